"""`hixl.client.mooncake.MooncakeDistributedStore`: Mooncake Store's documented Python API,
end to end, and how it behaves under failure.

Real parts only: a real `hixl-master` process (journal under tmp_path), store clients in
separate processes (tests/helpers/store_worker.py, each with its own embedded agent
holding a segment) and one in this process. Every value is checked byte for byte.
Deadlines only prove "does not hang"; nothing asserts how long anything took.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import selectors
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import waiting

from hixl.client.mooncake import (
    BufferHandle,
    MooncakeConfig,
    MooncakeDistributedStore,
    ReplicateConfig,
    SoftPinAction,
)
from hixl.client.mooncake.store import mooncake_size as parse_size
from hixl.client.store_client import MasterClient
from hixl.processes import free_port
from hixl.store_codes import ErrorCode
from hixl.tools.daemons import MasterProcess

WORKER = os.path.join(os.path.dirname(__file__), "helpers", "store_worker.py")
MiB = 1 << 20
SEGMENT = 16 * MiB
BUFFER = 4 * MiB
GIVE_UP_S = 30.0   # only a guard against a hang: no assertion depends on timing

RPC_FAIL = int(ErrorCode.RPC_FAIL)
NOT_FOUND = int(ErrorCode.OBJECT_NOT_FOUND)
INVALID_PARAMS = int(ErrorCode.INVALID_PARAMS)


def pattern(seed: int, size: int) -> bytes:
    """The same bytes tests/helpers/store_worker.py makes for (seed, size)."""
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


#: call() until done(result) (e.g. once a restarted master is reached and remounted):
#: that result (tests/waiting.py)
eventually = partial(waiting.wait_until, timeout=GIVE_UP_S, interval=0.1)


class Worker:
    """A store client in its own process (tests/helpers/store_worker.py)."""

    def __init__(self, master: str, log_dir: Path, name: str, segment: int = SEGMENT) -> None:
        self.log_path = log_dir / f"{name}.log"
        job = {"master": master, "segment": segment, "buffer": BUFFER,
               "setup_timeout": GIVE_UP_S}
        with open(self.log_path, "w", encoding="utf-8") as log:
            self.proc = subprocess.Popen(
                [sys.executable, WORKER, json.dumps(job)], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log, text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "MC_TRANSFER_TIMEOUT": "10"})
        ready = self._line()
        assert ready["rc"] == 0, (ready, self.log())
        self.hostname: str = ready["hostname"]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(GIVE_UP_S):
                raise AssertionError(f"worker did not answer; its log:\n{self.log()}")
        line = self.proc.stdout.readline()
        assert line, f"worker exited (rc={self.proc.poll()}); its log:\n{self.log()}"
        return json.loads(line)

    def step(self, **step: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(step) + "\n")
        self.proc.stdin.flush()
        return self._line()

    def kill(self) -> None:
        """SIGKILL: the client dies holding its segment, without a word to the master."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(GIVE_UP_S)

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, AssertionError, ValueError):
                self.step(do="close")
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(GIVE_UP_S)
        self.kill()


@pytest.fixture
def master(tmp_path: Path) -> Iterator[MasterProcess]:
    with MasterProcess(extra=["--data-dir", str(tmp_path / "data")]) as process:
        yield process


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    started: list[Worker] = []

    def start(master: MasterProcess, segment: int = SEGMENT) -> Worker:
        worker = Worker(master.target, tmp_path, f"worker-{len(started)}", segment)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.close()


def new_store(master: MasterProcess, segment: int | str = SEGMENT, buffer: int | str = BUFFER,
              **options: Any) -> MooncakeDistributedStore:
    store = MooncakeDistributedStore(setup_timeout=GIVE_UP_S, **options)
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", segment, buffer, "tcp", "", master.target)
    assert rc == 0, store.last_error
    return store


@pytest.fixture
def store(master: MasterProcess) -> Iterator[MooncakeDistributedStore]:
    store = new_store(master)
    yield store
    store.close()


