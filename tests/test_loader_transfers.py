"""tpkit.loaders' copies into GPUs: page-locked staging buffers and direct copies from the page cache (the
GPU cases skip without a GPU; the CPU ones check the chunking and the routing)."""

from __future__ import annotations

import itertools
import math
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from tpkit.loaders import (
    _direct_copy,
    _staging,
    iter_weights,
    load_weights,
)
from tpkit.parallel_layers import ColumnParallelLinear, RowParallelLinear, TPGroup, _loading

# tp_size 1 without init_tensor_parallel, also under torchrun (where torch.distributed is initialised).
SINGLE = TPGroup(None, 0, 1)


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


# --- copies into GPUs through page-locked buffers ---------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_pinned_chunk_plan_cuts_rows_and_rows_too_large():
    assert _staging._plan_chunks((10, 4), 4, 48) == [((), 0, 3), ((), 3, 3), ((), 6, 3), ((), 9, 1)]
    assert _staging._plan_chunks((10,), 2, 8) == [((), 0, 4), ((), 4, 4), ((), 8, 2)]  # 1-D: by elements
    assert _staging._plan_chunks((3, 4), 4, 1000) == [((), 0, 3)]
    assert _staging._plan_chunks((3,), 8, 4) == [((), 0, 1), ((), 1, 1), ((), 2, 1)]  # an element at least
    # A row of 80 bytes over a chunk of 40: each row is cut along its own first dimension.
    assert _staging._plan_chunks((2, 5, 4), 4, 40) == [((row,), start, length) for row in range(2)
                                                       for start, length in ((0, 2), (2, 2), (4, 1))]
    assert _staging._plan_chunks((2, 3, 4), 2, 5) == [((row, i), start, length) for row in range(2)
                                                      for i in range(3) for start, length in ((0, 2), (2, 2))]
    assert _staging._plan_chunks((0, 4), 4, 48) == _staging._plan_chunks((4, 0), 4, 48) == []
    with pytest.raises(ValueError, match="0-d"):
        _staging._plan_chunks((), 4, 48)


@pytest.mark.parametrize("shape", [(10, 4), (7,), (3, 5, 4), (2, 3, 1, 9), (1, 64)])
@pytest.mark.parametrize("chunk_bytes", [1, 12, 40, 100, 10_000])
def test_pinned_chunk_plan_covers_every_element_once_in_order(shape, chunk_bytes):
    covered = torch.arange(math.prod(shape)).reshape(shape)
    pieces = [covered[index].narrow(0, start, length)
              for index, start, length in _staging._plan_chunks(shape, 4, chunk_bytes)]
    assert torch.equal(torch.cat([piece.reshape(-1) for piece in pieces]), covered.reshape(-1))
    assert all(piece.numel() * 4 <= chunk_bytes or piece.shape[0] == 1 for piece in pieces)


CopyCase = Callable[[torch.device], tuple[torch.Tensor, torch.Tensor]]


def _copy_cases(rows: int, cols: int) -> dict[str, CopyCase]:
    """(dst on the device, src on the CPU) pairs of one shape each; their sizes scale with rows x cols."""
    g = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    return {
        "contiguous": lambda d: (torch.zeros(rows, cols, device=d), randn(rows, cols)),
        # A column-parallel layer's rows: both contiguous, at an offset.
        "row shard": lambda d: (torch.zeros(3 * rows, cols, device=d).narrow(0, rows, rows),
                                randn(2 * rows, cols).narrow(0, rows, rows)),
        # A row-parallel layer's columns: both strided.
        "column shard": lambda d: (torch.zeros(rows, 3 * cols, device=d).narrow(1, cols, cols),
                                   randn(rows, 2 * cols).narrow(1, cols, cols)),
        "float32 into bfloat16": lambda d: (torch.zeros(rows, cols, dtype=torch.bfloat16, device=d),
                                            randn(rows, cols)),
        "bfloat16 column shard into float32": lambda d: (
            torch.zeros(rows, 2 * cols, device=d).narrow(1, cols, cols),
            randn(rows, 3 * cols).to(torch.bfloat16).narrow(1, 0, cols)),
        "rows larger than a chunk": lambda d: (torch.zeros(2, rows, cols, device=d), randn(2, rows, cols)),
        "1-D": lambda d: (torch.zeros(rows * cols + 3, device=d), randn(rows * cols + 3)),
        "0-D": lambda d: (torch.zeros((), device=d), randn(())),
    }


