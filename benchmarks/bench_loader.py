"""Checkpoint loading: tpkit.loaders against safetensors ``load_file`` and transformers ``from_pretrained``.

Makes a Llama-shaped checkpoint of random bf16 weights (about 2 GB, sharded through
``model.safetensors.index.json`` as transformers saves big models), then loads it with each contender, every
load in a fresh process (a first load, as users see it; peak memory its own). The contenders take turns for
``--rounds`` rounds and each one's best round counts (the cores of a shared machine come and go):

- ``load_file``: ``safetensors.torch.load_file`` file by file, copied into a transformers Llama with
  ``load_state_dict``;
- ``from_pretrained``: ``transformers.LlamaForCausalLM.from_pretrained(path, dtype=bfloat16)``;
- ``tpkit from_pretrained``: ``tpkit.models.from_pretrained(path, dtype=bfloat16, device="cpu")``, the
  counterpart of transformers' (the model built without random draws, then loaded);
- ``tpkit``: ``tpkit.models.LlamaForCausalLM.load_weights(iter_weights(path))`` into a model built before
  the clock, at tp_size 1, and at tp_size 2 on two spawned CPU ranks (gloo), each reading only its shard.

Each contender (and rank) gets two times: ``call``, until its loading call returns, and ``resident``, the call
plus one pass that reads every byte of every parameter (``max`` over its bytes), the same pass for all. They
differ for ``from_pretrained``: transformers 5 leaves the parameters as views of private memory maps of the
files (the "in file maps" column counts the parameter bytes that lie in a mapping of a ``*.safetensors``
file), so when its call returns the bytes are not in the parameters' memory yet (RSS at return near zero;
from a cold page cache the call still reads much of the files into the page cache) and the pass faults them
in. ``load_file`` alone would do the same, which is why it is followed by ``load_state_dict`` into a model
whose parameters are resident. The goals are judged on resident times.

Goals: tpkit's throughput at tp_size 1 at least ``load_file``'s (both into a built model); tpkit's
``from_pretrained`` at least 2x faster than transformers'; each rank's peak memory under 1.2x the bytes of
its shard. Peak RSS is the highest RSS from the start of loading to the end of the pass, less the RSS before
the model existed (so it holds the model and what loading adds; file pages mapped into the process count).
The ``load_file`` and ``tpkit`` contenders build their model before the clock starts (its time is printed
apart); both ``from_pretrained`` build theirs inside the call.

Page cache: warm by default (every checkpoint file is read just before each contender starts); ``--cold``
syncs and drops the page cache before each contender instead (it needs write access to
/proc/sys/vm/drop_caches). Every process computes with the same number of torch threads (one by default:
on a machine whose cores are busy, a starved OpenMP thread stalls every tensor copy); the loaders' own
thread pools keep their defaults: transformers', and tpkit's (``load_weights`` copies on up to 4 threads,
fewer where there are fewer CPUs; ``TPKIT_LOAD_THREADS`` sets it). Progress bars are off for all.

    python benchmarks/bench_loader.py              # ~2 GB, tp_size 1 and 2, warm page cache
    python benchmarks/bench_loader.py --cold       # the page cache dropped before each contender
    python benchmarks/bench_loader.py --small      # ~100 MB, a quick check (writes no results file)
    python3 benchmarks/bench_loader.py --device cuda --tp-sizes 1,2   # into GPUs: rank r on cuda:r, NCCL

With ``--device cuda`` every contender loads onto the GPU (rank r of tp_size N onto ``cuda:r``, over
NCCL): ``load_file(file, device=...)`` then ``load_state_dict``, ``from_pretrained(..., device_map=...)``,
and tpkit's two into models on that GPU. There every loader copies each byte to the device, so call and
resident times are the same (the call ends with a synchronize). The memory columns add the GPU's peak
allocated bytes during loading (above what the model held before it) over the shard, next to the host's
peak RSS.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import multiprocessing as mp
import os
import platform
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import safetensors
import torch
import torch.distributed as dist
import transformers
from packaging.version import Version
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlamaForCausalLM

from tpkit.loaders import bytes_read, iter_weights, resolve_checkpoint
from tpkit.models import LlamaForCausalLM, from_pretrained
from tpkit.parallel_layers import destroy_tensor_parallel, init_tensor_parallel

GB = 1e9
# TinyLlama-1.1B's shapes; the layer count is chosen to reach the requested size.
FULL_SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=4,
                  vocab_size=32000)
SMALL_SHAPE = dict(hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=4,
                   vocab_size=32000)
MAX_SHARD_BYTES = 512 * 2**20
# transformers renamed torch_dtype to dtype in 4.56.
DTYPE_ARG = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
DROP_CACHES = Path("/proc/sys/vm/drop_caches")
RESULTS = Path(__file__).parent / "results"
LOAD_FILE = "load_file + load_state_dict"
FROM_PRETRAINED = f"transformers {transformers.__version__} from_pretrained"
TPKIT_FROM_PRETRAINED = "tpkit from_pretrained, tp_size 1"


def llama_config(size_gb: float, shape: dict[str, int]) -> LlamaConfig:
    h, inter, heads = shape["hidden_size"], shape["intermediate_size"], shape["num_attention_heads"]
    kv, vocab = shape["num_key_value_heads"], shape["vocab_size"]
    kv_size = h // heads * kv
    per_layer = 2 * (2 * h * h + 2 * h * kv_size + 3 * h * inter + 2 * h)  # bf16 bytes
    outside = 2 * (2 * vocab * h + h)
    layers = max(1, round((size_gb * GB - outside) / per_layer))
    return LlamaConfig(**shape, num_hidden_layers=layers, max_position_embeddings=2048, rms_norm_eps=1e-5,
                       tie_word_embeddings=False, architectures=["LlamaForCausalLM"],
                       **{DTYPE_ARG: "bfloat16"})


def make_checkpoint(path: Path, config: LlamaConfig, seed: int = 0) -> int:
    """Writes random bf16 weights in transformers' names and layout; returns the bytes of tensor data."""
    h, inter = config.hidden_size, config.intermediate_size
    kv_size = h // config.num_attention_heads * config.num_key_value_heads
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv_size, h),
                       p + "self_attn.v_proj.weight": (kv_size, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    shapes.update({"model.norm.weight": (h,), "lm_head.weight": (config.vocab_size, h)})
    groups: list[list[str]] = [[]]
    group_bytes = 0
    for name, shape in shapes.items():
        nbytes = 2 * torch.Size(shape).numel()
        if groups[-1] and group_bytes + nbytes > MAX_SHARD_BYTES:
            groups.append([])
            group_bytes = 0
        groups[-1].append(name)
        group_bytes += nbytes
    generator = torch.Generator().manual_seed(seed)
    weight_map = {}
    for index, names in enumerate(groups, start=1):
        file = f"model-{index:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: torch.randn(shapes[n], dtype=torch.bfloat16, generator=generator) for n in names},
                  path / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    total = sum(2 * torch.Size(s).numel() for s in shapes.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    config.save_pretrained(path)
    return total


# --- contenders, each loading once in its own process

def job_load_file(path: str, device: str) -> dict[str, Any]:
    build_start = time.perf_counter()
    config = LlamaConfig.from_pretrained(path)
    with torch.device("meta"):
        model = HFLlamaForCausalLM(config).to(torch.bfloat16)
    model.to_empty(device=device)
    with torch.no_grad():
        # Resident, like the tpkit model after its initialisation: first-touch page faults are no part of
        # loading for either.
        for param in model.parameters():
            param.zero_()
    build = time.perf_counter() - build_start
    start = _start_loading(device)
    loaded: set[str] = set()
    nbytes = 0
    for file in sorted(Path(path).glob("*.safetensors")):
        state = load_file(file, device=device)
        model.load_state_dict(state, strict=False)
        loaded.update(state)
        nbytes += sum(t.numel() * t.element_size() for t in state.values())
        del state
    call = _end_call(start, device)
    assert loaded == set(model.state_dict()) - {k for k, _ in model.named_buffers()}, "keys left unloaded"
    return dict(contender=LOAD_FILE, bytes=nbytes, build=build, **_after_call(model, call))


def job_from_pretrained(path: str, device: str) -> dict[str, Any]:
    start = _start_loading(device)
    on_gpu = {} if device == "cpu" else {"device_map": device}
    model = HFLlamaForCausalLM.from_pretrained(path, **{DTYPE_ARG: torch.bfloat16}, **on_gpu)
    call = _end_call(start, device)
    return dict(contender=FROM_PRETRAINED, bytes=_param_bytes(model), build=None, **_after_call(model, call))


def job_tpkit(path: str, device: str, tp_size: int) -> dict[str, Any]:
    init_tensor_parallel(tp_size)
    config = json.loads((Path(path) / "config.json").read_text())
    build_start = time.perf_counter()
    # Initialised, like load_file's model: the parameters' pages are in memory before the clock starts.
    model = LlamaForCausalLM(config, dtype=torch.bfloat16, device=device)
    build = time.perf_counter() - build_start
    if dist.is_initialized():
        dist.barrier()
    read_before = bytes_read()
    start = _start_loading(device)
    model.load_weights(iter_weights(resolve_checkpoint(path)))
    call = _end_call(start, device)
    result = dict(contender=f"tpkit tp_size {tp_size}", bytes=bytes_read() - read_before, build=build,
                  **_after_call(model, call))
    destroy_tensor_parallel()
    return result


def job_tpkit_from_pretrained(path: str, device: str) -> dict[str, Any]:
    read_before = bytes_read()
    start = _start_loading(device)
    model = from_pretrained(path, dtype=torch.bfloat16, device=device)
    call = _end_call(start, device)
    return dict(contender=TPKIT_FROM_PRETRAINED, bytes=bytes_read() - read_before, build=None,
                **_after_call(model, call))


def read_every_byte(model: torch.nn.Module) -> None:
    """Reads each byte of each parameter once (a max over them): what it takes to have them all in memory,
    whether they were copied in already or are still views of a memory-mapped file."""
    with torch.no_grad():
        for param in model.parameters():
            if param.numel():
                param.reshape(-1).view(torch.uint8).max()


def _after_call(model: torch.nn.Module, call: float) -> dict[str, Any]:
    """After the timed call: RSS then, the pass over every byte (timed), then where the parameters live."""
    rss_at_return = _status_bytes("VmRSS")
    device = next(model.parameters()).device
    pass_start = time.perf_counter()
    read_every_byte(model)
    resident = call + _end_call(pass_start, str(device))
    peak_gpu = (torch.cuda.max_memory_allocated(device) - _gpu_baseline) if device.type == "cuda" else None
    return dict(call=call, resident=resident, rss_at_return=rss_at_return, shard=_param_bytes(model),
                in_file_maps=_bytes_in_file_maps(model), peak_gpu=peak_gpu)


def _param_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _bytes_in_file_maps(model: torch.nn.Module) -> int:
    """Parameter bytes whose memory is a mapping of a ``*.safetensors`` file (per /proc/self/maps)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[5].endswith(".safetensors"):
            begin, end = (int(address, 16) for address in fields[0].split("-"))
            ranges.append((begin, end))
    return sum(p.numel() * p.element_size() for p in model.parameters()
               if any(begin <= p.data_ptr() < end for begin, end in ranges))


# --- running a job in fresh processes and measuring their memory

def _status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


_gpu_baseline = 0  # bytes allocated on the GPU when loading started (the model built before, if any)


def _start_loading(device: str) -> float:
    """Resets the kernel's peak-RSS mark (where allowed) and the GPU's peak-memory mark, so the peaks are
    the loading's; returns the clock."""
    global _gpu_baseline
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    if device != "cpu":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        _gpu_baseline = torch.cuda.memory_allocated(device)
    return time.perf_counter()


def _end_call(start: float, device: str) -> float:
    """Seconds since ``start`` once the device has finished what was queued (copies to a GPU can be
    asynchronous)."""
    if device != "cpu":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def _worker(job: Callable[..., dict[str, Any]], path: str, device_type: str, extra: tuple, rank: int,
            world_size: int, threads: int, port: int, results: mp.Queue) -> None:
    try:
        logging.basicConfig(level=logging.WARNING, format="    [%(name)s] %(message)s")
        transformers.utils.logging.disable_progress_bar()
        torch.set_num_threads(threads)
        device = "cpu"
        if device_type == "cuda":
            torch.cuda.set_device(rank)
            torch.cuda.init()
            device = f"cuda:{rank}"
        if world_size > 1:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                              WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
            dist.init_process_group("nccl" if device_type == "cuda" else "gloo", rank=rank,
                                    world_size=world_size, timeout=datetime.timedelta(minutes=10))
        baseline = _status_bytes("VmRSS")
        result = job(path, device, *extra)
        result.update(rank=rank, peak_rss=_status_bytes("VmHWM") - baseline,
                      rss_at_return=result["rss_at_return"] - baseline)
        results.put(result)
    except BaseException:  # noqa: BLE001 - reported by the parent
        results.put(dict(rank=rank, error=traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_job(job: Callable[..., dict[str, Any]], path: str, device_type: str, *extra: Any,
            world_size: int = 1, threads: int = 1) -> list[dict[str, Any]]:
    """Runs ``job(path, device, *extra)`` in ``world_size`` fresh processes (rank r on ``cuda:r`` for
    device_type cuda) and returns their results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_worker, args=(job, path, device_type, extra, r, world_size, threads, port,
                                               results)) for r in range(world_size)]
    for p in procs:
        p.start()
    outputs = [results.get(timeout=1800) for _ in procs]
    for p in procs:
        p.join()
    errors = [o["error"] for o in outputs if "error" in o]
    if errors:
        raise RuntimeError(f"{job.__name__} failed:\n" + "\n".join(errors))
    return sorted(outputs, key=lambda o: o["rank"])


def prepare_page_cache(path: Path, cold: bool) -> None:
    """Cold: write back and drop the page cache. Warm: read every checkpoint file, so all of it is cached."""
    if cold:
        os.sync()
        DROP_CACHES.write_text("3\n")
        return
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb", buffering=0) as f:
            while f.read(64 * 2**20):
                pass


# --- report

def machine() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    model_name = next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")),
                      platform.processor())
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    mem_kib = next(int(line.split()[1]) for line in meminfo if line.startswith("MemTotal:"))
    return dict(cpu=model_name, cores=os.cpu_count(), usable_cores=len(os.sched_getaffinity(0)),
                ram_gib=round(mem_kib / 2**20, 1), kernel=platform.release(),
                gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                python=platform.python_version(), torch=torch.__version__,
                safetensors=safetensors.__version__, transformers=transformers.__version__)


def best_of_rounds(rounds: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per contender and rank: the round with the shortest resident time, with every round's times and the
    highest peak RSS of all rounds."""
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for row in (row for round_rows in rounds for row in round_rows):
        key = (row["contender"], row["rank"])
        kept = best.get(key)
        if kept is None or row["resident"] < kept["resident"]:
            best[key] = dict(row, rounds=kept["rounds"] if kept else [],
                             peak_rss=max(row["peak_rss"], kept["peak_rss"] if kept else 0))
        else:
            kept["peak_rss"] = max(kept["peak_rss"], row["peak_rss"])
        best[key]["rounds"].append(dict(call=row["call"], resident=row["resident"]))
    return list(best.values())


def goals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_name = {r["contender"]: r for r in rows if r["rank"] == 0}
    base, tp1 = by_name.get(LOAD_FILE), by_name.get("tpkit tp_size 1")
    hf, ours = by_name.get(FROM_PRETRAINED), by_name.get(TPKIT_FROM_PRETRAINED)
    out = []
    if base and tp1:
        for key, counts in (("resident", True), ("call", False)):
            ratio = (tp1["bytes"] / tp1[key]) / (base["bytes"] / base[key])
            out.append(dict(goal=f"tpkit tp_size 1 throughput / load_file's ({key} times)", measured=ratio,
                            target=1.0, counts=counts, met=ratio >= 1.0))
    if hf and ours:
        for key, counts in (("resident", True), ("call", False)):
            ratio = hf[key] / ours[key]
            out.append(dict(goal=f"transformers from_pretrained time / tpkit from_pretrained time ({key} "
                            "times)", measured=ratio, target=2.0, counts=counts, met=ratio >= 2.0))
    for r in rows:
        if r["contender"].startswith("tpkit"):
            ratio = r["peak_rss"] / r["shard"]
            out.append(dict(goal=f"{r['contender']} rank {r['rank']} peak RSS / shard", measured=ratio,
                            target=1.2, counts=True, met=ratio < 1.2))
            if r["peak_gpu"] is not None:
                ratio = r["peak_gpu"] / r["shard"]
                out.append(dict(goal=f"{r['contender']} rank {r['rank']} peak GPU memory / shard",
                                measured=ratio, target=1.2, counts=True, met=ratio < 1.2))
    return out


def report(rows: list[dict[str, Any]], goal_rows: list[dict[str, Any]], info: dict[str, Any]) -> str:
    m = info["machine"]
    cache = ("cold: the page cache synced and dropped before each contender" if info["cold"] else
             "warm: every checkpoint file read just before each contender")
    gpu = f"; loading into {m['gpu']} (rank r into cuda:r)" if info["device"] == "cuda" else ""
    lines = [f"machine: {m['cpu']}, {m['cores']} CPU cores ({m['usable_cores']} usable), {m['ram_gib']} GiB "
             f"RAM, Linux {m['kernel']}; Python {m['python']}, torch {m['torch']}, safetensors "
             f"{m['safetensors']}, transformers {m['transformers']}{gpu}",
             f"checkpoint: {info['checkpoint_bytes'] / GB:.2f} GB of bf16 tensors in {info['files']} files; "
             f"page cache {cache}",
             f"{info['threads']} torch thread(s) in every process (tpkit's loader: "
             f"{os.environ.get('TPKIT_LOAD_THREADS') or 'its default of up to 4'} copy threads); best of "
             f"{info['rounds']} rounds by resident time, each a fresh process loading once;",
             "resident = call + one pass reading every parameter byte (the goals use it)",
             "",
             "| contender | rank | call s | resident s | GB read | GB/s (resident) | in file maps GB | "
             "RSS at return GB | peak RSS GB | shard GB | peak RSS / shard | peak GPU / shard |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gpu_ratio = "-" if r["peak_gpu"] is None else f"{r['peak_gpu'] / r['shard']:.2f}"
        lines.append(f"| {r['contender']} | {r['rank']} | {r['call']:.3f} | {r['resident']:.3f} | "
                     f"{r['bytes'] / GB:.3f} | {r['bytes'] / GB / r['resident']:.2f} | "
                     f"{r['in_file_maps'] / GB:.3f} | {r['rss_at_return'] / GB:.3f} | "
                     f"{r['peak_rss'] / GB:.3f} | {r['shard'] / GB:.3f} | {r['peak_rss'] / r['shard']:.2f} | "
                     f"{gpu_ratio} |")
    lines.append("")
    for r in rows:
        rounds = ", ".join(f"{t['call']:.3f}/{t['resident']:.3f}" for t in r["rounds"])
        built = "" if r["build"] is None else f"; model built before the clock in {r['build']:.2f} s"
        lines.append(f"- {r['contender']} rank {r['rank']}: rounds (call/resident s) {rounds}{built}")
    lines += ["", "| goal | measured | target | met |", "|---|---|---|---|"]
    for g in goal_rows:
        target = f"< {g['target']:.2f}x" if "peak" in g["goal"] else f">= {g['target']:.2f}x"
        met = ("yes" if g["met"] else "NO") if g["counts"] else "(information)"
        lines.append(f"| {g['goal']} | {g['measured']:.2f}x | {target} | {met} |")
    for name in sorted({r["contender"] for r in rows if r["contender"].startswith("tpkit")}):
        group = [r for r in rows if r["contender"] == name]
        if len(group) > 1:
            seconds = max(r["resident"] for r in group)
            throughput = sum(r["bytes"] for r in group) / GB / seconds
            lines.append(f"| {name}: all ranks together (resident) | {throughput:.2f} GB/s | | "
                         "(information) |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size-gb", type=float, default=2.0, help="checkpoint size (default 2 GB)")
    parser.add_argument("--small", action="store_true", help="a ~0.1 GB checkpoint with narrower layers")
    parser.add_argument("--tp-sizes", default="1,2", help="comma-separated tp_size values (default 1,2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of fresh processes, one per contender; the best counts (default 3)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="start no round that would end past this many seconds from the start, judged "
                        "by the longest round so far (default: no limit)")
    parser.add_argument("--cold", action="store_true",
                        help="sync and drop the page cache before each contender (default: warm cache)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the parameters live: cpu (default), or cuda (rank r on cuda:r, NCCL)")
    parser.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temp dir)")
    parser.add_argument("--json", default=None,
                        help="where to write the rows as JSON (default benchmarks/results/"
                        "loader_<device>.json; none with --small)")
    args = parser.parse_args()
    if args.cold and not os.access(DROP_CACHES, os.W_OK):
        parser.error(f"--cold needs write access to {DROP_CACHES} (root)")
    tp_sizes = [int(t) for t in args.tp_sizes.split(",")]
    if args.device == "cuda" and max(tp_sizes) > torch.cuda.device_count():
        parser.error(f"--tp-sizes: tp_size {max(tp_sizes)} needs as many GPUs, found "
                     f"{torch.cuda.device_count()}")
    os.environ.setdefault("TPKIT_DISABLE_PROGRESS", "1")
    json_path = Path(args.json) if args.json else (None if args.small else
                                                   RESULTS / f"loader_{args.device}.json")
    config = llama_config(0.1 if args.small else args.size_gb, SMALL_SHAPE if args.small else FULL_SHAPE)
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="bench_loader_") as tmp:
        path = Path(tmp)
        start = time.perf_counter()
        total = make_checkpoint(path, config)
        files = len(list(path.glob("*.safetensors")))
        print(f"made {total / GB:.2f} GB in {files} files ({config.num_hidden_layers} layers, hidden "
              f"{config.hidden_size}) in {time.perf_counter() - start:.1f} s", flush=True)
        jobs: list[tuple[Callable[..., dict[str, Any]], tuple, int]] = [
            (job_load_file, (), 1), (job_from_pretrained, (), 1), (job_tpkit_from_pretrained, (), 1),
            *((job_tpkit, (tp_size,), tp_size) for tp_size in tp_sizes)]
        rounds = []
        longest_round = 0.0
        for round_index in range(args.rounds):
            elapsed = time.perf_counter() - start
            if args.budget_s is not None and rounds and elapsed + longest_round > args.budget_s:
                print(f"stopping after {len(rounds)} rounds: another would end past --budget-s "
                      f"{args.budget_s:.0f} s ({elapsed:.0f} s gone, the longest round "
                      f"{longest_round:.0f} s)",
                      flush=True)
                break
            round_start = time.perf_counter()
            # Contenders take turns, so that a busy spell on a shared machine hits all of them alike.
            rows = []
            for job, job_args, world_size in jobs:
                prepare_page_cache(path, args.cold)
                job_start = time.perf_counter()
                outputs = run_job(job, str(path), args.device, *job_args, world_size=world_size,
                                  threads=args.threads)
                resident = ", ".join(f"{o['resident']:.3f}" for o in outputs)
                print(f"round {round_index + 1}: {outputs[0]['contender']}: resident {resident} s, its "
                      f"process(es) {time.perf_counter() - job_start:.1f} s", flush=True)
                rows += outputs
            rounds.append(rows)
            longest_round = max(longest_round, time.perf_counter() - round_start)
    rows = best_of_rounds(rounds)
    goal_rows = goals(rows)
    info = dict(machine=machine(), device=args.device, cold=args.cold, threads=args.threads,
                rounds=len(rounds), checkpoint_bytes=total, files=files)
    print(report(rows, goal_rows, info))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(dict(info, date=datetime.date.today().isoformat(), rows=rows,
                                             goals=goal_rows, all_rounds=rounds), indent=1) + "\n")
        print(f"\nwrote {json_path}")


if __name__ == "__main__":
    main()
