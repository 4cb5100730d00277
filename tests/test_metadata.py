"""The store's metadata backends (server/master/metadata.py): the MetadataBackend contract, then
what only the local journal does.

**The contract tests are reusable.** `TestBackendContract` runs against every entry of
`PLACES` through the `place` fixture: a `Place` opens backends on one storage location
(for the local journal a data dir; for etcd, a fresh key prefix on a real 3-member
cluster, tests/etcd_cluster.py) and names that location. Another backend joins by adding
its Place to `PLACES`; no test changes. Without etcd or aetcd the etcd places skip (under
CI=true they fail). The tests never read a
backend's storage directly: they compare what `load()` yields, replayed by `fold` (the
reference replay of the module docstring's record kinds), with the records appended — so
a backend that loads snapshot-shaped state and no records (etcd) passes the same tests
as one that returns its journal. `test_a_store_on_the_backend_...` checks `fold` against
what a real ObjectStore holds, so the reference replay cannot drift from the store's.

Local-only tests (files, torn tails, exact records) follow the contract class.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from etcd_cluster import EtcdCluster, start_cluster_or_skip

from hixl.errors import ConfigError
from hixl.server.master.etcd_metadata import EtcdMetadataBackend
from hixl.server.master.master import StoreConfig, open_backend
from hixl.server.master.metadata import (
    Journal,
    JournalFailed,
    LoadedState,
    LocalJournalBackend,
    MetadataBackend,
    Record,
    State,
    read_journal,
)
from hixl.server.master.store import ObjectStore, StoreOptions
from hixl.store_codes import ErrorCode
from hixl.store_types import KeyState, ReplicaConfig, StoreSegment

MiB = 1 << 20
JOIN_S = 60.0           # "does not hang" deadline for threads


# ---------------------------------------------------------------- records, as the store writes them


def mount(engine: str, segment_id: int = 1, *, epoch: int = 1, base: int = 0x7F00_0000_0000,
          length: int = MiB, client: str = "c1") -> Record:
    return {"t": "mount", "c": client, "e": engine, "i": segment_id, "p": epoch, "b": base,
            "l": length, "n": "node-a", "m": f"{engine}#{segment_id}", "x": ["", "", "", ""]}


def unmount(engine: str, segment_id: int = 1) -> Record:
    return {"t": "unmount", "e": engine, "i": segment_id}


def replica(replica_id: int, engine: str, offset: int, *, segment_id: int = 1, epoch: int = 1,
            length: int = 64) -> list[Any]:
    return [replica_id, engine, segment_id, epoch, offset, length]


def put(*objects: list[Any]) -> Record:
    return {"t": "put", "o": list(objects)}


def obj(key: str, size: int, *replicas: list[Any], hard_pin: bool = False) -> list[Any]:
    return [key, size, hard_pin, list(replicas)]


def rm(*keys: str) -> Record:
    return {"t": "rm", "k": list(keys)}


# ---------------------------------------------------------------- the reference replay


@dataclass
class Folded:
    """Committed state: segments by (engine, id), objects by key (replicas sorted), and
    the next replica id replay would hand out."""

    segments: dict[tuple[str, int], dict[str, Any]]
    objects: dict[str, tuple[int, bool, tuple[tuple[Any, ...], ...]]]
    next_replica_id: int

    def state(self) -> State:
        """The snapshot the store would write of this state."""
        return {"version": 1, "next_replica_id": self.next_replica_id,
                "segments": list(self.segments.values()),
                "objects": [[key, size, pin, [list(r) for r in replicas]]
                            for key, (size, pin, replicas) in self.objects.items()]}


_MEMORY = ("p", "b", "l")


def fold(loaded: LoadedState) -> Folded:
    """Replay a loaded state the way the store does (module docstring of metadata.py)."""
    segments: dict[tuple[str, int], dict[str, Any]] = {}
    objects: dict[str, tuple[int, bool, tuple[tuple[Any, ...], ...]]] = {}
    top = 0

    def drop_segment(ident: tuple[str, int]) -> None:
        del segments[ident]
        for key, (size, pin, replicas) in list(objects.items()):
            left = tuple(r for r in replicas if (r[1], r[2]) != ident)
            if not left:
                del objects[key]
            else:
                objects[key] = (size, pin, left)

    def install(record: list[Any]) -> None:
        nonlocal top
        key, size, pin, replicas = record
        objects.pop(key, None)
        kept = []
        for r in replicas:
            top = max(top, r[0])
            held = segments.get((r[1], r[2]))
            if held is not None and held["p"] == r[3]:
                kept.append(tuple(r))
        if kept:
            objects[key] = (size, pin, tuple(sorted(kept)))

    def mount_segment(record: dict[str, Any]) -> None:
        record = {k: v for k, v in record.items() if k != "t"}
        ident = (record["e"], record["i"])
        held = segments.get(ident)
        if held is not None and any(held[k] != record[k] for k in _MEMORY):
            drop_segment(ident)
        segments[ident] = record

    snapshot = loaded.snapshot or {}
    for record in snapshot.get("segments", ()):
        mount_segment(record)
    for record in snapshot.get("objects", ()):
        install(record)
    top = max(top, snapshot.get("next_replica_id", 1) - 1)
    for record in loaded.records:
        kind = record["t"]
        if kind == "mount":
            mount_segment(record)
        elif kind == "unmount":
            if (record["e"], record["i"]) in segments:
                drop_segment((record["e"], record["i"]))
        elif kind == "put":
            for one in record["o"]:
                install(one)
        elif kind == "rm":
            for key in record["k"]:
                objects.pop(key, None)
        else:
            raise AssertionError(f"unknown record kind {kind!r}")
    for record in segments.values():
        record["x"] = list(record["x"])
    return Folded(segments, objects, top + 1)


def committed(records: list[Record]) -> Folded:
    return fold(LoadedState(None, records))


def replica_ids(records: list[Record]) -> set[int]:
    return {r[0] for rec in records if rec["t"] == "put" for o in rec["o"] for r in o[3]}


def same_content(got: Folded, expected: Folded) -> None:
    assert got.segments == expected.segments
    assert got.objects == expected.objects


# A history with every kind and every cascade, including the traps for a key-value
# backend: a same-memory remount keeps objects; unmount + remount of the same memory, a
# new epoch, and the same epoch with other memory all drop them.
HISTORY: list[Record] = [
    mount("a"), mount("b"), mount("c", epoch=3),
    put(obj("on-a", 10, replica(1, "a", 0)),
        obj("on-a-b", 20, replica(2, "a", 64), replica(3, "b", 0)),
        obj("on-b", 30, replica(4, "b", 64), hard_pin=True)),
    put(obj("on-c", 40, replica(5, "c", 0, epoch=3))),
    put(obj("gone", 5, replica(6, "a", 128))),
    rm("gone"),
    put(obj("on-a", 11, replica(7, "a", 192))),              # upsert
    unmount("b"),                                            # on-b gone, on-a-b keeps a
    mount("a", client="c9"),                                 # same memory: objects stay
    mount("c", epoch=3, base=0x1000),                        # same epoch, other memory
    put(obj("back-on-b", 50, replica(8, "b", 0))),           # b is unknown: skipped
    mount("b"), put(obj("on-b-again", 60, replica(9, "b", 0))),
    unmount("b"), mount("b"),                                # remounted: dropped anyway
    mount("d"), put(obj("on-d", 70, replica(10, "d", 0))),
    mount("d", epoch=2),                                     # a new epoch drops on-d
    put(obj("ünïcode/key with spaces", 80, replica(11, "a", 256))),
]


def test_the_history_exercises_what_it_claims() -> None:
    folded = committed(HISTORY)
    assert set(folded.objects) == {"on-a", "on-a-b", "ünïcode/key with spaces"}
    assert folded.objects["on-a"] == (11, False, ((7, "a", 1, 1, 192, 64),))
    assert folded.objects["on-a-b"][2] == ((2, "a", 1, 1, 64, 64),)
    assert folded.segments[("a", 1)]["c"] == "c9"
    assert folded.segments[("c", 1)]["b"] == 0x1000
    assert folded.next_replica_id == 12


# ---------------------------------------------------------------- places


class Place:
    """One storage location backends open on; `location` names it in messages."""

    location: str

    def open(self) -> MetadataBackend:
        raise NotImplementedError


class LocalPlace(Place):
    def __init__(self, path: Path) -> None:
        self.path = path
        self.location = str(path)

    def open(self) -> MetadataBackend:
        return LocalJournalBackend(self.path)


class EtcdPlace(Place):
    """A fresh key prefix on the shared test cluster (`etcd_cluster()`)."""

    def __init__(self, cluster: EtcdCluster) -> None:
        self.endpoints = cluster.endpoints
        self.location = f"/hixl/contract-{uuid.uuid4().hex[:8]}/"

    def open(self) -> MetadataBackend:
        return EtcdMetadataBackend({"endpoints": self.endpoints, "prefix": self.location})


_ETCD: list[EtcdCluster] = []


def etcd_cluster() -> EtcdCluster:
    """One 3-member cluster for this module's etcd places, started on first use (skips
    without etcd, except under CI) and stopped after the module (`_stop_etcd`)."""
    if not _ETCD:
        _ETCD.append(start_cluster_or_skip(3))
    return _ETCD[0]


@pytest.fixture(scope="module", autouse=True)
def _stop_etcd() -> Iterator[None]:
    yield
    while _ETCD:
        _ETCD.pop().close()


#: every backend the contract runs against: name -> Place on a fresh location
PLACES: dict[str, Callable[[Path], Place]] = {
    "local": lambda tmp_path: LocalPlace(tmp_path / "data"),
    "etcd": lambda tmp_path: EtcdPlace(etcd_cluster()),
}


class Opened:
    """Opens backends on a place and closes whatever a test left open."""

    def __init__(self, place: Place) -> None:
        self.place = place
        self.backends: list[MetadataBackend] = []

    def __call__(self) -> MetadataBackend:
        backend = self.place.open()
        self.backends.append(backend)
        return backend

    def reopen(self, backend: MetadataBackend) -> tuple[MetadataBackend, LoadedState]:
        """Close `backend` as a crash would (no snapshot), open it again and load."""
        backend.close()
        again = self()
        return again, again.load()


#: a place's test kind (tests/conftest.py), declared here: PLACES holds both kinds (a
#: place not listed gets the kind the conftest finds)
PLACE_KINDS = {"local": pytest.mark.unit, "etcd": pytest.mark.etcd}


@pytest.fixture(params=[pytest.param(name, marks=PLACE_KINDS.get(name, ()))
                        for name in sorted(PLACES)])
def opened(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Opened]:
    opener = Opened(PLACES[request.param](tmp_path))
    yield opener
    for backend in opener.backends:
        backend.close()


def append_all(backend: MetadataBackend, records: list[Record]) -> list[object]:
    return [backend.append(record) for record in records]


# ---------------------------------------------------------------- the contract


class TestBackendContract:
    def test_a_new_place_loads_nothing(self, opened: Opened) -> None:
        backend = opened()
        assert backend.persistent
        assert opened.place.location in backend.describe()
        loaded = backend.load()
        same_content(fold(loaded), committed([]))

    def test_appended_records_become_durable(self, opened: Opened) -> None:
        backend = opened()
        backend.load()
        marks = append_all(backend, HISTORY[:4])
        for mark in marks:
            backend.wait_durable(mark)
        backend.wait_durable(backend.mark())
        backend.wait_durable()
        marks.append(backend.append(HISTORY[4]))
        backend.wait_durable()                  # everything, this one included
        backend.wait_durable(marks[-1])
        backend, loaded = opened.reopen(backend)
        same_content(fold(loaded), committed(HISTORY[:5]))

    def test_many_waiters_share_commits_and_lose_nothing(self, opened: Opened) -> None:
        """Writers append under one lock (as the store does) and wait without it."""
        backend = opened()
        backend.load()
        lock = threading.Lock()
        appended: list[Record] = []
        errors: list[BaseException] = []
        with lock:
            appended.append(mount("a", length=64 * MiB))
            backend.append(appended[-1])

        def writer(n: int) -> None:
            try:
                for i in range(25):
                    key = f"w{n}-{i}"
                    rid = n * 1000 + i + 1
                    record = put(obj(key, i + 1, replica(rid, "a", rid * 64)))
                    with lock:
                        appended.append(record)
                        mark = backend.append(record)
                    backend.wait_durable(mark)
                    if i % 4 == 0:
                        with lock:
                            appended.append(rm(key))
                            mark = backend.append(appended[-1])
                        backend.wait_durable(mark)
            except BaseException as exc:  # noqa: BLE001 - reported by the test thread
                errors.append(exc)

        threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=JOIN_S)
        assert not any(t.is_alive() for t in threads) and not errors, errors
        backend, loaded = opened.reopen(backend)
        folded = fold(loaded)
        same_content(folded, committed(appended))
        assert len(folded.objects) == 8 * 25 - 8 * 7

    def test_a_crash_keeps_every_committed_change_and_its_cascades(
            self, opened: Opened) -> None:
        backend = opened()
        backend.load()
        for record in HISTORY:
            backend.wait_durable(backend.append(record))
        backend, loaded = opened.reopen(backend)
        folded = fold(loaded)
        same_content(folded, committed(HISTORY))
        assert folded.next_replica_id > max(replica_ids(HISTORY))  # ids never repeat
        # and appends go on after a load: the next start sees both
        more = [put(obj("later", 1, replica(12, "a", 320)))]
        backend.wait_durable(backend.append(more[0]))
        backend, loaded = opened.reopen(backend)
        same_content(fold(loaded), committed(HISTORY + more))

    def test_a_snapshot_supersedes_what_came_before_its_cut(self, opened: Opened) -> None:
        backend = opened()
        backend.load()
        before, between, after = HISTORY[:8], HISTORY[8:12], HISTORY[12:]
        append_all(backend, before)
        cut = backend.begin_snapshot()
        if cut is not None:
            assert backend.records_since_snapshot == 0
        append_all(backend, between)            # after the cut: not in the snapshot
        if cut is not None:
            backend.write_snapshot(cut, committed(before).state())
            assert backend.records_since_snapshot == len(between)
        append_all(backend, after)
        backend.wait_durable()
        backend, loaded = opened.reopen(backend)
        folded = fold(loaded)
        same_content(folded, committed(HISTORY))
        assert folded.next_replica_id > max(replica_ids(HISTORY))

    def test_a_second_backend_on_the_same_place_is_refused(self, opened: Opened) -> None:
        first = opened()
        first.load()
        with pytest.raises(ConfigError, match=re.escape(opened.place.location)):
            opened()
        first.close()
        second = opened()                       # free again once the first is closed
        same_content(fold(second.load()), committed([]))

    def test_after_close_waits_return_and_appends_fail(self, opened: Opened) -> None:
        backend = opened()
        backend.load()
        mark = backend.append(HISTORY[0])
        backend.close()
        backend.wait_durable(mark)              # closing made it durable: returns at once
        backend.wait_durable()
        backend.close()                         # idempotent
        with pytest.raises(RuntimeError, match="closed"):
            backend.append(HISTORY[1])
        _, loaded = opened.reopen(opened())
        same_content(fold(loaded), committed(HISTORY[:1]))

    def test_a_store_on_the_backend_restores_what_it_committed(self, opened: Opened) -> None:
        """A real ObjectStore writes through the backend; `fold` of what loads equals what
        the store held, and a new store on the place serves it again."""
        options = StoreOptions(client_ttl_s=1e9)
        store = ObjectStore(options, backend=opened())
        assert store.persistent and opened.place.location in store.describe_persistence()
        segments = [StoreSegment("a", 1, 1, 0x1000_0000, MiB),
                    StoreSegment("b", 1, 1, 0x2000_0000, MiB),
                    StoreSegment("c", 2, 5, 0x3000_0000, MiB)]
        for segment in segments:
            assert store.mount_segment("owner", segment).code == ErrorCode.OK
        for i in range(30):
            [started] = store.put_start("w", [(f"k{i}", 100 + i)], ReplicaConfig(replica_num=2))
            assert store.put_end("w", [(f"k{i}", started.put_id)]) == [ErrorCode.OK]
        assert store.remove([f"k{i}" for i in range(0, 30, 3)], force=True) == [ErrorCode.OK] * 10
        assert store.unmount_segment("owner", "b", 1).code == ErrorCode.OK
        assert store.mount_segment("owner", StoreSegment("c", 2, 6, 0x3000_0000, MiB)).code == 0
        listing = store.list_keys()
        held = {info.key: (info.size, info.hard_pin, tuple(sorted(
            (r.replica.replica_id, r.replica.engine, r.replica.segment_id, r.replica.epoch)
            for r in info.replicas))) for info in listing.keys
            if info.state != KeyState.PUTTING}
        mounted = {(m.segment.engine, m.segment.segment_id): m.segment.epoch
                   for m in store.list_segments()}
        assert held and mounted == {("a", 1): 1, ("c", 2): 6}
        store.close(snapshot=False)

        reader = opened()
        folded = fold(reader.load())
        reader.close()
        assert {ident: s["p"] for ident, s in folded.segments.items()} == mounted
        assert {key: (size, pin, tuple(r[:4] for r in replicas))
                for key, (size, pin, replicas) in folded.objects.items()} == held

        store = ObjectStore(options, backend=opened())
        for segment in (segments[0], StoreSegment("c", 2, 6, 0x3000_0000, MiB)):
            assert store.mount_segment("owner", segment).code == ErrorCode.OK
        assert store.get_sizes(sorted(held)) == [held[key][0] for key in sorted(held)]
        store.close()


# ---------------------------------------------------------------- the local journal


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"


def journals(path: Path) -> list[Path]:
    return sorted(path.glob("journal-*.log"))


def then_appends_follow(backend: LocalJournalBackend, place: Path, kept: int) -> None:
    """After a load that kept HISTORY[:kept]: the next record lands after them, and a
    restart on `place` loads them all."""
    backend.wait_durable(backend.append(HISTORY[kept]))
    backend.close()
    backend = LocalJournalBackend(place)
    assert backend.load() == LoadedState(None, HISTORY[:kept + 1])
    backend.close()


def test_load_returns_exactly_the_records_after_a_crash(data_dir: Path) -> None:
    backend = LocalJournalBackend(data_dir)
    assert backend.load() == LoadedState(None, [])
    append_all(backend, HISTORY)
    backend.close()
    backend = LocalJournalBackend(data_dir)
    assert backend.load() == LoadedState(None, HISTORY)
    backend.close()


def test_a_torn_tail_is_ignored_with_a_warning_and_appends_continue(
        data_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    backend = LocalJournalBackend(data_dir)
    backend.load()
    append_all(backend, HISTORY[:6])
    backend.close()
    [journal] = journals(data_dir)
    whole = journal.stat().st_size
    with open(journal, "ab") as f:                   # a record cut short by the crash
        f.write(b"\x40\x00\x00\x00\x12\x34\x56\x78{\"t\":\"put\",\"o\":[[\"k9\"")
    backend = LocalJournalBackend(data_dir)
    with caplog.at_level(logging.WARNING, logger="hixl.store"):
        loaded = backend.load()
    assert loaded == LoadedState(None, HISTORY[:6])
    assert f"store journal {journal}: ignoring a torn or corrupt tail" in caplog.text
    assert "after 6 whole records" in caplog.text
    assert journal.stat().st_size == whole           # cut off, so appends follow whole records
    then_appends_follow(backend, data_dir, 6)


def test_appends_reach_the_file_at_sync_in_order_one_write_per_group(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """append runs under the store's lock, so it makes no system call: the frames wait
    in memory until a sync writes the whole group with one write (and one fdatasync),
    in place, into zeros the journal keeps ahead of its records; a clean close cuts the
    zeros off."""
    path = tmp_path / "j.log"
    journal = Journal(path)
    writes: list[tuple[int, int]] = []   # (offset, length) of each write of records
    real_pwrite = os.pwrite

    def counted_pwrite(fd: int, data: Any, offset: int) -> int:
        if fd == journal._fd and bytes(data).strip(b"\0"):
            writes.append((offset, len(data)))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", counted_pwrite)
    ends = [journal.append({"n": i}) for i in range(5)]
    assert path.stat().st_size == 0 and writes == []      # nothing written yet
    journal.sync(ends[1])                                 # covers the whole group queued
    assert writes == [(0, ends[4])]
    assert path.stat().st_size == ends[4] + Journal.PREALLOCATE
    assert read_journal(path) == ([{"n": i} for i in range(5)], ends[4], ends[4])
    journal.sync(ends[4])                                 # already durable: no write
    assert len(writes) == 1
    end = journal.append({"n": 5})
    journal.close()                                       # close writes what is queued
    assert writes[1:] == [(ends[4], end - ends[4])]
    assert path.stat().st_size == end
    assert read_journal(path) == ([{"n": i} for i in range(6)], end, end)


def test_a_crashed_journals_zeros_are_cut_without_a_warning(
        data_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A master killed with its journal open leaves the preallocated zeros behind: the
    next load reads the records before them, warns of nothing and appends after them."""
    backend = LocalJournalBackend(data_dir)
    backend.load()
    backend.wait_durable(append_all(backend, HISTORY[:4])[-1])
    [journal] = journals(data_dir)
    assert journal.stat().st_size > Journal.PREALLOCATE  # as a kill -9 leaves it
    copy = data_dir.parent / "copy"
    copy.mkdir()
    (copy / journal.name).write_bytes(journal.read_bytes())
    backend.close()
    backend = LocalJournalBackend(copy)
    with caplog.at_level(logging.WARNING, logger="hixl.store"):
        assert backend.load() == LoadedState(None, HISTORY[:4])
    assert caplog.text == ""
    then_appends_follow(backend, copy, 4)


