"""The CUDA paged-attention kernels against the PyTorch (CPU) implementation of the same ops.

Skipped without a GPU. The kernel is called directly through ``tpkit.ops._extension`` (which must build:
a test fails rather than silently checking the PyTorch fallback) and through the public ops, in CUDA graphs
and under ``torch.compile``. Caches start filled with NaN and block tables are random permutations whose
unused entries point at NaN pages, so any read of a slot outside a sequence shows up in the result.
"""

from __future__ import annotations

import math

import pytest
import torch
from cuda_graphs import capture

from tpkit.ops import _extension, paged_attention, reshape_and_cache

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HEAD_SIZES = (32, 64, 80, 96, 112, 120, 128, 192, 256)
BLOCK_SIZES = (8, 16, 32)
RATIOS = (1, 4, 8, 48)
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# (atol, rtol) against a float32 reference: output rounding plus P rounded to the dtype for P V.
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 4e-3), torch.bfloat16: (1e-2, 1.6e-2)}
HEADS_FOR_RATIO = {1: (4, 4), 4: (8, 2), 8: (16, 2), 48: (48, 1)}  # ratio -> (num_heads, num_kv_heads)


def _alibi_slopes(num_heads: int) -> torch.Tensor:
    """The geometric ALiBi slopes of the ALiBi paper, float32 [num_heads]."""
    return torch.tensor([2.0 ** (-8.0 * (i + 1) / num_heads) for i in range(num_heads)], dtype=torch.float32)


def _table_width(seq_lens: list[int], block_size: int) -> int:
    """Entries of the block tables _make_paged builds: every sequence's pages and one more."""
    return max(math.ceil(n / block_size) for n in seq_lens) + 1


