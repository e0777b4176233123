"""tpkit.checkpoint: save, resume at the same and at another tp_size, export to HuggingFace, refuse bad input.

A small Llama (4 query heads, 2 KV heads: replicated at tp_size 4; tied embeddings; a vocabulary of 300,
padded differently at every tp_size, so that at tp_size 4 the last rank holds padding only; o_proj's bias,
replicated) and a BART (dropout 0.1 on the residual stream, drawn alike at every tp_size) train with AdamW
at tp_size 1 (one process, no torch.distributed), 2 and 4 (gloo ranks). Each run saves after N steps and
goes on for M more; fresh, randomly initialised models with optimizers of another learning rate then load
the checkpoint of the same tp_size and of another (1 -> 2, 2 -> 4, 4 -> 1) and train the same M steps: the
losses equal the uninterrupted run's bit for bit at the same tp_size (the generator states restored), and
within float32 rounding across sizes. The exported HuggingFace directories load into transformers with
tpkit's logits, and into ``from_pretrained`` at another tp_size.
"""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from checkpoints import make_bart_checkpoint, make_gpt_bigcode_checkpoint, make_llama_checkpoint
from multirank import device, under_torchrun

N, M = 2, 2
VOCAB = 300
# float32 rounding across tp sizes (sums in another order), grown over M AdamW steps
ACROSS_SIZES = dict(rtol=1e-4, atol=1e-5)
LOGITS = dict(rtol=1e-4, atol=1e-4)


def _batch(kind: str, step: int) -> tuple[torch.Tensor, ...]:
    """The step's (inputs..., labels), the same on every rank: [2, 8] token ids."""
    generator = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(3, VOCAB, (2, 9), generator=generator)
    if kind == "llama":
        return ids[:, :-1], ids[:, 1:]
    return torch.randint(3, VOCAB, (2, 7), generator=generator), ids[:, :-1], ids[:, 1:]


def _logits(model, kind: str, step: int) -> torch.Tensor:
    inputs = [t.to(device()) for t in _batch(kind, step)[:-1]]
    return model(*inputs)


def _train(model, optimizer, kind: str, steps: range) -> list[float]:
    from tpkit.parallel_layers import clip_grad_norm_, reduce_kv_replica_grads

    losses = []
    for step in steps:
        labels = _batch(kind, step)[-1].to(device())
        loss = F.cross_entropy(_logits(model, kind, step).flatten(0, 1), labels.flatten())
        loss.backward()
        reduce_kv_replica_grads(model)
        clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _fresh(model, seed: int):
    """A randomly initialised model of the same class, config and group, and an AdamW of another lr."""
    torch.manual_seed(seed)
    fresh = type(model)(model.config, device=device(), tp_group=model.tp_group).train()
    return fresh, torch.optim.AdamW(fresh.parameters(), lr=1.0)


def run_training(paths: dict[str, str], tp_size: int, work: str, resume_from: int | None) -> dict:
    """Every rank: for each model, train N steps, save, train M more; load that checkpoint (and the one of
    tp_size ``resume_from``) into fresh models and train the same M steps; export. Returns the losses and,
    for the export, the logits of a fixed batch."""
    from tpkit.checkpoint import export_hf, load, save
    from tpkit.models import from_pretrained
    from tpkit.parallel_layers import destroy_tensor_parallel, init_tensor_parallel, seed_tensor_parallel

    if tp_size > 1:
        init_tensor_parallel(tp_size)
    work = Path(work)
    results = {}
    try:
        for kind, path in paths.items():
            model = from_pretrained(path, device=device()).train()
            # After building: sharded layers draw their seeds from the default generator at tp_size > 1.
            seed_tensor_parallel(0)
            optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
            out = {"first": _train(model, optimizer, kind, range(N))}
            save(work / f"{kind}-tp{tp_size}", model, optimizer, extra={"step": N, "tag": [kind, tp_size],
                                                                        "seen": torch.arange(N)})
            out["rest"] = _train(model, optimizer, kind, range(N, N + M))
            sources = [tp_size] + ([resume_from] if resume_from is not None else [])
            for source in sources:
                fresh, fresh_optimizer = _fresh(model, seed=100 + source)
                extra = load(work / f"{kind}-tp{source}", fresh, fresh_optimizer)
                assert extra["step"] == N and extra["tag"] == [kind, source]
                assert torch.equal(extra["seen"], torch.arange(N))
                assert fresh_optimizer.param_groups[0]["lr"] == 3e-3
                out[source] = _train(fresh, fresh_optimizer, kind, range(N, N + M))
            export_hf(work / f"{kind}-hf-tp{tp_size}", model, model.config)
            with torch.no_grad():
                out["logits"] = _logits(model.eval(), kind, 0).cpu()
            results[kind] = out
    finally:
        if tp_size == 1:
            destroy_tensor_parallel()  # forgets the generator state seeded in this process
    return results


