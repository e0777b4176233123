"""Run a function on every rank of a tensor-parallel world, for tests.

On CPU (plain ``pytest``) a :class:`tpkit.parallel_layers.RankPool` per world size is started once and
reused across tests: its ranks join a gloo group on 127.0.0.1 and run the functions they are sent. A hung
collective cannot hang the suite: gloo's own timeout (``COLLECTIVE_TIMEOUT_S``) raises inside the rank, and
the caller gives up waiting after ``timeout`` seconds and kills the pool. A failure on any rank is raised
with each failed rank's traceback.

Under ``torchrun`` (``WORLD_SIZE`` set) every rank is already a pytest process: a call runs the function
in-process when ``world_size`` equals the launched world, and skips otherwise. On GPUs that is NCCL, with
each rank on ``cuda:LOCAL_RANK``::

    torchrun --nproc-per-node 2 -m pytest tests -x -q

A function sent to the ranks must be defined at module level (it is pickled by reference). It runs with
``torch.distributed`` initialised over the whole world; it calls ``init_tensor_parallel`` itself, and the
tensor-parallel state is torn down after it. Use :func:`device` for the rank's device.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tpkit.parallel_layers import RankPool, destroy_tensor_parallel, free_port, local_device

COLLECTIVE_TIMEOUT_S = 30

__all__ = ["COLLECTIVE_TIMEOUT_S", "Ranks", "device", "free_port", "under_torchrun"]


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def device() -> torch.device:
    """The device this rank computes on: its GPU under torchrun with NCCL, else the CPU."""
    return local_device()


class Ranks:
    """``ranks.run(world_size, fn, *args, **kwargs)`` runs ``fn`` on every rank; returns their results."""

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}

    def run(self, world_size: int, fn: Callable, *args: Any, timeout: float = 120,
            **kwargs: Any) -> list[Any]:
        if under_torchrun():
            launched = int(os.environ["WORLD_SIZE"])
            if world_size != launched:
                pytest.skip(f"needs {world_size} ranks; torchrun launched {launched}")
            _init_torchrun_world()
            try:
                return [fn(*args, **kwargs)]
            finally:
                destroy_tensor_parallel()
        pool = self._pools.get(world_size)
        if pool is None or not pool.alive():
            pool = self._pools[world_size] = RankPool(world_size, collective_timeout=COLLECTIVE_TIMEOUT_S)
        return pool.run(fn, *args, timeout=timeout, **kwargs)

    def close(self) -> None:
        for pool in self._pools.values():
            try:
                pool.close()
            except TimeoutError:  # the pool is killed; the tests' verdicts are in
                pass
        self._pools.clear()


def _init_torchrun_world() -> None:
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S * 4))
