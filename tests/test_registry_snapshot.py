"""The registry's compact snapshot path: SegmentColumns on the wire, bulk decode, caching.

A watcher that asks for columns (`WatchRegistryRequest.columns`, the default of
`RegistryClient.open_watch`) must see exactly what a watcher of one `Segment` message per
segment sees: every segment once, every field right, as a true SegmentInfo value. Bad
input is refused by name, and a lease's cached wire form never outlives its table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from hixl.client.global_table import GlobalTable
from hixl.control import (
    add_segments,
    segment_from_pb,
    segment_to_pb,
    segments_from_columns,
    segments_to_columns,
)
from hixl.errors import ParamInvalid
from hixl.registry_client import EngineEndpoints, RegistryClient, RegistryWatch
from hixl.server.registry import SNAPSHOT_CHUNK, EventKind, Registry, RegistryEvent, events_to_pb
from hixl.tools.daemons import MasterProcess
from hixl.types import MemType, Perm, SegmentInfo
from hixl.v1 import agent_pb2

pytestmark = pytest.mark.timeout(120)

GIVE_UP_S = 30.0  # only a guard against a hang
TTL_MS = 30_000


def segment(engine: str, number: int, *, epoch: int = 1, node: str = "node-1") -> SegmentInfo:
    """Segments whose fields all vary with `number`, so a field mixed up shows."""
    return SegmentInfo(segment_id=number + 1, engine=engine, node_id=node,
                       base=(1 << 40) + (number << 20), length=4096 + number,
                       mem_type=MemType(number % 2), perms=Perm(number % 4), epoch=epoch,
                       shareable=number % 3 == 0, name=f"seg-{number}-é" if number % 5 else "")


def table_of(engine: str, count: int, **kwargs: object) -> list[SegmentInfo]:
    return [segment(engine, n, **kwargs) for n in range(count)]  # type: ignore[arg-type]


def assert_same_value(decoded: SegmentInfo, original: SegmentInfo) -> None:
    """Equal, equally hashed, the same fields and field types, and still frozen."""
    assert type(decoded) is SegmentInfo
    assert decoded == original and hash(decoded) == hash(original)
    assert dataclasses.asdict(decoded) == dataclasses.asdict(original)
    assert type(decoded.mem_type) is MemType and type(decoded.perms) is Perm
    assert decoded.end == original.end
    with pytest.raises(dataclasses.FrozenInstanceError):
        decoded.base = 0  # type: ignore[misc]


class ListCall:
    """Stands in for a gRPC stream's call object: yields prepared messages."""

    def __init__(self, messages: list[agent_pb2.SegmentEvent]) -> None:
        self._messages = iter(messages)

    def __next__(self) -> agent_pb2.SegmentEvent:
        return next(self._messages)

    def cancel(self) -> None:
        pass


def decode(messages: list[agent_pb2.SegmentEvent]):  # noqa: ANN201 - a WatchEvent
    return next(RegistryWatch(ListCall(messages), "test watch"))


# ---------------------------------------------------------------- codec


def test_columns_round_trip_every_field_in_order() -> None:
    segments = [*table_of("a:1", 23), *table_of("b:1", 5, epoch=7, node="node-2"),
                segment("b:1", 99, epoch=7, node="node-3"), *table_of("a:1", 3, epoch=2)]
    blocks = segments_to_columns(segments)
    # one block per run of (engine, node, epoch)
    assert [(b.engine, b.node_id, b.epoch, len(b.segment_id)) for b in blocks] == [
        ("a:1", "node-1", 1, 23), ("b:1", "node-2", 7, 5), ("b:1", "node-3", 7, 1),
        ("a:1", "node-1", 2, 3)]
    wire = [agent_pb2.SegmentColumns.FromString(b.SerializeToString()) for b in blocks]
    decoded = [s for block in wire for s in segments_from_columns(block)]
    assert len(decoded) == len(segments)
    for got, want in zip(decoded, segments, strict=True):
        assert_same_value(got, want)


def test_columns_split_every_chunk_segments() -> None:
    segments = table_of("a:1", 23)
    blocks = segments_to_columns(segments, chunk=10)
    assert [len(b.segment_id) for b in blocks] == [10, 10, 3]
    assert [s for b in blocks for s in segments_from_columns(b)] == segments
    assert segments_to_columns([]) == []


