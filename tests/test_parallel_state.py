"""init_tensor_parallel in its three settings, the getters, destroy, and layers on different groups."""

from __future__ import annotations

import datetime
import gc
import os
import pathlib
import subprocess
import sys
import weakref

import multirank
import pytest
import torch
import torch.distributed as dist
from torch import nn

from tpkit.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    destroy_tensor_parallel,
    get_tp_group,
    get_tp_rank,
    get_tp_size,
    init_tensor_parallel,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]

needs_plain_process = pytest.mark.skipif(
    multirank.under_torchrun() or (dist.is_available() and dist.is_initialized()),
    reason="needs a process without torch.distributed",
)


def _assert_not_initialised() -> None:
    for getter in (get_tp_group, get_tp_rank, get_tp_size):
        with pytest.raises(RuntimeError, match="init_tensor_parallel"):
            getter()


@needs_plain_process
def test_single_process_without_distributed() -> None:
    _assert_not_initialised()
    try:
        tp = init_tensor_parallel()
        assert (tp.group, tp.rank, tp.size) == (None, 0, 1)
        assert get_tp_group() is tp and get_tp_rank() == 0 and get_tp_size() == 1
        assert init_tensor_parallel(1) is tp  # a compatible request returns the same group
        with pytest.raises(RuntimeError, match="already initialised with tp_size=1"):
            init_tensor_parallel(2)
        assert ColumnParallelLinear(8, 8).tp_group is tp
    finally:
        destroy_tensor_parallel()
    _assert_not_initialised()
    destroy_tensor_parallel()  # a no-op when there is nothing to destroy
    assert not dist.is_initialized()


@needs_plain_process
def test_bad_arguments_change_nothing() -> None:
    with pytest.raises(ValueError, match="torchrun --nproc-per-node 2"):
        init_tensor_parallel(2)
    with pytest.raises(ValueError, match="tp_size must be a positive int, got 0"):
        init_tensor_parallel(0)
    with pytest.raises(TypeError, match="timeout must be a datetime.timedelta or seconds, got str"):
        init_tensor_parallel(timeout="10")
    with pytest.raises(ValueError, match="timeout must be positive, got -1"):
        init_tensor_parallel(timeout=-1)
    with pytest.raises(TypeError, match="group must be a ProcessGroup or a 1-D DeviceMesh, got object"):
        init_tensor_parallel(group=object())
    _assert_not_initialised()
    with pytest.raises(ValueError, match="rank=2, size=2"):
        TPGroup(None, 2, 2)


@needs_plain_process
def test_torchrun_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """With torchrun's variables set, init creates the default group (gloo here) and destroy removes it."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(multirank.free_port()))
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)
    try:
        tp = init_tensor_parallel(timeout=datetime.timedelta(seconds=20))
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        assert dist.is_initialized() and dist.get_backend() == backend
        assert (tp.rank, tp.size, tp.backend) == (0, 1, backend)
    finally:
        destroy_tensor_parallel()
    assert not dist.is_initialized()


@needs_plain_process
def test_destroy_collects_cycles_before_the_group_goes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dropped model's CUDA graphs can live on in a reference cycle (model and graph hold each other), and a
    live graph that captured NCCL collectives keeps the group's destruction from returning: destroy collects
    such garbage before it destroys the group."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(multirank.free_port()))
    for name, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(name, value)

    class Node:
        partner: Node

    seen_alive: list[bool] = []
    destroy = dist.destroy_process_group

    def recording_destroy(group: dist.ProcessGroup | None = None) -> None:
        seen_alive.append(cycle() is not None)
        destroy(group)

    monkeypatch.setattr(dist, "destroy_process_group", recording_destroy)
    gc_was_enabled = gc.isenabled()
    gc.disable()  # the cycle must not go by an automatic collection
    try:
        init_tensor_parallel(backend="gloo", timeout=datetime.timedelta(seconds=20))
        first, second = Node(), Node()
        first.partner, second.partner = second, first
        cycle = weakref.ref(first)
        del first, second
        assert cycle() is not None
        destroy_tensor_parallel()
    finally:
        if gc_was_enabled:
            gc.enable()
        if dist.is_initialized():
            destroy(None)
    assert seen_alive == [False]
    assert not dist.is_initialized()


@pytest.mark.skipif(multirank.under_torchrun(), reason="spawns its own ranks; once is enough")
def test_example_on_two_ranks() -> None:
    """examples/tp_mlp.py starts 2 CPU ranks with the launcher; they init from torchrun's variables."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "tp_mlp.py"), "--nproc", "2"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rank 1/2: gate_up_proj.weight (688, 256), down_proj.weight (256, 344)" in result.stdout
    assert "output matches the unsharded MLP" in result.stdout