def resume_only(paths: dict[str, str], work: str, source: int) -> dict:
    """tp_size 1, this process: each model's checkpoint of tp_size ``source`` into a fresh model, M steps."""
    from tpkit.checkpoint import load
    from tpkit.models import from_pretrained

    results = {}
    for kind, path in paths.items():
        fresh, optimizer = _fresh(from_pretrained(path), seed=7)
        load(Path(work) / f"{kind}-tp{source}", fresh, optimizer)
        results[kind] = _train(fresh, optimizer, kind, range(N, N + M))
    return results


def _in_process(fn, *args):
    """``fn`` at tp_size 1 in this process, without torch.distributed, its generators left as they were."""
    with torch.random.fork_rng(devices=[]):
        return fn(*args)


@pytest.fixture(scope="module")
def training_runs(ranks, tmp_path_factory):
    if under_torchrun():
        pytest.skip("the training runs span tp_size 1, 2 and 4: run under plain pytest")
    models = tmp_path_factory.mktemp("checkpoint_models")
    paths = {"llama": str(models / "llama"), "bart": str(models / "bart")}
    make_llama_checkpoint(paths["llama"], num_key_value_heads=2, tie_word_embeddings=True,
                          attention_bias=True, vocab_size=VOCAB, num_hidden_layers=1)
    make_bart_checkpoint(paths["bart"], vocab_size=VOCAB, dropout=0.1, encoder_layers=1, decoder_layers=1)
    work = str(tmp_path_factory.mktemp("checkpoints"))
    results = {1: _in_process(run_training, paths, 1, work, None)}
    results[2] = ranks.run(2, run_training, paths, 2, work, 1, timeout=300)[0]
    results[4] = ranks.run(4, run_training, paths, 4, work, 2, timeout=300)[0]
    resumed = _in_process(resume_only, paths, work, 4)
    for kind, losses in resumed.items():
        results[1][kind][4] = losses
    return paths, work, results


@pytest.mark.parametrize("kind", ["llama", "bart"])
@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_resume_at_same_tp_size_is_bitwise(training_runs, kind, tp_size):
    out = training_runs[2][tp_size][kind]
    assert out[tp_size] == out["rest"]


@pytest.mark.parametrize("kind", ["llama", "bart"])
@pytest.mark.parametrize(("source", "target"), [(1, 2), (2, 4), (4, 1)])
def test_resume_at_another_tp_size(training_runs, kind, source, target):
    results = training_runs[2]
    resumed = results[target][kind][source]
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(results[source][kind]["rest"]),
                               **ACROSS_SIZES)
    # and the uninterrupted runs agree across sizes too
    torch.testing.assert_close(torch.tensor(results[target][kind]["rest"]),
                               torch.tensor(results[source][kind]["rest"]), **ACROSS_SIZES)


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("kind", ["llama", "bart"])
def test_export_loads_into_transformers(training_runs, kind, tp_size):
    from transformers import AutoModelForCausalLM, BartForConditionalGeneration

    _, work, results = training_runs
    path = Path(work) / f"{kind}-hf-tp{tp_size}"
    assert (path / "model.safetensors.index.json").is_file() and (path / "config.json").is_file()
    hf_class = AutoModelForCausalLM if kind == "llama" else BartForConditionalGeneration
    hf_model = hf_class.from_pretrained(path).eval()
    inputs = _batch(kind, 0)[:-1]
    with torch.no_grad():
        if kind == "llama":
            logits = hf_model(inputs[0]).logits
        else:
            logits = hf_model(input_ids=inputs[0], decoder_input_ids=inputs[1]).logits
    torch.testing.assert_close(logits, results[tp_size][kind]["logits"], **LOGITS)


