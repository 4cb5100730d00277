"""The Agent gRPC service: a thin async adapter over the `Agent` domain object.

Each method converts protobuf to domain calls and back; every HixlError leaves through
`control.abort_with`, so clients get the precise exception type. Calls that map or
populate memory (allocate, register) run in a worker thread so the event loop keeps
serving other RPCs meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from hixl.control import abort_with, segment_to_pb
from hixl.errors import HixlError, ParamInvalid
from hixl.server.agent.agent import ADDED, Agent
from hixl.server.agent.data_server import Peer
from hixl.server.agent.fd_server import TicketBook
from hixl.types import Perm, SegmentInfo
from hixl.v1 import agent_pb2, agent_pb2_grpc

log = logging.getLogger("hixl.grpc")

PROTOCOL_VERSION = 1
_WATCH_QUEUE_LIMIT = 4096

_T = TypeVar("_T")


@dataclass(frozen=True)
class Endpoints:
    """Where this agent serves, as told to clients in the handshake."""

    engine: str
    data_tcp: str
    data_unix: str
    fd_socket: str


@dataclass(frozen=True)
class RegistryState:
    """Where the agent publishes its table and how that goes (Health's `registry`)."""

    mode: str = "none"            # "embedded", "master" or "none"
    target: str = ""              # the master's address
    published: bool = False       # held under a lease now
    lease_id: int = 0
    failures: int = 0             # consecutive failed attempts
    last_error: str = ""
    last_success_age_s: float = -1.0  # -1: never
    engines: int = 0              # embedded registry: engines held
    segments: int = 0             # embedded registry: segments held


class AgentServicer(agent_pb2_grpc.AgentServicer):
    """Agent RPCs over one `Agent`; `extra_counters` adds e.g. the data server's counters,
    `peers` and `registry_state` what Health reports of connections and publishing."""

    def __init__(self, agent: Agent, endpoints: Endpoints, tickets: TicketBook,
                 extra_counters: Callable[[], dict[str, int]] = dict,
                 peers: Callable[[], list[Peer]] = list,
                 registry_state: Callable[[], RegistryState] = RegistryState) -> None:
        self._agent = agent
        self._endpoints = endpoints
        self._tickets = tickets
        self._extra_counters = extra_counters
        self._peers = peers
        self._registry_state = registry_state
        self._started = time.monotonic()
        self._stopping = asyncio.Event()
        self.watchers = 0
        self._watch_peers: dict[int, tuple[str, float]] = {}  # stream -> (peer, since)

    def stop_watches(self) -> None:
        """End every WatchSegments stream (called on the serving loop at shutdown)."""
        self._stopping.set()

    async def Handshake(self, request: agent_pb2.HandshakeRequest,
                        context: grpc.aio.ServicerContext) -> agent_pb2.HandshakeReply:
        if request.version and request.version != PROTOCOL_VERSION:
            await abort_with(context, ParamInvalid(
                f"client {request.client_engine or '?'} speaks control protocol "
                f"{request.version}; this agent speaks {PROTOCOL_VERSION}"))
        agent, ends = self._agent, self._endpoints
        log.debug("handshake from %s", request.client_engine or context.peer())
        return agent_pb2.HandshakeReply(
            version=PROTOCOL_VERSION, engine=ends.engine, node_id=agent.node_id,
            fabric_domain=agent.node_id, epoch=agent.epoch, data_tcp=ends.data_tcp,
            data_unix=ends.data_unix, fd_socket=ends.fd_socket,
            segments=[segment_to_pb(s) for s in agent.segments()])

    async def ListSegments(self, request: agent_pb2.ListSegmentsRequest,
                           context: grpc.aio.ServicerContext) -> agent_pb2.ListSegmentsReply:
        return agent_pb2.ListSegmentsReply(
            epoch=self._agent.epoch, segments=[segment_to_pb(s) for s in self._agent.segments()])

    async def WatchSegments(self, request: agent_pb2.WatchSegmentsRequest,
                            context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[agent_pb2.SegmentEvent]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, list[SegmentInfo]] | None] = asyncio.Queue()

        def push(item: tuple[str, list[SegmentInfo]] | None) -> None:
            if queue.qsize() >= _WATCH_QUEUE_LIMIT:
                # a watcher this far behind is dropped; it reconnects and gets a snapshot
                with contextlib.suppress(asyncio.QueueEmpty):
                    while True:
                        queue.get_nowait()
                item = None
            queue.put_nowait(item)

        def listener(kind: str, segments: list[SegmentInfo]) -> None:
            with contextlib.suppress(RuntimeError):  # loop closed at shutdown
                loop.call_soon_threadsafe(push, (kind, segments))

        snapshot = self._agent.subscribe(listener)
        self.watchers += 1
        watch_id = id(asyncio.current_task())
        self._watch_peers[watch_id] = (context.peer(), time.monotonic())
        epoch = self._agent.epoch
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            yield agent_pb2.SegmentEvent(kind=agent_pb2.SegmentEvent.SNAPSHOT, epoch=epoch,
                                         segments=[segment_to_pb(s) for s in snapshot])
            while True:
                getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getter, stopping},
                                             return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    return
                item = getter.result()
                if item is None:
                    await abort_with(context, HixlError(
                        "segment watch fell too far behind; watch again for a fresh snapshot"))
                    return
                kind, segments = item
                pb_kind = (agent_pb2.SegmentEvent.ADDED if kind == ADDED
                           else agent_pb2.SegmentEvent.REMOVED)
                yield agent_pb2.SegmentEvent(kind=pb_kind, epoch=epoch,
                                             segments=[segment_to_pb(s) for s in segments])
        finally:
            stopping.cancel()
            self.watchers -= 1
            self._watch_peers.pop(watch_id, None)
            self._agent.unsubscribe(listener)

    async def AllocateSegment(self, request: agent_pb2.AllocateSegmentRequest,
                              context: grpc.aio.ServicerContext) -> agent_pb2.SegmentReply:
        try:
            perms = _perms(request.perms)
            info = await asyncio.to_thread(self._agent.allocate, request.size, perms,
                                           request.name, request.owner,
                                           allowed_engines=list(request.allowed_engines))
            key = self._agent.release_key(info.segment_id)
        except HixlError as exc:
            await abort_with(context, exc)
        return agent_pb2.SegmentReply(segment=segment_to_pb(info), release_key=key)

    async def RegisterSegment(self, request: agent_pb2.RegisterSegmentRequest,
                              context: grpc.aio.ServicerContext) -> agent_pb2.SegmentReply:
        try:
            perms = _perms(request.perms)
            fd, deposited = self._tickets.take(request.fd_ticket)
            try:
                length = request.length or deposited
                if length > deposited:
                    raise ParamInvalid(
                        f"register: length {length} exceeds the {deposited} bytes deposited")
                info = await asyncio.to_thread(self._agent.register_fd, fd, length, perms,
                                               request.name, request.owner,
                                               allowed_engines=list(request.allowed_engines))
            finally:
                os.close(fd)  # the agent keeps its own duplicate
            key = self._agent.release_key(info.segment_id)
        except HixlError as exc:
            await abort_with(context, exc)
        return agent_pb2.SegmentReply(segment=segment_to_pb(info), release_key=key)

    async def DeregisterSegment(self, request: agent_pb2.DeregisterSegmentRequest,
                                context: grpc.aio.ServicerContext
                                ) -> agent_pb2.DeregisterSegmentReply:
        try:
            # epochs are never 0, so 0 (the proto default) means "not given"
            self._agent.deregister(request.segment_id, request.epoch or None,
                                   release_key=request.release_key)
        except HixlError as exc:
            await abort_with(context, exc)
        return agent_pb2.DeregisterSegmentReply()

    async def Health(self, request: agent_pb2.HealthRequest,
                     context: grpc.aio.ServicerContext) -> agent_pb2.HealthReply:
        counters = self._agent.counters()
        now = time.monotonic()
        peers = [*self._collect(self._peers, []),
                 *(Peer("watch", peer, "", now - since)
                   for peer, since in list(self._watch_peers.values()))]
        registry = self._collect(self._registry_state, RegistryState())
        return agent_pb2.HealthReply(
            status="SERVING", engine=self._endpoints.engine, node_id=self._agent.node_id,
            epoch=self._agent.epoch, uptime_s=now - self._started,
            segments=counters["segments"], segment_bytes=counters["segment_bytes"],
            peers=[agent_pb2.Peer(kind=p.kind, address=p.address, identity=p.identity,
                                  connected_s=p.connected_s) for p in peers],
            registry=agent_pb2.RegistryState(
                mode=registry.mode, target=registry.target, published=registry.published,
                lease_id=registry.lease_id, failures=registry.failures,
                last_error=registry.last_error,
                last_success_age_s=registry.last_success_age_s,
                engines=registry.engines, segments=registry.segments))

    @staticmethod
    def _collect(source: Callable[[], _T], fallback: _T) -> _T:
        """Health must answer even when one of its sources fails."""
        try:
            return source()
        except Exception:  # noqa: BLE001 - logged; the rest of Health still answers
            log.exception("collecting health details failed")
            return fallback

    async def Stats(self, request: agent_pb2.StatsRequest,
                    context: grpc.aio.ServicerContext) -> agent_pb2.StatsReply:
        counters = self._agent.counters()
        counters["watchers"] = self.watchers
        counters["fd_tickets_pending"] = len(self._tickets)
        try:
            counters.update(self._extra_counters())
        except Exception:  # noqa: BLE001 - stats must not fail because one source did
            log.exception("collecting counters failed")
        return agent_pb2.StatsReply(
            counters={k: int(v) for k, v in counters.items() if isinstance(v, int) and v >= 0})


def _perms(raw: int) -> Perm:
    """Wire permissions: 0 means read-write (proto default), else bit 0 read, bit 1 write."""
    if raw == 0:
        return Perm.RW
    if raw & ~int(Perm.RW):
        raise ParamInvalid(f"unknown permission bits {raw:#x}: use 1 (read), 2 (write), 3 (rw)")
    return Perm(raw)
