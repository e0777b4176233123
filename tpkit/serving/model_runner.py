"""The engine's view of a model: its KV caches, a request's blocks in them, and one step over a mixed batch.

A step is a list of ``(request, num_tokens)``: the next ``num_tokens`` of each request's context, already
given slots in the caches (:meth:`ModelRunner.append`), run in one call of the model over their tokens packed
together (``query_start_loc``), returning the logits of the requests whose context the step finishes.
A decoder-only model runs :meth:`PagedDecoderOnlyLM._packed_step`; an encoder-decoder (BART) runs the encoder
over the prompts the step starts, their K/V into the cross cache, and the decoder over every request's tokens
in the same call. On CUDA, a step of decodes only replays the model's CUDA graph of the next captured batch
size up, its rows past the batch padding; where no request of the step samples, the graph draws the greedy
tokens too.

A step may be launched before the one before it has been read back: a request whose last context token the
previous step drew holds :data:`~tpkit.serving.request.DRAWN` there on the host, and the step takes that
token from the previous step's tokens on the device. Its id reaches the prefix cache when the host reads it
(:meth:`ModelRunner.record_token`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence

import torch

from tpkit.attention import AttentionMetadata, chunk_positions, copy_to_device, host_longs
from tpkit.models.generation import PagedDecoderOnlyLM, PagedLM
from tpkit.serving.request import DRAWN, Request

Batch = Sequence[tuple[Request, int]]
# The tokens a launched step drew, still on the device (int64 ``[num_drawn]``), and the row of each request's.
Drawn = tuple[torch.Tensor, Mapping[Request, int]]
_MIN_GRAPH_WIDTH = 8  # blocks: the narrowest block table a decode graph is captured for


class ModelRunner:
    """Caches of ``num_blocks[name]`` blocks for ``model``; ``graph_sizes`` the decode batch sizes a CUDA
    graph is captured for (empty: every step eager)."""

    def __init__(self, model: PagedLM, num_blocks: dict[str, int], *, prefix_caching: bool,
                 graph_sizes: Sequence[int]) -> None:
        self.model = model
        self.encoder_decoder = not isinstance(model, PagedDecoderOnlyLM)
        # The decoder of an encoder-decoder model starts from one token: no full block to share.
        self.prefix_caching = prefix_caching and not self.encoder_decoder
        self.caches = {name: model.new_kv_cache(blocks, name) for name, blocks in num_blocks.items()}
        self.block_size = model.kv_block_size
        self.graph_sizes = sorted(graph_sizes)
        self._max_blocks = {name: -(-model.max_positions // self.block_size) for name in self.caches}
        self._to_encode: dict[int, list[int]] = {}  # the prompts of the requests the next step encodes
        # The last decode step's cross-attention metadata and its sequences: the cross cache changes only
        # when a request starts or is freed, so consecutive steps of the same requests share it.
        self._cross_decode: tuple[tuple[int, ...], AttentionMetadata] | None = None

    def capacity_error(self, request: Request) -> str | None:
        """Why the request could never fit the caches, even alone; None if it can."""
        needs = self.model._plan_kv_cache([len(request.prompt)], request.params.max_new_tokens)
        for name, (tokens,) in needs.items():
            blocks = -(-tokens // self.block_size)
            if blocks > self.caches[name].num_blocks:
                return (f"it needs {tokens} tokens of the {name!r} KV cache, which holds "
                        f"{self.caches[name].num_blocks * self.block_size}")
        return None

    def start_tokens(self, request: Request) -> int:
        """Tokens a step runs, beyond its context's, for a request it starts: the encoder's prompt."""
        return len(request.prompt) if self.encoder_decoder else 0

    def start(self, request: Request) -> bool:
        """Give a waiting request its sequences (False, and nothing held, when blocks run out); sets
        ``num_computed`` to its context's tokens found in the prefix cache."""
        seq_id = request.request_id
        self._cross_decode = None
        request.num_computed = self.caches["self"].add_sequence(
            seq_id, request.context if self.prefix_caching else None)
        if not self.encoder_decoder:
            return True
        cross = self.caches["cross"]
        cross.add_sequence(seq_id)
        try:
            cross.append_slots([seq_id], [len(request.prompt)])
        except RuntimeError:  # out of blocks (the cache is as it was)
            self.free(request)
            return False
        self._to_encode[seq_id] = request.prompt
        return True

    def append_decodes(self, requests: Sequence[Request]) -> bool:
        """A slot each for the next token of requests that decode (one pending token each), all or none;
        False (nothing changed) when blocks run out. The tokens' ids come later (:meth:`record_token`)."""
        try:
            self.caches["self"].append_slots([r.request_id for r in requests], [1] * len(requests))
        except RuntimeError:
            return False
        return True

    def append(self, request: Request, num_tokens: int) -> bool:
        """Slots for the request's next ``num_tokens`` context tokens; False (nothing changed) when blocks run
        out."""
        start = request.num_computed
        ids = request.context[start:start + num_tokens]
        # A drawn token still on the device is the context's last; its id comes later (record_token).
        token_ids = [ids] if self.prefix_caching and ids[-1] != DRAWN else None
        try:
            self.caches["self"].append_slots([request.request_id], [num_tokens], token_ids=token_ids)
        except RuntimeError:
            return False
        return True

    def record_token(self, request: Request, position: int, token: int) -> None:
        """A drawn token read back on the host, at ``position`` of the request's context: into the prefix
        cache's record of the request's tokens (a decoder's context is its cache's sequence)."""
        cache = self.caches["self"]
        if self.prefix_caching and request.request_id in cache:
            cache.record_token_ids(request.request_id, position, [token])

    def free(self, request: Request) -> None:
        """Let the request's blocks go (those the prefix cache knows stay cached)."""
        self._to_encode.pop(request.request_id, None)
        self._cross_decode = None
        for cache in self.caches.values():
            if request.request_id in cache:
                cache.free(request.request_id)

    @torch.inference_mode()
    def run(self, batch: Batch, drawn: Drawn | None = None, *, greedy: bool = False
            ) -> tuple[torch.Tensor, bool]:
        """One model call over the batch (slots appended) for the ``n`` requests whose context the step
        reaches the end of, in batch order: their logits ``[n, vocab]`` and False or, where ``greedy`` (every
        request of the batch draws greedily) and the step replays a CUDA graph, their greedy tokens int64
        ``[n]``, drawn inside the graph, and True. ``drawn``: the previous step's tokens, for the requests
        whose last context token is one of them."""
        size = self._graph_size(batch)
        if size is not None:
            return self._run_graph(batch, size, drawn, greedy)
        chunks = [(r.request_id, r.num_computed, r.context[r.num_computed:r.num_computed + n])
                  for r, n in batch]
        ends = list(itertools.accumulate(n for _, n in batch))
        input_ids = self._input_ids([t for _, _, ids in chunks for t in ids], batch,
                                    [end - 1 for end in ends], drawn)  # [num_tokens]
        if self.encoder_decoder:
            hidden = self._encoder_decoder_step(chunks, input_ids)
        else:
            hidden = self.model._packed_step(self.caches["self"], chunks, input_ids)  # [num_tokens, hidden]
        # Rows of the tokens that end their request's context: the ones with logits.
        rows = torch.tensor([end - 1 for end, (r, n) in zip(ends, batch, strict=True)
                             if r.num_computed + n == len(r.context)], dtype=torch.int64)
        (rows,) = copy_to_device([rows], self.model.device)
        return self.model.compute_logits(hidden[rows]), False

    def _input_ids(self, tokens: list[int], batch: Batch, last: Sequence[int], drawn: Drawn | None
                   ) -> torch.Tensor:
        """The step's ``tokens`` ``[num_tokens]`` on the device, each request's last one (at ``last[i]`` for
        ``batch[i]``) taken from ``drawn`` where the previous step drew it."""
        at, sources = _drawn_patch(batch, last, drawn)
        token_ids = host_longs(tokens)  # filled in C: a tensor of a list converts a prefill's ints one by one
        if not at:
            (ids,) = copy_to_device([token_ids], self.model.device)
            return ids
        ids, at, sources = copy_to_device([token_ids, torch.tensor(at), torch.tensor(sources)],
                                          self.model.device)
        ids[at] = drawn[0][sources]
        return ids

    def _encoder_decoder_step(self, chunks: list[tuple[int, int, list[int]]], input_ids: torch.Tensor
                              ) -> torch.Tensor:
        """Final decoder hidden states ``[num_tokens, d_model]`` of one packed step of the decoder's
        ``input_ids`` ``[num_tokens]``, the encoder run over the prompts of the requests it starts."""
        model, device = self.model, self.model.device
        seq_ids = [seq_id for seq_id, _, _ in chunks]
        new = [seq_id in self._to_encode for seq_id in seq_ids]
        prompt_lens = [self.caches["cross"].seq_len(seq_id) if fresh else 0
                       for seq_id, fresh in zip(seq_ids, new, strict=True)]
        encoder_tokens = None
        if any(new):
            prompts = [self._to_encode[seq_id] for seq_id, fresh in zip(seq_ids, new, strict=True) if fresh]
            encoder_tokens = model.encode_packed(prompts)  # [1, sum(prompt lengths), d_model]
        self_metadata = self.caches["self"].step_metadata(seq_ids, [len(ids) for _, _, ids in chunks])
        # Cross-attention's queries are the decoder's tokens; the encoder's K/V are written for new prompts.
        cross_metadata = dataclasses.replace(self.caches["cross"].step_metadata(seq_ids, prompt_lens),
                                             query_lens=self_metadata.query_lens,
                                             query_start_loc=self_metadata.query_start_loc)
        positions = chunk_positions(chunks)
        (positions,) = copy_to_device([positions], device)  # [num_tokens]
        hidden = model.decode(input_ids[None], positions[None], encoder_tokens, self.caches,
                              {"self": self_metadata, "cross": cross_metadata})
        for seq_id in seq_ids:
            self._to_encode.pop(seq_id, None)
        return hidden[0]

    # CUDA graphs ------------------------------------------------------------------------------------------
    def _graph_size(self, batch: Batch) -> int | None:
        """The captured batch size a step of decodes only pads up to; None for an eager step."""
        if not self.graph_sizes or len(batch) > self.graph_sizes[-1]:
            return None
        if any(n != 1 or r.num_pending != 1 or r.request_id in self._to_encode for r, n in batch):
            return None
        return next(size for size in self.graph_sizes if size >= len(batch))

    def _graph_width(self, name: str, needed: int) -> int:
        """The block-table width of the graph for a step whose widest table in cache ``name`` is ``needed``
        blocks: the next power of two up (at least ``_MIN_GRAPH_WIDTH``), at most the model's positions. The
        attention kernel splits a context by its table's width, so a graph as wide as the model's positions
        would split short contexts into partitions that are mostly empty."""
        return min(self._max_blocks[name], max(_MIN_GRAPH_WIDTH, 1 << (needed - 1).bit_length()))

    def _cross_decode_metadata(self, seq_ids: list[int]) -> AttentionMetadata:
        """The cross cache's decode metadata of ``seq_ids`` on the host (nothing appended): the last step's
        where its sequences were the same."""
        key = tuple(seq_ids)
        if self._cross_decode is None or self._cross_decode[0] != key:
            metadata = self.caches["cross"].decode_metadata(seq_ids, append=False, on_host=True)
            self._cross_decode = (key, metadata)
        return self._cross_decode[1]

    def _run_graph(self, batch: Batch, size: int, drawn: Drawn | None, greedy: bool
                   ) -> tuple[torch.Tensor, bool]:
        model = self.model
        seq_ids = [r.request_id for r, _ in batch]
        # Decode-shaped metadata (no query_start_loc) with block tables as wide as the sequences need: the
        # graph's static tables are wider, their further columns zero.
        metadata: dict[str, AttentionMetadata] = {"self": dataclasses.replace(
            self.caches["self"].step_metadata(seq_ids, [1] * len(batch), on_host=True), query_start_loc=None)}
        if self.encoder_decoder:
            metadata["cross"] = self._cross_decode_metadata(seq_ids)
        widths = {name: self._graph_width(name, m.block_tables.shape[1]) for name, m in metadata.items()}
        # A batch that only draws greedily draws inside the graph, as generate's graphs do: a few launches
        # fewer on the host a step, and a few bytes of tokens out instead of the logits.
        decode_step = model._decode_and_draw if greedy else model._decode_step
        step = model._graph_step(decode_step, self.caches, size, widths, ("serving", greedy))
        at, sources = _drawn_patch(batch, range(len(batch)), drawn)
        tokens = torch.tensor([r.context[-1] for r, _ in batch])  # [batch]; DRAWN at the rows in ``at``
        # The graph's own output buffer, which its next replay overwrites: the caller copies from it first.
        return step.run_from_host(tokens, metadata, (drawn[0], at, sources) if at else None), greedy


def _drawn_patch(batch: Batch, last: Sequence[int], drawn: Drawn | None) -> tuple[list[int], list[int]]:
    """For each request of the batch whose last context token the previous step drew: that token's index
    ``last[i]`` in the step's tokens, and its row in ``drawn`` (two lists, in batch order)."""
    at: list[int] = []
    sources: list[int] = []
    if drawn is not None:
        rows = drawn[1]
        for index, (request, _) in zip(last, batch, strict=True):
            if request in rows:
                at.append(index)
                sources.append(rows[request])
    return at, sources
