"""Gets without the master (docs/store.md §3), against a real hixl-master and holder.

A repeated get of an unchanged key is answered from the client's location cache (no
master call); once another client's removal or upsert of the key has returned, no get
reads the old value; eviction never takes a value a client may still read from its
cache. Waits are for conditions, under a deadline that only guards against a hang.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import waiting

from hixl.client.mooncake import MooncakeDistributedStore, ReplicateConfig
from hixl.client.store_client import MasterClient
from hixl.store_codes import ErrorCode
from hixl.tools.daemons import HolderProcess, MasterProcess
from hixl.types import TransferOp

MiB = 1 << 20
GIVE_UP_S = 30.0   # only a guard against a hang
LEASE_MS = 1000

#: call() until done(result): that result (tests/waiting.py)
eventually = partial(waiting.wait_until, timeout=GIVE_UP_S, interval=0.05)


def pattern(seed: int, size: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


@pytest.fixture
def lease_ms() -> int:
    """The master's read lease (a test parametrizes it to change it)."""
    return LEASE_MS


@pytest.fixture
def master(tmp_path: Path, lease_ms: int) -> Iterator[MasterProcess]:
    with MasterProcess(extra=["--data-dir", str(tmp_path / "data"),
                              f"-default_kv_lease_ttl={lease_ms}"]) as process:
        yield process


def pure_client(master: MasterProcess) -> MooncakeDistributedStore:
    store = MooncakeDistributedStore(setup_timeout=GIVE_UP_S)
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 4 * MiB, "tcp", "",
                       master.target) == 0, store.last_error
    return store


@pytest.fixture
def clients(master: MasterProcess) -> Iterator[tuple[MooncakeDistributedStore,
                                                     MooncakeDistributedStore]]:
    holder = HolderProcess("hixl", master.target, "127.0.0.1", 16 * MiB)
    writer, reader = pure_client(master), pure_client(master)
    yield writer, reader
    reader.close()
    writer.close()
    holder.stop()


class Reader:
    """One way a caller reads a value back as bytes (b"" when the call failed): `get`, or
    `get_into` / `batch_get_into` on a registered buffer (these take the cached-read
    path when the key's location is cached)."""

    def __init__(self, store: MooncakeDistributedStore, how: str) -> None:
        self.store, self.how = store, how
        self.sink = np.zeros(2 * MiB, np.uint8)
        assert store.register_buffer(self.sink.ctypes.data, self.sink.nbytes) == 0

    def __call__(self, key: str) -> bytes:
        if self.how == "get":
            return self.store.get(key)
        self.sink[:] = 0
        addr, room = self.sink.ctypes.data, self.sink.nbytes
        got = (self.store.get_into(key, addr, room) if self.how == "get_into"
               else self.store.batch_get_into([key], [addr], [room])[0])
        return bytes(self.sink[:got]) if got > 0 else b""


READS = ["get", "get_into", "batch_get_into"]


def master_calls(store: MooncakeDistributedStore) -> int:
    assert store._master is not None
    return store._master.fast_calls


def test_a_repeated_get_needs_no_master_call(clients: tuple[MooncakeDistributedStore, ...],
                                             ) -> None:
    writer, reader = clients
    value = pattern(1, 64 << 10)
    assert writer.put("k", value) == 0
    assert reader.get("k") == value                       # asks the master, caches
    before, hits = master_calls(reader), reader._locations.hits
    sink = np.zeros(64 << 10, np.uint8)
    assert reader.register_buffer(sink.ctypes.data, sink.nbytes) == 0
    assert reader.get("k") == value
    assert reader.get_into("k", sink.ctypes.data, sink.nbytes) == len(value)
    assert bytes(sink) == value
    # both answered from the cache, every byte read from the holder's segment
    assert (master_calls(reader), reader._locations.hits) == (before, hits + 2)


