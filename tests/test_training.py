"""A training step's gradients: tpkit's models against transformers, at tp_size 1, 2 and 4, eager and
compiled.

The parent computes transformers' loss and the gradient of every parameter, by checkpoint name. Each rank
loads its shard, runs the same loss forward and backward (for the decoder-only models from each rank's
vocabulary columns too, ``lm_head.cross_entropy``), sums the
replicated KV heads' gradients (``reduce_kv_replica_grads``), checks the whole model's gradient norms and
clipping (``clip_grad_norm_``), and compares each parameter's gradient with transformers' gradient sharded
as the weights are: loaded through the model's own ``load_weights`` into a zeroed copy of the model.
Llama with GQA (KV heads replicated at tp_size 4), tied embeddings and biases; GPT-BigCode with
multi-query attention (replicated at 2 and 4) and its fused ``c_attn``; BART, whose cross-attention is
``QKVCrossParallelLinear``. All three also built with ``sequence_parallel=True`` (their norms' gradients
summed by ``reduce_sequence_parallel_grads``), at tp_size 2 and 4.

Every case runs eager. Each model, with and without sequence parallelism, also runs compiled at one tp_size
above 1, where the traced graph holds the collectives (at tp_size 1 it holds none, and another tp_size
traces the same code with other shapes): Llama without sequence parallelism at 4, where its KV heads are
replicated, the rest at 2 (GPT-BigCode's single KV head is replicated there).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from checkpoints import (
    make_bart_checkpoint,
    make_gpt_bigcode_checkpoint,
    make_llama_checkpoint,
    random_token_ids,
)
from multirank import device

# float32, summed in other orders across ranks and against transformers: relative, and absolute against the
# tensor's largest gradient (elements near 0 carry the rounding of the large ones).
GRAD_RTOL, GRAD_ATOL_OF_MAX = 1e-4, 1e-4


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    # logits [batch, seq, vocab], labels [batch, seq]
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _references(hf_model, forward_args: dict[str, torch.Tensor], labels: torch.Tensor) -> dict:
    """transformers' loss and gradients, the latter under every name a parameter has (tied ones too)."""
    hf_model.zero_grad()
    loss = _loss(hf_model(**forward_args).logits, labels)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in hf_model.named_parameters(remove_duplicate=False)}
    every = torch.cat([p.grad.flatten() for p in hf_model.parameters()])  # each parameter once
    hf_model.zero_grad()
    return {"forward_args": tuple(forward_args.values()), "labels": labels, "ref_loss": loss.detach(),
            "ref_grads": grads, "ref_norms": (every.norm(), every.abs().max())}


