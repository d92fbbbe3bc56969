"""create_block_mask vs brute-force dense evaluation, list layout, torch parity, views, errors."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

from flexattn import BlockMask, create_block_mask
from flexattn.blockmask import EMPTY, FULL, PARTIAL
from flexattn.mods import causal, full, mask_mod, prefix_lm, sliding_window
from flexattn.mods import document as mods_document

RNG = np.random.default_rng(0)
S_MAX = 520
DOC_IDS = torch.from_numpy(np.sort(RNG.integers(0, 6, size=(2, S_MAX)), axis=1))
PREFIX = torch.tensor([37, 300])
NOISE = torch.from_numpy(RNG.random((2, 3, S_MAX, S_MAX)) < 0.97)

# torch-evaluable functions, traced by create_block_mask and run eagerly by the brute force
MASKS = {
    "causal": lambda b, h, q, kv: q >= kv,
    "sliding": lambda b, h, q, kv: (q - kv <= 40) & (q - kv >= -8),
    "document_b": lambda b, h, q, kv: DOC_IDS[b, q] == DOC_IDS[b, kv],
    "head_dependent": lambda b, h, q, kv: ((q // 16 + h) % 3 != (kv // 32) % 2) | (h == 1),
    "prefix_b": lambda b, h, q, kv: (kv < PREFIX[b]) | (q >= kv),
    "noise": lambda b, h, q, kv: NOISE[b, h, q, kv] & (q + 64 >= kv),
    "full": lambda b, h, q, kv: q >= 0,
    "empty": lambda b, h, q, kv: q < 0,
}


def dense_mask(fn, B, H, Q, KV):
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    q = torch.arange(Q).view(1, 1, Q, 1)
    kv = torch.arange(KV).view(1, 1, 1, KV)
    return torch.broadcast_to(fn(b, h, q, kv), (B, H, Q, KV)).numpy()


def brute_states(dense, qb, kvb):
    B, H, Q, KV = dense.shape
    nq, nkv = -(-Q // qb), -(-KV // kvb)
    pad = np.zeros((B, H, nq * qb, nkv * kvb), bool)
    valid = np.zeros_like(pad)
    pad[:, :, :Q, :KV] = dense
    valid[:, :, :Q, :KV] = True
    allowed = pad.reshape(B, H, nq, qb, nkv, kvb).sum(axis=(3, 5))
    n_valid = valid.reshape(B, H, nq, qb, nkv, kvb).sum(axis=(3, 5))
    return np.where(allowed == 0, EMPTY, np.where(allowed == n_valid, FULL, PARTIAL)).astype(np.int8)


def check_lists(num, idx, selected):
    """counts = #selected; indices = selected ascending, then the rest ascending."""
    rows = selected.reshape(-1, selected.shape[-1])
    num, idx = num.reshape(-1), idx.reshape(-1, selected.shape[-1])
    assert num.dtype == np.int32 and idx.dtype == np.int32
    for r in range(rows.shape[0]):
        chosen = np.flatnonzero(rows[r])
        rest = np.flatnonzero(~rows[r])
        assert num[r] == len(chosen)
        np.testing.assert_array_equal(idx[r], np.concatenate([chosen, rest]))


def check_layout(bm, states):
    partial, fullb = states == PARTIAL, states == FULL
    check_lists(bm.kv_num_blocks, bm.kv_indices, partial)
    check_lists(bm.full_kv_num_blocks, bm.full_kv_indices, fullb)
    check_lists(bm.q_num_blocks, bm.q_indices, partial.swapaxes(-1, -2))
    check_lists(bm.full_q_num_blocks, bm.full_q_indices, fullb.swapaxes(-1, -2))
    nq, nkv = states.shape[-2:]
    assert bm.kv_indices.shape == states.shape and bm.q_indices.shape == states.shape[:2] + (nkv, nq)


SHAPES = [(128, 128), (200, 77), (1, 1), (257, 300), (64, 513), (384, 256)]
BLOCKS = [(128, 128), (64, 128), (16, 32)]


@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("Q, KV", SHAPES)
@pytest.mark.parametrize("block", BLOCKS)
def test_matches_brute_force(name, Q, KV, block):
    fn = MASKS[name]
    depends_bh = name in ("document_b", "head_dependent", "prefix_b", "noise")
    B, H = (2, 3) if depends_bh else (None, None)
    bm = create_block_mask(fn, B, H, Q, KV, BLOCK_SIZE=block)
    dense = dense_mask(fn, B or 1, H or 1, Q, KV)
    want = brute_states(dense, *block)
    np.testing.assert_array_equal(bm.block_states(), want)
    check_layout(bm, want)
    assert bm.shape == (B or 1, H or 1, Q, KV) and bm.seq_lengths == (Q, KV) and bm.BLOCK_SIZE == block
    np.testing.assert_allclose(bm.density(), dense.mean(), rtol=1e-12)
    np.testing.assert_array_equal(bm.num_allowed, dense.sum(axis=(2, 3)))
    np.testing.assert_array_equal(bm.to_dense(), (want != EMPTY).astype(np.int32))
    assert bm.sparsity() == pytest.approx(100 * (1 - (want != EMPTY).mean()))


def test_b_h_none_broadcasts_and_given_b_h():
    m = causal()
    a = create_block_mask(m, None, None, 300, 300, BLOCK_SIZE=64)
    b = create_block_mask(m, 2, 4, 300, 300, BLOCK_SIZE=64)
    assert a.block_states().shape == (1, 1, 5, 5) and b.block_states().shape == (2, 4, 5, 5)
    assert (b.block_states() == a.block_states()).all()
    assert b.density() == a.density()
    c = create_block_mask(m, 3, None, 300, 300, BLOCK_SIZE=64)
    assert c.shape == (3, 1, 300, 300)


