"""The address-table registry: the global table of published segments every engine can watch.

Each engine publishes its whole segment table, and the endpoints where its agent serves,
under a lease and keeps the lease alive;
when the lease expires (the agent died or was cut off) its segments disappear and
watchers are told. A restarted agent publishes with a newer epoch, which replaces the
old lease; an older epoch than the one held is refused, so a zombie can never overwrite
the table of the agent that replaced it.

`Registry` is a plain thread-safe object (no gRPC inside) so agents can embed it and
tests can drive it with an injected clock; `RegistryServicer` is the thin gRPC skin.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hmac
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc

from hixl.control import abort_with, add_segments, segment_from_pb, segments_to_columns
from hixl.errors import (
    HixlError,
    NotConnected,
    ParamInvalid,
    PermissionDenied,
    ResourceExhausted,
    StaleEpoch,
    TransferTimeout,
)
from hixl.registry_client import (
    NO_ENDPOINTS,
    OWNER_KEY_SIZE,
    EngineEndpoints,
    EngineInfo,
    endpoints_from_pb,
    engine_info_to_pb,
    owner_verifier,
)
from hixl.table import AddressTable, check_range
from hixl.types import SegmentInfo
from hixl.v1 import agent_pb2, agent_pb2_grpc

log = logging.getLogger("hixl.registry")
T = TypeVar("T")

DEFAULT_MAX_TTL_MS = 60_000
DEFAULT_WATCH_QUEUE_LIMIT = 1024
EXPIRE_EVERY_S = 0.1
#: Segments per watch message: a 100k-segment SNAPSHOT goes out in pieces, each far under
#: gRPC's 4 MiB default message limit (a Segment is ~60 bytes on the wire).
SNAPSHOT_CHUNK = 8192
MAX_EPOCH = (1 << 32) - 1  # the proto carries epochs as uint32
#: engine names whose owner the in-memory registry remembers (names without a live lease
#: are forgotten first, the longest-known first, once there are more)
DEFAULT_MAX_OWNERS = 65_536

#: A watch stream can sit idle for a long time; these let clients ping it (so a dead
#: master is noticed) without the server treating the pings as abuse. Any gRPC server
#: that serves the Registry service should be created with them.
SERVER_KEEPALIVE_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
]


class EventKind(enum.IntEnum):
    """Same numbering as `SegmentEvent.Kind` in the proto."""

    SNAPSHOT = 0
    ADDED = 1
    REMOVED = 2
    ENGINE_UP = 3
    ENGINE_DOWN = 4


#: Kinds only membership watchers (subscribe(engines=True)) receive.
MEMBERSHIP_KINDS = frozenset({EventKind.ENGINE_UP, EventKind.ENGINE_DOWN})


class PublishedSegments:
    """One lease's published table (base order), with its compact wire form made on first
    need and then shared by every snapshot that includes it.

    Why: encoding 100k segments costs the registry far more than sending them, and a table
    only ever changes by being replaced, so each new watcher would otherwise pay it again.
    """

    __slots__ = ("segments", "_columns")

    def __init__(self, segments: tuple[SegmentInfo, ...]) -> None:
        self.segments = segments
        self._columns: dict[int, list[agent_pb2.SegmentColumns]] = {}

    def columns(self, chunk: int) -> list[agent_pb2.SegmentColumns]:
        """The segments as SegmentColumns of at most `chunk` segments each (cached)."""
        blocks = self._columns.get(chunk)
        if blocks is None:
            blocks = self._columns[chunk] = segments_to_columns(self.segments, chunk)
        return blocks


@dataclass(frozen=True)
class RegistryEvent:
    """One change batch. SNAPSHOT holds the whole table (epoch 0: it spans engines) and,
    for membership watchers, every live engine; ADDED/REMOVED hold one engine's segments
    and carry that engine's epoch; ENGINE_UP/ENGINE_DOWN hold one engine in `engines`.

    Order per engine: a new lease is ENGINE_UP then ADDED; a restart (newer epoch) is
    REMOVED (old epoch), ENGINE_UP, ADDED; a lease that ends is REMOVED then ENGINE_DOWN.
    """

    kind: EventKind
    epoch: int
    segments: tuple[SegmentInfo, ...]
    engines: tuple[EngineInfo, ...] = ()
    #: SNAPSHOT only: `segments` again, per lease, with each lease's cached wire form.
    published: tuple[PublishedSegments, ...] = field(default=(), compare=False, repr=False)


class Subscription:
    """A watcher's bounded event queue.

    The registry only ever appends (O(1), never waits); a watcher that lets the queue
    fill up is dropped with ResourceExhausted so it resubscribes and resyncs from a
    fresh SNAPSHOT instead of slowing the registry down or silently missing events.
    """

    def __init__(self, registry: Registry, limit: int, engines: bool = False) -> None:
        self._registry = registry
        self._limit = limit
        self.engines = engines  # also wants membership (ENGINE_UP/ENGINE_DOWN) events
        self._cond = threading.Condition()
        self._events: deque[RegistryEvent] = deque()
        self._error: HixlError | None = None
        self._closed = False
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    # -- producer side (called by the registry under its lock) --------------------------

    def _push(self, event: RegistryEvent) -> bool:
        """Queue an event; False (and the subscription fails) when the watcher is too slow."""
        with self._cond:
            if self._closed or self._error is not None:
                return False
            if len(self._events) >= self._limit:
                self._events.clear()
                self._error = ResourceExhausted(
                    f"registry watcher fell more than {self._limit} events behind and was "
                    "dropped; watch again to resync from a fresh snapshot")
                self._wake_locked()
                return False
            self._events.append(event)
            self._wake_locked()
            return True

    def _wake_locked(self) -> None:
        self._cond.notify_all()
        waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            # RuntimeError: that loop is closed, so nobody is waiting any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_resolve, future)

    # -- consumer side ------------------------------------------------------------------

    def _take_locked(self) -> RegistryEvent | None:
        if self._events:
            return self._events.popleft()
        if self._error is not None:
            raise self._error
        if self._closed:
            raise NotConnected("registry subscription is closed")
        return None

    def get(self, timeout: float) -> RegistryEvent:
        """Next event, waiting at most `timeout` seconds (TransferTimeout after that)."""
        with self._cond:
            self._cond.wait_for(
                lambda: bool(self._events) or self._error is not None or self._closed,
                timeout)
            event = self._take_locked()
        if event is None:
            raise TransferTimeout(f"no registry event within {timeout}s")
        return event

    async def next(self) -> RegistryEvent:
        """Next event, awaited on the running loop (cancel the task to stop waiting)."""
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                event = self._take_locked()
                if event is not None:
                    return event
                future: asyncio.Future[None] = loop.create_future()
                self._waiters.append((loop, future))
            try:
                await future
            finally:
                with self._cond:
                    if (loop, future) in self._waiters:
                        self._waiters.remove((loop, future))

    def pending(self) -> int:
        with self._cond:
            return len(self._events)

    def close(self) -> None:
        """Stop receiving events; pending and later next()/get() calls raise NotConnected."""
        self._registry._unsubscribe(self)
        with self._cond:
            self._closed = True
            self._events.clear()
            self._wake_locked()

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def stale_publish(engine: str, epoch: int, held: int) -> StaleEpoch:
    """The refusal of a publish older than the epoch the registry holds for `engine`."""
    return StaleEpoch(f"publish {engine!r}: epoch {epoch} is older than the epoch {held} "
                      "already published for that engine (a newer agent replaced this one)")


def check_owner_key(what: str, owner_key: object) -> bytes:
    """The verifier of a caller's owner key (b"": none given); ParamInvalid for a malformed one."""
    if owner_key is None or owner_key == b"":
        return b""
    if not isinstance(owner_key, bytes) or len(owner_key) != OWNER_KEY_SIZE:
        size = len(owner_key) if isinstance(owner_key, bytes | bytearray) else type(owner_key)
        raise ParamInvalid(f"{what}: an owner key is {OWNER_KEY_SIZE} bytes, got {size}")
    return owner_verifier(owner_key)


