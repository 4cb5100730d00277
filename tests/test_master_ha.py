"""Several hixl-masters on one etcd (issue 8, part 4b): one leader, standbys take over.

Real parts only: a 3-member etcd cluster on loopback (tests/etcd_cluster.py), real
hixl-master processes on one prefix (killed with SIGKILL, stopped with SIGSTOP), a real
segment holder process (a store client contributing a global segment), a real Mooncake
store client and MasterClients given every master address, a real agent and engine.
Deadlines only bound waits and prove "does not hang"; nothing asserts how long anything
took (scripts/bench_failover.py measures that).
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import grpc
import numpy as np
import pytest
import waiting
from conftest import AgentProcess
from etcd_cluster import EtcdCluster

from hixl import Engine
from hixl.client.agent_client import AgentClient
from hixl.client.mooncake import MooncakeDistributedStore
from hixl.client.store_client import MasterClient
from hixl.etcd import EtcdClient
from hixl.failover import LEADER_METADATA_KEY, NOT_LEADER_CODE, NotLeader
from hixl.registry_client import RegistryClient
from hixl.server.master.etcd_registry import engine_key
from hixl.server.master.leadership import ELECTION_NAME
from hixl.server.master.master import EXIT_DEPOSED
from hixl.store_codes import ErrorCode
from hixl.store_rpc import CallConnection
from hixl.store_types import StoreSegment
from hixl.tools.admin import master_roles
from hixl.tools.cli import main as cli_main
from hixl.tools.daemons import HolderProcess, MasterProcess
from hixl.v1 import agent_pb2, agent_pb2_grpc, store_pb2, store_pb2_grpc

StartAgent = Callable[..., AgentProcess]

MiB = 1 << 20
WAIT_S = 30.0        # the most any wait for an expected event may take (not a speed claim)
LEASE_TTL_S = 2      # the masters' election lease: short, so the tests stay quick
#: what a put may return while the masters switch (never a silent loss: see the test)
SWITCH_CODES = {ErrorCode.RPC_FAIL, ErrorCode.OBJECT_NOT_FOUND,
                ErrorCode.NO_AVAILABLE_HANDLE, ErrorCode.SEGMENT_NOT_FOUND,
                ErrorCode.REPLICA_IS_NOT_READY, ErrorCode.TRANSFER_FAIL}


@pytest.fixture(autouse=True)
def no_token_from_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HIXL_CLUSTER_TOKEN", raising=False)
    monkeypatch.delenv("HIXL_CLUSTER_TOKEN_FILE", raising=False)


wait_until = partial(waiting.wait_until, timeout=WAIT_S)


def pattern(seed: int, size: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


class Masters:
    """hixl-masters on one etcd prefix; the first started leads (it campaigned first)."""

    def __init__(self, cluster: EtcdCluster, count: int, prefix: str | None = None) -> None:
        self.prefix = prefix or f"/hixl/ha-{uuid.uuid4().hex[:8]}/"
        self.flags = ["--etcd-endpoints", ",".join(cluster.endpoints), "--etcd-prefix",
                      self.prefix, "--etcd-lease-ttl", str(LEASE_TTL_S)]
        self.etcd = EtcdClient({"endpoints": cluster.endpoints, "prefix": self.prefix})
        self.procs: list[MasterProcess] = []
        try:
            for _ in range(count):
                self.procs.append(MasterProcess(extra=self.flags))
        except BaseException:
            self.close()
            raise

    @property
    def targets(self) -> list[str]:
        return [p.target for p in self.procs]

    def elected(self) -> str:
        """The leader's address as etcd's election names it ("" when none)."""
        leader = self.etcd.election(ELECTION_NAME).leader()
        return leader.value.decode() if leader is not None else ""

    def serves(self, target: str) -> bool:
        """`target` answers a store call itself (it leads and has loaded the store)."""
        with MasterClient(target, timeout=2.0) as client:
            try:
                client.stats()
            except NotLeader:
                return False
            except Exception:  # noqa: BLE001 - down or starting: not serving
                return False
            return client.current == target

    def leader(self, exclude: tuple[str, ...] = ()) -> MasterProcess:
        """The live master that leads and serves (waiting for one outside `exclude`)."""
        found: list[MasterProcess] = []

        def one() -> bool:
            name = self.elected()
            for proc in self.procs:
                if proc.target == name and name not in exclude and proc.proc.poll() is None \
                        and self.serves(name):
                    found.append(proc)
                    return True
            return False

        wait_until(one, "a master that leads and serves")
        return found[0]

    def restart(self, proc: MasterProcess) -> MasterProcess:
        """Start `proc` again on its port (as its supervisor would): a standby now."""
        proc.close()
        again = MasterProcess(proc.port, extra=self.flags)
        self.procs[self.procs.index(proc)] = again
        return again

    def close(self) -> None:
        for proc in self.procs:
            proc.close()
        self.etcd.close()

    def __enter__(self) -> Masters:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def not_leader_hint(call: Callable[[], object]) -> tuple[grpc.StatusCode, str]:
    """The status and hixl-leader metadata of a call a standby refuses."""
    with pytest.raises(grpc.RpcError) as info:
        call()
    error = info.value
    hint = dict(error.trailing_metadata() or ()).get(LEADER_METADATA_KEY)  # type: ignore[attr-defined]
    return error.code(), hint  # type: ignore[attr-defined,return-value]


def fast_port_of(master: MasterProcess) -> int:
    """The store call endpoint's port, from the master's log (a standby advertises none)."""
    marker = "store call endpoint: port "
    line = next(line for line in master.log().splitlines() if marker in line)
    return int(line.rsplit(marker, 1)[1].split()[0])


# ---------------------------------------------------------------- one leader, standbys


def test_one_leader_and_standbys_that_answer_not_the_leader_with_the_hint(
        cluster: EtcdCluster) -> None:
    with Masters(cluster, 3) as masters:
        leader = masters.leader()
        assert leader is masters.procs[0]
        standbys = masters.procs[1:]
        assert [masters.serves(p.target) for p in masters.procs] == [True, False, False]
        for standby in standbys:
            check_refuses_naming(standby, leader.target)
        # a client given only a standby's address reaches the leader through the hint,
        # a put (not idempotent) included: a refused call was not applied
        with MasterClient(standbys[1].target, timeout=WAIT_S) as client:
            segment = StoreSegment("holder:1", 1, 1, 0x10_0000, 4 * MiB, "node-a")
            assert client.mount_segment(segment).code == ErrorCode.OK
            assert client.current == leader.target
            assert client.remove("nothing") == ErrorCode.OBJECT_NOT_FOUND
        # the standbys really served nothing: their logs show no store call handled
        assert all("won the leadership" not in p.log() for p in standbys)


def check_refuses_naming(standby: MasterProcess, leader: str) -> None:
    """Every Master and Registry call (the watch included) and every call on the store
    call endpoint is answered "not the leader", naming `leader`."""
    channel = grpc.insecure_channel(standby.target)
    try:
        store = store_pb2_grpc.MasterStub(channel)
        registry = agent_pb2_grpc.RegistryStub(channel)
        calls: list[Callable[[], object]] = [
            lambda: store.Stats(store_pb2.StoreStatsRequest(), timeout=WAIT_S),
            lambda: store.PutStart(store_pb2.PutStartRequest(), timeout=WAIT_S),
            lambda: store.Heartbeat(store_pb2.HeartbeatRequest(), timeout=WAIT_S),
            lambda: registry.QuerySegments(agent_pb2.QuerySegmentsRequest(), timeout=WAIT_S),
            lambda: registry.Publish(agent_pb2.PublishRequest(engine="e"), timeout=WAIT_S),
            lambda: next(registry.Watch(agent_pb2.WatchRegistryRequest(), timeout=WAIT_S))]
        for call in calls:
            assert not_leader_hint(call) == (NOT_LEADER_CODE, leader)
    finally:
        channel.close()
    # the store call endpoint refuses too, naming the leader, and stays usable
    connection = CallConnection.open("127.0.0.1", fast_port_of(standby), token=None,
                                     identity="pytest", deadline=time.monotonic() + WAIT_S)
    try:
        for _ in range(2):
            with pytest.raises(NotLeader) as info:
                connection.call(5, b"rid", store_pb2.KeysRequest(keys=["k"]).SerializeToString(),
                                time.monotonic() + WAIT_S)
            assert info.value.leader == leader
    finally:
        connection.close()
    assert "is a standby; the leader is " + leader in details_of(standby)


def details_of(standby: MasterProcess) -> str:
    """What a standby says about itself in a refusal (status and operators read it)."""
    channel = grpc.insecure_channel(standby.target)
    try:
        with pytest.raises(grpc.RpcError) as info:
            store_pb2_grpc.MasterStub(channel).Stats(store_pb2.StoreStatsRequest(),
                                                     timeout=WAIT_S)
        return info.value.details()  # type: ignore[attr-defined,no-any-return]
    finally:
        channel.close()


# ---------------------------------------------------------------- kill the leader mid-load


@dataclass
class Outcome:
    key: str
    seed: int
    size: int
    code: int
    after_kills: int   # kills done when the put started


class PutLoad:
    """A thread doing puts one after another, recording each one's outcome."""

    def __init__(self, store: MooncakeDistributedStore) -> None:
        self.store = store
        self.outcomes: list[Outcome] = []
        self.kills = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="put-load")
        self.error: BaseException | None = None

    def _run(self) -> None:
        index = 0
        try:
            while not self._stop.is_set():
                size = 1000 + (index * 7919) % (64 << 10)
                key = f"load-{index}"
                kills = self.kills
                code = self.store.put(key, pattern(index, size))
                self.outcomes.append(Outcome(key, index, size, code, kills))
                index += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def succeeded_after(self, kills: int) -> int:
        return sum(1 for o in self.outcomes if o.code == 0 and o.after_kills >= kills)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        # every put is bounded by the client's deadlines: the thread ends
        self._thread.join(WAIT_S)
        assert not self._thread.is_alive(), "a put hung"
        assert self.error is None, repr(self.error)