def _make_paged(seq_lens: list[int], num_kv_heads: int, head_size: int, block_size: int, *, extra_blocks: int,
                generator: torch.Generator, key_growth: float = 0.0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float32 caches [num_blocks, block_size, num_kv_heads, head_size] holding random K/V for every token of
    every sequence and NaN elsewhere, and an int32 block table [num_seqs, max_blocks_per_seq + 1] mapping
    each sequence to a random permutation of pages; unused entries point at random (mostly NaN) pages. The
    key of position pos is scaled by 1 + key_growth * pos / 64, so scores grow along the sequence."""
    pages_per_seq = [math.ceil(n / block_size) for n in seq_lens]
    num_blocks = sum(pages_per_seq) + extra_blocks
    width = _table_width(seq_lens, block_size)
    perm = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    block_tables = torch.randint(0, num_blocks, (len(seq_lens), width), generator=generator,
                                 dtype=torch.int32)
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_size), float("nan"))
    value_cache = torch.full_like(key_cache, float("nan"))
    used = 0
    for s, (n, pages) in enumerate(zip(seq_lens, pages_per_seq, strict=True)):
        block_tables[s, :pages] = perm[used:used + pages]
        used += pages
        if n == 0:
            continue
        pos = torch.arange(n)
        blocks = block_tables[s, pos // block_size].long()  # [n]
        gain = (1 + key_growth * pos / 64)[:, None, None]  # [n, 1, 1]
        keys = torch.randn(n, num_kv_heads, head_size, generator=generator)
        key_cache[blocks, pos % block_size] = keys * gain
        value_cache[blocks, pos % block_size] = torch.randn(n, num_kv_heads, head_size, generator=generator)
    return key_cache, value_cache, block_tables


def _check_attention(dtype: torch.dtype, head_size: int, block_size: int, num_heads: int, num_kv_heads: int,
                     seq_lens: list[int], *, alibi: bool, seed: int, key_growth: float = 0.0) -> None:
    generator = torch.Generator().manual_seed(seed)
    key_cache, value_cache, block_tables = _make_paged(seq_lens, num_kv_heads, head_size, block_size,
                                                       extra_blocks=3, generator=generator,
                                                       key_growth=key_growth)
    # Rounded to the dtype first, so the CPU float32 reference sees exactly the kernel's inputs.
    query = torch.randn(len(seq_lens), num_heads, head_size, generator=generator).to(dtype).float()
    key_cache, value_cache = key_cache.to(dtype).float(), value_cache.to(dtype).float()
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    slopes = _alibi_slopes(num_heads) if alibi else None
    scale = head_size ** -0.5
    expected = paged_attention(query, key_cache, value_cache, block_tables, lens, scale=scale,
                               alibi_slopes=slopes)

    dev = torch.device("cuda")
    out = torch.full((len(seq_lens), num_heads, head_size), float("nan"), dtype=dtype, device=dev)
    ran = _extension.paged_attention(out, query.to(dev, dtype), key_cache.to(dev, dtype),
                                value_cache.to(dev, dtype), block_tables.to(dev), lens.to(dev), scale,
                                None if slopes is None else slopes.to(dev))
    assert ran, "the CUDA extension did not build"
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float().cpu(), expected, atol=atol, rtol=rtol)


def _plan(dtype: torch.dtype, head_size: int, block_size: int, num_heads: int, num_kv_heads: int,
          seq_lens: list[int]) -> dict[str, int]:
    """The CUDA launch plan of the call _check_attention makes with the same arguments (the plan depends on
    the shapes alone: block tables as wide as _make_paged builds them)."""
    dev = torch.device("cuda")
    width = _table_width(seq_lens, block_size)
    return _extension.launch_plan(torch.empty(len(seq_lens), num_heads, head_size, dtype=dtype, device=dev),
                             torch.empty(4, block_size, num_kv_heads, head_size, dtype=dtype, device=dev),
                             torch.zeros(len(seq_lens), width, dtype=torch.int32, device=dev))


def _grid_cases() -> list[tuple]:
    """Every head size per dtype (block sizes, ratios and ALiBi cycled), then every block size x ratio x
    ALiBi per dtype at head size 128."""
    cases = []
    for dtype in DTYPES:
        for i, head_size in enumerate(HEAD_SIZES):
            cases.append((dtype, head_size, BLOCK_SIZES[i % 3], RATIOS[i % 4], bool(i % 2)))
        for block_size in BLOCK_SIZES:
            for ratio in RATIOS:
                for alibi in (False, True):
                    cases.append((dtype, 128, block_size, ratio, alibi))
    return cases


@pytest.mark.parametrize(("dtype", "head_size", "block_size", "ratio", "alibi"), _grid_cases(),
                         ids=lambda v: str(v).replace("torch.", ""))
def test_paged_attention_grid(dtype: torch.dtype, head_size: int, block_size: int, ratio: int,
                              alibi: bool) -> None:
    num_heads, num_kv_heads = HEADS_FOR_RATIO[ratio]
    # Ragged: empty, one token, block boundaries, a tile boundary (64) and longer contexts that split.
    seq_lens = [0, 1, block_size, block_size + 1, 65, 517, 1000 + head_size]
    _check_attention(dtype, head_size, block_size, num_heads, num_kv_heads, seq_lens, alibi=alibi,
                     seed=head_size * 1000 + block_size * 10 + ratio)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_paged_attention_many_sequences_no_split(dtype: torch.dtype) -> None:
    """Enough (sequence, KV head) pairs to fill the GPU: one partition per sequence, no merge."""
    generator = torch.Generator().manual_seed(7)
    seq_lens = torch.randint(0, 300, (96,), generator=generator).tolist()
    _check_attention(dtype, 64, 16, 32, 8, seq_lens, alibi=False, seed=11)


@pytest.mark.parametrize(("head_size", "group_size", "slices"),
                         [(64, 48, 1), (80, 48, 2), (120, 40, 2), (128, 16, 1), (128, 48, 2), (128, 128, 2),
                          (256, 64, 2)])
def test_paged_attention_two_slice_steps(head_size: int, group_size: int, slices: int) -> None:
    """Large groups (more than 32 query heads a KV head) take two 16-token slices per warp step, where the
    query stays in shared memory (head > 64); against the CPU op, with lengths that end mid-slice."""
    seq_lens = [1, 15, 16, 17, 33, 47, 300, 1000]
    plan = _plan(torch.bfloat16, head_size, 16, group_size, 1, seq_lens)
    # Head 128 on compute 9.0 takes the warpgroup kernel instead (test_paged_attention_wgmma).
    assert plan["slices"] == (1 if plan["wgmma"] else slices), plan
    _check_attention(torch.bfloat16, head_size, 16, group_size, 1, seq_lens, alibi=group_size == 48,
                     seed=head_size + group_size)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("group_size", "num_kv_heads"), [(33, 2), (48, 1), (64, 1), (100, 1), (128, 2)])
def test_paged_attention_wgmma(dtype: torch.dtype, group_size: int, num_kv_heads: int) -> None:
    """Head 128 with more than 32 query heads a KV head: on compute 9.0 the warpgroup kernel (64 rows a
    block: groups of 100 and 128 take two blocks a KV head), elsewhere the mma kernel; against the CPU op,
    with ALiBi and lengths that end mid-tile and split."""
    seq_lens = [0, 1, 63, 64, 65, 300, 2100]
    num_heads = group_size * num_kv_heads
    plan = _plan(dtype, 128, 16, num_heads, num_kv_heads, seq_lens)
    assert plan["wgmma"] == (1 if torch.cuda.get_device_capability() == (9, 0) else 0), plan
    _check_attention(dtype, 128, 16, num_heads, num_kv_heads, seq_lens, alibi=True, seed=group_size)


def _takes_warpgroup_kernel(dtype: torch.dtype, group_size: int, table_tokens: int) -> bool:
    """Whether head 128 runs the warpgroup kernel: in fp16/bf16 on compute 9.0, for groups of more than 32
    query heads, and for every group on block tables of 2048 tokens or more (32 tiles)."""
    return dtype != torch.float32 and torch.cuda.get_device_capability() == (9, 0) and (
        group_size > 32 or table_tokens >= 2048)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("group_size", "num_kv_heads", "max_len"),
                         [(1, 4, 2100), (4, 2, 2100), (8, 2, 5000), (16, 1, 2100), (24, 1, 2100),
                          (32, 1, 2100), (4, 2, 1900), (32, 1, 1900)])
def test_paged_attention_small_groups_long_tables(dtype: torch.dtype, group_size: int, num_kv_heads: int,
                                                  max_len: int) -> None:
    """Head 128, groups of up to 32 query heads, block tables of 2048 tokens or more: on compute 9.0 the
    warpgroup kernel (the group's rows padded to 64), which streams long blocks faster than the mma kernel;
    tables of fewer tokens keep the mma kernel. Against the CPU op, with ALiBi and lengths that end mid-tile,
    split and leave later partitions empty."""
    seq_lens = [0, 1, 63, 65, 700, max_len - 1, max_len]
    num_heads = group_size * num_kv_heads
    plan = _plan(dtype, 128, 16, num_heads, num_kv_heads, seq_lens)
    assert plan["wgmma"] == _takes_warpgroup_kernel(dtype, group_size, _table_width(seq_lens, 16) * 16), plan
    _check_attention(dtype, 128, 16, num_heads, num_kv_heads, seq_lens, alibi=True, seed=group_size + max_len)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("key_growth", [0.3, 3.0])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 2), (48, 1)])
def test_paged_attention_growing_scores(dtype: torch.dtype, key_growth: float, num_heads: int,
                                        num_kv_heads: int) -> None:
    """Scores that grow along the sequence push each row's running max up tile after tile (by a few units of
    log2 with 0.3, by tens with 3.0), so the output is rescaled at many tiles, on the path that takes the
    max of unscaled scores (no ALiBi, no masked column) and at the masked ends; the mma kernel (group 4:
    a table of fewer than 2048 tokens) and, on compute 9.0, the warpgroup kernel (48)."""
    _check_attention(dtype, 128, 16, num_heads, num_kv_heads, [1, 65, 700, 1900], alibi=False, seed=7,
                     key_growth=key_growth)


@pytest.mark.parametrize(("head_size", "swizzled"), [(120, 1), (128, 1), (96, 0)])
@pytest.mark.parametrize("num_seqs", [6, 160])
def test_paged_attention_layouts(num_seqs: int, head_size: int, swizzled: int) -> None:
    """The one-slice kernel keeps K/V rows swizzled in shared memory where a row is a multiple of 8 chunks
    (head 120: padded to 128 with a zero chunk), in a grid of one wave and in one of several; other heads
    take padded rows. Each against the CPU op."""
    generator = torch.Generator().manual_seed(head_size + num_seqs)
    seq_lens = torch.randint(0, 300, (num_seqs,), generator=generator).tolist()
    seq_lens[:3] = [1, 64, 299]
    plan = _plan(torch.bfloat16, head_size, 16, 32, 8, seq_lens)
    assert (plan["slices"], plan["swizzled"]) == (1, swizzled), plan
    _check_attention(torch.bfloat16, head_size, 16, 32, 8, seq_lens, alibi=False, seed=head_size + num_seqs)


@pytest.mark.parametrize("head_size", [128, 64])
def test_paged_attention_long_context(head_size: int) -> None:
    """One 128k-token sequence (split across many partitions) beside a short one: head 128 takes the
    warpgroup kernel on compute 9.0, head 64 the mma kernel's deepest pipeline."""
    _check_attention(torch.bfloat16, head_size, 32, 8, 1, [131072 + 37, 3], alibi=True, seed=5)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="needs Hopper (thread-block clusters)")
