"""What an attention call is, apart from how it runs: its configuration (``spec``:
``AttentionSpec``), the checks of its inputs (``validate``), KV caches (``kvcache``) and a
decoding step rewritten as an attention problem (``decode``). Every backend below the core
(the numpy reference, the kernels' planners) reads these; none of it runs anything."""

from .kvcache import KVCache, PagedKVCache
from .spec import AttentionSpec
from .validate import AttentionShape, check_inputs

__all__ = ["AttentionSpec", "AttentionShape", "check_inputs", "KVCache", "PagedKVCache"]
