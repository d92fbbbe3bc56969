"""Reproduces, without flexattn's kernels, why the JAX GPU path aliases no result to an
operand: XLA's dynamic-slice fusion loses what a cutlass_call custom call writes into a
result aliased to an operand (``input_output_aliases``) when the call sits in a
``lax.scan`` body whose result is stacked.

A two-line CuTeDSL kernel writes y = 2x + 1 and z = x; the scan stacks y. With the results
free, or with ``--xla_gpu_enable_dynamic_slice_fusion=false``, the stack is right; with both
results aliased to zeros operands, XLA wraps dynamic-slice(xs) + the custom call +
dynamic-update-slice(ys) into one ``kind=kCustom`` fusion that hands the call the slice of
ys as its result buffer, while the aliased operand keeps a buffer of its own; the CuTeDSL
runtime passes the kernel the operand (aliased results are not kernel arguments), so ys
stays zero. XLA forms the fusion only for large enough, aligned slices (4096 bytes here,
not 4000).

Seen on an H100, jax 0.11.2, nvidia-cutlass-dsl 4.8.1, 2026-11-22 00:13 UTC:
n=1024 and n=33280 aliased: all zeros (fusion formed); free: right; n=1000: right either
way (no fusion); all right with the fusion off.

    python3 benchmarks/xla_alias_repro.py
    XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=false python3 benchmarks/xla_alias_repro.py
"""

import flexattn.kernels  # noqa: F401  (CUTE_DSL_ARCH before cutlass loads)

import cutlass
import cutlass.cute as cute
import jax
import jax.numpy as jnp
import numpy as np


@cute.kernel
def _kernel(x: cute.Tensor, y: cute.Tensor, z: cute.Tensor, n: cutlass.Int32):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    i = bidx * 128 + tidx
    if i < n:
        y[i] = x[i] * cutlass.Float32(2.0) + cutlass.Float32(1.0)
        z[i] = x[i]


@cute.jit
def entry(stream, x: cute.Tensor, y: cute.Tensor, z: cute.Tensor):
    n = cute.size(x.shape[0])
    _kernel(x, y, z, n).launch(grid=[(n + 127) // 128, 1, 1], block=[128, 1, 1], stream=stream)


def main():
    import cutlass.jax
    from cutlass.jax import TensorSpec

    from flexattn.kernels.launch.compile import ARCH_OPTION

    layers, spec = 3, TensorSpec(divisibility=(1,), ptr_assumed_align=4)
    for n in (1000, 1024, 33280):
        sds = (jax.ShapeDtypeStruct((n,), jnp.float32),) * 2
        free = cutlass.jax.cutlass_call(entry, output_shape_dtype=sds, compile_options=ARCH_OPTION,
                                        input_spec=(spec,), output_spec=(spec, spec))
        aliased = cutlass.jax.cutlass_call(entry, output_shape_dtype=sds, compile_options=ARCH_OPTION,
                                           input_spec=(spec,) * 3, output_spec=(spec, spec),
                                           input_output_aliases={1: 0, 2: 1})
        xs = jnp.arange(layers * n, dtype=jnp.float32).reshape(layers, n)
        cases = {"free": lambda xs: jax.lax.scan(lambda c, x: (c, free(x)[0]), 0, xs)[1],
                 "aliased": lambda xs: jax.lax.scan(
                     lambda c, x: (c, aliased(x, jnp.zeros_like(x), jnp.zeros_like(x))[0]), 0, xs)[1]}
        for name, f in cases.items():
            fused = "kind=kCustom" in jax.jit(f).lower(xs).compile().as_text()
            got = np.asarray(jax.jit(f)(xs))
            ok = np.array_equal(got, 2 * np.asarray(xs) + 1)
            print(f"n={n} {name}: {'right' if ok else 'WRONG'}, dynamic-slice fusion {'formed' if fused else 'not formed'}"
                  + ("" if ok else f", all zero: {bool((got == 0).all())}"))


if __name__ == "__main__":
    main()
