"""tpkit.serving's Engine: greedy tokens equal transformers' per prompt whatever the batching (a KV budget
small enough to preempt, chunked prefill of 16 tokens, shared prefixes, requests added while others run), at
tp_size 1, 2 and 4 (at 4, Llama's 2 KV heads and GPT-BigCode's one are replicated), for Llama, GPT-BigCode
and BART; seeded sampling reproducible and independent of batching; stop tokens, abort, and bad input refused
before anything is queued.
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import (
    make_bart_checkpoint,
    make_gpt_bigcode_checkpoint,
    make_llama_checkpoint,
    random_token_ids,
)
from model_parity import greedy_checkpoints
from multirank import device

MAX_NEW_TOKENS = 20
_PREFIX = random_token_ids(256, (37,), seed=5)[0].tolist()
_OTHERS = [ids.tolist() for ids in random_token_ids(256, (9,), (26,), (3,), seed=6)]
PROMPTS = [
    _PREFIX + [50, 51, 52],  # two full blocks of the shared prefix
    _OTHERS[0],
    _PREFIX[:20] + [60],  # its first block
    _OTHERS[1],
    _PREFIX + [80] * 12,  # its two blocks and a third of its own
    _OTHERS[2],
]
CHECKPOINTS = {"llama": make_llama_checkpoint, "gpt_bigcode": make_gpt_bigcode_checkpoint,
               "bart": make_bart_checkpoint}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``checkpoints(name)``: (path, transformers' greedy tokens for PROMPTS), made on first use."""
    return greedy_checkpoints(tmp_path_factory, CHECKPOINTS, PROMPTS, MAX_NEW_TOKENS)


def _block_bytes(model) -> int:
    """Bytes of one block of every cache of the model (the engine splits its budget evenly among them)."""
    layout = model.kv_cache_layout()
    return len(layout) * max(2 * layers * model.kv_block_size * heads * size * model.dtype.itemsize
                             for layers, heads, size in layout.values())


def _model(path: str, tp_size: int = 1):
    """The model at tp_size 1 in this process, or this rank's shard (``init_tensor_parallel`` first)."""
    from tpkit.models import from_pretrained
    from tpkit.parallel_layers import TPGroup

    if tp_size == 1:
        return from_pretrained(path, tp_group=TPGroup(None, 0, 1), device="cpu")
    return from_pretrained(path, device=device())


def _stream(engine, prompts, sampling, add_after: int) -> list[list[int]]:
    """The first ``add_after`` prompts queued, two steps run, then the rest queued while those run."""
    ids = [engine.add_request(p, sampling) for p in prompts[:add_after]]
    outputs = {}
    for _ in range(2):
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    ids += [engine.add_request(p, sampling) for p in prompts[add_after:]]
    finished = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            assert out.token_ids == outputs[out.request_id]
            if out.finished:
                assert out.finish_reason == "length" and out.first_token_time == out.token_times[0]
                finished.add(out.request_id)
    assert finished == set(ids)
    return [outputs[i] for i in ids]


def _serve_every_way(path: str, tp_size: int, ref_tokens: list[list[int]], ways: list[str]) -> dict:
    """On every rank, the engine's tokens in each of ``ways``; returns each way's preemptions."""
    from tpkit.parallel_layers import init_tensor_parallel
    from tpkit.serving import Engine, SamplingParams

    if tp_size > 1:
        init_tensor_parallel(tp_size)
    model = _model(path, tp_size)
    sampling = SamplingParams(MAX_NEW_TOKENS, ignore_eos=True)
    # Room for the longest request and a little more: requests wait for blocks and are preempted.
    tight = dict(kv_cache_memory=6 * _block_bytes(model), max_num_batched_tokens=64)
    settings = {"plain": {}, "tight": tight, "chunked": dict(max_num_batched_tokens=16),
                "tight chunked": {**tight, "max_num_batched_tokens": 16},
                "streamed": dict(max_num_batched_tokens=64, max_num_seqs=3),
                "no prefix cache": dict(prefix_caching=False, max_num_seqs=2)}
    preemptions = {}
    for way in ways:
        engine = Engine(model, **settings[way])
        if way == "streamed":
            tokens = _stream(engine, PROMPTS, sampling, add_after=2)
        else:
            tokens = engine.generate(PROMPTS, sampling)
        assert tokens == ref_tokens, f"{way}: engine {tokens} != transformers {ref_tokens}"
        assert not engine.has_unfinished_requests()
        for cache in engine.runner.caches.values():
            assert cache.num_free_blocks == cache.num_blocks
        preemptions[way] = engine.num_preemptions
    return preemptions


