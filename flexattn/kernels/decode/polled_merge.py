"""The polled merge of a decode step's splits: partials that mark themselves written.

The ticket merge (decode/sm90.py) puts a chain on the step's critical path after the
last split's stream: its partial stores, a CTA barrier, a GPU-scope release (the stores
acknowledged), the ticket's atomic round trip, then the merging CTA's loads of every
partial, ~1.2 + 1.9 µs on the H200 (benchmarks/decode_timeline.py). Here the partial
slots themselves say whether they are written, so nothing waits for a fence or a ticket:

* Every slot a launch uses holds the bits 0 (``EMPTY``) when it starts: the memory is
  allocated zeroed, and either each merge zeroes the slots it read (``empty``, the
  workspace's shared slots) or, with parity slots (``DecodeConfig.parity_slots``, the
  default where the plan has memory of its own), the launches alternate between two sets
  and each zeroes the other set's slots outside the merger's path (decode/sm90.py).
* A split stores each value with a relaxed GPU-scope store, +0.0 as -0.0 (the same
  number to every use the merge makes of it), so a written slot is never all-zero bits.
* One CTA per group merges: the split that started last (a relaxed ticket taken at the
  CTA's start, long before its stream ends, so off the critical path; every other split
  of its group has started, and none of them waits for anything, so the merger's wait
  ends whatever order the hardware places CTAs in). It polls each slot it needs with
  relaxed GPU-scope loads until none reads ``EMPTY``: every load checks its own value, so
  no ordering between slots is needed, and the last partial costs about one L2 round trip
  after its stores land. A poll that has not seen every slot after ``POLL_LIMIT`` rounds
  (seconds) traps: a bug, not a hang.

Each lane of a merging warp owns D/32 contiguous columns of a row (``lane_columns``), lane
s the LSE of split s (so at most 32 splits: ``MAX_SPLITS``); the arithmetic is
``combine.merge_splits``'.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from flexattn.kernels.decode.combine import LOG2_E, inverse_and_lse, log2_shift
from flexattn.kernels.hopper.atomics import _f32_to_address, trap

EMPTY = 0            # the bits of a slot no split has written since the last merge
MAX_SPLITS = 32      # one LSE per lane
POLL_LIMIT = 1 << 22  # rounds of loads (each at least an L2 round trip) before a trap
CHUNK_FLOATS = 64    # partial values a lane has in flight per round (16 splits at D 128)


@dsl_user_op
def store_marked_f32(ptr, value, *, loc=None, ip=None) -> None:
    """``*ptr = value`` (global fp32) as a relaxed GPU-scope store, +0.0 stored as -0.0: a
    written slot never holds ``EMPTY``'s bits."""
    _f32_to_address("{ .reg .b32 t; .reg .pred z; mov.b32 t, $1; setp.eq.b32 z, t, 0; @z mov.b32 t, 0x80000000; "
                    "st.relaxed.gpu.global.b32 [$0], t; }", "l", ptr, value, loc, ip)


