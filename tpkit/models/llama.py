"""Llama (and Qwen2) for causal LM, tensor-parallel, from tpkit layers.

A layer: RMSNorm -> QKVParallelLinear -> RoPE -> Attention (paged) -> RowParallelLinear (all-reduce) ->
RMSNorm -> MergedColumnParallelLinear (gate, up) -> SiLU(gate) * up -> RowParallelLinear (all-reduce).
GQA with any KV-head count the QKV layer accepts (KV heads replicated when ranks outnumber them), RoPE with
the default, linear and llama3 schedules, q/k/v bias (Qwen2, or ``attention_bias``, which also biases
o_proj), tied or untied embeddings, and in training ``attention_dropout`` (with tp_size > 1 after
``seed_tensor_parallel``) and, built with ``sequence_parallel=True``, sequence parallelism
(``tpkit.models.sequence_parallel``).

The layers multiply with ``tpkit.ops.decode_linear``: tpkit's kernel for the few rows of a decode step on a
GPU, ``F.linear`` everywhere else. A decode step where that kernel applies runs
:mod:`tpkit.models.fused_decode` rather than the forward below: the same arithmetic, with RoPE, the cache
write, SwiGLU and the norms folded into the products' kernels. ``model.fused_decode = False`` runs every
step through the forward below.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tpkit.attention import Attention, AttentionMetadata, PagedKVCache
from tpkit.loaders import load_weights
from tpkit.models.activations import get_activation
from tpkit.models.config_checks import LLAMA, check_config
from tpkit.models.dropout import attend
from tpkit.models.fused_decode import fused_decode_applies, fused_decode_step
from tpkit.models.generation import PagedDecoderOnlyLM
from tpkit.models.kv_scales import peel_kv_scales
from tpkit.models.prompts import parse_eos_token_ids
from tpkit.models.sequence_parallel import check_sequence_parallel, exit_sequence_parallel, mark_norms
from tpkit.ops import RMSNorm, RotaryEmbedding, apply_rotary, decode_linear, rope_parameters, silu_and_mul
from tpkit.parallel_layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    QuantizationMethod,
    RowParallelLinear,
    VocabParallelEmbedding,
    set_linear_op,
)


class LlamaAttention(nn.Module):
    def __init__(self, config: Mapping[str, Any], layer_idx: int, *, qkv_bias: bool, o_bias: bool,
                 factory: dict[str, Any]) -> None:
        super().__init__()
        hidden_size = config["hidden_size"]
        total_num_heads = config["num_attention_heads"]
        head_size = config.get("head_dim") or hidden_size // total_num_heads
        self.layer_idx = layer_idx
        self.qkv_proj = QKVParallelLinear(hidden_size, head_size, total_num_heads,
                                          config.get("num_key_value_heads") or total_num_heads, bias=qkv_bias,
                                          **factory)
        self.o_proj = RowParallelLinear(total_num_heads * head_size, hidden_size, bias=o_bias, **factory)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size, self.head_size = self.qkv_proj.q_size, self.qkv_proj.kv_size, head_size
        self.attn = Attention(self.num_heads, head_size, self.num_kv_heads)
        self.attention_dropout = config.get("attention_dropout", 0.0)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: PagedKVCache | None,
                metadata: AttentionMetadata | None) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [batch, seq, q_size + 2 * kv_size]: every token, also sequence-parallel
        batch, seq = qkv.shape[:2]
        # q and k heads side by side: one rotation for both.
        qk = qkv[..., : self.q_size + self.kv_size].view(batch, seq, -1, self.head_size)
        qk = apply_rotary(qk, cos, sin).flatten(2)  # [batch, seq, q_size + kv_size]
        q, k = qk.split([self.q_size, self.kv_size], dim=-1)
        v = qkv[..., self.q_size + self.kv_size:]
        out = attend(self.attn, q, k, v, dropout_p=self.attention_dropout, tp_size=self.o_proj.tp_size,
                     kv_cache=kv_cache, layer_idx=self.layer_idx, metadata=metadata)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: Mapping[str, Any], factory: dict[str, Any]) -> None:
        super().__init__()
        hidden_size, intermediate_size = config["hidden_size"], config["intermediate_size"]
        bias = config.get("mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias,
                                                       **factory)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, **factory)
        self.act = get_activation(config.get("hidden_act", "silu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [batch, seq, 2 * intermediate_size / tp_size]: gate, then up
        if self.act is F.silu:
            return self.down_proj(silu_and_mul(gate_up))  # SwiGLU, one kernel on GPUs
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Mapping[str, Any], layer_idx: int, *, qkv_bias: bool, o_bias: bool,
                 factory: dict[str, Any]) -> None:
        super().__init__()
        hidden_size, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
        norm_factory = {"dtype": factory["params_dtype"], "device": factory["device"]}
        self.input_layernorm = RMSNorm(hidden_size, eps, **norm_factory)
        self.self_attn = LlamaAttention(config, layer_idx, qkv_bias=qkv_bias, o_bias=o_bias, factory=factory)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, **norm_factory)
        self.mlp = LlamaMLP(config, factory)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: PagedKVCache | None,
                metadata: AttentionMetadata | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, metadata)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(PagedDecoderOnlyLM):
    """Llama / Qwen2 from a HuggingFace config.json dict, this rank's shard of it.

    Parameters are randomly initialised; :meth:`load_weights` (or :func:`tpkit.models.from_pretrained`)
    loads a HuggingFace checkpoint.
    """

    # Decode steps on the fused kernels (tpkit.models.fused_decode): None (the default) where tpkit's decode
    # kernel takes the step's products, True at every decode step without gradients (the fused ops'
    # PyTorch expressions where the kernels do not run), False never (every step through the layers, which
    # is what a model whose layers get another product through set_linear_op wants).
    fused_decode: bool | None = None

    # (param_name, checkpoint_name, loaded_shard_id): checkpoint tensors that land in one stacked parameter.
    stacked_params_mapping = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )

    def __init__(self, config: Mapping[str, Any], *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, tp_group: Any = None,
                 sequence_parallel: bool = False, quant_method: QuantizationMethod | None = None) -> None:
        super().__init__()
        check_config("LlamaForCausalLM", config, LLAMA, dtype=dtype, device=device, tp_group=tp_group,
                     sequence_parallel=sequence_parallel)
        architectures = config.get("architectures") or ()
        is_qwen2 = config.get("model_type") == "qwen2" or "Qwen2ForCausalLM" in architectures
        if is_qwen2 and config.get("use_sliding_window", False):
            raise ValueError("use_sliding_window=True (Qwen2 sliding-window attention) is not supported")
        dtype = dtype or torch.get_default_dtype()
        factory = {"params_dtype": dtype, "device": device, "tp_group": tp_group}
        hidden_size, vocab_size = config["hidden_size"], config["vocab_size"]
        # Qwen2 biases q, k and v only; Llama's attention_bias biases o_proj as well.
        attention_bias = config.get("attention_bias", False)
        qkv_bias, o_bias = attention_bias or is_qwen2, attention_bias and not is_qwen2

        self.config = dict(config)
        self.vocab_size = vocab_size
        self.max_positions = config["max_position_embeddings"]
        self.eos_token_ids = parse_eos_token_ids(config.get("eos_token_id"))
        self.embed_tokens = VocabParallelEmbedding(vocab_size, hidden_size,
                                                   sequence_parallel=sequence_parallel, **factory)
        self.sequence_parallel = sequence_parallel
        # The decoder layers' linear layers hold and multiply their weights with quant_method (float8 weights:
        # tpkit.models.quantization); the embedding and the LM head stay in dtype.
        layer_factory = {**factory, "sequence_parallel": sequence_parallel, "quant_method": quant_method}
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, i, qkv_bias=qkv_bias, o_bias=o_bias, factory=layer_factory)
            for i in range(config["num_hidden_layers"])
        )
        self.norm = RMSNorm(hidden_size, config.get("rms_norm_eps", 1e-6), dtype=dtype, device=device)
        if sequence_parallel:
            mark_norms(self, RMSNorm)
        self.lm_head = ParallelLMHead(vocab_size, hidden_size, **factory)
        self.tie_word_embeddings = config.get("tie_word_embeddings", False)
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.embed_tokens)
        attention = self.layers[0].self_attn
        self.tp_group = self.embed_tokens.tp_group
        self.num_layers = len(self.layers)
        self.num_heads, self.num_kv_heads = attention.num_heads, attention.num_kv_heads
        self.head_size = attention.head_size
        self.rotary_emb = RotaryEmbedding(self.head_size, self.max_positions, rope_parameters(config),
                                          device=device)
        # A decode step's products (a few rows each) run tpkit's decode kernel on the GPU, F.linear elsewhere.
        set_linear_op(self, decode_linear)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      kv_cache: PagedKVCache | None = None,
                      metadata: AttentionMetadata | None = None) -> torch.Tensor:
        if self.sequence_parallel:
            check_sequence_parallel(input_ids, self.tp_group, kv_cache is not None)
        x = self.embed_tokens(input_ids)  # [batch, seq, hidden]; sequence-parallel [batch, seq / tp, hidden]
        cos, sin = self.rotary_emb.cos_sin(positions, x.dtype)  # every position's, for q and k of every token
        if fused_decode_applies(self, x, kv_cache, metadata):
            return fused_decode_step(self, x, cos, sin, kv_cache, metadata)
        for layer in self.layers:
            x = layer(x, cos, sin, kv_cache, metadata)
        x = self.norm(x)
        return exit_sequence_parallel(x, self.tp_group) if self.sequence_parallel else x

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Load HuggingFace ``(name, tensor)`` pairs (``model.`` prefix); returns the parameters loaded. A
        float8 KV cache's ``k_scale``/``v_scale`` tensors go into ``kv_cache_scales``."""
        qkv = self.layers[0].self_attn.qkv_proj
        kv_rank = qkv.tp_rank // qkv.num_kv_head_replicas
        weights = peel_kv_scales(weights, self.kv_cache_scales,
                                 (kv_rank * qkv.num_kv_heads, qkv.num_kv_heads), qkv.total_num_kv_heads)
        # Old checkpoints saved the rotary inverse frequencies; they are recomputed here.
        # fbgemm's float8 checkpoints may store the activation bound, which the config also gives.
        return load_weights(self, weights, self.stacked_params_mapping,
                            rename=lambda name: name.removeprefix("model."),
                            ignore=("rotary_emb.inv_freq", re.compile(r"\.input_scale_ub$")))

