"""Argument checks the op families share: each raises naming the op, the argument, what was expected and
what was received, and reads no device memory."""

from __future__ import annotations

import torch

from tpkit._env import env_flag

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The float8 dtypes a KV cache (with float32 scales) and a quantized weight may hold.
_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_HALF_DTYPES = (torch.float16, torch.bfloat16)  # what the decode linear and element-wise kernels take


def _debug_enabled() -> bool:
    """``TPKIT_DEBUG=1``: the ops also check the values of their index tensors (a host synchronisation)."""
    return env_flag("TPKIT_DEBUG", False)


def _check_tensor(op: str, name: str, tensor: object, *, dim: int, dtypes: tuple[torch.dtype, ...]) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: {name}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != dim:
        raise ValueError(f"{op}: {name}: expected {dim} dimensions, got shape {list(tensor.shape)}")
    if tensor.dtype not in dtypes:
        expected = dtypes[0] if len(dtypes) == 1 else f"one of {list(dtypes)}"
        raise TypeError(f"{op}: {name}: expected dtype {expected}, got {tensor.dtype}")
    # Kernels read the innermost dimension with vector loads; other strides are passed to them.
    if tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{op}: {name}: expected a contiguous last dimension (stride 1), got strides "
                         f"{list(tensor.stride())}")


def _check_same(op: str, name: str, what: str, expected: object, got: object) -> None:
    if expected != got:
        raise ValueError(f"{op}: {name}: expected {what} {expected}, got {got}")


def _check_devices(op: str, reference_name: str, reference: torch.Tensor, **tensors: torch.Tensor) -> None:
    for name, tensor in tensors.items():
        if tensor.device != reference.device:
            raise ValueError(f"{op}: {name}: expected device {reference.device} (the device of "
                             f"{reference_name}), got {tensor.device}")


def _num_rows(input: torch.Tensor) -> int:
    """The rows of ``input`` ``[..., features]``: its leading dimensions flattened."""
    return input.numel() // input.shape[-1] if input.shape[-1] else 0


def _check_row_sums(op: str, name: str, input: torch.Tensor, sums: torch.Tensor | None) -> None:
    """``sums`` (argument ``name`` of ``op``; None passes) must be float64 [num_rows], one sum a row of
    ``input``: the rows' sums of squares of an RMSNorm split across two products."""
    if sums is None:
        return
    rows = _num_rows(input)
    if sums.shape != (rows,) or sums.dtype != torch.float64:
        raise ValueError(f"{op}: {name}: expected float64 [{rows}] (one sum a row of input), got "
                         f"{sums.dtype} {tuple(sums.shape)}")
