"""Where the KV store's committed metadata lives: `MetadataBackend` and its implementations.

`ObjectStore` (server/master/store.py) keeps its whole index in memory; a backend makes the
*committed* part of it (mounted segments and committed objects) survive the master.
Puts in progress, leases, soft pins and clients are never stored. Today's backend is
`LocalJournalBackend` (a data dir: snapshot + append-only journal, group commit); an
etcd backend (issue 8) implements the same interface on `hixl.etcd`.

**The contract** (what `ObjectStore` does with a backend, in this order):

1. `load()` once, at start: the latest snapshot-shaped state (or None) and the change
   records committed after it, which the store replays in order.
2. `append(record)` for every committed change, under the store's lock (so records are in
   mutation order): it returns a *mark* at once, without waiting for the disk or network.
   `mark()` gives the mark of everything appended so far (a `PutStart` waits for earlier
   releases of space to be durable before it hands that space out again).
3. `wait_durable(mark)` after the lock is released: returns once every record up to
   `mark` is durable (None: everything appended so far). Many callers wait at once;
   one fsync (or one etcd txn) should serve every record written before it began
   (group commit). It raises if the records cannot be made durable, and returns at
   once for a mark of a closed backend (closing made everything durable).
4. Periodically, when `records_since_snapshot` reaches the store's
   `snapshot_every_records`: `begin_snapshot()` under the store's lock (the cut: records
   appended after it belong after the snapshot), then `write_snapshot(cut, state)`
   outside the lock with the whole committed state as it was at the cut; the snapshot
   supersedes (and may delete) everything before the cut. A backend that does not need
   snapshots returns None from `begin_snapshot` and the store skips building the state.
5. `close()` at the end (after a final snapshot for a clean stop; without one, the
   backend is left as a crash leaves it). The store owns the backend it is given.

**Records** are JSON-able dicts; a backend must not change them. The kinds the store
writes, and what replaying one does:

- `{"t": "mount", "c": client id, "e": engine, "i": segment id, "p": epoch, "b": base,
  "l": length, "n": node id, "m": segment name, "x": [fabric_domain, data_tcp,
  data_unix, fd_socket]}`: add or update segment (e, i). If one is held with other memory
  (epoch, base, length), it is replaced: objects lose their replicas on the old one, and
  objects left with none are gone.
- `{"t": "unmount", "e": engine, "i": segment id}`: the segment goes, with the same
  cascade (an unmount, a client's expiry, a segment never remounted after a restart).
- `{"t": "put", "o": [object, ...]}`, object = `[key, size, hard_pin, [[replica_id,
  engine, segment_id, epoch, offset, length], ...]]`: install each (a `PutEnd`),
  replacing any older value of the key.
- `{"t": "rm", "k": [key, ...]}`: remove each key (removal, by regex, all, eviction).

**State** (a snapshot, and what `load` returns): `{"version": 1, "next_replica_id": n,
"segments": [mount record without "t", ...], "objects": [object, ...]}` (the local
backend adds `"gen"`). Replay skips replicas whose segment is unknown or has another
epoch, drops objects left without replicas, and continues replica ids after both
`next_replica_id` and the highest id it saw.

**On etcd** (the next step, on `hixl.etcd.EtcdClient`; `<p>` is the cluster's prefix,
which the client adds itself):

- `<p>/store/seg/<quoted engine>/<segment id>`: the mount record (without "t") plus
  `"inc"`, the segment's *incarnation*; `<p>/store/obj/<key>`: the object record, each
  replica with its segment's incarnation when written; `<p>/store/meta/next_replica_id`.
- mount -> one put of the seg key. The incarnation stays when the backend's cached
  segment (e, i) has the same memory (epoch, base, length), else it is fresh (64 random
  bits). unmount -> delete the seg key. put -> put each obj key, and meta/next_replica_id
  (the highest id written + 1). rm -> delete each obj key.
- Why incarnations: unmount and replacing mounts drop objects *implicitly* (the record
  names only the segment), and a txn cannot delete "every object with a replica there"
  without an index by segment. So the cascade is applied at load instead: a replica is
  kept only if its segment key exists with the same incarnation (a replica written
  before an unmount/replacement is stale, exactly what the journal's replay drops), and
  objects left with none are skipped (their keys may be deleted then, as garbage).
- One record -> one txn, sent in append order by a single committer; the txn returning is
  durability, so `wait_durable(mark)` waits for the committer to pass `mark`, and the
  committer may pack consecutive records into one txn (group commit) when they fit and
  name no key twice (etcd refuses a key twice in one txn). A record over etcd's txn limits
  (`--max-txn-ops`, 128 by default; the request size) is split at key boundaries: each
  key's change stays atomic, which is what replay needs (a batch call's outcomes are per
  key, and its caller hears of none until all are durable). Every txn is fenced on the writer's
  election key, so a deposed master cannot write; its operations are whole-value puts
  and deletes, so `hixl.etcd`'s retry of a txn cut off mid-flight is harmless.
- `load()` reads the prefix at one revision into the state above (with the stale
  replicas dropped) and returns no records; `records_since_snapshot` is 0 and
  `begin_snapshot()` None (etcd compacts its own history); `close()` drains the committer.
"""

