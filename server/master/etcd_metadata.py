"""The store's committed metadata on etcd: `EtcdMetadataBackend` (issue 8).

The same contract as the local journal (server/master/metadata.py's docstring), on `hixl.etcd`:
the committed state lives as keys under the cluster's prefix, so it outlives the master
and its host, and several hixl clusters share one etcd under different prefixes.

**Key layout** (relative to the prefix, which the client adds):

- `store/seg/<engine>/<segment id>`: a mounted segment: the mount record without "t",
  plus `"inc"`, the segment's *incarnation* (64 random bits, kept while the segment
  keeps its memory: epoch, base, length).
- `store/obj/<key>`: a committed object, `[key, size, hard_pin, [[replica_id, engine,
  segment_id, epoch, offset, length, inc], ...]]`: each replica with its segment's
  incarnation when it was written (0: no such segment then).
- `store/meta/next_replica_id`: the highest replica id written + 1.
- `store/writer`: the writer's claim (who, since when), held by its lease.

Engines and keys are percent-quoted in key names (non-ASCII, spaces, controls, "%";
"/" too in engines); the values carry the real names, so names only need be unique.

**Why incarnations.** An unmount or a mount with other memory drops objects *implicitly*
(the record names only the segment), and a txn cannot delete "every object with a
replica there". So the cascade is applied when the state is read back: a replica counts
only if its segment key exists with the same incarnation and epoch. A replica written
before an unmount or a replacement is stale, exactly what the journal's replay drops;
objects left with no replica are skipped, and their keys deleted as garbage.

**Commits.** `append` turns a record into key changes at once (under the store's lock,
so the incarnation cache follows mutation order) and queues them; one committer thread
sends them in order, one etcd txn per batch: consecutive records are packed into one txn
(group commit) while the batch names at most `max_txn_ops` keys (etcd's --max-txn-ops,
128 by default) and `MAX_TXN_BYTES`; a key named twice in a batch keeps its last change,
which is what applying them in order leaves (etcd refuses a key twice in one txn). The
txn returning is durability. A record with more keys than one txn takes is split at key
boundaries into consecutive txns: each key's change is atomic, the record's callers hear
of none until all are committed, and a crash in between leaves some of the record's keys
changed and the others not (a batch put or removal reports per key anyway; the replica
id counter goes in the first part, so ids never repeat). Every change is a whole-value
put or a delete, so `hixl.etcd`'s retry of a txn cut off mid-flight is harmless.

**Fencing.** The backend claims `store/writer` with expect-absent under a lease it keeps
alive; a second backend on the prefix is refused (ConfigError naming the prefix), after
waiting `wait_for_writer_s` for a dead writer's lease to end -- unless `take_over`: a
master that won the election (server/master/leadership.py) deletes the old claim at once, which
is safe because every txn of the old writer compares the claim's create revision, so
none lands once the claim is gone or re-made. Every txn compares the
writer key's create revision, plus whatever `fence()` returns (part 4: the election's
`Election.fence()`), so a writer that lost its claim cannot write. When the lease is
lost or a fence compare fails, the backend is *fenced*: it logs an error, refuses every
later append (NotConnected) and drops what was queued; it never writes again.

**Failures.** etcd unavailable: the txn fails within the client's deadline, and every
`wait_durable` waiting then raises the client's typed error (`PeerUnavailable` or
`TransferTimeout`), so the store's call fails (the front ends reply with the error, as
for a failed fsync) and never reports success for a change that is not committed. The
changes stay queued in order and the committer retries them until etcd is back (or the
backend is fenced or closed): the store's memory already holds them, so memory and
etcd converge; a caller told "failed" learns the outcome by reading, as after a timeout.
Other refusals (bad request, authentication) are permanent: the backend is fenced.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from hixl.errors import ConfigError, HixlError, NotConnected, TransferTimeout
from hixl.etcd import (
    MAX_TXN_BYTES,
    MAX_TXN_OPS,
    UNAVAILABLE_ERRORS,
    Compare,
    Delete,
    EtcdClient,
    EtcdConfig,
    Get,
    Lease,
    Put,
    TxnOp,
    key_part,
)
from hixl.server.master.metadata import LoadedState, MetadataBackend, Record, State

log = logging.getLogger("hixl.store")

STORE_DIR = "store/"
SEGMENT_DIR = STORE_DIR + "seg/"
OBJECT_DIR = STORE_DIR + "obj/"
NEXT_REPLICA_KEY = STORE_DIR + "meta/next_replica_id"
WRITER_KEY = STORE_DIR + "writer"
#: the writer lease: a master that cannot refresh it for this long is fenced, and a
#: killed master's claim ends after it
DEFAULT_WRITER_TTL_S = 10
_RETRY_PAUSE_S = (0.05, 1.0)   # the committer's pause after a failed txn: first, most
_OP_OVERHEAD = 16              # bytes a txn op costs besides its key and value

#: a key's change: the new value, or None to delete it
Changes = dict[str, bytes | None]


def segment_key(engine: str, segment_id: int) -> str:
    return f"{SEGMENT_DIR}{key_part(engine)}/{segment_id}"


def object_key(key: str) -> str:
    return OBJECT_DIR + key_part(key, slash=True)


def _json(value: object) -> bytes:
    # ASCII escapes: every text the store accepts round-trips, lone surrogates included
    return json.dumps(value, separators=(",", ":")).encode("ascii")


class _Memory(NamedTuple):
    """A segment's memory (epoch, base, length) and the incarnation it has."""

    epoch: int
    base: int
    length: int
    inc: int


