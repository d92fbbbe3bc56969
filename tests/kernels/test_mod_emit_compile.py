"""CPU: every IR op and built-in mod lowers to CuTeDSL and compiles for sm_90a."""

import numpy as np
import pytest

pytest.importorskip("cutlass")

from flexattn import mods  # noqa: E402
from flexattn.kernels.mod_emit import IRModHook, capture_kinds  # noqa: E402
from flexattn.kernels.mod_eval import compile_mod_eval  # noqa: E402

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
def test_mod_rows_compile_for_sm90(name):
    """Row emission (the forward's apply_mods on fragment rows) of every zoo mod."""
    score, mask = ZOO[name]
    compiled = compile_mod_eval(IRModHook(score, mask), rows=True)
    assert compiled is not None
