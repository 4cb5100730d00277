"""Host memory: shm-backed segments that peers can map, and caller buffers.

A `ShmSegment` is a memfd (anonymous, freed with its last fd or mapping) mapped once with
MAP_POPULATE, so its pages are faulted in at creation and never per transfer. Its fd can
be handed to local peers over a unix socket; a read-only peer gets a fresh O_RDONLY fd,
so the kernel itself refuses a writable mapping.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import starmap
from typing import Any, NamedTuple

import numpy as np

from hixl.errors import ConfigError, ParamInvalid, PermissionDenied, ResourceExhausted
from hixl.sizes import parse_size

PAGE_SIZE = mmap.PAGESIZE
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


#: The seals every memfd hixl maps must carry: a file that a holder of any fd on it could
#: shrink would SIGBUS every process mapping it on its next access (the agent included).
SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW


def size_sealed(fd: int) -> bool:
    """True when the file behind `fd` can neither shrink nor grow (memfd seals)."""
    try:
        return fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SIZE_SEALS == SIZE_SEALS
    except OSError:  # not a sealable file (a pipe, a regular file on disk)
        return False


def round_up(n: int, to: int = PAGE_SIZE) -> int:
    return (n + to - 1) // to * to


_bytes_from_size = ctypes.pythonapi.PyBytes_FromStringAndSize
_bytes_from_size.restype = ctypes.py_object
_bytes_from_size.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
_bytes_data = ctypes.pythonapi.PyBytes_AsString
_bytes_data.restype = ctypes.c_void_p
_bytes_data.argtypes = (ctypes.py_object,)


def new_bytes(size: int) -> tuple[bytes, int]:
    """A new `bytes` of `size` bytes not yet written, and the address of its data.

    The C API lets the creator of PyBytes_FromStringAndSize(NULL, n) fill it before
    anyone else sees it: a value read from a peer lands straight in the object returned
    to the caller, instead of in a buffer that is then copied into a new bytes. The
    caller must write all `size` bytes before letting the object out (or drop it).
    """
    if size < 0:
        raise ParamInvalid(f"size must be >= 0, got {size}")
    value = _bytes_from_size(None, size)
    return value, (_bytes_data(value) if size else 0)


# Memory malloc keeps. A value read into a new `bytes` (the store's get / get_batch) is
# written into memory malloc has just taken: with glibc's defaults that is often fresh
# from the kernel, because allocations over the mmap threshold (128 KiB, raised only as
# mapped blocks are freed) get their own mapping and freed memory above the trim threshold
# goes back at once. Each first-touched page then faults, and on our VMs that costs more
# than the copy: 8 MiB into fresh pages 6.7 ms, into reused ones 0.45 ms (get_batch of 8 x
# 1 MiB: 7.1 ms -> 1.0 ms). So the store asks malloc to keep up to KEEP_FREED_DEFAULT of
# freed memory and to serve blocks up to glibc's ceiling from its heap.
KEEP_FREED_ENV = "HIXL_KEEP_FREED_MEMORY"
KEEP_FREED_DEFAULT = 256 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit hosts
#: the caller's own settings, which win over ours
_MALLOC_USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")
_malloc_kept: str | None = None
_malloc_lock = threading.Lock()


def keep_freed_memory(limit: int | None = None) -> str:
    """Tune glibc malloc once per process so freshly allocated values reuse warm pages
    (the why is above). `limit`: bytes of freed memory malloc may keep (default: the
    HIXL_KEEP_FREED_MEMORY environment variable, else 256 MiB); 0 leaves malloc alone,
    as do the caller's own MALLOC_*_THRESHOLD_ / GLIBC_TUNABLES malloc settings and a C
    library other than glibc. Returns what was done, in words (for the log)."""
    global _malloc_kept
    with _malloc_lock:
        if _malloc_kept is not None:
            return _malloc_kept
        _malloc_kept = _tune_malloc(limit)
        return _malloc_kept


def _tune_malloc(limit: int | None) -> str:
    if limit is None:
        text = os.environ.get(KEEP_FREED_ENV, "").strip()
        try:
            limit = parse_size(text, allow_zero=True) if text else KEEP_FREED_DEFAULT
        except ConfigError as exc:
            raise ConfigError(f"{KEEP_FREED_ENV}: {exc}") from None
    if limit <= 0:
        return f"malloc left as it is ({KEEP_FREED_ENV}=0)"
    user = [name for name in _MALLOC_USER_SETTINGS if name in os.environ]
    if "malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        user.append("GLIBC_TUNABLES")
    if user:
        return f"malloc left as it is (the caller set {', '.join(user)})"
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return "malloc left as it is (not glibc)"
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    mmap_threshold = min(_MMAP_THRESHOLD_MAX, limit)
    if not (mallopt(_M_TRIM_THRESHOLD, min(limit, 2**31 - 1))
            and mallopt(_M_MMAP_THRESHOLD, mmap_threshold)):
        return "malloc left as it is (mallopt refused the settings)"
    return (f"malloc keeps up to {limit} freed bytes and serves blocks up to "
            f"{mmap_threshold} from its heap ({KEEP_FREED_ENV})")


def load_fastwire() -> Any:
    """hixl._fastwire (hixl/_fastwire.c: the socket path's lone op and copy_runs, built by
    pip when a compiler is there); None without it, or with HIXL_FASTWIRE=0 (the same
    work in Python)."""
    if os.environ.get("HIXL_FASTWIRE", "1").strip() == "0":
        return None
    try:
        from hixl import _fastwire
    except ImportError:
        return None
    return _fastwire


_FASTWIRE = load_fastwire()
#: the compiled copy loop for array batches (copy_arrays), or None: numpy and ctypes
_FAST_COPY = getattr(_FASTWIRE, "copy_runs", None)
#: one move with streaming stores, or memmove without the compiled module. Streaming
#: (non-temporal) stores skip reading the destination's cache lines and leave the cache
#: alone: for writes into memory this process will not read next -- a remote segment --
#: they measured 1.3-1.6x a memmove from 4 KiB to 8784 KiB here (docs/benchmarks.md §9).
_STREAM_COPY = getattr(_FASTWIRE, "copy_stream", None) or ctypes.memmove


# Parallel copies. One thread's memcpy tops out near 7-12 GB/s on a VM core; two threads
# on two cores do 10-15 GB/s (measured: an 8784 KiB block into a mapped memfd, 12 -> 15
# GB/s). A hand-off to a worker costs ~20-50 µs, so only copies of PARALLEL_COPY_MIN bytes
# or more are split, in pieces of at least _COPY_PIECE_MIN. ctypes.memmove releases the
# GIL, so the workers copy while the calling thread copies its own share.
PARALLEL_COPY_MIN = 2 << 20
#: the same for streamed copies: one thread's streaming stores reach 20-25 GB/s here, so
#: below 8 MiB the hand-off costs more than a second thread gains (2 MiB: 82 µs on one
#: thread, 165 with the pool; 4 MiB from a cold source a tie; 8784 KiB from a cold source
#: 656 -> 476-555 µs with the pool)
PARALLEL_STREAM_MIN = 8 << 20 if _STREAM_COPY is not ctypes.memmove else PARALLEL_COPY_MIN
_COPY_PIECE_MIN = 1 << 20
COPY_THREADS = max(1, min(os.cpu_count() or 1, 4))
_memmove = ctypes.memmove
_copy_pool: ThreadPoolExecutor | None = None
_copy_pool_lock = threading.Lock()

Move = tuple[int, int, int]  # (destination address, source address, length)


def _pool() -> ThreadPoolExecutor:
    global _copy_pool
    if _copy_pool is None:
        with _copy_pool_lock:
            if _copy_pool is None:
                _copy_pool = ThreadPoolExecutor(COPY_THREADS - 1, thread_name_prefix="hixl-copy")
    return _copy_pool


def _forget_pool() -> None:
    """In a forked child the pool's threads do not exist: start a new pool when needed."""
    global _copy_pool, _copy_pool_lock
    _copy_pool, _copy_pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_pool)


