"""The KV store's object index (server/master/store.py), driven directly: no gRPC, no sleeps.

Time is an injected clock the tests move by hand; randomness is a seeded Random.
"Restart" is a new ObjectStore on the same data dir after the old one was abandoned as a
crash leaves it (`close(snapshot=False)`: the journal as written, no final snapshot).
"""

from __future__ import annotations

import logging
import random
import threading
import tracemalloc
from collections.abc import Iterable
from pathlib import Path

import pytest

from hixl.errors import ConfigError
from hixl.server.master import store as store_module
from hixl.server.master.metadata import Journal, read_journal
from hixl.server.master.store import (
    ALIGNMENT,
    MAX_REGEX_CHARS,
    MAX_REGEX_WEIGHT,
    ObjectStore,
    OffsetAllocator,
    StoreOptions,
)
from hixl.store_codes import RPC_FAIL, ErrorCode, code_name
from hixl.store_types import (
    ClientStatus,
    Replica,
    ReplicaConfig,
    ReplicaState,
    SoftPinAction,
    StoreSegment,
)

MiB = 1 << 20
KiB = 1 << 10
T0 = 1000.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def seg(engine: str, segment_id: int = 1, *, epoch: int = 1, length: int = MiB,
        node: str = "node-a", base: int = 0x7F00_0000_0000) -> StoreSegment:
    return StoreSegment(engine, segment_id, epoch, base, length, node, name=f"{engine}#{segment_id}")


@pytest.fixture
def clock() -> Clock:
    return Clock()


#: Segment owners here do not heartbeat unless a test is about liveness.
FOREVER_S = 1e9
CLIENT_TTL_S = 10.0


def make_store(clock: Clock, data_dir: Path | None = None, **options: object) -> ObjectStore:
    options.setdefault("client_ttl_s", FOREVER_S)
    return ObjectStore(StoreOptions(**options), clock=clock, data_dir=data_dir,  # type: ignore[arg-type]
                       rng=random.Random(7))


@pytest.fixture
def store(clock: Clock) -> ObjectStore:
    return make_store(clock)


def put(store: ObjectStore, key: str, size: int, config: ReplicaConfig | None = None, *,
        client: str = "c1", upsert: bool = False, node: str = "") -> tuple[Replica, ...]:
    """A whole two-phase put; returns the committed replicas."""
    [started] = store.put_start(client, [(key, size)], config, upsert=upsert, node_id=node)
    assert started.code == ErrorCode.OK, code_name(started.code)
    assert store.put_end(client, [(key, started.put_id)]) == [ErrorCode.OK]
    return started.replicas


def used(store: ObjectStore) -> int:
    return int(store.stats()["used"])


def spans(replicas: Iterable[Replica]) -> list[tuple[str, int, int, int]]:
    return [(r.engine, r.segment_id, r.addr, r.length) for r in replicas]


def assert_disjoint(replicas: Iterable[Replica]) -> None:
    by_segment: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for r in replicas:
        by_segment.setdefault((r.engine, r.segment_id), []).append((r.addr, r.addr + r.length))
    for ranges in by_segment.values():
        ranges.sort()
        for (_, end), (start, _) in zip(ranges, ranges[1:], strict=False):
            assert end <= start, f"overlapping replicas: {ranges}"


# ---------------------------------------------------------------- codes


def test_error_codes_are_mooncakes() -> None:
    assert ErrorCode.OBJECT_NOT_FOUND == -704 and ErrorCode.OBJECT_ALREADY_EXISTS == -705
    assert ErrorCode.OBJECT_HAS_LEASE == -706 and ErrorCode.NO_AVAILABLE_HANDLE == -200
    assert ErrorCode.INVALID_KEY == -400 and ErrorCode.INVALID_PARAMS == -600
    assert ErrorCode.SEGMENT_NOT_FOUND == -101 and ErrorCode.SEGMENT_ALREADY_EXISTS == -102
    assert ErrorCode.REPLICA_IS_NOT_READY == -703 and ErrorCode.LEASE_EXPIRED == -707
    assert RPC_FAIL == ErrorCode.RPC_FAIL == -900
    assert code_name(-704) == "OBJECT_NOT_FOUND" and code_name(-12345) == "-12345"


# ---------------------------------------------------------------- allocator


def test_allocator_aligns_coalesces_and_reports_fragmentation() -> None:
    allocator = OffsetAllocator(64 * KiB)
    a = allocator.allocate(100)
    b = allocator.allocate(ALIGNMENT)
    c = allocator.allocate(1000)
    assert (a, b, c) == (0, 128, 192)
    assert allocator.used == 128 + 64 + 1024
    assert allocator.fragmentation() == 0.0
    allocator.free(b)
    assert allocator.fragmentation() > 0.0           # a 64-byte hole before c
    assert allocator.allocate(64) == 128              # first fit reuses the hole
    allocator.free(128)
    allocator.free(a)                                 # merges with the hole after it
    assert allocator.allocate(192) == 0               # one 192-byte block again
    allocator.free(0)
    allocator.free(c)                                 # merges both ways: one block
    assert allocator.used == 0 and allocator.largest_free() == 64 * KiB
    assert allocator.allocate(64 * KiB + 1) is None
    assert allocator.reserve(4096, 100) and not allocator.reserve(4100, 10)
    assert allocator.allocate(4096) == 0 and allocator.allocate(64) == 4096 + 128


# ---------------------------------------------------------------- two-phase put


