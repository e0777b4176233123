"""paged_attention's variants (sliding window, logit soft-capping, attention sinks) against a naive float64
loop, one-token and multi-token, with ALiBi, GQA and causal on and off; and their bad inputs.

Cases are seeded random draws over make_case's paged inputs (NaN in every unwritten cache slot, garbage in
block tables past each sequence's blocks), so a key outside the window that were read would show as NaN.
"""

import math
import random

import pytest
import torch
from cuda_graphs import capture
from test_paged_attention import TOLERANCE, make_case
from test_paged_attention_multitoken import make_multitoken_case

from tpkit.attention import paged_attention


def naive_variants(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale, *,
                   alibi_slopes=None, causal=True, window_size=None, logits_soft_cap=None, sinks=None):
    """One sequence and one query token at a time, float64: the definition of the variants. Without
    ``query_start_loc`` a row is a sequence's one (last) token."""
    num_rows, num_heads, head_size = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    kv_head = torch.arange(num_heads) // (num_heads // num_kv_heads)  # [num_heads]
    starts = list(range(num_rows + 1)) if query_start_loc is None else query_start_loc.tolist()
    out = torch.zeros(num_rows, num_heads, head_size, dtype=torch.float64)
    for i in range(len(seq_lens)):
        seq_len, q_len = int(seq_lens[i]), starts[i + 1] - starts[i]
        for j in range(q_len):
            query_pos = seq_len - q_len + j
            last = query_pos + 1 if causal and query_start_loc is not None else seq_len
            first = 0 if window_size is None else max(0, query_pos - window_size + 1)
            positions = torch.arange(first, last)  # the keys this query sees, and only those are read
            blocks = block_tables[i].long()[positions // block_size]
            keys = key_cache[blocks, positions % block_size].double()[:, kv_head]  # [keys, num_heads, D]
            values = value_cache[blocks, positions % block_size].double()[:, kv_head]
            scores = torch.einsum("hd,khd->hk", query[starts[i] + j].double(), keys) * scale
            if logits_soft_cap is not None:
                scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
            if alibi_slopes is not None:
                scores = scores + alibi_slopes.double()[:, None] * (positions - query_pos).double()
            if sinks is not None:
                scores = torch.cat([scores, sinks.double()[:, None]], dim=1)
            probs = torch.softmax(scores, dim=-1)[:, :last - first]  # a sink's weight has no value
            out[starts[i] + j] = torch.einsum("hk,khd->hd", probs, values)
    return out


def _draw(rng: random.Random, seed: int) -> tuple[dict, dict]:
    """A random case (decode or multi-token) and a random combination of the variants, at least one on."""
    num_kv_heads = rng.choice([1, 2])
    num_heads = num_kv_heads * rng.choice([1, 2])
    seq_lens = [rng.choice([0, 1, rng.randint(2, 40)]) for _ in range(rng.randint(1, 3))]
    common = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=rng.choice([16, 32]),
                  block_size=rng.choice([4, 8]), seq_lens=seq_lens, dtype=torch.float32,
                  alibi=rng.random() < 0.3, seed=seed)
    if rng.random() < 0.4:
        case = make_case(**common)
        case["query_start_loc"] = None
    else:
        query_lens = [rng.randint(0, n) for n in seq_lens]
        case = make_multitoken_case(query_lens=query_lens, **common)
    while True:
        variants = dict(window_size=rng.choice([None, 1, 3, 8]),
                        logits_soft_cap=rng.choice([None, 0.5, 5.0]),
                        causal=rng.random() < 0.8)
        gen = torch.Generator().manual_seed(seed)
        variants["sinks"] = torch.randn(num_heads, generator=gen) if rng.random() < 0.5 else None
        if any(variants[k] is not None for k in ("window_size", "logits_soft_cap", "sinks")):
            break
    if variants["window_size"] is not None:
        # Table entries of blocks wholly before every query's window are never read: garbage there.
        starts = (case["query_start_loc"] if case["query_start_loc"] is not None
                  else torch.arange(len(seq_lens) + 1)).tolist()
        block_size = common["block_size"]
        for i, seq_len in enumerate(seq_lens):
            first = seq_len - (starts[i + 1] - starts[i]) - variants["window_size"] + 1
            case["block_tables"][i, :max(0, first) // block_size] = -(10**6)
    return case, variants


@pytest.mark.parametrize("seed", range(24))
def test_variants_match_naive_loop(seed):
    case, variants = _draw(random.Random(seed), seed)
    scale = 1 / math.sqrt(case["query"].shape[-1])
    out = paged_attention(case["query"], case["key_cache"], case["value_cache"], case["block_tables"],
                          case["seq_lens"], alibi_slopes=case["alibi_slopes"],
                          query_start_loc=case["query_start_loc"], **variants)
    expected = naive_variants(case["query"], case["key_cache"], case["value_cache"], case["block_tables"],
                              case["seq_lens"], case["query_start_loc"], scale,
                              alibi_slopes=case["alibi_slopes"], **variants)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), expected, atol=TOLERANCE[torch.float32],
                               rtol=TOLERANCE[torch.float32])


