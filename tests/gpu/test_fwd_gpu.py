"""GPU: the sm90 forward against a float64 reference on randomized shapes, mods, dtypes.

Skipped without CUDA. Outputs are NaN-poisoned before every launch, so an element the
kernel fails to write fails the test.
"""

import math
import random

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cutlass")

import cutlass  # noqa: E402

from flexattn.kernels.emit import example_hooks as hooks  # noqa: E402
from flexattn.kernels.fwd.sm90 import FwdConfig  # noqa: E402
from flexattn.kernels.launch.forward import ForwardRunner  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


# ----------------------------------------------------------------- reference (float64)
def reference(q, k, v, scale, score_fn=None, mask_fn=None):
    """Naive attention in float64 on [B, H, S, D]; returns (out, lse) with out = 0 and
    lse = -inf for rows where every key is masked."""
    q, k, v = (t.double() for t in (q, k, v))
    B, Hq, Sq, _ = q.shape
    Hkv, Skv = k.shape[1], k.shape[2]
    k = k.repeat_interleave(Hq // Hkv, dim=1)
    v = v.repeat_interleave(Hq // Hkv, dim=1)
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    dev = q.device
    b = torch.arange(B, device=dev).view(B, 1, 1, 1)
    h = torch.arange(Hq, device=dev).view(1, Hq, 1, 1)
    qi = torch.arange(Sq, device=dev).view(1, 1, Sq, 1)
    ki = torch.arange(Skv, device=dev).view(1, 1, 1, Skv)
    if score_fn is not None:
        s = score_fn(s, b, h, qi, ki)
    if mask_fn is not None:
        s = s.masked_fill(~mask_fn(b, h, qi, ki).expand_as(s), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    p = torch.where(torch.isfinite(lse)[..., None], p, torch.zeros_like(p))
    return p @ v, lse


# ----------------------------------------------------------------- mods under test
def mod_setup(kind, B, Hq, Sq, Skv, dev):
    """-> (config kwargs, runtime hook args, reference score_fn, reference mask_fn)."""
    if kind == "none":
        return {}, (), None, None
    if kind == "causal":                       # block structure + mask hook
        return {"causal": True, "mods": hooks.CausalHook()}, (), None, lambda b, h, q, k: q >= k
    if kind == "causal_builtin":               # block structure, built-in diagonal mask
        return {"causal": True}, (), None, lambda b, h, q, k: q >= k
    if kind == "softcap":
        cap = random.choice([2.0, 5.0, 30.0])
        return ({"mods": hooks.SoftcapHook()}, (cutlass.Float32(cap),),
                lambda s, b, h, q, k: cap * torch.tanh(s / cap), None)
    if kind == "lag":                          # rows q < lag are fully masked
        lag = random.randint(1, 70)
        return ({"mods": hooks.LaggedCausalHook()}, (cutlass.Int32(lag),), None,
                lambda b, h, q, k: k + lag <= q)
    if kind in ("doc", "doc_far"):
        S = max(Sq, Skv)
        doc = torch.sort(torch.randint(0, 4, (B, S), device=dev), dim=1).values.int()
        bias = torch.randn(Hq, device=dev, dtype=torch.float32)
        if kind == "doc_far":   # every score far below 0: exp2 against 0 underflows
            bias = bias - 400.0
        args = (ForwardRunner.hook_tensor(doc), ForwardRunner.hook_tensor(bias))
        d64 = doc.long()
        return ({"mods": hooks.DocumentBiasHook()}, args,
                lambda s, b, h, q, k: s + bias.double()[h],
                lambda b, h, q, k: d64[b, q] == d64[b, k])
    if kind == "window":                       # a band of diagonals, walked by arithmetic
        from flexattn import mods
        from flexattn.kernels.emit.mod_emit import IRModHook, runtime_args
        from flexattn.mods.structure import canonical_band

        left, right = random.choice([(100, 0), (300, 40), (0, 200)])
        hook = IRModHook(None, canonical_band(mods.sliding_window(left, right)))
        return ({"band": True, "mods": hook}, runtime_args(hook, torch.as_tensor), None,
                lambda b, h, q, k: (q - k <= left) & (k - q <= right))
    raise ValueError(kind)


_RUNNERS = {}


def runner_for(cfg):
    if cfg.key() not in _RUNNERS:
        _RUNNERS[cfg.key()] = ForwardRunner(cfg)
    return _RUNNERS[cfg.key()]


def make_qkv(B, Hq, Hkv, Sq, Skv, D, dtype, layout, dev):
    def mk(H, S):
        if layout == "bshd":   # [B, S, H, D] storage viewed as [B, H, S, D]: strided
            return torch.randn(B, S, H, D, device=dev, dtype=dtype).transpose(1, 2)
        return torch.randn(B, H, S, D, device=dev, dtype=dtype)
    return mk(Hq, Sq), mk(Hkv, Skv), mk(Hkv, Skv)


SCHEDULES = {  # step (b) scheduling options; results must not depend on them
    "ov+pp": dict(intra_wg_overlap=True, pingpong=True),
    "ov": dict(intra_wg_overlap=True, pingpong=False),
    "pp": dict(intra_wg_overlap=False, pingpong=True),
    "plain": dict(intra_wg_overlap=False, pingpong=False),
    "m128": dict(tile_m=128),      # head_dim 64 defaults to 192 (3 warpgroups) without score mod
    "m64": dict(tile_m=64, pingpong=False),
    # Tile scheduling: orders, and persistent CTAs capped far below the tile count so each
    # walks many tiles (pipelines, ping-pong turns and the O buffer carried across tiles).
    "by_head": dict(tile_order="by_head"),
    "longest": dict(tile_order="longest_first"),
    "persist": dict(max_ctas=7),
    "persist+pp": dict(max_ctas=3, intra_wg_overlap=False),
    "persist+plain": dict(max_ctas=5, intra_wg_overlap=False, pingpong=False),
    "persist+snake": dict(max_ctas=7, snake=True),   # odd full rounds reversed, a partial last one
    "persist+tickets": dict(max_ctas=7, tile_tickets=True),   # later tiles by a global counter
}
# Schedules that need particular shapes, so kept out of the random draw:
SHAPED_SCHEDULES = {
    # clusters of 2 CTAs sharing K/V by TMA multicast: an even number of q tiles per head
    "cluster": dict(cluster_m=2),
    "cluster+persist": dict(cluster_m=2, max_ctas=6),
    "cluster+plain": dict(cluster_m=2, intra_wg_overlap=False, pingpong=False),
    # KV_LEN a multiple of tile_n: full blocks skip the straddle test (kv_aligned)
    "aligned": dict(kv_aligned=True),
    "aligned+tickets": dict(max_ctas=7, tile_tickets=True, kv_aligned=True),
}
# four consumer warpgroups (256-row tiles; head dims <= 64, kv tiles <= 96 where nothing spills)
M256_SCHEDULES = {
    "m256n64": dict(tile_m=256, tile_n=64),
    "m256n80+tickets": dict(tile_m=256, tile_n=80, max_ctas=7, tile_tickets=True),
    "m256n96+persist": dict(tile_m=256, tile_n=96, max_ctas=5),
    "m256n64+plain": dict(tile_m=256, tile_n=64, intra_wg_overlap=False),
}
# O's rescale skipped while a warp's max stays within 2^8 of the reference (rescale_threshold)
LAZY_SCHEDULES = {
    "lazy": dict(rescale_threshold=8.0),
    "lazy+plain": dict(rescale_threshold=8.0, intra_wg_overlap=False, pingpong=False),
    "lazy+early": dict(rescale_threshold=8.0, rescale_o_early=True, tile_n=64),   # (D256 fits 64 keys)
    "lazy+early+tickets": dict(rescale_threshold=8.0, rescale_o_early=True, max_ctas=7, tile_tickets=True),
    "lazy+persist": dict(rescale_threshold=8.0, max_ctas=7),
    "lazy+cluster": dict(rescale_threshold=8.0, cluster_m=2),
    "lazy+t2": dict(rescale_threshold=2.0),   # a low threshold: rescales and skips alternate more
    # no row maxima on the fast path (maxima_on_demand): the exponentials first, redone
    # where a sum passed 2^t or a row had no reference yet
    "od": dict(rescale_threshold=8.0, maxima_on_demand=True),
    "od+plain": dict(rescale_threshold=8.0, maxima_on_demand=True, intra_wg_overlap=False, pingpong=False),
    "od+early": dict(rescale_threshold=8.0, maxima_on_demand=True, rescale_o_early=True, tile_n=64),
    "od+tickets": dict(rescale_threshold=8.0, maxima_on_demand=True, rescale_o_early=True, max_ctas=7,
                       tile_tickets=True),
    "od+persist": dict(rescale_threshold=8.0, maxima_on_demand=True, max_ctas=7),
    "od+cluster": dict(rescale_threshold=8.0, maxima_on_demand=True, cluster_m=2),
    "od+t2": dict(rescale_threshold=2.0, maxima_on_demand=True),
    "od+m256": dict(rescale_threshold=8.0, maxima_on_demand=True, tile_m=256, tile_n=80, max_ctas=7,
                    tile_tickets=True),
    "od+m256n64": dict(rescale_threshold=8.0, maxima_on_demand=True, tile_m=256, tile_n=64, max_ctas=7,
                       tile_tickets=True),
}
# causal tiles taller than their kv tiles, where a warpgroup's walk ends at its own rows'
# diagonal (FwdConfig.own_diagonal, planned; these schedules name the tiles)
OWN_SCHEDULES = {
    "m192n112+tickets": dict(tile_m=192, tile_n=112, max_ctas=7, tile_tickets=True),
    "n80": dict(tile_n=80),
    "od+n80": dict(tile_n=80, rescale_threshold=8.0, maxima_on_demand=True),
}
ALL_SCHEDULES = {**SCHEDULES, **SHAPED_SCHEDULES, **M256_SCHEDULES, **LAZY_SCHEDULES, **OWN_SCHEDULES}


def spiky_gains(q, k, block=64):
    """Scale keys by a gain drawn per block of keys (0.25 to 8) and queries by one per row
    (0.3 to 3): a row's max then jumps by far more than 2^8 between some kv blocks and
    not between others, differently from warp to warp (rescale_threshold's two branches)."""
    S = k.shape[2]
    gains = torch.tensor([0.25, 1.0, 2.0, 4.0, 8.0], device=k.device)
    per_block = gains[torch.randint(0, len(gains), ((S + block - 1) // block,), device=k.device)]
    k = (k.float() * per_block.repeat_interleave(block)[:S].view(1, 1, S, 1)).to(k.dtype)
    rows = torch.tensor([0.3, 1.0, 3.0], device=q.device)[torch.randint(0, 3, (q.shape[2],), device=q.device)]
    q = (q.float() * rows.view(1, 1, -1, 1)).to(q.dtype)
    return q, k


def run_case(dtype_name, D, B, Hq, Hkv, Sq, Skv, kind, layout="bhsd", sched="ov+pp", seed=0, spiky=False,
             overrides=None):
    """Run one forward against the float64 reference; returns (O, LSE). `overrides`: more
    FwdConfig fields on top of the schedule's."""
    random.seed(seed)
    torch.manual_seed(seed)
    dev = "cuda"
    dtype = DTYPES[dtype_name]
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Skv, D, dtype, layout, dev)
    if spiky:
        q, k = spiky_gains(q, k)
    cfg_kw, args, score_fn, mask_fn = mod_setup(kind, B, Hq, Sq, Skv, dev)
    cfg = FwdConfig(dtype=dtype_name, head_dim=D, **cfg_kw, **{**ALL_SCHEDULES[sched], **(overrides or {})})
    scale = 1.0 / math.sqrt(D)
    o = torch.full((B, Hq, Sq, D), float("nan"), device=dev, dtype=dtype)
    lse = torch.full((B, Hq, Sq), float("nan"), device=dev, dtype=torch.float32)
    tickets = torch.zeros(1, dtype=torch.int32, device=dev) if cfg.tile_tickets else None
    stream = torch.cuda.current_stream().cuda_stream
    runner_for(cfg).run(q, k, v, o, lse, scale, args, stream, None if tickets is None else (tickets,))
    torch.cuda.synchronize()
    if tickets is not None:
        # The counter is left zero; a second launch with it (NaN-poisoned outputs) computes
        # every tile again, bit for bit.
        assert tickets.item() == 0, "the tile tickets' counter was not reset"
        o2, lse2 = torch.full_like(o, float("nan")), torch.full_like(lse, float("nan"))
        runner_for(cfg).run(q, k, v, o2, lse2, scale, args, stream, (tickets,))
        torch.cuda.synchronize()
        assert torch.equal(o2, o) and torch.equal(lse2.nan_to_num(), lse.nan_to_num()) and tickets.item() == 0
    ref_o, ref_lse = reference(q, k, v, scale, score_fn, mask_fn)

    assert not torch.isnan(o).any(), "unwritten or NaN output"
    assert not torch.isnan(lse).any(), "unwritten or NaN LSE"
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse) & (lse < 0), empty), "-inf LSE rows differ"
    assert (o[empty] == 0).all(), "fully masked rows must output 0"
    err_o = (o.double() - ref_o).abs().max().item()
    rel_o = ((o.double() - ref_o).norm() / ref_o.norm().clamp_min(1e-12)).item()
    fin = ~empty
    err_lse = (lse.double()[fin] - ref_lse[fin]).abs().max().item() if fin.any() else 0.0
    tol_o = 2e-2 if dtype_name == "bf16" else 4e-3
    assert err_o < tol_o and rel_o < tol_o / 2, (err_o, rel_o)
    # tanh.approx (softcap) has ~5e-4 relative error; everything else is fp32 rounding.
    assert err_lse < (5e-3 if kind == "softcap" else 2e-3), err_lse
    return o, lse


# (dtype, D, B, Hq, Hkv, Sq, Skv, mod, layout, schedule)
FIXED = [
    ("bf16", 128, 2, 4, 4, 256, 256, "none", "bhsd", "ov+pp"),
    ("bf16", 128, 2, 4, 4, 256, 256, "none", "bhsd", "plain"),
    ("bf16", 64, 1, 2, 2, 128, 128, "none", "bhsd", "ov"),
    ("fp16", 128, 1, 3, 3, 77, 300, "none", "bhsd", "pp"),
    ("bf16", 128, 2, 8, 2, 1000, 1000, "causal", "bhsd", "ov+pp"),      # GQA 4:1
    ("bf16", 128, 2, 8, 2, 1000, 1000, "causal", "bhsd", "plain"),
    ("bf16", 64, 1, 6, 3, 333, 129, "causal", "bshd", "ov+pp"),          # Sq > Skv, strided
    ("fp16", 128, 1, 4, 1, 129, 513, "causal_builtin", "bhsd", "ov+pp"),  # MQA, Sq < Skv
    ("bf16", 128, 2, 4, 2, 511, 257, "softcap", "bshd", "ov+pp"),
    ("fp16", 64, 1, 2, 2, 64, 1, "softcap", "bhsd", "ov+pp"),             # one key
    ("bf16", 64, 2, 2, 1, 200, 200, "lag", "bhsd", "ov+pp"),              # empty rows
    ("fp16", 128, 1, 2, 2, 130, 257, "lag", "bhsd", "pp"),
    ("bf16", 128, 2, 4, 4, 384, 384, "doc", "bhsd", "ov+pp"),
    ("fp16", 64, 1, 1, 1, 1, 1, "none", "bhsd", "ov+pp"),                 # single element
    ("bf16", 64, 2, 4, 2, 700, 700, "causal", "bhsd", "m128"),
    ("bf16", 64, 1, 2, 2, 450, 450, "lag", "bshd", "pp"),                 # 3-WG rotation
    ("fp16", 128, 1, 2, 1, 300, 200, "causal", "bhsd", "m64"),            # 1 consumer WG
    ("bf16", 128, 1, 2, 2, 3000, 2900, "none", "bhsd", "ov+pp"),          # long: many stages
    ("bf16", 128, 3, 8, 2, 1000, 1000, "causal", "bhsd", "by_head"),
    ("fp16", 64, 2, 6, 3, 515, 700, "softcap", "bshd", "longest"),
    ("bf16", 128, 2, 8, 2, 1000, 1000, "causal", "bhsd", "persist"),
    ("bf16", 128, 3, 4, 4, 700, 333, "doc", "bhsd", "persist"),
    ("bf16", 64, 2, 4, 2, 450, 450, "lag", "bshd", "persist"),            # 3 WGs, empty rows
    ("fp16", 128, 2, 4, 1, 257, 700, "softcap", "bhsd", "persist+pp"),
    ("bf16", 128, 2, 2, 2, 300, 301, "causal_builtin", "bhsd", "persist+plain"),
    ("bf16", 128, 3, 4, 4, 700, 333, "doc", "bhsd", "persist+snake"),       # 72 tiles: 10 rounds + 2
    ("fp16", 128, 2, 8, 2, 1000, 1000, "causal", "bhsd", "persist+snake"),
    ("bf16", 128, 3, 4, 2, 1000, 1000, "window", "bhsd", "persist"),
    ("bf16", 128, 3, 4, 2, 1000, 1000, "window", "bhsd", "persist+tickets"),  # 96 tiles, 7 CTAs
    ("fp16", 128, 2, 6, 3, 700, 900, "window", "bshd", "persist+tickets"),
    ("bf16", 64, 2, 4, 4, 450, 450, "window", "bhsd", "persist+tickets"),     # 3 WGs
    ("bf16", 128, 3, 4, 4, 700, 333, "doc", "bhsd", "persist+tickets"),
    ("fp16", 128, 2, 8, 2, 1000, 1000, "causal", "bhsd", "persist+tickets"),
    ("bf16", 128, 2, 2, 2, 300, 301, "causal_builtin", "bhsd", "persist+tickets"),
    ("bf16", 64, 3, 8, 2, 1000, 1000, "causal_builtin", "bhsd", "persist+tickets"),   # 192-row tiles
    ("fp16", 96, 2, 6, 3, 777, 777, "causal_builtin", "bshd", "persist+tickets"),
    ("bf16", 128, 1, 1, 1, 100, 100, "window", "bhsd", "persist+tickets"),    # one tile: no ticket used
    ("bf16", 128, 3, 4, 2, 1000, 1024, "window", "bhsd", "aligned+tickets"),  # KV_LEN on tile boundaries
    ("fp16", 128, 2, 6, 3, 700, 896, "window", "bshd", "aligned"),
    # clusters (q tiles per head even: 128-row tiles, 192 for head dim 64 without score mod)
    ("bf16", 128, 2, 4, 4, 256, 256, "none", "bhsd", "cluster"),
    ("bf16", 128, 3, 8, 2, 1000, 999, "none", "bshd", "cluster"),          # GQA, odd Skv
    ("fp16", 128, 1, 4, 1, 250, 1, "none", "bhsd", "cluster"),              # one key, MQA
    ("bf16", 64, 2, 4, 2, 300, 700, "none", "bhsd", "cluster"),             # 3 WGs (192 rows)
    ("bf16", 128, 2, 4, 2, 511, 257, "softcap", "bshd", "cluster"),
    ("fp16", 64, 2, 2, 1, 200, 513, "lag", "bhsd", "cluster"),              # empty rows
    ("bf16", 128, 2, 4, 4, 500, 500, "doc", "bhsd", "cluster"),             # mask on every block
    ("bf16", 128, 3, 8, 2, 1000, 1000, "none", "bhsd", "cluster+persist"),
    ("fp16", 128, 2, 4, 2, 700, 333, "softcap", "bshd", "cluster+persist"),
    ("bf16", 128, 2, 4, 2, 511, 300, "none", "bhsd", "cluster+plain"),
    # causal clusters: the lower tile of a pair skips the blocks only the upper one sees
    ("bf16", 128, 2, 8, 2, 1000, 1000, "causal_builtin", "bhsd", "cluster"),
    ("fp16", 128, 1, 4, 4, 1000, 700, "causal_builtin", "bshd", "cluster"),    # Sq > Skv
    ("bf16", 128, 2, 4, 1, 256, 1000, "causal_builtin", "bhsd", "cluster"),    # Sq < Skv, MQA
    ("bf16", 128, 2, 4, 2, 700, 701, "causal", "bhsd", "cluster"),             # + mask hook
    ("bf16", 128, 2, 4, 2, 511, 511, "causal_builtin", "bhsd", "cluster+plain"),
]


@pytest.mark.parametrize("case", FIXED, ids=lambda c: "-".join(map(str, c)))
def test_fixed(case):
    run_case(*case)


# 256-row tiles: the four-way ping-pong, causal diagonals crossing several kv tiles, odd lengths,
# GQA, empty rows, the hooks' one-step walk, persistent CTAs with tickets, no overlap
M256 = [
    ("bf16", 32, 2, 4, 2, 1000, 1000, "causal_builtin", "bhsd", "m256n64"),
    ("bf16", 64, 3, 8, 2, 1000, 1000, "causal_builtin", "bhsd", "m256n80+tickets"),
    ("fp16", 32, 2, 6, 3, 777, 777, "causal_builtin", "bshd", "m256n96+persist"),
    ("bf16", 64, 2, 4, 4, 513, 700, "none", "bhsd", "m256n64"),
    ("fp16", 64, 1, 6, 3, 333, 129, "causal", "bshd", "m256n64"),          # mask hook, Sq > Skv
    ("bf16", 32, 2, 2, 1, 300, 300, "lag", "bhsd", "m256n80+tickets"),     # empty rows
    ("bf16", 64, 2, 4, 2, 1000, 999, "none", "bhsd", "m256n64+plain"),
    ("fp16", 32, 1, 2, 2, 64, 1, "none", "bhsd", "m256n64"),               # one key
    # score mods on tall tiles (planned 128 x 128; FLEXATTN_FWD_TILES A/B runs take these)
    ("bf16", 32, 2, 4, 2, 511, 257, "softcap", "bshd", "od+m256"),
    ("fp16", 64, 1, 4, 2, 700, 700, "softcap", "bhsd", "od+m256n64"),
    ("bf16", 64, 2, 4, 2, 333, 700, "softcap", "bhsd", "m192n112+tickets"),
    # ... and bands (sliding windows; the same A/B runs)
    ("bf16", 32, 3, 4, 2, 1000, 1000, "window", "bhsd", "od+m256"),
    ("fp16", 64, 2, 6, 3, 700, 900, "window", "bshd", "od+m256n64"),
]


@pytest.mark.parametrize("case", M256, ids=lambda c: "-".join(map(str, c)))
def test_256_row_tiles(case):
    run_case(*case)


# A band's partial and full blocks through one step (FwdConfig.band_one_step, planned; the
# other band cases build their configs and walk the two loops):
# windows open on either side, odd lengths, GQA, Sq != Skv, rows with no key, persistent CTAs
# by tickets, four warpgroups, the maxima on demand and without them, kv-aligned full blocks.
BAND_ONE_STEP = [
    ("bf16", 128, 3, 4, 2, 1000, 1000, "window", "bhsd", "od+persist", True),
    ("fp16", 128, 2, 4, 2, 700, 900, "window", "bshd", "od+tickets", False),
    ("bf16", 64, 2, 6, 3, 777, 500, "window", "bhsd", "ov+pp", False),
    ("bf16", 128, 2, 4, 2, 1024, 1024, "window", "bhsd", "aligned+tickets", True),
    ("bf16", 32, 3, 4, 2, 1000, 1000, "window", "bhsd", "od+m256", True),
    ("fp16", 128, 1, 2, 2, 130, 257, "window", "bshd", "od", False),
]


@pytest.mark.parametrize("case", BAND_ONE_STEP, ids=lambda c: "-".join(map(str, c)))
def test_band_one_step(case):
    run_case(*case[:9], sched=case[9], spiky=case[10], overrides={"band_one_step": True})


# The dense and causal structures without hooks through one step (FwdConfig.one_step_walk,
# planned up to head dim 64): clusters, tickets, persistent CTAs, tiles whose later blocks
# cross the diagonal (n80) and a warpgroup's own diagonal (192 and 256 rows), kv-aligned full blocks,
# the maxima on demand and without them, Sq != Skv, one key.
ONE_STEP_WALK = [
    ("bf16", 128, 2, 8, 2, 1000, 1000, "causal_builtin", "bhsd", "od+cluster", True),
    ("fp16", 128, 2, 4, 2, 700, 900, "causal_builtin", "bshd", "od+tickets", False),
    ("bf16", 128, 2, 4, 2, 1000, 1000, "causal_builtin", "bhsd", "od+n80", True),
    ("bf16", 64, 2, 6, 3, 777, 777, "causal_builtin", "bshd", "m192n112+tickets", False),
    ("bf16", 32, 2, 4, 2, 1000, 1000, "causal_builtin", "bhsd", "od+m256", True),
    ("bf16", 128, 2, 4, 2, 1024, 1024, "causal_builtin", "bhsd", "aligned+tickets", True),
    ("bf16", 64, 1, 6, 3, 333, 129, "causal_builtin", "bhsd", "ov+pp", False),
    ("fp16", 128, 1, 2, 2, 130, 257, "none", "bshd", "od", False),
    ("bf16", 128, 3, 8, 2, 1000, 999, "none", "bshd", "od+cluster", True),
    ("fp16", 64, 1, 2, 2, 64, 1, "none", "bhsd", "od", False),
]


@pytest.mark.parametrize("case", ONE_STEP_WALK, ids=lambda c: "-".join(map(str, c)))
def test_one_step_walk(case):
    run_case(*case[:9], sched=case[9], spiky=case[10], overrides={"one_step_walk": True})


# rescale_threshold over every walk (dense, causal peeled and in one step, lists, band, no
# overlap, early rescale, clusters, persistent CTAs), empty rows, D32 to D256; spiky inputs
# (spiky_gains) take both branches of the vote, plain ones mostly the skip.
LAZY = [
    ("bf16", 64, 2, 4, 2, 1000, 1000, "causal_builtin", "bhsd", "lazy+early+tickets", True),   # 192-row tiles
    ("bf16", 32, 2, 4, 2, 1000, 1000, "causal_builtin", "bhsd", "lazy", True),
    ("fp16", 128, 2, 4, 2, 700, 900, "none", "bshd", "lazy", True),
    ("bf16", 128, 2, 8, 2, 1000, 1000, "causal", "bhsd", "lazy", True),          # hooks: one-step walk
    ("bf16", 128, 2, 4, 2, 511, 257, "softcap", "bshd", "lazy", True),
    ("bf16", 64, 2, 2, 1, 200, 200, "lag", "bhsd", "lazy", True),                # empty rows
    ("fp16", 128, 1, 2, 2, 130, 257, "lag", "bhsd", "lazy+plain", True),
    ("bf16", 128, 3, 4, 4, 700, 333, "doc", "bhsd", "lazy+persist", True),       # lists
    ("bf16", 128, 3, 4, 2, 1000, 1000, "window", "bhsd", "lazy+persist", True),  # band
    ("fp16", 128, 2, 4, 2, 511, 300, "none", "bhsd", "lazy+plain", True),
    ("bf16", 128, 3, 8, 2, 1000, 999, "none", "bshd", "lazy+cluster", True),
    ("fp16", 256, 1, 4, 2, 600, 600, "causal_builtin", "bhsd", "lazy+early", True),
    ("bf16", 96, 2, 6, 3, 777, 777, "causal_builtin", "bshd", "lazy+t2", True),
    ("bf16", 128, 2, 8, 2, 1000, 1000, "causal_builtin", "bhsd", "lazy+t2", False),
    ("bf16", 64, 2, 4, 2, 1000, 1000, "causal_builtin", "bhsd", "lazy+early+tickets", False),
    ("fp16", 64, 1, 2, 2, 64, 1, "softcap", "bhsd", "lazy", False),              # one key
]
# ... and maxima_on_demand over the same walks, plus rows whose every exponential against
# 0 underflows (their first visited blocks masked: the slow path must set a reference),
# and four consumer warpgroups
ON_DEMAND_OF = {"lazy": "od", "lazy+plain": "od+plain", "lazy+early": "od+early", "lazy+t2": "od+t2",
                "lazy+early+tickets": "od+tickets", "lazy+persist": "od+persist", "lazy+cluster": "od+cluster"}
LAZY += [case[:9] + (ON_DEMAND_OF[case[9]], case[10]) for case in LAZY if case[9] in ON_DEMAND_OF]
LAZY += [
    ("bf16", 64, 2, 4, 2, 700, 800, "doc_far", "bhsd", "od", False),
    ("fp16", 128, 2, 4, 2, 511, 333, "doc_far", "bshd", "od+persist", True),
    ("bf16", 32, 2, 4, 2, 1000, 1000, "causal_builtin", "bhsd", "od+m256", True),
    ("fp16", 32, 1, 6, 3, 777, 777, "none", "bshd", "od+m256", False),
    ("bf16", 64, 2, 2, 1, 300, 300, "lag", "bhsd", "od+m256", True),
    ("bf16", 64, 2, 4, 2, 1000, 1000, "causal_builtin", "bhsd", "od+m256n64", True),   # D64's plan
    ("fp16", 64, 2, 4, 2, 700, 800, "doc_far", "bhsd", "od+m256n64", False),
    ("bf16", 64, 2, 4, 2, 1000, 999, "none", "bshd", "od+m256n64", True),
    ("fp16", 128, 1, 2, 2, 130, 257, "lag", "bhsd", "od", True),                 # empty rows
    ("bf16", 64, 1, 2, 2, 64, 1, "softcap", "bhsd", "od", False),                # one key
]


@pytest.mark.parametrize("case", LAZY, ids=lambda c: "-".join(map(str, c)))
def test_rescale_threshold(case):
    *args, spiky = case
    run_case(*args, spiky=spiky)


# Each warpgroup's causal walk ends at its own rows' diagonal (own_diagonal): four, three and
# two consumer warpgroups, the peeled walk and the hooks' one-step walk, Sq != Skv, odd
# lengths, GQA, persistent CTAs by tickets, on-demand maxima with spiky rows (a warpgroup's
# first block may leave some of its rows without a key). The walk only drops blocks that
# are wholly masked for a warpgroup's rows, so O and LSE match the whole tile's walk's up
# to one thing: with on-demand maxima a row's first real block is summed by the first
# step there, by the slow path's pairs after an all-masked block (another order of fp32
# additions; the GPU run of 2026-12-01 found O bitwise equal in all eight cases and the
# LSE not, in the three with on-demand maxima and the peeled walk).
OWN_DIAGONAL = [
    ("bf16", 32, 2, 4, 2, 1000, 1000, "causal_builtin", "bhsd", "od+m256", True),    # D32's plan
    ("bf16", 64, 2, 4, 2, 1000, 1000, "causal_builtin", "bhsd", "od+m256n64", True),  # D64's plan
    ("fp16", 64, 1, 6, 3, 333, 129, "causal", "bshd", "m256n64", False),              # hook, Sq > Skv
    ("bf16", 32, 2, 2, 1, 300, 300, "causal", "bhsd", "m256n80+tickets", False),
    ("bf16", 96, 2, 6, 3, 777, 777, "causal_builtin", "bshd", "m192n112+tickets", True),
    ("fp16", 256, 1, 4, 2, 600, 600, "causal_builtin", "bhsd", "n80", False),
    ("bf16", 256, 1, 4, 2, 600, 611, "causal", "bhsd", "od+n80", True),               # hook, one step
    ("bf16", 128, 2, 4, 2, 129, 513, "causal_builtin", "bhsd", "od+n80", False),      # Sq < Skv
]


@pytest.mark.parametrize("case", OWN_DIAGONAL, ids=lambda c: "-".join(map(str, c)))
def test_own_diagonal(case):
    *args, spiky = case
    o, lse = run_case(*args, spiky=spiky)
    o_tile, lse_tile = run_case(*args, spiky=spiky, overrides={"own_diagonal": False})
    # O: within one 16-bit rounding step; LSE: within the fp32 rounding of a row sum of
    # at most a few hundred terms (relative 1e-5 of l is 1e-5 absolute in its log).
    torch.testing.assert_close(o, o_tile, rtol=2.0 ** -7, atol=1e-6)
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_tile))
    fin = ~torch.isinf(lse)
    torch.testing.assert_close(lse[fin], lse_tile[fin], rtol=1e-6, atol=1e-5)


def _random_cases(n, seed=1234):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        hkv = rng.choice([1, 2, 3])
        out.append((rng.choice(["bf16", "fp16"]), rng.choice([64, 128]), rng.randint(1, 3),
                    hkv * rng.choice([1, 2, 4]), hkv, rng.randint(1, 700), rng.randint(1, 700),
                    rng.choice(["none", "causal", "causal_builtin", "softcap", "lag", "doc"]),
                    rng.choice(["bhsd", "bshd"]), rng.choice(list(SCHEDULES))))
    return out


RANDOM = _random_cases(16)


@pytest.mark.parametrize("i", range(len(RANDOM)), ids=lambda i: "-".join(map(str, RANDOM[i])))
def test_random(i):
    run_case(*RANDOM[i], seed=i)


def test_runtime_args_reuse_one_kernel():
    """Two softcap values, one compiled kernel, both right."""
    cfg = FwdConfig(head_dim=64, mods=hooks.SoftcapHook())
    r = runner_for(cfg)
    dev = "cuda"
    q, k, v = (torch.randn(1, 2, 200, 64, device=dev, dtype=torch.bfloat16) for _ in range(3))
    for cap in (1.5, 9.0):
        o = torch.full_like(q, float("nan"))
        lse = torch.full(q.shape[:3], float("nan"), device=dev)
        r.run(q, k, v, o, lse, 0.125, (cutlass.Float32(cap),), torch.cuda.current_stream().cuda_stream)
        ref, _ = reference(q, k, v, 0.125, lambda s, *_: cap * torch.tanh(s / cap))
        assert (o.double() - ref).abs().max().item() < 2e-2
    assert len(r._compiled) == 1


def test_cluster_refuses_odd_tile_count():
    """A pair of a cluster must share its (batch, head): 3 q tiles per head is refused
    before the launch, not computed with the wrong K/V."""
    r = runner_for(FwdConfig(cluster_m=2))
    q, k, v = (torch.randn(1, 2, 300, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    o, lse = torch.empty_like(q), torch.empty(q.shape[:3], device="cuda")
    with pytest.raises(ValueError, match="cluster_m=2"):
        r.run(q, k, v, o, lse, 0.1, (), torch.cuda.current_stream().cuda_stream)


# ----------------------------------------------------------------- block sparsity
def random_block_mask(B, Hm, Sq, Skv, tm, tn, seed, dev, paired=False):
    """FlexAttention-style lists with random per-block kinds (0 skip, 1 partial, 2 full)
    in random order; row (0, 0, 0) is forced empty. `paired`: rows 2i and 2i+1 get
    identical lists (what a cluster's two CTAs need). Returns (tensors, kinds)."""
    g = torch.Generator().manual_seed(seed)
    nq, nk = -(-Sq // tm), -(-Skv // tn)
    kinds = torch.randint(0, 3, (B, Hm, nq, nk), generator=g)
    kinds[0, 0, 0] = 0
    if paired:
        kinds[:, :, 1::2] = kinds[:, :, 0::2][:, :, :nq // 2]
    num = [torch.zeros(B, Hm, nq, dtype=torch.int32) for _ in range(2)]
    idx = [torch.zeros(B, Hm, nq, nk, dtype=torch.int32) for _ in range(2)]
    for b in range(B):
        for h in range(Hm):
            for m in range(nq):
                for j, kind in enumerate((1, 2)):
                    sel = torch.nonzero(kinds[b, h, m] == kind).flatten()
                    sel = sel[torch.randperm(len(sel), generator=g)]
                    if paired and m % 2:   # the same order as its pair's first row
                        sel = idx[j][b, h, m - 1, :num[j][b, h, m - 1]].long()
                    num[j][b, h, m] = len(sel)
                    idx[j][b, h, m, :len(sel)] = sel.int()
    tensors = tuple(t.to(dev) for t in (num[0], idx[0], num[1], idx[1]))
    return tensors, kinds.to(dev)


BLOCK_SPARSE = [  # (dtype, D, B, Hq, Hkv, Hmask, Sq, Skv, mod, schedule)
    ("bf16", 128, 2, 4, 2, 4, 700, 650, "lag", "ov+pp"),
    ("bf16", 128, 2, 4, 2, 1, 700, 650, "none", "ov+pp"),     # broadcast over heads
    ("fp16", 64, 1, 2, 2, 2, 300, 1000, "causal", "ov+pp"),
    ("bf16", 64, 2, 2, 1, 1, 513, 257, "doc", "plain"),
    ("bf16", 128, 1, 3, 3, 3, 129, 129, "softcap", "pp"),
    ("bf16", 128, 2, 4, 2, 4, 700, 650, "lag", "persist"),    # empty rows inside the walk
    ("fp16", 64, 2, 2, 1, 1, 513, 257, "doc", "persist+plain"),
    # clusters over lists whose row pairs are identical (documents on 256-token boundaries)
    ("bf16", 128, 2, 4, 2, 4, 700, 650, "lag", "cluster"),
    ("bf16", 128, 2, 4, 2, 1, 1000, 650, "none", "cluster+persist"),
    ("fp16", 128, 1, 4, 4, 4, 512, 1000, "doc", "cluster+plain"),
    ("bf16", 128, 2, 2, 1, 1, 256, 300, "softcap", "cluster+persist"),
    # KV_LEN on tile boundaries: full blocks skip the straddle test
    ("bf16", 128, 2, 4, 2, 4, 700, 640, "lag", "aligned"),
    ("fp16", 64, 2, 2, 1, 1, 513, 256, "doc", "aligned"),
    ("bf16", 128, 2, 4, 2, 4, 512, 1024, "softcap", "aligned"),
    # the list walks with no row maxima on the fast path (maxima_on_demand): empty rows,
    # rows whose exponentials against 0 underflow, clusters
    ("bf16", 128, 2, 4, 2, 4, 700, 650, "lag", "od"),
    ("fp16", 64, 2, 2, 1, 1, 513, 257, "doc_far", "od+persist"),
    ("bf16", 128, 2, 4, 2, 4, 700, 650, "lag", "od+cluster"),
    ("bf16", 64, 2, 2, 1, 1, 513, 257, "doc", "od+t2"),
]


@pytest.mark.parametrize("case", BLOCK_SPARSE, ids=lambda c: "-".join(map(str, c)))
def test_block_sparse(case):
    dtype_name, D, B, Hq, Hkv, Hm, Sq, Skv, kind, sched = case
    seed = BLOCK_SPARSE.index(case)
    random.seed(seed)
    torch.manual_seed(seed)
    dev = "cuda"
    dtype = DTYPES[dtype_name]
    q, k, v = make_qkv(B, Hq, Hkv, Sq, Skv, D, dtype, "bhsd", dev)
    cfg_kw, args, score_fn, mask_fn = mod_setup(kind, B, Hq, Sq, Skv, dev)
    cfg_kw.pop("causal", None)
    cfg = FwdConfig(dtype=dtype_name, head_dim=D, block_sparse=True, **cfg_kw,
                    **ALL_SCHEDULES[sched])
    tensors, kinds = random_block_mask(B, Hm, Sq, Skv, cfg.tile_m, cfg.tile_n, seed, dev,
                                       paired=cfg.cluster_m > 1)

    def block_mask(b, h, qi, ki):
        kb = kinds[b, h % Hm, qi // cfg.tile_m, ki // cfg.tile_n]
        inner = mask_fn(b, h, qi, ki) if mask_fn is not None else torch.ones_like(kb, dtype=torch.bool)
        return (kb == 2) | ((kb == 1) & inner)

    scale = 1.0 / math.sqrt(D)
    o = torch.full((B, Hq, Sq, D), float("nan"), device=dev, dtype=dtype)
    lse = torch.full((B, Hq, Sq), float("nan"), device=dev, dtype=torch.float32)
    runner_for(cfg).run(q, k, v, o, lse, scale, args, torch.cuda.current_stream().cuda_stream,
                        block_sparse=tensors)
    torch.cuda.synchronize()
    ref_o, ref_lse = reference(q, k, v, scale, score_fn, block_mask)
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    empty = torch.isinf(ref_lse)
    assert empty[0, 0, :cfg.tile_m].any()              # the forced empty row block
    assert torch.equal(torch.isinf(lse) & (lse < 0), empty)
    assert (o[empty] == 0).all()
    tol_o = 2e-2 if dtype_name == "bf16" else 4e-3
    assert (o.double() - ref_o).abs().max().item() < tol_o
    fin = ~empty
    assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() < 5e-3
