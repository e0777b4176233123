"""tpkit.checkpoint: save, resume and reshard a tensor-parallel model and its optimizer; export it to
HuggingFace.

- :func:`sharded_state_dict`: the model's tensors as the unsharded model's logical tensors (q, k and v of a
  QKV weight apart, the vocabulary unpadded), each with its full shape and this rank's place in it, for
  ``torch.distributed.checkpoint`` (DCP);
- :func:`save` / :func:`load`: model, optimizer state (sharded like its parameters), generator states and
  your own values in one DCP directory, loaded back at any tp_size after checking it against the model;
- :func:`export_hf`: a HuggingFace directory (safetensors shards, index, config.json) gathered from the
  ranks, for ``transformers`` and ``tpkit.models.from_pretrained``.

It reads how each layer splits its parameters (``layer.shard_parts``, ``tpkit.parallel_layers.sharding``)
and knows nothing of the models: a model describes its checkpoint names with ``stacked_params_mapping``
and an optional ``export_weights``. A plain ``dcp.save(model.state_dict())`` of a sharded model is refused
(it would keep one rank's shard for all).
"""

from .errors import CheckpointMismatchError
from .hf import export_hf
from .save_load import load, save
from .state_dict import sharded_state_dict

__all__ = ["CheckpointMismatchError", "export_hf", "load", "save", "sharded_state_dict"]
