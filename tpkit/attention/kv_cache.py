"""Paged KV cache: per-layer key/value caches and the block allocator that hands out their blocks."""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tpkit._memory import available_bytes

logger = logging.getLogger("tpkit.attention")


@dataclass
class AttentionMetadata:
    """Where one forward step of a batch of sequences reads and writes the paged cache.

    ``slot_mapping`` has one entry per token of the (right-padded) batch, row-major over
    ``[num_seqs, q_len]``: the cache slot (``block * block_size + offset``) its K/V is written to, -1 for
    padding and for steps that write nothing. ``query_lens`` counts each sequence's query tokens this step:
    the prompt lengths at prefill, 1 at decode.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor  # int64 [num_seqs * q_len]
    block_tables: torch.Tensor  # int32 [num_seqs, max_blocks_per_seq]
    seq_lens: torch.Tensor  # int32 [num_seqs]: tokens in the cache after this step
    query_lens: torch.Tensor  # int32 [num_seqs]


def _check_config(dtype: object, **sizes: object) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"PagedKVCache: {name}: expected an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"PagedKVCache: {name}: expected a positive int, got {value}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"PagedKVCache: dtype: expected a floating-point torch.dtype, got {dtype!r}")


def _as_prompt_len(prompt_len: object, seq_id: int) -> int:
    error = ValueError(f"PagedKVCache.prefill_metadata: prompt_lens: expected positive ints, got "
                       f"{prompt_len!r} for seq_id {seq_id}")
    if isinstance(prompt_len, bool):
        raise error
    try:
        # Takes Python, NumPy and 0-d tensor integers alike, and refuses floats.
        length = operator.index(prompt_len)
    except TypeError:
        raise error from None
    if length < 1:
        raise error
    return length


def _bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_size: int,
                     dtype: torch.dtype) -> int:
    # Keys and values, every layer.
    return 2 * num_layers * block_size * num_kv_heads * head_size * dtype.itemsize


class PagedKVCache:
    """Per-layer key and value caches of one rank's KV heads, with a block allocator.

    Each cache is ``[num_blocks, block_size, num_kv_heads, head_size]``. A sequence (named by an int
    ``seq_id``) owns a list of blocks, allocated as it grows and shared by every layer; its block table
    maps its logical blocks to those physical blocks. Allocation fails with a RuntimeError, before any
    state changes, when not enough blocks are free.
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
        # Popped from the end: the lowest block ids go first, which keeps a fresh cache's tables readable.
        self._free_blocks: list[int] = list(range(num_blocks - 1, -1, -1))
        self._seq_blocks: dict[int, list[int]] = {}
        self._seq_lens: dict[int, int] = {}

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
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    def seq_len(self, seq_id: int) -> int:
        """Tokens of ``seq_id`` in the cache."""
        self._check_known(seq_id)
        return self._seq_lens[seq_id]

    def prefill_metadata(self, seq_ids: Sequence[int], prompt_lens: Sequence[int]) -> AttentionMetadata:
        """Allocate blocks for new sequences and map their prompts, right-padded to ``max(prompt_lens)``."""
        seq_ids = self._check_seq_ids(seq_ids)
        if len(prompt_lens) != len(seq_ids):
            raise ValueError(f"PagedKVCache.prefill_metadata: prompt_lens: expected {len(seq_ids)} lengths "
                             f"(one per seq_id), got {len(prompt_lens)}")
        lengths = []
        for seq_id, prompt_len in zip(seq_ids, prompt_lens, strict=True):
            if seq_id in self._seq_blocks:
                raise ValueError(f"PagedKVCache.prefill_metadata: seq_ids: expected new sequences, got "
                                 f"{seq_id}, which is already cached (free it first)")
            lengths.append(_as_prompt_len(prompt_len, seq_id))
        prompt_lens = lengths
        needed = [-(-prompt_len // self.block_size) for prompt_len in prompt_lens]
        self._check_available(sum(needed), "prefill")
        for seq_id, prompt_len, num in zip(seq_ids, prompt_lens, needed, strict=True):
            self._seq_blocks[seq_id] = [self._free_blocks.pop() for _ in range(num)]
            self._seq_lens[seq_id] = prompt_len

        block_tables = self._block_tables(seq_ids)  # [num_seqs, max_blocks_per_seq]
        lens = torch.tensor(prompt_lens, dtype=torch.int64)  # [num_seqs]
        positions = torch.arange(max(prompt_lens))  # [padded_len]
        blocks = block_tables.long()[:, positions // self.block_size]  # [num_seqs, padded_len]
        slots = blocks * self.block_size + positions % self.block_size
        slot_mapping = torch.where(positions[None, :] < lens[:, None], slots, -1)
        return self._metadata(True, slot_mapping.flatten(), block_tables, prompt_lens, prompt_lens)

    def decode_metadata(self, seq_ids: Sequence[int], append: bool = True, *,
                        block_table_width: int | None = None) -> AttentionMetadata:
        """One decode step of cached sequences.

        ``append=True`` (self-attention): one new token per sequence, its slot allocated (a new block when
        the last one is full). ``append=False`` (cross-attention over stored encoder K/V): attend to what
        is cached; nothing is allocated or written (``slot_mapping`` is all -1). ``block_table_width``:
        the block tables' columns, at least the most blocks a sequence holds after this step (default: that
        many); a fixed width keeps the step's shapes fixed while sequences grow (a CUDA graph's, and the
        attention kernel's split-K plan, which follows the width).
        """
        seq_ids = self._check_seq_ids(seq_ids)
        for seq_id in seq_ids:
            self._check_known(seq_id)
        growing = [seq_id for seq_id in seq_ids if append and self._seq_lens[seq_id] % self.block_size == 0]
        self._check_available(len(growing), "decode")
        needed_width = max(len(self._seq_blocks[seq_id]) + (seq_id in growing) for seq_id in seq_ids)
        if block_table_width is not None and (isinstance(block_table_width, bool)
                                              or not isinstance(block_table_width, int)
                                              or block_table_width < needed_width):
            raise ValueError(f"PagedKVCache.decode_metadata: block_table_width: expected None or an int >= "
                             f"{needed_width} (the most blocks a sequence holds after this step), got "
                             f"{block_table_width!r}")
        if append:
            for seq_id in growing:
                self._seq_blocks[seq_id].append(self._free_blocks.pop())
            slots = []
            for seq_id in seq_ids:
                position = self._seq_lens[seq_id]
                block = self._seq_blocks[seq_id][position // self.block_size]
                slots.append(block * self.block_size + position % self.block_size)
                self._seq_lens[seq_id] = position + 1
            slot_mapping = torch.tensor(slots, dtype=torch.int64)  # [num_seqs]
        else:
            slot_mapping = torch.full((len(seq_ids),), -1, dtype=torch.int64)  # [num_seqs]
        seq_lens = [self._seq_lens[seq_id] for seq_id in seq_ids]
        block_tables = self._block_tables(seq_ids, block_table_width or needed_width)
        return self._metadata(False, slot_mapping, block_tables, seq_lens, [1] * len(seq_ids))

    def free(self, seq_id: int) -> None:
        """Return a sequence's blocks to the allocator."""
        self._check_known(seq_id)
        self._free_blocks.extend(reversed(self._seq_blocks.pop(seq_id)))
        del self._seq_lens[seq_id]

    def _check_seq_ids(self, seq_ids: Sequence[int]) -> list[int]:
        seq_ids = list(seq_ids)
        if not seq_ids:
            raise ValueError("PagedKVCache: seq_ids: expected at least one sequence, got none")
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

    def _check_available(self, needed: int, step: str) -> None:
        if needed > len(self._free_blocks):
            raise RuntimeError(f"PagedKVCache: out of KV blocks: this {step} step needs {needed} blocks, "
                               f"{len(self._free_blocks)} of {self.num_blocks} are free (free finished "
                               f"sequences, or give the cache more memory)")

    def _block_tables(self, seq_ids: list[int], width: int | None = None) -> torch.Tensor:
        width = width or max(len(self._seq_blocks[seq_id]) for seq_id in seq_ids)
        # Entries past a sequence's blocks are never read; 0 keeps them in range.
        rows = [blocks + [0] * (width - len(blocks)) for blocks in (self._seq_blocks[i] for i in seq_ids)]
        return torch.tensor(rows, dtype=torch.int32)  # [num_seqs, width]

    def _metadata(self, is_prefill: bool, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: Sequence[int], query_lens: Sequence[int]) -> AttentionMetadata:
        slot_mapping, block_tables, seq_lens, query_lens = self._to_device(
            slot_mapping, block_tables, torch.tensor(seq_lens, dtype=torch.int32),
            torch.tensor(query_lens, dtype=torch.int32))
        return AttentionMetadata(is_prefill=is_prefill, slot_mapping=slot_mapping, block_tables=block_tables,
                                 seq_lens=seq_lens, query_lens=query_lens)

    def _to_device(self, *host: torch.Tensor) -> list[torch.Tensor]:
        if self.device.type != "cuda":
            return [tensor.to(self.device) for tensor in host]
        return _copy_packed(host, self.device)


def _copy_packed(host: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The host tensors on ``device`` by one copy of them packed together (from pinned memory on a GPU).

    One copy a step instead of one a tensor: each copy is a few microseconds of an idle GPU between decode
    steps. From pinned memory the copy is queued behind the work already there, so building the next step's
    metadata overlaps the current step (from pageable memory the host would wait for the GPU's queue)."""
    offsets, end = [], 0
    for tensor in host:
        end += -end % tensor.element_size()  # each view starts aligned to its element size
        offsets.append(end)
        end += tensor.numel() * tensor.element_size()
    packed = torch.empty(end, dtype=torch.uint8, pin_memory=device.type == "cuda")
    for view, tensor in zip(_views(packed, host, offsets), host, strict=True):
        view.copy_(tensor)
    return _views(packed.to(device, non_blocking=True), host, offsets)


def _views(packed: torch.Tensor, like: Sequence[torch.Tensor], offsets: Sequence[int]) -> list[torch.Tensor]:
    """Views of the bytes ``packed`` at ``offsets`` with the dtypes and shapes of ``like``."""
    return [packed[offset: offset + tensor.numel() * tensor.element_size()].view(tensor.dtype)
            .view(tensor.shape) for tensor, offset in zip(like, offsets, strict=True)]
