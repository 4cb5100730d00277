"""The socket data path end to end: a real DataServer serving real shm segments, and
SocketTransport over both TCP and a unix socket. Every byte moved is checked."""

from __future__ import annotations

import contextlib
import fcntl
import os
import random
import re
import socket
import stat
import struct
import termios
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import random_items

from hixl import errors, wire
from hixl.memory import ShmSegment
from hixl.server.agent.data_server import DataServer
from hixl.transports import tcp
from hixl.transports.base import Item, ItemArrays
from hixl.transports.tcp import SocketTransport
from hixl.types import MemType, Perm, SegmentInfo, TransferOp

EPOCH = 5
SEG_SIZE = 1 << 20
FRAME = 64 << 10  # a small frame limit so splitting is exercised without 64 MiB buffers
#: the deadline of ops against a server that never answers in time (any deadline passes
#: there; a short one keeps these dozens of cases quick)
STALL_DEADLINE_S = 0.15


class Served:
    """The table a DataServer resolves against: real ShmSegments, changeable at will."""

    def __init__(self) -> None:
        self.table: dict[int, wire.ServedSegment] = {}
        self.shm: dict[int, ShmSegment] = {}

    def add(self, segment_id: int, size: int = SEG_SIZE, perms: Perm = Perm.RW,
            epoch: int = EPOCH) -> SegmentInfo:
        shm = ShmSegment(size)
        shm.view()[:] = random.Random(segment_id).randbytes(shm.length)
        self.shm[segment_id] = shm
        self.table[segment_id] = wire.ServedSegment(segment_id, epoch, shm.addr, shm.length,
                                                    perms, shm.view())
        return SegmentInfo(segment_id, "agent", "node", shm.addr, shm.length, MemType.MEM_HOST,
                           perms, epoch, False)

    def bytes_of(self, segment_id: int) -> bytes:
        return bytes(self.shm[segment_id].view())

    def resolve(self, segment_id: int) -> wire.ServedSegment | None:
        return self.table.get(segment_id)


