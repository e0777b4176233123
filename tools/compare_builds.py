"""Interleaved timing of the paged-attention kernels built from several source trees (on a GPU).

    git archive main tpkit | tar -x -C /tmp/main
    python3 tools/compare_builds.py --tree main=/tmp/main --tree new=. --rounds 2 -- \
        --impls tpkit --flex-budget-s 0 --config S64:fp16:8:64:48:1

A tree is a directory holding a ``tpkit`` package. Every tree's extension is built into its own
TORCH_EXTENSIONS_DIR, all at once; then ``benchmarks/bench_paged_attention.py`` runs once per tree per round
with that tree first on PYTHONPATH, the trees taking turns (in the reverse order every other round), so
drifts of the GPU's clock and of the machine hit them alike. Prints, per configuration and tree, the mean
time in us and each run's; the JSON of every run is kept under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUILD = "import torch; from tpkit.ops import _extension; _extension.build(torch.cuda.get_device_capability())"


def _parse_tree(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not name or not (Path(path) / "tpkit").is_dir():
        raise argparse.ArgumentTypeError(f"expected NAME=DIR with DIR/tpkit a directory, got "
                                         f"{text!r}")
    return name, Path(path).resolve()


def _env(name: str, tree: Path, out: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{ROOT}", "PYTHONUNBUFFERED": "1",
            "TORCH_EXTENSIONS_DIR": str(out / f"extensions_{name}")}


def _build(name: str, tree: Path, out: Path) -> tuple[str, int]:
    with open(out / f"build_{name}.log", "w") as log:
        return name, subprocess.run([sys.executable, "-c", BUILD], env=_env(name, tree, out), stdout=log,
                                    stderr=subprocess.STDOUT, check=False).returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", type=_parse_tree, required=True,
                        help="NAME=DIR, repeatable")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("/tmp/tpkit_compare_builds"))
    parser.add_argument("bench_args", nargs=argparse.REMAINDER, help="after --: bench_paged_attention.py's")
    args = parser.parse_args()
    trees = dict(args.tree)
    if len(trees) != len(args.tree):
        parser.error("--tree: every NAME must be different")
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    args.out.mkdir(parents=True, exist_ok=True)
    with ThreadPoolExecutor(len(trees)) as pool:
        failed = [name for name, rc in pool.map(lambda item: _build(*item, args.out), trees.items()) if rc]
    if failed:
        print(f"build failed for {', '.join(failed)} (logs in {args.out})", file=sys.stderr)
        return 1
    # config -> column (a tree, or another implementation in a tree's run) -> us of each run
    times: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for round_index in range(args.rounds):
        # The order flips each round: the tree that runs second in a round has run slower.
        order = list(trees.items())
        for name, tree in order[::-1] if round_index % 2 else order:
            result = args.out / f"bench_{name}_{round_index}.json"
            with open(args.out / f"bench_{name}_{round_index}.log", "w") as log:
                rc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_paged_attention.py"),
                                     *bench_args, "--json", str(result)], env=_env(name, tree, args.out),
                                    stdout=log, stderr=subprocess.STDOUT, check=False).returncode
            print(f"round {round_index + 1}, {name}: rc {rc}", flush=True)
            if rc == 0:
                for row in json.loads(result.read_text()):
                    if row["t_us"] is None:  # an implementation that did not run (its status says why)
                        continue
                    column = name if row["impl"] == "tpkit" else f"{row['impl']} ({name})"
                    times[row["config"]][column].append(row["t_us"])
    columns = list(dict.fromkeys(column for per_config in times.values() for column in per_config))
    print("config  " + "".join(f"{column:>24}" for column in columns))
    for config, per_config in times.items():
        cells = []
        for column in columns:
            runs = per_config.get(column, [])
            text = f"{statistics.fmean(runs):.1f} ({'/'.join(f'{t:.1f}' for t in runs)})" if runs else "-"
            cells.append(f"{text:>24}")
        print(f"{config:<8}" + "".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