def refuse_owner(engine: str, owner: bytes, verifier: bytes, release: str) -> None:
    """PermissionDenied unless `verifier` (the caller's) is `owner` (the name's; b"": none)."""
    if not owner:
        return
    if not verifier:
        raise PermissionDenied(
            f"publish {engine!r}: that engine name has an owner, and this publish carries no "
            "owner key (a client that predates owner keys?); only the agent holding the "
            "name's secret may publish it")
    if not hmac.compare_digest(owner, verifier):
        raise PermissionDenied(
            f"publish {engine!r}: that engine name is owned by another owner key: only the "
            "agent that holds the name's secret (in its state dir) may publish, renew or "
            "withdraw it. If this is that agent and it lost its state dir, an operator "
            f"releases the name: {release}")


def refuse_lease(what: str, lease_id: int, engine: str, owner: bytes, verifier: bytes) -> None:
    """PermissionDenied unless the caller's key is the one lease `lease_id` was published with."""
    if owner and not hmac.compare_digest(owner, verifier):
        raise PermissionDenied(f"{what} of lease {lease_id}: that lease belongs to engine "
                               f"{engine!r}, and this call does not carry its owner key")


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


@dataclass
class _Lease:
    lease_id: int
    engine: str
    node_id: str
    epoch: int
    ttl_ms: int
    deadline: float
    segments: tuple[SegmentInfo, ...]          # in base order
    table: AddressTable[SegmentInfo]
    endpoints: EngineEndpoints = NO_ENDPOINTS
    owner: bytes = b""  # the owner key's verifier; b"": an unowned lease
    _published: PublishedSegments | None = None

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(self.engine, self.node_id, self.epoch, self.endpoints)

    @property
    def published(self) -> PublishedSegments:
        """`segments` with their cached wire form (made anew once `segments` is replaced)."""
        published = self._published
        if published is None or published.segments is not self.segments:
            published = self._published = PublishedSegments(self.segments)
        return published


