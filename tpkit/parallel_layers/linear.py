"""Linear layers sharded over a tensor-parallel group (Megatron / vLLM style).

* :class:`ReplicatedLinear`: the whole matrix on every rank.
* :class:`ColumnParallelLinear`: output features split; ``gather_output`` concatenates them again.
* :class:`MergedColumnParallelLinear`: several column-parallel matrices in one (``gate_up_proj``), each
  split on its own, so every rank holds its part of each.
* :class:`~tpkit.parallel_layers.QKVParallelLinear` (:mod:`.qkv`): q, k and v of attention by heads; KV
  heads are replicated when there are fewer of them than ranks.
* :class:`RowParallelLinear`: input features split; partial results summed by one all-reduce.

With ``sequence_parallel=True`` (Megatron-LM's sequence parallelism, for training) the activations between a
row-parallel layer and the next column-parallel one are split along the sequence (the dim before the
features) rather than replicated: a column-parallel layer all-gathers its input's tokens, a row-parallel one
reduce-scatters its output over them. The norms in between then see 1 / tp_size of the tokens:
:func:`~tpkit.parallel_layers.mark_sequence_parallel` them, and sum their gradients with
:func:`~tpkit.parallel_layers.reduce_sequence_parallel_grads` after backward. With
``overlap_communication=True`` as well, the gather and the reduce-scatter run as rings overlapped with the
products (:mod:`.overlap`).

Forward is ``F.linear`` like ``nn.Linear`` (or the layer's ``linear_op``, :mod:`.linear_op`); with
``skip_bias_add=True`` it returns ``(output, bias)`` so the caller can fuse the bias into what follows.
Weights are ``[output_size_per_partition, input_size_per_partition]``; every parameter carries
``param.weight_loader(param, loaded_weight, loaded_shard_id=None)`` that copies this rank's part of the full
checkpoint tensor.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from ._checks import _check_positive, _divide
from ._init import _shard_seed, _uniform_
from ._loading import (
    Piece,
    _attach_weight_loaders,
    _check_shape,
    _copy_pieces,
    _copy_whole,
    _LoadableModule,
    _param_name,
    _reject_shard_id,
)
from .linear_op import _UsesLinearOp
from .mappings import (
    _reduce_from_tp_region_,
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
)
from .overlap import _check_overlap, all_gather_matmul, matmul_reduce_scatter
from .quantization import QuantizationMethod
from .sharding import ShardPart, replicated
from .state import TPGroup, _resolve_tp_group

_TPGroupArg = TPGroup | dist.ProcessGroup | None


class _LinearBase(_UsesLinearOp, _LoadableModule):
    """Parameters, defaults and the ``skip_bias_add`` convention shared by all linear layers.

    Each layer defines ``reset_parameters`` (its default initialisation, run here) and ``weight_loader``
    (attached here to every parameter; ``_LoadableModule`` keeps it there through copies and conversions).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        input_size_per_partition: int,
        output_size_per_partition: int,
        *,
        bias: bool,
        skip_bias_add: bool,
        tp: TPGroup,
        params_dtype: torch.dtype | None,
        device: torch.device | str | None,
        quant_method: QuantizationMethod | None = None,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_partition = input_size_per_partition
        self.output_size_per_partition = output_size_per_partition
        self.skip_bias_add = skip_bias_add
        self.tp_group = tp
        self.tp_rank = tp.rank
        self.tp_size = tp.size
        self.params_dtype = params_dtype or torch.get_default_dtype()
        factory = {"dtype": self.params_dtype, "device": device}
        # [output_size_per_partition, input_size_per_partition]
        self.weight = nn.Parameter(
            torch.empty(output_size_per_partition, input_size_per_partition, **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size_per_partition, **factory))
        else:
            self.register_parameter("bias", None)
        _attach_weight_loaders(self)
        self.reset_parameters()
        if quant_method is not None:
            self.quant_method = quant_method
            quant_method.create_weights(self)

    # How the layer holds and multiplies its weight (tpkit.parallel_layers.quantization); None: as it is,
    # through linear_op.
    quant_method: QuantizationMethod | None = None

    def _product(self, input_: torch.Tensor, bias: torch.Tensor | None, rows: slice | None = None
                 ) -> torch.Tensor:
        """``input_ @ weight[rows].T + bias``: the quantization method's product, else ``linear_op``'s."""
        if self.quant_method is not None:
            return self.quant_method.apply(self, input_, bias, rows)
        return self.linear_op(input_, self.weight if rows is None else self.weight[rows], bias)

    def _quantized_shard_parts(self, param: nn.Parameter) -> tuple[ShardPart, ...] | None:
        """A quantization method's parameters' layout (its scales'), or None for the layer's own rule."""
        return None if self.quant_method is None else self.quant_method.shard_parts(self, param)

    def _grad_holders(self, param: nn.Parameter) -> int | torch.Tensor:
        """How many ranks of the group hold each row of ``param`` (an int, or one a row): gradient norms count
        every row once. ReplicatedLinear's default: every rank."""
        return self.tp_size

    def shard_parts(self, param: nn.Parameter) -> tuple[ShardPart, ...]:
        """The logical tensors ``param`` holds rows of, and where (``tpkit.parallel_layers.sharding``).
        ReplicatedLinear's default: the whole parameter on every rank."""
        return replicated(param)

    def _init_bound(self) -> float:
        # nn.Linear's kaiming-uniform bound over the full fan-in, whatever this rank's share of it.
        return 1.0 / math.sqrt(self.input_size)

    def _with_bias(self, output: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        return (output, self.bias) if self.skip_bias_add else output

    def _check_input(self, input_: torch.Tensor, width: int, why: str = "input_size") -> None:
        """The input's features, ``[..., width]``, named with ``why`` (F.linear's own error names neither
        the layer nor which size it expected)."""
        if not isinstance(input_, torch.Tensor) or input_.dim() == 0 or input_.shape[-1] != width:
            got = list(input_.shape) if isinstance(input_, torch.Tensor) else type(input_).__name__
            raise ValueError(f"{type(self).__name__}: input: expected a last dimension of {width} ({why}), "
                             f"got shape {got}")

    def extra_repr(self) -> str:
        quant = "" if self.quant_method is None else f", quant_method={self.quant_method!r}"
        return (f"input_size={self.input_size}, output_size={self.output_size}, "
                f"bias={self.bias is not None}, tp_size={self.tp_size}, weight={tuple(self.weight.shape)}"
                f"{quant}")


class ReplicatedLinear(_LinearBase):
    """``nn.Linear`` with the weight loader protocol: the same full matrix on every rank."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        skip_bias_add: bool = False,
        *,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        tp_group: _TPGroupArg = None,
        quant_method: QuantizationMethod | None = None,
    ) -> None:
        _check_positive(input_size=input_size, output_size=output_size)
        super().__init__(input_size, output_size, input_size, output_size, bias=bias,
                         skip_bias_add=skip_bias_add, tp=_resolve_tp_group(tp_group),
                         params_dtype=params_dtype, device=device, quant_method=quant_method)

    def reset_parameters(self) -> None:
        for param in (self.weight, self.bias):
            if param is not None:
                _uniform_(param, self._init_bound(), None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: int | str | None = None) -> None:
        name = _param_name(self, param)
        _reject_shard_id(name, loaded_shard_id)
        _check_shape(name, loaded_weight, param.shape)
        _copy_whole(param, loaded_weight)

    def forward(self, input_: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        # [..., input_size] -> [..., output_size]
        self._check_input(input_, self.input_size)
        output = self._product(input_, None if self.skip_bias_add else self.bias)
        return self._with_bias(output)


class _ColumnParallelBase(_LinearBase):
    """Output features split over the ranks: rank r computes its rows of ``x @ W.T``.

    Subclasses say which rows of the full output a rank holds (:meth:`_row_pieces`); the forward, the
    initialisation and the loading follow from that.
    """

    def __init__(self, input_size: int, output_size: int, output_size_per_partition: int, *, bias: bool,
                 gather_output: bool, skip_bias_add: bool, sequence_parallel: bool, tp: TPGroup,
                 params_dtype: torch.dtype | None, device: torch.device | str | None,
                 quant_method: QuantizationMethod | None = None, overlap_communication: bool = False) -> None:
        if sequence_parallel and gather_output:
            raise ValueError("sequence_parallel=True takes the output split over the ranks: expected "
                             "gather_output=False, received True")
        _check_overlap(type(self).__name__, overlap_communication, sequence_parallel, quant_method)
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel
        self.overlap_communication = overlap_communication
        super().__init__(input_size, output_size, input_size, output_size_per_partition, bias=bias,
                         skip_bias_add=skip_bias_add, tp=tp, params_dtype=params_dtype, device=device,
                         quant_method=quant_method)

    def _grad_holders(self, param: nn.Parameter) -> int | torch.Tensor:
        return 1

    def _row_pieces(self) -> list[tuple[int, int, int, int]]:
        """(start in this rank's rows, start in the full output, length, block index) for each block of rows.

        The block index names the block of the full matrix: the initialisation gives distinct blocks distinct
        values and replicas of one block (a replicated KV head) the same.
        """
        rows = self.output_size_per_partition
        return [(0, self.tp_rank * rows, rows, self.tp_rank)]

    def _logical_rows(self) -> list[tuple[int | str | None, int, int, int, int]]:
        """(shard id, rows of the logical tensor, this rank's first row of it, how many, start in this rank's
        rows) for each logical tensor the weight stacks."""
        rows = self.output_size_per_partition
        return [(None, self.output_size, self.tp_rank * rows, rows, 0)]

    def shard_parts(self, param: nn.Parameter) -> tuple[ShardPart, ...]:
        quantized = self._quantized_shard_parts(param)
        if quantized is not None:
            return quantized
        return tuple(ShardPart(shard_id, (total, *param.shape[1:]), 0, start, length, param_start)
                     for shard_id, total, start, length, param_start in self._logical_rows())

    def reset_parameters(self) -> None:
        bound = self._init_bound()
        for param in (self.weight, self.bias):
            if param is None:
                continue
            seed = _shard_seed(self.tp_group)
            for dst_start, _, length, block in self._row_pieces():
                _uniform_(param.narrow(0, dst_start, length), bound, None if seed is None else seed + block)

    def _load_rows(self, param: nn.Parameter, loaded_weight: torch.Tensor, name: str, total_rows: int,
                   pieces: list[Piece]) -> None:
        _check_shape(name, loaded_weight, (total_rows, *param.shape[1:]))
        _copy_pieces(param, loaded_weight, 0, pieces)

    def _input_region(self, input_: torch.Tensor) -> torch.Tensor:
        """The input every rank multiplies: the same tensor (its gradient summed over the ranks), or with
        sequence parallelism every rank's tokens gathered, ``[..., seq / tp_size, input_size]`` ->
        ``[..., seq, input_size]``."""
        if self.tp_size == 1:
            return input_
        if self.sequence_parallel:
            return gather_from_sequence_parallel_region(input_, self.tp_group, partial_grad=True)
        return copy_to_tp_region(input_, self.tp_group)

    def forward(self, input_: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        # [..., input_size] -> [..., output_size_per_partition] (or [..., output_size] with gather_output)
        self._check_input(input_, self.input_size)
        if self.overlap_communication and self.tp_size > 1:
            output = all_gather_matmul(input_, self.weight, None if self.skip_bias_add else self.bias,
                                       self.tp_group, linear_op=self.linear_op)
        else:
            output = self._product(self._input_region(input_), None if self.skip_bias_add else self.bias)
        if not (self.gather_output and self.tp_size > 1):
            return self._with_bias(output)
        output = gather_from_tp_region(output, self.tp_group)
        if self.skip_bias_add and self.bias is not None:
            return output, gather_from_tp_region(self.bias, self.tp_group)
        return self._with_bias(output)


class ColumnParallelLinear(_ColumnParallelBase):
    """``Y = X W^T + b`` with W's rows (output features) split: rank r holds rows ``[r * n, (r + 1) * n)``.

    The output is this rank's ``[..., output_size / tp_size]``, or the full ``[..., output_size]`` with
    ``gather_output=True``. With ``skip_bias_add`` the returned bias matches the output (gathered too).
    With ``sequence_parallel=True`` the input is this rank's tokens, ``[..., seq / tp_size, input_size]``,
    gathered before the product (module docstring).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        gather_output: bool = False,
        skip_bias_add: bool = False,
        *,
        sequence_parallel: bool = False,
        overlap_communication: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        tp_group: _TPGroupArg = None,
        quant_method: QuantizationMethod | None = None,
    ) -> None:
        _check_positive(input_size=input_size, output_size=output_size)
        tp = _resolve_tp_group(tp_group)
        super().__init__(input_size, output_size, _divide(output_size, tp.size, "output_size"), bias=bias,
                         gather_output=gather_output, skip_bias_add=skip_bias_add,
                         sequence_parallel=sequence_parallel, tp=tp, params_dtype=params_dtype, device=device,
                         quant_method=quant_method, overlap_communication=overlap_communication)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: int | str | None = None) -> None:
        name = _param_name(self, param)
        _reject_shard_id(name, loaded_shard_id)
        pieces = [(dst, src, length) for dst, src, length, _ in self._row_pieces()]
        self._load_rows(param, loaded_weight, name, self.output_size, pieces)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked, each split on its own (e.g. ``gate_up_proj``).

    For ``output_sizes=[a, b]`` rank r holds rows ``[r * a/tp, (r+1) * a/tp)`` of the first and the same
    share of the second, so its output is ``[..., a/tp + b/tp]`` = its part of each. ``weight_loader``
    takes ``loaded_shard_id`` = the index into ``output_sizes``, or None for a checkpoint tensor that
    already stacks them all.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = True,
        gather_output: bool = False,
        skip_bias_add: bool = False,
        *,
        sequence_parallel: bool = False,
        overlap_communication: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        tp_group: _TPGroupArg = None,
        quant_method: QuantizationMethod | None = None,
    ) -> None:
        if not output_sizes:
            raise ValueError("output_sizes must list at least one size, got an empty list")
        _check_positive(**{f"output_sizes[{i}]": size for i, size in enumerate(output_sizes)})
        tp = _resolve_tp_group(tp_group)
        for i, size in enumerate(output_sizes):
            _divide(size, tp.size, f"output_sizes[{i}]")
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias=bias, gather_output=gather_output,
                         skip_bias_add=skip_bias_add, sequence_parallel=sequence_parallel,
                         params_dtype=params_dtype, device=device, tp_group=tp, quant_method=quant_method,
                         overlap_communication=overlap_communication)

    def _shard_pieces(self, index: int) -> tuple[int, int, int]:
        """(start in this rank's rows, start in the full output, length) of matrix ``index``'s share."""
        local = [size // self.tp_size for size in self.output_sizes]
        return sum(local[:index]), sum(self.output_sizes[:index]) + self.tp_rank * local[index], local[index]

    def _row_pieces(self) -> list[tuple[int, int, int, int]]:
        return [(*self._shard_pieces(i), i * self.tp_size + self.tp_rank)
                for i in range(len(self.output_sizes))]

    def _logical_rows(self) -> list[tuple[int | str | None, int, int, int, int]]:
        rows = []
        for i, size in enumerate(self.output_sizes):
            dst_start, full_start, length = self._shard_pieces(i)
            rows.append((i, size, full_start - sum(self.output_sizes[:i]), length, dst_start))
        return rows

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: int | str | None = None) -> None:
        name = _param_name(self, param, loaded_shard_id)
        if loaded_shard_id is None:
            pieces = [self._shard_pieces(i) for i in range(len(self.output_sizes))]
            self._load_rows(param, loaded_weight, name, self.output_size, pieces)
            return
        if (isinstance(loaded_shard_id, bool) or not isinstance(loaded_shard_id, int)
                or not 0 <= loaded_shard_id < len(self.output_sizes)):
            raise ValueError(f"{name}: loaded_shard_id must be an index into output_sizes "
                             f"(0..{len(self.output_sizes) - 1}) or None, received {loaded_shard_id!r}")
        _, total, src_start, length, dst_start = self._logical_rows()[loaded_shard_id]
        self._load_rows(param, loaded_weight, name, total, [(dst_start, src_start, length)])


