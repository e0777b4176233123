"""Copies from a checkpoint file straight into a GPU: the file's pages, where they lie in the page cache,
page-locked in place (``cudaHostRegister``, read-only) and read by the GPU's copy engine.

Loading into a GPU is bound by the host's memory bandwidth (BENCHMARKS.md, "Loading into GPUs": about 12
GB/s of memcpy on the 16-core host of an H200). A copy through page-locked buffers moves each byte three
times (the CPU reads and writes it, the copy engine reads it again); this reads it once. On that host, 2 GiB
registered in 64 MiB pieces, each piece's copy queued once it was registered: 53 ms (40 GB/s) and 16 ms to
unregister, against 0.23 s through buffers (``benchmarks/bench_host_copy.py register``).

The map is shared and read-only. The lazy handles' own views are of private (copy-on-write) maps, so that
a caller may write into what ``t[:]`` returns; registering such a map did not return within 120 s there.
Where registering fails (a file system whose pages cannot be pinned, no driver support), the process stops
trying and the caller copies its own way. ``TPKIT_LOAD_DMA=0`` in the environment turns this off.
"""

from __future__ import annotations

import mmap
import os
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

# Smaller parts (norms, biases) are not worth a map and a registration.
_MIN_BYTES = 2**20
# Registered and copied a piece at a time, so that registering the next piece overlaps the copy of this one
# (one registration of 2 GiB, then one copy: 86 ms against 53 ms in 64 MiB pieces). A multiple of the page.
_PIECE_BYTES = 64 * 2**20
# cudaHostRegisterReadOnly (8): the driver pins the pages without asking to write them; and
# cudaHostRegisterPortable (1): pinned for every device's context, not only the calling thread's current
# device (a loader thread's is device 0 even where it copies into another).
_HOST_REGISTER_FLAGS = 8 | 1

Register = Callable[[int, int], bool]  # (address, nbytes) -> registered
Unregister = Callable[[int], None]  # (address)

_LOCK = threading.Lock()


class _State:
    failed = False  # registering failed once in this process: do not try again


def enabled() -> bool:
    """False where the environment sets ``TPKIT_LOAD_DMA`` to 0 (or false, no, off), or registering failed."""
    setting = os.environ.get("TPKIT_LOAD_DMA", "").strip().lower()
    return setting not in ("0", "false", "no", "off") and not _State.failed


def worth_it(dst: torch.Tensor, part: torch.Tensor) -> bool:
    """Whether ``part`` (a view of a file map) is worth copying into ``dst`` straight from the file: into a
    GPU, the same shape and dtype, both contiguous, at least ``_MIN_BYTES``."""
    return (dst.device.type == "cuda" and part.device.type == "cpu" and dst.shape == part.shape
            and dst.dtype == part.dtype and dst.is_contiguous() and part.is_contiguous()
            and part.numel() * part.element_size() >= _MIN_BYTES and enabled())


def copy_file_range(dst: torch.Tensor, path: Path, offset: int) -> None:
    """Copies the ``dst.nbytes`` bytes at ``offset`` of the file at ``path`` into ``dst`` (contiguous, on a
    GPU) by DMA from the page cache, and returns once ``dst`` holds them. Pieces that cannot be registered
    are copied from the same (pageable) map instead."""
    cudart = torch.cuda.cudart()

    def register(address: int, nbytes: int) -> bool:
        if _State.failed:  # another piece or thread found it cannot be done
            return False
        if int(cudart.cudaHostRegister(address, nbytes, _HOST_REGISTER_FLAGS)) == 0:
            return True
        _State.failed = True
        _clear_cuda_error(dst.device)
        warnings.warn("tpkit: could not page-lock a checkpoint file's pages for a direct copy to the GPU; "
                      "copying through page-locked buffers from now on", RuntimeWarning, stacklevel=4)
        return False

    _copy_in_pieces(dst, path, offset, register, lambda address: cudart.cudaHostUnregister(address))


def _copy_in_pieces(dst: torch.Tensor, path: Path, offset: int, register: Register,
                    unregister: Unregister) -> None:
    """The copy of :func:`copy_file_range`, with the page-locking calls given: tests pass their own, and a
    ``dst`` on the CPU, where every copy is synchronous.

    The registered ranges are whole pages, one range a piece, and never overlap (the driver refuses a range
    that overlaps one registered before); a piece's copy starts at its first byte of the part, which may lie
    inside its first page. Each range is unregistered once its copy has finished, also after a failure.
    """
    nbytes = dst.numel() * dst.element_size()
    page = mmap.PAGESIZE
    map_start = offset - offset % mmap.ALLOCATIONGRANULARITY
    with open(path, "rb") as file:
        mapped = mmap.mmap(file.fileno(), offset + nbytes - map_start, access=mmap.ACCESS_READ,
                           offset=map_start)
    host = _read_only_bytes(mapped)  # [offset + nbytes - map_start] uint8, the map
    flat = dst.view(-1).view(torch.uint8)  # [nbytes]
    stream = torch.cuda.current_stream(dst.device) if dst.device.type == "cuda" else None
    pending: list[tuple[int, torch.cuda.Event | None]] = []  # registered ranges, each with its copy's event
    try:
        begin, end = offset - map_start, offset - map_start + nbytes  # the part, in map bytes
        for lo in range(begin - begin % page, end, _PIECE_BYTES):
            hi = min(lo + _PIECE_BYTES, -(-end // page) * page)
            piece_lo, piece_hi = max(lo, begin), min(hi, end)
            address = host.data_ptr() + lo
            registered = register(address, hi - lo)
            target = flat[piece_lo - begin:piece_hi - begin]
            target.copy_(host[piece_lo:piece_hi], non_blocking=registered)
            if registered:
                pending.append((address, stream.record_event() if stream is not None else None))
    finally:
        for address, event in pending:
            if event is not None:
                event.synchronize()
            unregister(address)


def _read_only_bytes(mapped: mmap.mmap) -> torch.Tensor:
    """The map as a uint8 tensor. torch warns once that it cannot mark a tensor read-only; nothing writes
    into this one."""
    with _LOCK, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
        return torch.frombuffer(mapped, dtype=torch.uint8)


def _clear_cuda_error(device: torch.device) -> None:
    """A failed runtime call leaves its error as this thread's last CUDA error, where torch's next kernel
    launch check would report it as that kernel's; a launch here takes it (and raises it) first."""
    try:
        torch.empty(1, device=device).zero_()
    except RuntimeError:
        pass
