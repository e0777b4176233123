"""Float8 weights in the parallel linear layers: per-tensor (kept per q/k/v and gate/up part), per-channel
and 128x128-style block scales, loaded by the layers' weight loaders at tp 1 and 2 from full checkpoint
tensors, against float64 products of the dequantized full weights; quantize-on-load; bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tpkit.parallel_layers import (
    Fp8LinearMethod,
    MergedColumnParallelLinear,
    QKVCrossParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    process_weights_after_loading,
    set_quant_method,
)

FP8 = torch.float8_e4m3fn
BLOCK = (32, 32)


def quantize(w: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint's float8 weight and scale of w [rows, columns], element by element from the scale's
    definition (not tpkit's code): per tensor a scale of shape [1], per channel [rows, 1], per block
    [row_tiles, column_tiles]."""
    rows, columns = w.shape
    if scheme == "tensor":
        scale = (w.abs().max() / 448).reshape(1)
        expanded = scale.expand(rows, columns)
    elif scheme == "channel":
        scale = w.abs().amax(1, keepdim=True) / 448
        expanded = scale.expand(rows, columns)
    else:
        tiles = (-(-rows // BLOCK[0]), -(-columns // BLOCK[1]))
        scale = torch.empty(tiles)
        expanded = torch.empty(rows, columns)
        for i in range(tiles[0]):
            for j in range(tiles[1]):
                tile = (slice(i * BLOCK[0], (i + 1) * BLOCK[0]), slice(j * BLOCK[1], (j + 1) * BLOCK[1]))
                scale[i, j] = w[tile].abs().max() / 448
                expanded[tile] = scale[i, j]
    return (w / expanded).to(FP8), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, scheme: str) -> torch.Tensor:
    if scheme != "block":
        return q.double() * scale.double()
    rows, columns = q.shape
    return q.double() * scale.double().repeat_interleave(BLOCK[0], 0)[:rows].repeat_interleave(
        BLOCK[1], 1)[:, :columns]


def _load(layer, name, tensor, shard_id=None):
    param = getattr(layer, name)
    param.weight_loader(param, tensor, shard_id)


def _check_shard_parts(layer, name, checkpoint):
    """Every ShardPart of the layer's parameter ``name`` is where the checkpoint tensors (by shard id) hold
    its values: what tpkit.checkpoint saves and loads at any tp_size."""
    param = getattr(layer, name)
    for part in layer.shard_parts(param):
        full = checkpoint[part.shard_id]
        if part.dim is None:
            continue
        assert tuple(full.shape) == part.shape
        assert torch.equal(param.narrow(part.dim, part.param_start, part.length),
                           full.narrow(part.dim, part.start, part.length))


def _check_fp8_layers(tp_size: int) -> None:
    from tpkit.parallel_layers import init_tensor_parallel

    tp = init_tensor_parallel(tp_size)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen)
    for scheme in ("tensor", "channel", "block"):
        method = Fp8LinearMethod(scheme, block_size=BLOCK)
        scale_name = "weight_scale_inv" if scheme == "block" else "weight_scale"
        # q, k, v of 4 heads (2 KV heads) of 32, each part its own checkpoint tensor and scale; the parts'
        # magnitudes differ, so one scale for all would not reproduce them.
        parts = {name: torch.randn(rows, 64, generator=gen) * size
                 for name, rows, size in (("q", 128, 1.0), ("k", 64, 4.0), ("v", 64, 0.25))}
        quantized = {name: quantize(w, scheme) for name, w in parts.items()}
        qkv = QKVParallelLinear(64, 32, 4, 2, bias=False, quant_method=method)
        for name, (q, s) in quantized.items():
            _load(qkv, "weight", q, name)
            _load(qkv, scale_name, s, name)
        full = {name: dequantize(q, s, scheme) for name, (q, s) in quantized.items()}
        rows = [full["q"][tp.rank * 128 // tp_size:][:128 // tp_size],
                full["k"][tp.rank * 32:][:64 // tp_size], full["v"][tp.rank * 32:][:64 // tp_size]]
        torch.testing.assert_close(qkv(x).double(), x.double() @ torch.cat(rows).T, rtol=1e-5, atol=1e-5)
        if scheme != "tensor":
            _check_shard_parts(qkv, scale_name, {name: s for name, (_, s) in quantized.items()})
        else:
            assert [p.dim for p in qkv.shard_parts(qkv.weight_scale)] == [None]
        cross = QKVCrossParallelLinear(64, 32, 4, 2, bias=False, quant_method=method)
        cross.load_state_dict(qkv.state_dict())
        q_out, k_out, _ = cross(x, x[:2])
        torch.testing.assert_close(q_out.double(), x.double() @ rows[0].T, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k_out.double(), x[:2].double() @ rows[1].T, rtol=1e-5, atol=1e-5)

        # gate/up, loaded as one fused tensor where the scheme allows it (a per-tensor scale is one a part).
        gate, up = (torch.randn(64, 64, generator=gen) * size for size in (1.0, 3.0))
        merged = MergedColumnParallelLinear(64, [64, 64], bias=True, quant_method=method)
        merged.bias.data.zero_()
        (gq, gs), (uq, us) = quantize(gate, scheme), quantize(up, scheme)
        for index, (q, s) in enumerate(((gq, gs), (uq, us))):
            _load(merged, "weight", q, index)
            _load(merged, scale_name, s, index)
        half = 64 // tp_size
        expected = torch.cat([dequantize(gq, gs, scheme)[tp.rank * half:][:half],
                              dequantize(uq, us, scheme)[tp.rank * half:][:half]])
        torch.testing.assert_close(merged(x).double(), x.double() @ expected.T, rtol=1e-5, atol=1e-5)

        # Row-parallel: columns split, the scales of whole rows (or column tiles) on every rank.
        down = torch.randn(48, 64, generator=gen)
        dq, ds = quantize(down, scheme)
        row = RowParallelLinear(64, 48, bias=False, quant_method=method)
        _load(row, "weight", dq)
        _load(row, scale_name, ds)
        _check_shard_parts(row, scale_name, {None: ds})
        columns = 64 // tp_size
        out = row(x[:, tp.rank * columns:][:, :columns])
        torch.testing.assert_close(out.double(), x.double() @ dequantize(dq, ds, scheme).T, rtol=1e-5,
                                   atol=1e-5)

        replicated = ReplicatedLinear(64, 48, bias=False, quant_method=method)
        _load(replicated, "weight", dq)
        _load(replicated, scale_name, ds)
        torch.testing.assert_close(replicated(x).double(), x.double() @ dequantize(dq, ds, scheme).T,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_fp8_scales_shard_with_their_rows_and_columns(ranks, tp_size):
    ranks.run(tp_size, _check_fp8_layers, tp_size)


def test_quantize_on_load_and_random_init_quantize_per_channel():
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=gen).bfloat16()
    layer = MergedColumnParallelLinear(64, [32, 64], bias=False, params_dtype=torch.bfloat16,
                                       quant_method=Fp8LinearMethod(quantize_on_load=True))
    assert layer.weight.dtype == torch.bfloat16
    _load(layer, "weight", w)
    process_weights_after_loading(layer)
    assert layer.weight.dtype == FP8 and layer.weight_scale.shape == (96, 1)
    q, s = quantize(w.float(), "channel")
    assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8))
    x = torch.randn(3, 64, generator=gen).bfloat16()
    expected = F.linear(x, dequantize(q, s, "channel").bfloat16())  # a bf16 model of the dequantized weight
    assert torch.equal(layer(x), expected)
    # A layer given a method after it was built quantizes its (random) weight the same way.
    plain = ReplicatedLinear(64, 32, bias=False)
    before = plain.weight.detach().clone()
    assert set_quant_method(plain, Fp8LinearMethod("block", block_size=BLOCK)) == 1
    torch.testing.assert_close(plain.weight.float() * plain.weight_scale_inv.repeat_interleave(32, 0)
                               .repeat_interleave(32, 1), before, rtol=2 ** -4, atol=0)


def test_bad_fp8_input_is_named():
    with pytest.raises(ValueError, match=r"weight_scheme: expected one of \['tensor', 'channel', 'block'\], "
                                         r"got 'row'"):
        Fp8LinearMethod("row")
    with pytest.raises(ValueError, match=r"block_size: expected two positive ints, got \(128,\)"):
        Fp8LinearMethod("block", block_size=(128,))
    layer = QKVParallelLinear(64, 32, 4, 2, bias=False, quant_method=Fp8LinearMethod("tensor"))
    with pytest.raises(ValueError, match=r"QKVParallelLinear.weight\['q'\]: expected a torch.float8_e4m3fn "
                                         r"checkpoint tensor .* received torch.bfloat16"):
        _load(layer, "weight", torch.zeros(128, 64, dtype=torch.bfloat16), "q")
    with pytest.raises(ValueError, match=r"weight_scale\['k'\]: expected a per-tensor scale of shape \(\) or "
                                         r"\(1,\), received \(64, 1\)"):
        _load(layer, "weight_scale", torch.ones(64, 1), "k")
    with pytest.raises(ValueError, match=r"loaded_shard_id must be one of \['q', 'k', 'v'\], received 'x'"):
        _load(layer, "weight_scale", torch.ones(1), "x")
    channel = QKVParallelLinear(64, 32, 4, 2, bias=False, quant_method=Fp8LinearMethod("channel"))
    with pytest.raises(ValueError, match=r"weight_scale\['v'\]: expected a checkpoint tensor of shape "
                                         r"\(64, 1\), received \(64,\)"):
        _load(channel, "weight_scale", torch.ones(64), "v")
    with pytest.raises(ValueError, match=r"block-wise float8 weights: this rank's rows \[0, 32\) of logical "
                                         r"tensor 1 \(at 48 in the weight\) must start at a multiple of the "
                                         r"block size 32"):
        MergedColumnParallelLinear(64, [48, 32], bias=False, quant_method=Fp8LinearMethod("block",
                                                                                           block_size=BLOCK))


def test_decode_linear_fp8_op_and_its_cpu_fallback():
    """The op's PyTorch implementation is the dequantized product; the wrapper declines (None) where the
    kernel cannot run, here on the CPU, and the method then multiplies the dequantized weight."""
    from tpkit.ops import decode_linear_fp8

    gen = torch.Generator().manual_seed(2)
    w, x = torch.randn(64, 96, generator=gen), torch.randn(4, 96, generator=gen).bfloat16()
    q, s = quantize(w, "channel")
    bias = torch.randn(64, generator=gen).bfloat16()
    expected = F.linear(x, dequantize(q, s, "channel").bfloat16(), bias)
    assert torch.equal(torch.ops.tpkit.decode_linear_fp8(x, q, s.view(-1), bias), expected)
    torch.library.opcheck(torch.ops.tpkit.decode_linear_fp8.default, (x, q, s.view(-1), bias),
                          test_utils=("test_autograd_registration", "test_faketensor"))
    assert decode_linear_fp8(x, q, s.view(-1), bias) is None
    layer = ReplicatedLinear(96, 64, params_dtype=torch.bfloat16,
                             quant_method=Fp8LinearMethod(decode_op=decode_linear_fp8))
    _load(layer, "weight", q)
    _load(layer, "weight_scale", s)
    layer.bias.data.copy_(bias)
    assert torch.equal(layer(x), expected)


def _quantizations() -> dict:
    """The per-token quantization: its PyTorch implementation, and tpkit's op (on the CPU, that
    implementation)."""
    from tpkit.ops import quantize_per_token_fp8
    from tpkit.ops.fp8_quantize import _quantize_reference

    return {"reference": _quantize_reference, "op": quantize_per_token_fp8}


@pytest.mark.parametrize("via", ["reference", "op"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_per_token_activation_quantization_bit_for_bit(dtype, via):
    """The float8 product's activations, quantized per token (dynamic, with an upper bound, or a static
    scale), bit for bit as the scale's definition gives them element by element in float32: a token's amax
    over 448, the quotient saturated. Rows of zeros, of large values, with NaN (which stays NaN) and with
    infinities among them; by the PyTorch implementation and through tpkit's op."""
    quantize = _quantizations()[via]
    gen = torch.Generator().manual_seed(7)
    rows = (torch.randn(9, 200, generator=gen) * torch.logspace(-3, 3, 9)[:, None]).to(dtype)
    rows[2] = 0.0
    rows[5, 17] = float("nan")
    rows[7, 3], rows[7, 4] = float("inf"), -float("inf")
    cases = [(None, None), (None, 50.0), (torch.tensor([0.25]), None)]
    for input_scale, bound in cases:
        quantized, scale = quantize(rows, input_scale, bound)
        expected_scale = torch.empty(9, 1)
        for t in range(9):
            if input_scale is not None:
                expected_scale[t] = input_scale.float()
                continue
            amax = max(abs(float(v)) for v in rows[t].float()) if not rows[t].isnan().any() else float("nan")
            amax = min(amax, bound) if bound is not None and amax == amax else amax
            expected_scale[t] = max(amax / 448.0, 1e-12) if amax == amax else amax
        assert torch.equal(scale.isnan(), expected_scale.isnan())
        assert torch.equal(scale.nan_to_num(-1.0), expected_scale.nan_to_num(-1.0))
        expected = (rows.float() / expected_scale).clamp(-448.0, 448.0).to(FP8)
        same = quantized.view(torch.uint8) == expected.view(torch.uint8)
        assert (same | (quantized.float().isnan() & expected.float().isnan())).all()
        assert quantized[5].float().isnan().all() if input_scale is None else quantized[5, 17].float().isnan()


def test_quantize_per_token_fp8_op_on_the_cpu():
    """tpkit's op on the CPU: its PyTorch implementation for rows with any strides (a row-strided view, a
    transposed one) and 0 rows, schema and fake implementation (opcheck), a compiled trace, argument checks;
    its scale is a new tensor even where it is the static input_scale's one value."""
    from tpkit.ops import quantize_per_token_fp8
    from tpkit.ops.fp8_quantize import _quantize_reference

    gen = torch.Generator().manual_seed(8)
    wide = (torch.randn(6, 48, generator=gen) * 30).bfloat16()
    static = torch.tensor(0.05)
    for rows in (wide[:, 8:40], wide[:, :6].t(), wide[:0, :16]):
        for input_scale, bound in ((None, None), (None, 20.0), (static, None)):
            quantized, scale = quantize_per_token_fp8(rows, input_scale, bound)
            expected, expected_scale = _quantize_reference(rows, input_scale, bound)
            assert quantized.shape == rows.shape and scale.shape == (rows.shape[0], 1)
            assert torch.equal(quantized.view(torch.uint8), expected.view(torch.uint8))
            assert torch.equal(scale, expected_scale)
    one = static.reshape(1)
    _, scale = quantize_per_token_fp8(wide[:1], one)
    assert scale.untyped_storage().data_ptr() != one.untyped_storage().data_ptr()
    for args in ((wide[:, :16],), (wide[:, :16], static), (wide[:, :16], None, 20.0)):
        torch.library.opcheck(torch.ops.tpkit.quantize_per_token_fp8.default, args)
    compiled = torch.compile(quantize_per_token_fp8, backend="aot_eager", fullgraph=True)
    eager = quantize_per_token_fp8(wide, None, 20.0)
    for got, expected in zip(compiled(wide, None, 20.0), eager, strict=True):
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    with pytest.raises(ValueError, match=r"quantize_per_token_fp8: input: expected \[num_rows, features\], "
                                         r"got shape \[2, 6, 24\]"):
        quantize_per_token_fp8(wide.view(2, 6, 24))
    with pytest.raises(TypeError, match=r"quantize_per_token_fp8: input: expected dtype one of"):
        quantize_per_token_fp8(wide.to(torch.int32))
    with pytest.raises(ValueError, match=r"quantize_per_token_fp8: input_scale: expected one floating-point "
                                         r"value \(a per-tensor scale\), got torch.float32 \[2\]"):
        quantize_per_token_fp8(wide, torch.ones(2))
