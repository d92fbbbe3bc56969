"""What the three warp-specialized Hopper kernels (forward, backward, decode) share.

Each runs one producer warpgroup (warp 0 issues the TMA loads) and one to three consumer
warpgroups (wgmma, softmax, the epilogue), connected by TMA rings of mbarriers. The pieces
here are the ones every such kernel sets up the same way:

- ``KernelConfig``: the element types (``DTYPES``), compile-cache keys derived from the
  config dataclass's fields, and ``with_mods`` (the same config with another hook of the
  same structure);
- ``register_split``: one rule for the setmaxnreg budgets of the two roles;
- ``NamedBarriers``: a kernel's named barrier ids as an enum (0 is ``__syncthreads``),
  with sync / arrive over the consumer threads;
- ``WarpSpecialized``: descriptor prefetch, shared storage, the cluster-wide ring init and
  the role entry (producer gives registers away, consumers take them);
- ``store_staged``: the shared-memory-staged TMA store epilogue (registers → stmatrix →
  fence → one warp stores each tile).
"""

from __future__ import annotations

import dataclasses
import enum

import cutlass
import cutlass.cute as cute
from cutlass import const_expr, pipeline
from cutlass.cute.nvgpu import cpasync

from flexattn.kernels.hopper import mma

REGISTER_FILE = 65536      # 32-bit registers per SM
THREADS_PER_WARPGROUP = 128
MAX_REGS_PER_THREAD = 256  # setmaxnreg's ceiling
DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}   # Q, K, V, O and their gradients


def register_split(consumer_wgs: int, producer_regs: int, ctas_per_sm: int = 1,
                   max_consumer_regs: int = MAX_REGS_PER_THREAD) -> tuple:
    """(producer, consumer) setmaxnreg budgets: the producer warpgroup keeps
    ``producer_regs`` per thread, the consumer warpgroups share the rest of the registers
    the CTA launched with, each a multiple of 8 and at most ``max_consumer_regs``. E.g.
    forward 2 WGs: 24 / 240; 3 WGs: 32 / 160; 4 WGs: 24 / 112; decode two CTAs per SM:
    40 / 216.

    The pool is what the launch grants, not the register file: every thread launches with
    the same count, a multiple of 8 that fits the CTA's share (640 threads: 96, so 4 WGs
    pool 61440 of the 65536). setmaxnreg.inc waits for registers the CTA does not hold
    forever: budgets over the pool hang the kernel."""
    warpgroups = consumer_wgs + 1
    launch = REGISTER_FILE // ctas_per_sm // (THREADS_PER_WARPGROUP * warpgroups)
    launch = min(MAX_REGS_PER_THREAD, launch - launch % 8)
    consumer = (launch * warpgroups - producer_regs) // consumer_wgs
    return producer_regs, min(max_consumer_regs, consumer - consumer % 8)


