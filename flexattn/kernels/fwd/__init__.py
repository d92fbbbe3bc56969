"""The warp-specialized Hopper forward: ``sm90`` (``FwdConfig``, ``FlashFwdSm90``)."""