def test_segment_from_pb_makes_the_same_value() -> None:
    for original in table_of("a:1", 12):
        assert_same_value(segment_from_pb(segment_to_pb(original)), original)


def test_add_segments_builds_what_segment_to_pb_builds() -> None:
    segments = table_of("a:1", 12)
    reply = agent_pb2.QuerySegmentsReply()
    add_segments(reply.segments, segments)
    assert list(reply.segments) == [segment_to_pb(s) for s in segments]


@pytest.mark.parametrize("field, value, problem", [
    ("mem_type", 7, "segment 3: unknown mem_type 7"),
    ("perms", 4, "segment 3: unknown permission bits 0x4"),
])
def test_values_outside_the_enums_are_refused_by_name(field: str, value: int,
                                                      problem: str) -> None:
    pb = segment_to_pb(segment("a:1", 2))
    setattr(pb, field, value)
    with pytest.raises(ParamInvalid, match=problem):
        segment_from_pb(pb)
    (block,) = segments_to_columns(table_of("a:1", 4))
    getattr(block, field)[2] = value
    with pytest.raises(ParamInvalid, match=problem):
        segments_from_columns(block)


@pytest.mark.parametrize("column", ["base", "length", "mem_type", "perms", "shareable",
                                    "name"])
def test_a_short_column_is_refused_not_cut_short(column: str) -> None:
    (block,) = segments_to_columns(table_of("a:1", 4))
    del getattr(block, column)[-1]
    with pytest.raises(ParamInvalid, match="columns of unequal lengths"):
        segments_from_columns(block)


# ---------------------------------------------------------------- the registry's messages


def published_registry() -> tuple[Registry, list[SegmentInfo]]:
    registry = Registry()
    tables = {"a:1": table_of("a:1", 7), "b:1": table_of("b:1", 12, epoch=3),
              "c:1": [], "d:1": table_of("d:1", 4)}
    for engine, segments in tables.items():
        epoch = segments[0].epoch if segments else 1
        registry.publish(engine, "node-1", epoch, segments, TTL_MS)
    return registry, [s for engine in sorted(tables) for s in tables[engine]]


@pytest.mark.parametrize("chunk", [1, 5, 7, 12, 13, SNAPSHOT_CHUNK])
def test_a_column_snapshot_delivers_every_segment_once(chunk: int) -> None:
    registry, segments = published_registry()
    snapshot = registry.subscribe(engines=True).get(timeout=0)
    messages = list(events_to_pb(snapshot, chunk, columns=True))
    assert all(not m.segments for m in messages)  # columns only
    assert all(m.more for m in messages[:-1]) and not messages[-1].more
    assert [len(m.engines) for m in messages] == [4] + [0] * (len(messages) - 1)
    for message in messages:
        assert sum(len(b.segment_id) for b in message.columns) <= chunk
    event = decode(messages)
    assert event.kind == "SNAPSHOT" and [e.engine for e in event.engines] == [
        "a:1", "b:1", "c:1", "d:1"]
    assert event.segments == segments == registry.query()
    # and the classic form carries exactly the same
    assert decode(list(events_to_pb(snapshot, chunk))).segments == segments


def test_an_empty_column_snapshot_is_one_message() -> None:
    (message,) = events_to_pb(Registry().subscribe().get(timeout=0), columns=True)
    assert (message.kind, message.more, len(message.columns)) == (EventKind.SNAPSHOT, False, 0)


def test_changes_go_as_columns_too() -> None:
    registry, _ = published_registry()
    subscription = registry.subscribe()
    subscription.get(timeout=0)
    table = table_of("a:1", 9)
    registry.publish("a:1", "node-1", 1, table[2:], TTL_MS)
    for want_kind, want in (("REMOVED", table[:2]), ("ADDED", table[7:])):
        event = subscription.get(timeout=0)
        (message,) = events_to_pb(event, columns=True)
        assert not message.segments
        decoded = decode([message])
        assert (decoded.kind, decoded.segments) == (want_kind, want)