class Registry:
    """Thread-safe global address table: engine -> leased, published segment table."""

    #: writes wait on something remote (server/master/etcd_registry.py): the gRPC skin runs them
    #: on a thread instead of the event loop
    blocking = False
    #: "" : a lease is known here only; else the lease space all masters of the cluster
    #: share (PublishReply.lease_scope)
    lease_scope = ""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic,
                 max_ttl_ms: int = DEFAULT_MAX_TTL_MS,
                 watch_queue_limit: int = DEFAULT_WATCH_QUEUE_LIMIT,
                 max_owners: int = DEFAULT_MAX_OWNERS) -> None:
        if max_ttl_ms <= 0:
            raise ParamInvalid(f"max_ttl_ms must be positive, got {max_ttl_ms}")
        if watch_queue_limit <= 0:
            raise ParamInvalid(f"watch_queue_limit must be positive, got {watch_queue_limit}")
        self._clock = clock
        self.max_ttl_ms = max_ttl_ms
        self._watch_queue_limit = watch_queue_limit
        self._lock = threading.Lock()
        self._leases: dict[int, _Lease] = {}
        self._by_engine: dict[str, _Lease] = {}
        #: engine name -> its owner key's verifier, kept after its lease ends (so nobody
        #: else takes the name) for the life of this registry, up to max_owners names
        self._owners: dict[str, bytes] = {}
        self.max_owners = max_owners
        self._subscribers: set[Subscription] = set()
        # A lower bound on every lease deadline (deadlines only move later), so lookups
        # skip the O(engines) expiry scan until something can actually have expired.
        self._earliest_deadline = float("inf")
        #: leases granted (a new engine or a restart), publishes that replaced a live
        #: lease's table, keepalives, unpublishes, leases expired, watchers dropped for
        #: falling behind (for metrics; see stats())
        self.counters = dict.fromkeys(("leases_granted", "republishes", "keepalives",
                                       "unpublishes", "expiries", "watchers_dropped"), 0)

    # -- leases ---------------------------------------------------------------------------

    def publish(self, engine: str, node_id: str, epoch: int,
                segments: Sequence[SegmentInfo], ttl_ms: int, *,
                endpoints: EngineEndpoints | None = None,
                owner_key: bytes | None = None) -> int:
        """Replace `engine`'s whole table (and its endpoints) under a lease; returns the lease id.

        The name belongs to the first owner key it was published with: a publish without
        that key is refused (PermissionDenied) whatever its epoch, while the lease lives
        and after it ended. Then the same epoch keeps the lease (the agent's table
        changed); a newer epoch is a restart and gets a new lease, revoking the old one;
        an older epoch is refused (StaleEpoch). `owner_key` None (or b""): an unowned
        publish, taken only for a name nobody owns.
        """
        verifier = check_owner_key(f"publish {engine!r}", owner_key)
        endpoints, ordered, table = self._check_publish(engine, epoch, segments, ttl_ms,
                                                        endpoints)
        with self._lock:
            now = self._clock()
            self._sweep_locked(now)
            held = self._by_engine.get(engine)
            refuse_owner(engine, self._owners.get(engine, b""), verifier,
                         self.release_hint(engine))
            if held is not None and epoch < held.epoch:
                raise stale_publish(engine, epoch, held.epoch)
            if verifier and engine not in self._owners:
                self._claim_locked(engine, verifier)
            lease = self._install_locked(engine, node_id, epoch, ttl_ms, now + ttl_ms / 1000,
                                         ordered, table, endpoints, owner=verifier)
            return lease.lease_id

    def release_hint(self, engine: str) -> str:
        """How an operator frees `engine`'s name here (for refusals)."""
        return ("restart the registry (hixl-master, or the agent that embeds it), or call "
                f"Registry.release_owner({engine!r}) once its lease has ended")

    def release_owner(self, engine: str) -> bool:
        """Forget who owns `engine` (an operator's act: the owner lost its secret), so the
        next owner-keyed publish claims it; refused while the name has a live lease.
        True when there was an owner."""
        with self._lock:
            self._sweep_locked(self._clock())
            if engine in self._by_engine:
                raise ParamInvalid(f"release of {engine!r}: it has a live lease; only an "
                                   "ended lease's name can be released")
            return self._owners.pop(engine, None) is not None

    def _claim_locked(self, engine: str, verifier: bytes) -> None:
        """Make `verifier` the owner of `engine` (first use); forget owners of names with
        no live lease, the longest-known first, when that passes max_owners."""
        if len(self._owners) >= self.max_owners:
            for name in [n for n in self._owners if n not in self._by_engine]:
                del self._owners[name]
                log.warning("registry: forgot the owner of engine %r (no live lease; over "
                            "%d owned names)", name, self.max_owners)
                if len(self._owners) < self.max_owners:
                    break
            else:
                raise ResourceExhausted(f"publish {engine!r}: the registry already holds "
                                        f"{self.max_owners} owned engine names, all live")
        self._owners[engine] = verifier

    def _new_lease_id_locked(self) -> int:
        """A random 63-bit lease id, so ids cannot be guessed (and a restarted registry
        never hands out one its predecessor gave: an agent renewing its old lease there
        is told it is unknown, and publishes again)."""
        while True:
            lease_id = secrets.randbits(63)
            if lease_id and lease_id not in self._leases:
                return lease_id

    def _check_publish(self, engine: str, epoch: int, segments: Iterable[SegmentInfo],
                       ttl_ms: int, endpoints: EngineEndpoints | None,
                       ) -> tuple[EngineEndpoints, tuple[SegmentInfo, ...],
                                  AddressTable[SegmentInfo]]:
        """A publish's arguments checked (ParamInvalid naming the bad one) and its table
        indexed, outside the lock: the endpoints, the segments in base order, the table."""
        self._check_publish_args(engine, epoch, ttl_ms)
        endpoints = NO_ENDPOINTS if endpoints is None else endpoints
        if not isinstance(endpoints, EngineEndpoints):
            raise ParamInvalid(f"publish {engine!r}: endpoints must be EngineEndpoints, got "
                               f"{type(endpoints).__name__}")
        ordered, table = self._build_table(engine, epoch, segments)
        return endpoints, ordered, table

    def _install_locked(self, engine: str, node_id: str, epoch: int, ttl_ms: int,
                        deadline: float, ordered: tuple[SegmentInfo, ...],
                        table: AddressTable[SegmentInfo], endpoints: EngineEndpoints,
                        lease_id: int | None = None, owner: bytes = b"") -> _Lease:
        """Make a checked table `engine`'s, and tell the watchers what changed.

        The same epoch updates the lease in place (re-keyed when `lease_id` names another
        one); any other epoch replaces the lease by a new one, `lease_id` or the next id.
        """
        held = self._by_engine.get(engine)
        self._earliest_deadline = min(self._earliest_deadline, deadline)
        if held is not None and held.epoch == epoch:
            self.counters["republishes"] += 1
            lease = held
            old_segments = lease.segments
            announce = (lease.node_id, lease.endpoints) != (node_id, endpoints)
            lease.node_id, lease.ttl_ms, lease.deadline = node_id, ttl_ms, deadline
            lease.segments, lease.table, lease.endpoints = ordered, table, endpoints
            lease.owner = owner
            if lease_id is not None and lease_id != lease.lease_id:
                del self._leases[lease.lease_id]
                lease.lease_id = lease_id
                self._leases[lease_id] = lease
        else:
            old_segments = held.segments if held is not None else ()
            announce = True
            if held is not None:
                del self._leases[held.lease_id]
            lease = _Lease(self._new_lease_id_locked() if lease_id is None else lease_id,
                           engine, node_id, epoch, ttl_ms, deadline, ordered, table,
                           endpoints, owner)
            self.counters["leases_granted"] += 1
            self._leases[lease.lease_id] = lease
            self._by_engine[engine] = lease
        self._emit_diff_locked(old_segments, held.epoch if held else epoch, ordered, epoch,
                               lease.info if announce else None)
        return lease

    def keepalive(self, lease_id: int, *, owner_key: bytes | None = None) -> int:
        """Extend a live lease by its ttl; returns the ttl in ms. A lease published with
        an owner key is renewed only with that key (PermissionDenied otherwise)."""
        verifier = check_owner_key(f"keepalive of lease {lease_id}", owner_key)
        with self._lock:
            now = self._clock()
            self._sweep_locked(now)
            lease = self._live_lease_locked(lease_id)
            refuse_lease("keepalive", lease_id, lease.engine, lease.owner, verifier)
            lease.deadline = now + lease.ttl_ms / 1000
            self.counters["keepalives"] += 1
            return lease.ttl_ms

    def unpublish(self, lease_id: int, *, owner_key: bytes | None = None) -> None:
        """Withdraw a lease's segments now (a clean shutdown); the same proof as keepalive.
        The name stays its owner's."""
        verifier = check_owner_key(f"unpublish of lease {lease_id}", owner_key)
        with self._lock:
            self._sweep_locked(self._clock())
            lease = self._live_lease_locked(lease_id)
            refuse_lease("unpublish", lease_id, lease.engine, lease.owner, verifier)
            self._drop_locked(lease)
            self.counters["unpublishes"] += 1

    def close(self) -> None:
        """Release what the registry holds outside this process (nothing, here)."""

    def expire(self) -> list[str]:
        """Drop every lease whose deadline has passed; returns the engines dropped."""
        with self._lock:
            return self._sweep_locked(self._clock())

    # -- lookups --------------------------------------------------------------------------

    def query(self, engine: str = "") -> list[SegmentInfo]:
        """Published segments of one engine ("" = all engines), in (engine, base) order."""
        with self._lock:
            self._sweep_locked(self._clock())
            if engine:
                lease = self._by_engine.get(engine)
                return list(lease.segments) if lease is not None else []
            return self._all_segments_locked()

    def find(self, engine: str, addr: int, length: int) -> SegmentInfo:
        """The segment of `engine` that wholly holds [addr, addr+length), O(log n)."""
        with self._lock:
            self._sweep_locked(self._clock())
            lease = self._by_engine.get(engine)
            if lease is None:
                raise NotConnected(f"engine {engine!r} has no published segments in the registry")
            _, segment = lease.table.find(addr, length, f"engine {engine!r} address")
            return segment

    def engines(self) -> dict[str, int]:
        """Engine name -> epoch of every live lease (for operators and tests)."""
        with self._lock:
            self._sweep_locked(self._clock())
            return {name: lease.epoch for name, lease in self._by_engine.items()}

    def stats(self) -> dict[str, int]:
        """What the registry holds now (engines, segments, their bytes, watchers) and its
        counters since start, for metrics; O(segments)."""
        with self._lock:
            self._sweep_locked(self._clock())
            leases = list(self._by_engine.values())
            out = dict(self.counters)
            out["engines"] = len(leases)
            out["segments"] = sum(len(lease.segments) for lease in leases)
            out["segment_bytes"] = sum(s.length for lease in leases for s in lease.segments)
            out["watchers"] = len(self._subscribers)
            out["owned_names"] = len(self._owners)
        return out

    def engine_infos(self, engine: str = "") -> list[EngineInfo]:
        """Identity, epoch and endpoints of one live engine ("" = all), in name order."""
        with self._lock:
            self._sweep_locked(self._clock())
            if engine:
                lease = self._by_engine.get(engine)
                return [lease.info] if lease is not None else []
            return [self._by_engine[name].info for name in sorted(self._by_engine)]

    # -- watchers -------------------------------------------------------------------------

    def subscribe(self, *, engines: bool = False) -> Subscription:
        """A new watcher whose first event is a SNAPSHOT of the whole table.

        The snapshot is queued under the same lock as every change, so no change is
        missed or seen twice between the snapshot and the first ADDED/REMOVED.
        `engines` asks for membership too: the snapshot lists every live engine and
        ENGINE_UP/ENGINE_DOWN events follow leases (so engines with no segments are seen).
        """
        subscription = Subscription(self, self._watch_queue_limit, engines)
        with self._lock:
            self._sweep_locked(self._clock())
            leases = [self._by_engine[name] for name in sorted(self._by_engine)]
            infos = tuple(lease.info for lease in leases) if engines else ()
            published = tuple(lease.published for lease in leases)
            segments = tuple(s for table in published for s in table.segments)
            subscription._push(RegistryEvent(EventKind.SNAPSHOT, 0, segments, infos,
                                             published))
            self._subscribers.add(subscription)
        return subscription

    def _unsubscribe(self, subscription: Subscription) -> None:
        with self._lock:
            self._subscribers.discard(subscription)

    # -- internals ------------------------------------------------------------------------

    def _check_publish_args(self, engine: object, epoch: object, ttl_ms: object) -> None:
        if not isinstance(engine, str) or not engine:
            raise ParamInvalid(f"publish: engine name must be a non-empty string, got {engine!r}")
        if not isinstance(epoch, int) or isinstance(epoch, bool) or not 0 <= epoch <= MAX_EPOCH:
            raise ParamInvalid(f"publish {engine!r}: epoch must be an integer in "
                               f"[0, {MAX_EPOCH}], got {epoch!r}")
        if (not isinstance(ttl_ms, int) or isinstance(ttl_ms, bool)
                or not 0 < ttl_ms <= self.max_ttl_ms):
            raise ParamInvalid(f"publish {engine!r}: ttl_ms must be in (0, {self.max_ttl_ms}], "
                               f"got {ttl_ms!r}")

    @staticmethod
    def _build_table(engine: str, epoch: int, segments: Iterable[SegmentInfo],
                     ) -> tuple[tuple[SegmentInfo, ...], AddressTable[SegmentInfo]]:
        """Validate a published table and index it; done outside the lock (it is O(n log n))."""
        checked: list[SegmentInfo] = []
        seen_ids: set[int] = set()
        for segment in segments:
            if not isinstance(segment, SegmentInfo):
                raise ParamInvalid(f"publish {engine!r}: expected SegmentInfo, got "
                                   f"{type(segment).__name__}")
            if segment.engine != engine:
                raise ParamInvalid(f"publish {engine!r}: segment {segment.segment_id} belongs "
                                   f"to engine {segment.engine!r}, not the publisher")
            if segment.epoch != epoch:
                raise ParamInvalid(f"publish {engine!r}: segment {segment.segment_id} has epoch "
                                   f"{segment.epoch}, the publisher's epoch is {epoch}")
            check_range(segment.base, segment.length,
                        f"publish {engine!r}: segment {segment.segment_id}")
            if segment.segment_id in seen_ids:
                raise ParamInvalid(f"publish {engine!r}: segment id {segment.segment_id} "
                                   "appears twice")
            seen_ids.add(segment.segment_id)
            checked.append(segment)
        checked.sort(key=lambda s: s.base)
        with contextlib.suppress(ParamInvalid):  # an overlap: the loop below names it
            return tuple(checked), AddressTable.bulk((s.base, s.length, s) for s in checked)
        table: AddressTable[SegmentInfo] = AddressTable()
        for segment in checked:
            try:
                table.insert(segment.base, segment.length, segment)
            except ParamInvalid as exc:
                raise ParamInvalid(f"publish {engine!r}: segment {segment.segment_id}: "
                                   f"{exc.args[0]}") from None
        return tuple(checked), table

    def _live_lease_locked(self, lease_id: int) -> _Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            raise NotConnected(f"lease {lease_id} expired or unknown; publish again")
        return lease

    def _sweep_locked(self, now: float) -> list[str]:
        if now < self._earliest_deadline:
            return []
        expired = [lease for lease in self._leases.values() if lease.deadline <= now]
        self._earliest_deadline = min(
            (lease.deadline for lease in self._leases.values() if lease.deadline > now),
            default=float("inf"))
        for lease in expired:
            log.info("lease %d of engine %r (epoch %d) expired", lease.lease_id,
                     lease.engine, lease.epoch)
            self._drop_locked(lease)
            self.counters["expiries"] += 1
        return [lease.engine for lease in expired]

    def _drop_locked(self, lease: _Lease) -> None:
        del self._leases[lease.lease_id]
        del self._by_engine[lease.engine]
        self._emit_locked(EventKind.REMOVED, lease.epoch, lease.segments)
        self._emit_locked(EventKind.ENGINE_DOWN, lease.epoch, (), (lease.info,))

    def _all_segments_locked(self) -> list[SegmentInfo]:
        return [segment for name in sorted(self._by_engine)
                for segment in self._by_engine[name].segments]

    def _emit_diff_locked(self, old: tuple[SegmentInfo, ...], old_epoch: int,
                          new: tuple[SegmentInfo, ...], new_epoch: int,
                          announce: EngineInfo | None) -> None:
        """REMOVED before ADDED, so a watcher's own address table never sees an overlap;
        ENGINE_UP (a new lease, or new endpoints) between them, so a watcher knows an
        engine's epoch and endpoints before its segments arrive."""
        old_set, new_set = set(old), set(new)
        self._emit_locked(EventKind.REMOVED, old_epoch,
                          tuple(s for s in old if s not in new_set))
        if announce is not None:
            self._emit_locked(EventKind.ENGINE_UP, announce.epoch, (), (announce,))
        self._emit_locked(EventKind.ADDED, new_epoch,
                          tuple(s for s in new if s not in old_set))

    def _emit_locked(self, kind: EventKind, epoch: int, segments: tuple[SegmentInfo, ...],
                     engines: tuple[EngineInfo, ...] = ()) -> None:
        if not segments and not engines:
            return
        event = RegistryEvent(kind, epoch, segments, engines)
        membership = kind in MEMBERSHIP_KINDS
        for subscription in list(self._subscribers):
            if membership and not subscription.engines:
                continue
            if not subscription._push(event):
                self._subscribers.discard(subscription)
                self.counters["watchers_dropped"] += 1
                log.warning("dropped a registry watcher that fell behind")


