"""Decode attention on one GPU: tpkit's paged kernel against torch SDPA on contiguous KV, a naive
gather-then-SDPA, FlexAttention over the paged layout, FlashInfer's paged decode kernels (its decode
wrapper on CUDA cores and on tensor cores, and XQA; see ``flashinfer_decode.py``) where FlashInfer is
installed, and vLLM's kernels (measured figures, ``baselines/paged_attention_decode_h200.json``). tpkit
also runs on the same pages stored head-major (``tpkit-head-major``), to show what the cache layout costs,
and on SDPA's contiguous K/V (``tpkit-contiguous``), to show what the paging itself costs.

    PYTHONPATH=. python benchmarks/bench_paged_attention.py [--only C1,C3] [--config name:dtype:B:L:Hq:Hkv]
    PYTHONPATH=. python benchmarks/bench_paged_attention.py --kv-dtype fp8_e4m3  # tpkit on a float8 cache

With ``--kv-dtype fp8_e4m3`` (or ``fp8_e5m2``) the caches are quantized to float8 with one scale per cache
(its amax over the format's largest value), the reference is the float32 attention over the dequantized
cache, and tpkit's implementations and FlashInfer's (where installed: its decode wrapper and XQA on the
same float8 pages, with the scales) run, not SDPA's (which reads 16-bit caches); bandwidth counts the
float8 bytes.

Every configuration uses head size 128 and KV block (page) 16, every sequence holding L tokens. Data is
random normal; block tables are random permutations of the pages. Each implementation is checked against
a float32 reference on the same data (relative error ||out - ref|| / ||ref||), then timed as the median of
CUDA-graph replays, each replay running it on every one of several input sets, so that at least
``--min-kv-mb`` of KV is touched between two reads of the same bytes (L2 is 60 MB), round after round for
about ``--replay-ms`` (as ``triton.testing.do_bench_cudagraph``, the anchors' timer, repeats the call
within one graph). An implementation whose error passes ``MAX_REL_ERR`` is reported, not timed. The device
copy bandwidth (a 2 GiB clone, bytes read + written) is measured in the same run, after the configurations.
Prints a table of every implementation, then the peers' table (a column says "not installed" where
FlashInfer does not import and "fails" where a kernel refused the shape or failed to build), and writes the
rows as JSON (a row with ``t_us`` null and a ``status`` for each peer that did not run).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from flashinfer_decode import IMPLS as FLASHINFER_IMPLS
from flashinfer_decode import FlashInferDecode, import_error
from torch.nn.attention import SDPBackend, sdpa_kernel

from tpkit.ops import _extension, paged_attention

HEAD_SIZE = 128
BLOCK_SIZE = 16
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
KV_DTYPES = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
SDPA_BACKENDS = {
    "sdpa-cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa-flash": SDPBackend.FLASH_ATTENTION,
    "sdpa-efficient": SDPBackend.EFFICIENT_ATTENTION,
}
# Measured figures of kernels the GPU machine does not have (vLLM's), with how they were measured.
BASELINES = Path(__file__).resolve().parent / "baselines" / "paged_attention_decode_h200.json"
MAX_REL_ERR = 2e-2  # against the float32 reference, as the baselines were checked
# The peers' table: its columns, by implementation.
PEER_COLUMNS = {"sdpa-cudnn": "cuDNN", "sdpa-flash": "FLASH", "tpkit": "tpkit", "fi-decode": "FI decode",
                "fi-decode-tc": "FI decode TC", "fi-xqa": "FI XQA"}


@dataclass(frozen=True)
class Config:
    name: str
    dtype: str
    batch: int
    seq_len: int
    num_heads: int
    num_kv_heads: int

    @property
    def kv_bytes(self) -> int:
        return 2 * self.batch * self.seq_len * self.num_kv_heads * HEAD_SIZE * DTYPES[self.dtype].itemsize

    def __str__(self) -> str:
        return (f"{self.name}-{self.dtype} B={self.batch} L={self.seq_len} Hq={self.num_heads} "
                f"Hkv={self.num_kv_heads}")


CONFIGS = (
    Config("C1", "bf16", 64, 4096, 32, 8),
    Config("C2", "fp16", 8, 1024, 40, 40),
    Config("C3", "fp16", 8, 2048, 48, 1),
    Config("C4", "bf16", 2, 32768, 32, 8),
    Config("C5", "bf16", 256, 512, 32, 8),
    Config("C6", "bf16", 64, 4096, 48, 1),
    Config("C7", "bf16", 128, 1024, 28, 4),  # a group of 7
    Config("C8", "bf16", 512, 256, 8, 1),  # many short sequences, MQA
    Config("C9", "fp16", 64, 4096, 32, 8),  # C1 in float16
    Config("C10", "bf16", 1, 131072, 8, 1),  # one long sequence, MQA
)


def _parse_config(text: str) -> Config:
    parts = text.split(":")
    if len(parts) != 6 or parts[1] not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"expected name:dtype:B:L:Hq:Hkv with dtype in {list(DTYPES)}, got {text!r}")
    name, dtype, *numbers = parts
    batch, seq_len, num_heads, num_kv_heads = (int(x) for x in numbers)
    if seq_len % BLOCK_SIZE or num_heads % num_kv_heads:
        raise argparse.ArgumentTypeError(
            f"L must be a multiple of {BLOCK_SIZE} and Hkv divide Hq, got {text!r}")
    return Config(name, dtype, batch, seq_len, num_heads, num_kv_heads)


@dataclass
class InputSet:
    """One decode step's inputs, in the paged layout and (the same values) laid out contiguously."""

    query: torch.Tensor  # [B, Hq, D]
    key_cache: torch.Tensor  # [num_blocks, BLOCK_SIZE, Hkv, D]
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [B, L / BLOCK_SIZE], a permutation of the pages
    seq_lens: torch.Tensor  # int32 [B]
    key: torch.Tensor | None = None  # [B, Hkv, L, D], contiguous
    value: torch.Tensor | None = None
    k_scale: torch.Tensor | None = None  # float32 []: a float8 cache's scales
    v_scale: torch.Tensor | None = None


