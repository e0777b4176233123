"""``decode_linear``: ``F.linear`` for the few rows of a decode step, with a CUDA kernel of tpkit's own.

A decode step multiplies a handful of rows (one token per sequence) by every weight matrix of the model, so
each product costs its weight's bytes at the memory's speed plus fixed costs. cuBLAS adds 3-8 us a product
on the H200 (``benchmarks/bench_decode_gemm.py``); the kernel in ``csrc/decode_linear.cuh`` streams the
weight straight into tensor-core operands and adds 2-4 us. It lives beside the attention kernels
because they share the build (``tpkit.attention._cuda``) and ``tpkit.parallel_layers`` imports nothing of
ours: a model hands it to its layers with ``tpkit.parallel_layers.set_linear_op``.

``torch.ops.tpkit.decode_linear`` is a functional ``torch.library`` custom op (a fake implementation for
``torch.compile``; no host synchronisation, so it runs in CUDA graphs). :func:`decode_linear` calls it only
where the kernel can run and no gradient is wanted, and ``F.linear`` everywhere else. The kernel's epilogue
also takes the small element-wise steps that follow two of a decode layer's products, each otherwise a
kernel of 1.5-3 us for a few KB: SwiGLU after the MLP's gate/up product (:func:`decode_linear_silu_and_mul`)
and RoPE plus the cache write after the attention's q, k, v product (:func:`decode_qkv_rope_cache`, an op
that writes the caches in place).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

from tpkit.attention.ops import reshape_and_cache
from tpkit.attention.rotary import apply_rotary

_MAX_ROWS = 16  # TPKIT_DECODE_LINEAR_MAX_ROWS of csrc/decode_linear.h
_KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def _silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _features(weight: torch.Tensor, silu_and_mul: bool) -> int:
    return weight.shape[0] // 2 if silu_and_mul else weight.shape[0]


def _run(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
         silu_and_mul: bool) -> torch.Tensor:
    # input [num_rows, in_features], weight [out_features, in_features] (with silu_and_mul the gate's rows,
    # then the up projection's), bias [out_features] or None -> [num_rows, features], contiguous
    if input.is_cuda:
        # Imported here so that CPU-only use never touches the extension.
        from tpkit.attention import _cuda

        out = input.new_empty(input.shape[0], _features(weight, silu_and_mul))
        if _cuda.decode_linear(out, input, weight, bias, silu_and_mul=silu_and_mul):
            return out
    product = F.linear(input, weight, bias)
    return (_silu_and_mul(product) if silu_and_mul else product).contiguous()


@torch.library.custom_op("tpkit::decode_linear", mutates_args=())
def _decode_linear_op(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _run(input, weight, bias, silu_and_mul=False)


@_decode_linear_op.register_fake
def _(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return input.new_empty(input.shape[0], _features(weight, False))


@torch.library.custom_op("tpkit::decode_linear_silu_and_mul", mutates_args=())
def _decode_linear_silu_and_mul_op(input: torch.Tensor, weight: torch.Tensor,
                                   bias: torch.Tensor | None) -> torch.Tensor:
    return _run(input, weight, bias, silu_and_mul=True)


@_decode_linear_silu_and_mul_op.register_fake
def _(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return input.new_empty(input.shape[0], _features(weight, True))


def _kernel_may_take(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """What the shapes, dtypes and devices decide; the kernel's binding checks strides and alignment."""
    if not (input.is_cuda and input.dtype in _KERNEL_DTYPES and weight.dim() == 2 and input.dim() >= 1):
        return False
    if weight.dtype != input.dtype or weight.device != input.device:
        return False
    if bias is not None and (bias.dtype != input.dtype or bias.device != input.device):
        return False
    in_features = input.shape[-1]
    num_rows = input.numel() // in_features if in_features else 0
    if not 1 <= num_rows <= _MAX_ROWS or in_features % 32 != 0 or weight.shape[0] % 8 != 0:
        return False
    # The op has no backward: products that autograd must see go to F.linear.
    tensors = (input, weight, bias)
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors))


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
    return _on_rows(_decode_linear_op, input, weight, bias, _features(weight, False))


