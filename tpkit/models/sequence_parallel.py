"""Sequence parallelism in the reference models (training): where the residual stream is a
rank's share of the tokens.

Built with ``sequence_parallel=True``, a model's embeddings reduce-scatter their lookups over the
sequence, its linear layers gather and reduce-scatter tokens (``tpkit.parallel_layers``,
sequence_parallel=True), its norms and the dropout of the residual stream act on a rank's tokens, and the
final norm's output is gathered again for the LM head (BART: the encoder's and the decoder's embeddings,
and the decoder's output; cross-attention gathers the encoder's tokens). Such a model runs full forwards only
(``model(input_ids)``, no cache): generation takes a model built without it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tpkit.parallel_layers import (
    TPGroup,
    check_ranks_agree,
    gather_from_sequence_parallel_region,
    mark_sequence_parallel,
)

NO_GENERATION = ("a model built with sequence_parallel=True runs full forwards only (training): generate "
                 "with a model built without it")


def check_sequence_parallel(input_ids: torch.Tensor, tp: TPGroup, has_cache: bool) -> None:
    """Before the embeddings split ``input_ids`` ``[batch, seq]``'s tokens over the ranks: every rank must
    pass the same shape (checked outside ``torch.compile``: collectives of different sizes would abort)."""
    if not torch.compiler.is_compiling():
        check_ranks_agree("sequence-parallel forward", tp, input_ids_shape=list(input_ids.shape))
    if has_cache:
        raise ValueError(NO_GENERATION)
    if input_ids.shape[1] % tp.size:
        raise ValueError(f"sequence_parallel=True splits the sequence over the ranks: expected a sequence "
                         f"length divisible by tp_size={tp.size}, received {input_ids.shape[1]} (pad the "
                         "batch)")


def exit_sequence_parallel(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """This rank's tokens of the final norm's output -> every token, for the LM head (whose input copy sums
    the ranks' gradients itself, so the backward keeps this rank's chunk)."""
    return gather_from_sequence_parallel_region(x, tp, dim=1, partial_grad=False)


def mark_norms(model: nn.Module, norm_type: type[nn.Module], exclude: Iterable[nn.Module] = ()) -> None:
    """Every ``norm_type`` module of ``model`` but those in ``exclude`` acts on a rank's tokens (a reference
    model's norms of the residual stream sit between a row-parallel layer, or the embeddings, and the next
    column-parallel one): ``reduce_sequence_parallel_grads`` sums their gradients. Norms of attention heads
    (``exclude``) see every token, after the projection gathered them."""
    excluded = {id(module) for module in exclude}
    mark_sequence_parallel(*(module for module in model.modules()
                             if isinstance(module, norm_type) and id(module) not in excluded))
