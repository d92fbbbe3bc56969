"""Which tokens each rank holds: a sequence cut into equal chunks, each owned by one rank.

Context parallelism shards the sequence dimension. Every rank holds the same number of
chunks (the ring passes equal-sized K/V buffers), in ascending global order; a rank's local
tensors are its chunks concatenated. The assignment of chunks to ranks is the load balance:

- ``contiguous``: rank r holds chunk r (no balancing; fine for dense masks and windows);
- ``head_tail``: 2·world chunks, rank r holds r and 2·world − 1 − r (causal: equal work);
- ``balanced``: from per-chunk work (attended tiles of the mask, ``mask_weights``): chunks
  dealt in snake order by descending work, then pairwise swaps while they help;
  ``fewer_transfers`` then swaps chunks so fewer of them are attended from other ranks
  (documents kept together), work staying within ``TRANSFER_SLACK``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...blockmask.build import tile_verdicts
from ...arrays import to_numpy


@dataclass(frozen=True)
class ShardLayout:
    """``seq_len`` tokens in ``len(owners)`` chunks of ``chunk`` tokens; ``owners[c]`` is the
    rank holding chunk ``c``."""

    seq_len: int
    world: int
    owners: tuple

    def __post_init__(self):
        n = len(self.owners)
        if self.world < 1 or n % self.world or self.seq_len % n:
            raise ValueError(
                f"a shard layout needs the sequence ({self.seq_len}) cut into equal chunks, as many per rank:"
                f" {n} chunks over {self.world} ranks")
        counts = np.bincount(np.asarray(self.owners, dtype=np.int64), minlength=self.world)
        if len(counts) != self.world or np.any(counts != n // self.world):
            raise ValueError(f"every rank must own {n // self.world} chunks, got owners {self.owners}")

    @property
    def num_chunks(self) -> int:
        return len(self.owners)

    @property
    def chunk(self) -> int:
        return self.seq_len // self.num_chunks

    @property
    def local_len(self) -> int:
        return self.seq_len // self.world

    def local_chunks(self, rank: int) -> tuple:
        """The global chunk ids rank ``rank`` holds, in its local order (ascending)."""
        return tuple(c for c, o in enumerate(self.owners) if o == rank)

    def positions(self, rank: int) -> np.ndarray:
        """Global positions of rank ``rank``'s local tokens (its position ids)."""
        c = self.chunk
        return np.concatenate([np.arange(g * c, (g + 1) * c) for g in self.local_chunks(rank)])

    def order(self) -> np.ndarray:
        """Global position of each token of the ranks' shards laid end to end (rank 0's,
        then rank 1's, ...): ``sharded = x[..., order]``, ``x[..., order] = sharded``."""
        return np.concatenate([self.positions(r) for r in range(self.world)])


def contiguous(seq_len: int, world: int) -> ShardLayout:
    return ShardLayout(seq_len, world, tuple(range(world)))


def head_tail(seq_len: int, world: int) -> ShardLayout:
    """Rank r holds chunks r and 2·world − 1 − r: under a causal mask every rank then has
    the same number of attended pairs."""
    owners = [0] * (2 * world)
    for r in range(world):
        owners[r], owners[2 * world - 1 - r] = r, r
    return ShardLayout(seq_len, world, tuple(owners))


