"""Fake tensors: every kernel's arguments as typed, symbolic-shape stand-ins, for compiling
without values or a GPU (CI compiles every kernel this way; the TVM-FFI runners compile on
them too). Each layout is exactly the one the runners pass — symbolic sizes and outer
strides, last dim contiguous, the same alignment — since a compiled kernel reads its
arguments in the layout it was traced with. One symbol per dim: a repeated symbol would
declare two dims equal (TVM-FFI checks it)."""

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_stream, make_fake_tensor


def fake_tensor(dtype, rank: int, align: int | None, inner: int | None = None, divisibility: int = 1):
    """Symbolic sizes (the last one ``inner`` if given) and outer strides (multiples of
    ``divisibility``), last dim contiguous, ``align``-byte aligned (None: CuTeDSL's default)."""
    shape = tuple(cute.sym_int() for _ in range(rank - 1)) + (inner if inner is not None else cute.sym_int(),)
    stride = tuple(cute.sym_int64(divisibility=divisibility) for _ in range(rank - 1)) + (1,)
    if align is None:
        return make_fake_tensor(dtype, shape, stride)
    return make_fake_tensor(dtype, shape, stride, assumed_align=align)


def fake_stream(tvm_ffi: bool):
    """The stream argument: with ``tvm_ffi``, TVM-FFI's environment stream (the caller
    framework's current stream), else an explicit CUstream."""
    return make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi)


def fake_bhsd(dtype, name: str, sym_b, sym_h, sym_s, head_dim: int):
    """A [B, H, S, D] fake tensor with the given symbolic B/H/S, symbolic strides, D
    contiguous and 16-byte aligned rows (what TMA requires)."""
    elems_16b = 128 // dtype.width
    stride = (cute.sym_int64(divisibility=elems_16b), cute.sym_int64(divisibility=elems_16b),
              cute.sym_int64(divisibility=elems_16b), 1)
    return make_fake_tensor(dtype, (sym_b, sym_h, sym_s, head_dim), stride, assumed_align=16)


def fake_block_lists():
    """BlockMask lists (num_blocks [B, H, rows], indices [B, H, rows, cols], partial then
    full), int32."""
    return (fake_tensor(cutlass.Int32, 3, 4), fake_tensor(cutlass.Int32, 4, 4),
            fake_tensor(cutlass.Int32, 3, 4), fake_tensor(cutlass.Int32, 4, 4))


def _mod_args(mod_args):
    return tuple(mod_args) if mod_args else None   # CuTeDSL cannot pass an empty tuple


# -- forward ---------------------------------------------------------------------------------

