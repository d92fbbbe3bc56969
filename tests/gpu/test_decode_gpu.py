"""GPU: the split-KV decode kernel against a float64 reference.

Randomized steps: q_len 1..16, cache lengths not multiples of the tile, GQA ratios 1/4/8,
contiguous and paged caches (pages smaller than, equal to and larger than the tile, in
shuffled order), mods none / causal / sliding window / ALiBi / softcap, splits forced
from 1 to many. Outputs, LSE and the split workspace are NaN-poisoned before launch.
Whole steps through the adapter: queued without a sync (more steps than the pinned
staging ring has slots, plans alternating), from several threads and streams, and on
the repeated-step path (no planning).
The splits are merged inside the decode kernel (the last split CTA of each group, counted
by tickets; or, polled, the last to start, reading slots that mark themselves written):
the tickets must be zero again after every launch, and the polled merge's partials too
(those are "poisoned" by being zero: unwritten). Skipped without CUDA.
"""

import dataclasses
import math
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cutlass")

import flexattn.torch as fa  # noqa: E402
import flexattn.torch.devices as fa_devices  # noqa: E402
from flexattn import mods  # noqa: E402
from flexattn.core import decode_path  # noqa: E402
from flexattn.kernels.decode.polled_merge import chunk_splits  # noqa: E402
from flexattn.core.kernel_path import Device  # noqa: E402
from flexattn.kernels.launch import cache as kernel_cache  # noqa: E402

DEV = "cuda"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def reference(q, k, v, lengths, scale, score_fn=None, mask_fn=None):
    """float64 decode on logical K/V [B, Hkv, cap, D]: query row i of sequence b at
    position lengths[b] - q_len + i, keys < lengths[b]. -> (out, lse)."""
    q, k, v = (t.double() for t in (q, k, v))
    B, Hq, n, _ = q.shape
    group = Hq // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    L = torch.as_tensor(lengths, device=q.device).view(B, 1, 1, 1).long()
    b = torch.arange(B, device=q.device).view(B, 1, 1, 1)
    h = torch.arange(Hq, device=q.device).view(1, Hq, 1, 1)
    qi = torch.arange(n, device=q.device).view(1, 1, n, 1) + L - n
    ki = torch.arange(k.shape[2], device=q.device).view(1, 1, 1, -1)
    if score_fn is not None:
        s = score_fn(s, b, h, qi, ki)
    keep = ki < L
    if mask_fn is not None:
        keep = keep & mask_fn(b, h, qi, ki)
    s = s.masked_fill(~keep.expand_as(s), -math.inf)
    lse = torch.logsumexp(s, -1)
    p = torch.where(torch.isfinite(lse)[..., None], torch.exp(s - lse[..., None]), torch.zeros_like(s))
    return p @ v, lse


def variant(kind, Hq, window=None):
    """-> (mask, score, mask_fn, score_fn) at true positions."""
    if kind == "none":
        return None, None, None, None
    if kind == "causal":
        return mods.causal(), None, lambda b, h, q, k: q >= k, None
    if kind == "window":
        w = random.choice([17, 100, 700]) if window is None else window
        return (mods.sliding_window(w), None, lambda b, h, q, k: (q >= k) & (q - k <= w), None)
    if kind == "alibi":
        slopes = torch.from_numpy(mods.alibi_slopes(Hq)).to(DEV).double()
        return (mods.causal(), mods.alibi(num_heads=Hq), lambda b, h, q, k: q >= k,
                lambda s, b, h, q, k: s + slopes[h] * (k - q))
    if kind == "softcap":
        cap = random.choice([5.0, 30.0])
        return None, mods.softcap(cap), None, lambda s, b, h, q, k: cap * torch.tanh(s / cap)
    raise ValueError(kind)


def make_cache(B, Hkv, cap, D, lengths, dtype, page_size):
    """(cache for the kernel, logical K, logical V); paged caches get shuffled pages."""
    k = torch.randn(B, Hkv, cap, D, device=DEV, dtype=dtype)
    v = torch.randn(B, Hkv, cap, D, device=DEV, dtype=dtype)
    lens = torch.tensor(lengths, dtype=torch.int32)
    if not page_size:
        return fa.KVCache(k, v, lens), k, v
    per_seq = cap // page_size
    n_pages = B * per_seq + 5
    perm = torch.randperm(n_pages)[: B * per_seq]
    table = perm.view(B, per_seq).to(torch.int32).to(DEV)
    pages = [torch.full((n_pages, page_size, Hkv, D), float("nan"), device=DEV, dtype=dtype) for _ in range(2)]
    for src, dst in ((k, pages[0]), (v, pages[1])):
        dst[table.long()] = src.view(B, Hkv, per_seq, page_size, D).permute(0, 2, 3, 1, 4)
    return fa.PagedKVCache(pages[0], pages[1], table, lens), k, v


def make_paged(k, v, lengths, page_size):
    """A paged cache in shuffled pages holding logical K/V [B, Hkv, cap, D] as they are."""
    B, Hkv, cap, D = k.shape
    per_seq = cap // page_size
    table = torch.randperm(B * per_seq).view(B, per_seq).to(torch.int32).to(DEV)
    pages = [torch.empty((B * per_seq, page_size, Hkv, D), device=DEV, dtype=k.dtype) for _ in range(2)]
    for src, dst in ((k, pages[0]), (v, pages[1])):
        dst[table.long()] = src.view(B, Hkv, per_seq, page_size, D).permute(0, 2, 3, 1, 4)
    return fa.PagedKVCache(pages[0], pages[1], table, torch.tensor(lengths, dtype=torch.int32))


_WORKSPACES = {}


def workspace():
    """The torch adapter's decode workspace (tickets, pinned staging ring) with partials
    NaN-poisoned before every step (and positions buffers: -1), one per stream, kept (so
    plans are reused)."""
    stream = torch.cuda.current_stream()
    hit = _WORKSPACES.get(stream.cuda_stream)
    if hit is None:
        ws = fa_devices._decode_workspace(torch.device(DEV, torch.cuda.current_device()), stream)
        scratch = [torch.empty(0, device=DEV)]

        def alloc(shape, dtype):
            return torch.full(shape, float("nan") if dtype == "float32" else -1, device=DEV,
                              dtype=getattr(torch, dtype))

        def poisoned_scratch(n):
            if scratch[0].numel() < n:
                scratch[0] = torch.empty(n, device=DEV)
            return scratch[0].fill_(float("nan"))     # in stream order, before the step's kernel

        hit = _WORKSPACES[stream.cuda_stream] = decode_path.DecodeWorkspace(
            alloc, ws.tickets, poisoned_scratch, ws.uploader, marked_scratch=ws.marked_scratch, zeroed=ws.zeroed)
    return hit


