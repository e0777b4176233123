"""Paged attention with its variants against the plain call, on a GPU: a sliding window (a decode step
reads only the window's blocks), a logit soft cap and sinks, for decode batches and chunks after cached
tokens. Each call is timed as CUDA-graph replays; bf16, 32:8 heads of 128, blocks of 16, random pages.

    python3 benchmarks/bench_attention_variants.py
"""

from __future__ import annotations

import torch

from tpkit.attention import paged_attention

REPLAYS = 50
# (batch, tokens a sequence, query tokens a sequence)
SHAPES = ((8, 32768, 1), (64, 4096, 1), (1, 131072, 1), (4, 8192, 512))
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 32, 8, 128, 16


def replay_us(fn) -> float:
    """Microseconds a replay of ``fn`` captured in a CUDA graph takes, over REPLAYS replays."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / REPLAYS * 1000


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench_attention_variants: needs a CUDA GPU")
    torch.manual_seed(0)
    dev = "cuda"
    sinks = torch.randn(NUM_HEADS, device=dev)
    variants = {"plain": {}, "window 4096": dict(window_size=4096),
                "soft cap 50": dict(logits_soft_cap=50.0), "sinks": dict(sinks=sinks)}
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}; us a call")
    print(f"{'shape':<44}" + "".join(f"{name:>14}" for name in variants))
    for batch, seq_len, q_len in SHAPES:
        pages = seq_len // BLOCK_SIZE
        # [num_blocks, block_size, num_kv_heads, head_size]
        key_cache = torch.randn(batch * pages, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, device=dev,
                                dtype=torch.bfloat16)
        value_cache = torch.randn_like(key_cache)
        block_tables = torch.randperm(batch * pages, device=dev, dtype=torch.int32).view(batch, pages)
        seq_lens = torch.full((batch,), seq_len, device=dev, dtype=torch.int32)
        query = torch.randn(batch * q_len, NUM_HEADS, HEAD_SIZE, device=dev, dtype=torch.bfloat16)
        query_start_loc = (None if q_len == 1 else
                           torch.arange(0, batch * q_len + 1, q_len, device=dev, dtype=torch.int32))
        args = (query, key_cache, value_cache, block_tables, seq_lens)
        times = []
        for kw in variants.values():
            times.append(replay_us(lambda a=args, qsl=query_start_loc, kw=kw:
                                   paged_attention(*a, query_start_loc=qsl, **kw)))
        shape = f"{batch} x {seq_len} tokens, {q_len} query token(s) each"
        print(f"{shape:<44}" + "".join(f"{t:>14.1f}" for t in times))


if __name__ == "__main__":
    main()
