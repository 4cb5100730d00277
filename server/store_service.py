"""The gRPC `Master` service: a thin skin over an ObjectStore (server/store.py).

Outcomes travel as ErrorCode values inside the replies (one per key in batch calls), so
a call only fails as a call when something is wrong with the call itself. With a data
dir, store calls may wait for an fsync; they then run in worker threads so the event
loop keeps serving (the registry on the same server included).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Iterable
from typing import TypeVar

import grpc

from hixl.errors import ParamInvalid
from hixl.server.store import ObjectStore
from hixl.store_client import (
    key_info_to_pb,
    replica_config_from_pb,
    replica_to_pb,
    store_segment_from_pb,
    store_segment_to_pb,
)
from hixl.store_codes import ErrorCode
from hixl.v1 import store_pb2, store_pb2_grpc

log = logging.getLogger("hixl.store")

UPKEEP_EVERY_S = 0.1

_R = TypeVar("_R")


class MasterServicer(store_pb2_grpc.MasterServicer):
    """Convert, call the store, convert back; no store logic here."""

    def __init__(self, store: ObjectStore) -> None:
        self._store = store
        #: (RPC, ErrorCode) -> keys (or calls, for whole-call results) answered so, for
        #: metrics; bumped on the event loop's thread only
        self.results: dict[tuple[str, int], int] = {}

    def _tally(self, method: str, codes: Iterable[int]) -> None:
        results = self.results
        for code in codes:
            key = (method, int(code))
            results[key] = results.get(key, 0) + 1

    async def _run(self, fn: Callable[..., _R], *args: object, **kwargs: object) -> _R:
        """Call the store; in a worker thread when it may wait for the disk."""
        if not self._store.persistent:
            return fn(*args, **kwargs)
        return await asyncio.to_thread(functools.partial(fn, *args, **kwargs))

    async def MountSegment(self, request: store_pb2.MountSegmentRequest,
                           context: grpc.aio.ServicerContext) -> store_pb2.MountSegmentReply:
        result = await self._run(self._store.mount_segment, request.client_id,
                                 store_segment_from_pb(request.segment))
        self._tally("MountSegment", (result.code,))
        return store_pb2.MountSegmentReply(code=result.code, message=result.message,
                                           restored_objects=result.objects)

    async def UnmountSegment(self, request: store_pb2.UnmountSegmentRequest,
                             context: grpc.aio.ServicerContext,
                             ) -> store_pb2.UnmountSegmentReply:
        result = await self._run(self._store.unmount_segment, request.client_id,
                                 request.engine, request.segment_id)
        self._tally("UnmountSegment", (result.code,))
        return store_pb2.UnmountSegmentReply(code=result.code, message=result.message,
                                             dropped_objects=result.objects)

    async def Heartbeat(self, request: store_pb2.HeartbeatRequest,
                        context: grpc.aio.ServicerContext) -> store_pb2.HeartbeatReply:
        result = self._store.heartbeat(request.client_id)  # never touches the disk
        return store_pb2.HeartbeatReply(status=int(result.status),
                                        client_ttl_ms=result.client_ttl_ms)

    async def PutStart(self, request: store_pb2.PutStartRequest,
                       context: grpc.aio.ServicerContext) -> store_pb2.PutStartReply:
        items = [(item.key, item.value_length) for item in request.items]
        try:
            config = replica_config_from_pb(request.config)
        except ParamInvalid as exc:
            log.debug("put start refused: %s", exc)
            self._tally("PutStart", (ErrorCode.INVALID_PARAMS for _ in items))
            return store_pb2.PutStartReply(results=[
                store_pb2.PutStartResult(code=ErrorCode.INVALID_PARAMS) for _ in items])
        results = await self._run(self._store.put_start, request.client_id, items, config,
                                  node_id=request.node_id, upsert=request.upsert)
        self._tally("PutStart", (r.code for r in results))
        return store_pb2.PutStartReply(results=[
            store_pb2.PutStartResult(code=r.code, put_id=r.put_id,
                                     replicas=[replica_to_pb(p) for p in r.replicas])
            for r in results])

    async def PutEnd(self, request: store_pb2.PutEndRequest,
                     context: grpc.aio.ServicerContext) -> store_pb2.CodesReply:
        codes = await self._run(self._store.put_end, request.client_id,
                                [(p.key, p.put_id) for p in request.puts])
        self._tally("PutEnd", codes)
        return store_pb2.CodesReply(codes=codes)

    async def PutRevoke(self, request: store_pb2.PutEndRequest,
                        context: grpc.aio.ServicerContext) -> store_pb2.CodesReply:
        codes = self._store.put_revoke(request.client_id,
                                       [(p.key, p.put_id) for p in request.puts])
        self._tally("PutRevoke", codes)
        return store_pb2.CodesReply(codes=codes)

    async def GetReplicas(self, request: store_pb2.KeysRequest,
                          context: grpc.aio.ServicerContext) -> store_pb2.GetReplicasReply:
        results = self._store.get_replicas(list(request.keys))
        self._tally("GetReplicas", (r.code for r in results))
        return store_pb2.GetReplicasReply(results=[
            store_pb2.GetReplicasResult(code=r.code, size=r.size, lease_ttl_ms=r.lease_ttl_ms,
                                        replicas=[replica_to_pb(p) for p in r.replicas])
            for r in results])

    async def ExistKey(self, request: store_pb2.KeysRequest,
                       context: grpc.aio.ServicerContext) -> store_pb2.CodesReply:
        codes = self._store.exist_keys(list(request.keys))
        self._tally("ExistKey", codes)
        return store_pb2.CodesReply(codes=codes)

    async def GetSize(self, request: store_pb2.KeysRequest,
                      context: grpc.aio.ServicerContext) -> store_pb2.GetSizeReply:
        sizes = self._store.get_sizes(list(request.keys))
        self._tally("GetSize", (min(size, ErrorCode.OK) for size in sizes))  # a size is OK
        return store_pb2.GetSizeReply(sizes=sizes)

    async def Remove(self, request: store_pb2.RemoveRequest,
                     context: grpc.aio.ServicerContext) -> store_pb2.CodesReply:
        codes = await self._run(self._store.remove, list(request.keys), force=request.force)
        self._tally("Remove", codes)
        return store_pb2.CodesReply(codes=codes)

    async def RemoveByRegex(self, request: store_pb2.RemoveByRegexRequest,
                            context: grpc.aio.ServicerContext) -> store_pb2.CountReply:
        result = await self._run(self._store.remove_by_regex, request.regex,
                                 force=request.force)
        self._tally("RemoveByRegex", (result.code,))
        return store_pb2.CountReply(code=result.code, count=result.count,
                                    message=result.message)

    async def RemoveAll(self, request: store_pb2.RemoveAllRequest,
                        context: grpc.aio.ServicerContext) -> store_pb2.CountReply:
        result = await self._run(self._store.remove_all, force=request.force)
        self._tally("RemoveAll", (result.code,))
        return store_pb2.CountReply(code=result.code, count=result.count,
                                    message=result.message)

    async def ListSegments(self, request: store_pb2.ListStoreSegmentsRequest,
                           context: grpc.aio.ServicerContext,
                           ) -> store_pb2.ListStoreSegmentsReply:
        return store_pb2.ListStoreSegmentsReply(segments=[
            store_pb2.MountedSegment(segment=store_segment_to_pb(m.segment),
                                     client_id=m.client_id, live=m.live, used=m.used)
            for m in self._store.list_segments()])

    async def Stats(self, request: store_pb2.StoreStatsRequest,
                    context: grpc.aio.ServicerContext) -> store_pb2.StoreStatsReply:
        return store_pb2.StoreStatsReply(stats=self._store.stats())

    async def ListKeys(self, request: store_pb2.ListKeysRequest,
                       context: grpc.aio.ServicerContext) -> store_pb2.ListKeysReply:
        # a worker thread: matching a large store's keys must not stall the event loop
        listing = await asyncio.to_thread(self._store.list_keys, request.regex, request.limit)
        return store_pb2.ListKeysReply(
            code=listing.code, message=listing.message, total=listing.total,
            truncated=listing.truncated, keys=[key_info_to_pb(k) for k in listing.keys])


async def upkeep_forever(store: ObjectStore, interval_s: float = UPKEEP_EVERY_S) -> None:
    """Run the store's periodic upkeep (expiries, eviction, snapshots) in a worker thread."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await asyncio.to_thread(store.tick)
        except Exception:  # a bug here must not stop upkeep for good
            log.exception("store upkeep pass failed")


def add_store_service(server: grpc.aio.Server, store: ObjectStore) -> MasterServicer:
    """Serve `store` as the Master service on `server` (start upkeep with upkeep_forever);
    returns the servicer (its `results` feed the metrics)."""
    servicer = MasterServicer(store)
    store_pb2_grpc.add_MasterServicer_to_server(servicer, server)
    return servicer


__all__ = ["MasterServicer", "UPKEEP_EVERY_S", "add_store_service", "upkeep_forever"]
