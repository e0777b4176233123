"""The generator states a training run draws from, saved and restored with its checkpoint.

Two kinds (``tpkit.parallel_layers.random``):

- the default generators (the CPU's and the current CUDA device's), which ``seed_tensor_parallel`` seeds
  alike on every rank: saved once (DCP keeps one of the ranks' equal copies) and restored on every rank.
  They draw the dropout masks of replicated activations and layer drop, and whatever else the run draws
  (data order, say), so those continue exactly, at any tp_size;
- the tensor-parallel streams, one a rank, which draw the masks of sharded activations: saved per rank. At
  the same tp_size each rank gets its own stream back, and a resumed run draws the masks an uninterrupted
  one would. At another tp_size there is nothing to give back: a rank's stream drew masks for its shard of
  the activations, and the shards are others now (rank 0 of 2 holds what ranks 0 and 1 of 4 held). The
  streams are then seeded afresh, from a seed derived from the saved default CPU state and the rank as
  ``seed_tensor_parallel`` does: distinct across ranks and the same on every resume from that checkpoint,
  but not the masks an uninterrupted run at either tp_size draws (those already differ between tp sizes).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch

from tpkit.parallel_layers import (
    TPGroup,
    get_tensor_parallel_rng_state,
    seed_tensor_parallel,
    set_tensor_parallel_rng_state,
)


def _default_states() -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _tensor_parallel_states() -> dict[torch.device, torch.Tensor]:
    try:
        return get_tensor_parallel_rng_state()
    except RuntimeError:  # never seeded: nothing to save
        return {}


def rng_values(tp: TPGroup) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(DCP values, header)``: ``rng.default.<device type>`` and ``rng.tensor_parallel.<tp_rank>.<device
    type>`` uint8 states; the header lists the device types of each."""
    values = {f"rng.default.{kind}": state for kind, state in _default_states().items()}
    parallel = {device.type: state for device, state in _tensor_parallel_states().items()}
    values.update({f"rng.tensor_parallel.{tp.rank}.{kind}": state for kind, state in parallel.items()})
    return values, {"default": sorted(_default_states()), "tensor_parallel": sorted(parallel)}


def rng_targets(header: dict[str, Any], saved_tp_size: int,
                tp: TPGroup) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
    """``(DCP targets, finish)``: the states to read, and the call that then restores them (module docstring).
    States of a device type this process lacks (CUDA on a CPU machine) are left as they are."""
    here = _default_states()  # a generator state's size depends only on the device type
    default = {kind: torch.empty_like(here[kind]) for kind in header["default"] if kind in here}
    targets = {f"rng.default.{kind}": state for kind, state in default.items()}
    same_layout = saved_tp_size == tp.size
    parallel: dict[str, torch.Tensor] = {}
    if same_layout:
        parallel = {kind: torch.empty_like(here[kind]) for kind in header["tensor_parallel"] if kind in here}
        targets.update({f"rng.tensor_parallel.{tp.rank}.{kind}": state for kind, state in parallel.items()})

    def finish() -> None:
        if header["tensor_parallel"]:
            if same_layout:
                if not _tensor_parallel_states():
                    seed_tensor_parallel(0, tp)  # creates the streams; overwritten next
                current = get_tensor_parallel_rng_state()
                set_tensor_parallel_rng_state({device: parallel.get(device.type, state)
                                               for device, state in current.items()})
            else:
                seed_tensor_parallel(_derived_seed(default["cpu"]), tp)
        if "cpu" in default:
            torch.set_rng_state(default["cpu"])
        if "cuda" in default:
            torch.cuda.set_rng_state(default["cuda"])

    return targets, finish


def _derived_seed(cpu_state: torch.Tensor) -> int:
    """A seed for the tensor-parallel streams at a new tp_size: a digest of the saved default CPU state."""
    digest = hashlib.sha256(cpu_state.numpy().tobytes()).digest()
    return int.from_bytes(digest[:7], "little")
