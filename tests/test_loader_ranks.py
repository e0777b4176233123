"""Loading into tensor-parallel layers on several ranks: every rank gets its shard and reads only that.

The models here are just the parameters of a checkpoint laid out in tpkit layers (no forward): what is
checked is each rank's values against slices of the full tensors, and the bytes each rank read.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tpkit.loaders import bytes_read, iter_weights, load_weights, reset_bytes_read
from tpkit.parallel_layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    init_tensor_parallel,
)

LLAMA_MAPPING = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
                 ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    from checkpoints import make_gpt_bigcode_checkpoint, make_llama_checkpoint

    root = tmp_path_factory.mktemp("rank_checkpoints")
    make_llama_checkpoint(root / "llama", max_shard_size="100KB", attention_bias=True, num_key_value_heads=2)
    make_gpt_bigcode_checkpoint(root / "gpt_bigcode", multi_query=True)
    return {"llama": str(root / "llama"), "gpt_bigcode": str(root / "gpt_bigcode")}


class _Weight(nn.Module):
    """A norm's replicated weight (and bias), loaded by default_weight_loader."""

    def __init__(self, size: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.bias = nn.Parameter(torch.empty(size)) if bias else None


class _LlamaParams(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        inter = config["intermediate_size"]
        head_size, bias = hidden // heads, config["attention_bias"]
        self.embed_tokens = VocabParallelEmbedding(config["vocab_size"], hidden)
        self.layers = nn.ModuleList()
        for _ in range(config["num_hidden_layers"]):
            layer = nn.Module()
            layer.self_attn = nn.Module()
            layer.self_attn.qkv_proj = QKVParallelLinear(hidden, head_size, heads,
                                                         config["num_key_value_heads"], bias=bias)
            layer.self_attn.o_proj = RowParallelLinear(hidden, hidden, bias=bias)
            layer.mlp = nn.Module()
            layer.mlp.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], bias=False)
            layer.mlp.down_proj = RowParallelLinear(inter, hidden, bias=False)
            layer.input_layernorm, layer.post_attention_layernorm = _Weight(hidden), _Weight(hidden)
            self.layers.append(layer)
        self.norm = _Weight(hidden)
        self.lm_head = ParallelLMHead(config["vocab_size"], hidden)


