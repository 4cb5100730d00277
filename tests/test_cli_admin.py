"""`hixl status`, `hixl segments`, `hixl keys` against real processes.

A real hixl-master, real hixl-agent processes, a real store client putting real values,
a real engine holding a data connection; the CLI runs in-process (`main([...])`) and once
as the installed `hixl` console script. Deadlines only prove "does not hang".
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import waiting
from conftest import AgentProcess

from hixl import Engine
from hixl.client.agent_client import AgentClient
from hixl.client.mooncake import MooncakeDistributedStore
from hixl.processes import free_port
from hixl.registry_client import RegistryClient
from hixl.server.master.store import ObjectStore, StoreOptions
from hixl.store_codes import ErrorCode
from hixl.store_types import KeyState, ReplicaConfig, StoreSegment
from hixl.tools.cli import main
from hixl.tools.daemons import MasterProcess

StartAgent = Callable[..., AgentProcess]

DEADLINE_S = 20.0
TOKEN = b"admin-test-token"
VALUES = {"layer0/block-1": 5000, "layer0/block-2": 70_000, "other": 100}
HIXL = Path(sys.executable).with_name("hixl")  # the console script of this environment


@pytest.fixture(autouse=True)
def no_token_from_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HIXL_CLUSTER_TOKEN", raising=False)
    monkeypatch.delenv("HIXL_CLUSTER_TOKEN_FILE", raising=False)


@pytest.fixture
def master() -> Iterator[MasterProcess]:
    with MasterProcess() as process:
        yield process


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of `hixl ARGV` run in this process."""
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    rc, out, err = run(capsys, *argv, "--json")
    assert rc == 0, err
    return json.loads(out)


wait_until = partial(waiting.wait_until, timeout=DEADLINE_S)


def token_file(tmp_path: Path, token: bytes) -> str:
    path = tmp_path / f"token-{len(token)}-{token[:3].hex()}"
    path.write_bytes(token)
    path.chmod(0o600)
    return str(path)


# ---------------------------------------------------------------- a cluster with a store


@pytest.fixture
def cluster(master: MasterProcess, agent_process: StartAgent,
            ) -> Iterator[tuple[MasterProcess, AgentProcess, MooncakeDistributedStore]]:
    """A master; an agent publishing to it (pool segment "kv-pool"); a store client whose
    segment lives in that agent, holding VALUES."""
    agent = agent_process(config={"master": master.target,
                                  "pool": [{"size": "1MiB", "name": "kv-pool"}]})
    store = MooncakeDistributedStore(agent=agent.engine, setup_timeout=DEADLINE_S)
    assert store.setup("127.0.0.1", "P2PHANDSHAKE", 4 << 20, 1 << 20, "tcp", "",
                       master.target) == 0, store.last_error
    try:
        for key, size in VALUES.items():
            assert store.put(key, key.encode()[:1] * size) == 0, store.last_error
        with RegistryClient(master.target, timeout=DEADLINE_S) as registry:
            wait_until(lambda: len(registry.query(agent.engine)) == 2,
                       "the store's segment in the master's registry")
        yield master, agent, store
    finally:
        store.close()


def agent_segments(agent: AgentProcess) -> list[Any]:
    with AgentClient(agent.engine, timeout=DEADLINE_S) as client:
        return sorted(client.list_segments()[1], key=lambda s: s.base)


