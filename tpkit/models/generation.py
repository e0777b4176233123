"""Generation on a paged KV cache: the one loop that every tpkit model uses (its sampler: ``sampling.py``).

A batch of ragged prompts runs together: the prefill, in packed steps of the prompts' tokens (one step, or
chunks of at most ``max_prefill_tokens`` tokens; with ``prefix_caching`` a prompt's first blocks that are
already in the cache are not computed again), then one paged decode step per token for every unfinished
sequence. A sequence stops after its EOS token (kept in its output) and its KV blocks go back to the cache at
once (those holding a prompt's full blocks stay in the prefix cache, for later prompts that start alike).

Sampling is the same on every rank by construction: rank 0 of the tensor-parallel group draws the tokens
(greedy, or with its seeded generator) and broadcasts them, so ranks can never drift apart, even where an
all-reduce left their logits different in the last bit. One small broadcast per step is the whole cost.

Models plug in through :class:`PagedLM`'s hooks; decoder-only models get them all from
:class:`PagedDecoderOnlyLM` and only define ``hidden_states`` and ``compute_logits``.
"""

from __future__ import annotations

import functools
import itertools
import threading
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from tpkit.attention import AttentionMetadata, PagedKVCache, chunk_positions, copy_to_device, host_longs
from tpkit.models.cuda_graph import DecodeGraph
from tpkit.models.prompts import Prompts, check_input_ids, check_prompts, parse_eos_token_ids
from tpkit.models.sampling import Sampler, greedy_tokens
from tpkit.models.sequence_parallel import NO_GENERATION
from tpkit.parallel_layers import check_ranks_agree

# Captured decode graphs a model keeps (one per batch size, block-table width and step variant).
_MAX_GRAPHS = 32
StepFn = Callable[[torch.Tensor, Mapping[str, AttentionMetadata], Sequence[int]], torch.Tensor]

def _one_call_at_a_time(generate: Callable) -> Callable:
    """``generate`` of a model refuses to start while the same model is generating in another thread: the
    two would share its KV caches and CUDA graphs."""
    guard = threading.Lock()

    @functools.wraps(generate)
    def exclusive(self: PagedLM, *args: Any, **kwargs: Any) -> list[list[int]]:
        with guard:
            if getattr(self, "_generating", False):
                raise RuntimeError("generate: this model is already generating (in another thread): it "
                                   "runs one generate call at a time; batch the prompts into one call, or "
                                   "give each thread a model of its own")
            self._generating = True
        try:
            return generate(self, *args, **kwargs)
        finally:
            self._generating = False

    return exclusive


