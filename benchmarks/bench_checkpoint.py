"""Checkpoint throughput: ``tpkit.checkpoint.save`` / ``load`` of a Llama-3-8B-shaped model against
``torch.save`` / ``torch.load`` and safetensors ``save_file`` / ``load_file`` of the same bytes.

The model is tpkit's Llama with Llama-3-8B's shapes (hidden 4096, 14336 intermediate, 32 query and 8 KV
heads, a vocabulary of 128256, untied embeddings, bf16), ``--layers`` of its 32 layers (the default, 2,
fits a machine of 24 GiB: about 2.9 GB), built without random draws and filled with random values. Each
contender writes the model's tensors into a fresh directory and reads them back; the rates are the
tensors' bytes over the time:

- ``tpkit``: ``save(path, model)`` (a DCP directory; fsync of every file, as DCP does) and ``load(path,
  model)``, which checks the checkpoint against the model and reads straight into the parameters;
- ``torch``: ``torch.save(model.state_dict(), file)`` plus an fsync, and ``torch.load(file,
  weights_only=True)`` followed by ``load_state_dict``;
- ``safetensors``: ``save_file`` of the state dict plus an fsync, ``load_file`` then ``load_state_dict``.

Reads are from a warm page cache (each file was just written); the contenders take turns for ``--rounds``
rounds and each one's best round counts (the cores of a shared machine come and go). Under ``torchrun``
every rank saves and loads its shard (tpkit one directory for all; the others a file a rank), and a rate is
all ranks' bytes over the slowest rank's time.

    python benchmarks/bench_checkpoint.py                      # CPU, 2 layers
    python benchmarks/bench_checkpoint.py --layers 32          # the whole model (about 16 GB of host memory)
    python benchmarks/bench_checkpoint.py --device cuda        # the model on a GPU
    torchrun --nproc-per-node 2 benchmarks/bench_checkpoint.py --device cuda --layers 32
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from tpkit.checkpoint import load, save
from tpkit.models import LlamaForCausalLM
from tpkit.parallel_layers import destroy_tensor_parallel, init_tensor_parallel, skip_init

LLAMA_3_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                  vocab_size=128256, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                  tie_word_embeddings=False, architectures=["LlamaForCausalLM"])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _fsync_tree(path: Path) -> None:
    for file in [path] if path.is_file() else path.rglob("*"):
        if file.is_file():
            with open(file, "rb+") as handle:
                os.fsync(handle.fileno())


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _timed(fn: Callable[[], None], device: torch.device) -> float:
    """The slowest rank's seconds for ``fn``."""
    _barrier()
    start = time.perf_counter()
    fn()
    _sync(device)
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds)


def _contenders(model: LlamaForCausalLM, root: Path, rank: int) -> dict[str, tuple[Callable, Callable]]:
    """name -> (write, read), each writing into / reading from a path of its own under ``root``."""
    tpkit_dir, torch_file = root / "tpkit", root / f"torch-{rank}.pt"
    safetensors_file = root / f"safetensors-{rank}.safetensors"

    def torch_write() -> None:
        torch.save(model.state_dict(), torch_file)
        _fsync_tree(torch_file)

    def safetensors_write() -> None:
        save_file(model.state_dict(), str(safetensors_file))
        _fsync_tree(safetensors_file)

    def torch_read() -> None:
        model.load_state_dict(torch.load(torch_file, weights_only=True, map_location="cpu"))

    return {
        "tpkit": (lambda: save(tpkit_dir, model), lambda: load(tpkit_dir, model)),
        "torch": (torch_write, torch_read),
        "safetensors": (safetensors_write,
                        lambda: model.load_state_dict(load_file(str(safetensors_file)))),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the 32 (default 2)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()

    tp = init_tensor_parallel()
    if args.device == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    config = {**LLAMA_3_8B, "num_hidden_layers": args.layers}
    with skip_init():
        model = LlamaForCausalLM(config, dtype=torch.bfloat16, device=device)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    local_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    total = torch.tensor([local_bytes], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(total)
    gigabytes = float(total) / 1e9

    root = Path(args.dir or tempfile.mkdtemp(prefix="bench_checkpoint_"))
    if tp.rank == 0:
        root.mkdir(parents=True, exist_ok=True)
    _barrier()
    best: dict[str, dict[str, float]] = {}
    contenders = _contenders(model, root, dist.get_rank() if dist.is_initialized() else 0)
    for _ in range(args.rounds):
        for name, (write, read) in contenders.items():
            rates = best.setdefault(name, {"write": 0.0, "read": 0.0})
            rates["write"] = max(rates["write"], gigabytes / _timed(write, device))
            rates["read"] = max(rates["read"], gigabytes / _timed(read, device))

    if tp.rank == 0:
        print(f"Llama-3-8B-shaped, {args.layers} layers, bf16, {gigabytes:.2f} GB, tp_size {tp.size}, "
              f"{args.device}; torch {torch.__version__}, {platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} CPUs; best of {args.rounds} rounds, reads from a warm page cache")
        print(f"{'contender':<12} {'write GB/s':>10} {'read GB/s':>10}")
        for name, rates in best.items():
            print(f"{name:<12} {rates['write']:>10.2f} {rates['read']:>10.2f}")
        if args.json:
            Path(args.json).write_text(json.dumps({"layers": args.layers, "device": args.device,
                                                   "tp_size": tp.size, "gigabytes": gigabytes,
                                                   "torch": torch.__version__, "results": best}, indent=1))
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    destroy_tensor_parallel()


if __name__ == "__main__":
    main()