def test_status_reports_the_agent_its_master_and_the_store(cluster, capsys) -> None:
    master, agent, _ = cluster
    segments = agent_segments(agent)
    rc, out, err = run(capsys, "status", "--agent", agent.engine)
    assert rc == 0, err
    assert f"agent {agent.engine}: SERVING" in out
    assert f"master {master.target}: published" in out  # the agent's registry state
    assert f"master {master.target}: SERVING" in out    # found through the agent
    assert f"pid {os.getpid()}" in out                  # the store client, on the fd socket
    assert f"{len(VALUES)} objects, 1 clients alive" in out
    assert out.rstrip().endswith("OK") and err == ""

    report = run_json(capsys, "status", "--agent", agent.engine)
    assert report["ok"] is True
    health = report["agent"]["health"]
    assert health["engine"] == agent.engine and health["epoch"] == agent.info.epoch
    assert health["segments"] == 2
    assert health["segment_bytes"] == sum(s.length for s in segments)
    assert health["registry"]["mode"] == "master"
    assert health["registry"]["target"] == master.target and health["registry"]["published"]
    fd_peers = [p["address"] for p in health["peers"] if p["kind"] == "fd"]
    assert any(address.startswith(f"pid {os.getpid()} uid ") for address in fd_peers)
    assert report["agent"]["counters"]["segments"] == 2
    registry = report["master"]["registry"]
    assert [e["engine"] for e in registry["engines"]] == [agent.engine]
    assert registry["segments"] == 2 and registry["engines"][0]["epoch"] == agent.info.epoch
    store = report["master"]["store"]
    assert store["keys"] == len(VALUES) and store["clients"] == 1
    [mounted] = store["segments"]
    assert mounted["engine"] == agent.engine and mounted["live"] and mounted["used"] > 0
    assert mounted["length"] == 4 << 20 and store["capacity"] == 4 << 20

    rc, out, err = run(capsys, "status", "--master", master.target)  # the master alone
    assert rc == 0, err
    assert "agent " not in out.splitlines()[0] and f"master {master.target}: SERVING" in out


def test_segments_lists_the_global_table(cluster, capsys) -> None:
    master, agent, _ = cluster
    segments = agent_segments(agent)
    rc, out, err = run(capsys, "segments", "--master", master.target)
    assert rc == 0, err
    assert out.startswith(f"2 segments from the registry of master {master.target}")
    lines = out.splitlines()
    for seg in segments:
        [row] = [line for line in lines if f"{seg.base:#x}" in line]
        assert agent.engine in row and seg.node_id in row and f" {seg.epoch} " in row
        assert " rw " in row and agent.info.data_tcp in row
    assert any("kv-pool" in line and " 1M " in line for line in lines)
    assert any(" 4M " in line for line in lines)  # the store's segment

    expected = [{"engine": s.engine, "segment_id": s.segment_id, "name": s.name,
                 "base": s.base, "length": s.length, "epoch": s.epoch} for s in segments]
    for source in (("--master", master.target), ("--agent", agent.engine)):
        listing = run_json(capsys, "segments", *source)
        got = [{k: row[k] for k in expected[0]} for row in listing["segments"]]
        assert got == expected, source
        assert all(row["data"] == agent.info.data_tcp for row in listing["segments"])
    node = segments[0].node_id
    assert len(run_json(capsys, "segments", "--master", master.target, "--node", node)
               ["segments"]) == 2
    rc, out, _ = run(capsys, "segments", "--master", master.target, "--node", "elsewhere")
    assert rc == 0 and out.startswith("0 segments")


def test_keys_lists_objects_by_pattern(cluster, capsys) -> None:
    master, agent, store = cluster
    [store_segment] = [s for s in agent_segments(agent) if s.name != "kv-pool"]
    rc, out, err = run(capsys, "keys", "--master", master.target)
    assert rc == 0, err
    assert out.startswith("3 keys\n")
    for key, size_text in (("layer0/block-1", "4.9K"), ("layer0/block-2", "68.4K"),
                           ("other", "100B")):
        [row] = [line for line in out.splitlines() if line.startswith(key + " ")]
        assert size_text in row and "COMPLETE" in row
        assert f"{agent.engine}/{store_segment.segment_id}" in row

    assert store.get("other") == b"o" * VALUES["other"]  # a read: "other" is leased now
    listing = run_json(capsys, "keys", "--master", master.target)
    assert listing["total"] == 3 and not listing["truncated"]
    rows = {row["key"]: row for row in listing["keys"]}
    assert {key: row["size"] for key, row in rows.items()} == VALUES
    for row in rows.values():
        [replica] = row["replicas"]
        assert replica["engine"] == agent.engine and replica["live"]
        assert replica["segment_id"] == store_segment.segment_id
        assert store_segment.base <= replica["addr"] < store_segment.base + store_segment.length
    assert rows["other"]["lease_ms"] > 0

    rc, out, err = run(capsys, "keys", "^layer0/", "--master", master.target, "--limit", "1")
    assert rc == 0
    assert out.startswith("1 of 2 keys matching '^layer0/'") and "layer0/block-1" in out
    assert "layer0/block-2" not in out and "truncated" in out and "truncated" in err
    listing = run_json(capsys, "keys", "block-2$", "--master", master.target)
    assert [row["key"] for row in listing["keys"]] == ["layer0/block-2"]