def _sharded_like_weights(model, path: str, grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' gradients, each in this rank's shard of the parameter it loads into: a zeroed copy of
    ``model`` loads them (buffers the checkpoint holds as zeros) through its own ``load_weights``."""
    from tpkit.loaders import iter_weights
    from tpkit.parallel_layers import skip_init

    with skip_init():
        shadow = type(model)(model.config, device=device(), tp_group=model.tp_group)
    for tensor in (*shadow.parameters(), *shadow.buffers()):
        tensor.detach().zero_()
    shadow.load_weights((name, grads[name] if name in grads else torch.zeros(tuple(handle.shape)))
                        for name, handle in iter_weights(path))
    return dict(shadow.named_parameters())


def check_training_step(path: str, tp_size: int, forward_args: tuple[torch.Tensor, ...], labels: torch.Tensor,
                        ref_loss: torch.Tensor, ref_grads: dict[str, torch.Tensor],
                        ref_norms: tuple[torch.Tensor, torch.Tensor], sequence_parallel: bool = False,
                        compiled: bool = False) -> int:
    """On every rank: loss and every parameter's gradient equal transformers', eager and, with ``compiled``,
    compiled (AOTAutograd gradients, ``fullgraph=True``), and for decoder-only models with the loss from each
    rank's vocabulary columns (``lm_head.cross_entropy``); the whole model's gradient norms (2 and inf) equal
    theirs, and clipping to half the 2-norm scales every gradient by a half. Returns how many QKV layers had
    replicated KV heads."""
    from tpkit.models import from_pretrained
    from tpkit.parallel_layers import (
        clip_grad_norm_,
        init_tensor_parallel,
        reduce_kv_replica_grads,
        reduce_sequence_parallel_grads,
    )

    init_tensor_parallel(tp_size)
    model = from_pretrained(path, device=device(), sequence_parallel=sequence_parallel)
    expected = _sharded_like_weights(model, path, ref_grads)
    args = tuple(t.to(device()) for t in forward_args)
    labels = labels.to(device())
    losses = [lambda: _loss(model(*args), labels)]
    if compiled:
        compiled_model = torch.compile(model, backend="aot_eager", fullgraph=True)
        losses.append(lambda: _loss(compiled_model(*args), labels))
    if hasattr(model, "hidden_states"):  # decoder-only: the loss from each rank's vocabulary columns too
        positions = torch.arange(args[0].shape[1], device=device()).expand_as(args[0])
        losses.append(lambda: model.lm_head.cross_entropy(model.hidden_states(args[0], positions), labels))
    reduced = 0
    for compute_loss in losses:
        model.zero_grad(set_to_none=True)
        loss = compute_loss()
        loss.backward()
        reduced = reduce_kv_replica_grads(model)
        assert (reduce_sequence_parallel_grads(model) > 0) == sequence_parallel
        torch.testing.assert_close(loss.cpu(), ref_loss, rtol=1e-5, atol=1e-6)
        norm, max_abs = ref_norms
        # An inf-norm and a max_norm that clips nothing, then clipping to half the 2-norm.
        inf_norm = clip_grad_norm_(model, 1e9, float("inf"))
        torch.testing.assert_close(inf_norm.cpu(), max_abs, rtol=1e-4, atol=0)
        torch.testing.assert_close(clip_grad_norm_(model, 0.5 * norm.item()).cpu(), norm, rtol=1e-4, atol=0)
        scale = 0.5 * norm.item() / (norm.item() + 1e-6)
        for name, param in model.named_parameters():
            if not param.requires_grad:  # BART's final_logits_bias, a buffer in transformers
                assert param.grad is None, f"{name}: a gradient for a frozen parameter"
                continue
            assert param.grad is not None, f"{name}: no gradient"
            atol = GRAD_ATOL_OF_MAX * scale * expected[name].abs().max().item()
            torch.testing.assert_close(param.grad, scale * expected[name], rtol=GRAD_RTOL, atol=atol,
                                       msg=lambda m, name=name: f"{name}: {m}")
    return reduced


def _decoder_only(hf_model, seq_len: int = 13) -> dict:
    input_ids, last = random_token_ids(hf_model.config.vocab_size, (2, seq_len), (2, 1), seed=2)
    labels = torch.cat([input_ids[:, 1:], last], dim=1)  # each position predicts the next token
    return _references(hf_model, {"input_ids": input_ids}, labels)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_train")
    hf_model = make_llama_checkpoint(path, num_key_value_heads=2, tie_word_embeddings=True,
                                     attention_bias=True)
    return str(path), _decoder_only(hf_model)


@pytest.fixture(scope="module")
def gpt_bigcode(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_bigcode_train")
    return str(path), _decoder_only(make_gpt_bigcode_checkpoint(path))


def _bart(tmp_path_factory, name: str, encoder_len: int, decoder_len: int, seed: int) -> tuple[str, dict]:
    path = tmp_path_factory.mktemp(name)
    hf_model = make_bart_checkpoint(path, scale_embedding=True)
    shapes = (2, encoder_len), (2, decoder_len), (2, decoder_len)
    input_ids, decoder_input_ids, labels = random_token_ids(hf_model.config.vocab_size, *shapes, seed=seed)
    return str(path), _references(hf_model, {"input_ids": input_ids, "decoder_input_ids": decoder_input_ids},
                                  labels)


@pytest.fixture(scope="module")
def bart(tmp_path_factory):
    return _bart(tmp_path_factory, "bart_train", 11, 7, seed=3)


@pytest.mark.parametrize(("tp_size", "compiled"), [(1, False), (2, False), (4, True)])
def test_llama_training_step(ranks, llama, tp_size, compiled):
    path, refs = llama
    reduced = ranks.run(tp_size, check_training_step, path, tp_size, **refs, compiled=compiled, timeout=240)
    assert set(reduced) == {2 if tp_size == 4 else 0}  # 2 KV heads: replicated at tp_size 4


@pytest.mark.parametrize(("tp_size", "compiled"), [(1, False), (2, True), (4, False)])
def test_gpt_bigcode_training_step(ranks, gpt_bigcode, tp_size, compiled):
    path, refs = gpt_bigcode
    reduced = ranks.run(tp_size, check_training_step, path, tp_size, **refs, compiled=compiled, timeout=240)
    assert set(reduced) == {0 if tp_size == 1 else 2}  # multi-query: replicated from tp_size 2


@pytest.mark.parametrize(("tp_size", "compiled"), [(1, False), (2, True), (4, False)])
def test_bart_training_step(ranks, bart, tp_size, compiled):
    path, refs = bart
    ranks.run(tp_size, check_training_step, path, tp_size, **refs, compiled=compiled, timeout=240)


@pytest.fixture(scope="module", params=["llama", "gpt_bigcode"])
def decoder_only_16_tokens(request, tmp_path_factory):
    """A decoder-only checkpoint and references for 16 tokens a sequence, which 2 and 4 ranks split."""
    path = tmp_path_factory.mktemp(f"{request.param}_sequence_parallel")
    if request.param == "llama":
        hf_model = make_llama_checkpoint(path, num_key_value_heads=2, attention_bias=True)
    else:
        hf_model = make_gpt_bigcode_checkpoint(path)
    return str(path), _decoder_only(hf_model, seq_len=16)


@pytest.fixture(scope="module")
def bart_12_and_8_tokens(tmp_path_factory):
    """BART with 12 encoder and 8 decoder tokens a sequence, which 2 and 4 ranks split."""
    return _bart(tmp_path_factory, "bart_sequence_parallel", 12, 8, seed=4)


@pytest.mark.parametrize(("tp_size", "compiled"), [(2, True), (4, False)])
def test_sequence_parallel_training_step(ranks, decoder_only_16_tokens, tp_size, compiled):
    path, refs = decoder_only_16_tokens
    ranks.run(tp_size, check_training_step, path, tp_size, **refs, sequence_parallel=True, compiled=compiled,
              timeout=240)


@pytest.mark.parametrize(("tp_size", "compiled"), [(2, True), (4, False)])
def test_bart_sequence_parallel_training_step(ranks, bart_12_and_8_tokens, tp_size, compiled):
    path, refs = bart_12_and_8_tokens
    ranks.run(tp_size, check_training_step, path, tp_size, **refs, sequence_parallel=True, compiled=compiled,
              timeout=240)


def _sequence_parallel_refusals(path: str) -> list[str]:
    from tpkit.models import from_pretrained
    from tpkit.parallel_layers import init_tensor_parallel

    init_tensor_parallel(2)
    model = from_pretrained(path, device=device(), sequence_parallel=True)
    messages = []
    for call in (lambda: model(torch.full((1, 5), 3, device=device())), lambda: model.generate([[3, 4]], 2)):
        with pytest.raises(ValueError) as error:
            call()
        messages.append(str(error.value))
    return messages


def test_sequence_parallel_refuses_what_it_cannot_split(ranks, decoder_only_16_tokens):
    path, _ = decoder_only_16_tokens
    for length, generation in ranks.run(2, _sequence_parallel_refusals, path):
        assert "expected a sequence length divisible by tp_size=2, received 5" in length
        assert "runs full forwards only (training)" in generation
