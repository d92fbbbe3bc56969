"""The float32 backward (issue 25, kernels/bwd/tf32_sync.py) on the CPU: which head dims it
takes, that its shared-memory layouts make the fragment loads bank-conflict-free, and its
kernels compiled for sm_90a from the planner's configs (warp-level tf32 MMAs, vector fp32
reductions, registers). tests/gpu/test_bwd_gpu.py::test_float32 runs them."""

import os
import re

import numpy as np
import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
pytest.importorskip("cutlass")

from flexattn import mods  # noqa: E402
from flexattn.core import AttentionSpec, check_inputs  # noqa: E402
from flexattn.core.kernel_path import backward_unsupported, plan_forward  # noqa: E402
from flexattn.kernels.bwd.plan import config_from_forward, workspace_shapes  # noqa: E402
from flexattn.kernels.bwd.sm90 import BwdConfig  # noqa: E402
from flexattn.kernels.bwd.tf32_sync import PAD, shared_bytes, warp_layouts  # noqa: E402
from flexattn.kernels.emit.mod_emit import IRModHook, fake_args  # noqa: E402
from flexattn.kernels.hopper.mma import SMEM_CAPACITY  # noqa: E402
from flexattn.kernels.launch.compile import (compile_backward, compile_postprocess, compile_preprocess,  # noqa: E402
                                             resource_usage_from_ptx)
from compile_pool import compile_all, prefetch  # noqa: E402


def _planned(d, dv=None, passes=3, score=None, mask=None, S=300):
    q = np.zeros((1, 2, S, d), np.float32)
    v = np.zeros((1, 2, S, dv or d), np.float32)
    spec = AttentionSpec.from_args(score=score, mask=mask)
    shape = check_inputs(q, q, v, spec)
    assert backward_unsupported(shape, q) is None
    return config_from_forward(plan_forward(q, shape, spec, tf32_passes=passes).config)


@pytest.mark.parametrize("d", range(32, 257, 16))
def test_every_head_dim_that_fits_is_taken(d):
    """Multiples of 32 run 32-row visits at every head dim; the others 64-row ones (dQ's
    warps) where those fit: up to 176. 208 and 240 are refused before any launch, by name."""
    q = np.zeros((1, 1, 64, d), np.float32)
    shape = check_inputs(q, q, q, AttentionSpec.from_args())
    reason = backward_unsupported(shape, q)
    if d in (208, 240):
        assert reason is not None and "does not fit shared memory" in reason
        return
    assert reason is None
    cfg = _planned(d)
    assert cfg.tile_m == (32 if d % 32 == 0 else 64) and cfg.tile_n == 64
    assert shared_bytes(cfg) <= SMEM_CAPACITY
    assert cfg.num_stages == (2 if shared_bytes(cfg, 2) <= SMEM_CAPACITY else 1)
    # the workspace is the bf16 kernel's, rows padded to whole BlockMask blocks
    assert workspace_shapes(cfg, 1, 1, 64)["dq_accum"] == (1, 1, 128, d)


def test_deterministic_and_mixed_configs_are_refused():
    with pytest.raises(ValueError, match="no deterministic mode"):
        BwdConfig(dtype="fp32", head_dim=128, tile_m=32, deterministic=True)
    with pytest.raises(ValueError, match="tile_m=64"):
        BwdConfig(dtype="fp32", head_dim=80, tile_m=32)
    with pytest.raises(ValueError, match="tf32_passes"):
        BwdConfig(dtype="bf16", head_dim=128, tf32_passes=3)


def _banks(addresses):
    return len({a % 32 for a in addresses})


