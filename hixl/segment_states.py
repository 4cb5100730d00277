"""Liveness words for mapped segments: how a same-node peer learns, with no RPC, that a
segment it has mapped was deregistered.

A peer on the mapped (fabric) path copies with `memmove` and never asks the owner agent
per op, so without help it would go on writing into memory the owner has withdrawn.
Each agent therefore keeps one small memfd of 64-bit words, one *slot* per shareable
segment it serves, holding that segment's id while it is registered and 0 once it is
not. Peers map the page read-only (the fd is handed out O_RDONLY) and read the segment's
word before and after every copy; a copy that does not see its segment's id both times
is reported as failed (ParamInvalid, like the socket path's UNKNOWN_SEGMENT).

Ordering: the owner clears the word before `deregister` returns. A copy that reads the
word after it, and sees the id still there, finished its bytes before the owner cleared
it (CPython releases and re-takes the GIL around the `memmove` call, a locked instruction
and so a full fence on x86-64 and arm64, between the copy and the second read). A copy
that overlapped the clear reads 0 afterwards and fails, so no transfer that touched a
withdrawn segment is ever reported SUCCESS. What a failed, overlapping WRITE left in the
withdrawn range is the caller's to rewrite, as after any failed write.

Slots are reused; segment ids never are (within one agent life), so a peer holding an
old slot number reads another segment's id there and fails as it should.

Slot 0 holds no segment: its first 32 bits are the agent's *life word*, a robust futex
(the kernel's Documentation/locking/robust-futex-ABI.rst) that a thread of the agent
owns for the agent's whole life (`_LifeWord`). When the agent dies, by any signal, the
kernel itself marks the word FUTEX_OWNER_DIED while tearing the process down, before it
closes the agent's file descriptors and long before a parent can reap it. A peer reads
the word after each copy, as it reads the segment's: a plain load, no system call. It
replaced a zero-timeout poll() on the agent's unix socket (~1 µs, most of what a cached
64 KiB get costs over its copy) and is never later than the socket's hang-up was.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import platform
import threading

import numpy as np

from hixl.errors import HixlError, ResourceExhausted
from hixl.memory import SIZE_SEALS

WORD = 8
#: Slots per agent: 8 MiB of sparse memfd (a page is allocated only once a slot on it is
#: used), so as many shareable segments as any agent serves.
DEFAULT_CAPACITY = 1 << 20
#: a robust futex's bits (linux/futex.h): the owner's thread id, and "the owner died"
FUTEX_TID_MASK = 0x3FFFFFFF
FUTEX_OWNER_DIED = 0x40000000
#: (set_robust_list, get_robust_list) system call numbers per machine
_ROBUST_LIST_CALLS = {"x86_64": (273, 274), "aarch64": (99, 100), "arm64": (99, 100),
                      "riscv64": (99, 100), "ppc64le": (300, 299), "s390x": (304, 305)}


def owner_alive(word: int) -> bool:
    """Whether a life word (its 32 bits) still names a live owner thread."""
    return bool(word & FUTEX_TID_MASK) and not word & FUTEX_OWNER_DIED


class _RobustList(ctypes.Structure):
    """struct robust_list_head (linux/futex.h: next, futex_offset, list_op_pending), then
    the list's one entry (a struct robust_list: its `next`), which the futex_offset
    leads from to the life word."""

    _fields_ = [("next", ctypes.c_void_p), ("futex_offset", ctypes.c_long),
                ("pending", ctypes.c_void_p), ("entry_next", ctypes.c_void_p)]


_HEAD_SIZE = _RobustList.entry_next.offset  # sizeof(struct robust_list_head)


class _LifeWord:
    """A thread that owns the robust futex at `address` until `stop`: it registers a robust
    list whose one entry is that word, then writes its thread id into it. If the process
    dies while the word holds that id, the kernel sets FUTEX_OWNER_DIED in it (and clears
    the id) on the way out, whatever killed it.

    The thread registers its own list in place of the C library's (set_robust_list keeps
    one list per thread) and restores the library's before it ends; it locks no pthread
    robust mutex meanwhile, so nothing of the library's is lost."""

    def __init__(self, address: int) -> None:
        calls = _ROBUST_LIST_CALLS.get(platform.machine())
        if calls is None:
            raise HixlError(f"segment states: no robust-futex system call numbers known for "
                            f"machine {platform.machine()!r}; mapped peers cannot see this "
                            "agent die")
        self._set_call, self._get_call = calls
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._head = _RobustList()  # held here, so the kernel never walks freed memory
        entry = ctypes.addressof(self._head) + _HEAD_SIZE
        self._head.next = entry
        self._head.entry_next = ctypes.addressof(self._head)  # the list closes on the head
        self._head.futex_offset = address - entry
        self._head.pending = None
        self._word = ctypes.c_uint32.from_address(address)
        self._stop = threading.Event()
        self._started = threading.Event()
        self._error: OSError | None = None
        self._thread = threading.Thread(target=self._hold, name="hixl-life-word", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            self._thread.join()
            raise HixlError(f"segment states: cannot own the agent's life word "
                            f"(set_robust_list: {self._error}); mapped peers could not "
                            "see this agent die") from self._error

    def _robust_list(self, call: int, *args: object) -> None:
        """syscall(call, *args), every argument passed at its C width (ctypes would pass a
        bare int as a 32-bit int to the variadic `syscall`)."""
        if self._libc.syscall(ctypes.c_long(call), *args) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))

    def _hold(self) -> None:
        theirs, size = ctypes.c_void_p(), ctypes.c_size_t()
        try:
            self._robust_list(self._get_call, ctypes.c_long(0), ctypes.byref(theirs),
                              ctypes.byref(size))
            self._robust_list(self._set_call, ctypes.byref(self._head),
                              ctypes.c_size_t(_HEAD_SIZE))
        except OSError as exc:
            self._error = exc
            self._started.set()
            return
        self._word.value = threading.get_native_id()  # only now: the kernel watches it
        self._started.set()
        self._stop.wait()
        self._word.value = 0  # a clean stop is no death
        if theirs.value:  # the C library's list back (with none, ours stays: it is harmless)
            self._robust_list(self._set_call, theirs, size)

    def stop(self) -> None:
        """Clear the word (peers read the agent gone) and end the thread."""
        self._stop.set()
        self._thread.join()


