"""Forward attention with mods, side by side on one GPU in one process.

  flexattn   the user's door: flexattn.torch called exactly as torch's flex_attention is —
             torch-style functions (``mask_fn`` through ``create_block_mask(..., device="cuda")``,
             ``score_mod=fn``), torch's argument order
  flexattn-builtin  the same variant through our built-in mods (``mask=``/``block_mask=`` of
             ``mods.causal()``, ``mods.softcap(30)``, ...), where one exists
  fa4        FlashAttention-4, flash_attn.cute.flash_attn_func (where it has the variant);
             document4 through flash_attn_varlen_func (the documents as packed sequences)
  flex       torch flex_attention, torch.compile'd (Triton backend)
  flex-fa    torch flex_attention, kernel_options={"BACKEND": "FLASH"}
  cudnn      torch SDPA on the cuDNN backend (full and causal only)

TFLOP/s count 4·B·H·S²·D·density, the density being the exact fraction of attended
(q, kv) pairs (from our BlockMask), so every implementation is credited the same work.
Block masks are built once, outside the timed loop, for us and for torch. The first-call
seconds (trace + compile) and host µs per call are the headline column's. Inputs are one [B, S, H, D] storage,
viewed as [B, H, S, D] where a library wants that.

    python3 benchmarks/bench_fwd.py [--shapes 4x4096x16x128 ...] [--variants full causal ...] [--out results.json]
"""

import argparse
import datetime
import math
import time
import traceback

import numpy as np
import torch

from common import bench_ms, device_name, measure_until_stopped, rel_diff, report
from results_log import RECORD_HELP, append_rows, tflops_rows

VARIANTS = ("full", "causal", "window1024", "document4", "causal+softcap30", "causal+alibi", "dilated1024",
            "neighborhood2d")
# Asked for by name only: score mods through torch functions (mods/torch_functions.py:
# gelu built on the erf node, a softcap written with atan)
FUNCTION_SCORES = {
    "causal+gelu": lambda s, b, h, q, kv: torch.nn.functional.gelu(s),
    "causal+atan_softcap20": lambda s, b, h, q, kv: 20.0 * torch.atan(s / 20.0),
}
OPTIONAL_VARIANTS = tuple(FUNCTION_SCORES)
IMPLS = ("flexattn", "flexattn-builtin", "fa4", "flex", "flex-fa", "cudnn")
IMAGE_WIDTH = 64   # neighborhood2d: tokens are a row-major image this wide


