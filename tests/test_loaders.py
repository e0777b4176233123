"""tpkit.loaders on checkpoints made here with transformers: lazy reads, names, strictness, bad files."""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
import os
import re
import shutil
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from checkpoints import make_bart_checkpoint, make_gpt_bigcode_checkpoint, make_llama_checkpoint
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import BartForConditionalGeneration, GPTBigCodeForCausalLM, LlamaForCausalLM

from tpkit.loaders import (
    CheckpointError,
    CheckpointNotFoundError,
    LazyTensor,
    WeightsMismatchError,
    _direct_copy,
    _staging,
    bytes_read,
    default_weight_loader,
    iter_weights,
    load_weights,
    reset_bytes_read,
)
from tpkit.loaders import load as _load_module
from tpkit.models import LlamaForCausalLM as TpkitLlama
from tpkit.parallel_layers import ColumnParallelLinear, RowParallelLinear, TPGroup, _loading

# tp_size 1 without init_tensor_parallel, also under torchrun (where torch.distributed is initialised).
SINGLE = TPGroup(None, 0, 1)

HF_CLASSES = {"llama": LlamaForCausalLM, "llama_sharded": LlamaForCausalLM, "llama_tied": LlamaForCausalLM,
              "gpt_bigcode": GPTBigCodeForCausalLM, "bart": BartForConditionalGeneration}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, nn.Module]]:
    root = tmp_path_factory.mktemp("checkpoints")
    # The shapes asserted below are those of a hidden size of 64.
    made = {
        "llama": make_llama_checkpoint(root / "llama", hidden_size=64),
        "llama_sharded": make_llama_checkpoint(root / "llama_sharded", max_shard_size="100KB",
                                               attention_bias=True, seed=1),
        "llama_tied": make_llama_checkpoint(root / "llama_tied", tie_word_embeddings=True, seed=2),
        "gpt_bigcode": make_gpt_bigcode_checkpoint(root / "gpt_bigcode"),
        "bart": make_bart_checkpoint(root / "bart"),
    }
    return {name: (root / name, model) for name, model in made.items()}


def _reference_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def _assert_unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), f"{name} was written"


# --- iter_weights and LazyTensor ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["llama", "llama_sharded", "gpt_bigcode", "bart"])
def test_iter_weights_yields_every_tensor(checkpoints, name):
    path, _ = checkpoints[name]
    reference = _reference_tensors(path)
    weights = dict(iter_weights(path))
    assert weights.keys() == reference.keys()
    for key, handle in weights.items():
        assert isinstance(handle, LazyTensor)
        assert handle.shape == reference[key].shape and handle.dtype == reference[key].dtype
        assert torch.equal(handle[:], reference[key])
    if name == "llama_sharded":
        assert len({h.file for h in weights.values()}) > 2
        assert (path / "model.safetensors.index.json").is_file()


def test_lazy_tensor_reads_only_the_slices_asked_for(checkpoints):
    path, _ = checkpoints["llama"]
    weights = dict(iter_weights(path))
    handle = weights["model.layers.0.mlp.down_proj.weight"]  # [64, 128] float32
    full = load_file(path / "model.safetensors")["model.layers.0.mlp.down_proj.weight"]
    assert handle.shape == torch.Size([64, 128]) and handle.dtype == torch.float32
    assert handle.ndim == 2 and handle.size(1) == 128 and handle.numel() == 64 * 128 and len(handle) == 64
    reset_bytes_read()
    assert bytes_read() == 0
    cases = [
        (lambda t: t[8:24], full[8:24]),
        (lambda t: t[:, 32:96], full[:, 32:96]),
        (lambda t: t.narrow(0, 16, 16), full.narrow(0, 16, 16)),
        (lambda t: t.narrow(1, 64, 64), full.narrow(1, 64, 64)),
        (lambda t: t.narrow(-1, -32, 32), full.narrow(-1, -32, 32)),
        (lambda t: t[5], full[5]),
        (lambda t: t[:], full),
        (lambda t: t[...], full),
    ]
    for take, expected in cases:
        before = bytes_read()
        got = take(handle)
        assert isinstance(got, torch.Tensor) and torch.equal(got, expected)
        assert bytes_read() - before == expected.numel() * 4
    norm = weights["model.norm.weight"]
    assert torch.equal(norm[...], load_file(path / "model.safetensors")["model.norm.weight"])


def test_lazy_tensor_narrow_out_of_range(checkpoints):
    handle = dict(iter_weights(checkpoints["llama"][0]))["model.layers.0.mlp.down_proj.weight"]
    with pytest.raises(ValueError, match=r"narrow\(dim=1, start=100, length=64\).*down_proj.*\(64, 128\)"):
        handle.narrow(1, 100, 64)
    with pytest.raises(IndexError, match="dim 2 is out of range"):
        handle.narrow(2, 0, 1)


def test_views_outlive_the_handle(checkpoints):
    path, _ = checkpoints["llama"]
    part = dict(iter_weights(path))["model.embed_tokens.weight"][10:20]
    # The memory map lives as long as the view, whatever happened to the handle.
    expected = load_file(path / "model.safetensors")["model.embed_tokens.weight"][10:20]
    assert torch.equal(part.clone(), expected)


def _data_spans(file: Path) -> dict[str, tuple[int, int]]:
    """Each tensor's [start, end) byte offsets in the file, from its header."""
    data = file.read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + header_len])
    return {name: (8 + header_len + info["data_offsets"][0], 8 + header_len + info["data_offsets"][1])
            for name, info in header.items() if name != "__metadata__"}


def test_slices_across_map_boundaries_match_safetensors(tmp_path):
    # Several MB, so that tensors start mid-page, cross 2 MiB file offsets (where the handles' maps begin
    # and end) and the last one ends at the end of the file (where its map is cut short).
    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(3, generator=g), "b": torch.randn(700, 1031, generator=g),
               "c": torch.randn(1500, 1333, generator=g).to(torch.bfloat16),
               "d": torch.randn(517, 1001, generator=g)}
    file = tmp_path / "model.safetensors"
    save_file(tensors, file)
    spans = _data_spans(file)
    mib2 = 2 * 2**20
    assert any(start % 4096 and start // mib2 < (end - 1) // mib2 for start, end in spans.values())
    assert max(end for _, end in spans.values()) == file.stat().st_size
    reference = load_file(file)
    handles = dict(iter_weights(tmp_path))
    for name in "bcd":
        full, handle = reference[name], handles[name]
        rows, cols = full.shape
        third, half = rows // 3, cols // 2
        cases = [(lambda t: t[:], full),
                 (lambda t, a=third: t[a:2 * a], full[third:2 * third]),
                 (lambda t, n=rows: t.narrow(0, n - 5, 5), full[rows - 5:]),
                 (lambda t, n=cols: t[:, 7:n - 3], full[:, 7:cols - 3]),
                 (lambda t, n=cols, h=half: t.narrow(1, h, n - h), full[:, half:])]
        for take, expected in cases:
            before = bytes_read()
            got = take(handle)
            assert torch.equal(got, expected), name
            assert bytes_read() - before == expected.numel() * expected.element_size()
    # Cast on the way into parameters of other dtypes, whole and by row and column pieces.
    for dtype in (torch.float64, torch.float16, torch.bfloat16):
        model = nn.Module()
        for name in "bcd":
            model.register_parameter(name, nn.Parameter(torch.zeros(reference[name].shape, dtype=dtype)))
        load_weights(model, iter_weights(tmp_path), ignore="a", progress=False)
        for name in "bcd":
            assert torch.equal(model.get_parameter(name), reference[name].to(dtype)), (name, dtype)
        param = torch.zeros(reference["c"].shape, dtype=dtype)
        with torch.no_grad():
            param[:700].copy_(handles["c"][:700])
            param[700:, :600].copy_(handles["c"][700:, :600])
            param[700:, 600:].copy_(handles["c"].narrow(0, 700, 800).narrow(1, 600, 733))
        assert torch.equal(param, reference["c"].to(dtype))


def test_read_ahead_is_asked_only_for_the_part_taken(checkpoints, monkeypatch):
    path, _ = checkpoints["llama"]
    file = path / "model.safetensors"
    start, end = _data_spans(file)["model.layers.0.mlp.down_proj.weight"]  # [64, 128] float32
    handle = dict(iter_weights(path))["model.layers.0.mlp.down_proj.weight"]
    advised: list[tuple[int, int, int]] = []
    monkeypatch.setattr(os, "posix_fadvise",
                        lambda fd, offset, length, advice: advised.append((offset, length, advice)))
    handle[16:48]
    handle.narrow(0, 60, 4)
    handle[:]
    assert advised == [(start + 16 * 512, 32 * 512, os.POSIX_FADV_WILLNEED),
                       (start + 60 * 512, 4 * 512, os.POSIX_FADV_WILLNEED),
                       (start, end - start, os.POSIX_FADV_WILLNEED)]
    advised.clear()
    handle[:, 64:]  # a column slice's byte range holds the other columns too: left to the page faults
    assert advised == []


def test_file_truncated_after_its_header_was_read(tmp_path):
    file = tmp_path / "model.safetensors"
    save_file({"a": torch.randn(64, 64)}, file)
    handle = dict(iter_weights(tmp_path))["a"]
    file.write_bytes(file.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(file))}: truncated after its header was "
                                              r"read: tensor 'a' ends at byte \d+, the file now holds \d+"):
        handle[:8]