@pytest.mark.parametrize(("seq_len", "cluster_merge"), [(256, 1), (8192, 0)])
@pytest.mark.parametrize("head_size", [120, 128])
def test_paged_attention_merge_paths(head_size: int, seq_len: int, cluster_merge: int) -> None:
    """On Hopper, a split into at most 8 partitions merges inside a thread-block cluster; more partitions
    (8 sequences of 8192 tokens, MQA 48:1: 16 or more partitions beat 8 by more than the merge kernel's
    cost) take the merge kernel. Head 120 runs the mma kernel, head 128 the warpgroup kernel (compute
    9.0; two warpgroups a block in these grids of fewer blocks than SMs). Both against the CPU op, with empty
    and short sequences whose later partitions hold nothing."""
    seq_lens = [0, 1, 17, 64, 65, seq_len // 2, seq_len - 1, seq_len]
    plan = _plan(torch.float16, head_size, 16, 48, 1, seq_lens)
    assert plan["num_partitions"] > 1 and plan["cluster_merge"] == cluster_merge, plan
    assert plan["wgmma"] == (1 if head_size == 128 and torch.cuda.get_device_capability() == (9, 0) else 0)
    _check_attention(torch.float16, head_size, 16, 48, 1, seq_lens, alibi=False, seed=seq_len)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="needs compute 9.0 (the warpgroup kernel)")
