"""Cross entropy of logits split over the vocabulary (Megatron's vocab-parallel cross entropy).

A training step's loss needs, per token, the log of the sum of exp over the whole vocabulary and the
label's logit. Gathering the logits first (``ParallelLMHead.compute_logits``) puts ``[tokens, vocab]`` on
every rank; here each rank keeps its ``[tokens, vocab / tp_size]`` columns and the group exchanges three
numbers a token in two all-reduces: the maximum, then the sum of exps and the label's logit together. The
gradient, softmax minus the label's one-hot, is this rank's columns alone: the backward communicates
nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ._checks import _check_indices
from ._failures import collective_failed
from .mappings import _all_reduce
from .state import TPGroup, _resolve_tp_group

_REDUCTIONS = ("mean", "sum", "none")


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, vocab_start_index: int, num_real_rows: int,
                ignore_index: int, tp: TPGroup) -> torch.Tensor:
        # logits [tokens, vocab_per_partition], labels [tokens]
        ctx.logits_dtype = logits.dtype
        logits = logits.float()
        if num_real_rows < logits.shape[-1]:  # padding columns take no probability
            padding = torch.arange(logits.shape[-1], device=logits.device) >= num_real_rows
            logits = logits.masked_fill(padding, float("-inf"))
        row_max = logits.max(dim=-1).values
        if tp.size > 1:
            try:
                dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=tp.group)
            except RuntimeError as error:
                raise collective_failed("all-reduce (max)", tp.group, row_max, error) from error
        shifted = logits - row_max[:, None]
        exp = shifted.exp()
        local = labels - vocab_start_index
        ignored = labels == ignore_index
        here = (local >= 0) & (local < num_real_rows) & ~ignored
        column = torch.where(here, local, 0)
        label_logit = torch.where(here, shifted.gather(-1, column[:, None]).squeeze(-1), 0.0)
        # [2, tokens]: each rank's sum of exps and its share of the label's logit (the label's rank alone)
        sums = torch.stack([exp.sum(dim=-1), label_logit])
        if tp.size > 1:
            _all_reduce(sums, tp)
        sum_exp, label_logit = sums
        loss = torch.where(ignored, 0.0, sum_exp.log() - label_logit)
        exp.div_(sum_exp[:, None])  # now the softmax
        ctx.save_for_backward(exp, column, here, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, column, here, ignored = ctx.saved_tensors
        # softmax - one_hot(label) on this rank's columns; out of place, so a second backward finds the
        # softmax intact.
        grad = softmax.scatter_add(-1, column[:, None], -here[:, None].to(softmax.dtype))
        grad.mul_(torch.where(ignored, 0.0, grad_loss)[:, None])
        return grad.to(ctx.logits_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_start_index: int,
    num_real_rows: int,
    *,
    tp_group: TPGroup | dist.ProcessGroup | DeviceMesh | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy`` of the full-vocabulary logits, from this rank's columns of them.

    ``logits`` ``[..., vocab_per_partition]`` are columns ``[vocab_start_index, vocab_start_index +
    vocab_per_partition)`` of the vocabulary, of which the first ``num_real_rows`` are real (the rest
    padding), as :meth:`ParallelLMHead.compute_sharded_logits` gives them; ``labels`` ``[...]`` are int64
    vocabulary ids, or ``ignore_index`` for tokens that take no loss. ``reduction``: "mean" (over the tokens
    not ignored), "sum" or "none" (float32 ``[...]``, 0 where ignored). Computed in float32; the gradient
    has the logits' dtype. Every rank of the group must call it with the same labels. A negative label
    other than ``ignore_index`` (at tp_size 1 also one past the vocabulary) is refused on the CPU (on GPUs
    with ``TPKIT_DEBUG=1``); past the vocabulary at tp_size > 1 only ``ParallelLMHead.cross_entropy``,
    which knows its size, refuses it: an id outside the vocabulary is no rank's column.
    """
    if labels.dtype != torch.long:
        raise ValueError(f"labels must be int64 vocabulary ids, received dtype {labels.dtype}")
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"labels must have the logits' leading shape {tuple(logits.shape[:-1])}, received "
                         f"{tuple(labels.shape)}")
    if not 0 <= num_real_rows <= logits.shape[-1]:
        raise ValueError(f"num_real_rows must lie in [0, {logits.shape[-1]}] (the logits' last dimension), "
                         f"received {num_real_rows}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, received {reduction!r}")
    tp = _resolve_tp_group(tp_group)
    # A negative label other than ignore_index (and at tp_size 1 one past the vocabulary) is no rank's column:
    # refused where that is free, on the CPU (ParallelLMHead.cross_entropy also knows the whole vocabulary).
    upper = vocab_start_index + num_real_rows if tp.size == 1 else 2**62
    _check_indices("vocab_parallel_cross_entropy", "labels", labels.masked_fill(labels == ignore_index, 0),
                   upper)
    loss = _VocabParallelCrossEntropy.apply(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                            vocab_start_index, num_real_rows, ignore_index, tp)
    if reduction == "none":
        return loss.view(labels.shape)
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (labels != ignore_index).sum()
