"""Offline throughput: many requests of different lengths through tpkit's engine, tpkit's static ``generate``
and transformers' continuous batching, with the roofline the run allows.

    PYTHONPATH=. python3 benchmarks/bench_throughput.py [--num-requests 256] [--impls engine,static] [--small]

Llama-3-8B shapes with random bf16 weights; ``--num-requests`` requests whose prompt lengths are drawn
uniformly from 128-1024 tokens (``random.Random(0)``), 256 new tokens each, EOS ignored. Prints requests/s
and output tokens/s of each, and the roofline: the prompts' FLOPs at the device's bf16 matmul rate plus, per
decode step, the weights' and the KV cache's bytes at its copy bandwidth (steps of ``max_num_seqs``
requests), with the engine's fraction of it. ``--impls`` picks the rows (``engine``, ``static``,
``transformers``; all by default); the figure of transformers measured on an H200
(``benchmarks/baselines/throughput_h200.json``) is printed beside them. ``--small``: a two-layer model, 8
short requests, on the CPU as a smoke test (no roofline).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch
from bench_latency import LLAMA3_8B, SMALL_LLAMA

from tpkit.models import LlamaForCausalLM
from tpkit.parallel_layers import TPGroup
from tpkit.serving import Engine, SamplingParams

BASELINE = json.loads((Path(__file__).parent / "baselines" / "throughput_h200.json").read_text())
IMPLS = ("engine", "static", "transformers")


def _requests(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    low, high = (16, 64) if args.small else (128, 1024)
    lens = [rng.randint(low, high) for _ in range(args.num_requests)]
    return [[rng.randrange(vocab_size) for _ in range(n)] for n in lens]


def _timed(device: torch.device, fn: Callable[[], list[list[int]]]) -> tuple[float, int]:
    """Seconds of one call of ``fn`` and the tokens it generated."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    tokens = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, sum(len(t) for t in tokens)


