"""Puts held across a master switch (issue 20 item 11), in process: a PutStart that finds
no room while segments await their owners' remount waits for the remount (within its
hold) instead of failing NO_AVAILABLE_HANDLE "the pool is full"; one whose hold runs out,
and a Reserve (never held), say what is happening (AWAITING_REMOUNT, "awaiting remount
... N of M").

The master-side pieces (`StoreCalls`, both front ends' paths: the blocking one the call
endpoint uses and the event-loop one of the gRPC servicer) on a persistent store restarted
over its data dir: its segments come back awaiting remount, as at a standby's takeover.
tests/test_master_switch_holds_puts.py runs the same on real masters on etcd.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import waiting

from hixl.server.master.store import ObjectStore, StoreOptions
from hixl.server.master.store_service import AWAITING_REMOUNT, Hold, StoreCalls
from hixl.store_codes import ErrorCode, code_name
from hixl.store_types import StoreSegment
from hixl.v1 import store_pb2

MiB = 1 << 20
WAIT_S = 30.0  # a bound on waiting for a state, never a measurement


def segment(engine: str = "holder:1", segment_id: int = 1) -> StoreSegment:
    return StoreSegment(engine, segment_id, 1, 0x7F00_0000_0000, 4 * MiB, "node-a",
                        name=f"{engine}#{segment_id}")


def options() -> StoreOptions:
    # a short start fence: a restarted store allocates nothing for reservation_ttl_ms
    return StoreOptions(reservation_ttl_ms=20, client_ttl_s=1e9)


@pytest.fixture
def restarted(tmp_path: Path) -> Iterator[ObjectStore]:
    """A persistent store whose one segment awaits its owner's remount (restarted)."""
    first = ObjectStore(options(), data_dir=tmp_path)
    assert first.mount_segment("holder", segment()).code == ErrorCode.OK
    first.close(snapshot=False)
    store = ObjectStore(options(), data_dir=tmp_path)
    assert store.remount_pending() == (1, 1)
    yield store
    store.close()


def put_start(*keys: str, size: int = 4096) -> store_pb2.PutStartRequest:
    return store_pb2.PutStartRequest(client_id="putter", items=[
        store_pb2.PutStartItem(key=key, value_length=size) for key in keys])


def reserve() -> store_pb2.ReserveRequest:
    return store_pb2.ReserveRequest(client_id="putter", bytes=MiB)


def held(store: ObjectStore, count: int = 1) -> None:
    """Wait until `count` calls are held for a remount (the store counts them)."""
    waiting.wait_until(lambda: store.stats()["puts_held_for_remount"] >= count,
                       f"{count} call(s) held for a remount", WAIT_S, interval=0.005)


