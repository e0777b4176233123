"""The scales of a float8 KV cache: setting them, and calibrating them from keys and values.

A float8 cache stores ``saturate(x / scale)`` with one float32 ``k_scale`` and ``v_scale`` a layer, each of
shape ``[]`` (the layer's) or ``[num_kv_heads]`` (one a KV head of this rank). A scale comes from the
checkpoint where it has one (``k_scale``/``v_scale`` tensors, the models load them), from
:func:`calibrated_kv_scales` over keys and values the model computed, or is 1.0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from tpkit.attention.kv_cache import PagedKVCache

FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _as_kv_scale(value: object, name: str, num_kv_heads: int) -> torch.Tensor:
    """A scale as a CPU float32 tensor of shape [] or [num_kv_heads], finite and positive."""
    if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
        raise TypeError(f"PagedKVCache.set_scales: {name}: expected a float or a float tensor, got "
                        f"{type(value).__name__}")
    scale = torch.as_tensor(value).detach().to("cpu", torch.float32)
    if list(scale.shape) not in ([], [num_kv_heads]):
        raise ValueError(f"PagedKVCache.set_scales: {name}: expected shape [] or [num_kv_heads] = "
                         f"[{num_kv_heads}], got {list(scale.shape)}")
    if not bool((torch.isfinite(scale) & (scale > 0)).all()):
        raise ValueError(f"PagedKVCache.set_scales: {name}: expected finite positive scales, got "
                         f"{scale.tolist()}")
    return scale


def set_kv_scales(cache: PagedKVCache, layer_idx: int, k_scale: torch.Tensor | float,
                  v_scale: torch.Tensor | float) -> None:
    """Set the scales of layer ``layer_idx`` of a float8 ``cache``: floats or float tensors of shape [] or
    [num_kv_heads], finite and positive, checked before anything changes.

    Set them before writing the layer (what is stored was divided by the scale of its time) and before
    capturing a CUDA graph: a scale of the shape it had is written in place, so graphs already captured read
    the new value; one of another shape replaces the tensor.
    """
    if cache.k_scales is None or cache.v_scales is None:
        raise ValueError(f"PagedKVCache.set_scales: expected a float8 cache, got one of {cache.dtype} "
                         f"(which stores keys and values unscaled)")
    if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < cache.num_layers:
        raise ValueError(f"PagedKVCache.set_scales: layer_idx: expected an int in [0, {cache.num_layers}), "
                         f"got {layer_idx!r}")
    new = [_as_kv_scale(k_scale, "k_scale", cache.num_kv_heads),
           _as_kv_scale(v_scale, "v_scale", cache.num_kv_heads)]
    for scales, scale in zip((cache.k_scales, cache.v_scales), new, strict=True):
        if scales[layer_idx].shape == scale.shape:
            scales[layer_idx].copy_(scale)
        else:
            scales[layer_idx] = scale.to(cache.device)


def calibrated_kv_scales(key: torch.Tensor, value: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn,
                         *, per_head: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(k_scale, v_scale)`` that map the largest magnitude of ``key`` and ``value`` onto the largest finite
    value of float8 ``dtype``: ``amax / finfo(dtype).max``, per layer (shape []) or with ``per_head`` per KV
    head ([num_kv_heads]).

    ``key``, ``value``: ``[..., num_kv_heads, head_size]`` of one layer, e.g. a cache in the model's dtype
    after calibration prompts ran through it (``cache.key_caches[i]``; zeros of unused slots change no
    maximum). A head (or layer) whose values are all zero gets scale 1.0. NaN in the inputs is an error.
    """
    if dtype not in FP8_KV_DTYPES:
        raise ValueError(f"calibrated_kv_scales: dtype: expected one of {list(FP8_KV_DTYPES)}, got {dtype}")
    scales = []
    for name, x in (("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor) or x.dim() < 2 or not x.dtype.is_floating_point:
            got = f"{x.dtype} of shape {list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise ValueError(f"calibrated_kv_scales: {name}: expected a float tensor [..., num_kv_heads, "
                             f"head_size], got {got}")
        if bool(x.isnan().any()):
            raise ValueError(f"calibrated_kv_scales: {name}: expected no NaN, got NaN")
        amax = x.detach().float().abs()
        amax = amax.flatten(0, -3).amax(dim=(0, 2)) if per_head else amax.amax()  # [num_kv_heads] or []
        scale = amax.cpu() / torch.finfo(dtype).max
        scales.append(torch.where(scale > 0, scale, 1.0))
    return scales[0], scales[1]
