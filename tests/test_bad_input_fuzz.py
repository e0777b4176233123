"""Bad input that can only be found while writing (a failure part way through a load), inputs that must
keep working (hub snapshots' links, two threads, the TPKIT_* switches), and a bounded fuzz of headers, ids
and tables: each a clear error, never a silent wrong result."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from test_bad_input import SINGLE, _FailingSecond, _llama, _tiny_module, _write_safetensors
from torch import nn

from tpkit._env import env_flag
from tpkit.attention import paged_attention
from tpkit.loaders import CheckpointError, PartialLoadError, iter_weights, load_weights
from tpkit.loaders.safetensors_header import read_header
from tpkit.models import (
    from_pretrained,
)
from tpkit.parallel_layers import (
    VocabParallelEmbedding,
)

# --- what cannot be checked before writing, and what must work --------------------------------------------

def test_failure_during_the_copies_says_how_much_was_written() -> None:
    model = _FailingSecond()
    tensors = [(name, torch.full((2,), float(i + 1))) for i, name in enumerate("abc")]
    with pytest.raises(PartialLoadError, match=r"failed after writing 1 of 3 checkpoint tensors: the model "
                                               r"is partially loaded .*OSError: disk gone") as info:
        load_weights(model, tensors, progress=False, num_threads=1)
    assert (info.value.written, info.value.total) == (1, 3)
    assert torch.equal(model.a, torch.ones(2)) and torch.equal(model.b, torch.zeros(2))


def test_float64_overflowing_float16_is_named(tmp_path: Path) -> None:
    module = _tiny_module(torch.float16)
    save_file({"w": torch.full((4, 3), 1e300, dtype=torch.float64),
               "b": torch.randn(4, dtype=torch.float64)}, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"overflow .*written as inf: w \(torch.float64 -> "
                                              r"torch.float16, largest 65504\)"):
        load_weights(module, iter_weights(tmp_path), progress=False)
    # An inf the checkpoint itself holds is loaded as it is.
    save_file({"w": torch.full((4, 3), float("inf"), dtype=torch.float64),
               "b": torch.zeros(4, dtype=torch.float64)}, tmp_path / "model.safetensors")
    load_weights(module, iter_weights(tmp_path), progress=False)
    assert torch.isinf(module.w).all()


def test_hub_snapshot_links_into_its_blobs_load(tmp_path: Path) -> None:
    """The hub cache's layout: snapshot files are links into the model's blobs/, outside the snapshot."""
    storage = tmp_path / "models--org--tiny"
    (storage / "blobs").mkdir(parents=True)
    snapshot = storage / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    tensors = {"w": torch.randn(4, 3), "b": torch.randn(4)}
    save_file(tensors, storage / "blobs" / "0123")
    (snapshot / "model.safetensors").symlink_to(Path("../../blobs/0123"))
    module = _tiny_module()
    load_weights(module, iter_weights(snapshot), progress=False)
    assert torch.equal(module.w, tensors["w"])
    # A link out of the model's storage is refused there too.
    other = tmp_path / "elsewhere.safetensors"
    save_file(tensors, other)
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(other)
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        iter_weights(snapshot)


def test_tied_head_that_differs_in_the_checkpoint_is_untied_as_in_transformers(tmp_path: Path) -> None:
    """A tied model's checkpoint holding lm_head.weight with other values than the embedding: transformers
    warns and unties, each loaded from its own tensor, whichever comes first in the file. So does tpkit."""
    from checkpoints import make_llama_checkpoint
    from transformers import LlamaForCausalLM as HFLlama

    make_llama_checkpoint(tmp_path, tie_word_embeddings=True, seed=3)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["lm_head.weight"] = torch.randn(tensors["model.embed_tokens.weight"].shape,
                                            generator=torch.Generator().manual_seed(4))
    ids = torch.randint(3, 256, (1, 7), generator=torch.Generator().manual_seed(5))
    for head_first in (True, False):
        order = sorted(tensors, key=lambda name: (name != "lm_head.weight") == head_first)
        save_file({name: tensors[name] for name in order}, tmp_path / "model.safetensors",
                  metadata={"format": "pt"})
        expected = HFLlama.from_pretrained(tmp_path).eval()(ids).logits
        with pytest.warns(UserWarning, match=r"ties .* but the checkpoint holds both with different values"):
            model = from_pretrained(tmp_path, tp_group=SINGLE)
        assert model.lm_head.weight is not model.embed_tokens.weight
        torch.testing.assert_close(model(ids), expected, atol=1e-4, rtol=1e-4)


def test_two_threads_generating_on_one_model() -> None:
    model = _llama()
    started, release = threading.Event(), threading.Event()
    prefill = model._prefill

    def slow_prefill(*args: object) -> torch.Tensor:
        started.set()
        release.wait(60)
        return prefill(*args)

    model._prefill = slow_prefill
    results: list[object] = []
    worker = threading.Thread(target=lambda: results.append(model.generate([[1, 2]], 3)))
    worker.start()
    assert started.wait(60)
    with pytest.raises(RuntimeError, match=r"generate: this model is already generating \(in another "
                                           r"thread\)"):
        model.generate([[1, 2]], 3)
    release.set()
    worker.join(60)
    assert len(results) == 1 and len(results[0][0]) == 3
    assert len(model.generate([[1, 2]], 3)[0]) == 3  # and again once the first is done


@pytest.mark.parametrize(("text", "value"), [("1", True), (" TRUE ", True), ("on", True), ("yes", True),
                                             ("0", False), ("false", False), ("Off", False), ("no", False),
                                             ("", None)])
def test_env_flags_read_one_way(monkeypatch: pytest.MonkeyPatch, text: str, value: bool | None) -> None:
    monkeypatch.setenv("TPKIT_DEBUG", text)
    assert env_flag("TPKIT_DEBUG", False) is (False if value is None else value)
    assert env_flag("TPKIT_DEBUG", True) is (True if value is None else value)


def test_env_flag_neither_on_nor_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TPKIT_LOAD_DMA", "maybe")
    with pytest.raises(ValueError, match=r"environment variable TPKIT_LOAD_DMA: expected one of 1, true, "
                                         r".*got 'maybe'"):
        env_flag("TPKIT_LOAD_DMA", True)


# --- fuzz: bounded, a few seconds -------------------------------------------------------------------------

_DIMENSION = st.one_of(st.integers(0, 6), st.just(-1), st.just(True), st.just(2.0))
_TENSOR = st.fixed_dictionaries({"dtype": st.sampled_from(["U8", "F16", "F32", "BOOL", "X9"]),
                                 "shape": st.lists(_DIMENSION, max_size=2),
                                 "data_offsets": st.lists(st.integers(0, 40), min_size=2, max_size=2)})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tensors=st.lists(st.tuples(st.sampled_from("abc"), _TENSOR), max_size=3),
       data_size=st.integers(0, 40), metadata=st.sampled_from([None, {"k": "v"}, {"k": 1}]))
def test_fuzz_safetensors_headers_as_safetensors_reads_them(tmp_path: Path, tensors: list, data_size: int,
                                                             metadata: dict | None) -> None:
    """Random headers (names repeated, odd dimensions, offsets anywhere, trailing bytes): tpkit reads a file
    exactly when the safetensors library does, and then the same tensors."""
    entries = [f'"{name}": {json.dumps(info)}' for name, info in tensors]
    if metadata is not None:
        entries.insert(0, f'"__metadata__": {json.dumps(metadata)}')
    file = _write_safetensors(tmp_path / "fuzz.safetensors", "{" + ", ".join(entries) + "}",
                              bytes(range(data_size)))
    try:
        with safe_open(file, "pt") as f:
            expected = {name: f.get_tensor(name) for name in f.keys()}
    except Exception:  # noqa: BLE001 - any refusal of the library's
        expected = None
    if expected is None:
        with pytest.raises(CheckpointError):
            read_header(file)
        return
    entries_read = read_header(file)
    assert sorted(e.name for e in entries_read) == sorted(expected)
    for name, handle in iter_weights(file):
        assert torch.equal(handle[...], expected[name])


@settings(max_examples=40, deadline=None)
@given(ids=st.lists(st.integers(-3, 23), min_size=1, max_size=6))
def test_fuzz_embedding_ids(ids: list[int]) -> None:
    """Ids anywhere near the table: refused exactly when one is outside it, else nn.Embedding's rows."""
    layer = VocabParallelEmbedding(20, 4, tp_group=SINGLE)
    tensor = torch.tensor(ids)
    if all(0 <= i < 20 for i in ids):
        assert torch.equal(layer(tensor), nn.functional.embedding(tensor, layer.weight))
    else:
        first = next(k for k, i in enumerate(ids) if not 0 <= i < 20)
        with pytest.raises(ValueError, match=re.escape(f"input_ids[{first}]: expected values in [0, 20), got "
                                                       f"{ids[first]}")):
            layer(tensor)


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(-2, 20), min_size=1, max_size=3),
       entries=st.lists(st.integers(-2, 6), min_size=6, max_size=6))