@pytest.mark.parametrize("how", READS)
@pytest.mark.parametrize("change", ["remove", "upsert"])
def test_no_stale_read_once_another_clients_change_returned(
        clients: tuple[MooncakeDistributedStore, ...], change: str, how: str) -> None:
    writer, store = clients
    reader = Reader(store, how)
    old, new = pattern(2, 50_000), pattern(3, 70_000)
    for round_ in range(3):
        key = f"k{round_}"
        assert writer.put(key, old) == 0
        assert reader(key) == old and reader(key) == old   # the second: cached
        if change == "remove":
            assert writer.remove(key) == ErrorCode.OBJECT_HAS_LEASE   # leased: kept
            assert reader(key) == old
            assert writer.remove(key, force=True) == 0
            assert reader(key) == b""
            assert store.last_error_code == ErrorCode.OBJECT_NOT_FOUND
        else:
            assert writer.upsert(key, new) == 0
            assert reader(key) == new


# a lease that outlasts the fills: they evict only values older than the eviction grace
@pytest.mark.parametrize("how", READS)
@pytest.mark.parametrize("lease_ms", [10_000])
def test_eviction_never_takes_a_value_a_cache_may_still_read(
        master: MasterProcess, clients: tuple[MooncakeDistributedStore, ...], how: str) -> None:
    writer, store = clients
    reader = Reader(store, how)
    kept = pattern(4, MiB)
    assert writer.put("kept", kept) == 0
    assert reader("kept") == kept                         # leased and cached
    filler = pattern(5, MiB)
    for i in range(24):                                   # more than the 16 MiB pool holds
        # a full pool whose other values were all just put evicts none of them (the
        # eviction grace): NO_AVAILABLE_HANDLE until the oldest may go
        eventually(lambda i=i: writer.put(f"fill-{i}", filler),
                   "room once the eviction grace passed", done=lambda rc: rc == 0)
    assert reader("kept") == kept                         # evicted around it
    with MasterClient(master.target, timeout=GIVE_UP_S) as check:
        eventually(lambda: check.list_keys("^kept$").keys[0].lease_ms, "lease end",
                   done=lambda ms: ms == 0)
        for i in range(24, 48):                           # now it goes: least recently read
            eventually(lambda i=i: writer.put(f"fill-{i}", filler),
                       "room once the eviction grace passed", done=lambda rc: rc == 0)
        assert check.exist_key("kept") == ErrorCode.OBJECT_NOT_FOUND
    assert reader("kept") == b""                          # never another value's bytes
    assert store.last_error_code == ErrorCode.OBJECT_NOT_FOUND


def fabric_reads(store: MooncakeDistributedStore) -> int:
    """READ transfers this store's engine made over the fabric path (ops)."""
    assert store._engine is not None
    return store._engine.traffic.pair("fabric")[TransferOp.READ].ops


def test_a_repeated_get_into_copies_from_the_kept_mapping_until_the_key_changes(
        clients: tuple[MooncakeDistributedStore, ...]) -> None:
    """From the second cached get_into of a key on, the client copies straight from where
    the first one found its bytes mapped (no transfer); its own removal and replacement,
    and another client's upsert, end that at once."""
    writer, store = clients
    reader = Reader(store, "get_into")
    old, new, newer = pattern(7, 64 << 10), pattern(8, 40_000), pattern(9, 90_000)
    assert writer.put("k", old) == 0
    assert reader("k") == old and reader("k") == old     # asked the master; one transfer
    transfers, hits = fabric_reads(store), store._locations.hits
    for _ in range(5):
        assert reader("k") == old
    assert (fabric_reads(store), store._locations.hits) == (transfers, hits + 5)

    assert store.upsert("k", new) == 0                     # its own replacement
    assert reader("k") == new and reader("k") == new
    assert store.remove("k", force=True) == 0              # its own removal (leased)
    assert reader("k") == b""
    assert store.last_error_code == ErrorCode.OBJECT_NOT_FOUND

    assert writer.put("k", old) == 0
    assert reader("k") == old and reader("k") == old     # kept again
    assert writer.upsert("k", newer) == 0                 # another client's replacement
    assert reader("k") == newer


