"""Block masks on the GPU: building them (``classify``: tile states by interval analysis
and early-exit evaluation; ``compact``: the sorted lists) and reading them (``visit``:
which kv blocks a forward CTA visits)."""
