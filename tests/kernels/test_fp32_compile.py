"""float32 inputs (issue 25): the forward's tf32 kernels and their operand pass, compiled for
sm_90a on the CPU; the planner's tiles. (tests/gpu/test_fp32_gpu.py runs them.)"""

import os
import re
from types import SimpleNamespace

import numpy as np
import pytest

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
pytest.importorskip("cutlass")

from flexattn import mods  # noqa: E402
from flexattn.core import AttentionSpec, check_inputs  # noqa: E402
from flexattn.core.kernel_path import _fp32_tiles, kernel_unsupported, plan_forward  # noqa: E402
from flexattn.kernels.emit.mod_emit import IRModHook, fake_args  # noqa: E402
from flexattn.kernels.fwd.fp32_operands import OperandsConfig, key_order  # noqa: E402
from flexattn.kernels.fwd.sm90 import FwdConfig, shared_bytes  # noqa: E402
from flexattn.kernels.hopper.mma import SMEM_CAPACITY  # noqa: E402
from flexattn.kernels.launch.compile import compile_forward, compile_fp32_operands, resource_usage_from_ptx  # noqa: E402
from compile_pool import compile_all, prefetch  # noqa: E402


def _dims(d, dv=None):
    return SimpleNamespace(head_dim=d, v_head_dim=dv or d)


def test_key_order_matches_the_accumulator_to_operand_view():
    """Thread c's accumulator holds columns 2c, 2c+1 of each 8; as a tf32 A operand those
    registers are columns c and c + 4 (mma.acc_as_tf32_a_view): V^T's position c + 4j must
    hold key 2c + j."""
    for c in range(4):
        for j in range(2):
            assert key_order(c + 4 * j) == 2 * c + j
    assert sorted(key_order(p) for p in range(64)) == list(range(64))


@pytest.mark.parametrize("d,dv", [(32, 32), (64, 64), (80, 80), (128, 128), (192, 128), (256, 256)])
@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("lists", [False, True])
def test_planned_tiles_fit(d, dv, parts, lists):
    tile_m, tile_n, stages = _fp32_tiles(_dims(d, dv), parts, lists)
    assert tile_n % 8 == 0 and (not lists or 128 % tile_n == 0)
    assert shared_bytes(tile_m, tile_n, stages, d, dv, dv > d, elem_bytes=4, parts=parts) <= SMEM_CAPACITY
    if d <= 128 and dv <= 128:
        assert tile_m == 128                     # two consumer warpgroups taking turns


# (head dims, passes, structure): the planner's tiles, compiled; no spills where the value
# head dim is at most 128 (beyond it, test_3xtf32_wide_value_dims_promote_pv_in_column_pieces).
CASES = [((64, 64), 1, "dense"), ((128, 128), 1, "causal"), ((80, 80), 3, "dense"), ((128, 128), 3, "causal"),
         ((192, 128), 3, "dense"), ((128, 128), 3, "sparse_softcap")]
ERROR_FIX_DIMS = [(128, 128), (64, 64), (80, 80), (32, 32)]
WIDE_VALUE_DIMS = [(192, 192), (256, 256), (144, 144)]   # (144: two warpgroups)
OPERAND_CONFIGS = [OperandsConfig(128, True, 1), OperandsConfig(80, True, 2), OperandsConfig(64, False, 2)]


def _case_config(dims, passes, kind):
    d, dv = dims
    lists = kind.startswith("sparse")
    tile_m, tile_n, stages = _fp32_tiles(_dims(d, dv), 2 if passes == 3 else 1, lists)
    hook = IRModHook(mods.softcap(20.0) if "softcap" in kind else None, None, passes != 3)
    return FwdConfig(dtype="fp32", tf32_passes=passes, head_dim=d, head_dim_v=dv, tile_m=tile_m, tile_n=tile_n,
                     num_stages=stages, causal=kind == "causal", block_sparse=lists, mods=hook,
                     pingpong=tile_m > 64, sparse_block_m=128 if lists else None)


