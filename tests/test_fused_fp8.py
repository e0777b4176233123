"""The fused float8 step (``tpkit.models.fused_fp8``) and its ops on the CPU: the ops' PyTorch
implementations against the expressions they fuse, their argument checks, and a float8 Llama's logits through
the fused step against its layers' forward with the same arithmetic (activations quantized per token, the
products on the dequantized operands), at tp_size 1 and 2, per tensor and per channel, dynamic and static
activation scales, with q/k/v biases."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpkit.models import LlamaForCausalLM, llama
from tpkit.ops import (
    add_rms_norm_quantize_fp8,
    quantize_per_token_fp8,
    rms_norm_quantize_fp8,
    silu_and_mul_quantize_fp8,
)
from tpkit.parallel_layers import (
    ColumnParallelLinear,
    Fp8LinearMethod,
    init_tensor_parallel,
    set_quant_method,
)

CONFIG = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 64,
          "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 64, "rms_norm_eps": 1e-5}


class TensorCoreArithmetic(Fp8LinearMethod):
    """What a float8 tensor-core product computes, on any device: every input quantized per token by
    ``quantize_op``, then multiplied in float32 by the dequantized weight (the layers' own CPU path multiplies
    the unquantized input)."""

    def apply(self, layer, input_, bias, rows=None):
        assert rows is None
        flat = input_.reshape(-1, input_.shape[-1])  # [num_tokens, in_features]
        quantized, scale = self.quantize_op(flat, *self.activation_scales(layer))
        out = self.apply_quantized(layer, quantized, scale, bias, input_.dtype)
        return out.view(*input_.shape[:-1], -1)


def _rows(num_rows: int, features: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scales = torch.logspace(-3, 3, num_rows)[:, None]
    return (torch.randn(num_rows, features, generator=gen) * scales).to(dtype)


def _assert_same(got: tuple, expected: tuple) -> None:
    """The same tensors, bit for bit (float8 compared as bytes, NaN equal to NaN)."""
    for g, e in zip(got, expected, strict=True):
        assert g.dtype == e.dtype and g.shape == e.shape
        if g.dtype == torch.float8_e4m3fn:
            assert torch.equal(g.view(torch.uint8), e.view(torch.uint8))
        else:
            torch.testing.assert_close(g, e, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_fused_quantizations_are_the_unfused_expressions(dtype):
    """Each op is quantize_per_token_fp8 of the expression it fuses, NaN rows included, with dynamic,
    bounded and static scales."""
    x, residual = _rows(12, 48, 0, dtype), _rows(12, 48, 1, dtype)
    x[3, 5] = float("nan")
    weight = _rows(1, 48, 2, dtype)[0] + 1
    gate_up = _rows(12, 96, 3, dtype)
    for input_scale, bound in ((None, None), (None, 0.5), (torch.tensor(0.01), None)):
        gate, up = gate_up.chunk(2, dim=-1)
        _assert_same(silu_and_mul_quantize_fp8(gate_up, input_scale, bound),
                     quantize_per_token_fp8(F.silu(gate) * up, input_scale, bound))
        normed = F.rms_norm(x, (48,), weight, 1e-5)
        _assert_same(rms_norm_quantize_fp8(x, weight, 1e-5, input_scale, bound),
                     quantize_per_token_fp8(normed, input_scale, bound))
        added = x + residual
        normed = F.rms_norm(added, (48,), weight, 1e-5)
        expected = (*quantize_per_token_fp8(normed, input_scale, bound), added)
        _assert_same(add_rms_norm_quantize_fp8(x, residual, weight, 1e-5, input_scale, bound), expected)
    quantized, scale = rms_norm_quantize_fp8(x, weight, 1e-5)
    assert torch.isnan(scale[3]) and not torch.isnan(scale[:3]).any()


def test_fused_quantizations_opcheck_and_compile():
    """Schema and fake implementation (opcheck) of each op, strided rows included, and the three in one
    compiled graph."""
    x, residual, gate_up = _rows(6, 48, 0), _rows(6, 48, 1), _rows(6, 80, 2)[:, 8:]
    weight, static = _rows(1, 48, 3)[0], torch.tensor(0.05)
    for input_scale, bound in ((None, None), (static, None), (None, 20.0)):
        ops = torch.ops.tpkit
        torch.library.opcheck(ops.silu_and_mul_quantize_fp8.default, (gate_up, input_scale, bound))
        torch.library.opcheck(ops.rms_norm_quantize_fp8.default, (x, weight, 1e-5, input_scale, bound))
        torch.library.opcheck(ops.add_rms_norm_quantize_fp8.default,
                              (x[:, :40], residual[:, 8:], weight[:40], 1e-5, input_scale, bound))

    def fused(x, residual, gate_up, weight):
        return (*rms_norm_quantize_fp8(x, weight, 1e-5),
                *add_rms_norm_quantize_fp8(x, residual, weight, 1e-5),
                *silu_and_mul_quantize_fp8(gate_up, None, 20.0))

    compiled = torch.compile(fused, backend="aot_eager", fullgraph=True)
    _assert_same(compiled(x, residual, gate_up, weight), fused(x, residual, gate_up, weight))


def test_fused_quantizations_reject_bad_arguments():
    x, weight = _rows(4, 16, 0), _rows(1, 16, 1)[0]
    cases = [
        (lambda: silu_and_mul_quantize_fp8(_rows(4, 15, 0)), ValueError, "gate, then up"),
        (lambda: silu_and_mul_quantize_fp8(x[0]), ValueError, "input: expected [num_rows, features]"),
        (lambda: rms_norm_quantize_fp8(x, weight[:8], 1e-5), ValueError, "weight: expected shape [16]"),
        (lambda: rms_norm_quantize_fp8(x, weight.float(), 1e-5), ValueError, "weight: expected dtype"),
        (lambda: rms_norm_quantize_fp8(x, weight, -1.0), ValueError, "eps: expected a number >= 0"),
        (lambda: rms_norm_quantize_fp8(x, weight, 1e-5, torch.ones(2)), ValueError, "input_scale"),
        (lambda: add_rms_norm_quantize_fp8(x, x[:2], weight, 1e-5), ValueError, "residual: expected shape"),
        (lambda: add_rms_norm_quantize_fp8(x, x.half(), weight, 1e-5), ValueError,
         "residual: expected dtype"),
        (lambda: rms_norm_quantize_fp8(x.long(), weight, 1e-5), TypeError, "input: expected dtype"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=message.replace("[", r"\[").replace("]", r"\]")):
            call()


def test_apply_quantized_rejects_what_it_cannot_multiply():
    method = Fp8LinearMethod("channel", quantize_op=quantize_per_token_fp8)
    layer = ColumnParallelLinear(32, 16, bias=False, params_dtype=torch.bfloat16, quant_method=method)
    quantized, scale = quantize_per_token_fp8(_rows(3, 32, 0))
    with pytest.raises(ValueError, match=r"quantized: expected torch.float8_e4m3fn \[num_tokens, 32\]"):
        method.apply_quantized(layer, quantized[:, :16], scale, None, torch.bfloat16)
    with pytest.raises(ValueError, match=r"scale: expected torch.float32 \[3, 1\]"):
        method.apply_quantized(layer, quantized, scale[:2], None, torch.bfloat16)
    block = Fp8LinearMethod("block", block_size=(16, 16))
    blocked = ColumnParallelLinear(32, 16, bias=False, params_dtype=torch.bfloat16, quant_method=block)
    with pytest.raises(ValueError, match="one scale a tensor or a row"):
        block.apply_quantized(blocked, quantized, scale, None, torch.bfloat16)


# Families with the same layers around other attention: Qwen3's q/k norms, Mistral's sliding window.
FAMILIES = {"llama": {}, "qwen3": {"model_type": "qwen3", "head_dim": 16},
            "mistral": {"model_type": "mistral", "sliding_window": 4}}


def _fused_and_layers_logits(tp_size: int, scheme: str, static: bool, bias: bool,
                             family: str = "llama") -> tuple:
    """(fused step's logits, layers' logits, fused steps taken) of one random float8 Llama-family model."""
    tp = init_tensor_parallel(tp_size) if tp_size > 1 else None
    torch.manual_seed(11)
    method = TensorCoreArithmetic(scheme, static_input_scale=static, quantize_op=quantize_per_token_fp8,
                                  activation_scale_ub=None if static else 30.0)
    config = {**CONFIG, "attention_bias": bias, "mlp_bias": bias, **FAMILIES[family]}
    model = LlamaForCausalLM(config, dtype=torch.bfloat16, tp_group=tp, quant_method=method).eval()
    with torch.no_grad():  # norms and biases of their own, which the init leaves at ones and zeros
        for name, param in model.named_parameters():
            if name.endswith(("norm.weight", "bias")):
                param.uniform_(0.5, 1.5)
            elif name.endswith("input_scale"):
                param.uniform_(0.002, 0.02)
    torch.manual_seed(12)
    input_ids = torch.randint(0, CONFIG["vocab_size"], (2, 9))
    positions = torch.arange(9).expand(2, 9)
    steps = []
    fused = llama.fused_fp8_step
    llama.fused_fp8_step = lambda *args: steps.append(1) or fused(*args)
    try:
        with torch.no_grad():
            model.fused_fp8 = True
            got = model.compute_logits(model.hidden_states(input_ids, positions))
            model.fused_fp8 = False
            expected = model.compute_logits(model.hidden_states(input_ids, positions))
    finally:
        llama.fused_fp8_step = fused
    return got, expected, len(steps)


@pytest.mark.parametrize("scheme,static,bias,family", [
    ("channel", False, False, "llama"), ("tensor", True, True, "llama"), ("channel", True, False, "llama"),
    ("channel", False, False, "qwen3"), ("tensor", False, True, "mistral")])
def test_fused_fp8_step_gives_the_layers_logits(scheme, static, bias, family):
    """On the CPU the fused ops are the unfused expressions, so the fused step's logits are the layers'
    bit for bit: every layer's norms, adds, scales and biases in the layers' order, with Qwen3's q/k norms
    and Mistral's window."""
    got, expected, steps = _fused_and_layers_logits(1, scheme, static, bias, family)
    assert steps == 1
    assert torch.equal(got, expected)
    assert got.float().std() > 0


