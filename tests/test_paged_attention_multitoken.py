"""paged_attention with query_start_loc (several query tokens a sequence) against a naive float64 loop.

Cases are seeded random draws: ragged sequences (q_len 0 included), cached prefixes of any length, GQA/MQA,
ALiBi, causal on and off, every dtype and a spread of head and block sizes; caches hold NaN wherever no
token was written and block tables garbage past each sequence's blocks (see test_paged_attention).
"""

import math
import random

import pytest
import torch
from cuda_graphs import capture
from test_paged_attention import TOLERANCE, assert_compiled_step_matches_eager, make_case

import tpkit.ops.paged_attention_reference as reference
from tpkit.attention import paged_attention, reshape_and_cache


def naive_multitoken(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                     alibi_slopes, causal):
    """One sequence and one query token at a time, float64: the definition of the op."""
    num_tokens, num_heads, head_size = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    kv_head = torch.arange(num_heads) // (num_heads // num_kv_heads)  # [num_heads]
    out = torch.zeros(num_tokens, num_heads, head_size, dtype=torch.float64)
    starts = query_start_loc.tolist()
    for i in range(len(seq_lens)):
        seq_len, q_len = int(seq_lens[i]), starts[i + 1] - starts[i]
        positions = torch.arange(seq_len)
        blocks = block_tables[i].long()[positions // block_size]
        keys = key_cache[blocks, positions % block_size].double()[:, kv_head]  # [seq_len, num_heads, D]
        values = value_cache[blocks, positions % block_size].double()[:, kv_head]
        for j in range(q_len):
            query_pos = seq_len - q_len + j
            limit = query_pos + 1 if causal else seq_len
            q = query[starts[i] + j].double()  # [num_heads, D]
            scores = torch.einsum("hd,khd->hk", q, keys[:limit]) * scale  # [num_heads, limit]
            if alibi_slopes is not None:
                scores = scores + alibi_slopes.double()[:, None] * (torch.arange(limit) - query_pos).double()
            out[starts[i] + j] = torch.einsum("hk,khd->hd", torch.softmax(scores, dim=-1), values[:limit])
    return out


def make_multitoken_case(*, num_heads, num_kv_heads, head_size, block_size, seq_lens, query_lens, dtype,
                         alibi=False, seed=0):
    """make_case's paged K/V for sequences of ``seq_lens`` tokens, the last ``query_lens`` of each queried."""
    case = make_case(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                     block_size=block_size, seq_lens=seq_lens, dtype=dtype, alibi=alibi, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1000)
    case["query"] = torch.randn(sum(query_lens), num_heads, head_size, generator=gen).to(dtype)
    starts = [0]
    for q_len in query_lens:
        starts.append(starts[-1] + q_len)
    case["query_start_loc"] = torch.tensor(starts, dtype=torch.int32)
    return case


def run_op(case, *, causal=True, scale=None, **kwargs):
    return paged_attention(case["query"], case["key_cache"], case["value_cache"], case["block_tables"],
                           case["seq_lens"], scale=scale, alibi_slopes=case.get("alibi_slopes"),
                           query_start_loc=case["query_start_loc"], causal=causal, **kwargs)


def check_against_naive(case, *, causal=True, scale=None):
    out = run_op(case, causal=causal, scale=scale)
    if scale is None:
        scale = 1 / math.sqrt(case["query"].shape[-1])
    expected = naive_multitoken(case["query"], case["key_cache"], case["value_cache"], case["block_tables"],
                                case["seq_lens"], case["query_start_loc"], scale, case.get("alibi_slopes"),
                                causal)
    assert out.dtype == case["query"].dtype and out.shape == case["query"].shape
    assert not out.isnan().any()
    tol = TOLERANCE[out.dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


def _draw_case(rng: random.Random, seed: int) -> tuple[dict, bool]:
    """Random sequences: a cached prefix of 0..70 tokens and 0..40 query tokens each (0 and 1 frequent)."""
    num_kv_heads = rng.choice([1, 2, 4])
    num_heads = num_kv_heads * rng.choice([1, 2, 3, 8])
    block_size = rng.choice([1, 8, 16, 32])
    head_size = rng.choice([16, 32, 64, 80, 128, 256])
    query_lens, seq_lens = [], []
    for _ in range(rng.randint(1, 5)):
        q_len = rng.choice([0, 1, 1, 2, 4, rng.randint(0, 40)])
        cached = rng.choice([0, 0, rng.randint(0, 70)])
        query_lens.append(q_len)
        seq_lens.append(cached + q_len)
    if max(seq_lens) == 0:
        seq_lens[0] = query_lens[0] = 3
    case = make_multitoken_case(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                                block_size=block_size, seq_lens=seq_lens, query_lens=query_lens,
                                dtype=rng.choice([torch.float32, torch.float16, torch.bfloat16]),
                                alibi=rng.random() < 0.3, seed=seed)
    return case, rng.random() < 0.7


@pytest.mark.parametrize("seed", range(24))
def test_random_steps_match_naive(seed):
    case, causal = _draw_case(random.Random(seed), seed)
    check_against_naive(case, causal=causal)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (12, 1)])
