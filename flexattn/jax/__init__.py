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
- CUDA arrays: the CuTeDSL Hopper kernels (bf16/fp16, and float32 for the forward — tf32
  MMAs, 3xTF32 unless ``jax.default_matmul_precision`` allows tf32, operands made by the
  same entry; head dims: the forward any multiple of 16
  up to 256, value head dim apart; the backward query and value head dims from 32 to 256) through
  ``cutlass.jax.cutlass_call``: each launch (the forward; the backward's three kernels) is
  one XLA FFI custom call served by the CuTeDSL runtime's C handler, which calls a compiled
  ``@cute.jit`` entry (``kernels/launch/xla_entry.py``) with XLA's stream and buffers — no Python
  of ours (and no host round trip) when a jitted function runs. XLA allocates every array
  the kernels write (``out``/``lse``; ``dq``/``dk``/``dv``, the backward's fp32 workspace
  and the buffer gradients are results of the custom call — destination passing, no
  allocator of ours); buffer gradients, accumulated by fp32 atomics, are zero-filled by
  the entry itself before the backward's kernels (no result is aliased to an operand:
  XLA's dynamic-slice fusion in ``lax.scan``/``lax.map`` bodies hands an aliased call a
  result buffer other than its operand's, and the stacked results stayed zero — see
  ``kernels/launch/xla_entry.py``). Everything the kernels read from
  the host — block-mask lists, numpy arrays captured by mods — is a constant operand.
  Everything decided on the host (kernel support, block structure, the block mask of a
  ``mask=``, the kernel configs, the backward's workspace layout) is decided while tracing:
  errors surface at trace time, before anything compiles or runs. The entry compiles when
  the jitted function is lowered (cutlass_call's cache, keyed by a ``compile_key`` = the
  launch description, so lookups generate no IR), once per call structure *and shapes*;
  repeated calls, and new jitted functions of the same call, compile nothing.
  Buffer gradients: only the score buffers jax differentiates (``custom_vjp`` with
  symbolic zeros tells which) are computed — fixed ALiBi slopes cost the backward nothing.

GPU limits: a ``mask=`` (without ``block_mask``) whose captured jax arrays are traced
values cannot be turned into a block mask while tracing — build the ``BlockMask`` outside
``jit`` and pass ``block_mask=`` (its mask's captures may be traced); numpy captures must
have a dtype jax keeps (int64/float64 need ``jax_enable_x64``). Other dtypes or head dims
raise ``ValueError`` (put the arrays on the CPU for the exact reference). What cutlass_call
cannot express, and what we do instead: (1) it passes buffers only, no runtime scalars —
the softmax scale and numbers captured by mods (runtime kernel arguments elsewhere) are
compile-time constants of the entry, so a new scale or captured number compiles a new
entry (they were constants of the jax computation already; jax arrays never recompile);
(2) its compile cache is keyed by the operands' shapes — each new shape compiles the entry
again (seconds per entry: the forward, and the backward under ``grad``), although the
compiled entry reads every size at run time (divisibility hints are explicit, so the code
does not depend on them); (3) it has no batching rule — under ``vmap`` each element is one
call, in order (``jax.custom_batching.custom_vmap`` + ``lax.map``; folding the mapped axis
into the batch is faster); (4) results aliased to operands are lost in loop bodies (XLA's
dynamic-slice fusion, see ``kernels/launch/xla_entry.py``), so no result is aliased: the entry
fills what must start filled. Eager (un-jitted) calls lower a new small computation per
call: jit the caller.
"""

from __future__ import annotations

import os

import numpy as np

try:
    import jax
    import jax.custom_batching
    import jax.numpy as jnp
    from jax.custom_derivatives import SymbolicZero
except ImportError as e:  # pragma: no cover - exercised only without jax
    raise ImportError("flexattn.jax needs JAX: pip install jax (or 'flexattn[jax]')") from e

from .. import reference
from ..arrays import to_numpy
from ..blockmask import BlockMask, create_block_mask
from ..core import kernel_path, xla_path
from ..problem.spec import OPERAND, AttentionSpec, lse_dtype
from ..problem.validate import AttentionShape, check_inputs
from ..mods import MaskMod, ScoreMod, mask_mod, score_mod

__all__ = ["flex_attention", "create_block_mask", "BlockMask", "MaskMod", "ScoreMod", "mask_mod", "score_mod"]

# Platforms whose arrays run the kernels. Tests add "cpu" to run the kernel path's
# plumbing (operand layout, fills, gradients) on CPU arrays with cutlass_call faked.
_KERNEL_PLATFORMS = {"gpu", "cuda"}


def flex_attention(q, k, v, score_mod=None, block_mask=None, scale=None, enable_gqa=False, return_lse=False,
                   *, mask=None, score=None):
    """FlexAttention on jax arrays ``[B, H, S, D]``: returns ``out`` or ``(out, lse)``.

    Arguments as ``flexattn.torch.flex_attention`` (``score_mod``/``score``: a ``ScoreMod``
    or a function ``(score, b, h, q_idx, kv_idx)``; ``block_mask``: a ``flexattn.BlockMask``;
    ``mask``: a mask applied element-wise). ``out`` has the query's dtype; ``lse`` (natural
    log) is float32, float64 for float64 inputs. Differentiable w.r.t. ``q, k, v`` and the
    score mod's captured float jax arrays. CPU arrays run the exact reference, CUDA arrays
    the GPU kernels (bf16/fp16, float32 forward-only; the forward at head dims that are
    multiples of 16 up to 256, the backward from 32 too; block masks at any BLOCK_SIZE, 128 saving
    a conversion: ``blockmask/coarsen.py``).
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
    template_spec, score_bufs, mask_bufs = spec.template(_is_jax_array, masks=True)
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


def _is_jax_array(x) -> bool:
    """Captures that are operands of the call (the rest are trace-time constants)."""
    return isinstance(x, jax.Array)


def _is_float(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


# --- differentiation: one custom_vjp per call structure, backend-independent ---------------------

def _attention(backend):
    """A ``custom_vjp`` function of (q, k, v, score buffers, mask buffers) -> (out, lse).

    Symbolic zeros tell the backward which score buffers jax differentiates (``perturbed``)
    and which cotangents are absent (a loss of ``out`` alone has no ``lse`` cotangent)."""

    def forward(q, k, v, score_bufs, mask_bufs):
        # inside shard_map the results vary as the query does (a host callback's results
        # are typed invariant, whose cotangents autodiff would sum over the mesh axis)
        out, lse = backend.forward(q, k, v, score_bufs, mask_bufs)
        return _match_vma(out, q), _match_vma(lse, q)

    @jax.custom_vjp
    def attention(q, k, v, score_bufs, mask_bufs):
        return forward(q, k, v, score_bufs, mask_bufs)

    def attention_fwd(q, k, v, score_bufs, mask_bufs):
        # perturbed flags are static: they travel in the residuals' tree structure
        # (None / () are leafless), not as arrays.
        flags = tuple(() if b.perturbed and _is_float(b.value) else None for b in score_bufs)
        q, k, v = q.value, k.value, v.value
        score_bufs = tuple(b.value for b in score_bufs)
        mask_bufs = tuple(b.value for b in mask_bufs)
        backend.check_backward()   # differentiated: what the backward cannot do, before any launch
        out, lse = forward(q, k, v, score_bufs, mask_bufs)
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
        varying = _varying(q) | _varying(k) | _varying(v)      # the axes this call's work differs over
        dq, dk, dv = _summed_to(dq, q, varying), _summed_to(dk, k, varying), _summed_to(dv, v, varying)
        d_score = tuple(_summed_to(d, b, varying) for d, b in zip(d_score, score_bufs))
        return dq, dk, dv, d_score, tuple(_match_vma(_zero_cotangent(b), b) for b in mask_bufs)

    attention.defvjp(attention_fwd, attention_bwd, symbolic_zeros=True)
    return attention


def _match_vma(x, like):
    """``x`` typed as varying over the same ``shard_map`` mesh axes as ``like`` (a
    custom_vjp's cotangent must match its primal's type; results of the host callbacks and
    fresh zeros vary over none). Float0 zeros and arrays outside shard_map pass as they are."""
    if not isinstance(x, jax.Array):
        return x
    return _vary(x, _varying(like))


def _summed_to(grad, primal, varying: set):
    """A cotangent computed on each device (inside ``shard_map``: one device's part) as
    ``primal``'s type wants it: summed over the mesh axes the call's work varies over but
    ``primal`` does not (a replicated captured tensor gets every device's part), varying
    over the rest. Outside shard_map, unchanged."""
    if not isinstance(grad, jax.Array):
        return grad
    over = tuple(sorted(varying - _varying(primal)))
    if over:
        grad = jax.lax.psum(_vary(grad, varying), over)
    return _match_vma(grad, primal)


def _vary(x, axes: set):
    """``x`` typed as varying over ``axes`` too (values unchanged)."""
    missing = tuple(sorted(set(axes) - _varying(x)))
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)


def _varying(x) -> set:
    """The shard_map mesh axes ``x``'s type varies over (newer JAX: ``manual_axis_type``;
    earlier: ``vma``; none where JAX has no such types)."""
    if not hasattr(jax, "typeof"):
        return set()
    kind = jax.typeof(x)
    manual = getattr(kind, "manual_axis_type", None)
    if manual is not None:
        return set(manual.varying)
    return set(getattr(kind, "vma", None) or ())


def _zero_cotangent(x):
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, dtype=jax.dtypes.float0)


