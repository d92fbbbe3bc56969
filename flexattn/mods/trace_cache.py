"""Plain functions traced once: a function's trace is reused while everything it reads is the same.

A torch user passes ``score_mod=lambda score, b, h, q_idx, kv_idx: ...`` on every call, often
a new lambda object each time. Tracing it costs ~0.2 ms of host time, and a fresh IR object
misses every plan cache keyed by the IR's identity (another ~0.3 ms). So a trace is kept
under the function's *fingerprint*: its code, and what that code can read —

- closure cells, default arguments and the globals its code names (nested code included);
- numbers, strings, None and tuples by value; arrays by shape and dtype and where the
  code finds them (which closure cell, global, attribute: gpt-fast's ``q + offset`` over
  a new position tensor each step is the same trace), the arrays of this call captured
  in their place on a hit; Python functions by their own fingerprint, library functions,
  builtins, classes and modules by identity (a module's attributes named by the code are
  fingerprinted too: ``config.WINDOW``);
- other objects (``self`` in a method's closure: torch's ``PagedAttention`` mask reads
  ``self.physical_to_logical``; a module's ``self.bias``) by identity plus the attributes
  the code names, each keyed as above, as for a module: the fingerprint is taken at every
  call, so a rebound or changed attribute gives another key. Not where the code reads
  attributes by a computed name (``getattr``), nor an attribute that is itself not keyed
  (a bound method, a list);
- anything else (a list, a dict) can change without the function changing, so a
  function that reads one is traced on every call, as before.

A hit rebuilds the mod from the kept IR (the same object: plans and compiled kernels hit)
with the arrays the function names now, taken from the same places. A trace that
captured something the fingerprint does not cover (a tensor made inside the function) is
not kept. ``Fingerprint.key`` itself keeps arrays by identity (watched by weak reference,
so a recycled ``id`` never matches): the prepared-call cache (core/prepared.py), whose
entries hold converted captures, keys by it.
"""

from __future__ import annotations

import types
import weakref
from collections import OrderedDict

import numpy as np

from .trace import _is_number, is_array

# Library code does not change between calls: its functions are keyed by identity.
_LIBRARY_PREFIXES = ("torch", "numpy", "math", "jax", "jaxlib", "cupy", "flexattn", "functools", "operator",
                     "builtins")
_JAX_FUNCTION_TYPES = ("PjitFunction", "custom_jvp", "custom_vjp")
_MAX_DEPTH = 4
_UNCACHEABLE = object()


class Fingerprint:
    """The hashable key of a function plus the arrays (and mods) it names, watched weakly.
    ``shape_key``: the key with each array by its place among ``arrays`` (the arrays the
    function names, in the order the fingerprint met them) instead of its identity."""

    __slots__ = ("key", "watched", "shape_key", "arrays", "places")

    def __init__(self, key, watched):
        self.key, self.watched = key, watched
        self.arrays = [v for v in watched.values() if _is_watched_array(v)]
        self.places = {id(a): i for i, a in enumerate(self.arrays)}   # id -> index in arrays
        self.shape_key = _by_place(key, self.places)


def _is_watched_array(value) -> bool:
    from .mod import Mod

    return not isinstance(value, (Mod, types.FunctionType)) and is_array(value)


def _by_place(key, places: dict):
    """``key`` with each ``("array", id, shape, dtype)`` as ``("array", place, shape, dtype)``."""
    if type(key) is not tuple:
        return key
    if len(key) == 4 and key[0] == "array" and type(key[1]) is int and key[1] in places:
        return ("array", places[key[1]], key[2], key[3])
    return tuple(_by_place(k, places) for k in key)


def fingerprint(fn) -> Fingerprint | None:
    """``fn``'s fingerprint, or None when it reads something that may change unseen."""
    if not isinstance(fn, types.FunctionType):
        return None
    watched: dict[int, object] = {}
    key = _function_key(fn, watched, 0)
    return None if key is _UNCACHEABLE else Fingerprint(key, watched)


