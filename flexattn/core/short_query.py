"""Short queries take the decoding kernel, whatever the door.

A torch user decodes by calling ``flex_attention(q, k_cache[:, :, :L], v_cache[:, :, :L])``
with one query token (torch itself switches to its decoding kernel for short queries).
The forward kernel would spend a 128-row tile on that token and read K/V once per query
head; the split-KV decode kernel (``kernels/decode``) packs the query heads that share a
K/V head into one tile (GQA) and splits the keys over the whole GPU. So the core sends a
forward call here when

- the query is short (``SHORT_QUERY_MAX`` tokens, and its GQA group's rows fit the decode
  kernel's two 64-row warpgroups),
- no key row is shorter than the query block (``KV >= Q``),
- the mask is a mask mod (``mask=``, or a block mask built from its mask alone:
  ``BlockMask.from_mask``; the decode kernel skips blocks by analysing the mask itself,
  so lists given by hand keep the forward kernel), any score mod,
- and the adapter supplies the decode kernel's resources (``Device.decode_resources``:
  torch, CuPy) — or, for JAX, whose launches are XLA custom calls, ``xla_path.XlaPlan``
  plans the decode kernel's entry with a fixed launch (``decode_path.fixed_length_launch``).

Queries keep flex_attention's positions (``q_idx`` from 0: ``DecodeMods.true_positions``
False). The forward's outputs and LSE are the same arrays, so a backward that follows
runs unchanged.
"""

from __future__ import annotations

from ..problem.spec import AttentionSpec
from ..problem.validate import AttentionShape
from .kernel_path import DECODE_HEAD_DIMS, KERNEL_DTYPES
from .decode_path import DECODE_MAX_Q_LEN, DecodeMods, DecodeSite, attention_into, attention_plan

# Query tokens up to which the decode kernel serves a forward call. Measured on the H100
# (bench_decode.py --flex, 2026-11-26): see benchmarks/RESULTS.md, "Decode".
SHORT_QUERY_MAX = DECODE_MAX_Q_LEN
_MAX_GROUP_ROWS = 128   # two consumer warpgroups of 64 packed rows


def decode_route(shape: AttentionShape, spec: AttentionSpec, q_dtype: str) -> DecodeMods | None:
    """The decode kernel's mods for this forward call (``q_dtype``: the query's dtype name),
    or None where the forward kernel runs it (float32 among others: the decode kernel is
    16-bit)."""
    if q_dtype not in KERNEL_DTYPES:
        return None
    if shape.q_len > SHORT_QUERY_MAX or shape.kv_len < shape.q_len or shape.group * shape.q_len > _MAX_GROUP_ROWS:
        return None
    if shape.v_head_dim != shape.head_dim or shape.head_dim not in DECODE_HEAD_DIMS:
        return None
    mask = spec.mask
    block_mask = spec.block_mask
    if block_mask is not None:
        if not block_mask.from_mask:
            return None
        mask = block_mask.mask_mod
    if mask is not None and mask.expr.op == "const" and mask.expr.attr is True:
        mask = None
    return DecodeMods(spec.score, mask, spec.resolved_scale(shape.head_dim), true_positions=False)


def _site(device) -> DecodeSite:
    num_sms, workspace = device.decode_resources()
    return DecodeSite(device, num_sms, workspace)


def short_query_into(q, k, v, out, lse, mods: DecodeMods, device) -> None:
    """Run a routed call (``decode_route``) with the decode kernel on ``device``'s stream."""
    attention_into(q, k, v, out, lse, _site(device), mods)


class PreparedShortQuery:
    """A routed call shape ready to launch again: ``kernel_path.prepare_forward`` hands it
    out in place of a ``PreparedForward``, with the same ``launch``. Its decode plan is
    made at the first launch (it needs the arrays) for the device's stream; a launch on
    another stream returns False (the adapter then takes the full path)."""

    __slots__ = ("_mods", "_device", "_run", "_lengths", "_num_sms")

    def __init__(self, mods: DecodeMods, device):
        self._mods, self._device, self._run = mods, device, None

    def launch(self, q, k, v, out, lse, stream: int | None = None):
        if stream is not None and stream != self._device.stream:
            return False
        if self._run is None:
            site = _site(self._device)
            self._run, self._num_sms = attention_plan(q, k, v, out, lse, site, self._mods).run, site.num_sms
            self._lengths = [int(k.shape[2])] * int(q.shape[0])
        self._run(q, k, v, None, out, lse, self._lengths, self._num_sms)
        return True


__all__ = ["SHORT_QUERY_MAX", "PreparedShortQuery", "decode_route", "short_query_into"]
