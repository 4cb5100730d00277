"""The agent's domain object: the segments this agent serves, with no networking inside.

One class serves both shapes of agent: the standalone daemon (segments it allocates from
its own DRAM pool, or maps from fds local clients deposit) and the agent embedded in an
engine (the caller's own registered memory). The gRPC servicer, the fd socket and the
data server are thin adapters over it.

Threading: mutations take one lock; `resolve()` — called by data-server threads for every
frame — is a plain dict read with no lock (dict get/set are atomic under the GIL, and an
entry is fully built before it is published).
"""

from __future__ import annotations

import contextlib
import ctypes
import hmac
import itertools
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hixl import wire
from hixl.control import segment_to_pb
from hixl.errors import (
    HixlError,
    OutOfRange,
    ParamInvalid,
    PermissionDenied,
    ResourceExhausted,
    StaleEpoch,
)
from hixl.memory import FdGrant, Mapping, ShmSegment, round_up, size_sealed
from hixl.segment_states import SegmentStates
from hixl.table import AddressTable, check_range
from hixl.types import MemType, Perm, SegmentInfo, check_allowed_engines

log = logging.getLogger("hixl.agent")

#: a change event: ("ADDED" | "REMOVED", the segments concerned)
Listener = Callable[[str, list[SegmentInfo]], None]

ADDED = "ADDED"
REMOVED = "REMOVED"


#: Why an unsealed fd is refused, and how to make one that is accepted.
UNSEALED = ("{what}: the file is not sealed against shrinking and growing: anyone holding "
            "an fd on it could truncate it under the agent, which would then crash (SIGBUS) "
            "on its next access; create it with memfd_create(MFD_ALLOW_SEALING) and add "
            "F_SEAL_SHRINK | F_SEAL_GROW after sizing it (hixl.memory.ShmSegment does)")

#: Default of the config key `max_segments`: segments clients may hold at once
#: (AllocateSegment and RegisterSegment together; the pool and an embedded engine's own
#: registrations do not count). Each holds two fds and a mapping in the agent.
MAX_SEGMENTS = 4096
#: A segment name's limit in UTF-8 bytes: Mooncake transfer notifications travel as the
#: names of 1-byte segments (client/mooncake, at most 64 KiB), so names stay that long;
#: the table limit below is what keeps replies small.
MAX_NAME_BYTES = 64 << 10
#: An owner's limit in UTF-8 bytes (an engine name, "host:port", is at most 255).
MAX_OWNER_BYTES = 256
#: The most bytes the segment table may take serialized: Handshake, ListSegments and the
#: WatchSegments snapshot carry all of it, and clients receive at most 4 MiB a reply
#: (gRPC's default); 3 MiB leaves room for the rest of the reply.
TABLE_BYTES_LIMIT = 3 << 20


