"""The one kind of smem pipeline the sm90 kernels use: one producer thread fills a ring of
`num_stages` buffers by TMA (mbarrier transaction counts), the consumer warpgroups release
each stage when their MMAs have read it. Forward, backward and decode build all their
rings (Q, K, V, dO, ...) with `tma_ring`.
"""

from cutlass import pipeline


def tma_ring(barrier_storage, num_stages: int, num_consumer_threads: int, tx_count: int):
    """A `PipelineTmaAsync` over `barrier_storage` (2 * num_stages mbarriers): each stage
    expects `tx_count` bytes; it is released with one arrive per consumer warp (as
    PipelineTmaAsync's consumer release does). `defer_sync`: the kernel calls
    `pipeline_init_arrive` / `pipeline_init_wait` once for all its rings."""
    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barrier_storage, num_stages=num_stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread,
                                                 num_consumer_threads // 32),
        tx_count=tx_count, defer_sync=True)
