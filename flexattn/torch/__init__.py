"""PyTorch adapter: ``flexattn.torch.flex_attention`` with torch's signature and autograd.

Tensors in, tensors out, on the caller's device and dtype. CUDA tensors (bf16/fp16; head
dims: see ``core.kernel_path``) run the CuTeDSL Hopper kernels on the current stream,
forward and backward;
CPU tensors run the exact numpy reference. Gradients flow to query, key, value and to
captured float tensors of score mods (trainable biases, slopes, tables).

The computation is a ``torch.library`` custom op pair, ``flexattn::attention_fwd`` and
``flexattn::attention_bwd`` (fake implementations + ``register_autograd``), so
``torch.compile(fullgraph=True)`` sees one opaque node (graphs that record no backward:
``flexattn::attention_fwd_inference``, the forward without an autograd layer). Mods are not tensors: everything
that is not a tensor (mods' IR, non-tensor captures, block mask, scale, GQA) lives in a
spec registry (``core.registry.SpecRegistry``) under an int the op receives; the score mod's captured
tensors travel as a ``Tensor[]`` input, so autograd reaches them and their current
values are read at run time. See docs/ARCHITECTURE.md, "torch.compile".

Modules, top to bottom: this one (the public names; torch's ``BlockMask`` and
``create_block_mask`` on our block masks); ``attention.py`` (``flex_attention``: checks,
the eager autograd layer, prepared repeat calls) and ``decoding.py`` (``decode``);
``compiled.py`` (torch.compile's route into the custom ops); ``ops.py`` (the custom ops);
``launches.py`` (the kernels on torch tensors); ``devices.py`` (the CUDA device facts every
route shares). ``nested.py`` / ``graph_walk.py`` / ``tensor_eval.py``: torch.compile's
traced code (``dynamo_marks.py``: its marks, without importing dynamo);
``context_parallel.py``: several GPUs.
"""

from __future__ import annotations

import inspect
import types

import numpy as np
import torch

from . import tensor_eval
from .. import mods as _mods
from ..blockmask import BlockMask as _CoreBlockMask, create_block_mask as _create_block_mask
from ..blockmask.build import dense_mask
from ..blockmask.layout import _LIST_NAMES, as_class
from ..core.registry import by_id, from_id
from ..mods import MaskMod, ScoreMod, mask_mod
from ..problem.kvcache import KVCache, PagedKVCache
from .attention import AuxOutput, AuxRequest, FlexKernelOptions, flex_attention
from .compiled import _guard_numbers
from .decoding import decode
from .dynamo_marks import assume_constant_result
from .launches import _is_tensor
from .nested import captures_graph_values

__all__ = ["flex_attention", "decode", "create_block_mask", "create_mask", "BlockMask", "KVCache", "PagedKVCache",
           "MaskMod", "ScoreMod", "mask_mod", "and_masks", "or_masks", "noop_mask", "FlexKernelOptions",
           "AuxRequest", "AuxOutput"]

# torch's helpers, framework-free (mods/builtins.py): mask values that trace, compose with
# ``& |`` and are callable like torch's functions.
and_masks, or_masks, noop_mask = _mods.and_masks, _mods.or_masks, _mods.noop_mask
from torch.nn.attention.flex_attention import BlockMask as _TorchBlockMask   # (converted; built in compiled code: nested.py)
from torch.nn.attention.flex_attention import create_block_mask as _torch_create_block_mask   # (masks over tensors, compiled)


class BlockMask(_CoreBlockMask):
    """flexattn's ``BlockMask`` whose index lists are torch tensors, as torch's are (int32;
    a host-built mask's on the CPU, a GPU-built mask's on its device): what
    ``create_block_mask``, ``BlockMask.from_kv_blocks``, slicing, ``to`` and ``update`` of
    this module return. The kernels read the lists as kept (``list_array``)."""

    def _present(self, name: str):
        array = self._lists[name]
        if not isinstance(array, np.ndarray):
            return array
        if torch.compiler.is_dynamo_compiling():
            # (in traced code: a copy in the graph, none kept — keeping it would be a side
            # effect that dynamo replays after every call of the compiled function)
            t = self.__dict__.get("_tensors", {}).get(name)
            return torch.from_numpy(np.array(array)) if t is None else t
        tensors = self.__dict__.setdefault("_tensors", {})
        t = tensors.get(name)
        if t is None:   # a copy: the host lists are read-only, and stay the kernels'
            t = tensors[name] = torch.from_numpy(np.array(array))
        return t

    def __getitem__(self, index):
        """torch's slicing. Inside code dynamo traces (gpt-fast's decoding step slices its
        block mask by ``input_pos // BLOCK_SIZE``, a tensor of the graph) the lists are
        sliced as torch's ``BlockMask`` slices them, in the graph: the result is a torch
        ``BlockMask`` with this one's lists and ``mask_mod`` (our mods evaluate on tensors:
        ``tensor_eval``), which ``flex_attention`` takes as it takes torch's."""
        if torch.compiler.is_dynamo_compiling():
            where = next((i.device for i in (index if isinstance(index, tuple) else (index,))
                          if isinstance(i, torch.Tensor)), None)
            return self._as_torch(where)[index]
        return super().__getitem__(index)

    @property
    def mask_mod(self):
        """The mask (a ``MaskMod``). Inside code dynamo traces, a plain function of torch
        tensors evaluating it (``tensor_eval``): what torch code does with a block mask's
        mask_mod there — wrap it in a closure, hand it to torch's flex HOP — then meets
        only a function, as with torch's own block masks."""
        mod = self._mask_mod
        if mod is None:
            return super().mask_mod     # (a slice's: unset, its getter says so)
        return _mask_function(mod.expr, mod.captures) if torch.compiler.is_dynamo_compiling() else mod

    @mask_mod.setter
    def mask_mod(self, value):
        _CoreBlockMask.mask_mod.__set__(self, value)

    def _as_torch(self, device=None) -> _TorchBlockMask:
        """This block mask as torch's ``BlockMask``: the same list tensors and mask; with
        ``device`` (a slice's index tensor's, in traced code), lists elsewhere (a host-built
        mask's, sliced by a CUDA index) copied there in the graph, as torch's slicing needs."""
        lists = [self._present(name) for name in _LIST_NAMES]
        if device is not None and any(t.device != device for t in lists):
            _warn_lists_copied(str(device))
            lists = [t.to(device) for t in lists]
        return _TorchBlockMask(self.seq_lengths, *lists, BLOCK_SIZE=self.BLOCK_SIZE, mask_mod=self.mask_mod)


