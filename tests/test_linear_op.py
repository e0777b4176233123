"""``set_linear_op``: every layer that multiplies by its weight calls its ``linear_op``; ``decode_linear`` on
the CPU is ``F.linear``, and the models hand it to their layers. (The kernel itself:
tests/test_decode_linear_cuda.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from tpkit.attention import apply_rotary, decode_linear, decode_linear_silu_and_mul, decode_qkv_rope_cache
from tpkit.models import LlamaForCausalLM
from tpkit.parallel_layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVCrossParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    set_linear_op,
)

# One process (also under torchrun, whose world is not this test's group).
SINGLE = TPGroup(None, 0, 1)


def _layers() -> torch.nn.ModuleDict:
    torch.manual_seed(0)
    return torch.nn.ModuleDict({
        "replicated": ReplicatedLinear(16, 24, tp_group=SINGLE),
        "column": ColumnParallelLinear(16, 24, gather_output=True, tp_group=SINGLE),
        "merged": MergedColumnParallelLinear(16, [8, 16], bias=False, tp_group=SINGLE),
        "qkv": QKVParallelLinear(16, 4, 4, 2, tp_group=SINGLE),
        "cross": QKVCrossParallelLinear(16, 4, 4, 2, tp_group=SINGLE),
        "row": RowParallelLinear(24, 16, tp_group=SINGLE),
        "lm_head": ParallelLMHead(40, 16, bias=True, tp_group=SINGLE),
        "embedding": VocabParallelEmbedding(40, 16, tp_group=SINGLE),
    })


def _outputs(layers: torch.nn.ModuleDict, x: torch.Tensor, enc: torch.Tensor) -> list[torch.Tensor]:
    q, k, v = layers["cross"](x, enc)
    return [layers["replicated"](x), layers["column"](x), layers["merged"](x), layers["qkv"](x), q, k, v,
            layers["row"](torch.cat([x, x[..., :8]], -1)), layers["lm_head"](x)]


def test_every_multiplying_layer_calls_its_linear_op() -> None:
    layers = _layers()
    x, enc = torch.randn(2, 3, 16), torch.randn(2, 5, 16)
    expected = _outputs(layers, x, enc)
    calls = []

    def doubled(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        calls.append(tuple(weight.shape))
        return 2 * F.linear(input, weight, bias)

    # The embedding does not multiply: seven layers.
    assert set_linear_op(layers, doubled) == 7
    for out, ref in zip(_outputs(layers, x, enc), expected, strict=True):
        torch.testing.assert_close(out, 2 * ref)
    # One call per product, in _outputs' order: the cross layer's q rows, then its k and v rows; the head's
    # vocabulary is padded to 64.
    assert calls == [(16, 16), (16, 16), (24, 16), (24, 16), (24, 16), (32, 16), (16, 24), (64, 16)]
    assert set_linear_op(layers, F.linear) == 7
    for out, ref in zip(_outputs(layers, x, enc), expected, strict=True):
        torch.testing.assert_close(out, ref)


def test_gradients_flow_through_the_linear_op() -> None:
    layers = _layers()
    set_linear_op(layers, decode_linear)
    x = torch.randn(4, 16, requires_grad=True)
    layers["column"](x).square().sum().backward()
    weight = layers["column"].weight
    x_ref = x.detach().clone().requires_grad_(True)
    w_ref = weight.detach().clone().requires_grad_(True)
    F.linear(x_ref, w_ref, layers["column"].bias.detach()).square().sum().backward()
    torch.testing.assert_close(weight.grad, w_ref.grad)
    torch.testing.assert_close(x.grad, x_ref.grad)


def test_set_linear_op_rejects_a_non_function() -> None:
    layers = _layers()
    with pytest.raises(TypeError, match="linear_op: expected a function like F.linear, got int"):
        set_linear_op(layers, 3)
    assert all(m.linear_op is F.linear for m in layers.values() if hasattr(m, "linear_op"))


@pytest.mark.parametrize("bias", [False, True])
def test_decode_linear_on_cpu_is_f_linear(bias: bool) -> None:
    x, w = torch.randn(3, 5, 64).to(torch.bfloat16), torch.randn(24, 64).to(torch.bfloat16)
    b = torch.randn(24).to(torch.bfloat16) if bias else None
    assert torch.equal(decode_linear(x, w, b), F.linear(x, w, b))


def test_decode_linear_op_registration() -> None:
    # The custom op's schema, fake implementation and CPU implementation agree (torch's own checks).
    x, w, b = torch.randn(8, 64), torch.randn(32, 64), torch.randn(32)
    torch.library.opcheck(torch.ops.tpkit.decode_linear.default, (x, w, b))
    torch.library.opcheck(torch.ops.tpkit.decode_linear.default, (x, w, None))
    torch.testing.assert_close(torch.ops.tpkit.decode_linear(x, w, b), F.linear(x, w, b))


def test_decode_linear_flops_counted_as_f_linear() -> None:
    x, w, b = torch.randn(8, 64), torch.randn(32, 64), torch.randn(32)
    counted = []
    for fn in (lambda: torch.ops.tpkit.decode_linear(x, w, b), lambda: F.linear(x, w, b)):
        with FlopCounterMode(display=False) as counter:
            fn()
        counted.append(counter.get_total_flops())
    assert counted == [2 * 8 * 32 * 64] * 2


def test_models_hand_decode_linear_to_their_layers() -> None:
    config = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64}
    model = LlamaForCausalLM(config, tp_group=SINGLE)
    users = [m for m in model.modules() if hasattr(m, "linear_op")]
    # qkv, o, gate_up and down in each layer, and the head; gate_up with SwiGLU (the default SiLU).
    assert len(users) == 4 * model.num_layers + 1
    gate_ups = [layer.mlp.gate_up_proj for layer in model.layers]
    assert all(m.linear_op is decode_linear_silu_and_mul for m in gate_ups)
    assert all(m.linear_op is decode_linear for m in users if all(m is not g for g in gate_ups))
    # Another activation: no SwiGLU in the product.
    gelu = LlamaForCausalLM({**config, "hidden_act": "gelu"}, tp_group=SINGLE)
    assert all(m.linear_op is decode_linear for m in gelu.modules() if hasattr(m, "linear_op"))


def test_llama_mlp_with_and_without_swiglu_in_the_product() -> None:
    config = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64}
    mlp = LlamaForCausalLM(config, tp_group=SINGLE).layers[0].mlp
    x = torch.randn(2, 3, 64)
    w_gate, w_up = mlp.gate_up_proj.weight.detach().chunk(2)
    expected = F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), mlp.down_proj.weight)
    fused = mlp(x)
    set_linear_op(mlp, F.linear)  # the MLP now applies SwiGLU itself
    torch.testing.assert_close(fused, expected)
    torch.testing.assert_close(mlp(x), expected)


@pytest.mark.parametrize("bias", [False, True])
def test_decode_linear_silu_and_mul_on_cpu(bias: bool) -> None:
    x, w = torch.randn(3, 5, 64), torch.randn(48, 64)
    b = torch.randn(48) if bias else None
    gate, up = F.linear(x, w, b).chunk(2, dim=-1)
    assert torch.equal(decode_linear_silu_and_mul(x, w, b), F.silu(gate) * up)
    torch.library.opcheck(torch.ops.tpkit.decode_linear_silu_and_mul.default, (x.view(15, 64), w, b))
    with FlopCounterMode(display=False) as counter:
        torch.ops.tpkit.decode_linear_silu_and_mul(x.view(15, 64), w, b)
    assert counter.get_total_flops() == 2 * 15 * 48 * 64
    with pytest.raises(ValueError, match=r"weight: expected \[2 \* features, in_features\] \(gate rows, then "
                                         r"up rows\), got \(47, 64\)"):
        decode_linear_silu_and_mul(x, w[:47], None)


def test_decode_qkv_rope_cache_on_cpu() -> None:
    # The op's PyTorch path: the product, the models' rotation of q and k, reshape_and_cache of k and v.
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_size = 4, 2, 16
    features = (num_heads + 2 * num_kv_heads) * head_size  # 128
    x, w, b = torch.randn(3, 1, 64), torch.randn(features, 64), torch.randn(features)
    angles = torch.rand(3, 1, 1, head_size // 2) * 6
    cos, sin = angles.cos(), angles.sin()
    key_cache, value_cache = torch.randn(2, 4, 8, num_kv_heads, head_size).unbind(0)
    slot_mapping = torch.tensor([5, -1, 30])
    key_before, value_before = key_cache.clone(), value_cache.clone()
    qkv = decode_qkv_rope_cache(x, w, b, cos, sin, key_cache, value_cache, slot_mapping, num_heads)
    heads = F.linear(x, w, b).view(3, 1, -1, head_size)  # [batch, seq, heads, head_size]
    qk = apply_rotary(heads[:, :, : num_heads + num_kv_heads], cos, sin)
    assert torch.equal(qkv, torch.cat((qk, heads[:, :, num_heads + num_kv_heads:]), dim=2).flatten(2))
    key_before.view(32, num_kv_heads, head_size)[[5, 30]] = qk[[0, 2], 0, num_heads:]
    value_before.view(32, num_kv_heads, head_size)[[5, 30]] = heads[[0, 2], 0, num_heads + num_kv_heads:]
    assert torch.equal(key_cache, key_before) and torch.equal(value_cache, value_before)
    args = (x.view(3, 64), w, b, cos.view(3, -1), sin.view(3, -1), key_cache, value_cache, slot_mapping,
            num_heads)
    torch.library.opcheck(torch.ops.tpkit.decode_qkv_rope_cache.default, args)
    with FlopCounterMode(display=False) as counter:
        torch.ops.tpkit.decode_qkv_rope_cache(*args)
    assert counter.get_total_flops() == 2 * 3 * 128 * 64
    with pytest.raises(ValueError, match=r"decode_qkv_rope_cache: weight: expected \[\(num_heads \+ 2 \* "
                                         r"num_kv_heads\) \* head_size = 144, in_features\]"):
        decode_qkv_rope_cache(x, w, b, cos, sin, key_cache, value_cache, slot_mapping, 5)