def test_int_block_size_and_default():
    bm = create_block_mask(causal(), None, None, 300, 260)
    assert bm.BLOCK_SIZE == (128, 128) and bm.block_states().shape == (1, 1, 3, 3)
    bm = create_block_mask(causal(), None, None, 300, 260, BLOCK_SIZE=np.int64(64))
    assert bm.BLOCK_SIZE == (64, 64)


def test_mask_mod_none_is_full():
    bm = create_block_mask(None, None, None, 100, 70, BLOCK_SIZE=32)
    assert (bm.block_states() == FULL).all() and bm.density() == 1.0
    assert bm.mask_mod.name == "full"


def test_tiles_at_the_end_classified_by_valid_elements():
    # 130 x 130 causal with 128 blocks: the last tile holds 2x2 valid elements
    bm = create_block_mask(causal(), None, None, 130, 130, BLOCK_SIZE=128)
    np.testing.assert_array_equal(bm.block_states()[0, 0], [[PARTIAL, EMPTY], [FULL, PARTIAL]])
    # a mask true on every valid element gives full edge tiles although padding is "false"
    bm = create_block_mask(lambda b, h, q, kv: kv < 130, None, None, 129, 130, BLOCK_SIZE=128)
    assert (bm.block_states() == FULL).all()
    # decided by element evaluation too (not only by interval analysis)
    bm = create_block_mask(NOISE_FREE_EDGE, None, None, 130, 130, BLOCK_SIZE=128)
    np.testing.assert_array_equal(bm.block_states()[0, 0], brute_states(dense_mask(NOISE_FREE_EDGE, 1, 1, 130, 130), 128, 128)[0, 0])


def NOISE_FREE_EDGE(b, h, q, kv):  # noqa: N802 - undecidable by intervals, all true in the edge tile
    return ((q * 7 + kv * 3) % 11 != 0) | (q >= 128)


# --- torch parity ------------------------------------------------------------------------------------

TORCH_CASES = [
    ("causal", None, None, 256, 256, 128),
    ("causal", None, None, 256, 384, (64, 128)),
    ("sliding", None, None, 512, 256, (128, 64)),
    ("document_b", 2, 3, 256, 512, 128),
    ("head_dependent", 2, 3, 128, 256, (64, 32)),
    ("prefix_b", 2, 1, 384, 384, 128),
    ("noise", 2, 3, 256, 256, 64),
    ("full", None, None, 256, 128, 128),
    ("empty", 1, 1, 128, 128, 64),
]


def _np(t):
    return t.numpy() if isinstance(t, torch.Tensor) else np.asarray(t)


@pytest.mark.parametrize("name, B, H, Q, KV, block", TORCH_CASES)
def test_equal_to_torch_on_multiples(name, B, H, Q, KV, block):
    fn = MASKS[name]
    ours = create_block_mask(fn, B, H, Q, KV, BLOCK_SIZE=block)
    ref = torch_create_block_mask(fn, B, H, Q, KV, device="cpu", BLOCK_SIZE=block)
    for attr in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        theirs = getattr(ref, attr)
        mine = getattr(ours, attr)
        if theirs is None:  # older torch without full blocks
            continue
        np.testing.assert_array_equal(mine, _np(theirs), err_msg=attr)
    assert ours.seq_lengths == tuple(ref.seq_lengths)
    assert ours.BLOCK_SIZE == tuple(ref.BLOCK_SIZE)
    assert ours.sparsity() == pytest.approx(float(ref.sparsity()))
    np.testing.assert_array_equal(ours.to_dense(), _np(ref.to_dense()))


def _computed_tiles(num, idx, full_num, full_idx, nkv):
    out = np.zeros(num.shape + (nkv,), bool)
    for n, i in ((num, idx), (full_num, full_idx)):
        n, i = _np(n), _np(i)
        listed = np.arange(i.shape[-1]) < n[..., None]
        bb, hh, rr, cc = np.nonzero(listed)
        out[bb, hh, rr, i[bb, hh, rr, cc]] = True
    return out


@pytest.mark.parametrize("name, B, H, Q, KV, block", [
    ("causal", None, None, 200, 300, 128),
    ("sliding", None, None, 257, 129, (64, 32)),
    ("document_b", 2, 3, 100, 250, 64),
    ("prefix_b", 2, 1, 333, 301, 128),
])
def test_same_computed_tiles_as_torch_on_other_lengths(name, B, H, Q, KV, block):
    fn = MASKS[name]
    ours = create_block_mask(fn, B, H, Q, KV, BLOCK_SIZE=block)
    ref = torch_create_block_mask(fn, B, H, Q, KV, device="cpu", BLOCK_SIZE=block)
    nkv = ours.kv_indices.shape[-1]
    theirs = _computed_tiles(ref.kv_num_blocks, ref.kv_indices, ref.full_kv_num_blocks, ref.full_kv_indices, nkv)
    mine = ours.block_states() != EMPTY
    assert theirs.shape[-2] >= mine.shape[-2]
    np.testing.assert_array_equal(mine, theirs[..., : mine.shape[-2], :])


# --- views, repr, round trip ---------------------------------------------------------------------------

def test_density_exact():
    bm = create_block_mask(causal(), None, None, 100, 100, BLOCK_SIZE=32)
    assert bm.density() == pytest.approx(5050 / 10000, abs=0)
    bm = create_block_mask(prefix_lm(torch.tensor([10, 50])), 2, 2, 64, 80, BLOCK_SIZE=16)
    d = dense_mask(lambda b, h, q, kv: (kv < torch.tensor([10, 50])[b]) | (q >= kv), 2, 2, 64, 80)
    assert bm.density() == pytest.approx(d.mean(), abs=1e-15)
    assert BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, BLOCK_SIZE=16).density() is None