class RowParallelLinear(_LinearBase):
    """``Y = X W^T + b`` with W's columns (input features) split: rank r holds ``[r * n, (r + 1) * n)``.

    The input is this rank's ``[..., input_size / tp_size]`` (``input_is_parallel=True``, e.g. the output of
    a column-parallel layer), or the full input, which is then split. Partial products are summed with one
    all-reduce and the bias is added once, after it. With ``reduce_results=False`` the caller sums them
    (it must, to get the layer's output): tp rank 0 adds the bias so the sum holds it once, and the other
    ranks add a zero that carries its gradient, so every rank's copy of the bias gets the same gradient.
    With ``sequence_parallel=True`` the partial products are reduce-scattered over the tokens instead, the
    output this rank's ``[..., seq / tp_size, output_size]`` (module docstring); the bias, added to it, then
    gets the gradient of this rank's tokens only, which
    :func:`~tpkit.parallel_layers.reduce_sequence_parallel_grads` sums.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        reduce_results: bool = True,
        skip_bias_add: bool = False,
        *,
        sequence_parallel: bool = False,
        overlap_communication: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        tp_group: _TPGroupArg = None,
        quant_method: QuantizationMethod | None = None,
    ) -> None:
        _check_positive(input_size=input_size, output_size=output_size)
        if sequence_parallel and not (input_is_parallel and reduce_results):
            raise ValueError(f"sequence_parallel=True takes a split input and reduces the results: expected "
                             f"input_is_parallel=True and reduce_results=True, received {input_is_parallel} "
                             f"and {reduce_results}")
        _check_overlap(type(self).__name__, overlap_communication, sequence_parallel, quant_method)
        tp = _resolve_tp_group(tp_group)
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.sequence_parallel = sequence_parallel
        self.overlap_communication = overlap_communication
        super().__init__(input_size, output_size, _divide(input_size, tp.size, "input_size"), output_size,
                         bias=bias, skip_bias_add=skip_bias_add, tp=tp, params_dtype=params_dtype,
                         device=device, quant_method=quant_method)

    def reset_parameters(self) -> None:
        seed = _shard_seed(self.tp_group)
        _uniform_(self.weight, self._init_bound(), None if seed is None else seed + self.tp_rank)
        if self.bias is not None:
            _uniform_(self.bias, self._init_bound(), None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: int | str | None = None) -> None:
        name = _param_name(self, param)
        _reject_shard_id(name, loaded_shard_id)
        if param.dim() == 1:  # the bias, replicated
            _check_shape(name, loaded_weight, param.shape)
            _copy_whole(param, loaded_weight)
            return
        _check_shape(name, loaded_weight, (self.output_size, self.input_size))
        columns = self.input_size_per_partition
        _copy_pieces(param, loaded_weight, 1, [(0, self.tp_rank * columns, columns)])

    def _grad_holders(self, param: nn.Parameter) -> int | torch.Tensor:
        return 1 if param is self.weight else self.tp_size  # the bias: on every rank

    def shard_parts(self, param: nn.Parameter) -> tuple[ShardPart, ...]:
        quantized = self._quantized_shard_parts(param)
        if quantized is not None:
            return quantized
        if param is not self.weight:
            return replicated(param)
        columns = self.input_size_per_partition
        return (ShardPart(None, (self.output_size, self.input_size), 1, self.tp_rank * columns, columns),)

    def forward(self, input_: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        # [..., input_size_per_partition] (or [..., input_size]) -> [..., output_size]
        if self.input_is_parallel and self.tp_size > 1:
            self._check_input(input_, self.input_size_per_partition,
                              f"this rank's share of input_size {self.input_size}: input_is_parallel=True")
        else:
            self._check_input(input_, self.input_size)
        add_bias = self.bias is not None and not self.skip_bias_add
        if self.tp_size == 1:
            return self._with_bias(self._product(input_, self.bias if add_bias else None))
        if not self.input_is_parallel:
            input_ = scatter_to_tp_region(input_, self.tp_group)
        if self.sequence_parallel:
            if self.overlap_communication:
                output = matmul_reduce_scatter(input_, self.weight, self.tp_group, linear_op=self.linear_op)
            else:
                output = reduce_scatter_to_sequence_parallel_region(self._product(input_, None),
                                                                    self.tp_group)
            return self._with_bias(output + self.bias if add_bias else output)
        output = self._product(input_, None)
        if self.reduce_results:
            output = _reduce_from_tp_region_(output, self.tp_group)
            if add_bias:
                output = output.add_(self.bias)
        elif add_bias:
            if self.tp_rank == 0:
                output = output.add_(self.bias)
            elif torch.is_grad_enabled() and self.bias.requires_grad:
                output = output.add_(self.bias - self.bias.detach())
        return self._with_bias(output)