# --- CPU: the exact reference through pure_callback ----------------------------------------------

class _ReferenceBackend:
    """Forward and backward on the host, exact (``flexattn.reference``)."""

    def __init__(self, template_spec: AttentionSpec):
        self.spec = template_spec

    def check_backward(self) -> None:   # the reference differentiates everything
        pass

    def forward(self, q, k, v, score_bufs, mask_bufs):
        n_score = len(score_bufs)

        def host(q, k, v, *bufs):
            spec = self.spec.bind(bufs[:n_score], bufs[n_score:])
            out, lse = reference.forward(q, k, v, spec)
            return out.astype(q.dtype), lse.astype(lse_dtype(q))

        result = (jax.ShapeDtypeStruct(q.shape[:3] + v.shape[3:], q.dtype),
                  jax.ShapeDtypeStruct(q.shape[:3], jnp.dtype(lse_dtype(q))))
        return jax.pure_callback(host, result, q, k, v, *score_bufs, *mask_bufs, vmap_method="sequential")

    def backward(self, q, k, v, out, lse, d_out, d_lse, score_bufs, mask_bufs, wanted):
        n_score = len(score_bufs)
        slots = self.spec.operand_slots()
        d_out = jnp.zeros_like(out) if d_out is None else d_out
        d_lse = jnp.zeros_like(lse) if d_lse is None else d_lse

        def host(q, k, v, d_out, d_lse, *bufs):
            spec = self.spec.bind(bufs[:n_score], bufs[n_score:])
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


