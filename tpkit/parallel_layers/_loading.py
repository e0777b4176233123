"""What every weight loader does: check the checkpoint tensor, read only this rank's part, copy it in.

A loaded weight is a ``torch.Tensor`` or a lazy handle (``tpkit.loaders``); only ``.shape`` and
``.narrow(dim, start, length)`` are used, and ``narrow`` of a handle reads just those bytes, so a rank never
materialises more of a checkpoint tensor than its shard. Where the weight has ``copy_to(dst, part)``, each
part is offered to it first: a handle knows where its bytes come from and how they reach ``dst`` fastest
(the loaders' handles copy into a GPU by DMA from the file's page cache, or through page-locked buffers);
what it declines is copied with ``copy_``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from .sharding import _refuse_plain_dcp

# (start in the parameter, start in the checkpoint tensor, length), all along one dimension
Piece = tuple[int, int, int]

def _shape_of(loaded_weight: object) -> tuple[int, ...]:
    shape = getattr(loaded_weight, "shape", None)
    try:
        if not callable(getattr(loaded_weight, "narrow", None)):
            raise TypeError
        return tuple(int(size) for size in shape)
    except TypeError:
        raise TypeError("loaded_weight must be a torch.Tensor or a lazy tensor handle with .shape and "
                        f".narrow, got {type(loaded_weight).__name__}") from None


def _param_name(module: nn.Module, param: torch.Tensor, loaded_shard_id: object = None) -> str:
    """``Layer.weight`` (with the shard id when there is one), for error messages."""
    attr = next((name for name, p in module.named_parameters(recurse=False) if p is param), "parameter")
    name = f"{type(module).__name__}.{attr}"
    return name if loaded_shard_id is None else f"{name}[{loaded_shard_id!r}]"


def _check_shape(name: str, loaded_weight: object, expected: Sequence[int]) -> None:
    received = _shape_of(loaded_weight)
    if received != tuple(expected):
        raise ValueError(f"{name}: expected a checkpoint tensor of shape {tuple(expected)}, "
                         f"received {received}")


def _reject_shard_id(name: str, loaded_shard_id: object) -> None:
    if loaded_shard_id is not None:
        raise ValueError(f"{name} is not a stacked parameter: expected loaded_shard_id=None, "
                         f"received {loaded_shard_id!r}")


def _attach_weight_loaders(module: nn.Module) -> None:
    """Gives each of the module's own parameters ``param.weight_loader`` = the module's loader, or the one
    its quantization method gave that parameter (``module._quant_loaders``, by name)."""
    special = getattr(module, "_quant_loaders", {})
    for name, param in module.named_parameters(recurse=False):
        param.weight_loader = special.get(name, module.weight_loader)


class _LoadableModule(nn.Module):
    """A layer whose own parameters carry ``param.weight_loader``, also after whatever makes new Parameter
    objects without the attribute: ``copy.deepcopy`` and unpickling (``__setstate__``), and conversions that
    cannot swap data in place, such as ``to_empty`` from the meta device (``_apply``).

    Subclasses define ``weight_loader``, ``shard_parts(param)`` (``tpkit.parallel_layers.sharding``),
    ``tp_rank`` and ``tp_size``, and call ``_attach_weight_loaders(self)`` once their parameters exist. Their
    ``state_dict`` marks each sharded tensor so that torch.distributed.checkpoint refuses it (see there).
    """

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # noqa: ANN001, ANN202 (nn.Module's)
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.tp_size == 1:
            return
        for name, param in self.named_parameters(recurse=False):
            sharded = any(part.dim is not None for part in self.shard_parts(param))
            if sharded and prefix + name in destination:
                _refuse_plain_dcp(destination[prefix + name], prefix + name, self.tp_rank, self.tp_size)

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        _attach_weight_loaders(self)

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 (nn.Module's private signature)
        module = super()._apply(fn, recurse)
        _attach_weight_loaders(self)
        return module


def _copy_pieces(param: torch.Tensor, loaded_weight: object, dim: int, pieces: Sequence[Piece]) -> None:
    """Copies each piece of ``loaded_weight`` along ``dim`` into ``param``, casting to its dtype.

    Every piece is read before the first is written, so a failing read leaves the parameter untouched.
    """
    sources = [loaded_weight.narrow(dim, src_start, length) for _, src_start, length in pieces if length]
    copy_to = getattr(loaded_weight, "copy_to", None)
    with torch.no_grad():
        for (dst_start, _, length), source in zip([p for p in pieces if p[2]], sources, strict=True):
            dst = param.narrow(dim, dst_start, length)
            if copy_to is None or not copy_to(dst, source):
                dst.copy_(source)


def _copy_whole(param: torch.Tensor, loaded_weight: object) -> None:
    """Copies an unsharded (replicated) tensor: the whole checkpoint tensor."""
    _copy_pieces(param, loaded_weight, 0, [(0, 0, param.shape[0])])
