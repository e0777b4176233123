"""paged_attention on the CPU against a naive per-sequence loop in float64."""

import math

import pytest
import torch

import tpkit.ops.paged_attention_reference as reference
from tpkit.attention import paged_attention, reshape_and_cache

HEAD_SIZES = (32, 64, 80, 96, 112, 120, 128, 192, 256)
BLOCK_SIZES = (8, 16, 32)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def naive_paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, alibi_slopes):
    """One sequence and one head at a time, float64: the definition of the op."""
    num_seqs, num_heads, head_size = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(num_seqs, num_heads, head_size, dtype=torch.float64)
    for i in range(num_seqs):
        seq_len = int(seq_lens[i])
        if seq_len == 0:
            continue
        positions = torch.arange(seq_len)
        blocks = block_tables[i].long()[positions // block_size]
        keys = key_cache[blocks, positions % block_size].double()  # [seq_len, num_kv_heads, head_size]
        values = value_cache[blocks, positions % block_size].double()
        for h in range(num_heads):
            scores = keys[:, h // group] @ query[i, h].double() * scale  # [seq_len]
            if alibi_slopes is not None:
                scores = scores + float(alibi_slopes[h]) * (positions - (seq_len - 1)).double()
            out[i, h] = torch.softmax(scores, dim=0) @ values[:, h // group]
    return out


def make_case(*, num_heads, num_kv_heads, head_size, block_size, seq_lens, dtype, alibi=False, seed=0):
    """Random paged inputs: blocks handed out in a random (never identity) order, every cache slot not
    holding a token set to NaN, table entries past each sequence's blocks set to garbage."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    order = torch.randperm(num_blocks, generator=gen)
    if torch.equal(order, torch.arange(num_blocks)):
        order = order.roll(1)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_size)
    key_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    value_cache = torch.full(cache_shape, float("nan"), dtype=dtype)
    max_blocks = max(blocks_needed) + 1
    block_tables = torch.randint(-10**6, 10**6, (len(seq_lens), max_blocks), generator=gen, dtype=torch.int32)
    start = 0
    for i, (seq_len, needed) in enumerate(zip(seq_lens, blocks_needed, strict=True)):
        blocks = order[start:start + needed]
        start += needed
        block_tables[i, :needed] = blocks.int()
        positions = torch.arange(seq_len)
        for cache in (key_cache, value_cache):
            cache[blocks[positions // block_size], positions % block_size] = torch.randn(
                seq_len, num_kv_heads, head_size, generator=gen).to(dtype)
    query = torch.randn(len(seq_lens), num_heads, head_size, generator=gen).to(dtype)
    # Slopes as ALiBi makes them (2^-8k/n), times a random factor so heads differ irregularly.
    alibi_slopes = None
    if alibi:
        alibi_slopes = 2.0 ** (-8.0 * torch.arange(1, num_heads + 1) / num_heads)
        alibi_slopes = (alibi_slopes * (0.5 + torch.rand(num_heads, generator=gen))).float()
    return dict(query=query, key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32), alibi_slopes=alibi_slopes)


def check_against_naive(case, scale=None):
    out = paged_attention(case["query"], case["key_cache"], case["value_cache"], case["block_tables"],
                          case["seq_lens"], scale=scale, alibi_slopes=case["alibi_slopes"])
    if scale is None:
        scale = 1 / math.sqrt(case["query"].shape[-1])
    expected = naive_paged_attention(case["query"], case["key_cache"], case["value_cache"],
                                     case["block_tables"], case["seq_lens"], scale, case["alibi_slopes"])
    assert out.dtype == case["query"].dtype and out.shape == case["query"].shape
    assert not out.isnan().any()
    tol = TOLERANCE[out.dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)
    empty = case["seq_lens"] == 0
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
def test_every_head_and_block_size(head_size, block_size, dtype):
    index = HEAD_SIZES.index(head_size) + BLOCK_SIZES.index(block_size)
    seq_lens = [0, 1, block_size - 1, block_size, block_size + 1, 3 * block_size, 45]
    case = make_case(num_heads=4, num_kv_heads=2, head_size=head_size, block_size=block_size,
                     seq_lens=seq_lens, dtype=dtype, alibi=index % 2 == 1, seed=index)
    check_against_naive(case)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (16, 2), (48, 1)])
def test_head_ratios_alibi_dtypes(num_heads, num_kv_heads, alibi, dtype):
    case = make_case(num_heads=num_heads, num_kv_heads=num_kv_heads, head_size=64, block_size=16,
                     seq_lens=[17, 0, 1, 16, 33, 70], dtype=dtype, alibi=alibi, seed=num_heads)
    check_against_naive(case)


@pytest.mark.parametrize("chunk_elements", [reference.CHUNK_ELEMENTS, 1 << 13], ids=["one-chunk", "chunked"])
def test_long_sequences(chunk_elements, monkeypatch):
    """Long and ragged sequences; with a small budget the reference splits them over several chunks of
    sequences and of KV blocks, merged by log-sum-exp."""
    monkeypatch.setattr(reference, "CHUNK_ELEMENTS", chunk_elements)
    case = make_case(num_heads=8, num_kv_heads=2, head_size=32, block_size=16,
                     seq_lens=[20000, 0, 1, 1100, 17], dtype=torch.float32, alibi=True, seed=5)
    check_against_naive(case)


def test_custom_scale_and_direct_op():
    case = make_case(num_heads=4, num_kv_heads=1, head_size=32, block_size=8, seq_lens=[9, 4],
                     dtype=torch.float32, seed=6)
    check_against_naive(case, scale=0.3)
    out = torch.empty_like(case["query"])
    torch.ops.tpkit.paged_attention(out, case["query"], case["key_cache"], case["value_cache"],
                                    case["block_tables"], case["seq_lens"], 0.3, None)
    expected = naive_paged_attention(case["query"], case["key_cache"], case["value_cache"],
                                     case["block_tables"], case["seq_lens"], 0.3, None)
    torch.testing.assert_close(out.double(), expected, atol=2e-5, rtol=2e-5)


def test_head_major_cache_view():
    """Caches stored [num_blocks, num_kv_heads, block_size, head_size] and passed as a permuted view: the
    op's [num_blocks, block_size, num_kv_heads, head_size] shape with strides that are not row-major."""
    case = make_case(num_heads=8, num_kv_heads=2, head_size=64, block_size=16, seq_lens=[40, 0, 16, 5],
                     dtype=torch.float32, seed=8)
    for name in ("key_cache", "value_cache"):
        case[name] = case[name].transpose(1, 2).contiguous().transpose(1, 2)
        assert not case[name].is_contiguous()
    check_against_naive(case)


def test_out_argument():
    case = make_case(num_heads=4, num_kv_heads=2, head_size=32, block_size=8, seq_lens=[9, 0, 20],
                     dtype=torch.float16, seed=7)
    args = (case["query"], case["key_cache"], case["value_cache"], case["block_tables"], case["seq_lens"])
    expected = paged_attention(*args)
    # A strided out (every other row of a bigger tensor) receives the result and is returned as is.
    storage = torch.full((6, 4, 32), 7.0, dtype=torch.float16)
    out = storage[::2]
    result = paged_attention(*args, out=out)
    assert result is out
    assert torch.equal(out, expected)
    assert torch.equal(storage[1::2], torch.full((3, 4, 32), 7.0, dtype=torch.float16))
    with pytest.raises(TypeError, match=r"out: expected dtype torch.float16, got torch.float32"):
        paged_attention(*args, out=torch.empty(3, 4, 32))
    with pytest.raises(ValueError, match=r"out: expected shape \[3, 4, 32\], got \[3, 4, 31\]"):
        paged_attention(*args, out=torch.empty(3, 4, 31, dtype=torch.float16))


def test_opcheck():
    for alibi in (False, True):
        case = make_case(num_heads=4, num_kv_heads=2, head_size=32, block_size=8, seq_lens=[9, 0, 20],
                         dtype=torch.float32, alibi=alibi, seed=8)
        # opcheck compares runs: NaN in unused slots is fine for the op but not for its comparisons.
        for cache in (case["key_cache"], case["value_cache"]):
            cache.nan_to_num_(0.0)
        args = (torch.empty_like(case["query"]), case["query"], case["key_cache"], case["value_cache"],
                case["block_tables"], case["seq_lens"], 0.25, case["alibi_slopes"])
        torch.library.opcheck(torch.ops.tpkit.paged_attention.default, args)


def test_torch_compile_fullgraph():
    """The ops trace into one graph (fake implementations, functionalised mutation) and run compiled.

    The aot_eager backend runs dynamo and AOTAutograd like inductor does, without inductor's C++ build,
    which takes tens of seconds on a small machine.
    """
    case = make_case(num_heads=4, num_kv_heads=2, head_size=32, block_size=8, seq_lens=[9, 3, 20],
                     dtype=torch.float32, seed=9)
    key = torch.randn(3, 2, 32)
    value = torch.randn(3, 2, 32)
    seq_lens = case["seq_lens"] + 1
    # The new token goes right after each sequence's last one; room was left in every table.
    slot_mapping = torch.tensor([int(case["block_tables"][i, n // 8]) * 8 + n % 8 for i, n in
                                 enumerate(case["seq_lens"].tolist())])

    def step(query, key, value, key_cache, value_cache):
        reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
        return paged_attention(query * 2, key_cache, value_cache, case["block_tables"], seq_lens) + 1

    assert_compiled_step_matches_eager(step, case, key, value)


def assert_compiled_step_matches_eager(step, case, key, value):
    """``step(query, key, value, key_cache, value_cache)`` compiled in one graph gives eager's output and
    cache writes, each on its own copy of the case's caches."""
    eager_caches = (case["key_cache"].clone(), case["value_cache"].clone())
    compiled_caches = (case["key_cache"].clone(), case["value_cache"].clone())
    expected = step(case["query"], key, value, *eager_caches)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(case["query"], key, value, *compiled_caches), expected)
    assert torch.equal(compiled_caches[0].nan_to_num(), eager_caches[0].nan_to_num())
    assert torch.equal(compiled_caches[1].nan_to_num(), eager_caches[1].nan_to_num())


def _valid_args():
    case = make_case(num_heads=4, num_kv_heads=2, head_size=32, block_size=8, seq_lens=[9, 3],
                     dtype=torch.float16, seed=10)
    case.pop("alibi_slopes")
    return case


BAD_ARGS = [
    ("query", lambda a: a["query"].float(), TypeError,
     r"key_cache: expected dtype torch.float32 \(that of query\) or a float8 dtype .* with k_scale and "
     r"v_scale, got torch.float16"),
    ("query", lambda a: a["query"].long(), TypeError, r"query: expected dtype one of .*, got torch.int64"),
    ("query", lambda a: a["query"][0], ValueError, r"query: expected 3 dimensions, got shape \[4, 32\]"),
    ("query", lambda a: a["query"].transpose(1, 2).contiguous().transpose(1, 2), ValueError,
     r"query: expected a contiguous last dimension \(stride 1\), got strides \[128, 1, 4\]"),
    ("query", lambda a: a["query"][:, :3], ValueError,
     r"key_cache: expected num_kv_heads \(dim 2\) to divide num_heads = 3 of query, got 2"),
    ("query", lambda a: a["query"][:, :, :16], ValueError,
     r"key_cache: expected head_size \(dim 3, that of query\) 16, got 32"),
    ("value_cache", lambda a: a["value_cache"][:-1], ValueError,
     r"value_cache: expected shape \(that of key_cache\) \[\d+, 8, 2, 32\], got \[\d+, 8, 2, 32\]"),
    ("value_cache", lambda a: a["value_cache"].bfloat16(), TypeError,
     r"value_cache: expected dtype torch.float16, got torch.bfloat16"),
    ("key_cache", lambda a: a["key_cache"][0], ValueError, r"key_cache: expected 4 dimensions"),
    ("block_tables", lambda a: a["block_tables"].long(), TypeError,
     r"block_tables: expected dtype torch.int32, got torch.int64"),
    ("block_tables", lambda a: a["block_tables"][:1], ValueError,
     r"block_tables: expected num_seqs \(dim 0, that of query\) 2, got 1"),
    ("seq_lens", lambda a: a["seq_lens"].long(), TypeError,
     r"seq_lens: expected dtype torch.int32, got torch.int64"),
    ("seq_lens", lambda a: a["seq_lens"][:1], ValueError,
     r"seq_lens: expected shape \[num_seqs\] \[2\], got \[1\]"),
    ("seq_lens", lambda a: a["seq_lens"].to("meta"), ValueError,
     r"seq_lens: expected device cpu \(the device of query\), got meta"),
    ("alibi_slopes", lambda a: torch.ones(4, dtype=torch.float16), TypeError,
     r"alibi_slopes: expected dtype torch.float32, got torch.float16"),
    ("alibi_slopes", lambda a: torch.ones(3), ValueError,
     r"alibi_slopes: expected shape \[num_heads\] \[4\], got \[3\]"),
    ("scale", lambda a: torch.tensor(0.5), TypeError, r"scale: expected a float or None, got Tensor"),
]


@pytest.mark.parametrize("name,make_bad,error,message", BAD_ARGS,
                         ids=[f"{i}-{arg[0]}" for i, arg in enumerate(BAD_ARGS)])
def test_validation_errors(name, make_bad, error, message):
    args = _valid_args()
    args[name] = make_bad(args)
    with pytest.raises(error, match=message):
        paged_attention(args.pop("query"), args.pop("key_cache"), args.pop("value_cache"),
                        args.pop("block_tables"), args.pop("seq_lens"), **args)


def test_debug_checks(monkeypatch):
    args = _valid_args()
    bad_table = args["block_tables"].clone()
    bad_table[1, 0] = 10**6  # a used block: seq_lens[1] = 3
    capacity = args["block_tables"].shape[1] * 8
    bad_lens = torch.tensor([9, capacity + 1], dtype=torch.int32)
    positional = (args["query"], args["key_cache"], args["value_cache"])
    # Without TPKIT_DEBUG nothing reads the tables on the host; entries past the used blocks are never read.
    monkeypatch.setenv("TPKIT_DEBUG", "1")
    paged_attention(*positional, args["block_tables"], args["seq_lens"])
    with pytest.raises(ValueError, match=r"block_tables\[1, 0\]: expected a block index in .*, got 1000000"):
        paged_attention(*positional, bad_table, args["seq_lens"])
    with pytest.raises(ValueError, match=rf"seq_lens\[1\]: expected a length in \[0, {capacity}\] .*, got "
                                         rf"{capacity + 1}"):
        paged_attention(*positional, args["block_tables"], bad_lens)
