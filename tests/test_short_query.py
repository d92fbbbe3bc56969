"""Short queries take the decode kernel (flexattn/core/short_query.py): which forward calls
are routed there, with which mods, and that the route keeps flex_attention's positions."""

import dataclasses

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


def _torch_paged_step(B=3, Hq=8, Hkv=2, D=32, page=16, n_pages=20, L=96, lengths=(40, 96, 17), heads=None,
                      full_blocks=False):
    """torch's PagedAttention step (CPU, float64): q [B, Hq, 1, D], the physical cache
    [1, Hkv, n_pages * page, D] as a stride-0 batch of B (flexattn.torch's broadcast), and
    the converted torch block mask (``full_blocks``: its logical mask built over a block of
    query rows and cut to one, as gpt-fast does, so pages below a length are listed full)."""
    torch = pytest.importorskip("torch")
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    g = torch.Generator().manual_seed(5)
    paged = PagedAttention(n_pages, page, B, device="cpu")
    for b in reversed(range(B)):
        paged.reserve(torch.tensor(b), torch.tensor(L))
    k_cache, v_cache = (torch.zeros(1, Hkv, n_pages * page, D, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, Hkv, L, D, generator=g, dtype=torch.float64) for _ in range(2))
    paged.assign(torch.arange(B), torch.arange(L)[None].expand(B, L), k, v, k_cache, v_cache)
    lens = torch.tensor(lengths)
    logical = torch_create_block_mask(lambda b, h, qi, ki: ki < lens[b], B, heads, page if full_blocks else 1, L,
                                      device="cpu", BLOCK_SIZE=page)
    logical.seq_lengths = (1, L)
    q = torch.randn(B, Hq, 1, D, generator=g, dtype=torch.float64)
    expand = lambda x: x.expand(B, -1, -1, -1)   # noqa: E731
    return q, expand(k_cache), expand(v_cache), paged.convert_logical_block_mask(logical)


