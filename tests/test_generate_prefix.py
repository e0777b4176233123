"""generate with prefix caching and chunked prefill: the tokens of a plain generate and of transformers, for
Llama, GPT-BigCode and BART, at tp_size 1 and 2, with the prefix cache's hits and the tokens it saves
counted.

The prompts share prefixes of more than two KV blocks (16 tokens each), so prompts of one call find the
blocks of those before them, and a second call finds them all.
"""

from __future__ import annotations

import pytest
from checkpoints import (
    make_bart_checkpoint,
    make_gpt_bigcode_checkpoint,
    make_llama_checkpoint,
    random_token_ids,
)
from model_parity import greedy_checkpoints
from multirank import device

MAX_NEW_TOKENS = 10
_PREFIX = random_token_ids(256, (37,), seed=3)[0].tolist()
PROMPTS = [
    _PREFIX + [50, 51, 52],  # 40 tokens: two full blocks of the prefix
    _PREFIX[:20] + [60],  # the first block of it
    [70, 71, 72, 73, 74],  # nothing in common
    _PREFIX + [80] * 12,  # 49 tokens: the same two blocks, and a third of its own
]
CHECKPOINTS = {"llama": make_llama_checkpoint, "gpt_bigcode": make_gpt_bigcode_checkpoint,
               "bart": make_bart_checkpoint}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """``checkpoints(name)``: (path, transformers' greedy tokens for PROMPTS), made on first use."""
    return greedy_checkpoints(tmp_path_factory, CHECKPOINTS, PROMPTS, MAX_NEW_TOKENS)


def _llama(checkpoints):
    from tpkit.models import from_pretrained
    from tpkit.parallel_layers import TPGroup

    path, ref_tokens = checkpoints("llama")
    return from_pretrained(path, tp_group=TPGroup(None, 0, 1), device="cpu"), ref_tokens


def _generate_every_way(path: str, tp_size: int, ref_tokens: list[list[int]]) -> dict:
    """On every rank: plain, chunked, prefix-cached (twice) and both; each the tokens of transformers.
    Returns how many prompt tokens each run put through the model and the prefix cache's hits."""
    from tpkit.attention import PagedKVCache
    from tpkit.models import from_pretrained
    from tpkit.parallel_layers import init_tensor_parallel

    init_tensor_parallel(tp_size)
    model = from_pretrained(path, device=device())
    hits: list[int] = []
    add_sequence = PagedKVCache.add_sequence

    def counting_add_sequence(cache, seq_id, token_ids=None):
        hits.append(add_sequence(cache, seq_id, token_ids))
        return hits[-1]

    PagedKVCache.add_sequence = counting_add_sequence
    try:
        runs = {}
        for name, kwargs in [("plain", {}), ("chunked", dict(max_prefill_tokens=7)),
                             ("cached", dict(prefix_caching=True)),
                             ("cached again", dict(prefix_caching=True)),
                             ("cached chunked", dict(prefix_caching=True, max_prefill_tokens=5))]:
            hits.clear()
            tokens = model.generate(PROMPTS, MAX_NEW_TOKENS, ignore_eos=True, **kwargs)
            assert tokens == ref_tokens, f"{name}: tpkit {tokens} != transformers {ref_tokens}"
            runs[name] = list(hits)
        assert all(cache.num_free_blocks == cache.num_blocks for cache in model.kv_caches.values())
        return runs
    finally:
        PagedKVCache.add_sequence = add_sequence


# tp_size 2 on Llama only: the models share the generation loop.
@pytest.mark.parametrize("name,tp_size", [("llama", 1), ("llama", 2), ("gpt_bigcode", 1), ("bart", 1)])
def test_prefix_caching_and_chunked_prefill_give_transformers_tokens(ranks, checkpoints, name, tp_size):
    path, ref_tokens = checkpoints(name)
    runs = ranks.run(tp_size, _generate_every_way, path, tp_size, ref_tokens)
    assert all(run == runs[0] for run in runs)
    hits = runs[0]
    if name == "bart":
        # The decoder's prompt (its start token) fills no block: nothing to share.
        assert all(not any(h) for h in hits.values())
        return
    assert hits["plain"] == hits["chunked"] == [0, 0, 0, 0]
    # Within the first call: prompt 1 finds prompt 0's first block, prompt 3 its two.
    assert hits["cached"] == [0, 16, 0, 32]
    # Across calls: prompt 0 finds its own two blocks, prompt 3 its own third.
    assert hits["cached again"] == hits["cached chunked"] == [32, 16, 0, 48]


def test_prefix_cache_lives_in_the_model_between_calls_and_saves_work(checkpoints):
    model, ref_tokens = _llama(checkpoints)
    run_tokens = []
    hidden_states = model.hidden_states

    def counting_hidden_states(input_ids, positions, kv_cache=None, metadata=None):
        if metadata is not None and metadata.is_prefill:
            run_tokens.append(input_ids.numel())
        return hidden_states(input_ids, positions, kv_cache, metadata)

    model.hidden_states = counting_hidden_states
    assert model.generate(PROMPTS, MAX_NEW_TOKENS, ignore_eos=True, prefix_caching=True) == ref_tokens
    assert run_tokens == [sum(len(p) for p in PROMPTS) - 48]
    cache = model.kv_caches["self"]
    assert cache.num_cached_blocks == 3
    run_tokens.clear()
    assert model.generate(PROMPTS, MAX_NEW_TOKENS, ignore_eos=True, prefix_caching=True,
                          max_prefill_tokens=10) == ref_tokens
    assert model.kv_caches["self"] is cache
    # 96 of the 115 prompt tokens were cached: the 19 left, in steps of at most 10 tokens.
    assert run_tokens == [10, 9]
    # A call without prefix caching computes everything and may evict the cached blocks.
    run_tokens.clear()
    assert model.generate(PROMPTS, 3, ignore_eos=True) == [t[:3] for t in ref_tokens]
    assert run_tokens == [sum(len(p) for p in PROMPTS)]


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(prefix_caching=1), TypeError, "prefix_caching must be a bool, got int"),
    (dict(max_prefill_tokens=0), ValueError, r"max_prefill_tokens must be None or an int >= 1, got 0"),
    (dict(max_prefill_tokens=2.0), ValueError, r"max_prefill_tokens must be None or an int >= 1, got 2.0"),
])
def test_bad_arguments(checkpoints, kwargs, error, match):
    model, _ = _llama(checkpoints)
    with pytest.raises(error, match=match):
        model.generate(PROMPTS, 2, **kwargs)
    assert not model.kv_caches
