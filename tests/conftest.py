from pathlib import Path

import pytest
from checkpoints import make_bart_checkpoint, make_gpt_bigcode_checkpoint, make_llama_checkpoint
from multirank import Ranks
from torch import nn


@pytest.fixture(scope="session")
def ranks():
    """Reusable rank pools: ``ranks.run(tp_size, fn, *args)`` runs ``fn`` on every rank (multirank.py)."""
    pools = Ranks()
    yield pools
    pools.close()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, nn.Module]]:
    root = tmp_path_factory.mktemp("checkpoints")
    # The shapes asserted below are those of a hidden size of 64.
    made = {
        "llama": make_llama_checkpoint(root / "llama", hidden_size=64),
        "llama_sharded": make_llama_checkpoint(root / "llama_sharded", max_shard_size="100KB",
                                               attention_bias=True, seed=1),
        "llama_tied": make_llama_checkpoint(root / "llama_tied", tie_word_embeddings=True, seed=2),
        "gpt_bigcode": make_gpt_bigcode_checkpoint(root / "gpt_bigcode"),
        "bart": make_bart_checkpoint(root / "bart"),
    }
    return {name: (root / name, model) for name, model in made.items()}
