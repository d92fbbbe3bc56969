"""FlashAttention forward for Hopper (sm_90a) in CuTeDSL, with a compile-time mod hook.

A CTA computes (tile_m rows of Q) x (one head) x (one batch) output tiles — one, or with
`max_ctas` (persistent CTAs) several in turn; hopper/tile_scheduler.py decides which and in what
order. Per tile:

    warpgroup 0, warp 0   producer: TMA-loads Q once, then K_j and V_j for each visited
                          kv block j into a `num_stages`-deep ring (separate mbarrier
                          pipelines for K and V so S = Q K_j^T can start before V_j lands)
    warpgroups 1..        consumers, 64 rows of the tile each: S = Q K^T (wgmma, smem x smem),
                          mods on the S fragment, online softmax (fp32, exp2), O += P V
                          (wgmma, P from registers), then O / l -> smem -> TMA store, LSE.

Registers are moved from the producer to the consumers with setmaxnreg. Scheduling
(step b, config flags, results identical): *intra-warpgroup overlap* issues S_j = Q K_j^T
together with O += P_{j-1} V_{j-1} and runs the softmax of S_j while the tensor cores do the
P V product; *ping-pong* makes the consumer warpgroups take turns issuing GEMMs (named
barriers), so one warpgroup's softmax hides behind the other's GEMMs.

Tensors are [B, H, S, D] with D contiguous (any other strides); K/V may have fewer heads
(GQA: kv head = q head // (Hq / Hkv)); Q_LEN and KV_LEN are independent and arbitrary
(TMA zero-fills reads past the end and clips the store; the KV_LEN edge is masked).

fp32 inputs (``dtype="fp32"``) run tf32 wgmmas, which read both operands K-major: V comes
transposed, its keys permuted within each 8 so the S accumulator feeds P V without a
shuffle (``mma.acc_as_tf32_a_view``). ``tf32_passes=3`` (3xTF32, for torch's "highest"
float32 matmul precision) takes Q, K and V^T as tf32 (hi, lo) parts stacked along the batch
dim (batch b's lo part at b + B) and runs every product as three tf32 MMAs; P is split in
registers. kernels/fwd/fp32_operands.py makes those operands.

Which kv blocks are visited, and which of them need the mask evaluated, is the *block
structure* (see blockmask/visit.py): "dense" (all blocks, last first, the mask on every
block), "causal" (blocks at or below the diagonal, the mask only on blocks crossing it) or
"block_sparse" (a FlexAttention BlockMask's partial and full lists, runtime tensors) or
"band" (a mask that is exactly a band of diagonals, ``lo <= q - kv <= hi`` with runtime
bounds: the same partial-then-full walk, its blocks by arithmetic instead of lists).
`_visit_blocks`, `_visit_blocks_one_step`, `_visit_sparse` (consumers) and `load`
(producer) are the only code that enumerates blocks, in the same order. Where a hook is
emitted (and for every block-sparse walk), one overlapped step (`_visit_step`) serves all
blocks, the first included: which limits or masks a block needs, and whether a previous
P V is due, are decided at run time, so the hooks and the softmax are traced once
(compile time of a new mod, issue 3). Hook-free dense / causal kernels peel their first
block (`_first_half`) and run the same step for the others with the previous P V always
due.
"""

import math
from dataclasses import dataclass, field
from typing import NamedTuple

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup

from flexattn.kernels.hopper import mma
from flexattn.kernels.blockmask.visit import BandBlocks, DenseBlocks, SparseBlocks, band_bounds, band_of
from flexattn.kernels.emit.mod_hook import (NO_MODS, FragmentCoords, ModHook, apply_mods, masked_if,
                                            masked_where)
from flexattn.kernels.hopper.softmax import OnlineSoftmax, divide_rows, rescale_rows
from flexattn.kernels.hopper.tile_scheduler import ByHead, LongestFirst, TileSpace, TileTickets, grid_size
from flexattn.kernels.hopper.tma_pipeline import multicast_slice, tma_ring
from flexattn.kernels.hopper.warp_specialized import (DTYPES, KernelConfig, NamedBarriers, WarpSpecialized,
                                                      register_split, stage_tiles, store_staged)

LOG2_E = math.log2(math.e)
FWD_DTYPES = {**DTYPES, "fp32": cutlass.Float32}   # the forward alone takes fp32 (tf32 MMAs)



class _Consumer(NamedTuple):
    """A consumer warpgroup's parts for all its tiles (built once in `consume`): its two
    MMAs and their register operands, the S accumulator's shape, O (with ``promote_pv`` a
    pair: O and a block's P V), the softmax state, the fragment's coordinates, the K / V
    rings."""
    tiled_mma_qk: object
    tiled_mma_pv: object
    tSrQ: object
    tSrK: object
    tOrVt: object
    tOrP: object
    acc_shape_S: object
    acc_O: object
    softmax: object
    coords: object
    pipe_k: object
    pipe_v: object


class _PvPieces(NamedTuple):
    """``promote_pv`` in column pieces (``FwdConfig.promote_pv_pieces`` > 1): the P V MMA
    over one piece's Dv / pieces columns, V^T's fragments of each piece's rows, and the
    fresh accumulator the pieces take turns in. Piece p's accumulator is O's registers
    [p * n, (p + 1) * n) (n its size): both fragments are ((2, 2, columns / 8), 1, 1),
    compact, so their column groups follow each other."""
    tiled_mma: object
    tOrVt: tuple
    acc: object


# What a main-loop step reads: the `_Consumer` parts, then this tile's position, the call's
# run-time sizes, scale and mod arguments, and the warpgroup's index.
_Step = NamedTuple("_Step", [*_Consumer.__annotations__.items(), *(
    (name, object) for name in ("m_block", "head", "batch", "seqlen_q", "seqlen_k", "softmax_scale",
                                "mod_args", "wg"))])


