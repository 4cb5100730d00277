"""Engine end to end: a real hixl-agent process, this process and a second client process.

Every byte is checked: PUTs from here are read back here and from another process (over
the other data path), and bad input must leave every segment's content unchanged.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import pytest

from hixl import (
    Engine,
    HixlError,
    NotConnected,
    OutOfRange,
    ParamInvalid,
    Perm,
    PermissionDenied,
    SegmentInfo,
    TransferOp,
    TransferOpDesc,
    TransferStatus,
)
from hixl.client.agent_client import FdClient
from hixl.memory import PARALLEL_COPY_MIN, Mapping, new_bytes

WORKER = os.path.join(os.path.dirname(__file__), "helpers", "engine_worker.py")
POOL_RW = 4 << 20
POOL_RO = 1 << 20
FABRIC = pytest.mark.parametrize("fabric", ["1", "0"], ids=["fabric", "socket"])


def pattern(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def run_worker(job: dict) -> str:
    """A second client process; returns what it printed (fails the test on error)."""
    result = subprocess.run([sys.executable, WORKER, json.dumps(job)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.fixture
def node(agent_process):
    """A node agent whose pool has one read-write and one read-only segment."""
    return agent_process(config={"pool": [{"name": "kv", "size": POOL_RW, "perms": "rw"},
                                          {"name": "ro", "size": POOL_RO, "perms": "r"}]})


def pool_segment(engine: Engine, agent: str, name: str) -> SegmentInfo:
    (segment,) = [s for s in engine.segments(agent) if s.name == name]
    return segment


@pytest.fixture
def client(node, request) -> Iterator[tuple[Engine, str]]:
    fabric = getattr(request, "param", "1")
    with Engine("127.0.0.1", {"EnableUseFabricMem": fabric}) as engine:
        engine.connect(node.engine, timeout=10)
        yield engine, node.engine


def snapshot(engine: Engine, agent: str, segment: SegmentInfo) -> bytes:
    """The whole segment's content, read through the engine."""
    buf = np.zeros(segment.length, np.uint8)
    handle = engine.register(buf)
    try:
        engine.read(agent, buf, segment.base, timeout=10)
    finally:
        engine.deregister(handle)
    return buf.tobytes()


@FABRIC
def test_put_get_random_offsets_single_batched_sync_async(node, fabric: str) -> None:
    rng = np.random.default_rng(1234)
    with Engine("127.0.0.1", {"EnableUseFabricMem": fabric}) as engine:
        engine.connect(node.engine, timeout=10)
        kv = pool_segment(engine, node.engine, "kv")
        assert kv.perms == Perm.RW and kv.shareable
        src = pattern(1, POOL_RW)
        dst = np.zeros(POOL_RW, np.uint8)
        engine.register(src)
        engine.register(dst)

        # single ops, sync, at random offsets and sizes (1 byte .. 256 KiB)
        for _ in range(30):
            length = int(rng.integers(1, 256 << 10))
            offset = int(rng.integers(0, POOL_RW - length))
            engine.write(node.engine, src.ctypes.data + offset, kv.base + offset, length)
            engine.read(node.engine, dst.ctypes.data + offset, kv.base + offset, length)
            assert dst[offset:offset + length].tobytes() == src[offset:offset + length].tobytes()

        # a batch of 64 disjoint random ranges (plus one 1 MiB op), then read back batched
        edges = np.sort(rng.choice(POOL_RW - (1 << 20), 128, replace=False))
        ranges = [(int(a), int(b - a)) for a, b in zip(edges[::2], edges[1::2], strict=True)]
        ranges.append((POOL_RW - (1 << 20), 1 << 20))
        fresh = pattern(2, POOL_RW)
        engine.register(fresh)
        engine.transfer(node.engine, TransferOp.WRITE,
                        [TransferOpDesc(fresh.ctypes.data + o, kv.base + o, n) for o, n in ranges])
        dst[:] = 0
        engine.transfer(node.engine, TransferOp.READ,
                        [(dst.ctypes.data + o, kv.base + o, n) for o, n in ranges])
        for o, n in ranges:
            assert dst[o:o + n].tobytes() == fresh[o:o + n].tobytes()

        # async: several requests in flight, then GET it all back asynchronously
        reqs = [engine.transfer_async(node.engine, TransferOp.WRITE,
                                      [TransferOpDesc(src.ctypes.data + i * 65536, kv.base + i * 65536, 65536)])
                for i in range(16)]
        for req in reqs:
            req.wait()
            assert req.status == TransferStatus.COMPLETED
        dst[:] = 0
        req = engine.transfer_async(node.engine, TransferOp.READ,
                                    [TransferOpDesc(dst.ctypes.data, kv.base, 16 * 65536)])
        req.wait()
        assert req.status == TransferStatus.COMPLETED and req.error is None
        assert dst[:16 * 65536].tobytes() == src[:16 * 65536].tobytes()

        # asyncio variants
        async def round_trip() -> None:
            await engine.write_aio(node.engine, src[:4096], kv.base + 12345)
            out = np.zeros(4096, np.uint8)
            engine.register(out)
            await engine.read_aio(node.engine, out, kv.base + 12345)
            assert out.tobytes() == src[:4096].tobytes()

        asyncio.run(round_trip())


