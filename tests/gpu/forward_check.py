"""GPU test helper (not a test module): the forward through the core's destination-passing
path (``kernel_path.forward_into``) into NaN-poisoned O and LSE, against the float64
reference — shared by the randomized mod cases and the head-dim cases."""

import numpy as np
import torch

from flexattn import reference
from flexattn.core import check_inputs
from flexattn.core.kernel_path import Device, forward_into

TOL = {torch.bfloat16: 2.5e-2, torch.float16: 5e-3}   # max |O - reference| by input dtype


def torch_device() -> Device:
    """The core's device facts for torch's current CUDA stream."""
    from flexattn.torch.devices import _DeviceCopies

    return Device(torch.cuda.current_stream().cuda_stream, _DeviceCopies(torch.device("cuda")))


def check_forward(name: str, q, k, v, spec, shape=None) -> None:
    """Our forward of (q, k, v, spec) against ``reference.forward``: no NaN left in the
    poisoned outputs, the same fully-masked rows (LSE -inf, O zero), O within ``TOL`` and
    the LSE within 5e-3 (relative beyond 50). ``shape``: ``check_inputs``' result, if the
    caller has it."""
    shape = check_inputs(q, k, v, spec) if shape is None else shape
    out = torch.full((shape.batch, shape.q_heads, shape.q_len, shape.v_head_dim), float("nan"), dtype=q.dtype,
                     device="cuda")
    lse = torch.full((shape.batch, shape.q_heads, shape.q_len), float("nan"), device="cuda")
    forward_into(q, k, v, out, lse, shape, spec, torch_device())
    torch.cuda.synchronize()
    want_o, want_lse = reference.forward(q.cpu(), k.cpu(), v.cpu(), spec)
    got_o, got_lse = out.double().cpu().numpy(), lse.double().cpu().numpy()
    assert not np.isnan(got_o).any() and not np.isnan(got_lse).any(), f"{name}: NaN left in outputs"
    dead = np.isneginf(want_lse)
    assert np.array_equal(np.isneginf(got_lse), dead), f"{name}: fully-masked rows differ"
    assert np.all(got_o[dead] == 0), f"{name}: fully-masked rows not zero"
    err_o = np.abs(got_o - want_o).max()
    assert err_o < TOL[q.dtype], f"{name}: out error {err_o:.3g}"
    if (~dead).any():
        err_lse = np.abs(got_lse[~dead] - want_lse[~dead]).max()
        assert err_lse < 5e-3 * max(1.0, np.abs(want_lse[~dead]).max() / 50), f"{name}: lse error {err_lse:.3g}"