# --- GPU: the CuTeDSL kernels through cutlass_call (an XLA FFI custom call) -----------------------

def _cutlass_call():
    """``cutlass.jax.cutlass_call`` (tests replace this to run the plumbing on CPU)."""
    import cutlass.jax

    if not cutlass.jax.is_available():
        raise NotImplementedError("flexattn.jax on the GPU needs CuTeDSL's JAX extension (cutlass.jax) to be"
                                  " available with this jax")
    return cutlass.jax.cutlass_call


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


class _Operands:
    """The operands of one kernel call, in order, with the ``TensorSpec`` of each (layout
    hints for the compiled entry): inputs first; results are appended by ``_KernelBackend._call``."""

    def __init__(self):
        self.arrays, self.specs, self._by_id = [], [], {}

    def add(self, x, spec) -> int:
        self.arrays.append(x)
        self.specs.append(spec)
        return len(self.arrays) - 1

    def add_once(self, x, make, spec) -> int:
        """``make()`` as an operand, once per object ``x`` (numpy captures, block lists)."""
        i = self._by_id.get(id(x))
        if i is None:
            i = self._by_id[id(x)] = self.add(make(), spec)
        return i


def _bhsd_spec(x):
    """q, k, v, out and their gradients: 16-byte aligned, rows of D elements (the kernels'
    TMA boxes need 16-byte strides: every stride is a multiple of D)."""
    return _tensor_spec(x.ndim, 16, x.shape[-1])


