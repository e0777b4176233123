"""Lazy handles on checkpoint tensors: shape and dtype for free, data only for the part asked for.

A handle's ``narrow`` and ``[...]`` return real ``torch.Tensor``s. For a safetensors file they are views of a
private, copy-on-write memory map of that tensor's bytes (widened to 2 MiB file boundaries): only the pages
of the requested part are read, when the caller copies the view into its parameter (for a contiguous part,
the kernel is asked to start reading its bytes as soon as it is taken). The map goes away with the last
view, so a loader's resident memory grows by one tensor at a time per copying thread, not by the
checkpoint.

Every returned tensor's size is added to a per-process counter (:func:`bytes_read`), which the loading
log line and the per-rank tests read.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch

from . import _direct_copy, _staging
from .errors import CheckpointError

__all__ = ["LazyTensor", "bytes_read", "reset_bytes_read"]


class _ReadCounter:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total = 0

    def add(self, nbytes: int) -> None:
        with self._lock:
            self._total += nbytes

    def get(self) -> int:
        return self._total

    def reset(self) -> None:
        with self._lock:
            self._total = 0


_COUNTER = _ReadCounter()


def bytes_read() -> int:
    """Bytes this process has taken from checkpoint tensors through lazy handles since the last reset."""
    return _COUNTER.get()


def reset_bytes_read() -> None:
    """Sets the :func:`bytes_read` counter back to zero."""
    _COUNTER.reset()


class LazyTensor(ABC):
    """One checkpoint tensor, not yet read.

    ``shape`` (``torch.Size``) and ``dtype`` (``torch.dtype``) cost no read. ``narrow(dim, start, length)``
    and basic indexing (``t[a:b]``, ``t[:, a:b]``, ``t[i]``, ``t[...]``; ``t[:]`` is the whole tensor)
    return a ``torch.Tensor`` holding just that part. For safetensors the result is a view of a private map
    of the file, valid as long as it is referenced; weight loaders copy it into their parameter and drop it,
    which unmaps it (keeping it would keep its file pages resident).

    Bytes are counted (:func:`bytes_read`) as numel x element size of what is returned; for strided
    slices (``t[:, a:b]``) the kernel reads whole pages, so a rank reads from disk exactly its share only
    where rows are at least a page long.
    """

    # Whether copy_to can copy this handle's parts straight from its file (into a GPU, by DMA).
    copies_from_file = False

    def __init__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, file: Path | None) -> None:
        self.name = name
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self.file = file

    @abstractmethod
    def _full(self) -> torch.Tensor:
        """The whole tensor as a view that reads nothing until its elements are touched."""

    def _counts_reads(self) -> bool:
        return True

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None) -> torch.Size | int:
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return self.shape.numel()

    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Size of the whole tensor in bytes (what ``t[:]`` reads)."""
        return self.numel() * self.element_size()

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError(f"len() of a 0-d tensor ({self.name!r})")
        return self.shape[0]

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Elements ``start .. start + length - 1`` along ``dim``, like ``torch.Tensor.narrow``."""
        if not self.shape:
            raise ValueError(f"narrow: {self.name!r} is a 0-d tensor, it has no dimension {dim}")
        ndim = len(self.shape)
        if not -ndim <= dim < ndim:
            raise IndexError(f"narrow: dim {dim} is out of range for {self.name!r} of shape "
                             f"{tuple(self.shape)}")
        dim %= ndim
        size = self.shape[dim]
        begin = start + size if start < 0 else start
        if length < 0 or not 0 <= begin <= size or begin + length > size:
            raise ValueError(f"narrow(dim={dim}, start={start}, length={length}) does not fit dimension "
                             f"{dim} of {self.name!r}, shape {tuple(self.shape)}")
        return self._take(self._full().narrow(dim, begin, length))

    def __getitem__(self, key: Any) -> torch.Tensor:
        return self._take(self._full()[key])

    def copy_to(self, dst: torch.Tensor, part: torch.Tensor) -> bool:
        """Copies ``part``, a tensor this handle returned (``narrow`` or ``[...]``), into ``dst`` (the same
        shape; cast to dst's dtype) straight from the file, where that is faster than copying the view.
        Returns True once the copy is done or queued on dst's current stream (inside ``load_weights``,
        which waits for its copies before it returns); False, having written nothing, where it is not
        faster: the caller then copies ``part``.

        Into a GPU, a part of 1 MiB or more of a safetensors file is copied by DMA from the page cache,
        page-locked in place, so the host's CPU never copies its bytes: a contiguous part straight into a
        contiguous dst of its dtype, any other (a column shard, a cast) by its span into a GPU buffer, taken
        from there on the GPU (``TPKIT_LOAD_DMA=0`` turns this off). Any other part of 1 MiB or more from
        host memory into a GPU goes through page-locked buffers, so that reading it overlaps the transfer
        (``TPKIT_LOAD_PINNED=0`` turns this off). ``part`` was counted by :func:`bytes_read` when it was
        taken; this counts nothing.
        """
        return _staging.copy_into(dst, part)

    def _take(self, part: torch.Tensor) -> torch.Tensor:
        if self._counts_reads():
            _COUNTER.add(part.numel() * part.element_size())
        return part

    def __repr__(self) -> str:
        where = f", file={self.file.name!r}" if self.file is not None else ""
        return f"{type(self).__name__}({self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype}{where})"


# Maps begin and end on 2 MiB file offsets (the huge-page size of x86-64 and of arm64 with 4 KiB pages; a
# multiple of mmap's granularity): the kernel can then map the page cache's 2 MiB folios whole, one
# page-table entry each, also those where a tensor starts or ends mid-folio, which makes a warm load
# faster. A neighbour's bytes in such a folio may be mapped with it, while the map
# lives, but the tensor's views never read them (and the kernel reads a folio from disk whole anyway).
_MAP_ALIGNMENT = math.lcm(2 * 2**20, mmap.ALLOCATIONGRANULARITY)


class _SafetensorsTensor(LazyTensor):
    """A tensor stored at ``data_start`` (absolute file offset) of a safetensors file."""

    copies_from_file = True

    def __init__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, file: Path,
                 data_start: int) -> None:
        super().__init__(name, shape, dtype, file)
        self.data_start = data_start

    def _full(self) -> torch.Tensor:
        numel = self.numel()
        if numel == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        end = self.data_start + self.nbytes
        map_start = self.data_start - self.data_start % _MAP_ALIGNMENT
        fd = os.open(self.file, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if end > size:
                raise CheckpointError(f"{self.file}: truncated after its header was read: tensor "
                                      f"{self.name!r} ends at byte {end}, the file now holds {size}")
            map_end = min(size, -(-end // _MAP_ALIGNMENT) * _MAP_ALIGNMENT)
            mapped = mmap.mmap(fd, map_end - map_start, access=mmap.ACCESS_COPY, offset=map_start)
        finally:
            os.close(fd)
        # The tensor holds the only reference to `mapped`: it is unmapped when the last view dies, and
        # nothing else can close it under the view.
        flat = torch.frombuffer(mapped, dtype=self.dtype, count=numel,
                                offset=self.data_start - map_start)  # [numel]
        return flat.view(self.shape)

    def copy_to(self, dst: torch.Tensor, part: torch.Tensor) -> bool:
        if not _direct_copy.worth_it(dst, part):
            return super().copy_to(dst, part)
        _direct_copy.copy_file_view(dst, self.file, self._file_offset(part), part)
        return True

    def _file_offset(self, part: torch.Tensor) -> int:
        """Where the first byte of ``part``, a view this handle returned, lies in the file (the storage of
        ``_full``'s view begins at ``data_start``)."""
        return self.data_start + part.data_ptr() - part.untyped_storage().data_ptr()

    def _take(self, part: torch.Tensor) -> torch.Tensor:
        if part.numel() and part.is_contiguous() and hasattr(os, "posix_fadvise"):
            # Has the kernel start reading the part's bytes now, in large requests, instead of fault by fault
            # as the copy reaches them, which speeds up a load from a cold page cache. Only for
            # contiguous parts, whose byte range is theirs alone (a column slice's spans the other columns).
            start = self._file_offset(part)
            fd = os.open(self.file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, start, part.numel() * part.element_size(), os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)
        return super()._take(part)


class _InMemoryTensor(LazyTensor):
    """A tensor that ``torch.load`` already produced (memory-mapped where the file format allows)."""

    def __init__(self, name: str, tensor: torch.Tensor, file: Path | None) -> None:
        super().__init__(name, tuple(tensor.shape), tensor.dtype, file)
        self._tensor = tensor

    def _full(self) -> torch.Tensor:
        return self._tensor


class _GivenTensor(_InMemoryTensor):
    """A tensor handed to ``load_weights`` as it is: in memory already, so taking it counts no bytes read."""

    def _counts_reads(self) -> bool:
        return False


class _MetaTensor(LazyTensor):
    """Shape and dtype only: slicing returns meta tensors, so a weight loader can be tried without data."""

    def _full(self) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device="meta")

    def _counts_reads(self) -> bool:
        return False
