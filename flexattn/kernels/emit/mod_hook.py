"""The mod hook: how masks and score mods enter a kernel.

A `ModHook` is a compile-time Python object. The kernel calls its methods while it is
being traced, once per element of the S = Q K^T accumulator fragment, with CuTeDSL
values: `b, h, q, kv` are Int32 (global batch, *query* head, query row, key column),
`s` is the Float32 score. Whatever the methods emit is inlined into the kernel.

    class ModHook:
        has_score: bool
        has_mask: bool
        def score(self, s, b, h, q, kv, args) -> Float32
        def mask(self, b, h, q, kv, args) -> Boolean       # True = keep
        def key(self) -> hashable                          # structure only
        def row_invariants(self, b, h, q, args) -> object | None   # optional, see there
        def tile_invariants(self, b, h, q, kv_start, tile_n, args, ...) -> object | None  # optional

`args` is the tuple of *runtime* kernel arguments the caller passed next to Q/K/V
(captured buffers as cute tensors, scalars as Float32/Int32). A hook reads them; it must
never bake their values into the code, so one compiled kernel serves any values. `key()`
must change whenever the emitted code would (IR structure, dtypes/ranks of args), and
must not depend on argument values.

Semantics (as torch flex_attention): the score mod sees the *scaled* score
s = (q . k) * softmax_scale; masked elements become -inf after the score mod.

Index safety: the kernel clamps q to Q_LEN-1 and kv to KV_LEN-1 before calling a hook,
so a hook that indexes a buffer of length Q_LEN / KV_LEN never reads out of bounds for
the padding rows/columns of a partial tile (their results are discarded). A hook may
narrow the kv clamp to where it matters with `load_index_vars` (the indices that reach
its buffer reads).
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, const_expr
from cutlass._mlir_helpers import arith as cutlass_arith

from flexattn.kernels.emit.affine_index import AffineIndex


class ModHook:
    """No score mod, no mask. Subclass and set the flags for the methods you override."""

    has_score: bool = False
    has_mask: bool = False

    def rows(self, score: bool, mask: bool) -> bool:
        """Whether `score` (if `score`) and `mask` (if `mask`) can also be emitted for a
        whole fragment row at once: score_row(s, b, h, q, kv, args) / mask_row(b, h, q,
        kv, args), where `s` and `kv` are vectors (cute.TensorSSA) of the row's elements
        and the others scalars. The kernel then calls them once per row (less to trace
        and compile than once per element, same results)."""
        return False

    # Whether an AffineIndex's float keeps its product with a row constant as one FFMA per
    # element (affine_index.FloatAffine): IRModHook's, as the forward planner sets it.
    scaled_indices = False

    def affine_index(self, var: str, score: bool, mask: bool) -> bool:
        """Whether `score` / `mask` take index `var` ("q", "kv") as an
        `affine_index.AffineIndex` (a base plus compile-time offsets: a conversion of
        kv - q to float then costs one conversion per row). Only hooks that emit through
        `mod_emit` understand it, and only mods that convert such an index to float ask."""
        return False

    def score(self, s, b, h, q, kv, args):
        return s

    def mask(self, b, h, q, kv, args):
        return Boolean(True)

    def row_invariants(self, b, h, q, args):
        """What `score` and `mask` read from buffers without kv or the score (ALiBi's
        `slopes[h]`, a decode step's `q_offset[b]`), emitted once per (b, h, q) row, or
        None. A kernel that calls this before its kv loop passes the result back as
        `row=` to `score` / `mask` for that row: the reads then leave at the kernel's
        start, beside the first K/V loads, instead of after the first K block has arrived
        (behind the whole first round of K/V loads: ~5 µs on an H100 decode step), and
        no block reads them again. None: nothing to hoist, call `score` / `mask` as usual."""
        return None

    def tile_invariants(self, b, h, q, kv_start, tile_n: int, args, row=None, score=True, mask=True):
        """What `score` (if `score`) and `mask` (if `mask`) read from buffers that stays
        constant over an aligned tile of `tile_n` keys starting at `kv_start` (a walk's
        table and a paged mask's page map, read at `kv // page`), emitted once per tile
        and row, or None. A kernel that calls this before the tile's scores are ready
        (the loads then overlap its wait for K) passes the result back as `tile=` to
        `score` / `mask` for that tile and row (with `row=` from `row_invariants`)."""
        return None

    def tile_invariant_count(self, tile_n: int) -> int:
        """How many values `tile_invariants` would emit per row for tiles of `tile_n` keys
        (0: nothing to hoist; planners then leave the kernel as it is)."""
        return 0

    def key(self):
        return (type(self).__module__, type(self).__qualname__)

    def index_vars(self, score: bool, mask: bool) -> frozenset:
        """The indices among b, h, q, kv that `score` (if `score`) and `mask` (if `mask`)
        read; kernels may pass None for the others (and skip computing them)."""
        return frozenset(("b", "h", "q", "kv"))

    def load_index_vars(self, score: bool, mask: bool) -> frozenset:
        """The indices among b, h, q, kv that reach a buffer index in `score` (if `score`)
        and `mask` (if `mask`): only those must be clamped into the sequence for the
        hooks' reads to stay in bounds. Elsewhere an index past the sequence end only
        changes values that the kernel masks anyway. All four by default (none when
        neither method runs)."""
        if (score and self.has_score) or (mask and self.has_mask):
            return frozenset(("b", "h", "q", "kv"))
        return frozenset()

    def mask_takes_unclamped(self, var: str) -> bool:
        """Whether the mask takes index `var` unclamped, as an `AffineIndex`: it asks for
        the form (`affine_index`) and reads no buffer at `var`. Past the sequence end the
        mask then only selects among elements the kernel discards (the backward's rows past
        Q_LEN have P = 0 whatever it keeps)."""
        return (self.has_mask and var in self.index_vars(False, True)
                and var not in self.load_index_vars(False, True) and self.affine_index(var, False, True))

    # ---- backward (bwd/sm90.py): derivatives of the score mod -------------------------
    # Hooks without a score mod need nothing. A hand-written hook with a score mod must
    # override `score_and_grad` to be usable in the backward (IRModHook derives it).
    grad_slots: tuple = ()     # positions in `args` of captured float buffers receiving grads

    def score_and_grad(self, s, b, h, q, kv, args):
        """(s', ds'/ds) at the scaled score `s`; the backward needs both per element."""
        if self.has_score:
            raise NotImplementedError(f"{type(self).__name__} has a score mod but no derivative")
        return s, Float32(1.0)

    def buffer_grads(self, s, b, h, q, kv, args):
        """[(slot, index tuple of Int32, ds'/d buf[index]) for each read of a float buffer
        in `grad_slots`]: the backward scatter-adds dS' times the partial at the index."""
        return []


NO_MODS = ModHook()


class FragmentCoords:
    """Global (q, kv) coordinates of the S-fragment elements a thread holds.

    Built from an identity tensor partitioned exactly like the accumulator, viewed as
    (rows, cols). Column coordinates are split into this thread's offset (runtime) plus
    thread 0's coordinates (compile-time constants) so each column index costs one add.
    """

    def __init__(self, thr_mma, tile_m: int, tile_n: int, acc_mn_view, transposed: bool = False):
        """`transposed`: `acc_mn_view` shows the accumulator's (M, N) tile as (N, M) (the
        backward's swapped layout views its S = Q K^T tile as keys x queries): rows then
        take the N coordinate, columns the M one."""
        ident = cute.make_identity_tensor((tile_m, tile_n))
        self.t_mn = acc_mn_view(thr_mma.partition_C(ident))
        self.t0_mn = acc_mn_view(thr_mma.get_slice(0).partition_C(ident))
        self.tile_m, self.tile_n = tile_m, tile_n
        self._row_mode, self._col_mode = (1, 0) if transposed else (0, 1)
        # Thread 0's coordinates are Python ints: looked up once each (a lookup builds
        # IR and costs ~1.4 ms of tracing; kernels ask for each one several times).
        self._const = {}

    def row(self, r):           # local row of fragment row r
        return self.t_mn[r, 0][self._row_mode]

    def col_offset(self):       # local column of this thread's first element
        return self.t_mn[0, 0][self._col_mode]

    def col0(self, c):          # thread-0 column of fragment column c: a constant
        return self._thread0(0, c, self._col_mode)

    def row0(self, r):          # thread-0 row of fragment row r: a constant
        return self._thread0(r, 0, self._row_mode)

    def col0_vector(self, shape):
        """Thread 0's columns of a fragment row of shape `shape`, as an Int32 vector
        constant (element i: column i)."""
        return int32_vector([self.col0(c) for c in range(cute.size(shape))], shape)

    def _thread0(self, r, c, mode):
        key = (r, c, mode)
        value = self._const.get(key)
        if value is None:
            value = self.t0_mn[r, c][mode]
            if isinstance(value, int):   # only constants: an IR value may not dominate a later use
                self._const[key] = value
        return value


def int32_vector(values, shape) -> cute.TensorSSA:
    """Python ints as an Int32 vector constant of shape `shape` (one `arith.constant`)."""
    import array

    from cutlass._mlir import ir
    from cutlass._mlir.dialects import arith

    ty = ir.VectorType.get([len(values)], Int32.mlir_type)
    return cute.TensorSSA(arith.constant(ty, ir.DenseElementsAttr.get(array.array("i", values), type=ty)),
                          shape, Int32)


def masked_if(cond, s):
    """-inf where `cond`, else `s` (Float32): one `arith.select`. Written as `-inf if cond
    else s` in a jit function, a runtime `cond` becomes an `scf.if` whose branches CuTeDSL
    traces twice (once to infer the result types): ~4 ms of tracing per element, for the
    same code once MLIR has folded the `scf.if` back into a select."""
    return Float32(cutlass.select_(cond, -Float32.inf, s))


def kept_if(keep, s):
    """`s` where `keep`, else -inf (Float32): `s if keep else -inf`, as one select."""
    return Float32(cutlass.select_(keep, s, -Float32.inf))


@cute.jit
def apply_mods(
    s_mn: cute.Tensor,
    coords: FragmentCoords,
    mods: cutlass.Constexpr,
    batch: Int32,
    head: Int32,
    m_block: Int32,
    n_block: Int32,
    seqlen_q: Int32,
    seqlen_k: Int32,
    softmax_scale: Float32,
    args,
    apply_score: cutlass.Constexpr[bool],
    apply_mask: cutlass.Constexpr[bool],
    builtin_causal: cutlass.Constexpr[bool],
    check_kv_bounds: cutlass.Constexpr[bool],
    clamp_kv: cutlass.Constexpr[bool] = False,
    hoist_tile_reads: cutlass.Constexpr[bool] = False,
):
    """Apply score mod, mask, built-in causal mask and the KV_LEN bound to one S tile
    (`s_mn`: this thread's fragment as rows x cols), in place.

    apply_score:     s <- mods.score(s * softmax_scale, ...) (the caller then uses
                     log2(e) alone as the exp2 scale).
    apply_mask:      mods.mask(...) False -> -inf.
    builtin_causal:  q < kv -> -inf (used when the causal config has no mask hook).
    check_kv_bounds: kv >= KV_LEN -> -inf (only the tile that straddles KV_LEN).
    clamp_kv:        the hooks see min(kv, KV_LEN - 1) (implied by check_kv_bounds; for
                     tiles whose bound is applied by a separate bound-only call) —
                     where kv reaches a buffer index (`mods.load_index_vars`).
    hoist_tile_reads: the hooks' reads constant over the tile (`mods.tile_invariants`:
                     at kv // P, P a multiple of the tile) emitted once per row first.
    """
    q_base = m_block * coords.tile_m
    kv_base = n_block * coords.tile_n + coords.col_offset()
    q_last = seqlen_q - 1
    kv_last = seqlen_k - 1
    # kv only where something reads it (e.g. not for softcap alone): 3-4 ops per element
    # of tracing that MLIR would delete again. Clamped only where a buffer index reads it
    # (a document mask, not ALiBi or a sliding window): past KV_LEN the bound masks the
    # element whatever the hooks made of it.
    hook_kv = "kv" in mods.index_vars(apply_score, apply_mask)
    clamp = (clamp_kv or check_kv_bounds) and "kv" in mods.load_index_vars(apply_score, apply_mask)
    affine = hook_kv and not clamp and mods.affine_index("kv", apply_score, apply_mask)
    # Per row: the reads constant over the tile (at the tile's first key, which the clamp
    # leaves as it is: the tile holds a key below KV_LEN), or None.
    tile_values = [None] * cute.size(s_mn.shape[0])
    if const_expr(hoist_tile_reads and (apply_score or apply_mask)):
        for r in cutlass.range_constexpr(cute.size(s_mn.shape[0])):
            q_hook = cutlass.min(q_base + coords.row(r), q_last)
            tile_values[r] = mods.tile_invariants(batch, head, q_hook, n_block * coords.tile_n, coords.tile_n, args,
                                                  score=apply_score, mask=apply_mask)
    if const_expr(mods.rows(apply_score, apply_mask) or not (apply_score or apply_mask)):
        tile = _TileIndices(batch, head, q_base, kv_base, q_last, kv_last, seqlen_k)
        parts = _ModParts(apply_score, apply_mask, builtin_causal, check_kv_bounds, hook_kv, clamp, affine)
        _apply_mods_rows(s_mn, coords, mods, tile, softmax_scale, args, parts, tile_values)
        return
    for r in cutlass.range_constexpr(cute.size(s_mn.shape[0])):
        q = q_base + coords.row(r)
        q_hook = cutlass.min(q, q_last)
        hoisted = {} if const_expr(tile_values[r] is None) else {"tile": tile_values[r]}
        for c in cutlass.range_constexpr(cute.size(s_mn.shape[1])):
            kv = kv_hook = None
            if const_expr(hook_kv or builtin_causal or check_kv_bounds):
                kv = kv_base + coords.col0(c)
                kv_hook = kv
            if const_expr(hook_kv and clamp):
                kv_hook = cutlass.min(kv, kv_last)
            elif const_expr(hook_kv and affine):
                kv_hook = AffineIndex(kv_base, coords.col0(c), scaled=mods.scaled_indices)
            s = s_mn[r, c]
            if const_expr(apply_score):
                s = mods.score(s * softmax_scale, batch, head, q_hook, kv_hook, args, **hoisted)
            if const_expr(apply_mask):
                keep = mods.mask(batch, head, q_hook, kv_hook, args, **hoisted)
                s = kept_if(keep, s)
            if const_expr(builtin_causal):
                s = kept_if(q >= kv, s)
            if const_expr(check_kv_bounds):
                s = kept_if(kv < seqlen_k, s)
            s_mn[r, c] = s



class _TileIndices(NamedTuple):
    """Where an S tile sits: its (batch, head), first query and key, and the bounds."""

    batch: object
    head: object
    q_base: object
    kv_base: object
    q_last: object
    kv_last: object
    seqlen_k: object


class _ModParts(NamedTuple):
    """What one apply_mods call applies (compile-time flags; see apply_mods), and whether
    the hooks read kv (``hook_kv``) and see it clamped to KV_LEN - 1 (``clamp``)."""

    score: bool
    mask: bool
    builtin_causal: bool
    kv_bounds: bool
    hook_kv: bool
    clamp: bool
    affine: bool     # the hooks take kv as an AffineIndex (mods.affine_index; unclamped)


def _apply_mods_rows(s_mn, coords, mods, tile: _TileIndices, softmax_scale, args, parts: _ModParts,
                     tile_values: list):
    """apply_mods a row at a time (hooks with `rows`): the row's scores and kv indices as
    vectors, the hooks called once per row (with row r's `tile_values[r]`, if any)."""
    for r in range(cute.size(s_mn.shape[0])):
        hoisted = {} if tile_values[r] is None else {"tile": tile_values[r]}
        q = tile.q_base + coords.row(r)
        q_hook = cutlass.min(q, tile.q_last)
        s = s_mn[r, None].load()
        kv = kv_hook = None
        if parts.hook_kv or parts.builtin_causal or parts.kv_bounds:
            kv = coords.col0_vector(s.shape) + tile.kv_base
            kv_hook = kv
        if parts.hook_kv and parts.clamp:
            kv_hook = kv.apply_op(cutlass_arith._min, tile.kv_last)
        elif parts.affine:
            offsets = tuple(coords.col0(c) for c in range(cute.size(s.shape)))
            kv_hook = AffineIndex(tile.kv_base, offsets, s.shape, scaled=mods.scaled_indices)

        def kv_at(c):   # element c's kv as per-element emission computes it
            kv_c = tile.kv_base + coords.col0(c)
            return cutlass.min(kv_c, tile.kv_last) if parts.clamp else kv_c
        if parts.score:
            s = mods.score_row(s * softmax_scale, tile.batch, tile.head, q_hook, kv_hook, args, kv_at=kv_at,
                               **hoisted)
        if parts.mask:
            s = kept_where(mods.mask_row(tile.batch, tile.head, q_hook, kv_hook, args, kv_at=kv_at,
                                         shape=s.shape, **hoisted), s)
        if parts.builtin_causal:
            s = kept_where(kv <= q, s)
        if parts.kv_bounds:
            s = kept_where(kv < tile.seqlen_k, s)
        s_mn[r, None].store(s)


def kept_where(keep, s):
    """`s` where `keep` (a Boolean, or a vector of them), else -inf: one select."""
    if not isinstance(keep, cute.TensorSSA):
        keep = cute.full(s.shape, keep, Boolean)
    return cute.where(keep, s, cute.full(s.shape, -Float32.inf, Float32))


def masked_where(cond, s):
    """-inf where `cond` (a vector), else `s`."""
    return cute.where(cond, cute.full(s.shape, -Float32.inf, Float32), s)