def test_a_repeated_batch_get_into_copies_every_key_from_its_kept_mapping(
        clients: tuple[MooncakeDistributedStore, ...]) -> None:
    """A batch_get_into whose keys all have kept mappings copies them without a transfer;
    once one of them is removed, the batch takes the general path and reports that key."""
    writer, store = clients
    values = {f"b{i}": pattern(20 + i, 30_000 + i) for i in range(5)}
    for key, value in values.items():
        assert writer.put(key, value) == 0
    sink = np.zeros(5 * 32_768, np.uint8)
    assert store.register_buffer(sink.ctypes.data, sink.nbytes) == 0
    keys = list(values)
    ptrs = [sink.ctypes.data + i * 32_768 for i in range(5)]

    def read() -> list[int]:
        sink[:] = 0
        return store.batch_get_into(keys, ptrs, [32_768] * 5)

    def landed(index: int) -> bytes:
        return bytes(sink[index * 32_768:index * 32_768 + len(values[keys[index]])])

    assert read() == [len(v) for v in values.values()]     # asks the master
    assert read() == [len(v) for v in values.values()]     # one transfer; keeps them
    transfers, hits = fabric_reads(store), store._locations.hits
    for _ in range(3):
        assert read() == [len(v) for v in values.values()]
        assert all(landed(i) == values[key] for i, key in enumerate(keys))
    assert (fabric_reads(store), store._locations.hits) == (transfers, hits + 15)
    assert store.remove("b2", force=True) == 0
    codes = read()
    assert codes[2] == ErrorCode.OBJECT_NOT_FOUND
    assert [c for i, c in enumerate(codes) if i != 2] == [
        len(values[k]) for i, k in enumerate(keys) if i != 2]


def test_kept_reads_check_every_destination_against_the_registered_buffers(
        clients: tuple[MooncakeDistributedStore, ...]) -> None:
    """The kept path checks destinations in one lookup when they share a buffer; spread
    over two registered buffers they still read from the kept mappings (each checked); a
    destination in no registered buffer sends the call down the general path (a transfer),
    which reads into it as Mooncake's TCP transport would."""
    writer, store = clients
    values = {f"d{i}": pattern(40 + i, 20_000) for i in range(4)}
    for key, value in values.items():
        assert writer.put(key, value) == 0
    first, second = np.zeros(2 * 20_000, np.uint8), np.zeros(2 * 20_000, np.uint8)
    for sink in (first, second):
        assert store.register_buffer(sink.ctypes.data, sink.nbytes) == 0
    keys = list(values)
    ptrs = [first.ctypes.data, second.ctypes.data, first.ctypes.data + 20_000,
            second.ctypes.data + 20_000]
    expected = [values["d0"] + values["d2"], values["d1"] + values["d3"]]

    def read(dsts: list[int]) -> list[int]:
        first[:], second[:] = 0, 0
        return store.batch_get_into(keys, dsts, [20_000] * 4)

    assert read(ptrs) == [20_000] * 4     # asks the master
    assert read(ptrs) == [20_000] * 4     # one transfer; keeps the mappings
    transfers = fabric_reads(store)
    assert read(ptrs) == [20_000] * 4
    assert [first.tobytes(), second.tobytes()] == expected
    assert fabric_reads(store) == transfers   # from the kept mappings
    elsewhere = np.zeros(20_000, np.uint8)    # mapped here, never registered
    assert read(ptrs[:3] + [elsewhere.ctypes.data]) == [20_000] * 4
    assert fabric_reads(store) > transfers     # the general path's transfer
    assert elsewhere.tobytes() == values["d3"] and first.tobytes() == expected[0]