def assert_marked_zero():
    """Every polled merge leaves the partials' slots it read as it found them: zero."""
    marked = workspace().marked_scratch(1)
    assert int(marked.count_nonzero()) == 0, marked.nonzero().flatten()[:16].tolist()


@pytest.fixture(params=["analysis", "band"])
def prefix(request, monkeypatch):
    """A window's masked prefix by the kernel's interval analysis (FLEXATTN_DECODE_BAND_PREFIX=0),
    or by arithmetic from the band's bound (``decode_path.band_prefix``, planned); plans made
    under the other setting dropped."""
    monkeypatch.setenv("FLEXATTN_DECODE_BAND_PREFIX", "1" if request.param == "band" else "0")
    decode_path._PREPARED.clear()
    yield request.param
    decode_path._PREPARED.clear()


@pytest.fixture(params=["tickets", "polled"])
def merge(request, monkeypatch):
    """Both merges of split CTAs without a cluster (``decode_path.polled_merge_pays``); plans
    made under the other setting dropped (a plan reads it once)."""
    monkeypatch.setenv("FLEXATTN_DECODE_MERGE", "tickets" if request.param == "tickets" else "auto")
    decode_path._PREPARED.clear()
    yield request.param
    decode_path._PREPARED.clear()


def assert_tickets_zero():
    """Every launch leaves its arrival counters as it found them: zero."""
    tickets = workspace().tickets(1)
    assert int(tickets.count_nonzero()) == 0, tickets.nonzero().flatten().tolist()


@pytest.fixture(params=["split", "group"])
def slot_layout(request, monkeypatch):
    """The polled slots split-major or group-major (FLEXATTN_DECODE_SLOT_LAYOUT,
    ``decode_path.slot_views``); plans made under the other setting dropped."""
    monkeypatch.setenv("FLEXATTN_DECODE_SLOT_LAYOUT", request.param)
    decode_path._PREPARED.clear()
    yield request.param
    decode_path._PREPARED.clear()


def run_kernel(q, cache, mask, score, num_sms, tuning=None, num_splits=None, sync=True):
    """decode_into with poisoned outputs and workspace."""
    B, Hq, n, D = q.shape
    out = torch.full((B, Hq, n, D), float("nan"), device=DEV, dtype=q.dtype)
    lse = torch.full((B, Hq, n), float("nan"), device=DEV)

    from flexattn.torch.devices import _DeviceCopies

    device = Device(torch.cuda.current_stream().cuda_stream, _DeviceCopies(torch.device(DEV)), tvm_ffi_stream=True)
    step = decode_path.decode_into(q, cache, out, lse, decode_path.DecodeSite(device, num_sms, workspace()),
                                   decode_path.DecodeMods(score, mask),
                                   overrides=decode_path.DecodeOverrides(tuning, num_splits))
    if sync:
        torch.cuda.synchronize()
    return out, lse, step


# Compiles dominate the run time: the random draws share a few configs (D 128 bf16, each
# mod kind x {contiguous, pages of 64, pages of 16}); three extra cases cover fp16 / D 64,
# pages larger than the tile and two consumer warpgroups (group 8 x q_len 16 = 128 rows).
CASES = []
_rng = random.Random(5)
for i in range(21):
    group = _rng.choice([1, 4, 8])
    CASES.append(dict(
        q_len=_rng.choice([1, 1, 2, 5, 8] + ([16] if group < 8 else [])),
        group=group, Hkv=_rng.choice([1, 2]), B=_rng.choice([1, 2, 3]), D=128, dtype="bf16",
        page_size=[0, 64, 16][(i // 5) % 3],
        kind=["none", "causal", "window", "alibi", "softcap"][i % 5],
        num_sms=_rng.choice([1, 8, 132]),      # 1 SM: never split; 132: several splits
        seed=i,
    ))
CASES += [
    dict(q_len=3, group=4, Hkv=2, B=2, D=64, dtype="fp16", page_size=256, kind="window", num_sms=132, seed=100),
    dict(q_len=16, group=8, Hkv=1, B=2, D=64, dtype="bf16", page_size=0, kind="causal", num_sms=132, seed=101),
    dict(q_len=1, group=8, Hkv=2, B=3, D=128, dtype="bf16", page_size=128, kind="alibi", num_sms=132, seed=102),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "q{q_len}-g{group}-h{Hkv}-b{B}-d{D}-{dtype}-p{page_size}-{kind}-sm{num_sms}".format(**c))
def test_decode_matches_reference(case):
    random.seed(case["seed"])
    torch.manual_seed(case["seed"])
    B, Hkv, n, D = case["B"], case["Hkv"], case["q_len"], case["D"]
    Hq = Hkv * case["group"]
    cap = 1024 if case["page_size"] != 256 else 1280
    lengths = [random.randint(n, cap) for _ in range(B)]
    lengths[0] = cap - random.randint(0, 3)                  # near-full, not tile-aligned
    dtype = DTYPES[case["dtype"]]
    cache, k, v = make_cache(B, Hkv, cap, D, lengths, dtype, case["page_size"])
    q = torch.randn(B, Hq, n, D, device=DEV, dtype=dtype)
    mask, score, mask_fn, score_fn = variant(case["kind"], Hq)
    out, lse, step = run_kernel(q, cache, mask, score, case["num_sms"])
    want, want_lse = reference(q, k, v, lengths, 1 / math.sqrt(D), score_fn, mask_fn)
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-3, rtol=1e-3)
    assert_tickets_zero()


# Head dims beyond 64 / 128 (kernel_path.DECODE_HEAD_DIMS: every multiple of 16 from 32 to 256).
NEW_HEAD_DIMS = (32, 80, 96, 144, 192, 256)


@pytest.mark.parametrize("D", NEW_HEAD_DIMS)
@pytest.mark.parametrize("kind,page_size,group,q_len,num_sms", [
    ("alibi", 0, 4, 1, 132),       # several splits: the pair-cluster merge or tickets
    ("window", 64, 8, 16, 132),    # two consumer warpgroups (128 packed rows), paged
    ("softcap", 16, 1, 3, 1),      # one split: no merge
])
def test_decode_head_dims_against_reference(D, kind, page_size, group, q_len, num_sms):
    """Multiples of 16 from 32 to 256 (strided lane columns where not a multiple of 32;
    ``decode_path.fit_head_dim``'s rings beyond 128): poisoned outputs and workspace,
    float64 reference."""
    torch.manual_seed(D + q_len)
    random.seed(D)
    B, Hkv = 2, 2
    Hq = Hkv * group
    lengths = [1000, 301]
    cache, k, v = make_cache(B, Hkv, 1024, D, lengths, torch.bfloat16, page_size)
    q = torch.randn(B, Hq, q_len, D, device=DEV, dtype=torch.bfloat16)
    mask, score, mask_fn, score_fn = variant(kind, Hq, window=300)
    out, lse, _ = run_kernel(q, cache, mask, score, num_sms)
    want, want_lse = reference(q, k, v, lengths, 1 / math.sqrt(D), score_fn, mask_fn)
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-3, rtol=1e-3)
    assert_tickets_zero()


