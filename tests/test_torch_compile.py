"""flexattn.torch under torch.compile (CPU): the custom op, fullgraph capture, gradients.

``aot_eager`` runs dynamo + AOT autograd (fake implementations, ``register_autograd``)
without inductor's C++ compile, which costs ~30 s per graph on a CPU runner.
"""

import numpy as np
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import flexattn
import flexattn.torch as fa
import flexattn.torch.ops as fa_ops
from flexattn import mods
from flexattn.core.registry import SpecRegistry

B, H, S, D = 2, 4, 40, 8
DOC = torch.zeros(S, dtype=torch.int64)
_DOC3 = torch.arange(S) * 3 // S      # three documents


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _qkv(seed=0, grad=True, S=S):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, S, D, generator=g, dtype=torch.float64).requires_grad_(grad) for _ in range(3)]


class AlibiAttention(torch.nn.Module):
    """Trainable ALiBi slopes captured by the score mod; causal block mask; lse used too."""

    def __init__(self):
        super().__init__()
        self.slopes = torch.nn.Parameter(torch.rand(H, dtype=torch.float64))
        self.score = mods.alibi(self.slopes) >> mods.softcap(4.0)
        self.block_mask = fa.create_block_mask(mods.causal(), None, None, S, S, BLOCK_SIZE=16)

    def forward(self, q, k, v):
        out, lse = fa.flex_attention(q, k, v, score_mod=self.score, block_mask=self.block_mask, return_lse=True)
        return out.square().sum() + lse.sum() * 0.1


def _grads(loss, tensors):
    loss.backward()
    got = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return got


def test_fullgraph_module_matches_eager_outputs_and_gradients():
    model = AlibiAttention()
    q, k, v = _qkv()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    tensors = (q, k, v, model.slopes)
    got = compiled(q, k, v)
    got_grads = _grads(got, tensors)
    want = model(q, k, v)
    want_grads = _grads(want, tensors)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    assert model.slopes.grad is None and got_grads[3].abs().sum() > 0

    with torch.no_grad():  # an optimizer-style in-place update: seen, no recompile
        model.slopes.mul_(1.5)
    torch.testing.assert_close(compiled(q, k, v), model(q, k, v), atol=1e-12, rtol=1e-12)
    assert counter.frame_count == 1


def test_compiled_training_step_updates_a_captured_bias():
    torch.manual_seed(0)

    class BiasAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bias = torch.nn.Parameter(torch.zeros(H, S, S, dtype=torch.float64))
            self.proj = torch.nn.Linear(D, D, dtype=torch.float64)
            doc = torch.tensor([0] * 15 + [1] * 25)
            self.score = flexattn.score_mod(lambda s, b, h, qi, ki: s + self.bias[h, qi, ki])
            self.mask = mods.document(doc) & mods.causal()  # a tensor captured by the mask

        def forward(self, x):
            q = self.proj(x)
            return fa.flex_attention(q, x, x, score=self.score, mask=self.mask)

    x = torch.randn(B, H, S, D, dtype=torch.float64)
    target = torch.randn(B, H, S, D, dtype=torch.float64)
    eager, comp = BiasAttention(), BiasAttention()
    comp.load_state_dict(eager.state_dict())

    def step(model, opt):
        opt.zero_grad()
        loss = (model(x) - target).square().mean()
        loss.backward()
        opt.step()
        return loss.detach()

    opts = [torch.optim.SGD(m.parameters(), lr=10.0) for m in (eager, comp)]
    forward = torch.compile(comp, backend="aot_eager", fullgraph=True)
    comp_step = lambda: step(forward, opts[1])  # noqa: E731  (the module call is compiled)
    losses = []
    for _ in range(3):
        losses.append((step(eager, opts[0]), comp_step()))
    for a, b in losses:
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
    assert losses[-1][1] < losses[0][1]
    assert comp.bias.abs().sum() > 0
    torch.testing.assert_close(comp.bias, eager.bias, atol=1e-12, rtol=1e-12)


def test_plain_functions_and_torch_block_masks_compile():
    from torch.nn.attention.flex_attention import create_block_mask

    doc = torch.tensor([0] * 12 + [1] * 28)
    tbm = create_block_mask(lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (qi >= ki), None, None, S, S,
                            device="cpu", BLOCK_SIZE=16)

    def softcap(s, b, h, qi, ki):
        return 3.0 * torch.tanh(s / 3.0)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.window = 3

        def forward(self, q, k, v):
            window = self.window

            def local(b, h, qi, ki):  # built inside the compiled code; captures no tensor
                return (qi - ki <= window) & (qi >= ki)

            return (fa.flex_attention(q, k, v, score_mod=softcap, block_mask=tbm)
                    + fa.flex_attention(q, k, v, mask=local))

    q, k, v = _qkv(1, grad=False)
    model = Model()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), model(q, k, v), atol=1e-12, rtol=1e-12)
    model.window = 9  # an int read by the closure: dynamo guards on it and recompiles
    torch.testing.assert_close(compiled(q, k, v), model(q, k, v), atol=1e-12, rtol=1e-12)


_BIAS = torch.randn(H, dtype=torch.float64, requires_grad=True)


def _global_bias(s, b, h, qi, ki):
    return s + _BIAS[h]


def test_functions_capturing_tensors_compile_as_graph_inputs():
    """A plain score function that reads tensors from its globals, closure cells (a closure
    made outside the compiled function) or defaults: one graph, the eager values, gradients
    reaching the tensors, and new values (updated in place) seen without recompiling. A
    tensor reached through an object's attribute asks for a mod value (a function made
    outside; inside the compiled code it works: test_score_functions_defined_inside_...)."""
    def make(table):
        def score(s, b, h, q_idx, kv_idx, shift=torch.full((H,), 0.25, dtype=torch.float64)):
            return _global_bias(s, b, h, q_idx, kv_idx) + table[h, 0] * (kv_idx - q_idx) + shift[h]
        return score

    table = torch.rand(H, 3, dtype=torch.float64, requires_grad=True)
    score = make(table)

    def step(q, k, v):
        return fa.flex_attention(q, k, v, score_mod=score)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    q, k, v = _qkv(2)
    got = compiled(q, k, v)
    grads = _grads(got.square().sum(), (q, k, v, _BIAS, table))
    want = step(q, k, v)
    torch.testing.assert_close(got, want)
    for a, b in zip(grads, _grads(want.square().sum(), (q, k, v, _BIAS, table))):
        torch.testing.assert_close(a, b)
    with torch.no_grad():
        table.mul_(3.0)
        _BIAS.add_(1.0)
    torch.testing.assert_close(compiled(q, k, v), step(q, k, v))
    assert counter.frame_count == 1

    class Holder:
        bias = torch.randn(H, dtype=torch.float64)

    holder = Holder()
    reads_attribute = lambda s, b, h, qi, ki: s + holder.bias[h]   # noqa: E731 (made outside)

    def via_attribute(q, k, v):
        return fa.flex_attention(q, k, v, score_mod=reads_attribute)

    torch._dynamo.reset()
    with pytest.raises(Exception, match="flexattn.score_mod|closure"):
        torch.compile(via_attribute, backend="aot_eager", fullgraph=True)(*_qkv(3, grad=False))