@dataclass(frozen=True)
class FwdConfig(KernelConfig):
    """Everything that changes the generated code (runtime values never do)."""

    KIND = "fwd"
    ELEMENT_TYPES = FWD_DTYPES

    dtype: str = "bf16"            # "bf16" | "fp16" | "fp32": Q, K, V and O
    tf32_passes: int = 1           # fp32: tf32 MMAs per product, 1 or 3 (3xTF32, see above)
    # Each block's P V summed by the tensor cores into a fresh accumulator, then added to
    # O in registers (round-to-nearest FADD): the tensor cores' accumulation drops low
    # bits at every add, which over a long row's thousands of adds outweighs 3xTF32's own
    # error (DeepGEMM promotes its FP8 sums the same way). None: on for 3xTF32.
    promote_pv: bool | None = None
    # promote_pv's fresh accumulator covers Dv / promote_pv_pieces value columns; the pieces
    # run one after another (the first overlapped as the whole one is, the others at the
    # fold). None: 1 up to 128 value columns, 2 beyond, where an O-sized second accumulator
    # spills (ptxas, 192/192: 180 bytes) and one of half the columns does not.
    promote_pv_pieces: int | None = None
    # 3xTF32: S = Q K^T's chain over the head dim summed in pieces of this many k-blocks,
    # each waited for and added to S in registers (0: one accumulator; None: 4 for
    # 3xTF32 where it fits in registers). In one accumulator the truncating adds of
    # 3 x D/8 MMAs put S off by a few ulps, which rows with few keys carry into O: max
    # error 1.0-1.6x torch flex's; in pieces of 4, 0.48-0.77x flex's, mean error halved,
    # 4-11% slower (H200, 2026-11-30, docs/experiments.md). FLEXATTN_FWD_S_PROMOTE=N
    # overrides, for A/B runs.
    s_promote: int | None = None
    # O / l by IEEE division and the LSE by the precise log2 (None: for 3xTF32), instead of
    # an approximate reciprocal's multiply (~1.5 ulp of O, beside float32's 0.5).
    exact_normalize: bool | None = None
    head_dim: int = 128            # of Q and K: a multiple of 16 in [16, 256]
    head_dim_v: int | None = None  # of V and O (None: head_dim); a multiple of 16 in [16, 256]
    tile_m: int | None = None      # Q rows per CTA, 64 per consumer warpgroup (None: 192
                                   # for head dims <= 64 without score mod, else 128; the
                                   # planner also takes 192 at 80 / 96 with tile_n <= 112)
    tile_n: int = 128              # KV rows per pipeline stage
    num_stages: int = 2            # K/V ring depth
    causal: bool = False           # block structure: skip blocks above the diagonal
    block_sparse: bool = False     # block structure from BlockMask lists (runtime tensors)
    sparse_block_n: int = 128      # keys of one listed block (a multiple of tile_n)
    partial_blocks: bool = True    # block_sparse: the lists may hold partial blocks. False
                                   # (planned where a block mask has none): the full list
                                   # alone is walked, one copy of the step fewer (a faster
                                   # compile); partial lists are not read
    sparse_block_m: int | None = None  # query rows of one listed block (None: tile_m; else a
                                       # multiple of it: 64-row fp32 tiles read 128-row lists)
    band: bool = False             # block structure of the mask's band of diagonals (the
                                   # mask hook's IR is one; its bounds are runtime captures)
    band_one_step: bool = False    # band, overlapped schedule: one step serves partial and
                                   # full blocks (`partial` decided per block at run time, as
                                   # the causal walk does), one copy of the mods and the
                                   # softmax fewer (a faster compile); the blocks and their
                                   # order are unchanged. Planned for bands (session 77)
    one_step_walk: bool = False    # dense / causal without hooks, overlapped schedule: every
                                   # block through one step, the first included (hooks always
                                   # walk so), not a peeled first block: one copy of the step
                                   # fewer (a faster compile). Planned up to head dim 64
                                   # (session 78; at D128 causal it cost 2%)
    max_scores: bool = False       # also write each row's max score (torch's AuxRequest)
    hoist_tile_reads: bool = False # the mods' reads at kv // P (P a multiple of tile_n: a
                                   # paged mask's page map) once per tile and row, not per
                                   # element (mod_hook.apply_mods, IRModHook.tile_invariants)
    mods: ModHook = field(default=NO_MODS, compare=False)
    producer_regs: int | None = None  # setmaxnreg budgets; None: by warpgroup count,
    consumer_regs: int | None = None  # 2 WGs: 24 / 240, 3 WGs: 32 / 160 (fill 64K regs)
    # Step (b) scheduling; both only change timing, never results:
    intra_wg_overlap: bool = True  # softmax of block j overlaps P_{j-1} V_{j-1} on the tensor cores
    pingpong: bool = True          # 2 consumer warpgroups take turns issuing their GEMMs
    # Overlapped schedule: O shrinks by block j-1's row scale right after Q K_j^T is issued
    # (on registers the tensor cores do not hold then), instead of after the softmax of
    # block j, where it sits between P_{j-1} V_{j-1} landing and Q K_{j+1}^T going out:
    # 128 FMULs per thread there at 256 value columns. O sees the same multiplies and adds in
    # the same order (results bitwise equal: sweep_fwd_configs' diff 0); only when the
    # multiply issues moves. Planned beyond 192 (kernel_path._rescale_o_early); FA4: beyond 128.
    rescale_o_early: bool = False
    # O's rescale skipped while no row of a warp has outgrown the exponents' reference max
    # by more than 2^rescale_threshold (OnlineSoftmax: P then runs up to that factor; one
    # vote per warp and block decides, and the FMULs sit in a branch). 0: every block
    # rescales. FA4 does this on Blackwell (8.0).
    rescale_threshold: float = 0.0
    # With a rescale threshold: no row maxima on the fast path. The exponentials go against
    # the current references straight into P's 16-bit registers (after the P V wait); row
    # sums within 2^t prove every exponential is (`OnlineSoftmax.step_on_demand`), else the
    # warp takes the maxima and computes them again from S. Drops an FMNMX a score, the
    # maxima's shuffles and the max's latency before the first exponential; 16-bit inputs,
    # not with max_scores (no max is tracked).
    maxima_on_demand: bool = False
    # Causal, several consumer warpgroups: each ends its walk at its own 64 rows' diagonal
    # (`FlashFwdSm90._own_diagonal`). The tile's leading blocks that lie wholly right of a
    # warpgroup's last row are released unread (it still takes their ping-pong turns,
    # without GEMMs), and only the blocks crossing its own diagonal are masked. 256 x 80
    # tiles at S 4096: 4.4% of the warpgroups' block visits skipped, masked visits 14.5% ->
    # 5.8%; H200, 2026-12-01, causal B4 S4096 H16: D32 292 -> 320 TFLOP/s, D64 475 -> 511.
    # Only blocks wholly masked for a warpgroup's rows are dropped: O and LSE as before but
    # for the order of a row sum's fp32 additions where on-demand maxima met such a block.
    own_diagonal: bool = True
    # Which tiles each CTA takes (hopper/tile_scheduler.py): "by_head" or "longest_first"
    # (None: longest_first under causal, where tiles differ in work; by_head otherwise).
    tile_order: str | None = None
    # Persistent CTAs: at most this many (the SM count), each walking several tiles so the
    # next tile's loads overlap this one's epilogue; 0 = one CTA per tile. Costs a separate
    # O staging buffer in shared memory.
    max_ctas: int = 0
    # Persistent CTAs: CTA c takes position c of every even round of `grid` tiles and
    # position grid - 1 - c of every odd full one (a snake), so the CTAs that take the
    # longer tile of a round take the shorter one of the next (`TileSpace.snake`): a
    # stride of 132 over by-head rows of 16 gives CTA c the rows (c + 4 r) mod 16, 25%
    # more work for some CTAs than others under a sliding window. The planner turns it on
    # for bands (core/kernel_path.py: measured there).
    snake: bool = False
    # Persistent CTAs: tiles after a CTA's first go to whichever CTA frees up first, by
    # tickets from a global int32 counter the launch passes after the block lists
    # (`TileTickets`; the kernel leaves it zero). Evens out the tail of walks whose tiles
    # differ in work (bands: rows near the start see fewer keys).
    tile_tickets: bool = False
    # CTAs per cluster along the q tiles (1 or 2). With 2, the two CTAs of a cluster take
    # adjacent q tiles of one (batch, head) and load each K/V block once for both: each
    # CTA TMA-loads half of it, multicast into both CTAs' shared memory (FA3's cluster
    # for head dim >= 128), halving the K/V traffic from L2. Dense or causal structure
    # (under causal the lower tile of a pair skips the blocks only the upper one sees:
    # loaded for its peer, not computed), or block-sparse lists whose two rows of a pair
    # are identical (the caller checks: `BlockMask.row_pairs_match`; else the CTAs' walks
    # diverge and wait on each other forever). The caller must guarantee an even number
    # of q tiles per head (`cluster_fits`), or a pair would straddle two heads.
    cluster_m: int = 1
    # KV_LEN is a multiple of tile_n (the launch checks): no block straddles it, so the
    # full blocks of lists and bands skip the run-time test for one that does. That test
    # was a branch in the middle of the step, and ptxas then started the softmax only after
    # the P V wait (documents B2 S8192, H100: see docs/experiments.md, session 27).
    kv_aligned: bool = False

    def __post_init__(self):
        # Resolve the defaults that depend on other fields (frozen: via object.__setattr__).
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        if self.tile_m is None and self.walks_partial_then_full:
            object.__setattr__(self, "tile_m", 128)   # = FlexAttention's default Q block
        if self.tile_m is None:
            # 3 consumer warpgroups at 160 regs each suit head_dim 64, but a score mod
            # (e.g. with buffer loads) can spill there: then 2 warpgroups at 240.
            big = max(self.head_dim, self.head_dim_v) <= 64 and not self.mods.has_score
            object.__setattr__(self, "tile_m", 192 if big else 128)
        wgs = self.tile_m // 64
        regs = register_split(wgs, {1: 56, 3: 32}.get(wgs, 24))   # (tile_m: 64 to 256, checked below)
        if self.tile_order is None:
            object.__setattr__(self, "tile_order", "longest_first" if self.causal else "by_head")
        if self.tile_order not in ("by_head", "longest_first"):
            raise ValueError(f"tile_order must be 'by_head' or 'longest_first', got {self.tile_order!r}")
        if self.snake and (not self.max_ctas or self.cluster_m > 1):
            raise ValueError("snake orders persistent CTAs (max_ctas), without clusters")
        if self.tile_tickets and (not self.max_ctas or self.cluster_m > 1 or self.snake):
            raise ValueError("tile_tickets schedule persistent CTAs (max_ctas), without clusters or snake")
        if self.producer_regs is None:
            object.__setattr__(self, "producer_regs", regs[0])
        if self.consumer_regs is None:
            object.__setattr__(self, "consumer_regs", regs[1])
        self.check_dtype()
        for name in ("head_dim", "head_dim_v"):
            d = getattr(self, name)
            if d % 16 or not 16 <= d <= 256:
                raise ValueError(f"{name} must be a multiple of 16 in [16, 256], got {d}")
        if self.tile_m not in (64, 128, 192, 256):
            raise ValueError(f"tile_m must be 64, 128, 192 or 256, got {self.tile_m}")
        if self.tile_m == 256 and max(self.head_dim, self.head_dim_v) > 64:
            raise ValueError("tile_m=256 (4 consumer warpgroups at 112 regs) only fits head dims <= 64")
        if self.tile_m == 192 and max(self.head_dim, self.head_dim_v) > 96:
            raise ValueError("tile_m=192 (160 regs per warpgroup) only fits head dims <= 96")
        if self.tile_n % 16 != 0 or not 16 <= self.tile_n <= 256:
            raise ValueError(f"tile_n must be a multiple of 16 in [16, 256], got {self.tile_n}")
        if self.num_stages < 1:
            raise ValueError("num_stages must be >= 1")
        if self.sparse_block_m is None:
            object.__setattr__(self, "sparse_block_m", self.tile_m)
        if self.sparse_block_m % self.tile_m:
            raise ValueError(f"sparse_block_m {self.sparse_block_m} must be a multiple of tile_m {self.tile_m}")
        if self.block_sparse and self.sparse_block_n % self.tile_n:
            raise ValueError(f"sparse_block_n {self.sparse_block_n} must be a multiple of tile_n {self.tile_n}")
        if self.block_sparse + self.causal + self.band > 1:
            raise ValueError("causal, block_sparse and band are block structures: pick one")
        if not self.partial_blocks and not self.block_sparse:
            raise ValueError("partial_blocks=False is a choice of block_sparse lists")
        if self.band and band_of(self.mods) is None:
            raise ValueError("band=True needs a mask hook whose mask is a band of diagonals")
        if self.band_one_step and not (self.band and self.intra_wg_overlap):
            raise ValueError("band_one_step walks a band's blocks in the overlapped schedule: needs band=True "
                             "and intra_wg_overlap=True")
        if self.one_step_walk and (self.walks_partial_then_full or not self.intra_wg_overlap):
            raise ValueError("one_step_walk is a walk of the dense / causal structures in the overlapped schedule: "
                             "not with block_sparse or band, and needs intra_wg_overlap=True")
        if self.max_ctas < 0:
            raise ValueError(f"max_ctas must be >= 0, got {self.max_ctas}")
        if self.cluster_m not in (1, 2):
            raise ValueError(f"cluster_m must be 1 or 2, got {self.cluster_m}")
        if self.cluster_m > 1 and self.band:
            raise ValueError("cluster_m=2 needs the dense, causal or block-sparse structure (the"
                             " CTAs of a cluster load the same kv blocks; a band's rows differ)")
        if self.cluster_m > 1 and self.causal and self.tile_m != self.tile_n:
            raise ValueError("cluster_m=2 under causal needs tile_m == tile_n")
        if self.pingpong and self.tile_m == 64:
            raise ValueError("pingpong needs 2 to 4 consumer warpgroups (tile_m 128, 192 or 256)")
        if self.promote_pv is None:
            object.__setattr__(self, "promote_pv", self.tf32_passes == 3 and self.intra_wg_overlap)
        if self.promote_pv and not self.intra_wg_overlap:
            raise ValueError("promote_pv needs the overlapped schedule (intra_wg_overlap)")
        if self.promote_pv_pieces is None:
            object.__setattr__(self, "promote_pv_pieces", 2 if self.promote_pv and self.head_dim_v > 128 else 1)
        pieces = self.promote_pv_pieces
        if pieces < 1 or self.head_dim_v % (8 * pieces) or (pieces > 1 and not self.promote_pv):
            raise ValueError(f"promote_pv_pieces must divide the value head dim into multiples of 8 columns"
                             f" (and needs promote_pv), got {pieces} at {self.head_dim_v}")
        if self.exact_normalize is None:
            object.__setattr__(self, "exact_normalize", self.tf32_passes == 3)
        if self.s_promote is None:
            # Where S's second accumulator fits (ptxas, planned tiles: 64-row tiles, or up
            # to 64 keys with Dv <= D; 80/80 at 96 keys and 64/128 spill 368-672 bytes).
            # Pieces of 4 k-blocks (8 head-dim columns each); of 2 at head dim 32, where 4
            # would be the whole chain.
            fits = self.tile_m == 64 or (self.tile_n <= 64 and self.head_dim_v <= self.head_dim)
            pieces = 4 if self.head_dim > 32 else 2
            object.__setattr__(self, "s_promote", pieces if self.tf32_passes == 3 and fits else 0)
        if self.s_promote and (self.tf32_passes != 3 or self.s_promote < 0):
            raise ValueError(f"s_promote is 3xTF32's (tf32_passes=3), got {self.s_promote}")
        if self.rescale_o_early and (self.promote_pv or not self.intra_wg_overlap):
            raise ValueError("rescale_o_early needs the overlapped schedule without promote_pv")
        if self.tf32_passes not in (1, 3) or (self.tf32_passes == 3 and self.dtype != "fp32"):
            raise ValueError(f"tf32_passes must be 1, or 3 with dtype 'fp32', got {self.tf32_passes}")
        if self.maxima_on_demand and (self.rescale_threshold <= 0.0 or self.dtype == "fp32" or self.max_scores):
            raise ValueError("maxima_on_demand needs a rescale_threshold > 0, 16-bit inputs and no max_scores")
        if not 0.0 <= self.rescale_threshold <= 16.0:
            # (P up to 2^16 stays finite in fp16 and keeps float32's relative precision)
            raise ValueError(f"rescale_threshold must be in [0, 16], got {self.rescale_threshold}")
        if self.dtype == "fp32" and (self.cluster_m > 1 or self.tile_n % 8):
            raise ValueError("fp32 needs cluster_m=1 and tile_n a multiple of 8 (V's key groups)")

    @property
    def operand_parts(self) -> int:
        """Arrays per operand: 2 for 3xTF32 (tf32 hi and lo parts), else 1."""
        return 2 if self.tf32_passes == 3 else 1

    @property
    def separate_o(self) -> bool:
        """O is staged in its own shared buffer: persistent CTAs (the next tile's Q is
        loading) or a value head dim wider than Q's buffer."""
        return bool(self.max_ctas) or self.head_dim_v > self.head_dim

    @property
    def launch_lists(self) -> int:
        """int32 arrays the launch passes as `block_sparse`: the BlockMask's four kv-side
        lists (block_sparse), then the tile tickets' counter (tile_tickets)."""
        return 4 * self.block_sparse + self.tile_tickets

    @property
    def walks_partial_then_full(self) -> bool:
        """Block-sparse or band: each tile walks its partial blocks, then its full ones."""
        return self.block_sparse or self.band

    def cluster_fits(self, seqlen_q: int) -> bool:
        """Whether a call with `seqlen_q` queries may run this config (cluster_m tiles of
        a cluster must share their (batch, head))."""
        return -(-seqlen_q // self.tile_m) % self.cluster_m == 0


def shared_bytes(tile_m: int, tile_n: int, num_stages: int, head_dim: int, head_dim_v: int,
                 separate_o: bool, elem_bytes: int = 2, parts: int = 1) -> int:
    """The forward's shared memory (the kernel's SharedStorage: mbarriers, then Q, K, V and,
    if separate, O, each 1024-byte aligned), so planners can pick tiles that fit. ``parts``:
    arrays per operand (``FwdConfig.operand_parts``)."""
    size = 8 * (2 + 4 * num_stages) + 8   # mbarriers, tile slots
    for rows, cols, stages in ((tile_m, head_dim, parts), (tile_n, head_dim, num_stages * parts),
                               (tile_n, head_dim_v, num_stages * parts), (tile_m, head_dim_v, 1 if separate_o else 0)):
        if stages:
            size = -(-size // 1024) * 1024 + rows * cols * stages * elem_bytes
    return size


class FwdBarrier(NamedBarriers):
    EPILOGUE = 1   # the consumer warpgroups around the O staging
    TURN = 2       # 2 + w: warpgroup w's ping-pong turn to issue its GEMMs


class FlashFwdSm90(WarpSpecialized):
    """Compile with `cute.compile(FlashFwdSm90(cfg), q, k, v, o, lse, scale, args, stream)`
    or through `flexattn.kernels.launch.compile.compile_forward`."""

    def __init__(self, config: FwdConfig):
        super().__init__(config.tile_m // 64)
        self.cfg = config
        self.dtype = config.cutlass_dtype
        self.mods = config.mods
        self.fp32 = config.dtype == "fp32"
        kv_row_bytes = (config.head_dim + config.head_dim_v) * (self.dtype.width // 8) * config.operand_parts
        self.order = (LongestFirst(kv_row_bytes) if config.tile_order == "longest_first"
                      else ByHead())

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,          # [B, Hq, Sq, D] (fp32: [parts * B, ...], see the module doc)
        mK: cute.Tensor,          # [B, Hkv, Skv, D] (idem)
        mV: cute.Tensor,          # [B, Hkv, Skv, Dv] (fp32: V^T [parts * B, Hkv, Dv, Skv rounded up to 8])
        mO: cute.Tensor,          # [B, Hq, Sq, Dv]
        mLSE: cute.Tensor,        # [B, Hq, Sq] float32, natural log
        softmax_scale: Float32,
        mod_args,                 # tuple of runtime args for the mod hook, or None
        block_sparse,             # (kv_num_blocks, kv_indices, full_kv_num_blocks,
                                  #  full_kv_indices) int32, if cfg.block_sparse, then the
                                  #  tile tickets' int32 counter if cfg.tile_tickets; else None
        mMax,                     # [B, Hq, Sq] float32 iff cfg.max_scores (else None): per
                                  #  row, the max of the scaled, modded, masked scores
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        for t in (mQ, mK, mV, mO):
            if const_expr(t.element_type != self.dtype):
                raise TypeError(f"expected {self.dtype}, got {t.element_type}")
        if const_expr(mLSE.element_type != Float32):
            raise TypeError("LSE must be float32")
        if const_expr(bool(cfg.launch_lists) != (block_sparse is not None)):
            raise ValueError("block_sparse tensors must be given iff cfg.block_sparse or cfg.tile_tickets")
        if const_expr(cfg.max_scores != (mMax is not None)):
            raise ValueError("mMax must be given iff cfg.max_scores")

        # (S, D, H, B) views: the TMA box is (rows, D) and H, B index the tile.
        Q, K, V, O = [mma.select_modes(t, [2, 3, 1, 0]) for t in (mQ, mK, mV, mO)]
        # Row statistics out: LSE, then (cfg.max_scores) the max score; (S, H, B) views.
        stats = tuple(mma.select_modes(t, [2, 1, 0]) for t in (mLSE, mMax) if t is not None)

        tiled_mma_qk = mma.make_qk_mma(self.dtype, cfg.tile_m, cfg.tile_n)
        tiled_mma_pv = mma.make_pv_mma(self.dtype, cfg.tile_m, cfg.head_dim_v)

        parts = cfg.operand_parts
        sQ_layout = mma.smem_layout(self.dtype, cfg.tile_m, cfg.head_dim, parts if parts > 1 else None)
        sK_layout = mma.smem_layout(self.dtype, cfg.tile_n, cfg.head_dim, cfg.num_stages * parts)
        # V's tile as the PV MMA reads it: (keys, Dv), or fp32's V^T tile (Dv, keys), K-major.
        v_tile = (cfg.head_dim_v, cfg.tile_n) if const_expr(self.fp32) else (cfg.tile_n, cfg.head_dim_v)
        sV_layout = mma.smem_layout(self.dtype, *v_tile, cfg.num_stages * parts)
        sO_layout = mma.smem_layout(self.dtype, cfg.tile_m, cfg.head_dim_v)

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        g2s_kv = cpasync.CopyBulkTensorTileG2SMulticastOp() if cfg.cluster_m > 1 else g2s
        sQ_part = cute.select(sQ_layout, mode=[0, 1]) if const_expr(parts > 1) else sQ_layout
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(
            g2s, Q, sQ_part, (cfg.tile_m, cfg.head_dim))
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(
            g2s_kv, K, cute.select(sK_layout, mode=[0, 1]), (cfg.tile_n, cfg.head_dim), cfg.cluster_m)
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(
            g2s_kv, V, cute.select(sV_layout, mode=[0, 1]), v_tile, cfg.cluster_m)
        # O goes out through sQ's buffer once Q is dead (where it fits: head_dim_v <= head_dim).
        tma_atom_O, tma_O = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), O, sO_layout, (cfg.tile_m, cfg.head_dim_v))

        # Bytes per ring stage (every part of an operand arrives on the stage's barrier).
        self.bytes_q = cute.size_in_bytes(self.dtype, sQ_layout)
        self.bytes_k = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1])) * parts
        self.bytes_v = cute.size_in_bytes(self.dtype, cute.select(sV_layout, mode=[0, 1])) * parts

        @cute.struct
        class SharedStorage:
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * cfg.num_stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * cfg.num_stages]
            tile_slots: cute.struct.MemRange[Int32, 2]   # tile tickets (TileTickets)
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            if const_expr(cfg.separate_o):   # persistent: O must not overwrite the next Q
                sO: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sO_layout)], 1024]

        # A layout past the limit would compile and then fail at launch ("invalid
        # argument"): refuse it here, before any launch.
        if const_expr(SharedStorage.size_in_bytes() > mma.SMEM_CAPACITY):
            raise ValueError(
                f"forward shared memory: {SharedStorage.size_in_bytes()} bytes > {mma.SMEM_CAPACITY} (sm_90);"
                f" use a smaller tile_n ({cfg.tile_n}) or num_stages ({cfg.num_stages}), or max_ctas=0"
                " (persistent CTAs need a separate O buffer)")

        # With a score mod the kernel scales s itself before the hook; exp2 then needs
        # only log2(e). Without one, scale * log2(e) folds into the exp2 argument.
        scale_log2 = Float32(LOG2_E)
        if const_expr(not self.mods.has_score):
            scale_log2 = softmax_scale * Float32(LOG2_E)

        # O's batch count: fp32's 3xTF32 operands stack two parts along Q's batch dim.
        batch = O.shape[3] if const_expr(parts > 1) else Q.shape[3]
        grid = grid_size((Q.shape[0] + cfg.tile_m - 1) // cfg.tile_m * Q.shape[2] * batch,
                         cfg.max_ctas - cfg.max_ctas % cfg.cluster_m)
        self.kernel(
            tma_Q, tma_K, tma_V, tma_O, stats,
            tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O,
            tiled_mma_qk, tiled_mma_pv,
            sQ_layout, sK_layout, sV_layout, sO_layout,
            softmax_scale, scale_log2, mod_args, block_sparse,
            SharedStorage,
        ).launch(
            grid=grid,
            block=[self.num_threads, 1, 1],
            cluster=[cfg.cluster_m, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
        )

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mO: cute.Tensor, stats,
        tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom,
        tma_atom_V: cute.CopyAtom, tma_atom_O: cute.CopyAtom,
        tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout, sO_layout: cute.ComposedLayout,
        softmax_scale: Float32, scale_log2: Float32, mod_args, block_sparse,
        SharedStorage: cutlass.Constexpr,
    ):
        cfg = self.cfg
        warp_idx = self.warp_index()
        self.prefetch_descriptors(warp_idx, (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_O))
        tickets = None
        if const_expr(cfg.tile_tickets):
            tickets = block_sparse[-1]
            block_sparse = block_sparse[:-1] if const_expr(cfg.block_sparse) else None
        if const_expr(cfg.band):
            block_sparse = band_bounds(self.mods, mod_args)   # (lo, hi), Int32: see _tile

        storage = self.allocate(SharedStorage)
        n = self.num_mma_threads
        pipe_q = tma_ring(storage.mbar_q.data_ptr(), 1, n, self.bytes_q)
        pipe_k = tma_ring(storage.mbar_k.data_ptr(), cfg.num_stages, n, self.bytes_k, cfg.cluster_m)
        pipe_v = tma_ring(storage.mbar_v.data_ptr(), cfg.num_stages, n, self.bytes_v, cfg.cluster_m)
        self.rings_init_arrive(cfg.cluster_m)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        if const_expr(cfg.separate_o):
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        else:   # one tile per CTA: O is staged in Q's buffer once Q is dead
            sO = storage.sQ.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)

        seqlen_q = mQ.shape[0]
        seqlen_k = mK.shape[0]
        batch = mO.shape[3] if const_expr(cfg.operand_parts > 1) else mQ.shape[3]
        tiles = TileSpace((seqlen_q + cfg.tile_m - 1) // cfg.tile_m, mQ.shape[2], batch, seqlen_k)
        if const_expr(cfg.tile_tickets):
            tiles.tickets = TileTickets(tickets, storage.tile_slots.get_tensor(cute.make_layout(2)), tiles)

        self.rings_init_wait(cfg.cluster_m)

        regs = (cfg.producer_regs, cfg.consumer_regs)
        if self.is_producer(warp_idx):
            self.enter_producer(regs)
            if warp_idx == 0:
                self.load(mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V,
                          pipe_q, pipe_k, pipe_v, tiles, seqlen_k, block_sparse)
        else:
            self.enter_consumer(regs)
            self.consume(mO, stats, sQ, sK, sV, sO, tma_atom_O, tiled_mma_qk, tiled_mma_pv,
                         pipe_q, pipe_k, pipe_v, tiles, seqlen_q, seqlen_k,
                         block_sparse, softmax_scale, scale_log2, mod_args)

    @cute.jit
    def _tile(self, tiles: TileSpace, idx: Int32, seqlen_k: Int32, block_sparse):
        """(m_block, head, batch, blocks) of linear tile `idx`."""
        if const_expr(self._pairs_rows()):
            # The order places pairs of rows (2r + 1, 2r); the cluster's rank 0 takes the
            # upper one (the longer walk under causal).
            pairs = TileSpace(tiles.rows // 2, tiles.heads, tiles.batch, tiles.kv_len)
            row_pair, head, batch = self.order.tile(idx // 2, pairs)
            m_block = 2 * row_pair + 1 - idx % 2
        else:
            m_block, head, batch = self.order.tile(tiles.snake(idx) if const_expr(self.cfg.snake) else idx, tiles)
        if const_expr(self.cfg.block_sparse):
            rows_per_block = self.cfg.sparse_block_m // self.cfg.tile_m
            row = m_block // rows_per_block if const_expr(rows_per_block > 1) else m_block
            blocks = SparseBlocks(block_sparse, batch, head, row, self.cfg.sparse_block_n // self.cfg.tile_n,
                                  with_partial=self.cfg.partial_blocks)
        elif const_expr(self.cfg.band):   # `block_sparse` holds the band's bounds
            blocks = BandBlocks(block_sparse, m_block, self.cfg.tile_m, self.cfg.tile_n, seqlen_k)
        else:
            blocks = DenseBlocks(self._n_block_max(m_block, seqlen_k))
        return m_block, head, batch, blocks

    def _pairs_rows(self) -> bool:
        """Whether tiles are ordered in pairs of rows (a cluster under causal): a plain
        order would pair rows of different heads whenever its fastest index is the head
        (longest-first). Dense clusters keep the order: by-head pairs adjacent rows anyway."""
        return self.cfg.cluster_m > 1 and self.cfg.causal

    @cute.jit
    def _blocks_for_peer(self, m_block: Int32, seqlen_k: Int32) -> Int32:
        """Leading kv blocks the cluster pair's upper tile visits and this one does not
        (causal cluster; 0 for the upper tile): loaded for the peer, skipped here."""
        upper = m_block + 1 - m_block % 2
        return self._n_block_max(upper, seqlen_k) - self._n_block_max(m_block, seqlen_k)

    @cute.jit
    def _n_block_max(self, m_block: Int32, seqlen_k: Int32) -> Int32:
        cfg = self.cfg
        n_max = (seqlen_k + cfg.tile_n - 1) // cfg.tile_n
        if const_expr(cfg.causal):
            # Last kv column any row of this tile may see (top-left aligned: kv <= q).
            n_max = cutlass.min(n_max, ((m_block + 1) * cfg.tile_m + cfg.tile_n - 1) // cfg.tile_n)
        return n_max

    @cute.jit
    def load(self, mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V,
             pipe_q, pipe_k, pipe_v, tiles, seqlen_k, block_sparse):
        """Producer warp: Q and the visited K/V blocks of each of this CTA's tiles. The
        ring's state runs on across tiles, so a persistent CTA's next tile streams in
        while the consumers finish this one."""
        cfg = self.cfg
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.num_stages)
        group = mQ.shape[2] // mK.shape[2]
        operands = (mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V, pipe_q, pipe_k, pipe_v, tiles.batch)
        if const_expr(cfg.tile_tickets):
            idx, total = tiles.first, tiles.total
            count = Int32(0)
            while idx < total:
                q_state, kv_state, idx = self._load_ticketed_tile(
                    operands, tiles, idx, count, group, seqlen_k, block_sparse, q_state, kv_state)
                count += 1
            # No tile left: the next Q slot's barrier completes with an arrive and no bytes;
            # the consumers then find an index past the end in the slot.
            pipe_q.sync_object_empty.wait(q_state.index, q_state.phase)
            if cute.arch.lane_idx() == 0:
                cute.arch.mbarrier_arrive(pipe_q.producer_get_barrier(q_state))
        elif const_expr(cfg.max_ctas):
            for idx in cutlass.range(tiles.first, tiles.total, tiles.stride, unroll=1):
                q_state, kv_state = self._load_tile(
                    operands, tiles, idx, group, seqlen_k, block_sparse, q_state, kv_state)
        else:   # one tile per CTA: no loop (its carried state costs registers)
            q_state, kv_state = self._load_tile(
                operands, tiles, tiles.first, group, seqlen_k, block_sparse, q_state, kv_state)
        if const_expr(cfg.cluster_m > 1):
            # The peer CTA's consumers still arrive on our empty barriers: stay until every
            # slot has been released by both CTAs, so no arrive targets an exited CTA.
            pipe_k.producer_tail(kv_state.clone())
            pipe_v.producer_tail(kv_state.clone())

    @cute.jit
    def _load_ticketed_tile(self, operands, tiles, idx, count, group, seqlen_k, block_sparse, q_state, kv_state):
        """Load tile `idx` (this CTA's tile number `count`), then draw the next one's ticket."""
        q_state, kv_state = self._load_tile(operands, tiles, idx, group, seqlen_k, block_sparse, q_state, kv_state)
        return q_state, kv_state, tiles.tickets.draw(count)

    @cute.jit
    def _load_tile(self, operands, tiles, idx, group, seqlen_k, block_sparse, q_state, kv_state):
        """Issue linear tile `idx`'s loads: its Q and the K/V blocks it visits."""
        cfg = self.cfg
        m_block, head, batch, blocks = self._tile(tiles, idx, seqlen_k, block_sparse)
        head_kv = head // group
        mQ, mK, mV, sQ, sK, sV, tma_atom_Q, tma_atom_K, tma_atom_V, pipe_q, pipe_k, pipe_v, n_batch = operands
        one = cute.make_layout(1)
        # Cluster: this CTA's slice of each K/V block (it multicasts it to both CTAs).
        rank, pair, multicast = multicast_slice(cfg.cluster_m)
        # Per operand part (3xTF32: hi at `batch`, lo at `batch + n_batch`): the global
        # tiles' TMA partitions; the smem side is one tensor whose last mode is
        # stage * parts + part.
        tQgQ, tKgK, tVgV = [], [], []
        for part in cutlass.range_constexpr(cfg.operand_parts):
            b = batch + part * n_batch if const_expr(part) else batch
            gQ = cute.local_tile(mQ[None, None, head, b], (cfg.tile_m, cfg.head_dim), (m_block, 0))
            gK = cute.local_tile(mK[None, None, head_kv, b], (cfg.tile_n, cfg.head_dim), (None, 0))
            if const_expr(self.fp32):   # V^T: (Dv, keys) tiles
                gV = cute.local_tile(mV[None, None, head_kv, b], (cfg.head_dim_v, cfg.tile_n), (0, None))
            else:
                gV = cute.local_tile(mV[None, None, head_kv, b], (cfg.tile_n, cfg.head_dim_v), (None, 0))
            tQsQ, g = cpasync.tma_partition(
                tma_atom_Q, 0, one, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
            tQgQ.append(g)
            tKsK, g = cpasync.tma_partition(
                tma_atom_K, rank, pair, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
            tKgK.append(g)
            tVsV, g = cpasync.tma_partition(
                tma_atom_V, rank, pair, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
            tVgV.append(g)

        k_src = (pipe_k, tma_atom_K, tKgK, tKsK, multicast)
        v_src = (pipe_v, tma_atom_V, tVgV, tVsV, multicast)
        if const_expr(self._pairs_rows()):
            blocks = DenseBlocks(blocks.count + self._blocks_for_peer(m_block, mK.shape[0]))
        n = blocks.count
        # K_0 first: its slot may free up before the consumers release the previous Q.
        if const_expr(cfg.intra_wg_overlap):
            if n > 0:
                self._load_block(k_src, blocks.at(0), kv_state)
        pipe_q.producer_acquire(q_state)
        if const_expr(cfg.operand_parts == 1):
            cute.copy(tma_atom_Q, tQgQ[0], tQsQ, tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
        else:
            for part in cutlass.range_constexpr(cfg.operand_parts):
                cute.copy(tma_atom_Q, tQgQ[part], tQsQ[None, part], tma_bar_ptr=pipe_q.producer_get_barrier(q_state))
        q_state.advance()
        if const_expr(not cfg.intra_wg_overlap):
            for i in cutlass.range(n, unroll=1):
                n_block = blocks.at(i)
                self._load_block(k_src, n_block, kv_state)
                self._load_block(v_src, n_block, kv_state)
                kv_state.advance()
        else:
            # The consumers want K_j before V_{j-1}: issue in that order.
            for i in cutlass.range(1, n, unroll=1):
                v_state = kv_state.clone()
                kv_state.advance()
                self._load_block(k_src, blocks.at(i), kv_state)
                self._load_block(v_src, blocks.at(i - 1), v_state)
            if n > 0:
                self._load_block(v_src, blocks.at(n - 1), kv_state)
                kv_state.advance()
        return q_state, kv_state

    @cute.jit
    def _load_block(self, src, n_block, state):
        """TMA one K or V block into the ring slot of `state` (waits for the slot)."""
        pipe, atom, tXgX, tXsX, multicast = src
        pipe.producer_acquire(state)
        parts = self.cfg.operand_parts
        for part in cutlass.range_constexpr(parts):
            slot = state.index * parts + part if const_expr(parts > 1) else state.index
            cute.copy(atom, tXgX[part][None, n_block], tXsX[None, slot],
                      tma_bar_ptr=pipe.producer_get_barrier(state), **multicast)

    @cute.jit
    def consume(self, mO, stats, sQ, sK, sV, sO, tma_atom_O, tiled_mma_qk, tiled_mma_pv,
                pipe_q, pipe_k, pipe_v, tiles, seqlen_q, seqlen_k,
                block_sparse, softmax_scale, scale_log2, mod_args):
        cfg = self.cfg
        if const_expr(mod_args is None):
            mod_args = ()
        tidx = cute.arch.thread_idx()[0] - 128
        wg = cute.arch.make_warp_uniform(tidx // 128)
        # wgmma operands are partitioned per warpgroup; accumulators per thread.
        wg_first_thread = cute.make_layout(self.num_mma_wg, stride=128)(wg)
        wg_qk = tiled_mma_qk.get_slice(wg_first_thread)
        wg_pv = tiled_mma_pv.get_slice(wg_first_thread)
        thr_qk = tiled_mma_qk.get_slice(tidx)
        thr_pv = tiled_mma_pv.get_slice(tidx)

        # 3xTF32: (hi, lo) parts of Q and of P.
        if const_expr(cfg.operand_parts == 1):
            tSrQ = wg_qk.make_fragment_A(wg_qk.partition_A(sQ))
        else:
            tSrQ = tuple(wg_qk.make_fragment_A(wg_qk.partition_A(sQ[None, None, p])) for p in range(2))
        tSrK = wg_qk.make_fragment_B(wg_qk.partition_B(sK))
        if const_expr(self.fp32):   # sV holds V^T tiles already
            tOrVt = wg_pv.make_fragment_B(wg_pv.partition_B(sV))
        else:
            tOrVt = wg_pv.make_fragment_B(wg_pv.partition_B(mma.transpose_view(sV)))
        p_shape = wg_pv.partition_shape_A((cfg.tile_m, cfg.tile_n))
        if const_expr(cfg.operand_parts == 1):
            tOrP = wg_pv.make_fragment_A(p_shape)
        else:
            tOrP = tuple(wg_pv.make_fragment_A(p_shape) for _ in range(2))
        acc_shape_S = wg_qk.partition_shape_C((cfg.tile_m, cfg.tile_n))
        acc_O = cute.make_rmem_tensor(wg_pv.partition_shape_C((cfg.tile_m, cfg.head_dim_v)), Float32)
        softmax = OnlineSoftmax(scale_log2, cute.size(mma.acc_mn_view(acc_O).shape[0]),
                                defer_o_scale=cfg.rescale_o_early, rescale_threshold=cfg.rescale_threshold,
                                track_max=cfg.max_scores)
        if const_expr(cfg.promote_pv):   # (O, this block's P V): see FwdConfig.promote_pv
            if const_expr(cfg.promote_pv_pieces == 1):
                acc_O = (acc_O, cute.make_rmem_tensor_like(acc_O))
            else:
                acc_O = (acc_O, self._pv_pieces(sV, wg_first_thread, acc_O))

        coords = FragmentCoords(thr_qk, cfg.tile_m, cfg.tile_n, mma.acc_mn_view)

        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.num_stages)
        if const_expr(cfg.pingpong):
            # Warpgroup 0 holds the first turn. Turns pass once per visited block after
            # the first, in both warpgroups alike, so the last pass of a tile is the
            # next tile's first turn.
            if wg == 0:
                FwdBarrier.TURN.arrive(256)

        fixed = _Consumer(tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt, tOrP, acc_shape_S, acc_O,
                          softmax, coords, pipe_k, pipe_v)
        out = (mO, stats, sO, tma_atom_O, tiled_mma_pv, thr_pv, tidx)
        if const_expr(cfg.tile_tickets):
            idx, total = tiles.first, tiles.total
            count = Int32(0)
            while idx < total:
                q_state, kv_state = self._consume_tile(
                    fixed, out, tiles, idx, seqlen_q, seqlen_k, block_sparse, softmax_scale,
                    mod_args, wg, pipe_q, q_state, kv_state)
                count += 1
                # The next tile's Q (or the producer's end signal) names the next tile;
                # its wait in _consume_tile then returns at once.
                idx = self._next_ticketed(tiles, pipe_q, q_state, count)
        elif const_expr(cfg.max_ctas):
            for idx in cutlass.range(tiles.first, tiles.total, tiles.stride, unroll=1):
                q_state, kv_state = self._consume_tile(
                    fixed, out, tiles, idx, seqlen_q, seqlen_k, block_sparse, softmax_scale,
                    mod_args, wg, pipe_q, q_state, kv_state)
        else:   # one tile per CTA: no loop (its carried state costs registers)
            self._consume_tile(fixed, out, tiles, tiles.first, seqlen_q, seqlen_k, block_sparse,
                               softmax_scale, mod_args, wg, pipe_q, q_state, kv_state)
        if tidx // 32 == 0:
            # The last O store must finish reading shared memory before the CTA exits.
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def _next_ticketed(self, tiles, pipe_q, q_state, count) -> Int32:
        """Consumers: the index of this CTA's tile number `count` (past the end: none)."""
        pipe_q.consumer_wait(q_state)
        return cute.arch.make_warp_uniform(tiles.tickets.read(count))

    @cute.jit
    def _consume_tile(self, fixed, out, tiles, idx, seqlen_q, seqlen_k, block_sparse,
                      softmax_scale, mod_args, wg, pipe_q, q_state, kv_state):
        """Linear tile `idx`: main loop over its kv blocks, then the epilogue."""
        cfg = self.cfg
        m_block, head, batch, blocks = self._tile(tiles, idx, seqlen_k, block_sparse)
        ctx = _Step(*fixed, m_block, head, batch, seqlen_q, seqlen_k, softmax_scale, mod_args, wg)
        acc_O, softmax = fixed.acc_O, fixed.softmax
        if const_expr(cfg.promote_pv):   # P V stays 0 until the first block's lands
            if const_expr(cfg.promote_pv_pieces == 1):
                acc_O[1].fill(0.0)
            acc_O = acc_O[0]
        acc_O.fill(0.0)
        if const_expr(self._pairs_rows()):
            kv_state = self._skip_blocks(ctx, kv_state, self._blocks_for_peer(m_block, seqlen_k))
        pipe_q.consumer_wait(q_state)
        if const_expr(not cfg.intra_wg_overlap):
            self._turn_wait(wg)
        if const_expr(cfg.walks_partial_then_full):
            kv_state = self._visit_sparse(ctx, kv_state, blocks)
        elif const_expr(self._walks_in_one_step()):
            kv_state = self._visit_blocks_one_step(ctx, kv_state, m_block, blocks.count)
        else:
            kv_state = self._visit_blocks(ctx, kv_state, m_block, blocks.count)
            if const_expr(cfg.intra_wg_overlap):
                kv_state = self._last_pv(ctx, kv_state)
        if const_expr(not cfg.intra_wg_overlap):
            self._turn_pass(wg)
        # Every Q K^T of this tile has completed: the producer may load the next Q.
        pipe_q.consumer_release(q_state)
        q_state.advance()
        mO, stats, sO, tma_atom_O, tiled_mma_pv, thr_pv, tidx = out
        self.epilogue(acc_O, softmax, mO, stats, sO, tma_atom_O, tiled_mma_pv, thr_pv, tidx,
                      m_block, head, batch, seqlen_q)
        return q_state, kv_state

    @cute.jit
    def _skip_blocks(self, ctx, kv_state, count: Int32, turns: cutlass.Constexpr[bool] = False):
        """Release `count` K/V stages unread (blocks loaded only for the cluster peer, or
        wholly right of this warpgroup's rows: `turns`, their ping-pong turns taken without
        GEMMs, so every warpgroup passes the same number per tile)."""
        pipe_k, pipe_v = ctx.pipe_k, ctx.pipe_v
        for _ in cutlass.range(count, unroll=1):
            pipe_k.consumer_wait(kv_state)
            if const_expr(turns):
                self._turn_wait(ctx.wg)
                self._turn_pass(ctx.wg)
            pipe_k.consumer_release(kv_state)
            pipe_v.consumer_wait(kv_state)
            pipe_v.consumer_release(kv_state)
            kv_state.advance()
        return kv_state

    # Ping-pong: warpgroup w may issue GEMMs once barrier TURN + w has seen
    # the previous warpgroup's arrival; after issuing it passes the turn to the next one
    # (0 -> 1 -> 0, or 0 -> 1 -> 2 -> 0 with three consumer warpgroups). The softmax of
    # one warpgroup then runs while the other's GEMMs occupy the tensor cores.
    def _turn_wait(self, wg):
        if const_expr(self.cfg.pingpong):
            FwdBarrier.TURN.sync(256, wg)

    def _turn_pass(self, wg):
        if const_expr(self.cfg.pingpong):
            nxt = 1 - wg
            if const_expr(self.num_mma_wg > 2):
                nxt = (wg + 1) % self.num_mma_wg
            FwdBarrier.TURN.arrive(256, nxt)

    def _own_diagonal(self) -> bool:
        """Whether each consumer warpgroup walks a causal tile to its own rows' diagonal
        (`FwdConfig.own_diagonal`): where a block can lie wholly right of one warpgroup's
        rows (tile_n not a multiple of tile_m), with the overlapped schedule."""
        cfg = self.cfg
        return (cfg.own_diagonal and cfg.causal and self.num_mma_wg > 1 and cfg.intra_wg_overlap
                and cfg.tile_n % cfg.tile_m != 0)

    @cute.jit
    def _own_blocks(self, ctx, kv_state, m_block, n_block_max):
        """This warpgroup's part of a tile's walk: under `_own_diagonal`, the leading
        blocks wholly right of its last row released unread. Returns the stage of its first
        block, its block count and the first row whose diagonal bounds its masked blocks
        (top-left aligned: kv <= q); else the tile's own (nothing released)."""
        cfg = self.cfg
        first_row = m_block * cfg.tile_m
        if const_expr(self._own_diagonal()):
            first_row = first_row + ctx.wg * 64
            own_max = cutlass.min(n_block_max, (first_row + 64 + cfg.tile_n - 1) // cfg.tile_n)
            kv_state = self._skip_blocks(ctx, kv_state, n_block_max - own_max, turns=True)
            n_block_max = own_max
        return kv_state, n_block_max, first_row

    @cute.jit
    def _visit_blocks(self, ctx, kv_state, m_block, n_block_max):
        """Enumerate kv blocks (last first) and pick, per block, which masks to evaluate.
        The producer's `load` visits the same blocks in the same order."""
        cfg = self.cfg
        mods = self.mods
        kv_state, n_block_max, first_row = self._own_blocks(ctx, kv_state, m_block, n_block_max)
        # First block: masks always evaluated (it may cross the diagonal); the KV_LEN
        # bound only if it straddles KV_LEN, checked at run time.
        kv_state = self._block(ctx, kv_state, n_block_max - 1, is_first=True,
                               mask=mods.has_mask, causal=cfg.causal and not mods.has_mask,
                               kv_bound="first")
        n_rest = n_block_max - 1
        if const_expr(cfg.causal and cfg.tile_n % cfg.tile_m != 0):
            # Blocks >= n_diag contain some kv > the first row's q (the tile's, or this
            # warpgroup's under _own_diagonal): mask needed. When
            # tile_n is a multiple of tile_m (128 x 128) only the first block can: every
            # later one ends before the tile's first row, and this loop would never run.
            n_diag = (first_row + 1) // cfg.tile_n
            for i in cutlass.range(n_block_max - 1 - n_diag, unroll=1):
                kv_state = self._block(ctx, kv_state, n_block_max - 2 - i, is_first=False,
                                       mask=mods.has_mask, causal=not mods.has_mask,
                                       kv_bound=False)
            n_rest = cutlass.min(n_rest, n_diag)
        # Remaining blocks: full under causal; under the dense structure a mask hook
        # must still be evaluated everywhere.
        for i in cutlass.range(n_rest, unroll=1):
            kv_state = self._block(ctx, kv_state, n_rest - 1 - i, is_first=False,
                                   mask=mods.has_mask and not cfg.causal, causal=False,
                                   kv_bound=False)
        return kv_state

    def _walks_in_one_step(self) -> bool:
        """Whether the dense / causal structures walk their blocks with one step for every
        block (`_visit_blocks_one_step`): with the overlapped schedule, when a hook is
        emitted. A peeled first block would be a second copy of the hooks and the softmax
        (compile time: causal+softcap 2456 -> 1976 SASS instructions); without hooks that
        copy is smaller (causal D128 2400 -> 2128) and the kernels keep their peeled first
        block unless `FwdConfig.one_step_walk` asks."""
        mods = self.mods
        return self.cfg.intra_wg_overlap and (mods.has_score or mods.has_mask or self.cfg.one_step_walk)

    @cute.jit
    def _visit_blocks_one_step(self, ctx, kv_state, m_block, n_block_max):
        """`_visit_blocks` (same blocks, same order) with one overlapped step for all of
        them. The hooks run on every block (kv clamped where they read a buffer at kv);
        the per-row limits (causal diagonal, KV_LEN) only on the first block and, under
        causal, on blocks crossing the diagonal, decided at run time."""
        cfg = self.cfg
        softmax = ctx.softmax
        softmax.reset()
        kv_state, n_block_max, first_row = self._own_blocks(ctx, kv_state, m_block, n_block_max)
        n_diag = n_block_max - 1     # blocks >= n_diag cross the diagonal (causal)
        if const_expr(cfg.causal):
            n_diag = cutlass.min(n_diag, (first_row + 1) // cfg.tile_n)
        v_state = kv_state.clone()
        for i in cutlass.range(n_block_max, unroll=1):
            n_block = n_block_max - 1 - i
            kv_state, v_state = self._visit_step(ctx, kv_state, v_state, n_block, i > 0,
                                                  mask=self.mods.has_mask, partial=n_block >= n_diag,
                                                  kv_bound="limits")
        if n_block_max > 0:
            self._last_pv(ctx, v_state, advance=False)
        return kv_state

    @cute.jit
    def _visit_sparse(self, ctx, kv_state, blocks):
        """Block-sparse structure: partial blocks (mask evaluated), then full blocks (no
        mask). Counts are runtime values and may be 0. Any block may be the one straddling
        KV_LEN: partial blocks check the bound per element next to their mask; full blocks
        check at run time whether they straddle it, so the others pay nothing."""
        softmax = ctx.softmax
        has_mask = self.mods.has_mask
        softmax.reset()       # the first visit may be any block, or there may be none
        n_p, n_f = blocks.n_partial, blocks.n_full
        partial = self.cfg.partial_blocks   # (False: no partial list, no step for it)
        if const_expr(not self.cfg.intra_wg_overlap):
            if const_expr(partial):
                for i in cutlass.range(n_p, unroll=1):
                    kv_state = self._step(ctx, kv_state, blocks.partial_at(i), is_first=False,
                                          mask=has_mask, causal=False, kv_bound=True, may_be_first=True)
            for i in cutlass.range(n_f, unroll=1):
                kv_state = self._step(ctx, kv_state, blocks.full_at(i), is_first=False,
                                      mask=False, causal=False, kv_bound="tail", may_be_first=not partial)
        else:
            # One step per kind of block, each serving every visit of its kind, the first
            # included (it skips the P V of a previous block at run time): a peeled first
            # visit would be a third copy of the mods and the softmax (compile time).
            # Partial blocks, then full ones, in loops of their own: one step for both
            # with a run-time `partial` branched around the mask, read both lists per
            # block, and kept the softmax from starting before the branch ended.
            # With the maxima on demand, a row's first visit votes first (no wasted pass of
            # exponentials against -inf) in the partial loop, and in the full loop only
            # where there is no partial list: elsewhere a tile rarely starts with a full
            # block, and the full loop (a band's bulk) keeps the step without that vote.
            v_state = kv_state.clone()
            if const_expr(self.cfg.band_one_step):
                # A band's blocks by arithmetic (`BandBlocks.at`: no list to read), in the
                # same order, through one step; whether a block is partial is a run-time value.
                for i in cutlass.range(blocks.count, unroll=1):
                    kv_state, v_state = self._visit_step(ctx, kv_state, v_state, blocks.at(i), i > 0,
                                                          mask=has_mask, partial=i < n_p)
            else:
                if const_expr(partial):
                    for i in cutlass.range(n_p, unroll=1):
                        kv_state, v_state = self._visit_step(ctx, kv_state, v_state, blocks.partial_at(i), i > 0,
                                                              mask=has_mask, partial=True)
                for i in cutlass.range(n_f, unroll=1):
                    kv_state, v_state = self._visit_step(ctx, kv_state, v_state, blocks.full_at(i), n_p + i > 0,
                                                          mask=has_mask, partial=False, may_be_first=not partial)
            if n_p + n_f > 0:
                self._last_pv(ctx, v_state, advance=False)
        return kv_state

    @cute.jit
    def _block(self, ctx, kv_state, n_block, is_first: cutlass.Constexpr[bool],
               mask: cutlass.Constexpr[bool], causal: cutlass.Constexpr[bool],
               kv_bound: cutlass.Constexpr):
        flags = dict(mask=mask, causal=causal, kv_bound=kv_bound)
        if const_expr(not self.cfg.intra_wg_overlap):
            return self._step(ctx, kv_state, n_block, is_first, **flags)
        elif const_expr(is_first):
            return self._first_half(ctx, kv_state, n_block, **flags)
        else:
            # Block j's stage follows block j-1's (`kv_state`); the step hands back both.
            this = kv_state.clone()
            this.advance()
            _, kv_state = self._visit_step(ctx, this, kv_state, n_block, True, partial=None, may_be_first=False,
                                           **flags)
            return kv_state

    @cute.jit
    def _scores(self, ctx, acc_S, n_block, mask: cutlass.Constexpr[bool],
                causal: cutlass.Constexpr[bool], kv_bound: cutlass.Constexpr, partial=None):
        """Score mod and masks on a finished S tile.

        kv_bound, how the KV_LEN edge is handled:
          True     check every element (block-sparse partial blocks: any may straddle it);
          "first"  the first block of the dense / causal structures: whether it straddles
                   KV_LEN is decided once at run time, and only then are elements checked
                   (the hooks are traced once unless they read a buffer at kv);
          "tail"   hooks see kv clamped to KV_LEN - 1; the bound alone is applied if the
                   block straddles KV_LEN (block-sparse full blocks);
          "sparse" a block of the block-sparse structure: True with the mask if `partial`
                   (run time), else "tail" without it;
          "limits" any block of the dense / causal structures walked in one step: the
                   hooks (kv clamped if they read a buffer at kv), then, if `partial`
                   (run time: the first block, or one crossing the diagonal), the
                   causal and KV_LEN limits;
          False    the block lies below KV_LEN."""
        if const_expr(kv_bound == "limits"):
            self._masks(ctx, acc_S, n_block, mask, causal=False, kv_bound=False,
                        clamp_kv=self._hooks_clamp_kv(mask))
            if partial:
                self._mask_past_limits(ctx, acc_S, n_block, causal=self.cfg.causal, kv_bound=True)
        elif const_expr(kv_bound == "sparse"):
            if partial:
                if const_expr(self.cfg.band and mask):
                    # The mask is exactly the band: its two edges and KV_LEN as per-row
                    # column limits (the score mod alone through the hooks).
                    self._masks(ctx, acc_S, n_block, False, causal=False, kv_bound=False, clamp_kv=True)
                    self._mask_band(ctx, acc_S, n_block)
                else:
                    self._masks(ctx, acc_S, n_block, mask, causal, kv_bound=True)
            else:
                self._scores(ctx, acc_S, n_block, False, causal, "tail")
        elif const_expr(kv_bound == "first" and self._hooks_clamp_kv(mask)):
            if (n_block + 1) * self.cfg.tile_n > ctx.seqlen_k:
                self._masks(ctx, acc_S, n_block, mask, causal, kv_bound=True)
            else:
                self._masks(ctx, acc_S, n_block, mask, causal, kv_bound=False)
        elif const_expr(kv_bound == "first"):
            # The hooks read no buffer at kv: one copy of them serves both cases. The
            # causal limit takes KV_LEN in at once (a min per row; on a block below KV_LEN
            # it changes nothing); without it, the bound alone if the block straddles KV_LEN.
            self._masks(ctx, acc_S, n_block, mask, causal=False, kv_bound=False)
            if const_expr(causal):
                self._mask_past_limits(ctx, acc_S, n_block, causal=True, kv_bound=True)
            elif (n_block + 1) * self.cfg.tile_n > ctx.seqlen_k:
                self._mask_past_limits(ctx, acc_S, n_block, causal=False, kv_bound=True)
        elif const_expr(kv_bound == "tail" and self.cfg.kv_aligned):
            self._masks(ctx, acc_S, n_block, mask, causal, kv_bound=False)
        elif const_expr(kv_bound == "tail"):
            self._masks(ctx, acc_S, n_block, mask, causal, kv_bound=False, clamp_kv=True)
            if (n_block + 1) * self.cfg.tile_n > ctx.seqlen_k:   # the bound alone
                self._mask_past_limits(ctx, acc_S, n_block, causal=False, kv_bound=True)
        else:
            self._masks(ctx, acc_S, n_block, mask, causal, kv_bound=kv_bound)

    def _hooks_clamp_kv(self, mask: bool) -> bool:
        """Whether the hooks this block runs (the score mod, and the mask if `mask`) read a
        buffer at kv, so they must see kv clamped where the block may pass KV_LEN."""
        mods = self.mods
        return "kv" in mods.load_index_vars(mods.has_score, mask)

    @cute.jit
    def _masks(self, ctx, acc_S, n_block, mask: cutlass.Constexpr[bool],
               causal: cutlass.Constexpr[bool], kv_bound: cutlass.Constexpr[bool],
               clamp_kv: cutlass.Constexpr[bool] = False):
        """Hooks (score mod, mask mod) through apply_mods, then the built-in causal mask
        and the KV_LEN bound as per-row column limits."""
        coords, m_block, head, batch = ctx.coords, ctx.m_block, ctx.head, ctx.batch
        seqlen_q, seqlen_k, softmax_scale, mod_args = ctx.seqlen_q, ctx.seqlen_k, ctx.softmax_scale, ctx.mod_args
        mods = self.mods
        if const_expr(mods.has_score or mask):
            # Hooks index buffers with kv: clamped wherever kv may pass KV_LEN.
            apply_mods(mma.acc_mn_view(acc_S), coords, mods, batch, head, m_block,
                       n_block, seqlen_q, seqlen_k, softmax_scale, mod_args,
                       apply_score=mods.has_score, apply_mask=mask,
                       builtin_causal=False, check_kv_bounds=False,
                       clamp_kv=kv_bound or clamp_kv, hoist_tile_reads=self.cfg.hoist_tile_reads)
        if const_expr(causal or kv_bound):
            # Element by element after hooks emitted so: LLVM folds the two selects of an
            # element into one, which it does not across a vector built of scalars.
            per_element = (mods.has_score or mask) and not mods.rows(mods.has_score, mask)
            self._mask_past_limits(ctx, acc_S, n_block, causal=causal, kv_bound=kv_bound,
                                   per_element=per_element)

    @cute.jit
    def _mask_past_limits(self, ctx, acc_S, n_block, causal: cutlass.Constexpr[bool],
                          kv_bound: cutlass.Constexpr[bool],
                          per_element: cutlass.Constexpr[bool] = False):
        """s = -inf where kv >= limit(q): q + 1 for the built-in causal mask (kv <= q, top-left
        aligned) and/or KV_LEN. The limit is made relative to this thread's first column
        once per row, so an element costs one compare with a compile-time column and one
        select (no per-column index arithmetic); a row is one vector compare and select
        unless `per_element`."""
        coords, m_block, seqlen_k = ctx.coords, ctx.m_block, ctx.seqlen_k
        cfg = self.cfg
        s_mn = mma.acc_mn_view(acc_S)
        kv_first = n_block * cfg.tile_n + coords.col_offset()
        for r in cutlass.range_constexpr(cute.size(s_mn.shape[0])):
            if const_expr(causal):
                limit = m_block * cfg.tile_m + coords.row(r) + 1 - kv_first
                if const_expr(kv_bound):
                    limit = cutlass.min(limit, seqlen_k - kv_first)
            else:
                limit = seqlen_k - kv_first
            if const_expr(per_element):
                for c in cutlass.range_constexpr(cute.size(s_mn.shape[1])):
                    s_mn[r, c] = masked_if(limit <= coords.col0(c), s_mn[r, c])
            else:
                row = s_mn[r, None].load()
                s_mn[r, None].store(masked_where(coords.col0_vector(row.shape) >= limit, row))

    @cute.jit
    def _mask_band(self, ctx, acc_S, n_block):
        """s = -inf outside the band ``lo <= q - kv <= hi`` (the band structure's mask, which
        is exactly that) and past KV_LEN: per row, the columns q - hi .. min(q - lo, KV_LEN -
        1) relative to this thread's first column, so an element costs two compares with
        compile-time columns and its selects, as the causal limit does (`_mask_past_limits`),
        instead of the mask's expression (window1024 B8 S2048, H100: 14% more instructions
        than FA4's forward; the SASS counts put the difference in these masks)."""
        coords, m_block, seqlen_k, mod_args = ctx.coords, ctx.m_block, ctx.seqlen_k, ctx.mod_args
        cfg = self.cfg
        lo, hi = band_bounds(self.mods, mod_args)
        s_mn = mma.acc_mn_view(acc_S)
        kv_first = n_block * cfg.tile_n + coords.col_offset()
        for r in cutlass.range_constexpr(cute.size(s_mn.shape[0])):
            q = m_block * cfg.tile_m + coords.row(r)
            first = q - hi - kv_first                                  # kv >= q - hi
            limit = cutlass.min(q - lo + 1 - kv_first, seqlen_k - kv_first)   # kv <= q - lo, < KV_LEN
            row = s_mn[r, None].load()
            cols = coords.col0_vector(row.shape)
            row = masked_where(cols >= limit, row)
            s_mn[r, None].store(masked_where(cols < first, row))

    @cute.jit
    def _step(self, ctx, kv_state, n_block, is_first: cutlass.Constexpr[bool],
              mask: cutlass.Constexpr[bool], causal: cutlass.Constexpr[bool],
              kv_bound: cutlass.Constexpr, may_be_first: cutlass.Constexpr[bool] = False):
        """One kv block, no overlap: S = Q K^T, mods, softmax, O = O * scale + P V.
        `may_be_first`: a block list's step, whose visit may be the row's first (with
        is_first false: the softmax state starts reset). (Ping-pong turn: held from before
        P V until Q K^T of the next block is issued.)"""
        tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt, tOrP = (
            ctx.tiled_mma_qk, ctx.tiled_mma_pv, ctx.tSrQ, ctx.tSrK, ctx.tOrVt, ctx.tOrP)
        acc_shape_S, acc_O, softmax = ctx.acc_shape_S, ctx.acc_O, ctx.softmax
        pipe_k, pipe_v, wg = ctx.pipe_k, ctx.pipe_v, ctx.wg

        acc_S = cute.make_rmem_tensor(acc_shape_S, Float32)
        pipe_k.consumer_wait(kv_state)
        self._qk_gemm(tiled_mma_qk, acc_S, tSrQ, self._kv_operand(tSrK, kv_state), wait=-1)
        self._turn_pass(wg)
        warpgroup.wait_group(0)
        pipe_k.consumer_release(kv_state)

        self._scores(ctx, acc_S, n_block, mask, causal, kv_bound)
        if const_expr(self.cfg.maxima_on_demand and not is_first):
            row_scale, rescale = softmax.step_on_demand(acc_S, tOrP, may_be_first)
            rescale_rows(acc_O, row_scale, rescale)
        else:
            row_scale, rescale = softmax.step(acc_S, is_first=is_first)
            if const_expr(not is_first):
                rescale_rows(acc_O, row_scale, rescale)
            self._to_p(tOrP, acc_S)

        pipe_v.consumer_wait(kv_state)
        self._turn_wait(wg)
        mma.gemm(tiled_mma_pv, acc_O, tOrP, self._kv_operand(tOrVt, kv_state),
                      zero_init=False, wait=0)
        pipe_v.consumer_release(kv_state)
        kv_state.advance()
        return kv_state

    @cute.jit
    def _first_half(self, ctx, kv_state, n_block, mask: cutlass.Constexpr[bool],
                    causal: cutlass.Constexpr[bool], kv_bound: cutlass.Constexpr):
        """Overlapped schedule, block 0: S_0 and P_0 only (P_0 V_0 runs in the next step)."""
        tiled_mma_qk, tSrQ, tSrK, tOrP = ctx.tiled_mma_qk, ctx.tSrQ, ctx.tSrK, ctx.tOrP
        acc_shape_S, softmax, pipe_k = ctx.acc_shape_S, ctx.softmax, ctx.pipe_k
        acc_S = cute.make_rmem_tensor(acc_shape_S, Float32)
        pipe_k.consumer_wait(kv_state)
        self._qk_gemm(tiled_mma_qk, acc_S, tSrQ, self._kv_operand(tSrK, kv_state), wait=0)
        pipe_k.consumer_release(kv_state)
        self._scores(ctx, acc_S, n_block, mask, causal, kv_bound)
        softmax.step(acc_S, is_first=True)
        if const_expr(self.cfg.rescale_o_early):
            softmax.o_scale.fill(1.0)
            if const_expr(softmax.o_pending is not None):
                softmax.o_pending.fill(0)
        self._to_p(tOrP, acc_S)
        return kv_state

    @cute.jit
    def _visit_step(self, ctx, kv_state, v_state, n_block, has_prev, mask: cutlass.Constexpr[bool], partial,
                    kv_bound: cutlass.Constexpr = "sparse", causal: cutlass.Constexpr[bool] = False,
                    may_be_first: cutlass.Constexpr[bool] = True):
        """Overlapped schedule, block j: issue S_j = Q K_j^T and O += P_{j-1} V_{j-1}, then
        do mods + softmax of S_j while the P V GEMM is still running (O shrinks by S_j's
        row scale once P V is done, or with ``rescale_o_early`` by S_{j-1}'s before P V). `kv_state`: block
        j's stage; `v_state`: block j-1's, whose P V is issued here unless `has_prev` is
        false (a run-time value where one step serves every visit, the first included:
        the softmax state then starts reset, so the first visit's rescale is a no-op;
        `may_be_first` false where a peeled first block came before). Masks per
        `kv_bound`, `causal` and `partial` (see `_scores`). Returns the stages of block
        j+1 and of block j."""
        tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt, tOrP = (
            ctx.tiled_mma_qk, ctx.tiled_mma_pv, ctx.tSrQ, ctx.tSrK, ctx.tOrVt, ctx.tOrP)
        acc_shape_S, acc_O, softmax = ctx.acc_shape_S, ctx.acc_O, ctx.softmax
        pipe_k, pipe_v, wg = ctx.pipe_k, ctx.pipe_v, ctx.wg
        acc_S = cute.make_rmem_tensor(acc_shape_S, Float32)
        pipe_k.consumer_wait(kv_state)
        self._turn_wait(wg)
        self._qk_gemm(tiled_mma_qk, acc_S, tSrQ, self._kv_operand(tSrK, kv_state), wait=-1)
        o_scale, o_due = softmax.o_scale, softmax.o_scale_due()   # (the branch carries no softmax object)
        if has_prev:
            if const_expr(self.cfg.rescale_o_early):
                rescale_rows(acc_O, o_scale, o_due)   # block j-1's scale, while Q K_j^T runs
            pipe_v.consumer_wait(v_state)
            self._pv_gemm(tiled_mma_pv, acc_O, tOrP, tOrVt, v_state, wait=-1)
        else:
            warpgroup.commit_group()       # an empty group: one wait below serves both cases
        self._turn_pass(wg)
        warpgroup.wait_group(1)            # S_j ready (groups retire in order)
        pipe_k.consumer_release(kv_state)

        self._scores(ctx, acc_S, n_block, mask, causal, kv_bound, partial)
        if const_expr(self.cfg.maxima_on_demand):
            # P's registers first (the exponentials write them), then the softmax
            self._release_pv(acc_O, tOrP, v_state, has_prev, pipe_v)
            row_scale, rescale = softmax.step_on_demand(acc_S, tOrP, may_be_first)
        else:
            row_scale, rescale = softmax.step(acc_S, is_first=False)
            self._release_pv(acc_O, tOrP, v_state, has_prev, pipe_v)
            self._to_p(tOrP, acc_S)
        self._keep_or_fold(acc_O, row_scale, rescale, softmax)
        v_state = kv_state.clone()
        kv_state.advance()
        return kv_state, v_state

    @cute.jit
    def _release_pv(self, acc_O, tOrP, v_state, has_prev, pipe_v):
        """Wait for P_{j-1} V_{j-1} (O and P's registers free), add its later pieces, and
        release V_{j-1}."""
        warpgroup.wait_group(0)
        if has_prev:
            self._pv_later_pieces(acc_O, tOrP, v_state)
            pipe_v.consumer_release(v_state)

    @cute.jit
    def _keep_or_fold(self, acc_O, row_scale, rescale, softmax):
        """O's fold by this block's row scale (where `rescale`, None: always), or the scale
        and the vote kept for the next step's early rescale."""
        if const_expr(self.cfg.rescale_o_early):
            softmax.o_scale.store(row_scale.load())
            if const_expr(rescale is not None):
                softmax.o_pending[0] = Int32(1) if rescale else Int32(0)
        else:
            self._fold_o(acc_O, row_scale, rescale)

    def _qk_gemm(self, tiled_mma_qk, acc_S, tSrQ, tSrK, wait: int):
        """S = Q K^T as one wgmma group (`wait` as `mma.gemm`'s), or with ``s_promote`` in
        pieces over the head dim: the first into S, each later one into a fresh
        accumulator added to S, every piece waited for (S is complete on return; a later
        wait for it returns at once)."""
        pieces = self.cfg.s_promote
        if const_expr(not pieces):
            mma.gemm(tiled_mma_qk, acc_S, tSrQ, tSrK, zero_init=True, wait=wait)
        else:
            steps = mma.k_range(tSrQ, None)[1]
            mma.gemm(tiled_mma_qk, acc_S, tSrQ, tSrK, zero_init=True, wait=0, k_blocks=(0, min(pieces, steps)))
            part = cute.make_rmem_tensor_like(acc_S, Float32)
            for k0 in range(pieces, steps, pieces):   # (not a jit function: a Python unroll)
                mma.gemm(tiled_mma_qk, part, tSrQ, tSrK, zero_init=True, wait=0,
                         k_blocks=(k0, min(k0 + pieces, steps)))
                acc_S.store(acc_S.load() + part.load())

    def _pv_gemm(self, tiled_mma_pv, acc_O, tOrP, tOrVt, state, wait: int):
        """O += P V with V at ring stage `state`, or with ``promote_pv`` this block's P V
        alone (folded in by ``_fold_o``; in column pieces, the first piece alone: the
        others follow in ``_pv_later_pieces``). (Finer folds, and P_lo V_lo as a fourth
        pass, were measured: neither moved 3xTF32's max error, docs/experiments.md,
        2026-11-30.)"""
        cfg = self.cfg
        if const_expr(cfg.promote_pv and cfg.promote_pv_pieces > 1):
            pieces = acc_O[1]
            mma.gemm(pieces.tiled_mma, pieces.acc, tOrP, self._kv_operand(pieces.tOrVt[0], state),
                     zero_init=True, wait=wait)
        elif const_expr(cfg.promote_pv):
            mma.gemm(tiled_mma_pv, acc_O[1], tOrP, self._kv_operand(tOrVt, state), zero_init=True, wait=wait)
        else:
            mma.gemm(tiled_mma_pv, acc_O, tOrP, self._kv_operand(tOrVt, state), zero_init=False, wait=wait)

    def _pv_later_pieces(self, acc_O, tOrP, state):
        """Column pieces (``promote_pv_pieces`` > 1), once the first piece's P V is done
        and while P and V (at `state`) are still held: add it to O's columns, then each
        later piece's P V in turn, each added to its columns. Nothing otherwise."""
        cfg = self.cfg
        if const_expr(cfg.promote_pv and cfg.promote_pv_pieces > 1):
            o, pieces = acc_O
            n = cute.size(pieces.acc)
            for p in range(cfg.promote_pv_pieces):   # (a Python unroll)
                if const_expr(p > 0):
                    mma.gemm(pieces.tiled_mma, pieces.acc, tOrP, self._kv_operand(pieces.tOrVt[p], state),
                             zero_init=True, wait=0)
                mma.add_into(o, p * n, pieces.acc)

    def _fold_o(self, acc_O, row_scale, rescale):
        """O = (O + the last block's P V if promoted whole) * row_scale, once that P V is
        done (promoted in pieces: already added by ``_pv_later_pieces``); the multiply
        only where `rescale` (None: always)."""
        cfg = self.cfg
        if const_expr(cfg.promote_pv and cfg.promote_pv_pieces > 1):
            rescale_rows(acc_O[0], row_scale, rescale)
        elif const_expr(cfg.promote_pv):
            o, pv = acc_O
            o.store(o.load() + pv.load())
            rescale_rows(o, row_scale, rescale)
        else:
            rescale_rows(acc_O, row_scale, rescale)

    def _pv_pieces(self, sV, wg_first_thread, acc_O) -> _PvPieces:
        """The parts of ``promote_pv`` in column pieces (see `_PvPieces`): fp32's sV holds
        V^T tiles (Dv rows, K-major), so piece p's B operand is the rows [p w, (p + 1) w)."""
        cfg = self.cfg
        width = cfg.head_dim_v // cfg.promote_pv_pieces
        tiled_mma = mma.make_pv_mma(self.dtype, cfg.tile_m, width)
        wg = tiled_mma.get_slice(wg_first_thread)
        tOrVt = tuple(wg.make_fragment_B(wg.partition_B(cute.local_tile(sV, (width, cfg.tile_n), (p, 0, None))))
                      for p in range(cfg.promote_pv_pieces))
        acc = cute.make_rmem_tensor(wg.partition_shape_C((cfg.tile_m, width)), Float32)
        assert cute.size(acc) * cfg.promote_pv_pieces == cute.size(acc_O), (acc.layout, acc_O.layout)
        return _PvPieces(tiled_mma, tOrVt, acc)

    def _kv_operand(self, frag, state):
        """The MMA operand of a K or V fragment at a ring stage: (hi, lo) for 3xTF32."""
        parts = self.cfg.operand_parts
        if const_expr(parts == 1):
            return frag[None, None, None, state.index]
        return tuple(frag[None, None, None, state.index * parts + p] for p in range(parts))

    def _to_p(self, tOrP, acc_S):
        """P (the softmax's fp32 S fragment) into the PV MMA's A registers: 16-bit, or tf32
        (rounded; 3xTF32: hi and lo parts)."""
        if const_expr(not self.fp32):
            mma.convert_into(tOrP, mma.acc_as_a_view(acc_S))
        elif const_expr(self.cfg.operand_parts == 1):
            mma.split_tf32_into(cute.recast_tensor(tOrP, Float32), mma.acc_as_tf32_a_view(acc_S), None)
        else:
            mma.split_tf32_into(cute.recast_tensor(tOrP[0], Float32), mma.acc_as_tf32_a_view(acc_S),
                                cute.recast_tensor(tOrP[1], Float32))

    @cute.jit
    def _last_pv(self, ctx, kv_state, advance: cutlass.Constexpr[bool] = True):
        """Overlapped schedule, tail: O += P_last V_last; the ring moves on to the next
        tile's first block (the producer advances alike; `advance` False: the caller's
        state has moved on already)."""
        tiled_mma_pv, tOrVt, tOrP = ctx.tiled_mma_pv, ctx.tOrVt, ctx.tOrP
        acc_O, softmax, pipe_v = ctx.acc_O, ctx.softmax, ctx.pipe_v
        if const_expr(self.cfg.rescale_o_early):
            rescale_rows(acc_O, softmax.o_scale, softmax.o_scale_due())
        pipe_v.consumer_wait(kv_state)
        self._pv_gemm(tiled_mma_pv, acc_O, tOrP, tOrVt, kv_state, wait=0)
        self._pv_later_pieces(acc_O, tOrP, kv_state)
        pipe_v.consumer_release(kv_state)
        if const_expr(self.cfg.promote_pv and self.cfg.promote_pv_pieces == 1):
            acc_O[0].store(acc_O[0].load() + acc_O[1].load())
        if const_expr(advance):
            kv_state.advance()
        return kv_state

    @cute.jit
    def epilogue(self, acc_O, softmax, mO, stats, sO, tma_atom_O, tiled_mma_pv, thr_pv, tidx,
                 m_block, head, batch, seqlen_q):
        """O / l -> sO (stmatrix) -> TMA store; LSE (and the max score) straight to global
        memory."""
        cfg = self.cfg
        norm, lse = softmax.finalize(cfg.exact_normalize)   # per row: l (exact) or 1 / l
        if const_expr(cfg.exact_normalize):
            divide_rows(acc_O, norm)
        else:
            rescale_rows(acc_O, norm)
        if const_expr(not self.fp32):
            rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
            rO.store(acc_O.load().to(self.dtype))
        if const_expr(cfg.max_ctas):
            # The previous tile's O store must have read sO before it is overwritten.
            if tidx // 32 == 0:
                cute.arch.cp_async_bulk_wait_group(0, read=True)
        # Every consumer warpgroup must be done with sO's previous use (as sQ: its last
        # Q K^T; as sO: the wait above).
        FwdBarrier.EPILOGUE.sync(self.num_mma_threads)
        if const_expr(self.fp32):   # stmatrix moves 16-bit values only: 8-byte stores
            atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=64)
            r2s = cute.make_tiled_copy_C(atom, tiled_mma_pv).get_slice(tidx)
            cute.copy(r2s, r2s.retile(acc_O), r2s.partition_D(sO))
        else:
            stage_tiles(tiled_mma_pv, self.dtype, tidx, [(rO, sO)])

        # LSE: the lane holding column 0 of a row writes it.
        cO = cute.make_identity_tensor((cfg.tile_m, cfg.head_dim_v))
        tOcO = mma.acc_mn_view(thr_pv.partition_C(cO))
        gLSE = stats[0][None, head, batch]
        row_max = softmax.max_scores() if const_expr(cfg.max_scores) else None
        if tOcO[0, 0][1] == 0:
            for r in cutlass.range_constexpr(cute.size(lse)):
                q = m_block * cfg.tile_m + tOcO[r, 0][0]
                if q < seqlen_q:
                    gLSE[q] = lse[r]
                    if const_expr(cfg.max_scores):
                        stats[1][None, head, batch][q] = row_max[r]

        def o_store():
            gO = cute.local_tile(mO[None, None, head, batch], (cfg.tile_m, cfg.head_dim_v), (m_block, 0))
            return [(tma_atom_O, sO, gO)]

        store_staged(o_store, tidx, FwdBarrier.EPILOGUE, self.num_mma_threads)
