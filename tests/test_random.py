"""Generator states under tensor parallelism (tpkit.parallel_layers.random): one stream on every rank outside
tensor_parallel_rng(), each rank's own inside it, both against generators seeded independently; dropout of
replicated and sharded activations; activation recomputation drawing the same masks; tp_size 1, 2, 4."""

from __future__ import annotations

import re

import multirank
import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from test_linear import gather_ranks

from tpkit.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    checkpoint,
    get_tensor_parallel_rng_state,
    init_tensor_parallel,
    seed_tensor_parallel,
    set_tensor_parallel_rng_state,
    tensor_parallel_rng,
)

SEED = 1234


def _draws(generator: torch.Generator | None, device: torch.device) -> list[torch.Tensor]:
    return [torch.rand(8, generator=generator, device=device) for _ in range(2)]


def _check_streams(tp_size: int) -> None:
    with pytest.raises(RuntimeError, match="seed_tensor_parallel"):  # the worker forgot the last test's seed
        with tensor_parallel_rng():
            pass
    tp = init_tensor_parallel()
    assert tp.size == tp_size
    device = multirank.device()

    # Outside the block the shared stream, as if the block drew nothing; inside it the rank's own.
    seed_tensor_parallel(SEED)
    before = torch.rand(8, device=device)
    with tensor_parallel_rng():
        own = _draws(None, device)
    after = torch.rand(8, device=device)
    shared = torch.Generator(device).manual_seed(SEED)
    torch.testing.assert_close([before, after], _draws(shared, device), rtol=0, atol=0)
    rank_stream = torch.Generator(device).manual_seed(SEED + 2718 + tp.rank)
    torch.testing.assert_close(own, _draws(rank_stream, device), rtol=0, atol=0)

    # A second block continues the rank's stream where the first left it.
    seed_tensor_parallel(SEED)
    with tensor_parallel_rng():
        first = torch.rand(8, device=device)
    with tensor_parallel_rng():
        second = torch.rand(8, device=device)
    rank_stream = torch.Generator(device).manual_seed(SEED + 2718 + tp.rank)
    torch.testing.assert_close([first, second], _draws(rank_stream, device), rtol=0, atol=0)

    # Saved and restored around a block, the block draws the same again (activation recomputation).
    state = get_tensor_parallel_rng_state()
    with tensor_parallel_rng():
        once = torch.rand(8, device=device)
    set_tensor_parallel_rng_state(state)
    with tensor_parallel_rng():
        again = torch.rand(8, device=device)
    torch.testing.assert_close(again, once, rtol=0, atol=0)

    with tensor_parallel_rng(), pytest.raises(RuntimeError, match="nested"):
        with tensor_parallel_rng():
            pass
    with pytest.raises(ValueError, match="state must be a dict"):
        set_tensor_parallel_rng_state({torch.device("meta"): state[next(iter(state))]})

    # Dropout: one mask for a replicated activation, a mask of each rank's own for a sharded one.
    ones = torch.ones(512, device=device)
    replicated = F.dropout(ones, 0.5)
    with tensor_parallel_rng():
        sharded = F.dropout(ones, 0.5)
    for mask in gather_ranks(replicated, tp):
        torch.testing.assert_close(mask, replicated, rtol=0, atol=0)
    masks = gather_ranks(sharded, tp)
    for i in range(tp.size):
        for j in range(i):
            assert not torch.equal(masks[i], masks[j]), (i, j)


def _mlp_block() -> tuple[ColumnParallelLinear, RowParallelLinear, torch.Tensor]:
    """A column- then row-parallel block with the same full weights on every rank, and its input."""
    device = multirank.device()
    weights = torch.Generator().manual_seed(0)
    column = ColumnParallelLinear(16, 32, bias=False, device=device)
    row = RowParallelLinear(32, 16, bias=False, device=device)
    for layer, shape in ((column, (32, 16)), (row, (16, 32))):
        layer.weight.weight_loader(layer.weight, torch.randn(*shape, generator=weights))
    return column, row, torch.randn(4, 16, generator=weights).to(device)


def _dropped(column: ColumnParallelLinear, row: RowParallelLinear, x: torch.Tensor) -> torch.Tensor:
    """Dropout of the column-parallel (sharded) activation in the rank's stream, of the row-parallel
    (replicated) output in the shared one."""
    with tensor_parallel_rng():
        hidden = F.dropout(column(x), 0.5)
    return F.dropout(row(hidden), 0.5)


def _block_outputs(seed: int) -> torch.Tensor:
    column, row, x = _mlp_block()
    seed_tensor_parallel(seed)
    with torch.no_grad():
        return torch.stack(gather_ranks(_dropped(column, row, x), column.tp_group))


def _check_block(tp_size: int) -> None:
    tp = init_tensor_parallel()
    assert tp.size == tp_size
    outputs = _block_outputs(SEED)
    for output in outputs:
        torch.testing.assert_close(output, outputs[0], rtol=0, atol=0)
    if tp.size > 1:
        # A seed that differs from rank to rank (the mistake the shared seed prevents): the copies differ.
        outputs = _block_outputs(SEED + tp.rank)
        assert not torch.equal(outputs[0], outputs[1])


def _step(recompute) -> list[torch.Tensor]:
    """Output and gradients of two dropped-out blocks, the first under `recompute` (or plainly), and the
    rank's stream after the backward."""
    column, row, x = _mlp_block()
    x.requires_grad_(True)
    seed_tensor_parallel(SEED)
    first = recompute(_dropped, column, row, x) if recompute else _dropped(column, row, x)
    out = _dropped(column, row, first)  # draws after the first block's: the recompute must not disturb them
    out.square().sum().backward()
    with tensor_parallel_rng():  # the rank's stream goes on after the backward as if nothing was recomputed
        after = torch.rand(8, device=x.device)
    return [out.detach(), x.grad, column.weight.grad, row.weight.grad, after]


def _check_recompute(tp_size: int) -> None:
    tp = init_tensor_parallel()
    assert tp.size == tp_size
    plain = _step(None)
    torch.testing.assert_close(_step(checkpoint), plain, rtol=0, atol=0)
    # torch's own checkpoint restores the shared generators only: the sharded masks are drawn anew.
    torch_only = _step(lambda fn, *args: torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False))
    torch.testing.assert_close(torch_only[0], plain[0], rtol=0, atol=0)
    assert not torch.equal(torch_only[1], plain[1])


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_streams_across_ranks(ranks, tp_size: int) -> None:
    ranks.run(tp_size, _check_streams, tp_size)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_replicated_output_agrees_across_ranks(ranks, tp_size: int) -> None:
    ranks.run(tp_size, _check_block, tp_size)


@pytest.mark.parametrize("seed", [-1, 1.5, True, "7"])
def test_seed_must_be_a_non_negative_int(seed) -> None:
    with pytest.raises(ValueError, match=re.escape(f"seed must be a non-negative int, received {seed!r}")):
        seed_tensor_parallel(seed)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_recompute_draws_the_same_masks(ranks, tp_size: int) -> None:
    ranks.run(tp_size, _check_recompute, tp_size)