_DOCS = (torch.arange(S) // 13).to(torch.int32)


def test_mask_functions_reading_tensors_compile_as_graph_inputs():
    """A plain mask function reading tensors from its globals, a closure made outside or its
    defaults (with a trainable score beside it): one graph, the eager values and gradients,
    and new values — updated in place or a global rebound to another tensor — seen
    without recompiling."""
    global _DOCS

    def make(limit):
        def in_doc(b, h, q_idx, kv_idx, shift=torch.tensor([0], dtype=torch.int64)):
            return (_DOCS[q_idx] == _DOCS[kv_idx]) & (kv_idx <= q_idx + limit[0] + shift[0])
        return in_doc

    limit = torch.tensor([3])
    mask = make(limit)
    bias = torch.rand(H, dtype=torch.float64, requires_grad=True)
    score = lambda s, b, h, qi, ki: s + bias[h]  # noqa: E731

    def step(q, k, v):
        return fa.flex_attention(q, k, v, score_mod=score, mask=mask)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    q, k, v = _qkv(4)
    got = compiled(q, k, v)
    want = step(q, k, v)
    torch.testing.assert_close(got, want)
    for a, b in zip(_grads(got.square().sum(), (q, k, v, bias)), _grads(want.square().sum(), (q, k, v, bias))):
        torch.testing.assert_close(a, b)
    limit.fill_(-2)                                   # in place
    torch.testing.assert_close(compiled(q, k, v), step(q, k, v))
    old = _DOCS
    _DOCS = (torch.arange(S) // 7).to(torch.int32)     # rebound
    try:
        torch.testing.assert_close(compiled(q, k, v), step(q, k, v))
        assert not torch.equal(compiled(q, k, v), fa.flex_attention(
            q, k, v, score_mod=score, mask=lambda b, h, qi, ki: (old[qi] == old[ki]) & (ki <= qi - 2)))
    finally:
        _DOCS = old
    assert counter.frame_count == 1


def test_torch_block_masks_from_torch_combinators_inside_and_outside():
    """torch's create_block_mask with torch's and_masks, built inside the compiled function
    (graph lists: torch's HOP route, our op under Inductor; torch's own implementation
    under aot_eager) or outside (converted), and ours built inside: all equal."""
    from torch.nn.attention.flex_attention import and_masks
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def near(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= 9

    def inside(q, k, v):
        bm = torch_create_block_mask(and_masks(causal, near), None, None, S, S, device="cpu")
        return fa.flex_attention(q, k, v, block_mask=bm)

    q, k, v = _qkv(5, grad=False)
    outside = torch_create_block_mask(and_masks(causal, near), None, None, S, S, device="cpu")
    ours = lambda q, k, v: fa.flex_attention(q, k, v, block_mask=fa.create_block_mask(  # noqa: E731
        and_masks(causal, near), None, None, S, S))
    want = fa.flex_attention(q, k, v, block_mask=outside)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(lambda q, k, v: fa.flex_attention(q, k, v, block_mask=outside),
                                             backend="aot_eager", fullgraph=True)(q, k, v), want)
    torch.testing.assert_close(torch.compile(ours, backend="aot_eager", fullgraph=True)(q, k, v), want)
    for backend in ("inductor", "aot_eager"):
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(inside, backend=backend, fullgraph=True)(q, k, v), want)


def test_dynamic_sequence_lengths():
    mask = mods.sliding_window(5)
    f = torch.compile(lambda q, k, v: fa.flex_attention(q, k, v, mask=mask), backend="aot_eager",
                      fullgraph=True, dynamic=True)
    for s in (17, 29):
        q, k, v = _qkv(3, grad=False, S=s)
        torch.testing.assert_close(f(q, k, v), fa.flex_attention(q, k, v, mask=mask), atol=1e-12, rtol=1e-12)


def test_opcheck_custom_op():
    slopes = torch.rand(H, dtype=torch.float64, requires_grad=True)
    spec = flexattn.AttentionSpec.from_args(score=mods.alibi(slopes), mask=mods.causal())
    spec_id = fa_ops._REGISTRY.register(spec)
    q, k, v = _qkv(4)
    torch.library.opcheck(torch.ops.flexattn.attention_fwd.default, (q, k, v, [slopes], spec_id, [], None))


def test_opcheck_backward_op():
    """The backward op's schema, fake impl (shapes, contiguous strides) and real impl agree,
    with and without d_lse, for a strided query and a non-float buffer."""
    slopes = torch.rand(H, dtype=torch.float64)
    ids = torch.zeros(S, dtype=torch.int64)
    score = mods.score_mod(lambda s, b, h, q, kv: s + slopes[h] * (kv - q) + ids[q])
    spec_id = fa_ops._REGISTRY.register(flexattn.AttentionSpec.from_args(score=score, mask=mods.causal()))
    q, k, v = _qkv(6, grad=False)
    q = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, S, H, D] storage
    out, lse = torch.ops.flexattn.attention_fwd(q, k, v, [slopes, ids], spec_id, [], None)
    d_out = torch.randn_like(out)
    for d_lse in (None, torch.randn_like(lse)):
        torch.library.opcheck(torch.ops.flexattn.attention_bwd.default,
                              (q, k, v, out, lse, d_out, d_lse, [slopes, ids], spec_id, 1, [], None))


def test_registry_reuses_entries_and_stays_bounded():
    q, k, v = _qkv(5, grad=False)
    before = len(fa_ops._REGISTRY)
    for w in (3, 4, 5):  # equal structure, numbers by value: one entry per distinct window
        for _ in range(3):
            fa.flex_attention(q, k, v, mask=mods.sliding_window(w), score_mod=mods.alibi(torch.rand(H, dtype=torch.float64)))
    assert len(fa_ops._REGISTRY) - before <= 3
    registry = SpecRegistry(fa._is_tensor, capacity=4)
    ids = [registry.register(flexattn.AttentionSpec.from_args(mask=mods.document(np.zeros(S, np.int32))))
           for _ in range(10)]  # fresh arrays: new entries, oldest evicted
    assert len(registry) == 4 and len(set(ids)) == 10
    with pytest.raises(RuntimeError, match="no longer registered"):
        registry.get(ids[0])
    pinned = registry.register(flexattn.AttentionSpec.from_args(mask=mods.causal()), pin=True)
    for _ in range(10):
        registry.register(flexattn.AttentionSpec.from_args(mask=mods.document(np.zeros(S, np.int32))))
    assert registry.get(pinned).mask is not None


def test_registry_does_not_keep_score_tensors_alive():
    import gc
    import weakref

    q, k, v = _qkv(6, grad=False)
    slopes = torch.rand(H, dtype=torch.float64)
    ref = weakref.ref(slopes)
    fa.flex_attention(q, k, v, score_mod=mods.alibi(slopes))
    del slopes
    gc.collect()
    assert ref() is None


def test_mod_arguments_are_guarded_by_identity():
    """Mods reach the compile-time preparation by id() (dynamo guards on identity): a
    different mod object passed to the same compiled function recompiles and is honoured."""
    q, k, v = _qkv(grad=False)
    fn = torch.compile(lambda q, k, v, m: fa.flex_attention(q, k, v, score=m), fullgraph=True, backend="eager")
    for cap in (2.0, 0.5, 2.0):
        m = mods.softcap(cap)
        torch.testing.assert_close(fn(q, k, v, m), fa.flex_attention(q, k, v, score=m), rtol=1e-6, atol=1e-6)
    bm_a = fa.create_block_mask(mods.causal(), None, None, S, S)
    bm_b = fa.create_block_mask(mods.sliding_window(3), None, None, S, S)
    gn = torch.compile(lambda q, k, v, bm: fa.flex_attention(q, k, v, block_mask=bm), fullgraph=True, backend="eager")
    for bm in (bm_a, bm_b):
        torch.testing.assert_close(gn(q, k, v, bm), fa.flex_attention(q, k, v, block_mask=bm), rtol=1e-6, atol=1e-6)


