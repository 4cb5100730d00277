"""Blocking client of the Registry service (hixl-master, or a registry embedded in an agent).

Every unary call has a deadline, so a dead or wedged master turns into a typed error
instead of a hang; the watch stream pings the server so a vanished master ends it too.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grpc

from hixl.control import error_from_rpc, segment_from_pb, segment_to_pb
from hixl.errors import ParamInvalid
from hixl.types import SegmentInfo
from hixl.v1 import agent_pb2, agent_pb2_grpc

#: Ping an open watch stream every 10 s and give up 5 s after an unanswered ping, so a
#: master that disappears without closing its sockets still ends the stream.
CLIENT_KEEPALIVE_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
]

_KIND_NAMES = {value: name for name, value in agent_pb2.SegmentEvent.Kind.items()}


class RegistryClient:
    """publish / keepalive / unpublish / query / watch against one registry server."""

    def __init__(self, target: str, *, timeout: float = 5.0) -> None:
        if timeout <= 0:
            raise ParamInvalid(f"registry client timeout must be positive, got {timeout}")
        self.target = target
        self.timeout = timeout
        self._channel = grpc.insecure_channel(target, options=CLIENT_KEEPALIVE_OPTIONS)
        self._stub = agent_pb2_grpc.RegistryStub(self._channel)

    def _deadline(self, timeout: float | None) -> float:
        return self.timeout if timeout is None else timeout

    def publish(self, engine: str, node_id: str, epoch: int, segments: Sequence[SegmentInfo],
                ttl_ms: int, timeout: float | None = None) -> int:
        """Publish `engine`'s whole table under a lease; returns the lease id."""
        request = agent_pb2.PublishRequest(
            engine=engine, node_id=node_id, epoch=epoch, ttl_ms=ttl_ms,
            segments=[segment_to_pb(s) for s in segments])
        try:
            reply = self._stub.Publish(request, timeout=self._deadline(timeout))
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, f"publish {engine!r} to registry {self.target}") from None
        return reply.lease_id

    def keepalive(self, lease_id: int, timeout: float | None = None) -> int:
        """Extend the lease; returns its ttl in ms. NotConnected once it has expired."""
        try:
            reply = self._stub.KeepAlive(agent_pb2.KeepAliveRequest(lease_id=lease_id),
                                         timeout=self._deadline(timeout))
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, f"keepalive of lease {lease_id} at registry "
                                      f"{self.target}") from None
        return reply.ttl_ms

    def unpublish(self, lease_id: int, timeout: float | None = None) -> None:
        try:
            self._stub.Unpublish(agent_pb2.UnpublishRequest(lease_id=lease_id),
                                 timeout=self._deadline(timeout))
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, f"unpublish of lease {lease_id} at registry "
                                      f"{self.target}") from None

    def query(self, engine: str = "", timeout: float | None = None) -> list[SegmentInfo]:
        """Segments of one engine ("" = every engine)."""
        try:
            reply = self._stub.QuerySegments(agent_pb2.QuerySegmentsRequest(engine=engine),
                                             timeout=self._deadline(timeout))
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, f"query of registry {self.target}") from None
        return [segment_from_pb(pb) for pb in reply.segments]

    def watch(self, timeout: float | None = None,
              ) -> Iterator[tuple[str, int, list[SegmentInfo]]]:
        """Yield (kind name, epoch, segments): "SNAPSHOT" first, then "ADDED"/"REMOVED".

        The stream has no deadline unless `timeout` is given (it is meant to stay open);
        a dead master still ends it through the channel's keepalive pings. Closing the
        iterator (or the client) cancels the stream.
        """
        call = self._stub.Watch(agent_pb2.WatchRegistryRequest(), timeout=timeout)
        try:
            for event in call:
                yield (_KIND_NAMES.get(event.kind, str(event.kind)), event.epoch,
                       [segment_from_pb(pb) for pb in event.segments])
        except grpc.RpcError as exc:
            raise error_from_rpc(exc, f"watch of registry {self.target}") from None
        finally:
            call.cancel()

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