def balanced(seq_len: int, world: int, weights) -> ShardLayout:
    """Chunks (``len(weights)`` of them, a multiple of ``world``) dealt to ranks so their
    summed ``weights`` (work per chunk) are as even as this finds: snake order by
    descending weight, then swaps of one chunk between the heaviest and the lightest rank
    while that narrows their gap."""
    w = np.asarray(weights, dtype=np.float64)
    n = len(w)
    if n % world:
        raise ValueError(f"{n} chunks do not deal evenly to {world} ranks")
    owners = np.empty(n, dtype=np.int64)
    snake = [r for lap in range(n // world) for r in (range(world) if lap % 2 == 0 else reversed(range(world)))]
    owners[np.argsort(-w, kind="stable")] = snake
    for _ in range(4 * n):
        load = np.bincount(owners, weights=w, minlength=world)
        hi, lo = int(np.argmax(load)), int(np.argmin(load))
        gap = load[hi] - load[lo]
        if gap <= 0:
            break
        a = np.flatnonzero(owners == hi)
        b = np.flatnonzero(owners == lo)
        delta = w[a][:, None] - w[b][None, :]          # moving a to lo and b to hi
        after = np.abs(gap - 2 * delta)
        i, j = np.unravel_index(np.argmin(after), after.shape)
        if after[i, j] >= gap - 1e-12:
            break
        owners[a[i]], owners[b[j]] = lo, hi
    return ShardLayout(seq_len, world, tuple(int(o) for o in owners))


def transfers(owners, attended) -> int:
    """(rank, chunk) pairs where the rank's queries attend a chunk another rank holds: the
    K/V chunks the direct schedule sends (and the dK/dV chunks it returns).
    ``attended[i, j]``: chunk i's queries attend some key of chunk j."""
    owners = np.asarray(owners)
    world = int(owners.max()) + 1
    holds = np.zeros((world, len(owners)), dtype=np.int32)
    holds[owners, np.arange(len(owners))] = 1
    need = (holds @ np.asarray(attended, dtype=np.int32)) > 0
    need[owners, np.arange(len(owners))] = False
    return int(need.sum())


# fewer_transfers trades balance for messages only this far: per-rank work within 2% of
# even (the H100's run-to-run spread), or the layout's own imbalance if that is larger.
# Documents16 over 4-8 ranks (9 random packings, 64k tokens per rank): remote chunks sent
# 42 -> 24, 47 -> 31, 194 -> 106, 53 -> 37 (W 4 / 8), exact work imbalance at most 1.021.
TRANSFER_SLACK = 1.02


def fewer_transfers(layout: ShardLayout, weights, attended) -> ShardLayout:
    """``layout`` with chunks swapped between ranks while a swap lowers ``transfers``
    and keeps the ranks' summed ``weights`` within ``TRANSFER_SLACK`` of even (or within
    the layout's own imbalance, if larger). Deterministic: every rank computes the same."""
    owners = np.array(layout.owners)
    w = np.asarray(weights, dtype=np.float64)
    mean = w.sum() / layout.world
    if mean <= 0:
        return layout
    limit = max(TRANSFER_SLACK, imbalance(layout, w)) * mean
    best = transfers(owners, attended)
    improved = True
    while improved and best > 0:
        improved = False
        for a in range(len(owners)):
            for b in range(a + 1, len(owners)):
                if owners[a] == owners[b]:
                    continue
                owners[a], owners[b] = owners[b], owners[a]
                if np.bincount(owners, weights=w, minlength=layout.world).max() <= limit:
                    count = transfers(owners, attended)
                    if count < best:
                        best, improved = count, True
                        continue
                owners[a], owners[b] = owners[b], owners[a]
    return ShardLayout(layout.seq_len, layout.world, tuple(int(o) for o in owners))


def imbalance(layout: ShardLayout, weights) -> float:
    """max / mean of the ranks' summed chunk weights (1.0: perfectly even)."""
    load = np.bincount(np.asarray(layout.owners), weights=np.asarray(weights, dtype=np.float64),
                       minlength=layout.world)
    mean = load.mean()
    return float(load.max() / mean) if mean > 0 else 1.0


def mask_weights(mask, batch: int, heads: int, seq_len: int, num_chunks: int, block: int = 128,
                 rows: dict | None = None) -> np.ndarray:
    """Work per query chunk under ``mask`` (a ``MaskMod`` over global positions, or None):
    the (q, kv) tiles of ``block`` tokens interval analysis finds attended, every one full
    and half for each partial one (a diagonal or a document edge crosses a tile about
    halfway), over every batch and head at once (one box: sound, and one pass however many
    heads). ``rows``: a dict that keeps each block size's per-row sums for the next call
    (layouts tried one after another analyse the mask once)."""
    chunk = seq_len // num_chunks
    block = max(1, min(block, chunk))
    while chunk % block:
        block //= 2
    nb = seq_len // block
    if mask is None:
        return np.full(num_chunks, float(nb * (chunk // block)))
    per_block = None if rows is None else rows.get(block)
    if per_block is None:
        values = [to_numpy(c) for c in mask.captures]
        verdicts = tile_verdicts_box(mask, batch, heads, seq_len, block, values)
        per_block = (verdicts == 1).sum(axis=-1) + 0.5 * (verdicts == -1).sum(axis=-1)
        if rows is not None:
            rows[block] = per_block
    return per_block.reshape(num_chunks, chunk // block).sum(axis=-1).astype(np.float64)


def tile_verdicts_box(mask, batch: int, heads: int, seq_len: int, block: int, values) -> np.ndarray:
    """Interval verdicts [tiles, tiles] of ``mask`` over square tiles of ``block`` tokens,
    each tile's batch and head ranges the whole of them: 1 every pair attended in every
    (batch, head), 0 none in any, -1 otherwise."""
    verdict = tile_verdicts(mask, 1, 1, seq_len, seq_len, block, block, values=values, b_hi=batch - 1, h_hi=heads - 1)
    return verdict[0, 0]


def chunk_verdicts(mask, batch: int, heads: int, seq_len: int, num_chunks: int) -> np.ndarray:
    """[chunks, chunks] int8 of ``mask`` by interval analysis over chunk-sized tiles: 1
    chunk i's queries attend every key of chunk j, 0 none, -1 some (the plan's verdicts)."""
    values = [to_numpy(c) for c in mask.captures]
    return tile_verdicts_box(mask, batch, heads, seq_len, seq_len // num_chunks, values).astype(np.int8)


def _chunks_attended(mask, batch: int, heads: int, seq_len: int, num_chunks: int) -> np.ndarray:
    """[chunks, chunks] bool: chunk i's queries may attend a key of chunk j."""
    return chunk_verdicts(mask, batch, heads, seq_len, num_chunks) != 0


# choose_layout weighs chunks over at most this many tiles per side. Documents16 over 2-8
# ranks (9 packings, 64k tokens per rank), exact work imbalance of the balanced layouts:
# 1024 tiles with partial tiles at half weight give balanced layouts of the same exact
# imbalance as 2048 counted whole in 14 of 18 (chunks per rank 4 and 8), within +-0.011
# in the others, in a third of the time (55-240 ms vs 160-650 ms, a 2-core CPU with CI
# running); 512 tiles drift further (+0.016).
WEIGHT_TILES = 1024


# A layout within this factor of even work per rank is kept as it is (weak scaling target:
# every rank within 5% of the same attended tiles).
EVEN_ENOUGH = 1.05


def choose_layout(seq_len: int, world: int, mask=None, batch: int = 1, heads: int = 1,
                  block: int = 128) -> ShardLayout:
    """The default layout for a mask over global positions (a ``MaskMod`` or None):
    contiguous shards where they are already even (no mask, windows, documents of equal
    length), head-tail where that is even (causal), else ``balanced`` over 4 chunks per rank
    (8 where 4 is not even enough), refined by ``fewer_transfers``. Chunks stay whole
    ``block``s where the sequence allows.
    Deterministic: every rank computes the same layout from the same arguments."""
    if world == 1:
        return contiguous(seq_len, 1)
    candidates, rows = [], {}
    for per_rank in (1, 2, 4, 8):
        n = per_rank * world
        if seq_len % n or (seq_len // n) % block and per_rank > 1:
            continue
        weights = mask_weights(mask, batch, heads, seq_len, n, max(block, seq_len // WEIGHT_TILES), rows)
        if per_rank == 1:
            layout = contiguous(seq_len, world)
        elif per_rank == 2:
            layout = head_tail(seq_len, world)
        else:
            layout = balanced(seq_len, world, weights)
        spread = imbalance(layout, weights)
        if spread <= EVEN_ENOUGH:
            if per_rank > 2 and mask is not None:
                layout = fewer_transfers(layout, weights, _chunks_attended(mask, batch, heads, seq_len, n))
            return layout
        candidates.append((spread, per_rank, layout))
    if not candidates:
        raise ValueError(f"a sequence of {seq_len} tokens does not shard evenly over {world} ranks")
    return min(candidates, key=lambda c: (c[0], c[1]))[2]
