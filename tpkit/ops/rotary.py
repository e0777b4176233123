"""Rotary position embedding (RoPE): HuggingFace's frequency schedules, a cached cos/sin table, and the
rotation of a head's features (the NeoX / HuggingFace layout), shared by the models and by the decode
kernel's reference (``tpkit.ops.linear``).

On the GPU (float16, bfloat16, no gradient wanted) the rotation is one kernel, ``torch.ops.tpkit.rotary``,
where the expression is seven (two products and a sum for each half, and the concatenation). The kernel
rounds each product and sum to the dtype as the expression does, so both give the same values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tpkit.ops._checks import _FLOAT_DTYPES, _HALF_DTYPES, _check_tensor
from tpkit.ops._library import _define_op

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")
# The settings each schedule reads besides rope_theta; each a finite number > 0.
_FACTORS = {"default": (), "linear": ("factor",), "dynamic": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
            "yarn": ("factor", "original_max_position_embeddings"),
            "longrope": ("factor", "original_max_position_embeddings")}
# Optional settings, each a finite number > 0 where present.
_OPTIONAL = {"yarn": ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"),
             "longrope": ("attention_factor",)}


def rope_parameters(config: Mapping[str, Any], params: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The RoPE settings of a config.json as transformers 5 spells them (``rope_parameters``).

    transformers 4 wrote ``rope_theta`` at the top level and the scaling under ``rope_scaling`` (with
    ``type`` or ``rope_type``); transformers 5 writes one ``rope_parameters`` dict. Both give the same result.
    ``params``: one layer type's dict instead of the config's own (Gemma 3 nests one a layer type). The
    context lengths the schedules default to are filled in as transformers fills them.
    """
    if params is None:
        params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    params = dict(params)
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    max_positions = config.get("max_position_embeddings")
    if params["rope_type"] in ("llama3", "yarn", "longrope"):
        # Phi-3 style configs keep the pretraining length at the top level.
        params.setdefault("original_max_position_embeddings",
                          config.get("original_max_position_embeddings") or max_positions)
    if params["rope_type"] in ("yarn", "longrope") and params.get("factor") is None:
        original = params["original_max_position_embeddings"]
        if isinstance(max_positions, (int, float)) and isinstance(original, (int, float)) and original:
            params["factor"] = max_positions / original
    return params


