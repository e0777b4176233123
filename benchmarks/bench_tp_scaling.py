"""Tensor-parallel scaling of a Llama model: decode latency per token and prefill throughput at several
tp sizes and batch sizes, with the all-reduce time separated out, and the all-reduce bus bandwidth at the
decode message sizes.

    python benchmarks/bench_tp_scaling.py                       # CPU ranks over gloo, small shapes
    python benchmarks/bench_tp_scaling.py --device cuda --shapes 8b --tp-sizes 1,2,4
    torchrun --nproc-per-node 2 benchmarks/bench_tp_scaling.py --device cuda --shapes 8b   # one tp size
    python benchmarks/bench_tp_scaling.py --device cuda --tp-sizes 1,2 --batch-sizes 1 --profile

Without torchrun it spawns one process per rank for each tp size (gloo on CPU, NCCL with one GPU a rank).
Decode latency per token is (time of generate(1 + N tokens) - time of generate(1 token)) / N, so it holds
the whole step (embedding, layers, LM head, sampling). The all-reduce share is measured apart: the same
count of all-reduces a decode step makes (two per layer and one for the embedding), on messages of the
decode step's size ``[batch, hidden]``, timed alone. The goal: at tp_size 2 and batch 1 the decode step
takes at most 0.6x the tp_size 1 time for the 8B shapes.

``--profile``: after the timings, each tp size runs its decode steps once more under ``torch.profiler``
and rank 0 prints the operators that took the most host time a step, with their device time,
to show where a step's time goes when tp sizes differ.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from tpkit.models import LlamaForCausalLM
from tpkit.parallel_layers import destroy_tensor_parallel, init_tensor_parallel, launch, local_device

SHAPES = {
    # Llama-3-8B.
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    # Small enough for CPU ranks on a laptop, large enough that the matmuls are not all overhead.
    "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=8192),
}


def _config(shapes: str) -> dict:
    return dict(SHAPES[shapes], architectures=["LlamaForCausalLM"], model_type="llama",
                max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0, hidden_act="silu",
                tie_word_embeddings=False, eos_token_id=None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_seconds(fn, repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _allreduce_seconds(numel: int, dtype: torch.dtype, device: torch.device, group, iters: int) -> float:
    """Median time of one all-reduce of ``numel`` elements, over ``iters`` back-to-back calls."""
    x = torch.randn(numel, dtype=dtype, device=device)
    for _ in range(3):
        dist.all_reduce(x, group=group)

    def run() -> None:
        for _ in range(iters):
            dist.all_reduce(x, group=group)
    return _median_seconds(run, 5, device) / iters


def _measure(args: argparse.Namespace, device: torch.device) -> list[dict]:
    tp = init_tensor_parallel()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = _config(args.shapes)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config, dtype=dtype, device=device).eval()
    shard_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = []
    for batch in args.batch_sizes:
        generator = torch.Generator().manual_seed(batch)
        prompts = torch.randint(0, config["vocab_size"], (batch, args.prompt_len), generator=generator)

        def generate(new_tokens: int, prompts=prompts) -> None:
            model.generate(prompts, new_tokens, ignore_eos=True, cuda_graph=args.cuda_graph)

        generate(args.decode_steps + 1)  # warm-up: kernels, caches, a captured graph
        t_prefill = _median_seconds(lambda: generate(1), args.repeats, device)
        t_total = _median_seconds(lambda: generate(args.decode_steps + 1), args.repeats, device)
        if args.profile:  # every rank runs the steps (they all-reduce); rank 0 prints
            _profile(lambda: generate(args.decode_steps + 1), device, f"tp_size {tp.size}, batch {batch}",
                     args.decode_steps, show=tp.rank == 0)
        decode_s = (t_total - t_prefill) / args.decode_steps
        message = batch * config["hidden_size"]
        if tp.size > 1:
            allreduce_s = _allreduce_seconds(message, dtype, device, tp.group, iters=20)
            busbw = 2 * (tp.size - 1) / tp.size * message * torch.finfo(dtype).bits / 8 / allreduce_s / 1e9
        else:
            allreduce_s, busbw = 0.0, float("nan")
        allreduces_per_step = 2 * config["num_hidden_layers"] + 1
        rows.append(dict(
            tp_size=tp.size, batch=batch, prompt_len=args.prompt_len, shapes=args.shapes, dtype=str(dtype),
            device=str(device.type), cuda_graph=args.cuda_graph, shard_gb=shard_bytes / 1e9,
            decode_ms=decode_s * 1e3, allreduce_ms=allreduce_s * allreduces_per_step * 1e3,
            compute_ms=(decode_s - allreduce_s * allreduces_per_step) * 1e3,
            prefill_tok_s=batch * args.prompt_len / t_prefill,
            allreduce_bytes=message * torch.finfo(dtype).bits // 8, allreduce_busbw_GBps=busbw,
        ))
    # The graphs, which captured the group's all-reduces, go before the group (pytorch#115388 reports
    # teardowns waiting in ncclCommDestroy forever while such a graph lives).
    model.clear_kv_cache()
    return rows


def _profile(fn, device: torch.device, title: str, steps: int, show: bool, top: int = 15) -> None:
    """Runs ``fn`` under torch.profiler; with ``show``, prints the operators with the most host time, per
    decode step."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        _sync(device)
    if not show:
        return
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    print(f"profile, {title}: the {top} operators with the most host time, per decode step "
          f"({steps} steps and the prefill, divided by {steps})")
    print(f"{'operator':<48} {'calls/step':>10} {'host self ms':>12} {'device ms':>10}")
    for event in events:
        device_us = getattr(event, "device_time_total", getattr(event, "cuda_time_total", 0.0))
        host_ms, device_ms = event.self_cpu_time_total / 1e3 / steps, device_us / 1e3 / steps
        print(f"{event.key[:48]:<48} {event.count / steps:>10.1f} {host_ms:>12.3f} {device_ms:>10.3f}")