ALL_WAYS = ["plain", "tight", "chunked", "tight chunked", "streamed", "no prefix cache"]


@pytest.mark.parametrize("name,tp_size,ways", [
    ("llama", 1, ALL_WAYS),
    ("gpt_bigcode", 1, ["tight chunked", "streamed"]),
    ("bart", 1, ["plain", "tight", "streamed"]),
    ("llama", 2, ["tight chunked"]),
    ("bart", 2, ["tight"]),
    ("llama", 4, ["tight chunked"]),
    ("gpt_bigcode", 4, ["tight chunked"]),
    ("bart", 4, ["tight"]),
])
def test_greedy_tokens_are_transformers_whatever_the_batching(ranks, checkpoints, name, tp_size, ways):
    path, ref_tokens = checkpoints(name)
    if tp_size == 1:
        runs = [_serve_every_way(path, tp_size, ref_tokens, ways)]
    else:
        runs = ranks.run(tp_size, _serve_every_way, path, tp_size, ref_tokens, ways)
    assert all(run == runs[0] for run in runs)
    if name != "bart":  # BART's decoder needs two blocks a request: its requests wait, none is preempted
        assert runs[0]["tight chunked"] > 0


def _llama_engine(checkpoints, **kwargs):
    from tpkit.serving import Engine

    path, ref_tokens = checkpoints("llama")
    return Engine(_model(path), **kwargs), ref_tokens


def test_seeded_sampling_is_reproducible_and_independent_of_batching(checkpoints):
    from tpkit.serving import SamplingParams

    sampling = [SamplingParams(MAX_NEW_TOKENS, temperature=1.5, top_k=50, top_p=0.95, seed=i, ignore_eos=True)
                for i in range(len(PROMPTS))]
    engine, _ = _llama_engine(checkpoints)
    together = engine.generate(PROMPTS, sampling)
    assert engine.generate(PROMPTS, sampling) == together
    alone = [engine.generate([p], s)[0] for p, s in zip(PROMPTS, sampling, strict=True)]
    assert alone == together
    small, _ = _llama_engine(checkpoints, max_num_batched_tokens=16,
                             kv_cache_memory=6 * _block_bytes(engine.model))
    assert small.generate(PROMPTS[::-1], sampling[::-1]) == together[::-1]
    reseeded = [SamplingParams(MAX_NEW_TOKENS, temperature=1.5, seed=100 + i, ignore_eos=True)
                for i in range(len(PROMPTS))]
    assert engine.generate(PROMPTS, reseeded) != together


def test_stop_tokens_and_eos_end_a_request_with_the_token_kept(checkpoints):
    from tpkit.serving import SamplingParams

    engine, ref_tokens = _llama_engine(checkpoints)
    stop = ref_tokens[0][5]
    first = ref_tokens[0].index(stop)
    assert engine.generate([PROMPTS[0]], SamplingParams(MAX_NEW_TOKENS, stop_token_ids=[stop])) == \
        [ref_tokens[0][:first + 1]]
    engine._eos = frozenset([stop])  # the model's EOS, unless ignore_eos
    request_id = engine.add_request(PROMPTS[0], SamplingParams(MAX_NEW_TOKENS))
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    assert outputs[-1].request_id == request_id and outputs[-1].finish_reason == "stop"
    assert outputs[-1].token_ids == ref_tokens[0][:first + 1]


