"""Copies from host memory into a GPU through page-locked buffers, for the parts no direct copy takes.

A plain ``copy_`` from pageable host memory (a view of a file map) into a GPU goes through the CUDA driver's
own staging, one synchronous copy at a time. Instead, each copying thread fills page-locked buffers itself (a
CPU memcpy, which is also where the file's pages are faulted in) while the GPU's copy engine reads the buffer
filled before. ``TPKIT_LOAD_PINNED=0`` in the environment turns this off.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Sequence

import torch

from tpkit._env import env_flag

# (indices into the leading dimensions, start, length): the chunk ``tensor[index].narrow(0, start, length)``
Chunk = tuple[tuple[int, ...], int, int]

# Smaller tensors (norms, biases) go straight through copy_: a chunk costs a few calls and an event, which
# such a copy would not win back.
_STAGING_MIN_BYTES = 2**20
# Each of the two buffers of a copying thread, and so the largest chunk. Page-locking is slow and most
# processes load once, so the size trades that first cost against the fixed cost of each chunk (calls and an
# event); chunks smaller than the buffers allow only add that fixed cost. The buffers stay page-locked: 2 a
# thread. A power of two, as the caching host allocator rounds up to.
_STAGING_BUFFER_BYTES = 8 * 2**20


class _StagingBuffers(threading.local):
    """This thread's two page-locked buffers, made on its first staged copy; () where pinning failed."""

    pair: tuple[torch.Tensor, ...] | None = None


_STAGING = _StagingBuffers()


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """``dst.copy_(src)`` (same shape, cast to dst's dtype) through this thread's page-locked buffers, where
    that is faster: from host memory into a GPU, at least ``_STAGING_MIN_BYTES``, unless
    ``TPKIT_LOAD_PINNED=0``. Returns True once ``dst`` holds the values, as copy_ from pageable memory does,
    so a caller may drop ``src`` (and unmap its file) at once; False, having written nothing, where staging
    does not apply (the caller then copies ``src`` itself).
    """
    if not _worth_staging(dst, src):
        return False
    buffers = _staging_buffers()
    if not buffers:
        return False
    _staged_copy(dst, src, buffers)
    return True


def _staging_enabled() -> bool:
    """False where the environment sets ``TPKIT_LOAD_PINNED`` to 0 (or false, no, off)."""
    return env_flag("TPKIT_LOAD_PINNED", True)


def _worth_staging(dst: torch.Tensor, src: torch.Tensor) -> bool:
    return (dst.device.type == "cuda" and src.device.type == "cpu" and dst.shape == src.shape
            and dst.layout == src.layout == torch.strided and not src.is_quantized
            and src.numel() * src.element_size() >= _STAGING_MIN_BYTES and _staging_enabled()
            # A page-locked source is copied by DMA straight away: staging would only add a memcpy.
            and not src.is_pinned())


def _staging_buffers() -> tuple[torch.Tensor, ...]:
    """This thread's two buffers ([_STAGING_BUFFER_BYTES] uint8, page-locked each), made on first use."""
    if _STAGING.pair is None:
        try:
            # From the CUDA caching host allocator, not page-locked here (cudaHostRegister): load_weights
            # starts new threads on every call, and a thread's buffers die with it. Given back to that
            # allocator they stay page-locked, and the next call's threads get them back at once, where
            # page-locking anew costs milliseconds a buffer (under a driver-wide lock). The price: the
            # process keeps them page-locked after loading (the allocator's cache), 2 buffers a thread.
            # Outside inference mode: an inference tensor could not be written later outside it.
            with torch.inference_mode(False):
                _STAGING.pair = tuple(torch.empty(_STAGING_BUFFER_BYTES, dtype=torch.uint8, pin_memory=True)
                                      for _ in range(2))
        except RuntimeError as error:  # no page-locked memory to be had: copy as without buffers
            warnings.warn(f"tpkit: no page-locked staging buffers for loading ({error}); copying from "
                          "pageable memory instead", RuntimeWarning, stacklevel=3)
            _STAGING.pair = ()
    return _STAGING.pair


def _staged_copy(dst: torch.Tensor, src: torch.Tensor, buffers: Sequence[torch.Tensor]) -> None:
    """Copies ``src`` into ``dst`` (same shape) chunk by chunk, each through the next of ``buffers`` (flat
    uint8, equal sizes) in turn.

    A chunk is gathered into a buffer on the CPU, contiguous in src's dtype; then copied into its part of dst
    without waiting, on dst's current stream (a cast or a strided part of dst takes a one-chunk temporary on
    the GPU: copy_ with non_blocking casts there), and meanwhile the next chunk fills the other buffer. A
    buffer is refilled only once its previous copy has finished, and the call returns once the last one has;
    what the caller queues later on that stream comes after the copies anyway. With dst on the CPU every
    copy is synchronous, which is how the chunking is tested without a GPU.
    """
    if src.dim() == 0:
        dst, src = dst.unsqueeze(0), src.unsqueeze(0)
    itemsize = src.element_size()
    chunk_bytes = min(buffer.numel() for buffer in buffers)
    stream = torch.cuda.current_stream(dst.device) if dst.device.type == "cuda" else None
    copied: list[torch.cuda.Event | None] = [None] * len(buffers)  # each buffer's last copy to dst
    try:
        for i, (index, start, length) in enumerate(_plan_chunks(src.shape, itemsize, chunk_bytes)):
            slot = i % len(buffers)
            if copied[slot] is not None:
                copied[slot].synchronize()  # the buffer's previous chunk has left it
            src_chunk = src[index].narrow(0, start, length)  # [length, *src.shape[len(index) + 1:]]
            staged = buffers[slot][:src_chunk.numel() * itemsize].view(src.dtype).view(src_chunk.shape)
            staged.copy_(src_chunk)
            dst[index].narrow(0, start, length).copy_(staged, non_blocking=True)
            if stream is not None:
                copied[slot] = stream.record_event()
    finally:
        # Also after a failure: no copy may still be reading a buffer that the next call refills.
        for event in copied:
            if event is not None:
                event.synchronize()


def _plan_chunks(shape: Sequence[int], itemsize: int, chunk_bytes: int) -> list[Chunk]:
    """Cuts a tensor of ``shape`` (at least one dimension) into chunks of whole rows (along dim 0), each
    of at most ``chunk_bytes`` (but at least one row); where one row holds more, each row is cut so along its
    own first dimension, and so on (a 1-D tensor's rows are its elements).

    The chunks cover every element once, in the order of a contiguous tensor's memory.
    """
    if not shape:
        raise ValueError("_plan_chunks: a 0-d tensor has no rows")
    if math.prod(shape) == 0:
        return []
    rows, row_bytes = shape[0], math.prod(shape[1:]) * itemsize
    if row_bytes > chunk_bytes and len(shape) > 1:
        within = _plan_chunks(shape[1:], itemsize, chunk_bytes)
        return [((row, *index), start, length) for row in range(rows) for index, start, length in within]
    per_chunk = max(1, chunk_bytes // row_bytes)
    return [((), start, min(per_chunk, rows - start)) for start in range(0, rows, per_chunk)]
