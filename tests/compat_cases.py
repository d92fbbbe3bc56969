"""The torch FlexAttention calls a port to ``flexattn.torch`` must run unchanged (issue 25):
each case is torch-style code — functions with torch ops, torch's helpers, torch's keyword
arguments — written once and called with either library's ``flex_attention`` and
``create_block_mask`` (``lib`` below). ``tests/test_torch_compat.py`` compares the two on the
CPU; ``tests/gpu/test_torch_compat_gpu.py`` runs ours on the GPU against the float64
reference.

A case is ``make(lib, device, dtype) -> call``: ``call()`` returns the output (or ``(out,
aux)``); ``outputs`` runs one and lists its tensors.
"""

from __future__ import annotations

import math
import types

import torch
import torch.nn.functional as F

B, H, S, D = 2, 4, 96, 32


def libraries():
    """torch's and ours, as two namespaces with the same names."""
    import torch.nn.attention.flex_attention as torch_flex

    import flexattn.torch as ours

    def torch_ns():
        return types.SimpleNamespace(name="torch", flex_attention=torch_flex.flex_attention,
                                     create_block_mask=torch_flex.create_block_mask, and_masks=torch_flex.and_masks,
                                     or_masks=torch_flex.or_masks, noop_mask=torch_flex.noop_mask,
                                     AuxRequest=torch_flex.AuxRequest)

    def ours_ns():
        return types.SimpleNamespace(name="flexattn", flex_attention=ours.flex_attention,
                                     create_block_mask=ours.create_block_mask, and_masks=ours.and_masks,
                                     or_masks=ours.or_masks, noop_mask=ours.noop_mask, AuxRequest=ours.AuxRequest)

    return torch_ns(), ours_ns()


def _qkv(device, dtype, q_len=S, kv_len=S, hq=H, hkv=H, d=D, dv=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, hq, q_len, d, generator=g, dtype=torch.float64)
    k = torch.randn(B, hkv, kv_len, d, generator=g, dtype=torch.float64)
    v = torch.randn(B, hkv, kv_len, dv or d, generator=g, dtype=torch.float64)
    return [t.to(device=device, dtype=dtype) for t in (q, k, v)]


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def case_causal_lambda(lib, device, dtype):
    q, k, v = _qkv(device, dtype)
    bm = lib.create_block_mask(causal, None, None, S, S, device=device)
    return lambda: lib.flex_attention(q, k, v, block_mask=bm)