CPU_CASES = _copy_cases(7, 5)


@pytest.mark.parametrize("case", list(CPU_CASES))
def test_pinned_staged_copy_on_cpu_matches_copy(case):
    """The chunk loop, with a CPU destination and ordinary buffers of 64 bytes: many chunks, each copied
    synchronously; the same values as one copy_."""
    dst, src = CPU_CASES[case](torch.device("cpu"))
    expected = dst.clone().copy_(src)
    buffers = (torch.empty(64, dtype=torch.uint8), torch.empty(64, dtype=torch.uint8))
    _staging._staged_copy(dst, src, buffers)
    assert torch.equal(dst, expected)


def test_pinned_staging_switch(monkeypatch):
    monkeypatch.delenv("TPKIT_LOAD_PINNED", raising=False)
    assert _staging._staging_enabled()
    for off in ("0", "false", " Off ", "no"):
        monkeypatch.setenv("TPKIT_LOAD_PINNED", off)
        assert not _staging._staging_enabled()
    monkeypatch.setenv("TPKIT_LOAD_PINNED", "1")
    assert _staging._staging_enabled()


def _count_staged_copies(monkeypatch) -> list[tuple[torch.Size, torch.dtype]]:
    calls = []
    staged_copy = _staging._staged_copy

    def counting(dst, src, buffers):
        calls.append((src.shape, src.dtype))
        staged_copy(dst, src, buffers)

    monkeypatch.setattr(_staging, "_staged_copy", counting)
    return calls


# About 32 MiB in float32: several 8 MiB chunks, the last one shorter; a row of the 3-D case spans several.
GPU_CASES = _copy_cases(2053, 4099)


@needs_cuda
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_pinned_copy_into_gpu_matches_plain_copy(case, monkeypatch):
    monkeypatch.delenv("TPKIT_LOAD_PINNED", raising=False)
    calls = _count_staged_copies(monkeypatch)
    dst, src = GPU_CASES[case](torch.device("cuda"))
    expected = dst.clone().copy_(src)  # from pageable memory, cast on the CPU
    with torch.no_grad():
        staged = _staging.copy_into(dst, src)
        if not staged:
            dst.copy_(src)
    assert torch.equal(dst, expected)
    assert staged == (case != "0-D") and len(calls) == int(staged)  # small tensors are left to copy_


