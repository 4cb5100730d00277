"""Clients of one agent: its gRPC Agent service, and its unix fd socket.

`AgentClient` is blocking (a sync gRPC channel); every call has a deadline and failures
raise the agent's own exception class (via hixl.control.error_from_rpc), or
PeerUnavailable / TransferTimeout when the agent is gone or silent.

`FdClient` keeps one SOCK_SEQPACKET connection to the agent's fd socket: it fetches
segment fds to map (fabric path), deposits fds for registration, and answers `alive()`
(a zero-timeout poll for hang-up). A mapped transfer does not ask it: it reads the agent's
life word instead, a load (hixl.segment_states).
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Any

import grpc

from hixl import fd_wire
from hixl.auth import as_token
from hixl.control import error_class, error_from_rpc, open_channel, segment_from_pb
from hixl.errors import (
    HixlError,
    NotConnected,
    ParamInvalid,
    PeerUnavailable,
    TransferTimeout,
    error_for_status,
)
from hixl.memory import FdGrant
from hixl.segment_states import StateView
from hixl.tls import TlsSetting
from hixl.types import Perm, SegmentInfo, check_allowed_engines
from hixl.v1 import agent_pb2, agent_pb2_grpc
from hixl.wrong_server import AGENT
from hixl.wrong_server import wrong_server as wrong_server_as

PROTOCOL_VERSION = 1


def wrong_server(rpc: grpc.RpcError, error: HixlError, target: str) -> HixlError:
    """`error`, or WrongServer saying what `target` turned out to be, when the call
    reached something other than an agent's gRPC port: a server not speaking gRPC at all
    (an agent's data port), or one without the Agent service (a hixl-master)."""
    return wrong_server_as(rpc, error, target, AGENT, what_of(str(error)))


def what_of(text: str) -> str:
    """'<call> at agent <target>' from an error's text '[CODE n] <call> at agent ...: ...'."""
    body = text.split("] ", 1)[-1]
    return body.split(": ", 1)[0]

#: ping idle channels (watch streams) so a vanished agent ends them, not hangs them
CHANNEL_OPTIONS: list[tuple[str, int]] = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.http2.max_pings_without_data", 0),
]

_KIND_NAMES = {value: name for name, value in agent_pb2.SegmentEvent.Kind.items()}


@dataclass(frozen=True)
class AgentInfo:
    """What an agent said in the handshake: who it is and where its data paths are."""

    engine: str
    node_id: str
    fabric_domain: str
    epoch: int
    data_tcp: str
    data_unix: str
    fd_socket: str
    segments: list[SegmentInfo]


