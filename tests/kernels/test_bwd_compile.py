"""CPU (CI): the sm90 backward (preprocess, main kernel, postprocess) compiles for sm_90a
in its main structures, the PTX uses the Hopper paths (wgmma, TMA, setmaxnreg, stmatrix)
and fp32 reductions (red.global.add), nothing spills, and mod values stay runtime args.
The runner validates and compiles on CPU tensors too (launching needs the GPU)."""

import numpy as np
import pytest

pytest.importorskip("cutlass")

from flexattn import mods  # noqa: E402
from flexattn.kernels import example_hooks as hooks  # noqa: E402
from flexattn.kernels.bwd_compile import (  # noqa: E402
    compile_backward, compile_postprocess, compile_preprocess)
from flexattn.kernels.bwd_sm90 import BwdConfig  # noqa: E402
from flexattn.kernels.compile import resource_usage_from_ptx  # noqa: E402
from flexattn.kernels.mod_emit import IRModHook, capture_kinds, fake_args  # noqa: E402


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
    if name == "d128-relative-bias":       # trainable table: buffer gradients
        hook = IRModHook(mods.relative_bias(np.zeros((4, 15), np.float32)), None)
        return BwdConfig(head_dim=128, mods=hook), hook
    raise KeyError(name)


NAMES = ["d128-dense", "d128-causal-softcap", "d64-sparse-document", "d128-relative-bias"]


@pytest.fixture(scope="module")
def compiled():
    """Compile each config once (3-6 s each) and keep its PTX."""
    out = {}
    for name in NAMES:
        cfg, hook = _config(name)
        out[name] = (cfg, compile_backward(cfg, fake_args(hook), keep_ptx=True).__ptx__)
    return out


def _steps(ptx: str, cfg: BwdConfig) -> float:
    """Instances of the per-q-block step: S^T, dP^T (D/16 each), dV, dK (tile_m/16 each),
    dQ (tile_n/16)."""
    per_step = 2 * cfg.head_dim // 16 + 2 * cfg.tile_m // 16 + cfg.tile_n // 16
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
    assert "red.global.add.v2.f32" in ptx            # dQ accumulation


@pytest.mark.parametrize("name", NAMES)
def test_no_spills(compiled, name):
    _, ptx = compiled[name]
    usage = resource_usage_from_ptx(ptx)
    if usage is None:
        pytest.skip("no ptxas on PATH")
    assert usage.spill_store_bytes == 0 and usage.spill_load_bytes == 0, usage
    assert usage.stack_bytes == 0, usage


def test_block_structures(compiled):
    # Dense without a mask: one step instance; causal: diagonal + interior steps;
    # block-sparse: partial + full lists.
    for name, steps in (("d128-dense", 1), ("d128-causal-softcap", 2), ("d64-sparse-document", 2)):
        cfg, ptx = compiled[name]
        assert _steps(ptx, cfg) == steps, name


def test_buffer_gradients(compiled):
    cfg, ptx = compiled["d128-relative-bias"]
    # The float table's slot (the clamp distance is a captured int scalar, no grad).
    kinds = capture_kinds(cfg.mods)
    assert cfg.buffer_grads and cfg.mods.grad_slots == tuple(
        i for i, k in enumerate(kinds) if k[0] == "buffer" and k[1].startswith("float"))
    assert "red.global.add.f32" in ptx               # table gradient scatter
    for name in ("d128-dense", "d128-causal-softcap", "d64-sparse-document"):
        assert "red.global.add.f32 " not in compiled[name][1].replace("v2.f32", "")


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


def test_config_validation():
    assert BwdConfig().q_pad == 128
    assert BwdConfig().key() == BwdConfig().key()
    assert BwdConfig().key() != BwdConfig(causal=True).key()
    with pytest.raises(ValueError):
        BwdConfig(tile_m=128)
    with pytest.raises(ValueError):
        BwdConfig(causal=True, block_sparse=True)
    with pytest.raises(ValueError):
        BwdConfig(head_dim=96)
    with pytest.raises(ValueError, match="derivative"):
        BwdConfig(mods=hooks.SoftcapHook())           # hand-written: no derivative
    BwdConfig(mods=hooks.CausalHook())                # masks need none
    assert IRModHook(mods.alibi(num_heads=4)).grad_slots == (0,)
    assert IRModHook(mods.softcap(5.0)).grad_slots == ()


def test_runner_validates_and_compiles_on_cpu_tensors():
    torch = pytest.importorskip("torch")
    from flexattn.kernels.bwd_runner import BackwardRunner, workspace_shapes

    hook = IRModHook(None, mods.causal())
    cfg = BwdConfig(head_dim=64, mods=hook)
    B, Hq, Hkv, Sq, Skv, D = 1, 4, 2, 200, 150, 64
    q, o, do, dq = (torch.zeros(B, Hq, Sq, D, dtype=torch.bfloat16) for _ in range(4))
    k, v, dk, dv = (torch.zeros(B, Hkv, Skv, D, dtype=torch.bfloat16) for _ in range(4))
    lse = torch.zeros(B, Hq, Sq)
    ws = tuple(torch.zeros(s) for s in workspace_shapes(cfg, B, Hq, Sq).values())
    runner = BackwardRunner(cfg)
    with pytest.raises(ValueError, match="workspace"):
        runner.bind(q, k, v, o, do, lse, dq, dk, dv, ws[:2] + (torch.zeros(1),), 0.1, (),
                    None, 0)
    with pytest.raises(TypeError):
        runner.bind(q, k, v, o, do, lse, dq.float(), dk, dv, ws, 0.1, (), None, 0)
    runner.bind(q, k, v, o, do, lse, dq, dk, dv, ws, 0.1, (), None, 0)
    assert runner.num_compiled == 3                   # pre, main, post