class KernelConfig:
    """Mixin for the frozen config dataclasses. ``key()`` — the compile-cache key — is the
    kernel's ``KIND``, then every field but the hook (``key_values``, which a config may
    normalize: equal code, equal key), then the hook's structure key. Captured values are
    in no field, so new values never recompile."""

    KIND = ""
    ELEMENT_TYPES = DTYPES   # the dtypes a kernel takes (the forward adds fp32)

    @property
    def cutlass_dtype(self):
        return self.ELEMENT_TYPES[self.dtype]

    def check_dtype(self):
        if self.dtype not in self.ELEMENT_TYPES:
            raise ValueError(f"dtype must be one of {sorted(self.ELEMENT_TYPES)}, got {self.dtype!r}")

    def key_values(self) -> tuple:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "mods")

    def key(self) -> tuple:
        return (self.KIND,) + self.key_values() + (self.mods.key(),)

    def with_mods(self, mods):
        """This config with another hook of the *same structure* (the caller's promise:
        e.g. the same mods with this call's captured values). Skips re-validation: the
        planners call it on every launch."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        object.__setattr__(new, "mods", mods)
        return new


class NamedBarriers(enum.IntEnum):
    """Base of a kernel's named barrier ids (hardware barriers 1..15; 0 is
    ``__syncthreads``). Members that stand for one barrier per warpgroup are the first id
    of a consecutive run: ``member + wg``."""

    def sync(self, threads: int, offset=0):
        """Wait until ``threads`` threads have arrived on barrier ``self + offset``."""
        cute.arch.barrier(barrier_id=int(self) + offset, number_of_threads=threads)

    def arrive(self, threads: int, offset=0):
        """Arrive on barrier ``self + offset`` (of ``threads``) without waiting."""
        cute.arch.barrier_arrive(barrier_id=int(self) + offset, number_of_threads=threads)


class WarpSpecialized:
    """Base of the warp-specialized kernels: ``num_mma_threads`` consumer threads after one
    producer warpgroup, and the setup every such kernel performs the same way."""

    def __init__(self, num_mma_wg: int):
        self.num_mma_wg = num_mma_wg
        self.num_mma_threads = THREADS_PER_WARPGROUP * num_mma_wg
        self.num_threads = THREADS_PER_WARPGROUP + self.num_mma_threads

    @staticmethod
    def warp_index():
        return cute.arch.make_warp_uniform(cute.arch.warp_idx())

    @cute.jit
    def prefetch_descriptors(self, warp_idx, atoms):
        """Warp 0 prefetches the TMA descriptors (before anything waits on them)."""
        if warp_idx == 0:
            for atom in atoms:
                cpasync.prefetch_descriptor(atom)

    @staticmethod
    def allocate(shared_storage):
        return cutlass.utils.SmemAllocator().allocate(shared_storage)

    @staticmethod
    def rings_init_arrive(cluster_size: int = 1):
        """Publish the rings' mbarrier init; with a cluster, cluster-wide: the peers'
        multicasts and release arrives target these barriers."""
        cluster = (cluster_size, 1) if cluster_size > 1 else None
        pipeline.pipeline_init_arrive(cluster_shape_mn=cluster, is_relaxed=True)

    @staticmethod
    def rings_init_wait(cluster_size: int = 1):
        """Wait for every ring's init (cluster-wide with a cluster) before any load."""
        cluster = (cluster_size, 1) if cluster_size > 1 else None
        pipeline.pipeline_init_wait(cluster_shape_mn=cluster)

    @staticmethod
    def is_producer(warp_idx):
        """Warps 0-3 form the producer warpgroup."""
        return warp_idx < 4

    @staticmethod
    def enter_producer(regs: tuple):
        """The producer keeps ``regs[0]`` registers per thread, giving the rest away."""
        cute.arch.setmaxregister_decrease(regs[0])

    @staticmethod
    def enter_consumer(regs: tuple):
        """A consumer warpgroup grows to ``regs[1]`` registers per thread."""
        cute.arch.setmaxregister_increase(regs[1])


@cute.jit
def stage_tiles(tiled_mma, dtype, tidx, tiles, wg_cols: int = 16):
    """Registers → shared memory by stmatrix for each (register tile, smem tile) pair of
    ``tiles`` (the accumulator layout of ``tiled_mma``, already converted to ``dtype``).
    The caller has synchronized the consumers: the smem tiles are free. ``wg_cols``: as
    ``mma.stmatrix_copy``'s."""
    r2s = mma.stmatrix_copy(tiled_mma, dtype, tidx, wg_cols=wg_cols)
    for regs, smem in tiles:
        cute.copy(r2s, r2s.retile(regs), r2s.partition_D(smem))


@cute.jit
def store_staged(stores, tidx, barrier: NamedBarriers, threads: int, wait_read: cutlass.Constexpr = False):
    """The epilogue's second half: make the staged tiles visible to the async proxy, wait
    for every consumer's, then warp 0 TMA-stores each (atom, smem tile, global tile) that
    ``stores()`` gives (called there: the global tiles are only that warp's business) in
    one bulk group; ``wait_read``: and waits until the stores have read shared memory,
    before it is reused or the CTA exits."""
    cute.arch.fence_view_async_shared()   # generic-proxy writes → the TMA (async proxy)
    barrier.sync(threads)
    if tidx // 32 == 0:
        for atom, smem, gmem in stores():
            mma.tma_store_tile(atom, smem, gmem)
        cute.arch.cp_async_bulk_commit_group()
        if const_expr(wait_read):
            cute.arch.cp_async_bulk_wait_group(0, read=True)
