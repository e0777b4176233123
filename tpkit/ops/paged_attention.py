"""The paged attention custom ops, ``torch.ops.tpkit.paged_attention`` and ``tpkit.reshape_and_cache``.

Each op has a default implementation in plain PyTorch (:mod:`tpkit.ops.paged_attention_reference`), used on
the CPU and on any device without a kernel of its own; a CUDA implementation that runs the CUDA kernel
(:mod:`tpkit.ops._extension`) and falls back to the PyTorch one on the GPU where the kernel cannot be
built; and a fake implementation, so both run under ``torch.compile`` and in CUDA graphs.

Arguments are validated inside every implementation (fake included, so ``torch.compile`` reports bad
shapes while tracing) without reading device memory. The contents of ``block_tables``, ``seq_lens``,
``query_start_loc`` and ``slot_mapping`` are checked too where that is free, on CPU tensors, and on other
devices with the environment variable ``TPKIT_DEBUG=1`` (which synchronises with the device).
"""

import math

import torch
from torch._subclasses.fake_tensor import FakeTensor

from tpkit.ops._checks import _FLOAT_DTYPES, _FP8_DTYPES, _check_devices, _check_same, _check_tensor
from tpkit.ops._library import _define_op
from tpkit.ops.paged_attention_reference import paged_attention_reference, reshape_and_cache_reference


def _contents_free(tensor: torch.Tensor) -> bool:
    """A CPU tensor's contents are read without waiting for a device: always checked (a tracing fake tensor
    has none)."""
    return tensor.device.type == "cpu" and not isinstance(tensor, FakeTensor)


def _check_caches(op: str, key_cache: torch.Tensor, value_cache: torch.Tensor, dtype: torch.dtype,
                  dtype_of: str, k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None) -> None:
    """The caches hold ``dtype`` (that of ``dtype_of``) without scales, or a float8 dtype with both
    ``k_scale`` and ``v_scale`` (float32, shape [] or [num_kv_heads]; on the CPU also finite and positive)."""
    if isinstance(key_cache, torch.Tensor) and key_cache.dtype not in (dtype, *_FP8_DTYPES):
        raise TypeError(f"{op}: key_cache: expected dtype {dtype} (that of {dtype_of}) or a float8 dtype "
                        f"{list(_FP8_DTYPES)} with k_scale and v_scale, got {key_cache.dtype}")
    _check_tensor(op, "key_cache", key_cache, dim=4, dtypes=(dtype, *_FP8_DTYPES))
    if key_cache.dtype in _FP8_DTYPES and (k_scale is None or v_scale is None):
        missing = "k_scale" if k_scale is None else "v_scale"
        raise ValueError(f"{op}: {missing}: expected a float32 scale for a {key_cache.dtype} cache "
                         f"(stored = saturate(x / scale)), got None")
    if key_cache.dtype not in _FP8_DTYPES and (k_scale is not None or v_scale is not None):
        given = "k_scale" if k_scale is not None else "v_scale"
        raise ValueError(f"{op}: {given}: expected None for a {key_cache.dtype} cache (the scales are "
                         f"those of a float8 cache), got a tensor")
    _check_tensor(op, "value_cache", value_cache, dim=4, dtypes=(key_cache.dtype,))
    _check_same(op, "value_cache", "shape (that of key_cache)", list(key_cache.shape),
                list(value_cache.shape))
    num_kv_heads = key_cache.shape[2]
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scale is None:
            continue
        if not isinstance(scale, torch.Tensor):
            raise TypeError(f"{op}: {name}: expected a torch.Tensor, got {type(scale).__name__}")
        if scale.dtype != torch.float32 or list(scale.shape) not in ([], [num_kv_heads]):
            raise ValueError(f"{op}: {name}: expected float32 of shape [] or [num_kv_heads] = "
                             f"[{num_kv_heads}], got {scale.dtype} of shape {list(scale.shape)}")
        _check_devices(op, "key_cache", key_cache, **{name: scale})
        if _contents_free(scale):
            bad = (~(torch.isfinite(scale) & (scale > 0))).view(-1).nonzero()
            if bad.numel():
                i = int(bad[0, 0])
                raise ValueError(f"{op}: {name}: expected finite positive scales, got "
                                 f"{float(scale.view(-1)[i])} at index {i}")


