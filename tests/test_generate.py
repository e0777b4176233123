"""The generation loop and sampler shared by every tpkit model, and ``from_pretrained``'s choices.

References are independent of the code under test: EOS stopping against the same run with EOS ignored and
cut by hand, sampling filters against transformers' logits warpers, the sampled distribution against the
softmax, the static (CUDA-graph) decode step against the plain one.
"""

from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch
from checkpoints import make_llama_checkpoint
from multirank import device, under_torchrun
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tpkit.models import LlamaForCausalLM, from_pretrained
from tpkit.models.cuda_graph import StaticDecodeStep
from tpkit.models.sampling import Sampler, filter_logits, greedy_tokens
from tpkit.parallel_layers import TPGroup, launch

PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19], [20], [30, 31, 32, 33, 34, 35, 36]]
# In this process (also under torchrun): a single-rank group on the CPU.
SINGLE = TPGroup(None, 0, 1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_generate")
    make_llama_checkpoint(path)
    return path


@pytest.fixture(scope="module")
def model(checkpoint):
    return from_pretrained(checkpoint, tp_group=SINGLE, device="cpu")


def _cut_after_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


def _eos_and_sampling_on_ranks(path: str, tp_size: int) -> dict:
    from tpkit.parallel_layers import init_tensor_parallel

    init_tensor_parallel(tp_size)
    model = from_pretrained(path, device=device())
    full = model.generate(PROMPTS, 24, ignore_eos=True)
    # EOS ids that stop sequence 0 early and sequence 1 later, while the others run on.
    eos = {full[0][3], full[1][10]}
    model.eos_token_ids = tuple(eos)
    stopped = model.generate(PROMPTS, 24)
    assert stopped == [_cut_after_eos(tokens, eos) for tokens in full]
    assert len(stopped[0]) == 4 and stopped[0][-1] in eos
    assert all(cache.num_free_blocks == cache.num_blocks for cache in model.kv_caches.values())

    sample = dict(temperature=1.0, top_k=50, top_p=0.9)
    first = model.generate(PROMPTS, 12, seed=123, **sample)
    assert model.generate(PROMPTS, 12, seed=123, **sample) == first
    assert model.generate(PROMPTS, 12, seed=124, **sample) != first
    # top_k 1 leaves only the greedy token to draw.
    model.eos_token_ids = ()
    assert model.generate(PROMPTS, 12, temperature=0.7, top_k=1, seed=5) == [tokens[:12] for tokens in full]
    return {"stopped": stopped, "sampled": first}


@pytest.mark.parametrize("tp_size", [1, 2])
def test_eos_stops_sequences_and_sampling_agrees_on_every_rank(ranks, checkpoint, tp_size):
    results = ranks.run(tp_size, _eos_and_sampling_on_ranks, str(checkpoint), tp_size)
    assert all(result == results[0] for result in results)


def _compiled_step_on_ranks(path: str, tp_size: int) -> None:
    from tpkit.parallel_layers import init_tensor_parallel

    init_tensor_parallel(tp_size)
    model = from_pretrained(path, device=device())
    caches = model._reserve_kv_caches(model._plan_kv_cache([len(p) for p in PROMPTS], 2))
    torch._dynamo.reset()
    with torch.no_grad():
        tokens = model._prefill(PROMPTS, caches).argmax(-1)
        metadata = model._decode_metadata(caches, range(len(PROMPTS)))
        # Both write the same k, v into the same slots: the second step sees the caches the first did.
        eager = model._decode_step(tokens[:, None], metadata, caches)
        compiled = torch.compile(model._decode_step, fullgraph=True, backend="eager")
        logits = compiled(tokens[:, None], metadata, caches)
        # What a greedy generation's graph replays: the step and the draw.
        drawn = torch.compile(model._decode_and_draw, fullgraph=True, backend="eager")(
            tokens[:, None], metadata, caches)
    torch.testing.assert_close(logits, eager)
    assert drawn.tolist() == eager.argmax(-1).tolist()


@pytest.mark.parametrize("tp_size", [1, 2])
def test_decode_step_compiles_without_graph_breaks_on_every_rank(ranks, checkpoint, tp_size):
    """generate(compile=True) compiles the decode step; fullgraph=True fails on a graph break, which would
    recompile the step's per-layer frames until dynamo's limit (the all-reduces of row-parallel layers broke
    it once, through their autograd function's mark_dirty)."""
    ranks.run(tp_size, _compiled_step_on_ranks, str(checkpoint), tp_size)


def test_filter_logits_matches_transformers_warpers():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0)) * 3
    for temperature, top_k, top_p in [(0.7, 20, None), (1.3, None, 0.8), (0.9, 40, 0.5), (1.0, 300, 1.0)]:
        expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_k is not None:
            expected = TopKLogitsWarper(top_k)(None, expected)
        if top_p is not None:
            expected = TopPLogitsWarper(top_p)(None, expected)
        torch.testing.assert_close(filter_logits(logits, temperature, top_k, top_p), expected, rtol=0, atol=0)


