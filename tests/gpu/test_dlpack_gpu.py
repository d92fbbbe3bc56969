"""GPU: flexattn.dlpack with torch CUDA tensors handed over as plain DLPack objects (no
torch type visible to flexattn) gives the torch adapter's numbers bit for bit, on a side
stream. Skipped without CUDA."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cutlass")

import flexattn.torch as fa  # noqa: E402
from flexattn import mods  # noqa: E402
from flexattn.dlpack import flex_attention_into  # noqa: E402


class Plain:
    """An array known only by DLPack, shape and dtype."""

    def __init__(self, t):
        self._t = t
        self.shape, self.dtype = tuple(t.shape), str(t.dtype).replace("torch.", "")

    def __dlpack__(self, *args, **kwargs):
        return self._t.__dlpack__(*args, **kwargs)

    def __dlpack_device__(self):
        return self._t.__dlpack_device__()


def _to_device(x):   # host arrays the kernel reads (block lists, numpy captures)
    return Plain(torch.from_numpy(np.ascontiguousarray(x)).cuda())


@pytest.mark.parametrize("dtype,D", [(torch.bfloat16, 128), (torch.float16, 64)])
def test_plain_dlpack_arrays_match_the_torch_adapter(dtype, D):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 4, 300, D, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(2, 2, 333, D, device="cuda", dtype=dtype, generator=g) for _ in range(2))
    slopes = np.linspace(0.1, 0.8, 4).astype(np.float32)   # a numpy capture: through to_device
    cases = [dict(), dict(mask=mods.causal()), dict(score=mods.alibi(slopes), mask=mods.sliding_window(64)),
             dict(block_mask=fa.create_block_mask(mods.causal(), None, None, 300, 333, BLOCK_SIZE=128))]
    stream = torch.cuda.Stream()
    for kw in cases:
        want, want_lse = fa.flex_attention(q, k, v, enable_gqa=True, return_lse=True, **kw)
        out, lse = torch.full_like(q, float("nan")), torch.full(q.shape[:3], float("nan"), device="cuda")
        stream.wait_stream(torch.cuda.current_stream())
        flex_attention_into(Plain(q), Plain(k), Plain(v), Plain(out), Plain(lse), enable_gqa=True,
                            stream=stream.cuda_stream, to_device=_to_device, **kw)
        stream.synchronize()
        assert torch.equal(out, want) and torch.equal(lse, want_lse), kw


def test_host_arrays_need_to_device():
    q = torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.float16)
    out, lse = torch.empty_like(q), torch.empty(q.shape[:3], device="cuda")
    table = np.zeros((2, 9), np.float32)   # a numpy capture: read on the GPU
    with pytest.raises(ValueError, match="to_device="):
        flex_attention_into(Plain(q), Plain(q), Plain(q), Plain(out), Plain(lse), score=mods.relative_bias(table))
