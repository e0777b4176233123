"""``bench_latency.py --quantization fp8``: tpkit's float8 model against the model it is quantized from
(imported by bench_latency; not a script).

:func:`fp8_latency` builds the model of ``setup.dtype`` (bf16 on a GPU) and times it; quantizes a copy of it
(:func:`quantized_copy`: the method and the path of ``from_pretrained(path, quantization="fp8")``, its
weights loaded in high precision and quantized per channel once loaded); turns the first model into the
reference of the float8 model's tokens (:func:`dequantize_into`: the float8 weights times their scales) and
generates with it; frees it and times the float8 model the same way. Both are timed with every ``generate``
variant and with their prefill alone, and the float8 model's greedy tokens are compared with the
reference's (:func:`token_divergence`). The high-precision runs keep their KV cache in their dtype whatever
``--kv-cache-dtype`` says: they are the plain model the float8 one is measured against.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

import torch
from latency_timing import floor_line, free_memory, prefill_row, timed_model, token_agreement

from tpkit.models import PagedLM, model_class
from tpkit.models.quantization import quant_method_from_config
from tpkit.parallel_layers import Fp8LinearMethod, process_weights_after_loading, skip_init

if TYPE_CHECKING:
    from bench_latency import Setup

# The targets the float8 run is judged against.
FLOOR_GOAL = 1.15  # the float8 model's time at most this times its read floor
SPEEDUP_GOAL = 1.8  # ... and at least this times faster than the high-precision model
PREFILL_GOAL = 1.6  # prefill tokens a second at least this times the high-precision model's
AGREEMENT_GOAL = 0.95  # greedy tokens equal to the dequantized reference's on at least this share


def quantized_copy(model: PagedLM) -> PagedLM:
    """A float8 copy of ``model`` (Llama-family, one rank) on its device: every decoder linear layer's weight
    quantized per channel, by the method and the path of ``from_pretrained(quantization="fp8")``."""
    method = quant_method_from_config({}, "fp8")
    with skip_init():  # every parameter is loaded next
        quantized = type(model)(model.config, dtype=model.dtype, device=model.device, quant_method=method)
    quantized.load_state_dict(model.state_dict())
    process_weights_after_loading(quantized)
    return quantized.eval()


@torch.no_grad()
def dequantize_into(model: PagedLM, quantized: PagedLM) -> None:
    """Overwrite the linear weights of ``model`` with those of its float8 copy ``quantized``, dequantized
    (``weight.float() * scale`` in ``model``'s dtype); its other parameters are the copy's already."""
    for name, layer in quantized.named_modules():
        method = getattr(layer, "quant_method", None)
        if isinstance(method, Fp8LinearMethod):
            model.get_submodule(name).weight.copy_(method.dequantized_weight(layer, model.dtype))


def token_divergence(tokens: list[list[int]], reference: list[list[int]]) -> dict:
    """``positions_equal``: the share of positions whose token equals the reference's; ``before_divergence``:
    per sequence, the positions before the first that differs (all where none does): after it the two
    continue different texts, so later positions agree by chance."""
    firsts = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
              for x, y in zip(tokens, reference, strict=True)]
    return {"positions_equal": token_agreement(tokens, reference), "before_divergence": firsts}


@torch.no_grad()
def teacher_forced_agreement(model: PagedLM, prompts: list[list[int]], reference: list[list[int]]) -> float:
    """The share of the reference's generated positions whose token is ``model``'s greedy choice after the
    reference's own prefix: every sequence (its prompt and ``reference`` tokens) scored in one forward, so
    that a position that differs does not change the ones after it."""
    equal = total = 0
    for prompt, tokens in zip(prompts, reference, strict=True):
        sequence = torch.tensor([prompt + tokens[:-1]], device=model.device)  # [1, prompt + new - 1]
        predicted = model(sequence)[0, len(prompt) - 1:].argmax(-1)  # [new]: the token after each prefix
        equal += int((predicted == torch.tensor(tokens, device=model.device)).sum())
        total += len(tokens)
    return equal / total


def fp8_latency(setup: Setup, args: argparse.Namespace, config: dict, prompts: list[list[int]],
                bandwidth: float) -> dict:
    """The float8 model's result (``rows`` and floors, as ``timed_model`` gives them; ``prefill``), with
    ``fp8_vs_bf16`` (:func:`fp8_comparison`)."""
    model = model_class(config)(config, dtype=setup.dtype, device=setup.device).eval()
    dtype = "bf16" if setup.dtype == torch.bfloat16 else str(setup.dtype).removeprefix("torch.")
    baseline, baseline_tokens = timed_model(setup, args, model, prompts, bandwidth, f"tpkit {dtype}")
    # [batch, prefill_len], of their own generator: the weights stay those of bench_latency's seed.
    long_prompts = torch.randint(0, config["vocab_size"], (setup.batch, setup.prefill_len),
                                 generator=torch.Generator().manual_seed(1)).tolist()
    baseline["prefill"] = prefill_row(setup, model, long_prompts, f"tpkit {dtype} prefill")
    fp8 = quantized_copy(model)
    dequantize_into(model, fp8)  # from here the reference of the float8 model's tokens
    print("  reference: the dequantized float8 weights, eager ...", flush=True)
    reference_tokens = model.generate(prompts, setup.output_len, ignore_eos=True)
    # The reference's own tokens scored by its forward: the same weights through the prefill's kernels, whose
    # rounding differs from the decode steps' only in the order of the sums.
    rescored = teacher_forced_agreement(model, prompts, reference_tokens)
    del model  # one model on the device from here
    free_memory(setup)
    fp8.kv_cache_dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else None
    result, tokens = timed_model(setup, args, fp8, prompts, bandwidth, "tpkit")
    result["prefill"] = prefill_row(setup, fp8, long_prompts, "tpkit fp8 prefill")
    # The same prefill through the layers' forward: each product quantizing its own input.
    fp8.fused_fp8 = False
    result["prefill_layers"] = prefill_row(setup, fp8, long_prompts, "tpkit fp8 prefill, layers' forward")
    fp8.fused_fp8 = None
    result["fp8_vs_bf16"] = fp8_comparison(result, baseline, dtype, tokens, reference_tokens, baseline_tokens)
    result["fp8_vs_bf16"]["teacher_forced"] = {
        "fp8": teacher_forced_agreement(fp8, prompts, reference_tokens), "reference_rescored": rescored}
    return result


def fp8_comparison(fp8: dict, baseline: dict, dtype: str, tokens: list[list[int]] | None,
                   reference_tokens: list[list[int]], baseline_tokens: list[list[int]] | None) -> dict:
    """The float8 model's figures beside the high-precision (``dtype``) model's, as JSON: ``baseline`` (its
    result), ``rows`` (each variant's times and their ratio), ``prefill`` (tokens a second and their ratio),
    ``agreement`` (the float8 model's tokens against the ``dequantized`` reference's and the ``baseline``
    model's; none where its runs failed)."""
    rows = []
    for fp8_row, baseline_row in zip(fp8["rows"], baseline["rows"], strict=True):
        row: dict[str, Any] = {"variant": fp8_row["variant"], "fp8_s": fp8_row.get("avg_s"),
                               "baseline_s": baseline_row.get("avg_s")}
        if row["fp8_s"] and row["baseline_s"]:
            row["fp8_over_baseline"] = row["fp8_s"] / row["baseline_s"]
        rows.append(row)
    prefill = {"baseline_tokens_per_s": baseline["prefill"].get("tokens_per_s"),
               "fp8_tokens_per_s": fp8["prefill"].get("tokens_per_s"),
               "fp8_layers_tokens_per_s": fp8.get("prefill_layers", {}).get("tokens_per_s")}
    if prefill["baseline_tokens_per_s"] and prefill["fp8_tokens_per_s"]:
        prefill["ratio"] = prefill["fp8_tokens_per_s"] / prefill["baseline_tokens_per_s"]
    agreement = {}
    if tokens is not None:
        agreement["dequantized"] = token_divergence(tokens, reference_tokens)
        if baseline_tokens is not None:
            agreement["baseline"] = token_divergence(tokens, baseline_tokens)
    return {"baseline_dtype": dtype, "baseline": baseline, "rows": rows, "prefill": prefill,
            "agreement": agreement}


def print_comparison(latency: dict, batch: int, output_len: int) -> None:
    """The float8 section of bench_latency's report, from ``latency`` (its part's JSON)."""
    comparison, fp8_floor = latency["fp8_vs_bf16"], latency["read_floor"]["floor_s"]
    dtype, baseline = comparison["baseline_dtype"], comparison["baseline"]
    baseline_floor = baseline["read_floor"]["floor_s"]
    print(f"\n# float8 weights (per channel, quantized from the {dtype} model's) against that {dtype} model, "
          f"both tpkit, in this process: batch {batch}, {output_len} new tokens")
    print(floor_line(dtype, baseline["read_floor"], latency["copy_GBps"]))
    print(floor_line("fp8", latency["read_floor"], latency["copy_GBps"]))
    print(f"| {'variant':<22} | {dtype + ' s':>9} | {'/ floor':>7} | {'fp8 s':>9} | {'/ floor':>7} | "
          f"{'fp8 / ' + dtype:>13} | {'speedup':>7} |")
    print(f"|{'-' * 24}|{'-' * 11}|{'-' * 9}|{'-' * 11}|{'-' * 9}|{'-' * 15}|{'-' * 9}|")
    for row in comparison["rows"]:
        cells = []
        for seconds, floor in ((row["baseline_s"], baseline_floor), (row["fp8_s"], fp8_floor)):
            cells += [f"{seconds:>9.3f}", f"{seconds / floor:>6.2f}x"] if seconds else [f"{'failed':>9}",
                                                                                         f"{'-':>7}"]
        ratio = row.get("fp8_over_baseline")
        cells += [f"{ratio:>13.3f}", f"{1 / ratio:>6.2f}x"] if ratio else [f"{'-':>13}", f"{'-':>7}"]
        print(f"| {row['variant']:<22} | " + " | ".join(cells) + " |")
    print(f"goal: fp8 at most {FLOOR_GOAL}x its read floor and at least {SPEEDUP_GOAL}x faster than {dtype}")
    prefill, shape = comparison["prefill"], baseline["prefill"]
    if "ratio" in prefill:
        print(f"prefill alone, {shape['batch']} prompts x {shape['prompt_len']} tokens: {dtype} "
              f"{prefill['baseline_tokens_per_s']:,.0f} tokens/s, fp8 {prefill['fp8_tokens_per_s']:,.0f} "
              f"tokens/s: {prefill['ratio']:.2f}x (goal: at least {PREFILL_GOAL}x)")
        if prefill.get("fp8_layers_tokens_per_s"):
            print(f"  fp8 through the layers' forward (fused_fp8=False): "
                  f"{prefill['fp8_layers_tokens_per_s']:,.0f} tokens/s")
    else:
        print(f"prefill alone: failed ({dtype}: {shape.get('error', 'ran')}; fp8: "
              f"{latency['prefill'].get('error', 'ran')})")
    agreement = comparison["agreement"]
    if "dequantized" not in agreement:
        print("greedy tokens: none from the fp8 model (its runs failed)")
        return
    for key, what in (("dequantized", f"{dtype} with the dequantized fp8 weights"),
                      ("baseline", f"{dtype} with the weights before quantization")):
        if key in agreement:
            print(f"greedy tokens of fp8 against {what}, {batch} prompts x {output_len}: "
                  f"{agreement[key]['positions_equal']:.1%} of positions equal; positions before the first "
                  f"difference: {agreement[key]['before_divergence']}")
    print(f"goal: at least {AGREEMENT_GOAL:.0%} of positions equal to the dequantized weights' tokens")
    forced = comparison.get("teacher_forced")
    if forced:
        print(f"each position scored after the dequantized reference's own prefix (one forward a sequence): "
              f"fp8 picks the reference's token at {forced['fp8']:.1%} of positions; the reference's "
              f"forward, on its own tokens, at {forced['reference_rescored']:.1%}")
