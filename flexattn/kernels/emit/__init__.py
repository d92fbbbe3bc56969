"""How mods enter a kernel: the ``ModHook`` interface (``mod_hook``), IR → CuTeDSL emission
(``mod_emit``: ``IRModHook``), interval analysis emitted into a kernel (``interval_emit``),
a per-element evaluation kernel that tests the emitter (``mod_eval``), hand-written hooks."""
