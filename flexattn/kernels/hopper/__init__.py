"""Hopper (sm_90a) building blocks every kernel shares: warpgroup MMA and shared-memory
layouts (``mma``), TMA rings (``tma_pipeline``), online softmax, tile schedulers, fp32 /
fixed-point atomics, distributed shared memory, and the device facts configs depend on."""