# --- load_weights into transformers models (default_weight_loader everywhere) ------------------------------

@pytest.mark.parametrize("name", list(HF_CLASSES))
def test_load_weights_into_transformers_model(checkpoints, name):
    path, reference = checkpoints[name]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(123)
        model = HF_CLASSES[name](reference.config)
    loaded = load_weights(model, iter_weights(path), progress=False)
    assert set(dict(model.named_parameters(remove_duplicate=False))) <= loaded
    expected = reference.state_dict()
    for key, value in model.state_dict().items():
        if key in loaded:
            assert torch.equal(value, expected[key]), key


def test_tied_lm_head_in_checkpoint_is_not_unexpected(checkpoints):
    path, reference = checkpoints["llama_tied"]
    weights = list(iter_weights(path))
    assert "lm_head.weight" not in dict(weights)
    embed = dict(weights)["model.embed_tokens.weight"]
    model = LlamaForCausalLM(reference.config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # Some checkpoints store the tied head as well: loading it again adds nothing and is no error.
    loaded = load_weights(model, [("lm_head.weight", embed[:] * 1), *weights], progress=False)
    assert {"lm_head.weight", "model.embed_tokens.weight"} <= loaded
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight)


def test_untied_model_misses_lm_head_of_tied_checkpoint(checkpoints):
    path, reference = checkpoints["llama_tied"]
    config = reference.config.__class__(**{**reference.config.to_dict(), "tie_word_embeddings": False})
    model = LlamaForCausalLM(config)
    with pytest.raises(WeightsMismatchError) as info:
        load_weights(model, iter_weights(path), progress=False)
    assert info.value.missing == ["lm_head.weight"] and info.value.unexpected == []


# --- name matching ------------------------------------------------------------------------------------------

class _Stacked(nn.Module):
    """q, k and v rows stacked in one parameter; ``weight_loader`` places a shard by its id."""

    def __init__(self, rows: dict[str, int], cols: int) -> None:
        super().__init__()
        self.rows = rows
        self.weight = nn.Parameter(torch.zeros(sum(rows.values()), cols))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: str) -> None:
        start = sum(n for s, n in self.rows.items() if s < loaded_shard_id)
        expected = (self.rows[loaded_shard_id], param.shape[1])
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(f"shard {loaded_shard_id!r}: expected {expected}, "
                             f"received {tuple(loaded_weight.shape)}")
        param.narrow(0, start, expected[0]).copy_(loaded_weight[:])


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = _Stacked({"k": 2, "q": 4, "v": 2}, 3)  # stacked from q_proj, k_proj, v_proj
        self.xq_proj = nn.Linear(3, 5, bias=False)  # "q_proj" is a substring, not a component
        self.v_proj_gate = nn.Linear(3, 2, bias=False)  # likewise "v_proj"


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _Block()
        self.fused = nn.Module()
        self.fused.qkv_proj = nn.Linear(3, 8, bias=False)  # stored fused: "kv_proj"/"v_proj" are substrings
        self.cross = nn.Module()
        self.cross.q_proj = nn.Linear(3, 4, bias=False)  # not stacked: the mapping must fall through


QKV_MAPPING = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"))


def _name_matching_checkpoint() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"attn.q_proj.weight": (4, 3), "attn.k_proj.weight": (2, 3), "attn.v_proj.weight": (2, 3),
              "attn.xq_proj.weight": (5, 3), "attn.v_proj_gate.weight": (2, 3),
              "fused.qkv_proj.weight": (8, 3), "cross.q_proj.weight": (4, 3)}
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def test_names_match_by_whole_components():
    tensors = _name_matching_checkpoint()
    model = _Model()
    loaded = load_weights(model, list(tensors.items()), QKV_MAPPING, progress=False)
    assert loaded == {name for name, _ in model.named_parameters()}
    qkv = model.attn.qkv_proj.weight
    assert torch.equal(qkv[:2], tensors["attn.k_proj.weight"])
    assert torch.equal(qkv[2:6], tensors["attn.q_proj.weight"])
    assert torch.equal(qkv[6:], tensors["attn.v_proj.weight"])
    for name in ("attn.xq_proj.weight", "attn.v_proj_gate.weight", "fused.qkv_proj.weight",
                 "cross.q_proj.weight"):
        assert torch.equal(model.get_parameter(name), tensors[name]), name


def test_strict_reports_missing_and_unexpected_in_one_error_and_writes_nothing():
    tensors = _name_matching_checkpoint()
    del tensors["attn.k_proj.weight"]  # a stacked shard missing
    del tensors["cross.q_proj.weight"]  # a parameter missing
    tensors["attn.o_proj.weight"] = torch.randn(3, 3)  # matches nothing
    tensors["extra.bias"] = torch.randn(3)
    model = _Model()
    before = _snapshot(model)
    with pytest.raises(WeightsMismatchError) as info:
        load_weights(model, list(tensors.items()), QKV_MAPPING, progress=False)
    error = info.value
    assert error.missing == ["attn.qkv_proj.weight (shards not loaded: 'k')", "cross.q_proj.weight"]
    assert error.unexpected == ["attn.o_proj.weight", "extra.bias"]
    message = str(error)
    for name in ("attn.qkv_proj.weight", "cross.q_proj.weight", "attn.o_proj.weight", "extra.bias"):
        assert name in message
    _assert_unchanged(model, before)
    # Without strict the rest loads.
    loaded = load_weights(model, list(tensors.items()), QKV_MAPPING, strict=False, progress=False)
    assert "cross.q_proj.weight" not in loaded and "attn.xq_proj.weight" in loaded
    assert torch.equal(model.attn.xq_proj.weight, tensors["attn.xq_proj.weight"])


