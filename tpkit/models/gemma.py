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

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tpkit.attention import AttentionMetadata, PagedKVCache
from tpkit.models.config_checks import GEMMA
from tpkit.models.layer_types import family
from tpkit.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP
from tpkit.ops import RMSNorm


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


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 / Gemma 3 (text) from a HuggingFace config.json dict, this rank's shard of it: Llama's model
    with Gemma's layers, norms, embedding scale and attention settings.

    Parameters are randomly initialised; :meth:`load_weights` (or :func:`tpkit.models.from_pretrained`)
    loads a HuggingFace checkpoint.
    """

    fused_decode = False  # the fused decode step computes Llama's layers, not the sandwich
    fused_fp8 = False  # so does the fused float8 step
    config_schema = GEMMA
    layer_class = GemmaDecoderLayer
    norm_unit_offset = True
    tie_word_embeddings_default = True

    def _attention_settings(self, config: Mapping[str, Any]) -> dict[str, Any]:
        bias = config.get("attention_bias", False)
        return dict(qkv_bias=bias, o_bias=bias, qk_norm=family(config) == "gemma3_text",
                    norm_unit_offset=True, scale=config.get("query_pre_attn_scalar", 256) ** -0.5,
                    logits_soft_cap=config.get("attn_logit_softcapping"))

    def _embed_scale(self, config: Mapping[str, Any], dtype: torch.dtype) -> float | None:
        # sqrt(hidden_size) rounded to the model's dtype, as transformers multiplies by it.
        return float(torch.tensor(config["hidden_size"] ** 0.5).to(dtype))
