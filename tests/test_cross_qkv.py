"""QKVCrossParallelLinear against the naive way (QKVParallelLinear on both inputs, split): tp_size 1, 2, 4."""

from __future__ import annotations

import importlib

import multirank
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from tpkit.parallel_layers import QKVCrossParallelLinear, QKVParallelLinear, TPGroup, init_tensor_parallel

TOL = {"rtol": 1e-5, "atol": 1e-5}
HIDDEN, HEAD_SIZE = 16, 4
# MHA; GQA (KV heads replicated at tp_size 4); MQA (replicated at tp_size 2 and 4)
HEADS = ((4, 4), (8, 2), (4, 1))
STACKED_PARAMS_MAPPING = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
)


class CrossAttention(nn.Module):
    """What a model holds: ``encoder_attn.qkv_proj`` of either class."""

    def __init__(self, cls: type[QKVParallelLinear], heads: int, kv_heads: int, bias: bool,
                 skip_bias_add: bool = False) -> None:
        super().__init__()
        self.qkv_proj = cls(HIDDEN, HEAD_SIZE, heads, kv_heads, bias=bias, skip_bias_add=skip_bias_add,
                            device=multirank.device())


class Model(nn.Module):
    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__()
        self.encoder_attn = CrossAttention(*args, **kwargs)


def _checkpoint(heads: int, kv_heads: int, bias: bool) -> dict[str, torch.Tensor]:
    """Full q/k/v projections as a checkpoint stores them (the same on every rank: same seed)."""
    device = multirank.device()
    checkpoint = {}
    for name, rows in (("q_proj", heads), ("k_proj", kv_heads), ("v_proj", kv_heads)):
        checkpoint[f"encoder_attn.{name}.weight"] = torch.randn(rows * HEAD_SIZE, HIDDEN, device=device)
        if bias:
            checkpoint[f"encoder_attn.{name}.bias"] = torch.randn(rows * HEAD_SIZE, device=device)
    return checkpoint


def vllm_style_load(model: nn.Module, checkpoint: dict[str, torch.Tensor]) -> None:
    """The plain loop of vLLM models over stacked_params_mapping."""
    params = dict(model.named_parameters())
    for name, loaded_weight in checkpoint.items():
        for param_name, weight_name, shard_id in STACKED_PARAMS_MAPPING:
            if weight_name not in name:
                continue
            param = params[name.replace(weight_name, param_name)]
            param.weight_loader(param, loaded_weight, shard_id)
            break
        else:
            param = params[name]
            param.weight_loader(param, loaded_weight)


