"""A training step of Qwen3, Mistral, Gemma 2 and Gemma 3 against transformers (test_training's check:
loss, every gradient, norms and clipping, eager, compiled and from the vocabulary columns), built with
sequence parallelism at tp_size 2, and Gemma 3 at tp_size 4, its KV heads and q/k norms on every rank.

Sixteen tokens a sequence, past the 8-token windows; the q/k norms' weights get the sum of every rank's
heads' gradients, Gemma 2's loss goes through its soft-capped scores and logits.
"""

from __future__ import annotations

import pytest
from checkpoints import make_checkpoint
from test_models_families import FAMILIES
from test_training import _decoder_only, check_training_step


@pytest.fixture(scope="module")
def family_16_tokens(tmp_path_factory):
    made = {}

    def get(name):
        if name not in made:
            model_class, config_class, kwargs = FAMILIES[name]
            path = tmp_path_factory.mktemp(f"{name}_train")
            made[name] = str(path), _decoder_only(make_checkpoint(model_class, config_class(**kwargs), path),
                                                  seq_len=16)
        return made[name]

    return get


@pytest.mark.parametrize("name", ["qwen3", "mistral", "gemma2", "gemma3"])
def test_sequence_parallel_training_step(ranks, family_16_tokens, name):
    path, refs = family_16_tokens(name)
    ranks.run(2, check_training_step, path, 2, **refs, sequence_parallel=True, timeout=240)


def test_gemma3_training_step_tp4(ranks, family_16_tokens):
    path, refs = family_16_tokens("gemma3")
    reduced = ranks.run(4, check_training_step, path, 4, **refs, timeout=240)
    assert set(reduced) == {3}  # every layer's 2 KV heads replicated
