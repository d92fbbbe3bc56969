"""The one kind of smem pipeline the sm90 kernels use: one producer thread fills a ring of
`num_stages` buffers by TMA (mbarrier transaction counts), the consumer warpgroups release
each stage when their MMAs have read it. Forward, backward and decode build all their
rings (Q, K, V, dO, ...) with `tma_ring`.
"""

import cutlass
import cutlass.cute as cute
from cutlass import pipeline


def tma_ring(barrier_storage, num_stages: int, num_consumer_threads: int, tx_count: int,
             multicast: int = 1):
    """A `PipelineTmaAsync` over `barrier_storage` (2 * num_stages mbarriers): each stage
    expects `tx_count` bytes; it is released with one arrive per consumer warp (as
    PipelineTmaAsync's consumer release does). `defer_sync`: the kernel calls
    `pipeline_init_arrive` / `pipeline_init_wait` once for all its rings.

    `multicast` > 1: the stages are filled by TMA multicast from the `multicast` CTAs of a
    (multicast x 1) cluster, each loading a slice into all of them, so a slot is free only
    when the consumers of every CTA have released it: each consumer warp arrives on the
    empty barrier of every CTA of the cluster."""
    layout = cute.make_layout((1, multicast, 1, 1))
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barrier_storage, num_stages=num_stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                 multicast * num_consumer_threads // 32),
        tx_count=tx_count, cta_layout_vmnk=layout, defer_sync=True)


def multicast_slice(cluster_size: int):
    """(rank, CTA layout, copy keywords) for a TMA load shared by a (cluster_size x 1)
    cluster: `cpasync.tma_partition(atom, rank, layout, ...)` gives this CTA's slice of the
    tile, and `cute.copy(..., **keywords)` multicasts it into every CTA of the cluster.
    Without a cluster: the whole tile, a plain load."""
    if cluster_size == 1:
        return 0, cute.make_layout(1), {}
    rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
    mask = cutlass.Int16((1 << cluster_size) - 1)
    return rank, cute.make_layout(cluster_size), dict(mcast_mask=mask)


def lockstep_state(state, stages: int, producer: bool):
    """The state of a `stages`-deep ring that advances in lockstep with `state` (a ring at
    least as deep, advanced once per use of both): slot count % stages, its phase flipped
    once per wrap from the producer's 1 or the consumer's 0. Derived from `state.count`, so
    a shallower ring (the backward's dO ring under a two-stage Q ring) carries no state of
    its own through the loops."""
    if stages == state.stages:
        return state
    start = 1 if producer else 0
    count = state.count
    return pipeline.PipelineState(stages, count, count % stages, start ^ ((count // stages) % 2))
