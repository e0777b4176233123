"""The engine on a CUDA GPU: decode steps replayed from CUDA graphs, chunked prefill and preemption give the
tokens of the static ``generate``. Skipped without a GPU."""

from __future__ import annotations

import random

import pytest
import torch

from tpkit.models import LlamaForCausalLM
from tpkit.serving import Engine, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 512,
          "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8,
          "num_key_value_heads": 2, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6}
BLOCK_BYTES = 2 * 2 * 16 * 2 * 64 * 4  # keys and values, 2 layers, 16 tokens, 2 KV heads of 64, float32


@pytest.mark.parametrize("options", [{}, {"max_num_seqs": 8, "max_num_batched_tokens": 64},
                                     {"kv_cache_memory": 40 * BLOCK_BYTES}],
                         ids=["default", "small-steps", "preempting"])
def test_engine_gives_the_static_generate_tokens_on_gpu(options):
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG, dtype=torch.float32, device="cuda").eval()
    rng = random.Random(0)
    prompts = [[rng.randrange(CONFIG["vocab_size"]) for _ in range(rng.randint(5, 200))] for _ in range(24)]
    expected = model.generate(prompts, 24, ignore_eos=True)
    engine = Engine(model, **options)
    assert engine.generate(prompts, SamplingParams(24, ignore_eos=True)) == expected
    if "kv_cache_memory" in options:
        assert engine.num_preemptions > 0