def test_reads_from_kept_mappings_racing_close_end_in_a_code_not_a_crash(
        clients: tuple[MooncakeDistributedStore, ...]) -> None:
    """Threads repeating cached get_into while the store closes: each call returns the
    value whole or a negative code; the mappings they copy from stay mapped meanwhile."""
    writer, store = clients
    values = {f"k{i}": pattern(10 + i, 64 << 10) for i in range(4)}
    for key, value in values.items():
        assert writer.put(key, value) == 0
    readers = [Reader(store, "get_into") for _ in values]
    for (key, value), reader in zip(values.items(), readers, strict=True):
        assert reader(key) == value and reader(key) == value   # the next ones: kept
    outcomes: list[set[str]] = [set() for _ in readers]
    started = threading.Barrier(len(readers) + 1)

    def loop(index: int, key: str, value: bytes) -> None:
        started.wait(GIVE_UP_S)
        while True:
            got = readers[index](key)
            if got == b"":
                outcomes[index].add("code")
                return
            outcomes[index].add("value" if got == value else "corrupt")

    threads = [threading.Thread(target=loop, args=(i, key, value))
               for i, (key, value) in enumerate(values.items())]
    for thread in threads:
        thread.start()
    started.wait(GIVE_UP_S)
    store.close()
    for thread in threads:
        thread.join(GIVE_UP_S)
        assert not thread.is_alive()
    assert all(outcome <= {"value", "code"} and "code" in outcome for outcome in outcomes), \
        outcomes


def test_cached_reads_of_a_killed_holder_fail_instead_of_reading_its_memory(
        master: MasterProcess) -> None:
    """A holder SIGKILLed after its values were cached: the memory this client still maps
    is intact, but the value is gone with its holder, so get_into / batch_get_into fail
    (the cached read's liveness check sends them down the general path, which reports
    the failure) rather than return its bytes."""
    holder = HolderProcess("hixl", master.target, "127.0.0.1", 16 * MiB)
    writer, store = pure_client(master), pure_client(master)
    try:
        value = pattern(6, 100_000)
        assert writer.put("k", value) == 0
        reader = Reader(store, "get_into")
        assert reader("k") == value and reader("k") == value
        hits = store._locations.hits
        holder.proc.kill()
        holder.proc.wait(GIVE_UP_S)
        for how in ("get_into", "batch_get_into"):
            assert Reader(store, how)("k") == b"", how
            assert store.last_error_code < 0
        assert store._locations.hits > hits   # the locations were cached: the fast path ran
    finally:
        store.close()
        writer.close()
        holder.stop()


def test_batch_get_into_over_two_holders_reads_every_value(master: MasterProcess) -> None:
    """Values cached on two holders (two peers: not the one-peer cached read) come back
    whole through the general path, in order."""
    holders = [HolderProcess("hixl", master.target, "127.0.0.1", 16 * MiB) for _ in range(2)]
    writer, store = pure_client(master), pure_client(master)
    try:
        values = {f"v{i}": pattern(10 + i, 30_000 + i) for i in range(12)}
        for i, (key, value) in enumerate(values.items()):   # alternately on each holder
            config = ReplicateConfig(preferred_segment=holders[i % 2].segment)
            assert writer.put(key, value, config) == 0
        sink = np.zeros(12 * 64 << 10, np.uint8)
        assert store.register_buffer(sink.ctypes.data, sink.nbytes) == 0
        ptrs = [sink.ctypes.data + i * (64 << 10) for i in range(12)]
        for _ in range(2):   # the second time every location is cached
            sink[:] = 0
            got = store.batch_get_into(list(values), ptrs, [64 << 10] * 12)
            assert got == [len(v) for v in values.values()]
            for i, value in enumerate(values.values()):
                start = i * (64 << 10)
                assert bytes(sink[start:start + len(value)]) == value
        engines = {r.engine for key in values
                   for r in store._locations.get(key).replicas}  # type: ignore[union-attr]
        assert len(engines) == 2, engines
    finally:
        store.close()
        writer.close()
        for holder in holders:
            holder.stop()
