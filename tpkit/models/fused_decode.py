"""A Llama decode step on tpkit's fused decode kernels: what ``LlamaForCausalLM``'s layers compute at a
decode step, with the small steps between the products folded into the products' kernels. A reader of
``tpkit.models.llama`` may skip this module: the forward there computes the same.

At a decode step each product multiplies a few rows (one token a sequence) by a whole weight, so on a GPU
every kernel between two products costs a launch for a few KB. Here the decode kernel's epilogues take them
(the ops of :mod:`tpkit.ops.linear`):

- qkv_proj's rotates q and k (RoPE) and writes k and v into the paged cache (``decode_qkv_rope_cache``);
  attention then reads them from the cache;
- gate_up_proj's applies SwiGLU (``decode_linear_silu_and_mul``);
- on one rank, each RMSNorm is split between the products around it (:mod:`tpkit.ops.norm`): o_proj and
  down_proj add the residual and start the norm that follows (``decode_linear_residual_norm``), qkv_proj and
  gate_up_proj finish it (``rms_sums``). A layer is then its four products and attention: five kernels.
  Across ranks the residual add follows o_proj's and down_proj's all-reduce, so the norms stay modules.

Float8 takes the same step, in the same kernels:

- float8 weights (``Fp8LinearMethod``) with per-tensor or per-channel scales: each product reads the float8
  weight and its scales, one a row (``Fp8LinearMethod.row_scales``), as the layers' own decode product
  (``decode_op``, :func:`tpkit.ops.decode_linear_fp8`) does, the activations unquantized (a static
  ``input_scale`` is not used by that product either). A method without that ``decode_op`` quantizes the
  activations of a CUDA step (float8 tensor cores), and block scales vary along ``in_features``, which the
  kernel's per-feature scale cannot take: those layers decode through their forward;
- a float8 KV cache: qkv_proj's kernel quantizes k and v with the layer's ``k_scale`` and ``v_scale`` as
  :func:`tpkit.ops.reshape_and_cache` does, bit for bit.

``LlamaForCausalLM.fused_decode`` chooses: None (the default) takes this step where tpkit's decode kernel
takes the step's products (:func:`tpkit.ops.decode_kernel_applies`); True at every decode step without
gradients (the fused ops' PyTorch expressions where the kernels do not run, as on the CPU); False never.
It multiplies with the layers' weights itself (the decode kernels, whatever ``linear_op`` the layers
have), so it applies to SwiGLU MLPs (``hidden_act`` silu) without q/k norms (Qwen3's come between the
product and RoPE) only, and a model whose layers are given another product (``set_linear_op``) sets
``fused_decode = False``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tpkit.attention import AttentionMetadata, PagedKVCache
from tpkit.ops import (
    apply_rms_sums,
    decode_kernel_applies,
    decode_linear_fp8,
    decode_linear_residual_norm,
    decode_linear_silu_and_mul,
    decode_qkv_rope_cache,
)
from tpkit.parallel_layers import Fp8LinearMethod

if TYPE_CHECKING:
    from torch import nn

    from tpkit.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


def fused_decode_applies(model: LlamaForCausalLM, x: torch.Tensor, kv_cache: PagedKVCache | None,
                         metadata: AttentionMetadata | None) -> bool:
    """Whether ``model``'s step of ``x`` ``[batch, 1, hidden]`` (the embeddings) runs
    :func:`fused_decode_step`: a decode step without gradients, SwiGLU MLPs, not sequence-parallel, as
    ``model.fused_decode`` says."""
    if model.fused_decode is False or kv_cache is None or metadata is None or metadata.is_prefill:
        return False
    qkv_proj = model.layers[0].self_attn.qkv_proj
    if not _quantization_fuses(qkv_proj, x):
        return False
    if torch.is_grad_enabled() or model.sequence_parallel or model.layers[0].mlp.act is not F.silu:
        return False
    if model.layers[0].self_attn.q_norm is not None:  # q/k norms come before RoPE, in the qkv epilogue's way
        return False
    return model.fused_decode or decode_kernel_applies(x, qkv_proj.weight)


def _quantization_fuses(layer: nn.Module, x: torch.Tensor) -> bool:
    """Whether the fused products compute what ``layer``'s quantization method (every decoder layer's)
    computes at a decode step of ``x``: none; or float8 weights with one scale a row, multiplied by the
    decode kernel with the activations unquantized (the method's ``decode_op`` on a GPU; the dequantized
    weight elsewhere)."""
    method = layer.quant_method
    if method is None:
        return True
    if not isinstance(method, Fp8LinearMethod) or method.weight_scheme == "block":
        return False
    return method.decode_op is decode_linear_fp8 or not x.is_cuda


def _weight(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight, weight_scale)`` as the fused ops take them: a weight of the model's dtype and None, or a
    float8 weight and its float32 per-row scales ``[out_per_partition]``."""
    method = layer.quant_method
    return layer.weight, None if method is None else method.row_scales(layer)