def test_a_value_is_invisible_until_put_end(store: ObjectStore) -> None:
    store.mount_segment("owner", seg("a"))
    [started] = store.put_start("c1", [("k", 5000)])
    assert started.code == ErrorCode.OK and started.put_id
    [replica] = started.replicas
    assert replica.state == ReplicaState.INIT and replica.length == 5000
    assert seg("a").base <= replica.addr and replica.addr + 5000 <= seg("a").base + MiB
    # nothing to read yet, and nobody else may start the same key
    assert store.get_replicas(["k"])[0].code == ErrorCode.OBJECT_NOT_FOUND
    assert store.exist_keys(["k"]) == [ErrorCode.OBJECT_NOT_FOUND]
    assert store.get_sizes(["k"]) == [ErrorCode.OBJECT_NOT_FOUND]
    assert store.put_start("c2", [("k", 10)])[0].code == ErrorCode.OBJECT_ALREADY_EXISTS

    assert store.put_end("c1", [("k", started.put_id)]) == [ErrorCode.OK]
    got = store.get_replicas(["k"])[0]
    assert got.code == ErrorCode.OK and got.size == 5000
    assert got.lease_ttl_ms == StoreOptions().default_kv_lease_ttl_ms
    assert spans(got.replicas) == spans(started.replicas)
    assert got.replicas[0].state == ReplicaState.COMPLETE
    assert store.exist_keys(["k", "nope"]) == [ErrorCode.OK, ErrorCode.OBJECT_NOT_FOUND]
    assert store.get_sizes(["k"]) == [5000]
    # keys are immutable without upsert; a second put_end of the same put is unknown
    assert store.put_start("c1", [("k", 10)])[0].code == ErrorCode.OBJECT_ALREADY_EXISTS
    assert store.put_end("c1", [("k", started.put_id)]) == [ErrorCode.OBJECT_NOT_FOUND]


def test_batch_put_has_per_key_codes(store: ObjectStore) -> None:
    store.mount_segment("owner", seg("a", length=64 * KiB))
    results = store.put_start("c1", [("x", 100), ("", 100), ("y", 0), ("x", 5),
                                     ("big", MiB), ("z", 1)])
    assert [r.code for r in results] == [
        ErrorCode.OK, ErrorCode.INVALID_KEY, ErrorCode.INVALID_PARAMS,
        ErrorCode.OBJECT_ALREADY_EXISTS, ErrorCode.NO_AVAILABLE_HANDLE, ErrorCode.OK]
    codes = store.put_end("c1", [("x", results[0].put_id), ("z", results[5].put_id),
                                 ("z", results[0].put_id), ("w", 12345)])
    assert codes == [ErrorCode.OK, ErrorCode.OK, ErrorCode.OBJECT_NOT_FOUND,
                     ErrorCode.OBJECT_NOT_FOUND]
    assert_disjoint(r for got in store.get_replicas(["x", "z"]) for r in got.replicas)


def test_bad_config_or_client_refuses_the_whole_batch(store: ObjectStore) -> None:
    store.mount_segment("owner", seg("a"))
    for config in (ReplicaConfig(replica_num=0), ReplicaConfig(replica_num=65),
                   ReplicaConfig(soft_pin_ttl_ms=25 * 3600 * 1000)):
        assert [r.code for r in store.put_start("c1", [("k", 1), ("j", 1)], config)] == [
            ErrorCode.INVALID_PARAMS] * 2
    assert store.put_start("", [("k", 1)])[0].code == ErrorCode.INVALID_PARAMS
    assert store.put_start("c1", [("k" * 4097, 1)])[0].code == ErrorCode.INVALID_KEY
    assert used(store) == 0


def test_revoke_frees_the_space_and_keeps_nothing(store: ObjectStore) -> None:
    store.mount_segment("owner", seg("a"))
    [started] = store.put_start("c1", [("k", 4000)])
    assert used(store) == 4032
    assert store.put_revoke("c2", [("k", started.put_id)]) == [ErrorCode.INVALID_PARAMS]
    assert store.put_revoke("c1", [("k", started.put_id)]) == [ErrorCode.OK]
    assert used(store) == 0
    assert store.put_end("c1", [("k", started.put_id)]) == [ErrorCode.OBJECT_NOT_FOUND]
    assert store.exist_keys(["k"]) == [ErrorCode.OBJECT_NOT_FOUND]
    put(store, "k", 10)  # the key is free again


def test_upsert_replaces_the_value_only_at_put_end(store: ObjectStore) -> None:
    store.mount_segment("owner", seg("a"))
    old = put(store, "k", 1000)
    [started] = store.put_start("c1", [("k", 3000)], upsert=True)
    assert started.code == ErrorCode.OK
    got = store.get_replicas(["k"])[0]
    assert (got.size, spans(got.replicas)) == (1000, spans(old))      # still the old value
    clock_now = store.stats()["used"]
    assert clock_now == 1024 + 3008
    assert store.put_end("c1", [("k", started.put_id)]) == [ErrorCode.OK]
    got = store.get_replicas(["k"])[0]
    assert (got.size, spans(got.replicas)) == (3000, spans(started.replicas))


def test_revoked_upsert_keeps_the_committed_value(store: ObjectStore) -> None:
    store.mount_segment("owner", seg("a"))
    old = put(store, "k", 1000)
    [started] = store.put_start("c1", [("k", 3000)], upsert=True)
    assert store.put_revoke("c1", [("k", started.put_id)]) == [ErrorCode.OK]
    got = store.get_replicas(["k"])[0]
    assert (got.code, got.size, spans(got.replicas)) == (ErrorCode.OK, 1000, spans(old))
    assert used(store) == 1024


def test_upsert_of_a_leased_value_keeps_its_space_until_the_lease_ends(
        store: ObjectStore, clock: Clock) -> None:
    store.mount_segment("owner", seg("a"))
    old = put(store, "k", 1000)
    store.get_replicas(["k"])                                     # a reader holds a lease
    put(store, "k", 1000, upsert=True)
    assert used(store) == 2048                                    # old bytes still readable
    new = store.put_start("c1", [("other", 1000)])[0].replicas
    assert_disjoint([*old, *new])                                 # never reused meanwhile
    clock.advance(StoreOptions().default_kv_lease_ttl_ms / 1000)
    store.tick()
    assert used(store) == 2048                                    # 'other' + the new value


