"""FlashAttention backward for Hopper (sm_90a) in CuTeDSL, with the mod hook's derivative.

Math (per query head h, FlexAttention semantics as in `flexattn.reference.backward`):

    s  = scale * q k^T               s' = score_mod(s)   (masked -> -inf)
    P  = exp(s' - lse)               dV = P^T dO
    dP = dO V^T                      D  = rowsum(dO * O)   (bwd/preprocess.py; minus dLSE)
    dS' = P * (dP - D)               dS = dS' * ds'/ds     (0 where P == 0)
    dK = scale * dS^T Q              dQ = scale * dS K     (scale applied in postprocess)
    d buf[idx] += dS' * ds'/d buf[idx]   for each read of a captured float buffer

One CTA = (tile_n = 128 keys) x (one *kv* head) x (one batch). It loops over the q heads
of its GQA group and, per head, over the q blocks of tile_m rows that see its keys
(bwd/q_blocks.py), so dK/dV of a kv head are summed in registers: no atomics, deterministic,
written once in the input dtype by TMA. dQ gets one contribution per kv block: each
visit's fp32 dQ tile goes to shared memory and a writer warp adds it into a workspace
(`dq_accum`, zeroed by the preprocess) with bulk `cp.reduce.async.bulk .add.f32` copies;
the postprocess converts it. (`BwdConfig.max_ctas`, not planned: persistent CTAs walk
several such tiles in turn, see there.)

    warpgroup 0, warp 0   producer: K, V once (one mbarrier); per visit Q + LSE and
                          dO + D through two `num_stages` rings (TMA; LSE/D 1-D boxes)
    warpgroup 0, warp 1   dQ writer: per visit, waits for each consumer warpgroup's half
                          of the dQ tile (named barriers dq_full / dq_empty, 128 + 32
                          threads) and adds it to dq_accum (tile_m x D / 2 fp32 per bulk
                          copy: 16 KB at tile_m 64)
    warpgroups 1, 2       consumers, 64 keys each. Everything is computed *transposed*
                          (keys on the wgmma M axis), so P^T and dS^T leave the S^T / dP^T
                          accumulators directly as register A operands of dV += P^T dO and
                          dK += dS^T Q (the forward's P V trick). dQ = dS K needs all 128
                          keys as its K dimension: both warpgroups store dS^T to smem
                          (stmatrix), then each computes half of dQ's head dim.

tile_m (`BwdConfig.tile_m`, chosen by bwd.plan.choose_tile_m): 64, 128 at head dims up to
64 (dQ's warpgroups then run two M atoms each), or 80 for dense non-causal head dim 128 (FA3/FA4's tile there: 25% more q rows per K/V reuse, fewer
visits per CTA, fewer and larger dQ bulk adds). 80 rows cannot be a wgmma M (64 per
warpgroup), so dQ is computed transposed (`dq_swap_ab`): dQ^T [D, 80] = K^T dS^T, each
warpgroup taking 64 head dims on M and the 80 rows on N; dS is then stored keys-
contiguous (transposing stmatrix), the K-major B of that GEMM. The fp32 dQ^T fragments
go through sdQ and the bulk adds as before (fragment order), and the postprocess stores
them back transposed. Shared memory at 80: Q, dO, dS 2 x 20 KB each, K, V 32 KB each,
sdQ 40 KB, LSE / D: 227 KB, the sm_90 limit, so no room for the relative-bias diagonal
sums (sDiag: at 80 each thread adds its diagonals itself; the planner keeps 64 for those
mods).

Head dims beyond 128 (`BwdConfig.split_head_dim`, docs/KERNELS.md): 64-key CTAs whose
warpgroups split dK / dV / dQ over the head dim, or, for the dense and causal walks at head
dims that are multiples of 64 up to 192, the swapped layout (`BwdConfig.dkv_swap`): 96-key
CTAs, S = Q K^T with the keys split between the warpgroups, dK^T = Q^T dS and dV^T = dO^T P.

Per visit (consumer warpgroup):  LSE to registers, S^T = K Q^T, dP^T = V dO^T (SS, async)
-> P^T from LSE (mods re-applied exactly as the forward does; D read while dP^T runs)
-> dS^T -> dS^T to smem (double-buffered by Q stage), dV (RS, async) -> barrier ds_full
-> dQ (SS) -> dK (RS) -> dQ to smem for the writer (while dK runs).

Workspaces (fp32, rows padded to `BwdConfig.q_pad`): lse_log2 (LSE * log2 e; +inf for
empty or padding rows so P = 0 there), delta (D), dq_accum. See bwd/preprocess.py.

`BwdConfig.deterministic` (the design and the no-deadlock argument: launch/backward.py):
CTAs take kv blocks from the highest down (non-causal: heads interleaved in L2 sections,
`_deterministic_tile`); before its bulk adds for q tile m, the dQ
writer warp counts the kv blocks after this one that visit the tile
(`bwd.q_blocks.KvVisitors`; block-sparse: from the kv-side lists) and its lane 0 spins
(ld.acquire.gpu) on the tile's int32 flag until it equals that count; it issues the adds,
waits for their writes to complete, and adds 1 to the flag (red.release.gpu). The
consumers never wait for turns. Buffer-gradient contributions go to 128-bit fixed-point
accumulators (`atomics.red_add_fixed`) instead of fp32 atomics. The steps are the same;
the q-block walks are not rotated (`_rotation`) and block-sparse ones merge their two lists
in ascending order (`_visit`), so dK/dV are the default mode's sums in another order
(bitwise the same under causal, which never rotates).
"""

import dataclasses
import math
from dataclasses import dataclass, field
from typing import NamedTuple

import cuda.bindings.driver as cuda

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_helpers
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup

from flexattn.kernels.hopper import mma
from flexattn.kernels.hopper.atomics import (atom_add_acquire_s32, atom_add_release_s32, bulk_add_f32, bulk_load,
                                             bulk_store, ld_acquire_s32, red_release_add_s32, trap)
from flexattn.kernels.blockmask.visit import _kernel_ops, band_bounds, band_of
from flexattn.kernels.bwd.pointwise import BwdPointwise, _diagonal_flushes, _element_order
from flexattn.kernels.bwd.q_blocks import BwdWalks, KvVisitors, visitor_count
from flexattn.kernels.emit.mod_hook import NO_MODS, FragmentCoords, ModHook
from flexattn.kernels.hopper.tile_scheduler import L2_BYTES_FOR_KV, ByHead, LongestFirst, TileSpace, grid_size
from flexattn.kernels.hopper.tma_pipeline import lockstep_state, multicast_slice, tma_ring
from flexattn.kernels.hopper.warp_specialized import (DTYPES, KernelConfig, NamedBarriers, WarpSpecialized, register_split,
                                                      stage_tiles, store_staged)

LOG2_E = math.log2(math.e)

# What a consumer step (`_step`, `_idle_step`) reads: the warpgroup's MMAs and fragments (built
# once in `consume`), this visit's kv tile and q head, the call's sizes, scales and mod arguments.
_BwdStep = NamedTuple("_BwdStep", [(name, object) for name in (
    "mmas", "frags", "acc_shape_nm", "acc_shape_md", "acc_dV", "acc_dK", "coords", "r2s_dS", "tdSsdS",
    "tdQsdQ", "wg", "sLSE", "sDelta", "pipe_q", "pipe_do", "n_block", "head", "batch", "seqlen_q",
    "seqlen_k", "softmax_scale", "scale_log2", "mod_args", "grad_args", "sDiag")])

# Deterministic mode: a CTA waiting this long for its dQ turn traps (the launch fails
# instead of hanging). Legitimate waits are at most one CTA's work (milliseconds);
# only kv-side block lists that are not the transposes of the q-side ones, or a GPU that
# does not dispatch CTAs in index order, can get here.
DQ_TURN_TIMEOUT_NS = 1 << 34      # ~17 s
DQ_STORED = 1 << 20               # dq_first_store: the tile's first store has landed (above the tickets)
L2_BYTES = 50 * 1024 * 1024       # the L2 section size of the deterministic CTA order
SMEM_CAPACITY = mma.SMEM_CAPACITY

_REGS = register_split(2, 24)     # two consumer warpgroups: 24 + 2 x 240 fills the register file
FP32_TILE_M = 32                  # q rows per visit of the float32 kernel (bwd/tf32_sync.py)