def replicas_of(master: MasterProcess, key: str) -> list[str]:
    """The engines holding `key`'s replicas, as the master says."""
    with MasterClient(master.target, timeout=GIVE_UP_S) as client:
        found = client.get_replicas(key)
    assert found.code == ErrorCode.OK, found
    return [r.engine for r in found.replicas]


# ------------------------------------------------------------------ the documented API


def test_put_get_bytes_forms(store: MooncakeDistributedStore, master: MasterProcess,
                             workers: Callable[..., Worker]) -> None:
    """put/get/put_batch/get_batch/upsert*/put_parts with another client's segment in the
    pool: every byte comes back, existing keys keep their value, upserts replace it."""
    workers(master)
    values = {f"v{i}": pattern(i, size) for i, size in
              enumerate([1, 63, 4096, 100_000, 3 * MiB + 17, 6 * MiB])}  # last: > staging
    for key, value in values.items():
        assert store.put(key, value) == 0, store.last_error
    for key, value in values.items():
        assert store.get(key) == value
    assert store.get_batch(list(values)) == list(values.values())

    assert store.put("v0", b"other") == 0            # Mooncake: kept, still 0
    assert store.get("v0") == values["v0"]
    assert store.upsert("v0", b"replaced") == 0
    assert store.get("v0") == b"replaced"

    keys = [f"b{i}" for i in range(8)]
    batch = [pattern(100 + i, 1000 * (i + 1)) for i in range(8)]
    assert store.put_batch(keys, batch) == 0
    assert store.get_batch(keys + ["missing"]) == batch + [b""]
    assert store.upsert_batch(keys[:2], [b"x", bytearray(b"yy")]) == 0
    assert store.get_batch(keys[:3]) == [b"x", b"yy", batch[2]]

    parts = [b"head-", memoryview(b"middle-"), np.frombuffer(b"tail", np.uint8)]
    assert store.put_parts("parts", *parts) == 0
    assert store.get("parts") == b"head-middle-tail"
    assert store.upsert_parts("parts", b"new-", b"parts") == 0
    assert store.get("parts") == b"new-parts"

    assert store.get("missing") == b""
    assert store.last_error_code == NOT_FOUND


