"""Striping: a large batch spread over several pooled TCP connections at once.

A real DataServer over real shm segments; every byte is checked, and the server's
connection counter shows how many streams a transfer used. No timing assertions: deadlines
here only prove that nothing hangs.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import random_items

from hixl import errors, wire
from hixl.memory import ShmSegment
from hixl.server.agent.data_server import DataServer
from hixl.transports.base import Item
from hixl.transports.tcp import STRIPES, SocketTransport, _lane_bounds
from hixl.types import MemType, Perm, SegmentInfo, TransferOp

EPOCH = 3
MIB = 1 << 20


class Served:
    """Segments a DataServer serves; `broken` segment ids make the server's thread fail."""

    def __init__(self) -> None:
        self.table: dict[int, wire.ServedSegment] = {}
        self.shm: dict[int, ShmSegment] = {}
        self.broken: set[int] = set()

    def add(self, segment_id: int, size: int) -> SegmentInfo:
        shm = ShmSegment(size)
        shm.view()[:] = random.Random(segment_id).randbytes(size)
        self.shm[segment_id] = shm
        self.table[segment_id] = wire.ServedSegment(segment_id, EPOCH, shm.addr, shm.length,
                                                    Perm.RW, shm.view())
        return SegmentInfo(segment_id, "agent", "node", shm.addr, shm.length,
                           MemType.MEM_HOST, Perm.RW, EPOCH, False)

    def resolve(self, segment_id: int) -> wire.ServedSegment | None:
        if segment_id in self.broken:
            raise RuntimeError("simulated agent failure on this connection")
        return self.table.get(segment_id)

    def bytes_of(self, segment_id: int) -> bytes:
        return bytes(self.shm[segment_id].view())


@pytest.fixture
def served() -> Served:
    return Served()


@pytest.fixture
def server(served: Served, tmp_path: Path) -> Iterator[DataServer]:
    srv = DataServer(served.resolve, EPOCH, unix_path=str(tmp_path / "data.sock"))
    srv.start()
    yield srv
    srv.stop()


def deadline(seconds: float = 30.0) -> float:
    return time.monotonic() + seconds


def test_lane_bounds_cover_the_batch_in_order() -> None:
    assert _lane_bounds(10 * MIB, 1) == [0, 10 * MIB]
    for total in (1, 4097, 5 * MIB + 3, 64 * MIB):
        for lanes in (2, 3, 4):
            bounds = _lane_bounds(total, lanes)
            assert len(bounds) == lanes + 1 and bounds[0] == 0 and bounds[-1] == total
            assert bounds == sorted(bounds)
            assert all(b % (64 << 10) == 0 for b in bounds[1:-1])


@pytest.mark.parametrize("frame_limit", [wire.MAX_PAYLOAD, 300_000])
def test_striped_write_and_read_move_every_byte(served: Served, server: DataServer,
                                                frame_limit: int) -> None:
    """Random ops (cut at lane boundaries and frame limits) go out over 3 streams and back."""
    info = served.add(1, 24 * MIB)
    local, back = ShmSegment(24 * MIB), ShmSegment(24 * MIB)
    local.view()[:] = os.urandom(local.length)
    rng = random.Random(frame_limit)
    items = random_items(rng, info, local, 40, 900_000, max_gap=5000)
    assert sum(item.length for item in items) > 8 * MIB
    transport = SocketTransport(f"tcp://{server.tcp_address}", stripes=3,
                                stripe_min_bytes=2 * MIB, frame_limit=frame_limit)
    try:
        expected = bytearray(served.bytes_of(1))
        transport.transfer(TransferOp.WRITE, items, deadline())
        for item in items:
            at, near = item.remote_addr - info.base, item.local_addr - local.addr
            expected[at:at + item.length] = local.view()[near:near + item.length]
        assert served.bytes_of(1) == bytes(expected)
        assert server.counters["connections"] == 3  # striped: three streams at once
        reads = [Item(item.index, back.addr + (item.local_addr - local.addr), info,
                      item.remote_addr, item.length) for item in items]
        transport.transfer(TransferOp.READ, reads, deadline())
        for item in items:
            near = item.local_addr - local.addr
            assert back.view()[near:near + item.length] == local.view()[near:near + item.length]
        assert server.counters["connections"] == 3  # the same pooled streams again
        assert server.counters["bytes_written"] == server.counters["bytes_read"] == sum(
            item.length for item in items)
    finally:
        transport.close()


