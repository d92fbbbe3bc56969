"""Which (query chunk, key chunk) pairs a rank computes, and each pair's spec.

Every pair runs the ordinary kernels on a chunk of queries against a chunk of keys, with the
mods rewritten to global positions (``mods.positions.offset_positions``: the offsets are
captured numbers, so all pairs share one kernel per structure; a diagonal pair stays
exactly causal). Interval analysis of the whole mask over chunk-sized tiles, or the block
mask's tile states, decides each pair: nothing attended → skipped (no launch), everything
attended → no mask at all (the dense kernel), else the mask at its offsets (a causal mask
off the diagonal becomes a band with runtime bounds; documents a block mask per pair).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...blockmask import BlockMask
from ...blockmask.layout import EMPTY, FULL
from ...mods.positions import offset_positions, table_positions
from ...mods.structure import diagonal_band
from ...problem.spec import AttentionSpec
from .layout import ShardLayout, chunk_verdicts


@dataclass(frozen=True)
class ShardPair:
    """One launch: local q rows ``q_rows`` against keys ``kv_rows`` of the K/V buffer in
    hand (both (start, stop) along the sequence), with ``spec`` at global positions."""

    q_rows: tuple
    kv_rows: tuple
    spec: AttentionSpec


class ContextParallelPlan:
    """What rank ``rank`` launches at each ring step (``ring_steps``: the source rank whose
    K/V it holds, and the pairs), or over all-gathered K/V (``gathered_pairs``).

    ``block_mask_builder(mask, batch, heads, q_len, kv_len)``: builds a pair's block mask
    where the adapter can (on its device; None: the kernels' path builds one itself)."""

    def __init__(self, spec: AttentionSpec, layout: ShardLayout, rank: int, batch: int, heads: int,
                 block_mask_builder=None):
        if not 0 <= rank < layout.world:
            raise ValueError(f"rank {rank} outside a world of {layout.world}")
        self.spec, self.layout, self.rank = spec, layout, rank
        self.batch, self.heads = batch, heads
        self._builder = block_mask_builder
        self._offset_mods: dict = {}
        self._steps = self._direct = self._gathered = None     # built once: the backward reuses the forward's pairs
        self._most_fetched = None
        self._sent: dict = {}     # (rank, source) -> sent_chunks: asked every step of every call
        # the user's block mask's tile states, one host copy for the verdicts and every pair
        self._states = None if spec.block_mask is None else spec.block_mask.block_states()
        self.verdicts = _chunk_verdicts(spec, layout, batch, heads, self._states)
        self.score_position_free = spec.score is None or not ({"q", "kv"} & spec.score.depends_on)
        self.position_free = spec.element_mask is None and self.score_position_free

    def needs(self, rank: int, source: int) -> bool:
        """Whether ``rank``'s queries attend any key ``source`` holds (every rank computes
        the same answer: the verdicts are the whole mask's)."""
        return bool(self.sent_chunks(rank, source))

    def sent_chunks(self, rank: int, source: int) -> tuple:
        """The chunks of ``source``'s shard (local indices, ascending) that ``rank``'s
        queries attend: what the direct schedule sends from ``source`` to ``rank`` (all of
        them, or none, where the mods read no position and pairs run whole shards). Every
        rank computes the same answer."""
        hit = self._sent.get((rank, source))
        if hit is None:
            mine, theirs = self.layout.local_chunks(rank), self.layout.local_chunks(source)
            live = np.any(self.verdicts[np.ix_(mine, theirs)] != 0, axis=0)
            if self.position_free:
                hit = tuple(range(len(theirs))) if live.any() else ()
            else:
                hit = tuple(int(i) for i in np.flatnonzero(live))
            self._sent[(rank, source)] = hit
        return hit

    def most_fetched(self) -> float:
        """The most K/V any rank fetches over the direct steps, in local shards (0 where
        every rank attends only its own keys; world − 1 at most)."""
        if self._most_fetched is None:
            layout, world = self.layout, self.layout.world
            per_rank = layout.local_len // layout.chunk
            self._most_fetched = max(
                sum(len(self.sent_chunks(r, (r - s) % world)) for s in range(1, world)) for r in range(world)) / per_rank
        return self._most_fetched

    # -- the ring ----------------------------------------------------------------------------
    def ring_steps(self) -> list:
        """[(source rank, [ShardPair])] for steps 0 .. world − 1 (step s holds the K/V of
        rank (rank − s) mod world)."""
        if self._steps is None:
            self._steps = self._ring_steps()
        return self._steps

    def direct_steps(self) -> list:
        """[(source rank, [ShardPair])] like ``ring_steps``, but after step 0 the K/V in
        hand are only the chunks of rank − s this rank attends (``sent_chunks``), laid end
        to end: the pairs index that compact buffer (documents on 4 ranks: 42 of 96 remote
        chunks sent instead of 88 in whole shards)."""
        if self._direct is None:
            self._direct = self._steps_over(lambda s, src: list(self.layout.local_chunks(src)) if s == 0 else [
                self.layout.local_chunks(src)[i] for i in self.sent_chunks(self.rank, src)])
        return self._direct

    def _ring_steps(self) -> list:
        return self._steps_over(lambda s, src: list(self.layout.local_chunks(src)))

    def _steps_over(self, chunks_in_hand) -> list:
        """Each step's pairs against the K/V chunks in hand, ``chunks_in_hand(step,
        source)`` (global chunk indices, in buffer order)."""
        layout, c = self.layout, self.layout.chunk
        mine = layout.local_chunks(self.rank)
        steps = []
        for s in range(layout.world):
            src = (self.rank - s) % layout.world
            theirs = chunks_in_hand(s, src)
            if not theirs:
                steps.append((src, []))
                continue
            if self.position_free:
                steps.append((src, [ShardPair((0, layout.local_len), (0, len(theirs) * c), self.spec)]))
                continue
            full = self._blocks(mine, theirs, 1)
            pairs = self._fused_step(mine, theirs, len(full))
            if pairs is not None:
                steps.append((src, pairs))
                continue
            pairs = []
            for verdict, blocks in ((1, full), (-1, self._blocks(mine, theirs, -1))):
                for (q_lo, q_hi), (k_lo, k_hi) in blocks:
                    spec = self._pair_spec(mine[q_lo] * c, theirs[k_lo] * c, (q_hi - q_lo) * c, (k_hi - k_lo) * c,
                                           verdict)
                    pairs.append(ShardPair((q_lo * c, q_hi * c), (k_lo * c, k_hi * c), spec))
            steps.append((src, pairs))
        return steps

    def _fused_step(self, mine, theirs, full_launches: int):
        """[one ShardPair] over the span of local query chunks and of the K/V in hand that
        the step attends, with the mods reading each token's global position from a table,
        where the step would otherwise take more than ``FUSE_ABOVE`` launches (a layout of
        many chunks, e.g. documents balanced over 4-8 chunks per rank: one large launch and
        one merge instead of many small ones; the pairs the mask excludes become empty
        tiles of its block mask). None where the chunk pairs are few (causal head-tail
        keeps its diagonal structure) or the user gave a block mask (its tiles are sliced
        per pair). ``full_launches``: the step's fully attended rectangles
        (``_blocks``)."""
        if self.spec.block_mask is not None:
            return None
        verdicts = self.verdicts[np.ix_(mine, theirs)]
        if int(np.count_nonzero(verdicts == -1)) + full_launches <= FUSE_ABOVE:
            return None
        c, spec = self.layout.chunk, self.spec
        # only the span of chunks the step attends: the launch's per-row work (the
        # backward's preprocess, postprocess and dQ sum, the forward's merge) skips the rest
        live = verdicts != 0
        rows, cols = np.flatnonzero(live.any(axis=1)), np.flatnonzero(live.any(axis=0))
        q_lo, q_hi, k_lo, k_hi = int(rows[0]), int(rows[-1]) + 1, int(cols[0]), int(cols[-1]) + 1
        q_pos, kv_pos = _positions(mine[q_lo:q_hi], c), _positions(theirs[k_lo:k_hi], c)
        score = spec.score
        if score is not None and not self.score_position_free:
            score = table_positions(score, q_pos, kv_pos)
        mask = None if spec.element_mask is None else table_positions(spec.element_mask, q_pos, kv_pos)
        built = None
        if mask is not None and self._builder is not None:
            built = self._builder(mask, self.batch, self.heads, len(q_pos), len(kv_pos))
        pair_spec = (AttentionSpec(score, None, built, spec.scale, spec.enable_gqa) if built is not None
                     else AttentionSpec(score, mask, None, spec.scale, spec.enable_gqa))
        return [ShardPair((q_lo * c, q_hi * c), (k_lo * c, k_hi * c), pair_spec)]

    def _blocks(self, mine, theirs, verdict: int) -> list:
        """The chunk pairs of one step with ``verdict`` (1: fully attended, -1: partly) as
        few rectangles as possible: runs of the local key chunks, then of the local query
        chunks with equal runs, each a launch and a merge instead of one per chunk pair.
        Chunks join where their global positions continue each other — or, fully attended,
        anywhere when the score reads no position (the pair runs without a mask); partly
        attended pairs run the mask at the rectangle's offsets, so they need the positions
        to continue (documents16 on 2 ranks: a step of three 16k x 16k pairs, two of them on
        adjacent key chunks, becomes two launches, and its rows take two contributions, not
        three). [((q_lo, q_hi), (k_lo, k_hi))] in local chunk indices."""
        anywhere = verdict == 1 and self.score_position_free

        def joins(chunks, i):
            return anywhere or chunks[i] == chunks[i - 1] + 1

        rows = []
        for qi, gq in enumerate(mine):
            runs, start = [], None
            for ki, gk in enumerate(theirs):
                hit = self.verdicts[gq, gk] == verdict
                if hit and start is not None and joins(theirs, ki):
                    continue
                if start is not None:
                    runs.append((start, ki))
                start = ki if hit else None
            if start is not None:
                runs.append((start, len(theirs)))
            rows.append(runs)
        blocks = []
        for qi, runs in enumerate(rows):
            for run in runs:
                if blocks and blocks[-1][1] == run and blocks[-1][0][1] == qi and joins(mine, qi):
                    blocks[-1] = ((blocks[-1][0][0], qi + 1), run)
                else:
                    blocks.append(((qi, qi + 1), run))
        return blocks

    # -- all-gathered K/V ----------------------------------------------------------------------
    def gathered_pairs(self) -> list:
        """[ShardPair] over the whole sequence's K/V in global order: each local query
        chunk against the one range of key chunks it may attend."""
        if self._gathered is None:
            self._gathered = self._gathered_pairs()
        return self._gathered

    def _gathered_pairs(self) -> list:
        layout, c = self.layout, self.layout.chunk
        if self.position_free:
            return [ShardPair((0, layout.local_len), (0, layout.seq_len), self.spec)]
        pairs = []
        for qi, gq in enumerate(layout.local_chunks(self.rank)):
            live = np.flatnonzero(self.verdicts[gq] != 0)
            if live.size == 0:
                continue
            lo, hi = int(live[0]), int(live[-1]) + 1
            row = self.verdicts[gq, lo:hi]
            verdict = 1 if np.all(row == 1) else -1
            spec = self._pair_spec(gq * c, lo * c, c, (hi - lo) * c, verdict)
            pairs.append(ShardPair((qi * c, (qi + 1) * c), (lo * c, hi * c), spec))
        return pairs

    # -- a pair's spec -------------------------------------------------------------------------
    def _pair_spec(self, q0: int, kv0: int, q_len: int, kv_len: int, verdict: int) -> AttentionSpec:
        spec = self.spec
        score = spec.score
        if score is not None and {"q", "kv"} & score.depends_on:
            score = self._offset(score, q0, kv0)
        if verdict == 1:
            return AttentionSpec(score, None, None, spec.scale, spec.enable_gqa)
        mask = self._offset(spec.element_mask, q0, kv0)
        block_mask = spec.block_mask
        if block_mask is not None:
            bq, bk = block_mask.BLOCK_SIZE
            states = self._states[..., q0 // bq:(q0 + q_len) // bq, kv0 // bk:(kv0 + kv_len) // bk]
            sliced = BlockMask(states, (q_len, kv_len), block_mask.BLOCK_SIZE, mask)
            sliced.from_mask = block_mask.from_mask
            return AttentionSpec(score, None, sliced, spec.scale, spec.enable_gqa)
        if self._builder is not None and diagonal_band(mask.expr) is None:
            built = self._builder(mask, self.batch, self.heads, q_len, kv_len)
            if built is not None:
                return AttentionSpec(score, None, built, spec.scale, spec.enable_gqa)
        return AttentionSpec(score, mask, None, spec.scale, spec.enable_gqa)

    def _offset(self, mod, q0: int, kv0: int):
        key = (id(mod), q0, kv0)
        hit = self._offset_mods.get(key)
        if hit is None:
            hit = self._offset_mods[key] = offset_positions(mod, q0, kv0)
        return hit


# A ring step with more chunk-pair launches than this runs as one launch over position tables.
FUSE_ABOVE = 3


def _positions(chunks, chunk: int) -> np.ndarray:
    """Global positions of the tokens of these chunks laid end to end (int32, read-only:
    a kernel argument the GPU path copies once)."""
    table = np.concatenate([np.arange(g * chunk, (g + 1) * chunk, dtype=np.int32) for g in chunks])
    table.flags.writeable = False
    return table


def _chunk_verdicts(spec: AttentionSpec, layout: ShardLayout, batch: int, heads: int, states) -> np.ndarray:
    """[chunks, chunks]: 1 every pair of the two chunks attended (for every batch and
    head), 0 none, -1 some — from the block mask's tile ``states`` where there is one,
    else interval analysis of the mask over chunk-sized tiles."""
    n, c = layout.num_chunks, layout.chunk
    block_mask = spec.block_mask
    if block_mask is not None:
        bq, bk = block_mask.BLOCK_SIZE
        if block_mask.seq_lengths != (layout.seq_len, layout.seq_len):
            raise ValueError(f"the block mask is for lengths {block_mask.seq_lengths}, the sharded sequence has"
                             f" {layout.seq_len} tokens")
        if c % bq or c % bk:
            raise ValueError(f"context parallelism with a block mask needs chunks ({c} tokens) that are whole"
                             f" blocks ({bq}x{bk}): choose a sequence length or world size to match")
        tiles = states.reshape(-1, n, c // bq, n, c // bk)
        full = np.all(tiles == FULL, axis=(0, 2, 4))
        empty = np.all(tiles == EMPTY, axis=(0, 2, 4))
        return np.where(full, 1, np.where(empty, 0, -1)).astype(np.int8)
    mask = spec.mask
    if mask is None:
        return np.ones((n, n), dtype=np.int8)
    return chunk_verdicts(mask, batch, heads, layout.seq_len, n)