class PagedLM(nn.Module, ABC):
    """Base of tpkit's models: ``generate`` over paged KV caches.

    A subclass sets ``vocab_size``, ``max_positions``, ``eos_token_ids`` and ``tp_group`` and implements the
    hooks: ``kv_cache_layout``, ``_plan_kv_cache``, ``_prefill``, ``_decode_metadata``, ``_decode_step``.
    Caches are named (``"self"``; BART adds ``"cross"``). They are sized for the batch at hand, kept for the
    next call while big enough (a captured CUDA graph stays valid with them) and dropped by
    :meth:`clear_kv_cache`.

    Captured decode graphs are kept per batch shape, the ``_MAX_GRAPHS`` most recently used, in one memory
    pool that a new capture reuses. A pool is captured into only while one of its graphs is alive: when the
    last goes (a cache replaced, :meth:`clear_kv_cache`) the pool goes with it, its memory is given back,
    and the next capture starts a new one. (The caching allocator refuses, with an internal assert, a
    capture into a pool that no live graph uses but whose memory is still held.)
    """

    kv_block_size = 16
    # The dtype of the KV caches: None for the model's, or a float8 dtype (scales from kv_cache_scales).
    kv_cache_dtype: torch.dtype | None = None
    sequence_parallel = False  # built for training with the residual stream split along the sequence
    vocab_size: int
    max_positions: int
    max_positions_key = "max_position_embeddings"  # the config key of max_positions, for messages
    eos_token_ids: tuple[int, ...]
    tp_group: Any
    # As transformers' generation config: the first new token of an encoder-decoder model, and the token
    # at max_new_tokens - 1 of any model, forced (the EOS one wins where both fall on one step).
    forced_bos_token_id: int | None = None
    forced_eos_token_id: int | None = None
    # The prefix of the base model's names in transformers' checkpoints (the LM head's have none).
    checkpoint_prefix = "model."

    def __init__(self) -> None:
        super().__init__()
        self._kv_caches: dict[str, PagedKVCache] = {}
        self._graphs: OrderedDict[tuple, DecodeGraph] = OrderedDict()  # least recently used first
        self._graph_pool: Any = None
        self._compiled_decode_steps: dict[str, Callable] = {}  # by the step's name
        # The "self" cache's float8 scales by layer, {"k": k_scale, "v": v_scale} (this rank's KV heads, or
        # one a layer), from the checkpoint (tpkit.models.kv_scales) or set by the user; 1.0 where missing.
        self.kv_cache_scales: dict[int, dict[str, torch.Tensor]] = {}

    def export_weights(self, weights: Iterable[tuple[str, torch.Tensor]]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
        """The inverse of ``load_weights``' renaming, for ``tpkit.checkpoint.export_hf``: full tensors under
        the model's names (stacked parameters already split by ``stacked_params_mapping``) -> transformers'
        names."""
        for name, tensor in weights:
            yield (name if name.startswith("lm_head.") else self.checkpoint_prefix + name), tensor

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def kv_caches(self) -> dict[str, PagedKVCache]:
        """The paged KV caches of the last ``generate`` call, by name (empty before the first)."""
        return dict(self._kv_caches)

    def clear_kv_cache(self) -> None:
        """Drop the KV caches and captured CUDA graphs, returning their memory."""
        self._kv_caches.clear()
        self._drop_graphs()

    def _drop_graphs(self) -> None:
        """Drop every captured graph and their pool; give the memory of both (and of any cache dropped
        before) back to the device, so that memory follows what is alive rather than what was."""
        self._graphs.clear()
        self._graph_pool = None
        torch.cuda.empty_cache()  # without an initialised CUDA context (a CPU-only run) it does nothing

    # Hooks -------------------------------------------------------------------------------------------------
    @abstractmethod
    def kv_cache_layout(self) -> dict[str, tuple[int, int, int]]:
        """Per cache name: (num_layers, num_kv_heads on this rank, head_size)."""

    @abstractmethod
    def _plan_kv_cache(self, prompt_lens: Sequence[int], max_new_tokens: int) -> dict[str, list[int]]:
        """Per cache name, the tokens each sequence will store; a ValueError if positions run out."""

    @abstractmethod
    def _prefill(self, prompts: list[list[int]], caches: Mapping[str, PagedKVCache],
                 prefix_caching: bool = False, max_prefill_tokens: int | None = None) -> torch.Tensor:
        """Run the prompts (sequence ids 0..batch-1), fill the caches; logits of the first new token
        ``[batch, vocab]``. ``prefix_caching``: reuse (and register) the prompts' full blocks in the prefix
        cache; ``max_prefill_tokens``: the most prompt tokens one step runs (None: every prompt at once)."""

    @abstractmethod
    def _decode_metadata(self, caches: Mapping[str, PagedKVCache], seq_ids: Sequence[int],
                         max_blocks: Mapping[str, int] | None = None) -> dict[str, AttentionMetadata]:
        """Metadata of one decode step of ``seq_ids`` per cache (allocates a slot for each new token), the
        block tables ``max_blocks[name]`` wide (None: as wide as the sequences need)."""

    @abstractmethod
    def _decode_step(self, input_ids: torch.Tensor, metadata: Mapping[str, AttentionMetadata],
                     caches: Mapping[str, PagedKVCache]) -> torch.Tensor:
        """input_ids ``[batch, 1]`` -> logits ``[batch, vocab]``. Only device work: it is what a CUDA graph
        captures, so no host synchronisation and nothing that depends on tensor values on the host."""

    # Generation --------------------------------------------------------------------------------------------
    @_one_call_at_a_time
    @torch.inference_mode()
    def generate(self, prompts: Prompts, max_new_tokens: int, *, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 ignore_eos: bool = False, cuda_graph: bool = False, compile: bool = False,
                 prefix_caching: bool = False, max_prefill_tokens: int | None = None) -> list[list[int]]:
        """Generate up to ``max_new_tokens`` tokens for each prompt; returns each prompt's new tokens.

        prompts: token-id lists of any lengths, or a 2-D tensor. temperature 0 is greedy; otherwise
        temperature, top_k and top_p filter as in transformers and ``seed`` makes the draw reproducible.
        A sequence stops after one of ``eos_token_ids`` (kept in its output) unless ``ignore_eos``.
        ``forced_bos_token_id`` / ``forced_eos_token_id``, where the model has them (BART, from its config),
        replace the first / last of the ``max_new_tokens`` tokens, as transformers does.
        ``cuda_graph`` replays the decode step from a CUDA graph captured for this batch shape (the first
        call for a shape captures it). ``compile`` runs the decode step through ``torch.compile``, which
        fuses its small element-wise kernels (compiled on first use, again for each new batch shape).
        ``prefix_caching`` reuses the K/V of a prompt's first full blocks (``kv_block_size`` tokens each)
        where an earlier prompt, of this call or of an earlier one, started with the same tokens, and keeps
        this call's for later ones (in the model's caches, while they are big enough). ``max_prefill_tokens``
        prefills in steps of at most that many prompt tokens, a long prompt in chunks. Neither changes the
        tokens generated (up to floating-point rounding).
        The model must be in eval mode (training mode would drop out), and every rank of its group must
        pass the same prompts and settings (checked: a ValueError on every rank names what differs).
        """
        check_ranks_agree("generate", self.tp_group, prompts=prompts, max_new_tokens=max_new_tokens,
                          temperature=temperature, top_k=top_k, top_p=top_p, ignore_eos=ignore_eos,
                          cuda_graph=cuda_graph, compile=compile, prefix_caching=prefix_caching,
                          max_prefill_tokens=max_prefill_tokens)
        self._check_can_generate()
        token_lists = check_prompts(prompts, self.vocab_size)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
        if not isinstance(prefix_caching, bool):
            raise TypeError(f"prefix_caching must be a bool, got {type(prefix_caching).__name__}")
        if max_prefill_tokens is not None and (isinstance(max_prefill_tokens, bool)
                                               or not isinstance(max_prefill_tokens, int)
                                               or max_prefill_tokens < 1):
            raise ValueError(f"max_prefill_tokens must be None or an int >= 1, got {max_prefill_tokens!r}")
        device = self.device
        if cuda_graph and device.type != "cuda":
            raise ValueError(f"cuda_graph=True needs the model on a CUDA device, it is on {device}")
        prompt_lens = [len(ids) for ids in token_lists]
        needs = self._plan_kv_cache(prompt_lens, max_new_tokens)
        sample = Sampler(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, device=device,
                         tp_group=self.tp_group)
        eos = frozenset() if ignore_eos else frozenset(self.eos_token_ids)

        caches = self._reserve_kv_caches(needs)
        batch = len(token_lists)
        # Per cache, the widest block table a sequence of this generation needs.
        max_blocks = {name: -(-max(tokens) // self.kv_block_size) for name, tokens in needs.items()}
        # A graph replays the greedy draw with the step: its kernels then run without gaps between them and
        # the graph's launch, and the step hands back a few bytes of tokens instead of the logits.
        draws_in_step = cuda_graph and sample.is_greedy
        decode_step = self._decode_step
        if draws_in_step:
            decode_step = self._decode_and_draw
        if compile:
            decode_step = self._compiled(decode_step)
        if cuda_graph and max_new_tokens > 1:
            step = self._graph_step(decode_step, caches, batch, max_blocks, (compile, draws_in_step))
        else:
            step = lambda ids, metadata, _: decode_step(ids, metadata, caches)
        seq_ids = list(range(batch))
        outputs: list[list[int]] = [[] for _ in range(batch)]
        unchecked: list[torch.Tensor] = []  # [batch] per step when no EOS can stop a sequence
        live = set(seq_ids)
        prefilled = False
        try:
            logits = self._prefill(token_lists, caches, prefix_caching, max_prefill_tokens)
            prefilled = True
            tokens = self._next_tokens(sample, logits, 0, max_new_tokens)  # [len(seq_ids)]
            for i in range(max_new_tokens):
                if i > 0:
                    # Block tables as wide as a graph's in every step: the CUDA attention kernel plans its
                    # split-K from their width, so eager and graph steps take the same plan and tokens.
                    out = step(tokens[:, None], self._decode_metadata(caches, seq_ids, max_blocks), seq_ids)
                    tokens = self._next_tokens(sample, out, i, max_new_tokens, draws_in_step)
                if not eos:
                    # Nothing to decide on the host: the loop never waits for the device.
                    unchecked.append(tokens)
                    continue
                host = tokens.tolist()
                keep = []
                for row, (seq_id, token) in enumerate(zip(seq_ids, host, strict=True)):
                    outputs[seq_id].append(token)
                    if token in eos:
                        self._free(caches, seq_id)
                        live.discard(seq_id)
                    else:
                        keep.append(row)
                if len(keep) < len(seq_ids):
                    if not keep:
                        break
                    seq_ids = [seq_ids[row] for row in keep]
                    tokens = tokens[torch.tensor(keep, device=device)]
        finally:
            if prefilled:
                for seq_id in live:
                    self._free(caches, seq_id)
            else:
                # The prefill failed part way: which caches hold which sequences is unknown. Start afresh.
                self.clear_kv_cache()
        if unchecked:
            outputs = torch.stack(unchecked, dim=1).tolist()
        return outputs

    def _check_can_generate(self) -> None:
        if self.sequence_parallel:
            raise ValueError(NO_GENERATION)
        if self.training:
            raise ValueError("generate: the model is in training mode (model.train()), where its dropout "
                             "would drop activations: call model.eval() first")
        if self.device.type == "meta":
            raise ValueError("generate: the model is on the meta device, which holds no values: "
                             "model.to_empty(device=...) and load its weights first")
        parse_eos_token_ids(list(self.eos_token_ids))
        for key in ("forced_bos_token_id", "forced_eos_token_id"):
            token = getattr(self, key)
            if token is not None and (isinstance(token, bool) or not isinstance(token, int)
                                      or not 0 <= token < self.vocab_size):
                raise ValueError(f"generate: {key}: expected None or a token id in [0, {self.vocab_size}), "
                                 f"got {token!r}")

    def _next_tokens(self, sample: Sampler, out: torch.Tensor, step: int, max_new_tokens: int,
                     drawn: bool = False) -> torch.Tensor:
        """``[batch]`` token ids from a step's output: its logits ``[batch, vocab]`` sampled, or with
        ``drawn`` the tokens it drew ``[batch]`` (a graph's output, which its next replay overwrites: copied),
        unless a token is forced at this step (see ``forced_bos_token_id``). A forced token is the same on
        every rank, so nothing is broadcast for it."""
        if step == max_new_tokens - 1 and self.forced_eos_token_id is not None:
            forced = self.forced_eos_token_id
        else:
            forced = self.forced_bos_token_id if step == 0 else None
        if forced is not None:
            return torch.full((out.shape[0],), forced, dtype=torch.int64, device=out.device)
        return sample.share(out.clone()) if drawn else sample(out)

    @staticmethod
    def _free(caches: Mapping[str, PagedKVCache], seq_id: int) -> None:
        for cache in caches.values():
            cache.free(seq_id)

    @property
    def cache_dtype(self) -> torch.dtype:
        """The KV caches' dtype: ``kv_cache_dtype``, else the model's."""
        return self.kv_cache_dtype or self.dtype

    def new_kv_cache(self, num_blocks: int, name: str = "self") -> PagedKVCache:
        """A paged KV cache of ``num_blocks`` blocks for this model's cache ``name``, on its device, in
        :attr:`cache_dtype` (for :meth:`PagedDecoderOnlyLM.forward_on_cache`; ``generate`` manages its own).
        A float8 self-attention cache gets the scales of ``kv_cache_scales`` (1.0 where it has none)."""
        num_layers, num_kv_heads, head_size = self.kv_cache_layout()[name]
        cache = PagedKVCache(num_layers, num_blocks, self.kv_block_size, num_kv_heads, head_size,
                             dtype=self.cache_dtype, device=self.device)
        if cache.is_fp8 and name == "self":
            for layer_idx, scales in sorted(self.kv_cache_scales.items()):
                cache.set_scales(layer_idx, scales.get("k", 1.0), scales.get("v", 1.0))
        return cache

    def _reserve_kv_caches(self, needs: Mapping[str, Sequence[int]]) -> dict[str, PagedKVCache]:
        """Caches with room for ``needs`` (tokens per sequence, per cache); the last ones if they fit."""
        for name, tokens in needs.items():
            num_blocks = sum(-(-t // self.kv_block_size) for t in tokens)
            cache = self._kv_caches.get(name)
            if cache is None or cache.num_free_blocks < num_blocks or (cache.dtype, cache.device) != (
                    self.cache_dtype, self.device):
                # Let go of the old cache and the graphs that point into it, and give their memory back,
                # before allocating the new one.
                self._kv_caches.pop(name, None)
                self._drop_graphs()
                self._kv_caches[name] = self.new_kv_cache(num_blocks, name)
        return {name: self._kv_caches[name] for name in needs}

    def _decode_and_draw(self, input_ids: torch.Tensor, metadata: Mapping[str, AttentionMetadata],
                         caches: Mapping[str, PagedKVCache]) -> torch.Tensor:
        """:meth:`_decode_step` then the greedy draw, on a GPU: input_ids ``[batch, 1]`` -> ``[batch]``. Every
        rank draws; :meth:`Sampler.share` then gives them rank 0's tokens."""
        return greedy_tokens(self._decode_step(input_ids, metadata, caches))

    def _compiled(self, decode_step: Callable) -> Callable:
        compiled = self._compiled_decode_steps.get(decode_step.__name__)
        if compiled is None:
            # Shapes are static per batch: no dynamic-shape guards, the tightest code.
            compiled = torch.compile(decode_step, dynamic=False)
            self._compiled_decode_steps[decode_step.__name__] = compiled
        return compiled

    def _graph_step(self, decode_step: Callable, caches: Mapping[str, PagedKVCache], batch: int,
                    max_blocks: Mapping[str, int], variant: tuple) -> StepFn:
        key = (batch, tuple(sorted(max_blocks.items())), variant)
        graph = self._graphs.pop(key, None)
        if graph is None:
            while len(self._graphs) >= _MAX_GRAPHS:
                # The pool keeps the memory of the dropped graph for the next capture (other graphs still
                # use the pool).
                self._graphs.popitem(last=False)
            if self._graph_pool is None:
                self._graph_pool = torch.cuda.graph_pool_handle()
            try:
                graph = DecodeGraph(lambda ids, metadata: decode_step(ids, metadata, caches), batch,
                                    max_blocks, self.device, pool=self._graph_pool)
            except BaseException:
                if not self._graphs:
                    self._drop_graphs()  # a pool no graph uses is never captured into again
                raise
        self._graphs[key] = graph  # the most recently used last
        return graph


class PagedDecoderOnlyLM(PagedLM):
    """The generation hooks of a decoder-only model, which defines only ``hidden_states`` and
    ``compute_logits`` and sets ``num_layers``, ``num_kv_heads`` (this rank's) and ``head_size``."""

    num_layers: int
    num_kv_heads: int
    head_size: int

    @abstractmethod
    def hidden_states(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      kv_cache: PagedKVCache | None = None,
                      metadata: AttentionMetadata | None = None) -> torch.Tensor:
        """input_ids, positions ``[batch, seq]`` -> final hidden states ``[batch, seq, hidden]``."""

    @abstractmethod
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden states ``[..., hidden]`` -> full-vocabulary logits ``[..., vocab]`` on every rank."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids ``[batch, seq]`` -> logits ``[batch, seq, vocab]`` for every position, no cache."""
        check_input_ids("input_ids", input_ids, self.max_positions, self.max_positions_key)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        return self.compute_logits(self.hidden_states(input_ids, positions))

    def kv_cache_layout(self) -> dict[str, tuple[int, int, int]]:
        return {"self": (self.num_layers, self.num_kv_heads, self.head_size)}

    def _plan_kv_cache(self, prompt_lens: Sequence[int], max_new_tokens: int) -> dict[str, list[int]]:
        # The last sampled token is never fed back, so it takes no position and no cache slot.
        tokens = [n + max_new_tokens - 1 for n in prompt_lens]
        if max(tokens) > self.max_positions:
            raise ValueError(f"prompt length {max(prompt_lens)} + max_new_tokens {max_new_tokens} - 1 "
                             f"exceeds the model's {self.max_positions} positions ({self.max_positions_key})")
        return {"self": tokens}

    def _prefill(self, prompts: list[list[int]], caches: Mapping[str, PagedKVCache],
                 prefix_caching: bool = False, max_prefill_tokens: int | None = None) -> torch.Tensor:
        cache = caches["self"]
        budget = max_prefill_tokens or sum(len(ids) for ids in prompts)
        cached: list[int] = []  # per started prompt, its tokens in the cache
        logits = []  # [finished, vocab] per step, prompts finishing in order
        while len(cached) < len(prompts) or cached[-1] < len(prompts[-1]):
            # First come, first served: the oldest unfinished prompt's next tokens, then the next prompt's. A
            # prompt looks up its prefix when it starts, after the blocks of every earlier one are mapped
            # (written in this step at the latest, and each layer writes its K/V before it attends).
            chunks, ends = [], []  # (seq_id, start, token_ids); rows of prompts' last tokens
            seq_id = len(cached)
            if cached and cached[-1] < len(prompts[seq_id - 1]):
                seq_id -= 1  # the prompt the last step left unfinished (only the last started one can be)
            rows = 0
            while rows < budget and seq_id < len(prompts):
                if seq_id == len(cached):
                    cached.append(cache.add_sequence(seq_id, prompts[seq_id] if prefix_caching else None))
                start = cached[seq_id]
                ids = prompts[seq_id][start:start + budget - rows]
                cache.append_slots([seq_id], [len(ids)], token_ids=[ids] if prefix_caching else None)
                chunks.append((seq_id, start, ids))
                cached[seq_id] += len(ids)
                rows += len(ids)
                if cached[seq_id] == len(prompts[seq_id]):
                    ends.append(rows - 1)
                seq_id += 1
            hidden = self._packed_step(cache, chunks)  # [rows, hidden]
            if ends:
                # From pinned memory, queued behind the step: a copy from pageable memory would wait for the
                # whole step to finish before the host enqueues the logits' kernels.
                (rows,) = copy_to_device([host_longs(ends)], self.device)
                logits.append(self.compute_logits(hidden[rows]))
        return torch.cat(logits)

    def _packed_step(self, cache: PagedKVCache, chunks: list[tuple[int, int, list[int]]],
                     input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One packed step of token chunks ``(seq_id, start, token_ids)``, already appended to the cache (the
        tokens at positions ``start ..`` of their sequence); final hidden states ``[num_tokens, hidden]``.
        ``input_ids`` ``[num_tokens]`` on the device, where given, are the chunks' tokens (their lists then
        give the positions only)."""
        metadata = cache.step_metadata([seq_id for seq_id, _, _ in chunks],
                                       [len(ids) for _, _, ids in chunks])
        positions = chunk_positions(chunks)  # [num_tokens]
        if input_ids is None:
            tokens = host_longs(itertools.chain.from_iterable(ids for _, _, ids in chunks))
            positions, input_ids = copy_to_device([positions, tokens], self.device)
        else:
            (positions,) = copy_to_device([positions], self.device)
        return self.hidden_states(input_ids[None], positions[None], cache, metadata)[0]

    @torch.inference_mode()
    def forward_on_cache(self, kv_cache: PagedKVCache, seq_ids: Sequence[int],
                         token_ids: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Run new tokens of several sequences in one step on ``kv_cache`` (from :meth:`new_kv_cache`) and
        return the logits at every new position: speculative verification (a draft's tokens after each
        sequence's accepted ones; ``kv_cache.truncate(seq_id, k)`` then drops the ``k`` rejected), or a
        prefill that keeps every prompt position's logits.

        seq_ids: distinct ids; a cached sequence continues, an unknown one starts empty. token_ids: each
        sequence's new tokens, at least one. Returns per sequence float logits ``[len(token_ids[i]), vocab]``,
        row ``j`` scoring the token after ``token_ids[i][j]``. The tokens stay in the cache.
        """
        self._check_can_generate()
        layout = (self.num_layers, self.num_kv_heads, self.head_size, self.kv_block_size, self.cache_dtype,
                  self.device)
        got = (kv_cache.num_layers, kv_cache.num_kv_heads, kv_cache.head_size, kv_cache.block_size,
               kv_cache.dtype, kv_cache.device)
        if got != layout:
            raise ValueError(f"kv_cache: expected (num_layers, num_kv_heads, head_size, block_size, dtype, "
                             f"device) = {layout} (see new_kv_cache), got {got}")
        token_lists = check_prompts(token_ids, self.vocab_size)
        seq_ids = list(seq_ids)
        if len(seq_ids) != len(token_lists) or len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids: expected {len(token_lists)} distinct ids (one per token list), got "
                             f"{seq_ids}")
        starts = [kv_cache.seq_len(seq_id) if seq_id in kv_cache else 0 for seq_id in seq_ids]
        for seq_id, start, ids in zip(seq_ids, starts, token_lists, strict=True):
            if start + len(ids) > self.max_positions:
                raise ValueError(f"seq_id {seq_id}: {start} cached + {len(ids)} new tokens exceed the "
                                 f"model's {self.max_positions} positions ({self.max_positions_key})")
        new = [seq_id for seq_id in seq_ids if seq_id not in kv_cache]
        for seq_id in new:
            kv_cache.add_sequence(seq_id)
        try:
            kv_cache.append_slots(seq_ids, [len(ids) for ids in token_lists])
        except RuntimeError:
            for seq_id in new:  # out of blocks: as it was
                kv_cache.free(seq_id)
            raise
        hidden = self._packed_step(kv_cache, list(zip(seq_ids, starts, token_lists, strict=True)))
        return list(self.compute_logits(hidden).split([len(ids) for ids in token_lists]))

    def _decode_metadata(self, caches: Mapping[str, PagedKVCache], seq_ids: Sequence[int],
                         max_blocks: Mapping[str, int] | None = None) -> dict[str, AttentionMetadata]:
        width = None if max_blocks is None else max_blocks["self"]
        return {"self": caches["self"].decode_metadata(seq_ids, block_table_width=width)}

    def _decode_step(self, input_ids: torch.Tensor, metadata: Mapping[str, AttentionMetadata],
                     caches: Mapping[str, PagedKVCache]) -> torch.Tensor:
        self_metadata = metadata["self"]
        # The new token's position is the number of tokens cached before it; padding rows (seq_len 0) get 0.
        positions = (self_metadata.seq_lens.long() - 1).clamp_min(0)[:, None]  # [batch, 1]
        hidden = self.hidden_states(input_ids, positions, caches["self"], self_metadata)
        return self.compute_logits(hidden[:, 0])
