"""The socket data path, server side: one thread of blocking I/O per connection.

Each frame is checked by the sans-IO `ServerProtocol` before any byte moves into a
segment. Bytes arrive through a receive buffer read greedily, so one system call brings
many small frames: their headers are decoded in place and a small WRITE payload that came
along is copied once into the segment; larger payloads are received straight into segment
memory (`recv_into`, MSG_WAITALL: one system call per payload). READ data is sent straight
out of the segment (`sendmsg`). Blocking threads beat an event loop here: bulk receive is
one kernel call, with no readiness round trips. Accepted requests in a row are answered
by one run reply (`hixl.wire`), and replies are gathered and flushed together before the
thread would block, so a pipelined batch of small ops costs few system calls. A request
that arrives alone (the last read drained the socket, nothing is gathered) is answered at
once, in one `sendmsg`, without the run bookkeeping: the path of latency-bound small ops.
With the optional extension hixl._fastwire, an authenticated connection waits for its next
frame in C and answers such lone accepted WRITE/READ frames there, handing every other
frame back to this loop (`_serve_fast`; HIXL_FASTWIRE=0 keeps it all in Python).

Authentication: with a cluster token, a connection is served only after the HELLO /
CHALLENGE / AUTH exchange of `hixl.wire` proved the token; a wrong or missing proof gets a
NOT_AUTHENTICATED reply and the connection is closed before any WRITE/READ is looked at.

Memory: a connection drops every view of segment memory it served (its last action and
window) before it may block for the next frame, and WRITE windows before the reply
leaves, so a segment deregistered while the connection idles is unmapped at once instead
of staying pinned as a deferred unmap.

Timeouts: a connection has `handshake_timeout` s (5) from accept to authenticate, and
waits for its handshake in a budget of its own, apart from authenticated connections
(`hixl.server.connections`): idle outsiders cannot keep token holders out. An
authenticated idle connection may wait for its next frame forever, but once a frame has
begun, any stall longer than `io_timeout` (SO_RCVTIMEO / SO_SNDTIMEO) closes it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from hixl import wire
from hixl.errors import ConfigError
from hixl.metrics import Traffic, TrafficTable
from hixl.server.connections import (
    HANDSHAKE_TIMEOUT_S,
    PREAUTH_CONNECTIONS,
    PeerGone,
    Stalled,
    ThreadPerConnection,
)
from hixl.sockets import IOV_MAX, Buffer, BufferQueue, tune_socket
from hixl.transports import tcp

log = logging.getLogger("hixl.data")

# send gathered replies once they carry this much data: 1 MiB read 4-256 KiB ops ~20%
# faster than 256 KiB on loopback (fewer, larger sendmsg calls); 1 MiB ops the same
_FLUSH_BYTES = 1 << 20
_FLUSH_BUFFERS = 512  # ... or this many buffers
_DISCARD_CHUNK = 64 << 10
_LINGER_S = 1.0  # after a protocol error: how long to drain the peer before closing
_LINGER_BYTES = 16 << 20
_SCATTER_MAX = 256 << 10  # WRITE payloads up to this size are read with the next header
_RING = 64 << 10  # the connection's receive buffer: headers, and small payloads with them
# after a payload up to this size the ring is refilled greedily (the next frames are likely
# small too: copying them beats a system call each); after a larger one only the next
# header is read, so runs of large payloads go straight into segment memory
_GREEDY_MAX = 16 << 10
_RUN_OPS = 1024  # a run reply answers at most this many requests
_WRITE, _READ = int(wire.Op.WRITE), int(wire.Op.READ)
TRANSPORTS = ("tcp", "unix")
_REASONS = frozenset(int(reason) for reason in wire.Reason)
_monotonic = time.monotonic


class Peer(NamedTuple):
    """Something connected to the agent now, for the operator's view (Health, `hixl status`)."""

    kind: str          # "tcp" / "unix" data connection, "fd" socket, "watch" stream
    address: str       # remote "host:port", "pid N uid M", or the gRPC peer
    identity: str      # the engine name given in HELLO ("" when not said)
    connected_s: float


