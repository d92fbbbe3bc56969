"""CPU (CI): the sm90 backward (preprocess, main kernel, postprocess) compiles for sm_90a
in its main structures, the PTX uses the Hopper paths (wgmma, TMA, setmaxnreg, stmatrix,
dQ tiles to shared memory in 16-byte stores and into global memory by bulk fp32 adds from
the writer warp), nothing spills, and mod values stay runtime args.
Deterministic configs (dense, causal, block-sparse, buffer gradients) compile without
spills too, with the dQ turn protocol (acquire spin, release add) and the fixed-point
buffer-gradient atomics in their PTX, and only there.
The runner validates and compiles on CPU tensors too (launching needs the GPU)."""

import dataclasses
import re

import numpy as np
import pytest

pytest.importorskip("cutlass")

from flexattn import mods  # noqa: E402
from flexattn.kernels.emit import example_hooks as hooks  # noqa: E402
from flexattn.kernels.launch.compile import (  # noqa: E402
    compile_backward, compile_postprocess, compile_preprocess)
from flexattn.mods.structure import canonical_band  # noqa: E402
from flexattn.kernels.bwd.sm90 import BwdConfig  # noqa: E402
from flexattn.kernels.launch.compile import resource_usage_from_ptx  # noqa: E402
from flexattn.kernels.emit.mod_emit import IRModHook, capture_kinds, fake_args  # noqa: E402
import ptx_order  # noqa: E402
from compile_pool import compile_all, prefetch  # noqa: E402


def _config(name):
    if name == "d128-dense":
        hook = IRModHook()
        return BwdConfig(head_dim=128, mods=hook), hook
    if name == "d128-causal-softcap":
        hook = IRModHook(mods.softcap(30.0), None)
        return BwdConfig(head_dim=128, causal=True, mods=hook), hook
    if name == "d64-sparse-document":
        hook = IRModHook(None, mods.document(np.zeros(8, np.int32)))
        return BwdConfig(dtype="fp16", head_dim=64, block_sparse=True, mods=hook), hook
    if name == "d128-sparse-document":     # (planned with persistent CTAs: even, short columns)
        hook = IRModHook(None, mods.document(np.zeros(8, np.int32)))
        return BwdConfig(head_dim=128, block_sparse=True, mods=hook), hook
    if name == "d96-causal-softcap":       # head dims beyond 64 / 128 (dQ slices of 48)
        hook = IRModHook(mods.softcap(30.0), None)
        return BwdConfig(head_dim=96, causal=True, mods=hook), hook
    if name == "d32-sparse-document":
        hook = IRModHook(None, mods.document(np.zeros(8, np.int32)))
        return BwdConfig(head_dim=32, block_sparse=True, mods=hook), hook
    if name == "d128-band-window":         # a band walked by arithmetic
        hook = IRModHook(None, canonical_band(mods.sliding_window(1024)))
        return BwdConfig(head_dim=128, band=True, mods=hook), hook
    # BwdConfig.idle_masked_keys (planned since session 39): a warpgroup whose keys a visit masks
    # runs `_idle_step` (zero dS^T half, its dQ share) instead of `_step`
    if name == "d128-causal-idle":
        hook = IRModHook()
        return BwdConfig(head_dim=128, causal=True, mods=hook, idle_masked_keys=True), hook
    if name == "d128-band-window-idle":
        hook = IRModHook(None, canonical_band(mods.sliding_window(1024)))
        return BwdConfig(head_dim=128, band=True, mods=hook, idle_masked_keys=True), hook
    if name == "d128-causal-softcap-idle":
        hook = IRModHook(mods.softcap(30.0), None)
        return BwdConfig(head_dim=128, causal=True, mods=hook, idle_masked_keys=True), hook
    if name == "d128-causal":
        hook = IRModHook()
        return BwdConfig(head_dim=128, causal=True, mods=hook), hook
    if name == "d128-relative-bias":       # trainable table: buffer gradients
        hook = IRModHook(mods.relative_bias(np.zeros((4, 15), np.float32)), None)
        return BwdConfig(head_dim=128, mods=hook), hook
    if name == "d128-softcap":
        hook = IRModHook(mods.softcap(30.0), None)
        return BwdConfig(head_dim=128, mods=hook), hook
    if name == "d128-64-causal-softcap":   # value head dims apart from the query's
        hook = IRModHook(mods.softcap(30.0), None)
        return BwdConfig(head_dim=128, head_dim_v=64, causal=True, mods=hook), hook
    if name == "d64-128-dense":
        hook = IRModHook()
        return BwdConfig(head_dim=64, head_dim_v=128, mods=hook), hook
    if name == "d96-64-sparse-document":
        hook = IRModHook(None, mods.document(np.zeros(8, np.int32)))
        return BwdConfig(head_dim=96, head_dim_v=64, block_sparse=True, mods=hook), hook
    if name == "d256-causal-softcap":      # head dims beyond 128: split_head_dim
        hook = IRModHook(mods.softcap(30.0), None)
        return BwdConfig(head_dim=256, causal=True, mods=hook), hook
    if name == "d192-128-sparse-document":
        hook = IRModHook(None, mods.document(np.zeros(8, np.int32)))
        return BwdConfig(head_dim=192, head_dim_v=128, block_sparse=True, mods=hook), hook
    if name == "d192-128-causal-softcap-swap":   # the swapped layout (dkv_swap): 96-key CTAs
        hook = IRModHook(mods.softcap(30.0), None)
        return BwdConfig(head_dim=192, head_dim_v=128, tile_n=96, causal=True, mods=hook), hook
    if name == "d192-dense-swap":
        hook = IRModHook()
        return BwdConfig(head_dim=192, tile_n=96, num_stages=1, mods=hook), hook
    if name == "d192-causal-swap-q2do1":       # FA4's rings: 2 Q stages, 1 dO stage, 1 dS^T buffer
        hook = IRModHook()                         # (with softcap: spills 4 bytes at 192/192)
        return BwdConfig(head_dim=192, tile_n=96, num_stages=2, do_stages=1, ds_buffers=1, causal=True,
                         mods=hook), hook
    if name == "d256-128-causal-swap48":       # 48-key CTAs (FA4's at 256; not planned)
        hook = IRModHook(None, mods.causal())
        return BwdConfig(head_dim=256, head_dim_v=128, tile_n=48, causal=True, mods=hook), hook
    # issue 25's head-dim-256 candidates (FA4's choices there; CPU-checked, not yet GPU-run)
    if name == "d256-128-causal-split-q2do1":  # split layout, two Q stages and one dO stage
        return BwdConfig(head_dim=256, head_dim_v=128, causal=True, num_stages=2, do_stages=1), IRModHook()
    if name == "d256-causal-split-dvfirst":    # dV, dQ, dK: dO released once dV retired
        return BwdConfig(head_dim=256, causal=True, tail_order="dv_first"), IRModHook()
    if name == "d256-causal-swap48-rows":      # FA4's 256 layout: dK^T / dV^T split by head-dim rows
        return BwdConfig(head_dim=256, tile_n=48, num_stages=2, do_stages=1, ds_buffers=1, causal=True,
                         dkv_rows=True, tail_order="dv_first"), IRModHook()
    if name == "d256-128-causal-swap80-rows":  # 80 keys: FA4's config search's best at 256/128
        return BwdConfig(head_dim=256, head_dim_v=128, tile_n=80, num_stages=2, do_stages=1, ds_buffers=1,
                         causal=True, dkv_rows=True, tail_order="dv_first"), IRModHook()
    # 192/192's candidate (FA4's layout there: keys split, one dO stage, dV first), P^T stored
    # while dP runs (BwdConfig.p_early) or with dS^T
    if name in ("d192-causal-swap96-dvfirst", "d192-causal-swap96-dvfirst-pearly"):
        return BwdConfig(head_dim=192, tile_n=96, num_stages=2, do_stages=1, ds_buffers=1, causal=True,
                         tail_order="dv_first", p_early=name.endswith("pearly")), IRModHook()
    if name == "d64-causal":
        hook = IRModHook(None, mods.causal())
        return BwdConfig(head_dim=64, causal=True, mods=hook), hook
    # buffer gradients by read pattern (test_buffer_gradients_are_summed_per_diagonal_before_the_atomics)
    if name == "d128-alibi-slopes":            # read free of q and kv: one reduction per warp
        hook = IRModHook(mods.alibi(np.ones(4, np.float32)), None)
        return BwdConfig(head_dim=128, mods=hook), hook
    if name == "d128-table-2d":                # read by q and kv otherwise: one per element
        hook = IRModHook(mods.score_mod(lambda s, b, h, q, kv: s + _TABLE_2D[h, q % 9, kv % 9]), None)
        return BwdConfig(head_dim=128, mods=hook), hook
    if name in ("d128-causal-alibi", "d128-causal-alibi-fixed"):   # slopes trained / fixed
        hook = IRModHook(mods.alibi(np.ones(4, np.float32)), None)
        hook = hook.with_grad_filter(()) if name.endswith("fixed") else hook
        return BwdConfig(head_dim=128, causal=True, mods=hook), hook
    if name == "d128-causal-alibi8-fixed":     # the built-in's own slopes (positions once per row)
        hook = IRModHook(mods.alibi(num_heads=8)).with_grad_filter(())
        return BwdConfig(head_dim=128, causal=True, mods=hook), hook
    if name.endswith("-128"):
        cfg, hook = _config(name[:-4])
        return dataclasses.replace(cfg, tile_m=128), hook
    if name.endswith("-80"):
        cfg, hook = _config(name[:-3])
        return dataclasses.replace(cfg, tile_m=80), hook
    if name.endswith("-fullonly"):            # lists without partial blocks (BwdConfig.partial_blocks)
        cfg, _ = _config(name[:-9])
        hook = IRModHook()                    # (no partial tile: the planner drops the mask)
        return dataclasses.replace(cfg, partial_blocks=False, mods=hook), hook
    if name.endswith("-persist"):             # persistent CTAs (BwdConfig.max_ctas)
        cfg, hook = _config(name[:-8])
        return dataclasses.replace(cfg, max_ctas=132), hook
    if name.endswith("-pdl"):                 # programmatic dependent launches (BwdConfig.pdl)
        cfg, hook = _config(name[:-4])
        return dataclasses.replace(cfg, pdl=True), hook
    if name.endswith("-firststore-data"):     # the ticket drawn once the data is staged
        cfg, hook = _config(name[:-5])
        return dataclasses.replace(cfg, dq_ticket_on_data=True), hook
    if name.endswith("-firststore"):          # each dQ tile's first visit stores (BwdConfig.dq_first_store)
        cfg, hook = _config(name[:-11])
        return dataclasses.replace(cfg, dq_first_store=True), hook
    if name.endswith("-finish"):              # dQ stored by the main kernel (BwdConfig.dq_finish)
        cfg, hook = _config(name[:-7])
        return dataclasses.replace(cfg, dq_finish=True), hook
    if name.startswith("det-"):
        cfg, hook = _config(DETERMINISTIC[name])
        return dataclasses.replace(cfg, deterministic=True), hook
    raise KeyError(name)


