"""VocabParallelEmbedding and ParallelLMHead against nn.Embedding / nn.Linear at tp_size 1, 2, 4."""

from __future__ import annotations

import multirank
import pytest
import torch
from test_linear import LazyHandle, assert_rejected, load
from torch import nn

from tpkit.parallel_layers import (
    ParallelLMHead,
    TPGroup,
    VocabParallelEmbedding,
    init_tensor_parallel,
    pad_vocab_size,
)

TOL = {"rtol": 1e-5, "atol": 1e-5}
DIM = 8
# (num_embeddings, padding_size): padding within the last shard; whole padding shards at tp_size 4
# (10 rows padded to 64); a padding_size that tp_size does not divide (6 -> multiples of 12 at tp_size 4).
VOCABS = ((100, 64), (10, 64), (50, 6), (128, 64))


def _expected_padded(num_embeddings: int, padding_size: int, tp_size: int) -> int:
    padded = padding_size
    while padded < num_embeddings or padded % tp_size:
        padded += padding_size
    return padded


def _rows(layer: VocabParallelEmbedding, tp: TPGroup) -> tuple[int, int]:
    """[start, stop) of the real vocabulary rows this rank holds, derived from the padded size alone."""
    per_rank = layer.num_embeddings_padded // tp.size
    start = tp.rank * per_rank
    return start, max(start, min(start + per_rank, layer.num_embeddings))


def _ids(num_embeddings: int, device: torch.device) -> torch.Tensor:
    # [2, 9]: random ids plus the first and last of the vocabulary
    ids = torch.randint(0, num_embeddings, (2, 9), device=device)
    ids[0, 0], ids[1, -1] = 0, num_embeddings - 1
    return ids


