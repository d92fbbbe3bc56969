"""Plain functions are traced once per fingerprint (flexattn/mods/trace_cache.py): a hit
reuses the IR object, and anything the function reads that changes gives a new trace."""

import gc
import math
import types

import numpy as np
import pytest

from flexattn import mods
from flexattn.mods import as_mask, as_score
from flexattn.mods.mod import _SCORE_TRACES
from flexattn.mods.trace_cache import fingerprint


def _softcap_lambda():
    return lambda score, b, h, q_idx, kv_idx: 30.0 * np.tanh(score / 30.0)


def test_a_new_lambda_each_call_hits_the_same_trace():
    first, second = as_score(_softcap_lambda()), as_score(_softcap_lambda())
    assert first.expr is second.expr                      # plans and kernels key on this object
    assert first.structure_key == second.structure_key


def test_closure_numbers_are_values():
    def window(w):
        return lambda b, h, q_idx, kv_idx: (q_idx - kv_idx <= w) & (q_idx >= kv_idx)

    a, b, c = as_mask(window(4)), as_mask(window(4)), as_mask(window(9))
    assert a.expr is b.expr and a.captures == (4,)
    assert c.captures == (9,)                              # another value: its own capture
    q, kv = np.arange(16)[:, None], np.arange(16)[None, :]
    np.testing.assert_array_equal(c(0, 0, q, kv), (q - kv <= 9) & (q >= kv))


def test_rebinding_a_closure_cell_or_global_retraces():
    cap = 2.0
    fn = lambda score, b, h, q_idx, kv_idx: score * cap  # noqa: E731
    assert as_score(fn).captures == (2.0,)
    cap = 5.0  # noqa: F841 (the lambda's cell)
    assert as_score(fn).captures == (5.0,)
    g = types.FunctionType(compile("lambda s, b, h, q, kv: s + OFFSET", "<test>", "eval").co_consts[0],
                           {"OFFSET": 1.0})
    assert as_score(g).captures == (1.0,)
    g.__globals__["OFFSET"] = 7.0
    assert as_score(g).captures == (7.0,)


def test_arrays_by_place_and_never_kept_alive():
    """An array is keyed by where the code finds it, its shape and dtype: a new array of the
    same kind in the same cell reuses the trace (the same IR) and captures the new array;
    the cache holds no array. ``Fingerprint.key`` (the prepared calls') still tells arrays
    apart by identity."""
    import weakref

    table = np.arange(8, dtype=np.float32)
    fn = lambda score, b, h, q_idx, kv_idx: score + table[h]  # noqa: E731
    a, b = as_score(fn), as_score(fn)
    assert a.expr is b.expr and b.captures[0] is table
    old_key, watch = fingerprint(fn).key, weakref.ref(table)
    table = np.zeros(8, dtype=np.float32)                   # a new array in the cell
    c = as_score(fn)
    assert c.expr is a.expr and c.captures[0] is table and c(0.0, 3, 3, 0, 0) == 0.0
    assert fingerprint(fn).key != old_key
    del a, b
    gc.collect()
    assert watch() is None                                  # not kept alive by the cache
    shape_changed = np.arange(4, dtype=np.float32)
    assert fingerprint(lambda s, b, h, q, kv: s + shape_changed[h]).shape_key != \
        fingerprint(lambda s, b, h, q, kv: s + table[h]).shape_key
    assert as_score(lambda s, b, h, q, kv: s + shape_changed[h]).captures[0] is shape_changed


def test_a_closure_over_a_new_tensor_each_call_keeps_its_trace():
    """gpt-fast moves a mask to the current position with a closure over a new tensor each
    step (``input_pos[0]``): one trace, each mod capturing its own step's tensor. One array
    in two places and two arrays there are different keys (aliasing is structure)."""
    torch = pytest.importorskip("torch")

    def at(offset):
        return lambda b, h, q_idx, kv_idx: q_idx + offset >= kv_idx

    first, second = as_mask(at(torch.tensor(5))), as_mask(at(torch.tensor(9)))
    assert second.expr is first.expr and int(second.captures[0]) == 9
    q, kv = np.arange(12)[:, None], np.arange(12)[None, :]
    np.testing.assert_array_equal(np.asarray(second(0, 0, q, kv)), q + 9 >= kv)

    def pair(x, y):
        return lambda s, b, h, q_idx, kv_idx: s + x[h] * y[h]

    same, other = np.ones(4, np.float32), np.full(4, 2.0, np.float32)
    aliased, apart = as_score(pair(same, same)), as_score(pair(same, other))
    assert len(aliased.captures) == 1 and len(apart.captures) == 2
    assert apart(1.0, 0, 1, 0, 0) == 3.0 and aliased(1.0, 0, 1, 0, 0) == 2.0


