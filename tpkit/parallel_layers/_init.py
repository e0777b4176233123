"""Default initialisation of sharded parameters, so a model built without loading a checkpoint is usable.

Ranks are expected to be seeded alike (``torch.manual_seed`` with one seed everywhere), like any
tensor-parallel code. Replicated parameters then draw from the global generator and come out equal on every
rank. A sharded parameter must not: if every rank drew the same numbers, the full matrix would be the same
block repeated ``tp_size`` times and its units could never become different in training. So a sharded
parameter draws one seed from the global generator (same on every rank, keeping the ranks' streams in step)
and fills each shard from that seed plus the shard's index.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

from .state import TPGroup

_skipping = contextvars.ContextVar("tpkit_skip_init", default=False)


@contextlib.contextmanager
def skip_init() -> Iterator[None]:
    """Layers built inside draw no random initial values: their parameters keep the memory as allocated.

    For a model whose every parameter a checkpoint is about to overwrite, this saves the draws (seconds a
    GB on a CPU). A parameter that is then not loaded holds arbitrary values; ``tpkit.loaders.load_weights``
    with ``strict=True`` reports every one.
    """
    token = _skipping.set(True)
    try:
        yield
    finally:
        _skipping.reset(token)


def _shard_seed(tp: TPGroup) -> int | None:
    """A seed for the shards of one parameter, or None at tp_size 1 (plain global draws, like nn.Linear)."""
    if tp.size == 1:
        return None
    return int(torch.randint(0, 2**62, ()).item())


def _generator(tensor: torch.Tensor, seed: int) -> torch.Generator:
    return torch.Generator(device=tensor.device).manual_seed(seed)


def _uniform_(tensor: torch.Tensor, bound: float, seed: int | None) -> None:
    """U(-bound, bound) in place; ``seed`` None draws from the global generator (replicated values)."""
    if tensor.is_meta or tensor.numel() == 0 or _skipping.get():
        return
    with torch.no_grad():
        generator = None if seed is None else _generator(tensor, seed)
        tensor.uniform_(-bound, bound, generator=generator)


def _normal_(tensor: torch.Tensor, seed: int | None) -> None:
    """N(0, 1) in place (nn.Embedding's default); ``seed`` as in :func:`_uniform_`."""
    if tensor.is_meta or tensor.numel() == 0 or _skipping.get():
        return
    with torch.no_grad():
        generator = None if seed is None else _generator(tensor, seed)
        tensor.normal_(generator=generator)