def fake_forward_args(cfg, mod_args: tuple = (), tvm_ffi: bool = False):
    """(q, k, v, o, lse, softmax_scale, mod_args, block_sparse, max_scores, stream) for
    ``FlashFwdSm90.__call__``: Q/O and K/V with independent head counts and lengths."""
    dt = cfg.cutlass_dtype
    b, hq, hkv, sq, skv = (cute.sym_int() for _ in range(5))
    if cfg.dtype == "fp32":
        # fp32_operands' layout: Q, K (and V^T) stacked by parts along the batch dim, V^T's
        # keys rounded up to 8, every row 16-byte aligned.
        parts_b = cute.sym_int() if cfg.operand_parts > 1 else b
        q = fake_bhsd(dt, "q", parts_b, hq, sq, cfg.head_dim)
        k = fake_bhsd(dt, "k", parts_b, hkv, skv, cfg.head_dim)
        stride = (cute.sym_int64(divisibility=4), cute.sym_int64(divisibility=4), cute.sym_int64(divisibility=4), 1)
        v = make_fake_tensor(dt, (parts_b, hkv, cfg.head_dim_v, cute.sym_int(divisibility=8)), stride,
                             assumed_align=16)
    else:
        q = fake_bhsd(dt, "q", b, hq, sq, cfg.head_dim)
        k = fake_bhsd(dt, "k", b, hkv, skv, cfg.head_dim)
        v = fake_bhsd(dt, "v", b, hkv, skv, cfg.head_dim_v)
    o = fake_bhsd(dt, "o", b, hq, sq, cfg.head_dim_v)

    def row_stats():   # lse, max_scores: fp32 [B, Hq, Sq], the sequence dim contiguous
        return make_fake_tensor(cutlass.Float32, (b, hq, sq), (cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4)

    lse = row_stats()
    # kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices; the tile tickets' counter
    block_sparse = (fake_block_lists() if cfg.block_sparse else ()) + \
        ((fake_tensor(cutlass.Int32, 1, 4),) if cfg.tile_tickets else ())
    block_sparse = block_sparse or None
    max_scores = row_stats() if cfg.max_scores else None
    return (q, k, v, o, lse, cutlass.Float32(1.0), _mod_args(mod_args), block_sparse, max_scores,
            fake_stream(tvm_ffi))


def fake_fp32_operands_args(cfg, tvm_ffi: bool):
    """(x, out, stream) for ``Fp32Operands.__call__``: x fp32 [B, H, S, D] (any outer
    strides), out contiguous [parts * B, H, D, S8] (transpose) or [2 * B, H, S, D]."""
    b, h, s = (cute.sym_int() for _ in range(3))
    x = make_fake_tensor(cutlass.Float32, (b, h, s, cfg.head_dim), (cute.sym_int64(), cute.sym_int64(), cute.sym_int64(), 1),
                         assumed_align=4)
    out_dims = (cfg.head_dim, cute.sym_int(divisibility=8)) if cfg.transpose else (cute.sym_int(), cfg.head_dim)
    out = make_fake_tensor(cutlass.Float32, (cute.sym_int(), h, *out_dims),
                           (cute.sym_int64(divisibility=4), cute.sym_int64(divisibility=4), cute.sym_int64(divisibility=4), 1),
                           assumed_align=16)
    return x, out, fake_stream(tvm_ffi)


# -- backward --------------------------------------------------------------------------------

def _f32_rows(rank: int):
    """An fp32 workspace with 16-byte aligned rows (TMA reads LSE / D boxes; the runner
    pads rows to q_pad)."""
    return fake_tensor(cutlass.Float32, rank, 16, divisibility=4)


def _lse():
    """The forward's LSE (or its gradient) as the runner passes it: fp32 [B, H, Sq], 4-byte
    aligned (a framework's tensor, not our padded workspace)."""
    return fake_tensor(cutlass.Float32, 3, 4)


def fake_dq_semaphore(cfg):
    return fake_tensor(cutlass.Int32, 3, 4) if cfg.dq_flags else None


def fake_grad_fixed(cfg):
    return fake_tensor(cutlass.Int64, 2, 8) if cfg.deterministic and cfg.buffer_grads else None


def _grads(ranks):
    return tuple(fake_tensor(cutlass.Float32, r, None) for r in ranks)


def fake_grad_args(cfg, mod_args: tuple):
    """fp32 gradient buffers for the score mod's float-buffer captures (same ranks)."""
    if not cfg.buffer_grads:
        return None
    return _grads(len(mod_args[slot].shape) for slot in cfg.mods.grad_slots)


def fake_backward_args(cfg, mod_args: tuple = (), tvm_ffi: bool = False):
    """(q, k, v, do, lse_log2, delta, dq_accum, dq_semaphore, dq, dk, dv, scale, mod_args,
    grad_args, grad_fixed, block_sparse, stream) for ``FlashBwdSm90.__call__``."""
    dt = cfg.cutlass_dtype
    b, hq, hkv, sq, skv = (cute.sym_int() for _ in range(5))
    D, Dv = cfg.head_dim, cfg.head_dim_v
    q, do = fake_bhsd(dt, "q", b, hq, sq, D), fake_bhsd(dt, "do", b, hq, sq, Dv)
    dq = fake_bhsd(dt, "q", b, hq, sq, D) if cfg.dq_finish else None
    k, dk = (fake_bhsd(dt, n, b, hkv, skv, D) for n in ("k", "dk"))
    v, dv = (fake_bhsd(dt, n, b, hkv, skv, Dv) for n in ("v", "dv"))
    # q_num_blocks, q_indices, full_q_num_blocks, full_q_indices (+ the kv-side lists)
    block_sparse = None
    if cfg.block_sparse:
        block_sparse = fake_block_lists() + (fake_block_lists() if cfg.kv_lists else ())
    return (q, k, v, do, _f32_rows(3), _f32_rows(3), _f32_rows(4), fake_dq_semaphore(cfg), dq,
            dk, dv, cutlass.Float32(1.0), _mod_args(mod_args),
            fake_grad_args(cfg, mod_args), fake_grad_fixed(cfg), block_sparse, fake_stream(tvm_ffi))


def fake_preprocess_args(cfg, with_dlse: bool, grad_fixed: bool, tvm_ffi: bool):
    """(o, do, lse, dlse, lse_log2, delta, dq_accum, dq_semaphore, dq, grad_fixed, stream)
    for ``BwdPreprocess.__call__``."""
    b, h, s = (cute.sym_int() for _ in range(3))
    o, do = (fake_bhsd(cfg.cutlass_dtype, n, b, h, s, cfg.head_dim_v) for n in ("o", "do"))
    dq = fake_bhsd(cfg.cutlass_dtype, "q", b, h, s, cfg.head_dim) if cfg.dq_finish else None
    fixed = fake_tensor(cutlass.Int64, 2, 8) if grad_fixed else None
    return (o, do, _lse(), _lse() if with_dlse else None, _f32_rows(3), _f32_rows(3), _f32_rows(4),
            fake_dq_semaphore(cfg), dq, fixed, fake_stream(tvm_ffi))


def fake_postprocess_args(cfg, grad_ranks: tuple, tvm_ffi: bool):
    """(dq_accum, dq, scale, grads, grad_fixed, stream) for ``BwdPostprocess.__call__``."""
    b, h, s = (cute.sym_int() for _ in range(3))
    dq = fake_bhsd(cfg.cutlass_dtype, "dq", b, h, s, cfg.head_dim)
    grads = fixed = None
    if grad_ranks:
        grads = _grads(grad_ranks)
        fixed = fake_tensor(cutlass.Int64, 2, 8)
    return (_f32_rows(4), dq, cutlass.Float32(1.0), grads, fixed, fake_stream(tvm_ffi))


# -- merge of partial results -----------------------------------------------------------------

def fake_merge_args(dtype, head_dim_v: int, tvm_ffi: bool, acc_dtype=cutlass.Float32):
    """(acc, lse, out, lse_j, stream) for ``MergePartial.__call__``: rows 16-byte aligned
    with strides in whole 16-byte units (views of [B, H, S, Dv] arrays along S)."""
    acc = fake_tensor(acc_dtype, 4, 16, head_dim_v, divisibility=128 // acc_dtype.width)
    out = fake_tensor(dtype, 4, 16, head_dim_v, divisibility=128 // dtype.width)
    return (acc, fake_tensor(cutlass.Float32, 3, 4), out, fake_tensor(cutlass.Float32, 3, 4), fake_stream(tvm_ffi))


# -- decode ----------------------------------------------------------------------------------

def fake_decode_args(cfg, mod_args: tuple = (), tvm_ffi: bool = False):
    """(q, k, v, page_table, seq_lens, o, lse, o_part, lse_part, tickets, scale, mod_args,
    stream) for ``DecodeSm90.__call__``: head dim contiguous, 16-byte rows."""
    dt = cfg.cutlass_dtype
    vec = 128 // dt.width
    q, k, v, o = (fake_tensor(dt, 4, 16, cfg.head_dim, vec) for _ in range(4))
    table = fake_tensor(cutlass.Int32, 2, 4) if cfg.paged else None
    seq_lens = fake_tensor(cutlass.Int32, 1, 4)
    lse = fake_tensor(cutlass.Float32, 3, 4)
    o_part = fake_tensor(cutlass.Float32, 5, 16, cfg.head_dim, 4)
    lse_part = fake_tensor(cutlass.Float32, 4, 4)
    tickets = fake_tensor(cutlass.Int32, 1, 4)
    return (q, k, v, table, seq_lens, o, lse, o_part, lse_part, tickets, cutlass.Float32(1.0),
            _mod_args(mod_args), fake_stream(tvm_ffi))


# -- block masks -----------------------------------------------------------------------------

def fake_classifier_args(mod_args: tuple, count_allowed: bool, tvm_ffi: bool):
    """(states, allowed, q_len, kv_len, mod_args, stream) for ``BlockClassifierSm90.__call__``."""
    allowed = fake_tensor(cutlass.Int64, 1, 8) if count_allowed else None
    return (fake_tensor(cutlass.Int8, 4, 1), allowed, cutlass.Int32(1), cutlass.Int32(1), _mod_args(mod_args),
            fake_stream(tvm_ffi))


def fake_compactor_args(tvm_ffi: bool):
    """(states, q-side lists, kv-side lists, stream) for ``BlockListCompactor.__call__``."""
    return (fake_tensor(cutlass.Int8, 4, 1), fake_block_lists(), fake_block_lists(), fake_stream(tvm_ffi))
