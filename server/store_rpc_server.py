"""hixl-master's store call endpoint: the hot store calls over a plain socket.

The client side and the reasons are in `hixl.store_rpc`. One thread of blocking I/O per
connection (as the agent's data server): read a frame, check it with the sans-IO
`wire.CallServerProtocol` (handshake and cluster token first: nothing is served before
it), run the method through the same `StoreCalls` the gRPC servicer uses, send the
reply. The store's calls may wait for the journal's fsync; each connection waits on its
own thread, and concurrent commits share an fsync (the journal's group commit).

A call that fails as a call (a request that does not parse, an internal error, a
reply over wire.MAX_CALL) is answered with error text, logged once under the caller's
request id, and the connection stays open. Timeouts: a connection has `handshake_timeout`
s to authenticate, in a pre-auth budget apart from authenticated connections
(`hixl.server.connections`); an authenticated idle connection may wait for its next call
indefinitely; once a frame has begun, a stall longer than `io_timeout` closes it.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
from collections.abc import Callable

from google.protobuf.message import DecodeError

from hixl import wire
from hixl.errors import ConfigError, HixlError
from hixl.logs import request_context, valid_request_id
from hixl.server.connections import (
    HANDSHAKE_TIMEOUT_S,
    PREAUTH_CONNECTIONS,
    PeerGone,
    Stalled,
    ThreadPerConnection,
)
from hixl.server.leadership import Leadership
from hixl.server.store_service import StoreCalls
from hixl.store_rpc import MESSAGES, METHODS

log = logging.getLogger("hixl.store.rpc")

_RECEIVE = 64 << 10  # a connection's receive buffer: most calls arrive in one recv


class StoreCallServer(ThreadPerConnection):
    """Serves `METHODS` of `calls` on host:port (0: a free port) until stop().

    `leadership`: while its master does not lead (a standby, server/leadership.py), every
    CALL is answered with reason NOT_LEADER and the leader's address as text, unapplied.
    """

    log = log
    kind = "store call endpoint"
    connection_kind = "store call connection"
    thread_name = "hixl-store-rpc"
    failure_level = logging.WARNING

    def __init__(self, calls: StoreCalls, host: str = "127.0.0.1", port: int = 0, *,
                 cluster_token: bytes | None = None, max_connections: int = 1024,
                 io_timeout: float = 30.0, leadership: Leadership | None = None,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT_S,
                 preauth_connections: int = PREAUTH_CONNECTIONS,
                 start_thread: Callable[[threading.Thread], None] | None = None) -> None:
        self._calls = calls
        self._leadership = leadership
        self._host = host
        self._port = port
        self._token = cluster_token
        self._init_connections(max_connections, io_timeout,
                               handshake_timeout=handshake_timeout,
                               preauth_connections=preauth_connections,
                               start_thread=start_thread)
        #: connections accepted, turned away (over max_connections, or no thread could be
        #: started: thread_start_failures), closed in their handshake for a newer one
        #: (preauth_evicted) or for not authenticating in time (handshake_timeouts), closed
        #: for a bad frame or a stall, refused for a wrong or missing token; calls served
        self.counters = dict.fromkeys(("connections", "connections_rejected",
                                       "thread_start_failures", "preauth_evicted",
                                       "handshake_timeouts", "protocol_errors",
                                       "auth_failures", "calls"), 0)

    @property
    def port(self) -> int:
        """The port bound (after start)."""
        return self._port

    def start(self) -> None:
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self._host, self._port))
            sock.listen(128)
        except OSError as exc:
            sock.close()
            raise ConfigError(f"store call endpoint: cannot bind {self._host}:{self._port}: "
                              f"{exc.strerror or exc}") from None
        self._listeners.append(sock)
        self._port = sock.getsockname()[1]
        self._start_accepting()
        log.info("store call endpoint on %s:%d", self._host, self._port)

    def stop(self) -> None:
        """Close the listener and every connection; wait (bounded) for the threads."""
        self._stop_connections()

    def __enter__(self) -> StoreCallServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run_connection(self, sock: socket.socket, peer: object) -> None:
        _Connection(self, sock).run()


class _Connection:
    """The frame loop of one connection (in its own thread)."""

    def __init__(self, server: StoreCallServer, sock: socket.socket) -> None:
        self.server = server
        self.sock = sock
        self.proto = wire.CallServerProtocol(METHODS, server._token)
        self.admitted = False  # holds an authenticated slot (ThreadPerConnection._admit)
        self.buffer = bytearray(_RECEIVE)
        self.view = memoryview(self.buffer)
        self.start = 0  # unread bytes are buffer[start:end]
        self.end = 0

    def run(self) -> None:
        proto = self.proto
        while True:
            header = self._take(wire.HEADER_SIZE, idle=True)
            action = proto.on_header(header)
            if isinstance(action, wire.ReadCall):
                self._send(self._call(action, self._take(action.count)))
            elif isinstance(action, wire.ReadHello):
                action = proto.on_hello(action.request_id, bytes(self._take(action.count)))
                if isinstance(action, wire.Send):
                    if proto.authenticated and not self.admitted:
                        if not self.server._admit(self.sock):
                            return  # no authenticated slot: closed
                        self.admitted = True
                    self._send(action.reply)
                else:
                    self._close(action)
                    return
            elif isinstance(action, wire.Discard):
                self._take(action.count)
                self._send(action.reply)
            elif isinstance(action, wire.Send):
                self._send(action.reply)
            else:
                assert isinstance(action, wire.Close)
                self._close(action)
                return

    def _call(self, action: wire.ReadCall, payload: memoryview) -> bytes:
        """Run one CALL; the reply frame (the reply message, or why the call failed)."""
        method, caller_id, message = self.proto.split(action, payload)
        request_type, _ = MESSAGES[method]
        rid = action.request_id
        leadership = self.server._leadership
        hint = leadership.refusal() if leadership is not None else None
        if hint is not None:  # a standby: not applied, the caller goes to the leader
            return wire.error_reply(rid, wire.Reason.NOT_LEADER, hint)
        with request_context(valid_request_id(caller_id)):
            try:
                request = request_type.FromString(message)
            except DecodeError as exc:
                text = f"{method}: the request does not parse as {request_type.__name__}: {exc}"
                log.warning("store call failed: %s", text)
                return wire.error_reply(rid, wire.Reason.BAD_FRAME, text)
            try:
                reply = self.server._calls.handlers[method](request).SerializeToString()
            except HixlError as exc:
                log.warning("store call %s failed: %s", method, exc)
                return wire.error_reply(rid, wire.Reason.INTERNAL, f"{method}: {exc}")
            except Exception as exc:  # a bug must fail one call, not the connection
                log.error("store call %s failed: internal error: %r", method, exc,
                          exc_info=exc)
                return wire.error_reply(rid, wire.Reason.INTERNAL,
                                        f"{method}: internal error: {exc!r}")
            if len(reply) > wire.MAX_CALL:  # a frame this large breaks the client's codec
                text = (f"{method}: the reply of {len(reply)} bytes exceeds the call "
                        f"endpoint's limit of {wire.MAX_CALL}: ask for fewer keys per call")
                log.warning("store call failed: %s", text)
                return wire.error_reply(rid, wire.Reason.BAD_LENGTH, text)
        self.server.counters["calls"] += 1
        return wire.call_reply(rid, len(reply)) + reply

    def _take(self, count: int, idle: bool = False) -> memoryview:
        """The next `count` bytes of the stream. `idle`: the connection may wait for them
        indefinitely while none has arrived (between calls); a stall mid-frame ends it."""
        if self.end - self.start >= count:
            start = self.start
            self.start += count
            return self.view[start:start + count]
        if count > len(self.buffer):  # a large call: its own buffer
            large = bytearray(count)
            have = self.end - self.start
            large[:have] = self.view[self.start:self.end]
            self.start = self.end = 0
            out = memoryview(large)
            while have < count:
                have += self._receive(out[have:], False)
            return out
        if self.start:  # keep the unread bytes at the front
            have = self.end - self.start
            self.buffer[:have] = bytes(self.view[self.start:self.end])  # may overlap
            self.start, self.end = 0, have
        while self.end < count:
            self.end += self._receive(self.view[self.end:], idle and self.end == 0)
        self.start = count
        return self.view[:count]

    def _receive(self, into: memoryview, idle: bool) -> int:
        while True:
            try:
                got = self.sock.recv_into(into)
            except (BlockingIOError, TimeoutError):  # SO_RCVTIMEO passed
                if idle and not self.server._stopping:
                    continue
                raise Stalled(f"no bytes for {self.server._io_timeout:g} s in the middle "
                               "of a frame") from None
            if not got:
                raise PeerGone()
            return got

    def _send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except (BlockingIOError, TimeoutError):
            raise Stalled("the client stopped reading replies") from None

    def _close(self, action: wire.Close) -> None:
        if self.proto.auth_refused:
            self.server._count("auth_failures")
            log.warning("store call connection refused: %s", action.reason)
        else:
            self.server._count("protocol_errors")
            log.info("store call connection closed: %s", action.reason)
        if action.reply:
            with contextlib.suppress(OSError):
                self.sock.sendall(action.reply)
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_WR)


__all__ = ["StoreCallServer"]