def test_return_aux_max_scores_under_compile():
    """``return_aux=AuxRequest(max_scores=True)`` in one graph (the ``attention_fwd_max`` op):
    the eager values, and gradients through out and lse."""
    score = mods.alibi(torch.rand(H, dtype=torch.float64)) >> mods.softcap(4.0)
    bm = fa.create_block_mask(mods.causal(), None, None, S, S, BLOCK_SIZE=16)

    def step(q, k, v):
        out, aux = fa.flex_attention(q, k, v, score_mod=score, block_mask=bm,
                                     return_aux=fa.AuxRequest(lse=True, max_scores=True))
        return out, aux.lse, aux.max_scores

    _assert_max_scores_step_compiles(step, "aot_eager", _qkv(7))


def _assert_max_scores_step_compiles(step, backend, qkv, *rest):
    """``step(q, k, v, *rest) -> (out, lse, max_scores)`` compiled in one graph: the eager
    values, and the same gradients of q, k, v through out and lse."""
    counter = CompileCounterWithBackend(backend)
    got = torch.compile(step, backend=counter, fullgraph=True)(*qkv, *rest)
    want = step(*qkv, *rest)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    assert counter.frame_count == 1
    grads = _grads(got[0].sum() + got[1].sum(), qkv)
    for a, b in zip(grads, _grads(want[0].sum() + want[1].sum(), qkv)):
        torch.testing.assert_close(a, b)


def test_opcheck_max_scores_op():
    spec_id = fa_ops._REGISTRY.register(flexattn.AttentionSpec.from_args(score=mods.softcap(3.0), mask=mods.causal()))
    q, k, v = _qkv(8)
    torch.library.opcheck(torch.ops.flexattn.attention_fwd_max.default, (q, k, v, [], spec_id, [], None))


def test_create_block_mask_inside_the_compiled_function():
    """torch users build block masks inside the compiled step: module-level functions,
    closures over numbers, lambdas and torch's and_masks compile into one graph (fullgraph
    and not), equal to eager, without recompiling for new tensor values. A mask function
    that reads a tensor (a global, a closure's) is built by torch's create_block_mask in the
    graph (its lists computed each call: new values in place are seen); a mod value reading
    one is refused with the way out."""
    from torch.nn.attention.flex_attention import and_masks

    window = 9

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    def nested(q, k, v):
        def near(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx <= window) & (q_idx >= kv_idx)
        return fa.flex_attention(q, k, v, block_mask=fa.create_block_mask(near, None, None, S, S))

    def combinators(q, k, v):
        mask = and_masks(causal, lambda b, h, q_idx, kv_idx: q_idx - kv_idx < 20)
        return fa.flex_attention(q, k, v, block_mask=fa.create_block_mask(mask, None, None, S, S, BLOCK_SIZE=16))

    for step in (nested, combinators):
        for fullgraph in (True, False):
            torch._dynamo.reset()
            counter = CompileCounterWithBackend("aot_eager")
            compiled = torch.compile(step, backend=counter, fullgraph=fullgraph)
            for seed in (1, 2):
                q, k, v = _qkv(seed, grad=False)
                torch.testing.assert_close(compiled(q, k, v), step(q, k, v), atol=1e-12, rtol=1e-12)
            assert counter.frame_count == 1, (step.__name__, fullgraph)

    doc = _DOC3.clone()

    def reads_a_global(q, k, v):
        mask = fa.create_block_mask(lambda b, h, q_idx, kv_idx: _DOC3[q_idx] == _DOC3[kv_idx], None, None, S, S)
        return fa.flex_attention(q, k, v, block_mask=mask)

    def reads_a_closure(q, k, v):
        mask = fa.create_block_mask(lambda b, h, q_idx, kv_idx: (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx),
                                    None, None, S, S, BLOCK_SIZE=16)
        return fa.flex_attention(q, k, v, block_mask=mask)

    for step, ids in ((reads_a_global, _DOC3), (reads_a_closure, doc)):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("inductor")
        compiled = torch.compile(step, backend=counter, fullgraph=True)
        q, k, v = _qkv(3, grad=False)
        before = ids.clone()
        try:
            torch.testing.assert_close(compiled(q, k, v), step(q, k, v))
            ids.copy_(torch.roll(ids, 7))     # new ids in place: the lists are recomputed
            torch.testing.assert_close(compiled(q, k, v), step(q, k, v))
        finally:
            ids.copy_(before)
        assert counter.frame_count == 1, step.__name__

    documents = mods.document(_DOC3)   # (a mod value, made outside)

    def mod_value_reading_a_tensor(q, k, v):
        mask = fa.create_block_mask(documents, None, None, S, S)
        return fa.flex_attention(q, k, v, block_mask=mask)

    torch._dynamo.reset()
    with pytest.raises(Exception, match="build it with torch.s create_block_mask there"):
        torch.compile(mod_value_reading_a_tensor, backend="aot_eager", fullgraph=True)(*_qkv(3, grad=False))


_CAP = 1.0
_WINDOW = 10


def test_numbers_plain_functions_read_are_guarded():
    """A plain function's numbers (a global here) are baked into the compile-time trace and
    block mask: changing one must recompile, never leave the old value in use."""
    global _CAP, _WINDOW

    def score(s, b, h, q_idx, kv_idx):
        return s + _CAP * (kv_idx - q_idx) * 0.1

    def near(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx <= _WINDOW) & (q_idx >= kv_idx)

    def step(q, k, v):
        return fa.flex_attention(q, k, v, score_mod=score,
                                 block_mask=fa.create_block_mask(near, None, None, S, S, BLOCK_SIZE=16))

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    q, k, v = _qkv(4, grad=False)
    try:
        for cap, window in ((1.0, 10), (5.0, 10), (5.0, 3), (0.5, 20)):
            _CAP, _WINDOW = cap, window
            torch.testing.assert_close(compiled(q, k, v), step(q, k, v), atol=1e-12, rtol=1e-12)
    finally:
        _CAP, _WINDOW = 1.0, 10


def _assert_same_as_eager(compiled, eager, args, wrt):
    """``compiled(*args)`` and its gradients with respect to ``wrt`` equal ``eager``'s."""
    got = compiled(*args)
    got_grads = _grads(got, wrt)
    want = eager(*args)
    torch.testing.assert_close(got, want)
    for a, b in zip(got_grads, _grads(want, wrt)):
        torch.testing.assert_close(a, b)


# --- score functions defined inside the compiled code (flexattn/torch/nested.py) ---------------

_CAUSAL16 = fa.create_block_mask(mods.causal(), None, None, S, S, BLOCK_SIZE=16)


