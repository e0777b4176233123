"""The RoPE schedules of long-context releases (yarn, dynamic, longrope) against transformers: their
frequencies and cos/sin factor, and a Llama's logits and greedy tokens with each of yarn and longrope."""

from __future__ import annotations

import pytest
import torch
from checkpoints import make_llama_checkpoint
from model_parity import decoder_only_references, run_parity
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tpkit.ops import attention_factor, inverse_frequencies, rope_parameters

HEAD_SIZE = 32
SCHEDULES = {
    "yarn": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn_mscale": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0,
                    "original_max_position_embeddings": 16, "beta_fast": 16, "beta_slow": 2, "mscale": 1.0,
                    "mscale_all_dim": 0.8},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
    # Prompts stay within the 16 original positions and generation goes past them.
    "longrope": {"rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 16,
                 "short_factor": [1.0 + 0.05 * i for i in range(HEAD_SIZE // 2)],
                 "long_factor": [1.5 + 0.4 * i for i in range(HEAD_SIZE // 2)]},
}


def _config(name: str, **kwargs) -> LlamaConfig:
    return LlamaConfig(hidden_size=128, num_attention_heads=4, max_position_embeddings=128,
                       rope_parameters=dict(SCHEDULES[name]), **kwargs)


@pytest.mark.parametrize("name", SCHEDULES)
def test_frequencies_match_transformers(name):
    config = _config(name)
    params = rope_parameters(config.to_dict())
    expected, factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, None)
    assert torch.equal(inverse_frequencies(HEAD_SIZE, params), expected)
    assert attention_factor(params) == factor
    if name == "longrope":
        long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=17)
        assert torch.equal(inverse_frequencies(HEAD_SIZE, params, long=True), long)
        assert not torch.equal(long, expected)


def test_transformers4_yarn_config_reads_alike():
    """Qwen2.5's long-context recipe as transformers 4 wrote it: ``rope_scaling`` with ``type``."""
    config = {"max_position_embeddings": 128, "rope_theta": 1e6,
              "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}}
    assert rope_parameters(config) == rope_parameters(_config("yarn").to_dict()) | {"rope_type": "yarn"}


@pytest.fixture(scope="module", params=["yarn", "longrope"])
def scaled_llama(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf_model = make_llama_checkpoint(path, rope_parameters=dict(SCHEDULES[request.param]),
                                     max_position_embeddings=128)
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]
    return str(path), hf_model, decoder_only_references(hf_model, prompts, 12)


def test_scaled_rope_parity(ranks, scaled_llama):
    run_parity(ranks, scaled_llama, 1, total_num_kv_heads=2)


@pytest.mark.parametrize("params, match", [
    ({"rope_type": "yarn", "factor": 0.0, "original_max_position_embeddings": 32},
     "factor: expected a finite number > 0 for rope_type 'yarn', got 0.0"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": -1},
     "beta_fast: expected a finite number > 0 for rope_type 'yarn', got -1"),
    (dict(SCHEDULES["longrope"], long_factor=[1.0] * 3),
     r"long_factor: expected 16 numbers \(head_size / 2\), got 3"),
    (dict(SCHEDULES["longrope"], short_factor="1.0"),
     "short_factor: expected a list of finite numbers > 0 for rope_type 'longrope', got '1.0'"),
])
def test_bad_scaling_settings(params, match):
    full = rope_parameters({"max_position_embeddings": 128, "rope_parameters": params})
    with pytest.raises(ValueError, match=match):
        inverse_frequencies(HEAD_SIZE, full, long=True)