def _run_moves(moves: Sequence[Move], stream: bool = False) -> None:
    """memmove (`stream`: copy with streaming stores) each move, looping in C (starmap
    drained by a zero-length deque): no Python bytecode per move, only the copy's call."""
    deque(starmap(_STREAM_COPY if stream else _memmove, moves), maxlen=0)


def _run_arrays(dst: np.ndarray, src: np.ndarray, lengths: np.ndarray,
                stream: bool = False) -> None:
    """_run_moves for moves given as arrays (copy_runs' work where it is not built)."""
    _run_moves(array_moves(dst, src, lengths), stream)


def array_moves(dst: np.ndarray, src: np.ndarray, lengths: np.ndarray) -> list[Move]:
    """(dst, src, length) moves from three parallel integer arrays (for copy_moves)."""
    return list(zip(dst.tolist(), src.tolist(), lengths.tolist(), strict=True))


_MOVES_PER_SHARE = 64  # fewer moves than this per thread: cut them by bytes (split_moves)
# Threads only pay for moves this large on average: each ctypes call takes the GIL back
# after its memmove, so threads issuing many small moves spend their time handing the GIL
# to each other (measured: 537 moves of 4 KiB on 2 threads, 2-3x slower than one).
PARALLEL_MOVE_MIN = 64 << 10


