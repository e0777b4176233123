"""Tiny Hugging Face checkpoints with random weights, made on the spot: nothing is downloaded.

Every factory builds a ``transformers`` model from a small config (hidden 64, 2 layers, vocab 256), draws
every parameter at random from a seeded generator (biases and norm weights too: ``transformers`` would set
them to 0 and 1, and a dropped bias would go unnoticed), with an initializer range raised to 0.2 so greedy
tokens are not near-ties, saves it in float32 with ``save_pretrained`` (sharded with ``max_shard_size``)
plus its generation config, and returns the model in eval mode. The caller's RNG state is left untouched.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    GPTBigCodeConfig,
    GPTBigCodeForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
)

INITIALIZER_RANGE = 0.2
# Norm weights are drawn around 1 and biases around 0 with this spread.
AFFINE_STD = 0.2

_SMALL = dict(vocab_size=256, initializer_range=INITIALIZER_RANGE)


def make_llama_checkpoint(path: str | os.PathLike, *, tie_word_embeddings: bool = False,
                          num_key_value_heads: int = 2, attention_bias: bool = False,
                          max_shard_size: int | str | None = None, seed: int = 0,
                          **config_overrides: object) -> LlamaForCausalLM:
    """A Llama with GQA (4 query heads of 32, ``num_key_value_heads`` KV heads), SwiGLU and RMSNorm;
    ``attention_bias`` gives q/k/v/o biases (Qwen2 style)."""
    config = LlamaConfig(**{**_SMALL, **dict(
        hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=num_key_value_heads, max_position_embeddings=256, rms_norm_eps=1e-6,
        tie_word_embeddings=tie_word_embeddings, attention_bias=attention_bias,
        bos_token_id=1, eos_token_id=2, pad_token_id=0), **config_overrides})
    return make_checkpoint(LlamaForCausalLM, config, path, seed, max_shard_size)


def make_gpt_bigcode_checkpoint(path: str | os.PathLike, *, multi_query: bool = True,
                                max_shard_size: int | str | None = None, seed: int = 0,
                                **config_overrides: object) -> GPTBigCodeForCausalLM:
    """A GPTBigCode (StarCoder family): multi-query attention stored as one fused ``c_attn`` tensor
    (q rows, then the single k and v head), learned positions, LayerNorm with bias, tied LM head."""
    config = GPTBigCodeConfig(**{**_SMALL, **dict(
        n_embd=128, n_inner=128, n_layer=2, n_head=4, n_positions=256, multi_query=multi_query,
        activation_function="gelu_pytorch_tanh", bos_token_id=0, eos_token_id=0), **config_overrides})
    return make_checkpoint(GPTBigCodeForCausalLM, config, path, seed, max_shard_size)


def make_bart_checkpoint(path: str | os.PathLike, *, max_shard_size: int | str | None = None, seed: int = 0,
                         **config_overrides: object) -> BartForConditionalGeneration:
    """A BART encoder-decoder with tied embeddings and a random ``final_logits_bias``. ``forced_eos_token_id``
    is off so greedy generation is plain argmax (pass it in ``config_overrides`` to turn it back on)."""
    config = BartConfig(**{**_SMALL, **dict(
        d_model=128, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=256, init_std=INITIALIZER_RANGE,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=None,
        forced_bos_token_id=None), **config_overrides})
    return make_checkpoint(BartForConditionalGeneration, config, path, seed, max_shard_size)


def random_token_ids(vocab_size: int, *shapes: tuple[int, ...], seed: int) -> list[torch.Tensor]:
    """One tensor of token ids per shape, drawn from [3, vocab_size): clear of the special ids below 3
    (BART's BOS 0, pad 1 and EOS 2), so that no model masks or stops on them."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, shape, generator=generator) for shape in shapes]


def make_checkpoint(model_class: type[PreTrainedModel], config: object, path: str | os.PathLike,
                    seed: int = 0, max_shard_size: int | str | None = None) -> PreTrainedModel:
    """Any transformers model class and config, randomised and saved like the factories above."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config).to(torch.float32)
        _randomise(model)
    model.eval()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if hasattr(model, "should_save_on_this_rank"):
        # transformers 5 writes only on rank 0 of an initialised torch.distributed world; under torchrun
        # every rank makes its own checkpoint in its own directory.
        model.should_save_on_this_rank = lambda is_main_process: is_main_process
    model.save_pretrained(path, **({} if max_shard_size is None else {"max_shard_size": max_shard_size}))
    if not (path / "generation_config.json").is_file():
        model.generation_config.save_pretrained(path)
    return model


@torch.no_grad()
def _randomise(model: nn.Module) -> None:
    """Every parameter (and BART's ``final_logits_bias`` buffer) drawn at random from the global RNG."""
    for module in model.modules():
        is_norm = "Norm" in type(module).__name__
        for name, param in module.named_parameters(recurse=False):
            if is_norm and name == "weight":
                param.normal_(1.0, AFFINE_STD)
            elif param.ndim == 1:
                param.normal_(0.0, AFFINE_STD)
            else:
                param.normal_(0.0, INITIALIZER_RANGE)
    for name, buffer in model.named_buffers():
        if name.endswith("final_logits_bias"):
            buffer.normal_(0.0, AFFINE_STD)