@FABRIC
def test_unregistered_local_memory_only_with_the_opt_in(node, fabric: str) -> None:
    """Adapters moving Python objects skip registration explicitly (local_registered=False);
    everyone else is still refused before a byte moves. The blocks are large enough for
    the fabric path's parallel copy of a READ (a WRITE's streamed copy takes one thread up
    to PARALLEL_STREAM_MIN), and unaligned on both sides."""
    size = PARALLEL_COPY_MIN + (1 << 20) + 4097
    with Engine("127.0.0.1", {"EnableUseFabricMem": fabric}) as engine:
        engine.connect(node.engine, timeout=10)
        kv = pool_segment(engine, node.engine, "kv")
        before = snapshot(engine, node.engine, kv)
        value = pattern(9, size).tobytes()  # a bytes object: never registered
        addr = np.frombuffer(value, np.uint8).ctypes.data
        with pytest.raises(OutOfRange, match="must be registered"):
            engine.transfer(node.engine, TransferOp.WRITE, [(addr, kv.base + 3, size)])
        assert snapshot(engine, node.engine, kv) == before
        engine.transfer(node.engine, TransferOp.WRITE, [(addr, kv.base + 3, size)],
                        local_registered=False)
        after = snapshot(engine, node.engine, kv)
        assert after[3:3 + size] == value
        assert after[:3] == before[:3] and after[3 + size:] == before[3 + size:]
        out, out_addr = new_bytes(size)
        engine.transfer(node.engine, TransferOp.READ, [(out_addr, kv.base + 3, size)],
                        local_registered=False)
        assert out == value


@FABRIC
def test_two_client_processes_see_each_others_bytes(node, fabric: str) -> None:
    """Process A writes, process B (the other data path) reads the same bytes, and back."""
    other = "0" if fabric == "1" else "1"
    with Engine("127.0.0.1", {"EnableUseFabricMem": fabric}) as engine:
        engine.connect(node.engine, timeout=10)
        kv = pool_segment(engine, node.engine, "kv")
        ranges = [(kv.base + 7, 100_000), (kv.base + 300_001, 1 << 20), (kv.base + kv.length - 5, 5)]
        total = sum(n for _, n in ranges)
        data = pattern(99, total)
        engine.register(data)
        descs, offset = [], 0
        for addr, length in ranges:
            descs.append(TransferOpDesc(data.ctypes.data + offset, addr, length))
            offset += length
        engine.transfer(node.engine, TransferOp.WRITE, descs, timeout=10)
        digest = run_worker({"agent": node.engine, "fabric": other, "op": "read", "ranges": ranges})
        assert digest == hashlib.sha256(data.tobytes()).hexdigest()

        assert run_worker({"agent": node.engine, "fabric": other, "op": "write",
                           "ranges": ranges, "seed": 5}) == "ok"
        back = np.zeros(total, np.uint8)
        engine.register(back)
        engine.transfer(node.engine, TransferOp.READ,
                        [TransferOpDesc(back.ctypes.data + d.local_addr - data.ctypes.data,
                                        d.remote_addr, d.len) for d in descs], timeout=10)
        assert back.tobytes() == pattern(5, total).tobytes()


