"""tpkit's BartForConditionalGeneration against transformers: logits and greedy generation, tp_size 1, 2, 4.

Encoder-decoder with QKVCrossParallelLinear cross-attention over a cross KV cache filled at prefill,
learned positions with offset 2, sqrt(d_model) embedding scale, tied embeddings and final_logits_bias.
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import make_bart_checkpoint
from model_parity import hf_greedy, run_parity

# Encoder inputs of different lengths, BOS ... EOS as a tokenizer writes them.
PROMPTS = [[0, 5, 6, 7, 8, 2], [0, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 2], [0, 20, 2],
           [0, 30, 31, 32, 33, 34, 35, 36, 2]]
MAX_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def bart(tmp_path_factory):
    path = tmp_path_factory.mktemp("bart")
    hf_model = make_bart_checkpoint(path, scale_embedding=True)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, hf_model.config.vocab_size, (2, 11), generator=generator)
    decoder_input_ids = torch.randint(3, hf_model.config.vocab_size, (2, 7), generator=generator)
    with torch.no_grad():
        logits = hf_model(input_ids=input_ids, decoder_input_ids=decoder_input_ids).logits
    refs = {"forward_args": (input_ids, decoder_input_ids), "ref_logits": logits, "prompts": PROMPTS,
            "ref_tokens": hf_greedy(hf_model, PROMPTS, MAX_NEW_TOKENS)}
    return str(path), hf_model, refs


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_bart(ranks, bart, tp_size):
    hf_model = bart[1]
    assert hf_model.final_logits_bias.abs().sum() > 0
    run_parity(ranks, bart, tp_size, total_num_kv_heads=hf_model.config.decoder_attention_heads)