@assume_constant_result
def _warn_lists_copied(device: str) -> bool:
    """(at compile time) A host-built block mask sliced by an index on ``device`` in compiled
    code: its lists go there in every call."""
    import warnings

    warnings.warn(f"flexattn: a block mask built on the host is sliced by a {device} index inside compiled code: its"
                  f" lists are copied to {device} in every call; build it there (create_block_mask(...,"
                  f" device={device!r}), torch's default) to slice it in place", stacklevel=2)
    return True


def _mask_function(expr, captures):
    """A mask's IR as a plain function of torch tensors (``BlockMask.mask_mod`` in traced code)."""
    def mask_mod(b, h, q_idx, kv_idx):
        return tensor_eval.evaluate(expr, {"b": b, "h": h, "q": q_idx, "kv": kv_idx}, captures)
    return mask_mod


def create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device=None, BLOCK_SIZE=128, _compile=False,
                      separate_full_blocks: bool = True, compute_dq_write_order: bool = False,
                      dq_kv_order: bool = True) -> BlockMask:
    """torch's ``create_block_mask`` (``flexattn.blockmask.create_block_mask``: host or GPU
    lists, torch's argument order and keywords; the lists come back as torch tensors).

    Inside a function ``torch.compile`` traces, the block mask is built once, while
    compiling, and is a constant of the graph (its handle goes to ``flex_attention`` of the
    same graph; sizes are the traced ones, so new sizes recompile, as torch guards them).
    A mask function that reads tensors (they could change between calls) is built by
    torch's ``create_block_mask`` there instead, its lists values of the graph computed
    each call (``flex_attention`` takes such a block mask through torch's HOP, nested.py);
    a mod value reading tensors is refused: build it outside the compiled function.

    ``device=None`` is torch's default: the current accelerator (CUDA: the lists are built
    and kept there, as torch's are), the host where there is none."""
    device = _default_device(device)
    if torch.compiler.is_compiling():
        if inspect.isfunction(mask_mod) and (captures_graph_values(mask_mod) or _reads_tensors(by_id(mask_mod))):
            return _torch_create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cpu" if device is None else device,
                                            BLOCK_SIZE=BLOCK_SIZE)
        _guard_numbers(mask_mod)
        return _block_mask_while_compiling(by_id(mask_mod), B, H, Q_LEN, KV_LEN,
                                           None if device is None else str(device), BLOCK_SIZE, separate_full_blocks)
    return as_class(_create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE, _compile,
                                       separate_full_blocks, compute_dq_write_order, dq_kv_order), BlockMask)


_COMPILED_BLOCK_MASKS: list = []   # built while compiling: graphs hold their handles


# Mods made in code dynamo traces (``mods.causal()`` in a compiled ``forward``): dynamo
# cannot trace our tracer, so such a mod is made in plain Python at compile time — from its
# recipe: the built-in's name or the operator, and its arguments as constants (mods by
# identity) — and kept as an attribute of this namespace; the traced code reads it back
# from there, so dynamo sees an object with a source, as for a mod made outside, guarded
# by identity (each recipe has an attribute of its own: no guard sees the others).
_MADE_WHILE_TRACED = types.ModuleType("flexattn.torch.mods_made_while_traced")
_RECIPES: dict = {}   # recipe -> attribute name