def test_export_loads_into_from_pretrained_at_another_tp_size(training_runs):
    from tpkit.models import from_pretrained

    _, work, results = training_runs
    for kind in ("llama", "bart"):
        model = from_pretrained(Path(work) / f"{kind}-hf-tp4")  # tp_size 1, this process
        with torch.no_grad():
            torch.testing.assert_close(_logits(model, kind, 0), results[4][kind]["logits"], **LOGITS)


# --- DCP of a plain state_dict; async saves; GPT-BigCode's fused export ----------------------------------

def _check_shard_parts() -> None:
    """Every layer's ``shard_parts`` places the rows its ``weight_loader`` loads: random logical tensors
    loaded part by part, then each part's rows read back through ``ShardPart.local``."""
    from tpkit.parallel_layers import (
        MergedColumnParallelLinear,
        ParallelLMHead,
        QKVParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    on = {"device": device()}
    layers = [QKVParallelLinear(16, 4, 4, 1, **on),  # one KV head: replicated over 2 ranks
              MergedColumnParallelLinear(16, [8, 12], **on), RowParallelLinear(16, 8, **on),
              VocabParallelEmbedding(VOCAB, 8, **on), ParallelLMHead(VOCAB, 8, bias=True, **on)]
    generator = torch.Generator().manual_seed(5)
    for layer in layers:
        for param in layer.parameters():
            for part in layer.shard_parts(param):
                full = torch.randn(part.shape, generator=generator).to(device())
                layer.weight_loader(param, full, part.shard_id)
                expected = full if part.dim is None else full.narrow(part.dim, part.start, part.length)
                assert torch.equal(part.local(param), expected), (type(layer).__name__, part)


def plain_dcp(work: str, gpt_bigcode: str) -> dict:
    import torch.distributed.checkpoint as dcp

    from tpkit.checkpoint import export_hf, load, save, sharded_state_dict
    from tpkit.models import LlamaForCausalLM, from_pretrained
    from tpkit.parallel_layers import ColumnParallelLinear, get_tp_rank, init_tensor_parallel

    init_tensor_parallel(2)
    _check_shard_parts()
    work = Path(work)
    layer = ColumnParallelLinear(16, 8, device=device())
    refusals = []
    # A checkpoint of plain local tensors (as DCP would have written the state_dict before): same shapes.
    dcp.save({name: t.clone() for name, t in layer.state_dict().items()}, checkpoint_id=work / "local")
    for call in (dcp.save, dcp.load):
        with pytest.raises(BaseException) as error:  # DCP wraps it in a CheckpointException
            call(layer.state_dict(), checkpoint_id=work / ("plain" if call is dcp.save else "local"))
        refusals.append(str(error.value))
    dcp.save(sharded_state_dict(layer), checkpoint_id=work / "sharded")
    # torch.save of a rank's own tensors still round-trips, through weights_only loading
    buffer = io.BytesIO()
    torch.save(layer.state_dict(), buffer)
    buffer.seek(0)
    for name, tensor in torch.load(buffer, weights_only=True).items():
        assert torch.equal(tensor, layer.state_dict()[name])
    # the sharded state dict: each rank gets its own rows back
    before = {name: p.detach().clone() for name, p in layer.named_parameters()}
    with torch.no_grad():
        for p in layer.parameters():
            p.zero_()
    dcp.load(sharded_state_dict(layer), checkpoint_id=work / "sharded")
    for name, p in layer.named_parameters():
        assert torch.equal(p, before[name]), name
    # an asynchronous save: the tensors are copied when it returns
    future = save(work / "async", layer, async_save=True)
    with torch.no_grad():
        layer.weight.add_(1.0)
    future.result()
    load(work / "async", layer)
    assert torch.equal(layer.weight, before["weight"])
    # a tp_size the model cannot take: 3 KV heads over 2 ranks
    with pytest.raises(ValueError, match="total_num_kv_heads=3 and tp_size=2"):
        LlamaForCausalLM({"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 3,
                          "intermediate_size": 32, "num_hidden_layers": 1, "vocab_size": 64,
                          "max_position_embeddings": 16})
    model = from_pretrained(gpt_bigcode, device=device())
    export_hf(work / "gpt_bigcode-hf-tp2", model, model.config, max_shard_size=100_000)
    with torch.no_grad():
        logits = _logits(model, "llama", 0).cpu()
    return {"refusals": refusals, "rank": get_tp_rank(), "logits": logits,
            "row_sum": before["weight"].sum().item()}


def test_plain_dcp_state_dict_is_refused_and_sharded_one_round_trips(ranks, tmp_path):
    from transformers import GPTBigCodeForCausalLM

    gpt_bigcode = tmp_path / "gpt_bigcode"
    make_gpt_bigcode_checkpoint(gpt_bigcode, vocab_size=VOCAB)
    results = ranks.run(2, plain_dcp, str(tmp_path), str(gpt_bigcode), timeout=240)
    for result in results:
        for message in result["refusals"]:
            assert f"is tp rank {result['rank']}'s shard of a parameter split over 2 ranks" in message
            assert "tpkit.checkpoint.sharded_state_dict(model)" in message
    assert results[0]["row_sum"] != results[1]["row_sum"]  # the ranks held different rows
    export = tmp_path / "gpt_bigcode-hf-tp2"
    assert len(list(export.glob("model-*-of-*.safetensors"))) > 1  # sharded by max_shard_size
    hf_model = GPTBigCodeForCausalLM.from_pretrained(export).eval()
    with torch.no_grad():
        logits = hf_model(_batch("llama", 0)[0]).logits
    torch.testing.assert_close(logits, results[0]["logits"], **LOGITS)


# --- bad input: a clear error, nothing changed ----------------------------------------------------------

def _snapshot(model, optimizer) -> list[torch.Tensor]:
    tensors = [t.detach().clone() for t in model.state_dict().values()]
    for state in optimizer.state.values():
        tensors.extend(t.clone() for t in state.values())
    return tensors


def _bad_inputs(llama: str, bart: str, checkpoint: Path, scratch: Path) -> None:
    from tpkit.checkpoint import CheckpointMismatchError, load
    from tpkit.models import from_pretrained

    model = from_pretrained(llama).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, optimizer, "llama", range(1))
    before = _snapshot(model, optimizer)

    def refused(error_type, *match: str, into=model, optim=optimizer, path=checkpoint) -> None:
        with pytest.raises(error_type) as error:
            load(path, into, optim)
        for text in match:
            assert text in str(error.value), (text, str(error.value))
        assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(model, optimizer), strict=True))

    refused(FileNotFoundError, str(scratch / "nowhere"), path=scratch / "nowhere")
    bart_model = from_pretrained(bart)
    refused(CheckpointMismatchError, "the checkpoint holds a LlamaForCausalLM, the model is a "
            "BartForConditionalGeneration", "model.shared.weight", into=bart_model, optim=None)
    wider = from_pretrained(llama)
    config = {**wider.config, "intermediate_size": 256}
    wider = type(wider)(config)
    refused(CheckpointMismatchError, "model.layers.0.mlp.gate_up_proj.weight:0: checkpoint shape (128, 128), "
            "model shape (256, 128)", into=wider, optim=None)
    subset = torch.optim.AdamW(list(model.parameters())[1:], lr=1e-3)
    refused(CheckpointMismatchError, "optimizer: parameter groups", optim=subset)
    truncated = scratch / "truncated"
    shutil.copytree(checkpoint, truncated)
    data = next(truncated.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:1000])
    refused(CheckpointMismatchError, f"{data}: 1000 bytes", "truncated", path=truncated)
    (truncated / ".metadata").write_bytes(b"\x80\x04cos\nsystem\n.")  # a pickle that would run code
    refused(Exception, "refers to os.system", path=truncated)


def test_bad_input_is_refused_before_anything_changes(training_runs, tmp_path):
    paths, work, _ = training_runs
    _in_process(_bad_inputs, paths["llama"], paths["bart"], Path(work) / "llama-tp1", tmp_path)


def test_export_of_interleaved_c_attn_loads_into_transformers(tmp_path):
    """GPT-BigCode without multi_query stores c_attn interleaved per head: the export interleaves it back."""
    from transformers import GPTBigCodeForCausalLM

    from tpkit.checkpoint import export_hf
    from tpkit.models import from_pretrained

    make_gpt_bigcode_checkpoint(tmp_path / "in", multi_query=False, vocab_size=VOCAB, n_layer=1)
    model = from_pretrained(tmp_path / "in")
    export_hf(tmp_path / "out", model, model.config)
    ids = _batch("llama", 0)[0]
    with torch.no_grad():
        expected = model(ids)
        logits = GPTBigCodeForCausalLM.from_pretrained(tmp_path / "out").eval()(ids).logits
    torch.testing.assert_close(logits, expected, **LOGITS)
