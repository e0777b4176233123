"""tpkit.parallel_layers: tensor-parallel process groups, collectives, and sharded linear/embedding layers.

Set up the group once with :func:`init_tensor_parallel` (under torchrun, inside an initialised
torch.distributed, or in a single process), or pass ``tp_group=`` to each layer. Every parameter carries
``param.weight_loader(param, loaded_weight, loaded_shard_id=None)`` that copies this rank's shard of a
full checkpoint tensor (a ``torch.Tensor`` or a lazy handle that reads only the slices asked for).
Training takes a few steps across the group: :func:`vocab_parallel_cross_entropy` (the loss from each
rank's vocabulary columns), :func:`reduce_kv_replica_grads`, :func:`clip_grad_norm_`, and for dropout
:func:`seed_tensor_parallel`, :func:`tensor_parallel_dropout`, :func:`tensor_parallel_rng` and
:func:`checkpoint`; with sequence parallelism (the layers' ``sequence_parallel=True``)
:func:`mark_sequence_parallel` and :func:`reduce_sequence_parallel_grads`. :func:`launch` runs a function on
the ranks of a world on this machine (gloo on the CPU, NCCL on GPUs), as ``torchrun`` would. Each layer
describes how its parameters are split with ``layer.shard_parts(param)`` (:class:`ShardPart`,
``.sharding``), which ``tpkit.checkpoint`` reads to save and load at any tp_size. The linear layers take a
``quant_method`` (:class:`Fp8LinearMethod`: float8 weights with per-tensor, per-channel or block scales,
sharded by the same loaders; ``.quantization``), or get one with :func:`set_quant_method`.
:func:`check_ranks_agree` raises on every rank where the ranks were given different values (configs,
shapes, prompts), which would otherwise abort inside the backend or compute garbage. Sequence parallelism's
collectives overlap with the products in the layers built with ``overlap_communication=True`` or given it by
:func:`set_overlap_communication` (:func:`all_gather_matmul`, :func:`matmul_reduce_scatter`; ``.overlap``).
Decode-sized all-reduces of CUDA tensors (at most :data:`ONE_SHOT_MAX_BYTES`) run as symmetric memory's
one-shot kernel where the ranks' GPUs can map each other's memory (:func:`one_shot_all_reduce`;
``.symmetric_memory``), NCCL's otherwise.
"""

from ._consistency import check_ranks_agree
from ._init import skip_init
from .cross_entropy import vocab_parallel_cross_entropy
from .cross_qkv import QKVCrossParallelLinear
from .grads import (
    clip_grad_norm_,
    mark_sequence_parallel,
    reduce_kv_replica_grads,
    reduce_sequence_parallel_grads,
)
from .launch import RankError, RankPool, free_port, launch, local_device
from .linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from .linear_op import LinearOp, set_linear_op
from .mappings import (
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
)
from .overlap import all_gather_matmul, matmul_reduce_scatter, set_overlap_communication
from .qkv import QKVParallelLinear
from .quantization import (
    Fp8LinearMethod,
    QuantizationMethod,
    process_weights_after_loading,
    set_quant_method,
)
from .random import (
    checkpoint,
    get_tensor_parallel_rng_state,
    seed_tensor_parallel,
    set_tensor_parallel_rng_state,
    tensor_parallel_dropout,
    tensor_parallel_rng,
)
from .sharding import ShardPart
from .state import (
    TPGroup,
    destroy_tensor_parallel,
    get_tp_group,
    get_tp_rank,
    get_tp_size,
    init_tensor_parallel,
)
from .symmetric_memory import ONE_SHOT_MAX_BYTES, one_shot_all_reduce
from .vocab_embedding import ParallelLMHead, VocabParallelEmbedding, pad_vocab_size

__all__ = [
    "ONE_SHOT_MAX_BYTES",
    "ColumnParallelLinear",
    "Fp8LinearMethod",
    "LinearOp",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "RankError",
    "RankPool",
    "QKVCrossParallelLinear",
    "QKVParallelLinear",
    "QuantizationMethod",
    "ReplicatedLinear",
    "RowParallelLinear",
    "ShardPart",
    "TPGroup",
    "VocabParallelEmbedding",
    "all_gather_matmul",
    "check_ranks_agree",
    "checkpoint",
    "clip_grad_norm_",
    "copy_to_tp_region",
    "destroy_tensor_parallel",
    "free_port",
    "gather_from_sequence_parallel_region",
    "gather_from_tp_region",
    "get_tensor_parallel_rng_state",
    "get_tp_group",
    "get_tp_rank",
    "get_tp_size",
    "init_tensor_parallel",
    "launch",
    "local_device",
    "mark_sequence_parallel",
    "matmul_reduce_scatter",
    "one_shot_all_reduce",
    "pad_vocab_size",
    "process_weights_after_loading",
    "reduce_from_tp_region",
    "reduce_kv_replica_grads",
    "reduce_scatter_to_sequence_parallel_region",
    "reduce_sequence_parallel_grads",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tp_region",
    "seed_tensor_parallel",
    "set_linear_op",
    "set_overlap_communication",
    "set_quant_method",
    "set_tensor_parallel_rng_state",
    "skip_init",
    "tensor_parallel_dropout",
    "tensor_parallel_rng",
    "vocab_parallel_cross_entropy",
]
