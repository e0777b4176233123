"""Tensor-parallel process groups: set up once, looked up by every layer.

Three settings work with one call to :func:`init_tensor_parallel`:

* under ``torchrun`` (``RANK``/``WORLD_SIZE`` in the environment, ``torch.distributed`` not yet set up): it
  initialises the default group itself (nccl when CUDA is available, else gloo; on CUDA the device is set
  from ``LOCAL_RANK``) and :func:`destroy_tensor_parallel` tears it down again;
* inside an initialised ``torch.distributed``: the world is the tensor-parallel group, or consecutive
  blocks of ``tp_size`` ranks when ``tp_size`` is smaller, or a group you pass (e.g. a ``DeviceMesh``
  dimension);
* a single process without ``torch.distributed``: ``tp_size`` 1, nothing communicates.

Layers take ``tp_group=`` (a :class:`TPGroup`, a ``ProcessGroup`` or a 1-D ``DeviceMesh``), so models on
different groups can live in one process. ``tp_group=None`` means the group of :func:`init_tensor_parallel`;
when that was never called and ``torch.distributed`` is not initialised either, it means ``tp_size`` 1, so
layers work with no setup at all. With ``torch.distributed`` initialised but no tensor-parallel group
chosen, a layer raises instead of guessing which ranks share its weights.

Call :func:`destroy_tensor_parallel` when done (before the process exits), as with ``destroy_process_group``.
"""

from __future__ import annotations

import datetime
import gc
import os
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

_HOW_TO_INIT = (
    "call tpkit.parallel_layers.init_tensor_parallel() first: under torchrun it reads the environment; "
    "inside an initialised torch.distributed it uses the world (or tp_size / group=); in a single process "
    "init_tensor_parallel(tp_size=1) needs no torch.distributed"
)


class TPGroup:
    """A tensor-parallel group as the layers see it: the process group, this rank's index and the size.

    ``group`` is None only for ``size`` 1, where nothing communicates. The process group is held weakly:
    torch.distributed owns it until ``destroy_process_group``, and a layer kept alive past that (a model
    in a global, freed only while the interpreter shuts down) must not keep it alive, because freeing a
    gloo group during interpreter shutdown can abort the process. Using a TPGroup whose process group was
    destroyed raises RuntimeError. Copying a module that holds a TPGroup keeps the same group.
    """

    __slots__ = ("_group_ref", "_rank", "_size", "_backend", "__weakref__")

    def __init__(self, group: dist.ProcessGroup | None, rank: int, size: int,
                 backend: str | None = None) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"TPGroup needs 0 <= rank < size, got rank={rank}, size={size}")
        if size > 1 and group is None:
            raise ValueError(f"TPGroup of size {size} needs a process group, got group=None")
        if group is not None and backend is None:
            backend = dist.get_backend(group)
        self._group_ref = None if group is None else _weak(group)
        self._rank = rank
        self._size = size
        self._backend = backend

    @classmethod
    def from_process_group(cls, group: dist.ProcessGroup) -> TPGroup:
        """Wraps a ``ProcessGroup`` this process belongs to."""
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed.ProcessGroup, got {type(group).__name__}")
        rank = dist.get_rank(group)
        if rank < 0:
            raise ValueError("this process is not a member of the given process group")
        return cls(group, rank, dist.get_world_size(group))

    @property
    def group(self) -> dist.ProcessGroup | None:
        if self._group_ref is None:
            return None
        group = self._group_ref()
        if group is None:
            raise RuntimeError(f"the process group of this TPGroup (rank {self._rank} of {self._size}) "
                               "has been destroyed: build the layers again after init_tensor_parallel()")
        return group

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def backend(self) -> str | None:
        """The process group's backend ("gloo", "nccl", ...), None without one."""
        return self._backend

    def __repr__(self) -> str:
        return f"TPGroup(rank={self._rank}, size={self._size}, backend={self._backend})"

    def __copy__(self) -> TPGroup:
        return self

    def __deepcopy__(self, memo: dict) -> TPGroup:
        return self


def _weak(group: dist.ProcessGroup) -> Callable[[], dist.ProcessGroup | None]:
    try:
        return weakref.ref(group)
    except TypeError:  # a torch whose ProcessGroup takes no weak references: hold it
        return lambda: group


_SINGLE_PROCESS = TPGroup(None, 0, 1)
# What destroy_tensor_parallel calls to drop state seeded for the group: modules that keep such state
# (random.py's generator states) add their function here, so this module imports none of them.
_on_destroy: list[Callable[[], None]] = []

# The group of init_tensor_parallel, and what it created itself (only those are destroyed again).
_tp_group: TPGroup | None = None
_created_group: dist.ProcessGroup | None = None
_created_default_group = False


def _as_timedelta(timeout: datetime.timedelta | float | None) -> datetime.timedelta | None:
    if timeout is None or isinstance(timeout, datetime.timedelta):
        return timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a datetime.timedelta or seconds, got {type(timeout).__name__}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout} seconds")
    return datetime.timedelta(seconds=timeout)


def _distributed_ready() -> bool:
    return dist.is_available() and dist.is_initialized()


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _group_of(group: dist.ProcessGroup | DeviceMesh) -> dist.ProcessGroup:
    # A 1-D DeviceMesh (e.g. mesh["tp"]) stands for its only process group.
    get_group = getattr(group, "get_group", None)
    if not isinstance(group, dist.ProcessGroup) and callable(get_group):
        if getattr(group, "ndim", 1) != 1:
            raise ValueError(f"group= takes a 1-D DeviceMesh, got one with {group.ndim} dimensions")
        group = get_group()
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a ProcessGroup or a 1-D DeviceMesh, got {type(group).__name__}")
    return group


