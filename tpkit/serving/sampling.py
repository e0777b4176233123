"""A request's sampling settings, and the draw of a mixed batch's next tokens, one generator a request.

Each request that samples (temperature > 0) owns its generator, seeded from its own ``seed``: its tokens
depend on its logits and its seed only, never on which requests shared its steps. As in ``generate``, rank 0
of the tensor-parallel group draws every token and broadcasts them, so ranks cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tpkit.models.sampling import Sampler, check_sampling, greedy_tokens


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates: up to ``max_new_tokens`` tokens, greedy at temperature 0, else
    temperature, top_k and top_p as in transformers with ``seed`` for a reproducible draw. A request stops
    after one of the model's EOS tokens (unless ``ignore_eos``) or of ``stop_token_ids`` (kept in its
    output)."""

    max_new_tokens: int
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams: max_new_tokens: expected an int >= 1, got "
                             f"{self.max_new_tokens!r}")
        check_sampling(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"SamplingParams: ignore_eos: expected a bool, got "
                            f"{type(self.ignore_eos).__name__}")
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not isinstance(stops, Sequence) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stops):
            raise ValueError(f"SamplingParams: stop_token_ids: expected a sequence of token ids (ints >= 0), "
                             f"got {stops!r}")
        object.__setattr__(self, "stop_token_ids", tuple(stops))


def request_sampler(params: SamplingParams, device: torch.device, tp_group: Any) -> Sampler | None:
    """The request's own sampler (its generator on rank 0), None for greedy requests."""
    if params.temperature == 0:
        return None
    return Sampler(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=params.seed,
                   device=device, tp_group=tp_group)


def draw_tokens(logits: torch.Tensor, samplers: Sequence[Sampler | None], share: Sampler) -> torch.Tensor:
    """logits ``[num_seqs, vocab]``, row ``i`` a request's with ``samplers[i]`` (None: greedy) -> its next
    tokens, int64 ``[num_seqs]`` on the logits' device, identical on every rank (``share`` broadcasts rank
    0's). Nothing waits for the GPU."""
    if not share.is_source:
        tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    else:
        tokens = greedy_tokens(logits) if logits.is_cuda else logits.argmax(dim=-1)  # [num_seqs]
        for row, sampler in enumerate(samplers):
            if sampler is not None:
                tokens[row] = sampler.draw(logits[row:row + 1])[0]
    return share.share(tokens)
