"""The socket data path, server side: one thread of blocking I/O per connection.

Each frame is checked by the sans-IO `ServerProtocol` before any byte moves; the thread
then receives a WRITE's payload straight into segment memory (`recv_into`, MSG_WAITALL:
one system call per payload) and sends a READ's reply header and data straight out of it
(`sendmsg`). Blocking threads beat an event loop here: bulk receive is one kernel call,
with no readiness round trips. Replies are gathered and flushed together before the
thread would block, so a pipelined batch of small ops costs few system calls.

Authentication: with a cluster token, a connection is served only after the HELLO /
CHALLENGE / AUTH exchange of `hixl.wire` proved the token; a wrong or missing proof gets a
NOT_AUTHENTICATED reply and the connection is closed before any WRITE/READ is looked at.

Timeouts: an idle connection may wait for its next frame forever, but once a frame has
begun, any stall longer than `io_timeout` (SO_RCVTIMEO / SO_SNDTIMEO) closes it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable

from hixl import wire
from hixl.errors import ConfigError
from hixl.transports.tcp import IOV_MAX, Buffer, consume, tune_socket

log = logging.getLogger("hixl.data")

_FLUSH_BYTES = 256 << 10  # send gathered replies once they carry this much data
_FLUSH_BUFFERS = 512  # ... or this many buffers
_DISCARD_CHUNK = 64 << 10
_LINGER_S = 1.0  # after a protocol error: how long to drain the peer before closing
_LINGER_BYTES = 16 << 20
_SCATTER_MAX = 256 << 10  # WRITE payloads up to this size are read with the next header
_STOP_WAIT = 5.0  # stop(): longest wait for all threads to end


class _PeerGone(Exception):
    """EOF or reset from the peer: the connection ends quietly."""


class _Stalled(Exception):
    """A frame stopped half-way for longer than io_timeout."""


class DataServer:
    """Serves WRITE/READ frames against segments found by `resolve(segment_id)`."""

    def __init__(self, resolve: Callable[[int], wire.ServedSegment | None], epoch: int, *,
                 tcp_host: str | None = "127.0.0.1", tcp_port: int = 0,
                 unix_path: str | None = None, max_connections: int = 256,
                 io_timeout: float = 30.0, cluster_token: bytes | None = None) -> None:
        if tcp_host is None and unix_path is None:
            raise ConfigError("data server needs a TCP host or a unix socket path")
        if unix_path is not None and not os.path.isabs(unix_path):
            raise ConfigError(f"unix socket path {unix_path!r} must be absolute")
        self._resolve = resolve
        self._epoch = epoch
        self._tcp_host = tcp_host
        self._tcp_port = tcp_port
        self._unix_path = unix_path
        self._unix_inode: int | None = None
        self._max_connections = max_connections
        self._io_timeout = io_timeout
        self._cluster_token = cluster_token
        self._listeners: list[socket.socket] = []
        self._acceptors: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._live: dict[socket.socket, threading.Thread] = {}
        self._stopping = False
        self._tcp_address = ""
        #: bytes_written / ops_write: WRITE payloads received into segments; bytes_read /
        #: ops_read: READ data sent; refused: requests answered with an error; connections:
        #: accepted in total; connections_rejected: turned away over max_connections;
        #: protocol_errors: connections closed for a bad frame, a stall or an internal error;
        #: auth_failures: those of them refused for a wrong or missing cluster token
        self.counters: dict[str, int] = dict.fromkeys(
            ("bytes_written", "bytes_read", "ops_write", "ops_read", "refused", "connections",
             "connections_rejected", "protocol_errors", "auth_failures"), 0)

    # ------------------------------------------------------------ lifecycle

    @property
    def tcp_address(self) -> str:
        """'host:port' actually bound, '' without TCP."""
        return self._tcp_address

    @property
    def unix_path(self) -> str | None:
        return self._unix_path

    @property
    def live_connections(self) -> int:
        with self._lock:
            return len(self._live)

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
        for sock in self._listeners:
            thread = threading.Thread(target=self._accept_loop, args=(sock,), daemon=True,
                                      name=f"hixl-data-accept-{sock.family.name}")
            thread.start()
            self._acceptors.append(thread)
        log.info("data server listening on %s", ", ".join(
            filter(None, [self._tcp_address and f"tcp://{self._tcp_address}",
                          self._unix_path and f"unix://{self._unix_path}"])))

    def _bind_unix(self, path: str) -> socket.socket:
        """Bind `path` (mode 0660), replacing a stale socket file left by a dead server."""
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
            os.chmod(path, 0o660)
            self._unix_inode = os.lstat(path).st_ino
            sock.listen(128)
        except BaseException:
            sock.close()
            raise
        return sock

    def stop(self) -> None:
        """Close the listeners and every live connection; wait (bounded) for the threads."""
        self._stopping = True
        for sock in self._listeners:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the acceptor blocked in accept()
            sock.close()
        self._listeners.clear()
        with self._lock:
            live = list(self._live.items())
        for sock, _thread in live:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # its thread sees EOF and closes the fd
        deadline = time.monotonic() + _STOP_WAIT
        for thread in self._acceptors + [thread for _sock, thread in live]:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                log.warning("data server thread %s did not stop in time", thread.name)
        self._acceptors.clear()
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

    # ------------------------------------------------------------ accepting

    def _count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self.counters[name] += amount

    def _accept_loop(self, listener: socket.socket) -> None:
        while not self._stopping:
            try:
                sock, peer = listener.accept()
            except OSError as exc:
                if self._stopping:
                    return
                log.warning("data server accept failed: %s", exc)  # e.g. EMFILE: back off
                time.sleep(0.05)
                continue
            thread: threading.Thread | None = None
            with self._lock:  # decided once, so stop() never sees a thread that won't start
                full = len(self._live) >= self._max_connections
                if full:
                    self.counters["connections_rejected"] += 1
                elif not self._stopping:
                    self.counters["connections"] += 1
                    thread = threading.Thread(target=self._serve, args=(sock, peer or "unix"),
                                              daemon=True, name="hixl-data-conn")
                    self._live[sock] = thread
                    thread.start()
            if thread is None:
                if full:
                    log.warning("data server: turning a connection away, %d live is the "
                                "maximum", self._max_connections)
                sock.close()

    # ------------------------------------------------------------ one connection

    def _serve(self, sock: socket.socket, peer: object) -> None:
        try:
            sock.settimeout(None)  # blocking; stalls are bounded by the kernel timeouts
            tune_socket(sock)
            seconds = int(self._io_timeout)
            timeval = struct.pack("ll", seconds, int((self._io_timeout - seconds) * 1e6))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
            _Connection(self, sock, peer).run()
        except (_PeerGone, ConnectionResetError, BrokenPipeError, ConnectionAbortedError):
            log.debug("data connection from %s closed by the peer", peer)
        except _Stalled as exc:
            self._count("protocol_errors")
            log.debug("data connection from %s: %s", peer, exc)
        except Exception:
            self._count("protocol_errors")
            log.debug("data connection from %s failed", peer, exc_info=True)
        finally:
            with self._lock:
                self._live.pop(sock, None)
            sock.close()


class _Connection:
    """The frame loop of one connection (runs in its own thread)."""

    def __init__(self, server: DataServer, sock: socket.socket, peer: object = "") -> None:
        self.server = server
        self.sock = sock
        self.peer = peer
        self.proto = wire.ServerProtocol(server._resolve, server._epoch, server._cluster_token)
        self.header = memoryview(bytearray(wire.HEADER_SIZE))
        self.have = 0  # header bytes already read (with the previous frame's payload)
        self.replies: list[Buffer] = []  # gathered, not yet sent
        self.reply_bytes = 0
        # counted here and published at each flush: no shared lock per frame
        self.counts = dict.fromkeys(("bytes_written", "bytes_read", "ops_write", "ops_read",
                                     "refused"), 0)

    def run(self) -> None:
        try:
            self._loop()
        finally:
            self._publish()

    def _loop(self) -> None:
        proto = self.proto
        replies = self.replies
        counts = self.counts
        while self._read_header():
            action = proto.on_header(self.header)
            kind = type(action)
            if kind is wire.ReceiveInto:
                target = action.target
                if len(target) <= _SCATTER_MAX:
                    self._recv_with_next_header(target)
                else:
                    self._recv_exact(target)
                replies.append(action.reply)
                counts["ops_write"] += 1
                counts["bytes_written"] += len(target)
            elif kind is wire.Send:
                replies.append(action.reply)
                if action.payload is not None:
                    replies.append(action.payload)
                    self.reply_bytes += len(action.payload)
                    counts["ops_read"] += 1
                    counts["bytes_read"] += len(action.payload)
                elif len(action.reply) > wire.HEADER_SIZE:  # only error replies carry text
                    counts["refused"] += 1
            elif kind is wire.Discard:
                self._discard(action.count)
                replies.append(action.reply)
                counts["refused"] += 1
            elif kind is wire.ReadHello:  # HELLO or AUTH payload
                payload = bytearray(action.count)
                self._recv_exact(memoryview(payload))
                answer = proto.on_hello(action.request_id, bytes(payload))
                if type(answer) is wire.Close:
                    self._close(answer)
                    return
                replies.append(answer.reply)
            else:  # wire.Close
                assert isinstance(action, wire.Close)
                self._close(action)
                return
            if len(replies) >= _FLUSH_BUFFERS or self.reply_bytes >= _FLUSH_BYTES:
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
        if action.reply is not None:
            self.replies.append(action.reply)
        with contextlib.suppress(OSError, _Stalled):
            self._flush()
            self._drain_before_close()

    def _publish(self) -> None:
        server = self.server
        with server._lock:
            for name, value in self.counts.items():
                server.counters[name] += value
        for name in self.counts:
            self.counts[name] = 0

    def _read_header(self) -> bool:
        """Complete the next 48-byte header; False on EOF between frames (a clean close).

        Gathered replies are sent before the thread would block: they wait only while
        more frames are already here.
        """
        sock = self.sock
        header = self.header
        got = self.have
        self.have = 0
        if self.replies and got < wire.HEADER_SIZE:
            try:
                n = sock.recv_into(header[got:], wire.HEADER_SIZE - got, socket.MSG_DONTWAIT)
            except BlockingIOError:
                n = -1
            if n == 0:
                if got:
                    raise _PeerGone()
                with contextlib.suppress(OSError, _Stalled):
                    self._flush()  # a half-closed peer still reads its replies
                return False
            got += max(n, 0)
            if got < wire.HEADER_SIZE:
                self._flush()
        while got < wire.HEADER_SIZE:
            try:
                n = sock.recv_into(header[got:] if got else header, wire.HEADER_SIZE - got,
                                   socket.MSG_WAITALL)
            except BlockingIOError:  # SO_RCVTIMEO passed
                if got == 0 and not self.server._stopping:
                    continue  # idle between frames is fine
                raise _Stalled(f"header stalled after {got} bytes") from None
            if not n:
                if got:
                    raise _PeerGone()
                return False
            got += n
        return True

    def _recv_exact(self, target: memoryview) -> None:
        """Fill `target` from the socket: no intermediate buffer, one call per payload."""
        size = len(target)
        filled = 0
        while filled < size:
            try:
                got = self.sock.recv_into(target[filled:] if filled else target, size - filled,
                                          socket.MSG_WAITALL)
            except BlockingIOError:
                raise _Stalled(f"payload stalled at {filled} of {size} bytes") from None
            if not got:
                raise _PeerGone()
            filled += got

    def _recv_with_next_header(self, target: memoryview) -> None:
        """Fill `target`, and take whatever of the next header is already here too.

        One scatter read per small pipelined WRITE instead of two reads; the header bytes
        land in the header buffer, the payload in segment memory, nothing is staged.
        """
        size = len(target)
        filled = 0
        header = self.header
        while True:
            try:
                got = self.sock.recvmsg_into([target[filled:] if filled else target, header])[0]
            except BlockingIOError:
                raise _Stalled(f"payload stalled at {filled} of {size} bytes") from None
            if not got:
                raise _PeerGone()
            filled += got
            if filled >= size:
                self.have = filled - size
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
        scratch = memoryview(bytearray(min(count, _DISCARD_CHUNK)))
        while count:
            chunk = min(count, len(scratch))
            self._recv_exact(scratch[:chunk])
            count -= chunk

    def _flush(self) -> None:
        """Send every gathered reply (headers and READ data, zero-copy) in few calls."""
        self._publish()  # before the replies: a client that has them sees the counts
        buffers = self.replies
        start = 0
        while start < len(buffers):
            try:
                sent = self.sock.sendmsg(buffers[start:start + IOV_MAX])
            except BlockingIOError:  # SO_SNDTIMEO passed with nothing sent
                raise _Stalled("peer stopped reading replies") from None
            start = consume(buffers, start, sent)
        buffers.clear()
        self.reply_bytes = 0
