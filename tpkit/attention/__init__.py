"""tpkit.attention: paged KV cache, the paged attention ops, the Attention module, and ``decode_linear``
(the decode step's small-batch ``F.linear``, whose CUDA kernel shares the attention kernels' build).

``paged_attention`` and ``reshape_and_cache`` are ``torch.library`` custom ops
(``torch.ops.tpkit.paged_attention``, ``torch.ops.tpkit.reshape_and_cache``) with a PyTorch implementation
for the CPU and a CUDA kernel for NVIDIA GPUs. Caches are
``[num_blocks, block_size, num_kv_heads, head_size]``. ``apply_rotary`` and ``decode_linear_silu_and_mul``
past the decode kernel's 16 rows (a prefill) run RoPE and SwiGLU as one kernel each on GPUs
(``torch.ops.tpkit.rotary``, ``torch.ops.tpkit.silu_and_mul``), with the values of the PyTorch expressions.
"""

from tpkit.attention.kv_cache import AttentionMetadata, PagedKVCache
from tpkit.attention.layer import Attention
from tpkit.attention.linear import (
    apply_rms_sums,
    decode_kernel_applies,
    decode_linear,
    decode_linear_residual_norm,
    decode_linear_silu_and_mul,
    decode_qkv_rope_cache,
)
from tpkit.attention.ops import paged_attention, reshape_and_cache
from tpkit.attention.rotary import apply_rotary

__all__ = [
    "Attention",
    "AttentionMetadata",
    "PagedKVCache",
    "apply_rms_sums",
    "apply_rotary",
    "decode_kernel_applies",
    "decode_linear",
    "decode_linear_residual_norm",
    "decode_linear_silu_and_mul",
    "decode_qkv_rope_cache",
    "paged_attention",
    "reshape_and_cache",
]
