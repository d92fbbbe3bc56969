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


def to_numpy_all(xs) -> list:
    """``to_numpy`` of each of ``xs`` (None passes), the GPU waited for once: torch tensors
    of one dtype on one CUDA device are gathered into one device buffer (their own
    ``new_empty`` / ``copy_``) and copied to the host in one go (a block mask's four
    lists: one synchronization instead of four)."""
    present = [x for x in xs if x is not None]
    torch_cuda = [x for x in present if hasattr(x, "detach") and getattr(x, "is_cuda", False)]
    if len(torch_cuda) < 2 or len(torch_cuda) != len(present) or \
            len({(x.dtype, x.device) for x in torch_cuda}) != 1 or dtype_name(torch_cuda[0]) == "bfloat16":
        return [None if x is None else to_numpy(x) for x in xs]
    sizes = [x.numel() for x in torch_cuda]
    gathered = torch_cuda[0].new_empty(sum(sizes))
    offset = 0
    for x, n in zip(torch_cuda, sizes):
        gathered.narrow(0, offset, n).copy_(x.detach().reshape(-1))
        offset += n
    host = gathered.cpu().numpy()
    out, offset, parts = [], 0, iter(zip(torch_cuda, sizes))
    for x in xs:
        if x is None:
            out.append(None)
            continue
        t, n = next(parts)
        out.append(host[offset:offset + n].reshape(tuple(t.shape)))
        offset += n
    return out


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