class WindowSteps:
    """Decode steps of a 4096-key sliding window over caches of ``lengths`` (Hkv 8, GQA
    group 4, bf16, head dim ``D``), queued back to back with a fresh query each
    (``run``), then each checked against the float64 reference (``check``)."""

    def __init__(self, lengths: list, D: int, cap: int = 16384):
        self.lengths, self.D, self.Hq = lengths, D, 32
        self.cache, self.k, self.v = make_cache(len(lengths), 8, cap, D, lengths, torch.bfloat16, 0)
        self.mask, self.score, self.mask_fn, self.score_fn = variant("window", self.Hq, window=4096)
        self.steps = []

    def run(self, **overrides):
        """One step (``run_kernel``'s tuning / num_splits), not synchronized -> its plan step."""
        q = torch.randn(len(self.lengths), self.Hq, 1, self.D, device=DEV, dtype=torch.bfloat16)
        out, lse, step = run_kernel(q, self.cache, self.mask, self.score, 132, sync=False, **overrides)
        self.steps.append((q, out, lse))
        return step

    def check(self):
        for q, out, lse in self.steps:
            want, want_lse = reference(q, self.k, self.v, self.lengths, 1 / math.sqrt(self.D), self.score_fn,
                                       self.mask_fn)
            assert not out.isnan().any() and not lse.isnan().any()
            torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(lse.double(), want_lse, atol=2e-3, rtol=1e-3)


def test_parity_slots_across_steps_and_split_counts(slot_layout, monkeypatch):
    """FLEXATTN_DECODE_SLOTS=parity (``DecodeConfig.parity_slots``), split-major and
    group-major: steps queued back to back with new queries and split counts that shrink
    and grow (the splits zero their slots of the other set, including slots a larger last
    launch wrote past this launch's count), each against the float64 reference; the
    partials' views have the launch's split count in mode 0 (the grid's). Afterwards the
    workspace's shared slots and tickets are untouched (zero), and each group's phase word
    holds count 0, the parity of the launches on the plan, and the last step's split count."""
    monkeypatch.setenv("FLEXATTN_DECODE_SLOTS", "parity")
    decode_path._PREPARED.clear()
    torch.manual_seed(3)
    window = WindowSteps([16384 - 389, 9000], 128)
    counts = [13, 5, 13, 7, 3, 13, 11, 11]
    plans = []
    for n in counts:
        step = window.run(num_splits=n)
        assert step.num_splits == n and step.config.parity_slots and step.config.polled_merge, step
        assert tuple(step.plan._parity_slots(n)[0].shape)[0] == n    # (mode 0: the grid's splits)
        plans.append(step.plan)
    torch.cuda.synchronize()
    decode_path._PREPARED.clear()
    assert_tickets_zero()
    assert_marked_zero()
    # (the prepared-call cache keeps a plan from a call's second sighting: the first step's
    # plan is another, with its own memory; the last plan served every step from the second)
    launches = sum(p is plans[-1] for p in plans)
    assert launches == len(counts) - 1, launches
    words = step.plan._parity_parts[3][2 * 8:].long()     # (past B 2 x Hkv 8 tickets)
    assert ((words & 0xFFFF) == 0).all() and (((words >> 16) & 1) == launches % 2).all(), words
    assert ((words >> 24) == counts[-1]).all(), words
    window.check()


def test_balanced_splits_across_uneven_counts(monkeypatch):
    """FLEXATTN_DECODE_BALANCED=1 (``DecodeConfig.balanced_splits``): split ranges whose
    sizes differ by at most one, at counts that leave the ceil split short or empty (14,
    15, 16 of a window's 65 blocks; 5; 3), steps queued back to back, each against the
    float64 reference; and the planner's count untrimmed (16 for B 1's window)."""
    monkeypatch.setenv("FLEXATTN_DECODE_BALANCED", "1")
    decode_path._PREPARED.clear()
    torch.manual_seed(4)
    window = WindowSteps([16384 - 389, 9000], 128)
    tuning = dataclasses.replace(decode_path.DEFAULT_TUNING, cluster_merge=False)
    for n in [14, 15, 16, 5, 3, None]:
        step = window.run(tuning=None if n is None else tuning, num_splits=n)
        assert step.config.balanced_splits and (n is None or step.num_splits == n), step
    torch.cuda.synchronize()
    decode_path._PREPARED.clear()
    assert_tickets_zero()
    window.check()


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("chunks", ["exact", "generic"])
def test_merge_chunk_across_split_counts(D, chunks, monkeypatch):
    """``DecodeConfig.merge_chunk``: a window's polled merge loading exactly the launch's
    split count in its first round (FLEXATTN_DECODE_MERGE_CHUNK=exact, planned), or the head
    dim's chunk clamped (generic) — counts below, at and past the chunk (D 256: 8, so 13 and
    20 take later rounds either way), steps queued back to back, each against the float64
    reference; tickets and slots as they were."""
    monkeypatch.setenv("FLEXATTN_DECODE_MERGE_CHUNK", chunks)
    decode_path._PREPARED.clear()
    torch.manual_seed(D + 1)
    window = WindowSteps([16384 - 389, 9000], D)
    tuning = dataclasses.replace(decode_path.DEFAULT_TUNING, cluster_merge=False)   # (fitted to D by the plan)
    chunk = chunk_splits(D)
    for n in [13, 20, 3, 13, 2]:
        step = window.run(tuning=tuning, num_splits=n)
        want = n if chunks == "exact" and n <= chunk else 0
        assert step.config.polled_merge and step.num_splits == n and step.config.merge_chunk == want, step
    torch.cuda.synchronize()
    decode_path._PREPARED.clear()
    assert_tickets_zero()
    assert_marked_zero()
    window.check()


