"""reshape_and_cache on the CPU: cache writes with padding slots, read back and attended to."""

import pytest
import torch
import torch.nn.functional as F

from tpkit.attention import paged_attention, reshape_and_cache

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def random_caches(num_blocks, block_size, num_kv_heads, head_size, dtype, gen):
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    return (torch.randn(shape, generator=gen).to(dtype), torch.randn(shape, generator=gen).to(dtype))


def check_written(key, value, caches_before, caches_after, slot_mapping):
    """Valid tokens' K/V are in their slots bit for bit; every other slot is unchanged."""
    num_blocks, block_size = caches_after[0].shape[:2]
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for token, slot in enumerate(slot_mapping.tolist()):
        if not 0 <= slot < num_blocks * block_size:
            continue
        block, offset = divmod(slot, block_size)
        written[block, offset] = True
        assert torch.equal(caches_after[0][block, offset], key[token])
        assert torch.equal(caches_after[1][block, offset], value[token])
    for before, after in zip(caches_before, caches_after, strict=True):
        assert torch.equal(after[~written], before[~written])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_with_padding(dtype):
    gen = torch.Generator().manual_seed(0)
    key_cache, value_cache = random_caches(12, 8, 2, 32, dtype, gen)
    before = (key_cache.clone(), value_cache.clone())
    num_tokens = 40
    # Distinct random slots; the first token and several others are padding.
    slot_mapping = torch.randperm(12 * 8, generator=gen)[:num_tokens]
    slot_mapping[torch.tensor([0, 3, 4, 17, 39])] = -1
    key = torch.randn(num_tokens, 2, 32, generator=gen).to(dtype)
    value = torch.randn(num_tokens, 2, 32, generator=gen).to(dtype)
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    check_written(key, value, before, (key_cache, value_cache), slot_mapping)


@pytest.mark.parametrize("num_tokens", [0, 1, 5])
def test_only_padding_leaves_the_cache_unchanged(num_tokens):
    gen = torch.Generator().manual_seed(1)
    key_cache, value_cache = random_caches(4, 16, 1, 64, torch.float16, gen)
    before = (key_cache.clone(), value_cache.clone())
    key = torch.randn(num_tokens, 1, 64, generator=gen).half()
    reshape_and_cache(key, key.clone(), key_cache, value_cache, torch.full((num_tokens,), -1))
    assert torch.equal(key_cache, before[0]) and torch.equal(value_cache, before[1])


