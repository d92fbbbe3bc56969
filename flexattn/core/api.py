"""The functional API over any DLPack/array-protocol tensors.

Every call here runs the numpy reference on the host (the CPU path, any array). The GPU
kernels are reached through an adapter (``flexattn.torch``, ``.jax``, ``.cupy``, ``.dlpack``),
which allocates on the device and calls ``kernel_path`` / ``backward_path`` / ``decode_path``.
"""

from __future__ import annotations

import numpy as np

from .. import reference
from ..problem.decode import decode_problem
from ..problem.spec import AttentionSpec
from ..problem.validate import check_inputs


def flex_attention(q, k, v, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                   return_lse=False, *, mask=None, score=None, precision=np.float64):
    """Attention with mods on arrays [B, H, S, D]; returns numpy ``out`` (and ``lse``).

    Arguments follow ``torch.nn.attention.flex_attention`` plus ``mask=``/``score=`` for
    mod values. The result has the inputs' float dtype (bfloat16 comes back as float32,
    which numpy lacks); computation happens in ``precision``.
    """
    spec = AttentionSpec.from_args(score_mod, block_mask, scale, enable_gqa, mask, score)
    check_inputs(q, k, v, spec)
    out, lse = reference.forward(q, k, v, spec, dtype=precision)
    out_dtype = _result_dtype(q)
    out = out.astype(out_dtype)
    lse = lse.astype(np.float64 if out_dtype == np.float64 else np.float32)  # as torch does
    return (out, lse) if return_lse else out


def flex_attention_backward(q, k, v, d_out, d_lse=None, score_mod=None, block_mask=None, scale=None,
                            enable_gqa=False, *, mask=None, score=None, precision=np.float64):
    """Gradients (dq, dk, dv, d_captures) of flex_attention, see ``reference.backward``."""
    spec = AttentionSpec.from_args(score_mod, block_mask, scale, enable_gqa, mask, score)
    return reference.backward(q, k, v, d_out, d_lse, spec, dtype=precision)


def decode(q, cache, score_mod=None, mask=None, scale=None, return_lse=False, *, precision=np.float64):
    """Decoding step: ``q`` [B, Hq, q_len, D] (the last q_len tokens of each sequence, already
    appended) attends the valid part of ``cache`` (``KVCache``/``PagedKVCache``); mods see
    true positions. GQA is implicit (Hq a multiple of the cache's H_kv)."""
    k, v, spec = decode_problem(q, cache, score_mod, mask, scale)
    return flex_attention(q, k, v, score=spec.score, mask=spec.mask, scale=spec.scale,
                          enable_gqa=True, return_lse=return_lse, precision=precision)


def _result_dtype(x):
    name = str(x.dtype).replace("torch.", "")
    return {"float16": np.float16, "float64": np.float64}.get(name, np.float32)