def _quantize_caches(s: InputSet, dtype: torch.dtype) -> None:
    """The set's caches in float8 ``dtype``, stored = x / scale with scale = amax / the format's maximum."""
    top = torch.finfo(dtype).max
    scales = []
    for name in ("key_cache", "value_cache"):
        cache = getattr(s, name)
        scale = (cache.float().abs().amax() / top).clamp(min=1e-12)
        setattr(s, name, (cache.float() / scale).clamp(-top, top).to(dtype))
        scales.append(scale)
    s.k_scale, s.v_scale = scales


def _make_set(cfg: Config, generator: torch.Generator) -> InputSet:
    dtype = DTYPES[cfg.dtype]
    pages = cfg.seq_len // BLOCK_SIZE
    num_blocks = cfg.batch * pages
    dev = torch.device("cuda")
    cache_shape = (num_blocks, BLOCK_SIZE, cfg.num_kv_heads, HEAD_SIZE)
    return InputSet(
        query=torch.randn(cfg.batch, cfg.num_heads, HEAD_SIZE, device=dev, generator=generator, dtype=dtype),
        key_cache=torch.randn(cache_shape, device=dev, generator=generator, dtype=dtype),
        value_cache=torch.randn(cache_shape, device=dev, generator=generator, dtype=dtype),
        block_tables=torch.randperm(num_blocks, device=dev, generator=generator, dtype=torch.int32)
        .view(cfg.batch, pages),
        seq_lens=torch.full((cfg.batch,), cfg.seq_len, dtype=torch.int32, device=dev),
    )


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[num_blocks, BLOCK_SIZE, Hkv, D] pages of each sequence -> [B, Hkv, L, D] (a copy)."""
    batch, pages = block_tables.shape
    return cache[block_tables].view(batch, pages * BLOCK_SIZE, cache.shape[2], cache.shape[3]).transpose(1, 2)


def _reference(s: InputSet) -> torch.Tensor:
    """float32 decode attention over the gathered K/V (dequantized, for a float8 cache): [B, Hq, D]."""
    key = _gather(s.key_cache, s.block_tables).float()  # [B, Hkv, L, D]
    value = _gather(s.value_cache, s.block_tables).float()
    if s.k_scale is not None:
        key, value = key * s.k_scale, value * s.v_scale
    batch, num_heads, head_size = s.query.shape
    num_kv_heads = key.shape[1]
    q = s.query.float().view(batch, num_kv_heads, num_heads // num_kv_heads, head_size)  # [B, Hkv, G, D]
    scores = torch.matmul(q, key.transpose(-1, -2)) * head_size ** -0.5  # [B, Hkv, G, L]
    return torch.matmul(scores.softmax(dim=-1), value).view(batch, num_heads, head_size)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).splitlines()
    return f"{type(exc).__name__}: {lines[0][:100] if lines else ''}"


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref).norm() / ref.norm())


def _graph_time_us(calls: list[Callable[[], object]], replays: int, replay_ms: float = 0.0) -> float:
    """Median per call over CUDA-graph replays of one graph that makes every call once or, with replay_ms,
    makes them over and over until a replay takes about that long, as triton.testing.do_bench_cudagraph
    (the anchors' timer) does: a replay's launch and its first kernel's start from an idle GPU are then
    shared by many calls rather than by one round of the input sets."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:  # warm-up outside the capture (builds, autotuning, plans)
            call()
    torch.cuda.current_stream().wait_stream(stream)

    def capture(rounds: int) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(rounds):
                for call in calls:
                    call()
        for _ in range(3):
            graph.replay()
        return graph

    def replay_us(graph: torch.cuda.CUDAGraph) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1000.0

    rounds = 1
    graph = capture(rounds)
    if replay_ms > 0:
        rounds = max(1, int(replay_ms * 1000.0 / min(replay_us(graph) for _ in range(3))))
        del graph
        graph = capture(rounds)
    times = [replay_us(graph) / (rounds * len(calls)) for _ in range(replays)]
    del graph
    return statistics.median(times)


def _copy_bandwidth_gbps() -> float:
    """Device copy bandwidth: clone of a 2 GiB tensor, bytes read + written, median of 10."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    src.random_()
    dst = torch.empty_like(src)
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1000.0)
    del src, dst
    return 2 * (2 << 30) / statistics.median(times) / 1e9


class _Flex:
    """FlexAttention over the paged layout: the caches viewed as one [1, Hkv, num_blocks * 16, D] KV and
    a BlockMask whose KV blocks are each sequence's pages, all full (every sequence fills its pages)."""

    def __init__(self, budget_s: float) -> None:
        from torch.nn.attention.flex_attention import flex_attention

        self.compiled = torch.compile(flex_attention, dynamic=False)
        self.budget_s = budget_s

    def block_mask(self, s: InputSet):  # -> BlockMask
        from torch.nn.attention.flex_attention import BlockMask

        batch, pages = s.block_tables.shape
        num_blocks = s.key_cache.shape[0]
        dev = s.block_tables.device
        # Index tensors span every physical page: the mask's dense form is indexed by them.
        num_kv = torch.zeros(batch, 1, 1, dtype=torch.int32, device=dev)
        empty = torch.zeros(batch, 1, 1, num_blocks, dtype=torch.int32, device=dev)
        full_num = torch.full_like(num_kv, pages)
        full_idx = torch.zeros_like(empty)
        full_idx[:, 0, 0, :pages] = s.block_tables
        # The same mask as a mask_mod (used by the eager path; the kernel only visits the full blocks):
        # a physical slot belongs to sequence b when its page is in b's table.
        owner = torch.zeros(batch, num_blocks, dtype=torch.bool, device=dev)  # [B, num_blocks]
        owner[torch.arange(batch, device=dev)[:, None], s.block_tables.long()] = True

        def in_table(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor,
                     kv_idx: torch.Tensor) -> torch.Tensor:
            return owner[b, kv_idx // BLOCK_SIZE]

        return BlockMask.from_kv_blocks(num_kv, empty, full_num, full_idx, BLOCK_SIZE=(128, BLOCK_SIZE),
                                        mask_mod=in_table, seq_lengths=(1, num_blocks * BLOCK_SIZE))

    def call(self, s: InputSet, mask) -> Callable[[], torch.Tensor]:
        num_blocks, _, num_kv_heads, head_size = s.key_cache.shape
        # [num_blocks, 16, Hkv, D] -> [1, Hkv, num_blocks * 16, D], a strided view (no copy).
        key = s.key_cache.view(1, num_blocks * BLOCK_SIZE, num_kv_heads, head_size).transpose(1, 2)
        value = s.value_cache.view(1, num_blocks * BLOCK_SIZE, num_kv_heads, head_size).transpose(1, 2)
        query = s.query.unsqueeze(2)  # [B, Hq, 1, D]
        return lambda: self.compiled(query, key, value, block_mask=mask, enable_gqa=True).squeeze(2)


def _sdpa_call(s: InputSet, backend: SDPBackend | None) -> Callable[[], torch.Tensor]:
    query = s.query.unsqueeze(2)  # [B, Hq, 1, D]

    def run() -> torch.Tensor:
        if backend is None:
            return F.scaled_dot_product_attention(query, s.key, s.value, enable_gqa=True).squeeze(2)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(query, s.key, s.value, enable_gqa=True).squeeze(2)

    return run


def _naive_call(s: InputSet) -> Callable[[], torch.Tensor]:
    def run() -> torch.Tensor:
        key = _gather(s.key_cache, s.block_tables)
        value = _gather(s.value_cache, s.block_tables)
        return F.scaled_dot_product_attention(s.query.unsqueeze(2), key, value, enable_gqa=True).squeeze(2)

    return run


def _float_scales(s: InputSet) -> tuple[float, float]:
    """A float8 set's k and v scales as Python floats (1 for a 16-bit cache)."""
    return (1.0, 1.0) if s.k_scale is None else (float(s.k_scale), float(s.v_scale))


def _tpkit_call(s: InputSet) -> Callable[[], torch.Tensor]:
    out = torch.empty_like(s.query)
    return lambda: paged_attention(s.query, s.key_cache, s.value_cache, s.block_tables, s.seq_lens, out=out,
                                   k_scale=s.k_scale, v_scale=s.v_scale)


def _tpkit_head_major_call(s: InputSet) -> Callable[[], torch.Tensor]:
    """tpkit's op on the same pages stored head-major: [num_blocks, Hkv, BLOCK_SIZE, D] in memory, passed as
    a [num_blocks, BLOCK_SIZE, Hkv, D] view, so each KV head's page is one contiguous run of 16 rows."""
    key_cache = s.key_cache.transpose(1, 2).contiguous().transpose(1, 2)
    value_cache = s.value_cache.transpose(1, 2).contiguous().transpose(1, 2)
    out = torch.empty_like(s.query)
    return lambda: paged_attention(s.query, key_cache, value_cache, s.block_tables, s.seq_lens, out=out,
                                   k_scale=s.k_scale, v_scale=s.v_scale)


def _tpkit_contiguous_call(s: InputSet) -> Callable[[], torch.Tensor]:
    """tpkit's op on the contiguous [B, Hkv, L, D] K/V that SDPA reads: a [num_blocks, BLOCK_SIZE, Hkv, D]
    view whose head stride is L * D and whose block b * Hkv * L / BLOCK_SIZE + j is sequence b's page j.
    Against ``tpkit``, what reading pages rather than one run per (sequence, KV head) costs the kernel."""
    batch, num_kv_heads, seq_len, head_size = s.key.shape
    pages = seq_len // BLOCK_SIZE
    # The last sequence's last page, as seen from head 0, is the view's last block.
    shape = ((batch - 1) * num_kv_heads * pages + pages, BLOCK_SIZE, num_kv_heads, head_size)
    strides = (BLOCK_SIZE * head_size, head_size, seq_len * head_size, 1)
    key_cache, value_cache = (x.as_strided(shape, strides) for x in (s.key, s.value))
    first_page = torch.arange(batch, device=s.key.device, dtype=torch.int32) * (num_kv_heads * pages)
    block_tables = first_page[:, None] + torch.arange(pages, device=s.key.device, dtype=torch.int32)
    out = torch.empty_like(s.query)
    return lambda: paged_attention(s.query, key_cache, value_cache, block_tables, s.seq_lens, out=out,
                                   k_scale=s.k_scale, v_scale=s.v_scale)


def _bench_config(cfg: Config, args: argparse.Namespace, flex: _Flex | None, peers: FlashInferDecode | str,
                  rows: list[dict]) -> None:
    """Times every implementation on cfg's input sets into rows; peers: FlashInfer's calls, or why there
    are none (then its columns say so)."""
    kv_dtype = KV_DTYPES[args.kv_dtype]
    kv_bytes = cfg.kv_bytes if kv_dtype is None else cfg.kv_bytes // DTYPES[cfg.dtype].itemsize
    num_sets = max(1, math.ceil(args.min_kv_mb * 1e6 / kv_bytes))
    generator = torch.Generator(device="cuda").manual_seed(0)
    sets = [_make_set(cfg, generator) for _ in range(num_sets)]
    if kv_dtype is not None:
        for s in sets:
            _quantize_caches(s, kv_dtype)
    ref = _reference(sets[0])
    for s in sets:
        s.key = _gather(s.key_cache, s.block_tables).contiguous()
        s.value = _gather(s.value_cache, s.block_tables).contiguous()

    impls: list[tuple[str, Callable[[InputSet], Callable[[], torch.Tensor]]]] = [
        ("tpkit", _tpkit_call), ("tpkit-head-major", _tpkit_head_major_call),
        ("tpkit-contiguous", _tpkit_contiguous_call)]
    impls += [(name, lambda s, b=backend: _sdpa_call(s, b)) for name, backend in SDPA_BACKENDS.items()]
    impls += [("sdpa-default", lambda s: _sdpa_call(s, None)), ("naive-gather-sdpa", _naive_call)]
    if kv_dtype is not None:  # the contiguous SDPA and gather baselines read no float8 cache
        impls = [(name, make) for name, make in impls if name.startswith("tpkit")]
    if not isinstance(peers, str):
        impls += [(name, lambda s, n=name: peers.call(n, s.query, s.key_cache, s.value_cache, s.block_tables,
                                                      s.seq_lens, *_float_scales(s)))
                  for name in FLASHINFER_IMPLS]
    selected = None if args.impls is None else args.impls.split(",")
    if selected is not None:
        impls = [(name, make) for name, make in impls if name in selected]
    results: dict[str, tuple[float, float]] = {}
    statuses = {name: peers for name in FLASHINFER_IMPLS
                if isinstance(peers, str) and (selected is None or name in selected)}
    for name, make in impls:
        try:
            calls = [make(s) for s in sets]
            err = _rel_err(calls[0](), ref)
            if err <= MAX_REL_ERR:  # not NaN either
                results[name] = (_graph_time_us(calls, args.replays, args.replay_ms), err)
            else:
                statuses[name] = "wrong"
                print(f"  {cfg.name} {name}: wrong (relative error {err:.1e} against the float32 reference)")
        except Exception as exc:  # FlashInfer's build and shape errors vary; report and go on
            statuses[name] = "fails"
            print(f"  {cfg.name} {name}: fails ({_first_line(exc)})")
        torch.cuda.synchronize()
    print(f"  {cfg.name} sdpa-math: skipped (materialises the scores; far slower than every other backend)")
    if flex is not None and kv_dtype is None:
        if flex.budget_s <= 0:
            print(f"  {cfg.name} flex-paged: skipped (FlexAttention compile budget spent)")
        else:
            t0 = time.perf_counter()
            try:
                calls = [flex.call(s, flex.block_mask(s)) for s in sets]
                err = _rel_err(calls[0](), ref)
                results["flex-paged"] = (_graph_time_us(calls, args.replays, args.replay_ms), err)
            except Exception as exc:  # inductor/triton failures vary; report and go on
                print(f"  {cfg.name} flex-paged: skipped ({_first_line(exc)})")
            flex.budget_s -= time.perf_counter() - t0
    plan = _extension.launch_plan(sets[0].query, sets[0].key_cache, sets[0].block_tables)
    print(f"  {cfg.name} tpkit plan: {plan}")
    del sets
    torch.cuda.empty_cache()

    shape = {"config": cfg.name, "dtype": cfg.dtype, "kv_dtype": args.kv_dtype, "batch": cfg.batch,
             "seq_len": cfg.seq_len, "num_heads": cfg.num_heads, "num_kv_heads": cfg.num_kv_heads,
             "head_size": HEAD_SIZE, "block_size": BLOCK_SIZE, "kv_bytes": kv_bytes,
             "num_input_sets": num_sets}
    sdpa = {k: v for k, v in results.items() if k.startswith("sdpa")}
    best_sdpa = min(sdpa.items(), key=lambda kv: kv[1][0]) if sdpa else None
    for name, (t_us, err) in sorted(results.items(), key=lambda kv: kv[1][0]):
        gbps = kv_bytes / (t_us * 1e-6) / 1e9
        rows.append({
            **shape, "impl": name, "t_us": round(t_us, 2), "GBps": round(gbps, 1),
            "ratio_to_best_sdpa": round(t_us / best_sdpa[1][0], 3) if best_sdpa else None,
            "best_sdpa": best_sdpa is not None and name == best_sdpa[0], "rel_err": err, "status": "ok",
        })
    for name, status in statuses.items():
        rows.append({**shape, "impl": name, "t_us": None, "status": status})


def _print_table(rows: list[dict], copy_bw: float) -> None:
    timed = [row for row in rows if row["t_us"] is not None]
    print(f"\ncopy bandwidth {copy_bw:.0f} GB/s; ratio = t / t(best SDPA, contiguous KV), * = best SDPA")
    print(f"{'config':<9}{'impl':<20}{'us':>9}{'GB/s':>8}{'%copy':>7}{'ratio':>7}{'rel_err':>10}")
    for row in timed:
        mark = " *" if row["best_sdpa"] else ""
        ratio = f"{row['ratio_to_best_sdpa']:.2f}" if row["ratio_to_best_sdpa"] is not None else "-"
        print(f"{row['config'] + '-' + row['dtype']:<9}{row['impl'] + mark:<20}{row['t_us']:>9.1f}"
              f"{row['GBps']:>8.0f}{row['pct_copy_bw']:>7.1f}{ratio:>7}{row['rel_err']:>10.1e}")


def _print_peers(rows: list[dict], vllm_us: dict[str, float]) -> None:
    """One line per configuration: us of tpkit and its peers, and tpkit / the best of them (every
    implementation of another library that ran; vLLM's measured figure where there is one)."""
    by_config: dict[str, dict[str, dict]] = {}
    for row in rows:
        by_config.setdefault(row["config"], {})[row["impl"]] = row
    print(f"\n{'config':<34}" + "".join(f"{c:>14}" for c in PEER_COLUMNS.values())
          + f"{'vLLM':>10}{'tpkit / best other':>20}")
    for config, impls in by_config.items():
        cells = []
        for impl in PEER_COLUMNS:
            row = impls.get(impl)
            if row is None:
                cells.append("-")
            else:
                cells.append(row["status"] if row["t_us"] is None else f"{row['t_us']:.1f}")
        any_row = next(iter(impls.values()))
        others = [r["t_us"] for name, r in impls.items() if not name.startswith("tpkit") and r["t_us"]]
        key = f"{config}-{any_row['dtype']}"
        if key in vllm_us:
            others.append(vllm_us[key])
        tpkit = impls.get("tpkit")
        ratio = f"{tpkit['t_us'] / min(others):.2f}" if tpkit and tpkit["t_us"] and others else "-"
        label = (f"{key} B={any_row['batch']} L={any_row['seq_len']} "
                 f"{any_row['num_heads']}:{any_row['num_kv_heads']}")
        print(f"{label:<34}" + "".join(f"{c:>14}" for c in cells) + f"{vllm_us.get(key, '-'):>10}{ratio:>20}")


def _vllm_us() -> dict[str, float]:
    """vLLM's best of paged_attention v1 and v2 per "config-dtype", from the baselines file."""
    baselines = json.loads(BASELINES.read_text())["vllm"]["us"]
    return {key: min(times.values()) for key, times in baselines.items()}


def add_timer_args(parser: argparse.ArgumentParser, *, min_kv_mb: float) -> None:
    """The timer's options (see :func:`_graph_time_us`): --min-kv-mb, --replays, --replay-ms."""
    parser.add_argument("--min-kv-mb", type=float, default=min_kv_mb,
                        help="KV read between two reads of the same bytes (MB)")
    parser.add_argument("--replays", type=int, default=30)
    parser.add_argument("--replay-ms", type=float, default=20.0,
                        help="ms a replay takes, in rounds of the input sets (0: one round)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", type=_parse_config, default=[],
                        help="extra configuration name:dtype:B:L:Hq:Hkv (head 128, block 16)")
    parser.add_argument("--only", default=None, help="comma-separated names of the built-in configs to run")
    parser.add_argument("--impls", default=None,
                        help="comma-separated implementations to run (default: all), e.g. tpkit,sdpa-cudnn")
    add_timer_args(parser, min_kv_mb=512.0)
    parser.add_argument("--kv-dtype", choices=list(KV_DTYPES), default="auto",
                        help="the caches' dtype: auto (the query's) or float8 with per-cache scales")
    parser.add_argument("--flex-budget-s", type=float, default=90.0,
                        help="total seconds for FlexAttention (compiles included); 0 skips it")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/results/paged_attention_h200.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")

    configs = [c for c in CONFIGS if args.only is None or c.name in args.only.split(",")] + args.config
    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}; "
          f"python {platform.python_version()}")
    flex = _Flex(args.flex_budget_s) if args.flex_budget_s > 0 else None
    reason = import_error()
    if reason is not None:
        print(f"FlashInfer: not installed ({reason})")
    peers = "not installed" if reason is not None else FlashInferDecode(torch.device("cuda"))
    rows: list[dict] = []
    for cfg in configs:
        t0 = time.perf_counter()
        _bench_config(cfg, args, flex, peers, rows)
        print(f"  {cfg}: KV {cfg.kv_bytes / 1e6:.1f} MB ({time.perf_counter() - t0:.0f} s)")
    # After the configurations: the paged kernels ran C5 and C6 about 11% slower on memory the clone's 2 GiB
    # tensors had held (kept by the caching allocator, reused by the first configuration); contiguous
    # reads did not slow down there.
    copy_bw = _copy_bandwidth_gbps()
    for row in rows:
        if row["t_us"] is not None:
            row["pct_copy_bw"] = round(100 * row["GBps"] / copy_bw, 1)
    _print_table(rows, copy_bw)
    _print_peers(rows, _vllm_us())
    args.json.parent.mkdir(parents=True, exist_ok=True)
    meta = {"gpu": props.name, "torch": torch.__version__, "cuda": torch.version.cuda,
            "cudnn": torch.backends.cudnn.version(), "copy_bw_GBps": round(copy_bw, 1)}
    args.json.write_text(json.dumps([{**row, **meta} for row in rows], indent=1) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
