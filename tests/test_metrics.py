"""Prometheus metrics, scraped over HTTP from real processes: agents, a master, an engine.

Every counter is checked against the exact ops and bytes the test moved; histograms by
their counts (one observation per transfer call on the engine; at least one per batch of
replies on the agent, whose number of batches depends on how the bytes arrive).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import waiting
import yaml
from conftest import AgentProcess, agent_command, clean_env
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from hixl import wire
from hixl.client.engine import Engine
from hixl.client.store_client import MasterClient
from hixl.errors import (
    AuthenticationFailed,
    ConfigError,
    OutOfRange,
    ParamInvalid,
    PeerUnavailable,
    StaleEpoch,
)
from hixl.memory import buffer_range
from hixl.processes import free_port
from hixl.server.agent.config import AgentConfig
from hixl.server.master.store import StoreOptions
from hixl.store_codes import ErrorCode
from hixl.store_rpc import METHODS
from hixl.store_types import StoreSegment
from hixl.tools.daemons import MasterProcess
from hixl.transports.base import Item
from hixl.transports.tcp import SocketTransport
from hixl.types import TransferOp, TransferOpDesc

StartAgent = Callable[..., AgentProcess]
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

KiB, MiB = 1 << 10, 1 << 20
DEADLINE_S = 20.0
FABRIC = {"EnableUseFabricMem": "1"}


def parse(text: str) -> Samples:
    return {(sample.name, frozenset(sample.labels.items())): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def scrape(url: str) -> Samples:
    with urllib.request.urlopen(url, timeout=DEADLINE_S) as reply:
        assert reply.status == 200
        return parse(reply.read().decode())


def collect(engine: Engine) -> Samples:
    """The engine's collector, on a registry of the test's own."""
    registry = CollectorRegistry()
    registry.register(engine.metrics_collector())
    return parse(generate_latest(registry).decode())


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


eventually = partial(waiting.wait_until, timeout=DEADLINE_S, interval=0.02)


def transfer(engine: Engine, remote: str, op: TransferOp, local: bytearray, remote_addr: int,
             size: int, count: int) -> None:
    """One call of `count` ops of `size` bytes, back to back in both memories."""
    base = buffer_range(local).addr
    engine.transfer(remote, op, [TransferOpDesc(base + i * size, remote_addr + i * size, size)
                                 for i in range(count)], timeout=DEADLINE_S)


@pytest.fixture
def metrics_agent(agent_process: StartAgent) -> Callable[..., tuple[AgentProcess, str]]:
    """Start an agent with a 4 MiB pool segment and a metrics port; (agent, metrics url)."""
    def start(**config: object) -> tuple[AgentProcess, str]:
        port = free_port()
        agent = agent_process(config={"metrics_port": port,
                                      "pool": [{"name": "kv", "size": "4MiB"}], **config})
        return agent, f"http://127.0.0.1:{port}/metrics"

    return start


# ---------------------------------------------------------------- the agent


def test_agent_and_engine_count_socket_traffic_exactly(metrics_agent) -> None:
    agent, url = metrics_agent()
    segment = agent.info.segments[0]
    before = scrape(url)
    assert value(before, "hixl_agent_info", engine=agent.engine,
                 node_id=agent.info.node_id) == 1
    assert value(before, "hixl_agent_epoch") == agent.info.epoch
    assert value(before, "hixl_agent_segments", kind="pool") == 1
    assert value(before, "hixl_agent_segment_bytes", kind="pool") == 4 * MiB
    src = bytearray(os.urandom(256 * KiB))
    dst = bytearray(256 * KiB)
    with Engine("127.0.0.1") as engine:  # fabric off: same node, so the unix socket path
        engine.register(src)
        engine.register(dst)
        engine.connect(agent.engine)
        assert engine.route(agent.engine, segment.base) == "unix"
        engine_before = collect(engine)
        transfer(engine, agent.engine, TransferOp.WRITE, src, segment.base, 4 * KiB, 16)
        transfer(engine, agent.engine, TransferOp.WRITE, src, segment.base, 64 * KiB, 4)
        transfer(engine, agent.engine, TransferOp.READ, dst, segment.base, 8 * KiB, 32)
        assert dst == src  # 256 KiB written by the second call, read back whole
        engine_after = collect(engine)
        after = scrape(url)
        assert value(after, "hixl_agent_data_connections", transport="unix") == 1

    unix_write, unix_read = {"transport": "unix", "direction": "write"}, {
        "transport": "unix", "direction": "read"}
    # the agent counts requests: each call's ops lie back to back in the segment, so each
    # call travels as one merged frame (docs/data-path.md §2); the engine counts the ops
    assert delta(after, before, "hixl_agent_data_bytes_total", **unix_write) == 16 * 4 * KiB + 4 * 64 * KiB
    assert delta(after, before, "hixl_agent_data_ops_total", **unix_write) == 2
    assert delta(after, before, "hixl_agent_data_bytes_total", **unix_read) == 256 * KiB
    assert delta(after, before, "hixl_agent_data_ops_total", **unix_read) == 1
    for direction in ("write", "read"):
        labels = {"transport": "unix", "direction": direction}
        assert delta(after, before, "hixl_agent_data_seconds_count", **labels) >= 1
        assert value(after, "hixl_agent_data_seconds_bucket", le="+Inf", **labels) == \
            value(after, "hixl_agent_data_seconds_count", **labels)
        tcp = {"transport": "tcp", "direction": direction}
        assert delta(after, before, "hixl_agent_data_ops_total", **tcp) == 0
    assert delta(after, before, "hixl_agent_data_connections_accepted_total",
                 transport="unix") == 1

    # the engine counted the same traffic on its side, once per call
    write, read = {"path": "unix", "direction": "write"}, {"path": "unix", "direction": "read"}
    assert delta(engine_after, engine_before, "hixl_engine_transfer_bytes_total", **write) == \
        16 * 4 * KiB + 4 * 64 * KiB
    assert delta(engine_after, engine_before, "hixl_engine_transfer_ops_total", **write) == 20
    assert delta(engine_after, engine_before, "hixl_engine_transfer_seconds_count", **write) == 2
    assert delta(engine_after, engine_before, "hixl_engine_transfer_bytes_total", **read) == \
        256 * KiB
    assert delta(engine_after, engine_before, "hixl_engine_transfer_ops_total", **read) == 32
    assert delta(engine_after, engine_before, "hixl_engine_transfer_seconds_count", **read) == 1
    assert value(engine_after, "hixl_engine_transfer_seconds_sum", **read) > 0
    assert value(engine_after, "hixl_engine_peers") == 1
    assert value(engine_after, "hixl_engine_registered_bytes") == 512 * KiB
    assert value(engine_after, "hixl_engine_transfer_ops_total", path="fabric",
                 direction="write") == 0


def test_agent_counts_tcp_traffic_and_refusals_by_reason(metrics_agent) -> None:
    agent, url = metrics_agent()
    segment = agent.info.segments[0]
    src = bytearray(os.urandom(64 * KiB))
    base = buffer_range(src).addr
    before = scrape(url)
    transport = SocketTransport(f"tcp://{agent.info.data_tcp}", identity="pytest")
    try:
        deadline = time.monotonic() + DEADLINE_S
        transport.transfer(TransferOp.WRITE, [Item(i, base + i * 4 * KiB, segment,
                                                   segment.base + i * 4 * KiB, 4 * KiB)
                                              for i in range(16)], deadline)
        stale = replace(segment, epoch=segment.epoch + 1)  # as if the agent had restarted
        with pytest.raises(StaleEpoch):
            transport.transfer(TransferOp.WRITE, [Item(0, base, stale, segment.base, 4 * KiB)],
                               deadline)
        with pytest.raises(OutOfRange):  # READ past the segment's end
            transport.transfer(TransferOp.READ, [Item(0, base, segment,
                                                      segment.end - KiB, 4 * KiB)], deadline)
        after = scrape(url)
    finally:
        transport.close()
    write = {"transport": "tcp", "direction": "write"}
    assert delta(after, before, "hixl_agent_data_bytes_total", **write) == 64 * KiB
    assert delta(after, before, "hixl_agent_data_ops_total", **write) == 1  # one merged frame
    assert value(after, "hixl_agent_data_errors_total", code="STALE_EPOCH", **write) == 1
    assert value(after, "hixl_agent_data_errors_total", code="OUT_OF_RANGE", transport="tcp",
                 direction="read") == 1
    assert delta(after, before, "hixl_agent_data_ops_total", transport="tcp",
                 direction="read") == 0
    # a refused request is answered, not a broken connection
    assert value(after, "hixl_agent_data_connection_errors_total", kind="protocol") == 0


def test_agent_counts_auth_failures(metrics_agent, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("the-cluster-token\n")
    token_file.chmod(0o600)
    agent, url = metrics_agent(cluster_token_file=str(token_file))
    segment = agent.info.segments[0]
    src = bytearray(4 * KiB)
    transport = SocketTransport(f"tcp://{agent.info.data_tcp}", identity="intruder",
                                cluster_token=b"a-wrong-token")
    try:
        with pytest.raises(AuthenticationFailed):
            transport.transfer(TransferOp.WRITE, [Item(0, buffer_range(src).addr, segment,
                                                       segment.base, 4 * KiB)],
                               time.monotonic() + DEADLINE_S)
    finally:
        transport.close()
    samples = scrape(url)
    assert value(samples, "hixl_agent_data_connection_errors_total", kind="auth") == 1
    assert value(samples, "hixl_agent_data_connection_errors_total", kind="protocol") == 1
    assert value(samples, "hixl_agent_data_ops_total", transport="tcp", direction="write") == 0




def test_agent_counts_preauth_evictions_and_handshake_timeouts(metrics_agent) -> None:
    """Connections that never send HELLO: with one pre-auth slot, the second evicts the
    first; the second is closed at the handshake deadline. Both reach /metrics."""
    agent, url = metrics_agent(data_preauth_connections=1, data_handshake_timeout_s=2)
    errors = "hixl_agent_data_connection_errors_total"
    host, port = agent.info.data_tcp.rsplit(":", 1)
    idle = [socket.create_connection((host, int(port)), timeout=DEADLINE_S) for _ in range(2)]
    try:
        eventually(lambda: all(waiting.closed_by_peer(sock) for sock in idle),
                   "both idle connections closed by the agent")
    finally:
        for sock in idle:
            sock.close()
    samples = scrape(url)
    assert value(samples, errors, kind="preauth_evicted") == 1
    assert value(samples, errors, kind="handshake_timeout") == 1
    assert value(samples, errors, kind="thread_start_failure") == 0
    assert value(samples, errors, kind="rejected") == 0
    assert value(samples, "hixl_agent_data_connections_accepted_total", transport="tcp") == 2


def test_fabric_traffic_is_counted_by_the_engine(metrics_agent) -> None:
    agent, url = metrics_agent()
    segment = agent.info.segments[0]
    src = bytearray(os.urandom(64 * KiB))
    dst = bytearray(64 * KiB)
    before = scrape(url)
    with Engine("127.0.0.1", FABRIC) as engine:
        engine.register(src)
        engine.register(dst)
        engine.connect(agent.engine)
        assert engine.route(agent.engine, segment.base) == "fabric"
        server = engine.start_metrics_server()
        for _ in range(3):
            transfer(engine, agent.engine, TransferOp.WRITE, src, segment.base, 4 * KiB, 16)
        transfer(engine, agent.engine, TransferOp.READ, dst, segment.base, 64 * KiB, 1)
        assert dst == src
        mid = scrape(url)
        served = scrape(server.url)  # the engine's own endpoint
        assert served == collect(engine)
        write = {"path": "fabric", "direction": "write"}
        read = {"path": "fabric", "direction": "read"}
        assert value(served, "hixl_engine_transfer_bytes_total", **write) == 3 * 64 * KiB
        assert value(served, "hixl_engine_transfer_ops_total", **write) == 48
        assert value(served, "hixl_engine_transfer_seconds_count", **write) == 3
        assert value(served, "hixl_engine_transfer_seconds_bucket", le="+Inf", **write) == 3
        assert value(served, "hixl_engine_transfer_bytes_total", **read) == 64 * KiB
        assert value(served, "hixl_engine_transfer_ops_total", **read) == 1
        with pytest.raises(ParamInvalid, match="already serves metrics"):
            engine.start_metrics_server()

        # the agent moved none of it, but handed out the segment's fd once
        for direction in ("write", "read"):
            for path in ("tcp", "unix"):
                assert delta(mid, before, "hixl_agent_data_ops_total", transport=path,
                             direction=direction) == 0
        assert delta(mid, before, "hixl_agent_segment_changes_total", change="fds_exported") == 1
        assert value(mid, "hixl_agent_fd_clients") == 1

        # the owner dies: the write is reported failed, and counted so
        agent.proc.send_signal(signal.SIGKILL)
        agent.proc.wait(DEADLINE_S)
        with pytest.raises(PeerUnavailable) as failure:
            transfer(engine, agent.engine, TransferOp.WRITE, src, segment.base, 4 * KiB, 1)
        failed = collect(engine)
        assert value(failed, "hixl_engine_transfer_errors_total", code=failure.value.status_name,
                     **write) == 1
        assert value(failed, "hixl_engine_transfer_ops_total", **write) == 48  # not counted


def test_agent_reports_its_registry_lease(metrics_agent) -> None:
    agent, url = metrics_agent()  # no master: the agent runs the registry itself
    eventually(lambda: value(scrape(url), "hixl_agent_registry_published", mode="embedded")
               == 1, "the agent published its table")
    samples = scrape(url)
    assert value(samples, "hixl_registry_engines") == 1
    assert value(samples, "hixl_registry_segments") == 1
    assert value(samples, "hixl_registry_segment_bytes") == 4 * MiB
    assert value(samples, "hixl_registry_lease_events_total", event="leases_granted") == 1
    assert value(samples, "hixl_registry_lease_events_total", event="expiries") == 0
    assert 0 <= value(samples, "hixl_agent_registry_last_success_age_seconds") < DEADLINE_S
    assert value(samples, "hixl_agent_registry_consecutive_failures") == 0
    assert value(samples, "hixl_agent_registry_calls_total", call="publishes") >= 1


# ---------------------------------------------------------------- the master


@pytest.fixture
def metrics_master() -> Iterator[tuple[MasterProcess, str]]:
    port = free_port()
    # no watermark eviction (the test triggers one on demand), clients and leases that
    # cannot run out mid-test
    with MasterProcess(extra=["--metrics-port", str(port), "--eviction_high_watermark_ratio",
                              "1.0", "--client_ttl", "600",
                              "--default_kv_lease_ttl=600000"]) as master:
        yield master, f"http://127.0.0.1:{port}/metrics"


def test_master_counts_objects_space_results_and_evictions(metrics_master) -> None:
    master, url = metrics_master
    quarter = MiB // 4
    with MasterClient(master.target, timeout=DEADLINE_S, client_id="client-1") as client:
        assert client.mount_segment(StoreSegment("engine-a", 7, 1, 0x10_0000, MiB,
                                                 "node-a")).code == ErrorCode.OK
        keys = [f"key-{i}" for i in range(4)]
        started = client.batch_put_start([(key, quarter) for key in keys])
        assert [s.code for s in started] == [ErrorCode.OK] * 4
        assert client.batch_put_end([(k, s.put_id) for k, s in zip(keys, started, strict=True)]
                                    ) == [ErrorCode.OK] * 4
        full = scrape(url)
        assert value(full, "hixl_store_objects") == 4
        assert value(full, "hixl_store_capacity_bytes") == MiB
        assert value(full, "hixl_store_used_bytes") == MiB
        assert value(full, "hixl_store_segments", state="live") == 1
        segment = {"engine": "engine-a", "segment": "7", "client": "client-1"}
        assert value(full, "hixl_store_segment_capacity_bytes", **segment) == MiB
        assert value(full, "hixl_store_segment_used_bytes", **segment) == MiB
        assert value(full, "hixl_store_clients") == 1
        assert value(full, "hixl_store_results_total", method="MountSegment", code="OK") == 1
        assert value(full, "hixl_store_results_total", method="PutStart", code="OK") == 4
        assert value(full, "hixl_store_results_total", method="PutEnd", code="OK") == 4
        assert value(full, "hixl_store_puts_committed_total") == 4
        assert value(full, "hixl_store_evictions_total") == 0

        # no room for a fifth: the least recently used object (key-0) is evicted for it,
        # once the four are older than the eviction grace (a put just acknowledged is
        # never evicted; both processes read the same monotonic clock)
        time.sleep(StoreOptions().eviction_grace_ms / 1000)
        fifth = client.put_start("key-4", quarter)
        assert fifth.code == ErrorCode.OK
        assert client.put_end("key-4", fifth.put_id) == ErrorCode.OK
        assert client.put_start("key-4", quarter).code == ErrorCode.OBJECT_ALREADY_EXISTS
        assert client.remove("key-1") == ErrorCode.OK
        assert client.remove("key-0") == ErrorCode.OBJECT_NOT_FOUND  # evicted
        assert client.get_replicas("key-2").code == ErrorCode.OK  # leases it
        after = scrape(url)
    assert value(after, "hixl_store_evictions_total") == 1
    assert value(after, "hixl_store_evicted_objects_total") == 1
    assert value(after, "hixl_store_objects") == 3
    assert value(after, "hixl_store_used_bytes") == 3 * quarter
    assert value(after, "hixl_store_results_total", method="PutStart", code="OK") == 5
    assert value(after, "hixl_store_results_total", method="PutStart",
                 code="OBJECT_ALREADY_EXISTS") == 1
    assert value(after, "hixl_store_results_total", method="Remove", code="OK") == 1
    assert value(after, "hixl_store_results_total", method="Remove",
                 code="OBJECT_NOT_FOUND") == 1
    assert value(after, "hixl_store_results_total", method="GetReplicas", code="OK") == 1
    assert value(after, "hixl_store_objects_held", hold="leased") == 1
    assert value(after, "hixl_store_objects_held", hold="hard_pinned") == 0
    assert value(after, "hixl_registry_engines") == 0  # the master's registry: nobody yet


# ---------------------------------------------------------------- bad settings


def _call_reply(sock: socket.socket) -> tuple[wire.Header, bytes]:
    header = wire.decode_header(sock.recv(wire.HEADER_SIZE, socket.MSG_WAITALL))
    payload = sock.recv(header.length, socket.MSG_WAITALL) if header.length else b""
    return header, payload


def test_master_counts_its_store_call_endpoint() -> None:
    """A call over --call-bytes-budget, a body that stalls past --call-body-timeout-s and
    an idle connection that never authenticates, on a real master's store call endpoint:
    each reaches its /metrics."""
    port, fast_port = free_port(), free_port()
    put_start = next(number for number, name in METHODS.items() if name == "PutStart")
    with MasterProcess(extra=["--metrics-port", str(port), "--fast-port", str(fast_port),
                              "--call-bytes-budget", "1MiB",
                              "--call-body-timeout-s", "2"]):
        url = f"http://127.0.0.1:{port}/metrics"
        samples = scrape(url)
        assert value(samples, "hixl_store_call_body_bytes_budget") == MiB
        assert value(samples, "hixl_store_call_connections_accepted_total") == 0
        with socket.create_connection(("127.0.0.1", fast_port), timeout=DEADLINE_S) as sock:
            sock.sendall(wire.ClientProtocol().hello(b"pytest"))
            assert _call_reply(sock)[0].status == 0
            sock.sendall(wire.Header(wire.Op.CALL, 1, segment_id=put_start,
                                     length=2 * MiB).pack() + bytes(2 * MiB))
            header, text = _call_reply(sock)
            assert header.reason == wire.Reason.INTERNAL and b"not applied" in text, text
            sock.sendall(wire.Header(wire.Op.CALL, 2, segment_id=put_start,
                                     length=MiB // 2).pack() + bytes(KiB))
            eventually(lambda: value(scrape(url), "hixl_store_call_body_bytes") == MiB // 2,
                       "the stalled body holds its first step")
            eventually(lambda: waiting.closed_by_peer(sock), "the stalled body's connection closed")
        samples = scrape(url)
        errors = "hixl_store_call_connection_errors_total"
        assert value(samples, "hixl_store_call_calls_total", outcome="over_budget") == 1
        assert value(samples, "hixl_store_call_calls_total", outcome="served") == 0
        assert value(samples, errors, kind="body_timeout") == 1
        assert value(samples, errors, kind="protocol") == 1  # a stall: the body timeout
        assert value(samples, "hixl_store_call_body_bytes") == 0  # given back
        assert value(samples, "hixl_store_call_connections_accepted_total") == 1
        with socket.create_connection(("127.0.0.1", fast_port), timeout=DEADLINE_S) as idle:
            eventually(lambda: waiting.closed_by_peer(idle), "the idle connection closed at its "
                       "handshake deadline")
        samples = scrape(url)
        assert value(samples, errors, kind="handshake_timeout") == 1
        assert value(samples, errors, kind="preauth_evicted") == 0
        assert value(samples, errors, kind="thread_start_failure") == 0


def test_metrics_port_out_of_range_is_a_config_error_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="'metrics_port'.*65535"):
        AgentConfig.load(overrides={"metrics_port": 70000}, env={})
    with pytest.raises(ConfigError, match="HIXL_AGENT_METRICS_PORT.*'metrics_port'"):
        AgentConfig.load(env={"HIXL_AGENT_METRICS_PORT": "-1"})
    with pytest.raises(ConfigError, match="'metrics_port'.*grpc_port"):
        AgentConfig.load(overrides={"metrics_port": 50300, "grpc_port": 50300}, env={})
    assert AgentConfig.load(env={}).metrics_port == 0  # no endpoint unless asked
    assert "metrics_port" in AgentConfig.describe()


def test_metrics_port_in_use_fails_the_start_naming_the_key(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = tmp_path / "agent.yaml"
        config.write_text(yaml.safe_dump({"grpc_port": 0, "metrics_port": port,
                                          "runtime_dir": str(tmp_path / "run")}))
        result = subprocess.run(agent_command(str(config)), capture_output=True, text=True,
                                timeout=60, env=clean_env())
        assert result.returncode == 1, result.stderr
        assert "'metrics_port'" in result.stderr and f"127.0.0.1:{port}" in result.stderr
        assert "in use" in result.stderr

        with pytest.raises(ConfigError, match=f"start_metrics_server.*{port}.*in use"), \
                Engine("127.0.0.1") as engine:
            engine.start_metrics_server(port)

        master = subprocess.run([*MASTER, "--port", "0", "--metrics-port", str(port)],
                                capture_output=True, text=True, timeout=60)
        assert master.returncode == 1, master.stderr
        assert "--metrics-port" in master.stderr and "in use" in master.stderr
    master = subprocess.run([*MASTER, "--port", "0", "--metrics-port", "70000"],
                            capture_output=True, text=True, timeout=60)
    assert master.returncode == 2 and "--metrics-port" in master.stderr


MASTER = [sys.executable, "-m", "hixl.server.master.master", "--no-persist"]
