"""End-to-end generation latency of tpkit's models, in the spirit of vLLM's ``benchmark_latency.py``.

    PYTHONPATH=. python benchmarks/bench_latency.py            # one GPU: the shapes below, bf16 (minutes)
    PYTHONPATH=. python benchmarks/bench_latency.py --small    # tiny shapes on the CPU, under a minute
    PYTHONPATH=. python benchmarks/bench_latency.py --quantization fp8  # tpkit's Llama with float8 weights
    PYTHONPATH=. python benchmarks/bench_latency.py --model gemma-2-9b --skip kv_blocks,bart  # one family

``--quantization fp8`` gives tpkit's Llama float8 weights (its random weights quantized per channel; the
decode steps' products on tpkit's decode kernel reading float8, the prefill's on float8 tensor cores) and
``--kv-cache-dtype fp8`` a float8 KV cache; transformers runs bf16 as before. With ``--quantization fp8``
part 1 also measures the float8 model against the bf16 model it is quantized from, in the same process
(``latency_fp8.py``): that model first (same variants, bf16 KV cache), then the float8 one; each one's
prefill alone (batch 8 x ``--prefill-len`` 1024 prompt tokens) in tokens/s (the float8 one's also through
its layers' forward, without the fused float8 step); and the float8 model's greedy
tokens against those of the bf16 model holding its dequantized weights (positions equal, and per prompt the
positions before the first difference). Its section prints each variant's bf16 and fp8 times against
their read floors, the fp8 / bf16 ratio, the prefill tokens/s of both and the agreement, with the goals.

Three parts, each reported even when another fails:

1. Llama-3-8B shapes (32 layers, hidden 4096, 32 heads, 8 KV heads, MLP 14336, vocab 128256), or with
   ``--model`` another family's (``qwen3-8b``, ``mistral-7b`` with its 4096-token window, ``gemma-2-9b``
   with its soft caps and local layers), random bf16
   weights, batch 8, 128 prompt tokens, 128 new tokens (EOS ignored), greedy; average latency of 3 runs
   after a warm-up: tpkit eager, tpkit with the decode step replayed from a CUDA graph (and with the step
   also through ``torch.compile``), transformers ``generate`` with its default dynamic cache and with
   ``cache_implementation="static"``, against the floor: every decode step reads all weights once at the
   device copy bandwidth (measured here). The peers' figures on an H200 (transformers, the floor, and how
   they were measured) are in ``benchmarks/baselines/e2e_latency_h200.json``; the table prints them too.
   And against the read floor (``latency_timing.read_floor``), the bytes a call must move at that
   bandwidth: each step's weights but the embedding table (a step reads only its tokens' rows of it, unless
   the LM head is tied to it), and the KV cache the prefill writes and each decode step reads (every
   position so far, a window on a sliding layer) and writes.
2. KV blocks that fit in the GPU memory left by a StarCoder-shaped GPT-BigCode (48 heads, multi-query, 40
   layers, hidden 6144; built on the meta device): tpkit's cache holds the one KV head, against a cache
   that stores a KV head per query head.
3. A BART-large-shaped model, random weights, batch 12, encoder inputs of ~66 tokens, 32 new tokens: time
   per output token with ``QKVCrossParallelLinear`` against the naive cross projection (a
   ``QKVParallelLinear`` run on the decoder states and again on the encoder states, two thirds thrown away).

Prints the tables last and writes everything as JSON to ``--out`` (default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from latency_fp8 import fp8_latency, print_comparison
from latency_timing import (
    PrefillClock,
    copy_bandwidth,
    floor_line,
    free_memory,
    run_row,
    timed_model,
    token_agreement,
)
from torch import nn

from tpkit.attention import PagedKVCache
from tpkit.models import BartForConditionalGeneration, GPTBigCodeForCausalLM, model_class
from tpkit.parallel_layers import QKVCrossParallelLinear, QKVParallelLinear

BASELINE = json.loads((Path(__file__).parent / "baselines" / "e2e_latency_h200.json").read_text())
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
    "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
}
STARCODER = {
    "architectures": ["GPTBigCodeForCausalLM"], "model_type": "gpt_bigcode", "vocab_size": 49152,
    "n_embd": 6144, "n_inner": 24576, "n_layer": 40, "n_head": 48, "n_positions": 8192, "multi_query": True,
    "activation_function": "gelu_pytorch_tanh", "bos_token_id": 0, "eos_token_id": 0,
}
BART_LARGE = {
    "architectures": ["BartForConditionalGeneration"], "model_type": "bart", "vocab_size": 50265,
    "d_model": 1024, "encoder_layers": 12, "decoder_layers": 12, "encoder_attention_heads": 16,
    "decoder_attention_heads": 16, "encoder_ffn_dim": 4096, "decoder_ffn_dim": 4096,
    "max_position_embeddings": 1024, "activation_function": "gelu", "scale_embedding": False,
    "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, "decoder_start_token_id": 2,
}
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
    "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 151643, "eos_token_id": 151645,
}
MISTRAL_7B = {  # v0.1, the release with a sliding window
    "architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": 32000,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "max_position_embeddings": 32768, "sliding_window": 4096,
    "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2,
}
GEMMA2_9B = {
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "vocab_size": 256000, "hidden_size": 3584,
    "intermediate_size": 14336, "num_hidden_layers": 42, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 256, "max_position_embeddings": 8192, "sliding_window": 4096, "query_pre_attn_scalar": 256,
    "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh",
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True, "bos_token_id": 2,
    "eos_token_id": 1, "pad_token_id": 0,
}
MODELS = {"llama-3-8b": ("Llama-3-8B", LLAMA3_8B), "qwen3-8b": ("Qwen3-8B", QWEN3_8B),
          "mistral-7b": ("Mistral-7B", MISTRAL_7B), "gemma-2-9b": ("Gemma-2-9B", GEMMA2_9B)}
# --small: each family's config at tiny sizes (its window, 8 tokens, shorter than the 16-token prompts).
SMALL_SIZES = {"vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
               "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
               "max_position_embeddings": 512, "bos_token_id": 1, "eos_token_id": 2}
SMALL_LLAMA = LLAMA3_8B | SMALL_SIZES
SMALL_BART = BART_LARGE | {"vocab_size": 1000, "d_model": 128, "encoder_layers": 2, "decoder_layers": 2,
                           "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 256,
                           "decoder_ffn_dim": 256}
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default
ACTIVATION_RESERVE_BYTES = 2 * 2**30  # activations and workspaces of a forward, kept out of the KV budget


class Setup:
    """Sizes and device of one run: the real shapes on a GPU, or ``--small`` ones on the CPU."""

    def __init__(self, small: bool, model: str = "llama-3-8b") -> None:
        self.small = small
        self.device = torch.device("cpu") if small else torch.device("cuda", torch.cuda.current_device())
        self.dtype = torch.float32 if small else torch.bfloat16
        self.model_name, config = MODELS[model]
        windowed = {"sliding_window": 8} if config.get("sliding_window") else {}
        self.model_config = config | SMALL_SIZES | windowed if small else config
        self.batch, self.input_len, self.output_len = (4, 16, 16) if small else (8, 128, 128)
        self.prefill_len = 64 if small else 1024  # --quantization fp8: the prompts of the prefill alone
        self.bart = SMALL_BART if small else BART_LARGE
        self.bart_batch, self.bart_new_tokens = (4, 8) if small else (12, 32)
        self.bart_input_lens = [60 + (7 * i) % 13 for i in range(self.bart_batch)]  # ragged, mean ~66
        self.warmup, self.iterations = 1, 3

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


# 1. Llama-3-8B latency ----------------------------------------------------------------------------------
def llama_latency(setup: Setup, args: argparse.Namespace) -> dict:
    torch.manual_seed(0)
    config = dict(setup.model_config)
    prompts = torch.randint(0, config["vocab_size"], (setup.batch, setup.input_len)).tolist()
    # One model on the device at a time: each part's model is gone when its function returns.
    result = tpkit_latency(setup, args, config, prompts)
    free_memory(setup)
    result["rows"] += transformers_latency(setup, config, prompts)
    free_memory(setup)
    return result


def tpkit_latency(setup: Setup, args: argparse.Namespace, config: dict, prompts: list[list[int]]) -> dict:
    bandwidth = copy_bandwidth(setup)
    if args.quantization == "fp8":
        return fp8_latency(setup, args, config, prompts, bandwidth)
    model = model_class(config)(config, dtype=setup.dtype, device=setup.device).eval()
    model.kv_cache_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else None
    return timed_model(setup, args, model, prompts, bandwidth, "tpkit")[0]


def transformers_latency(setup: Setup, config: dict, prompts: list[list[int]]) -> list[dict]:
    try:
        import transformers
    except ImportError:
        return [{"impl": "transformers", "error": "transformers is not installed"}]
    hf_config = transformers.AutoConfig.for_model(config["model_type"], **{
        k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(setup.dtype)
    try:
        with torch.device(setup.device):
            hf_model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    finally:
        torch.set_default_dtype(default_dtype)
    input_ids = torch.tensor(prompts, device=setup.device)
    n = setup.output_len
    rows = []
    for name, options in [("transformers generate, dynamic cache", {}),
                          ("transformers generate, static cache", {"cache_implementation": "static"})]:
        def run(o: dict = options) -> None:
            with torch.inference_mode():
                hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False, num_beams=1,
                                  pad_token_id=config["eos_token_id"], **o)
        row = run_row(name, setup, run)
        row.pop("result", None)
        rows.append(row)
    return rows


# 2. KV blocks for a StarCoder-shaped model ----------------------------------------------------------------
def mqa_kv_blocks(setup: Setup) -> dict:
    """Blocks of 16 tokens that fit next to the weights, built on the meta device (no memory used)."""
    model = GPTBigCodeForCausalLM(STARCODER, dtype=torch.bfloat16, device="meta")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if setup.device.type == "cuda":
        total = torch.cuda.get_device_properties(setup.device).total_memory
        where = torch.cuda.get_device_name(setup.device)
    else:
        total, where = 80 * 2**30, "a nominal 80 GiB GPU (--small)"
    budget = int(total * GPU_MEMORY_UTILIZATION) - weight_bytes - ACTIVATION_RESERVE_BYTES
    blocks = {}
    for label, num_kv_heads in [("tpkit (MQA: 1 KV head)", model.num_kv_heads),
                                (f"a KV head per query head ({model.num_heads})", model.num_heads)]:
        cache = PagedKVCache.from_memory_budget(budget, model.num_layers, model.kv_block_size, num_kv_heads,
                                                model.head_size, dtype=torch.bfloat16, device="meta")
        blocks[label] = cache.num_blocks
    return {"device": where, "total_bytes": total, "weight_bytes": weight_bytes, "kv_budget_bytes": budget,
            "block_size": model.kv_block_size, "blocks": blocks}


# 3. BART-large cross-attention projection ------------------------------------------------------------------
class NaiveCrossQKV(nn.Module):
    """Cross-attention projections the naive way, on the same parameters: the full QKV projection of the
    decoder states (q kept) and, at prefill, of the encoder states (k, v kept)."""

    def __init__(self, fused: QKVCrossParallelLinear) -> None:
        super().__init__()
        self.fused = fused

    def forward(self, decoder_hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None):
        q_size, kv_size = self.fused.q_size, self.fused.kv_size
        q = QKVParallelLinear.forward(self.fused, decoder_hidden_states)[..., :q_size]
        if encoder_hidden_states is None:
            return q, None, None
        k, v = QKVParallelLinear.forward(self.fused, encoder_hidden_states)[..., q_size:].split(
            [kv_size, kv_size], dim=-1)
        return q, k, v


def bart_cross_qkv(setup: Setup) -> dict:
    torch.manual_seed(0)
    model = BartForConditionalGeneration(setup.bart, dtype=setup.dtype, device=setup.device).eval()
    prompts = [torch.randint(3, setup.bart["vocab_size"], (n,)).tolist() for n in setup.bart_input_lens]
    new_tokens = setup.bart_new_tokens
    modes = [("eager", {})] + ([("CUDA graph", {"cuda_graph": True})] if setup.device.type == "cuda" else [])
    rows = []
    fused = [layer.encoder_attn.qkv_proj for layer in model.decoder.layers]
    projections = {"naive QKVParallelLinear x2": [NaiveCrossQKV(qkv) for qkv in fused],
                   "QKVCrossParallelLinear": fused}
    first_tokens: dict[str, list[list[int]]] = {}
    clock = PrefillClock(setup, model)
    # Both projections back to back in each mode, so that neither is favoured by running second.
    for mode, options in modes:
        for projection, modules in projections.items():
            model.clear_kv_cache()  # captured graphs hold the other projection
            for layer, module in zip(model.decoder.layers, modules, strict=True):
                layer.encoder_attn.qkv_proj = module
            row = run_row(f"{projection}, {mode}", setup,
                           lambda o=options: model.generate(prompts, new_tokens, ignore_eos=True, **o))
            tokens = row.pop("result", None)
            if tokens is not None:
                # Same weights, same math: both projections give the tokens of whichever ran first.
                reference = first_tokens.setdefault(mode, tokens)
                row["same_tokens_both_ways"] = token_agreement(tokens, reference)
            if "avg_s" in row:
                prefill_s = clock.seconds[-len(row["runs_s"]):]  # the timed calls' own prefills
                row["ms_per_token"] = row["avg_s"] / new_tokens * 1e3
                row["prefill_ms"] = statistics.fmean(prefill_s) * 1e3
                decode_s = [total - prefill for total, prefill in zip(row["runs_s"], prefill_s, strict=True)]
                row["decode_ms_per_token"] = statistics.fmean(decode_s) / (new_tokens - 1) * 1e3
            rows.append({"projection": projection, "mode": mode, **row})
    model.clear_kv_cache()
    return {"batch": setup.bart_batch, "input_lens": setup.bart_input_lens, "new_tokens": new_tokens,
            "rows": rows}


# Report ---------------------------------------------------------------------------------------------------
def _section(name: str, fn: Callable[[], dict]) -> dict:
    print(f"== {name}", flush=True)
    try:
        return fn()
    except Exception as error:  # noqa: BLE001 - report the part that failed, run the others
        traceback.print_exc()
        return {"error": f"{type(error).__name__}: {error}"[:500]}


def print_report(setup: Setup, results: dict) -> None:
    shapes = f"{setup.model_name}, tiny shapes (--small)" if setup.small else f"{setup.model_name} shapes"
    latency = results["llama"]
    print(f"\n# End-to-end latency: {shapes}, {setup.dtype}, batch {setup.batch}, input {setup.input_len}, "
          f"output {setup.output_len}, greedy, average of {setup.iterations} runs after {setup.warmup} "
          "warm-up")
    if "error" in latency:
        print(f"failed: {latency['error']}")
    else:
        rows = {row["impl"]: row for row in latency["rows"]}
        static = rows.get("transformers generate, static cache", {}).get("avg_s")
        dynamic = rows.get("transformers generate, dynamic cache", {}).get("avg_s")
        floor = latency["floor_s"]
        is_llama = setup.model_name == "Llama-3-8B"
        baseline = f" (baseline on an H200: {BASELINE['floor_s']} s)" if is_llama else ""
        read = latency["read_floor"]["floor_s"]
        print(f"floor: {latency['weight_bytes'] / 1e9:.2f} GB of weights per step at "
              f"{latency['copy_GBps']:.0f} GB/s copy bandwidth x {setup.output_len} steps = {floor:.3f} s"
              f"{baseline}")
        print(floor_line("tpkit", latency["read_floor"], latency["copy_GBps"]))
        print(f"| {'implementation':<38} | {'avg s':>8} | {'tok/s':>8} | {'/ floor':>7} | / read floor | "
              f"{'HF static / x':>13} | {'HF dynamic / x':>14} | same tokens as eager |")
        print(f"|{'-' * 40}|{'-' * 10}|{'-' * 10}|{'-' * 9}|{'-' * 14}|{'-' * 15}|{'-' * 16}|{'-' * 22}|")
        for row in latency["rows"]:
            if "error" in row:
                print(f"| {row['impl']:<38} | failed: {row['error']}")
                continue
            avg = row["avg_s"]
            tokens_per_s = setup.batch * setup.output_len / avg
            vs_static = f"{static / avg:.2f}x" if static else "-"
            vs_dynamic = f"{dynamic / avg:.2f}x" if dynamic else "-"
            same = f"{row['same_tokens_as_eager']:.0%}" if "same_tokens_as_eager" in row else "-"
            print(f"| {row['impl']:<38} | {avg:>8.3f} | {tokens_per_s:>8.0f} | {avg / floor:>6.2f}x | "
                  f"{avg / read:>11.2f}x | {vs_static:>13} | {vs_dynamic:>14} | {same:>20} |")
        if "fp8_vs_bf16" in latency:
            print_comparison(latency, setup.batch, setup.output_len)
        if not setup.small and setup.model_name == "Llama-3-8B":
            measured = BASELINE["measured"]
            peers = ", ".join(f"{row['implementation']} {row['avg_s']:.2f} s" for row in BASELINE["rows"])
            print(f"baseline ({measured['gpu']}, torch {measured['torch']}, {measured['date']}): {peers}; "
                  f"floor {BASELINE['floor_s']:.2f} s; goal: {BASELINE['goal']}")

    kv = results["kv_blocks"]
    print("\n# KV blocks in the memory left by a StarCoder-shaped GPT-BigCode (48 heads, MQA, 40 layers, "
          "hidden 6144)")
    if "error" in kv:
        print(f"failed: {kv['error']}")
    else:
        print(f"{kv['device']}: {kv['total_bytes'] / 2**30:.1f} GiB x {GPU_MEMORY_UTILIZATION} - weights "
              f"{kv['weight_bytes'] / 2**30:.1f} GiB - {ACTIVATION_RESERVE_BYTES / 2**30:.0f} GiB "
              f"activations = {kv['kv_budget_bytes'] / 2**30:.1f} GiB for KV, blocks of {kv['block_size']} "
              "tokens")
        for label, blocks in kv["blocks"].items():
            print(f"| {label:<36} | {blocks:>9,} blocks | {blocks * kv['block_size']:>12,} tokens |")

    bart = results["bart"]
    print(f"\n# BART-large cross-attention projection: batch {setup.bart_batch}, encoder inputs "
          f"{setup.bart_input_lens}, {setup.bart_new_tokens} new tokens")
    if "error" in bart:
        print(f"failed: {bart['error']}")
        return
    by_mode: dict[str, dict[str, dict]] = {}
    for row in bart["rows"]:
        by_mode.setdefault(row["mode"], {})[row["projection"]] = row
    print(f"| {'projection':<28} | {'mode':<10} | {'ms / token':>10} | {'prefill ms':>10} | "
          f"{'decode ms / token':>17} | {'naive / this':>12} | same tokens both ways |")
    for mode, rows in by_mode.items():
        naive = rows.get("naive QKVParallelLinear x2", {}).get("ms_per_token")
        for projection, row in rows.items():
            if "error" in row:
                print(f"| {projection:<28} | {mode:<10} | failed: {row['error']}")
                continue
            ratio = f"{naive / row['ms_per_token']:.3f}x" if naive else "-"
            prefill_ms = row.get("prefill_ms", float("nan"))
            decode_ms = row.get("decode_ms_per_token", float("nan"))
            same = f"{row['same_tokens_both_ways']:.0%}" if "same_tokens_both_ways" in row else "-"
            print(f"| {projection:<28} | {mode:<10} | {row['ms_per_token']:>10.3f} | {prefill_ms:>10.2f} | "
                  f"{decode_ms:>17.3f} | {ratio:>12} | {same:>21} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="tiny shapes on the CPU (a check, < 1 minute)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile variant")
    parser.add_argument("--model", choices=MODELS, default="llama-3-8b",
                        help="the family whose shapes part 1 runs (default llama-3-8b)")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: llama, kv_blocks, bart")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="directory for the JSON")
    parser.add_argument("--quantization", choices=["none", "fp8"], default="none",
                        help="tpkit's Llama weights: as built (none) or float8 per channel (fp8)")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="tpkit's Llama KV cache: the model's dtype (auto) or float8 E4M3 (fp8)")
    parser.add_argument("--prefill-len", type=int, default=None,
                        help="--quantization fp8: the prompt tokens of the prefill timed alone, each of a "
                             "batch's prompts (default 1024; --small 64)")
    args = parser.parse_args()
    if not args.small and not torch.cuda.is_available():
        parser.error("no GPU visible: run with --small for the CPU check")
    if args.prefill_len is not None and args.prefill_len < 1:
        parser.error(f"--prefill-len: expected a positive number of tokens, got {args.prefill_len}")
    setup = Setup(args.small, args.model)
    setup.prefill_len = args.prefill_len or setup.prefill_len
    if args.small:
        # One thread: OpenMP threads spinning on a busy 2-core CI machine make timings swing 100x.
        torch.set_num_threads(1)
    skip = set(filter(None, args.skip.split(",")))
    parts = {"llama": lambda: llama_latency(setup, args), "kv_blocks": lambda: mqa_kv_blocks(setup),
             "bart": lambda: bart_cross_qkv(setup)}
    # Each part frees its models when it returns; collect before the next one allocates.
    results = {}
    for name, fn in parts.items():
        results[name] = {"error": "skipped (--skip)"} if name in skip else _section(name, fn)
        free_memory(setup)
    on_gpu = setup.device.type == "cuda"
    device_name = torch.cuda.get_device_name(setup.device) if on_gpu else platform.processor()
    meta = {"device": device_name or "cpu", "torch": torch.__version__, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "small": setup.small,
            "command": "python benchmarks/bench_latency.py" + (" --small" if setup.small else "")
            + f" --model {args.model}"
            + (" --quantization fp8" if args.quantization == "fp8" else "")
            + (" --kv-cache-dtype fp8" if args.kv_cache_dtype == "fp8" else "")
            + (f" --prefill-len {args.prefill_len}" if args.prefill_len else ""),
            "model": setup.model_name, "quantization": args.quantization,
            "kv_cache_dtype": args.kv_cache_dtype}
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except ImportError:
        meta["transformers"] = None
    print_report(setup, results)
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "" if args.model == "llama-3-8b" else f"_{args.model}"
    file = args.out / f"latency_{'small_cpu' if setup.small else 'gpu'}{suffix}.json"
    file.write_text(json.dumps({"meta": meta, **results}, indent=1, default=str) + "\n")
    print(f"\nwrote {file}")


if __name__ == "__main__":
    main()
