"""A model's decode step captured in one CUDA graph and replayed every step.

A decode step of a small batch is hundreds of small kernels; launched one by one from Python, the host is
slower than the GPU. Captured once, the whole step (embedding, every layer's projections, RoPE, cache write,
paged attention, all-reduces, logits, and with greedy sampling the draw) is one launch. The graph reads its
inputs from static buffers: token ids, and per KV cache the metadata (slot_mapping, block_tables, seq_lens;
positions follow from seq_lens). Each step copies the step's values into them, device to device, and replays.

The graph serves a fixed batch size; when sequences finish early their rows become padding: slot -1 (no
cache write) and seq_len 0 (nothing attended), so the graph never touches blocks that went back to the cache.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from tpkit.attention import AttentionMetadata


class StaticDecodeStep:
    """``step(input_ids [batch, 1], metadata) -> logits [batch, vocab]`` (or the tokens drawn from them,
    ``[batch]``) run on static buffers for a batch of ``batch`` sequences: what a CUDA graph replays, here run
    eagerly (which tests do on the CPU).

    max_blocks: per cache name, the widest block table a sequence of this batch can need.
    """

    def __init__(self, step: Callable[[torch.Tensor, Mapping[str, AttentionMetadata]], torch.Tensor],
                 batch: int, max_blocks: Mapping[str, int], device: torch.device) -> None:
        self.step = step
        self.batch = batch
        self.device = device
        self.input_ids = torch.zeros(batch, 1, dtype=torch.int64, device=device)
        # Every row starts as padding: no slot written, nothing attended.
        self.metadata = {
            name: AttentionMetadata(
                slot_mapping=torch.full((batch,), -1, dtype=torch.int64, device=device),
                block_tables=torch.zeros(batch, width, dtype=torch.int32, device=device),
                seq_lens=torch.zeros(batch, dtype=torch.int32, device=device),
                query_lens=torch.ones(batch, dtype=torch.int32, device=device),
            )
            for name, width in max_blocks.items()
        }

    def __call__(self, input_ids: torch.Tensor, metadata: Mapping[str, AttentionMetadata],
                 seq_ids: Sequence[int]) -> torch.Tensor:
        """One decode step of the sequences ``seq_ids`` (rows of the batch; all rows when none has
        finished): input_ids ``[len(seq_ids), 1]`` -> the step's output for those rows (logits
        ``[len(seq_ids), vocab]``, or tokens). With every row live, or the first rows given as
        ``range(count)``, a graph hands back (a view of) its own output buffer, which its next replay
        overwrites."""
        rows: torch.Tensor | slice | None = None
        if len(seq_ids) != self.batch:
            first = isinstance(seq_ids, range) and seq_ids.start == 0 and seq_ids.step == 1
            rows = slice(len(seq_ids)) if first else torch.tensor(seq_ids, device=self.device)
        _fill(self.input_ids, input_ids, rows, 0)
        for name, static in self.metadata.items():
            step_metadata = metadata[name]
            _fill(static.seq_lens, step_metadata.seq_lens, rows, 0)
            _fill(static.block_tables, step_metadata.block_tables, rows, 0)
            _fill(static.slot_mapping, step_metadata.slot_mapping, rows, -1)
        out = self._run()  # [batch, ...]
        return out if rows is None else out[rows]

    def _run(self) -> torch.Tensor:
        return self.step(self.input_ids, self.metadata)


class DecodeGraph(StaticDecodeStep):
    """:class:`StaticDecodeStep` captured once in a CUDA graph and replayed every step."""

    def __init__(self, step: Callable[[torch.Tensor, Mapping[str, AttentionMetadata]], torch.Tensor],
                 batch: int, max_blocks: Mapping[str, int], device: torch.device, *,
                 pool: Any = None) -> None:
        super().__init__(step, batch, max_blocks, device)
        # Warm up and capture with every row padding, so neither touches the cache. The warm-up runs on a
        # side stream, as capture requires, and does the lazy initialisation (kernel builds, NCCL
        # communicators) outside the graph. The capture runs on that same stream: state kept per stream,
        # such as cuBLAS's workspace, then exists before the capture, rather than being allocated inside it
        # from the graph's pool and outliving the graph there.
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            # Twice: a compiled step builds its kernels on the first call.
            for _ in range(2):
                step(self.input_ids, self.metadata)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool, stream=stream):
            self.out = step(self.input_ids, self.metadata)  # [batch, ...]

    def _run(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


def _fill(static: torch.Tensor, value: torch.Tensor, rows: torch.Tensor | slice | None, pad: int) -> None:
    """Copy ``value`` into the leading columns of ``static``'s ``rows`` (all rows if None, the first rows if a
    slice); the rest = pad."""
    if rows is None and value.shape == static.shape:
        static.copy_(value)
        return
    static.fill_(pad)
    target = static if value.dim() == 1 else static[:, : value.shape[1]]
    if rows is None:
        target.copy_(value)
    elif isinstance(rows, slice):
        target[rows].copy_(value)
    else:
        target.index_copy_(0, rows, value.to(static.dtype))
