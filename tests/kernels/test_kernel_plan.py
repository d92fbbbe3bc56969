"""CPU: how the core plans a GPU call (block structure, tiles, hook, errors) — no launch."""

import numpy as np
import pytest
import torch

pytest.importorskip("cutlass")

from flexattn import create_block_mask, mods  # noqa: E402
from flexattn.core import AttentionSpec, check_inputs  # noqa: E402
from flexattn.core.kernel_path import plan_forward  # noqa: E402
from torch.nn.attention.flex_attention import and_masks, noop_mask  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask  # noqa: E402

from flexattn.blockmask.layout import BlockMask, as_block_mask  # noqa: E402


def _plan(D=128, dtype=torch.bfloat16, Q=300, KV=300, **kw):
    q = torch.empty(2, 4, Q, D, dtype=dtype)
    k = torch.empty(2, 4, KV, D, dtype=dtype)
    spec = AttentionSpec.from_args(**kw)
    return plan_forward(q, check_inputs(q, k, k, spec), spec)


class _OnGpu(torch.Tensor):   # a CPU tensor that reports a CUDA DLPack device
    def __dlpack_device__(self):
        return (2, 0)


def _gpu_config(mask, D=128, dtype=torch.bfloat16):
    """The planned FwdConfig of a B2 H4 S1024 call with ``mask`` on ``_OnGpu`` tensors."""
    q = torch.empty(2, 4, 1024, D, dtype=dtype).as_subclass(_OnGpu)
    spec = AttentionSpec.from_args(mask=mask)
    return plan_forward(q, check_inputs(q, q, q, spec), spec).config


@pytest.fixture
def on_gpu(monkeypatch):
    """Plans for ``_OnGpu`` tensors see an H100's device facts (132 SMs, 60 clusters of 2)."""
    from flexattn.kernels.hopper import device_facts

    monkeypatch.setattr(device_facts, "sm_count", lambda ordinal: 132)
    monkeypatch.setattr(device_facts, "max_active_clusters", lambda ordinal, size: 60)


def test_dense_without_mask():
    p = _plan()
    assert not p.config.causal and not p.config.block_sparse and p.block_mask is None
    assert not p.config.mods.has_mask and not p.config.mods.has_score


def test_builtin_causal_uses_the_kernels_diagonal():
    p = _plan(mask=mods.causal(), score=mods.softcap(20.0))
    assert p.config.causal and not p.config.block_sparse and not p.config.mods.has_mask
    assert p.config.mods.has_score