DEFAULT = ["d128-dense", "d128-causal-softcap", "d64-sparse-document", "d128-band-window", "d128-relative-bias",
           "d96-causal-softcap", "d32-sparse-document"]
# Deterministic variants: dense, causal (+ score mod), block-sparse, buffer gradients.
DETERMINISTIC = {"det-d128-dense": "d128-dense", "det-d128-causal-softcap": "d128-causal-softcap",
                 "det-d64-sparse-document": "d64-sparse-document",
                 "det-d128-relative-bias": "d128-relative-bias",
                 "det-d192-128-sparse-document": "d192-128-sparse-document"}
# tile_m 80 (dQ^T = K^T dS^T): dense, a score mod, buffer gradients, deterministic.
TILE80 = ["d128-dense-80", "d128-softcap-80", "d128-relative-bias-80", "det-d128-dense-80",
          "det-d128-relative-bias-80"]
# value head dims apart from the query's (dP^T's k steps and dV's N are Dv's)
VALUE_DIMS = ["d128-64-causal-softcap", "d64-128-dense", "d96-64-sparse-document"]
# head dims beyond 128 (BwdConfig.split_head_dim)
WIDE = ["d256-causal-softcap", "d192-128-sparse-document"]
# the swapped layout beyond 128 (BwdConfig.dkv_swap)
SWAPPED = ["d192-128-causal-softcap-swap", "d192-dense-swap", "d256-128-causal-swap48", "d192-causal-swap-q2do1"]
# tile_m 128 (head dims up to 64, no score mod; wider block lists spill: bwd.plan)
TILE128 = ["d64-causal-128", "d32-sparse-document-128"]
# persistent CTAs (planned for documents' even columns: kernel_path._backward_ctas; FLEXATTN_BWD_PERSISTENT=1 everywhere)
PERSISTENT = ["d128-band-window-persist", "d128-sparse-document-persist"]
# dQ finished in the main kernel (not planned: measured slower; FLEXATTN_DQ_FINISH=1 plans it)
FINISH = ["d128-causal-softcap-finish", "d128-band-window-finish", "d64-sparse-document-finish",
          "d96-causal-softcap-finish", "d128-dense-finish"]
# programmatic dependent launch (not planned: measured neutral; FLEXATTN_BWD_PDL=1 plans it)
PDL = ["d128-band-window-pdl", "d128-band-window-persist-pdl", "det-d128-relative-bias-pdl"]
# head dim 256 layouts (BwdConfig.dkv_rows, tail_order): swap48-rows / swap80-rows planned at 256/256 and
# 256/128 (bwd.plan.SWAP_PLANNED), the split ones measured slower on the H200
WIDE256 = ["d256-128-causal-split-q2do1", "d256-causal-split-dvfirst", "d256-causal-swap48-rows",
           "d256-128-causal-swap80-rows"]
# idle warpgroups on visits that mask all their keys (BwdConfig.idle_masked_keys), beside the plain causal kernel
IDLE = ["d128-causal-idle", "d128-band-window-idle", "d128-causal-softcap-idle", "d128-causal"]
# 192/192's layout (planned since session 38: bwd.plan.SWAP_PLANNED) with and without BwdConfig.p_early
P_EARLY = ["d192-causal-swap96-dvfirst", "d192-causal-swap96-dvfirst-pearly"]
# the full q-block list alone (planned where the forward walks full blocks alone)
FULL_ONLY = ["d128-sparse-document-persist-fullonly", "d64-sparse-document-fullonly"]
NAMES = (DEFAULT + list(DETERMINISTIC) + TILE80 + VALUE_DIMS + WIDE + SWAPPED + TILE128 + PERSISTENT + FINISH + PDL
         + WIDE256 + P_EARLY + IDLE + FULL_ONLY)
# compiled with NAMES for the tests that name them, outside the instruction / spill checks
BUFFER_READS = ["d128-alibi-slopes", "d128-table-2d"]
ALIBI = ["d128-causal-alibi", "d128-causal-alibi-fixed", "d128-causal-alibi8-fixed"]
FIRST_STORE = ["d128-causal-firststore", "d128-sparse-document-persist-firststore", "d128-causal-firststore-data"]
EXTRA = BUFFER_READS + ALIBI + FIRST_STORE
_TABLE_2D = np.zeros((4, 9, 9), np.float32)


def _ptx(name):
    cfg, hook = _config(name)
    return compile_backward(cfg, fake_args(hook), keep_ptx=True).__ptx__


prefetch(_ptx, NAMES + EXTRA)   # the fixture's jobs, started ahead (compile_pool.py)


@pytest.fixture(scope="module")
def compiled():
    """Compile each config once (3-6 s each, in parallel processes) and keep its PTX."""
    ptx = compile_all(_ptx)
    return {name: (_config(name)[0], text) for name, text in ptx.items()}


def _steps(ptx: str, cfg: BwdConfig) -> float:
    """Instances of the per-q-block step: S^T (D/16), dP^T (Dv/16), dV, dK (tile_m/16
    each), dQ (tile_n/16)."""
    per_step = (cfg.head_dim + cfg.head_dim_v) // 16 + 2 * cfg.tile_m // 16 + cfg.tile_n // 16
    return ptx.count("wgmma.mma_async") / per_step


@pytest.mark.parametrize("name", NAMES)
def test_hopper_instructions(compiled, name):
    _, ptx = compiled[name]
    assert ".target sm_90a" in ptx
    assert "wgmma.mma_async" in ptx
    assert "cp.async.bulk.tensor" in ptx             # TMA loads; TMA store of dK, dV
    assert "setmaxnreg.inc" in ptx and "setmaxnreg.dec" in ptx
    assert "stmatrix" in ptx                         # dS^T -> smem, dK/dV epilogue
    assert "ex2.approx" in ptx
    # dQ: registers -> sdQ (st.shared.v4, fragment order) -> one bulk add per warpgroup
    assert "st.shared.v4.b32" in ptx
    assert ptx.count("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32") == 2
    assert "red.global.add.v2" not in ptx


@pytest.mark.parametrize("name", NAMES)
def test_no_spills(compiled, name):
    _, ptx = compiled[name]
    usage = resource_usage_from_ptx(ptx)
    if usage is None:
        pytest.skip("no ptxas on PATH")
    assert usage.spill_store_bytes == 0 and usage.spill_load_bytes == 0, usage
    assert usage.stack_bytes == 0, usage
    assert usage.wgmma_serialized is None, usage      # (ptxas would make every wgmma wait)


def test_block_structures(compiled):
    # Dense without a mask: one step instance; causal: diagonal + interior steps;
    # block-sparse: partial + full lists. Deterministic mode: the same steps.
    for name, steps in (("d128-dense", 1), ("d128-causal-softcap", 2), ("d64-sparse-document", 2),
                        ("d128-dense-80", 1)):
        for n in (name, "det-" + name):
            cfg, ptx = compiled[n]
            assert _steps(ptx, cfg) == steps, n
    # The band: the same partial and full steps as the lists.
    cfg, ptx = compiled["d128-band-window"]
    assert _steps(ptx, cfg) == 2
    # Lists without partial blocks (BwdConfig.partial_blocks=False): the full step alone.
    for name in FULL_ONLY:
        cfg, ptx = compiled[name]
        assert _steps(ptx, cfg) == 1, name
    with pytest.raises(ValueError, match="partial_blocks"):
        BwdConfig(head_dim=128, causal=True, partial_blocks=False)


