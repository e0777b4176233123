"""A Llama step on float8 tensor cores with each activation quantized where it is made: what
``LlamaForCausalLM``'s layers compute at a prefill (or any step of more tokens than a decode kernel takes)
when their linear layers hold float8 weights. A reader of ``tpkit.models.llama`` may skip this module: the
forward there computes the same.

With float8 weights (``Fp8LinearMethod``, per-tensor or per-channel scales) each product of many tokens
quantizes its input per token and multiplies on float8 tensor cores (``torch._scaled_mm``). Through the
layers' forward the 16-bit input of every product is written, read back by the quantization, and the
float8 rows written again; around it the residual adds, the norms and SwiGLU each pass over the rows once
more. Here the ops of :mod:`tpkit.ops.fp8_quantize` make the float8 rows directly from what precedes them:

- the input norm of each layer, after the residual add of the layer before
  (``add_rms_norm_quantize_fp8``; the first layer's ``rms_norm_quantize_fp8``), for qkv_proj;
- the post-attention norm after the attention's residual add, for gate_up_proj;
- SwiGLU of gate_up_proj's output (``silu_and_mul_quantize_fp8``), for down_proj.

Each product then multiplies the float8 rows (``Fp8LinearMethod.apply_quantized``). Attention and o_proj run
as the layers run them (o_proj's input comes from attention; its layer quantizes it). A static
``input_scale`` is the scale of the product that takes the rows, as that layer would use it.

``LlamaForCausalLM.fused_fp8`` chooses: None (the default) takes this step where the products would run on
float8 tensor cores (:meth:`Fp8LinearMethod.tensor_cores_apply`) and no decode kernel takes them; True at
every step without gradients that the fused decode step does not take (the ops' PyTorch expressions and
the dequantized products where the kernels do not run, as on the CPU); False never. It applies where every
layer's qkv_proj, gate_up_proj and down_proj hold float8 weights with one scale a tensor or a row and a
method whose ``quantize_op`` is ``quantize_per_token_fp8`` (what the fused ops compute), to SwiGLU MLPs with
the layers' own norms, without sequence parallelism, on any number of ranks (the row-parallel products'
all-reduce before each residual add).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tpkit.attention import AttentionMetadata, PagedKVCache
from tpkit.ops import (
    add_rms_norm_quantize_fp8,
    decode_kernel_applies,
    quantize_per_token_fp8,
    rms_norm_quantize_fp8,
    silu_and_mul_quantize_fp8,
)
from tpkit.parallel_layers import Fp8LinearMethod, RowParallelLinear, reduce_from_tp_region

if TYPE_CHECKING:
    from torch import nn

    from tpkit.models.llama import LlamaDecoderLayer, LlamaForCausalLM

_Quantized = tuple[torch.Tensor, torch.Tensor]  # float8 [num_tokens, features], float32 [num_tokens, 1]


def fused_fp8_applies(model: LlamaForCausalLM, x: torch.Tensor) -> bool:
    """Whether ``model``'s step of ``x`` ``[batch, seq, hidden]`` (the embeddings) runs
    :func:`fused_fp8_step`, as ``model.fused_fp8`` says (the caller has ruled out the fused decode step)."""
    if model.fused_fp8 is False or torch.is_grad_enabled() or model.sequence_parallel:
        return False
    first = model.layers[0]
    if first.mlp.act is not F.silu or not _layer_fuses(first, x.dtype):
        return False
    qkv_proj = first.self_attn.qkv_proj
    if model.fused_fp8 is None and not (qkv_proj.quant_method.tensor_cores_apply(qkv_proj, x)
                                        and not decode_kernel_applies(x, qkv_proj.weight)):
        return False
    # The other layers too: a model may leave some products unquantized. (A slice of the ModuleList would
    # build a new one, a module added per layer.)
    return all(_layer_fuses(layer, x.dtype) for layer in itertools.islice(model.layers, 1, None))


def _products(layer: LlamaDecoderLayer) -> tuple[nn.Module, ...]:
    """The products whose inputs the fused ops quantize."""
    return layer.self_attn.qkv_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def _layer_fuses(layer: LlamaDecoderLayer, dtype: torch.dtype) -> bool:
    """The layer's norms hold weights of the activations' dtype (the fused ops' norms take no other), and
    each product float8 weights with one scale a tensor or a row, its method quantizing activations as the
    fused ops do."""
    if layer.input_layernorm.weight.dtype != dtype or layer.post_attention_layernorm.weight.dtype != dtype:
        return False
    for product in _products(layer):
        method = product.quant_method
        if not (isinstance(method, Fp8LinearMethod) and method.quantize_op is quantize_per_token_fp8
                and method.weight_scheme != "block" and product.weight.dtype == torch.float8_e4m3fn):
            return False
    return True


def _scales(layer: nn.Module) -> tuple[torch.Tensor | None, float | None]:
    """``(input_scale, activation_scale_ub)`` with which ``layer``'s product quantizes its input."""
    return layer.quant_method.activation_scales(layer)


def _product(layer: nn.Module, activations: _Quantized, out_dtype: torch.dtype) -> torch.Tensor:
    """``layer``'s output ``[num_tokens, out_per_partition]`` (a row-parallel layer's all-reduced) from its
    quantized input."""
    out = layer.quant_method.apply_quantized(layer, *activations, None, out_dtype)
    if isinstance(layer, RowParallelLinear) and layer.tp_size > 1:
        out = reduce_from_tp_region(out, layer.tp_group)
    return out if layer.bias is None else out + layer.bias


def fused_fp8_step(model: LlamaForCausalLM, x: torch.Tensor, rotations: dict[str, tuple[torch.Tensor, ...]],
                   kv_cache: PagedKVCache | None, metadata: AttentionMetadata | None) -> torch.Tensor:
    """The layers and the final norm: the embeddings ``[batch, seq, hidden]`` -> the final norm's output, as
    ``model.hidden_states`` computes it. ``rotations``: each layer type's ``(cos, sin)``."""
    batch, seq, hidden = x.shape
    residual = x.reshape(-1, hidden)  # [num_tokens, hidden], the residual stream
    first = model.layers[0]
    norm = first.input_layernorm
    activations = rms_norm_quantize_fp8(residual, norm.weight, norm.eps,
                                        *_scales(first.self_attn.qkv_proj))
    for i, (layer, layer_type) in enumerate(zip(model.layers, model.layer_types, strict=True)):
        attn, mlp = layer.self_attn, layer.mlp
        qkv = _product(attn.qkv_proj, activations, x.dtype).view(batch, seq, -1)
        out = attn.from_qkv(qkv, *rotations[layer_type], kv_cache, metadata)  # [batch, seq, hidden]
        norm = layer.post_attention_layernorm
        *activations, residual = add_rms_norm_quantize_fp8(out.reshape(-1, hidden), residual, norm.weight,
                                                           norm.eps, *_scales(mlp.gate_up_proj))
        gate_up = _product(mlp.gate_up_proj, activations, x.dtype)  # [num_tokens, 2 * intermediate / tp]
        down = _product(mlp.down_proj, silu_and_mul_quantize_fp8(gate_up, *_scales(mlp.down_proj)),
                        x.dtype)  # [num_tokens, hidden]
        if i + 1 == model.num_layers:
            residual = residual + down
            break
        after = model.layers[i + 1]
        norm = after.input_layernorm
        *activations, residual = add_rms_norm_quantize_fp8(down, residual, norm.weight, norm.eps,
                                                           *_scales(after.self_attn.qkv_proj))
    return model.norm(residual.view(batch, seq, hidden))