def _tensor_spec(ndim: int, align: int, last: int = 1, before_last: int = 1):
    """Explicit divisibility hints (1 = none) so the compiled entry reads any size: without
    them cutlass_call would assume each dimension divisible by its traced extent."""
    from cutlass.jax import TensorSpec

    div = (1,) * (ndim - 2) + (before_last, last) if ndim >= 2 else (last,)
    return TensorSpec(divisibility=div, ptr_assumed_align=align)


def _sequential_vmap(call):
    """``call`` under ``jax.vmap`` as one call per element, in order (``custom_vmap`` +
    ``lax.map``; cutlass_call's primitive has no batching rule, and buffer_callback's
    ``vmap_method="sequential"`` did the same). Each element calls ``f`` again, so nested
    vmaps nest maps. (Its zeros on the GPU were the aliasing bug of kernels/launch/xla_entry.py.)"""

    @jax.custom_batching.custom_vmap
    def f(*ops):
        return call(*ops)

    @f.def_vmap
    def rule(axis_size, in_batched, *ops):
        def one(batched):
            it = iter(batched)
            return f(*(next(it) if b else x for x, b in zip(ops, in_batched)))

        out = jax.lax.map(one, [x for x, b in zip(ops, in_batched) if b])
        return out, jax.tree.map(lambda _: True, out)

    return f


