"""CPU: the repeated-call cache of the core (flexattn/core/prepared.py)."""

import gc

import numpy as np

from flexattn import create_block_mask, mods
from flexattn.core.prepared import PreparedCalls, call_identity


def _call(score_mod=None, block_mask=None, scale=None, mask=None):
    return (score_mod, block_mask, scale, False, mask, None)


def test_only_immutable_calls_have_an_identity():
    assert call_identity(_call(mods.softcap(3.0), mask=mods.causal())) is not None
    assert call_identity(_call(block_mask=create_block_mask(mods.causal(), None, None, 64, 64))) is not None
    assert call_identity(_call(lambda s, b, h, q, kv: s)) is None        # re-traced every call
    assert call_identity(_call(scale=np.float32(0.5))) is None            # not a plain number
    assert call_identity(_call(scale=0.5)) == call_identity(_call(scale=0.5))


def test_second_sighting_then_hits_then_dies_with_its_objects():
    cache, made = PreparedCalls(), []
    score = mods.alibi(np.linspace(0.1, 0.5, 4).astype(np.float32))
    call = _call(score, mask=mods.causal())
    key = call_identity(call) + ("shape",)
    make = lambda: made.append(1) or "entry"  # noqa: E731
    cache.add(key, call, make)
    assert cache.get(key, call) is None and made == []       # first sighting: nothing prepared
    cache.add(key, call, make)
    assert cache.get(key, call) == "entry" and made == [1]
    cache.add(key, call, make)
    assert made == [1]                                       # prepared once
    other = _call(mods.alibi(np.ones(4, np.float32)), mask=call[4])
    assert cache.get(key, other) is None                     # same key, other objects: no hit
    del score, call
    gc.collect()
    assert len(cache) == 0                                   # the entry left with its mod


def test_capacity_bounds_the_cache():
    cache = PreparedCalls(capacity=3)
    keep = [mods.softcap(float(i + 1)) for i in range(5)]
    for i, m in enumerate(keep):
        call = _call(m)
        for _ in range(2):
            cache.add(("k", i), call, lambda i=i: i)
    assert len(cache) == 3 and cache.get(("k", 4), _call(keep[4])) == 4
    assert cache.get(("k", 0), _call(keep[0])) is None
