"""Getting kernels onto the GPU: compiling (``compile*``: also on fake tensors, without a
GPU), runners (``*_runner``: from_dlpack and TVM-FFI launches), the compile cache in memory
(``cache``) and on disk (``disk_cache``), and the XLA entries of the JAX adapter."""
