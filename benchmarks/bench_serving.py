"""Online serving: requests arriving as a Poisson process into ``Engine.add_request`` / ``Engine.step``.

    PYTHONPATH=. python3 benchmarks/bench_serving.py [--model llama|bart] [--rates 1,4,16] [--small]

Per arrival rate (requests/s): time to first token (TTFT), time per output token after the first (TPOT,
per request), the inter-token latencies (ITL), each mean, median and p99 in ms, and the request and output
token throughput. Llama-3-8B shapes (prompts of 128-1024 tokens, 256 new tokens) or BART-large-cnn's
(prompts of 60-70 tokens, 32-128 new tokens), random bf16 weights, EOS ignored; ``--num-requests`` requests
from ``random.Random(0)``. ``--small``: a small model on the CPU, a few requests (a smoke test).

BART runs two ways on the same weights and the same requests, printed side by side with their ratios:
``cross``, tpkit's model with ``QKVCrossParallelLinear`` (q from the decoder states; k and v from the
encoder states, once, when a request starts), and ``naive``, its cross projections replaced by
bench_latency's ``NaiveCrossQKV`` (the full fused QKV projection of the decoder states in every step, q
kept, and of the encoder states when a request starts, k and v kept). The last line gives the mean TPOT
ratio cross / naive per rate and whether it is at most 1 at every rate. Each way has its own model and
engine with the same KV budget. At each rate both serve twice, each going first once (the second round's
prompts of other tokens, the same lengths and arrivals), and each way's latencies pool its two runs'
requests. Their tokens are compared (the fraction of equal tokens: below 1 only where bf16 rounding tips a
greedy choice).

Before timing, each engine serves the workload's requests once, all at once (other tokens), so that no CUDA
graph capture or first run of a kernel falls into a timed run.

At the lightest rate the mean TPOT is set beside a decode step of tpkit's static ``generate`` (from CUDA
graphs on a GPU) for a batch of the mean number of requests decoding at once (Little's law: output tokens/s
times the mean TPOT), prompts of the workload's mean length: the goal is a ratio of at most 1.10.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from bench_latency import BART_LARGE, LLAMA3_8B, SMALL_LLAMA, NaiveCrossQKV
from latency_timing import token_agreement

from tpkit.models import BartForConditionalGeneration, LlamaForCausalLM
from tpkit.models.generation import PagedLM
from tpkit.parallel_layers import TPGroup
from tpkit.serving import Engine, SamplingParams

SMALL_BART = BART_LARGE | {"vocab_size": 1024, "d_model": 128, "encoder_layers": 2, "decoder_layers": 2,
                           "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 256,
                           "decoder_ffn_dim": 256, "max_position_embeddings": 256}
KV_CACHE_FRACTION = 0.9  # of the GPU memory free after the weights, split evenly among the ways' engines
CPU_KV_CACHE_BYTES = 64 << 20
LATENCIES = ("TTFT", "TPOT", "ITL")
STATISTICS = ("mean", "median", "p99")
THROUGHPUTS = ("requests/s", "output tokens/s")
WARM_UP_SHIFT, SECOND_ROUND_SHIFT = 1, 2  # how far the warm-up's and the second round's tokens move

Work = list[tuple[float, list[int], int]]


def _workload(args: argparse.Namespace, vocab_size: int) -> Work:
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


def serve(engine: Engine, work: Work) -> dict:
    """Feed the requests at their arrival times, step until all are done. The run's seconds, requests and
    output tokens, each request's latencies in seconds (``TTFT``, ``TPOT``, and its ``ITL``s), and every
    request's tokens in arrival order."""
    start, pending, finished, ids = time.perf_counter(), list(work), {}, []
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while pending and pending[0][0] <= now:
            _, prompt, new_tokens = pending.pop(0)
            ids.append(engine.add_request(prompt, SamplingParams(new_tokens, ignore_eos=True)))
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0][0] - now))
            continue
        finished |= {out.request_id: out for out in engine.step() if out.finished}
    duration = time.perf_counter() - start
    outputs = [finished[i] for i in ids]
    ttft = [o.first_token_time - o.arrival_time for o in outputs]
    tpot = [(o.token_times[-1] - o.token_times[0]) / (len(o.token_times) - 1) for o in outputs
            if len(o.token_times) > 1]
    itl = [b - a for o in outputs for a, b in zip(o.token_times, o.token_times[1:], strict=False)]
    num_tokens = sum(len(o.token_ids) for o in outputs)
    return {"seconds": duration, "requests": len(outputs), "output tokens": num_tokens, "TTFT": ttft,
            "TPOT": tpot, "ITL": itl, "tokens": [o.token_ids for o in outputs]}


