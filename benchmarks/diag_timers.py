"""Where a paged-attention call's time goes, block by block (GPU machine, the ``timers`` tree).

    python3 benchmarks/make_diag_trees.py --trees timers
    PYTHONPATH=benchmarks/_trees/timers python3 benchmarks/diag_timers.py C6 C3 G48L:bf16:16:16384:48:1

Each configuration (bench_paged_attention.py's names, or NAME:dtype:B:L:Hq:Hkv) runs as the benchmark runs
it: one CUDA graph that calls the op once on each of several input sets, replayed. Every call gets its own
buffer of %globaltimer stamps (the tree's kernels write one slot a block, or a warpgroup, and one a merge
block; layout in make_diag_trees.py); after the last replay the first two calls' stamps are printed, in us
from the call's first block entry, as min/10%/50%/90%/max over the blocks: when blocks enter, are released
(griddepcontrol.wait), see their first tile land, end their loop and exit, then the epilogue's steps from
the loop's end, and the merge kernel's blocks if there are any. The timer advances in steps of about
0.26 us on the H200.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_paged_attention as bench  # noqa: E402

from tpkit.ops import _extension, paged_attention  # noqa: E402

TIMER_WORDS = 12
MERGE_OFFSET = 1 << 20  # words; the merge kernel's slots, 4 words each
PHASES = (("entry", 0), ("released", 1), ("first tile", 2), ("loop end", 3), ("exit", 9))
EPILOGUE = (("warpgroups met", 3, 4), ("epilogue written", 4, 5), ("cluster barrier", 5, 6),
            ("peers' values read", 6, 7), ("second cluster barrier", 7, 8), ("to exit", 8, 9))


def _spread(values: list[float]) -> str:
    values = sorted(values)
    return "/".join(f"{values[round(q * (len(values) - 1))]:.1f}" for q in (0, 0.1, 0.5, 0.9, 1))


def _print_call(index: int, timers: torch.Tensor) -> None:
    slots = timers[:MERGE_OFFSET // TIMER_WORDS * TIMER_WORDS].view(-1, TIMER_WORDS)
    slots = slots[slots[:, 0] != 0].double()  # [blocks, TIMER_WORDS]: slots that were written
    if len(slots) == 0:
        raise SystemExit("no stamps were written: is make_diag_trees.py's timers tree first on PYTHONPATH?")
    merges = timers[MERGE_OFFSET:].view(-1, 4)
    merges = merges[merges[:, 0] != 0].double()  # [merge blocks, 4]
    t0 = slots[:, 0].min()

    def us(column: torch.Tensor) -> list[float]:
        return ((column - t0) / 1000).tolist()

    print(f"  call {index}: {len(slots)} slots on {slots[:, 10].unique().numel()} SMs, "
          f"{int(slots[:, 11].sum())} tiles")
    print("    " + " | ".join(f"{name} {_spread(us(slots[:, c]))}" for name, c in PHASES))
    streamed = slots[slots[:, 2] != 0]
    rates = streamed[:, 11] / (streamed[:, 3] - streamed[:, 2]) * 1000
    print(f"    tiles/us a slot {_spread(rates.tolist())}")
    steps = [f"{name} {_spread(((slots[:, b] - slots[:, a]) / 1000).tolist())}"
             for name, a, b in EPILOGUE if bool((slots[:, a] != 0).all() and (slots[:, b] != 0).all())]
    print("    after the loop: " + " | ".join(steps))
    if len(merges):
        print(f"    merge kernel, {len(merges)} blocks: entry {_spread(us(merges[:, 0]))} | released "
              f"{_spread(us(merges[:, 1]))} | exit {_spread(us(merges[:, 2]))}")


def _run(cfg: bench.Config) -> None:
    generator = torch.Generator(device="cuda").manual_seed(0)
    dtype = bench.DTYPES[cfg.dtype]
    kv_bytes = 2 * cfg.batch * cfg.seq_len * cfg.num_kv_heads * bench.HEAD_SIZE * dtype.itemsize
    sets = [bench._make_set(cfg, generator) for _ in range(max(1, math.ceil(512e6 / kv_bytes)))]
    timers = [torch.zeros(MERGE_OFFSET + 4 * 65536, dtype=torch.int64, device="cuda") for _ in sets]
    outs = [torch.empty_like(s.query) for s in sets]

    def call(i: int) -> None:
        # Read by the launcher at each launch, so baked into the captured graph.
        os.environ["TPKIT_DIAG_TIMERS"] = str(timers[i].data_ptr())
        s = sets[i]
        paged_attention(s.query, s.key_cache, s.value_cache, s.block_tables, s.seq_lens, out=outs[i])

    # Each replay writes every slot again, so the buffers hold the last replay's stamps.
    t_us = bench._graph_time_us([lambda i=i: call(i) for i in range(len(sets))], replays=15)
    plan = _extension.launch_plan(sets[0].query, sets[0].key_cache, sets[0].block_tables)
    print(f"{cfg.name}: {len(sets)} calls a replay, {t_us:.1f} us a call; plan {plan}")
    for i in range(min(2, len(sets))):
        _print_call(i, timers[i].cpu())


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU and the timers tree (make_diag_trees.py) on PYTHONPATH")
    configs = {c.name: c for c in bench.CONFIGS}
    for name in sys.argv[1:]:
        _run(configs[name] if name in configs else bench._parse_config(name))


if __name__ == "__main__":
    main()
