"""What every runner does with its arguments, from_dlpack or TVM-FFI: DLPack arrays as
dynamic-layout cute views (``to_cute``), the structure of hook args for compile keys
(``arg_signature``), the shape checks the compiled kernels cannot make (block-mask lists,
GQA), and captured values as TVM-FFI call arguments (``ffi_args``)."""

import cutlass
from cutlass.cute.runtime import from_dlpack

from flexattn.kernels.emit.mod_emit import capture_kinds


def to_cute(x, align: int):
    """DLPack array -> cute tensor with dynamic shape/strides (innermost dim contiguous),
    so one compiled kernel serves every size."""
    t = from_dlpack(x, assumed_align=align)
    return t, t.mark_layout_dynamic(leading_dim=len(t.shape) - 1)


def arg_signature(a):
    """Structure of one hook arg for the compile key: kind, dtype, rank (never values)."""
    if isinstance(a, cutlass.Numeric):
        return ("scalar", type(a).__name__)
    return ("tensor", str(a.element_type), len(a.shape))


def check_block_lists(block_sparse, enabled: bool, batch: int, heads: int, rows: int, side: str, row_desc: str):
    """Validate BlockMask lists ``({side}_num_blocks, {side}_indices, full_{side}_num_blocks,
    full_{side}_indices)``: int32, [B|1, H|1, rows] and [B|1, H|1, rows, n]; return their
    dynamic cute views (or None). Indices beyond the sequence are the caller's contract,
    as in torch."""
    if enabled != (block_sparse is not None):
        raise ValueError("pass block_sparse tensors iff the config has block_sparse=True")
    if block_sparse is None:
        return None
    if len(block_sparse) != 4:
        raise ValueError(f"block_sparse = ({side}_num_blocks, {side}_indices, full_{side}_num_blocks, full_{side}_indices)")
    views = [to_cute(x, 4) for x in block_sparse]
    for i, (t, _) in enumerate(views):
        if str(t.element_type) != "Int32":
            raise ValueError(f"block_sparse[{i}]: want int32 of rank {3 + i % 2}")
        check_block_list_shape(i, tuple(t.shape), batch, heads, rows, row_desc)
    return tuple(d for _, d in views)


def check_block_list_shape(i: int, shape: tuple, batch: int, heads: int, rows: int, row_desc: str) -> None:
    """Shape of BlockMask list ``i`` (counts at even positions: [B|1, H|1, rows]; indices at
    odd ones: [B|1, H|1, rows, n >= 1])."""
    if len(shape) != 3 + i % 2:
        raise ValueError(f"block_sparse[{i}]: want int32 of rank {3 + i % 2}")
    if shape[0] not in (1, batch) or shape[1] not in (1, heads) or shape[2] != rows:
        raise ValueError(f"block_sparse[{i}]: shape {shape} does not match B={batch}, H={heads}, {rows} {row_desc}")
    if i % 2 and shape[3] < 1:
        raise ValueError(f"block_sparse[{i}]: empty index list")


def check_q_and_kv_shapes(q_shape: tuple, k_shape: tuple) -> None:
    """[B, Hq, Sq, D] and [B, Hkv, Skv, D]: one batch, Hq a multiple of Hkv, no empty sequence."""
    (b, hq, sq, _), (bk, hk, sk, _) = q_shape, k_shape
    if bk != b or hk == 0 or hq % hk:
        raise ValueError(f"q {q_shape} and k {k_shape}: batch must match and Hq must be a multiple of Hkv")
    if sk < 1 or sq < 1:
        raise ValueError("empty sequences are not supported")


def is_contiguous(t) -> bool:
    """Row-major contiguous (size-1 dims may have any stride)."""
    expect = 1
    for n, st in zip(reversed(tuple(t.shape)), reversed(tuple(t.stride))):
        if n != 1 and st != expect:
            return False
        expect *= n
    return True


def ffi_mod_args(hook, to_device) -> tuple:
    """The hook's captures as TVM-FFI call arguments (see ``FfiForwardRunner``)."""
    return ffi_args(capture_kinds(hook), hook.captures(), to_device)


def ffi_args(kinds: tuple, captures: tuple, to_device) -> tuple:
    """Captured values (kinds from ``capture_kinds``) as TVM-FFI call arguments."""
    out = []
    for kind, value in zip(kinds, captures):
        if kind[0] == "scalar":
            out.append(int(value) if kind[1] == "int32" else float(value))
            continue
        arr = to_device(value)
        out.append(arr.reshape(1) if len(arr.shape) == 0 else arr)
    return tuple(out)


def dlpack_view(x, align: int):
    """The dynamic-layout cute view of a DLPack array (``to_cute``'s second half)."""
    return to_cute(x, align)[1]
