"""The paged attention custom ops, ``torch.ops.tpkit.paged_attention`` and ``tpkit.reshape_and_cache``.

Each op has a default implementation in plain PyTorch (:mod:`tpkit.ops.paged_attention_reference`), used on
the CPU and on any device without a kernel of its own; a CUDA implementation that runs the CUDA kernel
(:mod:`tpkit.ops._extension`) and falls back to the PyTorch one on the GPU where the kernel cannot be
built; and a fake implementation, so both run under ``torch.compile`` and in CUDA graphs.

Arguments are validated inside every implementation (fake included, so ``torch.compile`` reports bad
shapes while tracing) without reading device memory. With the environment variable ``TPKIT_DEBUG=1`` the
real implementations also check the contents of ``block_tables``, ``seq_lens`` and ``slot_mapping``,
which synchronises with the device.
"""

import math

import torch

from tpkit.ops._checks import _FLOAT_DTYPES, _check_devices, _check_same, _check_tensor
from tpkit.ops._library import _define_op
from tpkit.ops.paged_attention_reference import paged_attention_reference, reshape_and_cache_reference


def _check_caches(op: str, key_cache: torch.Tensor, value_cache: torch.Tensor, dtype: torch.dtype) -> None:
    _check_tensor(op, "key_cache", key_cache, dim=4, dtypes=(dtype,))
    _check_tensor(op, "value_cache", value_cache, dim=4, dtypes=(dtype,))
    _check_same(op, "value_cache", "shape (that of key_cache)", list(key_cache.shape),
                list(value_cache.shape))


def _check_paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    alibi_slopes: torch.Tensor | None,
    *,
    read_values: bool = False,
) -> None:
    """Shapes, dtypes, devices and strides; with ``read_values`` also the contents of the tables (a sync)."""
    op = "paged_attention"
    _check_tensor(op, "query", query, dim=3, dtypes=_FLOAT_DTYPES)
    num_seqs, num_heads, head_size = query.shape
    _check_tensor(op, "out", out, dim=3, dtypes=(query.dtype,))
    _check_same(op, "out", "shape", list(query.shape), list(out.shape))
    _check_caches(op, key_cache, value_cache, query.dtype)
    num_kv_heads = key_cache.shape[2]
    _check_same(op, "key_cache", "head_size (dim 3, that of query)", head_size, key_cache.shape[3])
    if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
        raise ValueError(f"{op}: key_cache: expected num_kv_heads (dim 2) to divide num_heads = {num_heads} "
                         f"of query, got {num_kv_heads}")
    _check_tensor(op, "block_tables", block_tables, dim=2, dtypes=(torch.int32,))
    _check_same(op, "block_tables", "num_seqs (dim 0, that of query)", num_seqs, block_tables.shape[0])
    _check_tensor(op, "seq_lens", seq_lens, dim=1, dtypes=(torch.int32,))
    _check_same(op, "seq_lens", "shape [num_seqs]", [num_seqs], list(seq_lens.shape))
    tensors = dict(out=out, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                   seq_lens=seq_lens)
    if alibi_slopes is not None:
        _check_tensor(op, "alibi_slopes", alibi_slopes, dim=1, dtypes=(torch.float32,))
        _check_same(op, "alibi_slopes", "shape [num_heads]", [num_heads], list(alibi_slopes.shape))
        tensors["alibi_slopes"] = alibi_slopes
    _check_devices(op, "query", query, **tensors)
    if read_values:
        _check_table_values(key_cache, block_tables, seq_lens)


