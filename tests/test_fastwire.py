"""hixl._fastwire, the lone op in C (hixl/_fastwire.c), against the Python path it stands in for.

- The bytes: the C header codec against hixl/wire.py's for random fields, both ways.
- The client (`_Connection.single`): for random ops and scripted replies (OK, refusals,
  protocol errors, a peer closing mid-frame, a peer that never answers) the C path and the
  Python path send the same bytes, end the same way (same typed error, same message) and
  leave the same bytes in local memory.
- The agent (`DataServer` in C): lone WRITE/READ byte for byte on real segments, answered
  in C (counted by `_counted`) with the counters exactly as the Python path keeps them;
  refusals (out of bounds, wrong epoch, read-only, deregistered, unknown) answered as in
  Python and the connection still served in C afterwards; truncated frames and peers
  closing mid-frame; and threads hammering lone ops while segments are deregistered and
  new ones allocated: typed errors or correct bytes, never a crash.
- Real agent processes with HIXL_FASTWIRE=0 and without it move the same bytes.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib
import importlib.util
import json
import os
import random
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import waiting
from hypothesis import given, settings
from hypothesis import strategies as st
from test_fuzz_data_server import recv_exact_or_eof as recv_exact

from hixl import errors, wire
from hixl.memory import ShmSegment
from hixl.processes import DaemonProcess
from hixl.server.agent import data_server
from hixl.server.agent.agent import Agent
from hixl.server.agent.data_server import DataServer
from hixl.transports import tcp
from hixl.transports.base import Item
from hixl.transports.tcp import SocketTransport
from hixl.types import MemType, Perm, SegmentInfo, TransferOp

FAST = tcp.FASTWIRE
needs_fast = pytest.mark.skipif(FAST is None, reason="hixl._fastwire is not built here "
                                                     "(no compiler) or HIXL_FASTWIRE=0")
U8, U16, U32, U64 = (st.integers(0, (1 << bits) - 1) for bits in (8, 16, 32, 64))
ROOT = Path(__file__).resolve().parent.parent


def test_ci_builds_the_extension() -> None:
    """CI installs a compiler and the headers (.ci/run): there the C path must exist, or
    every test of it would be skipped unseen."""
    if not os.environ.get("CI"):
        pytest.skip("outside CI a machine without a compiler runs the Python path")
    importlib.import_module("hixl._fastwire")


def test_hixl_fastwire_0_turns_it_off() -> None:
    code = "from hixl.transports import tcp; print(tcp.FASTWIRE is None)"
    env = dict(os.environ, HIXL_FASTWIRE="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.strip() == "True"


# ---------------------------------------------------------------- the bytes

@needs_fast
@settings(max_examples=500, deadline=None)
@given(opcode=U8, flags=U16, reason=U16, status=U32, epoch=U32, rid=U64, segment=U64,
       addr=U64, length=U64)
def test_c_headers_are_wire_py_headers(opcode: int, flags: int, reason: int, status: int,
                                       epoch: int, rid: int, segment: int, addr: int,
                                       length: int) -> None:
    fields = (opcode, flags, reason, status, epoch, rid, segment, addr, length)
    packed = wire.HEADER.pack(wire.MAGIC, wire.VERSION, *fields)
    assert FAST.header(*fields) == packed
    assert FAST.unpack(packed) == wire.HEADER.unpack(packed)


@needs_fast
@settings(max_examples=500, deadline=None)
@given(raw=st.binary(min_size=wire.HEADER_SIZE, max_size=wire.HEADER_SIZE))
def test_c_reads_any_48_bytes_as_wire_py_does(raw: bytes) -> None:
    assert FAST.unpack(raw) == wire.HEADER.unpack(raw)


# ---------------------------------------------------------------- the client

REPLIES = ["ok", "ok-split", "refused", "wrong-id", "garbage", "truncated", "close",
           "error-overlong", "read-short"]


def run_single(fast: object | None, opcode: int, segment_id: int, epoch: int, addr: int,
               payload: bytes, reply: str, reason: int, seed: int,
               ) -> tuple[bytes, tuple[object, ...], bytes]:
    """One `_Connection.single` against a scripted agent on a socketpair: (the request
    bytes the agent got, how the call ended, the local memory after it)."""
    length = len(payload)
    ours, theirs = socket.socketpair()
    conn = tcp._Connection(ours, fast)
    local = bytearray(payload if opcode == wire.Op.WRITE else bytes(length))
    address = ctypes.addressof((ctypes.c_char * length).from_buffer(local))
    outcome: list[tuple[object, ...]] = []

    def call() -> None:
        deadline = time.monotonic() + (0.3 if reply == "silent" else 20)
        try:
            error = conn.single(int(opcode), segment_id, epoch, addr, address, length, deadline)
        except tcp._StreamLost as lost:
            outcome.append(("lost", lost.kind, str(lost), lost.replied))
        else:
            outcome.append(("refused", type(error).__name__, str(error)) if error else ("ok",))

    thread = threading.Thread(target=call)
    thread.start()
    try:
        want = wire.HEADER_SIZE + (length if opcode == wire.Op.WRITE else 0)
        request = bytearray()
        while len(request) < want:
            chunk = theirs.recv(want - len(request))
            assert chunk
            request += chunk
        rid = wire.HEADER.unpack_from(request)[7]
        rng = random.Random(seed)
        data = rng.randbytes(length) if opcode == wire.Op.READ else b""
        ok = wire.ok_reply(rid, len(data)) + data
        if reply == "ok":
            theirs.sendall(ok)
        elif reply == "ok-split":
            cut = rng.randint(1, len(ok) - 1)
            theirs.sendall(ok[:cut])
            theirs.sendall(ok[cut:])
        elif reply == "refused":
            theirs.sendall(wire.error_reply(rid, wire.Reason(reason), f"no ({reason})"))
        elif reply == "wrong-id":
            theirs.sendall(wire.ok_reply(rid + 1, len(data)) + data)
        elif reply == "garbage":
            theirs.sendall(rng.randbytes(wire.HEADER_SIZE))
        elif reply == "truncated":
            theirs.sendall(ok[:rng.randint(0, len(ok) - 1)])
            theirs.shutdown(socket.SHUT_WR)
        elif reply == "close":
            theirs.shutdown(socket.SHUT_RDWR)
        elif reply == "error-overlong":  # more bytes after an error reply than its text
            theirs.sendall(wire.error_reply(rid, wire.Reason.OUT_OF_RANGE, "x") + b"extra!")
        elif reply == "read-short":  # a READ reply carrying fewer bytes than asked
            theirs.sendall(wire.ok_reply(rid, max(len(data) - 1, 0)) + data[:-1])
        # "silent": no answer at all, the deadline ends the call
        thread.join(30)
        assert not thread.is_alive(), "single() hung"
    finally:
        theirs.close()
        thread.join(30)
        ours.close()
    return bytes(request), outcome[0], bytes(local)


@needs_fast
@settings(max_examples=150, deadline=None)
@given(opcode=st.sampled_from([wire.Op.WRITE, wire.Op.READ]), segment_id=U64, epoch=U32,
       addr=U64, length=st.integers(1, 40000), reply=st.sampled_from(REPLIES),
       reason=st.sampled_from(list(wire.Reason)[1:]), seed=st.integers(0, 1 << 30))
def test_c_client_single_is_the_python_one(opcode: wire.Op, segment_id: int, epoch: int,
                                           addr: int, length: int, reply: str, reason: int,
                                           seed: int) -> None:
    payload = random.Random(seed).randbytes(length)
    c = run_single(FAST, opcode, segment_id, epoch, addr, payload, reply, reason, seed)
    py = run_single(None, opcode, segment_id, epoch, addr, payload, reply, reason, seed)
    assert c == py
    expected, _ = wire.ClientProtocol().request(int(opcode), segment_id, epoch, addr, length)
    assert c[0][:wire.HEADER_SIZE] == expected  # request id 1 on a fresh connection
    assert c[0][wire.HEADER_SIZE:] == (payload if opcode == wire.Op.WRITE else b"")
    if reply in ("ok", "ok-split"):
        assert c[1] == ("ok",)
    elif reply == "refused":
        assert c[1][0] == "refused"


@needs_fast
@pytest.mark.parametrize("opcode", [wire.Op.WRITE, wire.Op.READ])
def test_c_client_single_ends_at_the_deadline(opcode: wire.Op) -> None:
    for fast in (FAST, None):
        outcome = run_single(fast, opcode, 1, 1, 0, b"x" * 100, "silent", 0, 0)[1]
        assert outcome == ("lost", "timeout", "deadline passed", 0)


@needs_fast
def test_c_recv_scatter_fills_ranges_in_table_order_across_calls() -> None:
    """recv_scatter (a vector WRITE's payload): the stream lands range by range in the
    table's order, whatever the ranges' places, over more ranges than one recvmsg takes
    (IOV_MAX) and however the sender's writes are cut; short only at end-of-file."""
    rng = random.Random(7)
    count, size = 1500, 37                      # > IOV_MAX ranges of an odd size
    memory = bytearray(count * size * 2)
    order = list(range(count * 2))
    rng.shuffle(order)
    starts = np.array(order[:count], np.int64) * size
    lengths = np.full(count, size, np.int64)
    payload = bytes(rng.getrandbits(8) for _ in range(count * size))
    ours, theirs = socket.socketpair()
    try:
        def send() -> None:
            at = 0
            while at < len(payload):             # cut at random, not at range edges
                step = rng.randint(1, 5000)
                theirs.sendall(payload[at:at + step])
                at += step
        sender = threading.Thread(target=send)
        sender.start()
        assert FAST.recv_scatter(ours.fileno(), memory, starts, lengths) == len(payload)
        sender.join()
        landed = b"".join(bytes(memory[s:s + size]) for s in starts.tolist())
        assert landed == payload
        assert sum(memory) == sum(payload)       # nothing outside the ranges
        theirs.sendall(payload[:100])
        theirs.close()                           # end-of-file after 100 bytes
        assert FAST.recv_scatter(ours.fileno(), memory, starts[:10], lengths[:10]) == 100
    finally:
        ours.close()
        theirs.close()


@needs_fast
def test_c_recv_scatter_refuses_ranges_outside_its_memory_and_times_out() -> None:
    ours, theirs = socket.socketpair()
    try:
        memory = bytearray(100)
        theirs.sendall(b"x" * 10)
        for starts, lengths in (([95], [10]), ([-1], [5]), ([0, 50], [5, -1])):
            with pytest.raises(ValueError, match="outside the 100-byte memory"):
                FAST.recv_scatter(ours.fileno(), memory, np.array(starts, np.int64),
                                  np.array(lengths, np.int64))
        assert memory == bytearray(100)          # refused before reading: still queued
        with pytest.raises(ValueError, match="differ in length"):
            FAST.recv_scatter(ours.fileno(), memory, np.zeros(2, np.int64),
                              np.ones(1, np.int64))
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 50_000))
        with pytest.raises(BlockingIOError):     # SO_RCVTIMEO passed: 10 of 20 bytes came
            FAST.recv_scatter(ours.fileno(), memory, np.array([0], np.int64),
                              np.array([20], np.int64))
    finally:
        ours.close()
        theirs.close()