def test_fabric_engine_maps_and_socket_engine_streams(node) -> None:
    """Both paths are really taken: the fabric engine never touches the data server."""
    from hixl.client.agent_client import AgentClient

    with AgentClient(node.engine, timeout=10) as admin:
        before = admin.stats()
        with Engine("127.0.0.1", {"EnableUseFabricMem": "1"}) as engine:
            engine.connect(node.engine, timeout=10)
            kv = pool_segment(engine, node.engine, "kv")
            buf = pattern(3, 1 << 20)
            engine.register(buf)
            engine.write(node.engine, buf, kv.base)
        mid = admin.stats()
        with Engine("127.0.0.1", {"EnableUseFabricMem": "0"}) as engine:
            engine.connect(node.engine, timeout=10)
            out = np.zeros(1 << 20, np.uint8)
            engine.register(out)
            engine.read(node.engine, out, kv.base)
            assert out.tobytes() == buf.tobytes()
        after = admin.stats()
    assert mid["data_bytes_written"] == before["data_bytes_written"]
    assert mid["data_bytes_read"] == before["data_bytes_read"]
    assert after["data_bytes_read"] - mid["data_bytes_read"] == 1 << 20


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("client", ["1", "0"], indirect=True, ids=["fabric", "socket"])
def test_bad_input_is_refused_by_name_and_changes_nothing(client) -> None:
    engine, agent = client
    kv = pool_segment(engine, agent, "kv")
    ro = pool_segment(engine, agent, "ro")
    seed_kv, seed_ro = pattern(11, kv.length), snapshot(engine, agent, ro)
    engine.register(seed_kv)
    engine.write(agent, seed_kv, kv.base, timeout=10)
    buf = pattern(12, 1 << 20)
    engine.register(buf)
    unregistered = pattern(13, 4096)
    addr = buf.ctypes.data

    cases: list[tuple[type[HixlError], str, list]] = [
        (OutOfRange, "registered", [TransferOpDesc(unregistered.ctypes.data, kv.base, 4096)]),
        (OutOfRange, "not inside any registered segment",
         [TransferOpDesc(addr, kv.base + kv.length + (64 << 20), 16)]),
        (OutOfRange, "crosses the end", [TransferOpDesc(addr, kv.base + kv.length - 10, 11)]),
        (ParamInvalid, "length must be positive", [TransferOpDesc(addr, kv.base, 0)]),
        (ParamInvalid, "length must be positive", [TransferOpDesc(addr, kv.base, -5)]),
        (ParamInvalid, "overflows", [TransferOpDesc(addr, kv.base, (1 << 64) - 1)]),
        (OutOfRange, "crosses the end", [TransferOpDesc(addr, kv.base, kv.length + 1)]),
        (PermissionDenied, "read-only", [TransferOpDesc(addr, ro.base, 4096)]),
        (ParamInvalid, "integers", [TransferOpDesc(addr, kv.base, 1.5)]),
        (ParamInvalid, "non-empty", []),
        # one bad op spoils the batch before any byte of the good ones moves
        (OutOfRange, "crosses the end", [TransferOpDesc(addr, kv.base, 4096),
                                         TransferOpDesc(addr, kv.base + kv.length - 1, 2)]),
    ]
    for error, words, descs in cases:
        with pytest.raises(error, match=words) as info:
            engine.transfer(agent, TransferOp.WRITE, descs)
        assert info.value.status == 103900  # PARAM_INVALID
    with pytest.raises(ParamInvalid, match="TransferOp"):
        engine.transfer(agent, 7, [TransferOpDesc(addr, kv.base, 16)])
    with pytest.raises(ParamInvalid, match="timeout"):
        engine.transfer(agent, TransferOp.WRITE, [TransferOpDesc(addr, kv.base, 16)], timeout=0)
    # a READ cannot land in read-only local memory
    frozen = np.frombuffer(bytes(4096), np.uint8)
    engine.register(frozen)
    with pytest.raises(PermissionDenied, match="read-only"):
        engine.read(agent, frozen, kv.base)

    assert snapshot(engine, agent, kv) == seed_kv.tobytes()
    assert snapshot(engine, agent, ro) == seed_ro