# ---------------------------------------------------------------------------- gRPC service


def event_to_pb(event: RegistryEvent) -> agent_pb2.SegmentEvent:
    """The whole event as one message (see events_to_pb for what goes on the wire)."""
    message = agent_pb2.SegmentEvent(kind=int(event.kind), epoch=event.epoch,
                                     engines=[engine_info_to_pb(e) for e in event.engines])
    add_segments(message.segments, event.segments)
    return message


def events_to_pb(event: RegistryEvent, chunk: int = SNAPSHOT_CHUNK, *, columns: bool = False,
                 ) -> Iterator[agent_pb2.SegmentEvent]:
    """The event as wire messages: a big SNAPSHOT in pieces of `chunk` segments, `more` set
    on all but the last (engines ride in the first), so no message nears gRPC's limit.

    `columns`: segments go as SegmentColumns (for watchers that asked for them).
    """
    if columns:
        yield from _column_events_to_pb(event, chunk)
        return
    if event.kind != EventKind.SNAPSHOT or len(event.segments) <= chunk:
        yield event_to_pb(event)
        return
    segments = event.segments
    for start in range(0, len(segments), chunk):
        message = agent_pb2.SegmentEvent(
            kind=int(event.kind), epoch=event.epoch,
            engines=[engine_info_to_pb(e) for e in event.engines] if start == 0 else [],
            more=start + chunk < len(segments))
        add_segments(message.segments, segments[start:start + chunk])
        yield message


