"""`python -m tpkit.demo` as a user runs it: 2 CPU ranks, checked against transformers, under a minute."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoints import make_llama_checkpoint
from multirank import under_torchrun
from tokenizers import Tokenizer, models, pre_tokenizers

from tpkit.demo import _parse, main, prepare, run_rank
from tpkit.parallel_layers import destroy_tensor_parallel

ROOT = Path(__file__).resolve().parent.parent


def _cpu_env() -> dict[str, str]:
    """The environment of a user's shell on a CPU machine: tpkit importable, no GPU, not under torchrun."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "CUDA_VISIBLE_DEVICES": ""}
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


# Under torchrun every rank would start the same CPU ranks at once: the plain pytest run covers these.
_SPAWNS_CPU_RANKS = pytest.mark.skipif(under_torchrun(), reason="spawns its own CPU ranks; once is enough")


@_SPAWNS_CPU_RANKS
def test_demo_runs_sharded_and_matches_transformers():
    result = subprocess.run([sys.executable, "-m", "tpkit.demo"], cwd=ROOT, env=_cpu_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "tp_size 2 on cpu" in out
    assert "transformers check: tokens identical for all 6 prompts" in out
    assert "tokens/s" in out
    # The engine's tokens equal generate's, and so transformers'.
    assert "Engine (continuous batching): " in out and "tokens identical to generate" in out
    # Both ranks report their shard and KV cache blocks.
    rows = [line.split() for line in out.splitlines() if line.strip().startswith(("0 ", "1 "))]
    assert [row[0] for row in rows] == ["0", "1"] and all("self:" in row for row in rows)


@pytest.mark.parametrize("argv, message", [
    (["--prompt", "hi"], "--prompt needs --model"),
    (["--tp", "0"], "--tp must be >= 1"),
])
def test_demo_rejects_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.skipif(under_torchrun(), reason="runs tp_size 1 in this process; torchrun's world is bigger")
def test_demo_model_and_prompt_use_the_checkpoint_and_its_tokenizer(tmp_path, capsys):
    """``--model DIR --prompt ...`` in this process (tp_size 1): a checkpoint with a word-level tokenizer."""
    make_llama_checkpoint(tmp_path)
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    args = _parse(["--model", str(tmp_path), "--prompt", "w5 w6 w7", "--prompt", "w9",
                   "--max-new-tokens", "4"])
    job = prepare(args, str(tmp_path))
    assert job.prompts == [[5, 6, 7], [9]] and not job.synthetic
    try:
        assert run_rank(job, torch.device("cpu"))
    finally:
        destroy_tensor_parallel()
    out = capsys.readouterr().out
    assert "tp_size 1 on cpu" in out and "'w5 w6 w7' -> 'w" in out and "'w9' -> 'w" in out


@_SPAWNS_CPU_RANKS
@pytest.mark.parametrize(("script", "args", "lines"), [
    ("custom_model.py", [], ["tp_size 2: this rank holds 4 of 8 query heads, 1 KV head(s)",
                             "logits and greedy tokens equal the unsharded model's"]),
    ("train_tp.py", [], ["30 steps: the losses and gradient norms agree within",
                         "the KV head's 2 replicas are equal"]),
    ("train_tp.py", ["--sequence-parallel"], ["(tp_size 2, sequence-parallel)",
                                              "30 steps: the losses and gradient norms agree within"]),
])
def test_example_runs_on_two_cpu_ranks(script: str, args: list[str], lines: list[str]):
    result = subprocess.run([sys.executable, f"examples/{script}", *args], cwd=ROOT, env=_cpu_env(),
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    for line in lines:
        assert line in result.stdout
