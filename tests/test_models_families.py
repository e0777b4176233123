"""Qwen3, Mistral, Qwen2 with sliding windows, Gemma 2 and Gemma 3 against transformers: logits and greedy
generation through the paged cache, at tp_size 1, 2 and 4 (its 2 KV heads replicated), and on the GPU.

Windows are 8 tokens wide and the prompts (11 tokens) plus the generated tokens run past them, so a window
ignored would change the tokens (each fixture checks that transformers' own logits change without it).
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import make_checkpoint
from model_parity import decoder_only_references, run_parity
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [20], [30, 31, 32, 33, 34, 35, 36]]
MAX_NEW_TOKENS = 16
WINDOW = 8
SMALL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
             initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0)
GEMMA = dict(SMALL, num_hidden_layers=3, sliding_window=WINDOW, query_pre_attn_scalar=24)

FAMILIES = {
    "qwen3": (Qwen3ForCausalLM, Qwen3Config, dict(SMALL)),
    "mistral": (MistralForCausalLM, MistralConfig, dict(SMALL, sliding_window=WINDOW)),
    # The second layer slides (max_window_layers 1), the first attends to every key.
    "qwen2_sliding": (Qwen2ForCausalLM, Qwen2Config, dict(SMALL, use_sliding_window=True,
                                                          sliding_window=WINDOW, max_window_layers=1)),
    # Eager attention: some transformers releases drop the scores' soft cap under SDPA.
    "gemma2": (Gemma2ForCausalLM, Gemma2Config, dict(GEMMA, attn_logit_softcapping=3.0,
                                                     final_logit_softcapping=5.0,
                                                     attn_implementation="eager")),
    # Local layers (0 and 2) rotate with base 100, the global layer with linear scaling over base 10000.
    "gemma3": (Gemma3ForCausalLM, Gemma3TextConfig, dict(GEMMA, sliding_window_pattern=2, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}})),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            model_class, config_class, kwargs = FAMILIES[name]
            path = tmp_path_factory.mktemp(name)
            hf_model = make_checkpoint(model_class, config_class(**kwargs), path)
            refs = decoder_only_references(hf_model, PROMPTS, MAX_NEW_TOKENS)
            if hf_model.config.sliding_window is not None:
                hf_model.config.sliding_window = None if name == "mistral" else 10**6
                with torch.no_grad():
                    unwindowed = hf_model(*refs["forward_args"]).logits
                assert not torch.allclose(unwindowed, refs["ref_logits"], atol=1e-3)
            made[name] = str(path), hf_model, refs
        return made[name]

    return get


@pytest.mark.parametrize("tp_size", [1, 2, 4])  # at 4, the 2 KV heads replicated
@pytest.mark.parametrize("name", ["qwen3", "mistral", "gemma2", "gemma3"])
def test_family_parity(ranks, checkpoint, name, tp_size):
    run_parity(ranks, checkpoint(name), tp_size, total_num_kv_heads=2)


def test_qwen2_sliding_window_parity(ranks, checkpoint):
    run_parity(ranks, checkpoint("qwen2_sliding"), 2, total_num_kv_heads=2)


def test_layer_windows_and_attention_settings(checkpoint):
    """What each family's layers were built with (the parity above would hide a setting that happens not to
    matter for these weights)."""
    from tpkit.models import from_pretrained

    windows = {}
    for name in ("mistral", "qwen2_sliding", "gemma2", "gemma3", "qwen3"):
        layers = from_pretrained(checkpoint(name)[0]).layers
        windows[name] = [layer.self_attn.attn.window_size for layer in layers]
    local_global = [WINDOW, None, WINDOW]
    assert windows == {"mistral": [WINDOW] * 2, "qwen2_sliding": [None, WINDOW], "gemma2": local_global,
                       "gemma3": local_global, "qwen3": [None] * 2}
    gemma2 = from_pretrained(checkpoint("gemma2")[0])
    attn = gemma2.layers[0].self_attn.attn
    assert attn.logits_soft_cap == 3.0 and attn.scale == 24 ** -0.5 and gemma2.lm_head.logits_soft_cap == 5.0


@pytest.mark.parametrize("config, match", [
    (dict(layer_types=["sliding_attention", "chunked_attention"]),
     "layer_types: expected a list of 2 entries"),
    (dict(layer_types=["full_attention"]), "layer_types: expected a list of 2 entries"),
    (dict(sliding_window=0), "sliding_window: expected an int in"),
    (dict(use_bidirectional_attention=True), "use_bidirectional_attention: expected false or absent"),
    (dict(rope_parameters={"rope_type": "proportional", "rope_theta": 1e4}),
     "rope_type 'proportional' is not supported; supported: default, linear, llama3, dynamic, yarn, "
     "longrope"),
])
def test_bad_family_configs(config, match):
    from tpkit.models import LlamaForCausalLM

    base = {k: v for k, v in SMALL.items() if k not in ("initializer_range", "bos_token_id", "pad_token_id")}
    with pytest.raises(ValueError, match=match):
        LlamaForCausalLM({**base, "architectures": ["MistralForCausalLM"], "model_type": "mistral", **config})


def test_chunked_prefill_and_prefix_cache_keep_the_window(checkpoint):
    """Prompts prefilled in chunks of 5 tokens (a window spanning chunks and cached tokens), then again with
    their first blocks of 4 from the prefix cache: transformers' tokens both times."""
    from tpkit.models import from_pretrained

    path, _, refs = checkpoint("mistral")
    model = from_pretrained(path, device="cpu")  # blocks of 4: the PyTorch implementation's, not the kernels'
    model.kv_block_size = 4
    for _ in range(2):
        tokens = model.generate(refs["prompts"], MAX_NEW_TOKENS, ignore_eos=True, max_prefill_tokens=5,
                                prefix_caching=True)
        assert tokens == refs["ref_tokens"]


