"""NaN propagates through paged attention, on the CPU and through every CUDA kernel path; zeros only for a
sequence with no key.

Each batch holds a sequence with a NaN key, one with a NaN value, one with a NaN query head, an empty one
and a clean one, with NaN also in every slot no sequence uses (which must not leak). The NaN pattern of
the output is predicted from how the inputs were built, not taken from another implementation, and the
rest is compared with a float64 softmax over the sequence's keys. On a GPU the kernel is called through
``tpkit.ops._extension`` (it must build), with shapes that take the single-pass kernels, the split-K merge
kernel and (on Hopper) the merge inside thread-block clusters.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_paged_attention import naive_paged_attention

from tpkit.ops import _extension, paged_attention

NO_GPU = not torch.cuda.is_available()

# (num_heads, num_kv_heads, head_size, block_size, the clean sequences' length, dtype)
SHAPES = [
    (4, 2, 64, 16, 40, torch.float32),  # one partition a sequence
    (8, 2, 128, 16, 300, torch.bfloat16),
    (48, 1, 128, 16, 256, torch.float16),  # split, merged in clusters on Hopper
    (48, 1, 128, 16, 8192, torch.float16),  # split into many partitions: the merge kernel
    (16, 2, 80, 32, 2000, torch.float32),
]


def _batch(num_heads: int, num_kv_heads: int, head_size: int, block_size: int, length: int, *, seed: int):
    """Float32 query, caches, int32 block tables and seq_lens of five sequences (NaN key, NaN value, NaN
    query head 0, empty, clean), NaN in every unused slot; and the [num_seqs, num_heads] bool mask of the
    outputs that must be NaN."""
    g = torch.Generator().manual_seed(seed)
    lens = [length, length, length, 0, length]
    pages = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(pages) + 2
    width = max(pages) + 1
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_size), float("nan"))
    value_cache = torch.full_like(key_cache, float("nan"))
    order = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)
    used = 0
    for s, (n, count) in enumerate(zip(lens, pages, strict=True)):
        tables[s, :count] = order[used:used + count]
        tables[s, count:] = order[-1]  # past the sequence: an unused (NaN) block
        used += count
        positions = torch.arange(n)
        blocks, offsets = tables[s, positions // block_size].long(), positions % block_size
        key_cache[blocks, offsets] = torch.randn(n, num_kv_heads, head_size, generator=g)
        value_cache[blocks, offsets] = torch.randn(n, num_kv_heads, head_size, generator=g)
    query = torch.randn(len(lens), num_heads, head_size, generator=g)
    group = num_heads // num_kv_heads
    nan = torch.zeros(len(lens), num_heads, dtype=torch.bool)
    middle = length // 2
    key_cache[tables[0, middle // block_size], middle % block_size, 0, 3] = float("nan")  # KV head 0
    nan[0, :group] = True
    value_cache[tables[1, 0], 0, num_kv_heads - 1] = float("nan")  # the last KV head, first token
    nan[1, num_heads - group:] = True
    query[2, 0, 7] = float("nan")
    nan[2, 0] = True
    return query, key_cache, value_cache, tables, torch.tensor(lens, dtype=torch.int32), nan


def _check(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
           tables: torch.Tensor, lens: torch.Tensor, expected_nan: torch.Tensor, scale: float,
           atol: float) -> None:
    out = out.double().cpu()
    assert torch.equal(torch.isnan(out).any(-1), expected_nan)
    assert torch.equal(torch.isnan(out).all(-1), expected_nan)  # a NaN row is NaN throughout
    empty = lens == 0
    assert torch.equal(out[empty], torch.zeros_like(out[empty]))
    finite = ~expected_nan
    reference = naive_paged_attention(query, key_cache, value_cache, tables, lens, scale, None)
    torch.testing.assert_close(out[finite], reference[finite], atol=atol, rtol=atol)


def test_nan_propagates_on_cpu() -> None:
    batch = _batch(8, 2, 32, 8, 50, seed=0)
    out = paged_attention(*batch[:5], scale=32 ** -0.5)
    _check(out, *batch, 32 ** -0.5, 1e-5)


def test_nan_scores_in_a_later_chunk_still_propagate(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU implementation attends in chunks of blocks: a NaN key in a later chunk than the first."""
    from tpkit.ops import paged_attention_reference

    monkeypatch.setattr(paged_attention_reference, "CHUNK_ELEMENTS", 8 * 2 * 32)  # one block a chunk
    batch = _batch(4, 2, 32, 8, 60, seed=1)
    _check(paged_attention(*batch[:5]), *batch, 32 ** -0.5, 1e-5)


@pytest.mark.skipif(NO_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_size", "block_size", "length", "dtype"), SHAPES,
                         ids=lambda v: str(v).replace("torch.", ""))
def test_nan_propagates_through_the_cuda_kernels(num_heads, num_kv_heads, head_size, block_size, length,
                                                 dtype) -> None:
    query, key_cache, value_cache, tables, lens, nan = _batch(num_heads, num_kv_heads, head_size, block_size,
                                                              length, seed=head_size + length)
    # The kernel's inputs, rounded to its dtype, for the reference too.
    query, key_cache, value_cache = (t.to(dtype).float() for t in (query, key_cache, value_cache))
    scale = head_size ** -0.5
    dev = torch.device("cuda")
    out = torch.full(query.shape, 7.0, dtype=dtype, device=dev)
    ran = _extension.paged_attention(out, query.to(dev, dtype), key_cache.to(dev, dtype),
                                     value_cache.to(dev, dtype), tables.to(dev), lens.to(dev), scale, None)
    assert ran, "the CUDA extension did not build"
    atol = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2e-2}[dtype]
    _check(out, query, key_cache, value_cache, tables, lens, nan, scale, atol)
