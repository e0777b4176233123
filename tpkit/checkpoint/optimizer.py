"""An optimizer's state by logical tensor: each state tensor shaped like its parameter (AdamW's ``exp_avg``
and ``exp_avg_sq``) cut and placed exactly as the parameter is, so it reshards with it; a 0-d state (the
``step``) saved once, under the parameter's name. The parameter groups' hyperparameters and the names of
their parameters travel as JSON in the checkpoint's header.

Keys: ``optim.state.<logical tensor>.<state>`` for a sharded state (``...qkv_proj.weight:q.exp_avg``),
``optim.state.<parameter>.<state>`` for a 0-d one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from .state_dict import ModelLayout, Stage, _Entry

_PARAM_SHAPED, _SCALAR = "param", "scalar"


_Parts = list[tuple[int, _Entry]]


def _by_param(optimizer: torch.optim.Optimizer, layout: ModelLayout, verb: str) -> list[list[_Parts]]:
    """For each group, for each of its parameters, the model's entries of that parameter (with indices)."""
    parts: dict[int, _Parts] = {}
    for index, entry in enumerate(layout.entries):
        parts.setdefault(id(entry.param), []).append((index, entry))
    groups = []
    for g, group in enumerate(optimizer.param_groups):
        params = []
        for i, param in enumerate(group["params"]):
            if id(param) not in parts:
                raise ValueError(f"{verb}: optimizer.param_groups[{g}]['params'][{i}] (shape "
                                 f"{tuple(param.shape)}) is not a parameter of the model")
            params.append(parts[id(param)])
        groups.append(params)
    return groups


def _hyperparameters(group: dict[str, Any], g: int) -> dict[str, Any]:
    values = {key: value for key, value in group.items() if key != "params"}
    try:
        json.dumps(values)
    except TypeError as error:
        raise TypeError(f"save: optimizer.param_groups[{g}] holds a value JSON cannot store ({error}); "
                        "tpkit.checkpoint saves numbers, strings, booleans, None and lists of them") from None
    return values


def optimizer_values(optimizer: torch.optim.Optimizer, layout: ModelLayout,
                     stage: Stage) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(DCP values, header)`` of ``optimizer``'s state: the values keyed as in the module docstring (each
    tensor through ``stage``), the header with each group's hyperparameters, parameter names and each
    parameter's state names."""
    values: dict[str, Any] = {}
    groups, kinds = [], {}
    for g, (group, params) in enumerate(zip(optimizer.param_groups, _by_param(optimizer, layout, "save"),
                                            strict=True)):
        groups.append({"params": [parts[0][1].name for parts in params], **_hyperparameters(group, g)})
        for param, parts in zip(group["params"], params, strict=True):
            name = parts[0][1].name
            kinds[name] = {}
            for state_name, state in optimizer.state.get(param, {}).items():
                if torch.is_tensor(state) and state.dim() > 0 and state.shape == param.shape:
                    kinds[name][state_name] = _PARAM_SHAPED
                    for index, entry in parts:
                        value = layout.value(index, state, stage)
                        if value is not None:
                            values[f"optim.state.{entry.key}.{state_name}"] = value
                elif torch.is_tensor(state) and state.dim() == 0:
                    kinds[name][state_name] = _SCALAR
                    values[f"optim.state.{name}.{state_name}"] = stage(state.detach())
                else:
                    raise TypeError(f"save: optimizer state {name}.{state_name} is neither a tensor shaped "
                                    f"like its parameter {tuple(param.shape)} nor a 0-d tensor: "
                                    f"{type(state).__name__} {tuple(getattr(state, 'shape', ()))}")
    return values, {"class": type(optimizer).__name__, "param_groups": groups, "state": kinds}


def optimizer_problems(optimizer: torch.optim.Optimizer, layout: ModelLayout, header: dict[str, Any] | None,
                       metadata: Metadata) -> list[str]:
    """What keeps the checkpoint's optimizer state from going into ``optimizer``, one line each."""
    if header is None:
        return ["optimizer: the checkpoint holds no optimizer state (saved without optimizer=)"]
    problems = []
    if header["class"] != type(optimizer).__name__:
        problems.append(f"optimizer: checkpoint {header['class']}, given {type(optimizer).__name__}")
    names = [[parts[0][1].name for parts in params] for params in _by_param(optimizer, layout, "load")]
    saved = [group["params"] for group in header["param_groups"]]
    if names != saved:
        problems.append(f"optimizer: parameter groups of sizes {[len(n) for n in saved]} in the checkpoint, "
                        f"{[len(n) for n in names]} given, or other parameters in them: the optimizer must "
                        "be built over the same parameters, in the same groups and order")
        return problems
    shapes = {entry.key: entry.part.shape for entry in layout.entries}
    for name, kinds in header["state"].items():
        for state_name, kind in kinds.items():
            keys = ([entry.key for entry in layout.entries if entry.name == name] if kind == _PARAM_SHAPED
                    else [name])
            for key in keys:
                md = metadata.state_dict_metadata.get(f"optim.state.{key}.{state_name}")
                expected = shapes[key] if kind == _PARAM_SHAPED else ()
                if not isinstance(md, TensorStorageMetadata):
                    problems.append(f"optim.state.{key}.{state_name}: not in the checkpoint")
                elif tuple(md.size) != expected:
                    problems.append(f"optim.state.{key}.{state_name}: checkpoint shape {tuple(md.size)}, "
                                    f"model {expected}")
    return problems


def optimizer_targets(optimizer: torch.optim.Optimizer, layout: ModelLayout, header: dict[str, Any],
                      metadata: Metadata) -> tuple[dict[str, Any], Callable[[], None]]:
    """``(DCP targets, finish)``: tensors for ``dcp.load`` to fill, and the call that then hands them to
    ``optimizer.load_state_dict`` with the checkpoint's hyperparameters. Check with
    :func:`optimizer_problems` first."""
    targets: dict[str, Any] = {}
    state: dict[int, dict[str, torch.Tensor]] = {}  # by the parameter's position, as Optimizer.state_dict
    groups = []
    for group, params in zip(header["param_groups"], _by_param(optimizer, layout, "load"), strict=True):
        positions = []
        for parts in params:
            name, param = parts[0][1].name, parts[0][1].param
            states = state[len(state)] = {}
            for state_name, kind in header["state"].get(name, {}).items():
                if kind == _PARAM_SHAPED:
                    local = torch.zeros_like(param, memory_format=torch.contiguous_format).detach()
                    for index, entry in parts:
                        value = layout.value(index, local)
                        if value is not None:
                            targets[f"optim.state.{entry.key}.{state_name}"] = value
                else:
                    key = f"optim.state.{name}.{state_name}"
                    local = torch.zeros((), dtype=metadata.state_dict_metadata[key].properties.dtype)
                    targets[key] = local
                states[state_name] = local
            positions.append(len(state) - 1)
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": positions})

    def finish() -> None:
        optimizer.load_state_dict({"state": {i: s for i, s in state.items() if s}, "param_groups": groups})

    return targets, finish
