"""A checkpoint's float8 KV-cache scales: ``k_scale`` and ``v_scale`` tensors of each layer's attention, as
vLLM's FP8-KV checkpoints store them (``self_attn.k_scale``, ``self_attn.attn.k_scale``, or the older
``self_attn.k_proj.k_scale`` and ``self_attn.v_proj.v_scale``).

They are not parameters: :func:`peel_kv_scales` takes them out of the stream of weights before the
parameters load, into the model's ``kv_cache_scales``, which ``new_kv_cache`` hands to a float8 cache.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from tpkit.loaders import CheckpointError

_KV_SCALE = re.compile(r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:(?:k_proj|v_proj|attn)\.)?([kv])_scale$")


def peel_kv_scales(weights: Iterable[tuple[str, Any]], scales: dict[int, dict[str, torch.Tensor]],
                   kv_heads: tuple[int, int], total_num_kv_heads: int) -> Iterator[tuple[str, Any]]:
    """``weights`` without its KV-cache scales, which go into ``scales[layer_idx]["k" | "v"]`` as float32:
    a scale of one value as shape [], one of ``total_num_kv_heads`` values as this rank's
    ``kv_heads = (first, count)`` of them (shape [count]). Any other size is a CheckpointError."""
    first, count = kv_heads
    for name, weight in weights:
        match = _KV_SCALE.search(name)
        if match is None:
            yield name, weight
            continue
        value = torch.as_tensor(weight[...]).detach().to("cpu", torch.float32).reshape(-1)
        if value.numel() == 1:
            value = value.reshape(())
        elif value.numel() == total_num_kv_heads:
            value = value[first:first + count].clone()
        else:
            raise CheckpointError(f"{name}: expected one scale or one a KV head ({total_num_kv_heads}), got "
                                  f"{value.numel()} values")
        scales.setdefault(int(match[1]), {})[match[2]] = value