class DataServer(ThreadPerConnection):
    """Serves WRITE/READ frames against segments found by `resolve(segment_id)`."""

    log = log  # the module's logger ("hixl.data") for the shared accept/serve lines
    kind = "data server"
    connection_kind = "data connection"
    thread_name = "hixl-data"

    def __init__(self, resolve: Callable[[int], wire.ServedSegment | None], epoch: int, *,
                 tcp_host: str | None = "127.0.0.1", tcp_port: int = 0,
                 unix_path: str | None = None, max_connections: int = 256,
                 io_timeout: float = 30.0, cluster_token: bytes | None = None,
                 unix_mode: int = 0o660, handshake_timeout: float = HANDSHAKE_TIMEOUT_S,
                 preauth_connections: int = PREAUTH_CONNECTIONS,
                 start_thread: Callable[[threading.Thread], None] | None = None) -> None:
        """`unix_mode`: the unix socket's file mode, set before it listens (so no one
        outside it can connect in between). `max_connections`: authenticated connections
        (TCP and unix together); `preauth_connections`: connections still in their
        handshake, per listener, each with `handshake_timeout` s to complete it
        (`hixl.server.connections`). `start_thread`: starts each connection's thread
        (default `Thread.start`; a test hook, see ThreadPerConnection)."""
        if tcp_host is None and unix_path is None:
            raise ConfigError("data server needs a TCP host or a unix socket path")
        if unix_path is not None and not os.path.isabs(unix_path):
            raise ConfigError(f"unix socket path {unix_path!r} must be absolute")
        self._resolve = resolve
        self._epoch = epoch
        #: hixl._fastwire: authenticated connections answer lone WRITE/READ frames in C
        #: (`_Connection._serve_fast`); None: in Python (no compiler, HIXL_FASTWIRE=0)
        self.fast = tcp.FASTWIRE
        self._tcp_host = tcp_host
        self._tcp_port = tcp_port
        self._unix_path = unix_path
        self._unix_inode: int | None = None
        self._unix_mode = unix_mode
        self._init_connections(max_connections, io_timeout,
                               handshake_timeout=handshake_timeout,
                               preauth_connections=preauth_connections,
                               start_thread=start_thread)
        self._cluster_token = cluster_token
        self._connections: dict[socket.socket, _Connection] = {}  # for peers()
        self._tcp_address = ""
        #: bytes_written / ops_write: WRITE payloads received into segments; bytes_read /
        #: ops_read: READ data sent; refused: requests answered with an error; connections:
        #: accepted in total; connections_rejected: turned away (authenticated while all
        #: max_connections slots were taken, or no thread could be started:
        #: thread_start_failures counts those too); preauth_evicted: closed in their
        #: handshake to make room for a newer one (the listener's preauth_connections were
        #: all taken); handshake_timeouts: closed for not authenticating within
        #: handshake_timeout;
        #: protocol_errors: connections closed for a bad frame, a stall or an internal error;
        #: auth_failures: those of them refused for a wrong or missing cluster token
        self.counters: dict[str, int] = dict.fromkeys(
            ("bytes_written", "bytes_read", "ops_write", "ops_read", "refused", "connections",
             "connections_rejected", "thread_start_failures", "preauth_evicted",
             "handshake_timeouts", "protocol_errors", "auth_failures"), 0)
        #: the same traffic per transport and direction, for metrics: ops and bytes (published
        #: with `counters`), the time per batch of replies, refusals by wire reason
        self.traffic = TrafficTable(TRANSPORTS)
        self.accepted = dict.fromkeys(TRANSPORTS, 0)  # connections accepted per transport

    # ------------------------------------------------------------ lifecycle

    @property
    def tcp_address(self) -> str:
        """'host:port' actually bound, '' without TCP."""
        return self._tcp_address

    @property
    def unix_path(self) -> str | None:
        return self._unix_path

    def peers(self) -> list[Peer]:
        """Each live data connection: kind, remote address, the engine it named in HELLO."""
        now = time.monotonic()
        with self._lock:
            connections = list(self._connections.values())
        return [Peer("unix" if c.sock.family == socket.AF_UNIX else "tcp", _address(c.peer),
                     c.proto.peer_identity, now - c.since) for c in connections]

    def start(self) -> None:
        """Bind and listen on every configured address; acceptor threads start serving."""
        try:
            if self._tcp_host is not None:
                family = socket.AF_INET6 if ":" in self._tcp_host else socket.AF_INET
                sock = socket.socket(family, socket.SOCK_STREAM)
                self._listeners.append(sock)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                tune_socket(sock)  # accepted sockets inherit buffers before the handshake
                sock.bind((self._tcp_host, self._tcp_port))
                sock.listen(128)
                host, port = sock.getsockname()[:2]
                self._tcp_address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            if self._unix_path is not None:
                self._listeners.append(self._bind_unix(self._unix_path))
        except BaseException:
            self.stop()
            raise
        self._start_accepting()
        log.info("data server listening on %s", ", ".join(
            filter(None, [self._tcp_address and f"tcp://{self._tcp_address}",
                          self._unix_path and f"unix://{self._unix_path}"])))

    def _bind_unix(self, path: str) -> socket.socket:
        """Bind `path` (mode `unix_mode`), replacing a stale socket file left by a dead
        server."""
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            pass
        else:
            if not stat.S_ISSOCK(mode):
                raise ConfigError(f"{path} exists and is not a socket; refusing to replace it")
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.settimeout(1.0)
                probe.connect(path)
            except OSError:
                os.unlink(path)  # nobody answers: stale
            else:
                raise ConfigError(f"{path}: another server is listening there")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            os.chmod(path, self._unix_mode)  # before listen(): nobody connects in between
            self._unix_inode = os.lstat(path).st_ino
            sock.listen(128)
        except BaseException:
            sock.close()
            raise
        return sock

    def stop(self) -> None:
        """Close the listeners and every live connection; wait (bounded) for the threads."""
        self._stop_connections()
        if self._unix_path is not None and self._unix_inode is not None:
            with contextlib.suppress(OSError):
                if os.lstat(self._unix_path).st_ino == self._unix_inode:  # still ours
                    os.unlink(self._unix_path)
            self._unix_inode = None

    def __enter__(self) -> DataServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ one connection

    def _accepted_locked(self, listener: socket.socket) -> None:
        self.accepted["unix" if listener.family == socket.AF_UNIX else "tcp"] += 1

    def _run_connection(self, sock: socket.socket, peer: object) -> None:
        connection = _Connection(self, sock, peer)
        with self._lock:
            self._connections[sock] = connection
        connection.run()

    def _forget_locked(self, sock: socket.socket) -> None:
        self._connections.pop(sock, None)