@pytest.mark.parametrize("full_blocks", [False, True])
def test_listed_kv_blocks_of_a_shared_cache_walk_as_pages(full_blocks):
    """torch's PagedAttention step takes the decode kernel's paged walk (``list_walk_route``):
    each sequence's listed blocks in its table, the K / V page views, the mods seeing keys
    at their physical positions; where pages below a length are listed full, they come
    first and the mask applies on each sequence's last page alone. Emulated here on the
    host — the walk's keys gathered through the table, its mods evaluated at walk positions
    (the mask where the kernel evaluates it) — it equals the reference of the physical
    call; per-head lists, a batched K / V or more than one row of q blocks keep the forward
    kernel."""
    import flexattn.torch.devices as fa_devices
    from flexattn import reference
    from flexattn.blockmask.layout import as_block_mask
    from flexattn.core import kernel_path
    from flexattn.core.short_query import list_walk_route
    from flexattn.mods.evaluate import evaluate

    q, k, v, physical = _torch_paged_step(full_blocks=full_blocks)
    spec = AttentionSpec.from_args(score_mod=lambda s, b, h, qi, ki: s - 0.01 * ki, block_mask=as_block_mask(physical),
                                   enable_gqa=True)
    B, Hq, _, D = q.shape
    shape = AttentionShape(B, Hq, k.shape[1], 1, k.shape[2], D, D)
    device = kernel_path.Device(0, lambda x: x, decode_resources=lambda: (132, None), page_view=fa_devices._page_view)
    route = list_walk_route(shape, spec, "bfloat16", k, v, device)
    assert route is not None
    walk, k_pages, v_pages = route
    assert walk.block == 16 and not walk.mods.true_positions
    assert walk.lengths == [48, 96, 32]          # listed pages x 16: each sequence's own
    # full pages first, a length's partial last page last: the kernel masks that page alone
    states = spec.block_mask.block_states()[:, 0, 0]
    assert walk.mods.full_but_last == full_blocks
    if full_blocks:
        for b, last in ((0, 2), (2, 1)):
            assert states[b, walk.table[b, last]] == 1 and (states[b, walk.table[b, :last]] == 2).all()
    assert tuple(k_pages.shape) == (20, 16, 2, D)
    again = list_walk_route(shape, spec, "bfloat16", k, v, device)[0]
    assert again is walk                         # made once: a repeated call finds its plan
    # a block mask converted anew (a serving loop's next step): the same rewritten IR, with
    # the new mask's page map and table put in
    q2, k2, v2, physical2 = _torch_paged_step(full_blocks=full_blocks)
    spec2 = AttentionSpec.from_args(score_mod=spec.score, block_mask=as_block_mask(physical2), enable_gqa=True)
    walk2 = list_walk_route(shape, spec2, "bfloat16", k2, v2, device)[0]
    assert walk2.mods.mask.expr is walk.mods.mask.expr
    assert {id(c) for c in walk2.mods.mask.captures} >= {id(c) for c in spec2.block_mask.mask_mod.captures}
    assert any(c is walk2.table for c in walk2.mods.mask.captures)

    want, _ = reference.forward(q, k, v, spec)
    for b in range(B):
        keys = np.arange(walk.lengths[b])
        rows = walk.table[b, keys // 16] * 16 + keys % 16           # physical positions
        kb = k_pages.numpy()[walk.table[b, keys // 16], keys % 16]   # [keys, Hkv, D]
        vb = v_pages.numpy()[walk.table[b, keys // 16], keys % 16]
        np.testing.assert_array_equal(kb, k[b].numpy()[:, rows].transpose(1, 0, 2))
        for h in range(Hq):
            env = {"b": np.int64(b), "h": np.int64(h), "q": np.int64(0), "kv": keys}
            s = q[b, h, 0].numpy() @ kb[:, h // (Hq // 2)].T * walk.mods.scale
            s = evaluate(walk.mods.score_mod.expr, dict(env, score=s), walk.mods.score_mod.captures)
            keep = evaluate(walk.mods.mask.expr, env, walk.mods.mask.captures)
            if walk.mods.full_but_last:     # the kernel's rule: only keys on the last page masked
                keep = keep | (keys < walk.lengths[b] - walk.block)
            p = np.where(keep, np.exp(s - s[keep].max()), 0.0)
            np.testing.assert_allclose(p @ vb[:, h // (Hq // 2)] / p.sum(), want[b, h, 0], rtol=1e-10, atol=1e-12)

    # a sequence that lists no block sees no key: the forward kernel's zeros and -inf LSE
    empty = _torch_paged_step(lengths=(40, 0, 17), full_blocks=full_blocks)[3]
    assert list_walk_route(shape, AttentionSpec.from_args(block_mask=as_block_mask(empty), enable_gqa=True),
                           "bfloat16", k, v, device) is None
    per_head = _torch_paged_step(heads=2)[3]
    assert list_walk_route(shape, AttentionSpec.from_args(block_mask=as_block_mask(per_head), enable_gqa=True),
                           "bfloat16", k, v, device) is not None   # heads that agree still walk
    batched = k.contiguous()
    assert list_walk_route(shape, spec, "bfloat16", batched, batched, device) is None
    assert list_walk_route(shape._replace(q_len=17), spec, "bfloat16", k, v, device) is None
    assert list_walk_route(shape, spec, "float32", k, v, device) is None


def test_batched_caches_fold_into_heads_for_a_shared_block_mask():
    """gpt-fast's decoding step: a batched contiguous cache (a view of a longer one), a
    block mask of batch 1 cut to one row with its mask_mod replaced. The walk folds the
    batch into the heads: q / out / LSE as [1, B x Hq, ...], K / V as pages of B x Hkv
    heads, one table row, the mods seeing each folded head's (b, h). Emulated on the host
    against the reference; a block mask with a batch of its own (the lists may differ per
    sequence) and an adapter without head views keep the forward kernel."""
    torch = pytest.importorskip("torch")
    import flexattn.torch as fa
    import flexattn.torch.devices as fa_devices
    from flexattn import reference
    from flexattn.core import kernel_path
    from flexattn.core.short_query import list_walk_route
    from flexattn.mods.evaluate import evaluate

    B, Hq, Hkv, D, S, block = 3, 8, 2, 32, 96, 16
    g = torch.Generator().manual_seed(8)
    cache_k, cache_v = (torch.randn(B, Hkv, 128, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = cache_k[:, :, :S], cache_v[:, :, :S]          # views of the preallocated cache
    q = torch.randn(B, Hq, 1, D, generator=g, dtype=torch.float64)
    pos = torch.tensor([70, 40, 90])                      # each sequence's current position
    full = fa.create_block_mask(lambda b, h, qi, ki: qi >= ki, 1, 1, S, S, BLOCK_SIZE=block)
    step = full[:, :, 90 // block]
    step.mask_mod = mods.mask_mod(lambda b, h, qi, ki: ki <= pos[b])
    step.seq_lengths = (1, S)
    score = lambda s, b, h, qi, ki: s + 0.1 * b * (ki % 7) - 0.05 * h * (ki % 5)   # noqa: E731  (folded b, h)
    spec = AttentionSpec.from_args(score_mod=score, block_mask=step, enable_gqa=True)
    shape = AttentionShape(B, Hq, Hkv, 1, S, D, D)
    device = kernel_path.Device(0, lambda x: x, decode_resources=lambda: (132, None), page_view=fa_devices._page_view,
                                heads_view=fa_devices._heads_view)
    no_heads = dataclasses.replace(device, heads_view=None)
    assert list_walk_route(shape, spec, "bfloat16", k, v, no_heads) is None
    batched = fa.create_block_mask(lambda b, h, qi, ki: qi >= ki, B, 1, S, S, BLOCK_SIZE=block)[:, :, 90 // block]
    batched.seq_lengths = (1, S)
    per_sequence = AttentionSpec.from_args(score_mod=score, block_mask=batched, enable_gqa=True)
    assert list_walk_route(shape, per_sequence, "bfloat16", k, v, device) is None
    walk, k_pages, v_pages = list_walk_route(shape, spec, "bfloat16", k, v, device)
    assert walk.folded and walk.mods.full_but_last and walk.table.shape[0] == 1 and tuple(k_pages.shape) == (S // block, block, B * Hkv, D)
    q_folded = fa_devices._heads_view(q, True)
    assert tuple(q_folded.shape) == (1, B * Hq, 1, D)

    want, _ = reference.forward(q, k, v, spec)
    keys = np.arange(walk.lengths[0])
    pages = walk.table[0, keys // block]
    for f in range(B * Hq):
        kb = k_pages.numpy()[pages, keys % block, f // (Hq // Hkv)]
        vb = v_pages.numpy()[pages, keys % block, f // (Hq // Hkv)]
        env = {"b": np.int64(0), "h": np.int64(f), "q": np.int64(0), "kv": keys}
        s = q_folded[0, f, 0].numpy() @ kb.T * walk.mods.scale
        s = evaluate(walk.mods.score_mod.expr, dict(env, score=s), walk.mods.score_mod.captures)
        keep = evaluate(walk.mods.mask.expr, env, walk.mods.mask.captures)
        keep = keep | (keys < walk.lengths[0] - block)   # the kernel's rule: pages listed full unmasked
        p = np.where(keep, np.exp(s - s[keep].max()), 0.0)
        np.testing.assert_allclose(p @ vb / p.sum(), want[f // Hq, f % Hq, 0], rtol=1e-10, atol=1e-12)