def test_shape_mismatch_is_found_before_any_write():
    tensors = _name_matching_checkpoint()
    tensors["cross.q_proj.weight"] = torch.randn(4, 7)  # default loader
    tensors["attn.v_proj.weight"] = torch.randn(3, 3)  # the parameter's own weight_loader refuses it
    model = _Model()
    before = _snapshot(model)
    with pytest.raises(WeightsMismatchError) as info:
        load_weights(model, list(tensors.items()), QKV_MAPPING, progress=False)
    problems = info.value.problems
    assert len(problems) == 2
    assert re.search(r"attn\.v_proj\.weight -> attn\.qkv_proj\.weight \(shard 'v'\).*expected \(2, 3\), "
                     r"received \(3, 3\)", problems[0])
    assert re.search(r"cross\.q_proj\.weight.*expected shape \(4, 3\), received \(4, 7\)", problems[1])
    _assert_unchanged(model, before)


def test_tp_layer_shape_error_is_found_before_any_write():
    model = nn.Module()
    model.first = nn.Linear(4, 4)
    model.proj = ColumnParallelLinear(4, 6, tp_group=SINGLE)
    before = _snapshot(model)
    tensors = [("first.weight", torch.randn(4, 4)), ("first.bias", torch.randn(4)),
               ("proj.weight", torch.randn(6, 5)), ("proj.bias", torch.randn(6))]
    with pytest.raises(WeightsMismatchError, match=r"proj\.weight: .*expected .*\(6, 4\), received \(6, 5\)"):
        load_weights(model, tensors, progress=False)
    _assert_unchanged(model, before)


