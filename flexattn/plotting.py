"""Pictures of masks and block masks (matplotlib, an optional dependency).

    from flexattn.plotting import plot_mask_and_blocks
    fig = plot_mask_and_blocks(mods.causal() & mods.sliding_window(256), 1024, 1024)
    fig.savefig("mask.png")

Every function draws into an ``ax`` you pass or into a new figure, and returns the axes
(or the figure); nothing calls ``plt.show()``, so the Agg backend (scripts, CI) and the
notebook inline backend both work. matplotlib is imported on first use:
``pip install 'flexattn[notebooks]'``.
"""

from __future__ import annotations

import numpy as np

from .blockmask import EMPTY, FULL, PARTIAL, BlockMask, create_block_mask
from .mods import as_mask

__all__ = ["dense_mask", "plot_mask", "plot_block_mask", "plot_mask_and_blocks"]

# Element picture: masked / attended. Tile picture: empty / partial / full.
MASK_COLORS = ("#f2f2f2", "#1f4e99")
TILE_COLORS = {EMPTY: "#f2f2f2", PARTIAL: "#9ecae1", FULL: "#1f4e99"}
TILE_NAMES = {EMPTY: "empty", PARTIAL: "partial", FULL: "full"}
MAX_ELEMENTS = 1 << 26  # largest element picture (64 Mi pairs); beyond it, plot the block mask


def _pyplot():
    """matplotlib.pyplot, or an ImportError that says how to install it."""
    try:
        import matplotlib  # noqa: F401
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(
            "flexattn.plotting needs matplotlib; install it with: pip install 'flexattn[notebooks]'"
        ) from e
    return plt


def _axes(ax, figsize):
    if ax is not None:
        return ax
    _, ax = _pyplot().subplots(figsize=figsize)
    return ax


def dense_mask(mask, Q_LEN: int, KV_LEN: int, b: int = 0, h: int = 0) -> np.ndarray:
    """The element mask of one (batch, head) as a [Q_LEN, KV_LEN] numpy bool array.

    ``mask`` is a ``MaskMod`` or a function ``(b, h, q_idx, kv_idx) -> bool``.
    """
    mask = as_mask(mask, "mask")
    for name, v in (("Q_LEN", Q_LEN), ("KV_LEN", KV_LEN)):
        if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if Q_LEN * KV_LEN > MAX_ELEMENTS:
        raise ValueError(
            f"a {Q_LEN}x{KV_LEN} element picture is too large ({Q_LEN * KV_LEN} pairs > {MAX_ELEMENTS});"
            " plot a shorter sequence, or the tiles with plot_block_mask"
        )
    q = np.arange(Q_LEN)[:, None]
    kv = np.arange(KV_LEN)[None, :]
    return np.broadcast_to(np.asarray(mask(b, h, q, kv), dtype=bool), (Q_LEN, KV_LEN)).copy()


def plot_mask(mask, Q_LEN: int, KV_LEN: int, b: int = 0, h: int = 0, ax=None, *, title: str | None = None):
    """Draw the element mask of (``b``, ``h``): dark where query ``q_idx`` (row) attends to
    key ``kv_idx`` (column). The title gives the mask's name and the share of pairs attended.
    Returns the axes; ``ax.images[0].get_array()`` is the dense mask (0/1)."""
    _pyplot()  # a clear ImportError first
    from matplotlib.colors import ListedColormap

    dense = dense_mask(mask, Q_LEN, KV_LEN, b, h)
    ax = _axes(ax, (4.6, 4.6))
    # antialiased in colour space: a downscaled picture keeps thin lines (dilated windows)
    # as light strokes instead of dropping them; small masks upscale as sharp squares
    ax.imshow(dense.astype(np.uint8), cmap=ListedColormap(MASK_COLORS), vmin=0, vmax=1,
              interpolation="antialiased", interpolation_stage="rgba", extent=(0, KV_LEN, Q_LEN, 0))
    ax.set_xlabel("kv_idx")
    ax.set_ylabel("q_idx")
    if title is None:
        name = as_mask(mask, "mask").name or "custom mask"
        title = f"{name}\n{100 * dense.mean():.1f}% of pairs attended"
    ax.set_title(title, fontsize=10)
    return ax


