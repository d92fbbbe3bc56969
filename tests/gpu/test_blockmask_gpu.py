"""GPU: block masks built on the GPU equal the CPU builder's, list for list.

Random mask mods (causal, windows, documents, prefix-LM, buffers of every kind, head- and
batch-dependent masks, combinations), odd lengths, B/H > 1, several block sizes; states
and all eight lists compared with ``create_block_mask`` on the host, and ``num_allowed``
with the host's exact count. Updating captured values reuses the compiled kernels;
``varlen_block_mask`` on the GPU equals its host version; the forward consumes a GPU-built
mask directly.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cutlass")

import flexattn.torch as fa  # noqa: E402  (registers torch's CUDA arrays for the builder)
from flexattn import mods  # noqa: E402
from flexattn.blockmask import _LIST_NAMES, create_block_mask, varlen_block_mask  # noqa: E402
from flexattn.kernels.blockmask.classify import compile_count  # noqa: E402


def assert_same(gpu, cpu, what=""):
    assert gpu.device.startswith("cuda"), gpu.device
    assert gpu.shape == cpu.shape and gpu.BLOCK_SIZE == cpu.BLOCK_SIZE
    np.testing.assert_array_equal(gpu.block_states(), cpu.block_states(), err_msg=f"{what}: states")
    for name in _LIST_NAMES:
        g = getattr(gpu, name)
        assert isinstance(g, torch.Tensor) and g.is_cuda and g.dtype == torch.int32, name
        np.testing.assert_array_equal(g.cpu().numpy(), getattr(cpu, name), err_msg=f"{what}: {name}")


def _offsets(rng, S, n):
    cuts = np.sort(rng.integers(0, S + 1, size=n - 1))
    return np.concatenate([[0], cuts, [S]])


def make_mask(name, rng, B, H, Q, KV):
    """A random instance of mask family ``name`` for [B, H, Q, KV]."""
    S = max(Q, KV)
    if name == "causal":
        return mods.causal(int(rng.integers(-50, 50)))
    if name == "window":
        return mods.sliding_window(int(rng.integers(0, 300)), int(rng.integers(0, 40)))
    if name == "causal_window":
        return mods.causal() & mods.sliding_window(int(rng.integers(1, 400)))
    if name == "document":
        ids = np.sort(rng.integers(0, 5, size=(B, S)), axis=1).astype(np.int32)
        return mods.document(ids)
    if name == "document_offsets_causal":
        return mods.document_from_offsets(_offsets(rng, S, int(rng.integers(1, 7)))) & mods.causal()
    if name == "prefix_lm":
        return mods.prefix_lm(int(rng.integers(0, S)))
    if name == "prefix_lm_batch":
        return mods.prefix_lm(rng.integers(0, S, size=B).astype(np.int32))
    if name == "head_dependent":
        k = int(rng.integers(2, 5))
        return mods.mask_mod(lambda b, h, q, kv: ((q // 16 + h) % k != (kv // 32) % 2) | (h == 1))
    if name == "noise_bool":  # a 4-D bool buffer: interval analysis gives up, every tile evaluated
        noise = rng.random((B, H, Q, KV)) < 0.98
        return mods.mask_mod(lambda b, h, q, kv: noise[b, h, q, kv] & (q + 64 >= kv))
    if name == "float_threshold":  # a float32 buffer indexed by q and kv
        table = rng.standard_normal((Q, KV)).astype(np.float32)
        return mods.mask_mod(lambda b, h, q, kv: (table[q, kv] > -1.5) | (q < kv))
    if name == "doc_window_prefix":
        ids = np.sort(rng.integers(0, 3, size=S)).astype(np.int32)
        w = int(rng.integers(10, 200))
        return (mods.document(ids) & mods.sliding_window(w)) | mods.prefix_lm(int(rng.integers(0, 64)))
    if name == "nan_ratio":  # 0 / 0 on the diagonal: minimum(NaN, 0) <= 0 is false there
        return mods.mask_mod(lambda b, h, q, kv: torch.minimum((q - kv).float() / (q - kv).float(),
                                                               torch.tensor(0.0)) <= 0)
    if name == "nan_table":  # a float table with NaNs, read along q: NaN > -1.5 is false
        table = rng.standard_normal(S).astype(np.float32)
        table[rng.integers(0, S, size=3)] = np.nan
        return mods.mask_mod(lambda b, h, q, kv: (table[q] > -2.5) & (kv <= q + 300))
    if name == "modular":
        return mods.mask_mod(lambda b, h, q, kv: ((q * 3 + kv) % 7 != 0) & (kv - q < 100 * (b + 1)))
    raise KeyError(name)


FAMILIES = ["causal", "window", "causal_window", "document", "document_offsets_causal", "prefix_lm",
            "prefix_lm_batch", "head_dependent", "noise_bool", "float_threshold", "doc_window_prefix", "modular",
            "nan_ratio", "nan_table"]
SHAPES = [  # (B, H, Q, KV, BLOCK_SIZE)
    (1, 1, 1, 1, 128),
    (2, 3, 200, 77, 128),
    (1, 2, 257, 300, (64, 128)),
    (2, 1, 1000, 1300, 128),
    (1, 1, 333, 190, (16, 32)),
]


@pytest.mark.parametrize("family", FAMILIES)
def test_gpu_builder_matches_cpu_builder(family):
    rng = np.random.default_rng(hash(family) % 2**32)
    for B, H, Q, KV, bs in SHAPES:
        mask = make_mask(family, rng, B, H, Q, KV)
        deps = mask.depends_on
        b = B if "b" in deps else None
        h = H if "h" in deps else None
        gpu = create_block_mask(mask, b, h, Q, KV, BLOCK_SIZE=bs, device="cuda")
        cpu = create_block_mask(mask, b, h, Q, KV, BLOCK_SIZE=bs)
        assert_same(gpu, cpu, f"{family} {B}x{H}x{Q}x{KV} {bs}")
    # the counting variant: exact attended pairs (last shape)
    np.testing.assert_array_equal(gpu.num_allowed, cpu.num_allowed, err_msg=f"{family}: num_allowed")


def test_separate_full_blocks_false_on_gpu_matches_host():
    """torch's ``separate_full_blocks=False``: the GPU compactor lists full tiles as partial,
    as the host builder does; attention through either mask is the same."""
    rng = np.random.default_rng(3)
    for family in FAMILIES[:3]:
        for B, H, Q, KV, bs in SHAPES[:2]:
            mask = make_mask(family, rng, B, H, Q, KV)
            gpu = create_block_mask(mask, B, H, Q, KV, BLOCK_SIZE=bs, device="cuda", separate_full_blocks=False)
            cpu = create_block_mask(mask, B, H, Q, KV, BLOCK_SIZE=bs, separate_full_blocks=False)
            assert_same(gpu, cpu, f"{family} {B}x{H}x{Q}x{KV} {bs} separate_full_blocks=False")


def test_update_reuses_compiled_kernels():
    rng = np.random.default_rng(7)
    S = 1500
    bm = create_block_mask(mods.document_from_offsets(_offsets(rng, S, 4)) & mods.causal(), None, None, S, S,
                           device="cuda")
    before = compile_count()
    for _ in range(3):
        ids = mods.document_ids_from_offsets(_offsets(rng, S, int(rng.integers(1, 9))), S)
        new = bm.update(ids)
        assert_same(new, create_block_mask(bm.mask_mod.with_captures((ids,)), None, None, S, S), "update")
    for w in (16, 300, 999):  # new captured values of the same structure: same kernels
        m = mods.causal() & mods.sliding_window(w)
        assert_same(create_block_mask(m, None, None, S, S, device="cuda"), create_block_mask(m, None, None, S, S))
    mid = compile_count()
    for w in (17, 301):
        create_block_mask(mods.causal() & mods.sliding_window(w), None, None, 2 * S + 1, S, device="cuda")
    assert compile_count() == mid, "new values or lengths recompiled"
    assert mid - before <= 1, "document updates recompiled"  # the window structure compiles once


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_on_gpu_matches_host(causal):
    rng = np.random.default_rng(3 + causal)
    for S, B in ((5000, 1), (777, 3)):
        n = int(rng.integers(1, 12))  # documents per row (some empty); rows end before S: padding
        offs = np.stack([_offsets(rng, int(rng.integers(S // 2, S + 1)), n) for _ in range(B)])
        offs = offs[0] if B == 1 else offs
        gpu = varlen_block_mask(offs, length=S, causal=causal, device="cuda")
        cpu = varlen_block_mask(offs, length=S, causal=causal)
        assert_same(gpu, cpu, f"varlen S={S} B={B}")
        np.testing.assert_array_equal(gpu.num_allowed, cpu.num_allowed)
        nxt = gpu.update(offs)  # same packing again, rebuilt on the GPU
        assert_same(nxt, cpu, "varlen update")


def test_forward_reads_gpu_built_lists():
    torch.manual_seed(0)
    B, H, S, D = 2, 4, 1000, 128
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    mask = mods.causal() & mods.sliding_window(300)
    gpu = create_block_mask(mask, None, None, S, S, device="cuda")
    cpu = create_block_mask(mask, None, None, S, S)
    out_gpu = fa.flex_attention(q, k, v, block_mask=gpu)
    out_cpu = fa.flex_attention(q, k, v, block_mask=cpu)
    torch.testing.assert_close(out_gpu, out_cpu, rtol=0, atol=0)
    offs = np.array([0, 100, 457, 458, 900])  # padding after 900
    vl = varlen_block_mask(offs, length=S, causal=True, device="cuda")
    ref = fa.flex_attention(q.cpu().float(), k.cpu().float(), v.cpu().float(), mask=vl.mask_mod)  # reference
    got = fa.flex_attention(q, k, v, block_mask=vl)
    torch.testing.assert_close(got.float().cpu(), ref, rtol=2e-2, atol=2e-2)


def test_dlpack_launch_path(monkeypatch):
    """Without TVM-FFI (other frameworks' path): the from_dlpack launch with an explicit stream."""
    monkeypatch.setenv("FLEXATTN_TVM_FFI", "0")
    rng = np.random.default_rng(11)
    for family in ("document", "prefix_lm_batch"):
        mask = make_mask(family, rng, 2, 1, 700, 900)
        gpu = create_block_mask(mask, 2, None, 700, 900, device="cuda")
        assert_same(gpu, create_block_mask(mask, 2, None, 700, 900), family)
        np.testing.assert_array_equal(gpu.num_allowed, create_block_mask(mask, 2, None, 700, 900).num_allowed)
    offs = _offsets(rng, 3000, 5)
    assert_same(varlen_block_mask(offs, causal=True, device="cuda"), varlen_block_mask(offs, causal=True), "varlen")
