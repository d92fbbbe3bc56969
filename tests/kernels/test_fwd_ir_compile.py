"""CPU (CI): the forward kernel with IR-emitted mods compiles for sm_90a, uses wgmma and
TMA, and ptxas reports no local-memory spills."""

import numpy as np
import pytest

pytest.importorskip("cutlass")

from flexattn import mods  # noqa: E402
from flexattn.kernels.launch.compile import compile_forward, resource_usage_from_ptx  # noqa: E402
from flexattn.kernels.fwd.sm90 import FwdConfig  # noqa: E402
from flexattn.kernels.emit.mod_emit import IRModHook, fake_args  # noqa: E402

CONFIGS = {
    "d128-causal": (128, dict(causal=True), None, None),
    "d64-causal": (64, dict(causal=True, tile_m=128), None, None),
    "d128-document+softcap": (128, dict(block_sparse=True), mods.softcap(30.0), mods.document(np.zeros(8, np.int32))),
    "d64-document+softcap": (64, dict(block_sparse=True), mods.softcap(30.0), mods.document(np.zeros(8, np.int32))),
    "d128-causal+alibi": (128, dict(causal=True), mods.alibi(num_heads=8), None),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_ir_forward_compiles_without_spills(name):
    head_dim, kw, score, mask = CONFIGS[name]
    hook = IRModHook(score, mask)
    cfg = FwdConfig(head_dim=head_dim, mods=hook, **kw)
    compiled = compile_forward(cfg, fake_args(hook), keep_ptx=True)
    ptx = compiled.__ptx__
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    usage = resource_usage_from_ptx(ptx)
    if usage is None:
        pytest.skip("no ptxas on PATH to report resource usage")
    assert usage.spill_store_bytes == 0 and usage.spill_load_bytes == 0 and usage.stack_bytes == 0, usage
    assert usage.wgmma_serialized is None, usage


def test_alibi_converts_positions_once_per_row():
    """ALiBi's float(kv - q): the forward passes kv as a base plus compile-time offsets
    (emit/affine_index.py), so the PTX converts one integer per fragment row, not one per
    element (64 conversions per tile and thread before; I2F shares the XU pipe with exp2)."""
    hook = IRModHook(mods.alibi(num_heads=8))
    ptx = compile_forward(FwdConfig(head_dim=128, causal=True, mods=hook), fake_args(hook), keep_ptx=True).__ptx__
    assert 0 < ptx.count("cvt.rn.f32.s32") <= 8, ptx.count("cvt.rn.f32.s32")


def test_scaled_indices_fold_alibis_slope_into_one_fma_per_element():
    """``IRModHook(scaled_indices=True)`` (planned; FLEXATTN_SCALED_INDICES=0 turns it off): ALiBi's
    ``slope[h] * float(kv - q)`` as ``offset * slope + base * slope`` (affine_index.FloatAffine),
    one FFMA with an immediate per element where the plain form has a FADD and a FMUL: at
    128 x 128 (64 scores per thread and tile) ~62 more fma, 62 fewer mul and add, no spill;
    the hook's key tells the two apart, and a mod without such a product compiles the same."""
    counts, keys = {}, set()
    for scaled in (False, True):
        hook = IRModHook(mods.alibi(num_heads=8), None, True, scaled)
        keys.add(hook.key())
        ptx = compile_forward(FwdConfig(head_dim=128, causal=True, mods=hook), fake_args(hook), keep_ptx=True).__ptx__
        counts[scaled] = {op: ptx.count(op) for op in ("fma.rn.f32", "mul.f32", "add.f32")}
        usage = resource_usage_from_ptx(ptx)
        if scaled and usage is not None:
            assert usage.spill_store_bytes == 0 and usage.spill_load_bytes == 0 and usage.stack_bytes == 0, usage
    assert len(keys) == 2
    assert counts[True]["fma.rn.f32"] - counts[False]["fma.rn.f32"] >= 56, counts
    assert counts[False]["mul.f32"] - counts[True]["mul.f32"] >= 56, counts
    assert counts[False]["add.f32"] - counts[True]["add.f32"] >= 56, counts
    # A constant multiplier folds into the offsets (a FADD per element, no FMUL); a float
    # index not multiplied compiles to the same PTX either way.
    def ptx_of(score, scaled):
        hook = IRModHook(score, None, True, scaled)
        return compile_forward(FwdConfig(head_dim=128, causal=True, mods=hook), fake_args(hook), keep_ptx=True).__ptx__

    constant = mods.score_mod(lambda s, b, h, q, kv: s + (kv - q) * 0.01)
    assert ptx_of(constant, False).count("mul.f32") - ptx_of(constant, True).count("mul.f32") >= 56
    plain = mods.score_mod(lambda s, b, h, q, kv: s - (kv - q))
    assert ptx_of(plain, False) == ptx_of(plain, True)


def _paged_mods():
    """A converted PagedAttention mask (the page map read at kv // 128) and a score
    reading a per-page bias: both constant over a 128-key tile."""
    page_map, lengths, bias = np.zeros((2, 64), np.int64), np.zeros(2, np.int64), np.zeros((2, 64), np.float32)

    def physical(b, h, q_idx, kv_idx):
        logical = page_map[b, kv_idx // 128] * 128 + kv_idx % 128
        return (page_map[b, kv_idx // 128] >= 0) & (logical <= q_idx + lengths[b])

    return mods.score_mod(lambda s, b, h, q_idx, kv_idx: s + bias[b, kv_idx // 128]), mods.mask_mod(physical)


def test_forward_hoists_tile_constant_reads():
    """``FwdConfig.hoist_tile_reads``: the page map and the per-page bias are read once per
    tile and row instead of once per element (the mask per element, the score by rows),
    without spills (when written: 108 -> 15 scalar loads, and the unhoisted kernel spilled
    36 bytes)."""
    import re

    score, mask = _paged_mods()
    hook = IRModHook(score, mask)
    assert hook.tile_invariant_count(128) == 3 and hook.tile_invariant_count(256) == 0
    reads = {}
    for hoist in (False, True):
        cfg = FwdConfig(head_dim=128, block_sparse=True, hoist_tile_reads=hoist, mods=hook)
        ptx = compile_forward(cfg, fake_args(hook), keep_ptx=True).__ptx__
        reads[hoist] = len(re.findall(r"\bld\.global(?:\.nc)?\.(?:b32|b64|s64|u64|f32|u32|s32)\b", ptx))
        usage = resource_usage_from_ptx(ptx)
        if hoist and usage is not None:
            assert usage.spill_store_bytes == 0 and usage.spill_load_bytes == 0, usage
    assert 4 * reads[True] < reads[False], reads
