"""The Hopper backward: ``preprocess`` (rowsum dO∘O, log2 LSE), ``sm90`` (dK/dV per kv tile,
dQ and buffer gradients by reductions), ``postprocess`` (dQ to the input dtype), and
``q_blocks`` (which q blocks a kv tile visits)."""