def test_window_reads_only_the_window():
    """A decode query with a window of 3 over 20 keys: the keys before the window are never read (NaN
    there changes nothing), nor the table entries of blocks before it (garbage there is no error), and the
    window changes the result (against no window)."""
    case = make_case(num_heads=2, num_kv_heads=1, head_size=16, block_size=4, seq_lens=[20],
                     dtype=torch.float32)
    args = (case["query"], case["key_cache"], case["value_cache"], case["block_tables"], case["seq_lens"])
    windowed = paged_attention(*args, window_size=3)
    full = paged_attention(*args)
    assert not torch.allclose(windowed, full)
    block = int(case["block_tables"][0, 0])
    case["key_cache"][block] = float("nan")  # positions 0..3, all outside the window 17..19
    assert torch.equal(paged_attention(*args, window_size=3), windowed)
    case["block_tables"][0, :4] = -7  # positions 0..15
    assert torch.equal(paged_attention(*args, window_size=3), windowed)
    with pytest.raises(ValueError, match=r"block_tables\[0, 0\]: expected a block index"):
        paged_attention(*args)  # without the window it reads them


def test_sinks_nan_propagates():
    """A NaN sink gives NaN for its head only, never zeros."""
    case = make_case(num_heads=2, num_kv_heads=2, head_size=16, block_size=4, seq_lens=[5],
                     dtype=torch.float32)
    sinks = torch.tensor([float("nan"), 0.5])
    out = paged_attention(case["query"], case["key_cache"], case["value_cache"], case["block_tables"],
                          case["seq_lens"], sinks=sinks)
    assert out[0, 0].isnan().all() and not out[0, 1].isnan().any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("multi", [False, True])
@pytest.mark.parametrize("dtype, head_size",
                         [(torch.bfloat16, 128), (torch.float16, 64), (torch.float32, 32)])