@dataclass(frozen=True)
class BwdConfig(KernelConfig):
    """Everything that changes the generated backward code (runtime values never do)."""

    KIND = "bwd"
    ELEMENT_TYPES = {**DTYPES, "fp32": Float32}   # fp32: bwd/tf32_sync.py's kernel

    dtype: str = "bf16"           # "bf16" | "fp16" | "fp32": Q, K, V, O, dO, dQ, dK, dV
    head_dim: int = 128           # a multiple of 16, 32 .. 256: Q, K, dQ, dK
    head_dim_v: int | None = None  # the same for V, O, dO, dV (None: head_dim)
    tile_m: int = 64              # q rows per visit (N of the S^T GEMM): 64 | 80 (dQ swapped)
                                  # | 128 (head dims up to 64: bwd.plan.choose_tile_m)
    tile_n: int | None = None     # keys per CTA: 128 (64 per consumer warpgroup), or 64
                                  # where a head dim exceeds 128 (`split_head_dim`), or 96
                                  # there in the swapped layout (`dkv_swap`); None: 128 / 64
    num_stages: int | None = None  # Q/LSE and dO/D ring depth; None: 2, or 1 where 2 do not
                                  # fit shared memory (`split_head_dim` at the widest heads)
    # The split layouts (`split_head_dim`) only: the dO / D ring's depth where it is shallower
    # than Q's (None: num_stages; FA4's 2 Q + 1 dO stages at 192/192 and 256), and the dS^T
    # buffers (None: 2, by visit parity; 1 in the swapped layout: a barrier before it is
    # rewritten, when both warpgroups' dQ GEMMs of the previous visit have retired).
    do_stages: int | None = None
    ds_buffers: int | None = None
    causal: bool = False          # block structure: skip q blocks above the diagonal
    block_sparse: bool = False    # block structure from the BlockMask's q-side lists
    partial_blocks: bool = True   # block_sparse: the lists may hold partial blocks. False:
                                  # the full list alone is walked (planned with the forward's
                                  # FwdConfig.partial_blocks; FLEXATTN_BWD_FULL_ONLY=0: both walks)
    band: bool = False            # block structure of the mask's band of diagonals, by
                                  # arithmetic (as the forward's; not deterministic)
    sparse_block_m: int = 128     # q rows of one BlockMask block (a multiple of tile_m)
    mods: ModHook = field(default=NO_MODS, compare=False)
    producer_regs: int = _REGS[0]  # setmaxnreg budgets (warp_specialized.register_split)
    consumer_regs: int = _REGS[1]
    deterministic: bool = False   # dQ adds in a fixed order, exact buffer-grad sums
    # CTA order (hopper/tile_scheduler.py): "by_head" (kv blocks of a head in launch order; the
    # deterministic mode's turn order needs it) or "longest_first" (default under causal:
    # kv block 0 sees every q block, the last one a few; long ones start first).
    tile_order: str | None = None
    # Deterministic dQ writer: when a tile's turn is passed on. "after_adds": as soon as
    # this CTA's adds landed (the next CTA's wait is shortest; the writer waits for the
    # landing before taking its next tile). "next_visit": after the writer's next tile is
    # ready (the landing wait is off the writer's path; the turn passes up to a step
    # later). None: "next_visit" for block-sparse (the writer also counts its turn from
    # the lists there, and a band's next visitor is two steps behind), else "after_adds"
    # (dense walks are in lockstep: the next visitor is right behind). H200, B4 S4096 H16
    # D128 backward kernel, µs: full 2542 after_adds / 2617 next_visit; window1024 914 / 849.
    dq_turn_pass: str | None = None
    # CTAs per cluster along the kv blocks (1 or 2). With 2, the CTAs of kv blocks 2c and
    # 2c + 1 of one head walk the same q blocks and load each Q / dO tile once for both
    # (TMA multicast, as the forward's cluster_m shares K/V). Dense, not deterministic
    # (its dQ turns follow single CTAs); the caller guarantees an even number of kv blocks.
    cluster_n: int = 1
    # Persistent CTAs (0: one CTA per kv tile): at most this many (the SM count), each walking
    # linear tiles first, first + stride, ... in `order`. The producer loads the next tile's
    # first Q / dO while the consumers finish this one, and its K / V once they have released
    # sK / sV (`FlashBwdSm90.dkv_staged_apart`: before the epilogue, which stages dK / dV in
    # sdQ / sdS; else after it); the dQ writer's last adds and the CTA launch overlap the next
    # tile. Measured faster for documents (1-2%), slower for windows and dense walks: planned
    # for block lists with even, short kv-block columns (core/kernel_path._backward_ctas).
    # Not deterministic (a CTA waiting for a later tile's dQ turn could wait for itself),
    # no clusters.
    max_ctas: int = 0
    # dQ finished in this kernel (no postprocess): the dQ writer counts each q tile's
    # landed adds in dq_semaphore (atom.release); the CTA whose adds complete the tile (its
    # count reaches the tile's visitor count, `_dq_visitors`) hands it to two finisher
    # warps (producer warps 2 and 3, one warpgroup column each), which read it back into
    # shared memory (TMA bulk copy), scale, convert and store dQ while the CTA goes on.
    # The 128-key, 64-row layout where the 32 KB read-back buffer fits beside the tiles
    # (`finish_allowed`); not deterministic (its turns order the adds already), not
    # persistent. dQ rows no CTA visits are empty (LSE -inf): the preprocess zeroes them.
    # Measured slower than the postprocess (each CTA's end waits for its last adds to land
    # and counts them), so not planned: FLEXATTN_DQ_FINISH=1 plans it (bwd/plan.py).
    dq_finish: bool = False
    # fp32: tf32 MMAs per product, 1 or 3 (3xTF32: torch's "highest" float32 precision)
    tf32_passes: int = 1
    # fp32, 3xTF32: S^T's and dP^T's chains over the head dim summed in a fresh accumulator
    # every this many k-blocks, then added with fp32 adds (0: one accumulator; tf32_sync's
    # promote). dS = P (dP - D) cancels in rows that see few keys, where one accumulator's
    # truncating adds over the head dim left dQ 4x further from float64 than torch flex's;
    # in pieces of 2 it is at flex's, in pieces of 1 below it at D64 / D128 (H200,
    # 2026-11-30, docs/experiments.md). None: `default_chain_promote`.
    # FLEXATTN_BWD_CHAIN_PROMOTE=N overrides, for A/B runs.
    chain_promote: int | None = None
    # fp32, 3xTF32, head dims <= 128: dQ's key chain summed in pieces of this many k-blocks.
    dq_promote: int = 4
    # fp32, 3xTF32: dK / dV's per-visit fresh accumulator (their long chain over the q rows)
    # covers 1 / dkv_pieces of their columns, the pieces one after another (0: none, one
    # accumulator). None: 1 up to head dim 128; beyond, where an accumulator of the whole
    # size spills, 2 up to 192 and 8 at 256 (ptxas: 28 / 52 bytes of spills against 124 /
    # 884). Without it dK / dV at 192 were 10x further from float64 than at 128 (H200,
    # 2026-11-30). FLEXATTN_BWD_DKV_PIECES=N overrides, for A/B runs.
    dkv_pieces: int | None = None
    # Programmatic dependent launch (PDL): the main kernel and the postprocess are launched
    # as dependents of the kernel before them, whose CTAs all signal
    # `griddepcontrol.launch_dependents` as they start: a dependent's CTAs take SMs as its
    # predecessor's drain (launch and K / V loads overlap that tail) and wait
    # (`griddepcontrol.wait`) before touching what the predecessor writes — the main
    # kernel's producer before the first Q / LSE / dO / D load, its dQ writer before the
    # first add, its consumers (buffer-gradient accumulators) at the start; the
    # postprocess at the start. Off: every kernel waits for the one before to finish.
    # Measured neutral (H200, fwd+bwd B4 S4096: 0.999-1.005x), so not planned:
    # FLEXATTN_BWD_PDL=1 plans it (bwd/plan.py).
    pdl: bool = False
    # FA4's choices at head dim 256 (planned there, bwd.plan.SWAP_PLANNED: 1.14-1.58x faster
    # fwd+bwd kernels than the split layout, H200, 2026-11-28).
    # dkv_rows: in the swapped layout the warpgroups split dK^T / dV^T over the head dim (M:
    # m64n<tile_n> atoms, FA4's AtomLayoutNdKV=1) instead of the keys (m64n<tile_n / 2>);
    # both then read all of P^T, so its store waits for both warpgroups' previous visit.
    dkv_rows: bool = False
    # tail_order of the split layouts' dQ / dV / dK GEMMs: "dq_first" (the default: dQ's
    # accumulator dies early) or "dv_first" (FA4's: dV, dQ, dK; dO released as soon as dV
    # retired, before the dQ staging waits for the writer — a single dO slot refills sooner).
    tail_order: str = "dq_first"
    # p_early: the swapped layout with the keys split (not dkv_rows), without a score mod:
    # P^T goes to shared memory as soon as it is converted, while dP's GEMM still runs
    # (FA4's order), instead of with dS^T after it. Each warpgroup writes and reads only its
    # own keys' rows of the one P^T buffer, whose last reader (its own previous dV^T GEMM)
    # retired at the end of the previous visit. Measured neutral at 192/192 (H200, 2026-11-29:
    # 3.18-3.31 ms against 3.03-3.23 without), so not planned.
    p_early: bool = False
    # idle_masked_keys: on a visit whose mask hides all of a warpgroup's 64 keys from all of
    # the q tile's rows (the causal diagonal's first visit, a band's two edge visits: known
    # from the structure, per visit), that warpgroup skips its S^T / dP^T GEMMs, the
    # pointwise pass and its dV / dK GEMMs, stores its half of dS^T as zeros (dQ reads all
    # keys) and computes its share of dQ (`_idle_step`). P and dS are exactly 0 there, so
    # the gradients are bitwise those of the full step. For 128-key CTAs of the split-free
    # layout, causal or band walks, without per-diagonal buffer-gradient sums. Planned there
    # (bwd/plan.py): fwd+bwd kernels 0.5-2% faster on window1024 / causal (H200, 2026-11-29).
    idle_masked_keys: bool = False
    # dq_first_store: the first visit to land on a dQ tile stores it (a bulk copy) instead of
    # adding into zeros, so the preprocess zeroes only the rows no CTA visits (LSE -inf)
    # and the tiles' tickets, not the whole dq_accum (2 x dQ's bytes of DRAM writes), and
    # the main kernel's first add into a line no longer fetches it. Per (q head, q tile) an
    # int32 in dq_semaphore: the writer draws a ticket (atom.relaxed, old value 0: first)
    # before its visit's copies; the first visitor publishes (red.release of
    # DQ_STORED) once its store has landed, which it checks at its next visit's start (or
    # its end), where the wait is short; later visitors wait for that before their adds.
    # Not deterministic (its turns order the adds), not with dq_finish.
    dq_first_store: bool = False
    # dq_ticket_on_data (with dq_first_store): the ticket is drawn once the visit's first dQ
    # half is staged (after DQ_FULL) instead of at the visit's start, so the first visitor is
    # the one whose data is ready first (fewer waits, one atomic's latency on the path).
    dq_ticket_on_data: bool = False
    # l2_section_bytes: the longest-first order's L2 budget (0: hopper.tile_scheduler's
    # L2_BYTES_FOR_KV): a section holds the most (kv head, batch) pairs, a power of two,
    # whose Q, dO, LSE, D and dq_accum rows fit in it.
    l2_section_bytes: int = 0

    def __post_init__(self):
        self.check_dtype()
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        for name in ("head_dim", "head_dim_v"):
            d = getattr(self, name)
            if d % 16 or not 32 <= d <= 256:
                raise ValueError(f"{name} must be a multiple of 16 from 32 to 256, got {d}")
        if self.tf32_passes not in (1, 3) or (self.tf32_passes == 3 and self.dtype != "fp32"):
            raise ValueError(f"tf32_passes must be 1, or 3 with dtype 'fp32', got {self.tf32_passes}")
        if self.chain_promote is None:
            object.__setattr__(self, "chain_promote", self.default_chain_promote())
        if self.chain_promote and (self.tf32_passes != 3 or self.chain_promote < 0):
            raise ValueError(f"chain_promote is 3xTF32's (tf32_passes=3), got {self.chain_promote}")
        if self.dkv_pieces is None:
            widest = max(self.head_dim, self.head_dim_v)
            object.__setattr__(self, "dkv_pieces", 0 if self.tf32_passes != 3 else
                               1 if widest <= 128 else 2 if widest <= 192 else 8)
        if self.dkv_pieces and (self.tf32_passes != 3 or self.dkv_pieces < 0):
            raise ValueError(f"dkv_pieces is 3xTF32's (tf32_passes=3), got {self.dkv_pieces}")
        if self.dtype == "fp32":
            self._check_fp32()
        else:
            self._check_wgmma()
        # Both kernels' block structures and mods:
        if self.block_sparse and self.sparse_block_m % self.tile_m:
            raise ValueError(f"sparse_block_m {self.sparse_block_m} must be a multiple of tile_m")
        if self.causal + self.block_sparse + self.band > 1:
            raise ValueError("causal, block_sparse and band are exclusive block structures")
        if self.band and (self.deterministic or band_of(self.mods) is None):
            raise ValueError("band=True needs a mask hook whose mask is a band of diagonals, and is"
                             " not deterministic (its dQ turns count from block lists)")
        if self.mods.has_score and type(self.mods).score_and_grad is ModHook.score_and_grad:
            raise ValueError(f"{type(self.mods).__name__} has a score mod but no derivative "
                             "(use mod_emit.IRModHook)")

    def _check_wgmma(self):
        """The bf16 / fp16 kernel's configs (FlashBwdSm90): tiles, stages, CTA order, dQ
        turns and clusters."""
        if self.tile_n is None:
            object.__setattr__(self, "tile_n", 64 if self.split_head_dim else 128)
        if self.num_stages is None:
            object.__setattr__(self, "num_stages", default_stages(self))
        if self.do_ring not in (1, 2) or self.do_ring > self.num_stages or (
                self.do_ring != self.num_stages and not self.split_head_dim):
            raise ValueError("do_stages must be 1 or 2, at most num_stages, and below it only beyond head dim 128")
        if self.ds_buffers is not None and (self.ds_buffers not in (1, 2) or not self.split_head_dim
                                            or (self.ds_buffers == 1 and not self.dkv_swap)):
            raise ValueError("ds_buffers is 2, or 1 in the swapped layout (beyond head dim 128)")
        if self.tile_m not in (64, 80, 128) or self.tile_n not in ((64, *SWAP_TILES) if self.split_head_dim else (128,)):
            raise ValueError("the backward supports tile_m=64, 80 or 128 and tile_n=128, or tile_m=64 and"
                             f" tile_n=64 or one of {tuple(SWAP_TILES)} where a head dim exceeds 128")
        if self.dkv_swap and not dkv_swap_allowed(self):
            raise ValueError(f"tile_n={self.tile_n} (the swapped layout) is for head dims up to"
                             f" {SWAP_TILES[self.tile_n]} beyond 128 that are multiples of 64, the dense and causal structures, not"
                             " deterministic, where it fits"
                             f" shared memory ({split_shared_bytes(self, self.num_stages, self.do_ring, self.ds_ring)}"
                             " bytes)")
        if self.dkv_rows and not self.dkv_swap:
            raise ValueError("dkv_rows splits the swapped layout's dK^T / dV^T by head-dim rows: it needs"
                             f" the swapped layout (tile_n one of {tuple(SWAP_TILES)})")
        if self.dkv_rows and (self.head_dim % 128 or self.head_dim_v % 128):
            # Each of the two warpgroups takes whole 64-row atoms of dK^T / dV^T.
            raise ValueError("dkv_rows needs head dims that are multiples of 128 (64 rows per warpgroup),"
                             f" got {self.head_dim}/{self.head_dim_v}")
        if self.idle_masked_keys and not idle_keys_allowed(self):
            raise ValueError("idle_masked_keys needs the causal or band walk of 128-key CTAs without split head"
                             " dims or swapped dK / dV, and no per-diagonal buffer-gradient sums")
        if not self.partial_blocks and not self.block_sparse:
            raise ValueError("partial_blocks=False is a choice of block_sparse lists")
        if self.dq_first_store and (self.deterministic or self.dq_finish):
            raise ValueError("dq_first_store is for the unordered dQ adds (not deterministic, not dq_finish)")
        if self.dq_ticket_on_data and not self.dq_first_store:
            raise ValueError("dq_ticket_on_data is a choice of dq_first_store's")
        if self.p_early and not (self.dkv_swap and not self.dkv_rows):
            raise ValueError("p_early is for the swapped layout with the keys split (dkv_swap, not dkv_rows)")
        if self.tail_order not in ("dq_first", "dv_first") or (self.tail_order != "dq_first"
                                                                and not self.split_head_dim):
            raise ValueError("tail_order is 'dq_first', or 'dv_first' in the split layouts (beyond head dim 128)")
        if self.tile_m == 128 and max(self.head_dim, self.head_dim_v) > 64:
            # S^T and dP^T (64 registers each) beside dK and dV: beyond 64 they spill.
            raise ValueError("tile_m=128 is for head dims up to 64")
        if self.num_stages not in (1, 2):
            raise ValueError(f"num_stages must be 1 or 2, got {self.num_stages}")
        if self.split_head_dim and (self.tile_m != 64 or self.cluster_n != 1):
            raise ValueError("head dims beyond 128 run tile_m=64 without clusters")
        if self.tile_m == 80 and (self.head_dim != 128 or self.head_dim_v != 128 or self.causal
                                  or self.block_sparse):
            # FA3/FA4's choice too: 80 pays off for dense head dim 128; the causal and
            # block-sparse walks (diagonal tiles, 128-row BlockMask blocks) keep 64. A band's
            # walk is arithmetic in tile_m rows (bwd/q_blocks.BandQBlocks): 80 fits it.
            raise ValueError("tile_m=80 is for dense or band (not causal, not block-sparse) head dim 128")
        if self.tile_order not in (None, "by_head", "longest_first"):
            raise ValueError(f"tile_order must be 'by_head' or 'longest_first', got {self.tile_order!r}")
        if self.dq_turn_pass not in (None, "after_adds", "next_visit"):
            raise ValueError(f"dq_turn_pass must be 'after_adds' or 'next_visit', got {self.dq_turn_pass!r}")
        if self.deterministic and self.tile_order == "longest_first":
            raise ValueError("deterministic mode orders its dQ turns by launch: tile_order='by_head'")
        if self.cluster_n not in (1, 2):
            raise ValueError(f"cluster_n must be 1 or 2, got {self.cluster_n}")
        if self.cluster_n > 1 and (self.causal or self.block_sparse or self.band or self.deterministic
                                   or self.tile_order == "longest_first"):
            raise ValueError("cluster_n=2 needs the dense block structure, not deterministic, by_head")
        if self.max_ctas < 0 or (self.max_ctas and (self.deterministic or self.cluster_n != 1)):
            raise ValueError(f"max_ctas (persistent CTAs) must be >= 0, and 0 in deterministic mode or"
                             f" with clusters, got {self.max_ctas}")
        if self.l2_section_bytes < 0:
            raise ValueError(f"l2_section_bytes must be >= 0 (0: the default budget), got {self.l2_section_bytes}")
        if self.dq_finish and not finish_allowed(self):
            raise ValueError("dq_finish is for tile_m 64, 128-key CTAs (head dims up to 128, block lists of"
                             " 128 keys), not deterministic, not persistent, without the per-diagonal"
                             " buffer-gradient sums")

    def _check_fp32(self):
        """The float32 kernel's configs (bwd/tf32_sync.py): 64 keys per CTA, tile_m 32 (or
        64), one or two Q / dO stages; the dense, causal, band and block-sparse walks; no
        deterministic mode, no clusters."""
        from flexattn.kernels.bwd.tf32_sync import default_fp32_stages, shared_bytes, wide_n

        if self.tile_n is None:
            object.__setattr__(self, "tile_n", 64)
        if self.num_stages is None:
            object.__setattr__(self, "num_stages", default_fp32_stages(self))
        if self.tile_n != 64 or self.tile_m not in (32, 64) or self.num_stages not in (1, 2):
            raise ValueError("the float32 backward runs tile_n=64, tile_m=32 or 64, 1 or 2 stages")
        if self.tile_m == 32 and not wide_n(self):
            raise ValueError("the float32 backward runs tile_m=64 where a head dim is not a multiple of 32")
        if shared_bytes(self) > SMEM_CAPACITY:
            raise ValueError(f"the float32 backward at head dims {self.head_dim}/{self.head_dim_v} does not fit"
                             f" shared memory ({shared_bytes(self)} bytes at tile_m {self.tile_m}); head dims"
                             " that are multiples of 32 fit up to 256")
        if self.deterministic or self.cluster_n != 1:
            raise ValueError("the float32 backward has no deterministic mode and no clusters (its dQ adds are"
                             " fp32 atomics): call it with deterministic algorithms off")
        if self.idle_masked_keys:
            raise ValueError("idle_masked_keys is for the bf16 / fp16 kernel (the float32 one runs 64-key CTAs)")
        if self.dq_first_store:
            raise ValueError("dq_first_store is for the bf16 / fp16 kernel (the float32 one adds dQ by atomics)")
        if self.max_ctas:
            raise ValueError("the float32 backward has no persistent CTAs (max_ctas=0)")
        if self.dq_finish:
            raise ValueError("the float32 backward finishes dQ in its postprocess (dq_finish=False)")
        if self.pdl:
            raise ValueError("the float32 backward launches its kernels in plain stream order (pdl=False)")

    def default_chain_promote(self) -> int:
        """`chain_promote` unless given: 0 without 3xTF32. With it, every k-block (1) on the
        32-row visits of head dims 64-128 with Dv <= D, 2 elsewhere. Pieces of 1 against 2
        (H200, 2026-11-30, B1 H4 S1025 / S4096 causal, 2 seeds, ours / flex's max error): dQ
        at D64 0.77 / 1.35 -> 0.57 / 1.19, D128 1.28 / 0.75 -> 0.68 / 0.71, D96 1.40 / 1.45
        -> 0.84 / 1.45, dK and dV within 0.1 of where they were, the step not slower. ptxas:
        0-12 more bytes of spills in the causal kernels there; at D32, D80 (64-row visits)
        and 64/128 pieces of 1 put 4 bytes of spills into dense kernels that have none. At
        192/192 (one seed) dQ / dV read 10% worse with them: not planned beyond 128."""
        if self.tf32_passes != 3:
            return 0
        fine = self.tile_m == 32 and 64 <= self.head_dim <= 128 and self.head_dim_v <= self.head_dim
        return 1 if fine else 2

    @property
    def split_head_dim(self) -> bool:
        """Head dims beyond 128: the two consumer warpgroups share 64 keys and split dK, dV
        and dQ over the head dim (FA3's layout there) instead of owning 64 keys each with
        whole-head-dim dK / dV accumulators (D / 2 + Dv / 2 registers per thread: 256 at
        256/256, more than the 240 a consumer has). S^T and dP^T split over the q columns,
        so P^T and dS^T reach the dK / dV GEMMs of both warpgroups through shared memory."""
        return self.head_dim > 128 or self.head_dim_v > 128

    @property
    def dq_flags(self) -> bool:
        """The kernel keeps one int32 flag per q tile in the `dq_semaphore` workspace:
        deterministic (the dQ turns), dq_finish (the landed visits) and dq_first_store (the
        tickets)."""
        return self.deterministic or self.dq_finish or self.dq_first_store

    @property
    def kv_lists(self) -> bool:
        """Block-sparse kernels that also read the kv-side lists (q block -> kv blocks):
        deterministic (the dQ turns) and dq_finish (each q tile's visitor count)."""
        return self.block_sparse and (self.deterministic or self.dq_finish)

    @property
    def do_ring(self) -> int:
        """The dO / D ring's depth (`do_stages`, defaulted)."""
        return self.do_stages or self.num_stages

    @property
    def ds_ring(self) -> int:
        """dS^T buffers (`ds_buffers`, defaulted): 2 in the split layouts (by visit parity),
        else one per Q stage."""
        return self.ds_buffers or (2 if self.split_head_dim else self.num_stages)

    @property
    def dkv_swap(self) -> bool:
        """The swapped layout beyond head dim 128 (FA3/FA4's there): CTAs of 96 keys, S = Q K^T
        and dP = dO V^T with the keys on N (48 per warpgroup), dK^T = Q^T dS and dV^T =
        dO^T P with the head dim on M. A 64-key CTA (`split_head_dim`'s other layout) moves
        1.5x the L2 bytes per key (Q, dO and the dQ adds per visit): at 192/128 that bound
        its backward (Nsight Compute, H100: L2 91.5% busy, tensor pipe 37.6%)."""
        return self.split_head_dim and self.tile_n in SWAP_TILES

    @property
    def sparse_block_n(self) -> int:
        """Keys of one BlockMask kv block (the q-side lists' index): 128; a 64-key CTA
        (`split_head_dim`) walks its block's lists."""
        return 128

    @property
    def dq_swap_ab(self) -> bool:
        """dQ computed transposed, dQ^T = K^T dS^T (FA3/FA4's dQ_swapAB): wgmma's M is 64
        rows, so a tile_m that is not a multiple of 64 (80) goes on N, and the warpgroups
        split the head dim on M instead."""
        return self.tile_m % 64 != 0 and self.dtype != "fp32"

    @property
    def q_pad(self) -> int:
        """Workspace rows are padded to a multiple of this: every q tile a CTA may visit
        (including the second half of a 128-row BlockMask block) lies inside them. A
        tile_m that divides no BlockMask block (80: dense only) pads to its own tiles."""
        if self.sparse_block_m % self.tile_m:
            return self.tile_m
        return math.lcm(self.tile_m, self.sparse_block_m)

    @property
    def order(self) -> str:
        """tile_order, defaulted (None stays None in the config, so that replacing
        `deterministic` or `causal` re-derives it)."""
        if self.tile_order is not None:
            return self.tile_order
        return "longest_first" if self.causal and not self.deterministic else "by_head"

    @property
    def turn_pass(self) -> str:
        if self.dq_turn_pass is not None:
            return self.dq_turn_pass
        return "next_visit" if self.block_sparse else "after_adds"

    @property
    def buffer_grads(self) -> bool:
        return len(self.mods.grad_slots) > 0

    def key_values(self) -> tuple:
        """The fields, with the CTA order and the dQ turn resolved (None and the value it
        defaults to are one kernel; the turn only matters in deterministic mode)."""
        values = dict(zip((f.name for f in dataclasses.fields(self) if f.name != "mods"), super().key_values()))
        values["tile_order"] = self.order
        values["dq_turn_pass"] = self.turn_pass if self.deterministic else None
        values["l2_section_bytes"] = self.l2_section_bytes if self.order == "longest_first" else 0
        return tuple(values.values())

    def cluster_fits(self, seqlen_k: int) -> bool:
        """Whether a call with `seqlen_k` keys may run this config (the kv blocks of a
        cluster must share their (batch, head))."""
        return -(-seqlen_k // self.tile_n) % self.cluster_n == 0


# Keys per CTA of the swapped layout (`BwdConfig.dkv_swap`) -> the widest head dim it takes:
# 96 up to 192 (dK^T / dV^T registers 3 x 24 + 3 x 24 at 192/192), 48 up to 256 (FA4's
# tile there: 4 x 12 + 4 x 12).
SWAP_TILES = {96: 192, 48: 256, 80: 256}   # 80: FA4's search's best at 256/128 (planned there: bwd.plan)


def dkv_swap_allowed(cfg) -> bool:
    """Whether `cfg` (tile_n one of SWAP_TILES) may run the swapped layout: head dims beyond
    128 up to the tile's limit, both multiples of 64 (dK^T / dV^T put them on wgmma's M,
    64 rows per atom), 64-row visits, the dense or causal walk (block lists and bands index
    128- / 64-key blocks; the deterministic dQ turns count 64-key CTAs), no clusters, and
    its shared memory fits."""
    return (cfg.split_head_dim and max(cfg.head_dim, cfg.head_dim_v) <= SWAP_TILES.get(cfg.tile_n, 0)
            and cfg.head_dim % 64 == 0 and cfg.head_dim_v % 64 == 0
            and cfg.tile_m == 64 and cfg.cluster_n == 1
            and not (cfg.block_sparse or cfg.band or cfg.deterministic)
            and split_shared_bytes(cfg, cfg.num_stages) <= SMEM_CAPACITY)


def idle_keys_allowed(cfg) -> bool:
    """Where `BwdConfig.idle_masked_keys` applies: the causal or band walk (the structure
    says which keys a visit masks) of 128-key CTAs, 64 keys per warpgroup, in the split-free
    layout, without the per-diagonal sums of a relative-position gradient (flushed per
    visit by both warpgroups)."""
    return (cfg.dtype != "fp32" and (cfg.causal or cfg.band) and cfg.tile_n == 128 and not cfg.split_head_dim
            and not one_diagonal_read(cfg))


def finish_allowed(cfg) -> bool:
    """Where `BwdConfig.dq_finish` applies: 64-row tiles of 128-key CTAs (two warpgroups
    splitting dQ's head dim; the read-back buffer, one dQ tile, fits beside them up to head
    dim 128 at two stages, not beside the per-diagonal sums), one CTA per kv tile, turns
    not ordered."""
    return (cfg.dtype != "fp32" and cfg.tile_m == 64 and cfg.tile_n == 128 and not cfg.split_head_dim
            and not cfg.deterministic and not cfg.max_ctas
            and not (cfg.block_sparse and cfg.sparse_block_n != cfg.tile_n)
            and not one_diagonal_read(cfg))


def default_stages(cfg) -> int:
    """Q / dO ring depth: 2 where its shared memory fits (`split_shared_bytes`), else 1 (the
    producer then loads a visit's Q and dO while the previous one's GEMMs finish)."""
    if not cfg.split_head_dim or split_shared_bytes(cfg, 2) <= SMEM_CAPACITY:
        return 2
    return 1


def split_shared_bytes(cfg, num_stages: int, do_stages: int | None = None, ds_buffers: int | None = None) -> int:
    """Shared memory of a `split_head_dim` config (the kernel's SharedStorage, 16-bit
    tiles): Q and dO per stage, K, V, two dS^T and two P^T buffers (one P^T buffer in the
    swapped layout: only its own warpgroup reads a P^T slice there), the fp32 dQ tile, LSE
    and D per stage, barriers and alignment."""
    tm, tn, d, dv = cfg.tile_m, cfg.tile_n, cfg.head_dim, cfg.head_dim_v
    do_stages = do_stages or getattr(cfg, "do_stages", None) or num_stages
    ds_buffers = ds_buffers or getattr(cfg, "ds_buffers", None) or 2     # (split layouts)
    p_buffers = 1 if tn in SWAP_TILES else 2
    tiles = 2 * (num_stages * tm * d + do_stages * tm * dv + tn * (d + dv) + (ds_buffers + p_buffers) * tn * tm)
    return tiles + 4 * tm * d + 4 * (num_stages + do_stages) * max(tm, 32) + 1024


def one_diagonal_read(cfg) -> bool:
    """The score mod's differentiated buffer reads are one read indexed by q - kv only (a
    relative-position table): what `FlashBwdSm90.diagonal_reduction` sums in shared memory."""
    mods = cfg.mods
    return (cfg.buffer_grads and mods.has_score
            and getattr(mods, "grad_reads_diagonal", False) and not mods.grad_reads_uniform
            and getattr(mods, "grad_read_count", 0) == 1)


def dq_splits_rows(tile_m: int, num_wg: int, swap_ab: bool = False) -> bool:
    """Whether the warpgroups split dQ's rows (M: one 64-row atom each, at tile_m 128) rather
    than its head dim (N). FA4's AtomLayoutMdQ = 2 at head dims up to 64: at 64 a half of the
    head dim would be m64n32 atoms, twice as many wgmma per FLOP, each re-reading its A
    slice of dS^T from shared memory (and m64n16 at head dim 32)."""
    return not swap_ab and tile_m == 64 * num_wg


def make_dq_mma(dtype, tile_m: int, head_dim: int, num_wg: int, swap_ab: bool = False):
    """dQ[tile_m, D] = dS K: both operands MN-major in smem (dS^T tile, K tile); the
    warpgroups split the head dim (N), each computing all tile_m rows, or at tile_m 128
    the rows (`dq_splits_rows`), each computing the whole head dim.
    `swap_ab` (`BwdConfig.dq_swap_ab`): dQ^T[D, tile_m] = K^T dS^T instead, K^T MN-major
    (the K tile), dS K-major (sdS stored keys-contiguous); the warpgroups split the head
    dim on M (64 rows each), each computing all tile_m columns."""
    if swap_ab:
        return sm90_helpers.make_trivial_tiled_mma(
            dtype, dtype,
            warpgroup.OperandMajorMode.MN, warpgroup.OperandMajorMode.K,
            Float32,
            atom_layout_mnk=(num_wg, 1, 1),
            tiler_mn=(head_dim // num_wg, tile_m),
        )
    rows = dq_splits_rows(tile_m, num_wg)
    return sm90_helpers.make_trivial_tiled_mma(
        dtype, dtype,
        warpgroup.OperandMajorMode.MN, warpgroup.OperandMajorMode.MN,
        Float32,
        atom_layout_mnk=(num_wg, 1, 1) if rows else (1, num_wg, 1),
        tiler_mn=(64, head_dim if rows else head_dim // num_wg),
    )


def make_split_mma(dtype, rows: int, cols: int, num_wg: int, b_major):
    """C[rows = 64, cols] = A B with the warpgroups side by side on N (cols / num_wg
    each), A K-major in smem: `split_head_dim`'s S^T = K Q^T (B K-major) and
    dK = dS^T Q, dV = P^T dO (B MN-major, the head dim's slices)."""
    return sm90_helpers.make_trivial_tiled_mma(
        dtype, dtype, warpgroup.OperandMajorMode.K, b_major, Float32,
        atom_layout_mnk=(1, num_wg, 1), tiler_mn=(rows, cols // num_wg))


def make_swapped_dkv_mma(dtype, tile_n: int, num_wg: int, rows: bool = False):
    """`BwdConfig.dkv_swap`'s dK^T = Q^T dS and dV^T = dO^T P: C[head dim, tile_n] with the
    warpgroups side by side on the keys (N), each running all head-dim rows (M, 64 per
    atom) — or, with ``rows`` (`BwdConfig.dkv_rows`), stacked on the head-dim rows, each
    running all keys; A (Q^T, dO^T tiles) MN-major, B (the dS^T / P^T tiles, q contiguous)
    K-major."""
    if rows:
        return sm90_helpers.make_trivial_tiled_mma(
            dtype, dtype, warpgroup.OperandMajorMode.MN, warpgroup.OperandMajorMode.K, Float32,
            atom_layout_mnk=(num_wg, 1, 1), tiler_mn=(64, tile_n))
    return sm90_helpers.make_trivial_tiled_mma(
        dtype, dtype, warpgroup.OperandMajorMode.MN, warpgroup.OperandMajorMode.K, Float32,
        atom_layout_mnk=(1, num_wg, 1), tiler_mn=(64, tile_n // num_wg))


def acc_kq_view(acc: cute.Tensor) -> cute.Tensor:
    """An S = Q K^T accumulator fragment (`BwdConfig.dkv_swap`) as (keys, queries): the
    orientation of the S^T fragments the pointwise code (bwd/pointwise.py) indexes."""
    view = mma.acc_mn_view(acc)
    return cute.make_tensor(view.iterator, cute.select(view.layout, mode=[1, 0]))


def dq_slice_atom(head_dim: int, num_wg: int) -> int | None:
    """The swizzle-atom width (``mma.smem_layout``'s atom_cols) of tiles the dQ GEMM reads or
    writes in head-dim slices of one warpgroup each (K, the staged dQ): a power-of-two head
    dim's slices nest in its own atom (None: unchanged); others (96 -> 48) need an atom
    that divides the slice."""
    return None if head_dim & (head_dim - 1) == 0 else head_dim // num_wg


def dq_tile_layout(cfg, num_wg: int) -> cute.Layout:
    """The fp32 dQ tile of one visit (tile_m x head_dim) in *fragment order*: column w is
    warpgroup w's half (its dQ columns, i.e. head dims: transposed or not, each
    warpgroup computes half the head dim for all tile_m rows), and thread t of it owns
    elements 4 t + 512 i + (0..3), i = 0 .. n/4 - 1, holding its accumulator registers in
    order. Each warp's 16-byte stores then cover 512 contiguous bytes (no bank conflicts)
    and a half is one contiguous run for the bulk add. The dq_accum workspace keeps each
    tile_m-row tile in this order (a [tile_m, head_dim] block of it, reinterpreted); the
    postprocess reads it back with the same copy (`dq_fragment_copy`)."""
    return cute.make_layout((cfg.tile_m * cfg.head_dim // num_wg, num_wg))


def dq_fragment_copy(num_wg: int) -> cute.TiledCopy:
    """Thread (t, w) <-> 4 consecutive fp32 at 4 t (+ 512 i) of column w of
    `dq_tile_layout`: 128-bit accesses."""
    return cute.make_tiled_copy_tv(
        cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128),
        cute.make_layout((128, num_wg)), cute.make_layout(4))


class BwdBarrier(NamedBarriers):
    # Over the consumer threads:
    EPILOGUE = 1
    DS_FULL = 2     # both halves of dS^T are in sdS[stage]
    # Over one consumer warpgroup + the dQ writer warp (dq_pair_threads), one per warpgroup:
    DQ_EMPTY = 3    # 3 + wg: the writer's last bulk add has read sdQ[wg]
    DQ_FULL = 5     # 5 + wg: the warpgroup's dQ tile is in sdQ[wg]
    # Over the consumer threads, with one dS^T buffer (`BwdConfig.ds_buffers` 1): both
    # warpgroups are done with the previous visit (its dQ GEMMs read the buffer).
    DS_EMPTY = 7
    # `BwdConfig.dq_finish`, over the dQ writer and the two finisher warps (96 threads):
    FIN_EMPTY = 8   # the finishers have taken the last tile handed over
    FIN_FULL = 9    # a finished tile's (head, q tile) is in sFinTile (head -1: no more)
    # Persistent CTAs staging dK / dV apart (`dkv_staged_apart`), over the consumer threads
    # and the dQ writer warp: the writer's last bulk add of the tile has read sdQ.
    DQ_DRAINED = 10


class FlashBwdSm90(BwdPointwise, BwdWalks, WarpSpecialized):
    """Compile with `cute.compile(FlashBwdSm90(cfg), q, k, v, do, lse_log2, delta, dq_accum,
    dq_semaphore, dq, dk, dv, scale, mod_args, grad_args, grad_fixed, block_sparse, stream)` or
    through `flexattn.kernels.launch.compile.compile_backward`."""

    num_mma_wg = 2
    # The (rows, cols) view of an S^T / dP^T accumulator fragment (bwd/pointwise.py's).
    acc_mn_view = staticmethod(mma.acc_mn_view)
    # Per-diagonal buffer-gradient sums (`diagonal_reduction`): one fp32 row of DIAG_ROW
    # per (consumer warp, row group of 8 lanes); a thread's diagonal keys -8..57 plus its
    # column offset 0..6 index 0..71 of its row. 72 keeps the stores at 2-way bank
    # conflicts at most; the flush reads consecutive diagonals (conflict-free).
    DIAG_ROW = 72
    DIAG_ROWS_PER_WARP = 8

    def __init__(self, config: BwdConfig):
        super().__init__(self.num_mma_wg)
        self.cfg = config
        if config.dkv_swap:     # S / dP come as (queries, keys): the pointwise sees (keys, queries)
            self.acc_mn_view = acc_kq_view
        self.dtype = config.cutlass_dtype
        self.mods = config.mods
        self.dq_pair_threads = 128 + 32
        self.dq_writer_warp = 1         # warp 0 loads; warp 1 adds dQ tiles into global
        self.fin_threads = 32 * 3       # dq_finish: the writer + finisher warps 2 and 3

    @property
    def diagonal_reduction(self) -> bool:
        """One differentiated buffer read, indexed by q - kv (a relative-position table):
        the threads' per-diagonal sums meet in shared memory and each warpgroup sends one
        sum per diagonal of its 64 x 64 tile (`_flush_diagonals`), ~127 global adds per
        step instead of 18 per thread. Several such reads keep one add per thread-diagonal
        (the arrays would not fit next to the tiles)."""
        # 64 x 64 warpgroup tiles only: next to tile_m 80's tiles (~225 KB of shared
        # memory) sDiag (~22 KB at 80) does not fit, so 80 keeps the per-thread adds, and
        # so do the 64 x 32 tiles of `split_head_dim`.
        return self.cfg.tile_m == 64 and not self.cfg.split_head_dim and one_diagonal_read(self.cfg)

    @property
    def dkv_staged_apart(self) -> bool:
        """Persistent CTAs stage dK / dV for their TMA stores in sdQ and sdS instead of sK /
        sV: sdQ (fp32, tile_m x D) and sdS (tile_n x tile_m per buffer) each hold a
        tile_n x D / Dv 16-bit tile at tile_m 64 and beyond, and both are free once the
        tile's last visit is done (sdQ: once the writer's last add has read it,
        `DQ_DRAINED`), so the consumers release sK / sV right after their last GEMMs and
        the producer loads the next tile's K / V during the epilogue."""
        cfg = self.cfg
        ds_elems = cfg.tile_n * cfg.tile_m * (cfg.num_stages if cfg.dq_swap_ab else cfg.ds_ring)
        return bool(cfg.max_ctas) and not cfg.split_head_dim and not cfg.dkv_swap and not cfg.dq_finish \
            and 2 * cfg.tile_n * cfg.head_dim <= 4 * cfg.tile_m * cfg.head_dim \
            and cfg.tile_n * cfg.head_dim_v <= ds_elems

    @property
    def stats_in_registers(self) -> bool:
        """LSE and D are read into registers early in each step (`_column_values`): LSE
        before the step's first GEMM is issued, D before the dP^T wait. An ld.shared
        issued after a batch of wgmma instructions waits in the same queue until the
        tensor core has taken them all, and the exponent's first FFMA stalled there (Nsight
        Compute, causal: 11% of the consumers' stall samples, FA4 reads them the same
        early way). Causal B4 S4096 H16 D128 backward 477.7 -> 500.6 TFLOP/s, B2 S8192
        542.4 -> 563.2, full 566 -> 568 / 606 -> 619 (H100, 2026-11-22). With a score mod
        the extra live registers spill (softcap: 24-72 bytes), so that path keeps reading
        them from shared memory per element."""
        return not self.mods.has_score

    @property
    def q_row_bytes(self) -> int:
        """What the CTAs of a kv head share per query row: its Q and dO rows, its fp32 dQ
        accumulator row, LSE and D (the L2 sections of the CTA orders)."""
        cfg = self.cfg
        return (cfg.head_dim + cfg.head_dim_v) * (self.dtype.width // 8) + 4 * cfg.head_dim + 8

    @property
    def diag_floats(self) -> int:
        if not self.diagonal_reduction:
            return 1
        return 4 * self.num_mma_wg * self.DIAG_ROWS_PER_WARP * self.DIAG_ROW

    # ------------------------------------------------------------------ host side
    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,          # [B, Hq, Sq, D]
        mK: cute.Tensor,          # [B, Hkv, Skv, D]
        mV: cute.Tensor,          # [B, Hkv, Skv, D]
        mdO: cute.Tensor,         # [B, Hq, Sq, D]
        mLSE: cute.Tensor,        # [B, Hq, Sq_pad] float32: LSE * log2(e), +inf if empty
        mDelta: cute.Tensor,      # [B, Hq, Sq_pad] float32: rowsum(dO * O) (- dLSE)
        mdQacc: cute.Tensor,      # [B, Hq, Sq_pad, D] float32, zeroed; gets dS K (unscaled)
        mdQsem,                   # [B, Hq, Sq_pad / tile_m] int32, zeroed, iff cfg.dq_flags (turns,
                                  #  landed visits (dq_finish) or tickets (dq_first_store) per q tile)
        mdQ,                      # [B, Hq, Sq, D] iff dq_finish (else None): dQ out
        mdK: cute.Tensor,         # [B, Hkv, Skv, D]
        mdV: cute.Tensor,         # [B, Hkv, Skv, D]
        softmax_scale: Float32,
        mod_args,                 # hook runtime args (tuple) or None
        grad_args,                # fp32 grads of args[slot] for slot in mods.grad_slots, or None
        grad_fixed,               # deterministic with buffer grads: [N, FIXED_WORDS] int64,
                                  #  zeroed, the grads' fixed-point accumulators one after
                                  #  another (atomics.red_add_fixed); else None
        block_sparse,             # (q_num_blocks, q_indices, full_q_num_blocks,
                                  #  full_q_indices) int32 iff cfg.block_sparse, else None;
                                  #  deterministic: + (kv_num_blocks, kv_indices,
                                  #  full_kv_num_blocks, full_kv_indices)
        stream: cuda.CUstream,
    ):
        cfg = self.cfg
        for t in (mQ, mK, mV, mdO, mdK, mdV):
            if const_expr(t.element_type != self.dtype):
                raise TypeError(f"expected {self.dtype}, got {t.element_type}")
        for t in (mLSE, mDelta, mdQacc):
            if const_expr(t.element_type != Float32):
                raise TypeError("lse_log2, delta and dq_accum must be float32")
        if const_expr(cfg.block_sparse != (block_sparse is not None)):
            raise ValueError("block_sparse tensors must be given iff cfg.block_sparse")
        if const_expr(cfg.buffer_grads != (grad_args is not None)):
            raise ValueError("grad_args must be given iff the score mod reads float buffers")
        if const_expr(cfg.dq_flags != (mdQsem is not None)):
            raise ValueError("dq_semaphore must be given iff cfg.deterministic or cfg.dq_finish")
        if const_expr(cfg.dq_finish != (mdQ is not None)):
            raise ValueError("dq must be given iff cfg.dq_finish")
        if const_expr(cfg.dq_finish and mdQ.element_type != self.dtype):
            raise TypeError(f"dq: expected {self.dtype}, got {mdQ.element_type}")
        if const_expr((cfg.deterministic and cfg.buffer_grads) != (grad_fixed is not None)):
            raise ValueError("grad_fixed must be given iff deterministic with buffer grads")
        if const_expr(cfg.block_sparse and
                      len(block_sparse) != (8 if cfg.kv_lists else 4)):
            raise ValueError("block_sparse: the 4 q-side lists (+ the 4 kv-side lists iff "
                             "deterministic or dq_finish)")

        # (S, D, H, B) views: the TMA box is (rows, D); H and B index the tile.
        Q, K, V, dO, dK, dV = [mma.select_modes(t, [2, 3, 1, 0])
                               for t in (mQ, mK, mV, mdO, mdK, mdV)]
        LSE, Delta = [mma.select_modes(t, [2, 1, 0]) for t in (mLSE, mDelta)]  # (S, H, B)
        dQacc = mma.select_modes(mdQacc, [2, 3, 1, 0])
        dQ = mma.select_modes(mdQ, [2, 3, 1, 0]) if const_expr(cfg.dq_finish) else None

        D, Dv, tm, tn = cfg.head_dim, cfg.head_dim_v, cfg.tile_m, cfg.tile_n
        n_wg = self.num_mma_wg
        split = cfg.split_head_dim
        # S^T, dP^T: [tile_n, tile_m], SS. dK: [tile_n, D], dV: [tile_n, Dv] (consume's
        # tiled_mma_nv), A from registers; split_head_dim: S^T / dP^T split over the q
        # columns, dK / dV over the head dim, A (P^T, dS^T) from shared memory.
        # dkv_swap: S = Q K^T / dP = dO V^T [tile_m, tile_n] with the keys split between the
        # warpgroups (N), and dK^T [D, tile_n] / dV^T [Dv, tile_n] = Q^T dS / dO^T P, A (Q^T,
        # dO^T) MN-major, B (dS^T, P^T tiles) K-major: one MMA for both (M from the tile).
        if const_expr(cfg.dkv_swap):
            tiled_mma_nm = make_split_mma(self.dtype, tm, tn, n_wg, warpgroup.OperandMajorMode.K)
            tiled_mma_nd = make_swapped_dkv_mma(self.dtype, tn, n_wg, cfg.dkv_rows)
        elif const_expr(split):
            tiled_mma_nm = make_split_mma(self.dtype, tn, tm, n_wg, warpgroup.OperandMajorMode.K)
            tiled_mma_nd = make_split_mma(self.dtype, tn, D, n_wg, warpgroup.OperandMajorMode.MN)
        else:
            tiled_mma_nm = mma.make_qk_mma(self.dtype, tn, tm)
            tiled_mma_nd = mma.make_pv_mma(self.dtype, tn, D)
        tiled_mma_md = make_dq_mma(self.dtype, tm, D, n_wg, cfg.dq_swap_ab)

        # split_head_dim: the dK / dV GEMMs read Q and dO MN-major in head-dim slices of one
        # warpgroup each, as the dQ GEMM reads K.
        # (dkv_swap reads them MN-major whole, 64 rows of M at a time: the default atoms.)
        q_atom = dq_slice_atom(D, n_wg) if const_expr(split and not cfg.dkv_swap) else None
        do_atom = dq_slice_atom(Dv, n_wg) if const_expr(split and not cfg.dkv_swap) else None
        sQ_layout = mma.smem_layout(self.dtype, tm, D, cfg.num_stages, atom_cols=q_atom)
        sdO_layout = mma.smem_layout(self.dtype, tm, Dv, cfg.do_ring, atom_cols=do_atom)
        # (dQ's B: K^T in head-dim slices of one warpgroup, unless the warpgroups split rows)
        k_atom = None if const_expr(dq_splits_rows(tm, n_wg, cfg.dq_swap_ab)) else dq_slice_atom(D, n_wg)
        sK_layout = mma.smem_layout(self.dtype, tn, D, 1, atom_cols=k_atom)
        sV_layout = mma.smem_layout(self.dtype, tn, Dv, 1, atom_cols=do_atom)
        # dS^T, q contiguous (the dQ GEMM's MN-major A); swapped dQ: dS, keys contiguous
        # (its K-major B; 128-byte swizzle, where 80 q would only allow 32). One buffer per
        # Q stage, so writing step i's dS^T needs no wait for step i-1's dQ GEMMs (step
        # i-2's, on the same buffer, finished before both warpgroups passed step i-1's
        # ds_full barrier).
        # split_head_dim: two buffers whatever the ring depth (a warpgroup writes visit
        # i + 1's while the other may still read visit i's), and as many for P^T.
        if const_expr(cfg.dq_swap_ab):
            sdS_layout = mma.smem_layout(self.dtype, tm, tn, cfg.num_stages)
        else:
            sdS_layout = mma.smem_layout(self.dtype, tn, tm, cfg.ds_ring)
        # dkv_swap: one P^T buffer (each warpgroup reads only its own keys' rows of it).
        sP_layout = (mma.smem_layout(self.dtype, tn, tm, 1 if cfg.dkv_swap else 2) if const_expr(split)
                     else mma.smem_layout(self.dtype, 8, 64, 1))
        # LSE / D per stage; each stage 128-byte aligned (TMA destinations).
        sStat_layout = cute.make_layout((tm, cfg.num_stages), stride=(1, -(-tm // 32) * 32))
        sDelta_layout = cute.make_layout((tm, cfg.do_ring), stride=(1, -(-tm // 32) * 32))   # (D: dO's ring)

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        s2g = cpasync.CopyBulkTensorTileS2GOp()
        g2s_q = cpasync.CopyBulkTensorTileG2SMulticastOp() if cfg.cluster_n > 1 else g2s
        tile_qd, tile_kd, tile_qv, tile_kv = (tm, D), (tn, D), (tm, Dv), (tn, Dv)
        tma_atom_Q, tma_Q = cpasync.make_tiled_tma_atom(
            g2s_q, Q, cute.select(sQ_layout, mode=[0, 1]), tile_qd, cfg.cluster_n)
        tma_atom_dO, tma_dO = cpasync.make_tiled_tma_atom(
            g2s_q, dO, cute.select(sdO_layout, mode=[0, 1]), tile_qv, cfg.cluster_n)
        tma_atom_K, tma_K = cpasync.make_tiled_tma_atom(
            g2s, K, cute.select(sK_layout, mode=[0, 1]), tile_kd, 1)
        tma_atom_V, tma_V = cpasync.make_tiled_tma_atom(
            g2s, V, cute.select(sV_layout, mode=[0, 1]), tile_kv, 1)
        tma_atom_LSE, tma_LSE = cpasync.make_tiled_tma_atom(
            g2s, LSE, cute.make_layout(tm), (tm,), 1)
        tma_atom_Delta, tma_Delta = cpasync.make_tiled_tma_atom(
            g2s, Delta, cute.make_layout(tm), (tm,), 1)
        # dK / dV leave through sK / sV (same shape and swizzle) once K and V are dead.
        tma_atom_dK, tma_dK = cpasync.make_tiled_tma_atom(
            s2g, dK, cute.select(sK_layout, mode=[0, 1]), tile_kd)
        tma_atom_dV, tma_dV = cpasync.make_tiled_tma_atom(
            s2g, dV, cute.select(sV_layout, mode=[0, 1]), tile_kv)

        self.bytes_qd = cute.size_in_bytes(self.dtype, cute.select(sQ_layout, mode=[0, 1]))
        self.bytes_kd = cute.size_in_bytes(self.dtype, cute.select(sK_layout, mode=[0, 1]))
        self.bytes_qv = cute.size_in_bytes(self.dtype, cute.select(sdO_layout, mode=[0, 1]))
        self.bytes_kv = cute.size_in_bytes(self.dtype, cute.select(sV_layout, mode=[0, 1]))
        self.bytes_stat = tm * 4

        # (fields built as a dict: the DSL rewrites `if` inside this traced function)
        fields = {
            "mbar_kv": cute.struct.MemRange[cutlass.Int64, 2],
            "mbar_q": cute.struct.MemRange[cutlass.Int64, 2 * cfg.num_stages],
            "mbar_do": cute.struct.MemRange[cutlass.Int64, 2 * cfg.do_ring],
        }
        if const_expr(cfg.dq_finish):    # (in the header's slack before sQ's 1024-byte alignment)
            fields["mbar_fin"] = cute.struct.MemRange[cutlass.Int64, 2]   # one per finisher warp
            fields["sFinTile"] = cute.struct.MemRange[Int32, 2]           # (head, q tile) handed over
        fields.update({
            "sLSE": cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sStat_layout)], 128],
            "sDelta": cute.struct.Align[cute.struct.MemRange[Float32, cute.cosize(sDelta_layout)], 128],
            "sQ": cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sQ_layout)], 1024],
            "sdO": cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdO_layout)], 1024],
            "sK": cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sK_layout)], 1024],
            "sV": cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sV_layout)], 1024],
            "sdS": cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sdS_layout)], 1024],
            # One fp32 dQ tile in fragment order (see dq_tile_layout), half per warpgroup.
            "sdQ": cute.struct.Align[cute.struct.MemRange[Float32, tm * D], 1024],
            "sDiag": cute.struct.Align[cute.struct.MemRange[Float32, self.diag_floats], 16],
            # split_head_dim's P^T buffers (last: elsewhere a 2-byte stub, no 1024 padding)
            "sP": cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sP_layout) if split else 1],
                                    1024 if split else 16],
        })
        if const_expr(cfg.dq_finish):
            # One dQ tile read back from dq_accum (fragment order, as sdQ).
            fields["sFin"] = cute.struct.Align[cute.struct.MemRange[Float32, tm * D], 128]
        SharedStorage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))

        self.smem_bytes = SharedStorage.size_in_bytes()     # (read by tests)
        if const_expr(self.smem_bytes > SMEM_CAPACITY):
            raise ValueError(f"backward shared memory: {self.smem_bytes} bytes > {SMEM_CAPACITY} "
                             f"({cfg})")

        # As in the forward: with a score mod the kernel scales s itself and exp2 needs
        # only log2(e); without one, scale * log2(e) folds into the exp2 argument.
        scale_log2 = Float32(LOG2_E)
        if const_expr(not self.mods.has_score):
            scale_log2 = softmax_scale * Float32(LOG2_E)

        grid = ((K.shape[0] + tn - 1) // tn, K.shape[2], K.shape[3])
        if const_expr(cfg.max_ctas):
            grid = grid_size(grid[0] * grid[1] * grid[2], cfg.max_ctas)
        elif const_expr(cfg.order == "longest_first" or self.head_swizzle):
            grid = (grid[0] * grid[1] * grid[2], 1, 1)
        self.kernel(
            tma_Q, tma_K, tma_V, tma_dO, tma_LSE, tma_Delta, tma_dK, tma_dV, dQacc,
            tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_LSE, tma_atom_Delta,
            tma_atom_dK, tma_atom_dV,
            tiled_mma_nm, tiled_mma_nd, tiled_mma_md,
            sQ_layout, sdO_layout, sK_layout, sV_layout, sdS_layout, sP_layout, (sStat_layout, sDelta_layout),
            Q.shape[0], Q.shape[2], softmax_scale, scale_log2, mod_args, grad_args,
            block_sparse, mdQsem, dQ, grad_fixed, SharedStorage,
        ).launch(
            grid=grid,
            block=[self.num_threads, 1, 1],
            cluster=[cfg.cluster_n, 1, 1],
            stream=stream,
            min_blocks_per_mp=1,
            use_pdl=cfg.pdl,
        )

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor, mK: cute.Tensor, mV: cute.Tensor, mdO: cute.Tensor,
        mLSE: cute.Tensor, mDelta: cute.Tensor, mdK: cute.Tensor, mdV: cute.Tensor,
        mdQacc: cute.Tensor,
        tma_atom_Q: cute.CopyAtom, tma_atom_K: cute.CopyAtom, tma_atom_V: cute.CopyAtom,
        tma_atom_dO: cute.CopyAtom, tma_atom_LSE: cute.CopyAtom, tma_atom_Delta: cute.CopyAtom,
        tma_atom_dK: cute.CopyAtom, tma_atom_dV: cute.CopyAtom,
        tiled_mma_nm: cute.TiledMma, tiled_mma_nd: cute.TiledMma, tiled_mma_md: cute.TiledMma,
        sQ_layout: cute.ComposedLayout, sdO_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
        sdS_layout: cute.ComposedLayout, sP_layout: cute.ComposedLayout, sStat_layouts,
        seqlen_q: Int32, num_q_heads: Int32,
        softmax_scale: Float32, scale_log2: Float32, mod_args, grad_args, block_sparse,
        mdQsem, mdQ, grad_fixed, SharedStorage: cutlass.Constexpr,
    ):
        cfg = self.cfg
        warp_idx = self.warp_index()
        self.prefetch_descriptors(warp_idx, (tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_LSE,
                                             tma_atom_Delta, tma_atom_dK, tma_atom_dV))
        if const_expr(cfg.band):
            block_sparse = band_bounds(self.mods, mod_args)   # (lo, hi), Int32: see _q_blocks

        storage = self.allocate(SharedStorage)
        n = self.num_mma_threads
        pipe_kv = tma_ring(storage.mbar_kv.data_ptr(), 1, n, self.bytes_kd + self.bytes_kv)
        pipe_q = tma_ring(storage.mbar_q.data_ptr(), cfg.num_stages, n,
                          self.bytes_qd + self.bytes_stat, cfg.cluster_n)
        pipe_do = tma_ring(storage.mbar_do.data_ptr(), cfg.do_ring, n,
                           self.bytes_qv + self.bytes_stat, cfg.cluster_n)
        self.rings_init_arrive(cfg.cluster_n)

        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sdO = storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        sdS = storage.sdS.get_tensor(sdS_layout.outer, swizzle=sdS_layout.inner)
        sP = storage.sP.get_tensor(sP_layout.outer, swizzle=sP_layout.inner) if const_expr(cfg.split_head_dim) else None
        sLSE = storage.sLSE.get_tensor(sStat_layouts[0])
        sDelta = storage.sDelta.get_tensor(sStat_layouts[1])
        sdQ = storage.sdQ.get_tensor(dq_tile_layout(cfg, self.num_mma_wg))
        sDiag = storage.sDiag.get_tensor(cute.make_layout(self.diag_floats))

        seqlen_k = mK.shape[0]
        group = num_q_heads // mK.shape[2]          # q heads per kv head (GQA)
        # `where`: this CTA's tile (n_block, head_kv, batch), or persistent: the TileSpace
        # whose linear tiles it walks in `_tile_order`.
        def tile_space():
            return TileSpace((seqlen_k + cfg.tile_n - 1) // cfg.tile_n, mK.shape[2], mK.shape[3], seqlen_q * group)

        if const_expr(cfg.max_ctas):
            # Each role builds the walk's numbers inside its own branch (`where()`): built
            # here, before the roles split, they stayed live through every role and the
            # producer's 24 registers spilled them (document lists: 24 bytes per CTA, reloaded
            # every tile).
            where = tile_space
        elif const_expr(cfg.order == "longest_first"):
            tiles = tile_space()
            where = self._tile_order().tile(tiles.first, tiles)
        elif const_expr(self.head_swizzle):
            where = self._deterministic_tile(seqlen_q, seqlen_k, group, mK.shape[2], mK.shape[3])
        else:
            n_block, head_kv, batch = cute.arch.block_idx()
            if const_expr(cfg.deterministic):
                # Launch order = dQ turn order: the highest kv block adds first.
                n_block = cute.arch.grid_dim()[0] - 1 - n_block
            where = (n_block, head_kv, batch)

        self.rings_init_wait(cfg.cluster_n)
        if const_expr(cfg.pdl):
            # The postprocess may take SMs as this grid's last CTAs start (it waits for
            # this grid to finish before reading dq_accum).
            cute.arch.griddepcontrol_launch_dependents()

        regs = (cfg.producer_regs, cfg.consumer_regs)
        if self.is_producer(warp_idx):
            self.enter_producer(regs)
            if warp_idx != 0:
                self._wait_predecessor()      # dq_accum (and dQ's zeroed rows) are the preprocess's
            if warp_idx == 0:
                self.load(mQ, mK, mV, mdO, mLSE, mDelta, sQ, sK, sV, sdO, sLSE, sDelta,
                          tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_LSE,
                          tma_atom_Delta, pipe_kv, pipe_q, pipe_do,
                          where, group, seqlen_q, block_sparse)
            elif warp_idx == self.dq_writer_warp:
                self.store_dq(mdQacc, sdQ, where, group, seqlen_q, seqlen_k, block_sparse, mdQsem,
                              storage.sFinTile.get_tensor(cute.make_layout(2)) if const_expr(cfg.dq_finish) else None)
            elif const_expr(cfg.dq_finish):
                self.finish_dq(mdQacc, mdQ, storage.sFin.get_tensor(dq_tile_layout(cfg, self.num_mma_wg)),
                               storage.mbar_fin.data_ptr() + (warp_idx - 2),
                               storage.sFinTile.get_tensor(cute.make_layout(2)), tiled_mma_md,
                               warp_idx - 2, where, seqlen_q, softmax_scale)
        else:
            self.enter_consumer(regs)
            self._wait_predecessor()          # (the deterministic buffer-grad accumulators)
            dkv_stage = (sK[None, None, 0], sV[None, None, 0])
            if const_expr(self.dkv_staged_apart):
                # sK's / sV's layouts (the dK / dV TMA atoms') over sdQ's and sdS's bytes
                dkv_stage = (storage.sdQ.get_tensor(sK_layout.outer, swizzle=sK_layout.inner,
                                                    dtype=self.dtype)[None, None, 0],
                             storage.sdS.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)[None, None, 0])
            self.consume(mdK, mdV, sdQ, sQ, sK, sV, dkv_stage, sdO, (sdS, sP), sLSE, sDelta, sDiag,
                         tma_atom_dK, tma_atom_dV, tiled_mma_nm, tiled_mma_nd, tiled_mma_md,
                         pipe_kv, pipe_q, pipe_do, where, group,
                         seqlen_q, seqlen_k, softmax_scale, scale_log2, mod_args, grad_args,
                         block_sparse, grad_fixed)

    def _tile_order(self):
        """Linear tile index -> (kv block, kv head, batch) (hopper/tile_scheduler.py)."""
        if self.cfg.order == "longest_first":
            # What the CTAs of a kv head share: the Q, dO, LSE, D rows of its group and
            # their fp32 dQ accumulator rows (counting those halves the L2 sections at
            # S4096: causal B4 H16 D128 backward 500.6 -> 506.5 TFLOP/s, H100, 2026-11-22).
            return LongestFirst(self.q_row_bytes, last_row_first=False,
                                l2_budget=self.cfg.l2_section_bytes or L2_BYTES_FOR_KV)
        return ByHead(last_row_first=False)

    @property
    def head_swizzle(self) -> bool:
        """Deterministic CTA order in L2 sections, heads interleaved (`_deterministic_tile`)
        for dense and block-sparse walks. Causal keeps head order (kv blocks of a head
        highest first: their walks are staggered already, and kv block major would put
        every head's longest walks last). H200, backward kernel µs, head order -> sections:
        full 2529 -> 2435, window1024 850 -> 829, document4 965 -> 885, causal 1279 -> 1414."""
        return self.cfg.deterministic and not self.cfg.causal

    @cute.jit
    def _deterministic_tile(self, seqlen_q, seqlen_k, group, kv_heads, batches):
        """Deterministic mode's CTA order (1-D grid), FA4's "head swizzle": sections of
        `sec` (kv head, batch) pairs whose Q, dO, LSE, D and dq_accum rows fit in L2 (50 MB,
        as FA4 assumes for Hopper); inside a section kv block major, head minor, highest
        kv block first. A head's CTAs are then spread over the launch instead of starting
        together, so they do not walk its tiles in lockstep, each waiting for the one above
        (the turn chain: ~400 us of a 2.5 ms dense backward in head order). Deadlock-free
        as before: a CTA waits only for higher kv blocks of its head, launched earlier in
        its section."""
        cfg = self.cfg
        n_kv = (seqlen_k + cfg.tile_n - 1) // cfg.tile_n
        pairs = kv_heads * batches
        row_bytes = cutlass.Int64(self.q_row_bytes)
        per_pair = cutlass.Int64(seqlen_q) * group * row_bytes
        sec = Int32(cutlass.max(cutlass.min(cutlass.Int64(L2_BYTES) // per_pair,
                                            cutlass.Int64(pairs)), cutlass.Int64(1)))
        i = cute.arch.block_idx()[0]
        section = i // (sec * n_kv)
        first = section * sec
        width = cutlass.min(sec, pairs - first)      # the last section may be narrower
        r = i - first * n_kv
        pair = first + r % width
        return n_kv - 1 - r // width, pair % kv_heads, pair // kv_heads

    # --------------------------------------------------------------- block structure
    @cute.jit
    def _wait_predecessor(self):
        """Under PDL (`BwdConfig.pdl`): wait until the kernel before (the preprocess) has
        finished and its writes are visible; a no-op when it already has."""
        if const_expr(self.cfg.pdl):
            cute.arch.griddepcontrol_wait()

    # ------------------------------------------------------------------ producer
    @cute.jit
    def load(self, mQ, mK, mV, mdO, mLSE, mDelta, sQ, sK, sV, sdO, sLSE, sDelta,
             tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_LSE, tma_atom_Delta,
             pipe_kv, pipe_q, pipe_do, where, group, seqlen_q, block_sparse):
        cfg = self.cfg
        ops = (mQ, mK, mV, mdO, mLSE, mDelta, sQ, sK, sV, sdO, sLSE, sDelta,
               tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_LSE, tma_atom_Delta,
               pipe_kv, pipe_q, pipe_do)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.num_stages)
        if const_expr(cfg.max_ctas):
            self._wait_predecessor()          # (the first tile's first load is its Q + LSE)
            tiles = where()
            for idx in cutlass.range(tiles.first, tiles.total, tiles.stride, unroll=1):
                n_block, head_kv, batch = self._tile_order().tile(idx, tiles)
                kv_state, state = self._load_tile(ops, kv_state, state, n_block, head_kv, batch,
                                                  group, seqlen_q, block_sparse)
        else:
            n_block, head_kv, batch = where
            kv_state, state = self._load_tile(ops, kv_state, state, n_block, head_kv, batch, group,
                                              seqlen_q, block_sparse)   # (state: the cluster's tail)
        if const_expr(cfg.cluster_n > 1):
            # The peer's consumers still release our stages: stay until they all have.
            pipe_q.producer_tail(state.clone())
            pipe_do.producer_tail(state.clone())

    @cute.jit
    def _load_kv(self, kv_operands, kv_state, n_block, head_kv, batch):
        """Issue one tile's K and V (one barrier), once the consumers have released the
        previous tile's (persistent: after its dK / dV left through sK / sV)."""
        cfg = self.cfg
        mK, mV, sK, sV, tma_atom_K, tma_atom_V, pipe_kv = kv_operands
        one = cute.make_layout(1)
        gK = cute.local_tile(mK[None, None, head_kv, batch], (cfg.tile_n, cfg.head_dim), (n_block, 0))
        tKsK, tKgK = cpasync.tma_partition(
            tma_atom_K, 0, one, cute.group_modes(sK, 0, 2), cute.group_modes(gK, 0, 2))
        pipe_kv.producer_acquire(kv_state)
        bar = pipe_kv.producer_get_barrier(kv_state)
        cute.copy(tma_atom_K, tKgK, tKsK[None, 0], tma_bar_ptr=bar)
        gV = cute.local_tile(mV[None, None, head_kv, batch], (cfg.tile_n, cfg.head_dim_v), (n_block, 0))
        tVsV, tVgV = cpasync.tma_partition(
            tma_atom_V, 0, one, cute.group_modes(sV, 0, 2), cute.group_modes(gV, 0, 2))
        cute.copy(tma_atom_V, tVgV, tVsV[None, 0], tma_bar_ptr=bar)

    @cute.jit
    def _load_tile(self, ops, kv_state, state, n_block, head_kv, batch, group, seqlen_q, block_sparse):
        """One kv tile's loads: K / V, and per visit Q + LSE, dO + D. One tile per CTA: K / V
        first. Persistent: after the first visit's Q / dO, which only need a free ring
        slot, while K / V wait for the previous tile's epilogue."""
        cfg = self.cfg
        (mQ, mK, mV, mdO, mLSE, mDelta, sQ, sK, sV, sdO, sLSE, sDelta,
         tma_atom_Q, tma_atom_K, tma_atom_V, tma_atom_dO, tma_atom_LSE, tma_atom_Delta,
         pipe_kv, pipe_q, pipe_do) = ops
        kv_operands = (mK, mV, sK, sV, tma_atom_K, tma_atom_V, pipe_kv)
        one = cute.make_layout(1)
        kv_due = Int32(1)
        if const_expr(not cfg.max_ctas):
            self._load_kv(kv_operands, kv_state, n_block, head_kv, batch)
            kv_due = Int32(0)
            self._wait_predecessor()          # K / V are inputs; LSE and D are the preprocess's
        tile_qd = (cfg.tile_m, cfg.head_dim)
        # Cluster: this CTA's slice of each Q / dO tile, multicast into both CTAs (LSE and
        # D, a few hundred bytes, each CTA loads for itself).
        rank, pair, mcast = multicast_slice(cfg.cluster_n)
        for g in cutlass.range(group, unroll=1):
            head = head_kv * group + g
            gQ = cute.local_tile(mQ[None, None, head, batch], tile_qd, (None, 0))
            gdO = cute.local_tile(mdO[None, None, head, batch], (cfg.tile_m, cfg.head_dim_v), (None, 0))
            gLSE = cute.local_tile(mLSE[None, head, batch], (cfg.tile_m,), (None,))
            gDelta = cute.local_tile(mDelta[None, head, batch], (cfg.tile_m,), (None,))
            tQsQ, tQgQ = cpasync.tma_partition(
                tma_atom_Q, rank, pair, cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
            tdOsdO, tdOgdO = cpasync.tma_partition(
                tma_atom_dO, rank, pair, cute.group_modes(sdO, 0, 2), cute.group_modes(gdO, 0, 2))
            tLsL, tLgL = cpasync.tma_partition(
                tma_atom_LSE, 0, one, cute.group_modes(sLSE, 0, 1), cute.group_modes(gLSE, 0, 1))
            tDsD, tDgD = cpasync.tma_partition(
                tma_atom_Delta, 0, one, cute.group_modes(sDelta, 0, 1),
                cute.group_modes(gDelta, 0, 1))
            blocks = self._q_blocks(block_sparse, batch, head, n_block, seqlen_q)
            walk = (Int32(0), Int32(0))
            for i in cutlass.range(blocks.count, unroll=1):
                m_block, _, walk = self._visit(blocks, i, walk)
                pipe_q.producer_acquire(state)
                bar = pipe_q.producer_get_barrier(state)
                cute.copy(tma_atom_Q, tQgQ[None, m_block], tQsQ[None, state.index], tma_bar_ptr=bar,
                          **mcast)
                cute.copy(tma_atom_LSE, tLgL[None, m_block], tLsL[None, state.index], tma_bar_ptr=bar)
                do_state = lockstep_state(state, cfg.do_ring, producer=True)
                pipe_do.producer_acquire(do_state)
                bar = pipe_do.producer_get_barrier(do_state)
                cute.copy(tma_atom_dO, tdOgdO[None, m_block], tdOsdO[None, do_state.index],
                          tma_bar_ptr=bar, **mcast)
                cute.copy(tma_atom_Delta, tDgD[None, m_block], tDsD[None, do_state.index],
                          tma_bar_ptr=bar)
                if const_expr(cfg.max_ctas):
                    if kv_due != 0:
                        self._load_kv(kv_operands, kv_state, n_block, head_kv, batch)
                        kv_due = Int32(0)
                state.advance()
        if const_expr(cfg.max_ctas):
            if kv_due != 0:                  # a tile without visits still gets its K / V
                self._load_kv(kv_operands, kv_state, n_block, head_kv, batch)
            kv_state.advance()
        return kv_state, state

    # ------------------------------------------------------------------ consumers
    @cute.jit
    def consume(self, mdK, mdV, sdQ, sQ, sK, sV, dkv_stage, sdO, sdS_sP, sLSE, sDelta, sDiag,
                tma_atom_dK, tma_atom_dV, tiled_mma_nm, tiled_mma_nd, tiled_mma_md,
                pipe_kv, pipe_q, pipe_do, where, group,
                seqlen_q, seqlen_k, softmax_scale, scale_log2, mod_args, grad_args,
                block_sparse, grad_fixed):
        cfg = self.cfg
        sdS, sP = sdS_sP
        if const_expr(mod_args is None):
            mod_args = ()
        if const_expr(grad_fixed is not None):
            # Deterministic buffer grads: slot i's accumulators start at row offsets[i].
            offsets, end = [], Int32(0)
            for grad in grad_args:
                offsets.append(end)
                end = end + cute.size(grad)
            grad_args = (grad_args, grad_fixed, tuple(offsets))
        tidx = cute.arch.thread_idx()[0] - 128
        wg = cute.arch.make_warp_uniform(tidx // 128)
        # wgmma operands are partitioned per warpgroup; accumulators per thread.
        wg_first_thread = cute.make_layout(self.num_mma_wg, stride=128)(wg)
        wg_nm = tiled_mma_nm.get_slice(wg_first_thread)
        wg_nd = tiled_mma_nd.get_slice(wg_first_thread)
        split = cfg.split_head_dim
        # dV's GEMM: N = the value head dim (the same MMA as dK's where they are equal)
        tiled_mma_nv = tiled_mma_nd
        kv_swap = cfg.dkv_swap
        if const_expr(cfg.head_dim_v != cfg.head_dim and not kv_swap):
            tiled_mma_nv = (make_split_mma(self.dtype, cfg.tile_n, cfg.head_dim_v, self.num_mma_wg,
                                           warpgroup.OperandMajorMode.MN) if split
                            else mma.make_pv_mma(self.dtype, cfg.tile_n, cfg.head_dim_v))
        wg_nv = tiled_mma_nv.get_slice(wg_first_thread)
        wg_md = tiled_mma_md.get_slice(wg_first_thread)
        thr_nm = tiled_mma_nm.get_slice(tidx)

        T = mma.transpose_view
        swap = cfg.dq_swap_ab
        tm, tn = cfg.tile_m, cfg.tile_n
        if const_expr(kv_swap):
            # The same slots as below, operands of the swapped GEMMs (see __call__).
            frags = (
                wg_nm.make_fragment_B(wg_nm.partition_B(sK)),        # S = Q K^T
                wg_nm.make_fragment_A(wg_nm.partition_A(sQ)),
                wg_nm.make_fragment_B(wg_nm.partition_B(sV)),        # dP = dO V^T
                wg_nm.make_fragment_A(wg_nm.partition_A(sdO)),
                wg_nv.make_fragment_B(wg_nv.partition_B(sP)),        # dV^T += dO^T P
                wg_nv.make_fragment_A(wg_nv.partition_A(T(sdO))),
                wg_nd.make_fragment_A(wg_nd.partition_A(T(sQ))),     # dK^T += Q^T dS
                wg_md.make_fragment_A(wg_md.partition_A(T(sdS))),    # dQ = dS K
                wg_md.make_fragment_B(wg_md.partition_B(T(sK))),
                wg_nd.make_fragment_B(wg_nd.partition_B(sdS)),
            )
            acc_shape_nm = wg_nm.partition_shape_C((tm, tn))
            acc_dV = cute.make_rmem_tensor(wg_nv.partition_shape_C((cfg.head_dim_v, tn)), Float32)
            acc_dK = cute.make_rmem_tensor(wg_nd.partition_shape_C((cfg.head_dim, tn)), Float32)
            coords = FragmentCoords(thr_nm, tm, tn, acc_kq_view, transposed=True)
            # P^T / dS^T tiles (q contiguous) from the S / dP fragments: transposing stmatrix.
            r2s_dS = mma.stmatrix_copy(tiled_mma_nm, self.dtype, tidx, transpose=True,
                                       wg_cols=tn // self.num_mma_wg)
            tdSsdS = (r2s_dS.partition_D(T(sdS)), r2s_dS.partition_D(T(sP)))
        else:
            frags = (
                wg_nm.make_fragment_A(wg_nm.partition_A(sK)),        # S^T = K Q^T
                wg_nm.make_fragment_B(wg_nm.partition_B(sQ)),
                wg_nm.make_fragment_A(wg_nm.partition_A(sV)),        # dP^T = V dO^T
                wg_nm.make_fragment_B(wg_nm.partition_B(sdO)),
                # P^T: registers, or split_head_dim: sP (both warpgroups' columns)
                (wg_nv.make_fragment_A(wg_nv.partition_A(sP)) if const_expr(split)
                 else wg_nd.make_fragment_A(wg_nd.partition_shape_A((cfg.tile_n, cfg.tile_m)))),
                wg_nv.make_fragment_B(wg_nv.partition_B(T(sdO))),    # dV += P^T dO
                wg_nd.make_fragment_B(wg_nd.partition_B(T(sQ))),     # dK += dS^T Q
                # dQ = dS K, or swapped dQ^T = K^T dS^T: (dS, K^T) fragments either way.
                (wg_md.make_fragment_B(wg_md.partition_B(sdS)) if const_expr(swap)
                 else wg_md.make_fragment_A(wg_md.partition_A(T(sdS)))),
                (wg_md.make_fragment_A(wg_md.partition_A(T(sK))) if const_expr(swap)
                 else wg_md.make_fragment_B(wg_md.partition_B(T(sK)))),
                # split_head_dim: dS^T as dK's A from sdS (else from registers)
                wg_nd.make_fragment_A(wg_nd.partition_A(sdS)) if const_expr(split) else None,
            )
        acc_shape_md = wg_md.partition_shape_C(
            (cfg.head_dim, cfg.tile_m) if const_expr(swap) else (cfg.tile_m, cfg.head_dim))
        if const_expr(not kv_swap):
            acc_shape_nm = wg_nm.partition_shape_C((cfg.tile_n, cfg.tile_m))
            acc_dV = cute.make_rmem_tensor(wg_nv.partition_shape_C((cfg.tile_n, cfg.head_dim_v)), Float32)
            acc_dK = cute.make_rmem_tensor(wg_nd.partition_shape_C((cfg.tile_n, cfg.head_dim)), Float32)
            # Rows of the S^T fragment are keys, columns are queries.
            coords = FragmentCoords(thr_nm, cfg.tile_n, cfg.tile_m, mma.acc_mn_view)
            # dS^T registers -> sdS (the forward's O epilogue copy, on the S^T tile; swapped
            # dQ: transposed, into the keys-contiguous dS tile).
            r2s_dS = mma.stmatrix_copy(tiled_mma_nm, self.dtype, tidx, transpose=swap,
                                       wg_cols=cfg.tile_m // self.num_mma_wg if split else 16)
            tdSsdS = r2s_dS.partition_D(T(sdS) if const_expr(swap) else sdS)   # (..., stage)
            if const_expr(split):
                tdSsdS = (tdSsdS, r2s_dS.partition_D(sP))     # P^T's stores likewise
        # dQ registers -> this thread's 16-byte runs of sdQ (fragment order).
        tdQsdQ = dq_fragment_copy(self.num_mma_wg).get_slice(tidx).partition_D(sdQ)

        if const_expr(self.diagonal_reduction):
            # Each thread zeroes the sDiag entries it alone writes (the first flush reads
            # them after ds_full, which orders these stores; the flushes leave them zero,
            # so persistent CTAs zero them once).
            diag_row = self._diag_row(sDiag, coords)
            s_mn0 = mma.acc_mn_view(cute.make_rmem_tensor(acc_shape_nm, Float32))
            order = _element_order(cute.size(s_mn0.shape[0]), cute.size(s_mn0.shape[1]), False)
            keys = sorted(set(_diagonal_flushes(order, coords, False).values()))
            for k in cutlass.range_constexpr(len(keys)):
                diag_row[keys[k] + 8] = Float32(0.0)
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, cfg.num_stages)
        fixed = ((tiled_mma_nm, tiled_mma_nd, tiled_mma_nv, tiled_mma_md), frags, acc_shape_nm, acc_shape_md,
                 acc_dV, acc_dK, coords, r2s_dS, tdSsdS, tdQsdQ, wg, sLSE, sDelta, pipe_q, pipe_do)
        rest = (seqlen_q, seqlen_k, softmax_scale, scale_log2, mod_args, grad_args, sDiag)
        out = (acc_dK, acc_dV, mdK, mdV, dkv_stage, tma_atom_dK, tma_atom_dV, (tiled_mma_nd, tiled_mma_nv),
               tidx, pipe_kv)
        if const_expr(cfg.max_ctas):
            tiles = where()
            for idx in cutlass.range(tiles.first, tiles.total, tiles.stride, unroll=1):
                n_block, head_kv, batch = self._tile_order().tile(idx, tiles)
                kv_state, state = self._consume_tile(fixed, rest, out, kv_state, state, n_block, head_kv,
                                                     batch, group, block_sparse)
        else:
            n_block, head_kv, batch = where
            self._consume_tile(fixed, rest, out, kv_state, state, n_block, head_kv, batch, group,
                               block_sparse)

    @cute.jit
    def _consume_tile(self, fixed, rest, out, kv_state, state, n_block, head_kv, batch, group,
                      block_sparse):
        """One kv tile: its q-block walks per q head of the group, then dK / dV out
        (persistent: then K / V released for the next tile's loads)."""
        cfg = self.cfg
        mods = self.mods
        seqlen_q, seqlen_k, softmax_scale, scale_log2, mod_args, grad_args, sDiag = rest
        acc_dK, acc_dV, mdK, mdV, dkv_stage, tma_atom_dK, tma_atom_dV, dkv_mmas, tidx, pipe_kv = out
        acc_dV.fill(0.0)
        acc_dK.fill(0.0)
        pipe_kv.consumer_wait(kv_state)
        for g in cutlass.range(group, unroll=1):
            head = head_kv * group + g
            ctx = _BwdStep(*fixed, n_block, head, batch, seqlen_q, seqlen_k,
                           softmax_scale, scale_log2, mod_args, grad_args, sDiag)
            if const_expr(cfg.block_sparse and cfg.deterministic):
                blocks = self._sparse_blocks(block_sparse, batch, head, n_block)
                # The next visit's list reads are issued a step ahead: the branch on
                # `partial` would otherwise wait for them at every step. (Past the last
                # visit they read clamped, in-bounds entries, unused.)
                nxt, nxt_partial, walk = self._visit(blocks, 0, (Int32(0), Int32(0)))
                for i in cutlass.range(blocks.count, unroll=1):
                    m_block, partial = nxt, nxt_partial
                    nxt, nxt_partial, walk = self._visit(blocks, i + 1, walk)
                    if partial != 0:
                        state = self._step(ctx, state, m_block, mask=mods.has_mask, causal=False)
                    else:
                        state = self._step(ctx, state, m_block, mask=False, causal=False)
            elif const_expr(cfg.block_sparse or cfg.band):
                blocks = self._q_blocks(block_sparse, batch, head, n_block, seqlen_q)
                if const_expr(cfg.partial_blocks):   # (False: no partial list, no step for it)
                    for i in cutlass.range(blocks.n_partial, unroll=1):
                        # (under a band, `block_sparse` holds its (lo, hi): see _q_blocks)
                        state = self._partial_step(ctx, state, blocks.partial_at(i), block_sparse,
                                                   mask=mods.has_mask, causal=False)
                for i in cutlass.range(blocks.n_full, unroll=1):
                    state = self._step(ctx, state, blocks.full_at(i), mask=False, causal=False)
            else:
                blocks = self._dense_blocks(n_block, seqlen_q)
                if const_expr(cfg.causal):
                    # Blocks crossing the diagonal: the hook's mask if any (it is the causal
                    # mask, as in the forward), else the built-in one; then full blocks.
                    n_diag = cutlass.min(blocks.diag_end, blocks.n_m)
                    for m_block in cutlass.range(blocks.first, n_diag, unroll=1):
                        state = self._partial_step(ctx, state, m_block, None, mask=mods.has_mask,
                                                   causal=not mods.has_mask)
                    for m_block in cutlass.range(cutlass.max(n_diag, blocks.first), blocks.n_m,
                                                 unroll=1):
                        state = self._step(ctx, state, m_block, mask=False, causal=False)
                else:
                    for i in cutlass.range(blocks.count, unroll=1):
                        state = self._step(ctx, state, blocks.at(i), mask=mods.has_mask,
                                           causal=False)

        if const_expr(self.dkv_staged_apart):
            # Each thread's last GEMMs (the last readers of sK / sV) have retired: the next
            # tile's K / V may load while dK / dV leave through sdQ / sdS.
            pipe_kv.consumer_release(kv_state)
            kv_state.advance()
        self.epilogue(acc_dK, acc_dV, mdK, mdV, dkv_stage, tma_atom_dK, tma_atom_dV,
                      dkv_mmas, tidx, n_block, head_kv, batch, softmax_scale)
        if const_expr(cfg.max_ctas and not self.dkv_staged_apart):
            # Warp 0 waited until the dK / dV stores read sK / sV (store_staged).
            pipe_kv.consumer_release(kv_state)
            kv_state.advance()
        return kv_state, state

    def _dq_gemm(self, tiled_mma_md, acc_shape_md, tQrdS, tQrKt, stage, wait: int):
        """dQ = dS K from sdS[stage] (this warpgroup's half of the head dim, or at tile_m 128
        of the rows; swapped: dQ^T = K^T dS^T), issued; `wait` as `mma.gemm`'s."""
        acc_dQ = cute.make_rmem_tensor(acc_shape_md, Float32)
        if const_expr(self.cfg.dq_swap_ab):
            mma.gemm(tiled_mma_md, acc_dQ, tQrKt[None, None, None, 0],
                     tQrdS[None, None, None, stage], zero_init=True, wait=wait)
        else:
            mma.gemm(tiled_mma_md, acc_dQ, tQrdS[None, None, None, stage],
                     tQrKt[None, None, None, 0], zero_init=True, wait=wait)
        return acc_dQ

    @cute.jit
    def _partial_step(self, ctx, state, m_block, band, mask: cutlass.Constexpr[bool],
                      causal: cutlass.Constexpr[bool]):
        """`_step` on a visit the mask may cut (a causal diagonal's, a band's or a list's
        partial block); under `idle_masked_keys` a warpgroup whose keys it hides entirely
        (`_keys_masked`; `band`: the band's (lo, hi), None for causal) runs `_idle_step`."""
        if const_expr(self.cfg.idle_masked_keys):
            if self._keys_masked(m_block, ctx, band):
                state = self._idle_step(ctx, state)
            else:
                state = self._step(ctx, state, m_block, mask=mask, causal=causal)
        else:
            state = self._step(ctx, state, m_block, mask=mask, causal=causal)
        return state

    def _keys_masked(self, m_block, ctx, band):
        """Whether the visit of q block `m_block` masks all of this warpgroup's keys
        (`BwdConfig.idle_masked_keys`): causal (top-left, kv <= q) when its last row comes
        before its first key; a band (`band` = (lo, hi) of q - kv) when every q - kv of the
        visit lies outside [lo, hi]. Warpgroup-uniform."""
        cfg = self.cfg
        keys = cfg.tile_n // self.num_mma_wg
        q_lo = m_block * cfg.tile_m
        q_hi = q_lo + (cfg.tile_m - 1)
        kv_lo = ctx.n_block * cfg.tile_n + ctx.wg * keys
        kv_hi = kv_lo + (keys - 1)
        if const_expr(band is None):
            return q_hi < kv_lo
        lo, hi = band
        return (q_lo - kv_hi > hi) | (q_hi - kv_lo < lo)

    @cute.jit
    def _idle_step(self, ctx, state):
        """`_step` for a warpgroup whose keys the visit masks entirely (`_keys_masked`):
        P^T and dS^T are 0 there, so no S^T / dP^T GEMM, pointwise pass, dV or dK. It
        stores its half of dS^T as zeros (the dQ GEMMs read all the keys) and computes its
        share of dQ, with `_step`'s waits, barrier and releases (the other warpgroup runs
        `_step`, or this same step)."""
        *_, tQrdS, tQrKt, _ = ctx.frags               # the dQ GEMM's operands (as `_step` names them)
        *_, tiled_mma_md = ctx.mmas
        stage = state.index
        do_state = lockstep_state(state, self.cfg.do_ring, producer=False)
        ctx.pipe_q.consumer_wait(state)
        ctx.pipe_do.consumer_wait(do_state)
        zeros = cute.make_rmem_tensor(ctx.acc_shape_nm, Float32)
        zeros.fill(0.0)
        rdS = cute.make_rmem_tensor_like(zeros, self.dtype)
        mma.convert_into(rdS, zeros)
        cute.copy(ctx.r2s_dS, ctx.r2s_dS.retile(rdS), ctx.tdSsdS[None, None, None, stage])
        cute.arch.fence_view_async_shared()          # generic-proxy writes -> wgmma reads
        BwdBarrier.DS_FULL.sync(self.num_mma_threads)
        ctx.pipe_do.consumer_release(do_state)
        acc_dQ = self._dq_gemm(tiled_mma_md, ctx.acc_shape_md, tQrdS, tQrKt, stage, wait=0)
        self._stage_dq(acc_dQ, ctx.tdQsdQ, ctx.wg)
        ctx.pipe_q.consumer_release(state)
        state.advance()
        return state

    @cute.jit
    def _step(self, ctx, state, m_block, mask: cutlass.Constexpr[bool],
              causal: cutlass.Constexpr[bool]):
        """One q block against this CTA's keys: dV, dK accumulate; the dQ tile goes to sdQ
        for the writer warp. GEMM order (FA3/FA4's): S^T, dP^T | P, dS | dV; dQ; dK, each
        wait retiring the GEMM before the last one issued, so dQ's GEMM overlaps dK's and
        its copy to smem overlaps the dK GEMM's tail."""
        tiled_mma_nm, tiled_mma_nd, tiled_mma_nv, tiled_mma_md = ctx.mmas
        tSrK, tSrQ, tPrV, tPrdO, tVrP, tVrdOt, tKrQt, tQrdS, tQrKt, _ = ctx.frags
        acc_shape_nm, acc_shape_md, acc_dV, acc_dK = ctx.acc_shape_nm, ctx.acc_shape_md, ctx.acc_dV, ctx.acc_dK
        coords, r2s_dS, tdSsdS, tdQsdQ, wg = ctx.coords, ctx.r2s_dS, ctx.tdSsdS, ctx.tdQsdQ, ctx.wg
        sLSE, sDelta, pipe_q, pipe_do, sDiag = ctx.sLSE, ctx.sDelta, ctx.pipe_q, ctx.pipe_do, ctx.sDiag
        n_block, head, batch, seqlen_q, seqlen_k = ctx.n_block, ctx.head, ctx.batch, ctx.seqlen_q, ctx.seqlen_k
        softmax_scale, scale_log2, mod_args, grad_args = ctx.softmax_scale, ctx.scale_log2, ctx.mod_args, ctx.grad_args
        mods = self.mods
        stage = state.index
        do_state = lockstep_state(state, self.cfg.do_ring, producer=False)   # (state itself unless shallower)
        do_stage = do_state.index
        split = self.cfg.split_head_dim
        rP = None

        # S^T = K Q^T and dP^T = V dO^T, both in flight at once.
        acc_S = cute.make_rmem_tensor(acc_shape_nm, Float32)
        pipe_q.consumer_wait(state)
        lse, delta = sLSE[None, stage], sDelta[None, do_stage]
        if const_expr(self.stats_in_registers):
            lse = self._column_values(lse, coords)
        mma.gemm(tiled_mma_nm, acc_S, *self._ordered(tSrK[None, None, None, 0], tSrQ[None, None, None, stage]),
                 zero_init=True, wait=-1)
        acc_dP = cute.make_rmem_tensor(acc_shape_nm, Float32)
        pipe_do.consumer_wait(do_state)
        mma.gemm(tiled_mma_nm, acc_dP, *self._ordered(tPrV[None, None, None, 0], tPrdO[None, None, None, do_stage]),
                 zero_init=True, wait=-1)
        blk = (m_block, n_block, head, batch, seqlen_q, seqlen_k, softmax_scale, mod_args)
        if const_expr(mods.has_score):
            # One pass after both GEMMs: ds'/ds and the raw score stay per-element
            # temporaries instead of two more 32-register fragments (which spilled).
            warpgroup.wait_group(0)
            if const_expr(getattr(mods, "constant_score_grad", None) is not None and not self.cfg.buffer_grads):
                # Additive mods with fixed captures: the KV_LEN test only where keys
                # straddle it (two copies; with buffer grads the scatter dominates).
                self._pointwise_at_edge(acc_S, acc_dP, lse, delta, coords, blk, scale_log2,
                                        grad_args, mask, causal, self._diag_row(sDiag, coords))
            else:
                # One copy: two spill with a derivative's temporaries (softcap: 48 B).
                self._pointwise(acc_S, acc_dP, lse, delta, coords, blk, scale_log2,
                                grad_args, mask, causal, True, self._diag_row(sDiag, coords))
            if const_expr(split):
                rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
                mma.convert_into(rP, acc_S)
            else:
                mma.convert_into(tVrP, mma.acc_as_a_view(acc_S))
        else:
            # Without a score mod dS = dS': P is computed while dP^T is still in flight.
            warpgroup.wait_group(1)                  # S^T ready (groups retire in order)
            self._pointwise_at_edge(acc_S, None, lse, None, coords, blk,
                                    scale_log2, grad_args, mask, causal)
            if const_expr(split):
                rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
                mma.convert_into(rP, acc_S)
                if const_expr(self.cfg.p_early):     # while dP runs (the tail's fence covers it)
                    # (tdSsdS is (dS^T, P^T) here; the swapped layout has one P^T buffer: 0)
                    cute.copy(r2s_dS, r2s_dS.retile(rP), tdSsdS[1][None, None, None, 0])
            else:
                mma.convert_into(tVrP, mma.acc_as_a_view(acc_S))
            if const_expr(self.stats_in_registers):
                delta = self._column_values(delta, coords)
            warpgroup.wait_group(0)                  # dP^T ready
            self._ds_from_p(acc_S, acc_dP, delta, coords)
        rdS = cute.make_rmem_tensor_like(acc_dP, self.dtype)
        mma.convert_into(rdS, acc_dP)
        if const_expr(split):
            return self._split_step_tail(ctx, state, do_state, rP, rdS,
                                         p_stored=self.cfg.p_early and not mods.has_score)

        # dS^T -> sdS[stage] (no wait: see sdS_layout), then dV += P^T dO (A from registers).
        cute.copy(r2s_dS, r2s_dS.retile(rdS), tdSsdS[None, None, None, stage])
        mma.gemm(tiled_mma_nv, acc_dV, tVrP, tVrdOt[None, None, None, do_stage], zero_init=False, wait=-1)
        cute.arch.fence_view_async_shared()          # generic-proxy writes -> wgmma reads
        BwdBarrier.DS_FULL.sync(self.num_mma_threads)
        acc_dQ = self._dq_gemm(tiled_mma_md, acc_shape_md, tQrdS, tQrKt, stage, wait=1)
        pipe_do.consumer_release(do_state)           # dV (the last reader of dO) retired
        # dK += dS^T Q (A from registers).
        mma.gemm(tiled_mma_nd, acc_dK, mma.acc_as_a_view(rdS),
                      tKrQt[None, None, None, stage], zero_init=False, wait=1)   # dQ retired
        if const_expr(self.diagonal_reduction):
            # While dK runs. sDiag was complete at ds_full; the warpgroup's next writes
            # come after the dq_empty barrier below, which every reader passes first.
            self._flush_diagonals(sDiag, wg, m_block, n_block, head, batch, mod_args,
                                  grad_args)
        self._stage_dq(acc_dQ, tdQsdQ, wg)
        warpgroup.wait_group(0)                      # dK retired: Q may be overwritten
        pipe_q.consumer_release(state)
        state.advance()
        return state

    @cute.jit
    def _split_step_tail(self, ctx, state, do_state, rP, rdS, p_stored: cutlass.Constexpr[bool] = False):
        """`_step` after P^T and dS^T (16-bit, this warpgroup's q columns), under
        `split_head_dim`: both go to shared memory (buffer by visit parity), then each
        warpgroup runs its head-dim slice of dQ = dS K, dV += P^T dO and dK += dS^T Q, all
        SS. dQ first: its accumulator (D / 4 registers) is only live until it is staged for
        the writer, while dV and dK run. `dkv_swap`: dV^T += dO^T P and dK^T += Q^T dS, one
        P^T buffer (a warpgroup's dV^T reads only its own keys' rows, after its previous
        visit's GEMMs all retired). `p_stored`: P^T is in shared memory already (p_early)."""
        _, tiled_mma_nd, tiled_mma_nv, tiled_mma_md = ctx.mmas
        _, _, _, _, tVsP, tVrdOt, tKrQt, tQrdS, tQrKt, tKsdS = ctx.frags
        tdSsdS, tPsP = ctx.tdSsdS                    # (dS^T, P^T) under split_head_dim
        acc_shape_md, acc_dV, acc_dK, r2s_dS = ctx.acc_shape_md, ctx.acc_dV, ctx.acc_dK, ctx.r2s_dS
        tdQsdQ, wg, pipe_q, pipe_do = ctx.tdQsdQ, ctx.wg, ctx.pipe_q, ctx.pipe_do
        cfg = self.cfg
        stage, do_stage = state.index, do_state.index
        # Two buffers: a warpgroup writes visit i + 1's tiles only after the ds_full barrier
        # of visit i, which the other passes after its visit i - 1 GEMMs have all retired.
        # One dS^T buffer (swapped layout): after both warpgroups are done with visit i. One
        # P^T buffer in the swapped layout (each warpgroup reads only its own rows).
        buf = state.count % 2
        ds_buf = buf if const_expr(cfg.ds_ring == 2) else 0
        p_buf = 0 if const_expr(cfg.dkv_swap) else buf
        if const_expr(cfg.dkv_rows):
            # Both warpgroups read all of P^T (dV^T's B): the previous visit's readers first.
            BwdBarrier.DS_EMPTY.sync(self.num_mma_threads)
        if const_expr(not p_stored):
            cute.copy(r2s_dS, r2s_dS.retile(rP), tPsP[None, None, None, p_buf])
        if const_expr(cfg.ds_ring == 1 and not cfg.dkv_rows):
            BwdBarrier.DS_EMPTY.sync(self.num_mma_threads)
        cute.copy(r2s_dS, r2s_dS.retile(rdS), tdSsdS[None, None, None, ds_buf])
        cute.arch.fence_view_async_shared()          # generic-proxy writes -> wgmma reads
        BwdBarrier.DS_FULL.sync(self.num_mma_threads)
        acc_dQ = cute.make_rmem_tensor(acc_shape_md, Float32)

        # The three GEMMs; `wait`: groups left in flight after issuing (-1: none waited for).
        def gemm_dq(wait):
            mma.gemm(tiled_mma_md, acc_dQ, tQrdS[None, None, None, ds_buf], tQrKt[None, None, None, 0],
                     zero_init=True, wait=wait)

        def gemm_dv(wait):
            mma.gemm(tiled_mma_nv, acc_dV, *self._ordered(tVsP[None, None, None, p_buf], tVrdOt[None, None, None, do_stage]),
                     zero_init=False, wait=wait)

        def gemm_dk(wait):
            mma.gemm(tiled_mma_nd, acc_dK, *self._ordered(tKsdS[None, None, None, ds_buf], tKrQt[None, None, None, stage]),
                     zero_init=False, wait=wait)

        if const_expr(cfg.tail_order == "dv_first"):
            gemm_dv(-1)
            gemm_dq(1)                                   # dV retired: dO may be overwritten
            pipe_do.consumer_release(do_state)
            gemm_dk(1)                                   # dQ retired
            self._stage_dq(acc_dQ, tdQsdQ, wg)
        else:
            gemm_dq(-1)
            gemm_dv(-1)
            gemm_dk(2)                                   # dQ retired
            self._stage_dq(acc_dQ, tdQsdQ, wg)
            warpgroup.wait_group(1)                      # dV retired: dO may be overwritten
            pipe_do.consumer_release(do_state)
        warpgroup.wait_group(0)                      # dK retired: Q may be overwritten
        pipe_q.consumer_release(state)
        state.advance()
        return state

    def _ordered(self, a, b):
        """A GEMM's (A, B) fragments as the layout takes them: (a, b) — S^T = K Q^T, dV +=
        P^T dO, ... — or, in the swapped layout (`dkv_swap`: S = Q K^T, dV^T = dO^T P, ...),
        (b, a). The fragment slots hold each layout's own operands."""
        return (b, a) if self.cfg.dkv_swap else (a, b)

    @cute.jit
    def _stage_dq(self, acc_dQ, tdQsdQ, wg):
        """This warpgroup's dQ tile -> sdQ[wg] once the writer's previous bulk add has read
        it; the writer adds it into global memory while the warpgroup goes on."""
        BwdBarrier.DQ_EMPTY.sync(self.dq_pair_threads, wg)
        cute.autovec_copy(cute.make_tensor(acc_dQ.iterator, cute.make_layout(tdQsdQ.shape)),
                          tdQsdQ)
        cute.arch.fence_view_async_shared()          # generic-proxy writes -> bulk copy
        BwdBarrier.DQ_FULL.arrive(self.dq_pair_threads, wg)

    # ------------------------------------------------------------------ dQ writer
    @cute.jit
    def store_dq(self, mdQacc, sdQ, where, group, seqlen_q, seqlen_k, block_sparse, mdQsem, fin_tile):
        """Warp 1: per visit, add each warpgroup's dQ tile (sdQ column) into the dq_accum
        workspace with one `cp.reduce.async.bulk .add.f32` (16 KB, fire and forget: the
        reads of sdQ complete before the next visit hands the buffer back). Visits are
        enumerated as by the producer.

        Deterministic: wait for this (head, q tile)'s turn before the adds; the turn is
        passed on once they have landed (`BwdConfig.dq_turn_pass`): right away, or one
        visit later, after the next tile's first half is ready, by when they have long
        landed (the landing wait is then off the writer's path). Holding a turn longer
        cannot deadlock: a CTA only ever waits for higher kv blocks' turns.

        dq_finish: a visit's adds are counted (`_count_landed`) just before the next visit's
        are issued, by when they have landed; the last visit's at the end; the visit that
        completes its tile hands it to the finisher warps (`fin_tile`)."""
        cfg = self.cfg
        lane = cute.arch.lane_idx()
        if const_expr(cfg.max_ctas):     # (never deterministic)
            tiles = where()
            for idx in cutlass.range(tiles.first, tiles.total, tiles.stride, unroll=1):
                n_block, head_kv, batch = self._tile_order().tile(idx, tiles)
                sems = mdQsem[batch, None, None] if const_expr(cfg.dq_first_store) else None
                self._store_dq_tile(mdQacc, sdQ, n_block, head_kv, batch, group, seqlen_q, seqlen_k,
                                    block_sparse, sems, Int32(-1), lane)
                if const_expr(self.dkv_staged_apart):
                    # The tile's last adds have read sdQ: the epilogue may stage dK there.
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
                    BwdBarrier.DQ_DRAINED.arrive(self.num_mma_threads + 32)
        else:
            n_block, head_kv, batch = where
            # Deterministic: the flag (its offset in this batch's [H, q tiles] semaphores)
            # whose turn is still held, or -1. One register: this warp has 24.
            sems = mdQsem[batch, None, None] if const_expr(cfg.dq_flags) else None
            if const_expr(cfg.dq_finish):
                # The visit whose adds are not counted yet: (head, q tile), head -1: none.
                none = Int32(-1)
                pending = self._store_dq_tile(mdQacc, sdQ, n_block, head_kv, batch, group, seqlen_q,
                                              seqlen_k, block_sparse, sems, (none, Int32(0)), lane, fin_tile)
                count = self._count_landed(sems, pending, batch, seqlen_k, block_sparse, lane)
                self._finish_if_last(fin_tile, pending, count, lane)
                self._hand_over(fin_tile, (none, Int32(0)), lane)     # no more tiles
            else:
                held = self._store_dq_tile(mdQacc, sdQ, n_block, head_kv, batch, group, seqlen_q, seqlen_k,
                                           block_sparse, sems, Int32(-1), lane)
                if const_expr(cfg.deterministic and cfg.turn_pass == "next_visit"):
                    if held >= 0:
                        self._dq_pass_turn(sems.iterator + held, lane)
        cute.arch.cp_async_bulk_wait_group(0, read=True)   # sdQ is read before the CTA exits

    @cute.jit
    def _store_dq_tile(self, mdQacc, sdQ, n_block, head_kv, batch, group, seqlen_q, seqlen_k,
                       block_sparse, sems, held, lane, fin_tile=None):
        """`store_dq` for one kv tile; returns the deterministic turn still held (dq_finish:
        the visit not yet counted, `held` on entry)."""
        cfg = self.cfg
        n_wg = self.num_mma_wg
        chunk = cfg.tile_m * cfg.head_dim // n_wg
        for g in cutlass.range(group, unroll=1):
            head = head_kv * group + g
            gdQ = cute.local_tile(mdQacc[None, None, head, batch], (cfg.tile_m, cfg.head_dim),
                                  (None, 0))
            blocks = self._q_blocks(block_sparse, batch, head, n_block, seqlen_q)
            visitors = None
            if const_expr(cfg.deterministic):
                kv_lists = block_sparse[4:] if const_expr(cfg.block_sparse) else None
                visitors = KvVisitors(cfg, (seqlen_k + cfg.tile_n - 1) // cfg.tile_n, kv_lists,
                                      batch, head)
            walk = (Int32(0), Int32(0))
            for i in cutlass.range(blocks.count, unroll=1):
                m_block, _, walk = self._visit(blocks, i, walk)
                for w in cutlass.range_constexpr(n_wg):
                    # Bulk groups complete in order: allow the later halves in flight.
                    cute.arch.cp_async_bulk_wait_group(n_wg - 1 - w, read=True)
                    BwdBarrier.DQ_EMPTY.arrive(self.dq_pair_threads, w)
                dst = gdQ[None, None, m_block].iterator
                count = None
                if const_expr(cfg.dq_finish):
                    # The previous visit's adds, counted before this visit's are issued.
                    count = self._count_landed(sems, held, batch, seqlen_k, block_sparse, lane)
                ticket = flag = None
                if const_expr(cfg.dq_first_store):
                    # The previous visit's store published (issued a visit ago: landed by
                    # now), then this visit's ticket (or once its data is staged).
                    held = self._publish_stored(sems, held, lane)
                    flag = sems[head, None].iterator + m_block
                    if const_expr(not cfg.dq_ticket_on_data):
                        ticket = self._draw_ticket(flag, lane)
                for w in cutlass.range_constexpr(n_wg):
                    BwdBarrier.DQ_FULL.sync(self.dq_pair_threads, w)
                    if const_expr(cfg.dq_ticket_on_data and w == 0):
                        ticket = self._draw_ticket(flag, lane)
                    if const_expr(cfg.deterministic and w == 0 and cfg.turn_pass == "next_visit"):
                        if held >= 0:
                            self._dq_pass_turn(sems.iterator + held, lane)
                    if const_expr(cfg.deterministic and w == 0):
                        self._dq_wait_turn(sems[head, None].iterator + m_block,
                                           visitors.after(m_block, n_block), lane)
                    if const_expr(cfg.dq_first_store):
                        if ticket == 0:
                            if lane == 0:
                                bulk_store(dst + w * chunk, sdQ[None, w].iterator, chunk * 4)
                        else:
                            if const_expr(w == 0):
                                # The ticket saw the first store published (acquired):
                                # no spin, no second round trip.
                                if ticket & DQ_STORED == 0:
                                    self._wait_stored(flag, lane)
                            if lane == 0:
                                bulk_add_f32(dst + w * chunk, sdQ[None, w].iterator, chunk * 4)
                    elif lane == 0:
                        bulk_add_f32(dst + w * chunk, sdQ[None, w].iterator, chunk * 4)
                    cute.arch.cp_async_bulk_commit_group()
                if const_expr(cfg.dq_first_store):
                    held = Int32(-1)
                    if ticket == 0:
                        held = Int32(cute.crd2idx((head, m_block), sems.layout))
                if const_expr(cfg.deterministic and cfg.turn_pass == "after_adds"):
                    self._dq_pass_turn(sems[head, None].iterator + m_block, lane)
                elif const_expr(cfg.deterministic):
                    held = Int32(cute.crd2idx((head, m_block), sems.layout))
                elif const_expr(cfg.dq_finish):
                    self._finish_if_last(fin_tile, held, count, lane)
                    held = (head, m_block)
        if const_expr(cfg.dq_first_store):
            held = self._publish_stored(sems, held, lane)   # the tile's last store, if first
        return held

    @cute.jit
    def _draw_ticket(self, flag, lane):
        """dq_first_store: the tile's flag before this visit's ticket, in every lane (lane 0
        draws it): 0 for the tile's first visit; with DQ_STORED set, the first store has
        landed and is acquired (a later visit need not spin)."""
        old = Int32(0)
        if lane == 0:
            old = atom_add_acquire_s32(flag, 1)
        return cute.arch.shuffle_sync(old, 0)

    @cute.jit
    def _publish_stored(self, sems, held, lane):
        """dq_first_store: once the store of the tile at offset `held` (-1: none) has landed,
        set its DQ_STORED bit (release: the store is visible to whoever sees the bit).
        Returns -1 (nothing held)."""
        if held >= 0:
            cute.arch.cp_async_bulk_wait_group(0, read=False)
            if lane == 0:
                red_release_add_s32(sems.iterator + held, DQ_STORED)
        return Int32(-1)

    @cute.jit
    def _wait_stored(self, flag, lane):
        """dq_first_store: spin (lane 0, acquire) until the tile's first store has landed."""
        if lane == 0:
            seen = Int32(0)
            start = cute.arch.globaltimer()
            while seen & DQ_STORED == 0:
                seen = self._acquire_flag(flag, start)
        cute.arch.sync_warp()

    @cute.jit
    def _count_landed(self, sems, visit, batch, seqlen_k, block_sparse, lane):
        """dq_finish: once the bulk adds of `visit` = (head, q tile) (head -1: none) have
        landed — the caller has issued none since, so the wait is short: they were issued a
        visit ago — add 1 to the tile's flag with release semantics (the adds are published
        with the count). Returns (the old count, lane 0's; the tile's visitor count); the
        caller reads the old count later (`_finish_if_last`), after it has returned.
        With newer bulk adds in flight the release waits for them too (fwd+bwd 5% slower
        measured, H100, 2026-11-27), hence before this visit's adds, not after."""
        old = Int32(0)
        count = Int32(0)
        if visit[0] >= 0:
            cute.arch.cp_async_bulk_wait_group(0, read=False)
            count = self._dq_visitors(block_sparse, batch, visit[0], visit[1], seqlen_k)
            if lane == 0:
                old = atom_add_release_s32(sems[visit[0], None].iterator + visit[1], 1)
        return old, count

    @cute.jit
    def _finish_if_last(self, fin_tile, visit, counted, lane):
        """dq_finish: hand `visit`'s tile over if its count (`_count_landed`'s) made it whole:
        a fence after the read of the final count acquires every visitor's released adds
        (the fence-acquire pattern), the hand-over's barrier orders the finishers after it."""
        if visit[0] >= 0:
            seen = cute.arch.shuffle_sync(counted[0], 0)
            if seen + 1 == counted[1]:
                cute.arch.fence_acq_rel_gpu()
                self._hand_over(fin_tile, visit, lane)

    @cute.jit
    def _hand_over(self, fin_tile, visit, lane):
        """The dQ writer hands (head, q tile) to the finisher warps once they have taken the
        previous one (head -1: no more tiles)."""
        BwdBarrier.FIN_EMPTY.sync(self.fin_threads)
        if lane == 0:
            fin_tile[0] = visit[0]
            fin_tile[1] = visit[1]
        BwdBarrier.FIN_FULL.arrive(self.fin_threads)

    @cute.jit
    def _dq_visitors(self, block_sparse, batch, head, m_block, seqlen_k):
        """How many CTAs (kv tiles) visit q tile `m_block` of (batch, head): the transposes
        of the walks (bwd/q_blocks.visitor_count; block-sparse: the BlockMask's kv-side
        lists of q block m_block // factor, each listed kv block one CTA)."""
        cfg = self.cfg
        if const_expr(cfg.block_sparse):
            kv_num, _, full_num, _ = block_sparse[4:]
            qb = m_block // (cfg.sparse_block_m // cfg.tile_m)
            b, h = batch % kv_num.shape[0], head % kv_num.shape[1]
            return Int32(kv_num[b, h, qb]) + Int32(full_num[b, h, qb])
        return Int32(visitor_count(m_block, cfg.tile_m, cfg.tile_n, seqlen_k, cfg.causal,
                                   block_sparse if const_expr(cfg.band) else None, _kernel_ops()))

    # ------------------------------------------------------------------ dQ finishers
    @cute.jit
    def finish_dq(self, mdQacc, mdQ, sFin, mbar, fin_tile, tiled_mma, w, where, seqlen_q, softmax_scale):
        """dq_finish, producer warp 2 + w (w = 0, 1): for each q tile the dQ writer hands
        over, read column w of its dq_accum tile (fragment order: consumer warpgroup w's
        half of the head dim) back into sFin with one bulk copy, and store dQ = scale *
        that, converted, from the registers consumer thread 128 w + t held (t = 32 j +
        lane: this warp takes the four warps' turns). Rows past Q_LEN are not stored."""
        lane = cute.arch.lane_idx()
        batch = where[2]
        if lane == 0:
            cute.arch.mbarrier_init(mbar, 1)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_warp()
        BwdBarrier.FIN_EMPTY.arrive(self.fin_threads)
        phase = Int32(0)
        head = Int32(0)
        while head >= 0:
            BwdBarrier.FIN_FULL.sync(self.fin_threads)
            head = fin_tile[0]
            m_block = fin_tile[1]
            if head >= 0:
                BwdBarrier.FIN_EMPTY.arrive(self.fin_threads)
                self._finish_tile(mdQacc, mdQ, sFin, mbar, phase, tiled_mma, w, head, m_block, batch,
                                  seqlen_q, softmax_scale, lane)
                phase = phase ^ 1

    @cute.jit
    def _finish_tile(self, mdQacc, mdQ, sFin, mbar, phase, tiled_mma, w, head, m_block, batch,
                     seqlen_q, softmax_scale, lane):
        cfg = self.cfg
        tm, D = cfg.tile_m, cfg.head_dim
        chunk = tm * D // self.num_mma_wg
        # The writer acquired the adds (`_finish_if_last`); fence again here, in the reading
        # warp, then order those generic-proxy fences before the bulk (async-proxy) read.
        cute.arch.fence_acq_rel_gpu()
        cute.arch.fence_proxy("async.global")
        acc_tile = cute.local_tile(mdQacc[None, None, head, batch], (tm, D), (m_block, 0))
        if lane == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(mbar, chunk * 4)
            bulk_load(sFin[None, w].iterator, acc_tile.iterator + w * chunk, chunk * 4, mbar)
        cute.arch.mbarrier_wait(mbar, phase)
        gdQ = cute.local_tile(mdQ[None, None, head, batch], (tm, D), (m_block, 0))
        cdQ = cute.make_identity_tensor((tm, D))
        rows = seqlen_q - m_block * tm
        copy = dq_fragment_copy(self.num_mma_wg)
        for j in cutlass.range(4, unroll=1):
            t = 128 * w + 32 * j + lane
            src = copy.get_slice(t).partition_S(sFin)        # ((4, 1), chunks, 1)
            thr = tiled_mma.get_slice(t)
            tCg = thr.partition_C(gdQ)                       # thread t's accumulator, in order
            tCc = thr.partition_C(cdQ)
            for i in cutlass.range_constexpr(cute.size(src, mode=[1])):
                # One 16-byte chunk at a time (registers: this warp has few).
                vals = cute.make_rmem_tensor((4,), Float32)
                cute.autovec_copy(src[None, i, 0], vals)
                out = cute.make_rmem_tensor((4,), self.dtype)
                out.store((vals.load() * softmax_scale).to(self.dtype))
                for e in cutlass.range_constexpr(4):
                    if tCc[4 * i + e][0] < rows:
                        tCg[4 * i + e] = out[e]
        cute.arch.sync_warp()      # every lane has read sFin before the next bulk copy

    @cute.jit
    def _dq_pass_turn(self, flag, lane):
        """Deterministic dQ: once this warp's bulk adds have landed (all of them: the
        caller has none of the next tile's in flight), add 1 to the tile's flag."""
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        if lane == 0:
            red_release_add_s32(flag, 1)

    @cute.jit
    def _dq_wait_turn(self, flag, rank, lane):
        """Deterministic dQ: spin (lane 0, acquire) until the tile's flag counts `rank` =
        the kv blocks after this one that visit the tile (they add first)."""
        if lane == 0:
            seen = Int32(0)
            start = cute.arch.globaltimer()
            while seen != rank:
                seen = self._acquire_flag(flag, start)
        cute.arch.sync_warp()

    @cute.jit
    def _acquire_flag(self, flag, start):
        """One read of a dQ flag in a spin (acquire), trapping once the spin that began at
        `start` (globaltimer) has run DQ_TURN_TIMEOUT_NS: a wait nothing will end."""
        seen = ld_acquire_s32(flag)
        if cute.arch.globaltimer() - start > DQ_TURN_TIMEOUT_NS:
            trap()
        return seen

    def _diag_row(self, sDiag, coords):
        """This thread's row of sDiag from its column offset on (diagonal key k at
        [k + 8]), or None without the diagonal reduction. Made per step, not kept live
        across the loop (a register the causal kernel cannot spare)."""
        if const_expr(not self.diagonal_reduction):
            return None
        row = coords.row(0)               # 16 w + g: warp w's row group g = lane // 4
        row_idx = (row // 16) * self.DIAG_ROWS_PER_WARP + row % 16
        return cute.make_tensor(sDiag.iterator + row_idx * self.DIAG_ROW + coords.col_offset(),
                                cute.make_layout(self.DIAG_ROW))

    @cute.jit
    def _flush_diagonals(self, sDiag, wg, m_block, n_block, head, batch, mod_args, grad_args):
        """Warpgroup `wg`'s per-diagonal sums -> one buffer-gradient add per nonzero
        diagonal. Thread t takes d = t - 63 (q - kv inside the warpgroup's 64 keys x 64
        queries) and adds the entries of its 4 warps x 8 row groups in a fixed order (so the
        CTA's sum is deterministic; across CTAs the deterministic mode adds in fixed point),
        zeroing what it read. Warp w's rows start 16 w keys lower: its local diagonal is
        d + 16 w, entry d + 16 w + 8 + g of row group g (`_diag_row`). Each entry has one
        writer (`_pointwise`) and one reader (here)."""
        cfg = self.cfg
        d = cute.arch.thread_idx()[0] % 128 - 63
        row_len = self.DIAG_ROW
        total = Float32(0.0)
        for w in cutlass.range(4, unroll=1):     # rolled: few registers (dK is in flight)
            for g in cutlass.range_constexpr(self.DIAG_ROWS_PER_WARP):
                e = d + (16 * w + 8 + g)
                e_in = cutlass.max(cutlass.min(e, row_len - 1), 0)
                at = ((wg * 4 + w) * self.DIAG_ROWS_PER_WARP + g) * row_len + e_in
                v = sDiag[at] if e_in == e else Float32(0.0)
                total = total + v
                if v != Float32(0.0):
                    sDiag[at] = Float32(0.0)        # ready for the next step's writers
        if total != Float32(0.0):
            # Any (q, kv) of the diagonal gives its index (unclamped, as the per-thread
            # path): the first element inside the warpgroup's tile.
            kv_local = cutlass.max(-d, 0)
            q = m_block * cfg.tile_m + kv_local + d
            kv = n_block * cfg.tile_n + wg * 64 + kv_local
            reads = self.mods.buffer_grads(Float32(0.0), batch, head, q, kv, mod_args)
            self._add_buffer_grad(reads[0][0], reads[0][1], total, grad_args)

    @cute.jit
    def epilogue(self, acc_dK, acc_dV, mdK, mdV, dkv_stage, tma_atom_dK, tma_atom_dV,
                 tiled_mmas, tidx, n_block, head_kv, batch, softmax_scale):
        """dK * scale and dV -> input dtype -> stmatrix into the staging tiles (sK / sV, or
        under `dkv_staged_apart` sdQ / sdS) -> TMA store (clips keys >= KV_LEN). A CTA that
        visited nothing writes zeros."""
        cfg = self.cfg
        rdK = cute.make_rmem_tensor_like(acc_dK, self.dtype)
        rdK.store((acc_dK.load() * softmax_scale).to(self.dtype))
        rdV = cute.make_rmem_tensor_like(acc_dV, self.dtype)
        rdV.store(acc_dV.load().to(self.dtype))
        if const_expr(self.dkv_staged_apart):
            # sdS: both warpgroups' last dQ GEMMs (its readers) retired before they arrive;
            # sdQ: the writer arrives once its last add of the tile has read it.
            BwdBarrier.DQ_DRAINED.sync(self.num_mma_threads + 32)
        else:
            # sK / sV are read by both warpgroups' GEMMs until their last visit.
            BwdBarrier.EPILOGUE.sync(self.num_mma_threads)
        sdK, sdV = dkv_stage
        tiled_mma_nd, tiled_mma_nv = tiled_mmas   # dK's and dV's accumulator layouts
        # split_head_dim: a warpgroup's accumulator columns are its head-dim slice
        wg_cols = ((cfg.head_dim // self.num_mma_wg, cfg.head_dim_v // self.num_mma_wg)
                   if cfg.split_head_dim else (16, 16))
        if const_expr(cfg.dkv_swap):
            # dK^T / dV^T fragments (head dim x keys) into the keys-major tiles: transposing
            # stmatrix; a warpgroup's columns are its keys.
            r2s = mma.stmatrix_copy(tiled_mma_nd, self.dtype, tidx, transpose=True,
                                    wg_cols=cfg.tile_n if cfg.dkv_rows else cfg.tile_n // self.num_mma_wg)
            cute.copy(r2s, r2s.retile(rdK), r2s.partition_D(mma.transpose_view(sdK)))
            cute.copy(r2s, r2s.retile(rdV), r2s.partition_D(mma.transpose_view(sdV)))
        elif const_expr(tiled_mma_nv is tiled_mma_nd):
            stage_tiles(tiled_mma_nd, self.dtype, tidx, [(rdK, sdK), (rdV, sdV)], wg_cols[0])
        else:
            stage_tiles(tiled_mma_nd, self.dtype, tidx, [(rdK, sdK)], wg_cols[0])
            stage_tiles(tiled_mma_nv, self.dtype, tidx, [(rdV, sdV)], wg_cols[1])

        def dk_dv_stores():
            gdK = cute.local_tile(mdK[None, None, head_kv, batch], (cfg.tile_n, cfg.head_dim), (n_block, 0))
            gdV = cute.local_tile(mdV[None, None, head_kv, batch], (cfg.tile_n, cfg.head_dim_v), (n_block, 0))
            return [(tma_atom_dK, sdK, gdK), (tma_atom_dV, sdV, gdV)]

        store_staged(dk_dv_stores, tidx, BwdBarrier.EPILOGUE, self.num_mma_threads, wait_read=True)
        if const_expr(self.dkv_staged_apart):
            # The next tile writes sdS / sdQ again: not before warp 0's stores have read them.
            BwdBarrier.EPILOGUE.sync(self.num_mma_threads)