def _three_pass_base(dims):
    """FwdConfig arguments of a causal 3xTF32 forward at the planner's tiles."""
    d, dv = dims
    tile_m, tile_n, stages = _fp32_tiles(_dims(d, dv), 2, False)
    return dict(dtype="fp32", tf32_passes=3, head_dim=d, head_dim_v=dv, tile_m=tile_m, tile_n=tile_n,
                num_stages=stages, causal=True, mods=IRModHook(None, None, False), pingpong=tile_m > 64)


def _job_config(job):
    """The kernel config of one compile job: (module part, index[, variant])."""
    part, i = job[0], job[1]
    if part == "case":
        return _case_config(*CASES[i])
    if part == "fix":
        base = _three_pass_base(ERROR_FIX_DIMS[i])
        return FwdConfig(**base) if job[2] == "planned" else FwdConfig(**base, s_promote=0, exact_normalize=False)
    if part == "wide":
        return FwdConfig(**_three_pass_base(WIDE_VALUE_DIMS[i]))
    return OPERAND_CONFIGS[i]


def _compile_job(job):
    """(PTX, resource usage or None without ptxas) of one job: run in the compile pool."""
    cfg = _job_config(job)
    if job[0] == "operands":
        ptx = compile_fp32_operands(cfg, keep_ptx=True).__ptx__
    else:
        ptx = compile_forward(cfg, fake_args(cfg.mods), keep_ptx=True).__ptx__
    return ptx, resource_usage_from_ptx(ptx)


JOBS = ([("case", i) for i in range(len(CASES))]
        + [("fix", i, v) for i in range(len(ERROR_FIX_DIMS)) for v in ("planned", "one_chain")]
        + [("wide", i) for i in range(len(WIDE_VALUE_DIMS))]
        + [("operands", i) for i in range(len(OPERAND_CONFIGS))])


prefetch(_compile_job, JOBS)   # the fixture's jobs, started ahead (compile_pool.py)


@pytest.fixture(scope="module")
def compiled():
    """(PTX, usage) of every job, compiled and assembled in parallel processes."""
    return compile_all(_compile_job)


@pytest.mark.parametrize("case", range(len(CASES)), ids=lambda i: str(CASES[i]))
def test_fp32_kernels_compile(compiled, case):
    dims, passes, kind = CASES[case]
    cfg = _case_config(dims, passes, kind)
    ptx, usage = compiled[("case", case)]
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m64n\d+k\d+\.\w+\.\w+\.\w+)", ptx))
    assert shapes and all(s.endswith("f32.tf32.tf32") for s in shapes), shapes
    # P to tf32: rounded (3xTF32: its hi and lo parts) for every block's S fragment.
    assert "cvt.rna.tf32.f32" in ptx
    assert cfg.promote_pv == (passes == 3)
    assert cfg.promote_pv_pieces == (1 if dims[1] <= 128 else 2)
    if "softcap" in kind:
        assert "tanh.approx" not in ptx          # 3xTF32 keeps the mods exact
    if usage is None:
        pytest.skip("no ptxas on PATH")
    assert usage.wgmma_serialized is None, usage
    if kind != "sparse_softcap":
        assert usage.spill_store_bytes == 0 and usage.stack_bytes == 0, usage
    else:   # 3xTF32 with a score mod and 32-key block-sparse tiles: a few bytes
        assert usage.spill_store_bytes <= 128, usage


