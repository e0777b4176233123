"""A tensor-parallel MLP (SwiGLU: Merged gate_up, Row down) checked against the unsharded one.

Run on 2 CPU ranks, either way::

    python examples/tp_mlp.py --nproc 2                   # spawns the ranks itself (gloo)
    torchrun --nproc-per-node 2 examples/tp_mlp.py        # gloo on CPU, NCCL when there are GPUs

Each rank builds its shard of the MLP, loads it from the full weights (the same on every rank: same seed),
runs the same input, and the output is compared with the unsharded MLP's. One all-reduce per forward.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpkit.parallel_layers import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    destroy_tensor_parallel,
    init_tensor_parallel,
    launch,
    local_device,
)


class TPMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate/up split by output features and down by input features."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, device: torch.device) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=False,
                                                       device=device)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # [..., hidden] -> [..., 2 * intermediate / tp_size]: this rank's gate and up columns
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)  # partial sums all-reduced: [..., hidden] on every rank


def reference_mlp(x: torch.Tensor, gate: nn.Linear, up: nn.Linear, down: nn.Linear) -> torch.Tensor:
    return down(F.silu(gate(x)) * up(x))


def run(hidden_size: int, intermediate_size: int, tokens: int) -> bool:
    """One rank's work; returns whether the output matched (on every rank)."""
    tp = init_tensor_parallel(timeout=60)
    device = local_device()  # this rank's GPU under torchrun with NCCL, else the CPU
    torch.manual_seed(0)  # same full weights and input on every rank
    gate, up, down = (nn.Linear(hidden_size, intermediate_size, bias=False, device=device),
                      nn.Linear(hidden_size, intermediate_size, bias=False, device=device),
                      nn.Linear(intermediate_size, hidden_size, bias=False, device=device))
    x = torch.randn(tokens, hidden_size, device=device)  # [tokens, hidden]

    mlp = TPMLP(hidden_size, intermediate_size, device=device)
    weight = mlp.gate_up_proj.weight
    weight.weight_loader(weight, gate.weight, 0)
    weight.weight_loader(weight, up.weight, 1)
    mlp.down_proj.weight.weight_loader(mlp.down_proj.weight, down.weight)

    with torch.no_grad():
        out = mlp(x)
        expected = reference_mlp(x, gate, up, down)
    error = (out - expected).abs().max().item()
    ok = torch.allclose(out, expected, rtol=1e-5, atol=1e-5)
    line = (f"rank {tp.rank}/{tp.size}: gate_up_proj.weight {tuple(weight.shape)}, "
            f"down_proj.weight {tuple(mlp.down_proj.weight.shape)}, output {tuple(out.shape)}, "
            f"max |tp - unsharded| = {error:.2e}")
    results = [(line, ok)]
    if tp.size > 1:
        results = [None] * tp.size
        dist.all_gather_object(results, (line, ok), group=tp.group)
    ok = all(rank_ok for _, rank_ok in results)
    if tp.rank == 0:
        print(f"tensor-parallel MLP, hidden {hidden_size}, intermediate {intermediate_size}, "
              f"{tokens} tokens, "
              f"tp_size {tp.size} ({tp.backend or 'single process'})")
        print("\n".join(rank_line for rank_line, _ in results))
        print("output matches the unsharded MLP" if ok else "MISMATCH with the unsharded MLP")
    destroy_tensor_parallel()
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2,
                        help="CPU ranks to spawn when not launched by torchrun (default 2)")
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--intermediate-size", type=int, default=688)
    parser.add_argument("--tokens", type=int, default=8)
    args = parser.parse_args()
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:  # launched by torchrun: this process is a rank
        sys.exit(0 if run(args.hidden_size, args.intermediate_size, args.tokens) else 1)
    if args.nproc < 1:
        parser.error(f"--nproc must be at least 1, got {args.nproc}")
    # CPU ranks (gloo) on this machine, whatever GPUs there are.
    matches = launch(run, args.nproc, args.hidden_size, args.intermediate_size, args.tokens)
    sys.exit(0 if all(matches) else 1)


if __name__ == "__main__":
    main()
