"""CPU (CI): the split-KV decode kernel compiles for sm_90a (contiguous / paged caches,
with and without IR mods, TVM-FFI and from_dlpack entry), uses the Hopper paths, does not
spill, emits the masked-prefix analysis only for masks and the in-kernel merge of the
splits (arrival ticket, reset; or the cluster merge through distributed shared memory);
plus the decode planner's host logic (splits heuristic,
errors, no recompiles across steps, plans reused across steps). No GPU needed."""

import dataclasses
import re

import numpy as np
import pytest

pytest.importorskip("cutlass")

from flexattn import KVCache, PagedKVCache, mods  # noqa: E402
from flexattn.core import decode_path  # noqa: E402
from flexattn.core.decode_path import DecodeTuning, choose_splits, decode_unsupported  # noqa: E402
from flexattn.core.kernel_path import Device  # noqa: E402
from flexattn.kernels.launch.compile import resource_usage_from_ptx  # noqa: E402
from flexattn.kernels.launch.compile import compile_decode  # noqa: E402
from flexattn.kernels.decode.combine import lane_columns  # noqa: E402
from flexattn.kernels.decode.polled_merge import chunk_splits  # noqa: E402
from flexattn.kernels.decode.sm90 import DecodeConfig  # noqa: E402
from flexattn.kernels.emit.mod_emit import IRModHook, fake_args  # noqa: E402
from flexattn.mods.positions import shift_queries  # noqa: E402
from compile_pool import compile_all, prefetch  # noqa: E402

OFFSETS = np.zeros(4, np.int32)


