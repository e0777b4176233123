"""tpkit's paged attention with other page sizes and page orders than the benchmark's (on a GPU).

    PYTHONPATH=. python3 tools/diag_paged_layout.py C6:16:random C6:16:in-order C6:32:random

Each case is CONFIG:BLOCK_SIZE:ORDER, CONFIG one of bench_paged_attention.py's (C1..C6, or G48L = bf16
B=16 L=16384 Hq=48 Hkv=1, S64 = fp16 B=8 L=64 Hq=48 Hkv=1), BLOCK_SIZE 8, 16 or 32, ORDER ``random`` (the
benchmark's permutation of the pages) or ``in-order`` (each sequence's pages consecutive in memory).
Inputs, rotation and timing are the benchmark's own; one line a case: time, GB/s, and the error against its
float32 reference.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_paged_attention as bench  # noqa: E402

CONFIGS = {c.name: c for c in bench.CONFIGS}
CONFIGS["G48L"] = bench.Config("G48L", "bf16", 16, 16384, 48, 1)
CONFIGS["S64"] = bench.Config("S64", "fp16", 8, 64, 48, 1)


def _run(case: str) -> None:
    name, block_size, order = case.split(":")
    if name not in CONFIGS or block_size not in ("8", "16", "32") or order not in ("random", "in-order"):
        raise SystemExit(f"expected CONFIG:BLOCK_SIZE:ORDER with CONFIG in {list(CONFIGS)}, BLOCK_SIZE 8, 16 "
                         f"or 32 and ORDER random or in-order, got {case!r}")
    cfg = CONFIGS[name]
    bench.BLOCK_SIZE = int(block_size)  # the benchmark's helpers read their page size from here
    generator = torch.Generator(device="cuda").manual_seed(0)
    sets = [bench._make_set(cfg, generator) for _ in range(-(-512_000_000 // cfg.kv_bytes))]
    if order == "in-order":
        for s in sets:
            s.block_tables = torch.arange(s.block_tables.numel(), device="cuda",
                                          dtype=torch.int32).view_as(s.block_tables)
    ref = bench._reference(sets[0])
    calls = [bench._tpkit_call(s) for s in sets]
    err = bench._rel_err(calls[0](), ref)
    t_us = bench._graph_time_us(calls, 30)
    print(f"{case:<20} {t_us:8.1f} us  {cfg.kv_bytes / t_us / 1e3:6.0f} GB/s  rel_err {err:.1e}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) < 2 or not torch.cuda.is_available():
        raise SystemExit(__doc__)
    for case in sys.argv[1:]:
        _run(case)
        torch.cuda.empty_cache()
