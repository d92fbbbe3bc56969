"""CPU: every IR op and built-in mod lowers to CuTeDSL and compiles for sm_90a."""

import numpy as np
import pytest

pytest.importorskip("cutlass")

from flexattn import mods  # noqa: E402
from flexattn.kernels.emit.mod_emit import IRModHook, capture_kinds  # noqa: E402
from flexattn.kernels.emit.mod_eval import compile_mod_eval  # noqa: E402

import mod_zoo  # noqa: E402

ZOO = mod_zoo.zoo(np.random.default_rng(0), 48)


@pytest.mark.parametrize("name", sorted(ZOO))
def test_mod_compiles_for_sm90(name):
    score, mask = ZOO[name]
    compiled = compile_mod_eval(IRModHook(score, mask))
    assert compiled is not None


def test_capture_kinds_follow_structure_not_values():
    a = IRModHook(mods.softcap(3.0), mods.sliding_window(5) & mods.document(np.zeros(8, np.int32)))
    b = IRModHook(mods.softcap(7.0), mods.sliding_window(9) & mods.document(np.ones(8, np.int32)))
    assert a.key() == b.key()
    assert capture_kinds(a) == (("scalar", "float32"), ("scalar", "float32"), ("scalar", "int32"), ("scalar", "int32"),
                                ("buffer", "int32", 1))
    c = IRModHook(mods.softcap(3.0), mods.document(np.zeros(8, np.int64)))
    assert c.key() != a.key()


@pytest.mark.parametrize("name", sorted(ZOO))
def test_mod_q_affine_compiles_for_sm90(name):
    """Per element with q as the AffineIndex (as the backward passes it)."""
    score, mask = ZOO[name]
    assert compile_mod_eval(IRModHook(score, mask), affine="q") is not None


@pytest.mark.parametrize("name", sorted(ZOO))
def test_mod_rows_compile_for_sm90(name):
    """Row emission (the forward's apply_mods on fragment rows) of every zoo mod."""
    score, mask = ZOO[name]
    compiled = compile_mod_eval(IRModHook(score, mask), rows=True)
    assert compiled is not None


@pytest.mark.parametrize("name", sorted(ZOO))
def test_mod_hoisted_compiles_for_sm90(name):
    """Per-element emission with the row-invariant reads emitted first (the decode kernel's
    way, `IRModHook.row_invariants`)."""
    score, mask = ZOO[name]
    assert compile_mod_eval(IRModHook(score, mask), hoisted=True) is not None


@pytest.mark.parametrize("rows", [False, True])
def test_mod_tiled_compiles_for_sm90(rows):
    """Element and row emission with the reads at kv // page emitted once per tile first
    (``ModEvalKernel(tiled=)``, as the decode kernel and the forward's hoist_tile_reads do):
    a row of 8 keys reads the page map and the bias once, not per key (one element per
    thread: as many reads either way)."""
    import re

    score, mask = mod_zoo.paged_zoo(np.random.default_rng(0), 130)["paged"]
    hook = IRModHook(score, mask)
    assert hook.tile_invariant_count(32) == 3
    reads = [len(re.findall(r"ld\.global(?:\.nc)?\.(?:b32|b64|s64|u64|f32)\b",
                            compile_mod_eval(hook, "--gpu-arch=sm_90a --keep-ptx", rows=rows, tiled=tiled).__ptx__))
             for tiled in (0, 32)]
    assert reads[1] < reads[0] if rows else reads[1] == reads[0], reads


def _ops(nodes):
    return [(n.op, tuple(sorted(n.free_vars()))) for n in nodes]


def test_row_invariant_roots():
    """The largest subexpressions that read a buffer but not kv or the score: what a kernel
    may emit once per query row, before its kv loop."""
    from flexattn.kernels.emit.mod_emit import row_invariant_roots
    from flexattn.mods.positions import shift_queries

    offsets = np.zeros(4, np.int32)
    slopes = mods.alibi_slopes(8)
    ids = np.zeros((2, 64), np.int32)
    # ALiBi: the slope; at true positions also the shifted query (q + q_offset[b]).
    assert _ops(row_invariant_roots(mods.alibi(slopes).expr)) == [("load", ("h",))]
    assert sorted(_ops(row_invariant_roots(shift_queries(mods.alibi(slopes), offsets).expr))) == \
        [("add", ("b", "q")), ("load", ("h",))]
    assert _ops(row_invariant_roots(shift_queries(mods.sliding_window(64), offsets).expr)) == [("add", ("b", "q"))]
    # A document mask: the query's document id, not the key's.
    assert _ops(row_invariant_roots(mods.document(ids).expr)) == [("load", ("b", "q"))]
    # Nothing read from a buffer, or every read depends on kv: nothing to hoist.
    assert row_invariant_roots(mods.causal().expr) == []
    assert row_invariant_roots(mods.softcap(30.0).expr) == []
    assert row_invariant_roots(mods.relative_bias(np.zeros((8, 9), np.float32)).expr) == []
    # A mask that never reads kv is itself invariant along a row.
    flags = np.ones(8, np.bool_)
    whole = mods.mask_mod(lambda b, h, q, kv: flags[h] & (q >= 0))
    assert _ops(row_invariant_roots(whole.expr)) == [("and", ("h", "q"))]
    hook = IRModHook(None, mods.causal())
    assert hook.row_invariants(None, None, None, ()) is None    # nothing to hoist: no emission


