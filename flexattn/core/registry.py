"""int → ``AttentionSpec``: the non-tensor half of a call, for a framework's custom op.

An op signature takes tensors and numbers, not mods: an adapter registers the spec of a
call here and hands the op its int; the op looks the spec up and binds the call's
operands (``AttentionSpec.template`` / ``bind``). ``is_operand(value)`` says which score
captures travel as op inputs (the torch adapter: torch tensors); the registry never keeps
those alive and never keys on their values.
"""

from __future__ import annotations

import collections
import threading
from typing import Callable

from ..blockmask import BlockMask
from ..blockmask.layout import as_block_mask
from ..mods import Mod
from ..mods.mod import LIVE_OBJECTS
from ..problem.spec import AttentionSpec


class SpecRegistry:
    """int → ``AttentionSpec``.

    Entries are keyed by content (IR structure, identity of non-tensor captures and block
    mask, numbers by value, scale, GQA), so eager calls that rebuild equal mods every step
    reuse one entry. Specs registered while compiling are pinned (a graph holds their id);
    eager ones live in an LRU of ``capacity`` entries (an id is only used between its
    forward and backward). The stored spec keeps the objects its key names alive, so ids
    in keys cannot be reused while the entry exists.
    """

    def __init__(self, is_operand: Callable, capacity: int = 512):
        self.is_operand = is_operand
        self.capacity = capacity
        self._lock = threading.Lock()
        self._by_key: dict = {}
        self._specs: dict[int, AttentionSpec] = {}
        self._pinned: set[int] = set()
        self._lru: collections.OrderedDict = collections.OrderedDict()
        self._next = 0

    def register(self, spec: AttentionSpec, pin: bool = False, masks: bool = False) -> int:
        """The id of ``spec``'s entry. ``masks``: the element mask's operands travel as op
        inputs too, after the score's (``bind_operands``), as a compiled call's plain mask
        function reading tensors needs."""
        key = spec_key(spec, self.is_operand, masks)
        with self._lock:
            spec_id = self._by_key.get(key)
            if spec_id is None:
                spec_id, self._next = self._next, self._next + 1
                self._by_key[key] = spec_id
                # without the operands: the registry must not keep them alive
                self._specs[spec_id] = spec.template(self.is_operand, masks)[0]
            if pin:
                self._pinned.add(spec_id)
                self._lru.pop(spec_id, None)
            elif spec_id not in self._pinned:
                self._lru[spec_id] = key
                self._lru.move_to_end(spec_id)
                while len(self._lru) > self.capacity:
                    old_id, old_key = self._lru.popitem(last=False)
                    del self._by_key[old_key], self._specs[old_id]
            return spec_id

    def get(self, spec_id: int) -> AttentionSpec:
        try:
            return self._specs[spec_id]
        except KeyError:
            raise RuntimeError(f"flexattn: attention spec #{spec_id} is no longer registered") from None

    def bind_operands(self, spec_id: int, operands) -> AttentionSpec:
        """Entry ``spec_id`` with an op call's operands put back: the score mod's first (one
        per operand slot of its template), then the element mask's (``register(masks=)``)."""
        template = self.get(spec_id)
        n = len(template.operand_slots())
        return template.bind(operands[:n], operands[n:])

    def __len__(self):
        return len(self._specs)


def by_id(x):
    """Our mods and block masks as ("id", id(x)), for a compiler that hands constant-result
    functions only constants (torch 2.11's ``assume_constant_result``) and guards on the
    identity of the objects whose id() it evaluates (another object recompiles)."""
    return ("id", id(x)) if isinstance(x, (Mod, BlockMask)) else x


def from_id(x):
    if isinstance(x, tuple) and len(x) == 2 and x[0] == "id":
        return LIVE_OBJECTS[x[1]]
    return x


def compiled_spec(score_mod, block_mask, scale, enable_gqa, mask, score, is_operand: Callable,
                  compiler: str, function_operands: tuple = ()) -> AttentionSpec:
    """The spec of a call being compiled (arguments as ``by_id`` passed them): mods and
    block masks normalized; plain functions that capture operands are refused (only a mod
    value built outside the compiled function makes its tensors inputs of the graph),
    except for the arguments named in ``function_operands``, whose operands the adapter
    fetches into the graph itself."""
    score_mod, block_mask, mask, score = (from_id(x) for x in (score_mod, block_mask, mask, score))
    spec = AttentionSpec.from_args(score_mod, as_block_mask(block_mask), scale, enable_gqa, mask, score)
    given = {"score_mod": score_mod, "score": score, "mask": mask}
    mods_ = {"score_mod": spec.score, "score": spec.score, "mask": spec.mask}
    for name, arg in given.items():
        if arg is None or isinstance(arg, Mod) or name in function_operands:
            continue
        if any(is_operand(c) for c in mods_[name].captures):
            raise TypeError(
                f"under {compiler}, a {name}= function that captures tensors must be made a mod value"
                f" outside the compiled function (flexattn.score_mod(fn) / flexattn.mask_mod(fn), e.g. in"
                f" __init__): only then are its tensors inputs of the graph"
            )
    return spec


def operand_grad_slots(spec: AttentionSpec, is_operand: Callable, grad_mask: int) -> tuple:
    """Score-capture slots of the op's operands (``is_operand`` captures, in capture order)
    whose bit n is set in ``grad_mask``."""
    if spec.score is None:
        return ()
    slots = [i for i, c in enumerate(spec.score.captures) if is_operand(c)]
    return tuple(slot for n, slot in enumerate(slots) if grad_mask >> n & 1)


def _capture_key(value, operand_slot: bool, is_operand: Callable):
    if operand_slot and is_operand(value):
        return ("tensor",)  # an op input: its value never matters here
    if isinstance(value, (bool, int, float)):
        return (type(value).__name__, value)
    return ("object", id(value))


def _mod_key(mod, operands: bool, is_operand: Callable):
    if mod is None:
        return None
    return (mod.structure_key, tuple(_capture_key(c, operands, is_operand) for c in mod.captures))


def spec_key(spec: AttentionSpec, is_operand: Callable, masks: bool = False):
    """The registry's key of ``spec``: score captures for which ``is_operand`` holds count
    as slots, mask captures by identity (slots too with ``masks``: op inputs then)."""
    return (_mod_key(spec.score, True, is_operand), _mod_key(spec.mask, masks, is_operand),
            None if spec.block_mask is None else id(spec.block_mask), spec.scale, spec.enable_gqa, masks)


__all__ = ["SpecRegistry", "by_id", "compiled_spec", "from_id", "operand_grad_slots", "spec_key"]
