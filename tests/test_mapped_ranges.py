"""Ranges registered inside one `malloc_mem` allocation, as HIXL users lay out KV caches:
mapped by same-node peers (fd + offset, only the pages holding each range), bounded to
the range, withdrawn the moment the owner deregisters them, and safe while threads copy
through them as the owner deregisters or the initiator disconnects.

The owner is a real Hixl engine in its own process (tests/helpers/range_owner.py); the
initiator is an Engine in this process, so its mappings (/proc/self/maps) can be read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import hixl
from hixl import Engine, HixlError, TransferOp, TransferOpDesc
from hixl.errors import NotConnected, OutOfRange, ParamInvalid
from hixl.memory import PAGE_SIZE, round_up
from hixl.processes import free_port

HELPER = Path(__file__).parent / "helpers" / "range_owner.py"
MiB = 1 << 20
POOL = 32 * MiB
FABRIC_ON = {hixl.OPTION_ENABLE_USE_FABRIC_MEM: "1"}


class Owner:
    """The target process: one pool, ranges registered inside it on command."""

    def __init__(self, pool: int = POOL, fabric: str = "1") -> None:
        self.name = f"127.0.0.1:{free_port()}"
        self.proc = subprocess.Popen([sys.executable, str(HELPER), self.name, str(pool), fabric],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        assert line, "the owner engine did not start"
        hello = json.loads(line)
        self.pool: int = hello["pool"]
        self.pid: int = hello["pid"]
        self.killed = False  # set by a test that kills it on purpose
        self._lock = threading.Lock()

    def ask(self, **step: Any) -> dict[str, Any]:
        with self._lock:
            self.proc.stdin.write(json.dumps(step) + "\n")  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
            line = self.proc.stdout.readline()  # type: ignore[union-attr]
        assert line, f"the owner died answering {step}"
        return json.loads(line)

    def register(self, offset: int, length: int) -> int:
        reply = self.ask(do="register", offset=offset, length=length)
        assert reply["ret"] == hixl.SUCCESS, reply
        return reply["addr"]

    def digest(self, offset: int, length: int) -> str:
        return self.ask(do="digest", offset=offset, length=length)["sha256"]

    def close(self) -> None:
        self.proc.stdin.close()  # type: ignore[union-attr]
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise


@pytest.fixture
def owner() -> Iterator[Owner]:
    target = Owner()
    try:
        yield target
    finally:
        target.close()
    assert target.killed or target.proc.returncode == 0


@pytest.fixture
def initiator() -> Iterator[Engine]:
    with Engine("127.0.0.1", FABRIC_ON) as engine:
        yield engine


def pattern(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def sha(data: np.ndarray) -> str:
    return hashlib.sha256(data.tobytes()).hexdigest()


def owner_mappings(pid: int) -> int:
    """Bytes of the owner's memfd pool this process has mapped (its /proc/self/maps)."""
    total = 0
    for line in Path("/proc/self/maps").read_text().splitlines():
        if f"/memfd:hixl-{pid} " in line + " ":
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            total += hi - lo
    return total


# offsets chosen off page boundaries, several per allocation, one KV block among them
RANGES = [(1 * MiB + 100, 8784 << 10), (12 * MiB, 4096), (12 * MiB + 4096 + 7, 1000),
          (20 * MiB - 3, 64 << 10)]


