"""The one process launcher of the tools, benches, tests and scripts.

Each of them starts daemons and helpers (a hixl-agent, a hixl-master, a segment holder, a
worker) for a while. `DaemonProcess` does it one way: spawn the command, wait under a
deadline for the line that says it is ready (an error naming it, with the tail of its
log, if it exits or the deadline passes first), stop it for sure (ask, wait a bounded
time, kill). A thread drains its stdout the whole time, so a chatty child never blocks on
a full pipe. `free_port` picks a port for a server that must be told its port in advance
(a restart on the same port, a config written before the start).

Core: imports neither hixl.server nor hixl.client, so that every side may use it.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import random
import re
import socket
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar

START_TIMEOUT_S = 30.0  # the ready line's default deadline
STOP_GRACE_S = 10.0     # how long stop() waits for a polite exit before it kills
KILL_WAIT_S = 30.0      # how long kill() waits for a SIGKILLed process to be reaped
TAIL_CHARS = 6000       # how much of a log an error quotes

_D = TypeVar("_D", bound="DaemonProcess")


_PORT_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_RESERVED_PORTS_FILE = "/proc/sys/net/ipv4/ip_local_reserved_ports"
_LOWEST_PICK = 10000  # below this, well-known and registered services live
_PICK_TRIES = 200


def _ephemeral_range() -> tuple[int, int] | None:
    """The kernel's range for bind(0) and connect() ports (this network namespace's)."""
    try:
        with open(_PORT_RANGE_FILE, encoding="ascii") as f:
            low, high = (int(field) for field in f.read().split())
        return low, high
    except (OSError, ValueError):
        return None


def _reserved_ports() -> set[int]:
    """ip_local_reserved_ports ("8000,9000-9010"): ports an operator set aside."""
    reserved: set[int] = set()
    with contextlib.suppress(OSError, ValueError), \
            open(_RESERVED_PORTS_FILE, encoding="ascii") as f:
        for part in f.read().strip().split(","):
            if part:
                first, _, last = part.partition("-")
                reserved.update(range(int(first), int(last or first) + 1))
    return reserved


def _bindable(family: socket.AddressFamily, host: str, port: int) -> socket.socket | None:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, port))
        return sock
    except OSError:
        sock.close()
        return None


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct TCP ports nothing listens on now, for servers that must be told
    their port before they start (a restart on the same port, a config written first).

    They are picked at random *below* the kernel's ephemeral range: a port from that range
    (what bind(host, 0) hands out) may meanwhile be given to any socket that binds port 0
    or connects out (another daemon's data listener, a client connection), and the
    server told to use it then fails with "address in use". Below the range only another
    explicit choice can take it. Falls back to bind(0) where the range is unknown or
    leaves no room. A server that can bind port 0 and report its port should do that.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    span = _ephemeral_range()
    pick = random.SystemRandom()
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        if span is not None and span[0] - _LOWEST_PICK >= 1000:
            skip = _reserved_ports()
            for _ in range(_PICK_TRIES):
                if len(ports) == count:
                    break
                port = pick.randrange(_LOWEST_PICK, span[0])
                if port in skip or port in ports:
                    continue
                sock = _bindable(family, host, port)
                if sock is not None:
                    held.enter_context(sock)
                    ports.append(port)
        while len(ports) < count:
            sock = held.enter_context(socket.socket(family, socket.SOCK_STREAM))
            sock.bind((host, 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (see free_ports)."""
    return free_ports(1, host)[0]


