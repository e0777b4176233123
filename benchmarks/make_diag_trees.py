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
- ``fencefirst``: the warpgroup kernel waits for its tile, fences and passes its barrier before it issues
  the next tile's copies (main issues them first): whether ``fence.proxy.async`` also waits for the copies
  in flight, which would leave each warpgroup one tile in flight only while it waits.
- ``nofence``: the warpgroup kernel's loop without its proxy fence (CUTLASS's cp.async GMMA mainloop,
  ``sm90_mma_multistage_gmma_ss.hpp``, has none): what the fence costs in all; not with ``fencefirst``.
- ``noepi``: the warpgroup kernel's blocks exit after their loop: no meeting of the warpgroups, no epilogue,
  no cluster merge and no output (wrong by design): with ``main``, what the end of a block costs; with
  ``noc`` against ``diag_stream_probe.py``, what of the copies is the loop's own.
- ``timers``: main, plus per-block ``%globaltimer`` stamps written where ``TPKIT_DIAG_TIMERS`` (a device
  address, in the environment at launch or capture) points; ``diag_timers.py`` sets it and reads them.

Edits combine with ``+``: ``noc+stages`` is the copies alone with the stage count forced.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path

CSRC = Path("tpkit/csrc")


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    if text.count(old) != 1:
        raise SystemExit(f"{path}: expected one {old!r}, found {text.count(old)}; the kernel changed")
    path.write_text(text.replace(old, new))


def _no_compute(tree: Path) -> None:
    _edit(tree / CSRC / "paged_attention_mma.cuh", "    if (warp_active) {\n      for (int tok0",
          "    if (warp_active && num_tiles < 0) {\n      for (int tok0")
    wgmma = tree / CSRC / "paged_attention_wgmma.cuh"
    _edit(wgmma, "    const int tile_start = ", "    if (num_tiles < 0) {\n    const int tile_start = ")
    _edit(wgmma, "    wgmma_wait<0>();  // the stage is refilled after the barrier below\n",
          "    wgmma_wait<0>();  // the stage is refilled after the barrier below\n    }\n")


def _no_loads(tree: Path) -> None:
    for name in ("paged_attention_mma.cuh", "paged_attention_wgmma.cuh"):
        _edit(tree / CSRC / name, "issue_tile(next, ", "if (next < num_stages - 1) issue_tile(next, ")


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


def _fence_first(tree: Path) -> None:
    issue = ("    if (next < num_tiles) issue_tile(next, stage == 0 ? num_stages - 1 : stage - 1);\n"
             "    cp_async_commit();\n")
    wait = "    cp_async_wait_dynamic(num_stages - {}); "
    ready = (" // this tile (and, the first time, the query) has landed\n"
             "    fence_proxy_async_shared();             // ... and is visible to wgmma\n"
             "    warpgroup_sync();\n")
    _edit(tree / CSRC / "paged_attention_wgmma.cuh", issue + wait.format(1) + ready,
          wait.format(2) + ready + issue)


def _no_fence(tree: Path) -> None:
    _edit(tree / CSRC / "paged_attention_wgmma.cuh",
          "    fence_proxy_async_shared();             // ... and is visible to wgmma\n", "")


def _no_epilogue(tree: Path) -> None:
    _edit(tree / CSRC / "paged_attention_wgmma.cuh", "the stage buffers become the cluster merge's\n"
          "  grid_launch_dependents();\n", "the stage buffers become the cluster merge's\n"
          "  grid_launch_dependents();\n  if (num_tiles >= 0) return;\n")


def _no_merge_kernel(tree: Path) -> None:
    _edit(tree / CSRC / "paged_attention_launch.cuh",
          "  if (a->num_partitions <= 1 || a->cluster_merge) return cudaSuccess;\n",
          "  if (a->num_partitions > 0) return cudaSuccess;\n")


# The stamps of the "timers" tree: a block's (warpgroup's) slot of kTimerWords words at
# ((z * gridDim.y + y) * gridDim.x + x) * warpgroups + warpgroup, a merge block's 4 at kTimerMergeOffset + its
# index. Slot words: entry, released (after griddepcontrol.wait), first tile landed, loop end, warpgroups
# met, epilogue written, cluster barrier passed, peers' values read, second cluster barrier passed, exit,
# %smid, tiles. diag_timers.py reads the same layout.
_TIMER_HELPERS = """#include "paged_attention.h"

namespace tpkit {
constexpr int kTimerWords = 12;
constexpr long long kTimerMergeOffset = 1 << 20;
__device__ __forceinline__ unsigned long long diag_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned diag_smid() {
  unsigned r;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void diag_write(const tpkit_paged_attention_args& p, int sub, int subs,
                                           const unsigned long long* stamps, int tiles) {
  if (p.diag_timers == nullptr) return;
  const long long block = (static_cast<long long>(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x +
                          blockIdx.x;
  unsigned long long* w = p.diag_timers + (block * subs + sub) * kTimerWords;
  for (int i = 0; i < 9; ++i) w[i] = stamps[i];
  w[9] = diag_now();
  w[10] = diag_smid();
  w[11] = tiles;
}
__device__ __forceinline__ void diag_write_merge(const tpkit_paged_attention_args& p,
                                                 unsigned long long entry, unsigned long long released) {
  if (threadIdx.x != 0 || p.diag_timers == nullptr) return;
  unsigned long long* w = p.diag_timers + kTimerMergeOffset + (blockIdx.y * gridDim.x + blockIdx.x) * 4;
  w[0] = entry;
  w[1] = released;
  w[2] = diag_now();
  w[3] = diag_smid();
}
}  // namespace tpkit
"""
_TIMERS_FROM_ENV = """  tpkit_paged_attention_args timed = *args;
  const char* timers = getenv("TPKIT_DIAG_TIMERS");
  timed.diag_timers = timers ? reinterpret_cast<unsigned long long*>(strtoull(timers, nullptr, 10)) : nullptr;
  const tpkit_paged_attention_args* a = &timed;
"""


