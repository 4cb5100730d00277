"""The Registry domain object: leases, epochs, validation, expiry, lookups and watchers.

Time is an injected clock, so expiry is exact and no test sleeps or measures time.
"""

from __future__ import annotations

import asyncio
import random
import threading

import grpc
import pytest

from hixl.errors import (
    NotConnected,
    OutOfRange,
    ParamInvalid,
    PermissionDenied,
    ResourceExhausted,
    StaleEpoch,
    TransferTimeout,
)
from hixl.registry_client import RegistryClient
from hixl.server.registry import (
    SERVER_KEEPALIVE_OPTIONS,
    EventKind,
    Registry,
    RegistryEvent,
    Subscription,
    add_registry_service,
)
from hixl.types import MemType, Perm, SegmentInfo

TTL_MS = 1_000


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def seg(engine: str, segment_id: int, base: int, length: int = 4096, epoch: int = 1,
        name: str = "") -> SegmentInfo:
    return SegmentInfo(segment_id=segment_id, engine=engine, node_id="node-1", base=base,
                       length=length, mem_type=MemType.MEM_HOST, perms=Perm.RW, epoch=epoch,
                       shareable=True, name=name)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def registry(clock: FakeClock) -> Registry:
    return Registry(clock=clock, max_ttl_ms=10_000)


def drain(subscription: Subscription) -> list[RegistryEvent]:
    events = []
    while subscription.pending():
        events.append(subscription.get(timeout=0))
    return events


# ---------------------------------------------------------------- publish / query


def test_publish_then_query_returns_segments_in_engine_and_base_order(registry: Registry) -> None:
    b_segments = [seg("b", 2, 0x9000), seg("b", 1, 0x1000)]
    a_segments = [seg("a", 7, 0x5000, length=100)]
    lease_b = registry.publish("b", "node-1", 1, b_segments, TTL_MS)
    lease_a = registry.publish("a", "node-1", 1, a_segments, TTL_MS)

    assert lease_a != lease_b
    assert registry.query("b") == [seg("b", 1, 0x1000), seg("b", 2, 0x9000)]
    assert registry.query() == [a_segments[0], seg("b", 1, 0x1000), seg("b", 2, 0x9000)]
    assert registry.query("nobody") == []
    assert registry.engines() == {"a": 1, "b": 1}


def test_publish_with_no_segments_holds_a_lease(registry: Registry) -> None:
    lease = registry.publish("a", "node-1", 1, [], TTL_MS)
    assert registry.query("a") == []
    assert registry.engines() == {"a": 1}
    assert registry.keepalive(lease) == TTL_MS


def test_same_epoch_republish_keeps_lease_and_replaces_whole_table(registry: Registry) -> None:
    kept, dropped, added = seg("a", 1, 0x1000), seg("a", 2, 0x2000), seg("a", 3, 0x3000)
    lease = registry.publish("a", "node-1", 1, [kept, dropped], TTL_MS)
    subscription = registry.subscribe()
    drain(subscription)

    assert registry.publish("a", "node-1", 1, [kept, added], TTL_MS) == lease

    assert registry.query("a") == [kept, added]
    assert drain(subscription) == [
        RegistryEvent(EventKind.REMOVED, 1, (dropped,)),
        RegistryEvent(EventKind.ADDED, 1, (added,)),
    ]


def test_unchanged_republish_emits_nothing(registry: Registry) -> None:
    table = [seg("a", 1, 0x1000)]
    registry.publish("a", "node-1", 1, table, TTL_MS)
    subscription = registry.subscribe()
    drain(subscription)
    registry.publish("a", "node-1", 1, table, TTL_MS)
    assert subscription.pending() == 0