def test_sampled_tokens_follow_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).expand(20000, 4)
    sampler = Sampler(temperature=1.5, top_k=None, top_p=None, seed=7, device=torch.device("cpu"),
                      tp_group=SINGLE)
    counts = torch.bincount(sampler(logits), minlength=4).float() / 20000
    torch.testing.assert_close(counts, (logits[0] / 1.5).softmax(-1), rtol=0, atol=0.015)
    greedy = Sampler(temperature=0.0, top_k=None, top_p=None, seed=None, device=torch.device("cpu"),
                     tp_group=SINGLE)
    assert greedy(logits[:3]).tolist() == [0, 0, 0]


def test_tensor_prompts_equal_list_prompts(model):
    prompts = torch.tensor([[5, 6, 7, 8], [30, 31, 32, 33]])
    assert model.generate(prompts, 8) == model.generate(prompts.tolist(), 8)


def test_a_failed_prefill_leaves_no_blocks_behind(model, monkeypatch):
    expected = model.generate(PROMPTS, 5)

    def fail(*args, **kwargs):
        raise RuntimeError("out of memory, say")

    with monkeypatch.context() as patch:
        patch.setattr(model, "hidden_states", fail)
        with pytest.raises(RuntimeError, match="out of memory, say"):
            model.generate(PROMPTS, 5)
    assert model.generate(PROMPTS, 5) == expected
    assert all(cache.num_free_blocks == cache.num_blocks for cache in model.kv_caches.values())


def test_compiled_decode_step_gives_the_same_tokens(checkpoint, monkeypatch):
    """Tracing through dynamo and AOTAutograd (fake tensors, the ops' fake kernels) is what can break;
    the aot_eager backend checks exactly that without inductor's minute of C++ compilation."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    model = from_pretrained(checkpoint, tp_group=SINGLE, device="cpu")
    expected = model.generate(PROMPTS, 6, ignore_eos=True)
    assert model.generate(PROMPTS, 6, ignore_eos=True, compile=True) == expected
    assert model._compiled_decode_steps


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_gives_the_eager_tokens(checkpoint):
    """bf16 on the GPU, contexts growing across kernel tiles (100 new tokens after prompts of 37-150): eager
    steps see block tables as wide as the graph's, so both take the same attention plan (split-K
    partitions) and give the same tokens, bit for bit."""
    model = from_pretrained(checkpoint, tp_group=SINGLE, device="cuda", dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.vocab_size, (n,), generator=generator).tolist() for n in (100, 37, 150)]
    eager = model.generate(prompts, 100, ignore_eos=True)
    assert model.generate(prompts, 100, ignore_eos=True, cuda_graph=True) == eager


def _eager_and_graphed_tokens(path: str) -> tuple[list[list[int]], list[list[int]]]:
    from tpkit.parallel_layers import init_tensor_parallel, local_device

    init_tensor_parallel()
    model = from_pretrained(path, device=local_device(), dtype=torch.bfloat16)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, model.vocab_size, (n,), generator=generator).tolist() for n in (100, 37, 150)]
    eager = model.generate(prompts, 40, ignore_eos=True)
    graphed = model.generate(prompts, 40, ignore_eos=True, cuda_graph=True)
    return eager, graphed


@pytest.mark.skipif(torch.cuda.device_count() < 2 or under_torchrun(),
                    reason="needs two GPUs and a plain pytest process (it starts its own NCCL ranks)")
def test_cuda_graph_at_two_ranks_gives_the_eager_tokens_and_lets_the_group_go(checkpoint):
    """The graph replays the step's NCCL all-reduces: the same tokens as eager steps on both ranks, and
    the process group is destroyed after (the launcher raises TimeoutError for a teardown stuck in NCCL
    rather than hanging)."""
    results = launch(_eager_and_graphed_tokens, 2, str(checkpoint), backend="nccl", timeout=300,
                     collective_timeout=120)
    for eager, graphed in results:
        assert graphed == eager


@torch.inference_mode()
def test_static_decode_step_that_draws_gives_the_argmax_of_the_plain_step(model):
    """A CUDA graph of a greedy generation replays the draw too: the static step then hands back the live
    rows' tokens."""
    caches = model._reserve_kv_caches(model._plan_kv_cache([len(p) for p in PROMPTS], 6))
    try:
        tokens = model._prefill(PROMPTS, caches).argmax(-1)
        step = lambda ids, metadata: model._decode_and_draw(ids, metadata, caches)
        greedy = Sampler(temperature=0.0, top_k=None, top_p=None, seed=None, device=model.device,
                         tp_group=SINGLE)
        static = StaticDecodeStep(step, len(PROMPTS), {"self": 2}, model.device)
        for seq_ids in ([0, 1, 2, 3], [0, 1, 2, 3], [1, 3]):
            metadata = model._decode_metadata(caches, seq_ids, {"self": 2})
            rows = torch.tensor(seq_ids)
            expected = model._decode_step(tokens[rows, None], metadata, caches).argmax(-1)
            drawn = static(tokens[rows, None], metadata, seq_ids)
            assert drawn.dtype == torch.int64 and drawn.tolist() == expected.tolist()
            # A graph's output is overwritten by its next replay: generation takes a copy.
            next_tokens = model._next_tokens(greedy, drawn, 1, 6, drawn=True)
            assert next_tokens.tolist() == expected.tolist() and next_tokens.data_ptr() != drawn.data_ptr()
            tokens[rows] = next_tokens
    finally:
        for seq_id in range(len(PROMPTS)):
            model._free(caches, seq_id)


