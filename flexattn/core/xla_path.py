"""The kernels as XLA custom calls: what the JAX adapter's ``cutlass_call`` launches need,
decided on the host while tracing.

The adapter lays out operands and results and calls ``cutlass_call``; everything about the
kernels is here: the forward plan (``plan_forward``, as every adapter's), the backward plan
(``backward_path.backward_config`` / ``backward_workspace``, as ``backward_into``'s), what
each capture of the kernel hook is (an array operand or a compile-time number), and the
hashable launch descriptions the compiled entries (``kernels/launch/xla_entry.py``) take.
"""

from __future__ import annotations

from ..arrays import dtype_name
from ..problem.spec import AttentionSpec
from ..problem.validate import AttentionShape
from .backward_path import backward_config, backward_workspace
from .kernel_path import plan_forward

KV_LISTS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
Q_LISTS = ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")
# The backward's scratch results (``XlaPlan.backward_workspace``: the config's, in entry order)
WORKSPACE = ("lse_log2", "delta", "dq_accum", "dq_semaphore")
FP32_SCRATCH = ("fp32_v", "fp32_q", "fp32_k")   # the fp32 forward's operands (``XlaPlan.fp32_scratch``)


def compile_options() -> str:
    """cutlass_call's ``compile_options``: the target arch (no device probe)."""
    from ..kernels.launch.compile import ARCH_OPTION

    return ARCH_OPTION


def forward_entry():
    from ..kernels.launch.xla_entry import forward_entry

    return forward_entry


def backward_entry():
    from ..kernels.launch.xla_entry import backward_entry

    return backward_entry


def decode_entry():
    from ..kernels.launch.xla_entry import decode_entry

    return decode_entry


def _sm_count(q) -> int | None:
    """The SM count of q's CUDA device, or None elsewhere (the adapter's CPU plumbing tests:
    short queries then keep the forward kernel)."""
    device_type, device_id = q.__dlpack_device__()
    if device_type != 2:
        return None
    from ..kernels.hopper.device_facts import sm_count

    return sm_count(device_id)


class XlaPlan:
    """One traced call's kernel decisions (raises what the kernels cannot do). ``config``
    is the capture-free template: the launch descriptions outlive the trace. ``decode``:
    for a short query on a CUDA device (``core/short_query.py``), the decode kernel's
    fixed launch that runs the forward instead; the backward is planned from the forward
    kernel's plan either way."""

    def __init__(self, q, shape: AttentionShape, spec: AttentionSpec, tf32_passes: int = 3):
        self.shape = shape
        self.plan = plan_forward(q, shape, spec, tf32_passes=tf32_passes)
        self.block_mask = self.plan.block_mask
        self.config = self.plan.entry.config if self.plan.entry is not None else self.plan.config
        self.scale = spec.resolved_scale(shape.head_dim)
        self.decode = None
        num_sms = _sm_count(q)
        if num_sms is not None:
            from .decode_path import fixed_length_launch
            from .short_query import decode_route

            route = decode_route(shape, spec, dtype_name(q))
            if route is not None:
                self.decode = fixed_length_launch((shape.batch, shape.q_heads, shape.q_len, shape.head_dim),
                                                  shape.kv_heads, shape.kv_len, dtype_name(q), route, num_sms)

    def captures(self, decode: bool = False) -> list:
        """[(kind, value, is_score)] per kernel-hook capture, in argument order: ``kind`` is
        ("scalar", "int32" | "float32") or ("buffer", dtype, ndim) (``capture_kinds``);
        ``decode``: of the decode kernel's hook."""
        from ..kernels.emit.mod_emit import capture_kinds

        hook = self.decode.hook if decode else self.plan.config.mods
        captures = hook.captures()
        n_score = len(captures) - len(hook.mask_args(captures))
        return [(kind, c, i < n_score) for i, (kind, c) in enumerate(zip(capture_kinds(hook), captures))]

    def decode_launch(self, main: tuple, args: tuple, fills: tuple):
        """``xla_entry.DecodeLaunch``: ``main`` the positions of q, k, v, seq_lens, out, lse,
        o_part, lse_part, tickets."""
        from ..kernels.launch.xla_entry import DecodeLaunch

        return DecodeLaunch(self.decode.config, self.scale, main, args, fills)

    def fp32_scratch(self) -> list:
        """[(name, shape)] of the fp32 forward's operand results (float32, contiguous; none
        for 16-bit inputs), one per ``fp32_operands.operand_passes``: V^T with its keys
        rounded up to 8, then with 3xTF32 Q's and K's (hi, lo) parts."""
        if self.config.dtype != "fp32":
            return []
        from ..kernels.fwd.fp32_operands import operand_passes, operand_shape

        s = self.shape
        inputs = {"q": (s.batch, s.q_heads, s.q_len, s.head_dim), "k": (s.batch, s.kv_heads, s.kv_len, s.head_dim),
                  "v": (s.batch, s.kv_heads, s.kv_len, s.v_head_dim)}
        return [(f"fp32_{source}", operand_shape(cfg, inputs[source])) for source, cfg in operand_passes(self.config)]

    def forward_launch(self, main: tuple, args: tuple, lists, fills: tuple, operands: tuple | None = None):
        """``xla_entry.ForwardLaunch``: ``main`` the positions of q, k, v, out, lse;
        ``operands`` those of ``fp32_scratch``'s results (fp32)."""
        from ..kernels.launch.xla_entry import ForwardLaunch

        return ForwardLaunch(self.config, self.scale, main, args, lists, fills, operands)

    def backward_config(self, grad_captures: tuple):
        """The (non-deterministic) backward config, gradients for ``grad_captures`` only; dQ
        by the postprocess (the XLA entry has no dq_finish launch yet)."""
        return backward_config(self.config, False, grad_captures, self.plan.backward_ctas, dq_finish=False)

    def backward_workspace(self, cfg) -> list:
        """[(name, shape, dtype name, divisibility of the last dims)] of the workspace results,
        in entry order: lse_log2, delta (rows padded to q_pad), dq_accum, and dq_first_store's
        tickets (one per q tile: no divisibility) where the config has them."""
        head_dim, pad = self.shape.head_dim, cfg.q_pad
        last = {"dq_accum": (head_dim, pad), "dq_semaphore": (1,)}
        return [(name, s, dtype, last.get(name, (pad,))) for name, s, dtype in backward_workspace(cfg, self.shape)]

    def backward_launch(self, cfg, main: tuple, workspace: tuple, args: tuple, grads: tuple, lists, fills: tuple):
        """``xla_entry.BackwardLaunch``: ``main`` the positions of q, k, v, out, d_out, lse,
        d_lse (None: absent), dq, dk, dv."""
        from ..kernels.launch.xla_entry import BackwardLaunch

        return BackwardLaunch(cfg, self.scale, main, workspace, args, grads, lists, fills)


__all__ = ["KV_LISTS", "Q_LISTS", "WORKSPACE", "XlaPlan", "backward_entry", "compile_options", "decode_entry",
           "forward_entry"]