def test_zero_copy_buffer_forms(store: MooncakeDistributedStore, master: MasterProcess,
                                workers: Callable[..., Worker]) -> None:
    """register_buffer, put_from/get_into, their batch and multi-buffer forms, upsert_from,
    get_into_ranges; unregister_buffer then refuses the memory."""
    workers(master)
    src = np.frombuffer(pattern(1, 2 * MiB), np.uint8).copy()
    dst = np.zeros(2 * MiB, np.uint8)
    s, d = src.ctypes.data, dst.ctypes.data
    assert store.register_buffer(s, src.nbytes) == 0
    assert store.register_buffer(d, dst.nbytes) == 0
    assert store.register_buffer(s, src.nbytes) == 0       # same range again: fine

    assert store.put_from("one", s, MiB) == 0
    assert store.get_into("one", d, dst.nbytes) == MiB
    assert bytes(dst[:MiB]) == bytes(src[:MiB])

    keys = ["a", "b", "c"]
    offsets, sizes = [0, 5000, 700_000], [5000, 695_000, 1]
    codes = store.batch_put_from(keys, [s + o for o in offsets], sizes,
                                 ReplicateConfig(replica_num=2))
    assert codes == [0, 0, 0], store.last_error
    dst[:] = 0
    got = store.batch_get_into(keys, [d + o for o in offsets], sizes)
    assert got == sizes
    assert bytes(dst[:700_001]) == bytes(src[:700_001])

    # multi buffers: each value gathered from pieces, scattered back into other pieces
    pieces = [[s, s + 1000], [s + 2000]]
    lengths = [[100, 200], [300]]
    assert store.batch_put_from_multi_buffers(["m1", "m2"], pieces, lengths) == [0, 0]
    assert store.get("m1") == bytes(src[:100]) + bytes(src[1000:1200])
    dst[:] = 0
    assert store.batch_get_into_multi_buffers(["m1", "m2"], [[d, d + 5000], [d + 9000]],
                                              [[150, 150], [300]]) == [300, 300]
    assert bytes(dst[:150]) == bytes(src[:100]) + bytes(src[1000:1050])
    assert bytes(dst[5000:5150]) == bytes(src[1050:1200])
    assert bytes(dst[9000:9300]) == bytes(src[2000:2300])

    # ranges of objects: buffer 0 takes two ranges of "one" and one of "a"
    dst[:] = 0
    result = store.get_into_ranges([d], [["one", "a"]], [[[0, 100], [200]]],
                                   [[[10, 5000], [4000]]], [[[50, 60], [1000]]])
    assert result == [[[50, 60], [1000]]]
    assert bytes(dst[:50]) == bytes(src[10:60])
    assert bytes(dst[100:160]) == bytes(src[5000:5060])
    assert bytes(dst[200:1200]) == bytes(src[4000:5000])
    # a range past the value's end, and a missing key: codes, the rest still read
    result = store.get_into_ranges([d], [["a", "nope"]], [[[0, 10], [20]]],
                                   [[[0, 4999], [0]]], [[[10, 5], [1]]])
    assert result == [[[10, INVALID_PARAMS], [NOT_FOUND]]]

    assert store.upsert_from("one", s + 10, 20) == 0
    assert store.get("one") == bytes(src[10:30])
    assert store.batch_upsert_from(["a", "b"], [s, s + 1], [3, 4]) == [0, 0]
    assert store.get_batch(["a", "b"]) == [bytes(src[:3]), bytes(src[1:5])]

    assert store.unregister_buffer(s) == 0
    assert store.unregister_buffer(s) == INVALID_PARAMS
    # the memory is plain memory again, which Mooncake's tcp transport takes too
    assert store.put_from("after", s, 100) == 0
    assert store.get("after") == bytes(src[:100])


def test_queries_buffers_and_removal(store: MooncakeDistributedStore) -> None:
    """is_exist/batch_is_exist/get_size, get_buffer/batch_get_buffer, remove (leases),
    batch_remove, remove_by_regex, remove_all, get_hostname, health_check."""
    value = pattern(5, 12345)
    assert store.put("k1", value) == 0
    assert store.put("k2", b"two") == 0
    assert store.is_exist("k1") == 1
    assert store.is_exist("nope") == 0
    assert store.batch_is_exist(["k1", "nope", "k2"]) == [1, 0, 1]
    assert store.get_size("k1") == 12345
    assert store.get_size("nope") == NOT_FOUND

    handle = store.get_buffer("k1")
    assert isinstance(handle, BufferHandle)
    assert handle.size() == 12345 and handle.ptr() != 0
    assert bytes(memoryview(handle)) == value
    assert ctypes.string_at(handle.ptr(), handle.size()) == value
    assert store.get_buffer("nope") is None
    handles = store.batch_get_buffer(["k2", "nope"])
    assert handles[0] is not None and bytes(handles[0]) == b"two" and handles[1] is None

    # reads leased k1 (the master's default lease): remove refuses unless forced
    assert store.remove("k1") == ErrorCode.OBJECT_HAS_LEASE
    assert store.get("k1") == value
    assert store.remove("k1", force=True) == 0
    assert store.is_exist("k1") == 0
    assert store.remove("k1") == NOT_FOUND

    for i in range(5):
        assert store.put(f"re-{i}", b"r") == 0
        assert store.put(f"keep-{i}", b"k") == 0
    assert store.batch_remove(["re-0", "re-1", "nope"], force=True) == [0, 0, NOT_FOUND]
    assert store.remove_by_regex("^re-", force=True) == 3
    assert store.batch_is_exist([f"re-{i}" for i in range(5)]) == [0] * 5
    assert store.remove_all(force=True) == 6          # keep-0..4 and k2
    assert store.batch_is_exist(["k2", "keep-0"]) == [0, 0]

    host, _, port = store.get_hostname().rpartition(":")
    assert host == "127.0.0.1" and 12300 <= int(port) <= 14300   # Mooncake's port range
    assert store.health_check() == 0


