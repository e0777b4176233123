"""The kernels' build for a CUDA device: found once per compute capability, and once looked up per device
index, so that an op's call does not ask torch for the device's capability again."""

from __future__ import annotations

import torch

from tpkit.ops import _extension


def test_each_device_asks_for_its_capability_once(monkeypatch):
    capabilities = {0: (9, 0), 1: (8, 0), 2: (9, 0)}
    asked, found = [], []
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda index: asked.append(index) or capabilities[index])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(_extension, "_find_module", lambda capability: found.append(capability) or capability)
    monkeypatch.setattr(_extension, "_modules", {})
    monkeypatch.setattr(_extension, "_device_modules", {})
    for _ in range(3):
        assert _extension._module_for(torch.device("cuda", 0)) == (9, 0)
        assert _extension._module_for(torch.device("cuda", 1)) == (8, 0)
        assert _extension._module_for(torch.device("cuda")) == (9, 0)  # the current device, index 2
    assert asked == [0, 1, 2]
    assert found == [(9, 0), (8, 0)]  # one build per capability, shared by devices 0 and 2
