"""Segment count, name and table limits of a real hixl-agent (issue 15, item 7).

The attack: a client allocates tiny segments until the agent cannot take more. Each
segment keeps an fd and a mapping in the agent, so without a count the agent ran out of
open files (every accept then failed with EMFILE); long names or allow-lists pushed the
table past the 4 MiB a client receives in a Handshake. Each test runs the attack against
a real agent process and shows it held: a typed refusal naming the limit, and the agent
still handshakes, lists and serves data connections.
"""

from __future__ import annotations

import os
import resource
import shutil
import socket
import tempfile
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

import pytest
import waiting
import yaml
from conftest import TEST_STATE_DIR, AgentProcess, parse_ready, start_agent

from hixl import wire
from hixl.client.agent_client import AgentClient
from hixl.errors import ParamInvalid, ResourceExhausted
from hixl.server.agent.agent import MAX_NAME_BYTES, MAX_OWNER_BYTES, TABLE_BYTES_LIMIT
from hixl.types import MAX_ALLOWED_ENGINES, MAX_ENGINE_NAME, Perm, SegmentInfo

StartAgent = Callable[..., AgentProcess]
DEADLINE_S = 60.0  # only proves "does not hang"; nothing asserts how long anything took
wait_for = partial(waiting.wait_until, timeout=DEADLINE_S)


