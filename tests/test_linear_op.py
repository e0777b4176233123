"""``set_linear_op``: every layer that multiplies by its weight calls its ``linear_op``; ``decode_linear`` on
the CPU is ``F.linear``, and the models hand it to their layers. (The kernel itself:
tests/test_decode_linear_cuda.py.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from tpkit.models import LlamaForCausalLM, fused_decode
from tpkit.models.fused_decode import fused_decode_applies
from tpkit.ops import (
    apply_rms_sums,
    apply_rotary,
    decode_linear,
    decode_linear_residual_norm,
    decode_linear_silu_and_mul,
    decode_qkv_rope_cache,
)
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
    for hidden_act in ("silu", "gelu"):
        model = LlamaForCausalLM({**config, "hidden_act": hidden_act}, tp_group=SINGLE)
        users = [m for m in model.modules() if hasattr(m, "linear_op")]
        # qkv, o, gate_up and down in each layer, and the head.
        assert len(users) == 4 * model.num_layers + 1
        assert all(m.linear_op is decode_linear for m in users)


def test_llama_mlp_is_swiglu() -> None:
    config = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64}
    mlp = LlamaForCausalLM(config, tp_group=SINGLE).layers[0].mlp
    x = torch.randn(2, 3, 64)
    w_gate, w_up = mlp.gate_up_proj.weight.detach().chunk(2)
    expected = F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), mlp.down_proj.weight)
    torch.testing.assert_close(mlp(x), expected)
    set_linear_op(mlp, F.linear)
    torch.testing.assert_close(mlp(x), expected)


def _check_registration(op: torch._ops.OpOverloadPacket, args: tuple, flops: int) -> None:
    """The custom op passes torch.library's checks (schema, fake implementation, mutations) and counts the
    FLOPs of its product."""
    torch.library.opcheck(op.default, args)
    with FlopCounterMode(display=False) as counter:
        op(*args)
    assert counter.get_total_flops() == flops


@pytest.mark.parametrize("bias", [False, True])
def test_decode_linear_silu_and_mul_on_cpu(bias: bool) -> None:
    x, w = torch.randn(3, 5, 64), torch.randn(48, 64)
    b = torch.randn(48) if bias else None
    gate, up = F.linear(x, w, b).chunk(2, dim=-1)
    assert torch.equal(decode_linear_silu_and_mul(x, w, b), F.silu(gate) * up)
    _check_registration(torch.ops.tpkit.decode_linear_silu_and_mul, (x.view(15, 64), w, b), 2 * 15 * 48 * 64)
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
    _check_registration(torch.ops.tpkit.decode_qkv_rope_cache, args, 2 * 3 * 128 * 64)
    with pytest.raises(ValueError, match=r"decode_qkv_rope_cache: weight: expected \[\(num_heads \+ 2 \* "
                                         r"num_kv_heads\) \* head_size = 144, in_features\]"):
        decode_qkv_rope_cache(x, w, b, cos, sin, key_cache, value_cache, slot_mapping, 5)


@pytest.mark.parametrize("bias", [False, True])
def test_decode_linear_residual_norm_on_cpu(bias: bool) -> None:
    # The op's PyTorch path: the residual add, the norm weight and the rows' sums of squares.
    torch.manual_seed(0)
    x, w, residual = torch.randn(3, 1, 64), torch.randn(48, 64), torch.randn(3, 1, 48)
    b = torch.randn(48) if bias else None
    norm_weight = torch.randn(48)
    sums, zero_sums = torch.rand(3, dtype=torch.float64), torch.randn(3, dtype=torch.float64)
    sums_before = sums.clone()
    out, normed = decode_linear_residual_norm(x, w, b, residual, norm_weight, sums, zero_sums)
    expected = residual + F.linear(x, w, b)
    assert torch.equal(out, expected) and torch.equal(normed, expected * norm_weight)
    torch.testing.assert_close(sums, sums_before + expected.square().sum(-1, dtype=torch.float64).flatten())
    assert torch.equal(zero_sums, torch.zeros(3, dtype=torch.float64))
    args = (x.view(3, 64), w, b, residual.view(3, 48), norm_weight, sums, zero_sums)
    _check_registration(torch.ops.tpkit.decode_linear_residual_norm, args, 2 * 3 * 48 * 64)
    with pytest.raises(ValueError, match=r"residual: expected \(3, 1, 48\) \(input's rows, weight's "
                                         r"out_features\), got \(3, 48\)"):
        decode_linear_residual_norm(x, w, b, residual.view(3, 48), norm_weight, sums, zero_sums)
    with pytest.raises(ValueError, match=r"sums: expected float64 \[3\] \(one sum a row of input\), got "
                                         r"torch.float32 \(3,\)"):
        decode_linear_residual_norm(x, w, b, residual, norm_weight, sums.float(), zero_sums)
    with pytest.raises(ValueError, match="zero_sums: expected another buffer than sums"):
        decode_linear_residual_norm(x, w, b, residual, norm_weight, sums, sums)


def test_rms_norm_split_between_two_products_on_cpu() -> None:
    # The consumer's half: from x * norm_weight and the rows' sums of x ** 2, the products of rms_norm(x).
    torch.manual_seed(0)
    num_heads, num_kv_heads, head_size, eps = 4, 2, 16, 1e-5
    x, norm_weight = torch.randn(3, 1, 64), torch.randn(64)
    normed, sums = x * norm_weight, x.square().sum(-1, dtype=torch.float64).flatten()
    reference = F.rms_norm(x, (64,), norm_weight, eps)
    # A norm no product follows (the model's last) ends with apply_rms_sums.
    torch.testing.assert_close(apply_rms_sums(normed, sums, eps), reference)
    assert apply_rms_sums(normed, None, eps) is normed
    assert apply_rms_sums(normed.bfloat16(), sums, eps).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"apply_rms_sums: rms_sums: expected float64 \[3\] \(one sum a row "
                                         r"of input\), got torch.float32 \(3,\)"):
        apply_rms_sums(normed, sums.float(), eps)
    w, b = torch.randn(48, 64), torch.randn(48)
    torch.testing.assert_close(decode_linear_silu_and_mul(normed, w, b, sums, eps),
                               decode_linear_silu_and_mul(reference, w, b))
    args = (normed.view(3, 64), w, b, sums, eps)
    torch.library.opcheck(torch.ops.tpkit.decode_linear_silu_and_mul.default, args)

    features = (num_heads + 2 * num_kv_heads) * head_size
    w, b = torch.randn(features, 64), torch.randn(features)
    angles = torch.rand(3, 1, 1, head_size // 2) * 6
    rotation = angles.cos(), angles.sin()
    caches = [torch.zeros(2, 4, 8, num_kv_heads, head_size).unbind(0) for _ in range(2)]
    slot_mapping = torch.tensor([5, -1, 30])
    split = decode_qkv_rope_cache(normed, w, b, *rotation, *caches[0], slot_mapping, num_heads, sums, eps)
    whole = decode_qkv_rope_cache(reference, w, b, *rotation, *caches[1], slot_mapping, num_heads)
    torch.testing.assert_close(split, whole)
    torch.testing.assert_close(caches[0], caches[1])
    with pytest.raises(ValueError, match=r"decode_linear_silu_and_mul: rms_sums: expected float64 \[3\] "
                                         r"\(one sum a row of input\), got torch.float64 \(2,\)"):
        decode_linear_silu_and_mul(normed, torch.randn(48, 64), None, sums[:2], eps)


def _cache_tensors(caches: dict) -> list[torch.Tensor]:
    return [t for cache in caches.values() for t in (*cache.key_caches, *cache.value_caches)]


def _llama_for_decode(num_layers: int, prompt_lens: tuple[int, ...]) -> tuple:
    """A tiny Llama on the CPU, its norm weights random (not ones: they must land where they belong),
    prefilled: (model, caches, tokens [batch], metadata) of its first decode step."""
    config = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": num_layers,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
              "max_position_embeddings": 64, "rms_norm_eps": 1e-5}
    torch.manual_seed(0)
    model = LlamaForCausalLM(config, tp_group=SINGLE)
    for name, param in model.named_parameters():
        if name.endswith("layernorm.weight") or name == "norm.weight":
            param.data.uniform_(0.5, 1.5)
    prompts = [torch.randint(0, 128, (n,)).tolist() for n in prompt_lens]
    caches = model._reserve_kv_caches(model._plan_kv_cache([len(p) for p in prompts], 2))
    with torch.no_grad():
        tokens = model._prefill(prompts, caches).argmax(-1)
        metadata = model._decode_metadata(caches, list(range(len(prompts))))
    return model, caches, tokens, metadata


def _plain_and_fused_steps(model: LlamaForCausalLM, caches: dict, tokens: torch.Tensor, metadata: dict,
                           fused_step: object) -> tuple:
    """The decode step through the layers' forward (``fused_decode = False``) and through ``fused_step()``,
    each from the same caches: (plain logits, its caches, fused logits, its caches)."""
    with torch.no_grad():
        before = [t.clone() for t in _cache_tensors(caches)]
        model.fused_decode = False
        plain = model._decode_step(tokens[:, None], metadata, caches)
        after_plain = [t.clone() for t in _cache_tensors(caches)]
        for t, saved in zip(_cache_tensors(caches), before, strict=True):
            t.copy_(saved)
        model.fused_decode = True
        fused = fused_step()
    return plain, after_plain, fused, _cache_tensors(caches)


def test_llama_fused_decode_step_with_the_norms_in_the_products_on_cpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The fused decode step on one rank, each RMSNorm split between the products around it (the ops' PyTorch
    # paths on the CPU), against the step through the layers' forward: logits and the caches written.
    model, caches, tokens, metadata = _llama_for_decode(3, (5, 9, 2))
    layers = []
    layer_step = fused_decode._layer_norms_in_products
    monkeypatch.setattr(fused_decode, "_layer_norms_in_products",
                        lambda layer, *args: layers.append(layer) or layer_step(layer, *args))
    plain, after_plain, split, after_split = _plain_and_fused_steps(
        model, caches, tokens, metadata, lambda: model._decode_step(tokens[:, None], metadata, caches))
    assert layers == list(model.layers), "the split-norm step was not taken"
    torch.testing.assert_close(split, plain, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(after_split, after_plain, rtol=1e-5, atol=1e-5)


def test_llama_fused_decode_layers_across_ranks_on_cpu() -> None:
    # The fused decode step's layers as they run at tp_size > 1 (RoPE and the cache write in qkv_proj's
    # product, SwiGLU in gate_up_proj's, the norms as modules), here on one rank, against the layers' forward.
    model, caches, tokens, metadata = _llama_for_decode(2, (4, 7))
    positions = (metadata["self"].seq_lens.long() - 1)[:, None]  # [batch, 1]

    def fused_layers() -> torch.Tensor:
        x = model.embed_tokens(tokens[:, None])  # [batch, 1, hidden]
        cos, sin = model.rotary_emb.cos_sin(positions, x.dtype)
        for layer in model.layers:
            x = fused_decode._layer(layer, x, cos, sin, caches["self"], metadata["self"])
        return model.compute_logits(model.norm(x)[:, 0])

    plain, after_plain, fused, after_fused = _plain_and_fused_steps(model, caches, tokens, metadata,
                                                                    fused_layers)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after_fused, after_plain, rtol=1e-6, atol=1e-6)


def test_llama_fused_decode_switch() -> None:
    # None: where the decode kernel takes the products (not on the CPU); True: every decode step without
    # gradients; False: never. Never a packed step (a prefill), nor a step that wants gradients.
    model, caches, _, metadata = _llama_for_decode(1, (3, 2))
    x = torch.empty(2, 1, 64)
    packed = dataclasses.replace(metadata["self"], query_start_loc=torch.tensor([0, 1, 2], dtype=torch.int32))
    with torch.no_grad():
        assert not fused_decode_applies(model, x, caches["self"], metadata["self"])
        model.fused_decode = True
        assert fused_decode_applies(model, x, caches["self"], metadata["self"])
        assert not fused_decode_applies(model, x, caches["self"], packed)
        assert not fused_decode_applies(model, x, None, None)
        model.fused_decode = False
        assert not fused_decode_applies(model, x, caches["self"], metadata["self"])
    model.fused_decode = True
    assert not fused_decode_applies(model, x, caches["self"], metadata["self"])  # gradients on


def _tiny_decode_step(num_layers: int) -> tuple:
    """A tiny Llama on the CPU that takes the fused decode step (``fused_decode = True``), prefilled:
    (model, caches, tokens [2], metadata) of its first decode step, with dynamo reset."""
    model, caches, tokens, metadata = _llama_for_decode(num_layers, (6, 3))
    model.fused_decode = True
    torch._dynamo.reset()
    return model, caches, tokens, metadata


def test_llama_fused_decode_step_compiles_without_graph_breaks() -> None:
    # generate(compile=True) compiles the decode step. A graph break inside a layer made dynamo compile that
    # layer's frame once per layer (the guards differ by layer) until its recompile limit (8), and run the
    # layers past it uncompiled; fullgraph=True fails on any break. Same logits as the eager step. (The step
    # through the layers' forward, on one rank and two: tests/test_generate.py.)
    model, caches, tokens, metadata = _tiny_decode_step(2)
    with torch.no_grad():
        assert fused_decode_applies(model, torch.empty(2, 1, 64), caches["self"], metadata["self"])
        # Both write the same k, v into the same slots: the second step sees the caches the first did.
        eager = model._decode_step(tokens[:, None], metadata, caches)
        compiled = torch.compile(model._decode_step, fullgraph=True, backend="eager")
        logits = compiled(tokens[:, None], metadata, caches)
    torch.testing.assert_close(logits, eager)


def _call_arguments(code: str, op: str) -> list[list[str]]:
    """The arguments of every call of ``op`` in inductor's generated ``code``, as source strings."""
    calls = []
    for line in code.splitlines():
        start = line.find(op + "(")
        if start < 0:
            continue
        args, depth, current = [], 0, ""
        for char in line[start + len(op) + 1:]:
            if char == ")" and depth == 0:
                break
            depth += {"(": 1, ")": -1}.get(char, 0)
            if char == "," and depth == 0:
                args.append(current.strip())
                current = ""
            else:
                current += char
        calls.append([*args, current.strip()])
    return calls


def test_compiled_decode_step_computes_cos_and_sin_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # inductor copied the step's cos and sin into buffers of their own for every layer's
    # decode_qkv_rope_cache (a layout constraint of custom ops' inputs): 64 copies a Llama-3-8B step in six
    # kernels. The op's flexible_layout tag lets every layer read the same two.
    from torch._inductor.utils import run_and_get_code

    model, caches, tokens, metadata = _tiny_decode_step(3)
    # The code, not a cached one: a cache key does not cover the op's tags.
    monkeypatch.setattr(torch._inductor.config, "force_disable_caches", True)
    # Scalar C++ kernels: the copies are placed before code generation, whatever the vector ISA, and probing
    # the machine's ISAs compiles a program for each.
    monkeypatch.setattr(torch._inductor.config.cpp, "vec_isa_ok", False)
    with torch.no_grad():
        _, codes = run_and_get_code(torch.compile(model._decode_step), tokens[:, None], metadata, caches)
    calls = _call_arguments("\n".join(codes), "torch.ops.tpkit.decode_qkv_rope_cache.default")
    assert len(calls) == 3
    assert len({tuple(args[3:5]) for args in calls}) == 1, [args[3:5] for args in calls]
