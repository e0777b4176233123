"""Writes diagnostic source trees of the paged-attention kernels, for ``compare_builds.py`` (GPU machine).

    python3 benchmarks/make_diag_trees.py --rev HEAD --out benchmarks/_trees
    python3 benchmarks/compare_builds.py --tree main=benchmarks/_trees/main --tree noc=benchmarks/_trees/noc \
        --tree nold=benchmarks/_trees/nold --rounds 1 -- --impls tpkit --flex-budget-s 0

Each tree is ``git archive REV tpkit`` with one edit; the outputs of ``noc`` and ``nold`` are wrong by
design, only their times mean something:

- ``main``: unchanged.
- ``noc`` (copies only): both kernels' loops issue and wait for every copy and pass every barrier, but
  run no ``mma``/``wgmma`` and no softmax: the copy pipeline's time.
- ``nold`` (arithmetic only): no copies after the prologue's; the products and the softmax run on what
  the stages hold: the time of the arithmetic and the barriers.
- ``stages``: main, but ``TPKIT_DIAG_STAGES=N`` in the environment forces the warpgroup kernel's stage
  count (resident blocks follow from the occupancy API).
- ``partitions``: main, but ``TPKIT_DIAG_PARTITIONS=N`` forces the split into N partitions (or the fewest
  that hold the same partition size); the cluster merge still takes splits of up to 8 that fit.
- ``notiles``: every block does all but its tiles: it starts (block table, query), runs no tile, writes
  its (meaningless) result, and the merge runs: a wave's fixed cost with no bytes streamed.
- ``nomerge``: the merge kernel is not launched (a cluster merge still runs inside the attention kernel):
  with ``main``, what the merge kernel costs.

Edits combine with ``+``: ``noc+stages`` is the copies alone with the stage count forced.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path

CSRC = Path("tpkit/attention/csrc")


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    if text.count(old) != 1:
        raise SystemExit(f"{path}: expected one {old!r}, found {text.count(old)}; the kernel changed")
    path.write_text(text.replace(old, new))


def _no_compute(tree: Path) -> None:
    _edit(tree / CSRC / "paged_attention_mma.cuh", "    if (warp_active) {\n      for (int tok0",
          "    if (warp_active && num_tiles < 0) {\n      for (int tok0")
    wgmma = tree / CSRC / "paged_attention_wgmma.cuh"
    tile_start = "    const int tile_start = start + (tile * WARPGROUPS + wg) * kTileTokens;\n"
    _edit(wgmma, tile_start, "    if (num_tiles < 0) {\n" + tile_start)
    _edit(wgmma, "    wgmma_wait<0>();  // the stage is refilled after the barrier below\n",
          "    wgmma_wait<0>();  // the stage is refilled after the barrier below\n    }\n")


def _no_loads(tree: Path) -> None:
    for name in ("paged_attention_mma.cuh", "paged_attention_wgmma.cuh"):
        _edit(tree / CSRC / name, "if (next < num_tiles) issue_tile(",
              "if (next < num_tiles && next < num_stages - 1) issue_tile(")


def _forced_stages(tree: Path) -> None:
    launch = tree / CSRC / "paged_attention_launch.cuh"
    _edit(launch, "#include <algorithm>\n", "#include <algorithm>\n#include <cstdlib>\n")
    _edit(launch, """                        &smem, &blocks_per_sm);
  if (err != cudaSuccess) return err;
  a->m_groups = ceil_div(a->group_size, kWgmmaRows);""", """                        &smem, &blocks_per_sm);
  if (err != cudaSuccess) return err;
  if (const char* forced = getenv("TPKIT_DIAG_STAGES")) {
    stages = atoi(forced);
    smem = wgmma_smem_bytes<T>(stages, 1);
    if ((err = kernel_occupancy(kernel, kWgmmaThreads, smem, &blocks_per_sm)) != cudaSuccess) return err;
  }
  a->m_groups = ceil_div(a->group_size, kWgmmaRows);""")


def _forced_partitions(tree: Path) -> None:
    api = tree / CSRC / "paged_attention_api.cu"
    _edit(api, "#include <algorithm>\n", "#include <algorithm>\n#include <cstdlib>\n")
    _edit(api, """  a->num_partitions = best_partitions;
  a->partition_size = best_tiles * kPlanTile;""",
          """  if (const char* forced = getenv("TPKIT_DIAG_PARTITIONS")) {
    best_tiles = (max_tiles + atoi(forced) - 1) / atoi(forced);
    best_partitions = (max_tiles + best_tiles - 1) / best_tiles;
  }
  a->num_partitions = best_partitions;
  a->partition_size = best_tiles * kPlanTile;""")


def _no_tiles(tree: Path) -> None:
    for name, count in (("paged_attention_mma.cuh", "num_tiles"),
                        ("paged_attention_wgmma.cuh", "block_tiles")):
        _edit(tree / CSRC / name,
              f"  const int {count} = end > start ? (end - start + kTileTokens - 1) / kTileTokens : 0;\n",
              f"  const int {count} = 0;\n")


def _no_merge_kernel(tree: Path) -> None:
    _edit(tree / CSRC / "paged_attention_launch.cuh",
          "  if (a->num_partitions <= 1 || a->cluster_merge) return cudaSuccess;\n",
          "  if (a->num_partitions > 0) return cudaSuccess;\n")


EDITS = {"noc": _no_compute, "nold": _no_loads, "stages": _forced_stages, "partitions": _forced_partitions,
         "notiles": _no_tiles, "nomerge": _no_merge_kernel}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rev", default="HEAD", help="the git revision to start from")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/_trees"))
    parser.add_argument("--trees", default="main,noc,nold,noc+stages",
                        help=f"comma-separated: main, or edits of {list(EDITS)} joined by +")
    args = parser.parse_args()
    for name in args.trees.split(","):
        edits = [] if name == "main" else name.split("+")
        if not all(edit in EDITS for edit in edits):
            parser.error(f"--trees: expected main or edits of {list(EDITS)} joined by +, got {name!r}")
        tree = args.out / name
        shutil.rmtree(tree, ignore_errors=True)
        tree.mkdir(parents=True)
        archive = subprocess.run(["git", "archive", args.rev, "tpkit"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
        for edit in edits:
            EDITS[edit](tree)
        print(f"wrote {tree}")


if __name__ == "__main__":
    main()
