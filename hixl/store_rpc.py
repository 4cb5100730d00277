"""The store's call endpoint, client side: the hot Master calls over a plain socket.

A gRPC unary round trip between Python processes costs 0.4-0.6 ms, several times what
the work behind a PutStart or GetReplicas takes; a put needs two of them. So hixl-master
also serves the hot calls (`METHODS`: the puts, reads, exists, sizes and removals) on a
second port, over the data path's framing and handshake (`hixl.wire`: HELLO, the
cluster-token CHALLENGE / AUTH, then CALL frames), one thread per connection. Payloads
are the very `store_pb2` request and reply messages the gRPC service takes, so both
front ends run the same code behind them (`hixl.server.master.store_service.StoreCalls`).

gRPC stays the canonical API: the master advertises the endpoint's port in its
Heartbeat and MountSegment replies (`fast_port`), and `MasterClient` takes this path
when it knows one and falls back to gRPC when the endpoint cannot be reached. Failure
contract, the same as gRPC's: every call has a deadline (kernel socket timeouts); a request
that may have reached the master is never sent twice, and a call whose connection
breaks after the request was sent fails with MasterUnavailable (the store's RPC_FAIL);
a standby master's NOT_LEADER reply (the call was not applied) sends the caller to the
leader (hixl.failover); a cached connection the master has since closed (it restarted)
is noticed before use and replaced.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import select
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

from hixl import wire
from hixl.addresses import split_host_port
from hixl.errors import AuthenticationFailed, ConfigError, HixlError, ParamInvalid
from hixl.failover import NotLeader
from hixl.logs import current_request_id
from hixl.sockets import polling_pays, tune_socket
from hixl.v1 import store_pb2
from hixl.wire_client import DeadlineSocket, Refused, handshake

#: method number on the wire -> gRPC method name
METHODS: dict[int, str] = {1: "PutStart", 2: "PutEnd", 3: "PutRevoke", 4: "GetReplicas",
                           5: "ExistKey", 6: "GetSize", 7: "Remove", 8: "Reserve",
                           9: "Commit", 10: "Release"}
METHOD_NUMBERS = {name: number for number, name in METHODS.items()}
#: method name -> (request message, reply message), as in the gRPC service
MESSAGES: dict[str, tuple[Any, Any]] = {
    "PutStart": (store_pb2.PutStartRequest, store_pb2.PutStartReply),
    "PutEnd": (store_pb2.PutEndRequest, store_pb2.CodesReply),
    "PutRevoke": (store_pb2.PutEndRequest, store_pb2.CodesReply),
    "GetReplicas": (store_pb2.KeysRequest, store_pb2.GetReplicasReply),
    "ExistKey": (store_pb2.KeysRequest, store_pb2.CodesReply),
    "GetSize": (store_pb2.KeysRequest, store_pb2.GetSizeReply),
    "Remove": (store_pb2.RemoveRequest, store_pb2.CodesReply),
    "Reserve": (store_pb2.ReserveRequest, store_pb2.ReserveReply),
    "Commit": (store_pb2.CommitRequest, store_pb2.CodesReply),
    "Release": (store_pb2.ReleaseRequest, store_pb2.CodesReply),
}

#: longest wait for the endpoint to accept a connection (within the call's deadline):
#: a port filtered on the way must cost a call little before it falls back to gRPC
CONNECT_TIMEOUT_S = 0.5
#: after the endpoint could not be reached: gRPC only for this long (doubling to the max)
RETRY_MIN_S, RETRY_MAX_S = 1.0, 10.0
#: connections kept open per client for the next calls (more are opened by concurrent callers)
MAX_IDLE = 4
#: how long a lone call polls for its reply before it blocks (DeadlineSocket.recv_spinning):
#: a store call is answered in ~100-200 µs, and a caller blocked that long finds its CPU
#: halted and its caches cold when the reply comes (measured: a 64 KiB put's floor
#: 220 -> 160 µs). Only while no other call of this client is in flight and the host has
#: a second CPU for the master: spinning threads must not starve what they wait for.
#: HIXL_CALL_SPIN_US (0: never spin).
SPIN_ENV = "HIXL_CALL_SPIN_US"


def spin_from_env(environ: Mapping[str, str] = os.environ) -> float:
    """SPIN_S: HIXL_CALL_SPIN_US (default 300, [0, 10000]) in seconds; 0 on a single CPU.
    ConfigError naming the variable for anything else."""
    text = environ.get(SPIN_ENV, "300").strip()
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= 10_000:
        raise ConfigError(f"environment variable {SPIN_ENV}: expected whole microseconds in "
                          f"[0, 10000] (0: never poll for a reply), got {text!r}")
    return value / 1e6 if polling_pays() else 0.0


SPIN_S = spin_from_env()
_RECEIVE = 64 << 10
_HEADER = wire.HEADER_SIZE
# request ids for calls made outside any request: 16 hex digits as hixl.logs makes them,
# counting up from a random point (a uuid4 per call costs more than the call's framing)
_fresh_ids = itertools.count(random.SystemRandom().getrandbits(63))


class _InFlight:
    """Calls of this process waiting for their reply, and how long replies take: a call
    spins (SPIN_S) only when it is the lone one in flight and replies typically come
    within the spin (a master across a slow link is waited for blocked, not polled)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0
        self.typical_s = 0.0  # moving average of recent calls' send-to-reply time

    def enter(self) -> float:
        """A call starts: the spin it may take."""
        with self._lock:
            self.count += 1
            return SPIN_S if self.count == 1 and self.typical_s <= SPIN_S else 0.0

    def leave(self, waited_s: float) -> None:
        """A call ended (answered or not) `waited_s` after it was sent. One long call (a
        removal waiting for readers, say) counts as 4 spins long at most: it pauses the
        spinning for a call or two, not for dozens."""
        with self._lock:
            self.count -= 1
            self.typical_s += (min(waited_s, 4 * SPIN_S) - self.typical_s) / 8