def _check_embedding(tp: TPGroup, device: torch.device, num_embeddings: int, padding_size: int) -> None:
    ref = nn.Embedding(num_embeddings, DIM, device=device)
    layer = VocabParallelEmbedding(num_embeddings, DIM, padding_size, device=device)
    padded = _expected_padded(num_embeddings, padding_size, tp.size)
    assert layer.num_embeddings_padded == padded == pad_vocab_size(num_embeddings, padding_size, tp.size)
    assert layer.weight.shape == (padded // tp.size, DIM)
    start, stop = _rows(layer, tp)
    assert load(layer.weight, ref.weight) == (stop - start) * DIM  # only this rank's rows are read
    torch.testing.assert_close(layer.weight[: stop - start], ref.weight[start:stop], rtol=0, atol=0)
    assert not layer.weight[stop - start:].any()

    ids = _ids(num_embeddings, device)
    out = layer(ids)
    expected = ref(ids)
    torch.testing.assert_close(out, expected, **TOL)
    g = torch.randn_like(expected)
    (expected * g).sum().backward()
    (out * g).sum().backward()
    torch.testing.assert_close(layer.weight.grad[: stop - start], ref.weight.grad[start:stop], **TOL)
    assert not layer.weight.grad[stop - start:].any()

    assert_rejected(layer.weight, torch.randn(num_embeddings + 1, DIM), None, "VocabParallelEmbedding.weight",
                    str((num_embeddings, DIM)), str((num_embeddings + 1, DIM)))
    assert_rejected(layer.weight, torch.randn(num_embeddings, DIM), "q", "loaded_shard_id")


def _check_lm_head(tp: TPGroup, device: torch.device, num_embeddings: int, padding_size: int) -> None:
    ref = nn.Linear(DIM, num_embeddings, bias=True, device=device)
    head = ParallelLMHead(num_embeddings, DIM, bias=True, padding_size=padding_size, device=device)
    start, stop = _rows(head, tp)
    assert load(head.weight, ref.weight) == (stop - start) * DIM
    assert load(head.bias, ref.bias) == stop - start
    assert not head.bias[stop - start:].any()

    hidden = torch.randn(2, 3, DIM, device=device)
    hidden_ref = hidden.clone().requires_grad_()
    hidden = hidden.requires_grad_()
    logits = head.compute_logits(hidden)
    expected = ref(hidden_ref)
    assert logits.shape == (2, 3, num_embeddings)  # full vocabulary on every rank, padding removed
    torch.testing.assert_close(logits, expected, **TOL)
    torch.testing.assert_close(head(hidden), logits, rtol=0, atol=0)
    g = torch.randn_like(expected)
    (expected * g).sum().backward()
    (logits * g).sum().backward()
    torch.testing.assert_close(hidden.grad, hidden_ref.grad, **TOL)
    torch.testing.assert_close(head.weight.grad[: stop - start], ref.weight.grad[start:stop], **TOL)
    torch.testing.assert_close(head.bias.grad[: stop - start], ref.bias.grad[start:stop], **TOL)
    assert_rejected(head.bias, torch.randn(num_embeddings - 1), None, "ParallelLMHead.bias",
                    str((num_embeddings,)), str((num_embeddings - 1,)))


def _check_tied(tp: TPGroup, device: torch.device, num_embeddings: int, padding_size: int) -> None:
    ref = nn.Embedding(num_embeddings, DIM, device=device)

    class TiedLM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = VocabParallelEmbedding(num_embeddings, DIM, padding_size, device=device)
            self.lm_head = ParallelLMHead(num_embeddings, DIM, padding_size=padding_size, device=device)
            assert self.lm_head.tie_weights(self.embed_tokens) is self.lm_head

    model = TiedLM()
    assert model.lm_head.weight is model.embed_tokens.weight
    assert [name for name, _ in model.named_parameters()] == ["embed_tokens.weight"]
    params = dict(model.named_parameters())
    load(params["embed_tokens.weight"], ref.weight)  # loading the embedding loads the head

    ids = _ids(num_embeddings, device)
    logits = model.lm_head.compute_logits(model.embed_tokens(ids))
    expected = ref(ids) @ ref.weight.T  # [2, 9, num_embeddings]
    torch.testing.assert_close(logits, expected, **TOL)
    g = torch.randn_like(expected)
    (expected * g).sum().backward()
    (logits * g).sum().backward()
    start, stop = _rows(model.embed_tokens, tp)
    # both uses of the shared weight contribute to its gradient, as in the tied reference
    torch.testing.assert_close(model.embed_tokens.weight.grad[: stop - start], ref.weight.grad[start:stop],
                               **TOL)


def _check_bad_input(tp: TPGroup, device: torch.device) -> None:
    embedding = VocabParallelEmbedding(100, DIM, device=device)
    with pytest.raises(ValueError, match="tie_weights needs the same sharding"):
        ParallelLMHead(101, DIM, padding_size=8, device=device).tie_weights(embedding)
    with pytest.raises(ValueError, match="tie_weights needs the same sharding"):
        ParallelLMHead(100, DIM + 1, device=device).tie_weights(embedding)
    with pytest.raises(TypeError, match="tie_weights takes a VocabParallelEmbedding, got Embedding"):
        ParallelLMHead(100, DIM, device=device).tie_weights(nn.Embedding(100, DIM))
    with pytest.raises(ValueError, match="padding_size must be a positive int, got 0"):
        VocabParallelEmbedding(100, DIM, padding_size=0)
    with pytest.raises(ValueError, match="num_embeddings must be a positive int, got -5"):
        ParallelLMHead(-5, DIM)
    with pytest.raises(TypeError, match="loaded_weight"):
        embedding.weight.weight_loader(embedding.weight, LazyHandle)


def _check_default_init(tp: TPGroup, device: torch.device) -> None:
    torch.manual_seed(2)
    embedding = VocabParallelEmbedding(100, DIM, padding_size=64, device=device)
    head = ParallelLMHead(100, DIM, bias=True, padding_size=64, device=device)
    for layer in (embedding, head):
        start, stop = _rows(layer, tp)
        real = layer.weight[: stop - start]
        assert real.numel() == 0 or real.std() > 0.1
        assert not layer.weight[stop - start:].any()
    assert head.weight.abs().max() <= DIM ** -0.5
    assert not head.bias[_rows(head, tp)[1] - _rows(head, tp)[0]:].any()


def _check_vocab_layers(tp_size: int) -> None:
    tp = init_tensor_parallel()
    assert tp.size == tp_size
    device = multirank.device()
    torch.manual_seed(0)
    for num_embeddings, padding_size in VOCABS:
        _check_embedding(tp, device, num_embeddings, padding_size)
        _check_lm_head(tp, device, num_embeddings, padding_size)
        _check_tied(tp, device, num_embeddings, padding_size)
    _check_bad_input(tp, device)
    _check_default_init(tp, device)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_vocab_layers(ranks, tp_size: int) -> None:
    ranks.run(tp_size, _check_vocab_layers, tp_size)
