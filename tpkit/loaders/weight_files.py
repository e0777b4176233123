"""Which files of a checkpoint hold its weights: one rule for a local directory and for a hub listing.

Safetensors first: ``model.safetensors.index.json`` (sharded), ``model.safetensors``, any other top-level
``*.safetensors``. Only without those, PyTorch pickles loaded with ``weights_only=True``:
``pytorch_model.bin.index.json``, ``pytorch_model.bin``, any top-level ``*.bin``, ``*.pt`` or ``*.pth``.

Every file read from a checkpoint directory must resolve (symbolic links followed) to a file inside it, or,
for a snapshot of the Hugging Face hub cache (``models--org--name/snapshots/<commit>``, whose files are
links into ``models--org--name/blobs``), inside that model's storage directory: a link to any other file is
refused, as is an index entry that names one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

from .errors import CheckpointError, CheckpointNotFoundError

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_FILE = "model.safetensors"
TORCH_INDEX = "pytorch_model.bin.index.json"
TORCH_FILE = "pytorch_model.bin"
TORCH_SUFFIXES = (".bin", ".pt", ".pth")

SEARCHED = (f"{SAFETENSORS_INDEX}, {SAFETENSORS_FILE}, *.safetensors, {TORCH_INDEX}, {TORCH_FILE}, "
            f"{', '.join('*' + s for s in TORCH_SUFFIXES)}")


@dataclass(frozen=True)
class WeightFileChoice:
    """``index``: the index file when there is one (the weight files are then listed in it), else None;
    ``files``: the weight files when there is no index."""

    index: str | None
    files: tuple[str, ...]


def choose_weight_files(names: Iterable[str]) -> WeightFileChoice | None:
    """Picks the weight files among the top-level file names of a checkpoint; None when it has none."""
    top = sorted(n for n in names if "/" not in n)
    for index, single, suffixes in ((SAFETENSORS_INDEX, SAFETENSORS_FILE, (".safetensors",)),
                                    (TORCH_INDEX, TORCH_FILE, TORCH_SUFFIXES)):
        if index in top:
            return WeightFileChoice(index, ())
        if single in top:
            return WeightFileChoice(None, (single,))
        others = tuple(n for n in top if n.endswith(suffixes))
        if others:
            return WeightFileChoice(None, others)
    return None


def _allowed_root(directory: Path) -> Path:
    """Where the files of checkpoint ``directory`` may resolve to: itself, or a hub snapshot's storage."""
    resolved = directory.resolve()
    snapshots = resolved.parent
    if snapshots.name == "snapshots" and snapshots.parent.name.startswith("models--"):
        return snapshots.parent
    return resolved


def check_inside(file: Path, directory: Path) -> Path:
    """``file`` of checkpoint ``directory``, refused (CheckpointError) where it resolves outside the files
    the checkpoint may use (module docstring)."""
    root = _allowed_root(directory)
    target = file.resolve()
    if not target.is_relative_to(root):
        raise CheckpointError(f"{file} resolves to {target}, outside the checkpoint directory {root}: a "
                              "checkpoint's files, and the links among them, must stay inside it")
    return file


def checkpoint_file(directory: Path, name: str) -> Path | None:
    """The file ``name`` of checkpoint ``directory`` (config.json, say), checked as the weight files are;
    None where there is none."""
    file = directory / name
    return check_inside(file, directory) if file.is_file() else None


def is_safetensors(file: Path | str) -> bool:
    return str(file).endswith(".safetensors")


def read_index(index_file: Path) -> dict[str, str]:
    """The index's ``weight_map`` (tensor name -> file relative to the index's directory), checked to stay
    inside that directory."""
    try:
        index = json.loads(index_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{index_file}: cannot read the index: {error}") from error
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_file}: expected a non-empty 'weight_map' object mapping tensor "
                              "names to files")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not _stays_inside(file):
            raise CheckpointError(f"{index_file}: weight_map[{name!r}] = {file!r} points outside the "
                                  f"checkpoint directory {index_file.parent}; only relative paths inside it "
                                  "are allowed")
    return weight_map


def _stays_inside(relative: str) -> bool:
    posix, windows = PurePosixPath(relative), PureWindowsPath(relative)
    return (bool(relative) and not posix.is_absolute() and not windows.is_absolute() and not windows.drive
            and ".." not in posix.parts and ".." not in windows.parts)


def find_weight_files(path: Path) -> tuple[list[Path], dict[str, Path] | None]:
    """The weight files of a checkpoint directory (or a single weight file), and where the index puts each
    tensor when the checkpoint is sharded through one."""
    if not path.exists():
        raise CheckpointNotFoundError(f"checkpoint path {path} does not exist")
    if path.is_file():
        if path.name.endswith(".index.json"):
            return _indexed_files(path)
        if is_safetensors(path) or path.name.endswith(TORCH_SUFFIXES):
            return [path], None
        raise CheckpointError(f"{path}: not a weight file: expected *.safetensors, *.index.json or "
                              f"{', '.join('*' + s for s in TORCH_SUFFIXES)}")
    choice = choose_weight_files(p.name for p in path.iterdir() if p.is_file())
    if choice is None:
        raise CheckpointNotFoundError(f"no weight files in {path}: searched for {SEARCHED}")
    if choice.index is not None:
        return _indexed_files(check_inside(path / choice.index, path))
    return [check_inside(path / name, path) for name in choice.files], None


def _indexed_files(index_file: Path) -> tuple[list[Path], dict[str, Path]]:
    placement = {name: index_file.parent / file for name, file in read_index(index_file).items()}
    files = sorted(set(placement.values()))
    for file in files:
        if not file.is_file():
            raise CheckpointNotFoundError(f"{index_file} lists {file.relative_to(index_file.parent)}, which "
                                          f"is not in {index_file.parent}")
        check_inside(file, index_file.parent)
    return files, placement
