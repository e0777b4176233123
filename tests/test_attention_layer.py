"""The Attention module: every step shape through the paged cache, and SDPA without one, against naive
attention."""

import dataclasses
import math
import random

import pytest
import torch

from tpkit.attention import Attention, PagedKVCache

HEAD_SIZE = 16


def naive_attention(query, key, value, *, causal):
    """One head at a time in float64. query [q_len, num_heads, D]; key, value [kv_len, num_kv_heads, D];
    causal aligns the last query with the last key."""
    q_len, num_heads, head_size = query.shape
    kv_len, num_kv_heads, _ = key.shape
    out = torch.empty(q_len, num_heads, head_size, dtype=torch.float64)
    for h in range(num_heads):
        kv_head = h // (num_heads // num_kv_heads)
        scores = query[:, h].double() @ key[:, kv_head].double().T / math.sqrt(head_size)  # [q_len, kv_len]
        if causal:
            allowed = torch.arange(kv_len)[None, :] <= torch.arange(kv_len - q_len, kv_len)[:, None]
            scores = scores.masked_fill(~allowed, float("-inf"))
        out[:, h] = torch.softmax(scores, dim=-1) @ value[:, kv_head].double()
    return out


def heads(x, num_heads):
    """[..., num_heads * HEAD_SIZE] -> [..., num_heads, HEAD_SIZE]"""
    return x.unflatten(-1, (num_heads, HEAD_SIZE))


def right_padded(full, lens, gen):
    """The first lens[i] positions of each row of full [batch, seq, width]; the rest random garbage."""
    padded = torch.randn(full.shape[0], max(lens), full.shape[2], generator=gen) * 100
    for i, n in enumerate(lens):
        padded[i, :n] = full[i, :n]
    return padded


def packed(full, starts, ends):
    """Positions starts[i]:ends[i] of each row of full [batch, seq, width], packed as [1, tokens, width]."""
    return torch.cat([full[i, a:b] for i, (a, b) in enumerate(zip(starts, ends, strict=True))])[None]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_prefill_then_decode_equals_full_causal_attention(num_heads, num_kv_heads):
    gen = torch.Generator().manual_seed(num_heads + num_kv_heads)
    prompt_lens, steps = [5, 1, 11], 7
    total = max(prompt_lens) + steps
    q_full = torch.randn(3, total, num_heads * HEAD_SIZE, generator=gen)
    k_full = torch.randn(3, total, num_kv_heads * HEAD_SIZE, generator=gen)
    v_full = torch.randn(3, total, num_kv_heads * HEAD_SIZE, generator=gen)
    cache = PagedKVCache(2, 16, 4, num_kv_heads, HEAD_SIZE, dtype=torch.float32, device="cpu")
    for tensor in cache.key_caches + cache.value_caches:
        tensor.fill_(float("nan"))  # never read where nothing was written
    attention = Attention(num_heads, HEAD_SIZE, num_kv_heads)
    seq_ids = [10, 20, 30]

    metadata = cache.prefill_metadata(seq_ids, prompt_lens)
    zeros = [0] * 3
    out = attention(packed(q_full, zeros, prompt_lens), packed(k_full, zeros, prompt_lens),
                    packed(v_full, zeros, prompt_lens), kv_cache=cache, layer_idx=1, metadata=metadata)
    assert out.shape == (1, sum(prompt_lens), num_heads * HEAD_SIZE)
    start = 0
    for i, n in enumerate(prompt_lens):
        expected = naive_attention(heads(q_full[i, :n], num_heads), heads(k_full[i, :n], num_kv_heads),
                                   heads(v_full[i, :n], num_kv_heads), causal=True)
        torch.testing.assert_close(heads(out[0, start:start + n], num_heads).double(), expected, atol=1e-5,
                                   rtol=1e-5)
        start += n
    assert cache.key_caches[0].isnan().all()  # layer 0 untouched

    for step in range(steps):
        positions = [n + step for n in prompt_lens]
        rows = torch.arange(3)
        metadata = cache.decode_metadata(seq_ids)
        out = attention(q_full[rows, positions][:, None], k_full[rows, positions][:, None],
                        v_full[rows, positions][:, None], kv_cache=cache, layer_idx=1, metadata=metadata)
        assert out.shape == (3, 1, num_heads * HEAD_SIZE)
        for i, p in enumerate(positions):
            expected = naive_attention(heads(q_full[i, p:p + 1], num_heads),
                                       heads(k_full[i, :p + 1], num_kv_heads),
                                       heads(v_full[i, :p + 1], num_kv_heads), causal=True)
            torch.testing.assert_close(heads(out[i, 0], num_heads).double(), expected[0], atol=1e-5,
                                       rtol=1e-5)