def test_head_ratios_causality_dtypes_with_alibi(num_heads, num_kv_heads, causal, dtype):
    """Prefill from scratch, a chunk after a cached prefix, speculative tokens, a decode and an idle
    sequence, in one call."""
    case = make_multitoken_case(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=64, block_size=16,
                                seq_lens=[21, 50, 37, 9, 4], query_lens=[21, 13, 4, 1, 0], dtype=dtype,
                                alibi=True, seed=num_heads)
    check_against_naive(case, causal=causal, scale=0.2)


def test_one_token_a_sequence_equals_the_decode_call():
    case = make_multitoken_case(num_heads=8, num_kv_heads=2, head_size=64, block_size=16,
                                seq_lens=[17, 1, 40, 33], query_lens=[1, 1, 1, 1], dtype=torch.float32,
                                alibi=True, seed=3)
    decode = paged_attention(case["query"], case["key_cache"], case["value_cache"], case["block_tables"],
                             case["seq_lens"], alibi_slopes=case["alibi_slopes"])
    for causal in (True, False):
        torch.testing.assert_close(run_op(case, causal=causal), decode, rtol=1e-6, atol=1e-6)


def test_a_mixed_step_equals_its_parts():
    """One call over a prefill chunk and decodes gives what one call per sequence gives."""
    case = make_multitoken_case(num_heads=4, num_kv_heads=2, head_size=32, block_size=8,
                                seq_lens=[30, 12, 5], query_lens=[9, 1, 1], dtype=torch.float32, seed=4)
    mixed = run_op(case)
    starts = case["query_start_loc"].tolist()
    for i in range(3):
        part = dict(case, query=case["query"][starts[i]:starts[i + 1]],
                    block_tables=case["block_tables"][i:i + 1], seq_lens=case["seq_lens"][i:i + 1],
                    query_start_loc=torch.tensor([0, starts[i + 1] - starts[i]], dtype=torch.int32))
        torch.testing.assert_close(run_op(part), mixed[starts[i]:starts[i + 1]], rtol=1e-6, atol=1e-6)


def test_no_tokens_and_idle_sequences():
    case = make_multitoken_case(num_heads=4, num_kv_heads=2, head_size=32, block_size=8, seq_lens=[5, 0, 7],
                                query_lens=[0, 0, 0], dtype=torch.float16, seed=5)
    assert run_op(case).shape == (0, 4, 32)
    empty = dict(case, block_tables=case["block_tables"][:0], seq_lens=case["seq_lens"][:0],
                 query_start_loc=torch.zeros(1, dtype=torch.int32))
    assert run_op(empty).shape == (0, 4, 32)


