"""Run a function on every rank of a tensor-parallel world on this machine: ``torchrun`` in a call.

::

    from tpkit.parallel_layers import init_tensor_parallel, launch, local_device

    def work(hidden_size: int) -> float:          # at module level: the ranks import it by name
        tp = init_tensor_parallel()                # the launched world
        layer = ColumnParallelLinear(hidden_size, 4 * hidden_size, device=local_device())
        return layer.weight.norm().item()

    if __name__ == "__main__":                     # the ranks import this module too
        norms = launch(work, 2, 1024)              # [rank 0's result, rank 1's]

Each rank is a fresh process (the ``spawn`` start method, so CUDA works in it) with torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` 127.0.0.1 and a free
``MASTER_PORT``) and the default process group initialised: ``backend="gloo"`` on the CPU (each rank with
its share of the cores as torch threads), ``"nccl"`` with rank r on ``cuda:r``. Code written for
``torchrun`` runs unchanged: :func:`init_tensor_parallel` finds the world.

Failures surface in the caller, in seconds rather than as a hang:

* an exception on a rank is re-raised as :class:`RankError`, with every failed rank's traceback;
* a rank that dies (a crash, an NCCL watchdog abort) raises :class:`RankError` with its exit code;
* a collective that waits longer than ``collective_timeout`` seconds raises on its rank (the process
  group's own timeout), and a call that outlasts ``timeout`` kills the ranks and raises ``TimeoutError``;
* after each call the rank destroys the tensor-parallel state (:func:`destroy_tensor_parallel`), and at
  the end the process group; ranks that do not exit within ``collective_timeout`` seconds of their last
  result (a teardown stuck in a collective) are killed and ``TimeoutError`` is raised.

:func:`launch` starts the ranks for one call; a :class:`RankPool` keeps them for many (a test suite, a
notebook), so that each call costs no process start or group set-up.
"""

from __future__ import annotations

import atexit
import datetime
import gc
import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .state import destroy_tensor_parallel

_BACKENDS = ("gloo", "nccl")
_POLL_S = 0.2


