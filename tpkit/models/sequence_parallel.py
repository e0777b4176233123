"""Sequence parallelism in the reference models (training): where the residual stream is a
rank's share of the tokens.

Built with ``sequence_parallel=True``, a model splits the embeddings' output along the sequence, its
linear layers gather and reduce-scatter tokens (``tpkit.parallel_layers``, sequence_parallel=True), its
norms and the dropout of the residual stream act on a rank's tokens, and the final norm's output is
gathered again for the LM head (BART: the encoder's and the decoder's embeddings, and the decoder's
output; cross-attention gathers the encoder's tokens). Such a model runs full forwards only
(``model(input_ids)``, no cache): generation takes a model built without it.
"""

from __future__ import annotations

import torch

from tpkit.parallel_layers import (
    TPGroup,
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)

NO_GENERATION = ("a model built with sequence_parallel=True runs full forwards only (training): generate "
                 "with a model built without it")


def enter_sequence_parallel(x: torch.Tensor, tp: TPGroup, has_cache: bool) -> torch.Tensor:
    """The embeddings' output ``[batch, seq, hidden]`` -> this rank's ``[batch, seq / tp_size, hidden]``."""
    if has_cache:
        raise ValueError(NO_GENERATION)
    if x.shape[1] % tp.size:
        raise ValueError(f"sequence_parallel=True splits the sequence over the ranks: expected a sequence "
                         f"length divisible by tp_size={tp.size}, received {x.shape[1]} (pad the batch)")
    return scatter_to_sequence_parallel_region(x, tp, dim=1)


def exit_sequence_parallel(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """This rank's tokens of the final norm's output -> every token, for the LM head (whose input copy sums
    the ranks' gradients itself, so the backward keeps this rank's chunk)."""
    return gather_from_sequence_parallel_region(x, tp, dim=1, partial_grad=False)

