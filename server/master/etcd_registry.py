"""The registry with its leases on etcd: `EtcdRegistry` (issue 8).

With etcd configured, the address table outlives the master that serves it: each engine's
published table is one key, `<prefix>registry/engine/<engine>`, held by an *etcd lease*,
so etcd (not a master's clock) ends the table of an agent that stopped renewing it, and
a standby that takes over serves the same leases at once: an agent's next keepalive goes
to the new leader and simply works, nothing is published again and no watcher sees its
segments go and come back.

- The value is the agent's own `PublishRequest` (engine, node id, epoch, TTL, endpoints,
  segments), so what etcd holds is exactly what was published; a table over one txn's
  size (`hixl.etcd.MAX_TXN_BYTES`: some 20,000 segments of about 50 bytes) is refused
  (ResourceExhausted).
- `publish` reads the key, refuses an older epoch (StaleEpoch), and writes it in one txn
  that compares the key's mod revision (two publishers cannot interleave) and this
  master's election fence (a deposed leader writes nothing). The same epoch and TTL keep
  the agent's lease (refreshed first); a newer epoch is a restart: a new lease, and the
  old one is revoked after the txn. Lease ids are etcd's, valid on every master.
- Ownership (issue 15): a name published with an owner key belongs to that key. The
  key's verifier (SHA-256, never the key) rides in the stored value (`owner_verifier`,
  so every master checks keepalives and unpublishes against it) and in a key of its own,
  `<prefix>registry/owner/<engine>`, without a lease: it outlives the engine's lease, so
  every master, now and after any failover, refuses the name to any other key until an
  operator deletes that key (`release_owner`). A publish reads it (cached per master,
  proven current by the txn's compare) and writes it on the first claim, in the same txn.
- `keepalive` is one etcd keepalive of that lease; `unpublish` revokes it (etcd deletes
  the key); both only with the lease's owner key. etcd rounds a TTL up to whole seconds (and to its minimum, about 2 s).
- What every engine sees (queries, `find`, the Watch stream) is the in-memory `Registry`
  this class extends, kept as a *mirror* of the prefix: loaded with one read, then fed
  by an etcd watch from the next revision, so nothing is missed between the two. Each
  change becomes the same REMOVED/ENGINE_UP/ADDED/ENGINE_DOWN events a local registry
  emits. A write returns once the mirror has applied it (read-your-writes on this
  master). If etcd compacted the history while the watch was away, the mirror reloads
  and emits the difference.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from google.protobuf.message import DecodeError

from hixl.control import add_segments, segment_from_pb
from hixl.errors import (
    HixlError,
    NotConnected,
    ParamInvalid,
    PermissionDenied,
    ResourceExhausted,
    TransferFailed,
)
from hixl.etcd import (
    MAX_TXN_BYTES,
    Compare,
    Delete,
    EtcdClient,
    Get,
    Put,
    Watch,
    WatchCompacted,
    WatchEvent,
    key_part,
)
from hixl.registry_client import EngineEndpoints, endpoints_from_pb, endpoints_to_pb
from hixl.server.registry import (
    DEFAULT_MAX_TTL_MS,
    DEFAULT_WATCH_QUEUE_LIMIT,
    Registry,
    check_owner_key,
    refuse_lease,
    refuse_owner,
    stale_publish,
)
from hixl.table import AddressTable
from hixl.types import SegmentInfo
from hixl.v1 import agent_pb2

log = logging.getLogger("hixl.registry")

ENGINE_DIR = "registry/engine/"
#: one key per owned engine name: the owner key's verifier (no lease: it outlives leases)
OWNER_DIR = "registry/owner/"
#: how often publish re-reads and retries when another write to the same engine won
PUBLISH_ATTEMPTS = 8
_FOREVER = math.inf  # a mirrored lease's deadline: etcd, not this clock, ends it


def engine_key(engine: str) -> str:
    return ENGINE_DIR + key_part(engine)


def owner_key_of(engine: str) -> str:
    """The etcd key (under the prefix) that holds who owns `engine`'s name."""
    return OWNER_DIR + key_part(engine)


def lease_seconds(ttl_ms: int) -> int:
    """An etcd lease TTL for `ttl_ms`: whole seconds, rounded up."""
    return max(1, math.ceil(ttl_ms / 1000))


class _Seen(NamedTuple):
    """What a publish knows an engine's key holds (from the mirror, or read from etcd):
    its mod revision and lease, and the epoch and TTL of its table (None: a value hixl
    cannot decode, which the publish simply replaces)."""

    mod_revision: int
    lease: int
    epoch: int | None
    ttl_ms: int | None
    owner: bytes = b""


