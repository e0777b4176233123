"""SwiGLU's activation, ``silu(gate) * up`` of a gate/up product's two halves.

On the GPU (float16, bfloat16, no gradient wanted) it is one kernel, ``torch.ops.tpkit.silu_and_mul``, where
the expression is two (the SiLU and the product). The kernel rounds the SiLU and the product to the dtype as
the expression does, so both give the same values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tpkit.ops._checks import _FLOAT_DTYPES, _HALF_DTYPES, _check_tensor
from tpkit.ops._library import _define_op


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


# out [num_rows, features] = silu(gate) * up of input [num_rows, 2 * features].
_define_op("silu_and_mul", "(Tensor(a!) out, Tensor input) -> ()", ("out",), _check_silu_and_mul,
           _silu_and_mul_reference)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``F.silu(gate) * up`` of ``gate_up``'s halves ``[..., 2 * features]`` (gate, then up) ->
    ``[..., features]``; by the ``tpkit::silu_and_mul`` op on GPUs (float16, bfloat16) where no gradient is
    wanted (it has no backward), with the same values."""
    if not (gate_up.is_cuda and gate_up.dtype in _HALF_DTYPES and gate_up.dim() >= 1
            and not (torch.is_grad_enabled() and gate_up.requires_grad)):
        return _silu_and_mul_expression(gate_up)
    width = gate_up.shape[-1]
    rows = gate_up.reshape(-1, width)  # [num_rows, 2 * features], a view wherever the rows allow one
    out = gate_up.new_empty(rows.shape[0], width // 2)
    torch.ops.tpkit.silu_and_mul(out, rows)
    return out.view(*gate_up.shape[:-1], width // 2)