# ---------------------------------------------------------------- allocation


def test_replicas_land_on_distinct_segments_best_effort(store: ObjectStore) -> None:
    for name in ("a", "b", "c"):
        store.mount_segment("owner", seg(name))
    three = put(store, "three", 100, ReplicaConfig(replica_num=3))
    assert sorted(r.engine for r in three) == ["a", "b", "c"]
    assert len({r.replica_id for r in three}) == 3
    # more replicas than segments: as many as there are segments, not a failure
    five = put(store, "five", 100, ReplicaConfig(replica_num=5))
    assert sorted(r.engine for r in five) == ["a", "b", "c"]
    assert_disjoint([*three, *five])


def test_only_segments_with_room_take_replicas(store: ObjectStore) -> None:
    store.mount_segment("owner", seg("small", length=4 * KiB))
    store.mount_segment("owner", seg("large", length=MiB))
    replicas = put(store, "k", 64 * KiB, ReplicaConfig(replica_num=2))
    assert [r.engine for r in replicas] == ["large"]


def test_preferred_segment_comes_first(store: ObjectStore) -> None:
    for name in ("a", "b", "c", "d"):
        store.mount_segment("owner", seg(name))
    for i in range(10):
        [replica] = put(store, f"k{i}", 100, ReplicaConfig(preferred_segments=("c",)))
        assert replica.engine == "c"
        replicas = put(store, f"j{i}", 100, ReplicaConfig(replica_num=2,
                                                          preferred_segments=("d#1",)))
        assert replicas[0].engine == "d" and replicas[1].engine != "d"


def test_same_node_preference(store: ObjectStore) -> None:
    store.mount_segment("owner", seg("far1", node="node-x"))
    store.mount_segment("owner", seg("near", node="node-y"))
    store.mount_segment("owner", seg("far2", node="node-z"))
    for i in range(10):
        [replica] = put(store, f"k{i}", 100, ReplicaConfig(prefer_alloc_in_same_node=True),
                        node="node-y")
        assert (replica.engine, replica.node_id) == ("near", "node-y")


def test_random_strategy_spreads_and_free_ratio_first_fills_the_emptiest(
        clock: Clock) -> None:
    spread = make_store(clock)
    for name in ("a", "b", "c", "d"):
        spread.mount_segment("owner", seg(name))
    engines = {put(spread, f"k{i}", 100)[0].engine for i in range(40)}
    assert engines == {"a", "b", "c", "d"}

    balanced = make_store(clock, allocation_strategy="free_ratio_first")
    balanced.mount_segment("owner", seg("a"))
    balanced.mount_segment("owner", seg("b", length=2 * MiB))
    put(balanced, "first", 256 * KiB)
    for i in range(20):
        stats = {m.segment.engine: m.used / m.segment.length for m in balanced.list_segments()}
        chosen = put(balanced, f"k{i}", 32 * KiB)[0].engine
        assert stats[chosen] == min(stats.values())      # ties go either way


def test_unknown_allocation_strategy_is_refused() -> None:
    with pytest.raises(ConfigError, match="allocation_strategy must be one of"):
        ObjectStore(StoreOptions(allocation_strategy="fastest"))
    with pytest.raises(ConfigError, match="eviction_ratio must be in"):
        ObjectStore(StoreOptions(eviction_ratio=1.5))


# ---------------------------------------------------------------- eviction


def test_no_space_evicts_least_recently_used(clock: Clock) -> None:
    store = make_store(clock, eviction_ratio=0.25, eviction_high_watermark_ratio=1.0)
    store.mount_segment("owner", seg("a", length=MiB))
    for i in range(4):
        put(store, f"k{i}", 256 * KiB)
        clock.advance(1)
    assert used(store) == MiB
    clock.advance(10)                                   # every lease is over
    store.get_sizes(["k0"])                             # no lease, not an access
    assert store.exist_keys(["k0"]) == [ErrorCode.OK]   # an access: k0 is now the newest
    clock.advance(10)
    put(store, "new", 256 * KiB)
    assert store.exist_keys(["k0", "k1", "k2", "k3"]) == [
        ErrorCode.OK, ErrorCode.OBJECT_NOT_FOUND, ErrorCode.OK, ErrorCode.OK]
    assert store.stats()["evicted"] == 1


def test_eviction_skips_leased_pinned_and_in_progress(clock: Clock) -> None:
    store = make_store(clock, eviction_ratio=0.25, eviction_high_watermark_ratio=1.0)
    store.mount_segment("owner", seg("a", length=MiB))
    put(store, "hard", 256 * KiB, ReplicaConfig(with_hard_pin=True))
    put(store, "leased", 256 * KiB)
    [pending] = store.put_start("c1", [("pending", 256 * KiB)])
    put(store, "soft", 256 * KiB, ReplicaConfig(soft_pin_action=SoftPinAction.ENABLE))
    clock.advance(10)
    store.get_replicas(["leased"])
    # only the soft-pinned one may go, as a last resort
    assert [r.code for r in store.put_start("c2", [("new", 256 * KiB)])] == [ErrorCode.OK]
    assert store.exist_keys(["hard", "leased", "soft"]) == [
        ErrorCode.OK, ErrorCode.OK, ErrorCode.OBJECT_NOT_FOUND]
    # now nothing may go: no space even after eviction
    assert store.put_start("c2", [("more", 256 * KiB)])[0].code == ErrorCode.NO_AVAILABLE_HANDLE
    assert store.put_end("c1", [("pending", pending.put_id)]) == [ErrorCode.OK]