@pytest.mark.parametrize("seed", range(3))
def test_requests_stopping_while_others_run_end_on_their_stop_token(checkpoints, seed):
    """Each request stops on its own token, drawn at random from its greedy output, while the others go on
    (the GPU runs a step ahead of the host: a stopped request's next step is dropped), under preemption and
    chunked prefill; its output ends on its first stop token and every block comes back."""
    import random

    from tpkit.serving import SamplingParams

    rng = random.Random(seed)
    path, ref_tokens = checkpoints("llama")
    model = _model(path)
    engine, _ = _llama_engine(checkpoints, kv_cache_memory=6 * _block_bytes(model),
                              max_num_batched_tokens=rng.choice([16, 64]))
    sampling, expected = [], []
    for ref in ref_tokens:
        stop = rng.choice(ref) if rng.random() < 0.8 else -1
        stops = [stop] if stop >= 0 else []
        sampling.append(SamplingParams(MAX_NEW_TOKENS, stop_token_ids=stops, ignore_eos=True))
        expected.append(ref[:ref.index(stop) + 1] if stops else ref)
    assert engine.generate(PROMPTS, sampling) == expected
    assert not engine.has_unfinished_requests()
    cache = engine.runner.caches["self"]
    assert cache.num_free_blocks == cache.num_blocks


def test_generated_tokens_reach_the_prefix_cache(checkpoints):
    """A finished request's generated tokens are found again by a prompt that repeats them (a
    conversation's next turn): their full blocks are cached, and the next turn's tokens are those of an
    engine without a prefix cache."""
    from tpkit.serving import SamplingParams

    engine, ref_tokens = _llama_engine(checkpoints)
    sampling = SamplingParams(MAX_NEW_TOKENS, ignore_eos=True)
    assert engine.generate([PROMPTS[0]], sampling) == [ref_tokens[0]]
    cache, block_size = engine.runner.caches["self"], engine.model.kv_block_size
    # Every token but the last went through the model, its K/V into the cache.
    computed = len(PROMPTS[0]) + MAX_NEW_TOKENS - 1
    assert cache.num_cached_blocks == computed // block_size
    next_turn = PROMPTS[0] + ref_tokens[0] + [7, 8]
    assert cache.add_sequence(-1, next_turn) == computed // block_size * block_size
    cache.free(-1)
    plain, _ = _llama_engine(checkpoints, prefix_caching=False)
    assert engine.generate([next_turn], sampling) == plain.generate([next_turn], sampling)


def test_abort_ends_a_request_and_frees_its_blocks(checkpoints):
    from tpkit.serving import SamplingParams

    engine, ref_tokens = _llama_engine(checkpoints)
    sampling = SamplingParams(MAX_NEW_TOKENS, ignore_eos=True)
    kept, aborted, waiting = (engine.add_request(p, sampling) for p in PROMPTS[:3])
    engine.step()
    engine.step()
    assert engine.abort(aborted) and engine.abort(waiting)
    assert not engine.abort(aborted)
    outputs = engine.step()
    assert [(o.request_id, o.finished, o.finish_reason, o.new_token_ids) for o in outputs[:2]] == [
        (aborted, True, "abort", []), (waiting, True, "abort", [])]
    tokens = [t for o in outputs for t in o.new_token_ids if o.request_id == kept]
    while engine.has_unfinished_requests():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    assert len(tokens) == MAX_NEW_TOKENS - 2 and tokens == ref_tokens[0][2:]
    cache = engine.runner.caches["self"]
    assert cache.num_free_blocks == cache.num_blocks


