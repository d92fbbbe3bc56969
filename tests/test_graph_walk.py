"""torch.compile: a short query whose block mask the graph sliced walks its lists on the
device (flexattn/torch/graph_walk.py, core.short_query.device_walk_into) — the table the
graph builds, the compiled graph's op inputs, and the decode kernel's reading of them,
emulated on the host against the float64 reference."""

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import flexattn.torch as fa  # noqa: E402
import flexattn.torch.devices as fa_devices  # noqa: E402
import flexattn.torch.ops as fa_ops  # noqa: E402
from flexattn import mods, reference  # noqa: E402
from flexattn.core import AttentionSpec, kernel_path, short_query  # noqa: E402
from flexattn.problem.validate import AttentionShape  # noqa: E402
from flexattn.problem.spec import OPERAND  # noqa: E402
from flexattn.torch.graph_walk import lists_of_walk, walk_lists  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))


def _masks(L):
    return {
        "causal": lambda b, h, q, kv: q >= kv,
        "window": lambda b, h, q, kv: (q >= kv) & (q - kv <= 200),   # two partial blocks a row
        "dilated": lambda b, h, q, kv: (q >= kv) & ((q - kv) % 3 != 1),  # every block partial
        "per_batch": lambda b, h, q, kv: kv <= (b + 1) * L // 4,
    }


