"""``resolve_checkpoint``: a local directory, or a Hugging Face model id fetched once into the hub cache.

Only what loading needs is downloaded: config, generation config, tokenizer files and the weights the
:mod:`weight_files` rule picks (safetensors and their index; ``.bin`` only when the repo has no
safetensors). The cache is the one ``huggingface_hub`` uses, found at call time from ``cache_dir``,
``HF_HUB_CACHE`` or ``HF_HOME``; with ``HF_HUB_OFFLINE=1`` nothing goes over the network. With several
processes in ``torch.distributed``, the first process of each node downloads while the others wait, then
they find the snapshot in the cache without asking the Hub.
"""

from __future__ import annotations

import fnmatch
import os
import re
from pathlib import Path

import torch.distributed as dist
from huggingface_hub import HfApi, constants, hf_hub_download, snapshot_download
from huggingface_hub.utils import (
    GatedRepoError,
    HFValidationError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
    validate_repo_id,
)

from .errors import CheckpointError, CheckpointNotFoundError
from .weight_files import choose_weight_files, read_index

__all__ = ["resolve_checkpoint"]

_CONFIG_PATTERNS = ("config.json", "generation_config.json", "tokenizer*", "special_tokens_map.json",
                    "added_tokens.json", "vocab.*", "merges.txt", "*.model", "chat_template*")
_COMMIT_HASH = re.compile(r"[0-9a-f]{40}")
_TRUE = ("1", "true", "yes", "on")


def resolve_checkpoint(
    name_or_path: str | os.PathLike,
    *,
    revision: str | None = None,
    cache_dir: str | os.PathLike | None = None,
    allow_patterns: list[str] | None = None,
) -> Path:
    """The local directory of a checkpoint.

    An existing directory is returned as it is (``revision`` and the cache play no part). Anything else is
    a Hugging Face model id: the snapshot for ``revision`` (default ``main``) is downloaded into the hub cache
    (``cache_dir``, else ``HF_HUB_CACHE``, else ``HF_HOME``/hub) limited to ``allow_patterns`` or, by default,
    to the files loading needs, and its directory returned. Offline (``HF_HUB_OFFLINE=1``) or when the Hub
    cannot be reached, the cached snapshot is used; a model that is not in the cache is a
    :class:`CheckpointNotFoundError` saying where it looked.

    Under ``torch.distributed`` every process must call it: one per node downloads, the rest wait.
    """
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise TypeError(f"name_or_path: expected a str or path, received {type(name_or_path).__name__}")
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise CheckpointError(f"name_or_path: expected a checkpoint directory or a model id, received the "
                              f"file {path}")
    repo_id = os.fspath(name_or_path)
    if isinstance(name_or_path, os.PathLike) or repo_id.startswith(("/", "./", "../", "~")):
        raise CheckpointNotFoundError(f"checkpoint directory {path} does not exist")
    try:
        validate_repo_id(repo_id)
    except HFValidationError as error:
        raise CheckpointNotFoundError(f"{repo_id!r} is neither an existing directory nor a valid Hugging "
                                      f"Face model id ({error})") from error
    cache = _cache_dir(cache_dir)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return _fetch(repo_id, revision, cache, allow_patterns)
    return _fetch_once_per_node(repo_id, revision, cache, allow_patterns)


def _fetch_once_per_node(repo_id: str, revision: str | None, cache: Path,
                         allow_patterns: list[str] | None) -> Path:
    downloads = int(os.environ.get("LOCAL_RANK", dist.get_rank())) == 0
    failure: Exception | None = None
    if downloads:
        try:
            _fetch(repo_id, revision, cache, allow_patterns)
        except Exception as caught:  # noqa: BLE001 - sent to every rank below, then raised here unchanged
            failure = caught
    # Doubles as the barrier: nobody reads the cache before the downloads are complete.
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, None if failure is None else f"{type(failure).__name__}: {failure}")
    if failure is not None:
        raise failure
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        raise CheckpointError(f"rank {failed[0][0]} could not fetch {repo_id!r}: {failed[0][1]}")
    return _cached_snapshot(repo_id, revision, cache)


def _fetch(repo_id: str, revision: str | None, cache: Path, allow_patterns: list[str] | None) -> Path:
    if _offline():
        return _cached_snapshot(repo_id, revision, cache, reason="downloads are off (HF_HUB_OFFLINE=1)")
    if allow_patterns is None:
        try:
            allow_patterns = _files_to_fetch(repo_id, revision, cache)
        except (RepositoryNotFoundError, RevisionNotFoundError, GatedRepoError, CheckpointError):
            raise
        except Exception as error:  # noqa: BLE001 - no listing (network down, Hub error): try the cache
            reason = f"the Hub could not be reached ({error})"
            return _cached_snapshot(repo_id, revision, cache, reason=reason)
    return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=allow_patterns))


def _files_to_fetch(repo_id: str, revision: str | None, cache: Path) -> list[str]:
    """Config, tokenizer and weight files of the repo, by exact name."""
    files = HfApi().list_repo_files(repo_id, revision=revision)
    top = [f for f in files if "/" not in f]
    wanted = [f for f in top if any(fnmatch.fnmatch(f, p) for p in _CONFIG_PATTERNS)]
    choice = choose_weight_files(top)
    if choice is None:
        raise CheckpointNotFoundError(f"{repo_id!r} (revision {revision or 'main'}) has no weight files: its "
                                      f"top-level files are {sorted(top)}")
    if choice.index is None:
        return wanted + list(choice.files)
    index_file = Path(hf_hub_download(repo_id, choice.index, revision=revision, cache_dir=cache))
    return wanted + [choice.index] + sorted(set(read_index(index_file).values()))


def _cached_snapshot(repo_id: str, revision: str | None, cache: Path, reason: str = "") -> Path:
    """The snapshot directory of ``repo_id`` in the hub cache layout
    (``models--org--name/refs/<revision>`` -> ``snapshots/<commit>``), without touching the network."""
    revision = revision or "main"
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    ref = storage / "refs" / revision
    if _COMMIT_HASH.fullmatch(revision):
        commit: str | None = revision
    else:
        commit = ref.read_text().strip() if ref.is_file() else None
    snapshot = storage / "snapshots" / commit if commit else None
    if snapshot is None or not snapshot.is_dir():
        because = f"; {reason}" if reason else ""
        raise CheckpointNotFoundError(f"{repo_id!r} (revision {revision}) is neither a local directory nor "
                                      f"in the Hugging Face cache at {cache}{because}. Download it once "
                                      "online, or point cache_dir, HF_HUB_CACHE or HF_HOME at a cache "
                                      "that has it.")
    return snapshot


def _cache_dir(cache_dir: str | os.PathLike | None) -> Path:
    # Read the environment now: huggingface_hub's constants were fixed when it was imported.
    if cache_dir is not None:
        chosen = Path(cache_dir)
    elif os.environ.get("HF_HUB_CACHE"):
        chosen = Path(os.environ["HF_HUB_CACHE"])
    elif os.environ.get("HF_HOME"):
        chosen = Path(os.environ["HF_HOME"]) / "hub"
    else:
        chosen = Path(constants.HF_HUB_CACHE)
    return chosen.expanduser().resolve()


def _offline() -> bool:
    value = os.environ.get("HF_HUB_OFFLINE")
    return value.strip().lower() in _TRUE if value is not None else bool(constants.HF_HUB_OFFLINE)
