"""Decoding on the reference path: KV caches (contiguous, paged), true positions in mods."""

import math

import numpy as np
import pytest
import torch

import flexattn
import flexattn.torch as fa
from flexattn import KVCache, PagedKVCache, mods
from flexattn.problem.decode import decode_problem
from flexattn.mods.positions import limit_keys, shift_queries


def _naive_decode(q, k, v, lengths, mask_fn=None, score_fn=None, scale=None):
    """Per sequence: queries at positions L-q_len.., keys 0..L-1, mods on true positions."""
    B, Hq, n, D = q.shape
    group = Hq // k.shape[1]
    scale = 1 / math.sqrt(D) if scale is None else scale
    out = np.zeros(q.shape[:3] + (v.shape[-1],))
    for b in range(B):
        L = int(lengths[b])
        for h in range(Hq):
            qi = np.arange(L - n, L)[:, None]
            ki = np.arange(L)[None, :]
            s = (q[b, h] @ k[b, h // group, :L].T) * scale
            if score_fn is not None:
                s = score_fn(s, b, h, qi, ki)
            if mask_fn is not None:
                s = np.where(mask_fn(b, h, qi, ki), s, -np.inf)
            s = s - s.max(-1, keepdims=True)
            p = np.exp(s)
            out[b, h] = (p / p.sum(-1, keepdims=True)) @ v[b, h // group, :L]
    return out


def _random_cache(rng, B, Hkv, cap, D, lengths):
    k = rng.standard_normal((B, Hkv, cap, D))
    v = rng.standard_normal((B, Hkv, cap, D))
    return KVCache(k, v, np.asarray(lengths, dtype=np.int32))


def _paged_copy(rng, cache: KVCache, page_size):
    """The same logical content as ``cache`` in shuffled pages."""
    B, H, cap, D = cache.k.shape
    pages_per_seq = cap // page_size
    perm = rng.permutation(B * pages_per_seq + 3)[: B * pages_per_seq]  # spare pages unused
    table = perm.reshape(B, pages_per_seq).astype(np.int32)
    k_pages = np.full((B * pages_per_seq + 3, page_size, H, D), np.nan)
    v_pages = np.full_like(k_pages, np.nan)
    paged = PagedKVCache(k_pages, v_pages, table, cache.lengths.copy())
    for b in range(B):
        paged.assign(b, np.arange(cap), cache.k[b], cache.v[b])
    return paged


@pytest.mark.parametrize("q_len", [1, 3, 16])
@pytest.mark.parametrize("variant", ["none", "causal", "window", "alibi", "prefix+softcap"])
def test_decode_matches_naive(q_len, variant):
    rng = np.random.default_rng(q_len * 7 + len(variant))
    B, Hq, Hkv, cap, D = 3, 8, 2, 160, 16
    lengths = rng.integers(q_len, cap + 1, size=B)
    cache = _random_cache(rng, B, Hkv, cap, D, lengths)
    q = rng.standard_normal((B, Hq, q_len, D))
    slopes = mods.alibi_slopes(Hq)
    table = {
        "none": (None, None, None, None),
        "causal": (mods.causal(), None, lambda b, h, qi, ki: qi >= ki, None),
        "window": (mods.sliding_window(20), None, lambda b, h, qi, ki: (qi >= ki) & (qi - ki <= 20), None),
        "alibi": (mods.causal(), mods.alibi(num_heads=Hq), lambda b, h, qi, ki: qi >= ki,
                  lambda s, b, h, qi, ki: s + slopes[h] * (ki - qi)),
        "prefix+softcap": (mods.prefix_lm(10), mods.softcap(2.0), lambda b, h, qi, ki: (ki < 10) | (qi >= ki),
                           lambda s, b, h, qi, ki: 2.0 * np.tanh(s / 2.0)),
    }
    mask, score, mask_fn, score_fn = table[variant]
    out = flexattn.decode(q, cache, score_mod=score, mask=mask)
    want = _naive_decode(q, cache.k, cache.v, lengths, mask_fn, score_fn)
    np.testing.assert_allclose(out, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("page_size", [16, 32, 64])
def test_paged_equals_contiguous(page_size):
    rng = np.random.default_rng(page_size)
    B, Hq, Hkv, cap, D = 2, 4, 4, 256, 8
    cache = _random_cache(rng, B, Hkv, cap, D, rng.integers(4, cap + 1, size=B))
    paged = _paged_copy(rng, cache, page_size)
    q = rng.standard_normal((B, Hq, 4, D))
    m = mods.causal() & mods.sliding_window(50)
    a = flexattn.decode(q, cache, mask=m, score_mod=mods.softcap(3.0))
    b = flexattn.decode(q, paged, mask=m, score_mod=mods.softcap(3.0))
    np.testing.assert_array_equal(a, b)


def test_stepping_a_decoder_equals_full_causal_attention():
    """Token by token through a paged cache = one causal pass over the whole sequence."""
    rng = np.random.default_rng(1)
    B, Hq, Hkv, S, D, page = 2, 4, 2, 40, 8, 16
    q_all, k_all, v_all = (rng.standard_normal((B, h, S, D)) for h in (Hq, Hkv, Hkv))
    pages = np.zeros((B * 3, page, Hkv, D)), np.zeros((B * 3, page, Hkv, D))
    table = np.arange(B * 3, dtype=np.int32)[::-1].reshape(B, 3).copy()
    cache = PagedKVCache(pages[0], pages[1], table, np.zeros(B, dtype=np.int32))
    score = mods.alibi(num_heads=Hq)
    keys = set()
    outs = []
    for t in range(S):
        cache.append(k_all[:, :, t:t + 1], v_all[:, :, t:t + 1])
        outs.append(flexattn.decode(q_all[:, :, t:t + 1], cache, score_mod=score, mask=mods.causal()))
        _, _, spec = decode_problem(q_all[:, :, t:t + 1], cache, score, mods.causal())
        keys.add((spec.mask.structure_key, spec.score.structure_key))
    full = flexattn.flex_attention(q_all, k_all, v_all, score=score, mask=mods.causal(), enable_gqa=True)
    np.testing.assert_allclose(np.concatenate(outs, axis=2), full, rtol=1e-10, atol=1e-10)
    assert len(keys) == 1  # every step has the same structure: one compiled kernel


def test_position_transforms():
    off = np.array([5, 0])
    lens = np.array([7, 3])
    m = limit_keys(shift_queries(mods.causal(), off), lens)
    q, kv = np.arange(2)[:, None], np.arange(8)[None, :]
    np.testing.assert_array_equal(m(0, 0, q, kv), (q + 5 >= kv) & (kv < 7))
    np.testing.assert_array_equal(m(1, 0, q, kv), (q >= kv) & (kv < 3))
    s = shift_queries(mods.alibi(np.array([1.0])), off)
    np.testing.assert_allclose(s(np.zeros((2, 8)), 0, 0, q, kv), 1.0 * (kv - (q + 5)))
    with pytest.raises(TypeError):
        shift_queries(42, off)


def test_torch_decode_and_cache_append():
    rng = np.random.default_rng(2)
    B, Hq, Hkv, cap, D = 2, 4, 2, 64, 8
    k = torch.zeros(B, Hkv, cap, D, dtype=torch.float64)
    v = torch.zeros_like(k)
    cache = fa.KVCache(k, v, torch.tensor([0, 5], dtype=torch.int32))
    new = [torch.from_numpy(rng.standard_normal((B, Hkv, 6, D))) for _ in range(2)]
    cache.append(*new)
    assert cache.lengths.tolist() == [6, 11]
    assert torch.equal(cache.k[1, :, 5:11], new[0][1]) and torch.equal(cache.k[0, :, :6], new[0][0])
    q = torch.from_numpy(rng.standard_normal((B, Hq, 2, D)))
    out, lse = fa.decode(q, cache, mask=mods.causal(), return_lse=True)
    want = flexattn.decode(q.numpy(), KVCache(k.numpy(), v.numpy(), np.array([6, 11])), mask=mods.causal())
    torch.testing.assert_close(out, torch.from_numpy(want))
    assert lse.shape == (B, Hq, 2)


def test_decode_errors():
    rng = np.random.default_rng(3)
    cache = _random_cache(rng, 2, 2, 32, 8, [3, 10])
    with pytest.raises(ValueError, match="append them first"):
        flexattn.decode(rng.standard_normal((2, 2, 4, 8)), cache)
    with pytest.raises(ValueError, match="batch"):
        flexattn.decode(rng.standard_normal((3, 2, 1, 8)), cache)
    with pytest.raises(TypeError, match="KVCache"):
        flexattn.decode(rng.standard_normal((2, 2, 1, 8)), object())
    with pytest.raises(ValueError, match="overflows"):
        cache.append(np.zeros((2, 2, 30, 8)), np.zeros((2, 2, 30, 8)))
    with pytest.raises(ValueError, match="lengths"):
        KVCache(np.zeros((2, 1, 4, 2)), np.zeros((2, 1, 4, 2)), np.array([5, 0]))
    with pytest.raises(ValueError, match="page_table"):
        PagedKVCache(np.zeros((4, 16, 1, 2)), np.zeros((4, 16, 1, 2)), np.array([[0, 9]]), np.array([3]))


class _FakeStream:
    """A stream the test runs by hand: queued host->device copies read their source only
    when the 'GPU' reaches them, as a real stream's do."""

    def __init__(self):
        self.ops, self.done, self.device = [], 0, {}

    def run(self, n=None):
        stop = len(self.ops) if n is None else min(len(self.ops), self.done + n)
        while self.done < stop:
            self.ops[self.done]()
            self.done += 1


def test_staging_ring_never_rewrites_a_slot_in_flight():
    """StagingRing over a hand-run stream that lags the host by random amounts: every copy,
    when it finally runs, reads the values its put wrote (a slot is rewritten only after
    its group's fence has passed), through laps of the ring and a growth of its slots."""
    from flexattn.core.decode_path import StagingRing

    rng = np.random.default_rng(0)
    stream = _FakeStream()
    memory = {}
    waits = []

    def host(nbytes):
        for old in memory.values():   # the old memory goes back to the allocator: reused
            old[:] = 255
        buf = np.zeros(nbytes, np.uint8)
        base = 1 << 20 * (len(memory) + 1)
        memory[base] = buf
        return buf, base

    def read(address, nbytes):
        for base, buf in memory.items():
            if base <= address < base + len(buf):
                return buf[address - base: address - base + nbytes].view(np.int32).tolist()
        raise AssertionError("copy from unknown memory")

    def copy(dst, src, nbytes):
        values = list(current)        # what the put being served has just written

        def op():
            got = read(src, nbytes)
            assert got == values, (got, values)
            stream.device[dst] = got
        stream.ops.append(op)

    class Fence:
        def __init__(self):
            self.at = None

        def record(self):
            self.at = len(stream.ops)

        def wait(self):
            waits.append(self.at - stream.done)
            stream.run(max(0, self.at - stream.done))

    ring = StagingRing(host, copy, Fence, slots=8, group=4, slot_bytes=16)
    puts = {count: ring.uploader(("dst", count), count) for count in (3, 4, 10)}   # 40 bytes: grows
    current = []
    for step in range(300):
        count = 10 if step > 150 and step % 3 == 0 else (4 if step % 2 else 3)
        current = rng.integers(0, 1 << 30, size=count).tolist()
        puts[count](current)
        stream.run(int(rng.integers(0, 3)))      # the GPU lags, sometimes far behind
    stream.run()
    assert ring.slot_bytes == 64 and any(w > 0 for w in waits)   # grew; the host did wait at times


def test_a_step_with_the_last_uploaded_lengths_skips_the_upload():
    """DecodePlan._stage uploads [lengths; offsets] into the plan's own positions buffer only
    when they differ from its last upload (the short-query door repeats a fixed cache
    length every call); a change uploads again, and so does going back."""
    from flexattn.core.decode_path import DEFAULT_TUNING, DecodePlan

    plan = object.__new__(DecodePlan)
    uploads = []
    plan.batch, plan.q_len, plan.capacity, plan.tuning = 2, 1, 4096, DEFAULT_TUNING
    plan._put, plan._uploaded = uploads.append, None
    plan._launches, plan._parts = {}, {}
    plan._part_sizes, plan.part_shapes = (8, 8), ((2, 4, 1, 1), (2, 4, 1))
    plan._scratch = lambda n: np.zeros(n, np.float32)
    plan._marked, plan.paged, plan._overhang = None, False, "auto"
    for lengths in ([100, 200], [100, 200], [100, 200], [101, 200], [101, 200], [100, 200]):
        plan._stage(lengths, 132, 2)
    assert uploads == [(100, 200, 99, 199), (101, 200, 100, 199), (100, 200, 99, 199)]


def test_steps_the_decode_kernel_cannot_take_are_attention_problems():
    """kernel_step: the split-KV kernel takes bf16/fp16 steps of at most 16 tokens at head
    dims that are multiples of 16 from 32 to 256 with pages it reads in place; other steps
    (head dim 16, pages of 48, float32) are ordinary attention problems (the forward kernel
    on the GPU)."""
    from flexattn.core.decode_device import kernel_step

    lens = torch.tensor([5], dtype=torch.int32)

    def contiguous(D, dtype=torch.bfloat16, q_len=1):
        k = torch.zeros(1, 2, 64, D, dtype=dtype)
        return torch.zeros(1, 4, q_len, D, dtype=dtype), KVCache(k, k.clone(), lens)

    assert kernel_step(*contiguous(128)) and kernel_step(*contiguous(64))
    assert kernel_step(*contiguous(96)) and kernel_step(*contiguous(256)) and not kernel_step(*contiguous(16))
    assert not kernel_step(*contiguous(128, torch.float32)) and not kernel_step(*contiguous(128, q_len=17))
    table = torch.zeros(1, 4, dtype=torch.int32)
    for page, takes in ((64, True), (16, True), (48, False)):
        pages = torch.zeros(4, page, 2, 128, dtype=torch.bfloat16)
        q = torch.zeros(1, 4, 1, 128, dtype=torch.bfloat16)
        assert kernel_step(q, PagedKVCache(pages, pages.clone(), table, lens)) is takes, page
