"""What the agent's data server and the master's store call endpoint share: listening
sockets served by one thread of blocking I/O per connection.

`ThreadPerConnection` owns the accept loop (a connection over `max_connections` is
turned away; a failing accept, e.g. EMFILE, backs off instead of spinning; a connection
whose thread cannot start — the process is out of threads — is closed and counted as
`thread_start_failures`, logged once per burst, and the loop goes on accepting), the live
connection threads (tracked, so `stop` can shut every socket down and wait for its
thread, bounded), and how a connection's end is logged and counted: the peer leaving is
quiet, a stall or a failure counts as a protocol error. Subclasses say what one
connection does (`_run_connection`) and name themselves in the log lines.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable

from hixl.transports.tcp import serve_blocking

STOP_WAIT_S = 5.0  # stop(): longest wait for all threads to end
BURST_QUIET_S = 10.0  # a repeated warning is logged once, then summed up at most this often


class BurstLog:
    """Logs the first of a burst of like events at once, then at most one line per
    `quiet` seconds with how many happened since: a flood of refused connections
    leaves a few lines in the log, not one per connection."""

    def __init__(self, logger: logging.Logger, level: int = logging.WARNING,
                 quiet: float = BURST_QUIET_S) -> None:
        self._log = logger
        self._level = level
        self._quiet = quiet
        self._last = -quiet
        self._suppressed = 0
        self._lock = threading.Lock()

    def note(self, message: str, *args: object) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._last < self._quiet:
                self._suppressed += 1
                return
            suppressed, self._suppressed, self._last = self._suppressed, 0, now
        if suppressed:
            message += " (and %d more like it since the last such line)"
            args = (*args, suppressed)
        self._log.log(self._level, message, *args)


def _start(thread: threading.Thread) -> None:
    thread.start()


class PeerGone(Exception):
    """EOF or reset from the peer: the connection ends quietly."""


class Stalled(Exception):
    """A frame stopped half-way for longer than io_timeout."""


_PEER_LEFT = (PeerGone, ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


class ThreadPerConnection:
    """Accept loop and per-connection threads; see the module docstring.

    Subclasses set `kind` ("data server"), `connection_kind` ("data connection") and
    `thread_name`, keep a `counters` dict with "connections", "connections_rejected",
    "thread_start_failures" and "protocol_errors", call `_init_connections` in their constructor, put their listening sockets in
    `_listeners` and call `_start_accepting`, and call `_stop_connections` from stop().
    """

    log = logging.getLogger("hixl.server")  # each subclass logs under its own name
    kind = "server"
    connection_kind = "connection"
    thread_name = "hixl-conn"
    failure_level = logging.DEBUG  # a connection that failed other than by a stall
    counters: dict[str, int]

    def _init_connections(self, max_connections: int, io_timeout: float, *,
                          start_thread: Callable[[threading.Thread], None] | None = None,
                          ) -> None:
        """`start_thread(thread)` starts a connection's thread (default: `thread.start()`);
        a test passes one that raises RuntimeError, as `Thread.start` does when the
        process cannot have another thread, to show the accept loop survives it."""
        self._start_thread = start_thread or _start
        self._refusals = BurstLog(self.log)
        self._thread_failures = BurstLog(self.log, logging.ERROR)
        self._max_connections = max_connections
        self._io_timeout = io_timeout
        self._lock = threading.Lock()
        self._live: dict[socket.socket, threading.Thread] = {}
        self._listeners: list[socket.socket] = []
        self._acceptors: list[threading.Thread] = []
        self._stopping = False

    @property
    def live_connections(self) -> int:
        with self._lock:
            return len(self._live)

    def _count(self, name: str, amount: int = 1) -> None:
        with self._lock:
            self.counters[name] += amount

    def _start_accepting(self) -> None:
        """One acceptor thread per socket in `_listeners` (bound and listening)."""
        for listener in self._listeners:
            thread = threading.Thread(target=self._accept_loop, args=(listener,), daemon=True,
                                      name=f"{self.thread_name}-accept-{listener.family.name}")
            thread.start()
            self._acceptors.append(thread)

    def _stop_connections(self) -> None:
        """Close the listeners and every live connection; wait (bounded) for the threads."""
        self._stopping = True
        for listener in self._listeners:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)  # wakes the acceptor blocked in accept()
            listener.close()
        self._listeners.clear()
        with self._lock:
            live = list(self._live.items())
        for sock, _ in live:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # its thread sees EOF and closes the fd
        deadline = time.monotonic() + STOP_WAIT_S
        for thread in self._acceptors + [thread for _, thread in live]:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                self.log.warning("%s thread %s did not stop in time", self.kind, thread.name)
        self._acceptors.clear()

    def _accept_loop(self, listener: socket.socket) -> None:
        while not self._stopping:
            try:
                sock, peer = listener.accept()
            except OSError as exc:
                if self._stopping:
                    return
                self.log.warning("%s: accept failed: %s", self.kind, exc)  # e.g. EMFILE: back off
                time.sleep(0.05)
                continue
            thread: threading.Thread | None = None
            failure: BaseException | None = None
            with self._lock:  # decided once, so stop() never misses a thread
                full = len(self._live) >= self._max_connections
                if full:
                    self.counters["connections_rejected"] += 1
                elif not self._stopping:
                    thread = threading.Thread(target=self._serve, args=(sock, peer or "unix"),
                                              daemon=True, name=self.thread_name)
                    try:
                        self._start_thread(thread)  # under the lock: stop() joins only started threads
                    except Exception as exc:  # noqa: BLE001 - RuntimeError: out of threads
                        failure, thread = exc, None
                        self.counters["thread_start_failures"] += 1
                        self.counters["connections_rejected"] += 1
                    else:
                        self.counters["connections"] += 1
                        self._accepted_locked(listener)
                        self._live[sock] = thread
            if thread is None:
                if failure is not None:
                    self._thread_failures.note(
                        "%s: closing a new connection, no thread could be started for it "
                        "(%s); still accepting", self.kind, failure)
                elif full:
                    self._refusals.note("%s: turning a connection away, %d live is the maximum",
                                        self.kind, self._max_connections)
                sock.close()

    def _serve(self, sock: socket.socket, peer: object) -> None:
        try:
            serve_blocking(sock, self._io_timeout)
            self._run_connection(sock, peer)
        except _PEER_LEFT:
            self.log.debug("%s from %s closed by the peer", self.connection_kind, peer)
        except Stalled as exc:
            self._count("protocol_errors")
            self.log.debug("%s from %s: %s", self.connection_kind, peer, exc)
        except Exception:
            self._count("protocol_errors")
            self.log.log(self.failure_level, "%s from %s failed", self.connection_kind, peer,
                    exc_info=True)
        finally:
            with self._lock:
                self._live.pop(sock, None)
                self._forget_locked(sock)
            sock.close()

    # ------------------------------------------------------------ what subclasses add

    def _run_connection(self, sock: socket.socket, peer: object) -> None:
        """Serve one accepted connection until it ends (raise PeerGone / Stalled)."""
        raise NotImplementedError

    def _accepted_locked(self, listener: socket.socket) -> None:
        """A connection on `listener` is being served (lock held): count it if wanted."""

    def _forget_locked(self, sock: socket.socket) -> None:
        """The connection on `sock` ended (lock held): drop what was kept for it."""


__all__ = ["BurstLog", "PeerGone", "Stalled", "ThreadPerConnection"]
