"""The global address table: a real hixl-master, real hixl-agent processes, real engines.

Every engine follows one watch stream of the registry, so it knows every agent's segments,
epoch and endpoints without an RPC per operation or per connect. The one wall-clock bound
asserted is the issue's contract: a killed agent's segments vanish from every table
within its lease TTL + 1 s. Every other deadline only proves "does not hang".
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from hixl import Engine, NotConnected, OutOfRange, PeerUnavailable, StaleEpoch
from hixl.client import global_table
from hixl.client.agent_client import AgentClient
from hixl.client.global_table import GlobalTable
from hixl.errors import AuthenticationFailed
from hixl.processes import free_port
from hixl.registry_client import EngineEndpoints, EngineInfo, RegistryClient
from hixl.server.registry import SNAPSHOT_CHUNK, EventKind, Registry, RegistryEvent
from hixl.tools.daemons import MasterProcess
from hixl.types import MemType, Perm, SegmentInfo

pytestmark = pytest.mark.timeout(180)

TTL_S = 1.0
GIVE_UP_S = 30.0  # only a guard against a hang: no assertion depends on it
POOL = 1 << 20
AGENTS = 3


@pytest.fixture
def master() -> Iterator[MasterProcess]:
    with MasterProcess() as process:
        yield process


@pytest.fixture
def cluster(master: MasterProcess, agent_process: Callable[..., object]):
    """3 agents on fixed gRPC ports publishing to the master; `restart(i)` brings one back."""
    ports = [free_port() for _ in range(AGENTS)]

    def start(index: int):
        return agent_process(config={
            "grpc_port": ports[index], "master": master.target,
            "lease_ttl_ms": int(TTL_S * 1000), "log_level": "DEBUG",
            "pool": [{"name": "kv", "size": POOL}]})

    agents = [start(i) for i in range(AGENTS)]
    return agents, start


def whole(table: GlobalTable, agents) -> bool:  # noqa: ANN001 - AgentProcess list
    """Every agent is listed with its current epoch and all its pool segments."""
    engines = table.engines()
    return all(agent.engine in engines and engines[agent.engine].epoch == agent.info.epoch
               and set(agent.info.segments) <= set(table.segments(agent.engine))
               for agent in agents)


def kv(engine: Engine, agent: str) -> SegmentInfo:
    (segment,) = [s for s in engine.segments(agent) if s.name == "kv"]
    return segment


def random_bytes(seed: int, size: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


# ---------------------------------------------------------------- membership and the table


def test_every_agent_is_listed_with_endpoints_and_allocations_arrive_by_watch(
        master: MasterProcess, cluster) -> None:
    agents, _ = cluster
    with GlobalTable(master.target) as table:
        assert table.wait_for(lambda t: whole(t, agents), GIVE_UP_S)
        assert table.synced and table.resyncs == 1
        for agent in agents:
            info = table.engines()[agent.engine]
            assert info.node_id == agent.info.node_id
            assert info.endpoints == EngineEndpoints(
                fabric_domain=agent.info.fabric_domain, data_tcp=agent.info.data_tcp,
                data_unix=agent.info.data_unix, fd_socket=agent.info.fd_socket)
            (pool,) = agent.info.segments
            assert table.find(agent.engine, pool.base + 10, 100) == pool

        # a third party allocates on agent 1: the table hears of it from the watch alone
        before = table.version
        with AgentClient(agents[1].engine, timeout=10) as client:
            allocated = client.allocate(64 << 10, Perm.READ, "late", "pytest")
        assert table.wait_for(lambda t: allocated in t.segments(agents[1].engine), GIVE_UP_S)
        assert table.version > before
        assert table.find(agents[1].engine, allocated.base, allocated.length) == allocated

        with pytest.raises(OutOfRange, match=f"engine '{agents[1].engine}' address"):
            table.find(agents[1].engine, allocated.end, 1)
        with pytest.raises(NotConnected, match="'10.9.9.9:1' is not in the registry"):
            table.find("10.9.9.9:1", 0x1000, 1)


@pytest.mark.parametrize("fabric", ["1", "0"], ids=["fabric", "socket"])
def test_put_and_get_through_a_registry_engine_need_no_handshake(
        master: MasterProcess, cluster, fabric: str) -> None:
    agents, _ = cluster
    with Engine("127.0.0.1", {"EnableUseFabricMem": fabric}, registry=master.target) as engine:
        assert engine.global_table is not None
        assert engine.global_table.wait_for(lambda t: whole(t, agents), GIVE_UP_S)
        assert set(engine.engines()) == {a.engine for a in agents}
        for index, agent in enumerate(agents):
            engine.connect(agent.engine, timeout=GIVE_UP_S)
            assert engine.route(agent.engine, kv(engine, agent.engine).base) == (
                "fabric" if fabric == "1" else "unix")
            data = random_bytes(index, POOL)
            out = np.zeros_like(data)
            handles = [engine.register(data), engine.register(out)]
            target = kv(engine, agent.engine)
            engine.write(agent.engine, data, target.base, timeout=GIVE_UP_S)
            engine.read(agent.engine, out, target.base, timeout=GIVE_UP_S)
            assert out.tobytes() == data.tobytes()

            # a segment allocated after connect is usable at once: the watch brought it
            late = engine.allocate(agent.engine, 4096, name="late")
            engine.write(agent.engine, data[:4096], late.base, timeout=GIVE_UP_S)
            out[:] = 0
            engine.read(agent.engine, out[:4096], late.base, timeout=GIVE_UP_S)
            assert out[:4096].tobytes() == data[:4096].tobytes()

            # ... and a released one is gone from the view: a typed miss, no RPC
            engine.release(agent.engine, late)
            assert engine.global_table.wait_for(
                lambda t, a=agent.engine, s=late: s not in t.segments(a), GIVE_UP_S)
            with pytest.raises(OutOfRange, match=f"of {agent.engine}"):
                engine.write(agent.engine, data[:4096], late.base, timeout=GIVE_UP_S)
            for handle in handles:
                engine.deregister(handle)

        # the bytes really are in the agents: read them back over the other path, P2P
        other = "0" if fabric == "1" else "1"
        with Engine("127.0.0.1", {"EnableUseFabricMem": other}) as checker:
            for index, agent in enumerate(agents):
                checker.connect(agent.engine, timeout=GIVE_UP_S)
                out = np.zeros(POOL, dtype=np.uint8)
                checker.register(out)
                checker.read(agent.engine, out, kv(checker, agent.engine).base,
                             timeout=GIVE_UP_S)
                assert out.tobytes() == random_bytes(index, POOL).tobytes()

    for agent in agents:  # one Handshake each, the P2P checker's: none from the registry engine
        assert agent.log().count("handshake from 127.0.0.1") == 1


def test_killed_agent_vanishes_within_ttl_and_comes_back_with_a_new_epoch(
        master: MasterProcess, cluster) -> None:
    agents, restart = cluster
    victim = agents[0]
    with Engine("127.0.0.1", registry=master.target) as engine:
        table = engine.global_table
        assert table is not None and table.wait_for(lambda t: whole(t, agents), GIVE_UP_S)
        engine.connect(victim.engine, timeout=GIVE_UP_S)
        data = random_bytes(7, 4096)
        engine.register(data)
        old = kv(engine, victim.engine)
        engine.write(victim.engine, data, old.base, timeout=GIVE_UP_S)

        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(GIVE_UP_S)
        # the contract: gone from the table within the lease TTL + 1 s
        assert table.wait_for(lambda t: victim.engine not in t.engines(), timeout=TTL_S + 1.0)
        assert table.segments(victim.engine) == []
        assert whole(table, agents[1:])

        # a transfer to it fails at once, typed, naming the engine; nothing hangs
        with pytest.raises(PeerUnavailable, match=f"{victim.engine} is gone"):
            engine.write(victim.engine, data, old.base, timeout=GIVE_UP_S)
        with pytest.raises(PeerUnavailable, match=f"{victim.engine} is gone"):
            engine.segments(victim.engine)

        reborn = restart(0)
        assert reborn.engine == victim.engine and reborn.info.epoch > victim.info.epoch
        assert table.wait_for(lambda t: whole(t, [reborn, *agents[1:]]), GIVE_UP_S)
        assert table.engines()[victim.engine].epoch == reborn.info.epoch

        # the old connection is stale until reconnected, exactly as peer-to-peer
        with pytest.raises(StaleEpoch, match="restarted"):
            engine.write(victim.engine, data, old.base, timeout=GIVE_UP_S)
        engine.disconnect(victim.engine)
        engine.connect(victim.engine, timeout=GIVE_UP_S)
        new = kv(engine, victim.engine)
        assert new.epoch == reborn.info.epoch
        engine.write(victim.engine, data, new.base, timeout=GIVE_UP_S)
        out = np.zeros_like(data)
        engine.register(out)
        engine.read(victim.engine, out, new.base, timeout=GIVE_UP_S)
        assert out.tobytes() == data.tobytes()


def test_master_restart_resyncs_every_table(master: MasterProcess, cluster) -> None:
    agents, _ = cluster
    with Engine("127.0.0.1", registry=master.target) as engine:
        table = engine.global_table
        assert table is not None and table.wait_for(lambda t: whole(t, agents), GIVE_UP_S)
        engine.connect(agents[2].engine, timeout=GIVE_UP_S)

        master.kill()
        assert table.wait_for(lambda t: not t.synced, GIVE_UP_S)
        # the last view stays readable while the registry is away
        assert whole(table, agents)
        again = MasterProcess(port=master.port)
        try:
            # a fresh snapshot, then the agents republish: the table is whole again
            assert table.wait_for(lambda t: t.synced and whole(t, agents), GIVE_UP_S)
            assert table.resyncs >= 2
            data = random_bytes(11, 8192)
            out = np.zeros_like(data)
            engine.register(data)
            engine.register(out)
            target = kv(engine, agents[2].engine)
            engine.write(agents[2].engine, data, target.base, timeout=GIVE_UP_S)
            engine.read(agents[2].engine, out, target.base, timeout=GIVE_UP_S)
            assert out.tobytes() == data.tobytes()
        finally:
            again.close()


# ---------------------------------------------------------------- other registries, fallbacks


def test_a_standalone_agents_embedded_registry_serves_the_table(agent_process) -> None:
    agent = agent_process(config={"pool": [{"name": "kv", "size": POOL}]})
    with Engine("127.0.0.1", registry=agent.engine) as engine:
        table = engine.global_table
        assert table is not None and table.wait_for(lambda t: whole(t, [agent]), GIVE_UP_S)
        engine.connect(agent.engine, timeout=GIVE_UP_S)
        data = random_bytes(5, POOL)
        out = np.zeros_like(data)
        engine.register(data)
        engine.register(out)
        target = kv(engine, agent.engine)
        engine.write(agent.engine, data, target.base, timeout=GIVE_UP_S)
        engine.read(agent.engine, out, target.base, timeout=GIVE_UP_S)
        assert out.tobytes() == data.tobytes()


def test_engine_with_a_port_publishes_its_memory_to_the_registry(master: MasterProcess) -> None:
    with Engine(f"127.0.0.1:{free_port()}", registry=master.target) as server, \
            Engine("127.0.0.1", registry=master.target) as client:
        memory = server.malloc(1 << 16)
        handle = server.register(memory, name="served")
        assert handle.segment is not None
        table = client.global_table
        assert table is not None
        assert table.wait_for(lambda t: handle.segment in t.segments(server.name), GIVE_UP_S)
        client.connect(server.name, timeout=GIVE_UP_S)
        data = random_bytes(9, 1 << 16)
        client.register(data)
        client.write(server.name, data, handle.segment.base, timeout=GIVE_UP_S)
        assert bytes(memory.view()) == data.tobytes()


def test_an_engine_the_registry_does_not_know_is_reached_by_handshake(
        master: MasterProcess, agent_process) -> None:
    loner = agent_process(config={"pool": [{"name": "kv", "size": POOL}]})  # own registry
    with Engine("127.0.0.1", registry=master.target) as engine:
        assert engine.global_table is not None and engine.global_table.wait_synced(GIVE_UP_S)
        assert loner.engine not in engine.engines()
        engine.connect(loner.engine, timeout=GIVE_UP_S)
        data = random_bytes(3, 4096)
        out = np.zeros_like(data)
        engine.register(data)
        engine.register(out)
        target = kv(engine, loner.engine)
        engine.write(loner.engine, data, target.base, timeout=GIVE_UP_S)
        engine.read(loner.engine, out, target.base, timeout=GIVE_UP_S)
        assert out.tobytes() == data.tobytes()


def test_registry_comes_from_the_environment(master: MasterProcess, cluster,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    agents, _ = cluster
    monkeypatch.setenv("HIXL_REGISTRY", master.target)
    with Engine("127.0.0.1") as engine:
        assert engine.registry == master.target
        assert engine.global_table is not None
        assert engine.global_table.wait_for(lambda t: whole(t, agents), GIVE_UP_S)
        assert set(engine.engines()) == {a.engine for a in agents}
        assert set(engine.segments(agents[0].engine)) == set(agents[0].info.segments)


def test_without_a_registry_engines_is_refused_by_name(agent_process,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HIXL_REGISTRY", raising=False)
    agent = agent_process(config={"pool": [{"name": "kv", "size": POOL}]})
    with Engine("127.0.0.1") as engine:
        assert engine.global_table is None
        with pytest.raises(NotConnected, match="no registry"):
            engine.engines()
        engine.connect(agent.engine, timeout=GIVE_UP_S)
        assert engine.segments(agent.engine) == agent.info.segments


def test_a_big_snapshot_arrives_whole_in_pieces(master: MasterProcess) -> None:
    count = SNAPSHOT_CHUNK * 2 + 17
    segments = [SegmentInfo(segment_id=i + 1, engine="big:1", node_id="n", base=(i + 1) << 16,
                            length=1 << 12, mem_type=MemType.MEM_HOST, perms=Perm.RW,
                            epoch=3, shareable=False) for i in range(count)]
    with RegistryClient(master.target, timeout=GIVE_UP_S) as client:
        client.publish("big:1", "n", 3, segments, 30_000)
        assert len(client.query("big:1", timeout=GIVE_UP_S)) == count
        (info,) = client.query_engines("big:1", timeout=GIVE_UP_S)
        assert (info.engine, info.epoch, info.endpoints) == ("big:1", 3, EngineEndpoints())
    with GlobalTable(master.target) as table:
        assert table.wait_synced(GIVE_UP_S)
        assert table.resyncs == 1 and len(table) == count
        assert table.segments("big:1") == segments


def test_an_unreachable_registry_never_blocks_the_caller() -> None:
    table = GlobalTable(f"127.0.0.1:{free_port()}", timeout=1.0)
    try:
        assert not table.wait_synced(0.3)
        assert table.engines() == {} and len(table) == 0 and not table.synced
        with pytest.raises(NotConnected, match="not in the registry"):
            table.find("a:1", 0, 1)
    finally:
        table.close()


def test_engines_before_the_registry_ever_answered_raises_with_the_reason(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty table is not an empty cluster: with no master at the address, engines()
    raises PeerUnavailable naming the registry and why (not `{}` and an INFO line)."""
    monkeypatch.setattr(global_table, "DEFAULT_TIMEOUT_S", 1.0)  # the bounded wait, shorter
    registry = f"127.0.0.1:{free_port()}"
    with Engine("127.0.0.1", registry=registry) as engine:
        with pytest.raises(PeerUnavailable) as caught:
            engine.engines()
        said = str(caught.value)
        assert f"registry {registry} has not answered since this engine started" in said
        assert "Connection refused" in said  # the watch's own reason
        assert f"is hixl-master running at {registry}" in said
        table = engine.global_table
        assert table is not None and isinstance(table.last_error, PeerUnavailable)


