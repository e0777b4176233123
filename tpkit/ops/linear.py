"""``decode_linear``: ``F.linear`` for the few rows of a decode step, with a CUDA kernel of tpkit's own.

A decode step multiplies a handful of rows (one token per sequence) by every weight matrix of the model, so
each product costs its weight's bytes at the memory's speed plus fixed costs; the kernel
(``csrc/gemm/decode_linear.cuh``) streams the weight straight into tensor-core operands with less fixed cost
than cuBLAS. ``tpkit.parallel_layers`` imports nothing of ours: a model hands :func:`decode_linear` to its
layers with ``tpkit.parallel_layers.set_linear_op``.

The ops (``torch.ops.tpkit.decode_linear`` and its fused variants) are functional: they return new tensors,
have fake implementations for ``torch.compile`` and no host synchronisation, so they run in CUDA graphs. The
wrappers call them only where the kernel can run and no gradient is wanted, and their PyTorch expressions
everywhere else. The kernel's epilogue also takes the small element-wise steps around a decode layer's
products, each otherwise a kernel of its own for a few KB: SwiGLU after the MLP's gate/up product
(:func:`decode_linear_silu_and_mul`), RoPE plus the cache write after the attention's q, k, v product
(:func:`decode_qkv_rope_cache`, which writes the caches in place), and the RMSNorm between two products,
split in halves (:mod:`tpkit.ops.norm`): the product that makes the norm's input also adds the residual and
starts the norm (:func:`decode_linear_residual_norm`), and the product that reads it finishes the norm
(``rms_sums`` of :func:`decode_linear_silu_and_mul` and :func:`decode_qkv_rope_cache`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

from tpkit.ops import _extension
from tpkit.ops._checks import _HALF_DTYPES, _check_row_sums
from tpkit.ops._library import _define_op
from tpkit.ops.activation import silu_and_mul
from tpkit.ops.norm import apply_rms_sums
from tpkit.ops.paged_attention import _check_caches, reshape_and_cache
from tpkit.ops.rotary import apply_rotary

_MAX_ROWS = 16  # TPKIT_DECODE_LINEAR_MAX_ROWS of csrc/gemm/decode_linear.h
_FP8_WEIGHT = torch.float8_e4m3fn  # the float8 weights the kernel reads


def _dequantized(weight: torch.Tensor, weight_scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The weight the product multiplies by: ``weight`` itself, or a float8 weight ``[out_features,
    in_features]`` times its per-row ``weight_scale`` ``[out_features]``, in float32, rounded to ``dtype``
    (as ``Fp8LinearMethod`` dequantizes)."""
    return weight if weight_scale is None else (weight.float() * weight_scale[:, None]).to(dtype)


def _check_weight_scale(op: str, weight: torch.Tensor, weight_scale: torch.Tensor | None) -> None:
    """With ``weight_scale``: a float8 E4M3 weight and float32 scales, one a row on the weight's device."""
    if weight_scale is None:
        return
    if weight.dtype != _FP8_WEIGHT:
        raise TypeError(f"{op}: weight: expected {_FP8_WEIGHT} with a weight_scale, got {weight.dtype}")
    expected = (weight.shape[0],)
    if weight_scale.dtype != torch.float32 or weight_scale.shape != expected:
        raise ValueError(f"{op}: weight_scale: expected float32 {list(expected)} (one scale a weight row), "
                         f"got {weight_scale.dtype} {list(weight_scale.shape)}")
    if weight_scale.device != weight.device:
        raise ValueError(f"{op}: weight_scale: expected a tensor on {weight.device} (that of weight), got "
                         f"{weight_scale.device}")


# --- the ops: input [num_rows, in_features], weight [out_features, in_features], bias [out_features] or None

def _product(input: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor]:
    # -> [num_rows, out_features]
    return (input.new_empty(input.shape[0], weight.shape[0]),)


