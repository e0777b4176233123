"""Llama, Qwen2, Qwen3 and Mistral for causal LM, tensor-parallel, from tpkit layers: one implementation,
the families' differences read from config.json.

A layer: RMSNorm -> QKVParallelLinear -> (q/k RMSNorm per head) -> RoPE -> Attention (paged) ->
RowParallelLinear (all-reduce) -> RMSNorm -> MergedColumnParallelLinear (gate, up) -> SiLU(gate) * up ->
RowParallelLinear (all-reduce). GQA with any KV-head count the QKV layer accepts (KV heads replicated when
ranks outnumber them), RoPE with every schedule of :mod:`tpkit.ops.rotary`, q/k/v bias (Qwen2, or
``attention_bias``, which also biases o_proj), q/k norms (Qwen3), sliding windows per layer (Mistral's
``sliding_window``; Qwen's ``use_sliding_window``, see :mod:`tpkit.models.layer_types`), tied or untied
embeddings, and in training ``attention_dropout`` (with tp_size > 1 after ``seed_tensor_parallel``) and,
built with ``sequence_parallel=True``, sequence parallelism (``tpkit.models.sequence_parallel``).

The q/k norms' weight is one ``[head_size]`` vector that every rank applies to its own heads: it enters the
heads through ``copy_to_tp_region``, so its gradient is the sum over the ranks without another step.

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
from tpkit.models.fused_fp8 import fused_fp8_applies, fused_fp8_step
from tpkit.models.generation import PagedDecoderOnlyLM
from tpkit.models.kv_scales import peel_kv_scales
from tpkit.models.layer_types import (
    FULL,
    SLIDING,
    family,
    layer_types,
    rope_parameters_by_type,
    window_sizes,
)
from tpkit.models.prompts import parse_eos_token_ids
from tpkit.models.sequence_parallel import check_sequence_parallel, exit_sequence_parallel, mark_norms
from tpkit.ops import RMSNorm, RotaryEmbedding, apply_rotary, decode_linear, silu_and_mul
from tpkit.parallel_layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    QuantizationMethod,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp_region,
    set_linear_op,
)


class LlamaAttention(nn.Module):
    """QKV projection, optional q/k norms per head, RoPE, attention and the output projection; the
    attention variants (``scale``, ``window_size``, ``logits_soft_cap``) are this layer's."""

    def __init__(self, config: Mapping[str, Any], layer_idx: int, *, qkv_bias: bool, o_bias: bool,
                 factory: dict[str, Any], qk_norm: bool = False, norm_unit_offset: bool = False,
                 scale: float | None = None, window_size: int | None = None,
                 logits_soft_cap: float | None = None) -> None:
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
        self.q_norm = self.k_norm = None
        if qk_norm:
            norm_args = dict(eps=config.get("rms_norm_eps", 1e-6), dtype=factory["params_dtype"],
                             device=factory["device"], unit_offset=norm_unit_offset)
            self.q_norm = RMSNorm(head_size, **norm_args)
            self.k_norm = RMSNorm(head_size, **norm_args)
        self.attn = Attention(self.num_heads, head_size, self.num_kv_heads, scale=scale,
                              window_size=window_size, logits_soft_cap=logits_soft_cap)
        self.attention_dropout = config.get("attention_dropout", 0.0)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: PagedKVCache | None,
                metadata: AttentionMetadata | None) -> torch.Tensor:
        # [batch, seq, q_size + 2 * kv_size]: every token, also sequence-parallel
        return self.from_qkv(self.qkv_proj(x), cos, sin, kv_cache, metadata)

    def from_qkv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: PagedKVCache | None,
                 metadata: AttentionMetadata | None) -> torch.Tensor:
        """The rest of :meth:`forward` after qkv_proj: qkv ``[batch, seq, q_size + 2 * kv_size]`` -> o_proj's
        output."""
        batch, seq = qkv.shape[:2]
        # q and k heads side by side: one rotation for both.
        qk = qkv[..., : self.q_size + self.kv_size].view(batch, seq, -1, self.head_size)
        if self.q_norm is not None:
            tp = self.o_proj.tp_group
            q_weight, k_weight = (copy_to_tp_region(n.weight, tp) for n in (self.q_norm, self.k_norm))
            qk = torch.cat([self.q_norm(qk[:, :, :self.num_heads], q_weight),
                            self.k_norm(qk[:, :, self.num_heads:], k_weight)], dim=2)
        qk = apply_rotary(qk, cos, sin).flatten(2)  # [batch, seq, q_size + kv_size]
        q, k = qk.split([self.q_size, self.kv_size], dim=-1)
        v = qkv[..., self.q_size + self.kv_size:]
        out = attend(self.attn, q, k, v, dropout_p=self.attention_dropout, tp_size=self.o_proj.tp_size,
                     kv_cache=kv_cache, layer_idx=self.layer_idx, metadata=metadata)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, config: Mapping[str, Any], factory: dict[str, Any],
                 activation: str | None = None) -> None:
        super().__init__()
        hidden_size, intermediate_size = config["hidden_size"], config["intermediate_size"]
        bias = config.get("mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias,
                                                       **factory)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, **factory)
        self.act = get_activation(activation or config.get("hidden_act", "silu"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [batch, seq, 2 * intermediate_size / tp_size]: gate, then up
        if self.act is F.silu:
            return self.down_proj(silu_and_mul(gate_up))  # SwiGLU, one kernel on GPUs
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Mapping[str, Any], layer_idx: int, *, factory: dict[str, Any],
                 **attention: Any) -> None:
        super().__init__()
        hidden_size, eps = config["hidden_size"], config.get("rms_norm_eps", 1e-6)
        norm_factory = {"dtype": factory["params_dtype"], "device": factory["device"]}
        self.input_layernorm = RMSNorm(hidden_size, eps, **norm_factory)
        self.self_attn = LlamaAttention(config, layer_idx, factory=factory, **attention)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps, **norm_factory)
        self.mlp = LlamaMLP(config, factory)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: PagedKVCache | None,
                metadata: AttentionMetadata | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, metadata)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(PagedDecoderOnlyLM):
    """Llama / Qwen2 / Qwen3 / Mistral from a HuggingFace config.json dict, this rank's shard of it.

    Parameters are randomly initialised; :meth:`load_weights` (or :func:`tpkit.models.from_pretrained`)
    loads a HuggingFace checkpoint. A family with other layers around the same attention and MLP (Gemma,
    :mod:`tpkit.models.gemma`) subclasses it: its config schema, layer class, norms and attention settings
    are the class attributes and :meth:`_attention_settings` below.
    """

    # Decode steps on the fused kernels (tpkit.models.fused_decode): None (the default) where tpkit's decode
    # kernel takes the step's products, True at every decode step without gradients (the fused ops'
    # PyTorch expressions where the kernels do not run), False never (every step through the layers, which
    # is what a model whose layers get another product through set_linear_op wants). CUDA graphs captured
    # before a change replay the step they captured: clear_kv_cache() drops them.
    fused_decode: bool | None = None
    # Steps of many tokens on float8 tensor cores with the activations quantized by fused ops
    # (tpkit.models.fused_fp8): None (the default) where the products run on float8 tensor cores, True at
    # every such step without gradients (the ops' PyTorch expressions where the kernels do not run), False
    # never.
    fused_fp8: bool | None = None
    config_schema = LLAMA
    layer_class: type[nn.Module] = LlamaDecoderLayer
    norm_unit_offset = False  # Gemma's norms scale by 1 + weight
    tie_word_embeddings_default = False

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
        check_config(type(self).__name__, config, self.config_schema, dtype=dtype, device=device,
                     tp_group=tp_group, sequence_parallel=sequence_parallel)
        self.layer_types, windows = layer_types(config), window_sizes(config)
        dtype = dtype or torch.get_default_dtype()
        factory = {"params_dtype": dtype, "device": device, "tp_group": tp_group}
        hidden_size, vocab_size = config["hidden_size"], config["vocab_size"]
        eps = config.get("rms_norm_eps", 1e-6)

        self.config = dict(config)
        self.vocab_size = vocab_size
        self.max_positions = config["max_position_embeddings"]
        self.eos_token_ids = parse_eos_token_ids(config.get("eos_token_id"))
        self.embed_tokens = VocabParallelEmbedding(vocab_size, hidden_size,
                                                   sequence_parallel=sequence_parallel, **factory)
        self.embed_scale = self._embed_scale(config, dtype)
        self.sequence_parallel = sequence_parallel
        # The decoder layers' linear layers hold and multiply their weights with quant_method (float8 weights:
        # tpkit.models.quantization); the embedding and the LM head stay in dtype.
        layer_factory = {**factory, "sequence_parallel": sequence_parallel, "quant_method": quant_method}
        attention = self._attention_settings(config)
        self.layers = nn.ModuleList(
            self.layer_class(config, i, factory=layer_factory, window_size=windows[i], **attention)
            for i in range(config["num_hidden_layers"])
        )
        self.norm = RMSNorm(hidden_size, eps, dtype=dtype, device=device, unit_offset=self.norm_unit_offset)
        if sequence_parallel:
            mark_norms(self, RMSNorm, exclude=head_norms(self))
        cap = config.get("final_logit_softcapping")  # Gemma 2's
        self.lm_head = ParallelLMHead(vocab_size, hidden_size, logits_soft_cap=cap, **factory)
        self.tie_word_embeddings = config.get("tie_word_embeddings", self.tie_word_embeddings_default)
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.embed_tokens)
        attention_layer = self.layers[0].self_attn
        self.tp_group = self.embed_tokens.tp_group
        self.num_layers = len(self.layers)
        self.num_heads, self.num_kv_heads = attention_layer.num_heads, attention_layer.num_kv_heads
        self.head_size = attention_layer.head_size
        rope = rope_parameters_by_type(config)
        self.rotary_emb = RotaryEmbedding(self.head_size, self.max_positions, rope[FULL], device=device)
        # The sliding layers' own table where their settings differ (Gemma 3's local base), else None.
        self.local_rotary_emb = None
        if rope[SLIDING] != rope[FULL]:
            self.local_rotary_emb = RotaryEmbedding(self.head_size, self.max_positions, rope[SLIDING],
                                                    device=device)
        # A decode step's products (a few rows each) run tpkit's decode kernel on the GPU, F.linear elsewhere.
        set_linear_op(self, decode_linear)

    def _attention_settings(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """The keyword arguments of every layer's :class:`LlamaAttention` (its window aside)."""
        kind = family(config)
        # Qwen2 biases q, k and v only; Llama's (and Qwen3's) attention_bias biases o_proj as well.
        bias, is_qwen2 = config.get("attention_bias", False), kind == "qwen2"
        return dict(qkv_bias=bias or is_qwen2, o_bias=bias and not is_qwen2, qk_norm=kind == "qwen3")

    def _embed_scale(self, config: Mapping[str, Any], dtype: torch.dtype) -> float | None:
        """What the embeddings are multiplied by (None: nothing)."""
        return None

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      kv_cache: PagedKVCache | None = None,
                      metadata: AttentionMetadata | None = None) -> torch.Tensor:
        if self.sequence_parallel:
            check_sequence_parallel(input_ids, self.tp_group, kv_cache is not None)
        x = self.embed_tokens(input_ids)  # [batch, seq, hidden]; sequence-parallel [batch, seq / tp, hidden]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        # Every position's cos and sin, for q and k of every token (Gemma 3's local layers: their own).
        rotations = {FULL: self.rotary_emb.cos_sin(positions, x.dtype)}
        rotations[SLIDING] = (rotations[FULL] if self.local_rotary_emb is None
                              else self.local_rotary_emb.cos_sin(positions, x.dtype))
        if fused_decode_applies(self, x, kv_cache, metadata):
            return fused_decode_step(self, x, *rotations[FULL], kv_cache, metadata)
        if fused_fp8_applies(self, x):
            return fused_fp8_step(self, x, rotations, kv_cache, metadata)
        for layer, layer_type in zip(self.layers, self.layer_types, strict=True):
            x = layer(x, *rotations[layer_type], kv_cache, metadata)
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


def head_norms(model: nn.Module) -> list[nn.Module]:
    """The q/k norms of ``model``'s attention layers (norms of heads, not of the residual stream)."""
    return [norm for layer in model.modules() if isinstance(layer, LlamaAttention)
            for norm in (layer.q_norm, layer.k_norm) if norm is not None]
