"""Gradients across tensor-parallel ranks, between a training step's backward and its optimizer step.

Backward leaves every rank the gradient of its own shards, and of its copy of each replicated parameter
(norm weights, a row-parallel bias, ``ReplicatedLinear``): the same on every rank, since their inputs are.
Two things then need the group:

- :func:`reduce_kv_replica_grads`: where ``tp_size`` exceeds a model's KV heads, each replica of a KV head
  holds only its own query heads' share of that head's gradient; this sums them.
- :func:`clip_grad_norm_`: ``torch.nn.utils.clip_grad_norm_`` for the whole model. On one rank's parameters
  alone, each rank would find its own norm and scale its replicated parameters by its own factor, and the
  replicas would drift apart.

With sequence parallelism a third: the replicated parameters that act on a rank's share of the tokens only
(the norms between a row-parallel and the next column-parallel layer, a sequence-parallel row layer's bias)
get the gradient of those tokens; :func:`reduce_sequence_parallel_grads` sums them over the ranks, which
:func:`mark_sequence_parallel` tells it about.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ._failures import collective_failed
from .linear import RowParallelLinear
from .mappings import _all_reduce
from .qkv import QKVParallelLinear
from .state import TPGroup, _resolve_tp_group

# Set on a module whose parameters act on a rank's share of the tokens (mark_sequence_parallel): a module
# attribute, which copies, pickling and dtype or device conversions keep.
_SEQUENCE_PARALLEL_ATTR = "_tpkit_sequence_parallel"


def reduce_kv_replica_grads(module: nn.Module) -> int:
    """:meth:`QKVParallelLinear.reduce_kv_replica_grads` on every QKV layer in ``module`` (itself included,
    :class:`~tpkit.parallel_layers.QKVCrossParallelLinear` too): after backward, on every rank, before the
    optimizer step of a model whose KV heads are replicated (``tp_size`` above ``total_num_kv_heads``).
    Returns how many layers it reduced."""
    return sum(layer.reduce_kv_replica_grads() for layer in module.modules()
               if isinstance(layer, QKVParallelLinear))


def mark_sequence_parallel(*modules: nn.Module) -> None:
    """Says that the parameters of each module (not its children) act on a rank's share of the tokens
    under sequence parallelism: the norms between a row-parallel and the next column-parallel layer.
    :func:`reduce_sequence_parallel_grads` then sums their gradients."""
    for module in modules:
        if not isinstance(module, nn.Module):
            raise TypeError(f"mark_sequence_parallel: expected nn.Module arguments, received "
                            f"{type(module).__name__}")
    for module in modules:
        setattr(module, _SEQUENCE_PARALLEL_ATTR, True)


def reduce_sequence_parallel_grads(module: nn.Module) -> int:
    """Sums over the group, in one all-reduce, the gradients of the parameters in ``module`` that act on a
    rank's share of the tokens: those of the modules given to :func:`mark_sequence_parallel` and the bias of
    every ``RowParallelLinear(sequence_parallel=True)``. Each rank then holds the whole gradient, the same
    on every rank. Call it after backward, on every rank, before :func:`clip_grad_norm_` and the optimizer
    step. Returns how many parameters it reduced."""
    params: list[nn.Parameter] = []
    for layer in module.modules():
        if getattr(layer, _SEQUENCE_PARALLEL_ATTR, False):
            params.extend(layer.parameters(recurse=False))
        elif isinstance(layer, RowParallelLinear) and layer.sequence_parallel and layer.bias is not None:
            params.append(layer.bias)
    params = [p for p in dict.fromkeys(params) if p.requires_grad]
    if not params:
        return 0
    tp = _group_of(module)
    if tp.size == 1:
        return len(params)
    for param in params:
        if param.grad is None:  # unused on this rank: its share of the sum is zero
            param.grad = torch.zeros_like(param)
    flat = torch.cat([param.grad.reshape(-1) for param in params])
    _all_reduce(flat, tp)
    for param, summed in zip(params, flat.split([param.numel() for param in params]), strict=True):
        param.grad.copy_(summed.view_as(param.grad))
    return len(params)


def clip_grad_norm_(module: nn.Module, max_norm: float, norm_type: float = 2.0, *,
                    tp_group: TPGroup | dist.ProcessGroup | None = None) -> torch.Tensor:
    """Scales every gradient of ``module`` on every rank by ``min(1, max_norm / (total_norm + 1e-6))``, as
    ``torch.nn.utils.clip_grad_norm_`` does for the unsharded model, and returns ``total_norm``.

    ``total_norm`` is the ``norm_type``-norm of the whole model's gradient, every element counted once: the
    shards of tpkit's layers summed over the ranks, replicated parameters (any parameter outside tpkit's
    layers too) and the replicas of a KV head once; the same float32 scalar on every rank. Call it on every
    rank of the group, after :func:`reduce_kv_replica_grads`. ``tp_group``: default the group of the tpkit
    layers in ``module``, else that of ``init_tensor_parallel``.
    """
    if isinstance(max_norm, bool) or not (isinstance(max_norm, (int, float)) and max_norm > 0
                                          and math.isfinite(max_norm)):
        raise ValueError(f"clip_grad_norm_: max_norm must be a positive finite number, received {max_norm!r}")
    if isinstance(norm_type, bool) or not (isinstance(norm_type, (int, float)) and norm_type > 0):
        raise ValueError(f"clip_grad_norm_: norm_type must be positive (or inf), received {norm_type!r}")
    tp = _resolve_tp_group(tp_group) if tp_group is not None else _group_of(module)
    grads: list[torch.Tensor] = []
    total = None
    for owner, param in _owned_parameters(module):
        if param.grad is None:
            continue
        grads.append(param.grad)
        share = _norm_share(param.grad, owner, param, norm_type, tp.size)
        total = share if total is None else (torch.maximum(total, share) if math.isinf(norm_type)
                                             else total + share)
    if total is None:
        total = torch.zeros((), device="cuda" if tp.backend == "nccl" else "cpu")
    if tp.size > 1:
        op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
        try:
            dist.all_reduce(total, op=op, group=tp.group)
        except RuntimeError as error:
            raise collective_failed("all-reduce of the gradient norm", tp.group, total, error) from error
    if not math.isinf(norm_type):
        total = total.pow(1.0 / norm_type)
    scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for grad in grads:
        grad.mul_(scale.to(grad.device, grad.dtype))
    return total


def _owned_parameters(module: nn.Module) -> list[tuple[nn.Module, nn.Parameter]]:
    """(the module that holds it, parameter) for each parameter of ``module`` once (tied ones too)."""
    seen: set[int] = set()
    owned = []
    for owner in module.modules():
        for param in owner.parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                owned.append((owner, param))
    return owned


def _norm_share(grad: torch.Tensor, owner: nn.Module, param: nn.Parameter, norm_type: float,
                tp_size: int) -> torch.Tensor:
    """This rank's part of the group's ``sum |g| ** norm_type`` (of ``max |g|`` for inf): each row's sum
    divided by the ranks that hold the row, so that summing over the ranks counts it once."""
    values = grad.detach().float().abs()
    if math.isinf(norm_type):
        return values.max() if values.numel() else values.new_zeros(())
    holders = owner._grad_holders(param) if hasattr(owner, "_grad_holders") else tp_size
    powered = values.pow(norm_type)
    rows = powered.reshape(powered.shape[0], -1).sum(1) if powered.dim() else powered  # [rows] (or a scalar)
    return (rows / holders).sum()


def _group_of(module: nn.Module) -> TPGroup:
    """The tensor-parallel group of the tpkit layers in ``module`` (all of them must share it)."""
    groups = {}
    for layer in module.modules():
        tp = getattr(layer, "tp_group", None)
        if isinstance(tp, TPGroup):
            groups[(tp.size, id(tp.group) if tp.size > 1 else None)] = tp
    if len(groups) > 1:
        raise ValueError(f"clip_grad_norm_: module's layers use {len(groups)} tensor-parallel groups; pass "
                         "tp_group= to say which one the gradients are sharded over")
    return next(iter(groups.values())) if groups else _resolve_tp_group(None)
