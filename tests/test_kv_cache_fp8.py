"""A float8 KV cache on the CPU: the quantizing write, attention that dequantizes as it loads, the accuracy
bound of fp8 rounding, the cache's scales, the Attention module over it, and bad input.

The bound. With round-to-nearest into a float8 format of ``m`` mantissa bits, a stored value ``x / s`` (in
range) is off by at most ``u * |x / s| + eta``: ``u = 2**-(m + 1)`` (e4m3: 2**-4, e5m2: 2**-3) and ``eta``
half the subnormal spacing (e4m3: 2**-10, e5m2: 2**-17). So each dequantized key and value element is off
by ``dk <= u * |k| + eta * s_k`` (``dv`` alike). For a query ``q`` the scores move by at most
``delta = max_i scale * sum_d |q_d| * dk_id``, which changes every softmax weight by a factor within
``exp(+-2 delta)``; hence, against float32 attention over the unquantized keys and values,
``|out_fp8 - out| <= max_i dv_i + max_i |v_i| * (exp(2 delta) - 1)`` per output element (plus float32
accumulation, far below it).
"""

import math

import pytest
import torch
from test_paged_attention import make_case
from test_paged_attention_multitoken import naive_multitoken

from tpkit.attention import (
    Attention,
    PagedKVCache,
    calibrated_kv_scales,
    paged_attention,
    reshape_and_cache,
)

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
# (u, eta): the relative rounding bound in the normal range and half the subnormal spacing.
ROUNDING = {torch.float8_e4m3fn: (2.0 ** -4, 2.0 ** -10), torch.float8_e5m2: (2.0 ** -3, 2.0 ** -17)}