def _made_while_traced(kind, name, args, kwargs):
    """``mods.mod.MADE_ELSEWHERE``: in code dynamo traces, the mod of a built-in's call or
    an operator, made at compile time; None elsewhere (made as usual)."""
    if not torch.compiler.is_dynamo_compiling():
        return None
    if kind == "call" and name in ("mask_mod", "score_mod"):
        _refuse_mods_made_in_traced_code("a plain function's mod (score_mod(fn), mask_mod(fn))")
    parts = [*args, *kwargs.values()]
    if any(_is_tensor(a) or isinstance(a, np.ndarray) for a in _flat(parts)):
        _refuse_mods_made_in_traced_code(f"{name} of tensors")
    encoded = tuple(("mod", id(a)) if isinstance(a, _mods.Mod) else a for a in args)
    return getattr(_MADE_WHILE_TRACED, _mod_from_recipe(kind, name, encoded, tuple(kwargs.items())))


def _flat(values):
    for v in values:
        if isinstance(v, (tuple, list)):
            yield from _flat(v)
        else:
            yield v


@assume_constant_result
def _mod_from_recipe(kind, name, args, kwargs) -> str:
    """The attribute of ``_MADE_WHILE_TRACED`` holding the mod of this recipe, made now (plain
    Python, at compile time) if it is new."""
    recipe = _hashable((kind, name, args, kwargs))
    attribute = _RECIPES.get(recipe)
    if attribute is None:
        decoded = [_mods.mod.LIVE_OBJECTS[a[1]] if isinstance(a, tuple) and len(a) == 2 and a[0] == "mod" else a
                   for a in args]
        if kind == "call":
            mod = _mods.mod.BUILT_INS[name](*decoded, **dict(kwargs))
        else:
            mod = getattr(decoded[0], name)(*decoded[1:])
        attribute = f"mod{len(_RECIPES)}"
        setattr(_MADE_WHILE_TRACED, attribute, mod)
        _RECIPES[recipe] = attribute
    return attribute


def _hashable(value):
    """A recipe as a dict key: lists (document lengths) as tagged tuples."""
    if isinstance(value, (list, tuple)):
        items = tuple(_hashable(v) for v in value)
        return ("list", items) if isinstance(value, list) else items
    return value


@assume_constant_result
def _refuse_mods_made_in_traced_code(what: str):
    raise TypeError(f"flexattn: {what} made inside a torch.compile'd function is not supported: make the mod"
                    " outside it (at module level or in __init__: mods are immutable values, their tensors read"
                    " at each call), or pass the plain function (score_mod=fn, mask=fn, create_block_mask(fn, ...)),"
                    " which works inside. Built-in mods of numbers (mods.causal(), mods.softcap(30.0), a & b) work"
                    " inside too")


_mods.mod.MADE_ELSEWHERE = _made_while_traced
_mods.mod.ARRAY_EVALUATORS.append((tensor_eval.is_tensor, tensor_eval.evaluate))   # mods called on tensors


@assume_constant_result
def _reads_tensors(mask_mod) -> bool:
    """Whether a mask function (``by_id`` handle) reads tensors, found by tracing it at
    compile time (plain Python)."""
    mask = _mods.as_mask(from_id(mask_mod), "mask_mod")
    return any(_is_tensor(c) for c in mask.captures)


@assume_constant_result
def _block_mask_while_compiling(mask_mod, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE, separate_full_blocks):
    """``create_block_mask`` at compile time (plain Python: dynamo runs it on the real
    arguments and bakes in its result): the mask's handle, ``("id", id(block_mask))`` as
    ``core.registry.by_id`` makes it, the block mask kept alive for the graphs."""
    mask = _mods.as_mask(from_id(mask_mod), "mask_mod") if mask_mod is not None else None
    if mask is not None and any(_is_tensor(c) for c in mask.captures):
        raise ValueError("create_block_mask inside a torch.compile'd function: this mask reads tensors, which"
                         " may change between calls while the graph keeps its block mask; build it with torch's"
                         " create_block_mask there (its lists stay values of the graph), or outside the compiled"
                         " function (or pass mask= to flex_attention)")
    block_mask = _create_block_mask(mask, B, H, Q_LEN, KV_LEN, device, BLOCK_SIZE,
                                    separate_full_blocks=separate_full_blocks)
    _COMPILED_BLOCK_MASKS.append(block_mask)
    return ("id", id(block_mask))


def create_mask(mod_fn, B, H, Q_LEN, KV_LEN, device=None) -> torch.Tensor:
    """torch's ``create_mask``: the dense bool mask [B, H, Q_LEN, KV_LEN] of a mask mod, or
    where a score mod (given a zero score) is not -inf; computed on the host, put on
    ``device`` (default, as torch's: the current accelerator, else the CPU)."""
    return torch.from_numpy(dense_mask(mod_fn, B, H, Q_LEN, KV_LEN)).to(_default_device(device) or "cpu")


def _default_device(device):
    """torch's default for a mask's ``device=None``: the current accelerator
    (``torch.accelerator``), None (the host) on a machine without one."""
    if device is not None:
        return device
    accelerator = torch.accelerator.current_accelerator(check_available=True)
    return None if accelerator is None else str(accelerator)


# --- the CUDA forward ---------------------------------------------------------------------------


# --- block masks built on the GPU ----------------------------------------------------------------