def _pooled(runs: list[dict]) -> dict:
    """The runs of one way at one rate as one: each latency's mean, median and p99 over every run's
    requests, the throughputs over their summed time, and the first run's tokens."""
    seconds = sum(run["seconds"] for run in runs)
    return {"requests/s": sum(run["requests"] for run in runs) / seconds,
            "output tokens/s": sum(run["output tokens"] for run in runs) / seconds,
            **{name: _summary([value for run in runs for value in run[name]]) for name in LATENCIES},
            "tokens": runs[0]["tokens"]}


def _other_tokens(work: Work, vocab_size: int, shift: int) -> Work:
    """The same arrivals, lengths and new tokens, every prompt token moved by ``shift`` (within the ids
    3 ..): requests that find nothing of ``work`` in the prefix cache."""
    return [(arrival, [3 + (token - 3 + shift) % (vocab_size - 3) for token in prompt], new_tokens)
            for arrival, prompt, new_tokens in work]


def _summary(seconds: list[float]) -> dict[str, float]:
    if not seconds:
        return dict.fromkeys(STATISTICS, float("nan"))
    ordered = sorted(seconds)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"mean": statistics.fmean(ordered), "median": statistics.median(ordered), "p99": p99}


def _models(args: argparse.Namespace, config: dict, dtype: torch.dtype, device: torch.device
            ) -> dict[str, PagedLM]:
    """The model of each way, by name: Llama's one, or BART's cross and naive on the same weights."""
    single = TPGroup(None, 0, 1)
    if args.model == "llama":
        torch.manual_seed(0)
        return {"llama": LlamaForCausalLM(config, dtype=dtype, device=device, tp_group=single).eval()}
    models = {}
    for way in ("cross", "naive"):
        torch.manual_seed(0)  # the same weights both ways
        model = BartForConditionalGeneration(config, dtype=dtype, device=device, tp_group=single).eval()
        if way == "naive":
            for layer in model.decoder.layers:
                layer.encoder_attn.qkv_proj = NaiveCrossQKV(layer.encoder_attn.qkv_proj)
        models[way] = model
    return models


def static_step_s(model: PagedLM, batch: int, prompt_len: int, cuda: bool, repeats: int = 5) -> float:
    """Seconds one decode step of ``model.generate`` takes for ``batch`` prompts of ``prompt_len`` tokens:
    the difference of two runs' times over the difference of their new tokens, so that the prefill cancels.
    Each run's time is the least of ``repeats``: a step of a small batch is short enough that the host's
    jitter in one run would move it by tens of percent."""
    prompts = [[3 + (i + j) % 97 for j in range(prompt_len)] for i in range(batch)]
    short, long = 8, 40
    times = []
    for new_tokens in (short, long):
        model.generate(prompts, new_tokens, ignore_eos=True, cuda_graph=cuda)  # captures its graphs
        runs = []
        for _ in range(repeats):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            model.generate(prompts, new_tokens, ignore_eos=True, cuda_graph=cuda)
            if cuda:
                torch.cuda.synchronize()
            runs.append(time.perf_counter() - start)
        times.append(min(runs))
    return (times[1] - times[0]) / (long - short)


def _print_light_load(rate: float, work: Work, results: dict[str, dict], models: dict[str, PagedLM],
                      cuda: bool) -> None:
    """At ``rate``, each way's mean TPOT against its static decode step at the mean concurrency."""
    prompt_len = round(statistics.fmean(len(prompt) for _, prompt, _ in work))
    for way, result in results.items():
        concurrency = result["output tokens/s"] * result["TPOT"]["mean"]
        batch = max(1, round(concurrency))
        step = static_step_s(models[way], batch, prompt_len, cuda)
        print(f"light load ({rate:g} requests/s), {way}: TPOT mean {result['TPOT']['mean'] * 1e3:.2f} ms; "
              f"static decode step at batch {batch} (mean concurrency {concurrency:.1f}), prompts of "
              f"{prompt_len} tokens: {step * 1e3:.2f} ms; ratio {result['TPOT']['mean'] / step:.3f} "
              f"(goal <= 1.10)")


