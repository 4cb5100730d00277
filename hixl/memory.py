"""Host memory: shm-backed segments that peers can map, and caller buffers.

A `ShmSegment` is a memfd (anonymous, freed with its last fd or mapping) mapped once with
MAP_POPULATE, so its pages are faulted in at creation and never per transfer. Its fd can
be handed to local peers over a unix socket; a read-only peer gets a fresh O_RDONLY fd,
so the kernel itself refuses a writable mapping.
"""

from __future__ import annotations

import errno
import mmap
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from hixl.errors import ParamInvalid, PermissionDenied, ResourceExhausted

PAGE_SIZE = mmap.PAGESIZE
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def round_up(n: int, to: int = PAGE_SIZE) -> int:
    return (n + to - 1) // to * to


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


class Mapping:
    """A shared mapping of a segment fd into this process (MAP_SHARED | MAP_POPULATE).

    Read-only mappings are PROT_READ: a stray write faults instead of corrupting a peer.
    """

    def __init__(self, fd: int, length: int, *, writable: bool) -> None:
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        try:
            self._mmap = mmap.mmap(fd, length, flags=mmap.MAP_SHARED | _MAP_POPULATE, prot=prot)
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
    """A memfd-backed host segment owned by this process, mapped read-write once."""

    def __init__(self, length: int, name: str = "hixl") -> None:
        if type(length) is not int or length <= 0:
            raise ParamInvalid(f"segment size must be a positive integer, got {length!r}")
        size = round_up(length)
        try:
            fd = os.memfd_create(_memfd_label(name), os.MFD_CLOEXEC)
        except OSError as exc:
            raise ResourceExhausted(f"memfd_create failed: {exc}") from None
        try:
            os.ftruncate(fd, size)
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