class _Normalising(nn.Module):
    """A weight_loader that needs the values to decide (meta tensors have none), and one that lets copy_
    find the shape misfit."""

    def __init__(self) -> None:
        super().__init__()
        self.scaled = nn.Parameter(torch.zeros(4))
        self.scaled.weight_loader = self.load_scaled
        self.plain = nn.Parameter(torch.zeros(2, 3))
        self.plain.weight_loader = lambda param, loaded: param.copy_(loaded[:])

    def load_scaled(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        full = loaded_weight[:]
        param.copy_(full / full.abs().max().item())


def test_trial_run_leaves_data_dependent_loaders_to_the_real_call():
    model = _Normalising()
    scaled, plain = torch.tensor([1.0, -4.0, 2.0, 0.5]), torch.randn(2, 3)
    load_weights(model, [("scaled", scaled), ("plain", plain)], progress=False)
    assert torch.equal(model.scaled, scaled / 4) and torch.equal(model.plain, plain)
    model = _Normalising()
    with pytest.raises(WeightsMismatchError, match=r"plain: The size of tensor a \(3\) must match"):
        load_weights(model, [("scaled", scaled), ("plain", torch.randn(2, 4))], progress=False)
    assert torch.equal(model.scaled, torch.zeros(4))


def test_two_tensors_into_one_parameter():
    tensors = list(_name_matching_checkpoint().items())
    tensors.append(("attn.q_proj.weight", torch.randn(4, 3)))
    with pytest.raises(WeightsMismatchError, match=r"attn\.q_proj\.weight -> attn\.qkv_proj\.weight \(shard "
                                                   r"'q'\): attn\.qkv_proj\.weight is already loaded"):
        load_weights(_Model(), tensors, QKV_MAPPING, progress=False)


def test_casts_to_parameter_dtype(checkpoints, tmp_path):
    path, reference = checkpoints["llama"]
    bf16 = {k: v.to(torch.bfloat16) for k, v in load_file(path / "model.safetensors").items()}
    save_file(bf16, tmp_path / "model.safetensors")
    model = LlamaForCausalLM(reference.config)
    load_weights(model, iter_weights(tmp_path), progress=False)
    for name, param in model.named_parameters():
        assert param.dtype == torch.float32
        assert torch.equal(param, bf16[name].float()), name
    half = nn.Linear(4, 2).to(torch.float16)
    weight = torch.randn(2, 4)
    load_weights(half, [("weight", weight), ("bias", torch.zeros(2))], progress=False)
    assert half.weight.dtype == torch.float16 and torch.equal(half.weight, weight.half())


def test_dtype_that_cannot_fit():
    model = nn.Module()
    model.register_buffer("counts", torch.zeros(3, dtype=torch.int64))
    model.scale = nn.Parameter(torch.zeros(3))
    with pytest.raises(WeightsMismatchError, match=r"counts: dtype torch\.float32 cannot be cast to the "
                                                   r"parameter's torch\.int64"):
        load_weights(model, [("counts", torch.randn(3)), ("scale", torch.randn(3))], progress=False)
    assert torch.equal(model.scale, torch.zeros(3))


def test_rename_and_ignore():
    tensors = {f"transformer.{k}": v for k, v in _name_matching_checkpoint().items()}
    tensors["transformer.attn.rotary_emb.inv_freq"] = torch.randn(2)
    tensors["transformer.attn.masked_bias"] = torch.randn(1)
    model = _Model()
    loaded = load_weights(model, list(tensors.items()), QKV_MAPPING, rename={"transformer": ""},
                          ignore=["rotary_emb.inv_freq", re.compile(r"\.masked_bias$")], progress=False)
    assert loaded == {name for name, _ in model.named_parameters()}
    assert torch.equal(model.cross.q_proj.weight, tensors["transformer.cross.q_proj.weight"])
    # A callable may drop tensors by returning None; a component pattern does not match inside a component.
    model = _Model()
    load_weights(model, list(tensors.items()), QKV_MAPPING, ignore="attn.masked_bias", progress=False,
                 rename=lambda n: None if n.endswith("inv_freq") else n.removeprefix("transformer."))
    with pytest.raises(WeightsMismatchError, match="transformer.attn.masked_bias"):
        load_weights(_Model(), list(tensors.items()), QKV_MAPPING, ignore="masked", progress=False,
                     rename=lambda n: None if n.endswith("inv_freq") else n.removeprefix("transformer."))


def test_bad_arguments():
    tensors = list(_name_matching_checkpoint().items())
    with pytest.raises(ValueError, match=r"stacked_params_mapping\[1\]: expected .*"
                                         r"received \('qkv_proj', 'k_proj'\)"):
        load_weights(_Model(), tensors, [QKV_MAPPING[0], ("qkv_proj", "k_proj")])
    with pytest.raises(TypeError, match="ignore: expected dotted names"):
        load_weights(_Model(), tensors, QKV_MAPPING, ignore=[3])
    with pytest.raises(TypeError, match=r"weights\[0\]: expected a \(name: str, tensor or LazyTensor\) pair"):
        load_weights(_Model(), [("attn.q_proj.weight", [1.0])], QKV_MAPPING)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        load_weights(tensors, tensors)
    with pytest.raises(TypeError, match="rename: expected a callable, a mapping or None"):
        load_weights(_Model(), tensors, QKV_MAPPING, rename=3)


def test_default_weight_loader(checkpoints):
    handle = dict(iter_weights(checkpoints["llama"][0]))["model.norm.weight"]
    param = nn.Parameter(torch.zeros(64, dtype=torch.float64))
    default_weight_loader(param, handle)
    assert param.dtype == torch.float64 and torch.equal(param, handle[:].double())
    with pytest.raises(ValueError, match=r"expected shape \(65,\), received \(64,\)"):
        default_weight_loader(nn.Parameter(torch.zeros(65)), handle)


# --- loading on several threads ---------------------------------------------------------------------------

def test_threads_load_exactly_what_one_thread_loads(checkpoints, monkeypatch):
    path, _ = checkpoints["llama_sharded"]  # 12 files; q/k/v and gate/up stacked into one parameter each
    config = json.loads((path / "config.json").read_text())
    states, reads = [], []
    for num_threads in ("1", "4"):
        monkeypatch.setenv("TPKIT_LOAD_THREADS", num_threads)
        model = TpkitLlama(config, tp_group=SINGLE)  # random: an unloaded parameter would differ
        before = bytes_read()
        model.load_weights(iter_weights(path))
        reads.append(bytes_read() - before)
        states.append(_snapshot(model))
    assert reads[0] == reads[1] > 0
    assert states[0].keys() == states[1].keys()
    for name, tensor in states[0].items():
        assert torch.equal(tensor, states[1][name]), name


def test_default_threads_follow_where_the_copies_run(checkpoints, monkeypatch):
    """Without an argument or TPKIT_LOAD_THREADS: one thread where every tensor goes into a GPU from a
    safetensors file with direct copies on (the CPU copies nothing there), else up to 4."""
    path, _ = checkpoints["llama_sharded"]
    handle = next(iter(iter_weights(path)))[1]  # safetensors

    def loads(*device_types: str, weight: object = handle) -> list:
        return [SimpleNamespace(target=SimpleNamespace(tensor=SimpleNamespace(device=torch.device(t))),
                                weight=weight) for t in device_types]

    monkeypatch.delenv("TPKIT_LOAD_DMA", raising=False)
    monkeypatch.setattr(_direct_copy._State, "failed", False)
    up_to_4 = min(4, os.cpu_count() or 1)
    assert _load_module._default_num_threads(loads("cuda", "cuda")) == 1
    assert _load_module._default_num_threads(loads("cuda", "cpu")) == up_to_4
    assert _load_module._default_num_threads(loads("cpu")) == up_to_4
    assert _load_module._default_num_threads(loads("cuda", weight=torch.zeros(2))) == up_to_4  # a tensor
    monkeypatch.setenv("TPKIT_LOAD_DMA", "0")
    assert _load_module._default_num_threads(loads("cuda")) == up_to_4
    assert _load_module._num_threads(None) is None
    monkeypatch.setenv("TPKIT_LOAD_THREADS", "3")
    assert _load_module._num_threads(None) == 3 and _load_module._num_threads(2) == 2


class _Recording(nn.Module):
    """Parameters of three shards each, whose loader records how many calls run at once per parameter and
    on which threads, and fails (on real data only) where told to."""

    def __init__(self, fail_on: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.fail_on = fail_on
        self.lock = threading.Lock()
        self.running: dict[int, int] = {}
        self.most_at_once = 0
        self.threads: set[int] = set()
        for i in range(4):
            layer = nn.Module()
            layer.w = nn.Parameter(torch.zeros(6, 3))
            layer.w.weight_loader = functools.partial(self.load, i)
            self.add_module(f"l{i}", layer)

    def load(self, layer: int, param: nn.Parameter, loaded_weight: torch.Tensor, shard: int) -> None:
        if param.is_meta:  # the trial run before any write
            param.narrow(0, 2 * shard, 2).copy_(loaded_weight[:])
            return
        with self.lock:
            self.running[layer] = self.running.get(layer, 0) + 1
            self.most_at_once = max(self.most_at_once, self.running[layer])
            self.threads.add(threading.get_ident())
        time.sleep(0.01)
        if (layer, shard) == self.fail_on:
            raise RuntimeError(f"cannot load l{layer} shard {shard}")
        param.narrow(0, 2 * shard, 2).copy_(loaded_weight[:])
        with self.lock:
            self.running[layer] -= 1


STACKED_MAPPING = (("w", "a", 0), ("w", "b", 1), ("w", "c", 2))


def test_loads_into_one_parameter_run_in_order_on_one_thread():
    g = torch.Generator().manual_seed(0)
    tensors = [(f"l{i}.{part}", torch.randn(2, 3, generator=g)) for i in range(4) for part in "abc"]
    model = _Recording()
    load_weights(model, tensors, STACKED_MAPPING, num_threads=4, progress=False)
    assert model.most_at_once == 1  # a parameter's shards never load at the same time
    assert len(model.threads) > 1  # different parameters do
    for i in range(4):
        expected = torch.cat([t for name, t in tensors if name.startswith(f"l{i}.")])
        assert torch.equal(model.get_parameter(f"l{i}.w"), expected)
    with pytest.raises(RuntimeError, match=r"cannot load l2 shard 1"):
        load_weights(_Recording(fail_on=(2, 1)), tensors, STACKED_MAPPING, num_threads=4, progress=False)


def test_threads_load_parameters_made_in_inference_mode():
    """Inference mode is thread-local, and a parameter made in it can only be written in it."""
    g = torch.Generator().manual_seed(0)
    tensors = {"weight": torch.randn(8, 3, generator=g), "bias": torch.randn(8, generator=g)}
    with torch.inference_mode():
        layer = ColumnParallelLinear(3, 8, tp_group=SINGLE)
        load_weights(layer, list(tensors.items()), num_threads=2, progress=False)
    assert torch.equal(layer.weight, tensors["weight"]) and torch.equal(layer.bias, tensors["bias"])


def test_bad_thread_counts(monkeypatch):
    model = _Recording()
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ValueError, match=rf"load_weights: num_threads: expected a positive integer, got "
                                             rf"{re.escape(repr(bad))}"):
            load_weights(model, [], num_threads=bad)
    monkeypatch.setenv("TPKIT_LOAD_THREADS", "many")
    with pytest.raises(ValueError, match=r"TPKIT_LOAD_THREADS: expected a positive integer, got 'many'"):
        load_weights(model, [])


# --- copies into GPUs through page-locked buffers ---------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_pinned_chunk_plan_cuts_rows_and_rows_too_large():
    assert _staging._plan_chunks((10, 4), 4, 48) == [((), 0, 3), ((), 3, 3), ((), 6, 3), ((), 9, 1)]
    assert _staging._plan_chunks((10,), 2, 8) == [((), 0, 4), ((), 4, 4), ((), 8, 2)]  # 1-D: by elements
    assert _staging._plan_chunks((3, 4), 4, 1000) == [((), 0, 3)]
    assert _staging._plan_chunks((3,), 8, 4) == [((), 0, 1), ((), 1, 1), ((), 2, 1)]  # an element at least
    # A row of 80 bytes over a chunk of 40: each row is cut along its own first dimension.
    assert _staging._plan_chunks((2, 5, 4), 4, 40) == [((row,), start, length) for row in range(2)
                                                       for start, length in ((0, 2), (2, 2), (4, 1))]
    assert _staging._plan_chunks((2, 3, 4), 2, 5) == [((row, i), start, length) for row in range(2)
                                                      for i in range(3) for start, length in ((0, 2), (2, 2))]
    assert _staging._plan_chunks((0, 4), 4, 48) == _staging._plan_chunks((4, 0), 4, 48) == []
    with pytest.raises(ValueError, match="0-d"):
        _staging._plan_chunks((), 4, 48)


@pytest.mark.parametrize("shape", [(10, 4), (7,), (3, 5, 4), (2, 3, 1, 9), (1, 64)])
@pytest.mark.parametrize("chunk_bytes", [1, 12, 40, 100, 10_000])
def test_pinned_chunk_plan_covers_every_element_once_in_order(shape, chunk_bytes):
    covered = torch.arange(math.prod(shape)).reshape(shape)
    pieces = [covered[index].narrow(0, start, length)
              for index, start, length in _staging._plan_chunks(shape, 4, chunk_bytes)]
    assert torch.equal(torch.cat([piece.reshape(-1) for piece in pieces]), covered.reshape(-1))
    assert all(piece.numel() * 4 <= chunk_bytes or piece.shape[0] == 1 for piece in pieces)


CopyCase = Callable[[torch.device], tuple[torch.Tensor, torch.Tensor]]


def _copy_cases(rows: int, cols: int) -> dict[str, CopyCase]:
    """(dst on the device, src on the CPU) pairs of one shape each; their sizes scale with rows x cols."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    return {
        "contiguous": lambda d: (torch.zeros(rows, cols, device=d), randn(rows, cols)),
        # A column-parallel layer's rows: both contiguous, at an offset.
        "row shard": lambda d: (torch.zeros(3 * rows, cols, device=d).narrow(0, rows, rows),
                                randn(2 * rows, cols).narrow(0, rows, rows)),
        # A row-parallel layer's columns: both strided.
        "column shard": lambda d: (torch.zeros(rows, 3 * cols, device=d).narrow(1, cols, cols),
                                   randn(rows, 2 * cols).narrow(1, cols, cols)),
        "float32 into bfloat16": lambda d: (torch.zeros(rows, cols, dtype=torch.bfloat16, device=d),
                                            randn(rows, cols)),
        "bfloat16 column shard into float32": lambda d: (
            torch.zeros(rows, 2 * cols, device=d).narrow(1, cols, cols),
            randn(rows, 3 * cols).to(torch.bfloat16).narrow(1, 0, cols)),
        "rows larger than a chunk": lambda d: (torch.zeros(2, rows, cols, device=d), randn(2, rows, cols)),
        "1-D": lambda d: (torch.zeros(rows * cols + 3, device=d), randn(rows * cols + 3)),
        "0-D": lambda d: (torch.zeros((), device=d), randn(())),
    }


CPU_CASES = _copy_cases(7, 5)


@pytest.mark.parametrize("case", list(CPU_CASES))
def test_pinned_staged_copy_on_cpu_matches_copy(case):
    """The chunk loop, with a CPU destination and ordinary buffers of 64 bytes: many chunks, each copied
    synchronously; the same values as one copy_."""
    dst, src = CPU_CASES[case](torch.device("cpu"))
    expected = dst.clone().copy_(src)
    buffers = (torch.empty(64, dtype=torch.uint8), torch.empty(64, dtype=torch.uint8))
    _staging._staged_copy(dst, src, buffers)
    assert torch.equal(dst, expected)


def test_pinned_staging_switch(monkeypatch):
    monkeypatch.delenv("TPKIT_LOAD_PINNED", raising=False)
    assert _staging._staging_enabled()
    for off in ("0", "false", " Off ", "no"):
        monkeypatch.setenv("TPKIT_LOAD_PINNED", off)
        assert not _staging._staging_enabled()
    monkeypatch.setenv("TPKIT_LOAD_PINNED", "1")
    assert _staging._staging_enabled()


def _count_staged_copies(monkeypatch) -> list[tuple[torch.Size, torch.dtype]]:
    calls = []
    staged_copy = _staging._staged_copy

    def counting(dst, src, buffers):
        calls.append((src.shape, src.dtype))
        staged_copy(dst, src, buffers)

    monkeypatch.setattr(_staging, "_staged_copy", counting)
    return calls


# About 32 MiB in float32: several 8 MiB chunks, the last one shorter; a row of the 3-D case spans several.
GPU_CASES = _copy_cases(2053, 4099)


@needs_cuda
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_pinned_copy_into_gpu_matches_plain_copy(case, monkeypatch):
    monkeypatch.delenv("TPKIT_LOAD_PINNED", raising=False)
    calls = _count_staged_copies(monkeypatch)
    dst, src = GPU_CASES[case](torch.device("cuda"))
    expected = dst.clone().copy_(src)  # from pageable memory, cast on the CPU
    with torch.no_grad():
        staged = _staging.copy_into(dst, src)
        if not staged:
            dst.copy_(src)
    assert torch.equal(dst, expected)
    assert staged == (case != "0-D") and len(calls) == int(staged)  # small tensors are left to copy_


@needs_cuda
def test_pinned_load_weights_into_gpu_matches_pageable(tmp_path, monkeypatch):
    """Lazy file views into tpkit layers and a plain parameter on the GPU, on 4 threads and on the calling
    thread, in and out of inference mode (the buffers are made in it, then written outside): the values of
    copies straight from pageable memory."""
    g = torch.Generator().manual_seed(0)
    tensors = {"up.weight": torch.randn(3000, 1024, generator=g), "up.bias": torch.randn(3000, generator=g),
               "down.weight": torch.randn(1024, 3000, generator=g),
               "scale": torch.randn(1_500_000, generator=g)}  # default_weight_loader: a plain copy_
    save_file(tensors, tmp_path / "model.safetensors")

    def build() -> nn.Module:
        model = nn.Module()
        model.up = ColumnParallelLinear(1024, 3000, tp_group=SINGLE, params_dtype=torch.bfloat16,
                                        device="cuda")
        model.down = RowParallelLinear(3000, 1024, bias=False, tp_group=SINGLE, device="cuda")
        model.scale = nn.Parameter(torch.zeros(1_500_000, dtype=torch.bfloat16, device="cuda"))
        return model

    calls = _count_staged_copies(monkeypatch)
    monkeypatch.setenv("TPKIT_LOAD_DMA", "0")  # staging itself, not the direct copies from the file
    monkeypatch.setattr(_staging._STAGING, "pair", None)  # this thread's made afresh, in inference mode
    states = []
    for pinned, threads, inference in (("0", 4, False), ("1", 4, True), ("1", 1, True), ("1", 1, False)):
        monkeypatch.setenv("TPKIT_LOAD_PINNED", pinned)
        calls.clear()
        with torch.inference_mode(inference):
            model = build()
            load_weights(model, iter_weights(tmp_path), num_threads=threads, progress=False)
        # The layers' weights and the plain parameter; the bias is under 1 MiB.
        assert len(calls) == (0 if pinned == "0" else 3)
        states.append(_snapshot(model))
    for state in states[1:]:
        for name, tensor in states[0].items():
            assert torch.equal(state[name], tensor), name
    # A row-parallel layer's columns at tp_size 2: a strided view of the file map.
    handle = dict(iter_weights(tmp_path))["down.weight"]
    param = torch.zeros(1024, 1500, dtype=torch.bfloat16, device="cuda")
    _loading._copy_pieces(param, handle, 1, [(0, 1500, 1500)])
    assert torch.equal(param, tensors["down.weight"][:, 1500:].to(torch.bfloat16).cuda())


# --- direct copies from the page cache into a GPU -----------------------------------------------------------

def _save_bf16(path: Path, rows: int, cols: int) -> torch.Tensor:
    """One bf16 tensor after a small one, so that its bytes start inside a page; returns it."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(rows, cols, generator=g).to(torch.bfloat16)
    save_file({"a.bias": torch.randn(37, generator=g).to(torch.bfloat16), "b.weight": weight}, path)
    return weight


def test_direct_copy_file_offset_of_parts(tmp_path):
    """Where a handle's views lie in the file: the bytes there are the view's (the whole and row ranges)."""
    weight = _save_bf16(tmp_path / "model.safetensors", 300, 200)
    handle = dict(iter_weights(tmp_path))["b.weight"]
    with open(tmp_path / "model.safetensors", "rb") as file:
        for part in (handle[:], handle.narrow(0, 7, 100), handle[150:]):
            offset = handle._file_offset(part)
            file.seek(offset)
            stored = torch.frombuffer(bytearray(file.read(part.numel() * 2)), dtype=torch.bfloat16)
            assert torch.equal(stored.view(part.shape), part)
    assert torch.equal(handle[150:], weight[150:])


@pytest.mark.parametrize("failing_piece", [None, 0, 2])
def test_direct_copy_pieces_and_registrations(tmp_path, monkeypatch, failing_piece):
    """One loading's copies with CPU destinations and recorded page-locking calls: pieces of whole pages,
    consecutive and not overlapping, each registered once although two parts share pieces; a piece that
    fails to register is copied all the same; on release every registered piece is unregistered; the bytes
    are the parts'."""
    weight = _save_bf16(tmp_path / "model.safetensors", 64, 1000)  # 128,000 bytes: 32 pages
    handle = dict(iter_weights(tmp_path))["b.weight"]
    page = _direct_copy.mmap.PAGESIZE
    monkeypatch.setattr(_direct_copy, "_PIECE_BYTES", 3 * page)
    registered, unregistered = [], []

    def register(address: int, nbytes: int) -> bool:
        ok = len(registered) != failing_piece
        registered.append((address, nbytes, ok))
        return ok

    copies = _direct_copy.DirectCopies(register, unregistered.append)
    rows = [(3, 50), (40, 24)]  # each starts and ends inside a page; they share a piece
    outputs = [torch.zeros(n, 1000, dtype=torch.bfloat16) for _, n in rows]
    for (start, n), dst in zip(rows, outputs, strict=True):
        copies.copy(dst, handle.file, handle._file_offset(handle.narrow(0, start, n)))
    for (start, n), dst in zip(rows, outputs, strict=True):
        assert torch.equal(dst, weight[start:start + n])
    registered.sort()
    assert all(address % page == 0 and nbytes % page == 0 for address, nbytes, _ in registered)
    for (a, n, _), (b, _, _) in itertools.pairwise(registered):
        assert a + n == b  # consecutive, not overlapping: each piece once
    base = copies._files[handle.file].host.data_ptr()  # where the map starts: file offset 0
    first_byte = handle._file_offset(handle.narrow(0, 3, 1))
    end_byte = handle._file_offset(handle[:]) + 128_000  # the tensor's end
    assert registered[0][0] - base == first_byte - first_byte % (3 * page)  # pieces start at multiples
    assert end_byte <= registered[-1][0] + registered[-1][1] - base < end_byte + 3 * page
    assert not unregistered
    copies.release(handle.file)
    assert sorted(unregistered) == [address for address, _, ok in registered if ok]
    copies.release(handle.file)  # released already: nothing more
    assert len(unregistered) == sum(ok for _, _, ok in registered)


def _mapped_kib(address: int) -> int:
    """The resident KiB of the mapping that starts at ``address`` (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(rf"0*{address:x}-", line):
            return next(int(entry.split()[1]) for entry in lines[i + 1:] if entry.startswith("Rss:"))
    raise AssertionError(f"no mapping starts at {address:#x}")


def test_direct_copy_pinned_bytes_bounded(tmp_path, monkeypatch):
    """With room for two pieces: a registration never takes the pinned bytes past that; pieces are
    registered in file order, each once, and unregistered oldest first; a piece needed again after that is
    registered again; the bytes are the tensor's; unpinned pages leave the process's page tables; on release
    nothing stays pinned."""
    weight = _save_bf16(tmp_path / "model.safetensors", 64, 1000)  # 128,000 bytes: 32 pages
    handle = dict(iter_weights(tmp_path))["b.weight"]
    page = _direct_copy.mmap.PAGESIZE
    monkeypatch.setattr(_direct_copy, "_PIECE_BYTES", 3 * page)
    monkeypatch.setattr(_direct_copy, "_MAX_PINNED_BYTES", 6 * page)
    pinned: dict[int, int] = {}
    calls = []

    def register(address: int, nbytes: int) -> bool:
        assert sum(pinned.values()) + nbytes <= 6 * page
        pinned[address] = nbytes
        calls.append(("register", address))
        return True

    def unregister(address: int) -> None:
        del pinned[address]
        calls.append(("unregister", address))

    copies = _direct_copy.DirectCopies(register, unregister)
    dst = torch.zeros(64, 1000, dtype=torch.bfloat16)
    copies.copy(dst, handle.file, handle._file_offset(handle[:]))
    assert torch.equal(dst, weight)
    registered = [address for call, address in calls if call == "register"]
    unregistered = [address for call, address in calls if call == "unregister"]
    assert len(registered) >= 11 and registered == sorted(set(registered))
    assert unregistered == registered[:-2] and len(pinned) == 2
    file = copies._files[handle.file]
    # The copies read all 32 pages through the map; unpinned pieces left the process's page tables. Mapped
    # now: the two pinned pieces and what the last read fault mapped around it (64 KiB, fault_around_bytes).
    if Path("/proc/self/smaps").exists():
        assert _mapped_kib(file.host.data_ptr()) * 1024 <= 6 * page + 64 * 1024 < 32 * page
    calls.clear()
    first_rows = torch.zeros(2, 1000, dtype=torch.bfloat16)
    copies.copy(first_rows, handle.file, handle._file_offset(handle.narrow(0, 0, 2)))
    assert torch.equal(first_rows, weight[:2])
    assert calls == [("unregister", registered[-2]), ("register", registered[0])]
    copies.release(handle.file)
    assert not pinned


def test_direct_copy_threads_share_pieces(tmp_path, monkeypatch):
    """Four threads copying rows of one tensor through one loading, with room for three pieces: no
    registration overlaps a pinned range, none is of a piece in use by another thread's copy (it is never
    unpinned under it), every row arrives, and on close nothing stays pinned."""
    weight = _save_bf16(tmp_path / "model.safetensors", 512, 1000)  # 1,024,000 bytes: 250 pages
    handle = dict(iter_weights(tmp_path))["b.weight"]
    page = _direct_copy.mmap.PAGESIZE
    monkeypatch.setattr(_direct_copy, "_PIECE_BYTES", 2 * page)
    monkeypatch.setattr(_direct_copy, "_MAX_PINNED_BYTES", 6 * page)
    pinned: dict[int, int] = {}
    lock = threading.Lock()

    def register(address: int, nbytes: int) -> bool:
        with lock:
            assert all(address + nbytes <= a or a + n <= address for a, n in pinned.items())
            pinned[address] = nbytes
        time.sleep(0.0005)
        return True

    def unregister(address: int) -> None:
        with lock:
            del pinned[address]

    unpin = _direct_copy.DirectCopies._unpin
    unpinned = []

    def checked_unpin(self, piece) -> None:
        assert piece.users == 0  # no copy is being queued from it
        unpinned.append(piece.lo)
        unpin(self, piece)

    monkeypatch.setattr(_direct_copy.DirectCopies, "_unpin", checked_unpin)
    dst = torch.zeros(512, 1000, dtype=torch.bfloat16)
    with _direct_copy.DirectCopies(register, unregister) as copies:
        errors = []

        def copy_rows(first: int) -> None:
            try:
                for start in range(first, 512, 16):  # each thread every fourth block of 4 rows
                    part = handle.narrow(0, start, 4)
                    copies.copy(dst[start:start + 4], handle.file, handle._file_offset(part))
            except BaseException as error:  # noqa: BLE001 - failed in the test's thread below
                errors.append(error)

        threads = [threading.Thread(target=copy_rows, args=(4 * i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        assert sum(pinned.values()) <= 6 * page + 4 * 2 * page  # over only while each thread holds one
    assert torch.equal(dst, weight) and not pinned and len(unpinned) >= 120


def test_direct_copy_loading_routes_copies(tmp_path, monkeypatch):
    """Inside ``loading(copies)`` a thread's copies go through that loading, which keeps its pieces
    registered until released; outside, each copy registers and unregisters its own."""
    weight = _save_bf16(tmp_path / "model.safetensors", 256, 1024)
    handle = dict(iter_weights(tmp_path))["b.weight"]
    calls = []
    monkeypatch.setattr(_direct_copy, "_cuda_register", lambda address, n: calls.append("register") or True)
    monkeypatch.setattr(_direct_copy, "_cuda_unregister", lambda address: calls.append("unregister"))
    offset = handle._file_offset(handle[:])
    dst = torch.zeros(256, 1024, dtype=torch.bfloat16)
    _direct_copy.copy_file_range(dst, handle.file, offset)
    assert torch.equal(dst, weight) and calls == ["register", "unregister"]
    calls.clear()
    with _direct_copy.DirectCopies() as copies, _direct_copy.loading(copies):
        for _ in range(3):
            dst.zero_()
            _direct_copy.copy_file_range(dst, handle.file, offset)
            assert torch.equal(dst, weight)
        assert calls == ["register"]
    assert calls == ["register", "unregister"] and _direct_copy._ACTIVE.copies is None
    with pytest.raises(ValueError, match=r"inside the file's .* received"):
        _direct_copy.copy_file_range(dst, handle.file, handle.file.stat().st_size - 100)


def test_direct_copy_views_by_their_span(tmp_path):
    """A column shard and a cast, copied (CPU destinations, recorded page-locking) by the span of file bytes
    from their first element to their last, then taken with their strides (also into a strided
    destination): the values are the parts'."""
    weight = _save_bf16(tmp_path / "model.safetensors", 256, 1024)
    handle = dict(iter_weights(tmp_path))["b.weight"]
    registered = []
    copies = _direct_copy.DirectCopies(lambda address, n: registered.append((address, n)) or True,
                                       lambda address: None)
    column = handle.narrow(1, 300, 400)  # [256, 400], rows 2048 bytes apart
    assert _direct_copy.span_bytes(column) == (255 * 1024 + 400) * 2
    assert _direct_copy.span_bytes(handle.narrow(0, 5, 10)) == 10 * 1024 * 2
    assert _direct_copy.span_bytes(handle.narrow(1, 0, 0)) == 0
    with _direct_copy.loading(copies):
        dst = torch.zeros(256, 400, dtype=torch.float32)
        _direct_copy.copy_file_view(dst, handle.file, handle._file_offset(column), column)
        assert torch.equal(dst, weight[:, 300:700].float())
        out = torch.zeros(1024, 256, dtype=torch.bfloat16).t()  # a strided destination
        whole = handle.narrow(1, 0, 1024)
        _direct_copy.copy_file_view(out, handle.file, handle._file_offset(whole), whole)
        assert torch.equal(out, weight)
    assert len(registered) == 1  # the file's one piece, registered once for both copies
    copies.close()