def test_newer_epoch_replaces_the_old_lease(registry: Registry) -> None:
    old = seg("a", 1, 0x1000, epoch=1)
    new = seg("a", 1, 0x1000, epoch=2)
    old_lease = registry.publish("a", "node-1", 1, [old], TTL_MS)
    subscription = registry.subscribe()
    drain(subscription)

    new_lease = registry.publish("a", "node-1", 2, [new], TTL_MS)

    assert new_lease != old_lease
    assert registry.query("a") == [new]
    assert registry.engines() == {"a": 2}
    with pytest.raises(NotConnected, match=f"lease {old_lease} expired or unknown; publish again"):
        registry.keepalive(old_lease)
    assert registry.keepalive(new_lease) == TTL_MS
    assert drain(subscription) == [
        RegistryEvent(EventKind.REMOVED, 1, (old,)),
        RegistryEvent(EventKind.ADDED, 2, (new,)),
    ]


def test_older_epoch_is_refused_and_changes_nothing(registry: Registry) -> None:
    current = seg("a", 1, 0x1000, epoch=5)
    lease = registry.publish("a", "node-1", 5, [current], TTL_MS)
    subscription = registry.subscribe()
    drain(subscription)

    with pytest.raises(StaleEpoch, match=r"epoch 4 is older than the epoch 5"):
        registry.publish("a", "node-1", 4, [seg("a", 9, 0x8000, epoch=4)], TTL_MS)

    assert registry.query("a") == [current]
    assert registry.keepalive(lease) == TTL_MS
    assert subscription.pending() == 0


@pytest.mark.parametrize(("engine", "epoch", "segments", "ttl_ms", "problem"), [
    ("", 1, [], TTL_MS, "engine name must be a non-empty string"),
    ("a", 1, [], 0, r"ttl_ms must be in \(0, 10000\], got 0"),
    ("a", 1, [], -5, r"ttl_ms must be in \(0, 10000\], got -5"),
    ("a", 1, [], 10_001, r"ttl_ms must be in \(0, 10000\], got 10001"),
    ("a", -1, [], TTL_MS, "epoch must be an integer"),
    ("a", 1 << 32, [], TTL_MS, "epoch must be an integer"),
    ("a", 1, [seg("b", 1, 0x1000)], TTL_MS, "segment 1 belongs to engine 'b', not the publisher"),
    ("a", 1, [seg("a", 1, 0x1000, epoch=2)], TTL_MS, "segment 1 has epoch 2, the publisher's"),
    ("a", 1, [seg("a", 1, 0x1000), seg("a", 2, 0x1800)], TTL_MS,
     r"segment 2: range \[0x1800, 0x2800\) overlaps the registered range \[0x1000, 0x2000\)"),
    ("a", 1, [seg("a", 1, 0x1000), seg("a", 1, 0x9000)], TTL_MS, "segment id 1 appears twice"),
    ("a", 1, [seg("a", 1, 0x1000, length=0)], TTL_MS, "length must be positive"),
    ("a", 1, [seg("a", 1, (1 << 64) - 16, length=32)], TTL_MS, "overflows"),
    ("a", 1, ["not a segment"], TTL_MS, "expected SegmentInfo, got str"),
])
def test_invalid_publish_is_refused_by_name_and_changes_nothing(
        registry: Registry, engine: str, epoch: int, segments: list[SegmentInfo],
        ttl_ms: int, problem: str) -> None:
    subscription = registry.subscribe()
    drain(subscription)
    with pytest.raises(ParamInvalid, match=problem):
        registry.publish(engine, "node-1", epoch, segments, ttl_ms)
    assert registry.query() == []
    assert registry.engines() == {}
    assert subscription.pending() == 0


def test_invalid_republish_keeps_the_previous_table(registry: Registry) -> None:
    table = [seg("a", 1, 0x1000)]
    registry.publish("a", "node-1", 1, table, TTL_MS)
    with pytest.raises(ParamInvalid, match="overlaps"):
        registry.publish("a", "node-1", 1, [seg("a", 1, 0x1000), seg("a", 2, 0x1fff)], TTL_MS)
    assert registry.query("a") == table


def test_registry_refuses_bad_limits() -> None:
    with pytest.raises(ParamInvalid, match="max_ttl_ms"):
        Registry(max_ttl_ms=0)
    with pytest.raises(ParamInvalid, match="watch_queue_limit"):
        Registry(watch_queue_limit=0)