@pytest.mark.parametrize("D", [32, 64, 96, 128, 256])
def test_polled_merge_planned_for_a_long_window_step(D, prefix, slot_layout):
    """The planner's B 1 sliding-window step (many splits, no cluster) merges polled: the
    split that started last polls the others' partial slots. Three steps queued back to
    back with new queries (each finds the slots the one before emptied), each against the
    float64 reference; tickets and slots zero afterwards."""
    torch.manual_seed(D)
    window = WindowSteps([16384 - 389], D)
    for _ in range(3):
        step = window.run()
    torch.cuda.synchronize()
    assert step.config.polled_merge and step.config.cluster_splits == 1 and step.num_splits > 2, step
    assert (step.config.prefix_band is not None) == (prefix == "band")
    assert_tickets_zero()
    assert_marked_zero()
    window.check()


def window_head_poisoned(B, Hq, Hkv, n, D, cap, lengths, w, block, score_fn=None):
    """A causal `w`-key window over one sequence's cache whose keys before the window's
    first `block`-key block are NaN (a kernel visiting them poisons O) -> (k, v, q, and
    the float64 reference's out, lse on the cache with those keys zeroed)."""
    first_block = (lengths[0] - n - w) // block * block
    k = torch.randn(B, Hkv, cap, D, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    k[:, :, :first_block] = float("nan")
    v[:, :, :first_block] = float("nan")
    q = torch.randn(B, Hq, n, D, device=DEV, dtype=torch.bfloat16)
    want, want_lse = reference(q, k.nan_to_num(0.0), v.nan_to_num(0.0), lengths, 1 / math.sqrt(D), score_fn,
                               lambda b, h, q_, k_: (q_ >= k_) & (q_ - k_ <= w))
    return k, v, q, want, want_lse


def test_window_skips_blocks_and_many_splits(prefix):
    """A long cache with a short window: the kernel skips the cache's head by itself — keys
    before the window's first 128-key block are NaN (any visit would poison O) — and B 1
    splits wide, also with the other tunings. The planner sizes the splits by the ~17
    blocks the window leaves (``live_blocks``), not the cache's 313."""
    torch.manual_seed(0)
    B, Hq, Hkv, n, D, cap = 1, 16, 2, 1, 128, 20032
    lengths = [19999]
    w = 1000
    slopes = torch.from_numpy(mods.alibi_slopes(Hq)).to(DEV).double()
    k, v, q, want, want_lse = window_head_poisoned(B, Hq, Hkv, n, D, cap, lengths, w, 128,
                                                   lambda s, b, h, q_, k_: s + slopes[h] * (k_ - q_))
    for page_size, tuning in ((64, None), (0, TUNINGS[1]), (16, TUNINGS[2])):
        cache = make_paged(k, v, lengths, page_size) if page_size else fa.KVCache(k, v, torch.tensor(lengths, dtype=torch.int32))
        out, lse, step = run_kernel(q, cache, mods.sliding_window(w), mods.alibi(num_heads=Hq), 132, tuning)
        assert step.num_splits > 1
        assert (step.config.prefix_band is not None) == (prefix == "band")
        t = tuning or decode_path.DEFAULT_TUNING
        live = decode_path.live_blocks(mods.sliding_window(w), B, Hq, n, lengths[0], t.tile_n)
        assert live == -(-lengths[0] // t.tile_n) - (lengths[0] - n - w) // t.tile_n
        assert step.num_splits == decode_path.choose_launch(B, Hkv, 1, live, 132, t)[1]
        torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse.double(), want_lse, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("tiles", ["start", "aligned"])
@pytest.mark.parametrize("q_len", [1, 3])
def test_band_tiles_start_at_the_first_key(tiles, q_len, monkeypatch):
    """A window over a cache view that ends at the length (``k[:, :, :L]``). Its kv tiles
    start at the band's first key (``band_start_tiles``, planned for contiguous caches) and
    the last overhangs the view's end, where the TMA reads nothing: every key below the first
    is NaN, so a visit below it would poison O. Aligned tiles (FLEXATTN_DECODE_BAND_TILES=
    aligned) start at the multiple of the tile below (NaN only under a multiple of 128).
    Windows whose first key is off a tile, on one and at 0; B 1 and 2, Hq 32 Hkv 8."""
    monkeypatch.setenv("FLEXATTN_DECODE_BAND_TILES", tiles)
    decode_path._PREPARED.clear()
    torch.manual_seed(q_len)
    Hq, Hkv, D = 32, 8, 128
    for B, L, w in ((1, 20000, 4096), (2, 4999, 1000), (1, 4097 + q_len - 1, 4096), (1, 3001, 77), (1, 8192 + q_len, 4095)):
        first = max(L - q_len - w, 0)
        poisoned = first if tiles == "start" else first // 128 * 128
        k = torch.randn(B, Hkv, L + 100, D, device=DEV, dtype=torch.bfloat16)[:, :, :L]
        v = torch.randn(B, Hkv, L + 100, D, device=DEV, dtype=torch.bfloat16)[:, :, :L]
        k[:, :, :poisoned] = float("nan")
        v[:, :, :poisoned] = float("nan")
        q = torch.randn(B, Hq, q_len, D, device=DEV, dtype=torch.bfloat16)
        lengths = [L] * B
        want, want_lse = reference(q, k.nan_to_num(0.0), v.nan_to_num(0.0), lengths, 1 / math.sqrt(D), None,
                                   lambda b, h, q_, k_: (q_ >= k_) & (q_ - k_ <= w))
        cache = fa.KVCache(k, v, torch.tensor(lengths, dtype=torch.int32))
        out, lse, step = run_kernel(q, cache, mods.sliding_window(w), None, 132)
        assert step.config.band_start_tiles == (tiles == "start"), (B, L, w)
        torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse.double(), want_lse, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("page_size", [0, 16, 64, 256])
@pytest.mark.parametrize("q_len", [1, 3])
def test_nan_past_the_length_stays_out(page_size, q_len, monkeypatch):
    """A cache allocated with ``torch.empty`` may hold NaN / Inf bits past each sequence's
    length; the bound block reads them (a cache longer than the length, a page's tail) and
    P = 0 times a NaN V row is NaN. By default (FLEXATTN_DECODE_V_OVERHANG=auto) such steps
    take the kernel that zeroes those V rows before P V (``DecodeConfig.zero_v_overhang``),
    as with "zero": K and V are NaN past every length (lengths off the tile and the page),
    contiguous and paged, no mask and a window (band-start tiles where contiguous), against
    the float64 reference; without it ("keep") the same contiguous step is NaN, so the test
    sees the hazard. A cache whose lengths all reach its rows keeps the kernel without it."""
    torch.manual_seed(100 + page_size + q_len)
    B, Hq, Hkv, D, cap, w = 3, 16, 4, 128, 2048, 300
    lengths = [1000 + q_len, 37 + q_len, 2047]
    k = torch.randn(B, Hkv, cap, D, device=DEV, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    for b, L in enumerate(lengths):
        k[b, :, L:] = float("nan")
        v[b, :, L:] = float("inf") if b == 1 else float("nan")
    q = torch.randn(B, Hq, q_len, D, device=DEV, dtype=torch.bfloat16)
    cache = make_paged(k, v, lengths, page_size) if page_size else \
        fa.KVCache(k, v, torch.tensor(lengths, dtype=torch.int32))
    clean = [t.masked_fill(~torch.isfinite(t), 0.0) for t in (k, v)]
    for setting in ("auto", "zero", "keep"):
        monkeypatch.setenv("FLEXATTN_DECODE_V_OVERHANG", setting)
        decode_path._PREPARED.clear()
        for mask, mask_fn in ((None, None), (mods.sliding_window(w), lambda b, h, q_, k_: (q_ >= k_) & (q_ - k_ <= w))):
            out, lse, step = run_kernel(q, cache, mask, None, 132)
            assert step.config.zero_v_overhang == (setting != "keep")
            if setting == "keep":
                if not page_size and mask is None:
                    assert out.isnan().any()   # the hazard the zeroing removes
                continue
            want, want_lse = reference(q, *clean, lengths, 1 / math.sqrt(D), None, mask_fn)
            assert not out.isnan().any() and not lse.isnan().any(), (page_size, mask)
            torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(lse.double(), want_lse, atol=2e-3, rtol=1e-3)
    monkeypatch.setenv("FLEXATTN_DECODE_V_OVERHANG", "auto")
    decode_path._PREPARED.clear()
    if not page_size:   # every length at the cache's rows: nothing read past them
        full = fa.KVCache(*clean, torch.full((B,), cap, dtype=torch.int32))
        out, lse, step = run_kernel(q, full, None, None, 132)
        assert not step.config.zero_v_overhang
        want, want_lse = reference(q, *clean, [cap] * B, 1 / math.sqrt(D), None, None)
        torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    decode_path._PREPARED.clear()


@pytest.mark.parametrize("page_size,num_splits", [(0, 16), (64, 16), (16, 8)])
def test_wide_clusters_merge_window_splits(page_size, num_splits):
    """A cluster of 16 CTAs (a non-portable size) and of 8 merge a window's splits; the
    planner's own choice is tickets (10 splits). Keys before the window are NaN (a visit
    would poison O), outputs poisoned, vs the float64 reference. (The kernel also merged
    clusters of 10 correctly here before the sizes were limited to powers of two.)"""
    torch.manual_seed(21)
    B, Hq, Hkv, n, D, cap = 1, 8, 2, 2, 128, 20032
    lengths = [19999]
    w = 2500
    k, v, q, want, want_lse = window_head_poisoned(B, Hq, Hkv, n, D, cap, lengths, w, 64)
    cache = make_paged(k, v, lengths, page_size) if page_size else fa.KVCache(k, v, torch.tensor(lengths, dtype=torch.int32))
    planned = decode_path.choose_launch(B, Hkv, 1, decode_path.live_blocks(mods.sliding_window(w), B, Hq, n,
                                                                           lengths[0], 64), 132)
    assert planned == (decode_path.DEFAULT_TUNING, 10, 1)
    out, lse, step = run_kernel(q, cache, mods.sliding_window(w), None, 132, num_splits=num_splits)
    assert (step.num_splits, step.config.cluster_splits) == (num_splits, num_splits)
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-3, rtol=1e-3)
    assert_tickets_zero()


TUNINGS = [decode_path.DEFAULT_TUNING,
           decode_path.DecodeTuning(tile_n=128, num_stages=3, ctas_per_sm=1),
           decode_path.DecodeTuning(tile_n=64, num_stages=6)]


@pytest.mark.parametrize("tuning", TUNINGS[1:], ids=["t128s3", "t64s6"])
@pytest.mark.parametrize("kind,page_size,num_splits", [("alibi", 64, None), ("window", 16, 7), ("none", 0, 1)])
def test_tunings_match_reference(tuning, kind, page_size, num_splits):
    """The other kernel shapes (64-key tiles, two CTAs per SM) and forced split counts."""
    random.seed(7)
    torch.manual_seed(7)
    B, Hkv, group, n, D, cap = 3, 2, 4, 2, 128, 2048
    lengths = [cap - 5, 700, 65]
    cache, k, v = make_cache(B, Hkv, cap, D, lengths, torch.bfloat16, page_size)
    q = torch.randn(B, Hkv * group, n, D, device=DEV, dtype=torch.bfloat16)
    mask, score, mask_fn, score_fn = variant(kind, Hkv * group)
    out, lse, step = run_kernel(q, cache, mask, score, 132, tuning, num_splits)
    assert num_splits is None or step.num_splits == num_splits
    want, want_lse = reference(q, k, v, lengths, 1 / math.sqrt(D), score_fn, mask_fn)
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-3, rtol=1e-3)


def test_adapter_stepping_never_recompiles():
    """fa.decode token by token on a paged cache: kernel path, reference-equal, and after
    the first steps (one split count, then another) no new compile."""
    torch.manual_seed(1)
    B, Hq, Hkv, D, page = 2, 8, 2, 128, 64
    max_pages = 40
    k_pages = torch.zeros(B * max_pages, page, Hkv, D, device=DEV, dtype=torch.bfloat16)
    v_pages = torch.zeros_like(k_pages)
    table = torch.randperm(B * max_pages, device=DEV).view(B, max_pages).to(torch.int32)
    start = np.array([300, 1000])
    cache = fa.PagedKVCache(k_pages, v_pages, table, torch.tensor(start, dtype=torch.int32))
    k_all = torch.randn(B, Hkv, 1200, D, device=DEV, dtype=torch.bfloat16)
    v_all = torch.randn_like(k_all)
    for b in range(B):
        cache.assign(b, np.arange(start[b]), k_all[b, :, : start[b]], v_all[b, :, : start[b]])
    score = mods.alibi(num_heads=Hq)
    counts = []
    for t in range(6):
        new_k = torch.stack([k_all[b, :, start[b] + t: start[b] + t + 1] for b in range(B)])
        new_v = torch.stack([v_all[b, :, start[b] + t: start[b] + t + 1] for b in range(B)])
        cache.append(new_k, new_v)
        q = torch.randn(B, Hq, 1, D, device=DEV, dtype=torch.bfloat16)
        out, lse = fa.decode(q, cache, score_mod=score, mask=mods.sliding_window(500), return_lse=True)
        counts.append(kernel_cache.compile_count())
        lengths = (start + t + 1).tolist()
        logical = torch.zeros(B, Hkv, 1200, D, device=DEV, dtype=torch.bfloat16)
        for b in range(B):
            logical[b, :, : lengths[b]] = k_all[b, :, : lengths[b]]
        logical_v = torch.zeros_like(logical)
        for b in range(B):
            logical_v[b, :, : lengths[b]] = v_all[b, :, : lengths[b]]
        slopes = torch.from_numpy(mods.alibi_slopes(Hq)).to(DEV).double()
        want, want_lse = reference(q, logical, logical_v, lengths, 1 / math.sqrt(D),
                                   lambda s, b, h, q_, k_: s + slopes[h] * (k_ - q_),
                                   lambda b, h, q_, k_: (q_ >= k_) & (q_ - k_ <= 500))
        torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse.double(), want_lse, atol=2e-3, rtol=1e-3)
    assert counts[-1] == counts[1], counts