def segment_ceiling() -> tuple[int, str]:
    """The most segments this process can hold safely, and what sets it: a quarter of the
    soft RLIMIT_NOFILE (each segment keeps two fds, its file's and the one mmap keeps, so
    segments take at most half; the rest is for connections) and half of
    vm.max_map_count (each keeps a mapping; the rest is for the interpreter)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    ceiling, why = 1 << 62, ""
    if soft != resource.RLIM_INFINITY and soft // 4 < ceiling:
        ceiling, why = soft // 4, (f"a quarter of the open-files limit (ulimit -n {soft}; "
                                   "each segment keeps 2 fds)")
    try:
        with open("/proc/sys/vm/max_map_count", encoding="ascii") as f:
            maps = int(f.read().strip())
    except (OSError, ValueError):
        maps = 0
    if maps and maps // 2 < ceiling:
        ceiling, why = maps // 2, f"half of vm.max_map_count ({maps})"
    return max(ceiling, 1), why


def _check_text(value: object, what: str, limit: int) -> str:
    """`value` if it is a string of at most `limit` UTF-8 bytes, else ParamInvalid."""
    if not isinstance(value, str):
        raise ParamInvalid(f"segment {what} must be a string, got {type(value).__name__}")
    size = len(value.encode("utf-8", "surrogatepass"))
    if size > limit:
        raise ParamInvalid(f"segment {what} is {size} bytes (UTF-8); at most {limit} are "
                           f"allowed ({what} limit of the agent)")
    return value


def _table_bytes(info: SegmentInfo) -> int:
    """What one segment adds to a reply carrying the table (its tag and length too)."""
    size = segment_to_pb(info).ByteSize()
    return size + 1 + max(1, (size.bit_length() + 6) // 7)


EPOCH_ORIGIN_S = 1_767_225_600  # 2026-01-01T00:00:00Z


def new_epoch() -> int:
    """A nonzero u32 that grows with each restart: tenths of a second since 2026.

    Growing (not random) so the registry can tell a restart (newer epoch, replaces the
    old lease) from a zombie (older epoch, refused). An agent takes far longer than
    0.1 s to restart, so two lives of one engine never share an epoch; it wraps after
    13 years.
    """
    return (int((time.time() - EPOCH_ORIGIN_S) * 10) % 0xFFFF_FFFF) + 1


def _reopen(fd: int, writable: bool) -> int:
    """A fresh fd on the same file, O_RDONLY or O_RDWR (so read-only peers cannot map it rw)."""
    return os.open(f"/proc/self/fd/{fd}", (os.O_RDWR if writable else os.O_RDONLY) | os.O_CLOEXEC)


@dataclass(eq=False)
class _Entry:
    info: SegmentInfo
    served: wire.ServedSegment
    kind: str                       # "allocated" | "memory" | "fd"
    owner: str
    charged: int = 0                # bytes charged to pool_max_bytes
    export: Callable[[bool], int] | None = None   # writable -> new fd; None = not shareable
    owned: list[Any] = field(default_factory=list)  # Mapping / fd ints to release
    offset: int = 0                 # where the segment starts in the exported file
    slot: int = 0                   # its liveness word (hixl.segment_states); 0: none
    # proof a remote caller must give to deregister it: the client that allocated or
    # registered it over gRPC got it; b"": only this process may (pool, embedded memory)
    release_key: bytes = b""
    limited: bool = False           # counts against max_segments (created by a client)
    table_bytes: int = 0            # what it adds to a reply carrying the table


class Agent:
    """Segments served by one agent process, keyed by segment id and by address."""

    def __init__(self, engine_name: str, node_id: str, *, pool_max_bytes: int = 1 << 30,
                 epoch: int | None = None, max_segments: int = MAX_SEGMENTS) -> None:
        """`max_segments`: segments clients may hold at once (config key max_segments);
        lowered to what the process can hold (`segment_ceiling`), logged once."""
        self.engine_name = engine_name
        self.node_id = node_id
        self.epoch = epoch if epoch is not None else new_epoch()
        self.pool_max_bytes = pool_max_bytes
        ceiling, why = segment_ceiling()
        self.max_segments = min(max_segments, ceiling)
        #: why max_segments is what it is, for refusals
        self._limit_reason = f"config key 'max_segments'={max_segments}"
        if ceiling < max_segments:
            self._limit_reason += f", lowered to {why}"
            log.warning("max_segments %d lowered to %d: %s; raise the limit to allow more",
                        max_segments, ceiling, why)
        self._limited = 0    # segments counting against max_segments
        self._table_total = 0  # bytes the table takes serialized
        self._lock = threading.Lock()
        self._entries: dict[int, _Entry] = {}
        self._served: dict[int, wire.ServedSegment] = {}
        self._table: AddressTable[int] = AddressTable()
        self._ids = itertools.count(1)
        self._charged = 0
        self._listeners: list[Listener] = []
        # mappings still viewed by a data connection, each with the pool bytes it still
        # holds: charged to pool_max_bytes until the pages are really gone
        self._deferred: list[tuple[Mapping, int]] = []
        #: one liveness word per shareable segment, mapped read-only by same-node peers
        self.states = SegmentStates()
        self._closed = False
        self._counters = {"allocations": 0, "registrations": 0, "deregistrations": 0,
                          "fds_exported": 0, "export_refusals": 0}

    # ------------------------------------------------------------ queries

    def resolve(self, segment_id: int) -> wire.ServedSegment | None:
        """The data path's lookup: lock-free, O(1)."""
        return self._served.get(segment_id)

    def segments(self) -> list[SegmentInfo]:
        with self._lock:
            return [e.info for e in self._entries.values()]

    def segment(self, segment_id: int) -> SegmentInfo:
        entry = self._entries.get(segment_id)
        if entry is None:
            raise ParamInvalid(f"segment {segment_id} is not registered (already deregistered?)")
        return entry.info

    def counters(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._counters)
            out["segments"] = len(self._entries)
            out["segment_bytes"] = sum(e.info.length for e in self._entries.values())
            out["pool_bytes_charged"] = self._charged
            out["pool_bytes_max"] = self.pool_max_bytes
            out["deferred_unmaps"] = len(self._deferred)
            out["client_segments"] = self._limited
            out["max_segments"] = self.max_segments
            out["table_bytes"] = self._table_total
            out["table_bytes_limit"] = TABLE_BYTES_LIMIT
        return out

    def segment_totals(self) -> dict[str, tuple[int, int]]:
        """kind -> (segments, bytes) served now; kinds: "pool" (created at start from the
        config), "allocated" (by clients at run time), "fd" (deposited), "memory" (an
        embedded agent serving its process's memory in place)."""
        totals: dict[str, tuple[int, int]] = {}
        with self._lock:
            for entry in self._entries.values():
                kind = "pool" if entry.owner == "pool" and entry.kind == "allocated" \
                    else entry.kind
                count, size = totals.get(kind, (0, 0))
                totals[kind] = (count + 1, size + entry.info.length)
        return totals

    # ------------------------------------------------------------ subscriptions

    def subscribe(self, listener: Listener) -> list[SegmentInfo]:
        """Call `listener(kind, segments)` on every change; returns the current table.

        Snapshot and subscription are atomic, so a watcher misses nothing and sees nothing
        twice. Listeners run under the agent lock, in change order: they must only hand
        the event off (queue it, set a flag) and never call back into the agent.
        """
        with self._lock:
            self._listeners.append(listener)
            return [e.info for e in self._entries.values()]

    def unsubscribe(self, listener: Listener) -> None:
        with self._lock, contextlib.suppress(ValueError):
            self._listeners.remove(listener)

    def _notify(self, kind: str, infos: list[SegmentInfo]) -> None:
        for listener in list(self._listeners):
            try:
                listener(kind, infos)
            except Exception:  # noqa: BLE001 - one broken watcher must not break the agent
                log.exception("segment listener failed")

    # ------------------------------------------------------------ mutations

    def allocate(self, size: int, perms: Perm = Perm.RW, name: str = "", owner: str = "", *,
                 budgeted: bool = True, allowed_engines: Any = ()) -> SegmentInfo:
        """A new shm segment from this agent's DRAM, shareable with same-node peers.

        Charged (page-rounded) to `pool_max_bytes` unless `budgeted` is False (the
        configured pool itself); over budget -> ResourceExhausted naming needed/available.
        `allowed_engines`: the engines that may reach it (every path); empty: everyone.
        """
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ParamInvalid(f"allocation size must be a positive integer, got {size!r}")
        perms = _check_perms(perms)
        name, owner = _check_names(name, owner)
        allowed = check_allowed_engines(allowed_engines)
        rounded = round_up(size)
        self._retry_deferred()  # memory whose last view has gone since counts as free again
        with self._lock:
            self._check_open()
            if budgeted:
                self._check_count(name, owner)  # before making a memfd; _add checks again
                available = self.pool_max_bytes - self._charged
                if rounded > available:
                    raise ResourceExhausted(
                        f"cannot allocate {rounded} bytes ({name or 'unnamed'} for "
                        f"{owner or 'unknown owner'}): only {available} of pool_max_bytes="
                        f"{self.pool_max_bytes} left")
                self._charged += rounded
        try:
            shm = ShmSegment(size, name=f"hixl:{name or 'segment'}")
        except BaseException:
            if budgeted:
                with self._lock:
                    self._charged -= rounded
            raise
        try:
            return self._add(
                kind="allocated", base=shm.addr, length=shm.length, perms=perms, name=name,
                owner=owner, memory=shm.view(), export=lambda w: shm.export_fd(writable=w),
                owned=[shm], charged=rounded if budgeted else 0, counter="allocations",
                allowed=allowed, limited=budgeted)
        except BaseException:
            if budgeted:
                with self._lock:
                    self._charged -= rounded
            _release(shm)
            raise

    def register_memory(self, addr: int, length: int, perms: Perm = Perm.RW, name: str = "",
                        owner: str = "", keepalive: Any = None,
                        shm: ShmSegment | None = None, *,
                        allowed_engines: Any = ()) -> SegmentInfo:
        """Serve caller memory [addr, addr+length) (the embedded shape).

        The caller keeps the memory valid until deregister; `keepalive` is held till then.
        Shareable (same-node peers map it) when it lies inside `shm`, at any offset: peers
        then map just the pages holding the range. Overlapping an existing registration
        is refused.
        """
        check_range(addr, length, "register_memory")
        perms = _check_perms(perms)
        name, owner = _check_names(name, owner)
        allowed = check_allowed_engines(allowed_engines)
        offset = 0
        if shm is not None:
            if shm.fd < 0:
                raise ParamInvalid("register_memory: the shm segment is closed")
            offset = addr - shm.addr
            if offset < 0 or offset + length > shm.length:
                raise OutOfRange(
                    f"register_memory: [{addr:#x}, +{length}) does not fit in its shared "
                    f"allocation [{shm.addr:#x}, +{shm.length})")
            memory = shm.view()[offset:offset + length]
            export: Callable[[bool], int] | None = lambda w: shm.export_fd(writable=w)  # noqa: E731
        else:
            memory = _memory_at(addr, length, keepalive)
            export = None
        return self._add(kind="memory", base=addr, length=length, perms=perms, name=name,
                         owner=owner, memory=memory, export=export, owned=[],
                         charged=0, counter="registrations", allowed=allowed, offset=offset)

    def register_fd(self, fd: int, length: int, perms: Perm = Perm.RW, name: str = "",
                    owner: str = "", *, allowed_engines: Any = ()) -> SegmentInfo:
        """Map a client's memfd (deposited over the fd socket) and serve it; shareable.

        The agent keeps its own duplicate: the caller still owns (and closes) `fd`.
        """
        if isinstance(length, bool) or not isinstance(length, int) or length <= 0:
            raise ParamInvalid(f"register_fd: length must be a positive integer, got {length!r}")
        perms = _check_perms(perms)
        name, owner = _check_names(name, owner)
        allowed = check_allowed_engines(allowed_engines)
        with self._lock:
            self._check_count(name, owner)  # before mapping; _add checks again
        try:
            st = os.fstat(fd)
        except OSError as exc:
            raise ParamInvalid(f"register_fd: fd {fd} is not usable: {exc.strerror}") from None
        if not stat.S_ISREG(st.st_mode):
            raise ParamInvalid("register_fd: the fd is not a memfd or regular shm file")
        if not size_sealed(fd):
            raise ParamInvalid(UNSEALED.format(what="register_fd"))
        if st.st_size < length:
            raise ParamInvalid(
                f"register_fd: the file holds {st.st_size} bytes, fewer than length {length}")
        own_fd = os.dup(fd)
        try:
            mapping = Mapping(own_fd, length, writable=bool(perms & Perm.WRITE))
        except BaseException:
            os.close(own_fd)
            raise
        try:
            return self._add(
                kind="fd", base=mapping.addr, length=length, perms=perms, name=name,
                owner=owner, memory=mapping.view(), export=lambda w: _reopen(own_fd, w),
                owned=[mapping, own_fd], charged=0, counter="registrations", allowed=allowed,
                limited=True)
        except BaseException:
            _release(mapping)
            os.close(own_fd)
            raise

    def release_key(self, segment_id: int) -> bytes:
        """A new key that a remote caller must present to deregister the segment (see
        `deregister`): given to the client that created it, and to nobody else."""
        key = secrets.token_bytes(16)
        with self._lock:
            entry = self._entries.get(segment_id)
            if entry is None:
                raise ParamInvalid(f"segment {segment_id} is not registered")
            entry.release_key = key
        return key

    def deregister(self, segment_id: int, epoch: int | None = None, *,
                   release_key: bytes | None = None) -> SegmentInfo:
        """Stop serving a segment (frames naming it are refused from now on).

        `release_key`: for a remote caller (None: this process, trusted), the key the
        segment's creator was given; the agent's pool and memory an embedded engine
        registered have none, so no remote caller may withdraw them."""
        with self._lock:
            self._check_epoch(segment_id, epoch)
            entry = self._entries.get(segment_id)
            if entry is None:
                raise ParamInvalid(
                    f"segment {segment_id} is not registered (already deregistered?)")
            if release_key is not None and not (
                    entry.release_key and hmac.compare_digest(release_key, entry.release_key)):
                raise PermissionDenied(
                    f"segment {segment_id} ({entry.info.name or entry.kind}, owner "
                    f"{entry.owner or '-'}) may be deregistered only by the client that "
                    + ("allocated or registered it (with the release key its reply carried)"
                       if entry.release_key else "owns it in-process: the agent's pool or an "
                       "engine's own registration"))
            if entry.slot:
                self.states.release(entry.slot)  # mapped peers see it gone from now on
            del self._served[segment_id]
            del self._entries[segment_id]
            self._table.remove(entry.info.base)
            self._limited -= entry.limited
            self._table_total -= entry.table_bytes
            self._counters["deregistrations"] += 1
            self._notify(REMOVED, [entry.info])
            info, owned, charged, entry.owned = entry.info, entry.owned, entry.charged, []
            del entry  # drop our view of the memory, or the unmap below would be refused
        self._release_all(owned, charged)
        return info

    def export_fd(self, segment_id: int, epoch: int, writable: bool, engine: str = "") -> int:
        """A new fd for a same-node peer (engine `engine`) to map; the caller closes it."""
        return self.grant(segment_id, epoch, writable, engine).fd

    def grant(self, segment_id: int, epoch: int, writable: bool, engine: str = "") -> FdGrant:
        """What a same-node peer (engine `engine`) needs to map a segment: a new fd (the
        caller closes it), the segment's offset in that file and its liveness slot.

        Read-only segments only ever give O_RDONLY fds, so a peer's PROT_WRITE map fails;
        a segment with an allow-list gives fds only to the engines it names.
        """
        self._check_epoch(segment_id, epoch)
        entry = self._entries.get(segment_id)
        if entry is None:
            raise ParamInvalid(f"segment {segment_id} is not registered (already deregistered?)")
        allowed = entry.served.allowed
        if allowed is not None and engine not in allowed:
            self._count("export_refusals")
            raise PermissionDenied(
                f"engine {engine or '(unnamed)'!r} may not map segment {segment_id} "
                f"({entry.info.name or entry.kind}): it is not in the segment's "
                "allowed_engines")
        if entry.export is None:
            self._count("export_refusals")
            raise ParamInvalid(
                f"segment {segment_id} ({entry.info.name or entry.kind}) is not shareable: "
                "it is plain process memory; use the data path, or register shm memory")
        if writable and not entry.info.perms & Perm.WRITE:
            self._count("export_refusals")
            raise PermissionDenied(
                f"segment {segment_id} is read-only (perms {entry.info.perms}); "
                "ask for a read-only fd")
        if not writable and not entry.info.perms & Perm.READ:
            self._count("export_refusals")
            raise PermissionDenied(f"segment {segment_id} is write-only; it cannot be read")
        try:
            fd = entry.export(writable)
        except OSError as exc:
            raise HixlError(f"segment {segment_id}: cannot open a new fd: {exc}") from None
        self._count("fds_exported")
        return FdGrant(fd, entry.info.length, entry.offset, entry.slot)

    def close(self) -> None:
        """Release every segment; later mutations raise."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            entries = list(self._entries.values())
            self._entries.clear()
            self._served.clear()
            self._table.clear()
            self._listeners.clear()
            self._charged = 0
            self._limited = self._table_total = 0
            self._deferred = [(mapping, 0) for mapping, _ in self._deferred]
            self.states.close()  # every mapped peer sees every segment gone
        owned = [item for entry in entries for item in entry.owned]
        del entries
        self._release_all(owned, 0)
        self._retry_deferred()

    # ------------------------------------------------------------ internals

    def _add(self, *, kind: str, base: int, length: int, perms: Perm, name: str, owner: str,
             memory: memoryview, export: Callable[[bool], int] | None, owned: list[Any],
             charged: int, counter: str, allowed: tuple[str, ...] = (),
             offset: int = 0, limited: bool = False) -> SegmentInfo:
        """Publish a segment; `limited`: a client's, counted against max_segments. Every
        segment counts against TABLE_BYTES_LIMIT."""
        with self._lock:
            self._check_open()
            if limited:
                self._check_count(name, owner)
            segment_id = next(self._ids)
            info = SegmentInfo(
                segment_id=segment_id, engine=self.engine_name, node_id=self.node_id,
                base=base, length=length, mem_type=MemType.MEM_HOST, perms=perms,
                epoch=self.epoch, shareable=export is not None, name=name,
                allowed_engines=allowed)
            size = _table_bytes(info)
            if self._table_total + size > TABLE_BYTES_LIMIT:
                raise ResourceExhausted(
                    f"cannot add segment {name[:64] or 'unnamed'!r} for "
                    f"{owner[:64] or 'unknown owner'!r}: the segment table would take "
                    f"{self._table_total + size} bytes serialized, over the agent's "
                    f"limit of {TABLE_BYTES_LIMIT} (table bytes limit: Handshake and "
                    "ListSegments replies must stay under clients' 4 MiB); shorter names "
                    "and allowed_engines lists, or fewer segments, fit")
            self._table.insert(base, length, segment_id)  # refuses overlaps
            try:
                slot = self.states.claim(segment_id) if export is not None else 0
            except BaseException:
                self._table.remove(base)
                raise
            served = wire.ServedSegment(segment_id, self.epoch, base, length, perms, memory,
                                        frozenset(allowed) if allowed else None)
            self._entries[segment_id] = _Entry(info, served, kind, owner, charged, export, owned,
                                               offset, slot, limited=limited, table_bytes=size)
            self._served[segment_id] = served
            self._limited += limited
            self._table_total += size
            self._counters[counter] += 1
            self._notify(ADDED, [info])
        self._retry_deferred()
        log.info("serving segment %d %s %s [%#x, +%d) perms=%s owner=%s%s", segment_id, kind,
                 name or "-", base, length, perms, owner or "-",
                 f" allowed_engines={','.join(allowed)}" if allowed else "")
        return info

    def _check_count(self, name: str, owner: str) -> None:
        """ResourceExhausted when clients hold max_segments segments (under the lock)."""
        if self._limited >= self.max_segments:
            raise ResourceExhausted(
                f"cannot add segment {name[:64] or 'unnamed'!r} for "
                f"{owner[:64] or 'unknown owner'!r}: clients hold {self._limited} segments, "
                f"the agent's limit (max_segments={self.max_segments}: "
                f"{self._limit_reason}); release some, or raise max_segments "
                "(HIXL_AGENT_MAX_SEGMENTS)")

    def _check_open(self) -> None:
        if self._closed:
            raise ParamInvalid(f"agent {self.engine_name} is closed")

    def _check_epoch(self, segment_id: int, epoch: int | None) -> None:
        if epoch is not None and epoch != self.epoch:
            raise StaleEpoch(
                f"segment {segment_id} epoch {epoch} is stale: agent {self.engine_name} "
                f"now runs epoch {self.epoch} (it restarted); refresh its segment table")

    def _count(self, name: str) -> None:
        with self._lock:
            self._counters[name] += 1

    def _release_all(self, owned: list[Any], charged: int) -> None:
        """Close and unmap what a segment owned, and give its `charged` pool bytes back
        once its memory is really gone: a mapping a data connection still views is kept
        (with its charge) until a later retry finds it free."""
        for item in owned:
            if isinstance(item, int):
                with contextlib.suppress(OSError):
                    os.close(item)
            elif not _release(item):
                with self._lock:
                    self._deferred.append((item, charged))
                charged = 0
        if charged:
            with self._lock:
                self._charged -= charged

    def _retry_deferred(self) -> None:
        with self._lock:
            pending, self._deferred = self._deferred, []
        freed = 0
        still = []
        for mapping, charged in pending:
            if _release(mapping):
                freed += charged
            else:
                still.append((mapping, charged))
        with self._lock:
            self._charged -= freed
            self._deferred.extend(still)


def _release(mapping: Mapping) -> bool:
    """Unmap (and close the memfd); False while a data-path thread still views the memory."""
    try:
        mapping.close()
    except BufferError:
        return False
    return True


def _check_names(name: object, owner: object) -> tuple[str, str]:
    """A segment's name and owner, within MAX_NAME_BYTES / MAX_OWNER_BYTES."""
    return _check_text(name, "name", MAX_NAME_BYTES), _check_text(owner, "owner",
                                                                  MAX_OWNER_BYTES)


def _check_perms(perms: object) -> Perm:
    if isinstance(perms, bool) or not isinstance(perms, int) or int(perms) & ~int(Perm.RW):
        raise ParamInvalid(f"permissions must be Perm.READ, Perm.WRITE or Perm.RW, got {perms!r}")
    perm = Perm(perms)
    if not perm:
        raise ParamInvalid("a segment nobody may read or write is useless: give perms r, w or rw")
    return perm


def _memory_at(addr: int, length: int, keepalive: Any) -> memoryview:
    """A writable byte view of caller memory that keeps `keepalive` alive as long as it."""
    array = (ctypes.c_ubyte * length).from_address(addr)
    array._hixl_keepalive = keepalive  # type: ignore[attr-defined]  # pinned by every slice
    return memoryview(array).cast("B")