def _fresh_incarnation() -> int:
    return secrets.randbits(63) | 1   # never 0: 0 marks a replica on no known segment


@dataclass
class _Entry:
    """Queued key changes: one record, or one part of a record too big for one txn."""

    seq: int
    changes: Changes
    size: int


class _EtcdMark(NamedTuple):
    backend: int     # id() of the backend that made it
    seq: int


@dataclass
class _Failure:
    """Why the committer's last txn failed, and how many have failed so far."""

    count: int = 0
    error: HixlError | None = None
    since: float = 0.0


class _Fenced(Exception):
    """A txn's compare failed: this writer may not write any more."""


class EtcdMetadataBackend(MetadataBackend):
    """The store's committed metadata under an etcd prefix (see the module docstring).

    `etcd`: an EtcdConfig (or what `EtcdConfig.parse` takes), or an EtcdClient to borrow
    (not closed here: part 4 shares the election's). `writer_ttl`: the writer lease's
    TTL. `wait_for_writer_s`: how long a claim held by another writer may take to end
    before this one is refused (a master restarted after kill -9 waits out the old
    lease). `take_over`: delete another writer's claim instead of waiting (for the
    elected leader: the old writer lost the election, and its txns fail once its claim
    is gone). `fence`: extra compares for every txn (e.g. `lambda: [election.fence()]`).
    `max_txn_ops`: the etcd cluster's --max-txn-ops.

    ConfigError naming the prefix when another writer holds it; the client's typed error
    when etcd cannot be reached within its deadline.
    """

    def __init__(self, etcd: EtcdClient | EtcdConfig | Mapping[str, object] | str, *,
                 writer_ttl: int = DEFAULT_WRITER_TTL_S, wait_for_writer_s: float = 0.0,
                 take_over: bool = False,
                 fence: Callable[[], Iterable[Compare]] | None = None,
                 max_txn_ops: int = MAX_TXN_OPS) -> None:
        if max_txn_ops < 2:
            raise ConfigError(f"max_txn_ops must be at least 2, got {max_txn_ops}")
        self._owns_client = not isinstance(etcd, EtcdClient)
        self._client = EtcdClient(etcd, name="hixl-store-etcd") if self._owns_client \
            else etcd  # type: ignore[assignment]
        self.config: EtcdConfig = self._client.config
        self._fence_hook = fence
        self._max_ops = max_txn_ops
        self._cond = threading.Condition()
        self._queue: deque[_Entry] = deque()
        self._appended = 0            # seq of the last entry queued
        self._durable = 0             # seq of the last entry committed
        self._failure = _Failure()
        self._fenced = ""             # why this backend may no longer write ("" = it may)
        self._loaded = False
        self._closing = False
        self._closed = False
        self._unsent = 0              # entries close() could not commit
        self._close_by = 0.0          # when close() stops retrying an unavailable etcd
        self._memory: dict[tuple[str, int], _Memory] = {}
        self._next_replica_id = 1
        self._committer: threading.Thread | None = None
        self._lease: Lease | None = None
        self._writer_revision = 0
        try:
            self._claim(writer_ttl, wait_for_writer_s, take_over)
        except BaseException:
            self._release()
            raise

    # -- the contract ----------------------------------------------------------------

    def describe(self) -> str:
        return f"{self.config.describe()}, prefix {self.config.prefix}"

    @property
    def client(self) -> EtcdClient:
        """The etcd client it writes with (part 4 campaigns on the same one)."""
        return self._client

    @property
    def fenced(self) -> str:
        """Why this backend may no longer write ("" while it may)."""
        return self._fenced

    def load(self) -> LoadedState:
        """Read the prefix at one revision into the store's snapshot shape (stale
        replicas dropped); objects left without replicas are queued for deletion."""
        if self._loaded:
            raise RuntimeError(f"{self.describe()}: load() may be called only once")
        if self._closed or self._closing:
            raise RuntimeError(f"{self.describe()}: closed")
        self._loaded = True
        snapshot = self._client.get_prefix(STORE_DIR)
        segments: list[dict[str, Any]] = []
        objects: list[list[Any]] = []
        garbage: list[str] = []
        next_id = 1
        raw_objects = []
        for kv in snapshot.items:
            if kv.key.startswith(SEGMENT_DIR):
                record = json.loads(kv.value)
                inc = record.pop("inc")
                self._memory[(record["e"], record["i"])] = _Memory(
                    record["p"], record["b"], record["l"], inc)
                segments.append(record)
            elif kv.key.startswith(OBJECT_DIR):
                raw_objects.append((kv.key, json.loads(kv.value)))
            elif kv.key == NEXT_REPLICA_KEY:
                next_id = max(next_id, int(kv.value))
        for name, (key, size, hard_pin, replicas) in raw_objects:
            kept = []
            for replica_id, engine, segment_id, epoch, offset, length, inc in replicas:
                next_id = max(next_id, replica_id + 1)
                held = self._memory.get((engine, segment_id))
                if held is not None and held.inc == inc and held.epoch == epoch:
                    kept.append([replica_id, engine, segment_id, epoch, offset, length])
            if kept:
                objects.append([key, size, hard_pin, kept])
            else:
                garbage.append(name)
        self._next_replica_id = next_id
        if garbage:
            with self._cond:
                self._queue_changes(dict.fromkeys(garbage))
        self._committer = threading.Thread(target=self._commit_forever, daemon=True,
                                           name="hixl-store-etcd-commit")
        self._committer.start()
        if garbage:
            log.info("%s: %d objects lost every replica to unmounts or replaced segments; "
                     "deleting their keys", self.describe(), len(garbage))
        if not snapshot.items:
            return LoadedState(None, [])
        return LoadedState({"version": 1, "next_replica_id": next_id,
                            "segments": segments, "objects": objects}, [])

    def append(self, record: Record) -> _EtcdMark:
        with self._cond:
            self._check_writable()
            return _EtcdMark(id(self), self._queue_changes(self._changes(record)))

    def mark(self) -> _EtcdMark:
        with self._cond:
            self._check_writable()
            return _EtcdMark(id(self), self._appended)

    def wait_durable(self, mark: object | None = None) -> None:
        """Return once the committer has passed `mark`. Raises the client's typed error
        when a txn fails while waiting (etcd unavailable), NotConnected when fenced, and
        TransferTimeout when the committer makes no progress for twice the deadline."""
        if mark is not None and not (isinstance(mark, _EtcdMark) and mark.backend == id(self)):
            raise TypeError(f"{self.describe()}: {mark!r} is not one of its marks")
        stall_s = 2 * self.config.timeout + 1.0
        with self._cond:
            target = self._appended if mark is None else mark.seq
            failures = self._failure.count
            progress, deadline = self._durable, time.monotonic() + stall_s
            while self._durable < target:
                if self._fenced:
                    raise self._fenced_error()
                if self._closed:
                    raise NotConnected(f"{self.describe()}: closed before the change was "
                                       f"committed ({self._unsent} changes never were)")
                if self._failure.count > failures and self._failure.error is not None:
                    error = self._failure.error
                    raise type(error)(f"{self.describe()}: the change is not committed "
                                      f"(it stays queued and is retried): {error.args[0]}")
                if self._durable > progress:
                    progress, deadline = self._durable, time.monotonic() + stall_s
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransferTimeout(f"{self.describe()}: the change was not committed "
                                          f"within {stall_s:g} s (the committer is stuck)")
                self._cond.wait(left)

    @property
    def records_since_snapshot(self) -> int:
        return 0

    def begin_snapshot(self) -> None:
        """None: etcd holds the state itself (and compacts its own history)."""
        return None

    def write_snapshot(self, cut: object, state: State) -> None:
        raise TypeError(f"{self.describe()}: takes no snapshots (begin_snapshot is None)")

    def close(self) -> None:
        """Commit what is queued (within the client's deadline), give up the writer
        claim, close the client. Idempotent."""
        with self._cond:
            if self._closed or self._closing:
                return
            self._closing = True
            self._close_by = time.monotonic() + self.config.timeout
            self._cond.notify_all()
        if self._committer is not None:
            self._committer.join(2 * self.config.timeout + 5.0)
        with self._cond:
            self._unsent = len(self._queue)
            self._queue.clear()
            self._closed = True
            self._cond.notify_all()
        if self._unsent and not self._fenced:
            log.error("%s: closed with %d changes not committed: %s", self.describe(),
                      self._unsent, self._failure.error)
        self._release()

    # -- the writer claim ------------------------------------------------------------

    def _claim(self, ttl: int, wait_s: float, take_over: bool = False) -> None:
        """Take `store/writer` (expect-absent, under a new lease), waiting up to `wait_s`
        for another writer's claim to end, or deleting it at once with `take_over`."""
        self._lease = self._client.grant(ttl, on_lost=self._lease_lost)
        claim = _json({"host": socket.gethostname(), "pid": os.getpid(),
                       "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        deadline = time.monotonic() + wait_s
        said = False
        while True:
            result = self._client.txn([Compare.absent(WRITER_KEY)],
                                      [Put(WRITER_KEY, claim, self._lease.id)],
                                      [Get(WRITER_KEY)])
            if result.succeeded:
                self._writer_revision = result.revision
                return
            held = result.gets[0][0] if result.gets and result.gets[0] else None
            holder = held.value.decode(errors="replace") if held is not None else "?"
            if take_over and held is not None:
                # only that very claim: a txn of its writer compares its create revision
                self._client.txn([Compare(WRITER_KEY, "create", "==", held.create_revision)],
                                 [Delete(WRITER_KEY)])
                log.warning("%s: took the store over from the previous writer (%s), which "
                            "lost the election: none of its commits can land any more",
                            self.describe(), holder)
                continue
            left = deadline - time.monotonic()
            if left <= 0:
                raise ConfigError(
                    f"store metadata prefix {self.config.prefix} on {self.config.describe()} "
                    f"is in use by another hixl-master ({holder}): give each cluster its "
                    "own etcd prefix (--etcd-prefix), or stop the other master")
            if not said:
                log.warning("%s: another writer holds the store (%s); waiting up to %.3g s "
                            "for its lease to end", self.describe(), holder, left)
                said = True
            time.sleep(min(0.2, left))

    def _lease_lost(self, lease: Lease) -> None:
        self._fence(f"the writer lease {lease.id:x} was lost ({lease.lost_reason})")

    def _fence(self, reason: str) -> None:
        with self._cond:
            if self._fenced or self._closed:
                return
            self._fenced = reason
            # said before any waiter hears of it, so the log has it first
            log.error("%s: FENCED, this master may no longer write the store's metadata: "
                      "%s; %d queued changes dropped, every later change refused (restart "
                      "it)", self.describe(), reason, len(self._queue))
            self._queue.clear()
            self._cond.notify_all()

    def _fenced_error(self) -> NotConnected:
        return NotConnected(f"{self.describe()}: fenced ({self._fenced}): this master may "
                            "no longer write the store's metadata")

    def _check_writable(self) -> None:
        if self._closed or self._closing:
            raise RuntimeError(f"{self.describe()}: closed")
        if not self._loaded:
            raise RuntimeError(f"{self.describe()}: load() it before appending")
        if self._fenced:
            raise self._fenced_error()

    def _release(self) -> None:
        """Give up the claim (its key vanishes with the lease) and the owned client."""
        lease, self._lease = self._lease, None
        try:
            if lease is not None and not lease.lost:
                lease.revoke()
        except HixlError as exc:
            log.info("%s: writer lease not revoked (it ends after its TTL): %s",
                     self.describe(), exc)
        finally:
            if self._owns_client:
                self._client.close()

    # -- records -> key changes ------------------------------------------------------

    def _changes(self, record: Record) -> Changes:
        """What `record` does to the keys (with the lock held: in append order)."""
        kind = record["t"]
        if kind == "mount":
            ident = (record["e"], record["i"])
            memory = (record["p"], record["b"], record["l"])
            held = self._memory.get(ident)
            inc = held.inc if held is not None and held[:3] == memory else _fresh_incarnation()
            self._memory[ident] = _Memory(*memory, inc)
            value = {k: v for k, v in record.items() if k != "t"}
            return {segment_key(*ident): _json({**value, "inc": inc})}
        if kind == "unmount":
            self._memory.pop((record["e"], record["i"]), None)
            return {segment_key(record["e"], record["i"]): None}
        if kind == "put":
            changes: Changes = {}
            top = 0
            for key, size, hard_pin, replicas in record["o"]:
                written = []
                for replica_id, engine, segment_id, epoch, offset, length in replicas:
                    top = max(top, replica_id)
                    held = self._memory.get((engine, segment_id))
                    inc = held.inc if held is not None and held.epoch == epoch else 0
                    written.append([replica_id, engine, segment_id, epoch, offset, length, inc])
                changes[object_key(key)] = _json([key, size, hard_pin, written])
            if top >= self._next_replica_id:
                self._next_replica_id = top + 1
                # first, so a record split over several txns never leaves ids to reuse
                changes = {NEXT_REPLICA_KEY: str(top + 1).encode(), **changes}
            return changes
        if kind == "rm":
            return {object_key(key): None for key in record["k"]}
        raise ValueError(f"{self.describe()}: unknown record kind {kind!r}")

    def _queue_changes(self, changes: Changes) -> int:
        """Queue `changes` (lock held) in parts that each fit one txn; the last part's seq."""
        part: Changes = {}
        size = 0
        for key, value in changes.items():
            cost = self._cost(key, value)
            if part and (len(part) >= self._max_ops or size + cost > MAX_TXN_BYTES):
                self._enqueue(part, size)
                part, size = {}, 0
            part[key] = value
            size += cost
        if part or not changes:
            self._enqueue(part, size)
        return self._appended

    def _cost(self, key: str, value: bytes | None) -> int:
        return len(self.config.prefix) + len(key.encode()) + len(value or b"") + _OP_OVERHEAD

    def _enqueue(self, changes: Changes, size: int) -> None:
        self._appended += 1
        self._queue.append(_Entry(self._appended, changes, size))
        self._cond.notify_all()

    # -- the committer ---------------------------------------------------------------

    def _batch(self) -> tuple[Changes, int]:
        """Consecutive queued entries that fit one txn, merged (lock held); the seq of
        the last one. A key changed twice keeps its last change."""
        merged: Changes = {}
        size = 0
        last = 0
        for entry in self._queue:
            new_keys = sum(1 for key in entry.changes if key not in merged)
            if last and (len(merged) + new_keys > self._max_ops
                         or size + entry.size > MAX_TXN_BYTES):
                break
            merged.update(entry.changes)
            size += entry.size
            last = entry.seq
        return merged, last

    def _commit_forever(self) -> None:
        """Send the queue in order, one txn per batch, until closed (and drained) or
        fenced; retry a batch that failed because etcd was unavailable."""
        pause = _RETRY_PAUSE_S[0]
        while True:
            with self._cond:
                while not self._queue and not self._closing and not self._fenced:
                    self._cond.wait()
                if self._fenced or not self._queue:
                    return
                if self._closing and self._failure.error is not None \
                        and time.monotonic() > self._close_by:
                    return  # closing, and etcd stayed unavailable: close() reports it
                changes, last = self._batch()
            try:
                self._commit(changes)
            except _Fenced as exc:
                self._fence(str(exc))
                return
            except UNAVAILABLE_ERRORS as exc:
                with self._cond:
                    if not self._failure.count or self._failure.error is None:
                        self._failure.since = time.monotonic()
                    self._failure.count += 1
                    self._failure.error = exc
                    self._cond.notify_all()
                    log.warning("%s: commit failed, retrying: %s", self.describe(), exc)
                    self._cond.wait(pause)
                pause = min(pause * 2, _RETRY_PAUSE_S[1])
                continue
            except HixlError as exc:  # refused for good (bad request, credentials)
                self._fence(f"etcd refused a commit: {exc}")
                return
            except Exception as exc:  # a bug: stop writing rather than skip a change
                log.exception("%s: the committer failed", self.describe())
                self._fence(f"internal error in the committer: {exc!r}")
                return
            with self._cond:
                while self._queue and self._queue[0].seq <= last:
                    self._queue.popleft()
                self._durable = last
                if self._failure.error is not None:
                    log.info("%s: commits go through again after %.3g s", self.describe(),
                             time.monotonic() - self._failure.since)
                    self._failure.error = None
                self._cond.notify_all()
            pause = _RETRY_PAUSE_S[0]

    def _commit(self, changes: Changes) -> None:
        """One txn: every change if the writer still holds its claim and every fence
        compare holds, else nothing (and _Fenced says why)."""
        if not changes:
            return
        try:
            fences = list(self._fence_hook()) if self._fence_hook is not None else []
        except HixlError as exc:
            raise _Fenced(f"no fence to write under: {exc}") from None
        compares = [Compare(WRITER_KEY, "create", "==", self._writer_revision), *fences]
        ops: list[TxnOp] = [Put(key, value) if value is not None else Delete(key)
                            for key, value in changes.items()]
        result = self._client.txn(compares, ops, [Get(WRITER_KEY)])
        if result.succeeded:
            return
        held = result.gets[0] if result.gets else ()
        if not held:
            raise _Fenced("the writer claim is gone (its lease expired or was revoked)")
        if held[0].create_revision != self._writer_revision:
            raise _Fenced("another writer holds the store now ("
                          f"{held[0].value.decode(errors='replace')})")
        raise _Fenced("a fence compare failed (this master no longer leads)")


__all__ = ["DEFAULT_WRITER_TTL_S", "EtcdMetadataBackend", "MAX_TXN_BYTES", "MAX_TXN_OPS",
           "object_key", "segment_key"]