def test_fuzz_block_tables_and_seq_lens(lens: list[int], entries: list[int]) -> None:
    """Any lengths and table entries: a ValueError exactly when a length leaves [0, capacity] or a used entry
    leaves the cache, else finite results equal to a naive per-sequence softmax."""
    g = torch.Generator().manual_seed(len(lens))
    num_seqs = len(lens)
    key_cache, value_cache = torch.randn(6, 4, 1, 8, generator=g), torch.randn(6, 4, 1, 8, generator=g)
    query = torch.randn(num_seqs, 2, 8, generator=g)
    tables = torch.tensor(entries[: 2 * num_seqs] + [0] * (2 * num_seqs - len(entries[: 2 * num_seqs])),
                          dtype=torch.int32).view(num_seqs, 2)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    valid = all(0 <= n <= 8 for n in lens) and all(
        0 <= int(tables[s, j]) < 6 for s, n in enumerate(lens) for j in range(2) if j * 4 < n)
    if not valid:
        with pytest.raises(ValueError, match=r"(seq_lens\[\d\]: expected a length|block_tables\[\d, \d\]: "
                                             r"expected a block index)"):
            paged_attention(query, key_cache, value_cache, tables, seq_lens)
        return
    out = paged_attention(query, key_cache, value_cache, tables, seq_lens)
    for s, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[s], torch.zeros_like(out[s]))
            continue
        slots = [(int(tables[s, p // 4]), p % 4) for p in range(n)]
        keys = torch.stack([key_cache[b, o, 0] for b, o in slots])  # [n, 8]
        values = torch.stack([value_cache[b, o, 0] for b, o in slots])
        weights = torch.softmax(query[s] @ keys.T / 8 ** 0.5, dim=-1)  # [2, n]
        torch.testing.assert_close(out[s], weights @ values, atol=1e-5, rtol=1e-5)