def test_direct_copy_worth_it_by_span(monkeypatch):
    """Into a GPU only (here a stand-in destination), parts of 1 MiB or more whose span is at most
    _MAX_SPAN_RATIO times their bytes, any dtype."""
    monkeypatch.delenv("TPKIT_LOAD_DMA", raising=False)
    monkeypatch.setattr(_direct_copy._State, "failed", False)
    full = torch.zeros(1024, 4096, dtype=torch.bfloat16)  # 8 MiB

    def gpu(part: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> SimpleNamespace:
        return SimpleNamespace(device=torch.device("cuda"), shape=part.shape, dtype=dtype)

    assert _direct_copy.worth_it(gpu(full), full)
    assert _direct_copy.worth_it(gpu(full, torch.float32), full)  # a cast
    assert _direct_copy.worth_it(gpu(full[:, :512]), full[:, :512])  # 1 MiB spanning 8x: the limit
    assert not _direct_copy.worth_it(gpu(full[:, :511]), full[:, :511])  # under 1 MiB
    assert not _direct_copy.worth_it(gpu(full[:512, ::16]), full[:512, ::16])  # spans 16x
    assert not _direct_copy.worth_it(SimpleNamespace(device=torch.device("cpu"), shape=full.shape), full)


def test_direct_copy_declines(tmp_path, monkeypatch):
    """Not into a CPU tensor (copy_to writes nothing then); the switch."""
    _save_bf16(tmp_path / "model.safetensors", 1024, 1024)  # 2 MiB
    handle = dict(iter_weights(tmp_path))["b.weight"]
    part = handle[:]
    dst = torch.zeros(1024, 1024, dtype=torch.bfloat16)
    assert not handle.copy_to(dst, part)
    assert not dst.any()
    monkeypatch.delenv("TPKIT_LOAD_DMA", raising=False)
    assert _direct_copy.enabled()
    for off in ("0", "false", " Off ", "no"):
        monkeypatch.setenv("TPKIT_LOAD_DMA", off)
        assert not _direct_copy.enabled()


@needs_cuda
def test_direct_copy_into_gpu(tmp_path, monkeypatch):
    """Into GPU parameters through load_weights: the whole tensor, a cast (float32 into bfloat16), a plain
    parameter (default_weight_loader), then row and column shards (a column-parallel layer's rows at
    tp_size 2, a row-parallel layer's columns) all copy straight from the file, the contiguous ones into
    the parameter, the others by their span through a GPU buffer; a part that spans more than
    _MAX_SPAN_RATIO times its bytes is staged; every value is the checkpoint's, every page unregistered."""
    g = torch.Generator().manual_seed(0)
    tensors = {"up.weight": torch.randn(3000, 1024, generator=g).to(torch.bfloat16),
               "down.weight": torch.randn(1024, 3000, generator=g),  # float32 into bfloat16
               "scale": torch.randn(1_500_000, generator=g).to(torch.bfloat16)}
    save_file(tensors, tmp_path / "model.safetensors")
    monkeypatch.delenv("TPKIT_LOAD_DMA", raising=False)
    monkeypatch.setattr(_direct_copy._State, "failed", False)
    direct, straight = [], []  # the parts copied from the file; those copied into the parameter itself
    copy_file_view, copy_file_range = _direct_copy.copy_file_view, _direct_copy.copy_file_range

    def counting_view(dst, path, offset, part):
        direct.append(tuple(part.shape))
        copy_file_view(dst, path, offset, part)

    def counting_range(dst, path, offset):
        if dst.dtype != torch.uint8:
            straight.append(tuple(dst.shape))
        copy_file_range(dst, path, offset)

    monkeypatch.setattr(_direct_copy, "copy_file_view", counting_view)
    monkeypatch.setattr(_direct_copy, "copy_file_range", counting_range)
    pinned = []
    register, unregister = _direct_copy._cuda_register, _direct_copy._cuda_unregister

    def recording_register(address: int, nbytes: int) -> bool:
        ok = register(address, nbytes)
        if ok:
            pinned.append(address)
        return ok

    def recording_unregister(address: int) -> None:
        unregister(address)
        pinned.remove(address)

    monkeypatch.setattr(_direct_copy, "_cuda_register", recording_register)
    monkeypatch.setattr(_direct_copy, "_cuda_unregister", recording_unregister)
    model = nn.Module()
    model.up = ColumnParallelLinear(1024, 3000, bias=False, tp_group=SINGLE, params_dtype=torch.bfloat16,
                                    device="cuda")
    model.down = RowParallelLinear(3000, 1024, bias=False, tp_group=SINGLE, params_dtype=torch.bfloat16,
                                   device="cuda")
    model.scale = nn.Parameter(torch.zeros(1_500_000, dtype=torch.bfloat16, device="cuda"))
    load_weights(model, iter_weights(tmp_path), num_threads=4, progress=False)
    assert sorted(direct) == sorted([(1024, 3000), (1_500_000,), (3000, 1024)])
    assert sorted(straight) == sorted([(1_500_000,), (3000, 1024)])  # the cast went through a buffer
    assert not _direct_copy._State.failed
    assert not pinned  # every piece registered was unregistered once its copies were done
    assert torch.equal(model.up.weight.cpu(), tensors["up.weight"])
    assert torch.equal(model.down.weight.cpu(), tensors["down.weight"].to(torch.bfloat16))
    assert torch.equal(model.scale.cpu(), tensors["scale"])
    direct.clear()
    handle = dict(iter_weights(tmp_path))["up.weight"]
    for rank in range(2):  # rows [1500 * rank, 1500 * (rank + 1)); then columns [512 * rank, ...)
        param = torch.zeros(1500, 1024, dtype=torch.bfloat16, device="cuda")
        _loading._copy_pieces(param, handle, 0, [(0, 1500 * rank, 1500)])
        assert torch.equal(param.cpu(), tensors["up.weight"][1500 * rank:1500 * (rank + 1)])
        param = torch.zeros(3000, 512, dtype=torch.bfloat16, device="cuda")
        _loading._copy_pieces(param, handle, 1, [(0, 512 * rank, 512)])
        assert torch.equal(param.cpu(), tensors["up.weight"][:, 512 * rank:512 * (rank + 1)])
    monkeypatch.setattr(_direct_copy, "_MAX_SPAN_RATIO", 1.5)  # a column half spans 2x its bytes: staged
    param = torch.zeros(3000, 512, dtype=torch.bfloat16, device="cuda")
    _loading._copy_pieces(param, handle, 1, [(0, 512, 512)])
    assert torch.equal(param.cpu(), tensors["up.weight"][:, 512:])
    assert direct == [(1500, 1024), (3000, 512)] * 2 and not pinned
    torch.zeros(1, device="cuda").add_(1)  # no CUDA error left behind
    torch.cuda.synchronize()


# --- progress bar and log line ------------------------------------------------------------------------------

def test_progress_bar_and_log_line(checkpoints, caplog, capsys, monkeypatch):
    """The log line names this process's rank; only rank 0 shows the bar (under torchrun, others none)."""
    path, reference = checkpoints["llama_sharded"]
    model = LlamaForCausalLM(reference.config)
    rank = dist.get_rank() if dist.is_initialized() else 0
    with caplog.at_level(logging.INFO, logger="tpkit.loaders"):
        load_weights(model, iter_weights(path), progress=True)
    assert re.search(rf"rank {rank}: loaded \d+ tensors from \d+ files \(\d+ thread\(s\)\): [\d.]+ GB read "
                     r"in [\d.]+ s \([\d.]+ GB/s\)", caplog.text)
    assert ("Loading checkpoint" in capsys.readouterr().err) == (rank == 0)
    monkeypatch.setenv("TPKIT_DISABLE_PROGRESS", "1")
    load_weights(model, iter_weights(path))
    assert "Loading checkpoint" not in capsys.readouterr().err


# --- bad checkpoints: a clear error before anything is yielded or written -----------------------------------

def test_missing_path_and_no_weight_files(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="does not exist"):
        iter_weights(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointNotFoundError, match=r"no weight files in .*searched for "
                                                      r"model\.safetensors\.index\.json, model\.safetensors"):
        iter_weights(tmp_path)


def _copy_checkpoint(source: Path, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def test_truncated_safetensors_names_the_file(checkpoints, tmp_path):
    path = _copy_checkpoint(checkpoints["llama_sharded"][0], tmp_path / "ckpt")
    last = sorted(path.glob("*.safetensors"))[-1]
    data = last.read_bytes()
    last.write_bytes(data[:-10])
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(last))}: truncated safetensors file: "
                                              r"tensor .* ends at data byte \d+, the file holds \d+ bytes"):
        iter_weights(path)
    last.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match=rf"{re.escape(last.name)}: not a safetensors file"):
        iter_weights(path)


