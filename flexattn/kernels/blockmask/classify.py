"""The GPU block-mask builder: tile states of any mask mod, interval analysis first.

One warp classifies 32 consecutive kv tiles of one (batch, head, q block) row. Each lane
runs the mask's interval analysis over its tile (``interval_emit``, a few Float64
instructions; buffer reads scan the indexed span); the tiles it leaves undecided are then
evaluated element by element by the whole warp, one tile at a time, with the mask
emitted inline (``mod_emit``) and an early exit: a tile is *partial* as soon as the warp
has seen an allowed and a masked element. The first step probes a spread 4×8 grid of the
tile (corners included) so diagonal and boundary tiles usually stop there; only tiles
that really are full or empty are read to the end.

States (int8 [B, H, Q_BLOCKS, KV_BLOCKS]: 0 empty, 1 partial, 2 full) go to
``compact`` for the sorted lists. Tiles cut by the sequence end are classified
by their valid elements, as the CPU builder does.

``count_allowed`` compiles a variant without early exit that also counts the attended
(q, kv) pairs (one int64 per tile slot), for ``BlockMask.num_allowed``: exact counting must
read every element of every partial tile, so the plain build does not pay for it.

The mask's captured buffers and scalars are runtime arguments: new values (next step's
document boundaries) reuse the compiled kernel; only the mask's structure, the block size
and the variant are compiled in.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Int32, Int64, const_expr

from flexattn.kernels.emit import interval_emit
from flexattn.kernels.emit.mod_emit import IRModHook

WARPS_PER_CTA = 4
EMPTY, PARTIAL, FULL = 0, 1, 2


class BlockClassifierSm90:
    """``states[b, h, i, j]`` of the mask for tiles of ``q_block × kv_block`` elements."""

    def __init__(self, hook: IRModHook, q_block: int, kv_block: int, count_allowed: bool = False):
        if not hook.has_mask or hook.has_score:
            raise ValueError("the block-mask builder takes a hook with a mask mod and no score mod")
        self.hook = hook
        self.expr = hook._mask.expr
        self.q_block, self.kv_block = int(q_block), int(kv_block)
        self.count_allowed = bool(count_allowed)

    @cute.jit
    def __call__(self, states: cute.Tensor, allowed, q_len: Int32, kv_len: Int32, args, stream):
        """``allowed``: int64 [n_warps * 32], the attended pairs of each lane's tile, when
        ``count_allowed``; else None."""
        n_rows = states.shape[0] * states.shape[1] * states.shape[2]
        n_warps = n_rows * ((states.shape[3] + 31) // 32)
        grid = (n_warps + WARPS_PER_CTA - 1) // WARPS_PER_CTA
        self.kernel(states, allowed, q_len, kv_len, args).launch(
            grid=[grid, 1, 1], block=[WARPS_PER_CTA * 32, 1, 1], stream=stream)

    @cute.kernel
    def kernel(self, states: cute.Tensor, allowed, q_len: Int32, kv_len: Int32, args):
        n_b, n_h, n_q, n_kv = states.shape
        chunks = (n_kv + 31) // 32
        bidx, _, _ = cute.arch.block_idx()
        warp = bidx * WARPS_PER_CTA + cute.arch.warp_idx()
        warp = cute.arch.make_warp_uniform(warp)
        lane = cute.arch.lane_idx()
        if warp < n_b * n_h * n_q * chunks:
            chunk = warp % chunks
            row_id = warp // chunks
            row = row_id % n_q
            h = (row_id // n_q) % n_h
            b = row_id // (n_q * n_h)
            q_lo = row * self.q_block
            q_hi = cutlass.min(q_lo + self.q_block, q_len) - 1
            j = chunk * 32 + lane
            in_range = j < n_kv
            j_c = cutlass.min(j, n_kv - 1)  # lanes past the last tile analyse the last one
            kv_lo = j_c * self.kv_block
            kv_hi = cutlass.min(kv_lo + self.kv_block, kv_len) - 1
            ranges = {"b": (b, b), "h": (h, h), "q": (q_lo, q_hi), "kv": (kv_lo, kv_hi)}
            verdict = interval_emit.classify(self.expr, ranges, args)
            state = Int32(cutlass.select_(verdict == 1, Int32(FULL), Int32(EMPTY)))
            count = Int64(0)  # attended pairs of this lane's tile (count_allowed)
            if const_expr(self.count_allowed):
                area = Int64(q_hi - q_lo + 1) * Int64(kv_hi - kv_lo + 1)
                count = Int64(cutlass.select_(in_range & (verdict == 1), area, Int64(0)))
            todo = cute.arch.vote_ballot_sync(in_range & (verdict == -1))
            for t in cutlass.range(32, unroll=1):
                if (todo >> t) & 1 != 0:  # warp-uniform: the whole warp evaluates tile t
                    t_lo = (chunk * 32 + t) * self.kv_block
                    t_hi = cutlass.min(t_lo + self.kv_block, kv_len) - 1
                    t_state, t_count = self._evaluate_tile(b, h, q_lo, q_hi, t_lo, t_hi, lane, args)
                    if lane == t:  # results are warp-uniform; the tile's lane keeps them
                        state = t_state
                        count = t_count
            if in_range:
                states[b, h, row, j] = cutlass.Int8(state)
            if const_expr(self.count_allowed):
                allowed[warp * 32 + lane] = count

    @cute.jit
    def _evaluate_tile(self, b, h, q_lo, q_hi, kv_lo, kv_hi, lane, args):
        """(state, allowed count) of one tile, evaluated by the warp 32 elements at a time
        (row-major, so buffer reads along kv coalesce). Warp-uniform results."""
        rows = q_hi - q_lo + 1
        cols = kv_hi - kv_lo + 1
        n = rows * cols
        seen_true = Int32(0)
        seen_false = Int32(0)
        count = Int64(0)
        if const_expr(not self.count_allowed):
            # probe a 4x8 grid spread over the tile (corners included) first
            pq = q_lo + ((lane // 8) * (rows - 1)) // 3
            pk = kv_lo + ((lane % 8) * (cols - 1)) // 7
            keep = self.hook.mask(b, h, pq, pk, args)
            seen_true = Int32(cutlass.select_(cute.arch.vote_any_sync(keep), Int32(1), Int32(0)))
            seen_false = Int32(cutlass.select_(cute.arch.vote_any_sync(keep == Boolean(False)), Int32(1), Int32(0)))
        e = Int32(0)
        go = seen_true + seen_false < 2
        while go:
            i = e + lane
            valid = i < n
            i_c = cutlass.min(i, n - 1)  # idle lanes re-read the last element
            r = i_c // cols
            keep_e = self.hook.mask(b, h, q_lo + r, kv_lo + (i_c - r * cols), args)
            allowed_here = valid & keep_e
            masked_here = valid & (keep_e == Boolean(False))
            if cute.arch.vote_any_sync(allowed_here):
                seen_true = Int32(1)
            if cute.arch.vote_any_sync(masked_here):
                seen_false = Int32(1)
            if const_expr(self.count_allowed):
                count += Int64(cute.arch.popc(cute.arch.vote_ballot_sync(allowed_here)))
                e += 32
                go = e < n
            else:
                e += 32
                go = (e < n) & (seen_true + seen_false < 2)
        state = Int32(cutlass.select_(seen_true + seen_false == 2, Int32(PARTIAL),
                                      cutlass.select_(seen_true == 1, Int32(FULL), Int32(EMPTY))))
        return state, count


# ---- host side: compile once per mask structure, launch on the caller's stream ----------

LIST_NAMES = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
              "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")


class GpuBlockMaskBuilder:
    """The compiled classifier (and its counting variant, compiled on first use) of one
    mask structure and block size; ``build`` launches it and the list compaction.

    ``arrays`` (from the adapter) provides ``empty(shape, dtype_name)`` for device arrays,
    ``to_device(x)`` for captured values, ``stream`` (a CUstream handle) and whether
    TVM-FFI launches land on that stream by themselves."""

    def __init__(self, template: IRModHook, q_block: int, kv_block: int, tvm_ffi: bool):
        self.template, self.q_block, self.kv_block, self.tvm_ffi = template, q_block, kv_block, tvm_ffi
        self._fns: dict = {}

    @property
    def num_compiled(self) -> int:
        return len(self._fns)

    def _fn(self, count_allowed: bool):
        from flexattn.kernels.launch.compile_lock import once

        def make():
            from flexattn.kernels.launch import disk_cache
            from flexattn.kernels.launch.compile import compile_classifier

            hook = disk_cache.hook_key(self.template) if self.tvm_ffi else None
            key = None if hook is None else ("blockmask_classifier", hook, self.q_block, self.kv_block, count_allowed)
            return disk_cache.compiled(key, lambda: compile_classifier(
                self.template, self.q_block, self.kv_block, count_allowed, tvm_ffi=self.tvm_ffi))

        return once(self._fns, count_allowed, make)

    def _launch(self, fn, hook, arrays, states, allowed, q_len, kv_len):
        from flexattn.kernels.emit.mod_emit import runtime_args

        if self.tvm_ffi:
            from flexattn.kernels.launch.arguments import ffi_mod_args

            fn(states, allowed, q_len, kv_len, ffi_mod_args(hook, arrays.to_device) or None)
        else:
            import cuda.bindings.driver as cuda

            args = runtime_args(hook, arrays.to_device) or None
            fn(_view(states), None if allowed is None else _view(allowed), Int32(q_len), Int32(kv_len),
               args, cuda.CUstream(arrays.stream))

    def build(self, mask, B: int, H: int, q_len: int, kv_len: int, arrays, separate_full_blocks: bool = True) -> dict:
        """Device arrays ``states`` and the eight lists (``LIST_NAMES``) of ``mask`` (full
        tiles listed as partial unless ``separate_full_blocks``)."""
        n_q, n_kv = -(-q_len // self.q_block), -(-kv_len // self.kv_block)
        states = arrays.empty((B, H, n_q, n_kv), "int8")
        hook = IRModHook(None, mask)
        hook.capture_kinds = self.template.capture_kinds
        self._launch(self._fn(False), hook, arrays, states, None, q_len, kv_len)
        out = compact(states, arrays, self.tvm_ffi, full_as_partial=not separate_full_blocks)
        out["states"] = states
        return out

    def count_allowed(self, mask, B: int, H: int, q_len: int, kv_len: int, arrays):
        """Device int64 [B, H, rows × chunks × 32] of attended-pair counts per tile slot (sum
        the last axis for [B, H]); rewrites identical states into a scratch array."""
        n_q, n_kv = -(-q_len // self.q_block), -(-kv_len // self.kv_block)
        chunks = -(-n_kv // 32)
        states = arrays.empty((B, H, n_q, n_kv), "int8")
        allowed = arrays.empty((B * H * n_q * chunks * 32,), "int64")
        hook = IRModHook(None, mask)
        hook.capture_kinds = self.template.capture_kinds
        self._launch(self._fn(True), hook, arrays, states, allowed, q_len, kv_len)
        return allowed.reshape(B, H, n_q * chunks * 32)


def _view(x):
    from cutlass.cute.runtime import from_dlpack

    t = from_dlpack(x)
    return t.mark_layout_dynamic(leading_dim=len(t.shape) - 1)


_COMPACTORS: dict = {}
_BUILDERS: dict = {}


def compact(states, arrays, tvm_ffi: bool, full_as_partial: bool = False) -> dict:
    """The eight sorted lists (device int32 arrays) of a device states array (full tiles
    listed as partial with ``full_as_partial``)."""
    from flexattn.kernels.launch.compile_lock import once

    def make():
        from flexattn.kernels.launch import disk_cache
        from flexattn.kernels.launch.compile import compile_compactor

        key = (("blockmask_compact",) + (("full_as_partial",) if full_as_partial else ())) if tvm_ffi else None
        return disk_cache.compiled(key, lambda: compile_compactor(tvm_ffi=tvm_ffi, full_as_partial=full_as_partial))

    fn = once(_COMPACTORS, (tvm_ffi, full_as_partial), make)
    B, H, n_q, n_kv = (int(s) for s in states.shape)
    lists = {}
    for side, rows, cols in (("kv", n_q, n_kv), ("q", n_kv, n_q)):
        lists[f"{side}_num_blocks"] = arrays.empty((B, H, rows), "int32")
        lists[f"{side}_indices"] = arrays.empty((B, H, rows, cols), "int32")
        lists[f"full_{side}_num_blocks"] = arrays.empty((B, H, rows), "int32")
        lists[f"full_{side}_indices"] = arrays.empty((B, H, rows, cols), "int32")
    kv = tuple(lists[n] for n in LIST_NAMES[:4])
    q = tuple(lists[n] for n in LIST_NAMES[4:])
    if tvm_ffi:
        fn(states, kv, q)
    else:
        import cuda.bindings.driver as cuda

        fn(_view(states), tuple(map(_view, kv)), tuple(map(_view, q)), cuda.CUstream(arrays.stream))
    return lists


def builder_for(mask, q_block: int, kv_block: int, tvm_ffi: bool) -> GpuBlockMaskBuilder:
    """The cached builder of ``mask``'s structure: new capture values never recompile."""
    from flexattn.kernels.emit.mod_emit import capture_kinds

    probe = IRModHook(None, mask)
    kinds = capture_kinds(probe)
    key = (mask.structure_key, kinds, int(q_block), int(kv_block), bool(tvm_ffi))
    builder = _BUILDERS.get(key)
    if builder is None:
        template = IRModHook(None, mask.with_captures((None,) * len(mask.captures)))
        template.capture_kinds = kinds
        builder = _BUILDERS[key] = GpuBlockMaskBuilder(template, q_block, kv_block, tvm_ffi)
    return builder


def compile_count() -> int:
    """Block-mask kernels compiled in this process (tests: new values never recompile)."""
    return sum(b.num_compiled for b in _BUILDERS.values()) + len(_COMPACTORS)
