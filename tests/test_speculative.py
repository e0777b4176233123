"""Speculative decoding on tpkit's paged cache: drafts verified with forward_on_cache, rejected tokens
truncated. Greedy verification must give exactly the tokens of plain greedy generation, whatever the
draft: drafts drawn from the same model (a fork of the sequence decoding ahead, every token accepted) and
drafts with wrong tokens (the rest of the draft rejected and truncated)."""

from __future__ import annotations

import pytest
import torch
from checkpoints import make_llama_checkpoint, random_token_ids

from tpkit.attention import PagedKVCache
from tpkit.models import from_pretrained
from tpkit.parallel_layers import TPGroup

NUM_TOKENS = 24


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_speculative")
    make_llama_checkpoint(path)
    return from_pretrained(path, tp_group=TPGroup(None, 0, 1), device="cpu")


@pytest.fixture(scope="module")
def prompts():
    return [ids.tolist() for ids in random_token_ids(256, (21,), (5,), seed=4)]


def _draft_by_forking(model, cache, seq_id: int, last: int, k: int) -> list[int]:
    """k greedy tokens after ``last`` from a fork of the sequence (its blocks shared, the last one copied on
    the fork's first write), which is then freed."""
    draft_id = seq_id + 1000
    cache.fork(seq_id, draft_id)
    draft = []
    for _ in range(k):
        (logits,) = model.forward_on_cache(cache, [draft_id], [[last]])
        last = int(logits[-1].argmax())
        draft.append(last)
    cache.free(draft_id)
    return draft


def _speculative_greedy(model, prompts, draft_lens, corrupt=None):
    """Greedy generation of NUM_TOKENS tokens a prompt, several prompts verified in each step.

    Each step feeds every sequence its last token and a draft of ``draft_lens[i]`` tokens, accepts the
    longest draft prefix that greedy verification agrees with, adds the verifier's next token, and
    truncates the rejected draft tokens. ``corrupt(step, i, draft)`` may spoil drafts."""
    cache = model.new_kv_cache(64)
    logits = model.forward_on_cache(cache, range(len(prompts)), prompts)
    outputs = [[int(rows[-1].argmax())] for rows in logits]
    accepted_total = 0
    step = 0
    while any(len(out) < NUM_TOKENS for out in outputs):
        seq_ids = [i for i, out in enumerate(outputs) if len(out) < NUM_TOKENS]
        drafts = []
        for i in seq_ids:
            draft = _draft_by_forking(model, cache, i, outputs[i][-1], draft_lens[i])
            drafts.append(corrupt(step, i, draft) if corrupt else draft)
        fed = [[outputs[i][-1]] + draft for i, draft in zip(seq_ids, drafts, strict=True)]
        verified = model.forward_on_cache(cache, seq_ids, fed)
        for i, draft, rows in zip(seq_ids, drafts, verified, strict=True):
            predicted = rows.argmax(-1).tolist()  # [len(draft) + 1]
            accepted = 0
            while accepted < len(draft) and draft[accepted] == predicted[accepted]:
                accepted += 1
            cache.truncate(i, len(draft) - accepted)
            outputs[i] += draft[:accepted] + [predicted[accepted]]
            accepted_total += accepted
        step += 1
    for i, out in enumerate(outputs):
        # The cache holds the prompt and every output token but the last, as after plain decoding.
        assert cache.seq_len(i) == len(prompts[i]) + len(out) - 1
        cache.free(i)
    assert cache.num_free_blocks == cache.num_blocks
    return [out[:NUM_TOKENS] for out in outputs], accepted_total, step


def test_a_draft_from_the_same_model_is_accepted_whole(model, prompts):
    expected = model.generate(prompts, NUM_TOKENS, ignore_eos=True)
    tokens, accepted, steps = _speculative_greedy(model, prompts, draft_lens=[4, 3])
    assert tokens == expected
    # Every draft token was right: 5 and 4 new tokens a step, for 5 and 6 steps.
    assert steps == 6 and accepted == 5 * 4 + 6 * 3


def test_wrong_draft_tokens_are_rejected_and_truncated(model, prompts):
    expected = model.generate(prompts, NUM_TOKENS, ignore_eos=True)

    def corrupt(step, i, draft):
        # A wrong token at a place that moves with the step (sometimes the first, sometimes none).
        place = (step + i) % (len(draft) + 1)
        if place < len(draft):
            draft = draft[:place] + [(draft[place] + 1) % 256] + draft[place + 1:]
        return draft

    tokens, accepted, steps = _speculative_greedy(model, prompts, draft_lens=[4, 3], corrupt=corrupt)
    assert tokens == expected
    assert steps > 6 and accepted < 5 * 4 + 6 * 3


def test_prefill_logits_equal_the_full_forward(model, prompts):
    """forward_on_cache's logits at every prompt position are those of the model's forward without a cache."""
    cache = model.new_kv_cache(16)
    logits = model.forward_on_cache(cache, [3, 9], prompts)
    with torch.no_grad():
        for prompt, rows in zip(prompts, logits, strict=True):
            torch.testing.assert_close(rows, model(torch.tensor([prompt]))[0], rtol=1e-4, atol=1e-4)


def test_forward_on_cache_refuses_before_changing_anything(model, prompts):
    cache = model.new_kv_cache(2)
    model.forward_on_cache(cache, [0], [prompts[1]])
    before = (cache.num_free_blocks, cache.seq_len(0))
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        model.forward_on_cache(cache, [1, 0], [prompts[0], [5]])
    with pytest.raises(ValueError, match=r"seq_ids: expected 2 distinct ids"):
        model.forward_on_cache(cache, [0, 0], [[5], [6]])
    with pytest.raises(ValueError, match=r"exceed the model's 256 positions"):
        model.forward_on_cache(cache, [0], [[5] * 252])
    with pytest.raises(ValueError, match=r"kv_cache: expected \(num_layers"):
        model.forward_on_cache(PagedKVCache(1, 4, 16, 2, 32, dtype=torch.float32, device="cpu"), [0], [[5]])
    assert (cache.num_free_blocks, cache.seq_len(0)) == before and 1 not in cache