def test_paged_attention_small_grid_two_warpgroups() -> None:
    """C3's shape (8 sequences of up to 2048 tokens, MQA 48:1, head 128) splits into fewer blocks than the
    GPU has SMs, so the warpgroup kernel runs two warpgroups a block, on alternate tiles of its partition;
    against the CPU op, with empty and short sequences whose later partitions, or second warpgroups, hold
    nothing."""
    seq_lens = [0, 17, 64, 65, 1000, 1024, 2047, 2048]
    plan = _plan(torch.float16, 128, 16, 48, 1, seq_lens)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert plan["wgmma"] == 1 and len(seq_lens) * plan["num_partitions"] <= num_sms, plan
    assert (plan["warpgroups"], plan["num_stages"]) == (2, 2), plan
    _check_attention(torch.float16, 128, 16, 48, 1, seq_lens, alibi=False, seed=11)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="needs compute 9.0 (the warpgroup kernel)")
@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize(("num_seqs", "max_len", "warpgroups", "num_partitions", "cluster_merge"),
                         [(64, 4096, 2, 2, 1), (32, 8176, 1, 8, 0), (32, 8192, 1, 7, 1), (160, 300, 1, 1, 0)])
def test_paged_attention_warpgroup_plans(num_seqs: int, max_len: int, warpgroups: int, num_partitions: int,
                                         cluster_merge: int, alibi: bool) -> None:
    """MQA 48:1, head 128, in grids of more blocks than SMs. C6's shape (64 sequences of up to 4096 tokens):
    one warpgroup a block would split each sequence into 4 partitions whose clusters do not all fit, so the
    plan runs two warpgroups a block, on alternate tiles, and merges 2 partitions in their clusters. 32
    sequences of up to 8176 tokens (a table of 8192) keep one warpgroup and the merge kernel (clusters of 4
    would not fit); of up to 8192 (a table of 8208) one warpgroup and 7 partitions merged in their clusters;
    160 short ones one warpgroup unsplit. Plans as on a 132-SM GPU; against the CPU op, with lengths that
    leave the second warpgroup, or a whole block, without a tile."""
    generator = torch.Generator().manual_seed(num_seqs)
    seq_lens = torch.randint(1, max_len + 1, (num_seqs,), generator=generator).tolist()
    seq_lens[:8] = [0, 1, 64, 65, 128, 129, max_len - 1, max_len]
    plan = _plan(torch.bfloat16, 128, 16, 48, 1, seq_lens)
    if torch.cuda.get_device_properties(0).multi_processor_count == 132:
        expected = (warpgroups, num_partitions, cluster_merge)
        assert (plan["warpgroups"], plan["num_partitions"], plan["cluster_merge"]) == expected, plan
    _check_attention(torch.bfloat16, 128, 16, 48, 1, seq_lens, alibi=alibi, seed=num_seqs)


