"""Where tpkit's loading into a GPU spends its time (on a GPU).

    PYTHONPATH=. python3 tools/profile_loader.py [--variant NAME:ENV=VALUE,...] [--size-gb 2]

Makes the Llama-shaped checkpoint of ``bench_loader.py``, reads it into the page cache, then for each
variant (environment settings, e.g. ``t4:TPKIT_LOAD_THREADS=4``) starts a fresh process that builds a tpkit
``LlamaForCausalLM`` on ``cuda:0`` (``--device``) and loads the checkpoint into it ``--loads`` times. Per
load it prints the wall time and, per stage, the calls and their time summed over the loading threads (so
with several threads the sums can exceed the wall time; a stage's sum growing with the threads is
contention):

- ``plan.add``: pairing checkpoint tensors with parameters (before any copy);
- ``_full``: mapping a tensor's bytes (one private map per tensor); ``_take``: a part's read-ahead advice;
- ``copy_file_range``: direct copies from the page cache, with ``register`` and ``unregister`` (the
  driver's page-locking calls) and ``release`` (waiting for a file's copies, then unlocking its pages);
- ``make_room``: unpinning the oldest pieces, with ``wait`` (for their copies) and ``drop_pages``;
- ``staged _copy_into``: copies through page-locked buffers;
- ``_run_loads``: one parameter's weight loaders, all of the above included;
- ``build`` (with ``PROFILE_FROM_PRETRAINED=1``): the model's construction inside ``from_pretrained``, and
  ``_execute``: the copies of ``load_weights`` after its checks.

The default variants are 1, 2 and 4 threads with direct copies and 4 threads without them. A variant may
also set ``PROFILE_MAX_PINNED_MIB`` (how many MiB a loading keeps page-locked) and
``PROFILE_FROM_PRETRAINED=1`` (each load a ``tpkit.models.from_pretrained`` call, the model built inside
the timed call), ``PROFILE_CPUS`` (the CPUs the process may run on, as ``taskset`` takes them: ``0-7,16``)
and ``PROFILE_CPROFILE=1`` (the last load under cProfile: the 25 functions of most own time are printed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

DEFAULT_VARIANTS = ["t1:TPKIT_LOAD_THREADS=1", "t2:TPKIT_LOAD_THREADS=2", "t4:TPKIT_LOAD_THREADS=4",
                    "staged-t4:TPKIT_LOAD_THREADS=4,TPKIT_LOAD_DMA=0"]


def _parse_variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, settings = text.partition(":")
    env = dict(setting.split("=", 1) for setting in settings.split(",") if "=" in setting)
    if not name or (settings and len(env) != len(settings.split(","))):
        raise argparse.ArgumentTypeError(f"expected NAME:ENV=VALUE[,ENV=VALUE...], got {text!r}")
    return name, env


def _cpu_list(text: str) -> set[int]:
    cpus: set[int] = set()
    for part in text.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def _child(path: str, name: str, loads: int, device: str) -> None:
    """Loads ``path`` into a tpkit Llama on ``device`` ``loads`` times, with the stages timed."""
    if os.environ.get("PROFILE_CPUS"):
        # Before torch starts its threads, so that they inherit it.
        os.sched_setaffinity(0, _cpu_list(os.environ["PROFILE_CPUS"]))
    import cProfile
    import pstats

    import torch

    from tpkit.loaders import _direct_copy, _staging, iter_weights, lazy_tensor, load, resolve_checkpoint
    from tpkit.models import LlamaForCausalLM, auto, from_pretrained
    from tpkit.parallel_layers import init_tensor_parallel

    stats: dict[str, tuple[int, float]] = {}
    lock = threading.Lock()

    def timed(stage: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                with lock:
                    calls, seconds = stats.get(stage, (0, 0.0))
                    stats[stage] = (calls + 1, seconds + time.perf_counter() - start)
        return wrapper

    # The driver calls are looked up on each use, so wrapping the module's functions times them all.
    _direct_copy._cuda_register = timed("register", _direct_copy._cuda_register)
    _direct_copy._cuda_unregister = timed("unregister", _direct_copy._cuda_unregister)
    _direct_copy.copy_file_range = timed("copy_file_range", _direct_copy.copy_file_range)
    _direct_copy.DirectCopies.release = timed("release", _direct_copy.DirectCopies.release)
    _direct_copy.DirectCopies._make_room = timed("make_room", _direct_copy.DirectCopies._make_room)
    _direct_copy._Piece.wait = timed("wait", _direct_copy._Piece.wait)
    _direct_copy._MappedFile.drop_pages = timed("drop_pages", _direct_copy._MappedFile.drop_pages)
    if os.environ.get("PROFILE_MAX_PINNED_MIB"):
        _direct_copy._MAX_PINNED_BYTES = int(os.environ["PROFILE_MAX_PINNED_MIB"]) * 2**20
    _staging.copy_into = timed("staged _copy_into", _staging.copy_into)
    handle = lazy_tensor._SafetensorsTensor
    handle._full = timed("_full", handle._full)
    handle._take = timed("_take", handle._take)
    load._Plan.add = timed("plan.add", load._Plan.add)
    load._run_loads = timed("_run_loads", load._run_loads)
    load._execute = timed("_execute", load._execute)
    auto.MODEL_CLASSES = {key: timed("build", cls) for key, cls in auto.MODEL_CLASSES.items()}

    init_tensor_parallel(1)
    config = json.loads((Path(path) / "config.json").read_text())
    build_in_call = os.environ.get("PROFILE_FROM_PRETRAINED") == "1"
    model = None if build_in_call else LlamaForCausalLM(config, dtype=torch.bfloat16, device=device)
    synchronize = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    profiler = cProfile.Profile() if os.environ.get("PROFILE_CPROFILE") == "1" else None
    for attempt in range(loads):
        stats.clear()
        synchronize()
        profiling = profiler is not None and attempt == loads - 1
        if profiling:
            profiler.enable()
        start = time.perf_counter()
        if build_in_call:
            model = from_pretrained(path, dtype=torch.bfloat16, device=device)
        else:
            model.load_weights(iter_weights(resolve_checkpoint(path)))
        synchronize()
        wall = time.perf_counter() - start
        if profiling:
            profiler.disable()
        stages = "; ".join(f"{stage} {calls}x {seconds * 1e3:.1f} ms"
                           for stage, (calls, seconds) in sorted(stats.items()))
        print(f"{name} load {attempt}: {wall * 1e3:.1f} ms (direct copies failed: "
              f"{_direct_copy._State.failed}); {stages}", flush=True)
        if build_in_call:
            model = None
    if profiler is not None:
        print(f"{name}: cProfile of load {loads - 1}, by own time", flush=True)
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(25)
        sys.stdout.flush()
    # Field 39 of /proc/PID/stat, the 37th after the command's closing parenthesis: the CPU it last ran on.
    last_cpu = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[36]
    print(f"{name}: may run on CPUs {sorted(os.sched_getaffinity(0))}, last ran on {last_cpu}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", action="append", type=_parse_variant, default=None,
                        help="NAME:ENV=VALUE,... (repeatable; default: " + " ".join(DEFAULT_VARIANTS) + ")")
    parser.add_argument("--size-gb", type=float, default=2.0)
    parser.add_argument("--loads", type=int, default=2, help="loads per process (the first pays warm-ups)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="where the model lives (cpu: to try the script without a GPU)")
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temp dir)")
    parser.add_argument("--child", nargs=2, metavar=("PATH", "NAME"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(*args.child, args.loads, args.device)
        return
    import bench_loader

    variants = args.variant or [_parse_variant(text) for text in DEFAULT_VARIANTS]
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="profile_loader_") as tmp:
        start = time.perf_counter()
        bench_loader.make_checkpoint(Path(tmp), bench_loader.llama_config(args.size_gb,
                                                                          bench_loader.FULL_SHAPE))
        print(f"checkpoint made in {time.perf_counter() - start:.1f} s", flush=True)
        bench_loader.prepare_page_cache(Path(tmp), cold=False)
        for name, env in variants:
            command = [sys.executable, __file__, "--loads", str(args.loads), "--device", args.device,
                       "--child", tmp, name]
            subprocess.run(command, env={**os.environ, "TPKIT_DISABLE_PROGRESS": "1", **env}, check=True)


if __name__ == "__main__":
    main()
