"""tpkit.parallel_layers.launch: results by rank, failures named by rank, hangs and crashes in seconds."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from multirank import under_torchrun

from tpkit.parallel_layers import RankError, RankPool, init_tensor_parallel, launch

pytestmark = pytest.mark.skipif(under_torchrun(), reason="starts its own CPU ranks; once is enough")


def _rank_sum(offset: int, scale: float = 1.0) -> tuple[int, str, float]:
    tp = init_tensor_parallel()
    value = torch.tensor([(tp.rank + offset) * scale])
    dist.all_reduce(value, group=tp.group)
    environment = f"{os.environ['RANK']}/{os.environ['WORLD_SIZE']}@{os.environ['MASTER_ADDR']}"
    return tp.rank, environment, value.item()


def _fail_on(rank: int) -> int:
    if dist.get_rank() == rank:
        raise ValueError(f"rank {rank} refuses")
    return dist.get_rank()


def _barrier_on_rank_0_only() -> None:
    if dist.get_rank() == 0:
        dist.barrier()


def _exit_on(rank: int) -> None:
    if dist.get_rank() == rank:
        os._exit(3)
    time.sleep(60)


def test_launch_returns_every_ranks_result_in_rank_order():
    offset, scale = 3, 0.5
    results = launch(_rank_sum, 2, offset, scale=scale)
    total = sum((rank + offset) * scale for rank in range(2))
    assert results == [(0, "0/2@127.0.0.1", total), (1, "1/2@127.0.0.1", total)]


def test_a_failure_names_its_rank_with_the_traceback():
    with pytest.raises(RankError, match=r"_fail_on failed on rank\(s\) 1:") as error:
        launch(_fail_on, 2, 1)
    assert list(error.value.failures) == [1] and "ValueError: rank 1 refuses" in error.value.failures[1]


def test_a_hung_collective_fails_in_seconds():
    start = time.monotonic()
    with pytest.raises(RankError, match=r"rank\(s\) 0:") as error:
        launch(_barrier_on_rank_0_only, 2, collective_timeout=2)  # rank 1 never joins rank 0's barrier
    assert list(error.value.failures) == [0]
    assert time.monotonic() - start < 50


def test_a_pool_runs_many_calls_until_one_outlasts_its_timeout():
    with RankPool(2) as pool:
        assert [rank for rank, _, _ in pool.run(_rank_sum, 0)] == [0, 1]
        assert pool.run(_rank_sum, 1)[1][2] == 3.0  # the same ranks again
        with pytest.raises(TimeoutError, match="within 1 s"):
            pool.run(time.sleep, 60, timeout=1)
        assert not pool.alive()
        with pytest.raises(RuntimeError, match="ranks are gone"):
            pool.run(_rank_sum, 0)


def test_a_rank_that_dies_fails_the_call_with_its_exit_code():
    start = time.monotonic()
    with pytest.raises(RankError, match=r"(?s)rank\(s\) 1:.*exit code 3") as error:
        launch(_exit_on, 2, 1)
    assert list(error.value.failures) == [1]
    assert time.monotonic() - start < 50  # not the 60 s rank 0 sleeps


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"world_size": 0}, "world_size must be a positive int, got 0"),
    ({"world_size": 2, "backend": "mpi"}, r"backend must be one of \('gloo', 'nccl'\), got 'mpi'"),
    ({"world_size": 2, "collective_timeout": 0}, "collective_timeout must be positive seconds, got 0"),
    pytest.param({"world_size": torch.cuda.device_count() + 1, "backend": "nccl"}, "needs as many GPUs",
                 id="nccl-without-enough-gpus"),
])
def test_bad_arguments_raise_before_any_rank_starts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RankPool(**kwargs)
