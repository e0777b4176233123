"""Constructor argument checks shared by the layers."""

from __future__ import annotations


def _check_positive(**sizes: int) -> None:
    for name, size in sizes.items():
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be a positive int, got {size!r}")


def _divide(size: int, tp_size: int, name: str) -> int:
    if size % tp_size:
        raise ValueError(f"{name}={size} is not divisible by tp_size={tp_size}")
    return size // tp_size
