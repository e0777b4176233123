"""Compose your own tensor-parallel model from tpkit layers, load a checkpoint into it, generate.

A small pre-norm transformer (GQA attention, SwiGLU MLP, learned positions). Its checkpoint
stores q/k/v and gate/up as separate tensors, like most HuggingFace models; ``stacked_params_mapping`` tells
``load_weights`` which fused parameter (and which part of it) each one loads into, and every rank keeps only
its shard. Subclassing ``PagedDecoderOnlyLM`` (define ``hidden_states`` and ``compute_logits``) gives the
model ``generate`` on the paged KV cache. Every rank checks itself against the same model unsharded.

    python examples/custom_model.py                                   # 2 CPU ranks (gloo)
    torchrun --nproc-per-node 2 examples/custom_model.py              # 2 GPUs (NCCL), or CPU ranks without
    torchrun --nproc-per-node 4 examples/custom_model.py              # 4 GPUs: 2 KV heads replicated
"""

from __future__ import annotations

import os

import torch
from torch import nn

from tpkit.attention import Attention
from tpkit.loaders import load_weights
from tpkit.models import PagedDecoderOnlyLM
from tpkit.parallel_layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    init_tensor_parallel,
    launch,
    local_device,
)

# Heads of 32 (the smallest the CUDA attention kernel takes).
VOCAB, HIDDEN, HEADS, KV_HEADS, FFN, LAYERS, POSITIONS = 512, 256, 8, 2, 512, 2, 256


class Block(nn.Module):
    def __init__(self, layer_idx: int, **factory) -> None:
        super().__init__()
        head_size = HIDDEN // HEADS
        self.layer_idx = layer_idx
        self.attn_norm = nn.LayerNorm(HIDDEN, device=factory["device"])
        self.qkv_proj = QKVParallelLinear(HIDDEN, head_size, HEADS, KV_HEADS, bias=False, **factory)
        self.sizes = [self.qkv_proj.q_size, self.qkv_proj.kv_size, self.qkv_proj.kv_size]
        self.attn = Attention(self.qkv_proj.num_heads, head_size, self.qkv_proj.num_kv_heads)
        self.o_proj = RowParallelLinear(HIDDEN, HIDDEN, bias=False, **factory)  # one all-reduce
        self.mlp_norm = nn.LayerNorm(HIDDEN, device=factory["device"])
        self.gate_up_proj = MergedColumnParallelLinear(HIDDEN, [FFN, FFN], bias=False, **factory)
        self.down_proj = RowParallelLinear(FFN, HIDDEN, bias=False, **factory)  # one all-reduce

    def forward(self, x, kv_cache, metadata):
        q, k, v = self.qkv_proj(self.attn_norm(x)).split(self.sizes, dim=-1)
        x = x + self.o_proj(self.attn(q, k, v, kv_cache=kv_cache, layer_idx=self.layer_idx,
                                      metadata=metadata))
        gate, up = self.gate_up_proj(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down_proj(nn.functional.silu(gate) * up)


class TinyLM(PagedDecoderOnlyLM):
    stacked_params_mapping = [("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"),
                              ("qkv_proj", "v_proj", "v"),
                              ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]

    def __init__(self, device: torch.device, tp_group=None) -> None:
        super().__init__()
        factory = {"device": device, "tp_group": tp_group}
        self.embed = VocabParallelEmbedding(VOCAB, HIDDEN, **factory)
        self.positions = VocabParallelEmbedding(POSITIONS, HIDDEN, **factory)
        self.blocks = nn.ModuleList(Block(i, **factory) for i in range(LAYERS))
        self.norm = nn.LayerNorm(HIDDEN, device=device)
        self.lm_head = ParallelLMHead(VOCAB, HIDDEN, **factory)
        # What generate needs to know: sizes, the cache layout (this rank's KV heads), EOS, the group.
        self.vocab_size, self.max_positions, self.eos_token_ids = VOCAB, POSITIONS, ()
        self.num_layers, self.head_size = LAYERS, HIDDEN // HEADS
        self.num_kv_heads = self.blocks[0].qkv_proj.num_kv_heads
        self.tp_group = self.embed.tp_group

    def hidden_states(self, input_ids, positions, kv_cache=None, metadata=None):
        x = self.embed(input_ids) + self.positions(positions)  # [batch, seq, hidden]
        for block in self.blocks:
            x = block(x, kv_cache, metadata)
        return self.norm(x)

    def compute_logits(self, hidden_states):
        return self.lm_head.compute_logits(hidden_states)  # full vocabulary on every rank

    def load_weights(self, weights) -> set[str]:
        return load_weights(self, weights, self.stacked_params_mapping, progress=False)


def checkpoint(seed: int = 0) -> dict[str, torch.Tensor]:
    """Full, unsharded tensors under their checkpoint names (a real one: tpkit.loaders.iter_weights(path))."""
    g = torch.Generator().manual_seed(seed)
    kv = HIDDEN // HEADS * KV_HEADS
    tensors = {"embed.weight": torch.randn(VOCAB, HIDDEN, generator=g),
               "positions.weight": torch.randn(POSITIONS, HIDDEN, generator=g)}
    shapes = dict(q_proj=(HIDDEN, HIDDEN), k_proj=(kv, HIDDEN), v_proj=(kv, HIDDEN), o_proj=(HIDDEN, HIDDEN),
                  gate_proj=(FFN, HIDDEN), up_proj=(FFN, HIDDEN), down_proj=(HIDDEN, FFN))
    for i in range(LAYERS):
        for name, shape in shapes.items():
            tensors[f"blocks.{i}.{name}.weight"] = torch.randn(*shape, generator=g) * shape[1] ** -0.5
        for norm in ("attn_norm", "mlp_norm"):
            tensors[f"blocks.{i}.{norm}.weight"] = 1 + 0.1 * torch.randn(HIDDEN, generator=g)
            tensors[f"blocks.{i}.{norm}.bias"] = 0.1 * torch.randn(HIDDEN, generator=g)
    tensors |= {"norm.weight": torch.ones(HIDDEN), "norm.bias": torch.zeros(HIDDEN),
                "lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=g)}
    return tensors


@torch.no_grad()
def run() -> None:
    tp = init_tensor_parallel()
    device = local_device()  # this rank's GPU under torchrun with NCCL, else the CPU
    model = TinyLM(device).eval()  # generate runs a model in eval mode (no dropout)
    model.load_weights(checkpoint().items())
    reference = TinyLM(device, tp_group=TPGroup(None, 0, 1)).eval()  # the same model, unsharded
    reference.load_weights(checkpoint().items())

    input_ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)
    torch.testing.assert_close(model(input_ids), reference(input_ids), rtol=1e-4, atol=1e-4)
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10, 11, 12, 13, 14]]
    tokens = model.generate(prompts, 16)
    assert tokens == reference.generate(prompts, 16)
    if tp.rank == 0:
        heads = model.blocks[0].qkv_proj.num_heads
        print(f"tp_size {tp.size}: this rank holds {heads} of {HEADS} query heads, {model.num_kv_heads} KV "
              f"head(s), {sum(p.numel() for p in model.parameters()):,} parameters")
        print(f"logits and greedy tokens equal the unsharded model's; {tokens[0]}")


if __name__ == "__main__":
    if "WORLD_SIZE" in os.environ:  # torchrun: this process is a rank
        run()
    else:
        launch(run, 2)  # 2 CPU ranks (gloo) on this machine