@pytest.mark.parametrize("scheme,static", [("channel", False), ("tensor", True)])
def test_fused_fp8_step_across_two_ranks(ranks, scheme, static):
    """At tp_size 2 each rank's fused step gives its layers' logits (down_proj's all-reduce before the
    residual add), and the ranks agree."""
    results = ranks.run(2, _fused_and_layers_logits, 2, scheme, static, True)
    for got, expected, steps in results:
        assert steps == 1
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)


def test_fused_fp8_step_applies_only_where_it_computes_the_layers():
    """Not with gradients, not for a method quantizing another way, not for block scales, not for a model
    with a product left unquantized, not with fused_fp8 False; by default (None) not on the CPU, where no
    float8 tensor cores run."""
    torch.manual_seed(0)
    method = Fp8LinearMethod("channel", quantize_op=quantize_per_token_fp8)
    model = LlamaForCausalLM(CONFIG, dtype=torch.bfloat16, quant_method=method).eval()
    x = torch.randn(1, 40, CONFIG["hidden_size"]).bfloat16()
    applies = llama.fused_fp8_applies
    with torch.no_grad():
        assert not applies(model, x)  # None on the CPU
        model.fused_fp8 = True
        assert applies(model, x)
    assert not applies(model, x)  # gradients on
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(getattr(layer, "quant_method", None), Fp8LinearMethod):
                layer.quant_method = Fp8LinearMethod("channel",
                                                     quantize_op=lambda *a: quantize_per_token_fp8(*a))
        assert not applies(model, x)
        block = LlamaForCausalLM(CONFIG, dtype=torch.bfloat16,
                                 quant_method=Fp8LinearMethod("block", block_size=(32, 32),
                                                              quantize_op=quantize_per_token_fp8)).eval()
        block.fused_fp8 = True
        assert not applies(block, x)
        plain = LlamaForCausalLM(CONFIG, dtype=torch.bfloat16).eval()
        plain.fused_fp8 = True
        assert not applies(plain, x)
        # One product left unquantized, or one norm in float32: the step runs through the layers.
        assert set_quant_method(plain, method, skip=["layers.2.mlp.down_proj"]) == 3 * 4 - 1
        assert not applies(plain, x)
        float32_norm = LlamaForCausalLM(CONFIG, dtype=torch.bfloat16, quant_method=method).eval()
        float32_norm.fused_fp8 = True
        assert applies(float32_norm, x)
        float32_norm.layers[1].post_attention_layernorm.float()
        assert not applies(float32_norm, x)
        positions = torch.arange(40)[None]
        assert plain.compute_logits(plain.hidden_states(torch.arange(40)[None], positions)).isfinite().all()
