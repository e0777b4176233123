"""tpkit's layers at tp_size 1 against torch.nn.functional on the same weights: is there any overhead?

    PYTHONPATH=. python benchmarks/bench_linear.py                   # CPU, float32, small Llama-like shapes
    PYTHONPATH=. python benchmarks/bench_linear.py --device cuda     # bfloat16, Llama-3-8B shapes

Every layer (Replicated, Column, Merged gate_up, QKV, Row, the LM head's compute_logits, and the embedding)
runs at tp_size 1 next to the plain functional call it amounts to (``F.linear(x, layer.weight,
layer.bias)``, ``F.embedding``), on the same tensors, in inference mode, for a decode batch and a prefill.
The two are timed in alternating rounds so that load on the machine hits both alike; the table shows each
one's best round (the least disturbed) and, as the ratio, the median of the rounds' ratios. On CUDA
each round is timed with events, and once more with the round's calls replayed from a CUDA graph: eager
time includes Python and launch overhead, which small decode matmuls on a fast GPU may not hide; the
graph time is the kernels alone. Goal: ratio <= 1.02.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tpkit.parallel_layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    destroy_tensor_parallel,
    init_tensor_parallel,
)


@dataclass(frozen=True)
class Shapes:
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    vocab_size: int
    token_counts: tuple[int, ...]


PRESETS = {
    # A small Llama, so that the CPU run takes well under a minute.
    "cpu": Shapes(1024, 2816, 16, 4, 64, 8000, (8, 256)),
    # Llama-3-8B.
    "cuda": Shapes(4096, 14336, 32, 8, 128, 128256, (8, 4096)),
}


def _timer(device: torch.device) -> Callable[[Callable[[], object], int], float]:
    """Seconds per call of ``fn`` over ``calls`` back-to-back calls."""
    if device.type != "cuda":
        def cpu(fn: Callable[[], object], calls: int) -> float:
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            return (time.perf_counter() - start) / calls
        return cpu

    def cuda(fn: Callable[[], object], calls: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls
    return cuda


def _graphed(fn: Callable[[], object], calls: int) -> Callable[[], object]:
    """A callable that replays ``calls`` calls of ``fn`` captured in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):  # warm up on the capturing stream, outside the capture (cuBLAS workspace)
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn()
    return graph.replay


def time_interleaved(fns: dict[str, Callable[[], object]], device: torch.device, *, rounds: int,
                     round_seconds: float, warm_up: bool = True) -> dict[str, list[float]]:
    """Seconds per call of each function in every round; the functions alternate, round by round.

    A round makes as many calls as the first function fits in ``round_seconds`` (at least one).
    """
    timer = _timer(device)
    if warm_up:
        for fn in fns.values():
            fn()
    per_call = max(timer(next(iter(fns.values())), 1), 1e-7)
    calls = max(1, min(10_000, round(round_seconds / per_call)))
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for i in range(rounds):
        for name in names if i % 2 == 0 else reversed(names):
            times[name].append(timer(fns[name], calls))
    return times


def time_graphed(fns: dict[str, Callable[[], object]], *, rounds: int, calls: int) -> dict[str, list[float]]:
    """Like :func:`time_interleaved`, each round one replay of ``calls`` captured calls (CUDA only)."""
    replays = {name: _graphed(fn, calls) for name, fn in fns.items()}
    times = time_interleaved(replays, torch.device("cuda"), rounds=rounds, round_seconds=0.0)
    return {name: [seconds / calls for seconds in per_round] for name, per_round in times.items()}


