"""hixl.etcd against a real 3-member etcd cluster on loopback (tests/etcd_cluster.py).

Key-value calls, atomic commits, prefix isolation between clusters, leases, watches,
elections, and fail-over: one member killed (calls go on), two killed (calls fail with a
typed error naming the endpoints, then succeed again on the same client once the members
are back). Members killed by a test are restarted after it (`cluster` stays whole).
Deadlines here only bound waits; nothing asserts how long anything took.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import grpc
import pytest
import waiting
from etcd_cluster import EtcdCluster, start_cluster_or_skip

from hixl.errors import (
    AuthenticationFailed,
    ConfigError,
    NotConnected,
    ParamInvalid,
    PeerUnavailable,
    TransferTimeout,
)
from hixl.etcd import (
    Compare,
    Delete,
    EtcdClient,
    EtcdConfig,
    Get,
    Leader,
    Lease,
    Put,
    WatchCompacted,
    WatchEvent,
)

WAIT_S = 15.0  # the most any wait for an expected event may take (not a speed claim)


@pytest.fixture
def connect(cluster: EtcdCluster) -> Iterator[Callable[..., EtcdClient]]:
    """connect(prefix=<unique per test>, **config) -> a client closed after the test."""
    clients: list[EtcdClient] = []
    unique = f"/hixl/test-{uuid.uuid4().hex[:8]}/"

    def make(prefix: str = unique, **config: object) -> EtcdClient:
        client = EtcdClient({"endpoints": cluster.endpoints, "prefix": prefix, **config})
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


wait_for = partial(waiting.wait_until, timeout=WAIT_S)


def drain(watch, count: int) -> list[WatchEvent | WatchCompacted]:  # type: ignore[no-untyped-def]
    events = []
    for _ in range(count):
        event = watch.get(WAIT_S)
        assert event is not None, f"watch delivered {len(events)} of {count} events: {events}"
        events.append(event)
    return events


# ------------------------------------------------------------------ key-value basics


def test_put_get_delete_and_prefix_reads(connect: Callable[..., EtcdClient]) -> None:
    etcd = connect()
    binary = bytes(range(256)) * 3
    first = etcd.put("obj/a", binary)
    second = etcd.put("obj/b", "text ✓")
    assert second > first
    got = etcd.get("obj/a")
    assert got is not None and got.value == binary and got.key == "obj/a"
    assert got.create_revision == got.mod_revision == first and got.version == 1
    assert etcd.get("obj/b").value == "text ✓".encode()  # type: ignore[union-attr]
    assert etcd.get("obj/missing") is None
    etcd.put("objx", b"not under obj/")
    etcd.put("obj/a", b"v2")
    assert etcd.get("obj/a").version == 2  # type: ignore[union-attr]

    snapshot = etcd.get_prefix("obj/")
    assert snapshot.as_dict() == {"obj/a": b"v2", "obj/b": "text ✓".encode()}
    assert snapshot.revision >= etcd.get("obj/a").mod_revision  # type: ignore[union-attr]
    assert [kv.key for kv in etcd.get_prefix().items] == ["obj/a", "obj/b", "objx"]

    assert etcd.delete("obj/a") is True
    assert etcd.delete("obj/a") is False
    assert etcd.get("obj/a") is None
    assert etcd.delete_prefix("obj") == 2
    assert etcd.get_prefix().items == ()
    assert etcd.revision() >= snapshot.revision


def test_get_prefix_reads_many_keys_in_pages_at_one_revision(
        connect: Callable[..., EtcdClient]) -> None:
    etcd = connect()
    expected = {f"k/{i:05d}": f"value {i}".encode() for i in range(2300)}
    items = list(expected.items())
    for start in range(0, len(items), 100):  # etcd allows 128 ops per txn by default
        assert etcd.commit(dict(items[start:start + 100])).succeeded
    snapshot = etcd.get_prefix("k/")
    assert snapshot.as_dict() == expected
    assert [kv.key for kv in snapshot.items] == sorted(expected)


def test_a_commit_whose_compare_fails_writes_nothing(
        connect: Callable[..., EtcdClient]) -> None:
    etcd = connect()
    etcd.put("a", b"1")
    etcd.put("c", b"old")
    read = etcd.get("a")
    assert read is not None
    etcd.put("a", b"changed by someone else")
    before = etcd.get_prefix()

    stale = etcd.commit({"a": b"2", "b": b"2"}, ["c"], expect={"a": read.mod_revision})
    assert stale.succeeded is False
    assert etcd.get_prefix().items == before.items  # nothing half-applied

    fresh = etcd.get("a")
    assert fresh is not None
    done = etcd.commit({"a": b"3", "b": b"3"}, ["c"], expect={"a": fresh.mod_revision,
                                                               "b": 0})
    assert done.succeeded
    after = etcd.get_prefix()
    assert after.as_dict() == {"a": b"3", "b": b"3"}
    assert {kv.mod_revision for kv in after.items} == {done.revision}  # one revision

    # expect 0 means "must not exist": b exists now
    assert not etcd.commit({"b": b"4"}, expect={"b": 0}).succeeded
    assert etcd.get("b").value == b"3"  # type: ignore[union-attr]
    with pytest.raises(ParamInvalid, match="both put and deleted"):
        etcd.commit({"a": b"x"}, ["a"])


def test_txn_runs_one_branch_and_returns_its_reads(connect: Callable[..., EtcdClient]) -> None:
    etcd = connect()
    etcd.put("lock", b"held")
    result = etcd.txn([Compare.absent("lock")], [Put("lock", b"mine")],
                      [Get("lock"), Get("q/", prefix=True)])
    assert not result.succeeded
    assert [kv.value for kv in result.gets[0]] == [b"held"] and result.gets[1] == ()
    result = etcd.txn([Compare.value_is("lock", b"held")],
                      [Delete("lock"), Put("q/1", b"x"), Put("q/2", b"y")])
    assert result.succeeded
    assert etcd.get_prefix().as_dict() == {"q/1": b"x", "q/2": b"y"}
    assert etcd.txn([Compare("q/", "version", ">", 0, prefix=True)],
                    [Delete("q/", prefix=True)]).succeeded
    assert etcd.get_prefix().items == ()


def test_clusters_with_different_prefixes_never_see_each_other(
        connect: Callable[..., EtcdClient]) -> None:
    base = f"/hixl/iso-{uuid.uuid4().hex[:6]}"
    one = connect(prefix=base)          # normalized to ".../"
    other = connect(prefix=base + "x")  # textually starts with the first prefix
    assert one.prefix == base + "/" and other.prefix == base + "x/"
    watch_one = one.watch_prefix()
    watch_other = other.watch_prefix()

    one.put("seg/1", b"one")
    other.put("seg/1", b"other")
    other.put("only-other", b"x")
    assert one.get_prefix().as_dict() == {"seg/1": b"one"}
    assert other.get_prefix().as_dict() == {"seg/1": b"other", "only-other": b"x"}
    assert one.get("only-other") is None

    assert other.delete_prefix("") == 2
    assert one.get_prefix().as_dict() == {"seg/1": b"one"}
    one.put("last", b"1")
    seen_one = drain(watch_one, 2)
    assert [(e.kind, e.key, e.value) for e in seen_one] == [  # type: ignore[union-attr]
        ("PUT", "seg/1", b"one"), ("PUT", "last", b"1")]
    seen_other = drain(watch_other, 4)
    assert [(e.kind, e.key) for e in seen_other] == [  # type: ignore[union-attr]
        ("PUT", "seg/1"), ("PUT", "only-other"), ("DELETE", "only-other"),
        ("DELETE", "seg/1")] or [(e.kind, e.key) for e in seen_other] == [  # type: ignore
        ("PUT", "seg/1"), ("PUT", "only-other"), ("DELETE", "seg/1"),
        ("DELETE", "only-other")]
    assert watch_one.get(0.3) is None and watch_other.get(0.3) is None


# ------------------------------------------------------------------ leases


def test_a_leased_key_vanishes_when_keepalive_stops_and_stays_while_kept_alive(
        connect: Callable[..., EtcdClient]) -> None:
    etcd = connect()
    kept = etcd.grant(1)
    unkept = etcd.grant(1, keepalive=False)
    etcd.put("kept", b"k", lease=kept)
    etcd.put("unkept", b"u", lease=unkept)
    assert etcd.get("kept").lease == kept.id  # type: ignore[union-attr]

    wait_for(lambda: etcd.get("unkept") is None, "the unkept lease's key expires")
    time.sleep(3 * kept.ttl)  # several TTLs: only keepalives keep it
    assert etcd.get("kept") is not None and not kept.lost

    kept.stop_keepalive()
    wait_for(lambda: etcd.get("kept") is None, "the key expires once keepalives stop")


def test_a_lease_revoked_elsewhere_is_reported_lost(connect: Callable[..., EtcdClient]) -> None:
    holder, other = connect(), connect()
    lost: list[Lease] = []
    lease = holder.grant(2, on_lost=lost.append)
    holder.put("owned", b"x", lease=lease)
    other.put("plain", b"y")
    other.revoke(lease.id)  # another process revokes it
    assert holder.get("owned") is None and holder.get("plain") is not None
    wait_for(lambda: lost == [lease], "on_lost runs for the revoked lease")
    assert lease.lost and "expired or was revoked" in lease.lost_reason
    with pytest.raises(ParamInvalid, match="is lost"):
        holder.put("again", b"x", lease=lease)


# ------------------------------------------------------------------ watches


def test_watch_delivers_puts_and_deletes_in_revision_order(
        connect: Callable[..., EtcdClient]) -> None:
    etcd = connect()
    start = etcd.put("w/0", b"before the watch")
    watch = etcd.watch_prefix("w/")
    etcd.put("w/1", b"one")
    etcd.put("elsewhere", b"not watched")
    etcd.commit({"w/2": b"two", "w/3": b"three"}, ["w/0"])
    etcd.delete("w/1")
    events = drain(watch, 5)
    assert all(isinstance(e, WatchEvent) for e in events)
    assert [(e.kind, e.key, e.value) for e in events] == [  # type: ignore[union-attr]
        ("PUT", "w/1", b"one"), ("PUT", "w/2", b"two"), ("PUT", "w/3", b"three"),
        ("DELETE", "w/0", b""), ("DELETE", "w/1", b"")]
    revisions = [e.revision for e in events]  # type: ignore[union-attr]
    assert revisions == sorted(revisions) and revisions[1] == revisions[2] == revisions[3]
    assert watch.get(0.3) is None
    watch.cancel()
    assert watch.done

    replay = etcd.watch_prefix("w/", start_revision=start)  # history from a revision on
    assert [(e.kind, e.key) for e in drain(replay, 6)] == [  # type: ignore[union-attr]
        ("PUT", "w/0"), ("PUT", "w/1"), ("PUT", "w/2"), ("PUT", "w/3"), ("DELETE", "w/0"),
        ("DELETE", "w/1")]


def test_watch_resumes_on_another_member_when_its_member_is_killed(
        cluster: EtcdCluster, connect: Callable[..., EtcdClient]) -> None:
    watcher, writer = connect(), connect()
    seen: list[WatchEvent | WatchCompacted] = []
    watch = watcher.watch_prefix("", seen.append)
    writer.put("k/00", b"0")
    wait_for(lambda: len(seen) == 1, "the first event")
    killed = cluster.index_of(watch.endpoint)
    cluster.kill(killed)
    for i in range(1, 20):
        writer.put(f"k/{i:02d}", str(i).encode())
    wait_for(lambda: len(seen) == 20, "every event after the member died")
    assert [(e.key, e.value) for e in seen] == [  # type: ignore[union-attr]
        (f"k/{i:02d}", str(i).encode()) for i in range(20)]  # in order, none twice
    assert watch.endpoint != cluster.endpoint(killed) and not watch.done


def test_a_watch_from_a_compacted_revision_reports_it(connect: Callable[..., EtcdClient]) -> None:
    etcd = connect()
    old = etcd.put("c/1", b"1")
    now = etcd.put("c/2", b"2")
    etcd.compact(now)
    watch = etcd.watch_prefix("c/", start_revision=old)
    event = watch.get(WAIT_S)
    assert isinstance(event, WatchCompacted) and event.compact_revision >= now
    wait_for(lambda: watch.done, "the compacted watch ends")


# ------------------------------------------------------------------ fail-over


def test_one_member_killed_reads_and_writes_go_on(
        cluster: EtcdCluster, connect: Callable[..., EtcdClient]) -> None:
    etcd = connect()
    etcd.put("before", b"1")
    in_use = etcd.endpoint
    cluster.kill(cluster.index_of(in_use))
    etcd.put("after", b"2")
    assert etcd.endpoint != in_use
    assert etcd.get_prefix().as_dict() == {"before": b"1", "after": b"2"}
    assert etcd.commit({"txn": b"3"}, expect={"txn": 0}).succeeded
    cluster.restart(cluster.index_of(in_use))
    assert etcd.get("txn").value == b"3"  # type: ignore[union-attr]


def test_without_a_quorum_calls_fail_typed_and_recover_on_the_same_client(
        cluster: EtcdCluster, connect: Callable[..., EtcdClient]) -> None:
    etcd = connect(timeout=2)
    etcd.put("k", b"1")
    lost: list[Lease] = []
    lease = etcd.grant(1, on_lost=lost.append)
    first = cluster.index_of(etcd.endpoint)
    second = (first + 1) % cluster.size
    cluster.kill(first)
    cluster.kill(second)
    # one member answers but cannot commit without a quorum
    with pytest.raises(TransferTimeout) as failed:
        etcd.put("k", b"2")
    assert ",".join(cluster.endpoints) in str(failed.value)
    assert "did not complete within 2 s" in str(failed.value)
    with pytest.raises(TransferTimeout):
        etcd.get("k")
    # keepalives cannot be confirmed without a quorum: the holder hears the lease is lost
    wait_for(lambda: lost == [lease], "the lease is reported lost")
    assert "no keepalive confirmed for its TTL" in lease.lost_reason

    cluster.kill((second + 1) % cluster.size)  # none left
    with pytest.raises(PeerUnavailable, match="no member reachable within 1 s"):
        etcd.put("k", b"3", timeout=1)

    cluster.ensure_running()
    assert etcd.put("k", b"4") > 0  # the same client, no re-creation
    assert etcd.get("k").value == b"4"  # type: ignore[union-attr]


# ------------------------------------------------------------------ election


def test_one_leader_and_the_next_takes_over_when_it_goes(
        connect: Callable[..., EtcdClient]) -> None:
    first, second, third = connect(), connect(), connect()
    e1 = first.election("master", ttl=2)
    e2 = second.election("master", ttl=2)
    e3 = third.election("master", ttl=2)
    assert e1.campaign(b"master-1", timeout=WAIT_S)
    assert not e2.campaign(b"master-2", timeout=0.3)
    assert not e3.campaign(b"master-3", timeout=0.3)
    assert e1.is_leader() and not e2.is_leader() and not e3.is_leader()
    assert e2.leader() == e1.leader() and e1.leader().value == b"master-1"  # type: ignore

    changes: list[Leader | None] = []
    observed = threading.Event()

    def on_change(leader: Leader | None) -> None:
        changes.append(leader)
        observed.set()

    observer = e3.observe(on_change)
    fence = e1.fence()
    assert first.commit({"state": b"by 1"}, compare=[fence]).succeeded

    first.close()  # its lease is revoked: leadership passes on at once
    assert e2.wait(WAIT_S)
    assert e2.leader().value == b"master-2"  # type: ignore[union-attr]
    # the old leader's fenced write can no longer land
    assert not second.commit({"state": b"stale write by 1"}, compare=[fence]).succeeded
    assert second.get("state").value == b"by 1"  # type: ignore[union-attr]

    e2.resign()
    assert e3.wait(WAIT_S) and e3.is_leader()
    wait_for(lambda: [c.value for c in changes if c] == [b"master-1", b"master-2",
                                                          b"master-3"],
             "observe reports each leader in turn")
    observer.cancel()


# ------------------------------------------------------------------ config and misuse


@pytest.mark.parametrize(("settings", "problem"), [
    ({}, "etcd_endpoints is required"),
    ({"endpoints": ""}, "at least one etcd member"),
    ({"endpoints": "localhost"}, "'localhost' is not host:port"),
    ({"endpoints": "a:0"}, "port must be 1..65535"),
    ({"endpoints": "a:99999"}, "port must be 1..65535"),
    ({"endpoints": "grpc://a:1"}, "scheme must be http"),
    ({"endpoints": "https://a:1"}, "need etcd_ca_file"),
    ({"endpoints": "::1:2379"}, "IPv6 address goes in brackets"),
    ({"endpoints": 2379}, "must be host:port texts"),
    ({"endpoints": "a:1", "prefix": "hixl/c1"}, "must start with '/'"),
    ({"endpoints": "a:1", "prefix": "/"}, "name the cluster"),
    ({"endpoints": "a:1", "prefix": "/hixl/c 1/"}, "no spaces"),
    ({"endpoints": "a:1", "prefix": "/hixl//c1"}, "empty path parts"),
    ({"endpoints": "a:1", "timeout": 0}, "etcd_timeout: must be more than 0"),
    ({"endpoints": "a:1", "timeout": "soon"}, "etcd_timeout: must be a number"),
    ({"endpoints": "a:1", "timeout": True}, "etcd_timeout: must be a number"),
    ({"endpoints": "a:1", "user": "root"}, "etcd_user and etcd_password go together"),
    ({"endpoints": "a:1", "cert_file": "c.pem"}, "need etcd_ca_file"),
    ({"endpoints": "a:1", "ca_file": "/nonexistent/ca.pem"}, "etcd_ca_file /nonexistent"),
    ({"endpoints": "a:1", "endpoint": "b:2"}, "unknown etcd setting 'endpoint'"),
    ({"endpoints": "a:1", "etcd_endpoints": "b:2"}, "given twice"),
])
def test_bad_settings_are_config_errors_naming_the_key(settings: dict[str, object],
                                                       problem: str) -> None:
    with pytest.raises(ConfigError) as error:
        EtcdConfig.parse(settings)
    assert problem in str(error.value)


def test_settings_are_normalized() -> None:
    config = EtcdConfig.parse({"etcd_endpoints": " http://10.0.0.1:2379/, 10.0.0.2:2379 ,"
                                                 "10.0.0.1:2379,[::1]:2379",
                               "etcd_prefix": "/hixl/c1", "etcd_timeout": "2.5s"})
    assert config.endpoints == ("10.0.0.1:2379", "10.0.0.2:2379", "[::1]:2379")
    assert config.prefix == "/hixl/c1/" and config.timeout == 2.5
    assert EtcdConfig.parse("a:1").endpoints == ("a:1",)
    assert "password" not in repr(EtcdConfig("a:1", user="u", password="secret"))  # type: ignore
    assert "secret" not in repr(EtcdConfig("a:1", user="u", password="secret"))  # type: ignore


def test_misuse_is_refused_and_a_closed_client_says_so(
        connect: Callable[..., EtcdClient]) -> None:
    etcd = connect()
    with pytest.raises(ParamInvalid, match="must not be empty"):
        etcd.put("", b"x")
    with pytest.raises(ParamInvalid, match="must be a str"):
        etcd.get(b"bytes key")  # type: ignore[arg-type]
    with pytest.raises(ParamInvalid, match="ttl must be"):
        etcd.grant(0)
    with pytest.raises(ParamInvalid, match="start_revision"):
        etcd.watch_prefix("", start_revision=0)
    with pytest.raises(ParamInvalid, match="name"):
        etcd.election("a/b")
    etcd.close()
    with pytest.raises(NotConnected, match="closed"):
        etcd.get("k")
    etcd.close()  # idempotent


# ------------------------------------------------------------------ auth and TLS


def test_authentication_user_and_password(tmp_path: Path) -> None:
    single = start_cluster_or_skip(1)
    try:
        from aetcd import rpc

        with grpc.insecure_channel(single.endpoints[0]) as channel:
            auth = rpc.AuthStub(channel)
            auth.RoleAdd(rpc.AuthRoleAddRequest(name="root"), timeout=WAIT_S)
            auth.UserAdd(rpc.AuthUserAddRequest(name="root", password="pw"), timeout=WAIT_S)
            auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"),
                               timeout=WAIT_S)
            auth.AuthEnable(rpc.AuthEnableRequest(), timeout=WAIT_S)
        base = {"endpoints": single.endpoints, "prefix": "/hixl/auth/"}
        with EtcdClient({**base, "user": "root", "password": "pw"}) as good:
            good.put("k", b"v")
            assert good.get("k").value == b"v"  # type: ignore[union-attr]
        with EtcdClient({**base, "user": "root", "password": "wrong"}) as bad, \
                pytest.raises(AuthenticationFailed, match="invalid user ID or password"):
            bad.get("k")
        with EtcdClient(base) as anonymous, \
                pytest.raises(AuthenticationFailed, match="set etcd_user and etcd_password"):
            anonymous.get("k")
    finally:
        single.close()


def test_tls_with_client_certificates(tmp_path: Path) -> None:
    from test_tls import _make_ca, _make_cert

    if os.system("command -v openssl >/dev/null") != 0:
        pytest.skip("the openssl command is needed to make test certificates")
    ca = _make_ca(tmp_path, "ca")
    server = _make_cert(tmp_path, "etcd", ca, "IP:127.0.0.1")
    client = _make_cert(tmp_path, "client", ca, "DNS:client", "clientAuth")
    secure = start_cluster_or_skip(1, tls=(server.cert, server.key, ca[0]))
    try:
        base = {"endpoints": [f"https://{e}" for e in secure.endpoints],
                "prefix": "/hixl/tls/", "ca_file": ca[0], "timeout": 2}
        with EtcdClient({**base, "cert_file": client.cert, "key_file": client.key}) as good:
            good.put("k", b"over tls")
            assert good.get("k").value == b"over tls"  # type: ignore[union-attr]
        # no client certificate: the handshake is refused, so no member is usable
        with EtcdClient(base) as refused, pytest.raises(PeerUnavailable):
            refused.get("k")
    finally:
        secure.close()
