"""CPU-only: the sm90 forward compiles for sm_90a in its main configurations, the PTX
uses the Hopper paths (wgmma, TMA, setmaxnreg), nothing spills, and hook arguments stay
runtime arguments. No GPU or driver needed."""

import re

import pytest

pytest.importorskip("cutlass")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass.cute.runtime import make_fake_tensor  # noqa: E402

from flexattn.kernels.emit import example_hooks as hooks  # noqa: E402
from flexattn.kernels.launch.compile import compile_forward, resource_usage_from_ptx  # noqa: E402
from flexattn.kernels.fwd.sm90 import FwdConfig  # noqa: E402
from flexattn.kernels.hopper.warp_specialized import register_split  # noqa: E402
from flexattn import mods  # noqa: E402
from flexattn.kernels.emit.mod_emit import IRModHook  # noqa: E402
from flexattn.mods.structure import canonical_band  # noqa: E402
import ptx_order  # noqa: E402
from compile_pool import compile_all, prefetch  # noqa: E402


def _doc_bias_args():
    doc = make_fake_tensor(cutlass.Int32, (cute.sym_int(), cute.sym_int()), (cute.sym_int64(), 1))
    bias = make_fake_tensor(cutlass.Float32, (cute.sym_int(),), (1,))
    return (doc, bias)


