"""Which requests run in the next step, and how many of their tokens.

Every step runs under a budget of ``max_num_batched_tokens`` tokens and at most ``max_num_seqs`` requests:
first the running requests, oldest first (a decode's one token, or the next chunk of a prompt that an
earlier step began), then waiting requests, first come first served, each with as many of its prompt's
tokens as the budget has left (chunked prefill). A waiting request is admitted while the KV cache has blocks
for its chunk; its prompt's first full blocks found in the prefix cache are not computed again.

When a running request needs a block and none is free, the newest running request is preempted: its blocks
go back (the prefix cache may keep them) and it waits at the head of the queue to be computed again, its
generated tokens kept. No waiting request is admitted in a step that preempted. Since every request fits the
cache alone (checked when it is added), the oldest request always makes progress.

The schedule depends only on what the ranks share (the requests, their tokens, the caches' blocks), never on
timing: every rank of a tensor-parallel group schedules the same steps.
"""

from __future__ import annotations

from collections import deque

from tpkit.serving.model_runner import ModelRunner
from tpkit.serving.request import Request


class Scheduler:
    """The waiting queue and the running list of one engine."""

    def __init__(self, runner: ModelRunner, *, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.runner = runner
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a finished or aborted request out, its blocks freed."""
        if request in self.running:
            self.running.remove(request)
            self.runner.free(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def schedule(self) -> list[tuple[Request, int]]:
        """The next step's ``(request, num_tokens)``, their slots appended; empty when nothing is left."""
        budget = self.max_num_batched_tokens
        preempted = False
        index = self._append_decodes(budget)
        batch: list[tuple[Request, int]] = [(request, 1) for request in self.running[:index]]
        budget -= index
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_tokens = min(request.num_pending, budget)
            while not self.runner.append(request, num_tokens):
                preempted = True
                victim = self.running.pop()
                self._preempt(victim)
                if victim is request:
                    break
            else:
                batch.append((request, num_tokens))
                budget -= num_tokens
                index += 1
        while not preempted and self.waiting and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            extra = self.runner.start_tokens(request)
            if extra + 1 > budget or not self.runner.start(request):
                break
            num_tokens = min(request.num_pending, budget - extra)
            if not self.runner.append(request, num_tokens):
                self.runner.free(request)
                request.num_computed = 0
                break
            self.waiting.popleft()
            self.running.append(request)
            batch.append((request, num_tokens))
            budget -= num_tokens + extra
        return batch

    def _append_decodes(self, budget: int) -> int:
        """Slots for the running requests that decode, oldest first up to the first that does not (or the
        budget), in one append; how many of them (0 when blocks run out: then they go one by one, with
        preemption). The blocks they get are those one append each would give them."""
        count = 0
        for request in self.running[:budget]:
            if request.num_pending != 1:
                break
            count += 1
        if count and self.runner.append_decodes(self.running[:count]):
            return count
        return 0

    def _preempt(self, request: Request) -> None:
        self.runner.free(request)
        request.num_computed = 0
        self.waiting.appendleft(request)
        self.num_preemptions += 1
