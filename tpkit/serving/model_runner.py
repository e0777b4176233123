"""The engine's view of a model: its KV caches, a request's blocks in them, and one step over a mixed batch.

A step is a list of ``(request, num_tokens)``: the next ``num_tokens`` of each request's context, already
given slots in the caches (:meth:`ModelRunner.append`), run in one call of the model over their tokens packed
together (``query_start_loc``), returning the logits of the requests whose context the step finishes.
A decoder-only model runs :meth:`PagedDecoderOnlyLM._packed_step`; an encoder-decoder (BART) runs the encoder
over the prompts the step starts, their K/V into the cross cache, and the decoder over every request's tokens
in the same call. On CUDA, a step of decodes only replays the model's CUDA graph of the next captured batch
size up, its rows past the batch padding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from tpkit.attention import AttentionMetadata
from tpkit.models.generation import PagedDecoderOnlyLM, PagedLM
from tpkit.serving.request import Request

Batch = Sequence[tuple[Request, int]]


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
        False (nothing changed) when blocks run out."""
        ids = [[r.context[r.num_computed]] for r in requests] if self.prefix_caching else None
        try:
            self.caches["self"].append_slots([r.request_id for r in requests], [1] * len(requests),
                                             token_ids=ids)
        except RuntimeError:
            return False
        return True

    def append(self, request: Request, num_tokens: int) -> bool:
        """Slots for the request's next ``num_tokens`` context tokens; False (nothing changed) when blocks run
        out."""
        start = request.num_computed
        ids = [request.context[start:start + num_tokens]] if self.prefix_caching else None
        try:
            self.caches["self"].append_slots([request.request_id], [num_tokens], token_ids=ids)
        except RuntimeError:
            return False
        return True

    def free(self, request: Request) -> None:
        """Let the request's blocks go (those the prefix cache knows stay cached)."""
        self._to_encode.pop(request.request_id, None)
        for cache in self.caches.values():
            if request.request_id in cache:
                cache.free(request.request_id)

    @torch.inference_mode()
    def run(self, batch: Batch) -> torch.Tensor:
        """One model call over the batch (slots appended); logits ``[n, vocab]`` of the ``n`` requests whose
        context the step reaches the end of, in batch order."""
        size = self._graph_size(batch)
        if size is not None:
            return self._run_graph(batch, size)
        device = self.model.device
        chunks = [(r.request_id, r.num_computed, r.context[r.num_computed:r.num_computed + n])
                  for r, n in batch]
        if self.encoder_decoder:
            hidden = self._encoder_decoder_step(chunks)
        else:
            hidden = self.model._packed_step(self.caches["self"], chunks)  # [num_tokens, hidden]
        ends = torch.tensor([n for _, n in batch], device=device).cumsum(0) - 1  # [num_seqs]
        last = torch.tensor([r.num_computed + n == len(r.context) for r, n in batch], device=device)
        return self.model.compute_logits(hidden[ends[last]])

    def _encoder_decoder_step(self, chunks: list[tuple[int, int, list[int]]]) -> torch.Tensor:
        """Final decoder hidden states ``[num_tokens, d_model]`` of one packed step, the encoder run over the
        prompts of the requests it starts."""
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
        input_ids = torch.tensor([[t for _, _, ids in chunks for t in ids]], device=device)  # [1, num_tokens]
        positions = torch.tensor([[p for _, start, ids in chunks for p in range(start, start + len(ids))]],
                                 device=device)
        hidden = model.decode(input_ids, positions, encoder_tokens, self.caches,
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

    def _run_graph(self, batch: Batch, size: int) -> torch.Tensor:
        model = self.model
        seq_ids = [r.request_id for r, _ in batch]
        # Decode-shaped metadata (no query_start_loc) with block tables as wide as the sequences need: the
        # graph's static tables are wider, their further columns zero.
        metadata: dict[str, AttentionMetadata] = {"self": dataclasses.replace(
            self.caches["self"].step_metadata(seq_ids, [1] * len(batch)), query_start_loc=None)}
        if self.encoder_decoder:
            metadata["cross"] = self.caches["cross"].decode_metadata(seq_ids, append=False)
        step = model._graph_step(model._decode_step, self.caches, size, self._max_blocks, ("serving",))
        # From pinned memory on a GPU: the copy queues behind the metadata's, the host does not wait for it.
        on_gpu = model.device.type == "cuda"
        last_tokens = torch.tensor([r.context[-1] for r, _ in batch], pin_memory=on_gpu)  # [batch]
        input_ids = last_tokens.to(model.device, non_blocking=on_gpu)[:, None]  # [batch, 1]
        return step(input_ids, metadata, range(len(batch))).clone()