def test_idle_masked_keys(compiled):
    """BwdConfig.idle_masked_keys adds one step body, the idle warpgroup's: a zero dS^T
    store and its dQ GEMM only (tile_n / 16 wgmma: k-steps over the keys; no exponentials), beside
    the causal / band walk's two full steps; the default config's PTX has none of it."""
    base = compiled["d128-causal"][1].count("wgmma.mma_async")
    for name in ("d128-causal-idle", "d128-band-window-idle", "d128-causal-softcap-idle"):
        cfg, ptx = compiled[name]
        plain = compiled["d128-band-window"][1] if "band" in name else compiled[name.replace("-idle", "")][1]
        assert ptx.count("wgmma.mma_async") - plain.count("wgmma.mma_async") == cfg.tile_n // 16, name
        assert ptx.count("ex2.approx") == plain.count("ex2.approx"), name
        assert ptx.count("bar.sync") > plain.count("bar.sync"), name      # its own ds_full / dq_empty waits
    assert base == compiled["d128-causal-softcap"][1].count("wgmma.mma_async")


def test_idle_masked_keys_is_validated():
    """Only the causal / band walks of 128-key CTAs without split head dims or per-diagonal
    sums take idle warpgroups."""
    BwdConfig(head_dim=128, causal=True, idle_masked_keys=True)
    for kw in (dict(head_dim=128), dict(head_dim=256, causal=True), dict(head_dim=128, block_sparse=True),
               dict(head_dim=192, causal=True), dict(dtype="fp32", head_dim=128, causal=True),
               dict(head_dim=128, causal=True, mods=IRModHook(mods.relative_bias(np.zeros((4, 15), np.float32)),
                                                              None))):
        with pytest.raises(ValueError, match="idle_masked_keys"):
            BwdConfig(**kw, idle_masked_keys=True)


def test_planner_idle_masked_keys(monkeypatch):
    """config_from_forward plans idle warpgroups wherever they apply (causal and band walks
    at head dims up to 128, deterministic too), never on block lists, dense walks, float32
    or wide head dims; FLEXATTN_BWD_IDLE_KEYS=0 and an explicit override leave it off."""
    from flexattn.kernels.bwd.plan import config_from_forward
    from flexattn.kernels.fwd.sm90 import FwdConfig

    monkeypatch.delenv("FLEXATTN_BWD_IDLE_KEYS", raising=False)
    band = IRModHook(None, canonical_band(mods.sliding_window(1024)))
    for fwd in (FwdConfig(head_dim=128, causal=True), FwdConfig(head_dim=64, causal=True),
                FwdConfig(head_dim=96, causal=True), FwdConfig(head_dim=128, band=True, mods=band)):
        assert config_from_forward(fwd).idle_masked_keys, fwd
        assert config_from_forward(fwd, deterministic=True).idle_masked_keys == fwd.causal, fwd
        assert not config_from_forward(fwd, idle_masked_keys=False).idle_masked_keys
    for fwd in (FwdConfig(head_dim=128), FwdConfig(head_dim=128, block_sparse=True),
                FwdConfig(head_dim=192, causal=True), FwdConfig(dtype="fp32", head_dim=128, causal=True)):
        assert not config_from_forward(fwd).idle_masked_keys, fwd
    monkeypatch.setenv("FLEXATTN_BWD_IDLE_KEYS", "0")
    assert not config_from_forward(FwdConfig(head_dim=128, causal=True)).idle_masked_keys


def test_persistent(compiled):
    """Persistent CTAs loop over kv tiles around the same two steps (no second copy), and
    release K / V for the next tile (one more mbarrier arrive than one CTA per tile, which
    never reloads them) before the epilogue: dK / dV are staged in sdQ / sdS
    (`dkv_staged_apart`), behind the writer's `DQ_DRAINED` arrival (barrier 10, the 256
    consumers and the writer warp, in place of the consumers' own sync before staging), and
    the consumers meet once more after the stores have read them. The combinations they
    refuse are errors."""
    from flexattn.kernels.bwd.sm90 import FlashBwdSm90

    cfg, ptx = compiled["d128-band-window-persist"]
    assert _steps(ptx, cfg) == 2
    _, once = compiled["d128-band-window"]
    arrives = "mbarrier.arrive.shared"
    assert ptx.count(arrives) > once.count(arrives)
    assert FlashBwdSm90(cfg).dkv_staged_apart and not FlashBwdSm90(compiled["d128-band-window"][0]).dkv_staged_apart
    assert len(re.findall(r"bar\.arrive\s+10, 288;", ptx)) == 1
    assert len(re.findall(r"bar\.sync\s+10, 288;", ptx)) == 1
    assert "10, 288" not in once
    epilogue = r"bar\.sync\s+1, 256;"
    assert len(re.findall(epilogue, ptx)) == len(re.findall(epilogue, once)) == 2
    # documents' lists, as planned: the partial and full steps once, dK / dV staged apart
    cfg, ptx = compiled["d128-sparse-document-persist"]
    assert _steps(ptx, cfg) == 2 and FlashBwdSm90(cfg).dkv_staged_apart
    assert len(re.findall(r"bar\.arrive\s+10, 288;", ptx)) == 1
    for bad in (dict(max_ctas=132, deterministic=True), dict(max_ctas=132, cluster_n=2), dict(max_ctas=-1)):
        with pytest.raises(ValueError, match="max_ctas"):
            BwdConfig(head_dim=128, **bad)
    with pytest.raises(ValueError, match="persistent"):
        BwdConfig(dtype="fp32", head_dim=64, max_ctas=132)


@pytest.mark.parametrize("name", PDL)
def test_pdl(compiled, name, monkeypatch):
    """Under PDL the main kernel lets the postprocess launch once its CTAs have started
    (one launch_dependents) and waits for the preprocess in every role that reads what it
    wrote: the producer (after K / V where one CTA has one tile), the dQ writer (and the
    idle producer warps with it) and the consumers: three waits; the same steps; none of
    it without PDL. The preprocess signals, the postprocess waits; neither without PDL."""
    cfg, ptx = compiled[name]
    _, plain = compiled[name[:-4]]
    assert _steps(ptx, cfg) == _steps(plain, cfg)
    assert ptx.count("griddepcontrol.launch_dependents") == 1
    assert ptx.count("griddepcontrol.wait") == 3
    assert "griddepcontrol" not in plain
    if name == PDL[0]:
        pre = compile_preprocess("bf16", 128, pdl=True, keep_ptx=True).__ptx__
        post = compile_postprocess("bf16", 128, pdl=True, keep_ptx=True).__ptx__
        assert pre.count("griddepcontrol.launch_dependents") == 1 and "griddepcontrol.wait" not in pre
        assert post.count("griddepcontrol.wait") == 1 and "launch_dependents" not in post
        for ptx in (compile_preprocess("bf16", 128, keep_ptx=True).__ptx__,
                    compile_postprocess("bf16", 128, keep_ptx=True).__ptx__):
            assert "griddepcontrol" not in ptx
        with pytest.raises(ValueError, match="pdl"):
            BwdConfig(dtype="fp32", head_dim=64, pdl=True)
        from flexattn.kernels.bwd.plan import config_from_forward
        from flexattn.kernels.fwd.sm90 import FwdConfig

        fwd = FwdConfig(head_dim=128)
        monkeypatch.delenv("FLEXATTN_BWD_PDL", raising=False)
        assert not config_from_forward(fwd).pdl
        monkeypatch.setenv("FLEXATTN_BWD_PDL", "1")
        assert config_from_forward(fwd).pdl
        assert not config_from_forward(dataclasses.replace(fwd, dtype="fp32")).pdl


@pytest.mark.parametrize("name", FINISH)
def test_dq_finish(compiled, name):
    """dq_finish: the same steps; the dQ writer counts each visit's landed adds with one
    release atom per visit (and hands finished tiles over through two named
    barriers), two finisher warps each read their half of a tile back with one bulk copy
    and store dQ in 4-byte pairs; none of it without dq_finish."""
    cfg, ptx = compiled[name]
    _, plain = compiled[name[:-7]]
    assert _steps(ptx, cfg) == _steps(plain, cfg)
    for text, count in (("atom.release.gpu.global.add.s32", 2),
                        ("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes", 1),
                        ("fence.proxy.async.global", 1), ("fence.acq_rel.gpu", 3)):
        assert ptx.count(text) == count and text not in plain, text
    assert "st.global.b32" in ptx or "st.global.v2.b16" in ptx or "st.global.u32" in ptx
    with pytest.raises(ValueError, match="dq_finish"):
        BwdConfig(head_dim=128, dq_finish=True, deterministic=True)
    with pytest.raises(ValueError, match="dq_finish"):
        BwdConfig(head_dim=128, dq_finish=True, tile_m=80)
    with pytest.raises(ValueError, match="dq_finish"):
        BwdConfig(head_dim=256, dq_finish=True)


