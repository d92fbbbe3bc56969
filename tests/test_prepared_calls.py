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
    # plain functions: by fingerprint, when they name no array (an entry would keep it alive)
    same = [call_identity(_call(lambda s, b, h, q, kv: s * 2.0)) for _ in range(2)]
    assert same[0] is not None and same[0] == same[1]                    # a new lambda each call
    def biased(table):
        return lambda s, b, h, q, kv: s + table[h]

    table = np.ones(4, np.float32)   # small arrays: by identity (the entry may hold them)
    small = call_identity(_call(biased(table)))
    assert small is not None and small == call_identity(_call(biased(table)))
    assert call_identity(_call(biased(np.ones(4, np.float32)))) != small
    big = np.ones(1 << 20, np.float32)   # large ones: never held by a cache entry
    assert call_identity(_call(lambda s, b, h, q, kv: s + big[kv])) is None
    holder = type("Holder", (), {"cap": 3.0})()
    def scaled():
        return lambda s, b, h, q, kv: s * holder.cap
    by_holder = call_identity(_call(scaled()))   # an object: by the attributes the code names
    assert by_holder is not None and by_holder == call_identity(_call(scaled()))
    holder.cap = 4.0
    assert call_identity(_call(scaled())) != by_holder
    holder.caps = [1.0]
    assert call_identity(_call(lambda s, b, h, q, kv: s * holder.caps[0])) is None   # a list: may change
    assert call_identity(_call(scale=np.float32(0.5))) is None            # not a plain number
    assert call_identity(_call(scale=0.5)) == call_identity(_call(scale=0.5))


def test_second_sighting_then_hits_then_dies_with_its_objects():
    cache, made = PreparedCalls(), []
    score = mods.alibi(np.linspace(0.1, 0.5, 4).astype(np.float32))
    call = _call(score, mask=mods.causal())
    key = call_identity(call) + ("shape",)
    make = lambda: made.append(1) or "entry"  # noqa: E731
    cache.add(key, call, make)
    assert cache.get(key) is None and made == []            # first sighting: nothing prepared
    cache.add(key, call, make)
    assert cache.get(key) == "entry" and made == [1]
    cache.add(key, call, make)
    assert made == [1]                                       # prepared once
    other = _call(mods.alibi(np.ones(4, np.float32)), mask=call[4])
    assert cache.get(call_identity(other) + ("shape",)) is None   # other objects: another key
    del score, call
    gc.collect()
    assert len(cache) == 0                                   # the entry left with its mod


def test_a_recycled_id_finds_no_entry():
    """Lookups trust the ids in the key: that is sound only because an entry leaves the
    moment one of its objects dies, before its id can be handed to a new object."""
    cache, mask, base = PreparedCalls(), mods.causal(), mods.softcap(3.0)
    ids, hits = set(), 0
    for _ in range(20):
        score = base.with_captures(base.captures)            # a new object, at an old id here
        ids.add(id(score))
        call = _call(score, mask=mask)
        key = call_identity(call)
        hits += cache.get(key) is not None
        cache.add(key, call, lambda: "entry")
        cache.add(key, call, lambda: "entry")
        assert cache.get(key) == "entry"
        del score, call                                      # no gc: refcounting alone
    assert len(ids) < 20, "no id was recycled: the test proves nothing"
    assert hits == 0


def test_capacity_bounds_the_cache():
    cache = PreparedCalls(capacity=3)
    keep = [mods.softcap(float(i + 1)) for i in range(5)]
    for i, m in enumerate(keep):
        call = _call(m)
        for _ in range(2):
            cache.add(("k", i), call, lambda i=i: i)
    assert len(cache) == 3 and cache.get(("k", 4)) == 4
    assert cache.get(("k", 0)) is None


def test_function_keyed_entries_die_with_the_arrays_they_name():
    cache = PreparedCalls()
    slopes = np.linspace(0.1, 0.5, 4).astype(np.float32)
    call = _call(lambda s, b, h, q, kv: s + slopes[h] * (kv - q))
    key = call_identity(call) + ("shape",)
    for _ in range(2):
        cache.add(key, call, lambda: "entry")
    assert cache.get(key) == "entry"
    del call
    gc.collect()
    assert cache.get(key) == "entry"          # the lambda died: the array it named lives
    slopes = None   # noqa: F841
    gc.collect()
    assert len(cache) == 0


def test_torch_block_masks_have_an_identity_and_end_entries_when_they_die():
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    cache = PreparedCalls()
    bm = torch_create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 256, 256, device="cpu")
    call = _call(block_mask=bm)
    key = call_identity(call) + ("shape",)
    for _ in range(2):
        cache.add(key, call, lambda: "entry")
    assert cache.get(key) == "entry"
    del bm, call
    gc.collect()
    assert len(cache) == 0


def test_capture_args_convert_as_rarely_as_each_capture_allows():
    """``kernel_path.CaptureArgs``: numbers and read-only arrays converted once; arrays with
    a ``same_memory`` key once per key (an update in place costs nothing, a new storage
    converts again); writeable host arrays, or keys of None, every launch."""
    from flexattn.core.kernel_path import CaptureArgs

    class Tensor:   # a framework tensor on the GPU: same_memory keys it by its pointer
        def __init__(self, ptr):
            self.ptr = ptr

    conversions = []

    def args_for(captures, **kw):
        def convert():
            conversions.append(1)
            return tuple(c.ptr if isinstance(c, Tensor) else c for c in captures)
        same = lambda x: x.ptr if isinstance(x, Tensor) and x.ptr is not None else None   # noqa: E731
        return CaptureArgs(captures, convert, same, wrap=lambda a: ("wrapped",) + a, **kw)

    frozen = np.arange(4)
    frozen.flags.writeable = False
    args = args_for((3.0, frozen))
    assert len(conversions) == 1 and args.current() == ("wrapped", 3.0, frozen) and len(conversions) == 1

    conversions.clear()
    t = Tensor(100)
    args = args_for((2, t))
    assert not conversions                         # nothing converted before the first launch
    assert args.current() == ("wrapped", 2, 100) and args.current() == ("wrapped", 2, 100)
    assert len(conversions) == 1                   # once for this pointer
    t.ptr = 200                                    # the storage rebound (``x.data = ...``)
    assert args.current() == ("wrapped", 2, 200) and len(conversions) == 2
    t.ptr = None                                   # not readable in place now: per launch
    args.current(), args.current()
    assert len(conversions) == 4

    conversions.clear()
    writeable = np.arange(4)                       # host array: copied at every launch
    args = args_for((writeable,))
    args.current(), args.current()
    assert len(conversions) == 2
    args = args_for((writeable, 5), stable=(writeable,))   # ... unless the plan owns it
    args.current(), args.current()
    assert len(conversions) == 3
    conversions.clear()
    per_launch = CaptureArgs((Tensor(1),), lambda: conversions.append(1) or (1,))   # no same_memory
    per_launch.current(), per_launch.current()
    assert len(conversions) == 2
