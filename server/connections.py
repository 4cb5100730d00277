"""What the agent's data server and the master's store call endpoint share: listening
sockets served by one thread of blocking I/O per connection.

`ThreadPerConnection` owns the accept loop (a failing accept, e.g. EMFILE, backs off
instead of spinning; a connection whose thread cannot start — the process is out of
threads — is closed and counted as `thread_start_failures`, logged once per burst, and the
loop goes on accepting), the live connection threads (tracked, so `stop` can shut every
socket down and wait for its thread, bounded), and how a connection's end is logged and
counted: the peer leaving is quiet, a stall or a failure counts as a protocol error.
Subclasses say what one connection does (`_run_connection`) and name themselves in the
log lines.

Pre-authentication connections are kept apart from authenticated ones, so that
connections that never finish the handshake cannot keep token holders out:

* a new connection is *pending* until its handshake completes (the subclass calls
  `_admit` once the protocol says the peer is authenticated, or right after HELLO when
  no cluster token is set). Each listener (TCP, the unix socket) has its own budget of
  `preauth_connections` pending connections; when it is full, the *oldest* pending
  connection on that listener is shut down to make room (`preauth_evicted`), so a
  newcomer is always taken: an outsider holding every pending slot delays an honest
  client by nothing, and can only push it out by opening `preauth_connections` more
  connections during the few round trips of its handshake;
* a pending connection has `handshake_timeout` seconds, from accept, to authenticate;
  one reaper thread per server shuts down those that did not (`handshake_timeouts`);
* only `_admit` takes one of the `max_connections` authenticated slots; when they are
  all taken the connection is closed at that point (`connections_rejected`), exactly as
  a client turned away at accept saw it before.

Threads stay bounded: at most `max_connections` authenticated plus `preauth_connections`
per listener pending (a connection over that hard cap, e.g. while evicted threads are
still exiting, is closed at accept). Warnings about refused, evicted or timed-out
connections are logged once per burst (`BurstLog`), never once per connection.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable

from hixl.sockets import serve_blocking

STOP_WAIT_S = 5.0  # stop(): longest wait for all threads to end
#: seconds from accept for a connection to complete HELLO (and AUTH, with a cluster token)
HANDSHAKE_TIMEOUT_S = 5.0
#: pending (not yet authenticated) connections per listener; the oldest makes room
PREAUTH_CONNECTIONS = 64
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
    "thread_start_failures", "preauth_evicted", "handshake_timeouts" and "protocol_errors",
    call `_admit` once a connection authenticated (and end it if that says no), call `_init_connections` in their constructor, put their listening sockets in
    `_listeners` and call `_start_accepting`, and call `_stop_connections` from stop().
    """

    log = logging.getLogger("hixl.server")  # each subclass logs under its own name
    kind = "server"
    connection_kind = "connection"
    thread_name = "hixl-conn"
    failure_level = logging.DEBUG  # a connection that failed other than by a stall
    counters: dict[str, int]

    def _init_connections(self, max_connections: int, io_timeout: float, *,
                          handshake_timeout: float = HANDSHAKE_TIMEOUT_S,
                          preauth_connections: int = PREAUTH_CONNECTIONS,
                          start_thread: Callable[[threading.Thread], None] | None = None,
                          ) -> None:
        """`start_thread(thread)` starts a connection's thread (default: `thread.start()`);
        a test passes one that raises RuntimeError, as `Thread.start` does when the
        process cannot have another thread, to show the accept loop survives it.
        `handshake_timeout` (s) and `preauth_connections` (per listener): the module
        docstring."""
        if handshake_timeout <= 0 or preauth_connections < 1:
            raise ValueError("handshake_timeout must be > 0 and preauth_connections >= 1")
        self._start_thread = start_thread or _start
        self._refusals = BurstLog(self.log)
        self._thread_failures = BurstLog(self.log, logging.ERROR)
        self._evictions = BurstLog(self.log)
        self._timeouts = BurstLog(self.log, logging.INFO)
        self._max_connections = max_connections
        self._io_timeout = io_timeout
        self._handshake_timeout = handshake_timeout
        self._preauth_max = preauth_connections
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # wakes the reaper
        self._live: dict[socket.socket, threading.Thread] = {}
        # pending connections per listener, oldest first, with their handshake deadline
        self._pending: dict[socket.socket, dict[socket.socket, float]] = {}
        self._pending_of: dict[socket.socket, dict[socket.socket, float]] = {}
        self._admitted: set[socket.socket] = set()
        self._listeners: list[socket.socket] = []
        self._acceptors: list[threading.Thread] = []
        self._stopping = False

    @property
    def live_connections(self) -> int:
        with self._lock:
            return len(self._live)

    @property
    def pending_connections(self) -> int:
        """Connections accepted that have not completed the handshake yet."""
        with self._lock:
            return len(self._pending_of)

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
        reaper = threading.Thread(target=self._reap_loop, daemon=True,
                                  name=f"{self.thread_name}-handshake-deadline")
        reaper.start()
        self._acceptors.append(reaper)

    def _stop_connections(self) -> None:
        """Close the listeners and every live connection; wait (bounded) for the threads."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()  # the reaper ends
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
            full = evicted = False
            with self._lock:  # decided once, so stop() never misses a thread
                pending = self._pending.setdefault(listener, {})
                cap = self._max_connections + self._preauth_max * max(1, len(self._listeners))
                full = len(self._live) >= cap
                if full:
                    self.counters["connections_rejected"] += 1
                elif not self._stopping:
                    if len(pending) >= self._preauth_max:  # the oldest makes room
                        self._drop_pending_locked(next(iter(pending)))
                        self.counters["preauth_evicted"] += 1
                        evicted = True
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
                        pending[sock] = time.monotonic() + self._handshake_timeout
                        self._pending_of[sock] = pending
                        if len(pending) == 1:
                            self._cond.notify()  # the reaper may be waiting with no deadline
            if evicted:
                self._evictions.note(
                    "%s: %d connections on %s are waiting for their handshake, the maximum: "
                    "closed the oldest to take a new one", self.kind, self._preauth_max,
                    listener.family.name)
            if thread is None:
                if failure is not None:
                    self._thread_failures.note(
                        "%s: closing a new connection, no thread could be started for it "
                        "(%s); still accepting", self.kind, failure)
                elif full:
                    self._refusals.note("%s: turning a connection away, %d live is the maximum",
                                        self.kind, cap)
                sock.close()

    def _drop_pending_locked(self, sock: socket.socket) -> None:
        """End a pending connection (lock held): out of the budget at once; its thread sees
        EOF and exits. Under the lock, so its socket cannot have been closed yet."""
        pending = self._pending_of.pop(sock)
        del pending[sock]
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)

    def _reap_loop(self) -> None:
        """Shut down every pending connection whose handshake deadline passed."""
        while True:
            expired = 0
            with self._cond:
                if self._stopping:
                    return
                now = time.monotonic()
                wake: float | None = None
                for pending in self._pending.values():
                    while pending:  # oldest first: deadlines are in order
                        sock, deadline = next(iter(pending.items()))
                        if deadline > now:
                            wake = deadline if wake is None else min(wake, deadline)
                            break
                        self._drop_pending_locked(sock)
                        expired += 1
                self.counters["handshake_timeouts"] += expired
                if not expired:
                    self._cond.wait(None if wake is None else wake - now)
                    continue
            self._timeouts.note("%s: closed %d connections that did not complete the "
                                "handshake within %g s", self.kind, expired,
                                self._handshake_timeout)

    def _admit(self, sock: socket.socket) -> bool:
        """The connection on `sock` has authenticated: move it from the pending budget to
        an authenticated slot. False when it must close instead: all `max_connections`
        slots are taken, or it was evicted or timed out meanwhile."""
        with self._lock:
            if sock in self._admitted:
                return True
            pending = self._pending_of.pop(sock, None)
            if pending is None:
                return False
            del pending[sock]
            if len(self._admitted) < self._max_connections:
                self._admitted.add(sock)
                return True
            self.counters["connections_rejected"] += 1
        self._refusals.note("%s: turning an authenticated connection away, %d is the maximum",
                            self.kind, self._max_connections)
        return False

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
                pending = self._pending_of.pop(sock, None)
                if pending is not None:
                    del pending[sock]
                self._admitted.discard(sock)
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


__all__ = ["HANDSHAKE_TIMEOUT_S", "PREAUTH_CONNECTIONS", "BurstLog", "PeerGone", "Stalled",
           "ThreadPerConnection"]