def _check_table_values(key_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
    num_blocks, block_size = key_cache.shape[:2]
    capacity = block_tables.shape[1] * block_size
    bad_lens = ((seq_lens < 0) | (seq_lens > capacity)).nonzero()
    if bad_lens.numel():
        i = int(bad_lens[0, 0])
        raise ValueError(f"paged_attention: seq_lens[{i}]: expected a length in [0, {capacity}] (the "
                         f"capacity of block_tables), got {int(seq_lens[i])} (TPKIT_DEBUG check)")
    block_start = torch.arange(block_tables.shape[1], device=block_tables.device) * block_size
    used = block_start[None, :] < seq_lens[:, None].long()  # [num_seqs, max_blocks_per_seq]
    bad_entries = (used & ((block_tables < 0) | (block_tables >= num_blocks))).nonzero()
    if bad_entries.numel():
        i, j = (int(x) for x in bad_entries[0])
        raise ValueError(f"paged_attention: block_tables[{i}, {j}]: expected a block index in [0, "
                         f"{num_blocks}), got {int(block_tables[i, j])} (TPKIT_DEBUG check)")


def _check_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    read_values: bool = False,
) -> None:
    """Shapes, dtypes, devices and strides; with ``read_values`` also the slots (a sync)."""
    op = "reshape_and_cache"
    _check_tensor(op, "key", key, dim=3, dtypes=_FLOAT_DTYPES)
    _check_tensor(op, "value", value, dim=3, dtypes=(key.dtype,))
    _check_same(op, "value", "shape (that of key)", list(key.shape), list(value.shape))
    _check_caches(op, key_cache, value_cache, key.dtype)
    _check_same(op, "key_cache", "[num_kv_heads, head_size] (dims 2, 3, those of key)", list(key.shape[1:]),
                list(key_cache.shape[2:]))
    _check_tensor(op, "slot_mapping", slot_mapping, dim=1, dtypes=(torch.int64,))
    _check_same(op, "slot_mapping", "shape [num_tokens]", [key.shape[0]], list(slot_mapping.shape))
    _check_devices(op, "key", key, value=value, key_cache=key_cache, value_cache=value_cache,
                   slot_mapping=slot_mapping)
    if read_values:
        _check_slot_values(key_cache, slot_mapping)


def _check_slot_values(key_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    bad = (slot_mapping >= num_slots).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ValueError(f"reshape_and_cache: slot_mapping[{i}]: expected a slot below num_blocks * "
                         f"block_size = {num_slots} (or negative to skip), got {int(slot_mapping[i])} "
                         f"(TPKIT_DEBUG check)")


_define_op(
    "paged_attention",
    "(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
    "Tensor seq_lens, float scale, Tensor? alibi_slopes) -> ()",
    ("out",),
    _check_paged_attention,
    paged_attention_reference,
)
_define_op(
    "reshape_and_cache",
    "(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping) -> ()",
    ("key_cache", "value_cache"),
    _check_reshape_and_cache,
    reshape_and_cache_reference,
)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention: each sequence's query attends to its keys and values in a paged cache.

    Args:
        query: ``[num_seqs, num_heads, head_size]``, float16, bfloat16 or float32.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, query's dtype.
            Query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)`` (MHA, GQA, MQA).
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``, logical block -> physical block. Entries
            past a sequence's last used block are never read.
        seq_lens: int32 ``[num_seqs]``, tokens of each sequence in the cache; 0 gives zeros.
        scale: score scale, default ``1 / sqrt(head_size)``.
        alibi_slopes: optional float32 ``[num_heads]``: adds ``slope * (key_pos - (seq_len - 1))``.
        out: optional tensor shaped like ``query`` that receives the result.

    Returns:
        ``[num_seqs, num_heads, head_size]`` in query's dtype (``out`` when given). Accumulation is float32.
    """
    if not isinstance(query, torch.Tensor):
        raise TypeError(f"paged_attention: query: expected a torch.Tensor, got {type(query).__name__}")
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"paged_attention: scale: expected a float or None, got {type(scale).__name__}")
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    torch.ops.tpkit.paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, float(scale),
                                    alibi_slopes)
    return out


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new tokens' keys and values into the paged cache, in place.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_size]``, the caches' dtype.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, written in place.
        slot_mapping: int64 ``[num_tokens]``, ``block * block_size + offset``; a negative slot skips the
            token (padding). A slot past the cache is skipped too rather than written out of bounds
            (``TPKIT_DEBUG=1`` reports it).
    """
    torch.ops.tpkit.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
