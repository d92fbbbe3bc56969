"""JAX adapter: ``flexattn.jax.flex_attention`` under ``jax.jit`` and ``jax.grad``.

Arrays in, arrays out. Mods are traced when the calling function is traced (once per
``jit`` compilation); jax arrays a mod captures (closures, ``mods.alibi(slopes)``, ...)
become operands of the computation, so they may be traced values and a score mod's float
buffers receive gradients. numpy arrays and Python numbers captured by mods are constants
of the traced computation.

One ``jax.custom_vjp`` per call structure (operands: q, k, v, the score mod's jax arrays,
the mask's jax arrays; residuals: those plus ``out`` and ``lse``), with two backends:

- CPU arrays: ``jax.pure_callback`` into the exact numpy reference
  (``flexattn.reference.forward/backward``).
- CUDA arrays: the CuTeDSL Hopper kernels (bf16/fp16, head dims 64/128) through
  ``jax.experimental.buffer_callback``. XLA allocates every array the kernels write
  (``out``/``lse``; ``dq``/``dk``/``dv``, the backward's fp32 workspace and the buffer
  gradients, which are results of the backward callback — destination passing, no
  allocator of ours, no host round trip) and runs the Python callback in stream order
  with device ``Buffer``s (DLPack, no strides: row-major) and its CUDA stream
  (``ExecutionContext.stream``). The callback calls ``core.kernel_path.forward_into`` /
  ``core.backward_path.backward_into`` on those buffers; the forward launches through
  TVM-FFI with its environment stream set to XLA's (``ffi_stream_scope``), the backward
  through ``from_dlpack`` with the stream passed explicitly. Everything the kernels read
  from the host — block-mask lists, numpy arrays captured by mods — is a constant operand
  of the call, so the callback copies nothing. Everything decided on the host (kernel
  support, block structure, the block mask of a ``mask=``, the backward's workspace
  layout) is decided while tracing: errors surface at trace time, before any launch.
  Buffer gradients: only the score buffers jax differentiates (``custom_vjp`` with
  symbolic zeros tells which) are computed — fixed ALiBi slopes cost the backward nothing.

GPU limits: a ``mask=`` (without ``block_mask``) whose captured jax arrays are traced
values cannot be turned into a block mask while tracing — build the ``BlockMask`` outside
``jit`` and pass ``block_mask=`` (its mask's captures may be traced); numpy captures must
have a dtype jax keeps (int64/float64 need ``jax_enable_x64``). Other dtypes or head dims
raise ``ValueError`` (put the arrays on the CPU for the exact reference).
"""

from __future__ import annotations

import copy

import numpy as np

try:
    import jax
    import jax.numpy as jnp
    from jax.custom_derivatives import SymbolicZero
except ImportError as e:  # pragma: no cover - exercised only without jax
    raise ImportError("flexattn.jax needs JAX: pip install jax (or 'flexattn[jax]')") from e
try:
    from jax.experimental.buffer_callback import Buffer as _Buffer, buffer_callback as _buffer_callback
except ImportError:  # pragma: no cover - an older jax: the CPU path still works
    _Buffer = _buffer_callback = None

from . import reference
from .arrays import dtype_name, to_numpy
from .blockmask import BlockMask, create_block_mask
from .core import kernel_path
from .core.spec import AttentionSpec
from .core.validate import AttentionShape, check_inputs
from .mods import MaskMod, ScoreMod, mask_mod, score_mod

__all__ = ["flex_attention", "create_block_mask", "BlockMask", "MaskMod", "ScoreMod", "mask_mod", "score_mod"]

_SLOT = object()  # a jax-array capture: an operand of the call

# Platforms whose arrays run the kernels. Tests add "cpu" to run the kernel path's
# plumbing (buffer_callback, operand layout, gradients) on CPU buffers with fake runners.
_KERNEL_PLATFORMS = {"gpu", "cuda"}


