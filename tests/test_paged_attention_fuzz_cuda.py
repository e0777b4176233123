"""A seeded fuzz of the CUDA paged-attention kernel over the whole supported space, against the reference.

Each case draws a dtype (float16, bfloat16, float32), a head size, a block size (8, 16, 32), a group size
from 1 to 64 (powers of two or not), 1-8 KV heads, 1-1024 sequences with ragged lengths from 1 to 2**20
tokens (under a budget of cache elements), a block table as wide as needed or wider, ALiBi or not, and
queries scaled for flat or peaked scores, and for half the cases several query tokens a sequence
(``query_start_loc``: per sequence none, one, a few speculative ones, a chunk after a cached prefix or the
whole sequence, mixed in one batch; causal or not), for a quarter of the 16-bit cases of head sizes that are
multiples of 16 a float8 cache (E4M3 or E5M2, one scale or one a KV head; the reference reads the same
stored values, dequantized), and for a third of the cases the variants: a sliding
window (whose earlier blocks' table entries then point at NaN pages), a logit soft cap, sinks. The cache
holds random K/V for every token of every sequence and NaN everywhere else (unused slots, spare pages,
which the unused table entries point at), and the output starts as NaN: a read outside a sequence, or a
row left unwritten, shows up as NaN. The kernel's output is compared with the PyTorch reference on the GPU
(float32 arithmetic over the same, exactly rounded inputs) within the dtype's tolerance.

The cases run in a worker process, one after another; a case that breaks the process (a launch error
leaves its CUDA context unusable) is reported as failed and the rest run in a new worker, so one bad
launch cannot poison the others. The first cases are fixed: shapes that once failed to launch, then a few
of several query tokens a sequence and of the variants. Budget:
``TPKIT_FUZZ_CASES`` cases (default 1500) from ``TPKIT_FUZZ_SEED`` (default 0); a long run by hand is e.g.
``TPKIT_FUZZ_CASES=20000 TPKIT_FUZZ_SEED=1 python -m pytest tests/test_paged_attention_fuzz_cuda.py -s``.
"""

from __future__ import annotations