def _paged_attention_mods():
    """torch's PagedAttention step as the short-query route hands it to the decode kernel
    (``short_query.list_walk_route``): its converted mask (the page map and lengths read per
    key) and an ALiBi score, both seeing each key at its physical position through the
    walk's block table (``positions.block_table_keys``)."""
    from flexattn.mods.positions import block_table_keys

    page_map, lengths, table = np.zeros((4, 64), np.int64), np.zeros(4, np.int64), np.zeros((4, 16), np.int32)

    def physical(b, h, q_idx, kv_idx):
        logical = page_map[b, kv_idx // 128] * 128 + kv_idx % 128
        return (page_map[b, kv_idx // 128] >= 0) & (logical < lengths[b])

    return (block_table_keys(mods.alibi(num_heads=32), table, 128),
            block_table_keys(mods.mask_mod(physical), table, 128))


# name: (config kwargs, score, mask, tvm_ffi, TMA copies per K+V block)
CASES = {
    "contiguous-plain": (dict(head_dim=128), None, None, True, 4),
    # the default tuning: two CTAs per SM, 64-key tiles, 2 stages; launch registers <= 128
    "2cta-tile64-window-alibi": (dict(head_dim=128, tile_n=64, num_stages=2, ctas_per_sm=2),
                                 mods.alibi(num_heads=32), mods.sliding_window(4096), True, 4),
    "paged64-window-alibi": (dict(head_dim=128, page_size=64), mods.alibi(num_heads=32),
                             mods.sliding_window(4096), True, 8),
    "paged256-hd64-softcap-fp16": (dict(head_dim=64, dtype="fp16", page_size=256), mods.softcap(30.0),
                                   mods.causal(), False, 2),
    "paged16-2wg": (dict(head_dim=64, page_size=16, num_mma_wg=2), None, mods.causal(), True, 16),
    # the cluster merge (4 splits per cluster: B 8 x Hkv 8 on 132 SMs), and 8 with two
    # consumer warpgroups and D 64 (two fp32 per lane and split row); the timeline probe
    "cluster4-2cta-window-alibi": (dict(head_dim=128, tile_n=64, num_stages=2, ctas_per_sm=2, cluster_splits=4),
                                   mods.alibi(num_heads=32), mods.sliding_window(4096), True, 4),
    "cluster8-paged16-2wg": (dict(head_dim=64, page_size=16, num_mma_wg=2, cluster_splits=8), None, mods.causal(),
                             False, 16),
    # a non-portable cluster of 16
    "cluster16-2cta-window": (dict(head_dim=128, tile_n=64, num_stages=2, ctas_per_sm=2, cluster_splits=16),
                              None, mods.sliding_window(4096), True, 4),
    # causal at true positions: the planner compiles the masked-prefix analysis out
    "causal-alibi-no-prefix": (dict(head_dim=128, tile_n=64, num_stages=6, skip_masked_prefix=False),
                               mods.alibi(num_heads=32), mods.causal(), True, 4),
    "cluster2-timeline": (dict(head_dim=128, tile_n=64, num_stages=2, ctas_per_sm=2, cluster_splits=2,
                               timeline=True), None, None, True, 4),
    # head dims beyond 64 / 128 (multiples of 32: each lane merges D/32 columns): one fp32
    # per lane in the pair cluster at 32, three (scalar reads) at 96, eight (two v4) at 256
    # with decode_path.fit_head_dim's ring (3 stages, one CTA per SM), 192 with two
    # consumer warpgroups
    "hd32-cluster2": (dict(head_dim=32, tile_n=64, num_stages=2, ctas_per_sm=2, cluster_splits=2),
                      mods.alibi(num_heads=32), mods.sliding_window(4096), True, 2),
    "hd96-2cta": (dict(head_dim=96, tile_n=64, num_stages=2, ctas_per_sm=2), None, mods.causal(), True, 6),
    "hd256-cluster2": (dict(head_dim=256, tile_n=64, num_stages=3, cluster_splits=2),
                       mods.alibi(num_heads=32), mods.sliding_window(4096), True, 8),
    "hd192-2wg": (dict(head_dim=192, tile_n=64, num_stages=3, num_mma_wg=2), None, None, True, 6),
    # not a multiple of 32: each lane merges the strided columns lane + 32 i (scalar reads);
    # K/V rows of 160 / 224 bytes take 32-byte swizzle atoms: 5 / 7 TMA copies per box
    "hd80-cluster2": (dict(head_dim=80, tile_n=64, num_stages=2, ctas_per_sm=2, cluster_splits=2),
                      mods.alibi(num_heads=32), mods.sliding_window(4096), True, 10),
    "hd112-2wg": (dict(head_dim=112, tile_n=64, num_stages=6, num_mma_wg=2), None, mods.causal(), True, 14),
    # a short query's walk of the kv blocks its block mask lists (torch's PagedAttention):
    # the mask on each sequence's last page alone (the others are full), as planned; and everywhere
    "paged128-block-table": (dict(head_dim=128, tile_n=64, num_stages=2, ctas_per_sm=2, page_size=128,
                                  skip_masked_prefix=False, mask_last_page_only=True),
                             *_paged_attention_mods(), True, 4),
    "paged128-block-table-every-block": (dict(head_dim=128, tile_n=64, num_stages=2, ctas_per_sm=2, page_size=128,
                                              skip_masked_prefix=False), *_paged_attention_mods(), True, 4),
    # the polled merge (decode/polled_merge.py): the planner's B 1 window kernel; D 96 (three
    # scalar columns per lane), D 256 (eight: two v4, 8 splits per round) with the timeline
    # probe, D 32 with two consumer warpgroups (rows over eight warps)
    "polled-2cta-window-alibi": (dict(head_dim=128, tile_n=64, num_stages=2, ctas_per_sm=2, polled_merge=True),
                                 mods.alibi(num_heads=32), mods.sliding_window(4096), True, 4),
    "polled-hd96-deep": (dict(head_dim=96, tile_n=64, num_stages=6, polled_merge=True), None, mods.causal(), True, 6),
    "polled-hd256-timeline": (dict(head_dim=256, tile_n=64, num_stages=3, polled_merge=True, timeline=True),
                              None, mods.sliding_window(4096), True, 8),
    "polled-hd32-2wg": (dict(head_dim=32, tile_n=64, num_stages=6, num_mma_wg=2, polled_merge=True), None, None,
                        False, 2),
    # parity slots: two sets by launch parity, each split zeroing its slots of the other set
    # at its start (not planned yet: FLEXATTN_DECODE_SLOTS=parity)
    "polled-parity-window": (dict(head_dim=128, tile_n=64, num_stages=2, ctas_per_sm=2, polled_merge=True,
                                  parity_slots=True), None, mods.sliding_window(4096), True, 4),
    # a sliding window's masked prefix by arithmetic (decode_path.band_prefix, planned;
    # FLEXATTN_DECODE_BAND_PREFIX=0 keeps the analysis): no Float64 analysis, no ballot
    "polled-window-band-prefix": (dict(head_dim=128, tile_n=64, num_stages=2, ctas_per_sm=2, polled_merge=True),
                                  mods.alibi(num_heads=32), mods.sliding_window(4096), True, 4),
    # ... with the next tile's table and page-map reads issued a step ahead
    "paged128-block-table-prefetched": (dict(head_dim=128, tile_n=64, num_stages=2, ctas_per_sm=2, page_size=128,
                                             skip_masked_prefix=False, prefetch_tile_reads=True),
                                        *_paged_attention_mods(), True, 4),
}


def _config(name):
    """(the case's DecodeConfig, its hook): mods as the planner makes them, shifted to true
    positions by a runtime offset; the band-prefix case with the window's bound at those
    positions, as the planner gives it (``decode_path.band_prefix``)."""
    kw, score, mask, _, _ = CASES[name]
    shifted = None if mask is None else shift_queries(mask, OFFSETS)
    hook = IRModHook(None if score is None else shift_queries(score, OFFSETS), shifted)
    if name.endswith("band-prefix"):
        kw = dict(kw, prefix_band=decode_path.band_prefix(mask, shifted, True))
    return DecodeConfig(mods=hook, **kw), hook


def _ptx(name):
    cfg, hook = _config(name)
    return compile_decode(cfg, fake_args(hook), keep_ptx=True, tvm_ffi=CASES[name][3]).__ptx__


prefetch(_ptx, CASES)   # the fixture's jobs, started ahead (compile_pool.py)


@pytest.fixture(scope="module")
def compiled():
    """Compile each case once (in parallel processes) and keep its PTX."""
    return compile_all(_ptx)


@pytest.mark.parametrize("name", list(CASES))
def test_decode_ptx(compiled, name):
    kw, score, mask, _, tma_copies = CASES[name]
    ptx = compiled[name]
    assert ".target sm_90a" in ptx
    assert "wgmma.mma_async" in ptx and "ex2.approx" in ptx
    assert "setmaxnreg.inc" in ptx and "setmaxnreg.dec" in ptx
    # TMA copy sites: K and V, one per 64-column half of a box (D=128: two), times the
    # tile's pages where pages are smaller than the tile (an unrolled loop over them).
    assert ptx.count("cp.async.bulk.tensor") == tma_copies
    # QK^T (D/16 wgmmas) and PV (tile_n/16) for the bounded first block and the rest (the
    # rest twice, masked and not, where the mask applies on the last page alone).
    cfg = _config(name)[0]
    steps = 3 if cfg.mask_last_page_only else 2
    assert ptx.count("wgmma.mma_async") == steps * (cfg.head_dim // 16 + cfg.tile_n // 16)
    assert ("tanh.approx" in ptx) == (name == "paged256-hd64-softcap-fp16")
    # The masked-prefix skip: Float64 interval analysis only where a mask is traced, and
    # its search over prefixes, one candidate per lane counted by a ballot.
    f64 = len(re.findall(r"\.f64\b", ptx))
    analysed = mask is not None and cfg.skip_masked_prefix and cfg.prefix_band is None
    assert (f64 > 0) == analysed, f64
    assert ("vote.sync.ballot" in ptx) == analysed
    assert re.search(rf"\.minnctapersm\s+{cfg.ctas_per_sm}\b", ptx)
    if cfg.polled_merge:
        # The polled merge: one relaxed start ticket (no acq_rel atomic, no fence) and its
        # reset (parity slots: the phase's exchange by the merger), the merger flag handed on by barrier 3; every
        # partial value a relaxed store of its own (+0.0 as -0.0: D/2 O values and 2 LSEs
        # per thread); the merger's polling loads, the first round with the LSE, a trap
        # past the poll limit in both loops.
        assert len(re.findall(r"atom\.global(?:\.relaxed)?(?:\.gpu)?\.add", ptx)) == 1 and "acq_rel" not in ptx
        # (parity slots: no reset by atomic, the merger stores the next phase)
        assert ptx.count("atom.global.exch") == (not cfg.parity_slots)
        assert not re.search(r"membar\.gl|fence\.(sc|acq_rel)\.gpu", ptx)
        assert re.search(r"bar\.arrive\s+3,", ptx) and re.search(r"bar\.sync\s+3,", ptx)
        # (parity slots: the merger's consumers sync once before it sets the next phase)
        assert bool(re.search(r"bar\.sync\s+2,", ptx)) == cfg.parity_slots
        assert ptx.count("st.relaxed.gpu.global.b32") == cfg.head_dim // 2 + 2 + cfg.parity_slots   # (+ the phase)
        assert ptx.count("0x80000000; st.relaxed") == cfg.head_dim // 2 + 2
        per_lane = cfg.head_dim // 32
        width = 4 if per_lane % 4 == 0 else 2 if per_lane % 2 == 0 else 1
        chunk = chunk_splits(cfg.head_dim)
        vector = {4: ".v4", 2: ".v2", 1: ""}[width]
        assert ptx.count(f"ld.relaxed.gpu.global{vector}.b32") == 2 * chunk * per_lane // width + (width == 1)
        if width > 1:
            # the LSE (parity slots: and each consumer thread's read of the phase word)
            assert ptx.count("ld.relaxed.gpu.global.b32") == 1 + cfg.parity_slots
        assert ptx.count("trap;") == 2
        assert "barrier.cluster" not in ptx and "mapa" not in ptx
    elif cfg.cluster_splits == 1:
        # The in-kernel merge: one acq_rel arrival ticket per split CTA (atom's default scope
        # is the GPU), the last arrival's reset, the arrival barrier, vectorized partial reads.
        assert len(re.findall(r"atom\.global\.acq_rel(?:\.gpu)?\.add", ptx)) == 1
        assert ptx.count("atom.global.exch") == 1
        assert len(re.findall(r"bar\.sync\s+2,", ptx)) == 2
        assert re.search(r"ld\.global\.v[24]\.(b32|f32)", ptx)   # a lane's D/32 partial columns at once
        assert "barrier.cluster" not in ptx and "mapa" not in ptx
    else:
        # The cluster merge: no tickets; two cluster barriers on the producer's path and two
        # on the consumers'; one distributed-shared-memory read per split of a row (D/32
        # columns at once) plus the LSE read; the consumers' barrier before the partial
        # overwrites the K ring.
        assert "atom.global" not in ptx
        assert ptx.count("barrier.cluster.arrive") == 4 and ptx.count("barrier.cluster.wait") == 4
        # a lane's D/32 columns in the widest loads their count allows (load_f32s_in_rank_chunked)
        per_lane = lane_columns(cfg.head_dim)
        width = 1 if cfg.head_dim % 32 else 4 if per_lane % 4 == 0 else 2 if per_lane % 2 == 0 else 1
        vector = {4: ".v4", 2: ".v2", 1: ""}[width]
        row_loads = cfg.cluster_splits * per_lane // width
        assert ptx.count(f"ld.shared::cluster{vector}.f32") == row_loads + (width == 1)
        if width > 1:
            assert ptx.count("ld.shared::cluster.f32") == 1   # the LSE
        assert len(re.findall(r"bar\.sync\s+2,", ptx)) == 1
    assert ("globaltimer" in ptx) == cfg.timeline == ("%smid" in ptx)


class _NoHoisting(IRModHook):
    def row_invariants(self, b, h, q, args):
        return None


def test_walks_of_listed_blocks_mask_the_last_page_alone(compiled):
    """``mask_last_page_only``: the loop's steps come in two bodies, one evaluating the mask
    (tiles over a sequence's last page) and one without it — its page map, lengths and
    block-table reads absent (fewer scalar loads per body than the kernel that masks every
    step: 137 when written, with two bodies; 47 once those reads came once per tile)."""
    once, every = compiled["paged128-block-table"], compiled["paged128-block-table-every-block"]
    loads = [len(re.findall(r"ld\.global(?:\.nc)?\.b32\b", ptx)) for ptx in (once, every)]
    assert loads[0] < 1.5 * loads[1], loads   # three step bodies, one of them unmasked
    assert once.count("wgmma.mma_async") == 3 * every.count("wgmma.mma_async") // 2


class _NoTileHoisting(IRModHook):
    def tile_invariants(self, *args, **kwargs):
        return None


def _compiled_with(hook_class, name) -> str:
    """The PTX of case ``name`` with its mods through ``hook_class`` (an ``IRModHook`` with
    a hoisting turned off)."""
    kw, score, mask, ffi, _ = CASES[name]
    hook = hook_class(shift_queries(score, OFFSETS), shift_queries(mask, OFFSETS))
    return compile_decode(DecodeConfig(mods=hook, **kw), fake_args(hook), keep_ptx=True, tvm_ffi=ffi).__ptx__


def _scalar_reads(ptx, types: str) -> int:
    return len(re.findall(rf"\bld\.global(?:\.nc)?\.(?:{types})\b", ptx))


def test_walks_read_the_table_and_page_map_once_per_tile(compiled):
    """A walk's mods read the key's page as ``page_map[b, table[b, kv // 128]]`` (the
    converted PagedAttention mask and a score at physical positions): constant over a
    64-key tile, so read once per tile and row before the wait for K, not once per key
    (``mod_emit.tile_invariant_roots``; 137 scalar loads in the kernel without, 47 with,
    when written)."""
    name, types = "paged128-block-table-every-block", "b32|b64|s64|u64|u32|s32"
    hoisted, per_key = (_scalar_reads(ptx, types) for ptx in (compiled[name], _compiled_with(_NoTileHoisting, name)))
    assert 2 * hoisted < per_key, (hoisted, per_key)


def test_walks_prefetch_their_tile_reads(compiled):
    """``prefetch_tile_reads``: the loop's step reads the next tile's table and page map
    (issued before its wait for K, consumed one step later: carried through the loop), so
    the loop body has no more scalar loads than without the prefetch; the prologue's read
    of the first looped tile adds one set."""
    every, ahead = compiled["paged128-block-table-every-block"], compiled["paged128-block-table-prefetched"]
    types = "b32|b64|s64|u64|u32|s32"
    assert _scalar_reads(every, types) <= _scalar_reads(ahead, types) <= _scalar_reads(every, types) + 8
    assert ahead.count("wgmma.mma_async") == every.count("wgmma.mma_async")
    with pytest.raises(ValueError, match="prefetch_tile_reads"):
        DecodeConfig(page_size=128, prefetch_tile_reads=True, mask_last_page_only=True)


def test_decode_hoists_row_invariant_reads(compiled):
    """ALiBi's slope and the true query position (q + q_offset[b]) are read once per row
    before the kv loop: without hoisting, the bounded first block and the loop body each
    read them again (after the first K block has arrived, behind the first round of K/V
    loads)."""
    name, types = "2cta-tile64-window-alibi", "b32|f32|u32|s32"
    hoisted, unhoisted = (_scalar_reads(ptx, types) for ptx in (compiled[name], _compiled_with(_NoHoisting, name)))
    assert hoisted < unhoisted, (hoisted, unhoisted)


@pytest.mark.parametrize("name", list(CASES))
def test_decode_no_spills(compiled, name):
    usage = resource_usage_from_ptx(compiled[name])
    if usage is None:
        pytest.skip("no ptxas on PATH")
    assert usage.spill_store_bytes == 0 and usage.spill_load_bytes == 0 and usage.stack_bytes == 0, usage
    assert usage.wgmma_serialized is None, usage
    cfg = _config(name)[0]
    threads = 128 * (1 + cfg.num_mma_wg)
    assert usage.registers * threads * cfg.ctas_per_sm <= 65536, usage   # the CTAs fit one SM


def test_parity_slots_store_without_waiting_and_zero_in_the_slack(compiled):
    """Parity slots: warp 1 counts the CTA in (one relaxed atomic) and, in the merging
    CTA, zeroes its own slots of the other set (16-byte stores) before it arrives on
    barrier 3; each consumer thread reads the phase word itself at its start (before the
    stream's first wgmma) and stores its partial without waiting on anything; after
    barrier 3 the splits that do not merge zero the other set where they stored (paired
    zeros), the merger polls, stores the merged row and, after a consumer barrier, sets
    the next launch's phase (a relaxed store after everything: an atomic's return would
    hold the merger's exit, ~0.15 µs on the H200). The emptied kernel: the
    last starter resets the ticket at the start, the emptying after the polls."""
    def order(ptx):
        marks = []
        for m in re.finditer(r"st\.global\.v4\.b32|st\.global\.v2\.b32|bar\.arrive\s+3|bar\.sync\s+3|bar\.sync\s+2"
                             r"|ld\.relaxed\.gpu\.global\.v4|ld\.relaxed\.gpu\.global\.b32|wgmma\.mma_async"
                             r"|atom\.global\.add|atom\.global\.exch|st\.relaxed\.gpu", ptx):
            mark = re.sub(r"\s+", " ", m.group(0))
            if not marks or marks[-1] != mark:
                marks.append(mark)
        return marks

    cfg, hook = _config("polled-window-band-prefix")
    ptx = {False: compiled["polled-window-band-prefix"],
           True: compile_decode(dataclasses.replace(cfg, parity_slots=True), fake_args(hook), keep_ptx=True,
                                tvm_ffi=True).__ptx__}
    polls = ["ld.relaxed.gpu.global.v4", "ld.relaxed.gpu.global.b32", "ld.relaxed.gpu.global.v4"]
    stream = ["wgmma.mma_async"]
    assert order(ptx[True]) == ["atom.global.add", "st.global.v4.b32", "bar.arrive 3", "ld.relaxed.gpu.global.b32",
                                *stream, "st.relaxed.gpu", "bar.sync 3", "st.global.v2.b32", *polls,
                                "st.global.v2.b32", "bar.sync 2", "st.relaxed.gpu"], order(ptx[True])
    assert order(ptx[False]) == ["atom.global.add", "atom.global.exch", "bar.arrive 3", *stream, "st.relaxed.gpu",
                                 "bar.sync 3", *polls, "st.global.v2.b32", "st.global.v4.b32"], order(ptx[False])
    # the splits that do not merge zero every value they stored (the O values in pairs) and the LSE
    assert ptx[True].count("st.global.v2.b32") - ptx[False].count("st.global.v2.b32") == 32
    assert resource_usage_from_ptx(ptx[True]).spill_store_bytes == 0
    # the phase word: parity bit 16, the split count from bit 24
    assert re.search(r"shl\.b32\s+%r\d+, %r\d+, 24", ptx[True]) and not re.search(r"shl\.b32\s+%r\d+, %r\d+, 24",
                                                                                ptx[False])
    with pytest.raises(ValueError, match="parity_slots"):
        DecodeConfig(parity_slots=True)


@pytest.mark.parametrize("group_major", [False, True])
@pytest.mark.parametrize("sets, capacity", [(1, None), (2, 16)])
def test_slot_views_cover_their_slots_once(group_major, sets, capacity):
    """``decode_path.slot_views``: views (never copies) [splits, B, Hq, q_len, D] and
    [splits, B, Hq, q_len] over the flat slot arrays, every (split, row) slot its own
    memory, the LSE's q_len contiguous; group-major puts a row's splits side by side (mode
    0's stride: one slot, or two with parity sets), split-major a split's rows."""
    import torch

    B, Hq, q_len, D, splits = 2, 8, 3, 64, 5
    cap = capacity or splits
    o_flat, lse_flat = torch.zeros(cap * sets * B * Hq * q_len * D), torch.zeros(cap * sets * B * Hq * q_len)
    o, lse = decode_path.slot_views(o_flat, lse_flat, splits, sets, (B, Hq, q_len, D), group_major, capacity)
    assert tuple(o.shape) == (splits, B, Hq, q_len, D) and tuple(lse.shape) == (splits, B, Hq, q_len)
    assert o.data_ptr() == o_flat.data_ptr() and lse.data_ptr() == lse_flat.data_ptr()
    assert o.stride(-1) == 1 and lse.stride(-1) == 1
    assert o.stride(0) == (sets * D if group_major else sets * B * Hq * q_len * D)
    o.copy_(torch.arange(o.numel(), dtype=torch.float32).reshape(o.shape) + 1)
    lse.copy_(torch.arange(lse.numel(), dtype=torch.float32).reshape(lse.shape) + 1)
    for flat, view in ((o_flat, o), (lse_flat, lse)):
        written = flat[flat != 0]
        assert written.numel() == view.numel() and written.unique().numel() == view.numel()


def test_balanced_splits_compile(compiled, monkeypatch):
    """``balanced_splits``: the split's range by two divisions of s * total by the split
    count (one more than the ceil split's one), nothing else changed, no spills; planned
    on every kernel of a plan with FLEXATTN_DECODE_BALANCED=1."""
    cfg, hook = _config("polled-window-band-prefix")
    ptx = {False: compiled["polled-window-band-prefix"],
           True: compile_decode(dataclasses.replace(cfg, balanced_splits=True), fake_args(hook), keep_ptx=True,
                                tvm_ffi=True).__ptx__}
    divisions = {b: len(re.findall(r"\bdiv\.", p)) for b, p in ptx.items()}
    assert divisions[True] == divisions[False] + 1, divisions
    _assert_no_spills(ptx[True])
    monkeypatch.setenv("FLEXATTN_DECODE_BALANCED", "1")
    plan, cap = _b1_plan(mods.sliding_window(4096))
    kernel, splits, _, _ = plan._launch_parts(cap, 132, None, False)
    assert splits == 16 and plan._kernel(kernel)[0].balanced_splits


def _assert_no_spills(ptx):
    """ptxas reports no spill stores and no stack (where ptxas is there to report)."""
    usage = resource_usage_from_ptx(ptx)
    assert usage is None or (usage.spill_store_bytes == 0 and usage.stack_bytes == 0), usage


def _b1_plan(mask):
    """A B1 L128k decode plan (Hq 32, Hkv 8, D 128) on a CPU workspace -> (plan, its length)."""
    return _b1_launch(mask).plan, 131072


def _b1_launch(mask, length: int = 131072):
    """A decode step's launch (``prepare_decode``) at B1 (Hq 32, Hkv 8, D 128), a cache of
    128k rows holding ``length`` keys, on a CPU workspace: its plan is made anew."""
    import torch

    B, Hq, cap = 1, 32, 131072
    k = torch.zeros(B, 8, cap, 128, dtype=torch.bfloat16)
    cache = KVCache(k, k, torch.tensor([length], dtype=torch.int32))
    q = torch.zeros(B, Hq, 1, 128, dtype=torch.bfloat16)
    out, lse = torch.empty_like(q), torch.empty(B, Hq, 1)
    ws = decode_path.DecodeWorkspace(alloc=lambda shape, dt: torch.empty(shape, dtype=getattr(torch, dt)),
                                     tickets=lambda n: torch.zeros(max(n, 16), dtype=torch.int32),
                                     scratch=lambda n: torch.empty(n), uploader=lambda into: lambda values: None,
                                     marked_scratch=lambda n: torch.zeros(max(n, 1)), zeroed=None)
    device = Device(0, lambda x: x if isinstance(x, torch.Tensor) else torch.from_numpy(np.array(x)))
    return decode_path.prepare_decode(q, cache, out, lse, decode_path.DecodeSite(device, 132, ws),
                                      decode_path.DecodeMods(None, mask), overrides=decode_path.DecodeOverrides())


def test_merge_chunk_loads_no_split_twice(compiled, monkeypatch):
    """``merge_chunk`` n: the polled merge's first round loads exactly n splits' partial
    columns (the first round's and the later rounds' loads: 2 n ``ld.relaxed`` v4 at D 128,
    against 2 x 16 with the head dim's chunk, clamped), no spills; planned as the launch's
    split count where a band bounds the visited blocks and the longest sequence has filled
    it (the window step's 13), not while it fills, nor for a growing cache's counts, nor
    past the head dim's chunk, nor with FLEXATTN_DECODE_MERGE_CHUNK=generic."""
    cfg, hook = _config("polled-window-band-prefix")
    exact = compile_decode(dataclasses.replace(cfg, merge_chunk=13), fake_args(hook), keep_ptx=True,
                           tvm_ffi=True).__ptx__
    loads = {name: ptx.count("ld.relaxed.gpu.global.v4")
             for name, ptx in (("generic", compiled["polled-window-band-prefix"]), ("exact", exact))}
    assert loads == {"generic": 2 * chunk_splits(128), "exact": 2 * 13}, loads
    _assert_no_spills(exact)
    for bad in (dict(merge_chunk=17, polled_merge=True), dict(merge_chunk=4)):
        with pytest.raises(ValueError, match="merge_chunk"):
            DecodeConfig(**bad)
    plan, cap = _b1_plan(mods.sliding_window(4096))
    kernel, splits, _, _ = plan._launch_parts(cap, 132, None, False)
    assert kernel[2] and kernel[3] == splits == 13 and plan._kernel(kernel)[0].merge_chunk == 13, kernel
    assert plan._band_hi == 4096
    filling = plan._launch_parts(3000, 132, None, False)[0]   # (the window not yet full: counts still move)
    assert filling[2] and filling[3] == 0, filling
    chunk = chunk_splits(128)
    assert decode_path.stable_merge_chunk(13, chunk, 4096, 4098, 1) == 13
    assert decode_path.stable_merge_chunk(13, chunk, 4096, 4097, 1) == 0
    assert decode_path.stable_merge_chunk(17, chunk, 4096, cap, 1) == 0   # (past the head dim's chunk of 16)
    assert decode_path.stable_merge_chunk(13, chunk, None, cap, 1) == 0   # (no band: a growing cache)
    monkeypatch.setenv("FLEXATTN_DECODE_MERGE_CHUNK", "generic")
    plan, cap = _b1_plan(mods.sliding_window(4096))
    assert plan._launch_parts(cap, 132, None, False)[0][3] == 0


def test_caller_empties_slots_leaves_the_emptying_out(compiled):
    """The benchmarks' ``caller_empties_slots`` (decode_floor.py --zero-slots with
    FLEXATTN_DECODE_SLOTS=caller): the same polled kernel without the merger's emptying —
    its zeroing loop over the splits' slots and the LSE slot's zero are the only stores
    gone; it needs the polled merge. With parity slots (``parity-caller``) no split zeroes
    the other set."""
    cfg, hook = _config("polled-window-band-prefix")
    ptx = {False: compiled["polled-window-band-prefix"],
           True: compile_decode(dataclasses.replace(cfg, caller_empties_slots=True), fake_args(hook), keep_ptx=True,
                                tvm_ffi=True).__ptx__}
    assert ptx[False].count("st.global.v4.b32") == 1 and ptx[True].count("st.global.v4.b32") == 0
    assert ptx[False].count("st.global") - ptx[True].count("st.global") == 2
    assert ptx[False].count("st.relaxed.gpu.global.b32") == ptx[True].count("st.relaxed.gpu.global.b32")
    # with parity slots (parity-caller): no split zeroes the other set either
    parity = dataclasses.replace(cfg, parity_slots=True)
    zeroing = {c: [compile_decode(dataclasses.replace(parity, caller_empties_slots=c), fake_args(hook), keep_ptx=True,
                                  tvm_ffi=True).__ptx__.count(f"st.global.{w}.b32") for w in ("v4", "v2")]
               for c in (False, True)}
    assert zeroing == {False: [1, 33], True: [0, 1]}, zeroing     # (the merged row: one v2 store)
    with pytest.raises(ValueError, match="caller_empties_slots"):
        DecodeConfig(caller_empties_slots=True)


def test_band_start_tiles(compiled, monkeypatch):
    """``band_start_tiles``: a band's kv tiles start at its first key (the TMA's key
    coordinate offset by it: the same copies, no spills, other PTX), planned for a window
    over a contiguous cache, not with FLEXATTN_DECODE_BAND_TILES=aligned, not without a
    band (causal), and refused without one or with pages."""
    cfg, hook = _config("polled-window-band-prefix")
    started = compile_decode(dataclasses.replace(cfg, band_start_tiles=True), fake_args(hook), keep_ptx=True,
                             tvm_ffi=True).__ptx__
    plain = compiled["polled-window-band-prefix"]
    assert started != plain and started.count("cp.async.bulk.tensor") == plain.count("cp.async.bulk.tensor") == 4
    _assert_no_spills(started)
    for bad in (dict(band_start_tiles=True), dict(band_start_tiles=True, prefix_band=(7, True), page_size=64)):
        with pytest.raises(ValueError, match="band_start_tiles"):
            DecodeConfig(**bad)
    assert _b1_plan(mods.sliding_window(4096))[0].config.band_start_tiles
    assert not _b1_plan(mods.causal())[0].config.band_start_tiles
    monkeypatch.setenv("FLEXATTN_DECODE_BAND_TILES", "aligned")
    assert not _b1_plan(mods.sliding_window(4096))[0].config.band_start_tiles


@pytest.mark.parametrize("name", ["polled-window-band-prefix", "paged128-block-table", "hd192-2wg"])
def test_zero_v_overhang(compiled, name, monkeypatch):
    """``zero_v_overhang``: the bound block's V rows past the length zeroed before P V — a
    loop of 16-byte shared stores behind a branch, one more async-proxy fence and named
    barrier 4 over the consumer threads, in the bound step only (the wgmmas unchanged), no
    spills. Planned per step (FLEXATTN_DECODE_V_OVERHANG=auto, the default) where a length
    falls short of the cache's rows, not where every length is the view's (the kernel
    without it: byte-identical PTX); "keep" never, "zero" always, anything else refused."""
    cfg, hook = _config(name)
    zeroing = compile_decode(dataclasses.replace(cfg, zero_v_overhang=True), fake_args(hook), keep_ptx=True,
                             tvm_ffi=CASES[name][3]).__ptx__
    plain = compiled[name]
    assert not re.search(r"bar\.sync\s+4,", plain)
    assert plain.count("fence.proxy.async") + 1 == zeroing.count("fence.proxy.async")
    assert len(re.findall(rf"bar\.sync\s+4,\s*{cfg.num_mma_wg * 128};", zeroing)) == 1
    assert zeroing.count("wgmma.mma_async") == plain.count("wgmma.mma_async")
    assert zeroing.count("st.shared.v4.b32 \t[") and "{0, 0, 0, 0}" in zeroing and "{0, 0, 0, 0}" not in plain
    _assert_no_spills(zeroing)
    window = mods.sliding_window(4096)
    for policy, planned in (("auto", {131072: False, 131035: True}), ("keep", {131072: False, 131035: False}),
                            ("zero", {131072: True, 131035: True})):
        monkeypatch.setenv("FLEXATTN_DECODE_V_OVERHANG", policy)
        assert {n: _b1_launch(window, n).config.zero_v_overhang for n in planned} == planned, policy
    monkeypatch.setenv("FLEXATTN_DECODE_V_OVERHANG", "yes")
    with pytest.raises(ValueError, match="FLEXATTN_DECODE_V_OVERHANG"):
        _b1_launch(window)


def test_config_validation():
    assert DecodeConfig().key() == DecodeConfig().key()
    assert DecodeConfig().key() != DecodeConfig(page_size=64).key()
    for bad in (dict(head_dim=72), dict(head_dim=288), dict(head_dim=16), dict(head_dim=256),   # 256: 3-stage ring too big
                dict(dtype="fp32"), dict(page_size=8), dict(page_size=48),
                dict(page_size=192), dict(num_mma_wg=3), dict(num_stages=5), dict(ctas_per_sm=3),
                dict(ctas_per_sm=2), dict(ctas_per_sm=2, num_mma_wg=2, tile_n=64, num_stages=1)):
        with pytest.raises(ValueError):
            DecodeConfig(**bad)
    # cluster sizes 1/2/4/8/16; the fp32 O tile must fit the K ring (num_stages x tile_n >= 2 x tile_m)
    for bad in (dict(cluster_splits=3), dict(cluster_splits=32), dict(tile_n=64, num_stages=1, cluster_splits=2),
                dict(cluster_splits=2, polled_merge=True), dict(head_dim=80, polled_merge=True)):
        with pytest.raises(ValueError):
            DecodeConfig(**bad)
    DecodeConfig(tile_n=64, num_stages=2, ctas_per_sm=2, cluster_splits=8)
    for ok in (16, 32, 64, 128, 256, 1024):
        DecodeConfig(page_size=ok)
    two = DecodeConfig(tile_n=64, num_stages=3, ctas_per_sm=2)
    assert 2 * (two.smem_bytes + 1024) <= 228 * 1024 and two.regs == (40, 216)
    assert DecodeConfig().regs == (40, 240) and two.key() != DecodeConfig(tile_n=64).key()


def test_head_dims_fit_their_rings():
    """decode_path.fit_head_dim: tunings sized for head dims up to 128 unchanged; wider heads
    get one CTA per SM and as many K/V bytes in flight as ONE_CTA_TUNING at 128, in stages
    that fit beside the Q tile; the pair-cluster merge only where the ring holds the O tile."""
    from flexattn.core.decode_path import DEFAULT_TUNING, ONE_CTA_TUNING, fit_head_dim

    for D in (32, 64, 96, 128):
        assert fit_head_dim(DEFAULT_TUNING, D) == DEFAULT_TUNING
    want = {(160, 1): 4, (192, 1): 4, (224, 1): 3, (256, 1): 3, (192, 2): 3, (256, 2): 2}
    for (D, wg), stages in want.items():
        for tuning in (DEFAULT_TUNING, ONE_CTA_TUNING):
            fit = fit_head_dim(tuning, D, wg)
            assert (fit.num_stages, fit.ctas_per_sm, fit.tile_n) == (stages, 1, 64), (D, wg)
            cfg = DecodeConfig(head_dim=D, num_mma_wg=wg, tile_n=fit.tile_n, num_stages=fit.num_stages,
                               cluster_splits=2 if fit.cluster_merge else 1)
            assert cfg.smem_bytes <= cfg.smem_limit
            assert fit.cluster_merge == (stages * 64 >= 128 * wg)


def test_choose_splits():
    # 132 SMs, 8 kv heads, one row block; 128-key tiles, one CTA per SM.
    one = DecodeTuning(tile_n=128, num_stages=3, ctas_per_sm=1)
    assert choose_splits(8, 8, 1, 128, 132) == 4               # the default: 2 CTAs/SM, 64-key tiles
    assert choose_splits(8, 8, 1, 64, 132, one) == 2          # B 8, 8k keys: 128 CTAs
    assert choose_splits(1, 8, 1, 1024, 132, one) == 16       # B 1, 128k keys
    assert choose_splits(64, 8, 1, 64, 132, one) == 1         # already > 1 wave
    assert choose_splits(1, 8, 1, 3, 132, one) == 1           # too short to split (3 blocks, 384 keys)
    assert choose_splits(1, 1, 1, 10, 132, one) == 5          # 2+ blocks (256 keys) per split, none empty
    assert choose_splits(1, 1, 1, 0, 132, one) == 1
    # balanced ranges (DecodeConfig.balanced_splits): the count is not trimmed — B 1, a
    # 4096-key window's 65 blocks: 16 splits of 4-5 blocks instead of 13 of 5
    assert choose_splits(1, 8, 1, 65, 132) == 13 and choose_splits(1, 8, 1, 65, 132, balanced=True) == 16
    assert choose_splits(1, 1, 1, 10, 132, one, balanced=True) == 5
    for b, h, n in ((1, 1, 37), (3, 2, 1000), (2, 8, 9)):
        s = choose_splits(b, h, 1, n, 132, one)
        per = -(-n // s)
        assert (s - 1) * per < n and b * h * s <= max(132, b * h)   # no empty split, one wave


def test_choose_splits_tuning():
    # Two resident CTAs per SM: twice the slots; 64-key tiles: MIN_KEYS_PER_SPLIT in blocks.
    two = DecodeTuning(tile_n=64, num_stages=3, ctas_per_sm=2)
    assert choose_splits(8, 8, 1, 128, 132, two) == 4         # B 8, 8k keys: 256 of 264 slots
    assert choose_splits(1, 8, 1, 2048, 132, two) == 33       # B 1, 128k keys: 264 CTAs
    assert choose_splits(1, 8, 1, 2048, 132, DecodeTuning(waves=2)) == 33
    assert choose_splits(1, 1, 1, 17, 132, two) == 4          # 4+ blocks (256 keys) per split


def test_choose_launch():
    """Two splits merge in clusters of two; where the default tuning needs 4 splits or
    more, the deep one-CTA-per-SM tuning fills the GPU with half; more splits merge by tickets;
    explicit tunings are kept (132 SMs, Hkv 8)."""
    from flexattn.core.decode_path import DEFAULT_TUNING, ONE_CTA_TUNING, choose_launch

    assert choose_launch(8, 8, 1, 128, 132) == (ONE_CTA_TUNING, 2, 2)        # B 8, 8k keys
    assert choose_launch(8, 8, 1, 1024, 132) == (ONE_CTA_TUNING, 2, 2)       # B 8, 64k keys
    assert choose_launch(16, 8, 1, 128, 132) == (DEFAULT_TUNING, 2, 2)       # 256 CTAs in pairs
    assert choose_launch(1, 8, 1, 2048, 132) == (ONE_CTA_TUNING, 16, 1)      # B 1, 128k keys: tickets
    assert choose_launch(4, 8, 1, 2048, 132) == (ONE_CTA_TUNING, 4, 1)
    assert choose_launch(64, 8, 1, 128, 132) == (DEFAULT_TUNING, 1, 1)
    explicit = DecodeTuning(tile_n=64, num_stages=3, ctas_per_sm=2)
    assert choose_launch(8, 8, 1, 128, 132, explicit) == (explicit, 4, 1)
    off = DecodeTuning(tile_n=64, num_stages=2, ctas_per_sm=2, cluster_merge=False)
    assert choose_launch(16, 8, 1, 128, 132, off) == (off, 2, 1)


def test_decode_unsupported_reasons():
    q = np.zeros((1, 4, 1, 128), np.float32)
    assert "bfloat16" in decode_unsupported(q, q, q, 0)
    import torch

    qb = torch.zeros(1, 4, 1, 16, dtype=torch.bfloat16)
    assert "head dims" in decode_unsupported(qb, qb, qb, 0)
    for d in (32, 80, 96, 144, 256):
        qb = torch.zeros(1, 4, 1, d, dtype=torch.bfloat16)
        assert decode_unsupported(qb, qb, qb, 0) is None
    qb = torch.zeros(1, 4, 1, 128, dtype=torch.bfloat16)
    assert "dtype" in decode_unsupported(qb, qb.half(), qb.half(), 0)
    assert "page" in decode_unsupported(qb, qb, qb, 48)
    assert decode_unsupported(qb, qb, qb, 64) is None


def test_decode_into_refuses_before_launch():
    import torch

    cache = KVCache(torch.zeros(2, 2, 64, 128, dtype=torch.bfloat16), torch.zeros(2, 2, 64, 128, dtype=torch.bfloat16),
                    np.array([10, 20], np.int32))
    out, lse = torch.empty(2, 4, 17, 128, dtype=torch.bfloat16), torch.empty(2, 4, 17)

    def call(q, c=cache, **kw):
        return decode_path.decode_into(q, c, out, lse, decode_path.DecodeSite(Device(0, None), 132, None), **kw)

    with pytest.raises(ValueError, match="1..16"):
        call(torch.zeros(2, 4, 17, 128, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="multiple"):
        call(torch.zeros(2, 3, 1, 128, dtype=torch.bfloat16))
    pages = torch.zeros(8, 64, 2, 128, dtype=torch.bfloat16)
    paged = PagedKVCache(pages, pages, torch.zeros(2, 4, dtype=torch.int64), np.array([10, 20]))
    with pytest.raises(ValueError, match="int32 page table"):
        call(torch.zeros(2, 4, 1, 128, dtype=torch.bfloat16), paged)
    with pytest.raises(ValueError, match="out/lse"):
        call(torch.zeros(2, 4, 1, 128, dtype=torch.bfloat16))


def test_steps_share_one_config():
    """Stepping the decoder changes the offsets (values), never the kernel config."""
    keys = set()
    for step in range(3):
        off = np.full(2, 100 + step, np.int32)
        score = shift_queries(mods.alibi(num_heads=8), off)
        mask = shift_queries(mods.sliding_window(64), off)
        keys.add(decode_path._config_for("bf16", 128, 1, 64, score, mask).key())
    assert len(keys) == 1


def test_true_position_rewrite_is_cached():
    """The traced rewrite is reused across steps (only the offset capture changes), also
    for mods that never read the query position (softcap: no offset to swap)."""
    alibi, softcap = mods.alibi(num_heads=4), mods.softcap(5.0)
    a1 = decode_path._at_true_positions(alibi, np.array([3, 7], np.int32))
    a2 = decode_path._at_true_positions(alibi, np.array([4, 8], np.int32))
    assert a1.expr is a2.expr
    q, kv = np.arange(1)[:, None], np.arange(10)[None, :]
    np.testing.assert_allclose(a2(np.zeros((1, 10)), 1, 2, q, kv), alibi(np.zeros((1, 10)), 1, 2, q + 8, kv))
    s1 = decode_path._at_true_positions(softcap, np.array([3], np.int32))
    s2 = decode_path._at_true_positions(softcap, np.array([9], np.int32))
    assert s1.expr is s2.expr
    np.testing.assert_allclose(s2(np.full((1, 3), 20.0), 0, 0, q, kv[:, :3]), softcap(np.full((1, 3), 20.0), 0, 0, q, kv[:, :3]))


def test_steps_reuse_one_plan():
    """A decoder's steps with the same mod objects share one DecodePlan (from the second
    sighting): the same config and positions buffer, into which every step uploads its
    own lengths and offsets; new mod objects make a new plan; a reused plan still checks
    the step's lengths. Nothing launches (CPU arrays, no compile)."""
    import torch

    B = 2
    k = torch.zeros(B, 2, 256, 128, dtype=torch.bfloat16)
    cache = KVCache(k, k, torch.tensor([100, 37], dtype=torch.int32))
    q = torch.zeros(B, 8, 1, 128, dtype=torch.bfloat16)
    out, lse = torch.empty_like(q), torch.empty(B, 8, 1)
    uploads = []

    def uploader(into):
        def put(values):
            host = np.asarray(values, np.int32).reshape(tuple(into.shape))
            into[...] = torch.from_numpy(host)
            uploads.append((host, into))
        return put

    ws = decode_path.DecodeWorkspace(alloc=lambda shape, dt: torch.empty(shape, dtype=getattr(torch, dt)),
                                     tickets=lambda n: torch.zeros(max(n, 16), dtype=torch.int32),
                                     scratch=lambda n: torch.empty(n), uploader=uploader)
    device = Device(0, lambda x: x if isinstance(x, torch.Tensor) else torch.from_numpy(np.array(x)))
    score, mask = mods.alibi(num_heads=8), mods.sliding_window(64)
    site, step_mods = decode_path.DecodeSite(device, 132, ws), decode_path.DecodeMods(score, mask)
    steps = []
    for _ in range(4):
        steps.append(decode_path.prepare_decode(q, cache, out, lse, site, step_mods))
        cache.lengths += 1
    assert steps[0].config is not steps[1].config           # first sighting: not kept
    assert steps[1].config is steps[2].config is steps[3].config
    assert uploads[1][1] is uploads[2][1] is uploads[3][1]   # one positions buffer
    assert [h[0].tolist() for h, _ in uploads] == [[100, 37], [101, 38], [102, 39], [103, 40]]
    assert [h[1].tolist() for h, _ in uploads] == [[99, 36], [100, 37], [101, 38], [102, 39]]
    other = decode_path.prepare_decode(q, cache, out, lse, site, decode_path.DecodeMods(mods.alibi(num_heads=8), mask))
    assert other.config is not steps[3].config
    # The window may exclude the cache's head: the kernel keeps its masked-prefix analysis;
    # under a causal mask the first key is always attended: compiled out.
    assert steps[3].config.skip_masked_prefix
    causal = decode_path.prepare_decode(q, cache, out, lse, site, decode_path.DecodeMods(score, mods.causal()))
    assert not causal.config.skip_masked_prefix
    cache.lengths[1] = 0
    with pytest.raises(ValueError, match="query tokens"):
        decode_path.prepare_decode(q, cache, out, lse, site, step_mods)


def test_plan_run_repeated_steps():
    """``DecodePlan.run``, the adapters' repeated-step path, with a stand-in for the compiled
    kernel: each step uploads its own lengths and offsets, checks them (batch, query
    tokens, capacity) before uploading, reuses its partials while the workspace's scratch
    stays (new views when it grows or the split count changes), and launches with the
    plan's own lengths buffer and tickets. Nothing compiles."""
    import torch

    B, Hq, cap = 2, 8, 4096
    k = torch.zeros(B, 2, cap, 128, dtype=torch.bfloat16)
    cache = KVCache(k, k, torch.tensor([100, 37], dtype=torch.int32))
    q = torch.zeros(B, Hq, 1, 128, dtype=torch.bfloat16)
    out, lse = torch.empty_like(q), torch.empty(B, Hq, 1)
    uploads, scratch = [], [torch.empty(0)]

    def uploader(into):
        return lambda values: uploads.append(list(values))

    def get_scratch(n):
        if scratch[0].numel() < n:
            scratch[0] = torch.empty(n)
        return scratch[0]

    ws = decode_path.DecodeWorkspace(alloc=lambda shape, dt: torch.empty(shape, dtype=getattr(torch, dt)),
                                     tickets=lambda n: torch.zeros(max(n, 16), dtype=torch.int32),
                                     scratch=get_scratch, uploader=uploader)
    device = Device(0, lambda x: x if isinstance(x, torch.Tensor) else torch.from_numpy(np.array(x)))
    tickets_only = dataclasses.replace(decode_path.DEFAULT_TUNING, cluster_merge=False)   # the partials' path
    plan = decode_path.prepare_decode(q, cache, out, lse, decode_path.DecodeSite(device, 132, ws),
                                      decode_path.DecodeMods(mods.alibi(num_heads=Hq), mods.causal()),
                                      overrides=decode_path.DecodeOverrides(tuning=tickets_only)).plan
    launches = []
    # splits 1 and 13: the ticket merge; lengths below the cache's rows: V overhang zeroed
    plan._fns[(plan.tuning, 1, False, 0, True)] = lambda *args: launches.append(args)
    assert plan.run(q, k, k, None, out, lse, [100, 37], 132) == 1            # 2 blocks: one split
    assert plan.run(q, k, k, None, out, lse, [4000, 37], 132) == 13          # 63 blocks: 13 of >= 256 keys
    assert plan.run(q, k, k, None, out, lse, [4001, 38], 132) == 13
    assert uploads[-3:] == [[100, 37, 99, 36], [4000, 37, 3999, 36], [4001, 38, 4000, 37]]
    assert launches[1][7] is launches[2][7] and launches[1][8] is launches[2][8]   # partials reused
    assert tuple(launches[1][7].shape) == (13, B, Hq, 1, 128) and tuple(launches[1][8].shape) == (13, B, Hq, 1)
    assert launches[0][7] is not launches[1][7]
    scratch[0] = torch.empty(10 ** 6)                                           # the workspace grew
    plan.run(q, k, k, None, out, lse, [4001, 38], 132)
    assert launches[3][7] is not launches[2][7]
    assert launches[3][4] is launches[0][4] and launches[3][9] is launches[0][9]   # lengths, tickets: once
    n = len(uploads)
    for bad, match in (([5, 0], "query tokens"), ([cap + 1, 5], "capacity"), ([5], "batch")):
        with pytest.raises(ValueError, match=match):
            plan.run(q, k, k, None, out, lse, bad, 132)
    assert len(uploads) == n and len(launches) == 4          # refused before any upload or launch
    # every length at the cache's rows: the kernel without the V zeroing
    plan._fns[(plan.tuning, 1, False, 0, False)] = lambda *args: launches.append(("full",) + args)
    assert plan.run(q, k, k, None, out, lse, [cap, cap], 132) == 16 and launches.pop()[0] == "full"
    # A workspace with zeroed slots (the adapters'): 13 splits merge polled, their partials
    # in the marked scratch; one split stays as it was.
    marked = torch.zeros(1 << 20)
    plan._marked = lambda n: marked
    plan._launches.clear()   # (each block count's launch holds its merge, decided with the workspace)
    plan._fns[(plan.tuning, 1, True, 0, True)] = lambda *args: launches.append(("polled",) + args)
    assert plan.run(q, k, k, None, out, lse, [4001, 38], 132) == 13
    assert launches[-1][0] == "polled" and launches[-1][8].data_ptr() == marked.data_ptr()
    assert plan.run(q, k, k, None, out, lse, [100, 37], 132) == 1 and launches[-1][0] != "polled"


def test_plan_parity_slots(monkeypatch):
    """FLEXATTN_DECODE_SLOTS=parity (with a workspace that gives zeroed memory): the polled
    launches take views of the plan's own slots, 2 x capacity splits (at least 16), with
    the launch's split count in mode 0 (the kernel's grid) and a split's two slots side by
    side, and its own tickets + phase words (two per group), the same every step; a plan without it, or
    without a workspace's ``zeroed``, keeps the shared zeroed scratch."""
    import torch

    monkeypatch.setenv("FLEXATTN_DECODE_SLOTS", "parity")
    B, Hq, cap = 2, 8, 4096
    k = torch.zeros(B, 2, cap, 128, dtype=torch.bfloat16)
    cache = KVCache(k, k, torch.tensor([100, 37], dtype=torch.int32))
    q = torch.zeros(B, Hq, 1, 128, dtype=torch.bfloat16)
    out, lse = torch.empty_like(q), torch.empty(B, Hq, 1)
    marked, zeroed = torch.zeros(1 << 20), []

    def get_zeroed(n, dt):
        zeroed.append(torch.zeros(n, dtype=getattr(torch, dt)))
        return zeroed[-1]

    def plan_with(zero):
        ws = decode_path.DecodeWorkspace(alloc=lambda shape, dt: torch.empty(shape, dtype=getattr(torch, dt)),
                                         tickets=lambda n: torch.zeros(max(n, 16), dtype=torch.int32),
                                         scratch=lambda n: torch.empty(n), uploader=lambda into: lambda values: None,
                                         marked_scratch=lambda n: marked, zeroed=zero)
        device = Device(0, lambda x: x if isinstance(x, torch.Tensor) else torch.from_numpy(np.array(x)))
        tuning = dataclasses.replace(decode_path.DEFAULT_TUNING, cluster_merge=False)
        plan = decode_path.prepare_decode(q, cache, out, lse, decode_path.DecodeSite(device, 132, ws),
                                          decode_path.DecodeMods(None, mods.causal()),
                                          overrides=decode_path.DecodeOverrides(tuning=tuning)).plan
        launches = []
        plan._fns[(plan.tuning, 1, True, 0, True)] = lambda *args: launches.append(args)
        return plan, launches

    plan, launches = plan_with(get_zeroed)
    for _ in range(2):
        assert plan.run(q, k, k, None, out, lse, [4001, 38], 132) == 13
    o_part, lse_part, tickets = launches[-1][7], launches[-1][8], launches[-1][9]
    # mode 0: the launch's splits (the kernel's grid), a split's two slots side by side
    assert tuple(o_part.shape) == (13, B, Hq, 1, 128) and tuple(lse_part.shape) == (13, B, Hq, 1)
    assert o_part.stride(0) == 2 * B * Hq * 128 and lse_part.stride(0) == 2 * B * Hq
    assert o_part.data_ptr() == zeroed[0].data_ptr() and tickets is zeroed[1] and tickets.numel() == 2 * B * 2
    assert lse_part.data_ptr() == zeroed[0].data_ptr() + 4 * 2 * 16 * B * Hq * 128   # (capacity 16)
    assert all(a is b for a, b in zip(launches[0][7:10], launches[1][7:10]))     # the same every step
    assert plan._kernel((plan.tuning, 1, True, 0, True))[0].parity_slots
    # more splits than the capacity: new memory (tickets and phase words with it), all zero
    for n, cap_splits, allocations in ((13, 16, 2), (20, 20, 4), (17, 20, 4), (25, 25, 6)):
        _, splits, o_part, lse_part = plan._stage([4001, 38], 132, n)
        assert splits == n and o_part.shape[0] == lse_part.shape[0] == n and len(zeroed) == allocations
        assert plan._parity_parts[0] == cap_splits and zeroed[-2].numel() == 2 * cap_splits * B * Hq * 129
        assert plan._tickets_for((plan.tuning, 1, True)) is zeroed[-1] and not zeroed[-1].any()
    assert plan._tickets_for((plan.tuning, 1, False)) is not zeroed[-1]   # the ticket merge: the workspace's
    plan, launches = plan_with(None)                 # no zeroed memory: the shared scratch, emptied
    assert plan.run(q, k, k, None, out, lse, [4001, 38], 132) == 13
    assert launches[-1][7].data_ptr() == marked.data_ptr()
    assert not plan._kernel((plan.tuning, 1, True, 0, True))[0].parity_slots
    # the variants' flags (the benchmarks' parity-caller: the parity kernel without its zeroing)
    for slots, flags in (("parity-caller", (True, True)), ("caller", (False, True))):
        monkeypatch.setenv("FLEXATTN_DECODE_SLOTS", slots)
        decode_path._PREPARED.clear()   # (a plan reads the setting once)
        config = plan_with(get_zeroed)[0]._kernel((plan.tuning, 1, True, 0, True))[0]
        assert (config.parity_slots, config.caller_empties_slots) == flags, slots


def test_band_prefix():
    """``decode_path.band_prefix``: a mask that is a band with an upper bound on q - kv gives
    that bound (captured numbers re-indexed to the kernel mask's captures: at true positions
    the offsets come first) and where the queries sit; anything else, None."""
    from flexattn.mods.structure import Affine

    window = mods.sliding_window(4096)
    shifted = shift_queries(window, OFFSETS)
    hi, at_end = decode_path.band_prefix(window, shifted, True)
    assert at_end and isinstance(hi, Affine) and hi.value(shifted.captures) == 4096
    assert decode_path.band_prefix(window, window, False) == (Affine(0, ((0, 1),)), False)
    literal = mods.mask_mod(lambda b, h, q, kv: (q - kv <= 1000) & (q >= kv))
    assert decode_path.band_prefix(literal, shift_queries(literal, OFFSETS), True) == (1000, True)
    assert decode_path.band_prefix(mods.mask_mod(lambda b, h, q, kv: kv >= q - 7), window, False) == (7, False)
    for not_one in (mods.causal(), mods.mask_mod(lambda b, h, q, kv: kv % 2 == 0), None):
        assert decode_path.band_prefix(not_one, window, True) is None


def test_choose_launch_short_ranges():
    """Few blocks to visit (a window at 128k keys, short caches): splits of 256+ keys;
    where the default tuning needs twice the splits of the deep one (33 / 16), the deep
    one (fewer partials to merge)."""
    from flexattn.core.decode_path import DEFAULT_TUNING, ONE_CTA_TUNING, choose_launch

    assert choose_launch(1, 8, 1, 65, 132) == (DEFAULT_TUNING, 13, 1)        # window 4096 at any length
    assert choose_launch(1, 8, 1, 64, 132) == (DEFAULT_TUNING, 16, 1)        # B 1, 4k keys
    assert choose_launch(1, 8, 1, 128, 132) == (ONE_CTA_TUNING, 16, 1)       # B 1, 8k keys
    assert choose_launch(1, 8, 1, 3, 132) == (DEFAULT_TUNING, 1, 1)          # 192 keys: one split
    assert choose_launch(2, 8, 1, 512, 132) == (ONE_CTA_TUNING, 8, 1)        # B 2, 32k keys


def test_live_blocks():
    """The planner's masked-prefix count on the host: a window's head of the cache is
    not visited; masks that exclude no leading block (causal, none), and masks reading
    arrays the host cannot see without waiting, leave every block."""
    from flexattn import mods
    from flexattn.core.decode_path import live_blocks, may_skip_head

    rng = np.random.default_rng(5)
    for _ in range(40):
        window, q_len, tile = int(rng.integers(1, 9000)), int(rng.integers(1, 17)), int(rng.choice([64, 128]))
        length = int(rng.integers(q_len, 140000))
        blocks = -(-length // tile)
        first_key = max(0, length - q_len - window)           # the earliest query's window start
        expected = max(1, blocks - first_key // tile)
        assert live_blocks(mods.sliding_window(window), 2, 32, q_len, length, tile) == expected, (window, q_len, length)
        both = mods.causal() & mods.sliding_window(window)
        assert live_blocks(both, 2, 32, q_len, length, tile) == expected
    assert live_blocks(mods.sliding_window(4096), 8, 32, 1, 131072, 64) == 65
    assert live_blocks(mods.causal(), 1, 32, 1, 131072, 64) == 2048
    assert live_blocks(None, 1, 32, 1, 131072, 64) == 2048
    # Masks that never exclude the first key are not analysed per block count (plans keep none).
    assert may_skip_head(mods.sliding_window(4096)) and may_skip_head(mods.causal() & mods.sliding_window(7))
    assert not may_skip_head(mods.causal()) and not may_skip_head(mods.prefix_lm(64)) and not may_skip_head(None)

    class OnDevice:   # a capture the host could read only by waiting for the GPU
        pass

    device_window = mods.sliding_window(4096).with_captures((OnDevice(), 0))
    assert live_blocks(device_window, 1, 32, 1, 131072, 64) == 2048 and not may_skip_head(device_window)


def test_head_always_kept():
    """Masks under which every query position attends a cache's first key: the planner
    compiles the kernel's masked-prefix analysis out for them (it could skip nothing)."""
    from flexattn.core.decode_path import head_always_kept

    assert head_always_kept(mods.causal(), 8, 32) and head_always_kept(mods.prefix_lm(64), 8, 32)
    assert not head_always_kept(mods.sliding_window(4096), 8, 32)
    assert not head_always_kept(mods.causal() & mods.sliding_window(7), 1, 8)
    assert head_always_kept(mods.document(np.zeros(64, np.int32)), 1, 8)          # one document
    assert not head_always_kept(mods.document(np.repeat(np.arange(4), 16).astype(np.int32)), 1, 8)
    # Heads differ: the analysis covers every head of the batch.
    per_head = np.array([0, 0, 5, 0], np.int32)
    late_start = mods.mask_mod(lambda b, h, q, kv: kv >= per_head[h])
    assert head_always_kept(late_start, 1, 2) and not head_always_kept(late_start, 1, 3)
    assert not head_always_kept(None, 1, 8)

    class OnDevice:   # values the host cannot read without waiting: keep the analysis
        pass

    assert head_always_kept(mods.causal(offset=3), 1, 8)
    assert not head_always_kept(mods.causal(offset=3).with_captures((OnDevice(),)), 1, 8)


@pytest.mark.parametrize("listed", ["partial", "full"])
def test_walks_plan_their_last_page_mask(listed):
    """A short query's walk of pages its block mask lists full below the length plans the
    mask on the last page's tiles alone (``mask_last_page_only``); pages listed partial
    (torch's PagedAttention at Q_LEN 1) evaluate it on every tile, their tile-constant
    reads issued a step ahead. Neither runs the masked-prefix analysis (the table hides
    any prefix)."""
    torch = pytest.importorskip("torch")
    from flexattn.blockmask.layout import as_block_mask
    import flexattn.torch.devices as fa_devices
    from flexattn.core import AttentionSpec, short_query
    from flexattn.problem.validate import AttentionShape

    B, Hq, Hkv, D, L, block = 2, 8, 2, 128, 512, 128
    lens = torch.tensor([300, 512])
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    # built for the one query (every block partial), or over a block of rows (full below the length)
    rows = 1 if listed == "partial" else block
    step = torch_create_block_mask(lambda b, h, q, kv: kv < lens[b], B, None, rows, L, device="cpu", BLOCK_SIZE=block)
    step.seq_lengths = (1, L)
    ws = decode_path.DecodeWorkspace(alloc=lambda shape, dt: torch.empty(shape, dtype=getattr(torch, dt)),
                                     tickets=lambda n: torch.zeros(max(n, 16), dtype=torch.int32),
                                     scratch=lambda n: torch.empty(n), uploader=lambda into: (lambda values: None))
    device = Device(0, fa_devices._DeviceCopies(torch.device("cpu")), decode_resources=lambda: (132, ws),
                    page_view=fa_devices._page_view, heads_view=fa_devices._heads_view)
    k = torch.zeros(1, Hkv, L, D, dtype=torch.bfloat16).expand(B, -1, -1, -1)
    q = torch.zeros(B, Hq, 1, D, dtype=torch.bfloat16)
    out, lse = torch.empty_like(q), torch.empty(B, Hq, 1)
    spec = AttentionSpec.from_args(block_mask=as_block_mask(step), enable_gqa=True)
    walk, k_pages, v_pages = short_query.list_walk_route(AttentionShape(B, Hq, Hkv, 1, L, D, D), spec, "bfloat16",
                                                         k, k, device)
    plan, _, _ = short_query._walk_plan(walk, q, k_pages, v_pages, out, lse, device)
    cfg = plan.config
    assert cfg.mask_last_page_only == (listed == "full")
    assert not cfg.skip_masked_prefix
    # Masked on every tile: the table and page map read a step ahead (prefetch_tile_reads).
    assert cfg.prefetch_tile_reads == (listed == "partial")
    # The next step's block mask, converted anew (other lengths: another table, a new
    # tensor in the mask's closure): the same plan, rebound to this step's captures.
    lens2 = torch.tensor([130, 400])
    step2 = torch_create_block_mask(lambda b, h, q, kv: kv < lens2[b], B, None, rows, L, device="cpu",
                                    BLOCK_SIZE=block)
    step2.seq_lengths = (1, L)
    spec2 = AttentionSpec.from_args(block_mask=as_block_mask(step2), enable_gqa=True)
    walk2 = short_query.list_walk_route(AttentionShape(B, Hq, Hkv, 1, L, D, D), spec2, "bfloat16", k, k, device)[0]
    assert walk2.mods.mask.expr is walk.mods.mask.expr and walk2.table is not walk.table
    again = short_query._walk_plan(walk2, q, k_pages, v_pages, out, lse, device)[0]
    assert again is plan and any(c is walk2.table for c in again._captures)
    assert not any(c is walk.table for c in again._captures)
    assert any(c is lens2 for c in again._captures)


def test_a_decode_plan_dies_with_its_last_reference():
    """A plan holds its captures' conversion as a function of the captures alone
    (``decode_path._converter``), not as its own bound method: no reference cycle, so a
    plan evicted from its cache frees its captured tensors at once, not at the next
    cyclic collection."""
    import gc
    import weakref

    torch = pytest.importorskip("torch")
    B, Hq = 2, 8
    k = torch.zeros(B, 2, 512, 128, dtype=torch.bfloat16)
    q = torch.zeros(B, Hq, 1, 128, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    ws = decode_path.DecodeWorkspace(alloc=lambda shape, dt: torch.empty(shape, dtype=getattr(torch, dt)),
                                     tickets=lambda n: torch.zeros(max(n, 16), dtype=torch.int32),
                                     scratch=lambda n: torch.empty(n), uploader=lambda into: (lambda values: None))
    device = Device(0, lambda x: x if isinstance(x, torch.Tensor) else torch.from_numpy(np.array(x)))
    bias = torch.zeros(Hq)
    step_mods = decode_path.DecodeMods(mods.score_mod(lambda s, b, h, q_idx, kv_idx: s + bias[h]), mods.causal())
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        plan = decode_path.DecodePlan(q, k, None, out, 0, decode_path.DEFAULT_TUNING,
                                      decode_path.DecodeSite(device, 132, ws), step_mods)
        ref = weakref.ref(plan)
        del plan
        assert ref() is None
    finally:
        if was_enabled:
            gc.enable()