def test_soft_pinned_objects_go_after_unpinned_ones(clock: Clock) -> None:
    store = make_store(clock, eviction_ratio=0.25, eviction_high_watermark_ratio=1.0)
    store.mount_segment("owner", seg("a", length=MiB))
    put(store, "pinned-old", 256 * KiB, ReplicaConfig(soft_pin_action=SoftPinAction.ENABLE))
    put(store, "plain-1", 256 * KiB)
    put(store, "plain-2", 256 * KiB)
    put(store, "plain-3", 256 * KiB)
    clock.advance(10)
    put(store, "new", 256 * KiB)
    # (get_sizes neither leases nor counts as an access)
    assert store.get_sizes(["pinned-old", "plain-1"]) == [256 * KiB, ErrorCode.OBJECT_NOT_FOUND]
    # the soft pin expires after its ttl: then it is an ordinary object again
    clock.advance(StoreOptions().default_kv_soft_pin_ttl_ms / 1000)
    put(store, "newer", 256 * KiB)
    assert store.get_sizes(["pinned-old"]) == [ErrorCode.OBJECT_NOT_FOUND]


def test_upsert_can_disable_a_soft_pin(clock: Clock) -> None:
    store = make_store(clock, eviction_ratio=0.25, eviction_high_watermark_ratio=1.0)
    store.mount_segment("owner", seg("a", length=MiB))
    put(store, "k", 256 * KiB, ReplicaConfig(soft_pin_action=SoftPinAction.ENABLE))
    put(store, "k", 256 * KiB, ReplicaConfig(soft_pin_action=SoftPinAction.PRESERVE),
        upsert=True)
    for i in range(3):
        put(store, f"p{i}", 256 * KiB)
    clock.advance(10)
    put(store, "x", 256 * KiB)                       # k is the oldest, but pinned
    assert store.get_sizes(["k", "p0"]) == [256 * KiB, ErrorCode.OBJECT_NOT_FOUND]
    put(store, "k", 256 * KiB, ReplicaConfig(soft_pin_action=SoftPinAction.DISABLE),
        upsert=True)                                 # (evicts p1 to make room)
    put(store, "y", 256 * KiB)
    clock.advance(10)
    store.exist_keys(["p2", "x", "y"])               # accessed: k is the least recent now
    clock.advance(10)
    put(store, "z", 256 * KiB)
    assert store.get_sizes(["k", "p2"]) == [ErrorCode.OBJECT_NOT_FOUND, 256 * KiB]


def test_high_watermark_triggers_eviction(clock: Clock) -> None:
    store = make_store(clock, eviction_ratio=0.5, eviction_high_watermark_ratio=0.6)
    store.mount_segment("owner", seg("a", length=MiB))
    for i in range(3):
        put(store, f"k{i}", 256 * KiB)
    store.get_replicas(["k0", "k1", "k2"])
    assert store.stats()["usage"] == 0.75
    store.tick()                              # leased: nothing may go yet
    assert store.stats()["usage"] == 0.75
    clock.advance(10)
    store.tick()
    assert store.stats()["usage"] == 0.25     # half the capacity freed, oldest first
    assert store.exist_keys(["k0", "k1", "k2"]) == [
        ErrorCode.OBJECT_NOT_FOUND, ErrorCode.OBJECT_NOT_FOUND, ErrorCode.OK]


# ---------------------------------------------------------------- leases and removal


def test_leases_block_remove_unless_forced(store: ObjectStore, clock: Clock) -> None:
    store.mount_segment("owner", seg("a"))
    replicas = put(store, "k", 1000)
    put(store, "j", 1000)
    assert store.remove(["k"]) == [ErrorCode.OK]                  # no lease: goes
    replicas = put(store, "k", 1000)
    assert store.get_replicas(["k"])[0].code == ErrorCode.OK
    assert store.remove(["k", "nope"]) == [ErrorCode.OBJECT_HAS_LEASE,
                                           ErrorCode.OBJECT_NOT_FOUND]
    assert store.remove(["k"], force=True) == [ErrorCode.OK]
    assert store.exist_keys(["k"]) == [ErrorCode.OBJECT_NOT_FOUND]
    # the reader under lease is not torn: the space is not handed out before the lease ends
    assert used(store) == 2048
    others = put(store, "other", 1000)
    assert_disjoint([*replicas, *others])
    clock.advance(StoreOptions().default_kv_lease_ttl_ms / 1000)
    store.tick()
    assert used(store) == 2048                                    # j + other


def test_lease_expires(store: ObjectStore, clock: Clock) -> None:
    store.mount_segment("owner", seg("a"))
    put(store, "k", 10)
    store.exist_keys(["k"])                                       # exist leases too
    assert store.remove(["k"]) == [ErrorCode.OBJECT_HAS_LEASE]
    clock.advance(StoreOptions().default_kv_lease_ttl_ms / 1000)
    assert store.remove(["k"]) == [ErrorCode.OK]


def test_remove_by_regex_and_remove_all(store: ObjectStore, clock: Clock) -> None:
    store.mount_segment("owner", seg("a"))
    for key in ("model_1_k", "model_1_v", "model_2_k", "other"):
        put(store, key, 10)
    clock.advance(10)
    store.get_replicas(["model_2_k"])
    result = store.remove_by_regex(r"^model_\d_k$")
    assert (result.code, result.count) == (ErrorCode.OK, 1)            # model_2_k is leased
    assert store.exist_keys(["model_1_k", "model_2_k"]) == [ErrorCode.OBJECT_NOT_FOUND,
                                                            ErrorCode.OK]
    assert store.remove_by_regex("(unclosed").code == ErrorCode.INVALID_PARAMS
    [pending] = store.put_start("c1", [("pending", 10)])
    assert store.remove_all().count == 2                               # model_1_v, other
    assert store.remove_all(force=True).count == 1                     # model_2_k
    assert store.stats()["keys"] == 0
    assert store.put_end("c1", [("pending", pending.put_id)]) == [ErrorCode.OK]