def test_sparsity_values():
    bm = create_block_mask(causal(), None, None, 256, 256, BLOCK_SIZE=128)
    assert bm.sparsity() == pytest.approx(25.0)
    assert create_block_mask(full(), None, None, 256, 256).sparsity() == 0.0
    assert create_block_mask(~full(), None, None, 256, 256).sparsity() == 100.0


def test_repr_and_to_string():
    bm = create_block_mask(causal(), 1, 2, 256, 384, BLOCK_SIZE=128)
    r = repr(bm)
    assert r.startswith("BlockMask(shape=(B=1, H=2, Q_LEN=256, KV_LEN=384), BLOCK_SIZE=(128, 128)")
    assert "sparsity=50.00%" in r and "partial=4" in r and "full=2" in r and "mask_mod=causal" in r
    s = bm.to_string()
    assert str(bm) == r + "\n" + s
    # torch's pictures: the same characters, sections, (b, h) labels and limit
    theirs = torch_create_block_mask(lambda b, h, q, kv: q >= kv, 1, 2, 256, 384, device="cpu")
    assert s == theirs.to_string()
    wide = create_block_mask(causal(), 3, 3, 2048, 2048)
    theirs_wide = torch_create_block_mask(lambda b, h, q, kv: q >= kv, 3, 3, 2048, 2048, device="cpu")
    for kw in ({}, {"grid_size": 4}, {"grid_size": (3, 5)}, {"grid_size": -1, "limit": 2}):
        assert wide.to_string(**kw) == theirs_wide.to_string(**kw), kw
    assert len(bm.to_string(max_blocks=1).split("\n\n")[0].splitlines()) == 2   # ours: the first tiles only
    anon = create_block_mask(mask_mod(lambda b, h, q, kv: q >= kv, name=None), None, None, 128, 128)
    assert "mask_mod=" in repr(anon)
    assert "mask_mod=custom" in repr(BlockMask(np.zeros((1, 1, 1, 1)), (1, 1), (1, 1),
                                               type(causal())(causal().expr, (), None)))


def test_as_tuple_order():
    bm = create_block_mask(causal(), None, None, 256, 128, BLOCK_SIZE=(128, 64))
    t = bm.as_tuple()
    assert t[:2] == (256, 128) and t[10:12] == (128, 64) and t[12] is bm.mask_mod
    assert t[2] is bm.kv_num_blocks and t[9] is bm.full_q_indices
    nested = bm.as_tuple(flatten=False)
    assert nested[0] == (256, 128) and nested[9] == (128, 64) and nested[10] is bm.mask_mod


def test_from_kv_blocks_takes_torch_shapes():
    """Lists without leading dims ([Q_BLOCKS, KV_BLOCKS], [H, Q_BLOCKS, KV_BLOCKS]) as
    torch's from_kv_blocks takes them, and its compute_q_blocks keyword."""
    bm = create_block_mask(causal(), None, None, 512, 512)
    for lead in (0, 1):
        index = (0,) * (2 - lead) if lead == 0 else (0,)
        lists = [getattr(bm, n)[index] for n in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")]
        again = BlockMask.from_kv_blocks(*lists, mask_mod=causal(), compute_q_blocks=False)
        assert again.shape == (1, 1, 512, 512)
        np.testing.assert_array_equal(again.block_states(), bm.block_states())
        # torch's q-side attributes are None then; ours too, while the kernels keep theirs
        assert again.q_num_blocks is None and again.full_q_indices is None and again.as_tuple()[6] is None
        assert again.kv_indices is not None and again.list_array("q_indices") is not None
        with_q = BlockMask.from_kv_blocks(*lists, mask_mod=causal(), dq_write_order=None, dq_kv_order=True)
        np.testing.assert_array_equal(with_q.q_indices, bm.q_indices)


def test_to_keeps_the_mask_on_the_host():
    bm = create_block_mask(causal(), None, None, 256, 256)
    assert bm.to("cpu") is bm and bm.numel() == 256 * 256


@pytest.mark.parametrize("name", ["causal", "noise", "document_b"])
def test_from_kv_blocks_round_trip(name):
    B, H = (2, 3) if name != "causal" else (None, None)
    bm = create_block_mask(MASKS[name], B, H, 256, 200, BLOCK_SIZE=(64, 32))
    back = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                                    BLOCK_SIZE=(64, 32), mask_mod=bm.mask_mod, seq_lengths=(256, 200))
    np.testing.assert_array_equal(back.block_states(), bm.block_states())
    for attr in ("q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices", "kv_indices"):
        np.testing.assert_array_equal(getattr(back, attr), getattr(bm, attr))
    assert back.mask_mod is bm.mask_mod and back.seq_lengths == (256, 200)
    # torch tensors work as inputs; without full lists every listed tile is partial
    t = BlockMask.from_kv_blocks(torch.from_numpy(bm.kv_num_blocks), torch.from_numpy(bm.kv_indices), BLOCK_SIZE=(64, 32))
    assert t.seq_lengths == (256, 224)
    np.testing.assert_array_equal(t.block_states() == PARTIAL, bm.block_states() == PARTIAL)
    assert not (t.block_states() == FULL).any()
    # a plain function as mask_mod is traced
    f = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, mask_mod=lambda b, h, q, kv: q >= kv)
    assert f.mask_mod.expr == causal().expr


