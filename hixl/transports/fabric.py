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
on several threads for large totals) -- no Python bytecode per op. A WRITE's copies use
streaming stores: its bytes go to another process's memory, which this one does not read
next (hixl.memory). Around the copies it reads each segment's liveness
word (hixl.segment_states): a segment its owner deregistered, before or during the copy,
fails the transfer with ParamInvalid instead of taking bytes into withdrawn memory. After
the copies it reads the owner agent's life word (a robust futex the kernel marks when the
agent dies, hixl.segment_states), a load and no system call: a write into memory whose
owner died is reported FAILED, not silently lost.

A caller that reads one range again and again (the store's repeated get of a cached
key) may hold it as a `MappedRange`: each read is then one memmove and the same checks
after it, without a transfer around them.

Mappings are never unmapped under a running copy: each transfer holds the mappings it
uses, and `close` (disconnect) or a remap (new epoch) only drops this transport's
references; the kernel mapping goes with the last one, when the last copy using it ends.

Device memory as the local side (`transfer_device`, issue 21): each mapping a device copy
uses is host-registered with that device's copier once (a `_Pin`, holding the mapping),
then every op is one asynchronous copy between device memory and the mapping. A pin is
retired with its mapping (withdrawn segment, remap, close) and unregistered once no
device copy uses it -- always before the mapping it holds can be unmapped.
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
from hixl.memory import FdGrant, Mapping, Move, copy_arrays, copy_moves, load_fastwire, round_up
from hixl.segment_states import WORD, StateView
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


class MappedRange:
    """A range of a peer's segment as mapped here, held by a caller that reads it again and
    again itself: the store's repeated get of a cached key, which then costs one memmove
    and the checks a READ makes after its copy, instead of a transfer (resolve, batch,
    account). Holding it keeps the mapping alive, so a disconnect racing `read_into`
    never unmaps under it."""

    __slots__ = ("_transport", "_mapped", "_word", "addr", "length")

    def __init__(self, transport: FabricTransport, mapped: _Mapped, addr: int,
                 length: int) -> None:
        self._transport, self._mapped = transport, mapped
        self._word = transport._states.address + mapped.slot * WORD  # type: ignore[union-attr]
        self.addr, self.length = addr, length  # local (mapped) address and bytes

    def read_into(self, dst: int) -> bool:
        """Copy the range to `dst` (writable host memory of `length` bytes); False, with
        `dst` perhaps overwritten, when the copy did not surely read a served segment: the
        transport closed or remapped it (new epoch, withdrawn), or by the end of the copy
        its owner had deregistered it (its memory may then hold anything) or died (its
        values are gone with it, though its pages stay mapped here). The caller then asks
        anew, as after a failed READ transfer. One C call with the compiled module."""
        if _read_checked is None:
            return read_all((self,), (dst,))
        check = self._check()
        return check is not None and _read_checked(((dst, self.addr, self.length),), (check,))

    def _check(self) -> tuple[int, int, int] | None:
        """(liveness word, the value it must read, the owner's life word) for
        read_checked; None when its transport no longer maps the segment this way (closed,
        remapped, withdrawn)."""
        mapped, transport = self._mapped, self._transport
        segment_id = mapped.segment.segment_id
        if transport._mappings.get(segment_id) is not mapped:
            return None
        return (self._word, segment_id, transport._states.address)  # type: ignore[union-attr]


def read_all(ranges: Sequence[MappedRange], dsts: Sequence[int]) -> bool:
    """`read_into` of many ranges into `dsts` at once: each mapping's currency checked
    first (`_check`), then, in one C call (`_fastwire.read_checked`), the copies and each distinct
    segment's liveness word and owner's life word. False as `read_into` is."""
    moves = []
    checks: dict[int, tuple[int, int, int]] = {}  # liveness word -> its check
    for source, dst in zip(ranges, dsts, strict=True):
        check = source._check()
        if check is None:
            return False
        moves.append((dst, source.addr, source.length))
        checks[check[0]] = check
    if _read_checked is not None:
        return _read_checked(moves, list(checks.values()))
    copy_moves(moves)
    for source in ranges:
        states = source._transport._states
        if not states.holds(source._mapped.slot, source._mapped.segment.segment_id) \
                or not states.owner_alive():
            return False
    return True


_read_checked = getattr(load_fastwire(), "read_checked", None)


class _Pin:
    """A mapping host-registered with a device copier; `users` device transfers use it."""

    __slots__ = ("mapping", "copier", "registered", "users", "retired")

    def __init__(self, mapping: Mapping, copier: Any, registered: bool) -> None:
        self.mapping: Mapping | None = mapping  # held: never unmapped while registered
        self.copier = copier
        self.registered = registered
        self.users = 0
        self.retired = False


