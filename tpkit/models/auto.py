"""``from_pretrained``: a HuggingFace checkpoint (a local directory or a hub id) into this rank's shard.

The class comes from config.json's ``architectures``. config.json is read as JSON, so checkpoints written
by transformers 4 (``torch_dtype``, ``rope_theta``/``rope_scaling``) and 5 (``dtype``, ``rope_parameters``)
both load without transformers installed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tpkit.loaders import CheckpointError, checkpoint_file, iter_weights, resolve_checkpoint
from tpkit.models.bart import BartForConditionalGeneration
from tpkit.models.gemma import GemmaForCausalLM
from tpkit.models.generation import PagedLM
from tpkit.models.gpt_bigcode import GPTBigCodeForCausalLM
from tpkit.models.llama import LlamaForCausalLM
from tpkit.models.prompts import parse_eos_token_ids
from tpkit.models.quantization import quant_method_from_config
from tpkit.parallel_layers import (
    TPGroup,
    get_tp_group,
    process_weights_after_loading,
    set_overlap_communication,
    skip_init,
)

MODEL_CLASSES: dict[str, type[PagedLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "GPTBigCodeForCausalLM": GPTBigCodeForCausalLM,
    "BartForConditionalGeneration": BartForConditionalGeneration,
}


def model_class(config: dict[str, Any]) -> type[PagedLM]:
    """The tpkit class for a config.json's ``architectures``; a ValueError lists the supported ones."""
    architectures = config.get("architectures") or []
    for architecture in architectures:
        if architecture in MODEL_CLASSES:
            return MODEL_CLASSES[architecture]
    raise ValueError(f"config.json architectures {architectures} has no supported architecture; supported: "
                     f"{', '.join(MODEL_CLASSES)}")


def from_pretrained(name_or_path: str | os.PathLike, *, dtype: torch.dtype | str | None = None,
                    device: torch.device | str | None = None, tp_group: Any = None,
                    revision: str | None = None, cache_dir: str | os.PathLike | None = None,
                    sequence_parallel: bool = False, overlap_communication: bool = False,
                    kv_cache_dtype: torch.dtype | str | None = None,
                    quantization: str | None = None) -> PagedLM:
    """This rank's shard of a HuggingFace checkpoint, built on ``device`` and loaded, in eval mode.

    dtype: default the checkpoint's (config.json ``dtype`` / ``torch_dtype``), else float32.
    device: default the current CUDA device when the tensor-parallel group runs on NCCL or there is a GPU
    and no group over gloo, else the CPU. tp_group: a TPGroup or ProcessGroup; default the group of
    ``init_tensor_parallel`` (tp_size 1 when nothing is initialised). Every rank must call it.
    sequence_parallel: for training, the model with its residual stream split along the sequence
    (``tpkit.models.sequence_parallel``); such a model does not generate. overlap_communication: with it,
    its linear layers' collectives overlapped with their products (``tpkit.parallel_layers.overlap``).
    EOS ids (and BART's decoder start and forced BOS/EOS tokens) come from generation_config.json, else
    config.json.
    kv_cache_dtype: the KV caches' dtype (``model.kv_cache_dtype``): None for the model's dtype (or float8
    E4M3 where ``quantization_config`` has a float 8-bit ``kv_cache_scheme``), ``torch.float8_e4m3fn`` /
    ``"fp8"`` / ``"fp8_e4m3"``, or ``torch.float8_e5m2`` / ``"fp8_e5m2"``. A float8 cache's scales come from
    the checkpoint's ``k_scale``/``v_scale`` tensors where it has them, else 1.0
    (:func:`tpkit.attention.calibrated_kv_scales` computes some; set them in ``model.kv_cache_scales``).
    Float8 weights load as the checkpoint's ``quantization_config`` says (compressed-tensors
    ``float-quantized``, ``fbgemm_fp8``, block-wise ``fp8``: :mod:`tpkit.models.quantization`);
    ``quantization="fp8"`` quantizes a high-precision checkpoint's linear layers per channel as it loads.
    Llama-family models only.
    """
    if overlap_communication and not sequence_parallel:
        raise ValueError("from_pretrained: overlap_communication=True overlaps sequence parallelism's "
                         "collectives: expected sequence_parallel=True, received False")
    if dtype is not None and not isinstance(dtype, (torch.dtype, str)):
        raise TypeError(f"dtype must be a torch.dtype, a dtype name or None, got {type(dtype).__name__}")
    path = resolve_checkpoint(name_or_path, revision=revision, cache_dir=cache_dir)
    config = _read_json(path, "config.json")
    if config is None:
        raise CheckpointError(f"{path} has no config.json")
    cls = model_class(config)
    dtype = _as_dtype(dtype if dtype is not None else config.get("dtype") or config.get("torch_dtype"))
    device = torch.device(device) if device is not None else _default_device(tp_group)
    quant_method = quant_method_from_config(config, quantization, str(path / "config.json"))
    extra = {}
    if quant_method is not None:
        if cls is not LlamaForCausalLM:
            raise ValueError(f"from_pretrained: float8 weights (quantization_config or quantization=) are "
                             f"supported for Llama-family models, got {cls.__name__}")
        extra["quant_method"] = quant_method
    # Every parameter is loaded below (strictly: one left out is an error), so random draws would be wasted.
    with skip_init():
        model = cls(config, dtype=dtype, device=device, tp_group=tp_group,
                    sequence_parallel=sequence_parallel, **extra)
    if overlap_communication:
        set_overlap_communication(model)
    generation_config = _read_json(path, "generation_config.json") or {}
    if generation_config.get("eos_token_id") is not None:
        model.eos_token_ids = parse_eos_token_ids(generation_config["eos_token_id"])
    if isinstance(model, BartForConditionalGeneration):
        start = generation_config.get("decoder_start_token_id")
        if start is not None:
            if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < model.vocab_size:
                raise CheckpointError(f"{path / 'generation_config.json'}: decoder_start_token_id: expected "
                                      f"a token id in [0, {model.vocab_size}), got {start!r}")
            model.decoder_start_token_id = start
        for key in ("forced_bos_token_id", "forced_eos_token_id"):
            if key in generation_config:  # null there turns config.json's off, as in transformers
                setattr(model, key, generation_config[key])
    model.kv_cache_dtype = _kv_cache_dtype(kv_cache_dtype, config)
    model.load_weights(iter_weights(path))
    process_weights_after_loading(model)
    return model.eval()