def test_a_registry_that_starts_late_is_followed_and_then_outlived(
        caplog: pytest.LogCaptureFixture) -> None:
    """The master comes up after the engine: once its first snapshot arrives, engines()
    answers from it; an outage after that keeps serving the last table, no raise."""
    port = free_port()
    with Engine("127.0.0.1", registry=f"127.0.0.1:{port}") as engine:
        table = engine.global_table
        assert table is not None
        assert table.wait_for(lambda t: t.last_error is not None, GIVE_UP_S)
        assert any(r.levelname == "WARNING" and "has not answered" in r.getMessage()
                   for r in caplog.records if r.name == "hixl.global_table")
        with MasterProcess(port=port) as master:
            with RegistryClient(master.target, timeout=GIVE_UP_S) as client:
                client.publish("late:1", "n", 7, [], 30_000)
            table.require(GIVE_UP_S)  # the first snapshot: no raise from now on
            assert table.wait_for(lambda t: "late:1" in t.engines(), GIVE_UP_S)
            assert engine.engines()["late:1"].epoch == 7
            master.kill()
            assert table.wait_for(lambda t: not t.synced, GIVE_UP_S)
            assert engine.engines()["late:1"].epoch == 7  # the last known table
        table.require(0)  # returns at once: it was synced once


def test_a_registry_refusing_the_token_is_reported_at_once(tmp_path) -> None:
    """A wrong cluster token is not mended by waiting: engines() raises the refusal at once
    (the long deadline below would fail the test by its timeout if it were waited out)."""
    token = tmp_path / "token"
    token.write_bytes(b"the-cluster-token-of-this-test")
    token.chmod(0o600)
    with MasterProcess(extra=["--cluster-token-file", str(token)]) as master, \
            Engine("127.0.0.1", registry=master.target, cluster_token=b"another-token") \
            as engine:
        table = engine.global_table
        assert table is not None
        with pytest.raises(AuthenticationFailed) as caught:
            table.require(600.0)
        assert f"registry {master.target} has not answered since this engine started" \
            in str(caught.value)
        assert "token" in str(caught.value)