def test_tile_invariant_roots():
    """The largest subexpressions that read a buffer and read kv only as ``kv // P``, P a
    multiple of the tile: what a kernel may emit once per aligned key tile. A walk's
    table and the page map of torch's PagedAttention mask behind it are; reads at kv
    itself, at ``kv // P`` with P below the tile or not dividing it, or beside the score,
    are not."""
    from flexattn.kernels.emit.mod_emit import tile_invariant_roots
    from flexattn.mods.optimize import optimize
    from flexattn.mods.positions import block_table_keys

    page_map, lengths, table = np.zeros((4, 64), np.int64), np.zeros(4, np.int64), np.zeros((4, 16), np.int32)
    paged = mods.mask_mod(lambda b, h, q, kv: (page_map[b, kv // 128] >= 0)
                          & (page_map[b, kv // 128] * 128 + kv % 128 < lengths[b]))
    walked = optimize(block_table_keys(paged, table, 128).expr)
    roots = tile_invariant_roots(walked, 64)

    def loads(roots):
        return sorted(str(n) for r in roots for n in r.walk() if n.op == "load")
    # page_map[b, table[b, kv // 128]] >= 0 and page_map[...] * 128: the two loads in both
    assert {n.op for n in roots} == {"ge", "mul"}
    assert len(set(loads(roots))) == 2 and not any(n.op == "mod" for r in roots for n in r.walk())
    assert loads(tile_invariant_roots(walked, 128)) == loads(roots)
    assert tile_invariant_roots(walked, 256) == []        # 128-key pages: not constant over 256 keys
    ids = np.zeros((2, 64), np.int32)
    assert tile_invariant_roots(mods.document(ids).expr, 64) == []          # read at kv itself
    coarse = mods.mask_mod(lambda b, h, q, kv: ids[b, kv // 192] == 0)
    assert tile_invariant_roots(coarse.expr, 64) != [] and tile_invariant_roots(coarse.expr, 128) == []
    bias = np.zeros((4, 64), np.float32)
    blocky = mods.score_mod(lambda s, b, h, q, kv: s + bias[b, kv // 128])
    assert _ops(tile_invariant_roots(blocky.expr, 64)) == [("load", ("b", "kv"))]   # bias[b, kv // 128]
    assert tile_invariant_roots(mods.alibi(mods.alibi_slopes(8)).expr, 64) == []


def test_shifts_lower_to_arithmetic_shifts():
    """``>>`` on signed indices is torch's arithmetic shift: shr.s32 in the kernel (a
    logical shr.u32 would turn negative differences into huge positives)."""
    from flexattn.kernels.emit.mod_emit import fake_args
    from flexattn.kernels.fwd.sm90 import FwdConfig
    from flexattn.kernels.launch.compile import compile_forward

    hook = IRModHook(None, mods.mask_mod(lambda b, h, q, kv: ((q - kv) >> 3) == (kv << 1) - (q >> 2)))
    ptx = compile_forward(FwdConfig(head_dim=128, block_sparse=True, mods=hook), fake_args(hook),
                          keep_ptx=True).__ptx__
    assert "shr.s32" in ptx and "shl.b32" in ptx


def test_vector_read_dot_compiles_per_element_without_spills():
    """A dot of embedding rows (mods/vectors.py: 8 loads at kv per element) is emitted per
    element (row emission would keep 8 gathered rows live: MAX_ROW_GATHERS) and the
    forward compiles without spilling."""
    import torch

    from flexattn.kernels.emit.mod_emit import fake_args, row_friendly
    from flexattn.kernels.fwd.sm90 import FwdConfig
    from flexattn.kernels.launch.compile import compile_forward, resource_usage_from_ptx

    q_emb, k_emb = torch.randn(2, 4, 64, 8), torch.randn(2, 2, 64, 8)
    score = mods.score_mod(lambda s, b, h, q, kv: s + torch.dot(q_emb[b, h, q], k_emb[b, h // 2, kv]))
    assert not row_friendly(score.expr)
    hook = IRModHook(score, mods.causal())
    ptx = compile_forward(FwdConfig(head_dim=128, causal=True, mods=hook), fake_args(hook), keep_ptx=True).__ptx__
    usage = resource_usage_from_ptx(ptx)
    if usage is not None:
        assert usage.spill_store_bytes == 0 and usage.stack_bytes == 0, usage


def test_affine_index_casts_found_on_the_ir():
    """Which mods take an index as an AffineIndex: those converting a sum / difference of
    that index and terms free of it to float (ALiBi's kv - q, both ways), not other uses."""
    from flexattn.kernels.emit.affine_index import casts_index_affinely
    from flexattn.mods import ir

    alibi = mods.alibi(num_heads=4).expr
    assert casts_index_affinely(alibi, "kv") and casts_index_affinely(alibi, "q")
    kv, q = ir.var("kv"), ir.var("q")
    b = ir.binary
    assert casts_index_affinely(ir.cast(b("sub", ir.unary("neg", b("add", kv, 3)), q), ir.FLOAT), "kv")
    assert not casts_index_affinely(ir.cast(b("mul", kv, kv), ir.FLOAT), "kv")                 # not affine
    assert not casts_index_affinely(ir.cast(b("sub", kv, b("floordiv", kv, 2)), ir.FLOAT), "kv")  # kv twice
    assert not casts_index_affinely(mods.softcap(5.0).expr, "kv")
    assert not casts_index_affinely(mods.sliding_window(8).expr, "kv")        # compares, no cast
    hook = IRModHook(mods.alibi(num_heads=4), mods.sliding_window(8))
    assert hook.affine_index("kv", True, True) and not hook.affine_index("kv", False, True)


def test_affine_index_compares_found_on_the_ir():
    """Masks that compare such an index (or its abs, or its residue modulo a power of two)
    with a constant take it as an AffineIndex too; compares with runtime values do not."""
    from flexattn.kernels.emit.affine_index import casts_index_affinely

    dilated = mods.mask_mod(lambda b, h, q, kv: ((q - kv).abs() <= 512) & ((q - kv) % 2 == 0)).expr
    assert casts_index_affinely(dilated, "kv") and casts_index_affinely(dilated, "q")
    assert casts_index_affinely(mods.mask_mod(lambda b, h, q, kv: 5 >= kv - q).expr, "kv")
    assert casts_index_affinely(mods.mask_mod(lambda b, h, q, kv: ((kv + 1) & 3) == 1).expr, "kv")
    assert not casts_index_affinely(mods.mask_mod(lambda b, h, q, kv: (kv % 3) == 1).expr, "kv")  # not 2**k
    assert not casts_index_affinely(mods.mask_mod(lambda b, h, q, kv: (kv * 2).abs() <= 3).expr, "kv")
    assert not casts_index_affinely(mods.mask_mod(lambda b, h, q, kv: kv <= q).expr, "kv")    # no constant
    assert not casts_index_affinely(mods.sliding_window(8).expr, "kv")       # a captured (runtime) width


def test_affine_compares_lower_without_abs_or_residues_per_element():
    """The dilated window ``abs(q - kv) <= 512 & (q - kv) % 2 == 0`` in the forward: no
    absolute value and no residue per score (the index's base compared with immediates,
    its parity once per row), where each score took an add, an abs, an and and compares."""
    from flexattn.kernels.emit.mod_emit import fake_args
    from flexattn.kernels.fwd.sm90 import FwdConfig
    from flexattn.kernels.launch.compile import compile_forward

    hook = IRModHook(None, mods.mask_mod(lambda b, h, q, kv: ((q - kv).abs() <= 512) & ((q - kv) % 2 == 0)))
    cfg = FwdConfig(head_dim=128, block_sparse=True, mods=hook)
    ptx = compile_forward(cfg, fake_args(hook), keep_ptx=True).__ptx__
    assert "abs.s32" not in ptx
    # residues: one per row (two rows of a 128-key tile per thread), in the step's one copy
    # that applies the mask; none per score
    assert ptx.count("and.b32") < 32, ptx.count("and.b32")