def test_ranges_inside_one_allocation_are_mapped_and_only_the_ranges_are_reached(
        owner: Owner, initiator: Engine) -> None:
    owner.ask(do="fill", offset=0, length=POOL, byte=0xC3)  # canary everywhere
    addrs = [owner.register(offset, length) for offset, length in RANGES]
    initiator.connect(owner.name, 10)
    for addr in addrs:
        route = initiator.route(owner.name, addr)
        assert route == "fabric" and route.reason == ""
    biggest = max(length for _, length in RANGES)
    local, back = pattern(1, biggest), np.zeros(biggest, np.uint8)
    initiator.register(local)
    initiator.register(back)
    for (offset, length), addr in zip(RANGES, addrs, strict=True):
        initiator.write(owner.name, local, addr, length)
        assert owner.digest(offset, length) == sha(local[:length])
        back[:] = 0
        initiator.read(owner.name, back, addr, length)
        assert (back[:length] == local[:length]).all()
    # the bytes between and around the ranges are untouched
    edges = sorted([0, POOL] + [x for offset, length in RANGES for x in (offset, offset + length)])
    canary = np.full(POOL, 0xC3, np.uint8)
    for lo, hi in zip(edges[0::2], edges[1::2], strict=True):
        if hi > lo:
            assert owner.digest(lo, hi - lo) == sha(canary[lo:hi]), (lo, hi)
    # one byte past a range is refused before anything moves, although its page is mapped
    offset, length = RANGES[2]
    before = owner.digest(offset - 7, length + 14)
    for op in (TransferOp.WRITE, TransferOp.READ):
        with pytest.raises(OutOfRange, match="crosses the end of its segment|not inside"):
            initiator.transfer(owner.name, op, [TransferOpDesc(local.ctypes.data, addrs[2], length + 1)])
        with pytest.raises(OutOfRange, match="not inside any registered segment"):
            initiator.transfer(owner.name, op, [TransferOpDesc(local.ctypes.data, addrs[2] - 1, 1)])
    assert owner.digest(offset - 7, length + 14) == before
    # only the pages holding the ranges are mapped here, never the 32 MiB allocation
    spans = sum(round_up(offset % PAGE_SIZE + length) for offset, length in RANGES)
    assert 0 < owner_mappings(owner.pid) <= spans < POOL // 2


def test_ranges_registered_and_deregistered_in_any_order(owner: Owner, initiator: Engine) -> None:
    initiator.connect(owner.name, 10)
    source = pattern(2, 64 << 10)
    local = np.zeros_like(source)
    initiator.register(local)
    live: dict[int, int] = {}
    rng = np.random.default_rng(3)
    sizes = {i * MiB + int(rng.integers(0, 4096)): int(rng.integers(1, 64 << 10)) for i in range(16)}
    offsets = sorted(sizes)
    for round_ in range(40):
        offset = offsets[int(rng.integers(0, len(offsets)))]
        if offset in live:
            assert owner.ask(do="deregister", offset=offset)["ret"] == hixl.SUCCESS
            addr = live.pop(offset)
            with pytest.raises((ParamInvalid, OutOfRange)):  # withdrawn at once: nothing written
                initiator.write(owner.name, local, addr, sizes[offset])
        else:
            live[offset] = owner.register(offset, sizes[offset])
        local[:] = np.roll(source, round_)  # new bytes each round: a stale write would show
        for live_offset, addr in live.items():
            size = sizes[live_offset]
            initiator.write(owner.name, local, addr, size)
            assert initiator.route(owner.name, addr) == "fabric"
            assert owner.digest(live_offset, size) == sha(local[:size])


def test_hixl_user_flow_a_deregistered_range_takes_no_more_writes(owner: Owner) -> None:
    """The issue's scenario: two regions, write to the second, owner deregisters it."""
    first = owner.register(0, 1 * MiB)
    second_alloc = owner.ask(do="malloc", size=4 * MiB)
    assert second_alloc["ret"] == hixl.SUCCESS
    second_offset = second_alloc["addr"] + 1 * MiB - owner.pool
    second = owner.register(second_offset, 1 * MiB)
    client = hixl.Hixl()
    assert client.initialize("127.0.0.1", FABRIC_ON) == hixl.SUCCESS
    try:
        local = pattern(4, 1 * MiB)
        ret, _ = client.register_mem(hixl.MemDesc(local.ctypes.data, local.nbytes), hixl.MemType.MEM_HOST)
        assert ret == hixl.SUCCESS
        assert client.connect(owner.name, 5000) == hixl.SUCCESS
        put = [TransferOpDesc(local.ctypes.data, second, 4096)]
        assert client._engine.route(owner.name, second) == "fabric"  # type: ignore[union-attr]
        assert client.transfer_sync(owner.name, TransferOp.WRITE, put, 5000) == hixl.SUCCESS
        assert owner.ask(do="deregister", offset=second_offset)["ret"] == hixl.SUCCESS
        for _ in range(3):  # right after, and again: never SUCCESS into withdrawn memory
            assert client.transfer_sync(owner.name, TransferOp.WRITE, put, 5000) == hixl.PARAM_INVALID
            assert "deregistered" in str(client.last_error) or \
                "not inside any registered segment" in str(client.last_error)
        # the sibling region is unaffected; registering the range again serves it again
        assert client.transfer_sync(owner.name, TransferOp.WRITE,
                                    [TransferOpDesc(local.ctypes.data, first, 4096)], 5000) == hixl.SUCCESS
        assert owner.register(second_offset, 1 * MiB) == second
        assert client.transfer_sync(owner.name, TransferOp.WRITE, put, 5000) == hixl.SUCCESS
        assert owner.digest(second_offset, 4096) == sha(local[:4096])
    finally:
        client.finalize()


