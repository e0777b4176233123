"""tpkit's GPTBigCodeForCausalLM against transformers: logits and greedy generation, at tp_size 1, 2 and 4.

Multi-query attention (one KV head, replicated on every rank) loaded from the fused ``c_attn`` through the
QKV layer's fused path, from a sharded checkpoint; and multi-head ``c_attn`` (q, k, v interleaved per head).
"""

from __future__ import annotations

import pytest
from checkpoints import make_gpt_bigcode_checkpoint
from model_parity import decoder_only_references, run_parity

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25], [26, 27]]
MAX_NEW_TOKENS = 32


def _checkpoint(tmp_path_factory, name: str, **kwargs) -> tuple[str, object, dict]:
    path = tmp_path_factory.mktemp(name)
    hf_model = make_gpt_bigcode_checkpoint(path, **kwargs)
    return str(path), hf_model, decoder_only_references(hf_model, PROMPTS, MAX_NEW_TOKENS)


@pytest.fixture(scope="module")
def mqa(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "gpt_bigcode_mqa", multi_query=True, max_shard_size="40KB")


@pytest.fixture(scope="module")
def mha(tmp_path_factory):
    return _checkpoint(tmp_path_factory, "gpt_bigcode_mha", multi_query=False)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_gpt_bigcode_mqa(ranks, mqa, tp_size):
    run_parity(ranks, mqa, tp_size, total_num_kv_heads=1)


def test_gpt_bigcode_multi_head_interleaved_c_attn(ranks, mha):
    run_parity(ranks, mha, 2, total_num_kv_heads=mha[1].config.n_head)
