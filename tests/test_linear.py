"""Parallel linear layers against the unsharded nn.Linear: loading, outputs, gradients; tp_size 1, 2, 4."""

from __future__ import annotations

import copy

import multirank
import pytest
import torch
import torch.distributed as dist
from torch import nn

from tpkit.parallel_layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    TPGroup,
    init_tensor_parallel,
    reduce_from_tp_region,
)

TOL = {"rtol": 1e-5, "atol": 1e-5}
HIDDEN = 16


class LazyHandle:
    """Only what a weight loader may use of a ``tpkit.loaders`` lazy tensor; counts the elements it gives."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor.detach()
        self.elements_read = 0

    @property
    def shape(self) -> torch.Size:
        return self._tensor.shape

    @property
    def dtype(self) -> torch.dtype:
        return self._tensor.dtype

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self._take(self._tensor.narrow(dim, start, length))

    def __getitem__(self, index: object) -> torch.Tensor:
        return self._take(self._tensor[index])

    def _take(self, part: torch.Tensor) -> torch.Tensor:
        self.elements_read += part.numel()
        return part.clone()


def load(param: nn.Parameter, tensor: torch.Tensor, loaded_shard_id: object = None) -> int:
    """Loads ``tensor`` through the param's weight_loader via a lazy handle; returns the elements it read."""
    handle = LazyHandle(tensor)
    param.weight_loader(param, handle, loaded_shard_id)
    return handle.elements_read


def blocks(*ranges: tuple[int, int]) -> torch.Tensor:
    """The indices of the given [start, stop) ranges, concatenated."""
    return torch.cat([torch.arange(start, stop) for start, stop in ranges])


def check_forward_backward(layer: nn.Module, ref: nn.Linear, *, held_rows: torch.Tensor | None,
                           output_is_full: bool = False, in_cols: torch.Tensor | None = None,
                           full_input: bool = True, grad_weight: torch.Tensor | None = None,
                           reduce_output: bool = False) -> None:
    """``layer`` holds rows ``held_rows`` (None: all) and columns ``in_cols`` (None: all) of ``ref.weight``.

    Its output is those rows of ``ref``'s output, or all of them with ``output_is_full``. The loss on each
    rank is the part of the reference loss its output covers, each output row weighted by ``grad_weight``
    (1 / number of ranks holding the row), so that the ranks' contributions to the input gradient add up
    to the reference's; its weight gradient is then the reference's rows, weighted the same.
    """
    device = multirank.device()
    x = torch.randn(2, 3, ref.in_features, device=device)  # [batch, seq, input_size]
    x_ref = x.clone().requires_grad_()
    y_ref = ref(x_ref)
    g = torch.randn_like(y_ref)
    (y_ref * g).sum().backward()

    x_local = x if full_input or in_cols is None else x[..., in_cols]
    x_local = x_local.clone().requires_grad_()
    out = layer(x_local)
    y, bias = out if isinstance(out, tuple) else (out, None)
    if reduce_output:
        y = reduce_from_tp_region(y, layer.tp_group)
    if bias is not None:
        y = y + bias
    rows = slice(None) if held_rows is None else held_rows
    out_rows = slice(None) if output_is_full else rows
    torch.testing.assert_close(y, y_ref[..., out_rows], **TOL)
    scale = torch.ones(y.shape[-1], device=device) if grad_weight is None else grad_weight.to(device)
    (y * g[..., out_rows] * scale).sum().backward()

    expected_x_grad = x_ref.grad if full_input or in_cols is None else x_ref.grad[..., in_cols]
    torch.testing.assert_close(x_local.grad, expected_x_grad, **TOL)
    row_scale = torch.ones(()) if output_is_full else scale
    ref_w_grad = ref.weight.grad[rows] * row_scale.unsqueeze(-1).to(device)
    if in_cols is not None:
        ref_w_grad = ref_w_grad[:, in_cols]
    torch.testing.assert_close(layer.weight.grad, ref_w_grad, **TOL)
    if ref.bias is not None:
        torch.testing.assert_close(layer.bias.grad, ref.bias.grad[rows] * row_scale.to(device), **TOL)


