"""The fused float8 quantizations' kernels and the fused float8 step on a GPU: SwiGLU's bit for bit against
its PyTorch implementation; the RMSNorm's residual sum bit for bit and its float8 rows within one float8 step
of torch's norm quantized (the sum of squares adds in another order); a float8 Llama's prefill logits through
the fused step against its layers' forward, and its greedy tokens eager and from CUDA graphs."""

from __future__ import annotations

import pytest
import torch
from cuda_graphs import capture
from test_fp8_cuda import QUANTIZE_WIDTHS, _activation_rows, _shuffled_rows

from tpkit.models import LlamaForCausalLM, llama
from tpkit.ops import (
    _extension,
    add_rms_norm_quantize_fp8,
    decode_linear_fp8,
    quantize_per_token_fp8,
    rms_norm_quantize_fp8,
    silu_and_mul_quantize_fp8,
)
from tpkit.ops.fp8_quantize import (
    _add_rms_norm_quantize_reference,
    _rms_norm_quantize_reference,
    _silu_and_mul_quantize_reference,
)
from tpkit.parallel_layers import Fp8LinearMethod

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
FP8 = torch.float8_e4m3fn
SCALES = [(None, None), (None, 2.0), (0.01, None)]


def _scale(value: float | None) -> torch.Tensor | None:
    return None if value is None else torch.tensor(value, device="cuda")


def _codes(quantized: torch.Tensor) -> torch.Tensor:
    """float8 E4M3 bytes as signed integers ordered as their values (sign and magnitude)."""
    bits = quantized.view(torch.uint8).int()
    return torch.where(bits >= 128, -(bits - 128), bits)


@pytest.mark.parametrize("features", QUANTIZE_WIDTHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_silu_and_mul_quantization_kernel_bit_for_bit(dtype, features):
    """The fused SwiGLU quantization against SwiGLU then the quantization on the GPU: float8 values and
    scales bit for bit, NaN and infinities included, contiguous and strided rows, rows wider than shared
    memory holds (copied and made again to quantize); and 0 rows."""
    for pad in (0, 8):
        gate_up = _activation_rows(24, 2 * features, dtype, features + pad, pad)
        for value, bound in SCALES:
            out = torch.empty(24, features, dtype=FP8, device="cuda")
            scale = torch.empty(24, 1, device="cuda")
            assert _extension.silu_and_mul_quantize_fp8(out, scale, gate_up, _scale(value), bound)
            expected, expected_scale = _silu_and_mul_quantize_reference(gate_up, _scale(value), bound)
            assert torch.equal(scale.view(torch.int32), expected_scale.view(torch.int32))
            assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))
    quantized, scale = silu_and_mul_quantize_fp8(torch.empty(0, 2 * features, dtype=dtype, device="cuda"))
    assert quantized.shape == (0, features) and scale.shape == (0, 1)


@pytest.mark.parametrize("features", [8, 4096, 14336])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fused_quantizations_on_shuffled_rows(dtype, features):
    """Thousands of rows (more blocks than the device runs at once), the zero, NaN, infinite and extreme
    rows anywhere among them: SwiGLU's bit for bit, the norm's sum bit for bit and its float8 rows as
    :func:`_assert_norm_quantized` says."""
    gate_up = _shuffled_rows(3000, 2 * features, dtype, features)
    x, residual = gate_up[:, :features], _shuffled_rows(3000, features, dtype, features + 1)
    weight = (torch.rand(features, device="cuda") + 0.5).to(dtype)
    for value, bound in SCALES:
        got = silu_and_mul_quantize_fp8(gate_up, _scale(value), bound)
        expected = _silu_and_mul_quantize_reference(gate_up, _scale(value), bound)
        assert torch.equal(got[1].view(torch.int32), expected[1].view(torch.int32))
        assert torch.equal(got[0].view(torch.uint8), expected[0].view(torch.uint8))
        got = add_rms_norm_quantize_fp8(x, residual, weight, 1e-5, _scale(value), bound)
        expected = _add_rms_norm_quantize_reference(x, residual, weight, 1e-5, _scale(value), bound)
        torch.testing.assert_close(got[2], expected[2], rtol=0, atol=0, equal_nan=True)
        _assert_norm_quantized(got, expected)


def _assert_norm_quantized(got: tuple, expected: tuple) -> None:
    """The kernel's float8 rows are the reference's to one float8 step (most of them equal), and their
    scales to float32's rounding of an amax one 16-bit step apart; NaN where the reference has NaN."""
    (quantized, scale), (expected_q, expected_scale) = got[:2], expected[:2]
    nan_rows = expected_scale.isnan().flatten()
    assert torch.equal(scale.isnan().flatten(), nan_rows)
    torch.testing.assert_close(scale[~nan_rows], expected_scale[~nan_rows], rtol=2 ** -7, atol=0)
    q, e = quantized[~nan_rows], expected_q[~nan_rows]
    assert torch.equal(q.float().isnan(), e.float().isnan())
    finite = ~e.float().isnan()
    difference = (_codes(q) - _codes(e)).abs()[finite]
    assert difference.max() <= 1
    assert (difference == 0).float().mean() > 0.97
    assert quantized[nan_rows].float().isnan().all()


