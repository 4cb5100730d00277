"""Issue 15, item 1: the registry hijack, tried against real processes, and shown to hold.

The attack: a caller that may talk to the registry (a cluster-token holder; anyone, on a
registry without a token) publishes another engine's name with epoch 2**32-1 (its
segments' epochs to match) and its own data endpoint, to take the name and have clients
send the victim's PUTs to it; or renews / withdraws the victim's lease by its id (which
the victim's Health shows), or guesses lease ids; or waits for the victim to die and then
takes its name. Each is refused; the honest agent keeps its name and its table, clients
that follow the registry still move bytes to it (never to the attacker's endpoint), and a
restarted agent (same state dir) takes its name back at once.

Deadlines here only prove "does not hang"; nothing asserts how long anything took.
"""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import waiting
from conftest import AgentProcess
from test_master_process import Master

from hixl import Engine, auth
from hixl.client.agent_client import AgentClient
from hixl.errors import NotConnected, PermissionDenied
from hixl.processes import free_port
from hixl.registry_client import (
    OWNER_KEY_SIZE,
    EngineEndpoints,
    RegistryClient,
    owner_secret_path,
)
from hixl.server.registry import MAX_EPOCH
from hixl.types import MemType, Perm, SegmentInfo

TOKEN = b"hijack-test-cluster-token"
DEADLINE_S = 30.0
TTL_MS = 2_000          # short: the victim's lease must end within the test
LONG_TTL_MS = 30_000    # long: a restart must not wait for the old lease to end
wait_for = partial(waiting.wait_until, timeout=DEADLINE_S)

StartAgent = Callable[..., AgentProcess]


@pytest.fixture(autouse=True)
def _no_token_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(auth.ENV_TOKEN, raising=False)
    monkeypatch.delenv(auth.ENV_TOKEN_FILE, raising=False)


@pytest.fixture
def token_file(tmp_path: Path) -> str:
    path = tmp_path / "cluster.token"
    path.write_bytes(TOKEN)
    path.chmod(0o600)
    return str(path)


@pytest.fixture
def master(token_file: str) -> Iterator[Master]:
    process = Master("--port", "0", "--cluster-token-file", token_file)
    try:
        process.wait_ready()
        yield process
    finally:
        process.kill()


@pytest.fixture
def trap() -> Iterator[socket.socket]:
    """The attacker's data endpoint: a listening socket that must never be dialled."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    sock.setblocking(False)
    yield sock
    sock.close()


def trap_was_dialled(trap: socket.socket) -> bool:
    try:
        conn, _ = trap.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


def forged_table(engine: str, epoch: int) -> list[SegmentInfo]:
    """A table claiming the victim's name, with epochs raised to match the forged one."""
    return [SegmentInfo(segment_id=1, engine=engine, node_id="evil", base=0x7000_0000,
                        length=1 << 20, mem_type=MemType.MEM_HOST, perms=Perm.RW,
                        epoch=epoch, shareable=True, name="pool")]


def health(agent: AgentProcess, token: bytes | None) -> dict[str, Any]:
    with AgentClient(agent.engine, timeout=DEADLINE_S, cluster_token=token) as client:
        return client.health()


def listed(registry: RegistryClient, engine: str) -> tuple[int, EngineEndpoints] | None:
    """(epoch, endpoints) of `engine` in the registry, None when it has no live lease."""
    infos = registry.query_engines(engine)
    return (infos[0].epoch, infos[0].endpoints) if infos else None


def try_every_attack(attacker: RegistryClient, victim: AgentProcess, lease_id: int,
                     trap: socket.socket) -> None:
    """Each attack on a live victim is refused, naming why."""
    endpoints = EngineEndpoints(fabric_domain="evil",
                                data_tcp=f"127.0.0.1:{trap.getsockname()[1]}")
    forged = forged_table(victim.engine, MAX_EPOCH)
    # the huge epoch, with a key of the attacker's own, with none, and with an empty one
    for key in (None, os.urandom(OWNER_KEY_SIZE), b""):
        with pytest.raises(PermissionDenied, match="owner"):
            attacker.publish(victim.engine, "evil", MAX_EPOCH, forged, TTL_MS,
                             endpoints=endpoints, owner_key=key)
    # the victim's own lease id (its Health shows it), with no key and a made-up one
    for key in (b"", os.urandom(OWNER_KEY_SIZE)):
        with pytest.raises(PermissionDenied, match="owner key"):
            attacker.keepalive(lease_id, owner_key=key)
        with pytest.raises(PermissionDenied, match="owner key"):
            attacker.unpublish(lease_id, owner_key=key)
    # guessed ids next to it are no lease at all: ids are random, not counted
    for guess in (lease_id - 2, lease_id - 1, lease_id + 1, lease_id + 2, 1, 2):
        with pytest.raises(NotConnected):
            attacker.unpublish(guess)


