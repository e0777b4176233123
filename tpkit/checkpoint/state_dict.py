"""``sharded_state_dict``: a model's tensors as the unsharded model's logical tensors, each with its full
shape and this rank's place in it, for ``torch.distributed.checkpoint`` (DCP).

Each parameter is cut into the logical tensors its layer describes (``layer.shard_parts(param)``,
``tpkit.parallel_layers.sharding``): a QKV weight into q, k and v, a merged weight into its matrices, a
vocabulary-parallel weight into the unpadded vocabulary. Their names are the parameter's, with
``:shard_id`` for a part of a stacked one (``layers.0.self_attn.qkv_proj.weight:q``); their shapes do not
depend on tp_size, so DCP reads them back at any tp_size, each rank the rows it holds there.

A sharded part is a ``ShardedTensor`` whose local shard is this rank's rows (a view of the parameter, so
DCP reads straight into it). Not a ``DTensor``: DCP places a DTensor's shards where ``torch.chunk`` would
(``ceil(rows / tp_size)`` a rank), which neither the unpadded vocabulary's shards (the padding makes them
larger, the last ones shorter or empty) nor a KV head replicated on several ranks of a one-dimensional mesh
follow. A ShardedTensor takes any rows at any offset; DCP handles it natively, in its planners, in the
staging of ``async_save`` and in its resharding reads, on torch 2.11 and 2.13, over gloo and NCCL alike.

A ShardedTensor's shards must cover the tensor without overlapping, while the replicas of a KV head hold
the same rows on several ranks, each of which must read them. So each rank's ShardedTensor lists its own
shard and, of the other ranks', those that do not overlap what it lists: every rank's list covers the
tensor, and the replicas' lists differ (DCP takes a tensor's layout from every rank's write items, not from
one rank's list). The layout of every rank comes from one all-gather of a few integers per tensor. Replicas
write the same rows at the same offset, which DCP's deduplication of save plans writes once; a rank that
holds none of a part's rows (a trailing rank of vocabulary padding) has no entry for it. A parameter every
rank holds whole (a norm, a row-parallel bias) is a plain tensor, which DCP also writes once; so is
everything at tp_size 1, which then needs no ``torch.distributed`` at all. DCP itself warns that
ShardedTensor is deprecated (FutureWarning); ``tpkit.checkpoint.save`` and ``load`` silence that warning
around their calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties

from tpkit.parallel_layers import ShardPart, TPGroup
from tpkit.parallel_layers.sharding import replicated

__all__ = ["sharded_state_dict"]

_SINGLE_PROCESS = TPGroup(None, 0, 1)
# Copies a rank's rows before they are handed to DCP (an asynchronous save's copy into host memory).
Stage = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class _Entry:
    """One logical tensor of the model: its name, the parameter (or buffer) and this rank's part of it."""

    key: str
    name: str
    param: torch.Tensor
    part: ShardPart


def _key(name: str, shard_id: int | str | None) -> str:
    return name if shard_id is None else f"{name}:{shard_id}"


def tp_group_of(model: nn.Module) -> TPGroup:
    """The tensor-parallel group of the tpkit layers in ``model`` (one group for all); tp_size 1 without."""
    groups = {}
    for module in model.modules():
        tp = getattr(module, "tp_group", None)
        if isinstance(tp, TPGroup) and hasattr(module, "shard_parts"):
            groups[(tp.size, id(tp.group) if tp.size > 1 else None)] = tp
    if len(groups) > 1:
        raise ValueError(f"model's layers use {len(groups)} tensor-parallel groups; a checkpoint takes one")
    return next(iter(groups.values()), _SINGLE_PROCESS)


def _entries(model: nn.Module) -> list[_Entry]:
    """Every logical tensor of ``model``, in the order of ``named_parameters`` (a tied parameter once, under
    its first name), then its persistent buffers (replicated). The same list on every rank."""
    entries: list[_Entry] = []
    seen: set[int] = set()
    for prefix, module in model.named_modules():
        prefix = f"{prefix}." if prefix else ""
        for attr, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            parts = module.shard_parts(param) if hasattr(module, "shard_parts") else replicated(param)
            entries.extend(_Entry(_key(prefix + attr, part.shard_id), prefix + attr, param, part)
                           for part in parts)
    for prefix, module in model.named_modules():
        prefix = f"{prefix}." if prefix else ""
        for attr, buffer in module.named_buffers(recurse=False):
            persistent = attr not in module._non_persistent_buffers_set
            if buffer is not None and persistent and id(buffer) not in seen:
                seen.add(id(buffer))
                entries.append(_Entry(prefix + attr, prefix + attr, buffer, replicated(buffer)[0]))
    return entries


