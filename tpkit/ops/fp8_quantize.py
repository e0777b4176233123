"""``quantize_per_token_fp8``: a float8 product's activations quantized per token, in one kernel.

Before each float8 tensor-core product (``torch._scaled_mm``) ``tpkit.parallel_layers.Fp8LinearMethod``
quantizes its activations: each token's scale its amax (at most ``activation_scale_ub``) over 448, or a static
``input_scale``, and its values ``saturate(x / scale)`` in float8 E4M3. The op's PyTorch implementation
(:func:`_quantize_reference`) passes over the input four times, several of them in float32. The kernel takes
a thread block a row: it reads the row once, keeps it in registers while the block reduces its amax, and
writes the float8 row and its scale, bit for bit what the PyTorch implementation gives on the GPU (NaN and
infinities included). The method takes :func:`quantize_per_token_fp8` as its ``quantize_op``, without which
it multiplies by the dequantized weight.
"""

from __future__ import annotations

import torch

from tpkit.ops._checks import _FLOAT_DTYPES, _check_devices
from tpkit.ops._library import _define_op

_OP = "quantize_per_token_fp8"
_FP8 = torch.float8_e4m3fn
_FP8_MAX = torch.finfo(_FP8).max
_MIN_SCALE = 1e-12  # an all-zero row quantizes to zeros with this scale, never divides by zero


def _check_quantize(input: torch.Tensor, input_scale: torch.Tensor | None = None,
                    activation_scale_ub: float | None = None, *, read_values: bool = False) -> None:
    # Any strides: the kernel takes rows with a contiguous last dimension, the PyTorch path the rest.
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"{_OP}: input: expected a torch.Tensor, got {type(input).__name__}")
    if input.dim() != 2:
        raise ValueError(f"{_OP}: input: expected [num_rows, features], got shape {list(input.shape)}")
    if input.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{_OP}: input: expected dtype one of {list(_FLOAT_DTYPES)}, got {input.dtype}")
    if input_scale is None:
        return
    if input_scale.numel() != 1 or not input_scale.is_floating_point():
        raise ValueError(f"{_OP}: input_scale: expected one floating-point value (a per-tensor scale), got "
                         f"{input_scale.dtype} {list(input_scale.shape)}")
    _check_devices(_OP, "input", input, input_scale=input_scale)


def _quantize_reference(rows: torch.Tensor, input_scale: torch.Tensor | None = None,
                        activation_scale_ub: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """rows ``[num_tokens, in_features]`` -> (float8 ``saturate(rows / scale)``, float32 scale
    ``[num_tokens, 1]``): each token's scale its amax (at most ``activation_scale_ub``) over the format's
    largest value, or the static ``input_scale``. Four passes over the tokens, the division in float32: the
    amax reduced without a copy of the magnitudes, the division promoting the input as it reads it, the clamp
    in place. The kernel gives these bits on a GPU (where torch divides the amax by 448 as the product by its
    float32 reciprocal)."""
    if input_scale is None:
        # [num_tokens, 1]
        amax = torch.linalg.vector_norm(rows, ord=float("inf"), dim=-1, keepdim=True).float()
        if activation_scale_ub is not None:
            amax = amax.clamp(max=activation_scale_ub)
        scale = (amax / _FP8_MAX).clamp(min=_MIN_SCALE)
    else:
        # A copy, never a view of input_scale: the op returns it as a new tensor.
        scale = input_scale.float().expand(rows.shape[0], 1).clone(memory_format=torch.contiguous_format)
    return torch.div(rows, scale).clamp_(-_FP8_MAX, _FP8_MAX).to(_FP8), scale


def _quantize_outputs(input: torch.Tensor, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
    num_rows, features = input.shape
    # [num_rows, features]
    quantized = torch.empty(num_rows, features, dtype=_FP8, device=input.device)
    scale = torch.empty(num_rows, 1, dtype=torch.float32, device=input.device)  # [num_rows, 1]
    return quantized, scale


# input [num_rows, features] -> (float8 E4M3 [num_rows, features], float32 scale [num_rows, 1])
_define_op(_OP, "(Tensor input, Tensor? input_scale=None, float? activation_scale_ub=None) -> "
           "(Tensor, Tensor)", (), _check_quantize, _quantize_reference, outputs=_quantize_outputs)


def quantize_per_token_fp8(input: torch.Tensor, input_scale: torch.Tensor | None = None,
                           activation_scale_ub: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``input`` quantized to float8 E4M3 per token, for a float8 tensor-core product.

    Args:
        input: ``[num_rows, features]``, float16, bfloat16 or float32.
        input_scale: a static scale (one value) for every row, or None: each row's scale is its largest
            magnitude over 448 (the format's largest value), at least 1e-12.
        activation_scale_ub: an upper bound on a row's largest magnitude (fbgemm's), or None.

    Returns:
        ``(quantized, scale)``: ``torch.float8_e4m3fn`` ``[num_rows, features]``, ``saturate(input / scale)``
        with the quotient in float32 (NaN stays NaN), and float32 ``[num_rows, 1]``. On a GPU one kernel,
        with the bits the PyTorch expression gives there, where it takes the tensors (float16 or bfloat16,
        ``features`` a multiple of 8, 16-byte aligned rows with a contiguous last dimension, a float32
        ``input_scale``); elsewhere the PyTorch expression.
    """
    return torch.ops.tpkit.quantize_per_token_fp8(input, input_scale, activation_scale_ub)
