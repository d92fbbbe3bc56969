"""A zoo of traced mods covering every IR op and every built-in, for emitter tests.

Each entry: name -> factory(rng, S) returning (score mod or None, mask mod or None).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from flexattn import mods


def _every_float_op(s, b, h, q, kv):
    x = s * 0.25
    y = torch.where(q > kv, x.sigmoid() + (x * 2).exp2().log2(), torch.minimum(x, torch.tensor(0.5)))
    z = x.abs().sqrt() - (x.abs() + 1.0).rsqrt() + (x.abs() + 1.0).log() - torch.exp(-x.abs())
    w = torch.maximum(x.tanh(), (q - kv).float() / 7.0) + (x // 0.75) - (x % 0.75)
    return y + z * 0.5 + w.clamp(-3.0, 3.0) - (-x)


def _every_int_op(b, h, q, kv):
    a = (q * 3 - kv * 2 + h) // 4
    c = (q - kv) % 5
    d = torch.minimum(q, kv) + torch.maximum(q, kv) - (q - kv).abs()
    bits = ((q & 3) | (kv ^ 5)) != (~kv & 7)
    bits = bits | ((q >> 2) == (kv << 1)) | (torch.bitwise_right_shift(q - kv, 3) == (1 << (h & 3)) - 2)
    return ((a > c) ^ (d % 2 == 0)) | bits & ~(q == kv) | ((q.float() * 0.5).int() == kv // 2)


def _divmod_constants(b, h, q, kv):
    """Integer // and % by constants, lowered by the emitters (mods/optimize.py): powers of
    two (shift, mask) and others, on dividends of both signs and on indices (>= 0)."""
    d = q - kv
    signed = (d // 8 + d % 16 + d // 3 - d % 7 + (-d) // 64) % 4
    indices = (q // 64 - kv % 64 + q // 3 + kv % 6 + (q + kv) // 2) % 3
    return signed == indices


def _divide_by_constants(s, b, h, q, kv):
    """Division by constants becomes a reciprocal multiply (within 1 ulp)."""
    return s / 30.0 + s / 0.125 + ((q - kv) // 16).float() / 7.0 + (q // 5 % 7).float() - ((q - kv) % 3).float()


def _rewritten_torch_functions(s, b, h, q, kv):
    """torch functions the tracer writes with the IR's own ops (trunc division, fmod,
    isnan / isinf / isfinite, log1p, expm1, logaddexp, new_tensor)."""
    d = q - kv
    x = torch.logaddexp(s * 0.5, d * 0.1) + torch.log1p(d.abs() * 0.25) - torch.expm1(-(s * s) * 0.1)
    x = x + torch.div(d, 3, rounding_mode="trunc") * 0.1 + torch.fmod(d, 5) * 0.2 + torch.fmod(s, 0.5)
    x = torch.where(torch.isnan(s / d) | torch.isinf(1.0 / d) | ~torch.isfinite(x), s, x)
    return x * s.new_tensor(0.5) + torch.sin(d * 0.37) * torch.cos(s) + torch.erf(s * 0.3)


def _composed_torch_functions(s, b, h, q, kv):
    """mods/torch_functions.py's compositions: activations, inverse and hyperbolic
    trigonometry, rounding, traced powers (ALiBi's 2 ** (-8 (h + 1) / H) through torch.pow)."""
    d = (q - kv).float()
    x = F.gelu(s) + torch.atan(d * 0.3) + torch.atan2(d, s) * 0.5 + F.softplus(s, beta=2.0) - F.silu(s * 0.5)
    x = x + torch.asinh(d * 0.1) + torch.sinh(s * 0.25) - torch.cosh(s * 0.1) + torch.round(s) * 0.1
    x = x + torch.pow(2.0, -8.0 * (h + 1) / 4) * d + torch.hypot(s, d * 0.1) * 0.1 + F.leaky_relu(s, 0.1)
    x = x + torch.pow(d.abs() * 0.1 + 0.5, s * 0.1)   # the general power: NaN constants in its branches
    # (acos away from +-1, round of the score itself: no float32 / float64 disagreement there)
    return torch.where(torch.signbit(d), x, x + torch.acos(torch.tanh(s * 0.1) * 0.9) + torch.log10(d.abs() + 1.0))


def _vector_reductions(emb):
    """Reductions of vector reads (amax, logsumexp, norm: unrolled over the trailing dims),
    an integer base to a traced power (torch's integer result) and a constant made with
    the score's dtype."""
    def fn(s, b, h, q, kv):
        row, col = emb[h], emb[kv % 4]
        return (s + row.amax() * 0.1 + torch.logsumexp(col, dim=-1).mean() * 0.1 + col.norm() * 0.05
                + 2 ** (h % 3) + torch.minimum(s, torch.tensor(4.0, dtype=s.dtype)) * 0.1)
    return fn


def _affine_compares(b, h, q, kv):
    """Each compare form of an index kept as base + offset (affine_index.py), combined by
    xor so that every one of them shows in the result: |x| against a constant each way,
    residues modulo 2, 4 and 8 (as % and as &) with constants inside and outside [0, m),
    plain compares with the constant on either side, and a form inside a sum (its plain
    value: it is no row constant)."""
    d = q - kv
    return ((d.abs() <= 12) & (d % 2 == 0)) ^ ((kv - q).abs() < 7) ^ (d.abs() >= 20) ^ (d.abs() > 25) \
        ^ (d % 4 == 1) ^ ((kv - q) & 7 != 3) ^ (d % 2 == 5) ^ (d % 8 != -1) ^ (kv - q >= -9) \
        ^ (30 > d) ^ (kv + 3 - q == 4) ^ (d.abs() <= -1) ^ (kv + d.abs() <= 60)


def _affine_extremes(b, h, q, kv):
    """Constants whose shifted value leaves int32 (the plain form is kept) and the edges."""
    d = q - kv
    return (d <= 2147483647) ^ (kv - q > -2147483648) ^ (d.abs() < 2147483647) ^ (kv - 2147483647 < q)


def zoo(rng, S):
    ids = np.sort(rng.integers(0, 4, size=S)).astype(np.int64)
    table = torch.from_numpy(rng.standard_normal((4, 2 * 5 + 1)).astype(np.float32))
    bias = torch.from_numpy(rng.standard_normal((1, 4, S, S)).astype(np.float32)).to(torch.bfloat16)
    slopes = torch.from_numpy(rng.uniform(0.1, 1, 4).astype(np.float32))
    offsets = torch.tensor([0, S // 3, S // 2, S], dtype=torch.int32)
    doc = torch.from_numpy(np.searchsorted(offsets.numpy()[1:], np.arange(S), side="right")).int()
    prefix = torch.tensor([S // 3, S // 2], dtype=torch.int64)
    return {
        "causal": (None, mods.causal()),
        "causal_offset": (None, mods.causal(offset=int(rng.integers(1, 9)))),
        "sliding_window": (None, mods.sliding_window(int(rng.integers(1, S)), int(rng.integers(0, 4)))),
        "document": (None, mods.document(ids)),
        "document_offsets": (None, mods.document_from_lengths([S // 2, S // 4], length=S)),
        "prefix_lm": (None, mods.prefix_lm(prefix)),
        "nested_index": (None, mods.mask_mod(lambda b, h, q, kv: offsets[doc[q]] <= kv)),
        "every_int_op": (None, mods.mask_mod(_every_int_op)),
        "alibi": (mods.alibi(slopes), None),
        "softcap": (mods.softcap(float(rng.uniform(5, 30))), None),
        "relative_bias": (mods.relative_bias(table), None),
        "bias_bf16": (mods.bias(bias), None),
        "every_float_op": (mods.score_mod(_every_float_op), None),
        "divmod_constants": (mods.score_mod(_divide_by_constants), mods.mask_mod(_divmod_constants)),
        "rewritten_torch_functions": (mods.score_mod(_rewritten_torch_functions),
                                      mods.mask_mod(lambda b, h, q, kv: torch.fmod(q - kv, 7) != 3)),
        "composed_torch_functions": (mods.score_mod(_composed_torch_functions), None),
        "vector_reductions": (mods.score_mod(_vector_reductions(
            torch.from_numpy(rng.standard_normal((4, 4, 3)).astype(np.float32)))), None),
        # an index compared with constants (affine_index's compares: base against immediates)
        "affine_compares": (None, mods.mask_mod(_affine_compares)),
        "affine_extremes": (None, mods.mask_mod(_affine_extremes)),
        "combo": (mods.alibi(slopes) >> mods.softcap(20.0),
                  (mods.causal() & mods.sliding_window(S // 3)) | ~mods.document(ids)),
    }


def paged_zoo(rng, S, page=32):
    """Mods that read a buffer at kv // page (a converted PagedAttention mask's page map, a
    per-page bias): what ``tile_invariants`` hoists over tiles that ``page`` is a multiple of."""
    pages = -(-S // page)
    page_map = torch.from_numpy(rng.permutation(pages).astype(np.int64))[None].repeat(2, 1)
    page_map[1, rng.integers(0, pages)] = -1                       # a page no longer live
    lengths = torch.tensor([S - 3, S // 2], dtype=torch.int64)
    bias = torch.from_numpy(rng.standard_normal((2, pages)).astype(np.float32))

    def physical(b, h, q_idx, kv_idx):
        logical = page_map[b, kv_idx // page] * page + kv_idx % page
        return (page_map[b, kv_idx // page] >= 0) & (logical < lengths[b]) & (logical <= q_idx + 5)

    # ... walked through a block table (a short query's walk of listed blocks): the page
    # map read at the table's entry, a chain of two dependent loads per tile
    table = torch.from_numpy(rng.permutation(pages).astype(np.int32))[None].repeat(2, 1)

    def walked(b, h, q_idx, kv_idx):
        return (page_map[b, table[b, kv_idx // page]] >= 0) & (kv_idx <= q_idx + 5)

    return {
        "paged": (mods.score_mod(lambda s, b, h, q_idx, kv_idx: s + bias[b, kv_idx // page] * (h + 1)),
                  mods.mask_mod(physical)),
        "paged-walk": (mods.score_mod(lambda s, b, h, q_idx, kv_idx: s + bias[b, table[b, kv_idx // page]]),
                       mods.mask_mod(walked)),
    }
