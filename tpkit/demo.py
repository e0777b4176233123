"""The main job end to end: a HuggingFace checkpoint sharded over ranks, generating on the paged KV cache.

    python -m tpkit.demo                              # a small random Llama over 2 CPU ranks (or every GPU)
    python -m tpkit.demo --model Qwen/Qwen2.5-0.5B --prompt "The capital of France is"
    python -m tpkit.demo --tp 4 --device cpu
    torchrun --nproc-per-node 2 -m tpkit.demo         # the ranks launched by torchrun (NCCL on GPUs)

Without ``--model`` it writes a small Llama checkpoint with random weights (HF format: config.json and
model.safetensors) to a temporary directory, generates greedily from a batch of ragged prompts and, when
transformers is installed, checks every token against transformers' own generate. It prints each rank's
shard, the KV cache blocks and the throughput, then runs the same prompts through ``tpkit.serving.Engine``
(continuous batching, a progress bar as requests finish) and checks its tokens against generate's. With
``--model`` it loads a real checkpoint (a local directory or a hub id) with its tokenizer and prints the
completions of ``--prompt``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from tpkit.loaders import resolve_checkpoint
from tpkit.models import from_pretrained
from tpkit.parallel_layers import (
    RankError,
    destroy_tensor_parallel,
    init_tensor_parallel,
    launch,
    local_device,
)
from tpkit.serving import Engine, SamplingParams

DEMO_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000, "hidden_size": 256,
    "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 32, "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "hidden_act": "silu", "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 0, "dtype": "float32",
}
DEMO_PROMPT_LENS = (7, 19, 3, 12, 26, 1)
DEFAULT_PROMPTS = ("The capital of France is", "def fibonacci(n):")


@dataclass
class Job:
    """What every rank runs: a checkpoint, tokenised prompts, and transformers' tokens when checked."""

    path: str
    prompts: list[list[int]]
    max_new_tokens: int
    synthetic: bool
    dtype: str | None
    cuda_graph: bool
    reference: list[list[int]] | None = None


def write_demo_checkpoint(path: Path, seed: int = 0) -> None:
    """A Llama checkpoint in HuggingFace's format with random weights, written without transformers.

    Weights are N(0, 0.1) (norm weights around 1), large enough that greedy choices are not near-ties.
    """
    c = DEMO_CONFIG
    hidden, inter, head = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q_size, kv_size = c["num_attention_heads"] * head, c["num_key_value_heads"] * head
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.1 + mean

    tensors = {"model.embed_tokens.weight": normal(c["vocab_size"], hidden),
               "model.norm.weight": normal(hidden, mean=1.0),
               "lm_head.weight": normal(c["vocab_size"], hidden)}
    for i in range(c["num_hidden_layers"]):
        layer = f"model.layers.{i}"
        tensors |= {
            f"{layer}.input_layernorm.weight": normal(hidden, mean=1.0),
            f"{layer}.self_attn.q_proj.weight": normal(q_size, hidden),
            f"{layer}.self_attn.k_proj.weight": normal(kv_size, hidden),
            f"{layer}.self_attn.v_proj.weight": normal(kv_size, hidden),
            f"{layer}.self_attn.o_proj.weight": normal(hidden, q_size),
            f"{layer}.post_attention_layernorm.weight": normal(hidden, mean=1.0),
            f"{layer}.mlp.gate_proj.weight": normal(inter, hidden),
            f"{layer}.mlp.up_proj.weight": normal(inter, hidden),
            f"{layer}.mlp.down_proj.weight": normal(hidden, inter),
        }
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(c, indent=2))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))


def transformers_tokens(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]] | None:
    """transformers' greedy tokens for each prompt alone (stopping at EOS, like tpkit), or None without it."""
    try:
        import transformers
    except ImportError:
        return None
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(path).float().eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            generated = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                       num_beams=1, pad_token_id=0)
            outputs.append(generated[0, len(prompt):].tolist())
    return outputs