@pytest.fixture(autouse=True, params=["python", "fastwire"])
def wire_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every test twice: the lone op in pure Python, and in C (hixl._fastwire) on both
    sides; read by each DataServer and SocketTransport when it is made."""
    if request.param == "python":
        monkeypatch.setattr(tcp, "FASTWIRE", None)
    elif tcp.FASTWIRE is None:
        pytest.skip("hixl._fastwire is not built here (or HIXL_FASTWIRE=0)")
    return request.param


@pytest.fixture
def served() -> Iterator[Served]:
    yield Served()


@pytest.fixture
def server(served: Served, tmp_path: Path) -> Iterator[DataServer]:
    srv = DataServer(served.resolve, EPOCH, unix_path=str(tmp_path / "data.sock"))
    srv.start()
    yield srv
    srv.stop()


def address_of(srv: DataServer, kind: str) -> str:
    return f"tcp://{srv.tcp_address}" if kind == "tcp" else f"unix://{srv.unix_path}"


@pytest.fixture(params=["tcp", "unix"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def connect(server: DataServer, kind: str) -> Iterator[Callable[..., SocketTransport]]:
    made: list[SocketTransport] = []

    def make(**options: object) -> SocketTransport:
        options.setdefault("frame_limit", FRAME)
        transport = SocketTransport(address_of(server, kind), identity="test", **options)
        made.append(transport)
        return transport

    yield make
    for transport in made:
        transport.close()


def deadline(seconds: float = 20.0) -> float:
    return time.monotonic() + seconds


def apply_write(expected: bytearray, info: SegmentInfo, local: ShmSegment,
                items: list[Item]) -> None:
    view = local.view()
    for item in items:
        offset = item.remote_addr - info.base
        local_offset = item.local_addr - local.addr
        expected[offset:offset + item.length] = view[local_offset:local_offset + item.length]


# ---------------------------------------------------------------- happy paths

def test_write_then_read_random_ranges_byte_for_byte(served: Served, connect, kind: str) -> None:
    info = served.add(1)
    rng = random.Random(kind)
    transport = connect()
    assert transport.name == kind
    local = ShmSegment(SEG_SIZE)
    for round_ in range(4):
        local.view()[:] = rng.randbytes(local.length)
        expected = bytearray(served.bytes_of(1))
        # sizes up to 3 frames, so some items are split; a batch per round
        items = random_items(rng, info, local, count=40, max_len=3 * FRAME // (round_ + 1))
        assert any(item.length > FRAME for item in items) or round_ > 1
        transport.transfer(TransferOp.WRITE, items, deadline())
        apply_write(expected, info, local, items)
        assert served.bytes_of(1) == bytes(expected)

        back = ShmSegment(SEG_SIZE)
        reads = [Item(item.index, back.addr + (item.local_addr - local.addr), info,
                      item.remote_addr, item.length) for item in items]
        transport.transfer(TransferOp.READ, reads, deadline())
        for item in items:
            offset = item.local_addr - local.addr
            assert bytes(back.view()[offset:offset + item.length]) == bytes(
                local.view()[offset:offset + item.length])
        untouched = bytearray(back.length)
        for item in items:
            offset = item.local_addr - local.addr
            untouched[offset:offset + item.length] = back.view()[offset:offset + item.length]
        assert bytes(back.view()) == bytes(untouched)  # nothing outside the read ranges
        back.close()


def test_ops_larger_than_the_protocol_frame_limit(served: Served, server: DataServer) -> None:
    """The real MAX_PAYLOAD split: one op of MAX_PAYLOAD + 4097 bytes each way."""
    size = wire.MAX_PAYLOAD + 4097
    info = served.add(1, size=size + 8192)
    local = ShmSegment(size)
    local.view()[:size] = os.urandom(size)
    transport = SocketTransport(address_of(server, "unix"))
    try:
        transport.transfer(TransferOp.WRITE, [Item(0, local.addr, info, info.base + 8192, size)],
                           deadline(60))
        assert served.shm[1].view()[8192:8192 + size] == local.view()[:size]
        back = ShmSegment(size)
        transport.transfer(TransferOp.READ, [Item(0, back.addr, info, info.base + 8192, size)],
                           deadline(60))
        assert back.view()[:size] == local.view()[:size]
    finally:
        transport.close()
    assert server.counters["ops_write"] == 2 and server.counters["ops_read"] == 2


def test_big_pipelined_batch_of_small_ops(served: Served, connect, server: DataServer) -> None:
    info = served.add(1, size=4 << 20)
    local = ShmSegment(2 << 20)
    local.view()[:] = os.urandom(local.length)
    transport = connect()
    # 2048 x 1 KiB writes, every other KiB of the segment, in one batch
    items = [Item(i, local.addr + i * 1024, info, info.base + i * 2048, 1024) for i in range(2048)]
    expected = bytearray(served.bytes_of(1))
    transport.transfer(TransferOp.WRITE, items, deadline())
    apply_write(expected, info, local, items)
    assert served.bytes_of(1) == bytes(expected)
    back = ShmSegment(2 << 20)
    transport.transfer(TransferOp.READ, [Item(i, back.addr + i * 1024, info, item.remote_addr,
                                              1024) for i, item in enumerate(items)], deadline())
    assert back.view()[:2048 * 1024] == local.view()[:2048 * 1024]
    # the agent counts requests: the scattered 1 KiB ops go as vector requests of the
    # 64 KiB frame limit, 32 each way
    assert server.counters["ops_write"] == 32 and server.counters["ops_read"] == 32
    assert server.counters["bytes_written"] == server.counters["bytes_read"] == 2048 * 1024


def test_concurrent_transfers_from_many_threads(served: Served, connect,
                                                server: DataServer) -> None:
    info = served.add(1, size=4 << 20)
    transport = connect(max_connections=3)
    threads_n, chunk = 8, (4 << 20) // 8
    problems: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            rng = random.Random(n)
            local, back = ShmSegment(chunk), ShmSegment(chunk)
            for _ in range(5):
                local.view()[:] = rng.randbytes(chunk)
                pieces = rng.choice([1, 7, 64])
                size = chunk // pieces
                base = info.base + n * chunk
                items = [Item(i, local.addr + i * size, info, base + i * size, size)
                         for i in range(pieces)]
                transport.transfer(TransferOp.WRITE, items, deadline(60))
                transport.transfer(TransferOp.READ, [Item(0, back.addr, info, base, chunk)],
                                   deadline(60))
                assert back.view()[:pieces * size] == local.view()[:pieces * size]
        except BaseException as exc:  # reported by the main thread
            problems.append(exc)

    workers = [threading.Thread(target=worker, args=(n,)) for n in range(threads_n)]
    for thread in workers:
        thread.start()
    for thread in workers:
        thread.join()
    assert not problems, problems
    assert server.counters["connections"] <= 3  # the pool bound held


def test_ping_and_pool_reuse(connect, server: DataServer) -> None:
    transport = connect()
    for _ in range(5):
        transport.ping(deadline())
    assert server.counters["connections"] == 1


# ---------------------------------------------------------------- refusals

def test_refused_items_leave_every_segment_byte_unchanged(served: Served, connect,
                                                          server: DataServer) -> None:
    rw = served.add(1)
    ro = served.add(2, perms=Perm.READ)
    wo = served.add(3, perms=Perm.WRITE)
    stale = SegmentInfo(1, "agent", "node", rw.base, rw.length, MemType.MEM_HOST, Perm.RW,
                        EPOCH - 1, False)
    ghost = SegmentInfo(77, "agent", "node", rw.base, rw.length, MemType.MEM_HOST, Perm.RW,
                        EPOCH, False)
    local = ShmSegment(SEG_SIZE)
    local.view()[:] = os.urandom(local.length)
    transport = connect()
    before = {sid: served.bytes_of(sid) for sid in (1, 2, 3)}
    batch = [
        Item(0, local.addr, rw, rw.base, 5000),  # fine
        Item(1, local.addr, ro, ro.base, 5000),  # read-only segment
        Item(2, local.addr, rw, rw.end - 4999, 5000),  # crosses the end by 1 byte
        Item(3, local.addr, stale, rw.base + 10_000, 100),  # stale epoch
        Item(4, local.addr, ghost, rw.base + 10_000, 100),  # unknown segment
        Item(5, local.addr, rw, rw.base + 3 * FRAME, 3 * FRAME),  # fine, split in 3
        Item(6, local.addr, rw, rw.end - 2 * FRAME, 2 * FRAME + 1),  # last frame crosses the end
    ]
    with pytest.raises(errors.PermissionDenied, match="does not allow writes") as info:
        transport.transfer(TransferOp.WRITE, batch, deadline())
    assert info.value.failed == [1, 2, 3, 4, 6]
    expected = bytearray(before[1])
    apply_write(expected, rw, local, [batch[0], batch[5]])
    # item 6: its first frames were in range and landed; the crossing frame did not
    expected[rw.length - 2 * FRAME:rw.length] = local.view()[:2 * FRAME]
    assert served.bytes_of(1) == bytes(expected)
    assert served.bytes_of(2) == before[2] and served.bytes_of(3) == before[3]
    assert server.counters["refused"] == 5

    # the stream stayed in step: the same (only) connection serves the next batch
    transport.transfer(TransferOp.WRITE, [Item(0, local.addr + 7, rw, rw.base, 64)], deadline())
    assert served.bytes_of(1)[:64] == bytes(local.view()[7:71])
    assert server.counters["connections"] == 1

    # READ refusals: a write-only segment, out of range; the local target stays as it was
    back = ShmSegment(SEG_SIZE)
    with pytest.raises(errors.PermissionDenied, match="does not allow reads") as info:
        transport.transfer(TransferOp.READ, [
            Item(0, back.addr, rw, rw.base, 64),
            Item(1, back.addr + 4096, wo, wo.base, 4096),
            Item(2, back.addr + 8192, rw, rw.base - 1, 10),
        ], deadline())
    assert info.value.failed == [1, 2]
    assert bytes(back.view()[:64]) == bytes(local.view()[7:71])
    assert bytes(back.view()[64:]) == bytes(back.length - 64)
    for sid in (2, 3):
        assert served.bytes_of(sid) == before[sid]


@pytest.mark.parametrize("error, words", [
    (errors.StaleEpoch, "stale"), (errors.OutOfRange, "outside"), (errors.ParamInvalid, "77"),
])
def test_first_refusal_decides_the_exception(served: Served, connect, error: type,
                                             words: str) -> None:
    rw = served.add(1)
    local = ShmSegment(4096)
    item = {
        errors.StaleEpoch: Item(0, local.addr, SegmentInfo(
            1, "a", "n", rw.base, rw.length, MemType.MEM_HOST, Perm.RW, EPOCH + 1, False),
            rw.base, 8),
        errors.OutOfRange: Item(0, local.addr, rw, rw.end, 8),
        errors.ParamInvalid: Item(0, local.addr, SegmentInfo(
            77, "a", "n", rw.base, rw.length, MemType.MEM_HOST, Perm.RW, EPOCH, False),
            rw.base, 8),
    }[error]
    transport = connect()
    for op in TransferOp:
        with pytest.raises(error, match=words) as info:
            transport.transfer(op, [item], deadline())
        assert info.value.failed == [0]


def test_segment_deregistered_between_batches(served: Served, connect) -> None:
    info = served.add(1)
    local = ShmSegment(4096)
    transport = connect()
    transport.transfer(TransferOp.WRITE, [Item(0, local.addr, info, info.base, 4096)], deadline())
    del served.table[1]
    with pytest.raises(errors.ParamInvalid, match="not served") as exc:
        transport.transfer(TransferOp.WRITE, [Item(3, local.addr, info, info.base, 4096)],
                           deadline())
    assert exc.value.failed == [3]


# ---------------------------------------------------------------- hostile or broken peers

def raw_connection(srv: DataServer, kind: str, *, hello: bool = True) -> socket.socket:
    if kind == "tcp":
        host, port = srv.tcp_address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=10)
    else:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(10)
        sock.connect(srv.unix_path)
    if hello:
        sock.sendall(wire.hello(1, b"raw"))
        assert wire.decode_header(recv_exactly(sock, wire.HEADER_SIZE)).epoch == EPOCH
    return sock


def recv_exactly(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            break
        data += chunk
    return data


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends before it closes (the socket timeout bounds the wait).

    A server closing with our bytes unread resets the stream, which also counts as closed.
    """
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


@pytest.mark.parametrize("garbage", ["random", "bad magic", "huge length", "reply"])
def test_garbage_client_is_disconnected_and_others_are_served(
        served: Served, server: DataServer, connect, kind: str, garbage: str) -> None:
    info = served.add(1)
    before = served.bytes_of(1)
    good = connect()
    good.ping(deadline())
    bad = raw_connection(server, kind, hello=garbage != "random")
    payload = {
        "random": random.Random(3).randbytes(5000),
        "bad magic": b"\x00\x01" + wire.write_header(2, 1, EPOCH, info.base, 8)[2:] + b"x" * 8,
        "huge length": wire.write_header(2, 1, EPOCH, info.base, 1 << 62) + b"x" * 4096,
        "reply": wire.ok_reply(2),
    }[garbage]
    with bad:
        bad.sendall(payload)
        data = read_until_closed(bad)  # the server closes it; the settimeout(10) bounds this
    if data:  # an error reply explains why
        header = wire.decode_header(data[:wire.HEADER_SIZE])
        assert header.flags & wire.FLAG_ERROR_TEXT
    assert served.bytes_of(1) == before
    local = ShmSegment(4096)
    local.view()[:] = os.urandom(4096)
    good.transfer(TransferOp.WRITE, [Item(0, local.addr, info, info.base, 4096)], deadline())
    assert served.bytes_of(1)[:4096] == bytes(local.view())
    assert server.counters["protocol_errors"] == 1


