"""Rotary position embedding (RoPE) with HuggingFace's frequency schedules and a cached cos/sin table."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# The settings each schedule reads besides rope_theta; each a finite number > 0.
_FACTORS = {"default": (), "linear": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def rope_parameters(config: Mapping[str, Any]) -> dict[str, Any]:
    """The RoPE settings of a config.json as transformers 5 spells them (``rope_parameters``).

    transformers 4 wrote ``rope_theta`` at the top level and the scaling under ``rope_scaling`` (with
    ``type`` or ``rope_type``); transformers 5 writes one ``rope_parameters`` dict. Both give the same result.
    """
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    if params["rope_type"] == "llama3":
        params.setdefault("original_max_position_embeddings", config["max_position_embeddings"])
    return params


def inverse_frequencies(head_size: int, params: Mapping[str, Any]) -> torch.Tensor:
    """float32 ``[head_size // 2]`` inverse frequencies, computed exactly as transformers computes them."""
    check_rope_parameters(params)
    rope_type = params["rope_type"]
    base = params["rope_theta"]
    inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size))
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        factor = params["factor"]
        low_freq_factor = params["low_freq_factor"]
        high_freq_factor = params["high_freq_factor"]
        old_context_len = params["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed down by `factor`, short ones kept, the band between interpolated.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


def check_rope_parameters(params: Mapping[str, Any]) -> None:
    """Every setting the schedule reads, by name: a factor of 0 would give NaN tables and plausible-looking
    tokens, not an error."""
    where = "config.json rope_parameters (rope_scaling)"
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"{where}: rope_type {rope_type!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{where}: partial_rotary_factor: expected 1.0, got "
                         f"{params['partial_rotary_factor']!r}")
    for key in ("rope_theta", *_FACTORS[rope_type]):
        value = params.get(key)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (number and math.isfinite(value) and value > 0):
            raise ValueError(f"{where}: {key}: expected a finite number > 0 for rope_type {rope_type!r}, got "
                             f"{value!r}")
    if rope_type == "llama3" and not params["high_freq_factor"] > params["low_freq_factor"]:
        raise ValueError(f"{where}: high_freq_factor: expected more than low_freq_factor = "
                         f"{params['low_freq_factor']!r}, got {params['high_freq_factor']!r}")


class RotaryEmbedding(nn.Module):
    """cos/sin for every position up to ``max_position``, computed once; ``forward`` only gathers rows.

    The table is float32 and half the head wide (the two halves of a head share frequencies). A step looks
    its positions up once (:meth:`cos_sin`) and every layer reuses the result in
    :func:`tpkit.attention.apply_rotary`.
    """

    def __init__(self, head_size: int, max_position: int, params: Mapping[str, Any], *,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_size, params)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_size // 2]
        self.head_size = head_size
        self.max_position = max_position
        self.register_buffer("cos_cache", freqs.cos().to(device), persistent=False)
        self.register_buffer("sin_cache", freqs.sin().to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int ``[batch, seq]`` -> cos, sin ``[batch, seq, 1, head_size // 2]`` in ``dtype``."""
        # Cast before use, like transformers: in bf16 the rotation is then rounded the same way.
        cos = self.cos_cache[positions].to(dtype).unsqueeze(2)
        sin = self.sin_cache[positions].to(dtype).unsqueeze(2)
        return cos, sin
