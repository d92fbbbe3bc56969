"""Launch the sm90 forward on DLPack arrays: validate, compile once per structure, run.

The compiled kernel performs no argument checks (a float32 tensor passed for a bf16
slot is silently misread), so everything the kernel assumes is checked here.
Framework-free: arrays come in through DLPack, the stream as a raw CUstream handle.
"""

import flexattn.kernels  # noqa: F401  (sets CUTE_DSL_ARCH before cutlass loads)
from flexattn.kernels.launch.compile import ARCH_OPTION, pipeline_options
from flexattn.kernels.fwd.sm90 import FlashFwdSm90, FwdConfig

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import from_dlpack


def _to_cute(x, align: int):
    """DLPack array -> cute tensor with dynamic shape/strides (innermost dim contiguous),
    so one compiled kernel serves every size."""
    t = from_dlpack(x, assumed_align=align)
    return t, t.mark_layout_dynamic(leading_dim=len(t.shape) - 1)


def _arg_signature(a):
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
    views = [_to_cute(x, 4) for x in block_sparse]
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


class ForwardRunner:
    """`run(q, k, v, o, lse, softmax_scale, mod_args, stream)`; q/o [B,Hq,Sq,D],
    k/v [B,Hkv,Skv,D] of cfg.dtype, lse float32 [B,Hq,Sq]. mod_args: tuple of cute
    values (use `hook_tensor` / cutlass.Float32 / cutlass.Int32). The first call for a
    given (config, hook-arg structure) compiles; `last_compile_seconds` records it."""

    def __init__(self, cfg: FwdConfig):
        self.cfg = cfg
        self._compiled = {}
        self.last_compile_seconds = 0.0

    @staticmethod
    def hook_tensor(x):
        """A captured buffer for a hook: any DLPack array, dynamic shape."""
        from flexattn.kernels.emit.mod_emit import buffer_arg

        return buffer_arg(x)

    def _check(self, q, k, v, o, lse):
        cfg = self.cfg
        want = str(cfg.cutlass_dtype)
        for name, t in (("q", q), ("k", k), ("v", v), ("o", o)):
            if str(t.element_type) != want:
                raise TypeError(f"{name}: dtype {t.element_type}, kernel compiled for {want}")
            if len(t.shape) != 4 or t.shape[3] != cfg.head_dim:
                raise ValueError(f"{name}: want [B, H, S, {cfg.head_dim}], got {tuple(t.shape)}")
            if t.stride[3] != 1 and t.shape[3] != 1:
                raise ValueError(f"{name}: the head dim must be contiguous")
            if any(s % 8 for s in t.stride[:3]):
                raise ValueError(f"{name}: strides must be multiples of 8 elements (TMA)")
        if str(lse.element_type) != "Float32" or tuple(lse.shape) != tuple(q.shape[:3]):
            raise ValueError("lse: want float32 [B, Hq, Sq]")
        if lse.stride[2] != 1:
            raise ValueError("lse: the sequence dim must be contiguous")
        (b, hq, sq, _), (bk, hk, sk, _) = q.shape, k.shape
        if tuple(k.shape) != tuple(v.shape) or tuple(o.shape) != tuple(q.shape) or bk != b:
            raise ValueError(f"shape mismatch q{tuple(q.shape)} k{tuple(k.shape)} "
                             f"v{tuple(v.shape)} o{tuple(o.shape)}")
        if hk == 0 or hq % hk:
            raise ValueError(f"Hq={hq} must be a multiple of Hkv={hk}")
        if sk < 1 or sq < 1:
            raise ValueError("empty sequences are not supported")
        if not cfg.cluster_fits(sq):
            raise ValueError(f"cluster_m={cfg.cluster_m} needs a multiple of {cfg.cluster_m} q tiles of "
                             f"{cfg.tile_m} rows per head, got Sq={sq}")

    def _check_block_sparse(self, q, k, block_sparse):
        (B, Hq, Sq, _) = q.shape
        return check_block_lists(block_sparse, self.cfg.block_sparse, B, Hq, -(-Sq // self.cfg.tile_m),
                                 "kv", f"q-blocks of {self.cfg.tile_m}")

    def bind(self, q, k, v, o, lse, softmax_scale: float, mod_args: tuple, stream: int,
             block_sparse=None):
        """Validate and compile once; return a no-argument launcher for these buffers
        (keeps DLPack conversion and checks out of timed loops). `block_sparse`:
        (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices) as DLPack int32
        arrays, block size tile_m x tile_n, iff cfg.block_sparse."""
        import time

        views = [_to_cute(x, 16) for x in (q, k, v, o)] + [_to_cute(lse, 4)]
        self._check(*(s for s, _ in views))
        bs = self._check_block_sparse(views[0][0], views[1][0], block_sparse)
        dyn = [d for _, d in views]
        args = tuple(mod_args) if mod_args else None
        scale = cutlass.Float32(softmax_scale)
        cu_stream = cuda.CUstream(stream)
        key = tuple(_arg_signature(a) for a in mod_args or ())
        fn = self._compiled.get(key)
        if fn is None:
            t0 = time.perf_counter()
            # Compile on these very (dynamic-layout) tensors: the compiled function reads
            # its arguments in the layout it was traced with, and checks none of them.
            with pipeline_options():
                fn = cute.compile(FlashFwdSm90(self.cfg), *dyn, scale, args, bs, cu_stream,
                                  options=ARCH_OPTION)
            self.last_compile_seconds = time.perf_counter() - t0
            self._compiled[key] = fn
        return lambda: fn(*dyn, scale, args, bs, cu_stream)

    @property
    def num_compiled(self) -> int:
        """Kernels compiled by this runner (one per hook-arg structure)."""
        return len(self._compiled)

    def run(self, q, k, v, o, lse, softmax_scale: float, mod_args: tuple, stream: int,
            block_sparse=None):
        self.bind(q, k, v, o, lse, softmax_scale, mod_args, stream, block_sparse)()