@torch.inference_mode()
def test_static_decode_step_with_padding_rows_equals_plain_step(model):
    """What the CUDA graph replays, run eagerly: finished sequences are padding rows that change nothing."""
    caches = model._reserve_kv_caches(model._plan_kv_cache([len(p) for p in PROMPTS], 6))
    try:
        tokens = model._prefill(PROMPTS, caches).argmax(-1)
        step = lambda ids, metadata: model._decode_step(ids, metadata, caches)
        static = StaticDecodeStep(step, len(PROMPTS), {"self": 2}, model.device)
        for seq_ids in ([0, 1, 2, 3], [0, 2, 3], [2]):
            metadata = model._decode_metadata(caches, seq_ids)
            rows = torch.tensor(seq_ids)
            expected = model._decode_step(tokens[rows, None], metadata, caches)
            # Padding rows change the matmuls' shapes, and with them the float32 rounding (not the values).
            torch.testing.assert_close(static(tokens[rows, None], metadata, seq_ids), expected,
                                       rtol=1e-5, atol=5e-5)
            tokens[rows] = expected.argmax(-1)
    finally:
        for seq_id in range(len(PROMPTS)):
            model._free(caches, seq_id)


@pytest.mark.parametrize("prompts, kwargs, error, match", [
    ([], {}, ValueError, "prompts is empty"),
    ([[1, 2], []], {}, ValueError, r"prompts\[1\] is empty"),
    ([[1, 256]], {}, ValueError, r"prompts\[0\] has token ids outside \[0, 256\)"),
    ([[1, 2.0]], {}, TypeError, r"prompts\[0\] must hold integer token ids, got 2.0"),
    ("hello", {}, TypeError, "prompts must be a list"),
    (torch.ones(3, dtype=torch.long), {}, ValueError, "2-D integer"),
    ([[1, 2]], {"max_new_tokens": 0}, ValueError, "max_new_tokens must be an int >= 1"),
    ([[1, 2]], {"temperature": -1.0}, ValueError, "temperature must be"),
    ([[1, 2]], {"temperature": 1.0, "top_k": 0}, ValueError, "top_k must be"),
    ([[1, 2]], {"temperature": 1.0, "top_p": 0.0}, ValueError, r"top_p must be None or in \(0, 1\]"),
    ([[1, 2]], {"seed": -3}, ValueError, "seed must be"),
    ([[1, 2]], {"cuda_graph": True}, ValueError, "cuda_graph=True needs the model on a CUDA device"),
    ([[1] * 250], {"max_new_tokens": 8}, ValueError, "exceeds the model's 256 positions"),
])
def test_bad_generate_arguments_raise_before_any_state_changes(model, prompts, kwargs, error, match):
    before = {name: cache.num_free_blocks for name, cache in model.kv_caches.items()}
    kwargs = {"max_new_tokens": 4, **kwargs}
    with pytest.raises(error, match=match):
        model.generate(prompts, **kwargs)
    assert {name: cache.num_free_blocks for name, cache in model.kv_caches.items()} == before


def test_from_pretrained_reads_dtype_and_generation_config(checkpoint, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(checkpoint, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16", "eos_token_id": 2}))
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    model = from_pretrained(copy, tp_group=SINGLE, device="cpu")
    assert isinstance(model, LlamaForCausalLM) and not model.training
    assert model.dtype == torch.bfloat16 and model.eos_token_ids == (7, 9)
    assert from_pretrained(copy, dtype=torch.float32, tp_group=SINGLE, device="cpu").dtype == torch.float32


def test_from_pretrained_unknown_architecture_lists_the_supported(checkpoint, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(checkpoint, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "architectures": ["MambaForCausalLM"]}))
    with pytest.raises(ValueError, match=r"\['MambaForCausalLM'\] has no supported architecture; supported: "
                                         r"LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
                                         r"MistralForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, "
                                         r"GPTBigCodeForCausalLM, BartForConditionalGeneration"):
        from_pretrained(copy, tp_group=SINGLE, device="cpu")


@pytest.mark.parametrize("vocab", [7, 256, 300, 50265, 128256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_tokens_is_argmax(vocab: int, dtype: torch.dtype) -> None:
    # Random logits, logits with many ties (the first maximum wins) and rows of -inf; any device.
    g = torch.Generator().manual_seed(vocab)
    cases = [torch.randn(8, vocab, generator=g), torch.randint(0, 3, (8, vocab), generator=g).float(),
             torch.full((2, vocab), float("-inf"))]
    for logits in cases:
        logits = logits.to(device(), dtype)
        torch.testing.assert_close(greedy_tokens(logits), logits.argmax(dim=-1), rtol=0, atol=0)
