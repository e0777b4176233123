"""q, k and v of attention in one column-parallel layer, split by heads (Megatron / vLLM style), with KV
heads replicated when there are fewer of them than ranks. The layers' common parts (sequence parallelism,
loading, the products) are :mod:`.linear`'s.
"""

from __future__ import annotations

import torch
from torch import nn

from ._checks import _check_positive, _divide
from ._loading import _param_name
from .linear import _ColumnParallelBase, _TPGroupArg
from .mappings import _all_reduce
from .quantization import QuantizationMethod
from .state import _resolve_tp_group


class QKVParallelLinear(_ColumnParallelBase):
    """q, k and v projections of attention in one matrix, split by heads.

    Rank r holds query heads ``[r * num_heads, (r + 1) * num_heads)``. KV heads are split the same way when
    ``total_num_kv_heads`` divides by ``tp_size``; when instead ``tp_size`` divides by it (MQA/GQA at high
    TP), each rank holds one KV head, ``r // (tp_size // total_num_kv_heads)``: the one its query heads use.
    The output is ``[..., q_size + 2 * kv_size]`` = this rank's q, k, v, in that order.

    ``weight_loader`` takes ``loaded_shard_id`` "q", "k" or "v" with the checkpoint's q_proj, k_proj,
    v_proj, or None with a tensor that stores them fused in that order (GPT-BigCode's ``c_attn``).

    A replicated KV head's weight gradient on a rank covers only that rank's query heads' use of it; the
    replicas' gradients sum to the full one: in training, call :meth:`reduce_kv_replica_grads` (or
    :func:`~tpkit.parallel_layers.reduce_kv_replica_grads` on the model) after backward.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int | None = None,
        bias: bool = True,
        skip_bias_add: bool = False,
        *,
        sequence_parallel: bool = False,
        overlap_communication: bool = False,
        params_dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        tp_group: _TPGroupArg = None,
        quant_method: QuantizationMethod | None = None,
    ) -> None:
        total_num_kv_heads = total_num_heads if total_num_kv_heads is None else total_num_kv_heads
        _check_positive(hidden_size=hidden_size, head_size=head_size, total_num_heads=total_num_heads,
                        total_num_kv_heads=total_num_kv_heads)
        if total_num_heads % total_num_kv_heads:
            raise ValueError(f"total_num_heads={total_num_heads} must be a multiple of "
                             f"total_num_kv_heads={total_num_kv_heads}")
        tp = _resolve_tp_group(tp_group)
        self.hidden_size = hidden_size
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = _divide(total_num_heads, tp.size, "total_num_heads")
        if total_num_kv_heads % tp.size == 0:
            self.num_kv_heads = total_num_kv_heads // tp.size
            self.num_kv_head_replicas = 1
        elif tp.size % total_num_kv_heads == 0:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = tp.size // total_num_kv_heads
        else:
            raise ValueError(f"total_num_kv_heads={total_num_kv_heads} and tp_size={tp.size}: one must "
                             "divide the other to split or replicate the KV heads")
        self.q_size = self.num_heads * head_size
        self.kv_size = self.num_kv_heads * head_size
        output_size = (total_num_heads + 2 * total_num_kv_heads) * head_size
        super().__init__(hidden_size, output_size, self.q_size + 2 * self.kv_size, bias=bias,
                         gather_output=False, skip_bias_add=skip_bias_add,
                         sequence_parallel=sequence_parallel, tp=tp, params_dtype=params_dtype, device=device,
                         quant_method=quant_method, overlap_communication=overlap_communication)

    def _qkv_piece(self, shard: str) -> tuple[int, int, int, int]:
        """(start in this rank's rows, start in the q/k/v checkpoint tensor, length, offset when fused)."""
        total_q = self.total_num_heads * self.head_size
        total_kv = self.total_num_kv_heads * self.head_size
        if shard == "q":
            return 0, self.tp_rank * self.q_size, self.q_size, 0
        kv_rank = self.tp_rank // self.num_kv_head_replicas
        if shard == "k":
            return self.q_size, kv_rank * self.kv_size, self.kv_size, total_q
        return self.q_size + self.kv_size, kv_rank * self.kv_size, self.kv_size, total_q + total_kv

    def _row_pieces(self) -> list[tuple[int, int, int, int]]:
        kv_rank = self.tp_rank // self.num_kv_head_replicas
        # Replicas of one KV head are one block of the full matrix.
        blocks = {"q": self.tp_rank, "k": self.tp_size + kv_rank, "v": 2 * self.tp_size + kv_rank}
        pieces = []
        for shard, block in blocks.items():
            dst, src, length, fused_start = self._qkv_piece(shard)
            pieces.append((dst, fused_start + src, length, block))
        return pieces

    def _logical_rows(self) -> list[tuple[int | str | None, int, int, int, int]]:
        kv_rows = self.total_num_kv_heads * self.head_size
        totals = {"q": self.total_num_heads * self.head_size, "k": kv_rows, "v": kv_rows}
        rows = []
        for shard in "qkv":
            dst, src, length, _ = self._qkv_piece(shard)
            rows.append((shard, totals[shard], src, length, dst))
        return rows

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: int | str | None = None) -> None:
        name = _param_name(self, param, loaded_shard_id)
        if loaded_shard_id is None:
            pieces = [(dst, src, length) for dst, src, length, _ in self._row_pieces()]
            self._load_rows(param, loaded_weight, name, self.output_size, pieces)
            return
        if loaded_shard_id not in ("q", "k", "v"):
            raise ValueError(f"{name}: loaded_shard_id must be 'q', 'k', 'v' or None, "
                             f"received {loaded_shard_id!r}")
        _, total, src, length, dst = self._logical_rows()["qkv".index(loaded_shard_id)]
        self._load_rows(param, loaded_weight, name, total, [(dst, src, length)])

    def _grad_holders(self, param: nn.Parameter) -> int | torch.Tensor:
        # q rows are shards; each KV head's rows sit on its num_kv_head_replicas ranks.
        holders = torch.ones(self.q_size + 2 * self.kv_size, device=param.device)
        holders[self.q_size:] = self.num_kv_head_replicas
        return holders

    def reduce_kv_replica_grads(self) -> bool:
        """Sums the k and v rows' gradients (weight and bias) over the ranks that hold the same KV head, so
        that each replica holds the whole head's gradient and the replicas stay equal through an optimizer
        step. Call it after backward, on every rank of the group. Returns False, doing nothing, when the KV
        heads are split rather than replicated."""
        if self.num_kv_head_replicas == 1:
            return False
        kv_rank = self.tp_rank // self.num_kv_head_replicas
        for param in (self.weight, self.bias):
            if param is None:
                continue
            if param.grad is None:  # unused on this rank: its replicas still count on its share
                param.grad = torch.zeros_like(param)
            kv_grad = param.grad[self.q_size:]  # [2 * head_size, ...]: this rank's k and v rows
            # One slot a KV head, each filled by its replicas: one all-reduce over the whole group, no
            # subgroups to create.
            slots = kv_grad.new_zeros(self.total_num_kv_heads, *kv_grad.shape)
            slots[kv_rank] = kv_grad
            _all_reduce(slots, self.tp_group)
            kv_grad.copy_(slots[kv_rank])
        return True

    def extra_repr(self) -> str:
        return (f"hidden_size={self.hidden_size}, head_size={self.head_size}, "
                f"total_num_heads={self.total_num_heads}, total_num_kv_heads={self.total_num_kv_heads}, "
                f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"bias={self.bias is not None}, tp_size={self.tp_size}")