def test_a_cached_snapshot_encoding_never_outlives_its_table() -> None:
    registry, _ = published_registry()

    def snapshot_columns() -> list[agent_pb2.SegmentColumns]:
        event = registry.subscribe().get(timeout=0)
        return [b for m in events_to_pb(event, columns=True) for b in m.columns]

    def snapshot_event() -> RegistryEvent:
        return registry.subscribe().get(timeout=0)

    first, again = snapshot_event(), snapshot_event()
    # each lease's table is encoded once and then shared by every snapshot
    assert [p.columns(SNAPSHOT_CHUNK) for p in first.published] == [
        p.columns(SNAPSHOT_CHUNK) for p in again.published]
    assert all(a.columns(SNAPSHOT_CHUNK) is b.columns(SNAPSHOT_CHUNK)
               for a, b in zip(first.published, again.published, strict=True))
    before = snapshot_columns()
    registry.publish("a:1", "node-1", 1, table_of("a:1", 8), TTL_MS)  # a new table
    after = snapshot_columns()
    assert len(after[0].segment_id) == 8 and len(before[0].segment_id) == 7
    assert decode(list(events_to_pb(snapshot_event(), columns=True))).segments == \
        registry.query()


# ---------------------------------------------------------------- over gRPC


@pytest.fixture(scope="module")
def master() -> Iterator[MasterProcess]:
    with MasterProcess() as process:
        yield process


def test_both_wire_forms_bring_the_same_snapshot_and_changes(master: MasterProcess) -> None:
    """Through a real hixl-master: a snapshot over several messages, then changes."""
    ends = EngineEndpoints(fabric_domain="node-1", data_tcp="10.0.0.1:7000")
    tables = {"big:1": table_of("big:1", SNAPSHOT_CHUNK + 100),
              "mid:1": table_of("mid:1", SNAPSHOT_CHUNK // 2, epoch=4),
              "none:1": []}
    with RegistryClient(master.target, timeout=GIVE_UP_S) as client:
        leases = {engine: client.publish(engine, "node-1", segments[0].epoch if segments else 1,
                                         segments, TTL_MS, endpoints=ends)
                  for engine, segments in tables.items()}
        expected = client.query()
        assert len(expected) == SNAPSHOT_CHUNK + 100 + SNAPSHOT_CHUNK // 2
        compact = client.open_watch(columns=True, timeout=GIVE_UP_S)
        classic = client.open_watch(columns=False, timeout=GIVE_UP_S)
        try:
            snapshots = [next(compact), next(classic)]
            for snapshot in snapshots:
                assert snapshot.kind == "SNAPSHOT"
                assert snapshot.segments == expected
                assert len({(s.engine, s.segment_id) for s in snapshot.segments}) == len(expected)
                assert {e.engine: e.endpoints for e in snapshot.engines} == dict.fromkeys(
                    tables, ends)
            for got, want in zip(snapshots[0].segments, expected, strict=True):
                assert_same_value(got, want)
            grown = [*tables["mid:1"], segment("mid:1", 5_000, epoch=4)]
            client.publish("mid:1", "node-1", 4, grown[1:], TTL_MS, endpoints=ends)
            for stream in (compact, classic):
                assert [(e.kind, e.segments) for e in (next(stream), next(stream))] == [
                    ("REMOVED", grown[:1]), ("ADDED", grown[-1:])]
        finally:
            compact.close()
            classic.close()
            for lease in leases.values():
                client.unpublish(lease)


def test_a_global_table_syncs_from_columns(master: MasterProcess) -> None:
    segments = table_of("gt:1", SNAPSHOT_CHUNK + 3, epoch=2)
    with RegistryClient(master.target, timeout=GIVE_UP_S) as client:
        lease = client.publish("gt:1", "node-1", 2, segments, TTL_MS)
        try:
            with GlobalTable(master.target, timeout=GIVE_UP_S) as table:
                assert table.wait_for(lambda t: len(t.segments("gt:1")) == len(segments),
                                      GIVE_UP_S)
                assert table.segments("gt:1") == segments
                last = segments[-1]
                assert table.find("gt:1", last.base + 10, 16) == last
        finally:
            client.unpublish(lease)