def _warm_up(engine: Engine, work: Work, vocab_size: int) -> None:
    """The workload's requests all at once, untimed: their steps go through the batch sizes and block-table
    widths the timed runs see, so that no CUDA graph is captured and no kernel is first run inside a timed
    run. Other tokens, so that the timed runs find nothing in the prefix cache."""
    prompts = [prompt for _, prompt, _ in _other_tokens(work, vocab_size, WARM_UP_SHIFT)]
    engine.generate(prompts, [SamplingParams(new_tokens, ignore_eos=True) for _, _, new_tokens in work])


def _print_rate(model: str, rate: float, num_requests: int, num_rounds: int,
                results: dict[str, dict]) -> None:
    """One rate's table: a column per way and, for two ways, their ratio."""
    ways = list(results)
    ratio = len(ways) == 2
    header = f"| {'':<18} | " + " | ".join(f"{way:>10}" for way in ways) + " |"
    header += f" {' / '.join(ways):>13} |" if ratio else ""
    rounds = f" in each of {num_rounds} rounds" if num_rounds > 1 else ""
    print(f"{model}, {rate:g} requests/s arriving, {num_requests} requests{rounds}:")
    print(header)
    print("|" + "|".join("-" * len(cell) for cell in header.split("|")[1:-1]) + "|")
    rows = [(f"{name} {stat} ms", [r[name][stat] * 1e3 for r in results.values()])
            for name in LATENCIES for stat in STATISTICS]
    rows += [(name, [r[name] for r in results.values()]) for name in THROUGHPUTS]
    for label, values in rows:
        line = f"| {label:<18} | " + " | ".join(f"{v:>10.2f}" for v in values) + " |"
        print(line + (f" {values[0] / values[1]:>13.3f} |" if ratio else ""))
    if ratio:
        tokens = [r["tokens"] for r in results.values()]
        print(f"same tokens both ways: {token_agreement(tokens[0], tokens[1]):.3f}")


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
        config = SMALL_BART if args.small else BART_LARGE
    else:
        config = SMALL_LLAMA if args.small else LLAMA3_8B
    models = _models(args, config, torch.bfloat16 if cuda else torch.float32, device)
    # Bytes, not a fraction: a fraction would give the engine built second less than the first.
    budget = int(torch.cuda.mem_get_info(device)[0] * KV_CACHE_FRACTION / len(models)) if cuda \
        else CPU_KV_CACHE_BYTES
    engines = {way: Engine(model, kv_cache_memory=budget) for way, model in models.items()}
    tpot_ratios = {}
    rates = [float(r) for r in args.rates.split(",")]
    args.rate = rates[0]  # the prompts and token counts are the same at every rate
    for engine in engines.values():
        _warm_up(engine, _workload(args, config["vocab_size"]), config["vocab_size"])
    # Two ways serve each rate twice, each going first once (the second round with other tokens, which the
    # prefix cache has not seen): what the first run after another way's pays (a kernel's first launch, a
    # shape's set-up) falls on both.
    rounds = [list(engines), list(engines)[::-1]] if len(engines) == 2 else [list(engines)]
    for rate in rates:
        args.rate = rate
        work = _workload(args, config["vocab_size"])
        runs: dict[str, list[dict]] = {way: [] for way in engines}
        for index, order in enumerate(rounds):
            round_work = _other_tokens(work, config["vocab_size"], SECOND_ROUND_SHIFT) if index else work
            for way in order:
                runs[way].append(serve(engines[way], round_work))
        results = {way: _pooled(way_runs) for way, way_runs in runs.items()}
        _print_rate(args.model, rate, args.num_requests, len(rounds), results)
        if rate == min(rates):
            _print_light_load(rate, work, results, models, cuda)
        if len(results) == 2:
            tpot_ratios[rate] = results["cross"]["TPOT"]["mean"] / results["naive"]["TPOT"]["mean"]
    if tpot_ratios:
        by_rate = ", ".join(f"{rate:g}/s {ratio:.3f}" for rate, ratio in tpot_ratios.items())
        verdict = "yes" if all(ratio <= 1.0 for ratio in tpot_ratios.values()) else "no"
        print(f"mean TPOT cross / naive by arrival rate: {by_rate}; cross no worse than naive at every rate: "
              f"{verdict}")


if __name__ == "__main__":
    main()
