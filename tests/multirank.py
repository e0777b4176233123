"""Run a function on every rank of a tensor-parallel world, for tests.

On CPU (plain ``pytest``) a pool of worker processes per world size is spawned once and reused across
tests: each worker joins a gloo group on 127.0.0.1 and runs the functions it is sent. A hung collective
cannot hang the suite: gloo's own timeout raises inside the worker, and the parent gives up waiting after
``timeout`` seconds and kills the pool.

Under ``torchrun`` (``WORLD_SIZE`` set) every rank is already a pytest process: a call runs the function
in-process when ``world_size`` equals the launched world, and skips otherwise. On GPUs that is NCCL, with
each rank on ``cuda:LOCAL_RANK``::

    torchrun --nproc-per-node 2 -m pytest tests -x -q

A function sent to the workers must be defined at module level (it is pickled by reference). It runs with
``torch.distributed`` initialised over the whole world; it calls ``init_tensor_parallel`` itself, and the
worker tears the tensor-parallel state down after it. Use :func:`device` for the rank's device.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = 30


def under_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def device() -> torch.device:
    """The device this rank computes on: its GPU under torchrun with NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _teardown_tp_state() -> None:
    from tpkit.parallel_layers import destroy_tensor_parallel

    destroy_tensor_parallel()


def _worker(rank: int, world_size: int, port: int, tasks: mp.Queue, results: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    # Ranks share two cores: one thread each keeps them from thrashing.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - the parent re-raises it with the rank's traceback
            results.put((rank, False, traceback.format_exc()))
        finally:
            try:
                _teardown_tp_state()
            except Exception:  # noqa: BLE001 - a failed test may leave no state to tear down
                pass
    dist.destroy_process_group()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a group's MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Pool:
    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [ctx.Process(target=_worker, args=(r, world_size, port, self.tasks[r], self.results),
                                  daemon=True) for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> list[Any]:
        for q in self.tasks:
            q.put((fn, args, kwargs))
        outputs: dict[int, Any] = {}
        failures: list[str] = []
        for _ in range(self.world_size):
            try:
                rank, ok, value = self.results.get(timeout=timeout)
            except queue.Empty:
                self.kill()
                raise TimeoutError(f"{fn.__name__} did not finish on all {self.world_size} ranks "
                                   f"within {timeout}s (finished: {sorted(outputs)})") from None
            if ok:
                outputs[rank] = value
            else:
                failures.append(f"--- rank {rank} ---\n{value}")
        if failures:
            raise AssertionError(f"{fn.__name__} failed on {len(failures)} rank(s):\n" + "\n".join(failures))
        return [outputs[r] for r in range(self.world_size)]

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(timeout=5)

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
        self.kill()


class Ranks:
    """``ranks.run(world_size, fn, *args, **kwargs)`` runs ``fn`` on every rank; returns their results."""

    def __init__(self) -> None:
        self._pools: dict[int, _Pool] = {}

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
                _teardown_tp_state()
        pool = self._pools.get(world_size)
        if pool is None or not pool.alive():
            pool = self._pools[world_size] = _Pool(world_size)
        return pool.run(fn, args, kwargs, timeout)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def _init_torchrun_world() -> None:
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S * 4))
