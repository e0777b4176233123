"""What every weight loader does: check the checkpoint tensor, read only this rank's part, copy it in.

A loaded weight is a ``torch.Tensor`` or a lazy handle (``tpkit.loaders``); only ``.shape`` and
``.narrow(dim, start, length)`` are used, and ``narrow`` of a handle reads just those bytes, so a rank never
materialises more of a checkpoint tensor than its shard. A handle with ``copy_to(dst, part)`` is first asked
to copy each part itself (into a GPU, a safetensors handle copies by DMA from the file's page cache).

Into a GPU, a large tensor from host memory goes through page-locked buffers in chunks (see
:func:`_copy_into`); ``TPKIT_LOAD_PINNED=0`` in the environment turns that off.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Sequence

import torch
from torch import nn

from tpkit._env import env_flag

from .sharding import _refuse_plain_dcp

# (start in the parameter, start in the checkpoint tensor, length), all along one dimension
Piece = tuple[int, int, int]
# (indices into the leading dimensions, start, length): the chunk ``tensor[index].narrow(0, start, length)``
Chunk = tuple[tuple[int, ...], int, int]

# A plain copy_ from pageable host memory (a view of a file map) into a GPU goes through the CUDA driver's own
# staging, one synchronous copy at a time, at 4-6 GB/s on an H200 (BENCHMARKS.md, "Loading into GPUs").
# Instead, each copying thread fills page-locked buffers itself (a CPU memcpy, which is also where the file's
# pages are faulted in) while the GPU's copy engine reads the buffer filled before.

# Smaller tensors (norms, biases) go straight through copy_: a chunk costs a few calls and an event, which
# such a copy would not win back.
_STAGING_MIN_BYTES = 2**20
# Each of the two buffers of a copying thread, and so the largest chunk: 8 MiB. Page-locking is slow (there,
# roughly half a millisecond a MiB, judged from first loads against later ones) and most processes load
# once, so the size trades that first cost against the cost of each chunk (calls and an event). Loading a
# 2 GB bf16 checkpoint into an H200 on 4 threads, warm page cache, one run each, GB/s of a process's first
# load / its later ones: 4 MiB 9.8 / 10.7, 8 MiB 8.9 / 11.2, 16 MiB 7.4 / 10.0, 32 MiB 7.1 / 11.1 (plain
# copy_: 4.8 / 5.2). Cutting tensors into more, smaller chunks than the buffers allow (so that the last
# chunk's transfer, which no fill overlaps, is short) was slower. 2 x 8 MiB a thread stay page-locked: 64 MiB
# for the default 4 threads of a process. A power of two, as the caching host allocator rounds up to.
_STAGING_BUFFER_BYTES = 8 * 2**20


class _StagingBuffers(threading.local):
    """This thread's two page-locked buffers, made on its first staged copy; () where pinning failed."""

    pair: tuple[torch.Tensor, ...] | None = None


_STAGING = _StagingBuffers()


def _shape_of(loaded_weight: object) -> tuple[int, ...]:
    shape = getattr(loaded_weight, "shape", None)
    try:
        if not callable(getattr(loaded_weight, "narrow", None)):
            raise TypeError
        return tuple(int(size) for size in shape)
    except TypeError:
        raise TypeError("loaded_weight must be a torch.Tensor or a lazy tensor handle with .shape and "
                        f".narrow, got {type(loaded_weight).__name__}") from None


def _param_name(module: nn.Module, param: torch.Tensor, loaded_shard_id: object = None) -> str:
    """``Layer.weight`` (with the shard id when there is one), for error messages."""
    attr = next((name for name, p in module.named_parameters(recurse=False) if p is param), "parameter")
    name = f"{type(module).__name__}.{attr}"
    return name if loaded_shard_id is None else f"{name}[{loaded_shard_id!r}]"


def _check_shape(name: str, loaded_weight: object, expected: Sequence[int]) -> None:
    received = _shape_of(loaded_weight)
    if received != tuple(expected):
        raise ValueError(f"{name}: expected a checkpoint tensor of shape {tuple(expected)}, "
                         f"received {received}")


def _reject_shard_id(name: str, loaded_shard_id: object) -> None:
    if loaded_shard_id is not None:
        raise ValueError(f"{name} is not a stacked parameter: expected loaded_shard_id=None, "
                         f"received {loaded_shard_id!r}")


def _attach_weight_loaders(module: nn.Module) -> None:
    """Gives each of the module's own parameters ``param.weight_loader`` = the module's loader."""
    for param in module.parameters(recurse=False):
        param.weight_loader = module.weight_loader


class _LoadableModule(nn.Module):
    """A layer whose own parameters carry ``param.weight_loader``, also after whatever makes new Parameter
    objects without the attribute: ``copy.deepcopy`` and unpickling (``__setstate__``), and conversions that
    cannot swap data in place, such as ``to_empty`` from the meta device (``_apply``).

    Subclasses define ``weight_loader``, ``shard_parts(param)`` (``tpkit.parallel_layers.sharding``),
    ``tp_rank`` and ``tp_size``, and call ``_attach_weight_loaders(self)`` once their parameters exist. Their
    ``state_dict`` marks each sharded tensor so that torch.distributed.checkpoint refuses it (see there).
    """

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # noqa: ANN001, ANN202 (nn.Module's)
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.tp_size == 1:
            return
        for name, param in self.named_parameters(recurse=False):
            sharded = any(part.dim is not None for part in self.shard_parts(param))
            if sharded and prefix + name in destination:
                _refuse_plain_dcp(destination[prefix + name], prefix + name, self.tp_rank, self.tp_size)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        _attach_weight_loaders(self)

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 (nn.Module's private signature)
        module = super()._apply(fn, recurse)
        _attach_weight_loaders(self)
        return module


def _copy_pieces(param: torch.Tensor, loaded_weight: object, dim: int, pieces: Sequence[Piece]) -> None:
    """Copies each piece of ``loaded_weight`` along ``dim`` into ``param``, casting to its dtype.

    Every piece is read before the first is written, so a failing read leaves the parameter untouched.
    """
    sources = [loaded_weight.narrow(dim, src_start, length) for _, src_start, length in pieces if length]
    # A lazy handle may copy its part straight from the file (into a GPU, by DMA from the page cache).
    copy_to = getattr(loaded_weight, "copy_to", None)
    with torch.no_grad():
        for (dst_start, _, length), source in zip([p for p in pieces if p[2]], sources, strict=True):
            dst = param.narrow(dim, dst_start, length)
            if copy_to is None or not copy_to(dst, source):
                _copy_into(dst, source)


def _copy_whole(param: torch.Tensor, loaded_weight: object) -> None:
    """Copies an unsharded (replicated) tensor: the whole checkpoint tensor."""
    _copy_pieces(param, loaded_weight, 0, [(0, 0, param.shape[0])])


# --- copies into a GPU through page-locked buffers ----------------------------------------------------------

def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` (same shape, cast to dst's dtype), through this thread's page-locked buffers where
    that is faster: from host memory into a GPU, at least ``_STAGING_MIN_BYTES``, unless
    ``TPKIT_LOAD_PINNED=0``. Either way it returns once ``dst`` holds the values, as copy_ from pageable
    memory does, so a caller may drop ``src`` (and unmap its file) at once.
    """
    if _worth_staging(dst, src):
        buffers = _staging_buffers()
        if buffers:
            _staged_copy(dst, src, buffers)
            return
    dst.copy_(src)


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
