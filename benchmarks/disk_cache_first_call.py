"""First calls with kernels compiled vs loaded from the disk cache, on the GPU.

    python benchmarks/disk_cache_first_call.py            # driver: runs the two processes below

The driver points FLEXATTN_CACHE_DIR at a new temporary directory and runs this script
twice as a child (``--child OUT``): the first child compiles every kernel of a small
workload and stores them, the second finds them on disk. Each child times the first
(and second) call of each step — GPU block mask (classifier + compaction), forward,
backward (three kernels), decode — synchronizing around each, and saves every output.
The driver prints the times and checks that both children's outputs are bitwise equal
and that the second one compiled nothing.
"""

import json
import os
import subprocess
import sys
import tempfile
import time


def child(out_path: str) -> None:
    import numpy as np
    import torch

    import flexattn.torch as fa
    from flexattn import mods
    from flexattn.kernels.blockmask import classify as blockmask_sm90
    from flexattn.kernels.launch import cache
    from flexattn.kernels.launch import disk_cache

    dev = os.environ.get("DEVICE", "cuda")   # DEVICE=cpu: a smoke test of this script (reference path)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    torch.use_deterministic_algorithms(True)   # the deterministic backward: bitwise-comparable dQ
    torch.zeros(1, device=dev)
    sync()   # CUDA context and torch's lazy init stay out of the timings
    gen = torch.Generator(device=dev).manual_seed(0)
    B, Hq, Hkv, S, D = 2, 8, 2, 1000, 128

    def randn(*shape):
        return torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=gen)

    q, k, v = randn(B, Hq, S, D), randn(B, Hkv, S, D), randn(B, Hkv, S, D)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    do = randn(B, Hq, S, D)
    score = mods.softcap(20.0)
    mask = mods.causal() & mods.sliding_window(300)
    kq = randn(B, Hq, 1, D)
    kv_cache = fa.KVCache(randn(B, Hkv, 2048, D), randn(B, Hkv, 2048, D),
                          torch.tensor([1500, 777], dtype=torch.int32))

    def timed(fn):
        sync()
        t0 = time.perf_counter()
        r = fn()
        sync()
        return r, time.perf_counter() - t0

    def block_mask():
        return fa.create_block_mask(mask, None, None, S, S, device=dev)

    def forward(bm):
        return fa.flex_attention(q, k, v, score_mod=score, block_mask=bm, enable_gqa=True)

    def backward(out):
        q.grad = k.grad = v.grad = None
        out.backward(do)
        return q.grad.clone(), k.grad.clone(), v.grad.clone()

    def decode():
        return fa.decode(kq, kv_cache, score_mod=mods.alibi(num_heads=Hq), mask=mods.sliding_window(600))

    times, outputs = {}, {}
    for rep in ("first", "second"):
        bm, times[f"block_mask_{rep}"] = timed(block_mask)
        out, times[f"forward_{rep}"] = timed(lambda: forward(bm))
        grads, times[f"backward_{rep}"] = timed(lambda: backward(out))
        dec, times[f"decode_{rep}"] = timed(decode)
    lists = {n: getattr(bm, n) for n in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")}
    outputs = {"out": out, "dq": grads[0], "dk": grads[1], "dv": grads[2], "decode": dec,
               **{n: torch.as_tensor(np.asarray(x)) if not isinstance(x, torch.Tensor) else x for n, x in lists.items()}}
    torch.save({n: t.detach().cpu() for n, t in outputs.items()}, out_path + ".pt")
    with open(out_path + ".json", "w") as f:
        json.dump(dict(times=times, compile_count=cache.compile_count() + blockmask_sm90.compile_count(),
                       disk_loads=disk_cache.load_count(), disk_stores=disk_cache.store_count(),
                       device=torch.cuda.get_device_name() if dev == "cuda" else dev), f)


def main() -> None:
    import torch

    root = tempfile.mkdtemp(prefix="flexattn-disk-cache-")
    env = dict(os.environ, FLEXATTN_CACHE_DIR=os.path.join(root, "kernels"))
    env.pop("FLEXATTN_DISK_CACHE", None)
    results = []
    for name in ("compiled", "loaded"):
        out = os.path.join(root, name)
        subprocess.run([sys.executable, __file__, "--child", out], env=env, check=True)
        with open(out + ".json") as f:
            results.append(json.load(f))
        results[-1]["outputs"] = torch.load(out + ".pt")
    print(f"{results[0]['device']}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"{'step':<12} {'compiled: 1st call':>19} {'2nd':>8} {'loaded: 1st call':>17} {'2nd':>8}   (seconds)")
    for step in ("block_mask", "forward", "backward", "decode"):
        row = [r["times"][f"{step}_{rep}"] for r in results for rep in ("first", "second")]
        print(f"{step:<12} {row[0]:>19.4f} {row[1]:>8.4f} {row[2]:>17.4f} {row[3]:>8.4f}")
    for name, r in zip(("compiled", "loaded"), results):
        print(f"{name}: kernels obtained {r['compile_count']}, loaded from disk {r['disk_loads']}, "
              f"stored {r['disk_stores']}")
    a, b = (r["outputs"] for r in results)
    same = {n: bool(torch.equal(a[n], b[n])) for n in a}
    print("bitwise equal:", same)
    ok = all(same.values()) and results[1]["disk_loads"] == results[1]["compile_count"] > 0 \
        and results[1]["disk_stores"] == 0
    print("OK" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
    else:
        main()