def test_bad_ranges_get_typed_errors_naming_the_range_and_change_nothing(owner: Owner,
                                                                         initiator: Engine) -> None:
    addr = owner.register(2 * MiB, 64 << 10)
    initiator.connect(owner.name, 10)
    local = pattern(5, 64 << 10)
    initiator.register(local)
    initiator.write(owner.name, local, addr)

    def refused(reply: dict[str, Any], *words: str) -> None:
        assert reply["ret"] == hixl.PARAM_INVALID, reply
        for word in words:
            assert word in reply["error"], reply

    # overlapping another range of the same allocation
    refused(owner.ask(do="register", offset=2 * MiB + 4096, length=4096), "overlaps",
            f"{owner.pool + 2 * MiB:#x}")
    # running past the allocation's end
    refused(owner.ask(do="register", offset=POOL - 100, length=4096), "runs past",
            f"{owner.pool + POOL - 100:#x}")
    # freeing the allocation while a range inside it is registered
    refused(owner.ask(do="free", addr=owner.pool), "still has 1 registered range",
            f"{addr:#x}")
    # HIXL's DeregisterMem is idempotent (REFERENCE.md); Engine.deregister says so instead
    assert owner.ask(do="deregister", offset=2 * MiB)["ret"] == hixl.SUCCESS
    assert owner.ask(do="deregister", offset=2 * MiB)["ret"] == hixl.SUCCESS  # a no-op
    with Engine("127.0.0.1:0", FABRIC_ON) as engine:
        pool = engine.malloc(4 * MiB)
        handle = engine.register(pool.addr + 100, 4096)
        engine.deregister(handle)
        with pytest.raises(ParamInvalid, match=f"\\[{handle.addr:#x}, \\+4096\\) is not registered"):
            engine.deregister(handle)
        with pytest.raises(OutOfRange, match="runs past its malloc_mem allocation"):
            engine.register(pool.addr - 4096, 8192)  # starts before it, ends inside
        engine.free(pool)
    # the other ranges still serve, byte for byte
    other = owner.register(8 * MiB + 5, 64 << 10)
    initiator.write(owner.name, local, other)
    assert owner.digest(8 * MiB + 5, 64 << 10) == sha(local)