def test_small_batches_and_unix_sockets_use_one_stream(served: Served,
                                                       server: DataServer) -> None:
    info = served.add(1, 8 * MIB)
    local = ShmSegment(8 * MIB)
    small = [Item(i, local.addr + i * 4096, info, info.base + i * 4096, 4096) for i in range(256)]
    whole = [Item(0, local.addr, info, info.base, 8 * MIB)]
    tcp = SocketTransport(f"tcp://{server.tcp_address}")  # default: STRIPES over TCP
    try:
        for _ in range(3):
            tcp.transfer(TransferOp.WRITE, small, deadline())
        assert server.counters["connections"] == 1
    finally:
        tcp.close()
    assert STRIPES > 1
    thin = SocketTransport(f"tcp://{server.tcp_address}", stripes=3, stripe_min_bytes=1)
    try:  # 96 KiB is less than two 64 KiB lanes: one stream
        thin.transfer(TransferOp.WRITE, [Item(0, local.addr, info, info.base, 96 << 10)],
                      deadline())
        assert server.counters["connections"] == 2
    finally:
        thin.close()
    unix = SocketTransport(f"unix://{server.unix_path}")  # default: no striping on unix
    try:
        unix.transfer(TransferOp.WRITE, whole, deadline())
        unix.transfer(TransferOp.READ, whole, deadline())
        assert server.counters["connections"] == 3
    finally:
        unix.close()


def test_striping_never_takes_the_pools_last_free_connection(served: Served,
                                                             server: DataServer) -> None:
    info = served.add(1, 16 * MIB)
    local = ShmSegment(16 * MIB)
    transport = SocketTransport(f"tcp://{server.tcp_address}", max_connections=3, stripes=8,
                                stripe_min_bytes=MIB)
    try:
        transport.transfer(TransferOp.WRITE, [Item(0, local.addr, info, info.base, 16 * MIB)],
                           deadline())
        assert server.counters["connections"] == 2  # 3 allowed, one kept free
        assert served.bytes_of(1) == bytes(local.view())
    finally:
        transport.close()


def test_refusals_in_several_lanes_name_exactly_the_refused_ops(served: Served,
                                                                server: DataServer) -> None:
    info = served.add(1, 16 * MIB)
    local = ShmSegment(16 * MIB)
    local.view()[:] = os.urandom(local.length)
    ghost = SegmentInfo(99, "agent", "node", info.base, info.length, MemType.MEM_HOST, Perm.RW,
                        EPOCH, False)  # a segment the server does not have
    items = [Item(i, local.addr + i * MIB, ghost if i in (1, 6, 10) else info,
                  info.base + i * MIB, MIB) for i in range(12)]
    transport = SocketTransport(f"tcp://{server.tcp_address}", stripes=3, stripe_min_bytes=MIB)
    before = served.bytes_of(1)
    try:
        with pytest.raises(errors.HixlError, match="segment") as exc:
            transport.transfer(TransferOp.WRITE, items, deadline())
        assert exc.value.failed == [1, 6, 10]
        assert server.counters["connections"] == 3
        after = served.bytes_of(1)
        for i in range(12):
            want = before if i in (1, 6, 10) else bytes(local.view())
            assert after[i * MIB:(i + 1) * MIB] == want[i * MIB:(i + 1) * MIB], i
        # the lanes stayed in step: the same streams serve the next batch
        transport.transfer(TransferOp.WRITE, [it for it in items if it.segment is info],
                           deadline())
        assert server.counters["connections"] == 3
    finally:
        transport.close()


def test_one_broken_lane_fails_only_its_ops(served: Served, server: DataServer) -> None:
    """The agent drops the stream carrying ops 4-7; ops on the other lanes complete."""
    info = served.add(1, 12 * MIB)
    doomed = served.add(2, 12 * MIB)
    served.broken.add(2)
    local = ShmSegment(12 * MIB)
    local.view()[:] = os.urandom(local.length)
    items = [Item(i, local.addr + i * MIB, doomed if i == 5 else info, info.base + i * MIB, MIB)
             for i in range(12)]
    items[5].remote_addr = doomed.base + 5 * MIB
    transport = SocketTransport(f"tcp://{server.tcp_address}", stripes=3, stripe_min_bytes=MIB)
    try:
        with pytest.raises(errors.PeerUnavailable) as exc:
            transport.transfer(TransferOp.WRITE, items, deadline())
        failed = exc.value.failed
        assert 5 in failed and set(failed) <= {4, 5, 6, 7}, failed  # lane 1 only
        after = served.bytes_of(1)
        for i in [*range(4), *range(8, 12)]:
            assert after[i * MIB:(i + 1) * MIB] == bytes(local.view()[i * MIB:(i + 1) * MIB]), i
        # the broken stream was dropped; the transport goes on with fresh ones
        served.broken.clear()
        transport.transfer(TransferOp.READ, items, deadline())
    finally:
        transport.close()


