"""Attention-probability dropout of one rank's heads, drawn as tensor parallelism needs.

A rank's attention heads are a shard of the model's: their probabilities' dropout masks must differ from
rank to rank (``tensor_parallel_rng``), as those of one unsharded model's heads do. The models drop where
transformers does, in training (``model.train()``); attention probabilities only without a KV cache (the
paged kernels have no dropout). Activations outside attention go through ``tensor_parallel_dropout``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from tpkit.attention import Attention
from tpkit.parallel_layers import tensor_parallel_rng


def attend(attn: Attention, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None, *,
           dropout_p: float, tp_size: int, **kwargs: Any) -> torch.Tensor:
    """``attn(query, key, value, **kwargs)``, its probabilities dropped at ``dropout_p`` where ``attn`` is
    training and has no ``kv_cache``; this rank's own generator stream where ``tp_size`` > 1."""
    if not attn.training or kwargs.get("kv_cache") is not None:
        dropout_p = 0.0
    rng = tensor_parallel_rng() if dropout_p > 0.0 and tp_size > 1 else contextlib.nullcontext()
    with rng:
        return attn(query, key, value, dropout_p=dropout_p, **kwargs)