def in_thread(call: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    return thread, out


def codes(reply: store_pb2.PutStartReply) -> list[str]:
    return [code_name(r.code) for r in reply.results]


def test_a_put_start_waits_for_the_remount_then_succeeds(restarted: ObjectStore) -> None:
    calls = StoreCalls(restarted)
    far = Hold(time.monotonic() + WAIT_S)
    thread, out = in_thread(lambda: calls.put_start(put_start("a", "b", "c"), far))
    held(restarted)
    assert thread.is_alive()
    assert restarted.mount_segment("holder", segment()).code == ErrorCode.OK
    thread.join(WAIT_S)
    [reply] = out
    assert codes(reply) == ["OK", "OK", "OK"]  # a batch: every item placed
    assert all(r.replicas for r in reply.results)
    stats = restarted.stats()
    assert stats["remount_holds"] == 1 and stats["remount_hold_timeouts"] == 0
    assert stats["puts_held_for_remount"] == 0
    assert calls.results == {("PutStart", 0): 3}


def test_a_reserve_is_answered_at_once_and_says_why(restarted: ObjectStore) -> None:
    """A reservation granted after a wait would be stale on arrival (the client writes one
    only until its Reserve's send time + 3/4 of the lease): Reserve is not held; the
    client's two-phase PutStart is. After the remount it is granted."""
    calls = StoreCalls(restarted)
    calls._fence_until = 0.0  # the fence is not what this is about
    reply = calls.reserve(reserve(), Hold(time.monotonic() + WAIT_S))
    assert reply.code == AWAITING_REMOUNT and not reply.reservations
    assert "awaiting remount after a master switch" in reply.message
    assert "(1 of 1)" in reply.message and "retry" in reply.message
    stats = restarted.stats()
    assert stats["remount_holds"] == stats["remount_hold_timeouts"] == 0
    restarted.mount_segment("holder", segment())
    reply = calls.reserve(reserve(), Hold(time.monotonic() + WAIT_S))
    assert reply.code == ErrorCode.OK and reply.reservations


def test_a_hold_that_runs_out_says_segments_await_their_remount(
        restarted: ObjectStore) -> None:
    calls = StoreCalls(restarted)
    calls._fence_until = 0.0  # the fence is not what this is about
    over = Hold(time.monotonic())
    reply = calls.put_start(put_start("a", "b"), over)
    assert codes(reply) == [AWAITING_REMOUNT.name] * 2
    assert AWAITING_REMOUNT != ErrorCode.NO_AVAILABLE_HANDLE
    reserved = calls.reserve(reserve(), over)
    assert reserved.code == AWAITING_REMOUNT
    stats = restarted.stats()
    assert stats["remount_hold_timeouts"] == 1 and stats["puts_in_progress"] == 0
    assert calls.results == {("PutStart", AWAITING_REMOUNT): 2,
                             ("Reserve", AWAITING_REMOUNT): 1}


def test_a_full_pool_is_still_no_available_handle_at_once(tmp_path: Path) -> None:
    """Nothing awaits a remount: no hold, whatever the caller's deadline."""
    store = ObjectStore(options(), data_dir=tmp_path)
    try:
        store.mount_segment("holder", segment())
        calls = StoreCalls(store)
        reply = calls.put_start(put_start("big", size=64 * MiB),
                                Hold(time.monotonic() + 3600))
        assert codes(reply) == ["NO_AVAILABLE_HANDLE"]
        assert store.stats()["remount_holds"] == 0
    finally:
        store.close()


def test_only_the_items_without_room_are_held(tmp_path: Path) -> None:
    """A live segment has room for the small item; the large one waits for the other
    segment's remount, and the small one is not placed twice."""
    first = ObjectStore(options(), data_dir=tmp_path)
    first.mount_segment("holder", segment())
    first.close(snapshot=False)
    store = ObjectStore(options(), data_dir=tmp_path)
    try:
        small = StoreSegment("other:1", 1, 1, 0x7E00_0000_0000, MiB, "node-a", name="other")
        store.mount_segment("other", small)
        calls = StoreCalls(store)
        request = store_pb2.PutStartRequest(client_id="putter", items=[
            store_pb2.PutStartItem(key="small", value_length=4096),
            store_pb2.PutStartItem(key="large", value_length=2 * MiB)])
        thread, out = in_thread(lambda: calls.put_start(request,
                                                        Hold(time.monotonic() + WAIT_S)))
        held(store)
        assert store.stats()["puts_in_progress"] == 1  # the small one, placed once
        store.mount_segment("holder", segment())
        thread.join(WAIT_S)
        [reply] = out
        assert codes(reply) == ["OK", "OK"]
        assert reply.results[1].replicas[0].engine == "holder:1"
        assert store.stats()["puts_in_progress"] == 2
    finally:
        store.close()


def test_a_caller_that_gave_up_gets_nothing_allocated(restarted: ObjectStore) -> None:
    calls = StoreCalls(restarted)
    gone = threading.Event()
    hold = Hold(time.monotonic() + WAIT_S, gone.is_set)
    thread, out = in_thread(lambda: calls.put_start(put_start("a"), hold))
    held(restarted)
    gone.set()
    restarted.mount_segment("holder", segment())
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert restarted.stats()["puts_in_progress"] == 0  # nothing left behind for nobody


def test_the_event_loop_path_holds_without_a_thread(restarted: ObjectStore) -> None:
    """The gRPC servicer's path: the wait is awaited on the loop; a remount from another
    thread wakes it."""
    calls = StoreCalls(restarted)

    async def scenario() -> tuple[Any, Any]:
        held_call = asyncio.ensure_future(calls.serve_async(
            "PutStart", put_start("a"), Hold(time.monotonic() + WAIT_S)))
        await asyncio.to_thread(held, restarted)
        await asyncio.to_thread(restarted.mount_segment, "holder", segment())
        reply = await asyncio.wait_for(held_call, WAIT_S)
        over = await calls.serve_async("Reserve", reserve(), Hold(time.monotonic()))
        return reply, over

    reply, reserved = asyncio.run(scenario())
    assert codes(reply) == ["OK"]
    assert reserved.code == ErrorCode.OK  # remounted: room now
    assert restarted.stats()["puts_held_for_remount"] == 0


def test_hold_for_a_known_deadline_answers_before_it() -> None:
    now = time.monotonic()
    hold = Hold.for_deadline(2.0)
    assert now < hold.until < now + 2.0
    assert Hold.for_deadline(0.0).until <= time.monotonic()
    unknown = Hold.for_deadline(None)
    assert unknown.until > now and not unknown.caller_gone()
