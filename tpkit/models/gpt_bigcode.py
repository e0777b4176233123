"""GPT-BigCode (SantaCoder, StarCoder) for causal LM, tensor-parallel, from tpkit layers.

A layer: LayerNorm -> QKVParallelLinear (``c_attn``) -> Attention (paged) -> RowParallelLinear (all-reduce)
-> LayerNorm -> ColumnParallelLinear -> GELU -> RowParallelLinear (all-reduce). Learned positions, and
multi-query attention: one KV head that every rank replicates, so each rank's cache holds a single head.
The checkpoint stores q, k and v fused in ``c_attn``: with multi_query as [q; k; v], loaded through the QKV
layer's fused path (``loaded_shard_id`` None); without, interleaved per head, split into q, k, v first.
In training, dropout (``embd_pdrop``, ``attn_pdrop``, ``resid_pdrop``) where transformers applies it; with
tp_size > 1 it needs ``seed_tensor_parallel`` first. Built with ``sequence_parallel=True``, sequence
parallelism (``tpkit.models.sequence_parallel``): the residual stream's dropout then draws each rank's own
mask for its tokens.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from tpkit.attention import Attention, AttentionMetadata, PagedKVCache
from tpkit.loaders import load_weights
from tpkit.models.activations import get_activation
from tpkit.models.config_checks import GPT_BIGCODE, check_config
from tpkit.models.dropout import attend
from tpkit.models.generation import PagedDecoderOnlyLM
from tpkit.models.prompts import parse_eos_token_ids
from tpkit.models.sequence_parallel import check_sequence_parallel, exit_sequence_parallel, mark_norms
from tpkit.ops import decode_linear
from tpkit.parallel_layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    set_linear_op,
    tensor_parallel_dropout,
)


class GPTBigCodeAttention(nn.Module):
    def __init__(self, config: Mapping[str, Any], layer_idx: int, factory: dict[str, Any]) -> None:
        super().__init__()
        hidden_size, total_num_heads = config["n_embd"], config["n_head"]
        head_size = hidden_size // total_num_heads
        total_num_kv_heads = 1 if config.get("multi_query", True) else total_num_heads
        self.layer_idx = layer_idx
        self.c_attn = QKVParallelLinear(hidden_size, head_size, total_num_heads, total_num_kv_heads,
                                        bias=True, **factory)
        self.c_proj = RowParallelLinear(hidden_size, hidden_size, bias=True, **factory)
        self.num_heads, self.num_kv_heads = self.c_attn.num_heads, self.c_attn.num_kv_heads
        self.head_size = head_size
        scale = None if config.get("scale_attn_weights", True) else 1.0
        self.attn = Attention(self.num_heads, head_size, self.num_kv_heads, scale=scale)
        self.attn_pdrop, self.resid_pdrop = config.get("attn_pdrop", 0.0), config.get("resid_pdrop", 0.0)

    def forward(self, x: torch.Tensor, kv_cache: PagedKVCache | None,
                metadata: AttentionMetadata | None) -> torch.Tensor:
        q_size, kv_size = self.c_attn.q_size, self.c_attn.kv_size
        q, k, v = self.c_attn(x).split([q_size, kv_size, kv_size], dim=-1)
        out = attend(self.attn, q, k, v, dropout_p=self.attn_pdrop, tp_size=self.c_proj.tp_size,
                     kv_cache=kv_cache, layer_idx=self.layer_idx, metadata=metadata)
        return tensor_parallel_dropout(self.c_proj(out), self.resid_pdrop, training=self.training,
                                       sharded=self.c_proj.sequence_parallel, tp_group=self.c_proj.tp_group)


class GPTBigCodeMLP(nn.Module):
    def __init__(self, config: Mapping[str, Any], factory: dict[str, Any]) -> None:
        super().__init__()
        hidden_size = config["n_embd"]
        inner_size = config.get("n_inner") or 4 * hidden_size
        self.c_fc = ColumnParallelLinear(hidden_size, inner_size, bias=True, **factory)
        self.c_proj = RowParallelLinear(inner_size, hidden_size, bias=True, **factory)
        self.act = get_activation(config.get("activation_function", "gelu_pytorch_tanh"))
        self.resid_pdrop = config.get("resid_pdrop", 0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tensor_parallel_dropout(self.c_proj(self.act(self.c_fc(x))), self.resid_pdrop,
                                       training=self.training, sharded=self.c_proj.sequence_parallel,
                                       tp_group=self.c_proj.tp_group)


class GPTBigCodeBlock(nn.Module):
    def __init__(self, config: Mapping[str, Any], layer_idx: int, factory: dict[str, Any]) -> None:
        super().__init__()
        hidden_size, eps = config["n_embd"], config.get("layer_norm_epsilon", 1e-5)
        norm_factory = {"dtype": factory["params_dtype"], "device": factory["device"]}
        self.ln_1 = nn.LayerNorm(hidden_size, eps=eps, **norm_factory)
        self.attn = GPTBigCodeAttention(config, layer_idx, factory)
        self.ln_2 = nn.LayerNorm(hidden_size, eps=eps, **norm_factory)
        self.mlp = GPTBigCodeMLP(config, factory)

    def forward(self, x: torch.Tensor, kv_cache: PagedKVCache | None,
                metadata: AttentionMetadata | None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv_cache, metadata)
        return x + self.mlp(self.ln_2(x))


class GPTBigCodeForCausalLM(PagedDecoderOnlyLM):
    """GPT-BigCode from a HuggingFace config.json dict, this rank's shard of it (embeddings tied)."""

    max_positions_key = "n_positions"
    # Without multi_query, c_attn is split into these three names while loading (see load_weights).
    stacked_params_mapping = (
        ("c_attn", "c_attn_q", "q"),
        ("c_attn", "c_attn_k", "k"),
        ("c_attn", "c_attn_v", "v"),
    )

    checkpoint_prefix = "transformer."

    def __init__(self, config: Mapping[str, Any], *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, tp_group: Any = None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        check_config("GPTBigCodeForCausalLM", config, GPT_BIGCODE, dtype=dtype, device=device,
                     tp_group=tp_group, sequence_parallel=sequence_parallel)
        if config.get("add_cross_attention", False):
            raise ValueError("add_cross_attention=True (GPT-BigCode as a decoder with cross-attention) is "
                             "not supported")
        dtype = dtype or torch.get_default_dtype()
        factory = {"params_dtype": dtype, "device": device, "tp_group": tp_group}
        hidden_size, vocab_size = config["n_embd"], config["vocab_size"]
        self.config = dict(config)
        self.multi_query = config.get("multi_query", True)
        self.vocab_size = vocab_size
        self.max_positions = config["n_positions"]
        self.eos_token_ids = parse_eos_token_ids(config.get("eos_token_id"))
        self.wte = VocabParallelEmbedding(vocab_size, hidden_size, sequence_parallel=sequence_parallel,
                                          **factory)
        self.wpe = VocabParallelEmbedding(self.max_positions, hidden_size,
                                          sequence_parallel=sequence_parallel, **factory)
        self.sequence_parallel = sequence_parallel
        layer_factory = {**factory, "sequence_parallel": sequence_parallel}
        self.h = nn.ModuleList(GPTBigCodeBlock(config, i, layer_factory) for i in range(config["n_layer"]))
        self.ln_f = nn.LayerNorm(hidden_size, eps=config.get("layer_norm_epsilon", 1e-5), dtype=dtype,
                                 device=device)
        if sequence_parallel:
            mark_norms(self, nn.LayerNorm)
        self.lm_head = ParallelLMHead(vocab_size, hidden_size, **factory)
        self.tie_word_embeddings = config.get("tie_word_embeddings", True)
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.wte)
        attention = self.h[0].attn
        self.tp_group = self.wte.tp_group
        self.embd_pdrop = config.get("embd_pdrop", 0.0)
        self.num_layers = len(self.h)
        self.num_heads, self.num_kv_heads = attention.num_heads, attention.num_kv_heads
        self.head_size = attention.head_size
        # A decode step's products (a few rows each) run tpkit's decode kernel on the GPU, F.linear elsewhere.
        set_linear_op(self, decode_linear)

    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      kv_cache: PagedKVCache | None = None,
                      metadata: AttentionMetadata | None = None) -> torch.Tensor:
        if self.sequence_parallel:
            check_sequence_parallel(input_ids, self.tp_group, kv_cache is not None)
        x = self.wte(input_ids) + self.wpe(positions)  # [batch, seq, hidden]; sequence-parallel seq / tp
        x = tensor_parallel_dropout(x, self.embd_pdrop, training=self.training,
                                    sharded=self.sequence_parallel, tp_group=self.tp_group)
        for block in self.h:
            x = block(x, kv_cache, metadata)
        x = self.ln_f(x)
        return exit_sequence_parallel(x, self.tp_group) if self.sequence_parallel else x

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Load HuggingFace ``(name, tensor)`` pairs (``transformer.`` prefix); returns what was loaded."""
        if not self.multi_query:
            weights = self._split_interleaved_c_attn(weights)
        # Old checkpoints carry GPT-2's causal-mask buffers (attn.bias, attn.masked_bias).
        return load_weights(self, weights, self.stacked_params_mapping,
                            rename=lambda name: name.removeprefix("transformer."),
                            ignore=re.compile(r"\.attn\.(masked_)?bias$"))

    def _split_interleaved_c_attn(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """Without multi_query, c_attn rows are [q, k, v] per head, head after head: the full tensor is read
        and yielded as c_attn_q / c_attn_k / c_attn_v, which the mapping stacks."""
        head_size = self.head_size
        for name, tensor in weights:
            module, _, kind = name.rpartition(".")
            if not module.endswith("attn.c_attn"):
                yield name, tensor
                continue
            full = tensor[:]  # [num_heads * 3 * head_size, hidden] or [num_heads * 3 * head_size]
            per_head = full.view(-1, 3, head_size, *full.shape[1:])
            for i, shard in enumerate("qkv"):
                yield f"{module}_{shard}.{kind}", per_head[:, i].reshape(-1, *full.shape[1:])

    def export_weights(self, weights: Iterable[tuple[str, torch.Tensor]]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
        """``c_attn_q``, ``c_attn_k``, ``c_attn_v`` fused back into ``c_attn`` (``[q; k; v]`` with
        multi_query, else interleaved per head: the inverse of :meth:`load_weights`); the rest as
        :meth:`PagedLM.export_weights`."""
        return super().export_weights(self._fuse_c_attn(weights))

    def _fuse_c_attn(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        parts: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            module, _, kind = name.rpartition(".")
            if not module.endswith(("attn.c_attn_q", "attn.c_attn_k", "attn.c_attn_v")):
                yield name, tensor
                continue
            parts[module[-1]] = tensor
            if len(parts) < 3:
                continue
            q, k, v = parts.pop("q"), parts.pop("k"), parts.pop("v")
            if self.multi_query:
                fused = torch.cat([q, k, v])
            else:  # [num_heads, 3, head_size, ...] -> [num_heads * 3 * head_size, ...]
                per_head = [t.view(-1, self.head_size, *t.shape[1:]) for t in (q, k, v)]
                fused = torch.stack(per_head, dim=1).reshape(-1, *q.shape[1:])
            yield f"{module[:-2]}.{kind}", fused