@dsl_user_op
def load_marked_f32s(ptr, n: int, *, loc=None, ip=None):
    """``n`` (1, 2 or 4) consecutive global fp32 at ``ptr`` (aligned to 4n bytes) by one
    relaxed GPU-scope load -> (their values, Int32 1 if none holds ``EMPTY``'s bits else 0)."""
    assert n in (1, 2, 4), n
    regs = [f"t{i}" for i in range(n)]
    width = "" if n == 1 else f".v{n}"
    dest = regs[0] if n == 1 else "{" + ", ".join(regs) + "}"
    least = "m"
    body = [f"ld.relaxed.gpu.global{width}.b32 {dest}, [${n + 1}];"]
    body += [f"mov.b32 ${i}, t{i};" for i in range(n)]
    if n == 1:
        least = "t0"
    else:
        body.append("min.u32 m, t0, t1;")
        body += [f"min.u32 m, m, t{i};" for i in range(2, n)]
    body.append(f"setp.ne.u32 p, {least}, 0; selp.u32 ${n}, 1, 0, p;")
    asm = "{ .reg .b32 " + ", ".join(regs + ["m"]) + "; .reg .pred p; " + " ".join(body) + " }"
    res = llvm.inline_asm(
        llvm.StructType.get_literal([T.f32()] * n + [T.i32()]),
        [ptr.toint(loc=loc, ip=ip).ir_value()],
        asm,
        ",".join(["=f"] * n + ["=r", "l"]),
        has_side_effects=True,
        is_align_stack=False,
        asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    values = [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(n)]
    return values, Int32(llvm.extractvalue(T.i32(), res, [n], loc=loc, ip=ip))


def _vector_width(per_lane: int) -> int:
    return 4 if per_lane % 4 == 0 else 2 if per_lane % 2 == 0 else 1


def chunk_splits(head_dim: int) -> int:
    """Splits whose partial columns a lane loads per polling round."""
    return max(1, min(16, CHUNK_FLOATS // (head_dim // 32)))


@cute.jit
def _load_chunk(vals: cute.Tensor, o_parts: cute.Tensor, s0, num_splits, lane: Int32,
                head_dim: cutlass.Constexpr[int], chunk: cutlass.Constexpr[int]) -> Int32:
    """This lane's columns of splits s0 .. s0 + chunk - 1 (clamped to the last split) into
    ``vals`` (chunk x per_lane, flat) -> 1 if every slot read was written, else 0."""
    per_lane = head_dim // 32
    width = _vector_width(per_lane)
    ok = Int32(1)
    for j in cutlass.range_constexpr(chunk):
        row = o_parts[cutlass.min(s0 + j, num_splits - 1), None]
        cols = cute.local_tile(row, (per_lane,), (lane,))
        for v in cutlass.range_constexpr(per_lane // width):
            xs, written = load_marked_f32s(cols.iterator + v * width, width)
            for i in cutlass.range_constexpr(width):
                vals[j * per_lane + v * width + i] = xs[i]
            ok = ok & written
    return ok


@cute.jit
def _count_round(rounds: Int32) -> Int32:
    rounds = rounds + 1
    if rounds > POLL_LIMIT:
        trap()
    return rounds


@cute.jit
def merge_polled_splits(lse_parts: cute.Tensor, o_parts: cute.Tensor, out_row: cute.Tensor, lane: Int32,
                        head_dim: cutlass.Constexpr[int], probe=None, probing=None,
                        empty: cutlass.Constexpr[bool] = True, chunk: cutlass.Constexpr[int] = 0) -> Float32:
    """One warp merges one row once every split has written it: ``lse_parts`` [splits]
    and ``o_parts`` [splits, D] (fp32 slots, ``EMPTY`` until written) into ``out_row`` [D]
    (each lane its D/32 columns, in out_row's dtype), then empties the slots it read;
    returns the row's natural-log LSE (-inf: no split saw a key). D a multiple of 32, at
    most ``MAX_SPLITS`` splits.

    The first round's loads (every LSE, the first chunk of partials) are in flight
    together: where every split has written, the merge costs one L2 round trip.
    ``chunk``: the splits of that first chunk (0: ``chunk_splits(head_dim)``, past the
    split count clamped to the last split). A chunk of exactly the launch's split count
    loads nothing twice: on the H200 the clamped duplicates of 13 splits in a chunk of 16
    cost ~0.2 µs of the B1 L128k window step (docs/experiments.md, session 71).

    ``probe`` (the decode timeline's, or None): where ``probing`` holds, lane 0 stores at
    ``probe[0]`` the %globaltimer_lo at which the first chunk was seen written, at
    ``probe[1]`` the rounds it took, at ``probe[3]`` the time the merged row was stored
    (before the slots are emptied). ``empty`` False (benchmarks: ``DecodeConfig.
    caller_empties_slots``): the slots are left written, for the caller to zero."""
    per_lane = head_dim // 32
    chunk = chunk or chunk_splits(head_dim)
    num_splits = cute.size(lse_parts.shape)
    vals = cute.make_rmem_tensor(chunk * per_lane, Float32)
    lse_s = -Float32.inf     # lane s: split s's LSE
    ready = Int32(0)
    rounds = Int32(0)
    while ready == 0:
        ok = _load_chunk(vals, o_parts, Int32(0), num_splits, lane, head_dim, chunk)
        if lane < num_splits:
            xs, written = load_marked_f32s(lse_parts.iterator + cute.crd2idx(lane, lse_parts.layout), 1)
            lse_s = xs[0]
            ok = ok & written
        ready = ok
        rounds = _count_round(rounds)
    if const_expr(probe is not None):
        if probing:
            if lane == 0:
                probe.store(Int32(cute.arch.globaltimer_lo()))
                (probe + 1).store(rounds)
    # (every lane leaves its own loop; the warp's shuffles below wait for all of them)
    m = cute.arch.warp_reduction_max(lse_s)
    m_safe = log2_shift(m)
    w = cute.math.exp2(lse_s * Float32(LOG2_E) - m_safe, fastmath=True)   # lanes >= splits: 0
    total = cute.arch.warp_reduction_sum(w)
    acc = cute.make_rmem_tensor(per_lane, Float32)
    acc.fill(0.0)
    for j in cutlass.range_constexpr(chunk):
        w_j = cute.arch.shuffle_sync(w, j)   # clamped duplicates past the last split: lane j's w = 0
        for i in cutlass.range_constexpr(per_lane):
            acc[i] = acc[i] + w_j * vals[j * per_lane + i]
    for s0 in cutlass.range(chunk, num_splits, chunk, unroll=1):
        ready = Int32(0)
        while ready == 0:
            ready = _load_chunk(vals, o_parts, s0, num_splits, lane, head_dim, chunk)
            rounds = _count_round(rounds)
        for j in cutlass.range_constexpr(chunk):
            s = s0 + j
            w_j = cutlass.select_(s < num_splits, cute.arch.shuffle_sync(w, cutlass.min(s, MAX_SPLITS - 1)),
                                  Float32(0.0))
            for i in cutlass.range_constexpr(per_lane):
                acc[i] = acc[i] + w_j * vals[j * per_lane + i]
    inv, lse = inverse_and_lse(m, total)
    out = cute.local_tile(out_row, (per_lane,), (lane,))
    out.store((acc.load() * inv).to(out_row.element_type))
    if const_expr(probe is not None):
        if probing:
            if lane == 0:
                (probe + 3).store(Int32(cute.arch.globaltimer_lo()))
    if const_expr(empty):
        # Empty what this lane read, for the next step (stream order publishes it).
        for s in cutlass.range(num_splits, unroll=1):
            zero_lane_columns(o_parts[s, None], lane, head_dim)
        if lane < num_splits:
            lse_parts[lane] = Float32(0.0)
    return lse


@cute.jit
def zero_lane_columns(row: cute.Tensor, lane: Int32, head_dim: cutlass.Constexpr[int]) -> None:
    """Store zeros (``EMPTY``) over lane ``lane``'s D/32 contiguous columns of a slot's
    ``row`` [D] (``lane_columns``' split of a row): a slot made empty again."""
    per_lane = head_dim // 32
    zeros = cute.make_rmem_tensor(per_lane, Float32)
    zeros.fill(0.0)
    cute.local_tile(row, (per_lane,), (lane,)).store(zeros.load())


__all__ = ["EMPTY", "MAX_SPLITS", "store_marked_f32", "load_marked_f32s", "merge_polled_splits", "chunk_splits",
           "zero_lane_columns"]
