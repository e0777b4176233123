"""Embedding and LM head sharded by vocabulary rows over a tensor-parallel group.

The vocabulary is padded to the smallest multiple of ``padding_size`` that splits evenly over ``tp_size``
(efficient shapes, equal shards); rank r holds rows ``[r * n, (r + 1) * n)`` of the padded vocabulary and the
padding rows stay zero. The embedding looks up the ids that fall in its rows, zeroes the others, and one
all-reduce sums the ranks' lookups. The LM head computes logits for its rows and gathers them, so every
rank gets the full vocabulary's logits with the padding cut off.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ._checks import _check_indices, _check_positive
from ._init import _normal_, _shard_seed, _uniform_
from ._loading import (
    _attach_weight_loaders,
    _check_shape,
    _copy_pieces,
    _LoadableModule,
    _param_name,
    _reject_shard_id,
)
from .cross_entropy import vocab_parallel_cross_entropy
from .linear_op import _UsesLinearOp
from .mappings import (
    _reduce_from_tp_region_,
    copy_to_tp_region,
    gather_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
)
from .sharding import ShardPart
from .state import TPGroup, _resolve_tp_group


def pad_vocab_size(num_embeddings: int, padding_size: int, tp_size: int = 1) -> int:
    """The smallest multiple of ``padding_size`` that holds ``num_embeddings`` and divides by tp_size."""
    _check_positive(num_embeddings=num_embeddings, padding_size=padding_size, tp_size=tp_size)
    multiple = padding_size * tp_size // math.gcd(padding_size, tp_size)
    return -(-num_embeddings // multiple) * multiple


class _VocabParallelBase(_LoadableModule):
    """Vocabulary rows split over the ranks: the sharding, the parameters and their loader.

    ``weight`` is ``[num_embeddings_per_partition, embedding_dim]``: rows ``[vocab_start_index,
    vocab_end_index)`` of the padded vocabulary, of which the first ``num_real_rows`` are real. Its
    ``weight_loader`` (and the bias's) takes the checkpoint's ``[num_embeddings, ...]`` tensor and reads
    only this rank's rows. Each layer defines ``reset_parameters`` (run here).
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_size: int, *, bias: bool,
                 params_dtype: torch.dtype | None, device: torch.device | str | None,
                 tp_group: TPGroup | dist.ProcessGroup | None) -> None:
        super().__init__()
        _check_positive(num_embeddings=num_embeddings, embedding_dim=embedding_dim, padding_size=padding_size)
        tp = _resolve_tp_group(tp_group)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_size = padding_size
        self.tp_group = tp
        self.tp_rank = tp.rank
        self.tp_size = tp.size
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.num_embeddings_padded = pad_vocab_size(num_embeddings, padding_size, tp.size)
        self.num_embeddings_per_partition = self.num_embeddings_padded // tp.size
        self.vocab_start_index = tp.rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        # Rows of this shard that are real vocabulary; the rest is padding (a trailing rank may hold none).
        self.num_real_rows = max(0, min(self.vocab_end_index, num_embeddings) - self.vocab_start_index)
        factory = {"dtype": self.params_dtype, "device": device}
        # [num_embeddings_per_partition, embedding_dim]
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim, **factory))
        if bias:
            # [num_embeddings_per_partition]
            self.bias = nn.Parameter(torch.empty(self.num_embeddings_per_partition, **factory))
        else:
            self.register_parameter("bias", None)
        _attach_weight_loaders(self)
        self.reset_parameters()

    def _grad_holders(self, param: nn.Parameter) -> int:
        """Each row of the weight (and bias) is on one rank (gradient norms count every row once)."""
        return 1

    def shard_parts(self, param: nn.Parameter) -> tuple[ShardPart, ...]:
        """Rows ``[vocab_start_index, vocab_start_index + num_real_rows)`` of the unpadded vocabulary
        (``tpkit.parallel_layers.sharding``); the padding rows belong to no logical tensor."""
        return (ShardPart(None, (self.num_embeddings, *param.shape[1:]), 0, self.vocab_start_index,
                          self.num_real_rows),)

    def _zero_padding(self, param: torch.Tensor) -> None:
        with torch.no_grad():
            param[self.num_real_rows:].zero_()

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: int | str | None = None) -> None:
        """Copies rows ``[vocab_start_index, vocab_end_index)`` of the ``[num_embeddings, ...]`` tensor."""
        name = _param_name(self, param)
        _reject_shard_id(name, loaded_shard_id)
        _check_shape(name, loaded_weight, (self.num_embeddings, *param.shape[1:]))
        _copy_pieces(param, loaded_weight, 0, [(0, self.vocab_start_index, self.num_real_rows)])
        self._zero_padding(param)

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
                f"num_embeddings_padded={self.num_embeddings_padded}, tp_size={self.tp_size}, "
                f"rows=[{self.vocab_start_index}, {self.vocab_end_index})")


