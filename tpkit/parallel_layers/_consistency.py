"""Checks that the ranks of a group agree, where ranks that disagree would abort or compute garbage.

Ranks that build a model from different configs, in different dtypes, or feed it different prompts do not
fail cleanly on their own: collectives of different sizes end the process inside gloo (``terminate
called ... gloo::EnforceNotMet``) or hang in NCCL, and collectives of equal sizes over different values
return wrong results without a word. :func:`check_ranks_agree` compares a fingerprint of a few values
where that is cheap (setting up the group, building a model, starting a generation): one all-gather of
:data:`_SLOTS` int64 digests, the same size at every call, so ranks at two different checks still exchange
equal tensors and learn that they are. Only when the digests differ are the values themselves exchanged,
to name what differs and on which ranks, and every rank raises the same ValueError.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from .mappings import _all_gather_dim
from .state import TPGroup, _resolve_tp_group

# Digests a fingerprint holds: the check's name, then one a value (values past the last slot share it).
_SLOTS = 16
_SHOWN = 200  # characters of a value a message shows


def check_ranks_agree(what: str, tp_group: TPGroup | dist.ProcessGroup | None = None, **values: Any) -> None:
    """Raises ValueError on every rank of the group unless all of them passed equal ``values`` (compared by
    their JSON text, or ``repr``) to a check named ``what``; the error names each value that differs and
    which ranks hold which. Every rank of the group must call it. A no-op at tp_size 1."""
    tp = _resolve_tp_group(tp_group)
    if tp.size == 1:
        return
    digests = [_digest(what)] + [_digest(f"{name}={_text(value)}") for name, value in values.items()]
    if len(digests) > _SLOTS:
        digests[_SLOTS - 1:] = [_digest(" ".join(map(str, digests[_SLOTS - 1:])))]
    device = torch.device("cuda", torch.cuda.current_device()) if tp.backend == "nccl" else "cpu"
    mine = torch.tensor(digests + [0] * (_SLOTS - len(digests)), dtype=torch.int64, device=device)  # [_SLOTS]
    rows = _all_gather_dim(mine, tp, 0).view(tp.size, _SLOTS).tolist()
    if all(row == rows[0] for row in rows):
        return
    texts = {name: _text(value) for name, value in values.items()}
    every: list[Any] = [None] * tp.size
    dist.all_gather_object(every, (what, texts), group=tp.group)
    raise ValueError(f"{what}: the {tp.size} tensor-parallel ranks disagree (this is rank {tp.rank}); every "
                     f"rank must pass the same values: {_differences(every)}")


def _text(value: Any) -> str:
    """JSON, with tensors as their values (``repr`` would elide a long one's middle)."""
    try:
        return json.dumps(value, sort_keys=True, default=_plain)
    except (TypeError, ValueError):
        return repr(value)


def _plain(value: Any) -> Any:
    return value.tolist() if isinstance(value, torch.Tensor) else repr(value)


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def _differences(every: list[tuple[str, dict[str, str]]]) -> str:
    """What differs between the ranks' ``(what, values)``: each differing value with the ranks holding it."""
    whats = [what for what, _ in every]
    if len(set(whats)) > 1:
        return "they are at different steps: " + _by_rank(whats)
    found = []
    for name in every[0][1]:
        texts = [values.get(name) for _, values in every]
        if len(set(texts)) == 1:
            continue
        parsed = [_parse(text) for text in texts]
        if all(isinstance(value, Mapping) for value in parsed):
            keys = sorted(set().union(*parsed), key=str)
            for key in keys:
                entries = [json.dumps(value.get(key, "<missing>")) for value in parsed]
                if len(set(entries)) > 1:
                    found.append(f"{name}[{key!r}]: {_by_rank(entries)}")
        else:
            found.append(f"{name}: {_by_rank(texts)}")
    return "; ".join(found)


def _parse(text: str | None) -> Any:
    try:
        return json.loads(text) if text is not None else None
    except ValueError:
        return text


def _by_rank(texts: list[str | None]) -> str:
    """``rank 0 has A, ranks 1, 2 have B``."""
    ranks: dict[str | None, list[int]] = {}
    for rank, text in enumerate(texts):
        ranks.setdefault(text, []).append(rank)
    parts = []
    for text, holders in ranks.items():
        shown = text if text is None or len(text) <= _SHOWN else text[:_SHOWN] + "..."
        who = f"rank {holders[0]} has" if len(holders) == 1 else f"ranks {', '.join(map(str, holders))} have"
        parts.append(f"{who} {shown}")
    return ", ".join(parts)


def check_setup_agrees(tp: TPGroup, **values: Any) -> None:
    """:func:`check_ranks_agree` for ``init_tensor_parallel``, after a barrier that, on gloo, names the ranks
    that never arrive (``monitored_barrier``; rank 0 names them, the others point at rank 0's message)."""
    if tp.size > 1 and tp.backend == "gloo":
        try:
            dist.monitored_barrier(tp.group, wait_all_ranks=True)
        except RuntimeError as error:
            raise RuntimeError(f"init_tensor_parallel: not every rank of the {tp.size} called it (this is "
                               f"rank {tp.rank}): {error}") from error
    check_ranks_agree("init_tensor_parallel", tp, **values)
