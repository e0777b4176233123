"""tpkit's LlamaForCausalLM against transformers: logits and greedy generation, at tp_size 1, 2 and 4.

Variants: GQA with 2 KV heads (replicated at tp 4), tied embeddings with q/k/v/o bias and llama3 RoPE
scaling saved as a transformers-4 config.json, and Qwen2 (q/k/v bias only).
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from checkpoints import make_checkpoint, make_llama_checkpoint
from model_parity import decoder_only_references, run_parity
from packaging.version import Version
from transformers import Qwen2Config, Qwen2ForCausalLM

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [20], [30, 31, 32, 33, 34, 35, 36]]
MAX_NEW_TOKENS = 32
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def _llama3_rope_config() -> dict:
    """LLAMA3_ROPE as the installed transformers' config takes it."""
    if Version(transformers.__version__).major >= 5:
        return {"rope_parameters": dict(LLAMA3_ROPE)}
    return {"rope_theta": LLAMA3_ROPE["rope_theta"],
            "rope_scaling": {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}}


def _as_transformers4_config(path) -> None:
    """Rewrite config.json as transformers 4 wrote it: rope_theta + rope_scaling, torch_dtype (a no-op when
    transformers 4 wrote it)."""
    file = path / "config.json"
    config = json.loads(file.read_text())
    if "rope_parameters" not in config:
        return
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    config["torch_dtype"] = config.pop("dtype")
    file.write_text(json.dumps(config))


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    hf_model = make_llama_checkpoint(path, num_key_value_heads=2)
    return str(path), hf_model, decoder_only_references(hf_model, PROMPTS, MAX_NEW_TOKENS)


@pytest.fixture(scope="module")
def llama_tied_bias_llama3(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_tied")
    hf_model = make_llama_checkpoint(path, tie_word_embeddings=True, attention_bias=True,
                                     **_llama3_rope_config(), max_shard_size="40KB")
    _as_transformers4_config(path)
    return str(path), hf_model, decoder_only_references(hf_model, PROMPTS, MAX_NEW_TOKENS)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2")
    config = Qwen2Config(vocab_size=256, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         initializer_range=0.2, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0)
    hf_model = make_checkpoint(Qwen2ForCausalLM, config, path)
    return str(path), hf_model, decoder_only_references(hf_model, PROMPTS, MAX_NEW_TOKENS)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_llama_gqa(ranks, llama, tp_size):
    run_parity(ranks, llama, tp_size, total_num_kv_heads=2)


def test_llama_tied_bias_llama3_rope_transformers4_config(ranks, llama_tied_bias_llama3):
    assert llama_tied_bias_llama3[1].model.layers[0].self_attn.o_proj.bias is not None
    run_parity(ranks, llama_tied_bias_llama3, 2, total_num_kv_heads=2)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_qwen2_qkv_bias(ranks, qwen2, tp_size):
    assert qwen2[1].model.layers[0].self_attn.o_proj.bias is None
    run_parity(ranks, qwen2, tp_size, total_num_kv_heads=2)


def test_llama3_inverse_frequencies_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tpkit.ops import inverse_frequencies, rope_parameters

    transformers4 = {"max_position_embeddings": 8192, "rope_theta": 500000.0,
                     "rope_scaling": {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
                     | {"original_max_position_embeddings": 2048}}
    if Version(transformers.__version__).major >= 5:
        config = LlamaConfig(hidden_size=512, num_attention_heads=4, max_position_embeddings=8192,
                             rope_parameters=dict(LLAMA3_ROPE, original_max_position_embeddings=2048))
    else:
        config = LlamaConfig(hidden_size=512, num_attention_heads=4, **transformers4)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](config, None)  # device None: the CPU (positional in 4.x)
    for config_json in (config.to_dict(), transformers4):
        assert torch.equal(inverse_frequencies(128, rope_parameters(config_json)), expected)


def test_unsupported_rope_type_is_a_clear_error():
    from tpkit.ops import inverse_frequencies

    supported = "default, linear, llama3, dynamic, yarn, longrope"
    with pytest.raises(ValueError, match=f"'proportional' is not supported; supported: {supported}"):
        inverse_frequencies(16, {"rope_type": "proportional", "rope_theta": 10000.0})
