"""``iter_weights``: every tensor of a checkpoint as a lazy handle, after checking the files hold together."""

from __future__ import annotations

import os
import zipfile
from collections.abc import Iterator
from pathlib import Path

import torch

from .errors import CheckpointError
from .lazy_tensor import LazyTensor, _InMemoryTensor, _SafetensorsTensor
from .safetensors_header import TensorEntry, read_header
from .weight_files import find_weight_files, is_safetensors


def iter_weights(path: str | os.PathLike) -> Iterator[tuple[str, LazyTensor]]:
    """Yields ``(name, handle)`` for every tensor of the checkpoint at ``path``.

    ``path`` is a checkpoint directory (``model.safetensors``, sharded through
    ``model.safetensors.index.json``, or PyTorch ``.bin``/``.pt`` files when there are no safetensors) or a
    single weight file. Handles read nothing until sliced (:class:`LazyTensor`), so this works before or
    without ``init_tensor_parallel`` and costs only the headers.

    Safetensors headers are all read and checked when this is called, before anything is yielded: a missing
    path, a directory without weight files, a truncated or corrupt file, an index that points outside the
    directory or at tensors its files lack each raise a :class:`CheckpointError` naming the file.
    ``.bin``/``.pt`` files are opened one at a time as iteration reaches them, only through
    ``torch.load(weights_only=True)`` (memory-mapped for the zip format), never unpickling arbitrary objects.
    """
    files, placement = find_weight_files(Path(path).expanduser())
    kinds = {is_safetensors(f) for f in files}
    if kinds == {True}:
        headers = {file: read_header(file) for file in files}
        _check_names(headers, placement)
        return _iter_safetensors(headers)
    if kinds == {False}:
        return _iter_torch_files(files)
    raise CheckpointError(f"{path}: the index mixes safetensors and PyTorch files: {[f.name for f in files]}")


def _check_names(headers: dict[Path, list[TensorEntry]], placement: dict[str, Path] | None) -> None:
    where: dict[str, Path] = {}
    for file, entries in headers.items():
        for entry in entries:
            if entry.name in where:
                raise CheckpointError(f"tensor {entry.name!r} is stored twice: in {where[entry.name]} and "
                                      f"{file}")
            where[entry.name] = file
    for name, file in (placement or {}).items():
        if where.get(name) != file:
            found = f"it is in {where[name].name}" if name in where else "no file has it"
            raise CheckpointError(f"the index puts tensor {name!r} in {file.name}, but {found}")


def _iter_safetensors(headers: dict[Path, list[TensorEntry]]) -> Iterator[tuple[str, LazyTensor]]:
    for file, entries in headers.items():
        for e in entries:
            yield e.name, _SafetensorsTensor(e.name, e.shape, e.dtype, file, e.data_start)


def _iter_torch_files(files: list[Path]) -> Iterator[tuple[str, LazyTensor]]:
    seen: dict[str, Path] = {}
    for file in files:
        for name, tensor in _load_torch_file(file).items():
            if name in seen:
                raise CheckpointError(f"tensor {name!r} is stored twice: in {seen[name]} and {file}")
            seen[name] = file
            yield name, _InMemoryTensor(name, tensor, file)


def _load_torch_file(file: Path) -> dict[str, torch.Tensor]:
    # Only the zip format (torch.save since 1.6) can be memory-mapped; legacy files are read whole.
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(file))
    except Exception as error:  # noqa: BLE001 - any failure to load is this file's fault: name it
        raise CheckpointError(f"{file}: cannot be loaded with torch.load(weights_only=True): "
                              f"{error}") from error
    if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                              for k, v in state.items()):
        raise CheckpointError(f"{file}: expected a flat dict of tensor name -> tensor, received "
                              f"{type(state).__name__} with other contents")
    return state
