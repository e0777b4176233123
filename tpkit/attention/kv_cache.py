"""Paged KV cache: per-layer key/value caches, the sequences that live in them, and their blocks.

Blocks are shared between sequences with reference counts (a fork, a common prompt prefix) and are never
written while shared: a write into a block that another sequence also holds goes to a copy of it first
(copy-on-write); a write into a block the prefix cache knows by its tokens takes it out of the prefix cache
first. The prefix cache (:mod:`tpkit.attention.block_pool`) finds a new prompt's already-computed full
blocks by the hash chain of their token ids and keeps released blocks until their memory is needed.
"""

from __future__ import annotations

import array
import itertools
import logging
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tpkit._memory import available_bytes
from tpkit.attention.block_pool import ROOT_HASH, BlockPool, block_hash
from tpkit.attention.host_tensors import (
    _block_tables,
    _segment_ids,
    _segment_positions,
    copy_to_device,
    host_longs,
)
from tpkit.attention.kv_scales import FP8_KV_DTYPES, set_kv_scales

logger = logging.getLogger("tpkit.attention")


@dataclass
class AttentionMetadata:
    """Where one forward step of a batch of sequences reads and writes the paged cache.

    Two step shapes. A packed step (``query_start_loc`` set; from :meth:`PagedKVCache.step_metadata` or
    :meth:`~PagedKVCache.prefill_metadata`) runs tokens packed sequence after sequence: ``query_lens[i]`` of
    sequence ``i``, the last of its ``seq_lens[i]`` tokens (a prompt, a chunk after cached tokens,
    speculative tokens, one decode token, or any mix of those). A decode step (``query_start_loc`` None;
    from :meth:`~PagedKVCache.decode_metadata`) runs one token a sequence, row ``i`` of the batch.

    ``slot_mapping`` has one entry per new K/V token the step writes, in the order they are passed (a
    packed step's tokens, or a decode step's rows): the cache slot (``block * block_size + offset``) its K/V
    is written to, -1 for none (padding rows, cross-attention steps that only read).
    """

    slot_mapping: torch.Tensor  # int64 [num_new_tokens]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor  # int32 [num_seqs]: tokens in the cache after this step
    query_lens: torch.Tensor  # int32 [num_seqs]
    query_start_loc: torch.Tensor | None = None  # int32 [num_seqs + 1]; None at a decode step

    @property
    def is_prefill(self) -> bool:
        """A packed step: anything but the one-token-a-sequence decode shape."""
        return self.query_start_loc is not None


def _check_config(dtype: object, **sizes: object) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"PagedKVCache: {name}: expected an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"PagedKVCache: {name}: expected a positive int, got {value}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"PagedKVCache: dtype: expected a floating-point torch.dtype, got {dtype!r}")


def _as_count(value: object, where: str, seq_id: int, minimum: int) -> int:
    """An int >= ``minimum`` (Python, NumPy and 0-d tensor integers alike; floats refused)."""
    what = "positive ints" if minimum == 1 else "non-negative ints"
    error = ValueError(f"PagedKVCache.{where}: expected {what}, got {value!r} for seq_id {seq_id}")
    if isinstance(value, bool):
        raise error
    try:
        count = operator.index(value)
    except TypeError:
        raise error from None
    if count < minimum:
        raise error
    return count


def _plain_ints(values: Sequence[object], minimum: int) -> list[int] | None:
    """``values`` as a list where every one is a Python int >= ``minimum`` (the common case, checked at
    once); None where any is not, for a check one by one."""
    ids = list(values)
    if set(map(type, ids)) <= {int} and min(ids, default=minimum) >= minimum:
        return ids
    return None


def _as_token_ids(token_ids: object, where: str, seq_id: int, length: int | None = None) -> list[int]:
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise TypeError(f"PagedKVCache.{where}: token_ids: expected a list of token ids for seq_id {seq_id}, "
                        f"got {type(token_ids).__name__}")
    ids = _plain_ints(token_ids, 0)
    if ids is None:
        ids = [_as_count(token, f"{where}: token_ids", seq_id, 0) for token in token_ids]
    if length is not None and len(ids) != length:
        raise ValueError(f"PagedKVCache.{where}: token_ids: expected {length} token ids for seq_id {seq_id} "
                         f"(its num_tokens), got {len(ids)}")
    return ids


