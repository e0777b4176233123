"""``save`` and ``load``: a model, its optimizer, the generator states and your own values in one
torch.distributed.checkpoint (DCP) directory, read back at any tp_size.

The directory is DCP's file system format (``dcp.save``; ``dcp.async_save`` with ``async_save=True``) of one
flat state dict:

- ``model.<logical tensor>``: :func:`~tpkit.checkpoint.sharded_state_dict`;
- ``optim.state.*``: the optimizer's state, sharded like its parameters (``tpkit.checkpoint.optimizer``);
- ``rng.*``: the default and tensor-parallel generator states (``tpkit.checkpoint.rng``);
- ``extra.<key>``: the tensors of ``extra``;
- ``tpkit.header``: JSON (as uint8) with the architecture, the tp_size it was saved at, the optimizer's
  parameter groups and ``extra``'s other values. Nothing is pickled but DCP's own ``.metadata``, which
  ``load`` unpickles through an allow-list (``tpkit.checkpoint.files``).

``load`` first reads the metadata and the header and checks everything against the model and optimizer
(names, every tensor's shape, the optimizer's groups, the data files' sizes); only when all fits does it
read, straight into the parameters.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.staging import AsyncStager

from .errors import CheckpointMismatchError
from .files import SafeReader, file_problems, open_checkpoint
from .optimizer import optimizer_problems, optimizer_targets, optimizer_values
from .rng import rng_targets, rng_values
from .state_dict import ModelLayout

__all__ = ["load", "save"]

_HEADER = "tpkit.header"
_FORMAT = "tpkit.checkpoint"
_VERSION = 1


@contextlib.contextmanager
def _dcp_quietly() -> Iterator[None]:
    """Without the warnings of DCP that ask nothing of the caller: its own calls into ShardedTensor warn that
    it is deprecated (``tpkit.checkpoint.state_dict`` says why tpkit uses it)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*deprecating ShardedTensor", category=FutureWarning)
        # In a single process DCP warns that it assumes one, as it is told (no_dist); and it warns that it
        # overwrites an existing checkpoint, as save's docstring says it does.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint", category=UserWarning)
        yield


class _Staged(AsyncStager):
    """The stager of an asynchronous save whose tensors :func:`save` has already copied into host memory
    (DCP's own staging of torch 2.13 cannot copy a ShardedTensor)."""

    _synchronize_after_execute = False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().to("cpu", copy=True)


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def _encode(header: dict[str, Any]) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8)


def _split_extra(extra: Mapping[str, Any] | None) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``extra``'s tensors (saved as they are) and its other values (JSON in the header)."""
    if extra is None:
        return {}, {}
    if not isinstance(extra, Mapping) or not all(isinstance(key, str) for key in extra):
        raise TypeError(f"save: extra must be a dict with str keys, received {type(extra).__name__}")
    tensors = {key: value.detach() for key, value in extra.items() if torch.is_tensor(value)}
    values = {key: value for key, value in extra.items() if key not in tensors}
    for key, value in values.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError) as error:
            raise TypeError(f"save: extra[{key!r}] is a {type(value).__name__}, neither a tensor nor a JSON "
                            f"value (numbers, strings, booleans, None, lists, str-keyed dicts): {error}"
                            ) from None
    return tensors, values


def save(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
         extra: Mapping[str, Any] | None = None, *, async_save: bool = False) -> Future | None:
    """Saves ``model`` (and ``optimizer``, the generator states and ``extra``) to the DCP directory ``path``.

    Call it on every rank of the tensor-parallel group, or in a single process without torch.distributed
    (tp_size 1). ``extra``: str keys; tensors (the same on every rank) and JSON values, returned by
    :func:`load`. The optimizer's state tensors are either shaped like their parameters (sharded with them)
    or 0-d (AdamW's ``step``). A checkpoint already at ``path`` is overwritten. ``async_save=True`` returns
    at once with the future of ``dcp.async_save``, once the tensors are copied to host memory (training may
    go on); wait on it (``.result()``) before the next save. Under NCCL, DCP's async save needs a CPU
    backend in the default group (``init_process_group("cpu:gloo,cuda:nccl")``).
    """
    layout = ModelLayout(model)
    # An asynchronous save writes from copies in host memory, so that training may go on meanwhile.
    stage = _to_host if async_save else torch.Tensor.detach
    values: dict[str, Any] = {f"model.{key}": value for key, value in layout.values(stage)}
    header: dict[str, Any] = {"format": _FORMAT, "version": _VERSION, "model": type(model).__name__,
                              "tp_size": layout.tp.size, "optimizer": None}
    if optimizer is not None:
        optim_values, header["optimizer"] = optimizer_values(optimizer, layout, stage)
        values.update(optim_values)
    rng, header["rng"] = rng_values(layout.tp)
    values.update(rng)
    extra_tensors, header["extra"] = _split_extra(extra)
    header["extra_tensors"] = sorted(extra_tensors)
    values.update({f"extra.{key}": stage(tensor) for key, tensor in extra_tensors.items()})
    values[_HEADER] = _encode(header)
    with _dcp_quietly():
        if async_save:
            return dcp.async_save(values, checkpoint_id=Path(path), async_stager=_Staged(),
                                  no_dist=_no_dist())
        dcp.save(values, checkpoint_id=Path(path), no_dist=_no_dist())
    return None


