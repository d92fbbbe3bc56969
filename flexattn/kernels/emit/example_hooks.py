"""Hand-written `ModHook`s: they prove the hook mechanism until the IR emitter exists,
and serve the kernel tests and benchmarks. Each reads its parameters from the runtime
`args` tuple, never from Python attributes, so values never reach the compiled code."""

import cutlass.cute as cute
from cutlass import Float32

from flexattn.kernels.emit.mod_hook import ModHook


class CausalHook(ModHook):
    """mask: q >= kv (top-left aligned, as torch flex_attention's causal mask_mod)."""

    has_mask = True

    def mask(self, b, h, q, kv, args):
        return q >= kv


class SoftcapHook(ModHook):
    """score: cap * tanh(s / cap); args[0] is cap (Float32)."""

    has_score = True

    def score(self, s, b, h, q, kv, args):
        cap = args[0]
        return cap * cute.math.tanh(s / cap, fastmath=True)


class LaggedCausalHook(ModHook):
    """mask: kv + lag <= q; args[0] is lag (Int32). Rows q < lag see no key at all, so
    this exercises fully masked rows (output 0, LSE -inf)."""

    has_mask = True

    def mask(self, b, h, q, kv, args):
        return kv + args[0] <= q


class DocumentBiasHook(ModHook):
    """Captured buffers: mask doc[b, q] == doc[b, kv] (args[0]: int32 [B, S]) and
    score s + bias[h] (args[1]: float32 [H])."""

    has_mask = True
    has_score = True

    def mask(self, b, h, q, kv, args):
        doc = args[0]
        return doc[b, q] == doc[b, kv]

    def score(self, s, b, h, q, kv, args):
        return s + Float32(args[1][h])
