"""The client side's blocking I/O around `wire.ClientProtocol`: one handshake for both of
the wire protocol's clients, the socket transport's data connections (hixl.transports.tcp)
and the store call client (hixl.store_rpc).

`DeadlineSocket` is a blocking socket whose sends and receives end by a deadline through
its kernel timeouts (`hixl.sockets.arm_timeouts`): a call costs its send and its receive,
no poll() around each. `handshake` sends HELLO and, when the server challenges, AUTH with
the cluster token, then checks the server's own proof (mutual); a server without a token
does not challenge, and a client with one still connects. Failures: TimeoutError at the
deadline, OSError when the connection breaks, wire.ProtocolError when the server speaks
something else, AuthenticationFailed when this side's check fails (no token to answer a
challenge, or a server that cannot prove the token), and `Refused` carrying the typed
error when the server answers with an error reply (a wrong token: AuthenticationFailed).
"""

from __future__ import annotations

import socket
import time

from hixl import wire
from hixl.errors import HixlError
from hixl.sockets import arm_timeouts, recv_polling

_HEADER = wire.HEADER_SIZE


class Refused(Exception):
    """The server answered a handshake frame with an error reply: `error` says why."""

    def __init__(self, error: HixlError) -> None:
        super().__init__(str(error.args[0]) if error.args else type(error).__name__)
        self.error = error


class DeadlineSocket:
    """A blocking socket whose every send and receive ends by a deadline (monotonic)."""

    __slots__ = ("sock", "armed")

    def __init__(self, sock: socket.socket) -> None:
        sock.settimeout(None)  # blocking: the kernel timeouts bound each call
        self.sock = sock
        self.armed = 0.0  # the kernel timeout set now (s; 0: none yet)

    def _arm(self, deadline: float) -> None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the deadline passed")
        self.armed = arm_timeouts(self.sock, self.armed, left)

    def send_all(self, data: bytes | bytearray | memoryview, deadline: float) -> None:
        """Send every byte by `deadline` (TimeoutError: some may have left)."""
        view = memoryview(data)
        sent = 0
        while sent < len(view):
            self._arm(deadline)
            try:
                sent += self.sock.send(view[sent:])
            except BlockingIOError:  # SO_SNDTIMEO, nothing taken: arm again, or give up
                if time.monotonic() >= deadline:
                    raise TimeoutError("the peer took no bytes before the deadline") from None
                self.armed = 0.0

    def recv_into(self, view: memoryview, deadline: float) -> int:
        """Some bytes into `view` (at least one) by `deadline`; ConnectionResetError at
        end of stream."""
        while True:
            self._arm(deadline)
            try:
                count = self.sock.recv_into(view)
            except BlockingIOError:  # SO_RCVTIMEO: arm again, or the deadline passed
                if time.monotonic() >= deadline:
                    raise TimeoutError("no reply before the deadline") from None
                self.armed = 0.0
                continue
            if not count:
                raise ConnectionResetError("the server closed the connection")
            return count

    def recv_spinning(self, view: memoryview, deadline: float, spin_s: float) -> int:
        """recv_into, first polling without blocking for up to `spin_s` (never past the
        deadline): a reply due within microseconds is taken by a thread still running,
        instead of one the kernel must wake on a halted CPU (on the VMs measured, that
        wake-up and the caches it finds cold cost ~60 µs of a ~230 µs store call)."""
        count = recv_polling(self.sock, view, min(time.monotonic() + spin_s, deadline))
        if count is None:
            return self.recv_into(view, deadline)
        if not count:
            raise ConnectionResetError("the server closed the connection")
        return count

    def recv_exact(self, view: memoryview, deadline: float) -> None:
        got = 0
        while got < len(view):
            got += self.recv_into(view[got:], deadline)


def _reply(io: DeadlineSocket, proto: wire.ClientProtocol, deadline: float) -> bytes:
    """The payload of the next reply, exactly (a handshake reply is small and nothing
    follows it unasked); an error reply raises Refused."""
    raw = bytearray(_HEADER)
    io.recv_exact(memoryview(raw), deadline)
    header = proto.on_reply_header(raw)
    payload = bytearray(wire.payload_length(header))
    io.recv_exact(memoryview(payload), deadline)
    if header.flags & wire.FLAG_ERROR_TEXT:
        raise Refused(wire.reply_error(header, bytes(payload)))
    return bytes(payload)


def handshake(io: DeadlineSocket, proto: wire.ClientProtocol, identity: bytes,
              token: bytes | None, deadline: float, *, runs: bool = False) -> None:
    """HELLO (asking for run replies with `runs`), then AUTH when challenged, by
    `deadline`; the connection then serves `proto`'s requests."""
    io.send_all(proto.hello(identity[:wire.MAX_HELLO], runs=runs), deadline)
    challenge = _reply(io, proto, deadline)
    if proto.challenged:
        io.send_all(proto.auth(token, challenge), deadline)
        proof = _reply(io, proto, deadline)
        assert token is not None  # auth() refused to answer without one
        proto.check_server_proof(token, proof)


__all__ = ["DeadlineSocket", "Refused", "handshake"]
