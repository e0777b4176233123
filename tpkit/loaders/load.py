"""``load_weights``: pair checkpoint tensors with model parameters by name, check every pair, then copy.

Names are compared as dotted paths, component by component: a ``stacked_params_mapping`` entry
``("qkv_proj", "q_proj", "q")`` turns ``layers.0.self_attn.q_proj.weight`` into
``layers.0.self_attn.qkv_proj.weight`` (shard ``"q"``) but leaves ``qkv_proj`` and ``v_proj`` alone, because
``q_proj`` must be a whole component there, not a substring.

Nothing is written until every tensor has been paired and checked: shapes and dtypes come from the lazy
handles for free, and a parameter's own ``weight_loader`` is first tried on a meta-device shadow of the
parameter with a meta stand-in for the tensor, so its shape errors surface before any data moves.

Then the copies run on a few threads (copies release the GIL, and one thread does not reach the memory's
bandwidth, nor overlap the page faults of file maps and fresh parameters), file by file; the loads into one
parameter (the shards of a stacked one) run in order on one thread, so a loader never races itself.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from tpkit._env import env_flag

from . import _direct_copy, _safeguards
from .errors import PartialLoadError, WeightsMismatchError
from .lazy_tensor import LazyTensor, _GivenTensor, _MetaTensor, bytes_read

__all__ = ["default_weight_loader", "load_weights"]

logger = logging.getLogger("tpkit.loaders")

ShardId = str | int | None
Weight = LazyTensor | torch.Tensor
Rename = Callable[[str], str | None] | Mapping[str, str] | None
IgnorePattern = str | re.Pattern

_Components = tuple[str, ...]
# How torch refuses to compute on meta tensors (values, not shapes): no verdict from the trial run then.
_NEEDS_DATA = re.compile(r"\bmeta tensors?\b|'Meta' backend", re.IGNORECASE)


def default_weight_loader(param: torch.Tensor, loaded_weight: Weight) -> None:
    """Copies a whole checkpoint tensor into a parameter that is not sharded, casting to its dtype.

    Raises ValueError, writing nothing, when the shapes differ or the dtype cannot be cast.
    """
    problem = _safeguards.meta_problem("the parameter", param) or _fit_problem(param, loaded_weight)
    if problem is not None:
        raise ValueError(f"default_weight_loader: {problem}")
    with torch.no_grad():
        part = loaded_weight[...]
        if not isinstance(loaded_weight, LazyTensor) or not loaded_weight.copy_to(param.data, part):
            param.data.copy_(part)


def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, Weight]],
    stacked_params_mapping: Sequence[tuple[str, str, ShardId]] = (),
    *,
    rename: Rename = None,
    ignore: IgnorePattern | Iterable[IgnorePattern] = (),
    strict: bool = True,
    progress: bool | None = None,
    num_threads: int | None = None,
) -> set[str]:
    """Loads checkpoint tensors into ``model``'s parameters (and persistent buffers); returns the names
    (every alias of a tied parameter included) of what was loaded.

    - ``weights``: ``(name, tensor)`` pairs, typically :func:`iter_weights`; lazy handles or tensors.
    - ``stacked_params_mapping``: ``(param_name, checkpoint_name, loaded_shard_id)`` triples; a checkpoint
      name whose dotted components contain ``checkpoint_name`` loads into the parameter named with
      ``param_name`` in its place, through ``param.weight_loader(param, tensor, loaded_shard_id)``. The
      first triple whose result names a parameter wins; a name no triple places loads under its own name,
      through ``param.weight_loader(param, tensor)`` or :func:`default_weight_loader`.
    - ``rename``: applied to every checkpoint name first: a callable ``name -> new name`` (None drops the
      tensor), or a mapping of dotted component sequences, e.g. ``{"transformer.h": "model.layers"}``,
      each replacing every whole-component occurrence, in order (an empty value removes them).
    - ``ignore``: checkpoint tensors to skip, matched on the name as stored: a string is a dotted component
      sequence that must occur whole (``"rotary_emb.inv_freq"``), a compiled ``re.Pattern`` is searched in
      the name (``re.compile(r"\\.attn\\.(masked_)?bias$")``).
    - ``strict``: every parameter must be loaded (all shards of a stacked one) and every tensor used; all
      the exceptions are reported in one :class:`WeightsMismatchError`. A tied parameter (one Parameter
      under two names, e.g. ``lm_head.weight`` and the embedding) is loaded once, from whichever name the
      checkpoint has.
    - ``progress``: a tqdm bar over checkpoint files on rank 0; None shows it unless the environment
      sets ``TPKIT_DISABLE_PROGRESS=1``.
    - ``num_threads``: threads that run the weight loaders once everything is checked; None takes
      ``TPKIT_LOAD_THREADS`` from the environment, else 1 where every tensor goes into a GPU from a
      safetensors file with direct copies on (``TPKIT_LOAD_DMA``), otherwise up to 4 (fewer on machines
      with fewer CPUs). 1 runs them in the calling thread.

    Shapes, dtypes (values are cast to the parameter's dtype; a float tensor into an integer parameter and an
    integer or bool one into a float parameter are refused), targets on the meta device, duplicates, files
    cut short since their headers were read and, with ``strict``, names are all checked before the first
    parameter is written. A tied parameter's two names both in the checkpoint with different values untie
    it where its module can (``untie_weights``, tpkit's LM head; with a warning, as transformers does), and
    are an error elsewhere. A failure during the copies raises :class:`PartialLoadError`, saying how many
    tensors were written; values a cast turns into inf (float64 into float16) a CheckpointError naming them.
    For that, each ``weight_loader`` is first called with a meta-device shadow of its parameter (same
    shape, dtype and attributes) and a meta stand-in for the tensor: a loader must write only through its
    ``param`` argument, and report a misfit as ValueError (or a torch shape error) there.
    Logs, on logger ``tpkit.loaders``, the bytes this rank read, the time and the throughput.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"load_weights: model must be a torch.nn.Module, received {type(model).__name__}")
    num_threads = _num_threads(num_threads)
    mapping = _parse_mapping(stacked_params_mapping)
    renamer = _parse_rename(rename)
    is_ignored = _parse_ignore(ignore)
    entries = []
    for position, entry in enumerate(weights):
        checkpoint_name, weight = _check_entry(position, entry)
        if is_ignored(checkpoint_name):
            continue
        name = renamer(checkpoint_name)
        if name is not None:
            entries.append((checkpoint_name, name, weight))
    plan = _Plan.of(model, mapping, entries)
    missing = [_safeguards.tie_hint(model, name) for name in plan.missing()]
    if plan.problems or (strict and (missing or plan.unexpected)):
        raise WeightsMismatchError(plan.problems, missing if strict else [],
                                   plan.unexpected if strict else [])
    if _safeguards.untie_differing_copies(model, plan.tied_copies):
        plan = _Plan.of(model, mapping, entries)
        if plan.problems:
            raise WeightsMismatchError(plan.problems, [], [])
    _safeguards.check_files_unchanged(load.weight for load in plan.loads)
    _execute(plan.loads, _show_progress(progress), num_threads or _default_num_threads(plan.loads))
    return {alias for load in plan.loads for alias in load.target.aliases}