class AgentClient:
    """Blocking client of one agent's Agent service.

    With a `cluster_token`, every call proves it (hixl.auth); an agent that has a token
    refuses calls without it with AuthenticationFailed. `tls`: a hixl.tls.ClientTLS to
    dial with TLS, False for plaintext, None as HIXL_TLS_CA_FILE (and friends) say.
    """

    def __init__(self, target: str, *, timeout: float = 5.0,
                 cluster_token: str | bytes | None = None, tls: TlsSetting = None) -> None:
        if not timeout or timeout <= 0:
            raise ParamInvalid(f"agent client timeout must be positive, got {timeout}")
        self.target = target
        self.timeout = timeout
        self._channel, channel = open_channel(target, token=as_token(cluster_token), tls=tls,
                                              options=CHANNEL_OPTIONS)
        self._stub = agent_pb2_grpc.AgentStub(channel)
        # (segment id, epoch) -> the release key of each segment this client created
        self._release_keys: dict[tuple[int, int], bytes] = {}
        self._keys_lock = threading.Lock()

    def _call(self, method: str, request: Any, what: str, timeout: float | None) -> Any:
        try:
            return getattr(self._stub, method)(
                request, timeout=self.timeout if timeout is None else timeout)
        except grpc.RpcError as exc:
            raise wrong_server(exc, error_from_rpc(exc, f"{what} at agent {self.target}"),
                               self.target) from None

    def handshake(self, client_engine: str, timeout: float | None = None) -> AgentInfo:
        reply = self._call("Handshake", agent_pb2.HandshakeRequest(
            version=PROTOCOL_VERSION, client_engine=client_engine), "handshake", timeout)
        return AgentInfo(
            engine=reply.engine, node_id=reply.node_id, fabric_domain=reply.fabric_domain,
            epoch=reply.epoch, data_tcp=reply.data_tcp, data_unix=reply.data_unix,
            fd_socket=reply.fd_socket, segments=[segment_from_pb(s) for s in reply.segments])

    def list_segments(self, timeout: float | None = None) -> tuple[int, list[SegmentInfo]]:
        """(agent epoch, its segments)."""
        reply = self._call("ListSegments", agent_pb2.ListSegmentsRequest(), "list segments",
                           timeout)
        return reply.epoch, [segment_from_pb(s) for s in reply.segments]

    def allocate(self, size: int, perms: Perm = Perm.RW, name: str = "", owner: str = "",
                 timeout: float | None = None, *, allowed_engines: Any = ()) -> SegmentInfo:
        """A new shm segment in the agent's pool (it stays until deregistered);
        `allowed_engines`: the engines that may reach it (empty: every engine)."""
        if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
            raise ParamInvalid(f"allocate: size must be a positive integer, got {size!r}")
        reply = self._call("AllocateSegment", agent_pb2.AllocateSegmentRequest(
            size=size, perms=int(_perm(perms)), name=name, owner=owner,
            allowed_engines=check_allowed_engines(allowed_engines)),
            f"allocate {size} bytes", timeout)
        return self._created(reply)

    def register_fd(self, fd: int, length: int, fd_socket: str, perms: Perm = Perm.RW,
                    name: str = "", owner: str = "", timeout: float | None = None, *,
                    allowed_engines: Any = ()) -> SegmentInfo:
        """Have the agent serve the memfd `fd` (deposited over `fd_socket`, then registered);
        `allowed_engines`: the engines that may reach it (empty: every engine)."""
        allowed = check_allowed_engines(allowed_engines)  # before the fd is deposited
        with FdClient(fd_socket, timeout=self.timeout if timeout is None else timeout) as fdc:
            ticket = fdc.deposit(fd, length)
        reply = self._call("RegisterSegment", agent_pb2.RegisterSegmentRequest(
            fd_ticket=ticket, length=length, perms=int(_perm(perms)), name=name, owner=owner,
            allowed_engines=allowed), f"register {length} bytes", timeout)
        return self._created(reply)

    def _created(self, reply: Any) -> SegmentInfo:
        """A segment this client created: its release key is kept for `deregister`."""
        segment = segment_from_pb(reply.segment)
        with self._keys_lock:
            self._release_keys[(segment.segment_id, segment.epoch)] = reply.release_key
        return segment

    def deregister(self, segment_id: int, epoch: int, timeout: float | None = None) -> None:
        """Withdraw a segment this client allocated or registered (the agent checks the
        release key it gave this client; any other segment is PermissionDenied)."""
        with self._keys_lock:
            key = self._release_keys.get((segment_id, epoch), b"")
        self._call("DeregisterSegment", agent_pb2.DeregisterSegmentRequest(
            segment_id=segment_id, epoch=epoch, release_key=key),
            f"deregister segment {segment_id}", timeout)
        with self._keys_lock:
            self._release_keys.pop((segment_id, epoch), None)

    def health(self, timeout: float | None = None) -> dict[str, Any]:
        """status, engine, node_id, epoch, uptime_s, segments, segment_bytes, peers (list
        of {kind, address, identity, connected_s}) and registry (how publishing goes)."""
        reply = self._call("Health", agent_pb2.HealthRequest(), "health", timeout)
        reg = reply.registry
        return {"status": reply.status, "engine": reply.engine, "node_id": reply.node_id,
                "epoch": reply.epoch, "uptime_s": reply.uptime_s, "segments": reply.segments,
                "segment_bytes": reply.segment_bytes,
                "peers": [{"kind": p.kind, "address": p.address, "identity": p.identity,
                           "connected_s": p.connected_s} for p in reply.peers],
                "registry": {"mode": reg.mode, "target": reg.target,
                             "published": reg.published, "lease_id": reg.lease_id,
                             "failures": reg.failures, "last_error": reg.last_error,
                             "last_success_age_s": reg.last_success_age_s,
                             "engines": reg.engines, "segments": reg.segments}}

    def stats(self, timeout: float | None = None) -> dict[str, int]:
        reply = self._call("Stats", agent_pb2.StatsRequest(), "stats", timeout)
        return dict(reply.counters)

    def watch(self, timeout: float | None = None) -> SegmentWatch:
        """Iterate ("SNAPSHOT" | "ADDED" | "REMOVED", epoch, segments), snapshot first.

        Runs until the agent goes away (raises PeerUnavailable), `timeout` seconds pass
        (None: no limit; then raises TransferTimeout), or `close()` is called on the
        returned iterator (from any thread; iteration then just ends).
        """
        call = self._stub.WatchSegments(agent_pb2.WatchSegmentsRequest(), timeout=timeout)
        return SegmentWatch(call, f"watch segments at agent {self.target}")

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> AgentClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SegmentWatch:
    """An agent's segment-change stream; `close()` (any thread) ends the iteration."""

    def __init__(self, call: Any, what: str) -> None:
        self._call = call
        self._what = what
        self._closed = False

    def __iter__(self) -> SegmentWatch:
        return self

    def __next__(self) -> tuple[str, int, list[SegmentInfo]]:
        if self._closed:
            raise StopIteration
        try:
            event = next(self._call)
        except grpc.RpcError as exc:
            if self._closed:
                raise StopIteration from None
            raise error_from_rpc(exc, self._what) from None
        return (_KIND_NAMES.get(event.kind, str(event.kind)), event.epoch,
                [segment_from_pb(s) for s in event.segments])

    def close(self) -> None:
        self._closed = True
        self._call.cancel()

    def __enter__(self) -> SegmentWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _perm(perms: Perm) -> Perm:
    if isinstance(perms, bool) or not isinstance(perms, int) or int(perms) & ~int(Perm.RW) \
            or not perms:
        raise ParamInvalid(f"perms must be Perm.READ, Perm.WRITE or Perm.RW, got {perms!r}")
    return Perm(perms)


