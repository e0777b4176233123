"""FlashInfer's paged decode kernels as peers of tpkit's in ``bench_paged_attention.py``.

Three kernels, on a benchmark input set's own pages (NHD: ``[num_blocks, page_size, num_kv_heads,
head_size]``, one block table per sequence): ``BatchDecodeWithPagedKVCacheWrapper`` on CUDA cores
(``fi-decode``) and with ``use_tensor_cores=True`` (``fi-decode-tc``), each planned once per input set, and
``flashinfer.decode.xqa_batch_decode_with_kv_cache`` (``fi-xqa``, TensorRT-LLM's XQA kernel). A float8
cache's scales go to the decode wrapper's ``k_scale``/``v_scale`` and into XQA's two product scales.

FlashInfer compiles each kernel the first time a shape needs it (10-70 s each). Run as a script it builds,
ahead of a benchmark, the kernels that the named configurations of ``bench_paged_attention.py`` need (a GPU
run can build them in the background of other work)::

    PYTHONPATH=. python benchmarks/flashinfer_decode.py [--impls fi-xqa] C1 C7 ...
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

IMPLS = ("fi-decode", "fi-decode-tc", "fi-xqa")
WORKSPACE_BYTES = 512 << 20  # FlashInfer's split-K scratch (its decode wrapper recommends 128 MiB)


def import_error() -> str | None:
    """None when FlashInfer imports here, else why not."""
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # ImportError, or a dependency failing at import
        return f"{type(exc).__name__}: {exc}"
    return None


class FlashInferDecode:
    """Makes FlashInfer decode calls on given paged inputs; one scratch buffer per kernel family."""

    def __init__(self, device: torch.device) -> None:
        import flashinfer

        self.flashinfer = flashinfer
        # Zeroed before first use, as FlashInfer asks; XQA keeps semaphores at the start of its own.
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.xqa_workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)

    def call(self, impl: str, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             block_tables: torch.Tensor, seq_lens: torch.Tensor, k_scale: float = 1.0,
             v_scale: float = 1.0) -> Callable[[], torch.Tensor]:
        """A call of ``impl`` on query ``[B, Hq, D]``, caches ``[num_blocks, page_size, Hkv, D]`` (16-bit, or
        float8 with scales: stored times scale is the value), int32 block_tables ``[B, max_pages]`` and
        seq_lens ``[B]``, returning ``[B, Hq, D]``; planning (a host sync) happens here, not in the call."""
        out = torch.empty_like(query)
        head_size = query.shape[-1]
        if impl == "fi-xqa":
            seq_lens_u32 = seq_lens.view(torch.uint32)  # the kernel's dtype; lengths are never negative
            max_seq_len = int(seq_lens.max())
            return lambda: self.flashinfer.decode.xqa_batch_decode_with_kv_cache(
                query, (key_cache, value_cache), self.xqa_workspace, block_tables, seq_lens_u32, max_seq_len,
                bmm1_scale=head_size ** -0.5 * k_scale, bmm2_scale=v_scale, out=out)
        if impl not in ("fi-decode", "fi-decode-tc"):
            raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")
        page_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
        pages = (seq_lens + page_size - 1) // page_size  # [B]
        indptr = torch.zeros(len(pages) + 1, dtype=torch.int32, device=query.device)
        indptr[1:] = torch.cumsum(pages, 0)
        columns = torch.arange(block_tables.shape[1], device=query.device)
        indices = block_tables[columns[None, :] < pages[:, None]]  # each sequence's pages, in order
        last_page_len = (seq_lens - 1) % page_size + 1  # [B]
        wrapper = self.flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_tensor_cores=impl == "fi-decode-tc")
        wrapper.plan(indptr, indices, last_page_len.to(torch.int32), query.shape[1], num_kv_heads, head_size,
                     page_size, q_data_type=query.dtype, kv_data_type=key_cache.dtype,
                     sm_scale=head_size ** -0.5)
        return lambda: wrapper.run(query, (key_cache, value_cache), k_scale=k_scale, v_scale=v_scale, out=out)


def main() -> None:
    import bench_paged_attention as bench

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="+", help="names of bench_paged_attention.py's configurations")
    parser.add_argument("--impls", default=",".join(IMPLS), help="comma-separated, of " + ", ".join(IMPLS))
    args = parser.parse_args()
    configs = {c.name: c for c in bench.CONFIGS}
    peers = FlashInferDecode(torch.device("cuda"))
    generator = torch.Generator(device="cuda").manual_seed(0)
    for name in args.configs:
        cfg = configs[name]
        # Two pages a sequence: the kernels built are those of the configuration's dtype and heads.
        s = bench._make_set(bench.Config(cfg.name, cfg.dtype, 1, 2 * bench.BLOCK_SIZE, cfg.num_heads,
                                         cfg.num_kv_heads), generator)
        for impl in args.impls.split(","):
            try:
                peers.call(impl, s.query, s.key_cache, s.value_cache, s.block_tables, s.seq_lens)()
                torch.cuda.synchronize()
                print(f"{name} {impl}: built", flush=True)
            except Exception as exc:  # FlashInfer's build and shape errors vary
                print(f"{name} {impl}: fails ({bench._first_line(exc)})", flush=True)


if __name__ == "__main__":
    main()