@pytest.mark.parametrize("chunk_elements,seq_lens,query_lens,causal", [
    (1 << 12, [300, 0, 40, 3], [12, 0, 6, 1], True),  # one row at a time over pieces of the table
    (1 << 12, [300, 0, 40, 3], [12, 0, 6, 1], False),
    (1 << 14, [100, 0, 60, 3], [40, 0, 60, 1], True),  # the whole table, a few rows at a time
], ids=["kv-pieces-causal", "kv-pieces-bidirectional", "row-chunks"])
def test_long_sequences_over_several_chunks(chunk_elements, seq_lens, query_lens, causal, monkeypatch):
    """With a small budget the reference splits the work over chunks of rows or of KV blocks, merged by
    log-sum-exp."""
    monkeypatch.setattr(reference, "CHUNK_ELEMENTS", chunk_elements)
    case = make_multitoken_case(num_heads=4, num_kv_heads=2, head_size=16, block_size=16, seq_lens=seq_lens,
                                query_lens=query_lens, dtype=torch.float32, alibi=True, seed=6)
    check_against_naive(case, causal=causal)


def test_nan_propagates_and_only_keyless_rows_are_zero():
    """A NaN key reaches exactly the queries that attend to it (causal: those at or after its position); a
    NaN query poisons only its own row. Nothing is turned into zeros."""
    case = make_multitoken_case(num_heads=2, num_kv_heads=1, head_size=16, block_size=4, seq_lens=[10, 6],
                                query_lens=[6, 3], dtype=torch.float32, seed=7)
    block = int(case["block_tables"][0, 1])
    case["key_cache"][block, 2] = float("nan")  # sequence 0's position 6: its query tokens 2..5 see it
    case["query"][7, 1] = float("nan")  # sequence 1's second query token, head 1
    out = run_op(case)
    assert out[:2].isfinite().all() and out[2:6].isnan().all()
    assert out[7, 1].isnan().all() and out[[6, 8]].isfinite().all() and out[7, 0].isfinite().all()
    assert run_op(case, causal=False)[:6].isnan().all()
    decode = dict(case, query=torch.full((2, 2, 16), float("nan")), query_start_loc=None,
                  seq_lens=torch.tensor([0, 6], dtype=torch.int32))
    out = paged_attention(decode["query"], decode["key_cache"], decode["value_cache"], decode["block_tables"],
                          decode["seq_lens"])
    assert torch.equal(out[0], torch.zeros(2, 16)) and out[1].isnan().all()


def test_opcheck():
    case = make_multitoken_case(num_heads=4, num_kv_heads=2, head_size=32, block_size=8, seq_lens=[9, 0, 20],
                                query_lens=[3, 0, 20], dtype=torch.float32, alibi=True, seed=8)
    for cache in (case["key_cache"], case["value_cache"]):
        cache.nan_to_num_(0.0)
    args = (torch.empty_like(case["query"]), case["query"], case["key_cache"], case["value_cache"],
            case["block_tables"], case["seq_lens"], 0.25, case["alibi_slopes"], case["query_start_loc"],
            False)
    torch.library.opcheck(torch.ops.tpkit.paged_attention.default, args)


