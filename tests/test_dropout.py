"""Dropout in training: the reference models drop where transformers does, and tensor parallelism draws
the masks as one unsharded model would.

Replicated activations (the residual stream, embeddings, a row-parallel layer's output) draw from the default
generators, which ``seed_tensor_parallel`` seeds alike on every rank: after ``torch.manual_seed`` in
transformers and ``seed_tensor_parallel`` with the same seed here, the logits in training equal transformers'
at tp_size 1, 2 and 4 (compiled whole too, at tp_size 2), and differ from the eval-mode logits (the dropout
did something). At tp_size 1 the sharded activations (attention probabilities, BART's FFN activations) draw
from the same stream, so there every dropout matches transformers; at tp_size 2 the ranks' halves of the FFN
activation lose different elements while the replicated stream stays equal on both ranks.

Masks are the generator's of the device that draws them and the references are computed on the CPU, so
under torchrun with CUDA these tests skip.

Layer drop: tpkit's BART, like transformers' since 5.23, draws a layer's number only where layerdrop is above
0; transformers up to 5.22 draws it in training whatever layerdrop is, which moves every later mask along the
stream. Where layerdrop is 0 the draw decides nothing, so the reference then takes it from a constant.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from checkpoints import (
    make_bart_checkpoint,
    make_gpt_bigcode_checkpoint,
    make_llama_checkpoint,
    random_token_ids,
)
from multirank import under_torchrun
from test_linear import gather_ranks

pytestmark = pytest.mark.skipif(under_torchrun() and torch.cuda.is_available(),
                                reason="masks drawn on a GPU differ from the CPU references")

SEED = 1234
# Dropout everywhere transformers has it, by model; "replicated" keeps only the replicated activations'.
DROPOUTS = {
    "bart": dict(dropout=0.3, attention_dropout=0.2, activation_dropout=0.4, encoder_layerdrop=0.3,
                 decoder_layerdrop=0.3),
    "gpt_bigcode": dict(embd_pdrop=0.3, resid_pdrop=0.2, attn_pdrop=0.4),
    "llama": dict(attention_dropout=0.4),
}
REPLICATED = {
    "bart": dict(DROPOUTS["bart"], attention_dropout=0.0, activation_dropout=0.0),
    "gpt_bigcode": dict(DROPOUTS["gpt_bigcode"], attn_pdrop=0.0),
}
MAKERS = {"bart": make_bart_checkpoint, "gpt_bigcode": make_gpt_bigcode_checkpoint,
          "llama": make_llama_checkpoint}


def _inputs(kind: str, vocab_size: int) -> dict[str, torch.Tensor]:
    if kind == "bart":
        input_ids, decoder_input_ids = random_token_ids(vocab_size, (2, 11), (2, 7), seed=5)
        return {"input_ids": input_ids, "decoder_input_ids": decoder_input_ids}
    return {"input_ids": random_token_ids(vocab_size, (2, 13), seed=5)[0]}


def _undrawn_layer_drop(rand: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``rand`` where ``torch.rand([])``, a layer-drop draw, gives 1 (keep the layer) without using the
    generator."""
    def undrawn(*size, **kwargs):
        return torch.ones([]) if size in ((), ([],)) and not kwargs else rand(*size, **kwargs)

    return undrawn


def _checkpoint(tmp_path_factory, kind: str, dropouts: dict[str, float]) -> tuple[str, dict, dict]:
    """The checkpoint's path, its inputs, and transformers' logits in training (after
    ``torch.manual_seed(SEED)``) and in eval mode."""
    path = tmp_path_factory.mktemp(f"{kind}_dropout")
    hf_model = MAKERS[kind](path, **dropouts)
    inputs = _inputs(kind, hf_model.config.vocab_size)
    layer_drop = any(p > 0.0 for name, p in dropouts.items() if name.endswith("layerdrop"))
    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        eval_logits = hf_model(**inputs).logits
        hf_model.train()
        torch.manual_seed(SEED)
        if not layer_drop:
            patch.setattr(torch, "rand", _undrawn_layer_drop(torch.rand))
        train_logits = hf_model(**inputs).logits
    hf_model.eval()
    return str(path), inputs, {"train": train_logits, "eval": eval_logits}


@pytest.fixture(scope="module", params=sorted(REPLICATED))
def replicated(request, tmp_path_factory):
    return request.param, *_checkpoint(tmp_path_factory, request.param, REPLICATED[request.param])


@pytest.fixture(scope="module", params=sorted(DROPOUTS))
def every_dropout(request, tmp_path_factory):
    return request.param, *_checkpoint(tmp_path_factory, request.param, DROPOUTS[request.param])


def _training_logits(path: str, tp_size: int, inputs: dict[str, torch.Tensor],
                     compiled: bool = False) -> torch.Tensor:
    from tpkit.models import from_pretrained
    from tpkit.parallel_layers import init_tensor_parallel, seed_tensor_parallel

    init_tensor_parallel(tp_size)
    model = from_pretrained(path).train()
    if compiled:  # AOTAutograd with eager kernels: the same draws as eager mode
        model = torch.compile(model, backend="aot_eager", fullgraph=True)
    seed_tensor_parallel(SEED)
    with torch.no_grad():
        return model(*inputs.values())