def _on_rank(measure, args: argparse.Namespace):
    result = measure(args, local_device())
    return result if dist.get_rank() == 0 else None


def spawn_ranks(tp_size: int, measure, args: argparse.Namespace):
    """Runs ``measure(args, device)`` on ``tp_size`` fresh ranks (gloo on CPU, NCCL with a GPU each, as
    ``args.device`` says); returns rank 0's result. ``measure`` must be a module-level function."""
    backend = "nccl" if args.device == "cuda" else "gloo"
    return launch(_on_rank, tp_size, measure, args, backend=backend, timeout=args.timeout,
                  collective_timeout=300)[0]


def run_under_torchrun(measure, args: argparse.Namespace):
    """Under torchrun: runs ``measure(args, device)`` on this rank of the launched world (NCCL with
    ``--device cuda``, else gloo) and tears the groups down; returns (this rank, its result)."""
    cuda = args.device == "cuda"
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    try:
        return int(os.environ["RANK"]), measure(args, device)
    finally:
        destroy_tensor_parallel()
        dist.destroy_process_group()


def _print_table(rows: list[dict]) -> None:
    base = {(r["batch"]): r["decode_ms"] for r in rows if r["tp_size"] == 1}
    header = (f"{'tp':>3} {'batch':>5} {'decode ms/tok':>13} {'vs tp1':>7} {'allreduce ms':>12} "
              f"{'compute ms':>10} {'prefill tok/s':>13} {'AR bytes':>9} {'AR busbw GB/s':>13}")
    print(header)
    print("-" * len(header))
    for r in sorted(rows, key=lambda r: (r["batch"], r["tp_size"])):
        ratio = r["decode_ms"] / base[r["batch"]] if r["batch"] in base else float("nan")
        print(f"{r['tp_size']:>3} {r['batch']:>5} {r['decode_ms']:>13.3f} {ratio:>7.2f} "
              f"{r['allreduce_ms']:>12.3f} {r['compute_ms']:>10.3f} {r['prefill_tok_s']:>13.0f} "
              f"{r['allreduce_bytes']:>9} {r['allreduce_busbw_GBps']:>13.2f}")
    goal = [r for r in rows if r["tp_size"] == 2 and r["batch"] == 1 and 1 in base]
    for r in goal:
        ratio = r["decode_ms"] / base[1]
        print(f"goal: tp2/tp1 decode at batch 1 = {ratio:.2f} (target <= 0.60 on 8B shapes)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--shapes", choices=sorted(SHAPES), default=None,
                        help="model shapes (default: 8b on cuda, small on cpu)")
    parser.add_argument("--tp-sizes", type=lambda s: [int(x) for x in s.split(",")], default=None,
                        help="comma-separated (default: 1,2 on cpu; 1,2,4 up to the GPU count on cuda)")
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=None, help="default: 32 on cuda, 8 on cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cuda-graph", action="store_true", help="replay the decode step from a CUDA graph")
    parser.add_argument("--profile", action="store_true",
                        help="also print where rank 0's decode steps spend host and device time")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds to wait for one tp size")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device visible")
    args.shapes = args.shapes or ("8b" if cuda else "small")
    args.decode_steps = args.decode_steps or (32 if cuda else 8)
    if args.cuda_graph and not cuda:
        parser.error("--cuda-graph needs --device cuda")

    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        # Under torchrun: this world is the one tp size measured.
        rank, rows = run_under_torchrun(_measure, args)
        if rank != 0:
            return
    else:
        available = torch.cuda.device_count() if cuda else 64
        tp_sizes = args.tp_sizes or ([t for t in (1, 2, 4) if t <= available] if cuda else [1, 2])
        rows = []
        for tp_size in tp_sizes:
            if tp_size > available:
                print(f"tp_size {tp_size}: skipped, only {available} GPU(s) visible", file=sys.stderr)
                continue
            rows += spawn_ranks(tp_size, _measure, args)
    _print_table(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"tp_scaling_{args.device}_{args.shapes}.json"
    path.write_text(json.dumps(rows, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