def test_torch_compile_fullgraph():
    """The cache write and the multi-token op trace into one graph (the fake implementation checks shapes
    without reading the CPU tensors' contents) and run compiled."""
    case = make_multitoken_case(num_heads=4, num_kv_heads=2, head_size=32, block_size=8,
                                seq_lens=[9, 3, 20], query_lens=[2, 3, 5], dtype=torch.float32, seed=9)
    key, value = torch.randn(10, 2, 32), torch.randn(10, 2, 32)
    # The query tokens' own K/V, rewritten where they already are.
    slots = [int(case["block_tables"][i, p // 8]) * 8 + p % 8
             for i, (n, q) in enumerate([(9, 2), (3, 3), (20, 5)]) for p in range(n - q, n)]
    slot_mapping = torch.tensor(slots)

    def step(query, key, value, key_cache, value_cache):
        reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        return paged_attention(query * 2, key_cache, value_cache, case["block_tables"], case["seq_lens"],
                               query_start_loc=case["query_start_loc"]) + 1

    assert_compiled_step_matches_eager(step, case, key, value)


def _valid_case():
    return make_multitoken_case(num_heads=4, num_kv_heads=2, head_size=32, block_size=8, seq_lens=[9, 3, 5],
                                query_lens=[4, 3, 0], dtype=torch.float16, seed=10)


def _starts(*values):
    return torch.tensor(values, dtype=torch.int32)


BAD_ARGS = [
    ("query_start_loc", lambda a: a["query_start_loc"].long(), TypeError,
     r"query_start_loc: expected dtype torch.int32, got torch.int64"),
    ("query_start_loc", lambda a: a["query_start_loc"][:-1], ValueError,
     r"query_start_loc: expected shape \[num_seqs \+ 1\] \(num_seqs that of block_tables\) \[4\], got \[3\]"),
    ("query_start_loc", lambda a: a["query_start_loc"][None], ValueError,
     r"query_start_loc: expected 1 dimensions, got shape \[1, 4\]"),
    ("query_start_loc", lambda a: a["query_start_loc"].to("meta"), ValueError,
     r"query_start_loc: expected device cpu \(the device of query\), got meta"),
    ("seq_lens", lambda a: a["seq_lens"][:2], ValueError,
     r"seq_lens: expected shape \[num_seqs\] \(that of block_tables\) \[3\], got \[2\]"),
    ("query_start_loc", lambda a: _starts(1, 4, 7, 7), ValueError,
     r"query_start_loc\[0\]: expected 0, got 1"),
    ("query_start_loc", lambda a: _starts(0, 5, 4, 7), ValueError,
     r"query_start_loc: expected non-decreasing entries, got query_start_loc\[2\] = 4 after "
     r"query_start_loc\[1\] = 5"),
    ("query_start_loc", lambda a: _starts(0, 4, 6, 6), ValueError,
     r"query_start_loc\[3\]: expected num_tokens = 7 \(dim 0 of query\), got 6"),
    ("query_start_loc", lambda a: _starts(0, 1, 5, 7), ValueError,
     r"query_start_loc: expected at most seq_lens\[1\] = 3 query tokens for sequence 1 \(its last tokens in "
     r"the cache\), got 4"),
    ("causal", lambda a: 1, TypeError, r"causal: expected a bool, got int"),
    ("block_tables", lambda a: a["block_tables"][:0], ValueError,
     r"query: expected no tokens \(num_tokens 0\) for no sequences \(block_tables has 0 rows\), got shape "
     r"\[7, 4, 32\]"),
]


@pytest.mark.parametrize("name,make_bad,error,message", BAD_ARGS,
                         ids=[f"{i}-{arg[0]}" for i, arg in enumerate(BAD_ARGS)])
def test_validation_errors(name, make_bad, error, message, monkeypatch):
    """Shapes are always checked; a CPU query_start_loc's contents too, without TPKIT_DEBUG."""
    monkeypatch.delenv("TPKIT_DEBUG", raising=False)
    case = _valid_case()
    run_op(case)  # valid as drawn
    bad = make_bad(case)
    if name == "block_tables":
        case.update(block_tables=bad, seq_lens=case["seq_lens"][:0], query_start_loc=_starts(0))
    elif name != "causal":
        case[name] = bad
    with pytest.raises(error, match=message):
        run_op(case, causal=bad if name == "causal" else True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_runs_several_tokens_in_a_graph():
    """On a GPU the multi-token kernel gives the CPU's result, also replayed from a CUDA graph: nothing in
    it reads tensor contents on the host."""
    case = make_multitoken_case(num_heads=8, num_kv_heads=2, head_size=128, block_size=16,
                                seq_lens=[300, 17, 5, 64], query_lens=[40, 17, 1, 0], dtype=torch.bfloat16,
                                alibi=True, seed=11)
    expected = run_op(case)
    gpu = {name: None if value is None else value.cuda() for name, value in case.items()}
    torch.testing.assert_close(run_op(gpu).cpu(), expected, rtol=0, atol=TOLERANCE[torch.bfloat16])
    graph, out = capture(lambda: run_op(gpu))
    out.zero_()
    graph.replay()
    torch.testing.assert_close(out.cpu(), expected, rtol=0, atol=TOLERANCE[torch.bfloat16])