def test_a_backtracking_regex_is_refused_and_changes_nothing(
        store: ObjectStore, monkeypatch: pytest.MonkeyPatch) -> None:
    """A client's pattern that backtracks exponentially on a stored key would freeze the
    master (`re` holds the GIL for the whole match): it is cut off after REGEX_BUDGET_S
    with INVALID_PARAMS naming the pattern, and no key is removed."""
    monkeypatch.setattr(store_module, "REGEX_BUDGET_S", 0.2)  # never matches: any budget
    store.mount_segment("owner", seg("a"))
    keys = ["a" * 3000 + "!", "plain", "model_7"]
    for key in keys:
        put(store, key, 10)
    evil = r"(\w*)*\d$"
    removed = store.remove_by_regex(evil, force=True)
    assert removed.code == ErrorCode.INVALID_PARAMS and removed.count == 0
    assert repr(evil) in removed.message and "simplify it" in removed.message
    listed = store.list_keys(evil)
    assert listed.code == ErrorCode.INVALID_PARAMS and "took more than" in listed.message
    assert store.exist_keys(keys) == [ErrorCode.OK] * 3
    # an ordinary pattern over the same keys still works
    assert store.remove_by_regex(r"_\d$", force=True).count == 1
    assert store.exist_keys(keys) == [ErrorCode.OK, ErrorCode.OK, ErrorCode.OBJECT_NOT_FOUND]