class _KernelBackend:
    """Everything about one traced call on the GPU kernels that the host decides, decided
    while tracing: kernel support (errors before anything runs), the block mask (built
    here from a ``mask=``), the host arrays the kernels read (constant operands), the
    kernel configs and the backward's workspace layout. Each launch is one ``cutlass_call``
    of a ``kernels.launch.xla_entry`` entry: XLA runs the compiled entry from C."""

    # Tests set this: results the kernels must write entirely start NaN-filled (by the
    # entry, before its kernels), so an element a kernel fails to write shows.
    poison_outputs = False

    def __init__(self, template_spec: AttentionSpec, shape: AttentionShape, q: _ArrayFacts, mask_bufs):
        reason = kernel_unsupported_message(q, shape)
        if reason:
            raise ValueError(reason)
        self.cutlass_call = _cutlass_call()
        self._q = q
        self.spec = _with_host_block_mask(template_spec, shape, mask_bufs)
        self.shape = shape
        self.plan = xla_path.XlaPlan(q, shape, self.spec, _tf32_passes())  # raises what the kernel can't do

    def check_backward(self) -> None:
        reason = kernel_path.backward_unsupported(self.shape, self._q)
        if reason:
            raise ValueError(f"{reason} (CPU arrays run the exact reference for anything else)")

    def _hook_args(self, ops: _Operands, score_bufs, mask_bufs, decode: bool = False) -> tuple:
        """The kernel hook's args as sources (``xla_entry``): this call's jax arrays and
        numpy captures as operands, numbers as compile-time constants (``decode``: of the
        decode kernel's hook)."""
        bufs = (iter(_as_operands(mask_bufs)), iter(_as_operands(score_bufs)))
        sources = []
        for i, (kind, c, is_score) in enumerate(self.plan.captures(decode)):
            if c is OPERAND:
                if kind[0] != "buffer":
                    raise ValueError(f"flexattn.jax: a captured jax array is used as a number (capture {i});"
                                     " capture a Python number instead")
                x = next(bufs[is_score])
                sources.append(("array", ops.add(x, _tensor_spec(x.ndim, x.dtype.itemsize))))
            elif kind[0] == "scalar":
                sources.append((kind[1], int(c) if kind[1] == "int32" else float(c)))
            else:  # a numpy capture: a constant operand
                host = np.asarray(c)
                spec = _tensor_spec(max(host.ndim, 1), host.dtype.itemsize)
                sources.append(("array", ops.add_once(c, lambda c=c: _constant(c), spec)))
        return tuple(sources)

    def _lists(self, ops: _Operands, names) -> tuple | None:
        bm = self.plan.block_mask
        if bm is None:
            return None
        return tuple(ops.add_once(bm.list_array(n), lambda n=n: _constant(bm.list_array(n)),
                                  _tensor_spec(bm.list_array(n).ndim, 4)) for n in names)

    def _call(self, entry, make_launch, ops: _Operands, results, zeroed=()):
        """One cutlass_call: ``results`` = [(name, ShapeDtypeStruct, TensorSpec)], the
        entry's arrays after the inputs; ``make_launch(position, fills)`` gets each result's
        position among the entry's arrays and the (position, kind) of the results the entry
        fills before its kernels: none, or with ``poison_outputs`` every result but the
        workspace and the ``zeroed`` ones (the backward's launch zero-fills those itself).
        No result is aliased to an operand (see kernels/launch/xla_entry.py: XLA's dynamic-slice
        fusion in loop bodies loses what aliased results write)."""
        n_inputs = len(ops.arrays)
        position = {name: n_inputs + j for j, (name, _, _) in enumerate(results)}
        fills = tuple((position[n], "nan") for n, _, _ in results
                      if self.poison_outputs and n not in self._unpoisoned and n not in zeroed)
        launch = make_launch(position, fills)
        call = self.cutlass_call(
            entry, output_shape_dtype=tuple(sds for _, sds, _ in results), input_spec=tuple(ops.specs),
            output_spec=tuple(spec for _, _, spec in results), compile_options=xla_path.compile_options(),
            compile_key=launch.key, launch=launch,
            allow_cuda_graph=os.environ.get("FLEXATTN_JAX_CUDA_GRAPH", "1") == "1")
        return dict(zip((name for name, _, _ in results), _sequential_vmap(call)(*ops.arrays)))

    _unpoisoned = xla_path.WORKSPACE + xla_path.FP32_SCRATCH  # scratch: the kernels fill it

    def forward(self, q, k, v, score_bufs, mask_bufs):
        if self.plan.decode is not None:
            return self._short_query(q, k, v, score_bufs, mask_bufs)
        shape = self.shape
        ops = _Operands()
        main = [ops.add(x, _bhsd_spec(x)) for x in (q, k, v)]
        args = self._hook_args(ops, score_bufs, mask_bufs)
        # The band structure walks its blocks by arithmetic: no lists.
        lists = self._lists(ops, xla_path.KV_LISTS) if self.plan.config.block_sparse else None
        out = jax.ShapeDtypeStruct((shape.batch, shape.q_heads, shape.q_len, shape.v_head_dim), q.dtype)
        lse = jax.ShapeDtypeStruct((shape.batch, shape.q_heads, shape.q_len), jnp.float32)
        results = [("out", out, _bhsd_spec(out)), ("lse", lse, _tensor_spec(3, 4))]
        scratch = self.plan.fp32_scratch()   # float32: the operand pass's results, rows 16-byte aligned
        results += [(name, jax.ShapeDtypeStruct(s, jnp.float32), _tensor_spec(4, 16, 4 if name == "fp32_v" else s[-1]))
                    for name, s in scratch]
        tickets = self.plan.config.tile_tickets   # the tile tickets' counter: a result zeroed per call
        if tickets:
            results.append(("tile_tickets", jax.ShapeDtypeStruct((1,), jnp.int32), _tensor_spec(1, 4)))

        def launch(pos, fills):
            operands = tuple(pos[name] for name, _ in scratch) or None
            kv_lists = lists
            if tickets:
                kv_lists = (lists or ()) + (pos["tile_tickets"],)
                fills = tuple(fills) + ((pos["tile_tickets"], "zero"),)
            return self.plan.forward_launch(tuple(main) + (pos["out"], pos["lse"]), args, kv_lists, fills, operands)

        r = self._call(xla_path.forward_entry(), launch, ops, results, zeroed=("tile_tickets",))
        return r["out"], r["lse"]

    def _short_query(self, q, k, v, score_bufs, mask_bufs):
        """The forward of a short query through the decode kernel (``core/short_query.py``):
        every sequence's length is the key count (a constant operand); the splits'
        partials and the arrival tickets are scratch results."""
        shape, launch_ = self.shape, self.plan.decode
        ops = _Operands()
        main = [ops.add(x, _bhsd_spec(x)) for x in (q, k, v)]
        lengths = np.full(shape.batch, shape.kv_len, np.int32)
        main.append(ops.add_once(lengths, lambda: _constant(lengths), _tensor_spec(1, 4)))
        args = self._hook_args(ops, score_bufs, mask_bufs, decode=True)
        out = jax.ShapeDtypeStruct((shape.batch, shape.q_heads, shape.q_len, shape.head_dim), q.dtype)
        lse = jax.ShapeDtypeStruct((shape.batch, shape.q_heads, shape.q_len), jnp.float32)
        splits = launch_.num_splits
        o_part = jax.ShapeDtypeStruct((splits,) + out.shape, jnp.float32)
        lse_part = jax.ShapeDtypeStruct((splits,) + lse.shape, jnp.float32)
        tickets = jax.ShapeDtypeStruct((launch_.num_tickets,), jnp.int32)
        results = [("out", out, _bhsd_spec(out)), ("lse", lse, _tensor_spec(3, 4)),
                   ("o_part", o_part, _tensor_spec(5, 4, shape.head_dim)), ("lse_part", lse_part, _tensor_spec(4, 4)),
                   ("tickets", tickets, _tensor_spec(1, 4))]

        def launch(pos, fills):
            names = ("out", "lse", "o_part", "lse_part", "tickets")
            fills = tuple(f for f in fills if f[0] in (pos["out"], pos["lse"]))   # partials: scratch
            return self.plan.decode_launch(tuple(main) + tuple(pos[n] for n in names), args, fills)

        r = self._call(xla_path.decode_entry(), launch, ops, results, zeroed={"tickets"})
        return r["out"], r["lse"]

    def backward(self, q, k, v, out, lse, d_out, d_lse, score_bufs, mask_bufs, wanted):
        slots = self.spec.operand_slots()
        cfg = self.plan.backward_config(tuple(s for s, w in zip(slots, wanted) if w))
        if d_out is None:
            d_out = jnp.zeros_like(out)
        ops = _Operands()
        main = [ops.add(x, _bhsd_spec(x)) for x in (q, k, v, out, d_out)]
        main.append(ops.add(lse, _tensor_spec(3, 4)))
        main.append(None if d_lse is None else ops.add(d_lse, _tensor_spec(3, 4)))
        args = self._hook_args(ops, score_bufs, mask_bufs)
        lists = self._lists(ops, xla_path.Q_LISTS) if cfg.block_sparse else None
        results = [(n, jax.ShapeDtypeStruct(x.shape, x.dtype), _bhsd_spec(x)) for n, x in (("dq", q), ("dk", k), ("dv", v))]
        workspace = self.plan.backward_workspace(cfg)
        for name, s, dtype, last_dims in workspace:
            results.append((name, jax.ShapeDtypeStruct(s, jnp.dtype(dtype)), _tensor_spec(len(s), 16, *last_dims)))
        # Buffer gradients are accumulated (fp32 atomics): the launch zero-fills them first.
        by_slot = dict(zip(slots, score_bufs))
        grads = [(f"grad{s}", jax.ShapeDtypeStruct(tuple(by_slot[s].shape) or (1,), jnp.float32)) for s in cfg.mods.grad_slots]
        results += [(n, sds, _tensor_spec(len(sds.shape), 4)) for n, sds in grads]

        def launch(pos, fills):
            return self.plan.backward_launch(cfg, tuple(main) + tuple(pos[n] for n in ("dq", "dk", "dv")),
                                             tuple(pos[n] for n, _, _, _ in workspace), args,
                                             tuple(pos[n] for n, _ in grads), lists, fills)

        r = self._call(xla_path.backward_entry(), launch, ops, results, zeroed={n for n, _ in grads})
        d_score = tuple(r[f"grad{s}"].reshape(b.shape).astype(b.dtype) if f"grad{s}" in r else None
                        for s, b in zip(slots, score_bufs))
        return r["dq"], r["dk"], r["dv"], d_score


# jax.default_matmul_precision values that allow tf32 (one pass) for float32 inputs; any
# other (unset, "high", "bfloat16_3x", "highest", "float32") keeps float32's accuracy (3xTF32).
_TF32_PRECISIONS = ("default", "fastest", "tensorfloat32", "bfloat16")


def _tf32_passes() -> int:
    """tf32 MMAs per product for float32 inputs, from JAX's matmul precision setting."""
    precision = jax.config.jax_default_matmul_precision
    return 1 if precision is not None and str(precision).lower() in _TF32_PRECISIONS else 3


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
            or kernel_path.is_causal(mask)):
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
    bm = create_block_mask(template_spec.bind((), values).mask, *dims, BLOCK_SIZE=(128, kernel_path.TILE_N))
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