class SegmentStates:
    """The owner's side: claims a slot per shareable segment and clears it on deregister."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self.capacity = capacity
        self.fd = os.memfd_create("hixl-segment-states", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, capacity * WORD)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, SIZE_SEALS | fcntl.F_SEAL_SEAL)
            self._mmap = mmap.mmap(self.fd, capacity * WORD, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(self.fd)
            raise
        self._words = np.frombuffer(self._mmap, dtype=np.uint64)
        self._lock = threading.Lock()
        self._free: list[int] = []
        self._next = 1  # slot 0 is never handed out: 0 reads as "no slot"; it holds:
        try:
            self._life = _LifeWord(int(self._words.ctypes.data))
        except BaseException:
            self._words = None  # type: ignore[assignment]
            self._mmap.close()
            os.close(self.fd)
            raise

    def claim(self, segment_id: int) -> int:
        """A slot now holding `segment_id` (> 0)."""
        with self._lock:
            if self._free:
                slot = self._free.pop()
            elif self._next < self.capacity:
                slot, self._next = self._next, self._next + 1
            else:
                raise ResourceExhausted(
                    f"this agent serves {self.capacity - 1} shareable segments already; "
                    "deregister some before registering more")
            self._words[slot] = segment_id
            return slot

    def release(self, slot: int) -> None:
        """Clear the slot (peers see the segment gone at once), then let it be reused."""
        with self._lock:
            self._words[slot] = 0
            self._free.append(slot)

    def export_fd(self) -> int:
        """A new O_RDONLY fd on the words, for a peer to map: it can read, never write."""
        return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        """Clear every word (peers still mapping it see every segment gone, and the agent
        gone) and let go."""
        with self._lock:
            if self.fd < 0:
                return
            self._words[:] = 0
            self._life.stop()
            self._words = None  # type: ignore[assignment]
            self._mmap.close()
            os.close(self.fd)
            self.fd = -1


class StateView:
    """A peer's read-only view of an owner's words; `holds(slot, id)` costs ~50 ns."""

    def __init__(self, fd: int, capacity: int) -> None:
        self._mmap = mmap.mmap(fd, capacity * WORD, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        self._words = memoryview(self._mmap).cast("Q")
        self._life = memoryview(self._mmap)[:4].cast("I")
        self.capacity = capacity
        #: where slot 0's word (the life word first) is mapped in this process (a C reader
        #: checks the words itself)
        self.address = int(np.frombuffer(self._mmap, np.uint64).ctypes.data)

    def holds(self, slot: int, segment_id: int) -> bool:
        """True while the owner still serves `segment_id` in `slot`."""
        return self._words[slot] == segment_id

    def owner_alive(self) -> bool:
        """True while the owner agent lives and has not closed its states: one load."""
        return owner_alive(self._life[0])
