"""tpkit.loaders on bad checkpoint files: a clear error before anything is yielded or written, and PyTorch
.bin files read through weights_only, never as arbitrary pickles."""

from __future__ import annotations

import json
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM

from tpkit.loaders import (
    CheckpointError,
    CheckpointNotFoundError,
    bytes_read,
    iter_weights,
    load_weights,
    reset_bytes_read,
)

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