def test_a_steps_outputs_keep_their_values_after_later_steps(checkpoints):
    """Every RequestOutput holds the tokens and times of its own step, whether read then or only after the
    requests finished (preempted and aborted ones too), and stays frozen."""
    import dataclasses

    from tpkit.serving import Engine, RequestOutput, SamplingParams

    path, ref_tokens = checkpoints("llama")
    model = _model(path)
    engine = Engine(model, kv_cache_memory=6 * _block_bytes(model), max_num_batched_tokens=64)
    ids = [engine.add_request(p, SamplingParams(MAX_NEW_TOKENS, ignore_eos=True)) for p in PROMPTS]
    kept, read_then, so_far = [], [], {i: [] for i in ids}
    for step in range(10_000):
        if step == 3:
            engine.abort(ids[1])
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            so_far[out.request_id] = so_far[out.request_id] + out.new_token_ids
            kept.append((out, so_far[out.request_id]))
            if step % 2:  # read now; the others only at the end
                read_then.append((out, list(out.token_ids), list(out.token_times)))
    assert engine.num_preemptions > 0
    final_times = {out.request_id: out.token_times for out, _ in kept if out.finished}
    assert sorted(final_times) == sorted(ids)
    for out, tokens in kept:
        assert type(out.token_ids) is list and out.token_ids == tokens
        assert type(out.token_times) is list and out.token_times == final_times[out.request_id][:len(tokens)]
        assert out.first_token_time == (out.token_times[0] if tokens else None)
        assert out == RequestOutput(out.request_id, out.new_token_ids, tokens, out.finished,
                                    out.finish_reason, out.arrival_time, out.first_token_time,
                                    list(out.token_times))
    for out, tokens, times in read_then:
        assert out.token_ids == tokens and out.token_times == times
    for out, tokens in kept:
        if out.request_id != ids[1] and out.finished:
            assert tokens == ref_tokens[ids.index(out.request_id)]
    with pytest.raises(dataclasses.FrozenInstanceError):
        kept[0][0].token_ids = []


def test_bad_input_is_refused_before_anything_is_queued(checkpoints):
    from tpkit.serving import Engine, SamplingParams

    engine, _ = _llama_engine(checkpoints, kv_cache_memory=4 * 16384)  # 4 blocks
    sampling = SamplingParams(4)
    cases = [
        ([], ValueError, r"prompts\[\d\] is empty"),
        ([3, 256], ValueError, r"token ids outside \[0, 256\): \[256\]"),
        ([3] * 254, ValueError, "exceeds the model's 256 positions"),
        ([3] * 80, ValueError, "needs 83 tokens of the 'self' KV cache, which holds 64"),
    ]
    for prompt, error, match in cases:
        with pytest.raises(error, match=match):
            engine.add_request(prompt, sampling)
        with pytest.raises(error, match=match):
            engine.generate([[5, 6], prompt], sampling)
        assert not engine.has_unfinished_requests()
    for kwargs, match in [(dict(max_new_tokens=0), "max_new_tokens: expected an int >= 1, got 0"),
                          (dict(max_new_tokens=2, temperature=-1.0), "temperature must be"),
                          (dict(max_new_tokens=2, stop_token_ids=[-1]), "stop_token_ids")]:
        with pytest.raises(ValueError, match=match):
            SamplingParams(**kwargs)
    with pytest.raises(TypeError, match="sampling: expected a SamplingParams, got dict"):
        engine.add_request([5], {"max_new_tokens": 2})
    with pytest.raises(ValueError, match="sampling: expected one SamplingParams or 2"):
        engine.generate([[5], [6]], [sampling])
    with pytest.raises(ValueError, match="max_num_seqs: expected an int >= 1, got 0"):
        Engine(engine.model, max_num_seqs=0)
    with pytest.raises(ValueError, match="kv_cache_memory: expected a fraction in"):
        Engine(engine.model, kv_cache_memory=1.5)
    assert not engine.has_unfinished_requests()
    assert len(engine.generate([[5, 6]], sampling)[0]) == 4


