"""CPU (CI): the GPU block-mask builder's kernels compile for sm_90a without spills; the
classifier evaluates elements with warp votes and early exit; captured values and
lengths are runtime arguments (one compile per mask structure)."""

import numpy as np
import pytest

pytest.importorskip("cutlass")

from flexattn import mods  # noqa: E402
from flexattn.kernels.blockmask import classify as blockmask_sm90  # noqa: E402
from flexattn.kernels.blockmask.classify import builder_for  # noqa: E402
from flexattn.kernels.launch.compile import compile_classifier, compile_compactor, resource_usage_from_ptx  # noqa: E402
from flexattn.kernels.emit.mod_emit import IRModHook  # noqa: E402


def _no_spills(ptx):
    usage = resource_usage_from_ptx(ptx)
    if usage is None:
        pytest.skip("no ptxas on PATH to report resource usage")
    assert usage.spill_store_bytes == 0 and usage.spill_load_bytes == 0 and usage.stack_bytes == 0, usage
    return usage


MASKS = {
    # index-only (no buffer), a 1-D int buffer read at q and kv, a per-batch scalar buffer
    "causal_window": (mods.causal() & mods.sliding_window(256), (128, 128), False),
    "document_offsets": (mods.document_from_offsets(np.array([0, 100, 300])), (64, 128), True),
    "prefix_lm_batch": (mods.prefix_lm(np.array([3, 70], dtype=np.int32)), (128, 128), False),
    # periodic functions (bounds unknown on the GPU: every tile evaluated) and a float -> int
    # cast of a value that may be infinite (its bounds then unknown too)
    "periodic_and_casts": (mods.mask_mod(lambda b, h, q, kv: (mods.ops.sin((q - kv) * 0.1) > 0.5)
                                         | (mods.ops.cast(mods.ops.log(mods.ops.cast(q, "float32")), "int32") > 3)),
                           (128, 128), False),
}


@pytest.mark.parametrize("name", sorted(MASKS))
def test_classifier_compiles_without_spills(name):
    mask, (qb, kvb), count = MASKS[name]
    compiled = compile_classifier(IRModHook(None, mask), qb, kvb, count_allowed=count, keep_ptx=True)
    ptx = compiled.__ptx__
    assert "vote.sync.ballot" in ptx and "vote.sync.any" in ptx  # tile lists and early exit by warp votes
    assert ".f64" in ptx  # interval bounds in double precision
    _no_spills(ptx)


def test_compactor_compiles_without_spills():
    ptx = compile_compactor(keep_ptx=True).__ptx__
    assert "vote.sync.ballot" in ptx and "popc" in ptx
    _no_spills(ptx)
    # separate_full_blocks=False: full tiles listed as partial (one more select per tile)
    _no_spills(compile_compactor(full_as_partial=True, keep_ptx=True).__ptx__)


def test_tvm_ffi_variant_compiles():
    assert compile_classifier(IRModHook(None, mods.causal()), 128, 128, tvm_ffi=True) is not None


def test_values_never_enter_the_builder_key():
    """Builders are cached by structure: new documents, windows or prefixes reuse the compiled kernel."""
    a = builder_for(mods.document_from_offsets(np.array([0, 5, 9])), 128, 128, False)
    b = builder_for(mods.document_from_offsets(np.array([0, 2, 3, 4, 7, 40])), 128, 128, False)
    assert a is b
    c = builder_for(mods.causal() & mods.sliding_window(5), 128, 128, False)
    assert c is builder_for(mods.causal() & mods.sliding_window(900), 128, 128, False)
    assert c is not builder_for(mods.causal() & mods.sliding_window(5), 64, 128, False)  # block size compiles in
    before = blockmask_sm90.compile_count()
    c._fn(False)
    builder_for(mods.causal() & mods.sliding_window(77), 128, 128, False)._fn(False)
    assert blockmask_sm90.compile_count() == before + 1


def test_builder_rejects_score_mods():
    with pytest.raises(ValueError, match="mask mod and no score mod"):
        blockmask_sm90.BlockClassifierSm90(IRModHook(mods.softcap(2.0), mods.causal()), 128, 128)
