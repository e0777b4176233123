"""Copies from a checkpoint file straight into a GPU: the file's pages, where they lie in the page cache,
page-locked in place (``cudaHostRegister``, read-only) and read by the GPU's copy engine.

Loading into a GPU is bound by the host's memory bandwidth. A copy through page-locked buffers moves each
byte three times (the CPU reads and writes it, the copy engine reads it again); this reads it once.

Registering is the cost, and registrations on several threads wait on each other. So a loading registers each
piece of a file once, whichever tensors lie in it, and queues the copies without waiting for them.
:class:`DirectCopies` holds the file maps and registered pieces of one ``load_weights`` call: it keeps at most
``_MAX_PINNED_BYTES`` page-locked, unregistering the oldest pieces as it registers new ones, and the call
releases each file once the next one is loaded (so that a file's last copies overlap the next file's first
ones). A copy outside such a call is a loading of its own, released before it returns.

The map is shared and read-only. The lazy handles' own views are of private (copy-on-write) maps, so that
a caller may write into what ``t[:]`` returns; registering such a map can take minutes.
Where registering fails (a file system whose pages cannot be pinned, no driver support), the process stops
trying and the caller copies its own way. ``TPKIT_LOAD_DMA=0`` in the environment turns this off.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from tpkit._env import env_flag

# Smaller parts (norms, biases) are not worth a registration.
_MIN_BYTES = 2**20
# A strided part (a column shard) is copied by its span, the file bytes from its first element to its
# last, into a GPU buffer, and taken from there on the GPU: worth it while the span is at most this many
# times the part (a column shard at tp_size 8 spans about 8x its bytes): the copy engine reads the span many
# times faster than a CPU thread gathers the part into page-locked buffers.
_MAX_SPAN_RATIO = 8
# Files are registered a piece at a time, on first use, so that one thread's copies run while another
# registers the next piece, rather than one registration of a whole file before its first copy. A multiple
# of the page.
_PIECE_BYTES = 64 * 2**20
# Pinned pages are the process's memory while they are pinned (its peak counts them), so a loading keeps
# at most this many registered: 4 pieces. Registering a piece takes about as long as copying it, so the
# copy engine trails registration by about a piece, and the oldest of four is copied by the time it is
# unregistered.
_MAX_PINNED_BYTES = 4 * _PIECE_BYTES
# cudaHostRegisterReadOnly (8): the driver pins the pages without asking to write them; and
# cudaHostRegisterPortable (1): pinned for every device's context, not only the calling thread's current
# device.
_HOST_REGISTER_FLAGS = 8 | 1

Register = Callable[[int, int], bool]  # (address, nbytes) -> registered
Unregister = Callable[[int], None]  # (address)

_WARNINGS_LOCK = threading.Lock()  # warnings.catch_warnings is not thread-safe


class _State:
    failed = False  # registering failed once in this process: do not try again


class _Active(threading.local):
    copies: DirectCopies | None = None  # the loading this thread copies for


_ACTIVE = _Active()


def enabled() -> bool:
    """False where the environment sets ``TPKIT_LOAD_DMA`` to 0 (or false, no, off), or registering failed."""
    return env_flag("TPKIT_LOAD_DMA", True) and not _State.failed


def worth_it(dst: torch.Tensor, part: torch.Tensor) -> bool:
    """Whether ``part`` (a view of a file map) is worth copying into ``dst`` straight from the file: into a
    GPU, the same shape, at least ``_MIN_BYTES``, spanning at most ``_MAX_SPAN_RATIO`` times its bytes."""
    nbytes = part.numel() * part.element_size()
    return (dst.device.type == "cuda" and part.device.type == "cpu" and dst.shape == part.shape
            and nbytes >= _MIN_BYTES and span_bytes(part) <= _MAX_SPAN_RATIO * nbytes and enabled())


def span_bytes(part: torch.Tensor) -> int:
    """The bytes from ``part``'s first element to the end of its last (its storage's strides are positive)."""
    if part.numel() == 0:
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(part.shape, part.stride(), strict=True))
            ) * part.element_size()


def copy_file_view(dst: torch.Tensor, path: Path, offset: int, part: torch.Tensor) -> None:
    """Copies ``part``, a view of the file at ``path`` whose first element lies at ``offset``, into ``dst``
    (the same shape; any dtype, any layout) by DMA from the page cache, as :func:`copy_file_range` does. A
    contiguous part of dst's dtype into a contiguous dst goes straight in; any other goes by its span into a
    buffer on dst's device, whose view with part's strides is then copied (and cast) into dst there."""
    if part.is_contiguous() and dst.is_contiguous() and dst.dtype == part.dtype:
        copy_file_range(dst, path, offset)
        return
    # [span_bytes] uint8. In a loading its copy is only queued: the caching allocator gives the memory to
    # later allocations on this stream only, whose work the stream runs after the copies.
    span = torch.empty(span_bytes(part), dtype=torch.uint8, device=dst.device)
    copy_file_range(span, path, offset)
    dst.copy_(span.view(part.dtype).as_strided(part.shape, part.stride()))


def copy_file_range(dst: torch.Tensor, path: Path, offset: int) -> None:
    """Copies the ``dst.nbytes`` bytes at ``offset`` of the file at ``path`` into ``dst`` (contiguous, on a
    GPU) by DMA from the page cache. In a loading (:func:`loading`) the copy is queued on dst's current
    stream and the loading waits for it before it unpins the pages (to make room, or when it releases the
    file); otherwise this returns once ``dst`` holds the bytes."""
    copies = _ACTIVE.copies
    if copies is not None:
        copies.copy(dst, Path(path), offset)
        return
    with DirectCopies() as copies:
        copies.copy(dst, Path(path), offset)


@contextlib.contextmanager
def loading(copies: DirectCopies | None) -> Iterator[None]:
    """In this thread, :func:`copy_file_range` copies for ``copies`` (None: each copy on its own)."""
    before, _ACTIVE.copies = _ACTIVE.copies, copies
    try:
        yield
    finally:
        _ACTIVE.copies = before


class DirectCopies:
    """The file maps and registered pieces of one loading. ``register`` and ``unregister`` stand in for the
    driver's calls in tests, whose destinations are on the CPU (where every copy is synchronous).

    Pieces are whole pages of the file, ``_PIECE_BYTES`` each (the last one shorter), never overlapping (the
    driver refuses a range that overlaps one registered before), registered on first use; a copy is cut at
    the pieces' bounds, one copy a piece. At most ``_MAX_PINNED_BYTES`` stay registered: to make room, the
    oldest piece no copy is being queued from waits for its copies, is unregistered and leaves the process's
    page tables (a piece needed again later is registered again). A piece that fails to register is copied
    from the same, pageable, map (synchronously). Thread-safe: the loaders of several threads copy through
    one.
    """

    def __init__(self, register: Register | None = None, unregister: Unregister | None = None):
        self._register = register or _cuda_register
        self._unregister = unregister or _cuda_unregister
        self._files: dict[Path, _MappedFile] = {}
        self._pinned: collections.deque[_Piece] = collections.deque()  # registered pieces, oldest first
        self._pinned_bytes = 0
        self._lock = threading.Lock()

    def copy(self, dst: torch.Tensor, path: Path, offset: int) -> None:
        with self._lock:
            file = self._files.get(path)
            if file is None:
                file = self._files[path] = _MappedFile(path)
        nbytes = dst.numel() * dst.element_size()
        if offset < 0 or offset + nbytes > file.host.numel():
            raise ValueError(f"direct copy: expected bytes inside the file's {file.host.numel()}, received "
                             f"[{offset}, {offset + nbytes})")
        flat = dst.view(-1).view(torch.uint8)  # [nbytes]
        stream = torch.cuda.current_stream(dst.device) if dst.device.type == "cuda" else None
        end = offset + nbytes
        for lo in range(offset - offset % _PIECE_BYTES, end, _PIECE_BYTES):
            piece = self._acquire(file, lo)
            try:
                piece_lo, piece_hi = max(lo, offset), min(lo + _PIECE_BYTES, end)
                flat[piece_lo - offset:piece_hi - offset].copy_(file.host[piece_lo:piece_hi],
                                                                 non_blocking=piece.registered)
            finally:
                with self._lock:
                    piece.users -= 1
                    if stream is not None and piece.registered:
                        piece.copied_on(stream)

    def _acquire(self, file: _MappedFile, lo: int) -> _Piece:
        """The piece at ``lo``, registered on first use, in use until the caller has queued its copy."""
        with self._lock:
            piece = file.pieces.get(lo)
            if piece is None:
                nbytes = min(_PIECE_BYTES, file.mapped_bytes - lo)
                self._make_room(nbytes)
                piece = file.pieces[lo] = _Piece(file, lo, nbytes, self._register(file.address(lo), nbytes))
                if piece.registered:
                    self._pinned.append(piece)
                    self._pinned_bytes += nbytes
            piece.users += 1
            return piece

    def _make_room(self, nbytes: int) -> None:
        """Unpins the oldest idle pieces until ``nbytes`` more fit (with the lock held)."""
        while self._pinned_bytes + nbytes > _MAX_PINNED_BYTES:
            idle = next((piece for piece in self._pinned if not piece.users), None)
            if idle is None:  # every one is being copied from on another thread: go over for now
                return
            del idle.file.pieces[idle.lo]
            self._unpin(idle)
            idle.file.drop_pages(idle.lo, idle.nbytes)

    def _unpin(self, piece: _Piece) -> None:
        """Waits for the piece's copies, then unregisters it (also where waiting failed: a CUDA error); it
        leaves the pinned pieces and their count at once (with the lock held)."""
        self._pinned.remove(piece)
        self._pinned_bytes -= piece.nbytes
        try:
            piece.wait()
        finally:
            self._unregister(piece.file.address(piece.lo))

    def release(self, path: Path) -> None:
        """Waits for the copies from ``path``, then unregisters its pieces and drops its map."""
        with self._lock:
            file = self._files.pop(Path(path), None)
            if file is None:
                return
            pieces = [piece for piece in file.pieces.values() if piece.registered]
            file.pieces.clear()
            errors = []
            for piece in pieces:
                try:
                    self._unpin(piece)
                except Exception as error:  # noqa: BLE001 - the others are unregistered all the same
                    errors.append(error)
            file.close()
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Releases every file, also after a failed copy."""
        errors = []
        for path in list(self._files):
            try:
                self.release(path)
            except Exception as error:  # noqa: BLE001 - the others are released all the same
                errors.append(error)
        if errors:
            raise errors[0]

    def __enter__(self) -> DirectCopies:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _MappedFile:
    """One file, mapped whole, shared and read-only, and its pieces (first byte -> piece)."""

    def __init__(self, path: Path):
        with open(path, "rb") as handle:
            self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        self.host = _read_only_bytes(self._map)  # [file size] uint8; the map lives while a view does
        self.mapped_bytes = -(-self.host.numel() // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages
        self.pieces: dict[int, _Piece] = {}

    def address(self, offset: int) -> int:
        return self.host.data_ptr() + offset

    def drop_pages(self, offset: int, nbytes: int) -> None:
        """Takes the pages out of the process's page tables (they stay in the page cache): pages pinned
        once were mapped in, and would count in the process's memory until the map is dropped."""
        self._map.madvise(mmap.MADV_DONTNEED, offset, min(nbytes, len(self._map) - offset))

    def close(self) -> None:
        self.pieces.clear()
        self.host = torch.empty(0, dtype=torch.uint8)
        self._map = None  # unmapped once no view of it is left


class _Piece:
    """A registered (or failed to register) range of a file: ``nbytes`` at ``lo``."""

    def __init__(self, file: _MappedFile, lo: int, nbytes: int, registered: bool):
        self.file, self.lo, self.nbytes, self.registered = file, lo, nbytes, registered
        self.users = 0  # copies being queued from it: it may not be unregistered under them
        self._copied: dict[torch.cuda.Stream, torch.cuda.Event] = {}  # recorded after its latest copy

    def copied_on(self, stream: torch.cuda.Stream) -> None:
        event = self._copied.get(stream)
        if event is None:
            event = self._copied[stream] = torch.cuda.Event()
        event.record(stream)

    def wait(self) -> None:
        for event in self._copied.values():
            event.synchronize()


def _cuda_register(address: int, nbytes: int) -> bool:
    if _State.failed:  # another piece or thread found it cannot be done
        return False
    if int(torch.cuda.cudart().cudaHostRegister(address, nbytes, _HOST_REGISTER_FLAGS)) == 0:
        return True
    _State.failed = True
    _clear_cuda_error()
    warnings.warn("tpkit: could not page-lock a checkpoint file's pages for a direct copy to the GPU; "
                  "copying through page-locked buffers from now on", RuntimeWarning, stacklevel=2)
    return False


def _cuda_unregister(address: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(address)


def _read_only_bytes(mapped: mmap.mmap) -> torch.Tensor:
    """The map as a uint8 tensor. torch warns once that it cannot mark a tensor read-only; nothing writes
    into this one."""
    with _WARNINGS_LOCK, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
        return torch.frombuffer(mapped, dtype=torch.uint8)


def _clear_cuda_error() -> None:
    """A failed runtime call leaves its error as this thread's last CUDA error, where torch's next kernel
    launch check would report it as that kernel's; a launch here takes it (and raises it) first."""
    try:
        torch.empty(1, device="cuda").zero_()
    except RuntimeError:
        pass