@pytest.mark.parametrize("name", ["llama", "bart"])
def test_decode_steps_through_the_static_step_give_transformers_tokens(checkpoints, monkeypatch, name):
    """Steps of decodes only run what a CUDA graph replays (static buffers, padding rows, block tables wider
    than the sequences', the greedy draw in the step where no request of it samples), here eagerly on the
    CPU: the tokens are still transformers', preempted or not, and seeded samples are those of each request
    served alone."""
    from tpkit.models.cuda_graph import StaticDecodeStep
    from tpkit.serving import Engine, SamplingParams

    path, ref_tokens = checkpoints(name)
    model = _model(path)
    steps = {}

    def graph_step(decode_step, caches, batch, max_blocks, variant):
        key = (batch, tuple(sorted(max_blocks.items())), variant)
        if key not in steps:
            steps[key] = StaticDecodeStep(lambda ids, metadata: decode_step(ids, metadata, caches), batch,
                                          max_blocks, model.device)
        return steps[key]

    monkeypatch.setattr(model, "_graph_step", graph_step)
    # Every other request samples (seeded): steps of greedy requests alone draw inside the static step,
    # steps with a sampling request hand back logits.
    mixed = [SamplingParams(MAX_NEW_TOKENS, ignore_eos=True) if i % 2 else
             SamplingParams(MAX_NEW_TOKENS, temperature=1.5, top_k=50, seed=i, ignore_eos=True)
             for i in range(len(PROMPTS))]
    sampled = [Engine(model).generate([p], s)[0] for p, s in zip(PROMPTS, mixed, strict=True)]
    for settings in ({}, dict(kv_cache_memory=6 * _block_bytes(model), max_num_batched_tokens=64)):
        engine = Engine(model, **settings)
        engine.runner.graph_sizes = [1, 2, 4, 8]
        tokens = engine.generate(PROMPTS, SamplingParams(MAX_NEW_TOKENS, ignore_eos=True))
        assert tokens == ref_tokens
        assert engine.generate(PROMPTS, mixed) == [sampled[i] if i % 2 == 0 else ref_tokens[i]
                                                   for i in range(len(PROMPTS))]
        for cache in engine.runner.caches.values():
            assert cache.num_free_blocks == cache.num_blocks
    assert {variant for _, _, variant in steps} == {("serving", True), ("serving", False)}
    # Graphs' tables are a power of two of blocks wide, at least 8 (or as wide as the model's positions).
    most = -(-model.max_positions // model.kv_block_size)
    assert steps and all(width == most or (width >= 8 and width & (width - 1) == 0)
                         for batch, widths, _ in steps for _, width in widths)


def test_cross_decode_metadata_follows_the_cross_cache(checkpoints):
    """A decode step's cross-attention metadata, kept from the step before while its requests are the same,
    is the cross cache's own: after a request is freed and started again with another prompt (other blocks,
    another length), and for another batch."""
    from tpkit.serving import Engine, SamplingParams
    from tpkit.serving.request import Request

    path, _ = checkpoints("bart")
    model = _model(path)
    runner = Engine(model).runner
    cross = runner.caches["cross"]

    def request(request_id: int, prompt_len: int) -> Request:
        prompt = [5 + i % 7 for i in range(prompt_len)]
        return Request(request_id, prompt, SamplingParams(4), [model.decoder_start_token_id], None, 0.0)

    def assert_current(seq_ids: list[int]) -> None:
        got = runner._cross_decode_metadata(seq_ids)
        expected = cross.decode_metadata(seq_ids, append=False, on_host=True)
        for name in ("slot_mapping", "block_tables", "seq_lens"):
            assert torch.equal(getattr(got, name), getattr(expected, name)), name

    first, second = request(1, 20), request(2, 35)
    assert runner.start(first) and runner.start(second)
    assert_current([1, 2])
    kept = runner._cross_decode_metadata([1, 2])
    assert runner._cross_decode_metadata([1, 2]) is kept
    runner.free(first)
    spacer = request(3, 40)  # takes the blocks the first request freed
    assert runner.start(spacer) and runner.start(request(1, 50))
    assert_current([1, 2])
    assert_current([2, 3])
    assert_current([1, 2, 3])
