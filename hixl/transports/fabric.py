"""The fabric path: map a peer's shareable segments once, then memmove — no RPC per op.

The initiator receives each segment's fd from the owner agent (SCM_RIGHTS over its unix
socket) with the segment's offset in that file: a range registered inside a bigger
`malloc_mem` allocation shares the allocation's memfd, and only the pages holding the
range are mapped (MAP_SHARED|MAP_POPULATE; PROT_READ when the segment is read-only, so
the kernel refuses stray writes). Every op was checked against the segment's own range
before it got here, so the bytes of a partial first or last page that lie outside the
range are mapped but never touched.

A transfer is one memmove per op (per run of ops that continue each other, for an array
batch: `transfer_runs`), issued by one C-level loop over the moves (hixl.memory.copy_moves,
on several threads for large totals) -- no Python bytecode per op. Around the copies it reads each segment's liveness
word (hixl.segment_states): a segment its owner deregistered, before or during the copy,
fails the transfer with ParamInvalid instead of taking bytes into withdrawn memory. After
the copies it checks, for ~1 µs, that the owner agent is still alive: a write into memory
whose owner died is reported FAILED, not silently lost.

Mappings are never unmapped under a running copy: each transfer holds the mappings it
uses, and `close` (disconnect) or a remap (new epoch) only drops this transport's
references; the kernel mapping goes with the last one, when the last copy using it ends.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from hixl.errors import HixlError, NotConnected, ParamInvalid, PeerUnavailable, TransferTimeout
from hixl.memory import FdGrant, Mapping, Move, copy_arrays, copy_moves
from hixl.segment_states import StateView
from hixl.transports.base import Item, Runs, Transport
from hixl.types import Perm, SegmentInfo, TransferOp

_WRITE = TransferOp.WRITE  # a module constant: `TransferOp.WRITE` is a class lookup per call
_GRANULE = mmap.ALLOCATIONGRANULARITY


class _Mapped(NamedTuple):
    """One mapped segment: owner address + `delta` = local address."""

    segment: SegmentInfo
    delta: int
    slot: int
    mapping: Mapping


class FabricTransport(Transport):
    """Direct load/store into a same-domain peer's segments through shared mappings.

    `fd_client` is the owner agent's fd socket (hixl.client.agent_client.FdClient):
    `grant` (an fd to map), `states` (the liveness words) and `alive` (hang-up check).
    """

    name = "fabric"

    def __init__(self, peer: str, fd_client: Any) -> None:
        self._peer = peer
        self._fd_client = fd_client
        self._mappings: dict[int, _Mapped] = {}  # segment id -> its mapping
        self._states: StateView | None = None
        self._lock = threading.Lock()
        self._closed = False

    def mapped(self, segment: SegmentInfo) -> _Mapped:
        """The mapping of `segment`, made on first use (one fd fetch, one mmap of the
        pages holding it); later calls are a dict hit. Raises ParamInvalid if its owner
        has deregistered it."""
        hit = self._mappings.get(segment.segment_id)
        if hit is None or hit.segment.epoch != segment.epoch:
            hit = self._map(segment)
        if not self._states.holds(hit.slot, segment.segment_id):  # type: ignore[union-attr]
            self._forget(hit)
            raise self._gone(segment, "before")
        return hit

    def _forget(self, hit: _Mapped) -> None:
        """Drop a withdrawn segment's mapping (unmapped once no copy holds it)."""
        with self._lock:
            if self._mappings.get(hit.segment.segment_id) is hit:
                del self._mappings[hit.segment.segment_id]

    def _map(self, segment: SegmentInfo) -> _Mapped:
        with self._lock:
            if self._closed:
                raise NotConnected(f"fabric path to {self._peer} is closed")
            hit = self._mappings.get(segment.segment_id)
            if hit is not None and hit.segment.epoch == segment.epoch:
                return hit
            if self._states is None:
                self._states = self._fd_client.states()
            writable = bool(segment.perms & Perm.WRITE)
            grant: FdGrant = self._fd_client.grant(segment.segment_id, segment.epoch, writable)
            try:
                if grant.length < segment.length or not 0 < grant.slot < self._states.capacity:
                    raise PeerUnavailable(
                        f"{self._peer} granted segment {segment.segment_id} as {grant}, which "
                        f"does not cover its {segment.length} bytes with a liveness slot")
                start = grant.offset - grant.offset % _GRANULE  # mmap offsets are page-aligned
                mapping = Mapping(grant.fd, grant.offset - start + segment.length,
                                  writable=writable, offset=start)
            finally:
                os.close(grant.fd)
            # a remap (new epoch) only drops the old mapping: a copy still using it keeps it
            hit = _Mapped(segment, mapping.addr + grant.offset - start - segment.base,
                          grant.slot, mapping)
            self._mappings[segment.segment_id] = hit
            return hit

    def _gone(self, segment: SegmentInfo, when: str) -> ParamInvalid:
        return ParamInvalid(
            f"segment {segment.segment_id} [{segment.base:#x}, +{segment.length}) of "
            f"{self._peer} was deregistered by its owner {when} this transfer; it is not "
            "served there any more (register it again, then look it up anew)")

    def transfer(self, op: TransferOp, items: Sequence[Item], deadline: float) -> None:
        """The ops of a list batch as moves (one mapping lookup per segment change), then
        the same copy as `transfer_runs`."""
        if self._closed:
            raise NotConnected(f"fabric path to {self._peer} is closed")
        writing = op is _WRITE
        segment: SegmentInfo | None = None
        delta = 0
        used: dict[int, _Mapped] = {}  # held until the copies are checked: never unmapped under us
        moves: list[Move] = []
        try:
            for item in items:
                if item.segment is not segment:
                    segment = item.segment
                    hit = used.get(segment.segment_id) or self.mapped(segment)
                    used[segment.segment_id] = hit
                    delta = hit.delta
                remote = item.remote_addr + delta
                moves.append((remote, item.local_addr, item.length) if writing
                             else (item.local_addr, remote, item.length))
        except HixlError as exc:
            if not exc.failed:
                exc.failed = [it.index for it in items]
            raise
        self._copy(lambda: copy_moves(moves), used, deadline, lambda: [it.index for it in items])

    def transfer_runs(self, op: TransferOp, runs: Runs, deadline: float) -> None:
        """An array batch: each segment mapped once, every run's mapped address computed
        in one numpy operation, the copies issued by one C-level loop (copy_moves)."""
        if self._closed:
            raise NotConnected(f"fabric path to {self._peer} is closed")
        used: dict[int, _Mapped] = {}
        try:
            for segment in runs.segments:
                used[segment.segment_id] = self.mapped(segment)
        except HixlError as exc:
            if not exc.failed:
                exc.failed = runs.failed()
            raise
        if len(runs.segments) == 1:
            remote = runs.remote + used[runs.segments[0].segment_id].delta
        else:
            deltas = np.array([used[s.segment_id].delta for s in runs.segments], np.int64)
            remote = runs.remote + deltas[runs.seg]
        dst, src = (remote, runs.local) if op is _WRITE else (runs.local, remote)
        self._copy(lambda: copy_arrays(dst, src, runs.lengths, runs.nbytes), used, deadline,
                   runs.failed)

    def _copy(self, copy: Callable[[], None], used: dict[int, _Mapped], deadline: float,
              failed: Callable[[], list[int]]) -> None:
        """Run `copy` (every move; large totals on several threads, hixl.memory), then the
        liveness checks. The copy is bounded memory work, so the deadline is checked
        once, before it: a transfer past it moves nothing."""
        if time.monotonic() > deadline:
            raise TransferTimeout(f"fabric transfer with {self._peer} passed its deadline",
                                  failed=failed())
        copy()
        self._check_after(used, failed)

    def _check_after(self, used: dict[int, _Mapped], failed: Callable[[], list[int]]) -> None:
        """After the copies: each segment still served (so the copy finished before any
        deregistration), and its owner alive."""
        states = self._states
        for hit in used.values():
            if not states.holds(hit.slot, hit.segment.segment_id):  # type: ignore[union-attr]
                self._forget(hit)
                error = self._gone(hit.segment, "during")
                error.failed = failed()
                raise error
        if not self._fd_client.alive():
            if self._closed:  # our own disconnect closed the fd socket (after setting this)
                raise NotConnected(
                    f"disconnected from {self._peer} during the transfer; whether every "
                    "byte landed is unknown: retry it once connected again",
                    failed=failed())
            raise PeerUnavailable(
                f"the agent owning {self._peer}'s segments died during the transfer; "
                "the bytes did not reach a live segment", failed=failed())

    def close(self) -> None:
        """Later transfers raise NotConnected; mappings go when no copy uses them."""
        with self._lock:
            self._closed = True
            self._mappings = {}