def _column_events_to_pb(event: RegistryEvent, chunk: int,
                         ) -> Iterator[agent_pb2.SegmentEvent]:
    """events_to_pb in compact form: a SNAPSHOT reuses each lease's cached columns, packed
    whole into messages of at most `chunk` segments."""
    engines = [engine_info_to_pb(e) for e in event.engines]
    if event.kind != EventKind.SNAPSHOT:
        yield agent_pb2.SegmentEvent(kind=int(event.kind), epoch=event.epoch, engines=engines,
                                     columns=segments_to_columns(event.segments))
        return
    if event.published:
        blocks = [block for table in event.published for block in table.columns(chunk)]
    else:  # a snapshot made by hand
        blocks = segments_to_columns(event.segments, chunk)
    messages: list[list[agent_pb2.SegmentColumns]] = [[]]
    count = 0
    for block in blocks:
        size = len(block.segment_id)
        if messages[-1] and count + size > chunk:
            messages.append([])
            count = 0
        messages[-1].append(block)
        count += size
    for index, message in enumerate(messages):
        yield agent_pb2.SegmentEvent(kind=int(event.kind), epoch=event.epoch,
                                     engines=engines if index == 0 else [], columns=message,
                                     more=index + 1 < len(messages))


class RegistryServicer(agent_pb2_grpc.RegistryServicer):
    """Thin gRPC skin over a Registry: convert, call, map errors."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    async def _write(self, context: grpc.aio.ServicerContext, call: Callable[..., T],
                     *args: Any, **kwargs: Any) -> T:
        """Run a registry write (on a thread when it waits on etcd); errors abort the RPC."""
        try:
            if self._registry.blocking:
                return await asyncio.to_thread(call, *args, **kwargs)
            return call(*args, **kwargs)
        except HixlError as exc:
            await abort_with(context, exc)
            raise

    async def Publish(self, request: agent_pb2.PublishRequest,
                      context: grpc.aio.ServicerContext) -> agent_pb2.PublishReply:
        try:
            segments = [segment_from_pb(pb) for pb in request.segments]
        except HixlError as exc:
            await abort_with(context, exc)
            raise
        endpoints = (endpoints_from_pb(request.endpoints)
                     if request.HasField("endpoints") else None)
        lease_id = await self._write(context, self._registry.publish, request.engine,
                                     request.node_id, request.epoch, segments,
                                     request.ttl_ms, endpoints=endpoints,
                                     owner_key=request.owner_key)
        return agent_pb2.PublishReply(lease_id=lease_id, ttl_ms=request.ttl_ms,
                                      lease_scope=self._registry.lease_scope)

    async def KeepAlive(self, request: agent_pb2.KeepAliveRequest,
                        context: grpc.aio.ServicerContext) -> agent_pb2.KeepAliveReply:
        ttl_ms = await self._write(context, self._registry.keepalive, request.lease_id,
                                   owner_key=request.owner_key)
        return agent_pb2.KeepAliveReply(ttl_ms=ttl_ms)

    async def Unpublish(self, request: agent_pb2.UnpublishRequest,
                        context: grpc.aio.ServicerContext) -> agent_pb2.UnpublishReply:
        await self._write(context, self._registry.unpublish, request.lease_id,
                          owner_key=request.owner_key)
        return agent_pb2.UnpublishReply()

    async def QuerySegments(self, request: agent_pb2.QuerySegmentsRequest,
                            context: grpc.aio.ServicerContext,
                            ) -> agent_pb2.QuerySegmentsReply:
        segments = self._registry.query(request.engine)
        engines = self._registry.engine_infos(request.engine)
        reply = agent_pb2.QuerySegmentsReply(engines=[engine_info_to_pb(e) for e in engines])
        add_segments(reply.segments, segments)
        return reply

    async def Watch(self, request: agent_pb2.WatchRegistryRequest,
                    context: grpc.aio.ServicerContext,
                    ) -> AsyncIterator[agent_pb2.SegmentEvent]:
        """SNAPSHOT first, then every change, until the client goes away or falls behind."""
        subscription = self._registry.subscribe(engines=request.engines)
        try:
            while True:
                try:
                    event = await subscription.next()
                except HixlError as exc:
                    await abort_with(context, exc)
                    raise
                for message in events_to_pb(event, columns=request.columns):
                    yield message
        finally:
            subscription.close()


async def expire_forever(registry: Registry, interval_s: float = EXPIRE_EVERY_S) -> None:
    """Drop expired leases every `interval_s` so watchers hear about dead agents promptly."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            registry.expire()
        except Exception:  # a bug here must not stop expiry for good
            log.exception("registry expiry pass failed")