def _group_sum(value: int, tp: TPGroup) -> int:
    tensor = torch.tensor([value], device=multirank.device())
    dist.all_reduce(tensor, group=tp.group)
    return int(tensor.item())


def _check_column_row(tp_group: object, device: torch.device) -> None:
    """A column + row pair on ``tp_group`` matches the unsharded pair."""
    torch.manual_seed(3)
    up, down = nn.Linear(8, 16, device=device), nn.Linear(16, 8, device=device)
    column = ColumnParallelLinear(8, 16, tp_group=tp_group, device=device)
    row = RowParallelLinear(16, 8, tp_group=tp_group, device=device)
    for layer, ref in ((column, up), (row, down)):
        for param, full in ((layer.weight, ref.weight), (layer.bias, ref.bias)):
            param.weight_loader(param, full)
    x = torch.randn(4, 8, device=device)
    torch.testing.assert_close(row(column(x)), down(up(x)), rtol=1e-5, atol=1e-5)


def _check_world_groups(world_size: int) -> None:
    rank = dist.get_rank()
    device = multirank.device()

    tp = init_tensor_parallel()  # the world
    assert (tp.rank, tp.size, tp.group) == (rank, world_size, dist.group.WORLD)
    assert _group_sum(1, tp) == world_size
    with pytest.raises(RuntimeError, match=f"already initialised with tp_size={world_size}"):
        init_tensor_parallel(1)
    destroy_tensor_parallel()
    assert dist.is_initialized()  # the world was not ours to destroy
    _assert_not_initialised()
    with pytest.raises(RuntimeError, match="no tensor-parallel group is chosen"):
        ColumnParallelLinear(8, 8)

    # Blocks of consecutive ranks, a timeout in seconds; destroy removes only the blocks.
    tp = init_tensor_parallel(tp_size=2, timeout=30)
    assert (tp.rank, tp.size) == (rank % 2, 2)
    assert _group_sum(rank, tp) == (rank // 2 * 2) * 2 + 1
    _check_column_row(None, device)
    _check_column_row(dist.group.WORLD, device)  # a second model on another group in the same process
    destroy_tensor_parallel()
    assert dist.is_initialized() and _group_sum(1, TPGroup.from_process_group(dist.group.WORLD)) == world_size
    with pytest.raises(RuntimeError, match="has been destroyed"):
        _ = tp.group

    # A group of the caller's: used, not destroyed.
    mine = dist.new_group(list(range(world_size)))
    tp = init_tensor_parallel(group=mine)
    assert (tp.rank, tp.size) == (rank, world_size)
    _check_column_row(None, device)
    destroy_tensor_parallel()
    assert _group_sum(1, TPGroup.from_process_group(mine)) == world_size
    dist.destroy_process_group(mine)

    with pytest.raises(ValueError, match=f"tp_size=3 must divide the world size {world_size}"):
        init_tensor_parallel(3)
    with pytest.raises(ValueError, match=f"tp_size={2 * world_size} must divide the world size {world_size}"):
        init_tensor_parallel(2 * world_size)
    _assert_not_initialised()

    if world_size == 4:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("dp", "tp"))
        tp = init_tensor_parallel(group=mesh["tp"])
        assert tp.size == 2 and tp.rank == mesh.get_local_rank("tp")
        assert _group_sum(rank, tp) == sum(int(r) for r in mesh.mesh[mesh.get_coordinate()[0]])
        _check_column_row(None, device)
        destroy_tensor_parallel()
        with pytest.raises(ValueError, match="tp_size=4 does not match the size of the given group \\(2\\)"):
            init_tensor_parallel(4, group=mesh["tp"])


@pytest.mark.parametrize("world_size", [2, 4])
def test_in_initialised_world(ranks, world_size: int) -> None:
    ranks.run(world_size, _check_world_groups, world_size)
