"""``flexattn.torch.decode``: a decode step over a ``KVCache`` / ``PagedKVCache`` with the
split-KV decode kernel, eagerly (a repeated step reuses its plan: ``_PreparedDecode``) and
under torch.compile (the lengths a graph tensor, ``_decode_in_graph``; a paged cache through
its own op, ``flexattn::decode_paged``).
"""

from __future__ import annotations

import numpy as np
import torch

from ..bounded import keep_bounded
from ..core.decode_device import cache_arrays, check_cache_layout, decode_key, kernel_step, tma_ready
from ..core.kernel_path import Device
from ..core.prepared import PreparedCalls, PreparedEntry
from ..core.registry import by_id, from_id
from ..mods import Mod
from ..problem import bounds
from ..problem.decode import decode_problem, decode_spec
from ..problem.kvcache import KVCache, PagedKVCache
from ..problem.spec import lse_dtype
from ..problem.validate import check_inputs
from .attention import flex_attention
from .compiled import _compiled_op_inputs
from .devices import _DeviceCopies, _current_raw_stream, _decode_workspace, _sm_count
from .dynamo_marks import assume_constant_result
from .launches import _is_tensor
from .nested import captures_graph_values
from .ops import _INFERENCE_OPS, _REGISTRY, _records_grad

def decode(query: torch.Tensor, cache, score_mod=None, mask=None, scale=None, return_lse=False):
    """Decoding step on a ``KVCache``/``PagedKVCache`` of torch tensors.

    ``query`` [B, Hq, q_len, D] holds the last q_len tokens of each sequence (append their
    K/V to the cache first); mods see true positions; GQA is implicit. CUDA inputs with
    q_len <= 16 that the kernel takes (``decode_device.kernel_step``: bf16/fp16, head dims
    multiples of 16 from 32 to 256, pages it reads in place) run the split-KV decode kernel (GQA heads packed,
    blocks past each sequence's length or before its mask's first key skipped; inference
    only — with autograd recording, the step goes through ``flex_attention``); anything
    else is an ordinary attention problem (the forward kernel on CUDA tensors, the CPU
    reference on CPU ones; paged caches then gathered into logical order).

    A step like an earlier one — the same mod objects (``Mod`` values), scale, cache type,
    query / K / V / page-table / lengths metadata, device and current stream — skips the
    checks and the planning (``_PreparedDecode``): it reads the lengths, allocates the
    outputs and launches. Steps are queued without waiting for the GPU; steps on one
    stream from several threads are serialized around their upload and launch.
    """
    if torch.compiler.is_compiling():
        return _decode_in_graph(query, cache, score_mod, mask, scale, return_lse)
    call = (score_mod, None, scale, True, mask, None)
    key = None
    if bounds.enabled():   # the debug mode: the step's reads checked, as flex_attention's
        k, v, spec = decode_problem(query, cache, score_mod, mask, scale)
        check_inputs(query, k, v, spec)
    if type(query) is torch.Tensor and query.is_cuda:
        key = decode_key(call, query, cache, _step_facts)
        repeated = _DECODES.run(key, query, cache, return_lse)
        if repeated is not None:
            return repeated if return_lse else repeated[0]
    if (isinstance(query, torch.Tensor) and query.is_cuda and kernel_step(query, cache)
            and not (torch.is_grad_enabled() and _cache_requires_grad(query, cache))):
        out, lse, step = _kernel_decode(query, cache, score_mod, mask, scale, launch=None)
        if key is not None:
            _DECODES.add(key, call, lambda: _PreparedDecode(step.plan, query, cache))
        return (out, lse) if return_lse else out
    k, v, spec = decode_problem(query, cache, score_mod, mask, scale)
    return flex_attention(query, k, v, score=spec.score, mask=spec.mask, scale=spec.scale,
                          enable_gqa=True, return_lse=return_lse)


