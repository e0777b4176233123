"""resolve_checkpoint: local directories, a hub cache laid out as huggingface_hub lays it, what gets fetched.

Nothing goes over the network: the Hub API and downloads are replaced by fakes that record what they were
asked for, and the offline path reads a cache written here (``models--org--name/refs/main`` ->
``snapshots/<commit>/`` with files linked to ``blobs/``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from tpkit.loaders import CheckpointError, CheckpointNotFoundError, iter_weights, resolve_checkpoint
from tpkit.loaders import checkpoint as checkpoint_module

REPO_ID = "tpkit-test/tiny-llama"
# resolve_checkpoint of a model id in a world of several ranks fetches once and shares it (the last test);
# the tests of what one process fetches run in plain pytest (under torchrun, a world of one).
_ONE_RANK = pytest.mark.skipif(int(os.environ.get("WORLD_SIZE", "1")) > 1,
                               reason="what one process fetches; a world of several ranks shares one fetch")


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from checkpoints import make_llama_checkpoint

    path = tmp_path_factory.mktemp("hub_source") / "tiny-llama"
    make_llama_checkpoint(path, max_shard_size="100KB")
    (path / "tokenizer.json").write_text("{}")
    return path


def _make_hub_cache(cache: Path, repo_id: str, source: Path, revision: str = "main") -> Path:
    """Writes ``source``'s files into ``cache`` the way huggingface_hub does; returns the snapshot dir."""
    storage = cache / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (storage / "blobs").mkdir(exist_ok=True)
    for file in sorted(source.iterdir()):
        blob = storage / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        link = snapshot / file.name
        if not link.is_symlink():
            link.symlink_to(os.path.relpath(blob, snapshot))
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / revision).write_text(commit)
    return snapshot


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the network was used")

    monkeypatch.setattr(checkpoint_module, "snapshot_download", refuse)
    monkeypatch.setattr(checkpoint_module, "hf_hub_download", refuse)
    monkeypatch.setattr(checkpoint_module.HfApi, "list_repo_files", refuse)


def test_local_directory_as_it_is(source):
    assert resolve_checkpoint(source) == source
    assert resolve_checkpoint(str(source)) == source


def test_bad_local_paths(tmp_path, no_network):
    with pytest.raises(CheckpointNotFoundError, match="checkpoint directory .*nowhere does not exist"):
        resolve_checkpoint(tmp_path / "nowhere")
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        resolve_checkpoint(str(tmp_path / "nowhere"))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="expected a checkpoint directory or a model id, received the "
                                              "file"):
        resolve_checkpoint(tmp_path / "model.safetensors")
    with pytest.raises(CheckpointNotFoundError, match="neither an existing directory nor a valid Hugging "
                                                      "Face"):
        resolve_checkpoint("not//a valid id")
    with pytest.raises(TypeError, match="name_or_path: expected a str or path"):
        resolve_checkpoint(3)


@_ONE_RANK
def test_offline_from_the_hub_cache(source, tmp_path, monkeypatch, no_network):
    snapshot = _make_hub_cache(tmp_path / "hf" / "hub", REPO_ID, source)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    path = resolve_checkpoint(REPO_ID)
    assert path == snapshot.resolve()
    assert [n for n, _ in iter_weights(path)] == [n for n, _ in iter_weights(source)]
    assert resolve_checkpoint(REPO_ID, revision=snapshot.name) == path
    with pytest.raises(CheckpointNotFoundError, match="revision v2"):
        resolve_checkpoint(REPO_ID, revision="v2")
    # An explicit cache_dir wins over HF_HOME, and HF_HUB_CACHE over HF_HOME.
    other = _make_hub_cache(tmp_path / "elsewhere", REPO_ID, source)
    assert resolve_checkpoint(REPO_ID, cache_dir=tmp_path / "elsewhere") == other.resolve()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert resolve_checkpoint(REPO_ID) == other.resolve()


@_ONE_RANK
def test_offline_and_not_cached(tmp_path, monkeypatch, no_network):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    cache = (tmp_path / "hf" / "hub").resolve()
    with pytest.raises(CheckpointNotFoundError, match=rf"'org/missing' \(revision main\) is neither a local "
                                                      rf"directory nor in the Hugging Face cache at {cache}; "
                                                      r"downloads are off \(HF_HUB_OFFLINE=1\)"):
        resolve_checkpoint("org/missing")


class _FakeHub:
    """Stands in for the Hub: a repo listing, the index download, and snapshot_download's arguments."""

    def __init__(self, listing: list[str], index: dict | None, tmp: Path) -> None:
        self.listing, self.index, self.tmp = listing, index, tmp
        self.allow_patterns: list[str] | None = None

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        hub = self

        class Api:
            def list_repo_files(self, repo_id: str, revision: str | None = None) -> list[str]:
                return hub.listing

        def hf_hub_download(repo_id: str, filename: str, **kwargs: object) -> str:
            file = hub.tmp / filename
            file.write_text(json.dumps(hub.index))
            return str(file)

        def snapshot_download(repo_id: str, *, allow_patterns: list[str], **kwargs: object) -> str:
            hub.allow_patterns = allow_patterns
            return str(hub.tmp)

        monkeypatch.setattr(checkpoint_module, "HfApi", Api)
        monkeypatch.setattr(checkpoint_module, "hf_hub_download", hf_hub_download)
        monkeypatch.setattr(checkpoint_module, "snapshot_download", snapshot_download)