def test_a_torn_group_in_the_zeros_is_cut_with_a_warning(
        data_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A crash while a group was written in place: a frame cut short, zeros after it."""
    backend = LocalJournalBackend(data_dir)
    backend.load()
    backend.wait_durable(append_all(backend, HISTORY[:3])[-1])
    [journal] = journals(data_dir)
    image = bytearray(journal.read_bytes())
    backend.close()
    end = journal.stat().st_size
    torn = b"\x40\x00\x00\x00\x12\x34\x56\x78{\"t\":\"put\",\"o\":[[\"k9\""
    image[end:end + len(torn)] = torn
    journal.write_bytes(bytes(image))
    backend = LocalJournalBackend(data_dir)
    with caplog.at_level(logging.WARNING, logger="hixl.store"):
        assert backend.load() == LoadedState(None, HISTORY[:3])
    assert "ignoring a torn or corrupt tail" in caplog.text
    then_appends_follow(backend, data_dir, 3)


def test_a_failed_write_fails_the_journal_for_good(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """After a failed write or fsync nothing more may be reported durable (the kernel may
    have dropped what it held): every later sync raises JournalFailed naming the file,
    and a restart loads the records made durable before the failure."""
    path = tmp_path / "j.log"
    journal = Journal(path)
    durable = journal.append({"n": 0})
    journal.sync(durable)
    lost = journal.append({"n": 1})
    readonly = os.open(path, os.O_RDONLY)                 # a real EBADF on the next write
    os.dup2(readonly, journal._fd)
    os.close(readonly)
    with caplog.at_level(logging.ERROR, logger="hixl.store"), \
            pytest.raises(JournalFailed, match=re.escape(f"store journal {path}: cannot "
                                                         "make records durable")):
        journal.sync(lost)
    assert "the master must be restarted" in caplog.text
    journal.sync(durable)                                 # what was durable stays so
    later = journal.append({"n": 2})
    for position in (lost, later):                        # latched, not retried
        with pytest.raises(JournalFailed):
            journal.sync(position)
    with pytest.raises(JournalFailed):
        journal.close()
    assert journal._fd == -1                              # closed all the same
    assert read_journal(path)[0] == [{"n": 0}]


def test_a_failed_journal_fails_the_store_call_that_waits_on_it(data_dir: Path) -> None:
    """The backend's wait raises JournalFailed to the store call, which the call
    endpoint answers as an internal error naming the journal."""
    backend = LocalJournalBackend(data_dir)
    backend.load()
    backend.wait_durable(backend.append(HISTORY[0]))
    mark = backend.append(HISTORY[1])
    [journal] = journals(data_dir)
    readonly = os.open(journal, os.O_RDONLY)
    os.dup2(readonly, mark.journal._fd)
    os.close(readonly)
    with pytest.raises(JournalFailed, match="the master must be restarted"):
        backend.wait_durable(mark)
    with pytest.raises(JournalFailed):
        backend.wait_durable()
    with pytest.raises(JournalFailed):
        backend.close()
    backend = LocalJournalBackend(data_dir)
    assert backend.load() == LoadedState(None, HISTORY[:1])
    backend.close()


def test_a_snapshot_replaces_the_files_before_it(data_dir: Path) -> None:
    backend = LocalJournalBackend(data_dir)
    backend.load()
    append_all(backend, HISTORY[:8])
    assert backend.records_since_snapshot == 8
    cut = backend.begin_snapshot()
    append_all(backend, HISTORY[8:10])
    state = committed(HISTORY[:8]).state()
    backend.write_snapshot(cut, state)
    assert sorted(p.name for p in data_dir.iterdir()) == [
        "LOCK", "journal-1.log", "snapshot-1.json"]
    assert json.loads((data_dir / "snapshot-1.json").read_bytes()) == {**state, "gen": 1}
    backend.wait_durable()                       # appends reach the file when waited for
    assert read_journal(data_dir / "journal-1.log")[0] == HISTORY[8:10]
    backend.close()
    backend = LocalJournalBackend(data_dir)
    assert backend.load() == LoadedState({**state, "gen": 1}, HISTORY[8:10])
    backend.close()


def modes(path: Path) -> dict[str, int]:
    """Permission bits of a directory and of each file in it."""
    return {".": path.stat().st_mode & 0o777,
            **{p.name: p.stat().st_mode & 0o777 for p in path.iterdir()}}


def test_every_file_of_a_data_dir_is_owner_only(data_dir: Path) -> None:
    """The journal was 0600 but snapshots followed the umask (0644): every file is 0600,
    including files an older release or a crash left wider, and a new dir is 0700."""
    old_umask = os.umask(0o022)
    try:
        backend = LocalJournalBackend(data_dir)
        backend.load()
        append_all(backend, HISTORY[:4])
        backend.close()
        for name in ("journal-0.log", "LOCK"):           # as an older release left them
            os.chmod(data_dir / name, 0o644)
        (data_dir / "snapshot-1.json.tmp").write_bytes(b"torn")   # a crash mid-snapshot
        os.chmod(data_dir / "snapshot-1.json.tmp", 0o666)
        backend = LocalJournalBackend(data_dir)
        assert backend.load() == LoadedState(None, HISTORY[:4])
        cut = backend.begin_snapshot()
        append_all(backend, HISTORY[4:6])
        backend.write_snapshot(cut, committed(HISTORY[:4]).state())
        assert modes(data_dir) == {".": 0o700, "LOCK": 0o600, "journal-1.log": 0o600,
                                   "snapshot-1.json": 0o600}
        backend.close()
    finally:
        os.umask(old_umask)
    backend = LocalJournalBackend(data_dir)
    assert backend.load().records == HISTORY[4:6]
    backend.close()


def test_an_unusable_or_held_data_dir_is_refused_naming_it(data_dir: Path,
                                                           tmp_path: Path) -> None:
    first = LocalJournalBackend(data_dir)
    with pytest.raises(ConfigError, match=f"{re.escape(str(data_dir))} is in use by another"):
        LocalJournalBackend(data_dir)
    first.close()
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match=f"{re.escape(str(blocker / 'sub'))}: cannot use it"):
        LocalJournalBackend(blocker / "sub")


def test_the_local_backend_must_be_loaded_once_before_appends(data_dir: Path) -> None:
    backend = LocalJournalBackend(data_dir)
    with pytest.raises(RuntimeError, match="load"):
        backend.append(HISTORY[0])
    backend.load()
    with pytest.raises(RuntimeError, match="once"):
        backend.load()
    with pytest.raises(TypeError, match="not one of its marks"):
        backend.wait_durable(("journal", 3))
    backend.close()


# ---------------------------------------------------------------- the store and the master


def test_a_store_takes_a_data_dir_or_a_backend_not_both(data_dir: Path) -> None:
    backend = LocalJournalBackend(data_dir)
    with pytest.raises(TypeError, match="not both"):
        ObjectStore(data_dir=data_dir, backend=backend)
    with pytest.raises(TypeError, match="must be a MetadataBackend, got str"):
        ObjectStore(backend=str(data_dir))  # type: ignore[arg-type]
    backend.close()
    memory = ObjectStore()
    assert not memory.persistent and memory.describe_persistence() == "in memory only"
    store = ObjectStore(data_dir=data_dir)
    assert store.persistent and store.describe_persistence() == f"local journal in {data_dir}"
    store.close()
    assert not store.persistent              # closed: it goes on in memory only


def test_a_store_whose_replay_fails_releases_its_backend(data_dir: Path) -> None:
    backend = LocalJournalBackend(data_dir)
    backend.load()
    backend.append({"t": "unmount"})         # no segment named: replay cannot apply it
    backend.close()
    with pytest.raises(KeyError):
        ObjectStore(backend=LocalJournalBackend(data_dir))
    LocalJournalBackend(data_dir).close()    # the dir is not left locked


def test_the_master_builds_its_backend_from_its_settings(tmp_path: Path) -> None:
    backend = open_backend(StoreConfig(data_dir=str(tmp_path / "m")), 6000)
    assert isinstance(backend, LocalJournalBackend) and backend.path == tmp_path / "m"
    backend.close()
    assert open_backend(StoreConfig(data_dir=str(tmp_path / "m"), persist=False), 6000) is None
    assert open_backend(StoreConfig(), 0) is None          # --port 0, no --data-dir