# ---------------------------------------------------------------- the agent

class Served:
    """A real Agent (segments it allocates, deregisters) behind a DataServer."""

    def __init__(self, tmp: Path, counted: list[int]) -> None:
        self.agent = Agent("fastwire-test", "node", pool_max_bytes=256 << 20)
        self.server = DataServer(self.agent.resolve, self.agent.epoch,
                                 unix_path=str(tmp / "data.sock"))
        self.server.start()
        self.counted = counted

    def address(self, kind: str) -> str:
        return (f"tcp://{self.server.tcp_address}" if kind == "tcp"
                else f"unix://{self.server.unix_path}")

    def close(self) -> None:
        self.server.stop()
        self.agent.close()


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many ops the agent answered in C (each is counted through `_counted`)."""
    calls = [0]
    original = data_server._Connection._counted

    def counting(self: data_server._Connection, *args: object) -> None:
        calls[0] += 1
        original(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(data_server._Connection, "_counted", counting)
    return calls


@pytest.fixture
def served(tmp_path: Path, counted: list[int]) -> Iterator[Served]:
    if FAST is None:
        pytest.skip("hixl._fastwire is not built here (or HIXL_FASTWIRE=0)")
    s = Served(tmp_path, counted)
    yield s
    s.close()


@pytest.fixture(params=["tcp", "unix"])
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


def deadline(seconds: float = 20.0) -> float:
    return time.monotonic() + seconds


def test_lone_ops_are_answered_in_c_byte_for_byte(served: Served, kind: str) -> None:
    info = served.agent.allocate(1 << 20, Perm.RW, name="target")
    segment = served.agent.resolve(info.segment_id)
    assert segment is not None
    memory = segment.memory
    local = ShmSegment(1 << 20)
    back = ShmSegment(1 << 20)
    rng = random.Random(kind)
    transport = SocketTransport(served.address(kind), identity="t")
    ops = small = 0
    try:
        for _ in range(120):
            length = rng.choice([1, 7, 4096, rng.randint(1, 4096), rng.randint(1, 64 << 10)])
            remote = rng.randint(0, info.length - length)
            near = rng.randint(0, local.length - length)
            data = rng.randbytes(length)
            local.view()[near:near + length] = data
            transport.transfer(TransferOp.WRITE, [Item(0, local.addr + near, info,
                                                       info.base + remote, length)], deadline())
            assert bytes(memory[remote:remote + length]) == data
            transport.transfer(TransferOp.READ, [Item(0, back.addr + near, info,
                                                      info.base + remote, length)], deadline())
            assert bytes(back.view()[near:near + length]) == data
            ops += 2
            small += 2 if length <= 4096 else 0
    finally:
        transport.close()
    counters = served.server.counters
    assert counters["ops_write"] == counters["ops_read"] == ops // 2
    assert counters["refused"] == 0 and counters["protocol_errors"] == 0
    # answered in C: every small op (its frame always comes whole in one read); a larger
    # one too, unless its WRITE outgrows the ring or comes in pieces (then Python does)
    assert small >= 60 and served.counted[0] >= small
    read, write = served.server.traffic.pair(kind)
    assert write.ops == read.ops == ops // 2
    assert sum(write.latency.buckets) + sum(read.latency.buckets) == ops


def test_refusals_are_the_python_paths_and_c_goes_on(served: Served, kind: str) -> None:
    agent = served.agent
    rw = agent.allocate(1 << 16, Perm.RW, name="rw")
    ro = agent.allocate(1 << 16, Perm.READ, name="ro")
    gone = agent.allocate(1 << 16, Perm.RW, name="gone")
    agent.deregister(gone.segment_id)
    before = {info.segment_id: bytes(agent.resolve(info.segment_id).memory)  # type: ignore[union-attr]
              for info in (rw, ro)}
    local = ShmSegment(1 << 16)
    local.view()[:] = random.Random(3).randbytes(local.length)
    stale = dataclasses.replace(rw, epoch=rw.epoch + 1)
    cases: list[tuple[TransferOp, SegmentInfo, int, int, type[errors.HixlError]]] = [
        (TransferOp.WRITE, rw, rw.base + rw.length - 10, 4096, errors.OutOfRange),
        (TransferOp.READ, rw, rw.base - 1, 16, errors.OutOfRange),
        (TransferOp.WRITE, stale, rw.base, 4096, errors.StaleEpoch),
        (TransferOp.WRITE, ro, ro.base, 4096, errors.PermissionDenied),
        (TransferOp.WRITE, gone, gone.base, 4096, errors.ParamInvalid),
        (TransferOp.READ, gone, gone.base, 4096, errors.ParamInvalid),
    ]
    transport = SocketTransport(served.address(kind), identity="t")
    try:
        transport.transfer(TransferOp.WRITE, [Item(0, local.addr, rw, rw.base, 64)], deadline())
        for op, info, remote, length, error in cases:
            answered = served.counted[0]
            with pytest.raises(error) as caught:
                transport.transfer(op, [Item(9, local.addr, info, remote, length)], deadline())
            assert caught.value.failed == [9]
            assert served.counted[0] == answered  # refused in Python, nothing counted in C
            # and the same connection is served in C right after
            transport.transfer(TransferOp.READ, [Item(0, local.addr + 8192, rw, rw.base, 64)],
                               deadline())
            assert served.counted[0] == answered + 1
    finally:
        transport.close()
    assert bytes(agent.resolve(ro.segment_id).memory) == before[ro.segment_id]  # type: ignore[union-attr]
    assert bytes(agent.resolve(rw.segment_id).memory)[64:] == before[rw.segment_id][64:]  # type: ignore[union-attr]
    assert served.server.counters["refused"] == len(cases)


def connect_raw(served: Served, kind: str) -> socket.socket:
    if kind == "tcp":
        host, port = served.server.tcp_address.rsplit(":", 1)
        sock = socket.create_connection((host, int(port)), timeout=20)
    else:
        sock = socket.socket(socket.AF_UNIX)
        sock.settimeout(20)
        sock.connect(served.server.unix_path)
    proto = wire.ClientProtocol()
    sock.sendall(proto.hello(b"raw"))
    assert len(recv_exact(sock, wire.HEADER_SIZE)) == wire.HEADER_SIZE
    return sock


@pytest.mark.parametrize("cut", ["header", "payload", "after-read"])
def test_peers_closing_mid_frame_leave_the_agent_serving(served: Served, kind: str,
                                                         cut: str) -> None:
    info = served.agent.allocate(1 << 16, Perm.RW, name="target")
    memory = served.agent.resolve(info.segment_id).memory  # type: ignore[union-attr]
    before = bytes(memory)
    epoch = info.epoch
    for _ in range(3):
        with connect_raw(served, kind) as sock:
            # a lone op first, so the connection waits in C for the next frame
            sock.sendall(wire.read_request(2, info.segment_id, epoch, info.base, 8))
            reply = recv_exact(sock, wire.HEADER_SIZE + 8)
            assert reply[:wire.HEADER_SIZE] == wire.ok_reply(2, 8)
            header = wire.write_header(3, info.segment_id, epoch, info.base + 100, 4096)
            if cut == "header":
                sock.sendall(header[:20])
            elif cut == "payload":
                sock.sendall(header + b"\xaa" * 1000)
            else:
                sock.sendall(wire.read_request(3, info.segment_id, epoch, info.base, 4096))
            sock.shutdown(socket.SHUT_WR)
            rest = recv_exact(sock, 1 << 20)
            if cut == "after-read":
                assert rest == wire.ok_reply(3, 4096) + before[:4096]
            else:
                assert rest == b""  # no reply to a frame that never ended
    # what a cut WRITE's payload reached is all it changed (the Python path's contract)
    after = bytes(memory)
    assert after[:100] == before[:100] and after[100 + 1000:] == before[100 + 1000:]
    transport = SocketTransport(served.address(kind), identity="t")
    local = ShmSegment(4096)
    local.view()[:] = b"\x5a" * 4096
    try:
        transport.transfer(TransferOp.WRITE, [Item(0, local.addr, info, info.base, 4096)],
                           deadline())
    finally:
        transport.close()
    assert bytes(memory[:4096]) == b"\x5a" * 4096


def test_truncated_and_odd_frames_are_handed_to_python(served: Served, kind: str) -> None:
    """Frames C does not serve (zero length, a WRITE whose payload comes later, two frames
    in one read, a PING, an unknown opcode) get the Python path's answers on a connection
    that was waiting in C."""
    info = served.agent.allocate(1 << 16, Perm.RW, name="target")
    memory = served.agent.resolve(info.segment_id).memory  # type: ignore[union-attr]
    seg, epoch = info.segment_id, info.epoch
    with connect_raw(served, kind) as sock:
        sock.sendall(wire.read_request(2, seg, epoch, info.base, 8))
        assert recv_exact(sock, wire.HEADER_SIZE + 8)[:wire.HEADER_SIZE] == wire.ok_reply(2, 8)
        # zero length: BAD_LENGTH, the connection goes on
        sock.sendall(wire.read_request(3, seg, epoch, info.base, 0))
        header = wire.decode_header(recv_exact(sock, wire.HEADER_SIZE))
        assert header.reason == wire.Reason.BAD_LENGTH
        recv_exact(sock, header.length)
        # a WRITE whose payload trails its header in another send
        sock.sendall(wire.write_header(4, seg, epoch, info.base, 3000))
        sock.sendall(b"\x11" * 3000)
        assert recv_exact(sock, wire.HEADER_SIZE) == wire.ok_reply(4)
        assert bytes(memory[:3000]) == b"\x11" * 3000
        # two frames in one send
        sock.sendall(wire.write_header(5, seg, epoch, info.base, 10) + b"\x22" * 10
                     + wire.read_request(6, seg, epoch, info.base, 10))
        replies = recv_exact(sock, 2 * wire.HEADER_SIZE + 10)
        assert replies == (wire.ok_reply(5) + wire.ok_reply(6, 10) + b"\x22" * 10)
        # PING
        sock.sendall(wire.Header(wire.Op.PING, 7).pack())
        assert recv_exact(sock, wire.HEADER_SIZE) == wire.ok_reply(7)
        # an unknown opcode: closed with a BAD_FRAME reply
        sock.sendall(wire.HEADER.pack(wire.MAGIC, wire.VERSION, 99, 0, 0, 0, 0, 8, 0, 0, 0))
        header = wire.decode_header(recv_exact(sock, wire.HEADER_SIZE))
        assert header.reason == wire.Reason.BAD_FRAME
        recv_exact(sock, header.length)
        assert sock.recv(1) == b""
    assert served.server.counters["protocol_errors"] == 1


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("shape", ["lone", "vector"])
def test_deregistering_under_ops_never_touches_unmapped_memory(served: Served, kind: str,
                                                               seed: int, shape: str,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               ) -> None:
    """Threads hammer WRITE/READ ops at segments the main thread deregisters and replaces
    (lone ops, or vectors of 5 ranges apart, both served in C, a vector WRITE's data
    received straight into the ranges while a view pins the segment's memory): each op
    either moves the right bytes or fails with a typed error naming it; the agent never
    crashes, and every unmap deferred while a view or buffer pinned it completes."""
    agent = served.agent
    rng = random.Random(seed)
    size = 1 << 16 if shape == "lone" else 1 << 20   # vectors: more than the agent's ring
    in_c: list[int] = []  # the sizes of the ops served in C
    counted = data_server._Connection._counted

    def counting(self: data_server._Connection, opcode: int, nbytes: int,
                 seconds: float) -> None:
        in_c.append(nbytes)
        counted(self, opcode, nbytes, seconds)

    monkeypatch.setattr(data_server._Connection, "_counted", counting)
    current: list[SegmentInfo] = [agent.allocate(size, Perm.RW, name=f"s{i}") for i in range(2)]
    stop = threading.Event()
    failures: list[BaseException] = []
    done = [0, 0]  # ok, refused

    def hammer(worker: int) -> None:
        transport = SocketTransport(served.address(kind), identity=f"w{worker}",
                                    max_connections=1)
        local = ShmSegment(size)
        wrng = random.Random(worker)
        try:
            while not stop.is_set():
                info = current[wrng.randrange(len(current))]
                length = wrng.choice([64, 4096, 32768] if shape == "lone" else [40_000, 64_000])
                ranges = 1 if shape == "lone" else 5
                offsets = sorted(wrng.sample(range(0, size - length, length), ranges))
                items = [Item(i, local.addr + i * length, info, info.base + offset, length)
                         for i, offset in enumerate(offsets)
                         if i == 0 or offset > offsets[i - 1] + length]  # none adjacent
                op = wrng.choice([TransferOp.WRITE, TransferOp.READ])
                try:
                    transport.transfer(op, items, deadline())
                    done[0] += 1
                except (errors.ParamInvalid, errors.StaleEpoch):
                    done[1] += 1  # deregistered under us: refused, typed
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            failures.append(exc)
        finally:
            transport.close()
            local.close()

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    moved = 0
    try:
        # the churn starts once ops flow (threads connecting could otherwise miss all of it)
        waiting.wait_until(lambda: sum(done) >= 3 or failures, "ops under way", timeout=30)
        for i in range(150):
            slot = rng.randrange(len(current))
            old = current[slot]
            current[slot] = agent.allocate(size, Perm.RW, name=f"n{i}")
            agent.deregister(old.segment_id)
        # ... and once it ends, ops on the segments that stay succeed again
        moved = done[0]
        waiting.wait_until(lambda: done[0] > moved or failures, "ops succeed after the churn",
                           timeout=30)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    assert not failures, failures
    assert done[0] > moved
    vectors_in_c = sum(nbytes >= 40_000 for nbytes in in_c)  # lone ops are <= 32 KiB
    assert (vectors_in_c > 0, len(in_c) > vectors_in_c) == (shape == "vector", shape == "lone")
    served.server.stop()  # every connection thread has ended: no view pins anything now
    agent._retry_deferred()
    assert agent.counters()["deferred_unmaps"] == 0


# ---------------------------------------------------------------- real agent processes

AGENT_SCRIPT = r"""
import json, sys
from hixl.server.agent.config import AgentConfig
from hixl.server.agent.runtime import AgentServer
from hixl.transports import tcp
server = AgentServer(AgentConfig(host="127.0.0.1", grpc_port=0, runtime_dir=sys.argv[1],
                                 node_id="fastwire"))
server.start()
info = server.agent.allocate(1 << 20, name="target")
print(json.dumps({"fast": tcp.FASTWIRE is not None, "segment": info.segment_id,
                  "base": info.base, "epoch": info.epoch, "tcp": server.endpoints.data_tcp,
                  "unix": server.endpoints.data_unix}), flush=True)
sys.stdin.read()
server.stop()
"""


@pytest.fixture(params=["0", "1"], ids=["agent-python", "agent-fastwire"])
def agent_process(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HIXL_AGENT_")}
    env["HIXL_FASTWIRE"] = request.param
    agent = DaemonProcess([sys.executable, "-c", AGENT_SCRIPT, str(tmp_path / "run")],
                          name="agent", ready=re.compile(r"^\{"), env=env, stop_by="stdin",
                          grace_s=30.0)
    with agent:
        info = json.loads(agent.wait_ready())
        built = importlib.util.find_spec("hixl._fastwire") is not None
        assert info["fast"] == (request.param == "1" and built)
        yield info


@pytest.mark.parametrize("client", ["python", "fastwire"])
def test_real_agents_move_every_byte_with_and_without_c(agent_process: dict, kind: str,
                                                        client: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    if client == "python":
        monkeypatch.setattr(tcp, "FASTWIRE", None)
    elif FAST is None:
        pytest.skip("hixl._fastwire is not built here (or HIXL_FASTWIRE=0)")
    address = (f"tcp://{agent_process['tcp']}" if kind == "tcp"
               else f"unix://{agent_process['unix']}")
    info = SegmentInfo(agent_process["segment"], "agent", "node", agent_process["base"], 1 << 20,
                       MemType.MEM_HOST, Perm.RW, agent_process["epoch"], False)
    rng = random.Random(client + kind)
    local, back = ShmSegment(1 << 20), ShmSegment(1 << 20)
    local.view()[:] = rng.randbytes(local.length)
    transport = SocketTransport(address, identity="t")
    try:
        for _ in range(60):
            length = rng.choice([1, 4096, rng.randint(1, 64 << 10)])
            offset = rng.randint(0, info.length - length)
            transport.transfer(TransferOp.WRITE, [Item(0, local.addr + offset, info,
                                                       info.base + offset, length)], deadline())
            transport.transfer(TransferOp.READ, [Item(0, back.addr + offset, info,
                                                      info.base + offset, length)], deadline())
            assert bytes(back.view()[offset:offset + length]) == bytes(
                local.view()[offset:offset + length])
        with pytest.raises(errors.OutOfRange):
            transport.transfer(TransferOp.WRITE, [Item(0, local.addr, info,
                                                       info.base + info.length - 1, 4096)],
                               deadline())
        stale = dataclasses.replace(info, epoch=info.epoch + 1)
        with pytest.raises(errors.StaleEpoch):
            transport.transfer(TransferOp.READ, [Item(0, back.addr, stale, info.base, 64)],
                               deadline())
    finally:
        transport.close()


