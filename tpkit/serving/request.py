"""A request as the engine tracks it, and what a step reports of it."""

from __future__ import annotations

from dataclasses import dataclass, field

from tpkit.models.sampling import Sampler
from tpkit.serving.sampling import SamplingParams

# A context's last token while it exists only on the device: drawn by a step the host has not read back yet.
DRAWN = -1


@dataclass(eq=False)
class Request:
    """One prompt's generation. ``context`` is what the model runs for it: a decoder-only model's prompt and
    the tokens generated so far; an encoder-decoder's decoder start token and the generated tokens (the
    prompt goes through the encoder). ``num_computed`` of its tokens are in the KV cache; the rest run in the
    next steps (a prompt's chunks, a decode's last token, everything again after a preemption). The last
    context token is :data:`DRAWN` while the step that drew it is in flight. Requests compare by identity."""

    request_id: int
    prompt: list[int]
    params: SamplingParams
    context: list[int]
    sampler: Sampler | None
    arrival_time: float
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    token_times: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def num_pending(self) -> int:
        """Context tokens not yet in the cache."""
        return len(self.context) - self.num_computed


@dataclass(frozen=True)
class RequestOutput:
    """What a step did for a request: ``new_token_ids`` it generated in this step (none for an abort),
    every token so far (``token_ids``), and whether it is done (``finish_reason`` "length", "stop" or
    "abort"). Times are ``time.perf_counter()`` seconds: the request's arrival, its first token and each
    token's."""

    request_id: int
    new_token_ids: list[int]
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    arrival_time: float
    first_token_time: float | None
    token_times: list[float]
