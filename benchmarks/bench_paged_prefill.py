"""Attention with several query tokens a sequence over a paged KV cache, on one GPU: tpkit's op (with
``query_start_loc``) against FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` (backends fa2 and fa3)
and torch SDPA on the same data laid out contiguously, next to the anchors' figures.

    PYTHONPATH=. python benchmarks/bench_paged_prefill.py [--only P1,MIX] [--impls tpkit,flashinfer-fa3]
    PYTHONPATH=. python benchmarks/bench_paged_prefill.py --device cpu --small    # smoke test, no GPU

The configurations and the anchors (the peers' times on an H200) come from
``benchmarks/baselines/paged_prefill_h200.json``: bf16, head size 128, KV block (page) 16, groups of
sequences each holding ``cached`` tokens and ``new`` query tokens after them (their K/V in the cache too),
causal bottom-right; ``--small`` shrinks them for a quick run. Pages are handed out in random order. Every
output is checked against a float32 reference (relative error ``||out - ref|| / ||ref||``). On a GPU the
time is the median of CUDA-graph replays, each running the call on every one of several input sets (at
least ``--min-kv-mb`` of KV between two reads of the same bytes), repeated within the graph for about
``--replay-ms`` as the anchors' timer does; on the CPU the wall clock of a round of the sets. TFLOP/s =
4 * Hq * 128 * (sum over query tokens of the keys each sees) / time. SDPA takes each group of equal
sequences as one call (``[count, H, L, 128]``, ``causal_lower_right``; MIX is a prefill call plus a decode
call), its gather not timed. FlashInfer columns read "not installed" where it cannot be imported.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_paged_attention as decode_bench  # noqa: E402
from flashinfer_decode import import_error  # noqa: E402

from tpkit.ops import paged_attention  # noqa: E402

HEAD_SIZE = 128
BLOCK_SIZE = 16
BASELINES = Path(__file__).resolve().parent / "baselines" / "paged_prefill_h200.json"
SDPA_BACKENDS = {"sdpa-default": None, "sdpa-flash": SDPBackend.FLASH_ATTENTION,
                 "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION}
FLASHINFER_BACKENDS = ("fa2", "fa3")
MAX_REL_ERR = 2e-2


@dataclass(frozen=True)
class Config:
    name: str
    groups: tuple[tuple[int, int, int], ...]  # (sequences, cached tokens, new tokens) per group
    num_heads: int
    num_kv_heads: int
    dtype: torch.dtype = torch.bfloat16

    @property
    def seqs(self) -> list[tuple[int, int]]:
        """(cached, new) of every sequence, group after group."""
        return [(cached, new) for count, cached, new in self.groups for _ in range(count)]

    @property
    def flops(self) -> float:
        # Query j of a sequence (0-based) sees cached + j + 1 keys.
        keys = sum(new * cached + new * (new + 1) // 2 for cached, new in self.seqs)
        return 4.0 * self.num_heads * HEAD_SIZE * keys

    @property
    def kv_bytes(self) -> int:
        tokens = sum(cached + new for cached, new in self.seqs)
        return 2 * tokens * self.num_kv_heads * HEAD_SIZE * self.dtype.itemsize

    def __str__(self) -> str:
        groups = " + ".join(f"{count}x{cached}:{new}" for count, cached, new in self.groups)
        return f"{self.name} {groups} Hq={self.num_heads} Hkv={self.num_kv_heads}"


def load_baselines() -> dict:
    return json.loads(BASELINES.read_text())


def configs_from(baselines: dict, small: bool) -> list[Config]:
    """The anchors' configurations; ``small``: a few short sequences and heads, for a smoke test."""
    configs = []
    for name, row in baselines["configs"].items():
        groups = tuple(tuple(g) for g in row["groups"])
        num_heads, num_kv_heads = row["num_heads"], row["num_kv_heads"]
        if small:
            groups = tuple((min(count, 2), cached // 64, new if new <= 4 else max(1, new // 64))
                           for count, cached, new in groups)
            num_kv_heads = max(1, num_kv_heads // 8)
            num_heads = num_kv_heads * max(1, num_heads // row["num_kv_heads"] // 2)
        configs.append(Config(name, groups, num_heads, num_kv_heads))
    return configs


@dataclass
class InputSet:
    """One step's inputs in the paged layout, and per group the same K/V laid out contiguously."""

    query: torch.Tensor  # [num_tokens, Hq, D]
    key_cache: torch.Tensor  # [num_pages, BLOCK_SIZE, Hkv, D]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [num_seqs, max_pages], a permutation of the pages
    seq_lens: torch.Tensor  # int32 [num_seqs]
    query_start_loc: torch.Tensor  # int32 [num_seqs + 1]
    contiguous_kv: list[tuple[torch.Tensor, torch.Tensor]]  # per group: key, value [count, Hkv, L, D]


def make_set(cfg: Config, generator: torch.Generator, device: torch.device) -> InputSet:
    seqs = cfg.seqs
    pages = [-(-(cached + new) // BLOCK_SIZE) for cached, new in seqs]
    num_pages = sum(pages)
    shape = (num_pages, BLOCK_SIZE, cfg.num_kv_heads, HEAD_SIZE)
    key_cache = torch.randn(shape, generator=generator, device=device, dtype=cfg.dtype)
    value_cache = torch.randn(shape, generator=generator, device=device, dtype=cfg.dtype)
    order = torch.randperm(num_pages, generator=generator, device=device).int()
    block_tables = torch.zeros(len(seqs), max(pages), dtype=torch.int32, device=device)
    start = 0
    for i, n in enumerate(pages):
        block_tables[i, :n] = order[start:start + n]
        start += n
    lens = [cached + new for cached, new in seqs]
    starts = [0]
    for _, new in seqs:
        starts.append(starts[-1] + new)
    query = torch.randn(starts[-1], cfg.num_heads, HEAD_SIZE, generator=generator, device=device,
                        dtype=cfg.dtype)
    contiguous_kv, first = [], 0
    for count, cached, new in cfg.groups:
        tables = block_tables[first:first + count, :-(-(cached + new) // BLOCK_SIZE)]
        key, value = (_gather(cache, tables, cached + new) for cache in (key_cache, value_cache))
        contiguous_kv.append((key, value))
        first += count
    return InputSet(query, key_cache, value_cache, block_tables,
                    torch.tensor(lens, dtype=torch.int32, device=device),
                    torch.tensor(starts, dtype=torch.int32, device=device), contiguous_kv)


def _gather(cache: torch.Tensor, tables: torch.Tensor, length: int) -> torch.Tensor:
    """[num_pages, BLOCK_SIZE, Hkv, D] pages of each table row -> contiguous [rows, Hkv, length, D]."""
    rows, pages = tables.shape
    tokens = cache[tables.long()].view(rows, pages * BLOCK_SIZE, cache.shape[2], cache.shape[3])
    return tokens[:, :length].transpose(1, 2).contiguous()


def reference(cfg: Config, s: InputSet) -> torch.Tensor:
    """float32 attention, one sequence at a time: [num_tokens, Hq, D]."""
    out = torch.empty(s.query.shape, dtype=torch.float32, device=s.query.device)
    group = cfg.num_heads // cfg.num_kv_heads
    token = 0
    for g, (count, cached, new) in enumerate(cfg.groups):
        key, value = s.contiguous_kv[g]
        for i in range(count):
            q = s.query[token:token + new].float().transpose(0, 1)  # [Hq, new, D]
            k = key[i].float().repeat_interleave(group, dim=0)  # [Hq, L, D]
            v = value[i].float().repeat_interleave(group, dim=0)
            allowed = torch.arange(cached + new, device=q.device)[None, :] <= (
                cached + torch.arange(new, device=q.device))[:, None]  # [new, L]
            attended = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)  # [Hq, new, D]
            out[token:token + new] = attended.transpose(0, 1)
            token += new
    return out


def tpkit_call(cfg: Config, s: InputSet) -> Callable[[], torch.Tensor]:
    out = torch.empty_like(s.query)
    return lambda: paged_attention(s.query, s.key_cache, s.value_cache, s.block_tables, s.seq_lens,
                                   query_start_loc=s.query_start_loc, out=out)


def sdpa_call(cfg: Config, s: InputSet, backend: SDPBackend | None) -> Callable[[], torch.Tensor]:
    """One SDPA call per group of equal sequences on its contiguous K/V; returns [num_tokens, Hq, D]."""
    calls, token = [], 0
    for (count, cached, new), (key, value) in zip(cfg.groups, s.contiguous_kv, strict=True):
        # [count, Hq, new, D], a view of the group's packed query tokens.
        query = s.query[token:token + count * new].view(count, new, cfg.num_heads, HEAD_SIZE)
        query = query.transpose(1, 2)
        token += count * new
        if new == 1:
            mask = dict()  # a decode token sees every key
        elif cached == 0:
            mask = dict(is_causal=True)
        else:
            mask = dict(attn_mask=causal_lower_right(new, cached + new))
        calls.append(lambda q=query, k=key, v=value, m=mask: F.scaled_dot_product_attention(
            q, k, v, enable_gqa=True, **m))

    def run() -> torch.Tensor:
        if backend is None:
            outs = [call() for call in calls]
        else:
            with sdpa_kernel(backend):
                outs = [call() for call in calls]
        return torch.cat([o.transpose(1, 2).reshape(-1, cfg.num_heads, HEAD_SIZE) for o in outs])

    return run


def flashinfer_call(cfg: Config, s: InputSet, backend: str) -> Callable[[], torch.Tensor]:
    """FlashInfer's paged prefill, planned once for this input set (its own workspace)."""
    import flashinfer

    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=s.query.device)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend=backend)
    pages = (s.seq_lens.long() + BLOCK_SIZE - 1) // BLOCK_SIZE  # [num_seqs]
    kv_indptr = torch.zeros(len(pages) + 1, dtype=torch.int32, device=s.query.device)
    kv_indptr[1:] = pages.cumsum(0)
    used = torch.arange(s.block_tables.shape[1], device=s.query.device)[None, :] < pages[:, None]
    indices = s.block_tables[used]  # each sequence's pages in order, packed
    last_page_len = ((s.seq_lens - 1) % BLOCK_SIZE + 1).int()
    wrapper.plan(s.query_start_loc.cpu(), kv_indptr.cpu(), indices, last_page_len.cpu(), cfg.num_heads,
                 cfg.num_kv_heads, HEAD_SIZE, BLOCK_SIZE, causal=True, q_data_type=cfg.dtype,
                 kv_data_type=cfg.dtype)
    out = torch.empty_like(s.query)
    return lambda: wrapper.run(s.query, (s.key_cache, s.value_cache), out=out)


MakeCall = Callable[[Config, InputSet], Callable[[], torch.Tensor]]


def implementations(device: torch.device) -> dict[str, MakeCall]:
    impls: dict[str, MakeCall] = {"tpkit": tpkit_call}
    for name, backend in SDPA_BACKENDS.items():
        if device.type == "cuda" or backend is None:
            impls[name] = lambda cfg, s, b=backend: sdpa_call(cfg, s, b)
    if device.type == "cuda":
        for backend in FLASHINFER_BACKENDS:
            impls[f"flashinfer-{backend}"] = lambda cfg, s, b=backend: flashinfer_call(cfg, s, b)
    return impls


def _time_us(calls: list[Callable[[], torch.Tensor]], device: torch.device,
             args: argparse.Namespace) -> float:
    """Per call: CUDA-graph replay medians on a GPU (fewer replays where a round is slow), else the
    wall-clock median of rounds."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        start = time.perf_counter()
        for call in calls:
            call()
        torch.cuda.synchronize()
        round_s = time.perf_counter() - start
        slow = round_s * args.replays > args.impl_budget_s
        replays = max(3, int(args.impl_budget_s / round_s)) if slow else args.replays
        return decode_bench._graph_time_us(calls, min(replays, args.replays), 0.0 if slow else args.replay_ms)
    times = []
    for _ in range(args.replays):
        start = time.perf_counter()
        for call in calls:
            call()
        times.append((time.perf_counter() - start) / len(calls))
    return statistics.median(times) * 1e6


def bench_config(cfg: Config, args: argparse.Namespace, device: torch.device, baselines: dict,
                 have_flashinfer: bool) -> list[dict]:
    num_sets = max(1, math.ceil(args.min_kv_mb * 1e6 / cfg.kv_bytes)) if device.type == "cuda" else 1
    generator = torch.Generator(device=device).manual_seed(0)
    sets = [make_set(cfg, generator, device) for _ in range(num_sets)]
    ref = reference(cfg, sets[0])
    anchor = baselines["configs"].get(cfg.name, {})
    anchor_us = {} if args.small else anchor.get("us", {})
    best = min(anchor_us.items(), key=lambda kv: kv[1]) if anchor_us else None
    rows = []
    for name, make in implementations(device).items():
        if args.impls is not None and name not in args.impls.split(","):
            continue
        row = {"config": cfg.name, "impl": name, "num_input_sets": num_sets, "anchor_us": anchor_us.get(name),
               "best_anchor": None if best is None else f"{best[0]} {best[1]}",
               "goal_us": None if args.small else anchor.get("goal_us")}
        if name.startswith("flashinfer") and not have_flashinfer:
            rows.append({**row, "status": "not installed"})
            continue
        try:
            calls = [make(cfg, s) for s in sets]
            err = decode_bench._rel_err(calls[0](), ref)
            t_us = _time_us(calls, device, args)
        except Exception as exc:  # noqa: BLE001 - a backend that refuses the shapes or fails to build: reported
            rows.append({**row, "status": f"failed ({decode_bench._first_line(exc)})"})
            continue
        status = "ok" if err < MAX_REL_ERR else f"WRONG (rel_err {err:.1e})"
        rows.append({**row, "status": status, "t_us": round(t_us, 2), "tflops": cfg.flops / t_us / 1e6,
                     "rel_err": err, "vs_best_anchor": None if best is None else round(t_us / best[1], 3)})
    del sets
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"\n{'config':<7}{'impl':<16}{'us':>10}{'TFLOP/s':>9}{'rel_err':>9}{'anchor':>9}{'x best':>8}"
          f"  status")
    for row in rows:
        t_us = f"{row['t_us']:.1f}" if "t_us" in row else "-"
        tflops = f"{row['tflops']:.3g}" if "tflops" in row else "-"
        err = f"{row['rel_err']:.1e}" if "rel_err" in row else "-"
        anchor = f"{row['anchor_us']:.1f}" if row.get("anchor_us") else "-"
        ratio = f"{row['vs_best_anchor']:.2f}" if row.get("vs_best_anchor") else "-"
        print(f"{row['config']:<7}{row['impl']:<16}{t_us:>10}{tflops:>9}{err:>9}{anchor:>9}{ratio:>8}"
              f"  {row['status']}")
    goals = {row["config"]: (row["best_anchor"], row["goal_us"]) for row in rows if row.get("goal_us")}
    for config, (best, goal) in goals.items():
        print(f"{config}: best anchor {best} us; goal for tpkit <= {goal} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--small", action="store_true", help="shrunk configurations (a smoke test)")
    parser.add_argument("--only", default=None, help="comma-separated configuration names, e.g. P1,MIX")
    parser.add_argument("--impls", default=None, help="comma-separated implementations (default: all)")
    decode_bench.add_timer_args(parser, min_kv_mb=256.0)
    parser.add_argument("--impl-budget-s", type=float, default=30.0,
                        help="seconds of replays an implementation gets at most (slow ones replay less)")
    parser.add_argument("--json", type=Path, default=None,
                        help="where to write the rows (on a GPU by default "
                             "benchmarks/results/paged_prefill_h200.json)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU (--device cpu --small runs a smoke test)")
    if device.type == "cpu":
        args.replays = min(args.replays, 3)
    reason = import_error()
    have_flashinfer = reason is None and device.type == "cuda"

    baselines = load_baselines()
    configs = [c for c in configs_from(baselines, args.small)
               if args.only is None or c.name in args.only.split(",")]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        print(f"{props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, CUDA "
              f"{torch.version.cuda}; python {platform.python_version()}; FlashInfer "
              f"{'installed' if have_flashinfer else f'not installed ({reason})'}")
    else:
        print(f"CPU; torch {torch.__version__}; python {platform.python_version()} (a smoke test)")
    print(f"anchors: {baselines['gpu']}, {baselines['software']}, {baselines['measured']}")
    rows = []
    for cfg in configs:
        start = time.perf_counter()
        rows += bench_config(cfg, args, device, baselines, have_flashinfer)
        print(f"  {cfg}: KV {cfg.kv_bytes / 1e6:.1f} MB, {cfg.flops / 1e9:.1f} GFLOP "
              f"({time.perf_counter() - start:.0f} s)")
    print_table(rows)
    default = Path("benchmarks/results/paged_prefill_h200.json") if device.type == "cuda" else None
    path = args.json or default
    if path is not None:
        meta = {"device": str(device), "torch": torch.__version__, "cuda": torch.version.cuda,
                "small": args.small}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps([{**row, **meta} for row in rows], indent=1) + "\n")
        print(f"wrote {path}")
    if any(row["status"].startswith("WRONG") for row in rows):
        raise SystemExit("some outputs differ from the float32 reference")


if __name__ == "__main__":
    main()
