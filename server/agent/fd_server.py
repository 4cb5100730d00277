"""The agent's fd socket: hands segment fds to same-node peers, takes fds from clients.

A unix SOCK_SEQPACKET socket (message boundaries kept, fds carried by SCM_RIGHTS). Each
request is one small JSON message, each reply one JSON message, with an fd attached for a
granted GetFd or GetStates: the messages and their codec are `hixl.fd_wire` (GetFd,
GetStates, Deposit, Ping -> FdGranted, StatesGranted, Deposited, Pong, or Refused).

A segment registered inside a bigger shared allocation is granted the allocation's fd
with the range's `offset` in it; `slot` is its liveness word in the get_states file
(hixl.segment_states), which peers read around every mapped copy.

Peers are checked by SO_PEERCRED uid against `allowed_uids`; a get_fd's "engine" names
the engine asking, checked against the segment's allow-list (absent: unnamed, which a
segment with an allow-list refuses). One thread serves every connection through a
selector; a malformed or hostile request gets an error reply (or its connection closed)
and never stops the server.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import selectors
import socket
import stat
import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from hixl import fd_wire
from hixl.errors import HixlError, ParamInvalid, PermissionDenied, ResourceExhausted
from hixl.memory import size_sealed
from hixl.server.agent.agent import UNSEALED, Agent
from hixl.server.agent.data_server import Peer

log = logging.getLogger("hixl.fd_server")

MAX_REQUEST = fd_wire.MAX_REQUEST
MAX_FDS_PER_MESSAGE = fd_wire.MAX_FDS_PER_MESSAGE
TICKET_TTL_S = 60.0
_PEERCRED = struct.Struct("3i")
UNIX_PATH_MAX = 107  # sun_path is 108 bytes including the terminating NUL


def prepare_socket_path(path: str) -> None:
    """Make `path` bindable: refuse a live server there, remove a stale socket file.

    Raises HixlError naming the path when another process is serving it, or when the
    path is something other than a socket (never deletes a regular file).
    """
    if len(os.fsencode(path)) > UNIX_PATH_MAX:
        raise ParamInvalid(
            f"unix socket path {path!r} is longer than {UNIX_PATH_MAX} bytes; "
            "choose a shorter runtime_dir")
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ParamInvalid(f"{path} exists and is not a socket; refusing to replace it")
    for kind in (socket.SOCK_SEQPACKET, socket.SOCK_STREAM):
        probe = socket.socket(socket.AF_UNIX, kind)
        try:
            probe.settimeout(1.0)
            probe.connect(path)
        except OSError as exc:
            if exc.errno == errno.EPROTOTYPE:
                continue  # other socket type: try the next one
            break  # refused / not listening: a stale file left by a dead process
        else:
            raise ResourceExhausted(f"another process is already serving on {path}")
        finally:
            probe.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class TicketBook:
    """Deposited fds waiting for RegisterSegment: single use, valid `ttl` seconds."""

    def __init__(self, ttl: float = TICKET_TTL_S, max_tickets: int = 1024) -> None:
        self._ttl = ttl
        self._max = max_tickets
        self._lock = threading.Lock()
        self._tickets: dict[str, tuple[int, int, float]] = {}  # ticket -> (fd, length, expiry)

    def put(self, fd: int, length: int) -> str:
        """Take ownership of `fd`; the returned ticket redeems it once."""
        with self._lock:
            self._expire_locked()
            if len(self._tickets) >= self._max:
                raise ResourceExhausted(
                    f"{len(self._tickets)} deposited fds await registration; "
                    "register or let them expire first")
            ticket = secrets.token_hex(16)
            self._tickets[ticket] = (fd, length, time.monotonic() + self._ttl)
            return ticket

    def take(self, ticket: str) -> tuple[int, int]:
        """(fd, length) for a live ticket; the caller now owns the fd."""
        with self._lock:
            self._expire_locked()
            hit = self._tickets.pop(ticket, None)
        if hit is None:
            raise ParamInvalid(
                f"fd ticket {ticket[:12]!r}... is unknown, already used or expired "
                f"(tickets last {self._ttl:.0f} s); deposit the fd again")
        return hit[0], hit[1]

    def __len__(self) -> int:
        return len(self._tickets)

    def _expire_locked(self) -> None:
        now = time.monotonic()
        for ticket in [t for t, (_, _, exp) in self._tickets.items() if exp <= now]:
            fd = self._tickets.pop(ticket)[0]
            with contextlib.suppress(OSError):
                os.close(fd)

    def close(self) -> None:
        with self._lock:
            tickets, self._tickets = self._tickets, {}
        for fd, _, _ in tickets.values():
            with contextlib.suppress(OSError):
                os.close(fd)


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    uid: int
    pid: int
    refusal: str = ""  # non-empty: answer the first request with this, then close
    since: float = 0.0  # time.monotonic() at accept


class FdServer:
    """SOCK_SEQPACKET server on `path`, serving `agent`'s fds in one background thread."""

    def __init__(self, path: str, agent: Agent, tickets: TicketBook, *, mode: int = 0o660,
                 allowed_uids: Iterable[int] = (), max_connections: int = 256) -> None:
        self.path = path
        self._agent = agent
        self._tickets = tickets
        self._mode = mode
        self._allowed = frozenset(allowed_uids)
        self._max_connections = max_connections
        self._selector = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._conns: dict[int, _Conn] = {}
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.counters = {"fd_connections": 0, "fd_requests": 0, "fd_errors": 0,
                         "fd_refused_peers": 0, "fd_deposits": 0}

    def peers(self) -> list[Peer]:
        """Each process connected to the fd socket now (pid and uid, from SO_PEERCRED)."""
        now = time.monotonic()
        for _ in range(3):  # the selector thread may change the dict while we copy it
            try:
                conns = list(self._conns.values())
                break
            except RuntimeError:
                continue
        else:
            conns = []
        return [Peer("fd", f"pid {c.pid} uid {c.uid}", "", now - c.since) for c in conns]

    def start(self) -> None:
        prepare_socket_path(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            listener.bind(self.path)
            os.chmod(self.path, self._mode)  # before listen(): nobody connects in between
            listener.listen(64)
            listener.setblocking(False)
        except OSError as exc:
            listener.close()
            raise HixlError(f"cannot serve the fd socket {self.path}: {exc.strerror}") from None
        self._listener = listener
        self._wake_r.setblocking(False)
        self._selector.register(listener, selectors.EVENT_READ, None)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._run, name="hixl-fd-server", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop serving, close every connection and remove the socket file."""
        self._stopping = True
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        for conn in list(self._conns.values()):
            self._drop(conn)
        if self._listener is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(self._listener)
            self._listener.close()
            self._listener = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()

    # ------------------------------------------------------------ loop

    def _run(self) -> None:
        while not self._stopping:
            try:
                events = self._selector.select(timeout=1.0)
            except OSError:  # pragma: no cover - selector closed under us
                return
            for key, _ in events:
                if key.data == "wake":
                    return
                try:
                    if key.data is None:
                        self._accept()
                    else:
                        self._serve(key.data)
                except Exception:  # noqa: BLE001 - nothing a peer sends may kill the server
                    log.exception("fd socket: unexpected error; dropping that connection")
                    if isinstance(key.data, _Conn):
                        self._drop(key.data)

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        if len(self._conns) >= self._max_connections:
            log.warning("fd socket: %d connections open; refusing one more", len(self._conns))
            sock.close()
            return
        sock.setblocking(False)
        pid, uid, _gid = _PEERCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        conn = _Conn(sock, uid, pid, since=time.monotonic())
        if self._allowed and uid not in self._allowed:
            self.counters["fd_refused_peers"] += 1
            conn.refusal = (
                f"uid {uid} (pid {pid}) may not use the fd socket {self.path}; allowed uids: "
                f"{sorted(self._allowed)} (allowed_uids in the agent config)")
            log.warning("fd socket: %s", conn.refusal)
        self._conns[sock.fileno()] = conn
        self._selector.register(sock, selectors.EVENT_READ, conn)
        self.counters["fd_connections"] += 1

    def _serve(self, conn: _Conn) -> None:
        try:
            data, fds, flags, _ = socket.recv_fds(conn.sock, MAX_REQUEST, MAX_FDS_PER_MESSAGE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        if not data and not fds:
            self._drop(conn)  # the peer closed
            return
        self.counters["fd_requests"] += 1
        try:
            if conn.refusal:
                raise PermissionDenied(conn.refusal)
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise ParamInvalid(
                    f"request too large: at most {MAX_REQUEST} bytes and "
                    f"{MAX_FDS_PER_MESSAGE} fds per message")
            reply, out_fd = self._handle(data, fds)
            fds = []  # _handle took ownership of any fds it used
        except HixlError as exc:
            self.counters["fd_errors"] += 1
            reply, out_fd = fd_wire.Refused.of(exc), None
        finally:
            for fd in fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._reply(conn, reply, out_fd)
        if conn.refusal:
            self._drop(conn)

    def _handle(self, data: bytes, fds: list[int]) -> tuple[fd_wire.Reply, int | None]:
        request = fd_wire.decode_request(data, len(fds))
        if isinstance(request, fd_wire.Ping):
            return fd_wire.Pong(self._agent.epoch, self._agent.engine_name), None
        if isinstance(request, fd_wire.GetFd):
            # checks the epoch first, then the allow-list and permissions
            grant = self._agent.grant(request.segment_id, request.epoch, request.write,
                                      request.engine)
            return fd_wire.FdGranted(grant.length, grant.offset, grant.slot), grant.fd
        if isinstance(request, fd_wire.GetStates):
            states = self._agent.states
            return fd_wire.StatesGranted(states.capacity), states.export_fd()
        length = request.length  # a Deposit, with its one fd
        st = os.fstat(fds[0])
        if not stat.S_ISREG(st.st_mode):
            raise ParamInvalid("deposit: the fd is not a memfd or shm file")
        if not size_sealed(fds[0]):
            raise ParamInvalid(UNSEALED.format(what="deposit"))
        if st.st_size < length:
            raise ParamInvalid(
                f"deposit: the file holds {st.st_size} bytes, fewer than length {length}")
        ticket = self._tickets.put(fds[0], length)
        fds.clear()  # the ticket book owns it now
        self.counters["fd_deposits"] += 1
        return fd_wire.Deposited(ticket), None

    def _reply(self, conn: _Conn, reply: fd_wire.Reply, fd: int | None) -> None:
        payload = fd_wire.encode_reply(reply)
        try:
            if fd is None:
                conn.sock.send(payload)
            else:
                socket.send_fds(conn.sock, [payload], [fd])
        except OSError as exc:  # a peer that does not read its replies loses its connection
            log.info("fd socket: cannot reply to pid %d (%s); closing", conn.pid, exc)
            self._drop(conn)
        finally:
            if fd is not None:
                os.close(fd)

    def _drop(self, conn: _Conn) -> None:
        if self._conns.pop(conn.sock.fileno(), None) is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self._selector.unregister(conn.sock)
        conn.sock.close()

