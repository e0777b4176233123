"""A DCP checkpoint directory, read without trusting it: its metadata unpickled by an allow-list, its files
checked against that metadata before anything is loaded.

DCP's file system format keeps the checkpoint's layout in ``.metadata``, a pickle, which
``FileSystemReader`` loads with ``pickle.load``: a crafted file could run code. :class:`SafeReader` loads it
through an unpickler that builds only DCP's own metadata classes, ``torch.Size``, dtypes, layouts and paths,
and refuses anything else. The tensors themselves DCP reads with ``torch.load(weights_only=True)``; tpkit's
checkpoints hold no other objects (what is not a tensor travels as JSON, ``tpkit.checkpoint.save_load``).
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path, PosixPath, PurePosixPath, PureWindowsPath, WindowsPath
from typing import Any

import torch
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_METADATA_FILE = ".metadata"
_ALLOWED = {
    ("torch", "Size"): torch.Size,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    **{("pathlib", cls.__name__): cls for cls in (PosixPath, WindowsPath, PurePosixPath, PureWindowsPath)},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.memory_format)):
            return getattr(torch, name)
        if module == dcp_metadata.__name__ and isinstance(getattr(dcp_metadata, name, None), type):
            return getattr(dcp_metadata, name)
        raise pickle.UnpicklingError(f"{_METADATA_FILE} refers to {module}.{name}, which DCP's checkpoint "
                                     "metadata does not hold: refusing to load it")


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose ``read_metadata`` unpickles ``.metadata`` through the allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as metadata_file:
            metadata = _MetadataUnpickler(metadata_file).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{path} holds a {type(metadata).__name__}, not DCP's Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def open_checkpoint(path: str | os.PathLike) -> tuple[SafeReader, Metadata]:
    """The reader and metadata of the DCP checkpoint at ``path``; FileNotFoundError naming what is missing."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint at {path}: not a directory")
    if not (path / _METADATA_FILE).is_file():
        raise FileNotFoundError(f"no checkpoint at {path}: it has no {_METADATA_FILE} file (a "
                                "torch.distributed.checkpoint directory has one once its save is complete)")
    reader = SafeReader(path)
    return reader, reader.read_metadata()


def file_problems(path: str | os.PathLike, metadata: Metadata) -> list[str]:
    """The data files ``metadata`` refers to that are missing or shorter than the bytes it places there."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    problems = []
    for name, size in sorted(needed.items()):
        file = Path(path) / name
        if not file.is_file():
            problems.append(f"{file}: missing (the checkpoint's metadata places tensors there)")
        elif file.stat().st_size < size:
            problems.append(f"{file}: {file.stat().st_size} bytes, the metadata places {size}: truncated")
    return problems
