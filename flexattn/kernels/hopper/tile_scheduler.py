"""Tile scheduling: which (row block, head, batch) tiles each CTA computes, in what order.

Kernels launch a 1-D grid and walk *linear tile indices* `first, first + stride, ...`
below `total`: one index per CTA when the grid covers every tile, several when the grid is
capped at the SM count (persistent CTAs: the producer warp loads the next tile's K/V and
Q while the consumers still finish the current one, so a tile's prologue and epilogue
hide behind its neighbours' work).

The order maps a linear index to a tile. The hardware starts CTAs in index order, so the
order decides load balance (under causal masking the last row blocks do the most work and
should start first, short tiles filling the tail) and L2 reuse (CTAs running together
should share K/V):

`ByHead`        row blocks of one head together (last row block first), then the next
                head: ideal L2 reuse; right when every tile does the same work.
`LongestFirst`  sections of as many (batch, head) pairs as have K/V fitting in ~40 MB of
                L2 (a power of two); inside a section tiles go by row block, longest
                first, heads fastest. Causal S=4k D=128: the first wave takes the longest
                tiles of 16 heads instead of all the tiles of 4 heads.

`TileTickets`   persistent CTAs take their first tile by index and every later one by a
                ticket from a global counter, so a tile goes to whichever CTA frees up
                first (FA3's dynamic persistent scheduler): the tail of a walk whose tiles
                differ in work evens out as the hardware's own CTA scheduling would, while
                the next tile's loads still overlap this one's epilogue.

Everything is computed from runtime sizes (no recompile across shapes). `rows` is the
number of row blocks (query tiles in the forward); `last_row_first` says which end of the
row range carries the most work.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

L2_BYTES_FOR_KV = 40 * 1024 * 1024   # of the H100's 50 MB, leave room for Q/O traffic


class TileSpace:
    """The tiles of one launch: sizes plus this CTA's walk over linear indices."""

    def __init__(self, rows: Int32, heads: Int32, batch: Int32, kv_len: Int32):
        self.rows, self.heads, self.batch, self.kv_len = rows, heads, batch, kv_len
        self.total = rows * heads * batch
        self.first = cute.arch.block_idx()[0]
        self.stride = cute.arch.grid_dim()[0]
        self.tickets = None   # TileTickets, where the kernel schedules by tickets

    def snake(self, idx: Int32) -> Int32:
        """`snake_index` of this launch's `idx`."""
        return snake_index(idx, self.stride, self.total, lambda c, a, b: Int32(cutlass.select_(c, a, b)))


def snake_index(idx, stride, total, select=None):
    """Persistent CTAs in a snake: linear index `idx` (= first + r * stride, a CTA's r-th
    tile) reversed within every odd round that is full (a partial last round keeps its
    order: its reversed positions would pass `total`). `select(cond, a, b)`: the kernel's,
    or Python's (the default) for host code and tests."""
    select = select or (lambda c, a, b: a if c else b)
    r = idx // stride
    flip = (r % 2 == 1) & ((r + 1) * stride <= total)
    return select(flip, r * stride + stride - 1 - (idx - r * stride), idx)


class TileTickets:
    """Tiles after a persistent CTA's first, by ticket: ticket t of the launch is linear
    tile `stride + t` (the first round goes by CTA index). Every CTA draws until its ticket
    is past `total`, so a launch draws exactly `total` tickets, and the drawer of ticket
    `total - 1` (the last: the counter's values are handed out in order) resets the
    counter to zero for the next launch in stream order: it is zeroed once, when
    allocated. Two launches must never share a counter at the same time (one per stream).

    The producer warp draws (lane 0: one atomic per tile, relaxed, as the counter
    publishes nothing but numbers) once it has issued a tile's loads, and publishes the
    index in a shared slot before its next Q arrives; the consumers read the slot once
    that Q has landed (the barrier's arrive and wait order the slot's write and read). Two
    slots, by tile parity: the slot of tile n + 1 is tile n - 1's, which the consumers
    read before releasing tile n - 1's Q buffer; the producer writes it after acquiring
    that buffer again for tile n."""

    def __init__(self, counter: cute.Tensor, slots: cute.Tensor, space: TileSpace):
        self.counter, self.slots, self.space = counter, slots, space

    @cute.jit
    def draw(self, count: Int32) -> Int32:
        """Producer warp, after this CTA's tile number `count`: the linear index of its
        next tile (>= total: none left), published in the slot of tile `count + 1`."""
        counter, slots, last, stride = self.counter.iterator, self.slots, self.space.total - 1, self.space.stride
        ticket = Int32(0)
        if cute.arch.lane_idx() == 0:
            ticket = cute.arch.atomic_add(counter, Int32(1), sem="relaxed", scope="gpu")
            if ticket == last:
                cute.arch.atomic_exch(counter, Int32(0), sem="relaxed", scope="gpu")
            slots[(count + 1) % 2] = stride + ticket
        return cute.arch.shuffle_sync(stride + ticket, 0)

    def read(self, count: Int32) -> Int32:
        """Consumers, once tile `count`'s Q (or the end signal) has landed: its index."""
        return self.slots[count % 2]


def grid_size(total_tiles, max_ctas: int):
    """1-D grid: one CTA per tile, or at most `max_ctas` persistent CTAs (0: no cap)."""
    if max_ctas:
        return (cutlass.min(total_tiles, max_ctas), 1, 1)
    return (total_tiles, 1, 1)


class ByHead:
    def __init__(self, last_row_first: bool = True):
        self.last_row_first = last_row_first

    @cute.jit
    def tile(self, idx: Int32, space: TileSpace):
        pair = idx // space.rows
        row = idx - pair * space.rows
        if const_expr(self.last_row_first):
            row = space.rows - 1 - row
        return row, pair % space.heads, pair // space.heads


class LongestFirst:
    def __init__(self, kv_row_bytes: int, last_row_first: bool = True, l2_budget: int = L2_BYTES_FOR_KV):
        self.kv_row_bytes = kv_row_bytes          # bytes of one K row + one V row
        self.last_row_first = last_row_first
        self.l2_budget = l2_budget                # bytes a section's rows may take in L2

    @cute.jit
    def tile(self, idx: Int32, space: TileSpace):
        pairs = space.heads * space.batch
        # Pairs per section: the largest power of two whose K/V fit the L2 budget.
        fit = Int32(self.l2_budget // self.kv_row_bytes) // cutlass.max(space.kv_len, 1)
        section = Int32(1)
        for i in cutlass.range_constexpr(1, 16):
            if (1 << i) <= fit:
                section = Int32(1 << i)
        section = cutlass.min(section, pairs)
        first_pair = (idx // (section * space.rows)) * section
        width = cutlass.min(section, pairs - first_pair)   # the last section may be narrower
        local = idx - first_pair * space.rows
        step = local // width
        pair = first_pair + local - step * width
        row = step
        if const_expr(self.last_row_first):
            row = space.rows - 1 - step
        return row, pair % space.heads, pair // space.heads