def test_variants_on_gpu_in_cuda_graph(multi, dtype, head_size):
    """On a GPU the CUDA kernel runs the variants (it takes them: True), against the naive loop, and its
    replay from a captured graph gives the eager result."""
    from tpkit.ops import _extension

    common = dict(num_heads=4, num_kv_heads=2, head_size=head_size, block_size=16, seq_lens=[40, 7, 300],
                  dtype=dtype)
    case = (make_multitoken_case(query_lens=[3, 7, 100], **common) if multi
            else dict(make_case(**common), query_start_loc=None))
    # Garbage in the table entries of the blocks before every query's window: never read.
    case["block_tables"][2, :(300 - (100 if multi else 1) - 8 + 1) // 16] = -(10**6)
    cuda = {k: v.cuda() for k, v in case.items() if isinstance(v, torch.Tensor)}
    qsl = cuda.get("query_start_loc")
    variants = dict(window_size=8, logits_soft_cap=20.0, sinks=torch.randn(4, device="cuda"))
    args = (cuda["query"], cuda["key_cache"], cuda["value_cache"], cuda["block_tables"], cuda["seq_lens"])
    out = torch.full_like(cuda["query"], float("nan"))
    assert _extension.paged_attention(out, *args, 1 / math.sqrt(head_size), None, qsl, True, **variants)
    eager = paged_attention(*args, query_start_loc=qsl, **variants)
    torch.testing.assert_close(eager, out)
    expected = naive_variants(case["query"], case["key_cache"], case["value_cache"], case["block_tables"],
                              case["seq_lens"], case["query_start_loc"], 1 / math.sqrt(head_size),
                              window_size=8, logits_soft_cap=20.0, sinks=variants["sinks"].cpu())
    torch.testing.assert_close(eager.cpu().double(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    graph, replayed = capture(lambda: paged_attention(*args, query_start_loc=qsl, **variants))
    graph.replay()
    torch.testing.assert_close(replayed, eager)


def _small_case():
    return make_case(num_heads=2, num_kv_heads=1, head_size=16, block_size=4, seq_lens=[5],
                     dtype=torch.float32)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(window_size=0), ValueError, r"window_size: expected an int >= 1 .*got 0"),
    (dict(window_size=2.0), TypeError, "window_size: expected an int or None, got float"),
    (dict(window_size=True), TypeError, "window_size: expected an int or None, got bool"),
    (dict(logits_soft_cap=0.0), ValueError, "logits_soft_cap: expected a finite float > 0, got 0.0"),
    (dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap: expected a finite float > 0, got -1.0"),
    (dict(logits_soft_cap=float("inf")), ValueError, "logits_soft_cap: expected a finite float > 0, got inf"),
    (dict(logits_soft_cap="30"), TypeError, "logits_soft_cap: expected a float or None, got str"),
    (dict(sinks=torch.zeros(3)), ValueError, r"sinks: expected shape \[num_heads\] \[2\], got \[3\]"),
    (dict(sinks=torch.zeros(2, dtype=torch.float16)), TypeError, "sinks: expected dtype torch.float32"),
    (dict(sinks=torch.zeros(1, 2)), ValueError, "sinks: expected 1 dimensions"),
    (dict(sinks=[0.0, 0.0]), TypeError, "sinks: expected a torch.Tensor or None, got list"),
])
def test_bad_variant_arguments(kwargs, error, match):
    case = _small_case()
    out = torch.full_like(case["query"], 7.0)
    with pytest.raises(error, match=match):
        paged_attention(case["query"], case["key_cache"], case["value_cache"], case["block_tables"],
                        case["seq_lens"], out=out, **kwargs)
    assert (out == 7.0).all()  # nothing written


def test_bad_variant_arguments_of_the_op_itself():
    """The op checks them too (a direct call, or torch.compile's trace)."""
    case = _small_case()
    args = (torch.empty_like(case["query"]), case["query"], case["key_cache"], case["value_cache"],
            case["block_tables"], case["seq_lens"], 0.25, None, None, True, None, None)  # no k/v scales
    with pytest.raises(ValueError, match="window_size: expected an int >= 1"):
        torch.ops.tpkit.paged_attention(*args, -4, None, None)
    with pytest.raises(ValueError, match="logits_soft_cap: expected a finite float > 0"):
        torch.ops.tpkit.paged_attention(*args, None, float("nan"), None)


def _naive_sequence(q, k, v, *, window_size, logits_soft_cap, sinks):
    """Causal attention of one sequence in float64: q [seq, num_heads, D], k, v [seq, num_kv_heads, D]."""
    seq, num_heads, head_size = q.shape
    group = num_heads // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    out = torch.empty(seq, num_heads, head_size, dtype=torch.float64)
    for p in range(seq):
        first = 0 if window_size is None else max(0, p - window_size + 1)
        scores = torch.einsum("hd,khd->hk", q[p].double(), k[first:p + 1]) / math.sqrt(head_size)
        if logits_soft_cap is not None:
            scores = logits_soft_cap * torch.tanh(scores / logits_soft_cap)
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[:, None]], dim=1)
        probs = torch.softmax(scores, dim=-1)[:, :p + 1 - first]
        out[p] = torch.einsum("hk,khd->hd", probs, v[first:p + 1])
    return out