def test_unmappable_memory_is_said_once_and_route_says_why(owner: Owner, initiator: Engine,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    plain = owner.ask(do="register_plain", length=4096)
    assert plain["ret"] == hixl.SUCCESS
    mapped = owner.register(0, 4096)
    initiator.connect(owner.name, 10)
    route = initiator.route(owner.name, plain["addr"])
    assert route == "unix" and "malloc_mem" in route.reason and "not shared memory" in route.reason
    local = pattern(6, 4096)
    initiator.register(local)
    with caplog.at_level(logging.WARNING, logger="hixl.engine"):
        for _ in range(3):
            initiator.write(owner.name, local, plain["addr"])
            initiator.write(owner.name, local, mapped)
    told = [r for r in caplog.records if "not the mapped one" in r.getMessage()]
    assert len(told) == 1 and f"{plain['addr']:#x}" in told[0].getMessage()
    with Engine("127.0.0.1", {hixl.OPTION_ENABLE_USE_FABRIC_MEM: "0"}) as off:
        off.connect(owner.name, 10)
        route = off.route(owner.name, mapped)
        assert route == "unix" and "EnableUseFabricMem is '0'" in route.reason


# ---------------------------------------------------------------- under concurrent change


def _hammer(engine: Engine, remote: str, jobs: list[tuple[int, int]], local: np.ndarray,
            stop: threading.Event, log_: list[tuple[float, float, int, str]]) -> None:
    """Write then read back each (addr, length) until told to stop; record (start time,
    end time, addr, outcome), outcome "ok", "corrupt" or the HixlError class name."""
    back = np.zeros_like(local)
    engine.register(back)
    i = 0
    while not stop.is_set():
        addr, length = jobs[i % len(jobs)]
        i += 1
        start = time.monotonic()
        try:
            engine.write(remote, local, addr, length)
            engine.read(remote, back, addr, length)
            outcome = "ok" if (back[:length] == local[:length]).all() else "corrupt"
        except HixlError as exc:
            outcome = type(exc).__name__
        log_.append((start, time.monotonic(), addr, outcome))


def test_owner_deregisters_a_range_while_threads_write_it_and_its_sibling(owner: Owner) -> None:
    sibling = owner.register(4 * MiB, 256 << 10)
    victim_offset = 4 * MiB + (256 << 10)
    with Engine("127.0.0.1", FABRIC_ON) as engine:
        engine.connect(owner.name, 10)
        stop = threading.Event()
        logs: list[list[tuple[float, float, int, str]]] = [[] for _ in range(3)]
        locals_ = [pattern(10 + i, 256 << 10) for i in range(3)]
        for buf in locals_:
            engine.register(buf)
        withdrawn: list[tuple[float, float]] = []  # per round: (deregistered, registered again)
        victim = owner.register(victim_offset, 256 << 10)
        threads = [threading.Thread(target=_hammer, args=(
            engine, owner.name, jobs, locals_[i], stop, logs[i]))
            for i, jobs in enumerate([[(sibling, 128 << 10)], [(victim, 128 << 10)],
                                      [(victim + (192 << 10), 4096),
                                       (sibling + (192 << 10), 4096)]])]
        for thread in threads:
            thread.start()
        try:
            for _ in range(8):
                time.sleep(0.05)  # let the threads copy through the range for a moment
                assert owner.ask(do="deregister", offset=victim_offset)["ret"] == hixl.SUCCESS
                returned = time.monotonic()
                time.sleep(0.05)
                withdrawn.append((returned, time.monotonic()))
                assert owner.register(victim_offset, 256 << 10) == victim
        finally:
            stop.set()
            for thread in threads:
                thread.join(30)
        assert not any(thread.is_alive() for thread in threads)
    everything = [entry for log_ in logs for entry in log_]
    assert all(outcome in ("ok", "ParamInvalid", "OutOfRange") for *_, outcome in everything), \
        sorted({outcome for *_, outcome in everything})
    sibling_ops = [o for _, _, addr, o in everything if sibling <= addr < sibling + (256 << 10)]
    assert sibling_ops and set(sibling_ops) == {"ok"}  # the sibling never noticed
    # a transfer made wholly after a deregistration returned and before the range was
    # registered again failed (one that overlaps the re-registration may succeed)
    victim_ops = [(t0, t1, o) for t0, t1, addr, o in everything
                  if victim <= addr < victim + (256 << 10)]
    for returned, comeback in withdrawn:
        during = [o for t0, t1, o in victim_ops if returned < t0 and t1 < comeback]
        assert during and "ok" not in during, during
    assert "ok" in {o for *_, o in victim_ops}  # and it served again after each comeback


def test_disconnect_while_threads_copy_never_unmaps_under_them(owner: Owner) -> None:
    addr = owner.register(0, 16 * MiB)  # 8 MiB ops take the parallel copy path
    with Engine("127.0.0.1", FABRIC_ON) as engine:
        engine.connect(owner.name, 10)
        big, small = pattern(20, 8 * MiB), pattern(21, 4096)
        engine.register(big)
        engine.register(small)
        stop = threading.Event()
        logs: list[list[tuple[float, float, int, str]]] = [[] for _ in range(3)]
        jobs = [[(addr, 8 * MiB)], [(addr + 8 * MiB + 4096 * i, 4096) for i in range(64)],
                [(addr + 12 * MiB, 4096)]]  # disjoint: each thread checks its own bytes
        threads = [threading.Thread(target=_hammer, args=(
            engine, owner.name, jobs[i], big if i == 0 else small, stop, logs[i]))
            for i in range(3)]
        for thread in threads:
            thread.start()
        try:
            for _ in range(30):
                engine.disconnect(owner.name)
                engine.connect(owner.name, 10)
        finally:
            stop.set()
            for thread in threads:
                thread.join(30)
        assert not any(thread.is_alive() for thread in threads)
        outcomes = {outcome for log_ in logs for *_, outcome in log_}
        assert outcomes <= {"ok", "NotConnected"}, outcomes
        assert "corrupt" not in outcomes
        # afterwards the path is whole again
        engine.write(owner.name, big, addr)
        assert owner.digest(0, 8 * MiB) == sha(big)


def test_owner_killed_while_threads_copy_gives_typed_errors(owner: Owner) -> None:
    addr = owner.register(0, 1 * MiB)
    with Engine("127.0.0.1", FABRIC_ON) as engine:
        engine.connect(owner.name, 10)
        local = pattern(30, 1 * MiB)
        engine.register(local)
        stop = threading.Event()
        logs: list[list[tuple[float, float, int, str]]] = [[] for _ in range(2)]
        threads = [threading.Thread(target=_hammer, args=(
            engine, owner.name, [(addr, 1 * MiB), (addr + 4096, 4096)], local, stop, logs[i]))
            for i in range(2)]
        for thread in threads:
            thread.start()
        try:
            time.sleep(0.1)
            owner.killed = True
            owner.proc.kill()
            owner.proc.wait(10)
            killed = time.monotonic()
            time.sleep(0.2)
        finally:
            stop.set()
            for thread in threads:
                thread.join(30)
        after = {o for log_ in logs for t, _, _, o in log_ if t > killed}
        assert after and "ok" not in after and "corrupt" not in after, after
        with pytest.raises((NotConnected, HixlError)):
            engine.write(owner.name, local, addr)


def test_a_numpy_view_into_malloc_memory_is_a_mapped_range(initiator: Engine) -> None:
    """Engine users register buffer objects: a numpy view into Engine.malloc memory is a
    range of that allocation like a raw (addr, len), and is mapped by peers."""
    with Engine(f"127.0.0.1:{free_port()}", FABRIC_ON) as owner_engine:
        pool = owner_engine.malloc(4 * MiB)
        layer = np.frombuffer(pool.view(), np.uint8)[MiB + 64:2 * MiB]
        owner_engine.register(layer)
        initiator.connect(owner_engine.name, 10)
        assert initiator.route(owner_engine.name, layer.ctypes.data) == "fabric"
        local = pattern(40, layer.nbytes)
        initiator.register(local)
        initiator.write(owner_engine.name, local, layer.ctypes.data)
        assert (layer == local).all()
        with pytest.raises(ParamInvalid, match="still has 1 registered range"):
            owner_engine.free(pool)
        initiator.disconnect(owner_engine.name)


def test_with_a_registry_a_deregistered_range_is_refused_at_once_and_served_again(
        owner: Owner) -> None:
    """Registry mode: the initiator follows the owner's embedded registry. A withdrawn
    range is refused at once (by its liveness word, or by the view if the watch came
    first); a range registered again is served as soon as the view has it."""
    offset = 3 * MiB + 40
    addr = owner.register(offset, 64 << 10)
    with Engine("127.0.0.1", FABRIC_ON, registry=owner.name) as engine:
        engine.connect(owner.name, 10)
        local = pattern(50, 64 << 10)
        engine.register(local)
        engine.write(owner.name, local, addr)
        assert engine.route(owner.name, addr) == "fabric"
        assert owner.ask(do="deregister", offset=offset)["ret"] == hixl.SUCCESS
        with pytest.raises((ParamInvalid, OutOfRange)):
            engine.write(owner.name, local, addr)
        table = engine.global_table
        assert table.wait_for(lambda t: not any(s.base == addr for s in t.segments(owner.name)), 10)
        with pytest.raises(OutOfRange):
            engine.write(owner.name, local, addr)
        assert owner.register(offset, 64 << 10) == addr
        assert table.wait_for(lambda t: any(s.base == addr for s in t.segments(owner.name)), 10)
        engine.write(owner.name, local, addr)
        assert owner.digest(offset, 64 << 10) == sha(local)
