"""The CUDA decode linear kernel against a float32 product of the same tensors.

Skipped without a GPU. The kernel is called directly through ``tpkit.ops._extension`` (which must build and
take the tensors: a test fails rather than silently checking the F.linear fallback), for every split of
``in_features`` over a block's warps, and through ``decode_linear``: under ``torch.compile``, in a CUDA
graph, in the fallbacks, in a model's layers and in its fused decode step.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cuda_graphs import capture

from tpkit.models import LlamaForCausalLM, fused_decode
from tpkit.models.fused_decode import fused_decode_applies
from tpkit.ops import (
    _extension,
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
    RowParallelLinear,
    TPGroup,
    set_linear_op,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DTYPES = (torch.float16, torch.bfloat16)
# Relative to the largest output: the float32 sum rounded once to the dtype.
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2}


def _operands(num_rows: int, out_features: int, in_features: int, dtype: torch.dtype, *, bias: bool,
              seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, in_features, generator=g)  # [num_rows, in_features]
    # [out_features, in_features]
    w = torch.randn(out_features, in_features, generator=g) / in_features ** 0.5
    b = torch.randn(out_features, generator=g) if bias else None  # [out_features]
    return (x.to("cuda", dtype), w.to("cuda", dtype), None if b is None else b.to("cuda", dtype))


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.float(), w.float(), None if b is None else b.float())


def _assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    scale = ref.abs().max().item()
    err = (out.float() - ref).abs().max().item()
    assert err <= TOLERANCE[dtype] * scale, f"max error {err:.3g} against a largest output of {scale:.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=["float16", "bfloat16"])
@pytest.mark.parametrize("num_rows", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("out_features,in_features", [(8, 32), (24, 96), (1040, 4096), (136, 14336)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_float32(dtype: torch.dtype, num_rows: int, out_features: int, in_features: int,
                                bias: bool) -> None:
    x, w, b = _operands(num_rows, out_features, in_features, dtype, bias=bias)
    out = torch.full((num_rows, out_features), float("nan"), device="cuda", dtype=dtype)
    assert _extension.decode_linear(out, x, w, b)
    _assert_close(out, _reference(x, w, b), dtype)


@pytest.mark.parametrize("splits", [1, 2, 4, 8])
@pytest.mark.parametrize("num_rows", [5, 12])
def test_every_split_gives_the_product(splits: int, num_rows: int) -> None:
    # in_features 1056 = 33 steps of 32: shares of unequal length for every split.
    x, w, b = _operands(num_rows, 200, 1056, torch.bfloat16, bias=True, seed=splits)
    out = torch.empty(num_rows, 200, device="cuda", dtype=torch.bfloat16)
    assert _extension.decode_linear(out, x, w, b, splits)
    _assert_close(out, _reference(x, w, b), torch.bfloat16)


def test_strided_rows_and_weight_slices() -> None:
    # The input's rows are a column slice of a wider tensor, the weight a slice of rows of a bigger matrix
    # (QKVCrossParallelLinear's q and kv parts), the output a column slice too.
    x_wide, w_all, _ = _operands(8, 320, 512, torch.float16, bias=False)
    x_wide = torch.cat([x_wide, x_wide[:, :64]], dim=1)  # [8, 576]
    x, w = x_wide[:, :512], w_all[64:]
    out_wide = torch.zeros(8, 384, device="cuda", dtype=torch.float16)
    out = out_wide[:, 64:320]
    assert _extension.decode_linear(out, x, w, None)
    _assert_close(out, _reference(x, w, None), torch.float16)
    assert out_wide[:, :64].eq(0).all() and out_wide[:, 320:].eq(0).all()


@pytest.mark.parametrize("case", [
    "17 rows", "float32", "in_features 48", "out_features 12", "unaligned input"])
def test_kernel_declines_what_it_does_not_take(case: str) -> None:
    num_rows, out_features, in_features, dtype = 8, 64, 256, torch.bfloat16
    if case == "17 rows":
        num_rows = 17
    elif case == "float32":
        dtype = torch.float32
    elif case == "in_features 48":
        in_features = 48
    elif case == "out_features 12":
        out_features = 12
    x, w, b = _operands(num_rows, out_features, in_features + 8, dtype, bias=True)
    w = w[:, :in_features].contiguous()
    # A column offset of 8 elements keeps 16-byte rows; of 1 element it does not.
    x = x[:, 1:in_features + 1] if case == "unaligned input" else x[:, 8:in_features + 8]
    out = torch.empty(num_rows, out_features, device="cuda", dtype=dtype)
    assert not _extension.decode_linear(out, x, w, b)
    # decode_linear falls back to F.linear for the same tensors.
    torch.testing.assert_close(decode_linear(x, w, b), F.linear(x, w, b))


def test_bad_arguments_raise() -> None:
    x, w, _ = _operands(4, 64, 256, torch.bfloat16, bias=False)
    with pytest.raises(ValueError, match="weight"):
        _extension.decode_linear(torch.empty(4, 64, device="cuda", dtype=torch.bfloat16), x, w[:, :128], None)
    with pytest.raises(ValueError, match="out: expected BFloat16 \\[4, 64\\]"):
        _extension.decode_linear(torch.empty(4, 32, device="cuda", dtype=torch.bfloat16), x, w, None)
    with pytest.raises(ValueError, match="bias"):
        _extension.decode_linear(torch.empty(4, 64, device="cuda", dtype=torch.bfloat16), x, w,
                            torch.zeros(32, device="cuda", dtype=torch.bfloat16))


def test_decode_linear_leading_dims_and_autograd() -> None:
    x, w, b = _operands(6, 96, 128, torch.bfloat16, bias=True)
    x3 = x.view(2, 3, 128)
    out = decode_linear(x3, w, b)
    assert out.shape == (2, 3, 96)
    _assert_close(out.view(6, 96), _reference(x, w, b), torch.bfloat16)
    # With gradients wanted the product is F.linear's, so backward works.
    w.requires_grad_(True)
    decode_linear(x3, w, b).float().square().sum().backward()
    w_ref = w.detach().clone().requires_grad_(True)
    F.linear(x3, w_ref, b).float().square().sum().backward()
    torch.testing.assert_close(w.grad, w_ref.grad)


def test_compiled_and_graph_replay() -> None:
    x, w, b = _operands(8, 512, 1024, torch.bfloat16, bias=True)
    compiled = torch.compile(lambda t: torch.relu(decode_linear(t * 2, w, b)), fullgraph=True)
    expected = torch.relu(_reference(x * 2, w, b))
    _assert_close(compiled(x), expected, torch.bfloat16)
    static_x = x.clone()
    graph, static_out = capture(lambda: decode_linear(static_x, w, b))
    x2, _, _ = _operands(8, 512, 1024, torch.bfloat16, bias=False, seed=7)
    static_x.copy_(x2)
    graph.replay()
    _assert_close(static_out, _reference(x2, w, b), torch.bfloat16)


@torch.no_grad()
def test_layers_with_decode_linear() -> None:
    # tp_size 1 layers of every kind, once with F.linear and once with decode_linear, on decode-sized input.
    torch.manual_seed(0)
    # One process (also under torchrun, whose world is not this test's group).
    factory = {"params_dtype": torch.bfloat16, "device": "cuda", "tp_group": TPGroup(None, 0, 1)}
    layers = torch.nn.ModuleDict({
        "column": ColumnParallelLinear(256, 512, bias=True, **factory),
        "merged": MergedColumnParallelLinear(256, [384, 384], bias=False, **factory),
        "row": RowParallelLinear(512, 256, bias=True, **factory),
        "cross": QKVCrossParallelLinear(256, 64, 4, 2, bias=True, **factory),
        "lm_head": ParallelLMHead(1000, 256, **factory),
    })
    x = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    enc = torch.randn(8, 256, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(8, 512, device="cuda", dtype=torch.bfloat16)

    def run() -> list[torch.Tensor]:
        q, k, v = layers["cross"](x, enc)
        return [layers["column"](x), layers["merged"](x), layers["row"](h), q, k, v, layers["lm_head"](x)]

    expected = run()
    assert set_linear_op(layers, decode_linear) == 5
    for out, ref in zip(run(), expected, strict=True):
        _assert_close(out, ref.float(), torch.bfloat16)


def _silu_and_mul_reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    # gate and up rounded to the dtype, as the plain product's output; silu(gate) * up in float32.
    gate, up = _reference(x, w, b).to(x.dtype).float().chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("dtype", DTYPES, ids=["float16", "bfloat16"])
@pytest.mark.parametrize("num_rows", [1, 8, 9, 16])
@pytest.mark.parametrize("features,in_features", [(8, 32), (520, 4096), (7168, 1024)])
@pytest.mark.parametrize("bias", [False, True])
def test_silu_and_mul_matches_float32(dtype: torch.dtype, num_rows: int, features: int, in_features: int,
                                      bias: bool) -> None:
    x, w, b = _operands(num_rows, 2 * features, in_features, dtype, bias=bias)
    out = torch.full((num_rows, features), float("nan"), device="cuda", dtype=dtype)
    assert _extension.decode_linear(out, x, w, b, 0, True)
    _assert_close(out, _silu_and_mul_reference(x, w, b), dtype)
    torch.testing.assert_close(decode_linear_silu_and_mul(x, w, b), out, rtol=0, atol=0)


@pytest.mark.parametrize("splits", [1, 2, 4, 8])
def test_silu_and_mul_every_split(splits: int) -> None:
    x, w, b = _operands(12, 2 * 264, 2048, torch.bfloat16, bias=True, seed=splits)
    out = torch.empty(12, 264, device="cuda", dtype=torch.bfloat16)
    assert _extension.decode_linear(out, x, w, b, splits, True)
    _assert_close(out, _silu_and_mul_reference(x, w, b), torch.bfloat16)


def test_silu_and_mul_declines_and_rejects() -> None:
    # 12 features: not a multiple of 8, so the kernel says no and the wrapper computes it with F.linear.
    x, w, b = _operands(4, 24, 256, torch.bfloat16, bias=True)
    out = torch.empty(4, 12, device="cuda", dtype=torch.bfloat16)
    assert not _extension.decode_linear(out, x, w, b, 0, True)
    gate, up = F.linear(x, w, b).chunk(2, dim=-1)
    torch.testing.assert_close(decode_linear_silu_and_mul(x, w, b), F.silu(gate) * up)
    with pytest.raises(ValueError, match="out: expected BFloat16 \\[4, 12\\]"):
        _extension.decode_linear(torch.empty(4, 24, device="cuda", dtype=torch.bfloat16), x, w, b, 0, True)
    with pytest.raises(ValueError, match="silu_and_mul: expected a weight of an even number of rows"):
        _extension.decode_linear(torch.empty(4, 11, device="cuda", dtype=torch.bfloat16), x, w[:23], None, 0,
                                 True)


def _small_llama_model() -> LlamaForCausalLM:
    config = {"hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 1,
              "num_attention_heads": 8,
              "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 64}
    torch.manual_seed(0)
    return LlamaForCausalLM(config, dtype=torch.bfloat16, device="cuda", tp_group=TPGroup(None, 0, 1))


@torch.no_grad()
def test_llama_mlp_swiglu_in_the_product() -> None:
    # The fused decode step's MLP, SwiGLU in gate_up_proj's kernel, compiled and in a CUDA graph, against the
    # model's MLP multiplying with F.linear.
    mlp = _small_llama_model().layers[0].mlp
    x = torch.randn(8, 1, 1024, device="cuda", dtype=torch.bfloat16)

    def fused_mlp(x: torch.Tensor) -> torch.Tensor:
        gate_up = mlp.gate_up_proj
        return mlp.down_proj(decode_linear_silu_and_mul(x, gate_up.weight, gate_up.bias))

    compiled = torch.compile(fused_mlp, fullgraph=True)
    fused = compiled(x)
    static_x = torch.zeros_like(x)
    graph, static_out = capture(lambda: fused_mlp(static_x))
    static_x.copy_(x)
    graph.replay()
    set_linear_op(mlp, F.linear)
    expected = mlp(x).float()
    _assert_close(fused, expected, torch.bfloat16)
    _assert_close(static_out, expected, torch.bfloat16)


def _rope_cache_operands(num_rows: int, num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
                         *, bias: bool) -> dict[str, torch.Tensor]:
    """A decode step's q, k, v projection operands, random caches of 9 blocks of 16 slots, a slot for
    every row (distinct, in random blocks), the last row's slot -1 (padding)."""
    x, w, b = _operands(num_rows, (num_heads + 2 * num_kv_heads) * head_size, 256, dtype, bias=bias)
    g = torch.Generator().manual_seed(num_rows + head_size)
    angles = torch.rand(num_rows, head_size // 2, generator=g) * 6.28
    caches = torch.randn(2, 9, 16, num_kv_heads, head_size, generator=g).to("cuda", dtype)
    slots = torch.randperm(9 * 16, generator=g)[:num_rows]
    slots[-1] = -1
    return {"input": x, "weight": w, "bias": b, "cos": angles.cos().to("cuda", dtype),
            "sin": angles.sin().to("cuda", dtype), "key_cache": caches[0], "value_cache": caches[1],
            "slot_mapping": slots.to("cuda")}


@pytest.mark.parametrize("dtype", DTYPES, ids=["float16", "bfloat16"])
@pytest.mark.parametrize("num_rows", [2, 8, 9, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(8, 2, 128), (4, 4, 64), (6, 1, 80)])
@pytest.mark.parametrize("bias", [False, True])
def test_qkv_rope_cache_matches_float32(dtype: torch.dtype, num_rows: int, num_heads: int, num_kv_heads: int,
                                        head_size: int, bias: bool) -> None:
    t = _rope_cache_operands(num_rows, num_heads, num_kv_heads, head_size, dtype, bias=bias)
    key_before, value_before = t["key_cache"].clone(), t["value_cache"].clone()
    out = torch.full((num_rows, t["weight"].shape[0]), float("nan"), device="cuda", dtype=dtype)
    assert _extension.decode_qkv_rope_cache(out, **t, num_heads=num_heads)
    # The product rounded to the dtype, then rotated in float32.
    qkv = _reference(t["input"], t["weight"], t["bias"]).to(dtype).float().view(num_rows, -1, head_size)
    rotated = apply_rotary(qkv[None, :, : num_heads + num_kv_heads], t["cos"].float()[None, :, None],
                           t["sin"].float()[None, :, None])[0]
    expected = torch.cat((rotated, qkv[:, num_heads + num_kv_heads:]), dim=1)  # [num_rows, heads, head_size]
    _assert_close(out, expected.flatten(1), dtype)
    # Each row's k and v in its slot; the padding row's and every other slot untouched.
    key_expected, value_expected = key_before.float(), value_before.float()
    for row, slot in enumerate(t["slot_mapping"].tolist()[:-1]):
        key_expected[slot // 16, slot % 16] = expected[row, num_heads: num_heads + num_kv_heads]
        value_expected[slot // 16, slot % 16] = expected[row, num_heads + num_kv_heads:]
    _assert_close(t["key_cache"], key_expected, dtype)
    _assert_close(t["value_cache"], value_expected, dtype)
    written = torch.zeros(9 * 16, dtype=torch.bool)
    written[t["slot_mapping"][:-1].cpu()] = True
    untouched = ~written.view(9, 16).to("cuda")
    assert torch.equal(t["key_cache"][untouched], key_before[untouched])
    assert torch.equal(t["value_cache"][untouched], value_before[untouched])


def test_qkv_rope_cache_wrapper_and_fallback_agree() -> None:
    # decode_qkv_rope_cache on [batch, 1, hidden] with the model's cos, sin [batch, 1, 1, head_size / 2],
    # through the kernel; and through its PyTorch path (head_size 72 is no multiple of 16).
    for head_size, kernel in ((128, True), (72, False)):
        t = _rope_cache_operands(6, 4, 2, head_size, torch.bfloat16, bias=True)
        reference = {k: v.clone() for k, v in t.items() if v is not None}
        out = torch.empty(6, t["weight"].shape[0], device="cuda", dtype=torch.bfloat16)
        assert _extension.decode_qkv_rope_cache(out, **t, num_heads=4) == kernel
        x, cos, sin = t["input"].view(6, 1, 256), t["cos"].view(6, 1, 1, -1), t["sin"].view(6, 1, 1, -1)
        got = decode_qkv_rope_cache(x, t["weight"], t["bias"], cos, sin, t["key_cache"], t["value_cache"],
                                    t["slot_mapping"], 4)
        qkv = F.linear(reference["input"], reference["weight"], reference["bias"]).view(6, -1, head_size)
        cos, sin = reference["cos"][None, :, None], reference["sin"][None, :, None]
        qk = apply_rotary(qkv[None, :, :6], cos, sin)[0]
        expected = torch.cat((qk, qkv[:, 6:]), dim=1)
        _assert_close(got.view(6, -1), expected.flatten(1).float(), torch.bfloat16)
        rows = t["slot_mapping"][:-1]
        _assert_close(t["key_cache"].flatten(0, 1)[rows], expected[:-1, 4:6].float(), torch.bfloat16)
        _assert_close(t["value_cache"].flatten(0, 1)[rows], expected[:-1, 6:].float(), torch.bfloat16)


def test_qkv_rope_cache_rejects_bad_arguments() -> None:
    t = _rope_cache_operands(4, 4, 2, 64, torch.bfloat16, bias=False)
    out = torch.empty(4, 512, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"weight: expected \[\(num_heads \+ 2 \* num_kv_heads\) \* "
                                         r"head_size = 576, in_features\]"):
        _extension.decode_qkv_rope_cache(out, **t, num_heads=5)
    with pytest.raises(ValueError, match=r"decode_qkv_rope_cache: weight: expected"):
        decode_qkv_rope_cache(t["input"], t["weight"], None, t["cos"], t["sin"], t["key_cache"],
                              t["value_cache"], t["slot_mapping"], 5)
    with pytest.raises(ValueError, match=r"cos: expected BFloat16 \[4, 32\], got BFloat16 \[4, 16\]"):
        _extension.decode_qkv_rope_cache(out, **{**t, "cos": t["cos"][:, :16]}, num_heads=4)
    with pytest.raises(ValueError, match=r"slot_mapping: expected Long \[4\], got Int \[4\]"):
        _extension.decode_qkv_rope_cache(out, **{**t, "slot_mapping": t["slot_mapping"].int()}, num_heads=4)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float16", "bfloat16"])
@pytest.mark.parametrize("num_rows", [1, 8, 9, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_residual_norm_matches_float32(dtype: torch.dtype, num_rows: int, bias: bool) -> None:
    # The producer's half of a split RMSNorm: the residual add, x * norm_weight, the rows' sums of squares
    # added to what sums held, zero_sums zeroed.
    x, w, b = _operands(num_rows, 1040, 512, dtype, bias=bias)
    g = torch.Generator().manual_seed(num_rows)
    residual = torch.randn(num_rows, 1040, generator=g).to("cuda", dtype)
    norm_weight = (torch.rand(1040, generator=g) + 0.5).to("cuda", dtype)
    sums_before = torch.rand(num_rows, generator=g, dtype=torch.float64).cuda()
    sums, zero_sums = sums_before.clone(), torch.randn(num_rows, device="cuda", dtype=torch.float64)
    out = torch.full((num_rows, 1040), float("nan"), device="cuda", dtype=dtype)
    normed = torch.full_like(out, float("nan"))
    assert _extension.decode_linear_residual_norm(out, normed, x, w, b, residual, norm_weight, sums,
                                                  zero_sums)
    # The product rounded to the dtype, the sum with the residual rounded once.
    _assert_close(out, (_reference(x, w, b).to(dtype).float() + residual.float()), dtype)
    assert torch.equal(normed, (out.float() * norm_weight.float()).to(dtype))
    torch.testing.assert_close(sums, sums_before + out.double().square().sum(-1), rtol=1e-6, atol=1e-6)
    assert torch.equal(zero_sums, torch.zeros_like(zero_sums))


@pytest.mark.parametrize("dtype", DTYPES, ids=["float16", "bfloat16"])
@pytest.mark.parametrize("num_rows", [2, 9])
def test_rms_sums_scale_the_products(dtype: torch.dtype, num_rows: int) -> None:
    # The consumer's half: each row's product times rsqrt(rms_sums / in_features + eps), before the bias and
    # the epilogue, in the plain, SwiGLU and RoPE + cache kernels.
    eps = 1e-5
    x, w, b = _operands(num_rows, 96, 256, dtype, bias=True)
    rms_sums = torch.rand(num_rows, device="cuda", dtype=torch.float64) * 256 + 1
    scale = torch.rsqrt(rms_sums.float() / 256 + eps)[:, None]  # [num_rows, 1]
    out = torch.empty(num_rows, 96, device="cuda", dtype=dtype)
    assert _extension.decode_linear(out, x, w, b, rms_sums=rms_sums, eps=eps)
    expected = _reference(x, w, None) * scale + b.float()
    _assert_close(out, expected, dtype)
    swiglu = torch.empty(num_rows, 48, device="cuda", dtype=dtype)
    assert _extension.decode_linear(swiglu, x, w, b, silu_and_mul=True, rms_sums=rms_sums, eps=eps)
    gate, up = expected.to(dtype).float().chunk(2, dim=-1)
    _assert_close(swiglu, F.silu(gate) * up, dtype)

    t = _rope_cache_operands(num_rows, 4, 2, 64, dtype, bias=True)
    plain = {k: v.clone() for k, v in t.items() if v is not None}
    qkv = torch.empty(num_rows, t["weight"].shape[0], device="cuda", dtype=dtype)
    assert _extension.decode_qkv_rope_cache(qkv, **t, num_heads=4, rms_sums=rms_sums, eps=eps)
    # The same step on the input rows scaled beforehand (in float32, then rounded once).
    plain["input"] = (plain["input"].float() * scale).to(dtype)
    expected_qkv = torch.empty_like(qkv)
    assert _extension.decode_qkv_rope_cache(expected_qkv, **plain, num_heads=4)
    _assert_close(qkv, expected_qkv.float(), dtype)
    _assert_close(t["key_cache"], plain["key_cache"].float(), dtype)
    _assert_close(t["value_cache"], plain["value_cache"].float(), dtype)


def test_residual_norm_rejects_bad_arguments() -> None:
    x, w, b = _operands(4, 64, 128, torch.bfloat16, bias=False)
    residual, norm_weight = torch.randn_like(x[:, :64]), torch.ones(64, device="cuda", dtype=torch.bfloat16)
    sums = torch.zeros(4, device="cuda", dtype=torch.float64)
    zero_sums = torch.zeros_like(sums)
    out, normed = torch.empty_like(residual), torch.empty_like(residual)
    with pytest.raises(ValueError, match=r"residual: expected BFloat16 \[4, 64\], got BFloat16 \[4, 32\]"):
        _extension.decode_linear_residual_norm(out, normed, x, w, b, residual[:, :32], norm_weight, sums,
                                          zero_sums)
    with pytest.raises(ValueError, match=r"sums: expected Double \[4\], got BFloat16 \[4\]"):
        _extension.decode_linear_residual_norm(out, normed, x, w, b, residual, norm_weight, sums.bfloat16(),
                                          zero_sums)
    with pytest.raises(ValueError, match="zero_sums: expected another buffer than sums"):
        torch.ops.tpkit.decode_linear_residual_norm(x, w, b, residual, norm_weight, sums, sums)
    with pytest.raises(ValueError, match=r"rms_sums: expected Double \[4\], got Double \[3\]"):
        _extension.decode_linear(out, x, w, b, rms_sums=sums[:3], eps=1e-5)
    with pytest.raises(ValueError, match=r"decode_linear_residual_norm: norm_weight: expected \(64,\)"):
        decode_linear_residual_norm(x, w, b, residual, norm_weight[:32], sums, zero_sums)


@torch.inference_mode()
def test_llama_decode_steps_with_the_norms_in_the_products() -> None:
    # Three layers' decode steps with each RMSNorm split between the products around it (the sums' two
    # buffers taking turns through the layers): replayed from a CUDA graph of the compiled step, the greedy
    # tokens of the eager steps; one step's logits and caches against the step with F.linear products and
    # the norms as modules.
    config = {"hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 3,
              "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 256,
              "max_position_embeddings": 64}
    torch.manual_seed(0)
    model = LlamaForCausalLM(config, dtype=torch.bfloat16, device="cuda", tp_group=TPGroup(None, 0, 1)).eval()
    for name, param in model.named_parameters():
        if "norm" in name:
            param.uniform_(0.5, 1.5)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (5, 17, 33, 8)]
    fused = model.generate(prompts, 6, ignore_eos=True)
    graphed = model.generate(prompts, 6, ignore_eos=True, cuda_graph=True, compile=True)
    assert graphed == fused
    # Reproducible: the sums of squares do not depend on the order the kernels' blocks add them in.
    assert model.generate(prompts, 6, ignore_eos=True, cuda_graph=True, compile=True) == graphed
    caches = model._reserve_kv_caches(model._plan_kv_cache([len(p) for p in prompts], 2))
    tokens = model._prefill(prompts, caches).argmax(-1)
    metadata = model._decode_metadata(caches, [0, 1, 2, 3])
    x = model.embed_tokens(tokens[:, None])
    before = [t.clone() for t in _cache_tensors(caches)]
    assert fused_decode_applies(model, x, caches["self"], metadata["self"])
    step = model._decode_step(tokens[:, None], metadata, caches).float()
    split_caches = [t.clone() for t in _cache_tensors(caches)]
    for t, saved in zip(_cache_tensors(caches), before, strict=True):
        t.copy_(saved)
    model.fused_decode = False
    set_linear_op(model, F.linear)
    assert not fused_decode_applies(model, x, caches["self"], metadata["self"])
    _assert_close(step, model._decode_step(tokens[:, None], metadata, caches).float(), torch.bfloat16)
    for t, got in zip(_cache_tensors(caches), split_caches, strict=True):
        _assert_close(got, t.float(), torch.bfloat16)


@torch.inference_mode()
def test_llama_decode_layers_rope_and_cache_in_the_product() -> None:
    # The fused decode step's layers as they run at tp_size > 1 (RoPE and the cache write in qkv_proj's
    # kernel, SwiGLU in gate_up_proj's, the norms as modules), here on one GPU, against the step with F.linear
    # products through the layers' forward (the model's rotation and reshape_and_cache): logits and caches.
    model = _small_llama_model()
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in (5, 17, 33)]
    caches = model._reserve_kv_caches(model._plan_kv_cache([len(p) for p in prompts], 2))
    tokens = model._prefill(prompts, caches).argmax(-1)
    metadata = model._decode_metadata(caches, [0, 1, 2])
    before = [t.clone() for t in _cache_tensors(caches)]
    x = model.embed_tokens(tokens[:, None])  # [batch, 1, hidden]
    assert fused_decode_applies(model, x, caches["self"], metadata["self"])
    cos, sin = model.rotary_emb.cos_sin((metadata["self"].seq_lens.long() - 1)[:, None], x.dtype)
    for layer in model.layers:
        x = fused_decode._layer(layer, x, cos, sin, caches["self"], metadata["self"])
    fused = model.compute_logits(model.norm(x)[:, 0]).float()
    fused_caches = [t.clone() for t in _cache_tensors(caches)]
    for t, saved in zip(_cache_tensors(caches), before, strict=True):
        t.copy_(saved)
    model.fused_decode = False
    set_linear_op(model, F.linear)
    _assert_close(fused, model._decode_step(tokens[:, None], metadata, caches).float(), torch.bfloat16)
    for t, got in zip(_cache_tensors(caches), fused_caches, strict=True):
        _assert_close(got, t.float(), torch.bfloat16)


def _cache_tensors(caches: dict) -> list[torch.Tensor]:
    return [t for cache in caches.values() for t in (*cache.key_caches, *cache.value_caches)]
