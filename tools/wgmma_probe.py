"""Checks tpkit/csrc/common/wgmma.cuh on a Hopper GPU (sm_90a): S = Q K^T and O = bf16(S) V for one
64-row, 64-token, head-128 tile, through the shared-memory layout and descriptors the header documents,
against torch in float32. Prints the largest errors and exits non-zero when they are off.

    PYTHONPATH=. python3 tools/wgmma_probe.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

HERE = Path(__file__).resolve().parent
CSRC = HERE.parent / "tpkit" / "csrc" / "common"


def main() -> int:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("needs a Hopper GPU (sm_90)")
        return 2
    module = load("tpkit_wgmma_probe", [str(HERE / "wgmma_probe.cu")], extra_include_paths=[str(CSRC)],
                  extra_cuda_cflags=["-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a"])
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(64, 128, device="cuda", generator=generator).to(torch.bfloat16) for _ in range(3))
    s_out = torch.full((64, 64), float("nan"), device="cuda")
    o_out = torch.full((64, 128), float("nan"), device="cuda")
    module.probe(q, k, v, s_out, o_out)
    torch.cuda.synchronize()
    s_ref = q.float() @ k.float().T
    o_ref = s_out.to(torch.bfloat16).float() @ v.float()  # P exactly as the kernel rounded it
    s_err = ((s_out - s_ref).abs().max() / s_ref.abs().max()).item()
    o_err = ((o_out - o_ref).abs().max() / o_ref.abs().max()).item()
    print(f"S = Q K^T: max error {s_err:.2e} of max |S|;  O = P V: max error {o_err:.2e} of max |O|")
    if not (s_err < 1e-3 and o_err < 1e-2):
        # Which layout is off: S row/column of the worst error, and whether S matches a transposed K.
        worst = (s_out - s_ref).abs().argmax().item()
        print(f"worst S element at row {worst // 64}, column {worst % 64}; "
              f"S vs (Q K^T)^T error {((s_out - s_ref.T).abs().max() / s_ref.abs().max()).item():.2e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
