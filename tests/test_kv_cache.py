"""PagedKVCache: the block allocator, the metadata it builds, and sizing from a memory budget."""

import logging

import pytest
import torch

from tpkit.attention import AttentionMetadata, PagedKVCache, host_longs
from tpkit.attention.host_tensors import _copy_packed, _segment_ids, token_positions


def make_cache(num_blocks=10, block_size=4, **overrides):
    args = dict(num_layers=2, num_blocks=num_blocks, block_size=block_size, num_kv_heads=2, head_size=8,
                dtype=torch.float32, device="cpu")
    args.update(overrides)
    return PagedKVCache(**args)


def naive_slot(block_tables, seq_index, position, block_size):
    return int(block_tables[seq_index, position // block_size]) * block_size + position % block_size


def check_tables(cache, metadata, seq_ids):
    """Each sequence's table lists distinct blocks, none shared with another sequence, as many as its
    length needs."""
    seen = set()
    for i, seq_id in enumerate(seq_ids):
        needed = -(-cache.seq_len(seq_id) // cache.block_size)
        blocks = metadata.block_tables[i, :needed].tolist()
        assert len(set(blocks)) == needed and not seen & set(blocks)
        assert all(0 <= b < cache.num_blocks for b in blocks)
        seen |= set(blocks)
    assert metadata.block_tables.shape == (len(seq_ids), max(
        -(-cache.seq_len(s) // cache.block_size) for s in seq_ids))


def test_caches_and_fresh_state():
    cache = make_cache(dtype=torch.bfloat16)
    assert len(cache.key_caches) == len(cache.value_caches) == 2
    for tensor in cache.key_caches + cache.value_caches:
        assert tensor.shape == (10, 4, 2, 8) and tensor.dtype == torch.bfloat16
    assert cache.key_caches[0].data_ptr() != cache.key_caches[1].data_ptr()
    assert cache.num_free_blocks == 10


def test_prefill_and_decode_metadata_match_naive():
    cache = make_cache(num_blocks=12, block_size=4)
    seq_ids, prompt_lens = [7, 3, 11], [5, 1, 8]
    metadata = cache.prefill_metadata(seq_ids, prompt_lens)
    assert isinstance(metadata, AttentionMetadata) and metadata.is_prefill
    assert cache.num_free_blocks == 12 - (2 + 1 + 2)
    check_tables(cache, metadata, seq_ids)
    assert metadata.slot_mapping.dtype == torch.int64 and metadata.block_tables.dtype == torch.int32
    assert metadata.seq_lens.dtype == metadata.query_lens.dtype == torch.int32
    assert metadata.seq_lens.tolist() == metadata.query_lens.tolist() == prompt_lens
    # Packed: each prompt's tokens in order, sequence after sequence.
    expected = [naive_slot(metadata.block_tables, i, t, 4)
                for i, n in enumerate(prompt_lens) for t in range(n)]
    assert metadata.slot_mapping.tolist() == expected
    assert metadata.query_start_loc.dtype == torch.int32
    assert metadata.query_start_loc.tolist() == [0, 5, 6, 14]
    written = {s for s in expected if s >= 0}

    lens = list(prompt_lens)
    for _ in range(9):
        free_before = cache.num_free_blocks
        metadata = cache.decode_metadata(seq_ids)
        assert not metadata.is_prefill and metadata.query_start_loc is None
        # A new block exactly when a sequence's last block is full.
        assert free_before - cache.num_free_blocks == sum(n % 4 == 0 for n in lens)
        check_tables(cache, metadata, seq_ids)
        assert metadata.slot_mapping.tolist() == [naive_slot(metadata.block_tables, i, n, 4)
                                                  for i, n in enumerate(lens)]
        assert not written & set(metadata.slot_mapping.tolist())
        written |= set(metadata.slot_mapping.tolist())
        lens = [n + 1 for n in lens]
        assert metadata.seq_lens.tolist() == lens and metadata.query_lens.tolist() == [1, 1, 1]
    assert [cache.seq_len(s) for s in seq_ids] == lens


def test_decode_without_append_writes_nothing():
    cache = make_cache()
    cache.prefill_metadata([0, 1], [4, 6])
    free = cache.num_free_blocks
    prefix_tables = cache.decode_metadata([1, 0], append=False)
    assert prefix_tables.slot_mapping.tolist() == [-1, -1]
    assert prefix_tables.seq_lens.tolist() == [6, 4] and prefix_tables.query_lens.tolist() == [1, 1]
    assert cache.num_free_blocks == free and cache.seq_len(0) == 4
    # Subsets of the cached sequences, in any order, get their own rows.
    alone = cache.decode_metadata([1], append=False)
    assert prefix_tables.block_tables[0, :2].tolist() == alone.block_tables[0].tolist()


def test_free_and_reuse():
    cache = make_cache(num_blocks=6)
    first = cache.prefill_metadata([1, 2], [8, 9])  # 2 + 3 blocks
    blocks_of_1 = set(first.block_tables[0, :2].tolist())
    assert cache.num_free_blocks == 1
    cache.free(1)
    assert cache.num_free_blocks == 3
    with pytest.raises(ValueError, match=r"seq_id: expected a cached sequence \(one of \[2\]\), got 1"):
        cache.decode_metadata([1])
    # The freed blocks serve the next sequence, id 1 included.
    again = cache.prefill_metadata([1], [12])
    assert set(again.block_tables[0].tolist()) >= blocks_of_1
    cache.free(1)
    cache.free(2)
    assert cache.num_free_blocks == 6


def test_out_of_blocks_changes_nothing():
    cache = make_cache(num_blocks=4)
    cache.prefill_metadata([0], [8])  # 2 blocks, both full
    with pytest.raises(RuntimeError, match=r"out of KV blocks: this prefill step needs 3 blocks, 2 of 4 "):
        cache.prefill_metadata([1, 2], [4, 5])
    assert cache.num_free_blocks == 2
    with pytest.raises(ValueError, match="expected a cached sequence"):
        cache.free(1)
    cache.prefill_metadata([1], [8])
    assert cache.num_free_blocks == 0
    with pytest.raises(RuntimeError, match=r"out of KV blocks: this decode step needs 2 blocks, 0 of 4 "):
        cache.decode_metadata([0, 1])
    assert cache.seq_len(0) == cache.seq_len(1) == 8
    # Cross-attention steps need no blocks.
    assert cache.decode_metadata([0, 1], append=False).seq_lens.tolist() == [8, 8]


def test_block_table_width_pads_and_checks_before_allocating():
    cache = make_cache(block_size=4)
    cache.prefill_metadata([0, 1], [4, 2])  # sequence 0's block is full: its next token needs a second
    free = cache.num_free_blocks
    for width in (1, 0, True, 2.0):
        with pytest.raises(ValueError, match=rf"block_table_width: expected None or an int >= 2 \(the most "
                                             rf"blocks a sequence holds after this step\), got {width!r}"):
            cache.decode_metadata([0, 1], block_table_width=width)
    assert cache.num_free_blocks == free and cache.seq_len(0) == 4 and cache.seq_len(1) == 2
    metadata = cache.decode_metadata([0, 1], block_table_width=5)
    assert metadata.block_tables.shape == (2, 5)
    assert cache.num_free_blocks == free - 1
    table_0 = list(cache._seq_blocks[0])
    assert metadata.block_tables.tolist() == [table_0 + [0, 0, 0], list(cache._seq_blocks[1]) + [0] * 4]
    assert metadata.slot_mapping.tolist() == [table_0[1] * 4, cache._seq_blocks[1][0] * 4 + 2]


def test_packed_copy_keeps_every_tensor():
    """Metadata goes to a GPU as one copy of its tensors packed together: each comes back whole, aligned to
    its element size whatever precedes it."""
    host = [torch.tensor([3, -1, 7], dtype=torch.int32), torch.randint(-2**40, 2**40, (5,)),
            torch.randint(0, 99, (3, 3), dtype=torch.int32), torch.randn(2, 1, dtype=torch.float64)]
    copied = _copy_packed(host, torch.device("cpu"))
    for original, copy in zip(host, copied, strict=True):
        assert copy.dtype == original.dtype and copy.shape == original.shape
        assert torch.equal(copy, original)
        assert copy.data_ptr() % copy.element_size() == 0
    assert len({copy.untyped_storage().data_ptr() for copy in copied}) == 1


@pytest.mark.parametrize("call,message", [
    (lambda c: c.prefill_metadata([1, 1], [2, 3]), r"seq_ids: expected distinct ids, got \[1, 1\]"),
    (lambda c: c.prefill_metadata([], []), r"seq_ids: expected at least one sequence"),
    (lambda c: c.prefill_metadata([5], [2]), r"seq_ids: expected new sequences, got 5, which is already "),
    (lambda c: c.prefill_metadata([1, 2], [2]), r"prompt_lens: expected 2 lengths \(one per seq_id\), got 1"),
    (lambda c: c.prefill_metadata([1], [0]), r"prompt_lens: expected positive ints, got 0 for seq_id 1"),
    (lambda c: c.prefill_metadata([1], [2.0]), r"prompt_lens: expected positive ints, got 2.0 for seq_id 1"),
    (lambda c: c.decode_metadata([5, 9]), r"seq_id: expected a cached sequence \(one of \[5\]\), got 9"),
    (lambda c: c.free(9), r"seq_id: expected a cached sequence \(one of \[5\]\), got 9"),
])
def test_bad_requests(call, message):
    cache = make_cache()
    cache.prefill_metadata([5], [3])
    free = cache.num_free_blocks
    with pytest.raises(ValueError, match=message):
        call(cache)
    assert cache.num_free_blocks == free and cache.seq_len(5) == 3


def test_integer_like_prompt_lens():
    cache = make_cache()
    metadata = cache.prefill_metadata(torch.tensor([3, 4]).tolist(), torch.tensor([6, 2]))
    assert metadata.seq_lens.tolist() == [6, 2]


@pytest.mark.parametrize("overrides,error,message", [
    (dict(num_blocks=0), ValueError, r"num_blocks: expected a positive int, got 0"),
    (dict(head_size=8.0), TypeError, r"head_size: expected an int, got float"),
    (dict(dtype=torch.int8), TypeError, r"dtype: expected a floating-point torch.dtype, got torch.int8"),
])
def test_bad_construction(overrides, error, message):
    with pytest.raises(error, match=message):
        make_cache(**overrides)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_from_memory_budget(dtype, caplog):
    num_layers, block_size, num_kv_heads, head_size = 3, 16, 2, 64
    block_bytes = 2 * num_layers * block_size * num_kv_heads * head_size * dtype.itemsize
    with caplog.at_level(logging.INFO, logger="tpkit.attention"):
        cache = PagedKVCache.from_memory_budget(block_bytes * 7 + block_bytes - 1, num_layers, block_size,
                                                num_kv_heads, head_size, dtype=dtype, device="cpu")
    assert cache.num_blocks == cache.num_free_blocks == 7
    used = sum(t.numel() * t.element_size() for t in cache.key_caches + cache.value_caches)
    assert used == 7 * block_bytes
    assert [(r.name, r.getMessage()) for r in caplog.records] == [
        ("tpkit.attention", "# KV blocks: 7 (112 tokens) per rank")]
    with pytest.raises(ValueError, match=rf"memory_bytes: expected at least one KV block's worth "
                                         rf"\({block_bytes} bytes for 3 layers\), got {block_bytes - 1}"):
        PagedKVCache.from_memory_budget(block_bytes - 1, num_layers, block_size, num_kv_heads, head_size,
                                        dtype=dtype, device="cpu")


def test_a_gpus_available_memory_counts_what_the_caching_allocator_holds_unused(monkeypatch):
    """Memory freed by tensors stays with torch's caching allocator, not the driver: a budget or a size
    check taken after a freed cache (an earlier engine's) still sees it as free."""
    from tpkit._memory import available_bytes

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (3 << 30, 140 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 120 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 20 << 30)
    assert available_bytes(torch.device("cuda")) == (3 << 30) + (100 << 30)


@pytest.mark.parametrize("seed", range(3))
def test_host_longs_equal_a_tensor_of_the_values(seed):
    """Random int64 values of any count (none, one, thousands; negatives and the int64 extremes among them),
    from a list or a generator, give the tensor ``torch.tensor`` builds of them."""
    gen = torch.Generator().manual_seed(seed)
    for count in (0, 1, 5, 4099):
        values = torch.randint(-2**62, 2**62, (count,), generator=gen).tolist()
        if count > 1:
            values[:2] = [torch.iinfo(torch.int64).min, torch.iinfo(torch.int64).max]
        expected = torch.tensor(values, dtype=torch.int64)
        for given in (values, iter(values)):
            got = host_longs(given)
            assert got.dtype == torch.int64 and got.shape == (count,)
            assert torch.equal(got, expected)


@pytest.mark.parametrize("seed", range(4))
def test_token_positions_equal_a_loop_over_the_segments(seed):
    """Random starts and segment lengths (zeros among them, thousands of tokens in some): each segment's
    starts[i], starts[i] + 1, ... one after another, as a loop over ranges makes them."""
    gen = torch.Generator().manual_seed(seed)
    for num_segments, longest in ((0, 5), (1, 5), (9, 3), (300, 2), (8, 3000)):
        counts = torch.randint(0, longest, (num_segments,), generator=gen)
        starts = torch.randint(0, 10_000, (num_segments,), generator=gen)
        expected = [p for start, n in zip(starts.tolist(), counts.tolist(), strict=True)
                    for p in range(start, start + n)]
        got = token_positions(starts, counts)
        assert got.dtype == torch.int64 and got.tolist() == expected


def test_token_positions_refuses_bad_input_by_name():
    longs = torch.tensor([3, 4])
    expected = "expected a 1-D int64 CPU tensor, got"
    with pytest.raises(ValueError, match=rf"starts: {expected} torch.int32 of shape \(2,\)"):
        token_positions(longs.int(), longs)
    with pytest.raises(ValueError, match=rf"counts: {expected} torch.int64 of shape \(1, 2\)"):
        token_positions(longs, longs[None])
    with pytest.raises(ValueError, match=r"counts: expected one per start \(2\), got 3"):
        token_positions(longs, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match=r"counts: expected counts >= 0, got -1"):
        token_positions(longs, torch.tensor([2, -1]))


@pytest.mark.parametrize("seed", range(4))
def test_segment_ids_equal_repeat_interleave(seed):
    """Each element's segment for random segment lengths (zeros among them, at either end too; thousands of
    elements a segment, as a prefill's prompts) is what ``torch.repeat_interleave`` of the segment indices
    gives."""
    gen = torch.Generator().manual_seed(seed)
    for num_segments, longest in ((0, 5), (1, 5), (2, 5), (7, 5), (300, 5), (8, 3000)):
        counts = torch.randint(0, longest, (num_segments,), generator=gen)
        expected = torch.repeat_interleave(torch.arange(num_segments), counts)
        assert torch.equal(_segment_ids(counts), expected)
