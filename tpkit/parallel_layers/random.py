"""Random numbers under tensor parallelism: one dropout mask where activations are replicated, independent
masks where they are sharded.

A tensor-parallel model holds some activations whole on every rank (the residual stream, a row-parallel
layer's reduced output) and others split across the ranks (a column-parallel layer's output, a rank's
attention heads). Dropout of a replicated activation must draw the same mask on every rank, or the copies
that the next layers take to be equal drift apart. Dropout of a sharded activation must draw masks that
differ from rank to rank, or every rank drops the same positions of its shard, a correlation no unsharded
model has. As in Megatron-LM: every rank seeds its default generators alike, and a second generator state,
seeded per rank, is swapped in around the dropout of sharded activations::

    init_tensor_parallel()
    seed_tensor_parallel(1234)                    # on every rank, the same seed
    x = F.dropout(row_parallel(h), 0.1)           # replicated: the default generators, one mask
    with tensor_parallel_rng():
        a = F.dropout(column_parallel(x), 0.1)    # sharded: this rank's own stream

or, in one call each, ``tensor_parallel_dropout(h, 0.1)`` and
``tensor_parallel_dropout(a, 0.1, sharded=True)``.

The generators are the CPU's and, where CUDA is available, the current device's. Activation recomputation
must draw the same masks again: ``torch.utils.checkpoint`` restores the default generators, and
:func:`checkpoint` this state too. ``torch.compile`` breaks its graph at the block: a generator's state
cannot be traced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.distributed.device_mesh import DeviceMesh

from .state import TPGroup, _on_destroy, _resolve_tp_group

# Keeps the per-rank seeds (seed + offset + tp_rank) away from the shared seed and its neighbours.
_TP_SEED_OFFSET = 2718

# This rank's tensor-parallel generator state, by generator device; None until seed_tensor_parallel.
_tp_states: dict[torch.device, torch.Tensor] | None = None
_forked = False


def _default_generators() -> list[torch.Generator]:
    generators = [torch.default_generator]
    if torch.cuda.is_available():
        torch.cuda.init()
        generators.append(torch.cuda.default_generators[torch.cuda.current_device()])
    return generators


def seed_tensor_parallel(seed: int, tp_group: TPGroup | dist.ProcessGroup | DeviceMesh | None = None) -> None:
    """Seeds the default generators with ``seed`` (the same on every rank) and this rank's tensor-parallel
    state with ``seed + 2718 + tp_rank``. Call it on every rank with the same seed."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, received {seed!r}")
    tp = _resolve_tp_group(tp_group)
    torch.manual_seed(seed)
    states = {}
    for generator in _default_generators():
        shared = generator.get_state()
        generator.manual_seed(seed + _TP_SEED_OFFSET + tp.rank)
        states[generator.device] = generator.get_state()
        generator.set_state(shared)
    global _tp_states
    _tp_states = states


def _require_seeded() -> dict[torch.device, torch.Tensor]:
    if _tp_states is None:
        raise RuntimeError("the tensor-parallel generator state is not seeded: call "
                           "seed_tensor_parallel(seed) on every rank first")
    return _tp_states


@contextlib.contextmanager
def tensor_parallel_rng() -> Iterator[None]:
    """Draws from this rank's tensor-parallel stream inside the block (dropout of sharded activations); after
    it the default generators continue as if the block had drawn nothing. Not nestable."""
    global _forked
    states = _require_seeded()
    if _forked:
        raise RuntimeError("tensor_parallel_rng() is already active: the block cannot be nested")
    generators = _default_generators()
    unseeded = [str(g.device) for g in generators if g.device not in states]
    if unseeded:
        raise RuntimeError(f"seed_tensor_parallel seeded the generators of {sorted(map(str, states))}, "
                           f"not of {unseeded}: call it after torch.cuda.set_device")
    shared = [g.get_state() for g in generators]
    for generator in generators:
        generator.set_state(states[generator.device])
    _forked = True
    try:
        yield
    finally:
        for generator, state in zip(generators, shared, strict=True):
            states[generator.device] = generator.get_state()
            generator.set_state(state)
        _forked = False


def tensor_parallel_dropout(input: torch.Tensor, p: float, *, training: bool = True, sharded: bool = False,
                            tp_group: TPGroup | dist.ProcessGroup | DeviceMesh | None = None) -> torch.Tensor:
    """``F.dropout(input, p, training)`` of an activation of a tensor-parallel model: a ``sharded`` one (split
    across the ranks) draws from this rank's tensor-parallel stream, a replicated one from the default
    generators. Where anything is dropped and ``tp_group`` has more than one rank, both need
    :func:`seed_tensor_parallel` first: it also seeds the default generators alike on every rank, without
    which the ranks' copies of a replicated activation would lose different elements."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
        raise ValueError(f"p must be a probability in [0, 1), received {p!r}")
    if not training or p == 0.0:
        return input
    if _resolve_tp_group(tp_group).size == 1:
        return F.dropout(input, p, training=True)
    if not sharded:
        _require_seeded()
        return F.dropout(input, p, training=True)
    with tensor_parallel_rng():
        return F.dropout(input, p, training=True)


def get_tensor_parallel_rng_state() -> dict[torch.device, torch.Tensor]:
    """A copy of this rank's tensor-parallel generator state (for activation recomputation)."""
    return {device: state.clone() for device, state in _require_seeded().items()}


def set_tensor_parallel_rng_state(state: dict[torch.device, torch.Tensor]) -> None:
    """Restores a state from :func:`get_tensor_parallel_rng_state`."""
    current = _require_seeded()
    if not isinstance(state, dict) or state.keys() != current.keys():
        received = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"state must be a dict from get_tensor_parallel_rng_state() for devices "
                         f"{sorted(map(str, current))}, received {received}")
    current.update({device: value.clone() for device, value in state.items()})


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)`` that also
    recomputes ``function`` from the tensor-parallel generator state it first ran from, so the sharded
    activations' dropout masks are drawn again alike; the stream then continues where it was."""
    if _tp_states is None:
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, **kwargs)
    before = get_tensor_parallel_rng_state()
    ran = False

    def run(*inner_args: Any, **inner_kwargs: Any) -> Any:
        nonlocal ran
        if not ran:
            ran = True
            return function(*inner_args, **inner_kwargs)
        after = get_tensor_parallel_rng_state()
        set_tensor_parallel_rng_state(before)
        try:
            return function(*inner_args, **inner_kwargs)
        finally:
            set_tensor_parallel_rng_state(after)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, **kwargs)


def _forget_tensor_parallel_rng() -> None:
    """Drops the seeded state (the group it was seeded for is gone)."""
    global _tp_states, _forked
    _tp_states, _forked = None, False


_on_destroy.append(_forget_tensor_parallel_rng)