class FabricTransport(Transport):
    """Direct load/store into a same-domain peer's segments through shared mappings.

    `fd_client` is the owner agent's fd socket (hixl.client.agent_client.FdClient):
    `grant` (an fd to map) and `states` (the liveness words, the owner's life word first).
    """

    name = "fabric"

    def __init__(self, peer: str, fd_client: Any) -> None:
        self._peer = peer
        self._fd_client = fd_client
        self._mappings: dict[int, _Mapped] = {}  # segment id -> its mapping
        self._states: StateView | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._pins: dict[tuple[int, int], _Pin] = {}  # (segment id, id(copier)) -> its pin

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

    def mapped_range(self, segment: SegmentInfo, remote_addr: int, length: int) -> MappedRange:
        """[remote_addr, +length) of `segment` (checked by the caller to lie inside it) as a
        MappedRange; raises as `mapped` does."""
        hit = self.mapped(segment)
        return MappedRange(self, hit, remote_addr + hit.delta, length)

    def _forget(self, hit: _Mapped) -> None:
        """Drop a withdrawn segment's mapping (unmapped once no copy holds it)."""
        with self._lock:
            if self._mappings.get(hit.segment.segment_id) is hit:
                del self._mappings[hit.segment.segment_id]
            self._retire_pins(hit.segment.segment_id)

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
            self._retire_pins(segment.segment_id)
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
        # a WRITE lands in another process's memory: streamed stores (hixl.memory)
        self._copy(lambda: copy_moves(moves, stream=writing), used, deadline,
                   lambda: [it.index for it in items])

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
        self._copy(lambda: copy_arrays(dst, src, runs.lengths, runs.nbytes,
                                       stream=op is _WRITE), used, deadline,
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
        if not states.owner_alive() or self._fd_client.fileno() < 0:  # type: ignore[union-attr]
            if self._closed:  # our own disconnect closed the fd socket (after setting this)
                raise NotConnected(
                    f"disconnected from {self._peer} during the transfer; whether every "
                    "byte landed is unknown: retry it once connected again",
                    failed=failed())
            raise PeerUnavailable(
                f"the agent owning {self._peer}'s segments died during the transfer; "
                "the bytes did not reach a live segment", failed=failed())

    def close(self) -> None:
        """Later transfers raise NotConnected; mappings go when no copy uses them (host
        registrations of device copiers first)."""
        with self._lock:
            self._closed = True
            self._mappings = {}
            for key in list(self._pins):
                self._retire(self._pins.pop(key))

    # ------------------------------------------------------------ device memory

    def transfer_device(self, op: TransferOp, items: Sequence[Item], deadline: float,
                        copier: Any) -> None:
        """D2rH (WRITE) / rH2D (READ): `items`' local addresses are device memory served by
        `copier` (hixl.staging.DeviceCopier). Each segment is mapped and host-registered
        with the copier once; each op is one asynchronous copy between the device and
        the mapping; the call returns when the copier's event after the last one is
        reached, then checks liveness as `transfer` does. Mappings and registrations are
        held until every copy queued here is done, also when waiting fails."""
        if self._closed:
            raise NotConnected(f"fabric path to {self._peer} is closed")

        def failed() -> list[int]:
            return [it.index for it in items]

        if time.monotonic() > deadline:
            raise TransferTimeout(f"fabric transfer with {self._peer} passed its deadline",
                                  failed=failed())
        used: dict[int, _Mapped] = {}
        pins: list[_Pin] = []
        queued = done = False
        try:
            for item in items:
                segment_id = item.segment.segment_id
                if segment_id not in used:
                    hit = used[segment_id] = self.mapped(item.segment)
                    pins.append(self._pin(hit, copier))
            writing = op is _WRITE
            queued = True
            for item in items:
                mapped = item.remote_addr + used[item.segment.segment_id].delta
                if writing:
                    copier.to_host(mapped, item.local_addr, item.length)
                else:
                    copier.to_device(item.local_addr, mapped, item.length)
            copier.wait(copier.record(), deadline)
            done = True
        except HixlError as exc:
            if not exc.failed:
                exc.failed = failed()
            raise
        finally:
            if queued and not done:  # never unregister or unmap under a queued copy
                try:
                    copier.wait(copier.record(), time.monotonic() + 60.0)
                except HixlError as exc:
                    # wedged copies: their pins stay held (registered, mapped) for good
                    raise PeerUnavailable(f"device copies with {self._peer}'s mapped "
                                          f"segments did not finish: {exc}",
                                          failed=failed()) from exc
            for pin in pins:
                self._unpin(pin)
        self._check_after(used, failed)

    def _pin(self, hit: _Mapped, copier: Any) -> _Pin:
        key = (hit.segment.segment_id, id(copier))
        with self._lock:
            if self._closed:
                raise NotConnected(f"fabric path to {self._peer} is closed")
            pin = self._pins.get(key)
            if pin is not None and pin.mapping is not hit.mapping:
                self._retire(self._pins.pop(key))  # a mapping of an earlier epoch
                pin = None
            if pin is None:
                mapping = hit.mapping
                registered = copier.host_register(mapping.addr, round_up(mapping.length),
                                                  mapping.readonly)
                pin = self._pins[key] = _Pin(mapping, copier, registered)
            pin.users += 1
            return pin

    def _unpin(self, pin: _Pin) -> None:
        with self._lock:
            pin.users -= 1
            if pin.retired and pin.users == 0:
                self._unregister(pin)

    def _retire_pins(self, segment_id: int) -> None:
        """(lock held) The segment's mapping goes: so do its host registrations."""
        for key in [key for key in self._pins if key[0] == segment_id]:
            self._retire(self._pins.pop(key))

    def _retire(self, pin: _Pin) -> None:
        pin.retired = True
        if pin.users == 0:
            self._unregister(pin)

    @staticmethod
    def _unregister(pin: _Pin) -> None:
        mapping, pin.mapping = pin.mapping, None
        if pin.registered and mapping is not None:
            pin.registered = False
            pin.copier.host_unregister(mapping.addr)
        del mapping  # the mapping may be unmapped from here on, never before
