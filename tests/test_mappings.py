"""The autograd collectives: forward and backward values at tp_size 1, 2, 4, with every tp_group form."""

from __future__ import annotations

import multirank
import pytest
import torch

from tpkit.parallel_layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    TPGroup,
    copy_to_tp_region,
    gather_from_tp_region,
    init_tensor_parallel,
    reduce_from_tp_region,
    scatter_to_tp_region,
)


def _check_copy_and_reduce(tp: TPGroup, group: object, device: torch.device) -> None:
    r, n = tp.rank, tp.size
    full = torch.randn(3, 5, 8, device=device)  # the same on every rank (same seed)
    per_rank = torch.randn(n, 3, 5, 8, device=device)  # rank r uses per_rank[r]

    # copy: identity forward; backward sums the ranks' gradients
    x = full.clone().requires_grad_()
    y = copy_to_tp_region(x, group)
    torch.testing.assert_close(y, full, rtol=0, atol=0)
    (y * per_rank[r]).sum().backward()
    torch.testing.assert_close(x.grad, per_rank.sum(0))

    # reduce: forward sums the ranks' tensors (into a new tensor); backward is the identity
    x = per_rank[r].clone().requires_grad_()
    y = reduce_from_tp_region(x, group)
    torch.testing.assert_close(y, per_rank.sum(0))
    torch.testing.assert_close(x.detach(), per_rank[r], rtol=0, atol=0)
    (y * full).sum().backward()
    torch.testing.assert_close(x.grad, full, rtol=0, atol=0)

    ints = torch.arange(6, device=device).reshape(2, 3) * (r + 1)
    expected = torch.arange(6, device=device).reshape(2, 3) * (n * (n + 1) // 2)
    torch.testing.assert_close(reduce_from_tp_region(ints, group), expected)


def _check_gather_and_scatter(tp: TPGroup, group: object, device: torch.device) -> None:
    r, n = tp.rank, tp.size
    full = torch.randn(2, 3, 4 * n, device=device)  # [..., 4 * tp_size], the same on every rank
    g = torch.randn_like(full)
    chunk = slice(4 * r, 4 * (r + 1))

    # gather: rank r's [..., 4] lands at columns [4r, 4r + 4); backward keeps this rank's columns
    x = full[..., chunk].clone().requires_grad_()
    y = gather_from_tp_region(x, group)
    torch.testing.assert_close(y, full, rtol=0, atol=0)
    (y * g).sum().backward()
    torch.testing.assert_close(x.grad, g[..., chunk], rtol=0, atol=0)

    # a non-contiguous input gathers the same
    transposed = full.transpose(0, 1).contiguous().transpose(0, 1)[..., chunk]
    assert not transposed.is_contiguous()
    torch.testing.assert_close(gather_from_tp_region(transposed, group), full, rtol=0, atol=0)

    # scatter: forward keeps this rank's columns; backward gathers every rank's gradient
    x = full.clone().requires_grad_()
    y = scatter_to_tp_region(x, group)
    torch.testing.assert_close(y, full[..., chunk], rtol=0, atol=0)
    (y * g[..., chunk]).sum().backward()
    torch.testing.assert_close(x.grad, g, rtol=0, atol=0)

    if n > 1:
        with pytest.raises(ValueError, match=f"last dimension \\({4 * n + 1}\\) must divide by tp_size={n}"):
            scatter_to_tp_region(torch.randn(2, 4 * n + 1, device=device), group)


def _check_mappings(tp_size: int) -> None:
    tp = init_tensor_parallel()
    assert tp.size == tp_size
    device = multirank.device()
    torch.manual_seed(0)
    # tp_group as a TPGroup, a ProcessGroup, and None (the group of init_tensor_parallel)
    for group in (tp, tp.group, None):
        _check_copy_and_reduce(tp, group, device)
        _check_gather_and_scatter(tp, group, device)
    if tp_size == 1:
        x = torch.randn(3, 4, device=device)
        for fn in (copy_to_tp_region, reduce_from_tp_region, gather_from_tp_region, scatter_to_tp_region):
            assert fn(x) is x


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_mappings(ranks, tp_size: int) -> None:
    ranks.run(tp_size, _check_mappings, tp_size)


def _check_compiled_layers(tp_size: int) -> None:
    # The collectives inside tensor-parallel layers (copy to the region, the row-parallel all-reduce, the LM
    # head's gather) through torch.compile(fullgraph=True), which fails on a graph break: training (the
    # autograd functions, gradients through AOTAutograd) and inference (the reduction alone, in place),
    # against the same layers run eagerly. Under torchrun with NCCL, the reduction traced inside its autograd
    # function gave zero gradients to everything before it (torch 2.11).
    init_tensor_parallel()
    device = multirank.device()
    torch.manual_seed(0)
    up = ColumnParallelLinear(16, 32, device=device)
    down = RowParallelLinear(32, 16, device=device)
    head = ParallelLMHead(40, 16, bias=True, device=device)
    params = [*up.parameters(), *down.parameters(), *head.parameters()]
    x = torch.randn(3, 5, 16, device=device)

    def logits(x: torch.Tensor) -> torch.Tensor:
        return head.compute_logits(down(torch.relu(up(x))))  # [3, 5, 40]

    eager_loss = logits(x).square().mean()
    eager_grads = torch.autograd.grad(eager_loss, params)
    compiled = torch.compile(lambda x: logits(x).square().mean(), fullgraph=True, backend="aot_eager")
    loss = compiled(x)
    torch.testing.assert_close(loss, eager_loss)
    torch.testing.assert_close(torch.autograd.grad(loss, params), eager_grads)
    with torch.no_grad():
        expected = logits(x)
        torch.testing.assert_close(torch.compile(logits, fullgraph=True, backend="eager")(x), expected)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_layers_compile_without_graph_breaks(ranks, tp_size: int) -> None:
    ranks.run(tp_size, _check_compiled_layers, tp_size)