@pytest.mark.parametrize(("dtype", "num_heads", "num_kv_heads"),
                         [(torch.bfloat16, 8, 2), (torch.bfloat16, 96, 2), (torch.float32, 8, 2)],
                         ids=lambda v: str(v).replace("torch.", ""))
@pytest.mark.parametrize("layout", ["head_major", "sequence_major"])
def test_paged_attention_cache_views(layout: str, dtype: torch.dtype, num_heads: int,
                                     num_kv_heads: int) -> None:
    """Caches passed as views with strides other than row-major [num_blocks, block_size, num_kv_heads,
    head_size]: stored head-major ([num_blocks, num_kv_heads, block_size, head_size], permuted), or as SDPA
    takes K/V ([num_seqs, num_kv_heads, max_len, head_size]: a sequence's pages in order, NaN past its
    length, the head stride max_len * head_size, blocks overlapping). The mma kernel (group 4), the fp32
    kernel and, on compute 9.0, the warpgroup kernel (group 48); against the CPU op on the same views. (Two
    KV heads: with one, either view is row-major.)"""
    generator = torch.Generator().manual_seed(len(layout) + num_heads)
    head_size, block_size, max_len = 128, 16, 2048
    seq_lens = [1, 300, max_len, 64, 1000, 17]
    num_seqs, pages = len(seq_lens), max_len // block_size
    if layout == "head_major":
        key_cache, value_cache, block_tables = _make_paged(seq_lens, num_kv_heads, head_size, block_size,
                                                           extra_blocks=3, generator=generator)
        stores = [c.transpose(1, 2).contiguous() for c in (key_cache, value_cache)]

        def as_cache(store: torch.Tensor) -> torch.Tensor:
            return store.transpose(1, 2)
    else:
        past_end = torch.arange(max_len)[None, None, :, None] >= torch.tensor(seq_lens)[:, None, None, None]
        stores = [torch.randn(num_seqs, num_kv_heads, max_len, head_size, generator=generator)
                  .masked_fill(past_end, float("nan")) for _ in range(2)]
        num_blocks = (num_seqs - 1) * num_kv_heads * pages + pages  # the last block ends with the storage
        block_tables = (torch.arange(num_seqs)[:, None] * num_kv_heads * pages + torch.arange(pages)).int()

        def as_cache(store: torch.Tensor) -> torch.Tensor:
            return store.as_strided((num_blocks, block_size, num_kv_heads, head_size),
                                    (block_size * head_size, head_size, max_len * head_size, 1))
    # Rounded to the dtype first, so the CPU float32 reference sees exactly the kernel's inputs.
    stores = [store.to(dtype).float() for store in stores]
    query = torch.randn(num_seqs, num_heads, head_size, generator=generator).to(dtype).float()
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    expected = paged_attention(query, as_cache(stores[0]), as_cache(stores[1]), block_tables, lens)

    dev = torch.device("cuda")
    key_cache, value_cache = (as_cache(store.to(dev, dtype)) for store in stores)
    assert not key_cache.is_contiguous()
    query_d, block_tables_d = query.to(dev, dtype), block_tables.to(dev)
    warpgroup_kernel = _takes_warpgroup_kernel(dtype, num_heads // num_kv_heads,
                                               block_tables.shape[1] * block_size)
    assert _extension.launch_plan(query_d, key_cache, block_tables_d)["wgmma"] == warpgroup_kernel
    out = torch.full((num_seqs, num_heads, head_size), float("nan"), dtype=dtype, device=dev)
    assert _extension.paged_attention(out, query_d, key_cache, value_cache, block_tables_d, lens.to(dev),
                                 head_size ** -0.5, None)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float().cpu(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize(("dtype", "num_heads", "num_kv_heads", "head_size"),
                         [(torch.float32, 8, 2, 64), (torch.bfloat16, 32, 8, 128),
                          (torch.bfloat16, 48, 1, 128)])
def test_paged_attention_strided_query(dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                                       head_size: int) -> None:
    """A query that is a view into a wider tensor, as the attention layer passes it: the q slice of a
    fused q, k projection (the fp32 kernel; bf16 GQA 4:1 through the mma kernel; MQA 48:1, on compute 9.0,
    through the warpgroup kernel)."""
    generator = torch.Generator().manual_seed(3)
    seq_lens = [5, 200, 64, 3000]
    key_cache, value_cache, block_tables = _make_paged(seq_lens, num_kv_heads, head_size, 16, extra_blocks=2,
                                                       generator=generator)
    key_cache, value_cache = key_cache.to(dtype).float(), value_cache.to(dtype).float()
    qk = torch.randn(len(seq_lens), num_heads + num_kv_heads, head_size, generator=generator)
    qk = qk.to(dtype).float()
    query = qk[:, :num_heads]  # stride(0) = (num_heads + num_kv_heads) * head_size
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    expected = paged_attention(query.contiguous(), key_cache, value_cache, block_tables, lens)
    dev = torch.device("cuda")
    out = torch.empty(len(seq_lens), num_heads, head_size, device=dev, dtype=dtype)
    assert _extension.paged_attention(out, qk.to(dev, dtype)[:, :num_heads], key_cache.to(dev, dtype),
                                 value_cache.to(dev, dtype), block_tables.to(dev), lens.to(dev),
                                 head_size ** -0.5, None)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float().cpu(), expected, atol=atol, rtol=rtol)