@pytest.fixture
def holder_and_store(request: pytest.FixtureRequest) -> Iterator[Callable[..., MooncakeDistributedStore]]:
    """start(targets) -> a store client (no segment of its own) on every master address,
    with a holder process contributing a 64 MiB segment; both closed after the test."""
    opened: list[object] = []

    def start(targets: list[str]) -> MooncakeDistributedStore:
        addresses = ",".join(targets)
        opened.append(HolderProcess("hixl", addresses, "127.0.0.1", 64 * MiB))
        store = MooncakeDistributedStore(setup_timeout=WAIT_S)
        opened.append(store)
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MiB, "tcp", "",
                           addresses) == 0, store.last_error
        return store

    yield start
    for thing in reversed(opened):
        with contextlib.suppress(Exception):
            thing.close() if isinstance(thing, MooncakeDistributedStore) else thing.stop()  # type: ignore[attr-defined]


def wait_remounted(targets: list[str]) -> None:
    """The holder has remounted its segment at the leader (after a takeover its objects
    answer REPLICA_IS_NOT_READY until then: stored, not lost)."""
    with MasterClient(targets, timeout=WAIT_S) as client:
        def remounted() -> bool:
            stats = client.stats()
            return stats["segments"] >= 1 and stats["segments_awaiting_remount"] == 0
        wait_until(remounted, "the holder's remount at the new leader")


