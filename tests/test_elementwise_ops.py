"""The prefill's element-wise ops, ``torch.ops.tpkit.rotary`` and ``torch.ops.tpkit.silu_and_mul``.

On the CPU: each op's PyTorch implementation against the expression it replaces, opcheck, argument checks
and a compiled trace. On a GPU: the CUDA kernels against the same expressions, value for value (each rounds
where eager PyTorch rounds), through ``apply_rotary`` and ``decode_linear_silu_and_mul`` as the models call
them, and the cases those leave to the expressions.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cuda_graphs import capture

from tpkit.ops import apply_rotary, decode_linear_silu_and_mul

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rotary_expression(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _silu_and_mul_expression(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _qk_slice(batch: int, seq: int, num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
              device: str) -> torch.Tensor:
    """q and k heads as the Llama layer rotates them: [batch, seq, heads, head_size], a slice of a fused
    q, k, v projection's output (token stride (num_heads + 2 * num_kv_heads) * head_size)."""
    qkv = torch.randn(batch, seq, (num_heads + 2 * num_kv_heads) * head_size, device=device).to(dtype)
    return qkv[..., : (num_heads + num_kv_heads) * head_size].view(batch, seq, -1, head_size)


def _cos_sin(batch: int, seq: int, head_size: int, dtype: torch.dtype,
             device: str) -> tuple[torch.Tensor, torch.Tensor]:
    # [batch, seq, 1, head_size / 2]
    angles = torch.rand(batch, seq, 1, head_size // 2, device=device) * 100.0
    return angles.cos().to(dtype), angles.sin().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_op_on_the_cpu_is_the_expression(dtype: torch.dtype) -> None:
    x = _qk_slice(2, 5, 4, 2, 16, dtype, "cpu")
    cos, sin = _cos_sin(2, 5, 16, dtype, "cpu")
    out = torch.empty(10, 6, 16, dtype=dtype)
    torch.ops.tpkit.rotary(out, x.reshape(10, 6, 16), cos.reshape(10, 8), sin.reshape(10, 8))
    assert torch.equal(out.view(2, 5, 6, 16), _rotary_expression(x, cos, sin))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_op_on_the_cpu_is_the_expression(dtype: torch.dtype) -> None:
    gate_up = torch.randn(7, 40, dtype=torch.float32).to(dtype)[:, 4:36]  # strided rows: [7, 32]
    out = torch.empty(7, 16, dtype=dtype)
    torch.ops.tpkit.silu_and_mul(out, gate_up)
    assert torch.equal(out, _silu_and_mul_expression(gate_up))


def test_opcheck() -> None:
    x = torch.randn(6, 3, 16)
    angles = torch.rand(6, 8)
    torch.library.opcheck(torch.ops.tpkit.rotary.default,
                          (torch.empty(6, 3, 16), x, angles.cos(), angles.sin()))
    torch.library.opcheck(torch.ops.tpkit.silu_and_mul.default, (torch.empty(5, 12), torch.randn(5, 24)))


def test_torch_compile_fullgraph() -> None:
    x, angles, gate_up = torch.randn(6, 3, 16), torch.rand(6, 8), torch.randn(5, 24)

    def both(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rotated, activated = torch.empty_like(x), gate_up.new_empty(5, 12)
        torch.ops.tpkit.rotary(rotated, x, cos, sin)
        torch.ops.tpkit.silu_and_mul(activated, gate_up)
        return rotated, activated

    compiled = torch.compile(both, backend="aot_eager", fullgraph=True)
    for got, expected in zip(compiled(x, angles.cos(), angles.sin(), gate_up),
                             both(x, angles.cos(), angles.sin(), gate_up), strict=True):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("make_args,error,message", [
    (lambda: (torch.zeros(6, 3, 16), torch.randn(6, 3, 16), torch.rand(6, 7), torch.rand(6, 8)), ValueError,
     r"rotary: cos: expected shape \[6, 8\], got \[6, 7\]"),
    (lambda: (torch.zeros(6, 3, 8), torch.randn(6, 3, 16), torch.rand(6, 8), torch.rand(6, 8)), ValueError,
     r"rotary: out: expected a contiguous tensor of input's shape \[6, 3, 16\]"),
    (lambda: (torch.zeros(6, 3, 15), torch.randn(6, 3, 15), torch.rand(6, 7), torch.rand(6, 7)), ValueError,
     r"rotary: input: expected an even head_size, got shape \[6, 3, 15\]"),
    (lambda: (torch.zeros(6, 3, 16), torch.randn(6, 3, 16), torch.rand(6, 8).double(), torch.rand(6, 8)),
     TypeError, r"rotary: cos: expected dtype torch.float32, got torch.float64"),
])
def test_rotary_rejects_bad_arguments(make_args, error, message) -> None:
    args = make_args()
    with pytest.raises(error, match=message):
        torch.ops.tpkit.rotary(*args)
    assert args[0].eq(0).all()


@pytest.mark.parametrize("out_shape,input_shape,message", [
    ((5, 12), (5, 23), r"silu_and_mul: input: expected \[num_rows, 2 \* features\] \(gate, then up\), got "
     r"shape \[5, 23\]"),
    ((5, 11), (5, 24), r"silu_and_mul: out: expected shape \[5, 12\], got \[5, 11\]"),
    ((5, 12), (5, 24, 1), r"silu_and_mul: input: expected 2 dimensions, got shape \[5, 24, 1\]"),
])
def test_silu_and_mul_rejects_bad_arguments(out_shape, input_shape, message) -> None:
    out = torch.zeros(out_shape)
    with pytest.raises(ValueError, match=message):
        torch.ops.tpkit.silu_and_mul(out, torch.randn(input_shape))
    assert out.eq(0).all()


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_size", [(32, 8, 128), (6, 1, 80), (4, 4, 64)])
def test_rotary_kernel_gives_the_expression(dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                                            head_size: int) -> None:
    x = _qk_slice(3, 37, num_heads, num_kv_heads, head_size, dtype, "cuda")
    cos, sin = _cos_sin(3, 37, head_size, dtype, "cuda")
    out = apply_rotary(x, cos, sin)
    assert out.is_contiguous() and out.shape == x.shape
    torch.testing.assert_close(out, _rotary_expression(x, cos, sin), rtol=0, atol=0)


@needs_cuda
def test_rotary_kernel_runs_in_a_graph_and_compiled() -> None:
    x = _qk_slice(2, 9, 8, 2, 128, torch.bfloat16, "cuda")
    cos, sin = _cos_sin(2, 9, 128, torch.bfloat16, "cuda")
    expected = _rotary_expression(x, cos, sin)
    compiled = torch.compile(apply_rotary, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, cos, sin), expected, rtol=0, atol=0)
    graph, static_out = capture(lambda: apply_rotary(x, cos, sin))
    x.copy_(_qk_slice(2, 9, 8, 2, 128, torch.bfloat16, "cuda"))
    graph.replay()
    torch.testing.assert_close(static_out, _rotary_expression(x, cos, sin), rtol=0, atol=0)


@needs_cuda
def test_rotary_leaves_what_the_kernel_does_not_take_to_the_expression() -> None:
    # head_size 72 (not a multiple of 16), cos and sin broadcast over the batch, float32, and a gradient.
    x = _qk_slice(2, 5, 4, 2, 72, torch.bfloat16, "cuda")
    cos, sin = _cos_sin(2, 5, 72, torch.bfloat16, "cuda")
    torch.testing.assert_close(apply_rotary(x, cos, sin), _rotary_expression(x, cos, sin), rtol=0, atol=0)
    x = _qk_slice(2, 5, 4, 2, 64, torch.bfloat16, "cuda")
    cos, sin = _cos_sin(1, 5, 64, torch.bfloat16, "cuda")
    torch.testing.assert_close(apply_rotary(x, cos, sin), _rotary_expression(x, cos, sin), rtol=0, atol=0)
    x = _qk_slice(2, 5, 4, 2, 64, torch.float32, "cuda").requires_grad_()
    cos, sin = _cos_sin(2, 5, 64, torch.float32, "cuda")
    out = apply_rotary(x, cos, sin)
    out.sum().backward()
    assert out.grad_fn is not None and x.grad is not None


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("num_rows,features", [(40, 1792), (17, 8), (300, 56)])
def test_silu_and_mul_kernel_gives_the_expression(dtype: torch.dtype, num_rows: int, features: int) -> None:
    # More than 16 rows (16 or fewer take the decode kernel, SwiGLU in its epilogue, rounded otherwise):
    # decode_linear_silu_and_mul's F.linear and then the op, as a prefill runs it.
    x = torch.randn(num_rows, 256, device="cuda").to(dtype)
    weight = (torch.randn(2 * features, 256, device="cuda") / 16).to(dtype)
    out = decode_linear_silu_and_mul(x, weight)
    torch.testing.assert_close(out, _silu_and_mul_expression(F.linear(x, weight)), rtol=0, atol=0)
    gate_up = (torch.randn(num_rows, 2 * features + 8, device="cuda") * 4).to(dtype)[:, 8:]  # strided rows
    out = torch.empty(num_rows, features, device="cuda", dtype=dtype)
    torch.ops.tpkit.silu_and_mul(out, gate_up)
    torch.testing.assert_close(out, _silu_and_mul_expression(gate_up), rtol=0, atol=0)


@needs_cuda
def test_silu_and_mul_leaves_what_the_kernel_does_not_take_to_the_expression() -> None:
    # features 12 (not a multiple of 8) and float32 through the op; a gradient through the layer's path.
    for dtype, features in ((torch.bfloat16, 12), (torch.float32, 16)):
        gate_up = torch.randn(20, 2 * features, device="cuda").to(dtype)
        out = torch.empty(20, features, device="cuda", dtype=dtype)
        torch.ops.tpkit.silu_and_mul(out, gate_up)
        torch.testing.assert_close(out, _silu_and_mul_expression(gate_up), rtol=0, atol=0)
    x = torch.randn(20, 64, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = decode_linear_silu_and_mul(x, weight)
    out.float().sum().backward()
    assert weight.grad is not None and weight.grad.abs().sum() > 0
