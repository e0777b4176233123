"""What a failed collective says: which collective, in which layer, on which rank of how many.

A backend's own message (gloo's "Connection closed by peer [127.0.0.1]:28063", "Timed out waiting 10000ms
for recv operation") names neither the tensor-parallel rank nor the layer. Every collective of tpkit goes
through :func:`collective_failed` when the backend raises, which adds both: the layer is the innermost
``nn.Module`` whose ``forward`` is on the calling stack, named by its path in the outermost one (the
model), found only on this error path. A backward pass runs on autograd's threads, with no module on the
stack: its failure names the collective only. NCCL reports failures asynchronously (its watchdog aborts the
process), so this is what CPU (gloo) runs see.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch import nn

# What a backend's message means for the peers, by a phrase it contains.
_HINTS = (
    ("Connection closed by peer", "a peer rank exited or crashed"),
    ("Connection reset by peer", "a peer rank exited or crashed"),
    ("Timed out", "a peer rank did not join this collective within the group's timeout: it failed, hangs, or "
                  "runs a different step (every rank must run the same collectives in the same order)"),
)


def collective_failed(op: str, group: dist.ProcessGroup | None, tensor: torch.Tensor | None,
                      error: BaseException) -> RuntimeError:
    """The RuntimeError to raise (``from error``) where collective ``op`` on ``group`` failed with
    ``error``."""
    try:
        rank, size, backend = dist.get_rank(group), dist.get_world_size(group), dist.get_backend(group)
        where = f"tp rank {rank} of {size} ({backend}, global rank {dist.get_rank()})"
    except (RuntimeError, ValueError):  # the group itself is gone
        where = "a destroyed process group"
    layer = _calling_layer()
    in_layer = f" in {layer}" if layer else ""
    of = "" if tensor is None else f" of a {tensor.dtype} tensor of shape {list(tensor.shape)}"
    text = str(error)
    hint = next((f" ({meaning})" for phrase, meaning in _HINTS if phrase in text), "")
    return RuntimeError(f"tensor-parallel {op}{of}{in_layer} failed on {where}{hint}: {text}")


def _calling_layer() -> str | None:
    """``path (Class)`` of the innermost module on the calling stack, its path within the outermost one."""
    inner = outer = None
    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, nn.Module):
            inner = inner or owner
            outer = owner
        frame = frame.f_back
    if inner is None:
        return None
    path = next((name for name, module in outer.named_modules() if module is inner), "")
    return f"{path} ({type(inner).__name__})" if path else type(inner).__name__