def _decode_in_graph(query, cache, score_mod, mask, scale, return_lse):
    """``decode`` under torch.compile: the step as ``flex_attention`` over the cache's
    tensors, whose short-query route (``core/short_query.py``) takes the decode kernel on
    CUDA. The eager step reads the lengths on the host (its checks and its mods' shifted
    positions); here they stay a tensor of the graph, read per batch in the mask and the
    score (``lengths[b]``), so a new step's lengths neither break the graph nor recompile.
    A contiguous ``KVCache`` with torch ``lengths`` only, made outside the compiled code
    (its constructor checks the lengths on the host); mods as torch-style functions, or as
    mod values (``_decode_mods_in_graph``), not one of each. The lengths are not checked
    here (the debug mode checks the mods' reads)."""
    if isinstance(cache, PagedKVCache):
        return _decode_paged_in_graph(query, cache, score_mod, mask, scale, return_lse)
    if not isinstance(cache, KVCache):
        raise TypeError(f"decode under torch.compile takes a KVCache or PagedKVCache, not {type(cache).__name__}")
    lengths = cache.lengths
    if not isinstance(lengths, torch.Tensor):
        raise TypeError("decode under torch.compile needs the cache's lengths as a torch tensor (the graph reads "
                        f"them per step), got {type(lengths).__name__}")
    if query.dim() != 4:
        raise ValueError(f"query must be 4-D [B, H, q_len, D], got shape {tuple(query.shape)}")
    given = [m for m in (score_mod, mask) if m is not None]
    if all(isinstance(m, Mod) for m in given):
        return _decode_mods_in_graph(query, cache, score_mod, mask, scale, return_lse)
    if any(isinstance(m, Mod) for m in given):
        raise TypeError("decode under torch.compile takes score_mod= and mask= both as mod values or both as"
                        " torch-style functions, not one of each: write the mod value as a function of"
                        " (b, h, q_idx, kv_idx), or make the function a mod value outside the compiled code")
    # Query row i is position lengths[b] - q_len + i: the shift as a tensor of the graph (under
    # dynamic shapes q_len is symbolic, which a function defined here must not compute with).
    shift = lengths - query.shape[2]

    def step_mask(b, h, q_idx, kv_idx):      # the valid keys; mods see true positions
        keep = kv_idx < lengths[b]
        return keep if mask is None else keep & mask(b, h, q_idx + shift[b], kv_idx)

    def step_score(score, b, h, q_idx, kv_idx):
        return score_mod(score, b, h, q_idx + shift[b], kv_idx)

    return flex_attention(query, cache.k, cache.v, score_mod=None if score_mod is None else step_score,
                          mask=step_mask, scale=scale, enable_gqa=True, return_lse=return_lse)


def _decode_paged_in_graph(query, cache, score_mod, mask, scale, return_lse):
    """``_decode_in_graph`` for a ``PagedKVCache``: one op (``flexattn::decode_paged``) whose
    call is the eager step over the graph's pages, page table and lengths (read on the
    host per step, as the eager step reads them; new values never recompile). Its mods are
    made outside the compiled code (mod values, or functions whose tensors become graph
    inputs, as ``flex_attention``'s); inference only."""
    for name, fn in (("score_mod", score_mod), ("mask", mask)):
        if captures_graph_values(fn):
            raise TypeError(f"decode under torch.compile with a PagedKVCache takes a {name}= made outside the"
                            " compiled code (a mod value, or a function over tensors made there): this one is"
                            " defined inside it over tensors")
    for name in ("page_table", "lengths"):
        if not isinstance(getattr(cache, name), torch.Tensor):
            raise TypeError(f"decode under torch.compile needs the PagedKVCache's {name} as a torch tensor (the graph"
                            f" reads it per step), got {type(getattr(cache, name)).__name__}")
    buffers, spec_id = _compiled_op_inputs((score_mod, None, scale, True, mask, None))
    if _records_grad(query, cache.k_pages, cache.v_pages, *buffers):
        raise TypeError("decode under torch.compile with a PagedKVCache is inference only: call it under"
                        " torch.no_grad() (or detach the query and cache)")
    out, lse = torch.ops.flexattn.decode_paged(query, cache.k_pages, cache.v_pages, cache.page_table, cache.lengths,
                                               buffers, spec_id)
    return (out, lse) if return_lse else out


