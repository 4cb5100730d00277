"""`hixl soak`: random engine and store calls from client processes while agents and the
master are killed and restarted; every byte read is checked, every call has a deadline.

The short soak here runs as CI does it (a subprocess, fixed seed); its length is a run
length, never an assertion. Also here: regression tests for the bugs the soak found.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import waiting

from hixl import Engine, TransferTimeout, wire
from hixl.client.agent_client import AgentClient
from hixl.processes import free_port
from hixl.tools import cli
from hixl.tools.daemons import MasterProcess
from hixl.tools.soak import LEASE_TTL_MS, OP_KINDS
from hixl.types import Perm
from hixl.wire import HEADER_SIZE, Reason, ServedSegment, ServerProtocol

GIVE_UP_S = 30.0   # only a guard against a hang: no assertion depends on timing


def run_soak(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    report = tmp_path / "soak.json"
    done = subprocess.run(
        [sys.executable, "-m", "hixl.tools.cli", "soak", *args, "--json", str(report)],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert report.exists(), f"no report (rc={done.returncode}):\n{done.stdout}\n{done.stderr}"
    return done, json.loads(report.read_text())


def assert_clean(done: subprocess.CompletedProcess[str], report: dict[str, Any]) -> None:
    """No corrupt read, hung call or lost key; every kind of call ran and succeeded."""
    assert report["corrupt_reads"] == 0, report["details"]["corrupt"]
    assert report["hung_calls"] == 0, report["details"]["hung"]
    assert report["keys_lost"] == 0, report["details"]["lost"]
    assert report["errors"] == [], report["errors"]
    assert report["ok"] and done.returncode == 0, done.stdout + done.stderr
    for kind in OP_KINDS:
        assert report["ops"][kind].get("calls", 0) > 0, kind
        assert report["ops"][kind].get("ok", 0) > 0, (kind, report["failures"][kind])
    assert report["verified"].get("engine_slots", 0) > 0
    assert report["verified"].get("store_keys", 0) > 0
    assert "corrupt reads" in done.stdout and "PASSED" in done.stdout


@pytest.mark.timeout(600)
def test_short_soak_with_agent_and_master_kills(tmp_path: Path) -> None:
    """2 clients (fabric/p2p and socket/registry), 2 agents, a kill every ~2 s: agents
    and the master both die and come back, and nothing is corrupted, hung or lost."""
    done, report = run_soak(tmp_path, "--clients", "2", "--agents", "2", "--seconds", "8",
                            "--kill-every", "2", "--seed", "3", "--value-sizes", "1K,64K,256K")
    assert_clean(done, report)
    faults = report["faults"]
    assert faults["agent_kills"] > 0 and faults["master_kills"] > 0, faults
    assert faults["final_master_restarts"] == 1 and faults["restart_failures"] == 0, faults
    assert {c["path"] for c in report["clients"]} == {"fabric", "socket"}
    assert {c["tables"] for c in report["clients"]} == {"p2p", "registry"}


@pytest.mark.timeout(300)
def test_soak_of_a_running_cluster(tmp_path: Path,
                                   agent_process: Callable[..., Any]) -> None:
    """--master/--agent: no faults, the same checks; the soak gives back what it took
    (its segments in the agents, its keys)."""
    # the soak's own master leases reads for LEASE_TTL_MS; so must this one, or the space
    # of replaced values stays held for Mooncake's 5 s and the pool evicts
    with MasterProcess(extra=["--data-dir", str(tmp_path / "data"),
                              f"--default_kv_lease_ttl={LEASE_TTL_MS}"]) as master:
        agents = [agent_process(config={"master": master.target}) for _ in range(2)]
        done, report = run_soak(tmp_path, "--clients", "2", "--seconds", "3", "--kill-every",
                                "0", "--master", master.target, "--agent",
                                ",".join(a.engine for a in agents), "--value-sizes", "4K,64K")
        assert_clean(done, report)
        assert report["faults"]["agent_kills"] == report["faults"]["master_kills"] == 0
        for agent in agents:
            with AgentClient(agent.engine, timeout=GIVE_UP_S) as client:
                _, segments = client.list_segments()
            assert not [s for s in segments if s.name.startswith("soak-")]


def test_faults_are_refused_on_a_running_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["soak", "--master", "127.0.0.1:1", "--agent", "127.0.0.1:2",
                   "--kill-every", "1"])
    assert rc == cli.EXIT_FAILED
    assert "--kill-every 0" in capsys.readouterr().err
    rc = cli.main(["soak", "--master", "127.0.0.1:1", "--kill-every", "0"])
    assert rc == cli.EXIT_FAILED
    assert "both --master and --agent" in capsys.readouterr().err


# ------------------------------------------------------------------ bugs the soak found


def test_unknown_segment_of_an_older_epoch_is_a_stale_handle() -> None:
    """A frame naming a segment id the agent does not serve, with an epoch older than the
    agent's, comes from the agent's previous life (ids start again after a restart):
    STALE_EPOCH (reconnect), not UNKNOWN_SEGMENT (PARAM_INVALID, "your request is bad").
    The soak saw registry clients, still on the old view, get ParamInvalid."""
    segment = ServedSegment(1, 50, 0x1000, 4096, Perm.RW, memoryview(bytearray(4096)))
    server = ServerProtocol({1: segment}.get, epoch=50)
    hello = server.on_header(wire.hello(1, b"peer")[:HEADER_SIZE])
    server.on_hello(hello.request_id, b"peer")
    for epoch, reason in ((40, Reason.STALE_EPOCH), (50, Reason.UNKNOWN_SEGMENT)):
        reply = server.on_header(wire.read_request(2, 9, epoch, 0x1000, 8)).reply
        assert wire.decode_header(reply[:HEADER_SIZE]).reason == reason


@pytest.fixture
def restartable(agent_process: Callable[..., Any]) -> Iterator[tuple[Any, Callable[[], Any]]]:
    ports = {"grpc_port": free_port(), "data_port": free_port()}
    first = agent_process(config=ports)

    def restart() -> Any:
        return agent_process(config={**ports, "runtime_dir": first.runtime_dir})

    yield first, restart


def test_restarted_agent_calls_an_old_allocated_segment_stale(restartable) -> None:
    """End to end: a segment allocated before the restart (the new agent has no such id)."""
    first, restart = restartable
    with AgentClient(first.engine, timeout=GIVE_UP_S) as client:
        old = client.allocate(4096, Perm.RW, name="gone")
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(GIVE_UP_S)
    second = restart()
    assert old.segment_id not in {s.segment_id for s in second.info.segments}
    host, port = second.info.data_tcp.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=GIVE_UP_S) as sock:
        sock.sendall(wire.hello(1) + wire.read_request(2, old.segment_id, old.epoch,
                                                       old.base, 64))
        raw = b""
        while len(raw) < 2 * HEADER_SIZE:
            chunk = sock.recv(65536)
            assert chunk, "agent closed the connection instead of answering"
            raw += chunk
    assert wire.decode_header(raw[HEADER_SIZE:2 * HEADER_SIZE]).reason == Reason.STALE_EPOCH


def test_allocate_that_the_registry_cannot_show_is_released_and_raises(
        tmp_path: Path, agent_process: Callable[..., Any]) -> None:
    """Registry mode: allocate() promises a segment usable at once (it waits until the
    engine's view has it). With the master gone the view never gets it: the soak saw
    allocate() return anyway, then OutOfRange on the first transfer, and the segment
    leaked. Now: TransferTimeout naming the registry, and the segment released."""
    master = MasterProcess(extra=["--data-dir", str(tmp_path / "data")])
    try:
        agent = agent_process(config={"master": master.target})
        with Engine("127.0.0.1", {"EnableUseFabricMem": "0"}, registry=master.target) as engine:
            engine.connect(agent.engine, timeout=GIVE_UP_S)
            usable = engine.allocate(agent.engine, 4096, name="before")   # master up: fine
            buf = np.arange(4096, dtype=np.uint8)
            engine.register(buf)
            engine.write(agent.engine, buf, usable.base, timeout=GIVE_UP_S)
            master.kill()
            engine.disconnect(agent.engine)
            engine.connect(agent.engine, timeout=2.0)   # the last view: no master needed
            with pytest.raises(TransferTimeout, match="registry"):
                engine.allocate(agent.engine, 4096, name="during")
            with AgentClient(agent.engine, timeout=GIVE_UP_S) as client:
                _, segments = client.list_segments()
            assert [s.name for s in segments] == ["before"]    # "during" was given back
    finally:
        master.close()


@pytest.mark.parametrize("call", ["put", "get"])
def test_call_right_after_a_master_restart_finds_the_remounted_segment(
        tmp_path: Path, call: str) -> None:
    """After a master restart the client's segment awaits its remount, so a put's
    PutStart finds no room (NO_AVAILABLE_HANDLE) and a get's replicas are not ready
    (REPLICA_IS_NOT_READY); the call then checks in and tries again. The soak saw such
    calls fail anyway (puts ~1 per client per master restart): the heartbeat thread had
    remounted the segment first, so the call's own check-in found nothing to remount and
    it did not try again. Here that order is forced: the heartbeat thread is held off,
    the call reaches its check-in, the segment is remounted, then the check-in goes on."""
    from hixl.client.mooncake import MooncakeDistributedStore

    data = ["--data-dir", str(tmp_path / "data")]
    master = MasterProcess(extra=data)
    store = MooncakeDistributedStore(setup_timeout=GIVE_UP_S)
    try:
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", 4 << 20, 1 << 20, "tcp", "",
                           master.target) == 0, store.last_error
        assert store.put("before", b"x" * 1000) == 0
        value = np.random.default_rng(5).integers(0, 256, 50_000, dtype=np.uint8).tobytes()
        result: list[int] = []
        with store._checkin_lock:               # no check-in (heartbeat or put) for now
            master.kill()
            master.close()
            master = MasterProcess(int(master.target.rsplit(":", 1)[1]), extra=data)
            putter = threading.Thread(target=lambda: result.append(
                store.put("after", value) if call == "put" else len(store.get("before"))))
            putter.start()

            def checking_in() -> bool:  # PutStart found no room
                if in_function(putter, "_check_in"):
                    return True
                assert putter.is_alive(), result
                return False

            waiting.wait_until(checking_in, "the call waiting to check in", GIVE_UP_S,
                               interval=0.01)
            mounted = store._master.mount_segment(store._segment)   # as the heartbeat does
            assert mounted.code == 0
        putter.join(GIVE_UP_S)
        assert result == [0 if call == "put" else 1000], store.last_error
        if call == "put":
            assert store.get("after") == value
        assert store.get("before") == b"x" * 1000
    finally:
        store.close()
        master.close()


def in_function(thread: threading.Thread, name: str) -> bool:
    """Whether `thread` is running inside a function called `name` now."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == name:
            return True
        frame = frame.f_back
    return False