@pytest.mark.parametrize("name", TILE80)
def test_tile_m_80(compiled, name):
    """80 q rows per visit: S^T, dP^T and the swapped dQ^T GEMMs are m64n80 (8 k-steps
    each over D or the 128 keys), dV and dK m64n128 (5 k-steps over the 80 rows); dS goes
    to shared memory transposed (keys contiguous: the dQ^T GEMM's K-major B), 5 stmatrix
    .trans per step; the dQ^T fragments leave by the same two bulk adds; no
    shared-memory diagonal sums (they do not fit next to 80-row tiles)."""
    cfg, ptx = compiled[name]
    assert cfg.tile_m == 80 and cfg.dq_swap_ab and cfg.q_pad == 80
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n80k16") == 24
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n128k16") == 10
    assert ptx.count("wgmma.mma_async") == 34
    assert ptx.count("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16") == 5
    assert ptx.count("stmatrix.sync.aligned.m8n8.x4.shared.b16") == 16    # dK, dV epilogue
    assert ptx.count("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32") == 2
    if cfg.buffer_grads:
        # 40 elements per thread and step on 22 diagonals (2 key rows x 20 query
        # columns): one add per diagonal (fp32 reduction, or fixed-point digits)
        if cfg.deterministic:
            assert "red.global.add.u64" in ptx
        else:
            assert ptx.count("red.global.add.f32") == 22
        assert "st.shared.f32" not in ptx


