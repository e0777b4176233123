"""Sequence parallelism's collectives overlapped with the products (collective matmuls).

A sequence-parallel column-parallel layer all-gathers its input's tokens, then multiplies; a row-parallel one
multiplies, then reduce-scatters its output over the tokens. Each rank waits for the whole collective
before (or after) the whole product. Decomposed into ``tp_size`` steps along the tokens, a ring, the two
interleave instead:

* :func:`all_gather_matmul`, ``F.linear(all_gather(x), weight, bias)``: at each step a rank multiplies the
  chunk of tokens it holds while it sends that chunk on to the next rank and receives the next chunk from
  the previous one; each chunk's product goes to its tokens' rows of the output. Backward: the input's
  gradient is a ring reduce-scatter (below) of ``grad @ weight``, the weight's gradient the sum over the
  chunks of ``grad[chunk]^T @ x[chunk]``, the gathered chunks kept from forward (as the plain path's
  autograd keeps the gathered input).
* :func:`matmul_reduce_scatter`, ``reduce_scatter(F.linear(x, weight))``: at each step a rank multiplies the
  rows of one destination rank's tokens, adds the partial sum received for them and passes the result on,
  while the next step's product runs; after ``tp_size`` steps each rank holds the sum of its own tokens.
  Backward: a ring all-gather of the output's gradient, each chunk multiplied by the weight (the input's
  gradient) and by the input's chunk (the weight's gradient) as it arrives: the same ring as the forward of
  :func:`all_gather_matmul`.

Every step exchanges point to point (``batch_isend_irecv`` with the ring's neighbours). On GPUs with NCCL
the sends and receives run on NCCL's own stream while the product runs on the compute stream, so each
step's communication hides behind a matmul; with gloo on the CPU the ring is correct but gains nothing.
The partial sums are added in ring order rather than in the order of one reduce-scatter (and the weight's
gradient chunk by chunk rather than in one product), so results agree with the plain path to rounding, not
bit for bit. The token dim is the one before the features (-2), as in the plain sequence-parallel
mappings; its chunks are equal, ``tp_size`` of them. ``torch.compile`` breaks its graph around the rings
(its tracer refuses point-to-point ops), which then run eagerly; ``fullgraph=True`` refuses them.

The layers use this with ``overlap_communication=True`` (with ``sequence_parallel=True``);
:func:`set_overlap_communication` turns it on or off for every sequence-parallel layer of a model
(``tpkit.models.from_pretrained(..., sequence_parallel=True, overlap_communication=True)`` calls it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ._failures import collective_failed
from .linear_op import LinearOp
from .mappings import _chunk_of
from .state import TPGroup, _resolve_tp_group

_TOKENS = -2  # the token dim: the one before the features


def _check_overlap(layer: str, overlap_communication: bool, sequence_parallel: bool,
                   quant_method: object) -> None:
    """``overlap_communication=True`` overlaps sequence parallelism's collectives, and multiplies by the
    weight as it is (the backward's products use it)."""
    if not overlap_communication:
        return
    if not sequence_parallel:
        raise ValueError(f"{layer}: overlap_communication=True overlaps sequence parallelism's collectives: "
                         "expected sequence_parallel=True, received False")
    if quant_method is not None:
        raise ValueError(f"{layer}: overlap_communication=True multiplies by the weight as it is: expected "
                         f"quant_method=None, received {quant_method!r}")


def _ring_peers(tp: TPGroup) -> tuple[int, int]:
    """The global ranks of the next and the previous rank of the ring (P2P ops take global ranks)."""
    return (dist.get_global_rank(tp.group, (tp.rank + 1) % tp.size),
            dist.get_global_rank(tp.group, (tp.rank - 1) % tp.size))


def _exchange(send: torch.Tensor, receive: torch.Tensor, tp: TPGroup, peers: tuple[int, int]) -> list:
    """Starts sending ``send`` to the next rank and receiving the previous rank's into ``receive``; the
    caller waits on the returned works (and keeps both tensors alive until then)."""
    ops = [dist.P2POp(dist.isend, send, peers[0], tp.group),
           dist.P2POp(dist.irecv, receive, peers[1], tp.group)]
    try:
        return dist.batch_isend_irecv(ops)
    except RuntimeError as error:
        raise collective_failed("ring exchange", tp.group, send, error) from error


def _wait(works: list, tp: TPGroup, tensor: torch.Tensor) -> None:
    try:
        for work in works:
            work.wait()
    except RuntimeError as error:
        raise collective_failed("ring exchange", tp.group, tensor, error) from error


def _ring_all_gather(chunk: torch.Tensor, tp: TPGroup, consume: Callable[[int, torch.Tensor], None]
                     ) -> torch.Tensor:
    """Every rank's ``chunk`` stacked in rank order, ``[tp_size, *chunk.shape]``; ``consume(source, chunk)``
    runs on each rank's chunk (this rank's first) while the next one is on its way."""
    stacked = chunk.new_empty((tp.size, *chunk.shape))
    stacked[tp.rank].copy_(chunk)
    peers = _ring_peers(tp)
    for step in range(tp.size):
        source = (tp.rank - step) % tp.size
        # The previous rank sends now the chunk it holds at this step: its source's predecessor's.
        works = [] if step == tp.size - 1 else _exchange(stacked[source], stacked[source - 1], tp, peers)
        consume(source, stacked[source])
        _wait(works, tp, chunk)
    return stacked


def _ring_reduce_scatter(partial: Callable[[int], torch.Tensor], tp: TPGroup) -> torch.Tensor:
    """The sum over the ranks of their ``partial(tp.rank)``: each rank computes ``partial(destination)``
    for every destination (a new contiguous tensor it owns), adds the sum received for it and passes it on
    while the next destination's product runs. Destination d's sum starts at rank d + 1 and ends at d."""
    peers = _ring_peers(tp)
    total = partial((tp.rank - 1) % tp.size)
    for step in range(1, tp.size):
        sent, received = total, torch.empty_like(total)
        works = _exchange(sent, received, tp, peers)
        total = partial((tp.rank - step - 1) % tp.size)  # while the partial sum so far travels
        _wait(works, tp, sent)
        total += received
    return total


def _unstack(stacked: torch.Tensor) -> torch.Tensor:
    """``[tp_size, ..., n, features]`` -> ``[..., tp_size * n, features]``, chunk r at rows r * n."""
    tp_size, *batch, n, features = stacked.shape
    return stacked.movedim(0, -3).reshape(*batch, tp_size * n, features)


def _rows(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1, tensor.shape[-1])


def _tokens(tensor: torch.Tensor, index: int, n: int) -> torch.Tensor:
    return tensor.narrow(_TOKENS, index * n, n)


class _AllGatherMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: TPGroup,
                linear_op: LinearOp) -> torch.Tensor:
        products = input_.new_empty((tp.size, *input_.shape[:-1], weight.shape[0]))

        def multiply(source: int, chunk: torch.Tensor) -> None:
            products[source].copy_(linear_op(chunk, weight, bias))

        gathered = _ring_all_gather(input_.contiguous(), tp, multiply)  # [tp_size, ..., n, in]
        ctx.tp, ctx.has_bias = tp, bias is not None
        ctx.save_for_backward(gathered, weight)
        return _unstack(products)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gathered, weight = ctx.saved_tensors
        tp, n = ctx.tp, gathered.shape[_TOKENS]
        want_input, want_weight, want_bias = ctx.needs_input_grad[:3]
        grad_weight = torch.zeros_like(weight) if want_weight else None

        def add_weight_grad(destination: int) -> None:
            if want_weight:
                grad_weight.addmm_(_rows(_tokens(grad_output, destination, n)).t(),
                                   _rows(gathered[destination]))

        def partial(destination: int) -> torch.Tensor:
            add_weight_grad(destination)
            return (_tokens(grad_output, destination, n) @ weight).contiguous()

        grad_input = None
        if want_input:
            grad_input = _ring_reduce_scatter(partial, tp)
        else:  # the weight's gradient only: nothing to communicate
            for destination in range(tp.size):
                add_weight_grad(destination)
        grad_bias = _rows(grad_output).sum(0) if ctx.has_bias and want_bias else None
        return grad_input, grad_weight, grad_bias, None, None