@pytest.mark.parametrize("seed,num_heads,num_kv_heads", [(0, 4, 2), (1, 6, 1), (2, 4, 4)])
def test_steps_of_every_shape_equal_full_causal_attention(seed, num_heads, num_kv_heads):
    """Random steps over one cache: prompts started whole or in chunks, chunks after cached tokens,
    several speculative tokens of which the last are then rejected (truncated and replaced), decodes
    mixed into packed steps, and plain decode steps. Every token's output is causal attention over its
    sequence's tokens as they stand at that step."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lengths = [23, 9, 31]
    q_full = torch.randn(3, 40, num_heads * HEAD_SIZE, generator=gen)
    k_full = torch.randn(3, 40, num_kv_heads * HEAD_SIZE, generator=gen)
    v_full = torch.randn(3, 40, num_kv_heads * HEAD_SIZE, generator=gen)
    cache = PagedKVCache(1, 40, 4, num_kv_heads, HEAD_SIZE, dtype=torch.float32, device="cpu")
    for tensor in cache.key_caches + cache.value_caches:
        tensor.fill_(float("nan"))
    attention = Attention(num_heads, HEAD_SIZE, num_kv_heads)
    done = [0, 0, 0]
    while done != lengths:
        live = [i for i in range(3) if done[i] < lengths[i]]
        if all(i in cache and done[i] > 0 for i in live) and rng.random() < 0.3:
            metadata = cache.decode_metadata(live)  # the decode kernel's shape
            counts, rows = [1] * len(live), torch.tensor(live)
            out = attention(q_full[rows, [done[i] for i in live]][:, None],
                            k_full[rows, [done[i] for i in live]][:, None],
                            v_full[rows, [done[i] for i in live]][:, None], kv_cache=cache, metadata=metadata)
            out = out[:, 0]
        else:
            counts = [rng.choice([0, 1, 1, 3, 8, lengths[i]]) for i in live]
            counts = [min(n, lengths[i] - done[i]) for i, n in zip(live, counts, strict=True)]
            for i in live:
                if i not in cache:
                    cache.add_sequence(i)
            cache.append_slots(live, counts)
            metadata = cache.step_metadata(live, counts)
            ends = [done[i] + n for i, n in zip(live, counts, strict=True)]
            starts = [done[i] for i in live]
            rows = [q_full[i:i + 1] for i in live]
            picks = (torch.cat(rows), torch.cat([k_full[i:i + 1] for i in live]),
                     torch.cat([v_full[i:i + 1] for i in live]))
            out = attention(*(packed(x, starts, ends) for x in picks), kv_cache=cache, metadata=metadata)[0]
        row = 0
        for i, n in zip(live, counts, strict=True):
            for p in range(done[i], done[i] + n):
                expected = naive_attention(heads(q_full[i, p:p + 1], num_heads),
                                           heads(k_full[i, :p + 1], num_kv_heads),
                                           heads(v_full[i, :p + 1], num_kv_heads), causal=True)
                torch.testing.assert_close(heads(out[row], num_heads).double(), expected[0], atol=1e-5,
                                           rtol=1e-5)
                row += 1
            done[i] += n
            if n > 1 and done[i] < lengths[i] and rng.random() < 0.5:
                # The last tokens were speculative and are rejected: dropped, and other tokens come instead.
                rejected = rng.randint(1, n - 1)
                cache.truncate(i, rejected)
                done[i] -= rejected
                for full in (q_full, k_full, v_full):
                    full[i, done[i]:] = torch.randn(full.shape[1] - done[i], full.shape[2], generator=gen)


def test_cross_attention_prefill_and_decode():
    """Encoder K/V written once at prefill, where the decoder's queries (their own query_start_loc) attend
    to them; decode steps pass none and attend to every encoder position (not causally)."""
    gen = torch.Generator().manual_seed(1)
    num_heads, num_kv_heads = 4, 2
    encoder_lens, decoder_len = [3, 9], 4
    enc_k = torch.randn(2, max(encoder_lens), num_kv_heads * HEAD_SIZE, generator=gen)
    enc_v = torch.randn(2, max(encoder_lens), num_kv_heads * HEAD_SIZE, generator=gen)
    dec_q = torch.randn(2, decoder_len, num_heads * HEAD_SIZE, generator=gen)
    cross_cache = PagedKVCache(1, 8, 4, num_kv_heads, HEAD_SIZE, dtype=torch.float32, device="cpu")
    for tensor in cross_cache.key_caches + cross_cache.value_caches:
        tensor.fill_(float("nan"))
    attention = Attention(num_heads, HEAD_SIZE, num_kv_heads, causal=False)

    def expected(i, q):
        n = encoder_lens[i]
        return naive_attention(heads(q, num_heads), heads(enc_k[i, :n], num_kv_heads),
                               heads(enc_v[i, :n], num_kv_heads), causal=False)

    metadata = dataclasses.replace(cross_cache.prefill_metadata([0, 1], encoder_lens),
                                   query_start_loc=torch.tensor([0, 2, 4], dtype=torch.int32))
    out = attention(packed(dec_q, [0, 0], [2, 2]), packed(enc_k, [0, 0], encoder_lens),
                    packed(enc_v, [0, 0], encoder_lens), kv_cache=cross_cache, metadata=metadata)
    for i in range(2):
        torch.testing.assert_close(heads(out[0, 2 * i:2 * i + 2], num_heads).double(),
                                   expected(i, dec_q[i, :2]), atol=1e-5, rtol=1e-5)
    free = cross_cache.num_free_blocks
    for step in range(2, decoder_len):
        metadata = cross_cache.decode_metadata([0, 1], append=False)
        out = attention(dec_q[:, step:step + 1], None, None, kv_cache=cross_cache, metadata=metadata)
        for i in range(2):
            torch.testing.assert_close(heads(out[i], num_heads).double(),
                                       expected(i, dec_q[i, step:step + 1]), atol=1e-5, rtol=1e-5)
    assert cross_cache.num_free_blocks == free and cross_cache.seq_len(1) == 9


def test_decode_query_views():
    """A decode step's query as the models pass it, a slice of a wider fused projection, and with a strided
    last dimension: the same output as the contiguous query."""
    gen = torch.Generator().manual_seed(5)
    num_heads, num_kv_heads = 4, 2
    cache = PagedKVCache(1, 16, 4, num_kv_heads, HEAD_SIZE, dtype=torch.float32, device="cpu")
    attention = Attention(num_heads, HEAD_SIZE, num_kv_heads)
    k = torch.randn(2, 7, num_kv_heads * HEAD_SIZE, generator=gen)
    v = torch.randn(2, 7, num_kv_heads * HEAD_SIZE, generator=gen)
    attention(torch.randn(1, 9, num_heads * HEAD_SIZE, generator=gen), packed(k, [0, 0], [6, 3]),
              packed(v, [0, 0], [6, 3]), kv_cache=cache, metadata=cache.prefill_metadata([0, 1], [6, 3]))
    width = num_heads * HEAD_SIZE
    fused = torch.randn(2, 1, width + num_kv_heads * HEAD_SIZE, generator=gen)  # [q | k] of one step
    wide = torch.randn(2, 1, 2 * width, generator=gen)
    queries = {"slice": fused[..., :width], "strided": wide[..., ::2]}
    assert queries["slice"].stride(0) != width and queries["strided"].stride(-1) == 2
    metadata = cache.decode_metadata([0, 1])
    k_new, v_new = k[:, 6:7], v[:, 6:7]  # this step's K/V, written by the first call only
    for name, query in queries.items():
        out = attention(query, k_new, v_new, kv_cache=cache, metadata=metadata)
        expected = attention(query.contiguous(), None, None, kv_cache=cache, metadata=metadata)
        torch.testing.assert_close(out, expected, rtol=0, atol=0, msg=name)
        k_new = v_new = None


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_without_cache(causal):
    gen = torch.Generator().manual_seed(2)
    num_heads, num_kv_heads = 6, 2
    lens = [7, 2, 4]
    q = torch.randn(3, 7, num_heads * HEAD_SIZE, generator=gen)
    k = torch.randn(3, 7, num_kv_heads * HEAD_SIZE, generator=gen)
    v = torch.randn(3, 7, num_kv_heads * HEAD_SIZE, generator=gen)
    attention = Attention(num_heads, HEAD_SIZE, num_kv_heads, causal=causal)
    # Causal attention needs no key_lens for right padding; bidirectional uses them.
    key_lens = torch.tensor(lens)
    out = attention(q, right_padded(k, lens, gen), right_padded(v, lens, gen), key_lens=key_lens)
    for i, n in enumerate(lens):
        expected = naive_attention(heads(q[i, :n], num_heads), heads(k[i, :n], num_kv_heads),
                                   heads(v[i, :n], num_kv_heads), causal=causal)
        torch.testing.assert_close(heads(out[i, :n], num_heads).double(), expected, atol=1e-5, rtol=1e-5)


def test_bidirectional_without_key_lens_and_custom_scale():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(2, 3, 2 * HEAD_SIZE, generator=gen)
    k = torch.randn(2, 5, HEAD_SIZE, generator=gen)
    v = torch.randn(2, 5, HEAD_SIZE, generator=gen)
    out = Attention(2, HEAD_SIZE, 1, causal=False, scale=0.5 / math.sqrt(HEAD_SIZE))(q, k, v)
    for i in range(2):
        expected = naive_attention(heads(q[i], 2) * 0.5, heads(k[i], 1), heads(v[i], 1), causal=False)
        torch.testing.assert_close(heads(out[i], 2).double(), expected, atol=1e-5, rtol=1e-5)


def test_half_precision_decode_matches_float32():
    """The cache in the model's dtype: bf16 prefill and decode stay close to the float32 computation."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 6, 4 * HEAD_SIZE, generator=gen)
    k = torch.randn(2, 6, 2 * HEAD_SIZE, generator=gen)
    v = torch.randn(2, 6, 2 * HEAD_SIZE, generator=gen)
    attention = Attention(4, HEAD_SIZE, 2)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        cache = PagedKVCache(1, 8, 4, 2, HEAD_SIZE, dtype=dtype, device="cpu")
        prefill = attention(q[:, :5].to(dtype), k[:, :5].to(dtype), v[:, :5].to(dtype), kv_cache=cache,
                            metadata=cache.prefill_metadata([0, 1], [5, 5]))
        decode = attention(q[:, 5:].to(dtype), k[:, 5:].to(dtype), v[:, 5:].to(dtype), kv_cache=cache,
                           metadata=cache.decode_metadata([0, 1]))
        assert prefill.dtype == decode.dtype == dtype
        results[dtype] = torch.cat([prefill, decode], dim=1).float()
    torch.testing.assert_close(results[torch.bfloat16], results[torch.float32], atol=3e-2, rtol=3e-2)