@pytest.mark.parametrize("name", list(_masks(512)))
@pytest.mark.parametrize("separate_full", [True, False])
def test_walk_lists_matches_the_host_walk_table(name, separate_full):
    """The graph's table and lengths equal our host walk of the same lists (full blocks
    first, ascending, then partial ones) for every row, with and without full lists."""
    L, block = 512, 64
    B = 3 if name == "per_batch" else 1
    tbm = torch_create_block_mask(_masks(L)[name], B, 1, L, L, device="cpu", BLOCK_SIZE=block)
    for row in range(L // block):
        sliced = tbm[:, :, row]
        full_num, full_idx = (sliced.full_kv_num_blocks, sliced.full_kv_indices) if separate_full else (None, None)
        if not separate_full:   # one list of every visited block, as partial
            dense = sliced.to_dense()[:, :, 0]           # [B, 1, kv blocks]
            num = dense.sum(-1, keepdim=True).to(torch.int32)
            idx = torch.argsort(-dense.int(), dim=-1, stable=True).to(torch.int32)[:, :, None]
            lists = (num, idx, None, None)
        else:
            lists = (sliced.kv_num_blocks, sliced.kv_indices, full_num, full_idx)
        table, lengths, full = walk_lists(*lists, block, L // block)
        ours = fa.BlockMask.from_kv_blocks(*[None if x is None else x.numpy() for x in lists],
                                           BLOCK_SIZE=(block, block), seq_lengths=(1, L))
        want_table, counts, _ = ours.kv_block_table(B)
        assert table.dtype == torch.int32 and lengths.dtype == torch.int32 and full.dtype == torch.int32
        np.testing.assert_array_equal(lengths.numpy(), counts * block)
        np.testing.assert_array_equal(full.numpy(), (ours.block_states()[:, 0, 0] == 2).sum(-1))
        for b in range(B):
            np.testing.assert_array_equal(table[b, :counts[b]].numpy(), want_table[b, :counts[b]])
        assert int(table.min()) >= 0 and int(table.max()) < L // block
        # The lists rebuilt from the walk (what the op converts where it cannot take the walk)
        # give the same block mask
        rebuilt = lists_of_walk(table, lengths, full, block)
        again = fa.BlockMask.from_kv_blocks(*[x.numpy() for x in rebuilt], BLOCK_SIZE=(block, block),
                                            seq_lengths=(1, L))
        np.testing.assert_array_equal(again.block_states(), ours.block_states())


def test_walk_lists_clamps_lists_made_by_hand():
    """Counts past their lists and indices past the keys stay inside K / V."""
    num = torch.tensor([[[9]]], dtype=torch.int32)
    idx = torch.tensor([[[[0, 7, 99]]]], dtype=torch.int32)
    full_num = torch.tensor([[[5]]], dtype=torch.int32)
    full_idx = torch.tensor([[[[1, 2, 3, 4]]]], dtype=torch.int32)
    table, lengths, full = walk_lists(num, idx, full_num, full_idx, 16, 8)
    assert int(lengths[0]) == 7 * 16          # 4 + 3 listed, within the 8 blocks
    assert int(full[0]) == 4
    assert table.shape == (1, 7) and int(table.max()) <= 7 and int(table.min()) >= 0


def _record_op_lists(monkeypatch, layouts: list | None = None) -> list:
    """The lists each graph-list op call receives (copies), in call order (and its layout
    into ``layouts``, if given)."""
    seen = []
    real = fa_ops._with_graph_block_mask

    def recording(spec, lists, layout):
        seen.append([None if t is None else t.clone() for t in lists])
        if layouts is not None:
            layouts.append(layout)
        return real(spec, lists, layout)

    monkeypatch.setattr(fa_ops, "_with_graph_block_mask", recording)
    return seen


def _paged_caches(B: int, L: int, n_pages: int, page: int, Hkv: int, D: int, g):
    """(torch's PagedAttention, physical k / v caches [1, Hkv, pages x page, D], the logical
    k / v [B, Hkv, L, D] it holds): L keys of each sequence assigned, pages reserved last
    sequence first."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention

    paged = PagedAttention(n_pages, page, B, device="cpu")
    for b in reversed(range(B)):
        paged.reserve(torch.tensor(b), torch.tensor(L))
    k_cache, v_cache = (torch.zeros(1, Hkv, n_pages * page, D) for _ in range(2))
    k, v = (torch.randn(B, Hkv, L, D, generator=g) for _ in range(2))
    paged.assign(torch.arange(B), torch.arange(L)[None].expand(B, L), k, v, k_cache, v_cache)
    return paged, k_cache, v_cache, k, v


def test_compiled_gpt_fast_step_passes_the_graph_walk_to_the_op(monkeypatch):
    """Inductor (CPU) compiles gpt-fast's step with the walk in the graph: the inference op
    gets the table, lengths and full counts in place of the four lists, equal to the host
    walk of the row, every step one frame; outputs equal the reference."""
    import compat_cases

    torch._dynamo.reset()
    B, Hq, Hkv, D, L = 2, 4, 1, 32, 512
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache = (torch.randn(B, Hkv, L, D, generator=g) for _ in range(2))
    block_mask = fa.create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, L, L)
    seen = _record_op_lists(monkeypatch)
    step = torch.compile(compat_cases.gpt_fast_decode_step(fa, k_cache, v_cache, L), fullgraph=True)
    with torch.no_grad():
        for pos in (100, 101, 300, 511):
            q = torch.randn(B, Hq, 1, D, generator=g)
            out = step(q, torch.tensor([pos]), block_mask)
            want, _ = reference.forward(q, k_cache[:, :, :pos + 1], v_cache[:, :, :pos + 1],
                                        AttentionSpec.from_args(enable_gqa=True))
            np.testing.assert_allclose(out.numpy(), want, atol=1e-5)
            lists = seen[-1]
            assert len(lists) == 7, "the op did not get the walk"
            assert lists[:4] == [None] * 4
            blocks = pos // 128 + 1
            np.testing.assert_array_equal(lists[4][0, :blocks].numpy(), np.arange(blocks))
            assert lists[5].tolist() == [blocks * 128] and lists[6].tolist() == [blocks - 1]


def test_device_walk_reads_the_graph_table_as_the_kernel_does(monkeypatch):
    """``device_walk_into`` on gpt-fast's folded walk: the plan it runs gets the graph's
    table and lengths (the launch sized for the whole cache), and the kernel's reading of
    them — every tile masked, keys through the table — emulated on the host equals the
    reference."""
    from flexattn.mods.evaluate import evaluate

    B, Hq, Hkv, D, S, block = 3, 8, 2, 32, 96, 16
    g = torch.Generator().manual_seed(8)
    cache_k, cache_v = (torch.randn(B, Hkv, 128, D, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = cache_k[:, :, :S], cache_v[:, :, :S]
    q = torch.randn(B, Hq, 1, D, generator=g, dtype=torch.float64)
    position = 70
    full = fa.create_block_mask(lambda b, h, qi, ki: qi >= ki, 1, 1, S, S, BLOCK_SIZE=block)
    row = full[:, :, position // block]
    offset = torch.tensor(position)
    mask = mods.mask_mod(lambda b, h, qi, ki: qi + offset >= ki)
    score = lambda s, b, h, qi, ki: s + 0.1 * b * (ki % 7) - 0.05 * h * (ki % 5)   # noqa: E731
    spec = AttentionSpec.from_args(score_mod=score, mask=mask, enable_gqa=True)
    torch_lists = [torch.as_tensor(np.asarray(x)) for x in (row.kv_num_blocks, row.kv_indices,
                                                              row.full_kv_num_blocks, row.full_kv_indices)]
    table, lengths, _ = walk_lists(*torch_lists, block, S // block)
    runs = []

    class Plan:
        ffi = True

        def run_device_lengths(self, *args):
            runs.append(args)

    monkeypatch.setattr(short_query, "attention_plan", lambda *a: (runs.append(a), Plan())[1])
    monkeypatch.setattr(short_query, "use_tvm_ffi", lambda device: True)
    real_takes = short_query._decode_kernel_takes   # (float64 here stands in for bfloat16)
    monkeypatch.setattr(short_query, "_decode_kernel_takes", lambda shape, dtype: real_takes(shape, "bfloat16"))
    shape = AttentionShape(B, Hq, Hkv, 1, S, D, D)
    device = kernel_path.Device(0, lambda x: x, decode_resources=lambda: (132, None), page_view=fa_devices._page_view,
                                heads_view=fa_devices._heads_view)
    walk = short_query.DeviceLists(table, lengths, block, block)
    out = torch.empty(B, Hq, 1, D, dtype=torch.float64)
    lse = torch.empty(B, Hq, 1, dtype=torch.float64)
    assert not short_query.device_walk_into(q, k, v, out, lse, shape, spec, walk,
                                            dataclasses.replace(device, heads_view=None))
    assert not short_query.device_walk_into(q, k, v, out, lse, shape._replace(q_len=17), spec, walk, device)
    prepared = short_query.device_walk_into(q, k, v, out, lse, shape, spec, walk, device)
    assert isinstance(prepared, short_query.PreparedDeviceWalk)
    plan_args, run_args = runs
    # The plan is made over host stand-ins (it keeps no tensor of the call); the launch
    # passes the call's captures: score's, then the mask's, the table among them.
    planned = plan_args[6]
    assert planned.listed_walk and not planned.full_but_last and not planned.true_positions
    assert not any(isinstance(c, torch.Tensor) for m in (planned.score_mod, planned.mask) for c in m.captures)
    assert isinstance(plan_args[7], np.ndarray) and plan_args[7].shape == tuple(table.shape)
    q_folded, k_pages, v_pages, run_table, _, _, run_lengths, longest, _, captures = run_args
    assert run_table is table and run_lengths is lengths and longest == S
    n_score = len(planned.score_mod.captures)
    mods_ = dataclasses.replace(planned, score_mod=planned.score_mod.with_captures(captures[:n_score]),
                                mask=planned.mask.with_captures(captures[n_score:]))
    assert any(c is table for c in captures) and any(c is offset for c in captures)
    assert tuple(q_folded.shape) == (1, B * Hq, 1, D) and tuple(k_pages.shape) == (S // block, block, B * Hkv, D)

    want, _ = reference.forward(q, k[:, :, :position + 1], v[:, :, :position + 1],
                                AttentionSpec.from_args(score_mod=score, enable_gqa=True))
    keys = np.arange(int(lengths[0]))
    pages = table[0].numpy()[keys // block]
    for f in range(B * Hq):
        kb = k_pages.numpy()[pages, keys % block, f // (Hq // Hkv)]
        vb = v_pages.numpy()[pages, keys % block, f // (Hq // Hkv)]
        env = {"b": np.int64(0), "h": np.int64(f), "q": np.int64(0), "kv": keys}
        s = q_folded[0, f, 0].numpy() @ kb.T * mods_.scale
        s = evaluate(mods_.score_mod.expr, dict(env, score=s), mods_.score_mod.captures)
        keep = evaluate(mods_.mask.expr, env, mods_.mask.captures)
        p = np.where(keep, np.exp(s - s[keep].max()), 0.0)
        np.testing.assert_allclose(p @ vb / p.sum(), want[f // Hq, f % Hq, 0], rtol=1e-10, atol=1e-12)

    # The repeat: the same plan, this call's captures (a new offset tensor, a new table) in
    # the hook's order — score captures, then the mask's — read through the kept origins.
    offset2, table2 = torch.tensor(position + 1), table.clone()
    spec2 = AttentionSpec.from_args(score_mod=score, mask=mods.mask_mod(lambda b, h, qi, ki: qi + offset2 >= ki),
                                    enable_gqa=True)
    assert prepared.launch(q, k, v, out, lse, short_query.mod_captures(spec2), table2, lengths)
    again = runs[-1]
    captures = again[-1]
    want_captures = mods_.score_mod.captures + mods_.mask.captures
    assert len(captures) == len(want_captures)
    for got, was in zip(captures, want_captures):
        if was is table:
            assert got is table2
        elif was is offset:
            assert got is offset2
        else:
            assert type(got) is type(was) and got == was
    assert again[3] is table2 and again[7] == S
    assert not prepared.launch(q, k.contiguous().expand(B, Hkv, S, D)[:1].expand(B, Hkv, S, D), v, out, lse,
                               short_query.mod_captures(spec2), table2, lengths)


def test_graph_block_mask_conversions_follow_the_lists_contents():
    """A graph's lists are new tensors each call, often at the last call's address and
    version: the op's conversion is found by what the lists hold, never by where they are
    (here one tensor rewritten behind autograd's version counter, through numpy)."""
    L, block = 256, 64
    row = torch_create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, L, L, device="cpu", BLOCK_SIZE=block)
    lists = [row.kv_num_blocks[:, :, 1:2].clone(), row.kv_indices[:, :, 1:2].clone(),
             row.full_kv_num_blocks[:, :, 1:2].clone(), row.full_kv_indices[:, :, 1:2].clone()]
    spec = AttentionSpec.from_args(mask=lambda b, h, q, kv: q + 64 >= kv)
    layout = [block, block, 1, L]
    first = fa_ops._with_graph_block_mask(spec, lists, layout).block_mask
    versions = [t._version for t in lists]
    row3 = [row.kv_num_blocks[:, :, 3:4], row.kv_indices[:, :, 3:4], row.full_kv_num_blocks[:, :, 3:4],
            row.full_kv_indices[:, :, 3:4]]
    for t, new in zip(lists, row3):
        t.numpy()[...] = new.numpy()          # same storage, same version, other contents
    assert [t._version for t in lists] == versions
    second = fa_ops._with_graph_block_mask(spec, lists, layout).block_mask
    assert first.to_dense().sum() == 2 and second.to_dense().sum() == 4
    again = fa_ops._with_graph_block_mask(spec, lists, layout).block_mask
    assert again is not second and again._states is second._states   # the same contents: the conversion kept


def test_pagedattention_converted_in_the_graph_walks_on_the_device(monkeypatch):
    """torch's PagedAttention step converting its block mask inside the compiled step
    (Inductor): a batch of rows over one physical cache — the op gets the walk of each
    sequence's pages (the host walk of the converted mask), and the eager answer."""
    torch._dynamo.reset()
    B, H, Hkv, D, page, n_pages, L = 3, 4, 2, 16, 16, 14, 64
    g = torch.Generator().manual_seed(33)
    paged, k_cache, v_cache, k, v = _paged_caches(B, L, n_pages, page, Hkv, D, g)
    lens = torch.tensor([40, 64, 17])
    logical = torch_create_block_mask(lambda b, h, qi, ki: ki < lens[b], B, None, 1, L, device="cpu", BLOCK_SIZE=page)
    q = torch.randn(B, H, 1, D, generator=g)
    want = fa.flex_attention(q, k, v, block_mask=logical, enable_gqa=True)
    seen = _record_op_lists(monkeypatch)

    def step(q, k_cache, v_cache):
        return fa.flex_attention(q, k_cache, v_cache, block_mask=paged.convert_logical_block_mask(logical),
                                 enable_gqa=True)

    with torch.no_grad():
        got = torch.compile(step, fullgraph=True)(q, k_cache, v_cache)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    lists = seen[-1]
    assert len(lists) == 7 and lists[:4] == [None] * 4, "the op did not get the walk in place of the lists"
    eager = paged.convert_logical_block_mask(logical)
    converted = fa.BlockMask.from_kv_blocks(eager.kv_num_blocks, eager.kv_indices, eager.full_kv_num_blocks,
                                            eager.full_kv_indices, BLOCK_SIZE=(page, page),
                                            seq_lengths=(1, n_pages * page))
    want_table, counts, _ = converted.kv_block_table(B)
    np.testing.assert_array_equal(lists[5].numpy(), counts * page)
    for b in range(B):   # (torch's PagedAttention lists pages in its own order: the same pages)
        np.testing.assert_array_equal(np.sort(lists[4][b, :counts[b]].numpy()), want_table[b, :counts[b]])


def test_pagedattention_walks_with_a_symbolic_cache_length(monkeypatch):
    """A serving step compiled again for a physical cache of another size (dynamo's automatic
    dynamic shapes: KV_LEN becomes symbolic, as it did for bench_paged_door's second shape)
    still walks the converted lists on the device: the table's width is a node of the
    graph; outputs equal the eager call's."""
    torch._dynamo.reset()
    page, H, Hkv, D = 16, 4, 2, 16
    g = torch.Generator().manual_seed(35)
    layouts = []
    seen = _record_op_lists(monkeypatch, layouts)
    with torch.no_grad():
        for B, L in ((4, 64), (1, 512), (2, 256)):   # caches of 18, 34 and 34 pages
            n_pages = B * L // page + 2
            paged, k_cache, v_cache, k, v = _paged_caches(B, L, n_pages, page, Hkv, D, g)
            lens = torch.randint(1, L + 1, (B,), generator=g)
            logical = torch_create_block_mask(lambda b, h, qi, ki: ki < lens[b], B, None, 1, L, device="cpu",
                                              BLOCK_SIZE=page)
            q = torch.randn(B, H, 1, D, generator=g)
            want = fa.flex_attention(q, k, v, block_mask=logical, enable_gqa=True)

            def serving_step(q, k_cache, v_cache, paged=paged, logical=logical):   # (as bench_paged_door's)
                return fa.flex_attention(q, k_cache, v_cache, block_mask=paged.convert_logical_block_mask(logical),
                                         enable_gqa=True)

            got = torch.compile(serving_step, fullgraph=True)(q, k_cache, v_cache)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            assert len(seen[-1]) == 7, f"B{B} L{L}: the graph did not walk the lists"
            assert layouts[-1][3] == n_pages * page and seen[-1][5].tolist() == [
                -(-int(n) // page) * page for n in lens]


def test_host_built_mask_in_compiled_code_has_no_side_effects():
    """A host-built block mask first touched inside compiled code: its list tensors are
    copies in the graph, never kept on the mask there (a kept one is a side effect dynamo
    replays after every call: the graph returned the eight lists too). Sliced by an index
    on another device (a CUDA position; meta here) the lists go there in the graph, with a
    warning at compile time; on the index's own device they are sliced in place."""
    import warnings

    import compat_cases

    torch._dynamo.reset()
    B, Hq, Hkv, D, L = 2, 4, 1, 32, 512
    g = torch.Generator().manual_seed(5)
    k_cache, v_cache = (torch.randn(B, Hkv, L, D, generator=g) for _ in range(2))
    block_mask = fa.create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, L, L)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    step = torch.compile(compat_cases.gpt_fast_decode_step(fa, k_cache, v_cache, L), fullgraph=True, backend=backend)
    with torch.no_grad():
        q = torch.randn(B, Hq, 1, D, generator=g)
        out = step(q, torch.tensor([300]), block_mask)
    want, _ = reference.forward(q, k_cache[:, :, :301], v_cache[:, :, :301], AttentionSpec.from_args(enable_gqa=True))
    np.testing.assert_allclose(out.numpy(), want, atol=1e-5)
    (output,) = [n for n in graphs[-1].graph.nodes if n.op == "output"]
    assert len(output.args[0]) == 1, "the graph returns more than the attention (side effects replayed per call)"
    assert "_tensors" not in block_mask.__dict__

    def row_lists(bm, idx):
        return bm[:, :, idx].kv_indices

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        moved = torch.compile(row_lists, fullgraph=True, backend="eager")(block_mask, torch.tensor([2], device="meta"))
        in_place = torch.compile(row_lists, fullgraph=True, backend="eager")(block_mask, torch.tensor([2]))
    assert moved.device.type == "meta" and tuple(moved.shape) == (1, 1, 1, 4)
    assert [str(w.message) for w in caught if "copied to meta" in str(w.message)], "no warning"
    fresh = fa.create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, L, L)
    assert in_place.tolist() == fresh[:, :, [2]].kv_indices.tolist()


@pytest.mark.parametrize("masks", [True, False])
def test_template_captures_are_the_bound_specs(masks):
    """A repeated op call's walk takes its captures from the registered template and the
    op's buffers by slot (``_template_captures``, no bound spec made): the same values, in
    the same places, as the bound spec's (``bind_operands``), numbers and tensors alike."""
    bias, slopes, offset = torch.randn(8), torch.randn(4), torch.tensor(70)
    score = mods.score_mod(lambda s, b, h, qi, ki: s + bias[ki % 8] * 0.5 + slopes[h] * (ki - qi))
    mask = mods.mask_mod(lambda b, h, qi, ki: (qi + offset >= ki) & (ki > 3))
    spec = AttentionSpec.from_args(score_mod=score, mask=mask)
    spec_id = fa_ops._REGISTRY.register(spec, masks=masks)
    template = fa_ops._REGISTRY.get(spec_id)
    buffers = [c for c in score.captures if isinstance(c, torch.Tensor)]
    if masks:
        buffers += [c for c in mask.captures if isinstance(c, torch.Tensor)]
    got = fa_ops._template_captures(spec_id, buffers)
    want = short_query.mod_captures(fa_ops._REGISTRY.bind_operands(spec_id, buffers))
    assert got.keys() == want.keys()
    for kind in got:
        assert len(got[kind]) == len(want[kind]) > 0
        for a, b in zip(got[kind], want[kind]):
            assert a is b or (not isinstance(a, torch.Tensor) and np.array_equal(np.asarray(a), np.asarray(b)))
    assert any(c is offset for c in got["mask"]) and any(c is bias for c in got["score"])
    assert any(c is OPERAND for c in template.score.captures)
