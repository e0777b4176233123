"""Cross-attention q/k/v: QKVCrossParallelLinear against the naive QKVParallelLinear applied to both inputs.

    PYTHONPATH=. python benchmarks/bench_cross_qkv.py                 # CPU, float32, 2 layers per model
    PYTHONPATH=. python benchmarks/bench_cross_qkv.py --device cuda   # bfloat16, each model's layer count
    PYTHONPATH=. python benchmarks/bench_cross_qkv.py --layers 1      # one layer, weights reused each call

The naive way runs the fused projection on the decoder states and on the encoder states and keeps q from
the first, k and v from the second; a decode step (encoder K/V already cached) runs it on the decoder
states and keeps q. QKVCrossParallelLinear computes only those. Shapes: BART-large (hidden 1024, 16 heads
of 64, 12 decoder layers) and a Llama-3.2-Vision-like cross-attention (hidden 4096, 32 heads of 128, 8 KV
heads, 8 cross-attention layers as in Llama-3.2-11B-Vision); a prefill of 128 and of 1024 decoder tokens
against 1024 encoder tokens (batch 1), and a decode step (a batch of ``--decode-batch`` sequences, one
token each).

What is timed is the cross-attention projections of one model step: every layer's, each layer with its own
weights and its own decoder states, all layers reading the one encoder output (as in BART and Mllama).
Timing one layer's projection over and over would keep its few MB of weights in the GPU's L2 cache and
leave each kernel a few microseconds long, so that launch latency rather than the work set the time; a
model's step streams each layer's weights from memory once. A line above the table gives the weight bytes
a step reads and the L2 cache size. Where one way's weights would fit in L2 (BART-large's decode: the cross
way reads only the q rows, 25 MB), repeated steps would find them there, which a model's step, running
the rest of its weights in between, would not: on CUDA the timed steps therefore take turns over as many
independent copies of the layers as put at least twice the L2 size between two uses of the same weights.
On CPU the default is 2 layers per model (``--layers`` sets any count), which keeps the float32 run to a
minute or two.

For each model and step: q, k, v of every layer checked equal between the two ways, FLOPs counted by
torch's FlopCounterMode checked equal to the analytic count times the layers, and the time ratio; the two
are timed in alternating rounds, the ratio is the median of the rounds' ratios and the times each one's
best round, all per step. On CUDA the time is also taken from CUDA-graph replays of the whole step
(kernels only), which the eager loop over layers, launch-bound for small kernels, needs to show the work.

Both ways multiply with ``--linear-op``: ``decode`` (default), tpkit's ``decode_linear`` as tpkit's models
run it (its CUDA kernel for the decode step's few rows, ``F.linear`` for the prefills and on CPU), or
``F.linear`` throughout.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from bench_linear import device_parser, device_setup, summarise, time_graphed, time_interleaved
from torch.utils.flop_counter import FlopCounterMode

from tpkit.ops import decode_linear
from tpkit.parallel_layers import LinearOp, QKVCrossParallelLinear, QKVParallelLinear, TPGroup, set_linear_op

LINEAR_OPS: dict[str, LinearOp] = {"decode": decode_linear, "F.linear": F.linear}


@dataclass(frozen=True)
class Model:
    name: str
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    layers: int  # layers with cross-attention, each its own projection weights: a step runs them all


MODELS = (
    Model("BART-large", 1024, 16, 16, 64, layers=12),
    Model("Llama-3.2-Vision-like", 4096, 32, 8, 128, layers=8),
)
CPU_LAYERS = 2  # the CPU default: float32 on a core or two, the models' full counts would take minutes


@dataclass(frozen=True)
class Step:
    name: str
    batch: int
    decoder_tokens: int
    encoder_tokens: int  # 0: a decode step, the encoder's K/V already cached


def analytic_flops(model: Model, step: Step) -> tuple[int, int]:
    """(naive, cross) multiply-add FLOPs of one layer's projections, 2 per weight element per token."""
    q = model.num_heads * model.head_size
    kv = 2 * model.num_kv_heads * model.head_size
    decoder = step.batch * step.decoder_tokens
    encoder = step.batch * step.encoder_tokens
    naive = 2 * model.hidden_size * (decoder + encoder) * (q + kv)
    cross = 2 * model.hidden_size * (decoder * q + encoder * kv)
    return naive, cross


def weight_bytes(model: Model, dtype: torch.dtype) -> tuple[int, int]:
    """(all q, k, v rows, the q rows alone): bytes of one layer's weight and bias, each counted once.

    The naive way reads all rows in every step (twice in a prefill, once per input); the cross way reads all
    in a prefill (the q rows for the decoder states, the k, v rows for the encoder's) and the q rows alone
    in a decode step.
    """
    q = model.num_heads * model.head_size
    kv = 2 * model.num_kv_heads * model.head_size
    row = (model.hidden_size + 1) * dtype.itemsize  # a weight row and its bias element
    return (q + kv) * row, q * row