@needs_cuda
def test_pinned_load_weights_into_gpu_matches_pageable(tmp_path, monkeypatch):
    """Lazy file views into tpkit layers and a plain parameter on the GPU, on 4 threads and on the calling
    thread, in and out of inference mode (the buffers are made in it, then written outside): the values of
    copies straight from pageable memory."""
    g = torch.Generator().manual_seed(0)
    tensors = {"up.weight": torch.randn(3000, 1024, generator=g), "up.bias": torch.randn(3000, generator=g),
               "down.weight": torch.randn(1024, 3000, generator=g),
               "scale": torch.randn(1_500_000, generator=g)}  # default_weight_loader: a plain copy_
    save_file(tensors, tmp_path / "model.safetensors")

    def build() -> nn.Module:
        model = nn.Module()
        model.up = ColumnParallelLinear(1024, 3000, tp_group=SINGLE, params_dtype=torch.bfloat16,
                                        device="cuda")
        model.down = RowParallelLinear(3000, 1024, bias=False, tp_group=SINGLE, device="cuda")
        model.scale = nn.Parameter(torch.zeros(1_500_000, dtype=torch.bfloat16, device="cuda"))
        return model

    calls = _count_staged_copies(monkeypatch)
    monkeypatch.setenv("TPKIT_LOAD_DMA", "0")  # staging itself, not the direct copies from the file
    monkeypatch.setattr(_staging._STAGING, "pair", None)  # this thread's made afresh, in inference mode
    states = []
    for pinned, threads, inference in (("0", 4, False), ("1", 4, True), ("1", 1, True), ("1", 1, False)):
        monkeypatch.setenv("TPKIT_LOAD_PINNED", pinned)
        calls.clear()
        with torch.inference_mode(inference):
            model = build()
            load_weights(model, iter_weights(tmp_path), num_threads=threads, progress=False)
        # The layers' weights and the plain parameter; the bias is under 1 MiB.
        assert len(calls) == (0 if pinned == "0" else 3)
        states.append(_snapshot(model))
    for state in states[1:]:
        for name, tensor in states[0].items():
            assert torch.equal(state[name], tensor), name
    # A row-parallel layer's columns at tp_size 2: a strided view of the file map.
    handle = dict(iter_weights(tmp_path))["down.weight"]
    param = torch.zeros(1024, 1500, dtype=torch.bfloat16, device="cuda")
    _loading._copy_pieces(param, handle, 1, [(0, 1500, 1500)])
    assert torch.equal(param, tensors["down.weight"][:, 1500:].to(torch.bfloat16).cuda())


# --- direct copies from the page cache into a GPU -----------------------------------------------------------

def _save_bf16(path: Path, rows: int, cols: int) -> torch.Tensor:
    """One bf16 tensor after a small one, so that its bytes start inside a page; returns it."""
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(rows, cols, generator=g).to(torch.bfloat16)
    save_file({"a.bias": torch.randn(37, generator=g).to(torch.bfloat16), "b.weight": weight}, path)
    return weight


def test_direct_copy_file_offset_of_parts(tmp_path):
    """Where a handle's views lie in the file: the bytes there are the view's (the whole and row ranges)."""
    weight = _save_bf16(tmp_path / "model.safetensors", 300, 200)
    handle = dict(iter_weights(tmp_path))["b.weight"]
    with open(tmp_path / "model.safetensors", "rb") as file:
        for part in (handle[:], handle.narrow(0, 7, 100), handle[150:]):
            offset = handle._file_offset(part)
            file.seek(offset)
            stored = torch.frombuffer(bytearray(file.read(part.numel() * 2)), dtype=torch.bfloat16)
            assert torch.equal(stored.view(part.shape), part)
    assert torch.equal(handle[150:], weight[150:])


@pytest.mark.parametrize("failing_piece", [None, 0, 2])
def test_direct_copy_pieces_and_registrations(tmp_path, monkeypatch, failing_piece):
    """One loading's copies with CPU destinations and recorded page-locking calls: pieces of whole pages,
    consecutive and not overlapping, each registered once although two parts share pieces; a piece that
    fails to register is copied all the same; on release every registered piece is unregistered; the bytes
    are the parts'."""
    weight = _save_bf16(tmp_path / "model.safetensors", 64, 1000)  # 128,000 bytes: 32 pages
    handle = dict(iter_weights(tmp_path))["b.weight"]
    page = _direct_copy.mmap.PAGESIZE
    monkeypatch.setattr(_direct_copy, "_PIECE_BYTES", 3 * page)
    registered, unregistered = [], []

    def register(address: int, nbytes: int) -> bool:
        ok = len(registered) != failing_piece
        registered.append((address, nbytes, ok))
        return ok

    copies = _direct_copy.DirectCopies(register, unregistered.append)
    rows = [(3, 50), (40, 24)]  # each starts and ends inside a page; they share a piece
    outputs = [torch.zeros(n, 1000, dtype=torch.bfloat16) for _, n in rows]
    for (start, n), dst in zip(rows, outputs, strict=True):
        copies.copy(dst, handle.file, handle._file_offset(handle.narrow(0, start, n)))
    for (start, n), dst in zip(rows, outputs, strict=True):
        assert torch.equal(dst, weight[start:start + n])
    registered.sort()
    assert all(address % page == 0 and nbytes % page == 0 for address, nbytes, _ in registered)
    for (a, n, _), (b, _, _) in itertools.pairwise(registered):
        assert a + n == b  # consecutive, not overlapping: each piece once
    base = copies._files[handle.file].host.data_ptr()  # where the map starts: file offset 0
    first_byte = handle._file_offset(handle.narrow(0, 3, 1))
    end_byte = handle._file_offset(handle[:]) + 128_000  # the tensor's end
    assert registered[0][0] - base == first_byte - first_byte % (3 * page)  # pieces start at multiples
    assert end_byte <= registered[-1][0] + registered[-1][1] - base < end_byte + 3 * page
    assert not unregistered
    copies.release(handle.file)
    assert sorted(unregistered) == [address for address, _, ok in registered if ok]
    copies.release(handle.file)  # released already: nothing more
    assert len(unregistered) == sum(ok for _, _, ok in registered)