def test_corrupt_safetensors_header(tmp_path):
    file = tmp_path / "model.safetensors"
    save_file({"a": torch.randn(4, 4)}, file)
    data = bytearray(file.read_bytes())
    (header_len,) = struct.unpack("<Q", data[:8])
    file.write_bytes(struct.pack("<Q", 1 << 40) + data[8:])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt or truncated safetensors file: "
                                              r"header"):
        iter_weights(tmp_path)
    header = json.loads(data[8:8 + header_len])
    header["a"]["shape"] = [4, 5]
    raw = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + header_len:])
    with pytest.raises(CheckpointError, match=r"tensor 'a' \(F32, shape \(4, 5\)\) needs 80 bytes, its "
                                              r"data_offsets span 64"):
        iter_weights(tmp_path)
    data[8:12] = b"\xff\xfe{]"
    file.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        iter_weights(tmp_path)


@pytest.mark.parametrize("target", ["../outside.safetensors", "/tmp/outside.safetensors",
                                    "a/../../x.safetensors"])
def test_index_pointing_outside_the_checkpoint(checkpoints, tmp_path, target):
    path = _copy_checkpoint(checkpoints["llama_sharded"][0], tmp_path / "ckpt")
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = target
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"weight_map\['{re.escape(name)}'\] = '{re.escape(target)}' "
                                              r"points outside the checkpoint directory"):
        iter_weights(path)