def test_values_cross_processes(store: MooncakeDistributedStore, master: MasterProcess,
                                workers: Callable[..., Worker]) -> None:
    """What one client puts, another process reads, whoever's segment holds it."""
    worker = workers(master)
    for i, size in enumerate([10, 70_000, 2 * MiB]):
        assert worker.step(do="put", key=f"w{i}", seed=i, size=size) == {"rc": 0}
        assert store.get(f"w{i}") == pattern(i, size)
        assert store.put(f"s{i}", pattern(50 + i, size)) == 0
        got = worker.step(do="get", key=f"s{i}")
        assert got["len"] == size and got["sha256"] == sha(pattern(50 + i, size))
    engines = {e for i in range(3) for key in (f"w{i}", f"s{i}") for e in replicas_of(master, key)}
    assert engines <= {worker.hostname, store.get_hostname()}


def test_replica_survives_its_holder_killed(master: MasterProcess,
                                            workers: Callable[..., Worker]) -> None:
    """replica_num=2 on two clients' segments: kill one, every byte still reads from the other."""
    a, b = workers(master), workers(master)
    reader = new_store(master, segment=0)      # a pure client: the replicas go to a and b
    try:
        values = {f"r{i}": pattern(200 + i, 300_000 + i) for i in range(4)}
        assert reader.put_batch(list(values), list(values.values()),
                                ReplicateConfig(replica_num=2)) == 0, reader.last_error
        for key in values:
            assert sorted(replicas_of(master, key)) == sorted([a.hostname, b.hostname])
        assert reader.get_batch(list(values)) == list(values.values())  # connections cached
        a.kill()
        for key, value in values.items():
            assert reader.get(key) == value, reader.last_error
        buf = np.zeros(400_000, np.uint8)
        assert reader.register_buffer(buf.ctypes.data, buf.nbytes) == 0
        assert reader.get_into("r3", buf.ctypes.data, buf.nbytes) == 300_003
        assert bytes(buf[:300_003]) == values["r3"]
    finally:
        reader.close()


def test_dead_segment_holder_does_not_fail_puts(tmp_path: Path,
                                                workers: Callable[..., Worker]) -> None:
    """A client holding a segment is killed; until the master expires it (a long ttl here),
    its segment is still allocated from, yet every other client's put succeeds: the failed
    transfer is revoked and the put retried on other segments."""
    with MasterProcess(extra=["--data-dir", str(tmp_path / "data"), "--client_ttl=600"]) as master:
        a, doomed = workers(master), workers(master)
        writer = new_store(master)
        try:
            doomed.kill()
            with MasterClient(master.target, timeout=GIVE_UP_S) as client:
                mounted = {m.segment.engine for m in client.list_segments() if m.live}
            assert doomed.hostname in mounted       # the master still allocates from it
            values = {f"p{i}": pattern(300 + i, 50_000 + i) for i in range(30)}
            for key, value in values.items():
                assert writer.put(key, value) == 0, writer.last_error
            codes = writer.put_batch([f"q{i}" for i in range(10)], [b"q" * 100] * 10)
            assert codes == 0, writer.last_error
            assert a.step(do="puts", prefix="w", count=10, seed=400, size=20_000) == {
                "codes": [0] * 10}
            for key, value in values.items():
                assert writer.get(key) == value
                assert doomed.hostname not in replicas_of(master, key)
            for i in range(10):
                assert writer.get(f"w{i}") == pattern(400 + i, 20_000)
        finally:
            writer.close()


# ------------------------------------------------------------------ failures