# ---------------------------------------------------------------- leases


def test_keepalive_extends_the_lease(registry: Registry, clock: FakeClock) -> None:
    lease = registry.publish("a", "node-1", 1, [seg("a", 1, 0x1000)], TTL_MS)
    clock.advance(0.9)
    assert registry.keepalive(lease) == TTL_MS
    clock.advance(0.9)  # 1.8 s after publish, 0.9 s after the keepalive
    assert registry.expire() == []
    assert registry.query("a") == [seg("a", 1, 0x1000)]


def test_lease_expires_exactly_at_its_deadline(registry: Registry, clock: FakeClock) -> None:
    lease = registry.publish("a", "node-1", 1, [seg("a", 1, 0x1000)], TTL_MS)
    registry.publish("b", "node-1", 1, [seg("b", 1, 0x1000)], 5_000)
    subscription = registry.subscribe()
    drain(subscription)

    clock.advance(0.999)
    assert registry.expire() == []
    clock.advance(0.001)
    assert registry.expire() == ["a"]
    assert registry.expire() == []

    assert registry.query() == [seg("b", 1, 0x1000)]
    with pytest.raises(NotConnected, match=f"lease {lease} expired or unknown; publish again"):
        registry.keepalive(lease)
    assert drain(subscription) == [RegistryEvent(EventKind.REMOVED, 1, (seg("a", 1, 0x1000),))]
    clock.advance(3.999)  # 4.999 s after b's publish
    assert registry.expire() == []
    clock.advance(0.001)
    assert registry.expire() == ["b"]
    assert registry.query() == []


def test_lookups_never_show_an_expired_lease_even_before_the_timer(
        registry: Registry, clock: FakeClock) -> None:
    registry.publish("a", "node-1", 1, [seg("a", 1, 0x1000)], TTL_MS)
    clock.advance(2)
    assert registry.query() == []
    with pytest.raises(NotConnected, match="engine 'a' has no published segments"):
        registry.find("a", 0x1000, 1)
    assert registry.expire() == []  # already dropped by the query


def test_expired_engine_may_publish_again_with_any_epoch(
        registry: Registry, clock: FakeClock) -> None:
    registry.publish("a", "node-1", 7, [], TTL_MS)
    clock.advance(1)
    registry.publish("a", "node-1", 3, [seg("a", 1, 0x1000, epoch=3)], TTL_MS)
    assert registry.engines() == {"a": 3}


def test_unpublish_withdraws_now(registry: Registry) -> None:
    table = [seg("a", 1, 0x1000), seg("a", 2, 0x4000)]
    lease = registry.publish("a", "node-1", 1, table, TTL_MS)
    subscription = registry.subscribe()
    drain(subscription)

    registry.unpublish(lease)

    assert registry.query() == []
    assert drain(subscription) == [RegistryEvent(EventKind.REMOVED, 1, tuple(table))]
    with pytest.raises(NotConnected, match=f"lease {lease} expired or unknown"):
        registry.unpublish(lease)
    with pytest.raises(NotConnected, match="lease 12345 expired or unknown"):
        registry.keepalive(12345)


# ---------------------------------------------------------------- find