def _bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_size: int,
                     dtype: torch.dtype) -> int:
    # Keys and values, every layer.
    return 2 * num_layers * block_size * num_kv_heads * head_size * dtype.itemsize


class PagedKVCache:
    """Per-layer key and value caches of one rank's KV heads, with the sequences that hold their blocks.

    Each cache is ``[num_blocks, block_size, num_kv_heads, head_size]``, in ``dtype``: the model's, or a
    float8 dtype (``torch.float8_e4m3fn``, ``torch.float8_e5m2``), half the memory of a 16-bit cache, whose
    layers each have a float32 ``k_scale`` and ``v_scale`` (stored = saturate(x / scale); 1.0 until
    :meth:`set_scales` sets them, of shape [] or per KV head [num_kv_heads]; :meth:`scales` gives them to the
    ops). A sequence (named by an int
    ``seq_id``) holds a list of blocks, allocated as it grows and shared by every layer; its block table
    maps its logical blocks to those physical blocks. Every method checks its arguments and the free blocks
    before it changes anything: a bad argument is a ValueError or TypeError, too few free blocks a
    RuntimeError, and the cache is then as it was.

    A step's metadata comes from :meth:`decode_metadata` (one new token a sequence, the decode kernel's
    shape) or, for any other shape, from :meth:`step_metadata` over tokens already appended with
    :meth:`append_slots` (chunks of a prompt, speculative tokens, decodes, in one step); :meth:`add_sequence`
    starts a sequence, from the prefix cache where its prompt's first blocks are there, and
    :meth:`prefill_metadata` does all three for new prompts. :meth:`fork` shares a sequence's blocks with a
    new one, :meth:`truncate` drops a sequence's last tokens (rejected speculative tokens), :meth:`free`
    lets its blocks go.
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        _check_config(dtype, num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
                      num_kv_heads=num_kv_heads, head_size=head_size)
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_blocks, block_size, num_kv_heads, head_size)
        total = _bytes_per_block(num_layers, block_size, num_kv_heads, head_size, dtype) * num_blocks
        available = available_bytes(self.device)
        if available is not None and total > available:
            raise ValueError(f"PagedKVCache: num_blocks: {num_layers} layers' key and value caches of "
                             f"[num_blocks={num_blocks}, block_size={block_size}, num_kv_heads="
                             f"{num_kv_heads}, head_size={head_size}] {dtype} take {total / 1e9:.3g} GB, "
                             f"more than the {available / 1e9:.3g} GB available on {self.device}: fewer "
                             "num_blocks, or from_memory_budget")
        self.key_caches: list[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=self.device)
                                               for _ in range(num_layers)]
        self.value_caches: list[torch.Tensor] = [torch.zeros(shape, dtype=dtype, device=self.device)
                                                 for _ in range(num_layers)]
        # A float8 cache's scales, one float32 tensor a layer each, owned here so that a captured step reads
        # them from fixed addresses.
        fp8 = dtype in FP8_KV_DTYPES
        self.k_scales = [torch.ones((), device=self.device) for _ in range(num_layers)] if fp8 else None
        self.v_scales = [torch.ones((), device=self.device) for _ in range(num_layers)] if fp8 else None
        self._pool = BlockPool(num_blocks)
        # Each sequence's blocks, as C ints: a step's block tables are built from them in one copy.
        self._seq_blocks: dict[int, array.array] = {}
        self._seq_lens: dict[int, int] = {}
        # The token ids of each sequence's first tokens, where they were given without a gap (the prefix
        # cache's keys), and the hash chain of its full blocks among them.
        self._seq_tokens: dict[int, list[int]] = {}
        self._seq_hashes: dict[int, list[bytes]] = {}

    @classmethod
    def from_memory_budget(
        cls,
        memory_bytes: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> PagedKVCache:
        """As many blocks as fit in ``memory_bytes`` (keys and values of every layer), on this rank."""
        _check_config(dtype, memory_bytes=memory_bytes, num_layers=num_layers, block_size=block_size,
                      num_kv_heads=num_kv_heads, head_size=head_size)
        block_bytes = _bytes_per_block(num_layers, block_size, num_kv_heads, head_size, dtype)
        num_blocks = memory_bytes // block_bytes
        if num_blocks < 1:
            raise ValueError(f"PagedKVCache: memory_bytes: expected at least one KV block's worth "
                             f"({block_bytes} bytes for {num_layers} layers), got {memory_bytes}")
        logger.info("# KV blocks: %d (%d tokens) per rank", num_blocks, num_blocks * block_size)
        return cls(num_layers, num_blocks, block_size, num_kv_heads, head_size, dtype=dtype, device=device)

    @property
    def is_fp8(self) -> bool:
        """The cache holds float8 keys and values, with scales."""
        return self.k_scales is not None

    def scales(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Layer ``layer_idx``'s ``(k_scale, v_scale)``, float32 tensors on the cache's device, for
        ``reshape_and_cache`` and ``paged_attention``; ``(None, None)`` for a cache in the model's dtype."""
        if self.k_scales is None or self.v_scales is None:
            return None, None
        return self.k_scales[layer_idx], self.v_scales[layer_idx]

    def set_scales(self, layer_idx: int, k_scale: torch.Tensor | float,
                   v_scale: torch.Tensor | float) -> None:
        """Set a float8 cache's scales of layer ``layer_idx``: floats or float tensors of shape [] or
        [num_kv_heads], finite and positive (see :func:`tpkit.attention.set_kv_scales`)."""
        set_kv_scales(self, layer_idx, k_scale, v_scale)

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones and those only the prefix cache keeps."""
        return self._pool.num_available

    @property
    def num_cached_blocks(self) -> int:
        """Blocks no sequence holds whose K/V the prefix cache keeps (evicted, oldest first, when needed)."""
        return self._pool.num_cached

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seq_blocks

    def seq_len(self, seq_id: int) -> int:
        """Tokens of ``seq_id`` in the cache."""
        self._check_known(seq_id)
        return self._seq_lens[seq_id]

    def add_sequence(self, seq_id: int, token_ids: Sequence[int] | None = None) -> int:
        """Start sequence ``seq_id``, empty or, given its prompt's ``token_ids``, holding the prompt's longest
        prefix of full blocks the prefix cache has. Returns the tokens it starts with (a multiple of
        ``block_size``, at most ``len(token_ids) - 1``: the last token always runs, for its logits)."""
        self._check_new(seq_id, "add_sequence", "seq_id")
        tokens = [] if token_ids is None else _as_token_ids(token_ids, "add_sequence", seq_id)
        blocks, hashes = [], []
        parent = ROOT_HASH
        for start in range(0, len(tokens) - self.block_size, self.block_size):
            parent = block_hash(parent, tokens[start:start + self.block_size])
            block = self._pool.lookup(parent)
            if block is None:
                break
            blocks.append(block)
            hashes.append(parent)
        for block in blocks:
            self._pool.hold(block)
        self._seq_blocks[seq_id] = array.array("i", blocks)
        self._seq_lens[seq_id] = len(blocks) * self.block_size
        self._seq_tokens[seq_id] = tokens[:self._seq_lens[seq_id]]
        self._seq_hashes[seq_id] = hashes
        return self._seq_lens[seq_id]

    def append_slots(self, seq_ids: Sequence[int], num_tokens: Sequence[int], *,
                     token_ids: Sequence[Sequence[int]] | None = None) -> None:
        """Room for ``num_tokens[i]`` more tokens at the end of each cached sequence ``seq_ids[i]`` (0
        allowed), all or none of them. ``token_ids`` (one list per sequence), where given, are those tokens'
        ids: the blocks they fill are then registered in the prefix cache. A step then runs the tokens with
        :meth:`step_metadata`."""
        seq_ids = self._check_seq_ids(seq_ids)
        self._check_all_known(seq_ids)
        counts = self._check_counts(seq_ids, num_tokens, "append_slots", "num_tokens", 0)
        tokens = self._check_token_ids(seq_ids, counts, token_ids, "append_slots")
        self._check_available(sum(self._append_cost(s, n) for s, n in zip(seq_ids, counts, strict=True)),
                              "append")
        for seq_id, count, ids in zip(seq_ids, counts, tokens, strict=True):
            self._append(seq_id, count, ids)

    def record_token_ids(self, seq_id: int, start: int, token_ids: Sequence[int]) -> None:
        """The ids of tokens ``start ..`` of ``seq_id``, learnt after their slots were appended without them
        (a token drawn on the GPU while the host appended its slot) or before (its slot comes later): the
        blocks they fill are registered in the prefix cache once their slots are appended too. Ids are
        recorded in order: where the id of a token before ``start`` is not known, nothing is recorded."""
        self._check_known(seq_id)
        ids = _as_token_ids(token_ids, "record_token_ids", seq_id)
        start = _as_count(start, "record_token_ids: start", seq_id, 0)
        self._record_ids(seq_id, start, ids)
        self._register_blocks(seq_id)

    def step_metadata(self, seq_ids: Sequence[int], query_lens: Sequence[int], *,
                      block_table_width: int | None = None, on_host: bool = False) -> AttentionMetadata:
        """A packed step over the last ``query_lens[i]`` tokens of each cached sequence ``seq_ids[i]``
        (already appended; 0 allowed), their K/V written to their slots and attending with
        ``query_start_loc``: any mix of prompts, chunks, speculative tokens and decodes. Changes nothing.
        ``block_table_width`` and ``on_host`` as in :meth:`decode_metadata`."""
        seq_ids = self._check_seq_ids(seq_ids)
        self._check_all_known(seq_ids)
        lens = self._check_counts(seq_ids, query_lens, "step_metadata", "query_lens", 0)
        held = list(map(self._seq_lens.__getitem__, seq_ids))
        if any(map(operator.gt, lens, held)):
            for seq_id, q_len, seq_len in zip(seq_ids, lens, held, strict=True):
                if q_len > seq_len:
                    raise ValueError(f"PagedKVCache.step_metadata: query_lens: expected at most seq_len = "
                                     f"{seq_len} tokens for seq_id {seq_id} (the tokens it holds: "
                                     f"append_slots first), got {q_len}")
        width = self._check_width(seq_ids, block_table_width, "step_metadata", grows=set())
        block_tables = _block_tables([self._seq_blocks[seq_id] for seq_id in seq_ids], width)
        seq_lens = torch.tensor(held)  # [num_seqs]
        if all(q_len == 1 for q_len in lens):
            # A step of decodes: each sequence's last token, its slot looked up directly (a handful of
            # sequences a step, where the packed arithmetic below is a few dozen small tensor ops).
            return self._metadata(self._last_slots(seq_ids), block_tables, seq_lens,
                                  torch.ones(len(seq_ids), dtype=torch.int64),
                                  torch.arange(len(seq_ids) + 1), on_host)
        q_lens = torch.tensor(lens, dtype=torch.int64)  # [num_seqs]
        query_start_loc = torch.zeros(len(seq_ids) + 1, dtype=torch.int64)
        query_start_loc[1:] = q_lens.cumsum(0)
        flat, counts = self._flat_blocks(seq_ids)  # [total_blocks], [num_seqs]
        seq = _segment_ids(q_lens)  # [num_tokens]: each token's sequence
        # Each token's cache position: the last q_len of its sequence's tokens, in order.
        positions = _segment_positions(seq_lens - q_lens, q_lens, seq)
        # Gathers by index_select, which runs on one thread: indexing by a tensor splits more than 3000
        # indices over the intra-op pool (as _segment_ids says of the pool).
        first_block = counts.cumsum(0) - counts  # [num_seqs]: where each sequence's blocks start in flat
        block_index = first_block.index_select(0, seq) + torch.div(positions, self.block_size,
                                                                   rounding_mode="floor")
        blocks = flat.long().index_select(0, block_index)  # [num_tokens]
        slot_mapping = blocks * self.block_size + positions % self.block_size  # [num_tokens]
        return self._metadata(slot_mapping, block_tables, seq_lens, q_lens, query_start_loc, on_host)

    def prefill_metadata(self, seq_ids: Sequence[int], prompt_lens: Sequence[int], *,
                         token_ids: Sequence[Sequence[int]] | None = None) -> AttentionMetadata:
        """Start new sequences and map their whole prompts for one packed step (:meth:`add_sequence`,
        :meth:`append_slots` and :meth:`step_metadata` at once, all or nothing); ``token_ids`` as in
        :meth:`append_slots`. Nothing is taken from the prefix cache: every prompt token runs."""
        seq_ids = self._check_seq_ids(seq_ids)
        for seq_id in seq_ids:
            self._check_new(seq_id, "prefill_metadata")
        lens = self._check_counts(seq_ids, prompt_lens, "prefill_metadata", "prompt_lens", 1)
        tokens = self._check_token_ids(seq_ids, lens, token_ids, "prefill_metadata")
        self._check_available(sum(-(-n // self.block_size) for n in lens), "prefill")
        for seq_id, length, ids in zip(seq_ids, lens, tokens, strict=True):
            self.add_sequence(seq_id)
            self._append(seq_id, length, ids)
        return self.step_metadata(seq_ids, lens)

    def decode_metadata(self, seq_ids: Sequence[int], append: bool = True, *,
                        block_table_width: int | None = None, on_host: bool = False) -> AttentionMetadata:
        """One decode step of cached sequences.

        ``append=True`` (self-attention): one new token per sequence, its slot allocated (a new block when
        the last one is full, or a copy of it when it is shared). ``append=False`` (cross-attention over
        stored encoder K/V): attend to what is cached; nothing is allocated or written (``slot_mapping`` is
        all -1). ``block_table_width``: the block tables' columns, at least the most blocks a sequence holds
        after this step (default: that many); a fixed width keeps the step's shapes fixed while sequences
        grow (a CUDA graph's, and the attention kernel's split-K plan, which follows the width).
        ``on_host``: the metadata's tensors stay on the host, for a caller that copies them to the device
        together with others (one copy a step: :func:`~tpkit.attention.copy_to_device`).
        """
        seq_ids = self._check_seq_ids(seq_ids)
        self._check_all_known(seq_ids)
        growing = {seq_id for seq_id in seq_ids if append and self._seq_lens[seq_id] % self.block_size == 0}
        width = self._check_width(seq_ids, block_table_width, "decode_metadata", grows=growing)
        self._check_available(sum(self._append_cost(seq_id, 1) for seq_id in seq_ids) if append else 0,
                              "decode")
        if append:
            for seq_id in seq_ids:
                self._append(seq_id, 1, None)
            slot_mapping = self._last_slots(seq_ids)  # [num_seqs]
        else:
            slot_mapping = torch.full((len(seq_ids),), -1, dtype=torch.int64)  # [num_seqs]
        seq_lens = torch.tensor([self._seq_lens[seq_id] for seq_id in seq_ids])
        block_tables = _block_tables([self._seq_blocks[seq_id] for seq_id in seq_ids], width)
        return self._metadata(slot_mapping, block_tables, seq_lens,
                              torch.ones(len(seq_ids), dtype=torch.int64), None, on_host)

    def fork(self, seq_id: int, new_seq_id: int, num_tokens: int | None = None) -> None:
        """Start ``new_seq_id`` as the first ``num_tokens`` (default: all) of ``seq_id``'s tokens, sharing
        their blocks (a partly used last block too: whichever sequence writes into it first gets a copy)."""
        self._check_known(seq_id)
        self._check_new(new_seq_id, "fork", "new_seq_id")
        length = self._seq_lens[seq_id]
        count = length if num_tokens is None else _as_count(num_tokens, "fork: num_tokens", seq_id, 0)
        if count > length:
            raise ValueError(f"PagedKVCache.fork: num_tokens: expected at most seq_len = {length} of seq_id "
                             f"{seq_id}, got {count}")
        blocks = self._seq_blocks[seq_id][:-(-count // self.block_size)]
        for block in blocks:
            self._pool.hold(block)
        self._seq_blocks[new_seq_id] = blocks
        self._seq_lens[new_seq_id] = count
        self._seq_tokens[new_seq_id] = self._seq_tokens[seq_id][:count]
        self._seq_hashes[new_seq_id] = self._seq_hashes[seq_id][:count // self.block_size]

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Drop the last ``num_tokens`` tokens of ``seq_id`` (rejected speculative tokens); blocks it no
        longer uses are released. A block it keeps is not written here: the next write into it copies it
        first where it is shared (copy-on-write)."""
        self._check_known(seq_id)
        length = self._seq_lens[seq_id]
        count = _as_count(num_tokens, "truncate: num_tokens", seq_id, 0)
        if count > length:
            raise ValueError(f"PagedKVCache.truncate: num_tokens: expected at most seq_len = {length} of "
                             f"seq_id {seq_id}, got {count}")
        kept = length - count
        blocks = self._seq_blocks[seq_id]
        num_kept = -(-kept // self.block_size)
        self._pool.release(blocks[num_kept:][::-1])
        del blocks[num_kept:]
        self._seq_lens[seq_id] = kept
        del self._seq_tokens[seq_id][kept:]
        del self._seq_hashes[seq_id][kept // self.block_size:]

    def free(self, seq_id: int) -> None:
        """Let a sequence's blocks go: those the prefix cache knows stay cached, the others are free."""
        self._check_known(seq_id)
        # Last blocks first: the prefix cache then evicts a prompt's tail before its head.
        self._pool.release(self._seq_blocks.pop(seq_id)[::-1])
        for state in (self._seq_lens, self._seq_tokens, self._seq_hashes):
            del state[seq_id]

    # Internals -------------------------------------------------------------------------------------------
    def _append_cost(self, seq_id: int, num_tokens: int) -> int:
        """Blocks appending ``num_tokens`` to ``seq_id`` allocates: those its tokens reach past its last
        block, and a copy of that last block when the first token goes into it while it is shared."""
        length, blocks = self._seq_lens[seq_id], self._seq_blocks[seq_id]
        grow = -(-(length + num_tokens) // self.block_size) - len(blocks)
        return grow + int(num_tokens > 0 and length % self.block_size != 0
                          and self._pool.ref_count(blocks[-1]) > 1)

    def _append(self, seq_id: int, num_tokens: int, token_ids: list[int] | None) -> None:
        """Appends checked tokens (the blocks are there: see :meth:`_append_cost`)."""
        length, blocks = self._seq_lens[seq_id], self._seq_blocks[seq_id]
        if num_tokens and length % self.block_size:
            # The first token goes into the last block: it must be this sequence's alone, and hold no
            # longer the tokens the prefix cache knows it by.
            last = blocks[-1]
            if self._pool.ref_count(last) > 1:
                blocks[-1] = self._copy_block(last)
                self._pool.release([last])
            elif self._pool.is_registered(last):
                self._pool.unregister(last)
        end = length + num_tokens
        grow = -(-end // self.block_size) - len(blocks)
        if grow:
            blocks.extend(self._pool.allocate(grow))
        self._seq_lens[seq_id] = end
        if token_ids is not None:
            self._record_ids(seq_id, length, token_ids)
        if len(self._seq_tokens[seq_id]) > length:
            self._register_blocks(seq_id)

    def _record_ids(self, seq_id: int, start: int, token_ids: list[int]) -> None:
        """Records the ids of tokens ``start ..`` of ``seq_id`` where the ids of every token before them are
        known (else the chain ended earlier)."""
        known = self._seq_tokens[seq_id]
        if len(known) == start:
            known += token_ids

    def _register_blocks(self, seq_id: int) -> None:
        """Registers in the prefix cache the blocks of ``seq_id`` that are full, both of slots and of known
        token ids, and not yet registered."""
        known, length = self._seq_tokens[seq_id], self._seq_lens[seq_id]
        hashes, blocks = self._seq_hashes[seq_id], self._seq_blocks[seq_id]
        for index in range(len(hashes), min(len(known), length) // self.block_size):
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.append(block_hash(parent, known[index * self.block_size:(index + 1) * self.block_size]))
            self._pool.register(blocks[index], hashes[-1])

    def _copy_block(self, block: int) -> int:
        """A new block holding ``block``'s K/V in every layer (queued on the device, no sync)."""
        (copy,) = self._pool.allocate(1)
        for cache in self.key_caches + self.value_caches:
            cache[copy].copy_(cache[block])
        return copy

    def _check_seq_ids(self, seq_ids: Sequence[int]) -> list[int]:
        seq_ids = list(seq_ids)
        if not seq_ids:
            raise ValueError("PagedKVCache: seq_ids: expected at least one sequence, got none")
        if not set(map(type, seq_ids)) <= {int}:
            bad = [seq_id for seq_id in seq_ids if isinstance(seq_id, bool) or not isinstance(seq_id, int)]
            if bad:
                raise TypeError(f"PagedKVCache: seq_ids: expected ints, got {bad[0]!r}")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"PagedKVCache: seq_ids: expected distinct ids, got {seq_ids}")
        return seq_ids

    def _check_known(self, seq_id: int) -> None:
        if seq_id not in self._seq_blocks:
            raise ValueError(f"PagedKVCache: seq_id: expected a cached sequence (one of "
                             f"{sorted(self._seq_blocks)}), got {seq_id!r}")

    def _check_all_known(self, seq_ids: list[int]) -> None:
        if not self._seq_blocks.keys() >= set(seq_ids):
            for seq_id in seq_ids:
                self._check_known(seq_id)

    def _check_new(self, seq_id: int, where: str, name: str = "seq_ids") -> None:
        if seq_id in self._seq_blocks:
            raise ValueError(f"PagedKVCache.{where}: {name}: expected new sequences, got {seq_id}, which is "
                             f"already cached (free it first)")

    def _check_counts(self, seq_ids: list[int], counts: Sequence[int], method: str, name: str,
                      minimum: int) -> list[int]:
        if len(counts) != len(seq_ids):
            raise ValueError(f"PagedKVCache.{method}: {name}: expected {len(seq_ids)} lengths (one per "
                             f"seq_id), got {len(counts)}")
        plain = _plain_ints(counts, minimum)
        if plain is not None:
            return plain
        return [_as_count(count, f"{method}: {name}", seq_id, minimum)
                for seq_id, count in zip(seq_ids, counts, strict=True)]

    def _check_token_ids(self, seq_ids: list[int], counts: list[int],
                         token_ids: Sequence[Sequence[int]] | None, where: str) -> list[list[int] | None]:
        if token_ids is None:
            return [None] * len(seq_ids)
        if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
            raise TypeError(f"PagedKVCache.{where}: token_ids: expected one list of token ids per seq_id, "
                            f"got {type(token_ids).__name__}")
        if len(token_ids) != len(seq_ids):
            raise ValueError(f"PagedKVCache.{where}: token_ids: expected {len(seq_ids)} lists (one per "
                             f"seq_id), got {len(token_ids)}")
        lists = list(token_ids)
        if all(type(ids) is list for ids in lists) and list(map(len, lists)) == counts \
                and _plain_ints(list(itertools.chain.from_iterable(lists)), 0) is not None:
            return lists
        return [_as_token_ids(ids, where, seq_id, count)
                for seq_id, count, ids in zip(seq_ids, counts, token_ids, strict=True)]

    def _check_width(self, seq_ids: list[int], width: int | None, where: str, grows: set[int]) -> int:
        needed = max(len(self._seq_blocks[seq_id]) + (seq_id in grows) for seq_id in seq_ids)
        if width is None:
            return needed
        if isinstance(width, bool) or not isinstance(width, int) or width < needed:
            raise ValueError(f"PagedKVCache.{where}: block_table_width: expected None or an int >= {needed} "
                             f"(the most blocks a sequence holds after this step), got {width!r}")
        return width

    def _check_available(self, needed: int, step: str) -> None:
        if needed > self._pool.num_available:
            raise RuntimeError(f"PagedKVCache: out of KV blocks: this {step} step needs {needed} blocks, "
                               f"{self._pool.num_available} of {self.num_blocks} are free (free finished "
                               f"sequences, or give the cache more memory)")

    def _last_slots(self, seq_ids: list[int]) -> torch.Tensor:
        """int64 ``[num_seqs]``: the slot of each sequence's last token (every sequence holds one)."""
        slots = []
        for seq_id in seq_ids:
            position = self._seq_lens[seq_id] - 1
            slots.append(self._seq_blocks[seq_id][position // self.block_size] * self.block_size
                         + position % self.block_size)
        return torch.tensor(slots, dtype=torch.int64)

    def _flat_blocks(self, seq_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The blocks of the sequences one after another, and how many each holds."""
        held = [self._seq_blocks[seq_id] for seq_id in seq_ids]
        flat = bytearray().join(held)
        flat_blocks = torch.frombuffer(flat, dtype=torch.int32) if flat else torch.zeros(0, dtype=torch.int32)
        counts = host_longs(map(len, held))
        return flat_blocks, counts  # [total_blocks], [num_seqs]

    def _metadata(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                  query_lens: torch.Tensor, query_start_loc: torch.Tensor | None,
                  on_host: bool) -> AttentionMetadata:
        host = [slot_mapping.long(), block_tables, seq_lens.int(), query_lens.int()]
        if query_start_loc is not None:
            host.append(query_start_loc.int())
        tensors = host if on_host else copy_to_device(host, self.device)
        return AttentionMetadata(*tensors[:4], query_start_loc=tensors[4] if len(tensors) > 4 else None)