def _mapped_kib(address: int) -> int:
    """The resident KiB of the mapping that starts at ``address`` (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(rf"0*{address:x}-", line):
            return next(int(entry.split()[1]) for entry in lines[i + 1:] if entry.startswith("Rss:"))
    raise AssertionError(f"no mapping starts at {address:#x}")


def test_direct_copy_pinned_bytes_bounded(tmp_path, monkeypatch):
    """With room for two pieces: a registration never takes the pinned bytes past that; pieces are
    registered in file order, each once, and unregistered oldest first; a piece needed again after that is
    registered again; the bytes are the tensor's; unpinned pages leave the process's page tables; on release
    nothing stays pinned."""
    weight = _save_bf16(tmp_path / "model.safetensors", 64, 1000)  # 128,000 bytes: 32 pages
    handle = dict(iter_weights(tmp_path))["b.weight"]
    page = _direct_copy.mmap.PAGESIZE
    monkeypatch.setattr(_direct_copy, "_PIECE_BYTES", 3 * page)
    monkeypatch.setattr(_direct_copy, "_MAX_PINNED_BYTES", 6 * page)
    pinned: dict[int, int] = {}
    calls = []

    def register(address: int, nbytes: int) -> bool:
        assert sum(pinned.values()) + nbytes <= 6 * page
        pinned[address] = nbytes
        calls.append(("register", address))
        return True

    def unregister(address: int) -> None:
        del pinned[address]
        calls.append(("unregister", address))

    copies = _direct_copy.DirectCopies(register, unregister)
    dst = torch.zeros(64, 1000, dtype=torch.bfloat16)
    copies.copy(dst, handle.file, handle._file_offset(handle[:]))
    assert torch.equal(dst, weight)
    registered = [address for call, address in calls if call == "register"]
    unregistered = [address for call, address in calls if call == "unregister"]
    assert len(registered) >= 11 and registered == sorted(set(registered))
    assert unregistered == registered[:-2] and len(pinned) == 2
    file = copies._files[handle.file]
    # The copies read all 32 pages through the map; unpinned pieces left the process's page tables. Mapped
    # now: the two pinned pieces and what the last read fault mapped around it (64 KiB, fault_around_bytes).
    if Path("/proc/self/smaps").exists():
        assert _mapped_kib(file.host.data_ptr()) * 1024 <= 6 * page + 64 * 1024 < 32 * page
    calls.clear()
    first_rows = torch.zeros(2, 1000, dtype=torch.bfloat16)
    copies.copy(first_rows, handle.file, handle._file_offset(handle.narrow(0, 0, 2)))
    assert torch.equal(first_rows, weight[:2])
    assert calls == [("unregister", registered[-2]), ("register", registered[0])]
    copies.release(handle.file)
    assert not pinned


def test_direct_copy_threads_share_pieces(tmp_path, monkeypatch):
    """Four threads copying rows of one tensor through one loading, with room for three pieces: no
    registration overlaps a pinned range, none is of a piece in use by another thread's copy (it is never
    unpinned under it), every row arrives, and on close nothing stays pinned."""
    weight = _save_bf16(tmp_path / "model.safetensors", 512, 1000)  # 1,024,000 bytes: 250 pages
    handle = dict(iter_weights(tmp_path))["b.weight"]
    page = _direct_copy.mmap.PAGESIZE
    monkeypatch.setattr(_direct_copy, "_PIECE_BYTES", 2 * page)
    monkeypatch.setattr(_direct_copy, "_MAX_PINNED_BYTES", 6 * page)
    pinned: dict[int, int] = {}
    lock = threading.Lock()

    def register(address: int, nbytes: int) -> bool:
        with lock:
            assert all(address + nbytes <= a or a + n <= address for a, n in pinned.items())
            pinned[address] = nbytes
        time.sleep(0.0005)
        return True

    def unregister(address: int) -> None:
        with lock:
            del pinned[address]

    unpin = _direct_copy.DirectCopies._unpin
    unpinned = []

    def checked_unpin(self, piece) -> None:
        assert piece.users == 0  # no copy is being queued from it
        unpinned.append(piece.lo)
        unpin(self, piece)

    monkeypatch.setattr(_direct_copy.DirectCopies, "_unpin", checked_unpin)
    dst = torch.zeros(512, 1000, dtype=torch.bfloat16)
    with _direct_copy.DirectCopies(register, unregister) as copies:
        errors = []

        def copy_rows(first: int) -> None:
            try:
                for start in range(first, 512, 16):  # each thread every fourth block of 4 rows
                    part = handle.narrow(0, start, 4)
                    copies.copy(dst[start:start + 4], handle.file, handle._file_offset(part))
            except BaseException as error:  # noqa: BLE001 - failed in the test's thread below
                errors.append(error)

        threads = [threading.Thread(target=copy_rows, args=(4 * i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert not errors, errors
        assert sum(pinned.values()) <= 6 * page + 4 * 2 * page  # over only while each thread holds one
    assert torch.equal(dst, weight) and not pinned and len(unpinned) >= 120


def test_direct_copy_loading_routes_copies(tmp_path, monkeypatch):
    """Inside ``loading(copies)`` a thread's copies go through that loading, which keeps its pieces
    registered until released; outside, each copy registers and unregisters its own."""
    weight = _save_bf16(tmp_path / "model.safetensors", 256, 1024)
    handle = dict(iter_weights(tmp_path))["b.weight"]
    calls = []
    monkeypatch.setattr(_direct_copy, "_cuda_register", lambda address, n: calls.append("register") or True)
    monkeypatch.setattr(_direct_copy, "_cuda_unregister", lambda address: calls.append("unregister"))
    offset = handle._file_offset(handle[:])
    dst = torch.zeros(256, 1024, dtype=torch.bfloat16)
    _direct_copy.copy_file_range(dst, handle.file, offset)
    assert torch.equal(dst, weight) and calls == ["register", "unregister"]
    calls.clear()
    with _direct_copy.DirectCopies() as copies, _direct_copy.loading(copies):
        for _ in range(3):
            dst.zero_()
            _direct_copy.copy_file_range(dst, handle.file, offset)
            assert torch.equal(dst, weight)
        assert calls == ["register"]
    assert calls == ["register", "unregister"] and _direct_copy._ACTIVE.copies is None
    with pytest.raises(ValueError, match=r"inside the file's .* received"):
        _direct_copy.copy_file_range(dst, handle.file, handle.file.stat().st_size - 100)


def test_direct_copy_views_by_their_span(tmp_path):
    """A column shard and a cast, copied (CPU destinations, recorded page-locking) by the span of file bytes
    from their first element to their last, then taken with their strides (also into a strided
    destination): the values are the parts'."""
    weight = _save_bf16(tmp_path / "model.safetensors", 256, 1024)
    handle = dict(iter_weights(tmp_path))["b.weight"]
    registered = []
    copies = _direct_copy.DirectCopies(lambda address, n: registered.append((address, n)) or True,
                                       lambda address: None)
    column = handle.narrow(1, 300, 400)  # [256, 400], rows 2048 bytes apart
    assert _direct_copy.span_bytes(column) == (255 * 1024 + 400) * 2
    assert _direct_copy.span_bytes(handle.narrow(0, 5, 10)) == 10 * 1024 * 2
    assert _direct_copy.span_bytes(handle.narrow(1, 0, 0)) == 0
    with _direct_copy.loading(copies):
        dst = torch.zeros(256, 400, dtype=torch.float32)
        _direct_copy.copy_file_view(dst, handle.file, handle._file_offset(column), column)
        assert torch.equal(dst, weight[:, 300:700].float())
        out = torch.zeros(1024, 256, dtype=torch.bfloat16).t()  # a strided destination
        whole = handle.narrow(1, 0, 1024)
        _direct_copy.copy_file_view(out, handle.file, handle._file_offset(whole), whole)
        assert torch.equal(out, weight)
    assert len(registered) == 1  # the file's one piece, registered once for both copies
    copies.close()