_in_flight = _InFlight()


class CallFailed(HixlError):
    """The master answered a call with an error (the call itself failed, not a key)."""


class NotSent(OSError):
    """The request never reached the master whole: sending it again is safe."""


class CallConnection:
    """One authenticated connection to the call endpoint; one call at a time."""

    def __init__(self, sock: socket.socket, address: str) -> None:
        self.sock = sock
        self.address = address
        self._io = DeadlineSocket(sock)
        self._proto = wire.ClientProtocol()
        self._buffer = bytearray(_RECEIVE)
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)

    @classmethod
    def open(cls, host: str, port: int, *, token: bytes | None, identity: str,
             deadline: float) -> CallConnection:
        """Connect and handshake by `deadline` (monotonic). OSError/TimeoutError when the
        endpoint cannot be reached; AuthenticationFailed when it refuses our token (or
        cannot prove its own); wire.ProtocolError when it speaks something else."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no time left to connect")
        sock = socket.create_connection((host, port), timeout=min(left, CONNECT_TIMEOUT_S))
        try:
            tune_socket(sock)
            connection = cls(sock, f"{host}:{port}")
            handshake(connection._io, connection._proto, identity.encode("utf-8"), token,
                      deadline)
        except Refused as refused:
            sock.close()
            if isinstance(refused.error, AuthenticationFailed):
                raise refused.error from None
            raise CallFailed(str(refused), status=refused.error.status) from None
        except BaseException:
            sock.close()
            raise
        return connection

    def stale(self) -> bool:
        """True when the master closed this connection (or sent what nobody asked for)
        since its last call: it must not carry another request. One zero-timeout poll."""
        return bool(self._poll.poll(0))

    def call(self, method: int, caller_id: bytes, message: bytes, deadline: float,
             spin_s: float = 0.0) -> bytes:
        """Send one CALL and return the reply message (polled for up to `spin_s` before
        blocking: SPIN_S). NotSent if the request did not leave whole (safe to resend);
        CallFailed for an error reply, hixl.failover.NotLeader for a standby's refusal (the
        connection stays usable either way); any other OSError / TimeoutError /
        ProtocolError once it was sent."""
        frame = self._proto.call(method, caller_id, len(message))
        try:
            self._send(frame + message, deadline)
        except OSError as exc:
            raise NotSent(str(exc)) from exc
        return bytes(self._reply(deadline, spin_s)[1])

    def _send(self, data: bytes, deadline: float) -> None:
        try:
            self._io.send_all(data, deadline)
        except TimeoutError:
            raise TimeoutError("the master took no request bytes before the call's "
                               "deadline") from None

    def _reply(self, deadline: float, spin_s: float = 0.0) -> tuple[wire.Header, memoryview]:
        """The next reply's header and payload (error replies raise)."""
        view = memoryview(self._buffer)
        have = self._receive(view, deadline, spin_s)
        while have < _HEADER:
            have += self._receive(view[have:], deadline)
        header = self._proto.on_reply_header(view[:_HEADER])
        total = _HEADER + header.length
        if total <= len(view):
            while have < total:
                have += self._receive(view[have:total], deadline)
            payload = view[_HEADER:total]
        else:  # a large reply: its own buffer, what came with the header first
            large = bytearray(header.length)
            large[:have - _HEADER] = view[_HEADER:have]
            got, payload = have - _HEADER, memoryview(large)
            while got < header.length:
                got += self._receive(payload[got:], deadline)
            have = total
        if have > total:
            raise wire.ProtocolError(wire.Reason.BAD_FRAME,
                                     f"{have - total} bytes nobody asked for after a reply")
        if header.flags & wire.FLAG_ERROR_TEXT:
            if header.reason == wire.Reason.NOT_LEADER:  # unapplied: the caller goes elsewhere
                leader = bytes(payload).decode("utf-8", "replace").strip()
                raise NotLeader(f"master {self.address} (call endpoint) is not the leader "
                                f"(leader: {leader or 'unknown'})", leader=leader)
            error = wire.reply_error(header, bytes(payload))
            if isinstance(error, AuthenticationFailed):
                raise error
            raise CallFailed(str(error.args[0]) if error.args else "call failed",
                             status=error.status)
        return header, payload

    def _receive(self, into: memoryview, deadline: float, spin_s: float = 0.0) -> int:
        try:
            if spin_s:
                return self._io.recv_spinning(into, deadline, spin_s)
            return self._io.recv_into(into, deadline)
        except TimeoutError:
            raise TimeoutError("no reply before the call's deadline") from None
        except ConnectionResetError:
            raise ConnectionResetError("the master closed the connection") from None

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


