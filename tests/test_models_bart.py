"""tpkit's BartForConditionalGeneration against transformers: logits and greedy generation, tp_size 1, 2, 4.

Encoder-decoder with QKVCrossParallelLinear cross-attention over a cross KV cache filled at prefill,
learned positions with offset 2, sqrt(d_model) embedding scale, tied embeddings and final_logits_bias.
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import make_bart_checkpoint, random_token_ids
from model_parity import hf_greedy, run_parity

from tpkit.models import from_pretrained
from tpkit.parallel_layers import TPGroup

# Encoder inputs of different lengths, BOS ... EOS as a tokenizer writes them.
PROMPTS = [[0, 5, 6, 7, 8, 2], [0, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 2], [0, 20, 2],
           [0, 30, 31, 32, 33, 34, 35, 36, 2]]
MAX_NEW_TOKENS = 32


@pytest.fixture(scope="module")
def bart(tmp_path_factory):
    path = tmp_path_factory.mktemp("bart")
    hf_model = make_bart_checkpoint(path, scale_embedding=True)
    input_ids, decoder_input_ids = random_token_ids(hf_model.config.vocab_size, (2, 11), (2, 7), seed=1)
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


def test_forced_bos_and_eos_tokens_as_transformers(tmp_path):
    """BART configs force the first new token to BOS and the last to EOS (bart-large-cnn's does both);
    generate does as transformers does, also when both fall on one step (max_new_tokens 1)."""
    hf_model = make_bart_checkpoint(tmp_path, forced_eos_token_id=2, seed=3)
    # Where bart-large-cnn keeps it (transformers 5 drops forced_bos_token_id from config.json).
    hf_model.generation_config.forced_bos_token_id = 0
    hf_model.generation_config.save_pretrained(tmp_path)
    model = from_pretrained(tmp_path, tp_group=TPGroup(None, 0, 1), device="cpu")
    for max_new_tokens in (12, 1):
        expected = hf_greedy(hf_model, PROMPTS, max_new_tokens)
        assert model.generate(PROMPTS, max_new_tokens, ignore_eos=True) == expected
    assert all(tokens[0] == 0 and tokens[-1] == 2 for tokens in hf_greedy(hf_model, PROMPTS, 12))


def test_packed_encoder_ranks_backends_without_per_shape_setup_first(bart, monkeypatch):
    """``encode_packed`` runs the encoder's attention with FlashAttention first and cuDNN's (which builds a
    graph per new shape) last, whatever order was in force; the caller's order is back afterwards, and the
    states equal the unpacked encoder's rows."""
    model = from_pretrained(bart[0], tp_group=TPGroup(None, 0, 1), device="cpu")
    orders = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(*args, **kwargs):
        orders.append(torch._C._get_sdp_priority_order())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    backends = torch.nn.attention.SDPBackend
    cudnn, flash = int(backends.CUDNN_ATTENTION), int(backends.FLASH_ATTENTION)
    no_setup = [int(backends.FLASH_ATTENTION), int(backends.EFFICIENT_ATTENTION), int(backends.MATH)]
    before = torch._C._get_sdp_priority_order()
    cudnn_first = [cudnn] + [b for b in before if b != cudnn]
    torch._C._set_sdp_priority_order(cudnn_first)
    try:
        with torch.no_grad():
            packed = model.encode_packed(PROMPTS)  # [1, sum(prompt lengths), d_model]
        after = torch._C._get_sdp_priority_order()
    finally:
        torch._C._set_sdp_priority_order(before)
    assert orders and all(order[0] == flash and all(order.index(cudnn) > order.index(b) for b in no_setup)
                          for order in orders)
    assert after == cudnn_first
    with torch.no_grad():
        rows = [model.encode(torch.tensor([ids]))[0] for ids in PROMPTS]
    torch.testing.assert_close(packed[0], torch.cat(rows), rtol=1e-5, atol=1e-5)