def test_index_and_files_disagree(checkpoints, tmp_path):
    path = _copy_checkpoint(checkpoints["llama_sharded"][0], tmp_path / "ckpt")
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    first_file = sorted(index["weight_map"].values())[0]
    index["weight_map"]["model.layers.9.mlp.up_proj.weight"] = first_file
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"puts tensor 'model\.layers\.9\.mlp\.up_proj\.weight' in "
                                              rf"{re.escape(first_file)}, but no file has it"):
        iter_weights(path)
    index["weight_map"]["x"] = "model-00009-of-00009.safetensors"
    index_file.write_text(json.dumps(index))
    with pytest.raises(CheckpointNotFoundError, match="lists model-00009-of-00009.safetensors, which is "
                                                      "not in"):
        iter_weights(path)


# --- PyTorch .bin files: weights_only, never arbitrary pickles ---------------------------------------------

class _NotATensor:
    pass


def test_bin_checkpoint_loads_through_weights_only(checkpoints, tmp_path):
    path, reference = checkpoints["llama"]
    tensors = load_file(path / "model.safetensors")
    torch.save(tensors, tmp_path / "pytorch_model.bin")
    shutil.copy(path / "config.json", tmp_path / "config.json")
    weights = dict(iter_weights(tmp_path))
    assert weights.keys() == tensors.keys()
    handle = weights["model.layers.1.self_attn.o_proj.weight"]
    reset_bytes_read()
    assert torch.equal(handle[:, 16:48], tensors["model.layers.1.self_attn.o_proj.weight"][:, 16:48])
    assert bytes_read() == 64 * 32 * 4
    model = LlamaForCausalLM(reference.config)
    load_weights(model, iter_weights(tmp_path), progress=False)
    assert torch.equal(model.lm_head.weight, reference.lm_head.weight)
    # Safetensors win when both are there.
    save_file({"only": torch.zeros(1)}, tmp_path / "model.safetensors")
    assert [name for name, _ in iter_weights(tmp_path)] == ["only"]


def test_bin_with_arbitrary_objects_is_refused(tmp_path):
    torch.save({"weight": torch.zeros(2), "evil": _NotATensor()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin: cannot be loaded with "
                                              r"torch\.load\(weights_only=True\)"):
        list(iter_weights(tmp_path))
    torch.save({"nested": {"weight": torch.zeros(2)}}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="expected a flat dict of tensor name -> tensor"):
        list(iter_weights(tmp_path))
