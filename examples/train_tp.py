"""Train a tensor-parallel Llama for a few steps, step for step with transformers training the whole model.

    python examples/train_tp.py                           # 2 CPU ranks (gloo)
    torchrun --nproc-per-node 2 examples/train_tp.py      # 2 GPUs (NCCL), or CPU ranks without
    python examples/train_tp.py --sequence-parallel       # the residual stream split along the sequence

A small Llama with one KV head (multi-query, so every rank holds a replica of it) is written with random
weights in HuggingFace format. Every rank loads its shard with ``from_pretrained`` and, as the reference,
the whole model into transformers. Both learn the same batches (each token the one before it plus one,
modulo the vocabulary) with the same AdamW. tpkit's loss comes from every position's final hidden states
(``model.hidden_states``, no cache) through ``lm_head.cross_entropy``, each rank from its own columns of the
vocabulary (no rank holds all the logits; transformers' is cross-entropy of the full logits); then
backward, ``reduce_kv_replica_grads`` (each replica of the KV head holds only its own query
heads' share of the gradient), ``reduce_sequence_parallel_grads`` (with ``--sequence-parallel``: the
norms, which see a rank's tokens only), ``clip_grad_norm_`` (the whole model's gradient norm, found across
the ranks), step. AdamW works element by element, so each rank steps its shard alone. The two losses and
gradient norms agree at every step, and the losses fall; the KV head's replicas stay equal.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from tpkit.models import from_pretrained
from tpkit.parallel_layers import (
    clip_grad_norm_,
    destroy_tensor_parallel,
    init_tensor_parallel,
    launch,
    local_device,
    reduce_kv_replica_grads,
    reduce_sequence_parallel_grads,
)

CONFIG = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128,
              tie_word_embeddings=False)
STEPS, BATCH, SEQ_LEN, LR, MAX_NORM = 30, 8, 32, 3e-3, 1.0


def write_checkpoint(path: str) -> None:
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(path)


def batches(device: torch.device):
    """``(input_ids, labels)`` ``[BATCH, SEQ_LEN]`` each: runs of consecutive ids from random starts, the same
    on every rank."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        start = torch.randint(0, CONFIG["vocab_size"], (BATCH, 1), generator=generator)
        ids = (start + torch.arange(SEQ_LEN + 1)) % CONFIG["vocab_size"]
        yield ids[:, :-1].to(device), ids[:, 1:].to(device)


def vocab_parallel_loss(model, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    return model.lm_head.cross_entropy(model.hidden_states(input_ids, positions), labels)


def run(path: str, sequence_parallel: bool) -> None:
    tp = init_tensor_parallel()
    device = local_device()  # this rank's GPU under torchrun with NCCL, else the CPU
    model = from_pretrained(path, device=device, sequence_parallel=sequence_parallel).train()
    reference = LlamaForCausalLM.from_pretrained(path).to(device).train()
    optimizers = [torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.01) for m in (model, reference)]
    losses, norms = [], []
    for step, (input_ids, labels) in enumerate(batches(device)):
        loss = vocab_parallel_loss(model, input_ids, labels)
        loss.backward()
        reduce_kv_replica_grads(model)
        reduce_sequence_parallel_grads(model)
        norm = clip_grad_norm_(model, MAX_NORM)
        ref_loss = F.cross_entropy(reference(input_ids).logits.flatten(0, 1), labels.flatten())
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), MAX_NORM)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        losses.append((loss.item(), ref_loss.item()))
        norms.append((norm.item(), ref_norm.item()))
        if tp.rank == 0 and (step % 5 == 0 or step == STEPS - 1):
            print(f"step {step:2d}: loss {loss.item():.4f}, gradient norm {norm.item():.4f} "
                  f"(tp_size {tp.size}{', sequence-parallel' if sequence_parallel else ''}); "
                  f"{ref_loss.item():.4f}, {ref_norm.item():.4f} (transformers, unsharded)")
    worst = max(abs(a - b) / b for a, b in losses + norms)
    assert worst < 1e-3, f"the losses or gradient norms drifted apart: {worst:.2e} relative"
    first, last = losses[0][0], losses[-1][0]
    assert last < 0.5 * first, f"the loss did not fall: {first:.3f} -> {last:.3f}"
    # qkv_proj's k rows: the KV head, the same on every rank.
    qkv = model.layers[0].self_attn.qkv_proj
    k_rows = qkv.weight[qkv.q_size:qkv.q_size + qkv.kv_size].detach()
    replicas = [torch.empty_like(k_rows) for _ in range(tp.size)] if tp.size > 1 else [k_rows]
    if tp.size > 1:
        dist.all_gather(replicas, k_rows, group=tp.group)
    spread = max((r - replicas[0]).abs().max().item() for r in replicas)
    assert spread == 0.0, f"the KV head's replicas differ by {spread:.2e}"
    if tp.rank == 0:
        print(f"{STEPS} steps: the losses and gradient norms agree within {worst:.1e} (relative); the KV "
              f"head's {tp.size} replicas are equal")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Train a tensor-parallel Llama beside transformers.")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="split the residual stream along the sequence (Megatron's sequence parallelism)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as checkpoint:
        if "WORLD_SIZE" in os.environ:  # torchrun: rank 0 writes the checkpoint, every rank reads it
            tp = init_tensor_parallel()
            paths = [checkpoint]
            dist.broadcast_object_list(paths, group=tp.group, group_src=0)
            if tp.rank == 0:
                write_checkpoint(paths[0])
            dist.barrier(group=tp.group)
            run(paths[0], args.sequence_parallel)
            dist.barrier(group=tp.group)
            destroy_tensor_parallel()
        else:
            write_checkpoint(checkpoint)
            launch(run, 2, checkpoint, args.sequence_parallel)  # 2 CPU ranks (gloo) on this machine