def kill_process(proc: subprocess.Popen[Any]) -> int:
    """SIGKILL `proc` (if it still runs) and wait until it is gone; its exit status."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    return proc.wait(KILL_WAIT_S)


def stop_process(proc: subprocess.Popen[Any], grace_s: float = STOP_GRACE_S, *,
                 by: Literal["sigterm", "stdin"] = "sigterm") -> int:
    """Ask `proc` to go (SIGTERM, or EOF on its stdin), wait up to `grace_s`, then kill:
    never hangs. Its exit status."""
    if proc.poll() is None:
        with contextlib.suppress(OSError, ValueError):
            if by == "stdin":
                assert proc.stdin is not None
                proc.stdin.close()
            else:
                proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            return proc.wait(grace_s)
    return kill_process(proc)


class ProcessNotReady(RuntimeError):
    """A started process exited, or missed its deadline, before its ready line; the
    message names it and quotes its log tail. Callers re-raise their own error type."""

    def __init__(self, message: str, returncode: int | None) -> None:
        super().__init__(message)
        self.returncode = returncode


def _tail_of_file(path: str, limit: int) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()[-limit:]
    except OSError as exc:
        return f"(no log: {exc})"


class DaemonProcess:
    """A child process started for a while, by argv, with `env` (None: ours).

    `ready` is the prefix of the line on stdout saying it serves (or a compiled regex
    searched in each line; None: nothing to wait for); `wait_ready()` waits for it. stderr
    goes to `log_path` (appended) when given, else into stdout with the rest of its output.
    `stop_by` is how stop() asks it to go: "sigterm", or "stdin" for helpers that exit when
    their stdin closes; `grace_s`, how long stop() waits before it kills. stdin is a pipe
    for "stdin", else /dev/null, unless `stdin` says otherwise. `lines=True` queues every
    line after the ready one for next_line(); `on_line` is called (on the reader thread)
    with each of them, and with "" once at EOF. `spawn` makes the Popen (a simulated
    host's, say); other keywords go to it.
    """

    def __init__(self, argv: Sequence[str], *, name: str | None = None,
                 ready: str | re.Pattern[str] | None = None,
                 env: Mapping[str, str] | None = None, log_path: str | None = None,
                 stop_by: Literal["sigterm", "stdin"] = "sigterm",
                 stdin: int | None = None, lines: bool = False,
                 on_line: Callable[[str], None] | None = None,
                 spawn: Callable[..., subprocess.Popen[str]] = subprocess.Popen,
                 grace_s: float = STOP_GRACE_S, tail_lines: int = 40, **popen: Any) -> None:
        self.argv = list(argv)
        self.name = name or os.path.basename(self.argv[0])
        self.log_path = log_path
        self.stop_by = stop_by
        self.grace_s = grace_s
        self.ready_line: str | None = None
        self.ready_match: re.Match[str] | None = None
        self._ready = (None if ready is None else ready if isinstance(ready, re.Pattern)
                       else re.compile(re.escape(ready)))
        self._prefix_only = isinstance(ready, str)
        self._tail: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self._lines: queue.Queue[str] | None = queue.Queue() if lines else None
        self._on_line = on_line
        self._settled = threading.Event()  # the ready line came, or EOF did
        if stdin is None:
            stdin = subprocess.PIPE if stop_by == "stdin" else subprocess.DEVNULL
        with contextlib.ExitStack() as stack:
            stderr: Any = subprocess.STDOUT
            if log_path is not None:
                stderr = stack.enter_context(open(log_path, "a", encoding="utf-8"))
            self.proc = spawn(self.argv, stdin=stdin, stdout=subprocess.PIPE, stderr=stderr,
                              encoding="utf-8", errors="replace",
                              env=None if env is None else dict(env), **popen)
        assert self.proc.stdout is not None
        self._reader = threading.Thread(target=self._read, args=(self.proc.stdout,),
                                        daemon=True, name=f"hixl-{self.name}-output")
        self._reader.start()

    # ------------------------------------------------------------ output

    def _matches(self, line: str) -> re.Match[str] | None:
        assert self._ready is not None
        return self._ready.match(line) if self._prefix_only else self._ready.search(line)

    def _read(self, stream: Any) -> None:
        try:
            for line in stream:
                self._tail.append(line.rstrip("\n"))
                if self._ready is not None and self.ready_line is None:
                    match = self._matches(line)
                    if match is None:
                        continue
                    self.ready_match, self.ready_line = match, line.strip()
                    self._settled.set()
                    continue
                if self._lines is not None:
                    self._lines.put(line)
                if self._on_line is not None:
                    self._on_line(line)
        except (OSError, ValueError):  # the pipe closed under us: EOF all the same
            pass
        finally:
            with contextlib.suppress(OSError, ValueError):
                stream.close()
            if self._lines is not None:
                self._lines.put("")
            if self._on_line is not None:
                self._on_line("")
            self._settled.set()

    def next_line(self, timeout: float) -> str | None:
        """The next line after the ready one (needs lines=True): "" at EOF, None when
        `timeout` s pass first."""
        assert self._lines is not None, "started without lines=True"
        try:
            line = self._lines.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return None
        if line == "":
            self._lines.put("")  # EOF stays EOF for the next caller
        return line

    def log(self) -> str:
        """Its whole log file; without one, the last lines of its output."""
        if self.log_path is not None:
            return _tail_of_file(self.log_path, 1 << 30)
        return "\n".join(self._tail)

    def tail(self, limit: int = TAIL_CHARS) -> str:
        """The end of its log and of its output, for an error message."""
        parts = []
        if self.log_path is not None:
            parts.append(f"its log ({self.log_path}):\n{_tail_of_file(self.log_path, limit)}")
        if self._tail:
            parts.append("its output:\n" + "\n".join(self._tail)[-limit:])
        return "\n".join(parts) or "(no output)"

    # ------------------------------------------------------------ start and stop

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> str:
        """Its ready line (stripped), once it printed it. If it exits or `timeout` s pass
        first, it is killed and ProcessNotReady raised with its log tail."""
        assert self._ready is not None, f"{self.name} has no ready line to wait for"
        self._settled.wait(timeout)
        if self.ready_line is not None:
            return self.ready_line
        if self._settled.is_set():  # EOF: it exited, or closed its stdout
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(5)
            why = (f"exited with status {self.proc.returncode}"
                   if self.proc.returncode is not None else "closed its output")
        else:
            why = f"was not ready after {timeout:g} s"
        with contextlib.suppress(subprocess.TimeoutExpired, OSError):
            self.kill()
        raise ProcessNotReady(f"{self.name} {why}; {self.tail()}", self.proc.returncode)

    @property
    def ready_fields(self) -> dict[str, str]:
        """The key=value words of its ready line (a hixl-agent's engine=, data=, ...)."""
        return dict(word.split("=", 1) for word in (self.ready_line or "").split()
                    if "=" in word)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, text: str) -> bool:
        """Write `text` to its stdin (a pipe); False if it no longer reads it."""
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(text)
            self.proc.stdin.flush()
        except (OSError, ValueError):
            return False
        return True

    def kill(self) -> int:
        """SIGKILL, and wait until it is gone; its exit status."""
        return kill_process(self.proc)

    def stop(self, grace_s: float | None = None) -> int:
        """Ask it to go (SIGTERM, or EOF on its stdin), wait up to `grace_s` (default: the
        one it was started with), then kill: never hangs. Its exit status."""
        return stop_process(self.proc, self.grace_s if grace_s is None else grace_s,
                            by=self.stop_by)

    def close(self) -> None:
        """stop(), then let go of its pipes."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.stop()
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError, ValueError):
                self.proc.stdin.close()
        self._reader.join(1.0)  # EOF follows its exit (unless a child of its holds the pipe)

    def __enter__(self: _D) -> _D:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["DaemonProcess", "ProcessNotReady", "free_port", "free_ports", "kill_process",
           "stop_process"]
