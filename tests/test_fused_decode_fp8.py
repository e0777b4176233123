"""The fused decode step on float8: each fused op's PyTorch reference with float8 weights (and a float8 cache)
against a naive dequantize-then-compute loop, and a tiny Llama's fused step (``fused_decode = True``, the
references on the CPU) against its step through the layers' forward, with float8 weights of each scheme the
fused step takes and float8 caches, at tp 1 and 2. (The kernels: tests/test_fp8_cuda.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpkit.models import LlamaForCausalLM
from tpkit.models.fused_decode import fused_decode_applies
from tpkit.ops import (
    decode_linear_fp8,
    decode_linear_residual_norm,
    decode_linear_silu_and_mul,
    decode_qkv_rope_cache,
)
from tpkit.parallel_layers import Fp8LinearMethod, TPGroup

SINGLE = TPGroup(None, 0, 1)
FP8 = torch.float8_e4m3fn
CACHE_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def _fp8_weight(out_features: int, in_features: int, gen: torch.Generator) -> tuple:
    """A random float8 weight [out_features, in_features] and its per-row scales [out_features]."""
    weight = (torch.randn(out_features, in_features, generator=gen) * 100).to(FP8)
    return weight, torch.rand(out_features, generator=gen) * 0.01 + 1e-3


def _naive_product(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                   bias: torch.Tensor) -> torch.Tensor:
    """x [rows, in] @ W.T + bias, W dequantized row by row, each output a dot product of its own."""
    rows, out_features = x.shape[0], weight.shape[0]
    dequantized = [(weight[n].float() * scale[n]).to(x.dtype) for n in range(out_features)]
    out = torch.empty(rows, out_features, dtype=x.dtype)
    for m in range(rows):
        for n in range(out_features):
            out[m, n] = torch.dot(x[m].double(), dequantized[n].double()) + bias[n].double()
    return out


def _naive_quantized(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """saturate(x / scale) element by element: the stored float8 value of x [heads, head_size] (scale [] or
    [heads])."""
    scale = scale.expand(x.shape[0])
    limit = CACHE_MAX[dtype]
    return torch.stack([(x[h].float() / scale[h]).clamp(-limit, limit).to(dtype) for h in range(x.shape[0])])


def test_silu_and_mul_and_residual_norm_references_with_float8_weights() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=gen)
    weight, scale = _fp8_weight(48, 64, gen)
    bias = torch.randn(48, generator=gen)
    product = _naive_product(x, weight, scale, bias)
    gate, up = product[:, :24], product[:, 24:]
    torch.testing.assert_close(decode_linear_silu_and_mul(x, weight, bias, weight_scale=scale),
                               F.silu(gate) * up)
    residual, norm_weight = torch.randn(3, 48, generator=gen), torch.rand(48, generator=gen) + 0.5
    sums, zero_sums = torch.rand(3, dtype=torch.float64), torch.rand(3, dtype=torch.float64)
    before = sums.clone()
    out, normed = decode_linear_residual_norm(x, weight, bias, residual, norm_weight, sums, zero_sums, scale)
    torch.testing.assert_close(out, residual + product)
    torch.testing.assert_close(normed, (residual + product) * norm_weight)
    torch.testing.assert_close(sums, before + (residual + product).double().square().sum(-1))
    assert not zero_sums.any()
    # decode_linear_fp8's reference multiplies by the same dequantized weight.
    torch.testing.assert_close(torch.ops.tpkit.decode_linear_fp8(x, weight, scale, bias), product)


@pytest.mark.parametrize("cache_dtype", [torch.float32, *CACHE_MAX], ids=str)
@pytest.mark.parametrize("per_head", [False, True])
def test_qkv_rope_cache_reference_with_float8_weights_and_caches(cache_dtype, per_head) -> None:
    gen = torch.Generator().manual_seed(1)
    num_heads, num_kv_heads, head_size, rows = 4, 2, 16, 3
    features = (num_heads + 2 * num_kv_heads) * head_size
    x = torch.randn(rows, 64, generator=gen)
    weight, scale = _fp8_weight(features, 64, gen)
    bias = torch.randn(features, generator=gen)
    angles = torch.rand(rows, head_size // 2, generator=gen) * 6
    cos, sin = angles.cos(), angles.sin()
    caches = [torch.zeros(4, 8, num_kv_heads, head_size, dtype=cache_dtype) for _ in range(2)]
    fp8_cache = cache_dtype != torch.float32
    shape = (num_kv_heads,) if per_head else ()
    kv_scales = [torch.rand(shape, generator=gen) * 0.02 + 0.01 if fp8_cache else None for _ in range(2)]
    slots = torch.tensor([5, -1, 30])
    qkv = decode_qkv_rope_cache(x, weight, bias, cos, sin, *caches, slots, num_heads, weight_scale=scale,
                                k_scale=kv_scales[0], v_scale=kv_scales[1])
    # The naive rotation of each q and k head's pairs (i, i + head_size / 2).
    heads = _naive_product(x, weight, scale, bias).view(rows, -1, head_size)
    expected = heads.clone()
    half = head_size // 2
    for m in range(rows):
        for h in range(num_heads + num_kv_heads):
            for i in range(half):
                x1, x2 = heads[m, h, i], heads[m, h, i + half]
                expected[m, h, i] = x1 * cos[m, i] - x2 * sin[m, i]
                expected[m, h, i + half] = x2 * cos[m, i] + x1 * sin[m, i]
    torch.testing.assert_close(qkv, expected.flatten(1), rtol=1e-5, atol=1e-5)
    # Each written slot holds the output's k and v (quantized: saturate(x / scale) of those very values).
    out = qkv.view(rows, -1, head_size)
    for m, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        for cache, new, kv_scale in ((caches[0], out[m, num_heads:num_heads + num_kv_heads], kv_scales[0]),
                                     (caches[1], out[m, num_heads + num_kv_heads:], kv_scales[1])):
            stored = cache[slot // 8, slot % 8]
            wanted = _naive_quantized(new, kv_scale, cache_dtype) if fp8_cache else new
            assert torch.equal(stored.view(torch.uint8) if fp8_cache else stored,
                               wanted.view(torch.uint8) if fp8_cache else wanted)
    written = torch.zeros(4 * 8, dtype=torch.bool)
    written[[5, 30]] = True
    assert not caches[0].flatten(0, 1)[~written].float().any()


def test_bad_weight_scales_are_named() -> None:
    gen = torch.Generator().manual_seed(2)
    weight, scale = _fp8_weight(48, 64, gen)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match=r"decode_linear_silu_and_mul: weight_scale: expected float32 \[48\] "
                                         r"\(one scale a weight row\), got torch.float32 \[47\]"):
        decode_linear_silu_and_mul(x, weight, None, weight_scale=scale[:47])
    with pytest.raises(TypeError, match=r"decode_linear_residual_norm: weight: expected torch.float8_e4m3fn "
                                        r"with a weight_scale, got torch.float32"):
        decode_linear_residual_norm(x, weight.float(), None, torch.randn(2, 48), torch.ones(48),
                                    torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64),
                                    scale)
    caches = [torch.zeros(4, 8, 2, 16, dtype=FP8) for _ in range(2)]
    w, s = _fp8_weight(128, 64, gen)
    with pytest.raises(ValueError, match=r"decode_qkv_rope_cache: k_scale: expected a float32 scale for a "
                                         r"torch.float8_e4m3fn cache"):
        decode_qkv_rope_cache(x, w, None, torch.ones(2, 8), torch.zeros(2, 8), *caches, torch.tensor([0, 1]),
                              4, weight_scale=s)


CONFIG = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64, "rms_norm_eps": 1e-5}


def _fp8_llama(scheme: str, cache_dtype: torch.dtype | None, tp_group: object = SINGLE) -> LlamaForCausalLM:
    """A tiny Llama with float8 weights of ``scheme`` (the decode product tpkit's models give them), its norm
    weights random, caches of ``cache_dtype`` (None: the model's)."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(CONFIG, tp_group=tp_group,
                             quant_method=Fp8LinearMethod(scheme, block_size=(16, 16),
                                                          decode_op=decode_linear_fp8))
    for name, param in model.named_parameters():
        if name.endswith("layernorm.weight") or name == "norm.weight":
            param.data.uniform_(0.5, 1.5)
    model.kv_cache_dtype = cache_dtype
    return model


def _prefilled(model: LlamaForCausalLM, prompt_lens: tuple[int, ...]) -> tuple:
    """(caches, tokens [batch], metadata) of the first decode step after a prefill; a float8 cache gets
    random scales (per KV head in layer 0, one in layer 1) first."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in prompt_lens]
    caches = model._reserve_kv_caches(model._plan_kv_cache([len(p) for p in prompts], 2))
    cache = caches["self"]
    if cache.is_fp8:
        for i, shape in enumerate(((cache.num_kv_heads,), ())):
            cache.set_scales(i, torch.rand(shape, generator=gen) * 0.01 + 0.002,
                             torch.rand(shape, generator=gen) * 0.01 + 0.002)
    with torch.no_grad():
        tokens = model._prefill(prompts, caches).argmax(-1)
        metadata = model._decode_metadata(caches, list(range(len(prompts))))
    return caches, tokens, metadata


def _plain_and_fused(model: LlamaForCausalLM, prompt_lens: tuple[int, ...]) -> tuple:
    """The decode step through the layers' forward and the fused one, each from the same caches: (plain
    logits, fused logits, the caches after each as float32 tensors, the raw bytes after each)."""
    caches, tokens, metadata = _prefilled(model, prompt_lens)
    tensors = [*caches["self"].key_caches, *caches["self"].value_caches]
    before = [t.clone() for t in tensors]
    results = []
    with torch.no_grad():
        for fused in (False, True):
            for t, saved in zip(tensors, before, strict=True):
                t.copy_(saved)
            model.fused_decode = fused
            x = model.embed_tokens(tokens[:, None])
            assert fused_decode_applies(model, x, caches["self"], metadata["self"]) == fused
            logits = model._decode_step(tokens[:, None], metadata, caches)
            results.append((logits, [t.clone() for t in tensors]))
    (plain, plain_caches), (fused, fused_caches) = results
    return plain, fused, plain_caches, fused_caches


def _cache_bytes(caches: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([c.reshape(-1).view(torch.uint8) if c.element_size() == 1 else c.reshape(-1).float()
                      for c in caches])


@pytest.mark.parametrize("cache_dtype", [None, torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("scheme", ["tensor", "channel"])
def test_fused_step_on_float8_weights_and_caches_equals_the_layers_step(scheme, cache_dtype) -> None:
    # One rank: each RMSNorm split between the products around it. The split norm rounds differently from
    # the norm module (a tolerance on the logits); in a float8 cache that moves a value across a rounding
    # boundary now and then, so a few stored bytes may differ, by one step of the format.
    model = _fp8_llama(scheme, cache_dtype)
    plain, fused, plain_caches, fused_caches = _plain_and_fused(model, (5, 9, 2))
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4)
    if cache_dtype is None:
        torch.testing.assert_close(fused_caches, plain_caches, rtol=1e-5, atol=1e-5)
        return
    differ = _cache_bytes(fused_caches) != _cache_bytes(plain_caches)
    assert differ.float().mean() < 0.01
    for f, p in zip(fused_caches, plain_caches, strict=True):
        step = (p.view(torch.uint8).int() - f.view(torch.uint8).int()).abs()
        assert step.max() <= 1
    assert (_cache_bytes(plain_caches) != 0).any()  # the step wrote something


def test_block_scales_decode_through_the_layers() -> None:
    # Block scales vary along in_features, which the kernels' per-feature scale cannot take.
    model = _fp8_llama("block", torch.float8_e4m3fn)
    model.fused_decode = True
    caches, tokens, metadata = _prefilled(model, (3, 2))
    with torch.no_grad():
        assert not fused_decode_applies(model, model.embed_tokens(tokens[:, None]), caches["self"],
                                        metadata["self"])
    qkv_proj = model.layers[0].self_attn.qkv_proj
    assert qkv_proj.quant_method.row_scales(qkv_proj) is None
    # A method whose decode product is not the decode kernel quantizes the activations on a GPU: not fused
    # there, fused on the CPU (where the layers multiply by the dequantized weight).
    model = _fp8_llama("channel", None)
    set_method = Fp8LinearMethod("channel")
    for layer in model.modules():
        if getattr(layer, "quant_method", None) is not None:
            layer.quant_method = set_method
    model.fused_decode = True
    caches, tokens, metadata = _prefilled(model, (3, 2))
    with torch.no_grad():
        assert fused_decode_applies(model, model.embed_tokens(tokens[:, None]), caches["self"],
                                    metadata["self"])


def _steps_at_tp2(scheme: str, cache_dtype: torch.dtype | None) -> tuple:
    from tpkit.parallel_layers import init_tensor_parallel

    tp = init_tensor_parallel(2)
    model = _fp8_llama(scheme, cache_dtype, tp_group=tp)
    plain, fused, plain_caches, fused_caches = _plain_and_fused(model, (4, 7))
    return plain, fused, _cache_bytes(plain_caches), _cache_bytes(fused_caches)


@pytest.mark.parametrize("scheme,cache_dtype", [("tensor", torch.float8_e4m3fn), ("channel", None),
                                                ("channel", torch.float8_e4m3fn)], ids=str)
def test_fused_step_on_float8_at_tp2_equals_the_layers_step(ranks, scheme, cache_dtype) -> None:
    # Across ranks the norms stay modules: the qkv product is the layers' own, the caches equal bit for bit.
    for plain, fused, plain_caches, fused_caches in ranks.run(2, _steps_at_tp2, scheme, cache_dtype):
        torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
        assert torch.equal(fused_caches, plain_caches)


@pytest.mark.parametrize("scheme", ["tensor", "channel"])
def test_fused_step_on_float8_compiles_without_graph_breaks(scheme) -> None:
    # generate(compile=True) compiles the decode step: the scales' expansion and the float8 cache's scales
    # must trace too (fullgraph=True fails on any break). Same logits as the eager step.
    model = _fp8_llama(scheme, torch.float8_e4m3fn)
    model.fused_decode = True
    caches, tokens, metadata = _prefilled(model, (6, 3))
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model._decode_step(tokens[:, None], metadata, caches)
        compiled = torch.compile(model._decode_step, fullgraph=True, backend="eager")
        logits = compiled(tokens[:, None], metadata, caches)
    torch.testing.assert_close(logits, eager)
