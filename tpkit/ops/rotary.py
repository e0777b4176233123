"""RoPE's rotation of a head's features (the NeoX / HuggingFace layout), shared by the models and by the
decode kernel's reference (``tpkit.ops.linear``).

On the GPU (float16, bfloat16, no gradient wanted) the rotation is one kernel, ``torch.ops.tpkit.rotary``,
where the expression is seven (two products and a sum for each half, and the concatenation): a Llama-3-8B
prefill of 8 x 128 tokens runs it once a layer. The kernel rounds each product and sum to the dtype as the
expression does, so both give the same values.
"""

from __future__ import annotations

import torch

from tpkit.ops.paged_attention import _FLOAT_DTYPES, _HALF_DTYPES, _check_tensor, _define_op


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _check_rotary(out: torch.Tensor, input: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                  read_values: bool = False) -> None:
    _check_tensor("rotary", "input", input, dim=3, dtypes=_FLOAT_DTYPES)
    dtypes = (input.dtype,)
    num_tokens, num_heads, head_size = input.shape
    if head_size % 2:
        raise ValueError(f"rotary: input: expected an even head_size, got shape {list(input.shape)}")
    _check_tensor("rotary", "out", out, dim=3, dtypes=dtypes)
    if out.shape != input.shape or not out.is_contiguous():
        raise ValueError(f"rotary: out: expected a contiguous tensor of input's shape {list(input.shape)}, "
                         f"got shape {list(out.shape)}, strides {list(out.stride())}")
    for name, table in (("cos", cos), ("sin", sin)):
        _check_tensor("rotary", name, table, dim=2, dtypes=dtypes)
        if table.shape != (num_tokens, head_size // 2):
            raise ValueError(f"rotary: {name}: expected shape [{num_tokens}, {head_size // 2}], got "
                             f"{list(table.shape)}")


def _rotary_reference(out: torch.Tensor, input: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    out.copy_(_rotated(input, cos[:, None], sin[:, None]))


# out [num_tokens, num_heads, head_size] = input rotated by cos, sin [num_tokens, head_size // 2].
_define_op("rotary", "(Tensor(a!) out, Tensor input, Tensor cos, Tensor sin) -> ()", ("out",), _check_rotary,
           _rotary_reference)


def _kernel_may_take(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """GPU tensors of a kernel dtype, cos and sin one row a token (no broadcasting), and no gradient wanted
    (the op has no backward)."""
    if not (x.is_cuda and x.dtype in _HALF_DTYPES and x.dim() == 4 and x.shape[-1] % 16 == 0):
        return False
    table_shape = (*x.shape[:2], 1, x.shape[-1] // 2)
    if any(t.shape != table_shape or t.dtype != x.dtype or t.device != x.device for t in (cos, sin)):
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, cos, sin)))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[batch, seq, heads, head_size]`` by cos, sin ``[batch, seq, 1, head_size // 2]``.

    The NeoX / HuggingFace layout: the first half of a head pairs with the second half. Returns a new
    contiguous tensor; cos and sin may also broadcast over batch or seq (then, and with a gradient, this is
    the PyTorch expression rather than the kernel).
    """
    half = x.shape[-1] // 2
    for name, table in (("cos", cos), ("sin", sin)):
        if table.dim() != 4 or table.shape[2:] != (1, half):
            raise ValueError(f"apply_rotary: {name}: expected shape [batch, seq, 1, {half}] (half of x's "
                             f"head size {x.shape[-1]}), got {list(table.shape)}")
    if not _kernel_may_take(x, cos, sin):
        return _rotated(x, cos, sin)
    batch, seq, heads, head_size = x.shape
    # [batch * seq, heads, head_size]: a view where batch and seq strides allow one (a slice of the fused
    # qkv projection's output does).
    tokens = x.reshape(batch * seq, heads, head_size)
    out = torch.empty(tokens.shape, dtype=x.dtype, device=x.device)
    torch.ops.tpkit.rotary(out, tokens, cos.reshape(batch * seq, head_size // 2),
                           sin.reshape(batch * seq, head_size // 2))
    return out.view(x.shape)
