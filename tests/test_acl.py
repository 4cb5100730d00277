"""Per-segment allow-lists (`allowed_engines`), enforced on every path.

A real hixl-agent serves pool segments from its config: one open to every engine, one
that only engine A may reach, and a read-only one that only A may reach. Client engines
run in their own processes (tests/helpers/engine_worker.py) where that is easy, else in
this one. Engines refuse a listed-out segment before any byte moves; the agent enforces
the list again on its own, which clients that skip the engine (a transport driven
directly, a raw HELLO claiming another name) show: the data server refuses their frames
(reason NOT_ALLOWED) and the fd socket their fd requests. Each refusal is checked to have
left the segment's bytes as they were.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import AgentProcess

from hixl import Engine, wire
from hixl.client.agent_client import AgentClient, FdClient
from hixl.control import error_from_rpc, segments_from_columns, segments_to_columns
from hixl.errors import AuthenticationFailed, ConfigError, ParamInvalid, PermissionDenied
from hixl.memory import Mapping, ShmSegment
from hixl.server.agent.config import AgentConfig
from hixl.tools import admin
from hixl.transports.base import Item
from hixl.transports.fabric import FabricTransport
from hixl.transports.tcp import SocketTransport
from hixl.types import MAX_ALLOWED_ENGINES, MemType, Perm, SegmentInfo, TransferOp
from hixl.v1 import agent_pb2, agent_pb2_grpc

pytestmark = pytest.mark.timeout(120)

WORKER = os.path.join(os.path.dirname(__file__), "helpers", "engine_worker.py")
StartAgent = Callable[..., AgentProcess]

# Client-only engines are named by their host, so two loopback addresses make two engines.
ALLOWED = "127.0.0.2"
OTHER = "127.0.0.3"
ELSEWHERE = "10.9.9.9:50161"  # a second name on the list, never connected
SIZE = 256 << 10
HALF = SIZE // 2
POOL = [{"name": "open", "size": SIZE},
        {"name": "acl", "size": SIZE, "allowed_engines": [ALLOWED, ELSEWHERE]},
        {"name": "acl-ro", "size": SIZE, "perms": "r", "allowed_engines": [ALLOWED]}]


def pattern(seed: int, size: int) -> np.ndarray:
    """The bytes engine_worker.py writes for `seed` (same generator)."""
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def run_worker(local: str, fabric: bool, steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One client engine named `local` in its own process; one JSON answer per step."""
    job = {"local": local, "fabric": "1" if fabric else "0", "steps": steps}
    done = subprocess.run([sys.executable, WORKER, json.dumps(job)], capture_output=True,
                          text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def by_name(agent: AgentProcess) -> dict[str, SegmentInfo]:
    with AgentClient(agent.engine) as client:
        return {s.name: s for s in client.list_segments()[1]}


def segment_bytes(agent: AgentProcess, segment: SegmentInfo) -> bytes:
    """What the segment holds now, through a read-only mapping of its fd (as engine A)."""
    with FdClient(agent.info.fd_socket, engine=ALLOWED) as fdc:
        fd, length = fdc.fetch(segment.segment_id, segment.epoch, False)
    try:
        with contextlib.closing(Mapping(fd, length, writable=False)) as mapping:
            return bytes(mapping.view())
    finally:
        os.close(fd)


@pytest.fixture
def acl_agent(agent_process: StartAgent) -> AgentProcess:
    return agent_process(config={"pool": POOL})


# ---------------------------------------------------------------- engines, both paths


@pytest.mark.parametrize("fabric", [True, False], ids=["fabric", "socket"])
def test_allowed_engine_moves_bytes_and_the_other_is_refused(acl_agent: AgentProcess,
                                                            fabric: bool) -> None:
    agent = acl_agent
    segs = by_name(agent)
    acl, ro, open_ = segs["acl"], segs["acl-ro"], segs["open"]
    assert acl.allowed_engines == tuple(sorted([ALLOWED, ELSEWHERE]))
    assert ro.allowed_engines == (ALLOWED,) and ro.perms == Perm.READ
    assert open_.allowed_engines == ()
    path = "fabric" if fabric else "unix"
    target = agent.engine

    allowed = run_worker(ALLOWED, fabric, [
        {"do": "connect", "agent": target},
        {"do": "route", "agent": target, "addr": acl.base},
        {"do": "write", "agent": target, "ranges": [[acl.base, HALF]], "seed": 1},
        {"do": "write", "agent": target, "ranges": [[acl.base + HALF, HALF]], "seed": 2},
        {"do": "read", "agent": target, "ranges": [[acl.base, SIZE]]},
        {"do": "read", "agent": target, "ranges": [[ro.base, SIZE]]},
        {"do": "write", "agent": target, "ranges": [[ro.base, 4096]], "seed": 3},
    ])
    connect, route, put1, put2, get, get_ro, put_ro = allowed
    # the published list reached the client's table
    [seen] = [s for s in connect["segments"] if s["name"] == "acl"]
    assert seen["allowed_engines"] == list(acl.allowed_engines)
    assert route == {"route": path}
    expected = np.concatenate([pattern(1, HALF), pattern(2, HALF)]).tobytes()
    assert "error" not in put1 and "error" not in put2
    assert segment_bytes(agent, acl) == expected  # byte for byte, in the segment itself
    assert get["sha256"] == hashlib.sha256(expected).hexdigest()  # and read back
    assert get_ro["sha256"] == hashlib.sha256(bytes(SIZE)).hexdigest()
    # read-only and allowed: writes still refused by the segment's perms
    assert put_ro["error"] == "PermissionDenied" and put_ro["failed"] == [0]
    assert "read-only" in put_ro["message"]

    before_open = segment_bytes(agent, open_)
    other = run_worker(OTHER, fabric, [
        {"do": "connect", "agent": target},
        {"do": "write", "agent": target, "ranges": [[acl.base, 4096]], "seed": 9},
        {"do": "read", "agent": target, "ranges": [[acl.base, 4096]]},
        {"do": "read", "agent": target, "ranges": [[ro.base, 4096]]},
        # a batch mixing an open segment and a listed-out one moves nothing at all
        {"do": "write", "agent": target,
         "ranges": [[open_.base, 4096], [acl.base + 8192, 4096]], "seed": 9},
        {"do": "write", "agent": target, "ranges": [[open_.base + 4096, 4096]], "seed": 5},
    ])
    _, put, get, get_ro, mixed, put_open = other
    for answer in (put, get, get_ro):
        assert answer["error"] == "PermissionDenied" and answer["failed"] == [0]
        assert f"engine '{OTHER}' may not reach segment" in answer["message"]
        assert answer["status"] == PermissionDenied.status
    assert mixed["error"] == "PermissionDenied" and mixed["failed"] == [1]
    assert f"segment {acl.segment_id} " in mixed["message"]
    assert "error" not in put_open  # the open segment still serves every engine
    assert segment_bytes(agent, acl) == expected  # unchanged by every refusal
    after_open = segment_bytes(agent, open_)
    assert after_open[:4096] == before_open[:4096]  # the refused batch's first op
    assert after_open[4096:8192] == pattern(5, 4096).tobytes()


# ---------------------------------------------------------------- the agent's own checks


def _fill(engine: Engine, size: int, seed: int) -> tuple[np.ndarray, int]:
    buf = pattern(seed, size)
    engine.register(buf)
    return buf, buf.ctypes.data


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_data_server_refuses_frames_of_an_engine_not_listed(acl_agent: AgentProcess,
                                                            transport: str) -> None:
    """A client that skips the engine's check (a transport driven directly) is refused by
    the data server: before any byte moves, per op, the other ops of the batch served."""
    agent = acl_agent
    segs = by_name(agent)
    acl, open_ = segs["acl"], segs["open"]
    address = (f"tcp://{agent.info.data_tcp}" if transport == "tcp"
               else f"unix://{agent.info.data_unix}")
    before = segment_bytes(agent, acl)
    with Engine("127.0.0.1") as local:  # just registered memory for the transports
        src, src_addr = _fill(local, 3 * 4096, seed=11)
        dst = np.zeros(3 * 4096, np.uint8)
        local.register(dst)
        items = [Item(0, src_addr, open_, open_.base, 4096),
                 Item(1, src_addr + 4096, acl, acl.base, 4096),
                 Item(2, src_addr + 8192, open_, open_.base + 4096, 4096)]
        deadline = time.monotonic() + 10
        with contextlib.closing(SocketTransport(address, identity=OTHER)) as other:
            with pytest.raises(PermissionDenied) as refused:
                other.transfer(TransferOp.WRITE, items, deadline)
            assert refused.value.failed == [1]
            message = str(refused.value)
            assert f"engine '{OTHER}' may not reach segment {acl.segment_id}" in message
            reads = [Item(i, dst.ctypes.data + 4096 * i, it.segment, it.remote_addr, 4096)
                     for i, it in enumerate(items)]
            with pytest.raises(PermissionDenied) as refused_read:
                other.transfer(TransferOp.READ, reads, deadline)
            assert refused_read.value.failed == [1]
        assert segment_bytes(agent, acl) == before
        opened = segment_bytes(agent, open_)
        assert opened[:8192] == src[:4096].tobytes() + src[8192:].tobytes()
        assert dst[:4096].tobytes() == src[:4096].tobytes()  # the allowed ops were served
        assert not dst[4096:8192].any()  # nothing landed for the refused one
        with contextlib.closing(SocketTransport(address, identity=ALLOWED)) as allowed:
            allowed.transfer(TransferOp.WRITE, items, deadline)
        assert segment_bytes(agent, acl)[:4096] == src[4096:8192].tobytes()


def test_a_refused_frame_names_the_reason_and_keeps_the_connection(
        acl_agent: AgentProcess) -> None:
    """On the wire: NOT_ALLOWED before the payload is taken in; the stream stays in step."""
    agent = acl_agent
    acl = by_name(agent)["acl"]
    before = segment_bytes(agent, acl)
    client = wire.ClientProtocol()
    host, port = agent.info.data_tcp.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(client.hello(OTHER.encode()) + client.write(acl.segment_id, acl.epoch,
                                                                 acl.base, 16)
                     + b"x" * 16 + client.ping())
        stream = sock.makefile("rb")
        replies = []
        for _ in range(3):
            header = client.on_reply_header(stream.read(wire.HEADER_SIZE))
            replies.append((header, stream.read(wire.payload_length(header))))
    (hello, _), (write, text), (ping, _) = replies
    assert hello.status == 0 and ping.status == 0
    assert write.reason == wire.Reason.NOT_ALLOWED
    error = wire.reply_error(write, text)
    assert isinstance(error, PermissionDenied)
    assert f"engine '{OTHER}' may not reach segment {acl.segment_id}" in str(error)
    assert segment_bytes(agent, acl) == before


def test_fd_socket_hands_the_fd_only_to_listed_engines(acl_agent: AgentProcess) -> None:
    agent = acl_agent
    segs = by_name(agent)
    acl, ro, open_ = segs["acl"], segs["acl-ro"], segs["open"]
    path = agent.info.fd_socket
    for name in (OTHER, ""):  # another engine, or one that does not say
        with FdClient(path, engine=name) as fdc:
            for seg, writable in ((acl, True), (acl, False), (ro, False)):
                with pytest.raises(PermissionDenied,
                                   match=f"may not map segment {seg.segment_id} "):
                    fdc.fetch(seg.segment_id, seg.epoch, writable)
            fd, _ = fdc.fetch(open_.segment_id, open_.epoch, True)  # open: still served
            os.close(fd)
    with FdClient(path, engine=ALLOWED) as fdc:
        fd, length = fdc.fetch(acl.segment_id, acl.epoch, True)
        try:
            mapping = Mapping(fd, length, writable=True)
            mapping.view()[:5] = b"hello"
            mapping.close()
        finally:
            os.close(fd)
        # allowed, but read-only: a write fd is refused, a read fd cannot be mapped rw
        with pytest.raises(PermissionDenied, match="read-only"):
            fdc.fetch(ro.segment_id, ro.epoch, True)
        fd, length = fdc.fetch(ro.segment_id, ro.epoch, False)
        try:
            with pytest.raises(PermissionDenied, match="does not allow it"):
                Mapping(fd, length, writable=True)
        finally:
            os.close(fd)
    assert segment_bytes(agent, acl)[:5] == b"hello"

    # the fabric transport surfaces the refusal with the ops not done: every segment is
    # mapped before any copy, so none is (nothing moved)
    with Engine("127.0.0.1") as local:
        src, src_addr = _fill(local, 8192, seed=4)
        with FdClient(path, engine=OTHER) as fdc:
            fabric = FabricTransport(agent.engine, fdc)
            items = [Item(0, src_addr, open_, open_.base, 4096),
                     Item(1, src_addr + 4096, acl, acl.base, 4096)]
            with pytest.raises(PermissionDenied, match=f"may not map segment {acl.segment_id}") \
                    as refused:
                fabric.transfer(TransferOp.WRITE, items, time.monotonic() + 10)
            fabric.close()
        assert refused.value.failed == [0, 1]
    assert segment_bytes(agent, acl)[:5] == b"hello"


def test_the_claimed_name_is_bound_by_the_cluster_token(agent_process: StartAgent) -> None:
    token = "acl-test-token-0123456789"
    agent = agent_process(config={"pool": POOL}, env={"HIXL_CLUSTER_TOKEN": token})
    acl = by_name_with(agent, token)["acl"]
    address = f"tcp://{agent.info.data_tcp}"
    with Engine("127.0.0.1", cluster_token=token) as local:
        _, src_addr = _fill(local, 4096, seed=6)
        items = [Item(0, src_addr, acl, acl.base, 4096)]
        deadline = time.monotonic() + 10
        with contextlib.closing(SocketTransport(address, identity=ALLOWED,
                                                cluster_token=token)) as allowed:
            allowed.transfer(TransferOp.WRITE, items, deadline)
        with contextlib.closing(SocketTransport(address, identity=OTHER,
                                                cluster_token=token)) as other, \
                pytest.raises(PermissionDenied, match=f"'{OTHER}' may not reach"):
            other.transfer(TransferOp.WRITE, items, deadline)
        # claiming the listed name is not enough without the token
        with contextlib.closing(SocketTransport(address, identity=ALLOWED)) as impostor, \
                pytest.raises(AuthenticationFailed):
            impostor.transfer(TransferOp.WRITE, items, deadline)


def by_name_with(agent: AgentProcess, token: str) -> dict[str, SegmentInfo]:
    with AgentClient(agent.engine, cluster_token=token) as client:
        return {s.name: s for s in client.list_segments()[1]}


# ---------------------------------------------------------------- setting a list


def test_allocate_and_register_with_an_allow_list(agent_process: StartAgent) -> None:
    agent = agent_process(config={"pool_max_bytes": "4MiB"})
    with Engine(ALLOWED) as allowed, Engine(OTHER) as other:
        allowed.connect(agent.engine)
        other.connect(agent.engine)
        seg = allowed.allocate(agent.engine, 64 << 10, name="mine", allowed_engines=[ALLOWED])
        assert seg.allowed_engines == (ALLOWED,)
        src, src_addr = _fill(allowed, 4096, seed=8)
        allowed.write(agent.engine, src_addr, seg.base, 4096)
        _, other_addr = _fill(other, 4096, seed=9)
        with pytest.raises(PermissionDenied, match="may not reach") as refused:
            other.write(agent.engine, other_addr, seg.base, 4096)  # refreshes its table
        assert refused.value.failed == [0]
        assert segment_bytes(agent, seg)[:4096] == src.tobytes()

        # a client's own memfd, registered with a list over the fd socket + RegisterSegment
        with contextlib.closing(ShmSegment(64 << 10)) as shm, \
                AgentClient(agent.engine) as client:
            shm.view()[:4] = b"memf"
            deposited = client.register_fd(shm.fd, shm.length, agent.info.fd_socket,
                                           name="deposited", allowed_engines=[OTHER, OTHER])
            assert deposited.allowed_engines == (OTHER,)
            got = np.zeros(4, np.uint8)
            other.register(got)
            other.read(agent.engine, got, deposited.base)
            assert got.tobytes() == b"memf"
            dst = np.zeros(4, np.uint8)
            allowed.register(dst)
            with pytest.raises(PermissionDenied):
                allowed.read(agent.engine, dst, deposited.base)
            assert not dst.any()
            client.deregister(deposited.segment_id, deposited.epoch)

        # published: the agent's embedded registry, as `hixl segments` shows it
        listing = admin.segments(agent=agent.engine, token=None)
        [row] = [r for r in listing["segments"] if r["name"] == "mine"]
        assert row["allowed_engines"] == [ALLOWED]
        [line] = [line for line in admin.format_segments(listing).splitlines()
                  if " mine " in line]
        assert f" {ALLOWED} " in line


def test_an_embedded_agent_serves_its_memory_to_listed_engines_only(tmp_path: Path) -> None:
    """Engine.malloc / Engine.register with a list: the fabric path (malloc'd shm) and the
    socket path (plain process memory) of an engine's own agent."""
    config = AgentConfig(host="127.0.0.1", grpc_port=0, runtime_dir=str(tmp_path / "run"))
    fabric = {"EnableUseFabricMem": "1"}
    with Engine("127.0.0.1", agent_config=config) as owner, \
            Engine(ALLOWED, fabric) as allowed, Engine(OTHER, fabric) as other:
        shm = owner.malloc(64 << 10, allowed_engines=[ALLOWED])
        shared = owner.register(shm)  # takes malloc's list
        plain = np.zeros(64 << 10, np.uint8)
        private = owner.register(plain, allowed_engines=[ALLOWED])
        open_buf = np.zeros(4096, np.uint8)
        opened = owner.register(open_buf, allowed_engines=[])
        assert shared.segment.allowed_engines == private.segment.allowed_engines == (ALLOWED,)
        assert shared.segment.shareable and not private.segment.shareable
        assert opened.segment.allowed_engines == ()
        for engine in (allowed, other):
            engine.connect(owner.name)
        assert allowed.route(owner.name, shared.addr) == "fabric"
        assert allowed.route(owner.name, private.addr) == "unix"
        src, src_addr = _fill(allowed, 4096, seed=12)
        allowed.write(owner.name, src_addr, shared.addr, 4096)
        allowed.write(owner.name, src_addr, private.addr, 4096)
        assert shm.view()[:4096] == src.tobytes() and plain[:4096].tobytes() == src.tobytes()
        _, bad_addr = _fill(other, 4096, seed=13)
        for target in (shared.addr, private.addr):
            with pytest.raises(PermissionDenied, match=f"'{OTHER}' may not reach"):
                other.write(owner.name, bad_addr, target, 4096)
        other.write(owner.name, bad_addr, opened.addr, 4096)
        assert shm.view()[:4096] == src.tobytes() and plain[:4096].tobytes() == src.tobytes()
        assert open_buf.tobytes() == pattern(13, 4096).tobytes()
        owner.deregister(shared)
        owner.free(shm)


# ---------------------------------------------------------------- bad lists


@pytest.mark.parametrize("value, problem", [
    ("127.0.0.2", "must be a list of engine names"),
    ({"a": 1}, "must be a list of engine names"),
    ([""], "non-empty engine name"),
    ([7], "non-empty engine name"),
    (["a b:1"], "whitespace"),
    (["x" * 300], "longer than 255 bytes"),
    ([f"10.0.0.{i}:1" for i in range(MAX_ALLOWED_ENGINES + 1)], "at most 256"),
])
def test_bad_allow_lists_are_refused_by_name(value: Any, problem: str) -> None:
    entry = {"name": "kv", "size": 4096, "allowed_engines": value}
    with pytest.raises(ConfigError, match=f"key 'pool'.*entry \\[0\\].*allowed_engines.*{problem}"):
        AgentConfig.load(overrides={"pool": [entry]}, env={})
    text = json.dumps([entry])  # the same through HIXL_AGENT_POOL
    with pytest.raises(ConfigError, match=f"HIXL_AGENT_POOL.*allowed_engines.*{problem}"):
        AgentConfig.load(env={"HIXL_AGENT_POOL": text})
    if isinstance(value, dict):
        return  # an SDK caller's mapping iterates its keys, like any other iterable
    with Engine("127.0.0.1") as engine:
        with pytest.raises(ParamInvalid, match=f"allowed_engines.*{problem}"):
            engine.malloc(4096, allowed_engines=value)
        buf = np.zeros(16, np.uint8)
        with pytest.raises(ParamInvalid, match=f"allowed_engines.*{problem}"):
            engine.register(buf, allowed_engines=value)
        engine.register(buf)  # not registered by the refused call: no overlap now


def test_a_good_pool_entry_and_the_agent_refusing_a_bad_request(
        agent_process: StartAgent) -> None:
    config = AgentConfig.load(overrides={"pool": POOL}, env={})
    assert [e.allowed_engines for e in config.pool] == [
        (), tuple(sorted([ALLOWED, ELSEWHERE])), (ALLOWED,)]
    agent = agent_process()
    with grpc.insecure_channel(agent.engine) as channel:
        stub = agent_pb2_grpc.AgentStub(channel)
        for bad in ([""], ["x" * 300], ["tab\there"]):
            with pytest.raises(grpc.RpcError) as failed:
                stub.AllocateSegment(agent_pb2.AllocateSegmentRequest(
                    size=4096, allowed_engines=bad), timeout=10)
            error = error_from_rpc(failed.value, "allocate")
            assert isinstance(error, ParamInvalid) and "allowed_engines" in str(error)
        with AgentClient(agent.engine) as client:
            assert client.list_segments()[1] == []  # nothing allocated
            with pytest.raises(ParamInvalid, match="allowed_engines"):
                client.allocate(4096, allowed_engines="a:1")


# ---------------------------------------------------------------- the published form


def test_allow_lists_survive_the_compact_snapshot_form() -> None:
    segments = [SegmentInfo(segment_id=i + 1, engine="a:1", node_id="n", base=(i + 1) << 20,
                            length=4096, mem_type=MemType.MEM_HOST, perms=Perm.RW, epoch=3,
                            shareable=True, name=f"s{i}",
                            allowed_engines=(ALLOWED, OTHER) if i % 3 == 1 else ())
                for i in range(7)]
    blocks = segments_to_columns(segments, chunk=4)
    assert [len(b.allowed_engines) for b in blocks] == [1, 1]  # sparse: listed ones only
    wire_blocks = [agent_pb2.SegmentColumns.FromString(b.SerializeToString()) for b in blocks]
    decoded = [s for b in wire_blocks for s in segments_from_columns(b)]
    assert decoded == segments and {hash(s) for s in decoded} == {hash(s) for s in segments}
    bad = agent_pb2.SegmentColumns()
    bad.CopyFrom(blocks[1])
    bad.allowed_engines[0].index = 9
    with pytest.raises(ParamInvalid, match="allow-list for segment #9"):
        segments_from_columns(bad)
    bad.allowed_engines[0].index = 0
    bad.allowed_engines[0].engines.append("")
    with pytest.raises(ParamInvalid, match="allowed_engines"):
        segments_from_columns(bad)
