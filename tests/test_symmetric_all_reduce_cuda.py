"""The one-shot all-reduce over symmetric memory (``tpkit.parallel_layers.symmetric_memory``), as
``reduce_from_tp_region`` runs it for decode-sized CUDA tensors: the sums of random tensors of every
dtype it takes against the sums computed here, eagerly and replayed from a CUDA graph, and the messages it
leaves to the process group's all-reduce (too large, a size that is not a multiple of 4 bytes, integers).

The ranks are CUDA processes of a gloo world, rank r on GPU r modulo the GPUs there are. With a GPU a rank
the one-shot kernel takes the small messages; on a machine of one GPU both ranks share it, which symmetric
memory cannot map, so every message must go to the group's all-reduce, with the same sums. Under
``torchrun`` with NCCL the same checks run on the launched ranks.
"""

from __future__ import annotations

import multirank
import pytest
import torch

from tpkit.parallel_layers import (
    ONE_SHOT_MAX_BYTES,
    get_tp_group,
    init_tensor_parallel,
    one_shot_all_reduce,
    reduce_from_tp_region,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

_ranks = multirank.Ranks()


def teardown_module() -> None:
    _ranks.close()


# (shape, dtype, the input's offset in elements into its storage, whether the one-shot kernel takes it)
_CASES = [
    ((1, 4096), torch.bfloat16, 0, True),
    ((8, 4096), torch.bfloat16, 0, True),
    ((32, 4096), torch.bfloat16, 0, True),  # ONE_SHOT_MAX_BYTES exactly
    ((3, 5, 6), torch.float32, 0, True),
    ((7, 1000), torch.float32, 4, True),  # 16 bytes in: vectors of 16 bytes
    ((6, 10), torch.bfloat16, 4, True),  # 120 bytes: vectors of 8, from 8 bytes in
    ((2, 8), torch.bfloat16, 2, False),  # 32 bytes: vectors of 16, from 4 bytes in
    ((33, 4096), torch.bfloat16, 0, False),  # over ONE_SHOT_MAX_BYTES
    ((1, 7), torch.bfloat16, 0, False),  # 14 bytes
    ((3, 5, 6), torch.float16, 0, False),  # the kernel has no float16
    ((4, 9), torch.int64, 0, False),
]


def _inputs(world: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Every rank's input, ``[world, *shape]``, the same on every rank (seeded)."""
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, (world, *shape), generator=generator)
    return torch.randn(world, *shape, generator=generator).to(dtype)


def _expected(inputs: torch.Tensor) -> torch.Tensor:
    return inputs.sum(0) if inputs.dtype == torch.int64 else inputs.double().sum(0).to(inputs.dtype)


def _own_gpus() -> bool:
    """Whether every rank has a GPU of its own."""
    return torch.cuda.device_count() >= get_tp_group().size


def _check_sums() -> None:
    tp = get_tp_group()
    device = torch.device("cuda", tp.rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    assert ONE_SHOT_MAX_BYTES == 32 * 4096 * 2
    for seed, (shape, dtype, offset, one_shot) in enumerate(_CASES):
        inputs = _inputs(tp.size, shape, dtype, seed)
        storage = torch.zeros(offset + inputs[tp.rank].numel(), dtype=dtype, device=device)
        mine = storage[offset:].view(shape)
        mine.copy_(inputs[tp.rank])
        taken = one_shot_all_reduce(mine, tp.group)
        assert (taken is not None) == (one_shot and _own_gpus()), (shape, dtype, offset)
        out = reduce_from_tp_region(mine, tp)
        assert out.shape == shape and out.dtype == dtype
        # Two ranks: one rounding of the exact sum, whatever the kernel; more: a rounding a rank.
        tolerance = 0 if tp.size == 2 or dtype == torch.int64 else 4 * torch.finfo(dtype).eps
        torch.testing.assert_close(out.cpu(), _expected(inputs), rtol=tolerance, atol=tolerance)
        if taken is not None:
            torch.testing.assert_close(taken.cpu(), out.cpu(), rtol=0, atol=0)
        torch.testing.assert_close(mine.cpu(), inputs[tp.rank], rtol=0, atol=0)  # the input is kept


def _check_graph() -> None:
    """Three all-reduces captured in one graph (after the eager warm-up that makes the buffer), replayed
    on new inputs: each replay's sums are those of its inputs."""
    tp = get_tp_group()
    device = torch.device("cuda", tp.rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    shapes = [(1, 4096), (8, 4096), (8, 1024)]
    static = [torch.zeros(shape, dtype=torch.bfloat16, device=device) for shape in shapes]
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for x in static:
            reduce_from_tp_region(x, tp)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        outs = [reduce_from_tp_region(x, tp) for x in static]
    for replay in range(3):
        inputs = [_inputs(tp.size, shape, torch.bfloat16, 100 + 10 * replay + i)
                  for i, shape in enumerate(shapes)]
        for x, value in zip(static, inputs, strict=True):
            x.copy_(value[tp.rank])
        graph.replay()
        torch.cuda.synchronize(device)
        for out, value in zip(outs, inputs, strict=True):
            tolerance = 0 if tp.size == 2 else 4 * torch.finfo(torch.bfloat16).eps
            torch.testing.assert_close(out.cpu(), _expected(value), rtol=tolerance, atol=tolerance)


def _run(check: str) -> None:
    init_tensor_parallel(tp_size=2)
    {"sums": _check_sums, "graph": _check_graph}[check]()


@pytest.mark.parametrize("check", ["sums", "graph"])
def test_one_shot_all_reduce(check: str) -> None:
    _ranks.run(2, _run, check, timeout=180)