@dataclass(eq=False)
class _Target:
    tensor: torch.Tensor
    is_param: bool
    aliases: list[str] = field(default_factory=list)  # every name of this tensor; the first is canonical


@dataclass
class _Load:
    checkpoint_name: str
    name: str
    shard: ShardId
    target: _Target
    weight: Weight

    @property
    def file(self) -> Path | None:
        return self.weight.file

    def describe(self) -> str:
        shard = "" if self.shard is None else f" (shard {self.shard!r})"
        renamed = "" if self.name == self.checkpoint_name else f" -> {self.name}"
        return f"{self.checkpoint_name}{renamed}{shard}"


class _Plan:
    """The pairs of checkpoint tensor and parameter, and what does not pair up."""

    def __init__(self, targets: dict[str, _Target], mapping: list[tuple[_Components, _Components, ShardId]]):
        self.targets = targets
        self.mapping = mapping
        self.loads: list[_Load] = []
        self.problems: list[str] = []
        self.unexpected: list[str] = []
        self.tied_copies: list[tuple[_Load, _Load]] = []  # (a second name's load, the one placed)
        self._placed: dict[int, dict[ShardId, _Load]] = {}

    @classmethod
    def of(cls, model: nn.Module, mapping: list[tuple[_Components, _Components, ShardId]],
           entries: list[tuple[str, str, Weight]]) -> _Plan:
        """The plan of ``(checkpoint_name, renamed, weight)`` entries into ``model`` as it is now."""
        plan = cls(_targets(model), mapping)
        for checkpoint_name, name, weight in entries:
            plan.add(checkpoint_name, name, weight)
        return plan

    def add(self, checkpoint_name: str, name: str, weight: Weight) -> None:
        found = self._match(name)
        if found is None:
            self.unexpected.append(checkpoint_name)
            return
        target_name, shard = found
        load = _Load(checkpoint_name, target_name, shard, self.targets[target_name], weight)
        placed = self._placed.setdefault(id(load.target), {})
        if placed and all(p.name != target_name for p in placed.values()):
            # Another name of the same tied parameter was already loaded: this copy adds nothing if it holds
            # the same values (compared before anything is copied).
            self.tied_copies.append((load, next(iter(placed.values()))))
            return
        if placed and (shard in placed or shard is None or None in placed):
            earlier = placed.get(shard) or next(iter(placed.values()))
            self.problems.append(f"{load.describe()}: {target_name} is already loaded from "
                                 f"{earlier.describe()}")
            return
        problem = _pair_problem(load)
        if problem is not None:
            self.problems.append(f"{load.describe()}: {problem}")
            return
        placed[shard] = load
        self.loads.append(load)

    def _match(self, name: str) -> tuple[str, ShardId] | None:
        components = _components(name)
        for param_part, checkpoint_part, shard in self.mapping:
            replaced = _replace(components, checkpoint_part, param_part)
            if replaced is not None and ".".join(replaced) in self.targets:
                return ".".join(replaced), shard
        return (name, None) if name in self.targets else None

    def missing(self) -> list[str]:
        missing = []
        seen: set[int] = set()
        for target in self.targets.values():
            if not target.is_param or id(target) in seen:
                continue
            seen.add(id(target))
            placed = self._placed.get(id(target), {})
            name = target.aliases[0]
            if not placed:
                missing.append(name)
            elif None not in placed:
                expected = {shard for param_part, _, shard in self.mapping if shard is not None
                            and any(_contains(_components(alias), param_part) for alias in target.aliases)}
                absent = expected - set(placed)
                if absent:
                    missing.append(f"{name} (shards not loaded: {', '.join(sorted(map(repr, absent)))})")
        return missing