def test_stalled_payload_is_cut_off_but_idle_connections_live(served: Served, tmp_path: Path,
                                                              kind: str) -> None:
    info = served.add(1)
    before = served.bytes_of(1)
    srv = DataServer(served.resolve, EPOCH, unix_path=str(tmp_path / "s.sock"), io_timeout=0.2)
    with srv:
        idle = raw_connection(srv, kind)
        stalled = raw_connection(srv, kind)
        stalled.sendall(wire.write_header(2, 1, EPOCH, info.base, 4096) + b"x" * 100)
        assert read_until_closed(stalled) == b""  # cut off after io_timeout, no reply
        time.sleep(0.5)  # idle for longer than io_timeout: still served
        idle.sendall(wire.Header(wire.Op.PING, 9).pack())
        assert wire.decode_header(recv_exactly(idle, wire.HEADER_SIZE)).request_id == 9
        idle.close()
        stalled.close()
        assert srv.counters["protocol_errors"] == 1
    # the 100 bytes that came may have landed (a valid write, received in place); no more
    assert served.bytes_of(1)[100:] == before[100:]


@pytest.mark.parametrize("end", ["stall", "leave"])
def test_a_vector_payload_cut_short_ends_its_connection_and_no_other(
        served: Served, tmp_path: Path, kind: str, end: str) -> None:
    """A vector WRITE (two ranges) whose payload stops after its table and some bytes:
    stalled past io_timeout, or its peer gone. The agent (the C loop or Python's, per
    variant) ends that connection without a reply and counts a protocol error for the
    stall; another connection is served meanwhile and after; bytes past those that came
    never land."""
    info = served.add(1)
    before = served.bytes_of(1)
    srv = DataServer(served.resolve, EPOCH, unix_path=str(tmp_path / "s.sock"), io_timeout=0.2)
    with srv:
        other = raw_connection(srv, kind)
        cut = raw_connection(srv, kind)
        table = np.array([[info.base, 40_000], [info.base + 100_000, 40_000]], np.uint64)
        cut.sendall(wire.ClientProtocol().vector_table(wire.Op.WRITE, 1, EPOCH, table)
                    + b"x" * 1000)
        if end == "leave":
            cut.shutdown(socket.SHUT_WR)
        assert read_until_closed(cut) == b""
        other.sendall(wire.Header(wire.Op.PING, 9).pack())
        assert wire.decode_header(recv_exactly(other, wire.HEADER_SIZE)).request_id == 9
        other.close()
        cut.close()
        assert srv.counters["protocol_errors"] == (1 if end == "stall" else 0)
    after = served.bytes_of(1)
    assert after[1000:100_000] == before[1000:100_000] and after[100_000:] == before[100_000:]


def test_server_stopped_mid_transfer_fails_the_client_promptly(served: Served, tmp_path: Path,
                                                               kind: str) -> None:
    info = served.add(1, size=4 << 20)
    entered, release = threading.Event(), threading.Event()

    def slow_resolve(segment_id: int) -> wire.ServedSegment | None:
        entered.set()  # the transfer is in flight: the server is on its first frame
        release.wait(30)
        return served.resolve(segment_id)

    srv = DataServer(slow_resolve, EPOCH, unix_path=str(tmp_path / "s.sock"))
    srv.start()
    transport = SocketTransport(address_of(srv, kind), frame_limit=FRAME)
    local = ShmSegment(4 << 20)
    outcome: list[BaseException] = []

    def client() -> None:
        try:
            transport.transfer(TransferOp.WRITE, [Item(i, local.addr + i * FRAME, info,
                                                       info.base + i * FRAME, FRAME)
                                                  for i in range(64)], deadline(30))
        except BaseException as exc:
            outcome.append(exc)

    caller = threading.Thread(target=client)
    caller.start()
    assert entered.wait(30)
    stopper = threading.Thread(target=srv.stop)
    stopper.start()
    caller.join(30)  # the client fails as soon as the server shuts the stream
    release.set()
    stopper.join(30)
    assert not caller.is_alive() and not stopper.is_alive()
    transport.close()
    assert len(outcome) == 1 and isinstance(outcome[0], errors.PeerUnavailable), outcome
    assert outcome[0].failed == list(range(64))  # nothing was acknowledged


def test_stopped_server_closes_pooled_connections(served: Served, tmp_path: Path,
                                                  kind: str) -> None:
    info = served.add(1)
    path = str(tmp_path / "s.sock")
    srv = DataServer(served.resolve, EPOCH, unix_path=path)
    srv.start()
    transport = SocketTransport(address_of(srv, kind))
    local = ShmSegment(4096)
    transport.transfer(TransferOp.WRITE, [Item(0, local.addr, info, info.base, 64)], deadline())
    srv.stop()
    assert srv.live_connections == 0
    assert not os.path.exists(path)
    # the pooled connection is seen dead; a fresh connect is refused: PeerUnavailable
    with pytest.raises(errors.PeerUnavailable, match="cannot connect") as exc:
        transport.transfer(TransferOp.WRITE, [Item(4, local.addr, info, info.base, 64)],
                           deadline())
    assert exc.value.failed == [4]
    transport.close()


@pytest.mark.parametrize("op", [TransferOp.WRITE, TransferOp.READ])
def test_single_op_on_a_pooled_connection_the_server_closed_runs_on_a_fresh_one(
        served: Served, tmp_path: Path, kind: str, op: TransferOp) -> None:
    """A lone op takes a pooled connection without polling it first; one the server
    closed while it sat idle (here: the server stopped and a new one took its address)
    fails before any reply, and the op runs once more on a fresh connection: the caller
    sees success and exactly its bytes moved."""
    info = served.add(1)
    path = str(tmp_path / "s.sock")
    first = DataServer(served.resolve, EPOCH, unix_path=path)
    first.start()
    port = int(first.tcp_address.rsplit(":", 1)[1])
    transport = SocketTransport(address_of(first, kind))
    local = ShmSegment(8192)
    local.view()[:] = random.Random(7).randbytes(8192)
    transport.transfer(TransferOp.WRITE, [Item(0, local.addr, info, info.base, 64)], deadline())
    first.stop()
    second = DataServer(served.resolve, EPOCH, unix_path=path, tcp_port=port)
    second.start()
    try:
        before = served.bytes_of(1)
        transport.transfer(op, [Item(3, local.addr + 4096, info, info.base + 8192, 4096)],
                           deadline())
        after = served.bytes_of(1)
        if op == TransferOp.WRITE:
            assert after[8192:12288] == bytes(local.view()[4096:8192])
            assert after[:8192] == before[:8192] and after[12288:] == before[12288:]
        else:
            assert bytes(local.view()[4096:8192]) == before[8192:12288] == after[8192:12288]
        assert second.counters["connections"] == 1  # the fresh one; the op ran there once
        assert second.counters["ops_write" if op == TransferOp.WRITE else "ops_read"] == 1
    finally:
        transport.close()
        second.stop()


