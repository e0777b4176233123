"""Capturing a callable in a CUDA graph as the tests do: one warm-up call on a side stream (extension
builds, plans, workspaces outside the capture), then the capture."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def capture(fn: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``(graph, output)``: ``fn()`` warmed up, then captured; ``graph.replay()`` refills ``output``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out
