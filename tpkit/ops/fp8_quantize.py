"""Per-token float8 quantization of a float8 product's activations, alone or fused with what makes them.

Before each float8 tensor-core product (``torch._scaled_mm``) ``tpkit.parallel_layers.Fp8LinearMethod``
quantizes its activations: each token's scale its amax (at most ``activation_scale_ub``) over 448, or a static
``input_scale``, and its values ``saturate(x / scale)`` in float8 E4M3. :func:`quantize_per_token_fp8`'s
PyTorch implementation (:func:`_quantize_reference`) passes over the input four times, several of them in
float32. The kernel takes a thread block a row: it copies the row into shared memory once, reduces its amax
there and writes the float8 row and its scale, bit for bit what the PyTorch implementation gives on the GPU
(NaN and infinities included). The method takes :func:`quantize_per_token_fp8` as its
``quantize_op``, without which it multiplies by the dequantized weight.

A model's step on float8 tensor cores (``tpkit.models.fused_fp8``) quantizes the activations where they are
made, so that the 16-bit rows are never written: :func:`silu_and_mul_quantize_fp8` (SwiGLU of gate_up_proj's
output, for down_proj) and :func:`rms_norm_quantize_fp8` / :func:`add_rms_norm_quantize_fp8` (the norm before
qkv_proj and gate_up_proj, after the residual add). Each gives :func:`quantize_per_token_fp8` of the unfused
expression (bit for bit for SwiGLU; the norm's sum of squares added in another order than torch's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tpkit.ops import _extension
from tpkit.ops._checks import _FLOAT_DTYPES, _check_devices, _check_same
from tpkit.ops._library import _define_op
from tpkit.ops.activation import _silu_and_mul_expression

_OP = "quantize_per_token_fp8"
_FP8 = torch.float8_e4m3fn
_FP8_MAX = torch.finfo(_FP8).max
_MIN_SCALE = 1e-12  # an all-zero row quantizes to zeros with this scale, never divides by zero


def _check_quantize(input: torch.Tensor, input_scale: torch.Tensor | None = None,
                    activation_scale_ub: float | None = None, *, read_values: bool = False,
                    op: str = _OP) -> None:
    # Any strides: the kernel takes rows with a contiguous last dimension, the PyTorch path the rest.
    if not isinstance(input, torch.Tensor):
        raise TypeError(f"{op}: input: expected a torch.Tensor, got {type(input).__name__}")
    if input.dim() != 2:
        raise ValueError(f"{op}: input: expected [num_rows, features], got shape {list(input.shape)}")
    if input.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{op}: input: expected dtype one of {list(_FLOAT_DTYPES)}, got {input.dtype}")
    if input_scale is None:
        return
    if input_scale.numel() != 1 or not input_scale.is_floating_point():
        raise ValueError(f"{op}: input_scale: expected one floating-point value (a per-tensor scale), got "
                         f"{input_scale.dtype} {list(input_scale.shape)}")
    _check_devices(op, "input", input, input_scale=input_scale)


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
_QUANTIZE_SCHEMA = ("(Tensor input, Tensor? input_scale=None, float? activation_scale_ub=None) -> "
                    "(Tensor, Tensor)")
_define_op(_OP, _QUANTIZE_SCHEMA, (), _check_quantize, _quantize_reference, outputs=_quantize_outputs)


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


_Quantized = tuple[torch.Tensor, torch.Tensor]  # (float8 E4M3 [num_rows, features], float32 [num_rows, 1])


# SwiGLU, then the quantization ---------------------------------------------------------------------------

def _check_silu_and_mul_quantize(input: torch.Tensor, input_scale: torch.Tensor | None = None,
                                 activation_scale_ub: float | None = None, *,
                                 read_values: bool = False) -> None:
    op = "silu_and_mul_quantize_fp8"
    _check_quantize(input, input_scale, activation_scale_ub, op=op)
    if input.shape[1] % 2:
        raise ValueError(f"{op}: input: expected [num_rows, 2 * features] (gate, then up), got shape "
                         f"{list(input.shape)}")


def _silu_and_mul_quantize_reference(input: torch.Tensor, input_scale: torch.Tensor | None = None,
                                     activation_scale_ub: float | None = None) -> _Quantized:
    return _quantize_reference(_silu_and_mul_expression(input), input_scale, activation_scale_ub)


def _silu_and_mul_quantize_outputs(input: torch.Tensor, *args: object) -> _Quantized:
    return _quantize_outputs(input[:, : input.shape[1] // 2])


# input [num_rows, 2 * features] -> (float8 E4M3 [num_rows, features], float32 scale [num_rows, 1])
_define_op("silu_and_mul_quantize_fp8", _QUANTIZE_SCHEMA, (), _check_silu_and_mul_quantize,
           _silu_and_mul_quantize_reference, outputs=_silu_and_mul_quantize_outputs)


def silu_and_mul_quantize_fp8(gate_up: torch.Tensor, input_scale: torch.Tensor | None = None,
                              activation_scale_ub: float | None = None) -> _Quantized:
    """``quantize_per_token_fp8(silu_and_mul(gate_up), input_scale, activation_scale_ub)``: SwiGLU of the
    halves of ``gate_up`` ``[num_rows, 2 * features]`` (gate, then up) quantized per token, on a GPU in one
    kernel that never writes the 16-bit rows, with the bits of the two ops (float16 or bfloat16, ``features``
    a multiple of 8, 16-byte aligned rows); elsewhere the PyTorch expressions. Returns ``(quantized
    [num_rows, features], scale [num_rows, 1])`` as :func:`quantize_per_token_fp8` does."""
    return torch.ops.tpkit.silu_and_mul_quantize_fp8(gate_up, input_scale, activation_scale_ub)


# RMSNorm (after the residual add), then the quantization -------------------------------------------------

def _check_norm(op: str, input: torch.Tensor, weight: torch.Tensor, eps: float,
                residual: torch.Tensor | None = None) -> None:
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{op}: weight: expected a torch.Tensor, got {type(weight).__name__}")
    _check_same(op, "weight", "shape", [input.shape[1]], list(weight.shape))
    _check_same(op, "weight", "dtype (input's)", input.dtype, weight.dtype)
    _check_devices(op, "input", input, weight=weight)
    if not eps >= 0:
        raise ValueError(f"{op}: eps: expected a number >= 0, got {eps}")
    if residual is not None:
        _check_same(op, "residual", "shape (input's)", list(input.shape), list(residual.shape))
        _check_same(op, "residual", "dtype (input's)", input.dtype, residual.dtype)
        _check_devices(op, "input", input, residual=residual)


def _check_rms_norm_quantize(input: torch.Tensor, weight: torch.Tensor, eps: float,
                             input_scale: torch.Tensor | None = None,
                             activation_scale_ub: float | None = None, *, read_values: bool = False) -> None:
    op = "rms_norm_quantize_fp8"
    _check_quantize(input, input_scale, activation_scale_ub, op=op)
    _check_norm(op, input, weight, eps)


def _check_add_rms_norm_quantize(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                 eps: float, input_scale: torch.Tensor | None = None,
                                 activation_scale_ub: float | None = None, *,
                                 read_values: bool = False) -> None:
    op = "add_rms_norm_quantize_fp8"
    _check_quantize(input, input_scale, activation_scale_ub, op=op)
    _check_norm(op, input, weight, eps, residual)


def _rms_norm_quantize_reference(input: torch.Tensor, weight: torch.Tensor, eps: float,
                                 input_scale: torch.Tensor | None = None,
                                 activation_scale_ub: float | None = None) -> _Quantized:
    normed = F.rms_norm(input, weight.shape, weight, eps)
    return _quantize_reference(normed, input_scale, activation_scale_ub)


def _add_rms_norm_quantize_reference(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                     eps: float, input_scale: torch.Tensor | None = None,
                                     activation_scale_ub: float | None = None,
                                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    residual_out = input + residual
    return (*_rms_norm_quantize_reference(residual_out, weight, eps, input_scale, activation_scale_ub),
            residual_out)


def _rms_norm_quantize_kernel(quantized: torch.Tensor, scale: torch.Tensor, input: torch.Tensor,
                              weight: torch.Tensor, eps: float, input_scale: torch.Tensor | None = None,
                              activation_scale_ub: float | None = None) -> bool:
    return _extension.rms_norm_quantize_fp8(quantized, scale, None, input, None, weight, eps, input_scale,
                                            activation_scale_ub)


def _add_rms_norm_quantize_kernel(quantized: torch.Tensor, scale: torch.Tensor, residual_out: torch.Tensor,
                                  input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                  eps: float, input_scale: torch.Tensor | None = None,
                                  activation_scale_ub: float | None = None) -> bool:
    return _extension.rms_norm_quantize_fp8(quantized, scale, residual_out, input, residual, weight, eps,
                                            input_scale, activation_scale_ub)


def _add_rms_norm_quantize_outputs(input: torch.Tensor, *args: object) -> tuple[torch.Tensor, ...]:
    # (float8 [num_rows, features], float32 [num_rows, 1], residual_out [num_rows, features])
    return (*_quantize_outputs(input), torch.empty(input.shape, dtype=input.dtype, device=input.device))


_NORM_ARGS = "Tensor weight, float eps, Tensor? input_scale=None, float? activation_scale_ub=None"
# input [num_rows, features], weight [features] -> (float8 [num_rows, features], float32 scale [num_rows, 1])
_define_op("rms_norm_quantize_fp8", f"(Tensor input, {_NORM_ARGS}) -> (Tensor, Tensor)", (),
           _check_rms_norm_quantize, _rms_norm_quantize_reference, kernel=_rms_norm_quantize_kernel,
           outputs=_quantize_outputs)
# ... and residual [num_rows, features] -> (..., residual_out = input + residual [num_rows, features])
_define_op("add_rms_norm_quantize_fp8",
           f"(Tensor input, Tensor residual, {_NORM_ARGS}) -> (Tensor, Tensor, Tensor)", (),
           _check_add_rms_norm_quantize, _add_rms_norm_quantize_reference,
           kernel=_add_rms_norm_quantize_kernel, outputs=_add_rms_norm_quantize_outputs)


def rms_norm_quantize_fp8(input: torch.Tensor, weight: torch.Tensor, eps: float,
                          input_scale: torch.Tensor | None = None,
                          activation_scale_ub: float | None = None) -> _Quantized:
    """``quantize_per_token_fp8(F.rms_norm(input, weight.shape, weight, eps), input_scale,
    activation_scale_ub)``: ``input`` ``[num_rows, features]`` normed by ``weight`` ``[features]`` and
    quantized per token. On a GPU one kernel that never writes the normed rows (float16 or bfloat16,
    ``features`` a multiple of 8, 16-byte aligned rows): each row times ``rsqrt(mean(row ** 2) + eps)`` times
    the weight in float32, rounded once to the dtype as torch's norm rounds, the sum of squares added in its
    own order; elsewhere the PyTorch expressions. Returns ``(quantized, scale)`` as
    :func:`quantize_per_token_fp8` does."""
    return torch.ops.tpkit.rms_norm_quantize_fp8(input, weight, eps, input_scale, activation_scale_ub)


def add_rms_norm_quantize_fp8(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                              input_scale: torch.Tensor | None = None,
                              activation_scale_ub: float | None = None,
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`rms_norm_quantize_fp8` of ``input + residual`` (both ``[num_rows, features]``, the sum rounded
    to their dtype): a layer's output added to the residual stream, and the norm that follows. Returns
    ``(quantized, scale, residual_out)``, ``residual_out`` the sum, the next residual stream; on a GPU one
    kernel, which reads both once and writes the sum, the float8 rows and the scales."""
    return torch.ops.tpkit.add_rms_norm_quantize_fp8(input, residual, weight, eps, input_scale,
                                                     activation_scale_ub)