def load_tokenizer(path: str) -> Any:
    """transformers' AutoTokenizer when installed, else the ``tokenizers`` library's tokenizer.json."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
    return AutoTokenizer.from_pretrained(path)


def _encode(tokenizer: Any, text: str) -> list[int]:
    encoded = tokenizer.encode(text)
    return list(encoded.ids if hasattr(encoded, "ids") else encoded)


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def prepare(args: argparse.Namespace, workdir: str) -> Job:
    """Done once (in the launching process, or on rank 0 under torchrun): checkpoint, prompts, reference."""
    if args.model is None:
        path = Path(workdir) / "demo-llama"
        write_demo_checkpoint(path)
        generator = torch.Generator().manual_seed(1)
        vocab = DEMO_CONFIG["vocab_size"]
        prompts = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in DEMO_PROMPT_LENS]
        # In another dtype than the checkpoint's float32 rounding differs from transformers' float32 run.
        check = not args.no_check and args.dtype in (None, "float32")
        reference = transformers_tokens(str(path), prompts, args.max_new_tokens) if check else None
        return Job(str(path), prompts, args.max_new_tokens, True, args.dtype, args.cuda_graph, reference)
    path = resolve_checkpoint(args.model)
    tokenizer = load_tokenizer(str(path))
    prompts = [_encode(tokenizer, text) for text in (args.prompt or DEFAULT_PROMPTS)]
    return Job(str(path), prompts, args.max_new_tokens, False, args.dtype, args.cuda_graph)


def run_rank(job: Job, device: torch.device | None = None) -> bool:
    """Load this rank's shard, generate, print on rank 0. Returns False when transformers disagrees.

    ``device`` defaults to this rank's (its GPU in an NCCL world, else the CPU).
    """
    tp = init_tensor_parallel()
    device = local_device() if device is None else device
    model = from_pretrained(job.path, device=device, dtype=job.dtype)
    # The warm-up captures the CUDA graph for this batch shape, so the timed run only replays it.
    warm_up_tokens = job.max_new_tokens if job.cuda_graph else 2
    model.generate(job.prompts, warm_up_tokens, cuda_graph=job.cuda_graph)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    outputs = model.generate(job.prompts, job.max_new_tokens, cuda_graph=job.cuda_graph)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    engine_outputs, engine_seconds = _engine_run(job, model)

    params = list(dict.fromkeys(model.parameters()))
    caches = {name: (cache.num_blocks, cache.block_size) for name, cache in model.kv_caches.items()}
    shard = {"rank": tp.rank, "params": sum(p.numel() for p in params),
             "bytes": sum(p.numel() * p.element_size() for p in params), "num_kv_heads": model.num_kv_heads,
             "caches": caches}
    shards = [shard]
    if tp.size > 1:
        shards = [None] * tp.size
        dist.all_gather_object(shards, shard, group=tp.group)
    if tp.rank != 0:
        return True
    _report(job, model, tp.size, device, shards, outputs, seconds)
    same = engine_outputs == outputs
    verdict = "tokens identical to generate" if same else "MISMATCH with generate"
    print(f"Engine (continuous batching): {sum(len(t) for t in engine_outputs)} tokens in "
          f"{engine_seconds:.2f} s, {verdict}")
    if job.reference is None:
        return same
    matches = outputs == job.reference
    verdict = "tokens identical" if matches else "MISMATCH"
    print(f"transformers check: {verdict} for all {len(outputs)} prompts ({[len(t) for t in outputs]} "
          "new tokens)")
    if not matches:
        for i, (ours, theirs) in enumerate(zip(outputs, job.reference, strict=True)):
            if ours != theirs:
                print(f"  prompt {i}: tpkit {ours}\n            transformers {theirs}")
    return matches and same


def _engine_run(job: Job, model: Any) -> tuple[list[list[int]], float]:
    """The prompts through ``tpkit.serving.Engine`` (a progress bar as requests finish): tokens, seconds."""
    cuda = model.device.type == "cuda"
    engine = Engine(model, kv_cache_memory=0.5 if cuda else 64 << 20, cuda_graph=job.cuda_graph)
    engine.generate(job.prompts[:1], SamplingParams(2))  # warm-up
    start = time.perf_counter()
    outputs = engine.generate(job.prompts, SamplingParams(job.max_new_tokens))
    if cuda:
        torch.cuda.synchronize(model.device)
    return outputs, time.perf_counter() - start


def _report(job: Job, model: Any, tp_size: int, device: torch.device, shards: list[dict],
            outputs: list[list[int]], seconds: float) -> None:
    kind = "random weights" if job.synthetic else job.path
    print(f"tpkit demo: {type(model).__name__} ({kind}), dtype {model.dtype}, tp_size {tp_size} on "
          f"{device.type}{' with CUDA graphs' if job.cuda_graph else ''}")
    print(f"{'rank':>4} {'params':>12} {'MB':>9} {'kv heads':>9}  KV cache blocks (block_size)")
    for shard in shards:
        caches = ", ".join(f"{name}: {blocks} ({size})" for name, (blocks, size) in shard["caches"].items())
        print(f"{shard['rank']:>4} {shard['params']:>12,} {shard['bytes'] / 2**20:>9.2f} "
              f"{shard['num_kv_heads']:>9}  {caches}")
    new_tokens = sum(len(tokens) for tokens in outputs)
    prompt_lens = [len(p) for p in job.prompts]
    print(f"generated {new_tokens} tokens for {len(outputs)} prompts of {prompt_lens} tokens in "
          f"{seconds:.2f} s: {new_tokens / seconds:.1f} tokens/s (one prefill, then one paged decode step "
          f"per token for the whole batch)")
    tokenizer = None if job.synthetic else load_tokenizer(job.path)
    for prompt, tokens in zip(job.prompts, outputs, strict=True):
        if tokenizer is None:
            print(f"  {prompt[:6]}{'...' if len(prompt) > 6 else ''} -> {tokens[:10]}...")
        else:
            print(f"  {_decode(tokenizer, prompt)!r} -> {_decode(tokenizer, tokens)!r}")


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tpkit.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="HF model id or local checkpoint directory (default: a small random "
                                        "Llama written to a temporary directory)")
    parser.add_argument("--prompt", action="append", help="a prompt (repeat for a batch); with --model")
    parser.add_argument("--tp", type=int, help="ranks (default: the visible GPUs, else 2 CPU ranks)")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda when there are GPUs")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--dtype", help="e.g. bfloat16 (default: the checkpoint's)")
    parser.add_argument("--cuda-graph", action="store_true", help="replay decode steps from a CUDA graph")
    parser.add_argument("--no-check", action="store_true", help="skip the comparison with transformers")
    args = parser.parse_args(argv)
    if args.prompt and args.model is None:
        parser.error("--prompt needs --model (the random demo model has no tokenizer)")
    if args.tp is not None and args.tp < 1:
        parser.error(f"--tp must be >= 1, got {args.tp}")
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    os.environ.setdefault("TPKIT_DISABLE_PROGRESS", "1")
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        return _main_torchrun(args)
    use_cuda = torch.cuda.is_available() if args.device is None else args.device == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    if args.cuda_graph and not use_cuda:
        raise SystemExit("--cuda-graph needs --device cuda")
    tp_size = args.tp or (torch.cuda.device_count() if use_cuda else 2)
    if use_cuda and tp_size > torch.cuda.device_count():
        raise SystemExit(f"--tp {tp_size}: only {torch.cuda.device_count()} GPUs are visible")
    with tempfile.TemporaryDirectory(prefix="tpkit-demo-") as workdir:
        job = prepare(args, workdir)
        try:
            # A rank's first CUDA call may build the kernels, minutes during which its peers wait.
            matches = launch(run_rank, tp_size, job, backend="nccl" if use_cuda else "gloo",
                             collective_timeout=300)
        except (RankError, TimeoutError) as error:
            print(f"tpkit demo failed: {error}", file=sys.stderr)
            return 1
    return 0 if all(matches) else 1


def _main_torchrun(args: argparse.Namespace) -> int:
    tp = init_tensor_parallel()
    device = local_device()
    if args.cuda_graph and device.type != "cuda":
        raise SystemExit("--cuda-graph needs NCCL ranks on GPUs")
    # Rank 0 writes the checkpoint and computes the reference; the others wait for its directory.
    with tempfile.TemporaryDirectory(prefix="tpkit-demo-") as workdir:
        job = [prepare(args, workdir) if tp.rank == 0 else None]
        if tp.size > 1:
            dist.broadcast_object_list(job, group=tp.group, group_src=0)
        try:
            ok = run_rank(job[0], device)
        finally:
            if tp.size > 1:
                dist.barrier(group=tp.group)
            destroy_tensor_parallel()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
