"""tpkit.loaders on checkpoints made here with transformers: lazy reads, names, strictness, bad files."""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import struct
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import BartForConditionalGeneration, GPTBigCodeForCausalLM, LlamaForCausalLM

from tpkit.loaders import (
    CheckpointError,
    LazyTensor,
    WeightsMismatchError,
    _direct_copy,
    bytes_read,
    default_weight_loader,
    iter_weights,
    load_weights,
    reset_bytes_read,
)
from tpkit.loaders import load as _load_module
from tpkit.models import LlamaForCausalLM as TpkitLlama
from tpkit.parallel_layers import ColumnParallelLinear, TPGroup

# tp_size 1 without init_tensor_parallel, also under torchrun (where torch.distributed is initialised).
SINGLE = TPGroup(None, 0, 1)

HF_CLASSES = {"llama": LlamaForCausalLM, "llama_sharded": LlamaForCausalLM, "llama_tied": LlamaForCausalLM,
              "gpt_bigcode": GPTBigCodeForCausalLM, "bart": BartForConditionalGeneration}


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
