"""Every launch plan of the paged-attention planner against the launch limits of the device it runs on.

Skipped without a GPU (the plans and the limits are the device's), and no kernel runs: planning reads the
shapes alone, so the tensors handed to it are expanded (stride 0) views of one element, whatever their
size. The limits come from the CUDA runtime directly (``_extension.device_limits``), not through the
planner's own queries. Shapes: every dtype, head size and block size with every group size from 1 to 64
(and two larger ones), each with a few (num_seqs, context) pairs drawn from 1 to 65535 sequences and
contexts from one token to 2**20, each also with several query tokens a sequence (``query_start_loc``, from
one token to 2**20 in all), plus the shapes of one long sequence on one KV head that once planned a cluster
of 228 blocks.
"""

from __future__ import annotations

import random

import pytest
import torch

from tpkit.ops import _extension

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
HEAD_SIZES = (32, 64, 80, 96, 112, 120, 128, 192, 256)
BLOCK_SIZES = (8, 16, 32)
GROUP_SIZES = (*range(1, 65), 100, 128)
KV_HEADS = (1, 2, 3, 4, 8, 16)
PLAN_TILE = 64  # tokens: a partition is whole tiles of every kernel
MAX_PARTITIONS = 256
PORTABLE_CLUSTER_SIZE = 8


def _plan(dtype: torch.dtype, head_size: int, block_size: int, num_heads: int, num_kv_heads: int,
          num_seqs: int, max_blocks_per_seq: int, num_tokens: int | None = None) -> dict[str, int]:
    """The plan of a decode step, or with ``num_tokens`` of a step of that many query tokens."""
    dev = torch.device("cuda")
    one = torch.empty((), dtype=dtype, device=dev)
    one_int = torch.empty((), dtype=torch.int32, device=dev)
    rows = num_seqs if num_tokens is None else num_tokens
    query = one.expand(rows, num_heads, head_size)  # [num_seqs or num_tokens, num_heads, head_size]
    key_cache = one.expand(1, block_size, num_kv_heads, head_size)  # [num_blocks, block_size, ...]
    block_tables = one_int.expand(num_seqs, max_blocks_per_seq)
    query_start_loc = None if num_tokens is None else one_int.expand(num_seqs + 1)
    plan = _extension.launch_plan(query, key_cache, block_tables, query_start_loc)
    assert plan is not None, "the CUDA extension did not build"
    return plan


def _check_plan(plan: dict[str, int], limits: dict[str, int], dtype: torch.dtype, num_heads: int,
                num_kv_heads: int, num_seqs: int, capacity: int, num_tokens: int | None = None) -> None:
    """The plan launches on this device and covers the shape: raises AssertionError naming what does not."""
    group = num_heads // num_kv_heads
    where = (f"{dtype} Hq={num_heads} Hkv={num_kv_heads} seqs={num_seqs} tokens={num_tokens} "
             f"capacity={capacity}: {plan}")
    parts, size = plan["num_partitions"], plan["partition_size"]
    grid = (plan["grid_x"], plan["grid_y"], plan["grid_z"])
    tile_tokens = plan["tile_tokens"]
    if num_tokens is None:
        rows, work_tiles = num_seqs, num_seqs
        assert tile_tokens == 1, where
    else:
        # Every way of spreading num_tokens over num_seqs sequences has at most this many work tiles.
        rows, busy = num_tokens, min(num_seqs, num_tokens)
        work_tiles = (num_tokens + busy * (tile_tokens - 1)) // tile_tokens
        assert tile_tokens >= 1 and (tile_tokens == 1 or tile_tokens * group <= plan["rows_per_cta"]), where
        assert plan["cluster_merge"] == 0, where
    assert plan["num_work_tiles"] == work_tiles, where
    if num_tokens is None:
        assert grid == (num_kv_heads * plan["m_groups"], parts, num_seqs), where
    else:  # every work tile's blocks along x
        assert grid == (work_tiles * num_kv_heads * plan["m_groups"], parts, 1), where
    assert grid[0] <= limits["max_grid_x"] and grid[1] <= limits["max_grid_y"], where
    assert grid[2] <= limits["max_grid_z"], where
    assert 1 <= parts <= MAX_PARTITIONS and size > 0 and size % PLAN_TILE == 0, where
    # The partitions cover the table, none of them past its end.
    assert parts * size >= capacity and (parts - 1) * size < max(capacity, 1), where
    assert plan["m_groups"] * plan["rows_per_cta"] >= group, where
    assert plan["threads"] % 32 == 0 and 32 <= plan["threads"] <= limits["max_threads_per_block"], where
    assert 0 <= plan["smem_bytes"] <= limits["max_smem_per_block_optin"], where
    assert 1 <= plan["num_stages"] <= 4, where
    if plan["cluster_merge"]:
        # Clusters along y, as many blocks as partitions: the device must launch them.
        assert limits["cluster_launch"] == 1 and limits["major"] >= 9, where
        assert 2 <= plan["cluster_size"] <= PORTABLE_CLUSTER_SIZE, where
        assert plan["cluster_size"] == parts and grid[1] % plan["cluster_size"] == 0, where
    else:
        assert plan["cluster_size"] == 1, where
        if parts > 1:
            assert rows <= limits["max_grid_y"], where  # the merge kernel's grid: (heads, query rows)
    if plan["wgmma"]:
        assert (limits["major"], limits["minor"]) == (9, 0) and dtype != torch.float32, where
    assert plan["warpgroups"] in (1, 2) and (plan["warpgroups"] == 1 or plan["wgmma"]), where