_KV_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                    "fp8_e5m2": torch.float8_e5m2}


def _kv_cache_dtype(value: torch.dtype | str | None, config: dict[str, Any]) -> torch.dtype | None:
    """The KV caches' dtype from_pretrained was asked for, or the checkpoint's float8 one (None: the
    model's)."""
    if value is None:
        scheme = (config.get("quantization_config") or {}).get("kv_cache_scheme") or {}
        is_fp8 = scheme.get("type") == "float" and scheme.get("num_bits") == 8
        return torch.float8_e4m3fn if is_fp8 else None
    if isinstance(value, str) and value in _KV_CACHE_DTYPES:
        return _KV_CACHE_DTYPES[value]
    if value in (torch.float8_e4m3fn, torch.float8_e5m2):
        return value
    raise ValueError(f"from_pretrained: kv_cache_dtype: expected None, {list(_KV_CACHE_DTYPES)}, "
                     f"torch.float8_e4m3fn or torch.float8_e5m2, got {value!r}")


def _read_json(path: Path, name: str) -> dict[str, Any] | None:
    file = checkpoint_file(path, name)
    if file is None:
        return None
    try:
        value = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{file} is not valid JSON: {error}") from error
    if not isinstance(value, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(value).__name__}")
    return value


def _as_dtype(value: torch.dtype | str | None) -> torch.dtype:
    if value is None:
        return torch.float32
    if isinstance(value, torch.dtype):
        dtype = value
    else:
        dtype = getattr(torch, value.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch dtype, got {value!r}")
    return dtype


def _default_device(tp_group: Any) -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if isinstance(tp_group, TPGroup):
        backend = tp_group.backend
    elif tp_group is not None:
        backend = dist.get_backend(tp_group)
    else:
        try:
            backend = get_tp_group().backend
        except RuntimeError:
            backend = None
    return torch.device("cpu") if backend == "gloo" else torch.device("cuda", torch.cuda.current_device())
