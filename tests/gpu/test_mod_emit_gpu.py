"""GPU: the IR → CuTeDSL emitter agrees with the numpy oracle, element by element."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("cutlass")

import cuda.bindings.driver as cuda  # noqa: E402
from cutlass import Int32  # noqa: E402

from flexattn.arrays import to_numpy  # noqa: E402
from flexattn.kernels.emit.mod_emit import IRModHook, runtime_args  # noqa: E402
from flexattn.kernels.emit.mod_eval import compile_mod_eval, grid_arg  # noqa: E402
from flexattn.mods.evaluate import evaluate  # noqa: E402

import mod_zoo  # noqa: E402


def _dev(x):
    return (x if isinstance(x, torch.Tensor) else torch.from_numpy(np.asarray(x))).cuda().contiguous()


@pytest.mark.parametrize("mode", ["elements", "elements-q", "rows", "hoisted", "tiled", "tiled-rows"])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("S", [37, 130])
def test_emitted_mods_match_numpy(seed, S, mode):
    """Per-element emission, row emission (vectors of 8 keys, as the forward's apply_mods
    uses it on fragment rows), per-element emission with the buffer reads that do not
    depend on kv hoisted per query row (as the decode kernel emits them), and both with the
    reads at kv // page hoisted per tile of 32 keys (``tiled``: as the decode kernel and
    the forward's ``hoist_tile_reads`` emit them; written in session 47, first run next).
    ``elements-q``: per element with q (not kv) as the AffineIndex where the hooks ask, as
    the backward passes it (compares of q - kv with constants then take q's route)."""
    rng = np.random.default_rng(seed)
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    failures = []
    tiled = 32 if mode.startswith("tiled") else 0
    cases = dict(mod_zoo.zoo(rng, S), **mod_zoo.paged_zoo(rng, S))
    for name, (score, mask) in cases.items():
        hook = IRModHook(score, mask, fast_math=False)  # exact comparison with the oracle
        kernel = compile_mod_eval(hook, rows=mode in ("rows", "tiled-rows"), hoisted=mode == "hoisted", tiled=tiled,
                                  affine="q" if mode == "elements-q" else "kv")
        scores = torch.from_numpy(rng.standard_normal((S, S)).astype(np.float32) * 4).cuda()
        out_s = torch.full_like(scores, float("nan"))
        out_m = torch.full((S, S), 7, dtype=torch.int8, device="cuda")
        b, h = int(rng.integers(0, 2)), int(rng.integers(0, 4))
        args = runtime_args(hook, _dev) or None
        kernel(grid_arg(scores), grid_arg(out_s), grid_arg(out_m), Int32(b), Int32(h), args, stream)
        torch.cuda.synchronize()
        env = {"b": b, "h": h, "q": np.arange(S)[:, None], "kv": np.arange(S)[None, :]}
        if score is not None:
            want = evaluate(score.expr, dict(env, score=scores.cpu().double().numpy()),
                            [to_numpy(c) for c in score.captures])
            got = out_s.cpu().double().numpy()
            if not np.allclose(got, want, rtol=2e-5, atol=2e-5, equal_nan=True):
                failures.append(f"{name}: score max err {np.nanmax(np.abs(got - want)):.3g}")
        if mask is not None:
            want = np.broadcast_to(evaluate(mask.expr, env, [to_numpy(c) for c in mask.captures]), (S, S))
            got = out_m.cpu().numpy()
            if not np.array_equal(got, want.astype(np.int8)):
                failures.append(f"{name}: {int((got != want).sum())} mask elements differ")
    assert not failures, "; ".join(failures)


def test_fast_erf_is_within_its_stated_error():
    """The kernels' default (fast_math) erf is Abramowitz & Stegun 7.1.26 (mod_emit._erf_fast):
    within 1.5e-7 of the exact erf plus float32's rounding, in element and row emission."""
    import torch.nn.functional as F

    from flexattn import mods

    S = 130
    score = mods.score_mod(lambda s, b, h, q, kv: torch.erf(s) + F.gelu(s) * 0.1)
    rng = np.random.default_rng(9)
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    for rows in (False, True):
        hook = IRModHook(score, None, fast_math=True)
        kernel = compile_mod_eval(hook, rows=rows)
        scores = torch.from_numpy(rng.standard_normal((S, S)).astype(np.float32) * 3).cuda()
        out_s = torch.full_like(scores, float("nan"))
        out_m = torch.full((S, S), 7, dtype=torch.int8, device="cuda")
        kernel(grid_arg(scores), grid_arg(out_s), grid_arg(out_m), Int32(0), Int32(0), None, stream)
        torch.cuda.synchronize()
        env = {"b": 0, "h": 0, "q": np.arange(S)[:, None], "kv": np.arange(S)[None, :],
               "score": scores.cpu().double().numpy()}
        want = evaluate(score.expr, env, [])
        err = np.abs(out_s.cpu().double().numpy() - want).max()
        assert err < 1e-6, f"rows={rows}: max error {err:.3g}"
