"""Cross-attention q/k/v: QKVCrossParallelLinear against the naive QKVParallelLinear applied to both inputs.

    PYTHONPATH=. python benchmarks/bench_cross_qkv.py                 # CPU, float32
    PYTHONPATH=. python benchmarks/bench_cross_qkv.py --device cuda   # bfloat16

The naive way runs the fused projection on the decoder states and on the encoder states and keeps q from
the first, k and v from the second; a decode step (encoder K/V already cached) runs it on the decoder
states and keeps q. QKVCrossParallelLinear computes only those. Shapes: BART-large (hidden 1024, 16 heads
of 64) and a Llama-3.2-Vision-like cross-attention (hidden 4096, 32 heads of 128, 8 KV heads); a prefill
of 128 and of 1024 decoder tokens against 1024 encoder tokens (batch 1), and a decode step (a batch of
``--decode-batch`` sequences, one token each). For each: both outputs checked equal, FLOPs counted by
torch's FlopCounterMode next to the analytic ratio, and the time ratio; the two are timed in alternating
rounds, the ratio is the median of the rounds' ratios and the times each one's best round. On CUDA the
time is also taken from CUDA-graph replays (kernels only), which small decode steps need to show their
work rather than launch overhead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from bench_linear import device_parser, device_setup, summarise, time_graphed, time_interleaved
from torch.utils.flop_counter import FlopCounterMode

from tpkit.parallel_layers import QKVCrossParallelLinear, QKVParallelLinear, TPGroup


@dataclass(frozen=True)
class Model:
    name: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int


MODELS = (
    Model("BART-large", 1024, 16, 16, 64),
    Model("Llama-3.2-Vision-like", 4096, 32, 8, 128),
)


@dataclass(frozen=True)
class Step:
    name: str
    batch: int
    decoder_tokens: int
    encoder_tokens: int  # 0: a decode step, the encoder's K/V already cached


def analytic_flops(model: Model, step: Step) -> tuple[int, int]:
    """(naive, cross) multiply-add FLOPs of the projections, 2 per weight element per token."""
    q = model.num_heads * model.head_size
    kv = 2 * model.num_kv_heads * model.head_size
    decoder = step.batch * step.decoder_tokens
    encoder = step.batch * step.encoder_tokens
    naive = 2 * model.hidden_size * (decoder + encoder) * (q + kv)
    cross = 2 * model.hidden_size * (decoder * q + encoder * kv)
    return naive, cross


def _calls(model: Model, step: Step, dtype: torch.dtype, device: torch.device
           ) -> tuple[Callable[[], tuple], Callable[[], tuple]]:
    """The naive and the cross computation of (q, k, v) for one step, on the same weights."""
    single = TPGroup(None, 0, 1)
    args = (model.hidden_size, model.head_size, model.num_heads, model.num_kv_heads)
    naive = QKVParallelLinear(*args, params_dtype=dtype, device=device, tp_group=single)
    cross = QKVCrossParallelLinear(*args, params_dtype=dtype, device=device, tp_group=single)
    cross.load_state_dict(naive.state_dict())
    # [batch, tokens, hidden]
    decoder = torch.randn(step.batch, step.decoder_tokens, model.hidden_size, dtype=dtype, device=device)
    encoder = None
    if step.encoder_tokens:
        encoder = torch.randn(step.batch, step.encoder_tokens, model.hidden_size, dtype=dtype, device=device)
    sizes = [naive.q_size, naive.kv_size, naive.kv_size]

    def naive_call() -> tuple:
        q = naive(decoder).split(sizes, dim=-1)[0]
        if encoder is None:
            return q, None, None
        _, k, v = naive(encoder).split(sizes, dim=-1)
        return q, k, v

    return naive_call, lambda: cross(decoder, encoder)


def _check(naive_out: tuple, cross_out: tuple, dtype: torch.dtype) -> None:
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for expected, actual in zip(naive_out, cross_out, strict=True):
        if expected is None:
            assert actual is None
        else:
            torch.testing.assert_close(actual, expected, **tol)


def _counted_flops(fn: Callable[[], object]) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def main() -> None:
    parser = device_parser(__doc__)
    parser.add_argument("--decode-batch", type=int, default=8,
                        help="sequences in the decode step (default 8)")
    parser.add_argument("--rounds", type=int, default=None, help="timing rounds (default: 5 CPU, 21 CUDA)")
    args = parser.parse_args()
    if args.decode_batch < 1:
        parser.error(f"--decode-batch must be at least 1, got {args.decode_batch}")
    device, dtype = device_setup(parser, args)
    on_cuda = device.type == "cuda"
    rounds = args.rounds or (21 if on_cuda else 5)
    steps = (Step("prefill", 1, 128, 1024), Step("prefill", 1, 1024, 1024),
             Step("decode", args.decode_batch, 1, 0))

    torch.manual_seed(0)
    where = torch.cuda.get_device_name(device) if on_cuda else f"CPU, {torch.get_num_threads()} threads"
    print(f"cross-attention q/k/v, naive QKVParallelLinear vs QKVCrossParallelLinear: {where}, {dtype}, "
          f"torch {torch.__version__}")
    header = (f"| {'model':<21} | {'step':<7} | {'dec x enc tokens':<16} | {'naive GFLOP':>11} | "
              f"{'cross GFLOP':>11} | {'FLOPs ratio':>11} | {'analytic':>8} | {'naive ms':>9} | "
              f"{'cross ms':>9} | {'time ratio':>10} |")
    if on_cuda:
        header += f" {'graph: naive ms':>15} | {'graph: cross ms':>15} | {'time ratio':>10} |"
    print(header)
    print("|" + "|".join("-" * len(cell) for cell in header.split("|")[1:-1]) + "|")
    with torch.inference_mode():
        for model in MODELS:
            for step in steps:
                naive_call, cross_call = _calls(model, step, dtype, device)
                _check(naive_call(), cross_call(), dtype)
                naive_flops, cross_flops = _counted_flops(naive_call), _counted_flops(cross_call)
                analytic_naive, analytic_cross = analytic_flops(model, step)
                if (naive_flops, cross_flops) != (analytic_naive, analytic_cross):
                    raise AssertionError(f"{model.name} {step}: counted FLOPs {naive_flops}, {cross_flops}, "
                                         f"analytic {analytic_naive}, {analytic_cross}")
                fns = {"naive": naive_call, "cross": cross_call}
                # The calls above were the warm-up.
                times = time_interleaved(fns, device, rounds=rounds, round_seconds=0.005 if on_cuda else 0.05,
                                         warm_up=False)
                cross_s, naive_s, time_ratio = summarise(times, "cross", "naive")
                encoder = str(step.encoder_tokens) if step.encoder_tokens else "cached"
                tokens = f"{step.batch}x{step.decoder_tokens} x {encoder}"
                row = (f"| {model.name:<21} | {step.name:<7} | {tokens:<16} | {naive_flops / 1e9:>11.2f} | "
                       f"{cross_flops / 1e9:>11.2f} | {cross_flops / naive_flops:>11.3f} | "
                       f"{analytic_cross / analytic_naive:>8.3f} | {naive_s * 1e3:>9.3f} | "
                       f"{cross_s * 1e3:>9.3f} | {time_ratio:>10.3f} |")
                if on_cuda:
                    graphed = time_graphed(fns, rounds=rounds, calls=10)
                    cross_s, naive_s, time_ratio = summarise(graphed, "cross", "naive")
                    row += f" {naive_s * 1e3:>15.3f} | {cross_s * 1e3:>15.3f} | {time_ratio:>10.3f} |"
                print(row, flush=True)
    print("ratios are cross / naive; FLOPs counted by torch.utils.flop_counter equal the analytic ones "
          "(checked); both ways' q, k, v checked equal")


if __name__ == "__main__":
    main()