def _naive(layer: QKVParallelLinear, decoder: torch.Tensor, encoder: torch.Tensor | None
           ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    sizes = [layer.q_size, layer.kv_size, layer.kv_size]
    q = layer(decoder).split(sizes, dim=-1)[0]
    if encoder is None:
        return q, None, None
    _, k, v = layer(encoder).split(sizes, dim=-1)
    return q, k, v


def _compare(naive: Model, cross: Model, with_encoder: bool) -> None:
    """Outputs and gradients (inputs, weight, bias) of the two ways agree."""
    device = multirank.device()
    decoder = torch.randn(2, 3, HIDDEN, device=device)  # [batch, decoder tokens, hidden]
    # [batch, encoder tokens, hidden]
    encoder = torch.randn(2, 7, HIDDEN, device=device) if with_encoder else None
    results = []
    grads = None
    for model in (naive, cross):
        model.zero_grad()
        dec = decoder.clone().requires_grad_()
        enc = None if encoder is None else encoder.clone().requires_grad_()
        layer = model.encoder_attn.qkv_proj
        if isinstance(layer, QKVCrossParallelLinear):
            if layer.skip_bias_add:
                (q, k, v), (q_bias, k_bias, v_bias) = layer(dec, enc)
                assert (q_bias is None) == (layer.bias is None)
                assert (k_bias is None) == (v_bias is None) == (k is None or layer.bias is None)
                q, k, v = ((t if b is None else t + b) for t, b in ((q, q_bias), (k, k_bias), (v, v_bias)))
            else:
                q, k, v = layer(dec, enc)
        else:
            q, k, v = _naive(layer, dec, enc)
        assert q.shape == (2, 3, layer.q_size)
        assert (k is None) == (v is None) == (encoder is None)
        if grads is None:  # the same random output gradients for both ways
            grads = [torch.randn_like(q)] + ([] if k is None else [torch.randn_like(k), torch.randn_like(v)])
        outputs = [q] + ([] if k is None else [k, v])
        sum((t * g).sum() for t, g in zip(outputs, grads, strict=True)).backward()
        results.append((outputs, dec.grad, None if enc is None else enc.grad, layer.weight.grad,
                        None if layer.bias is None else layer.bias.grad))
    torch.testing.assert_close(results[1], results[0], **TOL)


def _check_cross_qkv(tp_size: int, load_weights_available: bool) -> None:
    tp = init_tensor_parallel()
    assert tp.size == tp_size
    torch.manual_seed(0)
    load_weights = None
    if load_weights_available:
        load_weights = importlib.import_module("tpkit.loaders").load_weights
    for heads, kv_heads in HEADS:
        for bias in (True, False):
            checkpoint = _checkpoint(heads, kv_heads, bias)
            naive = Model(QKVParallelLinear, heads, kv_heads, bias)
            cross = Model(QKVCrossParallelLinear, heads, kv_heads, bias)
            # drop-in: the same parameter names and shapes
            assert [(n, p.shape) for n, p in naive.named_parameters()] == \
                   [(n, p.shape) for n, p in cross.named_parameters()]
            vllm_style_load(naive, checkpoint)
            vllm_style_load(cross, checkpoint)
            torch.testing.assert_close(dict(cross.named_parameters()), dict(naive.named_parameters()),
                                       rtol=0, atol=0)
            if load_weights is not None:
                loaded = Model(QKVCrossParallelLinear, heads, kv_heads, bias)
                load_weights(loaded, iter(checkpoint.items()), STACKED_PARAMS_MAPPING)
                torch.testing.assert_close(dict(loaded.named_parameters()), dict(naive.named_parameters()),
                                           rtol=0, atol=0)
            for with_encoder in (True, False):
                _compare(naive, cross, with_encoder)
            skipping = Model(QKVCrossParallelLinear, heads, kv_heads, bias, skip_bias_add=True)
            vllm_style_load(skipping, checkpoint)
            for with_encoder in (True, False):
                _compare(naive, skipping, with_encoder)


def _load_weights_available() -> bool:
    return hasattr(importlib.import_module("tpkit.loaders"), "load_weights")


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_cross_qkv_matches_naive(ranks, tp_size: int) -> None:
    ranks.run(tp_size, _check_cross_qkv, tp_size, _load_weights_available())


def test_load_weights_loop() -> None:
    """The tpkit.loaders loop loads the cross layer unchanged (also run inside the rank tests above)."""
    if not _load_weights_available():
        pytest.skip("tpkit.loaders.load_weights is not there yet")
    load_weights = importlib.import_module("tpkit.loaders").load_weights
    torch.manual_seed(0)
    single = TPGroup(None, 0, 1)
    checkpoint = {name: t.cpu() for name, t in _checkpoint(8, 2, True).items()}
    model = nn.Module()
    model.encoder_attn = nn.Module()
    model.encoder_attn.qkv_proj = QKVCrossParallelLinear(HIDDEN, HEAD_SIZE, 8, 2, tp_group=single)
    loaded = load_weights(model, iter(checkpoint.items()), STACKED_PARAMS_MAPPING)
    assert loaded == {"encoder_attn.qkv_proj.weight", "encoder_attn.qkv_proj.bias"}
    expected = torch.cat([checkpoint[f"encoder_attn.{n}_proj.weight"] for n in "qkv"])
    torch.testing.assert_close(model.encoder_attn.qkv_proj.weight, expected, rtol=0, atol=0)


class _OpRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - the dispatch protocol
        self.ops.append(str(func.overloadpacket.__name__))
        return func(*args, **(kwargs or {}))


def test_forward_copies_no_weights_and_does_the_analytic_flops() -> None:
    single = TPGroup(None, 0, 1)
    heads, kv_heads, dec_tokens, enc_tokens = 8, 2, 5, 11
    layer = QKVCrossParallelLinear(HIDDEN, HEAD_SIZE, heads, kv_heads, tp_group=single)
    naive = QKVParallelLinear(HIDDEN, HEAD_SIZE, heads, kv_heads, tp_group=single)
    decoder, encoder = torch.randn(dec_tokens, HIDDEN), torch.randn(enc_tokens, HIDDEN)
    with torch.no_grad(), _OpRecorder() as recorder:
        layer(decoder, encoder)
    copying = {"clone", "copy_", "_to_copy", "cat", "contiguous", "index_select", "empty_like"}
    assert not copying & set(recorder.ops), recorder.ops

    q, kv = heads * HEAD_SIZE, 2 * kv_heads * HEAD_SIZE
    with FlopCounterMode(display=False) as cross_flops:
        layer(decoder, encoder)
    with FlopCounterMode(display=False) as naive_flops:
        naive(decoder), naive(encoder)
    assert cross_flops.get_total_flops() == 2 * HIDDEN * (dec_tokens * q + enc_tokens * kv)
    assert naive_flops.get_total_flops() == 2 * HIDDEN * (dec_tokens + enc_tokens) * (q + kv)
    with FlopCounterMode(display=False) as decode_flops:
        layer(decoder)
    assert decode_flops.get_total_flops() == 2 * HIDDEN * dec_tokens * q