@pytest.mark.parametrize("name", ["mistral", "qwen3"])
def test_fused_decode_forced_keeps_the_tokens(checkpoint, name):
    """``fused_decode = True`` (the fused decode step's PyTorch expressions on the CPU) keeps Mistral's
    window; Qwen3, whose q/k norms the fused step has not, stays on the layers' forward."""
    from tpkit.models import from_pretrained

    path, _, refs = checkpoint(name)
    model = from_pretrained(path)
    model.fused_decode = True
    assert model.generate(refs["prompts"], MAX_NEW_TOKENS, ignore_eos=True) == refs["ref_tokens"]


def test_bad_gemma_config():
    from tpkit.models import GemmaForCausalLM

    config = {**GEMMA, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
              "query_pre_attn_scalar": 0, "final_logit_softcapping": -1.0}
    with pytest.raises(ValueError, match=r"query_pre_attn_scalar: expected a finite number > 0, got 0; "
                                         r"final_logit_softcapping: expected a finite number > 0, got -1.0"):
        GemmaForCausalLM(config)


def _same_up_to_ties(hf_model, prompts, tokens, ref_tokens, tolerance=1e-4) -> bool:
    """tpkit's greedy tokens equal transformers', or first differ where transformers' own logits for the two
    tokens are within ``tolerance`` (a tie that float32 rounding in another order may break either way:
    Gemma 2's final soft cap squashes large logits together)."""
    for prompt, got, want in zip(prompts, tokens, ref_tokens, strict=True):
        for i, (a, b) in enumerate(zip(got, want, strict=True)):
            if a != b:
                with torch.no_grad():
                    logits = hf_model(torch.tensor([prompt + want[:i]])).logits[0, -1]
                if abs(float(logits[a] - logits[b])) > tolerance:
                    return False
                break
    return True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cuda_graph", [False, True])
@pytest.mark.parametrize("name", ["qwen3", "mistral", "qwen2_sliding", "gemma2", "gemma3"])
def test_family_tokens_on_gpu(checkpoint, name, cuda_graph):
    """On the GPU (float32: the kernels' windows, soft caps and per-layer settings), greedy generation
    through the paged cache, eager and replayed from CUDA graphs, gives transformers' tokens (up to ties);
    with blocks of 8 tokens the 8-token windows mostly start inside a block."""
    from tpkit.models import from_pretrained

    path, hf_model, refs = checkpoint(name)
    model = from_pretrained(path, device="cuda", dtype=torch.float32)
    model.kv_block_size = 8
    tokens = model.generate(refs["prompts"], MAX_NEW_TOKENS, ignore_eos=True, cuda_graph=cuda_graph)
    assert _same_up_to_ties(hf_model, refs["prompts"], tokens, refs["ref_tokens"]), (
        f"tpkit {tokens} != transformers {refs['ref_tokens']}")