def _decode_paged_impl(query, k_pages, v_pages, page_table, lengths, buffers, spec_id):
    """``flexattn::decode_paged``: the eager step (``decode``) over these pages with the
    registered mods bound to this call's buffers (kept per buffer objects, so that repeated
    steps find the same mod objects and the eager step's prepared plan)."""
    key = (spec_id, tuple(id(b) for b in buffers))
    hit = _PAGED_BINDINGS.get(key)
    if hit is None:
        hit = (_REGISTRY.bind_operands(spec_id, buffers), tuple(buffers))   # (the buffers kept: their ids stay)
        keep_bounded(_PAGED_BINDINGS, key, hit, 16)
    spec = hit[0]
    cache = PagedKVCache(k_pages, v_pages, page_table, lengths)
    return decode(query, cache, score_mod=spec.score, mask=spec.mask, scale=spec.scale, return_lse=True)


def _decode_paged_fake(query, k_pages, v_pages, page_table, lengths, buffers, spec_id):
    batch, heads, q_len, _ = query.shape
    out = query.new_empty(batch, heads, q_len, v_pages.shape[-1])
    return out, query.new_empty(batch, heads, q_len, dtype=getattr(torch, lse_dtype(query)))


_PAGED_BINDINGS: dict = {}   # (spec id, buffer ids) -> (bound spec, buffers): decode_paged's calls


def _decode_mods_in_graph(query, cache, score_mod, mask, scale, return_lse):
    """``_decode_in_graph`` for mod values (or none): the eager step's spec
    (``decode_spec``), registered at compile time with stand-ins for the per-step query
    offsets and lengths, which the graph computes from the cache's lengths tensor and
    hands our op as buffers beside the mods' own tensors (read from the mod values, which
    dynamo guards by identity). Our op on every backend, no HOP."""
    lengths = cache.lengths
    spec_id, origins = _prepare_decode_for_compile(by_id(score_mod), by_id(mask), scale,
                                                   str(lengths.dtype).removeprefix("torch."))
    per_step = {"offsets": lengths - query.shape[2], "lengths": lengths}
    mods_ = {"score": score_mod, "mask": mask}
    buffers = [per_step[o] if isinstance(o, str) else mods_[o[0]].captures[o[1]] for o in origins]
    op = torch.ops.flexattn.attention_fwd if _records_grad(query, cache.k, cache.v, *buffers) else \
        torch.ops.flexattn.attention_fwd_inference
    out, lse = op(query, cache.k, cache.v, buffers, spec_id, [], None)
    return (out, lse) if return_lse else out


@assume_constant_result
def _prepare_decode_for_compile(score_mod, mask, scale, lengths_dtype: str) -> tuple:
    """``(spec id, buffer origins)`` of a compiled decode step over mod values (plain Python
    at compile time, as ``_prepare_for_compile``): ``decode_spec`` with stand-in tensors for
    the offsets and lengths, registered with the mask's tensors as op buffers too. Each
    origin names where the graph finds that buffer: "offsets", "lengths", or (role,
    capture index) of the score / mask mod value."""
    score_mod, mask = from_id(score_mod), from_id(mask)
    dtype = getattr(torch, lengths_dtype)
    offsets, lengths = torch.zeros(1, dtype=dtype), torch.zeros(1, dtype=dtype)
    spec = decode_spec(score_mod, mask, offsets, lengths, scale)
    origins = {id(offsets): "offsets", id(lengths): "lengths"}
    for role, m in (("score", score_mod), ("mask", mask)):
        for i, c in enumerate(m.captures if m is not None else ()):
            origins.setdefault(id(c), (role, i))
    found = [origins[id(c)] for m in (spec.score, spec.element_mask) if m is not None
             for c in m.captures if _is_tensor(c)]
    return _REGISTRY.register(spec, pin=True, masks=True), tuple(found)


def _cache_requires_grad(query, cache) -> bool:
    return query.requires_grad or any(getattr(a, "requires_grad", False) for a in cache_arrays(cache)[:2])


