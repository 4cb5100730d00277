"""The store's Master service in a real hixl-master process, driven by MasterClient.

Deadlines only prove "does not hang": nothing asserts how long anything took. The
"fails fast" checks give the client a deadline far beyond the test's own timeout, so a
call that waited for its deadline would fail the test instead of passing slowly.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
import waiting

from hixl.client.store_client import MasterClient
from hixl.server.master.master import MasterConfig, StoreConfig, default_data_dir, parse_config
from hixl.store_codes import ErrorCode
from hixl.store_types import (
    ClientStatus,
    MasterAuthenticationFailed,
    MasterRpcError,
    MasterUnavailable,
    ReplicaConfig,
    StoreSegment,
)
from hixl.tools.daemons import MasterProcess

MiB = 1 << 20
DEADLINE_S = 20.0
#: A client deadline no test may wait out (the test's own timeout is far shorter).
UNREACHABLE_DEADLINE_S = 600.0



def seg(engine: str, segment_id: int = 1, epoch: int = 1, length: int = MiB) -> StoreSegment:
    return StoreSegment(engine, segment_id, epoch, 0x10_0000, length, "node-a")


#: call() once the master answers (a restarted one takes a moment to be reached): its
#: result (tests/waiting.py)
eventually = partial(waiting.wait_until, timeout=DEADLINE_S, done=lambda _: True,
                     retry_on=(MasterUnavailable,))


#: Leases that cannot run out mid-test, however slow the machine.
LONG_LEASE_MS = 600_000


@pytest.fixture
def master(tmp_path: Path) -> Iterator[MasterProcess]:
    with MasterProcess(extra=["--data-dir", str(tmp_path / "data"),
                              f"--default_kv_lease_ttl={LONG_LEASE_MS}"]) as process:
        yield process


@pytest.fixture
def client(master: MasterProcess) -> Iterator[MasterClient]:
    with MasterClient(master.target, timeout=DEADLINE_S, client_id="client-1") as c:
        yield c


def put(client: MasterClient, keys: list[str], size: int,
        config: ReplicaConfig | None = None) -> dict[str, list[tuple[str, int, int, int]]]:
    """Two-phase puts of `keys` in one batch each way; returns key -> replica spans."""
    started = client.batch_put_start([(key, size) for key in keys], config)
    assert [s.code for s in started] == [ErrorCode.OK] * len(keys)
    assert client.batch_put_end([(k, s.put_id) for k, s in zip(keys, started, strict=True)]) == [
        ErrorCode.OK] * len(keys)
    return {k: [(r.engine, r.segment_id, r.addr, r.length) for r in s.replicas]
            for k, s in zip(keys, started, strict=True)}


# ---------------------------------------------------------------- the service


def test_store_calls_end_to_end(client: MasterClient) -> None:
    assert client.heartbeat().status == ClientStatus.NEED_REMOUNT   # not known yet
    assert client.mount_segment(seg("a")).code == ErrorCode.OK
    assert client.mount_segment(seg("b")).code == ErrorCode.OK
    assert client.heartbeat() == client.heartbeat()
    assert client.heartbeat().status == ClientStatus.OK
    mounted = client.list_segments()
    assert sorted((m.segment.engine, m.client_id, m.live) for m in mounted) == [
        ("a", "client-1", True), ("b", "client-1", True)]

    [started] = client.batch_put_start([("k", 1000)], ReplicaConfig(replica_num=2))
    assert client.exist_key("k") == ErrorCode.OBJECT_NOT_FOUND      # invisible before end
    assert client.put_end("k", started.put_id) == ErrorCode.OK
    got = client.get_replicas("k")
    assert (got.code, got.size, got.lease_ttl_ms) == (ErrorCode.OK, 1000, LONG_LEASE_MS)
    assert sorted(r.engine for r in got.replicas) == ["a", "b"]
    assert {(r.addr, r.length, r.epoch) for r in got.replicas} == {
        (r.addr, r.length, r.epoch) for r in started.replicas}

    results = client.batch_put_start([("k", 10), ("", 10), ("j", 0), ("j", 64)])
    assert [r.code for r in results] == [ErrorCode.OBJECT_ALREADY_EXISTS, ErrorCode.INVALID_KEY,
                                         ErrorCode.INVALID_PARAMS, ErrorCode.OK]
    assert client.put_revoke("j", results[3].put_id) == ErrorCode.OK
    assert client.batch_exist_key(["k", "j"]) == [ErrorCode.OK, ErrorCode.OBJECT_NOT_FOUND]
    assert client.batch_get_size(["k", "j"]) == [1000, ErrorCode.OBJECT_NOT_FOUND]

    [upsert] = client.batch_put_start([("k", 2000)], upsert=True)
    assert client.get_size("k") == 1000
    assert client.put_end("k", upsert.put_id) == ErrorCode.OK
    assert client.get_size("k") == 2000

    put(client, ["x1", "x2", "y"], 64)
    # get_size is a read: it leased the new value, as in Mooncake
    assert client.remove("k") == ErrorCode.OBJECT_HAS_LEASE
    assert client.remove("k", force=True) == ErrorCode.OK
    put(client, ["k"], 64)
    assert client.get_replicas("k").code == ErrorCode.OK
    assert client.remove("k") == ErrorCode.OBJECT_HAS_LEASE
    assert client.batch_remove(["k", "y", "nope"], force=True) == [
        ErrorCode.OK, ErrorCode.OK, ErrorCode.OBJECT_NOT_FOUND]
    removed = client.remove_by_regex("^x")
    assert (removed.code, removed.count) == (ErrorCode.OK, 2)
    assert client.remove_by_regex("(").code == ErrorCode.INVALID_PARAMS
    put(client, ["z"], 64)
    assert client.remove_all().count == 1
    stats = client.stats()
    assert stats["keys"] == 0 and stats["segments"] == 2 and stats["capacity"] == 2 * MiB

    assert client.unmount_segment("b", 1).code == ErrorCode.OK
    assert client.unmount_segment("b", 1).code == ErrorCode.SEGMENT_NOT_FOUND


def test_a_large_batch_is_one_call(client: MasterClient) -> None:
    client.mount_segment(seg("a", length=64 * MiB))
    keys = [f"layer{i // 64}_block{i % 64}_k" for i in range(5000)]
    spans = put(client, keys, 4096)
    assert len({s[0][2] for s in spans.values()}) == 5000            # 5000 distinct addresses
    results = client.batch_get_replicas(keys)
    assert [r.code for r in results] == [ErrorCode.OK] * 5000
    assert client.batch_remove(keys, force=True) == [ErrorCode.OK] * 5000


def test_kill_9_and_restart_keeps_every_committed_key(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = MasterProcess(extra=["--data-dir", str(data)])
    port = first.port
    owner = MasterClient(first.target, timeout=UNREACHABLE_DEADLINE_S, client_id="owner")
    other = MasterClient(first.target, timeout=UNREACHABLE_DEADLINE_S, client_id="other")
    try:
        assert owner.mount_segment(seg("a", epoch=11)).code == ErrorCode.OK
        assert other.mount_segment(seg("b", epoch=4)).code == ErrorCode.OK
        keys = [f"key-{i}" for i in range(200)]
        committed = put(owner, keys, 1000, ReplicaConfig(replica_num=2))
        assert owner.batch_remove(keys[:10], force=True) == [ErrorCode.OK] * 10
        [pending] = owner.batch_put_start([("in-progress", 5000)])
        assert pending.code == ErrorCode.OK

        first.kill()                                            # SIGKILL: no goodbye
        for call in (owner.heartbeat, lambda: owner.get_replicas("key-50"),
                     lambda: owner.batch_put_start([("k", 1)])):
            with pytest.raises(MasterUnavailable) as caught:
                call()
            assert caught.value.code == ErrorCode.RPC_FAIL

        second = MasterProcess(port, extra=["--data-dir", str(data)])
        try:
            # the owners notice the restart and remount; their objects come back
            assert eventually(owner.heartbeat, "heartbeat").status == ClientStatus.NEED_REMOUNT
            assert owner.exist_key("key-50") == ErrorCode.REPLICA_IS_NOT_READY
            assert owner.mount_segment(seg("a", epoch=11)).objects == 190
            assert eventually(other.heartbeat, "heartbeat").status == ClientStatus.NEED_REMOUNT
            assert other.mount_segment(seg("b", epoch=4)).objects == 190
            results = owner.batch_get_replicas(keys)
            assert [r.code for r in results[:10]] == [ErrorCode.OBJECT_NOT_FOUND] * 10
            for key, result in zip(keys[10:], results[10:], strict=True):
                assert result.code == ErrorCode.OK and result.size == 1000, key
                assert sorted((r.engine, r.segment_id, r.addr, r.length)
                              for r in result.replicas) == sorted(committed[key])
            # the put that was in progress was never committed
            assert owner.exist_key("in-progress") == ErrorCode.OBJECT_NOT_FOUND
            assert owner.put_end("in-progress", pending.put_id) == ErrorCode.OBJECT_NOT_FOUND
            put(owner, ["after-restart"], 10)
            assert second.stop() == 0
        finally:
            second.close()
    finally:
        owner.close()
        other.close()
        first.close()


def test_every_file_a_master_writes_is_owner_only(tmp_path: Path) -> None:
    """Snapshots followed the umask (0644) while the journal was 0600: a hixl-master run
    under umask 022 leaves its data dir 0700 and every file in it 0600, and a restart
    finds every key."""
    data = tmp_path / "data"
    old_umask = os.umask(0o022)                       # the master inherits it
    try:
        first = MasterProcess(extra=["--data-dir", str(data)])
    finally:
        os.umask(old_umask)
    try:
        with MasterClient(first.target, timeout=DEADLINE_S, client_id="owner") as client:
            assert client.mount_segment(seg("a")).code == ErrorCode.OK
            put(client, [f"key-{i}" for i in range(20)], 100)
        assert first.stop() == 0                       # a graceful stop writes a snapshot
    finally:
        first.close()
    found = {p.name: p.stat().st_mode & 0o777 for p in data.iterdir()}
    assert any(name.startswith("snapshot-") for name in found), found
    assert found == dict.fromkeys(found, 0o600) and data.stat().st_mode & 0o777 == 0o700
    second = MasterProcess(extra=["--data-dir", str(data)])
    try:
        with MasterClient(second.target, timeout=DEADLINE_S, client_id="owner") as client:
            assert client.mount_segment(seg("a")).objects == 20
            assert client.list_keys("").total == 20
    finally:
        second.close()


def test_no_persist_keeps_nothing(tmp_path: Path) -> None:
    first = MasterProcess(extra=["--no-persist"])
    try:
        with MasterClient(first.target, timeout=DEADLINE_S) as client:
            client.mount_segment(seg("a"))
            put(client, ["k"], 10)
            first.kill()
            second = MasterProcess(first.port, extra=["--no-persist"])
            try:
                eventually(client.heartbeat, "heartbeat")
                assert client.mount_segment(seg("a")).objects == 0
                assert client.exist_key("k") == ErrorCode.OBJECT_NOT_FOUND
            finally:
                second.close()
    finally:
        first.close()


def test_a_data_dir_serves_one_master(master: MasterProcess, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "hixl.server.master.master", "--port", "0", "--data-dir",
         str(tmp_path / "data")], capture_output=True, text=True, timeout=DEADLINE_S)
    assert result.returncode == 1
    assert "in use by another hixl-master" in result.stderr


def test_an_unreachable_master_fails_fast_and_typed(tmp_path: Path) -> None:
    gone = MasterProcess(extra=["--no-persist"])
    gone.close()
    with MasterClient(gone.target, timeout=UNREACHABLE_DEADLINE_S) as client:
        with pytest.raises(MasterUnavailable, match=f"at master {gone.target}") as caught:
            client.batch_exist_key(["k"])
        assert caught.value.code == ErrorCode.RPC_FAIL
        with pytest.raises(MasterUnavailable):
            client.mount_segment(seg("a"))


def test_cluster_token_is_required(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret")
    token_file.chmod(0o600)
    with MasterProcess(extra=["--no-persist", "--cluster-token-file", str(token_file)]) as m:
        with MasterClient(m.target, timeout=DEADLINE_S) as anonymous, \
                pytest.raises(MasterAuthenticationFailed, match="no cluster token") as caught:
            anonymous.exist_key("k")
        assert caught.value.code == ErrorCode.RPC_FAIL
        with MasterClient(m.target, timeout=DEADLINE_S, cluster_token="s3cret") as member:
            assert member.exist_key("k") == ErrorCode.OBJECT_NOT_FOUND


def test_an_agents_embedded_registry_has_no_store(agent_process) -> None:  # type: ignore[no-untyped-def]
    agent = agent_process()
    with MasterClient(agent.engine, timeout=DEADLINE_S) as client, \
            pytest.raises(MasterRpcError, match="needs hixl-master") as caught:
        client.exist_key("k")
    assert caught.value.code == ErrorCode.RPC_FAIL


# ---------------------------------------------------------------- flags


@pytest.mark.parametrize("flags", [
    ["-default_kv_lease_ttl=4321", "-client_ttl=7", "-allocation_strategy=free_ratio_first"],
    ["--default_kv_lease_ttl", "4321", "--client_ttl", "7", "--allocation_strategy",
     "free_ratio_first"],
], ids=["gflags-single-dash", "double-dash"])
def test_mooncake_flags_configure_the_store(flags: list[str]) -> None:
    with MasterProcess(extra=["--no-persist", *flags]) as m, \
            MasterClient(m.target, timeout=DEADLINE_S) as client:
        assert client.heartbeat().client_ttl_ms == 7000
        client.mount_segment(seg("a"))
        client.mount_segment(seg("b", length=4 * MiB))
        put(client, ["k"], 100)
        got = client.get_replicas("k")
        assert got.lease_ttl_ms == 4321
        # free_ratio_first: the segment with the larger free ratio first, every time
        put(client, ["half-of-a"], MiB // 2, ReplicaConfig(preferred_segments=("a",)))
        for i in range(5):
            assert put(client, [f"j{i}"], 64 * 1024)[f"j{i}"][0][0] == "b"


def test_store_flags_parse() -> None:
    config = parse_config(["--port", "6000", "-allocation_strategy=free_ratio_first",
                           "--data-dir", "/var/lib/hixl", "-put_start_discard_timeout_sec=5",
                           "--put_start_release_timeout_sec", "50", "--remount-grace-s", "9",
                           "-default_kv_soft_pin_ttl=1000"])
    assert config == MasterConfig(port=6000, store=StoreConfig(
        allocation_strategy="free_ratio_first", data_dir="/var/lib/hixl",
        put_start_discard_timeout_s=5, put_start_release_timeout_s=50, remount_grace_s=9,
        default_kv_soft_pin_ttl_ms=1000))
    assert parse_config(["--no-persist"]).store.persist is False
    options = config.store.options()
    assert (options.allocation_strategy, options.put_start_release_timeout_s) == (
        "free_ratio_first", 50)
    assert default_data_dir(6000, {"XDG_STATE_HOME": "/state"}) == "/state/hixl/master-6000"
    assert default_data_dir(0, {"XDG_STATE_HOME": "/state"}) is None


@pytest.mark.parametrize(("flags", "named"), [
    (["--allocation_strategy", "fastest"], "allocation_strategy"),
    (["-put_start_discard_timeout_sec=0"], "put_start_discard_timeout_sec"),
    (["--remount-grace-s", "-1"], "--remount-grace-s"),
])
def test_bad_store_flags_exit_naming_the_flag(flags: list[str], named: str) -> None:
    result = subprocess.run([sys.executable, "-m", "hixl.server.master.master", *flags],
                            capture_output=True, text=True, timeout=DEADLINE_S)
    assert result.returncode == 2 and named in result.stderr


def test_release_timeout_shorter_than_discard_is_refused(tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "hixl.server.master.master", "--port", "0",
                             "--no-persist", "--put_start_discard_timeout_sec", "60",
                             "--put_start_release_timeout_sec", "30"],
                            capture_output=True, text=True, timeout=DEADLINE_S)
    assert result.returncode != 0 and "put_start_release_timeout_s" in result.stderr


def test_an_unreachable_backend_is_logged_once_not_per_upkeep_pass(caplog) -> None:  # type: ignore[no-untyped-def]
    """Upkeep runs ten times a second; while etcd has no quorum every pass fails. That is
    one warning (again every repeat_s while it lasts) and one line when it ends; a bug
    keeps its traceback every time."""
    from hixl.errors import PeerUnavailable
    from hixl.server.master.store_service import UpkeepFailures

    now = [100.0]
    failures = UpkeepFailures(repeat_s=30.0, clock=lambda: now[0])
    outage = PeerUnavailable("etcd at 127.0.0.1:1: no member reachable within 2 s")
    with caplog.at_level("INFO", logger="hixl.store"):
        for _ in range(50):                      # five seconds of failed passes
            failures.failed(outage)
            now[0] += 0.1
        assert [r.levelname for r in caplog.records] == ["WARNING"]
        assert "no member reachable" in caplog.records[0].getMessage()
        now[0] += 30.0                           # still failing half a minute later
        failures.failed(outage)
        assert [r.levelname for r in caplog.records] == ["WARNING", "WARNING"]
        assert "51 pass(es) failed so far" in caplog.records[1].getMessage()
        failures.passed()
        failures.passed()                        # said once
        assert [r.levelname for r in caplog.records][2:] == ["INFO"]
        assert "works again after 51 failed pass(es)" in caplog.records[2].getMessage()
        caplog.clear()
        for _ in range(2):
            failures.failed(KeyError("a bug"))   # not expected: a traceback each time
        assert [(r.levelname, bool(r.exc_info)) for r in caplog.records] == [("ERROR", True)] * 2
        assert failures.failing == 0
