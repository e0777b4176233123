"""A decode step's matrix products, Llama-3-8B shapes, bf16, on the GPU: what streaming each weight costs.

    PYTHONPATH=. python3 benchmarks/bench_decode_gemm.py [--batch 8] [--json PATH]

At batch 8 a decode step's projections are matrix-vector products in all but name: each must read its
whole weight once, so its floor is weight bytes / memory bandwidth, as for the step as a whole
(``bench_latency.py``'s floor). Each projection runs as tpkit's layers run it at tp_size 1
(``F.linear``, bench_linear.py checks that the layers add nothing), timed as the median per call of
CUDA-graph replays of one graph that calls it on independent copies of its weight, as many as touch
700 MB, so that no copy is still in L2 when its turn comes ("DRAM"); again with torch's other BLAS backend
(``torch.backends.cuda.preferred_blas_library("cublas")``, cuBLASLt being the default); and, where the
weight fits in the L2, on one copy again and again ("L2"): what a product costs once its weight has been
brought into L2 ahead of it. The table gives per projection the weight's MB, the floor at the copy
bandwidth measured in the same run, each time in us, and the DRAM time's rate in GB/s and as % of the
copy bandwidth.

The tpkit column is ``tpkit.ops.decode_linear`` (the decode kernel with its planned split of
in_features over a block's warps; the models' layers use it), timed the same way, with its ratio to
cuBLASLt; ``--splits`` also times the kernel at each split given (``tpkit_splits_us`` in the JSON rows).
For gate_up_proj it also times SwiGLU (``silu(gate) * up``, what LlamaMLP computes next): in the kernel's
epilogue (``decode_linear_silu_and_mul``, as the models run it) against the plain kernel followed by the
compiled element-wise SwiGLU (how the compiled decode step ran it before). For qkv_proj it also times RoPE
and the cache write in the kernel's epilogue (``decode_qkv_rope_cache``). And each product as the Llama
models' decode step runs it at tp_size 1, with the RMSNorm between products split in halves: o_proj and
down_proj adding the residual and starting the next norm (``decode_linear_residual_norm``), qkv_proj (with
RoPE and the cache write) and gate_up_proj (with SwiGLU) scaling their rows by the norm (``rms_sums``);
the JSON rows' ``tpkit_step_us``.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_latency import LLAMA3_8B
from bench_paged_attention import _copy_bandwidth_gbps, _graph_time_us

from tpkit.ops import _extension, decode_linear

TOUCHED_BYTES = 700_000_000  # weight bytes each graph streams: over 10x the L2
REPLAYS = 20


def projections(config: dict) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of each of a decoder layer's projections and of the LM head."""
    head_size = config["hidden_size"] // config["num_attention_heads"]
    hidden, intermediate = config["hidden_size"], config["intermediate_size"]
    return {
        "qkv_proj": ((config["num_attention_heads"] + 2 * config["num_key_value_heads"]) * head_size, hidden),
        "o_proj": (hidden, config["num_attention_heads"] * head_size),
        "gate_up_proj": (2 * intermediate, hidden),
        "down_proj": (hidden, intermediate),
        "lm_head": (config["vocab_size"], hidden),
    }


def _time_us(x: torch.Tensor, weights: list[torch.Tensor], blas: str) -> float:
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(blas)
    try:
        return _graph_time_us([lambda w=w: F.linear(x, w) for w in weights], REPLAYS)
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


def _kernel_time_us(call: Callable[[torch.Tensor], bool], weights: list[torch.Tensor], what: str) -> float:
    """``call(weight)`` (a ``_extension`` kernel call, False where the kernel does not take the tensors) timed
    over every weight copy; exits when the kernel does not take the first."""
    if not call(weights[0]):
        raise SystemExit(f"bench_decode_gemm.py: the decode linear kernel does not take {what} here")
    return _graph_time_us([lambda w=w: call(w) for w in weights], REPLAYS)


def _tpkit_time_us(x: torch.Tensor, weights: list[torch.Tensor], splits: int) -> float:
    """decode_linear's kernel with this split of in_features (0: the planned one, what the layers run)."""
    out = x.new_empty(x.shape[0], weights[0].shape[0])
    return _kernel_time_us(lambda w: _extension.decode_linear(out, x, w, None, splits), weights,
                           f"these products (splits {splits})")