def assert_victim_serves(registry_target: str, victim: AgentProcess, token: bytes | None,
                         trap: socket.socket) -> None:
    """A client following the registry writes bytes to the victim and reads them back."""
    payload = os.urandom(256 << 10)
    back = bytearray(len(payload))
    with Engine("127.0.0.1", {"EnableUseFabricMem": "0"}, registry=registry_target,
                cluster_token=token) as engine:
        engine.connect(victim.engine)
        segment = engine.allocate(victim.engine, len(payload))
        engine.register(payload)
        engine.register(back)
        engine.write(victim.engine, payload, segment.base)
        engine.read(victim.engine, back, segment.base)
        engine.release(victim.engine, segment)
    assert back == payload
    assert not trap_was_dialled(trap)


def test_a_token_holder_cannot_take_a_live_or_dead_engine_from_the_master(
        master: Master, agent_process: StartAgent, token_file: str, tmp_path: Path,
        trap: socket.socket) -> None:
    state_dir = str(tmp_path / "victim-state")
    config = {"master": master.target, "cluster_token_file": token_file,
              "lease_ttl_ms": TTL_MS, "state_dir": state_dir, "grpc_port": free_port(),
              "pool": [{"size": "1MiB"}]}
    victim = agent_process(config=config)
    with RegistryClient(master.target, timeout=DEADLINE_S, cluster_token=TOKEN) as attacker:
        wait_for(lambda: listed(attacker, victim.engine) is not None, "the victim's lease")
        state = health(victim, TOKEN)
        lease_id = state["registry"]["lease_id"]
        before = listed(attacker, victim.engine)
        table = sorted(attacker.query(victim.engine), key=lambda s: s.base)

        try_every_attack(attacker, victim, lease_id, trap)

        # nothing changed: the victim's epoch, endpoints, table and lease are its own
        assert listed(attacker, victim.engine) == before == (state["epoch"], before[1])
        assert sorted(attacker.query(victim.engine), key=lambda s: s.base) == table
        assert health(victim, TOKEN)["registry"]["lease_id"] == lease_id
        assert_victim_serves(master.target, victim, TOKEN, trap)
        assert health(victim, TOKEN)["registry"]["failures"] == 0

        # the victim dies; once its lease ended, its name is still not the attacker's
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(DEADLINE_S)
        wait_for(lambda: listed(attacker, victim.engine) is None, "the dead victim's lease ends")
        endpoints = EngineEndpoints(data_tcp=f"127.0.0.1:{trap.getsockname()[1]}")
        for epoch in (1, state["epoch"] + 1, MAX_EPOCH):
            with pytest.raises(PermissionDenied, match="owned by another owner key"):
                attacker.publish(victim.engine, "evil", epoch,
                                 forged_table(victim.engine, epoch), TTL_MS,
                                 endpoints=endpoints)
        assert listed(attacker, victim.engine) is None

        # the same agent (same port, same state dir) comes back and is its owner again
        back = agent_process(config=config)
        assert back.engine == victim.engine
        wait_for(lambda: (listed(attacker, back.engine) or (0,))[0] == back.info.epoch,
                 "the restarted victim's lease")
        assert back.info.epoch > state["epoch"]
        assert health(back, TOKEN)["registry"]["failures"] == 0
        assert_victim_serves(master.target, back, TOKEN, trap)