@pytest.mark.parametrize("features", [64, 4096, 8192, 40960, 73728, 131072])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_rms_norm_quantization_kernel_against_the_norm_quantized(dtype, features):
    """RMSNorm, after a residual add or alone, then the quantization, in one kernel: the sum bit for bit
    (rows of every magnitude, strided inputs and residuals, a NaN row and an infinity), the float8 rows
    as :func:`_assert_norm_quantized` says, with dynamic, bounded and static scales; rows wider than shared
    memory holds with the residual (73728 features) and without it (131072), copied again to quantize."""
    gen = torch.Generator(device="cuda").manual_seed(features)
    for pad in (0, 8):
        wide = torch.randn(40, features + pad, device="cuda", generator=gen)
        x = (wide * torch.logspace(-3, 3, 40, device="cuda")[:, None]).to(dtype)[:, pad:]
        residual = torch.randn(40, features + 2 * pad, device="cuda", generator=gen) * 4
        residual = residual.to(dtype)[:, 2 * pad:]
        x[3, features // 3] = float("nan")
        x[5, 0] = float("inf")
        weight = (torch.rand(features, device="cuda", generator=gen) + 0.5).to(dtype)
        for value, bound in SCALES:
            got = add_rms_norm_quantize_fp8(x, residual, weight, 1e-5, _scale(value), bound)
            expected = _add_rms_norm_quantize_reference(x, residual, weight, 1e-5, _scale(value), bound)
            torch.testing.assert_close(got[2], expected[2], rtol=0, atol=0, equal_nan=True)
            _assert_norm_quantized(got, expected)
            alone = rms_norm_quantize_fp8(residual, weight, 1e-6, _scale(value), bound)
            _assert_norm_quantized(alone, _rms_norm_quantize_reference(residual, weight, 1e-6, _scale(value),
                                                                       bound))
    empty = torch.empty(0, features, dtype=dtype, device="cuda")
    quantized, scale, summed = add_rms_norm_quantize_fp8(empty, empty, weight, 1e-5)
    assert quantized.shape == (0, features) and scale.shape == (0, 1) and summed.shape == (0, features)


def test_fused_quantizations_in_a_graph():
    """Both fused ops replayed from a CUDA graph give their eager outputs on new inputs."""
    x = torch.randn(300, 4096, device="cuda").bfloat16()
    residual = torch.randn(300, 4096, device="cuda").bfloat16()
    gate_up = torch.randn(300, 2 * 1024, device="cuda").bfloat16()
    weight = torch.rand(4096, device="cuda").bfloat16()
    graph, outputs = capture(lambda: (*add_rms_norm_quantize_fp8(x, residual, weight, 1e-5),
                                      *silu_and_mul_quantize_fp8(gate_up, None, 4.0)))
    for tensor in (x, residual, gate_up):
        tensor.copy_(torch.randn_like(tensor, dtype=torch.float32) * 3)
    graph.replay()
    eager = (*add_rms_norm_quantize_fp8(x, residual, weight, 1e-5),
             *silu_and_mul_quantize_fp8(gate_up, None, 4.0))
    for replayed, expected in zip(outputs, eager, strict=True):
        assert torch.equal(replayed.view(torch.uint8), expected.view(torch.uint8))


def _fp8_llama(scheme: str, seed: int) -> LlamaForCausalLM:
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 512,
              "intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 8,
              "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
              "attention_bias": scheme == "tensor"}
    torch.manual_seed(seed)
    method = Fp8LinearMethod(scheme, decode_op=decode_linear_fp8, quantize_op=quantize_per_token_fp8)
    model = LlamaForCausalLM(config, dtype=torch.bfloat16, device="cuda", quant_method=method).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "bias")):
                param.uniform_(0.5, 1.5)
    return model


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="needs float8 tensor cores (compute 8.9+)")
@pytest.mark.parametrize("scheme", ["channel", "tensor"])
def test_fused_fp8_prefill_gives_the_layers_logits(monkeypatch, scheme):
    """A float8 Llama's forward over 2 x 200 tokens takes the fused step by default and gives the logits
    of its layers' forward (which quantize each product's input themselves) to the norms' rounding; its
    greedy tokens for 20 prompts (decode steps of 20 rows, past the decode kernel, on the fused step too) are
    the same eager and replayed from CUDA graphs."""
    model = _fp8_llama(scheme, 7)
    steps = []
    fused = llama.fused_fp8_step
    monkeypatch.setattr(llama, "fused_fp8_step", lambda *args: steps.append(1) or fused(*args))
    input_ids = torch.randint(0, 512, (2, 200), device="cuda")
    positions = torch.arange(200, device="cuda").expand(2, 200)
    with torch.no_grad():
        got = model.compute_logits(model.hidden_states(input_ids, positions)).float()
        assert steps
        model.fused_fp8 = False
        expected = model.compute_logits(model.hidden_states(input_ids, positions)).float()
    assert len(steps) == 1
    error = (got - expected).norm() / expected.norm()
    assert error < 2e-2, error
    model.fused_fp8 = None
    prompts = [list(range(3 + i, 40 + 2 * i)) for i in range(20)]
    eager = model.generate(prompts, 6, ignore_eos=True)
    count = len(steps)
    assert model.generate(prompts, 6, ignore_eos=True, cuda_graph=True) == eager
    assert len(steps) > count