CASES = {
    "hd64-causal-hook": (FwdConfig(head_dim=64, causal=True, mods=hooks.CausalHook()), lambda: ()),
    "hd64-m128-causal": (FwdConfig(head_dim=64, tile_m=128, causal=True,
                                   mods=hooks.CausalHook()), lambda: ()),
    "hd128-causal-hook": (FwdConfig(head_dim=128, causal=True, mods=hooks.CausalHook()), lambda: ()),
    "hd64-causal": (FwdConfig(head_dim=64, causal=True), lambda: ()),
    "hd128-causal": (FwdConfig(head_dim=128, causal=True), lambda: ()),
    "hd64-softcap-fp16": (FwdConfig(dtype="fp16", head_dim=64, mods=hooks.SoftcapHook()),
                          lambda: (cutlass.Float32(30.0),)),
    "hd128-softcap": (FwdConfig(head_dim=128, mods=hooks.SoftcapHook()),
                      lambda: (cutlass.Float32(30.0),)),
    "hd128-doc-bias": (FwdConfig(head_dim=128, mods=hooks.DocumentBiasHook()), _doc_bias_args),
    "hd128-sparse-lag": (FwdConfig(head_dim=128, block_sparse=True,
                                   mods=hooks.LaggedCausalHook()), lambda: (cutlass.Int32(3),)),
    # a sliding window's band of diagonals walked by arithmetic (persistent)
    "hd128-band-window": (FwdConfig(head_dim=128, band=True, max_ctas=132,
                                    mods=IRModHook(None, canonical_band(mods.sliding_window(1024)))),
                          lambda: (cutlass.Int32(0), cutlass.Int32(1024))),
    # ... with its persistent CTAs in a snake (FwdConfig.snake), as planned
    "hd128-band-window-snake": (FwdConfig(head_dim=128, band=True, max_ctas=132, snake=True,
                                          mods=IRModHook(None, canonical_band(mods.sliding_window(1024)))),
                                lambda: (cutlass.Int32(0), cutlass.Int32(1024))),
    # the row maxima as a second statistic (torch's AuxRequest(max_scores=True))
    "hd128-causal-softcap-max": (FwdConfig(head_dim=128, causal=True, max_scores=True, mods=hooks.SoftcapHook()),
                                 lambda: (cutlass.Float32(30.0),)),
    # head dims beyond 64 / 128, as the planner tiles them (kernel_path._forward_tiles)
    "hd32": (FwdConfig(head_dim=32, max_ctas=132), lambda: ()),
    "hd80-causal": (FwdConfig(head_dim=80, causal=True), lambda: ()),
    # three consumer warpgroups at 80 / 96, as the planner takes them (tile_n <= 112)
    "hd96-m192-tn112-causal": (FwdConfig(head_dim=96, tile_m=192, tile_n=112, causal=True), lambda: ()),
    "hd80-m192-tn112-persistent": (FwdConfig(head_dim=80, tile_m=192, tile_n=112, max_ctas=132), lambda: ()),
    "hd96-softcap": (FwdConfig(head_dim=96, mods=hooks.SoftcapHook()), lambda: (cutlass.Float32(30.0),)),
    "hd192-128-causal": (FwdConfig(head_dim=192, head_dim_v=128, causal=True), lambda: ()),
    "hd192-tn112-softcap": (FwdConfig(head_dim=192, tile_n=112, mods=hooks.SoftcapHook()),
                            lambda: (cutlass.Float32(30.0),)),
    "hd256-tn80-causal": (FwdConfig(head_dim=256, tile_n=80, causal=True, rescale_o_early=True), lambda: ()),
    "hd256-tn80-causal-late": (FwdConfig(head_dim=256, tile_n=80, causal=True), lambda: ()),
    "hd256-sparse-tn64": (FwdConfig(head_dim=256, block_sparse=True, tile_n=64, rescale_o_early=True,
                                    mods=hooks.LaggedCausalHook()), lambda: (cutlass.Int32(3),)),
    "hd64-128": (FwdConfig(head_dim=64, head_dim_v=128), lambda: ()),
    "hd64-sparse-plain": (FwdConfig(head_dim=64, block_sparse=True, intra_wg_overlap=False,
                                    mods=hooks.CausalHook()), lambda: ()),
    # lists known to hold no partial block (documents on tile boundaries), as planned:
    # the full list alone, in clusters of 2 over 120 persistent CTAs
    "hd128-sparse-full-only": (FwdConfig(head_dim=128, block_sparse=True, partial_blocks=False, max_ctas=120,
                                         cluster_m=2, kv_aligned=True), lambda: ()),
    "hd64-sparse-full-only-plain": (FwdConfig(head_dim=64, block_sparse=True, partial_blocks=False,
                                              intra_wg_overlap=False), lambda: ()),
    # step (a) schedule: no intra-warpgroup overlap, no ping-pong
    "hd128-causal-plain": (FwdConfig(head_dim=128, causal=True, intra_wg_overlap=False,
                                     pingpong=False), lambda: ()),
    # persistent CTAs (what the planner picks for dense attention), one per SM
    "hd128-persistent": (FwdConfig(head_dim=128, max_ctas=132), lambda: ()),
    "hd64-persistent-softcap": (FwdConfig(head_dim=64, max_ctas=132, mods=hooks.SoftcapHook()),
                                lambda: (cutlass.Float32(30.0),)),
    # clusters of 2 CTAs sharing K/V by TMA multicast (the planner's dense head-dim-128 choice)
    "hd128-cluster-persistent": (FwdConfig(head_dim=128, max_ctas=132, cluster_m=2), lambda: ()),
    "hd128-cluster-softcap": (FwdConfig(head_dim=128, cluster_m=2, mods=hooks.SoftcapHook()),
                              lambda: (cutlass.Float32(30.0),)),
    "hd128-cluster-causal": (FwdConfig(head_dim=128, causal=True, cluster_m=2), lambda: ()),
    # ... and walked in one step without hooks (one_step_walk, planned up to D64; a faster compile)
    "hd128-cluster-causal-one-step-od": (FwdConfig(head_dim=128, causal=True, cluster_m=2, kv_aligned=True,
                                                   one_step_walk=True, rescale_threshold=8.0,
                                                   maxima_on_demand=True), lambda: ()),
    # persistent CTAs taking their later tiles by tickets (FwdConfig.tile_tickets), as
    # planned for bands; and with three consumer warpgroups
    "hd128-band-window-tickets": (FwdConfig(head_dim=128, band=True, max_ctas=132, tile_tickets=True,
                                            mods=IRModHook(None, canonical_band(mods.sliding_window(1024)))),
                                  lambda: (cutlass.Int32(0), cutlass.Int32(1024))),
    # the planned D256 window: O's early rescale behind the vote, then a P V that the first visit
    # skips (the rescale sat before that branch and ptxas serialized every wgmma: C7515)
    "hd256-band-window-early-od": (FwdConfig(head_dim=256, band=True, tile_n=80, rescale_o_early=True,
                                             rescale_threshold=8.0, maxima_on_demand=True,
                                             mods=IRModHook(None, canonical_band(mods.sliding_window(1024)))),
                                   lambda: (cutlass.Int32(0), cutlass.Int32(1024))),
    # ... its partial and full blocks through one step (FwdConfig.band_one_step, planned: a faster compile)
    "hd128-band-window-one-step-od": (FwdConfig(head_dim=128, band=True, band_one_step=True, max_ctas=132,
                                                tile_tickets=True, kv_aligned=True, rescale_threshold=8.0,
                                                maxima_on_demand=True,
                                                mods=IRModHook(None, canonical_band(mods.sliding_window(1024)))),
                                      lambda: (cutlass.Int32(0), cutlass.Int32(1024))),
    # D32 / D64's plans (four consumer warpgroups, the maxima on demand) walked in one step
    # without hooks (one_step_walk, planned up to D64: the peeled D32 causal spilled 4 B)
    "hd32-causal-m256-one-step-od": (FwdConfig(head_dim=32, causal=True, tile_m=256, tile_n=80, max_ctas=132,
                                               tile_tickets=True, tile_order="longest_first", one_step_walk=True,
                                               rescale_threshold=8.0, maxima_on_demand=True), lambda: ()),
    "hd64-m256n64-one-step-od": (FwdConfig(head_dim=64, tile_m=256, tile_n=64, max_ctas=132, kv_aligned=True,
                                           one_step_walk=True, rescale_threshold=8.0, maxima_on_demand=True),
                                 lambda: ()),
    "hd64-causal-tickets": (FwdConfig(head_dim=64, causal=True, max_ctas=132, tile_tickets=True), lambda: ()),
    # four consumer warpgroups: 256-row tiles with a four-way ping-pong
    "hd32-causal-m256": (FwdConfig(head_dim=32, causal=True, tile_m=256, tile_n=80, max_ctas=132,
                                   tile_tickets=True), lambda: ()),
    # ... each warpgroup's causal walk to its own rows' diagonal (own_diagonal, planned) against whole tiles,
    # the peeled walk and the hooks' one-step walk
    "hd32-causal-m256-whole": (FwdConfig(head_dim=32, causal=True, tile_m=256, tile_n=80, max_ctas=132,
                                         tile_tickets=True, own_diagonal=False), lambda: ()),
    "hd32-causal-hook-m256": (FwdConfig(head_dim=32, causal=True, tile_m=256, tile_n=80, mods=hooks.CausalHook()),
                              lambda: ()),
    "hd32-causal-hook-m256-whole": (FwdConfig(head_dim=32, causal=True, tile_m=256, tile_n=80,
                                              mods=hooks.CausalHook(), own_diagonal=False), lambda: ()),
    # O's rescale behind a vote of the warp (FwdConfig.rescale_threshold), with and without the early rescale
    "hd64-causal-tickets-lazy": (FwdConfig(head_dim=64, causal=True, max_ctas=132, tile_tickets=True,
                                           rescale_threshold=8.0), lambda: ()),
    "hd64-causal-tickets-od": (FwdConfig(head_dim=64, causal=True, max_ctas=132, tile_tickets=True,
                                         rescale_threshold=8.0, maxima_on_demand=True), lambda: ()),
    # ... over block lists: a row's first visit votes before its exponentials (partial loop; the
    # full loop too where there is no partial list)
    "hd128-sparse-lag-od": (FwdConfig(head_dim=128, block_sparse=True, mods=hooks.LaggedCausalHook(),
                                      rescale_threshold=8.0, maxima_on_demand=True), lambda: (cutlass.Int32(3),)),
    "hd64-sparse-full-only-od": (FwdConfig(head_dim=64, block_sparse=True, partial_blocks=False,
                                           mods=hooks.LaggedCausalHook(), rescale_threshold=8.0,
                                           maxima_on_demand=True), lambda: (cutlass.Int32(3),)),
    "hd256-causal-early-lazy": (FwdConfig(head_dim=256, causal=True, rescale_o_early=True, tile_n=64,
                                          rescale_threshold=8.0), lambda: ()),
}


