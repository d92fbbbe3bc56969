"""Input checks with clear errors, before any work is launched. Framework-neutral."""

from __future__ import annotations

from typing import NamedTuple

from ..arrays import device_type, dtype_name
from . import bounds
from .spec import AttentionSpec

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


class AttentionShape(NamedTuple):
    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    v_head_dim: int

    @property
    def group(self) -> int:
        """Query heads per key/value head (1 without GQA)."""
        return self.q_heads // self.kv_heads


def check_inputs(q, k, v, spec: AttentionSpec) -> AttentionShape:
    """Validate query/key/value against each other and the spec; return their sizes."""
    dims = []
    for name, x in (("query", q), ("key", k), ("value", v)):
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(f"{name} must be an array/tensor, got {type(x).__name__}")
        sizes = tuple(map(int, x.shape))
        if len(sizes) != 4:
            raise ValueError(f"{name} must be 4-D [B, H, S, D], got shape {sizes}")
        if dtype_name(x) not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be a floating tensor ({', '.join(FLOAT_DTYPES)}), got {dtype_name(x)}")
        if 0 in sizes:
            raise ValueError(f"{name} has an empty dimension: shape {sizes}")
        dims.append(sizes)
    if not dtype_name(q) == dtype_name(k) == dtype_name(v):
        raise TypeError(f"query, key and value must share a dtype, got {dtype_name(q)}, {dtype_name(k)}, {dtype_name(v)}")
    dev_q, dev_k, dev_v = device_type(q), device_type(k), device_type(v)
    if not dev_q == dev_k == dev_v:
        raise ValueError(f"query, key and value must be on one device, got {sorted({dev_q, dev_k, dev_v})}")
    (B, Hq, Sq, D), (Bk, Hk, Sk, Dk), (Bv, Hv, Sv, Dv) = dims
    if not B == Bk == Bv:
        raise ValueError(f"batch sizes differ: query {B}, key {Bk}, value {Bv} (flexattn.torch broadcasts a key /"
                         " value batch of 1, as torch does)")
    if Hk != Hv:
        raise ValueError(f"key and value must have the same number of heads, got {Hk} and {Hv}")
    if Sk != Sv:
        raise ValueError(f"key and value must have the same sequence length, got {Sk} and {Sv}")
    if D != Dk:
        raise ValueError(f"query and key head dims differ: {D} and {Dk}")
    if Hq != Hk:
        if not spec.enable_gqa:
            raise ValueError(
                f"query has {Hq} heads but key/value have {Hk}: pass enable_gqa=True for grouped-query attention"
            )
        if Hq % Hk:
            raise ValueError(f"with enable_gqa, query heads ({Hq}) must be a multiple of key/value heads ({Hk})")
    shape = AttentionShape(B, Hq, Hk, Sq, Sk, D, Dv)
    if spec.block_mask is not None:
        _check_block_mask(spec.block_mask, shape)
    if bounds.enabled():   # the debug mode: every captured-tensor read in range
        bounds.check_capture_reads(spec, shape)
    return shape


def _check_block_mask(bm, shape: AttentionShape):
    bb, bh, bq, bkv = bm.shape
    if (bq, bkv) != (shape.q_len, shape.kv_len):
        raise ValueError(
            f"block_mask was built for Q_LEN={bq}, KV_LEN={bkv} but the inputs have"
            f" Q_LEN={shape.q_len}, KV_LEN={shape.kv_len}: build it for these lengths, or adjust it"
            f" (block_mask._adjust({shape.q_len}, {shape.kv_len}), as torch's)"
        )
    # Lists with other block counts than the lengths need (from_kv_blocks with its own
    # seq_lengths, a slice) would make the kernels read rows past their ends or visit
    # tiles past the keys: an error here, before any launch.
    (qb, kvb), grid = bm.BLOCK_SIZE, bm.num_blocks
    need = (-(-shape.q_len // qb), -(-shape.kv_len // kvb))
    if grid != need:
        raise ValueError(
            f"block_mask lists {grid[0]} x {grid[1]} blocks of {qb} x {kvb}, but Q_LEN={shape.q_len},"
            f" KV_LEN={shape.kv_len} need {need[0]} x {need[1]}: build it for these lengths (or"
            " block_mask._adjust(Q_LEN, KV_LEN))")
    if bb not in (1, shape.batch):
        raise ValueError(f"block_mask batch size {bb} must be 1 or {shape.batch}")
    if bh not in (1, shape.q_heads):
        raise ValueError(f"block_mask head count {bh} must be 1 or the number of query heads {shape.q_heads}")