import faulthandler
import json
import math
import os
import random
import subprocess
import sys
import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CASES = int(os.environ.get("TPKIT_FUZZ_CASES", "1500"))
SEED = int(os.environ.get("TPKIT_FUZZ_SEED", "0"))
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
HEAD_SIZES = (32, 64, 80, 96, 112, 120, 128, 192, 256)
BLOCK_SIZES = (8, 16, 32)
MAX_SEQS = 1024
CASE_TIMEOUT_S = 60  # a case takes well under a second
MAX_LEN = 1 << 20
# Elements of one cache (tokens x num_kv_heads x head_size): 256 MiB in float32.
CACHE_ELEMENTS = 1 << 26
# With several query tokens a sequence: elements of the query (tokens x num_heads x head_size, 64 MiB in
# float32), and the reference's work (the sum over query tokens of their sequence's length, times num_heads
# x head_size).
QUERY_ELEMENTS = 1 << 24
REFERENCE_WORK = 1 << 33
# (atol, rtol) against the float32 reference: output rounding, P rounded to the dtype for P V, and float32
# sums over up to 2**20 tokens in another order.
TOLERANCES = {torch.float32: (2e-4, 2e-4), torch.float16: (2e-3, 4e-3), torch.bfloat16: (1e-2, 1.6e-2)}
# One sequence of 131072 tokens on one KV head, 4, 8 and 48 query heads: plans that once asked for a
# cluster of 228 blocks; then shapes of several query tokens a sequence, and of the variants.
FIXED_CASES = tuple(
    {"dtype": "bfloat16", "head_size": 128, "block_size": 16, "num_heads": num_heads, "num_kv_heads": 1,
     "seq_lens": [131072], "extra_width": 0, "alibi": False, "q_scale": 1.0}
    for num_heads in (8, 4, 48)) + (
    # Several query tokens a sequence: chunks after cached prefixes, a prefill from scratch, MQA chunks, and
    # one prefill chunk beside decodes.
    {"dtype": "bfloat16", "head_size": 128, "block_size": 16, "num_heads": 32, "num_kv_heads": 8,
     "seq_lens": [2560, 2560], "query_lens": [512, 512], "causal": True, "extra_width": 0, "alibi": False,
     "q_scale": 1.0},
    {"dtype": "float16", "head_size": 64, "block_size": 16, "num_heads": 8, "num_kv_heads": 8,
     "seq_lens": [1000, 333], "query_lens": [1000, 333], "causal": True, "extra_width": 1, "alibi": True,
     "q_scale": 1.0},
    {"dtype": "bfloat16", "head_size": 128, "block_size": 16, "num_heads": 48, "num_kv_heads": 1,
     "seq_lens": [1280] * 4, "query_lens": [256] * 4, "causal": True, "extra_width": 0, "alibi": False,
     "q_scale": 1.0},
    {"dtype": "bfloat16", "head_size": 128, "block_size": 16, "num_heads": 32, "num_kv_heads": 8,
     "seq_lens": [3072] + [2048] * 15, "query_lens": [1024] + [1] * 15, "causal": True, "extra_width": 0,
     "alibi": False, "q_scale": 1.0},
    # A sliding-window decode over long sequences (split partitions from the window's first block) and a
    # Gemma-2 step: window, soft cap and a chunk beside decodes.
    {"dtype": "bfloat16", "head_size": 128, "block_size": 16, "num_heads": 32, "num_kv_heads": 8,
     "seq_lens": [131072, 5000, 4097], "extra_width": 0, "alibi": False, "q_scale": 1.0, "window_size": 4096,
     "sinks": True},
    {"dtype": "bfloat16", "head_size": 256, "block_size": 16, "num_heads": 16, "num_kv_heads": 8,
     "seq_lens": [6000] + [300] * 7, "query_lens": [2048] + [1] * 7, "causal": True, "extra_width": 0,
     "alibi": False, "q_scale": 4.0, "window_size": 4096, "logits_soft_cap": 50.0},
    # Float8 caches: a long decode split into partitions, and a chunk beside decodes.
    {"dtype": "bfloat16", "head_size": 128, "block_size": 16, "num_heads": 32, "num_kv_heads": 8,
     "seq_lens": [65536, 300, 4097], "extra_width": 0, "alibi": False, "q_scale": 1.0,
     "kv_dtype": "float8_e4m3fn", "kv_scale_per_head": True},
    {"dtype": "float16", "head_size": 64, "block_size": 32, "num_heads": 16, "num_kv_heads": 2,
     "seq_lens": [3000] + [200] * 7, "query_lens": [1000] + [1] * 7, "causal": True, "extra_width": 0,
     "alibi": True, "q_scale": 1.0, "kv_dtype": "float8_e5m2", "kv_scale_per_head": False},
)