from __future__ import annotations

import abc
import errno
import fcntl
import json
import logging
import os
import struct
import threading
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from hixl.errors import ConfigError, HixlError

#: the store's logger: what an operator reads about the store, wherever its metadata lives
log = logging.getLogger("hixl.store")

#: a committed change, as the store writes it (see the module docstring)
Record = dict[str, Any]
#: the whole committed state (a snapshot; see the module docstring)
State = dict[str, Any]


@dataclass(frozen=True)
class LoadedState:
    """What a backend holds at start: the latest snapshot-shaped state (None when there is
    none) and the records committed after it, in order."""

    snapshot: State | None
    records: list[Record]

    @property
    def empty(self) -> bool:
        return self.snapshot is None and not self.records


class MetadataBackend(abc.ABC):
    """Durable storage for the store's committed changes; the contract is the module
    docstring's.

    An ABC rather than a Protocol: every implementation is ours, `ObjectStore(backend=)`
    checks what it is given with isinstance, and an implementation that misses a method
    fails when it is built, not at its first commit.

    Marks and cuts are opaque: only the backend that made one reads it. `append`,
    `mark`, `records_since_snapshot` and `begin_snapshot` are called with the store's
    lock held (one at a time, in mutation order) and must not wait for I/O to finish;
    `wait_durable` runs in many threads at once without it; `write_snapshot` runs
    without it, one at a time.
    """

    #: True when commits may wait for storage (the store's callers then run them off
    #: the event loop). Every backend is; in memory is "no backend".
    persistent: bool = True

    @abc.abstractmethod
    def describe(self) -> str:
        """Where the metadata lives, for logs and Health ("local journal in /var/...")."""

    @abc.abstractmethod
    def load(self) -> LoadedState:
        """The committed state to replay; called once, before anything else."""

    @abc.abstractmethod
    def append(self, record: Record) -> object:
        """Send a committed change on its way; returns its mark (not yet durable)."""

    @abc.abstractmethod
    def mark(self) -> object:
        """The mark of everything appended so far."""

    @abc.abstractmethod
    def wait_durable(self, mark: object | None = None) -> None:
        """Return once everything up to `mark` (None: all appended so far) is durable."""

    @property
    @abc.abstractmethod
    def records_since_snapshot(self) -> int:
        """Records appended since the last cut: the store snapshots past its threshold."""

    @abc.abstractmethod
    def begin_snapshot(self) -> object | None:
        """Cut the record stream for a snapshot (None: this backend takes none)."""

    @abc.abstractmethod
    def write_snapshot(self, cut: object, state: State) -> None:
        """Store `state` (the committed state at `cut`) and drop what it supersedes."""

    @abc.abstractmethod
    def close(self) -> None:
        """Make what was appended durable and release the storage; idempotent."""
# ---------------------------------------------------------------------------- journal

_FRAME = struct.Struct("<II")  # payload length, crc32 of payload