# ---------------------------------------------------------------- membership events (domain)


def test_membership_watchers_see_engines_come_and_go_in_order() -> None:
    now = [100.0]
    registry = Registry(clock=lambda: now[0])
    plain = registry.subscribe()
    members = registry.subscribe(engines=True)
    ends = EngineEndpoints(fabric_domain="n", data_tcp="10.0.0.1:7000", fd_socket="/x")

    def seg(number: int, epoch: int) -> SegmentInfo:
        return SegmentInfo(segment_id=number, engine="a:1", node_id="n", base=number << 20,
                           length=4096, mem_type=MemType.MEM_HOST, perms=Perm.RW,
                           epoch=epoch, shareable=True)

    def drain(subscription) -> list[RegistryEvent]:  # noqa: ANN001
        events = []
        while subscription.pending():
            events.append(subscription.get(timeout=0))
        return events

    registry.publish("a:1", "n", 1, [seg(1, 1)], 1_000, endpoints=ends)
    registry.publish("idle:1", "n", 1, [], 1_000)                     # no segments at all
    registry.publish("a:1", "n", 2, [seg(2, 2)], 1_000, endpoints=ends)  # a restart
    now[0] += 2.0
    registry.expire()

    up1, up2 = EngineInfo("a:1", "n", 1, ends), EngineInfo("a:1", "n", 2, ends)
    idle = EngineInfo("idle:1", "n", 1)
    events = drain(members)
    assert events[:7] == [
        RegistryEvent(EventKind.SNAPSHOT, 0, (), ()),
        RegistryEvent(EventKind.ENGINE_UP, 1, (), (up1,)),
        RegistryEvent(EventKind.ADDED, 1, (seg(1, 1),)),
        RegistryEvent(EventKind.ENGINE_UP, 1, (), (idle,)),
        RegistryEvent(EventKind.REMOVED, 1, (seg(1, 1),)),
        RegistryEvent(EventKind.ENGINE_UP, 2, (), (up2,)),
        RegistryEvent(EventKind.ADDED, 2, (seg(2, 2),)),
    ]
    # both leases expire together: which engine goes first is not promised, but each
    # engine's REMOVED comes before its ENGINE_DOWN
    tail = events[7:]
    assert [e for e in tail if e.engines == (idle,)] == [
        RegistryEvent(EventKind.ENGINE_DOWN, 1, (), (idle,))]
    assert [e for e in tail if e.engines != (idle,)] == [
        RegistryEvent(EventKind.REMOVED, 2, (seg(2, 2),)),
        RegistryEvent(EventKind.ENGINE_DOWN, 2, (), (up2,))]
    # a watcher that did not ask for membership gets the segment stream it always got
    plain_events = drain(plain)
    assert [e.kind for e in plain_events] == [
        EventKind.SNAPSHOT, EventKind.ADDED, EventKind.REMOVED, EventKind.ADDED,
        EventKind.REMOVED]
    assert all(e.engines == () for e in plain_events)


