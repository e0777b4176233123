"""Checks of a reference model's config.json, before anything is allocated.

A config read from a file can hold anything: a key missing, ``"12"`` where an int belongs, a dropout of
1.5, ``hidden_size: 10**9``. Left to the constructor, these fail as a bare ``KeyError``, as an allocator's
error naming no key, after minutes of building (``num_hidden_layers: 10**6``), or not at all (a dropout
rate torch accepts silently). :func:`check_config` reports every problem at once, each naming the key,
what it expects and what it got, then estimates this rank's parameter bytes and compares them with the
memory at hand. First of all it compares the config, dtype and device type across the tensor-parallel
ranks (:func:`~tpkit.parallel_layers.check_ranks_agree`): ranks built differently would otherwise abort
inside the backend at the first collective, or compute garbage.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from tpkit._memory import available_bytes
from tpkit.models.activations import _ACTIVATIONS
from tpkit.models.layer_types import rope_parameters_by_type
from tpkit.ops.rotary import check_rope_parameters
from tpkit.parallel_layers import TPGroup, check_ranks_agree, get_tp_group

# Every size is an int32 on the kernels' side (and a tensor dimension): at most this.
MAX_SIZE = 2**31 - 1
# Building a layer of modules costs tens of milliseconds on a CPU, whatever its size: no model has more.
MAX_LAYERS = 4096
# What the Python objects of one layer's modules and parameters take, besides the parameters.
_LAYER_OVERHEAD_BYTES = 64 * 1024

# A key's check: the problem with a (present, non-null) value, or None.
Check = Callable[[Any], str | None]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def size(limit: int = MAX_SIZE) -> Check:
    return lambda v: None if _is_int(v) and 1 <= v <= limit else f"expected an int in [1, {limit}]"


def count(v: Any) -> str | None:
    return None if _is_int(v) and 0 <= v <= MAX_SIZE else f"expected an int in [0, {MAX_SIZE}]"


def fraction(v: Any) -> str | None:
    return None if _is_number(v) and 0 <= v < 1 else "expected a probability in [0, 1)"


def positive(v: Any) -> str | None:
    return None if _is_number(v) and math.isfinite(v) and v > 0 else "expected a finite number > 0"


def flag(v: Any) -> str | None:
    return None if isinstance(v, bool) else "expected true or false"


def token_id(v: Any) -> str | None:
    return None if _is_int(v) and 0 <= v <= MAX_SIZE else "expected a token id (an int >= 0)"


def token_ids(v: Any) -> str | None:
    valid = token_id(v) is None or (isinstance(v, list) and v and all(token_id(t) is None for t in v))
    return None if valid else "expected a token id (an int >= 0) or a non-empty list of them"


def activation(v: Any) -> str | None:
    return None if v in _ACTIVATIONS else f"expected one of {', '.join(sorted(_ACTIVATIONS))}"


# (key, required, check) of each reference model's config.json.
Schema = tuple[tuple[str, bool, Check], ...]

LLAMA: Schema = (
    ("vocab_size", True, size()), ("hidden_size", True, size()), ("intermediate_size", True, size()),
    ("num_hidden_layers", True, size(MAX_LAYERS)), ("num_attention_heads", True, size()),
    ("max_position_embeddings", True, size()), ("num_key_value_heads", False, size()),
    ("head_dim", False, size()), ("rms_norm_eps", False, positive), ("attention_dropout", False, fraction),
    ("tie_word_embeddings", False, flag), ("attention_bias", False, flag), ("mlp_bias", False, flag),
    ("hidden_act", False, activation), ("eos_token_id", False, token_ids),
    ("sliding_window", False, size()), ("use_sliding_window", False, flag),
    ("max_window_layers", False, count),
)
_LLAMA_ATTENTION = tuple(entry for entry in LLAMA if entry[0] != "hidden_act")
GEMMA: Schema = (
    *_LLAMA_ATTENTION, ("hidden_activation", False, activation), ("query_pre_attn_scalar", False, positive),
    ("attn_logit_softcapping", False, positive), ("final_logit_softcapping", False, positive),
    ("sliding_window_pattern", False, size(MAX_LAYERS)), ("rope_local_base_freq", False, positive),
)
# The decoder-only models built from Llama's layers: their sizes and RoPE settings are checked alike.
_DECODERS = ("LlamaForCausalLM", "GemmaForCausalLM")
GPT_BIGCODE: Schema = (
    ("vocab_size", True, size()), ("n_embd", True, size()), ("n_layer", True, size(MAX_LAYERS)),
    ("n_head", True, size()), ("n_positions", True, size()), ("n_inner", False, size()),
    ("multi_query", False, flag), ("layer_norm_epsilon", False, positive),
    ("scale_attn_weights", False, flag),
    ("attn_pdrop", False, fraction), ("resid_pdrop", False, fraction), ("embd_pdrop", False, fraction),
    ("tie_word_embeddings", False, flag), ("activation_function", False, activation),
    ("eos_token_id", False, token_ids),
)
BART: Schema = (
    ("vocab_size", True, size()), ("d_model", True, size()), ("encoder_layers", True, size(MAX_LAYERS)),
    ("decoder_layers", True, size(MAX_LAYERS)), ("encoder_attention_heads", True, size()),
    ("decoder_attention_heads", True, size()), ("encoder_ffn_dim", True, size()),
    ("decoder_ffn_dim", True, size()), ("max_position_embeddings", True, size(MAX_SIZE - 2)),
    ("decoder_start_token_id", True, token_id), ("forced_bos_token_id", False, token_id),
    ("forced_eos_token_id", False, token_id), ("eos_token_id", False, token_ids),
    ("scale_embedding", False, flag), ("tie_word_embeddings", False, flag), ("dropout", False, fraction),
    ("attention_dropout", False, fraction), ("activation_dropout", False, fraction),
    ("encoder_layerdrop", False, fraction), ("decoder_layerdrop", False, fraction),
    ("activation_function", False, activation),
)


def check_config(model: str, config: Any, schema: Schema, *, dtype: torch.dtype | None,
                 device: torch.device | str | None, tp_group: Any, sequence_parallel: bool,
                 vocab_keys: tuple[str, ...] = ()) -> None:
    """Raises before ``model`` (a class name, for messages) allocates anything from ``config``: ValueError
    listing every key that is missing or holds a wrong value (``vocab_keys``: token ids that must also lie
    below ``vocab_size``), or whose parameters would not fit in the memory available on ``device``; on
    every rank alike when the ranks were given different configs, dtypes or devices."""
    if not isinstance(config, Mapping):
        raise TypeError(f"{model}: config: expected a mapping (a config.json's dict), got "
                        f"{type(config).__name__}")
    dtype = dtype or torch.get_default_dtype()
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{model}: dtype: expected a floating-point torch.dtype, got {dtype!r}")
    device = torch.device(device) if device is not None else torch.get_default_device()
    check_ranks_agree(model, tp_group, config=dict(config), dtype=str(dtype), device_type=device.type,
                      sequence_parallel=sequence_parallel)
    tp_size = _tp_size(tp_group)
    problems = _problems(config, schema, vocab_keys)
    if problems:
        raise ValueError(f"{model}: config.json: " + "; ".join(problems))
    if model in _DECODERS:
        for params in rope_parameters_by_type(config).values():
            check_rope_parameters(params)
    needed = (_parameter_numel(model, config) * dtype.itemsize // tp_size + _buffer_bytes(model, config)
              + _layer_count(config) * _LAYER_OVERHEAD_BYTES)
    available = available_bytes(device)
    if available is not None and needed > available:
        sizes = ", ".join(f"{key}={config[key]}" for key, required, check in schema
                          if key in config and check is not fraction and _is_int(config[key]))
        raise ValueError(f"{model}: config.json ({sizes}) needs about {needed / 1e9:.3g} GB for this rank's "
                         f"parameters in {dtype} (tp_size {tp_size}), more than the {available / 1e9:.3g} GB "
                         f"of memory available on {device}")


def _tp_size(tp_group: Any) -> int:
    """The size of a layer's ``tp_group=`` argument (a TPGroup, ProcessGroup or 1-D DeviceMesh; None: the
    group of ``init_tensor_parallel``, which the agreement check has found)."""
    if tp_group is None:
        try:
            return get_tp_group().size
        except RuntimeError:  # nothing initialised: one process
            return 1
    if isinstance(tp_group, TPGroup):
        return tp_group.size
    if isinstance(tp_group, dist.ProcessGroup):
        return dist.get_world_size(tp_group)
    return tp_group.size()


def _problems(config: Mapping[str, Any], schema: Schema, vocab_keys: tuple[str, ...]) -> list[str]:
    problems = []
    for key, required, check in schema:
        value = config.get(key)
        if value is None:
            if required:
                problems.append(f"{key}: missing (required)")
            continue
        problem = check(value)
        if problem is not None:
            problems.append(f"{key}: {problem}, got {value!r}")
    if problems:
        return problems
    vocab_size = config["vocab_size"]
    for key in vocab_keys:
        ids = config.get(key)
        for token in ids if isinstance(ids, list) else [] if ids is None else [ids]:
            if token >= vocab_size:
                problems.append(f"{key}: expected token ids below vocab_size={vocab_size}, got {ids!r}")
                break
    widths = (("num_attention_heads", "hidden_size"), ("n_head", "n_embd"),
              ("encoder_attention_heads", "d_model"), ("decoder_attention_heads", "d_model"))
    keys = {key for key, _, _ in schema}
    for heads_key, width_key in widths:
        if heads_key in keys and not config.get("head_dim") and config[width_key] % config[heads_key]:
            problems.append(f"{heads_key}: expected a divisor of {width_key}={config[width_key]}, got "
                            f"{config[heads_key]}")
    kv_heads = config.get("num_key_value_heads") if "num_key_value_heads" in keys else None
    if kv_heads and config["num_attention_heads"] % kv_heads:
        problems.append(f"num_key_value_heads: expected a divisor of num_attention_heads="
                        f"{config['num_attention_heads']}, got {kv_heads}")
    return problems


def _layer_count(config: Mapping[str, Any]) -> int:
    return sum(config.get(key) or 0 for key in ("num_hidden_layers", "n_layer", "encoder_layers",
                                                 "decoder_layers"))


def _parameter_numel(model: str, c: Mapping[str, Any]) -> int:
    """The parameters of the whole model (biases and norms included where they are of any size)."""
    if model in _DECODERS:
        hidden, heads = c["hidden_size"], c["num_attention_heads"]
        head_size = c.get("head_dim") or hidden // heads
        q, kv = heads * head_size, (c.get("num_key_value_heads") or heads) * head_size
        layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * c["intermediate_size"] + 2 * hidden
        heads_out = 1 if c.get("tie_word_embeddings", False) else 2
        return heads_out * c["vocab_size"] * hidden + c["num_hidden_layers"] * layer + hidden
    if model == "GPTBigCodeForCausalLM":
        hidden = c["n_embd"]
        kv = hidden // c["n_head"] if c.get("multi_query", True) else hidden
        inner = c.get("n_inner") or 4 * hidden
        layer = hidden * (hidden + 2 * kv) + hidden * hidden + 2 * hidden * inner + 8 * hidden
        return (c["vocab_size"] + c["n_positions"]) * hidden + c["n_layer"] * layer
    d = c["d_model"]
    encoder = c["encoder_layers"] * (4 * d * d + 2 * d * c["encoder_ffn_dim"] + 8 * d)
    decoder = c["decoder_layers"] * (8 * d * d + 2 * d * c["decoder_ffn_dim"] + 12 * d)
    return (c["vocab_size"] * (d + 1) + 2 * (c["max_position_embeddings"] + 2) * d + encoder + decoder)


def _buffer_bytes(model: str, c: Mapping[str, Any]) -> int:
    """Llama's RoPE tables: float32 cos and sin, half a head wide each, for every position (and the
    frequencies they are computed from, as large)."""
    if model not in _DECODERS:
        return 0
    head_size = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return 2 * c["max_position_embeddings"] * head_size * 4