def test_connect_errors_and_transfers_outside_a_connection(node) -> None:
    with Engine("127.0.0.1", {"EnableUseFabricMem": "1"}) as engine:
        buf = np.zeros(4096, np.uint8)
        engine.register(buf)
        with pytest.raises(NotConnected, match="connect"):
            engine.write(node.engine, buf, 0x1000)
        with pytest.raises(HixlError, match="127.0.0.1:1"):  # nobody listens there
            engine.connect("127.0.0.1:1", timeout=2)
        with pytest.raises(ParamInvalid, match="engine name"):
            engine.connect("", timeout=1)
        engine.connect(node.engine, timeout=10)
        with pytest.raises(HixlError, match="already connected") as info:
            engine.connect(node.engine, timeout=10)
        assert info.value.status == 103903
        kv = pool_segment(engine, node.engine, "kv")
        engine.write(node.engine, buf, kv.base)
        engine.disconnect(node.engine)
        with pytest.raises(NotConnected):
            engine.write(node.engine, buf, kv.base)
        with pytest.raises(NotConnected):
            engine.disconnect(node.engine)


def test_registration_rules() -> None:
    with Engine("127.0.0.1") as engine:
        buf = np.zeros(1 << 16, np.uint8)
        handle = engine.register(buf)
        assert engine.register(buf) is handle  # same range: same handle, as in HIXL
        with pytest.raises(ParamInvalid, match="overlaps"):
            engine.register(buf.ctypes.data + 100, 100)
        with pytest.raises(ParamInvalid, match="length"):
            engine.register(buf.ctypes.data + (1 << 20), 0)
        with pytest.raises(ParamInvalid, match="buffer"):
            engine.register(object())
        with pytest.raises(HixlError, match="MEM_DEVICE"):
            from hixl import MemType
            engine.register(bytearray(16), mem_type=MemType.MEM_DEVICE)
        engine.deregister(handle)
        with pytest.raises(ParamInvalid, match="already deregistered"):
            engine.deregister(handle)
        # memoryview, bytearray, mmap and raw (addr, len) are all accepted
        import mmap
        for memory in (bytearray(64), memoryview(bytearray(64)), mmap.mmap(-1, 4096)):
            engine.deregister(engine.register(memory))


