"""Where the float32 "highest" forward's error lives, beside torch flex and SDPA (issue 25,
item 1: errors against float64 no worse than torch flex's under the same setting).

Causal attention of float32 randn inputs under ``torch.set_float32_matmul_precision
("highest")``, several seeds, a float64 reference over every head. Ours runs 3xTF32 with
each block's P V in a fresh accumulator added to O in registers (``FwdConfig.promote_pv``).
``--ours`` runs A/B settings beside the planned kernel, each "NAME=value[,NAME=value]" of
the planner's variables: S over the head dim in other pieces (``FLEXATTN_FWD_S_PROMOTE=N``,
0 = one accumulator), the approximate O / l (``FLEXATTN_FP32_EXACT_NORM=0``). (Finer P V
folds and P_lo V_lo as a fourth pass were measured on 2026-11-30 and removed: neither
moved the max error.) Per implementation: the max |out - float64| and the row where it
lies, that max over the first 128 rows (few keys: short chains, large values), the mean, and the
forward's time; the 0.9999 quantile of |out - float64| beside the max (a tail statistic that
one element's rounding does not move).

``--backward``: the gradients instead (dQ, dK, dV: max |grad - float64| relative to the
largest reference gradient of each), ours with S^T's and dP^T's head-dim chains summed in
pieces of k-blocks (``BwdConfig.chain_promote``; ``--ours FLEXATTN_BWD_CHAIN_PROMOTE=0``: one accumulator):
dS = P (dP - D) cancels in rows that see few keys, where flex's IEEE products keep dP = D.
``--exact-forward`` adds our backward kernels run on the float64 reference's O and LSE
(rounded to float32) and on our own forward's (the same kernels through the same call):
whether a gradient's error comes from the forward's O / LSE (and D = rowsum(dO O) made of
them) or from the backward's own sums.

    python3 benchmarks/fp32_error_study.py [--shapes 1x4096x8x128 1x4096x8x64] [--seeds 3] \
        [--ours "" FLEXATTN_FWD_S_PROMOTE=0 FLEXATTN_FWD_S_PROMOTE=2]
    python3 benchmarks/fp32_error_study.py --backward [--shapes 1x1025x4x128] \
        [--ours "" FLEXATTN_BWD_CHAIN_PROMOTE=0 FLEXATTN_BWD_DQ_PROMOTE=2] [--exact-forward]
"""

import argparse
import math
import os
import statistics

import torch

from bench_fwd import setup_dynamo
from common import bench_ms, device_name


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def causal_scores(q, k, scale):
    """float64 scaled scores, -inf above the diagonal."""
    S = q.shape[2]
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    return s.masked_fill(~torch.ones(S, S, dtype=torch.bool, device=q.device).tril(), float("-inf"))


def reference(q, k, v, scale):
    return torch.softmax(causal_scores(q, k, scale), -1) @ v.double()


def errors(out, want) -> dict:
    """max / first 128 rows' max / mean |out - want|, and the row of the max (causal: that
    row sees row + 1 keys; short rows err by the operand split, long ones by the sums)."""
    err = (out.double() - want).abs()
    row = int(err.flatten().argmax().item()) // err.shape[-1] % err.shape[-2]
    return {"max": err.max().item(), "first128": err[:, :, :128].max().item(), "mean": err.mean().item(),
            "row": row, "tail": tail(err)}


TAIL_QUANTILE = 0.9999


def tail(err) -> float:
    """The TAIL_QUANTILE quantile of ``err``: the far tail without the single largest
    element, whose value moves +-30% with any change of rounding (session 55); the tables
    give its ratio to flex's beside the max's."""
    flat = err.flatten()
    return flat.kthvalue(max(1, int(TAIL_QUANTILE * flat.numel()))).values.item()


def grad_errors(q, k, v, do, scale, fn) -> dict:
    """dQ, dK, dV of ``fn`` against float64: max error relative to each largest gradient."""
    for t in (q, k, v):
        t.grad = None
    fn().backward(do)
    return reference_grad_errors((q.grad, k.grad, v.grad), q, k, v, do, scale)


def reference_grad_errors(got, q, k, v, do, scale) -> dict:
    """Gradients ``got`` (dQ, dK, dV) against float64's: max error relative to each largest."""
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    reference(qd, kd, vd, scale).backward(do.double())
    out = {}
    for name, g, w in zip(("dq", "dk", "dv"), got, (qd, kd, vd)):
        err, top = (g.double() - w.grad).abs(), w.grad.abs().max()
        out[name] = (err.max() / top).item()
        out[name + "_tail"] = tail(err) / top.item()
    return out


