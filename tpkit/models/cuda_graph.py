"""A model's decode step captured in one CUDA graph and replayed every step.

A decode step of a small batch is hundreds of small kernels; launched one by one from Python, the host is
slower than the GPU. Captured once, the whole step (embedding, every layer's projections, RoPE, cache write,
paged attention, all-reduces, logits, and with greedy sampling the draw) is one launch. The graph reads its
inputs from static buffers: token ids, and per KV cache the metadata (slot_mapping, block_tables, seq_lens;
positions follow from seq_lens). Each step copies the step's values into them (device to device, or from
the host in one copy) and replays.

The graph serves a fixed batch size; when sequences finish early their rows become padding: slot -1 (no
cache write) and seq_len 0 (nothing attended), so the graph never touches blocks that went back to the cache.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from tpkit.attention import AttentionMetadata, packed_size, packed_views


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
        # Every input is a view of one buffer, so that a step's inputs from the host are one copy
        # (run_from_host): the token ids, each cache's slot_mapping, block_tables and seq_lens, and the rows
        # whose token ids a device tensor gives, with their indices in it.
        self._like = [torch.empty(batch, 1, dtype=torch.int64, device="meta")]
        for width in max_blocks.values():
            self._like += [torch.empty(batch, dtype=torch.int64, device="meta"),
                           torch.empty(batch, width, dtype=torch.int32, device="meta"),
                           torch.empty(batch, dtype=torch.int32, device="meta")]
        self._like += [torch.empty(batch, dtype=torch.int64, device="meta")] * 2
        self._packed = torch.zeros(packed_size(self._like), dtype=torch.uint8, device=device)
        views = packed_views(self._packed, self._like)
        self.input_ids = views[0]  # [batch, 1]
        # Every row starts as padding: no slot written, nothing attended.
        self.metadata = {}
        for index, name in enumerate(max_blocks):
            slot_mapping, block_tables, seq_lens = views[1 + 3 * index: 4 + 3 * index]
            slot_mapping.fill_(-1)
            self.metadata[name] = AttentionMetadata(
                slot_mapping=slot_mapping, block_tables=block_tables, seq_lens=seq_lens,
                query_lens=torch.ones(batch, dtype=torch.int32, device=device))
        self._drawn_rows, self._drawn_sources = views[-2:]  # [batch] each
        # Two host buffers of the inputs taken in turns, each with its views and the event after its last
        # copy: a buffer is filled again only once its copy before has been done.
        self._host: list[tuple[torch.Tensor, list[torch.Tensor], torch.cuda.Event | None]] = []

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

    def run_from_host(self, input_ids: torch.Tensor, metadata: Mapping[str, AttentionMetadata],
                      drawn: tuple[torch.Tensor, Sequence[int], Sequence[int]] | None = None) -> torch.Tensor:
        """:meth:`__call__` of the first ``n`` rows from inputs on the host, moved in one copy: input_ids
        int64 ``[n]``, each cache's metadata of ``n`` sequences (tables at most as wide as the step's).
        ``drawn``: ``(tokens, rows, sources)``, token ids on the device that replace ``input_ids[rows[j]]``
        by ``tokens[sources[j]]``. Returns the step's output for the ``n`` rows (a view of the graph's own
        buffer, which its next replay overwrites)."""
        num_rows = input_ids.shape[0]
        host, views, copied = self._next_host_buffer()
        host.zero_()
        views[0][:num_rows, 0] = input_ids
        for index, name in enumerate(self.metadata):
            slot_mapping, block_tables, seq_lens = views[1 + 3 * index: 4 + 3 * index]
            step_metadata = metadata[name]
            slot_mapping.fill_(-1)
            slot_mapping[:num_rows] = step_metadata.slot_mapping
            block_tables[:num_rows, : step_metadata.block_tables.shape[1]] = step_metadata.block_tables
            seq_lens[:num_rows] = step_metadata.seq_lens
        num_drawn = 0 if drawn is None else len(drawn[1])
        if num_drawn:
            views[-2][:num_drawn] = torch.tensor(drawn[1])
            views[-1][:num_drawn] = torch.tensor(drawn[2])
        self._packed.copy_(host, non_blocking=True)
        if copied is not None:
            copied.record()
        if num_drawn:
            self.input_ids.view(-1)[self._drawn_rows[:num_drawn]] = drawn[0][self._drawn_sources[:num_drawn]]
        return self._run()[:num_rows]

    def _next_host_buffer(self) -> tuple[torch.Tensor, list[torch.Tensor], torch.cuda.Event | None]:
        """The host buffer whose turn it is (pinned on a GPU), its copy before done."""
        if not self._host:
            cuda = self.device.type == "cuda"
            for _ in range(2):
                host = torch.empty(self._packed.shape, dtype=torch.uint8, pin_memory=cuda)
                copied = torch.cuda.Event() if cuda else None
                self._host.append((host, packed_views(host, self._like), copied))
        self._host.append(self._host.pop(0))
        host, views, copied = self._host[-1]
        if copied is not None:
            copied.synchronize()
        return host, views, copied

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
