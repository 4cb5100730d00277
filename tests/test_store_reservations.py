"""Puts in one master round trip (docs/store.md §2), against real hixl-master processes.

Each failure case of the design has a test here: claims the master must refuse (no
reservation, another client's, forged or unaligned ranges, overlapping ones, an ended
lease), two clients racing on a key, a master killed with reservations outstanding, and
a client killed with -9 after reserving, after writing and after committing. Nothing
asserts how long anything took: waits are for conditions, under a deadline that only
guards against a hang.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import waiting

from hixl.client.mooncake import MooncakeDistributedStore
from hixl.client.store_client import MasterClient, _SharedCalls
from hixl.server.master.store import ObjectStore
from hixl.server.master.store_service import StoreCalls
from hixl.store_codes import ErrorCode
from hixl.store_types import MasterUnavailable, StoreSegment
from hixl.tools.daemons import HolderProcess, MasterProcess

MiB = 1 << 20
GIVE_UP_S = 30.0   # only a guard against a hang
OK = ErrorCode.OK

#: call() until done(result): that result (tests/waiting.py)
eventually = partial(waiting.wait_until, timeout=GIVE_UP_S, interval=0.05)


def seg(engine: str = "a", length: int = 64 * MiB) -> StoreSegment:
    return StoreSegment(engine, 1, 1, 0x10_0000, length, "node-a")


def pattern(seed: int, size: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


@pytest.fixture
def master(tmp_path: Path) -> Iterator[MasterProcess]:
    with MasterProcess(extra=["--data-dir", str(tmp_path / "data")]) as process:
        yield process


def client(master: MasterProcess, name: str) -> MasterClient:
    return MasterClient(master.target, timeout=GIVE_UP_S, client_id=name)


# ---------------------------------------------------------------- the master's checks


def test_commit_claims_are_checked_and_refusals_leave_nothing(master: MasterProcess) -> None:
    with client(master, "owner") as owner, client(master, "writer") as writer, \
            client(master, "other") as other:
        assert owner.mount_segment(seg()).code == OK
        got = writer.reserve()
        assert got.code == OK and got.lease_ttl_ms > 0
        [held] = got.reservations                       # one segment mounted
        rid, base, length = held.reservation_id, held.space.addr, held.space.length
        assert held.space.engine == "a" and length > 0
        refused = {
            "no-reservation": (rid + 1000, base, 128),
            "forged-before": (rid, base - 64, 128),
            "forged-after": (rid, base + length, 128),
            "unaligned": (rid, base + 8, 128),
            "too-short": (rid, base, 64),
        }
        codes = writer.batch_commit([(key, 100, [claim]) for key, claim in refused.items()])
        assert codes == [ErrorCode.OBJECT_NOT_FOUND] + [ErrorCode.INVALID_PARAMS] * 4
        assert other.batch_commit([("others", 100, [(rid, base, 128)])]) == [
            ErrorCode.INVALID_PARAMS]                    # not its reservation
        assert writer.batch_commit([("k", 100, [(rid, base, 128)])]) == [OK]
        assert writer.batch_commit([("overlap", 100, [(rid, base + 64, 128)]),
                                    ("again", 100, [(rid, base, 128)])]) == [
            ErrorCode.INVALID_PARAMS, ErrorCode.INVALID_PARAMS]
        assert writer.batch_exist_key([*refused, "others", "overlap", "again"]) == [
            ErrorCode.OBJECT_NOT_FOUND] * (len(refused) + 3)
        found = writer.get_replicas("k")
        assert (found.code, found.size, [r.addr for r in found.replicas]) == (OK, 100, [base])
        # no space leaked: once the reservation ends, k's block is all that is used
        assert writer.release([rid]) == [OK]
        assert writer.release([rid]) == [ErrorCode.OBJECT_NOT_FOUND]
        stats = writer.stats()
        assert (stats["used"], stats["reservations"], stats["keys"]) == (128, 0, 1)


def test_a_reservation_used_after_its_lease_is_refused(master: MasterProcess) -> None:
    with client(master, "owner") as owner, client(master, "writer") as writer:
        assert owner.mount_segment(seg()).code == OK
        [held] = writer.reserve().reservations
        eventually(writer.stats, "lease end", done=lambda s: s["reservations"] == 0)
        assert writer.batch_commit([("late", 10, [(held.reservation_id, held.space.addr,
                                                   64)])]) == [ErrorCode.LEASE_EXPIRED]
        assert writer.exist_key("late") == ErrorCode.OBJECT_NOT_FOUND
        assert writer.stats()["used"] == 0


@pytest.mark.parametrize("upsert", [False, True])
def test_two_clients_race_on_one_key(master: MasterProcess, upsert: bool) -> None:
    with client(master, "owner") as owner, client(master, "c1") as c1, \
            client(master, "c2") as c2:
        assert owner.mount_segment(seg()).code == OK
        claims = {}
        for writer in (c1, c2):
            [held] = writer.reserve().reservations
            claims[writer.client_id] = (held.reservation_id, held.space.addr, 4096)
        start = threading.Barrier(2)
        codes: dict[str, int] = {}

        def commit(writer: MasterClient) -> None:
            start.wait(GIVE_UP_S)
            [codes[writer.client_id]] = writer.batch_commit(
                [("same", 4000, [claims[writer.client_id]])], upsert=upsert)

        threads = [threading.Thread(target=commit, args=(w,)) for w in (c1, c2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(GIVE_UP_S)
        expected = [OK, OK] if upsert else [ErrorCode.OBJECT_ALREADY_EXISTS, OK]
        assert sorted(codes.values()) == sorted(expected)
        found = c1.get_replicas("same")
        winners = {claims[name][1] for name, code in codes.items() if code == OK}
        assert found.code == OK and found.replicas[0].addr in winners
        assert c1.release([claims["c1"][0]]) == [OK] and c2.release([claims["c2"][0]]) == [OK]
        assert c1.stats()["used"] == 4096                # one value's block, nothing else


def test_master_restart_with_reservations_outstanding(tmp_path: Path) -> None:
    data = ["--data-dir", str(tmp_path / "data")]
    first = MasterProcess(extra=data)
    owner, writer = client(first, "owner"), client(first, "writer")
    try:
        assert owner.mount_segment(seg()).code == OK
        [held] = writer.reserve().reservations
        rid, base = held.reservation_id, held.space.addr
        assert writer.batch_commit([("kept", 1000, [(rid, base, 1024)])]) == [OK]
        first.kill()                                      # SIGKILL, reservations outstanding
        second = MasterProcess(first.port, extra=data)
        try:
            mounted = eventually(lambda: owner.mount_segment(seg()), "remount",
                                 done=lambda r: r.code == OK)
            assert mounted.objects == 1
            # the restarted master knows no reservation: the claim is refused, not installed
            assert writer.batch_commit([("lost", 1000, [(rid, base + 1024, 1024)])]) == [
                ErrorCode.OBJECT_NOT_FOUND]
            assert writer.exist_key("lost") == ErrorCode.OBJECT_NOT_FOUND
            found = writer.get_replicas("kept")
            assert (found.code, found.size, found.replicas[0].addr) == (OK, 1000, base)
            again = writer.reserve()
            assert again.code == OK and again.reservations[0].reservation_id != rid
            assert writer.release([again.reservations[0].reservation_id]) == [OK]
            assert writer.stats()["used"] == 1024         # the old reservation left no trace
        finally:
            second.close()
    finally:
        owner.close()
        writer.close()
        first.close()


def test_a_store_that_may_have_had_a_predecessor_fences_allocation(tmp_path: Path) -> None:
    """Reservations are not journaled: the first ttl after a (re)start allocates nothing."""
    fresh = ObjectStore(data_dir=tmp_path / "d")
    assert StoreCalls(fresh).fence_left() == 0           # a first start: nothing to fear
    fresh.mount_segment("c", seg())
    fresh.close()
    reloaded = ObjectStore(data_dir=tmp_path / "d")
    assert StoreCalls(reloaded).fence_left() > 0
    assert StoreCalls(reloaded).blocks("PutStart") and StoreCalls(reloaded).blocks("Reserve")
    reloaded.close()
    assert StoreCalls(ObjectStore()).fence_left() > 0    # in memory: a restart is unknowable


# ---------------------------------------------------------------- through the Mooncake store


@pytest.fixture
def holder(master: MasterProcess) -> Iterator[HolderProcess]:
    holder = HolderProcess("hixl", master.target, "127.0.0.1", 64 * MiB)
    yield holder
    holder.stop()


def pure_client(master: MasterProcess) -> MooncakeDistributedStore:
    store = MooncakeDistributedStore(setup_timeout=GIVE_UP_S)
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 4 * MiB, "tcp", "",
                       master.target) == 0, store.last_error
    return store


def test_a_put_is_one_master_round_trip(master: MasterProcess, holder: HolderProcess) -> None:
    store = pure_client(master)
    try:
        master_client, space = store._master, store._space
        assert master_client is not None and space is not None
        assert store.put("warm", b"w" * 100) == 0         # its first reservation
        values = {f"v{i}": pattern(i, size) for i, size in enumerate(
            [1, 63, 64, 65, 4095, 64 << 10, 1 << 20])}
        for key, value in values.items():
            before = master_client.fast_calls
            assert store.put(key, value) == 0
            assert master_client.fast_calls - before == 1, key   # one Commit, nothing else
        before = master_client.fast_calls
        batch = {f"b{i}": pattern(100 + i, 10_000 + i) for i in range(8)}
        assert store.put_batch(list(batch), list(batch.values())) == 0
        assert master_client.fast_calls - before == 1
        for key, value in {**values, **batch}.items():
            assert store.get(key) == value, key
        assert store.put("v1", b"other") == 0             # exists: kept, as Mooncake
        assert store.get("v1") == values["v1"]
        assert store.upsert("v1", b"replaced") == 0
        assert store.get("v1") == b"replaced"
        assert store.remove("v1", force=True) == 0
        assert store.get("v1") == b"" and store.last_error_code == ErrorCode.OBJECT_NOT_FOUND
    finally:
        store.close()
    with client(master, "check") as check:                # close released the reservations
        assert eventually(check.stats, "release", done=lambda s: s["reservations"] == 0)


#: a client killed -9 after each step of a put; prints STEP once it is done with it
_CHILD = r"""
import sys, time
from hixl.client.mooncake import MooncakeDistributedStore, ReplicateConfig
from hixl.store_types import PutStartResult
master, key, step, size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
value = bytes((i * 7 + 3) % 251 for i in range(size))
store = MooncakeDistributedStore(setup_timeout=30)
assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 4 << 20, "tcp", "", master) == 0
if step == "committed":
    assert store.put(key, value) == 0