def test_adapter_takes_the_attention_path_where_the_decode_kernel_cannot():
    """Steps the decode kernel cannot take — head dim 16, pages of 48 keys — run as the ordinary attention problem (the forward kernel, on the logical K/V)
    instead of failing: against the float64 reference, causal, with ALiBi. The direct
    kernel entry (decode_into) still refuses them before any launch."""
    torch.manual_seed(3)
    mask, score, mask_fn, score_fn = variant("alibi", 8)
    for D, page_size in ((16, 0), (128, 48)):
        lengths = [150, 96]
        cache, k, v = make_cache(2, 2, 192, D, lengths, torch.bfloat16, page_size)
        q = torch.randn(2, 8, 3, D, device=DEV, dtype=torch.bfloat16)
        out, lse = fa.decode(q, cache, score_mod=score, mask=mask, return_lse=True)
        want, want_lse = reference(q, k, v, lengths, 1 / math.sqrt(D), score_fn, mask_fn)
        torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse.double(), want_lse, atol=2e-3, rtol=1e-3)
    q = torch.randn(1, 4, 1, 16, device=DEV, dtype=torch.bfloat16)
    k = torch.zeros(1, 2, 64, 16, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head dims"):
        run_kernel(q, fa.KVCache(k, k.clone(), torch.tensor([5], dtype=torch.int32)), None, None, 132)


def test_long_cache_many_splits():
    """B 1, 20k tokens, no mask: dozens of splits merged in the kernel."""
    torch.manual_seed(2)
    B, Hq, Hkv, n, D, cap = 1, 8, 2, 3, 128, 20032
    lengths = [20001]
    cache, k, v = make_cache(B, Hkv, cap, D, lengths, torch.bfloat16, 0)
    q = torch.randn(B, Hq, n, D, device=DEV, dtype=torch.bfloat16)
    out, lse, step = run_kernel(q, cache, None, mods.softcap(20.0), 132)
    assert step.num_splits >= 30
    want, want_lse = reference(q, k, v, lengths, 1 / math.sqrt(D), lambda s, b, h, q_, k_: 20.0 * torch.tanh(s / 20.0))
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-3, rtol=1e-3)