def check_no_put_lost(store: MooncakeDistributedStore, load: PutLoad,
                      targets: list[str]) -> None:
    """Every put that returned 0 reads back byte for byte; the others returned a code a
    switch explains (never a hang: PutLoad.stop)."""
    assert load.outcomes
    wait_remounted(targets)
    for outcome in load.outcomes:
        if outcome.code == 0:
            assert store.get(outcome.key) == pattern(outcome.seed, outcome.size), outcome
        else:
            assert outcome.code in SWITCH_CODES, outcome


def test_kill_9_the_leader_mid_load_a_standby_takes_over_and_no_put_is_lost(
        cluster: EtcdCluster, holder_and_store: Callable[..., MooncakeDistributedStore],
) -> None:
    with Masters(cluster, 3) as masters:
        leader = masters.leader()
        store = holder_and_store(masters.targets)
        load = PutLoad(store)
        load.start()
        try:
            wait_until(lambda: load.succeeded_after(0) >= 20, "puts before the kill")
            for kills in (1, 2):     # the leader, then the standby that took over
                leader.kill()        # SIGKILL, mid-load
                load.kills = kills
                old = leader.target
                leader = masters.leader(exclude=(old,))
                # the SAME client objects put again, at the new leader
                wait_until(lambda k=kills: load.succeeded_after(k) >= 10,  # type: ignore[misc]
                           f"puts after kill {kills}")
        finally:
            load.stop()
        assert leader is masters.procs[2]
        assert store._master is not None and store._master.current == leader.target
        check_no_put_lost(store, load, masters.targets)
        # the killed leaders come back (their supervisor) as standbys; nothing moves
        for proc in masters.procs[:2]:
            again = masters.restart(proc)
            assert not masters.serves(again.target)
        assert masters.leader() is masters.procs[2]
        assert store.put("after-restarts", b"x") == 0
        assert store.get("after-restarts") == b"x"


