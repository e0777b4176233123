"""Sequence parallelism: the three mappings against their definitions, and a LayerNorm -> column-parallel ->
GELU -> row-parallel block with a residual, its activations split along the sequence, against the same
block unsharded (forward, every gradient, the whole gradient's norm), eager at tp_size 2 and 4 and compiled
at 2 (tp_size 4 traces the same code with other shapes), for ``[batch, seq, hidden]`` and
``[tokens, hidden]``."""

from __future__ import annotations

import multirank
import pytest
import torch
import torch.nn.functional as F
from test_linear import gather_ranks
from torch import nn

from tpkit.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    clip_grad_norm_,
    gather_from_sequence_parallel_region,
    init_tensor_parallel,
    mark_sequence_parallel,
    reduce_scatter_to_sequence_parallel_region,
    reduce_sequence_parallel_grads,
    scatter_to_sequence_parallel_region,
)

HIDDEN, FFN = 8, 16
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _per_rank(shape: tuple[int, ...], tp: TPGroup, seed: int) -> list[torch.Tensor]:
    """Every rank's tensor, drawn alike in every process: rank r's from seed + r."""
    return [torch.randn(shape, generator=torch.Generator().manual_seed(seed + r)) for r in range(tp.size)]


def _check_mappings(tp_size: int, dim: int) -> None:
    tp = init_tensor_parallel(tp_size)
    device = multirank.device()
    full = (2, 4 * tp_size, 3) if dim == -2 else (4 * tp_size, 3)  # the sequence dim: 4 tokens a rank
    seq = dim % len(full)
    chunk = full[seq] // tp_size

    def mine(tensor: torch.Tensor, rank: int = tp.rank) -> torch.Tensor:
        return tensor.narrow(seq, rank * chunk, chunk)

    # scatter: this rank's chunk; backward: every rank's upstream gradient, gathered
    x = torch.randn(full, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_()
    upstream = [u.to(device) for u in _per_rank(mine(torch.empty(full)).shape, tp, 10)]
    out = scatter_to_sequence_parallel_region(x, dim=dim)
    torch.testing.assert_close(out, mine(x.detach()), rtol=0, atol=0)
    out.backward(upstream[tp.rank])
    torch.testing.assert_close(x.grad, torch.cat(upstream, seq), rtol=0, atol=0)

    # gather: every rank's chunk in rank order; backward: the ranks' upstream gradients summed, this rank's
    # chunk of the sum (partial_grad), or this rank's own chunk
    chunks = [c.to(device) for c in _per_rank(mine(torch.empty(full)).shape, tp, 20)]
    upstream = [u.to(device) for u in _per_rank(full, tp, 30)]
    for partial_grad in (True, False):
        own = chunks[tp.rank].clone().requires_grad_()
        out = gather_from_sequence_parallel_region(own, dim=dim, partial_grad=partial_grad)
        torch.testing.assert_close(out, torch.cat(chunks, seq), rtol=0, atol=0)
        out.backward(upstream[tp.rank])
        expected = mine(sum(upstream)) if partial_grad else mine(upstream[tp.rank])
        torch.testing.assert_close(own.grad, expected, **TOL)

    # reduce-scatter: this rank's chunk of the ranks' tensors summed; backward: the upstream gradients,
    # gathered
    partials = [p.to(device) for p in _per_rank(full, tp, 40)]
    upstream = [u.to(device) for u in _per_rank(mine(torch.empty(full)).shape, tp, 50)]
    own = partials[tp.rank].clone().requires_grad_()
    out = reduce_scatter_to_sequence_parallel_region(own, dim=dim)
    torch.testing.assert_close(out, mine(sum(partials)), **TOL)
    out.backward(upstream[tp.rank])
    torch.testing.assert_close(own.grad, torch.cat(upstream, seq), rtol=0, atol=0)

    with pytest.raises(ValueError, match=r"sequence dimension \(5\) must divide by tp_size"):
        scatter_to_sequence_parallel_region(torch.zeros(5, 3, device=device), dim=0)


def _check_embedding(tp_size: int) -> None:
    """VocabParallelEmbedding(sequence_parallel=True): this rank's tokens of nn.Embedding's output, and
    the gradient of its vocabulary rows from every token."""
    tp = init_tensor_parallel(tp_size)
    device = multirank.device()
    torch.manual_seed(0)
    reference = nn.Embedding(50, HIDDEN).to(device)
    ids = torch.randint(0, 50, (2, 4 * tp_size), device=device)
    upstream = torch.randn(2, 4 * tp_size, HIDDEN, device=device)
    (reference(ids) * upstream).sum().backward()
    embedding = VocabParallelEmbedding(50, HIDDEN, sequence_parallel=True, device=device)
    embedding.weight.weight_loader(embedding.weight, reference.weight.detach())
    out = embedding(ids)  # [2, 4, HIDDEN]
    mine = slice(4 * tp.rank, 4 * tp.rank + 4)
    torch.testing.assert_close(out, reference(ids).detach()[:, mine], **TOL)
    (out * upstream[:, mine]).sum().backward()
    start, end = embedding.vocab_start_index, min(embedding.vocab_end_index, 50)  # rows past 50: padding
    torch.testing.assert_close(embedding.weight.grad[: end - start], reference.weight.grad[start:end], **TOL)


class _Block(nn.Module):
    """x + fc2(gelu(fc1(norm(x)))): in the sequence-parallel form, x and the output are a rank's tokens."""

    def __init__(self, fc1: nn.Module, fc2: nn.Module, norm: nn.Module) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = norm, fc1, fc2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


def _check_block(tp_size: int, shape: tuple[int, ...], compiled: bool) -> None:
    tp = init_tensor_parallel(tp_size)
    device = multirank.device()
    torch.manual_seed(0)  # the same reference block and data on every rank
    reference = _Block(nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN), nn.LayerNorm(HIDDEN)).to(device)
    with torch.no_grad():  # LayerNorm starts at 1 and 0, where a wrong gradient could still look right
        reference.norm.weight.normal_(1.0, 0.2)
        reference.norm.bias.normal_(0.0, 0.2)
    x = torch.randn(shape, device=device, requires_grad=True)
    upstream = torch.randn(shape, device=device)
    (reference(x) * upstream).sum().backward()

    norm = nn.LayerNorm(HIDDEN).to(device)
    block = _Block(ColumnParallelLinear(HIDDEN, FFN, sequence_parallel=True, device=device),
                   RowParallelLinear(FFN, HIDDEN, sequence_parallel=True, device=device), norm)
    for name, param in block.named_parameters():
        loader = getattr(param, "weight_loader", None)
        source = reference.get_parameter(name).detach()
        if loader is None:
            param.data.copy_(source)
        else:
            loader(param, source)
    mark_sequence_parallel(norm)
    run = torch.compile(block, backend="aot_eager", fullgraph=True) if compiled else block

    seq = len(shape) - 2
    chunk = shape[seq] // tp.size
    mine = x.detach().narrow(seq, tp.rank * chunk, chunk).clone().requires_grad_()
    out = run(mine)  # [..., seq / tp_size, hidden]
    torch.testing.assert_close(torch.cat(gather_ranks(out.detach(), tp), seq), reference(x).detach(), **TOL)
    (out * upstream.narrow(seq, tp.rank * chunk, chunk)).sum().backward()
    torch.testing.assert_close(mine.grad, x.grad.narrow(seq, tp.rank * chunk, chunk), **TOL)
    shard = slice(tp.rank * FFN // tp.size, (tp.rank + 1) * FFN // tp.size)  # fc1's rows, fc2's columns
    torch.testing.assert_close(block.fc1.weight.grad, reference.fc1.weight.grad[shard], **TOL)
    torch.testing.assert_close(block.fc1.bias.grad, reference.fc1.bias.grad[shard], **TOL)
    torch.testing.assert_close(block.fc2.weight.grad, reference.fc2.weight.grad[:, shard], **TOL)
    # The norm and fc2's bias have seen this rank's tokens only, until their gradients are summed.
    assert not torch.allclose(norm.weight.grad, reference.norm.weight.grad, **TOL)
    assert reduce_sequence_parallel_grads(block) == 3
    for name in ("norm.weight", "norm.bias", "fc2.bias"):
        torch.testing.assert_close(block.get_parameter(name).grad, reference.get_parameter(name).grad, **TOL,
                                   msg=lambda m, name=name: f"{name}: {m}")
    expected_norm = torch.cat([p.grad.flatten() for p in reference.parameters()]).norm()
    torch.testing.assert_close(clip_grad_norm_(block, 1e9).cpu(), expected_norm.cpu(), **TOL)


@pytest.mark.parametrize("dim", [-2, 0], ids=["batch_seq_hidden", "tokens_hidden"])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_sequence_parallel_mappings(ranks, tp_size: int, dim: int) -> None:
    ranks.run(tp_size, _check_mappings, tp_size, dim)


@pytest.mark.parametrize("shape", [(2, 8, HIDDEN), (8, HIDDEN)], ids=["batch_seq_hidden", "tokens_hidden"])
@pytest.mark.parametrize(("tp_size", "compiled"), [(2, False), (2, True), (4, False)],
                         ids=["2-eager", "2-compiled", "4-eager"])
def test_sequence_parallel_block_matches_unsharded(ranks, tp_size: int, shape: tuple[int, ...],
                                                    compiled: bool) -> None:
    ranks.run(tp_size, _check_block, tp_size, shape, compiled, timeout=240)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_sequence_parallel_embedding(ranks, tp_size: int) -> None:
    ranks.run(tp_size, _check_embedding, tp_size)


def test_sequence_parallel_rejects_bad_arguments() -> None:
    one_rank = TPGroup(None, 0, 1)  # under torchrun too, where a layer without a group is refused
    with pytest.raises(ValueError, match="expected gather_output=False, received True"):
        ColumnParallelLinear(HIDDEN, FFN, gather_output=True, sequence_parallel=True, tp_group=one_rank)
    with pytest.raises(ValueError, match="expected input_is_parallel=True and reduce_results=True, received "
                                         "False and True"):
        RowParallelLinear(FFN, HIDDEN, input_is_parallel=False, sequence_parallel=True, tp_group=one_rank)
    with pytest.raises(TypeError, match="expected nn.Module arguments, received Parameter"):
        mark_sequence_parallel(nn.Parameter(torch.zeros(2)))