def assert_rejected(param: nn.Parameter, tensor: torch.Tensor, loaded_shard_id: object,
                    *fragments: str) -> None:
    """The loader raises ValueError mentioning every fragment and leaves the parameter as it was."""
    before = param.detach().clone()
    with pytest.raises(ValueError) as error:
        param.weight_loader(param, LazyHandle(tensor), loaded_shard_id)
    for fragment in fragments:
        assert fragment in str(error.value), (fragment, str(error.value))
    assert torch.equal(param.detach(), before)


def _column_layers(tp: TPGroup, device: torch.device) -> None:
    r, n = tp.rank, tp.size
    for bias in (True, False):
        ref = nn.Linear(HIDDEN, 24, bias=bias, device=device)
        rows = blocks((r * 24 // n, (r + 1) * 24 // n))
        for gather_output, skip_bias_add in ((False, False), (True, False), (False, True), (True, True)):
            ref.zero_grad()
            layer = ColumnParallelLinear(HIDDEN, 24, bias=bias, gather_output=gather_output,
                                         skip_bias_add=skip_bias_add, device=device)
            assert layer.weight.shape == (24 // n, HIDDEN)
            assert load(layer.weight, ref.weight) == layer.weight.numel()
            if bias:
                assert load(layer.bias, ref.bias) == layer.bias.numel()
            check_forward_backward(layer, ref, held_rows=rows, output_is_full=gather_output)

        ref.zero_grad()
        replicated = ReplicatedLinear(HIDDEN, 24, bias=bias, device=device)
        assert load(replicated.weight, ref.weight) == ref.weight.numel()
        if bias:
            load(replicated.bias, ref.bias)
        check_forward_backward(replicated, ref, held_rows=None)

    # Merged: each of gate and up split on its own.
    sizes = [20, 12]
    for bias in (True, False):
        ref = nn.Linear(HIDDEN, sum(sizes), bias=bias, device=device)
        gate_rows = (r * 20 // n, (r + 1) * 20 // n)
        up_rows = (20 + r * 12 // n, 20 + (r + 1) * 12 // n)
        for fused in (False, True):
            ref.zero_grad()
            layer = MergedColumnParallelLinear(HIDDEN, sizes, bias=bias, device=device)
            for param, full in ((layer.weight, ref.weight), (layer.bias, ref.bias)):
                if full is None:
                    continue
                if fused:
                    assert load(param, full) == param.numel()
                else:
                    assert load(param, full[:20], 0) + load(param, full[20:], 1) == param.numel()
            check_forward_backward(layer, ref, held_rows=blocks(gate_rows, up_rows))


def _qkv_rows(tp: TPGroup, heads: int, kv_heads: int, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The output rows this rank holds and each row's number of holders (independent of the layer)."""
    r, n = tp.rank, tp.size
    q_heads = heads // n
    kv_of_rank = [i // (n // kv_heads) for i in range(n)] if kv_heads < n else None
    if kv_of_rank is None:
        kv_local = kv_heads // n
        kv_first, holders = r * kv_local, 1
    else:
        kv_local, kv_first = 1, kv_of_rank[r]
        holders = kv_of_rank.count(kv_of_rank[r])
    total_q, total_kv = heads * head_size, kv_heads * head_size
    q = (r * q_heads * head_size, (r + 1) * q_heads * head_size)
    k = (total_q + kv_first * head_size, total_q + (kv_first + kv_local) * head_size)
    v = (k[0] + total_kv, k[1] + total_kv)
    rows = blocks(q, k, v)
    weight = torch.cat([torch.ones(q[1] - q[0]), torch.full((2 * (k[1] - k[0]),), 1.0 / holders)])
    return rows, weight


def _qkv_layers(tp: TPGroup, device: torch.device) -> None:
    head_size = 4
    # MHA, GQA (replicated at tp_size 4), MQA (replicated at tp_size 2 and 4)
    for heads, kv_heads in ((4, 4), (8, 2), (4, 1)):
        total = (heads + 2 * kv_heads) * head_size
        rows, weight = _qkv_rows(tp, heads, kv_heads, head_size)
        for bias in (True, False):
            ref = nn.Linear(HIDDEN, total, bias=bias, device=device)
            for fused in (False, True):
                ref.zero_grad()
                layer = QKVParallelLinear(HIDDEN, head_size, heads, kv_heads, bias=bias, device=device)
                num_kv_heads = max(1, kv_heads // tp.size)
                assert (layer.num_heads, layer.num_kv_heads) == (heads // tp.size, num_kv_heads)
                assert layer.q_size == heads // tp.size * head_size
                assert layer.kv_size == num_kv_heads * head_size
                for param, full in ((layer.weight, ref.weight), (layer.bias, ref.bias)):
                    if full is None:
                        continue
                    if fused:
                        read = load(param, full)
                    else:
                        q, k, v = full.split([heads * head_size, kv_heads * head_size, kv_heads * head_size])
                        read = load(param, q, "q") + load(param, k, "k") + load(param, v, "v")
                    assert read == param.numel()
                check_forward_backward(layer, ref, held_rows=rows, grad_weight=weight)


def _row_layers(tp: TPGroup, device: torch.device) -> None:
    r, n = tp.rank, tp.size
    cols = blocks((r * 24 // n, (r + 1) * 24 // n))
    for bias in (True, False):
        ref = nn.Linear(24, HIDDEN, bias=bias, device=device)
        for input_is_parallel, reduce_results, skip_bias_add in (
            (True, True, False), (False, True, False), (True, False, False), (True, True, True),
            (True, False, True),
        ):
            ref.zero_grad()
            layer = RowParallelLinear(24, HIDDEN, bias=bias, input_is_parallel=input_is_parallel,
                                      reduce_results=reduce_results, skip_bias_add=skip_bias_add,
                                      device=device)
            assert layer.weight.shape == (HIDDEN, 24 // n)
            assert load(layer.weight, ref.weight) == layer.weight.numel()
            if bias:
                assert load(layer.bias, ref.bias) == HIDDEN
            check_forward_backward(layer, ref, held_rows=None, in_cols=cols, full_input=not input_is_parallel,
                                   reduce_output=not reduce_results)


def _bad_loads(tp: TPGroup, device: torch.device) -> None:
    column = ColumnParallelLinear(HIDDEN, 24, device=device)
    assert_rejected(column.weight, torch.randn(24, HIDDEN + 1), None, "ColumnParallelLinear.weight",
                    str((24, HIDDEN)), str((24, HIDDEN + 1)))
    assert_rejected(column.bias, torch.randn(23), None, "ColumnParallelLinear.bias", "(24,)", "(23,)")
    assert_rejected(column.weight, torch.randn(24, HIDDEN), 0, "loaded_shard_id")
    row = RowParallelLinear(24, HIDDEN, device=device)
    assert_rejected(row.weight, torch.randn(24, HIDDEN), None, "RowParallelLinear.weight",
                    str((HIDDEN, 24)), str((24, HIDDEN)))
    assert_rejected(row.bias, torch.randn(24), None, "RowParallelLinear.bias")
    merged = MergedColumnParallelLinear(HIDDEN, [20, 12], device=device)
    assert_rejected(merged.weight, torch.randn(12, HIDDEN), 0, "MergedColumnParallelLinear.weight[0]",
                    str((20, HIDDEN)), str((12, HIDDEN)))
    assert_rejected(merged.weight, torch.randn(20, HIDDEN), 2, "loaded_shard_id", "0..1")
    assert_rejected(merged.weight, torch.randn(20, HIDDEN), None, str((32, HIDDEN)))
    qkv = QKVParallelLinear(HIDDEN, 4, 8, 2, device=device)
    assert_rejected(qkv.weight, torch.randn(32, HIDDEN), "k", "QKVParallelLinear.weight['k']",
                    str((8, HIDDEN)), str((32, HIDDEN)))
    assert_rejected(qkv.weight, torch.randn(8, HIDDEN), "x", "'q', 'k', 'v'")
    assert_rejected(qkv.bias, torch.randn(32), None, str((48,)), str((32,)))
    replicated = ReplicatedLinear(HIDDEN, 24, bias=False, device=device)
    assert_rejected(replicated.weight, torch.randn(HIDDEN, 24), None, "ReplicatedLinear.weight")
    with pytest.raises(TypeError, match="loaded_weight"):
        column.weight.weight_loader(column.weight, [[1.0]])


def _bad_sizes(tp: TPGroup) -> None:
    n = tp.size
    with pytest.raises(ValueError, match="total_num_heads=6 must be a multiple of total_num_kv_heads=4"):
        QKVParallelLinear(HIDDEN, 4, 6, 4)
    with pytest.raises(ValueError, match="input_size must be a positive int"):
        ColumnParallelLinear(0, 8)
    if n == 1:
        return
    output_size = 6 if n == 4 else 5
    with pytest.raises(ValueError, match=f"output_size={output_size} is not divisible by tp_size={n}"):
        ColumnParallelLinear(HIDDEN, output_size)
    with pytest.raises(ValueError, match=f"input_size={n + 1} is not divisible by tp_size={n}"):
        RowParallelLinear(n + 1, HIDDEN)
    with pytest.raises(ValueError, match=rf"output_sizes\[1\]=5 is not divisible by tp_size={n}"):
        MergedColumnParallelLinear(HIDDEN, [8, 5])
    heads, kv_heads = (6, 3) if n == 4 else (3, 1)
    with pytest.raises(ValueError, match=f"total_num_heads={heads} is not divisible by tp_size={n}"):
        QKVParallelLinear(HIDDEN, 4, heads, kv_heads)
    # KV heads neither divisible by tp_size nor dividing it: 6 KV heads on 4 ranks; 3 on 2.
    kv_heads = 6 if n == 4 else 3
    with pytest.raises(ValueError, match=f"total_num_kv_heads={kv_heads} and tp_size={n}"):
        QKVParallelLinear(HIDDEN, 4, 12, kv_heads)


def gather_ranks(tensor: torch.Tensor, tp: TPGroup) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape on each), in rank order."""
    parts = [torch.empty_like(tensor) for _ in range(tp.size)]
    dist.all_gather(parts, tensor.contiguous(), group=tp.group)
    return parts


def _default_init(tp: TPGroup, device: torch.device) -> None:
    """Built without loading: bounded like nn.Linear, shards distinct, replicated values equal everywhere."""
    torch.manual_seed(1)
    column = ColumnParallelLinear(HIDDEN, 24, device=device)
    row = RowParallelLinear(24, HIDDEN, device=device)
    merged = MergedColumnParallelLinear(HIDDEN, [8, 8], device=device)
    qkv = QKVParallelLinear(HIDDEN, 4, 4, 1, device=device)  # MQA: the KV head replicated on every rank
    for layer in (column, row, merged, qkv):
        bound = layer.input_size ** -0.5
        assert 0 < layer.weight.abs().max() <= bound
        assert layer.weight.std() > bound / 4
    assert not torch.equal(merged.weight[:8 // tp.size], merged.weight[8 // tp.size:])
    if tp.size == 1:
        return
    for shards in (gather_ranks(column.weight, tp), gather_ranks(row.weight, tp),
                   gather_ranks(qkv.weight[: qkv.q_size], tp)):
        assert not torch.equal(shards[0], shards[1])
    for copies in (gather_ranks(row.bias, tp), gather_ranks(qkv.weight[qkv.q_size:], tp)):
        assert all(torch.equal(copies[0], c) for c in copies[1:])


def _params_dtype(tp: TPGroup, device: torch.device) -> None:
    ref = nn.Linear(HIDDEN, 24, device=device)
    layer = ColumnParallelLinear(HIDDEN, 24, params_dtype=torch.float64, device=device)
    assert layer.weight.dtype == layer.bias.dtype == torch.float64
    load(layer.weight, ref.weight)
    load(layer.bias, ref.bias)
    rows = slice(tp.rank * 24 // tp.size, (tp.rank + 1) * 24 // tp.size)
    assert torch.equal(layer.weight, ref.weight[rows].double())
    bf16 = RowParallelLinear(24, HIDDEN, params_dtype=torch.bfloat16, device=device)
    load(bf16.weight, ref.weight.T.contiguous())
    assert bf16.weight.dtype == torch.bfloat16
    assert bf16(torch.randn(3, 24 // tp.size, device=device, dtype=torch.bfloat16)).dtype == torch.bfloat16


def _check_linear_layers(tp_size: int) -> None:
    tp = init_tensor_parallel()
    assert tp.size == tp_size
    device = multirank.device()
    torch.manual_seed(0)
    _column_layers(tp, device)
    _qkv_layers(tp, device)
    _row_layers(tp, device)
    _bad_loads(tp, device)
    _bad_sizes(tp)
    _params_dtype(tp, device)
    _default_init(tp, device)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_linear_layers(ranks, tp_size: int) -> None:
    ranks.run(tp_size, _check_linear_layers, tp_size)


def test_layers_need_no_setup() -> None:
    """Without init_tensor_parallel and without torch.distributed, layers are tp_size 1 (and copy well)."""
    if dist.is_available() and dist.is_initialized():
        pytest.skip("torch.distributed is initialised in this process")
    torch.manual_seed(0)
    ref = nn.Linear(HIDDEN, 24)
    layer = ColumnParallelLinear(HIDDEN, 24)
    assert layer.tp_size == 1
    load(layer.weight, ref.weight)
    load(layer.bias, ref.bias)
    x = torch.randn(5, HIDDEN)
    torch.testing.assert_close(layer(x), ref(x), **TOL)

    clone = copy.deepcopy(layer)  # a copy keeps its group and gets loaders of its own
    assert clone.tp_group is layer.tp_group
    assert clone.weight.weight_loader.__self__ is clone
    load(clone.weight, 2 * ref.weight)
    torch.testing.assert_close(clone.weight, 2 * ref.weight, rtol=0, atol=0)
    torch.testing.assert_close(layer.weight, ref.weight, rtol=0, atol=0)


def test_loaders_survive_materialising_from_meta() -> None:
    """Built on the meta device, then ``to_empty``: the new Parameters get the layer's loaders again, so the
    usual big-model flow (build without memory, materialise, load) works."""
    from tpkit.parallel_layers import VocabParallelEmbedding

    single = TPGroup(None, 0, 1)
    with torch.device("meta"):
        qkv = QKVParallelLinear(HIDDEN, 4, 4, 2, bias=True, tp_group=single)
        embedding = VocabParallelEmbedding(40, HIDDEN, tp_group=single)
    for layer in (qkv, embedding):
        layer.to_empty(device="cpu")
        for param in layer.parameters():
            assert param.device.type == "cpu"
            assert param.weight_loader.__self__ is layer
    torch.manual_seed(0)
    q, k, v = torch.randn(16, HIDDEN), torch.randn(8, HIDDEN), torch.randn(8, HIDDEN)
    for shard_id, tensor in zip("qkv", (q, k, v), strict=True):
        load(qkv.weight, tensor, shard_id)
    torch.testing.assert_close(qkv.weight, torch.cat([q, k, v]), rtol=0, atol=0)
    table = torch.randn(40, HIDDEN)
    load(embedding.weight, table)
    torch.testing.assert_close(embedding.weight[:40], table, rtol=0, atol=0)


def test_skip_init_draws_no_random_values(monkeypatch) -> None:
    """Inside skip_init layers draw nothing (from_pretrained's build, seconds a GB saved); outside they do."""
    from tpkit.parallel_layers import ParallelLMHead, VocabParallelEmbedding, skip_init

    draws = []
    for method in ("uniform_", "normal_"):
        monkeypatch.setattr(torch.Tensor, method,
                            lambda self, *args, method=method, **kwargs: draws.append(method) or self)
    single = TPGroup(None, 0, 1)

    def build() -> None:
        QKVParallelLinear(HIDDEN, 4, 4, 2, bias=True, tp_group=single)
        RowParallelLinear(HIDDEN, HIDDEN, tp_group=single)
        VocabParallelEmbedding(40, HIDDEN, tp_group=single)
        ParallelLMHead(40, HIDDEN, tp_group=single)

    with skip_init():
        build()
    assert draws == []
    build()
    assert sorted(set(draws)) == ["normal_", "uniform_"]