def decode_linear_silu_and_mul(input: torch.Tensor, weight: torch.Tensor,
                               bias: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU's first half: ``silu(gate) * up`` where
    ``gate, up = F.linear(input, weight, bias).chunk(2, -1)``, with SwiGLU in the decode kernel's epilogue
    where it applies (no kernel of its own, no ``[..., 2 * features]`` intermediate in memory).

    Args:
        input: ``[..., in_features]``.
        weight: ``[2 * features, in_features]``, the gate's rows over the up projection's (a
            ``MergedColumnParallelLinear`` of gate and up, on any rank).
        bias: ``[2 * features]`` or None.

    Returns:
        ``[..., features]``. Where :func:`decode_linear` would run the kernel and ``features`` is a
        multiple of 8, the kernel rounds gate and up to the dtype, then their product once (as a compiled
        ``F.silu(gate) * up`` does); everywhere else this is that expression over ``F.linear``. Also a
        ``linear_op`` for a gate/up layer whose caller wants the activated half (``LlamaMLP``).
    """
    if weight.dim() != 2 or weight.shape[0] % 2 != 0:
        raise ValueError(f"decode_linear_silu_and_mul: weight: expected [2 * features, in_features] (gate "
                         f"rows, then up rows), got {tuple(weight.shape)}")
    if not _kernel_may_take(input, weight, bias) or weight.shape[0] % 16 != 0:
        return _silu_and_mul(F.linear(input, weight, bias))
    return _on_rows(_decode_linear_silu_and_mul_op, input, weight, bias, _features(weight, True))


def _on_rows(op: Callable[..., torch.Tensor], input: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None, features: int) -> torch.Tensor:
    """``op`` on ``input``'s rows flattened to ``[num_rows, in_features]``, its ``[num_rows, features]``
    viewed with ``input``'s leading dimensions again."""
    rows = input.reshape(-1, input.shape[-1])
    return op(rows, weight, bias).view(*input.shape[:-1], features)


@torch.library.custom_op("tpkit::decode_qkv_rope_cache", mutates_args=("key_cache", "value_cache"))
def _decode_qkv_rope_cache_op(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                              cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
                              value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                              num_heads: int) -> torch.Tensor:
    # input [num_rows, in_features], weight [(num_heads + 2 * num_kv_heads) * head_size, in_features],
    # cos, sin [num_rows, head_size / 2], caches [num_blocks, block_size, num_kv_heads, head_size],
    # slot_mapping [num_rows] -> qkv [num_rows, (num_heads + 2 * num_kv_heads) * head_size], contiguous
    if input.is_cuda:
        from tpkit.attention import _cuda

        out = input.new_empty(input.shape[0], weight.shape[0])
        if _cuda.decode_qkv_rope_cache(out, input, weight, bias, cos, sin, key_cache, value_cache,
                                       slot_mapping, num_heads):
            return out
    num_kv_heads, head_size = key_cache.shape[2], key_cache.shape[3]
    # [num_rows, heads, head_size]; the rotation's cos, sin [num_rows, 1, head_size / 2]
    qkv = F.linear(input, weight, bias).view(input.shape[0], -1, head_size)
    qk = apply_rotary(qkv[None, :, : num_heads + num_kv_heads], cos[None, :, None], sin[None, :, None])[0]
    k, v = qk[:, num_heads:], qkv[:, num_heads + num_kv_heads:]
    reshape_and_cache(k, v, key_cache, value_cache, slot_mapping)
    return torch.cat((qk, v), dim=1).flatten(1)


@_decode_qkv_rope_cache_op.register_fake
def _(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor,
      sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
      num_heads: int) -> torch.Tensor:
    return input.new_empty(input.shape[0], weight.shape[0])


def decode_qkv_rope_cache(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          num_heads: int) -> torch.Tensor:
    """A decode step's fused q, k, v projection, RoPE and cache write in one: ``qkv = F.linear(input,
    weight, bias)``, its q and k heads rotated by :func:`apply_rotary`, its k and v heads written to the
    caches at ``slot_mapping`` (as :func:`reshape_and_cache`), all in the decode kernel's epilogue where it
    applies (two kernels fewer a layer).

    Args:
        input: ``[..., in_features]``, one row per token.
        weight: ``[(num_heads + 2 * num_kv_heads) * head_size, in_features]``: q heads, then k, then v
            (a ``QKVParallelLinear``'s, on any rank); bias its ``[out_features]`` or None.
        cos, sin: ``[..., head_size / 2]`` (or with a singleton head dimension, ``[..., 1, head_size / 2]``),
            the rotation of each row's position, input's dtype.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, written in place.
        slot_mapping: int64, one slot per row (negative: not written).
        num_heads: q heads in ``weight``.

    Returns:
        ``[..., (num_heads + 2 * num_kv_heads) * head_size]``: q and k rotated, v as projected. The kernel
        rounds the product to the dtype before rotating (as the product's output would be) and the rotation
        once (as a compiled rotation does); it runs where :func:`decode_linear` would and ``head_size`` is a
        multiple of 16, else the PyTorch expression above runs. An inference op: it has no backward (the
        models call it only with gradients off).
    """
    num_kv_heads, head_size = key_cache.shape[2], key_cache.shape[3]
    features = (num_heads + 2 * num_kv_heads) * head_size
    if weight.dim() != 2 or weight.shape[0] != features:
        raise ValueError(f"decode_qkv_rope_cache: weight: expected [(num_heads + 2 * num_kv_heads) * "
                         f"head_size = {features}, in_features] (num_heads {num_heads}, the cache's "
                         f"num_kv_heads {num_kv_heads} and head_size {head_size}), got {tuple(weight.shape)}")
    rows = input.reshape(-1, input.shape[-1])
    num_rows = rows.shape[0]
    cos, sin = cos.reshape(num_rows, head_size // 2), sin.reshape(num_rows, head_size // 2)
    slot_mapping = slot_mapping.reshape(num_rows)
    out = _decode_qkv_rope_cache_op(rows, weight, bias, cos, sin, key_cache, value_cache, slot_mapping,
                                    num_heads)
    return out.view(*input.shape[:-1], features)


@register_flop_formula([torch.ops.tpkit.decode_linear, torch.ops.tpkit.decode_linear_silu_and_mul,
                        torch.ops.tpkit.decode_qkv_rope_cache])
def _decode_linear_flops(input_shape: torch.Size, weight_shape: torch.Size, *args: object,
                         **kwargs: object) -> int:
    # As torch counts F.linear's addmm: 2 * rows * out_features * in_features, the bias not counted.
    return 2 * input_shape[0] * weight_shape[0] * weight_shape[1]