def _after(path: Path, anchor: str, text: str) -> None:
    _edit(path, anchor, anchor + text)


def _before_next(path: Path, start: str, token: str, text: str) -> None:
    """Inserts `text` before the first `token` after `start` (one of each): an argument list's end."""
    source = path.read_text()
    if source.count(start) != 1:
        raise SystemExit(f"{path}: expected one {start!r}, found {source.count(start)}; the kernel changed")
    at = source.index(token, source.index(start))
    path.write_text(source[:at] + text + source[at:])


def _timers(tree: Path) -> None:
    _edit(tree / CSRC / "paged_attention.h", "} tpkit_paged_attention_args;",
          "  unsigned long long* diag_timers;\n} tpkit_paged_attention_args;")
    ptx = tree / CSRC / "ptx.cuh"
    ptx.write_text(ptx.read_text() + _TIMER_HELPERS)
    api = tree / CSRC / "paged_attention_api.cu"
    _after(api, "#include <algorithm>\n", "#include <cstdlib>\n")
    _edit(api, "tpkit_paged_attention_launch(const tpkit_paged_attention_args* a, cudaStream_t stream) {\n",
          "tpkit_paged_attention_launch(const tpkit_paged_attention_args* args, cudaStream_t stream) {\n"
          + _TIMERS_FROM_ENV)
    start = ("  unsigned long long stamps[9] = {diag_now()};\n  int diag_tiles = 0;\n"
             "  grid_wait_primary();\n  stamps[1] = diag_now();\n")
    first_tile = "    if (tile == 0) stamps[2] = diag_now();\n    diag_tiles = tile + 1;\n"
    mma = tree / CSRC / "paged_attention_mma.cuh"
    _before_next(mma, "RowOut row_out, OutRow out_row", ") {", ", unsigned long long* stamps = nullptr")
    _after(mma, "  cluster_sync_shared();  // every partition's row_out and row_lse are written\n",
           "  if (stamps) stamps[0] = diag_now();\n")
    _edit(mma, "  cluster_sync_exit();  // no block exits while another still reads its shared memory\n",
          "  if (stamps) stamps[1] = diag_now();\n"
          "  cluster_sync_exit();  // no block exits while another still reads its shared memory\n"
          "  if (stamps) stamps[2] = diag_now();\n")
    _edit(mma, "  grid_wait_primary();\n  // Issued first;", start + "  // Issued first;")
    _after(mma, "    cp_async_wait_dynamic(num_stages - 1);\n    __syncthreads();\n", first_tile)
    _after(mma, "// trailing (empty) groups; the stage buffers become the epilogue's\n",
           "  stamps[3] = stamps[4] = diag_now();\n")
    _before_next(mma, "  if (cluster) merge_in_cluster<HEAD, float>(", ");", ", stamps + 6")
    _after(mma, ", stamps + 6);\n", "  if (tid == 0) diag_write(p, 0, 1, stamps, diag_tiles);\n")
    _edit(mma, "  if (cluster) merge_in_cluster<HEAD, float>(",
          "  stamps[5] = diag_now();\n  if (cluster) merge_in_cluster<HEAD, float>(")
    wgmma = tree / CSRC / "paged_attention_wgmma.cuh"
    _edit(wgmma, "  grid_wait_primary();\n  const int seq_len_read", start + "  const int seq_len_read")
    _after(wgmma, "// ... and is visible to wgmma\n    warpgroup_sync();\n", first_tile)
    _after(wgmma, "the stage buffers become the cluster merge's\n", "  stamps[3] = diag_now();\n")
    _edit(wgmma, "  // Epilogue, from registers:",
          "  stamps[4] = diag_now();\n  // Epilogue, from registers:")
    _edit(wgmma, "  if (cluster) {\n    merge_in_cluster<kWgmmaHead, T>",
          "  stamps[5] = diag_now();\n  if (cluster) {\n    merge_in_cluster<kWgmmaHead, T>")
    _before_next(wgmma, "    merge_in_cluster<kWgmmaHead, T>(", ");", ", stamps + 6")
    _after(wgmma, ", stamps + 6);\n  }\n",
           "  if (tid == 0) diag_write(p, wg, WARPGROUPS, stamps, diag_tiles);\n")
    merge = tree / CSRC / "paged_attention_merge.cuh"
    _edit(merge, "  grid_wait_primary();\n  if (head >= p.num_heads) return;",
          "  const unsigned long long entry = diag_now();\n  grid_wait_primary();\n"
          "  const unsigned long long released = diag_now();\n  if (head >= p.num_heads) return;")
    _edit(merge, "acc.w * inv));\n  }\n}", "acc.w * inv));\n  }\n  diag_write_merge(p, entry, released);\n}")

EDITS = {"noc": _no_compute, "nold": _no_loads, "stages": _forced_stages, "partitions": _forced_partitions,
         "notiles": _no_tiles, "nomerge": _no_merge_kernel, "noepi": _no_epilogue,
         "fencefirst": _fence_first, "nofence": _no_fence, "timers": _timers}


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
