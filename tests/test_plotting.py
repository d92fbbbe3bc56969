"""flexattn.plotting: the pictures show the mask and its tiles, on the Agg backend."""

import sys

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

import flexattn  # noqa: E402
from flexattn import mods, plotting  # noqa: E402
from flexattn.blockmask import EMPTY, FULL, PARTIAL  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def naive_dense(fn, Q, KV, b=0, h=0):
    return np.array([[bool(fn(b, h, q, kv)) for kv in range(KV)] for q in range(Q)])


def test_dense_mask_matches_python_evaluation():
    mask = mods.causal() & mods.sliding_window(5)
    want = naive_dense(lambda b, h, q, kv: q >= kv and q - kv <= 5, 37, 41)
    np.testing.assert_array_equal(plotting.dense_mask(mask, 37, 41), want)
    # a plain function works too, and full() (a constant) broadcasts to the whole grid
    np.testing.assert_array_equal(plotting.dense_mask(lambda b, h, q, kv: q >= kv, 37, 41), np.tril(np.ones((37, 41), bool)))
    assert plotting.dense_mask(mods.full(), 3, 4).shape == (3, 4)


def test_plot_mask_pixels_are_the_mask():
    mask = mods.causal() & mods.document_from_lengths([20, 13])
    ax = plotting.plot_mask(mask, 33, 33)
    image = np.asarray(ax.images[0].get_array())
    np.testing.assert_array_equal(image.astype(bool), plotting.dense_mask(mask, 33, 33))
    assert image.shape == (33, 33)
    want = 100 * plotting.dense_mask(mask, 33, 33).mean()
    assert f"{want:.1f}% of pairs attended" in ax.get_title()
    assert "causal & document" in ax.get_title()


def test_plot_mask_rendered_colours_follow_the_mask():
    """Render with Agg and sample the centre of every element: dark where attended."""
    S = 16
    fig = plt.figure(figsize=(2, 2), dpi=S * 8)
    ax = fig.add_axes((0, 0, 1, 1))
    plotting.plot_mask(mods.causal(), S, S, ax=ax)
    ax.set_axis_off()
    fig.canvas.draw()
    rgba = np.asarray(fig.canvas.buffer_rgba())  # [rows, cols, 4]
    step = rgba.shape[0] / S
    centres = ((np.arange(S) + 0.5) * step).astype(int)
    dark = rgba[np.ix_(centres, centres)][..., :3].mean(-1) < 128
    np.testing.assert_array_equal(dark, np.tril(np.ones((S, S), bool)))


def test_plot_mask_uses_b_and_h():
    per_head = mods.mask_mod(lambda b, h, q_idx, kv_idx: q_idx - kv_idx == h)
    ax = plotting.plot_mask(per_head, 8, 8, h=3)
    np.testing.assert_array_equal(np.asarray(ax.images[0].get_array()).astype(bool), np.eye(8, k=-3, dtype=bool))


def test_plot_block_mask_shows_states_legend_and_sparsity():
    bm = flexattn.create_block_mask(mods.causal(), None, None, 256, 256, BLOCK_SIZE=64)
    ax = plotting.plot_block_mask(bm)
    image = np.asarray(ax.images[0].get_array())
    np.testing.assert_array_equal(image, bm.block_states()[0, 0])
    assert set(np.unique(image)) == {EMPTY, PARTIAL, FULL}
    assert f"sparsity {bm.sparsity():.2f}%" in ax.get_title()  # 37.50%
    assert "64x64" in ax.get_title()
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert labels == ["empty: 6", "partial: 4", "full: 6"]
    assert ax.get_xlim() == (0, 256) and ax.get_ylim() == (256, 0)


def test_plot_block_mask_slices_batch_and_head():
    lengths = np.array([[64, 192], [128, 128]])
    doc = np.stack([np.repeat(np.arange(2), n) for n in lengths])
    mask = mods.document(doc) & mods.mask_mod(lambda b, h, q_idx, kv_idx: (h == 0) | (q_idx >= kv_idx))
    bm = flexattn.create_block_mask(mask, 2, 2, 256, 256, BLOCK_SIZE=64)
    for b in range(2):
        for h in range(2):
            ax = plotting.plot_block_mask(bm, b, h)
            np.testing.assert_array_equal(ax.images[0].get_array(), bm.block_states()[b, h])
            states = bm.block_states()[b, h]
            assert f"(b={b}, h={h})" in ax.get_title()
            assert f"sparsity {100 * np.mean(states == EMPTY):.2f}%" in ax.get_title()
    with pytest.raises(IndexError, match="h=2"):
        plotting.plot_block_mask(bm, 0, 2)
    # stored once for every head: any h shows the shared tiles
    shared = flexattn.create_block_mask(mods.causal(), None, None, 128, 128, BLOCK_SIZE=64)
    np.testing.assert_array_equal(plotting.plot_block_mask(shared, 1, 5).images[0].get_array(), shared.block_states()[0, 0])


def test_plot_mask_and_blocks_side_by_side():
    mask = mods.sliding_window(100, 100)
    fig = plotting.plot_mask_and_blocks(mask, 300, 260, BLOCK_SIZE=(64, 32))
    left, right = fig.axes[:2]
    np.testing.assert_array_equal(np.asarray(left.images[0].get_array()).astype(bool), plotting.dense_mask(mask, 300, 260))
    bm = flexattn.create_block_mask(mask, None, None, 300, 260, BLOCK_SIZE=(64, 32))
    np.testing.assert_array_equal(right.images[0].get_array(), bm.block_states()[0, 0])
    assert f"sparsity {bm.sparsity():.2f}%" in right.get_title()
    assert isinstance(fig, matplotlib.figure.Figure)
    fig.canvas.draw()  # renders without a display


def test_plot_mask_and_blocks_for_a_per_batch_mask_shows_that_batch():
    prefix = np.array([16, 48], dtype=np.int32)
    mask = mods.prefix_lm(prefix)
    fig = plotting.plot_mask_and_blocks(mask, 64, 64, BLOCK_SIZE=16, b=1)
    left, right = fig.axes[:2]
    want = plotting.dense_mask(mask, 64, 64, b=1)
    assert want[:, :48].all() and not want[0, 48:].any()
    np.testing.assert_array_equal(np.asarray(left.images[0].get_array()).astype(bool), want)
    bm = flexattn.create_block_mask(mask, 2, None, 64, 64, BLOCK_SIZE=16)
    np.testing.assert_array_equal(right.images[0].get_array(), bm.block_states()[1, 0])


def test_errors():
    with pytest.raises(TypeError, match="BlockMask"):
        plotting.plot_block_mask(mods.causal())
    with pytest.raises(ValueError, match="too large"):
        plotting.dense_mask(mods.causal(), 1 << 14, 1 << 14)
    with pytest.raises(ValueError, match="Q_LEN"):
        plotting.plot_mask(mods.causal(), 0, 4)
    bm = flexattn.create_block_mask(mods.causal(), None, None, 64, 64, BLOCK_SIZE=16)
    with pytest.raises(ValueError, match="built for"):
        plotting.plot_mask_and_blocks(mods.causal(), 32, 32, block_mask=bm)


def test_missing_matplotlib_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install 'flexattn\[notebooks\]'"):
        plotting.plot_mask(mods.causal(), 4, 4)
    with pytest.raises(ImportError, match=r"flexattn\[notebooks\]"):
        plotting.plot_mask_and_blocks(mods.causal(), 4, 4)