def kernel_grad_errors(q, k, v, do, scale, block_mask, exact: bool) -> dict:
    """``grad_errors`` of our backward kernels alone, given the forward's O and LSE: the
    float64 reference's rounded to float32 (``exact``), or our forward kernel's."""
    from flexattn.blockmask.layout import as_block_mask
    from flexattn.problem.spec import AttentionSpec
    from flexattn.problem.validate import check_inputs
    from flexattn.torch.launches import _kernel_backward, _kernel_forward

    q, k, v = (t.detach() for t in (q, k, v))
    spec = AttentionSpec.from_args(block_mask=as_block_mask(block_mask))
    shape = check_inputs(q, k, v, spec)
    if exact:
        s = causal_scores(q, k, scale)
        out, lse = (torch.softmax(s, -1) @ v.double()).float(), torch.logsumexp(s, -1).float()
    else:
        out, lse = _kernel_forward(spec, shape, q, k, v)
    dq, dk, dv, _ = _kernel_backward(spec, shape, q, k, v, out, lse, do, None, (), 0)
    return reference_grad_errors((dq, dk, dv), q, k, v, do, scale)


def shape_and_masks(spec: str, fa, create_block_mask):
    """(B, S, H, D, softmax scale, our causal block mask, torch's) for "BxSxHxD"."""
    B, S, H, D = map(int, spec.split("x"))
    return (B, S, H, D, 1.0 / math.sqrt(D), fa.create_block_mask(causal, None, None, S, S, device="cuda"),
            create_block_mask(causal, None, None, S, S, device="cuda"))


def with_ours(impls: dict, settings, fa, q, k, v, block_mask) -> dict:
    """``impls`` plus ours under each A/B setting (``with_env``), named by it."""
    for setting in settings:
        def ours(setting=setting):
            with_env(setting)
            return fa.flex_attention(q, k, v, block_mask=block_mask)
        impls[f"ours {setting or 'planned'}"] = ours
    return impls


