"""Framework-neutral array helpers: facts about arrays and host copies, by protocol only.

Nothing here imports torch, cupy or jax; every framework's arrays expose ``shape``,
``dtype`` and DLPack (``__dlpack__``), which is all the core relies on.
"""

from __future__ import annotations

import numpy as np


_DTYPE_NAMES: dict = {}  # dtype object -> name (str() of a dtype costs a microsecond per call)


def dtype_name(x) -> str:
    """'float32', 'bfloat16', 'int64'... for numpy, torch, jax and cupy arrays alike."""
    dt = x.dtype
    try:
        return _DTYPE_NAMES[dt]
    except (KeyError, TypeError):  # TypeError: an unhashable dtype
        name = str(dt).replace("torch.", "")
        try:
            _DTYPE_NAMES[dt] = name
        except TypeError:
            pass
        return name


def device_type(x) -> str:
    """'cpu' or 'cuda' (or another DLPack device name) of an array."""
    if isinstance(x, np.ndarray):
        return "cpu"
    kind = getattr(getattr(x, "device", None), "type", None)
    if kind in ("cpu", "cuda"):  # torch: ~5x cheaper than asking DLPack
        return kind
    if hasattr(x, "__dlpack_device__"):
        kind = int(x.__dlpack_device__()[0])
        return {1: "cpu", 2: "cuda", 3: "cpu", 13: "cuda"}.get(kind, f"dlpack-device-{kind}")
    return "cpu"


def to_numpy(x) -> np.ndarray | int | float:
    """A host numpy copy/view of ``x`` (Python numbers pass through).

    numpy cannot hold bfloat16 and DLPack refuses tensors that require grad, so those
    take the framework's own conversion methods (``detach``, ``float``, ``get``).
    """
    if isinstance(x, (bool, int, float)):
        return x
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "detach"):  # torch: drop autograd, move to host, widen bf16
        x = x.detach()
        if dtype_name(x) in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
            x = x.float()
        return x.cpu().numpy()
    if hasattr(x, "get") and device_type(x) == "cuda":  # cupy
        x = x.get()
    arr = np.asarray(x)
    if arr.dtype.kind == "V" or "bfloat16" in str(arr.dtype):  # ml_dtypes bfloat16 (jax)
        arr = arr.astype(np.float32)
    return arr
