"""The Attention module: SDPA without a cache; with one, every step through paged attention."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tpkit.attention.kv_cache import AttentionMetadata, PagedKVCache
from tpkit.ops.paged_attention import paged_attention, reshape_and_cache


class Attention(nn.Module):
    """Multi-head attention over already projected queries, keys and values, for one rank's heads.

    Inputs are ``[batch, seq, heads * head_size]``. Query head ``h`` reads KV head
    ``h // (num_heads // num_kv_heads)`` (MHA, GQA, MQA). The module has no parameters of its own (``sinks``
    given as a Parameter is one).

    - ``kv_cache=None``: plain SDPA over the inputs, right-padded for ragged batches (causal, or masked by
      ``key_lens``). Outputs at padded query positions are finite but meaningless.
    - With a cache, the step's new K/V (if given: a cross-attention step that only reads passes none) are
      written with ``reshape_and_cache`` at ``metadata.slot_mapping``, one slot a token of ``key``
      flattened, then the query attends over the cache with ``paged_attention`` (a float8 cache's write
      quantizes and its attention dequantizes with the cache's scales, ``kv_cache.scales(layer_idx)``):

      - a packed step (``metadata.query_start_loc`` set: a prefill, with or without a cached prefix, a
        chunk, speculative tokens, a mix with decodes): the query's tokens, flattened (``[1, num_tokens,
        ...]`` as the models pass them), are each sequence's tokens in turn, bottom-right causal or, with
        ``causal=False``, attending to all of their sequence's keys;
      - a decode step (no ``query_start_loc``): one token a sequence, ``q_len == 1``, the decode kernel.

    Variants, per layer (each None by default: the plain softmax): ``window_size``, a sliding window (a query
    at position ``p`` sees keys ``p - window_size + 1 .. p``; causal attention only); ``logits_soft_cap``,
    scores capped to ``cap * tanh(scores / cap)`` before the softmax; ``sinks``, float32 ``[num_heads]`` (this
    rank's heads), a learned logit a head in the softmax's denominator. Without a cache a window alone runs
    SDPA with a mask, a soft cap or sinks the attention written out (SDPA has neither); with one they are
    ``paged_attention``'s arguments.

    Cross-attention is ``causal=False`` with its own cache: the encoder K/V are passed and written once
    (``prefill_metadata(seq_ids, encoder_lens)``, with the decoder's ``query_start_loc`` for the queries of
    that step), and later steps pass ``key=value=None`` with ``decode_metadata(seq_ids, append=False)``.
    """

    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int | None = None, *,
                 scale: float | None = None, causal: bool = True, window_size: int | None = None,
                 logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None) -> None:
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        sizes = dict(num_heads=num_heads, head_size=head_size, num_kv_heads=num_kv_heads)
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"Attention: {name}: expected an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"Attention: {name}: expected a positive int, got {value}")
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"Attention: num_kv_heads: expected a divisor of num_heads = {num_heads}, "
                             f"got {num_kv_heads}")
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                                  or not math.isfinite(scale)):
            raise ValueError(f"Attention: scale: expected a finite number (or None), got {scale!r}")
        _check_variants(num_heads, causal, window_size, logits_soft_cap, sinks)
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = 1.0 / math.sqrt(head_size) if scale is None else float(scale)
        self.causal = causal
        self.window_size = window_size
        self.logits_soft_cap = None if logits_soft_cap is None else float(logits_soft_cap)
        self.sinks = sinks

    def extra_repr(self) -> str:
        variants = "".join(f", {name}={getattr(self, name)}" for name in ("window_size", "logits_soft_cap")
                           if getattr(self, name) is not None)
        return (f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_size={self.head_size}, "
                f"scale={self.scale:.6g}, causal={self.causal}{variants}")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None,
        value: torch.Tensor | None,
        *,
        kv_cache: PagedKVCache | None = None,
        layer_idx: int = 0,
        metadata: AttentionMetadata | None = None,
        key_lens: torch.Tensor | None = None,
        dropout_p: float = 0.0,
    ) -> torch.Tensor:
        """Attend ``query`` to ``key``/``value`` or to the cache.

        Returns query's ``[batch, seq, num_heads * head_size]`` in query's dtype.

        Args:
            query: ``[batch, q_len, num_heads * head_size]``; at a packed step its tokens flattened are the
                step's (``[1, num_tokens, ...]``).
            key, value: ``[batch, kv_len, num_kv_heads * head_size]``, or both None at a cache step that
                only reads (cross-attention over stored K/V). With a cache, their tokens flattened are the
                step's new K/V, one per ``metadata.slot_mapping`` entry.
            kv_cache, layer_idx, metadata: the paged cache, this layer's index in it, and the step's
                metadata from ``kv_cache.step_metadata`` / ``prefill_metadata`` / ``decode_metadata``.
            key_lens: int ``[batch]``, valid keys per sequence (each at least 1), without a cache only. Causal
                attention needs none for right padding: a valid query never sees a later position. With a
                cache, the key lengths are ``metadata.seq_lens``.
            dropout_p: dropout of the attention probabilities (SDPA's), without a cache only: training runs
                without one, generation never drops. Drawn from the default generators; a tensor-parallel
                model draws its heads' masks inside ``tensor_parallel_rng()``.
        """
        self._check_hidden("query", query, self.num_heads)
        batch, q_len, _ = query.shape
        if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0 <= dropout_p < 1:
            raise ValueError(f"Attention: dropout_p: expected a probability in [0, 1), got {dropout_p!r}")
        if dropout_p > 0.0 and kv_cache is not None:
            raise ValueError(f"Attention: dropout_p: expected 0 with a kv_cache (generation), got "
                             f"{dropout_p}")
        if (key is None) != (value is None):
            raise ValueError(f"Attention: key, value: expected both tensors or both None, got "
                             f"{type(key).__name__} and {type(value).__name__}")
        if key is not None:
            # Without a cache a key row is a query row's sequence; with one, tokens are matched by slot.
            self._check_hidden("key", key, self.num_kv_heads, None if kv_cache is not None else batch)
            self._check_hidden("value", value, self.num_kv_heads, None if kv_cache is not None else batch)
            if key.shape != value.shape:
                raise ValueError(f"Attention: value: expected shape {list(key.shape)} (that of key), got "
                                 f"{list(value.shape)}")

        if kv_cache is None:
            if key is None:
                raise ValueError("Attention: key, value: expected tensors without a kv_cache, got None")
            return self._sdpa(query, key, value, key_lens, dropout_p)
        if metadata is None:
            raise ValueError("Attention: metadata: expected the step's AttentionMetadata with a kv_cache, "
                             "got None")
        if not 0 <= layer_idx < kv_cache.num_layers:
            raise ValueError(f"Attention: layer_idx: expected an index in [0, {kv_cache.num_layers}), got "
                             f"{layer_idx}")
        key_cache = kv_cache.key_caches[layer_idx]
        value_cache = kv_cache.value_caches[layer_idx]
        k_scale, v_scale = kv_cache.scales(layer_idx)  # a float8 cache's; None otherwise
        if metadata.query_start_loc is None and q_len != 1:
            raise ValueError(f"Attention: query: expected q_len 1 at a decode step, got shape "
                             f"{list(query.shape)}")
        if key is not None:
            num_new = metadata.slot_mapping.shape[0]
            if key.shape[0] * key.shape[1] != num_new:
                raise ValueError(f"Attention: key: expected {num_new} tokens (one per slot_mapping entry), "
                                 f"got shape {list(key.shape)}")
            # [num_new, num_kv_heads, head_size]: views, the token stride stays that of the input.
            reshape_and_cache(key.reshape(num_new, self.num_kv_heads, self.head_size),
                              value.reshape(num_new, self.num_kv_heads, self.head_size),
                              key_cache, value_cache, metadata.slot_mapping, k_scale, v_scale)
        # [batch * q_len, num_heads, head_size]: a view where the model's query is one (a slice of its fused
        # q, k projection): the op takes any token and head strides, and a copy would be one more kernel a
        # layer in a compiled decode step. Only a strided last dimension is copied.
        tokens = query.reshape(batch * q_len, self.num_heads, self.head_size)
        if tokens.stride(-1) != 1:
            tokens = tokens.contiguous()
        out = paged_attention(tokens, key_cache, value_cache, metadata.block_tables, metadata.seq_lens,
                              scale=self.scale, query_start_loc=metadata.query_start_loc, causal=self.causal,
                              k_scale=k_scale, v_scale=v_scale,
                              window_size=self.window_size, logits_soft_cap=self.logits_soft_cap,
                              sinks=self.sinks)
        return out.view(batch, q_len, self.num_heads * self.head_size)

    def _check_hidden(self, name: str, tensor: torch.Tensor, num_heads: int,
                      batch: int | None = None) -> None:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"Attention: {name}: expected a torch.Tensor, got {type(tensor).__name__}")
        width = num_heads * self.head_size
        if tensor.dim() != 3 or tensor.shape[2] != width or (batch is not None and tensor.shape[0] != batch):
            batch_text = "batch" if batch is None else str(batch)
            raise ValueError(f"Attention: {name}: expected shape [{batch_text}, seq, {width}], got "
                             f"{list(tensor.shape)}")

    def _sdpa(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              key_lens: torch.Tensor | None, dropout_p: float = 0.0) -> torch.Tensor:
        batch, q_len, _ = query.shape
        kv_len = key.shape[1]
        group = self.num_heads // self.num_kv_heads
        # [batch, num_heads, q_len, head_size]; k, v: [batch, num_kv_heads, kv_len, head_size]
        q = query.unflatten(-1, (self.num_heads, self.head_size)).transpose(1, 2)
        k = key.unflatten(-1, (self.num_kv_heads, self.head_size)).transpose(1, 2)
        v = value.unflatten(-1, (self.num_kv_heads, self.head_size)).transpose(1, 2)
        if self.causal and q_len != kv_len:
            raise ValueError(f"Attention: key: expected kv_len = q_len = {q_len} for causal attention, got "
                             f"{kv_len}")
        padding = None if self.causal or key_lens is None else _key_padding_mask(key_lens, batch, kv_len,
                                                                                key.device)
        if self.logits_soft_cap is not None or self.sinks is not None:
            out = self._attention_math(q, k, v, self._mask(q_len, query.device, padding), dropout_p)
        elif self.window_size is not None:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=self._mask(q_len, query.device, padding),
                                                 scale=self.scale, dropout_p=dropout_p, enable_gqa=group > 1)
        elif self.causal:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                                 dropout_p=dropout_p, enable_gqa=group > 1)
        else:
            # Without causality the query heads of one KV head are just more query rows: folding them in
            # shares K/V without copies, on every SDPA backend.
            q = q.reshape(batch, self.num_kv_heads, group * q_len, self.head_size)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=padding, scale=self.scale,
                                                 dropout_p=dropout_p)
            out = out.view(batch, self.num_heads, q_len, self.head_size)
        return out.transpose(1, 2).reshape(batch, q_len, self.num_heads * self.head_size)

    def _mask(self, q_len: int, device: torch.device, padding: torch.Tensor | None) -> torch.Tensor | None:
        """Bool, True where a query row attends to a key: causal ``[q_len, q_len]`` (within the window), or
        the keys' padding ``[batch, 1, 1, kv_len]`` (None: every key)."""
        if not self.causal:
            return padding
        rows = torch.arange(q_len, device=device)[:, None]
        cols = torch.arange(q_len, device=device)[None, :]
        mask = cols <= rows
        return mask if self.window_size is None else mask & (cols > rows - self.window_size)

    def _attention_math(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                        dropout_p: float) -> torch.Tensor:
        """The softmax attention written out, for what SDPA lacks (a soft cap, sinks), in float32: q ``[batch,
        num_heads, q_len, head_size]``, k, v ``[batch, num_kv_heads, kv_len, head_size]`` -> q's shape."""
        group = self.num_heads // self.num_kv_heads
        # [batch, num_kv_heads, group, q_len, head_size]: the query heads of one KV head side by side.
        q = q.unflatten(1, (self.num_kv_heads, group)).float()
        scores = torch.einsum("bhgqd,bhkd->bhgqk", q, k.float()) * self.scale
        if self.logits_soft_cap is not None:
            scores = self.logits_soft_cap * torch.tanh(scores / self.logits_soft_cap)
        if mask is not None:
            # [q_len, kv_len] or [batch, 1, 1, kv_len] -> broadcast over [batch, kv heads, group, q, kv].
            scores = scores.masked_fill(~(mask if mask.dim() == 2 else mask[:, :, None]), float("-inf"))
        if self.sinks is not None:
            # A sink is one more score a head, with no value: its weight is dropped after the softmax.
            sinks = self.sinks.float().view(1, self.num_kv_heads, group, 1, 1).expand(*scores.shape[:-1], 1)
            probs = torch.softmax(torch.cat([scores, sinks], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        probs = F.dropout(probs, dropout_p) if dropout_p > 0.0 else probs
        out = torch.einsum("bhgqk,bhkd->bhgqd", probs, v.float()).to(v.dtype)
        return out.flatten(1, 2)


def _check_variants(num_heads: int, causal: bool, window_size: int | None, logits_soft_cap: float | None,
                    sinks: torch.Tensor | None) -> None:
    if window_size is not None:
        if isinstance(window_size, bool) or not isinstance(window_size, int) or window_size < 1:
            raise ValueError(f"Attention: window_size: expected None or an int >= 1, got {window_size!r}")
        if not causal:
            raise ValueError(f"Attention: window_size: expected None for causal=False (a window follows the "
                             f"query's position), got {window_size}")
    if logits_soft_cap is not None and (isinstance(logits_soft_cap, bool)
                                        or not isinstance(logits_soft_cap, (int, float))
                                        or not math.isfinite(logits_soft_cap) or logits_soft_cap <= 0):
        raise ValueError(f"Attention: logits_soft_cap: expected None or a finite number > 0, got "
                         f"{logits_soft_cap!r}")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.dtype != torch.float32
                              or sinks.shape != (num_heads,)):
        got = (f"{sinks.dtype} of shape {list(sinks.shape)}" if isinstance(sinks, torch.Tensor)
               else type(sinks).__name__)
        raise ValueError(f"Attention: sinks: expected None or a float32 tensor of shape [{num_heads}] "
                         f"(num_heads), got {got}")


def _key_padding_mask(key_lens: torch.Tensor, batch: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """[batch, 1, 1, kv_len] bool, True where a key is attended; broadcasts over heads and query rows."""
    if not isinstance(key_lens, torch.Tensor):
        raise TypeError(f"Attention: key_lens: expected an int tensor, got {type(key_lens).__name__}")
    if key_lens.shape != (batch,) or key_lens.dtype.is_floating_point or key_lens.dtype == torch.bool:
        raise ValueError(f"Attention: key_lens: expected an int tensor of shape [{batch}], got "
                         f"{key_lens.dtype} of shape {list(key_lens.shape)}")
    if key_lens.device.type == "cpu" and not torch.compiler.is_compiling():
        # Free on the CPU: no key (NaN rows) or more keys than given (silently fewer) would be wrong.
        bad = ((key_lens < 1) | (key_lens > kv_len)).nonzero()
        if bad.numel():
            i = int(bad[0, 0])
            raise ValueError(f"Attention: key_lens[{i}]: expected a length in [1, {kv_len}] (kv_len), got "
                             f"{int(key_lens[i])}")
    positions = torch.arange(kv_len, device=device)
    return (positions[None, :] < key_lens.to(device)[:, None])[:, None, None, :]
