"""GPU: flex_attention with a short query runs the decode kernel (core/short_query.py) and
matches the float64 reference at flex_attention's positions: masks, score mods, GQA,
views of a larger preallocated cache, block masks, torch.compile and CuPy."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cutlass")

import flexattn.torch as fa  # noqa: E402
import flexattn.torch.attention as fa_attention  # noqa: E402
import flexattn.torch.ops as fa_ops  # noqa: E402
from flexattn import reference  # noqa: E402
from flexattn.blockmask.layout import as_block_mask  # noqa: E402
from flexattn.core import AttentionSpec, short_query  # noqa: E402

TOL = 2.5e-2


@pytest.fixture
def routed(monkeypatch):
    """Counts the calls that took the decode kernel."""
    calls = []
    real = short_query.attention_into

    def counting(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(short_query, "attention_into", counting)
    return calls


def _mods(name, L):
    if name == "none":
        return None, None
    if name == "causal_lambda":          # flex positions: query 0 sees key 0 only
        return None, lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
    if name == "window_at_end":         # how torch users write a decoding window
        return None, lambda b, h, q_idx, kv_idx: kv_idx >= L - 300 + q_idx
    if name == "softcap_alibi":
        slopes = torch.rand(8, device="cuda")
        return (lambda s, b, h, q_idx, kv_idx: 20.0 * torch.tanh((s + slopes[h] * (kv_idx - q_idx)) / 20.0)), None
    raise ValueError(name)


@pytest.mark.parametrize("name", ["none", "causal_lambda", "window_at_end", "softcap_alibi"])
@pytest.mark.parametrize("q_len, L", [(1, 1), (1, 1000), (3, 4097), (16, 777)])
def test_short_queries_match_the_reference(name, q_len, L, routed):
    torch.manual_seed(q_len * 10007 + L)
    B, Hq, Hkv, D, capacity = 2, 8, 2, 128, 5000
    k_cache = torch.randn(B, Hkv, capacity, D, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(B, Hkv, capacity, D, device="cuda", dtype=torch.bfloat16)
    k, v = k_cache[:, :, :L], v_cache[:, :, :L]   # views of the preallocated cache
    q = torch.randn(B, Hq, q_len, D, device="cuda", dtype=torch.bfloat16)
    score_fn, mask_fn = _mods(name, L)
    block_mask = fa.create_block_mask(mask_fn, None, None, q_len, L, device="cuda") if mask_fn else None
    out, lse = fa.flex_attention(q, k, v, score_mod=score_fn, block_mask=block_mask, enable_gqa=True, return_lse=True)
    assert routed, "the call did not take the decode kernel"
    spec = AttentionSpec.from_args(score_mod=score_fn, mask=mask_fn, enable_gqa=True)
    want_o, want_lse = reference.forward(q.cpu(), k.cpu(), v.cpu(), spec)
    assert np.abs(out.double().cpu().numpy() - want_o).max() < TOL
    alive = ~np.isneginf(want_lse)
    assert np.abs(lse.double().cpu().numpy()[alive] - want_lse[alive]).max() < 5e-3


@pytest.mark.parametrize("D", [32, 80, 96, 192, 256])
def test_short_queries_at_other_head_dims(D, routed):
    """Every multiple of 16 from 32 to 256 takes the decode kernel (strided lane columns
    where D is not a multiple of 32), with a mask and a score mod."""
    torch.manual_seed(D)
    B, Hq, Hkv, q_len, L = 2, 8, 2, 2, 1500
    q = torch.randn(B, Hq, q_len, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    score_fn, mask_fn = _mods("softcap_alibi", L)[0], _mods("window_at_end", L)[1]
    block_mask = fa.create_block_mask(mask_fn, None, None, q_len, L, device="cuda")
    out, lse = fa.flex_attention(q, k, v, score_mod=score_fn, block_mask=block_mask, enable_gqa=True, return_lse=True)
    assert routed, "the call did not take the decode kernel"
    spec = AttentionSpec.from_args(score_mod=score_fn, mask=mask_fn, enable_gqa=True)
    want_o, want_lse = reference.forward(q.cpu(), k.cpu(), v.cpu(), spec)
    assert np.abs(out.double().cpu().numpy() - want_o).max() < TOL
    assert np.abs(lse.double().cpu().numpy() - want_lse).max() < 5e-3


def test_repeated_decoding_loop_and_compile(routed):
    """A torch user's decoding loop (growing views of one cache), eagerly and under
    torch.compile, agrees with the forward kernel's answer for the same call."""
    B, Hq, Hkv, D, capacity = 1, 32, 8, 128, 2048
    k_cache = torch.randn(B, Hkv, capacity, D, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(B, Hkv, capacity, D, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(fa.flex_attention, fullgraph=True)
    for L in (100, 101, 102, 700):
        q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
        k, v = k_cache[:, :, :L], v_cache[:, :, :L]
        eager = fa.flex_attention(q, k, v, enable_gqa=True)
        graph = compiled(q, k, v, enable_gqa=True)
        want, _ = reference.forward(q.cpu(), k.cpu(), v.cpu(), AttentionSpec.from_args(enable_gqa=True))
        assert np.abs(eager.double().cpu().numpy() - want).max() < TOL
        assert np.abs(graph.double().cpu().numpy() - want).max() < TOL
    assert len(routed) >= 8


@pytest.mark.parametrize("spelled", ["functions", "mod_values"])
def test_decode_steps_under_compile(routed, spelled):
    """``fa.decode`` in a compiled step, its mods as torch-style functions (one over per-head
    slopes; through torch's HOP) or as mod values (ALiBi over the slopes, a sliding window;
    our op directly, the lengths its buffers), a contiguous KVCache whose lengths grow in
    place: each step takes the decode kernel through the short-query route and agrees with
    the eager step (the decode kernel over host-read lengths)."""
    from flexattn import mods

    B, Hq, Hkv, D, capacity = 2, 16, 4, 128, 4096
    k = torch.randn(B, Hkv, capacity, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, Hkv, capacity, D, device="cuda", dtype=torch.bfloat16)
    cache = fa.KVCache(k, v, torch.tensor([1000, 3000], device="cuda", dtype=torch.int32))
    slopes = torch.rand(Hq, device="cuda")

    def score(s, b, h, q_idx, kv_idx):
        return s + slopes[h] * (kv_idx - q_idx) * 0.01

    def window(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < 1024

    given = (score, window) if spelled == "functions" else (mods.alibi(slopes * 0.01), mods.sliding_window(1023))

    def step(q, cache):
        return fa.decode(q, cache, score_mod=given[0], mask=given[1], return_lse=True)

    compiled = torch.compile(step, fullgraph=True)
    for _ in range(4):
        q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
        (out, lse), (want, want_lse) = compiled(q, cache), step(q, cache)
        assert (out.float() - want.float()).abs().max().item() < TOL
        assert (lse - want_lse).abs().max().item() < 1e-2
        cache.lengths += 9
    assert len(routed) >= 4


def test_given_block_lists_are_walked_as_listed(routed, monkeypatch):
    """A block mask built by hand (from_kv_blocks: two full blocks, a partial one, two
    empty) over a batch-1 cache: not the mask's own walk (the contiguous route) but the
    listed blocks' (``list_walk_route``: pages of 128 over tiles of 64, the partial page
    masked across both its tiles); the reference agrees."""
    L = 640
    q = torch.randn(1, 4, 1, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 4, L, 128, device="cuda", dtype=torch.bfloat16)
    built = fa.create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx < 300, None, None, 1, L)
    given = type(built).from_kv_blocks(built.kv_num_blocks, built.kv_indices, built.full_kv_num_blocks,
                                       built.full_kv_indices, mask_mod=built.mask_mod, seq_lengths=(1, L))
    walks = []
    real = short_query.list_walk_into
    monkeypatch.setattr(short_query, "list_walk_into", lambda *a: (walks.append(a[3][0].mods.full_but_last),
                                                                   real(*a))[1])
    out = fa.flex_attention(q, k, k, block_mask=given)
    assert not routed and walks == [True]
    want, _ = reference.forward(q.cpu(), k.cpu(), k.cpu(), AttentionSpec.from_args(mask=built.mask_mod))
    assert np.abs(out.double().cpu().numpy() - want).max() < TOL


def test_cupy_short_query(routed):
    cupy = pytest.importorskip("cupy")
    import flexattn.cupy as fc

    rng = np.random.default_rng(0)
    q = cupy.asarray(rng.standard_normal((2, 8, 1, 128)).astype(np.float16))
    k = cupy.asarray(rng.standard_normal((2, 2, 999, 128)).astype(np.float16))
    out, _ = fc.flex_attention(q, k, k, enable_gqa=True)
    assert routed
    want, _ = reference.forward(cupy.asnumpy(q), cupy.asnumpy(k), cupy.asnumpy(k),
                                AttentionSpec.from_args(enable_gqa=True))
    assert np.abs(cupy.asnumpy(out).astype(np.float64) - want).max() < 5e-3


def test_repeated_calls_take_the_prepared_route_and_follow_streams(routed):
    """A repeated routed call is prepared (one plan, its whole step), and a call on another
    stream takes the full path on that stream: the same answer everywhere."""
    from flexattn.core.short_query import PreparedShortQuery

    torch.manual_seed(3)
    q = torch.randn(2, 8, 1, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 1000, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    window = fa.create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx >= 700, None, None, 1, 1000, device="cuda")
    outs = [fa.flex_attention(q, k, v, block_mask=window, enable_gqa=True) for _ in range(4)]
    entries = [e for _, e in fa_attention._PREPARED._entries.values()]
    assert any(isinstance(getattr(e.launch, "__self__", None), PreparedShortQuery) for e in entries)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        other = fa.flex_attention(q, k, v, block_mask=window, enable_gqa=True)
    side.synchronize()
    want, _ = reference.forward(q.cpu(), k.cpu(), v.cpu(), AttentionSpec.from_args(mask=window.mask_mod,
                                                                                    enable_gqa=True))
    for out in outs + [other]:
        assert np.abs(out.double().cpu().numpy() - want).max() < TOL
    assert len(routed) >= 2   # the first two calls took the full path through the route


def _paged_cache(B, Hkv, D, page, n_pages, L, order):
    """torch's PagedAttention over one physical cache [1, Hkv, n_pages x page, D] with L
    positions reserved per sequence (pages handed out in the sequences' ``order``), filled
    from random logical caches k, v [B, Hkv, L, D]: (paged, k_cache, v_cache, k, v)."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention

    paged = PagedAttention(n_pages, page, B, device="cuda")
    for b in order:
        paged.reserve(torch.tensor(b, device="cuda"), torch.tensor(L, device="cuda"))
    k_cache, v_cache = (torch.zeros(1, Hkv, n_pages * page, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = (torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    paged.assign(torch.arange(B, device="cuda"), torch.arange(L, device="cuda")[None].expand(B, L), k, v, k_cache,
                 v_cache)
    return paged, k_cache, v_cache, k, v


@pytest.mark.parametrize("blocks", ["partial", "full"])
def test_torchs_paged_attention_decodes_on_the_decode_kernel(monkeypatch, blocks):
    """torch's PagedAttention as its users decode: one physical cache of batch 1 (pages of
    128 shuffled across sequences), a q_len-1 query per sequence, torch's block mask over
    logical positions converted to physical pages (its mask_mod reads the page map and the
    lengths) — built for the one query (every block listed partial) or over a block of
    rows and cut to one, as gpt-fast does (pages below a length listed full: the kernel
    masks each sequence's last page alone). The key / value batch of 1 broadcasts in place
    and the step walks the listed pages with the decode kernel; the float64 reference of
    the logical caches agrees."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    torch.manual_seed(41)
    B, Hq, Hkv, D, page, n_pages, L = 4, 32, 8, 128, 128, 80, 2048
    lens = torch.tensor([2048, 1000, 129, 1777], device="cuda")
    paged, k_cache, v_cache, k, v = _paged_cache(B, Hkv, D, page, n_pages, L, (2, 0, 3, 1))
    logical = torch_create_block_mask(lambda b, h, qi, ki: ki < lens[b], B, None, page if blocks == "full" else 1, L,
                                      device="cuda", BLOCK_SIZE=page)
    logical.seq_lengths = (1, L)
    physical = paged.convert_logical_block_mask(logical)
    assert (physical.full_kv_num_blocks.sum().item() > 0) == (blocks == "full")
    walks = []
    real = short_query.attention_plan
    monkeypatch.setattr(short_query, "attention_plan",
                        lambda *a: (walks.append((a[-1], a[6].full_but_last)), real(*a))[1])
    host_lens = lens.cpu()
    spec = AttentionSpec.from_args(mask=lambda b, h, qi, ki: ki < host_lens[b], enable_gqa=True)
    for step in range(3):     # the first call plans; repeats launch prepared
        q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
        out, lse = fa.flex_attention(q, k_cache, v_cache, block_mask=physical, enable_gqa=True, return_lse=True)
        want_o, want_lse = reference.forward(q.cpu(), k.cpu(), v.cpu(), spec)
        assert np.abs(out.double().cpu().numpy() - want_o).max() < TOL, step
        assert np.abs(lse.double().cpu().numpy() - want_lse).max() < 5e-3, step
    assert walks and all(w == (page, blocks == "full") for w in walks), walks


def test_torchs_paged_attention_block_mask_converted_every_step():
    """A serving loop converts its block mask every step (``convert_logical_block_mask``:
    a new closure over the PagedAttention object, whose page map and the lengths it reads
    change in place): the conversion's trace is kept across steps (same IR: the walk's
    rewrite and kernel are found again) and every step's output still follows the current
    lengths."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    torch.manual_seed(59)
    B, Hq, Hkv, D, page, n_pages, L = 2, 16, 4, 128, 128, 16, 1024
    lens = torch.tensor([383, 200], device="cuda")
    paged, k_cache, v_cache, k, v = _paged_cache(B, Hkv, D, page, n_pages, L, (1, 0))
    masks = []
    for step in range(4):
        lens += torch.tensor([1, 61], device="cuda")     # in place, as a serving loop's lengths
        logical = torch_create_block_mask(lambda b, h, qi, ki: ki < lens[b], B, None, 1, L, device="cuda",
                                          BLOCK_SIZE=page)
        logical.seq_lengths = (1, L)
        physical = paged.convert_logical_block_mask(logical)
        masks.append(as_block_mask(physical).mask_mod)
        q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
        out = fa.flex_attention(q, k_cache, v_cache, block_mask=physical, enable_gqa=True)
        host_lens = lens.cpu()
        spec = AttentionSpec.from_args(mask=lambda b, h, qi, ki: ki < host_lens[b], enable_gqa=True)
        want, _ = reference.forward(q.cpu(), k.cpu(), v.cpu(), spec)
        assert np.abs(out.double().cpu().numpy() - want).max() < TOL, step
    assert all(m.expr is masks[0].expr for m in masks)


@pytest.mark.parametrize("chunk", [160, 512])
def test_torchs_paged_attention_prefill_chunk(chunk):
    """A prefill chunk through torch's PagedAttention (q_len > 16: the forward kernel over
    the key / value batch of 1 broadcast, the converted block mask's lists and its mask
    reading the page map per key): each sequence's last ``chunk`` queries, causal at their
    true positions (the page map read once per tile and row: ``FwdConfig.hoist_tile_reads``);
    the float64 reference of the logical caches agrees."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    torch.manual_seed(61)
    B, Hq, Hkv, D, page, n_pages, L = 2, 16, 4, 128, 128, 20, 1024
    paged, k_cache, v_cache, k, v = _paged_cache(B, Hkv, D, page, n_pages, L, (1, 0))
    lens = torch.tensor([1024, 700], device="cuda")
    logical = torch_create_block_mask(lambda b, h, qi, ki: (ki <= qi + lens[b] - chunk) & (ki < lens[b]), B, None,
                                      chunk, L, device="cuda", BLOCK_SIZE=page)
    physical = paged.convert_logical_block_mask(logical)
    q = torch.randn(B, Hq, chunk, D, device="cuda", dtype=torch.bfloat16)
    out = fa.flex_attention(q, k_cache, v_cache, block_mask=physical, enable_gqa=True)
    host_lens = lens.cpu()
    spec = AttentionSpec.from_args(mask=lambda b, h, qi, ki: (ki <= qi + host_lens[b] - chunk) & (ki < host_lens[b]),
                                   enable_gqa=True)
    want, _ = reference.forward(q.cpu(), k.cpu(), v.cpu(), spec)
    assert np.abs(out.double().cpu().numpy() - want).max() < TOL


def test_torchs_paged_attention_step_compiled_walks_its_pages(monkeypatch):
    """The same PagedAttention step under torch.compile (default backend), the block mask
    converted inside the compiled step or outside: the broadcast K / V reach our op as
    stride-0 views and the step walks the listed pages; the reference agrees."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    torch.manual_seed(47)
    B, Hq, Hkv, D, page, n_pages, L = 2, 16, 4, 128, 128, 24, 1024
    lens = torch.tensor([1024, 700], device="cuda")
    paged, k_cache, v_cache, k, v = _paged_cache(B, Hkv, D, page, n_pages, L, (1, 0))
    logical = torch_create_block_mask(lambda b, h, qi, ki: ki < lens[b], B, None, page, L, device="cuda",
                                      BLOCK_SIZE=page)
    logical.seq_lengths = (1, L)
    converted = paged.convert_logical_block_mask(logical)
    walks = []
    real = short_query.attention_plan
    monkeypatch.setattr(short_query, "attention_plan", lambda *a: (walks.append(a[-1]), real(*a))[1])
    host_lens = lens.cpu()
    spec = AttentionSpec.from_args(mask=lambda b, h, qi, ki: ki < host_lens[b], enable_gqa=True)
    steps = {
        "outside": lambda q: fa.flex_attention(q, k_cache, v_cache, block_mask=converted, enable_gqa=True),
        "inside": lambda q: fa.flex_attention(q, k_cache, v_cache, block_mask=paged.convert_logical_block_mask(logical),
                                              enable_gqa=True),
    }
    for name, step in steps.items():
        torch._dynamo.reset()
        walks.clear()
        compiled = torch.compile(step, fullgraph=True)
        for _ in range(2):
            q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
            out = compiled(q)
            want, _ = reference.forward(q.cpu(), k.cpu(), v.cpu(), spec)
            assert np.abs(out.double().cpu().numpy() - want).max() < TOL, name
        assert walks, f"{name}: the compiled step did not walk its pages"


def test_gpt_fast_batched_decoding_folds_into_heads(monkeypatch):
    """gpt-fast's decoding step: a batched view of a preallocated cache, a causal block
    mask of batch 1 cut to the current row with its mask_mod moved to the position, a score reading b, h and kv. The walk folds the batch
    into the heads (pages of B x Hkv heads, q / out / LSE as [1, B x Hq, ...]); the float64
    reference agrees, eagerly and on the prepared repeat."""
    from flexattn import mods

    torch.manual_seed(53)
    B, Hq, Hkv, D, capacity, L = 4, 32, 8, 128, 4096, 2048
    cache_k, cache_v = (torch.randn(B, Hkv, capacity, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    k, v = cache_k[:, :, :L], cache_v[:, :, :L]
    full = fa.create_block_mask(lambda b, h, qi, ki: qi >= ki, 1, 1, L, L)
    position = 1500
    offset = torch.tensor(position, device="cuda")
    step = full[:, :, position // 128]
    step.mask_mod = mods.mask_mod(lambda b, h, qi, ki: qi + offset >= ki)
    step.seq_lengths = (1, L)

    def score(s, b, h, qi, ki):
        return s + 0.02 * (b + 1) * ((ki + h) % 9)

    walks = []
    real = short_query.attention_plan
    monkeypatch.setattr(short_query, "attention_plan",
                        lambda *a: (walks.append(tuple(a[0].shape)), real(*a))[1])
    host_offset = position
    spec = AttentionSpec.from_args(score_mod=score, mask=lambda b, h, qi, ki: qi + host_offset >= ki, enable_gqa=True)
    for _ in range(2):
        q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
        out, lse = fa.flex_attention(q, k, v, score_mod=score, block_mask=step, enable_gqa=True, return_lse=True)
        want_o, want_lse = reference.forward(q.cpu(), k.cpu(), v.cpu(), spec)
        assert np.abs(out.double().cpu().numpy() - want_o).max() < TOL
        assert np.abs(lse.double().cpu().numpy() - want_lse).max() < 5e-3
    assert walks and all(shape == (1, B * Hq, 1, D) for shape in walks), walks


@pytest.mark.parametrize("on_gpu,window", [(True, None), (True, 300), (False, None)])
def test_gpt_fast_step_eager_never_waits_for_the_gpu(on_gpu, window, monkeypatch):
    """gpt-fast's decoding step run eagerly with our imports: ``block_mask[:, :, input_pos //
    128]`` slices by a device index (``BlockMask._device_rows``) and the call walks the
    parent's rows on the device (``_row_walk_call``), so after the first step nothing waits
    for the GPU (torch's sync debug mode raises on any wait); a GPU-built and a host-built
    mask, causal and a window (two partial blocks a row); every step agrees with the float64
    reference."""
    import compat_cases

    torch.manual_seed(73)
    B, Hq, Hkv, D, L = 4, 32, 8, 128, 2048
    k_cache, v_cache = (torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lo = (lambda pos: 0) if window is None else (lambda pos: max(0, pos - window))
    fn = (lambda b, h, q, kv: q >= kv) if window is None else (lambda b, h, q, kv: (q >= kv) & (q - kv <= window))
    block_mask = fa.create_block_mask(fn, 1, 1, L, L, device="cuda" if on_gpu else "cpu")
    walks = []
    real = fa_ops._graph_walk_forward
    monkeypatch.setattr(fa_ops, "_graph_walk_forward",
                        lambda *a, **kw: (lambda r: (walks.append(r is not None), r)[1])(real(*a, **kw)))
    step = compat_cases.gpt_fast_decode_step(fa, k_cache, v_cache, L)
    positions = (700, 701, 1500, 2047, 0, 1500)
    qs = [torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16) for _ in positions]
    where = [torch.tensor([pos], device="cuda") for pos in positions]
    outs = []
    with torch.no_grad():
        outs.append(step(qs[0], where[0], block_mask))   # (first: plans, compiles, walks the rows)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            outs += [step(q, pos, block_mask) for q, pos in zip(qs[1:], where[1:])]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert len(walks) == len(positions) and all(walks), "a step did not take the device walk"
    for q, pos, out in zip(qs, positions, outs):
        keys = slice(lo(pos), pos + 1)
        want, _ = reference.forward(q.cpu(), k_cache[:, :, keys].cpu(), v_cache[:, :, keys].cpu(),
                                    AttentionSpec.from_args(enable_gqa=True))
        assert np.abs(out.double().cpu().numpy() - want).max() < TOL, pos


@pytest.mark.parametrize("on_gpu", [True, False])
def test_rows_sliced_by_a_device_index_serve_any_call(on_gpu):
    """A block mask sliced by a device index (``BlockMask._device_rows``) where the device
    walk does not apply — two rows under a chunk of 256 queries, one row under 128 — runs
    the forward kernel over the slice's lists, compacted on the device when read; it
    agrees with the same slice by host indices."""
    torch.manual_seed(79)
    H, D, L = 4, 128, 2048
    fn = lambda b, h, q, kv: (q >= kv) & (q - kv <= 700)   # noqa: E731
    block_mask = fa.create_block_mask(fn, 1, 1, L, L, device="cuda" if on_gpu else "cpu")
    k, v = (torch.randn(2, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for rows, q_len in (([6, 7], 256), ([11], 128)):
        sliced = block_mask[:, :, torch.tensor(rows, device="cuda")]
        assert sliced._row_source is not None
        host = block_mask[:, :, rows]
        q = torch.randn(2, H, q_len, D, device="cuda", dtype=torch.bfloat16)
        offset = rows[0] * 128
        for m in (sliced, host):
            m.mask_mod = lambda b, h, qi, kv: fn(b, h, qi + offset, kv)
            m.seq_lengths = (q_len, L)
        got = fa.flex_attention(q, k, v, block_mask=sliced)
        want = fa.flex_attention(q, k, v, block_mask=host)
        assert (got.float() - want.float()).abs().max().item() < TOL, rows
        np.testing.assert_array_equal(sliced.block_states(), host.block_states())


@pytest.mark.parametrize("mode,window,on_gpu", [("default", None, True), ("default", 300, True),
                                                ("reduce-overhead", None, True), ("default", None, False)])
def test_gpt_fast_step_compiled_with_our_imports(mode, window, on_gpu, monkeypatch):
    """gpt-fast's decoding step with flexattn.torch's create_block_mask and flex_attention,
    compiled as gpt-fast compiles it (fullgraph; inductor, and inductor with CUDA graphs):
    our block mask sliced by ``input_pos // BLOCK_SIZE`` in the graph, its mask_mod moved to
    ``input_pos[0]`` by a closure; the graph walks the row's lists on the device
    (``graph_walk``; a window: two partial blocks a row). Positions change every step (new
    tensor values, no recompile); each step agrees with the float64 reference. A mask built
    on the host (no ``device=``) has its lists copied to the GPU in the graph (with a warning)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    import compat_cases

    torch.manual_seed(71)
    torch._dynamo.reset()
    B, Hq, Hkv, D, L = 4, 32, 8, 128, 2048
    k_cache, v_cache = (torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    if window is None:
        block_mask = fa.create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, L, L, device="cuda" if on_gpu else "cpu")
    else:
        block_mask = fa.create_block_mask(lambda b, h, q, kv: (q >= kv) & (q - kv <= window), 1, 1, L, L,
                                          device="cuda")
    walks = []   # (the first walk may be an eager test's PreparedDeviceWalk of the same call: count launches)
    real = fa_ops._graph_walk_forward
    monkeypatch.setattr(fa_ops, "_graph_walk_forward",
                        lambda *a, **kw: (lambda r: (walks.append(r is not None), r)[1])(real(*a, **kw)))
    decode_one_token = compat_cases.gpt_fast_decode_step(fa, k_cache, v_cache, L)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(decode_one_token, fullgraph=True, backend=counter) if mode == "default" else \
        torch.compile(decode_one_token, fullgraph=True, mode=mode)
    with torch.no_grad():
        for pos in (700, 701, 1500, 1501, 2047, 1500):
            q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16)
            out = compiled(q, torch.tensor([pos], device="cuda"), block_mask).clone()
            lo = 0 if window is None else max(0, pos - window)
            keys = slice(lo, pos + 1)
            want, _ = reference.forward(q.cpu(), k_cache[:, :, keys].cpu(), v_cache[:, :, keys].cpu(),
                                        AttentionSpec.from_args(enable_gqa=True))
            assert np.abs(out.double().cpu().numpy() - want).max() < TOL, pos
    assert walks and all(walks), "the compiled step did not walk the graph's lists on the device"
    if mode == "default":
        assert counter.frame_count == 1
