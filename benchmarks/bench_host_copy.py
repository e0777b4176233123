"""The host side of loading a checkpoint into a GPU: how fast a warm file's bytes reach a GPU (GPU machine).

    python3 benchmarks/bench_host_copy.py copy        # into an 8 MiB page-locked buffer, 1/4/8 threads
    python3 benchmarks/bench_host_copy.py register    # DMA straight from the page cache, page-locked in place

``copy``: each thread moves its share of the file into its own page-locked buffer, 8 MiB at a time, the way
tpkit's staged copies fill their buffers: from a private map (``map``, as tpkit's lazy handles read), from
a private map populated first (``populate``, ``MADV_POPULATE_READ``), or with ``preadv`` (no map). Every
method and thread count in a fresh process, so no page tables carry over; the page cache is warm.

``register``: the file mapped shared and read-only, page-locked in place in pieces
(``cudaHostRegister`` with ``cudaHostRegisterReadOnly``), each piece's copy to the GPU queued once it is
registered; the times of registering, of registering and copying together, and of unregistering.
``--private`` also tries a private (copy-on-write) map, in a child process given 60 s.
"""

from __future__ import annotations

import argparse
import mmap
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

CHUNK = 8 << 20
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14; Python 3.12 names it
CUDA_HOST_REGISTER_READ_ONLY = 8


def _make_file(path: str, size: int) -> None:
    if not os.path.exists(path) or os.path.getsize(path) != size:
        with open(path, "wb") as f:
            for _ in range(size // (64 << 20)):
                f.write(os.urandom(64 << 20))
    subprocess.run(["cat", path], stdout=subprocess.DEVNULL, check=True)  # warm page cache


def _fill(path: str, method: str, lo: int, hi: int) -> None:
    """Moves bytes [lo, hi) of the file through one page-locked buffer of CHUNK bytes."""
    buffer = torch.empty(CHUNK, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    view = memoryview(buffer.numpy())
    fd = os.open(path, os.O_RDONLY)
    try:
        if method == "preadv":
            for offset in range(lo, hi, CHUNK):
                os.preadv(fd, [view[:min(CHUNK, hi - offset)]], offset)
            return
        mapped = mmap.mmap(fd, hi - lo, access=mmap.ACCESS_COPY, offset=lo)
        if method == "populate":
            mapped.madvise(MADV_POPULATE_READ)
        source = torch.frombuffer(mapped, dtype=torch.uint8)  # [hi - lo]
        for offset in range(0, hi - lo, CHUNK):
            n = min(CHUNK, hi - lo - offset)
            buffer[:n].copy_(source[offset:offset + n])
    finally:
        os.close(fd)


def _copy_once(path: str, size: int, method: str, threads: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.init()
    share = size // threads
    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda i: _fill(path, method, i * share, (i + 1) * share), range(threads)))
    seconds = time.perf_counter() - start
    print(f"{method:<9} threads {threads:>2}: {seconds * 1e3:7.1f} ms  {size / seconds / 1e9:5.2f} GB/s",
          flush=True)


def _register(path: str, size: int, piece_mib: int, access: int) -> None:
    cudart = torch.cuda.cudart()
    dst = torch.empty(size, dtype=torch.uint8, device="cuda")  # [size]
    fd = os.open(path, os.O_RDONLY)
    mapped = mmap.mmap(fd, size, access=access)
    os.close(fd)
    host = np.frombuffer(mapped, dtype=np.uint8)  # [size], read-only where the map is
    base = host.ctypes.data
    piece = piece_mib << 20
    torch.cuda.synchronize()
    registering = 0.0
    start = time.perf_counter()
    for offset in range(0, size, piece):
        t = time.perf_counter()
        error = cudart.cudaHostRegister(base + offset, piece, CUDA_HOST_REGISTER_READ_ONLY)
        registering += time.perf_counter() - t
        if int(error) != 0:
            raise RuntimeError(f"cudaHostRegister: {cudart.cudaGetErrorString(error)}")
        dst[offset:offset + piece].copy_(torch.from_numpy(host[offset:offset + piece]), non_blocking=True)
    torch.cuda.synchronize()
    copied = time.perf_counter()
    for offset in range(0, size, piece):
        cudart.cudaHostUnregister(base + offset)
    unregistered = time.perf_counter()
    equal = torch.equal(dst[::4099].cpu(), torch.from_numpy(host[::4099].copy()))
    print(f"pieces {piece_mib:>5} MiB: register {registering * 1e3:6.1f} ms, register + copy "
          f"{(copied - start) * 1e3:6.1f} ms ({size / (copied - start) / 1e9:5.2f} GB/s), unregister "
          f"{(unregistered - copied) * 1e3:5.1f} ms, bytes equal: {equal}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("copy", "register"))
    parser.add_argument("--path", default="/tmp/tpkit_host_copy.bin")
    parser.add_argument("--size-mib", type=int, default=2048)
    parser.add_argument("--private", action="store_true", help="register: also try a private map")
    # One measurement in this process: copy METHOD THREADS, or register PIECE_MIB MMAP_ACCESS.
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    size = args.size_mib << 20
    if args.child:
        if args.what == "copy":
            _copy_once(args.path, size, args.child[0], int(args.child[1]))
        else:
            _register(args.path, size, int(args.child[0]), int(args.child[1]))
        return
    _make_file(args.path, size)
    print(subprocess.run(["stat", "-f", "-c", "%T", os.path.dirname(args.path)], capture_output=True,
                         text=True).stdout.strip(), os.uname().release, f"{os.cpu_count()} CPUs", flush=True)
    if args.what == "copy":
        runs = [(method, str(threads)) for threads in (1, 4, 8) for method in ("map", "populate", "preadv")]
    else:
        runs = [(str(piece), str(mmap.ACCESS_READ)) for piece in (2048, 256, 64)]
        if args.private:
            runs.append(("256", str(mmap.ACCESS_COPY)))
    for child in runs:
        command = [sys.executable, __file__, args.what, "--path", args.path, "--size-mib", str(args.size_mib),
                   "--child", *child]
        try:
            subprocess.run(command, check=False, timeout=60)
        except subprocess.TimeoutExpired:
            print(f"{' '.join(child)}: no result within 60 s", flush=True)


if __name__ == "__main__":
    main()
