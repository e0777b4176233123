"""The host tensors of a step's metadata: block tables built from the blocks sequences hold, and their one
packed copy to the device."""

from __future__ import annotations

import array
from collections.abc import Iterable, Sequence

import torch


def host_longs(values: Iterable[int]) -> torch.Tensor:
    """The values as an int64 tensor on the host, sharing the memory of the array they fill in C: a tensor
    built from a list of Python ints converts them one by one, milliseconds of host time at the thousands
    of positions of a prefill step."""
    longs = array.array("q", values)
    return torch.frombuffer(longs, dtype=torch.int64) if longs else torch.zeros(0, dtype=torch.int64)


def _segment_ids(counts: torch.Tensor) -> torch.Tensor:
    """``i`` repeated ``counts[i]`` times, int64 ``[sum(counts)]``: which segment each element of segments of
    those lengths, laid end to end, belongs to. The running count of the segments that end at or before each
    element, by ops that run on one thread below tens of thousands of elements: ``torch.repeat_interleave``
    and ``torch.searchsorted`` split a few hundred elements over the whole intra-op pool, whose wake-up can
    stall the host for milliseconds (tens of them where the process has fewer cores than threads)."""
    ends = counts.cumsum(0)  # [num_segments]
    total = int(ends[-1]) if ends.numel() else 0
    ended = torch.zeros(total + 1, dtype=torch.int64)  # [total + 1]: segments ending at each element
    ended.index_add_(0, ends, torch.ones_like(ends))
    return ended[:total].cumsum(0)


def token_positions(starts: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """int64 ``[sum(counts)]``: ``starts[i], starts[i] + 1, ...`` (``counts[i]`` of them) for each segment,
    laid end to end; a step's chunks of tokens, each starting at its sequence's ``starts[i]``: every token's
    position. A handful of tensor ops on one thread whatever the number of segments, where building the
    values one range at a time in Python costs hundreds of microseconds at a prefill's thousands of tokens
    (and one ``arange`` a segment, as much at a step of hundreds of decodes). ``starts`` and ``counts``: int64
    ``[num_segments]`` on the host, counts at least 0."""
    for name, tensor in (("starts", starts), ("counts", counts)):
        if tensor.dtype != torch.int64 or tensor.dim() != 1 or tensor.device.type != "cpu":
            raise ValueError(f"token_positions: {name}: expected a 1-D int64 CPU tensor, got "
                             f"{tensor.dtype} of shape {tuple(tensor.shape)} on {tensor.device}")
    if starts.shape != counts.shape:
        raise ValueError(f"token_positions: counts: expected one per start ({starts.shape[0]}), got "
                         f"{counts.shape[0]}")
    if counts.numel() and int(counts.min()) < 0:
        raise ValueError(f"token_positions: counts: expected counts >= 0, got {int(counts.min())}")
    return _segment_positions(starts, counts, _segment_ids(counts))


def chunk_positions(chunks: Iterable[tuple[int, int, Sequence[int]]]) -> torch.Tensor:
    """int64 ``[num_tokens]`` on the host: the position of every token of a step's chunks ``(seq_id, start,
    token_ids)`` (the tokens at positions ``start ..`` of their sequence), laid end to end
    (:func:`token_positions`)."""
    chunks = list(chunks)
    return token_positions(host_longs(start for _, start, _ in chunks),
                           host_longs(len(ids) for _, _, ids in chunks))


def _segment_positions(starts: torch.Tensor, counts: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
    """:func:`token_positions` of checked inputs, given their :func:`_segment_ids` ``seq``."""
    shifts = starts - (counts.cumsum(0) - counts)  # [num_segments]: a segment's start less its first index
    return torch.arange(seq.shape[0]) + shifts.index_select(0, seq)


def _block_tables(blocks: Sequence[array.array], width: int) -> torch.Tensor:
    """int32 ``[num_seqs, width]``: row ``i`` the blocks of sequence ``i`` (``blocks[i]``, C ints), then zeros
    up to ``width`` columns. Entries past a sequence's blocks are never read; 0 keeps them in range. The
    rows' bytes are joined and viewed as one tensor: no tensor op a row or a step, each of which would cost
    the host microseconds."""
    zeros = memoryview(bytes(4 * width))
    pieces = []
    for row in blocks:
        pieces += (row, zeros[:4 * (width - len(row))])
    table = bytearray().join(pieces)
    if not table:
        return torch.zeros(len(blocks), width, dtype=torch.int32)
    return torch.frombuffer(table, dtype=torch.int32).view(len(blocks), width)


def copy_to_device(host: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """The host tensors on ``device``: on a GPU by one copy of them packed together, from pinned memory.

    One copy a step instead of one a tensor: each copy is a few microseconds of an idle GPU between decode
    steps. From pinned memory the copy is queued behind the work already there, so building the next step's
    metadata overlaps the current step (from pageable memory the host would wait for the GPU's queue)."""
    if device.type != "cuda":
        return [tensor.to(device) for tensor in host]
    return _copy_packed(host, device)


def _copy_packed(host: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """:func:`copy_to_device` by one packed copy, on any device."""
    packed = torch.empty(packed_size(host), dtype=torch.uint8, pin_memory=device.type == "cuda")
    for view, tensor in zip(packed_views(packed, host), host, strict=True):
        view.copy_(tensor)
    return packed_views(packed.to(device, non_blocking=True), host)


def packed_size(like: Sequence[torch.Tensor]) -> int:
    """Bytes of a buffer that holds tensors of the shapes and dtypes of ``like`` one after another, each
    aligned to its element size (:func:`packed_views`)."""
    return _offsets(like)[1]


def packed_views(packed: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of the bytes ``packed`` (uint8, :func:`packed_size` of them) with the dtypes and shapes of
    ``like``, one after another: tensors that move between host and device in one copy of ``packed``."""
    offsets, _ = _offsets(like)
    return [packed[offset: offset + tensor.numel() * tensor.element_size()].view(tensor.dtype)
            .view(tensor.shape) for tensor, offset in zip(like, offsets, strict=True)]


def _offsets(like: Sequence[torch.Tensor]) -> tuple[list[int], int]:
    offsets, end = [], 0
    for tensor in like:
        end += -end % tensor.element_size()  # each view starts aligned to its element size
        offsets.append(end)
        end += tensor.numel() * tensor.element_size()
    return offsets, end