# --- the in-kernel merge: the last split CTA of each group merges -------------------------

# (group, Hkv, q_len, page_size, kind, num_splits): GQA 1/4/8, splits 1 / 2 / many (more
# splits than some sequences have blocks: empty splits), contiguous and paged, with mods.
FUSED_CASES = [
    (1, 2, 1, 0, "none", 1),
    (4, 2, 1, 0, "alibi", 2),
    (8, 1, 3, 64, "window", 2),
    (4, 2, 2, 16, "softcap", 23),
    (8, 2, 1, 0, "causal", 40),
    (1, 4, 5, 64, "alibi", 40),
    # the cluster merge (2, 4, 8 splits): empty splits, paged, two consumer warpgroups
    (4, 2, 1, 0, "alibi", 4),
    (1, 4, 5, 64, "softcap", 8),
    (8, 1, 16, 16, "causal", 4),
    (4, 2, 2, 16, "window", 8),
]


@pytest.mark.parametrize("group,Hkv,q_len,page_size,kind,num_splits", FUSED_CASES,
                         ids=lambda v: str(v))
def test_fused_merge_matches_reference(group, Hkv, q_len, page_size, kind, num_splits, merge):
    """In-kernel merge vs the float64 reference; poisoned outputs and partials; tickets
    (and the polled merge's slots) zero afterwards."""
    random.seed(11)
    torch.manual_seed(11)
    B, D, cap = 3, 128, 2048
    Hq = Hkv * group
    lengths = [cap - 3, 777, 70]                 # 70 keys: 2 blocks, most splits empty
    cache, k, v = make_cache(B, Hkv, cap, D, lengths, torch.bfloat16, page_size)
    q = torch.randn(B, Hq, q_len, D, device=DEV, dtype=torch.bfloat16)
    mask, score, mask_fn, score_fn = variant(kind, Hq)
    out, lse, step = run_kernel(q, cache, mask, score, 132, num_splits=num_splits)
    assert step.num_splits == num_splits
    assert step.config.cluster_splits == (num_splits if num_splits in (2, 4, 8) else 1)
    assert step.config.polled_merge == (merge == "polled" and step.config.cluster_splits == 1 and 1 < num_splits <= 32)
    assert_tickets_zero()
    assert_marked_zero()
    want, want_lse = reference(q, k, v, lengths, 1 / math.sqrt(D), score_fn, mask_fn)
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("page_size,kind", [(0, "alibi"), (64, "window"), (16, "none")])
def test_planned_pair_clusters(page_size, kind):
    """The planner's own choice for B 8 x Hkv 8 with long caches: one CTA per SM, a deep
    ring and 2 splits merged by a cluster pair (``choose_launch``) — vs the float64
    reference, outputs poisoned, lengths not multiples of the tile, one sequence short."""
    random.seed(13)
    torch.manual_seed(13)
    B, Hkv, group, D, cap = 8, 8, 4, 128, 2304
    lengths = [cap - random.randint(0, 63) for _ in range(B - 1)] + [600]
    cache, k, v = make_cache(B, Hkv, cap, D, lengths, torch.bfloat16, page_size)
    q = torch.randn(B, Hkv * group, 1, D, device=DEV, dtype=torch.bfloat16)
    # A window as long as most of the cache: the planner sizes splits by the blocks visited.
    mask, score, mask_fn, score_fn = variant(kind, Hkv * group, window=2000)
    out, lse, step = run_kernel(q, cache, mask, score, 132)
    assert (step.num_splits, step.config.cluster_splits, step.config.ctas_per_sm) == (2, 2, 1)
    want, want_lse = reference(q, k, v, lengths, 1 / math.sqrt(D), score_fn, mask_fn)
    assert not out.isnan().any() and not lse.isnan().any()
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-3, rtol=1e-3)
    assert_tickets_zero()