def _kernel_decode(query, cache, score_mod, mask, scale, launch=True):
    """The split-KV decode kernel on the current stream -> (out, lse); with ``launch``
    False (out, lse, the planned ``DecodeLaunch``) without running it (benchmarks); with
    ``launch`` None, launched, (out, lse, the ``DecodeLaunch``)."""
    from ..core.decode_path import DecodeMods, DecodeSite, decode_into, prepare_decode

    dev = query.device
    check_cache_layout(cache, lambda x: x.stride() if isinstance(x, torch.Tensor) and x.device == dev else None,
                       f"a torch tensor on the query's device {dev}")
    q = query.detach()
    if not tma_ready(q.stride()):
        q = q.contiguous()
    B, Hq, q_len, D = q.shape
    out = torch.empty(B, Hq, q_len, D, dtype=q.dtype, device=dev)
    lse = torch.empty(B, Hq, q_len, dtype=torch.float32, device=dev)
    table = None
    if hasattr(cache, "page_table"):
        table = torch.as_tensor(cache.page_table).to(device=dev, dtype=torch.int32)
        if not table.is_contiguous():
            table = table.contiguous()
    num_sms = _sm_count(dev)

    with torch.cuda.device(dev):
        stream = torch.cuda.current_stream(dev)
        copies = _DeviceCopies(dev)
        site = DecodeSite(Device(stream.cuda_stream, copies, tvm_ffi_stream=True, same_memory=copies.same_memory),
                          num_sms, _decode_workspace(dev, stream))
        run = prepare_decode if launch is False else decode_into
        step = run(q, cache, out, lse, site, DecodeMods(score_mod, mask, scale), page_table=table)
    return (out, lse) if launch else (out, lse, step)


def _step_facts(q, k, v, table, lens):
    """The facts of a decode step's tensors a repeated step must share, and the current stream."""
    if type(k) is not torch.Tensor or type(v) is not torch.Tensor:
        return None
    table_key = None
    if table is not None:
        if type(table) is not torch.Tensor:
            return None
        table_key = (table.shape, table.stride(), table.dtype, table.get_device())
    if type(lens) is torch.Tensor:
        lens_key = (lens.shape, lens.dtype, lens.get_device())
    elif type(lens) is np.ndarray:
        lens_key = (lens.shape, lens.dtype)
    else:
        return None
    index = q.get_device()
    return (q.shape, q.stride(), q.dtype, index, k.shape, k.stride(), k.dtype, k.get_device(),
            v.shape, v.stride(), v.dtype, v.get_device(), table_key, lens_key, _current_raw_stream(index))


class _PreparedDecode(PreparedEntry):
    """A repeated decode step (``decode``'s key matched): read the lengths, allocate the
    outputs, ``DecodePlan.run``. The LSE goes to a buffer of the entry's when the caller
    does not want it (never read; steps on the entry's stream write it in order)."""

    __slots__ = ("run", "paged", "q_ready", "table_ready", "num_sms", "lse_sink")

    def __init__(self, plan, q, cache):
        super().__init__(q.shape, q.dtype, q.device, q.get_device())
        self.run = plan.run
        self.paged = type(cache) is PagedKVCache
        self.q_ready = tma_ready(q.stride())
        table = cache.page_table if self.paged else None
        self.table_ready = table is None or (table.dtype == torch.int32 and table.device == q.device
                                             and table.is_contiguous())
        self.num_sms = _sm_count(q.device)
        self.lse_sink = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)

    def __call__(self, q, cache, return_lse):
        """``(out, lse)``, or None where the full path must run: another current device, or
        autograd recording (some input requires grad while grad mode is on)."""
        if torch.cuda.current_device() != self.device_index:
            return None
        if self.paged:
            k, v, table = cache.k_pages, cache.v_pages, cache.page_table
            if not self.table_ready:
                table = table.to(device=self.device, dtype=torch.int32).contiguous()
        else:
            k, v, table = cache.k, cache.v, None
        if q.requires_grad or k.requires_grad or v.requires_grad:
            if torch.is_grad_enabled():
                return None
            q, k, v = q.detach(), k.detach(), v.detach()   # DLPack refuses tensors that require grad
        if not self.q_ready:
            q = q.contiguous()
        lengths = cache.lengths.tolist()
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device) if return_lse else self.lse_sink
        self.run(q, k, v, table, out, lse, lengths, self.num_sms)
        return out, lse


_DECODES = PreparedCalls()


# A compiled decode step over a PagedKVCache (``_decode_paged_in_graph``): inference only.
_INFERENCE_OPS.define("decode_paged(Tensor query, Tensor k_pages, Tensor v_pages, Tensor page_table, Tensor lengths,"
                      " Tensor[] buffers, int spec_id) -> (Tensor, Tensor)")
_INFERENCE_OPS.impl("decode_paged", _decode_paged_impl, "CompositeExplicitAutograd")
torch.library.register_fake("flexattn::decode_paged", _decode_paged_fake, lib=_INFERENCE_OPS)