def collective_device(tp: TPGroup) -> torch.device:
    """Where the group's collectives take their tensors: the current GPU under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if tp.backend == "nccl" else torch.device("cpu")


class ModelLayout:
    """A model's logical tensors (``entries``) and every rank's rows of each, gathered once: what places a
    parameter, or an optimizer state shaped like one, for DCP. Build it on every rank of the group."""

    def __init__(self, model: nn.Module) -> None:
        self.tp = tp_group_of(model)
        self.entries = _entries(model)
        # [tp_size, len(entries), 2]: each rank's (start, length) of each entry
        self.rows = self._gather_rows() if self.tp.size > 1 else None

    def _gather_rows(self) -> torch.Tensor:
        device = collective_device(self.tp)
        mine = torch.tensor([[entry.part.start, entry.part.length] for entry in self.entries],
                            dtype=torch.int64, device=device).reshape(len(self.entries), 2)
        gathered = [torch.empty_like(mine) for _ in range(self.tp.size)]
        dist.all_gather(gathered, mine, group=self.tp.group)
        return torch.stack(gathered).cpu()

    def value(self, index: int, tensor: torch.Tensor,
              stage: Stage | None = None) -> torch.Tensor | ShardedTensor | None:
        """What DCP is given for entry ``index`` of ``tensor`` (laid out like the entry's parameter): a plain
        tensor where the part is whole on this rank, a ShardedTensor of this rank's rows, or None where this
        rank holds none of them. ``stage``, where given, copies this rank's rows first (into host memory)."""
        part = self.entries[index].part
        local = part.local(tensor.detach())
        local = local if stage is None else stage(local)
        if part.dim is None or self.tp.size == 1:
            return local
        if part.length == 0:
            return None
        shards = [(self.tp.rank, part.start, part.length)]
        for rank, (start, length) in enumerate(self.rows[:, index].tolist()):
            if length and all(start + length <= s or s + n <= start for _, s, n in shards):
                shards.append((rank, start, length))
        if sum(n for _, _, n in shards) != part.shape[part.dim]:
            rows = self.rows[:, index].tolist()
            raise ValueError(f"{self.entries[index].key}: the ranks' (start, length) {rows} of "
                             f"{part.shape[part.dim]} rows are neither equal nor disjoint")
        metadata = [ShardMetadata(_offsets(part, start), _sizes(part, length),
                                  f"rank:{dist.get_global_rank(self.tp.group, rank)}/{local.device}")
                    for rank, start, length in shards]
        properties = TensorProperties(dtype=local.dtype, layout=local.layout, requires_grad=False,
                                      memory_format=torch.contiguous_format, pin_memory=False)
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            [Shard(local, metadata[0])], ShardedTensorMetadata(metadata, torch.Size(part.shape), properties),
            process_group=self.tp.group)

    def values(self, stage: Stage | None = None) -> Iterator[tuple[str, torch.Tensor | ShardedTensor]]:
        """(key, DCP value) of every parameter and buffer this rank holds rows of."""
        for index, entry in enumerate(self.entries):
            value = self.value(index, entry.param, stage)
            if value is not None:
                yield entry.key, value


def _offsets(part: ShardPart, start: int) -> list[int]:
    return [start if dim == part.dim else 0 for dim in range(len(part.shape))]


def _sizes(part: ShardPart, length: int) -> list[int]:
    return [length if dim == part.dim else size for dim, size in enumerate(part.shape)]


def sharded_state_dict(model: nn.Module) -> dict[str, torch.Tensor | ShardedTensor]:
    """``model``'s tensors for ``torch.distributed.checkpoint``, by logical tensor (module docstring):
    ``{name: tensor or ShardedTensor}``, views of the parameters, so that ``dcp.load`` of it writes into the
    model. ``dcp.save(sharded_state_dict(model), checkpoint_id=path)`` and ``dcp.load`` of it at another
    tp_size restore the same full parameters; :func:`tpkit.checkpoint.save` also takes the optimizer, the
    generator states and your own values, and checks a checkpoint against the model before loading it.
    Call it on every rank of the group (one all-gather of the layout).
    """
    return dict(ModelLayout(model).values())