def test_direct_copy_worth_it_by_span(monkeypatch):
    """Into a GPU only (here a stand-in destination), parts of 1 MiB or more whose span is at most
    _MAX_SPAN_RATIO times their bytes, any dtype."""
    monkeypatch.delenv("TPKIT_LOAD_DMA", raising=False)
    monkeypatch.setattr(_direct_copy._State, "failed", False)
    full = torch.zeros(1024, 4096, dtype=torch.bfloat16)  # 8 MiB

    def gpu(part: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> SimpleNamespace:
        return SimpleNamespace(device=torch.device("cuda"), shape=part.shape, dtype=dtype)

    assert _direct_copy.worth_it(gpu(full), full)
    assert _direct_copy.worth_it(gpu(full, torch.float32), full)  # a cast
    assert _direct_copy.worth_it(gpu(full[:, :512]), full[:, :512])  # 1 MiB spanning 8x: the limit
    assert not _direct_copy.worth_it(gpu(full[:, :511]), full[:, :511])  # under 1 MiB
    assert not _direct_copy.worth_it(gpu(full[:512, ::16]), full[:512, ::16])  # spans 16x
    assert not _direct_copy.worth_it(SimpleNamespace(device=torch.device("cpu"), shape=full.shape), full)


def test_direct_copy_declines(tmp_path, monkeypatch):
    """Not into a CPU tensor (copy_to writes nothing then); the switch."""
    _save_bf16(tmp_path / "model.safetensors", 1024, 1024)  # 2 MiB
    handle = dict(iter_weights(tmp_path))["b.weight"]
    part = handle[:]
    dst = torch.zeros(1024, 1024, dtype=torch.bfloat16)
    assert not handle.copy_to(dst, part)
    assert not dst.any()
    monkeypatch.delenv("TPKIT_LOAD_DMA", raising=False)
    assert _direct_copy.enabled()
    for off in ("0", "false", " Off ", "no"):
        monkeypatch.setenv("TPKIT_LOAD_DMA", off)
        assert not _direct_copy.enabled()


@needs_cuda
def test_direct_copy_into_gpu(tmp_path, monkeypatch):
    """Into GPU parameters through load_weights: the whole tensor, a cast (float32 into bfloat16), a plain
    parameter (default_weight_loader), then row and column shards (a column-parallel layer's rows at
    tp_size 2, a row-parallel layer's columns) all copy straight from the file, the contiguous ones into
    the parameter, the others by their span through a GPU buffer; a part that spans more than
    _MAX_SPAN_RATIO times its bytes is staged; every value is the checkpoint's, every page unregistered."""
    g = torch.Generator().manual_seed(0)
    tensors = {"up.weight": torch.randn(3000, 1024, generator=g).to(torch.bfloat16),
               "down.weight": torch.randn(1024, 3000, generator=g),  # float32 into bfloat16
               "scale": torch.randn(1_500_000, generator=g).to(torch.bfloat16)}
    save_file(tensors, tmp_path / "model.safetensors")
    monkeypatch.delenv("TPKIT_LOAD_DMA", raising=False)
    monkeypatch.setattr(_direct_copy._State, "failed", False)
    direct, straight = [], []  # the parts copied from the file; those copied into the parameter itself
    copy_file_view, copy_file_range = _direct_copy.copy_file_view, _direct_copy.copy_file_range

    def counting_view(dst, path, offset, part):
        direct.append(tuple(part.shape))
        copy_file_view(dst, path, offset, part)

    def counting_range(dst, path, offset):
        if dst.dtype != torch.uint8:
            straight.append(tuple(dst.shape))
        copy_file_range(dst, path, offset)

    monkeypatch.setattr(_direct_copy, "copy_file_view", counting_view)
    monkeypatch.setattr(_direct_copy, "copy_file_range", counting_range)
    pinned = []
    register, unregister = _direct_copy._cuda_register, _direct_copy._cuda_unregister

    def recording_register(address: int, nbytes: int) -> bool:
        ok = register(address, nbytes)
        if ok:
            pinned.append(address)
        return ok

    def recording_unregister(address: int) -> None:
        unregister(address)
        pinned.remove(address)

    monkeypatch.setattr(_direct_copy, "_cuda_register", recording_register)
    monkeypatch.setattr(_direct_copy, "_cuda_unregister", recording_unregister)
    model = nn.Module()
    model.up = ColumnParallelLinear(1024, 3000, bias=False, tp_group=SINGLE, params_dtype=torch.bfloat16,
                                    device="cuda")
    model.down = RowParallelLinear(3000, 1024, bias=False, tp_group=SINGLE, params_dtype=torch.bfloat16,
                                   device="cuda")
    model.scale = nn.Parameter(torch.zeros(1_500_000, dtype=torch.bfloat16, device="cuda"))
    load_weights(model, iter_weights(tmp_path), num_threads=4, progress=False)
    assert sorted(direct) == sorted([(1024, 3000), (1_500_000,), (3000, 1024)])
    assert sorted(straight) == sorted([(1_500_000,), (3000, 1024)])  # the cast went through a buffer
    assert not _direct_copy._State.failed
    assert not pinned  # every piece registered was unregistered once its copies were done
    assert torch.equal(model.up.weight.cpu(), tensors["up.weight"])
    assert torch.equal(model.down.weight.cpu(), tensors["down.weight"].to(torch.bfloat16))
    assert torch.equal(model.scale.cpu(), tensors["scale"])
    direct.clear()
    handle = dict(iter_weights(tmp_path))["up.weight"]
    for rank in range(2):  # rows [1500 * rank, 1500 * (rank + 1)); then columns [512 * rank, ...)
        param = torch.zeros(1500, 1024, dtype=torch.bfloat16, device="cuda")
        _loading._copy_pieces(param, handle, 0, [(0, 1500 * rank, 1500)])
        assert torch.equal(param.cpu(), tensors["up.weight"][1500 * rank:1500 * (rank + 1)])
        param = torch.zeros(3000, 512, dtype=torch.bfloat16, device="cuda")
        _loading._copy_pieces(param, handle, 1, [(0, 512 * rank, 512)])
        assert torch.equal(param.cpu(), tensors["up.weight"][:, 512 * rank:512 * (rank + 1)])
    monkeypatch.setattr(_direct_copy, "_MAX_SPAN_RATIO", 1.5)  # a column half spans 2x its bytes: staged
    param = torch.zeros(3000, 512, dtype=torch.bfloat16, device="cuda")
    _loading._copy_pieces(param, handle, 1, [(0, 512, 512)])
    assert torch.equal(param.cpu(), tensors["up.weight"][:, 512:])
    assert direct == [(1500, 1024), (3000, 512)] * 2 and not pinned
    torch.zeros(1, device="cuda").add_(1)  # no CUDA error left behind
    torch.cuda.synchronize()