def _check_paged_attention(
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
    *,
    read_values: bool = False,
) -> None:
    """Shapes, dtypes, devices and strides; with ``read_values`` also the contents of the tables (a sync).
    ``query_start_loc``'s contents are read with ``read_values`` or where it is a real CPU tensor."""
    op = "paged_attention"
    _check_tensor(op, "query", query, dim=3, dtypes=_FLOAT_DTYPES)
    num_rows, num_heads, head_size = query.shape
    # One query token a sequence, or sequences (as many as block_tables has rows) owning ranges of tokens.
    num_seqs = num_rows if query_start_loc is None else block_tables.shape[0]
    seqs_shape = "shape [num_seqs]" if query_start_loc is None else "shape [num_seqs] (that of block_tables)"
    _check_tensor(op, "out", out, dim=3, dtypes=(query.dtype,))
    _check_same(op, "out", "shape", list(query.shape), list(out.shape))
    _check_caches(op, key_cache, value_cache, query.dtype, "query", k_scale, v_scale)
    num_kv_heads = key_cache.shape[2]
    _check_same(op, "key_cache", "head_size (dim 3, that of query)", head_size, key_cache.shape[3])
    if num_kv_heads < 1 or num_heads % num_kv_heads != 0:
        raise ValueError(f"{op}: key_cache: expected num_kv_heads (dim 2) to divide num_heads = {num_heads} "
                         f"of query, got {num_kv_heads}")
    _check_tensor(op, "block_tables", block_tables, dim=2, dtypes=(torch.int32,))
    _check_same(op, "block_tables", "num_seqs (dim 0, that of query)", num_seqs, block_tables.shape[0])
    _check_tensor(op, "seq_lens", seq_lens, dim=1, dtypes=(torch.int32,))
    _check_same(op, "seq_lens", seqs_shape, [num_seqs], list(seq_lens.shape))
    if not math.isfinite(scale):
        raise ValueError(f"{op}: scale: expected a finite float, got {scale}")
    tensors = dict(out=out, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                   seq_lens=seq_lens)
    if query_start_loc is not None:
        _check_tensor(op, "query_start_loc", query_start_loc, dim=1, dtypes=(torch.int32,))
        _check_same(op, "query_start_loc", "shape [num_seqs + 1] (num_seqs that of block_tables)",
                    [num_seqs + 1], list(query_start_loc.shape))
        if num_seqs == 0 and num_rows > 0:
            raise ValueError(f"{op}: query: expected no tokens (num_tokens 0) for no sequences (block_tables "
                             f"has 0 rows), got shape {list(query.shape)}")
        tensors["query_start_loc"] = query_start_loc
    if alibi_slopes is not None:
        _check_tensor(op, "alibi_slopes", alibi_slopes, dim=1, dtypes=(torch.float32,))
        _check_same(op, "alibi_slopes", "shape [num_heads]", [num_heads], list(alibi_slopes.shape))
        tensors["alibi_slopes"] = alibi_slopes
    _check_variants(window_size, logits_soft_cap)
    if sinks is not None:
        _check_tensor(op, "sinks", sinks, dim=1, dtypes=(torch.float32,))
        _check_same(op, "sinks", "shape [num_heads]", [num_heads], list(sinks.shape))
        tensors["sinks"] = sinks
    _check_devices(op, "query", query, **tensors)
    if read_values or _contents_free(block_tables):
        first_needed = None
        if window_size is not None:
            # The first cache position any query of the sequence sees: its first query's window start.
            if query_start_loc is None:
                query_lens = torch.ones_like(seq_lens)
            else:
                query_lens = query_start_loc[1:] - query_start_loc[:-1]
            first_needed = seq_lens.long() - query_lens.long() - (window_size - 1)
        _check_table_values(key_cache, block_tables, seq_lens, first_needed)
    if query_start_loc is not None and (read_values or _contents_free(query_start_loc)):
        _check_query_start_loc_values(query_start_loc, seq_lens, num_rows)