class _Owner(NamedTuple):
    """What the owner key of an engine holds: its mod revision (0: absent) and verifier."""

    mod_revision: int
    verifier: bytes


@dataclass(frozen=True)
class _Record:
    """One engine's key, checked and indexed: what the mirror installs."""

    engine: str
    node_id: str
    epoch: int
    ttl_ms: int
    endpoints: EngineEndpoints
    segments: tuple[SegmentInfo, ...]
    table: AddressTable[SegmentInfo]
    owner: bytes = b""

    @classmethod
    def decode(cls, registry: Registry, value: bytes) -> _Record:
        pb = agent_pb2.PublishRequest.FromString(value)
        segments, table = registry._build_table(
            pb.engine, pb.epoch, (segment_from_pb(s) for s in pb.segments))
        return cls(pb.engine, pb.node_id, pb.epoch, pb.ttl_ms,
                   endpoints_from_pb(pb.endpoints), segments, table, pb.owner_verifier)


class EtcdRegistry(Registry):
    """A `Registry` whose leases are etcd leases and whose content mirrors etcd.

    Not usable until `attach(client)` (the master does it when it wins the election);
    until then every write raises NotConnected. Writes block on etcd (`blocking`: the
    gRPC skin runs them on a thread); reads are served from the mirror.
    """

    blocking = True

    def __init__(self, *, max_ttl_ms: int = DEFAULT_MAX_TTL_MS,
                 watch_queue_limit: int = DEFAULT_WATCH_QUEUE_LIMIT,
                 switch_s: float = 0.0) -> None:
        """`switch_s`: how long the masters take to switch leaders (about their election
        TTL); an agent publishing a shorter lease is warned of, once: its table would
        lapse during a switch."""
        super().__init__(max_ttl_ms=max_ttl_ms, watch_queue_limit=watch_queue_limit)
        self.switch_s = switch_s
        self._warned_short: set[str] = set()
        self._client: EtcdClient | None = None
        self._fence: Callable[[], Sequence[Compare]] = list
        self._watch: Watch | None = None
        self._changed = threading.Condition(self._lock)
        self._applied = 0                   # the etcd revision the mirror reflects
        self._engine_of: dict[str, str] = {}  # key -> engine, for DELETE events
        self._mod_of: dict[str, int] = {}     # key -> its mod revision, as mirrored
        #: key -> (value, record) of a publish under way here: installed without decoding
        self._written: dict[str, tuple[bytes, _Record]] = {}
        self._revoking: set[int] = set()    # leases unpublished here (not expiries)
        #: engine -> its owner key as this master last read or wrote it (the txn's
        #: compare proves it current, else it is read again)
        self._owner_seen: dict[str, _Owner] = {}
        self._closed = False

    @property
    def lease_scope(self) -> str:  # type: ignore[override]
        """Every master on this etcd prefix renews these leases."""
        client = self._client
        return f"etcd:{client.prefix}" if client is not None else ""

    # -- life ---------------------------------------------------------------------------

    def attach(self, client: EtcdClient, *,
               fence: Callable[[], Sequence[Compare]] = list) -> None:
        """Load the registry from etcd and follow it; writes go to etcd from now on, each
        fenced by `fence()` (the election's). Blocking; raises the client's typed error
        when etcd cannot be read."""
        self._client, self._fence = client, fence
        self._reload()
        log.info("registry: on %s (%d engines loaded)", client.config.describe(),
                 len(self.engines()))

    def close(self) -> None:
        """Stop following etcd (the leases stay: another master serves them)."""
        self._closed = True
        watch, self._watch = self._watch, None
        if watch is not None:
            with contextlib.suppress(HixlError):
                watch.cancel()

    def _reload(self) -> None:
        """Make the mirror what the prefix holds now (emitting the difference), then watch
        from the next revision."""
        client = self._attached()
        snapshot = client.get_prefix(ENGINE_DIR)
        loaded = {kv.key: (kv, record) for kv in snapshot.items
                  if (record := self._decode(kv.key, kv.value)) is not None}
        with self._lock:
            for key in [k for k in self._engine_of if k not in loaded]:
                self._remove_locked(key)
            for key, (kv, record) in loaded.items():
                held = self._by_engine.get(record.engine)
                if held is None or (held.lease_id, held.epoch, held.segments, held.node_id,
                                    held.endpoints) != (kv.lease, record.epoch,
                                                        record.segments, record.node_id,
                                                        record.endpoints):
                    self._apply_locked(key, kv.mod_revision, kv.lease, record)
                self._mod_of[key] = kv.mod_revision  # (also when only that changed)
            self._advance_locked(snapshot.revision)
        self._watch = client.watch_prefix(ENGINE_DIR, self._on_change,
                                          start_revision=snapshot.revision + 1)

    # -- writes (to etcd) -----------------------------------------------------------------

    def publish(self, engine: str, node_id: str, epoch: int,
                segments: Sequence[SegmentInfo], ttl_ms: int, *,
                endpoints: EngineEndpoints | None = None,
                owner_key: bytes | None = None) -> int:
        verifier = check_owner_key(f"publish {engine!r}", owner_key)
        endpoints, ordered, table = self._check_publish(engine, epoch, segments, ttl_ms,
                                                        endpoints)
        client = self._attached()
        pb = agent_pb2.PublishRequest(engine=engine, node_id=node_id, epoch=epoch,
                                      ttl_ms=ttl_ms, endpoints=endpoints_to_pb(endpoints),
                                      owner_verifier=verifier)
        add_segments(pb.segments, ordered)
        value = pb.SerializeToString()
        if len(value) > MAX_TXN_BYTES:
            raise ResourceExhausted(
                f"publish {engine!r}: its table of {len(ordered)} segments takes "
                f"{len(value)} bytes, over the {MAX_TXN_BYTES} one etcd transaction carries "
                "(the registry is on etcd): publish fewer, larger segments")
        key = engine_key(engine)
        record = _Record(engine, node_id, epoch, ttl_ms, endpoints, ordered, table, verifier)
        if ttl_ms < self.switch_s * 1000 and engine not in self._warned_short:
            self._warned_short.add(engine)
            log.warning("registry: engine %r publishes with a %g s lease, shorter than the "
                        "masters' switch time (about %g s): during a switch its table "
                        "lapses and it publishes again; give its agent lease_ttl_ms of "
                        "%d or more", engine, ttl_ms / 1000, self.switch_s,
                        math.ceil(self.switch_s * 2) * 1000)
        with self._lock:
            self._written[key] = (value, record)  # the mirror installs it without decoding
        try:
            for attempt in range(PUBLISH_ATTEMPTS):
                # first from the mirror (no read: the txn's compare proves it current),
                # then from etcd itself
                seen = (self._mirror_view(key, engine) if attempt == 0
                        else self._read_view(client, key))
                owner = self._owner_view(client, engine, fresh=attempt > 0)
                try:
                    lease_id = self._try_publish(client, key, record, seen, value, owner)
                except PermissionDenied:
                    if attempt:
                        raise
                    continue  # refused on what this master remembered: read etcd, decide again
                if lease_id:
                    return lease_id
        finally:
            with self._lock:
                if self._written.get(key, (None,))[0] is value:
                    del self._written[key]
        raise TransferFailed(f"publish {engine!r}: its registry key changed under each of "
                             f"{PUBLISH_ATTEMPTS} attempts (is another agent publishing as "
                             "the same engine?)")

    def _mirror_view(self, key: str, engine: str) -> _Seen | None:
        """What the mirror holds for `key` (no read: the txn's compare proves it current)."""
        with self._lock:
            lease = self._by_engine.get(engine)
            revision = self._mod_of.get(key, 0)
            if lease is None or not revision:
                return None
            return _Seen(revision, lease.lease_id, lease.epoch, lease.ttl_ms, lease.owner)

    def _read_view(self, client: EtcdClient, key: str) -> _Seen | None:
        """What etcd holds for `key` now."""
        kv = client.get(key)
        if kv is None:
            return None
        record = self._decode(kv.key, kv.value)
        if record is None:
            return _Seen(kv.mod_revision, kv.lease, None, None)
        return _Seen(kv.mod_revision, kv.lease, record.epoch, record.ttl_ms, record.owner)

    def _owner_view(self, client: EtcdClient, engine: str, *, fresh: bool) -> _Owner:
        """Who owns `engine` (from this master's cache unless `fresh`, else read)."""
        if not fresh:
            with self._lock:
                cached = self._owner_seen.get(engine)
            if cached is not None:
                return cached
        kv = client.get(owner_key_of(engine))
        owner = _Owner(kv.mod_revision, kv.value) if kv is not None else _Owner(0, b"")
        self._remember_owner(engine, owner)
        return owner

    def _remember_owner(self, engine: str, owner: _Owner) -> None:
        with self._lock:
            self._owner_seen[engine] = owner
            while len(self._owner_seen) > self.max_owners:  # a cache: re-read when dropped
                del self._owner_seen[next(iter(self._owner_seen))]

    def release_hint(self, engine: str) -> str:
        client = self._client
        prefix = client.prefix if client is not None else "<prefix>"
        return (f"delete etcd key {prefix}{owner_key_of(engine)} once its lease has ended "
                f"(EtcdRegistry.release_owner({engine!r}))")

    def release_owner(self, engine: str) -> bool:
        """Delete `engine`'s owner key on etcd, unless the engine has a live lease."""
        client = self._attached()
        key, okey = engine_key(engine), owner_key_of(engine)
        result = client.txn([Compare.absent(key), *self._fence()], [Delete(okey), Get(okey)],
                            [Get(key)])
        with self._lock:
            self._owner_seen.pop(engine, None)
        if not result.succeeded:
            if result.gets and result.gets[0]:
                raise ParamInvalid(f"release of {engine!r}: it has a live lease; only an "
                                   "ended lease's name can be released")
            raise NotConnected(f"release of {engine!r}: this hixl-master is no longer the "
                               "leader of the registry")
        return True

    def _try_publish(self, client: EtcdClient, key: str, record: _Record,
                     seen: _Seen | None, value: bytes, owner: _Owner) -> int:
        """One check-and-write round against `seen` (what the key holds, as far as we
        know) and `owner` (who owns the name); the lease id, or 0 when either was not
        that (read them and go again)."""
        engine = record.engine
        # the owner key decides; a live lease's own verifier too (its owner key deleted
        # by hand while it lives)
        held_owner = owner.verifier or (seen.owner if seen is not None else b"")
        refuse_owner(engine, held_owner, record.owner, self.release_hint(engine))
        claim = bool(record.owner) and not owner.verifier
        if seen is not None and seen.epoch is not None and record.epoch < seen.epoch:
            raise stale_publish(engine, record.epoch, seen.epoch)
        lease_id, fresh = 0, False
        if (seen is not None and seen.lease and seen.epoch == record.epoch
                and seen.ttl_ms == record.ttl_ms and client.refresh(seen.lease) > 0):
            lease_id = seen.lease  # the same agent's table changed: its lease goes on
        else:
            lease_id, fresh = client.grant(lease_seconds(record.ttl_ms), keepalive=False,
                                           owned=False).id, True
        expected = seen.mod_revision if seen is not None else 0
        okey = owner_key_of(engine)
        writes: list[Put | Get] = [Put(key, value, lease_id)]
        if claim:
            writes.append(Put(okey, record.owner))
        try:
            result = client.txn([Compare.mod_revision_is(key, expected),
                                 Compare.mod_revision_is(okey, owner.mod_revision),
                                 *self._fence()],
                                writes, [Get(key), Get(okey)])
        except ParamInvalid as exc:
            if fresh or "lease not found" not in str(exc):
                raise
            return 0  # the kept lease ended just now: grant a fresh one
        if not result.succeeded:
            if fresh:
                self._revoke_quietly(client, lease_id)
            gets = result.gets
            now = gets[0][0].mod_revision if gets and gets[0] else 0
            owner_now = gets[1][0].mod_revision if len(gets) > 1 and gets[1] else 0
            if (now, owner_now) == (expected, owner.mod_revision):
                raise NotConnected(f"publish {engine!r}: this hixl-master is no longer the "
                                   "leader of the registry; publish to the leader")
            return 0
        if claim:
            self._remember_owner(engine, _Owner(result.revision, record.owner))
        if seen is not None and seen.lease and seen.lease != lease_id:
            self._revoke_quietly(client, seen.lease)  # the replaced agent's lease
        self._wait_applied(result.revision, f"publish {engine!r}")
        return lease_id

    def keepalive(self, lease_id: int, *, owner_key: bytes | None = None) -> int:
        verifier = check_owner_key(f"keepalive of lease {lease_id}", owner_key)
        client = self._attached()
        ttl_ms = self._mirrored(lease_id, "keepalive", verifier)
        if client.refresh(lease_id) <= 0:
            raise NotConnected(f"lease {lease_id} expired or unknown; publish again")
        with self._lock:
            self.counters["keepalives"] += 1
        return ttl_ms

    def unpublish(self, lease_id: int, *, owner_key: bytes | None = None) -> None:
        verifier = check_owner_key(f"unpublish of lease {lease_id}", owner_key)
        client = self._attached()
        self._mirrored(lease_id, "unpublish", verifier)
        with self._lock:
            self._revoking.add(lease_id)
        client.revoke(lease_id)
        with self._changed:
            if not self._changed.wait_for(lambda: lease_id not in self._leases,
                                          client.config.timeout):
                log.warning("registry: lease %d revoked on etcd, but its deletion did not "
                            "reach this master's mirror within %g s", lease_id,
                            client.config.timeout)

    # -- the mirror (fed by the watch, on the etcd client's callback thread) -------------

    def _on_change(self, event: WatchEvent | WatchCompacted) -> None:
        if self._closed:
            return
        if isinstance(event, WatchCompacted):
            log.warning("registry: etcd compacted the history the watch needed (below "
                        "revision %d); reloading the registry", event.compact_revision)
            threading.Thread(target=self._reload_until_done, daemon=True,
                             name="hixl-registry-reload").start()
            return
        record = None
        if event.kind == "PUT":
            with self._lock:
                mine = self._written.get(event.key)
            record = mine[1] if mine is not None and mine[0] == event.value else \
                self._decode(event.key, event.value)
        with self._lock:
            if record is not None:
                self._apply_locked(event.key, event.revision, event.lease, record)
            elif event.kind == "DELETE":
                self._remove_locked(event.key)
            self._advance_locked(event.revision)

    def _reload_until_done(self) -> None:
        pause = 0.1
        while not self._closed:
            try:
                self._reload()
                return
            except HixlError as exc:
                log.warning("registry: reloading from etcd failed (%s); trying again", exc)
                threading.Event().wait(pause)
                pause = min(pause * 2, 2.0)

    def _apply_locked(self, key: str, revision: int, lease_id: int, record: _Record) -> None:
        self._engine_of[key] = record.engine
        self._mod_of[key] = revision
        self._install_locked(record.engine, record.node_id, record.epoch, record.ttl_ms,
                             _FOREVER, record.segments, record.table, record.endpoints,
                             lease_id=lease_id, owner=record.owner)

    def _remove_locked(self, key: str) -> None:
        engine = self._engine_of.pop(key, None)
        self._mod_of.pop(key, None)
        lease = self._by_engine.get(engine) if engine is not None else None
        if lease is None:
            return
        self._drop_locked(lease)
        if lease.lease_id in self._revoking:
            self._revoking.discard(lease.lease_id)
            self.counters["unpublishes"] += 1
        else:
            log.info("lease %d of engine %r (epoch %d) ended on etcd", lease.lease_id,
                     lease.engine, lease.epoch)
            self.counters["expiries"] += 1

    def _advance_locked(self, revision: int) -> None:
        if revision > self._applied:
            self._applied = revision
            self._changed.notify_all()

    def _wait_applied(self, revision: int, what: str) -> None:
        """Return once the mirror reflects `revision` (the write just made), so a query on
        this master sees it; a mirror that lags past the deadline is logged, not raised:
        the write itself is committed."""
        timeout = self._attached().config.timeout
        with self._changed:
            if not self._changed.wait_for(lambda: self._applied >= revision, timeout):
                log.warning("registry: %s is committed on etcd (revision %d), but this "
                            "master's mirror has not seen it within %g s", what, revision,
                            timeout)

    # -- helpers --------------------------------------------------------------------------

    def _attached(self) -> EtcdClient:
        client = self._client
        if client is None or self._closed:
            raise NotConnected("the registry is not served from etcd by this hixl-master "
                               "(not the leader, or shutting down)")
        return client

    def _mirrored(self, lease_id: int, what: str, verifier: bytes) -> int:
        """The TTL (ms) of mirrored lease `lease_id`; NotConnected when there is none
        (expired, revoked, or not a registry lease at all: this master refreshes and
        revokes only the leases it publishes under); PermissionDenied when the caller's
        owner key (`verifier`) is not the lease's."""
        with self._lock:
            lease = self._leases.get(lease_id)
        if lease is None:
            raise NotConnected(f"lease {lease_id} expired or unknown; publish again")
        refuse_lease(what, lease_id, lease.engine, lease.owner, verifier)
        return lease.ttl_ms

    def _decode(self, key: str, value: bytes) -> _Record | None:
        try:
            return _Record.decode(self, value)
        except (HixlError, ValueError, DecodeError) as exc:  # not written by hixl: skip it, say so
            log.error("registry: ignoring etcd key %r: not a valid published table (%s)",
                      key, exc)
            return None

    @staticmethod
    def _revoke_quietly(client: EtcdClient, lease_id: int) -> None:
        with contextlib.suppress(HixlError):  # it expires by itself anyway
            client.revoke(lease_id)

__all__ = ["ENGINE_DIR", "EtcdRegistry", "engine_key", "lease_seconds"]
