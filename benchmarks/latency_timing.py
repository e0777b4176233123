"""How ``bench_latency.py`` times tpkit's ``generate`` (imported by it and by the benchmarks built on it).

- :func:`timed_runs` / :func:`run_row`: the runs after a warm-up, as a table row that records a failure
  rather than raising it;
- :func:`timed_model`: a model's rows, one a ``generate`` variant of :func:`tpkit_variants` (eager, the
  decode step replayed from a CUDA graph, and also through ``torch.compile``), and its floors;
- :class:`PrefillClock` / :func:`prefill_row`: the prefill inside ``generate`` timed on its own;
- :func:`copy_bandwidth` and :func:`read_floor`: the floors' yardstick and the bytes a call must move.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from bench_paged_attention import _copy_bandwidth_gbps
from torch import nn

from tpkit.models import PagedLM
from tpkit.models.layer_types import window_sizes

if TYPE_CHECKING:
    from bench_latency import Setup


def timed_runs(setup: Setup, fn: Callable[[], Any]) -> tuple[list[float], Any]:
    """Seconds of each of ``setup.iterations`` runs after ``setup.warmup`` warm-up runs; the last result."""
    for _ in range(setup.warmup):
        result = fn()
    times = []
    for _ in range(setup.iterations):
        setup.sync()
        start = time.perf_counter()
        result = fn()
        setup.sync()
        times.append(time.perf_counter() - start)
    return times, result


def run_row(name: str, setup: Setup, fn: Callable[[], Any]) -> dict:
    print(f"  {name} ...", flush=True)
    try:
        times, result = timed_runs(setup, fn)
    except Exception as error:  # noqa: BLE001 - one failing variant must not hide the others
        traceback.print_exc()
        return {"impl": name, "error": f"{type(error).__name__}: {error}"[:300]}
    return {"impl": name, "runs_s": times, "avg_s": statistics.fmean(times), "result": result}


def token_agreement(tokens: list[list[int]], reference: list[list[int]]) -> float:
    """The share of positions whose token equals the reference's."""
    pairs = [(a, b) for x, y in zip(tokens, reference, strict=True) for a, b in zip(x, y, strict=True)]
    return sum(a == b for a, b in pairs) / len(pairs)


def free_memory(setup: Setup) -> None:
    gc.collect()
    if setup.device.type == "cuda":
        torch.cuda.empty_cache()


def copy_bandwidth(setup: Setup) -> float:
    """Bytes per second of a large clone (read + written), the floor's yardstick. On a GPU the baseline's
    measure, bench_paged_attention's (a 2 GiB clone timed by CUDA events): a clone timed from the host reads
    low, which would put the floor too high."""
    if setup.device.type == "cuda":
        return _copy_bandwidth_gbps() * 1e9
    x = torch.empty(64 * 2**20 // 2, dtype=torch.bfloat16, device=setup.device)
    times, _ = timed_runs(setup, x.clone)
    return 2 * x.nbytes / min(times)


def read_floor(model: PagedLM, batch: int, input_len: int, output_len: int, bandwidth: float) -> dict:
    """The time a ``generate`` call of ``batch`` prompts of ``input_len`` tokens and ``output_len`` new tokens
    (a Llama-family ``model``) takes to move the bytes it must at ``bandwidth`` (bytes a second, read +
    written):

    - each of its ``output_len`` steps (the prefill, then the decode steps) reads every parameter once but the
      embedding table, of which a step reads only its tokens' rows (a few KB, left out), unless the LM head
      is tied to it;
    - the prefill writes the prompts' K and V; decode step ``j`` (1 .. output_len - 1) writes its token's and
      reads the ``input_len + j`` tokens' K and V up to its own, a sliding layer only its window of them.
    """
    embedding = model.embed_tokens.weight
    tied = model.lm_head.weight is embedding
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if tied or p is not embedding)
    num_layers, num_kv_heads, head_size = model.kv_cache_layout()["self"]
    token_bytes = 2 * num_kv_heads * head_size * model.cache_dtype.itemsize  # one layer's K and V of a token
    read = sum(min(input_len + j, window or input_len + j)
               for window in window_sizes(model.config) for j in range(1, output_len))
    written = num_layers * (input_len + output_len - 1)
    kv_bytes = batch * token_bytes * (read + written)
    return {"weight_bytes_per_step": weight_bytes, "steps": output_len, "kv_bytes": kv_bytes,
            "kv_cache_dtype": str(model.cache_dtype).removeprefix("torch."),
            "floor_s": (weight_bytes * output_len + kv_bytes) / bandwidth}