@pytest.mark.parametrize("index", range(len(ERROR_FIX_DIMS)), ids=lambda i: str(ERROR_FIX_DIMS[i]))
def test_3xtf32_error_fixes_compile(compiled, index):
    """3xTF32's planned accuracy fixes: S = Q K^T over the head dim in pieces of 4 k-blocks
    (2 at head dim 32; FwdConfig.s_promote; a wgmma group per piece at each step body's Q
    K^T issue) and O / l by IEEE division (exact_normalize), without spills at the planned
    tiles."""
    d, dv = ERROR_FIX_DIMS[index]
    base = _three_pass_base((d, dv))
    planned = FwdConfig(**base)
    piece = 4 if d > 32 else 2
    assert (planned.s_promote, planned.exact_normalize) == (piece, True)
    one = compiled[("fix", index, "one_chain")][0]
    ptx, usage = compiled[("fix", index, "planned")]
    assert "div.rn.f32" in ptx and "rcp.approx" not in ptx
    assert "div.rn.f32" not in one and "rcp.approx" in one
    groups = one.count("wgmma.commit_group")
    qk_issues = groups // 2          # (every body issues Q K^T and P V once)
    pieces = -(-d // 8 // piece)
    assert ptx.count("wgmma.commit_group") == groups + qk_issues * (pieces - 1)
    if usage is not None:
        assert usage.spill_store_bytes == 0 and usage.stack_bytes == 0, usage
        assert usage.wgmma_serialized is None, usage
    with pytest.raises(ValueError, match="s_promote"):
        FwdConfig(**{**base, "tf32_passes": 1, "dtype": "fp32"}, s_promote=4)


@pytest.mark.parametrize("index", range(len(WIDE_VALUE_DIMS)), ids=lambda i: str(WIDE_VALUE_DIMS[i]))
def test_3xtf32_wide_value_dims_promote_pv_in_column_pieces(compiled, index):
    """Beyond 128 value columns 3xTF32 still sums each block's P V apart from O
    (``promote_pv``), in two column pieces (``promote_pv_pieces``): one O-sized second
    accumulator spilled there, which had left O's long chain in the tensor cores' adds.
    Each piece is its own wgmma group over half of V^T's rows (m64n<Dv/2>); ptxas neither
    spills more than a few words nor serializes the wgmmas (C7511, which the pieces' adds
    into O element by element caused: 288 waits in the 192/192 SASS against 26)."""
    dv = WIDE_VALUE_DIMS[index][1]
    base = _three_pass_base(WIDE_VALUE_DIMS[index])
    planned = FwdConfig(**base)
    assert (planned.promote_pv, planned.promote_pv_pieces, planned.rescale_o_early) == (True, 2, False)
    ptx, usage = compiled[("wide", index)]
    pv_shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k8\.f32\.tf32\.tf32\s+\{", ptx))
    assert str(dv // 2) in pv_shapes and str(dv) not in pv_shapes, pv_shapes
    if usage is not None:
        assert usage.spill_store_bytes <= 64 and usage.wgmma_serialized is None, usage
    with pytest.raises(ValueError, match="promote_pv_pieces"):
        FwdConfig(**base, promote_pv_pieces=5)          # Dv / 5: not whole column groups
    with pytest.raises(ValueError, match="promote_pv_pieces"):
        FwdConfig(**base, promote_pv=False, promote_pv_pieces=2)


@pytest.mark.parametrize("index", range(len(OPERAND_CONFIGS)), ids=lambda i: str(OPERAND_CONFIGS[i]))
def test_operand_kernels_compile(compiled, index):
    ptx = compiled[("operands", index)][0]
    assert "cvt.rna.tf32.f32" in ptx and ".local" not in ptx
    with pytest.raises(ValueError):
        OperandsConfig(64, False, 1)


def test_planner_takes_float32_with_the_devices_passes():
    q = np.zeros((1, 2, 300, 128), np.float32)
    spec = AttentionSpec.from_args(mask=mods.causal())
    shape = check_inputs(q, q, q, spec)
    assert kernel_unsupported(q, shape) is None
    for passes in (1, 3):
        cfg = plan_forward(q, shape, spec, tf32_passes=passes).config
        assert (cfg.dtype, cfg.tf32_passes, cfg.cluster_m, cfg.max_ctas, cfg.causal) == ("fp32", passes, 1, 0, True)
        assert cfg.mods.fast_math == (passes == 1)
        # 3xTF32's error fixes planned (the chains in pieces, the exact O / l); the float32
        # backward's S^T / dP^T chains in pieces likewise
        from flexattn.kernels.bwd.plan import config_from_forward
        assert (cfg.s_promote, cfg.exact_normalize) == ((4, True) if passes == 3 else (0, False))
        assert config_from_forward(cfg).chain_promote == (1 if passes == 3 else 0)
    assert "float64" in kernel_unsupported(q.astype(np.float64), shape)