@pytest.mark.parametrize("d", [32, 64, 80, 96, 128, 192, 256])
def test_padded_rows_make_fragment_loads_conflict_free(d):
    """A warp's m16n8k8 fragment load reads 8 rows (g = lane / 4) x 4 columns (t = lane % 4)
    of a row-major tile, or, transposed with the K permutation (`_k_permuted`: k = t at row
    2 t), rows 2 t x columns g: 32 distinct banks either way with rows PAD floats longer."""
    row = d + PAD
    lanes = [(lane // 4, lane % 4) for lane in range(32)]
    assert _banks(g * row + t for g, t in lanes) == 32                 # K, V, Q, dO as read
    assert _banks(2 * t * row + g for g, t in lanes) == 32             # dO, Q, K transposed
    assert _banks(t * row + g for g, t in lanes) < 32                  # (unpermuted: conflicts)
    for tm in (32, 64):                                                # dS^T read for dQ
        assert _banks(2 * t * (tm + PAD) + g for g, t in lanes) == 32


# (head dims, passes, mods, structure): the planner's configs
CASES = [
    ((128, 128), 1, None, None),
    ((128, 128), 3, "softcap", "causal"),
    ((80, 80), 3, None, None),
    ((256, 256), 1, "alibi", "window"),
    ((192, 128), 3, None, None),               # value head dim apart
]


# head dims whose N tiles the dK / dV pieces must divide otherwise (224: 7 tiles of 32
# columns, 176: 11 of 16): test_3xtf32_promotes_every_chain_at_wide_head_dims
ODD_WIDE = [((224, 224), 3, None, None), ((176, 176), 3, None, None)]


def _case_config(case):
    (d, dv), passes, score, mask = case
    score_mod = {"softcap": mods.softcap(20.0), "alibi": mods.alibi(num_heads=2), None: None}[score]
    mask_mod = {"causal": mods.causal(), "window": mods.sliding_window(100), None: None}[mask]
    return _planned(d, dv, passes, score_mod, mask_mod)


def _case_ptx(i):
    """(PTX, ptxas's resource usage or None) of case i of CASES + ODD_WIDE."""
    cfg = _case_config((CASES + ODD_WIDE)[i])
    hook = cfg.mods
    ptx = compile_backward(cfg, fake_args(hook) if isinstance(hook, IRModHook) else (), keep_ptx=True).__ptx__
    return ptx, resource_usage_from_ptx(ptx)


prefetch(_case_ptx, range(len(CASES + ODD_WIDE)))   # the fixture's jobs, started ahead (compile_pool.py)


@pytest.fixture(scope="module")
def compiled():
    """(PTX, resource usage) of each case of CASES + ODD_WIDE, by index (compiled and
    assembled in parallel processes, 12-36 s each)."""
    return compile_all(_case_ptx)


@pytest.mark.parametrize("case", range(len(CASES)), ids=lambda i: str(CASES[i]))
def test_fp32_backward_kernels_compile(compiled, case):
    (d, dv), passes, score, mask = CASES[case]
    cfg = _case_config(CASES[case])
    assert (cfg.dtype, cfg.tf32_passes) == ("fp32", passes)
    ptx, usage = compiled[case]
    mma = re.findall(r"mma\.sync\.aligned\.(m16n8k8\.row\.col\.f32\.tf32\.tf32\.f32)", ptx)
    # Per visit, per warp: S^T and dP^T (16 keys x tile_m / 2 q), dV and dK, the dQ tile;
    # each k-block once per pass.
    (nm_m, nm_n), (nd_m, nd_n), (md_m, md_n) = warp_layouts(cfg)
    tm, tn = cfg.tile_m, cfg.tile_n
    per_visit = ((tn // (16 * nm_m)) * (tm // (8 * nm_n)) * ((d + dv) // 8)     # S^T over D, dP^T over Dv
                 + (tn // (16 * nd_m)) * ((d + dv) // (8 * nd_n)) * (tm // 8)
                 + (tm // (16 * md_m)) * (d // (8 * md_n)) * (tn // 8))
    copies = 2 if mask else 1          # masked visits and full ones: two instantiations
    assert len(mma) == per_visit * passes * copies, (len(mma), per_visit)
    assert "red.global.add.v2.f32" in ptx and "cvt.rna.tf32.f32" in ptx
    if score == "softcap" and passes == 3:
        assert "tanh.approx" not in ptx            # 3xTF32 keeps the mods exact
    if usage is None:
        pytest.skip("no ptxas on PATH")
    if mask != "causal" and (passes == 1 or max(d, dv) <= 128):
        assert usage.spill_store_bytes == 0 and usage.stack_bytes == 0, usage
    else:   # the two step instantiations, or 3xTF32's promoted chains beyond head dim 128
        assert usage.spill_store_bytes <= 64, usage   # (a few bytes: docs/KERNELS.md)


def test_3xtf32_promotes_every_chain_at_wide_head_dims(compiled):
    """3xTF32 sums dK / dV per visit in column pieces beyond head dim 128 (a fresh
    accumulator of their whole size spilled 124-884 bytes there, and without one they
    were 4-16x torch flex's error), and S^T / dP^T over the head dim in pieces of 1
    k-block on 32-row visits of head dims 64-128 with Dv <= D, of 2 elsewhere; one tf32 pass
    promotes nothing."""
    for d, dv, pieces, chain in [(128, 128, 1, 1), (64, 64, 1, 1), (96, 96, 1, 1), (192, 128, 2, 2),
                                 (192, 192, 2, 2), (256, 256, 8, 2), (128, 256, 8, 2), (64, 128, 1, 2),
                                 (32, 32, 1, 2), (80, 80, 1, 2)]:
        cfg = _planned(d, dv)
        assert (cfg.dkv_pieces, cfg.chain_promote) == (pieces, chain), (d, dv)
    # head dims whose N tiles the pieces must divide otherwise (ODD_WIDE) compile with a few
    # words of spills
    for i, case in enumerate(ODD_WIDE, start=len(CASES)):
        usage = compiled[i][1]
        if usage is not None:
            assert usage.spill_store_bytes <= 128 and usage.wgmma_serialized is None, (case, usage)
    one = _planned(256, passes=1)
    assert (one.dkv_pieces, one.chain_promote) == (0, 0)
    with pytest.raises(ValueError, match="dkv_pieces"):
        BwdConfig(dtype="fp32", head_dim=128, tile_m=32, dkv_pieces=2)     # one tf32 pass


@pytest.mark.parametrize("d,tile_m", [(128, 32), (80, 64)])
def test_fp32_pre_and_postprocess_compile(d, tile_m):
    pre = compile_preprocess("fp32", d, True, tile_m=tile_m, keep_ptx=True).__ptx__
    post = compile_postprocess("fp32", d, tile_m=tile_m, keep_ptx=True).__ptx__
    assert re.search(r"ld\.global(\.nc)?\.v4\.(f32|b32)", pre), "the preprocess reads O and dO 16 bytes at a time"
    assert re.search(r"st\.global\.v4\.(f32|b32)", post), "the postprocess stores 16 bytes at a time"