def _causal_lambda(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@pytest.mark.parametrize("door", ["builtin mask=", "lambda mask=", "spelled otherwise", "block_mask= lambda",
                                  "block_mask= builtin", "block_mask= BLOCK_SIZE 64", "and full",
                                  "torch and_masks", "torch and_masks block_mask=", "torch's BlockMask"])
def test_causal_through_every_door_plans_the_same_kernel(door):
    """The structure comes from the mask's IR: every spelling of causal, as mask= or as a
    block mask built from it alone, runs the kernel's diagonal (no lists, no mask hook)."""
    kw = {
        "builtin mask=": dict(mask=mods.causal()),
        "lambda mask=": dict(mask=_causal_lambda),
        "spelled otherwise": dict(mask=lambda b, h, q, kv: kv - q <= 0),
        "block_mask= lambda": dict(block_mask=create_block_mask(_causal_lambda, None, None, 300, 300)),
        "block_mask= builtin": dict(block_mask=create_block_mask(mods.causal(), 2, 4, 300, 300)),
        "block_mask= BLOCK_SIZE 64": dict(block_mask=create_block_mask(_causal_lambda, None, None, 300, 300,
                                                                       BLOCK_SIZE=64)),
        "and full": dict(mask=mods.mask_mod(_causal_lambda) & mods.full()),
        "torch and_masks": dict(mask=and_masks(_causal_lambda, noop_mask)),
        "torch and_masks block_mask=": dict(block_mask=create_block_mask(and_masks(_causal_lambda, _causal_lambda),
                                                                         None, None, 300, 300)),
        "torch's BlockMask": dict(block_mask=as_block_mask(torch_create_block_mask(_causal_lambda, None, None, 300, 300,
                                                                                    device="cpu"))),
    }[door]
    p = _plan(score=mods.softcap(20.0), **kw)
    reference = _plan(score=mods.softcap(20.0), mask=mods.causal())
    assert p.config.key() == reference.config.key()
    assert p.config.causal and p.block_mask is None and not p.config.mods.has_mask


@pytest.mark.parametrize("door", ["builtin mask=", "lambda mask=", "block_mask= lambda", "block_mask= builtin",
                                  "torch and_masks"])
def test_windows_through_every_door_plan_the_same_kernel(door):
    """Every spelling of a sliding window runs the band structure (its blocks by
    arithmetic) and evaluates the band's canonical IR on its partial tiles (its bounds as
    runtime values): one kernel configuration for them all."""
    def window(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= 100)

    kw = {
        "builtin mask=": dict(mask=mods.sliding_window(100)),
        "lambda mask=": dict(mask=window),
        "block_mask= lambda": dict(block_mask=create_block_mask(window, None, None, 300, 300)),
        "block_mask= builtin": dict(block_mask=create_block_mask(mods.sliding_window(100), None, None, 300, 300)),
        "torch and_masks": dict(mask=and_masks(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx,
                                               lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= 100)),
    }[door]
    p = _plan(**kw)
    reference = _plan(mask=mods.sliding_window(7))
    assert p.config.key() == reference.config.key()
    assert p.config.band and not p.config.block_sparse
    assert p.config.mods.captures() == (0, 100)
    # The backward walks the lists of a block mask (the given one, or one built).
    assert p.block_mask is not None and p.block_mask.BLOCK_SIZE == (128, 128)


@pytest.mark.parametrize("door", ["builtin mask=", "builtin block_mask=", "lambda mask=", "lambda block_mask=",
                                  "torch and_masks block_mask="])
def test_documents_through_every_door_plan_the_same_kernel(door):
    """Documents as torch users write them (``doc[q_idx] == doc[kv_idx]`` over a captured
    tensor, through ``create_block_mask``) and as our built-in: one forward and one backward
    configuration (bench_fwd's door and built-in columns, document4)."""
    from flexattn.kernels.bwd.plan import config_from_forward

    doc = torch.arange(512) * 4 // 512          # four documents on 128-token tiles

    def same_doc(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    kw = {
        "builtin mask=": dict(mask=mods.document(doc)),
        "builtin block_mask=": dict(block_mask=create_block_mask(mods.document(doc), None, None, 512, 512)),
        "lambda mask=": dict(mask=same_doc),
        "lambda block_mask=": dict(block_mask=create_block_mask(same_doc, None, None, 512, 512)),
        "torch and_masks block_mask=": dict(block_mask=create_block_mask(and_masks(same_doc, noop_mask),
                                                                         None, None, 512, 512)),
    }[door]
    p = _plan(Q=512, KV=512, **kw)
    reference = _plan(Q=512, KV=512, mask=mods.document(doc))
    assert p.config.key() == reference.config.key()
    assert config_from_forward(p.config).key() == config_from_forward(reference.config).key()
    assert p.config.block_sparse and not p.config.partial_blocks and not p.config.mods.has_mask


def test_alibi_as_torch_users_write_it_plans_the_builtins_kernel():
    """``score + slopes[h] * (kv_idx - q_idx)`` under a causal function: the built-in ALiBi's
    configuration (a captured slope tensor read once per row), forward and backward."""
    from flexattn.kernels.bwd.plan import config_from_forward

    slopes = torch.from_numpy(mods.alibi_slopes(4))
    door = _plan(mask=_causal_lambda, score=lambda s, b, h, q_idx, kv_idx: s + slopes[h] * (kv_idx - q_idx))
    builtin = _plan(mask=mods.causal(), score=mods.alibi(slopes))
    assert door.config.key() == builtin.config.key()
    assert config_from_forward(door.config).key() == config_from_forward(builtin.config).key()


def test_block_masks_not_built_from_their_mask_keep_their_lists():
    """A block mask whose lists were given (from_kv_blocks) may leave out tiles its mask
    allows: it keeps the block-sparse structure even with a causal mask_mod."""
    built = create_block_mask(mods.causal(), None, None, 300, 300)
    given = type(built).from_kv_blocks(built.kv_num_blocks, built.kv_indices, built.full_kv_num_blocks,
                                       built.full_kv_indices, mask_mod=mods.causal(), seq_lengths=(300, 300))
    p = _plan(block_mask=given)
    assert p.config.block_sparse and p.block_mask is given
    window = create_block_mask(mods.sliding_window(64), None, None, 300, 300)
    given = type(window).from_kv_blocks(window.kv_num_blocks, window.kv_indices, window.full_kv_num_blocks,
                                        window.full_kv_indices, mask_mod=mods.sliding_window(64),
                                        seq_lengths=(300, 300))
    p = _plan(block_mask=given)
    assert p.config.block_sparse and not p.config.band and p.block_mask is given


@pytest.mark.parametrize("seed", range(4))
def test_band_block_ranges_are_the_band_tiles(seed):
    """The band structure's arithmetic (kernels/blockmask/visit.py) lists every kv block with
    a visible element and calls full exactly the blocks inside the band, against a brute
    force over the tile's elements, for random bands (open sides included) and shapes."""
    from flexattn.kernels.blockmask.visit import OPEN_BAND_SIDE, band_block_ranges

    rng = np.random.default_rng(seed)
    for _ in range(150):
        tile_m, tile_n = int(rng.choice([64, 128, 192])), int(rng.choice([64, 128]))
        q_len, kv_len = int(rng.integers(1, 700)), int(rng.integers(1, 700))
        lo = None if rng.random() < 0.2 else int(rng.integers(-400, 400))
        hi = None if rng.random() < 0.2 else int(rng.integers(-400, 400))
        lo_, hi_ = (-OPEN_BAND_SIDE if lo is None else lo), (OPEN_BAND_SIDE if hi is None else hi)
        q, kv = np.arange(q_len)[:, None], np.arange(kv_len)[None, :]
        allowed = (q - kv >= lo_) & (q - kv <= hi_)
        for m in range(-(-q_len // tile_m)):
            n_lo, n_end, f_lo, f_end = band_block_ranges(lo_, hi_, m, tile_m, tile_n, kv_len)
            rows = slice(m * tile_m, (m + 1) * tile_m)
            visible = {n for n in range(-(-kv_len // tile_n)) if allowed[rows, n * tile_n:(n + 1) * tile_n].any()}
            assert visible <= set(range(n_lo, n_end)), (lo, hi, m)
            assert n_lo <= f_lo <= f_end <= n_end
            for n in range(n_lo, n_end):
                tile_q = np.arange(m * tile_m, (m + 1) * tile_m)[:, None]
                tile_kv = np.arange(n * tile_n, (n + 1) * tile_n)[None, :]
                inside = ((tile_q - tile_kv >= lo_) & (tile_q - tile_kv <= hi_)).all()
                assert (f_lo <= n < f_end) == inside, (lo, hi, m, n)
                # Listed blocks hold a visible column of some row (maybe past KV_LEN),
                # unless runtime bounds made the band empty (lo > hi: visits, all masked).
                if lo_ <= hi_:
                    assert ((tile_q - tile_kv >= lo_) & (tile_q - tile_kv <= hi_)).any(), (lo, hi, m, n)


def test_other_masks_become_block_sparse_lists():
    p = _plan(mask=mods.causal() & mods.prefix_lm(np.array([5, 50])) | mods.sliding_window(64))
    assert p.config.block_sparse and p.block_mask.BLOCK_SIZE == (128, 128)
    assert p.config.mods.has_mask
    p = _plan(mask=mods.document(np.zeros(300, np.int32)))
    assert p.block_mask.shape == (1, 1, 300, 300)  # mask reads neither b nor h: stored once
    p = _plan(mask=mods.prefix_lm(np.array([5, 50])))  # reads b: one row of lists per batch
    assert p.block_mask.shape[0] == 2


def test_full_block_mask_needs_no_mask_hook():
    bm = create_block_mask(mods.full(), None, None, 300, 300)
    p = _plan(block_mask=bm)
    assert p.config.block_sparse and not p.config.mods.has_mask


def test_tile_m_above_128_only_up_to_d96_without_heavy_score_or_lists():
    assert _plan(D=96).config.tile_m == _plan(D=96, mask=mods.causal()).config.tile_m == 192
    assert _plan(D=64).config.tile_m == _plan(D=64, mask=mods.causal()).config.tile_m == 256   # (on demand)
    assert _plan(D=96, score=mods.softcap(5.0)).config.tile_m == 128
    assert _plan(D=64, score=mods.softcap(5.0)).config.tile_m == 256   # (a light score mod)
    assert _plan(D=64, mask=mods.sliding_window(8)).config.tile_m == 128
    assert _plan(D=128).config.tile_m == 128


def test_structure_not_values_decides_the_config_key():
    a = _plan(mask=mods.sliding_window(10) & mods.document(np.zeros(300, np.int32)), score=mods.softcap(3.0))
    b = _plan(mask=mods.sliding_window(99) & mods.document(np.arange(300, dtype=np.int32)), score=mods.softcap(9.0))
    c = _plan(mask=mods.sliding_window(10) & mods.document(np.zeros(300, np.int64)), score=mods.softcap(3.0))
    assert a.config.key() == b.config.key() != c.config.key()


@pytest.mark.parametrize("kw, words", [
    (dict(D=72), "multiples of 16"),
    (dict(D=272), "up to 256"),
    (dict(dtype=torch.float64), "bfloat16, float16 and float32"),
])
def test_unsupported_is_refused_before_compiling(kw, words):
    with pytest.raises(ValueError, match=words):
        _plan(**kw)


def test_block_masks_at_other_block_sizes_run_on_the_kernels_tiles():
    """A block mask built at another BLOCK_SIZE runs (torch's semantics kept): made from its
    mask alone, the mask plans as mask= would (a window at 64: the band); lists of their own
    (from_kv_blocks at 64 x 32) become 128 x 128 tiles whose mask reads the original tiles'
    states (blockmask/coarsen.py), made once per block mask."""
    window = _plan(block_mask=create_block_mask(mods.sliding_window(64), None, None, 300, 300, BLOCK_SIZE=64))
    assert window.config.key() == _plan(mask=mods.sliding_window(64)).config.key()
    fine = create_block_mask(mods.document(np.repeat(np.arange(5), 60).astype(np.int32)), None, None, 300, 300,
                             BLOCK_SIZE=(64, 32))
    listed = BlockMask.from_kv_blocks(*fine.as_tuple()[2:6], BLOCK_SIZE=(64, 32), mask_mod=fine.mask_mod,
                                      seq_lengths=(300, 300))
    assert not listed.from_mask
    p = _plan(block_mask=listed)
    assert p.config.block_sparse and p.block_mask.BLOCK_SIZE == (128, 128) and p.config.mods.has_mask
    assert _plan(block_mask=listed).block_mask is p.block_mask
    # the table-reading mask compiles, forward and backward (an int8 gather per element of a partial tile)
    from flexattn.kernels.bwd.plan import config_from_forward
    from flexattn.kernels.emit.mod_emit import fake_args
    from flexattn.kernels.launch.compile import compile_backward, compile_forward

    assert ".s8" in compile_forward(p.config, fake_args(p.config.mods), keep_ptx=True).__ptx__
    backward = config_from_forward(p.config)
    compile_backward(backward, fake_args(backward.mods))


def test_head_dims_plan_tiles_that_fit_shared_memory(on_gpu):
    """Every head dim (and value head dim) the forward takes gets two K/V stages of the
    widest tile that fits (FA3's 112 / 80 at 192 / 256), 192-row tiles up to 96 (at most 112
    keys beyond 64: the S fragment's registers; 256 x 80 up to 32, 256 x 64 up to 64), persistent
    CTAs only where their separate O buffer fits too; block-sparse lists take 64-key tiles
    where 128 do not fit (two per listed block); clusters only at 128/128 and 192/128. The backward takes
    every one of them (``backward_unsupported``)."""
    from flexattn.core.kernel_path import backward_unsupported
    from flexattn.kernels.fwd.sm90 import shared_bytes
    from flexattn.kernels.hopper.mma import SMEM_CAPACITY

    def plan(D, Dv, **kw):
        q = torch.empty(2, 4, 256, D, dtype=torch.bfloat16).as_subclass(_OnGpu)
        v = torch.empty(2, 4, 256, Dv, dtype=torch.bfloat16).as_subclass(_OnGpu)
        spec = AttentionSpec.from_args(**kw)
        shape = check_inputs(q, q, v, spec)
        return plan_forward(q, shape, spec).config, shape

    want = {(32, 32): (256, 80, 132), (64, 64): (256, 64, 132), (80, 80): (192, 112, 132), (96, 96): (192, 112, 132),
            (128, 64): (128, 128, 132), (192, 128): (128, 128, 0), (192, 192): (128, 112, 0),
            (256, 128): (128, 96, 0), (256, 256): (128, 80, 0)}
    for (D, Dv), (tile_m, tile_n, ctas) in want.items():
        cfg, shape = plan(D, Dv)
        assert (cfg.head_dim, cfg.head_dim_v, cfg.tile_m, cfg.tile_n, cfg.num_stages, cfg.max_ctas) == (
            D, Dv, tile_m, tile_n, 2, ctas), (D, Dv)
        assert shared_bytes(cfg.tile_m, cfg.tile_n, 2, D, Dv, cfg.separate_o) <= SMEM_CAPACITY
        assert cfg.cluster_m == (2 if (D, Dv) in ((128, 128), (192, 128)) else 1)
        assert cfg.rescale_o_early == (Dv > 192), (D, Dv)   # O shrinks while Q K^T runs
        assert backward_unsupported(shape) is None
    sparse, _ = plan(256, 256, mask=mods.document(np.zeros(256, np.int32)))
    assert (sparse.block_sparse, sparse.tile_n, sparse.num_stages, sparse.sparse_block_n) == (True, 64, 2, 128)
    band, _ = plan(256, 256, mask=mods.sliding_window(100))
    assert (band.band, band.tile_n, band.num_stages) == (True, 80, 2)
    assert sparse.rescale_o_early and band.rescale_o_early


def test_rescale_threshold_from_128_value_columns_without_score_mod(on_gpu, monkeypatch):
    """O's rescale behind a vote (rescale_threshold 8) from 128 value columns, where the
    door A/B measured it faster, and for every block structure; off below 128, with a
    score mod and for float32; FLEXATTN_RESCALE_THRESHOLD overrides (a plan of its own)."""
    monkeypatch.delenv("FLEXATTN_RESCALE_THRESHOLD", raising=False)
    monkeypatch.setenv("FLEXATTN_MAXIMA_ON_DEMAND", "0")   # (which plans a threshold everywhere)

    def threshold(D, Dv=None, dtype=torch.bfloat16, **kw):
        q = torch.empty(2, 4, 1024, D, dtype=dtype).as_subclass(_OnGpu)
        v = torch.empty(2, 4, 1024, Dv or D, dtype=dtype).as_subclass(_OnGpu)
        spec = AttentionSpec.from_args(**kw)
        return plan_forward(q, check_inputs(q, q, v, spec), spec).config.rescale_threshold

    assert threshold(128) == threshold(256) == threshold(192, 128) == 8.0
    assert threshold(128, mask=mods.causal()) == threshold(256, mask=mods.causal()) == 8.0
    assert threshold(128, mask=mods.sliding_window(100)) == 8.0
    assert threshold(128, mask=mods.document(np.arange(1024) // 300)) == 8.0
    assert threshold(128, dtype=torch.float16) == 8.0
    assert threshold(64) == threshold(32) == threshold(96) == threshold(128, 64) == 0.0
    assert threshold(128, mask=mods.causal(), score=mods.softcap(20.0)) == 0.0
    assert threshold(128, dtype=torch.float32) == 0.0
    monkeypatch.setenv("FLEXATTN_RESCALE_THRESHOLD", "0")
    assert threshold(128) == 0.0
    monkeypatch.setenv("FLEXATTN_RESCALE_THRESHOLD", "4")
    assert threshold(64) == 4.0
    monkeypatch.delenv("FLEXATTN_RESCALE_THRESHOLD")


def test_four_warpgroups_up_to_head_dim_32(on_gpu, monkeypatch):
    """256 x 80 tiles (four consumer warpgroups) for 16-bit calls up to head dim 32
    without a block mask, and with a score mod only if it is light (TALL_TILE_SCORE_OPS, no
    gathers); 192 x 128 beyond, 128-row tiles with a heavier score mod, a band or lists,
    fp32 its own; FLEXATTN_FWD_TILES overrides where the 192 plan would be, and with any
    score mod or a band."""
    monkeypatch.delenv("FLEXATTN_FWD_TILES", raising=False)

    def tiles(D, dtype=torch.bfloat16, Dv=None, **kw):
        q = torch.empty(2, 4, 1024, D, dtype=dtype).as_subclass(_OnGpu)
        v = torch.empty(2, 4, 1024, Dv or D, dtype=dtype).as_subclass(_OnGpu)
        spec = AttentionSpec.from_args(**kw)
        c = plan_forward(q, check_inputs(q, q, v, spec), spec).config
        return c.tile_m, c.tile_n

    for D in (16, 32):
        assert tiles(D) == tiles(D, mask=mods.causal()) == tiles(D, torch.float16) == (256, 80)
    assert tiles(32, Dv=64) == tiles(64) == tiles(64, mask=mods.causal()) == (256, 64)   # (on demand)
    assert tiles(80) == (192, 112)
    # light score mods (softcap, ALiBi, both; built-in or torch-style, a division by a
    # constant included) take the same tiles, causal or not ...
    slopes = torch.rand(4)
    light = [mods.softcap(20.0), mods.alibi(slopes), mods.alibi(slopes) >> mods.softcap(20.0)]
    for D, want in ((32, (256, 80)), (64, (256, 64))):
        for score in light:
            assert tiles(D, mask=mods.causal(), score=score) == tiles(D, score=score) == want, (D, score)
        assert tiles(D, mask=mods.causal(), score_mod=lambda s, b, h, q, kv: 30 * torch.tanh(s / 30)) == want
        assert tiles(D, score_mod=lambda s, b, h, q, kv: s + slopes[h] * (kv - q)) == want
    # ... heavier ones (a gather per element, or more operations) keep 128-row tiles, as
    # do bands and lists
    table = torch.randn(4, 2048)
    assert tiles(32, mask=mods.causal(), score_mod=lambda s, b, h, q, kv: s + table[h, kv - q + 1024])[0] == 128
    heavy = lambda s, b, h, q, kv: 30 * torch.tanh((s * slopes[h] + (kv - q) * 0.01 + ((kv * 3 + q) % 7) * 0.1) / 30) \
        + torch.exp((kv - q).abs() * 0.001)   # noqa: E731
    assert tiles(64, mask=mods.causal(), score_mod=heavy)[0] == 128
    # ... and so do mods with libdevice's slow paths (sin, cos, sqrt spill there in 3 operations)
    for fn in (torch.sin, torch.cos, torch.sqrt):
        assert tiles(64, score_mod=lambda s, b, h, q, kv, fn=fn: s + 0.5 * fn(s.abs()))[0] == 128, fn
    assert tiles(64, score_mod=lambda s, b, h, q, kv: s * torch.rsqrt(s.abs() + 1)) == (256, 64)   # (MUFU)
    # (integer // and % by other than powers of two: a multiply-high sequence per element)
    assert tiles(32, score_mod=lambda s, b, h, q, kv: s + ((kv - q) % 7) * 0.1)[0] == 128
    assert tiles(32, score_mod=lambda s, b, h, q, kv: s + ((kv - q) // 7) * 0.1)[0] == 128
    assert tiles(32, score_mod=lambda s, b, h, q, kv: s + ((kv - q) % 8) * 0.1) == (256, 80)    # (a mask)
    assert tiles(32, mask=mods.sliding_window(100))[0] == tiles(32, mask=mods.sliding_window(100), score=light[0])[0] == 128
    assert tiles(32, mask=mods.document(np.arange(1024) // 300), score=light[0])[0] == 128
    monkeypatch.setenv("FLEXATTN_MAXIMA_ON_DEMAND", "0")   # 256 x 64 needs the maxima on demand
    assert tiles(64) == (192, 128) and tiles(32) == (256, 80)
    monkeypatch.delenv("FLEXATTN_MAXIMA_ON_DEMAND")
    assert tiles(32, torch.float32)[0] != 256
    monkeypatch.setenv("FLEXATTN_FWD_TILES", "192x128")
    assert tiles(32, mask=mods.causal()) == (192, 128)
    monkeypatch.setenv("FLEXATTN_FWD_TILES", "256x64")
    assert tiles(64) == (256, 64)
    # (with a score mod too, for A/B runs; block lists keep their 128-row tiles)
    assert tiles(64, mask=mods.causal(), score=mods.softcap(20.0)) == (256, 64)
    assert tiles(64, mask=mods.sliding_window(100)) == (256, 64)
    assert tiles(64, mask=mods.document(np.arange(1024) // 300))[0] == 128
    monkeypatch.setenv("FLEXATTN_FWD_TILES", "256")
    with pytest.raises(ValueError, match="FLEXATTN_FWD_TILES must be MxN"):
        tiles(32)


def test_the_heaviest_light_score_mod_fits_four_warpgroups(on_gpu, monkeypatch):
    """A score mod of TALL_TILE_SCORE_OPS operations per element (ALiBi, softcap and a
    shift), as the door plans it at D32 causal (256 x 80) and D64 dense (256 x 64),
    compiles without a spill at the four consumer warpgroups' 112 registers."""
    from flexattn.core.kernel_path import TALL_TILE_SCORE_OPS
    from flexattn.kernels.emit.mod_emit import element_cost, fake_args
    from flexattn.kernels.launch.compile import compile_forward, resource_usage_from_ptx

    monkeypatch.delenv("FLEXATTN_FWD_TILES", raising=False)
    slopes = torch.rand(4)
    score = mods.score_mod(lambda s, b, h, q, kv: 20 * torch.tanh((s + slopes[h] * (kv - q)) / 20) - 0.25)
    assert element_cost(score).ops == TALL_TILE_SCORE_OPS
    # (cached by the IR object: the planner asks on every call)
    assert element_cost(score) is element_cost(score.with_captures(score.captures))
    for D, mask, tiles in ((32, mods.causal(), (256, 80)), (64, None, (256, 64))):
        q = torch.empty(2, 4, 1024, D, dtype=torch.bfloat16).as_subclass(_OnGpu)
        spec = AttentionSpec.from_args(score=score, mask=mask)
        cfg = plan_forward(q, check_inputs(q, q, q, spec), spec).config
        assert (cfg.tile_m, cfg.tile_n) == tiles
        usage = resource_usage_from_ptx(compile_forward(cfg, fake_args(cfg.mods), keep_ptx=True).__ptx__)
        if usage is None:
            pytest.skip("no ptxas on PATH")
        assert usage.spill_store_bytes == 0 and usage.spill_load_bytes == 0 and usage.stack_bytes == 0, (D, usage)


def test_own_diagonal_is_planned(on_gpu, monkeypatch):
    """Every forward plans own_diagonal (the kernel applies it where a causal tile's blocks
    can lie wholly right of a warpgroup's rows); FLEXATTN_OWN_DIAGONAL=0 walks whole tiles."""
    monkeypatch.delenv("FLEXATTN_OWN_DIAGONAL", raising=False)

    def config(D):
        return _gpu_config(mods.causal(), D)

    assert config(32).own_diagonal and (config(32).tile_m, config(32).tile_n) == (256, 80)
    monkeypatch.setenv("FLEXATTN_OWN_DIAGONAL", "0")
    assert not config(32).own_diagonal and not config(128).own_diagonal


def test_band_one_step_planned_for_bands(on_gpu, monkeypatch):
    """FwdConfig.band_one_step is planned for bands (not for other structures);
    FLEXATTN_BAND_ONE_STEP=0 plans the two loops, under a plan key of its own."""
    monkeypatch.delenv("FLEXATTN_BAND_ONE_STEP", raising=False)

    one_step = _gpu_config(mods.sliding_window(256))
    assert one_step.band and one_step.band_one_step
    assert not _gpu_config(mods.causal()).band_one_step
    monkeypatch.setenv("FLEXATTN_BAND_ONE_STEP", "0")
    two_loops = _gpu_config(mods.sliding_window(256))
    assert two_loops.band and not two_loops.band_one_step


def test_one_step_walk_planned_up_to_head_dim_64(on_gpu, monkeypatch):
    """FwdConfig.one_step_walk is planned for the dense and causal structures of 16-bit calls
    up to head dim 64 (H200: D32 0.969-0.985x the time, D128 causal 1.022x), under a plan key of
    its own; FLEXATTN_ONE_STEP_WALK=1 plans it at every head dim, =0 at none; never for bands,
    lists or float32."""
    monkeypatch.delenv("FLEXATTN_ONE_STEP_WALK", raising=False)
    for D in (32, 64):
        assert _gpu_config(mods.causal(), D=D).one_step_walk and _gpu_config(None, D=D).one_step_walk
    assert not _gpu_config(mods.causal()).one_step_walk and not _gpu_config(None).one_step_walk
    assert not _gpu_config(mods.causal(), D=96).one_step_walk
    assert not _gpu_config(mods.sliding_window(256), D=64).one_step_walk
    monkeypatch.setenv("FLEXATTN_ONE_STEP_WALK", "1")
    assert _gpu_config(mods.causal()).one_step_walk and _gpu_config(None).one_step_walk
    assert not _gpu_config(mods.sliding_window(256)).one_step_walk
    assert not _gpu_config(mods.document(torch.zeros(1024, dtype=torch.int32))).one_step_walk
    assert not _gpu_config(mods.causal(), dtype=torch.float32).one_step_walk
    monkeypatch.setenv("FLEXATTN_ONE_STEP_WALK", "0")
    assert not _gpu_config(mods.causal(), D=32).one_step_walk and not _gpu_config(None, D=64).one_step_walk


def test_maxima_on_demand_for_16_bit_calls_without_max_scores(on_gpu, monkeypatch):
    """maxima_on_demand is planned for 16-bit calls without max_scores, at every head dim and
    block structure and with score mods, with the threshold 8 it needs; not for float32 or
    max_scores; FLEXATTN_MAXIMA_ON_DEMAND=0 turns it off, FLEXATTN_RESCALE_THRESHOLD=0 too."""
    monkeypatch.delenv("FLEXATTN_RESCALE_THRESHOLD", raising=False)
    monkeypatch.delenv("FLEXATTN_MAXIMA_ON_DEMAND", raising=False)

    def config(D, dtype=torch.bfloat16, max_scores=False, **kw):
        q = torch.empty(2, 4, 1024, D, dtype=dtype).as_subclass(_OnGpu)
        spec = AttentionSpec.from_args(**(kw or dict(mask=mods.causal())))
        return plan_forward(q, check_inputs(q, q, q, spec), spec, max_scores=max_scores).config

    for D in (16, 32, 64, 96, 128, 192, 256):
        assert config(D).maxima_on_demand and config(D).rescale_threshold == 8.0, D
        assert config(D, torch.float16).maxima_on_demand
    for kw in (dict(), dict(mask=mods.sliding_window(100)), dict(mask=mods.document(np.arange(1024) // 300)),
               dict(mask=mods.causal(), score=mods.softcap(20.0))):
        assert config(64, **kw).maxima_on_demand and config(64, **kw).rescale_threshold == 8.0
    assert not config(64, torch.float32).maxima_on_demand
    assert not config(128, max_scores=True).maxima_on_demand
    assert config(64, max_scores=True).rescale_threshold == 0.0     # (64 columns: no lazy rescale)
    monkeypatch.setenv("FLEXATTN_MAXIMA_ON_DEMAND", "0")
    assert not config(64).maxima_on_demand and config(64).rescale_threshold == 0.0
    monkeypatch.delenv("FLEXATTN_MAXIMA_ON_DEMAND")
    monkeypatch.setenv("FLEXATTN_RESCALE_THRESHOLD", "0")
    assert not config(128).maxima_on_demand and config(128).rescale_threshold == 0.0


def test_early_o_rescale_needs_the_overlapped_schedule_without_promoted_pv():
    """`rescale_o_early` shrinks O between two GEMMs of the overlapped step; 3xTF32's
    promoted P V folds O its own way: both combinations are refused at construction."""
    from flexattn.kernels.fwd.sm90 import FwdConfig

    with pytest.raises(ValueError, match="rescale_o_early"):
        FwdConfig(head_dim=256, rescale_o_early=True, intra_wg_overlap=False)
    with pytest.raises(ValueError, match="rescale_o_early"):
        FwdConfig(dtype="fp32", tf32_passes=3, head_dim=128, tile_n=64, rescale_o_early=True)
    assert FwdConfig(head_dim=256, rescale_o_early=True).rescale_o_early


def test_tvm_ffi_forward_compiles_with_the_planned_signature():
    """The opt-in TVM-FFI launch (FLEXATTN_TVM_FFI=1): compiled on fake tensors, it checks
    its arguments itself — on a CPU tensor it must refuse with the compiled signature."""
    pytest.importorskip("tvm_ffi")
    from flexattn.kernels.launch.arguments import ffi_mod_args
    from flexattn.kernels.launch.forward import FfiForwardRunner

    # (two documents split inside a tile: a mask with no partial tile is left out of the kernel)
    p = _plan(mask=mods.document((np.arange(300) >= 100).astype(np.int32)), score=mods.softcap(30.0))
    runner = FfiForwardRunner(p.config)
    q = torch.zeros(2, 4, 300, 128, dtype=torch.bfloat16)
    lse = torch.zeros(2, 4, 300)
    bm = p.block_mask
    lists = tuple(torch.from_numpy(x.copy()) for x in (bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices))
    args = ffi_mod_args(p.config.mods, lambda x: torch.as_tensor(np.asarray(x)))
    assert [type(a) for a in args] == [float, float, torch.Tensor]
    with pytest.raises(ValueError, match="expected device_type=cuda") as err:
        runner.run(q, q, q, q, lse, 0.1, args, lists)
    assert "mod_args: Tuple[float32, float32, Tensor([n5], int32)]" in str(err.value)
    assert runner.num_compiled == 1


def test_block_list_validation_shared_by_both_runners():
    from flexattn.kernels.launch.forward import check_block_lists

    def lists(rows, cols=3, b=1, h=1):
        return (torch.zeros(b, h, rows, dtype=torch.int32), torch.zeros(b, h, rows, cols, dtype=torch.int32),
                torch.zeros(b, h, rows, dtype=torch.int32), torch.zeros(b, h, rows, cols, dtype=torch.int32))

    assert check_block_lists(None, False, 2, 4, 3, "kv", "q-blocks") is None
    assert len(check_block_lists(lists(3, b=2), True, 2, 4, 3, "kv", "q-blocks")) == 4
    with pytest.raises(ValueError, match="iff the config"):
        check_block_lists(lists(3), False, 2, 4, 3, "kv", "q-blocks")
    with pytest.raises(ValueError, match="3 q-blocks"):
        check_block_lists(lists(5), True, 2, 4, 3, "kv", "q-blocks")
    with pytest.raises(ValueError, match="int32"):
        check_block_lists(tuple(x.long() for x in lists(3)), True, 2, 4, 3, "kv", "q-blocks")
    with pytest.raises(ValueError, match="full_q_indices"):
        check_block_lists(lists(3)[:3], True, 2, 4, 3, "q", "kv blocks")


def test_a_mask_without_partial_tiles_is_left_out_of_the_kernel(monkeypatch):
    """Full tiles skip the mask (torch's rule too): a block mask with no partial tile plans
    its lists without the mask, so its kernel has no partial-tile walk (a faster first
    compile), and with the same results. Documents split inside a tile keep it; so does a
    GPU-built mask whose host copy has not landed (unknown: planned with the mask)."""
    on_tiles = mods.document(np.arange(512) // 256)       # boundaries on 128-token tiles
    inside = mods.document(np.arange(512) // 200)
    for mask, partial in ((on_tiles, False), (inside, True)):
        bm = create_block_mask(mask, 1, 1, 512, 512)
        assert bm.has_partial_tiles() is partial
        for p in (_plan(block_mask=bm, Q=512, KV=512), _plan(mask=mask, Q=512, KV=512)):
            assert p.config.block_sparse and p.config.mods.has_mask is partial
    # every visited tile listed partial (torch's separate_full_blocks=False): the mask stays
    listed = create_block_mask(on_tiles, 1, 1, 512, 512, separate_full_blocks=False)
    assert listed.has_partial_tiles() is True
    assert _plan(block_mask=listed, Q=512, KV=512).config.partial_blocks
    # torch-style lists whose mask_mod is never evaluated: the same kernel as no mask_mod
    bm = create_block_mask(on_tiles, 1, 1, 512, 512)
    plain = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices)
    assert _plan(block_mask=bm, Q=512, KV=512).config == _plan(block_mask=plain, Q=512, KV=512).config
    # not known yet (a GPU-built mask's copies in flight): the mask stays
    pending = create_block_mask(on_tiles, 1, 1, 512, 512)
    pending._device_states = pending._states
    pending._states, pending._states_copy, pending._row_counts = None, (lambda: None), None
    assert pending.has_partial_tiles() is None
    assert _plan(block_mask=pending, Q=512, KV=512).config.mods.has_mask
    # known from the per-row counts' copies (partial, full) of a mask too big to copy whole
    counted = create_block_mask(inside, 1, 1, 512, 512)
    counted._device_states = counted._states
    counted._states, counted._states_copy = None, None
    counted._row_counts = (lambda: np.zeros((1, 1, 4), np.int32), lambda: np.ones((1, 1, 4), np.int32))
    assert counted.has_partial_tiles() is False
    # the backward walks the full list alone too (FLEXATTN_BWD_FULL_ONLY=0: both, an A/B);
    # FLEXATTN_FULL_ONLY=0 plans both lists and the mask again
    from flexattn.kernels.bwd.plan import config_from_forward
    full_only = _plan(block_mask=create_block_mask(on_tiles, 1, 1, 512, 512), Q=512, KV=512).config
    assert not full_only.partial_blocks and not config_from_forward(full_only).partial_blocks
    assert config_from_forward(_plan(block_mask=listed, Q=512, KV=512).config).partial_blocks
    monkeypatch.setenv("FLEXATTN_BWD_FULL_ONLY", "0")
    assert config_from_forward(full_only).partial_blocks
    monkeypatch.delenv("FLEXATTN_BWD_FULL_ONLY")
    monkeypatch.setenv("FLEXATTN_FULL_ONLY", "0")
    again = _plan(block_mask=create_block_mask(on_tiles, 1, 1, 512, 512), Q=512, KV=512).config
    assert again.partial_blocks and again.mods.has_mask and config_from_forward(again).partial_blocks


def test_block_masks_built_for_immutable_masks_are_reused():
    a = _plan(mask=mods.sliding_window(64)).block_mask
    b = _plan(mask=mods.sliding_window(64)).block_mask  # a new mod object, same values
    assert a is b
    assert _plan(mask=mods.sliding_window(65)).block_mask is not a
    assert _plan(mask=mods.sliding_window(64), Q=301, KV=301).block_mask is not a
    ids = torch.zeros(300, dtype=torch.int32)  # a tensor may change in place: rebuilt each call
    m = mods.document(ids)
    assert _plan(mask=m).block_mask is not _plan(mask=m).block_mask


def test_plans_are_cached_by_structure_but_carry_each_calls_captures():
    """A second call with the same mods but new captured values reuses the cached plan
    (same config object underneath, no re-hashing) and its hook holds the *new* values."""
    from flexattn.core import kernel_path

    table_a, table_b = np.zeros((4, 9), np.float32), np.ones((4, 9), np.float32)
    score_a = mods.relative_bias(table_a)
    slot = next(i for i, c in enumerate(score_a.captures) if c is table_a)
    caps = list(score_a.captures)
    caps[slot] = table_b
    score_b = score_a.with_captures(tuple(caps))
    p_a, p_b = _plan(score=score_a), _plan(score=score_b)
    assert p_a.entry is p_b.entry and p_a.config.key() == p_b.config.key()
    assert p_a.config.mods.captures()[slot] is table_a and p_b.config.mods.captures()[slot] is table_b
    assert p_b.config.mods.capture_kinds == p_a.entry.kinds
    assert p_b.config.mods.derivative is p_a.config.mods.derivative  # differentiated once
    # A different structure (here: head dim) is another plan.
    assert _plan(D=64, score=score_a).entry is not p_a.entry
    # Equal IR built separately: another cache entry, the same compiled runner key.
    p_c = _plan(score=mods.relative_bias(table_a))
    assert p_c.config.key() == p_a.config.key()
    assert kernel_path._runner(p_c, False) is kernel_path._runner(p_a, False)


def test_launch_path_choice(monkeypatch):
    from flexattn.core.kernel_path import use_tvm_ffi

    monkeypatch.setenv("FLEXATTN_TVM_FFI", "0")
    assert not use_tvm_ffi()
    monkeypatch.setenv("FLEXATTN_TVM_FFI", "1")
    assert use_tvm_ffi()
    monkeypatch.delenv("FLEXATTN_TVM_FFI")
    import importlib.util

    from flexattn.core.kernel_path import Device

    assert use_tvm_ffi() == (importlib.util.find_spec("tvm_ffi") is not None)
    # Only where TVM-FFI's environment stream is the caller's stream (torch).
    assert not use_tvm_ffi(Device(0, lambda x: x))
    assert use_tvm_ffi(Device(0, lambda x: x, tvm_ffi_stream=True)) == use_tvm_ffi()


def test_tile_scheduling_by_structure(on_gpu, monkeypatch):
    """Dense tiles all cost the same: persistent CTAs, one per SM; so do block-sparse rows
    of about equal work (host lists within BALANCED_TILES of the mean; bands, read without
    lists, within BALANCED_BAND_TILES); causal and
    unbalanced block-sparse keep one CTA per tile (causal in longest-first order)."""
    q = torch.empty(2, 4, 300, 128, dtype=torch.bfloat16).as_subclass(_OnGpu)
    for kw, ctas, order in (({}, 132, "by_head"), ({"mask": mods.causal()}, 0, "longest_first"),
                            # rows visit 1, 2, 2 tiles: 1.2x the mean
                            ({"mask": mods.sliding_window(64)}, 132, "by_head"),
                            # rows visit 1, 2, 3 tiles: 1.5x, within a band's BALANCED_BAND_TILES
                            ({"mask": mods.sliding_window(200)}, 132, "by_head"),
                            # the same rows through a document mask's lists: one CTA per tile
                            ({"mask": mods.sliding_window(200) & mods.document(np.zeros(300, np.int32))},
                             0, "by_head"),
                            # rows visit 0, 1, 2 tiles: 2x the mean
                            ({"mask": mods.causal(offset=-128)}, 0, "by_head")):
        spec = AttentionSpec.from_args(**kw)
        cfg = plan_forward(q, check_inputs(q, q, q, spec), spec).config
        assert (cfg.max_ctas, cfg.tile_order) == (ctas, order), kw
        # bands' persistent CTAs walk in a snake (measured: issue 24); nothing else does
        assert cfg.snake == (cfg.band and ctas > 0) and not cfg.tile_tickets, kw
    assert _plan().config.max_ctas == 0   # a CPU array: nothing to query
    # From two rounds of 128-row tiles (264 on 132 SMs) a band's CTAs take tiles by tickets
    # instead; so do causal calls at head dims up to 96, and at 128 with at most 16 q tiles
    # per head (persistent, no clusters, longest first); dense calls never.
    for S, B, kw, tickets in ((4096, 2, {"mask": mods.sliding_window(1024)}, True),     # 512 tiles
                              (2048, 1, {"mask": mods.sliding_window(1024)}, False),    # 64 tiles
                              (4096, 2, {}, False), (4096, 2, {"mask": mods.causal()}, False),
                              (2048, 8, {"mask": mods.causal()}, True),                # 16 tiles per head
                              (2048, 1, {"mask": mods.causal()}, False)):              # 256 tiles
        big = torch.empty(B, 16, S, 128, dtype=torch.bfloat16).as_subclass(_OnGpu)
        spec = AttentionSpec.from_args(**kw)
        cfg = plan_forward(big, check_inputs(big, big, big, spec), spec).config
        assert (cfg.tile_tickets, cfg.snake) == (tickets, bool(cfg.band) and not tickets), (S, B, kw)
        if cfg.causal:
            assert (cfg.max_ctas, cfg.cluster_m) == ((132, 1) if tickets else (0, 2)), (S, B)
            assert cfg.tile_order == "longest_first"
    for S, B, D, Dv, tickets in ((4096, 4, 64, 64, True), (4096, 4, 96, 96, True), (8192, 2, 32, 32, True),
                                 (4096, 4, 64, 128, False),     # 128-wide values: not measured
                                 (4096, 4, 192, 128, False), (512, 2, 64, 64, False)):   # 64 tiles
        q = torch.empty(B, 16, S, D, dtype=torch.bfloat16).as_subclass(_OnGpu)
        v = torch.empty(B, 16, S, Dv, dtype=torch.bfloat16).as_subclass(_OnGpu)
        spec = AttentionSpec.from_args(mask=mods.causal())
        cfg = plan_forward(q, check_inputs(q, q, v, spec), spec).config
        assert (cfg.tile_tickets, cfg.max_ctas > 0) == (tickets, tickets), (S, B, D, Dv)
    # FLEXATTN_TILE_TICKETS: 1 plans tickets (as auto does here), 0 no tickets at all
    # (causal then keeps one CTA per tile, in clusters at 128)
    for flag, want in (("1", True), ("0", False)):
        monkeypatch.setenv("FLEXATTN_TILE_TICKETS", flag)
        for D, S, B in ((64, 4096, 4), (128, 2048, 8)):
            q = torch.empty(B, 16, S, D, dtype=torch.bfloat16).as_subclass(_OnGpu)
            spec = AttentionSpec.from_args(mask=mods.causal())
            cfg = plan_forward(q, check_inputs(q, q, q, spec), spec).config
            assert cfg.tile_tickets == want and (cfg.max_ctas > 0) == want, (flag, D)



def test_documents_on_pair_boundaries_run_clusters(on_gpu, monkeypatch):
    """Block lists whose row pairs match (documents on 256-token boundaries) run clusters
    of two CTAs sharing K/V loads, as dense calls do at head dim 128; a boundary inside a
    pair, head dim 64 or FLEXATTN_LIST_CLUSTERS=0 keep one CTA per tile (persistent)."""
    def cfg(ids, D=128, S=2048):
        q = torch.empty(2, 16, S, D, dtype=torch.bfloat16).as_subclass(_OnGpu)
        bm = create_block_mask(mods.document(ids), None, None, S, S)
        spec = AttentionSpec.from_args(block_mask=bm)
        return plan_forward(q, check_inputs(q, q, q, spec), spec).config

    aligned, split = np.arange(2048) * 4 // 2048, np.arange(2048) * 16 // 2048   # 512- / 128-token docs
    for ids, D, want in ((aligned, 128, 2), (split, 128, 1), (aligned, 64, 1)):
        c = cfg(ids, D)
        assert c.block_sparse and (c.cluster_m, c.max_ctas) == (want, 120 if want == 2 else 132), (D, want)
    monkeypatch.setenv("FLEXATTN_LIST_CLUSTERS", "0")
    assert cfg(aligned).cluster_m == 1


def test_backward_runs_persistent_ctas_over_even_short_document_columns(on_gpu, monkeypatch):
    """The backward walks kv-block columns: persistent CTAs where block lists (not bands) at
    head dim 128 give every column the same, short work (documents: measured faster),
    one CTA per kv tile elsewhere (dense, causal, windows, long or uneven columns, other
    head dims, float32, a shared GPU); FLEXATTN_BWD_PERSISTENT=1 / 0 forces either way."""
    from flexattn.core.kernel_path import gpu_shared

    def ctas(mask=None, S=4096, D=128, Dv=None, dtype=torch.bfloat16, **kw):
        q = torch.empty(2, 16, S, D, dtype=dtype).as_subclass(_OnGpu)
        v = torch.empty(2, 16, S, Dv or D, dtype=dtype).as_subclass(_OnGpu)
        spec = AttentionSpec.from_args(mask=mask, **kw)
        return plan_forward(q, check_inputs(q, q, v, spec), spec).backward_ctas

    docs4 = np.arange(4096) * 4 // 4096                       # 8 q blocks per column
    assert ctas(mods.document(docs4)) == 132
    assert ctas(block_mask=create_block_mask(lambda b, h, q, kv: docs4[q] == docs4[kv], None, None, 4096, 4096)) == 132
    assert ctas(mods.document(np.arange(2048) * 4 // 2048), S=2048) == 132    # 4 per column
    assert ctas(mods.document(np.arange(8192) * 4 // 8192), S=8192) == 0      # 16 per column
    uneven = np.repeat(np.arange(5), [512, 512, 1024, 1024, 1024])
    assert ctas(mods.document(uneven)) == 0                                   # columns of 4 and 8: 1.14x the mean
    assert ctas(mods.document(docs4) & mods.causal()) == 0                    # columns of 1..8 tiles
    assert ctas() == ctas(mods.causal()) == ctas(mods.sliding_window(1024)) == 0
    assert ctas(mods.document(docs4), D=64) == ctas(mods.document(docs4), D=128, Dv=64) == 0
    assert ctas(mods.document(docs4), dtype=torch.float32) == 0
    with gpu_shared():
        assert ctas(mods.document(docs4)) == 0
    monkeypatch.setenv("FLEXATTN_BWD_PERSISTENT", "0")
    assert ctas(mods.document(docs4)) == 0
    monkeypatch.setenv("FLEXATTN_BWD_PERSISTENT", "1")
    assert ctas() == ctas(mods.sliding_window(1024)) == 132
    assert _plan().backward_ctas == 0     # a CPU array: nothing to query


def test_a_shared_gpu_gets_one_cta_per_tile(on_gpu):
    """Inside ``gpu_shared()`` (context parallelism's launches, NCCL beside them) the
    structures that run persistent CTAs elsewhere run one CTA per tile; outside it, and in
    another thread while one thread is inside, nothing changes."""
    import threading

    from flexattn.core.kernel_path import gpu_shared

    q = torch.empty(2, 4, 300, 128, dtype=torch.bfloat16).as_subclass(_OnGpu)

    def ctas(**kw):
        spec = AttentionSpec.from_args(**kw)
        return plan_forward(q, check_inputs(q, q, q, spec), spec).config.max_ctas

    assert ctas() == 132 and ctas(mask=mods.sliding_window(64)) == 132
    other = []
    with gpu_shared():
        assert ctas() == 0 and ctas(mask=mods.sliding_window(64)) == 0
        thread = threading.Thread(target=lambda: other.append(ctas()))
        thread.start()
        thread.join()
    assert other == [132]
    assert ctas() == 132

def test_dense_head_dim_128_with_even_q_tiles_runs_clusters(on_gpu):
    """Dense and causal attention at head dim 128 pair the CTAs of adjacent q tiles into
    clusters sharing K/V loads, when every head has an even number of q tiles (block-sparse
    lists and bands differ per tile: never); persistent clusters are as many as the driver says fit
    at once (not SMs / 2: clusters live inside a GPC)."""
    def plan(S, D=128, **kw):
        q = torch.empty(2, 4, S, D, dtype=torch.bfloat16).as_subclass(_OnGpu)
        spec = AttentionSpec.from_args(**kw)
        return plan_forward(q, check_inputs(q, q, q, spec), spec).config

    for S, D, kw, cluster, ctas in ((256, 128, {}, 2, 120), (4096, 128, {"score": mods.softcap(30.0)}, 2, 120),
                                    (300, 128, {}, 1, 132),           # 3 q tiles per head
                                    (256, 64, {}, 1, 132),            # head dim 64: not measured a gain
                                    (256, 128, {"mask": mods.causal()}, 2, 0),   # one CTA per tile
                                    (300, 128, {"mask": mods.causal()}, 1, 0),
                                    # a band (no clusters): rows of 1 and 2 tiles, persistent
                                    (256, 128, {"mask": mods.sliding_window(64)}, 1, 132)):
        cfg = plan(S, D, **kw)
        assert (cfg.cluster_m, cfg.max_ctas) == (cluster, ctas), (S, D, kw)
    cpu = _plan(Q=256).config
    assert (cpu.cluster_m, cpu.max_ctas) == (2, 0)   # a CPU array: clusters, no persistence


@pytest.mark.parametrize("private_setter", [True, False])
def test_env_stream_swap_sets_and_restores_tvm_ffi_stream(monkeypatch, private_setter):
    """PreparedForward.launch with a caller's stream (CuPy): TVM-FFI's environment stream
    is that stream during the launch and the previous one after it, also when the launch
    raises; the same through the public API where TVM-FFI's setter is not there."""
    tvm_ffi = pytest.importorskip("tvm_ffi")
    from flexattn.core.kernel_path import CaptureArgs, EnvStream, PreparedForward

    device = tvm_ffi.device("cuda", 0)      # the stream table needs no GPU
    env = EnvStream(device)
    if not private_setter:
        env._set = None
    seen = []

    def fake_kernel(*args):
        seen.append(tvm_ffi.get_raw_stream(device))
        if args[-2] == "boom":   # (..., block lists, max_scores)
            raise RuntimeError("launch failed")

    prepared = PreparedForward.__new__(PreparedForward)    # launch only: no compile
    prepared._fn, prepared._scale, prepared._env_stream = fake_kernel, 0.125, env
    prepared._args = CaptureArgs((), lambda: None)
    before = tvm_ffi.get_raw_stream(device)
    prepared._lists, prepared._tickets = None, None
    prepared.launch("q", "k", "v", "out", "lse", stream=0xBEEF)
    prepared._lists = "boom"
    with pytest.raises(RuntimeError, match="launch failed"):
        prepared.launch("q", "k", "v", "out", "lse", stream=0xCAFE)
    assert seen == [0xBEEF, 0xCAFE] and tvm_ffi.get_raw_stream(device) == before


def test_prepared_launch_arguments_become_tvm_ffi_tensors():
    """Fixed launch arguments (block lists, frozen captures) are converted to TVM-FFI's own
    tensors once: TVM-FFI passes those through, where a framework array would be exchanged
    over DLPack at every launch (CuPy: ~4 µs per list, bench_overhead)."""
    tvm_ffi = pytest.importorskip("tvm_ffi")
    from flexattn.core.kernel_path import ffi_tensors

    lists = (np.arange(4, dtype=np.int32), None, 3, 0.5)
    out = ffi_tensors(lists)
    assert isinstance(out[0], tvm_ffi.Tensor) and tuple(out[0].shape) == (4,)
    assert out[1:] == (None, 3, 0.5)
    assert ffi_tensors(None) is None


def test_cached_plans_keep_the_ir_their_keys_name_alive():
    """Plans are keyed by the ids of the mods' IR as given; the optimizing pass may hand the
    hook other objects, so the cached template must hold the given ones, or a dead IR's
    id could be reused by another mod's and hit a plan of another structure."""
    import gc
    from flexattn.core.kernel_path import _PLANS

    for i in range(20):   # fresh structures: each a new IR whose optimized form is another object
        _plan(score=mods.score_mod(lambda s, b, h, q, kv, i=i: s / (3.0 + i)))
    gc.collect()
    for key, entry in _PLANS.items():
        held = {id(e) for e in entry.config.mods._sources}
        for ident in key[-2:]:
            assert ident is None or ident in held


@pytest.mark.parametrize("kv, aligned", [(1024, True), (1000, False), (640, True)])
def test_kv_len_on_tile_boundaries_plans_the_aligned_walk(kv, aligned):
    """KV_LEN a multiple of 128: no full block straddles it, so the kernel skips that
    run-time test (FwdConfig.kv_aligned); any other length keeps it."""
    window = mods.sliding_window(256)
    for kw in (dict(mask=window), dict(block_mask=create_block_mask(window, None, None, 1024, kv))):
        assert _plan(Q=1024, KV=kv, **kw).config.kv_aligned is aligned


def test_a_kv_aligned_kernel_refuses_a_ragged_kv_len():
    from flexattn.kernels.fwd.sm90 import FwdConfig
    from flexattn.kernels.launch.forward import _check_kv_aligned

    cfg = FwdConfig(head_dim=128, block_sparse=True, kv_aligned=True)
    _check_kv_aligned(cfg, 1024)
    with pytest.raises(ValueError, match="multiple of tile_n 128"):
        _check_kv_aligned(cfg, 1000)


def test_forward_plans_hoisted_tile_reads():
    """``FwdConfig.hoist_tile_reads`` where the mods read something at kv // P with P a
    multiple of the tile (a converted PagedAttention mask's page map); never for mods
    without such reads (their kernels stay as they were)."""
    page_map = torch.zeros(2, 8, dtype=torch.int64)
    paged = mods.mask_mod(lambda b, h, q, kv: page_map[b, kv // 128] * 128 + kv % 128 <= q)
    assert _plan(Q=1024, KV=1024, block_mask=create_block_mask(paged, 2, 1, 1024, 1024)).config.hoist_tile_reads
    assert not _plan(Q=1024, KV=1024, block_mask=create_block_mask(mods.causal(), 2, 1, 1024, 1024)).config.hoist_tile_reads