class FastPath:
    """A MasterClient's use of the call endpoint: the advertised port, idle connections,
    and the back-off after the endpoint could not be reached. Thread-safe."""

    def __init__(self, host: str, token: bytes | None, identity: str) -> None:
        self.host = host
        self._token = token
        self._identity = identity
        self._lock = threading.Lock()
        self._port: int | None = None   # None: not known (ask the master); 0: it has none
        self._failed_port: int | None = None  # the port that could not be reached last
        self._idle: list[CallConnection] = []
        self._retry_at = 0.0            # no attempt (nor probe) before this
        self._backoff = RETRY_MIN_S
        self._closed = False
        #: calls answered over the endpoint (for tests and operators)
        self.calls = 0

    @property
    def port(self) -> int | None:
        return self._port

    def advertised(self, port: int) -> None:
        """The port a Heartbeat / MountSegment reply named (0: the master has none).

        A new port is tried at once; the port that just failed is tried again only after
        its back-off (a port filtered on the way must not stall a call per heartbeat)."""
        with self._lock:
            if port == self._port:
                if not port:  # still none: the next probe after another wait
                    self._retry_at = time.monotonic() + RETRY_MAX_S
                return
            self._port = port
            if not port:  # no endpoint there: ask again later (it may restart with one)
                self._retry_at = time.monotonic() + RETRY_MAX_S
            elif port != self._failed_port:
                self._retry_at, self._backoff = 0.0, RETRY_MIN_S
            stale, self._idle = self._idle, []
        for connection in stale:
            connection.close()

    def should_probe(self) -> bool:
        """True when the port is not known (or the master had none) and may be asked now."""
        return not self._port and not self._closed and time.monotonic() >= self._retry_at

    def unreachable(self) -> None:
        """The endpoint (or the probe for it) failed: gRPC only for a while (doubling from
        RETRY_MIN_S to RETRY_MAX_S), then ask the master for its port again."""
        with self._lock:
            if self._port:
                self._failed_port = self._port
            self._port = None
            self._retry_at = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, RETRY_MAX_S)
            stale, self._idle = self._idle, []
        for connection in stale:
            connection.close()

    def call(self, method: str, message: bytes, deadline: float) -> bytes | None:
        """The reply message, or None when the endpoint is unknown or unreachable now (the
        request was not sent: use gRPC). Raises what `CallConnection.call` raises once the
        request was sent (NotLeader: it was not applied), and AuthenticationFailed when the
        endpoint refused our token."""
        port = self._port
        if port is None or self._closed or time.monotonic() < self._retry_at:
            return None
        rid = current_request_id() or f"{next(_fresh_ids):016x}"
        caller_id = rid.encode("ascii", "replace")[:wire.MAX_CALL_REQUEST_ID]
        number = METHOD_NUMBERS[method]
        connection = self._take()
        for _ in (0, 1):
            if connection is None:
                try:
                    connection = CallConnection.open(self.host, port, token=self._token,
                                                     identity=self._identity,
                                                     deadline=deadline)
                except AuthenticationFailed:
                    raise
                except (OSError, wire.ProtocolError):
                    self.unreachable()
                    return None
            spin_s = _in_flight.enter()
            sent = time.monotonic()
            try:
                reply = connection.call(number, caller_id, message, deadline, spin_s)
            except NotSent:  # e.g. reset by a master that restarted since: a new connection
                connection.close()
                connection = None
                continue
            except CallFailed as exc:
                self._give_back(connection)
                raise CallFailed(f"{exc.args[0]} (request {rid})", status=exc.status) from None
            except NotLeader:
                self._give_back(connection)
                raise
            except BaseException:
                connection.close()
                raise
            finally:
                _in_flight.leave(time.monotonic() - sent)
            self._give_back(connection)
            self._failed_port, self._backoff = None, RETRY_MIN_S
            self.calls += 1
            return reply
        return None

    def _take(self) -> CallConnection | None:
        while True:
            with self._lock:
                if not self._idle:
                    return None
                connection = self._idle.pop()
            if not connection.stale():
                return connection
            connection.close()

    def _give_back(self, connection: CallConnection) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < MAX_IDLE:
                self._idle.append(connection)
                return
        connection.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            stale, self._idle = self._idle, []
        for connection in stale:
            connection.close()


def target_host(target: str) -> str | None:
    """The host of a gRPC target "host:port" / "[v6]:port" (None for other forms)."""
    try:
        return split_host_port(target, min_port=0)[0]
    except ParamInvalid:
        return None


__all__ = ["CONNECT_TIMEOUT_S", "CallConnection", "CallFailed", "FastPath", "MESSAGES",
           "METHODS", "METHOD_NUMBERS", "NotSent", "target_host"]