def _check_variants(window_size: int | None, logits_soft_cap: float | None) -> None:
    """``window_size`` an int >= 1, ``logits_soft_cap`` a finite number > 0 (or None): a window of no keys or
    a cap of 0 has no meaning, and a negative cap would reverse the scores' order."""
    op = "paged_attention"
    if window_size is not None:
        if isinstance(window_size, bool) or not isinstance(window_size, int):
            raise TypeError(f"{op}: window_size: expected an int or None, got {type(window_size).__name__}")
        if window_size < 1:
            raise ValueError(f"{op}: window_size: expected an int >= 1 (the keys a query sees, its own "
                             f"included), got {window_size}")
    if logits_soft_cap is not None:
        if isinstance(logits_soft_cap, bool) or not isinstance(logits_soft_cap, (int, float)):
            raise TypeError(f"{op}: logits_soft_cap: expected a float or None, got "
                            f"{type(logits_soft_cap).__name__}")
        if not (math.isfinite(logits_soft_cap) and logits_soft_cap > 0):
            raise ValueError(f"{op}: logits_soft_cap: expected a finite float > 0, got {logits_soft_cap}")


def _check_table_values(key_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        first_needed: torch.Tensor | None = None) -> None:
    """Every block a sequence's queries read holds a valid index: those below ``seq_lens`` and, with a
    window, ending after ``first_needed`` (int64 [num_seqs], the first position any query sees)."""
    num_blocks, block_size = key_cache.shape[:2]
    capacity = block_tables.shape[1] * block_size
    bad_lens = ((seq_lens < 0) | (seq_lens > capacity)).nonzero()
    if bad_lens.numel():
        i = int(bad_lens[0, 0])
        raise ValueError(f"paged_attention: seq_lens[{i}]: expected a length in [0, {capacity}] (the "
                         f"capacity of block_tables), got {int(seq_lens[i])}")
    block_start = torch.arange(block_tables.shape[1], device=block_tables.device) * block_size
    used = block_start[None, :] < seq_lens[:, None].long()  # [num_seqs, max_blocks_per_seq]
    if first_needed is not None:
        used &= block_start[None, :] + block_size > first_needed[:, None]
    bad_entries = (used & ((block_tables < 0) | (block_tables >= num_blocks))).nonzero()
    if bad_entries.numel():
        i, j = (int(x) for x in bad_entries[0])
        raise ValueError(f"paged_attention: block_tables[{i}, {j}]: expected a block index in [0, "
                         f"{num_blocks}) (a block that seq_lens[{i}] = {int(seq_lens[i])} uses), got "
                         f"{int(block_tables[i, j])}")


def _check_query_start_loc_values(query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                                  num_tokens: int) -> None:
    starts = query_start_loc.long()
    num_seqs = starts.shape[0] - 1
    debug = "" if _contents_free(query_start_loc) else " (TPKIT_DEBUG check)"
    if int(starts[0]) != 0:
        raise ValueError(f"paged_attention: query_start_loc[0]: expected 0, got {int(starts[0])}{debug}")
    query_lens = starts[1:] - starts[:-1]  # [num_seqs]
    decreasing = (query_lens < 0).nonzero()
    if decreasing.numel():
        i = int(decreasing[0, 0])
        raise ValueError(f"paged_attention: query_start_loc: expected non-decreasing entries, got "
                         f"query_start_loc[{i + 1}] = {int(starts[i + 1])} after query_start_loc[{i}] = "
                         f"{int(starts[i])}{debug}")
    if int(starts[-1]) != num_tokens:
        raise ValueError(f"paged_attention: query_start_loc[{num_seqs}]: expected num_tokens = {num_tokens} "
                         f"(dim 0 of query), got {int(starts[-1])}{debug}")
    # A sequence's query tokens are the last of its cached tokens: there are at most seq_lens of them.
    too_many = (query_lens > seq_lens.long()).nonzero()
    if too_many.numel():
        i = int(too_many[0, 0])
        raise ValueError(f"paged_attention: query_start_loc: expected at most seq_lens[{i}] = "
                         f"{int(seq_lens[i])} query tokens for sequence {i} (its last tokens in the cache), "
                         f"got {int(query_lens[i])}{debug}")


