"""``decode_linear``: ``F.linear`` for the few rows of a decode step, with a CUDA kernel of tpkit's own.

A decode step multiplies a handful of rows (one token per sequence) by every weight matrix of the model, so
each product costs its weight's bytes at the memory's speed plus fixed costs. cuBLAS adds 3-8 us a product
on the H200 (``benchmarks/bench_decode_gemm.py``); the kernel in ``csrc/decode_linear.cuh`` streams the
weight straight into tensor-core operands and adds 2-4 us. It lives beside the attention kernels
because they share the build (``tpkit.ops._extension``) and ``tpkit.parallel_layers`` imports nothing of
ours: a model hands it to its layers with ``tpkit.parallel_layers.set_linear_op``.

``torch.ops.tpkit.decode_linear`` is a functional ``torch.library`` custom op (a fake implementation for
``torch.compile``; no host synchronisation, so it runs in CUDA graphs). :func:`decode_linear` calls it only
where the kernel can run and no gradient is wanted, and ``F.linear`` everywhere else. The kernel's epilogue
also takes the small element-wise steps that follow two of a decode layer's products, each otherwise a
kernel of 1.5-3 us for a few KB: SwiGLU after the MLP's gate/up product (:func:`decode_linear_silu_and_mul`)
and RoPE plus the cache write after the attention's q, k, v product (:func:`decode_qkv_rope_cache`, an op
that writes the caches in place). And the RMSNorm between two products, split in halves so that it needs
no kernel of its own: ``rms_norm(x) @ W.T = rsqrt(mean(x^2) + eps) * ((x * norm_weight) @ W.T)`` row by
row, so the product that makes ``x`` (:func:`decode_linear_residual_norm`, which also adds the residual)
writes ``x * norm_weight`` and adds up the rows' squares, and the product that reads it (``rms_sums`` of
:func:`decode_linear_silu_and_mul` and :func:`decode_qkv_rope_cache`) scales each row of its result.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

from tpkit.ops.paged_attention import (
    _FLOAT_DTYPES,
    _HALF_DTYPES,
    _check_tensor,
    _define_op,
    reshape_and_cache,
)
from tpkit.ops.rotary import apply_rotary

_MAX_ROWS = 16  # TPKIT_DECODE_LINEAR_MAX_ROWS of csrc/decode_linear.h


def _silu_and_mul_expression(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _check_silu_and_mul(out: torch.Tensor, input: torch.Tensor, *, read_values: bool = False) -> None:
    _check_tensor("silu_and_mul", "input", input, dim=2, dtypes=_FLOAT_DTYPES)
    num_rows, width = input.shape
    if width % 2:
        raise ValueError(f"silu_and_mul: input: expected [num_rows, 2 * features] (gate, then up), got shape "
                         f"{list(input.shape)}")
    _check_tensor("silu_and_mul", "out", out, dim=2, dtypes=(input.dtype,))
    if out.shape != (num_rows, width // 2):
        raise ValueError(f"silu_and_mul: out: expected shape [{num_rows}, {width // 2}], got "
                         f"{list(out.shape)}")


def _silu_and_mul_reference(out: torch.Tensor, input: torch.Tensor) -> None:
    out.copy_(_silu_and_mul_expression(input))


# out [num_rows, features] = silu(gate) * up of input [num_rows, 2 * features]: one kernel on the GPU where
# the expression is two (the prefill's SwiGLU after cuBLAS's gate/up product).
_define_op("silu_and_mul", "(Tensor(a!) out, Tensor input) -> ()", ("out",), _check_silu_and_mul,
           _silu_and_mul_reference)


def _silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` of ``gate_up``'s halves ``[..., 2 * features]`` -> ``[..., features]``; by the
    ``tpkit::silu_and_mul`` op on GPUs (float16, bfloat16) where no gradient is wanted (it has no backward),
    with the same values."""
    if not (gate_up.is_cuda and gate_up.dtype in _HALF_DTYPES and gate_up.dim() >= 1
            and not (torch.is_grad_enabled() and gate_up.requires_grad)):
        return _silu_and_mul_expression(gate_up)
    width = gate_up.shape[-1]
    rows = gate_up.reshape(-1, width)  # [num_rows, 2 * features], a view wherever the rows allow one
    out = gate_up.new_empty(rows.shape[0], width // 2)
    torch.ops.tpkit.silu_and_mul(out, rows)
    return out.view(*gate_up.shape[:-1], width // 2)


def _features(weight: torch.Tensor, silu_and_mul: bool) -> int:
    return weight.shape[0] // 2 if silu_and_mul else weight.shape[0]


def apply_rms_sums(input: torch.Tensor, rms_sums: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The second half of an RMSNorm split across two products: ``input`` ``[..., features]`` (the first
    half's ``normed``, ``x * norm_weight``) with row m times ``rsqrt(rms_sums[m] / features + eps)``, in
    float32, rounded once to input's dtype. rms_sums: float64 ``[num_rows]`` over input's leading dimensions
    flattened (the sums of ``x ** 2`` that :func:`decode_linear_residual_norm` added); input itself where
    it is None. What the products given ``rms_sums=`` apply, for a norm no product follows."""
    _check_rms_sums("apply_rms_sums", input, rms_sums)
    if rms_sums is None:
        return input
    scale = torch.rsqrt(rms_sums.float() / input.shape[-1] + eps).view(*input.shape[:-1], 1)
    return (input.float() * scale).to(input.dtype)


def _run(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu_and_mul: bool,
         rms_sums: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    # input [num_rows, in_features], weight [out_features, in_features] (with silu_and_mul the gate's rows,
    # then the up projection's), bias [out_features] or None, rms_sums [num_rows] or None
    # -> [num_rows, features], contiguous
    if input.is_cuda:
        # Imported here so that CPU-only use never touches the extension.
        from tpkit.ops import _extension

        out = input.new_empty(input.shape[0], _features(weight, silu_and_mul))
        if _extension.decode_linear(out, input, weight, bias, silu_and_mul=silu_and_mul, rms_sums=rms_sums,
                               eps=eps):
            return out
    product = F.linear(apply_rms_sums(input, rms_sums, eps), weight, bias)
    return (_silu_and_mul(product) if silu_and_mul else product).contiguous()


@torch.library.custom_op("tpkit::decode_linear", mutates_args=())
def _decode_linear_op(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _run(input, weight, bias, silu_and_mul=False)


@_decode_linear_op.register_fake
def _(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return input.new_empty(input.shape[0], _features(weight, False))


@torch.library.custom_op("tpkit::decode_linear_silu_and_mul", mutates_args=())
def _decode_linear_silu_and_mul_op(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                   rms_sums: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    return _run(input, weight, bias, silu_and_mul=True, rms_sums=rms_sums, eps=eps)


@_decode_linear_silu_and_mul_op.register_fake
def _(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
      rms_sums: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    return input.new_empty(input.shape[0], _features(weight, True))


def _kernel_may_take(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """What the shapes, dtypes and devices decide; the kernel's binding checks strides and alignment."""
    if not (input.is_cuda and input.dtype in _HALF_DTYPES and weight.dim() == 2 and input.dim() >= 1):
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


def decode_kernel_applies(input: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether :func:`decode_linear` would multiply ``input`` by ``weight`` with its CUDA kernel: from the
    shapes, dtypes, devices and whether a gradient is wanted (the binding may still decline unaligned rows).
    Models take their fused decode paths only where it does: the fused ops' PyTorch expressions, run one
    operator at a time inside the op, are slower than what ``torch.compile`` makes of the plain path."""
    return _kernel_may_take(input, weight, None)


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


def decode_linear_silu_and_mul(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                               rms_sums: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
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

    Returns:
        ``[..., features]``. Where :func:`decode_linear` would run the kernel and ``features`` is a
        multiple of 8, the kernel rounds gate and up to the dtype, then their product once (as a compiled
        ``F.silu(gate) * up`` does); everywhere else this is that expression over ``F.linear`` (on GPUs,
        without a gradient, as one kernel with the expression's values: ``torch.ops.tpkit.silu_and_mul``).
        Also a ``linear_op`` for a gate/up layer whose caller wants the activated half (``LlamaMLP``).
    """
    if weight.dim() != 2 or weight.shape[0] % 2 != 0:
        raise ValueError(f"decode_linear_silu_and_mul: weight: expected [2 * features, in_features] (gate "
                         f"rows, then up rows), got {tuple(weight.shape)}")
    _check_rms_sums("decode_linear_silu_and_mul", input, rms_sums)
    if not _kernel_may_take(input, weight, bias) or weight.shape[0] % 16 != 0:
        return _silu_and_mul(F.linear(apply_rms_sums(input, rms_sums, eps), weight, bias))
    features = _features(weight, True)
    return _on_rows(_decode_linear_silu_and_mul_op, input, weight, bias, features, rms_sums, eps)


def _check_row_sums(op: str, name: str, input: torch.Tensor, sums: torch.Tensor) -> None:
    """``sums`` (argument ``name`` of ``op``) must be float64 [num_rows], one sum a row of ``input``."""
    num_rows = input.numel() // input.shape[-1] if input.shape[-1] else 0
    if sums.shape != (num_rows,) or sums.dtype != torch.float64:
        raise ValueError(f"{op}: {name}: expected float64 [{num_rows}] (one sum a row of input), got "
                         f"{sums.dtype} {tuple(sums.shape)}")


def _check_rms_sums(op: str, input: torch.Tensor, rms_sums: torch.Tensor | None) -> None:
    if rms_sums is not None:
        _check_row_sums(op, "rms_sums", input, rms_sums)


def _on_rows(op: Callable[..., torch.Tensor], input: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None, features: int, *args: object) -> torch.Tensor:
    """``op`` on ``input``'s rows flattened to ``[num_rows, in_features]`` (and ``args``), its
    ``[num_rows, features]`` viewed with ``input``'s leading dimensions again."""
    rows = input.reshape(-1, input.shape[-1])
    return op(rows, weight, bias, *args).view(*input.shape[:-1], features)


# flexible_layout: inductor hands the op its inputs as it laid them out (the binding takes contiguous cos and
# sin, as inductor makes them, and falls back on anything else). Without it inductor copied the step's cos
# and sin into a buffer of their own for every layer's call: 64 copies a Llama-3-8B step, in six kernels.
@torch.library.custom_op("tpkit::decode_qkv_rope_cache", mutates_args=("key_cache", "value_cache"),
                        tags=(torch.Tag.flexible_layout,))
def _decode_qkv_rope_cache_op(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                              cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
                              value_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                              rms_sums: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    # input [num_rows, in_features], weight [(num_heads + 2 * num_kv_heads) * head_size, in_features],
    # cos, sin [num_rows, head_size / 2], caches [num_blocks, block_size, num_kv_heads, head_size],
    # slot_mapping [num_rows], rms_sums [num_rows] or None
    # -> qkv [num_rows, (num_heads + 2 * num_kv_heads) * head_size], contiguous
    if input.is_cuda:
        from tpkit.ops import _extension

        out = input.new_empty(input.shape[0], weight.shape[0])
        if _extension.decode_qkv_rope_cache(out, input, weight, bias, cos, sin, key_cache, value_cache,
                                       slot_mapping, num_heads, rms_sums, eps):
            return out
    num_kv_heads, head_size = key_cache.shape[2], key_cache.shape[3]
    # [num_rows, heads, head_size]; the rotation's cos, sin [num_rows, 1, head_size / 2]
    qkv = F.linear(apply_rms_sums(input, rms_sums, eps), weight, bias).view(input.shape[0], -1, head_size)
    qk = apply_rotary(qkv[None, :, : num_heads + num_kv_heads], cos[None, :, None], sin[None, :, None])[0]
    k, v = qk[:, num_heads:], qkv[:, num_heads + num_kv_heads:]
    reshape_and_cache(k, v, key_cache, value_cache, slot_mapping)
    return torch.cat((qk, v), dim=1).flatten(1)


@_decode_qkv_rope_cache_op.register_fake
def _(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cos: torch.Tensor,
      sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor,
      num_heads: int, rms_sums: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    return input.new_empty(input.shape[0], weight.shape[0])


def decode_qkv_rope_cache(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                          rms_sums: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
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
        rms_sums, eps: as in :func:`decode_linear_silu_and_mul` (the input an RMSNorm's first half).

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
    _check_rms_sums("decode_qkv_rope_cache", input, rms_sums)
    out = _decode_qkv_rope_cache_op(rows, weight, bias, cos, sin, key_cache, value_cache, slot_mapping,
                                    num_heads, rms_sums, eps)
    return out.view(*input.shape[:-1], features)


@torch.library.custom_op("tpkit::decode_linear_residual_norm", mutates_args=("sums", "zero_sums"))
def _decode_linear_residual_norm_op(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                    residual: torch.Tensor, norm_weight: torch.Tensor, sums: torch.Tensor,
                                    zero_sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # input [num_rows, in_features], weight [out_features, in_features], residual [num_rows, out_features],
    # norm_weight [out_features], sums and zero_sums float64 [num_rows]
    # -> out, normed [num_rows, out_features]
    # Here, not in the wrapper: torch.compile cannot trace a comparison of data pointers (a graph break in
    # every layer, then a recompilation per layer until its limit), and runs an op's body as it is.
    if sums.data_ptr() == zero_sums.data_ptr():
        raise ValueError("decode_linear_residual_norm: zero_sums: expected another buffer than sums")
    out = input.new_empty(input.shape[0], weight.shape[0])
    normed = torch.empty_like(out)
    if input.is_cuda:
        from tpkit.ops import _extension

        if _extension.decode_linear_residual_norm(out, normed, input, weight, bias, residual, norm_weight,
                                                  sums, zero_sums):
            return out, normed
    torch.add(residual, F.linear(input, weight, bias), out=out)
    torch.mul(out, norm_weight, out=normed)
    sums.add_(out.float().square().sum(-1, dtype=torch.float64))
    zero_sums.zero_()
    return out, normed


@_decode_linear_residual_norm_op.register_fake
def _(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
      norm_weight: torch.Tensor, sums: torch.Tensor,
      zero_sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = input.new_empty(input.shape[0], weight.shape[0])
    return out, torch.empty_like(out)


def decode_linear_residual_norm(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                                residual: torch.Tensor, norm_weight: torch.Tensor, sums: torch.Tensor,
                                zero_sums: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
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

    Returns:
        ``(out, normed)``, each ``[..., out_features]``. The kernel rounds the product to the dtype, then the
        sum with the residual and ``normed`` once each (as ``residual + product`` and ``out * norm_weight``
        in the dtype do); each block adds its float32 share of a row's sum in float64, where the order of
        the blocks' adds does not change the result (steps are reproducible). It runs where
        :func:`decode_linear` would, else the PyTorch expression above. An inference op: it has no backward
        (the models call it only with gradients off).
    """
    rows = input.reshape(-1, input.shape[-1])
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
    residual_rows = residual.reshape(num_rows, out_features)
    out, normed = _decode_linear_residual_norm_op(rows, weight, bias, residual_rows, norm_weight, sums,
                                                  zero_sums)
    return out.view(residual.shape), normed.view(residual.shape)


@register_flop_formula([torch.ops.tpkit.decode_linear, torch.ops.tpkit.decode_linear_silu_and_mul,
                        torch.ops.tpkit.decode_qkv_rope_cache, torch.ops.tpkit.decode_linear_residual_norm])
def _decode_linear_flops(input_shape: torch.Size, weight_shape: torch.Size, *args: object,
                         **kwargs: object) -> int:
    # As torch counts F.linear's addmm: 2 * rows * out_features * in_features, the bias not counted.
    return 2 * input_shape[0] * weight_shape[0] * weight_shape[1]
