"""The README's quickstart, run as a newcomer would paste it: every Python block of its Quickstart section.

The checkpoint block's ``path = "..."`` line is pointed at a tiny Llama checkpoint (random weights,
``save_pretrained``, a word-level tokenizer) made here, so that nothing is downloaded; its tokens must be
transformers' greedy ones. The layer block runs in this process at tp_size 1. The script block, which
starts its own ranks, runs as a script in a fresh process: 2 CPU ranks over gloo.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoints import make_llama_checkpoint
from multirank import under_torchrun
from tokenizers import Tokenizer, models, pre_tokenizers

from tpkit.parallel_layers import destroy_tensor_parallel

ROOT = Path(__file__).resolve().parent.parent
PATH_LINE = re.compile(r'^path = "[^"]*"', re.MULTILINE)

pytestmark = pytest.mark.skipif(under_torchrun(), reason="runs tp_size 1 in-process and starts its own ranks")


def _quickstart_blocks() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("\n## Quickstart\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.DOTALL)


def _block(needle: str) -> str:
    blocks = [block for block in _quickstart_blocks() if needle in block]
    assert len(blocks) == 1, f"expected one Quickstart block with {needle!r}, found {len(blocks)}"
    return blocks[0]


def test_the_quickstart_has_the_three_blocks_this_file_runs():
    assert len(_quickstart_blocks()) == 3


def _checkpoint_with_tokenizer(path: Path):
    """A tiny Llama (vocab 256) with a word-level tokenizer that knows the quickstart's words."""
    reference = make_llama_checkpoint(path)
    words = ["The", "capital", "of", "France", "is", "def", "fibonacci", "(", "n", "):"]
    vocab = {word: 3 + i for i, word in enumerate(words)}
    vocab |= {f"w{i}": i for i in range(256) if not 3 <= i < 3 + len(words)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return reference


def test_from_pretrained_and_generate_give_transformers_tokens(tmp_path, capsys):
    reference = _checkpoint_with_tokenizer(tmp_path)
    code, substitutions = PATH_LINE.subn(f"path = {str(tmp_path)!r}", _block("from_pretrained"))
    assert substitutions == 1, "the block sets the checkpoint with one line `path = \"...\"`"
    namespace: dict = {}
    try:
        exec(compile(code, "README.md (quickstart)", "exec"), namespace)
    finally:
        destroy_tensor_parallel()
    prompts, outputs = namespace["prompts"], namespace["outputs"]
    assert prompts == [[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]]  # the tokenizer saw every word
    with torch.no_grad():
        expected = [reference.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False,
                                       pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert outputs == expected
    assert repr([namespace["tokenizer"].decode(ids) for ids in outputs]) in capsys.readouterr().out


def test_the_five_line_layer_runs_alone():
    namespace: dict = {}
    try:
        exec(compile(_block("alone: tp_size 1"), "README.md (layer)", "exec"), namespace)
        assert namespace["tp"].size == 1
        up, down, y = namespace["up"], namespace["down"], namespace["y"]
        assert tuple(up.weight.shape) == (4096, 1024) and tuple(down.weight.shape) == (1024, 4096)
        assert y.shape == (8, 1024) and torch.isfinite(y).all()
    finally:
        destroy_tensor_parallel()


def test_the_script_starts_two_ranks(tmp_path):
    script = tmp_path / "tp_layers.py"
    script.write_text(_block('if __name__ == "__main__":'))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "CUDA_VISIBLE_DEVICES": ""}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    for rank in range(2):
        assert f"rank {rank} of 2: up.weight (2048, 1024), y (8, 1024)" in result.stdout