def test_setup_without_master_fails_within_its_timeout() -> None:
    """No master at the address: setup returns RPC_FAIL (Mooncake blocks 90 s), says why,
    and the store can be closed."""
    store = MooncakeDistributedStore(setup_timeout=0.5)
    address = f"127.0.0.1:{free_port()}"
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", MiB, MiB, "tcp", "", address)
    assert rc == RPC_FAIL
    assert address in store.last_error and "hixl-master" in store.last_error
    assert store.put("k", b"v") < 0                      # not set up
    assert store.health_check() == 1
    assert store.close() == 0


def test_missing_vs_unreachable(tmp_path: Path) -> None:
    """A missing key and an unreachable master give different codes everywhere."""
    master = MasterProcess(extra=["--data-dir", str(tmp_path / "data")])
    store = new_store(master)
    try:
        buf = np.zeros(4096, np.uint8)
        assert store.register_buffer(buf.ctypes.data, buf.nbytes) == 0
        assert store.get_into("nope", buf.ctypes.data, buf.nbytes) == NOT_FOUND
        assert store.get_size("nope") == NOT_FOUND
        assert store.is_exist("nope") == 0
        assert store.get("nope") == b"" and store.last_error_code == NOT_FOUND
        master.kill()
        assert store.get_into("nope", buf.ctypes.data, buf.nbytes) == RPC_FAIL
        assert store.get_size("nope") == RPC_FAIL
        assert store.is_exist("nope") == -1 and store.last_error_code == RPC_FAIL
        assert store.get("nope") == b"" and store.last_error_code == RPC_FAIL
        assert store.batch_is_exist(["a", "b"]) == [-1, -1]
        assert store.put("k", b"v") == RPC_FAIL
        assert store.remove("k") == RPC_FAIL
        assert store.health_check() == 2
        assert "master" in store.last_error
    finally:
        store.close()
        master.close()


def test_master_restart_keeps_keys_and_clients(tmp_path: Path,
                                               workers: Callable[..., Worker]) -> None:
    """kill -9 the master: calls fail at once with RPC_FAIL; restarted on its port and data
    dir, every committed key reads back (the clients remount their segments by
    themselves) and new puts work, without re-creating any client."""
    data = ["--data-dir", str(tmp_path / "data")]
    master = MasterProcess(extra=data)
    worker = workers(master)
    store = new_store(master)
    try:
        values = {f"k{i}": pattern(500 + i, 10_000 * (i + 1)) for i in range(12)}
        for key, value in values.items():
            assert store.put(key, value) == 0
        assert worker.step(do="put", key="from-worker", seed=9, size=77_777) == {"rc": 0}
        holders = {e for key in values for e in replicas_of(master, key)}
        assert holders == {store.get_hostname(), worker.hostname}   # both segments hold keys

        master.kill()
        assert store.put("during", b"x") == RPC_FAIL
        assert store.get("k0") == b"" and store.last_error_code == RPC_FAIL
        assert store.get_size("k0") == RPC_FAIL
        assert store.is_exist("k0") == -1
        assert worker.step(do="put", key="w-during", seed=1, size=10) == {"rc": RPC_FAIL}

        restarted = MasterProcess(master.port, extra=data)
        try:
            eventually(lambda: store.put("after", b"back"), "put after restart",
                       done=lambda rc: rc == 0)
            for key, value in values.items():
                assert eventually(lambda k=key: store.get(k), f"get {key}",  # type: ignore[misc]
                                  done=lambda v: v != b"") == value
            got = eventually(lambda: worker.step(do="get", key="from-worker"), "worker's key",
                             done=lambda r: r["len"] > 0)
            assert got["sha256"] == sha(pattern(9, 77_777))
            assert store.get("after") == b"back"
            assert worker.step(do="put", key="w-after", seed=2, size=1000) == {"rc": 0}
            assert store.get("w-after") == pattern(2, 1000)
            assert store.is_exist("during") == 0
        finally:
            store.close()
            restarted.close()
    finally:
        store.close()
        master.close()