def test_objects_are_keyed_by_the_attributes_the_code_names():
    class Config:
        window = 3

    config = Config()
    fn = lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= config.window  # noqa: E731
    first = as_mask(fn)
    assert as_mask(fn).expr is first.expr                   # unchanged: the kept trace
    config.window = 5
    second = as_mask(fn)
    assert first.expr != second.expr                        # the new value was seen
    values = [1, 2]
    assert fingerprint(lambda b, h, q, kv: q - kv <= values[0]) is None   # a list may change
    config.values = values                                  # ... also as an attribute
    assert fingerprint(lambda b, h, q, kv: q - kv <= config.values[0]) is None
    name = "window"
    assert fingerprint(lambda b, h, q, kv: q - kv <= getattr(config, name)) is None   # computed names


def test_a_method_closure_over_self_keeps_its_trace_until_an_attribute_changes():
    """torch's PagedAttention converts a block mask with a closure over ``self`` reading
    ``self.physical_to_logical`` and ``self.page_size``: a new closure per conversion, the
    same trace while those attributes key the same (an update in place of the tensor, or
    a new tensor of the same kind, needs no new trace; the trace reads it at run time). (torch tensors: an attribute's
    numpy array is not traced through, only the function's own.)"""
    torch = pytest.importorskip("torch")

    class Pages:
        def __init__(self):
            self.page_size = 4
            self.page_map = torch.arange(8, dtype=torch.int32)

        def mask_mod(self):
            def physical(b, h, q_idx, kv_idx):
                return self.page_map[kv_idx // self.page_size] * self.page_size + kv_idx % self.page_size <= q_idx
            return physical

        def helper(self, x):
            return x

        def with_method(self):
            return lambda b, h, q_idx, kv_idx: self.helper(q_idx) >= kv_idx

    pages = Pages()
    first = as_mask(pages.mask_mod())
    again = as_mask(pages.mask_mod())                      # a new closure, same attributes
    assert again.expr is first.expr and again.captures[0] is pages.page_map
    pages.page_map[:] = 0                                  # in place: same key
    assert as_mask(pages.mask_mod()).expr is first.expr
    pages.page_map = torch.zeros(8, dtype=torch.int32)    # rebound: the same trace over it
    rebound = as_mask(pages.mask_mod())
    assert rebound.expr is first.expr and rebound.captures[0] is pages.page_map
    pages.page_size = 2
    assert as_mask(pages.mask_mod()).expr != first.expr
    assert fingerprint(pages.with_method()) is None         # a bound method: not keyed


def test_module_attributes_named_by_the_code_are_fingerprinted():
    settings = types.ModuleType("user_settings")
    settings.WINDOW = 3
    g = types.FunctionType(compile("lambda b, h, q, kv: q - kv <= settings.WINDOW", "<test>", "eval").co_consts[0],
                           {"settings": settings})
    first = as_mask(g)
    settings.WINDOW = 6
    assert as_mask(g).expr != first.expr or as_mask(g).captures != first.captures


def test_helper_functions_are_fingerprinted_through():
    scale = 0.5

    def helper(x):
        return x * scale

    fn = lambda score, b, h, q_idx, kv_idx: helper(score)  # noqa: E731
    a = as_score(fn)
    scale = 4.0  # noqa: F841
    assert as_score(fn).expr is not a.expr or as_score(fn).captures != a.captures
    assert fingerprint(lambda s, b, h, q, kv: math.tanh(1.0) * s) is not None   # library: by identity


def test_arrays_made_inside_the_function_are_not_kept():
    def fn(score, b, h, q_idx, kv_idx):
        return score * np.full((), 2.0, np.float32)          # a new 0-d array per trace

    assert fingerprint(fn) is not None
    n = len(_SCORE_TRACES)
    first, second = as_score(fn), as_score(fn)
    assert first.captures[0] is not second.captures[0]      # traced twice: not kept
    assert len(_SCORE_TRACES) == n


def test_errors_still_raise_on_every_call():
    bad = lambda b, h, q_idx: q_idx  # noqa: E731
    for _ in range(2):
        with pytest.raises(TypeError, match="takes"):
            as_mask(bad)


def test_builtins_reuse_their_trace():
    assert mods.causal().expr is mods.causal().expr
    assert mods.sliding_window(128).expr is mods.sliding_window(128).expr
    assert mods.sliding_window(128).structure_key == mods.sliding_window(256).structure_key
