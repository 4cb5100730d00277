"""hixl-agent as a real process: gRPC control plane, fd socket, watch, shutdown, death."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from functools import partial

import grpc
import numpy as np
import pytest
import waiting
from conftest import AgentProcess, agent_command, clean_env, parse_ready, start_agent

from hixl import wire
from hixl.client.agent_client import AgentClient, FdClient
from hixl.control import error_from_rpc
from hixl.errors import (
    HixlError,
    NotConnected,
    ParamInvalid,
    PeerUnavailable,
    PermissionDenied,
    ResourceExhausted,
    StaleEpoch,
    TransferTimeout,
)
from hixl.memory import PAGE_SIZE, Mapping, ShmSegment
from hixl.processes import free_port
from hixl.registry_client import RegistryClient
from hixl.server.agent.config import AgentConfig
from hixl.server.agent.runtime import AgentServer
from hixl.tools.daemons import MasterProcess
from hixl.types import MemType, Perm
from hixl.v1 import agent_pb2, agent_pb2_grpc

StartAgent = Callable[..., AgentProcess]


def test_ready_line_and_handshake(agent_process: StartAgent) -> None:
    agent = agent_process(config={"node_id": "node-x", "pool": [{"name": "kv", "size": "1MiB"}]})
    proc, engine, info = agent
    fields = parse_ready(agent.ready_line)
    assert fields["engine"] == engine == info.engine
    assert int(fields["epoch"]) == info.epoch != 0
    assert fields["data"] == info.data_tcp and fields["fd"] == info.fd_socket
    assert info.node_id == info.fabric_domain == "node-x"
    assert info.data_unix == os.path.join(agent.runtime_dir, f"agent-{engine.rsplit(':')[1]}"
                                          ".data.sock")
    assert info.fd_socket.endswith(".fd.sock") and os.path.exists(info.fd_socket)
    assert os.stat(info.fd_socket).st_mode & 0o777 == 0o660
    [pool] = info.segments
    assert (pool.name, pool.length, pool.perms, pool.engine, pool.epoch, pool.mem_type) == (
        "kv", 1 << 20, Perm.RW, engine, info.epoch, MemType.MEM_HOST)
    assert pool.shareable and pool.node_id == "node-x"


def test_control_plane_round_trip(agent_process: StartAgent) -> None:
    _, engine, info = agent_process(config={"pool_max_bytes": "64KiB"})
    with AgentClient(engine) as client:
        epoch, segments = client.list_segments()
        assert (epoch, segments) == (info.epoch, [])
        seg = client.allocate(10_000, Perm.RW, name="blk", owner="pytest:1")
        assert seg.length == 12288 and seg.name == "blk" and seg.epoch == info.epoch
        ro = client.allocate(PAGE_SIZE, Perm.READ, name="ro")
        assert ro.perms == Perm.READ
        assert client.list_segments()[1] == [seg, ro]
        with pytest.raises(ResourceExhausted, match="pool_max_bytes"):
            client.allocate(1 << 20)
        with pytest.raises(ParamInvalid):
            client.allocate(0)
        client.deregister(seg.segment_id, seg.epoch)
        with pytest.raises(ParamInvalid, match="already deregistered"):
            client.deregister(seg.segment_id, seg.epoch)
        with pytest.raises(StaleEpoch):
            client.deregister(ro.segment_id, info.epoch ^ 1)
        assert client.list_segments()[1] == [ro]
        health = client.health()
        assert health["status"] == "SERVING" and health["engine"] == engine
        assert health["epoch"] == info.epoch and health["uptime_s"] >= 0
        stats = client.stats()
        assert stats["allocations"] == 2 and stats["deregistrations"] == 1
        assert stats["segments"] == 1 and stats["pool_bytes_charged"] == PAGE_SIZE
        assert "data_bytes_written" in stats and "fd_requests" in stats


def test_fd_fetch_maps_shared_memory(agent_process: StartAgent) -> None:
    _, engine, info = agent_process()
    with AgentClient(engine) as client, FdClient(info.fd_socket) as fdc:
        seg = client.allocate(2 * PAGE_SIZE, name="shared")
        assert fdc.alive()
        fd1, length = fdc.fetch(seg.segment_id, seg.epoch, True)
        fd2, length2 = fdc.fetch(seg.segment_id, seg.epoch, False)
        assert length == length2 == seg.length
        writer = Mapping(fd1, length, writable=True)
        reader = Mapping(fd2, length, writable=False)
        os.close(fd1)
        os.close(fd2)
        pattern = bytes(range(256)) * (length // 256)
        writer.view()[:] = pattern
        assert bytes(reader.view()) == pattern
        writer.close()
        reader.close()


def test_fd_fetch_read_only_segment(agent_process: StartAgent) -> None:
    _, engine, info = agent_process()
    with AgentClient(engine) as client, FdClient(info.fd_socket) as fdc:
        ro = client.allocate(PAGE_SIZE, Perm.READ, name="ro")
        with pytest.raises(PermissionDenied, match="read-only"):
            fdc.fetch(ro.segment_id, ro.epoch, True)
        fd, length = fdc.fetch(ro.segment_id, ro.epoch, False)
        try:
            with pytest.raises(PermissionDenied):
                Mapping(fd, length, writable=True)  # the kernel refuses PROT_WRITE
        finally:
            os.close(fd)
        with pytest.raises(StaleEpoch):
            fdc.fetch(ro.segment_id, ro.epoch ^ 0xFF, False)
        with pytest.raises(ParamInvalid, match="not registered"):
            fdc.fetch(12345, ro.epoch, False)
        assert fdc.alive()  # errors never cost the connection


def test_register_deposited_fd(agent_process: StartAgent) -> None:
    _, engine, info = agent_process()
    mine = ShmSegment(4 * PAGE_SIZE)
    try:
        mine.view()[:6] = b"client"
        with AgentClient(engine) as client:
            seg = client.register_fd(mine.fd, mine.length, info.fd_socket, Perm.RW,
                                     name="deposited", owner="pytest")
            assert seg.shareable and seg.length == mine.length and seg.name == "deposited"
            with FdClient(info.fd_socket) as fdc:
                fd, length = fdc.fetch(seg.segment_id, seg.epoch, True)
                peer = Mapping(fd, length, writable=True)
                os.close(fd)
                assert bytes(peer.view()[:6]) == b"client"
                peer.view()[-4:] = b"peer"
                assert bytes(mine.view()[-4:]) == b"peer"
                peer.close()
                ticket = fdc.deposit(mine.fd, mine.length)
            # a ticket is single use
            request = agent_pb2.RegisterSegmentRequest(fd_ticket=ticket, length=mine.length)
            with grpc.insecure_channel(engine) as channel:
                stub = agent_pb2_grpc.AgentStub(channel)
                stub.RegisterSegment(request, timeout=5)
                with pytest.raises(grpc.RpcError) as err:
                    stub.RegisterSegment(request, timeout=5)
            typed = error_from_rpc(err.value, "register")
            assert type(typed) is ParamInvalid and "already used" in str(typed)
            with pytest.raises(ParamInvalid, match="fewer than length"):
                client.register_fd(mine.fd, mine.length + PAGE_SIZE, info.fd_socket)
            assert len(client.list_segments()[1]) == 2
    finally:
        mine.close()


def test_fd_socket_refuses_other_uids(agent_process: StartAgent) -> None:
    other = os.getuid() + 4242
    _, engine, info = agent_process(config={"allowed_uids": [other]})
    with AgentClient(engine) as client:
        seg = client.allocate(PAGE_SIZE)
    with FdClient(info.fd_socket) as fdc:
        with pytest.raises(PermissionDenied) as err:
            fdc.fetch(seg.segment_id, seg.epoch, False)
        assert f"uid {os.getuid()}" in str(err.value) and str(other) in str(err.value)
    with FdClient(info.fd_socket) as fdc, pytest.raises(PermissionDenied):
        fdc.ping()


def test_fd_socket_survives_malformed_requests(agent_process: StartAgent) -> None:
    _, engine, info = agent_process()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(10)
    sock.connect(info.fd_socket)

    def ask(payload: bytes, fds: list[int] | None = None) -> dict:
        if fds:
            socket.send_fds(sock, [payload], fds)
        else:
            sock.send(payload)
        data, got, _, _ = socket.recv_fds(sock, 8192, 4)
        for fd in got:
            os.close(fd)
        return json.loads(data)

    bad = [b"not json", b"\xff\xfe", b"[1, 2]", b"{}", b'{"op": "explode"}',
           b'{"op": "get_fd"}', b'{"op": "get_fd", "segment_id": "1", "epoch": 1}',
           b'{"op": "get_fd", "segment_id": 1, "epoch": -1}',
           b'{"op": "get_fd", "segment_id": 1, "epoch": 1, "write": "yes"}',
           b'{"op": "deposit", "length": 10}', b"x" * 10000]
    for payload in bad:
        reply = ask(payload)
        assert reply["ok"] is False and reply["status"] == 103900, (payload, reply)
        assert reply["error"] and reply["kind"] == "ParamInvalid", reply
    read_end, write_end = os.pipe()
    try:
        reply = ask(b'{"op": "ping"}', [read_end])  # stray fd: refused and closed by agent
        assert reply["ok"] is False and "takes no fds" in reply["error"]
        reply = ask(b'{"op": "deposit", "length": 10}', [read_end])
        assert reply["ok"] is False and "not a memfd" in reply["error"]
    finally:
        os.close(read_end)
        os.close(write_end)
    assert ask(b'{"op": "ping"}') == {"ok": True, "epoch": info.epoch, "engine": engine}
    sock.close()
    with AgentClient(engine) as client:
        assert client.health()["status"] == "SERVING"
        assert client.stats()["fd_errors"] == len(bad) + 2


def test_watch_sees_added_and_removed(agent_process: StartAgent) -> None:
    _, engine, info = agent_process(config={"pool": [{"name": "p", "size": 4096}]})
    events: queue.Queue = queue.Queue()
    with AgentClient(engine) as client:
        stream = client.watch(timeout=60)

        def pump() -> None:
            try:
                for event in stream:
                    events.put(event)
            except Exception as exc:  # noqa: BLE001 - reported to the test thread
                events.put(exc)

        thread = threading.Thread(target=pump, daemon=True)
        thread.start()
        kind, epoch, segs = events.get(timeout=10)
        assert (kind, epoch, [s.name for s in segs]) == ("SNAPSHOT", info.epoch, ["p"])
        seg = client.allocate(PAGE_SIZE, name="w")
        assert events.get(timeout=10) == ("ADDED", info.epoch, [seg])
        client.deregister(seg.segment_id, seg.epoch)
        assert events.get(timeout=10) == ("REMOVED", info.epoch, [seg])
        stream.close()
        thread.join(10)
        assert not thread.is_alive()


def test_sigterm_exits_cleanly_and_removes_sockets(agent_process: StartAgent) -> None:
    agent = agent_process()
    proc, engine, info = agent
    with AgentClient(engine) as client:
        client.allocate(PAGE_SIZE)
    assert os.path.exists(info.fd_socket) and os.path.exists(info.data_unix)
    with FdClient(info.fd_socket, timeout=3) as fdc:
        states = fdc.states()
    assert states.owner_alive()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    assert not states.owner_alive()  # gone after a clean shutdown too
    assert not os.path.exists(info.fd_socket) and not os.path.exists(info.data_unix)
    assert os.listdir(agent.runtime_dir) == []
    assert "Traceback" not in agent.log()


def test_killed_agent_gives_typed_errors(agent_process: StartAgent) -> None:
    proc, engine, info = agent_process()
    client = AgentClient(engine, timeout=3)
    seg = client.allocate(PAGE_SIZE)
    fdc = FdClient(info.fd_socket, timeout=3)
    assert fdc.alive()
    states = fdc.states()
    assert states.owner_alive()
    events: queue.Queue = queue.Queue()

    def pump() -> None:
        try:
            for event in client.watch():
                events.put(event)
        except Exception as exc:  # noqa: BLE001 - reported to the test thread
            events.put(exc)

    threading.Thread(target=pump, daemon=True).start()
    assert events.get(timeout=10)[0] == "SNAPSHOT"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert not states.owner_alive()  # marked by the kernel before the agent was reaped
    assert isinstance(events.get(timeout=20), PeerUnavailable)  # the stream ends, typed
    assert not fdc.alive()
    with pytest.raises(PeerUnavailable):
        fdc.fetch(seg.segment_id, seg.epoch, False)
    with pytest.raises(NotConnected):
        fdc.fetch(seg.segment_id, seg.epoch, False)  # the broken connection was dropped
    for call in (client.health, client.list_segments, lambda: client.allocate(PAGE_SIZE),
                 lambda: client.deregister(seg.segment_id, seg.epoch)):
        with pytest.raises((PeerUnavailable, TransferTimeout)):
            call()
    client.close()
    fdc.close()
    with pytest.raises(NotConnected, match="no agent fd socket"):
        FdClient(info.fd_socket)  # the socket file is stale now: nobody listens


def test_restart_on_stale_sockets_gets_new_epoch(agent_process: StartAgent) -> None:
    agent = agent_process()
    proc, engine, info = agent
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    assert os.path.exists(info.fd_socket)  # left behind by the dead agent
    port = engine.rsplit(":", 1)[1]
    again, line = start_agent(agent.config_path, "--grpc-port", port, log_path=agent.log_path)
    try:
        fields = parse_ready(line)
        assert fields["engine"] == engine and fields["fd"] == info.fd_socket
        assert int(fields["epoch"]) != info.epoch
        with AgentClient(engine) as client:
            with pytest.raises(StaleEpoch):
                client.deregister(1, info.epoch)
            assert client.handshake("pytest").epoch == int(fields["epoch"])
    finally:
        assert again.stop(grace_s=20) == 0  # SIGTERM: a clean exit within 20 s


def test_second_agent_on_same_port_fails(agent_process: StartAgent) -> None:
    agent = agent_process()
    port = agent.engine.rsplit(":", 1)[1]
    result = subprocess.run(agent_command(agent.config_path, "--grpc-port", port),
                            capture_output=True, text=True, timeout=60, env=clean_env())
    assert result.returncode == 1, result.stderr
    assert "cannot start" in result.stderr and port in result.stderr
    assert result.stdout == ""
    assert os.path.exists(agent.info.fd_socket)  # the first agent's sockets are untouched
    with AgentClient(agent.engine) as client:
        assert client.health()["status"] == "SERVING"


def test_bad_config_exits_2_naming_key(tmp_path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("grpc_port: 0\npool_max_bytes: plenty\n")
    result = subprocess.run(agent_command(str(path)), capture_output=True, text=True,
                            timeout=60, env=clean_env())
    assert result.returncode == 2
    assert "'pool_max_bytes'" in result.stderr and str(path) in result.stderr
    path.write_text("grpc_port: 0\n")
    result = subprocess.run([sys.executable, "-m", "hixl.server.main", "--config", str(path),
                             "--grpc-port", "x"],
                            capture_output=True, text=True, timeout=60, env=clean_env())
    assert result.returncode == 2 and "'grpc_port'" in result.stderr


def test_flags_and_env_reach_the_agent(agent_process: StartAgent) -> None:
    _, engine, info = agent_process(args=["--pool-size", "64KiB", "--no-data-unix"],
                                    env={"HIXL_AGENT_NODE_ID": "from-env"})
    assert info.node_id == "from-env" and info.data_unix == ""
    assert [(s.name, s.length) for s in info.segments] == [("pool", 64 << 10)]


def test_errors_cross_grpc_with_code_and_exact_type(agent_process: StartAgent) -> None:
    _, engine, info = agent_process(config={"pool_max_bytes": "8KiB"})
    mine = ShmSegment(PAGE_SIZE)
    read_only_fd = mine.export_fd(writable=False)
    try:
        with FdClient(info.fd_socket) as fdc:
            ticket = fdc.deposit(read_only_fd, PAGE_SIZE)
        cases = [
            ("DeregisterSegment", agent_pb2.DeregisterSegmentRequest(segment_id=99),
             grpc.StatusCode.INVALID_ARGUMENT, ParamInvalid),
            ("AllocateSegment", agent_pb2.AllocateSegmentRequest(size=1 << 20),
             grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhausted),
            ("AllocateSegment", agent_pb2.AllocateSegmentRequest(size=4096, perms=8),
             grpc.StatusCode.INVALID_ARGUMENT, ParamInvalid),
            ("DeregisterSegment", agent_pb2.DeregisterSegmentRequest(segment_id=1,
                                                                     epoch=info.epoch ^ 1),
             grpc.StatusCode.INTERNAL, StaleEpoch),
            # a read-only fd registered for writing: the agent cannot map it writable
            ("RegisterSegment", agent_pb2.RegisterSegmentRequest(fd_ticket=ticket, perms=3),
             grpc.StatusCode.PERMISSION_DENIED, PermissionDenied),
        ]
        with grpc.insecure_channel(engine) as channel:
            stub = agent_pb2_grpc.AgentStub(channel)
            for method, request, code, cls in cases:
                with pytest.raises(grpc.RpcError) as err:
                    getattr(stub, method)(request, timeout=5)
                assert err.value.code() == code, method
                meta = dict(err.value.trailing_metadata())
                assert meta["hixl-error"] == cls.__name__
                assert int(meta["hixl-status"]) == cls.status
                typed = error_from_rpc(err.value, method)
                assert type(typed) is cls and typed.status == cls.status
                assert str(typed).count("[") == 1  # the status prefix is not doubled
    finally:
        os.close(read_only_fd)
        mine.close()


# ---------------------------------------------------------------- registry publishing

wait_for = partial(waiting.wait_until, timeout=20.0)


@pytest.fixture
def start_master() -> Iterator[Callable[[int], str]]:
    masters: list[MasterProcess] = []

    def start(port: int = 0) -> str:
        masters.append(MasterProcess(port, env=clean_env()))
        return masters[-1].target

    yield start
    for master in masters:
        master.close()


def names(segments: list) -> list[str]:
    return sorted(s.name for s in segments)


def test_embedded_registry_serves_the_agents_table(agent_process: StartAgent) -> None:
    _, engine, info = agent_process(config={"pool": [{"name": "kv", "size": "64KiB"}]})
    with RegistryClient(engine) as registry, AgentClient(engine) as client:
        wait_for(lambda: names(registry.query(engine)) == ["kv"], what="pool published")
        seg = client.allocate(PAGE_SIZE, name="extra")
        wait_for(lambda: names(registry.query(engine)) == ["extra", "kv"], what="re-publish")
        [published] = [s for s in registry.query(engine) if s.name == "extra"]
        assert published == seg
        client.deregister(seg.segment_id, seg.epoch)
        wait_for(lambda: names(registry.query()) == ["kv"], what="removal published")


def test_publishes_to_master_and_withdraws_on_exit(agent_process: StartAgent,
                                                    start_master: Callable[[int], str]) -> None:
    master = start_master(0)
    agent = agent_process(config={"master": master, "lease_ttl_ms": 1500,
                                  "pool": [{"name": "kv", "size": 4096}]})
    with RegistryClient(master) as registry, AgentClient(agent.engine) as client:
        wait_for(lambda: names(registry.query(agent.engine)) == ["kv"], what="published")
        assert registry.query(agent.engine)[0].epoch == agent.info.epoch
        # renewals every ttl/3: after 4 of them the original lease term is over, and only
        # the keepalives can have kept the segments published
        wait_for(lambda: client.stats()["registry_keepalives"] >= 4, what="keepalives")
        assert names(registry.query(agent.engine)) == ["kv"]
        assert client.stats()["registry_publishes"] == 1
        agent.proc.send_signal(signal.SIGTERM)
        assert agent.proc.wait(timeout=20) == 0
        assert registry.query(agent.engine) == []  # unpublished at shutdown, not expired


def test_killed_agent_lease_expires_at_master(agent_process: StartAgent,
                                              start_master: Callable[[int], str]) -> None:
    master = start_master(0)
    agent = agent_process(config={"master": master, "lease_ttl_ms": 1000,
                                  "pool": [{"name": "kv", "size": 4096}]})
    with RegistryClient(master) as registry:
        wait_for(lambda: names(registry.query(agent.engine)) == ["kv"], what="published")
        agent.proc.send_signal(signal.SIGKILL)
        agent.proc.wait(timeout=10)
        wait_for(lambda: registry.query(agent.engine) == [], what="lease expiry")


def test_unreachable_master_is_retried_not_fatal(agent_process: StartAgent,
                                                 start_master: Callable[[int], str]) -> None:
    port = free_port()
    agent = agent_process(config={"master": f"127.0.0.1:{port}", "lease_ttl_ms": 900,
                                  "pool": [{"name": "kv", "size": 4096}]})
    with AgentClient(agent.engine) as client:
        assert client.health()["status"] == "SERVING"  # serving without its master
    master = start_master(port)
    with RegistryClient(master) as registry:
        wait_for(lambda: names(registry.query(agent.engine)) == ["kv"], timeout=30,
                 what="publish after the master came up")
    assert agent.proc.poll() is None


# ---------------------------------------------------------------- wiring of the data path

def _recv_exact(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        assert chunk, "data server closed the connection"
        data += chunk
    return data


def _data_round_trip(sock: socket.socket, seg, payload: bytes) -> bytes:
    """HELLO, WRITE payload at the segment's start, READ it back; returns what was read."""
    proto = wire.ClientProtocol()
    sock.sendall(proto.hello(b"pytest"))
    proto.on_reply_header(_recv_exact(sock, wire.HEADER_SIZE))
    sock.sendall(proto.write(seg.segment_id, seg.epoch, seg.base, len(payload)) + payload)
    reply = proto.on_reply_header(_recv_exact(sock, wire.HEADER_SIZE))
    assert reply.status == 0
    sock.sendall(proto.read(seg.segment_id, seg.epoch, seg.base, len(payload)))
    reply = proto.on_reply_header(_recv_exact(sock, wire.HEADER_SIZE))
    assert reply.status == 0
    return _recv_exact(sock, wire.payload_length(reply))


