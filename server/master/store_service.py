"""The gRPC `Master` service: a thin skin over an ObjectStore (server/master/store.py).

Outcomes travel as ErrorCode values inside the replies (one per key in batch calls), so
a call only fails as a call when something is wrong with the call itself. `StoreCalls`
maps each request message to the store and back, for both front ends: this gRPC
servicer and the call endpoint (server/master/store_rpc_server.py). Calls that cannot block
run inline on the event loop (no thread hop); with a data dir, calls that may wait for
an fsync, and those that scan every key, run in worker threads so the event loop keeps
serving (the registry on the same server included).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from typing import Any

import grpc

from hixl.errors import HixlError, ParamInvalid
from hixl.server.master.store import ObjectStore
from hixl.store_codes import ErrorCode
from hixl.store_types import (
    PutStartResult,
    ReserveResult,
    key_info_to_pb,
    replica_config_from_pb,
    replica_to_pb,
    store_segment_from_pb,
    store_segment_to_pb,
)
from hixl.v1 import store_pb2, store_pb2_grpc

log = logging.getLogger("hixl.store")

UPKEEP_EVERY_S = 0.1
#: how long a PutStart that finds no room while segments await their owners'
#: remount (a master switch or restart) waits for the remount when its caller's deadline
#: is not known (the call endpoint carries none): within a client's default 5 s master
#: timeout, and the caller that gave up meanwhile is noticed (Hold.caller_gone)
REMOUNT_HOLD_S = 3.0
#: what a held call keeps of its caller's known deadline (gRPC) to answer before it
HOLD_MARGIN_S = 0.25
#: the code a put held for a remount is answered with once its hold ran out
AWAITING_REMOUNT = ErrorCode.REPLICA_IS_NOT_READY


@dataclass(frozen=True)
class Hold:
    """How long an allocating call (PutStart, Reserve) may wait for segments awaiting
    their remount: until `until` (monotonic), and only while `caller_gone()` is False."""

    until: float
    caller_gone: Callable[[], bool] = lambda: False

    @classmethod
    def for_deadline(cls, left: float | None,
                     caller_gone: Callable[[], bool] = lambda: False) -> Hold:
        """A hold that ends before a caller's deadline `left` s from now (None: not known,
        REMOUNT_HOLD_S)."""
        if left is None:
            return cls(time.monotonic() + REMOUNT_HOLD_S, caller_gone)
        return cls(time.monotonic() + max(0.0, left - min(HOLD_MARGIN_S, left / 10)),
                   caller_gone)


def awaiting_remount_text(awaiting: int, total: int) -> str:
    """Why a held put failed, in words."""
    return (f"segments awaiting remount after a master switch or restart ({awaiting} of "
            f"{total}); their holders remount within a heartbeat: retry")


@dataclass
class _Allocation:
    """One PutStart or Reserve being served, in rounds (`StoreCalls._rounds`):
    `run(todo)` asks the store for the items at indices `todo` and returns their results;
    `no_room(result)` is True for a result a remount could change; `give_up(result,
    text)` is the answer for one held past its hold (or not held: `may_wait` False);
    `reply(results)` the reply."""

    method: str
    count: int
    run: Callable[[list[int]], list[Any]]
    no_room: Callable[[Any], bool]
    give_up: Callable[[Any, str], Any]
    reply: Callable[[list[Any]], Any]
    may_wait: bool = True


class StoreCalls:
    """Request message -> ObjectStore call -> reply message, one method per Master RPC.

    The one place that maps the wire to the store, shared by both front ends: the gRPC
    servicer (`MasterServicer`) and the call endpoint (`hixl.server.master.store_rpc_server`),
    which passes the same store_pb2 messages. Each method is plain and blocking; it may
    wait for the journal's fsync when the store is persistent (`MAY_BLOCK`).
    Thread-safe: the store is, and the tally takes a lock.
    """

    #: methods that may wait for the disk (an fsync) with a persistent store, or scan
    #: every key: never run on the event loop then
    MAY_BLOCK = frozenset({"MountSegment", "UnmountSegment", "PutStart", "PutEnd",
                           "Remove", "RemoveByRegex", "RemoveAll", "ListKeys", "Reserve",
                           "Commit"})
    #: ... which allocate space: they wait out the start fence (docs/store.md §2)
    ALLOCATING = frozenset({"PutStart", "Reserve"})
    #: ... which remove or replace values: they wait out clients' location caches
    #: (docs/store.md §3), persistent or not
    CACHE_WAITS = frozenset({"PutEnd", "Commit", "Remove", "UnmountSegment"})
    #: ... of which these always scan every key, persistent or not
    SCANS = frozenset({"RemoveByRegex", "RemoveAll", "ListKeys"})
    #: allocating methods served in rounds across a remount (docs/store.md §6): they take
    #: a `hold` (front ends pass their caller's deadline); PutStart waits within it for
    #: segments awaiting their remount when nothing else has room, Reserve is answered
    #: at once then (AWAITING_REMOUNT: the client falls back to PutStart)
    HOLDING = frozenset({"PutStart", "Reserve"})

    def __init__(self, store: ObjectStore) -> None:
        self._fence_until = 0.0
        self.store = store
        #: the call endpoint's port, advertised in Heartbeat and MountSegment replies
        self.fast_port = 0
        #: (RPC, ErrorCode) -> keys (or calls, for whole-call results) answered so, for
        #: metrics; from both front ends
        self.results: dict[tuple[str, int], int] = {}
        self._tally_lock = threading.Lock()
        self.handlers: dict[str, Callable[[Any], Any]] = {
            "MountSegment": self.mount_segment, "UnmountSegment": self.unmount_segment,
            "Heartbeat": self.heartbeat, "PutStart": self.put_start, "PutEnd": self.put_end,
            "PutRevoke": self.put_revoke, "GetReplicas": self.get_replicas,
            "ExistKey": self.exist_key, "GetSize": self.get_size, "Remove": self.remove,
            "RemoveByRegex": self.remove_by_regex, "RemoveAll": self.remove_all,
            "ListSegments": self.list_segments, "Stats": self.stats,
            "ListKeys": self.list_keys, "Reserve": self.reserve, "Commit": self.commit,
            "Release": self.release}

    @property
    def store(self) -> ObjectStore:
        return self._store

    @store.setter
    def store(self, store: ObjectStore) -> None:
        """Serve `store` from now on. A store that may have had a predecessor allocates
        nothing for its start fence from now: the predecessor's reservations may still
        be written until then (docs/store.md §2)."""
        self._store = store
        self._fence_until = time.monotonic() + store.start_fence_s()

    def fence_left(self) -> float:
        """Seconds until allocations are safe on the store served (0: now)."""
        return max(0.0, self._fence_until - time.monotonic())

    def _wait_fence(self) -> None:
        left = self.fence_left()
        if left:
            time.sleep(left)

    def blocks(self, method: str) -> bool:
        """True when `method` may block (disk, a scan of every key, or the start fence)
        on this store."""
        return (method in self.SCANS or method in self.CACHE_WAITS
                or (method in self.MAY_BLOCK and self.store.persistent)
                or (method in self.ALLOCATING and self.fence_left() > 0))

    def _tally(self, method: str, codes: Iterable[int]) -> None:
        keys = [(method, int(code)) for code in codes]
        with self._tally_lock:
            results = self.results
            for key in keys:
                results[key] = results.get(key, 0) + 1

    def mount_segment(self, request: store_pb2.MountSegmentRequest,
                      ) -> store_pb2.MountSegmentReply:
        result = self.store.mount_segment(request.client_id,
                                          store_segment_from_pb(request.segment))
        self._tally("MountSegment", (result.code,))
        return store_pb2.MountSegmentReply(code=result.code, message=result.message,
                                           restored_objects=result.objects,
                                           fast_port=self.fast_port)

    def unmount_segment(self, request: store_pb2.UnmountSegmentRequest,
                        ) -> store_pb2.UnmountSegmentReply:
        result = self.store.unmount_segment(request.client_id, request.engine,
                                            request.segment_id)
        self._tally("UnmountSegment", (result.code,))
        return store_pb2.UnmountSegmentReply(code=result.code, message=result.message,
                                             dropped_objects=result.objects)

    def heartbeat(self, request: store_pb2.HeartbeatRequest) -> store_pb2.HeartbeatReply:
        result = self.store.heartbeat(request.client_id)  # never touches the disk
        return store_pb2.HeartbeatReply(status=int(result.status),
                                        client_ttl_ms=result.client_ttl_ms,
                                        fast_port=self.fast_port)

    # -- allocating calls, held across a remount ----------------------------------------

    def _rounds(self, job: _Allocation, hold: Hold,
                ) -> Generator[tuple[Any, ...], Any, list[Any]]:
        """Serve `job` in rounds: run it; while some items found no room and segments
        await their owners' remount (a master switch or restart: their space is the
        pool's), wait for the segments to change and run those items again, until
        `hold` ends. Yields ("run", todo), to be sent the results, and ("wait", store,
        version, seconds); returns the results. An item still without room when the hold
        ends is answered with `job.give_up` (AWAITING_REMOUNT and why); once no segment
        awaits a remount, NO_AVAILABLE_HANDLE stands (the pool is full)."""
        results: list[Any] = [None] * job.count
        todo = list(range(job.count))
        held = False
        while True:
            store = self.store
            version = store.segments_version()
            got = yield ("run", todo)
            for index, result in zip(todo, got, strict=True):
                results[index] = result
            todo = [index for index in todo if job.no_room(results[index])]
            if not todo:
                break
            awaiting, total = store.remount_pending()
            if not awaiting:
                break
            left = hold.until - time.monotonic() if job.may_wait else 0.0
            if left <= 0 or hold.caller_gone():
                text = awaiting_remount_text(awaiting, total)
                for index in todo:
                    results[index] = job.give_up(results[index], text)
                if job.may_wait:
                    store.count_remount_hold(timed_out=True)
                    log.warning("%s of %d item(s) failed: %s", job.method, len(todo), text)
                break
            if not held:
                held = True
                store.count_remount_hold(timed_out=False)
                log.info("%s of %d item(s) held: no room while %d of %d segment(s) await "
                         "their remount (up to %.2f s)", job.method, len(todo), awaiting,
                         total, left)
            yield ("wait", store, version, left)
            if hold.caller_gone():  # nobody reads the answer: allocate nothing more
                break
        return results

    def _serve(self, job: _Allocation, hold: Hold | None) -> Any:
        """`job` to its reply, on this thread (it may wait: fence, disk, a remount)."""
        self._wait_fence()
        rounds = self._rounds(job, hold or Hold.for_deadline(None))
        try:
            step = next(rounds)
            while True:
                if step[0] == "run":
                    step = rounds.send(job.run(step[1]))
                else:
                    _, store, version, left = step
                    store.wait_segments_changed(version, left)
                    step = next(rounds)
        except StopIteration as done:
            return job.reply(done.value)

    async def serve_async(self, method: str, request: Any, hold: Hold) -> Any:
        """A HOLDING method's reply on the event loop: its store calls run inline or in a
        worker thread as `blocks` says, and its waits (the fence, a remount) are awaited,
        so a held call occupies no thread."""
        job = self._allocation(method, request)
        if not isinstance(job, _Allocation):
            return job  # refused before reaching the store
        fence = self.fence_left()
        if fence:
            await asyncio.sleep(fence)
        rounds = self._rounds(job, hold)
        try:
            step = next(rounds)
            while True:
                if step[0] == "run":
                    todo = step[1]
                    got = (await asyncio.to_thread(job.run, todo)
                           if self.store.persistent else job.run(todo))
                    step = rounds.send(got)
                else:
                    _, store, version, left = step
                    await _segments_changed(store, version, left)
                    step = next(rounds)
        except StopIteration as done:
            return job.reply(done.value)

    def _allocation(self, method: str, request: Any) -> _Allocation | Any:
        """The job serving `request` (a HOLDING method's), or its reply when the request
        is refused before reaching the store."""
        if method == "PutStart":
            return self._put_start_job(request)
        if method == "Reserve":
            return self._reserve_job(request)
        raise ValueError(f"{method} is not an allocating call")

    def _put_start_job(self, request: store_pb2.PutStartRequest,
                       ) -> _Allocation | store_pb2.PutStartReply:
        items = [(item.key, item.value_length) for item in request.items]
        try:
            config = replica_config_from_pb(request.config)
        except ParamInvalid as exc:
            log.debug("put start refused: %s", exc)
            self._tally("PutStart", (ErrorCode.INVALID_PARAMS for _ in items))
            return store_pb2.PutStartReply(results=[
                store_pb2.PutStartResult(code=ErrorCode.INVALID_PARAMS) for _ in items])

        def run(todo: list[int]) -> list[Any]:
            return self.store.put_start(request.client_id, [items[i] for i in todo], config,
                                        node_id=request.node_id, upsert=request.upsert)

        def reply(results: list[PutStartResult]) -> store_pb2.PutStartReply:
            self._tally("PutStart", (r.code for r in results))
            return store_pb2.PutStartReply(results=[
                store_pb2.PutStartResult(code=r.code, put_id=r.put_id,
                                         replicas=[replica_to_pb(p) for p in r.replicas])
                for r in results])

        return _Allocation("PutStart", len(items), run,
                           lambda r: r.code == ErrorCode.NO_AVAILABLE_HANDLE,
                           lambda r, text: PutStartResult(AWAITING_REMOUNT), reply)

    def put_start(self, request: store_pb2.PutStartRequest, hold: Hold | None = None,
                  ) -> store_pb2.PutStartReply:
        """`hold`: how long items finding no room may wait for segments awaiting their
        remount (None: REMOUNT_HOLD_S)."""
        job = self._put_start_job(request)
        return self._serve(job, hold) if isinstance(job, _Allocation) else job

    def put_end(self, request: store_pb2.PutEndRequest) -> store_pb2.CodesReply:
        codes = self.store.put_end(request.client_id,
                                   [(p.key, p.put_id) for p in request.puts],
                                   reads_done=request.reads_done)
        self._tally("PutEnd", codes)
        return store_pb2.CodesReply(codes=codes)

    def _reserve_job(self, request: store_pb2.ReserveRequest,
                     ) -> _Allocation | store_pb2.ReserveReply:
        try:
            config = replica_config_from_pb(request.config)
        except ParamInvalid as exc:
            self._tally("Reserve", (ErrorCode.INVALID_PARAMS,))
            return store_pb2.ReserveReply(code=ErrorCode.INVALID_PARAMS, message=str(exc))
        release = list(request.release)

        def run(todo: list[int]) -> list[Any]:
            result = self.store.reserve(request.client_id, config, node_id=request.node_id,
                                        want_bytes=request.bytes, release=release)
            release.clear()  # released in the first round
            return [result]

        def reply(results: list[ReserveResult]) -> store_pb2.ReserveReply:
            [result] = results
            self._tally("Reserve", (result.code,))
            return store_pb2.ReserveReply(
                code=result.code, message=result.message, lease_ttl_ms=result.lease_ttl_ms,
                reservations=[store_pb2.Reservation(reservation_id=r.reservation_id,
                                                    space=replica_to_pb(r.space))
                              for r in result.reservations])

        # Not held: a client may write a reservation only until its Reserve's *send* time
        # plus three quarters of the lease (docs/store.md §2), so one granted after a wait
        # of that long is stale on arrival. Answered at once, the client puts two-phase,
        # and that PutStart is held for the remount.
        return _Allocation("Reserve", 1, run,
                           lambda r: r.code == ErrorCode.NO_AVAILABLE_HANDLE,
                           lambda r, text: ReserveResult(AWAITING_REMOUNT, message=text),
                           reply, may_wait=False)

    def reserve(self, request: store_pb2.ReserveRequest, hold: Hold | None = None,
                ) -> store_pb2.ReserveReply:
        """Never held for a remount (see _reserve_job): with segments awaiting their
        remount and no room elsewhere, AWAITING_REMOUNT and why, at once. `hold` is
        accepted as put_start's, for the front ends' sake."""
        job = self._reserve_job(request)
        return self._serve(job, hold) if isinstance(job, _Allocation) else job

    def commit(self, request: store_pb2.CommitRequest) -> store_pb2.CodesReply:
        try:
            config = replica_config_from_pb(request.config)
        except ParamInvalid as exc:
            log.debug("commit refused: %s", exc)
            codes = [int(ErrorCode.INVALID_PARAMS)] * len(request.items)
        else:
            codes = self.store.commit(
                request.client_id,
                [(item.key, item.value_length,
                  [(r.reservation_id, r.addr, r.length) for r in item.ranges])
                 for item in request.items], config, upsert=request.upsert,
                reads_done=request.reads_done)
        self._tally("Commit", codes)
        return store_pb2.CodesReply(codes=codes)

    def release(self, request: store_pb2.ReleaseRequest) -> store_pb2.CodesReply:
        codes = self.store.release(request.client_id, list(request.reservation_ids))
        self._tally("Release", codes)
        return store_pb2.CodesReply(codes=codes)

    def put_revoke(self, request: store_pb2.PutEndRequest) -> store_pb2.CodesReply:
        codes = self.store.put_revoke(request.client_id,
                                      [(p.key, p.put_id) for p in request.puts])
        self._tally("PutRevoke", codes)
        return store_pb2.CodesReply(codes=codes)

    def get_replicas(self, request: store_pb2.KeysRequest) -> store_pb2.GetReplicasReply:
        results = self.store.get_replicas(list(request.keys), cache=request.cache,
                                          client_id=request.client_id)
        self._tally("GetReplicas", (r.code for r in results))
        return store_pb2.GetReplicasReply(results=[
            store_pb2.GetReplicasResult(code=r.code, size=r.size, lease_ttl_ms=r.lease_ttl_ms,
                                        cache_ttl_ms=r.cache_ttl_ms,
                                        replicas=[replica_to_pb(p) for p in r.replicas])
            for r in results])

    def exist_key(self, request: store_pb2.KeysRequest) -> store_pb2.CodesReply:
        codes = self.store.exist_keys(list(request.keys))
        self._tally("ExistKey", codes)
        return store_pb2.CodesReply(codes=codes)

    def get_size(self, request: store_pb2.KeysRequest) -> store_pb2.GetSizeReply:
        sizes = self.store.get_sizes(list(request.keys), lease=True)
        self._tally("GetSize", (min(size, ErrorCode.OK) for size in sizes))  # a size is OK
        return store_pb2.GetSizeReply(sizes=sizes)

    def remove(self, request: store_pb2.RemoveRequest) -> store_pb2.CodesReply:
        codes = self.store.remove(list(request.keys), force=request.force,
                                  reader=request.client_id)
        self._tally("Remove", codes)
        return store_pb2.CodesReply(codes=codes)

    def remove_by_regex(self, request: store_pb2.RemoveByRegexRequest,
                        ) -> store_pb2.CountReply:
        result = self.store.remove_by_regex(request.regex, force=request.force)
        self._tally("RemoveByRegex", (result.code,))
        return store_pb2.CountReply(code=result.code, count=result.count,
                                    message=result.message)

    def remove_all(self, request: store_pb2.RemoveAllRequest) -> store_pb2.CountReply:
        result = self.store.remove_all(force=request.force)
        self._tally("RemoveAll", (result.code,))
        return store_pb2.CountReply(code=result.code, count=result.count,
                                    message=result.message)

    def list_segments(self, request: store_pb2.ListStoreSegmentsRequest,
                      ) -> store_pb2.ListStoreSegmentsReply:
        return store_pb2.ListStoreSegmentsReply(segments=[
            store_pb2.MountedSegment(segment=store_segment_to_pb(m.segment),
                                     client_id=m.client_id, live=m.live, used=m.used)
            for m in self.store.list_segments()])

    def stats(self, request: store_pb2.StoreStatsRequest) -> store_pb2.StoreStatsReply:
        # start_fence_s: how long allocating calls still wait for the start fence (§2)
        return store_pb2.StoreStatsReply(stats={**self.store.stats(),
                                                "start_fence_s": self.fence_left()})

    def list_keys(self, request: store_pb2.ListKeysRequest) -> store_pb2.ListKeysReply:
        listing = self.store.list_keys(request.regex, request.limit)
        return store_pb2.ListKeysReply(
            code=listing.code, message=listing.message, total=listing.total,
            truncated=listing.truncated, keys=[key_info_to_pb(k) for k in listing.keys])


async def _segments_changed(store: ObjectStore, version: int, timeout: float) -> None:
    """Wait on the event loop until `store`'s segments changed since `version`, or
    `timeout` s."""
    loop = asyncio.get_running_loop()
    changed = asyncio.Event()

    def wake() -> None:  # from the thread that changed them, under the store's lock
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(changed.set)

    store.add_segment_listener(wake)
    try:
        if store.segments_version() == version:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), max(0.0, timeout))
    finally:
        store.remove_segment_listener(wake)


def _rpc(name: str) -> Callable[..., Any]:
    """The servicer method for RPC `name`: StoreCalls' handler, on the event loop when it
    cannot block, in a worker thread when it may (fsync, or a scan of every key). An
    allocating call (HOLDING) is held on the event loop within its deadline."""
    async def serve(self: MasterServicer, request: Any,
                    context: grpc.aio.ServicerContext) -> Any:
        calls = self.calls
        if name in calls.HOLDING:
            return await calls.serve_async(name, request,
                                           Hold.for_deadline(context.time_remaining()))
        handler = calls.handlers[name]
        if calls.blocks(name):
            return await asyncio.to_thread(handler, request)
        return handler(request)

    serve.__name__ = serve.__qualname__ = name
    return serve


class MasterServicer(store_pb2_grpc.MasterServicer):
    """The gRPC front end of StoreCalls: no mapping or store logic here."""

    def __init__(self, store: ObjectStore, calls: StoreCalls | None = None) -> None:
        self.calls = calls or StoreCalls(store)

    @property
    def results(self) -> dict[tuple[str, int], int]:
        return self.calls.results

    MountSegment = _rpc("MountSegment")
    UnmountSegment = _rpc("UnmountSegment")
    Heartbeat = _rpc("Heartbeat")
    PutStart = _rpc("PutStart")
    PutEnd = _rpc("PutEnd")
    PutRevoke = _rpc("PutRevoke")
    GetReplicas = _rpc("GetReplicas")
    ExistKey = _rpc("ExistKey")
    GetSize = _rpc("GetSize")
    Remove = _rpc("Remove")
    RemoveByRegex = _rpc("RemoveByRegex")
    RemoveAll = _rpc("RemoveAll")
    ListSegments = _rpc("ListSegments")
    Stats = _rpc("Stats")
    ListKeys = _rpc("ListKeys")
    Reserve = _rpc("Reserve")
    Commit = _rpc("Commit")
    Release = _rpc("Release")


class UpkeepFailures:
    """How failed upkeep passes are logged, so an outage is one line, not one per pass.

    A HixlError is expected while the metadata backend is unreachable (etcd without a
    quorum: every pass's wait for durability fails, ten times a second): it is logged
    once, then every `repeat_s` while it lasts, and its end once. Any other exception is
    a bug and is logged with its traceback every time.
    """

    def __init__(self, repeat_s: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 ) -> None:
        self.repeat_s = repeat_s
        self._clock = clock
        self.failing = 0          # consecutive expected failures
        self._said_at = 0.0

    def failed(self, exc: BaseException) -> None:
        if not isinstance(exc, HixlError):
            log.error("store upkeep pass failed", exc_info=exc)
            return
        now = self._clock()
        self.failing += 1
        if self.failing == 1 or now - self._said_at >= self.repeat_s:
            self._said_at = now
            log.warning("store upkeep: %s (%d pass(es) failed so far; retrying, said again "
                        "every %g s while it lasts)", exc, self.failing, self.repeat_s)

    def passed(self) -> None:
        if self.failing:
            log.info("store upkeep works again after %d failed pass(es)", self.failing)
            self.failing = 0


async def upkeep_forever(store: ObjectStore, interval_s: float = UPKEEP_EVERY_S) -> None:
    """Run the store's periodic upkeep (expiries, eviction, snapshots) in a worker thread."""
    failures = UpkeepFailures()
    while True:
        await asyncio.sleep(interval_s)
        try:
            await asyncio.to_thread(store.tick)
        except Exception as exc:  # a bug here must not stop upkeep for good
            failures.failed(exc)
        else:
            failures.passed()


def add_store_service(server: grpc.aio.Server, store: ObjectStore,
                      calls: StoreCalls | None = None) -> MasterServicer:
    """Serve `store` as the Master service on `server` (start upkeep with upkeep_forever);
    returns the servicer (its `results` feed the metrics). Pass the `calls` the call
    endpoint serves too, so both front ends share one tally."""
    servicer = MasterServicer(store, calls)
    store_pb2_grpc.add_MasterServicer_to_server(servicer, server)
    return servicer


__all__ = ["AWAITING_REMOUNT", "Hold", "MasterServicer", "REMOUNT_HOLD_S", "StoreCalls",
           "UPKEEP_EVERY_S", "add_store_service", "awaiting_remount_text", "upkeep_forever"]
