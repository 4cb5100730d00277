"""The registry on etcd (server/master/etcd_registry.py): leases are etcd leases, the table is
a mirror fed by an etcd watch.

Real parts only: a 3-member etcd cluster on loopback (tests/etcd_cluster.py), real
EtcdRegistry objects on real etcd clients; two registries on one prefix stand for the
leader that writes and another master that follows (the mirror). Waits have generous
deadlines that only prove "does not hang"; nothing asserts a speed.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from functools import partial

import pytest
import waiting
from etcd_cluster import EtcdCluster
from test_registry import seg

from hixl.errors import (
    NotConnected,
    ParamInvalid,
    PermissionDenied,
    ResourceExhausted,
    StaleEpoch,
)
from hixl.etcd import UNAVAILABLE_ERRORS, Compare, EtcdClient, WatchEvent
from hixl.registry_client import EngineEndpoints, owner_verifier
from hixl.server.master.etcd_registry import (
    ENGINE_DIR,
    EtcdRegistry,
    engine_key,
    lease_seconds,
    owner_key_of,
)
from hixl.server.registry import EventKind, RegistryEvent, Subscription
from hixl.v1 import agent_pb2

WAIT_S = 15.0
wait_for = partial(waiting.wait_until, timeout=WAIT_S)
TTL_MS = 10_000  # long enough that no lease ends by itself in a test that does not wait


class Registries:
    """attach(prefix=<this test's>, **kw) -> an EtcdRegistry on its own etcd client;
    everything closed after the test."""

    def __init__(self, cluster: EtcdCluster) -> None:
        self.cluster = cluster
        self.prefix = f"/hixl/reg-{uuid.uuid4().hex[:8]}/"
        self.opened: list[EtcdRegistry | EtcdClient] = []

    def client(self, prefix: str | None = None, **config: object) -> EtcdClient:
        client = EtcdClient({"endpoints": self.cluster.endpoints,
                             "prefix": prefix or self.prefix, **config})
        self.opened.append(client)
        return client

    def attach(self, prefix: str | None = None, *,
               fence: Callable[[], list[Compare]] = list, **config: object) -> EtcdRegistry:
        registry = EtcdRegistry()
        registry.attach(self.client(prefix, **config), fence=fence)
        self.opened.append(registry)
        return registry


@pytest.fixture
def registries(cluster: EtcdCluster) -> Iterator[Registries]:
    made = Registries(cluster)
    yield made
    for thing in reversed(made.opened):
        thing.close()


def events(subscription: Subscription, count: int) -> list[RegistryEvent]:
    return [subscription.get(WAIT_S) for _ in range(count)]


def test_publish_is_an_etcd_key_under_an_etcd_lease_seen_by_every_mirror(
        registries: Registries) -> None:
    leader, other = registries.attach(), registries.attach()
    watcher = other.subscribe(engines=True)
    assert watcher.get(WAIT_S).kind == EventKind.SNAPSHOT
    endpoints = EngineEndpoints(data_tcp="10.0.0.1:7000")
    table = [seg("e1", 1, 0x10000, epoch=4), seg("e1", 2, 0x20000, epoch=4)]

    lease = leader.publish("e1", "node-1", 4, table, TTL_MS, endpoints=endpoints)

    # read-your-writes on the master that published
    assert leader.query("e1") == table
    assert leader.find("e1", 0x20000 + 8, 16) == table[1]
    # the key is the published table, held by the lease the agent was given
    raw = registries.client().get(engine_key("e1"))
    assert raw is not None and raw.lease == lease
    # another master's mirror gets the same events a local registry emits
    up, added = events(watcher, 2)
    assert up.kind == EventKind.ENGINE_UP and up.engines[0].endpoints == endpoints
    assert added.kind == EventKind.ADDED and added.segments == tuple(table)
    assert other.query() == table
    assert other.engine_infos("e1")[0].epoch == 4
    # ... and takes keepalives for it: lease ids are etcd's, valid on every master
    assert other.keepalive(lease) == TTL_MS


def test_a_republish_keeps_the_lease_a_restart_replaces_it_an_old_epoch_is_refused(
        registries: Registries) -> None:
    registry = registries.attach()
    etcd = registries.client()
    watcher = registry.subscribe(engines=True)
    watcher.get(WAIT_S)
    first = registry.publish("e1", "n", 1, [seg("e1", 1, 0x1000)], TTL_MS)
    events(watcher, 2)

    same = registry.publish("e1", "n", 1, [seg("e1", 1, 0x1000), seg("e1", 2, 0x9000)],
                            TTL_MS)
    assert same == first
    (added,) = events(watcher, 1)
    assert added.kind == EventKind.ADDED and [s.segment_id for s in added.segments] == [2]

    restarted = registry.publish("e1", "n", 2, [seg("e1", 7, 0x1000, epoch=2)], TTL_MS)
    assert restarted != first
    assert etcd.refresh(first) == 0  # the replaced agent's lease is revoked
    assert [e.kind for e in events(watcher, 3)] == [EventKind.REMOVED, EventKind.ENGINE_UP,
                                                     EventKind.ADDED]
    with pytest.raises(NotConnected, match="expired or unknown"):
        registry.keepalive(first)

    with pytest.raises(StaleEpoch, match="epoch 1 is older than the epoch 2"):
        registry.publish("e1", "n", 1, [seg("e1", 1, 0x1000)], TTL_MS)
    assert [s.segment_id for s in registry.query("e1")] == [7]
    assert registries.client().get(engine_key("e1")).lease == restarted  # type: ignore[union-attr]


def test_etcd_ends_a_lease_nobody_renews_and_every_watcher_hears_it(
        registries: Registries) -> None:
    leader, other = registries.attach(), registries.attach()
    watcher = other.subscribe(engines=True)
    watcher.get(WAIT_S)
    kept = leader.publish("kept", "n", 1, [seg("kept", 1, 0x1000)], 1000)
    leader.publish("dies", "n", 1, [seg("dies", 1, 0x1000)], 1000)
    events(watcher, 4)

    deadline = time.monotonic() + 4 * lease_seconds(1000) + WAIT_S
    gone: list[RegistryEvent] = []
    while len(gone) < 2:  # renew "kept" at a third of its TTL until "dies" is gone
        assert time.monotonic() < deadline, "the unrenewed lease never ended"
        leader.keepalive(kept)
        try:
            gone.append(watcher.get(0.3))
        except Exception as exc:  # noqa: BLE001 - TransferTimeout: nothing yet
            assert "no registry event" in str(exc)
    assert [(e.kind, (e.segments or e.engines)[0].engine) for e in gone] == [
        (EventKind.REMOVED, "dies"), (EventKind.ENGINE_DOWN, "dies")]
    assert set(other.engines()) == set(leader.engines()) == {"kept"}
    assert leader.counters["expiries"] == 1


def test_unpublish_revokes_the_lease_and_is_gone_when_it_returns(
        registries: Registries) -> None:
    registry = registries.attach()
    lease = registry.publish("e1", "n", 1, [seg("e1", 1, 0x1000)], TTL_MS)
    registry.unpublish(lease)
    assert registry.engines() == {}
    assert registries.client().get(engine_key("e1")) is None
    assert registry.counters["unpublishes"] == 1 and registry.counters["expiries"] == 0
    with pytest.raises(NotConnected, match=f"lease {lease} expired or unknown"):
        registry.unpublish(lease)


def test_keepalive_refreshes_only_registry_leases(registries: Registries) -> None:
    registry = registries.attach()
    etcd = registries.client()
    foreign = etcd.grant(30, keepalive=False)  # e.g. a master's election lease
    with pytest.raises(NotConnected, match="expired or unknown"):
        registry.keepalive(foreign.id)
    with pytest.raises(NotConnected, match="expired or unknown"):
        registry.unpublish(foreign.id)
    assert etcd.refresh(foreign) > 0  # untouched, still there


def test_clusters_on_other_prefixes_do_not_see_each_other(registries: Registries) -> None:
    ours = registries.attach()
    theirs = registries.attach(prefix=f"/hixl/other-{uuid.uuid4().hex[:8]}/")
    ours.publish("same-name", "n", 1, [seg("same-name", 1, 0x1000)], TTL_MS)
    theirs.publish("same-name", "n", 5, [seg("same-name", 1, 0x8000, epoch=5)], TTL_MS)
    assert ours.engines() == {"same-name": 1}
    assert theirs.engines() == {"same-name": 5}
    # a third registry on our prefix loads ours only
    assert registries.attach().query() == ours.query()


def test_a_mirror_reloads_after_etcd_compacted_what_its_watch_missed(
        registries: Registries) -> None:
    leader, other = registries.attach(), registries.attach()
    stays = leader.publish("stays", "n", 1, [seg("stays", 1, 0x1000)], TTL_MS)
    goes = leader.publish("goes", "n", 1, [seg("goes", 1, 0x1000)], TTL_MS)
    wait_for(lambda: set(other.engines()) == {"stays", "goes"}, "the mirror follows")
    watcher = other.subscribe(engines=True)
    watcher.get(WAIT_S)
    etcd = registries.client()
    missed_from = etcd.revision() + 1
    assert other._watch is not None
    other._watch.cancel()  # the mirror's watch is away ...
    leader.unpublish(goes)
    leader.publish("new", "n", 1, [seg("new", 1, 0x1000)], TTL_MS)
    leader.publish("stays", "n", 1, [seg("stays", 1, 0x1000), seg("stays", 2, 0x5000)],
                   TTL_MS)
    etcd.compact(etcd.revision())  # ... and etcd forgets what it missed
    # resuming where it left off, etcd answers "compacted": the mirror reloads
    other._watch = etcd.watch_prefix(ENGINE_DIR, other._on_change, start_revision=missed_from)
    wait_for(lambda: other.query() == leader.query(), "the mirror catches up")
    seen = {(e.kind, s.engine, s.segment_id) for e in events(watcher, 5) for s in e.segments}
    assert seen == {(EventKind.REMOVED, "goes", 1), (EventKind.ADDED, "new", 1),
                    (EventKind.ADDED, "stays", 2)}
    assert other.keepalive(stays) == TTL_MS
    # and it follows etcd again afterwards
    leader.publish("later", "n", 1, [seg("later", 1, 0x1000)], TTL_MS)
    wait_for(lambda: "later" in other.engines(), "the reloaded mirror follows new changes")


def test_a_fenced_master_cannot_publish(registries: Registries) -> None:
    fence_key = "test/fence"
    registries.client().put(fence_key, b"me")
    registry = registries.attach(fence=lambda: [Compare.value_is(fence_key, b"me")])
    registry.publish("e1", "n", 1, [seg("e1", 1, 0x1000)], TTL_MS)
    registries.client().put(fence_key, b"someone else")  # the leadership moved
    with pytest.raises(NotConnected, match="no longer the leader"):
        registry.publish("e2", "n", 1, [seg("e2", 1, 0x1000)], TTL_MS)
    assert "e2" not in registry.engines()
    assert registries.client().get(engine_key("e2")) is None


def test_a_lease_shorter_than_the_switch_time_is_warned_of_once(
        registries: Registries, caplog: pytest.LogCaptureFixture) -> None:
    registry = EtcdRegistry(switch_s=5)
    registry.attach(registries.client())
    registries.opened.append(registry)
    with caplog.at_level(logging.WARNING, logger="hixl.registry"):
        registry.publish("short", "n", 1, [seg("short", 1, 0x1000)], 2000)
        registry.publish("short", "n", 1, [seg("short", 1, 0x1000)], 2000)
        registry.publish("long", "n", 1, [seg("long", 1, 0x1000)], TTL_MS)
    warned = [r.getMessage() for r in caplog.records if "switch time" in r.getMessage()]
    assert len(warned) == 1 and "'short'" in warned[0] and "lease_ttl_ms of 10000" in warned[0]


def test_bad_input_is_refused_before_etcd_is_touched(registries: Registries) -> None:
    registry = registries.attach()
    with pytest.raises(ParamInvalid, match="ttl_ms must be in"):
        registry.publish("e1", "n", 1, [seg("e1", 1, 0x1000)], 0)
    with pytest.raises(ParamInvalid, match="overlap"):
        registry.publish("e1", "n", 1, [seg("e1", 1, 0x1000), seg("e1", 2, 0x1800)], TTL_MS)
    huge = [seg("big", i, (i + 1) << 20) for i in range(60_000)]
    with pytest.raises(ResourceExhausted, match="over the .* one etcd transaction carries"):
        registry.publish("big", "n", 1, huge, TTL_MS)
    assert registries.client().get_prefix(ENGINE_DIR).items == ()
    unattached = EtcdRegistry()
    with pytest.raises(NotConnected, match="not served from etcd"):
        unattached.publish("e1", "n", 1, [seg("e1", 1, 0x1000)], TTL_MS)


def test_one_member_down_serves_two_down_fail_clearly_and_recover(
        registries: Registries, cluster: EtcdCluster) -> None:
    registry = registries.attach(timeout=2.0)
    lease = registry.publish("e1", "n", 1, [seg("e1", 1, 0x1000)], TTL_MS)
    cluster.kill(0)
    assert registry.keepalive(lease) == TTL_MS
    registry.publish("e2", "n", 1, [seg("e2", 1, 0x1000)], TTL_MS)
    cluster.kill(1)
    with pytest.raises(UNAVAILABLE_ERRORS):
        registry.publish("e3", "n", 1, [seg("e3", 1, 0x1000)], TTL_MS)
    with pytest.raises(UNAVAILABLE_ERRORS):
        registry.keepalive(lease)
    assert set(registry.engines()) == {"e1", "e2"}  # what was committed is still served
    cluster.restart(0)
    cluster.restart(1)
    wait_for(lambda: _publishes(registry, "e3"), "publishing works again")
    assert registry.keepalive(lease) == TTL_MS
    assert set(registry.engines()) == {"e1", "e2", "e3"}


def _publishes(registry: EtcdRegistry, engine: str) -> bool:
    try:
        registry.publish(engine, "n", 1, [seg(engine, 1, 0x1000)], TTL_MS)
    except UNAVAILABLE_ERRORS:
        return False
    return True


def test_bench_registry_runs_its_master_on_etcd(cluster: EtcdCluster) -> None:
    """`hixl bench-registry --etcd-endpoints` end to end with tiny numbers; no timing is
    judged. Its agents unpublish at the end, so their keys are gone from the prefix."""
    prefix = f"/hixl/bench-{uuid.uuid4().hex[:8]}/"
    etcd = EtcdClient({"endpoints": cluster.endpoints, "prefix": prefix})
    before = etcd.revision()
    proc = subprocess.run(
        [sys.executable, "-m", "hixl.tools.cli", "bench-registry", "--publishers", "3",
         "--segments", "30", "--watchers", "2", "--changes", "4", "--small-segments", "6",
         "--finds", "200", "--timeout", "60", "--etcd-endpoints", ",".join(cluster.endpoints),
         "--etcd-prefix", prefix, "--json", "-"],
        capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert "private master, registry on etcd" in proc.stderr  # the table
    assert report["config"]["etcd_prefix"] == prefix
    assert report["propagation_from_call_ms"]["samples"] == 4
    assert report["snapshot"]["segments"] == 30 + 4
    with etcd, etcd.watch_prefix(ENGINE_DIR, start_revision=before + 1) as history:
        assert etcd.get_prefix(ENGINE_DIR).items == ()
        # the registry's history on etcd: each simulated agent's key put, then deleted
        changes: dict[str, list[str]] = {}
        while (event := history.get(1.0)) is not None:
            assert isinstance(event, WatchEvent)
            changes.setdefault(event.key, []).append(event.kind)
    assert len(changes) == 3
    for kinds in changes.values():
        assert kinds[0] == "PUT" and kinds[-1] == "DELETE" and kinds.count("DELETE") == 1


def test_bench_registry_refuses_contradictory_settings() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hixl.tools.cli", "bench-registry", "--master",
         "127.0.0.1:1", "--etcd-endpoints", "127.0.0.1:2"],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "give one" in proc.stderr


# ---------------------------------------------------------------- ownership (issue 15)

KEY_A, KEY_B = b"a" * 32, b"b" * 32


def test_every_master_binds_a_name_to_its_owner_key_through_etcd(
        registries: Registries) -> None:
    leader, other = registries.attach(), registries.attach()
    lease = leader.publish("e", "n", 5, [seg("e", 1, 0x1000, epoch=5)], TTL_MS,
                           owner_key=KEY_A)
    wait_for(lambda: other.engines() == {"e": 5}, "the other master's mirror")
    # etcd holds the key's verifier, never the key
    stored = agent_pb2.PublishRequest.FromString(registries.client().get(engine_key("e")).value)
    assert stored.owner_key == b"" and stored.owner_verifier == owner_verifier(KEY_A)
    assert registries.client().get(owner_key_of("e")).value == owner_verifier(KEY_A)
    for registry in (leader, other):  # a failover changes nothing
        for key in (KEY_B, None):
            with pytest.raises(PermissionDenied, match="owner"):
                registry.publish("e", "evil", 2**32 - 1,
                                 [seg("e", 1, 0x9000, epoch=2**32 - 1)], TTL_MS, owner_key=key)
            with pytest.raises(PermissionDenied, match="owner key"):
                registry.keepalive(lease, owner_key=key)
            with pytest.raises(PermissionDenied, match="owner key"):
                registry.unpublish(lease, owner_key=key)
    assert other.keepalive(lease, owner_key=KEY_A) == TTL_MS
    restarted = other.publish("e", "n", 6, [], TTL_MS, owner_key=KEY_A)
    wait_for(lambda: leader.engines() == {"e": 6}, "the restart on the leader's mirror")
    leader.unpublish(restarted, owner_key=KEY_A)
    wait_for(lambda: other.engines() == {}, "the unpublish on the other mirror")
    # the name outlives its lease: a master that starts now still refuses it to others
    late = registries.attach()
    with pytest.raises(PermissionDenied, match="registry/owner/e"):
        late.publish("e", "evil", 7, [], TTL_MS, owner_key=KEY_B)
    assert late.publish("e", "n", 1, [], TTL_MS, owner_key=KEY_A)  # the owner: any epoch


def test_an_operator_releases_an_ended_name_on_etcd(registries: Registries) -> None:
    leader, other = registries.attach(), registries.attach()
    lease = leader.publish("e", "n", 1, [], TTL_MS, owner_key=KEY_A)
    with pytest.raises(ParamInvalid, match="live lease"):
        other.release_owner("e")
    with pytest.raises(PermissionDenied):  # other caches who owns "e"
        other.publish("e", "n", 2, [], TTL_MS, owner_key=KEY_B)
    leader.unpublish(lease, owner_key=KEY_A)
    wait_for(lambda: other.engines() == {}, "the unpublish on the other mirror")
    assert leader.release_owner("e")
    assert registries.client().get(owner_key_of("e")) is None
    # the other master's cached owner is stale: it reads etcd again before refusing
    other.publish("e", "n", 2, [], TTL_MS, owner_key=KEY_B)
    with pytest.raises(PermissionDenied):
        leader.publish("e", "n", 3, [], TTL_MS, owner_key=KEY_A)


def test_unowned_publishes_on_etcd_work_as_before(registries: Registries) -> None:
    registry = registries.attach()
    lease = registry.publish("old", "n", 1, [], TTL_MS)
    assert registry.keepalive(lease) == TTL_MS
    assert registries.client().get(owner_key_of("old")) is None
    registry.publish("old", "n", 2, [], TTL_MS, owner_key=KEY_A)  # a key claims it
    with pytest.raises(PermissionDenied, match="carries no owner key"):
        registry.publish("old", "n", 3, [], TTL_MS)
