"""tpkit.attention: the paged KV cache and the Attention module.

``PagedKVCache`` holds per-layer key and value caches ``[num_blocks, block_size, num_kv_heads, head_size]``,
in the model's dtype or float8 with scales (:mod:`tpkit.attention.kv_scales`), the sequences in them and
their blocks (shared with reference counts, found again by the prefix cache);
``AttentionMetadata`` is where one step of any shape reads and writes them; ``Attention`` attends a rank's
heads with SDPA, or over the cache through ``paged_attention``. The attention ops themselves
(``paged_attention``, ``reshape_and_cache``) live in :mod:`tpkit.ops` and are re-exported here.
"""

from tpkit.attention.host_tensors import (
    chunk_positions,
    copy_to_device,
    host_longs,
    packed_size,
    packed_views,
    token_positions,
)
from tpkit.attention.kv_cache import AttentionMetadata, PagedKVCache
from tpkit.attention.kv_scales import FP8_KV_DTYPES, calibrated_kv_scales, set_kv_scales
from tpkit.attention.layer import Attention
from tpkit.ops.paged_attention import paged_attention, reshape_and_cache

__all__ = [
    "FP8_KV_DTYPES",
    "Attention",
    "AttentionMetadata",
    "PagedKVCache",
    "calibrated_kv_scales",
    "chunk_positions",
    "copy_to_device",
    "host_longs",
    "packed_size",
    "packed_views",
    "paged_attention",
    "reshape_and_cache",
    "set_kv_scales",
    "token_positions",
]
