"""tpkit.loaders: Hugging Face checkpoints into (sharded) models, each rank reading only its part.

``resolve_checkpoint`` (local directory or hub id) -> ``iter_weights`` (lazy handles, one per tensor) ->
``load_weights(model, weights, stacked_params_mapping)`` -> ``param.weight_loader(param, handle, shard)``,
which slices the handle and so reads only this rank's bytes. Nothing here keeps tensor-parallel state.
"""

from .checkpoint import resolve_checkpoint
from .errors import CheckpointError, CheckpointNotFoundError, PartialLoadError, WeightsMismatchError
from .lazy_tensor import LazyTensor, bytes_read, reset_bytes_read
from .load import default_weight_loader, load_weights
from .weight_files import checkpoint_file
from .weights import iter_weights

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "LazyTensor",
    "PartialLoadError",
    "WeightsMismatchError",
    "bytes_read",
    "checkpoint_file",
    "default_weight_loader",
    "iter_weights",
    "load_weights",
    "reset_bytes_read",
    "resolve_checkpoint",
]