def test_strided_inputs_and_caches():
    """Keys as views of a fused QKV output, caches as views of wider storage: only the last dim is dense."""
    gen = torch.Generator().manual_seed(2)
    storage = torch.randn(2, 6, 8, 2, 48, generator=gen)
    key_cache, value_cache = storage[0, ..., :32], storage[1, ..., 8:40]
    before = (key_cache.clone(), value_cache.clone())
    qkv = torch.randn(10, 8, 32, generator=gen)  # [num_tokens, num_heads + 2 * num_kv_heads, head_size]
    key, value = qkv[:, 4:6], qkv[:, 6:8]
    slot_mapping = torch.tensor([5, 47, -1, 0, 33, 12, -1, 8, 41, 20])
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    check_written(key, value, before, (key_cache, value_cache), slot_mapping)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_written_sequences_attend_like_contiguous_sdpa(dtype):
    """Right-padded prompts written through slot_mapping, then attended to with paged_attention, match
    SDPA (float64) over the same K/V laid out contiguously."""
    gen = torch.Generator().manual_seed(3)
    block_size, num_kv_heads, num_heads, head_size = 8, 2, 8, 64
    prompt_lens = [13, 1, 24, 7]
    padded = max(prompt_lens)
    num_blocks = 16
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_size), float("nan"), dtype=dtype)
    value_cache = key_cache.clone()
    order = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(prompt_lens), 3, dtype=torch.int32)
    slot_mapping = torch.full((len(prompt_lens), padded), -1)
    used = 0
    for i, prompt_len in enumerate(prompt_lens):
        needed = -(-prompt_len // block_size)
        block_tables[i, :needed] = order[used:used + needed].int()
        used += needed
        positions = torch.arange(prompt_len)
        blocks = block_tables[i, positions // block_size]
        slot_mapping[i, :prompt_len] = blocks * block_size + positions % block_size
    key = torch.randn(len(prompt_lens), padded, num_kv_heads, head_size, generator=gen).to(dtype)
    value = torch.randn(len(prompt_lens), padded, num_kv_heads, head_size, generator=gen).to(dtype)
    reshape_and_cache(key.flatten(0, 1), value.flatten(0, 1), key_cache, value_cache, slot_mapping.flatten())

    query = torch.randn(len(prompt_lens), num_heads, head_size, generator=gen).to(dtype)
    seq_lens = torch.tensor(prompt_lens, dtype=torch.int32)
    out = paged_attention(query, key_cache, value_cache, block_tables, seq_lens)

    group = num_heads // num_kv_heads
    mask = torch.arange(padded)[None, :] < seq_lens[:, None]  # [num_seqs, padded]
    expected = F.scaled_dot_product_attention(
        query.double()[:, :, None],  # [num_seqs, num_heads, 1, head_size]
        key.double().transpose(1, 2).repeat_interleave(group, dim=1),  # [num_seqs, num_heads, padded, D]
        value.double().transpose(1, 2).repeat_interleave(group, dim=1),
        attn_mask=mask[:, None, None, :])[:, :, 0]
    tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


def test_opcheck():
    gen = torch.Generator().manual_seed(4)
    key_cache, value_cache = random_caches(6, 8, 2, 32, torch.float32, gen)
    key, value = torch.randn(2, 7, 2, 32, generator=gen)
    slot_mapping = torch.tensor([3, -1, 40, 17, -1, 0, 9])
    torch.library.opcheck(torch.ops.tpkit.reshape_and_cache.default,
                          (key, value, key_cache, value_cache, slot_mapping))
    torch.library.opcheck(torch.ops.tpkit.reshape_and_cache.default,
                          (key, value, key_cache, value_cache, torch.full((7,), -1)))


def _valid_args():
    gen = torch.Generator().manual_seed(5)
    key_cache, value_cache = random_caches(6, 8, 2, 32, torch.float16, gen)
    key, value = torch.randn(2, 3, 2, 32, generator=gen).half()
    return dict(key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                slot_mapping=torch.tensor([4, -1, 20]))


BAD_ARGS = [
    (lambda a: dict(key=a["key"].float()), TypeError,
     r"value: expected dtype torch.float32, got torch.float16"),
    (lambda a: dict(key=a["key"].int()), TypeError, r"key: expected dtype one of .*, got torch.int32"),
    (lambda a: dict(key=a["key"][0]), ValueError, r"key: expected 3 dimensions, got shape \[2, 32\]"),
    (lambda a: dict(value=a["value"][:2]), ValueError,
     r"value: expected shape \(that of key\) \[3, 2, 32\], got \[2, 2, 32\]"),
    (lambda a: dict(value=a["value"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError,
     r"value: expected a contiguous last dimension \(stride 1\)"),
    (lambda a: dict(key_cache=a["key_cache"][:, :, :1], value_cache=a["value_cache"][:, :, :1]), ValueError,
     r"key_cache: expected \[num_kv_heads, head_size\] \(dims 2, 3, those of key\) \[2, 32\], got \[1, 32\]"),
    (lambda a: dict(key_cache=a["key_cache"].bfloat16()), TypeError,
     r"key_cache: expected dtype torch.float16 \(that of key\) or a float8 dtype .*, got torch.bfloat16"),
    (lambda a: dict(value_cache=a["value_cache"][1:]), ValueError,
     r"value_cache: expected shape \(that of key_cache\)"),
    (lambda a: dict(slot_mapping=a["slot_mapping"].int()), TypeError,
     r"slot_mapping: expected dtype torch.int64, got torch.int32"),
    (lambda a: dict(slot_mapping=a["slot_mapping"][:2]), ValueError,
     r"slot_mapping: expected shape \[num_tokens\] \[3\], got \[2\]"),
    (lambda a: dict(slot_mapping=a["slot_mapping"].to("meta")), ValueError,
     r"slot_mapping: expected device cpu \(the device of key\), got meta"),
]


@pytest.mark.parametrize("make_bad,error,message", BAD_ARGS,
                         ids=[f"{i}-{arg[2].split(':')[0]}" for i, arg in enumerate(BAD_ARGS)])
def test_validation_errors(make_bad, error, message):
    args = _valid_args()
    args.update(make_bad(args))
    before = args["key_cache"].clone()
    with pytest.raises(error, match=message):
        reshape_and_cache(**args)
    if args["key_cache"].shape == before.shape and args["key_cache"].dtype == before.dtype:
        assert torch.equal(args["key_cache"], before)


def test_debug_check_slot_range(monkeypatch):
    args = _valid_args()
    args["slot_mapping"] = torch.tensor([4, -1, 48])  # 6 blocks of 8 slots
    monkeypatch.setenv("TPKIT_DEBUG", "1")
    with pytest.raises(ValueError, match=r"slot_mapping\[2\]: expected a slot below num_blocks \* block_size "
                                         r"= 48 \(or negative to skip\), got 48"):
        reshape_and_cache(**args)