class NestedScore(torch.nn.Module):
    """As torch users write it: the score function defined in ``forward``, closing over the
    module's parameters (a per-head bias, a relative-position table) and a local number."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.bias = torch.nn.Parameter(torch.randn(H, generator=g, dtype=torch.float64))
        self.table = torch.nn.Parameter(torch.randn(H, 2 * S - 1, generator=g, dtype=torch.float64) * 0.3)

    def forward(self, q, k, v):
        cap = 4.0

        def score_mod(s, b, h, q_idx, kv_idx):
            s = s + self.bias[h] + self.table[h, q_idx - kv_idx + S - 1]
            return cap * torch.tanh(s / cap)

        out = fa.flex_attention(q, k, v, score_mod=score_mod, block_mask=_CAUSAL16, scale=0.3)
        return out.square().sum()


def test_score_functions_defined_inside_the_compiled_code():
    """A score function made in the compiled ``forward`` (torch's HOP captures it, our pass
    puts our op in its place): one graph under Inductor, the eager values and gradients
    (q, k, v and both parameters), and new parameter values without recompiling."""
    model = NestedScore()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    q, k, v = _qkv(5)
    _assert_same_as_eager(compiled, model, (q, k, v), (q, k, v, model.bias, model.table))
    for _ in range(3):
        with torch.no_grad():
            model.bias.add_(0.5)
            model.table.mul_(1.5)
        torch.testing.assert_close(compiled(q, k, v), model(q, k, v))
    assert counter.frame_count == 1


def test_the_pre_grad_pass_pickles_into_inductors_cache_key():
    """The pass the HOP route installs pickles (by reference to its class), as Inductor
    pickles its config into a cache key: torch 2.11 logged a traceback per compile for a
    local function there ("Failed to pickle cache key") and skipped its cache. It keeps no
    ``uuid()`` (it must run before the cache lookup) and chains a pass set before it."""
    import pickle

    import torch._inductor.config as inductor_config

    test_score_functions_defined_inside_the_compiled_code()   # installs the pass
    installed = inductor_config.pre_grad_custom_pass
    assert hasattr(installed, "flexattn_then") and not hasattr(installed, "uuid")
    again = pickle.loads(pickle.dumps(installed))
    assert type(again) is type(installed) and again.flexattn_then is installed.flexattn_then


def test_lambdas_defined_inside_the_compiled_code_with_gqa_and_lse():
    """A lambda over a tensor argument of the compiled function, with GQA and the LSE
    returned: equal to eager, gradients reaching the argument; new values of the
    argument never recompile."""
    def step(q, k, v, slopes):
        out, lse = fa.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s - slopes[h] * (qi - ki).abs(),
                                     enable_gqa=True, return_lse=True)
        return out.square().sum() + lse.sum()

    q = _qkv(6)[0]
    k, v = (t[:, : H // 2].detach().clone().requires_grad_() for t in _qkv(7)[:2])
    slopes = torch.rand(H, dtype=torch.float64, requires_grad=True)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    _assert_same_as_eager(compiled, step, (q, k, v, slopes), (q, k, v, slopes))
    for scale in (2.0, 0.5):
        new = (slopes.detach() * scale).requires_grad_()
        torch.testing.assert_close(compiled(q, k, v, new), step(q, k, v, new))
    assert counter.frame_count == 1


def test_mask_functions_defined_inside_the_compiled_code():
    """``mask=`` functions defined in the compiled code over tensor arguments (document ids),
    beside a score function defined there (slopes) or a mod value without tensors: equal
    to eager with gradients; new document ids and slopes never recompile."""
    cap = mods.softcap(3.0)     # mod values are built outside

    def step(q, k, v, docs, slopes):
        def same_doc(b, h, qi, ki):
            return (docs[qi] == docs[ki]) & (qi >= ki)

        def score(s, b, h, qi, ki):
            return s - slopes[h] * (qi - ki)

        out = fa.flex_attention(q, k, v, score_mod=score, mask=same_doc)
        return out.square().sum() + fa.flex_attention(q, k, v, score_mod=cap, mask=same_doc).sum()

    q, k, v = _qkv(8)
    slopes = torch.rand(H, dtype=torch.float64, requires_grad=True)
    docs = (torch.arange(S) // 11).to(torch.int32)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    _assert_same_as_eager(compiled, step, (q, k, v, docs, slopes), (q, k, v, slopes))
    for width in (5, 17):
        new_docs = (torch.arange(S) // width).to(torch.int32)
        torch.testing.assert_close(compiled(q, k, v, new_docs, slopes), step(q, k, v, new_docs, slopes))
    assert counter.frame_count == 1


def test_torch_block_masks_built_inside_the_compiled_code():
    """torch's own ``create_block_mask`` inside the compiled step, over a tensor argument
    (document ids, new each step), as torch users write document masking: its lists stay
    values of the graph and reach our op per call (torch's HOP route); equal to eager
    (the same torch block mask built outside, converted), with gradients; new ids never
    recompile. A score function defined there rides along."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    def step(q, k, v, docs, slopes):
        def same_doc(b, h, qi, ki):
            return (docs[qi] == docs[ki]) & (qi >= ki)

        bm = torch_create_block_mask(same_doc, None, None, S, S, device="cpu", BLOCK_SIZE=16)
        out = fa.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s - slopes[h] * (qi - ki), block_mask=bm)
        return out.square().sum()

    q, k, v = _qkv(9)
    slopes = torch.rand(H, dtype=torch.float64, requires_grad=True)
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for width in (11, 5, 17):
        docs = (torch.arange(S) // width).to(torch.int32)
        _assert_same_as_eager(compiled, step, (q, k, v, docs, slopes), (q, k, v, slopes))
    assert counter.frame_count == 1


def test_torch_block_masks_from_outside_are_guarded_by_identity():
    """A torch block mask passed into the compiled function (built outside) reaches the
    compile-time preparation (torch 2.11 and later); another one recompiles and is
    honoured."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    first = torch_create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S, device="cpu", BLOCK_SIZE=16)
    second = torch_create_block_mask(lambda b, h, qi, ki: qi - ki <= 3, None, None, S, S, device="cpu",
                                     BLOCK_SIZE=16)
    step = torch.compile(lambda q, k, v, bm: fa.flex_attention(q, k, v, block_mask=bm), backend="aot_eager",
                         fullgraph=True)
    q, k, v = _qkv(10, grad=False)
    for bm in (first, second, first):
        torch.testing.assert_close(step(q, k, v, bm), fa.flex_attention(q, k, v, block_mask=bm))


def test_functions_defined_inside_under_dynamic_shapes_and_mixed_with_outside_tensors():
    """Under dynamic shapes the HOP route drops the symbolic sizes dynamo lifts beside the
    tensors (two lengths, one graph, eager values); a mod value over tensors made outside
    beside a function defined inside over tensors is a clear error."""
    bias = torch.randn(H, dtype=torch.float64)

    def step(q, k, v, bias):
        return fa.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + bias[h])

    compiled = torch.compile(step, backend="inductor", fullgraph=True, dynamic=True)
    q, k, v = _qkv(11, grad=False)
    for n in (S, S - 7):
        args = (q[:, :, :n], k[:, :, :n], v[:, :, :n], bias)
        torch.testing.assert_close(compiled(*args), step(*args))

    alibi = mods.alibi(torch.rand(H, dtype=torch.float64))

    def mixed(q, k, v, docs):
        return fa.flex_attention(q, k, v, score_mod=alibi, mask=lambda b, h, qi, ki: docs[qi] == docs[ki])

    torch._dynamo.reset()
    with pytest.raises(Exception, match="write that one as a function"):
        torch.compile(mixed, backend="inductor", fullgraph=True)(q, k, v, _DOCS)


def test_functions_reading_outside_tensors_beside_a_block_mask_built_inside():
    """torch's create_block_mask inside the compiled step beside a score function reading a
    trainable tensor made outside (a global, or a closure defined outside): both through
    torch's HOP, dynamo lifting the tensor; equal to eager with gradients (the tensor's
    too), no recompile for new document ids. (A mod value such as alibi(slopes) there is
    still a clear error: the test above.)"""
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    bias = torch.randn(S, dtype=torch.float64, requires_grad=True)

    def outside(s, b, h, qi, ki):   # defined outside the compiled code, reading a tensor
        return s + bias[qi] * 0.5

    def step(q, k, v, docs, inner):
        bm = torch_create_block_mask(lambda b, h, qi, ki: docs[qi] == docs[ki], None, None, S, S, device="cpu",
                                     BLOCK_SIZE=16)
        score = (lambda s, b, h, qi, ki: s - bias[ki] * torch.sin(bias[qi])) if inner else outside
        return fa.flex_attention(q, k, v, score_mod=score, block_mask=bm).square().sum()

    q, k, v = _qkv(12)
    for inner in (True, False):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("inductor")
        compiled = torch.compile(lambda q, k, v, docs: step(q, k, v, docs, inner), backend=counter, fullgraph=True)
        for width in (11, 5):
            docs = (torch.arange(S) // width).to(torch.int32)
            _assert_same_as_eager(compiled, lambda q, k, v, docs: step(q, k, v, docs, inner), (q, k, v, docs),
                                  (q, k, v, bias))
        assert counter.frame_count == 1


_OUTSIDE_BIAS = torch.randn(S, dtype=torch.float64, requires_grad=True)


def _outside_score(s, b, h, qi, ki):     # defined outside the compiled code, reading a global tensor
    return s + _OUTSIDE_BIAS[ki] * 0.5


@pytest.mark.parametrize("backend", ["aot_eager", "eager"])
def test_functions_defined_inside_keep_every_part_under_other_backends(backend):
    """Backends other than Inductor run torch's own implementation of the HOP (no pass puts
    our op there), so every part of the call goes into it beside a function defined inside:
    a mask= function reading no tensors, a plain score made outside reading a tensor, a
    torch block mask made outside, with GQA and the LSE. Equal to eager with gradients.
    (Before, parts handed to the compile-time preparation were silently left out there:
    the first case was off by ~0.9.)"""
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    causal_torch = torch_create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S, device="cpu",
                                           BLOCK_SIZE=16)

    def score_inside_mask_plain(q, k, v, bias, docs):
        return fa.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + bias[h],
                                 mask=lambda b, h, qi, ki: ki < 30).square().sum()

    def mask_inside_score_outside(q, k, v, bias, docs):
        return fa.flex_attention(q, k, v, score_mod=_outside_score,
                                 mask=lambda b, h, qi, ki: docs[qi] == docs[ki]).square().sum()

    def score_inside_torch_block_mask(q, k, v, bias, docs):
        out, lse = fa.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s * bias[h], block_mask=causal_torch,
                                     scale=0.3, enable_gqa=True, return_lse=True)
        return out.square().sum() + lse.sum()

    q = _qkv(16)[0]
    bias = torch.rand(H, dtype=torch.float64, requires_grad=True)
    for step, trained in ((score_inside_mask_plain, bias), (mask_inside_score_outside, _OUTSIDE_BIAS),
                          (score_inside_torch_block_mask, bias)):
        k, v = _qkv(17)[:2]
        if step is score_inside_torch_block_mask:
            k, v = (t[:, : H // 2].detach().clone().requires_grad_() for t in (k, v))
        torch._dynamo.reset()
        counter = CompileCounterWithBackend(backend)
        compiled = torch.compile(step, backend=counter, fullgraph=True)
        _assert_same_as_eager(compiled, step, (q, k, v, bias, _DOCS), (q, k, v, trained))
        assert counter.frame_count == 1

    def max_scores_step(q, k, v, bias):
        out, aux = fa.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + bias[h],
                                     mask=lambda b, h, qi, ki: ki <= qi + 3,
                                     return_aux=fa.AuxRequest(lse=True, max_scores=True))
        return out, aux.lse, aux.max_scores

    torch._dynamo.reset()
    _assert_max_scores_step_compiles(max_scores_step, backend, _qkv(19), bias)


@pytest.mark.parametrize("other, words", [
    (lambda: {"mask": mods.causal()}, "cannot take a flexattn mod value as the call's mask="),
    (lambda: {"block_mask": _CAUSAL16}, "cannot take a flexattn BlockMask"),
])
def test_parts_torchs_hop_cannot_take_are_refused_under_other_backends(other, words):
    """Beside a function defined inside, a mod value or a flexattn block mask cannot enter
    torch's HOP, which backends other than Inductor run: a clear error naming the way out
    (Inductor, where the same call compiles and matches eager)."""
    made = other()

    def step(q, k, v, bias):
        return fa.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + bias[h], **made)

    args = (*_qkv(18, grad=False), torch.rand(H, dtype=torch.float64))
    with pytest.raises(Exception, match=words):
        torch.compile(step, backend="aot_eager", fullgraph=True)(*args)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(step, backend="inductor", fullgraph=True)(*args), step(*args))


def test_max_scores_with_a_score_function_defined_inside():
    """return_aux=AuxRequest(lse=True, max_scores=True) with a score function defined in the
    compiled code (the HOP route onto attention_fwd_max): equal to eager."""
    bias = torch.randn(H, dtype=torch.float64)

    def step(q, k, v, bias):
        out, aux = fa.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s + bias[h],
                                     return_aux=fa.AuxRequest(lse=True, max_scores=True))
        return out, aux.lse, aux.max_scores

    q, k, v = _qkv(12, grad=False)
    got = torch.compile(step, backend="inductor", fullgraph=True)(q, k, v, bias)
    for a, b in zip(got, step(q, k, v, bias)):
        torch.testing.assert_close(a, b)


def test_max_scores_with_a_torch_block_mask_built_inside():
    """return_aux=AuxRequest(lse=True, max_scores=True) beside a torch block mask built in
    the compiled code (its lists graph values of attention_fwd_max): one graph, the eager
    values, and gradients through out and lse."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    def step(q, k, v, docs):
        bm = torch_create_block_mask(lambda b, h, qi, ki: (docs[qi] == docs[ki]) & (qi >= ki), None, None, S, S,
                                     device="cpu", BLOCK_SIZE=16)
        out, aux = fa.flex_attention(q, k, v, block_mask=bm, return_aux=fa.AuxRequest(lse=True, max_scores=True))
        return out, aux.lse, aux.max_scores

    _assert_max_scores_step_compiles(step, "inductor", _qkv(15), _DOCS)


