"""Checkpoint loading: tpkit.loaders against safetensors ``load_file`` and transformers ``from_pretrained``.

Makes a Llama-shaped checkpoint of random bf16 weights (about 2 GB, sharded through
``model.safetensors.index.json`` as transformers saves big models), then loads it with each contender, every
load in a fresh process (a first load, as users see it; peak memory its own). The contenders take turns for
``--rounds`` rounds and each one's best round counts (the cores of a shared machine come and go):

- ``load_file``: ``safetensors.torch.load_file`` file by file, copied into a transformers Llama with
  ``load_state_dict`` (``load_file`` alone returns memory-mapped views and reads nothing until touched);
- ``from_pretrained``: ``transformers.LlamaForCausalLM.from_pretrained(path, dtype=bfloat16)``. transformers 5
  leaves the parameters memory-mapped, read only when first touched: the row that counts for the goal
  includes touching every page of every parameter once, so that its weights are in memory like the others';
- ``tpkit``: ``tpkit.models.LlamaForCausalLM.load_weights(iter_weights(path))`` at tp_size 1, and at
  tp_size 2 on two spawned CPU ranks (gloo), each reading only its shard.

Goals (issue 4): tpkit's throughput at least ``load_file``'s; at least 2x faster than ``from_pretrained``;
each rank's peak memory under 1.2x the bytes of its shard. Peak RSS is the highest RSS from the start of
loading, less the RSS before the model existed (so it holds the model and what loading adds). The page
cache is warm for every contender (the files were just written), and every process computes with one
thread by default: on a machine whose cores are busy, a starved OpenMP thread stalls every tensor copy.

    python benchmarks/bench_loader.py              # ~2 GB, tp_size 1 and 2
    python benchmarks/bench_loader.py --small      # ~100 MB, a quick check
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import multiprocessing as mp
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers
from packaging.version import Version
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlamaForCausalLM

from tpkit.loaders import bytes_read, iter_weights, resolve_checkpoint
from tpkit.models import LlamaForCausalLM
from tpkit.parallel_layers import destroy_tensor_parallel, init_tensor_parallel

GB = 1e9
# TinyLlama-1.1B's shapes; the layer count is chosen to reach the requested size.
FULL_SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4,
                  vocab_size=32000)
SMALL_SHAPE = dict(hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=4,
                   vocab_size=32000)
MAX_SHARD_BYTES = 512 * 2**20
# transformers renamed torch_dtype to dtype in 4.56.
DTYPE_ARG = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"


def llama_config(size_gb: float, shape: dict[str, int]) -> LlamaConfig:
    h, inter, heads = shape["hidden_size"], shape["intermediate_size"], shape["num_attention_heads"]
    kv, vocab = shape["num_key_value_heads"], shape["vocab_size"]
    kv_size = h // heads * kv
    per_layer = 2 * (2 * h * h + 2 * h * kv_size + 3 * h * inter + 2 * h)  # bf16 bytes
    outside = 2 * (2 * vocab * h + h)
    layers = max(1, round((size_gb * GB - outside) / per_layer))
    return LlamaConfig(**shape, num_hidden_layers=layers, max_position_embeddings=2048, rms_norm_eps=1e-5,
                       tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
                       **{DTYPE_ARG: "bfloat16"})


def make_checkpoint(path: Path, config: LlamaConfig, seed: int = 0) -> int:
    """Writes random bf16 weights in transformers' names and layout; returns the bytes of tensor data."""
    h, inter = config.hidden_size, config.intermediate_size
    kv_size = h // config.num_attention_heads * config.num_key_value_heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv_size, h),
                       p + "self_attn.v_proj.weight": (kv_size, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    shapes.update({"model.norm.weight": (h,), "lm_head.weight": (config.vocab_size, h)})
    groups: list[list[str]] = [[]]
    group_bytes = 0
    for name, shape in shapes.items():
        nbytes = 2 * torch.Size(shape).numel()
        if groups[-1] and group_bytes + nbytes > MAX_SHARD_BYTES:
            groups.append([])
            group_bytes = 0
        groups[-1].append(name)
        group_bytes += nbytes
    generator = torch.Generator().manual_seed(seed)
    weight_map = {}
    for index, names in enumerate(groups, start=1):
        file = f"model-{index:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: torch.randn(shapes[n], dtype=torch.bfloat16, generator=generator) for n in names},
                  path / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    total = sum(2 * torch.Size(s).numel() for s in shapes.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config.save_pretrained(path)
    return total


# --- contenders, each loading once in its own process

def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def job_load_file(path: str) -> dict[str, Any]:
    config = LlamaConfig.from_pretrained(path)
    with torch.device("meta"):
        model = HFLlamaForCausalLM(config).to(torch.bfloat16)
    model.to_empty(device="cpu")
    with torch.no_grad():
        # Resident, like the tpkit model after its initialisation: first-touch page faults are no part of
        # loading for either.
        for param in model.parameters():
            param.zero_()
    start = _start_loading()
    loaded: set[str] = set()
    nbytes = 0
    for file in sorted(Path(path).glob("*.safetensors")):
        state = load_file(file)
        model.load_state_dict(state, strict=False)
        loaded.update(state)
        nbytes += sum(t.numel() * t.element_size() for t in state.values())
        del state
    seconds = time.perf_counter() - start
    assert loaded == set(model.state_dict()) - {k for k, _ in model.named_buffers()}, "keys left unloaded"
    return dict(contender="load_file + load_state_dict", seconds=seconds, bytes=nbytes,
                shard=_param_bytes(model))


def job_from_pretrained(path: str) -> dict[str, Any]:
    start = _start_loading()
    model = HFLlamaForCausalLM.from_pretrained(path, **{DTYPE_ARG: torch.bfloat16})
    returned = time.perf_counter() - start
    with torch.no_grad():
        for param in model.parameters():
            # One element per 4 KiB page: what it costs to have every byte read in.
            param.reshape(-1)[:: 4096 // param.element_size()].max()
    seconds = time.perf_counter() - start
    shard = _param_bytes(model)
    return dict(contender=f"transformers {transformers.__version__} from_pretrained", seconds=seconds,
                bytes=shard, shard=shard, returned=returned)


def job_tpkit(path: str, tp_size: int) -> dict[str, Any]:
    init_tensor_parallel(tp_size)
    config = json.loads((Path(path) / "config.json").read_text())
    # Built (and randomly initialised) before the clock starts: only loading is timed.
    model = LlamaForCausalLM(config, dtype=torch.bfloat16, device="cpu")
    if dist.is_initialized():
        dist.barrier()
    read_before = bytes_read()
    start = _start_loading()
    model.load_weights(iter_weights(resolve_checkpoint(path)))
    seconds = time.perf_counter() - start
    result = dict(contender=f"tpkit tp_size {tp_size}", seconds=seconds, bytes=bytes_read() - read_before,
                  shard=_param_bytes(model))
    destroy_tensor_parallel()
    return result


# --- running a job in fresh processes and measuring their memory

def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _start_loading() -> float:
    """Resets the kernel's peak-RSS mark (where allowed) so the peak is the loading's; returns the clock."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return time.perf_counter()


def _worker(job: Callable[..., dict[str, Any]], args: tuple, rank: int, world_size: int, threads: int,
            port: int, results: mp.Queue) -> None:
    try:
        logging.basicConfig(level=logging.WARNING, format="    [%(name)s] %(message)s")
        logging.getLogger("tpkit.loaders").setLevel(logging.INFO)
        torch.set_num_threads(threads)
        if world_size > 1:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                              WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
            dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(minutes=10))
        baseline = _status_bytes("VmRSS")
        result = job(*args)
        result.update(rank=rank, peak_rss=_status_bytes("VmHWM") - baseline)
        results.put(result)
    except BaseException:  # noqa: BLE001 - reported by the parent
        results.put(dict(rank=rank, error=traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_job(job: Callable[..., dict[str, Any]], *args: Any, world_size: int = 1,
            threads: int = 1) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(job, args, r, world_size, threads, port, results))
             for r in range(world_size)]
    for p in procs:
        p.start()
    outputs = [results.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
    errors = [o["error"] for o in outputs if "error" in o]
    if errors:
        raise RuntimeError(f"{job.__name__} failed:\n" + "\n".join(errors))
    return sorted(outputs, key=lambda o: o["rank"])


# --- report

def best_of_rounds(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per contender and rank: the fastest round, with every round's time and the highest peak RSS."""
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for row in (row for round_rows in rounds for row in round_rows):
        key = (row["contender"], row["rank"])
        kept = best.setdefault(key, dict(row, times=[], returned_times=[], peak_rss=0))
        kept["times"].append(row["seconds"])
        if "returned" in row:
            kept["returned_times"].append(row["returned"])
        kept["peak_rss"] = max(kept["peak_rss"], row["peak_rss"])
        kept["seconds"] = min(kept["times"])
    return list(best.values())


def report(rows: list[dict[str, Any]], total_bytes: int, threads: int, rounds: int) -> str:
    lines = [f"checkpoint: {total_bytes / GB:.2f} GB of bf16 tensors; {os.cpu_count()} CPU cores, {threads} "
             f"thread(s) per process; best of {rounds} rounds, each a fresh process loading once; "
             f"torch {torch.__version__}",
             "",
             "| contender | rank | load s (best) | GB read | GB/s | peak RSS GB | shard GB | RSS / shard |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['contender']} | {r['rank']} | {r['seconds']:.2f} | {r['bytes'] / GB:.3f} | "
                     f"{r['bytes'] / GB / r['seconds']:.2f} | {r['peak_rss'] / GB:.3f} | "
                     f"{r['shard'] / GB:.3f} | {r['peak_rss'] / r['shard']:.2f} |")
    lines.append("")
    for r in rows:
        line = f"- {r['contender']} rank {r['rank']}: rounds {', '.join(f'{t:.2f}' for t in r['times'])} s"
        if r["returned_times"]:
            returned = ", ".join(f"{t:.2f}" for t in r["returned_times"])
            line += (f"; from_pretrained itself returned after {returned} s, the rest is touching every page "
                     "of its parameters (transformers 5 leaves them memory-mapped until first used)")
        lines.append(line)
    by_name = {r["contender"]: r for r in rows if r["rank"] == 0}
    base = by_name.get("load_file + load_state_dict")
    hf = next((r for name, r in by_name.items() if name.endswith("from_pretrained")), None)
    tp1 = by_name.get("tpkit tp_size 1")
    lines += ["", "| goal | measured | target | met |", "|---|---|---|---|"]
    if base and tp1:
        ratio = (tp1["bytes"] / tp1["seconds"]) / (base["bytes"] / base["seconds"])
        lines.append(f"| tpkit tp_size 1 throughput / load_file's | {ratio:.2f}x | >= 1.00x | "
                     f"{'yes' if ratio >= 1 else 'NO'} |")
    if hf and tp1:
        ratio = hf["seconds"] / tp1["seconds"]
        lines.append(f"| from_pretrained time / tpkit tp_size 1 time | {ratio:.2f}x | >= 2.00x | "
                     f"{'yes' if ratio >= 2 else 'NO'} |")
    for r in rows:
        if r["contender"].startswith("tpkit"):
            ratio = r["peak_rss"] / r["shard"]
            lines.append(f"| {r['contender']} rank {r['rank']} peak RSS / shard | {ratio:.2f}x | < 1.20x | "
                         f"{'yes' if ratio < 1.2 else 'NO'} |")
    for name in sorted({r["contender"] for r in rows if r["contender"].startswith("tpkit")}):
        group = [r for r in rows if r["contender"] == name]
        if len(group) > 1:
            seconds = max(r["seconds"] for r in group)
            throughput = sum(r["bytes"] for r in group) / GB / seconds
            lines.append(f"| {name}: all ranks together | {throughput:.2f} GB/s | (information) | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=2.0, help="checkpoint size (default 2 GB)")
    parser.add_argument("--small", action="store_true", help="a ~0.1 GB checkpoint with narrower layers")
    parser.add_argument("--tp-sizes", default="1,2", help="comma-separated tp_size values (default 1,2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of fresh processes, one per contender; the best counts (default 3)")
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temp dir)")
    args = parser.parse_args()
    os.environ.setdefault("TPKIT_DISABLE_PROGRESS", "1")
    config = llama_config(0.1 if args.small else args.size_gb, SMALL_SHAPE if args.small else FULL_SHAPE)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench_loader_") as tmp:
        path = Path(tmp)
        start = time.perf_counter()
        total = make_checkpoint(path, config)
        files = len(list(path.glob("*.safetensors")))
        print(f"made {total / GB:.2f} GB in {files} files ({config.num_hidden_layers} layers, hidden "
              f"{config.hidden_size}) in {time.perf_counter() - start:.1f} s", flush=True)
        tp_sizes = [int(t) for t in args.tp_sizes.split(",")]
        rounds = []
        for _ in range(args.rounds):
            # Contenders take turns, so that a busy spell on a shared machine hits all of them alike.
            rows = run_job(job_load_file, str(path), threads=args.threads)
            rows += run_job(job_from_pretrained, str(path), threads=args.threads)
            for tp_size in tp_sizes:
                rows += run_job(job_tpkit, str(path), tp_size, world_size=tp_size, threads=args.threads)
            rounds.append(rows)
    print(report(best_of_rounds(rounds), total, args.threads, args.rounds))


if __name__ == "__main__":
    main()
