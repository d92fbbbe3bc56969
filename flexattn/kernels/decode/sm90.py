"""Split-KV decoding for Hopper (sm_90a): a few query tokens against a long KV cache.

One CTA handles one (kv split) x (kv head, packed-row block) x (batch) work item:

    grid = (num_splits, H_kv * m_blocks, B)

* GQA packing: the M tile holds the (q head in the kv head's group, query row) pairs,
  row p = h_in_group * q_len + i, so K/V are read from HBM once per group instead of once
  per q head (Hq=32, Hkv=8, q_len=1: 4 rows of one 64-row tile; m_blocks > 1 only when
  group * q_len exceeds the tile).
* Split-KV: the kv blocks of sequence b, [n_lo, ceil(len[b] / tile_n)), are cut into
  num_splits ranges (ceil(blocks / splits) each, or with `balanced_splits` sizes that
  differ by at most one); split s writes its normalized partial O (fp32) and
  natural-log LSE to a workspace. With one split (decided at run time: grid dim 0 == 1)
  the CTA writes O in the input dtype and the final LSE itself. Blocks at or beyond a
  sequence's length are never loaded: that is where a decode step's bandwidth goes.
* In-kernel merge: each split CTA, once its partial is written, takes a ticket — an
  int32 arrival counter per (batch, kv head, row block) — and the CTA that arrives last
  merges the group's splits itself (`combine.merge_splits`) and resets the counter
  to 0, so the counters are zeroed once when allocated, never per step, and no second
  launch waits on the first: the merge of the last group is all a step adds (1.6-4.6 us
  on the H100; a separate combine launch cost 3.3-8 us). Ordering: the consumer threads' partial stores, a
  CTA barrier, then one acq_rel atomic at GPU scope (release is cumulative over the
  barrier; the last arrival's acquire covers every split's stores) — the pattern of
  cutlass::GenericBarrier. No thread ever waits on another CTA: nothing can deadlock.
* Polled merge (`polled_merge`, `decode/polled_merge.py`): the partial slots say whether
  they are written (zero bits until then; splits store relaxed, +0.0 as -0.0), and the
  split that *started* last in its group (a relaxed ticket taken by an idle producer warp
  at the CTA's start) polls them and merges: no fence, no ticket after the stream. The
  merger waits only for splits that have started, which never wait: it cannot deadlock.
  The merger then empties the slots it read. With `parity_slots` (planned where the plan
  has zeroed memory of its own) the slots come in two sets used by launch parity, in the
  plan's own memory: each consumer thread reads
  its group's phase word at its start and stores its partial in the launch's set (no
  barrier before the stores); the splits that do not merge then zero their slots of the
  other set (the last launch's) where they stored, in their slack; the merger's warp 1
  zeroes its own at the CTA's start, and the merger flips the phase after its merge. No
  merger empties anything. (Session 69's design, partials by start ticket, the consumers
  waiting for it before their stores, was no faster than the emptying: docs/experiments.md.)
* Cluster merge (`cluster_splits` > 1: the launch's splits are one cluster per group):
  each CTA keeps its partial in its own shared memory (fp32 O rows over the K ring, LSEs
  over the V ring), a cluster barrier publishes them, CTA `rank` merges rows r = rank
  (mod splits) from its peers' shared memory (`dsmem`), a second barrier keeps every
  CTA's shared memory until its peers have read it. No tickets, no partials in global
  memory: ~0.7 us of merge after ~1 us of barrier, against ~1.4 + 2.0 us for ticket and
  merge (benchmarks/decode_timeline.py). The planner uses pairs, the one cluster size
  that is always resident (`core/decode_path.choose_launch`).
* Masked-prefix skip: with a traced mask (`IRModHook`), every CTA finds n_lo itself — the
  most leading blocks that interval analysis (`interval_emit`) proves masked for all rows
  of its tile, by a search over prefixes [0, n * tile_n) (inclusion-isotone bounds: a
  provably empty prefix stays provably empty when shortened), 32 candidates per round, one
  per lane. A sliding window skips the cache's head in 1 + ~log32(blocks) analyses of a
  few Float64 instructions; one analysis when block 0 may be attended (causal...). A
  band the planner recognizes (`prefix_band`) gives its first key by arithmetic instead,
  and in contiguous caches (`band_start_tiles`) the blocks start there: block n holds keys
  [kv0 + n * tile_n, + tile_n), the last overhanging the length (TMA reads nothing past a
  cache view's end), so a 4097-key window reads 4097 keys, not 65 aligned tiles' 4160.
* Warp specialization as in the forward: warp 0 of warpgroup 0 is the TMA producer (K and
  V through separate `num_stages`-deep mbarrier rings); the consumer warpgroup(s) load the
  packed Q tile with ordinary loads (its rows are strided over heads: no TMA box fits),
  then per kv block S = Q K^T (wgmma), mods, online softmax (fp32, exp2), O += P V (wgmma,
  P from registers).

Why wgmma for a tile that is mostly padding (4 real rows of 64): the step is memory-bound
by a wide margin — a 128-row K+V block is 64 KB, ~2.6 us of one SM's share of HBM
bandwidth, while both 64x128x128 wgmmas take ~0.3 us — and wgmma keeps K/V in shared
memory (no register staging of 64 KB per block), with the same fragment layout the mods,
the softmax and `hopper.mma` already handle.

KV layouts (`DecodeConfig.page_size`):
* 0: contiguous cache [B, H_kv, capacity, D]; one TMA box (tile_n, D) per block.
* page_size > 0: paged cache [num_pages, page_size, H_kv, D] + page table [B, max_pages]
  read in place. page_size a multiple of tile_n: one box per block at (offset in page,
  page); page_size dividing tile_n (>= 16): tile_n / page_size boxes per block, one per
  page, into consecutive rows of the stage. Mods see logical kv indices either way. The
  producer warp reads the page table 32 entries at a time, one per lane, a batch ahead,
  and takes a block's pages by shuffle: no TMA waits on a dependent load of its page.

Mods enter through the `ModHook` interface with each row's own q head:
hook(b, q_head, q_row, kv) with q_row in [0, q_len) (the decode planner rewrites mods to
true positions with runtime offsets, `mods.positions`).
"""

import math
from dataclasses import dataclass, field

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync

from flexattn.kernels.emit import interval_emit
from flexattn.kernels.hopper import dsmem, mma
from flexattn.kernels.hopper.atomics import ld_relaxed_s32, st_relaxed_s32
from flexattn.kernels.decode.combine import inverse_and_lse, lane_columns, log2_shift, merge_splits
from flexattn.kernels.decode.polled_merge import (chunk_splits, merge_polled_splits, store_marked_f32,
                                                  zero_lane_columns)
from flexattn.kernels.emit.mod_hook import NO_MODS, FragmentCoords, ModHook, kept_if
from flexattn.kernels.hopper.softmax import OnlineSoftmax, rescale_rows
from flexattn.kernels.hopper.tma_pipeline import tma_ring
from flexattn.kernels.hopper.warp_specialized import KernelConfig, NamedBarriers, WarpSpecialized, register_split
from flexattn.mods.structure import Affine

LOG2_E = math.log2(math.e)
TIMELINE_STAMPS = 20    # per CTA: entry, producer start, Q loaded, first block done, stream
                        # end, ticket taken, merge end (merging CTAs only), the SM's id,
                        # blocks done at 1/4, 1/2, 3/4 of the split (8-10), the split's
                        # range known (11: length read, masked-prefix analysis done), the
                        # producer's first K block issued (12), the polled merger's first row
                        # seen written (13) and its polling rounds (14), the consumer's
                        # partial normalized (15: before its stores), the merger's first row
                        # written (16: before it empties the slots), the first block's K
                        # and V arrived (17, 18: the consumer's waits done), unused
CLUSTER_SPLITS = (1, 2, 4, 8, 16)   # cluster merge sizes; 16 is a non-portable cluster size,
                                    # which CuTeDSL allows on every kernel it builds (H100: 16)
PREFIX_SCAN_LIMIT = 16  # buffer spans the masked-prefix analysis scans: q rows, not kv ranges