def test_paged_attention_rejects_wide_strides() -> None:
    """Caches whose block stride is 2^31 bytes or more (the kernels' 32-bit addressing) are refused, with the
    strides in the message; the output is left as it was."""
    dev = torch.device("cuda")
    block_stride = 2 ** 30  # bf16 elements: 2 GiB
    storage = torch.zeros(block_stride + 16 * 64, dtype=torch.bfloat16, device=dev)
    cache = storage.as_strided((2, 16, 1, 64), (block_stride, 64, 64, 1))
    query = torch.randn(2, 4, 64, device=dev, dtype=torch.bfloat16)
    out = torch.full_like(query, 7.0)
    block_tables = torch.tensor([[0], [1]], dtype=torch.int32, device=dev)
    lens = torch.ones(2, dtype=torch.int32, device=dev)
    with pytest.raises(ValueError, match=r"strides under 2\^31 bytes, got strides \[1073741824, 64, 64, 1\]"):
        _extension.paged_attention(out, query, cache, cache, block_tables, lens, 1.0, None)
    assert bool((out == 7.0).all())


@pytest.mark.parametrize(("head_size", "block_size", "dtype"),
                         [(100, 16, torch.float16), (128, 64, torch.bfloat16)])
def test_paged_attention_unsupported(head_size: int, block_size: int, dtype: torch.dtype) -> None:
    dev = torch.device("cuda")
    query = torch.randn(2, 4, head_size, device=dev, dtype=dtype)
    cache = torch.randn(4, block_size, 4, head_size, device=dev, dtype=dtype)
    block_tables = torch.zeros(2, 2, dtype=torch.int32, device=dev)
    lens = torch.ones(2, dtype=torch.int32, device=dev)
    with pytest.raises(ValueError, match="supported: .*head sizes 32, 64"):
        _extension.paged_attention(torch.empty_like(query), query, cache, cache, block_tables, lens, 1.0,
                                   None)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_size", [64, 120])
