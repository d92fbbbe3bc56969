"""Context parallelism: attention over a sequence sharded across ranks, for any mod.

``layout`` (which chunks each rank holds: load balance), ``plan`` (which shard pairs run,
with mods at global positions), ``schedule`` (ring, direct and all-gather forward/backward over
a communicator the adapter supplies), ``loopback`` (ranks as threads of one process).
"""

from .layout import (ShardLayout, balanced, choose_layout, contiguous, fewer_transfers, head_tail, imbalance, mask_weights,
                     transfers)
from .loopback import LoopbackWorld
from .plan import ContextParallelPlan, ShardPair
from .schedule import (direct_backward, direct_forward, gathered_backward, gathered_forward, ring_backward,
                       ring_forward)

__all__ = [
    "ShardLayout", "balanced", "choose_layout", "contiguous", "fewer_transfers", "head_tail", "imbalance", "mask_weights",
    "transfers", "LoopbackWorld",
    "ContextParallelPlan", "ShardPair", "direct_backward", "direct_forward", "gathered_backward", "gathered_forward", "ring_backward", "ring_forward",
]
