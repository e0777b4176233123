"""Quantization methods of the linear layers: how a layer holds its weight and multiplies by it.

A linear layer built with ``quant_method=`` (or given one later by :func:`set_quant_method`) lets the method
make its weight parameters (:meth:`QuantizationMethod.create_weights`), load them (every parameter's
``weight_loader`` shards a scale with the rows or columns it scales, as the layer shards its weight) and
multiply (:meth:`QuantizationMethod.apply`, instead of the layer's ``linear_op``).
:func:`process_weights_after_loading` then lets each method finish what loading left (quantizing a weight
loaded in high precision).

:class:`Fp8LinearMethod` holds ``weight`` in ``torch.float8_e4m3fn`` with float32 ``weight_scale``
(dequantized = ``weight.float() * scale``):

- ``"tensor"``: one scale a logical tensor, ``[num_parts]``: a fused q/k/v layer keeps q's, k's and v's
  own scales (and gate/up theirs), each loaded with its part's ``loaded_shard_id``. They are kept rather
  than requantized to one (their maximum): requantizing rounds the parts with smaller scales a second time
  and changes their bits, while kept scales cost nothing, expanded to one a row for the per-channel product.
- ``"channel"``: one scale an output row, ``[output_size_per_partition, 1]``, sharded with the rows.
- ``"block"``: one scale a ``block_size`` tile of the weight (128 x 128 in DeepSeek-V3's and Qwen3's
  checkpoints), ``[ceil(rows / block_rows), ceil(columns / block_columns)]``, named ``weight_scale_inv``
  as those checkpoints name it (it multiplies all the same); a rank's rows and columns must start at tile
  boundaries.

On CUDA, per-tensor and per-channel products of a decode step's few rows run the method's ``decode_op``
where it has one (tpkit's decode kernel reading the float8 weight, activations unquantized); other products
on a device of compute capability 8.9 or newer run on float8 tensor cores (``torch._scaled_mm``, the scales
in its epilogue), the activations quantized per token at each call (dynamic) or with a static
``input_scale`` of the checkpoint (one a part; the product uses their maximum, the one scale the shared
input can have), by the method's ``quantize_op`` (``tpkit.ops.quantize_per_token_fp8``). Elsewhere (the CPU,
older GPUs, block scales, a method without a ``quantize_op``) the weight is dequantized to the input's dtype
and multiplied, the activations unquantized. :meth:`Fp8LinearMethod.apply_quantized` multiplies activations
quantized already (by an op that fuses the quantization with what makes them: ``tpkit.models.fused_fp8``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ._init import _skipping
from ._loading import Piece, _attach_weight_loaders, _check_shape, _copy_pieces, _copy_whole
from .sharding import ShardPart, replicated

if TYPE_CHECKING:
    from .linear import _LinearBase

_FP8 = torch.float8_e4m3fn  # the weights' format (OCP E4M3)
_FP8_MAX = torch.finfo(_FP8).max
_SCHEMES = ("tensor", "channel", "block")
_MIN_SCALE = 1e-12  # an all-zero row or tile quantizes to zeros with this scale, never divides by zero


class QuantizationMethod:
    """How a linear layer holds and multiplies its weight. Stateless: every tensor lives on the layer, so
    one method serves every layer of a model."""

    def create_weights(self, layer: _LinearBase) -> None:
        """Replace or add the layer's parameters (it has its ``weight`` and ``bias`` in ``params_dtype``)."""

    def weight_loader(self, layer: _LinearBase, name: str, param: nn.Parameter, loaded_weight: object,
                      loaded_shard_id: int | str | None = None) -> None:
        """Load parameter ``name`` of the layer; by default the layer's own loader."""
        layer.weight_loader(param, loaded_weight, loaded_shard_id)

    def apply(self, layer: _LinearBase, input_: torch.Tensor, bias: torch.Tensor | None,
              rows: slice | None = None) -> torch.Tensor:
        """``input_ @ W[rows].T + bias``: input ``[..., input_size_per_partition]``."""
        raise NotImplementedError

    def process_weights_after_loading(self, layer: _LinearBase) -> None:
        """Finish the layer's weights once the checkpoint is in them."""

    def shard_parts(self, layer: _LinearBase, param: nn.Parameter) -> tuple[ShardPart, ...] | None:
        """Where the method's own parameters lie over the ranks (``tpkit.parallel_layers.sharding``), or
        None where the layer's rule for its rows and columns holds."""
        return None


