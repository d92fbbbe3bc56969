"""Launch the log-sum-exp merge of a partial result (``merge.partial.MergePartial``): one
compile per (dtype, value head dim, launch path), cached on disk like every kernel."""

from flexattn.arrays import dtype_name
from flexattn.kernels.launch.compile_lock import once

_MERGE_DTYPES = {"bfloat16": "bf16", "float16": "fp16"}
_COMPILED: dict = {}


def merge_partial(acc, lse, out, lse_j, *, tvm_ffi: bool, stream: int) -> None:
    """In place: ``acc`` [B, H, S, Dv] (fp32, or the partial's dtype: the result's own
    rows) / ``lse`` [B, H, S] fp32 become the merge of themselves and the partial ``out``
    (bf16/fp16) / ``lse_j`` (fp32), computed in fp32. Rows ``lse_j`` leaves at -inf are not
    touched; rows ``lse`` holds at -inf take the partial as it is. ``stream``: the CUstream
    handle to launch on (TVM-FFI launches use the framework's)."""
    dtype = _MERGE_DTYPES.get(dtype_name(out))
    acc_dtype = "fp32" if dtype_name(acc) == "float32" else _MERGE_DTYPES.get(dtype_name(acc))
    if dtype is None or acc_dtype not in ("fp32", dtype) or dtype_name(lse) != "float32" \
            or dtype_name(lse_j) != "float32":
        raise TypeError(f"merge_partial takes fp32 lse/lse_j, a bf16/fp16 partial and an fp32 accumulator or one "
                        f"in the partial's dtype, got {dtype_name(acc)}, {dtype_name(lse)}, {dtype_name(out)}, "
                        f"{dtype_name(lse_j)}")
    head_dim_v = int(out.shape[-1])
    key = (dtype, head_dim_v, acc_dtype, tvm_ffi)
    fn = _COMPILED.get(key)
    if fn is None:
        fn = _compiled(key)
    if tvm_ffi:
        fn(acc, lse, out, lse_j)
        return
    import cuda.bindings.driver as cuda

    from flexattn.kernels.launch.arguments import to_cute

    # the alignments the kernel was compiled for (fakes.fake_merge_args)
    views = [to_cute(x, align)[1] for x, align in ((acc, 16), (lse, 4), (out, 16), (lse_j, 4))]
    fn(*views, cuda.CUstream(stream))


def _compiled(key):
    from flexattn.kernels.launch import disk_cache
    from flexattn.kernels.launch.compile import compile_merge

    dtype, head_dim_v, acc_dtype, tvm_ffi = key
    # ranks as threads merge at once: one compile per key
    return once(_COMPILED, key, lambda: disk_cache.compiled(
        ("merge_partial", dtype, head_dim_v, acc_dtype) if tvm_ffi else None,
        lambda: compile_merge(dtype, head_dim_v, acc_dtype=acc_dtype, tvm_ffi=tvm_ffi)))


__all__ = ["merge_partial"]
