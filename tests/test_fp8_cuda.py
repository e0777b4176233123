"""Float8 on a CUDA GPU: the quantizing cache write's kernel bit for bit against the PyTorch reference,
attention over a float8 cache, the float8 tensor-core product of Fp8LinearMethod against the dequantized
weight's, the per-token activation quantization's kernel bit for bit against its PyTorch implementation, the
decode kernel's fused epilogues on float8 weights (and the qkv one's float8 cache write) against their
PyTorch references, a float8 Llama's fused decode step, and all of them inside CUDA graphs. Skipped without
a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cuda_graphs import capture

from tpkit.attention import Attention, PagedKVCache, paged_attention
from tpkit.models import LlamaForCausalLM, llama
from tpkit.ops import _extension, decode_linear_fp8, decode_linear_silu_and_mul, quantize_per_token_fp8
from tpkit.ops.fp8_quantize import _quantize_reference
from tpkit.ops.linear import _qkv_rope_cache_reference, _residual_norm_reference, _silu_and_mul_reference
from tpkit.ops.paged_attention_reference import paged_attention_reference, reshape_and_cache_reference
from tpkit.parallel_layers import Fp8LinearMethod, MergedColumnParallelLinear, RowParallelLinear
from tpkit.parallel_layers.quantization import _fp8_product

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _has_fp8_tensor_cores() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.parametrize("cache_dtype", FP8, ids=str)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("per_head", [False, True])
def test_kernel_write_equals_the_reference_bit_for_bit(cache_dtype, dtype, per_head):
    gen = torch.Generator(device="cuda").manual_seed(0)
    num_tokens, num_kv_heads, head_size = 37, 4, 128
    # A fused-QKV-like token stride, values across the format's range, and some out of it, inf and NaN.
    wide = torch.randn(num_tokens, 3 * num_kv_heads, head_size, device="cuda", generator=gen) * 300
    wide[0, 0, :4] = torch.tensor([float("inf"), -float("inf"), float("nan"), 1e9])
    key, value = wide[:, :num_kv_heads].to(dtype), wide[:, num_kv_heads:2 * num_kv_heads].to(dtype)
    k_scale = torch.rand(num_kv_heads if per_head else (), device="cuda", generator=gen) + 0.1
    v_scale = torch.rand(num_kv_heads if per_head else (), device="cuda", generator=gen) + 0.1
    shape = (10, 16, num_kv_heads, head_size)
    slots = torch.randperm(160, device="cuda", generator=gen)[:num_tokens]
    slots[::5] = -1
    caches = [torch.zeros(shape, dtype=cache_dtype, device="cuda") for _ in range(4)]
    assert _extension.reshape_and_cache(key, value, caches[0], caches[1], slots, k_scale, v_scale)
    reshape_and_cache_reference(key, value, caches[2], caches[3], slots, k_scale, v_scale)
    for kernel, reference in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(kernel.view(torch.uint8), reference.view(torch.uint8))


def test_attention_over_a_float8_cache_in_a_graph():
    """The Attention module's step on a float8 cache (write and attention) replayed equals the eager step,
    and the eager step equals the CPU's."""
    torch.manual_seed(1)
    cache = PagedKVCache(1, 16, 16, 2, 128, dtype=torch.float8_e4m3fn, device="cuda")
    cache.set_scales(0, torch.tensor([0.01, 0.02]), 0.005)
    attn = Attention(8, 128, 2)
    prefill = cache.prefill_metadata([0, 1], [20, 33])
    query = torch.randn(1, 53, 8 * 128, device="cuda", dtype=torch.bfloat16)
    key, value = (torch.randn(1, 53, 2 * 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = attn(query, key, value, kv_cache=cache, layer_idx=0, metadata=prefill)
    cpu = PagedKVCache(1, 16, 16, 2, 128, dtype=torch.float8_e4m3fn, device="cpu")
    cpu.set_scales(0, torch.tensor([0.01, 0.02]), 0.005)
    cpu_out = attn(query.cpu(), key.cpu(), value.cpu(), kv_cache=cpu, layer_idx=0,
                   metadata=cpu.prefill_metadata([0, 1], [20, 33]))
    torch.testing.assert_close(out.cpu(), cpu_out, atol=1e-2, rtol=1e-2)
    decode = cache.decode_metadata([0, 1])
    step = [torch.randn(2, 1, n * 128, device="cuda", dtype=torch.bfloat16) for n in (8, 2, 2)]
    snapshot = [c.clone() for c in cache.key_caches + cache.value_caches]
    eager = attn(*step, kv_cache=cache, layer_idx=0, metadata=decode)
    for c, saved in zip(cache.key_caches + cache.value_caches, snapshot, strict=True):
        c.copy_(saved)
    graph, replayed = capture(lambda: attn(*step, kv_cache=cache, layer_idx=0, metadata=decode))
    graph.replay()
    torch.testing.assert_close(replayed, eager, atol=0, rtol=0)


@pytest.mark.parametrize("head_size", [32, 80, 96, 128, 256])
@pytest.mark.parametrize("magnitude", [1e-30, 1.0, 3e6])
@pytest.mark.parametrize("multi", [False, True])
def test_float8_cache_attention_at_every_query_magnitude(head_size, magnitude, multi):
    """bfloat16 queries far outside float16's range (the kernel's products run in float16 over a float8
    cache) give the float32 reference's output on the dequantized cache, for decode and several tokens."""
    gen = torch.Generator(device="cuda").manual_seed(head_size)
    num_kv_heads, group, block_size = 2, 3, 16
    seq_lens = torch.tensor([37, 130, 5], dtype=torch.int32, device="cuda")
    q_lens = [4, 9, 5] if multi else [1, 1, 1]
    key_cache, value_cache = (
        (torch.randn(40, block_size, num_kv_heads, head_size, device="cuda", generator=gen) * 40)
        .to(torch.float8_e4m3fn) for _ in range(2))
    block_tables = torch.randperm(40, device="cuda", generator=gen)[:27].view(3, 9).int()
    query = torch.randn(sum(q_lens), num_kv_heads * group, head_size, device="cuda", generator=gen)
    query = (query * magnitude).bfloat16()  # [num_tokens, num_heads, head_size]
    query_start_loc = torch.tensor([0, *q_lens], device="cuda").cumsum(0).int() if multi else None
    k_scale, v_scale = torch.tensor([0.02, 0.05], device="cuda"), torch.tensor(0.03, device="cuda")
    out = paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                          query_start_loc=query_start_loc, k_scale=k_scale, v_scale=v_scale)
    expected = torch.empty_like(query, dtype=torch.float32)
    paged_attention_reference(expected, query.float(), key_cache.float() * k_scale.view(-1, 1),
                              value_cache.float() * v_scale, block_tables, seq_lens, head_size ** -0.5, None,
                              query_start_loc)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not _has_fp8_tensor_cores(), reason="needs float8 tensor cores (compute 8.9+)")