@dataclass(frozen=True)
class DecodeConfig(KernelConfig):
    """Everything that changes the generated decode kernel (runtime values never do)."""

    KIND = "decode"

    dtype: str = "bf16"          # "bf16" | "fp16": Q, K, V and O
    head_dim: int = 128          # a multiple of 16 from 32 to 256 (merges: combine.lane_columns)
    num_mma_wg: int = 1          # consumer warpgroups: 64 packed rows each
    tile_n: int = 128            # kv rows per pipeline stage
    num_stages: int = 3          # K/V ring depth
    ctas_per_sm: int = 1         # 2: registers and shared memory sized for two resident CTAs
    page_size: int = 0           # 0: contiguous cache; else the paged cache's page size
    cluster_splits: int = 1      # > 1: the launch has exactly this many splits, one cluster
                                 # per group, merged through distributed shared memory
    polled_merge: bool = False   # splits > 1 without a cluster: the last split to start polls
                                 # the partials' slots (zero until written; the workspace
                                 # zeroed between steps) instead of a ticket after the stream
    parity_slots: bool = False   # polled merge: two sets of partial slots, used by launch
                                 # parity (a phase word per group past the tickets: the
                                 # count started, parity, the last launch's split count,
                                 # read by each consumer thread at its start); no merger
                                 # empties anything: the splits that do not merge zero their
                                 # slots of the other set (the last launch's) after their
                                 # partial stores, the merger's warp 1 its own at its start
                                 # (mOPart / mLSEPart: this launch's splits, mode 0's stride
                                 # spanning a slot in both sets, interleaved: the plan's own
                                 # zeroed memory)
    balanced_splits: bool = False  # split ranges whose sizes differ by at most one (split s:
                                 # blocks [s * total // splits, (s + 1) * total // splits)),
                                 # none empty while splits <= blocks; else ceil(total /
                                 # splits) each, the last ones short or empty (the planner
                                 # trims its count so none is: choose_splits)
    merge_chunk: int = 0         # polled merge: splits whose partials a lane loads in its
                                 # first polling round (0: polled_merge.chunk_splits(head_dim),
                                 # past the launch's count clamped to its last split); the
                                 # planner sets the launch's count where it holds across steps
                                 # (decode_path.stable_merge_chunk): no loads past it
    caller_empties_slots: bool = False  # benchmarks only (decode_floor.py --zero-slots, never
                                 # planned): the polled merge leaves the slots it read
                                 # written, the caller zeroes them between steps — what the
                                 # merger's emptying costs, measured without it (with
                                 # parity_slots: no split zeroes the other set)
    timeline: bool = False       # probe for benchmarks/decode_timeline.py: every CTA writes
                                 # globaltimer stamps past the tickets (never planned)
    skip_masked_prefix: bool = True  # the masked-prefix analysis before the stream (masks
                                     # only); off where the planner proves the cache's first
                                     # key always attended (causal...): it would find nothing
    prefix_band: tuple | None = None  # (hi, queries at the cache's end): the mask is a band
                                     # with q - kv <= hi (hi an int or a structure.Affine of the
                                     # mask's captures), so its masked prefix is arithmetic —
                                     # keys below the first query's position minus hi — instead
                                     # of the analysis (decode_path.band_prefix)
    band_start_tiles: bool = False  # with prefix_band, contiguous caches: kv tiles start at the
                                     # band's first key instead of at multiples of tile_n, so the
                                     # last tile overhangs the sequence's end (rows a cache view
                                     # ending at the length holds none of: TMA reads nothing
                                     # there) instead of the first reaching below the band
    mask_last_page_only: bool = False  # paged: the mask evaluated in the tiles that overlap
                                     # a sequence's last page alone (every page before it is
                                     # known full: a short query's walk of listed blocks,
                                     # full ones first: core/short_query.py)
    prefetch_tile_reads: bool = False  # the mods' tile-constant reads (ModHook.tile_invariants:
                                     # a walk's table, a paged mask's page map) issued one tile
                                     # ahead, so their dependent loads overlap the step before
                                     # (masked steps; not with mask_last_page_only)
    zero_v_overhang: bool = False    # the bound block's V rows at or past the length zeroed in
                                     # shared memory before P V, where memory was read there (a
                                     # cache longer than the length, a page's tail): such rows
                                     # may hold NaN / Inf bits (torch.empty), and P = 0 times NaN
                                     # is NaN. Rows past a view's end are TMA zeros already.
    mods: ModHook = field(default=NO_MODS, compare=False)

    def __post_init__(self):
        self.check_dtype()
        if self.head_dim % 16 or not 32 <= self.head_dim <= 256:
            raise ValueError(f"head_dim must be a multiple of 16 from 32 to 256, got {self.head_dim}")
        if self.num_mma_wg not in (1, 2):
            raise ValueError(f"num_mma_wg must be 1 or 2, got {self.num_mma_wg}")
        if self.tile_n not in (64, 128):
            raise ValueError(f"tile_n must be 64 or 128, got {self.tile_n}")
        if self.num_stages < 1:
            raise ValueError("num_stages must be >= 1")
        if self.ctas_per_sm not in (1, 2) or (self.ctas_per_sm == 2 and self.num_mma_wg != 1):
            raise ValueError(f"ctas_per_sm must be 1, or 2 with one consumer warpgroup, got {self.ctas_per_sm}")
        check_page_size(self.page_size, self.tile_n)
        if self.mask_last_page_only and not self.paged:
            raise ValueError("mask_last_page_only needs a paged cache (page_size > 0)")
        if self.prefetch_tile_reads and self.mask_last_page_only:
            raise ValueError("prefetch_tile_reads serves walks masked on every tile, not mask_last_page_only")
        if self.cluster_splits not in CLUSTER_SPLITS:
            raise ValueError(f"cluster_splits must be one of {CLUSTER_SPLITS}, got {self.cluster_splits}")
        if self.cluster_splits > 1 and 2 * self.tile_m > self.num_stages * self.tile_n:
            raise ValueError("the cluster merge keeps a split's fp32 O tile in the K ring: it needs "
                             f"num_stages * tile_n >= 2 * tile_m, got {self.num_stages} x {self.tile_n}")
        if self.polled_merge and (self.cluster_splits > 1 or self.head_dim % 32):
            raise ValueError("polled_merge needs cluster_splits 1 and a head dim that is a multiple of 32, got "
                             f"{self.cluster_splits} and {self.head_dim}")
        if self.parity_slots and not self.polled_merge:
            raise ValueError("parity_slots needs polled_merge")
        if self.merge_chunk and not (self.polled_merge and 1 <= self.merge_chunk <= chunk_splits(self.head_dim)):
            raise ValueError(f"merge_chunk must be 0, or 1 to {chunk_splits(self.head_dim)} with polled_merge at head "
                             f"dim {self.head_dim}, got {self.merge_chunk}")
        if self.band_start_tiles and (self.prefix_band is None or self.paged or self.prefetch_tile_reads):
            raise ValueError("band_start_tiles needs prefix_band, a contiguous cache and no prefetch_tile_reads")
        if self.caller_empties_slots and not self.polled_merge:
            raise ValueError("caller_empties_slots needs polled_merge")
        if self.smem_bytes > self.smem_limit:
            raise ValueError(f"{self.smem_bytes} bytes of shared memory per CTA exceed {self.smem_limit} for "
                             f"{self.ctas_per_sm} CTA(s) per SM: fewer stages or a smaller tile_n")

    @property
    def tile_m(self) -> int:
        return 64 * self.num_mma_wg

    @property
    def paged(self) -> bool:
        return self.page_size > 0

    @property
    def pages_per_tile(self) -> int:
        """Paged: the pages one kv tile spans (1 when pages hold whole tiles)."""
        return max(1, self.tile_n // self.page_size)

    @property
    def tiles_per_page(self) -> int:
        """Paged: the kv tiles one page holds (1 when pages are smaller than a tile)."""
        return max(1, self.page_size // self.tile_n)

    @property
    def box_rows(self) -> int:
        """Rows of one K/V TMA box: the tile, or one page when pages are smaller."""
        return self.tile_n if not self.paged else min(self.tile_n, self.page_size)

    @property
    def smem_bytes(self) -> int:
        return self.smem_for(self.head_dim, self.tile_m, self.tile_n, self.num_stages)

    @staticmethod
    def smem_for(head_dim: int, tile_m: int, tile_n: int, num_stages: int) -> int:
        """Q tile + K and V rings (1024-aligned, in that order) + the 2 x 2 x stages mbarriers
        + the last-arrival flag (8 bytes)."""
        elem = 2
        return elem * head_dim * (tile_m + 2 * num_stages * tile_n) + 2 * 2 * num_stages * 8 + 8

    @property
    def smem_limit(self) -> int:
        return self.smem_limit_for(self.ctas_per_sm)

    @staticmethod
    def smem_limit_for(ctas_per_sm: int) -> int:
        """Bytes one CTA may take: an H100 SM has 228 KB, 1 KB of it reserved per resident CTA."""
        return 228 * 1024 // ctas_per_sm - 1024

    @property
    def regs(self) -> tuple:
        """(producer, consumer) setmaxnreg budgets (``register_split``): a CTA launches with its
        share of the SM's 64K registers (ptxas caps the launch count at 64K / (ctas_per_sm x
        threads)); the producer warpgroup keeps 40 (the paged producer has page-table reads
        and several boxes in flight) and gives the rest to the consumers, at most 240 each."""
        return register_split(self.num_mma_wg, 40, self.ctas_per_sm, max_consumer_regs=240)


def check_page_size(page_size: int, tile_n: int) -> None:
    """Page sizes the kernel reads in place: >= 16, and dividing the kv tile or a multiple of it."""
    if page_size == 0:
        return
    if page_size < 16 or (tile_n % page_size and page_size % tile_n):
        raise ValueError(f"page_size must be >= 16 and divide the kv tile ({tile_n}) or be a multiple "
                         f"of it, got {page_size}")
    if page_size < tile_n and page_size & (page_size - 1):
        raise ValueError(f"page_size below the kv tile must be a power of two, got {page_size}")


class DecodeBarrier(NamedBarriers):
    Q_READY = 1     # the consumers' packed Q rows are in shared memory
    ARRIVAL = 2     # the consumers around a split's partial stores and the merge
    MERGER = 3      # polled merge: the producer's ticket warp publishes whether this CTA merges
    V_ZEROED = 4    # zero_v_overhang: the bound block's rows past the length zeroed, before P V


class DecodeSm90(WarpSpecialized):
    """Compile with `cute.compile(DecodeSm90(cfg), q, k, v, page_table, seq_lens, o, lse,
    o_part, lse_part, tickets, softmax_scale, mod_args, stream)` (see launch/compile.py)."""

    def __init__(self, config: DecodeConfig):
        self.cfg = config
        self.dtype = config.cutlass_dtype
        self.mods = config.mods
        super().__init__(config.num_mma_wg)
        # The traced mask, for the in-kernel masked-prefix skip (hand-written hooks: none).
        self.mask_expr = getattr(config.mods, "mask_expr", None) \
            if config.mods.has_mask and config.skip_masked_prefix else None

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,          # [B, Hq, q_len, D]
        mK: cute.Tensor,          # [B, Hkv, cap, D] or pages [P, page_size, Hkv, D]
        mV: cute.Tensor,          # same as mK
        mPageTable,               # [B, max_pages] int32 (paged) or None
        mSeqLens: cute.Tensor,    # [B] int32: valid cache tokens
        mO: cute.Tensor,          # [B, Hq, q_len, D] (written when num_splits == 1)
        mLSE: cute.Tensor,        # [B, Hq, q_len] float32, natural log
        mOPart: cute.Tensor,      # [splits, B, Hq, q_len, D] float32 (num_splits > 1)
        mLSEPart: cute.Tensor,    # [splits, B, Hq, q_len] float32
        mTickets: cute.Tensor,    # [>= B * Hkv * m_blocks] int32, zero between launches
                                  # (polled_merge: mOPart / mLSEPart zero between launches too)
        softmax_scale: Float32,
        mod_args,
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        for t in (mQ, mK, mV, mO):
            if const_expr(t.element_type != self.dtype):
                raise TypeError(f"expected {self.dtype}, got {t.element_type}")
        if const_expr(cfg.paged != (mPageTable is not None)):
            raise ValueError("a page table must be given iff cfg.page_size > 0")

        # K/V as (rows, D, Hkv, outer): outer = batch (contiguous) or page (paged).
        if const_expr(cfg.paged):
            K, V = [mma.select_modes(t, [1, 3, 2, 0]) for t in (mK, mV)]
        else:
            K, V = [mma.select_modes(t, [2, 3, 1, 0]) for t in (mK, mV)]

        tiled_mma_qk = mma.make_qk_mma(self.dtype, cfg.tile_m, cfg.tile_n)
        tiled_mma_pv = mma.make_pv_mma(self.dtype, cfg.tile_m, cfg.head_dim)
        sQ_layout = mma.smem_layout(self.dtype, cfg.tile_m, cfg.head_dim)
        sK_layout = mma.smem_layout(self.dtype, cfg.tile_n, cfg.head_dim, cfg.num_stages)
        sV_layout = mma.smem_layout(self.dtype, cfg.tile_n, cfg.head_dim, cfg.num_stages)
        box_layout = mma.smem_layout(self.dtype, cfg.box_rows, cfg.head_dim)

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(g2s, K, box_layout, (cfg.box_rows, cfg.head_dim), 1)
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(g2s, V, box_layout, (cfg.box_rows, cfg.head_dim), 1)
        self.bytes_kv = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1]))

        # The 1024-aligned tiles first, the mbarriers after them: no alignment padding, so
        # two CTAs of tile_n 64 x 3 stages fit one SM (DecodeConfig.smem_bytes).
        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * cfg.num_stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * cfg.num_stages]
            last_arrival: cute.struct.MemRange[Int32, 2]

        scale_log2 = Float32(LOG2_E)
        if const_expr(not self.mods.has_score):
            scale_log2 = softmax_scale * Float32(LOG2_E)

        group = mQ.shape[1] // K.shape[2]
        rows = group * mQ.shape[2]
        m_blocks = (rows + cfg.tile_m - 1) // cfg.tile_m
        grid = (mOPart.shape[0], K.shape[2] * m_blocks, mQ.shape[0])
        self.kernel(
            mQ, tma_K, tma_V, mPageTable, mSeqLens, mO, mLSE, mOPart, mLSEPart, mTickets,
            tma_atom_K, tma_atom_V, tiled_mma_qk, tiled_mma_pv,
            sQ_layout, sK_layout, sV_layout,
            softmax_scale, scale_log2, mod_args, SharedStorage,
        ).launch(
            grid=grid,
            block=[self.num_threads, 1, 1],
            stream=stream,
            min_blocks_per_mp=cfg.ctas_per_sm,
            cluster=[cfg.cluster_splits, 1, 1] if cfg.cluster_splits > 1 else None,
            # Given, CuTeDSL would query the device for it while tracing (never here): the
            # largest shared-memory carveout, so two CTAs' rings fit.
            preferred_smem_carveout=100 if cfg.ctas_per_sm > 1 else None,
        )

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mPageTable, mSeqLens: cute.Tensor,
        mO: cute.Tensor, mLSE: cute.Tensor, mOPart: cute.Tensor,
        mLSEPart: cute.Tensor, mTickets,
        tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
        tiled_mma_qk: cute.TiledMma, tiled_mma_pv: cute.TiledMma,
        sQ_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        softmax_scale: Float32, scale_log2: Float32, mod_args,
        SharedStorage: cutlass.Constexpr,
    ):
        cfg = self.cfg
        warp_idx = self.warp_index()
        self.prefetch_descriptors(warp_idx, (tma_atom_K, tma_atom_V))

        storage = self.allocate(SharedStorage)
        n = self.num_mma_threads
        pipe_k = tma_ring(storage.mbar_k.data_ptr(), cfg.num_stages, n, self.bytes_kv)
        pipe_v = tma_ring(storage.mbar_v.data_ptr(), cfg.num_stages, n, self.bytes_kv)
        self.rings_init_arrive()   # a cluster here merges splits; its rings are the CTA's own

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)

        split, head_block, batch = cute.arch.block_idx()
        num_splits, head_blocks, _ = cute.arch.grid_dim()
        kv_heads = mK.shape[2]
        group = mQ.shape[1] // kv_heads
        q_len = mQ.shape[2]
        rows = group * q_len
        m_blocks = (rows + cfg.tile_m - 1) // cfg.tile_m
        head_kv = head_block // m_blocks
        m_block = head_block - head_kv * m_blocks

        # Timeline probe: this CTA's stamps, past the tickets (one per group).
        stamps = None
        if const_expr(cfg.timeline):
            cta = (batch * head_blocks + head_block) * num_splits + split
            words = head_blocks * mQ.shape[0] * (2 if const_expr(cfg.parity_slots) else 1)   # (+ phase words)
            stamps = mTickets.iterator + (words + cta * TIMELINE_STAMPS)
        self._stamp(stamps, 0, warp_idx == 4)
        self._stamp(stamps, 7, warp_idx == 4, cute.arch.smid)

        # This split's kv blocks: [first, first + count), visited last first; block n holds
        # keys [kv0 + n * tile_n, + tile_n). Every thread computes the same values (no
        # broadcast needed before the roles split).
        seqlen = Int32(mSeqLens[batch])
        n_hi = (seqlen + cfg.tile_n - 1) // cfg.tile_n
        n_lo = Int32(0)
        kv0 = Int32(0)
        if const_expr(cfg.band_start_tiles):
            kv0 = cutlass.min(self._band_first_key(seqlen, q_len, mod_args), seqlen)
            n_hi = (seqlen - kv0 + cfg.tile_n - 1) // cfg.tile_n
        elif const_expr(self.mask_expr is not None and cfg.prefix_band is not None):
            n_lo = cutlass.min(self._band_first_key(seqlen, q_len, mod_args) // cfg.tile_n, n_hi)
        elif const_expr(self.mask_expr is not None):
            p_lo = m_block * cfg.tile_m
            p_hi = cutlass.min(p_lo + cfg.tile_m, rows) - 1
            heads = (head_kv * group + p_lo // q_len, head_kv * group + p_hi // q_len)
            n_lo = self._masked_prefix_blocks(batch, heads, q_len, seqlen, n_hi, mod_args)
        if const_expr(cfg.balanced_splits):
            # split s: blocks [s * total // splits, (s + 1) * total // splits) past n_lo
            total = n_hi - n_lo
            first = n_lo + split * total // num_splits
            count = n_lo + (split + 1) * total // num_splits - first
        else:
            per_split = (n_hi - n_lo + num_splits - 1) // num_splits
            first = cutlass.min(n_lo + split * per_split, n_hi)
            count = cutlass.min(first + per_split, n_hi) - first
        self._stamp(stamps, 11, warp_idx == 4)
        # [0]: whether this CTA merges its group (set by whoever counts it in: _count_in);
        # [1]: parity slots, the phase word as the ticket found it (_take_parity_ticket)
        sMerges = storage.last_arrival.get_tensor(cute.make_layout(2))
        # Parity slots: the group's phase word, past the groups' tickets (the count started,
        # the launch's parity, the last launch's split count: _take_parity_ticket)
        phase_word = None
        if const_expr(cfg.parity_slots):
            phase_word = mTickets.iterator + ((mQ.shape[0] + batch) * head_blocks + head_block)

        # The cluster merge's view of a split's partial: fp32 O rows over the K ring, LSEs
        # over the V ring (both free once the stream has ended).
        sPart = sLSE = None
        if const_expr(cfg.cluster_splits > 1):
            sPart = cute.make_tensor(cute.recast_ptr(storage.sK.data_ptr(), dtype=Float32),
                                     cute.make_layout((cfg.tile_m, cfg.head_dim), stride=(cfg.head_dim, 1)))
            sLSE = cute.make_tensor(cute.recast_ptr(storage.sV.data_ptr(), dtype=Float32), cute.make_layout(cfg.tile_m))

        self.rings_init_wait()

        if self.is_producer(warp_idx):
            self.enter_producer(cfg.regs)
            if warp_idx == 0:
                self._stamp(stamps, 1, True)
                self.load(mK, mV, mPageTable, sK, sV, tma_atom_K, tma_atom_V, pipe_k, pipe_v,
                          head_kv, batch, first, count, stamps, kv0)
            if const_expr(cfg.polled_merge):
                if warp_idx == 1:
                    if num_splits > 1:
                        if const_expr(cfg.parity_slots):
                            self._take_parity_ticket(phase_word, num_splits, sMerges, mOPart, mLSEPart, split,
                                                     head_kv, group, q_len, rows, m_block, batch)
                        else:
                            self._take_start_ticket(mTickets.iterator + (batch * head_blocks + head_block),
                                                    num_splits, sMerges)
            if const_expr(cfg.cluster_splits > 1):
                # The cluster barriers count every thread: the producer's pass both.
                for _ in cutlass.range_constexpr(2):
                    cute.arch.cluster_arrive()
                    cute.arch.cluster_wait()
        else:
            self.enter_consumer(cfg.regs)
            # Parity slots: every consumer thread reads its group's phase word itself, at its
            # start (used only by its partial's stores: no barrier before them). Its parity
            # and last count hold all launch: only the merger changes the word, after every
            # split's partial — stored at addresses that depend on this read.
            phase = Int32(0)
            if const_expr(cfg.parity_slots):
                phase = ld_relaxed_s32(phase_word)
            self.consume(mQ, mO, mLSE, mOPart, mLSEPart, sQ, sK, sV, tiled_mma_qk, tiled_mma_pv,
                         pipe_k, pipe_v, split, num_splits, head_kv, group, q_len, rows, m_block,
                         batch, seqlen, first, count, softmax_scale, scale_log2, mod_args, stamps, sPart, sLSE,
                         phase, kv0, mV.shape[0])
            if const_expr(cfg.polled_merge):
                if num_splits > 1:
                    tidx = cute.arch.thread_idx()[0] - 128
                    self._stamp(stamps, 5, warp_idx == 4)
                    DecodeBarrier.MERGER.sync(self.num_mma_threads + 32)
                    if sMerges[0] == 0:
                        if const_expr(cfg.parity_slots and not cfg.caller_empties_slots):
                            # In this split's slack: the last launch's partial, where this thread wrote it.
                            self._zero_own_positions(mOPart, mLSEPart, phase, split, num_splits,
                                                     tiled_mma_pv.get_slice(tidx), head_kv, group, q_len, rows,
                                                     m_block, batch)
                    else:
                        self._merge_group(mO, mLSE, mOPart, mLSEPart, tidx, head_kv, group, q_len, rows, m_block,
                                          batch, stamps, phase)
                        if const_expr(cfg.parity_slots):
                            # Every row merged, so every split's phase reads are done: the next
                            # launch's phase (count 0, parity flipped, this split count), by a
                            # store (no atomic: its return would hold the merger's exit).
                            DecodeBarrier.ARRIVAL.sync(self.num_mma_threads)
                            if tidx == 0:
                                st_relaxed_s32(phase_word, _next_phase(phase, num_splits))
                        self._stamp(stamps, 6, warp_idx == 4)
            elif const_expr(cfg.cluster_splits == 1):
                if num_splits > 1:
                    tidx = cute.arch.thread_idx()[0] - 128
                    ticket = mTickets.iterator + (batch * head_blocks + head_block)
                    last = self._arrived_last(ticket, num_splits, sMerges, tidx)
                    self._stamp(stamps, 5, warp_idx == 4)
                    if last:
                        self._merge_group(mO, mLSE, mOPart, mLSEPart, tidx, head_kv, group, q_len, rows, m_block,
                                          batch)
                        if const_expr(cfg.timeline):
                            DecodeBarrier.ARRIVAL.sync(self.num_mma_threads)
                        self._stamp(stamps, 6, warp_idx == 4)
            else:
                # Every thread of the cluster: the first barrier publishes each split's
                # partial (in its own shared memory), the second keeps each CTA's shared
                # memory alive until its peers have read it.
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()
                self._stamp(stamps, 5, warp_idx == 4)
                self._merge_cluster(mO, mLSE, sPart, sLSE, cute.arch.thread_idx()[0] - 128, split, head_kv, group,
                                    q_len, rows, m_block, batch)
                self._stamp(stamps, 6, warp_idx == 4)
                cute.arch.cluster_arrive()
                cute.arch.cluster_wait()

    @cute.jit
    def _stamp(self, stamps, k: cutlass.Constexpr[int], leader, read: cutlass.Constexpr = cute.arch.globaltimer_lo):
        """Timeline probe (cfg.timeline): stamp k := read() — %globaltimer_lo (ns), or the
        SM's id — by one lane of the warp for which `leader` holds."""
        if const_expr(self.cfg.timeline):
            if leader:
                if cute.arch.lane_idx() == 0:
                    (stamps + k).store(Int32(read()))

    @cute.jit
    def _masked_prefix_blocks(self, batch, heads, q_len, seqlen, n_hi, mod_args):
        """The largest n <= n_hi such that interval analysis proves keys [0, n * tile_n)
        masked for every (head in `heads`, query row) of the tile. The property only
        weakens with longer prefixes, so each warp tests 32 candidates per round, one per
        lane, and a ballot counts the masked ones: ~log32(n_hi) rounds of one analysis
        (2 for up to 1024 blocks) where a binary search took log2 (the analyses delay every
        CTA's first load: a 4096-key window took ~1 µs at 8k-64k keys). Every warp finds
        the same n."""
        args = self.cfg.mods.mask_args(mod_args)
        lo = Int32(0)
        hi = n_hi
        if n_hi > 0:
            # Block 0 may be attended (causal...): nothing to skip, one analysis.
            if self._prefix_masked(Int32(1), batch, heads, q_len, seqlen, args):
                lo = Int32(1)
                lane = cute.arch.lane_idx()
                while lo < hi:
                    # Invariant: prefix lo is masked, prefixes past hi are not.
                    step = (hi - lo + 31) // 32
                    candidate = cutlass.min(lo + (lane + 1) * step, hi)
                    masked = self._prefix_masked(candidate, batch, heads, q_len, seqlen, args)
                    count = Int32(cute.arch.popc(cute.arch.vote_ballot_sync(masked)))  # masked lanes: a prefix
                    new_lo = cutlass.min(lo + count * step, hi)
                    hi = cutlass.min(hi, lo + (count + 1) * step - 1)
                    lo = new_lo
        return lo

    @cute.jit
    def _band_first_key(self, seqlen, q_len, mod_args):
        """``cfg.prefix_band``: the first key a band ``q - kv <= hi`` keeps for some row of
        the tile — the first query's position (``seqlen - q_len`` at the cache's end, else 0:
        no row sits lower) minus hi, at least 0. The blocks below it are what the masked-
        prefix analysis finds, in a few integer instructions instead of its rounds before
        the first load."""
        hi, at_end = self.cfg.prefix_band
        if const_expr(isinstance(hi, Affine)):
            hi = hi.value(self.cfg.mods.mask_args(mod_args), as_int=Int32)
        q_first = Int32(0)
        if const_expr(at_end):
            q_first = seqlen - q_len
        return cutlass.max(q_first - Int32(hi), Int32(0))

    def _prefix_masked(self, n, batch, heads, q_len, seqlen, args):
        """Keys [0, n * tile_n) surely masked for the tile's rows (n >= 1)."""
        # Buffers read over long kv spans (document ids...) stay unbounded: scanning them
        # per CTA would cost more than the blocks it could skip.
        return _classify_keys(self.mask_expr, batch, heads, q_len - 1, Int32(0),
                              cutlass.min(n * self.cfg.tile_n, seqlen) - 1, args, PREFIX_SCAN_LIMIT) == 0

    # ------------------------------------------------------------------ producer
    @cute.jit
    def load(self, mK, mV, mPageTable, sK, sV, tma_atom_K, tma_atom_V, pipe_k, pipe_v,
             head_kv, batch, first, count, stamps=None, kv0=None):
        cfg = self.cfg
        box = (cfg.box_rows, cfg.head_dim)
        one = cute.make_layout(1)

        def partition(atom, mX, sX):
            # gmem: (box, boxes along rows, outer); smem: (box, boxes per tile, stage).
            # band_start_tiles: boxes from key kv0 (TMA coordinates need no alignment).
            mX = mX[None, None, head_kv, None]
            if const_expr(cfg.band_start_tiles):
                mX = cute.domain_offset((kv0, 0, 0), mX)
            g = cute.flat_divide(mX, box)   # (r, D, nr, 1, outer)
            s = cute.flat_divide(sX, box)   # (r, D, nb, 1, stage)
            tXsX, tXgX = cpasync.tma_partition(
                atom, 0, one, cute.group_modes(s, 0, 2), cute.group_modes(g, 0, 2))
            return tXgX, tXsX

        tKgK, tKsK = partition(tma_atom_K, mK, sK)
        tVgV, tVsV = partition(tma_atom_V, mV, sV)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.num_stages)
        if const_expr(not cfg.paged):
            for i in cutlass.range(count, unroll=1):
                n_block = first + count - 1 - i
                self._load_block(pipe_k, tma_atom_K, tKgK, tKsK, batch, n_block, state)
                if const_expr(cfg.timeline):
                    if i == 0:
                        self._stamp(stamps, 12, True)
                self._load_block(pipe_v, tma_atom_V, tVgV, tVsV, batch, n_block, state)
                state.advance()
        else:
            # Page-table entries go to registers 32 at a time, one per lane, a batch ahead:
            # a block's TMA never waits on a dependent global load of its page (that wait
            # kept a ring slot idle per block). Block r of a batch finds its pages in lanes
            # [r * pages_per_tile, (r + 1) * pages_per_tile).
            pages_per_tile = cfg.pages_per_tile
            per_batch = 32 // pages_per_tile
            lane = cute.arch.lane_idx()
            upcoming = self._page_entries(mPageTable, batch, first, count, Int32(0), lane)
            for i0 in cutlass.range(0, count, per_batch, unroll=1):
                entries = upcoming
                upcoming = self._page_entries(mPageTable, batch, first, count, i0 + per_batch, lane)
                for r in cutlass.range(cutlass.min(per_batch, count - i0), unroll=1):
                    n_block = first + count - 1 - (i0 + r)
                    self._load_block(pipe_k, tma_atom_K, tKgK, tKsK, batch, n_block, state, entries, r * pages_per_tile)
                    if const_expr(cfg.timeline):
                        if i0 + r == 0:
                            self._stamp(stamps, 12, True)
                    self._load_block(pipe_v, tma_atom_V, tVgV, tVsV, batch, n_block, state, entries, r * pages_per_tile)
                    state.advance()

    @cute.jit
    def _page_entries(self, mPageTable, batch, first, count, i0, lane) -> Int32:
        """This lane's page-table entry of the batch of visits starting at visit `i0` (block
        first + count - 1 - i0 and down): page lane % pages_per_tile of visit i0 + lane //
        pages_per_tile; 0 past the last visit."""
        cfg = self.cfg
        entry = Int32(0)
        pages_per_tile = cfg.pages_per_tile
        visit = i0 + lane // pages_per_tile
        if visit < count:
            n_block = first + count - 1 - visit
            if const_expr(pages_per_tile == 1):
                logical_page = n_block // cfg.tiles_per_page
            else:
                # A tile's tail may run past the table when capacity is not a multiple of
                # the tile: clamp (those rows lie beyond the sequence and are masked).
                logical_page = cutlass.min(n_block * pages_per_tile + lane % pages_per_tile, mPageTable.shape[1] - 1)
            entry = Int32(mPageTable[batch, logical_page])
        return entry

    @cute.jit
    def _load_block(self, pipe, atom, tXgX, tXsX, batch, n_block, state, entries=None, lane0=None):
        """TMA kv block `n_block` of sequence `batch` into the ring slot of `state`; paged:
        its pages are `entries` of lanes lane0, lane0 + 1, ... (`_page_entries`)."""
        cfg = self.cfg
        pipe.producer_acquire(state)
        bar = pipe.producer_get_barrier(state)
        if const_expr(not cfg.paged):
            cute.copy(atom, tXgX[None, n_block, 0, batch], tXsX[None, 0, 0, state.index], tma_bar_ptr=bar)
        elif const_expr(cfg.page_size >= cfg.tile_n):
            page = cute.arch.shuffle_sync(entries, lane0)
            cute.copy(atom, tXgX[None, n_block % cfg.tiles_per_page, 0, page],
                      tXsX[None, 0, 0, state.index], tma_bar_ptr=bar)
        else:
            for j in cutlass.range_constexpr(cfg.pages_per_tile):
                page = cute.arch.shuffle_sync(entries, lane0 + j)
                cute.copy(atom, tXgX[None, 0, 0, page], tXsX[None, j, 0, state.index], tma_bar_ptr=bar)

    # ------------------------------------------------------------------ consumers
    @cute.jit
    def _load_q(self, mQ, sQ, tidx, head_kv, group, q_len, rows, m_block, batch):
        """Packed Q tile -> smem (zeros for padding rows), visible to wgmma afterwards."""
        cfg = self.cfg
        vec = 8                                      # 16 bytes per access
        chunks = cfg.head_dim // vec
        for k in cutlass.range_constexpr(cfg.tile_m * chunks // self.num_mma_threads):
            idx = tidx + k * self.num_mma_threads
            r = idx // chunks
            c = idx - r * chunks
            p = m_block * cfg.tile_m + r
            frag = cute.make_rmem_tensor(vec, self.dtype)
            frag.fill(0.0)
            if p < rows:
                head, qi = packed_row(p, head_kv, group, q_len)
                g = cute.local_tile(mQ[batch, head, qi, None], (vec,), (c,))
                frag.store(g.load())
            s = cute.local_tile(sQ[r, None], (vec,), (c,))
            s.store(frag.load())
        cute.arch.fence_view_async_shared()          # generic-proxy writes -> wgmma reads
        DecodeBarrier.Q_READY.sync(self.num_mma_threads)

    @cute.jit
    def consume(self, mQ, mO, mLSE, mOPart, mLSEPart, sQ, sK, sV, tiled_mma_qk, tiled_mma_pv,
                pipe_k, pipe_v, split, num_splits, head_kv, group, q_len, rows, m_block, batch,
                seqlen, first, count, softmax_scale, scale_log2, mod_args, stamps=None, sPart=None, sLSE=None,
                phase=None, kv0=None, kv_rows=None):
        """The split's stream, consumer side. ``kv_rows``: rows of the K / V view (the cache's
        capacity, or a page's size): where the length is below it, memory was read past the
        length (``DecodeConfig.zero_v_overhang``)."""
        cfg = self.cfg
        if const_expr(mod_args is None):
            mod_args = ()
        tidx = cute.arch.thread_idx()[0] - 128
        wg = cute.arch.make_warp_uniform(tidx // 128)
        wg_first_thread = cute.make_layout(cfg.num_mma_wg, stride=128)(wg)
        wg_qk = tiled_mma_qk.get_slice(wg_first_thread)
        wg_pv = tiled_mma_pv.get_slice(wg_first_thread)
        thr_qk = tiled_mma_qk.get_slice(tidx)
        thr_pv = tiled_mma_pv.get_slice(tidx)

        acc_O = cute.make_rmem_tensor(wg_pv.partition_shape_C((cfg.tile_m, cfg.head_dim)), Float32)
        coords = FragmentCoords(thr_qk, cfg.tile_m, cfg.tile_n, mma.acc_mn_view)
        # Each fragment row's own (q head, query row): the mods' coordinates under packing.
        n_rows = cute.size(mma.acc_mn_view(acc_O).shape[0])
        row_head = cute.make_rmem_tensor(n_rows, Int32)
        row_q = cute.make_rmem_tensor(n_rows, Int32)
        last_head = mQ.shape[1] - 1
        for r in cutlass.range_constexpr(n_rows):
            p = m_block * cfg.tile_m + coords.row(r)
            head, qi = packed_row(p, head_kv, group, q_len)
            row_head[r] = cutlass.min(head, last_head)   # padding rows: clamp
            row_q[r] = qi
        # The mods' buffer reads that stay constant along a row (ALiBi's slope, the query's
        # true position), before the Q load: they go out beside the producer's first K/V
        # loads instead of after the first K block (~5 µs later while HBM is saturated).
        row_values = []
        if const_expr(self.mods.has_score or self.mods.has_mask):
            for r in cutlass.range_constexpr(n_rows):
                row_values.append(self.mods.row_invariants(batch, row_head[r], row_q[r], mod_args))
        if const_expr(len(row_values) == 0 or row_values[0] is None):
            row_values = None

        self._load_q(mQ, sQ, tidx, head_kv, group, q_len, rows, m_block, batch)
        self._stamp(stamps, 2, tidx < 32)

        tSrQ = wg_qk.make_fragment_A(wg_qk.partition_A(sQ))
        tSrK = wg_qk.make_fragment_B(wg_qk.partition_B(sK))
        tOrVt = wg_pv.make_fragment_B(wg_pv.partition_B(mma.transpose_view(sV)))
        tOrP = wg_pv.make_fragment_A(wg_pv.partition_shape_A((cfg.tile_m, cfg.tile_n)))
        acc_shape_S = wg_qk.partition_shape_C((cfg.tile_m, cfg.tile_n))
        acc_O.fill(0.0)

        softmax = OnlineSoftmax(scale_log2, n_rows)
        softmax.reset()      # a split may visit no block at all

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.num_stages)
        ctx = (tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt, tOrP, acc_shape_S, acc_O, softmax,
               coords, row_head, row_q, row_values, pipe_k, pipe_v, batch, seqlen, softmax_scale, mod_args, kv0,
               sV, kv_rows)
        if count > 0:
            # The last block (visited first) is the only one that may straddle the length.
            kv_state = self._step(ctx, kv_state, first + count - 1, kv_bound=True, stamps=stamps)
        self._stamp(stamps, 3, tidx < 32)
        # Prefetched: the next block's tile-constant reads, issued before this block's step
        # (blocks run downwards; the last read, clamped to ``first``, is a harmless repeat).
        shape = pending = None
        if const_expr(cfg.prefetch_tile_reads):
            # (a split with fewer than two blocks reads, unused, a block below the length)
            last = cutlass.max((seqlen + cfg.tile_n - 1) // cfg.tile_n - 1, 0)
            shape = self._tile_values(ctx, cutlass.min(cutlass.max(first + count - 2, first), last),
                                      self.mods.has_mask)
            pending = _leaves(shape)
        for i in cutlass.range(1, count, unroll=1):
            n_block = first + count - 1 - i
            if const_expr(cfg.prefetch_tile_reads):
                current = _rebuild(shape, pending)
                pending = _leaves(self._tile_values(ctx, cutlass.max(n_block - 1, first), self.mods.has_mask))
                kv_state = self._step(ctx, kv_state, n_block, kv_bound=False, tile_values=current)
            elif const_expr(cfg.mask_last_page_only):
                # The pages before a sequence's last are full: tiles that end before the
                # last page starts skip the mask (pages wider than a tile: not only the bound one).
                if (n_block + 1) * cfg.tile_n > seqlen - cfg.page_size:
                    kv_state = self._step(ctx, kv_state, n_block, kv_bound=False)
                else:
                    kv_state = self._step(ctx, kv_state, n_block, kv_bound=False, masked=False)
            else:
                kv_state = self._step(ctx, kv_state, n_block, kv_bound=False)
            if const_expr(cfg.timeline):
                for k in cutlass.range_constexpr(1, 4):
                    if i == count * k // 4:
                        self._stamp(stamps, 7 + k, tidx < 32)
        self._stamp(stamps, 4, tidx < 32)

        inv_sum, lse = softmax.finalize()
        rescale_rows(acc_O, inv_sum)
        self._stamp(stamps, 15, tidx < 32)
        if const_expr(cfg.cluster_splits > 1):
            self._partial_to_smem(acc_O, lse, sPart, sLSE, thr_pv, rows, m_block)
        else:
            if const_expr(cfg.parity_slots):   # (this launch's set: the phase's parity)
                mOPart, mLSEPart = self._slot_set(mOPart, mLSEPart, _parity(phase))
            self.epilogue(acc_O, lse, mO, mLSE, mOPart, mLSEPart, thr_pv, split, num_splits,
                          head_kv, group, q_len, rows, m_block, batch)

    def _slot_set(self, mOPart, mLSEPart, which):
        """Parity slots: the partials' views of set ``which`` (0 or 1). The plan interleaves
        the sets split by split (mode 0's stride spans a split's two slots, and mode 0's size
        is this launch's split count: the grid's), so set 1 starts half a stride in."""
        o_half = cute.assume(mOPart.layout.stride[0] // 2, divby=4)   # (D a multiple of 32)
        lse_half = mLSEPart.layout.stride[0] // 2
        return (cute.make_tensor(mOPart.iterator + which * o_half, mOPart.layout),
                cute.make_tensor(mLSEPart.iterator + which * lse_half, mLSEPart.layout))

    def _tile_values(self, ctx, n_block, apply_mask: bool):
        """The mods' reads that stay constant over block ``n_block`` (a walk's table, a paged
        mask's page map: read at kv // page), one ``TileValues`` per fragment row, or None."""
        (_, _, _, _, _, _, _, _, _, _, row_head, row_q, row_values, _, _, batch, _, _, mod_args, kv0, _, _) = ctx
        mods = self.mods
        if not (mods.has_score or apply_mask):
            return None
        values = []
        for r in range(cute.size(row_head.shape)):     # (plain Python: traced inline)
            row = None if row_values is None else row_values[r]
            values.append(mods.tile_invariants(batch, row_head[r], row_q[r], kv0 + n_block * self.cfg.tile_n,
                                               self.cfg.tile_n, mod_args, row=row,
                                               score=mods.has_score, mask=apply_mask))
        return None if values[0] is None else values

    @cute.jit
    def _step(self, ctx, kv_state, n_block, kv_bound: cutlass.Constexpr[bool], masked: cutlass.Constexpr[bool] = True,
              tile_values=None, stamps=None):
        """One kv block: S = Q K^T, mods (``masked`` False: the block is known full, no
        mask), online softmax, O = O * scale + P V. ``tile_values``: the block's
        ``_tile_values`` read ahead (None: read here). ``stamps``: the timeline probe's
        K and V arrivals (the first block's)."""
        (tiled_mma_qk, tiled_mma_pv, tSrQ, tSrK, tOrVt, tOrP, acc_shape_S, acc_O, softmax,
         coords, row_head, row_q, row_values, pipe_k, pipe_v, batch, seqlen, softmax_scale, mod_args, kv0,
         sV, kv_rows) = ctx
        mods = self.mods
        apply_mask = mods.has_mask and masked
        # Read here: issued before the wait for K so the loads overlap it.
        if const_expr(tile_values is None):
            tile_values = self._tile_values(ctx, n_block, apply_mask)
        acc_S = cute.make_rmem_tensor(acc_shape_S, Float32)
        pipe_k.consumer_wait(kv_state)
        if const_expr(stamps is not None):
            self._stamp(stamps, 17, cute.arch.thread_idx()[0] < 128 + 32)
        mma.gemm(tiled_mma_qk, acc_S, tSrQ, tSrK[None, None, None, kv_state.index],
                      zero_init=True, wait=0)
        pipe_k.consumer_release(kv_state)

        kv_start = kv0 + n_block * self.cfg.tile_n   # the block's first key
        if const_expr(mods.has_score or apply_mask or kv_bound):
            apply_packed_mods(mma.acc_mn_view(acc_S), coords, row_head, row_q, row_values, mods, batch,
                              kv_start, seqlen, softmax_scale, mod_args, kv_bound, apply_mask, tile_values)
        row_scale, _ = softmax.step(acc_S, is_first=False)   # (no threshold: always)
        rescale_rows(acc_O, row_scale)
        tOrP.store(mma.acc_as_a_view(acc_S).load().to(self.dtype))

        pipe_v.consumer_wait(kv_state)
        if const_expr(stamps is not None):
            self._stamp(stamps, 18, cute.arch.thread_idx()[0] < 128 + 32)
        if const_expr(kv_bound and self.cfg.zero_v_overhang):
            self._zero_v_overhang(sV, kv_state.index, seqlen - kv_start, seqlen, kv_rows)
        mma.gemm(tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, kv_state.index],
                      zero_init=False, wait=0)
        pipe_v.consumer_release(kv_state)
        kv_state.advance()
        return kv_state

    @cute.jit
    def _zero_v_overhang(self, sV, stage, valid, seqlen, kv_rows):
        """``zero_v_overhang``: V rows ``valid`` .. tile_n - 1 of ring slot ``stage`` (keys at
        or past the length) set to zero, by every consumer thread, 16 bytes a store, then
        published to the P V wgmma (async proxy) — where memory was read there: a paged
        cache always, a contiguous one where the length is below the view's rows (past
        them the TMA wrote zeros). The condition is the same for every consumer thread."""
        cfg = self.cfg
        read_past = valid < cfg.tile_n
        if const_expr(not cfg.paged):
            read_past = read_past & (seqlen < kv_rows)
        if read_past:
            tidx = cute.arch.thread_idx()[0] - 128
            chunks = cfg.head_dim // 8
            slot = sV[None, None, stage]
            zeros = cute.make_rmem_tensor(8, self.dtype)
            zeros.fill(0.0)
            first = cutlass.max(valid, 0) * chunks
            for i in cutlass.range(first + tidx, cfg.tile_n * chunks, self.num_mma_threads, unroll=1):
                cute.local_tile(slot[i // chunks, None], (8,), (i % chunks,)).store(zeros.load())
            cute.arch.fence_view_async_shared()          # generic-proxy writes -> wgmma reads
            DecodeBarrier.V_ZEROED.sync(self.num_mma_threads)

    @cute.jit
    def epilogue(self, acc_O, lse, mO, mLSE, mOPart, mLSEPart, thr_pv, split, num_splits,
                 head_kv, group, q_len, rows, m_block, batch):
        """O rows straight from registers to their (q head, query row) in global memory:
        the final O in the input dtype with one split, else this split's fp32 partial, in its
        slot (``_zero_own_positions`` walks the same positions)."""
        self._for_own_rows(thr_pv, head_kv, group, q_len, rows, m_block, self._store_row,
                           (mma.acc_mn_view(acc_O), lse, mO, mLSE, mOPart, mLSEPart, split, num_splits, batch))

    @cute.jit
    def _for_own_rows(self, thr_pv, head_kv, group, q_len, rows, m_block, store_row, args):
        """The fragment walk of O's stores: ``store_row(r, tOcO, head, qi, *args)`` for each
        accumulator row ``r`` this thread holds that packs a real (q head, query row) —
        ``tOcO[r, c]`` is (row, head-dim column) of the row's c-th value. One walk, so the
        epilogue's stores and the parity slots' zeroing address the same positions."""
        cfg = self.cfg
        cO = cute.make_identity_tensor((cfg.tile_m, cfg.head_dim))
        tOcO = mma.acc_mn_view(thr_pv.partition_C(cO))
        for r in cutlass.range_constexpr(cute.size(tOcO.shape[0])):
            p = m_block * cfg.tile_m + tOcO[r, 0][0]
            if p < rows:
                head, qi = packed_row(p, head_kv, group, q_len)
                store_row(r, tOcO, head, qi, *args)

    @cute.jit
    def _store_row(self, r, tOcO, head, qi, o_mn, lse, mO, mLSE, mOPart, mLSEPart, split, num_splits, batch):
        """One row of the epilogue: the final O and LSE with one split, else this split's
        partial (marked where the merge polls)."""
        if num_splits == 1:
            gO = mO[batch, head, qi, None]
            for c in cutlass.range_constexpr(cute.size(o_mn.shape[1])):
                gO[tOcO[r, c][1]] = o_mn[r, c].to(self.dtype)
            if tOcO[r, 0][1] == 0:
                mLSE[batch, head, qi] = lse[r]
        elif const_expr(self.cfg.polled_merge):   # slots that mark themselves written
            gO = mOPart[split, batch, head, qi, None]
            for c in cutlass.range_constexpr(cute.size(o_mn.shape[1])):
                store_marked_f32(gO.iterator + tOcO[r, c][1], o_mn[r, c])
            if tOcO[r, 0][1] == 0:
                store_marked_f32(mLSEPart.iterator + cute.crd2idx((split, batch, head, qi), mLSEPart.layout),
                                 lse[r])
        else:
            gO = mOPart[split, batch, head, qi, None]
            for c in cutlass.range_constexpr(cute.size(o_mn.shape[1])):
                gO[tOcO[r, c][1]] = o_mn[r, c]
            if tOcO[r, 0][1] == 0:
                mLSEPart[split, batch, head, qi] = lse[r]

    @cute.jit
    def _zero_own_positions(self, mOPart, mLSEPart, phase, split, num_splits, thr_pv, head_kv, group, q_len, rows,
                            m_block, batch):
        """Parity slots, a split that does not merge, after its partial stores: zero the
        other set's slots split + k * splits below the last launch's split count, each
        thread where the epilogue stores (the same walk, ``_for_own_rows``) — the
        last launch's partials, read by its merger (stream order). ``phase``: the word this
        thread read at its start, whose parity addressed its partial's stores, so the read
        precedes the merger's flip."""
        mOPart, mLSEPart = self._slot_set(mOPart, mLSEPart, 1 - _parity(phase))
        for j in cutlass.range(split, _last_count(phase), num_splits, unroll=1):
            self._for_own_rows(thr_pv, head_kv, group, q_len, rows, m_block, self._zero_row,
                               (mOPart, mLSEPart, j, batch))

    @cute.jit
    def _zero_row(self, r, tOcO, head, qi, mOPart, mLSEPart, j, batch):
        """One row of slot ``j`` zeroed where the epilogue would store it."""
        gO = mOPart[j, batch, head, qi, None]
        for c in cutlass.range_constexpr(cute.size(tOcO.shape[1])):
            gO[tOcO[r, c][1]] = Float32(0.0)
        if tOcO[r, 0][1] == 0:
            mLSEPart[j, batch, head, qi] = Float32(0.0)

    @cute.jit
    def _partial_to_smem(self, acc_O, lse, sPart, sLSE, thr_pv, rows, m_block):
        """Cluster merge: this split's normalized O rows (fp32) and LSEs into its own shared
        memory, over the K/V rings — after every consumer warp's last wgmma has read them."""
        cfg = self.cfg
        DecodeBarrier.ARRIVAL.sync(self.num_mma_threads)
        cO = cute.make_identity_tensor((cfg.tile_m, cfg.head_dim))
        tOcO = mma.acc_mn_view(thr_pv.partition_C(cO))
        o_mn = mma.acc_mn_view(acc_O)
        for r in cutlass.range_constexpr(cute.size(o_mn.shape[0])):
            row = tOcO[r, 0][0]
            if m_block * cfg.tile_m + row < rows:
                for c in cutlass.range_constexpr(cute.size(o_mn.shape[1])):
                    sPart[row, tOcO[r, c][1]] = o_mn[r, c]
                if tOcO[r, 0][1] == 0:
                    sLSE[row] = lse[r]

    @cute.jit
    def _merge_cluster(self, mO, mLSE, sPart, sLSE, tidx, rank, head_kv, group, q_len, rows, m_block, batch):
        """Cluster merge: CTA `rank` merges the tile rows r with r % splits == rank, one
        consumer warp per row, reading every split's row from its CTA's shared memory
        (each lane D/32 columns; the partial loads go out before the LSE reduction, so a
        row costs about one distributed-shared-memory round trip). Same arithmetic as
        `combine.merge_splits`."""
        cfg = self.cfg
        splits = cfg.cluster_splits
        D = cfg.head_dim
        per_lane = lane_columns(D)
        warp = tidx // 32
        lane = tidx % 32
        warps = self.num_mma_threads // 32
        p_lo = m_block * cfg.tile_m
        tile_rows = cutlass.min(cfg.tile_m, rows - p_lo)
        for r in cutlass.range(rank + splits * warp, tile_rows, splits * warps, unroll=1):
            if const_expr(D % 32 == 0):
                cols = sPart.iterator + (r * D + lane * per_lane)
                parts = [dsmem.load_f32s_in_rank_chunked(cols, Int32(s), per_lane) for s in range(splits)]
            else:   # strided columns (lane_columns); those past D read column D - 1, weigh 0
                row = sPart.iterator + r * D
                parts = [[cutlass.select_(lane + 32 * i < D,
                                          dsmem.load_f32s_in_rank(row + cutlass.min(lane + 32 * i, D - 1),
                                                                  Int32(s), 1)[0], Float32(0.0))
                          for i in range(per_lane)] for s in range(splits)]
            lse_s = -Float32.inf
            if lane < splits:
                lse_s = dsmem.load_f32s_in_rank(sLSE.iterator + r, lane, 1)[0]
            m = cute.arch.warp_reduction_max(lse_s)
            w = cute.math.exp2(lse_s * Float32(LOG2_E) - log2_shift(m), fastmath=True)   # lanes >= splits: 0
            total = cute.arch.warp_reduction_sum(w)
            inv, lse = inverse_and_lse(m, total)
            acc = cute.make_rmem_tensor(per_lane, Float32)
            acc.fill(0.0)
            for s in cutlass.range_constexpr(splits):
                w_s = cute.arch.shuffle_sync(w, s)
                for i in cutlass.range_constexpr(per_lane):
                    acc[i] = acc[i] + w_s * parts[s][i]
            p = p_lo + r
            head, qi = packed_row(p, head_kv, group, q_len)
            if const_expr(D % 32 == 0):
                out = cute.local_tile(mO[batch, head, qi, None], (per_lane,), (lane,))
                out.store((acc.load() * inv).to(mO.element_type))
            else:
                for i in cutlass.range_constexpr(per_lane):
                    if lane + 32 * i < D:
                        mO[batch, head, qi, lane + 32 * i] = (acc[i] * inv).to(mO.element_type)
            if lane == 0:
                mLSE[batch, head, qi] = lse

    # ------------------------------------------------------------------ in-kernel merge
    @cute.jit
    def _arrived_last(self, ticket, num_splits, sFlag, tidx) -> cutlass.Boolean:
        """Called by every consumer thread after its partial stores: True in the CTA whose
        arrival completes its group's count (it then owns the merge; the count is reset)."""
        DecodeBarrier.ARRIVAL.sync(self.num_mma_threads)
        if tidx == 0:
            self._count_in(ticket, num_splits, sFlag, "acq_rel")
        DecodeBarrier.ARRIVAL.sync(self.num_mma_threads)
        return sFlag[0] != 0

    @cute.jit
    def _count_in(self, ticket, num_splits, sFlag, sem: cutlass.Constexpr[str]):
        """One thread: this CTA counted in its group's ticket (an atomic of ordering
        ``sem``); ``sFlag[0]`` = 1 in the CTA that completes the count, which resets it —
        every split of this launch has counted, so none touches it again, and the next
        launch (stream order) finds it zero."""
        counted = cute.arch.atomic_add(ticket, Int32(1), sem=sem, scope="gpu")
        last = Int32(0)
        if counted == num_splits - 1:
            last = Int32(1)
            cute.arch.atomic_exch(ticket, Int32(0), sem="relaxed", scope="gpu")
        sFlag[0] = last

    @cute.jit
    def _take_start_ticket(self, ticket, num_splits, sFlag):
        """Polled merge, by the producer warpgroup's idle warp 1 at the CTA's start: count
        this CTA's start in its group's ticket; the last to start merges (``sFlag[0]``, to
        the consumers through ``DecodeBarrier.MERGER``) and resets the ticket (every split
        of this launch has counted)."""
        if cute.arch.lane_idx() == 0:
            self._count_in(ticket, num_splits, sFlag, "relaxed")
        cute.arch.sync_warp()
        DecodeBarrier.MERGER.arrive(self.num_mma_threads + 32)

    @cute.jit
    def _take_parity_ticket(self, word, num_splits, sFlag, mOPart, mLSEPart, split, head_kv, group, q_len, rows,
                            m_block, batch):
        """Parity slots, by the producer warpgroup's idle warp 1 at the CTA's start. Its
        group's phase word holds the count of started splits (bits 0-15), the launch's
        parity (bit 16: the set its partials go to) and the last launch's split count (bits
        24-31). Count this CTA in; the last to start merges (``sFlag[0]``, to the consumers
        through ``DecodeBarrier.MERGER``) and, after its merge, sets the word for the next
        launch (count 0, parity flipped, this split count). ``sFlag[1]``: the word found.

        The other set holds the last launch's partials (slots below its split count), read
        by its merger (stream order): no one reads or writes it in this launch but the
        zeroing. A split that does not merge zeroes its slots (split + k * splits) after its
        partial stores (``_zero_own_positions``); the merger's warp 1 zeroes its own here,
        as soon as it knows it merges: 2 KB (B1 Hq32 D128) in 1 CTA of 13, off its tail."""
        cfg = self.cfg
        lane = cute.arch.lane_idx()
        if lane == 0:
            old = cute.arch.atomic_add(word, Int32(1), sem="relaxed", scope="gpu")
            last = Int32(0)
            if (old & 0xFFFF) == num_splits - 1:
                last = Int32(1)
            sFlag[0] = last
            sFlag[1] = old
        cute.arch.sync_warp()   # (lane 0's flags, to the warp's lanes)
        if const_expr(not cfg.caller_empties_slots):
            if sFlag[0] != 0:
                found = sFlag[1]
                self._zero_other_set(mOPart, mLSEPart, split, num_splits, 1 - _parity(found), _last_count(found),
                                     lane, head_kv, group, q_len, rows, m_block, batch)
            cute.arch.sync_warp()
        DecodeBarrier.MERGER.arrive(self.num_mma_threads + 32)

    @cute.jit
    def _zero_other_set(self, mOPart, mLSEPart, first, step, other, prev, lane, head_kv, group, q_len, rows,
                        m_block, batch):
        """Parity slots, one warp: zero slots j = first + k * step of set ``other`` below
        ``prev``, the last launch's split count (past this launch's count, mode 0's size,
        where it shrank: the plan's memory holds its capacity); every row of the tile, each
        lane D/32 columns."""
        cfg = self.cfg
        mOPart, mLSEPart = self._slot_set(mOPart, mLSEPart, other)
        p_lo = m_block * cfg.tile_m
        tile_rows = cutlass.min(cfg.tile_m, rows - p_lo)
        for j in cutlass.range(first, prev, step, unroll=1):
            for r in cutlass.range(tile_rows, unroll=1):
                head, qi = packed_row(p_lo + r, head_kv, group, q_len)
                zero_lane_columns(mOPart[j, batch, head, qi, None], lane, cfg.head_dim)
                if lane == 0:
                    mLSEPart[j, batch, head, qi] = Float32(0.0)

    @cute.jit
    def _merge_group(self, mO, mLSE, mOPart, mLSEPart, tidx, head_kv, group, q_len, rows, m_block, batch,
                     stamps=None, phase=None):
        """The merging split CTA of a group (tickets: the last to arrive; polled: the last to
        start): merge every split's partial of the tile's rows into O (input dtype) and LSE,
        one consumer warp per row (rows strided over warps). Parity slots: the launch's set
        (``phase``'s parity); nothing emptied."""
        cfg = self.cfg
        if const_expr(cfg.parity_slots):
            mOPart, mLSEPart = self._slot_set(mOPart, mLSEPart, _parity(phase))
        merge = merge_polled_splits if const_expr(cfg.polled_merge) else merge_splits
        warp = tidx // 32
        lane = tidx % 32
        p_lo = m_block * cfg.tile_m
        tile_rows = cutlass.min(cfg.tile_m, rows - p_lo)
        warps = self.num_mma_threads // 32
        for r in cutlass.range(warp, tile_rows, warps, unroll=1):
            p = p_lo + r
            head, qi = packed_row(p, head_kv, group, q_len)
            # (the timeline's probe: the first row's polling, stamps 13, 14 and 16)
            probe = (stamps + 13, r == 0) if const_expr(cfg.polled_merge and cfg.timeline) else ()
            kw = {"empty": False} if const_expr(cfg.caller_empties_slots or cfg.parity_slots) else {}
            if const_expr(cfg.polled_merge):
                kw["chunk"] = cfg.merge_chunk
            lse = merge(mLSEPart[None, batch, head, qi], mOPart[None, batch, head, qi, None], mO[batch, head, qi, None],
                        lane, cfg.head_dim, *probe, **kw)
            if lane == 0:
                mLSE[batch, head, qi] = lse


def _parity(phase):
    """A phase word's parity (bit 16): the set of slots this launch's partials go to."""
    return (phase >> 16) & 1


def _next_phase(phase, num_splits):
    """Parity slots: the next launch's phase word (count 0, parity flipped, this split count)."""
    return ((1 - _parity(phase)) << 16) | (num_splits << 24)


def _last_count(phase):
    """A phase word's last split count (bits 24-31): the other set's slots still written."""
    return (phase >> 24) & 0xFF


def _leaves(tree) -> list:
    """The run-time values in a structure of tuples, lists and named tuples (a hook's
    ``tile_invariants``), flat: a loop-carried variable. Python numbers and None stay
    structure."""
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return []
    if isinstance(tree, (tuple, list)):
        return [leaf for item in tree for leaf in _leaves(item)]
    return [tree]


def _rebuild(like, leaves) -> object:
    """``like`` with its run-time values replaced by ``leaves`` in ``_leaves``' order."""
    it = iter(leaves)

    def build(tree):
        if tree is None or isinstance(tree, (bool, int, float, str)):
            return tree
        if isinstance(tree, tuple) and hasattr(tree, "_fields"):
            return type(tree)(*(build(item) for item in tree))
        if isinstance(tree, (tuple, list)):
            return type(tree)(build(item) for item in tree)
        return next(it)
    return build(like)


def _classify_keys(mask_expr, batch, heads, q_last, kv_lo, kv_hi, args, scan_limit: int):
    """``interval_emit.classify`` of the mask over keys [kv_lo, kv_hi] for an M tile's rows
    (sequence ``batch``, q heads ``heads`` = (first, last), query rows [0, q_last]): 1 surely
    kept, 0 surely masked, -1 undecided."""
    ranges = {"b": (batch, batch), "h": heads, "q": (Int32(0), q_last), "kv": (kv_lo, kv_hi)}
    return interval_emit.classify(mask_expr, ranges, args, scan_limit=scan_limit)


def packed_row(p, head_kv, group, q_len) -> tuple:
    """(q head, query row) of packed row `p` of kv head `head_kv`'s group (rows are
    head-major: p = head_in_group * q_len + query row)."""
    h_in = p // q_len
    return head_kv * group + h_in, p - h_in * q_len


@cute.jit
def apply_packed_mods(s_mn: cute.Tensor, coords: FragmentCoords, row_head: cute.Tensor,
                      row_q: cute.Tensor, row_values: cutlass.Constexpr, mods: cutlass.Constexpr,
                      batch: Int32, kv_start: Int32,
                      seqlen: Int32, softmax_scale: Float32, args,
                      kv_bound: cutlass.Constexpr[bool], masked: cutlass.Constexpr[bool] = True,
                      tile_values: cutlass.Constexpr = None):
    """`mod_hook.apply_mods` for GQA-packed rows: fragment row r belongs to q head
    `row_head[r]` and query row `row_q[r]`. With `kv_bound`, keys at or beyond `seqlen` are
    masked and the hooks see min(kv, seqlen - 1) (buffers of cache length stay in bounds).
    `row_values[r]`: row r's `mods.row_invariants` (emitted before the kv loop), or None.
    `masked` False: the block is known full, the mask is not evaluated. `tile_values[r]`:
    row r's `mods.tile_invariants` for this block, or None."""
    kv_base = kv_start + coords.col_offset()
    kv_last = seqlen - 1
    for r in cutlass.range_constexpr(cute.size(s_mn.shape[0])):
        head = row_head[r]
        q = row_q[r]
        for c in cutlass.range_constexpr(cute.size(s_mn.shape[1])):
            kv = kv_base + coords.col0(c)
            kv_hook = kv
            if const_expr(kv_bound):
                kv_hook = cutlass.min(kv, kv_last)
            s = s_mn[r, c]
            row = {} if const_expr(row_values is None) else {"row": row_values[r]}
            if const_expr(tile_values is not None):
                row["tile"] = tile_values[r]
            if const_expr(mods.has_score):
                s = mods.score(s * softmax_scale, batch, head, q, kv_hook, args, **row)
            if const_expr(mods.has_mask and masked):
                keep = mods.mask(batch, head, q, kv_hook, args, **row)
                s = kept_if(keep, s)
            if const_expr(kv_bound):
                s = kept_if(kv < seqlen, s)
            s_mn[r, c] = s