def test_data_path_lands_in_the_segment(agent_process: StartAgent) -> None:
    _, engine, info = agent_process()
    with AgentClient(engine) as client, FdClient(info.fd_socket) as fdc:
        seg = client.allocate(2 * PAGE_SIZE, name="data")
        fd, length = fdc.fetch(seg.segment_id, seg.epoch, False)
        view = Mapping(fd, length, writable=False)
        os.close(fd)
        host, port = info.data_tcp.rsplit(":", 1)
        payload = os.urandom(length)
        with socket.create_connection((host, int(port)), timeout=10) as tcp:
            assert _data_round_trip(tcp, seg, payload) == payload
        assert bytes(view.view()) == payload  # the bytes landed in the shared segment
        payload = os.urandom(length)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unix:
            unix.settimeout(10)
            unix.connect(info.data_unix)
            assert _data_round_trip(unix, seg, payload) == payload
        assert bytes(view.view()) == payload
        view.close()
        stats = client.stats()
        assert stats["data_bytes_written"] == 2 * length
        assert stats["data_bytes_read"] == 2 * length


# ---------------------------------------------------------------- the embedded shape

def test_embedded_agent_serves_caller_memory() -> None:
    runtime_dir = tempfile.mkdtemp(prefix="hxe-")
    config = AgentConfig.load(None, {"grpc_port": 0, "runtime_dir": runtime_dir}, {})
    buf = np.zeros(PAGE_SIZE, dtype=np.uint8)
    shm = ShmSegment(PAGE_SIZE)
    with AgentServer(config) as server:
        agent = server.agent
        plain = agent.register_memory(buf.ctypes.data, buf.nbytes, Perm.READ, "plain",
                                      keepalive=buf)
        shared = agent.register_memory(shm.addr, shm.length, Perm.RW, "shm", shm=shm)
        with AgentClient(server.engine_name) as client:
            info = client.handshake("peer")
            assert info.engine == server.engine_name and info.epoch == agent.epoch
            assert sorted(info.segments, key=lambda s: s.segment_id) == [plain, shared]
            assert not plain.shareable and shared.shareable
        with FdClient(info.fd_socket) as fdc:
            with pytest.raises(ParamInvalid, match="not shareable"):
                fdc.fetch(plain.segment_id, plain.epoch, False)
            fd, length = fdc.fetch(shared.segment_id, shared.epoch, True)
            peer = Mapping(fd, length, writable=True)
            os.close(fd)
            peer.view()[:4] = b"peer"
            assert bytes(shm.view()[:4]) == b"peer"
            peer.close()
        buf[:5] = np.frombuffer(b"plain", dtype=np.uint8)
        host, port = info.data_tcp.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as tcp:
            proto = wire.ClientProtocol()
            tcp.sendall(proto.hello())
            proto.on_reply_header(_recv_exact(tcp, wire.HEADER_SIZE))
            tcp.sendall(proto.read(plain.segment_id, plain.epoch, plain.base, 5))
            reply = proto.on_reply_header(_recv_exact(tcp, wire.HEADER_SIZE))
            assert _recv_exact(tcp, reply.length) == b"plain"
    assert os.listdir(runtime_dir) == []  # sockets removed by stop()
    shm.close()
    os.rmdir(runtime_dir)


def test_embedded_agent_start_failure_is_typed_and_clean() -> None:
    runtime_dir = tempfile.mkdtemp(prefix="hxe-")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        config = AgentConfig.load(None, {"grpc_port": port, "runtime_dir": runtime_dir}, {})
        with pytest.raises(HixlError, match=str(port)):
            AgentServer(config).start()
    assert os.listdir(runtime_dir) == []
    os.rmdir(runtime_dir)
