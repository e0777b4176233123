"""Compile check of the torch-free CUDA kernel sources, for CI machines that have nvcc but no GPU.

``python -m tpkit.ops.build_check`` compiles every ``csrc/*/*.cu`` (everything but the torch binding)
for sm_80 and sm_90a (the JIT build's targets) into object files in a temporary directory, with the
flags the JIT build uses plus the half-precision macros torch's build defines, and ``-Xptxas -v``. It
prints one line per kernel with registers and spills, and exits non-zero on any compiler error (or, with
``--no-spills``, on any spill).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tpkit.ops._extension import arch_flags

_CSRC = Path(__file__).resolve().parent.parent / "csrc"
_CAPABILITIES = ((8, 0), (9, 0))
# torch.utils.cpp_extension adds these to every nvcc command; the kernels must compile with them.
_TORCH_NVCC_DEFINES = (
    "-D__CUDA_NO_HALF_OPERATORS__",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-D__CUDA_NO_HALF2_OPERATORS__",
    "--expt-relaxed-constexpr",
)
_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(sm_\w+)'")
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")


def _nvcc() -> str | None:
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").is_file():
        return str(Path(cuda_home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def _target(capability: tuple[int, int]) -> str:
    """The compiled target's name, as ptxas prints it (sm_80, sm_90a)."""
    return arch_flags(capability)[0].rsplit("code=", 1)[1]


def _compile(nvcc: str, source: Path, capability: tuple[int, int],
             out_dir: Path) -> subprocess.CompletedProcess[str]:
    obj = out_dir / f"{source.stem}.{_target(capability)}.o"
    cmd = [nvcc, "-std=c++17", "-O3", *_TORCH_NVCC_DEFINES, *arch_flags(capability),
           "-Xptxas", "-v", f"-I{_CSRC}", "-c", str(source), "-o", str(obj)]
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


def _kernel_report(ptxas_log: str) -> list[tuple[str, str, int, int]]:
    """(kernel, arch, registers, spill bytes) per compiled entry function, from ``-Xptxas -v`` output."""
    rows = []
    current: tuple[str, str] | None = None
    spills = 0
    for line in ptxas_log.splitlines():
        if (m := _ENTRY.search(line)) is not None:
            current = (m.group(1), m.group(2))
        elif (m := _SPILLS.search(line)) is not None:
            spills = int(m.group(2)) + int(m.group(3))
        elif (m := _REGS.search(line)) is not None and current is not None:
            rows.append((current[0], current[1], int(m.group(1)), spills))
            current = None
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--no-spills", action="store_true", help="fail when a kernel spills registers")
    args = parser.parse_args(argv)
    nvcc = _nvcc()
    if nvcc is None:
        print("build_check: nvcc not found (set CUDA_HOME or put nvcc on PATH)", file=sys.stderr)
        return 2
    sources = sorted(_CSRC.glob("*/*.cu"))
    jobs = [(source, capability) for source in sources for capability in _CAPABILITIES]
    with tempfile.TemporaryDirectory(prefix="tpkit_build_check_") as tmp, \
            ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        results = list(pool.map(lambda job: _compile(nvcc, job[0], job[1], Path(tmp)), jobs))
    failed = 0
    spilled = 0
    for (source, capability), result in zip(jobs, results, strict=True):
        if result.returncode != 0:
            failed += 1
            print(f"FAILED {source.name} {_target(capability)}:\n{result.stdout}{result.stderr}",
                  file=sys.stderr)
            continue
        for kernel, kernel_arch, registers, spill_bytes in _kernel_report(result.stderr):
            spilled += spill_bytes > 0
            flag = f"  SPILLS {spill_bytes} bytes" if spill_bytes else ""
            print(f"{kernel_arch} {registers:4d} registers  {kernel}{flag}")
    print(f"build_check: {len(jobs) - failed}/{len(jobs)} compiled ({', '.join(s.name for s in sources)} for "
          f"{', '.join(_target(c) for c in _CAPABILITIES)}), {spilled} kernel(s) with spills")
    if failed or (args.no_spills and spilled):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
