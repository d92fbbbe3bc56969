"""Temporary (session 24): one fwd+bwd step of ours and FA4 at head dims D/Dv, causal, inside a
profiler range for ncu --profile-from-start off."""
import math, sys
import torch
from bench_bwd import fwd_bwd
from bench_fwd import setup_dynamo


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


setup_dynamo()
import flexattn.torch as fa
from flash_attn.cute import flash_attn_func
B, S, H = 2, 4096, 16
D, Dv = map(int, sys.argv[1].split("/"))
bm = fa.create_block_mask(causal, None, None, S, S, device="cuda")
q, k = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16).requires_grad_(True) for _ in range(2))
v = torch.randn(B, S, H, Dv, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
scale = 1 / math.sqrt(D)
grad = torch.randn(B, H, S, Dv, device="cuda", dtype=torch.bfloat16)
steps = [("ours", fwd_bwd(lambda: fa.flex_attention(qh, kh, vh, block_mask=bm, scale=scale), (q, k, v), grad)),
         ("fa4", fwd_bwd(lambda: flash_attn_func(q, k, v, softmax_scale=scale, causal=True), (q, k, v),
                         grad.transpose(1, 2)))]
for _, s in steps:
    for _ in range(3):
        s()
torch.cuda.synchronize()
torch.cuda.profiler.start()
for label, s in steps:
    s()
    torch.cuda.synchronize()
torch.cuda.profiler.stop()
print("profiled")
