"""How a layer's parameter is laid out over the ranks: the logical tensors it holds parts of, and where.

A tensor-parallel parameter is this rank's part of one or more logical tensors, the tensors a checkpoint of
the unsharded model holds: a ``QKVParallelLinear`` weight holds rows of q, k and v, each split on its own; a
``MergedColumnParallelLinear`` weight rows of each merged matrix; a vocabulary-parallel weight rows of the
unpadded vocabulary (its padding rows belong to no logical tensor). Each tpkit layer describes this with
``layer.shard_parts(param)``, one :class:`ShardPart` a logical tensor, in the order a fused checkpoint
tensor stacks them (the order ``weight_loader(param, tensor, None)`` takes). The logical tensors' shapes do
not depend on tp_size, so a checkpoint that stores them can be read back at any tp_size
(``tpkit.checkpoint``).

A ``model.state_dict()`` holds each rank's parameters as they are, a shard on every rank under one name.
``torch.distributed.checkpoint`` takes same-named plain tensors for replicas and keeps one of them, so it
would store one rank's shard for all; the layers' ``state_dict`` therefore marks each sharded tensor so that
DCP refuses it with an error that points at ``tpkit.checkpoint.sharded_state_dict``, while ``state_dict``,
``load_state_dict`` and ``torch.save`` of a rank's own tensors work as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ShardPart:
    """One logical tensor of a parameter and this rank's rows of it.

    - ``shard_id``: the part's name, the ``loaded_shard_id`` its weight loader takes ("q", "k", "v"; an
      index into a merged layer's ``output_sizes``), or None where the parameter is one logical tensor.
    - ``shape``: the logical tensor's full shape, the same at every tp_size (a vocabulary unpadded).
    - ``dim``: the dimension split over the ranks; None where every rank holds the whole tensor.
    - ``start``, ``length``: this rank's rows ``[start, start + length)`` of the logical tensor along
      ``dim`` (``length`` 0: none, e.g. a trailing rank of padding only). Replicas of one KV head hold
      the same rows on several ranks.
    - ``param_start``: where those rows start along ``dim`` in the parameter.

    Where ``dim`` is None, ``start``, ``length`` and ``param_start`` are 0 and the part is the parameter.
    """

    shard_id: int | str | None
    shape: tuple[int, ...]
    dim: int | None
    start: int
    length: int
    param_start: int = 0

    def local(self, param: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the logical tensor: a view of ``param``."""
        if self.dim is None:
            return param
        return param.narrow(self.dim, self.param_start, self.length)


def replicated(param: torch.Tensor) -> tuple[ShardPart, ...]:
    """The description of a parameter that every rank holds whole (a norm, a row-parallel bias)."""
    return (ShardPart(None, tuple(param.shape), None, 0, 0),)


def _refuse_plain_dcp(tensor: torch.Tensor, name: str, tp_rank: int, tp_size: int) -> None:
    """Marks a rank's shard in a ``state_dict`` so that torch.distributed.checkpoint refuses it.

    DCP asks a state dict value for ``__create_write_items__`` (saving) and ``__create_chunk_list__``
    (loading) before treating it as a plain tensor; both raise TypeError here. ``__getstate__`` keeps the
    marks out of ``torch.save``'s pickle, so such files load with ``weights_only=True`` as before.
    """
    message = (f"{name} is tp rank {tp_rank}'s shard of a parameter split over {tp_size} ranks: "
               "torch.distributed.checkpoint would store one rank's shard for all of them. Save "
               "tpkit.checkpoint.sharded_state_dict(model) instead, or use tpkit.checkpoint.save / load, "
               "which also take the optimizer")

    def refuse(*args: object) -> None:
        # Not a ValueError: DCP's load planner rewords those as a metadata mismatch.
        raise TypeError(message)

    tensor.__create_write_items__ = refuse
    tensor.__create_chunk_list__ = refuse
    tensor.__getstate__ = dict