def _steps(model: Model, step: Step, layers: int, dtype: torch.dtype, device: torch.device,
           linear_op: LinearOp) -> tuple[Callable[[], list[tuple]], Callable[[], list[tuple]]]:
    """The naive and the cross computation of every layer's (q, k, v) for one step, on the same weights."""
    single = TPGroup(None, 0, 1)
    args = (model.hidden_size, model.head_size, model.num_heads, model.num_kv_heads)
    pairs = []
    for _ in range(layers):
        naive = QKVParallelLinear(*args, params_dtype=dtype, device=device, tp_group=single)
        cross = QKVCrossParallelLinear(*args, params_dtype=dtype, device=device, tp_group=single)
        cross.load_state_dict(naive.state_dict())
        set_linear_op(naive, linear_op)
        set_linear_op(cross, linear_op)
        pairs.append((naive, cross))
    # Each layer's decoder states are the previous layer's output, so distinct; every layer's cross-attention
    # reads the encoder's one output. layers x [batch, tokens, hidden]; [batch, tokens, hidden]
    decoders = torch.randn(layers, step.batch, step.decoder_tokens, model.hidden_size, dtype=dtype,
                           device=device).unbind(0)
    encoder = None
    if step.encoder_tokens:
        encoder = torch.randn(step.batch, step.encoder_tokens, model.hidden_size, dtype=dtype, device=device)
    sizes = [pairs[0][0].q_size, pairs[0][0].kv_size, pairs[0][0].kv_size]

    def naive_layer(naive: QKVParallelLinear, decoder: torch.Tensor) -> tuple:
        q = naive(decoder).split(sizes, dim=-1)[0]
        if encoder is None:
            return q, None, None
        _, k, v = naive(encoder).split(sizes, dim=-1)
        return q, k, v

    def naive_step() -> list[tuple]:
        return [naive_layer(naive, decoder) for (naive, _), decoder in zip(pairs, decoders, strict=True)]

    def cross_step() -> list[tuple]:
        return [cross(decoder, encoder) for (_, cross), decoder in zip(pairs, decoders, strict=True)]

    return naive_step, cross_step


def _take_turns(fns: list[Callable[[], list[tuple]]]) -> Callable[[], list[tuple]]:
    """A call that runs the next of ``fns`` each time, round and round."""
    turns = itertools.cycle(fns)
    return lambda: next(turns)()


def _copies_beyond_l2(step_bytes: int, device: torch.device) -> int:
    """Independent copies of a step's weights that put twice the L2 size between two uses of one copy."""
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) if device.type == "cuda" else 0
    return max(1, math.ceil(2 * l2 / step_bytes))


def _check(naive_out: list[tuple], cross_out: list[tuple], dtype: torch.dtype) -> None:
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for naive_layer, cross_layer in zip(naive_out, cross_out, strict=True):
        for expected, actual in zip(naive_layer, cross_layer, strict=True):
            if expected is None:
                assert actual is None
            else:
                torch.testing.assert_close(actual, expected, **tol)


def _counted_flops(fn: Callable[[], object]) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def _weights_line(layers: dict[str, int], dtype: torch.dtype, device: torch.device) -> str:
    """The weight bytes one step reads per model and, on CUDA, the L2 cache size to set them against."""
    parts = []
    for model in MODELS:
        n = layers[model.name]
        qkv, q = weight_bytes(model, dtype)
        parts.append(f"{model.name} {n} x {qkv / 1e6:.1f} = {n * qkv / 1e6:.1f} MB (the cross decode step "
                     f"{n} x {q / 1e6:.1f} = {n * q / 1e6:.1f} MB)")
    line = f"weights a step reads, each byte counted once: {'; '.join(parts)}"
    if device.type != "cuda":
        return line
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", None)
    return line + (f"; L2 cache {l2 / 1e6:.1f} MB" if l2 else "; L2 cache size not reported by this torch")


