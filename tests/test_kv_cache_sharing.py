"""PagedKVCache beyond one prefill and decodes: steps of any shape, shared blocks (fork, prefix cache),
copy-on-write, truncation, LRU eviction, and state left unchanged by every refused call.

The fuzz test drives random operations and checks, after each, what the cache must guarantee: reading a
sequence through its block table gives exactly the tokens written for it (so nothing shared was
overwritten, and prefix-cache hits hold the right tokens), and every block is free, cached or held by as
many sequences as its reference count says.
"""

import random

import pytest
import torch

from tpkit.attention import PagedKVCache


def make_cache(num_blocks=16, block_size=4, num_layers=2):
    # One KV head of width 1: a slot's value is the token written there, easy to read back.
    return PagedKVCache(num_layers, num_blocks, block_size, 1, 1, dtype=torch.float32, device="cpu")


def slots_of(cache, seq_id, positions):
    """The naive slot of each position through the cache's own table of seq_id."""
    blocks = cache._seq_blocks[seq_id]
    return [blocks[p // cache.block_size] * cache.block_size + p % cache.block_size for p in positions]


def write(cache, slot_mapping, token_ids):
    """What a model step does: each new token's 'K/V' (here its id) into its slot, every layer."""
    slots = torch.as_tensor(slot_mapping)
    for tensor in cache.key_caches + cache.value_caches:
        tensor.view(-1)[slots[slots >= 0]] = torch.tensor(token_ids, dtype=torch.float32)[slots >= 0]


def read(cache, seq_id, layer=0):
    """A sequence's tokens as its block table finds them in the cache."""
    slots = slots_of(cache, seq_id, range(cache.seq_len(seq_id)))
    return [int(v) for v in cache.value_caches[layer].view(-1)[slots].tolist()]


def state(cache):
    return (cache.num_free_blocks, cache.num_cached_blocks, dict(cache._seq_lens),
            {s: list(b) for s, b in cache._seq_blocks.items()}, list(cache._pool._ref_counts))


def test_a_mixed_step_maps_every_token():
    """A new prompt's first chunk, the next chunk of another, speculative tokens, a decode and an idle
    sequence in one packed step."""
    cache = make_cache(num_blocks=20, block_size=4)
    cache.prefill_metadata([1, 2, 3], [6, 4, 9])
    cache.add_sequence(7)
    cache.append_slots([7, 1, 2, 3], [5, 7, 3, 1])
    metadata = cache.step_metadata([7, 1, 2, 3], [5, 7, 3, 1])
    assert metadata.is_prefill
    assert metadata.query_start_loc.tolist() == [0, 5, 12, 15, 16]
    assert metadata.seq_lens.tolist() == [5, 13, 7, 10] and metadata.query_lens.tolist() == [5, 7, 3, 1]
    expected = (slots_of(cache, 7, range(0, 5)) + slots_of(cache, 1, range(6, 13))
                + slots_of(cache, 2, range(4, 7)) + slots_of(cache, 3, range(9, 10)))
    assert metadata.slot_mapping.tolist() == expected and len(set(expected)) == 16
    for row, seq_id in enumerate([7, 1, 2, 3]):
        blocks = list(cache._seq_blocks[seq_id])
        assert metadata.block_tables[row, :len(blocks)].tolist() == blocks
    idle = cache.step_metadata([1, 2], [0, 2], block_table_width=6)
    assert idle.query_start_loc.tolist() == [0, 0, 2] and idle.block_tables.shape == (2, 6)
    assert idle.slot_mapping.tolist() == slots_of(cache, 2, [5, 6])


def test_chunked_appends_give_the_slots_of_one_prefill():
    whole, chunked = make_cache(), make_cache()
    one = whole.prefill_metadata([0], [11]).slot_mapping.tolist()
    chunked.add_sequence(0)
    slots = []
    for n in (3, 5, 2, 1):
        chunked.append_slots([0], [n])
        slots += chunked.step_metadata([0], [n]).slot_mapping.tolist()
    assert slots == one and chunked._seq_blocks == whole._seq_blocks


def test_fork_shares_blocks_and_copies_on_write():
    cache = make_cache(num_blocks=8, block_size=4)
    metadata = cache.prefill_metadata([0], [6])
    write(cache, metadata.slot_mapping, [10, 11, 12, 13, 14, 15])
    free = cache.num_free_blocks
    cache.fork(0, 1)
    assert cache._seq_blocks[1] == cache._seq_blocks[0] and cache.num_free_blocks == free
    # The child writes into the shared, partly used last block: it gets a copy, every layer's.
    metadata = cache.decode_metadata([1])
    assert cache.num_free_blocks == free - 1
    parent, child = cache._seq_blocks[0], cache._seq_blocks[1]
    assert child[0] == parent[0] and child[1] != parent[1]
    write(cache, metadata.slot_mapping, [99])
    assert read(cache, 0) == [10, 11, 12, 13, 14, 15] and read(cache, 1) == [10, 11, 12, 13, 14, 15, 99]
    assert read(cache, 1, layer=1) == read(cache, 1)
    # The parent holds its block alone again: it writes in place.
    metadata = cache.decode_metadata([0])
    assert cache.num_free_blocks == free - 1
    write(cache, metadata.slot_mapping, [16])
    assert read(cache, 0) == [10, 11, 12, 13, 14, 15, 16]
    # A fork of a prefix; the shared first block is freed only with its last holder.
    cache.fork(0, 2, num_tokens=4)
    assert cache.seq_len(2) == 4 and cache._seq_blocks[2] == cache._seq_blocks[0][:1]
    cache.free(0)
    cache.free(1)
    assert cache.num_free_blocks == 8 - 1 and read(cache, 2) == [10, 11, 12, 13]
    cache.free(2)
    assert cache.num_free_blocks == 8 and cache.num_cached_blocks == 0


def test_truncate_frees_emptied_blocks_and_never_writes_shared_ones():
    cache = make_cache(num_blocks=8, block_size=4)
    metadata = cache.prefill_metadata([0], [10])
    write(cache, metadata.slot_mapping, list(range(10)))
    cache.truncate(0, 3)  # 7 tokens: the third block goes
    assert cache.seq_len(0) == 7 and len(cache._seq_blocks[0]) == 2 and cache.num_free_blocks == 6
    last = cache._seq_blocks[0][1]
    cache.append_slots([0], [2])
    write(cache, cache.step_metadata([0], [2]).slot_mapping, [70, 80])
    assert cache._seq_blocks[0][1] == last and read(cache, 0) == [0, 1, 2, 3, 4, 5, 6, 70, 80]
    # Shared with a fork, the block the truncated sequence writes into next is copied first.
    cache.fork(0, 1)
    cache.truncate(0, 3)
    cache.append_slots([0], [1])
    write(cache, cache.step_metadata([0], [1]).slot_mapping, [55])
    assert cache._seq_blocks[0][1] != cache._seq_blocks[1][1]
    assert read(cache, 0) == [0, 1, 2, 3, 4, 5, 55] and read(cache, 1) == [0, 1, 2, 3, 4, 5, 6, 70, 80]
    cache.truncate(1, 9)
    assert cache.seq_len(1) == 0 and list(cache._seq_blocks[1]) == []
    cache.truncate(0, 0)
    assert cache.seq_len(0) == 7


def _prefill(cache, seq_id, tokens, prefix_caching=True):
    """A prompt run the way generation runs it: the prefix cache's blocks, then the rest in one step."""
    start = cache.add_sequence(seq_id, tokens if prefix_caching else None)
    rest = tokens[start:]
    cache.append_slots([seq_id], [len(rest)], token_ids=[rest] if prefix_caching else None)
    write(cache, cache.step_metadata([seq_id], [len(rest)]).slot_mapping, rest)
    return start


def test_prefix_cache_finds_full_blocks_by_their_tokens():
    cache = make_cache(num_blocks=24, block_size=4)
    prompt = list(range(100, 114))  # 3 full blocks and 2 tokens
    assert _prefill(cache, 0, prompt) == 0
    # Live sequences share their registered blocks: same prompt, longer.
    assert _prefill(cache, 1, prompt + [7, 8]) == 12
    assert cache._seq_blocks[1][:3] == cache._seq_blocks[0][:3] and read(cache, 1) == prompt + [7, 8]
    # The same prompt exactly: its last token must run, so its last full block (12 tokens) does not count.
    assert _prefill(cache, 2, prompt[:12]) == 8
    # A prompt that differs in its third block shares the first two.
    assert _prefill(cache, 3, prompt[:9] + [1] * 9) == 8
    # Equal tokens after a different prefix are another prefix: no hit.
    assert _prefill(cache, 4, [1, 2, 3, 4] + prompt[4:12] + [5]) == 0
    for seq_id in range(5):
        cache.free(seq_id)
    # Released, the registered blocks stay cached: every full block but 2's last, which repeats 0's.
    assert cache.num_free_blocks == 24 and cache.num_cached_blocks == 3 + 1 + 0 + 2 + 3
    assert _prefill(cache, 5, prompt + [9]) == 12 and read(cache, 5) == prompt + [9]
    assert cache.num_cached_blocks == 6
    # Without token ids nothing is registered or found.
    assert _prefill(cache, 6, prompt, prefix_caching=False) == 0
    cache.free(6)
    assert cache.num_cached_blocks == 6


def test_the_same_prefix_computed_twice_is_cached_once():
    cache = make_cache(num_blocks=12, block_size=4)
    cache.prefill_metadata([0, 1], [8, 8], token_ids=[list(range(8)), list(range(8))])
    cache.free(0)
    cache.free(1)
    assert cache.num_cached_blocks == 2 and cache.num_free_blocks == 12


def test_eviction_takes_the_least_recently_released_blocks_first():
    cache = make_cache(num_blocks=8, block_size=4)
    old, new = list(range(10, 19)), list(range(50, 59))  # two full blocks and one token each
    _prefill(cache, 0, old)
    _prefill(cache, 1, new)
    cache.free(0)
    cache.free(1)
    assert cache.num_cached_blocks == 4 and cache.num_free_blocks == 8
    # Four blocks are truly free; the fifth and sixth evict the oldest cached ones: old's tail, then its head.
    cache.prefill_metadata([2], [24])
    assert cache.num_cached_blocks == 2
    cache.free(2)
    assert _prefill(cache, 3, old) == 0 and _prefill(cache, 4, new) == 8


def test_a_hit_on_cached_blocks_counts_them_as_taken():
    """Blocks taken back from the prefix cache are no longer there to allocate: a step that would need
    them too is refused before anything changes."""
    cache = make_cache(num_blocks=4, block_size=4)
    prompt = list(range(9))
    _prefill(cache, 0, prompt)
    cache.free(0)
    assert cache.num_free_blocks == 4
    assert cache.add_sequence(1, prompt + [1]) == 8
    assert cache.num_free_blocks == 2
    before = state(cache)
    with pytest.raises(RuntimeError, match=r"out of KV blocks: this append step needs 3 blocks, 2 of 4 are"):
        cache.append_slots([1], [12])
    assert state(cache) == before


@pytest.mark.parametrize("seed", range(4))
def test_ids_recorded_before_or_after_their_slots_register_the_blocks_given_ids_do(seed):
    """A decode's token is drawn on the device, so its id reaches the cache before or after its slot is
    appended (or never, for a sequence's last token): the blocks registered, and found again by a later
    prompt, are those of appending every id with its slot."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4])
    prompt = [rng.randrange(1000) for _ in range(rng.randint(1, 11))]
    generated = [rng.randrange(1000) for _ in range(rng.randint(1, 13))]
    hashes = []
    for way in ("with the slots", "recorded"):
        cache = make_cache(num_blocks=24, block_size=block_size)
        _prefill(cache, 0, prompt)
        for position, token in enumerate(generated, start=len(prompt)):
            if way == "with the slots":
                cache.append_slots([0], [1], token_ids=[[token]])
            elif rng.random() < 0.5:
                cache.append_slots([0], [1])
                cache.record_token_ids(0, position, [token])
            else:
                cache.record_token_ids(0, position, [token])
                cache.append_slots([0], [1])
        # A position out of order (not the next unknown one) is not recorded.
        cache.record_token_ids(0, len(prompt) + len(generated) + 1, [7])
        hashes.append(list(cache._seq_hashes[0]))
        full = (len(prompt) + len(generated)) // block_size
        assert len(hashes[-1]) == full and cache._seq_tokens[0] == prompt + generated
        cache.free(0)
        assert cache.num_cached_blocks == full
        context = prompt + generated + [1]
        assert cache.add_sequence(1, context) == full * block_size
    assert hashes[0] == hashes[1]


def test_refused_calls_change_nothing():
    cache = make_cache(num_blocks=6, block_size=4)
    cache.prefill_metadata([0, 1], [5, 3])
    before = state(cache)
    calls = [
        (lambda: cache.append_slots([0, 1], [4, 10]), RuntimeError,
         r"this append step needs 4 blocks, 3 of 6"),
        (lambda: cache.append_slots([0, 5], [1, 1]), ValueError, r"expected a cached sequence .*, got 5"),
        (lambda: cache.append_slots([0], [-1]), ValueError,
         r"append_slots: num_tokens: expected non-negative ints, got -1 for seq_id 0"),
        (lambda: cache.append_slots([0, 1], [1]), ValueError, r"num_tokens: expected 2 lengths"),
        (lambda: cache.append_slots([0], [2], token_ids=[[1]]), ValueError,
         r"token_ids: expected 2 token ids for seq_id 0 \(its num_tokens\), got 1"),
        (lambda: cache.append_slots([0], [1], token_ids=[[1.5]]), ValueError, r"token_ids: expected non-neg"),
        (lambda: cache.append_slots([0], [1], token_ids="a"), TypeError, r"token_ids: expected one list of"),
        (lambda: cache.step_metadata([0, 1], [6, 1]), ValueError,
         r"query_lens: expected at most seq_len = 5 tokens for seq_id 0 \(the tokens it holds: append_slots "
         r"first\), got 6"),
        (lambda: cache.step_metadata([0], [1], block_table_width=1), ValueError,
         r"step_metadata: block_table_width: expected None or an int >= 2"),
        (lambda: cache.add_sequence(1), ValueError, r"add_sequence: seq_id: expected new sequences, got 1"),
        (lambda: cache.add_sequence(2, [1, -2]), ValueError,
         r"token_ids: expected non-negative ints, got -2"),
        (lambda: cache.add_sequence(2, 7), TypeError, r"token_ids: expected a list of token ids"),
        (lambda: cache.fork(0, 1), ValueError, r"fork: new_seq_id: expected new sequences, got 1"),
        (lambda: cache.fork(0, 2, num_tokens=6), ValueError,
         r"fork: num_tokens: expected at most seq_len = 5"),
        (lambda: cache.fork(3, 2), ValueError, r"expected a cached sequence"),
        (lambda: cache.truncate(1, 4), ValueError, r"truncate: num_tokens: expected at most seq_len = 3"),
        (lambda: cache.truncate(1, True), ValueError, r"truncate: num_tokens: expected non-negative ints"),
        (lambda: cache.prefill_metadata([2, 3], [20, 1]), RuntimeError, r"this prefill step needs 6 blocks"),
        (lambda: cache.prefill_metadata([2, 0], [1, 1]), ValueError, r"expected new sequences, got 0"),
        (lambda: cache.record_token_ids(4, 5, [1]), ValueError, r"expected a cached sequence"),
        (lambda: cache.record_token_ids(0, -1, [1]), ValueError,
         r"record_token_ids: start: expected non-negative ints, got -1 for seq_id 0"),
        (lambda: cache.record_token_ids(0, 5, [-3]), ValueError,
         r"record_token_ids: token_ids: expected non-negative ints, got -3"),
        (lambda: cache.record_token_ids(0, 5, 3), TypeError, r"record_token_ids: token_ids: expected a list"),
    ]
    for call, error, message in calls:
        with pytest.raises(error, match=message):
            call()
        assert state(cache) == before, message


def _check_invariants(cache, contents):
    held = [0] * cache.num_blocks
    for seq_id, tokens in contents.items():
        assert read(cache, seq_id) == tokens, seq_id
        assert len(cache._seq_blocks[seq_id]) == -(-len(tokens) // cache.block_size)
        for block in cache._seq_blocks[seq_id]:
            held[block] += 1
    assert held == cache._pool._ref_counts
    unheld = sum(count == 0 for count in held)
    assert cache.num_free_blocks == unheld and cache.num_cached_blocks <= unheld


@pytest.mark.parametrize("seed", range(6))
def test_random_operations_keep_every_sequence_intact(seed):
    rng = random.Random(seed)
    cache = make_cache(num_blocks=40, block_size=rng.choice([1, 2, 4]))
    vocab = [rng.randrange(3) for _ in range(6)]  # few distinct tokens: prefixes repeat, hashes collide less
    contents: dict[int, list[int]] = {}
    next_id = 0
    for _ in range(150):
        op = rng.choice(["add", "add", "append", "append", "decode", "fork", "truncate", "free"])
        live = list(contents)
        try:
            if op == "add" or not live:
                base = rng.choice(list(contents.values()) or [[]])
                tail = [rng.choice(vocab) for _ in range(rng.randrange(1, 9))]
                prompt = base[:rng.randrange(len(base) + 1)] + tail
                contents[next_id] = prompt
                try:
                    _prefill(cache, next_id, prompt, prefix_caching=rng.random() < 0.8)
                except RuntimeError:
                    del contents[next_id]
                    if next_id in cache:
                        cache.free(next_id)
                next_id += 1
            elif op == "append":
                seq_ids = rng.sample(live, rng.randint(1, len(live)))
                tokens = [[rng.choice(vocab) for _ in range(rng.randrange(4))] for _ in seq_ids]
                cache.append_slots(seq_ids, [len(t) for t in tokens], token_ids=tokens)
                metadata = cache.step_metadata(seq_ids, [len(t) for t in tokens])
                write(cache, metadata.slot_mapping, [token for t in tokens for token in t])
                for seq_id, new in zip(seq_ids, tokens, strict=True):
                    contents[seq_id] = contents[seq_id] + new
            elif op == "decode":
                seq_ids = rng.sample(live, rng.randint(1, len(live)))
                tokens = [rng.choice(vocab) for _ in seq_ids]
                write(cache, cache.decode_metadata(seq_ids).slot_mapping, tokens)
                for seq_id, token in zip(seq_ids, tokens, strict=True):
                    contents[seq_id] = contents[seq_id] + [token]
            elif op == "fork":
                seq_id = rng.choice(live)
                count = rng.randint(0, len(contents[seq_id]))
                cache.fork(seq_id, next_id, count)
                contents[next_id] = contents[seq_id][:count]
                next_id += 1
            elif op == "truncate":
                seq_id = rng.choice(live)
                count = rng.randint(0, len(contents[seq_id]))
                cache.truncate(seq_id, count)
                contents[seq_id] = contents[seq_id][:len(contents[seq_id]) - count]
            else:
                seq_id = rng.choice(live)
                cache.free(seq_id)
                del contents[seq_id]
        except RuntimeError as exc:
            assert "out of KV blocks" in str(exc)
        _check_invariants(cache, contents)


def test_block_tables_and_slots_match_the_blocks_held_on_random_ragged_sequences():
    """step_metadata and decode_metadata against each sequence's blocks padded with zeros by hand, and slots
    looked up token by token: random ragged lengths, forks sharing blocks (a partly used last block too),
    truncations, tables wider than needed, a sequence with no blocks, and steps of decodes alone."""
    rng = random.Random(3)
    block_size = 4
    cache = PagedKVCache(num_layers=1, num_blocks=400, block_size=block_size, num_kv_heads=1, head_size=4,
                         dtype=torch.float32, device="cpu")
    seq_ids = list(range(12))
    for seq_id in seq_ids[:8]:
        cache.add_sequence(seq_id)
        cache.append_slots([seq_id], [rng.randint(1, 40)])
    for seq_id in seq_ids[8:11]:
        cache.fork(rng.choice(seq_ids[:8]), seq_id, rng.randint(0, 20))
    cache.add_sequence(seq_ids[11])  # empty: no blocks
    cache.truncate(seq_ids[0], 3)
    for _ in range(3):
        rng.shuffle(seq_ids)
        query_lens = [rng.randint(0, min(3, cache.seq_len(s))) for s in seq_ids]
        cache.append_slots(seq_ids, query_lens)
        held = {s: list(cache._seq_blocks[s]) for s in seq_ids}
        needed = max(len(blocks) for blocks in held.values())
        for width in (None, needed, needed + 7):
            columns = needed if width is None else width
            expected = torch.tensor([held[s] + [0] * (columns - len(held[s])) for s in seq_ids],
                                    dtype=torch.int32)  # [num_seqs, columns]
            metadata = cache.step_metadata(seq_ids, query_lens, block_table_width=width)
            torch.testing.assert_close(metadata.block_tables, expected, rtol=0, atol=0)
            spans = [range(cache.seq_len(s) - q, cache.seq_len(s))
                     for s, q in zip(seq_ids, query_lens, strict=True)]
            slots = [held[s][p // block_size] * block_size + p % block_size
                     for s, span in zip(seq_ids, spans, strict=True) for p in span]
            assert metadata.slot_mapping.tolist() == slots
            assert metadata.seq_lens.tolist() == [cache.seq_len(s) for s in seq_ids]
        decoding = [s for s in seq_ids if cache.seq_len(s) > 0]
        metadata = cache.decode_metadata(decoding, block_table_width=needed + 2)
        held = {s: list(cache._seq_blocks[s]) for s in decoding}
        expected = torch.tensor([held[s] + [0] * (needed + 2 - len(held[s])) for s in decoding],
                                dtype=torch.int32)  # [num_decoding, needed + 2]
        torch.testing.assert_close(metadata.block_tables, expected, rtol=0, atol=0)
        positions = [cache.seq_len(s) - 1 for s in decoding]
        assert metadata.slot_mapping.tolist() == [held[s][p // block_size] * block_size + p % block_size
                                                  for s, p in zip(decoding, positions, strict=True)]
        # The same tokens as a packed step of decodes (one query token each, already appended).
        step = cache.step_metadata(decoding, [1] * len(decoding), block_table_width=needed + 2)
        torch.testing.assert_close(step.block_tables, expected, rtol=0, atol=0)
        assert step.slot_mapping.tolist() == metadata.slot_mapping.tolist()
        assert step.seq_lens.tolist() == [cache.seq_len(s) for s in decoding]
        assert step.query_lens.tolist() == [1] * len(decoding)
        assert step.query_start_loc.tolist() == list(range(len(decoding) + 1))