def test_a_stalled_striped_transfer_fails_by_its_deadline(served: Served,
                                                          tmp_path: Path) -> None:
    info = served.add(1, 8 * MIB)
    entered, release = threading.Event(), threading.Event()

    def stalling(segment_id: int) -> wire.ServedSegment | None:
        entered.set()
        release.wait(30)
        return served.resolve(segment_id)

    srv = DataServer(stalling, EPOCH, unix_path=str(tmp_path / "s.sock"))
    srv.start()
    transport = SocketTransport(f"tcp://{srv.tcp_address}", stripes=3, stripe_min_bytes=MIB)
    local = ShmSegment(8 * MIB)
    try:
        for op in TransferOp:
            with pytest.raises(errors.TransferTimeout) as exc:
                transport.transfer(op, [Item(i, local.addr + i * MIB, info,
                                             info.base + i * MIB, MIB) for i in range(8)],
                                   time.monotonic() + 0.5)
            assert exc.value.failed == list(range(8))
        assert entered.is_set()
    finally:
        release.set()
        transport.close()
        srv.stop()


def test_close_during_a_striped_transfer_fails_it_as_not_connected(served: Served,
                                                                   tmp_path: Path) -> None:
    info = served.add(1, 8 * MIB)
    entered, release = threading.Event(), threading.Event()

    def stalling(segment_id: int) -> wire.ServedSegment | None:
        entered.set()
        release.wait(30)
        return served.resolve(segment_id)

    srv = DataServer(stalling, EPOCH, unix_path=str(tmp_path / "s.sock"))
    srv.start()
    transport = SocketTransport(f"tcp://{srv.tcp_address}", stripes=3, stripe_min_bytes=MIB)
    local = ShmSegment(8 * MIB)
    outcome: list[BaseException] = []

    def caller() -> None:
        try:
            transport.transfer(TransferOp.READ, [Item(0, local.addr, info, info.base, 8 * MIB)],
                               deadline())
        except BaseException as exc:  # checked below
            outcome.append(exc)

    thread = threading.Thread(target=caller)
    thread.start()
    try:
        assert entered.wait(30)
        transport.close()
        thread.join(30)
        assert not thread.is_alive()
        assert len(outcome) == 1 and isinstance(outcome[0], errors.NotConnected), outcome
        assert outcome[0].failed == [0]
    finally:
        release.set()
        srv.stop()


def test_concurrent_striped_transfers_keep_the_pool_bound(served: Served,
                                                          server: DataServer) -> None:
    info = served.add(1, 32 * MIB)
    transport = SocketTransport(f"tcp://{server.tcp_address}", max_connections=4, stripes=3,
                                stripe_min_bytes=MIB)
    problems: list[BaseException] = []
    chunk = 8 * MIB

    def worker(n: int) -> None:
        try:
            rng = random.Random(n)
            local, back = ShmSegment(chunk), ShmSegment(chunk)
            base = info.base + n * chunk
            for _ in range(3):
                local.view()[:] = rng.randbytes(chunk)
                pieces = rng.choice([1, 3, 16])
                size = chunk // pieces
                items = [Item(i, local.addr + i * size, info, base + i * size, size)
                         for i in range(pieces)]
                transport.transfer(TransferOp.WRITE, items, deadline(60))
                transport.transfer(TransferOp.READ, [Item(0, back.addr, info, base, chunk)],
                                   deadline(60))
                assert back.view()[:pieces * size] == local.view()[:pieces * size]
        except BaseException as exc:  # reported by the main thread
            problems.append(exc)

    workers = [threading.Thread(target=worker, args=(n,)) for n in range(4)]
    try:
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join(120)
        assert not any(thread.is_alive() for thread in workers)
        assert not problems, problems
        assert server.counters["connections"] <= 4  # never more streams than the pool allows
    finally:
        transport.close()