def fused_decode_step(model: LlamaForCausalLM, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      kv_cache: PagedKVCache, metadata: AttentionMetadata) -> torch.Tensor:
    """The layers and the final norm of a decode step: the embeddings ``[batch, 1, hidden]`` -> the final
    norm's output, as ``model.hidden_states`` computes it."""
    if model.tp_group.size > 1:
        for layer in model.layers:
            x = _layer(layer, x, cos, sin, kv_cache, metadata)
        return model.norm(x)
    # float64 [batch]: the rows' sums of squares of the residual stream, for the input norms and for the
    # post-attention norms, two buffers that the products fill and zero in turn.
    input_sums = x.float().square().sum(-1, dtype=torch.float64).flatten()
    post_sums = torch.zeros_like(input_sums)
    normed = x * model.layers[0].input_layernorm.weight
    for i, layer in enumerate(model.layers):
        next_norm = model.layers[i + 1].input_layernorm if i + 1 < model.num_layers else model.norm
        x, normed = _layer_norms_in_products(layer, x, normed, input_sums, post_sums, next_norm.weight, cos,
                                             sin, kv_cache, metadata)
    return apply_rms_sums(normed, input_sums, model.norm.eps)


def _layer(layer: LlamaDecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           kv_cache: PagedKVCache, metadata: AttentionMetadata) -> torch.Tensor:
    """``LlamaDecoderLayer.forward`` of a decode step, with RoPE and the cache write in qkv_proj's kernel and
    SwiGLU in gate_up_proj's: x ``[batch, 1, hidden]``, the residual stream."""
    x = x + layer.self_attn.o_proj(_attention(layer.self_attn, layer.input_layernorm(x), cos, sin, kv_cache,
                                              metadata))
    gate_up, down = layer.mlp.gate_up_proj, layer.mlp.down_proj
    weight, weight_scale = _weight(gate_up)
    hidden = decode_linear_silu_and_mul(layer.post_attention_layernorm(x), weight, gate_up.bias,
                                        weight_scale=weight_scale)
    return x + down(hidden)  # via [batch, 1, intermediate_size / tp_size]


def _layer_norms_in_products(layer: LlamaDecoderLayer, x: torch.Tensor, normed: torch.Tensor,
                             input_sums: torch.Tensor, post_sums: torch.Tensor,
                             next_norm_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             kv_cache: PagedKVCache,
                             metadata: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_layer` on one rank, each RMSNorm split between the products around it.

    x: the residual stream [batch, 1, hidden]; normed: ``x * input_layernorm.weight``; input_sums: the rows'
    sums of ``x ** 2``, float64 [batch]; post_sums: zero, float64 [batch]. Returns the next layer's
    ``(x, normed)``, normed by ``next_norm_weight``, with input_sums its sums and post_sums zero again.
    """
    o_proj, gate_up, down = layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj
    post_norm = layer.post_attention_layernorm
    out = _attention(layer.self_attn, normed, cos, sin, kv_cache, metadata, input_sums,
                     layer.input_layernorm.eps)
    (o_weight, o_scale), (gate_up_weight, gate_up_scale), (down_weight, down_scale) = (
        _weight(o_proj), _weight(gate_up), _weight(down))
    x, normed = decode_linear_residual_norm(out, o_weight, o_proj.bias, x, post_norm.weight, post_sums,
                                            input_sums, o_scale)
    hidden = decode_linear_silu_and_mul(normed, gate_up_weight, gate_up.bias, post_sums, post_norm.eps,
                                        gate_up_scale)
    return decode_linear_residual_norm(hidden, down_weight, down.bias, x, next_norm_weight, input_sums,
                                       post_sums, down_scale)


def _attention(attn: LlamaAttention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               kv_cache: PagedKVCache, metadata: AttentionMetadata, rms_sums: torch.Tensor | None = None,
               eps: float = 0.0) -> torch.Tensor:
    """A decode step's attention before o_proj, x ``[batch, 1, hidden]`` -> ``[batch, 1, q_size]``:
    qkv_proj's kernel rotates q and k and writes k and v into the cache (two kernels fewer a layer), and
    attention reads them from there. With ``rms_sums``, ``x`` is the first half of the input norm and the
    product does the second."""
    caches = kv_cache.key_caches[attn.layer_idx], kv_cache.value_caches[attn.layer_idx]
    k_scale, v_scale = kv_cache.scales(attn.layer_idx)  # a float8 cache's; None otherwise
    weight, weight_scale = _weight(attn.qkv_proj)
    # [batch, 1, q_size + 2 * kv_size]
    qkv = decode_qkv_rope_cache(x, weight, attn.qkv_proj.bias, cos, sin, *caches, metadata.slot_mapping,
                                attn.num_heads, rms_sums, eps, weight_scale, k_scale, v_scale)
    return attn.attn(qkv[..., : attn.q_size], None, None, kv_cache=kv_cache, layer_idx=attn.layer_idx,
                     metadata=metadata)
