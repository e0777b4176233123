"""A checkpoint's quantization, from config.json's ``quantization_config``, as the linear layers' method.

Three published float8 formats are read, each into :class:`tpkit.parallel_layers.Fp8LinearMethod`:

- compressed-tensors ``float-quantized`` (``quant_method: "compressed-tensors"``): a config group whose
  ``weights`` are float 8-bit with strategy ``tensor``, ``channel`` or ``block`` (``block_structure``), and
  ``input_activations`` dynamic per token, or static per tensor (an ``input_scale`` a layer), or none.
  Tensors: ``weight``, ``weight_scale``, ``input_scale``.
- ``fbgemm_fp8``: per-channel weights (``weight``, ``weight_scale`` ``[out, 1]``), dynamic per-token
  activations bounded by ``activation_scale_ub``.
- ``fp8`` (transformers' fine-grained FP8, DeepSeek-V3, Qwen3-FP8): with ``weight_block_size`` block scales
  (``weight_scale_inv``), without it one ``weight_scale`` a tensor; ``activation_scheme`` dynamic or static.

``quantization="fp8"`` quantizes a high-precision checkpoint while it loads, per channel. Only the linear
layers are quantized: modules the config leaves out must be the LM head (never a quantized layer here).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tpkit.loaders import CheckpointError
from tpkit.ops import decode_linear_fp8, quantize_per_token_fp8
from tpkit.parallel_layers import Fp8LinearMethod, QuantizationMethod

QUANTIZATIONS = ("fp8",)


def _fp8(*args: Any, **kwargs: Any) -> Fp8LinearMethod:
    """An :class:`Fp8LinearMethod` whose decode steps run tpkit's decode kernel on float8 weights and whose
    float8 tensor-core products quantize their activations with tpkit's kernel."""
    return Fp8LinearMethod(*args, decode_op=decode_linear_fp8, quantize_op=quantize_per_token_fp8, **kwargs)


def quant_method_from_config(config: Mapping[str, Any], quantization: str | None = None,
                             where: str = "config.json") -> QuantizationMethod | None:
    """The linear layers' method for a config.json dict (its ``quantization_config``), or for
    ``quantization="fp8"`` over a high-precision checkpoint; None for neither. A format or scheme not read
    here is a CheckpointError naming it."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"from_pretrained: quantization: expected None or one of {list(QUANTIZATIONS)}, "
                         f"got {quantization!r}")
    quant = config.get("quantization_config")
    if not quant:
        return _fp8("channel", quantize_on_load=True) if quantization == "fp8" else None
    if not isinstance(quant, Mapping):
        raise CheckpointError(f"{where}: quantization_config: expected an object, got {type(quant).__name__}")
    method = quant.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(quant, where)
    _check_skipped(quant.get("modules_to_not_convert"), where, "modules_to_not_convert")
    if method == "fbgemm_fp8":
        bound = quant.get("activation_scale_ub")
        return _fp8("channel", activation_scale_ub=None if bound is None else float(bound))
    if method == "fp8":
        static = _activation_scheme(quant.get("activation_scheme", "dynamic"), where)
        if quant.get("fmt", "e4m3") != "e4m3":
            raise CheckpointError(f"{where}: quantization_config.fmt: expected 'e4m3', got {quant['fmt']!r}")
        block = quant.get("weight_block_size")
        if block is None:
            return _fp8("tensor", static_input_scale=static)
        if static:
            raise CheckpointError(f"{where}: quantization_config: block-wise weights take dynamic "
                                  "activations: expected activation_scheme 'dynamic', got 'static'")
        return _fp8("block", block_size=tuple(block))
    raise CheckpointError(f"{where}: quantization_config.quant_method: expected 'compressed-tensors', "
                          f"'fbgemm_fp8' or 'fp8', got {method!r}")


def _activation_scheme(value: object, where: str) -> bool:
    if value not in ("dynamic", "static"):
        raise CheckpointError(f"{where}: quantization_config.activation_scheme: expected 'dynamic' or "
                              f"'static', got {value!r}")
    return value == "static"


def _check_skipped(modules: object, where: str, key: str) -> None:
    """Modules left unquantized must be the LM head: every linear layer here reads the scheme."""
    for name in modules or ():
        if "lm_head" not in str(name):
            raise CheckpointError(f"{where}: quantization_config.{key}: leaving {name!r} unquantized is not "
                                  "supported (only the LM head may be left out)")


def _compressed_tensors(quant: Mapping[str, Any], where: str) -> QuantizationMethod | None:
    groups = list((quant.get("config_groups") or {}).values())
    if not groups:  # no quantized weights: a float8 KV cache's kv_cache_scheme alone
        return None
    fmt = quant.get("format")
    if fmt not in ("float-quantized", "naive-quantized"):
        raise CheckpointError(f"{where}: quantization_config.format: expected 'float-quantized', got {fmt!r}")
    _check_skipped(quant.get("ignore"), where, "ignore")
    if len(groups) != 1:
        raise CheckpointError(f"{where}: quantization_config.config_groups: expected one group (every "
                              f"linear layer alike), got {len(groups)}")
    weights, activations = groups[0].get("weights") or {}, groups[0].get("input_activations")
    if weights.get("type") != "float" or weights.get("num_bits") != 8:
        raise CheckpointError(f"{where}: config_groups weights: expected float 8-bit, got "
                              f"{weights.get('type')!r} {weights.get('num_bits')!r}-bit")
    strategy = weights.get("strategy")
    if strategy not in ("tensor", "channel", "block"):
        raise CheckpointError(f"{where}: config_groups weights.strategy: expected 'tensor', 'channel' or "
                              f"'block', got {strategy!r}")
    static = False
    if activations:
        if activations.get("type") != "float" or activations.get("num_bits") != 8:
            raise CheckpointError(f"{where}: config_groups input_activations: expected float 8-bit, got "
                                  f"{activations.get('type')!r} {activations.get('num_bits')!r}-bit")
        static = not activations.get("dynamic", True)
        expected = "tensor" if static else "token"
        if activations.get("strategy") != expected:
            got = activations.get("strategy")
            raise CheckpointError(f"{where}: config_groups input_activations.strategy: expected "
                                  f"{expected!r} for dynamic={not static}, got {got!r}")
    block = tuple(weights.get("block_structure") or (128, 128))
    return _fp8(strategy, block_size=block, static_input_scale=static, scale_name="weight_scale")