def _swiglu_times_us(x: torch.Tensor, weights: list[torch.Tensor]) -> dict[str, float]:
    """gate_up_proj with SwiGLU: in the kernel's epilogue, and the plain kernel then a compiled SwiGLU."""
    features = weights[0].shape[0] // 2
    fused_out = x.new_empty(x.shape[0], features)
    fused_us = _kernel_time_us(lambda w: _extension.decode_linear(fused_out, x, w, None, 0, True), weights,
                               "SwiGLU")
    # fused_out now holds the last copy's product.
    gate, up = F.linear(x.float(), weights[-1].float()).to(x.dtype).float().chunk(2, dim=-1)
    torch.testing.assert_close(fused_out.float(), F.silu(gate) * up, atol=0.05, rtol=2e-2)
    swiglu = torch.compile(lambda t: F.silu(t[:, :features]) * t[:, features:], fullgraph=True)
    out = x.new_empty(x.shape[0], 2 * features)
    swiglu(out)  # compiled before the graph captures it

    def plain_then_swiglu(w: torch.Tensor) -> torch.Tensor:
        _extension.decode_linear(out, x, w, None, 0)
        return swiglu(out)

    unfused = [lambda w=w: plain_then_swiglu(w) for w in weights]
    return {"tpkit_swiglu_fused_us": fused_us, "tpkit_then_swiglu_us": _graph_time_us(unfused, REPLAYS)}