def _matmul_flops(device: torch.device) -> float:
    """bf16 FLOP/s of an 8192^3 matmul on the GPU."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize()
    return 10 * 2 * 8192 ** 3 / (time.perf_counter() - start)


def roofline_s(model: LlamaForCausalLM, prompts: list[list[int]], output_len: int,
               max_num_seqs: int) -> float:
    """The fewest seconds the run can take: the prompts' matmul FLOPs at the matmul rate, then per decode step
    the weights once and every running request's K/V at the copy bandwidth."""
    from bench_paged_attention import _copy_bandwidth_gbps

    device = model.device
    params = sum(p.numel() for p in model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv_bytes_per_token = 2 * model.num_layers * model.num_kv_heads * model.head_size * model.dtype.itemsize
    prefill_s = 2 * params * sum(len(p) for p in prompts) / _matmul_flops(device)
    bandwidth = _copy_bandwidth_gbps() * 1e9
    decode_bytes = 0.0
    for first in range(0, len(prompts), max_num_seqs):
        group = prompts[first:first + max_num_seqs]
        for step in range(1, output_len):
            decode_bytes += weight_bytes + kv_bytes_per_token * sum(len(p) + step for p in group)
    return prefill_s + decode_bytes / bandwidth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--output-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--static-batch", type=int, default=64)
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated rows out of {IMPLS}")
    parser.add_argument("--small", action="store_true", help="a small model on the CPU (smoke test)")
    args = parser.parse_args()
    impls = args.impls.split(",")
    if unknown := sorted(set(impls) - set(IMPLS)):
        parser.error(f"--impls: expected names out of {IMPLS}, got {unknown}")
    args.num_requests = args.num_requests or (8 if args.small else 256)
    args.output_len = args.output_len or (8 if args.small else 256)
    cuda = torch.cuda.is_available() and not args.small
    device = torch.device("cuda" if cuda else "cpu")
    config = SMALL_LLAMA if args.small else LLAMA3_8B
    torch.manual_seed(0)
    model = LlamaForCausalLM(config, dtype=torch.bfloat16 if cuda else torch.float32, device=device,
                             tp_group=TPGroup(None, 0, 1)).eval()
    prompts = _requests(args, config["vocab_size"])
    rows = []
    if "engine" in impls:
        rows.append(("tpkit Engine", *_engine_run(model, prompts, args, cuda)))

    def static() -> list[list[int]]:
        out = []
        for first in range(0, len(prompts), args.static_batch):
            out += model.generate(prompts[first:first + args.static_batch], args.output_len, ignore_eos=True,
                                  cuda_graph=cuda, prefix_caching=True)
        return out

    if "static" in impls:
        rows.append((f"tpkit generate, batches of {args.static_batch}", *_timed(device, static)))
        model.clear_kv_cache()
    if "transformers" in impls:
        rows.append(_transformers_row(config, prompts, args, device))
    where = torch.cuda.get_device_name() if cuda else "the CPU"
    print(f"{args.num_requests} requests, prompts of {min(map(len, prompts))}-{max(map(len, prompts))} "
          f"tokens, {args.output_len} new tokens each, on {where}")
    for name, seconds, tokens in rows:
        if seconds is None:
            print(f"  {name}: {tokens}")
            continue
        print(f"  {name}: {seconds:.2f} s, {args.num_requests / seconds:.2f} requests/s, "
              f"{tokens / seconds:.0f} output tokens/s")
    peer = BASELINE["rows"][0]
    measured = BASELINE["measured"]
    print(f"  {peer['implementation']} on an {measured['gpu']} ({measured['date']}, {peer['num_requests']} "
          f"requests): {peer['seconds']:.1f} s, {peer['output_tokens_per_s']} output tokens/s")
    if cuda and "engine" in impls:
        engine_s, engine_tokens = rows[0][1], rows[0][2]
        floor = roofline_s(model, prompts, args.output_len, args.max_num_seqs)
        print(f"  roofline: {floor:.2f} s; the engine reaches {floor / engine_s:.0%} of it, "
              f"{engine_tokens / engine_s / peer['output_tokens_per_s']:.1f}x the baseline's tokens/s")


def _engine_run(model: LlamaForCausalLM, prompts: list[list[int]], args: argparse.Namespace,
                cuda: bool) -> tuple[float, int]:
    """The engine's seconds and tokens, after a warm-up run of the same shapes (its KV cache freed after)."""
    engine = Engine(model, max_num_seqs=args.max_num_seqs, kv_cache_memory=0.9 if cuda else 64 << 20)
    sampling = SamplingParams(args.output_len, ignore_eos=True)
    # Warm-up: the same lengths once, untimed, so that the CUDA graphs of the run's batch sizes and
    # block-table widths are captured (on first use); other tokens, so that the timed run finds nothing in
    # the prefix cache.
    vocab_size = model.vocab_size
    engine.generate([[(token + 1) % vocab_size for token in prompt] for prompt in prompts], sampling)
    return _timed(model.device, lambda: engine.generate(prompts, sampling))


def _transformers_row(config: dict, prompts: list[list[int]], args: argparse.Namespace,
                      device: torch.device) -> tuple[str, float | None, int | str]:
    """transformers' ``generate_batch`` (continuous batching, paged attention) over the same requests."""
    import transformers

    name = "transformers generate_batch"
    hf_config = transformers.LlamaConfig(**{k: v for k, v in config.items() if k != "architectures"})
    with torch.device(device):
        model = transformers.LlamaForCausalLM(hf_config).to(torch.bfloat16 if device.type == "cuda"
                                                             else torch.float32).eval()
    if not hasattr(model, "generate_batch"):
        return name, None, f"not in transformers {transformers.__version__}"
    model.config._attn_implementation = "paged|sdpa" if device.type == "cuda" else "sdpa"
    generation_config = transformers.GenerationConfig(max_new_tokens=args.output_len, eos_token_id=-1,
                                                      do_sample=False, num_blocks=math.ceil(
                                                          len(prompts) * 2048 / 256), block_size=256)
    try:
        seconds, _ = _timed(device, lambda: [list(o.generated_tokens) for o in model.generate_batch(
            prompts, generation_config=generation_config).values()])
    except Exception as error:  # a version whose continuous batching takes other settings
        return name, None, f"failed: {type(error).__name__}: {error}"
    return name, seconds, len(prompts) * args.output_len


if __name__ == "__main__":
    main()
