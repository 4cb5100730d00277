"""Thread exhaustion at the accept loop (issue 15, item 13), against a real process.

A data server runs in a subprocess (this file, run as a script) whose connection threads
cannot start for the first FAILS connections: its documented `start_thread` hook raises
RuntimeError("can't start new thread"), exactly what `Thread.start` raises when the
process is out of threads (a low RLIMIT_NPROC would do it too, but not reliably as root).
The accept loop must survive: each such connection is closed and counted, the failure is
logged once for the burst, and the next connection is served byte for byte.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from hixl import errors, wire
from hixl.memory import ShmSegment
from hixl.transports.base import Item
from hixl.transports.tcp import SocketTransport
from hixl.types import MemType, Perm, SegmentInfo, TransferOp

FAILS = 5
SEG = 1 << 20
EPOCH = 3
DEADLINE_S = 30.0


def serve(fails: int) -> None:
    """The subprocess: a DataServer on a real shm segment; `stats` on stdin prints the
    counters, EOF stops it."""
    import logging

    from hixl.server.agent.data_server import DataServer

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    shm = ShmSegment(SEG)
    served = wire.ServedSegment(1, EPOCH, shm.addr, shm.length, Perm.RW, shm.view())
    left = [fails]

    def start_thread(thread: threading.Thread) -> None:
        if left[0] > 0:
            left[0] -= 1
            raise RuntimeError("can't start new thread")
        thread.start()

    server = DataServer({1: served}.get, EPOCH, unix_path=None, start_thread=start_thread)
    server.start()
    print(json.dumps({"tcp": server.tcp_address, "base": shm.addr}), flush=True)
    for line in sys.stdin:
        if line.strip() == "stats":
            print(json.dumps(dict(server.counters)), flush=True)
    server.stop()


class Helper:
    def __init__(self, fails: int, log_path: str) -> None:
        self.log_path = log_path
        with open(log_path, "w", encoding="utf-8") as log:
            self.proc = subprocess.Popen(
                [sys.executable, __file__, str(fails)], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, stderr=log, text=True,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        assert self.proc.stdout is not None and self.proc.stdin is not None
        self.ready = json.loads(self.proc.stdout.readline())

    def stats(self) -> dict[str, int]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(DEADLINE_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def helper(tmp_path: object) -> Iterator[Helper]:
    process = Helper(FAILS, os.path.join(str(tmp_path), "server.log"))
    yield process
    process.close()


def test_the_accept_loop_survives_threads_that_cannot_start(helper: Helper) -> None:
    address = f"tcp://{helper.ready['tcp']}"
    info = SegmentInfo(1, "helper", "node", helper.ready["base"], SEG, MemType.MEM_HOST,
                       Perm.RW, EPOCH, False)
    for _ in range(FAILS):  # each gets no thread: closed, the loop accepts the next
        refused = SocketTransport(address, identity="refused")
        with pytest.raises(errors.PeerUnavailable, match="handshake"):
            refused.ping(time.monotonic() + DEADLINE_S)
        refused.close()
    stats = helper.stats()
    assert stats["thread_start_failures"] == FAILS
    assert stats["connections_rejected"] == FAILS
    assert stats["connections"] == 0

    local, back = ShmSegment(SEG), ShmSegment(SEG)
    local.view()[:] = os.urandom(SEG)
    honest = SocketTransport(address, identity="honest")
    try:
        honest.transfer(TransferOp.WRITE, [Item(0, local.addr, info, info.base, SEG)],
                        time.monotonic() + DEADLINE_S)
        honest.transfer(TransferOp.READ, [Item(0, back.addr, info, info.base, SEG)],
                        time.monotonic() + DEADLINE_S)
    finally:
        honest.close()
    assert bytes(back.view()) == bytes(local.view())
    stats = helper.stats()
    assert stats["connections"] >= 1 and stats["thread_start_failures"] == FAILS
    with open(helper.log_path, encoding="utf-8") as f:
        lines = [line for line in f if "no thread could be started" in line]
    assert len(lines) == 1, lines  # once per burst, not once per connection


if __name__ == "__main__":
    serve(int(sys.argv[1]))
