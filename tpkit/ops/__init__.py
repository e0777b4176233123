"""tpkit.ops: the custom ops and their kernels, one module per op family.

Each op is a ``torch.library`` op (``torch.ops.tpkit.<name>``, all defined through
:mod:`tpkit.ops._library`) with a PyTorch implementation, the CPU path and the reference its CUDA kernel is
tested against, and a fake implementation for ``torch.compile``. The CUDA kernels live in ``tpkit/csrc`` by
topic (attention, cache, GEMM, element-wise) and are compiled on first use (:mod:`tpkit.ops._extension`);
where they cannot be built, the ops run their PyTorch implementation on the GPU and warn once.

- :mod:`~tpkit.ops.paged_attention`: ``paged_attention`` and ``reshape_and_cache`` over the paged KV cache.
- :mod:`~tpkit.ops.linear`: a decode step's small-batch products (``decode_linear`` and its fused
  variants: SwiGLU, RoPE with the cache write, the RMSNorm split).
- :mod:`~tpkit.ops.fp8_linear`: ``decode_linear_fp8``, the decode kernel reading float8 weights.
- :mod:`~tpkit.ops.fp8_quantize`: ``quantize_per_token_fp8``, a float8 product's activations quantized per
  token, and the same fused with SwiGLU (``silu_and_mul_quantize_fp8``) or with RMSNorm after the residual
  add (``rms_norm_quantize_fp8``, ``add_rms_norm_quantize_fp8``).
- :mod:`~tpkit.ops.rotary`: RoPE: the frequencies (``RotaryEmbedding``) and the rotation (``apply_rotary``).
- :mod:`~tpkit.ops.norm`: ``RMSNorm``, and ``apply_rms_sums``, the second half of a norm split across two
  products.
- :mod:`~tpkit.ops.activation`: SwiGLU's ``silu_and_mul``.
"""

from tpkit.ops.activation import silu_and_mul
from tpkit.ops.fp8_linear import decode_linear_fp8
from tpkit.ops.fp8_quantize import (
    add_rms_norm_quantize_fp8,
    quantize_per_token_fp8,
    rms_norm_quantize_fp8,
    silu_and_mul_quantize_fp8,
)
from tpkit.ops.linear import (
    decode_kernel_applies,
    decode_linear,
    decode_linear_residual_norm,
    decode_linear_silu_and_mul,
    decode_qkv_rope_cache,
)
from tpkit.ops.norm import RMSNorm, apply_rms_sums
from tpkit.ops.paged_attention import paged_attention, reshape_and_cache
from tpkit.ops.rotary import (
    RotaryEmbedding,
    apply_rotary,
    attention_factor,
    inverse_frequencies,
    rope_parameters,
)

__all__ = [
    "RMSNorm",
    "RotaryEmbedding",
    "add_rms_norm_quantize_fp8",
    "apply_rms_sums",
    "apply_rotary",
    "attention_factor",
    "decode_kernel_applies",
    "decode_linear",
    "decode_linear_fp8",
    "decode_linear_residual_norm",
    "decode_linear_silu_and_mul",
    "decode_qkv_rope_cache",
    "inverse_frequencies",
    "paged_attention",
    "quantize_per_token_fp8",
    "reshape_and_cache",
    "rms_norm_quantize_fp8",
    "rope_parameters",
    "silu_and_mul",
    "silu_and_mul_quantize_fp8",
]