@pytest.mark.parametrize("name", WIDE + ["det-d192-128-sparse-document"])
def test_head_dims_beyond_128(compiled, name):
    """split_head_dim: 64-key CTAs; S^T and dP^T m64n32 per warpgroup (its 32 q columns,
    D / 16 and Dv / 16 k-steps), dQ, dK and dV m64n(D / 2 | Dv / 2) with 4 k-steps (64 keys
    or 64 q rows) from shared memory (P^T and dS^T: 2 x 2 stmatrix per step, no RS
    wgmma); one Q / dO stage at 256/256, two at 192/128; the same two bulk dQ adds."""
    cfg, ptx = compiled[name]
    D, Dv = cfg.head_dim, cfg.head_dim_v
    assert cfg.split_head_dim and (cfg.tile_m, cfg.tile_n) == (64, 64)
    assert cfg.num_stages == (1 if D == Dv == 256 else 2)
    steps = 2 if cfg.causal or cfg.block_sparse else 1
    per_step = {32: (D + Dv) // 16, D // 2: 8, Dv // 2: 4}
    if D == Dv:
        per_step = {32: (D + Dv) // 16, D // 2: 12}
    for n, count in per_step.items():
        assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{n}k16") == steps * count, n
    assert ptx.count("wgmma.mma_async") == steps * sum(per_step.values())
    # (epilogue: a warp stores its 16 keys x the warpgroup's D / 2 + Dv / 2 columns)
    assert ptx.count("stmatrix.sync.aligned.m8n8.x4.shared.b16") == steps * 4 + (D + Dv) // 32
    assert ptx.count("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32") == 2


@pytest.mark.parametrize("name", SWAPPED)
def test_swapped_layout(compiled, name):
    """dkv_swap: 96- (or 48-) key CTAs; S = Q K^T and dP = dO V^T m64n48 (n24) per warpgroup
    (its half of the keys, D / 16 and Dv / 16 k-steps); dK^T and dV^T m64n48 (n24) with the
    head dim on M (D / 64 and Dv / 64 atoms, 4 k-steps over the 64 q rows); dQ m64n(D / 2)
    over all the keys (tile_n / 16 k-steps); P^T and dS^T by transposing stmatrix, dK^T / dV^T
    too in the epilogue; the same two bulk dQ adds."""
    cfg, ptx = compiled[name]
    D, Dv, tn = cfg.head_dim, cfg.head_dim_v, cfg.tile_n
    assert cfg.dkv_swap and cfg.tile_m == 64 and tn in (96, 48)
    steps = 2 if cfg.causal else 1
    n_half = (D + Dv) // 16 + 4 * (D + Dv) // 64
    assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{tn // 2}k16") == steps * n_half
    assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{D // 2}k16") == steps * tn // 16
    assert ptx.count("wgmma.mma_async") == steps * (n_half + tn // 16)
    assert "stmatrix.sync.aligned.m8n8" in ptx and ".trans.shared.b16" in ptx
    assert "stmatrix.sync.aligned.m8n8.x4.shared.b16" not in ptx and "stmatrix.sync.aligned.m8n8.x2.shared.b16" not in ptx
    assert ptx.count("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32") == 2


def test_swapped_layout_rings(compiled):
    """do_stages / ds_buffers (the split layouts only): FA4's rings at 192/192 fit shared
    memory with two Q stages, one dO stage and one dS^T buffer (not with two dS^T buffers);
    the one-buffer kernel meets at an extra consumer barrier per visit (bar.sync 7, 256);
    elsewhere the fields are refused."""
    from flexattn.kernels.bwd.sm90 import SMEM_CAPACITY, split_shared_bytes

    cfg, ptx = compiled["d192-causal-swap-q2do1"]
    assert (cfg.num_stages, cfg.do_ring, cfg.ds_ring) == (2, 1, 1)
    assert split_shared_bytes(cfg, 2) <= SMEM_CAPACITY < split_shared_bytes(cfg, 2, 1, 2)
    assert re.search(r"bar\.sync\s+7, 256;", ptx)
    assert not re.search(r"bar\.sync\s+7,", compiled["d192-128-causal-softcap-swap"][1])
    for bad in (dict(head_dim=128, do_stages=1), dict(head_dim=192, ds_buffers=1),
                dict(head_dim=192, tile_n=96, num_stages=1, do_stages=2)):
        with pytest.raises(ValueError):
            BwdConfig(**bad)


@pytest.mark.parametrize("name", ["d256-causal-swap48-rows", "d256-128-causal-swap80-rows"])
def test_swapped_layout_by_rows(compiled, name):
    """dkv_rows: the swapped layout's dK^T / dV^T with the warpgroups on head-dim rows (FA4's
    AtomLayoutNdKV=1 at 256): m64n<tile_n> over all the keys — (D + Dv) / 128 atoms of 4
    k-steps per warpgroup — beside S / dP at m64n<tile_n / 2> and dQ at m64n<D / 2>; the P^T
    store waits at the dS barrier (both warpgroups read all of P^T)."""
    cfg, ptx = compiled[name]
    D, Dv, tn = cfg.head_dim, cfg.head_dim_v, cfg.tile_n
    assert cfg.dkv_swap and cfg.dkv_rows and cfg.tail_order == "dv_first"
    steps = 2 if cfg.causal else 1
    assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{tn}k16") == steps * 4 * (D + Dv) // 128
    assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{tn // 2}k16") == steps * (D + Dv) // 16
    assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{D // 2}k16") == steps * tn // 16
    assert re.search(r"bar\.sync\s+7, 256;", ptx)


def test_p_early_stores_p_while_dp_runs(compiled):
    """BwdConfig.p_early: P^T's stmatrix stores sit between S's wait (1: dP still in flight)
    and dP's (0), instead of after dP's with dS^T's."""
    late, early = (ptx_order.runs(compiled[n][1], ptx_order.WAIT, ptx_order.STMATRIX, ptx_order.BARRIER)
                   for n in P_EARLY)
    assert late.count("wait1x1 wait0x1 stmx3 barx1 stmx3") == 2 and "wait1x1 stmx3 wait0x1" not in late, late
    assert early.count("wait1x1 stmx3 wait0x1 barx1 stmx3") == 2 and "wait1x1 wait0x1 stmx3" not in early, early
    with pytest.raises(ValueError, match="p_early"):
        BwdConfig(head_dim=192, tile_n=64, p_early=True)        # the split layout: no P^T buffer of its own
    with pytest.raises(ValueError, match="p_early"):
        BwdConfig(head_dim=256, tile_n=48, num_stages=2, do_stages=1, ds_buffers=1, dkv_rows=True, p_early=True)


@pytest.mark.parametrize("name", ["d128-causal", "d128-dense"])
def test_dv_follows_the_ds_stores(compiled, name):
    """dV's GEMM (m64n<D>, A = P^T from registers) is issued after dP^T's wait for 0 and
    dS^T's stmatrix stores, before the DS_FULL barrier (FA3 / FA4's order; issuing it under
    the dS pass instead measured neutral, docs/experiments.md, session 45)."""
    tokens = (ptx_order.WGMMA, ptx_order.COMMIT, ptx_order.WAIT, ptx_order.STMATRIX, ptx_order.BARRIER)
    runs = ptx_order.runs(compiled[name][1], *tokens)
    steps = 2 if compiled[name][0].causal else 1
    assert runs.count("wait1x1 wait0x1 stmx4 W128x4 Cx1 barx1") == steps, runs


def test_head_dim_256_candidates_are_validated():
    """dkv_rows needs the swapped layout; tail_order "dv_first" the split layouts."""
    for bad in (dict(head_dim=256, dkv_rows=True), dict(head_dim=128, tail_order="dv_first"),
                dict(head_dim=256, tail_order="dv_last")):
        with pytest.raises(ValueError):
            BwdConfig(**bad)


def test_lockstep_state_follows_a_ring_of_its_own():
    """`tma_pipeline.lockstep_state` (the dO ring under a deeper Q ring, `do_stages`): after
    n visits it is where a ring of its own depth would be after n advances — slot n % depth,
    the phase flipped once per wrap from the producer's 1 / the consumer's 0 (cutlass'
    PipelineState convention) — and a ring of the same depth is the Q state itself."""
    from types import SimpleNamespace

    from flexattn.kernels.hopper.tma_pipeline import lockstep_state

    for producer in (True, False):
        for depth in (1, 2):
            index, phase = 0, int(producer)
            for n in range(9):
                q_state = SimpleNamespace(stages=2, count=n)
                got = lockstep_state(q_state, depth, producer)
                if depth == 2:
                    assert got is q_state
                else:
                    assert (got.stages, got.count, got.index, got.phase) == (depth, n, index, phase), (producer, n)
                index += 1                          # PipelineState.advance
                if index == depth:
                    index, phase = 0, phase ^ 1


def test_planner_swapped_layout():
    """bwd.plan.with_swapped_layout: the swapped layout where SWAP_PLANNED names the head
    dims (measured faster), for the dense and causal walks, where its stages fit: 96 keys
    split by keys at 192/128, 128/192, 192/64 (two Q / dO stages) and 192/192 (FA4's rings, dV
    first); 80 (256/128) and 48 (256/256) keys split by
    head-dim rows, two Q stages, one dO stage, one dS^T buffer, dV first; the 64-key split
    layout elsewhere (144, block lists, bands, deterministic)."""
    from flexattn.kernels.bwd.plan import with_swapped_layout

    def layout(**kw):
        cfg = with_swapped_layout(BwdConfig(**kw))
        return cfg.tile_n, cfg.num_stages

    assert layout(head_dim=192, head_dim_v=128, causal=True) == (96, 2) and layout(head_dim=192, head_dim_v=128) == (96, 2)
    assert layout(head_dim=128, head_dim_v=192) == (96, 2) and layout(head_dim=192, head_dim_v=64) == (96, 2)
    BwdConfig(head_dim=128, head_dim_v=192, tile_n=96, num_stages=2)
    BwdConfig(head_dim=192, head_dim_v=64, tile_n=96, num_stages=2)
    for kw, tile_n in ((dict(head_dim=256, head_dim_v=128, causal=True), 80), (dict(head_dim=256), 48)):
        cfg = with_swapped_layout(BwdConfig(**kw))
        assert (cfg.tile_n, cfg.num_stages, cfg.do_ring, cfg.ds_ring, cfg.dkv_rows, cfg.tail_order) == (
            tile_n, 2, 1, 1, True, "dv_first"), kw
        assert cfg.dkv_swap and not with_swapped_layout(BwdConfig(**kw, deterministic=True)).dkv_swap
    cfg = with_swapped_layout(BwdConfig(head_dim=192, causal=True))     # 192/192: FA4's rings, keys split
    assert (cfg.tile_n, cfg.num_stages, cfg.do_ring, cfg.ds_ring, cfg.dkv_rows, cfg.tail_order) == (
        96, 2, 1, 1, False, "dv_first")
    for kw in (dict(head_dim=144), dict(head_dim=192, deterministic=True),
               dict(head_dim=256, head_dim_v=64),
               dict(head_dim=192, block_sparse=True, mods=IRModHook(None, mods.sliding_window(64))),
               dict(head_dim=256, block_sparse=True, mods=IRModHook(None, mods.sliding_window(64)))):
        assert layout(**kw)[0] == 64, kw
    assert layout(head_dim=128)[0] == 128
    with pytest.raises(ValueError, match="swapped"):
        BwdConfig(head_dim=256, tile_n=96)
    with pytest.raises(ValueError, match="swapped"):
        BwdConfig(head_dim=192, tile_n=96, deterministic=True)
    with pytest.raises(ValueError, match="multiples of 128"):     # (192 rows: no whole atoms per warpgroup)
        BwdConfig(head_dim=192, head_dim_v=128, tile_n=96, num_stages=2, dkv_rows=True)


@pytest.mark.parametrize("name", TILE128)
def test_tile_m_128(compiled, name):
    """128 q rows per visit: S^T and dP^T m64n128 (both warpgroups, D / 16 k-steps each),
    dV and dK 8 k-steps over the rows, dQ one 64-row M atom of the whole head dim per
    warpgroup (`dq_splits_rows`: m64nD, 8 k-steps over the keys; 4096 fp32 per warpgroup at
    D 64); still two bulk adds; the planner's choice (`choose_tile_m`) where no score mod
    runs, block lists only at 32."""
    from flexattn.kernels.bwd.plan import choose_tile_m

    cfg, ptx = compiled[name]
    D = cfg.head_dim
    steps = 2
    assert ptx.count("wgmma.mma_async.sync.aligned.m64n128k16") == steps * (2 * D // 16)
    assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{D}k16") == steps * (2 * 128 // 16 + 128 // 16)
    assert ptx.count("wgmma.mma_async") == steps * (2 * D // 16 + 2 * 128 // 16 + 128 // 16)
    assert ptx.count("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32") == 2
    assert choose_tile_m(dataclasses.replace(cfg, tile_m=64)) == 128
    assert choose_tile_m(_config("d64-sparse-document")[0]) == 64       # lists beyond 32
    assert choose_tile_m(_config("d128-causal-softcap")[0]) == 64


def test_tile_m_80_fits_shared_memory():
    """Q, dO (2 stages of 80 x 128), K, V, dS (2 stages), the fp32 dQ tile and LSE / D
    (stages 128-byte aligned for TMA): 227 KB, the sm_90 maximum per CTA, exactly (the
    struct rounds up to its 1024-byte alignment). The kernel refuses to compile past it."""
    from flexattn.kernels.launch.compile import compile_on_fakes
    from flexattn.kernels.launch.fakes import fake_backward_args
    from flexattn.kernels.bwd.sm90 import SMEM_CAPACITY, FlashBwdSm90

    sizes = {}
    for name in ("d128-dense", "d128-dense-80", "det-d128-relative-bias-80"):
        cfg, hook = _config(name)
        kernel = FlashBwdSm90(cfg)
        compile_on_fakes(kernel, fake_backward_args(cfg, fake_args(hook)))
        sizes[name] = kernel.smem_bytes
    assert sizes["d128-dense"] == 195 * 1024
    assert sizes["d128-dense-80"] == sizes["det-d128-relative-bias-80"] == SMEM_CAPACITY


def test_buffer_gradients(compiled):
    cfg, ptx = compiled["d128-relative-bias"]
    # The float table's slot (the clamp distance is a captured int scalar, no grad).
    kinds = capture_kinds(cfg.mods)
    assert cfg.buffer_grads and cfg.mods.grad_slots == tuple(
        i for i, k in enumerate(kinds) if k[0] == "buffer" and k[1].startswith("float"))
    assert "red.global.add.f32" in ptx               # table gradient scatter
    for name in ("d128-dense", "d128-causal-softcap", "d64-sparse-document"):
        assert "red.global.add.f32 " not in compiled[name][1]
    assert "atom.global.add.u64" not in ptx          # fixed point: deterministic mode only


# The dQ turn protocol (bwd_sm90._dq_wait_turn / _dq_pass_turn).
TURN = ("ld.acquire.gpu.global.b32", "red.release.gpu.global.add.s32", "trap;")


@pytest.mark.parametrize("name", [n for n in NAMES if n.startswith("det-")])
def test_deterministic_dq_turns(compiled, name):
    cfg, ptx = compiled[name]
    assert cfg.deterministic and cfg.key() != _config(name[4:])[0].key()
    for needle in TURN:
        assert needle in ptx, needle
    # non-causal: a 1-D grid in L2 sections (FlashBwdSm90._deterministic_tile); causal:
    # (kv block, head, batch), kv blocks reversed
    if cfg.causal:
        assert "%ctaid.y" in ptx and "%nctaid.x" in ptx
    else:
        assert "%ctaid.y" not in ptx and "%ctaid.x" in ptx
    # The writer warp: a spin per visit (a loop around the acquire load) before the bulk
    # adds; the turn is passed (one release add, after a wait for the *writes* of the adds:
    # no .read) right after them, or (block-sparse) at the next visit and once after the last.
    assert ptx.count("red.release.gpu.global.add.s32") == (2 if cfg.block_sparse else 1)
    lines = ptx.splitlines()
    i = next(j for j, line in enumerate(lines) if "ld.acquire.gpu.global.b32" in line)
    assert any(line.strip().startswith("@") and "bra" in line for line in lines[i:i + 12])
    for j, line in enumerate(lines):
        if "red.release.gpu" in line:
            assert "cp.async.bulk.wait_group \t0;" in "\n".join(lines[j - 12:j]), line
    if cfg.block_sparse:
        # The turn is counted in the kv-side lists by the writer warp (one shuffle
        # reduction, 5 shfl, on top of the default kernel's).
        # 64-key CTAs (split_head_dim) also count the last kv block's entries: 5 more.
        extra = ptx.count("shfl.sync") - compiled[name[4:]][1].count("shfl.sync")
        assert extra == (10 if cfg.split_head_dim else 5)


def test_default_has_no_turns(compiled):
    for name in DEFAULT + [n for n in TILE80 if not n.startswith("det-")]:
        ptx = compiled[name][1]
        for needle in ("ld.acquire", "red.release", "atom.global.add.u64", "trap;"):
            assert needle not in ptx, (name, needle)


def test_deterministic_buffer_gradients(compiled):
    _, ptx = compiled["det-d128-relative-bias"]
    # Fixed point as four digit counters: one predicated red.add.u64 per digit (skipped
    # when the digit is 0), none returning a value; fp32 reds only for non-finite values.
    reds = [line.strip() for line in ptx.splitlines() if "red.global.add.u64" in line]
    assert reds and all(line.startswith("@") for line in reds)
    assert len(reds) % 4 == 0 and "atom.global" not in ptx
    assert "testp.finite.f32" in ptx
    fp32_reds = [line for line in ptx.splitlines() if "red.global.add.f32 " in line]
    assert fp32_reds and all(line.strip().startswith("@!") for line in fp32_reds)


def test_softcap_value_is_not_baked_in(compiled):
    _, ptx = compiled["d128-causal-softcap"]
    assert "0f41F00000" not in ptx                   # 30.0f: a runtime arg
    assert "tanh.approx" in ptx


def test_pre_and_postprocess_compile():
    pre = compile_preprocess("bf16", 128, keep_ptx=True).__ptx__
    assert ".target sm_90a" in pre and "shfl.sync" in pre      # row reduction
    pre_dlse = compile_preprocess("fp16", 64, with_dlse=True, keep_ptx=True).__ptx__
    assert ".target sm_90a" in pre_dlse
    post = compile_postprocess("bf16", 64, keep_ptx=True).__ptx__
    assert ".target sm_90a" in post and "cvt.rn.bf16" in post
    # dq_accum tiles read back in 16-byte loads, written by stmatrix + one TMA store
    assert "ld.global.v4" in post and "stmatrix" in post and "cp.async.bulk.tensor" in post
    assert "fma.rn.f64" not in post
    assert ".trans" not in post


def test_pre_and_postprocess_compile_tile_m_80():
    """One preprocess CTA per 80-row tile (10 row passes of 8 rows, loads all issued
    first); the postprocess reads the dQ^T fragments back (10 16-byte loads per thread: 80
    rows x 64 head dims / 128 threads / 4 floats) and stores them transposed."""
    base = compile_preprocess("bf16", 128, keep_ptx=True).__ptx__
    pre = compile_preprocess("bf16", 128, tile_m=80, deterministic=True, keep_ptx=True).__ptx__
    assert pre.count("ld.global.v4") == base.count("ld.global.v4") * 80 // 64
    post = compile_postprocess("bf16", 128, tile_m=80, keep_ptx=True).__ptx__
    assert post.count("ld.global.v4") == 10
    assert post.count("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16") == 5
    for ptx in (pre, post):
        usage = resource_usage_from_ptx(ptx)
        if usage is not None:
            assert usage.spill_store_bytes == 0 and usage.stack_bytes == 0, usage


@pytest.mark.parametrize("head_dim", [48, 80, 112])
def test_postprocess_stores_dq_halves_not_multiples_of_16(head_dim):
    """dQ halves of 24, 40, 56 columns per warpgroup: stmatrix stores two 8x8 matrices at a
    time (four span 16 columns and wrote past the tile: an illegal address on the H100,
    found by compute-sanitizer, 2026-11-26); 16-byte loads of whole fragments."""
    post = compile_postprocess("bf16", head_dim, keep_ptx=True).__ptx__
    assert "stmatrix.sync.aligned.m8n8.x4" not in post
    assert post.count("stmatrix.sync.aligned.m8n8.x2.shared.b16") == head_dim // 2 // 8
    assert post.count("ld.global.v4") == 64 * head_dim // 2 // 128 // 4


def test_deterministic_pre_and_postprocess_compile():
    base = compile_preprocess("bf16", 128, keep_ptx=True).__ptx__
    pre = compile_preprocess("bf16", 128, deterministic=True, keep_ptx=True).__ptx__
    # + the tile's semaphore (one st.global.b32 by thread 0)
    assert pre.count("st.global") == base.count("st.global") + 1
    pre_fixed = compile_preprocess("bf16", 128, deterministic=True, grad_fixed=True,
                                   keep_ptx=True).__ptx__
    assert pre_fixed.count("st.global.b64") == 4    # grid-stride zeroing of the 4 digit counters
    post = compile_postprocess("fp16", 128, grad_ranks=(1, 2), keep_ptx=True).__ptx__
    # one fixed-point -> fp32 conversion per gradient slot (a 128-bit carry add each)
    assert post.count("fma.rn.f64") == 2 and post.count("cvt.rn.f32.f64") == 2
    assert post.count("add.cc.u64") == 2 and post.count("addc.u64") == 2
    for ptx in (pre, pre_fixed, post):
        usage = resource_usage_from_ptx(ptx)
        if usage is not None:
            assert usage.spill_store_bytes == 0 and usage.stack_bytes == 0, usage


def test_value_head_dims(compiled):
    """D != Dv: one step instance dense, two (diagonal + interior) causal or block-sparse;
    dK and dV leave by two TMA stores of their own widths."""
    for name, steps in (("d128-64-causal-softcap", 2), ("d64-128-dense", 1), ("d96-64-sparse-document", 2)):
        cfg, ptx = compiled[name]
        assert _steps(ptx, cfg) == steps, (name, _steps(ptx, cfg))
    assert BwdConfig(head_dim=128).head_dim_v == 128
    assert BwdConfig(head_dim=128, head_dim_v=64).key() != BwdConfig(head_dim=128).key()
    for bad in (dict(head_dim_v=16), dict(head_dim_v=136), dict(head_dim_v=72), dict(tile_m=80, head_dim_v=64)):
        with pytest.raises(ValueError):
            BwdConfig(**bad)


def test_config_validation():
    assert BwdConfig().q_pad == 128
    assert BwdConfig().key() == BwdConfig().key()
    assert BwdConfig().key() != BwdConfig(causal=True).key()
    assert BwdConfig().key() != BwdConfig(deterministic=True).key()
    assert not BwdConfig().deterministic
    # the deterministic writer passes turns right after its adds (dense) or a visit later
    # (block-sparse); the choice is part of the key only where it changes code
    assert BwdConfig(deterministic=True).turn_pass == "after_adds"
    assert BwdConfig(deterministic=True, block_sparse=True).turn_pass == "next_visit"
    assert BwdConfig(deterministic=True).key() != BwdConfig(deterministic=True, dq_turn_pass="next_visit").key()
    assert BwdConfig().key() == BwdConfig(dq_turn_pass="next_visit").key()
    with pytest.raises(ValueError, match="dq_turn_pass"):
        BwdConfig(dq_turn_pass="later")
    # the longest-first order's L2 budget is one kernel with the default where no such order runs
    assert BwdConfig(causal=True).key() != BwdConfig(causal=True, l2_section_bytes=10 << 20).key()
    assert BwdConfig(tile_order="by_head").key() == BwdConfig(tile_order="by_head", l2_section_bytes=10 << 20).key()
    with pytest.raises(ValueError, match="l2_section_bytes"):
        BwdConfig(l2_section_bytes=-1)
    with pytest.raises(ValueError):
        BwdConfig(tile_m=128)
    # tile_m 80: dense non-causal head dim 128 only; workspace rows padded to 80
    assert BwdConfig(tile_m=80).q_pad == 80 and BwdConfig(tile_m=80).dq_swap_ab
    assert not BwdConfig().dq_swap_ab
    assert BwdConfig(tile_m=80).key() != BwdConfig().key()
    for bad in (dict(causal=True), dict(block_sparse=True), dict(head_dim=64)):
        with pytest.raises(ValueError, match="tile_m=80"):
            BwdConfig(tile_m=80, **bad)
    with pytest.raises(ValueError):
        BwdConfig(causal=True, block_sparse=True)
    for bad in (16, 72, 136, 272):   # multiples of 16 from 32 to 256
        with pytest.raises(ValueError, match="head_dim"):
            BwdConfig(head_dim=bad)
    assert BwdConfig(head_dim=96).head_dim == 96 and BwdConfig(head_dim=80).head_dim == 80
    # beyond 128: 64-key CTAs, the head dim split between the warpgroups
    assert BwdConfig(head_dim=128, head_dim_v=144).split_head_dim and BwdConfig(head_dim=192).tile_n == 64
    assert not BwdConfig().split_head_dim and BwdConfig().tile_n == 128
    for bad in (dict(tile_n=128), dict(tile_m=80), dict(num_stages=3)):
        with pytest.raises(ValueError):
            BwdConfig(head_dim=256, **bad)
    with pytest.raises(ValueError, match="derivative"):
        BwdConfig(mods=hooks.SoftcapHook())           # hand-written: no derivative
    BwdConfig(mods=hooks.CausalHook())                # masks need none
    assert IRModHook(mods.alibi(num_heads=4)).grad_slots == (0,)
    assert IRModHook(mods.softcap(5.0)).grad_slots == ()


def test_planner_tile_m():
    """config_from_forward: 80-row q tiles for dense non-causal head dim 128 (deterministic
    too, any score mod), except a relative-position table's gradient (its shared-memory
    diagonal sums need 64-row tiles); 128 up to head dim 64 without a score mod; 64 for
    causal, block-sparse and score mods otherwise; an explicit tile_m wins; a grad filter that drops the table's gradient allows 80."""
    from types import SimpleNamespace

    from flexattn.kernels.bwd.plan import config_from_forward

    def config(head_dim=128, causal=False, block_sparse=False, band=False, score=None, mask=None,
               head_dim_v=None, **kw):
        fwd = SimpleNamespace(dtype="bf16", head_dim=head_dim, head_dim_v=head_dim_v or head_dim, causal=causal,
                              block_sparse=block_sparse, band=band, mods=IRModHook(score, mask))
        return config_from_forward(fwd, **kw)

    def tile(**kw):
        return config(**kw).tile_m

    table = mods.relative_bias(np.zeros((4, 15), np.float32))
    assert tile() == 80 and tile(deterministic=True) == 80
    assert tile(score=mods.softcap(5.0)) == 80 and tile(score=mods.alibi(np.ones(4, np.float32))) == 80
    assert tile(causal=True) == 64 and tile(head_dim=64, score=mods.softcap(5.0)) == 64
    # 128 rows up to head dim 64 without a score mod (block lists: only at 32)
    assert tile(head_dim=64) == 128 and tile(head_dim=32, causal=True) == 128
    assert tile(head_dim=64, head_dim_v=32, band=True, mask=mods.sliding_window(8)) == 128
    assert tile(head_dim=64, block_sparse=True, mask=mods.sliding_window(8)) == 64
    assert tile(head_dim=32, block_sparse=True, mask=mods.sliding_window(8)) == 128
    assert tile(head_dim=64, head_dim_v=96) == 64
    assert tile(head_dim_v=64) == 64 and config(head_dim_v=64).head_dim_v == 64   # 80 rows: D = Dv = 128
    assert tile(block_sparse=True, mask=mods.sliding_window(8)) == 64
    assert tile(score=table) == 64 and tile(score=table, deterministic=True) == 64
    assert tile(score=table, mods=IRModHook(table, None).with_grad_filter(())) == 80
    assert tile(tile_m=64) == 64 and tile(score=table, tile_m=80) == 80
    # A band walks by arithmetic in 64-row tiles; deterministic, it reads its block mask's lists.
    window = canonical_band(mods.sliding_window(8))
    assert tile(band=True, mask=window) == 64
    det = config(band=True, mask=window, deterministic=True)
    assert det.block_sparse and not det.band


def test_tile_order():
    # Causal: longest first (kv block 0 sees every q block); its deterministic variant and
    # every other structure: head order (the dQ turns follow the launch order).
    assert BwdConfig(causal=True).order == "longest_first"
    causal_det = dataclasses.replace(BwdConfig(causal=True), deterministic=True)
    assert causal_det.order == "by_head"
    assert BwdConfig().order == BwdConfig(block_sparse=True).order == "by_head"
    assert BwdConfig(causal=True).key() != BwdConfig(causal=True, tile_order="by_head").key()
    with pytest.raises(ValueError, match="deterministic"):
        BwdConfig(causal=True, deterministic=True, tile_order="longest_first")
    with pytest.raises(ValueError, match="tile_order"):
        BwdConfig(tile_order="random")


def test_runner_validates_and_compiles_on_cpu_tensors():
    torch = pytest.importorskip("torch")
    from flexattn.kernels.bwd.plan import workspace_shapes
    from flexattn.kernels.launch.backward import BackwardRunner
    from flexattn.kernels.launch.operands import BackwardArrays

    hook = IRModHook(None, mods.causal())
    cfg = BwdConfig(head_dim=64, mods=hook)
    B, Hq, Hkv, Sq, Skv, D = 1, 4, 2, 200, 150, 64
    q, o, do, dq = (torch.zeros(B, Hq, Sq, D, dtype=torch.bfloat16) for _ in range(4))
    k, v, dk, dv = (torch.zeros(B, Hkv, Skv, D, dtype=torch.bfloat16) for _ in range(4))
    lse = torch.zeros(B, Hq, Sq)
    ws = tuple(torch.zeros(s) for s in workspace_shapes(cfg, B, Hq, Sq).values())
    arrays = BackwardArrays(q, k, v, o, lse, do, dq, dk, dv)
    runner = BackwardRunner(cfg)
    with pytest.raises(ValueError, match="workspace"):
        runner.bind(arrays, ws[:2] + (torch.zeros(1),), 0.1, (), None, 0)
    with pytest.raises(TypeError):
        runner.bind(dataclasses.replace(arrays, dq=dq.float()), ws, 0.1, (), None, 0)
    runner.bind(arrays, ws, 0.1, (), None, 0)
    assert runner.num_compiled == 3                   # pre, main, post


def test_deterministic_runner_on_cpu_tensors():
    """Deterministic block-sparse GQA with buffer gradients: the workspace grows by the dQ
    semaphores (int32) and the fixed-point accumulators (int64), the kv-side lists are
    required, the gradients must be contiguous; everything compiles."""
    torch = pytest.importorskip("torch")
    from flexattn.blockmask import create_block_mask
    from flexattn.kernels.bwd.plan import buffer_grad_shapes, workspace_dtypes, workspace_shapes
    from flexattn.kernels.launch.backward import BackwardRunner
    from flexattn.kernels.launch.operands import BackwardArrays
    from flexattn.kernels.emit.mod_emit import runtime_args

    B, Hq, Hkv, Sq, Skv, D = 2, 4, 2, 300, 260, 64
    mask = mods.sliding_window(100)
    hook = IRModHook(mods.alibi(num_heads=Hq), mask)
    cfg = BwdConfig(head_dim=D, block_sparse=True, deterministic=True, mods=hook)
    shapes = workspace_shapes(cfg, B, Hq, Sq)
    dtypes = workspace_dtypes(cfg)
    assert list(shapes) == list(dtypes) == ["lse_log2", "delta", "dq_accum", "dq_semaphore",
                                            "grad_fixed"]
    assert shapes["dq_semaphore"] == (B, Hq, 384 // 64) and dtypes["dq_semaphore"] == "int32"
    assert buffer_grad_shapes(hook) == ((Hq,),)
    assert shapes["grad_fixed"] == (Hq, 4) and dtypes["grad_fixed"] == "int64"
    assert workspace_shapes(cfg, B, Hq, Sq, ((3, 5), (2,)))["grad_fixed"] == (17, 4)
    # The default config's workspace is unchanged: three fp32 arrays.
    plain = dataclasses.replace(cfg, deterministic=False)
    assert list(workspace_shapes(plain, B, Hq, Sq)) == ["lse_log2", "delta", "dq_accum"]
    assert set(workspace_dtypes(plain).values()) == {"float32"}

    q, o, do, dq = (torch.zeros(B, Hq, Sq, D, dtype=torch.bfloat16) for _ in range(4))
    k, v, dk, dv = (torch.zeros(B, Hkv, Skv, D, dtype=torch.bfloat16) for _ in range(4))
    lse = torch.zeros(B, Hq, Sq)
    ws = tuple(torch.zeros(shapes[n], dtype=getattr(torch, dtypes[n])) for n in shapes)
    bm = create_block_mask(mask, None, None, Sq, Skv)
    q_side = tuple(torch.from_numpy(x.copy()) for x in (
        bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices))
    kv_side = tuple(torch.from_numpy(x.copy()) for x in (
        bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices))
    args = runtime_args(hook, lambda x: torch.from_numpy(np.ascontiguousarray(x)))
    grads = (torch.zeros(Hq),)
    runner = BackwardRunner(cfg)

    def bind(workspace=ws, lists=q_side + kv_side, grad_args=grads):
        return runner.bind(BackwardArrays(q, k, v, o, lse, do, dq, dk, dv), workspace, 0.1, args, grad_args,
                           0, lists)

    with pytest.raises(ValueError, match="kv-side lists"):
        bind(lists=q_side)
    with pytest.raises(ValueError, match="dq_semaphore: want int32"):
        bind(workspace=ws[:3] + (ws[3].float(),) + ws[4:])
    with pytest.raises(ValueError, match="workspace ="):
        bind(workspace=ws[:4])
    with pytest.raises(ValueError, match="grad_fixed"):
        bind(grad_args=(torch.zeros(Hq + 1),))       # accumulators sized for Hq elements
    with pytest.raises(ValueError, match="contiguous"):
        bind(grad_args=(torch.zeros(2, Hq)[:, :2],))   # Hq elements, strided rows
    bind()
    assert runner.num_compiled == 3                   # pre, main, post


def test_buffer_gradients_are_summed_per_diagonal_before_the_atomics(compiled):
    """Reads indexed by q - kv only (relative bias) are summed per diagonal of a thread's
    fragment, then per diagonal of the warpgroup's tile in shared memory, which one
    global reduction (the flush) sends; reads free of q and kv (per-head slopes) cost one
    per warp (a shuffle tree); a read that depends on q and kv otherwise keeps one per
    element (one ex2 per element)."""
    cases = {"relative": ("d128-relative-bias", (True, False)), "slopes": ("d128-alibi-slopes", (True, True)),
             "2-d table": ("d128-table-2d", (False, False))}
    counts = {}
    for name, (config, flags) in cases.items():
        hook = _config(config)[1]
        assert (hook.grad_reads_diagonal, hook.grad_reads_uniform) == flags, name
        ptx = compiled[config][1]
        counts[name] = (ptx.count("ex2.approx"), ptx.count("red.global.add.f32"),
                        ptx.count("st.shared.f32"), ptx.count("shfl.sync.bfly"))
        usage = resource_usage_from_ptx(ptx)
        assert usage is None or usage.spill_store_bytes == 0
    elements = counts["2-d table"][0]
    assert counts["2-d table"][1] == elements
    # 32 elements per thread and step lie on 18 diagonals (2 rows x 16 columns): 18
    # shared stores (the kernel's start zeroes the same entries with a plain store), one
    # global reduction in the flush.
    assert counts["relative"][0] == elements
    assert counts["relative"][1] == 1 and counts["relative"][2] == 18
    assert counts["slopes"][1] == 1 and counts["slopes"][2] == 0
    assert counts["slopes"][3] == counts["2-d table"][3] + 5     # the warp's butterfly
    assert counts["2-d table"][2] == 0


def test_additive_mods_with_fixed_captures_skip_the_masked_element_guard(compiled):
    """ALiBi with slopes that need no gradient (the door's causal+alibi): ds'/ds is the
    constant 1, so dS' needs no per-element derivative and no `P == 0` select, and the
    KV_LEN test runs only in the CTA whose keys straddle it (two copies of the pointwise
    pass, as without a score mod). softcap's derivative is not constant: one guarded copy."""
    alibi = IRModHook(mods.alibi(np.ones(4, np.float32)), None)
    assert alibi.constant_score_grad == 1.0
    assert IRModHook(mods.softcap(30.0), None).constant_score_grad is None
    ptx = {"fixed": compiled["d128-causal-alibi-fixed"][1], "trained": compiled["d128-causal-alibi"][1]}
    for name in ptx:
        usage = resource_usage_from_ptx(ptx[name])
        assert usage is None or usage.spill_store_bytes == 0, name
    ex2 = {name: p.count("ex2.approx") for name, p in ptx.items()}
    assert ex2["fixed"] >= 1.9 * ex2["trained"]      # edge / interior copies (x diagonal / below)
    # the guard: one `P == 0` test per element, in the trained kernel only
    guard = re.compile(r"setp\.(eq|neu)\.f32\s+%p\d+, %\w+, 0f00000000")
    assert len(guard.findall(ptx["trained"])) >= ex2["trained"]
    assert len(guard.findall(ptx["fixed"])) < ex2["fixed"] // 4


def test_fixed_point_digits_model():
    """A host model of atomics._FIXED_ADD / _FIXED_READ (same steps): sums of random
    fp32 values in any order give the same counters, and the read-back is the exact sum
    of the values rounded toward zero to multiples of 2^-64, rounded to fp32."""
    from fractions import Fraction

    def digits(x: np.float32):
        a = min(abs(float(x)), float(np.float32(2.0 ** 63 - 2.0 ** 39)))
        fl = np.floor(np.float32(a))
        fr = np.float32((np.float32(a) - fl) * np.float32(2.0 ** 64))   # exact in fp32
        hi, lo = int(fl), int(fr)
        d = [lo & 0xFFFFFFFF, lo >> 32, hi & 0xFFFFFFFF, hi >> 32]
        assert sum(1 for v in d if v) <= 2                        # at most two reductions
        return [-v if x < 0 else v for v in d]

    def wrap(v):                                                  # int64 two's complement
        return (v + 2 ** 63) % 2 ** 64 - 2 ** 63

    def read(S):
        mask = 2 ** 64 - 1
        lo = (S[0] & mask) + ((S[1] << 32) & mask)
        hi = (S[0] >> 63) + (S[1] >> 32) + (lo >> 64) + S[2] + (S[3] << 32)
        hi, lo = wrap(hi), lo & mask
        return np.float32(np.float64(hi) + np.float64(lo) * 2.0 ** -64)

    rng = np.random.default_rng(0)
    values = (rng.standard_normal(2000) * np.exp2(rng.integers(-40, 30, 2000))).astype(np.float32)
    # each value's magnitude truncated to a multiple of 2^-64, summed exactly
    exact = sum((1 if v > 0 else -1) * Fraction(int(Fraction(abs(float(v))) * 2 ** 64), 2 ** 64)
                for v in values)
    counters = []
    for order in (values, values[::-1], rng.permutation(values)):
        S = [0, 0, 0, 0]
        for v in order:
            S = [wrap(s + d) for s, d in zip(S, digits(v))]
        counters.append(S)
    assert counters[0] == counters[1] == counters[2]
    assert read(counters[0]) == np.float32(float(exact))


@pytest.mark.parametrize("head_dim", [32, 96])
def test_pre_and_postprocess_at_other_head_dims(head_dim):
    """The preprocess shares a row among a power of two of threads (their butterfly sum),
    each owning whole 16-byte runs; the postprocess stages dQ in head-dim slices whose
    swizzle atom divides them (bwd.sm90.dq_slice_atom)."""
    from flexattn.kernels.bwd.preprocess import RowChunkKernel

    geometry = RowChunkKernel(BwdConfig(head_dim=head_dim))
    tpr = geometry.threads_per_row
    assert tpr & (tpr - 1) == 0 and geometry.chunk * tpr == head_dim and geometry.chunk % 8 == 0
    assert compile_preprocess("bf16", head_dim, with_dlse=True) is not None
    assert compile_postprocess("bf16", head_dim) is not None


def test_alibi_backward_converts_positions_once_per_row(compiled):
    """The backward passes q (its fragment columns) as a base plus offsets, clamped to
    Q_LEN - 1 as the hooks see it: float(kv - q) is one conversion per row and bound, a
    float add and a min / max per element (emit/affine_index.py); 128 conversions per
    tile and thread before (two copies of the pointwise pass)."""
    ptx = compiled["d128-causal-alibi8-fixed"][1]
    assert 0 < ptx.count("cvt.rn.f32.s32") <= 32, ptx.count("cvt.rn.f32.s32")
    assert "max.f32" in ptx   # the clamp of q, on the converted value


@pytest.mark.parametrize("persistent,on_data", [(False, False), (True, False), (False, True)])
def test_dq_first_store(compiled, persistent, on_data, monkeypatch):
    """dq_first_store: the dQ writer draws a ticket per visit (an acquiring atomic: a ticket
    that saw the first store published skips the spin), stores the tile on the first (a bulk
    copy, beside the bulk adds of the others), publishes it with a release and otherwise
    waits for it with acquiring reads; the preprocess then zeroes dq_accum only where
    LSE is -inf (a branch around the zero stores). Planned unless FLEXATTN_DQ_FIRST_STORE=0,
    never deterministic or fp32; the flags workspace comes with it."""
    from flexattn.kernels.bwd.plan import workspace_shapes

    base = "d128-sparse-document-persist" if persistent else "d128-causal"
    name = base + "-firststore" + ("-data" if on_data else "")
    cfg, ptx = compiled[name]
    assert (cfg.dq_first_store, cfg.dq_ticket_on_data) == (True, on_data)
    plain_cfg, plain = compiled[base]
    store = "cp.async.bulk.global.shared::cta.bulk_group"
    assert ptx.count(store) >= 1 and plain.count(store) == 0
    assert "atom.acquire.gpu.global.add.s32" in ptx and "red.release.gpu.global.add.s32" in ptx
    assert "atom.relaxed" not in ptx
    assert "ld.acquire.gpu.global.b32" in ptx
    assert ptx.count("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32") >= 1
    assert "dq_semaphore" in workspace_shapes(cfg, 2, 4, 300) and "dq_semaphore" not in workspace_shapes(
        plain_cfg, 2, 4, 300)


def test_dq_first_store_preprocess_and_plan(monkeypatch):
    """With dq_first_store the preprocess zeroes only the rows no CTA visits; the planner
    plans it for the unordered adds unless FLEXATTN_DQ_FIRST_STORE=0, never for the
    deterministic backward."""
    from flexattn.kernels.bwd.plan import config_from_forward
    from flexattn.kernels.fwd.sm90 import FwdConfig

    pre = compile_preprocess("bf16", 128, dq_first_store=True, keep_ptx=True).__ptx__
    zeroing = compile_preprocess("bf16", 128, keep_ptx=True).__ptx__
    assert pre.count("st.global") < zeroing.count("st.global") + 2   # (the flag word's store)
    with pytest.raises(ValueError, match="dq_first_store"):
        BwdConfig(dq_first_store=True, deterministic=True, head_dim=128, causal=True)
    fwd = FwdConfig(head_dim=128, causal=True)
    monkeypatch.setenv("FLEXATTN_DQ_FIRST_STORE", "0")
    assert not config_from_forward(fwd).dq_first_store
    monkeypatch.delenv("FLEXATTN_DQ_FIRST_STORE", raising=False)
    assert config_from_forward(fwd).dq_first_store and not config_from_forward(fwd).dq_ticket_on_data
    assert not config_from_forward(fwd, dq_finish=True).dq_first_store
    assert not config_from_forward(fwd, deterministic=True).dq_first_store
    monkeypatch.setenv("FLEXATTN_DQ_FIRST_STORE", "data")
    assert config_from_forward(fwd).dq_ticket_on_data
    with pytest.raises(ValueError, match="dq_ticket_on_data"):
        BwdConfig(dq_ticket_on_data=True, head_dim=128, causal=True)