def test_read_only_segment_is_mapped_read_only_so_stray_writes_fault(node) -> None:
    """The kernel, not just hixl, refuses writes into a read-only segment's mapping."""
    ro = [s for s in node.info.segments if s.name == "ro"][0]
    fd_client = FdClient(node.info.fd_socket, timeout=10)
    try:
        with pytest.raises(PermissionDenied):
            fd_client.fetch(ro.segment_id, ro.epoch, writable=True)
        fd, length = fd_client.fetch(ro.segment_id, ro.epoch, writable=False)
        with pytest.raises(PermissionDenied):
            Mapping(fd, length, writable=True)
        os.close(fd)
    finally:
        fd_client.close()
    script = (
        "import ctypes, os, sys\n"
        "from hixl.client.agent_client import FdClient\n"
        "from hixl.memory import Mapping\n"
        f"c = FdClient({node.info.fd_socket!r}, timeout=10)\n"
        f"fd, n = c.fetch({ro.segment_id}, {ro.epoch}, writable=False)\n"
        "m = Mapping(fd, n, writable=False)\n"
        "print(bytes(m.view()[:1]).hex(), flush=True)\n"  # reading works
        "ctypes.memset(m.addr, 0x41, 1)\n"                 # writing must fault
        "print('wrote', flush=True)\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.returncode == -signal.SIGSEGV, (result.returncode, result.stdout, result.stderr)
    assert "wrote" not in result.stdout
    with Engine("127.0.0.1", {"EnableUseFabricMem": "1"}) as engine:
        engine.connect(node.engine, timeout=10)
        assert snapshot(engine, node.engine, ro) == bytes(ro.length)


def test_malformed_frames_on_the_real_agent_data_port(node) -> None:
    """Garbage on the data port gets an error or a closed connection; the agent serves on."""
    import socket
    import struct

    from hixl import wire

    host, port = node.info.data_tcp.rsplit(":", 1)
    kv = [s for s in node.info.segments if s.name == "kv"][0]

    def exchange(frames: bytes) -> bytes:
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(wire.hello(1, b"pytest") + frames)
            sock.shutdown(socket.SHUT_WR)
            chunks = []
            while chunk := sock.recv(65536):
                chunks.append(chunk)
            return b"".join(chunks)

    def replies(raw: bytes) -> list[wire.Header]:
        out = []
        while len(raw) >= wire.HEADER_SIZE:
            header = wire.decode_header(raw[:wire.HEADER_SIZE])
            out.append(header)
            raw = raw[wire.HEADER_SIZE + wire.payload_length(header):]
        return out

    # wrong segment id, then a wrong length (0), both answered with an error; the stream lives on
    answers = replies(exchange(wire.write_header(2, 9999, kv.epoch, kv.base, 4) + b"abcd"
                               + wire.read_request(3, kv.segment_id, kv.epoch, kv.base, 0)
                               + wire.read_request(4, kv.segment_id, kv.epoch, kv.base, 8)))
    assert [h.reason for h in answers] == [wire.Reason.OK, wire.Reason.UNKNOWN_SEGMENT,
                                           wire.Reason.BAD_LENGTH, wire.Reason.OK]
    # an unknown opcode: error reply, then the agent closes the stream
    bad_opcode = struct.pack("!HBBHHIIQQQQ", wire.MAGIC, wire.VERSION, 99, 0, 0, 0, 0, 5, 0, 0, 0)
    answers = replies(exchange(bad_opcode + wire.read_request(6, kv.segment_id, kv.epoch, kv.base, 8)))
    assert [h.reason for h in answers] == [wire.Reason.OK, wire.Reason.BAD_FRAME]
    # a write claiming more payload than a frame may carry: refused, stream closed
    answers = replies(exchange(wire.write_header(7, kv.segment_id, kv.epoch, kv.base, 1 << 40)))
    assert answers[-1].reason == wire.Reason.BAD_LENGTH
    # random bytes
    exchange(os.urandom(4096))
    # ... and the agent still serves everyone else
    with Engine("127.0.0.1", {"EnableUseFabricMem": "0"}) as engine:
        engine.connect(node.engine, timeout=10)
        data = pattern(21, 8192)
        engine.register(data)
        engine.write(node.engine, data, kv.base)
        assert snapshot(engine, node.engine, kv)[:8192] == data.tobytes()


def test_allocate_and_release_in_a_remote_pool(node) -> None:
    with Engine("127.0.0.1", {"EnableUseFabricMem": "1"}) as engine:
        engine.connect(node.engine, timeout=10)
        segment = engine.allocate(node.engine, 3 << 20, "rw", name="mine")
        assert segment in engine.segments(node.engine)
        data = pattern(31, 3 << 20)
        engine.register(data)
        engine.write(node.engine, data, segment.base)
        assert snapshot(engine, node.engine, segment) == data.tobytes()
        engine.release(node.engine, segment)
        assert segment not in engine.segments(node.engine)
        with pytest.raises(OutOfRange):
            engine.write(node.engine, data, segment.base)
        with pytest.raises(ParamInvalid, match="not registered"):
            engine.release(node.engine, segment)


def test_auto_connect_option_connects_on_first_use(node) -> None:
    with Engine("127.0.0.1", {"EnableUseFabricMem": "1", "AutoConnect": "1"}) as engine:
        kv = pool_segment(engine, node.engine, "kv")  # no connect() call first
        data = pattern(41, 8192)
        engine.register(data)
        engine.write(node.engine, data, kv.base + 100)
        assert snapshot(engine, node.engine, kv)[100:100 + 8192] == data.tobytes()