def silent_listener(kind: str, tmp_path: Path, *, mode: str) -> tuple[str, Callable]:
    """A server that accepts and then never replies ("silent"), answers only the HELLO
    ("after-hello"), or answers everything a byte per 20 ms ("trickle")."""
    if kind == "tcp":
        listener = socket.create_server(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    else:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(tmp_path / "silent.sock"))
        listener.listen()
        address = f"unix://{tmp_path / 'silent.sock'}"
    accepted: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return  # closed by cleanup
            accepted.append(conn)
            if mode == "silent":
                continue
            header = wire.decode_header(recv_exactly(conn, wire.HEADER_SIZE))
            recv_exactly(conn, header.length)
            conn.sendall(wire.Header(wire.Op.REPLY, header.request_id, epoch=EPOCH).pack())
            if mode == "trickle":
                threading.Thread(target=trickle, args=(conn,), daemon=True).start()

    def trickle(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while header := recv_exactly(conn, wire.HEADER_SIZE):
                for byte in wire.ok_reply(wire.decode_header(header).request_id):
                    conn.sendall(bytes([byte]))
                    time.sleep(0.02)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    def cleanup() -> None:
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join(10)
        for conn in accepted:
            conn.close()

    return address, cleanup


@pytest.mark.parametrize("mode", ["silent", "after-hello", "trickle"])
def test_deadline_passes_while_server_stalls(served: Served, tmp_path: Path, kind: str,
                                             mode: str) -> None:
    info = served.add(1)
    address, cleanup = silent_listener(kind, tmp_path, mode=mode)
    transport = SocketTransport(address, connect_timeout=30)
    local = ShmSegment(1 << 20)
    items = [Item(i, local.addr, info, info.base, 1 << 20 if mode != "trickle" else 8)
             for i in (2, 5, 9)]
    try:
        for op in TransferOp:
            with pytest.raises(errors.TransferTimeout, match=re.escape(address)) as exc:
                transport.transfer(op, items, time.monotonic() + STALL_DEADLINE_S)
            assert exc.value.failed == [2, 5, 9]
        with pytest.raises(errors.TransferTimeout, match=re.escape(address)):
            transport.ping(time.monotonic() + STALL_DEADLINE_S)
    finally:
        transport.close()
        cleanup()


@pytest.mark.parametrize("mode", ["silent", "after-hello", "trickle"])
def test_single_op_deadline_passes_while_server_stalls(served: Served, tmp_path: Path,
                                                       kind: str, mode: str) -> None:
    """A lone small op takes the blocking path; its waits are bounded by the deadline too,
    also when the reply trickles in (each blocking read is re-armed with what is left)."""
    info = served.add(1)
    address, cleanup = silent_listener(kind, tmp_path, mode=mode)
    transport = SocketTransport(address, connect_timeout=30)
    local = ShmSegment(1 << 16)
    try:
        for op in TransferOp:
            for size in (8, 1 << 16):
                with pytest.raises(errors.TransferTimeout, match=re.escape(address)) as exc:
                    transport.transfer(op, [Item(7, local.addr, info, info.base, size)],
                                       time.monotonic() + STALL_DEADLINE_S)
                assert exc.value.failed == [7]
    finally:
        transport.close()
        cleanup()


def scripted_server(kind: str, tmp_path: Path, answer: Callable[[socket.socket, wire.Header], None]
                    ) -> tuple[str, Callable[[], None]]:
    """A server that answers HELLO, then calls `answer(conn, header)` for each request
    (after reading a WRITE's payload)."""
    if kind == "tcp":
        listener = socket.create_server(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{listener.getsockname()[1]}"
    else:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(tmp_path / "scripted.sock"))
        listener.listen()
        address = f"unix://{tmp_path / 'scripted.sock'}"

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:  # the listener was shut down: the test is over
                return
            # a client that writes to a connection this server left gets a reset: that
            # connection is over, the next one is served
            with conn, contextlib.suppress(OSError):
                while raw := recv_exactly(conn, wire.HEADER_SIZE):
                    header = wire.decode_header(raw)
                    if header.opcode in (wire.Op.HELLO, wire.Op.WRITE):
                        recv_exactly(conn, header.length)
                    if header.opcode == wire.Op.HELLO:
                        conn.sendall(wire.Header(wire.Op.REPLY, header.request_id,
                                                 epoch=EPOCH).pack())
                    else:
                        answer(conn, header)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    def cleanup() -> None:
        with contextlib.suppress(OSError):
            listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        thread.join(10)

    return address, cleanup


@pytest.mark.parametrize("reply, error, words", [
    (lambda h: wire.ok_reply(h.request_id + 1), errors.TransferFailed, "expected"),
    (lambda h: wire.ok_reply(h.request_id, 3), errors.TransferFailed, "payload|3 bytes"),
    (lambda h: b"", errors.PeerUnavailable, "closed"),
    (lambda h: wire.ok_reply(h.request_id)[:20], errors.PeerUnavailable, "closed"),
    # stray bytes after an error reply: seen when a small READ's reply is read whole
    (lambda h: wire.error_reply(h.request_id, wire.Reason.OUT_OF_RANGE, "x") + b"??",
     (errors.OutOfRange, errors.TransferFailed), "x|after an error reply"),
])
def test_single_op_bad_or_missing_reply_breaks_the_stream(
        served: Served, tmp_path: Path, kind: str, reply: Callable[[wire.Header], bytes],
        error: type | tuple[type, ...], words: str) -> None:
    """The single-op path checks a reply that is not the expected OK fully; a wrong one,
    or the peer leaving before the reply is complete, fails the op and drops the stream."""
    info = served.add(1)

    def answer(conn: socket.socket, header: wire.Header) -> None:
        conn.sendall(reply(header))
        conn.shutdown(socket.SHUT_RDWR)  # and leave: the stream ends here

    address, cleanup = scripted_server(kind, tmp_path, answer)
    transport = SocketTransport(address)
    local = ShmSegment(4096)
    try:
        for op in (TransferOp.WRITE, TransferOp.WRITE, TransferOp.READ):
            with pytest.raises(error, match=words) as exc:
                transport.transfer(op, [Item(3, local.addr, info, info.base, 4096)], deadline())
            assert exc.value.failed == [3]
    finally:
        transport.close()
        cleanup()


def test_single_op_accepts_a_run_reply_of_one_and_refusals_touch_nothing(
        served: Served, tmp_path: Path, kind: str) -> None:
    """Any valid reply is accepted, not only the exact OK the client expects; a refused
    lone READ leaves the local buffer as it was, and the stream stays usable."""
    info = served.add(1)

    def answer(conn: socket.socket, header: wire.Header) -> None:
        if header.addr == info.base:  # accept as a run of one, data from the segment
            data = served.bytes_of(1)[:header.length] if header.opcode == wire.Op.READ else b""
            conn.sendall(wire.Header(wire.Op.REPLY, header.request_id, addr=1, length=len(data),
                                     flags=wire.FLAG_RUN).pack() + data)
        else:
            conn.sendall(wire.error_reply(header.request_id, wire.Reason.OUT_OF_RANGE, "no"))

    address, cleanup = scripted_server(kind, tmp_path, answer)
    transport = SocketTransport(address)
    local = ShmSegment(4096)
    try:
        transport.transfer(TransferOp.WRITE, [Item(0, local.addr, info, info.base, 64)], deadline())
        transport.transfer(TransferOp.READ, [Item(0, local.addr, info, info.base, 4096)],
                           deadline())
        assert bytes(local.view()) == served.bytes_of(1)[:4096]
        local.view()[:] = b"\x5a" * 4096
        with pytest.raises(errors.OutOfRange, match="no") as exc:
            transport.transfer(TransferOp.READ, [Item(6, local.addr, info, info.base + 8, 4096)],
                               deadline())
        assert exc.value.failed == [6]
        assert bytes(local.view()) == b"\x5a" * 4096
        transport.transfer(TransferOp.READ, [Item(0, local.addr, info, info.base, 100)],
                           deadline())
        assert bytes(local.view()[:100]) == served.bytes_of(1)[:100]
    finally:
        transport.close()
        cleanup()


def test_single_op_reply_arriving_in_pieces(served: Served, tmp_path: Path, kind: str) -> None:
    """A lone op's reply dribbled a few bytes per send: the header, a small READ's data
    (read with its header into the scratch, then straight into place) and error text all
    arrive whole; a larger READ takes the exact-read path."""
    info = served.add(1)
    rng = random.Random(11)

    def answer(conn: socket.socket, header: wire.Header) -> None:
        if header.addr != info.base:
            reply = wire.error_reply(header.request_id, wire.Reason.OUT_OF_RANGE, "not there")
        elif header.opcode == wire.Op.READ:
            reply = wire.ok_reply(header.request_id, header.length) + \
                served.bytes_of(1)[:header.length]
        else:
            reply = wire.ok_reply(header.request_id)
        if kind == "tcp":
            dribble(conn, reply, rng)
        else:
            for pos in range(0, len(reply), 5):
                conn.sendall(reply[pos:pos + 5])

    address, cleanup = scripted_server(kind, tmp_path, answer)
    transport = SocketTransport(address)
    local = ShmSegment(1 << 16)
    try:
        for size in (100, 4096, 40_000):
            local.view()[:] = bytes(local.length)
            transport.transfer(TransferOp.READ, [Item(0, local.addr, info, info.base, size)],
                               deadline())
            assert bytes(local.view()[:size]) == served.bytes_of(1)[:size]
            assert bytes(local.view()[size:]) == bytes(local.length - size)
            transport.transfer(TransferOp.WRITE, [Item(0, local.addr, info, info.base, size)],
                               deadline())
            with pytest.raises(errors.OutOfRange, match="not there") as exc:
                transport.transfer(TransferOp.READ,
                                   [Item(2, local.addr, info, info.base + 8, size)], deadline())
            assert exc.value.failed == [2]
            assert bytes(local.view()[:size]) == served.bytes_of(1)[:size]
    finally:
        transport.close()
        cleanup()


def test_connection_refused_names_the_address(tmp_path: Path, served: Served) -> None:
    info = served.add(1)
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    local = ShmSegment(4096)
    for address in (f"tcp://127.0.0.1:{port}", f"unix://{tmp_path}/nobody.sock"):
        transport = SocketTransport(address)
        with pytest.raises(errors.PeerUnavailable, match=re.escape(address)) as exc:
            transport.transfer(TransferOp.READ, [Item(1, local.addr, info, info.base, 8)],
                               deadline())
        assert exc.value.failed == [1]
        with pytest.raises(errors.PeerUnavailable, match="refused"):
            transport.ping(deadline())
        transport.close()


def test_transfer_after_close_raises_not_connected(served: Served, connect) -> None:
    info = served.add(1)
    local = ShmSegment(4096)
    transport = connect()
    transport.ping(deadline())
    transport.close()
    with pytest.raises(errors.NotConnected) as exc:
        transport.transfer(TransferOp.WRITE, [Item(6, local.addr, info, info.base, 8)],
                           deadline())
    assert exc.value.failed == [6]
    with pytest.raises(errors.NotConnected):
        transport.ping(deadline())


def test_connections_over_the_limit_are_turned_away(served: Served, tmp_path: Path,
                                                    kind: str) -> None:
    srv = DataServer(served.resolve, EPOCH, unix_path=str(tmp_path / "s.sock"),
                     max_connections=1)
    with srv:
        first = SocketTransport(address_of(srv, kind))
        first.ping(deadline())
        second = SocketTransport(address_of(srv, kind))
        with pytest.raises(errors.PeerUnavailable, match="handshake"):
            second.ping(deadline())
        first.ping(deadline())
        first.close()
        second.close()
        assert srv.counters["connections_rejected"] == 1


@pytest.mark.parametrize("address", ["http://x:1", "tcp://nohost", "tcp://h:0", "unix://rel/p"])
def test_bad_addresses_are_refused(address: str) -> None:
    with pytest.raises(errors.ParamInvalid):
        SocketTransport(address)


# ---------------------------------------------------------------- the unix socket file

def test_unix_socket_mode_and_stale_file(served: Served, tmp_path: Path) -> None:
    path = tmp_path / "agent.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))  # a dead server's leftover: bound, never listening, then closed
    stale.close()
    srv = DataServer(served.resolve, EPOCH, tcp_host=None, unix_path=str(path))
    with srv:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o660
        assert srv.tcp_address == ""
        SocketTransport(f"unix://{path}").ping(deadline())
        other = DataServer(served.resolve, EPOCH, tcp_host=None, unix_path=str(path))
        with pytest.raises(errors.ConfigError, match="another server"):
            other.start()
        assert path.exists()  # the live server's socket was not taken away
    assert not path.exists()
    path.write_text("not a socket")
    with pytest.raises(errors.ConfigError, match="not a socket"):
        DataServer(served.resolve, EPOCH, tcp_host=None, unix_path=str(path)).start()
    assert path.read_text() == "not a socket"


# ---------------------------------------------------------------- streams cut in small pieces

class OldAgentProtocol(wire.ServerProtocol):
    """An agent from before vector requests: its handshake does not offer them, so the
    client sends it one frame per op (what the fake agents below answer op by op)."""

    reply_flags = 0


def dribble(sock: socket.socket, data: bytes, rng: random.Random) -> None:
    """Send in 1-7 byte pieces, so the peer sees every partial-read state."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    pos = 0
    while pos < len(data):
        step = rng.randint(1, 7)
        sock.sendall(data[pos:pos + step])
        pos += step
        if rng.random() < 0.05:
            time.sleep(0.001)


def test_client_reads_replies_arriving_in_pieces(served: Served) -> None:
    """A server built on ServerProtocol that dribbles every reply (a few bytes per send)."""
    rw = served.add(1, size=1 << 16)
    ro = served.add(2, size=1 << 16, perms=Perm.READ)
    listener = socket.create_server(("127.0.0.1", 0))
    rng = random.Random(7)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            proto = OldAgentProtocol(served.resolve, EPOCH)
            while header := recv_exactly(conn, wire.HEADER_SIZE):
                action = proto.on_header(header)
                if isinstance(action, wire.ReadHello):
                    identity = recv_exactly(conn, action.count)
                    action = proto.on_hello(action.request_id, identity)
                if isinstance(action, wire.ReceiveInto):
                    action.target[:] = recv_exactly(conn, len(action.target))
                elif isinstance(action, wire.Discard):
                    recv_exactly(conn, action.count)
                assert not isinstance(action, wire.Close)
                payload = getattr(action, "payload", None)
                dribble(conn, action.reply + (bytes(payload) if payload is not None else b""), rng)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    transport = SocketTransport(f"tcp://127.0.0.1:{listener.getsockname()[1]}", identity="x" * 300)
    local, back = ShmSegment(1 << 16), ShmSegment(1 << 16)
    local.view()[:] = os.urandom(local.length)
    try:
        writes = [Item(i, local.addr + i * 1000, rw, rw.base + i * 1000, 1000) for i in range(20)]
        writes[4] = Item(4, local.addr, ro, ro.base, 1000)  # refused: read-only
        with pytest.raises(errors.PermissionDenied) as exc:
            transport.transfer(TransferOp.WRITE, writes, deadline())
        assert exc.value.failed == [4]
        reads = [Item(i, back.addr + i * 1000, rw, rw.base + i * 1000, 1000) for i in range(20)]
        reads[9] = Item(9, back.addr + 9000, rw, rw.end - 999, 1000)  # refused: out of range
        with pytest.raises(errors.OutOfRange) as exc:
            transport.transfer(TransferOp.READ, reads, deadline())
        assert exc.value.failed == [9]
        for i in set(range(20)) - {4, 9}:
            assert back.view()[i * 1000:(i + 1) * 1000] == local.view()[i * 1000:(i + 1) * 1000]
        assert bytes(back.view()[9000:10000]) == bytes(1000)  # a refused read wrote nothing
        transport.ping(deadline())
    finally:
        transport.close()
        thread.join(10)
        listener.close()


@pytest.mark.parametrize("runs", [False, True])
def test_server_reads_requests_arriving_in_pieces(served: Served, server: DataServer,
                                                  runs: bool) -> None:
    """Headers cut anywhere, in the agent's ring or across its refills; with runs, the
    accepted WRITEs around a refusal may share run replies."""
    rw = served.add(1, size=1 << 16)
    ro = served.add(2, size=1 << 16, perms=Perm.READ)
    before = served.bytes_of(2)
    data = os.urandom(3000)
    client = wire.ClientProtocol()
    stream = (client.hello(b"dribbler", runs=runs)
              + client.write(1, EPOCH, rw.base + 10, 3000) + data
              + client.write(1, EPOCH, rw.base + 4000, 2) + b"ab"
              + client.write(2, EPOCH, ro.base, 500) + b"z" * 500  # refused, payload skipped
              + client.write(1, EPOCH, rw.base + 5000, 1) + b"!"
              + client.read(1, EPOCH, rw.base + 10, 3000)
              + client.ping())
    sock = raw_connection(server, "tcp", hello=False)
    with sock:
        dribble(sock, stream, random.Random(1))
        replies = []  # one (header, payload) per request, run replies spread over theirs
        while client.outstanding:
            header = client.on_reply_header(recv_exactly(sock, wire.HEADER_SIZE))
            payload = recv_exactly(sock, wire.payload_length(header))
            count = wire.reply_count(header)
            assert count == 1 or not header.length  # the only READ has no company
            replies += [(header, payload)] * count
    assert [bool(h.flags & wire.FLAG_ERROR_TEXT) for h, _ in replies] == [
        False, False, False, True, False, False, False]
    assert isinstance(wire.reply_error(*replies[3]), errors.PermissionDenied)
    assert replies[5][1] == data
    assert served.bytes_of(1)[10:3010] == data and served.bytes_of(1)[5000:5001] == b"!"
    assert served.bytes_of(1)[4000:4002] == b"ab"
    assert served.bytes_of(2) == before


# ---------------------------------------------------------------- run replies and the agent's ring

def outbound_unread(sock: socket.socket) -> int:
    """Bytes this unix socket sent that the peer has not read yet (SIOCOUTQ)."""
    return struct.unpack("i", fcntl.ioctl(sock, termios.TIOCOUTQ, b"\0" * 4))[0]


def send_split(conn: socket.socket, stream: bytes, cut: int) -> None:
    """Send stream[:cut], wait (bounded) until the peer has read all of it, then the rest:
    the client's reads end exactly at `cut`."""
    conn.sendall(stream[:cut])
    limit = time.monotonic() + 10
    while outbound_unread(conn) and time.monotonic() < limit:
        time.sleep(0.0002)
    conn.sendall(stream[cut:])


def grouped_replies(proto: wire.ServerProtocol, requests: list[bytes], payloads: list[bytes],
                    groups: list[list[int]]) -> bytes:
    """The reply stream a runs-speaking agent sends for `requests`: ServerProtocol checks
    each one; every group of accepted requests is answered by one run reply."""
    actions = []
    for header, payload in zip(requests, payloads, strict=True):
        action = proto.on_header(header)
        if isinstance(action, wire.ReceiveInto):
            action.target[:] = payload
        actions.append(action)
    stream = b""
    for group in groups:
        first = actions[group[0]]
        data = b"".join(bytes(actions[n].payload) for n in group
                        if getattr(actions[n], "payload", None) is not None)
        if len(group) == 1:
            stream += first.reply + data
        else:
            stream += wire.run_reply(first.request_id, len(group), len(data)) + data
    return stream


def test_run_replies_split_at_every_byte(served: Served, tmp_path: Path) -> None:
    """A fake agent answers READ and WRITE batches with runs, a refusal between them, and
    cuts its reply stream at every byte in turn: the client's scatter reads resume at
    every point, data lands only in accepted ops' destinations, `.failed` stays exact."""
    rw = served.add(1, size=1 << 16)
    ro = served.add(2, size=1 << 16, perms=Perm.READ)
    lengths = [3, 5, 6, 7, 1, 4]
    groups = [[0, 1], [2], [3], [4, 5]]  # the refused op (2) stands alone
    path = str(tmp_path / "fake.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen()
    cut = [0]  # where the fake agent cuts its next reply stream
    streams: list[int] = []  # the length of each reply stream it sent

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            proto = OldAgentProtocol(served.resolve, EPOCH)
            hello = recv_exactly(conn, wire.HEADER_SIZE)
            action = proto.on_header(hello)
            assert isinstance(action, wire.ReadHello) and proto.runs
            conn.sendall(proto.on_hello(action.request_id,
                                        recv_exactly(conn, action.count)).reply)
            while True:
                requests, payloads = [], []
                for _ in lengths:  # one batch: header, then the payload a WRITE carries
                    header = recv_exactly(conn, wire.HEADER_SIZE)
                    if not header:
                        return
                    requests.append(header)
                    payloads.append(recv_exactly(
                        conn, wire.payload_length(wire.decode_header(header))))
                stream = grouped_replies(proto, requests, payloads, groups)
                streams.append(len(stream))
                send_split(conn, stream, cut[0])

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    transport = SocketTransport(f"unix://{path}")
    local = ShmSegment(4096)
    offsets = [sum(lengths[:n]) * 3 for n in range(len(lengths))]
    try:
        for op, refused_segment, error in ((TransferOp.READ, rw, errors.OutOfRange),
                                           (TransferOp.WRITE, ro, errors.PermissionDenied)):
            cut[0] = 0
            while True:
                local.view()[:] = bytes(4096) if op == TransferOp.READ else os.urandom(4096)
                items = [Item(n, local.addr + offsets[n], rw, rw.base + 100 * n, length)
                         for n, length in enumerate(lengths)]
                items[2] = Item(2, local.addr + offsets[2], refused_segment,
                                rw.end - 1 if op == TransferOp.READ else ro.base, lengths[2])
                with pytest.raises(error) as exc:
                    transport.transfer(op, items, deadline())
                assert exc.value.failed == [2]
                for n in (0, 1, 3, 4, 5):
                    mine = bytes(local.view()[offsets[n]:offsets[n] + lengths[n]])
                    assert mine == served.bytes_of(1)[100 * n:100 * n + lengths[n]]
                if op == TransferOp.READ:  # the refused read's destination is untouched
                    assert bytes(local.view()[offsets[2]:offsets[2] + lengths[2]]) == bytes(6)
                if cut[0] == streams[-1] - 1:
                    break  # every cut of this stream was tried
                cut[0] += 1
    finally:
        transport.close()
        listener.close()
        thread.join(10)
    assert len(streams) == streams[0] + streams[-1]  # each stream, cut at each of its bytes
    assert served.bytes_of(2) == random.Random(2).randbytes(1 << 16)


def test_refusals_between_runs_of_scattered_read_replies(served: Served, server: DataServer,
                                                         connect) -> None:
    """The real agent answers a READ batch around two refused ops: each accepted op's data
    is right, the refused ops' destinations untouched, `.failed` exact. (The remote pages
    have gaps between them: they go as vector requests, and the one holding op 10 is
    refused whole, so the client runs its ops again one frame each to name op 10 alone.)"""
    info = served.add(1, size=1 << 20)
    ghost = SegmentInfo(77, "agent", "node", info.base, info.length, MemType.MEM_HOST,
                        Perm.RW, EPOCH, False)
    transport = connect()
    back = ShmSegment(64 * 4096)
    items = [Item(n, back.addr + n * 4096, info, info.base + 2 * n * 4096, 4096)
             for n in range(64)]
    items[10] = Item(10, back.addr + 10 * 4096, info, info.end - 100, 4096)  # past the end
    items[40] = Item(40, back.addr + 40 * 4096, ghost, info.base, 4096)  # unknown segment
    for _ in range(3):  # and the stream stays in step for the next batch
        back.view()[:] = bytes(back.length)
        with pytest.raises(errors.OutOfRange) as exc:
            transport.transfer(TransferOp.READ, items, deadline())
        assert exc.value.failed == [10, 40]
        for n in range(64):
            got = bytes(back.view()[n * 4096:(n + 1) * 4096])
            expected = (bytes(4096) if n in (10, 40)
                        else served.bytes_of(1)[2 * n * 4096:(2 * n + 1) * 4096])
            assert got == expected, n
    assert server.counters["connections"] == 1
    # per batch, in vectors of 16 pages (the 64 KiB frame limit): refused are the vector
    # holding op 10, then op 10 alone, and op 40 (another segment); read are the four
    # other vectors and the 15 good ops of the refused one, run again one frame each
    assert server.counters["refused"] == 3 * 3 and server.counters["ops_read"] == 3 * 19


def test_agent_answers_many_headers_from_one_receive_with_runs(served: Served,
                                                               tmp_path: Path) -> None:
    """Every frame of a pipelined batch is already in the agent's socket when it reads:
    one receive brings them all, and each kind of request is answered by one run reply."""
    info = served.add(1, size=1 << 16)
    release = threading.Event()
    calls = []

    def held_resolve(segment_id: int) -> wire.ServedSegment | None:
        calls.append(segment_id)
        if len(calls) == 1:
            release.wait(30)  # hold the first WRITE until the whole batch has been sent
        return served.resolve(segment_id)

    srv = DataServer(held_resolve, EPOCH, tcp_host=None, unix_path=str(tmp_path / "s.sock"))
    data = os.urandom(100 * 100)
    client = wire.ClientProtocol()
    stream = client.hello(b"batcher", runs=True)
    writes = client.requests(wire.Op.WRITE, [(1, EPOCH, info.base + 100 * n, 100)
                                             for n in range(100)])
    stream += b"".join(header + data[100 * n:100 * (n + 1)] for n, header in enumerate(writes))
    stream += b"".join(client.requests(wire.Op.READ, [(1, EPOCH, info.base + 100 * n, 100)
                                                      for n in range(100)]))
    stream += client.ping()
    with srv:
        sock = raw_connection(srv, "unix", hello=False)
        with sock:
            sock.sendall(stream)
            release.set()
            headers = []
            read_back = b""
            while client.outstanding:
                header = client.on_reply_header(recv_exactly(sock, wire.HEADER_SIZE))
                headers.append(header)
                payload = recv_exactly(sock, wire.payload_length(header))
                if wire.reply_count(header) == 100 and header.length:
                    read_back = payload
    assert [wire.reply_count(h) for h in headers] == [1, 100, 100, 1]  # HELLO, runs, PING
    assert read_back == data == served.bytes_of(1)[:100 * 100]
    assert srv.counters["ops_write"] == srv.counters["ops_read"] == 100


def test_small_and_large_frames_mixed_in_one_batch(served: Served, connect) -> None:
    """Small payloads come through the agent's ring (copied), large ones straight into the
    segment; a batch alternating them moves every byte right, both ways."""
    info = served.add(1, size=8 << 20)
    transport = connect(frame_limit=wire.MAX_PAYLOAD)
    local = ShmSegment(8 << 20)
    local.view()[:] = os.urandom(local.length)
    sizes = [100, 1 << 20, 7, 3000, (1 << 20) + 5, 1, 300_000, 48, 2 << 20, 60]
    offsets = [sum(sizes[:n]) for n in range(len(sizes))]
    items = [Item(n, local.addr + offsets[n], info, info.base + offsets[n], size)
             for n, size in enumerate(sizes)]
    transport.transfer(TransferOp.WRITE, items, deadline())
    assert served.bytes_of(1)[:sum(sizes)] == bytes(local.view()[:sum(sizes)])
    back = ShmSegment(8 << 20)
    transport.transfer(TransferOp.READ, [Item(n, back.addr + offsets[n], info, item.remote_addr,
                                              item.length) for n, item in enumerate(items)],
                       deadline())
    assert bytes(back.view()[:sum(sizes)]) == bytes(local.view()[:sum(sizes)])


@pytest.mark.parametrize("count", [64, tcp.MERGE_MAX_OPS + 88])
def test_remote_contiguous_ops_travel_as_merged_frames(served: Served, server: DataServer,
                                                       connect, count: int) -> None:
    """Pages back to back in the peer's segment, scattered (reversed) here: WRITE then READ
    them; one range per MERGE_MAX_OPS ops (`frames` of them), all in one vector request,
    every byte in place."""
    page = 1024
    info = served.add(1, size=count * page)
    transport = connect(frame_limit=wire.MAX_PAYLOAD)
    source, back = ShmSegment(count * page), ShmSegment(count * page)
    source.view()[:] = random.Random(9).randbytes(source.length)
    frames = -(-count // tcp.MERGE_MAX_OPS)

    def items(local: ShmSegment) -> list[Item]:  # op n: remote page n, local page count-1-n
        return [Item(n, local.addr + (count - 1 - n) * page, info, info.base + n * page, page)
                for n in range(count)]
    transport.transfer(TransferOp.WRITE, items(source), deadline())
    written = served.bytes_of(1)
    for n in range(count):
        mine = (count - 1 - n) * page
        assert written[n * page:(n + 1) * page] == bytes(source.view()[mine:mine + page]), n
    transport.transfer(TransferOp.READ, items(back), deadline())
    assert bytes(back.view()) == bytes(source.view())
    assert server.counters["ops_write"] == 1 and server.counters["ops_read"] == 1
    assert frames == (1 if count <= tcp.MERGE_MAX_OPS else 2)


@pytest.mark.parametrize("op", [TransferOp.WRITE, TransferOp.READ])
def test_a_refused_merged_frame_fails_every_op_it_carries(served: Served, server: DataServer,
                                                          connect, op: TransferOp) -> None:
    """Ops 3..7 are back to back but run past the segment's end: the agent refuses their
    one frame, so all five fail (and only they); the others land, the stream goes on."""
    page = 4096
    info = served.add(1, size=16 * page)
    transport = connect()
    local = ShmSegment(16 * page)
    local.view()[:] = random.Random(4).randbytes(local.length)
    before = served.bytes_of(1)
    ops = [Item(n, local.addr + n * page, info, info.base + 2 * n * page, page)
           for n in range(3)]  # gaps between them: frames of their own
    ops += [Item(n, local.addr + n * page, info, info.base + (12 + n - 3) * page, page)
            for n in range(3, 8)]  # pages 12..16 of a 16-page segment: the last is outside
    for _ in range(2):
        with pytest.raises(errors.OutOfRange) as exc:
            transport.transfer(op, ops, deadline())
        assert exc.value.failed == [3, 4, 5, 6, 7]
    after = served.bytes_of(1)
    if op == TransferOp.WRITE:
        for n in range(3):
            at = 2 * n * page
            assert after[at:at + page] == bytes(local.view()[n * page:(n + 1) * page])
        assert after[12 * page:] == before[12 * page:]  # nothing of the refused frame
    else:
        for n in range(3):
            at = 2 * n * page
            assert bytes(local.view()[n * page:(n + 1) * page]) == after[at:at + page]


def test_merge_joins_only_back_to_back_ops_of_one_segment_and_epoch() -> None:
    """_merge: a new frame at a gap, another segment or epoch, the byte limit, or
    MERGE_MAX_OPS ops; a frame of one op keeps its single view."""
    views = [memoryview(bytearray(10)) for _ in range(8)]
    requests = [(1, 5, 100, 10), (1, 5, 110, 10), (1, 5, 120, 10),  # one frame
                (1, 5, 140, 10),                                    # a gap
                (2, 5, 150, 10),                                    # another segment
                (2, 6, 160, 10),                                    # another epoch
                (2, 6, 170, 10), (2, 6, 180, 10)]                   # joined, then the limit
    firsts, lasts, merged, pieces = tcp._merge(list(range(8)), requests, views, limit=20)
    assert merged == [(1, 5, 100, 20), (1, 5, 120, 10), (1, 5, 140, 10), (2, 5, 150, 10),
                      (2, 6, 160, 20), (2, 6, 180, 10)]
    assert (firsts, lasts) == ([0, 2, 3, 4, 5, 7], [1, 2, 3, 4, 6, 7])
    assert pieces[0] == views[0:2] and pieces[1] is views[2] and pieces[4] == views[5:7]
    many = [(1, 5, 10 * n, 10) for n in range(tcp.MERGE_MAX_OPS + 1)]
    _, lasts, merged, _ = tcp._merge(list(range(len(many))), many, [views[0]] * len(many),
                                     limit=wire.MAX_PAYLOAD)
    assert [r[3] for r in merged] == [10 * tcp.MERGE_MAX_OPS, 10]
    assert lasts == [tcp.MERGE_MAX_OPS - 1, tcp.MERGE_MAX_OPS]
    single = [(1, 5, 0, 10), (1, 5, 20, 10)]
    assert tcp._merge([0, 1], single, views[:2], limit=100) == ([0, 1], None, single, views[:2])


def test_a_broken_stream_fails_every_op_of_the_merged_frames_it_left_undone() -> None:
    frames = tcp._Frames([0, 3, 5], [b""] * 3, lasts=[2, 4, 9])
    refused = errors.OutOfRange("refused")
    assert tcp._undone(frames, tcp._StreamLost("closed", "x", 2, [])) == set(range(5, 10))
    assert tcp._undone(frames, tcp._StreamLost("closed", "x", 2, [(0, refused)])) == \
        {0, 1, 2, *range(5, 10)}
    assert list(frames.covered(1)) == [3, 4]


def test_frames_of_one_segment_become_vector_requests_in_batch_order() -> None:
    """`tcp._vectors` (unit): frames that follow one another in one segment and epoch go
    as one vector request, up to the frame limit and MAX_VECTOR_RANGES ranges; a frame of
    another segment stays a frame of its own; request ids follow the batch order."""
    proto = wire.ClientProtocol()
    requests = [(1, EPOCH, 0x1000, 10), (1, EPOCH, 0x3000, 20),   # a vector of 2
                (2, EPOCH, 0x5000, 5),                              # another segment
                (1, EPOCH, 0x7000, 30), (1, EPOCH, 0x9000, 40),     # over the limit together
                (1, EPOCH + 1, 0xB000, 1)]                          # another epoch
    views = [memoryview(bytearray(r[3])) for r in requests]
    views[3] = [memoryview(bytearray(10)), memoryview(bytearray(20))]  # a merged frame
    firsts, lasts, headers, pieces, vectors = tcp._vectors(
        proto, wire.Op.WRITE, [0, 1, 2, 3, 5, 6], [0, 1, 2, 4, 5, 6], requests, views, 60)
    assert vectors == [0]
    assert (firsts, lasts) == ([0, 2, 3, 5, 6], [1, 2, 4, 5, 6])
    decoded = [wire.decode_header(h[:wire.HEADER_SIZE]) for h in headers]
    assert [h.request_id for h in decoded] == [1, 2, 3, 4, 5]
    assert decoded[0].flags & wire.FLAG_VECTOR and (decoded[0].addr, decoded[0].length) == (2, 30)
    assert [wire.VECTOR_ENTRY.unpack_from(headers[0], wire.HEADER_SIZE + 16 * i)
            for i in range(2)] == [(0x1000, 10), (0x3000, 20)]
    assert [len(h) for h in headers[1:]] == [wire.HEADER_SIZE] * 4
    assert pieces[0] == [views[0], views[1]] and pieces[2] is views[3]
    many = [(1, EPOCH, 0x10 * i, 1) for i in range(wire.MAX_VECTOR_RANGES + 3)]
    *_, headers, _, vectors = tcp._vectors(wire.ClientProtocol(), wire.Op.READ,
                                           list(range(len(many))), None, many,
                                           [memoryview(bytearray(1))] * len(many), 1 << 20)
    assert vectors == [0, 1]
    assert [wire.decode_header(h[:wire.HEADER_SIZE]).addr for h in headers] == [
        wire.MAX_VECTOR_RANGES, 3]


def test_array_batches_frame_by_segment_ranges_and_limit() -> None:
    """`tcp._array_frames` (unit): vectors cut where the segment changes, at
    MAX_VECTOR_RANGES and at the frame limit; one local view per run of locally adjacent
    ops; the frames cover every op once, in order."""
    one = SegmentInfo(1, "agent", "node", 0x10_0000, 1 << 30, MemType.MEM_HOST, Perm.RW,
                      EPOCH, False)
    two = SegmentInfo(2, "agent", "node", 0x8000_0000, 1 << 30, MemType.MEM_HOST, Perm.RW,
                      EPOCH, False)
    local = bytearray(1 << 20)
    base = memoryview(local)
    addr = np.frombuffer(base, np.uint8).ctypes.data
    count = wire.MAX_VECTOR_RANGES + 40
    seg = np.zeros(count, np.int64)
    seg[10:20] = 1                                   # a switch and back
    lengths = np.full(count, 100, np.int64)
    lengths[30] = 900                                # with its neighbours, over a 1000-byte limit
    local_at = addr + np.concatenate(([0], np.cumsum(lengths[:-1])))
    local_at[25:] += 7                               # a gap in the local side at op 25
    remote = np.where(seg == 0, one.base, two.base) + np.arange(count) * 4096
    ops = ItemArrays([one, two], seg, local_at.astype(np.int64), remote.astype(np.int64),
                     lengths, np.arange(count))
    frames = tcp._array_frames(wire.ClientProtocol(), TransferOp.WRITE, ops, 1 << 20)
    covered = [list(frames.covered(n)) for n in range(len(frames.headers))]
    assert [pos for cover in covered for pos in cover] == list(range(count))
    assert [(c[0], c[-1]) for c in covered] == [
        (0, 9), (10, 19), (20, 20 + wire.MAX_VECTOR_RANGES - 1),
        (20 + wire.MAX_VECTOR_RANGES, count - 1)]
    assert frames.vectors == [0, 1, 2, 3]
    headers = [wire.decode_header(h[:wire.HEADER_SIZE]) for h in frames.headers]
    assert [h.segment_id for h in headers] == [1, 2, 1, 1]
    assert [h.addr for h in headers] == [len(c) for c in covered]
    assert frames.payloads is not None
    assert [len(p) for p in frames.payloads] == [1, 1, 2, 1]   # op 25 starts a new view
    assert sum(len(v) for p in frames.payloads for v in p) == int(lengths.sum())
    small = tcp._array_frames(wire.ClientProtocol(), TransferOp.READ, ops, 1000)
    sizes = [sum(len(v) for v in t) for t in small.targets]  # type: ignore[union-attr]
    assert max(sizes) <= 1000 and sum(sizes) == int(lengths.sum())


def test_array_batch_tables_join_ranges_adjacent_in_the_segment_whatever_the_local_side(
        ) -> None:
    """`tcp._array_frames` (unit), a top-k gather's shape: each block's pages follow each
    other in the pool but land strided in the compact buffer. The table has one entry per
    block (the agent checks and sends 3 ranges, not 30); the local side one view per page,
    in the same order, so the stream's bytes land where each op says."""
    pool = SegmentInfo(1, "agent", "node", 0x10_0000, 1 << 30, MemType.MEM_HOST, Perm.RW,
                       EPOCH, False)
    layers, blocks, page = 10, 3, 64
    into = np.zeros(layers * blocks * page, np.uint8)
    addr = into.ctypes.data
    layer, block = np.meshgrid(np.arange(layers), np.arange(blocks))   # block-major order
    slots = np.array([7, 2, 5])[block.ravel()]
    remote = pool.base + (slots * layers + layer.ravel()) * page
    local = addr + (layer.ravel() * blocks + block.ravel()) * page
    count = layers * blocks
    ops = ItemArrays([pool], np.zeros(count, np.int64), local.astype(np.int64),
                     remote.astype(np.int64), np.full(count, page, np.int64),
                     np.arange(count))
    frames = tcp._array_frames(wire.ClientProtocol(), TransferOp.READ, ops, 1 << 20)
    assert len(frames.headers) == 1 and frames.vectors == [0]
    header = wire.decode_header(frames.headers[0][:wire.HEADER_SIZE])
    assert (header.addr, header.length) == (blocks, count * page)    # 3 entries, all bytes
    table = np.frombuffer(frames.headers[0][wire.HEADER_SIZE:], ">u8").reshape(-1, 2)
    assert table.tolist() == [[pool.base + s * layers * page, layers * page] for s in (7, 2, 5)]
    assert frames.targets is not None
    [views] = frames.targets
    assert len(views) == count
    starts = [np.frombuffer(v, np.uint8).ctypes.data for v in views]
    assert starts == local.tolist() and all(len(v) == page for v in views)