def floor_line(name: str, floor: dict, bandwidth_gbps: float) -> str:
    """:func:`read_floor`'s parts, as the report prints them."""
    return (f"read floor, {name}: {floor['weight_bytes_per_step'] / 1e9:.3f} GB of weights a step (the "
            f"embedding table aside) x {floor['steps']} steps + {floor['kv_bytes'] / 1e9:.3f} GB of "
            f"{floor['kv_cache_dtype']} KV cache over them (read and written) at {bandwidth_gbps:.0f} GB/s = "
            f"{floor['floor_s']:.3f} s")


def tpkit_variants(setup: Setup, args: argparse.Namespace) -> list[tuple[str, dict]]:
    """The ``generate`` options each tpkit model is timed with, by name."""
    variants = [("eager", {})]
    if setup.device.type == "cuda":
        variants.append(("CUDA graph", {"cuda_graph": True}))
        if not args.no_compile:
            variants.append(("CUDA graph + compile", {"cuda_graph": True, "compile": True}))
    return variants


def timed_model(setup: Setup, args: argparse.Namespace, model: PagedLM, prompts: list[list[int]],
                bandwidth: float, prefix: str) -> tuple[dict, list[list[int]] | None]:
    """``model``'s rows (``impl``: ``prefix`` and the variant's name) and its floors: the weights read once a
    step (all of them), and :func:`read_floor`; the tokens of the first variant that ran."""
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rows: list[dict] = []
    first_tokens = None
    for name, options in tpkit_variants(setup, args):
        row = run_row(f"{prefix} {name}", setup, lambda o=options: model.generate(prompts, setup.output_len,
                                                                                   ignore_eos=True, **o))
        row["variant"] = name
        if row.get("result") is not None:
            tokens = row.pop("result")
            first_tokens = first_tokens or tokens
            row["same_tokens_as_eager"] = token_agreement(tokens, first_tokens)
        rows.append(row)
    model.clear_kv_cache()
    return {"weight_bytes": weight_bytes, "copy_GBps": bandwidth / 1e9,
            "floor_s": weight_bytes / bandwidth * setup.output_len,
            "read_floor": read_floor(model, setup.batch, setup.input_len, setup.output_len, bandwidth),
            "rows": rows}, first_tokens


class PrefillClock:
    """Times the prefill inside every ``generate`` call of ``model`` (synchronised before and after), so a
    call's decode time is its own time less its own prefill's: the eager prefill's host time varies by
    several ms between calls, too much to subtract one call's prefill from another call's total."""

    def __init__(self, setup: Setup, model: nn.Module) -> None:
        self.seconds: list[float] = []
        prefill = model._prefill

        def timed_prefill(*args: Any, **kwargs: Any) -> torch.Tensor:
            setup.sync()
            start = time.perf_counter()
            logits = prefill(*args, **kwargs)
            setup.sync()
            self.seconds.append(time.perf_counter() - start)
            return logits

        model._prefill = timed_prefill


def prefill_row(setup: Setup, model: PagedLM, prompts: list[list[int]], name: str) -> dict:
    """The prefill of ``prompts`` alone (``generate`` of one token, its prefill timed), in tokens a second."""
    clock = PrefillClock(setup, model)
    row = run_row(name, setup, lambda: model.generate(prompts, 1, ignore_eos=True))
    row.pop("result", None)
    row |= {"batch": len(prompts), "prompt_len": len(prompts[0])}
    if "runs_s" in row:
        row["prefill_s"] = statistics.fmean(clock.seconds[-len(row["runs_s"]):])  # the timed calls' own
        row["tokens_per_s"] = len(prompts) * len(prompts[0]) / row["prefill_s"]
    model.clear_kv_cache()
    return row
