"""Gradients across ranks (tpkit.parallel_layers.grads): replicated KV heads summed, the whole model's norm
and clipping; tp_size 1, 2, 4."""

from __future__ import annotations

import math
import re

import multirank
import pytest
import torch
import torch.distributed as dist
from torch import nn

from tpkit.parallel_layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    clip_grad_norm_,
    init_tensor_parallel,
    reduce_kv_replica_grads,
)

HIDDEN = 16
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _kv_replica_grads(tp: TPGroup, device: torch.device) -> None:
    # Every rank's gradients at random; reduce_kv_replica_grads leaves the q rows as they were and gives the
    # k and v rows the sum over the ranks that hold the same KV head (gathered here, summed naively).
    head_size = 4
    for heads, kv_heads, bias in ((4, 4, True), (8, 2, True), (4, 1, False)):
        layer = QKVParallelLinear(HIDDEN, head_size, heads, kv_heads, bias=bias, device=device)
        params = [p for p in (layer.weight, layer.bias) if p is not None]
        generator = torch.Generator().manual_seed(100 * tp.rank + heads)
        own = [torch.randn(p.shape, generator=generator).to(device) for p in params]
        for param, grad in zip(params, own, strict=True):
            param.grad = grad.clone()
        replicas = layer.num_kv_head_replicas
        assert replicas == max(1, tp.size // kv_heads)
        assert reduce_kv_replica_grads(nn.Sequential(layer)) == (replicas > 1)
        holders = [r for r in range(tp.size) if r // replicas == tp.rank // replicas]
        for param, grad in zip(params, own, strict=True):
            every = [grad]
            if tp.size > 1:
                every = [torch.empty_like(grad) for _ in range(tp.size)]
                dist.all_gather(every, grad, group=tp.group)
            expected = grad.clone()
            expected[layer.q_size:] = sum(every[r][layer.q_size:] for r in holders)
            torch.testing.assert_close(param.grad, expected, **TOL)


def _full_shape(layer: nn.Module, param: nn.Parameter) -> tuple[int, ...]:
    """The checkpoint shape ``param``'s loader takes whole (q/k/v and gate/up fused)."""
    if isinstance(layer, VocabParallelEmbedding | ParallelLMHead):
        rows, cols = layer.num_embeddings, layer.embedding_dim
    elif hasattr(layer, "output_size"):
        rows, cols = layer.output_size, layer.input_size
    else:  # a module of torch's: replicated as it is
        return tuple(param.shape)
    return (rows, cols) if param.dim() == 2 else (rows,)


def _clip_grad_norms(tp: TPGroup, device: torch.device) -> None:
    # Each parameter's gradient set to this rank's part of a full gradient, drawn alike on every rank and
    # loaded as a weight would be: the group's norm is the norm of those full gradients, every element once,
    # whether a rank holds a shard (column, row, vocabulary), a copy (a row-parallel bias, ReplicatedLinear,
    # torch's LayerNorm) or one of a KV head's replicas.
    model = nn.ModuleList([
        ColumnParallelLinear(HIDDEN, 24, device=device),
        MergedColumnParallelLinear(HIDDEN, [20, 12], device=device),
        QKVParallelLinear(HIDDEN, 4, 8, 2, device=device),  # 2 KV heads: replicated at tp_size 4
        QKVParallelLinear(HIDDEN, 4, 4, 1, device=device),  # MQA: replicated from tp_size 2
        RowParallelLinear(24, HIDDEN, device=device),
        ReplicatedLinear(HIDDEN, 24, device=device),
        VocabParallelEmbedding(50, HIDDEN, device=device),
        ParallelLMHead(50, HIDDEN, bias=True, device=device),
        nn.LayerNorm(HIDDEN, device=device),
    ])
    generator = torch.Generator().manual_seed(7)
    full_grads = []
    for layer in model:
        for param in layer.parameters():
            full = torch.randn(_full_shape(layer, param), generator=generator).to(device)
            full_grads.append(full)
            if not hasattr(param, "weight_loader"):
                param.grad = full.clone()
                continue
            kept = param.detach().clone()
            with torch.no_grad():
                param.zero_()  # vocabulary padding rows stay zero
            param.weight_loader(param, full)
            param.grad = param.detach().clone()
            with torch.no_grad():
                param.copy_(kept)
    every = torch.cat([g.flatten() for g in full_grads])
    shards = [p.grad.clone() for p in model.parameters()]
    for norm_type, expected in ((2.0, every.norm()), (1.0, every.abs().sum()), (3.0, every.norm(3.0)),
                                (math.inf, every.abs().max())):
        norm = clip_grad_norm_(model, 1e9, norm_type)  # clips nothing
        torch.testing.assert_close(norm, expected, **TOL)
    half = 0.5 * every.norm().item()
    torch.testing.assert_close(clip_grad_norm_(model, half), every.norm(), **TOL)
    for param, shard in zip(model.parameters(), shards, strict=True):
        torch.testing.assert_close(param.grad, shard * (half / (every.norm().item() + 1e-6)), **TOL)


def _check_grads(tp_size: int) -> None:
    tp = init_tensor_parallel()
    assert tp.size == tp_size
    device = multirank.device()
    _kv_replica_grads(tp, device)
    _clip_grad_norms(tp, device)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_grads_across_ranks(ranks, tp_size: int) -> None:
    ranks.run(tp_size, _check_grads, tp_size)


@pytest.mark.parametrize(("max_norm", "norm_type", "message"), [
    (0.0, 2.0, "max_norm must be a positive finite number, received 0.0"),
    (float("nan"), 2.0, "max_norm must be a positive finite number, received nan"),
    (1.0, -1.0, "norm_type must be positive (or inf), received -1.0"),
])
def test_clip_grad_norm_rejects_bad_arguments(max_norm, norm_type, message):
    layer = ColumnParallelLinear(4, 8, tp_group=TPGroup(None, 0, 1))  # also under torchrun
    layer(torch.randn(2, 4)).sum().backward()
    grad = layer.weight.grad.clone()
    with pytest.raises(ValueError, match=re.escape(message)):
        clip_grad_norm_(layer, max_norm, norm_type)
    assert torch.equal(layer.weight.grad, grad)  # untouched