class RankError(RuntimeError):
    """A launched function failed on one or more ranks; ``failures`` maps each rank to what it reported
    (its traceback, or how its process ended)."""

    def __init__(self, fn_name: str, failures: dict[int, str]) -> None:
        self.failures = dict(sorted(failures.items()))
        ranks = ", ".join(str(rank) for rank in self.failures)
        details = "\n".join(f"--- rank {rank} ---\n{text}" for rank, text in self.failures.items())
        super().__init__(f"{fn_name} failed on rank(s) {ranks}:\n{details}")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for a group's ``MASTER_PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def local_device() -> torch.device:
    """The device this rank computes on: ``cuda:LOCAL_RANK`` in an NCCL world, else the CPU."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _rank_main(rank: int, world_size: int, port: int, backend: str, collective_timeout: float,
               tasks: mp.Queue, results: mp.Queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:
        # The ranks share the machine's cores.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=collective_timeout))
    while (task := tasks.get()) is not None:
        fn, args, kwargs = task
        try:
            # Pickled here, so that a result that cannot be sent fails as the function's own error would.
            reply = (rank, True, pickle.dumps(fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - the caller re-raises it, naming this rank
            reply = (rank, False, traceback.format_exc())
        try:
            destroy_tensor_parallel()
        except Exception:  # noqa: BLE001 - a failed call may leave state that cannot be torn down
            if reply[1]:
                reply = (rank, False, traceback.format_exc())
        results.put(reply)
    # A CUDA graph that captured the group's collectives must be gone before the group.
    gc.collect()
    dist.destroy_process_group()
    # Leave without the interpreter's teardown: there, after a clean destroy_process_group, a gloo rank can
    # still abort ("terminate called without an active exception"), which would read as a failed run.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class RankPool:
    """``world_size`` ranks started once and kept for many calls of :meth:`run` (see the module's doc).

    ``backend`` is ``"gloo"`` (CPU) or ``"nccl"`` (rank r on ``cuda:r``); ``collective_timeout`` is the
    process group's timeout in seconds. Use it as a context manager, or call :meth:`close`.
    """

    def __init__(self, world_size: int, *, backend: str = "gloo", collective_timeout: float = 60.0) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if backend not in _BACKENDS:
            raise ValueError(f"backend must be one of {_BACKENDS}, got {backend!r}")
        if not collective_timeout > 0:
            raise ValueError(f"collective_timeout must be positive seconds, got {collective_timeout!r}")
        if backend == "nccl" and torch.cuda.device_count() < world_size:
            raise ValueError(f"backend 'nccl' puts rank r on cuda:r: world_size {world_size} needs as many "
                             f"GPUs, {torch.cuda.device_count()} visible")
        self.world_size = world_size
        self.backend = backend
        self.collective_timeout = collective_timeout
        context = mp.get_context("spawn")
        self._results = context.Queue()
        self._tasks = [context.Queue() for _ in range(world_size)]
        port = free_port()
        self._procs = [context.Process(target=_rank_main,
                                       args=(rank, world_size, port, backend, collective_timeout,
                                             self._tasks[rank], self._results))
                       for rank in range(world_size)]
        for proc in self._procs:
            proc.start()
        # Ranks are not daemons (they may start processes of their own), so an interpreter that exits
        # without close() would wait for them: kill them then.
        weakref.finalize(self, _kill, self._procs)

    def alive(self) -> bool:
        """Whether every rank's process is still running."""
        return all(proc.is_alive() for proc in self._procs)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None,
            **kwargs: Any) -> list[Any]:
        """``fn(*args, **kwargs)`` on every rank; their results, by rank.

        ``fn`` and its arguments are pickled (``fn`` by reference: define it at a module's top level), and
        so is each result. Raises :class:`RankError` when a rank raises or dies, and ``TimeoutError`` when
        they have not all returned within ``timeout`` seconds; either way the ranks are killed, and the
        next call needs a new pool.
        """
        if not self.alive():
            raise RuntimeError("this RankPool's ranks are gone (closed, killed or crashed): start another")
        for tasks in self._tasks:
            tasks.put((fn, args, kwargs))
        deadline = None if timeout is None else time.monotonic() + timeout
        outputs: dict[int, Any] = {}
        failures: dict[int, str] = {}
        dead_since: float | None = None
        while len(outputs) + len(failures) < self.world_size:
            try:
                rank, ok, value = self._results.get(timeout=_POLL_S)
            except queue.Empty:
                now = time.monotonic()
                if deadline is not None and now > deadline:
                    self.kill()
                    raise TimeoutError(f"{_name(fn)} did not return on all {self.world_size} ranks within "
                                       f"{timeout} s (returned: {sorted(outputs)}, failed: "
                                       f"{sorted(failures)}); the ranks were killed") from None
                dead = self._dead_without_reply(outputs.keys() | failures.keys())
                # A dead rank's last reply may still be in the pipe: give it a moment to arrive.
                dead_since = (dead_since or now) if dead else None
                if dead and now - dead_since > 1.0:
                    self.kill()
                    raise RankError(_name(fn), failures | dead) from None
                continue
            if ok:
                outputs[rank] = pickle.loads(value)
            else:
                failures[rank] = value
        if failures:
            # A failed call can leave the group unusable (a collective that timed out on one rank closes
            # its peers' connections): the ranks end with it.
            self.kill()
            raise RankError(_name(fn), failures)
        return [outputs[rank] for rank in range(self.world_size)]

    def _dead_without_reply(self, replied: set[int]) -> dict[int, str]:
        return {rank: f"the process ended with exit code {proc.exitcode} before returning"
                for rank, proc in enumerate(self._procs) if rank not in replied and not proc.is_alive()}

    def close(self, timeout: float | None = None) -> None:
        """Ends the ranks: each destroys its process group and exits. Raises ``TimeoutError`` (after killing
        them) for ranks still running ``timeout`` seconds later (default ``collective_timeout``)."""
        timeout = self.collective_timeout if timeout is None else timeout
        for tasks, proc in zip(self._tasks, self._procs, strict=True):
            if proc.is_alive():
                tasks.put(None)
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        stuck = [rank for rank, proc in enumerate(self._procs) if proc.is_alive()]
        self.kill()
        if stuck:
            raise TimeoutError(f"rank(s) {stuck} did not exit within {timeout} s of their last call (a "
                               "teardown stuck in a collective); they were killed")

    def kill(self) -> None:
        """Kills the ranks' processes at once."""
        _kill(self._procs)

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if exc_info[0] is None:
            self.close()
        else:
            self.kill()


def launch(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
           timeout: float | None = None, collective_timeout: float = 60.0, **kwargs: Any) -> list[Any]:
    """Runs ``fn(*args, **kwargs)`` on ``world_size`` fresh ranks and returns their results, by rank.

    ``backend``: ``"gloo"`` (CPU) or ``"nccl"`` (rank r on ``cuda:r``). ``timeout``: seconds the call may
    take on every rank (default: no limit); ``collective_timeout``: the process group's timeout, and how
    long the ranks may take to exit after it. Raises :class:`RankError` or ``TimeoutError`` as the module's
    doc says. Call it under ``if __name__ == "__main__":`` (the ranks import the caller's module).
    """
    with RankPool(world_size, backend=backend, collective_timeout=collective_timeout) as pool:
        return pool.run(fn, *args, timeout=timeout, **kwargs)


def _kill(procs: list[mp.process.BaseProcess]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(timeout=5)


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