def _pair_problem(load: _Load) -> str | None:
    """Why ``load.weight`` cannot go into its parameter, found without reading or writing any data."""
    param = load.target.tensor
    meta = _safeguards.meta_problem(load.name, param)
    if meta is not None:
        return meta
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        if load.shard is not None:
            return (f"{load.name} has no weight_loader to place loaded_shard_id {load.shard!r}; "
                    "stacked parameters need one")
        return _fit_problem(param, load.weight)
    cast = _safeguards.cast_problem(load.weight.dtype, param.dtype)
    if cast is not None:
        return cast
    shadow = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=False)  # [param.shape]
    shadow.__dict__.update(param.__dict__)
    stand_in = _MetaTensor(load.checkpoint_name, tuple(load.weight.shape), load.weight.dtype, None)
    try:
        with torch.no_grad():
            _call_loader(loader, shadow, stand_in, load.shard)
    except NotImplementedError:
        # The loader needs real values (meta tensors have none) to decide: the real call still checks.
        return None
    except RuntimeError as error:
        return None if _NEEDS_DATA.search(str(error)) else str(error)
    except (ValueError, TypeError, IndexError) as error:
        return str(error)
    return None


def _fit_problem(param: torch.Tensor, weight: Weight) -> str | None:
    if tuple(weight.shape) != tuple(param.shape):
        return f"expected shape {tuple(param.shape)}, received {tuple(weight.shape)}"
    return _safeguards.cast_problem(weight.dtype, param.dtype)