def test_bad_calls():
    cache = PagedKVCache(1, 8, 4, 2, HEAD_SIZE, dtype=torch.float32, device="cpu")
    attention = Attention(4, HEAD_SIZE, 2)
    q = torch.randn(2, 3, 4 * HEAD_SIZE)
    kv = torch.randn(2, 3, 2 * HEAD_SIZE)
    prefill = cache.prefill_metadata([0, 1], [3, 2])
    decode = cache.decode_metadata([0, 1])
    with pytest.raises(ValueError, match=r"metadata: expected the step's AttentionMetadata"):
        attention(q, kv, kv, kv_cache=cache)
    with pytest.raises(ValueError, match=r"layer_idx: expected an index in \[0, 1\), got 1"):
        attention(q, kv, kv, kv_cache=cache, metadata=prefill, layer_idx=1)
    with pytest.raises(ValueError, match=r"query: expected q_len 1 at a decode step, got shape \[2, 3, 64\]"):
        attention(q, kv, kv, kv_cache=cache, metadata=decode)
    with pytest.raises(ValueError, match=r"key: expected 2 tokens \(one per slot_mapping entry\), got shape "
                                         r"\[2, 3, 32\]"):
        attention(q[:, :1], kv, kv, kv_cache=cache, metadata=decode)
    with pytest.raises(ValueError, match=r"key, value: expected tensors without a kv_cache, got None"):
        attention(q, None, None)
    with pytest.raises(ValueError, match=r"key, value: expected both tensors or both None, got Tensor and"):
        attention(q, kv, None)
    with pytest.raises(ValueError, match=r"key: expected shape \[2, seq, 32\], got \[2, 3, 64\]"):
        attention(q, q, q)
    with pytest.raises(ValueError, match=r"key: expected kv_len = q_len = 3 for causal attention, got 2"):
        attention(q, kv[:, :2], kv[:, :2])
    with pytest.raises(ValueError, match=r"key_lens: expected an int tensor of shape \[2\], got torch.float"):
        Attention(4, HEAD_SIZE, 2, causal=False)(q, kv, kv, key_lens=torch.ones(2))
    with pytest.raises(ValueError, match=r"num_kv_heads: expected a divisor of num_heads = 4, got 3"):
        Attention(4, HEAD_SIZE, 3)
