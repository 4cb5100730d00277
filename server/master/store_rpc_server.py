"""hixl-master's store call endpoint: the hot store calls over a plain socket.

The client side and the reasons are in `hixl.store_rpc`. One thread of blocking I/O per
connection (as the agent's data server): read a frame, check it with the sans-IO
`wire.CallServerProtocol` (handshake and cluster token first: nothing is served before
it), run the method through the same `StoreCalls` the gRPC servicer uses, send the
reply. The store's calls may wait for the journal's fsync; each connection waits on its
own thread, and concurrent commits share an fsync (the journal's group commit). A
PutStart that finds no room while segments await their remount (a master switch) is held
on its connection's thread for up to REMOUNT_HOLD_S (a CALL carries no deadline), and
allocates nothing more once its caller closed the connection (gave up).

A call that fails as a call (a request that does not parse, an internal error, a
reply over wire.MAX_CALL) is answered with error text, logged once under the caller's
request id, and the connection stays open.

Memory: a CALL's declared length is never allocated up front. Calls that fit the
connection's 64 KiB receive buffer (every hot call but large batches) use it; a larger
body grows its own buffer 1 MiB at a time as bytes arrive, each step reserved against
`call_bytes_budget` (256 MiB), the bytes of large bodies held at once by all
connections. A connection holds at most one call (at most wire.MAX_CALL) at a time. A
step the budget cannot cover waits up to BUDGET_WAIT_S for other calls to finish; then
the call is refused, unapplied, with error text (the client raises MasterRpcError),
its remaining bytes are read and dropped and the connection goes on. A body has
`body_timeout` s (10) from its header to its last byte: a stalled body closes the
connection and frees what it held. Timeouts: a connection has `handshake_timeout`
s to authenticate, in a pre-auth budget apart from authenticated connections
(`hixl.server.connections`); an authenticated idle connection may wait for its next call
indefinitely; once a frame has begun, a stall longer than `io_timeout` closes it.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
import time
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
from hixl.server.master.leadership import Leadership
from hixl.server.master.store_service import Hold, StoreCalls
from hixl.sockets import polling_pays, recv_polling
from hixl.store_rpc import MESSAGES, METHODS

log = logging.getLogger("hixl.store.rpc")

_RECEIVE = 64 << 10  # a connection's receive buffer: most calls arrive in one recv
#: bytes of large call bodies (over _RECEIVE) held at once by all connections
CALL_BYTES_BUDGET = 256 << 20
BUDGET_WAIT_S = 1.0  # a body step the budget cannot cover waits this long, then is refused
BODY_TIMEOUT_S = 10.0  # a call body must arrive whole within this long of its header
#: after answering, poll this long for the connection's next call before blocking (one
#: connection at a time): see _Connection._spin_receive
CALL_SPIN_US = 500
_GROW = 1 << 20  # a large body's buffer grows by this much as bytes arrive
_ZEROS = bytes(_GROW)


class _OverBudget(Exception):
    """The call bytes budget stayed exhausted for BUDGET_WAIT_S."""


class StoreCallServer(ThreadPerConnection):
    """Serves `METHODS` of `calls` on host:port (0: a free port) until stop().

    `leadership`: while its master does not lead (a standby, server/master/leadership.py), every
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
                 call_bytes_budget: int = CALL_BYTES_BUDGET,
                 body_timeout: float = BODY_TIMEOUT_S, spin_us: int = CALL_SPIN_US,
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
        #: calls_over_budget: refused because call_bytes_budget stayed exhausted;
        #: calls_polled: calls whose first bytes a polling connection took (spin_us);
        #: body_timeouts: connections closed because a call body did not arrive in time
        self.counters = dict.fromkeys(("connections", "connections_rejected",
                                       "thread_start_failures", "preauth_evicted",
                                       "handshake_timeouts", "protocol_errors",
                                       "auth_failures", "calls", "calls_over_budget",
                                       "calls_polled", "body_timeouts"), 0)
        self._budget = call_bytes_budget
        self._body_timeout = body_timeout
        self._spin_s = spin_us / 1e6 if polling_pays() else 0.0
        self._spinner = threading.Lock()  # held by the one connection spinning now
        self._held = 0  # bytes of large call bodies reserved now
        self.held_peak = 0  # the most ever reserved at once
        self._budget_cond = threading.Condition()

    @property
    def bytes_in_flight(self) -> int:
        """Bytes of large call bodies held now (reserved against call_bytes_budget)."""
        with self._budget_cond:
            return self._held

    def _reserve(self, amount: int, wait_until: float) -> bool:
        """Reserve `amount` bytes of the call budget, waiting until `wait_until` at most."""
        with self._budget_cond:
            while self._held + amount > self._budget:
                left = wait_until - time.monotonic()
                if left <= 0 or self._stopping:
                    return False
                self._budget_cond.wait(left)
            self._held += amount
            self.held_peak = max(self.held_peak, self._held)
            return True

    def _unreserve(self, amount: int) -> None:
        if amount:
            with self._budget_cond:
                self._held -= amount
                self._budget_cond.notify_all()

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
        self.reserved = 0  # call budget bytes held by the body being received
        self.replied_at = 0.0  # when the last reply was sent (monotonic)
        self.back_to_back = True  # its last call came within the spin of the reply before

    def run(self) -> None:
        try:
            self._loop()
        finally:
            self.server._unreserve(self.reserved)
            self.reserved = 0

    def _loop(self) -> None:
        proto = self.proto
        while True:
            header = self._take(wire.HEADER_SIZE, idle=True)
            action = proto.on_header(header)
            if isinstance(action, wire.ReadCall):
                try:
                    payload = self._take(action.count)
                except _OverBudget as exc:
                    self._send(self._over_budget(action, exc.args[0]))
                    continue
                try:
                    reply = self._call(action, payload)
                finally:
                    del payload
                    self.server._unreserve(self.reserved)
                    self.reserved = 0
                self._send(reply)
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
            handler = self.server._calls.handlers[method]
            try:
                if method in StoreCalls.HOLDING:  # may wait for a remount: see Hold
                    answer = handler(request, hold=Hold.for_deadline(None, self._caller_gone))
                else:
                    answer = handler(request)
                reply = answer.SerializeToString()
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

    def _caller_gone(self) -> bool:
        """True once the caller closed the connection while its call ran (it gave up at
        its deadline): a client sends nothing else before the reply, so anything to read
        now is the end of the stream."""
        try:
            data = self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            return True
        return not data

    def _take(self, count: int, idle: bool = False) -> memoryview:
        """The next `count` bytes of the stream. `idle`: the connection may wait for them
        indefinitely while none has arrived (between calls); a stall mid-frame ends it."""
        if self.end - self.start >= count:
            start = self.start
            self.start += count
            return self.view[start:start + count]
        if count > len(self.buffer):  # a large call: its own buffer, grown as bytes arrive
            return memoryview(self._take_large(count))
        if self.start:  # keep the unread bytes at the front
            have = self.end - self.start
            self.buffer[:have] = bytes(self.view[self.start:self.end])  # may overlap
            self.start, self.end = 0, have
        while self.end < count:
            self.end += self._receive(self.view[self.end:], idle and self.end == 0)
        self.start = count
        return self.view[:count]

    def _take_large(self, count: int) -> bytearray:
        """A body larger than the receive buffer: a buffer that grows _GROW bytes at a
        time, each step reserved against the server's call budget, only once the bytes
        before it have arrived; the whole body within body_timeout. Raises _OverBudget
        (the rest of the body already read and dropped) or Stalled."""
        server = self.server
        deadline = time.monotonic() + server._body_timeout
        large = bytearray()
        have = self.end - self.start
        filled = 0
        try:
            while filled < count:
                if filled == len(large):
                    step = min(_GROW, count - len(large))
                    if not server._reserve(step, min(deadline, time.monotonic()
                                                     + BUDGET_WAIT_S)):
                        server._count("calls_over_budget")
                        held = len(large)
                        del large
                        self.server._unreserve(self.reserved)
                        self.reserved = 0
                        self._skip(count - filled, deadline)
                        raise _OverBudget(held)
                    self.reserved += step
                    large += _ZEROS[:step]
                if have:  # what came with the header
                    take = min(have, len(large) - filled)
                    large[filled:filled + take] = self.view[self.start:self.start + take]
                    self.start += take
                    have -= take
                    filled += take
                    if not have:
                        self.start = self.end = 0
                    continue
                with memoryview(large) as whole, whole[filled:] as into:
                    filled += self._receive_by(into, deadline)
        finally:
            self._restore_timeout()
        return large

    def _skip(self, count: int, deadline: float) -> None:
        """Read and drop `count` bytes of the stream (a refused call's body)."""
        have = min(count, self.end - self.start)
        self.start += have
        count -= have
        if self.start == self.end:
            self.start = self.end = 0
        scratch = memoryview(bytearray(min(count, _RECEIVE)))
        while count:
            count -= self._receive_by(scratch[:min(count, len(scratch))], deadline)

    def _receive_by(self, into: memoryview, deadline: float) -> int:
        """recv_into, given up (Stalled, the connection closes) once `deadline` passes."""
        late = Stalled(f"a call body did not arrive within {self.server._body_timeout:g} s")
        left = deadline - time.monotonic()
        if left <= 0:
            self.server._count("body_timeouts")
            raise late
        left = min(left, self.server._io_timeout)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                             struct.pack("ll", int(left), int((left - int(left)) * 1e6) or 1))
        try:
            return self._receive(into, False)
        except Stalled:
            if time.monotonic() < deadline:
                raise
            self.server._count("body_timeouts")
            raise late from None

    def _restore_timeout(self) -> None:
        timeout = self.server._io_timeout
        with contextlib.suppress(OSError):
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                                 struct.pack("ll", int(timeout),
                                             int((timeout - int(timeout)) * 1e6)))

    def _over_budget(self, action: wire.ReadCall, held: int) -> bytes:
        method = METHODS.get(action.method, str(action.method))
        text = (f"{method}: refused, not applied: the master holds its limit of "
                f"{self.server._budget} bytes of large call bodies in flight (this call of "
                f"{action.count} bytes got {held}); retry, or send fewer keys per call")
        log.warning("store call refused: %s", text)
        return wire.error_reply(action.request_id, wire.Reason.INTERNAL, text)

    def _spin_receive(self, into: memoryview) -> int:
        """Between calls, the next call's first bytes if they come within the server's
        spin, polled without blocking; 0 when they do not (then block as usual).

        Why: a client calling back to back sends its next call ~100-200 µs after our
        reply; a thread that blocked meanwhile is woken on a halted CPU with cold caches,
        which on the VMs measured cost more than the call's own work (a 64 KiB put
        ~270 -> ~150-230 µs with the spin, docs/store.md §1). Bounded so it cannot cost
        much: one connection spins at a time (others block), only one whose last call
        came back to back, never while stopping; the GIL is released at every poll."""
        server = self.server
        if not (server._spin_s and self.back_to_back) or server._stopping or \
                not server._spinner.acquire(blocking=False):
            return 0
        try:  # stop() shuts every connection down: a poll then sees the end at once
            got = recv_polling(self.sock, into, self.replied_at + server._spin_s)
        finally:
            server._spinner.release()
        if got is None:
            return 0
        if not got:
            raise PeerGone()
        server._count("calls_polled")
        return got

    def _receive(self, into: memoryview, idle: bool) -> int:
        if idle:
            got = self._spin_receive(into)
            if got:
                return got
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
            if idle:
                self.back_to_back = time.monotonic() - self.replied_at <= self.server._spin_s
            return got

    def _send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except (BlockingIOError, TimeoutError):
            raise Stalled("the client stopped reading replies") from None
        self.replied_at = time.monotonic()

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
