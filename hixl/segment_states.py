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
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading

import numpy as np

from hixl.errors import ResourceExhausted
from hixl.memory import SIZE_SEALS

WORD = 8
#: Slots per agent: 8 MiB of sparse memfd (a page is allocated only once a slot on it is
#: used), so as many shareable segments as any agent serves.
DEFAULT_CAPACITY = 1 << 20


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
        self._next = 1  # slot 0 is never handed out: 0 reads as "no slot"

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
        """Clear every word (peers still mapping it see every segment gone) and let go."""
        with self._lock:
            if self.fd < 0:
                return
            self._words[:] = 0
            self._words = None  # type: ignore[assignment]
            self._mmap.close()
            os.close(self.fd)
            self.fd = -1


class StateView:
    """A peer's read-only view of an owner's words; `holds(slot, id)` costs ~50 ns."""

    def __init__(self, fd: int, capacity: int) -> None:
        self._mmap = mmap.mmap(fd, capacity * WORD, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        self._words = memoryview(self._mmap).cast("Q")
        self.capacity = capacity
        #: where slot 0's word is mapped in this process (a C reader checks a word itself)
        self.address = int(np.frombuffer(self._mmap, np.uint64).ctypes.data)

    def holds(self, slot: int, segment_id: int) -> bool:
        """True while the owner still serves `segment_id` in `slot`."""
        return self._words[slot] == segment_id
