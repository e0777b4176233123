"""How the layers multiply: ``F.linear``, unless a model hands them a function of its own.

Every layer that multiplies by its weight (the linear layers, ``QKVCrossParallelLinear`` and
``ParallelLMHead``) calls ``self.linear_op(input, weight, bias)``. The layers import no kernels; a model
that has a faster product for some shapes (``tpkit.models`` uses ``tpkit.ops.decode_linear`` for the
few rows of a decode step) sets it on all its layers at once with :func:`set_linear_op`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

# (input [..., in_features], weight [out_features, in_features], bias [out_features] or None)
# -> [..., out_features]: the contract of F.linear, gradients included.
LinearOp = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


class _UsesLinearOp:
    """Mixin of the layers that multiply by their weight: ``linear_op`` is ``F.linear`` by default."""

    linear_op: LinearOp = staticmethod(F.linear)


def set_linear_op(module: nn.Module, linear_op: LinearOp) -> int:
    """Makes every tpkit layer in ``module`` (itself included) multiply with ``linear_op``, a function with
    ``F.linear``'s signature and results; ``F.linear`` restores the default. Returns how many layers."""
    if not callable(linear_op):
        raise TypeError(f"set_linear_op: linear_op: expected a function like F.linear, got "
                        f"{type(linear_op).__name__}")
    layers = [m for m in module.modules() if isinstance(m, _UsesLinearOp)]
    for layer in layers:
        layer.linear_op = linear_op
    return len(layers)