def test_fused_tickets_survive_repeats_and_shape_changes(merge):
    """One ticket buffer across steps queued without a sync in between: the same shape with
    other split counts, then another shape (other groups, GQA, q_len), then the first
    again — a counter left non-zero by any launch would make a later group merge early
    (NaN from the poisoned partials) or never (NaN outputs). Polled: one zeroed partials'
    buffer across the same steps — a slot left written would be merged as the next step's
    (a wrong output, not NaN), a slot never written would trap."""
    torch.manual_seed(12)
    shapes = [dict(B=3, Hkv=2, group=4, q_len=1, lengths=[1500, 900, 130], page=0),
              dict(B=2, Hkv=4, group=1, q_len=3, lengths=[2000, 64], page=64)]
    made = []
    for sh in shapes:
        cache, k, v = make_cache(sh["B"], sh["Hkv"], 2048, 128, sh["lengths"], torch.bfloat16, sh["page"])
        made.append((sh, cache, k, v))
    plan = [(0, 5), (0, 5), (0, 2), (0, 17), (1, 9), (1, 1), (1, 31), (0, 5), (0, None)]
    pending = []
    for i, splits in plan:
        sh, cache, k, v = made[i]
        q = torch.randn(sh["B"], sh["Hkv"] * sh["group"], sh["q_len"], 128, device=DEV, dtype=torch.bfloat16)
        out, lse, step = run_kernel(q, cache, None, mods.alibi(num_heads=sh["Hkv"] * sh["group"]), 132,
                                    num_splits=splits, sync=False)
        pending.append((sh, k, v, q, out, lse))
    torch.cuda.synchronize()
    assert_tickets_zero()
    assert_marked_zero()
    for sh, k, v, q, out, lse in pending:
        slopes = torch.from_numpy(mods.alibi_slopes(q.shape[1])).to(DEV).double()
        want, want_lse = reference(q, k, v, sh["lengths"], 1 / math.sqrt(128),
                                   lambda s, b, h, q_, k_: s + slopes[h] * (k_ - q_))
        assert not out.isnan().any() and not lse.isnan().any()
        torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse.double(), want_lse, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("same_mods", [True, False], ids=["one-plan", "new-mods"])
def test_adapter_async_steps_match_reference(same_mods):
    """fa.decode steps queued back to back (no sync): the lengths/offsets of each step go
    up from pinned staging asynchronously while the host already appends the next token
    and plans the next step; each step must see its own lengths — also when the steps
    share one plan (the same mod objects: one positions buffer, rewritten every step in
    stream order)."""
    torch.manual_seed(13)
    B, Hq, Hkv, D, cap = 2, 8, 2, 128, 4096
    start = [2500, 1200]
    k_all = torch.randn(B, Hkv, cap, D, device=DEV, dtype=torch.bfloat16)
    v_all = torch.randn_like(k_all)
    k = torch.zeros_like(k_all)
    v = torch.zeros_like(v_all)
    cache = fa.KVCache(k, v, torch.tensor(start, dtype=torch.int32))
    for b in range(B):
        k[b, :, : start[b]] = k_all[b, :, : start[b]]
        v[b, :, : start[b]] = v_all[b, :, : start[b]]
    slopes = torch.from_numpy(mods.alibi_slopes(Hq)).to(DEV).double()
    score, mask = mods.alibi(num_heads=Hq), mods.causal()
    steps = []
    for t in range(12):
        cache.append(torch.stack([k_all[b, :, start[b] + t: start[b] + t + 1] for b in range(B)]),
                     torch.stack([v_all[b, :, start[b] + t: start[b] + t + 1] for b in range(B)]))
        q = torch.randn(B, Hq, 1, D, device=DEV, dtype=torch.bfloat16)
        if not same_mods:
            score, mask = mods.alibi(num_heads=Hq), mods.causal()
        out, lse = fa.decode(q, cache, score_mod=score, mask=mask, return_lse=True)
        steps.append(([s + t + 1 for s in start], q, out, lse))
    torch.cuda.synchronize()
    assert_tickets_zero()
    for lengths, q, out, lse in steps:
        want, want_lse = reference(q, k_all, v_all, lengths, 1 / math.sqrt(D),
                                   lambda s, b, h, q_, k_: s + slopes[h] * (k_ - q_), lambda b, h, q_, k_: q_ >= k_)
        torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse.double(), want_lse, atol=2e-3, rtol=1e-3)


# --- whole steps: the repeated-step path, the staging ring, threads and streams ------------

def _alibi_causal_ref(q, k, v, lengths):
    Hq = q.shape[1]
    slopes = torch.from_numpy(mods.alibi_slopes(Hq)).to(DEV).double()
    return reference(q, k, v, lengths, 1 / math.sqrt(q.shape[-1]), lambda s, b, h, q_, k_: s + slopes[h] * (k_ - q_),
                     lambda b, h, q_, k_: q_ >= k_)


