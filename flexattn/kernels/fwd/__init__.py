"""The warp-specialized Hopper forward: ``sm90`` (``FwdConfig``, ``FlashFwdSm90``) and, for
float32 inputs, ``fp32_operands`` (the tf32 operands it reads: V^T, 3xTF32 parts)."""