def test_from_kv_blocks_errors():
    num = np.array([[[1, 2]]])
    idx = np.array([[[[0, 1], [1, 0]]]])
    BlockMask.from_kv_blocks(num, idx)
    with pytest.raises(ValueError, match="kv_indices"):
        BlockMask.from_kv_blocks(num, idx[0])
    with pytest.raises(ValueError, match="kv_indices"):
        BlockMask.from_kv_blocks(np.array([[[1, 2, 0]]]), idx)
    with pytest.raises(ValueError, match="kv_indices"):
        BlockMask.from_kv_blocks(np.array([[[3, 0]]]), idx)
    with pytest.raises(ValueError, match="kv_indices"):
        BlockMask.from_kv_blocks(np.array([[[-1, 0]]]), idx)
    with pytest.raises(ValueError, match="kv_indices"):
        BlockMask.from_kv_blocks(num, np.array([[[[0, 2], [1, 0]]]]))
    with pytest.raises(ValueError, match="full_kv_indices"):
        BlockMask.from_kv_blocks(num, idx, num, np.array([[[[0, -1], [1, 0]]]]))
    with pytest.raises(ValueError, match="BLOCK_SIZE"):
        BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=(0, 128))
    with pytest.raises(ValueError, match="block states"):
        BlockMask(np.zeros((2, 2)), (1, 1), (1, 1), None)


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(B=0), "B"), (dict(B=-1), "B"), (dict(B=1.5), "B"), (dict(B=True), "B"), (dict(B="2"), "B"),
        (dict(H=0), "H"), (dict(H=2.0), "H"),
        (dict(Q_LEN=0), "Q_LEN"), (dict(Q_LEN=None), "Q_LEN"), (dict(Q_LEN=10.0), "Q_LEN"),
        (dict(KV_LEN=-3), "KV_LEN"), (dict(KV_LEN=None), "KV_LEN"),
        (dict(BLOCK_SIZE=0), "BLOCK_SIZE"), (dict(BLOCK_SIZE=(128,)), "BLOCK_SIZE"),
        (dict(BLOCK_SIZE=(128, -1)), "BLOCK_SIZE"), (dict(BLOCK_SIZE=(64, 64, 64)), "BLOCK_SIZE"),
        (dict(BLOCK_SIZE=(64.5, 64)), "BLOCK_SIZE"), (dict(BLOCK_SIZE=True), "BLOCK_SIZE"),
        (dict(BLOCK_SIZE=12.0), "BLOCK_SIZE"), (dict(BLOCK_SIZE="128"), "BLOCK_SIZE"),
    ],
)
def test_argument_validation(kwargs, word):
    args = dict(B=None, H=None, Q_LEN=64, KV_LEN=64, BLOCK_SIZE=32)
    args.update(kwargs)
    with pytest.raises(ValueError, match=word):
        create_block_mask(causal(), **args)


def test_mask_argument_validation():
    with pytest.raises(TypeError, match="mask_mod"):
        create_block_mask(3, None, None, 64, 64)
    from flexattn.mods import softcap
    with pytest.raises(TypeError, match="mask_mod"):
        create_block_mask(softcap(2.0), None, None, 64, 64)


def test_device_and_compile_accepted():
    a = create_block_mask(causal(), None, None, 128, 128, device="cuda", _compile=True)
    assert (a.block_states() == create_block_mask(causal(), None, None, 128, 128).block_states()).all()


# --- speed ----------------------------------------------------------------------------------------------

def test_long_causal_sliding_window_is_fast():
    m = causal() & sliding_window(1000)
    create_block_mask(m, None, None, 1024, 1024)  # warm up
    t = time.perf_counter()
    bm = create_block_mask(m, None, None, 16384, 16384)
    elapsed = time.perf_counter() - t
    assert elapsed < 1.0, f"16k x 16k causal & sliding window took {elapsed:.2f}s"
    states = bm.block_states()[0, 0]
    # only the tiles the two boundaries cross are partial: the diagonal and the window edge
    qi, ki = np.nonzero(states == PARTIAL)
    d = qi - ki
    assert set(np.unique(d)) <= {0, 7, 8}
    assert (states == PARTIAL).sum() == 128 + 121 + 120
    assert bm.density() == pytest.approx((1001 * 16384 - 1000 * 1001 / 2) / 16384 ** 2, rel=1e-12)


def test_update_with_new_captured_values_needs_no_retrace():
    ids_a = np.repeat([0, 1, 2], [100, 60, 96]).astype(np.int32)
    ids_b = np.repeat([0, 1], [30, 226]).astype(np.int32)
    bm = create_block_mask(mods_document(ids_a) & causal(), 2, None, 256, 256, BLOCK_SIZE=32)
    captures = list(bm.mask_mod.captures)
    captures[[i for i, c in enumerate(captures) if c is ids_a][0]] = ids_b
    new = bm.update(*captures)
    fresh = create_block_mask(mods_document(ids_b) & causal(), 2, None, 256, 256, BLOCK_SIZE=32)
    assert new.mask_mod.expr is bm.mask_mod.expr  # same structure object: nothing re-traced
    np.testing.assert_array_equal(new.block_states(), fresh.block_states())
    assert new.shape == bm.shape and new.BLOCK_SIZE == bm.BLOCK_SIZE


def test_per_sequence_offsets_pack_each_batch_row():
    from flexattn.mods import document_from_lengths, document_from_offsets, document_ids_from_offsets

    offsets = np.array([[0, 5, 9, 9], [0, 2, 3, 12]])  # row 0 has 2 documents (last one repeated)
    ids = document_ids_from_offsets(offsets, length=12)
    np.testing.assert_array_equal(ids[0], [0] * 5 + [1] * 4 + [-1] * 3)
    np.testing.assert_array_equal(ids[1], [0, 0, 1] + [2] * 9)
    m = document_from_offsets(offsets, length=12)
    q, kv = np.arange(12)[:, None], np.arange(12)[None, :]
    for b in range(2):
        want = (ids[b][q] == ids[b][kv]) & (ids[b][q] >= 0)
        np.testing.assert_array_equal(m(b, 0, q, kv), want)
    m2 = document_from_lengths(np.array([[5, 4, 0], [2, 1, 9]]), length=12)
    for b in range(2):
        np.testing.assert_array_equal(m2(b, 0, q, kv), m(b, 0, q, kv))
    bm = create_block_mask(m, 2, None, 12, 12, BLOCK_SIZE=4)
    assert bm.shape[0] == 2
    with pytest.raises(ValueError, match="start at 0"):
        document_ids_from_offsets(np.array([[1, 4]]))


