"""Vectorized pure-PyTorch paged attention and cache writes.

These are the CPU implementations of the ``tpkit`` ops, the GPU fallback where the CUDA kernel cannot be
built, and the reference the kernel is tested against. They run on any device without host
synchronisation, so they can be captured in CUDA graphs: the work follows the shapes (the full width of
``block_tables``), never the values of ``seq_lens``, ``query_start_loc`` or ``slot_mapping``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# Upper bound on the elements of one gathered float32 K (or V, or score) chunk: 2**24 elements is 64 MiB,
# so a chunk's working set stays a few hundred MiB whatever the batch and context length.
CHUNK_ELEMENTS = 1 << 24


def paged_attention_reference(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    alibi_slopes: torch.Tensor | None,
    query_start_loc: torch.Tensor | None = None,
    causal: bool = True,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window_size: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Attention of each query row over its sequence's paged K/V, written into ``out``.

    Arguments are as for ``tpkit.attention.paged_attention`` and are assumed valid. Without
    ``query_start_loc`` a row is a sequence (its one query token); with it a row is a query token, which
    reads its sequence's block table and attends, as the cache position it stands at, to the keys before it
    (``causal``) or to all of them; with ``window_size``, only to those of the last ``window_size`` positions
    up to its own. ``logits_soft_cap`` caps the scaled scores (before ALiBi), ``sinks`` adds a logit a head
    to the softmax's denominator. Rows and KV blocks are processed in chunks of at most
    :data:`CHUNK_ELEMENTS` gathered elements, merged with a running log-sum-exp, so memory stays bounded for
    any context length. A float8 cache's keys and values are dequantized as they are gathered,
    ``stored.float() * scale``.
    """
    num_rows, num_heads, head_size = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    group = num_heads // num_kv_heads
    num_table_blocks = block_tables.shape[1]
    if num_rows == 0 or num_table_blocks == 0:
        out.zero_()
        return

    per_token = max(num_kv_heads * head_size, num_heads)
    blocks_per_chunk = max(1, min(num_table_blocks, CHUNK_ELEMENTS // (block_size * per_token)))
    rows_per_chunk = max(1, min(num_rows, CHUNK_ELEMENTS // (blocks_per_chunk * block_size * per_token)))
    # [num_heads] -> [num_kv_heads, group], matching the query's grouping below.
    slopes = None if alibi_slopes is None else alibi_slopes.float().view(num_kv_heads, group)
    head_sinks = None if sinks is None else sinks.float().view(num_kv_heads, group)
    variants = _Variants(window_size, logits_soft_cap, head_sinks)
    for r0 in range(0, num_rows, rows_per_chunk):
        r1 = min(num_rows, r0 + rows_per_chunk)
        # [R, num_kv_heads, group, head_size]: query heads of one KV head side by side, so GQA needs no
        # copies of K/V.
        q = (query[r0:r1].float() * scale).view(r1 - r0, num_kv_heads, group, head_size)
        if query_start_loc is None:
            table, key_lens = block_tables[r0:r1], seq_lens[r0:r1].long()  # [R, max_blocks], [R]
            query_pos = key_lens - 1
        else:
            table, key_lens, query_pos = _token_rows(r0, r1, block_tables, seq_lens, query_start_loc, causal)
        result = _attend_chunk(q, key_cache, value_cache, table, key_lens, query_pos, slopes,
                               num_table_blocks, blocks_per_chunk, k_scale, v_scale,
                               variants)
        out[r0:r1] = result.view(r1 - r0, num_heads, head_size).to(out.dtype)


class _Variants(NamedTuple):
    """The optional attention variants, as :func:`_attend_chunk` applies them (None: off).

    window_size: a row attends to cache positions ``query_pos - window_size + 1`` and later;
    logits_soft_cap: scores become ``cap * tanh(scores / cap)``; sinks: float32 [num_kv_heads, group], one
    logit a head that joins the softmax's denominator (and no value).
    """

    window_size: int | None = None
    logits_soft_cap: float | None = None
    sinks: torch.Tensor | None = None


_PLAIN = _Variants()


def _token_rows(
    t0: int,
    t1: int,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Query tokens t0..t1 as rows: each one's block table, number of keys and cache position.

    Sequence ``s`` owns tokens ``query_start_loc[s]:query_start_loc[s + 1]``, the last of its ``seq_lens[s]``
    cached tokens, so token ``t`` of it stands at cache position ``seq_lens[s] - query_start_loc[s + 1] + t``
    (bottom-right alignment). Found on the device (a sorted search), never read on the host.
    Returns table [T, max_blocks_per_seq], key_lens int64 [T], query_pos int64 [T].
    """
    device = query_start_loc.device
    tokens = torch.arange(t0, t1, device=device)  # [T]
    ends = query_start_loc[1:].long()  # [num_seqs]
    # The sequence whose rows hold the token; clamped so that invalid starts cannot index out of range.
    seq = torch.searchsorted(ends, tokens, right=True).clamp_max(ends.shape[0] - 1)  # [T]
    lens = seq_lens.long()[seq]  # [T]
    query_pos = lens - ends[seq] + tokens
    key_lens = query_pos + 1 if causal else lens
    return block_tables[seq], key_lens, query_pos


def _attend_chunk(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    key_lens: torch.Tensor,
    query_pos: torch.Tensor,
    slopes: torch.Tensor | None,
    num_table_blocks: int,
    blocks_per_chunk: int,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    variants: _Variants = _PLAIN,
) -> torch.Tensor:
    """Attention of a chunk of rows, over their tables in pieces of ``blocks_per_chunk`` blocks.

    q [R, num_kv_heads, group, head_size] float32, pre-scaled; block_tables [R, max_blocks_per_seq]; key_lens
    int64 [R]: each row attends to cache positions ``0 .. key_lens - 1``; query_pos int64 [R]: the row's
    cache position, for ALiBi and the window; k_scale, v_scale float32 [] or [num_kv_heads] (a float8
    cache) or None. Returns float32 [R, num_kv_heads, group, head_size].
    """
    num_rows, num_kv_heads, group, head_size = q.shape
    block_size = key_cache.shape[1]
    device = q.device
    window_size, soft_cap, sinks = variants
    if sinks is None:
        running_max = torch.full((num_rows, num_kv_heads, group, 1), float("-inf"), device=device)
        running_sum = torch.zeros((num_rows, num_kv_heads, group, 1), device=device)
    else:
        # A sink is one more score with a zero value: the running softmax starts from it.
        running_max = sinks[None, :, :, None].expand(num_rows, num_kv_heads, group, 1)
        running_sum = torch.ones((num_rows, num_kv_heads, group, 1), device=device)
    # [R]: the first cache position a row attends to.
    first_key = None if window_size is None else query_pos - (window_size - 1)
    acc = torch.zeros_like(q)
    for b0 in range(0, num_table_blocks, blocks_per_chunk):
        b1 = min(num_table_blocks, b0 + blocks_per_chunk)
        num_tokens = (b1 - b0) * block_size
        block_start = torch.arange(b0, b1, device=device) * block_size  # [B]
        used = block_start[None, :] < key_lens[:, None]  # [R, B]
        if first_key is not None:  # blocks wholly before the window are not the row's
            used &= block_start[None, :] + block_size > first_key[:, None]
        # Table entries past a row's used blocks may be garbage: point them at block 0, whose contents are
        # masked out below.
        table = torch.where(used, block_tables[:, b0:b1].long(), 0)  # [R, B]
        positions = torch.arange(b0 * block_size, b1 * block_size, device=device)  # [T]
        valid = positions[None, :] < key_lens[:, None]  # [R, T]
        if first_key is not None:
            valid = valid & (positions[None, :] >= first_key[:, None])
        # reshape, not view: indexing a cache with strided pages (a head-major view) keeps their order.
        keys = _dequantized(key_cache[table].reshape(num_rows, num_tokens, num_kv_heads, head_size), k_scale)
        values = _dequantized(value_cache[table].reshape(num_rows, num_tokens, num_kv_heads, head_size),
                              v_scale)
        # Unused slots may hold NaN, and NaN * 0 is NaN: mask the values as well as the scores.
        values = torch.where(valid[:, :, None, None], values, 0.0)
        scores = torch.einsum("rhgd,rthd->rhgt", q, keys)  # [R, num_kv_heads, group, T]
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        if slopes is not None:
            distance = (positions[None, :] - query_pos[:, None]).float()  # [R, T]
            scores = scores + slopes[None, :, :, None] * distance[:, None, None, :]
        scores = torch.where(valid[:, None, None, :], scores, float("-inf"))
        new_max = torch.maximum(running_max, scores.amax(dim=-1, keepdim=True))
        # A row with no valid key yet has max -inf; subtracting 0 instead keeps exp() at 0, not NaN.
        safe_max = torch.where(torch.isinf(new_max), 0.0, new_max)
        probs = torch.exp(scores - safe_max)
        correction = torch.exp(running_max - safe_max)
        running_sum = running_sum * correction + probs.sum(dim=-1, keepdim=True)
        acc = acc * correction + torch.einsum("rhgt,rthd->rhgd", probs, values)
        running_max = new_max
    # Zeros only where a row has no key (seq_len 0); anything else divides, so a NaN in the query or in an
    # attended key or value propagates.
    return torch.where(key_lens[:, None, None, None] > 0, acc / running_sum, 0.0)


def _dequantized(stored: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """float32 of cached ``[..., num_kv_heads, head_size]``, times the float8 cache's scale (shape [] or
    [num_kv_heads]) where there is one."""
    values = stored.float()
    return values if scale is None else values * scale.view(-1, 1)


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``saturate(x.float() / scale)`` in float8 ``dtype``: x ``[..., num_kv_heads, head_size]``, scale
    float32 [] or [num_kv_heads]. Rounds to nearest even (as the kernel's conversion does) after clamping to
    the dtype's finite range, so an overflow saturates and NaN stays NaN."""
    limit = torch.finfo(dtype).max
    return (x.float() / scale.view(-1, 1)).clamp(-limit, limit).to(dtype)


def reshape_and_cache_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Write each token's K/V into its cache slot; negative slots (and, as in the kernel, slots past the
    cache) are skipped. With scales (a float8 cache) each value is stored as :func:`quantize_kv` makes it.

    Arguments are as for ``tpkit.attention.reshape_and_cache`` and are assumed valid.

    Skipping without a host sync: a boolean-mask selection would need the number of valid tokens on the
    host. Instead every skipped token is redirected to the slot of one valid "donor" token, carrying that
    donor's own K/V, so the duplicate writes all store identical bits and the result is deterministic.
    When no token is valid, the donor is slot 0 rewritten with its current contents, read before the write.
    """
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    num_blocks, block_size = key_cache.shape[:2]
    valid = (slot_mapping >= 0) & (slot_mapping < num_blocks * block_size)  # [num_tokens]
    any_valid = valid.any()
    # [1]: the first valid token, 0 when there is none. index_select, unlike indexing with a 0-d tensor,
    # never reads the index on the host.
    donor = torch.argmax(valid.int()).view(1)
    donor_slot = torch.where(any_valid, slot_mapping.index_select(0, donor), 0)  # [1]
    slots = torch.where(valid, slot_mapping, donor_slot)  # [num_tokens]
    blocks = torch.div(slots, block_size, rounding_mode="floor")
    offsets = slots - blocks * block_size
    for new, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        if scale is not None:
            new = quantize_kv(new, scale, cache.dtype)
        # [1, num_kv_heads, head_size]
        donor_row = torch.where(any_valid, new.index_select(0, donor), cache[:1, 0])
        rows = torch.where(valid[:, None, None], new, donor_row)  # [num_tokens, num_kv_heads, head_size]
        cache.index_put_((blocks, offsets), rows)
