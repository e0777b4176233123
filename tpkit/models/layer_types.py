"""Per-layer attention settings of a decoder's config.json: which family it is, which layers attend
through a sliding window and how wide, and each layer type's RoPE settings.

transformers 5 writes ``layer_types`` (``"sliding_attention"`` or ``"full_attention"`` a layer) into every
config.json of these families; older configs leave it out, and it is derived here as transformers derives
it: Mistral slides every layer where ``sliding_window`` is set, Qwen2 and Qwen3 the layers from
``max_window_layers`` on where ``use_sliding_window`` is true, Gemma 2 every other layer from the first,
Gemma 3 all but every ``sliding_window_pattern``-th (6). A sliding layer's query at position ``p`` sees the
keys ``p - sliding_window + 1 .. p``, transformers' window as ``tpkit.attention.Attention`` takes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tpkit.ops.rotary import rope_parameters

SLIDING = "sliding_attention"
FULL = "full_attention"
LAYER_TYPES = (SLIDING, FULL)

# architectures entry -> family, for configs without model_type.
_ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                  "MistralForCausalLM": "mistral", "Gemma2ForCausalLM": "gemma2",
                  "Gemma3ForCausalLM": "gemma3_text"}
FAMILIES = tuple(_ARCHITECTURES.values())


def family(config: Mapping[str, Any]) -> str:
    """``model_type`` where it names a family tpkit builds, else the family of ``architectures``; llama when
    neither says (a Llama-shaped config.json of any origin)."""
    model_type = config.get("model_type")
    if model_type in FAMILIES:
        return model_type
    for architecture in config.get("architectures") or ():
        if architecture in _ARCHITECTURES:
            return _ARCHITECTURES[architecture]
    return "llama"


def layer_types(config: Mapping[str, Any]) -> list[str]:
    """One of :data:`LAYER_TYPES` a layer: config.json's ``layer_types``, or derived as transformers does."""
    num_layers = config["num_hidden_layers"]
    given = config.get("layer_types")
    if given is not None:
        valid = isinstance(given, list) and all(t in LAYER_TYPES for t in given)
        if not valid or len(given) != num_layers:
            raise ValueError(f"config.json layer_types: expected a list of {num_layers} entries "
                             f"(num_hidden_layers), each one of {', '.join(LAYER_TYPES)}, got {given!r}")
        return list(given)
    kind = family(config)
    if kind == "mistral":
        sliding = [config.get("sliding_window") is not None] * num_layers
    elif kind in ("qwen2", "qwen3"):
        first = config.get("max_window_layers", 28)
        sliding = [bool(config.get("use_sliding_window")) and i >= first for i in range(num_layers)]
    elif kind == "gemma2":
        sliding = [(i + 1) % 2 == 1 for i in range(num_layers)]
    elif kind == "gemma3_text":
        pattern = config.get("sliding_window_pattern", 6)
        sliding = [(i + 1) % pattern != 0 for i in range(num_layers)]
    else:
        sliding = [False] * num_layers
    return [SLIDING if s else FULL for s in sliding]


def window_sizes(config: Mapping[str, Any]) -> list[int | None]:
    """Each layer's ``window_size`` for :class:`tpkit.attention.Attention`: ``sliding_window`` on a sliding
    layer, None (every key) on a full one, and on every layer where the config turns windows off (Qwen's
    ``use_sliding_window`` false, a Mistral's ``sliding_window`` null)."""
    window = config.get("sliding_window")
    if family(config) in ("qwen2", "qwen3") and not config.get("use_sliding_window"):
        window = None
    if config.get("use_bidirectional_attention"):
        raise ValueError("config.json use_bidirectional_attention: expected false or absent (tpkit's "
                         "decoders attend causally), got true")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"config.json sliding_window: expected an int >= 1 or null, got {window!r}")
    return [window if t == SLIDING else None for t in layer_types(config)]


def rope_parameters_by_type(config: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Each layer type's RoPE settings (:func:`tpkit.ops.rope_parameters`'s form). Gemma 3 nests one dict a
    layer type under ``rope_parameters`` (transformers 5) or gives the local layers their own base,
    ``rope_local_base_freq``, with ``rope_scaling`` for the global ones only (transformers 4); every other
    family has one set for all layers."""
    nested = config.get("rope_parameters")
    if isinstance(nested, Mapping) and set(nested) <= set(LAYER_TYPES) and nested:
        return {t: rope_parameters(config, nested.get(t) or {"rope_type": "default"}) for t in LAYER_TYPES}
    full = rope_parameters(config)
    if family(config) == "gemma3_text":
        local = {"rope_type": "default", "rope_theta": config.get("rope_local_base_freq", 10000.0)}
        return {SLIDING: rope_parameters(config, local), FULL: full}
    return {SLIDING: full, FULL: full}
