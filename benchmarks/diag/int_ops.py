import numpy as np, torch, cuda.bindings.driver as cuda
from cutlass import Int32
from flexattn import mods
from flexattn.kernels.mod_emit import IRModHook, runtime_args
from flexattn.kernels.mod_eval import compile_mod_eval, grid_arg
from flexattn.mods.evaluate import evaluate
S=37
subs = {
 "a>c": lambda b,h,q,kv: ((q*3 - kv*2 + h)//4) > ((q-kv)%5),
 "d%2": lambda b,h,q,kv: (torch.minimum(q, kv) + torch.maximum(q, kv) - (q - kv).abs()) % 2 == 0,
 "bits": lambda b,h,q,kv: ((q & 3) | (kv ^ 5)) != (~kv & 7),
 "notdiag": lambda b,h,q,kv: ~(q == kv),
 "half": lambda b,h,q,kv: (q.float() * 0.5).int() == kv // 2,
 "xor": lambda b,h,q,kv: (q > kv) ^ (q % 2 == 0),
 "invert": lambda b,h,q,kv: (~kv) < -5,
}
stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
for name, fn in subs.items():
    m = mods.mask_mod(fn); hook = IRModHook(None, m); k = compile_mod_eval(hook)
    sc = torch.zeros(S,S,device="cuda"); os_ = torch.zeros_like(sc); om = torch.full((S,S),7,dtype=torch.int8,device="cuda")
    k(grid_arg(sc), grid_arg(os_), grid_arg(om), Int32(0), Int32(1), runtime_args(hook, lambda x: x) or None, stream)
    torch.cuda.synchronize()
    want = np.broadcast_to(evaluate(m.expr, {"b":0,"h":1,"q":np.arange(S)[:,None],"kv":np.arange(S)[None,:]}), (S,S))
    got = om.cpu().numpy()
    bad = np.argwhere(got != want)
    print(name, len(bad), bad[:6].tolist(), [(int(got[i,j]), bool(want[i,j])) for i,j in bad[:6]])
