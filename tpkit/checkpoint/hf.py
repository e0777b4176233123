"""``export_hf``: a tensor-parallel model gathered into a HuggingFace directory (safetensors shards, their
index, config.json) that ``transformers`` and ``tpkit.models.from_pretrained`` load at any tp_size.

Every rank sends its rows of each logical tensor (``tpkit.checkpoint.state_dict``) to tp rank 0, one tensor
at a time, which assembles the full tensor and writes the shards; so no rank ever holds more than one full
tensor besides the shard it is filling. Names then go back to the checkpoint's:

1. a part of a stacked parameter takes the checkpoint name of the model's ``stacked_params_mapping``
   (``(param_name, checkpoint_name, loaded_shard_id)``, the triples its loading reads): ``qkv_proj.weight:q``
   -> ``q_proj.weight``; a stacked parameter no triple names is stored fused, its parts concatenated in
   order (what its weight loader takes with ``loaded_shard_id=None``);
2. the model's ``export_weights(pairs)``, where it has one, renames the rest (prefixes, a bias kept apart)
   as the inverse of its ``load_weights``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from tpkit.parallel_layers import TPGroup

from .state_dict import ModelLayout, _Entry, collective_device

__all__ = ["export_hf"]

_INDEX = "model.safetensors.index.json"


def _gather(entry: _Entry, layout: torch.Tensor, tp: TPGroup, device: torch.device) -> torch.Tensor | None:
    """The full logical tensor of ``entry`` on tp rank 0 (on the CPU), None elsewhere. ``layout``:
    ``[tp_size, 2]`` every rank's (start, length) of it."""
    local = entry.part.local(entry.param.detach())
    if entry.part.dim is None or tp.size == 1:
        return local.to("cpu", copy=True) if tp.rank == 0 else None
    dim = entry.part.dim
    rows = int(layout[:, 1].max())
    # One size on every rank: this rank's rows, then padding.
    padded = local.new_zeros(*local.shape[:dim], rows, *local.shape[dim + 1:]).to(device)
    padded.narrow(dim, 0, entry.part.length).copy_(local)
    received = [torch.empty_like(padded) for _ in range(tp.size)] if tp.rank == 0 else None
    dist.gather(padded, received, dst=dist.get_global_rank(tp.group, 0), group=tp.group)
    if tp.rank != 0:
        return None
    full = torch.empty(entry.part.shape, dtype=local.dtype)
    for (start, length), piece in zip(layout.tolist(), received, strict=True):
        full.narrow(dim, start, length).copy_(piece.narrow(dim, 0, length))
    return full


def _checkpoint_names(entries: list[_Entry], tensors: Iterable[torch.Tensor | None],
                      mapping: Iterable[tuple[str, str, Any]]) -> Iterator[tuple[str, torch.Tensor | None]]:
    """(checkpoint name, tensor) of each logical tensor, the stacked ones split by ``mapping`` or fused."""
    mapping = list(mapping)
    pending: list[torch.Tensor | None] = []
    for i, (entry, tensor) in enumerate(zip(entries, tensors, strict=True)):
        if entry.part.shard_id is None:
            yield entry.name, tensor
            continue
        components = entry.name.split(".")
        renamed = next((".".join(checkpoint if c == param else c for c in components)
                        for param, checkpoint, shard_id in mapping
                        if param in components and shard_id == entry.part.shard_id), None)
        if renamed is not None:
            yield renamed, tensor
            continue
        pending.append(tensor)
        if i + 1 == len(entries) or entries[i + 1].name != entry.name:  # the last part: store them fused
            yield entry.name, None if pending[0] is None else torch.cat(pending, dim=entry.part.dim)
            pending = []


def _max_shard_bytes(max_shard_size: int | str) -> int:
    if isinstance(max_shard_size, int) and max_shard_size > 0:
        return max_shard_size
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    text = str(max_shard_size).strip().upper()
    for unit, scale in sorted(units.items(), key=lambda item: -len(item[0])):
        if text.endswith(unit) and text[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(text[: -len(unit)]) * scale)
    raise ValueError(f"export_hf: max_shard_size must be a positive number of bytes or a size such as "
                     f"'5GB', received {max_shard_size!r}")


def _write_shards(path: Path, weights: Iterable[tuple[str, torch.Tensor]], max_bytes: int,
                  dtype: torch.dtype | None) -> None:
    """Writes ``weights`` into safetensors shards of at most ``max_bytes`` (a larger tensor alone) and the
    index, named as ``save_pretrained`` names them."""
    shards: list[list[str]] = []
    weight_map: dict[str, str] = {}
    current: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal current, size
        if current:
            shards.append(list(current))
            save_file(current, str(path / f"shard-{len(shards):05d}.tmp"), metadata={"format": "pt"})
            current, size = {}, 0

    for name, tensor in weights:
        if name in weight_map or name in current:
            raise ValueError(f"export_hf: two tensors named {name}")
        tensor = (tensor if dtype is None else tensor.to(dtype)).contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_bytes:
            flush()
        current[name] = tensor
        size += nbytes
        total += nbytes
    flush()
    for i, names in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        os.replace(path / f"shard-{i:05d}.tmp", path / file)
        weight_map.update(dict.fromkeys(names, file))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / _INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _config_dict(config: Mapping[str, Any] | Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    if callable(getattr(config, "to_dict", None)):  # a transformers PretrainedConfig
        return config.to_dict()
    raise TypeError(f"export_hf: config must be a config.json dict or a transformers config, received "
                    f"{type(config).__name__}")


def export_hf(path: str | os.PathLike, model: nn.Module, config: Mapping[str, Any] | Any, *,
              dtype: torch.dtype | None = None, max_shard_size: int | str = "5GB") -> None:
    """Writes ``model`` as a HuggingFace checkpoint directory at ``path``: safetensors shards
    (``model-0000i-of-0000n.safetensors``) of at most ``max_shard_size`` each, their index
    ``model.safetensors.index.json`` and ``config`` (a config.json dict, e.g. ``model.config``, or a
    transformers config) as config.json.

    Call it on every rank of the tensor-parallel group (or in a single process); tp rank 0 writes, and
    every rank returns once the directory is complete. ``dtype``: cast every tensor (default: as they are).
    The names are the checkpoint's (module docstring), so ``from_pretrained(path)`` loads the model back at
    any tp_size, and transformers loads it. A config without ``architectures`` gets the model's class name.
    """
    config = _config_dict(config)
    # from_pretrained picks the class from it; tpkit's model classes bear transformers' architecture names.
    config.setdefault("architectures", [type(model).__name__])
    max_bytes = _max_shard_bytes(max_shard_size)
    layout = ModelLayout(model)
    tp, entries, device = layout.tp, layout.entries, collective_device(layout.tp)
    path = Path(path)
    if tp.rank == 0:
        path.mkdir(parents=True, exist_ok=True)
    tensors = (_gather(entry, None if layout.rows is None else layout.rows[:, i], tp, device)
               for i, entry in enumerate(entries))
    named = _checkpoint_names(entries, tensors, getattr(model, "stacked_params_mapping", ()))
    export = getattr(model, "export_weights", None)
    if tp.rank == 0:
        weights = export(named) if callable(export) else named
        _write_shards(path, weights, max_bytes, dtype)
        (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    else:
        for _ in named:  # this rank's part of every gather
            pass
    if tp.size > 1:
        dist.barrier(group=tp.group)