class _MatmulReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input_: torch.Tensor, weight: torch.Tensor, tp: TPGroup, linear_op: LinearOp
                ) -> torch.Tensor:
        n = input_.shape[_TOKENS] // tp.size
        ctx.tp = tp
        ctx.save_for_backward(input_, weight)
        return _ring_reduce_scatter(
            lambda destination: linear_op(_tokens(input_, destination, n), weight, None).contiguous(), tp)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        input_, weight = ctx.saved_tensors
        tp, n = ctx.tp, grad_output.shape[_TOKENS]
        want_input, want_weight = ctx.needs_input_grad[:2]
        grad_inputs = input_.new_empty((tp.size, *grad_output.shape[:-1], weight.shape[1]))
        grad_weight = torch.zeros_like(weight) if want_weight else None

        def consume(source: int, grad: torch.Tensor) -> None:
            if want_input:
                torch.matmul(grad, weight, out=grad_inputs[source])
            if want_weight:
                grad_weight.addmm_(_rows(grad).t(), _rows(_tokens(input_, source, n)))

        _ring_all_gather(grad_output.contiguous(), tp, consume)
        return (_unstack(grad_inputs) if want_input else None), grad_weight, None, None


def _check_tokens(input_: torch.Tensor, what: str) -> None:
    if not isinstance(input_, torch.Tensor) or input_.dim() < 2:
        got = list(input_.shape) if isinstance(input_, torch.Tensor) else type(input_).__name__
        raise ValueError(f"{what}: input_: expected [..., tokens, features] (2 dims or more), got {got}")


