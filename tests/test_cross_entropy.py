"""Vocab-parallel cross entropy (ParallelLMHead.cross_entropy, vocab_parallel_cross_entropy) against
F.cross_entropy of nn.Linear's full logits: the loss for every reduction, with ignored tokens, the
gradients of the hidden states, the head's rows and its bias; tp_size 1, 2, 4, and compiled at 2 and 4."""

from __future__ import annotations

import re

import multirank
import pytest
import torch
import torch.nn.functional as F
from test_linear import load
from torch import nn

from tpkit.parallel_layers import ParallelLMHead, TPGroup, init_tensor_parallel, vocab_parallel_cross_entropy

DIM = 16
TOL = {"rtol": 1e-5, "atol": 1e-6}
# (num_embeddings, padding_size): padding in the last shard; at tp_size 4 whole shards of padding (10 in 64).
VOCABS = ((1000, 64), (10, 64))


def _check(tp: TPGroup, device: torch.device, num_embeddings: int, padding_size: int) -> None:
    generator = torch.Generator().manual_seed(num_embeddings)
    ref = nn.Linear(DIM, num_embeddings, bias=True, device=device)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(num_embeddings, DIM, generator=generator))
        ref.bias.copy_(torch.randn(num_embeddings, generator=generator))
    head = ParallelLMHead(num_embeddings, DIM, bias=True, padding_size=padding_size, device=device)
    load(head.weight, ref.weight)
    load(head.bias, ref.bias)
    start, rows = head.vocab_start_index, head.num_real_rows

    hidden = torch.randn(3, 7, DIM, generator=generator).to(device)
    labels = torch.randint(0, num_embeddings, (3, 7), generator=generator).to(device)
    labels[0, 0], labels[1, 1], labels[2, 2], labels[2, 3] = 0, num_embeddings - 1, -100, -100
    def expected_loss(hidden: torch.Tensor, labels: torch.Tensor, **kwargs) -> torch.Tensor:
        return F.cross_entropy(ref(hidden).transpose(1, 2), labels, **kwargs)  # classes in dim 1

    for reduction in ("mean", "sum", "none"):
        expected = expected_loss(hidden, labels, reduction=reduction)
        loss = head.cross_entropy(hidden, labels, reduction=reduction)
        assert loss.dtype == torch.float32 and loss.shape == expected.shape
        torch.testing.assert_close(loss, expected, **TOL)

    # Gradients, under a weighting that differs from token to token.
    weights = torch.rand(3, 7, generator=generator).to(device)
    hidden_ref = hidden.clone().requires_grad_(True)
    (expected_loss(hidden_ref, labels, reduction="none") * weights).sum().backward()
    hidden_tp = hidden.clone().requires_grad_(True)
    (head.cross_entropy(hidden_tp, labels, reduction="none") * weights).sum().backward()
    torch.testing.assert_close(hidden_tp.grad, hidden_ref.grad, **TOL)
    torch.testing.assert_close(head.weight.grad[:rows], ref.weight.grad[start:start + rows], **TOL)
    torch.testing.assert_close(head.bias.grad[:rows], ref.bias.grad[start:start + rows], **TOL)
    assert not head.weight.grad[rows:].any() and not head.bias.grad[rows:].any()  # padding rows

    # A second id ignored: ignore_index is the caller's.
    labels = labels.clamp(min=0)
    loss = head.cross_entropy(hidden, labels, ignore_index=0)
    torch.testing.assert_close(loss, expected_loss(hidden, labels, ignore_index=0), **TOL)

    # Compiled whole (the collectives inside the autograd function traced), the same loss and gradient. At
    # tp_size 1 the function is the same without collectives.
    if tp.size == 1:
        return
    compiled = torch.compile(lambda x: head.cross_entropy(x, labels), backend="aot_eager", fullgraph=True)
    hidden_c = hidden.clone().requires_grad_(True)
    compiled(hidden_c).backward()
    hidden_e = hidden.clone().requires_grad_(True)
    head.cross_entropy(hidden_e, labels).backward()
    torch.testing.assert_close(hidden_c.grad, hidden_e.grad, **TOL)


def _check_across_ranks(tp_size: int) -> None:
    tp = init_tensor_parallel()
    assert tp.size == tp_size
    for num_embeddings, padding_size in VOCABS:
        _check(tp, multirank.device(), num_embeddings, padding_size)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_cross_entropy_across_ranks(ranks, tp_size: int) -> None:
    ranks.run(tp_size, _check_across_ranks, tp_size)


def test_cross_entropy_of_bfloat16_logits() -> None:
    """bfloat16 logits: the loss in float32 as F.cross_entropy of the same logits in float32, the gradient
    in bfloat16."""
    single = TPGroup(None, 0, 1)
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 9, 128, generator=generator).bfloat16().requires_grad_(True)
    labels = torch.randint(0, 100, (5, 9), generator=generator)
    loss = vocab_parallel_cross_entropy(logits, labels, 0, 100, tp_group=single)
    expected_logits = logits.detach().float()[..., :100].requires_grad_(True)
    expected = F.cross_entropy(expected_logits.transpose(1, 2), labels)
    torch.testing.assert_close(loss, expected, **TOL)
    loss.backward()
    expected.backward()
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(logits.grad[..., :100].float(), expected_logits.grad, rtol=1e-2, atol=1e-4)
    assert not logits.grad[..., 100:].any()


LONG = torch.long


@pytest.mark.parametrize(("labels", "num_real_rows", "reduction", "message"), [
    (torch.zeros(4), 8, "mean", "labels must be int64 vocabulary ids, received dtype torch.float32"),
    (torch.zeros(5, dtype=LONG), 8, "mean", "labels must have the logits' leading shape (4,), received (5,)"),
    (torch.zeros(4, dtype=LONG), 9, "mean",
     "num_real_rows must lie in [0, 8] (the logits' last dimension), received 9"),
    (torch.zeros(4, dtype=LONG), 8, "avg",
     "reduction must be one of ('mean', 'sum', 'none'), received 'avg'"),
])
def test_cross_entropy_rejects_bad_arguments(labels, num_real_rows, reduction, message) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        vocab_parallel_cross_entropy(torch.randn(4, 8), labels, 0, num_real_rows,
                                     tp_group=TPGroup(None, 0, 1), reduction=reduction)