def _shapes() -> list[tuple]:
    """(dtype, head_size, block_size, num_heads, num_kv_heads, num_seqs, max_blocks_per_seq, num_tokens or
    None), seeded."""
    rng = random.Random(0)
    shapes = []
    for dtype in DTYPES:
        for head_size in HEAD_SIZES:
            for block_size in BLOCK_SIZES:
                for group in GROUP_SIZES:
                    for _ in range(3):
                        num_kv_heads = rng.choice(KV_HEADS)
                        num_seqs = min(65535, round(2 ** rng.uniform(0, 16)))
                        context = round(2 ** rng.uniform(0, 20))
                        width = -(-context // block_size) + rng.choice((0, 0, 1, 3))
                        shape = (dtype, head_size, block_size, group * num_kv_heads, num_kv_heads, num_seqs,
                                 width)
                        shapes.append((*shape, None))
                        shapes.append((*shape, round(2 ** rng.uniform(0, 20))))
    # One sequence of 131072 tokens on one KV head (and its neighbours): plans of hundreds of partitions.
    for tokens in (65536, 131072, 131072 + 64, 262144, 1 << 20):
        for num_heads in (4, 8, 16, 48, 64):
            for num_seqs in (1, 2, 3):
                shapes.append((torch.bfloat16, 128, 16, num_heads, 1, num_seqs, tokens // 16, None))
                shapes.append((torch.float16, 120, 32, num_heads, 1, num_seqs, tokens // 32, None))
                shapes.append((torch.bfloat16, 128, 16, num_heads, 1, num_seqs, tokens // 16, 4 * num_seqs))
    return shapes


def test_every_plan_launches_on_this_device() -> None:
    limits = _extension.device_limits(torch.device("cuda"))
    assert limits is not None, "the CUDA extension did not build"
    failures = []
    for dtype, head_size, block_size, num_heads, num_kv_heads, num_seqs, width, num_tokens in _shapes():
        try:
            plan = _plan(dtype, head_size, block_size, num_heads, num_kv_heads, num_seqs, width, num_tokens)
            _check_plan(plan, limits, dtype, num_heads, num_kv_heads, num_seqs, width * block_size,
                        num_tokens)
        except (AssertionError, RuntimeError) as exc:  # RuntimeError: the planner refused the shape
            failures.append(f"head {head_size} block {block_size} {type(exc).__name__}: {exc}")
    assert not failures, (f"{len(failures)} plans break the device's limits, e.g.:\n"
                          + "\n".join(failures[:10]))


@pytest.mark.parametrize("num_heads", [4, 8, 48])
def test_one_long_sequence_on_one_kv_head_plans_a_launchable_cluster(num_heads: int) -> None:
    """131072 tokens, one KV head (Llama-3-70B's 8 query heads at tp_size 8; 4 and 48 too): hundreds of
    partitions, merged by the merge kernel; a cluster merge only of at most the portable cluster size."""
    plan = _plan(torch.bfloat16, 128, 16, num_heads, 1, 1, 131072 // 16)
    assert plan["num_partitions"] > PORTABLE_CLUSTER_SIZE, plan
    assert plan["cluster_merge"] == 0 and plan["cluster_size"] == 1, plan


def test_plans_are_a_function_of_the_shapes() -> None:
    """The same shapes plan the same way every time (what CUDA graphs and eager steps rely on)."""
    shapes = random.Random(1).sample(_shapes(), 200)
    first = [_plan(*shape) for shape in shapes]
    assert [_plan(*shape) for shape in reversed(shapes)] == first[::-1]