def all_gather_matmul(input_: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                      tp_group: TPGroup | dist.ProcessGroup | None = None, *,
                      linear_op: LinearOp = F.linear) -> torch.Tensor:
    """``linear_op(all_gather(input_), weight, bias)``, the gather over the tokens (dim -2) overlapped with
    the products (module docstring): ``[..., n, in]`` on each rank -> ``[..., tp_size * n, out]``, rank r's
    tokens at rows ``[r * n, (r + 1) * n)``. The backward reduce-scatters the input's gradient, as
    ``gather_from_sequence_parallel_region(partial_grad=True)`` does. ``linear_op`` makes the forward's
    products; the backward's use ``weight`` as it is."""
    _check_tokens(input_, "all_gather_matmul")
    tp = _resolve_tp_group(tp_group)
    if tp.size == 1:
        return linear_op(input_, weight, bias)
    return _AllGatherMatmul.apply(input_, weight, bias, tp, linear_op)


def matmul_reduce_scatter(input_: torch.Tensor, weight: torch.Tensor,
                          tp_group: TPGroup | dist.ProcessGroup | None = None, *,
                          linear_op: LinearOp = F.linear) -> torch.Tensor:
    """``reduce_scatter(linear_op(input_, weight))`` over the tokens (dim -2), the products overlapped with
    the reduction (module docstring): ``[..., tp_size * n, in]`` on each rank -> this rank's
    ``[..., n, out]`` of the sum over the ranks. The backward all-gathers the output's gradient, as
    ``reduce_scatter_to_sequence_parallel_region`` does."""
    _check_tokens(input_, "matmul_reduce_scatter")
    tp = _resolve_tp_group(tp_group)
    if tp.size == 1:
        return linear_op(input_, weight, None)
    _chunk_of(input_.shape[_TOKENS], tp, "sequence dimension")
    return _MatmulReduceScatter.apply(input_, weight, tp, linear_op)


def set_overlap_communication(module: nn.Module, enabled: bool = True) -> int:
    """Sets ``overlap_communication`` on every sequence-parallel linear layer of ``module`` (itself
    included); returns how many. Enabling it on a module that has none raises, as a layer built with it
    and without ``sequence_parallel=True`` does."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"set_overlap_communication: module: expected an nn.Module, got "
                        f"{type(module).__name__}")
    layers = [m for m in module.modules() if getattr(m, "sequence_parallel", False)
              and hasattr(m, "overlap_communication")]
    if enabled and not layers:
        raise ValueError(f"set_overlap_communication: module: expected sequence-parallel linear layers "
                         f"(built with sequence_parallel=True), found none in {type(module).__name__}")
    for layer in layers:
        _check_overlap(type(layer).__name__, enabled, True, layer.quant_method)
    for layer in layers:
        layer.overlap_communication = enabled
    return len(layers)
