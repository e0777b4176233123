"""Collectives between tensor-parallel ranks as autograd functions (Megatron's mappings).

Each has a forward collective and the backward that makes gradients right:

==========================================  =============================  ==============================
function                                    forward                        backward
==========================================  =============================  ==============================
copy_to_tp_region                           identity                       all-reduce
reduce_from_tp_region                       all-reduce                     identity
gather_from_tp_region                       all-gather (last dim)          keep this rank's chunk
scatter_to_tp_region                        keep this rank's chunk         all-gather (last dim)
scatter_to_sequence_parallel_region         keep this rank's chunk         all-gather (sequence dim)
gather_from_sequence_parallel_region        all-gather (sequence dim)      keep chunk, or reduce-scatter
reduce_scatter_to_sequence_parallel_region  reduce-scatter (sequence dim)  all-gather (sequence dim)
==========================================  =============================  ==============================

The last three are sequence parallelism (Megatron-LM's): between a row-parallel layer and the next
column-parallel one, activations are split along the sequence instead of replicated, so norms, dropout and
residual adds each take 1 / tp_size of the tokens on every rank. The sequence dim is ``dim`` (default -2:
``[batch, seq, hidden]`` and ``[tokens, hidden]`` alike); its size must divide by ``tp_size``.

With ``tp_size`` 1 each returns its input unchanged and communicates nothing. ``tp_group`` is a
:class:`TPGroup`, a ``ProcessGroup`` or None (the group of ``init_tensor_parallel``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._failures import collective_failed
from .state import TPGroup, _resolve_tp_group
from .symmetric_memory import one_shot_all_reduce

# torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor (deprecated there); 2.11 has only the
# old names.
_all_gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_reduce(tensor: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Sums ``tensor`` over the group in place; ``tensor`` must be contiguous and owned by the caller."""
    try:
        dist.all_reduce(tensor, group=tp.group)
    except RuntimeError as error:
        raise collective_failed("all-reduce", tp.group, tensor, error) from error
    return tensor