def _call_loader(loader: Callable, param: torch.Tensor, weight: Weight, shard: ShardId) -> None:
    if shard is None:
        loader(param, weight)
    else:
        loader(param, weight, shard)


def _execute(loads: list[_Load], show_progress: bool, num_threads: int) -> None:
    files = list(dict.fromkeys(load.file for load in loads if load.file is not None))
    start, read_before = time.perf_counter(), bytes_read()
    done: list[tuple[list[_Load], torch.Tensor | None]] = []  # each parameter's loads and overflow flag
    try:
        with (tqdm(total=len(files), unit="file", desc="Loading checkpoint",
                   disable=not show_progress) as bar,
              _direct_copy.DirectCopies() as direct_copies, ThreadPoolExecutor(num_threads) as pool):
            caller = _CallerState.capture(loads, direct_copies)
            previous_file = None
            for file, group in itertools.groupby(loads, key=lambda load: load.file):
                by_target: dict[int, list[_Load]] = {}
                for load in group:
                    by_target.setdefault(id(load.target), []).append(load)
                if num_threads == 1:
                    for target_loads in by_target.values():
                        done.append((target_loads, _run_loads(target_loads, caller)))
                else:
                    futures = [(target_loads, pool.submit(_run_loads, target_loads, caller))
                               for target_loads in by_target.values()]
                    wait([future for _, future in futures])  # every task of the file ends before a failure
                    done.extend((target_loads, future.result()) for target_loads, future in futures
                                if future.exception() is None)
                    for _, future in futures:
                        future.result()
                if file is not None:
                    # The file before is released only now, so that its last copies to a GPU overlap this
                    # file's first ones.
                    if previous_file is not None:
                        direct_copies.release(previous_file)
                    previous_file = file
                    bar.update(1)
    except Exception as error:
        raise PartialLoadError(sum(len(written) for written, _ in done), len(loads), error) from error
    except BaseException as error:  # KeyboardInterrupt and the like go on as they are, with the count
        error.add_note(f"load_weights stopped after writing {sum(len(written) for written, _ in done)} of "
                       f"{len(loads)} checkpoint tensors: the model is partially loaded")
        raise
    _safeguards.check_overflow(done)
    seconds = time.perf_counter() - start
    nbytes = bytes_read() - read_before
    logger.info("rank %d: loaded %d tensors from %d files (%d thread(s)): %.3f GB read in %.2f s (%.2f GB/s)",
                _rank(), len(loads), len(files), num_threads, nbytes / 1e9, seconds,
                nbytes / 1e9 / max(seconds, 1e-9))


@dataclass(frozen=True)
class _CallerState:
    """The calling thread's state that its loads must run under on a worker thread (where it is
    thread-local): inference mode (parameters made in it can only be written in it), and per GPU the
    current stream (so the copies are ordered before what the caller queues next); and the loading's
    direct copies from files (:mod:`._direct_copy`), which the handles' ``copy_to`` finds per thread."""

    inference_mode: bool
    streams: dict[torch.device, torch.cuda.Stream]
    direct_copies: _direct_copy.DirectCopies

    @staticmethod
    def capture(loads: list[_Load], direct_copies: _direct_copy.DirectCopies) -> _CallerState:
        devices = {load.target.tensor.device for load in loads if load.target.tensor.device.type == "cuda"}
        return _CallerState(torch.is_inference_mode_enabled(),
                            {device: torch.cuda.current_stream(device) for device in devices}, direct_copies)