def main() -> None:
    parser = device_parser(__doc__)
    parser.add_argument("--decode-batch", type=int, default=8,
                        help="sequences in the decode step (default 8)")
    parser.add_argument("--layers", type=int, default=None,
                        help="layers per step, each with its own weights (default: the model's, "
                             + ", ".join(f"{m.name} {m.layers}" for m in MODELS)
                             + f"; on CPU {CPU_LAYERS} for every model)")
    parser.add_argument("--rounds", type=int, default=None, help="timing rounds (default: 5 CPU, 21 CUDA)")
    parser.add_argument("--linear-op", choices=tuple(LINEAR_OPS), default="decode",
                        help="how both ways multiply (default: decode, tpkit's decode_linear, as the models)")
    args = parser.parse_args()
    if args.decode_batch < 1:
        parser.error(f"--decode-batch must be at least 1, got {args.decode_batch}")
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers must be at least 1, got {args.layers}")
    device, dtype = device_setup(parser, args)
    on_cuda = device.type == "cuda"
    rounds = args.rounds or (21 if on_cuda else 5)
    linear_op = LINEAR_OPS[args.linear_op]
    layers = {m.name: args.layers or (m.layers if on_cuda else min(m.layers, CPU_LAYERS)) for m in MODELS}
    steps = (Step("prefill", 1, 128, 1024), Step("prefill", 1, 1024, 1024),
             Step("decode", args.decode_batch, 1, 0))

    torch.manual_seed(0)
    where = torch.cuda.get_device_name(device) if on_cuda else f"CPU, {torch.get_num_threads()} threads"
    print(f"cross-attention q/k/v, naive QKVParallelLinear vs QKVCrossParallelLinear: {where}, {dtype}, "
          f"torch {torch.__version__}; linear op: {args.linear_op}")
    print(_weights_line(layers, dtype, device))
    cpu_default = not (args.layers or on_cuda)
    print("GFLOP and ms per step: the projections of all its layers"
          + (f" (on CPU {CPU_LAYERS} layers by default, not the model's count)" if cpu_default else ""))
    header = (f"| {'model':<21} | {'layers':>6} | {'step':<7} | {'dec x enc tokens':<16} | "
              f"{'naive GFLOP':>11} | {'cross GFLOP':>11} | {'FLOPs ratio':>11} | {'analytic':>8} | "
              f"{'naive ms':>9} | {'cross ms':>9} | {'time ratio':>10} |")
    if on_cuda:
        header += f" {'graph: naive ms':>15} | {'graph: cross ms':>15} | {'time ratio':>10} |"
    print(header)
    print("|" + "|".join("-" * len(cell) for cell in header.split("|")[1:-1]) + "|")
    with torch.inference_mode():
        for model in MODELS:
            n = layers[model.name]
            for step in steps:
                qkv_bytes, q_bytes = weight_bytes(model, dtype)
                copies = _copies_beyond_l2(n * (q_bytes if step.encoder_tokens == 0 else qkv_bytes), device)
                stacks = [_steps(model, step, n, dtype, device, linear_op) for _ in range(copies)]
                naive_step, cross_step = stacks[0]
                _check(naive_step(), cross_step(), dtype)
                naive_flops, cross_flops = _counted_flops(naive_step), _counted_flops(cross_step)
                naive_step = _take_turns([naive for naive, _ in stacks])
                cross_step = _take_turns([cross for _, cross in stacks])
                analytic_naive, analytic_cross = (n * flops for flops in analytic_flops(model, step))
                if (naive_flops, cross_flops) != (analytic_naive, analytic_cross):
                    raise AssertionError(f"{model.name} {step}, {n} layers: counted FLOPs {naive_flops}, "
                                         f"{cross_flops}, analytic {analytic_naive}, {analytic_cross}")
                fns = {"naive": naive_step, "cross": cross_step}
                # The calls above were the warm-up.
                times = time_interleaved(fns, device, rounds=rounds, round_seconds=0.005 if on_cuda else 0.05,
                                         warm_up=False)
                cross_s, naive_s, time_ratio = summarise(times, "cross", "naive")
                encoder = str(step.encoder_tokens) if step.encoder_tokens else "cached"
                tokens = f"{step.batch}x{step.decoder_tokens} x {encoder}"
                layers_text = f"{n} x{copies}" if copies > 1 else str(n)  # layers, copies taking turns
                row = (f"| {model.name:<21} | {layers_text:>6} | {step.name:<7} | {tokens:<16} | "
                       f"{naive_flops / 1e9:>11.2f} | {cross_flops / 1e9:>11.2f} | "
                       f"{cross_flops / naive_flops:>11.3f} | {analytic_cross / analytic_naive:>8.3f} | "
                       f"{naive_s * 1e3:>9.3f} | {cross_s * 1e3:>9.3f} | {time_ratio:>10.3f} |")
                if on_cuda:
                    # Each copy's step once per graph (at least two steps): the step is already every
                    # layer's work, and few repeats keep the graph's memory pool (the outputs) small.
                    graphed = time_graphed(fns, rounds=rounds, calls=max(2, copies))
                    cross_s, naive_s, time_ratio = summarise(graphed, "cross", "naive")
                    row += f" {naive_s * 1e3:>15.3f} | {cross_s * 1e3:>15.3f} | {time_ratio:>10.3f} |"
                print(row, flush=True)
    print("ratios are cross / naive; FLOPs counted by torch.utils.flop_counter equal the analytic ones times "
          "the layers (checked); both ways' q, k, v checked equal in every layer")


if __name__ == "__main__":
    main()