def test_bad_regex_is_refused_by_name(master: MasterProcess, capsys) -> None:
    rc, out, err = run(capsys, "keys", "layer(", "--master", master.target)
    assert rc == 1 and out == ""
    assert "bad regex 'layer('" in err and "INVALID_PARAMS" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


# ---------------------------------------------------------------- embedded registry, peers


def test_embedded_registry_and_data_peers_via_the_console_script(
        agent_process: StartAgent, capsys) -> None:
    agent = agent_process(config={"pool": [{"size": "256KiB", "name": "solo"}]})
    [seg] = agent.info.segments
    with Engine("127.0.0.1", {"EnableUseFabricMem": "0"}) as engine:
        payload = os.urandom(8192)
        engine.register(payload)
        engine.connect(agent.engine)
        engine.write(agent.engine, payload, seg.base)  # leaves a pooled data connection
        report = run_json(capsys, "status", "--agent", agent.engine)
        data_peers = [p for p in report["agent"]["health"]["peers"]
                      if p["kind"] in ("unix", "tcp")]
        assert data_peers and all(p["identity"] for p in data_peers)
        assert report["agent"]["counters"]["data_bytes_written"] == len(payload)

    registry = report["agent"]["health"]["registry"]
    assert registry["mode"] == "embedded" and registry["engines"] == 1
    assert registry["segments"] == 1 and registry["published"]
    assert report["master"] is None  # an embedded registry leads to no master

    env = {k: v for k, v in os.environ.items() if not k.startswith("HIXL_CLUSTER_TOKEN")}
    done = subprocess.run([str(HIXL), "segments", "--agent", agent.engine, "--json"],
                          capture_output=True, text=True, timeout=DEADLINE_S * 3, env=env)
    assert done.returncode == 0, done.stderr
    listing = json.loads(done.stdout)
    assert listing["source"] == f"embedded registry of agent {agent.engine}"
    assert [(r["segment_id"], r["name"], r["base"], r["length"]) for r in listing["segments"]] \
        == [(seg.segment_id, "solo", seg.base, seg.length)]
    done = subprocess.run([str(HIXL), "status", "--agent", agent.engine],
                          capture_output=True, text=True, timeout=DEADLINE_S * 3, env=env)
    assert done.returncode == 0, done.stderr
    assert "registry  embedded (1 engines, 1 segments" in done.stdout
    assert "segments  1 (256K)" in done.stdout


# ---------------------------------------------------------------- failures


def test_unreachable_endpoints_fail_fast_with_a_named_reason(capsys) -> None:
    dead = f"127.0.0.1:{free_port()}"
    for argv, role in ((("status", "--agent", dead), "agent"),
                       (("status", "--master", dead), "master"),
                       (("segments", "--master", dead), "master"),
                       (("segments", "--agent", dead), "agent"),
                       (("keys", "--master", dead), "master")):
        rc, _, err = run(capsys, *argv, "--timeout", "2")
        assert rc == 1, argv
        first = err.strip().splitlines()[0]
        assert f"{role} {dead}: unreachable" in first, (argv, err)
        assert "Traceback" not in err

    done = subprocess.run([str(HIXL), "status", "--agent", dead, "--timeout", "2"],
                          capture_output=True, text=True, timeout=DEADLINE_S * 3)
    assert done.returncode == 1
    assert done.stderr.startswith(f"hixl status: error: agent {dead}: unreachable")
    assert done.stdout.rstrip().endswith("DOWN")


