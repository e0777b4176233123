"""Ranks that disagree, and collectives that fail: the multi-rank twin of ``test_bad_input.py``.

Every case runs on every rank of a world of 2 (gloo on 127.0.0.1, or under ``torchrun``), each rank doing
what a careless launch script would make it do, and returns what it raised. Every rank must raise (no
abort, no hang: the pool's timeout fails the test), with the type and a message naming what differs and
on which ranks.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
from multirank import device, under_torchrun
from torch import nn

from tpkit.models import LlamaForCausalLM
from tpkit.parallel_layers import ColumnParallelLinear, RowParallelLinear, TPGroup, init_tensor_parallel

LLAMA = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=16, intermediate_size=32,
             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
             eos_token_id=2)


def _raised(call: Callable[[], object]) -> tuple[str, str] | None:
    try:
        call()
    except Exception as error:  # noqa: BLE001 - what each rank raised is the result
        return type(error).__name__, str(error)
    return None


def _rank() -> int:
    return dist.get_rank()


def _llama(**overrides: object) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM({**LLAMA, **overrides}, device=device()).eval()


def init_different_tp_sizes() -> tuple[str, str] | None:
    return _raised(lambda: init_tensor_parallel(2 if _rank() == 0 else 1))


def build_different_hidden_sizes() -> tuple[str, str] | None:
    init_tensor_parallel()
    return _raised(lambda: _llama(hidden_size=16 * (_rank() + 1), intermediate_size=32))


def build_different_dtypes() -> tuple[str, str] | None:
    init_tensor_parallel()
    dtype = torch.float16 if _rank() == 0 else torch.bfloat16
    return _raised(lambda: LlamaForCausalLM(LLAMA, dtype=dtype, device=device()))


def generate_different_lengths() -> tuple[str, str] | None:
    init_tensor_parallel()
    model = _llama()
    return _raised(lambda: model.generate([[5, 6, 7][: 2 + _rank()]], 2))


def generate_different_prompts() -> tuple[str, str] | None:
    init_tensor_parallel()
    model = _llama()
    return _raised(lambda: model.generate([[5, 6 + _rank()]], 2))


def generate_one_rank_out_of_vocab() -> tuple[str, str] | None:
    init_tensor_parallel()
    model = _llama()
    return _raised(lambda: model.generate([[5, 6] if _rank() == 0 else [5, 99]], 2))


def sequence_parallel_different_lengths() -> tuple[str, str] | None:
    init_tensor_parallel()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LLAMA, device=device(), sequence_parallel=True)
    ids = torch.randint(3, 64, (1, 4 + 2 * _rank()), device=device())
    return _raised(lambda: model(ids))


def layer_size_not_divisible() -> tuple[str, str] | None:
    init_tensor_parallel()
    return _raised(lambda: ColumnParallelLinear(8, 7))


class _Blocks(nn.Module):
    def __init__(self, tp: TPGroup) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(RowParallelLinear(8, 4, tp_group=tp))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks[0](x)


def collective_with_a_missing_peer() -> tuple[str, str] | None:
    """Rank 1 skips the all-reduce of a row-parallel layer inside a model: rank 0's fails in the group's
    timeout (2 s), naming the collective, the layer and the rank; rank 1 waits for that, then reports
    that it skipped."""
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    model = _Blocks(TPGroup.from_process_group(group))
    try:
        if _rank() == 1:
            return "RuntimeError", "skipped"
        return _raised(lambda: model(torch.randn(2, 4)))
    finally:
        dist.barrier()  # over the world: rank 1 keeps the group open until rank 0's collective timed out
        dist.destroy_process_group(group)


CASES = [
    (init_different_tp_sizes, "ValueError",
     r"init_tensor_parallel: the 2 tensor-parallel ranks disagree .*tp_size: rank 0 has 2, rank 1 has 1"),
    (build_different_hidden_sizes, "ValueError",
     r"LlamaForCausalLM: the 2 tensor-parallel ranks disagree .*config\['hidden_size'\]: rank 0 has 16, "
     r"rank 1 has 32"),
    (build_different_dtypes, "ValueError",
     r"dtype: rank 0 has \"torch.float16\", rank 1 has \"torch.bfloat16\""),
    (generate_different_lengths, "ValueError",
     r"generate: the 2 tensor-parallel ranks disagree .*prompts: rank 0 has \[\[5, 6\]\], rank 1 has "
     r"\[\[5, 6, 7\]\]"),
    (generate_different_prompts, "ValueError", r"prompts: rank 0 has \[\[5, 6\]\], rank 1 has \[\[5, 7\]\]"),
    (generate_one_rank_out_of_vocab, "ValueError",
     r"prompts: rank 0 has \[\[5, 6\]\], rank 1 has \[\[5, 99\]\]"),
    (sequence_parallel_different_lengths, "ValueError",
     r"sequence-parallel forward: .*input_ids_shape: rank 0 has \[1, 4\], rank 1 has \[1, 6\]"),
    (layer_size_not_divisible, "ValueError", r"output_size=7 is not divisible by tp_size=2"),
]


@pytest.mark.parametrize(("fn", "error", "match"), CASES, ids=[fn.__name__ for fn, _, _ in CASES])
def test_every_rank_raises_naming_what_differs(ranks, fn, error, match):
    results = ranks.run(2, fn, timeout=120)
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank} raised nothing"
        assert result[0] == error, (rank, result)
        assert re.search(match, result[1]), (rank, result[1])


@pytest.mark.skipif(under_torchrun(), reason="a gloo group's timeout; NCCL reports failures asynchronously")
def test_failed_collective_names_layer_and_rank(ranks):
    rank0, rank1 = ranks.run(2, collective_with_a_missing_peer, timeout=120)
    assert rank1 == ("RuntimeError", "skipped")
    assert rank0[0] == "RuntimeError"
    assert re.search(r"tensor-parallel all-reduce of a torch.float32 tensor of shape \[2, 4\] in "
                     r"blocks.0.0 \(RowParallelLinear\) failed on tp rank 0 of 2 \(gloo, global rank 0\) "
                     r"\(a peer rank did not join this collective", rank0[1]), rank0[1]