else:
    config = store._master_config(ReplicateConfig(), False)
    [placement] = store._space.place(config, [size])
    assert placement is not None
    if step == "written":
        item = store._bytes_item(0, key, value)
        assert not store._write([(item, PutStartResult(0, 0, placement.replicas))])
print(step, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("step", ["reserved", "written", "committed"])
def test_kill_9_of_the_client_at_every_step(master: MasterProcess, holder: HolderProcess,
                                            step: str) -> None:
    size = 50_000
    child = subprocess.Popen([sys.executable, "-c", _CHILD, master.target, "k", step,
                              str(size)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == step
    finally:
        child.kill()
        child.wait(GIVE_UP_S)
    store = pure_client(master)
    try:
        got = store.get("k")
        if step == "committed":                           # whole and readable
            assert got == bytes((i * 7 + 3) % 251 for i in range(size))
        else:                                             # absent
            assert got == b"" and store.last_error_code == ErrorCode.OBJECT_NOT_FOUND
    finally:
        store.close()
    with client(master, "check") as check:                # the dead client's space comes back
        stats = eventually(check.stats, "lease end", done=lambda s: s["reservations"] == 0)
        assert stats["used"] == (50_048 if step == "committed" else 0)


def test_reservations_never_take_more_than_a_quarter_of_a_segment() -> None:
    """Eviction cannot take reserved space back: however many clients reserve, three
    quarters of a segment stay for two-phase puts (and eviction)."""
    store = ObjectStore()
    assert store.mount_segment("owner", seg(length=64 * MiB)).code == OK
    granted = [store.reserve(f"client-{i}") for i in range(20)]
    spans = [r.reservations[0].space.length for r in granted if r.code == OK]
    assert spans and sum(spans) <= 16 * MiB
    assert granted[-1].code == ErrorCode.NO_AVAILABLE_HANDLE
    [started] = store.put_start("writer", [("big", 40 * MiB)])
    assert started.code == OK                             # the rest is still there


def test_an_exhausted_reservation_is_replaced_and_nothing_leaks(
        master: MasterProcess, holder: HolderProcess) -> None:
    """A 64 MiB holder: reservations of 8 MiB, values of 1 MiB, so 40 values need several
    reservations; the spent ones are released, every value reads back, and once the
    client closes only the values' blocks are used."""
    store = pure_client(master)
    values = {f"x{i}": pattern(200 + i, MiB - 100 * i) for i in range(40)}
    try:
        space = store._space
        assert space is not None
        for key, value in values.items():
            assert store.put(key, value) == 0
        assert space.commits == len(values)             # every one in one round trip
        assert space.calls > len(values) + 1            # ... and several Reserve calls
        for key, value in values.items():
            assert store.get(key) == value, key
    finally:
        store.close()
    blocks = sum((len(v) + 63) // 64 * 64 for v in values.values())
    with client(master, "check") as check:
        stats = eventually(check.stats, "release", done=lambda s: s["reservations"] == 0)
        assert (stats["used"], stats["keys"]) == (blocks, len(values))


def test_kill_9_of_the_master_between_write_and_commit(tmp_path: Path) -> None:
    """The client holds a reservation when the master dies: its next put fails (RPC_FAIL,
    nothing committed); after the restart the committed key is back, the failed one is
    absent, a new put takes a new reservation, and nothing stays reserved."""
    data = ["--data-dir", str(tmp_path / "data")]
    first = MasterProcess(extra=data)
    holder = HolderProcess("hixl", first.target, "127.0.0.1", 64 * MiB)
    store = pure_client(first)
    second = None
    try:
        kept, lost, after = pattern(7, 30_000), pattern(8, 40_000), pattern(9, 50_000)
        assert store.put("kept", kept) == 0
        first.kill()
        assert store.put("lost", lost) == ErrorCode.RPC_FAIL
        second = MasterProcess(first.port, extra=data)
        assert eventually(lambda: store.get("kept"), "kept", done=lambda v: v != b"") == kept
        # the new master's start fence over (a Reserve answered after waiting it out would
        # be stale on arrival, and the put would take the two-phase path instead)
        with client(second, "fence") as check:
            eventually(check.stats, "the start fence", done=lambda s: s["start_fence_s"] == 0)
        assert eventually(lambda: store.put("after", after), "put after restart",
                          done=lambda rc: rc == 0) == 0
        assert store.get("after") == after
        assert store.get("lost") == b""
        assert store.last_error_code == ErrorCode.OBJECT_NOT_FOUND
        space = store._space
        assert space is not None and space.commits == 2   # kept and after, one trip each
        store.close()
        with client(second, "check") as check:            # before the holder unmounts
            stats = eventually(check.stats, "release", done=lambda s: s["reservations"] == 0)
            assert (stats["keys"], stats["used"]) == (2, 30_016 + 50_048)
    finally:
        store.close()
        holder.stop()
        first.close()
        if second is not None:
            second.close()


# ---------------------------------------------------------------- commits shared by threads


def test_threads_putting_through_one_client_get_their_own_results(
        master: MasterProcess, holder: HolderProcess) -> None:
    """Eight threads put through one client at once (their Commits may share calls,
    `_SharedCalls`), some racing on common keys: every put returns 0, every value reads
    back whole, and a key put by several threads holds one writer's value entire."""
    store = pure_client(master)
    threads, per_thread = 8, 25
    errors: list[BaseException] = []
    shared_values = {(n, i): pattern(10_000 + n * 100 + i, 4096 + n) for n in range(threads)
                     for i in range(5)}

    def worker(n: int) -> None:
        try:
            for i in range(per_thread):
                assert store.put(f"t{n}-{i}", pattern(n * 1000 + i, 1000 + 37 * i)) == 0
                if i < 5:   # racing puts: upserts of one key, and plain puts of another
                    assert store.upsert(f"hot-{i}", shared_values[n, i]) == 0
                    assert store.put(f"first-{i}", shared_values[n, i]) == 0
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    try:
        running = [threading.Thread(target=worker, args=(n,)) for n in range(threads)]
        for thread in running:
            thread.start()
        for thread in running:
            thread.join(GIVE_UP_S)
        assert not any(thread.is_alive() for thread in running) and errors == []
        for n in range(threads):
            for i in range(per_thread):
                assert store.get(f"t{n}-{i}") == pattern(n * 1000 + i, 1000 + 37 * i)
        for i in range(5):
            candidates = {shared_values[n, i] for n in range(threads)}
            assert store.get(f"hot-{i}") in candidates
            assert store.get(f"first-{i}") in candidates
        space = store._space
        assert space is not None and space.commits == threads * (per_thread + 10)
    finally:
        store.close()


class _Master:
    """What _SharedCalls sends through, standing in for the Commit call: records each
    call's items and, while `hold` (or call number N's own `holds[N]`) is clear, keeps
    the caller in it."""

    def __init__(self) -> None:
        self.calls: list[list[tuple[str, int, Any]]] = []
        self.hold = threading.Event()
        self.holds: dict[int, threading.Event] = {}
        self.fail: BaseException | None = None

    def send(self, items: list[tuple[str, int, Any]], options: tuple[Any, ...]) -> list[int]:
        self.calls.append([item[0] for item in items])
        assert self.holds.get(len(self.calls) - 1, self.hold).wait(GIVE_UP_S)
        if self.fail is not None:
            raise self.fail
        return [len(key) for key, _, _ in items]   # a code per item, told apart


def _start(shared: _SharedCalls, keys: list[str], options: tuple[Any, ...] = ("c",)
           ) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["codes"] = shared.call([(key, 1, None) for key in keys], options)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            out["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, out


def test_calls_that_wait_go_together_each_with_its_own_codes() -> None:
    master = _Master()
    shared = _SharedCalls(master.send)
    first, first_out = _start(shared, ["a"])
    eventually(lambda: len(master.calls), "the first call in flight")
    waiting_calls = []
    for keys, options in [(["bb", "ccc"], ("c",)), (["dddd"], ("c",)),
                          (["bb"], ("c",)),          # a key already in the batch: a call after
                          (["eeeee"], ("other",))]:  # other options: a call of their own
        waiting_calls.append(_start(shared, keys, options))
        eventually(lambda: len(shared._queue), "the caller queued",
                   done=lambda n: n == len(waiting_calls))  # noqa: B023 - waited for here
    master.hold.set()
    for thread, _ in [(first, first_out), *waiting_calls]:
        thread.join(GIVE_UP_S)
    assert first_out == {"codes": [1]}
    assert [out for _, out in waiting_calls] == [
        {"codes": [2, 3]}, {"codes": [4]}, {"codes": [2]}, {"codes": [5]}]
    assert master.calls == [["a"], ["bb", "ccc", "dddd"], ["bb"], ["eeeee"]]


def test_a_failed_shared_call_fails_every_caller_with_its_type() -> None:
    master = _Master()
    master.fail = MasterUnavailable("the master did not answer")
    shared = _SharedCalls(master.send)
    first, first_out = _start(shared, ["a"])
    eventually(lambda: len(master.calls), "the first call in flight")
    second, second_out = _start(shared, ["b"])
    eventually(lambda: len(shared._queue), "a caller queued", done=lambda n: n == 1)
    third, third_out = _start(shared, ["c"])
    eventually(lambda: len(shared._queue), "two callers queued", done=lambda n: n == 2)
    master.hold.set()
    for thread in (first, second, third):
        thread.join(GIVE_UP_S)
    assert master.calls == [["a"], ["b", "c"]]
    for out in (first_out, second_out, third_out):
        assert type(out["error"]) is MasterUnavailable
        assert str(out["error"]) == str(master.fail)
    assert second_out["error"] is not third_out["error"]   # each thread its own


def test_threads_putting_while_the_master_hangs_all_fail_in_time_and_store_whole_or_nothing(
        master: MasterProcess, holder: HolderProcess) -> None:
    """A master that stops answering (SIGSTOP) while eight threads put through one
    client: every put returns an error by its deadline (the waiting threads' shared
    calls fail with it, none hangs), and once the master runs again each key is whole
    or absent: a commit it applies after the client gave up carries bytes written before
    it was sent."""
    store = MooncakeDistributedStore(setup_timeout=GIVE_UP_S, master_timeout=1.0)
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 4 * MiB, "tcp", "",
                       master.target) == 0, store.last_error
    values = {f"h{n}": pattern(500 + n, 3000 + n) for n in range(8)}
    codes: dict[str, int] = {}
    try:
        assert store.put("warm", b"w" * 100) == 0            # its reservation, held
        os.kill(master.pid, signal.SIGSTOP)
        try:
            running = [threading.Thread(target=lambda k=key: codes.__setitem__(
                k, store.put(k, values[k]))) for key in values]
            for thread in running:
                thread.start()
            for thread in running:
                thread.join(GIVE_UP_S)
            assert not any(thread.is_alive() for thread in running)
        finally:
            os.kill(master.pid, signal.SIGCONT)
        assert sorted(codes) == sorted(values)
        assert all(code == ErrorCode.RPC_FAIL for code in codes.values()), codes
        for key, value in values.items():
            got = eventually(lambda k=key: store.get(k), f"{key} readable or absent",
                             done=lambda v: v != b"" or store.last_error_code
                             == ErrorCode.OBJECT_NOT_FOUND)
            assert got in (value, b""), key
    finally:
        store.close()


def _interrupt(thread: threading.Thread) -> None:
    """KeyboardInterrupt in `thread` at its next bytecode, as a signal reaches the main
    thread: one blocked waiting on a condition gets it as it wakes."""
    assert thread.ident is not None
    assert ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread.ident), ctypes.py_object(KeyboardInterrupt)) == 1


def test_an_interrupted_caller_chosen_to_send_still_sends_for_the_others() -> None:
    master = _Master()
    shared = _SharedCalls(master.send)
    first, first_out = _start(shared, ["a"])
    eventually(lambda: len(master.calls), "the first call in flight")
    chosen, chosen_out = _start(shared, ["b"])     # first in the queue: sends the next
    eventually(lambda: len(shared._queue), "a caller queued", done=lambda n: n == 1)
    other, other_out = _start(shared, ["c"])       # goes in the same call
    eventually(lambda: len(shared._queue), "two callers queued", done=lambda n: n == 2)
    _interrupt(chosen)                             # raised as it wakes, chosen
    master.hold.set()
    for thread in (first, chosen, other):
        thread.join(GIVE_UP_S)
    assert master.calls == [["a"], ["b", "c"]]
    assert type(chosen_out["error"]) is KeyboardInterrupt and other_out == {"codes": [1]}
    assert not shared._in_flight and shared._queue == []
    after, after_out = _start(shared, ["d"])         # and the next caller is served
    after.join(GIVE_UP_S)
    assert after_out == {"codes": [1]} and master.calls[-1] == ["d"]


def test_an_interrupted_caller_waiting_its_turn_sends_nothing() -> None:
    master = _Master()
    master.holds[0], master.holds[1] = threading.Event(), threading.Event()
    shared = _SharedCalls(master.send)
    first, _ = _start(shared, ["a"])
    eventually(lambda: len(master.calls), "the first call in flight")
    second, second_out = _start(shared, ["b"])
    eventually(lambda: len(shared._queue), "a caller queued", done=lambda n: n == 1)
    gone, gone_out = _start(shared, ["x"], ("other",))    # not in the next call
    eventually(lambda: len(shared._queue), "two callers queued", done=lambda n: n == 2)
    _interrupt(gone)
    master.holds[0].set()                          # the next call goes, without "x"
    gone.join(GIVE_UP_S)
    assert type(gone_out["error"]) is KeyboardInterrupt
    master.holds[1].set()
    for thread in (first, second):
        thread.join(GIVE_UP_S)
    assert master.calls == [["a"], ["b"]] and second_out == {"codes": [1]}
    assert not shared._in_flight and shared._queue == []
