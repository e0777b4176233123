"""The memory a device has free now, so that a size can be refused by name before an allocation that would
fail without naming it (or, on Linux, succeed lazily and then have the process killed as it is filled)."""

from __future__ import annotations

import os

import torch


def available_bytes(device: torch.device) -> int | None:
    """Free memory of ``device``: the CPU's available memory (Linux's MemAvailable, else the free pages), a
    GPU's free memory and what torch's caching allocator holds unused; None where it cannot be told (other
    devices, the meta device)."""
    if device.type == "cuda":
        # The memory torch's caching allocator holds but no tensor uses is free to this process's tensors.
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + cached
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