@torch.library.custom_op("tpkit::all_reduce", mutates_args=())
def _all_reduce_copy(input_: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum of ``input_`` over the group named ``group_name``, in a new contiguous tensor.

    An op of its own so that torch.compile keeps it whole: traced inside an autograd function, the collective
    alone came out of the graph with no gradient (zeros on CUDA with NCCL, torch 2.11), the function's
    backward never running.
    """
    # Here, not at the top: torch builds without distributed support lack the module (and reduce nothing).
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    output = one_shot_all_reduce(input_.contiguous(), group)
    if output is not None:
        return output
    output = input_.clone(memory_format=torch.contiguous_format)
    try:
        dist.all_reduce(output, group=group)
    except RuntimeError as error:
        raise collective_failed("all-reduce", group, output, error) from error
    return output


@_all_reduce_copy.register_fake
def _(input_: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(input_, memory_format=torch.contiguous_format)


def _all_gather_dim(tensor: torch.Tensor, tp: TPGroup, dim: int) -> torch.Tensor:
    # [..., n, ...] on each rank -> [..., tp_size * n, ...] (n at dim), rank r's chunk at [r * n, (r + 1) * n)
    tensor = tensor.contiguous()
    dim = dim % tensor.dim()
    # Ranks' tensors stacked along dim 0, [tp_size * d0, ...], the output shape torch.compile's traced
    # all-gather writes (it copies into the buffer given), viewed as [tp_size, *tensor.shape].
    gathered = tensor.new_empty((tp.size * tensor.shape[0], *tensor.shape[1:]))
    stacked = gathered.view(tp.size, *tensor.shape)
    try:
        if tp.backend == "gloo":
            # Some gloo builds lack the single-tensor all-gather: gather into views of the same buffer.
            dist.all_gather(list(stacked.unbind(0)), tensor, group=tp.group)
        else:
            _all_gather_into(gathered, tensor, group=tp.group)
    except RuntimeError as error:
        raise collective_failed("all-gather", tp.group, tensor, error) from error
    shape = list(tensor.shape)
    shape[dim] *= tp.size
    return stacked.movedim(0, dim).reshape(shape)


def _chunk_of(size: int, tp: TPGroup, what: str) -> int:
    if size % tp.size:
        raise ValueError(f"the {what} ({size}) must divide by tp_size={tp.size} to scatter it")
    return size // tp.size


def _split_dim(tensor: torch.Tensor, tp: TPGroup, dim: int, what: str) -> torch.Tensor:
    chunk = _chunk_of(tensor.shape[dim], tp, what)
    return tensor.narrow(dim, tp.rank * chunk, chunk).contiguous()


@torch.library.custom_op("tpkit::reduce_scatter", mutates_args=())
def _reduce_scatter_copy(input_: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    """``input_`` ``[world_size * n, ...]`` summed over the group named ``group_name``: this rank's
    ``[n, ...]`` of the sum. An op of its own, as ``tpkit::all_reduce``: torch.compile cannot trace gloo's
    list form."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    input_ = input_.contiguous()
    output = input_.new_empty((input_.shape[0] // world_size, *input_.shape[1:]))
    try:
        if dist.get_backend(group) == "gloo":
            # As for the all-gather: the list form, which every gloo build has.
            dist.reduce_scatter(output, list(input_.split(output.shape[0])), group=group)
        else:
            _reduce_scatter_into(output, input_, group=group)
    except RuntimeError as error:
        raise collective_failed("reduce-scatter", group, input_, error) from error
    return output


@_reduce_scatter_copy.register_fake
def _(input_: torch.Tensor, group_name: str, world_size: int) -> torch.Tensor:
    return input_.new_empty((input_.shape[0] // world_size, *input_.shape[1:]))


def _reduce_scatter_dim(tensor: torch.Tensor, tp: TPGroup, dim: int) -> torch.Tensor:
    # [..., tp_size * n, ...] on each rank -> rank r's [..., n, ...]: the sum over the ranks of chunk r
    _chunk_of(tensor.shape[dim], tp, "sequence dimension")
    output = _reduce_scatter_copy(tensor.movedim(dim, 0), tp.group.group_name, tp.size)  # [n, ...]
    return output.movedim(0, dim).contiguous()


class _CopyToTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        ctx.tp = tp
        return input_.view_as(input_)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        # The incoming gradient may be shared (retain_grad, hooks): reduce a copy.
        grad = grad_output.clone(memory_format=torch.contiguous_format)
        return _all_reduce(grad, ctx.tp), None


class _ReduceFromTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        return _all_reduce_copy(input_, tp.group.group_name)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad_output, None


class _GatherFromTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        ctx.tp = tp
        return _all_gather_dim(input_, tp, -1)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split_dim(grad_output, ctx.tp, -1, "last dimension"), None


class _ScatterToTPRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_: torch.Tensor, tp: TPGroup) -> torch.Tensor:
        ctx.tp = tp
        return _split_dim(input_, tp, -1, "last dimension")

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather_dim(grad_output, ctx.tp, -1), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_: torch.Tensor, tp: TPGroup, dim: int) -> torch.Tensor:
        ctx.tp, ctx.dim = tp, dim
        return _split_dim(input_, tp, dim, "sequence dimension")

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather_dim(grad_output, ctx.tp, ctx.dim), None, None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_: torch.Tensor, tp: TPGroup, dim: int, partial_grad: bool) -> torch.Tensor:
        ctx.tp, ctx.dim, ctx.partial_grad = tp, dim, partial_grad
        return _all_gather_dim(input_, tp, dim)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.partial_grad:
            return _reduce_scatter_dim(grad_output, ctx.tp, ctx.dim), None, None, None
        return _split_dim(grad_output, ctx.tp, ctx.dim, "sequence dimension"), None, None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_: torch.Tensor, tp: TPGroup, dim: int) -> torch.Tensor:
        ctx.tp, ctx.dim = tp, dim
        output = _reduce_scatter_dim(input_, tp, dim)
        # A view, not tpkit::reduce_scatter's own result (which is what a dim-0 sequence leaves): returned
        # as is, torch 2.11's compile gave the input a zero gradient.
        return output.view_as(output)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather_dim(grad_output, ctx.tp, ctx.dim), None, None


def copy_to_tp_region(
    input_: torch.Tensor, tp_group: TPGroup | dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Identity forward; backward all-reduces the gradient (the input feeds every rank's shard)."""
    tp = _resolve_tp_group(tp_group)
    return input_ if tp.size == 1 else _CopyToTPRegion.apply(input_, tp)


def reduce_from_tp_region(
    input_: torch.Tensor, tp_group: TPGroup | dist.ProcessGroup | None = None
) -> torch.Tensor:
    """All-reduces (sums) partial results over the group into a new tensor; backward is the identity."""
    tp = _resolve_tp_group(tp_group)
    return input_ if tp.size == 1 else _ReduceFromTPRegion.apply(input_, tp)


def _reduce_from_tp_region_(input_: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """:func:`reduce_from_tp_region` in place where no gradient is wanted, for a fresh tensor the caller owns
    (a layer's output)."""
    if tp.size == 1:
        return input_
    if (torch.is_grad_enabled() and input_.requires_grad) or not input_.is_contiguous():
        # Into a new tensor: reduced in place inside the autograd function (mark_dirty), the output aliased
        # the input, and torch.compile on CUDA refused the row-parallel layer's in-place bias add on it.
        return _ReduceFromTPRegion.apply(input_, tp)
    return _all_reduce(input_, tp)


def gather_from_tp_region(
    input_: torch.Tensor, tp_group: TPGroup | dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Concatenates every rank's ``[..., n]`` along the last dim, in rank order: ``[..., tp_size * n]``."""
    tp = _resolve_tp_group(tp_group)
    return input_ if tp.size == 1 else _GatherFromTPRegion.apply(input_, tp)


def scatter_to_tp_region(
    input_: torch.Tensor, tp_group: TPGroup | dist.ProcessGroup | None = None
) -> torch.Tensor:
    """Keeps this rank's chunk of the last dim, ``[..., n]`` -> ``[..., n / tp_size]``."""
    tp = _resolve_tp_group(tp_group)
    return input_ if tp.size == 1 else _ScatterToTPRegion.apply(input_, tp)


def scatter_to_sequence_parallel_region(
    input_: torch.Tensor, tp_group: TPGroup | dist.ProcessGroup | None = None, *, dim: int = -2
) -> torch.Tensor:
    """Keeps this rank's chunk of the sequence dim of a replicated ``input_`` (an embedding's output, say):
    ``[..., seq, hidden]`` -> ``[..., seq / tp_size, hidden]``."""
    tp = _resolve_tp_group(tp_group)
    return input_ if tp.size == 1 else _ScatterToSequenceParallelRegion.apply(input_, tp, dim)


def gather_from_sequence_parallel_region(
    input_: torch.Tensor, tp_group: TPGroup | dist.ProcessGroup | None = None, *, dim: int = -2,
    partial_grad: bool = False,
) -> torch.Tensor:
    """Concatenates every rank's chunk of the sequence dim, in rank order: ``[..., seq / tp_size, hidden]``
    -> ``[..., seq, hidden]``. The backward keeps this rank's chunk of the gradient, which is right where
    every rank computes all of it: a replicated consumer, or tpkit's LM head (its input copy sums the ranks'
    gradients itself). ``partial_grad=True`` where each rank's gradient is a part of the whole (the product
    of a column-parallel weight shard, as inside ``ColumnParallelLinear(sequence_parallel=True)``): the
    backward sums the parts and scatters them (reduce-scatter)."""
    tp = _resolve_tp_group(tp_group)
    return input_ if tp.size == 1 else _GatherFromSequenceParallelRegion.apply(input_, tp, dim, partial_grad)


def reduce_scatter_to_sequence_parallel_region(
    input_: torch.Tensor, tp_group: TPGroup | dist.ProcessGroup | None = None, *, dim: int = -2
) -> torch.Tensor:
    """Sums partial results over the group and keeps this rank's chunk of the sequence dim (a row-parallel
    layer's output): ``[..., seq, hidden]`` -> ``[..., seq / tp_size, hidden]``; backward all-gathers."""
    tp = _resolve_tp_group(tp_group)
    return input_ if tp.size == 1 else _ReduceScatterToSequenceParallelRegion.apply(input_, tp, dim)
