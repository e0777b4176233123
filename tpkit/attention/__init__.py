"""tpkit.attention: the paged KV cache and the Attention module.

``PagedKVCache`` holds per-layer key and value caches ``[num_blocks, block_size, num_kv_heads, head_size]``,
the sequences in them and their blocks (shared with reference counts, found again by the prefix cache);
``AttentionMetadata`` is where one step of any shape reads and writes them; ``Attention`` attends a rank's
heads with SDPA, or over the cache through ``paged_attention``. The attention ops themselves
(``paged_attention``, ``reshape_and_cache``) live in :mod:`tpkit.ops` and are re-exported here.
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
