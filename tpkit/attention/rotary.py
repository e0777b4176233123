"""RoPE's rotation of a head's features (the NeoX / HuggingFace layout), shared by the models and by the
decode kernel's reference (``tpkit.attention.linear``)."""

from __future__ import annotations

import torch


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[batch, seq, heads, head_size]`` by cos, sin ``[batch, seq, 1, head_size // 2]``.

    The NeoX / HuggingFace layout: the first half of a head pairs with the second half.
    """
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
