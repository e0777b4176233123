"""BART for conditional generation (encoder-decoder), tensor-parallel, from tpkit layers.

Post-norm layers as in transformers' BART: ``x = LayerNorm(x + sublayer(x))``. The encoder attends
bidirectionally over the (right-padded) prompts. A decoder layer: causal self-attention over its paged cache,
then cross-attention whose q comes from the decoder and k, v from the encoder through one
QKVCrossParallelLinear, then the MLP. The encoder's K/V are computed once per request, at prefill, into
a second paged cache ("cross"); decode steps pass no encoder states and attend to that cache. Learned
positions with BART's offset of 2, optional sqrt(d_model) embedding scale, layernorm_embedding, embeddings
tied to the LM head, and ``final_logits_bias`` as the LM head's bias (not trained, as in transformers).
In training, dropout (``dropout``, ``attention_dropout``, ``activation_dropout``) and layer drop
(``encoder_layerdrop``, ``decoder_layerdrop``) where transformers applies them; with tp_size > 1 they need
``seed_tensor_parallel`` first. Built with ``sequence_parallel=True``, sequence parallelism
(``tpkit.models.sequence_parallel``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from tpkit.attention import Attention, AttentionMetadata, PagedKVCache, copy_to_device
from tpkit.loaders import load_weights
from tpkit.models.activations import get_activation
from tpkit.models.config_checks import BART, check_config
from tpkit.models.dropout import attend
from tpkit.models.generation import PagedLM
from tpkit.models.prompts import check_input_ids, parse_eos_token_ids
from tpkit.models.sequence_parallel import check_sequence_parallel, exit_sequence_parallel, mark_norms
from tpkit.ops import decode_linear
from tpkit.parallel_layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    QKVCrossParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    set_linear_op,
    tensor_parallel_dropout,
)

POSITION_OFFSET = 2  # BART's learned positions start at row 2 (fairseq kept two rows for padding)

# The encoder's attention backends over packed prompts, first choice first. Ragged prompts give a new shape
# almost every call, and cuDNN's attention (which recent torch ranks first on Hopper) builds an execution
# graph for each new shape, tens of milliseconds of host time before the first kernel runs; FlashAttention
# and memory-efficient attention have no per-shape set-up.
_PACKED_ENCODER_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH,
                            SDPBackend.CUDNN_ATTENTION]


class BartAttention(nn.Module):
    """Self-attention: bidirectional in the encoder, causal (with a paged cache) in the decoder."""

    def __init__(self, config: Mapping[str, Any], num_heads: int, layer_idx: int, *, causal: bool,
                 factory: dict[str, Any]) -> None:
        super().__init__()
        d_model = config["d_model"]
        head_size = d_model // num_heads
        self.layer_idx = layer_idx
        self.qkv_proj = QKVParallelLinear(d_model, head_size, num_heads, bias=True, **factory)
        self.out_proj = RowParallelLinear(d_model, d_model, bias=True, **factory)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.attn = Attention(self.qkv_proj.num_heads, head_size, self.qkv_proj.num_kv_heads, causal=causal)
        self.attention_dropout = config.get("attention_dropout", 0.0)

    def forward(self, x: torch.Tensor, *, kv_cache: PagedKVCache | None = None,
                metadata: AttentionMetadata | None = None,
                key_lens: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        out = attend(self.attn, q, k, v, dropout_p=self.attention_dropout, tp_size=self.out_proj.tp_size,
                     kv_cache=kv_cache, layer_idx=self.layer_idx, metadata=metadata, key_lens=key_lens)
        return self.out_proj(out)


class BartCrossAttention(nn.Module):
    """Decoder-to-encoder attention; k, v are projected only when encoder states are given (prefill)."""

    def __init__(self, config: Mapping[str, Any], layer_idx: int, factory: dict[str, Any]) -> None:
        super().__init__()
        d_model, num_heads = config["d_model"], config["decoder_attention_heads"]
        head_size = d_model // num_heads
        self.layer_idx = layer_idx
        self.qkv_proj = QKVCrossParallelLinear(d_model, head_size, num_heads, bias=True, **factory)
        self.out_proj = RowParallelLinear(d_model, d_model, bias=True, **factory)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_size = head_size
        self.attn = Attention(self.qkv_proj.num_heads, head_size, self.num_kv_heads, causal=False)
        self.attention_dropout = config.get("attention_dropout", 0.0)

    def forward(self, x: torch.Tensor, encoder_states: torch.Tensor | None, *,
                kv_cache: PagedKVCache | None = None,
                metadata: AttentionMetadata | None = None) -> torch.Tensor:
        q, k, v = self.qkv_proj(x, encoder_states)  # k, v None without encoder states
        out = attend(self.attn, q, k, v, dropout_p=self.attention_dropout, tp_size=self.out_proj.tp_size,
                     kv_cache=kv_cache, layer_idx=self.layer_idx, metadata=metadata)
        return self.out_proj(out)


class _BartLayer(nn.Module):
    """What encoder and decoder layers share: the residual dropout after each sublayer, the MLP (fc1,
    activation, fc2) and its final LayerNorm."""

    def __init__(self, config: Mapping[str, Any], ffn_dim: int, factory: dict[str, Any]) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(config["d_model"], ffn_dim, bias=True, **factory)
        self.fc2 = RowParallelLinear(ffn_dim, config["d_model"], bias=True, **factory)
        self.act = get_activation(config.get("activation_function", "gelu"))
        self.final_layer_norm = nn.LayerNorm(config["d_model"], dtype=factory["params_dtype"],
                                             device=factory["device"])
        self.dropout = config.get("dropout", 0.0)
        self.activation_dropout = config.get("activation_dropout", 0.0)

    def _residual_dropout(self, x: torch.Tensor) -> torch.Tensor:
        """A sublayer's output, [batch, seq, d_model], whole on every rank (a rank's tokens with sequence
        parallelism)."""
        return tensor_parallel_dropout(x, self.dropout, training=self.training,
                                       sharded=self.fc2.sequence_parallel, tp_group=self.fc2.tp_group)

    def _mlp_block(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.act(self.fc1(x))  # [batch, seq, ffn_dim / tp_size]
        hidden = tensor_parallel_dropout(hidden, self.activation_dropout, training=self.training,
                                         sharded=True, tp_group=self.fc1.tp_group)
        return self.final_layer_norm(x + self._residual_dropout(self.fc2(hidden)))


class BartEncoderLayer(_BartLayer):
    def __init__(self, config: Mapping[str, Any], layer_idx: int, factory: dict[str, Any]) -> None:
        super().__init__(config, config["encoder_ffn_dim"], factory)
        self.self_attn = BartAttention(config, config["encoder_attention_heads"], layer_idx, causal=False,
                                       factory=factory)
        self.self_attn_layer_norm = nn.LayerNorm(config["d_model"], dtype=factory["params_dtype"],
                                                 device=factory["device"])

    def forward(self, x: torch.Tensor, key_lens: torch.Tensor | None) -> torch.Tensor:
        x = self.self_attn_layer_norm(x + self._residual_dropout(self.self_attn(x, key_lens=key_lens)))
        return self._mlp_block(x)


class BartDecoderLayer(_BartLayer):
    def __init__(self, config: Mapping[str, Any], layer_idx: int, factory: dict[str, Any]) -> None:
        super().__init__(config, config["decoder_ffn_dim"], factory)
        norm_factory = {"dtype": factory["params_dtype"], "device": factory["device"]}
        self.self_attn = BartAttention(config, config["decoder_attention_heads"], layer_idx, causal=True,
                                       factory=factory)
        self.self_attn_layer_norm = nn.LayerNorm(config["d_model"], **norm_factory)
        self.encoder_attn = BartCrossAttention(config, layer_idx, factory)
        self.encoder_attn_layer_norm = nn.LayerNorm(config["d_model"], **norm_factory)

    def forward(self, x: torch.Tensor, encoder_states: torch.Tensor | None,
                caches: Mapping[str, PagedKVCache],
                metadata: Mapping[str, AttentionMetadata]) -> torch.Tensor:
        attn = self.self_attn(x, kv_cache=caches.get("self"), metadata=metadata.get("self"))
        x = self.self_attn_layer_norm(x + self._residual_dropout(attn))
        cross_cache, cross_metadata = caches.get("cross"), metadata.get("cross")
        attn = self.encoder_attn(x, encoder_states, kv_cache=cross_cache, metadata=cross_metadata)
        x = self.encoder_attn_layer_norm(x + self._residual_dropout(attn))
        return self._mlp_block(x)


class BartStack(nn.Module):
    """Learned positions, layernorm_embedding and the layers of the encoder or of the decoder."""

    def __init__(self, config: Mapping[str, Any], layer_cls: type[nn.Module], num_layers: int,
                 layerdrop: float, factory: dict[str, Any], sequence_parallel: bool) -> None:
        super().__init__()
        d_model = config["d_model"]
        self.embed_positions = VocabParallelEmbedding(config["max_position_embeddings"] + POSITION_OFFSET,
                                                      d_model, sequence_parallel=sequence_parallel, **factory)
        self.layernorm_embedding = nn.LayerNorm(d_model, dtype=factory["params_dtype"],
                                                device=factory["device"])
        layer_factory = {**factory, "sequence_parallel": sequence_parallel}
        self.layers = nn.ModuleList(layer_cls(config, i, layer_factory) for i in range(num_layers))
        self.sequence_parallel = sequence_parallel
        if sequence_parallel:
            mark_norms(self, nn.LayerNorm)
        self.dropout = config.get("dropout", 0.0)
        self.layerdrop = layerdrop

    def embed(self, inputs_embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.layernorm_embedding(inputs_embeds + self.embed_positions(positions + POSITION_OFFSET))
        return tensor_parallel_dropout(x, self.dropout, training=self.training,
                                       sharded=self.sequence_parallel, tp_group=self.embed_positions.tp_group)

    def active_layers(self) -> Iterator[nn.Module]:
        """The layers, less those layer drop skips in training: one draw a layer from the default generators,
        alike on every rank."""
        for layer in self.layers:
            if not (self.training and self.layerdrop > 0.0 and torch.rand([]) < self.layerdrop):
                yield layer


class BartForConditionalGeneration(PagedLM):
    """BART from a HuggingFace config.json dict, this rank's shard of it.

    ``model(input_ids, decoder_input_ids)`` gives decoder logits; ``generate`` takes the encoder inputs as
    prompts and decodes from ``decoder_start_token_id``.
    """

    stacked_params_mapping = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
    )

    def __init__(self, config: Mapping[str, Any], *, dtype: torch.dtype | None = None,
                 device: torch.device | str | None = None, tp_group: Any = None,
                 sequence_parallel: bool = False) -> None:
        super().__init__()
        check_config("BartForConditionalGeneration", config, BART, dtype=dtype, device=device,
                     tp_group=tp_group, sequence_parallel=sequence_parallel,
                     vocab_keys=("decoder_start_token_id", "forced_bos_token_id", "forced_eos_token_id"))
        if config.get("normalize_before", False) or config.get("add_final_layer_norm", False):
            raise ValueError("pre-norm BART variants (normalize_before / add_final_layer_norm, e.g. mBART) "
                             "are not supported")
        dtype = dtype or torch.get_default_dtype()
        factory = {"params_dtype": dtype, "device": device, "tp_group": tp_group}
        d_model, vocab_size = config["d_model"], config["vocab_size"]
        self.config = dict(config)
        self.vocab_size = vocab_size
        self.max_positions = config["max_position_embeddings"]
        self.eos_token_ids = parse_eos_token_ids(config.get("eos_token_id"))
        self.decoder_start_token_id = config["decoder_start_token_id"]
        self.forced_bos_token_id = config.get("forced_bos_token_id")
        self.forced_eos_token_id = config.get("forced_eos_token_id")
        self.embed_scale = math.sqrt(d_model) if config.get("scale_embedding", False) else 1.0
        self.shared = VocabParallelEmbedding(vocab_size, d_model, sequence_parallel=sequence_parallel,
                                             **factory)
        self.sequence_parallel = sequence_parallel
        self.encoder = BartStack(config, BartEncoderLayer, config["encoder_layers"],
                                 config.get("encoder_layerdrop", 0.0), factory, sequence_parallel)
        self.decoder = BartStack(config, BartDecoderLayer, config["decoder_layers"],
                                 config.get("decoder_layerdrop", 0.0), factory, sequence_parallel)
        self.lm_head = ParallelLMHead(vocab_size, d_model, bias=True, **factory)  # bias: final_logits_bias
        # transformers keeps final_logits_bias as a buffer, which training leaves as it is.
        self.lm_head.bias.requires_grad_(False)
        with torch.no_grad():
            self.lm_head.bias.zero_()
        self.tie_word_embeddings = config.get("tie_word_embeddings", True)
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.shared)
        cross = self.decoder.layers[0].encoder_attn
        self.tp_group = self.shared.tp_group
        self.num_heads, self.num_kv_heads = cross.num_heads, cross.num_kv_heads
        self.head_size = cross.head_size
        # A decode step's products (a few rows each) run tpkit's decode kernel on the GPU, F.linear elsewhere.
        set_linear_op(self, decode_linear)

    def _embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeds = self.shared(input_ids)
        return embeds if self.embed_scale == 1.0 else embeds * self.embed_scale

    def encode(self, input_ids: torch.Tensor, key_lens: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids ``[batch, seq]`` (right-padded to ``key_lens`` if given) -> ``[batch, seq, d_model]``
        (this rank's ``seq / tp_size`` tokens with sequence parallelism)."""
        if self.sequence_parallel:  # and so are the encoder states: [batch, seq / tp_size, d_model]
            check_sequence_parallel(input_ids, self.tp_group, has_cache=False)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        x = self.encoder.embed(self._embed_tokens(input_ids), positions)
        for layer in self.encoder.active_layers():
            x = layer(x, key_lens)
        return x

    def encode_packed(self, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
        """The encoder over ragged prompts, its tokens packed prompt after prompt (padding dropped), one per
        slot of a cross cache step: ``[1, sum(prompt lengths), d_model]``."""
        prompt_lens = [len(ids) for ids in prompts]
        src_len = max(prompt_lens)
        padded = torch.tensor([list(ids) + [0] * (src_len - len(ids)) for ids in prompts])  # [batch, src_len]
        index = torch.tensor([i * src_len + j for i, n in enumerate(prompt_lens) for j in range(n)])
        # One copy from pinned memory: the host does not wait for the GPU's queue.
        input_ids, key_lens, index = copy_to_device([padded, torch.tensor(prompt_lens), index], self.device)
        # Prompts of one length need no padding mask.
        with sdpa_kernel(_PACKED_ENCODER_BACKENDS, set_priority=True):
            encoder_states = self.encode(input_ids, key_lens if min(prompt_lens) < src_len else None)
        return encoder_states.flatten(0, 1)[index][None]  # from [batch, src_len, d_model]

    def decode(self, input_ids: torch.Tensor, positions: torch.Tensor, encoder_states: torch.Tensor | None,
               caches: Mapping[str, PagedKVCache] | None = None,
               metadata: Mapping[str, AttentionMetadata] | None = None) -> torch.Tensor:
        """Decoder hidden states ``[batch, seq, d_model]``; without caches over the whole decoder input."""
        caches, metadata = caches or {}, metadata or {}
        if self.sequence_parallel:
            check_sequence_parallel(input_ids, self.tp_group, has_cache=bool(caches))
        x = self.decoder.embed(self._embed_tokens(input_ids), positions)
        for layer in self.decoder.active_layers():
            x = layer(x, encoder_states, caches, metadata)
        return exit_sequence_parallel(x, self.tp_group) if self.sequence_parallel else x

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def forward(self, input_ids: torch.Tensor, decoder_input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids ``[batch, src_len]``, decoder_input_ids ``[batch, tgt_len]`` -> logits
        ``[batch, tgt_len, vocab]``, no cache."""
        check_input_ids("input_ids", input_ids, self.max_positions, "max_position_embeddings")
        check_input_ids("decoder_input_ids", decoder_input_ids, self.max_positions, "max_position_embeddings")
        if decoder_input_ids.shape[0] != input_ids.shape[0]:
            raise ValueError(f"decoder_input_ids: expected the batch of input_ids, {input_ids.shape[0]}, got "
                             f"{decoder_input_ids.shape[0]}")
        positions = torch.arange(decoder_input_ids.shape[1], device=decoder_input_ids.device)
        positions = positions.expand_as(decoder_input_ids)
        hidden = self.decode(decoder_input_ids, positions, self.encode(input_ids))
        return self.compute_logits(hidden)

    # Generation hooks (see PagedLM) ------------------------------------------------------------------------
    def kv_cache_layout(self) -> dict[str, tuple[int, int, int]]:
        layout = (len(self.decoder.layers), self.num_kv_heads, self.head_size)
        return {"self": layout, "cross": layout}

    def _plan_kv_cache(self, prompt_lens: Sequence[int], max_new_tokens: int) -> dict[str, list[int]]:
        if max(prompt_lens) > self.max_positions:
            raise ValueError(f"prompt length {max(prompt_lens)} exceeds the encoder's {self.max_positions} "
                             "positions (max_position_embeddings)")
        # The decoder caches its start token and every generated token but the last.
        if max_new_tokens > self.max_positions:
            raise ValueError(f"max_new_tokens {max_new_tokens} exceeds the decoder's {self.max_positions} "
                             "positions (max_position_embeddings)")
        return {"self": [max_new_tokens] * len(prompt_lens), "cross": list(prompt_lens)}

    def _prefill(self, prompts: list[list[int]], caches: Mapping[str, PagedKVCache],
                 prefix_caching: bool = False, max_prefill_tokens: int | None = None) -> torch.Tensor:
        start = self.decoder_start_token_id
        if isinstance(start, bool) or not isinstance(start, int) or not 0 <= start < self.vocab_size:
            raise ValueError(f"generate: decoder_start_token_id: expected a token id in "
                             f"[0, {self.vocab_size}), got {start!r}")
        # The decoder's prompt is its start token alone, shorter than a block: the prefix cache has nothing
        # to share. A step runs at most max_prefill_tokens of them, each with its sequence's encoder pass.
        group = max_prefill_tokens or len(prompts)
        return torch.cat([self._prefill_group(prompts, range(first, min(first + group, len(prompts))), caches)
                          for first in range(0, len(prompts), group)])

    def _prefill_group(self, prompts: list[list[int]], seq_ids: range,
                       caches: Mapping[str, PagedKVCache]) -> torch.Tensor:
        """The encoder over the prompts of ``seq_ids``, their K/V into the cross cache, and the decoder's
        start tokens: one packed step. Logits of the first new tokens ``[len(seq_ids), vocab]``."""
        device, batch = self.device, len(seq_ids)
        prompt_lens = [len(prompts[i]) for i in seq_ids]
        encoder_tokens = self.encode_packed([prompts[i] for i in seq_ids])
        self_metadata = caches["self"].prefill_metadata(seq_ids, [1] * batch)
        # Cross-attention's queries are the decoder's tokens: self-attention's query layout, over the
        # encoder's keys.
        cross_metadata = dataclasses.replace(caches["cross"].prefill_metadata(seq_ids, prompt_lens),
                                             query_lens=self_metadata.query_lens,
                                             query_start_loc=self_metadata.query_start_loc)
        start = torch.full((1, batch), self.decoder_start_token_id, dtype=torch.int64, device=device)
        positions = torch.zeros(1, batch, dtype=torch.int64, device=device)
        hidden = self.decode(start, positions, encoder_tokens, caches,
                             {"self": self_metadata, "cross": cross_metadata})  # [1, batch, d_model]
        return self.compute_logits(hidden[0])

    def _decode_metadata(self, caches: Mapping[str, PagedKVCache], seq_ids: Sequence[int],
                         max_blocks: Mapping[str, int] | None = None) -> dict[str, AttentionMetadata]:
        width = {} if max_blocks is None else max_blocks
        return {"self": caches["self"].decode_metadata(seq_ids, block_table_width=width.get("self")),
                "cross": caches["cross"].decode_metadata(seq_ids, append=False,
                                                         block_table_width=width.get("cross"))}

    def _decode_step(self, input_ids: torch.Tensor, metadata: Mapping[str, AttentionMetadata],
                     caches: Mapping[str, PagedKVCache]) -> torch.Tensor:
        positions = (metadata["self"].seq_lens.long() - 1).clamp_min(0)[:, None]  # [batch, 1]
        hidden = self.decode(input_ids, positions, None, caches, metadata)
        return self.compute_logits(hidden[:, 0])

    # Loading -----------------------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Load HuggingFace ``(name, tensor)`` pairs (``model.`` prefix); returns the parameters loaded."""
        # encoder/decoder embed_tokens are copies of shared; fairseq left version buffers.
        ignore = ["model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight",
                  "model.encoder.version", "model.decoder.version"]
        return load_weights(self, self._final_logits_bias_as_head_bias(weights), self.stacked_params_mapping,
                            rename=lambda name: name.removeprefix("model."), ignore=ignore)

    def export_weights(self, weights: Iterable[tuple[str, torch.Tensor]]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
        """The LM head's bias back as transformers' ``final_logits_bias`` ``[1, vocab]``; the rest as
        :meth:`PagedLM.export_weights`."""
        for name, tensor in super().export_weights(weights):
            yield ("final_logits_bias", tensor[None]) if name == "lm_head.bias" else (name, tensor)

    def _final_logits_bias_as_head_bias(self, weights: Iterable[tuple[str, Any]]
                                        ) -> Iterator[tuple[str, Any]]:
        """transformers keeps ``final_logits_bias`` ``[1, vocab]`` apart; here it is the LM head's bias.
        transformers also loads checkpoints without it, as zeros: so does this."""
        found = False
        for name, tensor in weights:
            if name == "final_logits_bias":
                found = True
                yield "lm_head.bias", tensor[0]
            else:
                yield name, tensor
        if not found:
            yield "lm_head.bias", torch.zeros(self.vocab_size)