# ---------------------------------------------------------------- fd socket

_TIMEVAL = struct.Struct("ll")


_HANGUP = select.POLLHUP | select.POLLRDHUP | select.POLLERR | select.POLLNVAL


class FdClient:
    """One SOCK_SEQPACKET connection to an agent's fd socket (thread-safe).

    `engine`: the name of the engine asking, sent with each fd request (a segment with an
    allow-list hands its fd only to the engines it names).
    """

    def __init__(self, path: str, *, timeout: float = 5.0, engine: str = "") -> None:
        if not timeout or timeout <= 0:
            raise ParamInvalid(f"fd client timeout must be positive, got {timeout}")
        self.path = path
        self.timeout = timeout
        self.engine = engine
        self._lock = threading.Lock()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        # Kernel-level timeouts keep the socket in blocking mode, so alive()'s MSG_DONTWAIT
        # peek is a single syscall with no poll() in front of it.
        seconds = int(timeout)
        tv = _TIMEVAL.pack(seconds, int((timeout - seconds) * 1e6))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        try:
            sock.connect(path)
        except OSError as exc:
            sock.close()
            if exc.errno in (errno.ENOENT, errno.ECONNREFUSED, errno.ENOTDIR):
                raise NotConnected(
                    f"no agent fd socket at {path}: {exc.strerror} (agent not running, "
                    "or on another node?)") from None
            if exc.errno in (errno.EACCES, errno.EPERM):
                raise NotConnected(
                    f"agent fd socket {path}: {exc.strerror} (socket_mode / allowed_uids)"
                ) from None
            if exc.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
                raise TransferTimeout(f"agent fd socket {path}: connect timed out") from None
            raise PeerUnavailable(f"agent fd socket {path}: connect failed: {exc}") from None
        self._sock: socket.socket | None = sock
        # alive() asks the kernel whether the agent hung up: one zero-timeout poll()
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN | select.POLLRDHUP)

    # ------------------------------------------------------------ operations

    def fetch(self, segment_id: int, epoch: int, writable: bool) -> tuple[int, int]:
        """(fd, length) of a segment to map; the caller closes the fd (see `grant`)."""
        grant = self.grant(segment_id, epoch, writable)
        return grant.fd, grant.length

    def grant(self, segment_id: int, epoch: int, writable: bool) -> FdGrant:
        """What it takes to map a segment: an fd (the caller closes it), the segment's
        length, its offset in that file and its liveness slot (`states`).

        A read-only request gets an O_RDONLY fd; a write request on a read-only segment,
        or one from an engine the segment's allow-list does not name, raises
        PermissionDenied; unknown segments ParamInvalid; stale epochs StaleEpoch.
        """
        reply, fds = self._request(
            fd_wire.GetFd(segment_id, epoch, bool(writable), self.engine),
            f"fetch fd of segment {segment_id}")
        assert isinstance(reply, fd_wire.FdGranted)
        return FdGrant(fds[0], reply.length, reply.offset, reply.slot)

    def states(self) -> StateView:
        """A read-only view of the agent's segment liveness words (one fetch, one mmap)."""
        reply, fds = self._request(fd_wire.GetStates(), "fetch segment states")
        assert isinstance(reply, fd_wire.StatesGranted)
        try:
            return StateView(fds[0], reply.capacity)
        finally:
            os.close(fds[0])

    def deposit(self, fd: int, length: int) -> str:
        """Hand `fd` to the agent (it gets its own copy); returns a ticket for RegisterSegment."""
        reply, _ = self._request(fd_wire.Deposit(length), "deposit fd", send_fd=fd)
        assert isinstance(reply, fd_wire.Deposited)
        return reply.ticket

    def ping(self) -> dict[str, Any]:
        """{"ok": True, "epoch": E, "engine": "host:port"} of the agent serving the socket."""
        reply, _ = self._request(fd_wire.Ping(), "ping")
        assert isinstance(reply, fd_wire.Pong)
        return {"ok": True, "epoch": reply.epoch, "engine": reply.engine}

    def fileno(self) -> int:
        """The fd socket's descriptor, -1 once closed (for a C check of what alive() asks)."""
        sock = self._sock
        return -1 if sock is None else sock.fileno()

    def alive(self) -> bool:
        """True while the agent end is open: no round trip, about a microsecond.

        A zero-timeout poll() for hang-up on the connection (a dead agent's kernel closes
        it); if another thread is polling at the same moment, one non-blocking MSG_PEEK.
        """
        sock = self._sock
        if sock is None:
            return False
        try:
            events = self._poll.poll(0)
        except RuntimeError:  # concurrent poll() on this object from another thread
            pass
        else:
            if not events:  # the usual answer: nothing happened on the connection
                return True
            return not any(mask & _HANGUP for _, mask in events)
        try:
            data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return True  # nothing to read: the peer is there and quiet
        except OSError:
            return False
        return bool(data)  # b"" is end-of-file: the agent closed (or died)

    def close(self) -> None:
        with self._lock:
            sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def __enter__(self) -> FdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------ internals

    def _request(self, request: fd_wire.Request, what: str, send_fd: int | None = None
                 ) -> tuple[fd_wire.Reply, list[int]]:
        """Send `request`, return its granted reply and exactly the fds that reply
        carries (the caller owns them; extras are closed here); raises the agent's
        error for a Refused, PeerUnavailable for a malformed reply."""
        payload = fd_wire.encode_request(request)
        with self._lock:
            sock = self._sock
            if sock is None:
                raise NotConnected(f"{what}: the fd socket client for {self.path} is closed")
            try:
                if send_fd is None:
                    sock.send(payload)
                else:
                    socket.send_fds(sock, [payload], [send_fd])
                data, fds, flags, _ = socket.recv_fds(sock, fd_wire.MAX_REPLY,
                                                      fd_wire.MAX_FDS_PER_MESSAGE)
            except (BlockingIOError, TimeoutError):
                self._broken()
                raise TransferTimeout(
                    f"{what}: agent fd socket {self.path} did not answer within "
                    f"{self.timeout} s") from None
            except OSError as exc:
                self._broken()
                raise PeerUnavailable(f"{what}: agent fd socket {self.path}: {exc}") from None
        if not data:
            _close_all(fds)
            self._broken()
            raise PeerUnavailable(f"{what}: agent fd socket {self.path} closed the connection "
                                  "(agent stopped or died)")
        try:
            reply = fd_wire.decode_reply(data, request, len(fds))
        except fd_wire.MalformedReply as exc:
            _close_all(fds)
            if exc.args[0] == fd_wire.NOT_JSON:
                raise PeerUnavailable(
                    f"{what}: agent fd socket {self.path} sent a malformed reply") from None
            if flags & socket.MSG_CTRUNC:
                raise HixlError(f"{what}: fds were truncated (out of file descriptors?)"
                                ) from None
            raise PeerUnavailable(f"agent fd socket {self.path}: {exc.args[0]}") from None
        if flags & socket.MSG_CTRUNC:
            _close_all(fds)
            raise HixlError(f"{what}: fds were truncated (out of file descriptors?)")
        if isinstance(reply, fd_wire.Refused):
            _close_all(fds)
            raise _reply_error(reply, what)
        _close_all(fds[reply.fds:])
        return reply, fds[:reply.fds]

    def _broken(self) -> None:
        """After a timeout or I/O error the request/reply pairing is lost: drop the socket."""
        sock, self._sock = self._sock, None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.close()


def _reply_error(reply: fd_wire.Refused, what: str) -> HixlError:
    message = f"{what}: {reply.error}"
    cls = error_class(reply.kind)
    if cls is not None:
        return cls(message, status=reply.status)
    return error_for_status(503900 if reply.status is None else reply.status, message)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)