def test_a_regex_that_would_unroll_past_the_bound_is_refused_before_compiling(
        store: ObjectStore) -> None:
    """`(?:a{1000}){3000}` is 18 bytes that `regex` would unroll into 3 million items
    (~800 MiB for seconds; the match timeout does not cover compiling): refused with
    INVALID_PARAMS naming the pattern and the bound, before any of it is built."""
    store.mount_segment("owner", seg("a"))
    put(store, "a" * 10, 10)
    evil = "(?:a{1000}){3000}"
    tracemalloc.start()
    try:
        listed = store.list_keys(evil)
        removed = store.remove_by_regex(evil, force=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * MiB, peak
    for message in (listed.message, removed.message):
        assert repr(evil) in message and str(MAX_REGEX_WEIGHT) in message, message
    assert (listed.code, removed.code, removed.count) == (ErrorCode.INVALID_PARAMS,) * 2 + (0,)
    # a bounded maximum is bounded too (`regex` unrolls the minimum; the check does not
    # rely on that), and the same body under the bound compiles and matches
    assert store.list_keys("(?:a{0,1000}){0,1000}").code == ErrorCode.INVALID_PARAMS
    assert [k.key for k in store.list_keys("^(?:a{5}){2}$").keys] == ["a" * 10]
    assert store.exist_keys(["a" * 10]) == [ErrorCode.OK]


def test_a_regex_longer_than_a_key_is_refused_naming_the_bound(store: ObjectStore) -> None:
    long = "x" * (MAX_REGEX_CHARS + 1)
    listed = store.list_keys(long)
    assert listed.code == ErrorCode.INVALID_PARAMS
    assert str(MAX_REGEX_CHARS) in listed.message and "shorten it" in listed.message
    assert len(listed.message) < 400                                  # the pattern is cut
    assert store.list_keys("x" * MAX_REGEX_CHARS).code == ErrorCode.OK


def test_client_patterns_are_not_cached(store: ObjectStore) -> None:
    """`regex` caches up to 500 compiled patterns and one near the weight bound holds
    megabytes: distinct client patterns would pin gigabytes. After 20 distinct ones
    (~70 MiB if cached), the master's Python heap holds next to nothing more."""
    store.mount_segment("owner", seg("a"))
    put(store, "k" * 10, 10)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(20):
            assert store.list_keys(f"(?:a{{90}}){{100}}x{i}").code == ErrorCode.OK
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held < MiB, held


# ---------------------------------------------------------------- clients and segments


def test_expired_client_loses_its_segments_at_once(clock: Clock) -> None:
    ttl = CLIENT_TTL_S
    store = make_store(clock, client_ttl_s=ttl)
    store.mount_segment("keeper", seg("a"))
    store.mount_segment("leaver", seg("b"))
    both = put(store, "both", 100, ReplicaConfig(replica_num=2))
    assert sorted(r.engine for r in both) == ["a", "b"]
    only_b = put(store, "only-b", 100, ReplicaConfig(preferred_segments=("b",)))
    assert only_b[0].engine == "b"
    [in_b] = store.put_start("c1", [("pending-b", 100)], ReplicaConfig(preferred_segments=("b",)))

    for _ in range(3):                          # heartbeats keep a client for ever
        clock.advance(ttl * 0.6)
        assert store.heartbeat("keeper").status == ClientStatus.OK
        assert store.heartbeat("leaver").status == ClientStatus.OK
    clock.advance(ttl * 0.6)
    assert store.heartbeat("keeper").status == ClientStatus.OK
    clock.advance(ttl * 0.6)                    # "leaver" missed its heartbeats
    # no upkeep ran: the very next put already avoids the dead client's segment
    for i in range(10):
        assert put(store, f"k{i}", 100, ReplicaConfig(preferred_segments=("b",)))[0].engine == "a"
    assert [m.segment.engine for m in store.list_segments()] == ["a"]
    got = store.get_replicas(["both", "only-b"])
    assert [r.engine for r in got[0].replicas] == ["a"]
    assert got[1].code == ErrorCode.OBJECT_NOT_FOUND
    assert store.put_end("c1", [("pending-b", in_b.put_id)]) == [ErrorCode.OBJECT_NOT_FOUND]
    # the client comes back: told to remount; then it is known again
    assert store.heartbeat("leaver").status == ClientStatus.NEED_REMOUNT
    assert store.heartbeat("leaver").status == ClientStatus.OK
    assert store.stats()["expired_clients"] == 1


def test_unmount_drops_replicas_and_orphaned_objects(store: ObjectStore) -> None:
    store.mount_segment("c1", seg("a"))
    store.mount_segment("c1", seg("b"))
    put(store, "both", 100, ReplicaConfig(replica_num=2))
    put(store, "only-b", 100, ReplicaConfig(preferred_segments=("b",)))
    assert store.unmount_segment("c2", "b", 1).code == ErrorCode.INVALID_PARAMS
    assert store.unmount_segment("c1", "b", 2).code == ErrorCode.SEGMENT_NOT_FOUND
    result = store.unmount_segment("c1", "b", 1)
    assert (result.code, result.objects) == (ErrorCode.OK, 1)
    assert store.exist_keys(["both", "only-b"]) == [ErrorCode.OK, ErrorCode.OBJECT_NOT_FOUND]
    assert store.unmount_segment("c1", "b", 1).code == ErrorCode.SEGMENT_NOT_FOUND


def test_mount_rules(store: ObjectStore) -> None:
    assert store.mount_segment("c1", seg("a", epoch=5)).code == ErrorCode.OK
    put(store, "k", 100)
    # the same memory again: idempotent, also from another client (ownership moves)
    assert store.mount_segment("c1", seg("a", epoch=5)).code == ErrorCode.OK
    assert store.mount_segment("c2", seg("a", epoch=5)).code == ErrorCode.OK
    assert [m.client_id for m in store.list_segments()] == ["c2"]
    assert store.exist_keys(["k"]) == [ErrorCode.OK]
    # the same epoch describing other memory: a conflict
    result = store.mount_segment("c3", seg("a", epoch=5, length=2 * MiB))
    assert result.code == ErrorCode.SEGMENT_ALREADY_EXISTS and "unmount it first" in result.message
    # an older epoch is a zombie
    assert store.mount_segment("c1", seg("a", epoch=4)).code == ErrorCode.INVALID_VERSION
    # a newer epoch: the owner restarted, its memory (and every object in it) is gone
    assert store.mount_segment("c1", seg("a", epoch=6)).code == ErrorCode.OK
    assert store.exist_keys(["k"]) == [ErrorCode.OBJECT_NOT_FOUND]
    assert used(store) == 0
    bad = store.mount_segment("c1", seg("", length=MiB))
    assert bad.code == ErrorCode.INVALID_PARAMS and "engine" in bad.message
    assert store.mount_segment("c1", seg("z", length=0)).code == ErrorCode.INVALID_PARAMS
    assert store.mount_segment("", seg("z")).code == ErrorCode.INVALID_PARAMS


def test_no_segments_means_no_space(store: ObjectStore) -> None:
    assert store.put_start("c1", [("k", 1)])[0].code == ErrorCode.NO_AVAILABLE_HANDLE


# ---------------------------------------------------------------- stale puts


def test_a_stale_put_is_preempted_and_its_space_released_later(
        store: ObjectStore, clock: Clock) -> None:
    options = StoreOptions()
    store.mount_segment("owner", seg("a"))
    [stale] = store.put_start("zombie", [("k", 4000)])
    clock.advance(options.put_start_discard_timeout_s - 1)
    assert store.put_start("c2", [("k", 4000)])[0].code == ErrorCode.OBJECT_ALREADY_EXISTS
    clock.advance(1)
    [fresh] = store.put_start("c2", [("k", 4000)])
    assert fresh.code == ErrorCode.OK
    assert_disjoint([*stale.replicas, *fresh.replicas])   # the zombie may still be writing
    assert store.stats()["preempted_puts"] == 1
    assert store.put_end("zombie", [("k", stale.put_id)]) == [ErrorCode.OBJECT_NOT_FOUND]
    assert store.put_end("c2", [("k", fresh.put_id)]) == [ErrorCode.OK]
    assert used(store) == 2 * 4032
    clock.advance(options.put_start_release_timeout_s - options.put_start_discard_timeout_s)
    store.tick()
    assert used(store) == 4032


def test_an_abandoned_put_is_released_after_the_release_timeout(
        store: ObjectStore, clock: Clock) -> None:
    store.mount_segment("owner", seg("a"))
    [started] = store.put_start("c1", [("k", 4000)])
    clock.advance(StoreOptions().put_start_release_timeout_s)
    store.tick()
    assert used(store) == 0 and store.stats()["released_puts"] == 1
    assert store.put_end("c1", [("k", started.put_id)]) == [ErrorCode.OBJECT_NOT_FOUND]


# ---------------------------------------------------------------- persistence


def crash_and_restart(store: ObjectStore, clock: Clock, data_dir: Path,
                      **options: object) -> ObjectStore:
    store.close(snapshot=False)
    return make_store(clock, data_dir, **options)


def test_committed_keys_survive_a_restart_and_come_back_on_remount(
        clock: Clock, tmp_path: Path) -> None:
    store = make_store(clock, tmp_path)
    store.mount_segment("c1", seg("a", epoch=7))
    store.mount_segment("c2", seg("b", epoch=3))
    kept = {f"k{i}": put(store, f"k{i}", 1000 + i, ReplicaConfig(replica_num=2))
            for i in range(20)}
    put(store, "gone", 10)
    clock.advance(10)
    assert store.remove(["gone"]) == [ErrorCode.OK]
    [pending] = store.put_start("c1", [("pending", 5000)])
    put(store, "k0", 777, ReplicaConfig(replica_num=2), upsert=True)
    kept["k0"] = store.get_replicas(["k0"])[0].replicas

    store = crash_and_restart(store, clock, tmp_path)
    segments = store.list_segments()
    assert sorted((m.segment.engine, m.segment.epoch, m.client_id, m.live) for m in segments) == [
        ("a", 7, "c1", False), ("b", 3, "c2", False)]
    # known but unreadable until the owners remount
    assert store.exist_keys(["k1", "gone", "pending"]) == [
        ErrorCode.REPLICA_IS_NOT_READY, ErrorCode.OBJECT_NOT_FOUND, ErrorCode.OBJECT_NOT_FOUND]
    assert store.get_replicas(["k1"])[0].code == ErrorCode.REPLICA_IS_NOT_READY
    assert store.put_start("c9", [("k", 1)])[0].code == ErrorCode.NO_AVAILABLE_HANDLE

    assert store.heartbeat("c1").status == ClientStatus.NEED_REMOUNT
    restored = store.mount_segment("c1", seg("a", epoch=7))
    assert (restored.code, restored.objects) == (ErrorCode.OK, 20)
    assert store.mount_segment("c2", seg("b", epoch=3)).objects == 20
    for key, replicas in kept.items():
        got = store.get_replicas([key])[0]
        assert got.code == ErrorCode.OK, key
        assert sorted(spans(got.replicas)) == sorted(spans(replicas))
    assert store.get_sizes(["k0", "k5"]) == [777, 1005]
    # the put in progress was never committed: gone, and its id unknown
    assert store.put_end("c1", [("pending", pending.put_id)]) == [ErrorCode.OBJECT_NOT_FOUND]
    # new allocations avoid every restored replica; ids do not repeat
    fresh = put(store, "fresh", 50_000, ReplicaConfig(replica_num=2))
    everything = [r for got in store.get_replicas(list(kept)) for r in got.replicas]
    assert_disjoint([*everything, *fresh])
    assert not {r.replica_id for r in fresh} & {r.replica_id for r in everything}
    store.close()


def test_a_segment_back_with_a_new_epoch_loses_its_objects(
        clock: Clock, tmp_path: Path) -> None:
    store = make_store(clock, tmp_path)
    store.mount_segment("c1", seg("a", epoch=1))
    store.mount_segment("c2", seg("b", epoch=1))
    put(store, "on-a", 10, ReplicaConfig(preferred_segments=("a",)))
    put(store, "on-b", 10, ReplicaConfig(preferred_segments=("b",)))
    store = crash_and_restart(store, clock, tmp_path)
    result = store.mount_segment("c1-restarted", seg("a", epoch=2))
    assert (result.code, result.objects) == (ErrorCode.OK, 0)
    assert store.mount_segment("c2", seg("b", epoch=1)).objects == 1
    assert store.exist_keys(["on-a", "on-b"]) == [ErrorCode.OBJECT_NOT_FOUND, ErrorCode.OK]
    # and that outcome is itself durable
    store = crash_and_restart(store, clock, tmp_path)
    store.mount_segment("c1", seg("a", epoch=2))
    store.mount_segment("c2", seg("b", epoch=1))
    assert store.exist_keys(["on-a", "on-b"]) == [ErrorCode.OBJECT_NOT_FOUND, ErrorCode.OK]
    store.close()


def test_segments_never_remounted_are_dropped_after_the_grace(
        clock: Clock, tmp_path: Path) -> None:
    store = make_store(clock, tmp_path, remount_grace_s=30)
    store.mount_segment("c1", seg("a"))
    put(store, "k", 10)
    store = crash_and_restart(store, clock, tmp_path, remount_grace_s=30)
    clock.advance(29)
    store.tick()
    assert store.exist_keys(["k"]) == [ErrorCode.REPLICA_IS_NOT_READY]
    clock.advance(1)
    store.tick()
    assert store.exist_keys(["k"]) == [ErrorCode.OBJECT_NOT_FOUND]
    assert store.list_segments() == []
    store = crash_and_restart(store, clock, tmp_path)
    assert store.list_segments() == [] and store.stats()["keys"] == 0
    store.close()


def test_removals_evictions_and_expiries_are_durable(clock: Clock, tmp_path: Path) -> None:
    store = make_store(clock, tmp_path, eviction_ratio=0.25, eviction_high_watermark_ratio=1.0,
                       client_ttl_s=CLIENT_TTL_S)
    store.mount_segment("c1", seg("a", length=MiB))
    store.mount_segment("c2", seg("b", length=4 * KiB))
    for i in range(4):
        put(store, f"a{i}", 256 * KiB, ReplicaConfig(preferred_segments=("a",)))
        clock.advance(1)
    put(store, "b", 100, ReplicaConfig(preferred_segments=("b",)))
    assert store.remove(["a3"]) == [ErrorCode.OK]
    put(store, "a4", 256 * KiB, ReplicaConfig(preferred_segments=("a",)))
    put(store, "a5", 600 * KiB, ReplicaConfig(preferred_segments=("a",)))  # evicts from a
    assert store.get_sizes(["a0", "a1", "a2", "a4"]) == [ErrorCode.OBJECT_NOT_FOUND] * 3 + [
        256 * KiB]
    store.heartbeat("c1")
    for _ in range(3):
        clock.advance(CLIENT_TTL_S * 0.6)
        store.heartbeat("c1")
    assert [m.segment.engine for m in store.list_segments()] == ["a"]   # c2 expired
    store = crash_and_restart(store, clock, tmp_path)
    assert [m.segment.engine for m in store.list_segments()] == ["a"]
    store.mount_segment("c1", seg("a", length=MiB))
    keys = ["a0", "a1", "a2", "a3", "a4", "a5", "b"]
    present = {k for k, code in zip(keys, store.exist_keys(keys), strict=True) if code == ErrorCode.OK}
    assert present == {"a4", "a5"}
    store.close()


def test_hard_pins_survive_a_restart(clock: Clock, tmp_path: Path) -> None:
    store = make_store(clock, tmp_path, eviction_ratio=1.0, eviction_high_watermark_ratio=0.0)
    store.mount_segment("c1", seg("a"))
    put(store, "pinned", 10, ReplicaConfig(with_hard_pin=True))
    put(store, "plain", 10)
    store = crash_and_restart(store, clock, tmp_path, eviction_ratio=1.0,
                              eviction_high_watermark_ratio=0.0)
    store.mount_segment("c1", seg("a"))
    assert store.remove(["plain"]) == [ErrorCode.OBJECT_HAS_LEASE]  # restored with a lease
    clock.advance(StoreOptions().default_kv_lease_ttl_ms / 1000)
    store.tick()                                                    # evicts all it may
    assert store.exist_keys(["pinned", "plain"]) == [ErrorCode.OK, ErrorCode.OBJECT_NOT_FOUND]
    store.close()


def test_a_torn_journal_tail_is_ignored_with_a_warning(
        clock: Clock, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = make_store(clock, tmp_path)
    store.mount_segment("c1", seg("a"))
    for i in range(5):
        put(store, f"k{i}", 100)
    store.close(snapshot=False)
    [journal] = sorted(tmp_path.glob("journal-*.log"))
    whole = journal.stat().st_size
    with open(journal, "ab") as f:                   # a record cut short by the crash
        f.write(b"\x40\x00\x00\x00\x12\x34\x56\x78{\"t\":\"put\",\"o\":[[\"k9\"")
    with caplog.at_level(logging.WARNING, logger="hixl.store"):
        store = make_store(clock, tmp_path)
    assert "torn or corrupt tail" in caplog.text and "after 6 whole records" in caplog.text
    store.mount_segment("c1", seg("a"))
    assert store.exist_keys([f"k{i}" for i in range(5)] + ["k9"]) == [ErrorCode.OK] * 5 + [
        ErrorCode.OBJECT_NOT_FOUND]
    put(store, "after", 100)                           # appends continue cleanly
    store.close(snapshot=False)
    assert whole > 0
    store = make_store(clock, tmp_path)
    store.mount_segment("c1", seg("a"))
    assert store.exist_keys(["k4", "after"]) == [ErrorCode.OK, ErrorCode.OK]
    store.close()


def test_snapshots_truncate_the_journal(clock: Clock, tmp_path: Path) -> None:
    store = make_store(clock, tmp_path, snapshot_every_records=10)
    store.mount_segment("c1", seg("a"))
    for i in range(25):
        put(store, f"k{i}", 100)
        store.tick()                                   # snapshots when 10 records piled up
    [journal] = tmp_path.glob("journal-*.log")
    records, _, _ = read_journal(journal)
    assert len(records) < 10
    assert len(list(tmp_path.glob("snapshot-*.json"))) == 1
    store = crash_and_restart(store, clock, tmp_path)
    store.mount_segment("c1", seg("a"))
    assert store.exist_keys([f"k{i}" for i in range(25)]) == [ErrorCode.OK] * 25
    store.close()


def test_a_data_dir_serves_one_store_at_a_time(clock: Clock, tmp_path: Path) -> None:
    store = make_store(clock, tmp_path)
    with pytest.raises(ConfigError, match="in use by another hixl-master"):
        make_store(clock, tmp_path)
    store.close()
    make_store(clock, tmp_path).close()
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match="cannot use it"):
        make_store(clock, blocker / "sub")


def test_journal_group_commit_and_reader(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j.log")
    ends = [journal.append({"n": i}) for i in range(3)]
    journal.sync(ends[0])                 # one fsync covers everything written before it
    journal.sync(ends[2])
    journal.close()
    journal.sync(ends[2])                 # closed: returns at once
    records, good, size = read_journal(tmp_path / "j.log")
    assert records == [{"n": 0}, {"n": 1}, {"n": 2}] and good == size == ends[2]


def test_a_value_no_segment_can_hold_evicts_nothing(clock: Clock) -> None:
    store = make_store(clock, eviction_ratio=1.0, eviction_high_watermark_ratio=1.0)
    store.mount_segment("owner", seg("a", length=64 * KiB))
    store.mount_segment("owner", seg("b", length=64 * KiB))
    put(store, "k", 1000)
    assert store.put_start("c1", [("huge", 100 * KiB)])[0].code == ErrorCode.NO_AVAILABLE_HANDLE
    assert store.get_sizes(["k"]) == [1000] and store.stats()["evicted"] == 0


def test_concurrent_writers_snapshots_and_upkeep(tmp_path: Path) -> None:
    """Threads putting, reading and removing while upkeep snapshots under them: no
    deadlock, no overlapping replicas, and a restart finds exactly what was committed."""
    store = ObjectStore(StoreOptions(client_ttl_s=FOREVER_S, snapshot_every_records=40),
                        data_dir=tmp_path)
    for name in ("a", "b", "c"):
        store.mount_segment("owner", seg(name, length=8 * MiB))
    errors: list[BaseException] = []
    stop = threading.Event()

    def writer(n: int) -> None:
        try:
            for i in range(150):
                key = f"w{n}-{i}"
                [started] = store.put_start(f"c{n}", [(key, 1000 + i)],
                                            ReplicaConfig(replica_num=2))
                assert started.code == ErrorCode.OK
                assert store.put_end(f"c{n}", [(key, started.put_id)]) == [ErrorCode.OK]
                assert store.get_replicas([key])[0].size == 1000 + i
                if i % 3 == 0:
                    assert store.remove([key], force=True) == [ErrorCode.OK]
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)

    def upkeep() -> None:
        while not stop.is_set():
            store.tick()

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(6)]
    keeper = threading.Thread(target=upkeep)
    keeper.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    stop.set()
    keeper.join(timeout=60)
    assert not errors, errors
    assert not any(t.is_alive() for t in [*threads, keeper])
    expected = {f"w{n}-{i}": 1000 + i for n in range(6) for i in range(150) if i % 3}
    live = store.get_replicas(list(expected))
    assert_disjoint(r for got in live for r in got.replicas)
    store.close(snapshot=False)

    store = ObjectStore(StoreOptions(client_ttl_s=FOREVER_S), data_dir=tmp_path)
    for name in ("a", "b", "c"):
        store.mount_segment("owner", seg(name, length=8 * MiB))
    assert store.stats()["keys"] == len(expected)
    assert store.get_sizes(list(expected)) == list(expected.values())
    restored = store.get_replicas(list(expected))
    assert [[spans(g.replicas)] for g in restored] == [[spans(g.replicas)] for g in live]
    store.close()