def _rope_cache_time_us(x: torch.Tensor, weights: list[torch.Tensor], config: dict,
                        rms_sums: torch.Tensor | None = None) -> float:
    """qkv_proj with RoPE on q and k and the cache write of k and v in the kernel's epilogue
    (``decode_qkv_rope_cache``): the kernel that replaced the plain product, the compiled rotation and
    ``reshape_and_cache``; with ``rms_sums``, also the input norm's row scale, as the Llama models run a
    decode step."""
    num_heads, num_kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_size = config["hidden_size"] // num_heads
    batch = x.shape[0]
    angles = torch.rand(batch, head_size // 2, device="cuda")
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    caches = torch.randn(2, 64, 16, num_kv_heads, head_size, device="cuda", dtype=x.dtype)
    slots = torch.randperm(64 * 16, device="cuda")[:batch]
    out = x.new_empty(batch, weights[0].shape[0])
    args = (cos, sin, caches[0], caches[1], slots, num_heads, rms_sums, 1e-5)
    return _kernel_time_us(lambda w: _extension.decode_qkv_rope_cache(out, x, w, None, *args), weights,
                           "RoPE and the cache write")


def _rms_sums(x: torch.Tensor) -> torch.Tensor:
    """float64 [batch]: the rows' sums of squares, as the product before a split RMSNorm leaves them."""
    return x.float().square().sum(-1, dtype=torch.float64)


def _step_time_us(name: str, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """The projection as the Llama models' decode step runs it at tp_size 1, the RMSNorm between products
    split in halves: o_proj and down_proj add the residual and start the next norm, gate_up_proj (SwiGLU)
    and qkv_proj (RoPE and the cache write) scale their rows by it."""
    if name == "qkv_proj":
        return _rope_cache_time_us(x, weights, LLAMA3_8B, _rms_sums(x))
    if name == "gate_up_proj":
        out = x.new_empty(x.shape[0], weights[0].shape[0] // 2)
        sums = _rms_sums(x)

        def swiglu_scaled(w: torch.Tensor) -> bool:
            return _extension.decode_linear(out, x, w, None, silu_and_mul=True, rms_sums=sums, eps=1e-5)

        return _kernel_time_us(swiglu_scaled, weights, "SwiGLU and the norm's scale")
    out = x.new_empty(x.shape[0], weights[0].shape[0])
    residual, normed = torch.randn_like(out), torch.empty_like(out)
    norm_weight = torch.ones(out.shape[1], device=x.device, dtype=x.dtype)
    sums = torch.zeros(x.shape[0], device=x.device, dtype=torch.float64)
    zero_sums = torch.zeros_like(sums)
    return _kernel_time_us(lambda w: _extension.decode_linear_residual_norm(out, normed, x, w, None, residual,
                                                                       norm_weight, sums, zero_sums),
                           weights, "the residual add and the norm's first half")


def bench(batch: int, copy_bw_gbps: float, splits: list[int]) -> list[dict]:
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, (out_features, in_features) in projections(LLAMA3_8B).items():
        weight_bytes = out_features * in_features * 2
        copies = max(2, math.ceil(TOUCHED_BYTES / weight_bytes))
        weights = [torch.randn(out_features, in_features, device="cuda", dtype=torch.bfloat16,
                               generator=generator) for _ in range(copies)]
        x = torch.randn(batch, in_features, device="cuda", dtype=torch.bfloat16, generator=generator)
        expected = x.float() @ weights[0].float().t()
        torch.testing.assert_close(F.linear(x, weights[0]).float(), expected, atol=0.5, rtol=2e-2)
        torch.testing.assert_close(decode_linear(x, weights[0]).float(), expected, atol=0.5, rtol=2e-2)
        row = {"projection": name, "batch": batch, "weight_MB": weight_bytes / 1e6,
               "floor_us": weight_bytes / copy_bw_gbps / 1e3,
               "dram_us": _time_us(x, weights, "cublaslt"), "dram_cublas_us": _time_us(x, weights, "cublas"),
               "l2_us": None,
               "tpkit_us": _tpkit_time_us(x, weights, 0),
               "tpkit_splits_us": {str(n): _tpkit_time_us(x, weights, n) for n in splits}}
        if weight_bytes <= l2_bytes:
            row["l2_us"] = _time_us(x, weights[:1] * copies, "cublaslt")
        if name == "gate_up_proj":
            row.update(_swiglu_times_us(x, weights))
        if name == "qkv_proj":
            row["tpkit_rope_cache_us"] = _rope_cache_time_us(x, weights, LLAMA3_8B)
        if name != "lm_head":
            row["tpkit_step_us"] = _step_time_us(name, x, weights)
        row["GBps"] = weight_bytes / row["dram_us"] / 1e3
        row["pct_copy_bw"] = 100 * row["GBps"] / copy_bw_gbps
        rows.append(row)
        del weights
        torch.cuda.empty_cache()
    return rows


def print_table(rows: list[dict], copy_bw_gbps: float) -> None:
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; copy bandwidth "
          f"{copy_bw_gbps:.0f} GB/s; batch {rows[0]['batch']}, bf16; us per call")
    splits = list(rows[0]["tpkit_splits_us"])
    print("| projection | weight MB | floor us | DRAM us (cuBLASLt) | GB/s | % copy bw | DRAM us (cuBLAS) "
          "| L2 us | tpkit us | tpkit / cuBLASLt |" + "".join(f" splits {n} |" for n in splits))
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(splits))
    for r in rows:
        l2 = "-" if r["l2_us"] is None else f"{r['l2_us']:.1f}"
        print(f"| {r['projection']} | {r['weight_MB']:.1f} | {r['floor_us']:.1f} | {r['dram_us']:.1f} | "
              f"{r['GBps']:.0f} | {r['pct_copy_bw']:.1f} | {r['dram_cublas_us']:.1f} | {l2} | "
              f"{r['tpkit_us']:.1f} | {r['tpkit_us'] / r['dram_us']:.2f} |"
              + "".join(f" {r['tpkit_splits_us'][n]:.1f} |" for n in splits))
    for r in rows:
        if "tpkit_rope_cache_us" in r:
            print(f"{r['projection']} with RoPE and the cache write: {r['tpkit_rope_cache_us']:.1f} us in "
                  f"the kernel's epilogue ({r['tpkit_us']:.1f} us without)")
        if "tpkit_swiglu_fused_us" in r:
            print(f"{r['projection']} with SwiGLU: {r['tpkit_swiglu_fused_us']:.1f} us in the kernel's "
                  f"epilogue, {r['tpkit_then_swiglu_us']:.1f} us as the plain kernel then a compiled SwiGLU")
    layer = [r for r in rows if r["projection"] != "lm_head"]
    print("as the Llama models' decode step runs them (the RMSNorms split between the products): "
          + ", ".join(f"{r['projection']} {r['tpkit_step_us']:.1f} us" for r in layer))
    print(f"a decoder layer's four: {sum(r['dram_us'] for r in layer):.1f} us (cuBLASLt), "
          f"{sum(r['tpkit_us'] for r in layer):.1f} us (tpkit), "
          f"{sum(r['tpkit_step_us'] for r in layer):.1f} us (tpkit, as the decode step runs them), against "
          f"a floor of {sum(r['floor_us'] for r in layer):.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8, help="tokens a step (sequences decoded at once)")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--splits", type=int, nargs="*", default=[], choices=(1, 2, 4, 8),
                        help="also time tpkit's kernel with these splits of in_features over a block's warps")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_gemm.py: needs a CUDA GPU")
    if args.batch < 1:
        parser.error(f"--batch: expected a positive number of tokens, got {args.batch}")
    copy_bw_gbps = _copy_bandwidth_gbps()
    rows = bench(args.batch, copy_bw_gbps, args.splits)
    print_table(rows, copy_bw_gbps)
    if args.json:
        meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_GBps": copy_bw_gbps}
        args.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
