"""Short queries take the decode kernel (flexattn/core/short_query.py): which forward calls
are routed there, with which mods, and that the route keeps flex_attention's positions."""

import numpy as np
import pytest

from flexattn import create_block_mask, mods
from flexattn.core import AttentionSpec
from flexattn.core.short_query import SHORT_QUERY_MAX, decode_route
from flexattn.problem.validate import AttentionShape


def _shape(q_len=1, kv_len=4096, q_heads=32, kv_heads=8, d=128, dv=128, batch=2):
    return AttentionShape(batch, q_heads, kv_heads, q_len, kv_len, d, dv)


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def test_short_queries_with_mods_are_routed_at_flex_positions():
    spec = AttentionSpec.from_args(score_mod=lambda s, b, h, q, kv: s * 0.5, mask=_causal, enable_gqa=True)
    route = decode_route(_shape(), spec, "bfloat16")
    assert route is not None and not route.true_positions
    assert route.score_mod is spec.score and route.mask is spec.mask
    assert route.scale == pytest.approx(1 / np.sqrt(128))


@pytest.mark.parametrize("shape", [
    _shape(q_len=SHORT_QUERY_MAX + 1),           # a prefill block: the forward kernel
    _shape(q_len=8, kv_len=4),                   # keys shorter than the queries
    _shape(q_len=16, q_heads=128, kv_heads=8),   # 16 heads x 16 rows: more than two warpgroups
    _shape(dv=64),                               # value head dim != query head dim
])
def test_what_stays_on_the_forward_kernel(shape):
    assert decode_route(shape, AttentionSpec.from_args(enable_gqa=True), "bfloat16") is None


def test_float32_stays_on_the_forward_kernel():   # the decode kernel is 16-bit
    assert decode_route(_shape(), AttentionSpec.from_args(enable_gqa=True), "float32") is None


def test_block_masks_route_only_when_built_from_their_mask():
    built = create_block_mask(_causal, None, None, 1, 4096)
    route = decode_route(_shape(), AttentionSpec.from_args(block_mask=built, enable_gqa=True), "bfloat16")
    assert route is not None and route.mask is built.mask_mod
    given = type(built).from_kv_blocks(built.kv_num_blocks, built.kv_indices, mask_mod=_causal,
                                       seq_lengths=(1, 4096))
    assert decode_route(_shape(), AttentionSpec.from_args(block_mask=given, enable_gqa=True), "bfloat16") is None
    full = create_block_mask(None, None, None, 1, 4096)
    assert decode_route(_shape(), AttentionSpec.from_args(block_mask=full, enable_gqa=True), "bfloat16").mask is None


def test_forward_into_routes_when_the_device_offers_decode_resources(monkeypatch):
    from flexattn.core import kernel_path, short_query

    calls = []
    monkeypatch.setattr(short_query, "attention_into", lambda *a: calls.append(a))
    q, k = np.zeros((2, 32, 1, 128), np.float16), np.zeros((2, 8, 4096, 128), np.float16)
    spec = AttentionSpec.from_args(mask=mods.causal(), enable_gqa=True)
    shape = _shape()
    with_resources = kernel_path.Device(0, lambda x: x, decode_resources=lambda: (132, "workspace"))
    assert kernel_path.forward_into(q, k, k, None, None, shape, spec, with_resources) is None
    site, mods_ = calls[0][5], calls[0][6]
    assert site.num_sms == 132 and site.workspace == "workspace" and not mods_.true_positions
    monkeypatch.setattr(kernel_path, "plan_forward", lambda *a: (_ for _ in ()).throw(RuntimeError("forward")))
    with pytest.raises(RuntimeError, match="forward"):   # no resources: the forward kernel
        kernel_path.forward_into(q, k, k, None, None, shape, spec, kernel_path.Device(0, lambda x: x))
