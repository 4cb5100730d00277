"""The fabric path: map a peer's shareable segments once, then memmove — no RPC per op.

The initiator receives each segment's fd from the owner agent (SCM_RIGHTS over its unix
socket), maps it MAP_SHARED|MAP_POPULATE — PROT_READ when the segment is read-only, so the
kernel refuses stray writes — and keeps the mapping until disconnect. A transfer is then
one memmove per op. After the copies it checks, for ~1 µs, that the owner agent is still
alive: a write into memory whose owner died is reported FAILED, not silently lost.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable, Sequence

from hixl.errors import HixlError, NotConnected, PeerUnavailable, TransferTimeout
from hixl.memory import PARALLEL_COPY_MIN, Mapping, copy_moves
from hixl.transports.base import Item, Transport
from hixl.types import Perm, SegmentInfo, TransferOp

FetchFd = Callable[[int, int, bool], tuple[int, int]]  # (segment_id, epoch, writable) -> (fd, len)

_memmove = ctypes.memmove
_WRITE = TransferOp.WRITE  # a module constant: `TransferOp.WRITE` is a class lookup per call


class FabricTransport(Transport):
    """Direct load/store into a same-domain peer's segments through shared mappings."""

    name = "fabric"

    def __init__(self, peer: str, fetch_fd: FetchFd, alive: Callable[[], bool]) -> None:
        self._peer = peer
        self._fetch_fd = fetch_fd
        self._alive = alive
        self._mappings: dict[int, tuple[int, int, Mapping]] = {}  # segment id -> (epoch, delta, map)
        self._lock = threading.Lock()
        self._closed = False
        self._last: tuple[SegmentInfo | None, int] = (None, 0)

    def mapping_delta(self, segment: SegmentInfo) -> int:
        """Offset to add to an owner address of `segment` to get the local mapped address.

        Maps the segment on first use (one fd fetch, one mmap); later calls are a dict hit.
        """
        hit = self._mappings.get(segment.segment_id)
        if hit is not None and hit[0] == segment.epoch:
            return hit[1]
        with self._lock:
            if self._closed:
                raise NotConnected(f"fabric path to {self._peer} is closed")
            hit = self._mappings.get(segment.segment_id)
            if hit is not None and hit[0] == segment.epoch:
                return hit[1]
            writable = bool(segment.perms & Perm.WRITE)
            fd, length = self._fetch_fd(segment.segment_id, segment.epoch, writable)
            try:
                mapping = Mapping(fd, min(length, segment.length), writable=writable)
            finally:
                os.close(fd)
            if hit is not None:
                hit[2].close()
            delta = mapping.addr - segment.base
            self._mappings[segment.segment_id] = (segment.epoch, delta, mapping)
            return delta

    def transfer(self, op: TransferOp, items: Sequence[Item], deadline: float) -> None:
        if self._closed:
            raise NotConnected(f"fabric path to {self._peer} is closed")
        writing = op is _WRITE
        segment, delta = self._last  # the segment the previous call ended in, and its delta
        if len(items) <= 64 and sum(item.length for item in items) >= PARALLEL_COPY_MIN:
            self._copy_large(writing, items)  # a few large ops: copied on several threads
            return
        done = 0
        try:
            for item in items:
                if item.segment is not segment:
                    segment = item.segment
                    delta = self.mapping_delta(segment)
                    self._last = (segment, delta)
                if writing:
                    _memmove(item.remote_addr + delta, item.local_addr, item.length)
                else:
                    _memmove(item.local_addr, item.remote_addr + delta, item.length)
                done += 1
                if done & 63 == 0 and time.monotonic() > deadline:
                    raise TransferTimeout(f"fabric transfer with {self._peer} passed its deadline")
        except HixlError as exc:
            if not exc.failed:
                exc.failed = [it.index for it in items[done:]]
            raise
        self._check_alive(items)

    def _copy_large(self, writing: bool, items: Sequence[Item]) -> None:
        """A few ops of many bytes in all: one parallel copy (hixl.memory.copy_moves), then
        the owner liveness check. The copy is bounded memory work, so the deadline is not
        polled inside it."""
        moves = []
        try:
            for item in items:
                delta = self.mapping_delta(item.segment)
                remote = item.remote_addr + delta
                moves.append((remote, item.local_addr, item.length) if writing
                             else (item.local_addr, remote, item.length))
        except HixlError as exc:
            if not exc.failed:
                exc.failed = [it.index for it in items]
            raise
        self._last = (items[-1].segment, delta)
        copy_moves(moves)
        self._check_alive(items)

    def _check_alive(self, items: Sequence[Item]) -> None:
        if not self._alive():
            raise PeerUnavailable(
                f"the agent owning {self._peer}'s segments died during the transfer; "
                "the bytes did not reach a live segment", failed=[it.index for it in items])

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._last = (None, 0)
            mappings, self._mappings = self._mappings, {}
        for _, _, mapping in mappings.values():
            mapping.close()