def _address(peer: object) -> str:
    """accept()'s peer as text: "host:port" for TCP, "unix" for a unix socket."""
    if isinstance(peer, tuple) and len(peer) >= 2:
        host, port = peer[0], peer[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(peer) or "unix"


class _Connection:
    """The frame loop of one connection (runs in its own thread).

    Bytes come in through `ring`, a receive buffer read greedily, so one system call
    brings many small frames: their headers are decoded in place, and a WRITE payload
    that came along is copied once from the ring into segment memory (the rest of a
    payload, and any payload after a large one, is received straight into the segment).
    Accepted requests that follow one another are answered together by one run reply
    (when the client asked for runs), READ data following its header zero-copy.
    """

    def __init__(self, server: DataServer, sock: socket.socket, peer: object = "") -> None:
        self.server = server
        self.sock = sock
        self.peer = peer
        self.since = time.monotonic()
        self.proto = wire.ServerProtocol(server._resolve, server._epoch, server._cluster_token)
        self.admitted = False  # holds an authenticated slot (ThreadPerConnection._admit)
        self.ring = bytearray(_RING)
        self.view = memoryview(self.ring)
        self.start = 0  # unread bytes are ring[start:end]
        self.end = 0
        self.exact = False  # read the next header alone: it follows a large payload
        # the last read into the ring got less than it asked: the socket was empty then, so
        # replies are sent at once instead of first probing for more frames (a probe that
        # finds nothing costs a system call and an exception: most of a lone op's overhead)
        self.drained = False
        self.replies: list[Buffer] = []  # gathered, not yet sent
        self.reply_bytes = 0
        # the open run: accepted requests of one opcode not yet answered
        self.run_op = 0
        self.run_first = 0
        self.run_next = -1  # the request id that would continue the run
        self.run_count = 0
        self.run_bytes = 0
        self.run_windows: list[memoryview] = []  # READ data, sent after the run's header
        # counted here and published at each flush: no shared lock per frame
        self.ops_write = self.bytes_written = self.ops_read = self.bytes_read = 0
        self.refused = 0
        self.traffic = server.traffic.pair(
            "unix" if sock.family == socket.AF_UNIX else "tcp")  # (read, write)
        self.started = _monotonic()  # when the batch the next flush answers began

    def run(self) -> None:
        try:
            self._loop()
        finally:
            self._publish()

    def _loop(self) -> None:
        proto = self.proto
        replies = self.replies
        on_header_at, ring, view = proto.on_header_at, self.ring, self.view
        fast = self.server.fast
        while True:
            start = self.start
            if self.end - start < wire.HEADER_SIZE:
                # no view of a segment survives while the thread may block for the next
                # frame: an idle connection must not keep a deregistered segment mapped
                action = target = window = None
                if (fast is not None and start == self.end and proto.authenticated
                        and (self.drained or not (replies or self.run_count)
                             or self._nothing_waiting())):
                    # the socket holds nothing more (or nothing is gathered): what
                    # _read_header would do, answer now, then wait in C
                    if self.run_count:
                        self._close_run()
                    if replies:
                        self._flush()
                    if not self._serve_fast(fast):
                        return
                elif self.end - self.start < wire.HEADER_SIZE and not self._read_header():
                    return  # (_nothing_waiting may have brought a whole header)
                start = self.start
            action = on_header_at(ring, start)
            start += wire.HEADER_SIZE
            self.start = start
            kind = type(action)
            if kind is wire.ReceiveInto:
                opcode = _WRITE
            elif kind is wire.Send and action.payload is not None:
                opcode = _READ
            else:
                opcode = 0
            if opcode:  # accepted: it joins the open run, or starts one
                rid = action.request_id
                if opcode == _WRITE:
                    window = None
                    target = action.target
                    size = len(target)
                    if self.end - start >= size:  # it came with its header: one copy
                        target[:] = view[start:start + size]
                        self.start = start + size
                    else:
                        self._receive(target)
                    target = action = None  # the data is in; dropped before the reply goes out
                else:
                    window = action.payload
                    size = len(window)
                self._accepted(opcode, rid, size, window)
                continue
            if kind is wire.ReadTable:  # a vector request: its range table, then its data
                table = bytearray(action.count)
                self._receive(memoryview(table))
                action = proto.on_table(action, table)
                kind = type(action)
                if kind is wire.ReceiveVector:
                    self._receive_scatter(action)
                    rid, size = action.request_id, action.size
                    action = None  # the data is in; the views go before the reply does
                    self._accepted(_WRITE, rid, size, None)
                    continue
                if kind is wire.SendVector:
                    self._accepted(_READ, action.request_id, action.size, action.views)
                    action = None
                    continue
            if self.run_count:
                self._close_run()
            if kind is wire.Send:  # PING, or a refused READ
                replies.append(action.reply)
                if len(action.reply) > wire.HEADER_SIZE:  # only error replies carry text
                    self._refused(self.traffic[0], action.reply)
            elif kind is wire.Discard:
                self._discard(action.count)
                replies.append(action.reply)
                self._refused(self.traffic[1], action.reply)
            elif kind is wire.ReadHello:  # HELLO or AUTH payload
                payload = bytearray(action.count)
                self._receive(memoryview(payload))
                answer = proto.on_hello(action.request_id, bytes(payload))
                if type(answer) is wire.Close:
                    self._close(answer)
                    return
                if proto.authenticated and not self.admitted:
                    if not self.server._admit(self.sock):
                        return  # no authenticated slot: closed, as if turned away at accept
                    self.admitted = True
                replies.append(answer.reply)
            else:  # wire.Close
                assert isinstance(action, wire.Close)
                self._close(action)
                return
            if len(replies) >= _FLUSH_BUFFERS or self.reply_bytes >= _FLUSH_BYTES:
                self._flush()

    def _accepted(self, opcode: int, rid: int, size: int,
                  window: memoryview | list[memoryview] | None) -> None:
        """An accepted WRITE (its data in) or READ (`window`: the data to send, or a
        vector's views): answered at once when it came alone, else it joins the open run
        of its kind, or starts one. Counted as one request, as a merged frame is."""
        replies = self.replies
        if self.drained and self.start == self.end and not self.run_count and not replies:
            self._answer_one(opcode, rid, size, window)  # alone: nothing to join
            return
        if rid != self.run_next or opcode != self.run_op:
            if self.run_count:
                self._close_run()
            self.run_op, self.run_first = opcode, rid
        self.run_next = rid + 1
        if type(window) is list:
            self.run_windows += window
        elif window is not None:
            self.run_windows.append(window)
        self.run_count += 1
        self.run_bytes += size
        if not self.proto.runs or self.run_count >= _RUN_OPS or self.run_bytes >= _FLUSH_BYTES:
            self._close_run()

    def _nothing_waiting(self) -> bool:
        """With replies gathered and the ring empty: True when the socket holds nothing
        now (then `drained`); else what it holds is in the ring and False (end-of-file
        too: `_read_header` then finds it). One non-blocking read, which `_read_header`
        would make first anyway (as it would: the header alone when `exact`); it lets the
        wait after a batch be in C."""
        try:
            n = self.sock.recv_into(self.view, wire.HEADER_SIZE if self.exact else _RING,
                                    socket.MSG_DONTWAIT)
        except BlockingIOError:
            self.drained = True
            return True
        self.start, self.end = 0, n
        return False

    def _serve_fast(self, fast: object) -> bool:
        """Wait for the next frame in C (hixl._fastwire.serve), which answers lone accepted
        WRITE/READ frames itself, one after another, as `_answer_one` does, and accepted
        vector requests alone on the stream, as `on_table` and `_receive_scatter` would
        serve them; the first frame it does not serve (a batch, a refusal, a handshake or
        control frame, a payload that did not come whole with its header) is left in the
        ring for the Python loop, as if `_read_header` had read it. False on EOF between
        frames.

        Only between frames of an authenticated connection with nothing gathered, so the
        replies stay in order. Memory: see hixl/_fastwire.c (checks and a WRITE's copy under
        the GIL, the segment pinned by a view for the whole op, as on the Python path).
        """
        want = wire.HEADER_SIZE if self.exact else _RING
        self.exact = False
        serve = fast.serve  # type: ignore[attr-defined]
        while True:
            status, n = serve(self.sock.fileno(), self.ring, want, self.server._resolve,
                              self.proto.peer_identity, self._counted)
            if status == 0:  # HANDBACK: ring[:n] holds what Python serves next
                self.started = _monotonic()
                self.start, self.end = 0, n
                self.drained = n < want
                return n >= wire.HEADER_SIZE or self._read_header()
            if status == 1:  # IDLE: SO_RCVTIMEO passed with nothing read
                if self.server._stopping:
                    raise Stalled("header stalled after 0 bytes")
                continue
            if status == 2:  # EOF between frames
                return False
            if status == 3:  # STALLED: SO_SNDTIMEO passed with nothing sent
                raise Stalled("peer stopped reading replies")
            if status == 5:  # PAYLOAD_STALLED: inside a vector WRITE's payload
                raise Stalled("vector payload stalled")
            if status == 6:  # GONE: EOF inside a vector WRITE's payload
                raise PeerGone()
            raise OSError(n, os.strerror(n))

    def _counted(self, opcode: int, size: int, seconds: float) -> None:
        """Count one op answered in C (published before its reply leaves, as `_answer_one`
        counts); `seconds`: from its frame's arrival to now, its latency observation."""
        self._count(opcode, size).latency.observe(seconds)

    def _count(self, opcode: int, size: int) -> Traffic:
        """Count one answered request (published before its reply leaves); returns its
        direction's traffic."""
        read, write = self.traffic
        with self.server._lock:
            counters = self.server.counters
            if opcode == _WRITE:
                counters["ops_write"] += 1
                counters["bytes_written"] += size
                write.ops += 1
                write.bytes += size
                return write
            counters["ops_read"] += 1
            counters["bytes_read"] += size
            read.ops += 1
            read.bytes += size
            return read

    def _answer_one(self, opcode: int, rid: int, size: int,
                    window: memoryview | list[memoryview] | None) -> None:
        """Answer a lone accepted request at once: the socket held nothing after it and
        nothing is gathered, so there is no run to build. Counts it (published before the
        reply, as `_flush` does), then sends the OK header and a READ's data in one call.

        Why a path of its own: one latency-bound op otherwise went through the run and
        flush bookkeeping, a good part of the agent's work for it.
        """
        traffic = self._count(opcode, size)
        if window is None:
            buffers: list[Buffer] = [wire.ok_reply(rid)]
            total = wire.HEADER_SIZE
        else:
            buffers = [wire.ok_reply(rid, size), *window] if type(window) is list \
                else [wire.ok_reply(rid, size), window]
            total = wire.HEADER_SIZE + size
        try:
            sent = self.sock.sendmsg(buffers[:IOV_MAX])
        except BlockingIOError:  # SO_SNDTIMEO passed with nothing sent
            raise Stalled("peer stopped reading replies") from None
        if sent != total:
            self._send_all(buffers, sent)
        now = _monotonic()
        traffic.latency.observe(now - self.started)
        self.started = now

    def _close_run(self) -> None:
        """Answer the open run: one reply (a plain one for a run of one), then READ data."""
        count, size = self.run_count, self.run_bytes
        self.replies.append(wire.run_reply(self.run_first, count, size
                                           if self.run_op == _READ else 0))
        if self.run_op == _READ:
            self.replies += self.run_windows
            self.run_windows.clear()
            self.reply_bytes += size
            self.ops_read += count
            self.bytes_read += size
        else:
            self.ops_write += count
            self.bytes_written += size
        self.run_count = self.run_bytes = 0
        self.run_next = -1
        if len(self.replies) >= _FLUSH_BUFFERS or self.reply_bytes >= _FLUSH_BYTES:
            self._flush()

    def _close(self, action: wire.Close) -> None:
        """Send the refusal (if any), drain what the peer already sent, end the connection."""
        proto = self.proto
        self.server._count("protocol_errors")
        if proto.auth_refused:
            self.server._count("auth_failures")
            log.info("refused data connection from %s (%s): %s", self.peer,
                     proto.peer_identity or "anonymous", action.reason)
        else:
            log.debug("closing data connection (%s): %s", proto.peer_identity or "anonymous",
                      action.reason)
        if self.run_count:
            self._close_run()
        if action.reply is not None:
            self.replies.append(action.reply)
        with contextlib.suppress(OSError, Stalled):
            self._flush()
            self._drain_before_close()

    def _refused(self, traffic: Traffic, reply: bytes) -> None:
        """Count a refused request (rare path) by the reason its error reply carries."""
        self.refused += 1
        reason = int.from_bytes(reply[6:8], "big")
        name = wire.Reason(reason).name if reason in _REASONS else str(reason)
        with self.server._lock:
            traffic.errors[name] = traffic.errors.get(name, 0) + 1

    def _publish(self) -> int:
        """Add this connection's counts to the server's; returns which directions had ops
        (1: writes, 2: reads), so the caller can time the batch."""
        server = self.server
        ops_write, ops_read, refused = self.ops_write, self.ops_read, self.refused
        directions = (1 if ops_write else 0) | (2 if ops_read else 0)
        if not (directions or refused):
            return 0
        read, write = self.traffic
        with server._lock:
            counters = server.counters
            if ops_write:
                counters["ops_write"] += ops_write
                counters["bytes_written"] += self.bytes_written
                write.ops += ops_write
                write.bytes += self.bytes_written
            if ops_read:
                counters["ops_read"] += ops_read
                counters["bytes_read"] += self.bytes_read
                read.ops += ops_read
                read.bytes += self.bytes_read
            if refused:
                counters["refused"] += refused
        self.ops_write = self.bytes_written = self.ops_read = self.bytes_read = 0
        self.refused = 0
        return directions

    def _read_header(self) -> bool:
        """Have the next 48-byte header in the ring; False on EOF between frames.

        Reads greedily: whatever the socket holds, up to the ring's free space, so one
        call brings many small frames. After a large payload the header is read alone
        (the next payload may be large too: it should go straight to the segment).
        Gathered replies (and the open run) are sent before the thread would block: they
        wait only while more frames are already here.
        """
        sock = self.sock
        have = self.end - self.start
        if have:  # the start of a header: move it to the front
            self.ring[:have] = self.ring[self.start:self.end]
        self.start, self.end = 0, have
        want = wire.HEADER_SIZE - have if self.exact else _RING - have
        self.exact = False
        if (self.replies or self.run_count) and not self.drained:
            try:
                n = sock.recv_into(self.view[have:], want, socket.MSG_DONTWAIT)
            except BlockingIOError:
                n = -1
            if n == 0:
                if have:
                    raise PeerGone()
                if self.run_count:
                    self._close_run()
                with contextlib.suppress(OSError, Stalled):
                    self._flush()  # a half-closed peer still reads its replies
                return False
            if n > 0:
                self.end = have = have + n
                self.drained = n < want
                want -= n
            if have >= wire.HEADER_SIZE:
                return True
        if self.run_count:
            self._close_run()
        if self.replies:
            self._flush()
        while have < wire.HEADER_SIZE:
            try:
                n = sock.recv_into(self.view[have:] if have else self.view, want)
            except BlockingIOError:  # SO_RCVTIMEO passed
                if have == 0 and not self.server._stopping:
                    continue  # idle between frames is fine
                raise Stalled(f"header stalled after {have} bytes") from None
            if not n:
                if have:
                    raise PeerGone()
                return False
            self.started = _monotonic()  # after an idle wait: a new batch begins
            self.end = have = have + n
            self.drained = n < want
            want -= n
        return True

    def _receive(self, target: memoryview) -> None:
        """Fill `target` with the next payload bytes: first those already in the ring
        (copied: they came with their header), then straight from the socket."""
        size = len(target)
        have = self.end - self.start
        if have >= size:
            target[:] = self.view[self.start:self.start + size]
            self.start += size
            return
        if have:
            target[:have] = self.view[self.start:self.end]
        self.start = self.end = 0
        rest = target[have:] if have else target
        if size > _SCATTER_MAX:
            self._recv_exact(rest)
            self.exact = True
        elif size > _GREEDY_MAX:
            self._recv_with_more(rest, self.view[:wire.HEADER_SIZE])
            self.exact = True
        else:
            self._recv_with_more(rest, self.view)
            self.exact = False

    def _receive_scatter(self, vector: wire.ReceiveVector) -> None:
        """Fill a vector WRITE's ranges in order with the next payload bytes: those already
        in the ring copied, the rest straight from the socket into segment memory, as
        many ranges per system call as it takes, waiting for all of them (MSG_WAITALL: one
        wake-up per call, as `_recv_exact`); in C (`recv_scatter`) when it is built."""
        memory, starts, lengths = vector.memory, vector.starts, vector.lengths
        have = self.end - self.start
        if have:  # the ring holds the first ranges' bytes (a few: it is one ring long)
            view, at, index = self.view, self.start, 0
            while have and index < len(lengths):
                start, length = int(starts[index]), int(lengths[index])
                take = min(length, have)
                memory[start:start + take] = view[at:at + take]
                at, have = at + take, have - take
                if take < length:  # its rest comes from the socket
                    starts, lengths = starts[index:].copy(), lengths[index:].copy()
                    starts[0] += take
                    lengths[0] -= take
                    index = 0
                    break
                index += 1
            starts, lengths = starts[index:], lengths[index:]
            self.start = at
        if not len(lengths):
            return
        self.start = self.end = 0
        self.drained = False  # more may be queued behind it
        self.exact = True
        want = int(lengths.sum())
        try:
            if self.server.fast is not None:
                got = self.server.fast.recv_scatter(  # type: ignore[attr-defined]
                    self.sock.fileno(), memory, starts, lengths)
            else:
                got = self._recvmsg_all(wire.ReceiveVector(memory, starts, lengths, want,
                                                           vector.request_id).targets)
        except BlockingIOError:
            raise Stalled(f"vector payload stalled with up to {want} bytes to come") from None
        if got != want:
            raise PeerGone()

    def _recvmsg_all(self, targets: list[memoryview]) -> int:
        """recv_scatter in Python: bytes received into `targets`, short at end-of-file."""
        queue = BufferQueue(targets)  # type: ignore[arg-type]
        while queue.left:
            got = self.sock.recvmsg_into(queue.chunk(), 0, socket.MSG_WAITALL)[0]
            if not got:
                break
            queue.advance(got)
        return queue.moved

    def _recv_exact(self, target: memoryview) -> None:
        """Fill `target` from the socket: no intermediate buffer, one call per payload."""
        self.drained = False  # more may be queued behind it
        size = len(target)
        filled = 0
        while filled < size:
            try:
                got = self.sock.recv_into(target[filled:] if filled else target, size - filled,
                                          socket.MSG_WAITALL)
            except BlockingIOError:
                raise Stalled(f"payload stalled at {filled} of {size} bytes") from None
            if not got:
                raise PeerGone()
            filled += got

    def _recv_with_more(self, target: memoryview, ring: memoryview) -> None:
        """Fill `target`, and take whatever follows it that is already here into `ring`
        (the empty ring, or its first 48 bytes: the next header only).

        One scatter read per payload instead of two reads; the payload lands in segment
        memory, what comes after it in the ring.
        """
        size = len(target)
        filled = 0
        while True:
            try:
                got = self.sock.recvmsg_into([target[filled:] if filled else target, ring])[0]
            except BlockingIOError:
                raise Stalled(f"payload stalled at {filled} of {size} bytes") from None
            if not got:
                raise PeerGone()
            filled += got
            if filled >= size:
                self.end = filled - size
                self.drained = self.end < len(ring)
                return

    def _drain_before_close(self) -> None:
        """Half-close, then swallow what the peer already sent (bounded in bytes and time).

        Closing with unread input makes the kernel send RST, which can destroy the error
        reply before the peer reads it; a peer that is told why gets to read why.
        """
        self.sock.shutdown(socket.SHUT_WR)
        self.sock.settimeout(_LINGER_S)
        scratch = bytearray(_DISCARD_CHUNK)
        budget = _LINGER_BYTES
        deadline = time.monotonic() + _LINGER_S
        while budget > 0 and time.monotonic() < deadline:
            try:
                got = self.sock.recv_into(scratch)
            except (TimeoutError, BlockingIOError):
                return
            if not got:
                return
            budget -= got

    def _discard(self, count: int) -> None:
        """Read and drop a refused WRITE's payload, keeping the stream in step."""
        here = min(count, self.end - self.start)
        self.start += here  # the part that came into the ring with the header
        count -= here
        if not count:
            return
        scratch = memoryview(bytearray(min(count, _DISCARD_CHUNK)))
        while count:
            chunk = min(count, len(scratch))
            self._recv_exact(scratch[:chunk])
            count -= chunk

    def _send_all(self, buffers: list[Buffer], sent: int) -> None:
        """Send `buffers` past their first `sent` bytes, in as few calls as it takes."""
        out = BufferQueue(buffers)
        out.advance(sent)
        unsent = out.left
        while unsent:
            try:
                sent = self.sock.sendmsg(out.chunk())
            except BlockingIOError:  # SO_SNDTIMEO passed with nothing sent
                raise Stalled("peer stopped reading replies") from None
            out.advance(sent)
            unsent -= sent

    def _flush(self) -> None:
        """Send every gathered reply (headers and READ data, zero-copy) in few calls.

        Then the batch's time (from its first request bytes, or the previous flush, to
        the replies sent) goes to the latency of the directions it served: one
        observation per flush, not per op.
        """
        directions = self._publish()  # before the replies: a client that has them sees the counts
        replies = self.replies
        if not replies:
            pass
        elif len(replies) <= 2:  # a lone reply (and its READ data): one call, no queue
            try:
                sent = self.sock.sendmsg(replies)
            except BlockingIOError:  # SO_SNDTIMEO passed with nothing sent
                raise Stalled("peer stopped reading replies") from None
            if sent != sum(map(len, replies)):
                self._send_all(replies, sent)
        else:
            self._send_all(replies, 0)
        replies.clear()
        self.reply_bytes = 0
        now = _monotonic()
        if directions:
            seconds = now - self.started
            read, write = self.traffic
            if directions & 1:
                write.latency.observe(seconds)
            if directions & 2:
                read.latency.observe(seconds)
        self.started = now
