"""Where a generate call's GPU time goes: kernels grouped by kind, for bench_latency's Llama-3-8B shapes.

    PYTHONPATH=. python3 benchmarks/profile_generate.py [--no-graph] [--no-compile] [--output-len 128]
    PYTHONPATH=. python3 benchmarks/profile_generate.py --quantization fp8 --kv-cache-dtype fp8

Builds the Llama model of bench_latency.py (random bf16 weights, batch 8, 128 prompt tokens), runs
``generate`` once to warm up (captures the graph, compiles), then once more under ``torch.profiler``. Prints
the GPU time per kind of kernel (GEMM, attention, cache write, everything else) and per kernel, per
decode step against the weight-read floor. The kernels of CUDA-graph replays are recorded like any others.
``--quantization`` and ``--kv-cache-dtype`` build the model as bench_latency.py's options of those names do;
``--output-len 1`` profiles the prefill alone (``--input-len 1024 --output-len 1 --no-graph``).
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch
from bench_latency import BASELINE, LLAMA3_8B
from torch.profiler import ProfilerActivity, profile

from tpkit.models import LlamaForCausalLM
from tpkit.ops import decode_linear_fp8, quantize_per_token_fp8
from tpkit.parallel_layers import Fp8LinearMethod

KINDS = (  # first match wins; matched against the lower-cased kernel name
    ("attention", ("paged_attention",)),
    ("cache write", ("reshape_and_cache",)),
    ("gemm", ("gemm", "gemv", "sm90_xmma", "cutlass", "nvjet", "splitk", "decode_linear_kernel")),
)


def _kind(name: str) -> str:
    lowered = name.lower()
    for kind, needles in KINDS:
        if any(n in lowered for n in needles):
            return kind
    return "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--no-graph", action="store_true", help="eager decode steps")
    parser.add_argument("--no-compile", action="store_true", help="decode step without torch.compile")
    parser.add_argument("--top", type=int, default=25, help="kernels listed")
    parser.add_argument("--quantization", choices=["none", "fp8"], default="none",
                        help="weights: as built (none) or float8 per channel (fp8)")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="KV cache: the model's dtype (auto) or float8 E4M3 (fp8)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")

    torch.manual_seed(0)
    quant_method = None
    if args.quantization == "fp8":
        quant_method = Fp8LinearMethod("channel", decode_op=decode_linear_fp8,
                                       quantize_op=quantize_per_token_fp8)
    model = LlamaForCausalLM(LLAMA3_8B, dtype=torch.bfloat16, device="cuda", quant_method=quant_method).eval()
    model.kv_cache_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else None
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    prompts = torch.randint(0, LLAMA3_8B["vocab_size"], (args.batch, args.input_len)).tolist()
    options = {"cuda_graph": not args.no_graph, "compile": not args.no_graph and not args.no_compile}

    def run() -> None:
        model.generate(prompts, args.output_len, ignore_eos=True, **options)
        torch.cuda.synchronize()

    run()
    start = time.perf_counter()
    run()
    wall_s = time.perf_counter() - start
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()

    per_kernel: dict[str, list[float]] = defaultdict(list)  # name -> durations (us)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name].append(event.time_range.elapsed_us())
    total_us = sum(sum(d) for d in per_kernel.values())
    by_kind: dict[str, float] = defaultdict(float)
    for name, durations in per_kernel.items():
        by_kind[_kind(name)] += sum(durations)

    steps = max(args.output_len - 1, 1)  # --output-len 1: the prefill alone, shown as one step
    copy_gbps = BASELINE["copy_bandwidth_GBps"]  # the H200 baseline's copy bandwidth
    copy_floor_ms = weight_bytes / (copy_gbps * 1e9) * 1e3
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; options {options}; "
          f"weights {args.quantization}, KV cache {args.kv_cache_dtype}; "
          f"batch {args.batch}, input {args.input_len}, output {args.output_len}")
    print(f"wall {wall_s:.3f} s (unprofiled); GPU kernel time {total_us / 1e6:.3f} s; weights "
          f"{weight_bytes / 1e9:.2f} GB = {copy_floor_ms:.2f} ms a step at {copy_gbps} GB/s")
    print(f"\n| kind | GPU ms | share | ms per decode step (/{steps}) |")
    print("|---|---:|---:|---:|")
    for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"| {kind} | {us / 1e3:.1f} | {us / total_us:.1%} | {us / 1e3 / steps:.3f} |")
    print("\n| kernel (first 90 characters) | kind | calls | mean us | total ms |")
    print("|---|---|---:|---:|---:|")
    ranked = sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))[: args.top]
    for name, durations in ranked:
        print(f"| {name[:90]} | {_kind(name)} | {len(durations)} | {sum(durations) / len(durations):.1f} | "
              f"{sum(durations) / 1e3:.1f} |")


if __name__ == "__main__":
    main()