def _recv_exact(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        assert chunk, "data server closed the connection"
        data += chunk
    return data


def round_trip(data_tcp: str, seg: SegmentInfo, payload: bytes) -> bytes:
    """A new TCP data connection: HELLO, WRITE `payload` at the segment, READ it back."""
    host, port = data_tcp.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        proto = wire.ClientProtocol()
        sock.sendall(proto.hello(b"pytest"))
        proto.on_reply_header(_recv_exact(sock, wire.HEADER_SIZE))
        sock.sendall(proto.write(seg.segment_id, seg.epoch, seg.base, len(payload)) + payload)
        assert proto.on_reply_header(_recv_exact(sock, wire.HEADER_SIZE)).status == 0
        sock.sendall(proto.read(seg.segment_id, seg.epoch, seg.base, len(payload)))
        reply = proto.on_reply_header(_recv_exact(sock, wire.HEADER_SIZE))
        assert reply.status == 0
        return _recv_exact(sock, wire.payload_length(reply))


def allocate_until_refused(client: AgentClient, limit: int,
                           **kwargs: Any) -> tuple[list[SegmentInfo], ResourceExhausted]:
    """Tiny segments until the agent refuses one (failing past `limit` + 1 tries)."""
    held: list[SegmentInfo] = []
    for _ in range(limit + 1):
        try:
            held.append(client.allocate(1, Perm.RW, name=f"tiny-{len(held)}", **kwargs))
        except ResourceExhausted as exc:
            return held, exc
    pytest.fail(f"the agent took {len(held)} segments without refusing one")


def still_serves(agent: AgentProcess, client: AgentClient, held: list[SegmentInfo]) -> None:
    """Handshake and ListSegments answer with the whole table, and new data connections
    (several, each a new fd in the agent) move bytes."""
    info = client.handshake("pytest-after")
    assert {s.segment_id for s in held} <= {s.segment_id for s in info.segments}
    _, listed = client.list_segments()
    assert {s.segment_id for s in held} <= {s.segment_id for s in listed}
    for seg in held[:8]:
        payload = os.urandom(64)
        assert round_trip(agent.info.data_tcp, seg, payload) == payload


def test_tiny_segments_stop_at_max_segments(agent_process: StartAgent) -> None:
    agent = agent_process(config={"max_segments": 24, "pool": [{"name": "kv", "size": "1MiB"}]})
    with AgentClient(agent.engine, timeout=10.0) as client:
        held, refusal = allocate_until_refused(client, 24, owner="attacker")
        assert len(held) == 24  # the pool does not count against the limit
        assert "max_segments=24" in str(refusal) and "max_segments" in str(refusal)
        with pytest.raises(ResourceExhausted, match="max_segments"):
            client.allocate(1, name="one-more")
        still_serves(agent, client, held)
        assert client.stats()["client_segments"] == 24
        # an honest client gets a segment once one is released
        client.deregister(held[0].segment_id, held[0].epoch)
        again = client.allocate(4096, name="honest")
        payload = os.urandom(4096)
        assert round_trip(agent.info.data_tcp, again, payload) == payload
        assert agent.proc.poll() is None


def test_long_name_and_owner_are_refused(agent_process: StartAgent) -> None:
    agent = agent_process()
    with AgentClient(agent.engine, timeout=10.0) as client:
        with pytest.raises(ParamInvalid, match=f"name is {1 << 20} bytes.*at most "
                                               f"{MAX_NAME_BYTES}"):
            client.allocate(1, name="n" * (1 << 20))
        with pytest.raises(ParamInvalid, match=f"owner is 1024 bytes.*at most "
                                               f"{MAX_OWNER_BYTES}"):
            client.allocate(1, name="x", owner="o" * 1024)
        # counted in UTF-8 bytes, not characters
        with pytest.raises(ParamInvalid, match="owner"):
            client.allocate(1, owner="é" * (MAX_OWNER_BYTES // 2 + 1))
        seg = client.allocate(1, name="n" * MAX_NAME_BYTES, owner="o" * MAX_OWNER_BYTES)
        assert seg.name == "n" * MAX_NAME_BYTES
        assert client.stats()["segments"] == 1  # nothing refused was kept
        still_serves(agent, client, [seg])


def test_table_stays_under_the_client_receive_limit(agent_process: StartAgent) -> None:
    """Segments with the longest allow-lists fill the table's byte limit long before the
    count: refused with the limit named, and the Handshake (whose reply carries the whole
    table, received with gRPC's default 4 MiB limit) still works."""
    agent = agent_process()
    allowed = [f"{i:03d}".ljust(MAX_ENGINE_NAME - 6, "h") + ":50161"
               for i in range(MAX_ALLOWED_ENGINES)]
    with AgentClient(agent.engine, timeout=30.0) as client:
        held, refusal = allocate_until_refused(client, 200, allowed_engines=allowed)
        assert "segment table" in str(refusal) and str(TABLE_BYTES_LIMIT) in str(refusal)
        stats = client.stats()
        assert stats["table_bytes"] <= TABLE_BYTES_LIMIT == stats["table_bytes_limit"]
        assert len(held) == stats["segments"] > 10
        info = client.handshake("pytest-after")
        assert len(info.segments) == len(held)
        # releasing one makes room again
        client.deregister(held[0].segment_id, held[0].epoch)
        client.allocate(1, name="honest", allowed_engines=allowed)


@pytest.fixture
def low_fd_agent() -> Iterator[AgentProcess]:
    """A hixl-agent whose open-files limit is 256 (soft), with max_segments at its default."""
    workdir = tempfile.mkdtemp(prefix="hxl-")
    settings = {"host": "127.0.0.1", "grpc_port": 0, "data_port": 0,
                "runtime_dir": os.path.join(workdir, "run"), "state_dir": TEST_STATE_DIR}
    config_path = os.path.join(workdir, "agent.yaml")
    with open(config_path, "w", encoding="utf-8") as f:
        yaml.safe_dump(settings, f)
    log_path = os.path.join(workdir, "agent.log")
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)

    def low_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

    try:
        agent, line = start_agent(config_path, log_path=log_path, timeout=60.0,
                                  preexec_fn=low_limit)
        try:
            engine = parse_ready(line)["engine"]
            with AgentClient(engine, timeout=10.0) as client:
                info = client.handshake("pytest")
            yield AgentProcess(agent.proc, engine, info, runtime_dir=settings["runtime_dir"],
                               log_path=log_path, config_path=config_path, ready_line=line)
        finally:
            agent.kill()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def test_tiny_segments_cannot_exhaust_open_files(low_fd_agent: AgentProcess) -> None:
    """The default max_segments (4096) is lowered to a quarter of the agent's open-files
    limit (two fds a segment), so the segments never take the fds its accepts need."""
    agent = low_fd_agent
    assert "max_segments 4096 lowered to 64" in agent.log()
    with AgentClient(agent.engine, timeout=10.0) as client:
        held, refusal = allocate_until_refused(client, 4096)
        assert len(held) == 64
        assert "max_segments=64" in str(refusal) and "ulimit -n 256" in str(refusal)
        # many new connections at once, each an fd in the agent: all are accepted
        host, port = agent.info.data_tcp.rsplit(":", 1)
        sockets = [socket.create_connection((host, int(port)), timeout=10) for _ in range(32)]
        try:
            for sock in sockets:
                proto = wire.ClientProtocol()
                sock.sendall(proto.hello(b"pytest"))
                proto.on_reply_header(_recv_exact(sock, wire.HEADER_SIZE))  # raises if refused
        finally:
            for sock in sockets:
                sock.close()
        still_serves(agent, client, held)
        client.deregister(held[0].segment_id, held[0].epoch)
        client.allocate(4096, name="honest")
    assert "Too many open files" not in agent.log()




def test_preauth_keys_reach_the_data_server(agent_process: StartAgent) -> None:
    """data_preauth_connections and data_handshake_timeout_s (config keys) set the data
    server's pre-auth budget and deadline: with 2 slots, a third idle connection evicts
    the oldest; the other two are closed at the deadline; an honest client still gets in."""
    agent = agent_process(config={"data_preauth_connections": 2,
                                  "data_handshake_timeout_s": 3,
                                  "pool": [{"name": "kv", "size": "64KiB"}]})
    assert "handshake=3s preauth=2/listener" in agent.log()
    host, port = agent.info.data_tcp.rsplit(":", 1)
    idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(3)]
    try:
        wait_for(lambda: waiting.closed_by_peer(idle[0]), "the oldest idle connection is evicted")
        with AgentClient(agent.engine, timeout=10.0) as client:
            assert client.stats()["data_preauth_evicted"] == 1
            wait_for(lambda: all(waiting.closed_by_peer(s) for s in idle[1:]),
                     "the others are closed at their handshake deadline")
            stats = client.stats()
            assert stats["data_handshake_timeouts"] == 2
            assert stats["data_preauth_evicted"] == 1
            [pool] = agent.info.segments
            payload = os.urandom(4096)
            assert round_trip(agent.info.data_tcp, pool, payload) == payload
    finally:
        for sock in idle:
            sock.close()
