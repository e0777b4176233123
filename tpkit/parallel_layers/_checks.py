"""Argument checks shared by the layers."""

from __future__ import annotations

import torch

from tpkit._env import env_flag

_INDEX_DTYPES = (torch.int64, torch.int32)


def _check_positive(**sizes: int) -> None:
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be a positive int, got {size!r}")


def _divide(size: int, tp_size: int, name: str) -> int:
    if size % tp_size:
        raise ValueError(f"{name}={size} is not divisible by tp_size={tp_size}")
    return size // tp_size


def _check_indices(owner: str, name: str, indices: object, size: int) -> None:
    """``indices`` must be an int64 or int32 tensor of values in ``[0, size)``: a row index past a rank's
    shard would otherwise be masked to a zero row, and one past the table read out of bounds.

    The values are read where that is free, on the CPU; on another device only with ``TPKIT_DEBUG=1`` (a
    synchronisation). Inside ``torch.compile`` or a CUDA graph capture the check is a device-side assertion
    (``torch._assert_async``), which fails the step without naming the value.
    """
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"{owner}: {name}: expected a torch.Tensor, got {type(indices).__name__}")
    if indices.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{owner}: {name}: expected dtype torch.int64 or torch.int32, got {indices.dtype}")
    if indices.numel() == 0 or (indices.device.type != "cpu" and not env_flag("TPKIT_DEBUG", False)):
        return
    expected = f"values in [0, {size})"
    outside = (indices < 0) | (indices >= size)
    if torch.compiler.is_compiling() or (indices.is_cuda and torch.cuda.is_current_stream_capturing()):
        torch._assert_async(~outside.any(), f"{owner}: {name}: expected {expected}")
        return
    bad = outside.nonzero()
    if bad.numel():
        where = tuple(bad[0].tolist())
        raise ValueError(f"{owner}: {name}{list(where)}: expected {expected}, got {int(indices[where])}")