class Variant:
    """One attention variant expressed for each library (None where a library lacks it)."""

    def __init__(self, name, B, S, H):
        from flexattn import mods

        self.name = name
        doc = torch.arange(S, device="cuda") * 4 // S  # 4 equal documents
        slopes = torch.from_numpy(mods.alibi_slopes(H)).cuda()
        causal_fn = lambda b, h, q, kv: q >= kv  # noqa: E731
        self.mask = self.score = self.mask_fn = self.score_fn = None
        self.fa4_kw, self.sdpa_kw = None, None
        self.fa4_documents = None   # FA4 runs equal documents as varlen sequences of this length
        self.trainable = ()  # captured tensors that require grad (bench_bwd differentiates them)
        self.flex_options = {}  # kernel_options for flex Triton (tiles that fit where its defaults do not)
        self.impls = IMPLS   # the implementations to run
        if name == "full":
            self.fa4_kw, self.sdpa_kw = {}, {"is_causal": False}
        elif name.startswith("causal"):
            self.mask, self.mask_fn = mods.causal(), causal_fn
            self.fa4_kw = {"causal": True}
            if name == "causal":
                self.sdpa_kw = {"is_causal": True}
            elif name == "causal+softcap30":
                self.score = mods.softcap(30.0)
                self.score_fn = lambda s, b, h, q, kv: 30.0 * torch.tanh(s / 30.0)
                self.fa4_kw = {"causal": True, "softcap": 30.0}
            elif name == "causal+alibi":
                self.score = mods.alibi(slopes)
                self.score_fn = lambda s, b, h, q, kv: s + slopes[h] * (kv - q)
                self.fa4_kw = None
            elif name in FUNCTION_SCORES:   # no built-in: the traced function as a mod value
                self.score_fn = FUNCTION_SCORES[name]
                self.score = mods.score_mod(self.score_fn)
                self.fa4_kw = None
            elif name == "causal+trainable_bias":  # learnable [H, 2S-1] relative bias
                rel = (0.1 * torch.randn(H, 2 * S - 1, device="cuda")).requires_grad_()
                self.score = mods.relative_bias(rel)  # rel[h, clamp(q - kv, ±(S-1)) + S - 1]
                self.score_fn = lambda s, b, h, q, kv: s + rel[h, q - kv + S - 1]
                self.fa4_kw = None
                self.trainable = (rel,)
                self.impls = ("flexattn", "flex")
                # Inductor's default tiles for this mod exceed the H100's shared memory
                # (no valid config, forward and backward): smaller tiles, one stage fewer.
                self.flex_options = {"BLOCK_M": 64, "BLOCK_N": 64, "num_stages": 2,
                                     "BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32}
        elif name == "window1024":
            self.mask = mods.sliding_window(1024)
            self.mask_fn = lambda b, h, q, kv: (q >= kv) & (q - kv <= 1024)
            self.fa4_kw = {"window_size": (1024, 0)}
        elif name == "document4":
            self.mask = mods.document(doc)
            self.mask_fn = lambda b, h, q, kv: doc[q] == doc[kv]
            self.fa4_documents = S // 4
        elif name == "dilated1024":   # mostly partial tiles: every other key within 512
            self.mask_fn = lambda b, h, q, kv: ((q - kv).abs() <= 512) & ((q - kv) % 2 == 0)
        elif name == "neighborhood2d":   # integer division: a 17 x 17 window on a 64-wide image
            w = IMAGE_WIDTH
            self.mask_fn = lambda b, h, q, kv: (((q // w) - (kv // w)).abs() <= 8) & (((q % w) - (kv % w)).abs() <= 8)
        else:
            raise ValueError(f"unknown variant {name}")


def run_shape(B, S, H, D, variants, rows):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    scale = 1.0 / math.sqrt(D)
    for name in variants:
        var = Variant(name, B, S, H)
        density, ours = door_call(var, qh, kh, vh, scale, S)
        work = 4.0 * B * H * S * S * D * density
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ref = ours()
        torch.cuda.synchronize()
        first_call = time.perf_counter() - t0
        res, diff = {"flexattn": bench_ms(ours)}, {}
        torch.cuda.synchronize()
        t0 = time.perf_counter()  # host cost per call: submit-only loop (GPU queue not full)
        for _ in range(20):
            ours()
        host_us = (time.perf_counter() - t0) / 20 * 1e6
        torch.cuda.synchronize()
        for impl, make in beside_the_door(q, k, v, scale, var, S):
            try:
                fn = make()
                if fn is None:
                    continue
                out = fn()
                torch.cuda.synchronize()
                diff[impl] = rel_diff(out, ref)
                res[impl] = bench_ms(fn)
            except Exception as e:  # a baseline that cannot run this variant must not hide the rest
                print(f"[{impl} {name}] failed: {type(e).__name__}: {str(e)[:200]}")
                traceback.print_exc(limit=1)
        tag = f"B{B} S{S} H{H} D{D}"
        row = {"shape": tag, "variant": name, "density": density, "first_call_s": first_call, "host_us": host_us,
               "tflops": {i: work / ms / 1e9 for i, ms in res.items()}, "ms": res, "rel_diff_vs_ours": diff}
        rows.append(row)
        print(f"{tag} {name:18s} " + "  ".join(f"{i}={row['tflops'][i]:.1f}" for i in res)
              + f"  first call {first_call:.2f}s  host {host_us:.0f}us  diffs {({i: f'{d:.1e}' for i, d in diff.items()})}", flush=True)


def door_call(var, qh, kh, vh, scale, S):
    """(density, call) of the user's door, the headline column: torch-style functions, a
    block mask built as a torch user builds it (``create_block_mask(fn, ..., device="cuda")``),
    ``flexattn.torch.flex_attention`` called with torch's arguments. qh, kh, vh: [B, H, S, D]."""
    import flexattn.torch as fa

    door_bm = fa.create_block_mask(var.mask_fn, None, None, S, S, device="cuda") if var.mask_fn else None
    density = door_bm.density() if door_bm is not None else 1.0
    return density, lambda: fa.flex_attention(qh, kh, vh, score_mod=var.score_fn, block_mask=door_bm, scale=scale)


def ours_mask_args(var, S):
    """(density, keyword args) for our call: the built-in causal structure for plain causal
    masks (``mask=``), a block mask built once otherwise (its exact density either way)."""
    import flexattn.torch as fa

    if var.mask is None:
        return 1.0, {}
    bm = fa.create_block_mask(var.mask, None, None, S, S)
    return bm.density(), ({"mask": var.mask} if var.name.startswith("causal") else {"block_mask": bm})


def beside_the_door(q, k, v, scale, var, S):
    """(impl, make) of every column beside the headline: our built-in mods where the
    variant has them ("flexattn-builtin"), then ``baselines``. q, k, v: [B, S, H, D]."""
    import flexattn.torch as fa

    makers = list(baselines(q, k, v, scale, var, S))
    if var.mask is not None or var.score is not None or var.name == "full":
        _, kw = ours_mask_args(var, S)
        qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
        makers.insert(0, ("flexattn-builtin",
                          lambda: lambda: fa.flex_attention(qh, kh, vh, score_mod=var.score, scale=scale, **kw)))
    return makers


def baselines(q, k, v, scale, var, S):
    """(impl, make) for each baseline this variant runs; ``make()`` returns a no-argument
    call (or None where the library lacks the variant). q, k, v: [B, S, H, D]."""
    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    makers = (("fa4", lambda: _fa4(q, k, v, scale, var)), ("flex", lambda: _flex(qh, kh, vh, scale, var, S, None)),
              ("flex-fa", lambda: _flex(qh, kh, vh, scale, var, S, "FLASH")), ("cudnn", lambda: _cudnn(qh, kh, vh, scale, var)))
    return [(impl, make) for impl, make in makers if impl in var.impls]


def _fa4(q, k, v, scale, var):
    if var.fa4_documents is not None:
        return _fa4_documents(q, k, v, scale, var.fa4_documents)
    if var.fa4_kw is None:
        return None
    from flash_attn.cute import flash_attn_func

    return lambda: flash_attn_func(q, k, v, softmax_scale=scale, **var.fa4_kw)


def _fa4_documents(q, k, v, scale, length):
    """Equal documents of ``length`` tokens the way FA4's users run them: its varlen call on
    the packed [B*S, H, D] tokens (views of q, k, v: no copy; gradients flow back), the
    output viewed as [B, S, H, D] again."""
    from flash_attn.cute import flash_attn_varlen_func

    B, S, H, D = q.shape
    cu = torch.arange(0, B * S + 1, length, device=q.device, dtype=torch.int32)

    def call():
        out = flash_attn_varlen_func(*(t.reshape(B * S, t.shape[2], t.shape[3]) for t in (q, k, v)),
                                     cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=length, max_seqlen_k=length,
                                     softmax_scale=scale)
        out = out[0] if isinstance(out, tuple) else out
        return out.reshape(B, S, H, out.shape[-1])
    return call


_compiled_flex = {}


def _flex(qh, kh, vh, scale, var, S, backend):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "flex" not in _compiled_flex:
        _compiled_flex["flex"] = torch.compile(flex_attention, dynamic=False)
    bm = create_block_mask(var.mask_fn, None, None, S, S, device="cuda") if var.mask_fn else None
    options = dict(var.flex_options, **({"BACKEND": backend} if backend else {}))
    kw = {"kernel_options": options} if options else {}
    fn = _compiled_flex["flex"]
    return lambda: fn(qh, kh, vh, score_mod=var.score_fn, block_mask=bm, scale=scale, **kw)


def _cudnn(qh, kh, vh, scale, var):
    if var.sdpa_kw is None:
        return None
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def fn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, scale=scale, **var.sdpa_kw)

    return fn


def table(rows, dev, stamp, title="Forward, bf16", flops="masked FLOPs × exact density") -> str:
    """Markdown: TFLOP/s per implementation, then ours (the headline column) against FA4,
    flex Triton, flex FLASH, and against our built-in spelling of the same variant."""
    host = all("host_us" in r for r in rows)
    ratios = (("ours/fa4", "fa4"), ("ours/flex", "flex"), ("ours/flex-fa", "flex-fa"),
              ("ours/builtin", "flexattn-builtin"))
    lines = [f"{title}, {dev}, {stamp}. TFLOP/s ({flops}).", "",
             "| shape | variant | " + " | ".join(IMPLS) + " | " + " | ".join(n for n, _ in ratios)
             + " | first call s |" + (" host µs/call |" if host else ""),
             "|---|---|" + "---|" * (len(IMPLS) + len(ratios) + 1 + host)]
    for r in rows:
        t = r["tflops"]
        cells = " | ".join(f"{t[i]:.1f}" if i in t else "n/a" for i in IMPLS)
        rs = " | ".join(f"{t['flexattn'] / t[i]:.2f}" if i in t else "n/a" for _, i in ratios)
        lines.append(f"| {r['shape']} | {r['variant']} | {cells} | {rs} | {r['first_call_s']:.2f} |"
                     + (f" {r['host_us']:.0f} |" if host else ""))
    return "\n".join(lines)


def setup_dynamo():
    """One compiled flex_attention serves every variant; let it hold them all (not fall back to eager)."""
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = 256
    torch._dynamo.config.accumulated_cache_size_limit = 4096


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="*", default=["4x4096x16x128"], help="BxSxHxD")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS + OPTIONAL_VARIANTS)
    ap.add_argument("--out", default=None, help="write rows + markdown table as JSON")
    ap.add_argument("--tvm-ffi", action="store_true", help="launch ours through TVM-FFI (FLEXATTN_TVM_FFI=1)")
    ap.add_argument("--record", action="store_true", help=RECORD_HELP)
    args = ap.parse_args()
    if args.tvm_ffi:
        import os

        os.environ["FLEXATTN_TVM_FFI"] = "1"
    setup_dynamo()
    rows = []

    def measure():
        for shape in args.shapes:
            B, S, H, D = map(int, shape.split("x"))
            run_shape(B, S, H, D, args.variants, rows)
    measure_until_stopped(measure, rows)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    md = table(rows, device_name(), stamp)
    report(md, rows, args.out, stamp)
    if args.record:
        append_rows("forward", tflops_rows(rows), script="bench_fwd.py", device=device_name(), date=stamp)


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