def init_tensor_parallel(
    tp_size: int | None = None,
    *,
    backend: str | None = None,
    group: dist.ProcessGroup | DeviceMesh | None = None,
    timeout: datetime.timedelta | float | None = None,
) -> TPGroup:
    """Sets up the tensor-parallel group that layers use when built with ``tp_group=None``.

    ``tp_size`` defaults to the whole world (or the size of ``group``). With ``tp_size`` smaller than the
    world, ranks ``[k * tp_size, (k + 1) * tp_size)`` form the groups. ``backend`` and ``timeout``
    (a ``timedelta`` or seconds) apply to the groups this call creates. Calling it again with a compatible
    request returns the same group; a different one needs :func:`destroy_tensor_parallel` first.
    """
    global _tp_group, _created_group, _created_default_group
    if tp_size is not None and (isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1):
        raise ValueError(f"tp_size must be a positive int, got {tp_size!r}")
    timeout = _as_timedelta(timeout)
    process_group = None if group is None else _group_of(group)
    if _tp_group is not None:
        same_size = tp_size is None or tp_size == _tp_group.size
        same_group = process_group is None or process_group is _tp_group.group
        if same_size and same_group:
            return _tp_group
        raise RuntimeError(f"tensor parallelism is already initialised with tp_size={_tp_group.size}; "
                           "call destroy_tensor_parallel() before initialising it differently")

    from ._consistency import check_setup_agrees  # it imports this module

    if process_group is not None:
        tp = TPGroup.from_process_group(process_group)
        if tp_size is not None and tp_size != tp.size:
            raise ValueError(f"tp_size={tp_size} does not match the size of the given group ({tp.size})")
        check_setup_agrees(tp, tp_size=tp_size)
        _tp_group = tp
        return tp

    created_default = False
    if not _distributed_ready():
        if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
            if tp_size not in (None, 1):
                raise ValueError(f"tp_size={tp_size} needs several processes: launch with "
                                 f"`torchrun --nproc-per-node {tp_size} ...`, or initialise "
                                 "torch.distributed before calling init_tensor_parallel")
            _tp_group = _SINGLE_PROCESS
            return _tp_group
        backend = backend or _default_backend()
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        kwargs = {} if timeout is None else {"timeout": timeout}
        dist.init_process_group(backend, **kwargs)
        created_default = True
        backend = None  # the default group already has it

    world_size = dist.get_world_size()
    tp_size = world_size if tp_size is None else tp_size
    try:
        # Before any group is made: ranks asking for different groups would otherwise make different ones.
        check_setup_agrees(TPGroup.from_process_group(dist.group.WORLD), tp_size=tp_size, backend=backend,
                           timeout=None if timeout is None else timeout.total_seconds())
    except (RuntimeError, ValueError):
        if created_default:
            dist.destroy_process_group()
        raise
    if world_size % tp_size:
        if created_default:
            dist.destroy_process_group()
        raise ValueError(f"tp_size={tp_size} must divide the world size {world_size}")

    world_backend = backend is None or backend == dist.get_backend()
    if tp_size == world_size and world_backend and (timeout is None or created_default):
        _tp_group = TPGroup.from_process_group(dist.group.WORLD)
    else:
        # new_group is collective over the world: every rank creates every block, keeps its own.
        rank = dist.get_rank()
        mine = None
        for start in range(0, world_size, tp_size):
            block = dist.new_group(list(range(start, start + tp_size)), timeout=timeout, backend=backend)
            if start <= rank < start + tp_size:
                mine = block
        _tp_group = TPGroup.from_process_group(mine)
        _created_group = mine
    _created_default_group = created_default
    return _tp_group


def destroy_tensor_parallel() -> None:
    """Forgets the tensor-parallel group, and the generator state seeded for it (``seed_tensor_parallel``),
    and destroys the process groups that init created (only those), after collecting garbage: a CUDA graph
    that captured their NCCL collectives must be gone first, so drop models (or ``clear_kv_cache()``) before.

    A no-op when tensor parallelism is not initialised.
    """
    global _tp_group, _created_group, _created_default_group
    for forget in _on_destroy:
        forget()
    created_group, created_default = _created_group, _created_default_group
    _tp_group, _created_group, _created_default_group = None, None, False
    if (created_default or created_group is not None) and _distributed_ready():
        # A live CUDA graph that captured the group's NCCL collectives keeps its destruction from returning
        # (torch 2.11, NCCL 2.28), and a dropped model's decode graphs can outlive the model in a reference
        # cycle (the model holds its graphs, each graph's step the model): collect them first.
        gc.collect()
        # The default group's destruction takes the groups made from it along.
        dist.destroy_process_group(None if created_default else created_group)


def get_tp_group() -> TPGroup:
    """The group of :func:`init_tensor_parallel`; raises RuntimeError (saying how to init) before it."""
    if _tp_group is None:
        raise RuntimeError(f"tensor parallelism is not initialised: {_HOW_TO_INIT}")
    return _tp_group


def get_tp_rank() -> int:
    """This process's index in the tensor-parallel group."""
    return get_tp_group().rank


def get_tp_size() -> int:
    """The number of ranks in the tensor-parallel group."""
    return get_tp_group().size


def _resolve_tp_group(tp_group: TPGroup | dist.ProcessGroup | DeviceMesh | None) -> TPGroup:
    """What a layer's ``tp_group=`` argument means (see the module docstring)."""
    if isinstance(tp_group, TPGroup):
        return tp_group
    if tp_group is not None:
        return TPGroup.from_process_group(_group_of(tp_group))
    if _tp_group is not None:
        return _tp_group
    if _distributed_ready():
        raise RuntimeError("torch.distributed is initialised but no tensor-parallel group is chosen: pass "
                           f"tp_group= to the layer, or {_HOW_TO_INIT}")
    return _SINGLE_PROCESS
