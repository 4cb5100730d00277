"""Waiting for a condition in tests, with a deadline that only proves "does not hang": the
one polling helper of the suite (no test module keeps its own).

    import waiting
    wait_for = partial(waiting.wait_until, timeout=WAIT_S)  # the module's own deadline
    wait_for(lambda: etcd.get("k") is None, "the key expires")
    stats = wait_for(check.stats, "the release", done=lambda s: s["reservations"] == 0)

Nothing asserts how long the wait took; `timeout` is far beyond what a healthy run needs.
"""

from __future__ import annotations

import reprlib
import select
import socket
import time
from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")


def wait_until(predicate: Callable[[], _T], what: str, timeout: float,
               interval: float = 0.05, *, done: Callable[[_T], object] | None = None,
               retry_on: tuple[type[BaseException], ...] = (),
               detail: Callable[[], object] | None = None) -> _T:
    """Call `predicate` every `interval` s until its result is true, or, given `done`, until
    `done(result)` is; return that result. Once `timeout` s pass first, fail the test with
    an AssertionError naming `what`, the last result and `detail()` if given (a daemon's
    log, say). An exception of a `retry_on` type counts as "not yet" (a daemon still
    starting); any other propagates at once."""
    deadline = time.monotonic() + timeout
    while True:
        last: Any
        try:
            result = predicate()
        except retry_on as exc:
            last = f"raised {exc!r}"
        else:
            if done(result) if done is not None else result:
                return result
            last = f"still {reprlib.repr(result)}"
        if time.monotonic() >= deadline:
            more = f"\n{detail()}" if detail is not None else ""
            raise AssertionError(f"timed out after {timeout} s waiting for {what}: {last}{more}")
        time.sleep(interval)


def closed_by_peer(sock: socket.socket) -> bool:
    """True once the other side closed `sock` (EOF or reset), without blocking: a
    predicate for wait_until when a server is expected to drop a connection."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
