"""Float8 checkpoints through ``from_pretrained``: tiny Llamas written with ``safetensors`` in each published
format (compressed-tensors per-channel dynamic and per-tensor static, fbgemm_fp8, block-wise fp8 as
DeepSeek-V3 and Qwen3-FP8, per-tensor fp8) and a float32 one quantized on load, each against transformers
holding the dequantized weights; a bfloat16 model of the dequantized weights gives the same logits; tp 2."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from checkpoints import make_llama_checkpoint, random_token_ids
from model_parity import LOGITS_TOLERANCE
from multirank import device
from safetensors.torch import load_file, save_file
from test_fp8_linear import dequantize, quantize
from transformers import LlamaConfig, LlamaForCausalLM

from tpkit.loaders import CheckpointError

_LINEAR = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")
(INPUT_IDS,) = random_token_ids(256, (2, 7), seed=5)


def _compressed_tensors(strategy: str, activations: dict) -> dict:
    """compressed-tensors' quantization_config: one group of float 8-bit weights with ``strategy`` and
    float 8-bit input activations as ``activations`` says."""
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "quantization_status": "compressed", "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
                            "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, **activations}}}}


FORMATS = {
    "compressed-tensors-channel": ("channel", "weight_scale", False,
                                   _compressed_tensors("channel", {"strategy": "token", "dynamic": True})),
    "compressed-tensors-tensor-static": (
        "tensor", "weight_scale", True,
        _compressed_tensors("tensor", {"strategy": "tensor", "dynamic": False})),
    "fbgemm_fp8": ("channel", "weight_scale", False, {
        "quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]}),
    "fp8-block": ("block", "weight_scale_inv", False, {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}),
    "fp8-tensor": ("tensor", "weight_scale", False, {"quant_method": "fp8", "activation_scheme": "dynamic"}),
}


def _write(path: Path, weights: dict, config: dict, source: Path) -> str:
    path.mkdir(parents=True, exist_ok=True)
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config))
    shutil.copy(source / "generation_config.json", path / "generation_config.json")
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Per format: (float8 checkpoint, dequantized float32 checkpoint, transformers' float32 logits of the
    dequantized weights); plus the float32 original with its per-channel quantize-on-load reference."""
    root = tmp_path_factory.mktemp("fp8")
    make_llama_checkpoint(root / "float32", num_key_value_heads=2)
    original = load_file(root / "float32" / "model.safetensors")
    config = json.loads((root / "float32" / "config.json").read_text())
    made = {}
    for name, (scheme, scale_name, static, quant) in {**FORMATS, "quantize-on-load": ("channel", None, False,
                                                                                      None)}.items():
        weights, dequantized = dict(original), dict(original)
        for key, w in original.items():
            if not _LINEAR.search(key):
                continue
            q, s = quantize(w, scheme)
            dequantized[key] = dequantize(q, s, scheme).float()
            weights[key], weights[key.replace(".weight", "." + str(scale_name))] = q, s
            if static:
                weights[key.replace(".weight", ".input_scale")] = torch.tensor([0.02])
            if name == "fbgemm_fp8":
                weights[key.replace(".weight", ".input_scale_ub")] = torch.tensor([1200.0])
        hf = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"}))
        hf.load_state_dict(dequantized)
        with torch.no_grad():
            logits = hf.eval()(INPUT_IDS).logits
        source = root / "float32"
        fp8 = (str(source) if quant is None
               else _write(root / name, weights, {**config, "quantization_config": quant}, source))
        made[name] = (fp8, _write(root / f"{name}-dequantized", dequantized, config, source), logits)
    return made


@pytest.mark.parametrize("name", [*FORMATS, "quantize-on-load"])
def test_each_format_matches_transformers_on_its_dequantized_weights(checkpoints, name):
    from tpkit.models import from_pretrained

    path, _, reference = checkpoints[name]
    model = from_pretrained(path, device="cpu", dtype=torch.float32,
                            quantization="fp8" if name == "quantize-on-load" else None)
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.quant_method is not None
    with torch.no_grad():
        torch.testing.assert_close(model(INPUT_IDS), reference, **LOGITS_TOLERANCE)


def test_bfloat16_model_of_the_dequantized_weights_gives_the_same_logits(checkpoints):
    from tpkit.models import from_pretrained

    path, dequantized, _ = checkpoints["fp8-block"]
    fp8 = from_pretrained(path, device="cpu", dtype=torch.bfloat16)
    bf16 = from_pretrained(dequantized, device="cpu", dtype=torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(fp8(INPUT_IDS), bf16(INPUT_IDS))
    assert fp8.generate([[5, 6, 7]], 4, ignore_eos=True) == bf16.generate([[5, 6, 7]], 4, ignore_eos=True)


def _logits_at(path, tp_size):
    from tpkit.models import from_pretrained
    from tpkit.parallel_layers import init_tensor_parallel

    init_tensor_parallel(tp_size)
    model = from_pretrained(path, device=device(), dtype=torch.float32)
    with torch.no_grad():
        return model(INPUT_IDS.to(device())).cpu()


def test_tp2_shards_the_block_scales(ranks, checkpoints):
    path, _, reference = checkpoints["fp8-block"]
    for logits in ranks.run(2, _logits_at, path, 2):
        torch.testing.assert_close(logits, reference, **LOGITS_TOLERANCE)


@pytest.mark.parametrize("change,message", [
    (dict(quant_method="awq"),
     r"quant_method: expected 'compressed-tensors', 'fbgemm_fp8' or 'fp8', got 'awq'"),
    (dict(modules_to_not_convert=["model.layers.0.mlp.down_proj"]),
     r"modules_to_not_convert: leaving 'model.layers.0.mlp.down_proj' unquantized is not supported"),
    (dict(activation_scheme="static"), r"block-wise weights take dynamic activations"),
    (dict(fmt="e5m2"), r"fmt: expected 'e4m3', got 'e5m2'"),
])
def test_unsupported_configs_are_named(checkpoints, tmp_path, change, message):
    from tpkit.models import from_pretrained

    path = Path(checkpoints["fp8-block"][0])
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {**config["quantization_config"], **change}
    for file in ("model.safetensors", "generation_config.json"):
        shutil.copy(path / file, tmp_path / file)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        from_pretrained(str(tmp_path), device="cpu")


def test_an_unknown_quantization_is_refused(checkpoints):
    from tpkit.models import from_pretrained

    with pytest.raises(ValueError, match=r"quantization: expected None or one of \['fp8'\], got 'int4'"):
        from_pretrained(checkpoints["fp8-block"][0], device="cpu", quantization="int4")