def flex_attention(q, k, v, score_mod=None, block_mask=None, scale=None, enable_gqa=False, return_lse=False,
                   *, mask=None, score=None):
    """FlexAttention on jax arrays ``[B, H, S, D]``: returns ``out`` or ``(out, lse)``.

    Arguments as ``flexattn.torch.flex_attention`` (``score_mod``/``score``: a ``ScoreMod``
    or a function ``(score, b, h, q_idx, kv_idx)``; ``block_mask``: a ``flexattn.BlockMask``;
    ``mask``: a mask applied element-wise). ``out`` has the query's dtype; ``lse`` (natural
    log) is float32, float64 for float64 inputs. Differentiable w.r.t. ``q, k, v`` and the
    score mod's captured float jax arrays. CPU arrays run the exact reference, CUDA arrays
    the GPU kernels (bf16/fp16, head dims 64/128; block masks with BLOCK_SIZE 128).
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, jax.Array):
            raise TypeError(f"{name} must be a jax array, got {type(x).__name__}")
    spec = AttentionSpec.from_args(score_mod, block_mask, scale, enable_gqa, mask, score)
    platform = _platform(q, k, v)
    # Checked as the computation will see them: under jit, traced and closed-over arrays
    # alike live on the computation's platform.
    facts = [_ArrayFacts(x, platform) for x in (q, k, v)]
    shape = check_inputs(*facts, spec)
    template, score_bufs = _split(spec.score)
    mask_template, mask_bufs = _split(_mask_of(spec))
    template_spec = _with_mods(spec, template, mask_template)
    if platform in _KERNEL_PLATFORMS:
        backend = _KernelBackend(template_spec, shape, facts[0], mask_bufs)
    elif platform == "cpu":
        backend = _ReferenceBackend(template_spec)
    else:
        raise NotImplementedError(f"flexattn.jax runs on CPU and CUDA arrays, got platform {platform!r}")
    out, lse = _attention(backend)(q, k, v, tuple(score_bufs), tuple(mask_bufs))
    return (out, lse) if return_lse else out


def _platform(*arrays) -> str:
    """Where the call runs: the computation's backend under a trace, else the arrays' own."""
    platforms = set()
    for x in arrays:
        try:
            platforms |= {d.platform for d in x.devices()}
        except Exception:  # a tracer: the computation's default backend decides
            return jax.default_backend()
    if len(platforms) != 1:
        raise ValueError(f"q, k and v must be on one platform, got {sorted(platforms)}")
    return platforms.pop()


def _mask_of(spec):
    return spec.block_mask.mask_mod if spec.block_mask is not None else spec.mask


def _split(mod):
    """(mod with jax-array captures replaced by slots, those arrays)."""
    if mod is None:
        return None, []
    arrays = [c for c in mod.captures if isinstance(c, jax.Array)]
    if not arrays:
        return mod, []
    return mod.with_captures(tuple(_SLOT if isinstance(c, jax.Array) else c for c in mod.captures)), arrays


def _fill(mod, values):
    if mod is None or not values:
        return mod
    it = iter(values)
    return mod.with_captures(tuple(next(it) if c is _SLOT else c for c in mod.captures))


def _with_mods(spec, score, mask):
    if spec.block_mask is None:
        return AttentionSpec(score, mask, None, spec.scale, spec.enable_gqa)
    bm = spec.block_mask
    if mask is not bm.mask_mod:
        bm = copy.copy(bm)
        bm.mask_mod = mask
    return AttentionSpec(score, None, bm, spec.scale, spec.enable_gqa)


def _bind(template_spec, score_values, mask_values):
    return _with_mods(template_spec, _fill(template_spec.score, score_values), _fill(_mask_of(template_spec), mask_values))


def _score_slots(template_spec) -> list:
    """Score-capture slot of each score operand (the jax arrays, in capture order)."""
    if template_spec.score is None:
        return []
    return [i for i, c in enumerate(template_spec.score.captures) if c is _SLOT]


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


# --- differentiation: one custom_vjp per call structure, backend-independent ---------------------

def _attention(backend):
    """A ``custom_vjp`` function of (q, k, v, score buffers, mask buffers) -> (out, lse).

    Symbolic zeros tell the backward which score buffers jax differentiates (``perturbed``)
    and which cotangents are absent (a loss of ``out`` alone has no ``lse`` cotangent)."""

    @jax.custom_vjp
    def attention(q, k, v, score_bufs, mask_bufs):
        return backend.forward(q, k, v, score_bufs, mask_bufs)

    def attention_fwd(q, k, v, score_bufs, mask_bufs):
        # perturbed flags are static: they travel in the residuals' tree structure
        # (None / () are leafless), not as arrays.
        flags = tuple(() if b.perturbed and _is_float(b.value) else None for b in score_bufs)
        q, k, v = q.value, k.value, v.value
        score_bufs = tuple(b.value for b in score_bufs)
        mask_bufs = tuple(b.value for b in mask_bufs)
        out, lse = backend.forward(q, k, v, score_bufs, mask_bufs)
        return (out, lse), (q, k, v, out, lse, score_bufs, mask_bufs, flags)

    def attention_bwd(residuals, cotangents):
        q, k, v, out, lse, score_bufs, mask_bufs, flags = residuals
        d_out, d_lse = (None if isinstance(c, SymbolicZero) else c for c in cotangents)
        wanted = tuple(f is not None for f in flags)
        if d_out is None and d_lse is None:
            d_score = (None,) * len(score_bufs)
            dq, dk, dv = jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
        else:
            dq, dk, dv, d_score = backend.backward(q, k, v, out, lse, d_out, d_lse, score_bufs, mask_bufs, wanted)
        d_score = tuple(_zero_cotangent(b) if d is None or not w else d
                        for d, b, w in zip(d_score, score_bufs, wanted))
        return dq, dk, dv, d_score, tuple(_zero_cotangent(b) for b in mask_bufs)

    attention.defvjp(attention_fwd, attention_bwd, symbolic_zeros=True)
    return attention


def _zero_cotangent(x):
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, dtype=jax.dtypes.float0)


def _lse_dtype(q):
    return jnp.float64 if q.dtype == jnp.float64 else jnp.float32


# --- CPU: the exact reference through pure_callback ----------------------------------------------

class _ReferenceBackend:
    """Forward and backward on the host, exact (``flexattn.reference``)."""

    def __init__(self, template_spec: AttentionSpec):
        self.spec = template_spec

    def forward(self, q, k, v, score_bufs, mask_bufs):
        n_score = len(score_bufs)

        def host(q, k, v, *bufs):
            spec = _bind(self.spec, bufs[:n_score], bufs[n_score:])
            out, lse = reference.forward(q, k, v, spec)
            return out.astype(q.dtype), lse.astype(np.float64 if q.dtype == np.float64 else np.float32)

        result = (jax.ShapeDtypeStruct(q.shape[:3] + v.shape[3:], q.dtype),
                  jax.ShapeDtypeStruct(q.shape[:3], _lse_dtype(q)))
        return jax.pure_callback(host, result, q, k, v, *score_bufs, *mask_bufs, vmap_method="sequential")

    def backward(self, q, k, v, out, lse, d_out, d_lse, score_bufs, mask_bufs, wanted):
        n_score = len(score_bufs)
        slots = _score_slots(self.spec)
        d_out = jnp.zeros_like(out) if d_out is None else d_out
        d_lse = jnp.zeros_like(lse) if d_lse is None else d_lse

        def host(q, k, v, d_out, d_lse, *bufs):
            spec = _bind(self.spec, bufs[:n_score], bufs[n_score:])
            g = reference.backward(q, k, v, d_out, d_lse, spec)
            d_bufs = tuple(  # one per score buffer; int buffers get (discarded) float32 zeros
                np.zeros(bufs[j].shape, np.float32) if g.d_captures[i] is None else g.d_captures[i].astype(bufs[j].dtype)
                for j, i in enumerate(slots))
            return (g.dq.astype(q.dtype), g.dk.astype(k.dtype), g.dv.astype(v.dtype)) + d_bufs

        result = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)) + tuple(
            jax.ShapeDtypeStruct(b.shape, b.dtype if _is_float(b) else jnp.float32) for b in score_bufs)
        dq, dk, dv, *d_bufs = jax.pure_callback(host, result, q, k, v, d_out, d_lse, *score_bufs, *mask_bufs,
                                                vmap_method="sequential")
        return dq, dk, dv, tuple(d if _is_float(b) else None for d, b in zip(d_bufs, score_bufs))


# --- GPU: the CuTeDSL kernels through buffer_callback --------------------------------------------

_KV_LISTS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
_Q_LISTS = ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


class _ArrayFacts:
    """What the checks and the kernel planner read of an array (dtype, shape, DLPack
    device), on the platform the call runs on — for arrays that may be tracers."""

    def __init__(self, x, platform: str):
        self.dtype, self.shape = x.dtype, tuple(x.shape)
        if platform not in ("gpu", "cuda"):  # the CPU reference, or the plumbing tests on CPU
            self._device = (1, 0)
        else:
            try:
                (device,) = x.devices()
            except Exception:  # a tracer: the default device (SM counts are alike on one host)
                device = jax.devices()[0]
            self._device = (2, int(getattr(device, "local_hardware_id", None) or 0))

    def __dlpack_device__(self):
        return self._device


class _KernelBackend:
    """Everything about one traced call on the GPU kernels that the host decides, decided
    while tracing: kernel support (errors before anything runs), the block mask (built
    here from a ``mask=``), the host arrays the kernels read (constant operands), and the
    backward's workspace layout. The callbacks bind this call's device buffers and launch."""

    def __init__(self, template_spec: AttentionSpec, shape: AttentionShape, q: _ArrayFacts, mask_bufs):
        if _buffer_callback is None:
            raise NotImplementedError("flexattn.jax on the GPU needs a jax with jax.experimental.buffer_callback")
        reason = kernel_unsupported_message(q, shape)
        if reason:
            raise ValueError(reason)
        self.spec = _with_host_block_mask(template_spec, shape, mask_bufs)
        self.shape = shape
        self.on_gpu = q.__dlpack_device__()[0] == 2
        self.plan = kernel_path.plan_forward(q, shape, self.spec)  # raises what the kernel can't do
        self._host = {}  # block-list names -> (host objects, their jax constants)

    # Host arrays the kernels read, as constant operands: the callback's to_device maps each
    # object (by identity: the spec holds them alive) to its device buffer.
    def _host_arrays(self, list_names) -> tuple:
        key = tuple(list_names)
        hit = self._host.get(key)
        if hit is None:
            objs = [c for c in self.plan.config.mods.captures() if isinstance(c, np.ndarray)]
            if self.plan.block_mask is not None:
                objs += [getattr(self.plan.block_mask, n) for n in list_names]
            unique = list({id(o): o for o in objs}.values())
            hit = self._host[key] = (unique, tuple(_constant(o) for o in unique))
        return hit

    def _binder(self, n_score: int, n_mask: int, host_objs):
        """bufs (score, mask, host constants) -> (this call's spec, to_device)."""

        def bind(bufs):
            score, mask, host = bufs[:n_score], bufs[n_score:n_score + n_mask], bufs[n_score + n_mask:]
            table = {id(o): b for o, b in zip(host_objs, host)}

            def to_device(x):
                if isinstance(x, _Buffer):
                    return x
                try:
                    return table[id(x)]
                except KeyError:
                    raise RuntimeError(f"flexattn.jax: the kernel asked for a host array ({type(x).__name__}"
                                       f" {getattr(x, 'shape', '')}) that is not an operand of the call") from None

            return _bind(self.spec, score, mask), to_device

        return bind

    def _device(self, ctx, to_device):
        stream = int(ctx.stream) if self.on_gpu else 0
        return kernel_path.Device(stream, to_device)

    def forward(self, q, k, v, score_bufs, mask_bufs):
        shape = self.shape
        host_objs, host_consts = self._host_arrays(_KV_LISTS)
        bind = self._binder(len(score_bufs), len(mask_bufs), host_objs)

        def callback(ctx, results, q, k, v, *bufs):
            out, lse = results
            spec, to_device = bind(bufs)
            kernel_path.forward_into(q, k, v, out, lse, shape, spec, self._device(ctx, to_device))

        result = (jax.ShapeDtypeStruct((shape.batch, shape.q_heads, shape.q_len, shape.v_head_dim), q.dtype),
                  jax.ShapeDtypeStruct((shape.batch, shape.q_heads, shape.q_len), jnp.float32))
        call = _buffer_callback(callback, result, vmap_method="sequential")
        return tuple(call(q, k, v, *_as_operands(score_bufs), *_as_operands(mask_bufs), *host_consts))

    def backward(self, q, k, v, out, lse, d_out, d_lse, score_bufs, mask_bufs, wanted):
        from .core.backward_path import BackwardArrays, backward_into
        from .kernels.bwd_runner import config_from_forward, workspace_dtypes, workspace_shapes

        shape = self.shape
        slots = _score_slots(self.spec)
        grad_captures = tuple(s for s, w in zip(slots, wanted) if w)
        # The layout backward_into will ask its allocator for: the workspace, then one
        # zeroed fp32 gradient per differentiated buffer (kernels/bwd_runner.py).
        mods = self.plan.config.mods.with_grad_filter(grad_captures)
        cfg = config_from_forward(self.plan.config, deterministic=False, mods=mods)
        workspace = [(tuple(s), workspace_dtypes(cfg)[name])
                     for name, s in workspace_shapes(cfg, shape.batch, shape.q_heads, shape.q_len).items()]
        by_slot = dict(zip(slots, score_bufs))
        grad_shapes = [tuple(by_slot[s].shape) or (1,) for s in cfg.mods.grad_slots]
        host_objs, host_consts = self._host_arrays(_Q_LISTS)
        bind = self._binder(len(score_bufs), len(mask_bufs), host_objs)
        has_d_lse = d_lse is not None
        if d_out is None:
            d_out = jnp.zeros_like(out)
        n_inputs = 6 + has_d_lse + len(score_bufs) + len(mask_bufs) + len(host_consts)

        def callback(ctx, results, q, k, v, out, lse, d_out, *rest):
            d_lse = rest[0] if has_d_lse else None
            bufs = rest[has_d_lse:len(rest) - len(grad_shapes)]
            dq, dk, dv, *scratch = results
            spec, to_device = bind(bufs)
            alloc = _ResultAllocator(scratch, zeroed_from=len(workspace))
            arrays = BackwardArrays(q=q, k=k, v=v, out=out, lse=lse, d_out=d_out, dq=dq, dk=dk, dv=dv, d_lse=d_lse)
            backward_into(arrays, shape, spec, self._device(ctx, to_device), alloc, grad_captures=grad_captures)
            alloc.check_used()

        result = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
        result += tuple(jax.ShapeDtypeStruct(s, jnp.dtype(d)) for s, d in workspace)
        result += tuple(jax.ShapeDtypeStruct(s, jnp.float32) for s in grad_shapes)
        # Gradients are accumulated (fp32 atomics) into zeroed arrays: zeros operands
        # aliased to those results, so XLA hands the callback zero-filled buffers.
        zeros = tuple(jnp.zeros(s, jnp.float32) for s in grad_shapes)
        aliases = {n_inputs + i: 3 + len(workspace) + i for i in range(len(zeros))}
        call = _buffer_callback(callback, result, vmap_method="sequential", input_output_aliases=aliases)
        operands = (q, k, v, out, lse, d_out) + ((d_lse,) if has_d_lse else ())
        dq, dk, dv, *rest = call(*operands, *_as_operands(score_bufs), *_as_operands(mask_bufs), *host_consts, *zeros)
        grads = dict(zip(cfg.mods.grad_slots, rest[len(workspace):]))
        d_score = tuple(grads[s].reshape(b.shape).astype(b.dtype) if s in grads else None
                        for s, b in zip(slots, score_bufs))
        return dq, dk, dv, d_score


def kernel_unsupported_message(q, shape: AttentionShape) -> str | None:
    """Why the GPU kernels cannot run these inputs (as the torch adapter says it), or None."""
    reason = kernel_path.kernel_unsupported(q, shape)
    if reason:
        return f"{reason} (CPU arrays run the exact reference for anything else)"
    return None


def _with_host_block_mask(template_spec: AttentionSpec, shape: AttentionShape, mask_bufs) -> AttentionSpec:
    """The spec with the block mask the kernel will use made explicit: a ``mask=`` (other
    than the kernel's built-in causal) becomes a block mask built now, on the host, from the
    mask's captured values — so the callbacks only read lists fixed at trace time. The
    mask's jax captures stay operands (partial tiles evaluate the mask with them)."""
    mask = template_spec.mask
    if (template_spec.block_mask is not None or mask is None or kernel_path._is_full(mask)
            or kernel_path._is_builtin_causal(mask)):
        return template_spec
    try:
        values = [_host_value(b) for b in mask_bufs]
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        raise ValueError(
            "on the GPU, mask= needs its captured jax arrays' values while tracing (to build the block"
            " mask), but they are traced (e.g. jit arguments): build a block mask outside jit with"
            " flexattn.jax.create_block_mask(mask, B, H, Q_LEN, KV_LEN, BLOCK_SIZE=128) and pass"
            " block_mask= (its mask may capture traced arrays), or capture numpy arrays"
        ) from None
    deps = mask.depends_on
    dims = (shape.batch if "b" in deps else None, shape.q_heads if "h" in deps else None, shape.q_len, shape.kv_len)
    bm = create_block_mask(_fill(mask, values), *dims, BLOCK_SIZE=(128, kernel_path.TILE_N))
    bm.mask_mod = mask  # the template: this call's captures are bound at run time
    return AttentionSpec(template_spec.score, None, bm, template_spec.scale, template_spec.enable_gqa)


def _host_value(x) -> np.ndarray:
    arr = np.array(x)  # a concrete jax array (raises for tracers)
    arr.flags.writeable = False
    return arr


def _constant(x):
    """A host array (numpy capture, block-mask list) as a jax constant of the same dtype
    (0-d as [1], as kernels take captures)."""
    arr = np.ascontiguousarray(to_numpy(x))
    const = jnp.asarray(arr.reshape(1) if arr.ndim == 0 else arr)
    if const.dtype != arr.dtype:
        raise ValueError(
            f"a captured numpy array of dtype {arr.dtype} would become {const.dtype} in jax (jax_enable_x64 is"
            f" off); capture it as {const.dtype} (e.g. arr.astype(np.{const.dtype})) or enable x64"
        )
    return const


def _as_operands(bufs) -> tuple:
    """Captured jax arrays as callback operands: 0-d ones as [1], as the kernels take them."""
    return tuple(b.reshape(1) if b.ndim == 0 else b for b in bufs)


class _ResultAllocator:
    """``backward_into``'s allocator over the callback's extra results: the workspace
    arrays first, then the (zero-filled, aliased) buffer gradients, in the order the
    backward asks for them — checked, since a mismatch would misread memory."""

    def __init__(self, buffers, zeroed_from: int):
        self._buffers, self._zeroed_from, self._next = list(buffers), zeroed_from, 0

    def __call__(self, shape, dtype, zeroed):
        i = self._next
        if i >= len(self._buffers):
            raise RuntimeError("flexattn.jax: the backward asked for more scratch arrays than were planned")
        buf = self._buffers[i]
        if tuple(buf.shape) != tuple(shape) or dtype_name(buf) != dtype or zeroed != (i >= self._zeroed_from):
            raise RuntimeError(f"flexattn.jax: scratch array {i} planned as {tuple(buf.shape)} {dtype_name(buf)}"
                               f" (zeroed={i >= self._zeroed_from}), asked for {tuple(shape)} {dtype} (zeroed={zeroed})")
        self._next += 1
        return buf

    def check_used(self):
        if self._next != len(self._buffers):
            raise RuntimeError(f"flexattn.jax: planned {len(self._buffers)} scratch arrays, the backward used {self._next}")