def _encode(record: dict[str, Any]) -> bytes:
    payload = json.dumps(record, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return _FRAME.pack(len(payload), zlib.crc32(payload)) + payload


def read_journal(path: Path) -> tuple[list[dict[str, Any]], int, int]:
    """(records, end of the last whole record, end of the data): a torn or corrupt tail
    stops it. The zeros the journal keeps ahead of its records (Journal.PREALLOCATE) are
    not data: a file of records and zeros reads as end == size."""
    data = path.read_bytes()
    records: list[dict[str, Any]] = []
    pos = 0
    while pos + _FRAME.size <= len(data):
        length, crc = _FRAME.unpack_from(data, pos)
        if length == 0 and not data[pos:].strip(b"\0"):  # no record is empty: the zeros
            return records, pos, pos
        payload = data[pos + _FRAME.size:pos + _FRAME.size + length]
        if len(payload) < length or zlib.crc32(payload) != crc:
            break
        try:
            records.append(json.loads(payload))
        except ValueError:
            break
        pos += _FRAME.size + length
    return records, pos, len(data)


#: the mode of every file the master writes: the store's keys, sizes and replica places
#: are for the master's own user, whatever umask or an older release left behind
FILE_MODE = 0o600
#: the mode of a data dir the master creates
DIR_MODE = 0o700


def _open_private(path: Path, flags: int) -> int:
    """os.open(path) creating it FILE_MODE, and an existing file (an older release's, a
    leftover .tmp) brought to FILE_MODE too: O_CREAT's mode applies only to new files.
    Never through a symlink."""
    fd = os.open(path, flags | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, FILE_MODE)
    try:
        if os.fstat(fd).st_mode & 0o7777 != FILE_MODE:
            os.fchmod(fd, FILE_MODE)
    except OSError:
        os.close(fd)
        raise
    return fd


class JournalFailed(HixlError):
    """The journal could not write or fsync its records. It stays failed: what it holds
    after the failure is unknown (a torn record, data the kernel dropped), so no later
    record can be reported durable; the master must be restarted, and its load() keeps
    the whole records before the damage."""


class Journal:
    """Append-only, CRC-framed journal file with group commit.

    `append` runs under the store's lock (so records are in mutation order): it only
    encodes the record and queues the frame, returning the position after it, so the
    lock is never held across a system call. `sync(position)` runs after the lock is
    released: the first caller writes every queued frame in one write and fsyncs; those
    that arrive meanwhile wait for it and then find themselves covered, or write and
    fsync the next group. One write and one fsync serve everyone queued before them.

    The file is kept PREALLOCATE bytes ahead of the records, zero-filled and made
    durable once per chunk, and groups are written in place (pwrite + fdatasync): a
    write that neither allocates blocks nor grows the file changes no metadata, so its
    fdatasync flushes the data alone, without a filesystem journal commit (on ext4 here
    ~145 µs wall and ~45 µs of kernel CPU per group, against ~210 and ~75 for an
    append + fsync). `read_journal` stops at the zeros; a clean close cuts them off.

    A failed write or fsync fails the journal for good (`JournalFailed`, now and at every
    later sync): after a failed fsync the kernel may have dropped the pages, so a retry
    that succeeded would claim records durable that are not.
    """

    #: bytes of zeros kept ahead of the records (one extension per ~13k put records)
    PREALLOCATE = 4 << 20

    def __init__(self, path: Path, *, fsync: bool = True) -> None:
        self.path = path
        self._fsync = fsync
        self._fd = _open_private(path, os.O_WRONLY)
        # the file must end with its last whole record (DataDir.load cuts a tail off)
        self.written = os.fstat(self._fd).st_size  # the end of everything appended
        self._durable = self.written
        self._allocated = self.written  # the file's size: records, then zeros
        self.records = 0
        self._queued: list[bytes] = []  # frames appended, not yet written
        self._queue_lock = threading.Lock()
        self._sync_lock = threading.Lock()
        self._failure: JournalFailed | None = None

    def append(self, record: dict[str, Any]) -> int:
        frame = _encode(record)
        with self._queue_lock:
            self._queued.append(frame)
            self.written += len(frame)
            self.records += 1
            return self.written

    def sync(self, position: int | None = None) -> None:
        """Return once everything up to `position` (default: all appended) is durable;
        JournalFailed if it cannot be."""
        target = self.written if position is None else position
        if self._durable >= target:
            return
        with self._sync_lock:
            if self._durable >= target:  # the group we waited for covered us
                return
            self._sync_locked()

    def _sync_locked(self) -> None:
        if self._failure is not None:
            raise self._failure
        with self._queue_lock:
            frames, self._queued = self._queued, []
            upto = self.written
        try:
            if self._fd < 0:
                raise OSError(errno.EBADF, "the journal is closed")
            at = self._durable
            if upto > self._allocated:
                self._preallocate(upto)
            _pwrite_all(self._fd, b"".join(frames), at)
            if self._fsync:
                os.fdatasync(self._fd)  # the zeros written with it, if any, included
        except OSError as exc:
            self._failure = JournalFailed(
                f"store journal {self.path}: cannot make records durable "
                f"({exc.strerror or exc}); the master must be restarted")
            log.error("%s", self._failure)
            raise self._failure from exc
        self._durable = max(self._durable, upto)

    def _preallocate(self, upto: int) -> None:
        """Grow the file with zeros to PREALLOCATE bytes past `upto`. Written, not
        fallocate'd: an unwritten extent costs a metadata change at its first write."""
        size = upto + self.PREALLOCATE
        _pwrite_all(self._fd, bytes(size - self._allocated), self._allocated)
        self._allocated = size

    def close(self) -> None:
        """Make everything durable, cut the zeros off and close (JournalFailed if that
        fails; the file is closed either way); later sync() calls return at once, or
        raise the failure."""
        with self._sync_lock:
            if self._fd < 0:
                return
            try:
                self._sync_locked()
                if self._allocated > self._durable:
                    os.ftruncate(self._fd, self._durable)
                    if self._fsync:
                        os.fsync(self._fd)
            finally:
                os.close(self._fd)
                self._fd = -1


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DataDir:
    """A master's data directory: LOCK, snapshot-<gen>.json, journal-<gen>.log.

    A snapshot of generation g holds everything before journal-g; journals of every
    generation >= the newest readable snapshot are replayed in order. Only one master
    may use a directory at a time (flock on LOCK).
    """

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self.path = Path(path)
        self.fsync = fsync
        try:
            self.path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
            self._lock_fd = _open_private(self.path / "LOCK", os.O_RDWR)
        except OSError as exc:
            raise ConfigError(f"store data dir {self.path}: cannot use it: "
                              f"{exc.strerror or exc}") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self._lock_fd)
            raise ConfigError(f"store data dir {self.path} is in use by another hixl-master "
                              "(give each master its own --data-dir)") from None

    def _generations(self, prefix: str, suffix: str) -> list[int]:
        found = []
        for entry in self.path.glob(f"{prefix}*{suffix}"):
            middle = entry.name[len(prefix):-len(suffix)]
            if middle.isdigit():
                found.append(int(middle))
        return sorted(found)

    def snapshot_path(self, gen: int) -> Path:
        return self.path / f"snapshot-{gen}.json"

    def journal_path(self, gen: int) -> Path:
        return self.path / f"journal-{gen}.log"

    def load(self) -> tuple[dict[str, Any] | None, list[dict[str, Any]], int]:
        """(newest readable snapshot or None, journal records after it, the last generation).

        A torn tail is cut off (with a warning) so appends continue after whole records.
        """
        snapshot: dict[str, Any] | None = None
        base = 0
        for gen in reversed(self._generations("snapshot-", ".json")):
            try:
                snapshot = json.loads(self.snapshot_path(gen).read_bytes())
                base = gen
                break
            except (OSError, ValueError) as exc:
                log.warning("store snapshot %s unreadable (%s); trying an older one",
                            self.snapshot_path(gen), exc)
        journals = [g for g in self._generations("journal-", ".log") if g >= base]
        records: list[dict[str, Any]] = []
        for gen in journals:
            path = self.journal_path(gen)
            got, good, size = read_journal(path)
            records.extend(got)
            if good < size:
                log.warning("store journal %s: ignoring a torn or corrupt tail of %d bytes "
                            "after %d whole records", path, size - good, len(got))
            if good < path.stat().st_size:  # a torn tail, or the zeros of a crashed master
                with open(path, "r+b") as f:
                    f.truncate(good)
        last = max([base, *journals])
        return snapshot, records, last

    def write_snapshot(self, gen: int, state: dict[str, Any]) -> None:
        """Write snapshot-<gen> atomically, then delete what it supersedes."""
        final = self.snapshot_path(gen)
        tmp = final.with_suffix(".json.tmp")
        with os.fdopen(_open_private(tmp, os.O_WRONLY | os.O_TRUNC), "wb") as f:
            f.write(json.dumps(state, separators=(",", ":"), ensure_ascii=False).encode())
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        os.replace(tmp, final)
        if self.fsync:
            _fsync_dir(self.path)
        for old in self._generations("snapshot-", ".json"):
            if old < gen:
                self.snapshot_path(old).unlink(missing_ok=True)
        for old in self._generations("journal-", ".log"):
            if old < gen:
                self.journal_path(old).unlink(missing_ok=True)

    def close(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1




# ---------------------------------------------------------------------------- local backend


class _JournalMark(NamedTuple):
    journal: Journal
    position: int


class _JournalCut(NamedTuple):
    gen: int
    old: Journal


class LocalJournalBackend(MetadataBackend):
    """A data dir (`DataDir`): snapshot-<gen>.json plus journal-<gen>.log, fsync'd with
    group commit. ConfigError naming the directory when it cannot be used or another
    master holds it."""

    def __init__(self, path: str | os.PathLike[str], *, fsync: bool = True) -> None:
        self._dir = DataDir(path, fsync=fsync)
        self._fsync = fsync
        self._journal: Journal | None = None
        self._gen = 0
        self._loaded = False

    @property
    def path(self) -> Path:
        return self._dir.path

    def describe(self) -> str:
        return f"local journal in {self._dir.path}"

    def load(self) -> LoadedState:
        if self._loaded:
            raise RuntimeError(f"{self.describe()}: load() may be called only once")
        self._loaded = True
        snapshot, records, self._gen = self._dir.load()
        self._journal = Journal(self._dir.journal_path(self._gen), fsync=self._fsync)
        return LoadedState(snapshot, records)

    def _open_journal(self) -> Journal:
        journal = self._journal
        if journal is None:
            raise RuntimeError(f"{self.describe()}: " + (
                "closed" if self._loaded else "load() it before appending"))
        return journal

    def append(self, record: Record) -> _JournalMark:
        journal = self._open_journal()
        return _JournalMark(journal, journal.append(record))

    def mark(self) -> _JournalMark:
        journal = self._open_journal()
        return _JournalMark(journal, journal.written)

    def wait_durable(self, mark: object | None = None) -> None:
        if mark is None:
            journal = self._journal
            if journal is not None:
                journal.sync()
            return
        if not isinstance(mark, _JournalMark):
            raise TypeError(f"{self.describe()}: {mark!r} is not one of its marks")
        mark.journal.sync(mark.position)

    @property
    def records_since_snapshot(self) -> int:
        journal = self._journal
        return journal.records if journal is not None else 0

    def begin_snapshot(self) -> _JournalCut:
        """Start the next generation's journal: later records go there."""
        old = self._open_journal()
        self._gen += 1
        self._journal = Journal(self._dir.journal_path(self._gen), fsync=self._fsync)
        return _JournalCut(self._gen, old)

    def write_snapshot(self, cut: object, state: State) -> None:
        """Close the cut's journal (durable), then write snapshot-<gen> and delete the
        files before it."""
        if not isinstance(cut, _JournalCut):
            raise TypeError(f"{self.describe()}: {cut!r} is not one of its cuts")
        cut.old.close()
        self._dir.write_snapshot(cut.gen, {**state, "gen": cut.gen})

    def close(self) -> None:
        """Close the journal (JournalFailed if what it holds cannot be made durable);
        the data dir is released either way, so a restarted master can take it."""
        journal, self._journal = self._journal, None
        try:
            if journal is not None:
                journal.close()
        finally:
            self._dir.close()


__all__ = [
    "DataDir", "Journal", "JournalFailed", "LoadedState", "LocalJournalBackend", "MetadataBackend", "Record",
    "State", "read_journal",
]