def test_a_killed_agent_restarted_with_its_state_dir_takes_its_name_back_at_once(
        master: Master, agent_process: StartAgent, token_file: str, tmp_path: Path,
        trap: socket.socket) -> None:
    state_dir = str(tmp_path / "state")
    config = {"master": master.target, "cluster_token_file": token_file,
              "lease_ttl_ms": LONG_TTL_MS, "state_dir": state_dir, "grpc_port": free_port(),
              "pool": [{"size": "1MiB"}]}
    first = agent_process(config=config)
    secret = owner_secret_path(state_dir, first.engine)
    assert os.stat(secret).st_mode & 0o777 == 0o600
    assert os.stat(state_dir).st_mode & 0o777 == 0o700
    with RegistryClient(master.target, timeout=DEADLINE_S, cluster_token=TOKEN) as registry:
        wait_for(lambda: listed(registry, first.engine) is not None, "the first lease")
        old_lease = health(first, TOKEN)["registry"]["lease_id"]
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(DEADLINE_S)
        # the old lease lives on (30 s); the restarted agent replaces it with its first
        # publish: no refusal, no waiting for the old lease to end
        assert listed(registry, first.engine) is not None
        second = agent_process(config=config)
        assert second.engine == first.engine and second.info.epoch > first.info.epoch
        wait_for(lambda: health(second, TOKEN)["registry"]["published"], "the new lease")
        state = health(second, TOKEN)["registry"]
        assert state["failures"] == 0 and state["last_error"] == ""
        assert state["lease_id"] != old_lease
        assert listed(registry, second.engine)[0] == second.info.epoch
        with pytest.raises(NotConnected):  # the old lease is gone, not merely outlived
            registry.keepalive(old_lease)
        # and the attack on the new lease fails as on the old one
        try_every_attack(registry, second, state["lease_id"], trap)
        assert_victim_serves(master.target, second, TOKEN, trap)


def test_without_a_token_anyone_is_refused_on_an_agents_embedded_registry(
        agent_process: StartAgent, tmp_path: Path, trap: socket.socket) -> None:
    """An agent with no master and no token: its embedded registry is open to anyone who
    reaches the port, and still binds its name (and the names of agents publishing to it)."""
    host = agent_process(config={"state_dir": str(tmp_path / "host"),
                                 "pool": [{"size": "1MiB"}]})
    peer_config = {"master": host.engine, "state_dir": str(tmp_path / "peer"),
                   "lease_ttl_ms": LONG_TTL_MS, "grpc_port": free_port(),
                   "pool": [{"size": "1MiB"}]}
    peer = agent_process(config=peer_config)
    with RegistryClient(host.engine, timeout=DEADLINE_S) as anyone:
        wait_for(lambda: listed(anyone, peer.engine) is not None, "the peer's lease")
        for victim in (host, peer):
            state = health(victim, None)
            before = listed(anyone, victim.engine)
            assert before is not None and before[0] == state["epoch"]
            try_every_attack(anyone, victim, state["registry"]["lease_id"], trap)
            assert listed(anyone, victim.engine) == before
            assert health(victim, None)["registry"]["failures"] == 0
            assert_victim_serves(host.engine, victim, None, trap)
        # the peer is killed and restarted with its state dir: its name, at once
        peer.proc.send_signal(signal.SIGKILL)
        peer.proc.wait(DEADLINE_S)
        again = agent_process(config=peer_config)
        assert again.engine == peer.engine
        wait_for(lambda: (listed(anyone, again.engine) or (0,))[0] == again.info.epoch,
                 "the restarted peer's lease")
        assert health(again, None)["registry"]["failures"] == 0
        assert_victim_serves(host.engine, again, None, trap)


def test_an_agent_refuses_a_state_dir_or_secret_others_could_touch(
        agent_process: StartAgent, tmp_path: Path) -> None:
    """The secret is only as good as its file: a loose mode fails the start, naming it."""
    from conftest import agent_command, clean_env

    state_dir = tmp_path / "loose"
    state_dir.mkdir(mode=0o700)
    port = free_port()
    engine = f"127.0.0.1:{port}"
    secret = Path(owner_secret_path(str(state_dir), engine))
    secret.write_bytes(os.urandom(OWNER_KEY_SIZE))
    secret.chmod(0o644)
    config = tmp_path / "agent.yaml"
    config.write_text(f"host: 127.0.0.1\ngrpc_port: {port}\nruntime_dir: {tmp_path}/run\n"
                      f"state_dir: {state_dir}\n")
    import subprocess

    done = subprocess.run(agent_command(str(config)), capture_output=True, text=True,
                          env=clean_env(), timeout=DEADLINE_S * 2)
    assert done.returncode != 0
    assert str(secret) in done.stderr and "group or others" in done.stderr
    secret.chmod(0o600)
    state_dir.chmod(0o777)
    done = subprocess.run(agent_command(str(config)), capture_output=True, text=True,
                          env=clean_env(), timeout=DEADLINE_S * 2)
    assert done.returncode != 0 and "writable by group or others" in done.stderr