def _check_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    *,
    read_values: bool = False,
) -> None:
    """Shapes, dtypes, devices and strides; with ``read_values`` also the slots (a sync)."""
    op = "reshape_and_cache"
    _check_tensor(op, "key", key, dim=3, dtypes=_FLOAT_DTYPES)
    _check_tensor(op, "value", value, dim=3, dtypes=(key.dtype,))
    _check_same(op, "value", "shape (that of key)", list(key.shape), list(value.shape))
    _check_caches(op, key_cache, value_cache, key.dtype, "key", k_scale, v_scale)
    _check_same(op, "key_cache", "[num_kv_heads, head_size] (dims 2, 3, those of key)", list(key.shape[1:]),
                list(key_cache.shape[2:]))
    _check_tensor(op, "slot_mapping", slot_mapping, dim=1, dtypes=(torch.int64,))
    _check_same(op, "slot_mapping", "shape [num_tokens]", [key.shape[0]], list(slot_mapping.shape))
    _check_devices(op, "key", key, value=value, key_cache=key_cache, value_cache=value_cache,
                   slot_mapping=slot_mapping)
    if read_values or _contents_free(slot_mapping):
        _check_slot_values(key_cache, slot_mapping)


def _check_slot_values(key_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    num_slots = key_cache.shape[0] * key_cache.shape[1]
    bad = (slot_mapping >= num_slots).nonzero()
    if bad.numel():
        i = int(bad[0, 0])
        raise ValueError(f"reshape_and_cache: slot_mapping[{i}]: expected a slot below num_blocks * "
                         f"block_size = {num_slots} (or negative to skip), got {int(slot_mapping[i])}")
    # Two tokens written to one slot would leave whichever the device writes last.
    slots, order = slot_mapping.sort(stable=True)
    repeated = ((slots[1:] == slots[:-1]) & (slots[1:] >= 0)).nonzero()
    if repeated.numel():
        k = int(repeated[0, 0])
        first, second = sorted((int(order[k]), int(order[k + 1])))
        raise ValueError(f"reshape_and_cache: slot_mapping[{second}]: expected distinct slots (or negative "
                         f"to skip), got {int(slots[k])}, the slot of slot_mapping[{first}] too")


_define_op(
    "paged_attention",
    "(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
    "Tensor seq_lens, float scale, Tensor? alibi_slopes, Tensor? query_start_loc=None, "
    "bool causal=True, Tensor? k_scale=None, Tensor? v_scale=None, SymInt? window_size=None, "
    "float? logits_soft_cap=None, Tensor? sinks=None) -> ()",
    ("out",),
    _check_paged_attention,
    paged_attention_reference,
)
_define_op(
    "reshape_and_cache",
    "(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, Tensor slot_mapping, "
    "Tensor? k_scale=None, Tensor? v_scale=None) -> ()",
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
    query_start_loc: torch.Tensor | None = None,
    causal: bool = True,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    window_size: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of query tokens over their sequences' keys and values in a paged cache.

    Without ``query_start_loc`` (decode): one query token a sequence, its last cached token, attending to
    all of its keys. With it, any step shape (a prefill, a chunk after a cached prefix, speculative tokens,
    a mix of those and decodes): sequence ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i + 1]``
    (``q_len_i`` of them, 0 allowed), the last ``q_len_i`` of its ``seq_lens[i]`` tokens in the cache (already
    written there by :func:`reshape_and_cache`).

    Args:
        query: ``[num_seqs, num_heads, head_size]``, or with ``query_start_loc`` ``[num_tokens, num_heads,
            head_size]``; float16, bfloat16 or float32.
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, query's dtype or a
            float8 dtype (``torch.float8_e4m3fn``, ``torch.float8_e5m2``) with ``k_scale`` and ``v_scale``.
            Query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)`` (MHA, GQA, MQA).
        block_tables: int32 ``[num_seqs, max_blocks_per_seq]``, logical block -> physical block. Entries
            past a sequence's last used block are never read.
        seq_lens: int32 ``[num_seqs]``, tokens of each sequence in the cache, at most the table's
            capacity; 0 gives zeros. NaN in a used key, value or the query gives NaN. Checked, with
            ``block_tables``, on CPU tensors (and with ``TPKIT_DEBUG=1`` elsewhere).
        scale: score scale, finite, default ``1 / sqrt(head_size)``.
        alibi_slopes: optional float32 ``[num_heads]``: adds ``slope * (key_pos - query_pos)``, both cache
            positions (a decode query stands at ``seq_len - 1``, query ``j`` of sequence ``i`` at
            ``seq_lens[i] - q_len_i + j``).
        out: optional tensor shaped like ``query`` that receives the result.
        query_start_loc: optional int32 ``[num_seqs + 1]``, non-decreasing from 0 to ``num_tokens``, with
            ``q_len_i <= seq_lens[i]``. Its contents are checked on the CPU, and on GPUs under
            ``TPKIT_DEBUG=1`` (a check there would synchronise).
        causal: with ``query_start_loc``, query ``j`` of sequence ``i`` attends to cache positions
            ``0 .. seq_lens[i] - q_len_i + j`` (bottom-right aligned, as FlashAttention's); False: to all
            ``seq_lens[i]`` keys (cross-attention over an encoder's cached K/V). A decode query attends to
            all of its sequence's keys either way.

    Returns:
        query's shape and dtype (``out`` when given). Accumulation is float32.
    """
    if not isinstance(query, torch.Tensor):
        raise TypeError(f"paged_attention: query: expected a torch.Tensor, got {type(query).__name__}")
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"paged_attention: scale: expected a float or None, got {type(scale).__name__}")
    if not isinstance(causal, bool):
        raise TypeError(f"paged_attention: causal: expected a bool, got {type(causal).__name__}")
    _check_variants(window_size, logits_soft_cap)
    if sinks is not None and not isinstance(sinks, torch.Tensor):
        raise TypeError(f"paged_attention: sinks: expected a torch.Tensor or None, got "
                        f"{type(sinks).__name__}")
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    k_scale = _as_scale("paged_attention", "k_scale", k_scale, key_cache)
    v_scale = _as_scale("paged_attention", "v_scale", v_scale, key_cache)
    cap = None if logits_soft_cap is None else float(logits_soft_cap)
    torch.ops.tpkit.paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, float(scale),
                                    alibi_slopes, query_start_loc, causal, k_scale, v_scale, window_size, cap,
                                    sinks)
    return out


def _as_scale(op: str, name: str, scale: object, key_cache: object) -> torch.Tensor | None:
    """A float32 tensor on the caches' device for a Python number; a tensor or None as it is."""
    if scale is None or isinstance(scale, torch.Tensor):
        return scale
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{op}: {name}: expected a float, a float32 tensor or None, got "
                        f"{type(scale).__name__}")
    device = key_cache.device if isinstance(key_cache, torch.Tensor) else None
    return torch.tensor(float(scale), dtype=torch.float32, device=device)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
) -> None:
    """Write new tokens' keys and values into the paged cache, in place.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_size]``, the caches' dtype (or any float dtype for a
            float8 cache).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, written in place; key's
            dtype, or a float8 dtype with ``k_scale`` and ``v_scale``.
        slot_mapping: int64 ``[num_tokens]``, ``block * block_size + offset``, distinct; a negative slot
            skips the token (padding). On CPU tensors a slot past the cache or a repeated one is an error;
            on a GPU the kernel skips a slot past the cache rather than write out of bounds, and
            ``TPKIT_DEBUG=1`` reports both.
        k_scale, v_scale: with a float8 cache (and only then), float32 tensors of shape ``[]`` or
            ``[num_kv_heads]`` (or Python floats, as in :func:`paged_attention`): each element is stored as
            ``saturate(x.float() / scale)``, rounded to nearest even and clamped to the dtype's finite range
            (NaN stays NaN).
    """
    k_scale = _as_scale("reshape_and_cache", "k_scale", k_scale, key_cache)
    v_scale = _as_scale("reshape_and_cache", "v_scale", v_scale, key_cache)
    torch.ops.tpkit.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
