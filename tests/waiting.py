"""Waiting for a condition in tests, with a deadline that only proves "does not hang".

    import waiting
    wait_for = partial(waiting.wait_until, timeout=WAIT_S)  # the module's own deadline
    wait_for(lambda: etcd.get("k") is None, "the key expires")

Nothing asserts how long the wait took; `timeout` is far beyond what a healthy run needs.
"""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Callable


def wait_until(predicate: Callable[[], object], what: str, timeout: float,
               interval: float = 0.05) -> None:
    """Poll `predicate` every `interval` s until it is true; once `timeout` s pass first,
    fail the test with an AssertionError naming `what`."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
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