def start_expiry(registry: Registry, interval_s: float = EXPIRE_EVERY_S) -> asyncio.Task[None]:
    """Start the expiry task on the running loop; cancel the task to stop it."""
    return asyncio.get_running_loop().create_task(expire_forever(registry, interval_s),
                                                  name="hixl-registry-expiry")


_EXPIRY_TASKS: set[asyncio.Task[None]] = set()


def add_registry_service(server: grpc.aio.Server, registry: Registry, *,
                         expire_every_s: float | None = EXPIRE_EVERY_S) -> None:
    """Serve `registry` on `server`, and (unless expire_every_s is None) start its expiry task.

    Must be called on the loop that runs the server; the expiry task lives as long as
    that loop (asyncio.run cancels it at exit). Callers wanting to stop it themselves
    pass expire_every_s=None and use start_expiry().
    """
    agent_pb2_grpc.add_RegistryServicer_to_server(RegistryServicer(registry), server)
    if expire_every_s is None:
        return
    try:
        task = start_expiry(registry, expire_every_s)
    except RuntimeError:
        raise RuntimeError(
            "add_registry_service must run inside the event loop that serves the server "
            "(it starts the lease-expiry task); pass expire_every_s=None to skip it") from None
    _EXPIRY_TASKS.add(task)
    task.add_done_callback(_EXPIRY_TASKS.discard)


__all__ = [
    "EventKind", "PublishedSegments", "Registry", "RegistryEvent", "RegistryServicer",
    "Subscription",
    "SERVER_KEEPALIVE_OPTIONS", "add_registry_service", "event_to_pb", "events_to_pb",
    "expire_forever",
    "start_expiry",
]
