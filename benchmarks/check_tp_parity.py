"""Tensor-parallel parity of a Llama model across tp sizes: the same random weights sharded over
1, 2 and 4 ranks give the same logits and the same greedy tokens.

    python benchmarks/check_tp_parity.py                                   # CPU ranks over gloo, small shapes
    python benchmarks/check_tp_parity.py --device cuda --shapes 8b --tp-sizes 1,2,4 --dtypes float32,bfloat16
    torchrun --nproc-per-node 2 benchmarks/check_tp_parity.py --device cuda --shapes 8b   # one tp size;
        # results are saved under --out and compared with those of the other tp sizes already there

Every rank streams the same full checkpoint tensors, drawn one at a time from a generator seeded by the
tensor's name, through the model's ``load_weights`` (so each rank keeps only its shard, and no checkpoint
is written). Checks against tp_size 1: in float32 the last-position logits agree within float32 rounding
and the greedy tokens of every prompt are equal; in bfloat16 the logits agree within bf16 tolerance.
Exits non-zero when a check fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch

from tpkit.models import LlamaForCausalLM
from tpkit.parallel_layers import init_tensor_parallel

sys.path.insert(0, str(Path(__file__).parent))
from bench_tp_scaling import SHAPES, _config, run_under_torchrun, spawn_ranks  # noqa: E402

# Relative max-abs error of the logits against tp_size 1 (scaled by the largest |logit|). The reduction
# order of the all-reduces differs between tp sizes, so values differ by rounding only.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def _checkpoint(config: dict, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Full HF-named tensors, each drawn on ``device`` from a generator seeded by its name: the same on every
    rank. (Drawn on the CPU, a run of the 8B shapes at tp sizes 1 and 2 outlasted 240 s.)"""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_size = hidden // config["num_attention_heads"]
    kv_size = config["num_key_value_heads"] * head_size
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}."
        shapes |= {prefix + "input_layernorm.weight": (hidden,),
                   prefix + "post_attention_layernorm.weight": (hidden,),
                   prefix + "self_attn.q_proj.weight": (hidden, hidden),
                   prefix + "self_attn.k_proj.weight": (kv_size, hidden),
                   prefix + "self_attn.v_proj.weight": (kv_size, hidden),
                   prefix + "self_attn.o_proj.weight": (hidden, hidden),
                   prefix + "mlp.gate_proj.weight": (inter, hidden),
                   prefix + "mlp.up_proj.weight": (inter, hidden),
                   prefix + "mlp.down_proj.weight": (hidden, inter)}
    for name, shape in shapes.items():
        generator = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
        values = torch.randn(shape, generator=generator, device=device)
        # Norm weights near 1, matrices at a scale that keeps activations O(1) through the layers.
        yield name, 1 + 0.1 * values if len(shape) == 1 else values / shape[1] ** 0.5


def _measure(args: argparse.Namespace, device: torch.device) -> dict:
    tp = init_tensor_parallel()
    config = _config(args.shapes)
    prompts = torch.randint(0, config["vocab_size"], (args.batch, args.prompt_len),
                            generator=torch.Generator().manual_seed(0))
    results = {}
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        model = LlamaForCausalLM(config, dtype=dtype, device=device).eval()
        model.load_weights(_checkpoint(config, device))
        with torch.inference_mode():
            logits = model(prompts.to(device))[:, -1].float().cpu()  # [batch, vocab]
        tokens = model.generate(prompts, args.new_tokens, ignore_eos=True)
        results[dtype_name] = {"logits": logits.tolist(), "tokens": tokens}
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return {"tp_size": tp.size, "results": results}


def _compare(runs: dict[int, dict], dtypes: list[str]) -> bool:
    ok = True
    base = runs.get(1)
    if base is None:
        print("no tp_size 1 run to compare with")
        return False
    if len(runs) == 1:
        print("only tp_size 1 so far: nothing to compare yet")
        return True
    print(f"{'dtype':>9} {'tp':>3} {'logits rel. max err':>20} {'tolerance':>10} {'equal greedy tokens':>21}")
    for dtype_name in dtypes:
        reference = base["results"][dtype_name]
        for tp_size, run in sorted(runs.items()):
            if tp_size == 1:
                continue
            result = run["results"][dtype_name]
            logits, reference_logits = torch.tensor(result["logits"]), torch.tensor(reference["logits"])
            err = ((logits - reference_logits).abs().max() / reference_logits.abs().max()).item()
            tolerance = TOLERANCE[getattr(torch, dtype_name)]
            same = sum(a == b for a, b in zip(result["tokens"], reference["tokens"], strict=True))
            # Greedy tokens must agree exactly in float32; bf16 rounding may flip near-ties.
            tokens_ok = same == len(reference["tokens"]) or dtype_name != "float32"
            ok &= err <= tolerance and tokens_ok
            print(f"{dtype_name:>9} {tp_size:>3} {err:>20.2e} {tolerance:>10.0e} "
                  f"{same:>13}/{len(reference['tokens'])} prompts")
    print("parity: OK" if ok else "parity: FAILED")
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="small")
    parser.add_argument("--tp-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4])
    parser.add_argument("--dtypes", type=lambda s: s.split(","), default=["float32", "bfloat16"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--timeout", type=float, default=3600, help="seconds to wait for one tp size")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "tp_parity")
    args = parser.parse_args(argv)
    os.environ.setdefault("TPKIT_DISABLE_PROGRESS", "1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device visible")
    args.out.mkdir(parents=True, exist_ok=True)

    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        rank, run = run_under_torchrun(_measure, args)
        if rank != 0:
            return 0
        torch.save(run, args.out / f"{args.shapes}_tp{run['tp_size']}.pt")
        runs = {}
        for path in sorted(args.out.glob(f"{args.shapes}_tp*.pt")):
            saved = torch.load(path, weights_only=True)
            runs[saved["tp_size"]] = saved
    else:
        limit = torch.cuda.device_count() if args.device == "cuda" else 64
        runs = {tp: spawn_ranks(tp, _measure, args) for tp in args.tp_sizes if tp <= limit}
    return 0 if _compare(runs, args.dtypes) else 1


if __name__ == "__main__":
    sys.exit(main())