def draw_case(seed: int, index: int) -> dict:
    """Case ``index`` of the fuzz seeded with ``seed``: the same case in every process."""
    if index < len(FIXED_CASES):
        return dict(FIXED_CASES[index])
    rng = random.Random(f"{seed}:{index}")
    head_size = rng.choice(HEAD_SIZES)
    block_size = rng.choice(BLOCK_SIZES)
    num_kv_heads = rng.choice((1, 1, 2, 3, 4, 8))
    num_heads = rng.randint(1, 64) * num_kv_heads
    num_seqs = round(2 ** rng.uniform(0, math.log2(MAX_SEQS)))
    max_len = round(2 ** rng.uniform(0, math.log2(MAX_LEN)))
    style = rng.choice(("ragged", "ragged", "equal", "one_long"))
    if style == "equal":
        seq_lens = [max_len] * num_seqs
    elif style == "one_long":
        seq_lens = [max_len] + [rng.randint(1, max(1, max_len // 64)) for _ in range(num_seqs - 1)]
    else:
        seq_lens = [rng.randint(1, max_len) for _ in range(num_seqs)]
    # Under the budget: fewer sequences first, then a shorter one.
    per_token = num_kv_heads * head_size
    while len(seq_lens) > 1 and sum(seq_lens) * per_token > CACHE_ELEMENTS:
        seq_lens.pop()
    seq_lens[0] = min(seq_lens[0], CACHE_ELEMENTS // per_token)
    pages = -(-max(seq_lens) // block_size)
    case = {"dtype": rng.choice(list(DTYPES)), "head_size": head_size, "block_size": block_size,
            "num_heads": num_heads, "num_kv_heads": num_kv_heads, "seq_lens": seq_lens,
            "extra_width": rng.choice((0, 0, 1, 3, rng.randint(0, pages))), "alibi": rng.random() < 0.5,
            "q_scale": rng.choice((1.0, 1.0, 4.0))}
    if rng.random() < 0.5:
        case["query_lens"] = _draw_query_lens(rng, seq_lens, num_heads * head_size)
        case["causal"] = rng.random() < 0.8
    if case["dtype"] != "float32" and head_size % 16 == 0 and rng.random() < 0.25:
        case["kv_dtype"] = rng.choice(("float8_e4m3fn", "float8_e5m2"))
        case["kv_scale_per_head"] = rng.random() < 0.5
    if rng.random() < 1 / 3:
        case["window_size"] = rng.choice((None, 1, 7, 64, 1000, rng.randint(1, max(seq_lens))))
        case["logits_soft_cap"] = rng.choice((None, 5.0, 30.0))
        case["sinks"] = rng.random() < 0.5
    return case


def _draw_query_lens(rng: random.Random, seq_lens: list[int], row_elements: int) -> list[int]:
    """Query tokens of each sequence (at most its length), one style a batch or each its own, under the
    query and reference budgets: the costliest are cut first."""
    def one(seq_len: int, style: str) -> int:
        if style == "decode":
            return 1
        if style == "speculative":
            return min(seq_len, rng.randint(2, 8))
        if style == "chunk":
            return rng.randint(1, min(seq_len, 2048))
        if style == "prefill":
            return seq_len
        return rng.choice((0, 1, rng.randint(0, seq_len)))
    styles = ("decode", "speculative", "chunk", "prefill", "mixed")
    batch_style = rng.choice(styles + ("each",))
    query_lens = [one(n, batch_style if batch_style != "each" else rng.choice(styles)) for n in seq_lens]
    def work(i: int) -> int:
        return query_lens[i] * seq_lens[i]
    while (sum(query_lens) * row_elements > QUERY_ELEMENTS
           or sum(map(work, range(len(seq_lens)))) * row_elements > REFERENCE_WORK):
        costliest = max(range(len(query_lens)), key=work)
        query_lens[costliest] //= 2
    return query_lens


def _alibi_slopes(num_heads: int, device: torch.device) -> torch.Tensor:
    """The geometric ALiBi slopes of the ALiBi paper, float32 [num_heads]."""
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / num_heads) for i in range(num_heads)], dtype=torch.float32,
                        device=device)


def _make_inputs(case: dict, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """query [num_seqs, num_heads, head_size]; caches [num_blocks, block_size, num_kv_heads, head_size]
    with NaN in every slot no sequence holds; block_tables int32 [num_seqs, pages + extra_width] (a random
    permutation of the pages; unused entries point at spare NaN pages); seq_lens int32 [num_seqs]."""
    dev = torch.device("cuda")
    dtype = DTYPES[case["dtype"]]
    block_size, num_kv_heads, head_size = case["block_size"], case["num_kv_heads"], case["head_size"]
    lens = torch.tensor(case["seq_lens"], dtype=torch.int64, device=dev)  # [num_seqs]
    pages = (lens + block_size - 1) // block_size  # [num_seqs]
    total_pages = int(pages.sum())
    spare_pages = 3
    num_blocks = total_pages + spare_pages
    perm = torch.randperm(num_blocks, device=dev, generator=generator).to(torch.int32)
    used, spare = perm[:total_pages], perm[total_pages:]
    width = int(pages.max()) + case["extra_width"]
    num_seqs = len(case["seq_lens"])
    pick = torch.randint(0, spare_pages, (num_seqs, width), device=dev, generator=generator)
    block_tables = spare[pick]  # [num_seqs, width]
    seq_of_page = torch.repeat_interleave(torch.arange(num_seqs, device=dev), pages)  # [total_pages]
    first_page = torch.cumsum(pages, 0) - pages  # [num_seqs]
    page_in_seq = torch.arange(total_pages, device=dev) - first_page[seq_of_page]
    block_tables[seq_of_page, page_in_seq] = used
    if case.get("window_size") is not None:
        # Pages wholly before a sequence's first window are no query's: their entries point at NaN pages.
        query_lens = torch.tensor(case.get("query_lens", [1] * num_seqs), device=dev)
        first_key = lens - query_lens - case["window_size"] + 1  # [num_seqs]
        before = (torch.arange(width, device=dev)[None, :] + 1) * block_size <= first_key[:, None]
        block_tables = torch.where(before, spare[pick], block_tables)
    tokens = torch.zeros(num_blocks, dtype=torch.int64, device=dev)  # valid slots of each block
    tokens[used.long()] = (lens[seq_of_page] - page_in_seq * block_size).clamp(max=block_size)
    valid = torch.arange(block_size, device=dev)[None, :] < tokens[:, None]  # [num_blocks, block_size]
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    caches = [torch.randn(shape, dtype=dtype, device=dev, generator=generator)
              .masked_fill_(~valid[:, :, None, None], float("nan")) for _ in range(2)]
    num_rows = sum(case["query_lens"]) if "query_lens" in case else num_seqs
    query = (torch.randn(num_rows, case["num_heads"], head_size, device=dev, generator=generator)
             * case["q_scale"]).to(dtype)
    return query, caches[0], caches[1], block_tables, lens.to(torch.int32)


def _quantized(case: dict, caches: tuple[torch.Tensor, torch.Tensor], generator: torch.Generator
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """A float8 case's caches quantized with random scales (one, or one a KV head; NaN stays NaN), and the
    scales; a 16-bit case's caches as they are and no scales."""
    from tpkit.ops.paged_attention_reference import quantize_kv

    if "kv_dtype" not in case:
        return caches[0], caches[1], None, None
    kv_dtype = getattr(torch, case["kv_dtype"])
    shape = (case["num_kv_heads"],) if case["kv_scale_per_head"] else ()
    scales = [torch.rand(shape, device="cuda", generator=generator) * 0.05 + 0.005 for _ in range(2)]
    return (quantize_kv(caches[0], scales[0], kv_dtype), quantize_kv(caches[1], scales[1], kv_dtype),
            scales[0], scales[1])


def _query_start_loc(case: dict) -> torch.Tensor | None:
    """int32 [num_seqs + 1] on the GPU for a case with several query tokens a sequence, else None."""
    if "query_lens" not in case:
        return None
    starts = [0]
    for q_len in case["query_lens"]:
        starts.append(starts[-1] + q_len)
    return torch.tensor(starts, dtype=torch.int32, device="cuda")


def run_case(case: dict, seed: int) -> dict:
    """Runs one case on the GPU: {"ok", "detail"}; raises where CUDA fails (the worker then exits)."""
    from tpkit.ops import _extension
    from tpkit.ops.paged_attention_reference import paged_attention_reference

    generator = torch.Generator(device="cuda").manual_seed(seed)
    query, key_cache, value_cache, block_tables, seq_lens = _make_inputs(case, generator)
    key_cache, value_cache, k_scale, v_scale = _quantized(case, (key_cache, value_cache), generator)
    dtype, head_size = query.dtype, case["head_size"]
    scale = head_size ** -0.5
    slopes = _alibi_slopes(case["num_heads"], query.device) if case["alibi"] else None
    query_start_loc, causal = _query_start_loc(case), case.get("causal", True)
    sinks = (torch.randn(case["num_heads"], device=query.device, generator=generator) * 2
             if case.get("sinks") else None)
    variants = dict(window_size=case.get("window_size"), logits_soft_cap=case.get("logits_soft_cap"),
                    sinks=sinks)
    expected = torch.empty(query.shape, dtype=torch.float32, device=query.device)
    kv = (key_cache, value_cache) if k_scale is not None else (key_cache.float(), value_cache.float())
    paged_attention_reference(expected, query.float(), *kv, block_tables, seq_lens, scale, slopes,
                              query_start_loc, causal, k_scale, v_scale, **variants)
    out = torch.full_like(query, float("nan"))
    if not _extension.paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens, scale,
                                      slopes, query_start_loc, causal, k_scale, v_scale, **variants):
        return {"ok": False, "detail": "the CUDA extension did not build"}
    torch.cuda.synchronize()
    atol, rtol = TOLERANCES[dtype]
    excess = ((out.float() - expected).abs() - rtol * expected.abs()) / atol  # <= 1 within tolerance
    nan_rows = int(out.isnan().any(-1).sum())
    worst = float(excess.nan_to_num(float("inf")).max()) if excess.numel() else 0.0
    plan = _extension.launch_plan(query, key_cache, block_tables, query_start_loc, causal,
                                  case.get("window_size"))
    ok = nan_rows == 0 and worst <= 1.0
    return {"ok": ok, "detail": f"{nan_rows} NaN rows, error {worst:.2f} x tolerance, plan {plan}"}


def _worker(seed: int, start: int, stop: int) -> None:
    """Runs cases start..stop-1, one JSON line before and after each; exits at the first CUDA failure."""
    for index in range(start, stop):
        print(json.dumps({"index": index, "started": True}), flush=True)
        faulthandler.dump_traceback_later(CASE_TIMEOUT_S, exit=True)  # a hung case ends the worker
        result = run_case(draw_case(seed, index), seed * 1_000_003 + index)
        faulthandler.cancel_dump_traceback_later()
        print(json.dumps({"index": index, **result}), flush=True)


def _summary(case: dict) -> str:
    lens = case["seq_lens"]
    queries = ""
    if "query_lens" in case:
        q_lens = case["query_lens"]
        queries = (f", {sum(q_lens)} query tokens ({min(q_lens)}-{max(q_lens)} a sequence), "
                   f"causal {case['causal']}")
    variants = "".join(f", {k} {case[k]}" for k in ("kv_dtype", "kv_scale_per_head", "window_size",
                                                     "logits_soft_cap", "sinks") if case.get(k))
    return (f"{case['dtype']} head {case['head_size']} block {case['block_size']} "
            f"{case['num_heads']}:{case['num_kv_heads']} {len(lens)} seqs of {min(lens)}-{max(lens)} tokens, "
            f"table +{case['extra_width']}, alibi {case['alibi']}, q x{case['q_scale']}{queries}{variants}")


def test_paged_attention_fuzz() -> None:
    t0 = time.perf_counter()
    failures: list[str] = []
    start = 0
    while start < CASES:
        timeout = 60 + CASE_TIMEOUT_S * (CASES - start)  # the worker's own watchdog ends a hung case first
        cmd = [sys.executable, os.path.abspath(__file__), str(SEED), str(start), str(CASES)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
            stdout, stderr, code = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            stdout, stderr, code = exc.stdout or "", exc.stderr or "", "timeout"
            stdout = stdout.decode() if isinstance(stdout, bytes) else stdout
            stderr = stderr.decode() if isinstance(stderr, bytes) else stderr
        last_started, last_done = start - 1, start - 1
        records = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
        tail = " | ".join(stderr.strip().splitlines()[-3:])
        assert records, f"the fuzz worker ran no case ({code}): {tail}"
        for record in records:
            if record.get("started"):
                last_started = record["index"]
                continue
            last_done = record["index"]
            if not record["ok"]:
                failures.append(f"case {last_done}: {_summary(draw_case(SEED, last_done))}: "
                                f"{record['detail']}")
        if last_done == CASES - 1:
            break
        crashed = max(last_started, last_done + 1)
        failures.append(f"case {crashed}: {_summary(draw_case(SEED, crashed))}: worker ended ({code}): "
                        f"{tail}")
        start = crashed + 1
    print(f"paged-attention fuzz: {CASES} cases (seed {SEED}) in {time.perf_counter() - t0:.1f} s, "
          f"{len(failures)} failed")
    assert not failures, f"{len(failures)} of {CASES} cases failed:\n" + "\n".join(failures[:20])


if __name__ == "__main__":
    _worker(*(int(arg) for arg in sys.argv[1:4]))