def _ptx(name):
    cfg, make_args = CASES[name]
    return compile_forward(cfg, make_args(), keep_ptx=True).__ptx__


prefetch(_ptx, CASES)   # the fixture's jobs, started ahead (compile_pool.py)


@pytest.fixture(scope="module")
def compiled():
    """Compile each case once (a few seconds each, in parallel processes) and keep its PTX."""
    return compile_all(_ptx)


@pytest.mark.parametrize("name", list(CASES))
def test_hopper_instructions(compiled, name):
    ptx = compiled[name]
    assert ".target sm_90a" in ptx
    assert "wgmma.mma_async" in ptx
    assert "cp.async.bulk.tensor" in ptx            # TMA loads and the TMA store of O
    assert "setmaxnreg.inc" in ptx and "setmaxnreg.dec" in ptx
    assert "ex2.approx" in ptx                       # exp2 softmax


@pytest.mark.parametrize("name", list(CASES))
def test_no_spills(compiled, name):
    usage = resource_usage_from_ptx(compiled[name])
    if usage is None:
        pytest.skip("no ptxas on PATH")
    assert usage.spill_store_bytes == 0 and usage.spill_load_bytes == 0, usage
    assert usage.stack_bytes == 0, usage
    assert usage.wgmma_serialized is None, usage      # (ptxas would make every wgmma wait)