@pytest.mark.parametrize("scheme,static", [("channel", False), ("tensor", False), ("tensor", True)])
def test_fp8_tensor_core_product_within_the_activation_rounding(scheme, static):
    """torch._scaled_mm's product against the dequantized weight's: the activation quantized per token (or
    with the static scale) rounds each input by at most 2^-4 relative, so |error| <= 2^-4 |x| @ |W|^T plus
    the bfloat16 output's rounding."""
    torch.manual_seed(2)
    method = Fp8LinearMethod(scheme, static_input_scale=static, quantize_op=quantize_per_token_fp8)
    layer = MergedColumnParallelLinear(256, [128, 256], bias=True, params_dtype=torch.bfloat16, device="cuda",
                                       quant_method=method)
    if static:
        layer.input_scale.data.fill_(8.0 / 448)  # above every |x|: nothing saturates
    x = torch.randn(3, 5, 256, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        out = layer(x)
        weight = method.dequantized_weight(layer, torch.float32)
        exact = x.float() @ weight.T + layer.bias.float()
        bound = 2 ** -4 * (x.float().abs() @ weight.abs().T) + 2 ** -7 * exact.abs() + 1e-3
        assert ((out.float() - exact).abs() <= bound).all()
        graph, replayed = capture(lambda: layer(x))
        graph.replay()
        assert torch.equal(replayed, out)
    row = RowParallelLinear(256, 64, bias=False, params_dtype=torch.bfloat16, device="cuda",
                            quant_method=Fp8LinearMethod("block"))
    with torch.inference_mode():  # block scales: the dequantized product
        expected = F.linear(x, Fp8LinearMethod("block").dequantized_weight(row, torch.bfloat16))
        assert torch.equal(row(x), expected)


# The activation quantization's row widths: a vector, three, a model's, and more than shared memory holds
# (about 116K 16-bit features; SwiGLU's two halves about 58K), so that it copies the row a second time.
QUANTIZE_WIDTHS = [8, 24, 4096, 14336, 28672, 40960, 73728, 131072]
# Bit patterns of a negative NaN, which a float assignment would make positive.
NEGATIVE_NAN = {torch.bfloat16: -64, torch.float16: -512}  # 0xffc0, 0xfe00


def _activation_rows(num_rows: int, features: int, dtype: torch.dtype, seed: int, pad: int) -> torch.Tensor:
    """Rows [num_rows, features] (num_rows >= 9) of dtype, a view of rows pad elements wider (strided rows
    where pad), their magnitudes from 1e-4 to 1e4 row by row, and first the rows the quantization takes
    apart: zeros, negative zeros, a NaN, infinities, the dtype's largest values, its subnormals, a NaN of
    each sign."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    wide = torch.randn(num_rows, features + pad, device="cuda", generator=gen)
    wide *= torch.logspace(-4, 4, num_rows, device="cuda")[:, None]
    rows = wide.to(dtype)[:, pad:]  # [num_rows, features]
    info = torch.finfo(dtype)
    rows[0] = 0.0
    rows[1] = -0.0
    rows[2, features // 2] = float("nan")
    rows[3, -1] = float("inf")
    rows[4, 0], rows[4, -1] = -float("inf"), float("inf")
    rows[5] = rows[5].sign() * info.max
    rows[6] = rows[6].sign() * (info.smallest_normal / 4)
    rows[7, 0] = float("nan")
    rows[7].view(torch.int16)[-1] = NEGATIVE_NAN[dtype]
    rows[8, 1] = -float("inf")
    return rows


def _shuffled_rows(num_rows: int, features: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """:func:`_activation_rows` (contiguous) in a random order ``[num_rows, features]``: the rows the
    quantization takes apart anywhere among thousands."""
    rows = _activation_rows(num_rows, features, dtype, seed, 0)
    order = torch.randperm(num_rows, device="cuda", generator=torch.Generator("cuda").manual_seed(seed))
    return rows[order]


def _assert_quantized_alike(rows: torch.Tensor, input_scale: torch.Tensor | None,
                            bound: float | None) -> None:
    """The kernel's float8 rows and scales are the PyTorch path's, bit for bit."""
    out = torch.empty(rows.shape, dtype=torch.float8_e4m3fn, device="cuda")  # [num_rows, features]
    scale = torch.empty(rows.shape[0], 1, device="cuda")  # [num_rows, 1]
    assert _extension.quantize_per_token_fp8(out, scale, rows, input_scale, bound)
    expected, expected_scale = _quantize_reference(rows, input_scale, bound)
    where = f"{rows.dtype} {list(rows.shape)} {rows.stride()}, input_scale {input_scale}, bound {bound}"
    assert torch.equal(scale.view(torch.int32), expected_scale.view(torch.int32)), where
    assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8)), where


@pytest.mark.parametrize("features", QUANTIZE_WIDTHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_activation_quantization_kernel_bit_for_bit(dtype, features):
    """The per-token float8 quantization's kernel against its PyTorch implementation on the GPU, the float8
    values and the float32 scales bit for bit, NaN included: dynamic scales, bounded amaxes (one bound
    below every row's amax), static scales (zero, negative and infinite ones too), contiguous and strided
    rows, and 0 rows through the op."""
    cases = [(None, None), (None, 50.0), (None, 1e-30)]
    cases += [(torch.tensor(value, device="cuda"), None) for value in (0.25, 3e-3, 0.0, -0.5, float("inf"))]
    cases.append((torch.tensor([1e-5], device="cuda"), None))
    for pad in (0, 8):
        rows = _activation_rows(24, features, dtype, features + pad, pad)
        for input_scale, bound in cases:
            _assert_quantized_alike(rows, input_scale, bound)
    empty = torch.empty(0, features, dtype=dtype, device="cuda")
    _assert_quantized_alike(empty, None, None)
    quantized, scale = quantize_per_token_fp8(empty)
    assert quantized.shape == (0, features) and scale.shape == (0, 1)


def _every_finite_value(dtype: torch.dtype) -> torch.Tensor:
    """Every finite value of the 16-bit dtype once, shuffled, then repeated to a multiple of 4096 ``[n]``."""
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32, device="cuda").to(torch.int16).view(dtype)
    values = values[values.isfinite()]
    gen = torch.Generator("cuda").manual_seed(0)
    values = values[torch.randperm(values.numel(), device="cuda", generator=gen)]
    return torch.cat([values, values[:-values.numel() % 4096]])  # pads to the next multiple


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_activation_quantization_kernel_divides_every_value_exactly(dtype):
    """Every finite 16-bit value over static scales from 2^-126 to 2^126 (and the dtype's extremes) and over
    dynamic scales (rows of 256 of them, each its own amax; bounded too), bit for bit: the kernel's quotient
    of a finite row is the IEEE one, though it divides by multiplying with the scale's inverse."""
    values = _every_finite_value(dtype)
    gen = torch.Generator().manual_seed(1)
    exponents = torch.empty(96).uniform_(-126, 126, generator=gen)
    scales = [2.0**e for e in exponents.tolist()] + [2.0**-126, 2.0**126, 1.0, 3.0, 1 / 448, 1e-12]
    scales += [torch.finfo(dtype).max / 448, torch.finfo(dtype).tiny, torch.finfo(dtype).smallest_normal / 7]
    rows = values.view(-1, 4096)  # [n / 4096, 4096]
    for scale in scales:
        _assert_quantized_alike(rows, torch.tensor(scale, device="cuda"), None)
    for bound in (None, 1e-3, 1.0, 300.0):
        _assert_quantized_alike(values.view(-1, 256), None, bound)


@pytest.mark.parametrize("features", [8, 4096, 14336])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_activation_quantization_kernel_on_shuffled_rows(dtype, features):
    """Thousands of rows (more blocks than the device runs at once), the zero, NaN, infinite and extreme
    rows anywhere among them: bit for bit with every kind of scale."""
    rows = _shuffled_rows(3000, features, dtype, features)
    for input_scale, bound in [(None, None), (None, 50.0), (torch.tensor(3e-3, device="cuda"), None)]:
        _assert_quantized_alike(rows, input_scale, bound)


@pytest.mark.parametrize("num_rows,features", [(8192, 2048), (4096, 4096), (1200, 14336)])
def test_activation_quantization_kernel_on_a_prefills_rows(num_rows, features):
    """A prefill's rows, enough that a thread holds 8 vectors (a warp a row, two, seven): bit for bit, and
    the op replayed from a CUDA graph."""
    rows = (torch.randn(num_rows, features, device="cuda") * 3).bfloat16()
    _assert_quantized_alike(rows, None, None)
    _assert_quantized_alike(rows, torch.tensor(0.02, device="cuda"), None)
    graph, (quantized, scale) = capture(lambda: quantize_per_token_fp8(rows, None, 8.0))
    rows.copy_(torch.randn(num_rows, features, device="cuda") * 5)
    graph.replay()
    expected, expected_scale = _quantize_reference(rows, None, 8.0)
    assert torch.equal(quantized.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(scale, expected_scale)


@pytest.mark.skipif(not _has_fp8_tensor_cores(), reason="needs float8 tensor cores (compute 8.9+)")
def test_fp8_product_with_the_quantization_kernel_is_the_same_product():
    """The float8 tensor-core product quantizing its input with the kernel (quantize_op): the quantized rows
    are the PyTorch implementation's bit for bit, and the product is the one on those rows to the bf16
    output's rounding (its bits are the GEMM's), directly and through a layer; replayed from a graph, the
    layer gives its eager bits."""
    torch.manual_seed(4)
    x = (torch.randn(3, 37, 4096, device="cuda") * 2).bfloat16()
    weight = (torch.randn(1024, 4096, device="cuda") * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    row_scales = torch.rand(1024, device="cuda") * 1e-3
    bias = torch.randn(1024, device="cuda").bfloat16()
    close = {"rtol": 2 ** -7, "atol": 1e-2}
    with torch.inference_mode():
        for input_scale, bound, b in ((None, None, bias), (None, 3.0, None),
                                      (torch.tensor(0.01, device="cuda"), None, bias)):
            _assert_quantized_alike(x.view(-1, 4096), input_scale, bound)
            expected = _fp8_product(x, weight, row_scales, b, input_scale, bound, _quantize_reference)
            got = _fp8_product(x, weight, row_scales, b, input_scale, bound, quantize_per_token_fp8)
            torch.testing.assert_close(got, expected, **close)
    calls = []

    def counted(*args: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(1)
        return quantize_per_token_fp8(*args)

    method = Fp8LinearMethod("channel", quantize_op=counted)
    layer = MergedColumnParallelLinear(4096, [512, 512], bias=True, params_dtype=torch.bfloat16,
                                       device="cuda", quant_method=method)
    with torch.inference_mode():
        out = layer(x)
        assert calls
        method.quantize_op = _quantize_reference
        torch.testing.assert_close(layer(x), out, **close)
        method.quantize_op = quantize_per_token_fp8
        graph, replayed = capture(lambda: layer(x))
        graph.replay()
        assert torch.equal(replayed, out)


def test_fp8_llama_generates_the_same_tokens_in_graphs():
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 256,
              "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-6}
    torch.manual_seed(3)
    method = Fp8LinearMethod("channel", quantize_op=quantize_per_token_fp8)
    model = LlamaForCausalLM(config, dtype=torch.bfloat16, device="cuda", quant_method=method).eval()
    model.kv_cache_dtype = torch.float8_e4m3fn
    prompts = [[5, 6, 7, 8], [9, 10]]
    eager = model.generate(prompts, 8, ignore_eos=True)
    assert model.generate(prompts, 8, ignore_eos=True, cuda_graph=True) == eager


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_rows", [1, 5, 16])
def test_decode_kernel_reading_float8_weights(dtype, num_rows):
    """The decode kernel's product of float8 weights against the float32 product of the dequantized weight
    (the conversion to the dtype is exact: only the accumulation order and the output's rounding differ),
    for every split, then through the wrapper inside a CUDA graph. The weights span E4M3's subnormals,
    normals and largest values."""
    torch.manual_seed(4)
    in_features = 512
    weight = (torch.randn(384, in_features, device="cuda") * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    weight[:3, :8] = torch.tensor([448.0, -448.0, 2.0**-9, -(2.0**-9), 7 * 2.0**-9, 2.0**-6, 0.0, -0.0])
    scale = torch.rand(384, device="cuda") * 0.01 + 1e-3
    x = torch.randn(num_rows, in_features, device="cuda", dtype=dtype)
    bias = torch.randn(384, device="cuda", dtype=dtype)
    exact = x.float() @ (weight.float() * scale[:, None]).T + bias.float()
    tolerance = (2e-3 if dtype == torch.float16 else 1e-2) * exact.abs().max()
    module = _extension._module_for(x.device)
    for splits in (1, 2, 4, 8):
        out = torch.empty(num_rows, 384, device="cuda", dtype=dtype)
        assert module.decode_linear_fp8(out, x, weight, scale, bias, splits)
        assert (out.float() - exact).abs().max() <= tolerance
    with torch.inference_mode():
        graph, replayed = capture(lambda: decode_linear_fp8(x, weight, scale, bias))
        graph.replay()
        assert (replayed.float() - exact).abs().max() <= tolerance


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("in_features", [512, 544])
def test_decode_kernel_float8_weight_nan_propagates(dtype, in_features):
    """A NaN weight byte (0x7f or 0xff) makes its feature NaN in every row, wherever in the row it sits;
    the other features keep the exact product."""
    torch.manual_seed(5)
    weight = (torch.randn(64, in_features, device="cuda") * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    bits = weight.view(torch.uint8)
    nan_features = [3, 17, 40]
    bits[3, 0], bits[17, in_features - 1], bits[40, 37] = 0x7F, 0xFF, 0x7F
    scale = torch.rand(64, device="cuda") * 0.01 + 1e-3
    x = torch.randn(6, in_features, device="cuda", dtype=dtype)
    out = decode_linear_fp8(x, weight, scale)
    assert out.float()[:, nan_features].isnan().all()
    finite = [n for n in range(64) if n not in nan_features]
    exact = x.float() @ (weight.float()[finite] * scale[finite, None]).T
    tolerance = (2e-3 if dtype == torch.float16 else 1e-2) * exact.abs().max()
    assert (out.float()[:, finite] - exact).abs().max() <= tolerance


# Relative to the largest output: the float32 sum of exactly converted float8 weights, scaled once, against
# the reference's product by the weight dequantized to the dtype (each weight rounded to it, then the
# output; for bfloat16 about two units in the last place of the largest output).
FUSED_TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 2e-2}
FUSED_ROWS = [1, 3, 8, 9, 16]
FUSED_DTYPES = [torch.float16, torch.bfloat16]


def _fp8_operands(num_rows: int, out_features: int, in_features: int, dtype: torch.dtype, seed: int) -> tuple:
    """input [num_rows, in_features], a float8 weight [out_features, in_features], its per-row scales and a
    bias, on the GPU; the scales keep the dequantized weight's products near 1."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, in_features, generator=gen)
    # Within E4M3's range: a cast to float8_e4m3fn turns larger values into NaN.
    weight = (torch.randn(out_features, in_features, generator=gen) * 100).clamp(-448, 448).to(
        torch.float8_e4m3fn)
    scale = (torch.rand(out_features, generator=gen) + 0.5) / (100 * in_features ** 0.5)
    bias = torch.randn(out_features, generator=gen)
    return x.to("cuda", dtype), weight.cuda(), scale.cuda(), bias.to("cuda", dtype)


def _rms_sums(num_rows: int, in_features: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(num_rows, generator=gen, dtype=torch.float64) + 0.5).cuda() * in_features


def _assert_within(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    scale = ref.float().abs().max().item()
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= FUSED_TOLERANCE[dtype] * scale, f"max error {err:.3g}, largest output {scale:.3g}"


@pytest.mark.parametrize("dtype", FUSED_DTYPES, ids=str)
@pytest.mark.parametrize("num_rows", FUSED_ROWS)
@pytest.mark.parametrize("features,in_features", [(8, 32), (200, 352), (1032, 4128)])
@pytest.mark.parametrize("norm", [False, True])
def test_silu_and_mul_kernel_on_float8_weights(dtype, num_rows, features, in_features, norm):
    x, weight, scale, bias = _fp8_operands(num_rows, 2 * features, in_features, dtype, seed=num_rows)
    rms_sums = _rms_sums(num_rows, in_features, 1) if norm else None
    out = torch.empty(num_rows, features, device="cuda", dtype=dtype)
    assert _extension.decode_linear(out, x, weight, bias, 0, True, rms_sums, 1e-5, scale)
    _assert_within(out, _silu_and_mul_reference(x, weight, bias, rms_sums, 1e-5, scale), dtype)
    with torch.inference_mode():  # the wrapper, replayed from a CUDA graph
        graph, replayed = capture(lambda: decode_linear_silu_and_mul(x, weight, bias, rms_sums, 1e-5, scale))
        graph.replay()
        assert torch.equal(replayed, out)


@pytest.mark.parametrize("dtype", FUSED_DTYPES, ids=str)
@pytest.mark.parametrize("num_rows", FUSED_ROWS)
@pytest.mark.parametrize("out_features,in_features", [(8, 32), (200, 352), (1032, 4128)])
def test_residual_norm_kernel_on_float8_weights(dtype, num_rows, out_features, in_features):
    x, weight, scale, bias = _fp8_operands(num_rows, out_features, in_features, dtype, seed=num_rows + 20)
    gen = torch.Generator().manual_seed(2)
    residual = torch.randn(num_rows, out_features, generator=gen).to("cuda", dtype)
    norm_weight = (torch.rand(out_features, generator=gen) + 0.5).to("cuda", dtype)
    sums = [_rms_sums(num_rows, out_features, 3) for _ in range(2)]
    zero_sums = [torch.rand(num_rows, device="cuda", dtype=torch.float64) for _ in range(2)]
    out, normed = torch.empty_like(residual), torch.empty_like(residual)
    assert _extension.decode_linear_residual_norm(out, normed, x, weight, bias, residual, norm_weight,
                                                  sums[0], zero_sums[0], scale)
    expected_out, expected_normed = _residual_norm_reference(x, weight, bias, residual, norm_weight, sums[1],
                                                             zero_sums[1], scale)
    _assert_within(out, expected_out, dtype)
    _assert_within(normed, expected_normed, dtype)
    torch.testing.assert_close(sums[0], sums[1], rtol=FUSED_TOLERANCE[dtype], atol=0)
    assert not zero_sums[0].any()


@pytest.mark.parametrize("dtype", FUSED_DTYPES, ids=str)
@pytest.mark.parametrize("num_rows", FUSED_ROWS)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size,in_features", [(8, 2, 128, 352), (6, 1, 80, 1056)])
@pytest.mark.parametrize("cache", ["dtype", "e4m3", "e5m2-per-head"])
def test_qkv_rope_cache_kernel_on_float8_weights_and_caches(dtype, num_rows, num_heads, num_kv_heads,
                                                            head_size, in_features, cache):
    """The product against the reference; each written slot holds, bit for bit, what reshape_and_cache's
    reference stores for the kernel's own k and v rows; the other slots untouched."""
    features = (num_heads + 2 * num_kv_heads) * head_size
    x, weight, scale, bias = _fp8_operands(num_rows, features, in_features, dtype, seed=num_rows + 40)
    gen = torch.Generator().manual_seed(5)
    angles = torch.rand(num_rows, head_size // 2, generator=gen) * 6
    cos, sin = angles.cos().to("cuda", dtype), angles.sin().to("cuda", dtype)
    cache_dtype = {"dtype": dtype, "e4m3": torch.float8_e4m3fn, "e5m2-per-head": torch.float8_e5m2}[cache]
    shape = (9, 16, num_kv_heads, head_size)
    key_cache = (torch.randn(shape, generator=gen) * 4).to("cuda", cache_dtype)
    value_cache = (torch.randn(shape, generator=gen) * 4).to("cuda", cache_dtype)
    before = key_cache.clone(), value_cache.clone()
    kv_scales = (None, None)
    if cache != "dtype":
        scale_shape = (num_kv_heads,) if cache.endswith("per-head") else ()
        kv_scales = tuple((torch.rand(scale_shape, generator=gen) * 0.02 + 0.005).cuda() for _ in range(2))
    slots = torch.randperm(9 * 16, generator=gen)[:num_rows].cuda()
    slots[-1] = -1  # a padding row
    out = torch.empty(num_rows, features, device="cuda", dtype=dtype)
    assert _extension.decode_qkv_rope_cache(out, x, weight, bias, cos, sin, key_cache, value_cache, slots,
                                            num_heads, None, 0.0, scale, *kv_scales)
    reference_caches = [c.clone() for c in before]
    expected = _qkv_rope_cache_reference(x, weight, bias, cos, sin, *reference_caches, slots, num_heads, None,
                                         0.0, scale, *kv_scales)
    _assert_within(out, expected, dtype)
    rows = out.view(num_rows, -1, head_size)
    own = [c.clone() for c in before]
    k, v = rows[:, num_heads:num_heads + num_kv_heads], rows[:, num_heads + num_kv_heads:]
    reshape_and_cache_reference(k, v, *own, slots, *kv_scales)
    for got, wanted in zip((key_cache, value_cache), own, strict=True):
        assert torch.equal(got.view(torch.uint8), wanted.view(torch.uint8))
    written = torch.zeros(9 * 16, dtype=torch.bool)
    written[slots[slots >= 0].cpu()] = True
    untouched = ~written.view(9, 16).cuda()
    for got, saved in zip((key_cache, value_cache), before, strict=True):
        assert torch.equal(got[untouched].view(torch.uint8), saved[untouched].view(torch.uint8))


@pytest.mark.parametrize("scheme", ["tensor", "channel"])
@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn], ids=str)
def test_fp8_llama_fused_decode_gives_the_layers_tokens(monkeypatch, scheme, cache_dtype):
    """Greedy tokens of a float8 Llama (the decode product tpkit's models give float8 layers) with the fused
    decode step and without it, eager and replayed from CUDA graphs."""
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 512,
              "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8,
              "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-6}
    torch.manual_seed(6)
    model = LlamaForCausalLM(config, dtype=torch.bfloat16, device="cuda",
                             quant_method=Fp8LinearMethod(scheme, decode_op=decode_linear_fp8,
                                                          quantize_op=quantize_per_token_fp8)).eval()
    model.kv_cache_dtype = cache_dtype
    fused_steps = []
    step = llama.fused_decode_step
    monkeypatch.setattr(llama, "fused_decode_step", lambda *args: fused_steps.append(1) or step(*args))
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    tokens = {}
    for fused in (False, None):
        model.fused_decode = fused
        model.clear_kv_cache()  # the graphs captured with the other setting go too
        for graphs in (False, True):
            count = len(fused_steps)
            tokens[fused, graphs] = model.generate(prompts, 8, ignore_eos=True, cuda_graph=graphs)
            assert (len(fused_steps) > count) == (fused is None)
    assert tokens[None, False] == tokens[False, False]
    assert tokens[None, True] == tokens[False, True] == tokens[False, False]
