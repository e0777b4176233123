"""``decode_linear``: ``F.linear`` for the few rows of a decode step, with a CUDA kernel of tpkit's own.

A decode step multiplies a handful of rows (one token per sequence) by every weight matrix of the model, so
each product costs its weight's bytes at the memory's speed plus fixed costs. cuBLAS adds 3-8 us a product
on the H200 (``benchmarks/bench_decode_gemm.py``); the kernel in ``csrc/decode_linear.cuh`` streams the
weight straight into tensor-core operands and adds 2-4 us. It lives beside the attention kernels
because they share the build (``tpkit.attention._cuda``) and ``tpkit.parallel_layers`` imports nothing of
ours: a model hands it to its layers with ``tpkit.parallel_layers.set_linear_op``.

``torch.ops.tpkit.decode_linear`` is a functional ``torch.library`` custom op (a fake implementation for
``torch.compile``; no host synchronisation, so it runs in CUDA graphs). :func:`decode_linear` calls it only
where the kernel can run and no gradient is wanted, and ``F.linear`` everywhere else.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

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


@register_flop_formula([torch.ops.tpkit.decode_linear, torch.ops.tpkit.decode_linear_silu_and_mul])
def _decode_linear_flops(input_shape: torch.Size, weight_shape: torch.Size, *args: object,
                         **kwargs: object) -> int:
    # As torch counts F.linear's addmm: 2 * rows * out_features * in_features, the bias not counted.
    return 2 * input_shape[0] * weight_shape[0] * weight_shape[1]
