"""JAX adapter: ``flexattn.jax.flex_attention`` under ``jax.jit`` and ``jax.grad``.

Arrays in, arrays out. Mods are traced when the calling function is traced (once per
``jit`` compilation); jax arrays a mod captures (closures, ``mods.alibi(slopes)``, ...)
become operands of the computation, so they may be traced values and a score mod's float
buffers receive gradients. numpy arrays and Python numbers captured by mods are constants
of the traced computation.

CPU: forward and backward run the exact numpy reference through ``jax.pure_callback``
(``flexattn.reference.forward/backward``), wrapped in a ``jax.custom_vjp``.

GPU (not implemented yet: CUDA arrays raise ``NotImplementedError``). The plan: register
the CuTeDSL forward (and later backward) as an XLA FFI custom call — ``jax.ffi.ffi_call``
with a target whose handler receives XLA's device buffers and ``cudaStream_t`` and calls
``flexattn.core.kernel_path.forward_into`` (destination-passing: XLA allocates ``out`` and
``lse``). The handler must be a C-ABI function: either a small C++ shim that calls the
cached, compiled CuTeDSL kernel's host entry (its function pointer exported by the compile
cache), or, as a first step, ``jax.experimental.buffer_callback`` (a Python callback that
gets device buffers and the stream, no host copies) around the same ``forward_into``.
Non-tensor state (IR, block-mask lists, scale) is baked per trace, as here; captured jax
arrays are extra operands. The ``custom_vjp`` structure below stays: only the two callbacks
change.
"""

from __future__ import annotations

import copy

import numpy as np

try:
    import jax
    import jax.numpy as jnp
except ImportError as e:  # pragma: no cover - exercised only without jax
    raise ImportError("flexattn.jax needs JAX: pip install jax (or 'flexattn[jax]')") from e

from . import reference
from .blockmask import BlockMask, create_block_mask
from .core.spec import AttentionSpec
from .core.validate import check_inputs
from .mods import MaskMod, ScoreMod, mask_mod, score_mod

__all__ = ["flex_attention", "create_block_mask", "BlockMask", "MaskMod", "ScoreMod", "mask_mod", "score_mod"]

_SLOT = object()  # a jax-array capture: an operand of the call


def flex_attention(q, k, v, score_mod=None, block_mask=None, scale=None, enable_gqa=False, return_lse=False,
                   *, mask=None, score=None):
    """FlexAttention on jax arrays ``[B, H, S, D]``: returns ``out`` or ``(out, lse)``.

    Arguments as ``flexattn.torch.flex_attention`` (``score_mod``/``score``: a ``ScoreMod``
    or a function ``(score, b, h, q_idx, kv_idx)``; ``block_mask``: a ``flexattn.BlockMask``;
    ``mask``: a mask applied element-wise). ``out`` has the query's dtype; ``lse`` (natural
    log) is float32, float64 for float64 inputs. Differentiable w.r.t. ``q, k, v`` and the
    score mod's captured float jax arrays.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, jax.Array):
            raise TypeError(f"{name} must be a jax array, got {type(x).__name__}")
    spec = AttentionSpec.from_args(score_mod, block_mask, scale, enable_gqa, mask, score)
    check_inputs(q, k, v, spec)
    _check_platform(q)
    template, score_bufs = _split(spec.score)
    mask_template, mask_bufs = _split(_mask_of(spec))
    template_spec = _with_mods(spec, template, mask_template)
    out, lse = _attention(template_spec)(q, k, v, tuple(score_bufs), tuple(mask_bufs))
    return (out, lse) if return_lse else out


def _check_platform(q):
    try:
        platforms = {d.platform for d in q.devices()}
    except Exception:  # a tracer: the computation's default backend decides
        platforms = {jax.default_backend()}
    if platforms - {"cpu"}:
        raise NotImplementedError(
            f"flexattn.jax runs on CPU arrays for now (got {sorted(platforms)}): the GPU path"
            " (an XLA FFI call into the CuTeDSL kernels) is planned, see flexattn/jax.py"
        )


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


def _lse_dtype(q):
    return jnp.float64 if q.dtype == jnp.float64 else jnp.float32


def _attention(template_spec):
    """A ``custom_vjp`` function of (q, k, v, score buffers, mask buffers) for one spec."""

    def forward_host(q, k, v, *bufs, n_score):
        spec = _bind(template_spec, bufs[:n_score], bufs[n_score:])
        out, lse = reference.forward(q, k, v, spec)
        return out.astype(q.dtype), lse.astype(np.float64 if q.dtype == np.float64 else np.float32)

    def backward_host(q, k, v, d_out, d_lse, *bufs, n_score):
        spec = _bind(template_spec, bufs[:n_score], bufs[n_score:])
        g = reference.backward(q, k, v, d_out, d_lse, spec)
        slots = [i for i, c in enumerate(template_spec.score.captures) if c is _SLOT] if n_score else []
        d_bufs = tuple(  # one per score buffer; int buffers get (discarded) float32 zeros
            np.zeros(bufs[j].shape, np.float32) if g.d_captures[i] is None else g.d_captures[i].astype(bufs[j].dtype)
            for j, i in enumerate(slots))
        return (g.dq.astype(q.dtype), g.dk.astype(k.dtype), g.dv.astype(v.dtype)) + d_bufs

    def forward(q, k, v, score_bufs, mask_bufs):
        result = (jax.ShapeDtypeStruct(q.shape[:3] + v.shape[3:], q.dtype),
                  jax.ShapeDtypeStruct(q.shape[:3], _lse_dtype(q)))
        host = lambda *a: forward_host(*a, n_score=len(score_bufs))  # noqa: E731
        return jax.pure_callback(host, result, q, k, v, *score_bufs, *mask_bufs, vmap_method="sequential")

    @jax.custom_vjp
    def attention(q, k, v, score_bufs, mask_bufs):
        return forward(q, k, v, score_bufs, mask_bufs)

    def attention_fwd(q, k, v, score_bufs, mask_bufs):
        return forward(q, k, v, score_bufs, mask_bufs), (q, k, v, score_bufs, mask_bufs)

    def attention_bwd(residuals, cotangents):
        q, k, v, score_bufs, mask_bufs = residuals
        d_out, d_lse = cotangents
        float_bufs = [jnp.issubdtype(b.dtype, jnp.inexact) for b in score_bufs]
        result = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v)) + tuple(
            jax.ShapeDtypeStruct(b.shape, b.dtype if f else jnp.float32) for b, f in zip(score_bufs, float_bufs))
        host = lambda *a: backward_host(*a, n_score=len(score_bufs))  # noqa: E731
        grads = jax.pure_callback(host, result, q, k, v, d_out, d_lse, *score_bufs, *mask_bufs, vmap_method="sequential")
        dq, dk, dv, *d_bufs = grads
        d_score = tuple(d if f else _zero_cotangent(b) for d, b, f in zip(d_bufs, score_bufs, float_bufs))
        return dq, dk, dv, d_score, tuple(_zero_cotangent(b) for b in mask_bufs)

    attention.defvjp(attention_fwd, attention_bwd)
    return attention


def _zero_cotangent(x):
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, dtype=jax.dtypes.float0)