class Fp8LinearMethod(QuantizationMethod):
    """Float8 (E4M3) weights with float32 scales; see the module docstring.

    Args:
        weight_scheme: ``"tensor"``, ``"channel"`` or ``"block"``.
        block_size: ``(block_rows, block_columns)`` of the block scheme.
        static_input_scale: the checkpoint has a per-tensor ``input_scale`` (activations quantized with it
            on float8 tensor cores) rather than dynamic per-token scales.
        activation_scale_ub: an upper bound on a token's dynamic activation scale's amax (fbgemm's
            ``activation_scale_ub``), or None.
        quantize_on_load: the checkpoint holds the weight in high precision: it loads into a weight of the
            layer's dtype and is quantized (per channel) by :func:`process_weights_after_loading`.
        scale_name: the scale parameter's name, as the checkpoint names it: by default ``weight_scale_inv``
            for blocks (DeepSeek-V3's), else ``weight_scale``.
        decode_op: a product for a decode step's few rows, ``decode_op(input, weight, row_scales, bias)``
            with the float8 weight and float32 per-row scales, returning the output or None where it does
            not apply (``tpkit.ops.decode_linear_fp8``, tpkit's decode kernel; this package imports no
            kernels); tried first for per-tensor and per-channel scales.
        quantize_op: the activations' per-token quantization for products on float8 tensor cores,
            ``quantize_op(rows, input_scale, activation_scale_ub) -> (float8 rows, float32 scales [num_rows,
            1])`` (``tpkit.ops.quantize_per_token_fp8``); None: those products multiply by the dequantized
            weight instead.
    """

    def __init__(self, weight_scheme: str = "channel", *, block_size: Sequence[int] = (128, 128),
                 static_input_scale: bool = False, activation_scale_ub: float | None = None,
                 quantize_on_load: bool = False, scale_name: str | None = None,
                 decode_op: Callable[..., torch.Tensor | None] | None = None,
                 quantize_op: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        if weight_scheme not in _SCHEMES:
            raise ValueError(f"Fp8LinearMethod: weight_scheme: expected one of {list(_SCHEMES)}, got "
                             f"{weight_scheme!r}")
        block = tuple(block_size)
        if len(block) != 2 or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in block):
            raise ValueError(f"Fp8LinearMethod: block_size: expected two positive ints, got {block_size!r}")
        if quantize_on_load and (weight_scheme != "channel" or static_input_scale):
            raise ValueError("Fp8LinearMethod: quantize_on_load quantizes per channel with dynamic "
                             f"activations: expected weight_scheme 'channel', got {weight_scheme!r} with "
                             f"static_input_scale={static_input_scale}")
        self.weight_scheme = weight_scheme
        self.block_size = block
        self.static_input_scale = static_input_scale
        self.activation_scale_ub = activation_scale_ub
        self.quantize_on_load = quantize_on_load
        self.scale_name = scale_name or ("weight_scale_inv" if weight_scheme == "block" else "weight_scale")
        self.decode_op = decode_op
        self.quantize_op = quantize_op

    def __repr__(self) -> str:
        block = f", block_size={self.block_size}" if self.weight_scheme == "block" else ""
        return (f"Fp8LinearMethod({self.weight_scheme!r}{block}, static_input_scale="
                f"{self.static_input_scale}, quantize_on_load={self.quantize_on_load})")

    # Parameters -------------------------------------------------------------------------------------------
    def create_weights(self, layer: _LinearBase) -> None:
        if self.quantize_on_load:
            return
        parts = layer.shard_parts(layer.weight)
        if self.weight_scheme == "block":
            _check_block_alignment(layer, parts, self.block_size)
        weight = layer.weight.detach()
        if _skipping.get() or weight.is_meta:
            # Built to be loaded: no values to quantize.
            quantized = torch.empty_like(weight, dtype=_FP8)
            scale = torch.ones(self._scale_shape(layer, len(parts)), device=weight.device)
        else:
            quantized, scale = self._quantize(weight, len(parts), parts)
        layer.weight = nn.Parameter(quantized, requires_grad=False)  # [out_per_partition, in_per_partition]
        layer.register_parameter(self.scale_name, nn.Parameter(scale, requires_grad=False))
        if self.static_input_scale:
            # [num_parts]: one a logical tensor, as the checkpoint stores them
            layer.input_scale = nn.Parameter(torch.ones(len(parts), device=weight.device),
                                             requires_grad=False)
        layer._quant_loaders = {name: functools.partial(self.weight_loader, layer, name)
                                for name in ("weight", self.scale_name, "input_scale")}
        _attach_weight_loaders(layer)

    def _scale_shape(self, layer: _LinearBase, num_parts: int) -> tuple[int, ...]:
        rows, columns = layer.weight.shape
        if self.weight_scheme == "tensor":
            return (num_parts,)
        if self.weight_scheme == "channel":
            return (rows, 1)
        return (-(-rows // self.block_size[0]), -(-columns // self.block_size[1]))

    def _quantize(self, weight: torch.Tensor, num_parts: int,
                  parts: Sequence[ShardPart]) -> tuple[torch.Tensor, torch.Tensor]:
        """(float8 weight, scale) of a high-precision weight [rows, columns], each scale the amax it covers
        over the largest float8 value."""
        w = weight.float()
        if self.weight_scheme == "channel":
            scale = w.abs().amax(dim=1, keepdim=True) / _FP8_MAX  # [rows, 1]
        elif self.weight_scheme == "tensor":
            lengths = _part_rows(parts, w.shape[0])
            scale = torch.stack([piece.abs().amax() for piece in w.split(lengths)]) / _FP8_MAX  # [num_parts]
        else:
            scale = _tile_amax(w, self.block_size) / _FP8_MAX  # [row_tiles, column_tiles]
        scale = scale.clamp(min=_MIN_SCALE)
        expanded = self._expand(scale, w.shape, parts)
        return (w / expanded).clamp(-_FP8_MAX, _FP8_MAX).to(_FP8), scale

    def _expand(self, scale: torch.Tensor, shape: torch.Size | tuple[int, int],
                parts: Sequence[ShardPart]) -> torch.Tensor:
        """The scale of every weight element, broadcastable to ``shape`` [rows, columns]."""
        rows, columns = shape
        if self.weight_scheme == "channel":
            return scale.view(rows, 1)
        if self.weight_scheme == "tensor":
            # Each part's scale expanded over its rows: no index tensor made from host values (a copy that a
            # CUDA graph capture refuses).
            lengths = _part_rows(parts, rows)
            return torch.cat([scale[i].expand(length) for i, length in enumerate(lengths)])[:, None]
        block_rows, block_columns = self.block_size
        return scale.repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_columns, 1)[:, :columns]

    # Loading ----------------------------------------------------------------------------------------------
    def weight_loader(self, layer: _LinearBase, name: str, param: nn.Parameter, loaded_weight: object,
                      loaded_shard_id: int | str | None = None) -> None:
        shard = "" if loaded_shard_id is None else f"[{loaded_shard_id!r}]"
        where = f"{type(layer).__name__}.{name}{shard}"
        if name == "weight":
            dtype = getattr(loaded_weight, "dtype", None)
            if dtype is not None and dtype != _FP8:
                raise ValueError(f"{where}: expected a {_FP8} checkpoint tensor (the layer holds float8 "
                                 f"weights: the checkpoint's quantization_config), received {dtype}")
            layer.weight_loader(param, loaded_weight, loaded_shard_id)
            return
        parts = layer.shard_parts(layer.weight)
        if name == "input_scale" or self.weight_scheme == "tensor":
            _load_part_scalar(where, param, loaded_weight, parts, loaded_shard_id)
            return
        unit = (1, 1) if self.weight_scheme == "channel" else self.block_size
        _load_scale_grid(where, param, loaded_weight, parts, loaded_shard_id, unit,
                         channel=self.weight_scheme == "channel")

    def process_weights_after_loading(self, layer: _LinearBase) -> None:
        if not self.quantize_on_load or layer.weight.dtype == _FP8:
            return
        quantized, scale = self._quantize(layer.weight.detach(), 1, layer.shard_parts(layer.weight))
        layer.weight = nn.Parameter(quantized, requires_grad=False)
        layer.register_parameter(self.scale_name, nn.Parameter(scale, requires_grad=False))
        _attach_weight_loaders(layer)

    def shard_parts(self, layer: _LinearBase, param: nn.Parameter) -> tuple[ShardPart, ...] | None:
        """Per-tensor and input scales: the same on every rank. Block scales: the weight's parts in tiles.
        Per-channel scales: the layer's rule (rows with the weight's, whole where it splits columns)."""
        name = next((n for n, p in layer.named_parameters(recurse=False) if p is param), None)
        if name == "input_scale" or (name == self.scale_name and self.weight_scheme == "tensor"):
            return replicated(param)
        if name != self.scale_name or self.weight_scheme != "block":
            return None
        parts = []
        for part in layer.shard_parts(layer.weight):
            shape = tuple(-(-size // unit) for size, unit in zip(part.shape, self.block_size, strict=True))
            if part.dim is None:
                return replicated(param)
            unit = self.block_size[part.dim]
            parts.append(ShardPart(part.shard_id, shape, part.dim, part.start // unit,
                                   -(-part.length // unit), part.param_start // unit))
        return tuple(parts)

    # Products ---------------------------------------------------------------------------------------------
    def dequantized_weight(self, layer: _LinearBase, dtype: torch.dtype) -> torch.Tensor:
        """The layer's weight ``[out_per_partition, in_per_partition]`` as ``weight.float() * scale`` in
        ``dtype``."""
        if layer.weight.dtype != _FP8:
            return layer.weight.to(dtype)
        scale = getattr(layer, self.scale_name)
        parts = layer.shard_parts(layer.weight)
        return (layer.weight.float() * self._expand(scale, layer.weight.shape, parts)).to(dtype)

    def row_scales(self, layer: _LinearBase) -> torch.Tensor | None:
        """float32 ``[out_per_partition]``, the scale of each row of the layer's float8 weight (a per-tensor
        scale expanded over its part's rows, a per-channel one as it is), for products that scale each output
        feature; None where no such scale exists: block scales, or a weight not float8 (yet)."""
        if layer.weight.dtype != _FP8 or self.weight_scheme == "block":
            return None
        return self._expand(getattr(layer, self.scale_name), layer.weight.shape,
                            layer.shard_parts(layer.weight)).reshape(-1)

    def activation_scales(self, layer: _LinearBase) -> tuple[torch.Tensor | None, float | None]:
        """``(input_scale, activation_scale_ub)`` with which the layer's product quantizes its input, as
        ``quantize_op`` takes them: the largest of the layer's static input scales (the one scale the shared
        input can have), or None for dynamic per-token scales."""
        return (layer.input_scale.max() if self.static_input_scale else None), self.activation_scale_ub

    def tensor_cores_apply(self, layer: _LinearBase, input_: torch.Tensor) -> bool:
        """Whether :meth:`apply` multiplies ``input_`` on float8 tensor cores, its activations quantized by
        ``quantize_op``, where ``decode_op`` declines it: per-tensor or per-channel float8 weights, a
        ``quantize_op``, and a device, dtype and sizes that ``torch._scaled_mm`` takes."""
        return (self.quantize_op is not None and self.weight_scheme != "block"
                and _scaled_mm_applies(input_, layer.weight))

    def apply_quantized(self, layer: _LinearBase, quantized: torch.Tensor, scale: torch.Tensor,
                        bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        """``(quantized * scale) @ W.T + bias`` of activations already quantized (by ``quantize_op`` or an op
        that fuses it with what makes them): ``quantized`` float8 E4M3 ``[num_tokens, in_per_partition]``,
        ``scale`` float32 ``[num_tokens, 1]`` -> ``[num_tokens, out_per_partition]`` in ``out_dtype``. On
        float8 tensor cores where :meth:`tensor_cores_apply` says so, elsewhere in float32 on the dequantized
        operands; per-tensor and per-channel weights only."""
        where = f"{type(layer).__name__}.apply_quantized"
        row_scales = self.row_scales(layer)  # [out_per_partition]
        if row_scales is None:
            raise ValueError(f"{where}: expected float8 weights with one scale a tensor or a row, got "
                             f"{layer.weight.dtype} weights with weight_scheme {self.weight_scheme!r}")
        in_features = layer.weight.shape[1]
        if quantized.dtype != _FP8 or quantized.dim() != 2 or quantized.shape[1] != in_features:
            raise ValueError(f"{where}: quantized: expected {_FP8} [num_tokens, {in_features}], got "
                             f"{quantized.dtype} {list(quantized.shape)}")
        if scale.dtype != torch.float32 or scale.shape != (quantized.shape[0], 1):
            raise ValueError(f"{where}: scale: expected torch.float32 [{quantized.shape[0]}, 1], got "
                             f"{scale.dtype} {list(scale.shape)}")
        if quantized.is_cuda and _tensor_cores_take(quantized.device, out_dtype, layer.weight):
            return _scaled_product(quantized, scale, layer.weight, row_scales, bias, out_dtype)
        weight = layer.weight.float() * row_scales[:, None]
        out = F.linear(quantized.float() * scale, weight).to(out_dtype)
        return out if bias is None else out + bias

    def apply(self, layer: _LinearBase, input_: torch.Tensor, bias: torch.Tensor | None,
              rows: slice | None = None) -> torch.Tensor:
        weight = layer.weight if rows is None else layer.weight[rows]
        per_row = weight.dtype == _FP8 and self.weight_scheme != "block" and input_.is_cuda
        if per_row:
            row_scales = self.row_scales(layer)  # [out_per_partition]
            if rows is not None:
                row_scales = row_scales[rows]
            out = None if self.decode_op is None else self.decode_op(input_, weight, row_scales, bias)
            if out is not None:
                return out
        if per_row and self.quantize_op is not None and _scaled_mm_applies(input_, weight):
            return _fp8_product(input_, weight, row_scales, bias, *self.activation_scales(layer),
                                self.quantize_op)
        dequantized = self.dequantized_weight(layer, input_.dtype)
        return F.linear(input_, dequantized if rows is None else dequantized[rows], bias)


def set_quant_method(module: nn.Module, method: QuantizationMethod, skip: Sequence[str] = ()) -> int:
    """Gives every tpkit linear layer in ``module`` (itself included) ``method``, except those whose name
    (``module.named_modules()``) is in ``skip`` or ends with ``"." + entry``; their weights are converted
    as :meth:`QuantizationMethod.create_weights` does. Returns how many layers."""
    from .linear import _LinearBase

    if not isinstance(method, QuantizationMethod):
        raise TypeError(f"set_quant_method: method: expected a QuantizationMethod, got "
                        f"{type(method).__name__}")
    count = 0
    for name, layer in module.named_modules():
        if not isinstance(layer, _LinearBase) or any(name == s or name.endswith("." + s) for s in skip):
            continue
        if layer.quant_method is not None:
            raise ValueError(f"set_quant_method: {name or type(layer).__name__} already has "
                             f"{layer.quant_method!r}")
        layer.quant_method = method
        method.create_weights(layer)
        count += 1
    return count


def process_weights_after_loading(module: nn.Module) -> None:
    """Lets every quantized layer's method finish its weights once a checkpoint is loaded."""
    from .linear import _LinearBase

    for layer in module.modules():
        if isinstance(layer, _LinearBase) and layer.quant_method is not None:
            layer.quant_method.process_weights_after_loading(layer)


# Helpers ----------------------------------------------------------------------------------------------------

def _part_rows(parts: Sequence[ShardPart], rows: int) -> list[int]:
    """The rows of each logical part in the weight (a row-split or replicated weight: one part)."""
    if any(part.dim != 0 for part in parts):
        return [rows]
    return [part.length for part in parts]


def _tile_amax(w: torch.Tensor, block_size: tuple[int, int]) -> torch.Tensor:
    """[row_tiles, column_tiles]: the largest magnitude of each tile of w [rows, columns] (edge tiles
    partial)."""
    rows, columns = w.shape
    block_rows, block_columns = block_size
    padded = F.pad(w.abs(), (0, -columns % block_columns, 0, -rows % block_rows))
    return padded.unflatten(1, (-1, block_columns)).unflatten(0, (-1, block_rows)).amax(dim=(1, 3))


def _check_block_alignment(layer: _LinearBase, parts: Sequence[ShardPart],
                           block_size: tuple[int, int]) -> None:
    for part in parts:
        if part.dim is None:
            continue
        unit = block_size[part.dim]
        ends_tensor = part.start + part.length == part.shape[part.dim]
        if part.start % unit or part.param_start % unit or (part.length % unit and not ends_tensor):
            what = "rows" if part.dim == 0 else "columns"
            raise ValueError(f"{type(layer).__name__}: block-wise float8 weights: this rank's {what} "
                             f"[{part.start}, {part.start + part.length}) of logical tensor "
                             f"{part.shard_id!r} (at {part.param_start} in the weight) must start at a "
                             f"multiple of the block size {unit} (shape {list(part.shape)}, tp_size "
                             f"{layer.tp_size})")


def _shard_index(where: str, parts: Sequence[ShardPart], loaded_shard_id: int | str | None) -> list[int]:
    """The parts a checkpoint tensor with ``loaded_shard_id`` loads (None: all, a fused tensor)."""
    if loaded_shard_id is None:
        return list(range(len(parts)))
    ids = [part.shard_id for part in parts]
    if loaded_shard_id not in ids or isinstance(loaded_shard_id, bool):
        raise ValueError(f"{where}: loaded_shard_id must be one of {ids}, received {loaded_shard_id!r}")
    return [ids.index(loaded_shard_id)]


def _load_part_scalar(where: str, param: nn.Parameter, loaded_weight: object, parts: Sequence[ShardPart],
                      loaded_shard_id: int | str | None) -> None:
    """A per-tensor scale (shape [] or [1] in the checkpoint) into the entries of its parts."""
    shape = tuple(getattr(loaded_weight, "shape", ()))
    if shape not in ((), (1,)):
        raise ValueError(f"{where}: expected a per-tensor scale of shape () or (1,), received {shape}")
    value = torch.as_tensor(loaded_weight[...]).reshape(())
    with torch.no_grad():
        for index in _shard_index(where, parts, loaded_shard_id):
            param[index].copy_(value)


def _load_scale_grid(where: str, param: nn.Parameter, loaded_weight: object, parts: Sequence[ShardPart],
                     loaded_shard_id: int | str | None, unit: tuple[int, int], *, channel: bool) -> None:
    """A per-channel scale [rows, 1] or a block scale [row_tiles, column_tiles]: this rank's rows (or
    columns) of it, cut where the layer cuts its weight, in units of the tiles."""
    chosen = _shard_index(where, parts, loaded_shard_id)
    split = [parts[i] for i in chosen]
    dim = split[0].dim
    # The checkpoint tensor's logical weight shape: one part's, or the fused parts' stacked along dim 0.
    rows = sum(part.shape[0] for part in split) if dim == 0 else split[0].shape[0]
    columns = split[0].shape[1]
    expected = (rows, 1) if channel else (-(-rows // unit[0]), -(-columns // unit[1]))
    if dim is None:
        _check_shape(where, loaded_weight, expected)
        _copy_whole(param, loaded_weight)
        return
    pieces: list[Piece] = []
    offset = 0
    for part in split:
        step = unit[dim]
        pieces.append((part.param_start // step, (offset + part.start) // step, -(-part.length // step)))
        offset += part.shape[0] if dim == 0 else 0
    _check_shape(where, loaded_weight, expected)
    if dim == 1 and channel:  # a row-parallel layer's per-channel scale: every rank holds all rows
        _copy_whole(param, loaded_weight)
        return
    _copy_pieces(param, loaded_weight, dim, pieces)


def _scaled_mm_applies(input_: torch.Tensor, weight: torch.Tensor) -> bool:
    """float8 tensor cores for ``input_`` (a CUDA tensor, no gradient wanted) and ``weight``."""
    if not input_.is_cuda or torch.is_grad_enabled():
        return False
    return _tensor_cores_take(input_.device, input_.dtype, weight)


def _tensor_cores_take(device: torch.device, out_dtype: torch.dtype, weight: torch.Tensor) -> bool:
    """``torch._scaled_mm`` on ``device``: compute capability 8.9+, a bfloat16 output (the dtype it takes with
    per-row scales) and a float8 ``weight`` whose sizes are multiples of 16."""
    if out_dtype != torch.bfloat16 or weight.dtype != _FP8:
        return False
    if weight.shape[0] % 16 or weight.shape[1] % 16 or weight.stride(1) != 1:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _fp8_product(input_: torch.Tensor, weight: torch.Tensor, row_scales: torch.Tensor,
                 bias: torch.Tensor | None, input_scale: torch.Tensor | None,
                 activation_scale_ub: float | None,
                 quantize_op: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """``input_ @ (weight * row_scales[:, None]).T + bias`` on float8 tensor cores, the input quantized per
    token (or with the static ``input_scale``) by ``quantize_op``, both scales applied in the product's
    epilogue."""
    rows = input_.reshape(-1, input_.shape[-1])  # [num_tokens, in_features]
    quantized, scale_a = quantize_op(rows, input_scale, activation_scale_ub)
    out = _scaled_product(quantized, scale_a, weight, row_scales, bias, input_.dtype)
    return out.view(*input_.shape[:-1], weight.shape[0])


def _scaled_product(quantized: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor,
                    row_scales: torch.Tensor, bias: torch.Tensor | None,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """quantized float8 [num_tokens, in_features] with scale [num_tokens, 1] times the float8 weight
    [out_features, in_features] with row_scales [out_features], on float8 tensor cores, plus bias."""
    out = torch._scaled_mm(quantized, weight.t(), scale_a=scale, scale_b=row_scales.float().view(1, -1),
                           out_dtype=out_dtype)
    return out if bias is None else out + bias