def test_bench_registry_json_shape() -> None:
    """`hixl bench-registry` end to end with tiny numbers; no timing is judged."""
    proc = subprocess.run(
        [sys.executable, "-m", "hixl.tools.cli", "bench-registry", "--publishers", "3",
         "--segments", "30", "--watchers", "2", "--changes", "4", "--small-segments", "6",
         "--finds", "200", "--timeout", "60", "--json", "-"],
        capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert "publish() returned -> seen by all" in proc.stderr  # the table
    assert report["config"]["publishers"] == 3 and report["config"]["watchers"] == 2
    assert report["population"]["segments"] == 30 and report["population"]["engines"] == 3
    for key in ("propagation_ms", "propagation_from_call_ms"):
        stats = report[key]
        assert stats["samples"] == 4
        assert stats["min"] <= stats["p50"] <= stats["p99"] <= stats["max"]
    assert report["snapshot"]["segments"] == report["snapshot"]["total"] == 30 + 4
    assert report["snapshot"]["new_watcher_s"] > 0
    assert report["snapshot"]["watchers_together_s"]["samples"] == 2
    finds = report["find_ns"]
    assert finds["small"]["segments"] == 6 and finds["full"]["segments"] == 30
    assert finds["small"]["ns"] > 0 and finds["full"]["ns"] > 0 and finds["ratio"] > 0