def test_killing_each_new_leader_again_and_again_keeps_every_key(
        cluster: EtcdCluster, holder_and_store: Callable[..., MooncakeDistributedStore],
) -> None:
    """Three masters, the leader killed four times; each killed one is restarted (as a
    supervisor would) and rejoins as a standby, so there is always one to take over."""
    with Masters(cluster, 3) as masters:
        store = holder_and_store(masters.targets)
        written: dict[str, bytes] = {}
        for round_ in range(4):
            leader = masters.leader()
            for i in range(5):
                key = f"r{round_}-{i}"
                written[key] = pattern(100 * round_ + i, 5000 + i)

                def put_done(key: str = key) -> bool:  # refused only while a switch settles
                    code = store.put(key, written[key])
                    assert code == 0 or code in SWITCH_CODES, code
                    return code == 0

                wait_until(put_done, f"put {key} through the switch", interval=0.1)
            leader.kill()
            masters.leader(exclude=(leader.target,))
            masters.restart(leader)
        wait_remounted(masters.targets)
        for key, value in written.items():
            assert store.get(key) == value, key


def test_a_leader_cut_off_past_its_lease_exits_and_never_serves_again(
        cluster: EtcdCluster, holder_and_store: Callable[..., MooncakeDistributedStore],
) -> None:
    """SIGSTOP the leader beyond its election lease: a standby takes over; once the old
    leader runs again it finds its leadership lost, says so, and exits EXIT_DEPOSED (its
    supervisor restarts it as a standby). Its writes could not land anyway (fenced)."""
    with Masters(cluster, 2) as masters:
        old = masters.leader()
        store = holder_and_store(masters.targets)
        assert store.put("before", b"1") == 0
        old.proc.send_signal(signal.SIGSTOP)
        try:
            new = masters.leader(exclude=(old.target,))
            wait_until(lambda: store.put("during", b"2") == 0, "a put at the new leader",
                       interval=0.1)
        finally:
            old.proc.send_signal(signal.SIGCONT)
        assert old.proc.wait(WAIT_S) == EXIT_DEPOSED
        log = old.log()
        assert "lost the leadership" in log and "comes back as a standby" in log
        assert masters.leader() is new
        wait_remounted(masters.targets)
        assert store.get("before") == b"1" and store.get("during") == b"2"
        again = masters.restart(old)
        assert not masters.serves(again.target)
        assert store.put("after", b"3") == 0 and store.get("after") == b"3"