class _GPTBigCodeParams(nn.Module):
    def __init__(self, config: dict) -> None:
        super().__init__()
        hidden, heads, inner = config["n_embd"], config["n_head"], config["n_inner"]
        self.wte = VocabParallelEmbedding(config["vocab_size"], hidden)
        self.wpe = nn.Embedding(config["n_positions"], hidden)
        self.h = nn.ModuleList()
        for _ in range(config["n_layer"]):
            layer = nn.Module()
            layer.ln_1, layer.ln_2 = _Weight(hidden, bias=True), _Weight(hidden, bias=True)
            layer.attn = nn.Module()
            # One KV head (multi-query) stored fused after the query rows: every rank reads it whole.
            layer.attn.c_attn = QKVParallelLinear(hidden, hidden // heads, heads, 1)
            layer.attn.c_proj = RowParallelLinear(hidden, hidden)
            layer.mlp = nn.Module()
            layer.mlp.c_fc = ColumnParallelLinear(hidden, inner)
            layer.mlp.c_proj = RowParallelLinear(inner, hidden)
            self.h.append(layer)
        self.ln_f = _Weight(hidden, bias=True)


def _rows(tensor: torch.Tensor, rank: int, tp_size: int) -> torch.Tensor:
    n = tensor.shape[0] // tp_size
    return tensor[rank * n:(rank + 1) * n]


def _columns(tensor: torch.Tensor, rank: int, tp_size: int) -> torch.Tensor:
    n = tensor.shape[1] // tp_size
    return tensor[:, rank * n:(rank + 1) * n]


def _kv_heads(tensor: torch.Tensor, num_kv_heads: int, head_size: int, rank: int,
              tp_size: int) -> torch.Tensor:
    """This rank's KV rows: its share of the heads, or the one head its queries use when ranks outnumber
    them."""
    if num_kv_heads % tp_size == 0:
        return _rows(tensor, rank, tp_size)
    head = rank // (tp_size // num_kv_heads)
    return tensor[head * head_size:(head + 1) * head_size]


def _full_tensors(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def _load_and_measure(model: nn.Module, path: Path, mapping: tuple,
                      rename: Callable[[str], str]) -> tuple[int, dict[str, torch.Tensor]]:
    reset_bytes_read()
    load_weights(model, iter_weights(path), mapping, rename=rename, progress=False)
    return bytes_read(), _full_tensors(path)


_SHARDED = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")


def _check_llama(tp_size: int, path: str) -> tuple[int, int, int]:
    """Loads on every rank; returns (bytes read, of them from sharded tensors, sharded tensors' full size)."""
    tp = init_tensor_parallel(tp_size)
    r = tp.rank
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    model = _LlamaParams(config)
    read, full = _load_and_measure(model, path, LLAMA_MAPPING, lambda n: n.removeprefix("model."))
    kv, head_size = config["num_key_value_heads"], config["hidden_size"] // config["num_attention_heads"]
    replicated_read = 0
    for name, param in model.named_parameters():
        module, kind = name.split(".")[-2:]
        source = name if name.startswith("lm_head.") else "model." + name
        if module == "qkv_proj":
            q, k, v = (full[source.replace("qkv_proj", p)] for p in ("q_proj", "k_proj", "v_proj"))
            expected = torch.cat([_rows(q, r, tp_size), _kv_heads(k, kv, head_size, r, tp_size),
                                  _kv_heads(v, kv, head_size, r, tp_size)])
        elif module == "gate_up_proj":
            expected = torch.cat([_rows(full[source.replace("gate_up_proj", p)], r, tp_size)
                                  for p in ("gate_proj", "up_proj")])
        elif module in ("o_proj", "down_proj") and kind == "weight":
            expected = _columns(full[source], r, tp_size)
        elif module in ("embed_tokens", "lm_head"):
            expected = _rows(full[source], r, tp_size)
        else:  # norms and the o_proj bias: replicated
            expected = full[source]
            replicated_read += expected.numel() * 4
        assert torch.equal(param, expected), name
    # Every element of this rank's parameters was read exactly once, and nothing else.
    assert read == sum(p.numel() * 4 for p in model.parameters())
    sharded_total = sum(t.numel() * 4 for n, t in full.items() if n.split(".")[-2] in _SHARDED
                        or (n.split(".")[-2] in ("o_proj", "down_proj") and n.endswith("weight")))
    return read, read - replicated_read, sharded_total


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_each_rank_reads_its_llama_shard(ranks, checkpoints, tp_size):
    results = ranks.run(tp_size, _check_llama, tp_size, checkpoints["llama"])
    for _, sharded_read, sharded_total in results:
        if tp_size <= 2:
            # Two KV heads over at most two ranks: each rank reads exactly 1/tp_size of each sharded tensor.
            assert sharded_read * tp_size == sharded_total
        else:
            # At tp_size 4 the two KV heads are replicated: a rank reads one and a quarter of the rest.
            assert sharded_total / tp_size < sharded_read < sharded_total / 2


def _check_gpt_bigcode(tp_size: int, path: str) -> int:
    tp = init_tensor_parallel(tp_size)
    r = tp.rank
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    model = _GPTBigCodeParams(config)
    read, full = _load_and_measure(model, path, (), lambda n: n.removeprefix("transformer."))
    hidden, head_size = config["n_embd"], config["n_embd"] // config["n_head"]
    for name, param in model.named_parameters():
        tensor = full["transformer." + name]
        if ".c_attn." in name:  # fused [q (hidden rows), k (one head), v (one head)]
            q, k, v = tensor.split([hidden, head_size, head_size])
            expected = torch.cat([_rows(q, r, tp_size), k, v])
        elif ".c_fc." in name or name.startswith("wte."):
            expected = _rows(tensor, r, tp_size)
        elif name.endswith("c_proj.weight"):
            expected = _columns(tensor, r, tp_size)
        else:
            expected = tensor
        assert torch.equal(param, expected), name
    assert read == sum(p.numel() * 4 for p in model.parameters())
    return read


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_mqa_fused_c_attn_loads_sharded(ranks, checkpoints, tp_size):
    results = ranks.run(tp_size, _check_gpt_bigcode, tp_size, checkpoints["gpt_bigcode"])
    assert len(set(results)) == 1