def _assert_dropped_as_transformers(logits: list[torch.Tensor], references: dict[str, torch.Tensor]) -> None:
    # float32 sums in other orders, scaled up by 1 / (1 - p): a mask off by one element is off by O(1).
    for rank_logits in logits:
        torch.testing.assert_close(rank_logits, references["train"], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(logits[0], references["eval"], rtol=1e-2, atol=1e-3), "nothing was dropped"


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_replicated_dropout_matches_transformers(ranks, replicated, tp_size):
    _, path, inputs, references = replicated
    _assert_dropped_as_transformers(ranks.run(tp_size, _training_logits, path, tp_size, inputs), references)


@pytest.fixture(scope="module", params=sorted(REPLICATED))
def replicated_no_layer_drop(request, tmp_path_factory):
    dropouts = {name: p for name, p in REPLICATED[request.param].items() if not name.endswith("layerdrop")}
    return request.param, *_checkpoint(tmp_path_factory, request.param, dropouts)


def test_compiled_replicated_dropout_matches_transformers(ranks, replicated_no_layer_drop):
    """Compiled whole (``fullgraph=True``), as a training step is: a replicated activation's dropout draws
    from the default generators inside the graph, alike on both ranks, whose collectives are in it too (at
    tp_size 1 the graph is the same without them). (Layer drop decides in Python on a drawn number, which
    breaks the graph, as in transformers.)"""
    _, path, inputs, references = replicated_no_layer_drop
    logits = ranks.run(2, _training_logits, path, 2, inputs, True)
    _assert_dropped_as_transformers(logits, references)


def test_every_dropout_matches_transformers_at_tp_size_1(ranks, every_dropout):
    _, path, inputs, references = every_dropout
    _assert_dropped_as_transformers(ranks.run(1, _training_logits, path, 1, inputs), references)


def _check_ffn_masks(path: str, inputs: dict[str, torch.Tensor]) -> None:
    """BART at tp_size 2 in training: the ranks' halves of the first encoder layer's FFN activation lose
    about half their elements each, at different positions (one stream for both halves would drop the same
    positions of each), and the logits are equal on both ranks."""
    from tpkit.models import from_pretrained
    from tpkit.parallel_layers import get_tp_group, init_tensor_parallel, seed_tensor_parallel

    init_tensor_parallel(2)
    model = from_pretrained(path).train()
    seed_tensor_parallel(SEED)
    dropped = []  # [batch, seq, ffn_dim / 2]: zeros entering fc2
    model.encoder.layers[0].fc2.register_forward_pre_hook(lambda _, args: dropped.append(args[0] == 0))
    with torch.no_grad():
        logits = model(*inputs.values())
    tp = get_tp_group()
    mask0, mask1 = gather_ranks(dropped[0].float(), tp)
    for mask in (mask0, mask1):
        assert 0.4 < mask.mean().item() < 0.6
    assert (mask0 != mask1).float().mean().item() > 0.3
    logits0, logits1 = gather_ranks(logits, tp)
    torch.testing.assert_close(logits0, logits1, rtol=0, atol=0)


def test_sharded_dropout_masks_differ_across_ranks(ranks, tmp_path_factory):
    path, inputs, _ = _checkpoint(tmp_path_factory, "bart", dict(dropout=0.0, activation_dropout=0.5))
    ranks.run(2, _check_ffn_masks, path, inputs)


def _unseeded_training(path: str, inputs: dict[str, torch.Tensor]) -> str:
    from tpkit.models import from_pretrained
    from tpkit.parallel_layers import init_tensor_parallel

    init_tensor_parallel(2)
    model = from_pretrained(path)
    with torch.no_grad():
        model(*inputs.values())  # eval mode: nothing dropped, no seeding needed
        model.train()
        try:
            model(*inputs.values())
        except RuntimeError as error:
            return str(error)
    return "no error"


def test_dropout_across_ranks_needs_seeding(ranks, replicated):
    kind, path, inputs, _ = replicated
    for message in ranks.run(2, _unseeded_training, path, inputs):
        assert "seed_tensor_parallel" in message, (kind, message)


def test_bad_dropout_arguments():
    from tpkit.attention import Attention, PagedKVCache
    from tpkit.parallel_layers import tensor_parallel_dropout

    x = torch.randn(2, 3, 8)
    for p in (-0.1, 1.0, True, "0.1"):
        with pytest.raises(ValueError, match="p must be a probability in"):
            tensor_parallel_dropout(x, p)
    attn = Attention(2, 4)
    with pytest.raises(ValueError, match="dropout_p: expected a probability"):
        attn(x, x, x, dropout_p=1.5)
    cache = PagedKVCache(num_layers=1, num_blocks=4, block_size=4, num_kv_heads=2, head_size=4,
                         dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="dropout_p: expected 0 with a kv_cache"):
        attn(x, x, x, kv_cache=cache, metadata=cache.prefill_metadata([0, 1], [3, 3]), dropout_p=0.1)