def _run_loads(loads: list[_Load], caller: _CallerState) -> torch.Tensor | None:
    """One parameter's loads, in order, under the caller's state; where a cast narrows, a flag (a bool
    tensor on the parameter's device) of whether the parameter now holds inf."""
    device = loads[0].target.tensor.device
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.inference_mode(caller.inference_mode))
        stack.enter_context(torch.no_grad())
        stack.enter_context(_direct_copy.loading(caller.direct_copies))
        if device.type == "cuda":
            # A thread starts on GPU 0: loaders that allocate on the current device find the parameter's.
            stack.enter_context(torch.cuda.device(device))
            stack.enter_context(torch.cuda.stream(caller.streams[device]))
        for load in loads:
            loader = getattr(load.target.tensor, "weight_loader", None) or default_weight_loader
            _call_loader(loader, load.target.tensor, load.weight, load.shard)
        param = loads[0].target.tensor
        if any(_safeguards.narrows(load.weight.dtype, param.dtype) for load in loads):
            return torch.isinf(param).any()  # on the parameter's device, after its copies
    return None


def _num_threads(num_threads: int | None) -> int | None:
    """The number asked for (argument, else environment), checked; None where neither asks."""
    if num_threads is None:
        text = os.environ.get("TPKIT_LOAD_THREADS", "").strip()
        if not text:
            return None
        try:
            num_threads = int(text)
        except ValueError:
            raise ValueError(f"TPKIT_LOAD_THREADS: expected a positive integer, got {text!r}") from None
        what = "TPKIT_LOAD_THREADS"
    else:
        what = "load_weights: num_threads"
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"{what}: expected a positive integer, got {num_threads!r}")
    return num_threads


def _default_num_threads(loads: list[_Load]) -> int:
    """1 where every tensor goes into a GPU straight from its file (``._direct_copy``; safetensors handles,
    direct copies on): the CPU then copies nothing, and more threads only contend for the GIL and the
    process's memory map, so that a load on more threads is slower. Otherwise up to 4: the CPU copies, and
    copies release the GIL."""
    if loads and _direct_copy.enabled() and all(
            load.target.tensor.device.type == "cuda" and getattr(load.weight, "copies_from_file", False)
            for load in loads):
        return 1
    return min(4, os.cpu_count() or 1)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _show_progress(progress: bool | None) -> bool:
    if progress is None:
        progress = not env_flag("TPKIT_DISABLE_PROGRESS", False)
    return progress and _rank() == 0


def _targets(model: nn.Module) -> dict[str, _Target]:
    """Every parameter and persistent buffer by each of its names; tied ones share one target."""
    named: list[tuple[str, torch.Tensor, bool]] = [
        (name, param, True) for name, param in model.named_parameters(remove_duplicate=False)]
    for module_name, module in model.named_modules(remove_duplicate=False):
        for buffer_name, buffer in module._buffers.items():
            if buffer is not None and buffer_name not in module._non_persistent_buffers_set:
                named.append((f"{module_name}.{buffer_name}" if module_name else buffer_name, buffer, False))
    by_storage: dict[object, _Target] = {}
    targets: dict[str, _Target] = {}
    for name, tensor, is_param in named:
        target = by_storage.setdefault(_storage_key(tensor), _Target(tensor, is_param))
        if name not in target.aliases:
            target.aliases.append(name)
        targets[name] = target
    return targets


def _storage_key(tensor: torch.Tensor) -> object:
    """Equal for tensors that are the same memory (tied weights), whether or not the same object."""
    if tensor.device.type == "meta" or tensor.numel() == 0:
        return id(tensor)
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
            tensor.stride(), tensor.dtype, tensor.device)