def finite_values(dtype):
    """Every finite value of a float8 dtype, float64, from its 256 bit patterns."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).double()
    return values[torch.isfinite(values)]


def fp8_step(case, dtype, per_head, seed=0):
    """The case's K/V written into float8 caches with calibrated scales; returns (caches, scales, the
    unquantized caches)."""
    key_cache, value_cache = case["key_cache"], case["value_cache"]
    num_kv_heads = key_cache.shape[2]
    k_scale, v_scale = calibrated_kv_scales(key_cache.nan_to_num(0.0), value_cache.nan_to_num(0.0), dtype,
                                            per_head=per_head)
    gen = torch.Generator().manual_seed(seed)
    # Scales a little larger than calibrated and random per head, so that no value saturates.
    k_scale = k_scale * (1 + torch.rand(k_scale.shape, generator=gen))
    v_scale = v_scale * (1 + torch.rand(v_scale.shape, generator=gen))
    fp8_caches = [torch.full_like(key_cache, float("nan"), dtype=dtype) for _ in range(2)]
    # Every slot of the unquantized caches through the write, NaN slots included (NaN stays NaN).
    slots = torch.arange(key_cache.shape[0] * key_cache.shape[1])
    flat = [c.reshape(-1, num_kv_heads, key_cache.shape[3]) for c in (key_cache, value_cache)]
    reshape_and_cache(*flat, *fp8_caches, slots, k_scale, v_scale)
    return fp8_caches, (k_scale, v_scale)


def dequantized(cache, scale):
    return cache.double() * scale.double().view(-1, 1)


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_write_rounds_to_the_nearest_float8_and_skips_padding(dtype):
    gen = torch.Generator().manual_seed(1)
    num_tokens, num_kv_heads, head_size = 24, 2, 32
    key = (torch.randn(num_tokens, num_kv_heads, head_size, generator=gen) * 3).bfloat16()
    value = torch.randn(num_tokens, num_kv_heads, head_size, generator=gen).bfloat16()
    key_cache = torch.randn(6, 8, num_kv_heads, head_size, generator=gen).to(dtype)
    value_cache = torch.randn(6, 8, num_kv_heads, head_size, generator=gen).to(dtype)
    before = (key_cache.clone(), value_cache.clone())
    slot_mapping = torch.randperm(48, generator=gen)[:num_tokens]
    slot_mapping[torch.tensor([0, 5, 11])] = -1
    k_scale = torch.tensor([0.01, 0.03])  # per KV head
    v_scale = torch.tensor(0.004)
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    grid = finite_values(dtype)
    written = torch.zeros(6, 8, dtype=torch.bool)
    for new, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        for token, slot in enumerate(slot_mapping.tolist()):
            if slot < 0:
                continue
            block, offset = divmod(slot, 8)
            written[block, offset] = True
            target = new[token].double() / scale.double().view(-1, 1)  # [num_kv_heads, head_size]
            stored = cache[block, offset].double()
            nearest = (grid[None, :] - target.reshape(-1, 1)).abs().amin(dim=1).view_as(target)
            assert ((stored - target).abs() <= nearest + 1e-6 * target.abs()).all()
    for old, cache in zip(before, (key_cache, value_cache), strict=True):
        assert torch.equal(cache[~written].view(torch.uint8), old[~written].view(torch.uint8))


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_write_saturates_and_keeps_nan(dtype):
    special = torch.tensor([1e9, -1e9, float("inf"), float("-inf"), float("nan"), 0.5])
    key = special.view(1, 1, 6).expand(1, 1, 6).float()
    key_cache = torch.zeros(1, 1, 1, 6, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    reshape_and_cache(key, key * 2, key_cache, value_cache, torch.tensor([0]), 0.5, 1.0)
    top = torch.finfo(dtype).max
    got = key_cache.view(6).double()
    assert got[:4].tolist() == [top, -top, top, -top]
    assert math.isnan(got[4]) and got[5] == 1.0
    assert value_cache.view(6).double()[5] == 1.0


@pytest.mark.parametrize("dtype,per_head,query_dtype", [
    (torch.float8_e4m3fn, False, torch.float32),
    (torch.float8_e4m3fn, True, torch.bfloat16),
    (torch.float8_e5m2, True, torch.float32),
], ids=str)
def test_attention_dequantizes_and_stays_within_the_fp8_bound(dtype, per_head, query_dtype):
    case = make_case(num_heads=4, num_kv_heads=2, head_size=32, block_size=8, seq_lens=[13, 1, 30],
                     dtype=torch.float32, seed=3)
    (key_fp8, value_fp8), (k_scale, v_scale) = fp8_step(case, dtype, per_head)
    gen = torch.Generator().manual_seed(4)
    query_lens = [4, 1, 7]
    query = torch.randn(sum(query_lens), 4, 32, generator=gen).to(query_dtype)
    query_start_loc = torch.tensor([0, 4, 5, 12], dtype=torch.int32)
    scale = 32 ** -0.5
    out = paged_attention(query, key_fp8, value_fp8, case["block_tables"], case["seq_lens"],
                          query_start_loc=query_start_loc, k_scale=k_scale, v_scale=v_scale)
    assert out.dtype == query_dtype
    args = (case["block_tables"], case["seq_lens"], query_start_loc, scale, None, True)
    # Exactly the attention over the dequantized cache, up to float32 accumulation and query's rounding.
    on_dequantized = naive_multitoken(query, dequantized(key_fp8, k_scale), dequantized(value_fp8, v_scale),
                                      *args)
    tolerance = 2e-6 if query_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), on_dequantized, atol=tolerance, rtol=tolerance)
    # And within the bound of fp8 rounding of the float32 attention over the unquantized K/V.
    exact = naive_multitoken(query, case["key_cache"], case["value_cache"], *args)
    u, eta = ROUNDING[dtype]
    keys, values = case["key_cache"].nan_to_num(0.0).double(), case["value_cache"].nan_to_num(0.0).double()
    dk = u * keys.abs() + eta * k_scale.double().view(-1, 1)  # [num_blocks, block_size, num_kv_heads, D]
    dv = u * values.abs() + eta * v_scale.double().view(-1, 1)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(case["seq_lens"].tolist()):
        blocks = case["block_tables"][i].long()[torch.arange(seq_len) // 8]
        offsets = torch.arange(seq_len) % 8
        for t in range(starts[i], starts[i + 1]):
            for h in range(4):
                kv = h // 2
                delta = (scale * (query[t, h].double().abs() * dk[blocks, offsets, kv]).sum(-1)).max()
                bound = (dv[blocks, offsets, kv].amax()
                         + values[blocks, offsets, kv].abs().amax() * math.expm1(2 * float(delta)))
                error = (out[t, h].double() - exact[t, h]).abs().max()
                assert error <= bound + (1e-5 if query_dtype == torch.float32 else 2e-2)
    assert (out.double() - exact).abs().max() > 0  # the cache is really quantized


def test_decode_step_equals_the_multitoken_step_of_one_token_a_sequence():
    case = make_case(num_heads=4, num_kv_heads=1, head_size=32, block_size=16, seq_lens=[5, 40],
                     dtype=torch.float32, seed=5)
    (key_fp8, value_fp8), (k_scale, v_scale) = fp8_step(case, torch.float8_e4m3fn, per_head=False)
    decode = paged_attention(case["query"], key_fp8, value_fp8, case["block_tables"], case["seq_lens"],
                             k_scale=k_scale, v_scale=v_scale, alibi_slopes=None)
    packed = paged_attention(case["query"], key_fp8, value_fp8, case["block_tables"], case["seq_lens"],
                             k_scale=float(k_scale), v_scale=float(v_scale),
                             query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32))
    torch.testing.assert_close(decode, packed, atol=1e-6, rtol=1e-6)


def _bad_input_args():
    gen = torch.Generator().manual_seed(6)
    key = torch.randn(3, 2, 16, generator=gen).bfloat16()
    key_cache = torch.zeros(2, 4, 2, 16, dtype=torch.float8_e4m3fn)
    return dict(key=key, value=key.clone(), key_cache=key_cache, value_cache=key_cache.clone(),
                slot_mapping=torch.tensor([0, 5, -1]), k_scale=torch.tensor(0.5),
                v_scale=torch.tensor([1.0, 2.0]))


BAD_SCALES = [
    (dict(k_scale=None), ValueError, r"reshape_and_cache: k_scale: expected a float32 scale for a "
     r"torch.float8_e4m3fn cache"),
    (dict(v_scale=None), ValueError, r"v_scale: expected a float32 scale"),
    (dict(key_cache=torch.zeros(2, 4, 2, 16, dtype=torch.float16), value_cache=torch.zeros(2, 4, 2, 16)),
     TypeError, r"key_cache: expected dtype torch.bfloat16 \(that of key\) or a float8 dtype .* got "
     r"torch.float16"),
    (dict(key_cache=torch.zeros(2, 4, 2, 16, dtype=torch.bfloat16),
          value_cache=torch.zeros(2, 4, 2, 16, dtype=torch.bfloat16)),
     ValueError, r"k_scale: expected None for a torch.bfloat16 cache"),
    (dict(value_cache=torch.zeros(2, 4, 2, 16, dtype=torch.float8_e5m2)), TypeError,
     r"value_cache: expected dtype torch.float8_e4m3fn, got torch.float8_e5m2"),
    (dict(k_scale=torch.tensor(0.5, dtype=torch.float64)), ValueError,
     r"k_scale: expected float32 of shape \[\] or \[num_kv_heads\] = \[2\], got torch.float64 of shape \[\]"),
    (dict(v_scale=torch.ones(3)), ValueError, r"v_scale: expected float32 of shape .* got torch.float32 of "
     r"shape \[3\]"),
    (dict(k_scale=torch.tensor([1.0, 0.0])), ValueError,
     r"k_scale: expected finite positive scales, got 0.0 at index 1"),
    (dict(v_scale=torch.tensor(float("nan"))), ValueError,
     r"v_scale: expected finite positive scales, got nan"),
    (dict(k_scale=True), TypeError, r"k_scale: expected a float, a float32 tensor or None, got bool"),
    (dict(k_scale=torch.tensor(1.0, device="meta")), ValueError,
     r"k_scale: expected device cpu \(the device of key_cache\), got meta"),
]


@pytest.mark.parametrize("change,error,message", BAD_SCALES, ids=[m for _, _, m in BAD_SCALES])
def test_bad_scales_are_named_before_any_write(change, error, message):
    args = {**_bad_input_args(), **change}
    before = args["key_cache"].clone()
    with pytest.raises(error, match=message):
        reshape_and_cache(**args)
    assert torch.equal(args["key_cache"].view(torch.uint8), before.view(torch.uint8))


def test_paged_attention_refuses_a_float8_cache_without_scales_and_scales_without_one():
    case = make_case(num_heads=2, num_kv_heads=2, head_size=16, block_size=4, seq_lens=[3],
                     dtype=torch.float32)
    args = (case["query"], case["key_cache"].to(torch.float8_e5m2), case["value_cache"].to(torch.float8_e5m2),
            case["block_tables"], case["seq_lens"])
    with pytest.raises(ValueError, match=r"paged_attention: k_scale: expected a float32 scale for a "
                                         r"torch.float8_e5m2 cache"):
        paged_attention(*args, v_scale=1.0)
    with pytest.raises(ValueError, match=r"paged_attention: v_scale: expected None for a torch.float32 "
                                         r"cache"):
        paged_attention(*args[:1], case["key_cache"], case["value_cache"], *args[3:], v_scale=1.0)


def test_opcheck_of_the_quantizing_write():
    args = _bad_input_args()
    # opcheck's schema test multiplies the float8 caches, which the CPU cannot: the other tests run.
    torch.library.opcheck(torch.ops.tpkit.reshape_and_cache.default,
                          tuple(args[name] for name in ("key", "value", "key_cache", "value_cache",
                                                        "slot_mapping", "k_scale", "v_scale")),
                          test_utils=("test_autograd_registration", "test_faketensor",
                                      "test_aot_dispatch_dynamic"))


def test_cache_scales_calibration_and_the_attention_module():
    """A float8 PagedKVCache: half the bytes, scales per layer (1.0 until set, per head or not), and the
    Attention module writing and reading it with them, against the definition over the dequantized cache."""
    cache = PagedKVCache(2, 6, 4, 2, 16, dtype=torch.float8_e4m3fn, device="cpu")
    assert cache.is_fp8 and cache.key_caches[0].element_size() == 1
    assert [float(s) for s in cache.scales(1)] == [1.0, 1.0]
    assert PagedKVCache(1, 2, 4, 2, 16, dtype=torch.bfloat16, device="cpu").scales(0) == (None, None)
    gen = torch.Generator().manual_seed(7)
    key = torch.randn(1, 9, 32, generator=gen) * torch.tensor([1.0] * 16 + [8.0] * 16)
    value = torch.randn(1, 9, 32, generator=gen)
    query = torch.randn(1, 9, 64, generator=gen)
    k_scale, v_scale = calibrated_kv_scales(key.view(9, 2, 16), value.view(9, 2, 16), per_head=True)
    torch.testing.assert_close(k_scale, key.view(9, 2, 16).abs().amax(dim=(0, 2)) / 448)
    k_before, v_before = cache.scales(1)
    cache.set_scales(1, k_scale, float(v_scale.max()))
    assert cache.k_scales[1] is not k_before and cache.v_scales[1] is v_before  # [2] replaced, [] in place
    metadata = cache.prefill_metadata([0], [9])
    attn = Attention(4, 16, 2)
    out = attn(query, key, value, kv_cache=cache, layer_idx=1, metadata=metadata)
    blocks = metadata.block_tables[0].long()[torch.arange(9) // 4]
    keys = dequantized(cache.key_caches[1][blocks, torch.arange(9) % 4], cache.k_scales[1])
    torch.testing.assert_close(keys, key.view(9, 2, 16).double(), rtol=2 ** -4, atol=k_scale.max() * 2 ** -10)
    expected = naive_multitoken(query.view(9, 4, 16), dequantized(cache.key_caches[1], cache.k_scales[1]),
                                dequantized(cache.value_caches[1], cache.v_scales[1]), metadata.block_tables,
                                metadata.seq_lens, metadata.query_start_loc, 0.25, None, True)
    torch.testing.assert_close(out.view(9, 4, 16).double(), expected, atol=2e-6, rtol=2e-6)
    assert not cache.key_caches[0].float().any()  # layer 0 untouched


@pytest.mark.parametrize("call,error,message", [
    (lambda c: c.set_scales(0, 0.0, 1.0), ValueError, r"k_scale: expected finite positive scales, got 0.0"),
    (lambda c: c.set_scales(0, 1.0, torch.ones(3)), ValueError,
     r"v_scale: expected shape \[\] or \[num_kv_heads\] = \[2\], got \[3\]"),
    (lambda c: c.set_scales(2, 1.0, 1.0), ValueError, r"layer_idx: expected an int in \[0, 2\), got 2"),
    (lambda c: c.set_scales(0, "1", 1.0), TypeError, r"k_scale: expected a float or a float tensor, got str"),
])
def test_set_scales_refuses_bad_scales(call, error, message):
    cache = PagedKVCache(2, 2, 4, 2, 16, dtype=torch.float8_e5m2, device="cpu")
    with pytest.raises(error, match=message):
        call(cache)
    assert all(float(s) == 1.0 for s in cache.k_scales + cache.v_scales)


def test_set_scales_and_calibration_refuse_what_does_not_apply():
    with pytest.raises(ValueError, match=r"set_scales: expected a float8 cache, got one of torch.float16"):
        PagedKVCache(1, 2, 4, 2, 16, dtype=torch.float16, device="cpu").set_scales(0, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"calibrated_kv_scales: dtype: expected one of .*, got "
                                         r"torch.bfloat16"):
        calibrated_kv_scales(torch.ones(2, 2, 4), torch.ones(2, 2, 4), torch.bfloat16)
    with pytest.raises(ValueError, match=r"calibrated_kv_scales: value: expected no NaN"):
        calibrated_kv_scales(torch.ones(2, 2, 4), torch.full((2, 2, 4), float("nan")))