def inverse_frequencies(head_size: int, params: Mapping[str, Any], *, long: bool = False) -> torch.Tensor:
    """float32 ``[head_size // 2]`` inverse frequencies, computed exactly as transformers computes them.

    ``dynamic`` (NTK) changes the base only for sequences past ``max_position_embeddings``, which no tpkit
    model reaches (its positions end there): its frequencies are the default ones. ``longrope`` has two sets:
    ``long`` gives those for positions from ``original_max_position_embeddings`` on.
    """
    check_rope_parameters(params)
    rope_type = params["rope_type"]
    base = params["rope_theta"]
    if rope_type == "longrope":
        factors = params["long_factor" if long else "short_factor"]
        if len(factors) != head_size // 2:
            name = "long_factor" if long else "short_factor"
            raise ValueError(f"config.json rope_parameters (rope_scaling): {name}: expected {head_size // 2} "
                             f"numbers (head_size / 2), got {len(factors)}")
        shape = torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base ** shape)
    if rope_type == "yarn":
        return _yarn_inverse_frequencies(head_size, params)
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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inverse_frequencies(head_size: int, params: Mapping[str, Any]) -> torch.Tensor:
    """YaRN: dimensions that turn many times within the pretraining context keep their frequency, those
    that turn less than once are interpolated by ``factor``, a linear ramp between (``beta_fast``,
    ``beta_slow`` turns)."""
    base, factor = params["rope_theta"], params["factor"]
    original = params["original_max_position_embeddings"]
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_size * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_size - 1)
    if low == high:
        high += 0.001  # a ramp of width zero
    ramp = torch.clamp((torch.arange(head_size // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, head_size, 2).float() / head_size)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def attention_factor(params: Mapping[str, Any]) -> float:
    """The factor cos and sin are multiplied by: 1, but for ``yarn`` and ``longrope`` (their
    ``attention_factor``, or the value transformers infers from the scaling factor)."""
    rope_type = params["rope_type"]
    given = params.get("attention_factor")
    if rope_type not in ("yarn", "longrope"):
        return 1.0
    if given is not None:
        return float(given)
    factor = params["factor"]
    if rope_type == "longrope":
        if factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(factor) / math.log(params["original_max_position_embeddings"]))
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
    return _yarn_mscale(factor)


def check_rope_parameters(params: Mapping[str, Any]) -> None:
    """Every setting the schedule reads, by name: a factor of 0 would give NaN tables and plausible-looking
    tokens, not an error. A schedule tpkit does not implement is refused by name."""
    where = "config.json rope_parameters (rope_scaling)"
    rope_type = params["rope_type"]
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"{where}: rope_type {rope_type!r} is not supported; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(f"{where}: partial_rotary_factor: expected 1.0, got "
                         f"{params['partial_rotary_factor']!r}")
    optional = [key for key in _OPTIONAL.get(rope_type, ()) if params.get(key) is not None]
    for key in ("rope_theta", *_FACTORS[rope_type], *optional):
        value = params.get(key)
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (number and math.isfinite(value) and value > 0):
            raise ValueError(f"{where}: {key}: expected a finite number > 0 for rope_type {rope_type!r}, got "
                             f"{value!r}")
    if rope_type == "llama3" and not params["high_freq_factor"] > params["low_freq_factor"]:
        raise ValueError(f"{where}: high_freq_factor: expected more than low_freq_factor = "
                         f"{params['low_freq_factor']!r}, got {params['high_freq_factor']!r}")
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            factors = params.get(key)
            if not (isinstance(factors, list) and factors and all(
                    isinstance(f, (int, float)) and not isinstance(f, bool) and math.isfinite(f) and f > 0
                    for f in factors)):
                raise ValueError(f"{where}: {key}: expected a list of finite numbers > 0 for rope_type "
                                 f"'longrope', got {factors!r}")


class RotaryEmbedding(nn.Module):
    """cos/sin for every position up to ``max_position``, computed once; ``forward`` only gathers rows.

    The table is float32 and half the head wide (the two halves of a head share frequencies), times the
    schedule's :func:`attention_factor`. A step looks its positions up once (:meth:`cos_sin`) and every
    layer reuses the result in :func:`apply_rotary`.

    ``longrope``: positions below ``original_max_position_embeddings`` rotate by the short factors, later
    ones by the long factors. transformers chooses one set for a whole forward, by its last position: the
    same rotations for a prompt within the original context and the tokens generated after it, which each
    rotate as they are added; a prompt longer than that rotates by the long factors throughout there.
    """

    def __init__(self, head_size: int, max_position: int, params: Mapping[str, Any], *,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_size, params)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_size // 2]
        if params["rope_type"] == "longrope":
            long_freqs = positions[:, None] * inverse_frequencies(head_size, params, long=True)[None, :]
            is_long = positions[:, None] >= params["original_max_position_embeddings"]
            freqs = torch.where(is_long, long_freqs, freqs)
        scaling = attention_factor(params)
        self.head_size = head_size
        self.max_position = max_position
        self.register_buffer("cos_cache", (freqs.cos() * scaling).to(device), persistent=False)
        self.register_buffer("sin_cache", (freqs.sin() * scaling).to(device), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions int ``[batch, seq]`` -> cos, sin ``[batch, seq, 1, head_size // 2]`` in ``dtype``."""
        # Cast before use, like transformers: in bf16 the rotation is then rounded the same way.
        cos = self.cos_cache[positions].to(dtype).unsqueeze(2)
        sin = self.sin_cache[positions].to(dtype).unsqueeze(2)
        return cos, sin


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
