"""RMSNorm, and the second half of an RMSNorm split across two products.

``rms_norm(x) @ W.T = rsqrt(mean(x^2) + eps) * ((x * norm_weight) @ W.T)`` row by row, so a decode step can
fold a norm into the products around it, with no norm kernel between them: the product that makes ``x``
writes ``x * norm_weight`` and adds up the rows' squares (``tpkit.ops.decode_linear_residual_norm``), and
the product that reads it scales each row of its result by the norm (their ``rms_sums`` argument).
:func:`apply_rms_sums` does that scaling for a norm no product follows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tpkit.ops._checks import _check_row_sums


class RMSNorm(nn.Module):
    """transformers' LlamaRMSNorm (normalised in float32), as one fused op where torch has one.

    ``unit_offset``: Gemma's RMSNorm instead, which scales by ``1 + weight`` (its checkpoints store the
    offset from 1) and rounds to the input's dtype only after the scaling, all in float32 as transformers
    computes it.
    """

    def __init__(self, hidden_size: int, eps: float, *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, unit_offset: bool = False) -> None:
        super().__init__()
        initial = torch.zeros if unit_offset else torch.ones
        self.weight = nn.Parameter(initial(hidden_size, dtype=dtype, device=device))  # [hidden_size]
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """x ``[..., hidden_size]``; ``weight``: the weight to scale by (default ``self.weight``; a model
        passes it through an autograd mapping where the norm's gradient needs one)."""
        weight = self.weight if weight is None else weight
        if self.unit_offset:
            x32 = x.float()
            normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            return (normed * (1.0 + weight.float())).to(x.dtype)
        return F.rms_norm(x, weight.shape, weight, self.eps)


def apply_rms_sums(input: torch.Tensor, rms_sums: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The second half of an RMSNorm split across two products: ``input`` ``[..., features]`` (the first
    half's ``normed``, ``x * norm_weight``) with row m times ``rsqrt(rms_sums[m] / features + eps)``, in
    float32, rounded once to input's dtype. rms_sums: float64 ``[num_rows]`` over input's leading dimensions
    flattened (the sums of ``x ** 2`` that :func:`~tpkit.ops.decode_linear_residual_norm` added); input
    itself where it is None. What the products given ``rms_sums=`` apply, for a norm no product follows."""
    _check_row_sums("apply_rms_sums", "rms_sums", input, rms_sums)
    if rms_sums is None:
        return input
    scale = torch.rsqrt(rms_sums.float() / input.shape[-1] + eps).view(*input.shape[:-1], 1)
    return (input.float() * scale).to(input.dtype)
