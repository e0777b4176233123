"""Sequence parallelism's collectives overlapped with the products (``tpkit.parallel_layers.overlap``).

The two ring collective matmuls against the unsharded product (every rank's weight shard and every token on
one rank, through autograd), then each overlapped layer (column, merged, QKV, row) against the same layer
without overlap: output and every gradient, in float64, at tp_size 2 and 4, with 3 tokens a rank (odd, so
that a chunk boundary off by one shows), for ``[batch, seq, hidden]`` and ``[tokens, hidden]``. A small
Llama built with and without ``from_pretrained(..., overlap_communication=True)`` (which switches every
sequence-parallel layer with ``set_overlap_communication``): the same loss and gradients. Bad flag
combinations raise.
"""

from __future__ import annotations

import multirank
import pytest
import torch
import torch.nn.functional as F
from checkpoints import make_llama_checkpoint, random_token_ids
from torch import nn

from tpkit.models import from_pretrained
from tpkit.parallel_layers import (
    ColumnParallelLinear,
    Fp8LinearMethod,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    TPGroup,
    all_gather_matmul,
    init_tensor_parallel,
    matmul_reduce_scatter,
    set_overlap_communication,
)

TOKENS = 3  # a rank's tokens
TOL = {"rtol": 1e-10, "atol": 1e-10}  # float64, sums in another order