def test_softcap_value_is_not_baked_in(compiled):
    # 30.0f is 0f41F00000 in PTX; it was only the fake arg's value and must not appear.
    assert "0f41F00000" not in compiled["hd128-softcap"]
    # tanh is emitted (approx) for the score mod.
    assert "tanh.approx" in compiled["hd128-softcap"]


def test_causal_skips_mask_on_interior_blocks(compiled):
    # Causal without hooks: first block, diagonal blocks, full blocks -> 3 instances of the
    # step (QK^T: D/16 wgmma, PV: tile_n/16 wgmma each) where a tile's rows span more than
    # one kv block (192 x 128)...
    cfg = CASES["hd64-causal"][0]
    assert (cfg.tile_m, cfg.tile_n) == (192, 128)
    assert compiled["hd64-causal"].count("wgmma.mma_async") == 3 * (cfg.head_dim // 16 + cfg.tile_n // 16)
    # ... and 2 where only the first block crosses the diagonal (128 x 128: no diagonal loop).
    cfg = CASES["hd128-causal"][0]
    per_step = cfg.head_dim // 16 + cfg.tile_n // 16
    assert compiled["hd128-causal"].count("wgmma.mma_async") == 2 * per_step
    # Without overlap the count is the same (the overlap moves P V by one block).
    assert compiled["hd128-causal-plain"].count("wgmma.mma_async") == 2 * per_step


def test_256_row_tiles_run_four_warpgroups_at_112_registers(compiled):
    """tile_m=256: four consumer warpgroups (640 threads) at 112 registers (the pool of a
    launch at 96 a thread: 120 hung), passing the ping-pong turn around; refused above
    head dim 64 (they would spill)."""
    ptx = compiled["hd32-causal-m256"]
    assert ".reqntid 640" in ptx or ".maxntid 640" in ptx
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+112;", ptx)
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;", ptx)
    # the first turn (warpgroup 0's barrier, id 2); the others' ids are computed per warpgroup
    assert re.search(r"bar\.arrive\s+2,\s*256;", ptx)
    with pytest.raises(ValueError, match="tile_m=256"):
        FwdConfig(head_dim=96, tile_m=256)
    with pytest.raises(ValueError, match="tile_m must be"):
        FwdConfig(head_dim=64, tile_m=320)


def test_own_diagonal_releases_a_warpgroups_leading_blocks_with_their_turns(compiled):
    """own_diagonal: each walk (peeled, one step) gains one loop that waits for a block's K
    and V and passes the ping-pong turn (one more turn wait and pass) without a GEMM; the
    GEMMs are the same. Where no block can lie wholly right of a warpgroup's rows (128 x
    128) the kernel is the whole-tile one."""
    for own, whole in (("hd32-causal-m256", "hd32-causal-m256-whole"),
                       ("hd32-causal-hook-m256", "hd32-causal-hook-m256-whole")):
        a, b = compiled[own], compiled[whole]
        assert a.count("wgmma.mma_async") == b.count("wgmma.mma_async")
        assert len(re.findall(r"bar\.arrive", a)) == len(re.findall(r"bar\.arrive", b)) + 1
        assert len(re.findall(r"bar\.sync", a)) == len(re.findall(r"bar\.sync", b)) + 1
        assert a.count("mbarrier.try_wait") == b.count("mbarrier.try_wait") + 2     # K and V
    assert CASES["hd128-causal"][0].own_diagonal
    assert compile_forward(FwdConfig(head_dim=128, causal=True, own_diagonal=False), (),
                           keep_ptx=True).__ptx__.count("\n") == compiled["hd128-causal"].count("\n")


def test_rescale_threshold_votes_once_per_step(compiled):
    """rescale_threshold: each step after the first asks its warp once (vote.any) whether
    the reference max moves; the same wgmmas otherwise, and no vote without it."""
    base, lazy = compiled["hd64-causal-tickets"], compiled["hd64-causal-tickets-lazy"]
    assert lazy.count("wgmma.mma_async") == base.count("wgmma.mma_async")
    assert "vote.sync.any.pred" not in base
    # the peeled first block has no vote; the diagonal loop and the full-block loop one each
    assert lazy.count("vote.sync.any.pred") == 2
    assert compiled["hd256-causal-early-lazy"].count("vote.sync.any.pred") >= 1
    for bad in (-1.0, 17.0):
        with pytest.raises(ValueError, match="rescale_threshold"):
            FwdConfig(head_dim=64, rescale_threshold=bad)
    # maxima_on_demand: the same votes, with the second pass's exponentials behind them
    od = compiled["hd64-causal-tickets-od"]
    assert od.count("vote.sync.any.pred") == 2
    # over lists, the first visit's vote: in the partial loop (and the full loop without one)
    assert compiled["hd128-sparse-lag-od"].count("vote.sync.any.pred") == 2 + 1
    assert compiled["hd64-sparse-full-only-od"].count("vote.sync.any.pred") == 2
    # a thread's 64 exponentials a block (192 x 128): the peeled first block's, then each
    # loop's first pass and its second (diagonal loop and full-block loop); lazy: 3 x 64
    assert od.count("ex2.approx") >= 5 * 64 > lazy.count("ex2.approx")
    for bad in (dict(), dict(rescale_threshold=8.0, dtype="fp32", tile_n=64),
                dict(rescale_threshold=8.0, max_scores=True)):
        with pytest.raises(ValueError, match="maxima_on_demand"):
            FwdConfig(head_dim=64, tile_m=128, maxima_on_demand=True, **bad)


def test_hooks_walk_blocks_in_one_step(compiled):
    # With a hook emitted (overlapped schedule), dense and causal walk every block with one
    # step (which limits a block needs, and whether a P V is due, decided at run time),
    # then the final P V: one copy of the hooks and the softmax.
    for name in ("hd64-causal-hook", "hd128-causal-hook", "hd128-softcap", "hd128-doc-bias"):
        cfg = CASES[name][0]
        qk, pv = cfg.head_dim // 16, cfg.tile_n // 16
        assert compiled[name].count("wgmma.mma_async") == (qk + pv) + pv, name


def test_band_walks_in_one_step_when_asked(compiled):
    # A band walks its partial blocks, then its full ones, each kind with a step of its own
    # (two copies of the GEMMs); with band_one_step one step serves both (partial decided at
    # run time), then the final P V.
    for name, steps in (("hd128-band-window-tickets", 2), ("hd128-band-window-one-step-od", 1)):
        cfg = CASES[name][0]
        qk, pv = cfg.head_dim // 16, cfg.tile_n // 16
        assert compiled[name].count("wgmma.mma_async") == steps * (qk + pv) + pv, name
    with pytest.raises(ValueError, match="band_one_step"):
        FwdConfig(head_dim=128, band_one_step=True)


def test_causal_walks_in_one_step_when_asked(compiled):
    # Without hooks the causal walk peels its first block (Q K^T alone), then a loop of
    # overlapped steps, then the final P V; with one_step_walk one step serves every block.
    for name, qk_copies in (("hd128-cluster-causal", 2), ("hd128-cluster-causal-one-step-od", 1)):
        cfg = CASES[name][0]
        qk, pv = cfg.head_dim // 16, cfg.tile_n // 16
        assert compiled[name].count("wgmma.mma_async") == qk_copies * qk + 2 * pv, name
    band = dict(band=True, mods=IRModHook(None, canonical_band(mods.sliding_window(64))))
    for bad in (band, dict(block_sparse=True), dict(intra_wg_overlap=False)):
        with pytest.raises(ValueError, match="one_step_walk"):
            FwdConfig(head_dim=128, one_step_walk=True, **bad)


def test_early_o_rescale_runs_between_the_two_gemms(compiled):
    """FwdConfig.rescale_o_early: O's multiply by the pending row scale (one per O element:
    Dv / 2 per thread) sits between Q K^T's commit and the P V GEMM, not after P V's wait."""
    qk_run = "W80x16 Cx1"
    early, late = (ptx_order.runs(compiled[n], ptx_order.WGMMA, ptx_order.COMMIT, ptx_order.WAIT, ptx_order.MUL_F32)
                   for n in ("hd256-tn80-causal", "hd256-tn80-causal-late"))
    assert early.count(f"{qk_run} mulx128 W256x5") >= 2 and "wait0x1 mulx128 W80" not in early, early
    assert f"{qk_run} mulx128 W256" not in late and late.count("wait0x1 mulx128 W80") >= 1, late


def test_block_sparse_structure(compiled):
    # Sparse, overlapped: one step for the partial blocks and one for the full ones, each
    # serving its first visit too (whether a previous P V is due is decided at run time),
    # and the final P V.
    cfg = CASES["hd128-sparse-lag"][0]
    qk, pv = cfg.head_dim // 16, cfg.tile_n // 16
    assert compiled["hd128-sparse-lag"].count("wgmma.mma_async") == 2 * (qk + pv) + pv
    # Sparse, plain: one step per list.
    cfg = CASES["hd64-sparse-plain"][0]
    assert compiled["hd64-sparse-plain"].count("wgmma.mma_async") == 2 * (
        cfg.head_dim // 16 + cfg.tile_n // 16)
    # The band walks the same partial-then-full steps, its blocks by arithmetic.
    assert compiled["hd128-band-window"].count("wgmma.mma_async") == 2 * (qk + pv) + pv
    # Lists without partial blocks: the full step alone (and the final P V), and no read
    # of the partial count (the kernel's parameters still take all four lists).
    assert compiled["hd128-sparse-full-only"].count("wgmma.mma_async") == (qk + pv) + pv
    cfg = CASES["hd64-sparse-full-only-plain"][0]
    assert compiled["hd64-sparse-full-only-plain"].count("wgmma.mma_async") == cfg.head_dim // 16 + cfg.tile_n // 16
    with pytest.raises(ValueError, match="partial_blocks"):
        FwdConfig(causal=True, partial_blocks=False)
    with pytest.raises(ValueError):
        FwdConfig(block_sparse=True, causal=True)
    with pytest.raises(ValueError, match="band"):
        FwdConfig(band=True, mods=hooks.CausalHook())    # no IR: no band to walk
    assert FwdConfig(head_dim=64, block_sparse=True).tile_m == 128


def test_pingpong_barriers(compiled):
    # Ping-pong uses named barriers besides the epilogue's; the plain schedule does not.
    assert "bar.arrive" in compiled["hd128-causal-hook"]
    assert "bar.arrive" not in compiled["hd128-causal-plain"]


def test_shared_memory_past_the_limit_is_refused_while_compiling():
    # 176-wide K/V tiles in two stages plus the persistent O buffer: 240 KB > 227 KB. Such a
    # kernel compiled and then failed at launch (cudaErrorInvalidValue, H100 2026-11-22).
    with pytest.raises(ValueError, match="shared memory"):
        compile_forward(FwdConfig(head_dim=128, tile_n=176, max_ctas=132), ())


def test_config_keys():
    a = FwdConfig(mods=hooks.SoftcapHook())
    b = FwdConfig(mods=hooks.SoftcapHook())
    assert a.key() == b.key()                       # structure, not identity
    assert a.key() != FwdConfig(mods=hooks.CausalHook()).key()
    assert a.key() != FwdConfig(head_dim=64, mods=hooks.SoftcapHook()).key()
    with pytest.raises(ValueError, match="multiple of 16"):
        FwdConfig(head_dim=72)
    with pytest.raises(ValueError, match="head_dim_v"):
        FwdConfig(head_dim=128, head_dim_v=512)
    assert FwdConfig(head_dim=96).head_dim_v == 96 and FwdConfig(head_dim=192, head_dim_v=128).separate_o is False
    assert FwdConfig(head_dim=64, head_dim_v=128).separate_o     # O wider than Q's buffer
    with pytest.raises(ValueError, match="sparse_block_n"):
        FwdConfig(block_sparse=True, tile_n=96)
    with pytest.raises(ValueError):
        FwdConfig(dtype="fp64")
    with pytest.raises(ValueError, match="tf32_passes"):
        FwdConfig(tf32_passes=3)                                         # fp32 only
    with pytest.raises(ValueError, match="cluster_m"):
        FwdConfig(dtype="fp32", cluster_m=2)
    assert FwdConfig(dtype="fp32", tf32_passes=3).operand_parts == 2
    with pytest.raises(ValueError):
        FwdConfig(head_dim=128, tile_m=192)
    assert FwdConfig(head_dim=64).tile_m == 192                         # 3 consumer WGs
    assert FwdConfig(head_dim=64, mods=hooks.SoftcapHook()).tile_m == 128
    assert FwdConfig(head_dim=64).consumer_regs == 160
    assert FwdConfig(head_dim=128).consumer_regs == 240
    assert FwdConfig(head_dim=32, tile_m=256, tile_n=64).consumer_regs == 112   # 640 threads launch at 96


@pytest.mark.parametrize("ctas_per_sm", [1, 2])
@pytest.mark.parametrize("consumer_wgs", [1, 2, 3, 4])
def test_register_budgets_fit_the_launch_pool(consumer_wgs, ctas_per_sm):
    """setmaxnreg.inc spins until the CTA's pool has the registers: budgets must fit what
    the launch grants (every thread the same multiple of 8), not the register file: 4
    consumer WGs at 120 hung the GPU (640 threads launch at 96: a pool of 61440)."""
    producer, consumer = register_split(consumer_wgs, 24, ctas_per_sm)
    threads = 128 * (consumer_wgs + 1)
    launch = min(256, 65536 // ctas_per_sm // threads // 8 * 8)
    assert consumer % 8 == 0 and producer % 8 == 0
    assert 128 * (producer + consumer_wgs * consumer) <= launch * threads
    assert 128 * (producer + consumer_wgs * (consumer + 8)) > launch * threads or consumer == 256


def test_snake_order_is_a_permutation_that_alternates():
    """FwdConfig.snake (tile_scheduler.snake_index): the persistent CTAs' walks cover every
    tile exactly once for any tile count and grid; in each pair of full rounds CTA c takes
    positions c and grid - 1 - c; a partial last round keeps its order. Needs persistent
    CTAs without clusters."""
    from flexattn.kernels.hopper.tile_scheduler import snake_index

    for total in range(1, 200):
        for grid in range(1, 40):
            walks = [[snake_index(c + r * grid, grid, total) for r in range(-(-total // grid)) if c + r * grid < total]
                     for c in range(grid)]
            assert sorted(i for w in walks for i in w) == list(range(total)), (total, grid)
            full = total // grid
            for c, walk in enumerate(walks):
                for r, i in enumerate(walk):
                    position = grid - 1 - c if r % 2 == 1 and r < full else c
                    assert i == r * grid + position, (total, grid, c, r)
    FwdConfig(head_dim=128, max_ctas=132, snake=True)
    for bad in (dict(snake=True), dict(snake=True, max_ctas=132, cluster_m=2)):
        with pytest.raises(ValueError, match="snake"):
            FwdConfig(head_dim=128, **bad)


def test_tile_tickets(compiled):
    """Tile tickets: one relaxed atomic add per later tile and the last drawer's reset (an
    exchange) at GPU scope; static walks draw none. Persistent CTAs without clusters or
    snake only."""
    for name in ("hd128-band-window-tickets", "hd64-causal-tickets"):
        ptx = compiled[name]
        # (PTX's default atom semantics: relaxed, GPU scope)
        assert ptx.count("atom.global.add") == 1 and ptx.count("atom.global.exch") == 1, name
    for name in ("hd128-band-window", "hd128-band-window-snake", "hd128-persistent"):
        assert "atom." not in compiled[name], name
    assert FwdConfig(head_dim=128, max_ctas=132, tile_tickets=True).launch_lists == 1
    assert FwdConfig(head_dim=128, block_sparse=True, mods=hooks.CausalHook(), max_ctas=132,
                     tile_tickets=True).launch_lists == 5
    for bad in (dict(tile_tickets=True), dict(tile_tickets=True, max_ctas=132, cluster_m=2),
                dict(tile_tickets=True, max_ctas=132, snake=True)):
        with pytest.raises(ValueError, match="tile_tickets"):
            FwdConfig(head_dim=128, **bad)


def test_persistent_walks_tiles_in_a_loop(compiled):
    """Persistent CTAs run the same per-tile code, once, inside a loop over tiles."""
    per_step = 128 // 16 + 128 // 16
    assert compiled["hd128-persistent"].count("wgmma.mma_async") == 2 * per_step


def test_cluster_multicasts_kv(compiled):
    """Cluster kernels: K/V TMA loads multicast into both CTAs, the slot releases reach the
    peer's barriers (mapa + remote arrive), the barriers are initialised cluster-wide; Q
    stays a plain load. Kernels without a cluster have none of it."""
    for name in ("hd128-cluster-persistent", "hd128-cluster-softcap", "hd128-cluster-causal"):
        ptx = compiled[name]
        loads = [ln for ln in ptx.splitlines() if "cp.async.bulk.tensor" in ln and "complete_tx" in ln]
        multicast = [ln for ln in loads if "multicast::cluster" in ln]
        # K and V (two 64-column boxes each under the 128-byte swizzle), first and later
        # visits; Q without multicast.
        assert multicast and len(multicast) < len(loads)
        assert "mapa.shared::cluster" in ptx and "barrier.cluster.wait" in ptx
    for name in ("hd128-persistent", "hd128-causal"):
        assert "multicast::cluster" not in compiled[name] and "barrier.cluster" not in compiled[name]


def test_cluster_config_checks():
    FwdConfig(cluster_m=2, causal=True)
    with pytest.raises(ValueError, match="tile_m == tile_n"):
        FwdConfig(cluster_m=2, causal=True, head_dim=64)          # 192-row tiles
    FwdConfig(cluster_m=2, block_sparse=True, mods=hooks.CausalHook())   # lists: the planner pairs rows
    with pytest.raises(ValueError, match="a band's rows differ"):
        FwdConfig(cluster_m=2, band=True, mods=IRModHook(None, canonical_band(mods.sliding_window(64))))
    with pytest.raises(ValueError):
        FwdConfig(cluster_m=4)
    cfg = FwdConfig(cluster_m=2)
    assert cfg.key() != FwdConfig().key()
    assert cfg.cluster_fits(256) and cfg.cluster_fits(129) and cfg.cluster_fits(4096)
    assert not cfg.cluster_fits(128) and not cfg.cluster_fits(300)
    assert FwdConfig().cluster_fits(300)