def test_a_wrong_token_is_reported_as_authentication_failure(
        agent_process: StartAgent, tmp_path: Path, capsys) -> None:
    right, wrong = token_file(tmp_path, TOKEN), token_file(tmp_path, b"not-the-token")
    agent = agent_process(config={"cluster_token_file": right,
                                  "pool": [{"size": "64KiB", "name": "secured"}]})
    for flags in (("--token-file", wrong), ()):
        rc, _, err = run(capsys, "status", "--agent", agent.engine, *flags)
        assert rc == 1
        assert f"agent {agent.engine}: authentication refused" in err, err
        rc, _, err = run(capsys, "segments", "--agent", agent.engine, *flags)
        assert rc == 1 and f"agent {agent.engine}: authentication refused" in err, err
    assert run_json(capsys, "status", "--agent", agent.engine, "--token-file", right)["ok"]
    listing = run_json(capsys, "segments", "--agent", agent.engine, "--token-file", right)
    assert [r["name"] for r in listing["segments"]] == ["secured"]

    with MasterProcess(extra=["--cluster-token-file", right]) as master:
        rc, _, err = run(capsys, "keys", "--master", master.target, "--token-file", wrong)
        assert rc == 1 and f"master {master.target}: authentication refused" in err, err
        rc, _, err = run(capsys, "status", "--master", master.target, "--token-file", wrong)
        assert rc == 1 and f"master {master.target}: authentication refused" in err, err
        assert run_json(capsys, "keys", "--master", master.target,
                        "--token-file", right)["total"] == 0


# ---------------------------------------------------------------- ObjectStore.list_keys


def test_object_store_list_keys_states_leases_pins_and_limits() -> None:
    now = [1000.0]
    store = ObjectStore(StoreOptions(), clock=lambda: now[0])
    segment = StoreSegment("10.0.0.1:1", 7, 3, 1 << 30, 1 << 20, "node-a", name="seg-a")
    assert store.mount_segment("client", segment).code == ErrorCode.OK
    committed, pinned, pending = store.put_start(
        "client", [("k/committed", 100), ("k/pinned", 200), ("k/pending", 300)])
    pinned_again = store.put_start("client", [("k/hard", 50)],
                                   ReplicaConfig(with_hard_pin=True))[0]
    assert store.put_end("client", [("k/committed", committed.put_id),
                                    ("k/pinned", pinned.put_id),
                                    ("k/hard", pinned_again.put_id)]) == [ErrorCode.OK] * 3
    store.get_replicas(["k/committed"])

    listing = store.list_keys("^k/")
    assert listing.code == ErrorCode.OK and listing.total == 4 and not listing.truncated
    infos = {info.key: info for info in listing.keys}
    assert [info.key for info in listing.keys] == sorted(infos)
    assert infos["k/pending"].state == KeyState.PUTTING and infos["k/pending"].size == 300
    assert infos["k/committed"].state == KeyState.COMPLETE
    assert infos["k/committed"].lease_ms == StoreOptions().default_kv_lease_ttl_ms
    assert infos["k/pinned"].lease_ms == 0 and infos["k/hard"].hard_pin
    [replica] = infos["k/committed"].replicas
    assert replica.segment_name == "seg-a" and replica.live
    assert replica.replica.segment_id == 7 and replica.replica.length == 100

    now[0] += StoreOptions().default_kv_lease_ttl_ms / 1000 + 1  # the lease is over, and
    store.heartbeat("client")  # listing took none
    assert store.list_keys("committed").keys[0].lease_ms == 0
    limited = store.list_keys("", limit=2)
    assert [i.key for i in limited.keys] == ["k/committed", "k/hard"]
    assert limited.total == 4 and limited.truncated
    bad = store.list_keys("k/(")
    assert bad.code == ErrorCode.INVALID_PARAMS and "bad regex 'k/('" in bad.message
    assert store.list_keys("nothing-matches").total == 0