class VocabParallelEmbedding(_VocabParallelBase):
    """``nn.Embedding`` with the vocabulary rows split over the ranks: each rank looks up the ids in its rows,
    zeroes the rest, one all-reduce. Ids must lie in ``[0, num_embeddings)``: a ValueError names the first
    that does not (checked on the CPU; on GPUs with ``TPKIT_DEBUG=1``).

    With ``sequence_parallel=True`` (sequence parallelism, ``tpkit.parallel_layers.linear``) the partial
    lookups are reduce-scattered over the ids' last dim instead: ids ``[..., seq]`` -> this rank's
    ``[..., seq / tp_size, embedding_dim]``.
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_size: int = 64,
        *,
        sequence_parallel: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        tp_group: TPGroup | dist.ProcessGroup | None = None,
    ) -> None:
        self.sequence_parallel = sequence_parallel
        super().__init__(num_embeddings, embedding_dim, padding_size, bias=False, params_dtype=params_dtype,
                         device=device, tp_group=tp_group)

    def reset_parameters(self) -> None:
        # nn.Embedding's N(0, 1)
        seed = _shard_seed(self.tp_group)
        _normal_(self.weight, None if seed is None else seed + self.tp_rank)
        self._zero_padding(self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # [...] int -> [..., embedding_dim]
        _check_indices(f"VocabParallelEmbedding(num_embeddings={self.num_embeddings})", "input_ids",
                       input_ids, self.num_embeddings)
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index).masked_fill_(outside, 0)
        output = F.embedding(local_ids, self.weight)
        output.masked_fill_(outside.unsqueeze(-1), 0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(output, self.tp_group)
        return _reduce_from_tp_region_(output, self.tp_group)


class ParallelLMHead(_UsesLinearOp, _VocabParallelBase):
    """The output projection to vocabulary logits, sharded like :class:`VocabParallelEmbedding`.

    :meth:`compute_logits` (also ``forward``) returns ``[..., num_embeddings]`` logits on every rank;
    :meth:`compute_sharded_logits` this rank's vocabulary columns, and :meth:`cross_entropy` a training loss
    from them, without gathering.
    :meth:`tie_weights` shares the embedding's weight Parameter (models with tied embeddings); loading the
    embedding then loads the head. ``tied`` says it was asked to (``model.to_empty()`` gives each name its
    own tensor: tie again after it); :meth:`untie_weights` gives the head a weight of its own again (loaders
    do, as transformers does, where a checkpoint holds both with different values). The optional bias is
    sharded and padded like the weight's rows. ``logits_soft_cap`` (Gemma 2's ``final_logit_softcapping``)
    caps every method's logits to ``cap * tanh(logits / cap)``.
    """

    tied = False

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        bias: bool = False,
        padding_size: int = 64,
        *,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        tp_group: TPGroup | dist.ProcessGroup | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, padding_size, bias=bias, params_dtype=params_dtype,
                         device=device, tp_group=tp_group)
        if logits_soft_cap is not None and (isinstance(logits_soft_cap, bool)
                                            or not isinstance(logits_soft_cap, (int, float))
                                            or not math.isfinite(logits_soft_cap) or logits_soft_cap <= 0):
            raise ValueError(f"ParallelLMHead: logits_soft_cap: expected None or a finite number > 0, got "
                             f"{logits_soft_cap!r}")
        self.logits_soft_cap = logits_soft_cap

    def reset_parameters(self) -> None:
        # An untied head is a linear layer: nn.Linear's bound over its fan-in.
        bound = 1.0 / math.sqrt(self.embedding_dim)
        for param in (self.weight, self.bias):
            if param is not None:
                seed = _shard_seed(self.tp_group)
                _uniform_(param, bound, None if seed is None else seed + self.tp_rank)
                self._zero_padding(param)

    def tie_weights(self, embedding: VocabParallelEmbedding) -> ParallelLMHead:
        """Makes this head use ``embedding.weight`` (the same Parameter); returns self."""
        if not isinstance(embedding, VocabParallelEmbedding):
            raise TypeError(f"tie_weights takes a VocabParallelEmbedding, got {type(embedding).__name__}")
        mine = (self.num_embeddings, self.num_embeddings_padded, self.embedding_dim, self.tp_size,
                self.tp_rank)
        theirs = (embedding.num_embeddings, embedding.num_embeddings_padded, embedding.embedding_dim,
                  embedding.tp_size, embedding.tp_rank)
        if mine != theirs:
            raise ValueError("tie_weights needs the same sharding (num_embeddings, num_embeddings_padded, "
                             f"embedding_dim, tp_size, tp_rank): head {mine}, embedding {theirs}")
        self.weight = embedding.weight
        self.tied = True
        return self

    def untie_weights(self) -> ParallelLMHead:
        """Gives this head a weight Parameter of its own, a copy of the one it shares; returns self."""
        self.weight = nn.Parameter(self.weight.detach().clone(), requires_grad=self.weight.requires_grad)
        _attach_weight_loaders(self)
        self.tied = False
        return self

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # [..., embedding_dim] -> [..., num_embeddings]
        logits = self.compute_sharded_logits(hidden_states)
        if self.tp_size > 1:
            logits = gather_from_tp_region(logits, self.tp_group)  # [..., num_embeddings_padded]
        if self.num_embeddings_padded != self.num_embeddings:
            logits = logits[..., : self.num_embeddings]
        return logits

    def compute_sharded_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary columns of the logits: ``[..., embedding_dim]`` -> ``[...,
        num_embeddings_per_partition]`` (columns ``[vocab_start_index, vocab_end_index)``, padding past
        ``num_real_rows``)."""
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.shape[-1:] != (self.embedding_dim,):
            got = list(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else hidden_states
            raise ValueError(f"ParallelLMHead: hidden_states: expected a last dimension of "
                             f"{self.embedding_dim} (embedding_dim), got shape {got!r}")
        if self.tp_size > 1:
            hidden_states = copy_to_tp_region(hidden_states, self.tp_group)
        logits = self.linear_op(hidden_states, self.weight, self.bias)
        cap = self.logits_soft_cap
        # Element-wise: capping a rank's columns caps the full logits.
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def cross_entropy(self, hidden_states: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100,
                      reduction: str = "mean") -> torch.Tensor:
        """``F.cross_entropy(self.compute_logits(hidden_states), labels)`` without gathering the logits: each
        rank keeps its vocabulary columns (:func:`vocab_parallel_cross_entropy`). hidden_states ``[...,
        embedding_dim]``, labels ``[...]`` int64 (``ignore_index``: no loss); reduction "mean", "sum" or
        "none". A label outside ``[0, num_embeddings)`` other than ``ignore_index`` is refused (checked on the
        CPU; on GPUs with ``TPKIT_DEBUG=1``)."""
        if isinstance(labels, torch.Tensor) and labels.dtype == torch.long:
            _check_indices(f"ParallelLMHead(num_embeddings={self.num_embeddings})", "labels",
                           labels.masked_fill(labels == ignore_index, 0), self.num_embeddings)
        logits = self.compute_sharded_logits(hidden_states)
        return vocab_parallel_cross_entropy(logits, labels, self.vocab_start_index, self.num_real_rows,
                                            tp_group=self.tp_group, ignore_index=ignore_index,
                                            reduction=reduction)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.compute_logits(hidden_states)