def backward_study(args, fa, flex, create_block_mask):
    rows = []
    for spec in args.shapes:
        B, S, H, D, scale, door_bm, torch_bm = shape_and_masks(spec, fa, create_block_mask)
        for seed in range(args.seeds):
            g = torch.Generator(device="cuda").manual_seed(seed)
            q, k, v, do = (torch.randn(B, H, S, D, device="cuda", generator=g) for _ in range(4))
            for t in (q, k, v):
                t.requires_grad_()
            impls = with_ours({"flex": lambda: flex(q, k, v, block_mask=torch_bm)}, args.ours, fa, q, k, v, door_bm)
            for name, fn in impls.items():
                if name.startswith("ours"):
                    forget_prepared_calls()
                try:
                    errs = grad_errors(q, k, v, do, scale, fn)
                except Exception as e:   # one library failing (e.g. flex's shared memory) must not hide the others
                    print(f"[{name} {spec}] failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                if seed == 0:
                    def step(fn=fn):
                        for t in (q, k, v):
                            t.grad = None
                        fn().backward(do)
                    errs["ms"] = bench_ms(step)
                rows.append((spec, name, seed, errs))
                print(rows[-1], flush=True)
            if args.exact_forward:
                with_env("")
                forget_prepared_calls()
                for name, exact in (("ours kernels, own O / LSE", False), ("ours kernels, float64 O / LSE", True)):
                    errs = kernel_grad_errors(q, k, v, do, scale, door_bm, exact)
                    errs["ms"] = float("nan")
                    rows.append((spec, name, seed, errs))
                    print(rows[-1], flush=True)
    with_env("")

    def cells(es, flex_es):
        out = []
        for g in ("dq", "dk", "dv"):
            ratios = "/".join(f"{e[g] / f[g]:.2f}" for e, f in zip(es, flex_es)) or "—"
            tails = "/".join(f"{e[g + '_tail'] / f[g + '_tail']:.2f}" for e, f in zip(es, flex_es)) or "—"
            out.append(f"{max(e[g] for e in es):.2e} ({ratios}; tail {tails})")
        return out + [f"{es[0]['ms']:.3f}"]

    print_table(f"causal fwd+bwd, {device_name()}, seeds 0-{args.seeds - 1}: max |grad - float64| / max |float64 grad|"
                f" (worst seed; in brackets ours / flex per seed, of the max and of the {TAIL_QUANTILE} quantile)",
                ["dQ", "dK", "dV", "fwd+bwd ms (seed 0)"], rows, args.shapes, cells)


def print_table(title: str, columns, rows, shapes, cells):
    """A markdown table: per shape and implementation, ``cells(its results by seed, flex's)``."""
    print(f"\nfloat32 'highest', {title}\n")
    print("| shape | impl | " + " | ".join(columns) + " |\n" + "|---" * (len(columns) + 2) + "|")
    for spec in shapes:
        runs = grouped(rows, spec)
        for name, es in runs.items():
            print(f"| {spec} | {name} | " + " | ".join(cells(es, runs.get("flex", []))) + " |")


def grouped(rows, spec) -> dict:
    """impl -> its rows' results at shape ``spec``, in seed order."""
    out = {}
    for s, name, seed, result in rows:
        if s == spec:
            out.setdefault(name, []).append(result)
    return out


_SET: list = []   # the variables the last with_env set


def with_env(setting: str):
    """Set the A/B variables of ``setting`` ("NAME=value,NAME=value"; "" = the planner's
    defaults), clearing those a previous setting left."""
    for name in _SET:
        os.environ.pop(name, None)
    _SET.clear()
    for item in filter(None, setting.split(",")):
        name, value = item.split("=")
        os.environ[name] = value
        _SET.append(name)


def forget_prepared_calls():
    """The torch door's repeat-call caches hold a plan; a new A/B setting must plan anew."""
    from flexattn.torch import attention, ops
    attention._PREPARED.clear()
    ops._OP_PREPARED.clear()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=None, help="BxSxHxD")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--ours", nargs="*", default=["", "FLEXATTN_FWD_S_PROMOTE=0"],
                    help="A/B settings of ours, each NAME=value[,NAME=value] ('' = planned)")
    ap.add_argument("--backward", action="store_true")
    ap.add_argument("--exact-forward", action="store_true",
                    help="--backward: also our backward kernels on float64 O / LSE and on our own")
    args = ap.parse_args()
    setup_dynamo()
    import flexattn.torch as fa
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.set_float32_matmul_precision("highest")
    flex = torch.compile(flex_attention, dynamic=False)
    default_shapes = ["1x1025x4x128", "1x4096x4x128"] if args.backward else ["1x4096x8x128", "1x4096x8x64"]
    args.shapes = args.shapes or default_shapes
    if args.backward:
        return backward_study(args, fa, flex, create_block_mask)
    rows = []   # (shape, impl, seed, errors and ms)
    for spec in args.shapes:
        B, S, H, D, scale, door_bm, torch_bm = shape_and_masks(spec, fa, create_block_mask)
        for seed in range(args.seeds):
            g = torch.Generator(device="cuda").manual_seed(seed)
            q, k, v = (torch.randn(B, H, S, D, device="cuda", generator=g) for _ in range(3))
            want = reference(q, k, v, scale)
            sdpa = torch.nn.functional.scaled_dot_product_attention
            impls = with_ours({"flex": lambda: flex(q, k, v, block_mask=torch_bm),
                               "sdpa": lambda: sdpa(q, k, v, is_causal=True)}, args.ours, fa, q, k, v, door_bm)
            for name, fn in impls.items():
                if name.startswith("ours"):
                    forget_prepared_calls()
                try:
                    out = fn()
                except Exception as e:   # one library failing (e.g. flex's shared memory) must not hide the others
                    print(f"[{name} {spec}] failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                ms = bench_ms(fn) if seed == 0 else float("nan")
                rows.append((spec, name, seed, {**errors(out, want), "ms": ms}))
                print(rows[-1], flush=True)
                del out
            del want
    with_env("")

    def cells(es, flex_es):
        ratios = " / ".join(f"{e['max'] / f['max']:.2f}" for e, f in zip(es, flex_es)) or "—"
        tails = " / ".join(f"{e['tail'] / f['tail']:.2f}" for e, f in zip(es, flex_es)) or "—"
        return [f"{max(e['max'] for e in es):.2e}", ratios, tails, " / ".join(str(e["row"]) for e in es),
                f"{max(e['first128'] for e in es):.2e}", f"{statistics.mean(e['mean'] for e in es):.2e}",
                f"{es[0]['ms']:.3f}"]

    print_table(f"causal, {device_name()}, seeds 0-{args.seeds - 1}: max |out - float64| (worst seed), the row of"
                f" each seed's max, its {TAIL_QUANTILE} quantile's ratio to flex's, the max over the first 128 rows,"
                " the mean (average of seeds), ms (seed 0)",
                ["max", "ratio to flex (per seed)", f"q{TAIL_QUANTILE} ratio to flex (per seed)",
                 "row of the max (per seed)", "first 128 rows", "mean", "ms"], rows, args.shapes, cells)


if __name__ == "__main__":
    main()