CONFIGS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json"]


@_ONE_RANK
@pytest.mark.parametrize(("listing", "index", "fetched"), [
    (CONFIGS + ["model.safetensors", "pytorch_model.bin", "README.md", ".gitattributes",
                "original/consolidated.safetensors", "onnx/model.onnx"],
     None, CONFIGS + ["model.safetensors"]),
    (["config.json", "pytorch_model.bin", "tf_model.h5", "README.md"], None,
     ["config.json", "pytorch_model.bin"]),
    (["config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
      "model-00002-of-00002.safetensors", "pytorch_model.bin.index.json", "pytorch_model-00001-of-00002.bin"],
     {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}},
     ["config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
      "model-00002-of-00002.safetensors"]),
])
def test_online_fetches_only_what_loading_needs(tmp_path, monkeypatch, listing, index, fetched):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    hub = _FakeHub(listing, index, tmp_path)
    hub.install(monkeypatch)
    assert resolve_checkpoint("org/model", cache_dir=tmp_path) == tmp_path
    assert sorted(hub.allow_patterns) == sorted(fetched)
    # Patterns given by the caller are passed on as they are.
    resolve_checkpoint("org/model", cache_dir=tmp_path, allow_patterns=["*.json"])
    assert hub.allow_patterns == ["*.json"]


@_ONE_RANK
def test_online_repo_without_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    _FakeHub(["config.json", "README.md"], None, tmp_path).install(monkeypatch)
    with pytest.raises(CheckpointNotFoundError, match=r"^'org/model' \(revision main\) has no weight "
                                                      r"files: its top-level files are \['README.md', "
                                                      r"'config.json'\]$"):
        resolve_checkpoint("org/model", cache_dir=tmp_path)


@_ONE_RANK
def test_unreachable_hub_falls_back_to_the_cache(source, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")

    class DownApi:
        def list_repo_files(self, repo_id: str, revision: str | None = None) -> list[str]:
            raise ConnectionError("no route to host")

    monkeypatch.setattr(checkpoint_module, "HfApi", DownApi)
    snapshot = _make_hub_cache(tmp_path, REPO_ID, source)
    assert resolve_checkpoint(REPO_ID, cache_dir=tmp_path) == snapshot.resolve()
    with pytest.raises(CheckpointNotFoundError, match=r"the Hub could not be reached \(no route to host\)"):
        resolve_checkpoint("org/other", cache_dir=tmp_path)


def _resolve_on_every_rank(source: str) -> tuple[str, int]:
    """Every rank resolves one id online; the fake download is slow, so a rank that did not wait fails."""
    shared = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    cache = Path(shared[0])
    downloads = []

    class Api:
        def list_repo_files(self, repo_id: str, revision: str | None = None) -> list[str]:
            return sorted(p.name for p in Path(source).iterdir())

    def snapshot_download(repo_id: str, *, revision: str | None, cache_dir: Path, allow_patterns: list[str],
                          **kwargs: object) -> str:
        downloads.append(allow_patterns)
        time.sleep(0.5)
        return str(_make_hub_cache(Path(cache_dir), repo_id, Path(source)))

    def hf_hub_download(repo_id: str, filename: str, **kwargs: object) -> str:
        return str(Path(source) / filename)

    names = ("HfApi", "snapshot_download", "hf_hub_download")
    saved = [getattr(checkpoint_module, name) for name in names], os.environ.get("HF_HUB_OFFLINE")
    for name, fake in zip(names, (Api, snapshot_download, hf_hub_download), strict=True):
        setattr(checkpoint_module, name, fake)
    os.environ["HF_HUB_OFFLINE"] = "0"
    try:
        path = resolve_checkpoint(REPO_ID, cache_dir=cache)
        assert sorted(n for n, _ in iter_weights(path)) == sorted(n for n, _ in iter_weights(Path(source)))
    finally:
        for name, original in zip(names, saved[0], strict=True):
            setattr(checkpoint_module, name, original)
        if saved[1] is None:
            os.environ.pop("HF_HUB_OFFLINE")
        else:
            os.environ["HF_HUB_OFFLINE"] = saved[1]
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(cache)
    return str(path.relative_to(cache)), len(downloads)


def test_one_rank_downloads_the_others_wait(ranks, source):
    results = ranks.run(2, _resolve_on_every_rank, str(source))
    assert len({path for path, _ in results}) == 1
    # Under torchrun only this process's rank comes back.
    expected = [1, 0] if len(results) == 2 else [int(dist.get_rank() == 0)]
    assert [downloads for _, downloads in results] == expected
