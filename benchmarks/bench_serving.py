"""Online serving: requests arriving as a Poisson process into ``Engine.add_request`` / ``Engine.step``.

    PYTHONPATH=. python3 benchmarks/bench_serving.py [--model llama|bart] [--rates 1,4,16] [--small]

Per arrival rate (requests/s): time to first token (TTFT), time per output token after the first (TPOT,
per request), the inter-token latencies (ITL), each mean, median and p99 in ms, and the request and output
token throughput. Llama-3-8B shapes (prompts of 128-1024 tokens, 256 new tokens) or BART-large-cnn's
(prompts of 60-70 tokens, 32-128 new tokens), random bf16 weights, EOS ignored; ``--num-requests`` requests
from ``random.Random(0)``. ``--small``: a small model on the CPU, a few requests (a smoke test).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from bench_latency import BART_LARGE, LLAMA3_8B, SMALL_LLAMA

from tpkit.models import BartForConditionalGeneration, LlamaForCausalLM
from tpkit.parallel_layers import TPGroup
from tpkit.serving import Engine, SamplingParams

SMALL_BART = BART_LARGE | {"vocab_size": 1024, "d_model": 128, "encoder_layers": 2, "decoder_layers": 2,
                           "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 256,
                           "decoder_ffn_dim": 256, "max_position_embeddings": 256}


def _workload(args: argparse.Namespace, vocab_size: int) -> list[tuple[float, list[int], int]]:
    """(arrival offset in s, prompt, new tokens) per request: exponential gaps at ``args.rate``."""
    rng = random.Random(0)
    if args.model == "bart":
        prompt_lens, new_tokens = (60, 70), (32, 128)
    else:
        prompt_lens, new_tokens = (128, 1024), (256, 256)
    if args.small:
        prompt_lens, new_tokens = (16, 64), (4, 8)
    clock, work = 0.0, []
    for _ in range(args.num_requests):
        clock += rng.expovariate(args.rate)
        prompt = [rng.randrange(3, vocab_size) for _ in range(rng.randint(*prompt_lens))]
        work.append((clock, prompt, rng.randint(*new_tokens)))
    return work


def serve(engine: Engine, work: list[tuple[float, list[int], int]]) -> dict:
    """Feed the requests at their arrival times, step until all are done; latency statistics."""
    start, pending, finished = time.perf_counter(), list(work), []
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            _, prompt, new_tokens = pending.pop(0)
            engine.add_request(prompt, SamplingParams(new_tokens, ignore_eos=True))
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        finished += [out for out in engine.step() if out.finished]
    duration = time.perf_counter() - start
    ttft = [o.first_token_time - o.arrival_time for o in finished]
    tpot = [(o.token_times[-1] - o.token_times[0]) / (len(o.token_times) - 1) for o in finished
            if len(o.token_times) > 1]
    itl = [b - a for o in finished for a, b in zip(o.token_times, o.token_times[1:], strict=False)]
    tokens = sum(len(o.token_ids) for o in finished)
    return {"requests/s": len(finished) / duration, "output tokens/s": tokens / duration,
            **{name: _summary(values) for name, values in (("TTFT", ttft), ("TPOT", tpot), ("ITL", itl))}}


def _summary(seconds: list[float]) -> str:
    if not seconds:
        return "-"
    ordered = sorted(seconds)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    mean, median = statistics.fmean(ordered), statistics.median(ordered)
    return f"mean {mean * 1e3:.1f} ms, median {median * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("llama", "bart"), default="llama")
    parser.add_argument("--rates", default="1,4,16", help="arrival rates, requests/s, comma-separated")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--small", action="store_true", help="a small model on the CPU (smoke test)")
    args = parser.parse_args()
    args.num_requests = args.num_requests or (6 if args.small else 200)
    cuda = torch.cuda.is_available() and not args.small
    device = torch.device("cuda" if cuda else "cpu")
    if args.model == "bart":
        model_class, config = BartForConditionalGeneration, SMALL_BART if args.small else BART_LARGE
    else:
        model_class, config = LlamaForCausalLM, SMALL_LLAMA if args.small else LLAMA3_8B
    torch.manual_seed(0)
    model = model_class(config, dtype=torch.bfloat16 if cuda else torch.float32, device=device,
                        tp_group=TPGroup(None, 0, 1)).eval()
    engine = Engine(model, kv_cache_memory=0.9 if cuda else 64 << 20)
    engine.generate([[5] * 8], SamplingParams(2, ignore_eos=True))  # warm-up
    for rate in (float(r) for r in args.rates.split(",")):
        args.rate = rate
        results = serve(engine, _workload(args, config["vocab_size"]))
        print(f"{args.model}, {rate:g} requests/s arriving, {args.num_requests} requests:")
        for name, value in results.items():
            print(f"  {name}: {value:.2f}" if isinstance(value, float) else f"  {name}: {value}")


if __name__ == "__main__":
    main()
