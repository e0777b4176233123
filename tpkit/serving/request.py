"""A request as the engine tracks it, and what a step reports of it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tpkit.models.sampling import Sampler
from tpkit.serving.sampling import SamplingParams


@dataclass(eq=False)
class Request:
    """One prompt's generation. ``context`` is what the model runs for it: a decoder-only model's prompt and
    the tokens generated so far; an encoder-decoder's decoder start token and the generated tokens (the
    prompt goes through the encoder). ``num_computed`` of its tokens are in the KV cache; the rest run in the
    next steps (a prompt's chunks, a decode's last token, everything again after a preemption). ``output``
    and ``token_times`` only grow: each step's :class:`RequestOutput` holds prefixes of them. Requests
    compare by identity."""

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


class Prefix:
    """The first ``length`` items of a list that only grows (a request's tokens or times): a step's view of
    them, taken in O(1) and turned into a list of those items only when read."""

    __slots__ = ("items", "length")

    def __init__(self, items: list[Any], length: int) -> None:
        self.items = items
        self.length = length

    def to_list(self) -> list[Any]:
        return self.items[:self.length]


class _Snapshot:
    """A field of a frozen dataclass that may be given a :class:`Prefix`: read, it is the prefix's items as a
    list (made on the first read and kept), so a later step's tokens never show in an earlier output."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.slot = "_" + name

    def __get__(self, instance: object, owner: type | None = None) -> Any:
        if instance is None:
            raise AttributeError(self.slot[1:])  # no default: the field is required
        value = instance.__dict__[self.slot]
        if type(value) is Prefix:
            value = value.to_list()
            instance.__dict__[self.slot] = value
        return value

    def __set__(self, instance: object, value: Sequence[Any] | Prefix) -> None:
        instance.__dict__[self.slot] = value  # by __init__ only: the dataclass is frozen


@dataclass(frozen=True)
class RequestOutput:
    """What a step did for a request: ``new_token_ids`` it generated in this step (none for an abort),
    every token so far (``token_ids``), and whether it is done (``finish_reason`` "length", "stop" or
    "abort"). Times are ``time.perf_counter()`` seconds: the request's arrival, its first token and each
    token's."""

    request_id: int
    new_token_ids: list[int]
    token_ids: list[int] = _Snapshot()  # type: ignore[assignment]
    finished: bool
    finish_reason: str | None
    arrival_time: float
    first_token_time: float | None
    token_times: list[float] = _Snapshot()  # type: ignore[assignment]


def snapshot(request: Request, new_token_ids: list[int]) -> RequestOutput:
    """The :class:`RequestOutput` of ``request`` as it stands, its tokens and times so far as prefixes of its
    lists (which only grow): O(1), not copied unless read. Built as ``RequestOutput(...)`` would build it,
    the fields set at once."""
    output, times = request.output, request.token_times
    snap = object.__new__(RequestOutput)
    snap.__dict__.update(request_id=request.request_id, new_token_ids=new_token_ids,
                         _token_ids=Prefix(output, len(output)), finished=request.finish_reason is not None,
                         finish_reason=request.finish_reason, arrival_time=request.arrival_time,
                         first_token_time=times[0] if times else None, _token_times=Prefix(times, len(times)))
    return snap
