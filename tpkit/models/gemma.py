"""Gemma 2 and Gemma 3 (text) for causal LM, tensor-parallel: Llama's attention and MLP layers with
Gemma's differences around them.

- RMSNorm scales by ``1 + weight`` (``RMSNorm(unit_offset=True)``), four norms a layer: before and after
  attention, before and after the MLP (the "sandwich");
- the embeddings are scaled by ``sqrt(hidden_size)``, that factor rounded to the model's dtype first, as
  transformers rounds it;
- attention scales its scores by ``query_pre_attn_scalar ** -0.5``; local (sliding-window) and global
  layers alternate as ``layer_types`` says (:mod:`tpkit.models.layer_types`); Gemma 2 soft-caps the scores
  (``attn_logit_softcapping``), Gemma 3 norms q and k per head and gives each layer type its own RoPE
  (``rope_local_base_freq`` for the local layers);
- the MLP's gate goes through tanh GELU (``hidden_activation``); the LM head is tied to the embeddings and
  Gemma 2 soft-caps its logits (``final_logit_softcapping``, the head's ``logits_soft_cap``: the logits of
  ``model(input_ids)``, of generation and of ``lm_head.cross_entropy`` alike).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from tpkit.attention import AttentionMetadata, PagedKVCache
from tpkit.loaders import load_weights
from tpkit.models.config_checks import GEMMA, check_config
from tpkit.models.generation import PagedDecoderOnlyLM
from tpkit.models.layer_types import LAYER_TYPES, family, layer_types, rope_parameters_by_type, window_sizes
from tpkit.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, head_norms
from tpkit.models.prompts import parse_eos_token_ids
from tpkit.models.sequence_parallel import check_sequence_parallel, exit_sequence_parallel, mark_norms
from tpkit.ops import RMSNorm, RotaryEmbedding, decode_linear
from tpkit.parallel_layers import ParallelLMHead, VocabParallelEmbedding, set_linear_op


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: Mapping[str, Any], layer_idx: int, *, factory: dict[str, Any],
                 **attention: Any) -> None:
        super().__init__()
        hidden_size, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
        norm = dict(dtype=factory["params_dtype"], device=factory["device"], unit_offset=True)
        self.input_layernorm = RMSNorm(hidden_size, eps, **norm)
        self.self_attn = LlamaAttention(config, layer_idx, factory=factory, **attention)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, **norm)
        self.pre_feedforward_layernorm = RMSNorm(hidden_size, eps, **norm)
        self.mlp = LlamaMLP(config, factory, config.get("hidden_activation") or "gelu_pytorch_tanh")
        self.post_feedforward_layernorm = RMSNorm(hidden_size, eps, **norm)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: PagedKVCache | None,
                metadata: AttentionMetadata | None) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, metadata)
        x = x + self.post_attention_layernorm(attended)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaForCausalLM(PagedDecoderOnlyLM):
    """Gemma 2 / Gemma 3 (text) from a HuggingFace config.json dict, this rank's shard of it.

    Parameters are randomly initialised; :meth:`load_weights` (or :func:`tpkit.models.from_pretrained`)
    loads a HuggingFace checkpoint.
    """

    stacked_params_mapping = LlamaForCausalLM.stacked_params_mapping

    def __init__(self, config: Mapping[str, Any], *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, tp_group: Any = None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        check_config("GemmaForCausalLM", config, GEMMA, dtype=dtype, device=device, tp_group=tp_group,
                     sequence_parallel=sequence_parallel)
        is_gemma3 = family(config) == "gemma3_text"
        types, windows = layer_types(config), window_sizes(config)
        dtype = dtype or torch.get_default_dtype()
        factory = {"params_dtype": dtype, "device": device, "tp_group": tp_group}
        hidden_size, vocab_size = config["hidden_size"], config["vocab_size"]
        bias = config.get("attention_bias", False)
        attention = dict(qkv_bias=bias, o_bias=bias, qk_norm=is_gemma3, norm_unit_offset=True,
                         scale=config.get("query_pre_attn_scalar", 256) ** -0.5,
                         logits_soft_cap=config.get("attn_logit_softcapping"))

        self.config = dict(config)
        self.vocab_size = vocab_size
        self.max_positions = config["max_position_embeddings"]
        self.eos_token_ids = parse_eos_token_ids(config.get("eos_token_id"))
        self.embed_tokens = VocabParallelEmbedding(vocab_size, hidden_size,
                                                   sequence_parallel=sequence_parallel, **factory)
        # sqrt(hidden_size) rounded to the model's dtype, as transformers multiplies by it.
        self.embed_scale = float(torch.tensor(hidden_size ** 0.5).to(dtype))
        self.sequence_parallel = sequence_parallel
        layer_factory = {**factory, "sequence_parallel": sequence_parallel}
        self.layer_types = types
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i, factory=layer_factory, window_size=windows[i], **attention)
            for i in range(config["num_hidden_layers"])
        )
        self.norm = RMSNorm(hidden_size, config.get("rms_norm_eps", 1e-6), dtype=dtype, device=device,
                            unit_offset=True)
        if sequence_parallel:
            mark_norms(self, RMSNorm, exclude=head_norms(self))
        self.final_logit_softcapping = config.get("final_logit_softcapping")
        self.lm_head = ParallelLMHead(vocab_size, hidden_size, logits_soft_cap=self.final_logit_softcapping,
                                      **factory)
        self.tie_word_embeddings = config.get("tie_word_embeddings", True)
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.embed_tokens)
        attention_layer = self.layers[0].self_attn
        self.tp_group = self.embed_tokens.tp_group
        self.num_layers = len(self.layers)
        self.num_heads, self.num_kv_heads = attention_layer.num_heads, attention_layer.num_kv_heads
        self.head_size = attention_layer.head_size
        # One table a layer type (Gemma 3's local and global layers rotate with different bases).
        rope = rope_parameters_by_type(config)
        tables = {}
        for t in LAYER_TYPES:
            key = repr(sorted(rope[t].items()))
            if key not in tables:
                tables[key] = RotaryEmbedding(self.head_size, self.max_positions, rope[t], device=device)
            rope[t] = tables[key]
        self.rotary_emb = nn.ModuleDict(rope)
        set_linear_op(self, decode_linear)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      kv_cache: PagedKVCache | None = None,
                      metadata: AttentionMetadata | None = None) -> torch.Tensor:
        if self.sequence_parallel:
            check_sequence_parallel(input_ids, self.tp_group, kv_cache is not None)
        x = self.embed_tokens(input_ids) * self.embed_scale  # [batch, seq, hidden]; sequence-parallel a share
        rotations = {t: self.rotary_emb[t].cos_sin(positions, x.dtype) for t in set(self.layer_types)}
        for layer, layer_type in zip(self.layers, self.layer_types, strict=True):
            x = layer(x, *rotations[layer_type], kv_cache, metadata)
        x = self.norm(x)
        return exit_sequence_parallel(x, self.tp_group) if self.sequence_parallel else x

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Load HuggingFace ``(name, tensor)`` pairs (``model.`` prefix); returns the parameters loaded."""
        return load_weights(self, weights, self.stacked_params_mapping,
                            rename=lambda name: name.removeprefix("model."), ignore="rotary_emb.inv_freq")