def _read_header(path: Path, reader: SafeReader, metadata: Metadata) -> dict[str, Any]:
    md = metadata.state_dict_metadata.get(_HEADER)
    if not isinstance(md, TensorStorageMetadata) or md.properties.dtype != torch.uint8 or len(md.size) != 1:
        raise CheckpointMismatchError(str(path), [f"{_HEADER}: missing; not a checkpoint of "
                                                  "tpkit.checkpoint.save"], [], [])
    header = torch.empty(md.size, dtype=torch.uint8)
    dcp.load({_HEADER: header}, storage_reader=reader, no_dist=_no_dist())
    decoded = json.loads(header.numpy().tobytes().decode())
    if decoded.get("format") != _FORMAT or decoded.get("version") != _VERSION:
        raise CheckpointMismatchError(str(path), [f"{_HEADER}: format {decoded.get('format')!r} version "
                                                  f"{decoded.get('version')!r}, expected {_FORMAT!r} "
                                                  f"version {_VERSION}"], [], [])
    return decoded


def _model_problems(model: nn.Module, layout: ModelLayout, header: dict[str, Any],
                    metadata: Metadata) -> tuple[list[str], list[str], list[str]]:
    problems, missing = [], []
    if header["model"] != type(model).__name__:
        problems.append(f"architecture: the checkpoint holds a {header['model']}, the model is a "
                        f"{type(model).__name__}")
    expected = {f"model.{entry.key}": entry.part.shape for entry in layout.entries}
    saved = metadata.state_dict_metadata
    for key, shape in expected.items():
        md = saved.get(key)
        if not isinstance(md, TensorStorageMetadata):
            missing.append(f"{key} {shape}")
        elif tuple(md.size) != shape:
            problems.append(f"{key}: checkpoint shape {tuple(md.size)}, model shape {shape}")
    unexpected = sorted(f"{key} {tuple(md.size)}" for key, md in saved.items()
                        if key.startswith("model.") and key not in expected)
    return problems, missing, unexpected


def load(path: str | os.PathLike, model: nn.Module,
         optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Loads a checkpoint of :func:`save` into ``model`` (and ``optimizer``) at any tp_size; restores the
    generator states (``tpkit.checkpoint.rng``: exactly at the same tp_size, the tensor-parallel streams
    reseeded at another) and returns ``extra`` (its tensors on the CPU).

    Call it on every rank, with the model (and optimizer, over the same parameters in the same groups as
    when saved) built at the tp_size to load at. Everything is checked first: a missing directory raises
    FileNotFoundError; another architecture, a tensor of another shape (named, with both shapes), tensors
    missing on either side, optimizer groups that differ or missing or truncated data files raise
    :class:`CheckpointMismatchError`, all of them in one message, before any parameter changes.
    """
    path = Path(path)
    reader, metadata = open_checkpoint(path)
    problems = file_problems(path, metadata)
    if problems:
        raise CheckpointMismatchError(str(path), problems, [], [])
    with _dcp_quietly():
        header = _read_header(path, reader, metadata)
        layout = ModelLayout(model)
        problems, missing, unexpected = _model_problems(model, layout, header, metadata)
        if optimizer is not None:
            problems += optimizer_problems(optimizer, layout, header["optimizer"], metadata)
        if problems or missing or unexpected:
            raise CheckpointMismatchError(str(path), problems, missing, unexpected)

        targets: dict[str, Any] = {f"model.{key}": value for key, value in layout.values()}
        finish_optimizer = None
        if optimizer is not None:
            optim_targets, finish_optimizer = optimizer_targets(optimizer, layout, header["optimizer"],
                                                                metadata)
            targets.update(optim_targets)
        rng, finish_rng = rng_targets(header["rng"], header["tp_size"], layout.tp)
        targets.update(rng)
        extra = dict(header["extra"])
        for key in header["extra_tensors"]:
            md = metadata.state_dict_metadata[f"extra.{key}"]
            extra[key] = targets[f"extra.{key}"] = torch.empty(md.size, dtype=md.properties.dtype)
        dcp.load(targets, storage_reader=reader, no_dist=_no_dist())
    if finish_optimizer is not None:
        finish_optimizer()
    finish_rng()
    return extra