def test_bad_inputs_change_nothing(store: MooncakeDistributedStore) -> None:
    """Empty or oversized keys, oversized values, unregistered or small buffers, mismatched
    lists: documented codes, and nothing stored changes."""
    assert store.put("kept", b"original") == 0
    assert store.put("", b"v") == ErrorCode.INVALID_KEY
    assert store.put("x" * 5000, b"v") == ErrorCode.INVALID_KEY
    assert store.get("") == b"" and store.last_error_code == ErrorCode.INVALID_KEY
    assert store.put("s", "a str") == INVALID_PARAMS   # type: ignore[arg-type]
    assert store.put("huge", b"\0" * (SEGMENT + MiB)) == ErrorCode.NO_AVAILABLE_HANDLE
    assert store.is_exist("huge") == 0
    assert store.put_batch(["a", "b"], [b"1"]) == INVALID_PARAMS
    assert store.batch_is_exist(["a", "b"]) == [0, 0]

    # memory whose last page is unmapped: a range running into it is refused, whether
    # registered or not (plain mapped memory is taken, as Mooncake's tcp transport does)
    page = os.sysconf("SC_PAGE_SIZE")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    mapped = MiB + page
    base = libc.mmap(None, mapped, 3, 0x22, -1, 0)  # PROT_READ|WRITE, PRIVATE|ANONYMOUS
    assert base not in (None, ctypes.c_void_p(-1).value)
    assert libc.munmap(base + MiB, page) == 0  # [base, base + MiB) stays mapped
    buf = np.ctypeslib.as_array((ctypes.c_uint8 * MiB).from_address(base))
    addr = base
    assert store.put_from("u0", addr + MiB - 10, 20) == INVALID_PARAMS   # unmapped page
    assert store.get_into("kept", addr + MiB - 10, 20) == INVALID_PARAMS
    assert store.batch_put_from(["u1", "u2"], [addr, addr + MiB], [10, 10]) == [0, INVALID_PARAMS]
    assert store.batch_get_into(["kept"], [addr + MiB], [10]) == [INVALID_PARAMS]
    assert store.remove("u1") == 0
    assert store.register_buffer(addr, MiB) == 0
    assert store.register_buffer(addr + 10, 100) == INVALID_PARAMS        # overlaps
    assert store.put_from("edge", addr + MiB - 10, 20) == INVALID_PARAMS  # runs past it
    assert store.get_into("kept", addr, 3) == ErrorCode.BUFFER_OVERFLOW
    assert bytes(buf[:3]) == b"\0\0\0"
    assert store.batch_put_from(["ok", ""], [addr, addr], [10, 10]) == [0, ErrorCode.INVALID_KEY]
    assert store.batch_put_from(["x"], [addr, addr], [10]) == [INVALID_PARAMS]
    assert store.batch_is_exist(["u0", "u1", "u2", "edge", "x", "ok"]) == [0, 0, 0, 0, 0, 1]
    assert store.get("kept") == b"original"
    assert store.unregister_buffer(addr) == 0
    libc.munmap(base, MiB)
    assert store.put("bad-config", b"v", ReplicateConfig(replica_num=0)) == INVALID_PARAMS
    assert store.is_exist("bad-config") == 0
    assert store.put("empty", b"") == 0 and store.is_exist("empty") == 0   # as Mooncake


