"""tpkit.attention: the paged KV cache and the Attention module.

``PagedKVCache`` holds per-layer key and value caches ``[num_blocks, block_size, num_kv_heads, head_size]``
and the block allocator; ``Attention`` attends a rank's heads with SDPA or over the cache. The attention
ops themselves (``paged_attention``, ``reshape_and_cache``) live in :mod:`tpkit.ops` and are re-exported
here.
"""

from tpkit.attention.kv_cache import AttentionMetadata, PagedKVCache
from tpkit.attention.layer import Attention
from tpkit.ops.paged_attention import paged_attention, reshape_and_cache

__all__ = [
    "Attention",
    "AttentionMetadata",
    "PagedKVCache",
    "paged_attention",
    "reshape_and_cache",
]