def case_sliding_window_and_masks(lib, device, dtype):
    q, k, v = _qkv(device, dtype)

    def near(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= 24

    mask = lib.and_masks(causal, near)
    bm = lib.create_block_mask(mask, None, None, S, S, device=device)
    return lambda: lib.flex_attention(q, k, v, block_mask=bm)


def case_prefix_or_causal(lib, device, dtype):
    q, k, v = _qkv(device, dtype)
    prefix = torch.tensor([10, 40], device=device)

    def in_prefix(b, h, q_idx, kv_idx):
        return kv_idx < prefix[b]

    mask = lib.or_masks(causal, in_prefix)
    bm = lib.create_block_mask(mask, B, None, S, S, device=device)
    return lambda: lib.flex_attention(q, k, v, block_mask=bm)


def case_bit_shifts(lib, device, dtype):
    q, k, v = _qkv(device, dtype)

    def morton_blocks(b, h, q_idx, kv_idx):
        return ((q_idx >> 4) == (kv_idx >> 4)) | (torch.bitwise_right_shift(q_idx - kv_idx, 3) == 1)

    bm = lib.create_block_mask(morton_blocks, None, None, S, S, device=device)
    return lambda: lib.flex_attention(q, k, v, block_mask=bm)


def case_softcap_division(lib, device, dtype):
    q, k, v = _qkv(device, dtype)

    def softcap(score, b, h, q_idx, kv_idx):
        return 20 * torch.tanh(score / 20)

    bm = lib.create_block_mask(causal, None, None, S, S, device=device)
    return lambda: lib.flex_attention(q, k, v, score_mod=softcap, block_mask=bm)


def case_alibi_tensor(lib, device, dtype):
    q, k, v = _qkv(device, dtype)
    slopes = torch.linspace(0.1, 0.8, H, dtype=torch.float64, device=device)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + slopes[h] * (kv_idx - q_idx)

    return lambda: lib.flex_attention(q, k, v, score_mod=alibi)


def case_rotary_dot(lib, device, dtype):
    q, k, v = _qkv(device, dtype)
    g = torch.Generator().manual_seed(4)
    q_emb = (0.3 * torch.randn(B, H, S, 4, generator=g, dtype=torch.float64)).to(device)
    k_emb = (0.3 * torch.randn(B, H, S, 4, generator=g, dtype=torch.float64)).to(device)

    def bias(score, b, h, q_idx, kv_idx):
        return score + torch.dot(q_emb[b, h, q_idx], k_emb[b, h, kv_idx])

    return lambda: lib.flex_attention(q, k, v, score_mod=bias)


def case_documents_tensor(lib, device, dtype):
    q, k, v = _qkv(device, dtype)
    doc = torch.repeat_interleave(torch.arange(3), torch.tensor([20, 50, S - 70])).to(device)

    def same_doc(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    bm = lib.create_block_mask(same_doc, None, None, S, S, device=device)
    return lambda: lib.flex_attention(q, k, v, block_mask=bm)


def case_documents_block_size_64(lib, device, dtype):
    """A block mask at BLOCK_SIZE 64 (96 tokens: a partial last block), its mask reading a
    tensor: ours runs it on the kernels' 128 x 128 tiles (blockmask/coarsen.py)."""
    q, k, v = _qkv(device, dtype, seed=3)
    doc = torch.repeat_interleave(torch.arange(3), torch.tensor([20, 50, S - 70])).to(device)

    def same_doc_causal(b, h, q_idx, kv_idx):
        return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

    bm = lib.create_block_mask(same_doc_causal, None, None, S, S, device=device, BLOCK_SIZE=64)
    return lambda: lib.flex_attention(q, k, v, block_mask=bm)


def case_gqa_causal(lib, device, dtype):
    q, k, v = _qkv(device, dtype, hq=8, hkv=2)
    bm = lib.create_block_mask(causal, None, None, S, S, device=device)
    return lambda: lib.flex_attention(q, k, v, block_mask=bm, enable_gqa=True)


def case_q_len_differs(lib, device, dtype):
    q, k, v = _qkv(device, dtype, q_len=40, kv_len=S)
    bm = lib.create_block_mask(causal, None, None, 40, S, device=device)
    return lambda: lib.flex_attention(q, k, v, block_mask=bm)


def case_value_head_dim_differs(lib, device, dtype):
    q, k, v = _qkv(device, dtype, d=32, dv=64)
    return lambda: lib.flex_attention(q, k, v, scale=0.2)


def case_head_dim_96(lib, device, dtype):
    q, k, v = _qkv(device, dtype, d=96)
    bm = lib.create_block_mask(causal, None, None, S, S, device=device)
    return lambda: lib.flex_attention(q, k, v, block_mask=bm)


def case_return_aux_lse(lib, device, dtype):
    q, k, v = _qkv(device, dtype)
    bm = lib.create_block_mask(causal, None, None, S, S, device=device)
    return lambda: lib.flex_attention(q, k, v, block_mask=bm, return_aux=lib.AuxRequest(lse=True))


def case_noop_mask_with_score(lib, device, dtype):
    q, k, v = _qkv(device, dtype)

    def rel(score, b, h, q_idx, kv_idx):
        return score - 0.01 * (q_idx - kv_idx).abs()

    bm = lib.create_block_mask(lib.noop_mask, None, None, S, S, device=device)
    return lambda: lib.flex_attention(q, k, v, score_mod=rel, block_mask=bm)


def case_alibi_slopes_by_torch_pow(lib, device, dtype):
    """ALiBi with its slopes computed inside the function from the traced head index."""
    q, k, v = _qkv(device, dtype)

    def alibi(score, b, h, q_idx, kv_idx):
        return score + torch.pow(2, -8.0 * (h + 1) / H) * (kv_idx - q_idx)

    bm = lib.create_block_mask(causal, None, None, S, S, device=device)
    return lambda: lib.flex_attention(q, k, v, score_mod=alibi, block_mask=bm)


def case_t5_relative_buckets(lib, device, dtype):
    """T5's bucketed relative positions (log-spaced beyond 8) indexing a learned table."""
    q, k, v = _qkv(device, dtype)
    table = (0.5 * torch.randn(H, 32, generator=torch.Generator().manual_seed(5), dtype=torch.float64)).to(device)

    def t5_bias(score, b, h, q_idx, kv_idx):
        relative = kv_idx - q_idx
        buckets, max_distance = 16, 64
        bucket = (relative > 0).to(torch.long) * buckets
        distance = torch.abs(relative)
        exact = buckets // 2
        large = exact + (torch.log(distance.float() / exact) / math.log(max_distance / exact)
                         * (buckets - exact)).to(torch.long)
        large = torch.min(large, torch.full_like(large, buckets - 1))
        return score + table[h, bucket + torch.where(distance < exact, distance, large)]

    return lambda: lib.flex_attention(q, k, v, score_mod=t5_bias)


def case_activation_score(lib, device, dtype):
    """Scores through torch.nn.functional and inverse trigonometry, in a sliding window."""
    q, k, v = _qkv(device, dtype)

    def window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= 24

    def squash(score, b, h, q_idx, kv_idx):
        return F.gelu(score) + 0.5 * torch.atan(score) - F.softplus(-score, beta=2.0)

    bm = lib.create_block_mask(window, None, None, S, S, device=device)
    return lambda: lib.flex_attention(q, k, v, score_mod=squash, block_mask=bm)


CASES = {name[5:]: fn for name, fn in dict(globals()).items() if name.startswith("case_")}


def outputs(case: str, lib, device, dtype) -> list:
    """The tensors case ``case`` returns through ``lib`` on ``device`` in ``dtype``: out, then
    the auxiliary outputs it asked for (lse; ``return_aux``'s non-None fields)."""
    result = CASES[case](lib, device, dtype)()
    if isinstance(result, tuple):   # (out, AuxOutput) or (out, lse)
        out, aux = result
        return [out] + [t for t in (aux if isinstance(aux, tuple) else (aux,)) if t is not None]
    return [result]


def gpt_fast_decode_step(lib, k_cache, v_cache, max_len: int):
    """gpt-fast's decoding step over ``lib`` (``decode_one_token``, as gpt-fast writes it and
    compiles it): its block mask cut to the row of ``input_pos`` (a tensor), the row's
    mask_mod moved to that position by a closure over ``input_pos[0]``. Not a ``CASES``
    entry: it is compiled (tests/test_torch_compile.py, tests/gpu/test_short_query_gpu.py)."""
    def at_position(mask_mod, offset):
        def moved(b, h, q_idx, kv_idx):
            return mask_mod(b, h, q_idx + offset, kv_idx)
        return moved

    def decode_one_token(q, input_pos, block_mask):
        mask = block_mask[:, :, input_pos // block_mask.BLOCK_SIZE[0]]
        mask.mask_mod = at_position(block_mask.mask_mod, input_pos[0])
        mask.seq_lengths = (1, max_len)
        return lib.flex_attention(q, k_cache, v_cache, block_mask=mask, enable_gqa=True)
    return decode_one_token