def test_setup_forms_and_lifecycle(master: MasterProcess, tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Dict form with human-readable sizes, setup() from MOONCAKE_* / MOONCAKE_CONFIG_PATH,
    bad arguments refused, calls before setup and after close refused."""
    assert parse_size("16MB") == 16 * MiB and parse_size("4gb") == 4 << 30
    assert parse_size(" 1.5k ") == 1536 and parse_size(42) == 42
    with pytest.raises(ValueError):
        parse_size("12XB")

    unset = MooncakeDistributedStore()
    assert unset.put("k", b"v") < 0 and unset.get("k") == b"" and unset.is_exist("k") == -1
    assert unset.get_hostname() == "" and unset.close() == 0

    port = free_port()
    store = MooncakeDistributedStore()
    assert store.setup({"local_hostname": f"127.0.0.1:{port}", "metadata_server":
                        "http://127.0.0.1:8080/metadata", "global_segment_size": "8MB",
                        "local_buffer_size": "1mb", "protocol": "tcp",
                        "master_server_addr": master.target}) == 0, store.last_error
    assert store.get_hostname() == f"127.0.0.1:{port}"
    assert store.setup({"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                        "master_server_addr": master.target}) < 0   # already set up
    assert store.put("dict", b"form") == 0 and store.get("dict") == b"form"
    assert store.close() == 0 and store.close() == 0
    assert store.put("k", b"v") < 0 and store.health_check() == 1

    for bad in ({"protocol": "carrier-pigeon"}, {"global_segment_size": "12XB"},
                {"master_server_addr": "etcd://a:2379"}, {"local_hostname": ""}):
        args = {"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                "master_server_addr": master.target, **bad}
        refused = MooncakeDistributedStore()
        assert refused.setup(args) == INVALID_PARAMS, bad
        refused.close()

    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    monkeypatch.setenv("MOONCAKE_MASTER", master.target)
    monkeypatch.setenv("MOONCAKE_LOCAL_HOSTNAME", "127.0.0.1")
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "4MB")
    monkeypatch.setenv("MOONCAKE_LOCAL_BUFFER_SIZE", "1MB")
    config = MooncakeConfig.load_from_env()
    assert (config.master_server_address, config.metadata_server, config.protocol,
            config.global_segment_size) == (master.target, "P2PHANDSHAKE", "tcp", 4 * MiB)
    from_env = MooncakeDistributedStore()
    assert from_env.setup() == 0, from_env.last_error
    assert from_env.put("env", b"e") == 0 and from_env.get("env") == b"e"
    from_env.close()

    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                                "global_segment_size": "2MB", "local_buffer_size": "1MB",
                                "protocol": "RDMA", "device_name": "mlx5_0",
                                "master_server_address": master.target}))
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    config = MooncakeConfig.load_from_env()
    assert (config.protocol, config.local_buffer_size, config.device_name) == ("rdma", MiB,
                                                                                "mlx5_0")
    from_file = MooncakeDistributedStore()
    assert from_file.setup() == 0, from_file.last_error
    assert from_file.put("file", pattern(3, 70_000)) == 0
    assert from_file.get("file") == pattern(3, 70_000)
    from_file.close()
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(tmp_path / "missing.json"))
    assert MooncakeDistributedStore().setup() == INVALID_PARAMS


def test_replicate_config_and_preferred_segment(store: MooncakeDistributedStore,
                                                master: MasterProcess,
                                                workers: Callable[..., Worker]) -> None:
    """preferred_segment places the value (as LMCache's prefer_local_alloc does); pins and
    soft pin actions are accepted."""
    worker = workers(master)
    for target in (store.get_hostname(), worker.hostname):
        config = ReplicateConfig(preferred_segment=target, with_hard_pin=True,
                                 soft_pin_action=SoftPinAction.ENABLE)
        key = f"on-{target}"
        assert store.put(key, pattern(7, 5000), config) == 0
        assert replicas_of(master, key) == [target]
        assert store.get(key) == pattern(7, 5000)


def test_segment_in_a_running_agent(agent_process: Callable[..., Any],
                                    master: MasterProcess) -> None:
    """agent=: the client's segment is allocated in a running hixl-agent (this process
    serves nothing), and released on close."""
    agent = agent_process()
    store = new_store(master, agent=agent.engine)
    try:
        assert store.get_hostname() == agent.engine
        value = pattern(11, 3 * MiB)
        assert store.put("in-agent", value) == 0
        assert replicas_of(master, "in-agent") == [agent.engine]
        assert store.get("in-agent") == value
    finally:
        store.close()
    with MasterClient(master.target, timeout=GIVE_UP_S) as client:
        assert client.list_segments() == []