@pytest.mark.parametrize("variants", [
    dict(window_size=4),
    dict(logits_soft_cap=2.0),
    dict(sinks=torch.tensor([0.5, -1.0, 2.0, 0.0])),
    dict(window_size=3, logits_soft_cap=1.5, sinks=torch.tensor([1.0, 0.0, -0.5, 0.3])),
])
def test_attention_module_variants_with_and_without_cache(variants):
    """The module's variants without a cache (SDPA with a mask, or the attention written out) and through
    the paged cache (a packed prefill, then decode steps) equal the naive loop."""
    from tpkit.attention import Attention, PagedKVCache

    num_heads, num_kv_heads, head_size, lens, steps = 4, 2, 16, [9, 5], 3
    gen = torch.Generator().manual_seed(3)
    total = max(lens) + steps
    q = torch.randn(2, total, num_heads * head_size, generator=gen)
    k = torch.randn(2, total, num_kv_heads * head_size, generator=gen)
    v = torch.randn(2, total, num_kv_heads * head_size, generator=gen)
    attention = Attention(num_heads, head_size, num_kv_heads, **variants)
    naive_kwargs = dict(window_size=None, logits_soft_cap=None, sinks=None) | variants
    expected = [_naive_sequence(q[i].unflatten(-1, (num_heads, head_size)),
                                k[i].unflatten(-1, (num_kv_heads, head_size)),
                                v[i].unflatten(-1, (num_kv_heads, head_size)), **naive_kwargs)
                for i in range(2)]
    no_cache = attention(q, k, v).unflatten(-1, (num_heads, head_size))
    for i in range(2):
        torch.testing.assert_close(no_cache[i].double(), expected[i], atol=1e-5, rtol=1e-5)

    cache = PagedKVCache(1, 16, 4, num_kv_heads, head_size, dtype=torch.float32, device="cpu")
    metadata = cache.prefill_metadata([0, 1], lens)
    rows = lambda x: torch.cat([x[i, :n] for i, n in enumerate(lens)])[None]  # noqa: E731
    out = attention(rows(q), rows(k), rows(v), kv_cache=cache, layer_idx=0, metadata=metadata)
    out = out[0].unflatten(-1, (num_heads, head_size)).split(lens)
    for i, n in enumerate(lens):
        torch.testing.assert_close(out[i].double(), expected[i][:n], atol=1e-5, rtol=1e-5)
    for step in range(steps):
        positions = torch.tensor([n + step for n in lens])
        new = [x[torch.arange(2), positions][:, None] for x in (q, k, v)]  # [2, 1, width] each
        out = attention(*new, kv_cache=cache, layer_idx=0, metadata=cache.decode_metadata([0, 1]))
        for i in range(2):
            torch.testing.assert_close(out[i, 0].unflatten(-1, (num_heads, head_size)).double(),
                                       expected[i][positions[i]], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kwargs, match", [
    (dict(window_size=0), "window_size: expected None or an int >= 1, got 0"),
    (dict(window_size=4, causal=False), "window_size: expected None for causal=False"),
    (dict(logits_soft_cap=-3.0), "logits_soft_cap: expected None or a finite number > 0, got -3.0"),
    (dict(sinks=torch.zeros(3)),
     r"sinks: expected None or a float32 tensor of shape \[4\] \(num_heads\), got torch.float32 of "
     r"shape \[3\]"),
    (dict(sinks=torch.zeros(4, dtype=torch.bfloat16)), "sinks: expected .* got torch.bfloat16"),
])
def test_attention_module_bad_variants(kwargs, match):
    from tpkit.attention import Attention

    with pytest.raises(ValueError, match=match):
        Attention(4, 16, 2, **kwargs)