def summarise(times: dict[str, list[float]], numerator: str, denominator: str) -> tuple[float, float, float]:
    """(best numerator, best denominator, median of the rounds' ratios).

    A round's two timings are taken moments apart, so their ratio cancels most of the load on the machine
    (which comes and goes); the median ignores the rounds that a burst of load hit on one side only.
    The best times show the scale.
    """
    ratios = sorted(a / b for a, b in zip(times[numerator], times[denominator], strict=True))
    return min(times[numerator]), min(times[denominator]), ratios[len(ratios) // 2]


def _cases(shapes: Shapes, tokens: int, dtype: torch.dtype, device: torch.device
           ) -> list[tuple[str, str, Callable[[], object], Callable[[], object]]]:
    """(layer name, shape text, layer call, functional call) for one token count."""
    h, i = shapes.hidden_size, shapes.intermediate_size
    factory = {"params_dtype": dtype, "device": device}
    x = torch.randn(tokens, h, dtype=dtype, device=device)  # [tokens, hidden]
    x_inter = torch.randn(tokens, i, dtype=dtype, device=device)  # [tokens, intermediate]
    layers = [
        ("ReplicatedLinear", ReplicatedLinear(h, h, bias=False, **factory), x),
        ("ColumnParallelLinear", ColumnParallelLinear(h, h, bias=False, **factory), x),
        ("ColumnParallelLinear+bias", ColumnParallelLinear(h, h, bias=True, **factory), x),
        ("MergedColumnParallelLinear", MergedColumnParallelLinear(h, [i, i], bias=False, **factory), x),
        ("QKVParallelLinear", QKVParallelLinear(h, shapes.head_size, shapes.num_heads, shapes.num_kv_heads,
                                                bias=False, **factory), x),
        ("RowParallelLinear", RowParallelLinear(i, h, bias=False, **factory), x_inter),
        ("RowParallelLinear+bias", RowParallelLinear(i, h, bias=True, **factory), x_inter),
    ]
    cases = []
    for name, layer, inp in layers:
        out_features, in_features = layer.weight.shape
        cases.append((name, f"{tokens}x{in_features} -> {out_features}",
                      lambda layer=layer, inp=inp: layer(inp),
                      lambda layer=layer, inp=inp: F.linear(inp, layer.weight, layer.bias)))
    head = ParallelLMHead(shapes.vocab_size, h, **factory)
    vocab, padded = head.num_embeddings, head.num_embeddings_padded

    def logits() -> torch.Tensor:
        out = F.linear(x, head.weight)  # [tokens, padded vocab]
        return out if padded == vocab else out[..., :vocab]
    cases.append(("ParallelLMHead.compute_logits", f"{tokens}x{h} -> {vocab}", lambda: head.compute_logits(x),
                  logits))
    embedding = VocabParallelEmbedding(shapes.vocab_size, h, **factory)
    ids = torch.randint(0, shapes.vocab_size, (tokens,), device=device)
    cases.append(("VocabParallelEmbedding", f"{tokens} ids -> {h}", lambda: embedding(ids),
                  lambda: F.embedding(ids, embedding.weight)))
    return cases


def device_parser(description: str) -> argparse.ArgumentParser:
    """The arguments every layer benchmark takes: --device, --dtype, --threads."""
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--threads", type=int, default=1,
                        help="CPU threads (default 1: steadier timings on a shared machine)")
    return parser


def device_setup(parser: argparse.ArgumentParser,
                 args: argparse.Namespace) -> tuple[torch.device, torch.dtype]:
    """The device and dtype of ``args`` (checked); sets the CPU thread count."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but CUDA is not available")
    if device.type != "cuda":
        torch.set_num_threads(args.threads)
    return device, getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))


def main() -> None:
    parser = device_parser(__doc__)
    parser.add_argument("--rounds", type=int, default=None, help="timing rounds (default 41)")
    parser.add_argument("--round-ms", type=float, default=None,
                        help="length of one round of calls (default: 10 ms CPU, 5 ms CUDA)")
    args = parser.parse_args()
    device, dtype = device_setup(parser, args)
    on_cuda = device.type == "cuda"
    rounds = args.rounds or 41
    round_seconds = (args.round_ms or (5.0 if on_cuda else 10.0)) / 1e3
    shapes = PRESETS["cuda" if on_cuda else "cpu"]

    tp = init_tensor_parallel(tp_size=1)
    torch.manual_seed(0)
    where = torch.cuda.get_device_name(device) if on_cuda else f"CPU, {torch.get_num_threads()} threads"
    print(f"tpkit layers vs torch.nn.functional at tp_size {tp.size}: {where}, {dtype}, "
          f"torch {torch.__version__}")
    print(f"shapes: {shapes}")
    header = f"| {'layer':<30} | {'shape':<22} | {'functional us':>13} | {'layer us':>9} | {'ratio':>6} |"
    if on_cuda:
        header += f" {'graph: functional us':>20} | {'graph: layer us':>15} | {'ratio':>6} |"
    print(header)
    print("|" + "|".join("-" * (len(cell)) for cell in header.split("|")[1:-1]) + "|")
    ratios = []
    with torch.inference_mode():
        for tokens in shapes.token_counts:
            for name, shape, layer_call, functional_call in _cases(shapes, tokens, dtype, device):
                fns = {"functional": functional_call, "layer": layer_call}
                times = time_interleaved(fns, device, rounds=rounds, round_seconds=round_seconds)
                layer_s, functional_s, ratio = summarise(times, "layer", "functional")
                if name != "VocabParallelEmbedding":  # the goal is about the matmul layers
                    ratios.append(ratio)
                row = (f"| {name:<30} | {shape:<22} | {functional_s * 1e6:>13.1f} | {layer_s * 1e6:>9.1f} | "
                       f"{ratio:>6.3f} |")
                if on_cuda:
                    graphed = time_graphed(fns, rounds=rounds, calls=20)
                    layer_s, functional_s, ratio = summarise(graphed, "layer", "functional")
                    row += f" {functional_s * 1e6:>20.1f} | {layer_s * 1e6:>15.1f} | {ratio:>6.3f} |"
                print(row, flush=True)
    print(f"linear layers, eager ratio: median {sorted(ratios)[len(ratios) // 2]:.3f}, max {max(ratios):.3f} "
          "(goal <= 1.02). The embedding's lookup takes microseconds, so nn.Module's own call overhead "
          "(about a microsecond) shows in its ratio.")
    destroy_tensor_parallel()


if __name__ == "__main__":
    main()
