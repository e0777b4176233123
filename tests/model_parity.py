"""Parity of tpkit's models with transformers: references made once in the pytest process, checks on ranks.

The parent computes transformers' logits and greedy tokens (each prompt on its own, no padding, EOS off so
every prompt runs the full length) and hands them to :func:`check_parity`, which every rank runs: it loads
its shard with ``from_pretrained``, compares the logits, then generates the whole ragged batch at once
through the paged KV cache.
"""

from __future__ import annotations

import torch
from multirank import device

# float32 rounding: the all-reduces of tensor parallelism sum partial products in another order.
LOGITS_TOLERANCE = dict(rtol=1e-4, atol=1e-4)


@torch.no_grad()
def hf_greedy(hf_model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens for each prompt alone, ``max_new_tokens`` of them (EOS off)."""
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        # The whole prompt attends: without a mask, transformers 4 masks every token equal to pad_token_id,
        # and BART prompts start with BOS = 0.
        generated = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                      min_new_tokens=0, do_sample=False, num_beams=1, eos_token_id=None,
                                      pad_token_id=0)
        # A decoder-only model returns the prompt too; an encoder-decoder the decoder start token.
        start = 1 if hf_model.config.is_encoder_decoder else len(prompt)
        new_tokens = generated[0, start:].tolist()
        assert len(new_tokens) == max_new_tokens, "transformers stopped early"
        outputs.append(new_tokens)
    return outputs


def greedy_checkpoints(tmp_path_factory, factories: dict, prompts: list[list[int]], max_new_tokens: int):
    """``get(name)``: (path, transformers' greedy tokens for ``prompts``) of the checkpoint
    ``factories[name]`` makes, made on first use."""
    made = {}

    def get(name: str) -> tuple[str, list[list[int]]]:
        if name not in made:
            path = tmp_path_factory.mktemp(name)
            made[name] = str(path), hf_greedy(factories[name](path), prompts, max_new_tokens)
        return made[name]

    return get


def check_parity(path: str, tp_size: int, forward_args: tuple[torch.Tensor, ...], ref_logits: torch.Tensor,
                 prompts: list[list[int]], ref_tokens: list[list[int]]) -> dict:
    """On every rank: tpkit logits and greedy tokens equal transformers'. Returns the rank's shard sizes."""
    from tpkit.models import from_pretrained
    from tpkit.parallel_layers import init_tensor_parallel

    tp = init_tensor_parallel(tp_size)
    model = from_pretrained(path, device=device())
    assert model.tp_group.size == tp_size and model.tp_group.rank == tp.rank
    with torch.no_grad():
        logits = model(*(t.to(device()) for t in forward_args)).cpu()
    torch.testing.assert_close(logits, ref_logits, **LOGITS_TOLERANCE)
    tokens = model.generate(prompts, len(ref_tokens[0]), ignore_eos=True)
    assert tokens == ref_tokens, f"rank {tp.rank}: tpkit {tokens} != transformers {ref_tokens}"
    # The blocks went back to the cache.
    assert all(cache.num_free_blocks == cache.num_blocks for cache in model.kv_caches.values())
    return {"num_params": sum(p.numel() for p in model.parameters()), "num_kv_heads": model.num_kv_heads}


def decoder_only_references(hf_model, prompts: list[list[int]], max_new_tokens: int) -> dict:
    """transformers' logits for a random batch and greedy tokens for ``prompts``: check_parity's inputs."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, hf_model.config.vocab_size, (2, 13), generator=generator)
    with torch.no_grad():
        logits = hf_model(input_ids).logits
    return {"forward_args": (input_ids,), "ref_logits": logits, "prompts": prompts,
            "ref_tokens": hf_greedy(hf_model, prompts, max_new_tokens)}


def run_parity(ranks, checkpoint: tuple[str, object, dict], tp_size: int, total_num_kv_heads: int) -> None:
    """:func:`check_parity` on ``tp_size`` ranks; then every rank holds a shard, not the whole model, its
    KV heads split (or one each when replicated)."""
    path, hf_model, refs = checkpoint
    shards = ranks.run(tp_size, check_parity, path, tp_size, **refs)
    for shard in shards:
        if tp_size > 1:
            assert shard["num_params"] < hf_model.num_parameters()
        assert shard["num_kv_heads"] == max(1, total_num_kv_heads // tp_size)