# --- packed variable-length batches (closed form) ---------------------------------------------------

def _random_offsets(rng, L, n, B):
    rows = []
    for _ in range(B):
        total = L if rng.random() < 0.6 else int(rng.integers(1, L + 1))  # else padding at the end
        cuts = np.minimum(np.sort(rng.integers(0, L + 1, size=n - 1)), total)  # repeated cuts: empty documents
        rows.append(np.concatenate([[0], cuts, [total]]))
    return np.array(rows) if B > 1 else rows[0]


@pytest.mark.parametrize("causal_", [False, True])
def test_varlen_closed_form_equals_element_builder(causal_):
    from flexattn.blockmask import varlen_block_mask
    from flexattn.mods import document_from_offsets

    rng = np.random.default_rng(17 + causal_)
    for it in range(40):
        L, n, B = int(rng.integers(1, 700)), int(rng.integers(1, 9)), int(rng.integers(1, 3))
        offs = _random_offsets(rng, L, n, B)
        bs = [(128, 128), (64, 32), (16, 48)][it % 3]
        vl = varlen_block_mask(offs, length=L, causal=causal_, BLOCK_SIZE=bs)
        mask = document_from_offsets(offs, L) & causal() if causal_ else document_from_offsets(offs, L)
        ref = create_block_mask(mask, B if B > 1 else None, None, L, L, BLOCK_SIZE=bs)
        np.testing.assert_array_equal(vl.block_states(), ref.block_states(), err_msg=f"{offs} L={L} {bs}")
        np.testing.assert_array_equal(vl.num_allowed, ref.num_allowed)
        check_layout(vl, ref.block_states())
        assert vl.mask_mod.structure_key == mask.structure_key


def test_varlen_lengths_update_and_errors():
    from flexattn.blockmask import varlen_block_mask

    a = varlen_block_mask(np.array([0, 100, 100, 250, 400]), causal=True)
    b = varlen_block_mask(lengths=np.array([100, 0, 150, 150]), causal=True)
    np.testing.assert_array_equal(a.block_states(), b.block_states())
    assert a.shape == (1, 1, 400, 400) and int(a.num_allowed[0, 0]) == 100 * 101 // 2 + 2 * 150 * 151 // 2
    new = np.array([0, 30, 400])
    up = a.update(new)
    np.testing.assert_array_equal(up.block_states(), varlen_block_mask(new, causal=True).block_states())
    assert up.mask_mod.structure_key == a.mask_mod.structure_key  # same kernels serve the update
    padded = varlen_block_mask(np.array([0, 64, 200]), length=512)  # tiles past 200 are empty
    assert padded.shape[2:] == (512, 512) and (padded.block_states()[0, 0, 2:] == EMPTY).all()
    assert (padded.block_states()[0, 0, :, 2:] == EMPTY).all()
    with pytest.raises(ValueError, match="one of them"):
        varlen_block_mask()
    with pytest.raises(ValueError, match="start at 0"):
        varlen_block_mask(np.array([1, 5]))
    with pytest.raises(ValueError, match="shorter than"):
        varlen_block_mask(np.array([0, 500]), length=100)


def test_varlen_is_fast_at_long_lengths():
    from flexattn.blockmask.varlen import _varlen_states

    offs = np.concatenate([[0], np.sort(np.random.default_rng(0).choice(np.arange(1, 1 << 17), 63, replace=False)), [1 << 17]])
    t = time.perf_counter()
    states = _varlen_states(offs[None], 1 << 17, 128, 128, True)
    assert time.perf_counter() - t < 0.5  # ~5 ms here; a [1024, 1024] tile grid, no element evaluation
    assert states.shape == (1, 1, 1024, 1024)


def test_device_without_gpu_adapter_builds_on_host():
    """A device no registered adapter serves (no CUDA here) keeps torch-style code running."""
    from flexattn.blockmask import DeviceArrays, register_device
    from flexattn.blockmask.device import _DEVICE_RESOLVERS

    seen = []

    def resolver(device):
        seen.append(device)
        return None

    register_device(resolver)
    try:
        bm = create_block_mask(causal(), None, None, 300, 300, device="cuda:0")
        assert bm.device == "cpu" and seen == ["cuda:0"] and isinstance(bm.kv_indices, np.ndarray)
        assert DeviceArrays(device="x", stream=0, empty=None, to_device=None).tvm_ffi_stream is False
    finally:
        _DEVICE_RESOLVERS.remove(resolver)


