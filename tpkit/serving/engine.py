"""The serving engine: requests in, one scheduled model step at a time, tokens out.

``Engine(model)`` sizes the model's paged KV caches from a memory budget and serves requests through
:meth:`Engine.add_request` and :meth:`Engine.step` (streaming: each step reports the tokens it generated),
or all at once through :meth:`Engine.generate`. A step asks the scheduler for a mixed batch (decodes and
prompt chunks, :mod:`tpkit.serving.scheduler`), runs it in one model call
(:mod:`tpkit.serving.model_runner`), draws the next token of every request whose context the step finished
(:mod:`tpkit.serving.sampling`) and retires the requests that are done.

Under tensor parallelism every rank builds the same engine and calls the same methods with the same
arguments (checked); the scheduler is deterministic and rank 0 draws the tokens, so every rank computes the
same steps and reports the same outputs.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from tqdm import tqdm

from tpkit._env import env_flag
from tpkit._memory import available_bytes
from tpkit.attention import copy_to_device
from tpkit.models.generation import PagedLM
from tpkit.models.prompts import Prompts, check_prompts
from tpkit.models.sampling import Sampler
from tpkit.parallel_layers import check_ranks_agree
from tpkit.serving.model_runner import Drawn, ModelRunner
from tpkit.serving.request import DRAWN, Request, RequestOutput
from tpkit.serving.sampling import SamplingParams, draw_tokens, request_sampler
from tpkit.serving.scheduler import Scheduler

# The KV budget off a GPU, where ``kv_cache_memory`` is a fraction: of this many bytes.
CPU_KV_CACHE_BYTES = 256 << 20
_MAX_GRAPH_SIZES = 8  # batch sizes a decode graph is captured for


class Engine:
    """Continuous batching of ``model`` (a tpkit causal LM or BART, in eval mode) over its paged KV cache.

    max_num_seqs: the most requests one step runs. max_num_batched_tokens: the most tokens one step runs
    (decodes, prompt chunks and, for BART, the encoder's prompts). kv_cache_memory: the KV cache's bytes per
    rank (an int), or a fraction in (0, 1] of the GPU memory free after the weights (off a GPU, of
    ``CPU_KV_CACHE_BYTES``); an encoder-decoder model splits it evenly between its self- and cross-attention
    caches. prefix_caching: reuse the K/V of prompts' shared full blocks. cuda_graph: on CUDA, replay steps
    of decodes only from CUDA graphs captured (on first use) for batch sizes up to ``max_num_seqs``.
    """

    def __init__(self, model: PagedLM, *, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 kv_cache_memory: float | int = 0.9, prefix_caching: bool = True,
                 cuda_graph: bool = True) -> None:
        if not isinstance(model, PagedLM):
            raise TypeError(f"Engine: model: expected a tpkit model (a PagedLM), got {type(model).__name__}")
        sizes = {"max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens}
        for name, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Engine: {name}: expected an int >= 1, got {value!r}")
        for name, value in (("prefix_caching", prefix_caching), ("cuda_graph", cuda_graph)):
            if not isinstance(value, bool):
                raise TypeError(f"Engine: {name}: expected a bool, got {type(value).__name__}")
        model._check_can_generate()
        check_ranks_agree("Engine", model.tp_group, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, prefix_caching=prefix_caching,
                          cuda_graph=cuda_graph)
        self.model = model
        self.tp_group = model.tp_group
        num_blocks = self._num_blocks(_budget_bytes(kv_cache_memory, model.device))
        use_graphs = cuda_graph and model.device.type == "cuda"
        graph_sizes = sorted({max(max_num_seqs >> i, 1) for i in range(_MAX_GRAPH_SIZES)})
        if not use_graphs:
            graph_sizes = []
        model._drop_graphs()  # graphs captured over other caches
        self.runner = ModelRunner(model, num_blocks, prefix_caching=prefix_caching, graph_sizes=graph_sizes)
        self.scheduler = Scheduler(self.runner, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens)
        self._share = Sampler(temperature=0.0, top_k=None, top_p=None, seed=None, device=model.device,
                              tp_group=self.tp_group)
        self._requests: dict[int, Request] = {}
        self._aborted: list[Request] = []
        self._in_flight: _InFlight | None = None  # the step launched ahead, its tokens not read yet
        self._next_id = itertools.count()
        self._eos = frozenset(model.eos_token_ids)

    def _num_blocks(self, budget: int) -> dict[str, int]:
        """Blocks per cache in ``budget`` bytes, the fewest any rank can hold (the ranks schedule alike)."""
        layout = self.model.kv_cache_layout()
        share = budget // len(layout)
        blocks = {}
        for name, (num_layers, num_kv_heads, head_size) in layout.items():
            block_bytes = 2 * num_layers * self.model.kv_block_size * num_kv_heads * head_size * \
                self.model.cache_dtype.itemsize  # keys and values, every layer
            blocks[name] = share // block_bytes
        counts = torch.tensor(list(blocks.values()), dtype=torch.int64,
                              device="cuda" if self.tp_group.backend == "nccl" else "cpu")
        if self.tp_group.size > 1:
            dist.all_reduce(counts, op=dist.ReduceOp.MIN, group=self.tp_group.group)
        blocks = dict(zip(blocks, counts.tolist(), strict=True))
        if min(blocks.values()) < 1:
            raise ValueError(f"Engine: kv_cache_memory: {budget} bytes hold no KV block of every cache "
                             f"({blocks}): give the cache more memory")
        return blocks

    # Requests ----------------------------------------------------------------------------------------------
    def add_request(self, prompt: Sequence[int] | torch.Tensor, sampling: SamplingParams) -> int:
        """Queue a prompt (token ids) to generate with ``sampling``; returns its request id."""
        return self._add([self._check(prompt, sampling)])[0]

    def abort(self, request_id: int) -> bool:
        """Stop a request; the next :meth:`step` reports it finished ("abort"). False if it had already
        finished."""
        if isinstance(request_id, bool) or not isinstance(request_id, int):
            raise TypeError(f"Engine.abort: request_id: expected an int, got {type(request_id).__name__}")
        check_ranks_agree("Engine.abort", self.tp_group, request_id=request_id)
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        self.scheduler.remove(request)
        request.finish_reason = "abort"
        self._aborted.append(request)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests) or bool(self._aborted)

    @property
    def num_preemptions(self) -> int:
        """Requests preempted so far (their blocks freed, computed again later)."""
        return self.scheduler.num_preemptions

    def _check(self, prompt: Sequence[int] | torch.Tensor, sampling: SamplingParams) -> tuple[list[int],
                                                                                          SamplingParams]:
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"Engine: sampling: expected a SamplingParams, got {type(sampling).__name__}")
        (ids,) = check_prompts([prompt], self.model.vocab_size)
        self.model._plan_kv_cache([len(ids)], sampling.max_new_tokens)  # positions: a ValueError by name
        probe = Request(-1, ids, sampling, [], None, 0.0)
        error = self.runner.capacity_error(probe)
        if error is not None:
            raise ValueError(f"Engine: prompt of {len(ids)} tokens with max_new_tokens "
                             f"{sampling.max_new_tokens}: {error}; give the engine more kv_cache_memory")
        extra = self.runner.start_tokens(probe)
        if extra + 1 > self.scheduler.max_num_batched_tokens:
            raise ValueError(f"Engine: prompt: expected at most max_num_batched_tokens - 1 = "
                             f"{self.scheduler.max_num_batched_tokens - 1} tokens (the encoder runs a prompt "
                             f"in one step, with the decoder's first token), got {len(ids)}")
        return ids, sampling

    def _add(self, checked: list[tuple[list[int], SamplingParams]]) -> list[int]:
        check_ranks_agree("Engine.add_request", self.tp_group,
                          requests=[(ids, repr(sampling)) for ids, sampling in checked])
        model, ids_out = self.model, []
        for ids, sampling in checked:
            request_id = next(self._next_id)
            start = [ids] if not self.runner.encoder_decoder else [[model.decoder_start_token_id]]
            request = Request(request_id, ids, sampling, list(start[0]),
                              request_sampler(sampling, model.device, self.tp_group), time.perf_counter())
            self._requests[request_id] = request
            self.scheduler.add(request)
            ids_out.append(request_id)
        return ids_out

    # Steps -------------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; the outputs of the requests that generated a token or finished in it."""
        aborted, generated = self._step()
        return [_output(r, []) for r in aborted] + [_output(r, [token]) for r, token in generated]

    def _step(self) -> tuple[list[Request], list[tuple[Request, int]]]:
        """One scheduled step: the requests aborted since the last step, and each (request, token) the step
        generated, in batch order.

        The GPU runs ahead of the host by one step: the next step is launched, its inputs taking the tokens
        this step drew on the device, before this step's tokens are read back, so that the host's scheduling
        of a step overlaps the GPU's running of the one before. A request that stops on a token the host has
        not read yet runs once more in the step launched meanwhile, and that step's token for it is dropped.
        """
        aborted, self._aborted = self._aborted, []
        current = self._in_flight
        if current is None:
            current = self._launch(self.scheduler.schedule(), None)
        self._in_flight = self._launch(self.scheduler.schedule(), current)
        return aborted, self._collect(current) if current is not None else []

    def _launch(self, batch: list[tuple[Request, int]], previous: _InFlight | None) -> _InFlight | None:
        """Queue one step of ``batch`` on the device and the draw of its tokens, then count its tokens as
        computed: a request whose context it finishes holds :data:`DRAWN` as its next token. None for an
        empty batch."""
        if not batch:
            return None
        greedy = all(request.sampler is None for request, _ in batch)
        out, drew = self.runner.run(batch, previous.drawn if previous is not None else None, greedy=greedy)
        done = []  # the requests whose context the step finished, in batch order
        for request, num_tokens in batch:
            request.num_computed += num_tokens
            if request.num_computed == len(request.context):
                done.append(request)
        if drew:  # the step's greedy tokens, in the graph's buffer: every rank takes rank 0's
            tokens = self._share.share(out.clone())  # [len(done)]
        elif done:
            tokens = draw_tokens(out, [r.sampler for r in done], self._share)  # [len(done)]
        else:
            tokens = torch.empty(0, dtype=torch.int64, device=out.device)
        self._force(tokens, done)
        positions = []
        for request in done:
            positions.append(len(request.context))
            request.context.append(DRAWN)
            if self._num_generated(request) == request.params.max_new_tokens:
                self.scheduler.remove(request)  # its last token: no step runs it
        return _InFlight(done, positions, tokens, *_to_host(tokens))

    def _collect(self, step: _InFlight) -> list[tuple[Request, int]]:
        """Read a launched step's tokens back (waiting for it) into its requests' outputs, and retire the
        requests that are done; each (request, token), in batch order."""
        if step.ready is not None:
            step.ready.synchronize()
        now = time.perf_counter()
        generated = []
        for request, position, token in zip(step.requests, step.positions, step.host.tolist(), strict=True):
            if request.finish_reason is not None:  # aborted, or stopped on a token an earlier step drew
                continue
            request.context[position] = token
            request.output.append(token)
            request.token_times.append(now)
            params = request.params
            if token in params.stop_token_ids or (not params.ignore_eos and token in self._eos):
                request.finish_reason = "stop"
            elif len(request.output) == params.max_new_tokens:
                request.finish_reason = "length"
            if request.finish_reason is not None:
                self.scheduler.remove(request)
                del self._requests[request.request_id]
            else:
                self.runner.record_token(request, position, token)
            generated.append((request, token))
        return generated

    def _num_generated(self, request: Request) -> int:
        """Tokens generated for the request so far, those still on the device included."""
        return len(request.context) - (1 if self.runner.encoder_decoder else len(request.prompt))

    def _force(self, tokens: torch.Tensor, requests: list[Request]) -> None:
        """The model's forced first / last token where it has one (BART's), as ``generate`` does, into the
        drawn ``tokens`` ``[len(requests)]`` on the device."""
        model, forced = self.model, []
        for row, request in enumerate(requests):
            step = self._num_generated(request)
            if step == request.params.max_new_tokens - 1 and model.forced_eos_token_id is not None:
                forced.append((row, model.forced_eos_token_id))
            elif step == 0 and model.forced_bos_token_id is not None:
                forced.append((row, model.forced_bos_token_id))
        if forced:
            rows, ids = copy_to_device([torch.tensor([r for r, _ in forced]),
                                        torch.tensor([t for _, t in forced])], tokens.device)
            tokens[rows] = ids

    def generate(self, prompts: Prompts, sampling: SamplingParams | Sequence[SamplingParams]
                 ) -> list[list[int]]:
        """Each prompt's new token ids, in order: every prompt queued (all checked first), then steps until
        they are done. ``sampling``: one for every prompt, or one per prompt. A progress bar counts finished
        prompts on rank 0 (off with ``TPKIT_DISABLE_PROGRESS=1``)."""
        token_lists = check_prompts(prompts, self.model.vocab_size)
        if isinstance(sampling, SamplingParams):
            sampling = [sampling] * len(token_lists)
        elif not isinstance(sampling, Sequence) or len(sampling) != len(token_lists):
            got = len(sampling) if isinstance(sampling, Sequence) else type(sampling).__name__
            raise ValueError(f"Engine.generate: sampling: expected one SamplingParams or {len(token_lists)} "
                             f"(one per prompt), got {got}")
        ids = self._add([self._check(p, s) for p, s in zip(token_lists, sampling, strict=True)])
        index = {request_id: i for i, request_id in enumerate(ids)}
        results: list[list[int]] = [[] for _ in ids]
        disable = env_flag("TPKIT_DISABLE_PROGRESS", False) or self.tp_group.rank != 0
        with tqdm(total=len(ids), desc="Engine.generate", unit="req", disable=disable) as progress:
            remaining = len(ids)
            while remaining:
                # The steps' requests, not their RequestOutputs: no copy of every history every step.
                aborted, generated = self._step()
                for request in aborted + [r for r, _ in generated]:
                    if request.finish_reason is not None and request.request_id in index:
                        results[index[request.request_id]] = list(request.output)
                        remaining -= 1
                        progress.update(1)
        return results


def _budget_bytes(kv_cache_memory: float | int, device: torch.device) -> int:
    if isinstance(kv_cache_memory, bool) or not isinstance(kv_cache_memory, (int, float)):
        raise TypeError(f"Engine: kv_cache_memory: expected bytes (an int) or a fraction (a float), got "
                        f"{type(kv_cache_memory).__name__}")
    if isinstance(kv_cache_memory, int):
        if kv_cache_memory < 1:
            raise ValueError(f"Engine: kv_cache_memory: expected bytes >= 1, got {kv_cache_memory}")
        return kv_cache_memory
    if not 0.0 < kv_cache_memory <= 1.0:
        raise ValueError(f"Engine: kv_cache_memory: expected a fraction in (0, 1], got {kv_cache_memory!r}")
    free = available_bytes(device) if device.type == "cuda" else CPU_KV_CACHE_BYTES
    return int(free * kv_cache_memory)


def _output(request: Request, new_token_ids: list[int]) -> RequestOutput:
    return RequestOutput(request_id=request.request_id, new_token_ids=new_token_ids,
                         token_ids=list(request.output), finished=request.finish_reason is not None,
                         finish_reason=request.finish_reason, arrival_time=request.arrival_time,
                         first_token_time=request.token_times[0] if request.token_times else None,
                         token_times=list(request.token_times))


@dataclass
class _InFlight:
    """A launched step: the requests it draws a token for, in batch order, each token's position in its
    request's context, the tokens on the device (int64 ``[len(requests)]``) and their copy on the host, whole
    once ``ready`` (None: already) has happened."""

    requests: list[Request]
    positions: list[int]
    tokens: torch.Tensor
    host: torch.Tensor
    ready: torch.cuda.Event | None

    @property
    def drawn(self) -> Drawn:
        return self.tokens, {request: row for row, request in enumerate(self.requests)}


def _to_host(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """``tokens`` on the host, copied without the host waiting, and the event after which the copy is whole
    (None off a GPU, where ``tokens`` are on the host already)."""
    if not tokens.is_cuda:
        return tokens, None
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record()
    return host, ready
