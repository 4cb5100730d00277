"""The store's metadata on etcd (server/master/etcd_metadata.py) beyond the shared contract
(tests/test_metadata.py runs that against etcd too): prefixes as independent stores,
records over etcd's txn cap, a store restarted on its prefix, etcd members killed, the
writer claim and fencing, hixl-master's etcd settings, and a real hixl-master killed
with -9 and restarted on the same prefix.

Real parts only: a 3-member etcd cluster on loopback (tests/etcd_cluster.py), real
ObjectStores, real hixl-master processes and a real Mooncake store client. Members killed
by a test are restarted after it. Deadlines only bound waits; nothing asserts how long
anything took.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import waiting
from etcd_cluster import EtcdCluster
from test_metadata import HISTORY, committed, fold, mount, obj, put, replica, rm, same_content

from hixl.client.mooncake import MooncakeDistributedStore
from hixl.errors import ConfigError, HixlError, NotConnected, ParamInvalid
from hixl.etcd import UNAVAILABLE_ERRORS, EtcdClient, EtcdConfig, Put
from hixl.server.master.etcd_metadata import (
    MAX_TXN_OPS,
    NEXT_REPLICA_KEY,
    WRITER_KEY,
    EtcdMetadataBackend,
    object_key,
)
from hixl.server.master.master import StoreConfig, etcd_settings, open_backend, parse_config
from hixl.server.master.store import ObjectStore, StoreOptions
from hixl.store_codes import ErrorCode
from hixl.store_types import ReplicaConfig, StoreSegment
from hixl.tools.daemons import MasterProcess

MiB = 1 << 20
WAIT_S = 30.0   # the most any wait for an expected event may take (not a speed claim)


class Backends:
    """open(prefix=..., **options) -> a backend on the test cluster, closed after the test."""

    def __init__(self, cluster: EtcdCluster) -> None:
        self.cluster = cluster
        self.prefix = unique_prefix()
        self.opened: list[EtcdMetadataBackend | EtcdClient] = []

    def config(self, prefix: str | None = None, **settings: object) -> dict[str, object]:
        return {"endpoints": self.cluster.endpoints, "prefix": prefix or self.prefix,
                **settings}

    def open(self, prefix: str | None = None, timeout: float = 5.0,
             **options: Any) -> EtcdMetadataBackend:
        backend = EtcdMetadataBackend(self.config(prefix, timeout=timeout), **options)
        self.opened.append(backend)
        return backend

    def client(self, prefix: str | None = None) -> EtcdClient:
        client = EtcdClient(self.config(prefix))
        self.opened.append(client)
        return client

    def store(self, prefix: str | None = None, **options: Any) -> ObjectStore:
        return ObjectStore(StoreOptions(client_ttl_s=1e9, default_kv_lease_ttl_ms=1),
                           backend=self.open(prefix, **options))


def unique_prefix() -> str:
    return f"/hixl/meta-{uuid.uuid4().hex[:8]}/"


@pytest.fixture
def backends(cluster: EtcdCluster) -> Iterator[Backends]:
    made = Backends(cluster)
    yield made
    for thing in made.opened:
        thing.close()


wait_for = partial(waiting.wait_until, timeout=WAIT_S)


def reopened(backends: Backends, backend: EtcdMetadataBackend,
             prefix: str | None = None) -> Any:
    """Close `backend`, open its prefix again and fold what loads."""
    backend.close()
    again = backends.open(prefix)
    return fold(again.load())


def seg(engine: str, epoch: int = 1, length: int = MiB) -> StoreSegment:
    return StoreSegment(engine, 1, epoch, 0x10_0000, length, "node-a")


def put_keys(store: ObjectStore, keys: list[str], size: int = 1000,
             config: ReplicaConfig | None = None) -> list[int]:
    started = store.put_start("writer", [(key, size) for key in keys], config or ReplicaConfig())
    assert [s.code for s in started] == [ErrorCode.OK] * len(keys)
    return store.put_end("writer", [(key, s.put_id) for key, s in zip(keys, started,
                                                                        strict=True)])


# ------------------------------------------------------------------ prefixes and layout


def test_two_prefixes_on_one_etcd_are_independent_stores(backends: Backends) -> None:
    first_prefix, second_prefix = unique_prefix(), unique_prefix()
    first, second = backends.open(first_prefix), backends.open(second_prefix)  # both write
    first.load()
    second.load()
    other = [mount("z", length=4 * MiB), put(obj("only-in-second", 9, replica(1, "z", 0)))]
    for record in HISTORY:
        first.append(record)
    for record in other:
        second.append(record)
    first.wait_durable()
    second.wait_durable()
    with pytest.raises(ConfigError, match=re.escape(first_prefix)):
        backends.open(first_prefix)       # one writer per prefix, whatever other prefixes do
    same_content(reopened(backends, first, first_prefix), committed(HISTORY))
    same_content(reopened(backends, second, second_prefix), committed(other))
    assert [kv.key for kv in backends.client(second_prefix).get_prefix("store/obj/").items] \
        == [object_key("only-in-second")]
    assert object_key("only-in-second") not in backends.client(first_prefix).get_prefix(
        "store/obj/").as_dict()


def test_the_keys_are_the_documented_layout(backends: Backends) -> None:
    backend = backends.open()
    backend.load()
    backend.append(mount("eng/1", length=4 * MiB))
    backend.append(put(obj("ünï key/x", 5, replica(7, "eng/1", 64))))
    backend.wait_durable()
    keys = backends.client().get_prefix("store/").as_dict()
    assert set(keys) == {"store/seg/eng%2F1/1", "store/obj/%C3%BCn%C3%AF%20key/x",
                         NEXT_REPLICA_KEY, WRITER_KEY}
    assert object_key("ünï key/x") == "store/obj/%C3%BCn%C3%AF%20key/x"
    assert keys[NEXT_REPLICA_KEY] == b"8"


def test_a_record_over_the_txn_op_cap_is_split_and_round_trips(
        backends: Backends) -> None:
    client = backends.client()
    with pytest.raises(ParamInvalid, match="too many operations"):   # etcd's own cap
        client.txn([], [Put(f"probe/{i}", b"x") for i in range(MAX_TXN_OPS + 1)])
    backend = backends.open()
    backend.load()
    objects = [obj(f"k{i:04d}", i + 1, replica(i + 1, "a", i * 64)) for i in range(3 * MAX_TXN_OPS)]
    records = [mount("a", length=64 * MiB), put(*objects)]
    for record in records:
        backend.append(record)
    backend.wait_durable()
    backend2_fold = reopened(backends, backend)
    same_content(backend2_fold, committed(records))
    assert backend2_fold.next_replica_id == 3 * MAX_TXN_OPS + 1
    again = backends.opened[-1]
    assert isinstance(again, EtcdMetadataBackend)
    removal = rm(*(f"k{i:04d}" for i in range(0, 3 * MAX_TXN_OPS, 2)))
    again.wait_durable(again.append(removal))
    same_content(reopened(backends, again), committed([*records, removal]))


# ------------------------------------------------------------------ a store on etcd


def test_a_store_on_etcd_survives_a_restart_and_its_keys_come_back_on_remount(
        backends: Backends) -> None:
    store = backends.store()
    assert store.persistent and backends.prefix in store.describe_persistence()
    assert store.mount_segment("c1", seg("a", epoch=7)).code == ErrorCode.OK
    assert store.mount_segment("c2", seg("b", epoch=3)).code == ErrorCode.OK
    keys = [f"k{i}" for i in range(20)]
    assert put_keys(store, keys, config=ReplicaConfig(replica_num=2)) == [ErrorCode.OK] * 20
    kept = {key: store.get_replicas([key])[0].replicas for key in keys}
    assert put_keys(store, ["gone"]) == [ErrorCode.OK]
    assert store.remove(["gone"], force=True) == [ErrorCode.OK]
    [pending] = store.put_start("c1", [("pending", 5000)], ReplicaConfig())
    store.close(snapshot=False)

    store = backends.store()
    assert sorted((m.segment.engine, m.segment.epoch, m.live) for m in store.list_segments()) \
        == [("a", 7, False), ("b", 3, False)]
    assert store.exist_keys(["k1", "gone", "pending"]) == [
        ErrorCode.REPLICA_IS_NOT_READY, ErrorCode.OBJECT_NOT_FOUND, ErrorCode.OBJECT_NOT_FOUND]
    assert store.mount_segment("c1", seg("a", epoch=7)).objects == 20
    # b comes back with a new epoch: its memory was lost, so are its replicas
    assert store.mount_segment("c2", seg("b", epoch=4)).objects == 0
    for key, replicas in kept.items():
        got = store.get_replicas([key])[0]
        assert got.code == ErrorCode.OK, key
        assert [(r.engine, r.epoch, r.addr, r.length) for r in got.replicas] == [
            (r.engine, r.epoch, r.addr, r.length) for r in replicas if r.engine == "a"]
    assert store.put_end("c1", [("pending", pending.put_id)]) == [ErrorCode.OBJECT_NOT_FOUND]
    fresh = store.put_start("c1", [("fresh", 100)], ReplicaConfig())[0]
    assert not {r.replica_id for r in fresh.replicas} & {
        r.replica_id for replicas in kept.values() for r in replicas}
    store.close()


# ------------------------------------------------------------------ etcd members down


def test_one_member_killed_the_store_keeps_committing(cluster: EtcdCluster,
                                                      backends: Backends) -> None:
    store = backends.store()
    backend = backends.opened[-1]
    assert isinstance(backend, EtcdMetadataBackend)
    store.mount_segment("c1", seg("a"))
    assert put_keys(store, ["before"]) == [ErrorCode.OK]
    cluster.kill(cluster.index_of(backend.client.endpoint))
    assert put_keys(store, ["after"]) == [ErrorCode.OK]
    assert store.remove(["before"], force=True) == [ErrorCode.OK]
    store.close(snapshot=False)
    store = backends.store()
    store.mount_segment("c1", seg("a"))
    assert store.exist_keys(["before", "after"]) == [ErrorCode.OBJECT_NOT_FOUND, ErrorCode.OK]
    store.close()


def test_without_a_quorum_a_put_end_fails_typed_and_works_again_on_the_same_store(
        cluster: EtcdCluster, backends: Backends) -> None:
    # a writer lease long enough to outlive the outage: this is about commits, not fencing
    store = backends.store(timeout=2, writer_ttl=60)
    backend = backends.opened[-1]
    assert isinstance(backend, EtcdMetadataBackend)
    store.mount_segment("c1", seg("a"))
    assert put_keys(store, ["k1"]) == [ErrorCode.OK]
    first = cluster.index_of(backend.client.endpoint)
    cluster.kill(first)
    cluster.kill((first + 1) % cluster.size)

    [started] = store.put_start("c1", [("k2", 100)], ReplicaConfig())
    with pytest.raises(UNAVAILABLE_ERRORS) as failed:      # never a success
        store.put_end("c1", [("k2", started.put_id)])
    assert isinstance(failed.value, HixlError) and failed.value.status != 0
    assert ",".join(cluster.endpoints) in str(failed.value)
    assert "not committed" in str(failed.value)
    with pytest.raises(UNAVAILABLE_ERRORS):
        store.remove(["k1"], force=True)
    assert not backend.fenced

    cluster.ensure_running()
    # the changes that failed stayed queued in order; they land once etcd is back
    wait_for(backend.wait_durable, "the queued changes to land", done=lambda _: True,
             retry_on=UNAVAILABLE_ERRORS)
    assert put_keys(store, ["k3"]) == [ErrorCode.OK]      # the same store object
    memory = store.exist_keys(["k1", "k2", "k3"])
    assert memory == [ErrorCode.OBJECT_NOT_FOUND, ErrorCode.OK, ErrorCode.OK]
    store.close(snapshot=False)
    store = backends.store()                               # etcd agrees with the memory
    store.mount_segment("c1", seg("a"))
    assert store.exist_keys(["k1", "k2", "k3"]) == memory
    store.close()


# ------------------------------------------------------------------ the writer claim


def test_a_dead_writers_claim_is_waited_out_and_a_live_one_refused(
        backends: Backends) -> None:
    client = backends.client()
    lease = client.grant(2, keepalive=False)           # a writer that died: no keepalives
    client.put(WRITER_KEY, b'{"host": "gone"}', lease=lease)
    with pytest.raises(ConfigError, match=re.escape(backends.prefix) + ".*in use by another"
                       ".*gone"):
        backends.open()
    backend = backends.open(wait_for_writer_s=WAIT_S)   # once its lease ends, it is ours
    backend.load()
    backend.wait_durable(backend.append(mount("a")))
    with pytest.raises(ConfigError, match="in use by another"):
        backends.open(wait_for_writer_s=0.5)           # a live writer keeps its claim


def test_a_lost_writer_lease_fences_the_store_loudly(
        backends: Backends, caplog: pytest.LogCaptureFixture) -> None:
    store = backends.store()
    backend = backends.opened[-1]
    assert isinstance(backend, EtcdMetadataBackend)
    store.mount_segment("c1", seg("a"))
    assert put_keys(store, ["kept"]) == [ErrorCode.OK]
    writer = backends.client().get(WRITER_KEY)
    assert writer is not None and writer.lease
    [started] = store.put_start("c1", [("refused", 100)], ReplicaConfig())
    with caplog.at_level(logging.ERROR, logger="hixl.store"):
        backends.client().revoke(writer.lease)          # e.g. an operator, or expiry
        # no write needed: the lease keeper hears of it and fences the backend
        wait_for(lambda: "was lost" in backend.fenced, "the keeper reports the lease lost")
    assert "FENCED, this master may no longer write" in caplog.text
    assert f"writer lease {writer.lease:x} was lost" in caplog.text
    with pytest.raises(NotConnected, match="fenced"):
        store.put_end("c1", [("refused", started.put_id)])
    for refused in (lambda: store.remove(["kept"], force=True),
                    lambda: store.mount_segment("c2", seg("b")),
                    lambda: backend.append(rm("kept"))):
        with pytest.raises(NotConnected, match="fenced"):
            refused()
    # the claim is free: a new writer takes it and sees only what was committed
    store2 = backends.store()
    store2.mount_segment("c1", seg("a"))
    assert store2.exist_keys(["kept", "refused"]) == [ErrorCode.OK, ErrorCode.OBJECT_NOT_FOUND]
    store2.close()
    store.close()


def test_a_claim_deleted_under_the_writer_fences_its_next_commit(backends: Backends) -> None:
    backend = backends.open()
    backend.load()
    backend.wait_durable(backend.append(mount("a")))
    backends.client().delete(WRITER_KEY)                # its lease lives on: only the txn knows
    with pytest.raises(NotConnected, match="the writer claim is gone"):
        backend.wait_durable(backend.append(mount("b")))
    with pytest.raises(NotConnected, match="fenced"):
        backend.mark()
    backend.close()
    same_content(fold(backends.open().load()), committed([mount("a")]))


def test_the_fence_hook_stops_writes_once_the_election_is_lost(backends: Backends) -> None:
    client = backends.client()
    election = client.election("master", ttl=30)
    assert election.campaign("me", timeout=WAIT_S)
    fence = election.fence()
    backend = backends.open(fence=lambda: [fence])
    backend.load()
    backend.wait_durable(backend.append(mount("a")))
    backends.client().revoke(client.get(election.key).lease)  # type: ignore[union-attr]
    with pytest.raises(NotConnected, match="fence compare failed"):
        backend.wait_durable(backend.append(mount("b")))   # the txn's compare refuses it
    with pytest.raises(NotConnected, match="fenced"):
        backend.append(mount("c"))
    backend.close()
    same_content(fold(backends.open().load()), committed([mount("a")]))


# ------------------------------------------------------------------ hixl-master settings


def test_the_master_picks_etcd_when_endpoints_are_given(backends: Backends,
                                                        tmp_path: Path) -> None:
    endpoints = ",".join(backends.cluster.endpoints)
    backend = open_backend(StoreConfig(etcd_endpoints=endpoints, etcd_prefix=backends.prefix),
                           6000)
    assert isinstance(backend, EtcdMetadataBackend)
    assert backend.config.prefix == backends.prefix
    backend.close()
    password = tmp_path / "password"
    password.write_text("s3cret\n")
    config = parse_config(["--etcd-endpoints", "a:1, b:2", "--etcd-prefix", "/hixl/x",
                           "--etcd-user", "hixl", "--etcd-password-file", str(password),
                           "--etcd-timeout", "2.5"], env={})
    assert etcd_settings(config.store) == EtcdConfig(
        ("a:1", "b:2"), "/hixl/x/", user="hixl", password="s3cret", timeout=2.5)
    assert etcd_settings(StoreConfig()) is None


@pytest.mark.parametrize(("settings", "named"), [
    ({"data_dir": "/tmp/x"}, "data_dir and etcd_endpoints"),
    ({"persist": False}, "persist is false"),
    ({"etcd_user": "u"}, "etcd_user and etcd_password_file"),
    ({"etcd_user": "u", "etcd_password_file": "/no/such/file"}, "etcd_password_file"),
    ({"etcd_prefix": "nope"}, "etcd_prefix"),
    ({"etcd_endpoints": "a:1,b"}, "etcd_endpoints"),
])
def test_contradictory_or_bad_etcd_settings_are_config_errors(settings: dict[str, Any],
                                                              named: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(named)):
        etcd_settings(StoreConfig(**{"etcd_endpoints": "a:1", **settings}))


def test_the_master_refuses_contradictory_or_unreachable_etcd(tmp_path: Path) -> None:
    run = [sys.executable, "-m", "hixl.server.master.master", "--port", "0"]
    both = subprocess.run([*run, "--etcd-endpoints", "127.0.0.1:1", "--data-dir",
                           str(tmp_path)], capture_output=True, text=True, timeout=WAIT_S)
    assert both.returncode == 2 and "data_dir and etcd_endpoints" in both.stderr
    down = subprocess.run([*run, "--etcd-endpoints", "127.0.0.1:1", "--etcd-timeout", "1"],
                          capture_output=True, text=True, timeout=WAIT_S)
    assert down.returncode == 1
    assert "etcd at 127.0.0.1:1: cannot start" in down.stderr


def pattern(seed: int, size: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def test_kill_9_and_a_new_master_on_the_same_prefix_keeps_every_key(
        cluster: EtcdCluster) -> None:
    """The local-journal restart test, on etcd: the new master waits out the killed one's
    writer lease, then serves every committed key again once the client remounts."""
    flags = ["--etcd-endpoints", ",".join(cluster.endpoints), "--etcd-prefix",
             unique_prefix()]
    master = MasterProcess(extra=flags)
    store = MooncakeDistributedStore(setup_timeout=WAIT_S)
    try:
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", 16 * MiB, 4 * MiB, "tcp", "",
                           master.target) == 0, store.last_error
        values = {f"k{i}": pattern(i, 10_000 * (i + 1)) for i in range(8)}
        for key, value in values.items():
            assert store.put(key, value) == 0, store.last_error
        assert store.remove("k0") == 0
        master.kill()                                     # SIGKILL: the claim stays behind
        restarted = MasterProcess(master.port, extra=flags)
        try:
            wait_for(lambda: store.put("after", b"back") == 0,  # it remounts by itself
                     "a put after the remount", interval=0.1, detail=lambda: store.last_error)
            assert store.get("k0") == b""
            for key, value in list(values.items())[1:]:
                assert store.get(key) == value, key
            assert store.get("after") == b"back"
        finally:
            store.close()
            restarted.close()
    finally:
        store.close()
        master.close()