def _decode_linear_reference(input: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(input, weight, bias)


# Each fused op below takes a weight of input's dtype, or a float8 E4M3 weight with its float32 per-row
# weight_scale [out_features]: the reference multiplies by the weight dequantized to input's dtype, the kernel
# converts the float8 values exactly and scales each feature's sum.


_define_op("decode_linear", "(Tensor input, Tensor weight, Tensor? bias) -> Tensor", (), None,
           _decode_linear_reference, outputs=lambda input, weight, *args: _product(input, weight))


def _silu_and_mul_reference(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            rms_sums: torch.Tensor | None = None, eps: float = 0.0,
                            weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    weight = _dequantized(weight, weight_scale, input.dtype)
    return silu_and_mul(F.linear(apply_rms_sums(input, rms_sums, eps), weight, bias)).contiguous()


# -> [num_rows, out_features / 2]: silu(gate) * up of the product's halves, the product of row m first
# scaled by the norm of rms_sums[m]
_define_op("decode_linear_silu_and_mul",
           "(Tensor input, Tensor weight, Tensor? bias, Tensor? rms_sums=None, float eps=0., "
           "Tensor? weight_scale=None) -> Tensor", (), None, _silu_and_mul_reference,
           kernel=lambda out, input, weight, bias, rms_sums=None, eps=0.0, weight_scale=None:
           _extension.decode_linear(out, input, weight, bias, 0, True, rms_sums, eps, weight_scale),
           outputs=lambda input, weight, *args: (input.new_empty(input.shape[0], weight.shape[0] // 2),))


def _qkv_rope_cache_reference(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                              cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
                              value_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                              rms_sums: torch.Tensor | None = None, eps: float = 0.0,
                              weight_scale: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                              v_scale: torch.Tensor | None = None) -> torch.Tensor:
    num_kv_heads, head_size = key_cache.shape[2], key_cache.shape[3]
    weight = _dequantized(weight, weight_scale, input.dtype)
    # [num_rows, heads, head_size]; the rotation's cos, sin [num_rows, 1, head_size / 2]
    qkv = F.linear(apply_rms_sums(input, rms_sums, eps), weight, bias).view(input.shape[0], -1, head_size)
    qk = apply_rotary(qkv[None, :, : num_heads + num_kv_heads], cos[None, :, None], sin[None, :, None])[0]
    k, v = qk[:, num_heads:], qkv[:, num_heads + num_kv_heads:]
    reshape_and_cache(k, v, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    return torch.cat((qk, v), dim=1).flatten(1)


# cos, sin [num_rows, head_size / 2], caches [num_blocks, block_size, num_kv_heads, head_size] (written; of
# input's dtype, or float8 with k_scale and v_scale [] or [num_kv_heads]), slot_mapping [num_rows] -> qkv
# [num_rows, (num_heads + 2 * num_kv_heads) * head_size]. flexible_layout:
# inductor hands the op its inputs as it laid them out (the binding takes contiguous cos and sin, as inductor
# makes them, and declines anything else), rather than copying the step's cos and sin into buffers of their
# own for every layer's call.
def _check_qkv_caches(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor,
                      sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, num_heads: int, rms_sums: torch.Tensor | None = None,
                      eps: float = 0.0, weight_scale: torch.Tensor | None = None,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, *,
                      read_values: bool = False) -> None:
    # In the op: the scales' values are read (on the CPU) where the tensors hold them, never while tracing.
    _check_caches("decode_qkv_rope_cache", key_cache, value_cache, input.dtype, "input", k_scale, v_scale)


_define_op("decode_qkv_rope_cache",
           "(Tensor input, Tensor weight, Tensor? bias, Tensor cos, Tensor sin, Tensor(a!) key_cache, "
           "Tensor(b!) value_cache, Tensor slot_mapping, SymInt num_heads, Tensor? rms_sums=None, "
           "float eps=0., Tensor? weight_scale=None, Tensor? k_scale=None, Tensor? v_scale=None) -> Tensor",
           ("key_cache", "value_cache"), _check_qkv_caches, _qkv_rope_cache_reference,
           outputs=lambda input, weight, *args: _product(input, weight), tags=(torch.Tag.flexible_layout,))


def _check_two_buffers(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       residual: torch.Tensor, norm_weight: torch.Tensor, sums: torch.Tensor,
                       zero_sums: torch.Tensor, weight_scale: torch.Tensor | None = None, *,
                       read_values: bool = False) -> None:
    # In the op, not in its wrapper: torch.compile cannot trace a comparison of data pointers (a graph break
    # in every layer, then a recompilation per layer until its limit), and runs an op's body as it is.
    if sums.data_ptr() == zero_sums.data_ptr():
        raise ValueError("decode_linear_residual_norm: zero_sums: expected another buffer than sums")


def _residual_norm_reference(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             residual: torch.Tensor, norm_weight: torch.Tensor, sums: torch.Tensor,
                             zero_sums: torch.Tensor,
                             weight_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.add(residual, F.linear(input, _dequantized(weight, weight_scale, input.dtype), bias))
    normed = torch.mul(out, norm_weight)
    sums.add_(out.float().square().sum(-1, dtype=torch.float64))
    zero_sums.zero_()
    return out, normed


# residual [num_rows, out_features], norm_weight [out_features], sums and zero_sums float64 [num_rows]
# (written) -> out, normed [num_rows, out_features]
_define_op("decode_linear_residual_norm",
           "(Tensor input, Tensor weight, Tensor? bias, Tensor residual, Tensor norm_weight, "
           "Tensor(a!) sums, Tensor(b!) zero_sums, Tensor? weight_scale=None) -> (Tensor, Tensor)",
           ("sums", "zero_sums"),
           _check_two_buffers, _residual_norm_reference, check_fake=False,
           outputs=lambda input, weight, *args: (*_product(input, weight), *_product(input, weight)))


@register_flop_formula([torch.ops.tpkit.decode_linear, torch.ops.tpkit.decode_linear_silu_and_mul,
                        torch.ops.tpkit.decode_qkv_rope_cache, torch.ops.tpkit.decode_linear_residual_norm])
def _decode_linear_flops(input_shape: torch.Size, weight_shape: torch.Size, *args: object,
                         **kwargs: object) -> int:
    # As torch counts F.linear's addmm: 2 * rows * out_features * in_features, the bias not counted.
    return 2 * input_shape[0] * weight_shape[0] * weight_shape[1]


# --- the wrappers: any leading dimensions, the kernel where it applies ------------------------------------

def _kernel_may_take(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     weight_scale: torch.Tensor | None = None) -> bool:
    """What the shapes, dtypes and devices decide; the kernel's binding checks strides and alignment. The
    weight is of input's dtype, or float8 E4M3 with a float32 ``weight_scale`` ``[out_features]``."""
    if not (input.is_cuda and input.dtype in _HALF_DTYPES and weight.dim() == 2 and input.dim() >= 1):
        return False
    weight_dtype = input.dtype if weight_scale is None else _FP8_WEIGHT
    if weight.dtype != weight_dtype or weight.device != input.device:
        return False
    if weight_scale is not None and (weight_scale.dtype != torch.float32 or weight_scale.dim() != 1
                                     or weight_scale.shape[0] != weight.shape[0]
                                     or weight_scale.device != input.device):
        return False
    if bias is not None and (bias.dtype != input.dtype or bias.device != input.device):
        return False
    in_features = input.shape[-1]
    num_rows = input.numel() // in_features if in_features else 0
    if not 1 <= num_rows <= _MAX_ROWS or in_features % 32 != 0 or weight.shape[0] % 8 != 0:
        return False
    # The ops have no backward: products that autograd must see go to F.linear.
    tensors = (input, weight, bias)
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


def decode_kernel_applies(input: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`decode_linear` (for a ``torch.float8_e4m3fn`` weight,
    :func:`~tpkit.ops.decode_linear_fp8` with its per-row scales) would multiply ``input`` by ``weight``
    with its CUDA kernel: from the shapes, dtypes, devices and whether a gradient is wanted (the binding may
    still decline unaligned rows). Models take their fused decode steps where it does: elsewhere the fused
    ops' PyTorch expressions, run one operator at a time inside the op, are slower than what
    ``torch.compile`` makes of the plain forward."""
    # A float8 weight's scales judged on a stand-in of their shape, dtype and device (nothing computed).
    scales = (torch.empty((), dtype=torch.float32, device=weight.device).expand(weight.shape[0])
              if weight.dtype == _FP8_WEIGHT and weight.dim() == 2 else None)
    return _kernel_may_take(input, weight, None, scales)


def decode_linear(input: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(input, weight, bias)``, by tpkit's decode kernel where it applies.

    Args:
        input: ``[..., in_features]``.
        weight: ``[out_features, in_features]``.
        bias: ``[out_features]`` or None.

    Returns:
        ``[..., out_features]``. The kernel runs for CUDA float16 or bfloat16 tensors of at most 16 rows
        (the product of the leading dimensions), ``in_features`` a multiple of 32 and ``out_features`` of 8,
        16-byte aligned rows, when no gradient is wanted; it accumulates in float32, as cuBLAS does, in
        another order. Everything else runs ``F.linear``.
    """
    if not _kernel_may_take(input, weight, bias):
        return F.linear(input, weight, bias)
    rows = input.reshape(-1, input.shape[-1])  # [num_rows, in_features]
    return torch.ops.tpkit.decode_linear(rows, weight, bias).view(*input.shape[:-1], weight.shape[0])


def decode_linear_silu_and_mul(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                               rms_sums: torch.Tensor | None = None, eps: float = 0.0,
                               weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU's first half: ``silu(gate) * up`` where
    ``gate, up = F.linear(input, weight, bias).chunk(2, -1)``, with SwiGLU in the decode kernel's epilogue
    where it applies (no kernel of its own, no ``[..., 2 * features]`` intermediate in memory).

    Args:
        input: ``[..., in_features]``.
        weight: ``[2 * features, in_features]``, the gate's rows over the up projection's (a
            ``MergedColumnParallelLinear`` of gate and up, on any rank).
        bias: ``[2 * features]`` or None.
        rms_sums: float64 ``[num_rows]`` (rows: input's leading dimensions flattened) or None: the second
            half of an RMSNorm of the input's rows, whose first half (``input`` = ``x * norm_weight``,
            ``rms_sums`` = the rows' sums of ``x ** 2``) :func:`decode_linear_residual_norm` computed; the
            product of row m is multiplied by ``rsqrt(rms_sums[m] / in_features + eps)`` before the bias.
        eps: the RMSNorm's epsilon.
        weight_scale: float32 ``[2 * features]`` or None: ``weight`` is ``torch.float8_e4m3fn`` and the
            product multiplies by ``(weight.float() * weight_scale[:, None]).to(input.dtype)``; the kernel
            converts the float8 values exactly and scales each feature's float32 sum (per-tensor or
            per-channel scales as one a row: ``Fp8LinearMethod.row_scales``).

    Returns:
        ``[..., features]``. Where :func:`decode_linear` would run the kernel and ``features`` is a
        multiple of 8, the kernel rounds gate and up to the dtype, then their product once (as a compiled
        ``F.silu(gate) * up`` does); everywhere else this is that expression over ``F.linear``
        (:func:`~tpkit.ops.silu_and_mul`: on GPUs, without a gradient, one kernel with the expression's
        values).
    """
    if weight.dim() != 2 or weight.shape[0] % 2 != 0:
        raise ValueError(f"decode_linear_silu_and_mul: weight: expected [2 * features, in_features] (gate "
                         f"rows, then up rows), got {tuple(weight.shape)}")
    _check_row_sums("decode_linear_silu_and_mul", "rms_sums", input, rms_sums)
    _check_weight_scale("decode_linear_silu_and_mul", weight, weight_scale)
    if not _kernel_may_take(input, weight, bias, weight_scale) or weight.shape[0] % 16 != 0:
        weight = _dequantized(weight, weight_scale, input.dtype)
        return silu_and_mul(F.linear(apply_rms_sums(input, rms_sums, eps), weight, bias))
    rows = input.reshape(-1, input.shape[-1])  # [num_rows, in_features]
    out = torch.ops.tpkit.decode_linear_silu_and_mul(rows, weight, bias, rms_sums, eps, weight_scale)
    return out.view(*input.shape[:-1], weight.shape[0] // 2)


def decode_qkv_rope_cache(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                          rms_sums: torch.Tensor | None = None, eps: float = 0.0,
                          weight_scale: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None) -> torch.Tensor:
    """A decode step's fused q, k, v projection, RoPE and cache write in one: ``qkv = F.linear(input,
    weight, bias)``, its q and k heads rotated by :func:`~tpkit.ops.apply_rotary`, its k and v heads written
    to the caches at ``slot_mapping`` (as :func:`~tpkit.ops.reshape_and_cache`, quantizing into a float8
    cache), all in the decode kernel's epilogue where it applies (two kernels fewer a layer).

    Args:
        input: ``[..., in_features]``, one row per token.
        weight: ``[(num_heads + 2 * num_kv_heads) * head_size, in_features]``: q heads, then k, then v
            (a ``QKVParallelLinear``'s, on any rank); bias its ``[out_features]`` or None.
        cos, sin: ``[..., head_size / 2]`` (or with a singleton head dimension, ``[..., 1, head_size / 2]``),
            the rotation of each row's position, input's dtype.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, written in place;
            input's dtype, or a float8 dtype with ``k_scale`` and ``v_scale``.
        slot_mapping: int64, one slot per row (negative: not written).
        num_heads: q heads in ``weight``.
        rms_sums, eps: as in :func:`decode_linear_silu_and_mul` (the input an RMSNorm's first half).
        weight_scale: as in :func:`decode_linear_silu_and_mul`, ``[(num_heads + 2 * num_kv_heads) *
            head_size]``.
        k_scale, v_scale: a float8 cache's float32 scales, ``[]`` or ``[num_kv_heads]`` (None for a cache of
            input's dtype): k and v are stored as :func:`~tpkit.ops.reshape_and_cache` stores the rotated k
            and the projected v, ``saturate(x / scale)`` of the values the output holds, bit for bit.

    Returns:
        ``[..., (num_heads + 2 * num_kv_heads) * head_size]``: q and k rotated, v as projected. The kernel
        rounds the product to the dtype before rotating (as the product's output would be) and the rotation
        once (as a compiled rotation does); it runs where :func:`decode_linear` would and ``head_size`` is a
        multiple of 16, else the PyTorch expression runs. An inference op: it has no backward (the models
        call it only with gradients off).
    """
    num_kv_heads, head_size = key_cache.shape[2], key_cache.shape[3]
    features = (num_heads + 2 * num_kv_heads) * head_size
    if weight.dim() != 2 or weight.shape[0] != features:
        raise ValueError(f"decode_qkv_rope_cache: weight: expected [(num_heads + 2 * num_kv_heads) * "
                         f"head_size = {features}, in_features] (num_heads {num_heads}, the cache's "
                         f"num_kv_heads {num_kv_heads} and head_size {head_size}), got {tuple(weight.shape)}")
    rows = input.reshape(-1, input.shape[-1])  # [num_rows, in_features]
    num_rows = rows.shape[0]
    cos, sin = cos.reshape(num_rows, head_size // 2), sin.reshape(num_rows, head_size // 2)
    slot_mapping = slot_mapping.reshape(num_rows)
    _check_row_sums("decode_qkv_rope_cache", "rms_sums", input, rms_sums)
    _check_weight_scale("decode_qkv_rope_cache", weight, weight_scale)
    out = torch.ops.tpkit.decode_qkv_rope_cache(rows, weight, bias, cos, sin, key_cache, value_cache,
                                                slot_mapping, num_heads, rms_sums, eps, weight_scale, k_scale,
                                                v_scale)
    return out.view(*input.shape[:-1], features)


def decode_linear_residual_norm(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                residual: torch.Tensor, norm_weight: torch.Tensor, sums: torch.Tensor,
                                zero_sums: torch.Tensor, weight_scale: torch.Tensor | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode step's product that adds the residual stream and starts the RMSNorm that follows it (the
    first half; the next product, given ``rms_sums=sums``, does the second):
    ``out = residual + F.linear(input, weight, bias)``, ``normed = out * norm_weight``,
    ``sums += (out.float() ** 2).sum(-1)`` row by row, ``zero_sums`` set to zero, all in the decode kernel's
    epilogue where it applies (no norm kernel between the two products).

    Args:
        input: ``[..., in_features]``.
        weight: ``[out_features, in_features]``; bias its ``[out_features]`` or None.
        residual: ``[..., out_features]``, the residual stream before the product.
        norm_weight: ``[out_features]``, the RMSNorm's weight.
        sums: float64 ``[num_rows]`` (rows: the leading dimensions flattened), zero before the call; the
            rows' sums of squares are added to it in place.
        zero_sums: float64 ``[num_rows]``, another buffer, set to zero in place: the sums of the product
            before, whose consumer has run, ready for the product after (two buffers take turns).
        weight_scale: as in :func:`decode_linear_silu_and_mul`, ``[out_features]``.

    Returns:
        ``(out, normed)``, each ``[..., out_features]``. The kernel rounds the product to the dtype, then the
        sum with the residual and ``normed`` once each (as ``residual + product`` and ``out * norm_weight``
        in the dtype do); each block adds its float32 share of a row's sum in float64, where the order of
        the blocks' adds does not change the result (steps are reproducible). It runs where
        :func:`decode_linear` would, else the PyTorch expression. An inference op: it has no backward
        (the models call it only with gradients off).
    """
    rows = input.reshape(-1, input.shape[-1])  # [num_rows, in_features]
    num_rows, out_features = rows.shape[0], weight.shape[0]
    expected = (*input.shape[:-1], out_features)
    if residual.shape != expected:
        raise ValueError(f"decode_linear_residual_norm: residual: expected {expected} (input's rows, "
                         f"weight's out_features), got {tuple(residual.shape)}")
    if norm_weight.shape != (out_features,):
        raise ValueError(f"decode_linear_residual_norm: norm_weight: expected ({out_features},), got "
                         f"{tuple(norm_weight.shape)}")
    _check_row_sums("decode_linear_residual_norm", "sums", input, sums)
    _check_row_sums("decode_linear_residual_norm", "zero_sums", input, zero_sums)
    _check_weight_scale("decode_linear_residual_norm", weight, weight_scale)
    residual_rows = residual.reshape(num_rows, out_features)
    out, normed = torch.ops.tpkit.decode_linear_residual_norm(rows, weight, bias, residual_rows, norm_weight,
                                                              sums, zero_sums, weight_scale)
    return out.view(residual.shape), normed.view(residual.shape)