SMALL_MOVE_MAX = 8 << 10  # moves of one size up to this: copied by numpy, not per move
_SMALL_MOVES_MIN = 8


def _strided(addrs: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """A numpy array of `size`-byte items over the memory the moves at `addrs` touch (item
    stride: the gcd of their distances, so every address is an item), and each move's
    item index. Only the indexed items are ever read or written."""
    low = int(addrs.min())
    span = int(addrs.max()) + size - low
    offsets = addrs - low
    stride = int(np.gcd.reduce(offsets)) or size
    memory = (ctypes.c_char * span).from_address(low)
    items = np.ndarray(((span - size) // stride + 1,), dtype=f"V{size}", buffer=memory,
                       strides=(stride,))
    return items, offsets // stride


def _copy_small(dst: np.ndarray, src: np.ndarray, size: int) -> None:
    """Many moves of one small size: one numpy gather and one scatter over strided views
    (two passes over the bytes, but no call per move: at 4 KiB ~2x a memmove loop)."""
    to, at = _strided(dst, size)
    source, pick = _strided(src, size)
    to[at] = source[pick]


def copy_arrays(dst: np.ndarray, src: np.ndarray, lengths: np.ndarray,
                total: int | None = None, *, stream: bool = False) -> None:
    """copy_moves for moves given as three int64 arrays (an array batch); `stream` as
    copy_moves'.

    With hixl._fastwire every share of the moves is one C loop without the GIL
    (copy_runs: 4 KiB pages at memory speed); without it, many moves of one small size
    (pages up to SMALL_MOVE_MAX) are copied by numpy (_copy_small). Moves must not
    overlap one another.

    Why: cutting many moves into per-thread shares one move at a time (split_moves)
    costs more than copying small pages, and small moves are faster on one thread
    (PARALLEL_MOVE_MIN); with many large moves the shares are cut at move
    boundaries found by one searchsorted over the running byte count instead (shares
    then differ by at most one move's bytes).
    """
    fast = _FAST_COPY
    if fast is None and lengths.size >= _SMALL_MOVES_MIN:
        size = int(lengths.max())
        if size <= SMALL_MOVE_MAX and int(lengths.min()) == size:
            _copy_small(dst, src, size)
            return
    if total is None:
        total = int(lengths.sum())
    shares = _shares(total, stream) if total >= PARALLEL_MOVE_MIN * lengths.size else 1
    run = fast or _run_arrays  # one share's moves
    if shares <= 1:
        run(dst, src, lengths, stream)
        return
    if lengths.size < shares * _MOVES_PER_SHARE:
        copy_moves(array_moves(dst, src, lengths), total, stream=stream)
        return
    ends = np.cumsum(lengths)
    inner = np.searchsorted(ends, np.arange(1, shares) * (total // shares)) + 1
    cuts = [0, *np.minimum(inner, lengths.size).tolist(), lengths.size]
    parts = [(dst[a:b], src[a:b], lengths[a:b])
             for a, b in zip(cuts[:-1], cuts[1:], strict=True) if b > a]
    pool = _pool()
    futures: list[Future[None]] = [pool.submit(run, *part, stream) for part in parts[1:]]
    try:
        run(*parts[0], stream)
    finally:
        for future in futures:
            future.result()


def split_moves(moves: Sequence[Move], shares: int) -> list[list[Move]]:
    """Cut `moves` into `shares` lists of about equal bytes, in order, splitting a move
    where a share ends (every byte copied exactly once)."""
    total = sum(length for _, _, length in moves)
    target = -(-total // shares)
    out: list[list[Move]] = [[]]
    room = target
    for dst, src, length in moves:
        while length:
            if not room:
                out.append([])
                room = target
            take = min(length, room)
            out[-1].append((dst, src, take))
            dst, src, length, room = dst + take, src + take, length - take, room - take
    return out


def _shares(total: int, stream: bool) -> int:
    """How many threads copy `total` bytes (1: the caller alone)."""
    if total < (PARALLEL_STREAM_MIN if stream else PARALLEL_COPY_MIN):
        return 1
    return min(COPY_THREADS, total // _COPY_PIECE_MIN)


def copy_moves(moves: Sequence[Move], total: int | None = None, *,
               stream: bool = False) -> None:
    """memmove every (dst, src, length); large totals on several threads at once.

    Moves must not overlap each other (they are copied in parallel); each move alone may
    (memmove). `stream`: the destination is memory this process will not read next (a
    remote segment): moves of a page or more are copied with streaming stores, fenced
    before this returns. Returns when every byte is copied; a worker's exception is
    re-raised.
    """
    if total is None:
        total = sum(length for _, _, length in moves)
    shares = _shares(total, stream)
    if shares <= 1:
        _run_moves(moves, stream)
        return
    first, *rest = split_moves(moves, shares)
    pool = _pool()
    futures: list[Future[None]] = [pool.submit(_run_moves, share, stream) for share in rest]
    try:
        _run_moves(first, stream)
    finally:
        for future in futures:
            future.result()


@dataclass
class BufferRange:
    """Where a caller's buffer lives; `keepalive` pins the object while it is registered."""

    addr: int
    length: int
    readonly: bool
    keepalive: Any


def buffer_range(obj: Any) -> BufferRange:
    """Address and length of a contiguous buffer-protocol object (or torch tensor).

    Raises ParamInvalid, naming the type, for objects without a contiguous buffer.
    """
    if isinstance(obj, ShmSegment | Mapping):
        return BufferRange(obj.addr, obj.length, obj.readonly, obj)
    data_ptr = getattr(obj, "data_ptr", None)
    if callable(data_ptr) and hasattr(obj, "element_size"):  # torch.Tensor without importing torch
        if not obj.is_contiguous():
            raise ParamInvalid("tensor is not contiguous; call .contiguous() first")
        if obj.device.type != "cpu":
            raise ParamInvalid(f"tensor is on {obj.device}; hixl moves host memory only")
        return BufferRange(obj.data_ptr(), obj.numel() * obj.element_size(), False, obj)
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ParamInvalid("numpy array is not C-contiguous; use np.ascontiguousarray")
        return BufferRange(obj.ctypes.data, obj.nbytes, not obj.flags.writeable, obj)
    try:
        view = np.frombuffer(obj, dtype=np.uint8)
    except (TypeError, ValueError) as exc:
        raise ParamInvalid(
            f"{type(obj).__name__} is not a contiguous buffer-protocol object: {exc}") from None
    return BufferRange(view.ctypes.data, view.nbytes, not view.flags.writeable, (obj, view))


class FdGrant(NamedTuple):
    """What an owner hands a same-node peer to map one segment: an fd on the memory, the
    segment's `length` and its `offset` in that file (a range registered inside a bigger
    allocation starts past 0), and its liveness `slot` (hixl.segment_states; 0: none)."""

    fd: int
    length: int
    offset: int = 0
    slot: int = 0


class Mapping:
    """A shared mapping of a segment fd into this process (MAP_SHARED | MAP_POPULATE).

    Read-only mappings are PROT_READ: a stray write faults instead of corrupting a peer.
    `offset` (a multiple of mmap.ALLOCATIONGRANULARITY) maps from that file offset on.
    """

    def __init__(self, fd: int, length: int, *, writable: bool, offset: int = 0) -> None:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        try:
            self._mmap = mmap.mmap(fd, length, flags=mmap.MAP_SHARED | _MAP_POPULATE, prot=prot,
                                   offset=offset)
        except OSError as exc:
            if exc.errno == errno.EACCES:
                raise PermissionDenied(
                    f"cannot map {length} bytes {'read-write' if writable else 'read-only'}: "
                    "the fd does not allow it (segment is read-only?)") from None
            raise ResourceExhausted(f"cannot map {length} bytes of shared memory: {exc}") from None
        self._array = np.frombuffer(self._mmap, dtype=np.uint8)
        self.addr: int = self._array.ctypes.data
        self.length = length
        self.readonly = not writable

    def view(self) -> memoryview:
        """A memoryview of the whole mapping (read-only when the mapping is)."""
        return memoryview(self._array)

    def close(self) -> None:
        """Unmap; refused (BufferError) while someone still holds a view of the memory."""
        if self._mmap is None:
            return
        self._array = None  # type: ignore[assignment]
        self._mmap.close()
        self._mmap = None  # type: ignore[assignment]


_MEMFD_LABEL_MAX = 249  # memfd_create(2): longer names are EINVAL


def _memfd_label(name: str) -> str:
    """`name` as a memfd label (seen only in /proc/<pid>/fd): no NUL byte, at most 249
    bytes. Segment names come from clients; a label the kernel refuses must not fail the
    allocation."""
    label = name.replace("\0", "?").encode("utf-8", "replace")[:_MEMFD_LABEL_MAX]
    return label.decode("utf-8", "ignore")


class ShmSegment(Mapping):
    """A memfd-backed host segment owned by this process, mapped read-write once.

    Sealed against shrinking and growing before anyone else can get an fd on it, so no
    peer holding one can truncate it under the processes that map it."""

    def __init__(self, length: int, name: str = "hixl") -> None:
        if type(length) is not int or length <= 0:
            raise ParamInvalid(f"segment size must be a positive integer, got {length!r}")
        size = round_up(length)
        try:
            fd = os.memfd_create(_memfd_label(name), os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            raise ResourceExhausted(f"memfd_create failed: {exc}") from None
        try:
            os.ftruncate(fd, size)
            # F_SEAL_SEAL too: no holder of an fd may add seals of its own (a write seal
            # would stop every peer mapping it writable)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS | fcntl.F_SEAL_SEAL)
            super().__init__(fd, size, writable=True)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.requested = length
        self.name = name

    def export_fd(self, *, writable: bool) -> int:
        """A new fd for a peer: O_RDWR, or O_RDONLY so PROT_WRITE mappings are refused."""
        flags = os.O_RDWR if writable else os.O_RDONLY
        return os.open(f"/proc/self/fd/{self.fd}", flags | os.O_CLOEXEC)

    def close(self) -> None:
        super().close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