def test_torch_block_masks_built_inside_with_gqa_lse_and_a_mod_value():
    """A torch block mask built inside, with GQA and the LSE returned, and beside a mod value
    without tensors (softcap, made outside): equal to eager."""
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    cap = mods.softcap(2.0)

    def step(q, k, v, docs):
        bm = torch_create_block_mask(lambda b, h, qi, ki: (docs[qi] == docs[ki]) & (qi >= ki), None, None, S, S,
                                     device="cpu", BLOCK_SIZE=16)
        out, lse = fa.flex_attention(q, k, v, score_mod=cap, block_mask=bm, enable_gqa=True, return_lse=True)
        return out, lse

    q = _qkv(13, grad=False)[0]
    k, v = (t[:, : H // 2].contiguous() for t in _qkv(14, grad=False)[:2])
    got = torch.compile(step, backend="inductor", fullgraph=True)(q, k, v, _DOCS)
    for a, b in zip(got, step(q, k, v, _DOCS)):
        torch.testing.assert_close(a, b)


def test_compiled_inference_calls_the_op_without_autograd():
    """A graph that records no backward (no_grad, or nothing requires grad) calls
    ``flexattn::attention_fwd_inference`` — a plain op, no Python autograd layer per call —
    and one that records calls ``attention_fwd`` (its backward registered); both give the
    eager call's numbers."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return gm.forward

    slopes = torch.rand(H, dtype=torch.float64)

    def alibi(s, b, h, qi, ki):     # (made outside the compiled code: the op's route, not the HOP's)
        return s + slopes[h] * (ki - qi)

    def step(q, k, v):
        return fa.flex_attention(q, k, v, score_mod=alibi)

    compiled = torch.compile(step, backend=record, fullgraph=True)
    q, k, v = _qkv(3, grad=False)
    want = step(q, k, v)
    with torch.no_grad():
        torch.testing.assert_close(compiled(q, k, v), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(compiled(q, k, v), want, rtol=1e-12, atol=1e-12)   # grad mode, nothing requires grad
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
    out = compiled(*leaves)
    out.sum().backward()
    assert all(x.grad is not None for x in leaves)
    ops = [{t.split(".")[1] for t in g if t.startswith("flexattn.")} for g in graphs]
    assert ops[:2] == [{"attention_fwd_inference"}] * 2 and ops[-1] == {"attention_fwd"}, (ops, graphs)


def test_functions_defined_inside_take_the_inference_op_when_nothing_records():
    """Through torch's HOP (a score function defined in the compiled code over a tensor
    argument), a call autograd does not record runs ``attention_fwd_inference``; one it
    records runs ``attention_fwd`` — both the eager values."""
    def step(q, k, v, slopes):
        return fa.flex_attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s - slopes[h] * (qi - ki).abs())

    def ops_run(fn):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = fn()
        return out, {e.name for e in prof.events() if e.name.startswith("flexattn::")}

    q, k, v = _qkv(8, grad=False)
    slopes = torch.rand(H, dtype=torch.float64)
    compiled = torch.compile(step, backend="inductor", fullgraph=True)
    with torch.no_grad():
        out, ran = ops_run(lambda: compiled(q, k, v, slopes))
    torch.testing.assert_close(out, step(q, k, v, slopes))
    assert ran == {"flexattn::attention_fwd_inference"}, ran
    trained = slopes.clone().requires_grad_(True)
    compiled(q, k, v, trained)      # (compiling traces the backward op too)
    out, ran = ops_run(lambda: compiled(q, k, v, trained))
    torch.testing.assert_close(out, step(q, k, v, trained))
    assert ran == {"flexattn::attention_fwd"}, ran


class TorchFunctionScore(torch.nn.Module):
    """A score function in ``forward`` written with torch functions that have no IR node of
    their own (mods/torch_functions.py) and tensor idioms: gelu, atan on a trainable
    temperature, ALiBi slopes by torch.pow of the traced head, masked_fill."""

    def __init__(self):
        super().__init__()
        self.temperature = torch.nn.Parameter(torch.rand(H, dtype=torch.float64) + 0.5)

    def forward(self, q, k, v):
        temperature = self.temperature

        def score(s, b, h, q_idx, kv_idx):
            s = torch.nn.functional.gelu(s) + torch.atan(s * temperature[h])
            s = s + torch.pow(2, -8.0 * (h + 1) / H) * (kv_idx - q_idx)
            return s.masked_fill(q_idx < kv_idx, float("-inf"))

        return fa.flex_attention(q, k, v, score_mod=score).square().sum()


def test_torch_functions_in_a_compiled_score_function():
    model = TorchFunctionScore()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    q, k, v = _qkv(7)
    _assert_same_as_eager(compiled, model, (q, k, v), (q, k, v, model.temperature))
    assert counter.frame_count == 1


def test_torch_functions_in_a_score_function_match_dense_autograd():
    """The same model's value and gradients against dense attention in torch autograd."""
    model = TorchFunctionScore()
    q, k, v = _qkv(8)
    got = _grads(model(q, k, v), (q, k, v, model.temperature))
    h, qi, ki = torch.arange(H).view(1, H, 1, 1), torch.arange(S).view(1, 1, S, 1), torch.arange(S).view(1, 1, 1, S)
    s = q @ k.transpose(-1, -2) / D ** 0.5
    s = torch.nn.functional.gelu(s) + torch.atan(s * model.temperature[h])
    s = (s + torch.pow(2, -8.0 * (h + 1) / H) * (ki - qi)).masked_fill(qi < ki, float("-inf"))
    want = _grads((torch.softmax(s, -1) @ v).square().sum(), (q, k, v, model.temperature))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


class LiteralsAndReductionsScore(torch.nn.Module):
    """A score function in ``forward`` making literals with torch's constructors
    (``torch.tensor(c, dtype=s.dtype)``, ``torch.full((), c)``: constants of the expression,
    not tensors for torch.compile to find a source for) and reducing a vector read of a
    trainable table (``emb[h].amax(...)``, ``logsumexp``)."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Parameter(torch.randn(H, 3, 2, dtype=torch.float64,
                                                  generator=torch.Generator().manual_seed(11)))

    def forward(self, q, k, v):
        emb = self.emb

        def score(s, b, h, q_idx, kv_idx):
            s = torch.minimum(s, torch.tensor(2.5, dtype=s.dtype)) + torch.full((), 0.25)
            return s + emb[h].amax(dim=(-2, -1)) * 0.5 + torch.logsumexp(emb[h], dim=-1).sum(-1) * 0.1

        return fa.flex_attention(q, k, v, score_mod=score).square().sum()


def test_literals_and_vector_reductions_in_a_compiled_score_function():
    model = LiteralsAndReductionsScore()
    counter = CompileCounterWithBackend("inductor")   # (our route; other backends run torch's HOP)
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    q, k, v = _qkv(9)
    _assert_same_as_eager(compiled, model, (q, k, v), (q, k, v, model.emb))
    assert counter.frame_count == 1
    # and against dense attention in torch autograd
    got = _grads(model(q, k, v), (q, k, v, model.emb))
    h = torch.arange(H).view(1, H, 1, 1)
    s = torch.minimum(q @ k.transpose(-1, -2) / D ** 0.5, torch.tensor(2.5, dtype=q.dtype)) + 0.25
    e = model.emb[h]     # [1, H, 1, 1, 3, 2]
    s = s + e.amax(dim=(-2, -1)) * 0.5 + torch.logsumexp(e, dim=-1).sum(-1) * 0.1
    want = _grads((torch.softmax(s, -1) @ v).square().sum(), (q, k, v, model.emb))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


_GLOBAL_SLOPES = torch.nn.Parameter(torch.rand(H, dtype=torch.float64) + 0.1)


def _global_helper(h):
    return _GLOBAL_SLOPES[h] * 0.5


def test_functions_defined_inside_reading_global_tensors():
    """A score function defined in the compiled code whose tensors are module globals (read
    directly and through a global helper), closing over a local number only: dynamo
    cannot follow a nested function's globals, so it takes torch's HOP like closures over
    tensors (nested.py). One graph under Inductor, the eager values and gradients, new
    values of the global without recompiling."""
    def step(q, k, v):
        cap = 5.0

        def score(s, b, h, q_idx, kv_idx):
            return cap * torch.tanh((s + _GLOBAL_SLOPES[h] * (kv_idx - q_idx) * 0.1 + _global_helper(h)) / cap)

        return fa.flex_attention(q, k, v, score_mod=score).square().sum()

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    q, k, v = _qkv(12)
    _assert_same_as_eager(compiled, step, (q, k, v), (q, k, v, _GLOBAL_SLOPES))
    with torch.no_grad():
        _GLOBAL_SLOPES.mul_(2.0)
    torch.testing.assert_close(compiled(q, k, v), step(q, k, v))
    assert counter.frame_count == 1


_OFFSETS = torch.tensor([3, 7])                      # per batch: a position shift (as a decode step's)
_HEAD_SLOPES = torch.nn.Parameter(torch.rand(H, dtype=torch.float64) + 0.1)


def _slope_bias(s, b, h, q_idx, kv_idx):
    return s + _HEAD_SLOPES[h] * (kv_idx - q_idx) * 0.1


def _kept_near(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() <= 4 + h


def test_functions_defined_inside_reading_a_tensor_in_a_helpers_argument():
    """A function defined in the compiled code that reads one tensor in the argument of a
    helper reading another (``helper(s, b, h, q + offsets[b], kv)``): its trace reads
    ``offsets`` first, dynamo lifts ``slopes`` first, and the op binds the tensors in the
    trace's order (before: swapped, an index past the [B] tensor). Score and mask, one graph,
    the eager values and gradients, new tensor values without recompiling."""
    def step(q, k, v):
        def score(s, b, h, q_idx, kv_idx):
            return _slope_bias(s, b, h, q_idx + _OFFSETS[b], kv_idx)

        def mask(b, h, q_idx, kv_idx):
            return _kept_near(b, h, q_idx + _OFFSETS[b], kv_idx) | (kv_idx < _OFFSETS[b] * h)

        return fa.flex_attention(q, k, v, score_mod=score, mask=mask).square().sum()

    counter = CompileCounterWithBackend("inductor")   # (our op replaces torch's HOP in Inductor's pass)
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    q, k, v = _qkv(14)
    _assert_same_as_eager(compiled, step, (q, k, v), (q, k, v, _HEAD_SLOPES))
    with torch.no_grad():
        _HEAD_SLOPES.mul_(-1.5)
        _OFFSETS.copy_(torch.tensor([5, 1]))
    torch.testing.assert_close(compiled(q, k, v), step(q, k, v))
    assert counter.frame_count == 1


_CAUSAL_MOD = mods.causal()
_SLOPES = torch.nn.Parameter(torch.rand(H, dtype=torch.float64))


@pytest.mark.parametrize("make", [
    lambda: {"mask": mods.causal()},
    lambda: {"mask": _CAUSAL_MOD & mods.sliding_window(8)},
    # (dynamo traces no unary ~ on objects: "Failed to trace builtin operator invert")
    lambda: {"mask": (mods.sliding_window(4) ^ mods.causal()) | mods.causal(offset=2), "score_mod": mods.softcap(20.0)},
    lambda: {"mask": mods.and_masks(mods.causal(), mods.sliding_window(12)), "score_mod": mods.softcap(9.0)},
    lambda: {"block_mask": fa.create_block_mask(mods.causal() & mods.sliding_window(10), None, None, S, S,
                                                BLOCK_SIZE=16)},
], ids=["causal", "outside_and_inside", "operators_and_softcap", "and_masks", "block_mask"])
def test_mods_of_numbers_made_inside_the_compiled_code(make):
    """Built-in mods of numbers made in code dynamo traces (``mods.causal()`` in a compiled
    ``forward``), combined with each other and with mods made outside: made at compile time
    from their recipe (flexattn/torch: ``_made_while_traced``). One graph under Inductor for
    repeated calls, the eager values and gradients."""
    def step(q, k, v):
        return fa.flex_attention(q, k, v, **make()).square().sum()

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    q, k, v = _qkv(13)
    _assert_same_as_eager(compiled, step, (q, k, v), (q, k, v))
    torch.testing.assert_close(compiled(q, k, v), step(q, k, v))
    assert counter.frame_count == 1


@pytest.mark.parametrize("make, words", [
    (lambda: {"score_mod": mods.alibi(_SLOPES)}, "alibi of tensors"),
    (lambda: {"mask": mods.document(DOC)}, "document of tensors"),
    (lambda: {"score_mod": mods.score_mod(lambda s, b, h, q, kv: s * 0.5)}, "score_mod(fn)"),
])
def test_mods_of_tensors_made_inside_the_compiled_code_are_refused_clearly(make, words):
    """A mod over tensors (or of a plain function) made in code dynamo traces: a TypeError
    with the way out, not dynamo's "Observed exception" from inside the tracer; the same
    mod made outside compiles."""
    def step(q, k, v):
        return fa.flex_attention(q, k, v, **make())

    with pytest.raises(Exception, match=words.replace("(", r"\(").replace(")", r"\)")):
        torch.compile(step, backend="aot_eager", fullgraph=True)(*_qkv(4, grad=False))
    made = make()
    torch._dynamo.reset()
    q, k, v = _qkv(4, grad=False)
    torch.testing.assert_close(torch.compile(lambda q, k, v: fa.flex_attention(q, k, v, **made), backend="aot_eager",
                                             fullgraph=True)(q, k, v), fa.flex_attention(q, k, v, **made))


# --- decode steps under torch.compile (flexattn.torch.decoding._decode_in_graph) -------------------------

def _decode_cache(lengths):
    g = torch.Generator().manual_seed(21)
    k, v = (torch.randn(2, 2, 64, D, generator=g, dtype=torch.float64) for _ in range(2))
    return fa.KVCache(k, v, torch.tensor(lengths))


def test_decode_steps_compile_and_follow_the_lengths():
    """``fa.decode`` in a compiled step, mods as torch-style functions (one over a tensor):
    the eager step's output and LSE at every step while the cache's lengths grow in place,
    one graph per query length (none for new lengths), q_len 1 and 3."""
    cache = _decode_cache([40, 25])
    slopes = torch.rand(2 * H, dtype=torch.float64)

    def score(s, b, h, q_idx, kv_idx):
        return s + slopes[h] * (kv_idx - q_idx) * 0.1

    def near(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < 20

    def step(q, cache):
        return fa.decode(q, cache, score_mod=score, mask=near, return_lse=True)

    counter = CompileCounterWithBackend("inductor")
    _decode_steps_match_eager(step, counter, cache, torch.Generator().manual_seed(22))
    assert counter.frame_count == 2


def _decode_steps_match_eager(step, counter, cache, g, between=lambda: None):
    """``step(q, cache)`` compiled with ``counter`` against the eager step: output and LSE at
    q_len 1 (three steps) and 3 (two), the cache's lengths growing by 5 after each step
    (and ``between()`` called)."""
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    for q_len, steps in ((1, 3), (3, 2)):
        for _ in range(steps):
            q = torch.randn(2, 2 * H, q_len, D, generator=g, dtype=torch.float64)
            (out, lse), (want, want_lse) = compiled(q, cache), step(q, cache)
            torch.testing.assert_close(out, want)
            torch.testing.assert_close(lse, want_lse)
            cache.lengths += 5
            between()


def _paged(cache):
    pages = [x[0].transpose(0, 1).reshape(4, 16, 2, D) for x in (cache.k, cache.v)]
    return fa.PagedKVCache(*pages, torch.tensor([[0, 1, 2, 3]] * 2), cache.lengths)


_DECODE_SLOPES = torch.rand(2 * H, dtype=torch.float64)


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_decode_steps_with_mod_values_compile_and_follow_the_lengths(backend):
    """``fa.decode`` in a compiled step with mod values (ALiBi over a tensor, a sliding
    window; none at all): our op on every backend, the eager step's output and LSE while
    the lengths grow in place and the slopes change in place, one graph per query length."""
    cache = _decode_cache([40, 25])
    alibi, window = mods.alibi(_DECODE_SLOPES), mods.sliding_window(12)
    g = torch.Generator().manual_seed(23)
    for kw in ({"score_mod": alibi, "mask": window}, {"score_mod": alibi}, {"mask": window}, {}):
        torch._dynamo.reset()
        cache.lengths.copy_(torch.tensor([40, 25]))

        def step(q, cache):
            return fa.decode(q, cache, return_lse=True, **kw)

        counter = CompileCounterWithBackend(backend)
        _decode_steps_match_eager(step, counter, cache, g, between=lambda: _DECODE_SLOPES.mul_(1.1))
        assert counter.frame_count == 2, kw
        assert not any(n.target is torch.ops.higher_order.flex_attention for gm in counter.graphs
                       for n in gm.graph.nodes), kw


_PAGED_BIAS = torch.rand(2 * H, dtype=torch.float64)


def _paged_score(s, b, h, q_idx, kv_idx):     # a function made outside, over a global tensor
    return s + _PAGED_BIAS[h] * (kv_idx % 3)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_paged_decode_steps_compile_and_follow_the_lengths(backend):
    """``fa.decode`` over a PagedKVCache in a compiled step (``flexattn::decode_paged``: the
    eager step over the graph's pages, table and lengths): mod values, or a function made
    outside over a tensor updated in place; the eager step's output and LSE while the
    lengths grow, one graph per query length."""
    g = torch.Generator().manual_seed(24)
    for kw in ({"score_mod": mods.alibi(_DECODE_SLOPES), "mask": mods.sliding_window(12)},
               {"score_mod": _paged_score}, {}):
        torch._dynamo.reset()
        cache = _paged(_decode_cache([40, 25]))

        def step(q, cache):
            return fa.decode(q, cache, return_lse=True, **kw)

        counter = CompileCounterWithBackend(backend)
        _decode_steps_match_eager(step, counter, cache, g, between=lambda: _PAGED_BIAS.mul_(1.2))
        assert counter.frame_count == 2, kw


@pytest.mark.parametrize("make,kw,words", [
    (lambda c: c, {"score_mod": lambda s, b, h, q, kv: s, "mask": mods.sliding_window(8)}, "not one of each"),
    (_paged, {"score_mod": None}, "inference only"),
], ids=["mod_value_beside_a_function", "paged_training"])
def test_decode_under_compile_refuses_clearly(make, kw, words):
    """What a compiled decode step does not take (a mod value beside a function; a paged
    step that autograd would record) is a clear error naming the way out, not dynamo's
    failure on the host-side checks."""
    cache = make(_decode_cache([40, 25]))
    q = torch.randn(2, 2 * H, 1, D, dtype=torch.float64, requires_grad=make is _paged)
    with pytest.raises(Exception, match=words):
        torch.compile(lambda q, c: fa.decode(q, c, **kw), backend="aot_eager", fullgraph=True)(q, cache)


def test_torchs_paged_attention_step_compiles():
    """torch's PagedAttention step under torch.compile (the physical cache's batch of 1
    broadcast in the graph; the converted block mask made outside, or converted inside the
    compiled step from a logical mask made outside): one graph, the eager step's output."""
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask as torch_create_block_mask

    B, page, n_pages, L = 3, 16, 14, 64
    g = torch.Generator().manual_seed(33)
    paged = PagedAttention(n_pages, page, B, device="cpu")
    for b in reversed(range(B)):
        paged.reserve(torch.tensor(b), torch.tensor(L))
    k_cache, v_cache = (torch.zeros(1, H // 2, n_pages * page, D, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, H // 2, L, D, generator=g, dtype=torch.float64) for _ in range(2))
    paged.assign(torch.arange(B), torch.arange(L)[None].expand(B, L), k, v, k_cache, v_cache)
    lens = torch.tensor([40, 64, 17])
    logical = torch_create_block_mask(lambda b, h, qi, ki: ki < lens[b], B, None, 1, L, device="cpu", BLOCK_SIZE=page)
    converted = paged.convert_logical_block_mask(logical)
    q = torch.randn(B, H, 1, D, generator=g, dtype=torch.float64)
    want = fa.flex_attention(q, k, v, block_mask=logical, enable_gqa=True)

    def step(q, k_cache, v_cache):
        return fa.flex_attention(q, k_cache, v_cache, block_mask=converted, enable_gqa=True)

    def converting_step(q, k_cache, v_cache):
        return fa.flex_attention(q, k_cache, v_cache, block_mask=paged.convert_logical_block_mask(logical),
                                 enable_gqa=True)

    for fn in (step, converting_step):
        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
        torch.testing.assert_close(torch.compile(fn, backend=counter, fullgraph=True)(q, k_cache, v_cache), want)
        assert counter.frame_count == 1


def test_mods_called_on_tensors_evaluate_with_torch():
    """A mod called on torch tensors (as torch code calls a block mask's ``mask_mod``, and as
    torch's flex HOP traces a function that wraps one) answers with torch tensors equal to
    the numpy oracle's, for every op in the zoo (``flexattn.torch.tensor_eval``)."""
    import mod_zoo
    from flexattn.mods.evaluate import evaluate

    rng = np.random.default_rng(3)
    n = 37
    cases = dict(mod_zoo.zoo(rng, n), **mod_zoo.paged_zoo(rng, n))
    q, kv = torch.arange(n)[:, None], torch.arange(n)[None, :]
    scores = torch.from_numpy(rng.standard_normal((n, n)).astype(np.float32) * 4)
    for name, (score, mask) in cases.items():
        b, h = torch.tensor(1), torch.tensor(2)
        env = {"b": 1, "h": 2, "q": q.numpy(), "kv": kv.numpy()}
        if mask is not None:
            got = mask(b, h, q, kv)
            want = evaluate(mask.expr, env, [np.asarray(c) for c in mask.captures])
            assert isinstance(got, torch.Tensor) and got.dtype == torch.bool, name
            assert np.array_equal(np.broadcast_to(got.numpy(), (n, n)), np.broadcast_to(want, (n, n))), name
        if score is not None:
            got = score(scores, b, h, q, kv)
            want = evaluate(score.expr, dict(env, score=scores.double().numpy()),
                            [np.asarray(c.float() if isinstance(c, torch.Tensor) and c.dtype == torch.bfloat16 else c)
                             for c in score.captures])
            assert isinstance(got, torch.Tensor), name
            np.testing.assert_allclose(got.double().numpy(), np.broadcast_to(want, (n, n)), rtol=2e-4, atol=2e-4,
                                       err_msg=name)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_gpt_fast_decoding_step_compiles(backend):
    """gpt-fast's decoding step written against flexattn.torch, compiled with fullgraph: our
    block mask (made outside) sliced by a tensor of the graph (``input_pos // BLOCK_SIZE``:
    in the graph, as torch's BlockMask slices), its ``mask_mod`` (our mod) wrapped in a
    closure that moves it to the position (``input_pos[0]``, a tensor). New positions do
    not recompile; each step agrees with SDPA over the cache's prefix."""
    import compat_cases

    torch.manual_seed(0)
    Bt, Hq, Hkv, Dh, L = 2, 8, 2, 16, 256
    block_mask = fa.create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, L, L, BLOCK_SIZE=64)
    k_cache, v_cache = torch.randn(Bt, Hkv, L, Dh), torch.randn(Bt, Hkv, L, Dh)

    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(compat_cases.gpt_fast_decode_step(fa, k_cache, v_cache, L), fullgraph=True,
                             backend=counter)
    for pos in (70, 71, 200):
        q = torch.randn(Bt, Hq, 1, Dh)
        got = compiled(q, torch.tensor([pos]), block_mask)
        prefix = slice(0, pos + 1)
        want = torch.nn.functional.scaled_dot_product_attention(
            q, k_cache[:, :, prefix].repeat_interleave(Hq // Hkv, 1), v_cache[:, :, prefix].repeat_interleave(Hq // Hkv, 1))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1


def test_dynamo_marks_match_dynamos_own():
    """flexattn.torch marks its trace-time functions without importing torch._dynamo
    (dynamo_marks.py, ~1 s of import): the mark must be the one dynamo's decorator sets."""
    from flexattn.torch.dynamo_marks import assume_constant_result

    def ours():
        return 1

    def theirs():
        return 1

    assume_constant_result(ours)
    torch._dynamo.assume_constant_result(theirs)
    assert vars(ours) == vars(theirs) and vars(ours)


def test_importing_the_adapter_leaves_dynamo_unimported():
    """An eager user never pays torch._dynamo's import (its trace-time hooks load it when
    torch.compile runs, which has imported it already)."""
    import subprocess
    import sys

    code = "import sys, flexattn.torch; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr[-2000:]