def test_tile_balance_from_host_lists():
    """max / mean of the tiles each q-block row visits: what the planner reads to choose
    persistent CTAs for block-sparse attention."""
    from flexattn import mods as m

    S = 1024
    assert create_block_mask(m.document(np.arange(S) * 4 // S), None, None, S, S).tile_balance() == 1.0
    causal = create_block_mask(m.causal(), None, None, S, S).tile_balance()
    assert causal == pytest.approx(8 / 4.5)            # rows visit 1..8 tiles
    window = create_block_mask(m.sliding_window(256), None, None, S, S).tile_balance()
    assert window == pytest.approx(3 / (21 / 8))       # 1, 2, then 3 tiles per row
    empty = BlockMask(np.zeros((1, 1, 2, 2), np.int8), (256, 256), (128, 128), None)
    assert empty.tile_balance() is None


def test_column_visits_from_host_lists_and_landed_states():
    """The q tiles visiting each kv-block column (the backward's work per CTA): balance
    (max / mean) and mean; what the planner reads to run persistent backward CTAs. A
    GPU-built mask knows them once its states' host copy has landed (its per-row counts
    alone do not tell), or from the host analysis when its mask captures only numbers."""
    from flexattn import mods as m
    from flexattn.blockmask.layout import _LIST_NAMES

    S = 1024
    docs = create_block_mask(m.document(np.arange(S) * 4 // S), None, None, S, S).column_visits()
    assert (docs.balance, docs.mean) == (1.0, 2.0)
    causal = create_block_mask(m.causal(), None, None, S, S).column_visits()
    assert causal.balance == pytest.approx(8 / 4.5) and causal.mean == 4.5    # columns seen by 8..1 rows
    window = create_block_mask(m.sliding_window(256), None, None, S, S).column_visits()
    assert window.mean == pytest.approx(21 / 8) and window.balance == pytest.approx(3 / (21 / 8))
    assert BlockMask(np.zeros((1, 1, 2, 2), np.int8), (256, 256), (128, 128), None).column_visits() is None

    host = create_block_mask(m.document(np.repeat(np.arange(4), 256)), None, None, S, S)
    arrays = {name: getattr(host, name) for name in _LIST_NAMES}
    arrays["states"] = host._states
    bm = BlockMask._on_device(arrays, (S, S), (128, 128), host.mask_mod, "cuda")
    bm.from_mask = True
    bm._row_counts = tuple((lambda a=a: a) for a in (host.kv_num_blocks, host.full_kv_num_blocks))
    assert bm.tile_balance() == 1.0 and bm.column_visits() is None    # rows known, columns not
    landed = []
    bm._states_copy = lambda: host._states if landed else None
    assert bm.column_visits() is None
    landed.append(True)
    assert bm.column_visits() == host.column_visits()
    landed.clear()
    assert bm.column_visits() == host.column_visits()                  # kept
    band = create_block_mask(lambda b, h, q, kv: (q >= kv) & (q - kv <= 300), None, None, 1000, 1000)
    arrays = {name: getattr(band, name) for name in _LIST_NAMES}
    arrays["states"] = np.zeros((1, 1, 8, 8), np.int8)                 # never read
    bm = BlockMask._on_device(arrays, (1000, 1000), (128, 128), band.mask_mod, "cuda")
    bm.from_mask = True
    assert bm.column_visits().balance == pytest.approx(band.column_visits().balance)


def test_tile_balance_of_gpu_built_masks_from_the_host_analysis():
    """A GPU-built block mask's balance (persistent scheduling) comes from interval
    analysis on the host when its mask captures only numbers; masks reading arrays
    would make the host wait for the GPU: None."""
    from flexattn.blockmask.layout import _LIST_NAMES

    def on_device(mask):
        host = create_block_mask(mask, None, None, 1000, 1000)
        arrays = {name: getattr(host, name) for name in _LIST_NAMES}
        arrays["states"] = np.zeros((1, 1, 8, 8), np.int8)   # never read by tile_balance
        bm = BlockMask._on_device(arrays, (1000, 1000), (128, 128), host.mask_mod, "cuda")
        bm.from_mask = True
        return host, bm

    host, bm = on_device(lambda b, h, q, kv: (q >= kv) & (q - kv <= 300))
    assert bm.tile_balance() == pytest.approx(host.tile_balance())
    ids = np.repeat(np.arange(4), 250)
    _, bm = on_device(mods_document(ids))
    assert bm.tile_balance() is None


def test_tile_balance_waits_for_the_downloaded_counts_without_stalling():
    """A GPU-built mask whose mask reads arrays learns its balance from the builder's
    asynchronous copies of the per-row counts: unknown (None, asked again) while they are
    in flight, then kept."""
    from flexattn.blockmask.layout import _LIST_NAMES

    ids = np.repeat(np.arange(4), 250)
    host = create_block_mask(mods_document(ids), None, None, 1000, 1000)
    arrays = {name: getattr(host, name) for name in _LIST_NAMES}
    arrays["states"] = np.zeros((1, 1, 8, 8), np.int8)
    bm = BlockMask._on_device(arrays, (1000, 1000), (128, 128), host.mask_mod, "cuda")
    bm.from_mask = True
    landed = []
    bm._row_counts = tuple((lambda a=a: a if landed else None) for a in (host.kv_num_blocks, host.full_kv_num_blocks))
    assert bm.tile_balance() is None and bm.tile_balance() is None
    landed.append(True)
    assert bm.tile_balance() == pytest.approx(host.tile_balance())
    landed.clear()
    assert bm.tile_balance() == pytest.approx(host.tile_balance())   # kept


def test_row_pairs_match_reads_the_states_host_or_downloaded():
    """Rows 2i and 2i+1 visiting the same tiles in the same states (documents on 256-token
    boundaries at 128-token blocks): what the planner reads to run block lists in clusters
    of two CTAs. A boundary inside a pair, an odd row count or a causal mask: no. A
    GPU-built mask knows once its states' host copy has landed (its tile balance too)."""
    from flexattn import mods as m
    from flexattn.blockmask.layout import _LIST_NAMES

    assert create_block_mask(m.document(np.repeat(np.arange(4), 256)), None, None, 1024, 1024).row_pairs_match()
    assert not create_block_mask(m.document(np.repeat(np.arange(8), 128)), None, None, 1024, 1024).row_pairs_match()
    assert not create_block_mask(m.document(np.zeros(640, np.int64)), None, None, 640, 640).row_pairs_match()   # 5 rows
    assert not create_block_mask(m.causal(), None, None, 1024, 1024).row_pairs_match()
    assert create_block_mask(None, None, None, 1024, 1024).row_pairs_match()   # full: every row alike
    # per (batch, head): a pair may differ between heads, not inside one
    ids = np.stack([np.repeat(np.arange(2), 512), np.repeat(np.arange(4), 256)])
    assert create_block_mask(m.document(ids), 2, None, 1024, 1024).row_pairs_match()
    ids[1, 256:384] = 7
    assert not create_block_mask(m.document(ids), 2, None, 1024, 1024).row_pairs_match()

    host = create_block_mask(m.document(np.repeat(np.arange(4), 256)), None, None, 1024, 1024)
    arrays = {name: getattr(host, name) for name in _LIST_NAMES}
    arrays["states"] = host._states
    bm = BlockMask._on_device(arrays, (1024, 1024), (128, 128), host.mask_mod, "cuda")
    assert bm.row_pairs_match() is None                # no copy started
    landed = []
    bm._states_copy = lambda: host._states if landed else None
    assert bm.row_pairs_match() is None and bm.tile_balance() is None
    landed.append(True)
    assert bm.row_pairs_match() is True
    assert bm.tile_balance() == host.tile_balance() == 1.0   # the same copy serves the balance
    landed.clear()
    assert bm.row_pairs_match() is True                # kept


def test_torch_block_masks_convert_once_and_keep_their_structure():
    """A torch BlockMask converts once per object (its lists are copied to the host once);
    one built from a band mask (causal, a window) by torch's create_block_mask adds
    nothing to its mask (``from_mask``), even where torch lists a padded last row of tiles
    as partial; one whose lists leave out attended tiles does not."""
    from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask
    from torch.nn.attention.flex_attention import and_masks

    from flexattn.blockmask.layout import as_block_mask

    def causal_fn(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    t = torch_create_block_mask(causal_fn, None, None, 1000, 1000, device="cpu")
    ours = as_block_mask(t)
    assert as_block_mask(t) is ours and ours.from_mask
    window = torch_create_block_mask(and_masks(causal_fn, lambda b, h, q, kv: q - kv <= 300), 2, 1, 1000, 1000,
                                     device="cpu")
    assert as_block_mask(window).from_mask
    fewer = TorchBlockMask.from_kv_blocks(t.kv_num_blocks.clamp(max=1), t.kv_indices, mask_mod=causal_fn)
    assert not as_block_mask(fewer).from_mask
    docs = torch_create_block_mask(lambda b, h, q, kv: q // 100 == kv // 100, None, None, 1000, 1000, device="cpu")
    assert not as_block_mask(docs).from_mask     # not a band: lists kept


@pytest.mark.parametrize("index", [0, -1, (0, 1), (slice(0, 2), slice(1, 2)), (slice(None), slice(None), [1, 3]),
                                   (slice(0, 2), slice(1, 2), "tensor")])
def test_slicing_matches_torch(index):
    """``block_mask[b]``, ``[:, h]``, ``[:, :, rows]`` as torch slices its lists (ints keep
    their dimension); the mask_mod is unset until the caller sets it, as in torch."""
    def causal_fn(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    ours = create_block_mask(causal_fn, 2, 3, 512, 512)
    theirs = torch_create_block_mask(causal_fn, 2, 3, 512, 512, device="cpu")
    if isinstance(index, tuple) and index[-1] == "tensor":
        index = index[:-1] + (torch.tensor([1], dtype=torch.int32),)
    torch_index = tuple(torch.tensor(i) if isinstance(i, list) else i for i in index) if isinstance(index, tuple) else index
    a, b = ours[index], theirs[torch_index]
    for name in ("kv_num_blocks", "full_kv_num_blocks"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name).numpy())
    n = a.kv_num_blocks
    listed = np.arange(a.kv_indices.shape[-1]) < n[..., None]
    np.testing.assert_array_equal(np.where(listed, a.kv_indices, -1), np.where(listed, b.kv_indices.numpy(), -1))
    assert a.seq_lengths == tuple(b.seq_lengths) and a.numel() == b.numel()
    with pytest.raises(ValueError, match="sliced"):
        a.mask_mod
    a.mask_mod = causal_fn
    assert a.mask_mod(0, 0, 3, 2) and not a.from_mask


def test_conversions_of_equal_small_lists_share_them():
    """torch's PagedAttention converts a new block mask every step (and a compiled gpt-fast
    step slices one in its graph): conversions whose lists hold the same values share
    states, lists and walk tables, each a block mask of its own with its own mask."""
    from flexattn.blockmask.layout import as_block_mask

    def causal_fn(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    base = torch_create_block_mask(causal_fn, 2, 1, 128, 1024, device="cpu")
    again = torch_create_block_mask(causal_fn, 2, 1, 128, 1024, device="cpu")
    shifted = torch_create_block_mask(lambda b, h, q, kv: q + 300 >= kv, 2, 1, 128, 1024, device="cpu")
    a, b, c = as_block_mask(base), as_block_mask(again), as_block_mask(shifted)
    assert a is not b and a._states is b._states and a.kv_block_table(2) is b.kv_block_table(2)
    assert c._states is not a._states
    assert a.from_mask and b.from_mask and c.from_mask
    b.mask_mod = lambda bb, h, q_idx, kv_idx: q_idx + 1 >= kv_idx
    assert a.mask_mod(0, 0, 0, 1) == False and b.mask_mod(0, 0, 0, 1) == True  # noqa: E712


def test_device_lists_come_to_the_host_in_one_copy():
    """``arrays.to_numpy_all``: torch tensors of one dtype on one CUDA device (stood in for
    by a subclass answering ``is_cuda``) are gathered and copied to the host once; each
    comes back in its shape, None passes, anything else converts one by one."""
    from flexattn.arrays import to_numpy_all

    class OnTheGPU(torch.Tensor):
        @property
        def is_cuda(self):
            return True

    copies = []
    real = torch.Tensor.cpu
    a = torch.arange(6, dtype=torch.int32).reshape(1, 2, 3).as_subclass(OnTheGPU)
    b = torch.tensor([[7]], dtype=torch.int32).as_subclass(OnTheGPU)
    try:
        torch.Tensor.cpu = lambda self, *args, **kw: (copies.append(tuple(self.shape)), real(self, *args, **kw))[1]
        got = to_numpy_all([a, None, b])
    finally:
        torch.Tensor.cpu = real
    assert copies and set(copies) == {(7,)}     # only the gathered buffer went to the host
    np.testing.assert_array_equal(got[0], np.arange(6).reshape(1, 2, 3))
    assert got[1] is None and got[2].tolist() == [[7]]
    mixed = to_numpy_all([torch.arange(3), np.ones(2)])
    assert mixed[0].tolist() == [0, 1, 2] and mixed[1].tolist() == [1.0, 1.0]


def test_slices_of_one_row_share_their_lists_not_their_mask():
    """A decoder slices the row of its position every step: each slice is a block mask of
    its own (its mask_mod, its walks) over the row's states, lists and walk tables, kept
    once on the parent (an int and a tensor index name the same row)."""
    def causal_fn(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    full = create_block_mask(causal_fn, 1, 1, 1024, 1024)
    first, second = full[:, :, 3], full[:, :, torch.tensor([3])]
    assert first is not second and first._states is second._states
    assert first.kv_block_table(1) is second.kv_block_table(1)     # computed once for the row
    first.mask_mod = causal_fn
    with pytest.raises(ValueError, match="sliced"):
        second.mask_mod                                               # still unset
    other = full[:, :, 4]
    assert other._states is not first._states and int(other.kv_num_blocks[0, 0, 0]) == 1
    assert int(other.full_kv_num_blocks[0, 0, 0]) == 4


def test_adjust_matches_torch():
    def causal_fn(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    ours = create_block_mask(causal_fn, None, None, 1024, 1024)
    theirs = torch_create_block_mask(causal_fn, None, None, 1024, 1024, device="cpu")
    for q_len, kv_len in ((300, 700), (1024, 1024), (1, 1024)):
        a, b = ours._adjust(q_len, kv_len), theirs._adjust(q_len, kv_len)
        assert a.seq_lengths == (q_len, kv_len) == tuple(b.seq_lengths)
        for name in ("kv_num_blocks", "full_kv_num_blocks"):
            np.testing.assert_array_equal(getattr(a, name), getattr(b, name).numpy())
        assert a.mask_mod is ours.mask_mod


def test_a_new_mask_mod_ends_from_mask():
    built = create_block_mask(causal(), None, None, 256, 256)
    assert built.from_mask
    built.mask_mod = causal()            # the same mask (another object): lists still its own
    assert built.from_mask
    built.mask_mod = sliding_window(8)   # another mask: the lists keep their meaning
    assert not built.from_mask


def test_torch_decoding_pattern_matches_torch_eager():
    """The decoding pattern of torch users: one q-block row of a prebuilt causal mask, its
    mask_mod shifted to the query's position, seq_lengths set — against torch's eager
    flex_attention on CPU."""
    import flexattn.torch as fa
    from torch.nn.attention.flex_attention import flex_attention as torch_flex

    torch.manual_seed(0)
    L, pos = 512, 300
    q = torch.randn(1, 2, 1, 16, dtype=torch.float64)
    k, v = (torch.randn(1, 2, L, 16, dtype=torch.float64) for _ in range(2))

    def causal_fn(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def at_pos(b, h, q_idx, kv_idx):
        return q_idx + pos >= kv_idx

    outs = []
    for make, attend in ((create_block_mask, fa.flex_attention), (torch_create_block_mask, torch_flex)):
        full = make(causal_fn, None, None, L, L, device="cpu") if make is torch_create_block_mask \
            else make(causal_fn, None, None, L, L)
        row = full[:, :, pos // 128]
        row.mask_mod = at_pos
        row.seq_lengths = (1, L)
        outs.append(attend(q, k, v, block_mask=row))
    torch.testing.assert_close(outs[0], outs[1])


@pytest.mark.parametrize("broken", ["count above the list", "negative count", "index past the last block",
                                    "negative index"])
def test_user_made_block_masks_with_bad_lists_are_clear_errors(broken):
    """A user-made block mask (ours or torch's, converted) whose counts exceed its lists or
    whose indices leave the grid is a ValueError when it is made: nothing reaches a kernel."""
    from torch.nn.attention.flex_attention import BlockMask as TorchBlockMask

    from flexattn.blockmask.layout import as_block_mask

    num = np.array([[[1, 2]]], np.int32)
    idx = np.array([[[[0, 1], [0, 1]]]], np.int32)
    if broken == "count above the list":
        num = np.array([[[1, 3]]], np.int32)
    elif broken == "negative count":
        num = np.array([[[-1, 2]]], np.int32)
    elif broken == "index past the last block":
        idx = np.array([[[[0, 1], [0, 2]]]], np.int32)
    else:
        idx = np.array([[[[0, 1], [-1, 1]]]], np.int32)
    with pytest.raises(ValueError, match="kv_indices|must lie"):
        BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=128, seq_lengths=(256, 256))
    theirs = TorchBlockMask.from_kv_blocks(torch.from_numpy(num), torch.from_numpy(idx), BLOCK_SIZE=128,
                                           seq_lengths=(256, 256), compute_q_blocks=False)
    with pytest.raises(ValueError, match="kv_indices|must lie"):
        as_block_mask(theirs)
