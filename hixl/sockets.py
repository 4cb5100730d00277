"""Socket helpers the data path shares: clients (hixl.transports.tcp, the store's fast
path hixl.store_rpc) and daemons (the agent's data server, both daemons' connection
threads, hixl.server.connections) import them from here.

`tune_socket` sets TCP_NODELAY and the per-family buffer sizes (`SOCKET_BUFFERS`);
`serve_blocking` makes an accepted socket blocking with kernel-enforced I/O deadlines;
`arm_timeouts` bounds a client's blocking calls by its call's deadline the same way;
`BufferQueue` walks a list of buffers through partial sendmsg/recvmsg_into calls.
`recv_polling` is the busy poll both ends of a store call use before they block, where
`polling_pays` says a second CPU is there for the peer.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import os
import socket
import struct
import time
from typing import Union

IOV_MAX = 1024  # Linux's limit on buffers per sendmsg
# SO_SNDBUF/SO_RCVBUF per family; None keeps the kernel's choice. Unix sockets have no
# autotuning and a ~200 KiB default: 4 MiB lets MiB-sized frames stream (measured ~1.2x on
# loopback). TCP autotuning did as well as a fixed 4 MiB on loopback, and a fixed
# SO_RCVBUF would cap the window on real high-latency links.
SOCKET_BUFFERS: dict[int, int | None] = {socket.AF_INET: None, socket.AF_INET6: None,
                                         socket.AF_UNIX: 4 << 20}
Buffer = Union[bytes, bytearray, memoryview]  # noqa: UP007 - a runtime alias on 3.10


class BufferQueue:
    """Buffers that partial sends (or scatter receives) go through front to back.

    Progress is one bisect over the buffers' cumulative ends, not Python work per buffer:
    a batch of small frames is hundreds of buffers per system call.
    """

    __slots__ = ("buffers", "ends", "moved", "index")

    def __init__(self, buffers: list[Buffer]) -> None:
        self.buffers = buffers
        self.ends = list(itertools.accumulate(map(len, buffers)))
        self.moved = 0  # bytes sent (received) so far
        self.index = 0  # the first buffer not wholly done

    @property
    def left(self) -> int:
        return (self.ends[-1] if self.ends else 0) - self.moved

    def chunk(self, limit: int = IOV_MAX) -> list[Buffer]:
        """The next `limit` buffers to pass to sendmsg/recvmsg_into, the first one's rest."""
        index = self.index
        done = self.moved - (self.ends[index - 1] if index else 0)
        if not done:
            return self.buffers[index:index + limit]
        return [memoryview(self.buffers[index])[done:], *self.buffers[index + 1:index + limit]]

    def advance(self, count: int) -> int:
        """Count `count` more bytes done; returns how many buffers they completed."""
        self.moved += count
        index = self.index
        self.index = bisect.bisect_right(self.ends, self.moved, index)
        return self.index - index


def tune_socket(sock: socket.socket) -> None:
    """Low latency for small frames, big buffers for bulk ones."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    size = SOCKET_BUFFERS.get(sock.family)
    if size is None:
        return
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        # capped by net.core.*mem_max, refused by odd kernels: the default still works
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, size)


ARM_MIN_S = 0.01  # below this much time left, a blocking call is bounded by all of it
ARM_MAX_S = 3600.0  # the longest a blocking call waits before it checks the deadline again


def arm_timeouts(sock: socket.socket, armed: float, remaining: float) -> float:
    """Bound a blocking socket's next calls by a deadline `remaining` seconds away, through
    its kernel timeouts (SO_RCVTIMEO / SO_SNDTIMEO): no poll() around each call, as
    Python's own socket timeouts add. Returns the timeout set now (`armed`, the one set
    before, when it still fits: 0 < armed <= remaining and armed >= remaining / 4, so calls
    with like deadlines pay no system call). It is set to half the time left (all of it
    below 2 * ARM_MIN_S): a wait never outlasts the deadline, and one that ends early
    (EAGAIN) is the caller's cue to check its deadline and arm again."""
    if 0 < armed <= remaining and armed * 4 >= remaining:
        return armed
    value = min(remaining / 2, ARM_MAX_S) if remaining > 2 * ARM_MIN_S else remaining
    seconds = int(value)
    timeval = struct.pack("ll", seconds, max(int((value - seconds) * 1e6), 0 if seconds else 1))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
    return value


def serve_blocking(sock: socket.socket, io_timeout: float) -> None:
    """An accepted server socket, tuned and blocking, where any stall longer than
    `io_timeout` fails the call (SO_RCVTIMEO / SO_SNDTIMEO): a dead peer never holds a
    serving thread forever, yet a healthy stream pays nothing per call for the deadline."""
    sock.settimeout(None)
    tune_socket(sock)
    seconds = int(io_timeout)
    timeval = struct.pack("ll", seconds, int((io_timeout - seconds) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def polling_pays() -> bool:
    """Whether this process may run on a second CPU: a thread polling for a peer's bytes
    must not hold the only CPU the peer could answer on."""
    return len(os.sched_getaffinity(0)) > 1


def recv_polling(sock: socket.socket, into: memoryview, until: float) -> int | None:
    """recv_into without blocking, tried again until `until` (monotonic): the bytes
    received (0: end of stream), or None when none came by then (the caller then blocks
    as usual). Why: on the VMs measured, a thread that blocks for a reply due within
    ~100-300 µs is woken on a halted CPU with cold caches, which costs more than the
    call's own work (docs/store.md §1); the GIL is released at every try."""
    while True:
        try:
            return sock.recv_into(into, 0, socket.MSG_DONTWAIT)
        except BlockingIOError:
            if time.monotonic() >= until:
                return None


__all__ = ["ARM_MAX_S", "ARM_MIN_S", "IOV_MAX", "SOCKET_BUFFERS", "Buffer", "BufferQueue",
           "arm_timeouts", "polling_pays", "recv_polling", "serve_blocking", "tune_socket"]
