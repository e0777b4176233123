"""``decode_linear_fp8``: a decode step's product by float8 (E4M3) weights on tpkit's decode kernel.

The kernel streams the float8 weight (half a 16-bit weight's bytes, so about half the time of a decode step's
product), converts each value exactly to the input's dtype in registers, multiplies on the tensor cores as
:func:`~tpkit.ops.decode_linear` does and applies the weight's per-row scales in the epilogue; the
activations stay in their dtype. ``tpkit.parallel_layers.Fp8LinearMethod`` takes it as its ``decode_op``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tpkit.ops._library import _define_op
from tpkit.ops.linear import _dequantized, _kernel_may_take


def _decode_linear_fp8_reference(input: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                                 bias: torch.Tensor | None) -> torch.Tensor:
    # [num_rows, in_features] @ ([out_features, in_features] * [out_features, 1]).T
    return F.linear(input, _dequantized(weight, weight_scale, input.dtype), bias)


# input [num_rows, in_features], weight float8 [out_features, in_features], weight_scale float32
# [out_features], bias [out_features] or None -> [num_rows, out_features]
_define_op("decode_linear_fp8", "(Tensor input, Tensor weight, Tensor weight_scale, Tensor? bias) -> Tensor",
           (), None, _decode_linear_fp8_reference,
           outputs=lambda input, weight, *args: (input.new_empty(input.shape[0], weight.shape[0]),))


def decode_linear_fp8(input: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``input @ (weight.float() * weight_scale[:, None]).T + bias`` by the decode kernel, or None where the
    kernel does not take these tensors (the caller then multiplies another way).

    Args:
        input: ``[..., in_features]``, float16 or bfloat16.
        weight: ``torch.float8_e4m3fn`` ``[out_features, in_features]``, contiguous.
        weight_scale: float32 ``[out_features]``, one scale a row (a per-tensor scale expanded).
        bias: ``[out_features]`` in input's dtype, or None.

    Returns:
        ``[..., out_features]`` in input's dtype, where the kernel runs: a CUDA tensor of at most 16 rows,
        ``in_features`` a multiple of 32 and ``out_features`` of 8, no gradient wanted.
    """
    if not _kernel_may_take(input, weight, bias, weight_scale):
        return None
    rows = input.reshape(-1, input.shape[-1])  # [num_rows, in_features], at most 16 of them
    return torch.ops.tpkit.decode_linear_fp8(rows, weight, weight_scale, bias).view(*input.shape[:-1],
                                                                                      weight.shape[0])