def _code_names(code, out: set) -> set:
    out.update(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            _code_names(c, out)
    return out


def _function_key(fn, watched, depth):
    if depth > _MAX_DEPTH:
        return _UNCACHEABLE
    code = fn.__code__
    names = _code_names(code, set())
    parts = [code]
    if fn.__closure__:
        for cell in fn.__closure__:
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell: bound later, read at call time
                return _UNCACHEABLE
            k = _value_key(value, names, watched, depth)
            if k is _UNCACHEABLE:
                return _UNCACHEABLE
            parts.append(k)
    for value in fn.__defaults__ or ():
        k = _value_key(value, names, watched, depth)
        if k is _UNCACHEABLE:
            return _UNCACHEABLE
        parts.append(k)
    if fn.__kwdefaults__:
        for name, value in sorted(fn.__kwdefaults__.items()):
            k = _value_key(value, names, watched, depth)
            if k is _UNCACHEABLE:
                return _UNCACHEABLE
            parts.append((name, k))
    glb = fn.__globals__
    for name in sorted(names):
        if name in glb:
            k = _value_key(glb[name], names, watched, depth)
            if k is _UNCACHEABLE:
                return _UNCACHEABLE
            parts.append((name, k))
    return tuple(parts)


def _value_key(value, names, watched, depth):
    # Modules and functions before arrays: ``is_array`` reads ``.shape``, which a module
    # such as torch answers through a slow ``__getattr__``.
    if value is None or isinstance(value, (bool, str, bytes)):
        return (type(value), value)
    if _is_number(value):
        return (type(value), value.item() if isinstance(value, np.generic) else value)
    if isinstance(value, tuple):
        keys = tuple(_value_key(v, names, watched, depth + 1) for v in value)
        return _UNCACHEABLE if _UNCACHEABLE in keys else ("tuple", keys)
    if isinstance(value, types.FunctionType):
        if (value.__module__ or "").split(".")[0] in _LIBRARY_PREFIXES:
            # by identity, watched: a library's closures (torch's and_masks) die and their
            # ids come back as other functions'
            watched[id(value)] = value
            return ("function", id(value))
        k = _function_key(value, watched, depth + 1)
        return k if k is _UNCACHEABLE else ("function", k)
    if isinstance(value, types.ModuleType):
        return _module_key(value, names, watched, depth)
    if isinstance(value, (type, types.BuiltinFunctionType, types.BuiltinMethodType, np.dtype)) or \
            type(value).__name__ in ("dtype", "ufunc", "method_descriptor", "wrapper_descriptor"):
        return ("object", id(value))   # classes, builtins, dtypes: not mutated in practice
    if type(value).__name__ in _JAX_FUNCTION_TYPES and (getattr(value, "__module__", None) or "").startswith("jax"):
        return ("object", id(value))   # jax.numpy's jitted functions, jax.nn's custom_jvp ones
    if is_array(value):
        try:
            weakref.ref(value)
        except TypeError:
            return _UNCACHEABLE
        watched[id(value)] = value
        return ("array", id(value), tuple(value.shape), str(value.dtype))
    from .mod import Mod

    if isinstance(value, Mod):   # immutable; its captures are its own
        watched[id(value)] = value
        return ("mod", id(value))
    return _object_key(value, names, watched, depth)


# Code naming these may read attributes the fingerprint does not see.
_COMPUTED_ACCESS = frozenset(("getattr", "vars", "__dict__", "__getattribute__", "attrgetter"))


def _object_key(obj, names, watched, depth):
    """An object by identity plus the attributes the code names (see the module doc)."""
    if (depth >= _MAX_DEPTH or names & _COMPUTED_ACCESS
            or isinstance(obj, (list, dict, set, frozenset, bytearray, memoryview, types.MethodType))):
        return _UNCACHEABLE
    try:
        weakref.ref(obj)
    except TypeError:
        return _UNCACHEABLE
    key = _attributes_key(("object", id(obj)), obj, names, watched, depth, lambda value: False)
    if key is not _UNCACHEABLE:
        watched[id(obj)] = obj
    return key


def _module_key(module, names, watched, depth):
    """A module by identity, plus the attributes the code names that are user data
    (``config.WINDOW``, ``settings.bias``): a library's own attributes are fixed."""
    if (module.__name__ or "").split(".")[0] in _LIBRARY_PREFIXES:
        return ("module", id(module))
    return _attributes_key(("module", id(module)), module, names, watched, depth,
                           lambda value: value is None or isinstance(value, types.ModuleType))


def _attributes_key(head, obj, names, watched, depth, skip):
    """``head`` plus the key of each attribute of ``obj`` the code names (absent ones and
    those ``skip(value)`` says left out), or ``_UNCACHEABLE`` if one cannot be keyed."""
    parts = [head]
    for name in sorted(names):
        try:
            value = getattr(obj, name)
        except AttributeError:
            continue
        except Exception:   # a property that fails: nothing to rely on
            return _UNCACHEABLE
        if skip(value):
            continue
        k = _value_key(value, names, watched, depth + 1)
        if k is _UNCACHEABLE:
            return _UNCACHEABLE
        parts.append((name, k))
    return tuple(parts)


class _Entry:
    __slots__ = ("expr", "captures", "name", "finalizers")

    def __init__(self, mod, places: dict, finalizers):
        self.expr, self.name, self.finalizers = mod.expr, mod.name, finalizers
        # numbers by value, arrays by their place among the fingerprint's arrays
        self.captures = tuple(c if _is_number(c) else _Place(places[id(c)]) for c in mod.captures)

    def mod(self, cls, arrays: list):
        """The mod again over ``arrays`` (this call's, from the fingerprint)."""
        return cls(self.expr, tuple(arrays[c.index] if isinstance(c, _Place) else c for c in self.captures), self.name)

    def drop(self):
        for f in self.finalizers:
            f.detach()


class _Place:
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


class TraceCache:
    """fingerprint -> traced IR of one kind of mod (``cls``, made by ``trace``); bounded,
    least recently used out."""

    def __init__(self, cls, trace, capacity: int = 256):
        self.cls, self.trace, self.capacity = cls, trace, capacity
        self._entries: OrderedDict = OrderedDict()

    def __len__(self):
        return len(self._entries)

    def clear(self):
        for entry in self._entries.values():
            entry.drop()
        self._entries.clear()

    def lookup(self, fn, name=None):
        """The mod of ``fn`` (named ``name``): from a kept trace when ``fn``'s fingerprint
        matches one, else a fresh trace, kept when the fingerprint covers everything it
        captured."""
        fp = fingerprint(fn)
        if fp is None:
            return self.trace(fn, name)
        key = (fp.shape_key, name)
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
            return entry.mod(self.cls, fp.arrays)
        mod = self.trace(fn, name)
        if all(_is_number(c) or id(c) in fp.places for c in mod.captures):
            self._keep(key, fp, mod)
        return mod

    def _keep(self, key, fp, mod):
        try:   # an entry leaves when something it names by identity dies (its id could be reused)
            finalizers = [weakref.finalize(obj, self._pop, key) for obj in fp.watched.values()
                          if id(obj) not in fp.places]
        except TypeError:   # not weakly referenceable after all
            return
        self._entries[key] = _Entry(mod, fp.places, finalizers)
        if len(self._entries) > self.capacity:
            self._pop(next(iter(self._entries)))

    def _pop(self, key):
        entry = self._entries.pop(key, None)
        if entry is not None:
            entry.drop()
