"""What ``load_weights`` refuses besides names and shapes, so that no load succeeds with wrong values.

- A target on the meta device: it holds no memory, so "loading" it would write nothing and report success.
- An integer or bool checkpoint tensor into a floating-point parameter: ``torch.can_cast`` allows it, and
  the ids, masks or counts it holds would become weights without a word.
- A file cut short since ``iter_weights`` read its header: found before the first copy, not half-way.
- Values that a narrowing cast turns into inf (float64 1e300 into float16): found on the parameters after
  the copies (one flag a parameter, read once, where the copies ran), and named.
- Tied parameters: a checkpoint's two copies of a tied tensor (``lm_head.weight`` and the embedding) are
  compared, never chosen by their order in the file; where they differ the model is untied and each loads
  its own, as transformers does (it warns and unties too); a tie that ``model.to_empty()`` broke is named
  when the head then goes missing.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from .errors import CheckpointError, WeightsMismatchError
from .lazy_tensor import LazyTensor

logger = logging.getLogger("tpkit.loaders")


def meta_problem(name: str, tensor: torch.Tensor) -> str | None:
    if tensor.device.type != "meta":
        return None
    return (f"{name} is on the meta device, which holds no values: materialise the model first "
            "(model.to_empty(device=...)), then tie its tied weights again (to_empty gives each name its "
            "own tensor)")


def cast_problem(source: torch.dtype, target: torch.dtype) -> str | None:
    """Why values of dtype ``source`` may not be copied into a parameter of dtype ``target``, or None."""
    if target.is_floating_point and not (source.is_floating_point or source.is_complex):
        return (f"dtype {source} holds integers or booleans, not weights: it cannot go into the parameter's "
                f"{target}")
    if not torch.can_cast(source, target):
        return f"dtype {source} cannot be cast to the parameter's {target}"
    return None


def narrows(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether casting ``source`` floats to ``target`` can turn finite values into inf."""
    return (source.is_floating_point and target.is_floating_point
            and torch.finfo(target).max < torch.finfo(source).max)


def check_files_unchanged(weights: Iterable[object]) -> None:
    """Raises CheckpointError, before anything is written, where a safetensors file is now shorter than the
    header read earlier said (truncated, or replaced, since ``iter_weights``)."""
    ends: dict[Path, tuple[int, str]] = {}
    for weight in weights:
        start = getattr(weight, "data_start", None)
        if isinstance(weight, LazyTensor) and weight.file is not None and start is not None:
            end = start + weight.nbytes
            if end > ends.get(weight.file, (0, ""))[0]:
                ends[weight.file] = (end, weight.name)
    for file, (end, name) in ends.items():
        try:
            size = os.path.getsize(file)
        except OSError as error:
            raise CheckpointError(f"{file}: cannot be read any more: {error}; nothing was loaded") from error
        if size < end:
            raise CheckpointError(f"{file}: truncated after its header was read: tensor {name!r} ends at "
                                  f"byte {end}, the file now holds {size}; nothing was loaded")


def overflowed(param: torch.Tensor, weights: Iterable[LazyTensor | torch.Tensor]) -> bool:
    """Whether ``param``'s inf values came from the cast rather than from the checkpoint (error path only:
    reads the checkpoint tensors whole)."""
    return not any(torch.isinf(weight[...]).any() for weight in weights)


def overflow_error(names: list[str], dtypes: list[tuple[torch.dtype, torch.dtype]]) -> CheckpointError:
    listed = ", ".join(f"{name} ({source} -> {target}, largest {torch.finfo(target).max:.6g})"
                       for name, (source, target) in zip(names, dtypes, strict=True))
    return CheckpointError(f"load_weights: checkpoint values overflow the parameters' dtype and were written "
                           f"as inf: {listed}. The model now holds inf there; load it in a wider dtype")


def differ(a: LazyTensor | torch.Tensor, b: LazyTensor | torch.Tensor) -> bool:
    """Whether two checkpoint tensors hold different values (reads both whole)."""
    return tuple(a.shape) != tuple(b.shape) or not torch.equal(a[...], b[...].to(a.dtype))


def untie(model: nn.Module, name: str, tied_to: str) -> torch.Tensor | None:
    """Gives parameter ``name`` a tensor of its own, where its module can (``untie_weights``), warning as
    transformers does; returns the new parameter, or None where the module cannot untie."""
    module_name, _, attr = name.rpartition(".")
    module = model.get_submodule(module_name)
    if not callable(getattr(module, "untie_weights", None)):
        return None
    module.untie_weights()
    warnings.warn(f"load_weights: the model ties {name} to {tied_to}, but the checkpoint holds both with "
                  f"different values: they are untied, each loaded from its own tensor (as transformers "
                  f"does); set tie_word_embeddings=False to silence this", UserWarning, stacklevel=4)
    return getattr(module, attr)


def tie_hint(model: nn.Module, missing: str) -> str:
    """``missing`` (a parameter's name, perhaps with details) with a hint where its module is meant to be
    tied (``tied``) but no longer shares its weight."""
    name = missing.split(" ", 1)[0]
    module_name, _, _ = name.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return missing
    if getattr(module, "tied", False):
        return (f"{missing} (tied to an embedding, but no longer sharing its weight, as after "
                f"model.to_empty(): restore the tie, e.g. model.lm_head.tie_weights(model.embed_tokens))")
    return missing


def untie_differing_copies(model: nn.Module, tied_copies: list) -> bool:
    """Unties each tied parameter whose names the checkpoint holds with different values (``tied_copies``:
    ``(a second name's load, the load placed)`` pairs), or raises WeightsMismatchError where its module
    cannot untie; whether anything was untied."""
    untied = False
    for copy, placed in tied_copies:
        if not differ(copy.weight, placed.weight):
            logger.debug("skipping %s: the same values as %s, to which it is tied", copy.describe(),
                         placed.describe())
            continue
        if (untie(model, copy.name, placed.name) is None
                and untie(model, placed.name, copy.name) is None):
            raise WeightsMismatchError([f"{copy.describe()}: holds other values than {placed.describe()}, "
                                        "which the model ties it to: untie the model's weights, or fix the "
                                        "checkpoint"], [], [])
        untied = True
    return untied


def check_overflow(done: list[tuple[list, torch.Tensor | None]]) -> None:
    """Raises where a narrowing cast wrote inf that the checkpoint tensors do not hold; ``done``: each
    parameter's loads with its flag (None where no cast narrows), read once every copy is done."""
    flagged = [(loads, flag) for loads, flag in done if flag is not None]
    if not flagged:
        return
    hits = torch.stack([flag.cpu() for _, flag in flagged]).tolist()
    names, dtypes = [], []
    for (loads, _), hit in zip(flagged, hits, strict=True):
        param = loads[0].target.tensor
        if hit and overflowed(param, [load.weight for load in loads]):
            names.append(loads[0].target.aliases[0])
            dtypes.append((loads[0].weight.dtype, param.dtype))
    if names:
        raise overflow_error(names, dtypes)
