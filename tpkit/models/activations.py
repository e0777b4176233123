"""The MLP activations that HuggingFace configs name (``activation_function`` / ``hidden_act``)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

# gelu_new is transformers' hand-written tanh approximation: the same function as torch's tanh GELU.
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu_new": partial(F.gelu, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function a config names; a ValueError lists the supported names otherwise."""
    if name not in _ACTIVATIONS:
        supported = ", ".join(sorted(_ACTIVATIONS))
        raise ValueError(f"activation {name!r} is not supported; supported: {supported}")
    return _ACTIVATIONS[name]
