"""Reading and checking a safetensors header, so a broken file fails before any tensor is handed out.

Layout: 8 bytes little-endian header length ``N``, ``N`` bytes of JSON (``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {...}}``), then the data; offsets count from the data start.
What the safetensors library refuses is refused here too: a name given twice, a shape or offset that is not
a non-negative integer (``true``, ``4.0``), ``__metadata__`` other than a string-to-string object, and data
that the tensors do not cover exactly, back to back from the data start to the end of the file.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import CheckpointError

# The safetensors library refuses larger headers too.
_MAX_HEADER_BYTES = 100_000_000

_DTYPES: dict[str, torch.dtype] = {
    name: dtype
    for name, dtype in {
        "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
        "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
        "BOOL": torch.bool, "C64": torch.complex64,
        "U16": getattr(torch, "uint16", None), "U32": getattr(torch, "uint32", None),
        "U64": getattr(torch, "uint64", None),
        "F8_E4M3": getattr(torch, "float8_e4m3fn", None), "F8_E5M2": getattr(torch, "float8_e5m2", None),
        "F8_E8M0": getattr(torch, "float8_e8m0fnu", None),
    }.items()
    if dtype is not None
}


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    data_start: int  # absolute offset in the file
    nbytes: int


def read_header(file: Path) -> list[TensorEntry]:
    """The tensors of ``file`` in storage order, after checking that every one lies inside the file."""
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{file}: not a safetensors file: {size} bytes, shorter than the "
                                      "8-byte header length")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > _MAX_HEADER_BYTES or 8 + header_len > size:
                raise CheckpointError(f"{file}: corrupt or truncated safetensors file: header length "
                                      f"{header_len} bytes does not fit in the file of {size} bytes")
            raw = f.read(header_len)
    except OSError as error:
        raise CheckpointError(f"{file}: cannot read safetensors file: {error}") from error
    try:
        header = json.loads(raw, object_pairs_hook=_unique_keys)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{file}: corrupt safetensors header (not JSON): {error}") from error
    except _DuplicateKey as duplicate:
        raise CheckpointError(f"{file}: corrupt safetensors header: {duplicate.args[0]!r} is given twice"
                              ) from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header: expected a JSON object, "
                              f"received {type(header).__name__}")
    metadata = header.get("__metadata__")
    if metadata is not None and not (isinstance(metadata, dict)
                                     and all(isinstance(v, str) for v in metadata.values())):
        raise CheckpointError(f"{file}: corrupt safetensors header: __metadata__: expected an object of "
                              f"strings, received {metadata!r}")
    data_start = 8 + header_len
    data_size = size - data_start
    entries = [_entry(file, name, info, data_start, data_size)
               for name, info in header.items() if name != "__metadata__"]
    entries.sort(key=lambda e: (e.data_start, e.nbytes))
    covered = data_start
    for entry in entries:
        if entry.data_start != covered:
            what = "overlaps the tensor before it" if entry.data_start < covered else "leaves a gap before it"
            raise CheckpointError(f"{file}: corrupt safetensors header: tensor {entry.name!r} starts at data "
                                  f"byte {entry.data_start - data_start}, where the tensors before end at "
                                  f"{covered - data_start}: it {what}")
        covered += entry.nbytes
    if covered != size:
        raise CheckpointError(f"{file}: corrupt safetensors file: its tensors end at data byte "
                              f"{covered - data_start}, the file holds {data_size} bytes of data")
    return entries


class _DuplicateKey(Exception):
    pass


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """A JSON object's pairs as a dict, refusing a key given twice (json keeps the last silently)."""
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKey(key)
        out[key] = value
    return out


def _is_index(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _entry(file: Path, name: str, info: object, data_start: int, data_size: int) -> TensorEntry:
    if not isinstance(info, dict):
        raise CheckpointError(f"{file}: corrupt safetensors header: entry {name!r} is not an object")
    dtype_name, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype_name not in _DTYPES:
        raise CheckpointError(f"{file}: tensor {name!r} has dtype {dtype_name!r}; supported: "
                              f"{', '.join(sorted(_DTYPES))}")
    if not (isinstance(shape, list) and all(_is_index(d) for d in shape)):
        raise CheckpointError(f"{file}: corrupt safetensors header: tensor {name!r}: expected a shape of "
                              f"non-negative ints, received {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_index(o) for o in offsets)
            and offsets[0] <= offsets[1]):
        raise CheckpointError(f"{file}: corrupt safetensors header: tensor {name!r}: expected data_offsets "
                              f"[begin, end] of ints, 0 <= begin <= end, received {offsets!r}")
    dtype = _DTYPES[dtype_name]
    begin, end = offsets
    nbytes = math.prod(shape) * dtype.itemsize
    if end - begin != nbytes:
        raise CheckpointError(f"{file}: corrupt safetensors header: tensor {name!r} ({dtype_name}, shape "
                              f"{tuple(shape)}) needs {nbytes} bytes, its data_offsets span {end - begin}")
    if end > data_size:
        raise CheckpointError(f"{file}: truncated safetensors file: tensor {name!r} ends at data byte {end}, "
                              f"the file holds {data_size} bytes of data")
    return TensorEntry(name, dtype, tuple(shape), data_start + begin, nbytes)