def test_many_queued_steps_alternating_plans():
    """150 fa.decode steps queued without a sync (more than twice the staging ring's 64
    slots, so it laps and waits on its fences), alternating a contiguous and a paged cache
    with their own mods (two plans sharing one ring), new lengths every step (set, not
    appended: any stale upload shows). Every step must see its own lengths."""
    torch.manual_seed(21)
    random.seed(21)
    B, Hq, Hkv, D, cap = 2, 8, 2, 128, 1024
    contiguous, k, v = make_cache(B, Hkv, cap, D, [cap, cap], torch.bfloat16, 0)
    paged = make_paged(k, v, [cap, cap], 64)
    mods_of = [(mods.alibi(num_heads=Hq), mods.causal()), (mods.alibi(num_heads=Hq), mods.causal())]
    steps = []
    for t in range(150):
        which = t % 2
        cache = (contiguous, paged)[which]
        lengths = [random.randint(1, cap) for _ in range(B)]
        cache.lengths = torch.tensor(lengths, dtype=torch.int32)
        q = torch.randn(B, Hq, 1, D, device=DEV, dtype=torch.bfloat16)
        score, mask = mods_of[which]
        out, lse = fa.decode(q, cache, score_mod=score, mask=mask, return_lse=True)
        steps.append((lengths, q, out, lse))
    torch.cuda.synchronize()
    assert_tickets_zero()
    for lengths, q, out, lse in steps:
        want, want_lse = _alibi_causal_ref(q, k, v, lengths)
        torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse.double(), want_lse, atol=2e-3, rtol=1e-3)


def test_repeated_steps_skip_planning(monkeypatch):
    """After two sightings a step goes straight to its plan: with the planner made to fail,
    repeated steps still run and match the reference (return_lse or not, an int64 page
    table converted per step); new mod objects do plan again."""
    torch.manual_seed(22)
    B, Hq, Hkv, D, cap = 3, 16, 2, 128, 2048
    lengths = [2000, 700, 65]
    cache, k, v = make_cache(B, Hkv, cap, D, lengths, torch.bfloat16, 64)
    cache.page_table = cache.page_table.long()
    score, mask = mods.alibi(num_heads=Hq), mods.causal()
    q = torch.randn(B, Hq, 1, D, device=DEV, dtype=torch.bfloat16)
    for _ in range(2):
        fa.decode(q, cache, score_mod=score, mask=mask)

    def no_planning(*a, **kw):
        raise AssertionError("planned again")

    monkeypatch.setattr(decode_path, "_plan_for", no_planning)
    want, want_lse = _alibi_causal_ref(q, k, v, lengths)
    out = fa.decode(q, cache, score_mod=score, mask=mask)
    out2, lse = fa.decode(q, cache, score_mod=score, mask=mask, return_lse=True)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out2.double(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double(), want_lse, atol=2e-3, rtol=1e-3)
    with pytest.raises(ValueError, match="query tokens"):      # lengths still checked per step
        cache.lengths = torch.tensor([2000, 0, 65], dtype=torch.int32)
        fa.decode(q, cache, score_mod=score, mask=mask)
    cache.lengths = torch.tensor(lengths, dtype=torch.int32)
    with pytest.raises(AssertionError, match="planned again"):
        fa.decode(q, cache, score_mod=mods.alibi(num_heads=Hq), mask=mask)


@pytest.mark.parametrize("streams", ["one-stream", "own-streams"])
def test_steps_from_threads(streams):
    """Two threads stepping decoders of the same shape and mods at once, queued without a
    sync: on one stream they share a plan and its positions buffer (the workspace's lock
    keeps each launch right after its own upload); on streams of their own each has its
    workspace (ring, tickets, partials) and plan."""
    import threading

    torch.manual_seed(23)
    B, Hq, Hkv, D, cap = 2, 8, 2, 128, 1024
    score, mask = mods.alibi(num_heads=Hq), mods.causal()
    made = [make_cache(B, Hkv, cap, D, [cap, cap], torch.bfloat16, 0) for _ in range(2)]
    results, errors = [[], []], []
    barrier = threading.Barrier(2)

    def work(i):
        try:
            stream = torch.cuda.Stream() if streams == "own-streams" else torch.cuda.default_stream()
            cache = made[i][0]
            rng = random.Random(i)
            with torch.cuda.stream(stream):
                barrier.wait()
                for _ in range(40):
                    lengths = [rng.randint(1, cap) for _ in range(B)]
                    cache.lengths = torch.tensor(lengths, dtype=torch.int32)
                    q = torch.randn(B, Hq, 1, D, device=DEV, dtype=torch.bfloat16)
                    out, lse = fa.decode(q, cache, score_mod=score, mask=mask, return_lse=True)
                    results[i].append((lengths, q, out, lse))
                stream.synchronize()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    torch.cuda.synchronize()
    assert not errors, errors
    for i in range(2):
        _, k, v = made[i]
        assert len(results[i]) == 40
        for lengths, q, out, lse in results[i]:
            want, want_lse = _alibi_causal_ref(q, k, v, lengths)
            torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)
            torch.testing.assert_close(lse.double(), want_lse, atol=2e-3, rtol=1e-3)


def test_paged_decode_steps_under_compile():
    """``fa.decode`` over a PagedKVCache (pages of 64, shuffled) in a compiled step
    (``flexattn::decode_paged``, written in session 46 when the device time was spent: run
    it): mod values, the lengths growing in place; each step equals the eager step, which
    the decode kernel runs (both read the same pages in place)."""
    torch.manual_seed(61)
    B, Hq, Hkv, D, page, pages_per_seq = 2, 16, 4, 128, 64, 32
    n_pages = B * pages_per_seq
    k_pages, v_pages = (torch.randn(n_pages, page, Hkv, D, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    table = torch.randperm(n_pages, device=DEV).view(B, pages_per_seq).to(torch.int32)
    cache = fa.PagedKVCache(k_pages, v_pages, table, torch.tensor([700, 1500], device=DEV, dtype=torch.int32))
    score, window = mods.alibi(torch.rand(Hq, device=DEV) * 0.01), mods.sliding_window(1023)

    def step(q, cache):
        return fa.decode(q, cache, score_mod=score, mask=window, return_lse=True)

    compiled = torch.compile(step, fullgraph=True)
    for _ in range(3):
        q = torch.randn(B, Hq, 1, D, device=DEV, dtype=torch.bfloat16)
        (out, lse), (want, want_lse) = compiled(q, cache), step(q, cache)
        torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse, want_lse, atol=1e-3, rtol=1e-3)
        cache.lengths += 33