def _components(name: str) -> _Components:
    stripped = name.strip(".")
    return tuple(stripped.split(".")) if stripped else ()


def _contains(components: _Components, part: _Components) -> bool:
    n = len(part)
    return any(components[i:i + n] == part for i in range(len(components) - n + 1))


def _replace(components: _Components, old: _Components, new: _Components) -> _Components | None:
    """``components`` with every whole occurrence of ``old`` replaced by ``new``; None when none occurs."""
    out: list[str] = []
    i, n, found = 0, len(old), False
    while i < len(components):
        if components[i:i + n] == old:
            out.extend(new)
            i += n
            found = True
        else:
            out.append(components[i])
            i += 1
    return tuple(out) if found else None


def _parse_mapping(stacked_params_mapping: Sequence[tuple[str, str, ShardId]]
                   ) -> list[tuple[_Components, _Components, ShardId]]:
    parsed = []
    for i, entry in enumerate(stacked_params_mapping):
        if not (isinstance(entry, (tuple, list)) and len(entry) == 3
                and all(isinstance(part, str) and _components(part) for part in entry[:2])
                and (entry[2] is None or isinstance(entry[2], str)
                     or (isinstance(entry[2], int) and not isinstance(entry[2], bool)))):
            raise ValueError(f"stacked_params_mapping[{i}]: expected (param_name: str, checkpoint_name: str, "
                             f"loaded_shard_id: str | int | None), received {entry!r}")
        parsed.append((_components(entry[0]), _components(entry[1]), entry[2]))
    return parsed


def _parse_rename(rename: Rename) -> Callable[[str], str | None]:
    if rename is None:
        return lambda name: name
    if isinstance(rename, Mapping):
        pairs = []
        for old, new in rename.items():
            if not (isinstance(old, str) and _components(old) and isinstance(new, str)):
                raise TypeError(f"rename: expected a mapping of non-empty dotted names to dotted names, "
                                f"received the entry {old!r}: {new!r}")
            pairs.append((_components(old), _components(new)))

        def apply(name: str) -> str:
            components = _components(name)
            for old, new in pairs:
                components = _replace(components, old, new) or components
            return ".".join(components)

        return apply
    if callable(rename):
        def checked(name: str) -> str | None:
            new = rename(name)
            if new is not None and not isinstance(new, str):
                raise TypeError(f"rename({name!r}) must return a str or None, returned {type(new).__name__}")
            return new

        return checked
    raise TypeError(f"rename: expected a callable, a mapping or None, received {type(rename).__name__}")


def _parse_ignore(ignore: IgnorePattern | Iterable[IgnorePattern]) -> Callable[[str], bool]:
    patterns = [ignore] if isinstance(ignore, (str, re.Pattern)) else list(ignore)
    parts: list[_Components] = []
    regexes: list[re.Pattern] = []
    for pattern in patterns:
        if isinstance(pattern, re.Pattern):
            regexes.append(pattern)
        elif isinstance(pattern, str) and _components(pattern):
            parts.append(_components(pattern))
        else:
            raise TypeError(f"ignore: expected dotted names (str) or compiled regexes (re.Pattern), "
                            f"received {pattern!r}")
    return lambda name: (any(_contains(_components(name), part) for part in parts)
                         or any(regex.search(name) for regex in regexes))


def _check_entry(position: int, entry: object) -> tuple[str, Weight]:
    if not (isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str)
            and isinstance(entry[1], (LazyTensor, torch.Tensor))):
        raise TypeError(f"weights[{position}]: expected a (name: str, tensor or LazyTensor) pair, received "
                        f"{type(entry).__name__}")
    name, weight = entry
    # A tensor as a handle too: the weight loaders then copy every weight the handles' way (copy_to).
    return name, weight if isinstance(weight, LazyTensor) else _GivenTensor(name, weight, None)