def _draw(shape: tuple[int, ...], seed: int, device: torch.device) -> torch.Tensor:
    """The same on every rank."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(device)


def _mine(tensor: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return tensor.narrow(-2, tp.rank * TOKENS, TOKENS)


def _check_ring_matmuls(tp_size: int, batch: tuple[int, ...]) -> None:
    tp = init_tensor_parallel(tp_size)
    device = multirank.device()
    seq = TOKENS * tp.size
    x = _draw((*batch, seq, 5), 1, device)  # every rank's tokens
    weights = _draw((tp.size, 6, 5), 2, device)  # every rank's column-parallel shard
    biases = _draw((tp.size, 6), 3, device)
    upstream = _draw((tp.size, *batch, seq, 6), 4, device)

    # all_gather_matmul: F.linear of every token by this rank's shard; backward: the input's gradient summed
    # over the ranks' shards, this rank's tokens of it
    full = x.clone().requires_grad_()
    shards = weights.clone().requires_grad_()
    bias_shards = biases.clone().requires_grad_()
    sum(F.linear(full, shards[r], bias_shards[r]).mul(upstream[r]).sum() for r in range(tp.size)).backward()
    mine = _mine(x, tp).clone().requires_grad_()
    weight = weights[tp.rank].clone().requires_grad_()
    bias = biases[tp.rank].clone().requires_grad_()
    out = all_gather_matmul(mine, weight, bias, tp)
    torch.testing.assert_close(out, F.linear(x, weights[tp.rank], biases[tp.rank]), **TOL)
    out.mul(upstream[tp.rank]).sum().backward()
    torch.testing.assert_close(mine.grad, _mine(full.grad, tp), **TOL)
    torch.testing.assert_close(weight.grad, shards.grad[tp.rank], **TOL)
    torch.testing.assert_close(bias.grad, bias_shards.grad[tp.rank], **TOL)

    # matmul_reduce_scatter: this rank's tokens of the products of every rank's input columns by its shard,
    # summed; backward: the gradients of every rank's tokens
    inputs = _draw((tp.size, *batch, seq, 4), 5, device)  # every rank's input columns
    row_weights = _draw((tp.size, 7, 4), 6, device)
    upstream = _draw((*batch, seq, 7), 7, device)
    inputs_ref = inputs.clone().requires_grad_()
    row_ref = row_weights.clone().requires_grad_()
    reference = sum(F.linear(inputs_ref[r], row_ref[r]) for r in range(tp.size))
    reference.mul(upstream).sum().backward()
    own = inputs[tp.rank].clone().requires_grad_()
    weight = row_weights[tp.rank].clone().requires_grad_()
    out = matmul_reduce_scatter(own, weight, tp)
    torch.testing.assert_close(out, _mine(reference.detach(), tp), **TOL)
    out.mul(_mine(upstream, tp)).sum().backward()
    torch.testing.assert_close(own.grad, inputs_ref.grad[tp.rank], **TOL)
    torch.testing.assert_close(weight.grad, row_ref.grad[tp.rank], **TOL)

    with pytest.raises(ValueError, match=rf"sequence dimension \(5\) must divide by tp_size={tp.size}"):
        matmul_reduce_scatter(torch.zeros(5, 4, device=device), weight.detach(), tp)


def _layer_pair(kind: str, device: torch.device) -> tuple[nn.Module, nn.Module]:
    """The layer without and with overlap, holding the same weights."""
    build = {
        "column": lambda **kw: ColumnParallelLinear(8, 12, **kw),
        "merged": lambda **kw: MergedColumnParallelLinear(8, [8, 4], **kw),
        "qkv": lambda **kw: QKVParallelLinear(8, 2, 4, 2, **kw),
        "row": lambda **kw: RowParallelLinear(8, 6, **kw),
    }[kind]
    factory = {"sequence_parallel": True, "params_dtype": torch.float64, "device": device}
    torch.manual_seed(0)
    plain = build(**factory)
    overlapped = build(**factory, overlap_communication=True)
    overlapped.load_state_dict(plain.state_dict())
    return plain, overlapped


def _graph_nodes(tensor: torch.Tensor) -> set[str]:
    """The names of the autograd nodes ``tensor`` was computed through."""
    seen, todo = set(), [tensor.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            todo.extend(next_node for next_node, _ in node.next_functions)
    return {type(node).__name__ for node in seen}


def _check_layers(tp_size: int, batch: tuple[int, ...]) -> None:
    tp = init_tensor_parallel(tp_size)
    device = multirank.device()
    for kind in ("column", "merged", "qkv", "row"):
        plain, overlapped = _layer_pair(kind, device)
        # The row-parallel layer takes every token of this rank's input columns, the others a rank's tokens.
        tokens = TOKENS * tp.size if kind == "row" else TOKENS
        width = plain.input_size_per_partition
        x = _draw((*batch, tokens, width), 10 + tp.rank, device)
        outputs, grads = [], []
        for layer in (plain, overlapped):
            given = x.clone().requires_grad_()
            out = layer(given)
            ring = "_MatmulReduceScatterBackward" if kind == "row" else "_AllGatherMatmulBackward"
            assert (ring in _graph_nodes(out)) == layer.overlap_communication, kind
            out.mul(_draw(out.shape, 20 + tp.rank, device)).sum().backward()
            outputs.append(out.detach())
            grads.append((given.grad, layer.weight.grad, layer.bias.grad))
        assert outputs[0].shape[:-1] == (*batch, TOKENS if kind == "row" else TOKENS * tp.size)
        torch.testing.assert_close(outputs[1], outputs[0], **TOL, msg=lambda m, kind=kind: f"{kind}: {m}")
        for name, ours, theirs in zip(("input", "weight", "bias"), grads[1], grads[0], strict=True):
            torch.testing.assert_close(ours, theirs, **TOL,
                                       msg=lambda m, kind=kind, name=name: f"{kind} {name} gradient: {m}")


@pytest.mark.parametrize("batch", [(2,), ()], ids=["batch_seq_hidden", "tokens_hidden"])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_ring_matmuls_match_unsharded(ranks, tp_size: int, batch: tuple[int, ...]) -> None:
    ranks.run(tp_size, _check_ring_matmuls, tp_size, batch)


@pytest.mark.parametrize("batch", [(2,), ()], ids=["batch_seq_hidden", "tokens_hidden"])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_overlapped_layers_match_plain_sequence_parallel(ranks, tp_size: int, batch: tuple[int, ...]) -> None:
    ranks.run(tp_size, _check_layers, tp_size, batch)


def _model_loss_and_grads(path: str, ids: torch.Tensor, labels: torch.Tensor, overlap: bool
                          ) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    model = from_pretrained(path, device=multirank.device(), sequence_parallel=True,
                            overlap_communication=overlap)
    switched = sum(getattr(m, "overlap_communication", False) for m in model.modules())
    logits = model(ids.to(multirank.device()))
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten().to(logits.device))
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}, switched


def _check_model(path: str, tp_size: int, ids: torch.Tensor, labels: torch.Tensor) -> None:
    init_tensor_parallel(tp_size)
    loss, grads, _ = _model_loss_and_grads(path, ids, labels, overlap=False)
    overlapped_loss, overlapped_grads, switched = _model_loss_and_grads(path, ids, labels, overlap=True)
    assert switched == 2 * 4  # each of the 2 layers: qkv, o, gate_up and down projections
    torch.testing.assert_close(overlapped_loss, loss, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        atol = 1e-4 * grad.abs().max().item()
        torch.testing.assert_close(overlapped_grads[name], grad, rtol=1e-4, atol=atol,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_model_with_overlap_matches_without(ranks, tmp_path) -> None:
    make_llama_checkpoint(tmp_path / "llama", hidden_size=64, intermediate_size=64)
    ids, labels = random_token_ids(256, (2, 8), (2, 8), seed=0)
    ranks.run(2, _check_model, str(tmp_path / "llama"), 2, ids, labels, timeout=240)


def test_overlap_rejects_bad_arguments() -> None:
    one_rank = TPGroup(None, 0, 1)
    for build in (lambda **kw: ColumnParallelLinear(8, 8, **kw),
                  lambda **kw: MergedColumnParallelLinear(8, [4, 4], **kw),
                  lambda **kw: QKVParallelLinear(8, 2, 4, **kw),
                  lambda **kw: RowParallelLinear(8, 8, **kw)):
        with pytest.raises(ValueError, match="overlap_communication=True overlaps sequence parallelism's "
                                             "collectives: expected sequence_parallel=True, received False"):
            build(overlap_communication=True, tp_group=one_rank)
        with pytest.raises(ValueError, match="expected quant_method=None, received"):
            build(overlap_communication=True, sequence_parallel=True, quant_method=Fp8LinearMethod(),
                  tp_group=one_rank)
    with pytest.raises(ValueError, match="expected sequence-parallel linear layers .* found none in Linear"):
        set_overlap_communication(nn.Linear(2, 2))
    assert set_overlap_communication(nn.Linear(2, 2), enabled=False) == 0
    plain = RowParallelLinear(8, 8, sequence_parallel=True, tp_group=one_rank)
    assert set_overlap_communication(nn.Sequential(plain)) == 1 and plain.overlap_communication
    with pytest.raises(ValueError, match="from_pretrained: overlap_communication=True .* expected "
                                         "sequence_parallel=True, received False"):
        from_pretrained("unread", overlap_communication=True)
    with pytest.raises(TypeError, match="module: expected an nn.Module, got Tensor"):
        set_overlap_communication(torch.zeros(2))
    with pytest.raises(ValueError, match=r"input_: expected \[..., tokens, features\] \(2 dims or more\)"):
        all_gather_matmul(torch.zeros(8), torch.zeros(4, 8), tp_group=one_rank)