def _slice(states: np.ndarray, b: int, h: int) -> np.ndarray:
    """Tile states of (b, h); a block mask stored once for every batch/head broadcasts."""
    B, H = states.shape[:2]
    for name, i, n in (("b", b, B), ("h", h, H)):
        if not isinstance(i, (int, np.integer)) or i < 0:
            raise ValueError(f"{name} must be a non-negative int, got {i!r}")
        if n > 1 and i >= n:
            raise IndexError(f"{name}={i} is out of range: the block mask has {n} along that dim")
    return states[b if B > 1 else 0, h if H > 1 else 0]


def plot_block_mask(block_mask: BlockMask, b: int = 0, h: int = 0, ax=None, *, title: str | None = None):
    """Draw the tiles of (``b``, ``h``): empty (skipped), partial (mask evaluated per element)
    and full (computed without the mask), with a legend counting each; the title gives the block size and
    the sparsity (percentage of tiles skipped). Tiles sit at their element coordinates, so the
    picture lines up with ``plot_mask``. Returns the axes; ``ax.images[0].get_array()`` holds
    the tile states (0 empty, 1 partial, 2 full)."""
    _pyplot()
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.patches import Patch

    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a flexattn BlockMask, got {type(block_mask).__name__}")
    states = _slice(block_mask.block_states(), b, h)
    Q_LEN, KV_LEN = block_mask.seq_lengths
    qb, kvb = block_mask.BLOCK_SIZE
    nq, nkv = states.shape
    ax = _axes(ax, (4.6, 4.6))
    cmap = ListedColormap([TILE_COLORS[s] for s in (EMPTY, PARTIAL, FULL)])
    ax.imshow(states, cmap=cmap, norm=BoundaryNorm([-0.5, 0.5, 1.5, 2.5], 3), interpolation="nearest",
              extent=(0, nkv * kvb, nq * qb, 0))
    ax.set_xlim(0, KV_LEN)
    ax.set_ylim(Q_LEN, 0)
    if nq <= 64 and nkv <= 64:  # tile borders, while they stay readable
        ax.set_xticks(np.arange(1, nkv) * kvb, minor=True)
        ax.set_yticks(np.arange(1, nq) * qb, minor=True)
        ax.grid(which="minor", color="white", linewidth=0.6)
        ax.tick_params(which="minor", length=0)
    ax.set_xlabel("kv_idx")
    ax.set_ylabel("q_idx")
    counts = {s: int((states == s).sum()) for s in (EMPTY, PARTIAL, FULL)}
    ax.legend(handles=[Patch(facecolor=TILE_COLORS[s], edgecolor="0.6", label=f"{TILE_NAMES[s]}: {counts[s]}")
                       for s in (EMPTY, PARTIAL, FULL)],
              loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3, fontsize=8, frameon=False,
              handlelength=1.2, columnspacing=1.0)
    if title is None:
        sparsity = 100.0 * counts[EMPTY] / states.size
        where = f" (b={b}, h={h})" if block_mask.shape[0] * block_mask.shape[1] > 1 else ""
        title = f"tiles {qb}x{kvb}{where}\nsparsity {sparsity:.2f}% of tiles skipped"
    ax.set_title(title, fontsize=10)
    return ax


def plot_mask_and_blocks(mask, Q_LEN: int, KV_LEN: int, BLOCK_SIZE=128, *, B: int | None = None,
                         H: int | None = None, b: int = 0, h: int = 0, block_mask: BlockMask | None = None,
                         figsize=(9.5, 5.0)):
    """Element mask (left) and its block mask (right) side by side; returns the figure.

    The block mask is built with ``create_block_mask(mask, B, H, Q_LEN, KV_LEN,
    BLOCK_SIZE=BLOCK_SIZE)`` unless you pass ``block_mask``. A mask that reads ``b``/``h``
    gets a block mask with enough batches/heads to show (``b``, ``h``).
    """
    plt = _pyplot()
    mask = as_mask(mask, "mask")
    if block_mask is None:
        if B is None and "b" in mask.depends_on:
            B = b + 1
        if H is None and "h" in mask.depends_on:
            H = h + 1
        block_mask = create_block_mask(mask, B, H, Q_LEN, KV_LEN, BLOCK_SIZE=BLOCK_SIZE)
    elif tuple(block_mask.seq_lengths) != (Q_LEN, KV_LEN):
        raise ValueError(f"block_mask was built for {block_mask.seq_lengths}, not ({Q_LEN}, {KV_LEN})")
    fig, (left, right) = plt.subplots(1, 2, figsize=figsize, layout="constrained")
    plot_mask(mask, Q_LEN, KV_LEN, b, h, ax=left)
    plot_block_mask(block_mask, b, h, ax=right)
    return fig