def test_status_shows_each_masters_role_and_a_dead_standby(
        cluster: EtcdCluster, capsys: pytest.CaptureFixture[str]) -> None:
    with Masters(cluster, 3) as masters:
        leader = masters.leader()
        standbys = [p.target for p in masters.procs if p is not leader]
        everyone = ",".join(masters.targets)
        wait_until(lambda: all(masters_roles(everyone)[s]["leader"] == leader.target
                               for s in standbys), "every standby to know the leader")

        capsys.readouterr()
        assert cli_main(["status", "--master", everyone, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)["master"]
        roles = {m["address"]: (m["role"], m["leader"]) for m in report["masters"]}
        assert roles == {leader.target: ("serving", leader.target),
                         **{s: ("standby", leader.target) for s in standbys}}
        assert cli_main(["status", "--master", everyone]) == 0
        text = capsys.readouterr().out
        assert f"{leader.target} leader" in text
        assert f"{standbys[0]} standby (leader: {leader.target})" in text

        dead = masters.procs[masters.targets.index(standbys[1])]
        dead.kill()
        assert cli_main(["status", "--master", everyone, "--timeout", "2"]) == 1
        out, err = capsys.readouterr()
        assert f"{standbys[1]} DOWN" in out and "DEGRADED" in out
        assert f"master {standbys[1]}: unreachable" in err
        # the leader itself down: nobody serves until a standby takes over
        leader.kill()
        assert cli_main(["status", "--master", everyone, "--timeout", "2"]) == 1
        assert f"{leader.target} DOWN" in capsys.readouterr().out


def masters_roles(target: str) -> dict[str, dict[str, str]]:
    return {m["address"]: m for m in master_roles(target, token=None, timeout=WAIT_S)}


# ---------------------------------------------------------------- registry, prefixes


def test_the_new_leader_serves_the_same_leases_and_agents_never_republish(
        cluster: EtcdCluster, agent_process: StartAgent) -> None:
    """The registry lives on etcd (server/master/etcd_registry.py): a standby that takes over
    serves the agent's table at once, under the agent's own lease, which its keepalives
    go on renewing there; nothing is published again, and an engine's global table
    resyncs to the same content."""
    with Masters(cluster, 2) as masters:
        first = masters.leader()
        # the agent's lease outlives the switch (election lease 2 s + loading)
        agent = agent_process(config={"master": ",".join(masters.targets),
                                      "lease_ttl_ms": 6000,
                                      "pool": [{"size": "1MiB", "name": "kv-pool"}]})
        with RegistryClient(masters.targets, timeout=WAIT_S) as registry, \
                AgentClient(agent.engine) as agent_client, \
                Engine("127.0.0.1", registry=",".join(masters.targets)) as engine:
            wait_until(lambda: len(registry.query(agent.engine)) == 1, "the agent's segment")
            table = engine.global_table
            assert table is not None
            assert table.wait_for(lambda t: len(t.segments(agent.engine)) == 1, WAIT_S)
            before = table.segments(agent.engine)
            lease = agent_client.health()["registry"]["lease_id"]
            assert lease and masters.etcd.refresh(lease) > 0  # an etcd lease
            resyncs = table.resyncs
            first.kill()
            second = masters.leader(exclude=(first.target,))
            assert registry.query(agent.engine) == before  # loaded from etcd, not republished
            assert registry.current == second.target
            keepalives = agent_client.stats()["registry_keepalives"]
            wait_until(lambda: agent_client.stats()["registry_keepalives"] >= keepalives + 2,
                       "the agent's keepalives renewing its lease at the new leader")
            assert agent_client.stats()["registry_publishes"] == 1, agent.log()
            assert agent_client.health()["registry"]["lease_id"] == lease
            assert table.wait_for(lambda t: t.resyncs > resyncs and t.synced
                                  and t.segments(agent.engine) == before, WAIT_S)
            assert table.current == second.target


def test_an_agent_that_dies_while_no_master_leads_is_dropped_by_etcd(
        cluster: EtcdCluster, agent_process: StartAgent) -> None:
    """Leases end on etcd, not in a master: an agent killed while every master is down
    is gone from the table the next leader serves."""
    with Masters(cluster, 1) as masters:
        only = masters.leader()
        agent = agent_process(config={"master": only.target, "lease_ttl_ms": 1000,
                                      "pool": [{"size": "1MiB", "name": "kv-pool"}]})
        with RegistryClient(masters.targets, timeout=WAIT_S) as registry:
            wait_until(lambda: len(registry.query(agent.engine)) == 1, "the agent's segment")
        with AgentClient(agent.engine) as agent_client:
            lease = agent_client.health()["registry"]["lease_id"]
        only.kill()
        agent.proc.kill()
        agent.proc.wait(10)
        # (watched by reading the key: a refresh would renew the lease)
        wait_until(lambda: masters.etcd.get(engine_key(agent.engine)) is None,
                   "etcd ends the agent's lease")
        assert masters.etcd.refresh(lease) == 0
        again = masters.restart(only)
        masters.leader()
        with RegistryClient(again.target, timeout=WAIT_S) as registry:
            assert registry.query(agent.engine) == []
            assert registry.query_engines(agent.engine) == []


def test_a_master_on_another_prefix_never_serves_this_clusters_keys(
        cluster: EtcdCluster, holder_and_store: Callable[..., MooncakeDistributedStore],
) -> None:
    with Masters(cluster, 2) as ours, Masters(cluster, 1) as theirs:
        store = holder_and_store(ours.targets)
        for i in range(5):
            assert store.put(f"ours-{i}", pattern(i, 2000)) == 0
        other = theirs.leader()   # leads its own, empty prefix
        first = ours.leader()
        first.kill()
        second = ours.leader(exclude=(first.target,))
        assert second is ours.procs[1] and ours.elected() == second.target
        assert theirs.elected() == other.target
        with MasterClient(other.target, timeout=WAIT_S) as client:
            assert client.batch_exist_key([f"ours-{i}" for i in range(5)]) == [
                ErrorCode.OBJECT_NOT_FOUND] * 5
            assert client.list_keys("").total == 0
            assert client.current == other.target
        wait_remounted(ours.targets)
        for i in range(5):
            assert store.get(f"ours-{i}") == pattern(i, 2000)
