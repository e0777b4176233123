"""Decode-sized all-reduces over symmetric memory: one kernel that reads every peer's buffer.

A row-parallel layer's all-reduce at a decode step moves a few KB (``[batch, hidden]``), where NCCL's
fixed cost, not the bytes, sets its time. PyTorch's symmetric memory maps one buffer of every rank into
every rank's address space; its one-shot all-reduce copies the local input into this rank's buffer, waits
at a barrier of signal pads until every rank has done the same, and sums the peers' buffers over NVLink
into the output, one kernel in all, which a CUDA graph captures like any other.

:func:`one_shot_all_reduce` takes a bf16 or float32 CUDA tensor of at most :data:`ONE_SHOT_MAX_BYTES`
(its size a multiple of 4 bytes, its start aligned to the kernel's vectors) when every rank of
the group is on one host, each on a GPU of its own that can reach the others', and returns None otherwise,
for the caller's NCCL (or gloo) all-reduce. The group's buffer is made (a collective: every rank calls it
in the same order, as it calls the all-reduces) at the first such all-reduce outside a CUDA graph capture;
until then, and where making it failed, the caller's collective runs. ``TPKIT_SYMMETRIC_ALL_REDUCE=0``
turns it off. NVLink multicast stays off (``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` unless set): the one-shot
kernel does not use it, and on shared machines it can take a host's GPUs out of service.
"""

from __future__ import annotations

import os
import socket
import warnings
import weakref

import torch
import torch.distributed as dist

from tpkit._env import env_flag

from .state import _on_destroy

# The largest all-reduce taken by the one-shot kernel: a decode step's [batch, hidden] up to batch 32 at
# hidden 4096 in bf16. Larger messages go to NCCL, whose ring and tree move bytes at the links' rate.
ONE_SHOT_MAX_BYTES = 256 * 1024
_DTYPES = (torch.bfloat16, torch.float32)  # the kernel's

# Per process group (held weakly: a group made after another's destruction may take its name), per device
# index: the rank's symmetric buffer of ONE_SHOT_MAX_BYTES, or None where the group cannot have one (then
# it never tries again).
_buffers: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[int, torch.Tensor | None]] = (
    weakref.WeakKeyDictionary())


def one_shot_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor | None:
    """The sum of ``tensor`` (any shape, contiguous) over ``group`` in a new tensor of its shape, by the
    one-shot kernel; None where it does not apply (see the module's doc), for the caller's collective."""
    nbytes = tensor.numel() * tensor.element_size()
    if (tensor.device.type != "cuda" or tensor.dtype not in _DTYPES or not 0 < nbytes <= ONE_SHOT_MAX_BYTES
            or nbytes % 4 or not tensor.is_contiguous()):
        return None
    # The kernel moves vectors of the widest of 16, 8 or 4 bytes that divides the size, in the buffer (at
    # its start) and in the input alike: the input must start at such a boundary.
    vector = next(width for width in (16, 8, 4) if nbytes % width == 0)
    if tensor.data_ptr() % vector or tensor.storage_offset() * tensor.element_size() % vector:
        return None
    if not env_flag("TPKIT_SYMMETRIC_ALL_REDUCE", True):
        return None
    buffers = _buffers.setdefault(group, {})
    index = tensor.device.index
    if index not in buffers:
        if torch.cuda.is_current_stream_capturing():
            return None  # making the buffer synchronises the device, which a capture cannot
        with torch.cuda.device(tensor.device):  # where the object collectives' tensors go, as the group's
            buffers[index] = _make_buffer(group, tensor.device)
    buffer = buffers[index]
    if buffer is None:
        return None
    flat = buffer.view(tensor.dtype)[: tensor.numel()]
    return torch.ops.symm_mem.one_shot_all_reduce_copy(flat, tensor.view(-1), "sum", group.group_name
                                                       ).view(tensor.shape)


def _make_buffer(group: dist.ProcessGroup, device: torch.device) -> torch.Tensor | None:
    """This rank's symmetric buffer of the group, after every rank has agreed that it can have one: every
    rank on one host (peers reached through CUDA IPC), each on a GPU of its own that reaches every other's."""
    placement = (socket.gethostname(), device.index)
    placements: list[tuple[str, int] | None] = [None] * group.size()
    dist.all_gather_object(placements, placement, group=group)
    # Ranks sharing a GPU cannot map each other's buffers (the allocator refuses overlapping devices).
    others = [index for rank, (_, index) in enumerate(placements) if rank != group.rank()]
    reachable = (all(host == placement[0] for host, _ in placements) and device.index not in others
                 and all(torch.cuda.can_device_access_peer(device.index, index) for index in others))
    verdicts: list[bool | None] = [None] * group.size()
    dist.all_gather_object(verdicts, reachable, group=group)
    if not all(verdicts):
        return None
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    try:
        import torch.distributed._symmetric_memory as symm_mem

        torch.ops.symm_mem.one_shot_all_reduce_copy  # noqa: B018 - a build without the op raises here
        buffer = symm_mem.empty(ONE_SHOT_MAX_BYTES, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(buffer, group.group_name)
    except (ImportError, AttributeError, RuntimeError) as error:  # every rank alike: the same build, driver
        warnings.warn(f"tpkit: symmetric memory is not available ({error}); decode all-reduces run on "
                      f"{dist.get_backend(group)}", RuntimeWarning, stacklevel=4)
        return None
    return buffer


def _forget_buffers() -> None:
    _buffers.clear()


_on_destroy.append(_forget_buffers)
