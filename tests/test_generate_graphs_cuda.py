"""Many ``generate`` calls on one model of real width, as a serving or throughput loop makes them: new batch
sizes, prompt lengths and token counts every call, eager, from CUDA graphs, and from graphs of the compiled
step. Skipped without a GPU.

Each call's tokens are checked against the eager call's on the same prompts, and the GPU memory the
process holds is checked not to grow once the largest call has run: graphs dropped with a replaced cache
give their memory back, graphs kept per shape are bounded, and no capture goes into a pool whose graphs are
gone (which the caching allocator refuses with an internal assert, and which leaves the process's CUDA
state broken).
"""

from __future__ import annotations

import random

import pytest
import torch

from tpkit.models import LlamaForCausalLM
from tpkit.models.generation import _MAX_GRAPHS
from tpkit.parallel_layers import TPGroup

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# Llama-3-8B's widths (hidden 4096, GQA 32:8, head 128, MLP 14336) in two layers and a smaller vocabulary.
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
          "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 2, "num_attention_heads": 32,
          "num_key_value_heads": 8, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
          "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False, "eos_token_id": 2}
MAX_BATCH, MAX_PROMPT, MAX_NEW = 40, 320, 24
# The largest call: its cache, prefill and graphs are the most memory any later call needs.
LARGEST = 4
# Up to 16 rows a decode step runs tpkit's decode kernels, whose compiled step gives the eager tokens bit
# for bit; past 16, cuBLAS products (whose workspace is per stream) and norms that torch.compile fuses.
DECODE_KERNEL_ROWS = 16
SLACK = 256 << 20  # bytes the allocator may hold past the largest call's (fragmentation, small graphs)


def _calls() -> list[tuple[int, int, int]]:
    """(batch, longest prompt, max_new_tokens) of each call: growing needs first (a cache replaced while
    graphs of the old one exist), the largest call, then random ones no larger."""
    rng = random.Random(0)
    calls = [(2, 40, 8), (8, 120, 12), (24, 200, 6), (5, 60, 20), (MAX_BATCH, MAX_PROMPT, MAX_NEW)]
    for _ in range(15):
        calls.append((rng.choice((1, 3, 7, 16, 17, 32, MAX_BATCH)), rng.randint(1, MAX_PROMPT),
                      rng.randint(2, MAX_NEW)))
    return calls


@torch.inference_mode()
def test_repeated_generate_gives_the_eager_tokens_in_bounded_memory() -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG, dtype=torch.bfloat16, device="cuda", tp_group=TPGroup(None, 0, 1)).eval()
    rng = random.Random(1)
    reserved = []
    for i, (batch, longest, new_tokens) in enumerate(_calls()):
        lens = [longest] * batch if i == LARGEST else [rng.randint(1, longest) for _ in range(batch)]
        prompts = [[rng.randrange(3, CONFIG["vocab_size"]) for _ in range(n)] for n in lens]
        where = f"call {i}: batch {batch}, prompts of {min(lens)}-{max(lens)} tokens, {new_tokens} new"
        eager = model.generate(prompts, new_tokens, ignore_eos=True)
        assert model.generate(prompts, new_tokens, ignore_eos=True, cuda_graph=True) == eager, where
        if batch <= DECODE_KERNEL_ROWS and i % 3 == 0:
            graphed = model.generate(prompts, new_tokens, ignore_eos=True, cuda_graph=True, compile=True)
            assert graphed == eager, where + ", compiled"
        if i in (10, 15):
            model.clear_kv_cache()  # the next call starts a new cache and a new pool
        assert len(model._graphs) <= _MAX_GRAPHS, where
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved())
    later = max(reserved[LARGEST + 1:])
    assert later <= reserved[LARGEST] + SLACK, (
        f"GPU memory reserved grew after the largest call: {reserved[LARGEST] / 2**20:.0f} MiB then up to "
        f"{later / 2**20:.0f} MiB (every call: {[round(r / 2**20) for r in reserved]})")
