"""Sampling the next tokens from logits, the same on every rank: greedy, or temperature, top-k and top-p as
transformers filters them, drawn on rank 0 with its seeded generator and broadcast."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def filter_logits(logits: torch.Tensor, temperature: float, top_k: int | None,
                  top_p: float | None) -> torch.Tensor:
    """float32 logits ``[batch, vocab]`` scaled by temperature, then top-k, then top-p (transformers' order);
    filtered-out entries are -inf. top-p keeps the smallest set whose probability exceeds top_p, at least one.
    """
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [batch, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, dim=-1)  # ascending
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= 1.0 - top_p
        remove_sorted[..., -1] = False
        remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
        logits = logits.masked_fill(remove, float("-inf"))
    return logits


_ARGMAX_CHUNK = 256  # vocabulary entries a first-pass maximum covers


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(-1)`` of ``[batch, vocab]`` logits as int64 ``[batch]``, in two passes: the maximum of
    each chunk of ``_ARGMAX_CHUNK`` entries, then the best chunk. On a GPU torch's argmax gives each row to
    one thread block, which leaves the GPU nearly idle for a decode step's few rows of a large vocabulary.
    Ties go to the first index, as
    argmax's do: the first maximum of the first chunk holding one."""
    batch, vocab = logits.shape
    pad = -vocab % _ARGMAX_CHUNK
    if pad:
        logits = nn.functional.pad(logits, (0, pad), value=float("-inf"))
    chunks = logits.reshape(batch, -1, _ARGMAX_CHUNK)  # [batch, num_chunks, chunk]
    chunk_max, chunk_argmax = chunks.max(dim=-1)  # [batch, num_chunks] each
    best_chunk = chunk_max.argmax(dim=-1, keepdim=True)  # [batch, 1]
    return (best_chunk * _ARGMAX_CHUNK + chunk_argmax.gather(1, best_chunk)).squeeze(1)


def check_sampling(*, temperature: float, top_k: int | None, top_p: float | None, seed: int | None) -> None:
    """Sampling settings as :class:`Sampler` takes them, or a ValueError naming the one that is not."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0 \
            or not math.isfinite(temperature):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float))
                              or not 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be None or in (0, 1], got {top_p!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError(f"seed must be None or an int >= 0, got {seed!r}")


class Sampler:
    """Picks every sequence's next token from its logits; rank 0 draws and broadcasts (see the module doc)."""

    def __init__(self, *, temperature: float, top_k: int | None, top_p: float | None, seed: int | None,
                 device: torch.device, tp_group: Any) -> None:
        check_sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        self.temperature, self.top_k, self.top_p = float(temperature), top_k, top_p
        self.tp_size = tp_group.size
        self.group = tp_group.group
        self.is_source = tp_group.rank == 0
        self.generator: torch.Generator | None = None
        if temperature > 0 and self.is_source:
            self.generator = torch.Generator(device=device)
            if seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(seed)

    @property
    def is_greedy(self) -> bool:
        """temperature 0: the draw is the logits' argmax, which needs no generator (a CUDA graph can replay
        it)."""
        return self.temperature == 0

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits ``[batch, vocab]`` -> int64 token ids ``[batch]``, identical on every rank."""
        return self.share(self.draw(logits))

    def draw(self, logits: torch.Tensor) -> torch.Tensor:
        """logits ``[batch, vocab]`` -> int64 token ids ``[batch]``: rank 0's draw (elsewhere uninitialised,
        until :meth:`share`)."""
        if not self.is_source:
            return torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        if self.is_greedy:
            return greedy_tokens(logits) if logits.is_cuda else logits.argmax(dim=-1)
        probs = filter_logits(logits, self.temperature, self.top_k, self.top_p).softmax(dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator).squeeze(1)

    def share(self, tokens: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``tokens`` ``[batch]`` on every rank (in place)."""
        if self.tp_size > 1:
            dist.broadcast(tokens, group=self.group, group_src=0)
        return tokens