def test_reshape_and_cache(dtype: torch.dtype, head_size: int) -> None:
    generator = torch.Generator().manual_seed(head_size)
    num_tokens, num_kv_heads, block_size, num_blocks = 37, 4, 16, 12
    # key is a strided view (part of a fused projection); slot -1 marks padding.
    kv = torch.randn(num_tokens, 2 * num_kv_heads, head_size, generator=generator).to(dtype)
    key, value = kv[:, :num_kv_heads], kv[:, num_kv_heads:].contiguous()
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[::5] = -1
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_size, generator=generator).to(dtype)
    value_cache = torch.randn_like(key_cache.float()).to(dtype)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reshape_and_cache(key, value, expected_k, expected_v, slots)

    dev = torch.device("cuda")
    key_cache_d, value_cache_d = key_cache.to(dev), value_cache.to(dev)
    assert _extension.reshape_and_cache(kv.to(dev)[:, :num_kv_heads], value.to(dev), key_cache_d,
                                        value_cache_d, slots.to(dev))
    assert torch.equal(key_cache_d.cpu(), expected_k)
    assert torch.equal(value_cache_d.cpu(), expected_v)


def test_cuda_graph_replay() -> None:
    """Cache write + attention captured once, replayed on new inputs written in place (split-K path)."""
    dev = torch.device("cuda")
    generator = torch.Generator().manual_seed(21)
    num_seqs, num_heads, num_kv_heads, head_size, block_size = 3, 16, 2, 128, 16
    seq_lens = [700, 1, 2000]
    key_cache, value_cache, block_tables = _make_paged(seq_lens, num_kv_heads, head_size, block_size,
                                                       extra_blocks=4, generator=generator)
    key_cache = key_cache.nan_to_num(0.0).to(dev, torch.bfloat16)
    value_cache = value_cache.nan_to_num(0.0).to(dev, torch.bfloat16)
    block_tables = block_tables.to(dev)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    query = torch.randn(num_seqs, num_heads, head_size, device=dev, dtype=torch.bfloat16)
    new_k = torch.randn(num_seqs, num_kv_heads, head_size, device=dev, dtype=torch.bfloat16)
    new_v = torch.randn_like(new_k)
    slots = torch.zeros(num_seqs, dtype=torch.int64, device=dev)
    out = torch.empty_like(query)

    def step() -> None:
        reshape_and_cache(new_k, new_v, key_cache, value_cache, slots)
        paged_attention(query, key_cache, value_cache, block_tables, lens, out=out)

    graph, _ = capture(step)

    for new_lens in ([701, 2, 2001], [64, 1500, 17]):
        lens.copy_(torch.tensor(new_lens, dtype=torch.int32))
        last = lens.long() - 1
        slots.copy_(block_tables[torch.arange(num_seqs, device=dev), last // block_size].long() * block_size
                    + last % block_size)
        query.normal_()
        new_k.normal_()
        new_v.normal_()
        graph.replay()
        expected = paged_attention(query.float().cpu(), key_cache.float().cpu(), value_cache.float().cpu(),
                                   block_tables.cpu(), lens.cpu())
        torch.testing.assert_close(out.float().cpu(), expected, atol=1e-2, rtol=1.6e-2)


def test_torch_compile() -> None:
    dev = torch.device("cuda")
    generator = torch.Generator().manual_seed(8)
    seq_lens = [33, 300]
    key_cache, value_cache, block_tables = _make_paged(seq_lens, 2, 64, 16, extra_blocks=2,
                                                       generator=generator)
    key_cache = key_cache.nan_to_num(0.0).half().float()
    value_cache = value_cache.nan_to_num(0.0).half().float()
    query = torch.randn(2, 8, 64, generator=generator).half().float()
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    expected = paged_attention(query, key_cache, value_cache, block_tables, lens) * 2.0

    @torch.compile(fullgraph=True)
    def attend_twice(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, bt: torch.Tensor,
                     sl: torch.Tensor) -> torch.Tensor:
        return paged_attention(q, kc, vc, bt, sl) * 2.0

    got = attend_twice(query.to(dev, torch.float16), key_cache.to(dev, torch.float16),
                       value_cache.to(dev, torch.float16), block_tables.to(dev), lens.to(dev))
    torch.testing.assert_close(got.float().cpu(), expected, atol=4e-3, rtol=4e-3)