def test_find_on_100k_segments(registry: Registry) -> None:
    """Every segment is found from its first, a middle and its last byte; gaps are not."""
    rng = random.Random(7)
    segments = []
    base = 0x10_0000
    for segment_id in range(100_000):
        length = rng.randrange(1, 8192)
        segments.append(seg("big", segment_id, base, length=length))
        base += length + rng.randrange(1, 4096)  # always a gap after each segment
    shuffled = segments[:]
    rng.shuffle(shuffled)
    registry.publish("big", "node-1", 1, shuffled, TTL_MS)

    assert registry.query("big") == segments
    for segment in segments:
        assert registry.find("big", segment.base, 1) is segment
        assert registry.find("big", segment.base + segment.length // 2, 1) is segment
        assert registry.find("big", segment.end - 1, 1) is segment
        assert registry.find("big", segment.base, segment.length) is segment
    for segment in rng.sample(segments, 1_000):
        with pytest.raises(OutOfRange, match=f"{segment.end:#x} is not inside"):
            registry.find("big", segment.end, 1)  # first byte of the gap
        with pytest.raises(OutOfRange, match=r"crosses the end of its segment \[.*\) by 1 bytes"):
            registry.find("big", segment.base, segment.length + 1)
    with pytest.raises(OutOfRange, match="not inside any registered segment"):
        registry.find("big", 0, 16)
    with pytest.raises(OutOfRange, match="not inside any registered segment"):
        registry.find("big", segments[-1].end + 1, 1)


def test_find_names_the_engine(registry: Registry) -> None:
    registry.publish("a", "node-1", 1, [seg("a", 1, 0x1000)], TTL_MS)
    with pytest.raises(OutOfRange, match="engine 'a' address 0x5000"):
        registry.find("a", 0x5000, 8)
    with pytest.raises(NotConnected, match="engine 'zz' has no published segments"):
        registry.find("zz", 0x1000, 8)


# ---------------------------------------------------------------- watchers


def test_subscription_gets_snapshot_then_changes(registry: Registry, clock: FakeClock) -> None:
    a1 = seg("a", 1, 0x1000)
    registry.publish("a", "node-1", 1, [a1], TTL_MS)
    b1 = seg("b", 1, 0x1000, epoch=4)

    with registry.subscribe() as subscription:
        assert subscription.get(timeout=0) == RegistryEvent(EventKind.SNAPSHOT, 0, (a1,))
        registry.publish("b", "node-1", 4, [b1], 5_000)
        clock.advance(1)
        registry.expire()
        assert drain(subscription) == [
            RegistryEvent(EventKind.ADDED, 4, (b1,)),
            RegistryEvent(EventKind.REMOVED, 1, (a1,)),
        ]

    # closed: no more events, and reading says why
    registry.publish("c", "node-1", 1, [seg("c", 1, 0x1000)], TTL_MS)
    with pytest.raises(NotConnected, match="subscription is closed"):
        subscription.get(timeout=0)


def test_get_with_nothing_queued_times_out(registry: Registry) -> None:
    subscription = registry.subscribe()
    assert subscription.get(timeout=0).kind is EventKind.SNAPSHOT
    with pytest.raises(TransferTimeout, match="no registry event within"):
        subscription.get(timeout=0.01)


def test_slow_subscriber_is_dropped_without_disturbing_others(clock: FakeClock) -> None:
    registry = Registry(clock=clock, watch_queue_limit=4)
    slow = registry.subscribe()          # never reads
    fast = registry.subscribe()
    received = drain(fast)
    for i in range(10):
        registry.publish(f"e{i}", "node-1", 1, [seg(f"e{i}", 1, 0x1000)], TTL_MS)
        received += drain(fast)

    with pytest.raises(ResourceExhausted, match="fell more than 4 events behind"):
        slow.get(timeout=0)
    with pytest.raises(ResourceExhausted):  # stays failed: it must resubscribe
        slow.get(timeout=0)
    assert [e.kind for e in received] == [EventKind.SNAPSHOT] + [EventKind.ADDED] * 10
    assert [e.segments[0].engine for e in received[1:]] == [f"e{i}" for i in range(10)]

    resync = registry.subscribe()
    assert resync.get(timeout=0) == RegistryEvent(EventKind.SNAPSHOT, 0,
                                                  tuple(registry.query()))


async def test_async_next_wakes_on_a_publish_from_another_thread(registry: Registry) -> None:
    subscription = registry.subscribe()
    assert (await subscription.next()).kind is EventKind.SNAPSHOT
    segment = seg("a", 1, 0x1000)
    waiter = asyncio.ensure_future(subscription.next())
    await asyncio.sleep(0)  # let it park on its future
    publisher = threading.Thread(
        target=registry.publish, args=("a", "node-1", 1, [segment], TTL_MS))
    publisher.start()
    event = await asyncio.wait_for(waiter, timeout=10)
    publisher.join(timeout=10)
    assert event == RegistryEvent(EventKind.ADDED, 1, (segment,))


async def test_async_next_raises_when_closed_while_waiting(registry: Registry) -> None:
    subscription = registry.subscribe()
    await subscription.next()
    waiter = asyncio.ensure_future(subscription.next())
    await asyncio.sleep(0)
    subscription.close()
    with pytest.raises(NotConnected, match="subscription is closed"):
        await asyncio.wait_for(waiter, timeout=10)


async def test_cancelled_async_next_leaves_no_waiter(registry: Registry) -> None:
    subscription = registry.subscribe()
    await subscription.next()
    waiter = asyncio.ensure_future(subscription.next())
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    registry.publish("a", "node-1", 1, [seg("a", 1, 0x1000)], TTL_MS)
    assert (await asyncio.wait_for(subscription.next(), timeout=10)).kind is EventKind.ADDED


async def test_slow_grpc_watcher_is_ended_with_resource_exhausted() -> None:
    """Through the real gRPC service: the dropped watcher gets a typed error, not silence."""
    registry = Registry(watch_queue_limit=4)
    server = grpc.aio.server(options=SERVER_KEEPALIVE_OPTIONS)
    add_registry_service(server, registry, expire_every_s=None)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = RegistryClient(f"127.0.0.1:{port}", timeout=10)
    try:
        events = client.watch()
        first = await asyncio.wait_for(asyncio.to_thread(next, events), timeout=10)
        assert first == ("SNAPSHOT", 0, [])
        # No await in between: the servicer cannot drain, so the queue overflows.
        for i in range(6):
            registry.publish(f"e{i}", "node-1", 1, [seg(f"e{i}", 1, 0x1000)], TTL_MS)
        with pytest.raises(ResourceExhausted, match="watch of registry .* fell more than 4"):
            await asyncio.wait_for(asyncio.to_thread(list, events), timeout=10)
        # the registry itself carried on
        segments = await asyncio.wait_for(asyncio.to_thread(client.query), timeout=10)
        assert [s.engine for s in segments] == [f"e{i}" for i in range(6)]
    finally:
        client.close()
        await server.stop(0)


# ---------------------------------------------------------------- ownership (issue 15)

KEY_A, KEY_B = b"a" * 32, b"b" * 32


def test_an_owned_name_is_refused_to_every_other_key_whatever_the_epoch(
        registry: Registry) -> None:
    lease = registry.publish("e", "n", 5, [seg("e", 1, 0x1000, epoch=5)], TTL_MS,
                             owner_key=KEY_A)
    for key in (KEY_B, None, b""):
        with pytest.raises(PermissionDenied, match="owner"):
            registry.publish("e", "evil", 2**32 - 1, [seg("e", 1, 0x9000, epoch=2**32 - 1)],
                             TTL_MS, owner_key=key)
        with pytest.raises(PermissionDenied, match="owner key"):
            registry.keepalive(lease, owner_key=key)
        with pytest.raises(PermissionDenied, match="owner key"):
            registry.unpublish(lease, owner_key=key)
    assert registry.engines() == {"e": 5}
    assert [s.base for s in registry.query("e")] == [0x1000]
    # the owner: the same epoch keeps the lease, a newer one replaces it, an older is stale
    assert registry.publish("e", "n", 5, [], TTL_MS, owner_key=KEY_A) == lease
    assert registry.keepalive(lease, owner_key=KEY_A) == TTL_MS
    with pytest.raises(StaleEpoch):
        registry.publish("e", "n", 4, [], TTL_MS, owner_key=KEY_A)
    newer = registry.publish("e", "n", 6, [], TTL_MS, owner_key=KEY_A)
    assert newer != lease and registry.engines() == {"e": 6}
    with pytest.raises(NotConnected):
        registry.keepalive(lease, owner_key=KEY_A)
    registry.unpublish(newer, owner_key=KEY_A)


def test_a_name_stays_its_owners_after_its_lease_ends_until_released(
        registry: Registry, clock: FakeClock) -> None:
    lease = registry.publish("e", "n", 3, [], TTL_MS, owner_key=KEY_A)
    registry.unpublish(lease, owner_key=KEY_A)
    with pytest.raises(PermissionDenied, match="release_owner"):
        registry.publish("e", "n", 9, [], TTL_MS, owner_key=KEY_B)
    registry.publish("e", "n", 1, [], TTL_MS, owner_key=KEY_A)  # any epoch: a new lease
    with pytest.raises(ParamInvalid, match="live lease"):
        registry.release_owner("e")
    clock.advance(TTL_MS / 1000)
    assert registry.engines() == {}
    with pytest.raises(PermissionDenied):
        registry.publish("e", "n", 9, [], TTL_MS, owner_key=KEY_B)
    assert registry.release_owner("e") is True
    assert registry.release_owner("e") is False
    registry.publish("e", "n", 9, [], TTL_MS, owner_key=KEY_B)  # claimed anew
    with pytest.raises(PermissionDenied):
        registry.publish("e", "n", 10, [], TTL_MS, owner_key=KEY_A)


def test_unowned_publishes_work_as_before_and_a_key_claims_the_name(
        registry: Registry) -> None:
    lease = registry.publish("old", "n", 1, [], TTL_MS)  # a client that predates keys
    assert registry.keepalive(lease) == TTL_MS
    assert registry.publish("old", "n", 2, [], TTL_MS) != lease
    registry.publish("old", "n", 3, [], TTL_MS, owner_key=KEY_A)
    with pytest.raises(PermissionDenied, match="carries no owner key"):
        registry.publish("old", "n", 4, [], TTL_MS)
    with pytest.raises(ParamInvalid, match="32 bytes"):
        registry.publish("x", "n", 1, [], TTL_MS, owner_key=b"short")
    assert registry.stats()["owned_names"] == 1


def test_lease_ids_are_random(registry: Registry) -> None:
    leases = sorted(registry.publish(f"e{i}", "n", 1, [], TTL_MS) for i in range(64))
    gaps = {b - a for a, b in zip(leases, leases[1:], strict=False)}
    assert len(set(leases)) == 64 and min(gaps) > 1 << 20


def test_owners_beyond_the_limit_forget_names_without_a_lease_first(clock: FakeClock) -> None:
    registry = Registry(clock=clock, max_owners=2)
    gone = registry.publish("gone", "n", 1, [], TTL_MS, owner_key=KEY_A)
    registry.publish("live", "n", 1, [], TTL_MS, owner_key=KEY_A)
    registry.unpublish(gone, owner_key=KEY_A)
    new = registry.publish("new", "n", 1, [], TTL_MS, owner_key=KEY_B)  # forgets "gone"
    with pytest.raises(ResourceExhausted, match="all live"):
        registry.publish("more", "n", 1, [], TTL_MS, owner_key=KEY_B)
    registry.unpublish(new, owner_key=KEY_B)
    registry.publish("gone", "n", 1, [], TTL_MS, owner_key=KEY_B)  # another key: forgotten
    assert registry.engines() == {"gone": 1, "live": 1}


def test_the_grpc_client_proves_its_own_key_by_itself(registry: Registry) -> None:
    async def main() -> None:
        server = grpc.aio.server()
        add_registry_service(server, registry, expire_every_s=None)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            def calls() -> None:
                with RegistryClient(f"127.0.0.1:{port}") as ours, \
                        RegistryClient(f"127.0.0.1:{port}") as theirs:
                    lease = ours.publish("e", "n", 1, [], TTL_MS)
                    assert ours.publish("e", "n", 1, [], TTL_MS) == lease
                    assert ours.keepalive(lease) == TTL_MS
                    with pytest.raises(PermissionDenied):
                        theirs.publish("e", "n", 2, [], TTL_MS)
                    with pytest.raises(PermissionDenied):
                        theirs.keepalive(lease)
                    with pytest.raises(PermissionDenied):
                        theirs.unpublish(lease)
                    ours.unpublish(lease)
            await asyncio.to_thread(calls)
        finally:
            await server.stop(None)

    asyncio.run(main())
