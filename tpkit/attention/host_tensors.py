"""The host tensors of a step's metadata: block tables built from the blocks sequences hold, and their one
packed copy to the device."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _block_tables(flat: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
    """Row ``i``: the ``counts[i]`` blocks of sequence ``i`` (taken in order from ``flat``), then zeros up to
    ``width`` columns. Entries past a sequence's blocks are never read; 0 keeps them in range."""
    tables = torch.zeros(counts.shape[0], width, dtype=torch.int32)  # [num_seqs, width]
    # Block j of sequence i, at flat[first[i] + j], goes to column j of row i.
    first = counts.cumsum(0) - counts  # [num_seqs]
    row_start = torch.arange(counts.shape[0]) * width - first  # [num_seqs]
    index = torch.arange(flat.shape[0]) + torch.repeat_interleave(row_start, counts)  # [total_blocks]
    tables.view(-1)[index] = flat
    return tables


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
