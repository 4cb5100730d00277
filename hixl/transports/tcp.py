"""The socket data path, client side: pipelined frames over TCP or a unix socket.

One transfer owns one connection from a small pool (callers in other threads never share
a stream). It sends every request frame of the batch — WRITE payloads gathered straight
from local memory with `sendmsg` — while it reads the replies, READ data landing straight
in local memory (a run reply's data, many ops' worth, with one `recvmsg_into` scatter
list): no user-space staging copy either way (but for a lone READ of at most 16 KiB,
read with its reply header and copied once). A batch is driven by one `poll` loop
whose every socket call passes MSG_DONTWAIT, so sending and receiving interleave and the
two socket buffers can never deadlock each other, and every wait uses what is left of
the caller's deadline. A lone op up to SINGLE_MAX is one frame sent with one blocking
`sendmsg` and answered by blocking reads (no readiness round trip: most of a small op's
cost), each call bounded by SO_RCVTIMEO/SO_SNDTIMEO set from the deadline; with the
optional extension hixl._fastwire (hixl/_fastwire.c) that lone frame is one C call
(`FASTWIRE`; HIXL_FASTWIRE=0 keeps it in Python). A large batch
over TCP is striped: cut into contiguous byte ranges run at once on several pooled
connections, one thread each (SocketTransport.transfer).
"""

from __future__ import annotations

import bisect
import concurrent.futures
import contextlib
import ctypes
import errno
import itertools
import logging
import math
import operator
import os
import select
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hixl import auth, wire
from hixl.addresses import split_host_port
from hixl.errors import (
    AuthenticationFailed,
    HixlError,
    NotConnected,
    ParamInvalid,
    PeerUnavailable,
    TransferFailed,
    TransferTimeout,
)
from hixl.memory import load_fastwire
from hixl.sockets import IOV_MAX, Buffer, BufferQueue, arm_timeouts, tune_socket
from hixl.transports.base import Item, ItemArrays, Transport
from hixl.types import TransferOp
from hixl.wire_client import DeadlineSocket, Refused, handshake

log = logging.getLogger("hixl.data")

_SCRATCH = 64 << 10  # reply headers and error texts are read through this buffer
# Striping: a transfer moving at least STRIPE_MIN_BYTES spreads its frames over up to
# STRIPES connections of the pool, driven together (see SocketTransport.transfer).
STRIPES = 3
STRIPE_MIN_BYTES = 4 << 20
_STRIPE_ALIGN = 64 << 10  # lane boundaries fall on multiples of this (within the batch)
# A lone op up to this size is one frame sent and answered with blocking calls
# (_Connection.single). The kernel bounds each such TCP call, and a unix receive, in total
# by the socket's timeout; a unix send this small fits in an idle stream's buffer without
# waiting. Larger ops are not latency-bound and keep the poll loop.
SINGLE_MAX = 64 << 10
_COPY_MAX = 16 << 10  # a lone READ up to this size is read with its reply header (one call)
_LANE_GRACE_S = 5.0  # how long past the deadline a helper lane may take to report

# PyMemoryView_FromMemory wraps raw memory in a plain "B" memoryview without creating a
# ctypes array type per length (ctypes caches those forever).
_view_from_memory = ctypes.pythonapi.PyMemoryView_FromMemory
_view_from_memory.restype = ctypes.py_object
_view_from_memory.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_PYBUF_READ = 0x100
_PYBUF_WRITE = 0x200


#: The compiled lone-op path, or None: read when a transport (or a data server) is made,
#: so a test can set it to None to run the pure-Python path in the same process.
FASTWIRE = load_fastwire()


def local_view(addr: int, length: int, *, writable: bool) -> memoryview:
    """A memoryview over `length` bytes at `addr` (memory the Engine has checked)."""
    return _view_from_memory(addr, length, _PYBUF_WRITE if writable else _PYBUF_READ)


def parse_data_address(address: str,
                       ) -> tuple[str, socket.AddressFamily, str | tuple[str, int]]:
    """"tcp://host:port" or "unix:///abs/path" -> (transport name, family, sockaddr)."""
    if address.startswith("unix://"):
        path = address[len("unix://"):]
        if not path.startswith("/"):
            raise ParamInvalid(f"unix data address {address!r} needs an absolute path")
        return "unix", socket.AF_UNIX, path
    if address.startswith("tcp://"):
        host, port = split_host_port(
            address[len("tcp://"):], "tcp data address",
            no_port=f"tcp data address {address!r} is not tcp://host:port")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return "tcp", family, (host, port)
    raise ParamInvalid(f"data address {address!r}: use tcp://host:port or unix:///path")


@dataclass(slots=True)
class _Frames:
    """The request frames of one exchange, as parallel lists (no object per frame).

    A frame carries one op, or several ops whose remote ranges follow one another in one
    segment (`_merge`), or several ranges of one segment (a vector request, `_vectors`):
    their local ranges are then its payload's (or reply data's) pieces, a list of views,
    and `lasts` names the last op's position."""

    positions: list[int]  # each frame's (first) item position in the batch; -1: control
    headers: list[bytes]  # each frame's header (a PING is its header alone)
    payloads: list[Any] | None = None  # WRITE: each frame's data (a view or a list of them)
    targets: list[Any] | None = None  # READ: where each reply's data lands (the same)
    lasts: list[int] | None = None  # each frame's last item position; None: one item each
    vectors: list[int] | None = None  # which frames are vector requests (refused whole)

    def vector_positions(self) -> set[int]:
        """The item positions that vector requests carry."""
        return {pos for frame in self.vectors or () for pos in self.covered(frame)}

    def covered(self, frame: int) -> range:
        """The item positions frame number `frame` carries."""
        first = self.positions[frame]
        return range(first, (self.lasts[frame] if self.lasts is not None else first) + 1)


#: most ops one merged frame carries (its views are one scatter/gather call's buffers)
MERGE_MAX_OPS = IOV_MAX // 2


def _merge(positions: list[int], requests: list[tuple[int, int, int, int]],
           views: list[memoryview], limit: int
           ) -> tuple[list[int], list[int] | None, list[tuple[int, int, int, int]], list[Any]]:
    """Ops whose remote ranges follow one another in one segment (one epoch) become one
    frame of at most `limit` bytes and MERGE_MAX_OPS ops, its data the ops' local pieces
    in order: a row of pages the peer holds back to back (a KV block's layers, a MoE
    destination's rows) costs the agent one frame, not one per page, whatever the local
    layout. Returns (first positions, last positions or None, requests, views per frame).

    The agent checks a merged frame as one range, so a refusal (the segment was
    deregistered meanwhile) fails every op of the frame."""
    groups: list[tuple[int, int]] = []
    start = 0
    segment, epoch, remote, size = requests[0]
    end = remote + size
    for index in range(1, len(requests)):
        seg, ep, remote, length = requests[index]
        if (remote == end and seg == segment and ep == epoch and size + length <= limit
                and index - start < MERGE_MAX_OPS):
            end += length
            size += length
            continue
        groups.append((start, index))
        start, segment, epoch, end, size = index, seg, ep, remote + length, length
    groups.append((start, len(requests)))
    if len(groups) == len(requests):
        return positions, None, requests, views
    firsts = [positions[a] for a, _ in groups]
    lasts = [positions[b - 1] for _, b in groups]
    merged = [requests[a] if b - a == 1 else
              (*requests[a][:3], sum(r[3] for r in requests[a:b])) for a, b in groups]
    pieces = [views[a] if b - a == 1 else views[a:b] for a, b in groups]
    return firsts, lasts, merged, pieces


def _vector_spans(breaks: np.ndarray, sizes: np.ndarray, limit: int,
                  max_ranges: int = wire.MAX_VECTOR_RANGES) -> list[tuple[int, int]]:
    """The ranges [start, stop) of consecutive entries that go as one vector request: a
    new one where `breaks` is set (another segment or epoch), after `max_ranges` entries
    and before `limit` bytes would be passed (an entry over it alone)."""
    count = len(sizes)
    ends = np.cumsum(sizes)
    changes = (np.flatnonzero(breaks[1:]) + 1).tolist() + [count]
    spans: list[tuple[int, int]] = []
    start, change = 0, 0
    while start < count:
        while changes[change] <= start:
            change += 1
        before = int(ends[start - 1]) if start else 0
        fit = int(np.searchsorted(ends, before + limit, "right"))
        stop = max(start + 1, min(start + max_ranges, changes[change], fit))
        spans.append((start, stop))
        start = stop
    return spans


def _vectors(proto: wire.ClientProtocol, opcode: int, positions: list[int],
             lasts: list[int] | None, requests: list[tuple[int, int, int, int]],
             views: list[Any], limit: int
             ) -> tuple[list[int], list[int], list[bytes], list[Any], list[int]]:
    """Frames (after `_merge`) that follow one another in one segment become one vector
    request each (wire: FLAG_VECTOR), cut as `_vector_spans` says: the pages of a KV
    layer, strewn over the pool, cost the agent one frame, one check pass and one scatter
    read, not one frame each. Returns (first positions, last positions, request frames,
    local views per frame, the frame numbers of vectors)."""
    fields = np.array(requests, np.uint64)  # segment id, epoch, addr, length per frame
    breaks = np.ones(len(requests), bool)
    breaks[1:] = (fields[1:, 0] != fields[:-1, 0]) | (fields[1:, 1] != fields[:-1, 1])
    vectors: list[int] = []
    out_first: list[int] = []
    out_last: list[int] = []
    headers: list[bytes] = []
    pieces: list[Any] = []
    singles: list[int] = []  # frames sent as they are, encoded together

    def flush() -> None:
        if singles:
            headers.extend(proto.requests(opcode, [requests[k] for k in singles]))
            singles.clear()

    for index, end in _vector_spans(breaks, fields[:, 3], limit):
        out_first.append(positions[index])
        out_last.append(lasts[end - 1] if lasts is not None else positions[end - 1])
        if end - index == 1:
            singles.append(index)
            pieces.append(views[index])
            continue
        flush()
        vectors.append(len(out_first) - 1)
        segment, epoch = requests[index][:2]
        headers.append(proto.vector_table(opcode, segment, epoch, fields[index:end, 2:]))
        local: list[Any] = []
        for part in views[index:end]:
            if type(part) is list:
                local += part
            else:
                local.append(part)
        pieces.append(local)
    flush()
    return out_first, out_last, headers, pieces, vectors


#: a span of an array batch: (first op, last op, segment slot, range table as big-endian
#: (address, length) u64 pairs, local addresses, local lengths)
Span = tuple[int, int, int, bytes, list[int], list[int]]


def _frame_spans(seg: np.ndarray, local: np.ndarray, remote: np.ndarray,
                 lengths: np.ndarray, limit: int, max_ranges: int) -> list[Span]:
    """How an array batch goes as vector requests, in numpy (`_fastwire.frame_spans`
    computes the same in one C pass). Ops that continue each other on both sides are one
    range (as `_merge` does; one range per op when such a range would pass `limit`), and
    each span takes the next ranges of one segment as `_vector_spans` cuts them. Its
    table has an entry per run of ranges that continue each other in the segment (a
    block's layers, side by side in the pool: one), its local side one piece per run that
    continues locally (a KV layer's pages, side by side in the cache: one)."""
    count = len(lengths)
    op_ends = np.cumsum(lengths)
    joined = np.zeros(count, bool)  # op i continues op i - 1 on both sides
    joined[1:] = (seg[1:] == seg[:-1]) & (remote[1:] == remote[:-1] + lengths[:-1]) \
        & (local[1:] == local[:-1] + lengths[:-1])
    firsts_op = np.flatnonzero(~joined)  # each range's first op
    lasts_op = np.append(firsts_op[1:], count) - 1
    sizes = op_ends[lasts_op] - op_ends[firsts_op] + lengths[firsts_op]
    if int(sizes.max()) > limit:  # a run over the frame limit: one range per op instead
        firsts_op = lasts_op = np.arange(count)
        sizes = lengths
    seg, local, remote = seg[firsts_op], local[firsts_op], remote[firsts_op]
    ranges = len(sizes)
    ends = np.zeros(ranges + 1, np.int64)  # ends[i]: the bytes of ranges before range i
    np.cumsum(sizes, out=ends[1:])
    segment_changes = np.ones(ranges, bool)
    segment_changes[1:] = seg[1:] != seg[:-1]
    remote_breaks = segment_changes.copy()  # where a range does not continue the last there
    remote_breaks[1:] |= remote[1:] != remote[:-1] + sizes[:-1]
    local_breaks = np.ones(ranges, bool)  # ... and here
    local_breaks[1:] = local[1:] != local[:-1] + sizes[:-1]
    spans: list[Span] = []
    for start, stop in _vector_spans(segment_changes, sizes, limit, max_ranges):
        runs = np.flatnonzero(remote_breaks[start + 1:stop]) + 1  # from `start`
        table = np.empty((len(runs) + 1, 2), ">u8")
        table[0, 0] = remote[start]
        table[1:, 0] = remote[start + runs]
        table[:, 1] = np.add.reduceat(sizes[start:stop], np.append(0, runs))
        local_runs = np.flatnonzero(local_breaks[start + 1:stop]) + start + 1
        run_firsts, run_stops = np.append(start, local_runs), np.append(local_runs, stop)
        spans.append((int(firsts_op[start]), int(lasts_op[stop - 1]), int(seg[start]),
                      table.tobytes(), local[run_firsts].tolist(),
                      (ends[run_stops] - ends[run_firsts]).tolist()))
    return spans


def _array_frames(proto: wire.ClientProtocol, op: TransferOp, ops: ItemArrays,
                  limit: int) -> _Frames:
    """The frames of an array batch, all vector requests, as `_frame_spans` cuts them (in
    C where the extension is built). The two sides of a vector are cut apart, as each is
    one byte stream. No Python object per op, which is what a batch of 4 KiB pages costs
    otherwise. Every op is at most `limit` bytes (the caller checked)."""
    writing = op == TransferOp.WRITE
    opcode = wire.Op.WRITE if writing else wire.Op.READ
    cut = FASTWIRE.frame_spans if FASTWIRE is not None else _frame_spans
    spans = cut(ops.seg, ops.local, ops.remote, ops.lengths, limit, wire.MAX_VECTOR_RANGES)
    firsts: list[int] = []
    lasts: list[int] = []
    headers: list[bytes] = []
    pieces: list[list[memoryview]] = []
    for first, last, slot, table, addrs, sizes in spans:
        segment = ops.segments[slot]
        headers.append(proto.vector_table(opcode, segment.segment_id, segment.epoch,
                                          np.frombuffer(table, ">u8").reshape(-1, 2)))
        pieces.append(_views(addrs, sizes, writable=not writing))
        firsts.append(first)
        lasts.append(last)
    frames = list(range(len(headers)))
    if writing:
        return _Frames(firsts, headers, payloads=pieces, lasts=lasts, vectors=frames)
    return _Frames(firsts, headers, targets=pieces, lasts=lasts, vectors=frames)


def _views(addrs: list[int], lengths: list[int], *, writable: bool) -> list[memoryview]:
    """Memoryviews of local ranges (addrs[i], lengths[i]): slices of one view over their span.

    Slicing costs ~0.06 us where a view per range (ctypes) costs ~0.8 us. Only the
    slices are ever touched, and each lies in memory the Engine checked.
    """
    low = min(addrs)
    span = local_view(low, max(map(operator.add, addrs, lengths)) - low, writable=writable)
    return [span[addr - low:addr - low + length] for addr, length in zip(addrs, lengths, strict=True)]


class _StreamLost(Exception):
    """The connection cannot go on; `replied` frames had their replies read."""

    def __init__(self, kind: str, message: str, replied: int,
                 refusals: list[tuple[int, HixlError]]) -> None:
        super().__init__(message)
        self.kind = kind  # "timeout", "closed" or "protocol"
        self.replied = replied
        self.refusals = refusals


_PEER_GONE = (ConnectionResetError, BrokenPipeError, ConnectionAbortedError)
_DONTWAIT = socket.MSG_DONTWAIT
_WAITALL = socket.MSG_WAITALL
_WRITE, _READ = int(wire.Op.WRITE), int(wire.Op.READ)
_monotonic = time.monotonic


class _Connection:
    """One data stream with its own request numbering and reply scratch.

    The socket is in blocking mode, bounded by SO_RCVTIMEO/SO_SNDTIMEO (`_arm`): a single
    frame is one blocking `sendmsg` and one blocking receive, no readiness round trip. The
    pipelined exchange of a batch passes MSG_DONTWAIT on every call and waits in `poll`,
    so it never blocks in a send while replies pile up.
    """

    def __init__(self, sock: socket.socket, fast: object | None = None) -> None:
        self.sock = sock
        self.proto = wire.ClientProtocol()
        self._fast = fast  # hixl._fastwire: `single` runs in C (None: in Python)
        self._fd = sock.fileno()
        self._poll = select.poll()
        self._poll.register(self._fd, select.POLLIN)
        self._events = select.POLLIN  # what _poll waits for now
        self._scratch = bytearray(_SCRATCH)
        self._view = memoryview(self._scratch)
        self._head = self._view[:wire.HEADER_SIZE]  # where a single op's reply header lands
        self._armed = 0.0  # the SO_RCVTIMEO/SO_SNDTIMEO set now, seconds; 0: none yet
        self._start = 0  # unread reply bytes are self._scratch[_start:_end]
        self._end = 0
        # READ data being received: the targets of the current reply (a run's, back to back)
        # from _at on (the first maybe already part-filled), and the bytes still to come
        self._targets = BufferQueue([])
        self._data_left = 0
        self._run_first = self._run_end = 0  # the frames the current READ reply answers
        self._frame_ends: list[int] | None = None  # their byte ends, when frames are merged
        self._refusal: wire.Header | None = None  # error reply whose text is still coming
        self.replied = 0  # progress of the current exchange
        self.refusals: list[tuple[int, HixlError]] = []
        self.pooled = False  # has been idle in the pool (so may have died there)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def is_stale(self) -> bool:
        """An idle stream has nothing to read; EOF, a reset or stray bytes mean it is dead."""
        if self._events != select.POLLIN:
            self._events = select.POLLIN
            self._poll.modify(self._fd, select.POLLIN)
        return bool(self._poll.poll(0))

    def abort(self) -> None:
        """Wake a transfer blocked on this stream (from another thread): it sees EOF."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def single(self, opcode: int, segment_id: int, epoch: int, addr: int,
               local_addr: int, length: int, deadline: float) -> HixlError | None:
        """One WRITE or READ frame with blocking calls: the request (header and payload)
        in one `sendmsg`, then the reply: its header read exactly, then a READ's data
        straight into `local` (up to _COPY_MAX, the data is read with the header into the
        scratch and copied once the header says OK). `local_addr`, `length`: the local
        memory (checked by the Engine). Returns the refusal, if any.

        Why not the poll loop: a single frame cannot deadlock (the agent reads all of it
        before it answers), and for a small op the readiness round trips and the
        non-blocking retries were most of its cost. Every call is bounded by the deadline
        (`_arm`); raises _StreamLost like `exchange`.
        """
        self.replied = 0
        self.refusals = []
        if self._fast is not None:
            return self._single_fast(opcode, segment_id, epoch, addr, local_addr, length,
                                     deadline)
        local = local_view(local_addr, length, writable=opcode == _READ)
        header, ok = self.proto.request(opcode, segment_id, epoch, addr, length)
        sock = self.sock
        try:
            self._arm(deadline)
            buffers = (header, local) if opcode == _WRITE else (header,)
            try:
                sent = sock.sendmsg(buffers)
            except BlockingIOError:  # SO_SNDTIMEO passed with nothing sent
                sent = 0
            if sent != wire.HEADER_SIZE + (length if opcode == _WRITE else 0):
                self._send_rest(buffers, sent, deadline)
            # a small READ's data is read with its header, into the scratch, and copied
            # out once the header said OK: a copy of a few KiB beats a second system call
            more = length if opcode == _READ and length <= _COPY_MAX else 0
            try:
                got = sock.recv_into(self._view, wire.HEADER_SIZE + more,
                                     0 if more else _WAITALL)
            except BlockingIOError:  # SO_RCVTIMEO passed with nothing read
                got = -1
            if got < wire.HEADER_SIZE:  # cut short by a timeout, EOF or a signal
                self._recv_rest(self._head, deadline, got)
                got = wire.HEADER_SIZE
            got -= wire.HEADER_SIZE  # the bytes after the header
            if self._scratch.startswith(ok):
                self.proto.answered_ok()
            else:
                return self._other_reply(opcode, local, got, deadline)
            if opcode == _READ:
                if got:  # came with the header (never more than asked: `length`)
                    local[:got] = self._view[wire.HEADER_SIZE:wire.HEADER_SIZE + got]
                if got != length:
                    self._recv_rest(local, deadline, got)
        except (OSError, wire.ProtocolError) as exc:
            raise self._broken(exc) from None
        self.replied = 1
        return None

    def _single_fast(self, opcode: int, segment_id: int, epoch: int, addr: int,
                     local_addr: int, length: int, deadline: float) -> HixlError | None:
        """`single` in one C call (hixl._fastwire.single): the same frame, the same
        deadline-bounded blocking calls, the same check of the reply against the expected
        OK. A reply that is not that OK comes back with its header in the scratch and is
        decoded here, in Python, as on the Python path (`_other_reply`); so are the errors."""
        rid = self.proto.take(opcode, length)
        status, extra, self._armed = self._fast.single(  # type: ignore[attr-defined]
            self._fd, opcode, rid, segment_id, epoch, addr, local_addr, length,
            self._scratch, deadline, self._armed)
        if status == 0:  # OK: the reply was exactly the expected one
            self.proto.answered_ok()
            self.replied = 1
            return None
        if status == 2:  # TIMEOUT
            raise self._lost("timeout", "deadline passed")
        if status == 3:  # CLOSED
            raise self._lost("closed", "peer closed the connection")
        if status == 4:  # ERRNO
            raise self._broken(OSError(extra, os.strerror(extra))) from None
        try:  # OTHER: a refusal, or a reply to decode fully
            local = local_view(local_addr, length, writable=opcode == _READ)
            return self._other_reply(opcode, local, extra, deadline)
        except (OSError, wire.ProtocolError) as exc:
            raise self._broken(exc) from None

    def _other_reply(self, opcode: int, local: memoryview, got: int, deadline: float
                     ) -> HixlError | None:
        """A lone op's reply whose header (in the scratch, `got` bytes after it) is not the
        expected OK: decoded and checked fully; returns the refusal it carries, if any."""
        length = len(local)
        reply = self.proto.on_reply_header(self._head)
        if reply.flags & wire.FLAG_ERROR_TEXT:
            if got > reply.length:
                raise wire.ProtocolError(wire.Reason.BAD_FRAME, "bytes after an error reply")
            text = self._view[wire.HEADER_SIZE:wire.HEADER_SIZE + reply.length]
            self._recv_rest(text, deadline, got)
            self.replied = 1
            return wire.reply_error(reply, bytes(text))
        if opcode == _READ:
            if got:  # came with the header (never more than asked: `length`)
                local[:got] = self._view[wire.HEADER_SIZE:wire.HEADER_SIZE + got]
            if got != length:
                self._recv_rest(local, deadline, got)
        self.replied = 1
        return None

    def _arm(self, deadline: float) -> None:
        """Bound the next blocking call by the deadline (hixl.sockets.arm_timeouts).
        Raises _StreamLost("timeout") once the deadline has passed."""
        remaining = deadline - _monotonic()
        if remaining <= 0:
            raise self._lost("timeout", "deadline passed")
        self._armed = arm_timeouts(self.sock, self._armed, remaining)

    def _send_rest(self, buffers: Sequence[Buffer], sent: int, deadline: float) -> None:
        """Finish a blocking send that `sendmsg` cut short after `sent` bytes."""
        out = BufferQueue(list(buffers))
        out.advance(sent)
        while out.left:
            self._arm(deadline)
            try:
                out.advance(self.sock.sendmsg(out.chunk()))
            except BlockingIOError:  # SO_SNDTIMEO passed with nothing sent: re-arm
                continue

    def _recv_rest(self, target: memoryview, deadline: float, got: int = 0) -> None:
        """Fill `target` with blocking reads; a first read already brought `got` bytes
        (0: it found EOF, which the next read shows again; -1: it timed out)."""
        got = max(got, 0)
        size = len(target)
        while got < size:
            self._arm(deadline)
            try:
                n = self.sock.recv_into(target[got:], size - got, _WAITALL)
            except BlockingIOError:  # SO_RCVTIMEO passed with nothing read: re-arm
                continue
            if not n:
                raise self._lost("closed", "peer closed the connection")
            got += n

    def _broken(self, exc: BaseException) -> _StreamLost:
        """The _StreamLost for a failed socket call or a bad reply."""
        if isinstance(exc, wire.ProtocolError):
            return self._lost("protocol", f"bad reply: {exc}")
        if isinstance(exc, _PEER_GONE):
            return self._lost("closed", f"connection reset ({exc.strerror})")
        return self._lost("closed", f"socket error: {exc}")

    def exchange(self, frames: _Frames, deadline: float) -> list[tuple[int, HixlError]]:
        """Send every frame, read every reply; returns (frame number, error) per refusal.

        Raises _StreamLost when the stream breaks (timeout, EOF, reset, a reply that does
        not match): the connection must then be dropped.
        """
        headers, payloads = frames.headers, frames.payloads
        buffers: list[Buffer]
        if payloads is not None and frames.lasts is not None:  # merged: several pieces
            buffers = []
            for header, payload in zip(headers, payloads, strict=True):
                buffers.append(header)
                if type(payload) is list:
                    buffers += payload
                else:
                    buffers.append(payload)
        elif payloads is not None:  # header, payload, header, payload, ...
            buffers = [b""] * (2 * len(headers))
            buffers[::2] = headers
            buffers[1::2] = payloads
        else:  # READ requests, control frames: one buffer
            buffers = [b"".join(headers)] if headers else []
        out = BufferQueue(buffers)
        unsent = out.left
        total = len(headers)
        self.replied = 0  # frames whose reply is complete
        self.refusals = []
        try:
            while True:
                progressed = False
                if unsent:
                    try:
                        sent = self.sock.sendmsg(out.chunk(), (), _DONTWAIT)
                    except BlockingIOError:
                        sent = 0
                    if sent:
                        progressed = True
                        out.advance(sent)
                        unsent -= sent
                # once every request is out, READ data is waited for in the receive call
                if self._read_available(frames.targets, total, None if unsent else deadline):
                    progressed = True
                if self.replied == total:
                    break
                if not progressed:
                    self._wait(select.POLLIN | (select.POLLOUT if unsent else 0), deadline)
                elif time.monotonic() >= deadline:  # a trickling peer cannot stretch it
                    raise self._lost("timeout", "deadline passed")
        except (OSError, wire.ProtocolError) as exc:
            raise self._broken(exc) from None
        if self._start != self._end:
            raise self._lost("protocol", f"{self._end - self._start} bytes after the last reply")
        return self.refusals

    def _lost(self, kind: str, message: str) -> _StreamLost:
        return _StreamLost(kind, message, self.replied, self.refusals)

    def _read_available(self, targets: list[memoryview] | None, total: int,
                        sent_by: float | None) -> bool:
        """Read as many replies as the socket holds now, without blocking (but see
        `_read_data`: with every request sent by `sent_by`, READ data is waited for).

        Returns whether any byte came. Where a reply stops half-way, `_targets` (READ data
        still coming) or `_refusal` (an error header whose text is still coming) remember
        it for the next call.
        """
        read_any = False
        proto = self.proto
        while self.replied < total:
            if self._data_left:  # READ data: straight into place
                if not self._read_data(total, sent_by):
                    return read_any
                read_any = True
                continue
            # READ replies are read header-exact, so their data never lands in the scratch
            exact = targets is not None
            header = self._refusal
            if header is None:
                if not self._fill(wire.HEADER_SIZE, exact):
                    return read_any
                read_any = True
                start = self._start
                header = proto.on_reply_header(self._view[start:start + wire.HEADER_SIZE])
                self._start = start + wire.HEADER_SIZE
                if header.flags & wire.FLAG_ERROR_TEXT:
                    self._refusal = header
            if header.flags & wire.FLAG_ERROR_TEXT:
                if not self._fill(header.length, exact):
                    return read_any
                read_any = True
                text = bytes(self._view[self._start:self._start + header.length])
                self._start += header.length
                self._refusal = None
                self.refusals.append((self.replied, wire.reply_error(header, text)))
                self.replied += 1
            elif targets is None or header.length == 0:
                self.replied += wire.reply_count(header)
            else:  # the data of one READ, or of a run of them, follows back to back
                count = wire.reply_count(header)
                run = targets[self.replied:self.replied + count]
                self._run_first, self._run_end = self.replied, self.replied + count
                if any(type(target) is list for target in run):  # merged frames' pieces
                    flat: list[Buffer] = []
                    for target in run:
                        flat += target if type(target) is list else [target]
                    self._targets = BufferQueue(flat)
                    self._frame_ends = list(itertools.accumulate(
                        sum(map(len, t)) if type(t) is list else len(t) for t in run))
                else:
                    self._targets = BufferQueue(run)
                    self._frame_ends = None
                self._data_left = header.length
        return read_any

    def _read_data(self, total: int, sent_by: float | None) -> bool:
        """Receive more of the current READ data; False when none is there now.

        One scatter read takes as many of the targets as one call can name (IOV_MAX) and,
        when they end the reply and more replies are due, the next reply's header too,
        which lands in the (empty) scratch; the data itself never does. Once every
        request is out (`sent_by`: the exchange's deadline) that read waits for all of it
        (MSG_WAITALL, bounded by the deadline): a gather of 4 KiB pages otherwise took ~30 wake-ups per 2 MiB reply,
        each cutting the target list anew.
        """
        targets = self._targets
        if self._start != self._end:  # never with exact header reads; kept for safety
            got = self._from_scratch(targets)
        else:
            chunk = targets.chunk(IOV_MAX - 1)
            header_too = (targets.index + len(chunk) == len(targets.buffers)
                          and self._run_end < total)
            if header_too:  # these targets end the reply, and another reply is due
                self._start = self._end = 0
                chunk.append(self._view[:wire.HEADER_SIZE])
            flags = _DONTWAIT
            if sent_by is not None:
                self._arm(sent_by)
                flags = _WAITALL
            try:
                got = (self.sock.recvmsg_into(chunk, 0, flags)[0] if len(chunk) > 1
                       else self.sock.recv_into(chunk[0], 0, flags))
            except BlockingIOError:  # nothing now, or SO_RCVTIMEO passed: the loop decides
                return False
            if not got:
                raise self._lost("closed", "peer closed the connection")
            if header_too and got > self._data_left:
                self._end = got - self._data_left
                got = self._data_left
        self._data_left -= got
        done = targets.advance(got)
        if self._frame_ends is None:  # one buffer per frame
            self.replied += done
        else:
            self.replied = self._run_first + bisect.bisect_right(self._frame_ends,
                                                                 targets.moved)
        return True

    def _from_scratch(self, targets: BufferQueue) -> int:
        """Copy READ data that reached the scratch into its targets; returns the bytes."""
        moved = 0
        for target in targets.chunk():
            if self._start == self._end:
                break
            size = min(len(target), self._end - self._start)
            memoryview(target)[:size] = self._view[self._start:self._start + size]
            self._start += size
            moved += size
        return moved

    def _fill(self, need: int, exact: bool) -> bool:
        """Have `need` unread bytes in the scratch; False when the socket has no more now.

        `exact` reads no further than `need`, so bytes after it stay in the socket.
        """
        while self._end - self._start < need:
            if self._start == self._end:
                self._start = self._end = 0
            elif self._start + need > _SCRATCH:
                have = self._end - self._start
                self._scratch[:have] = self._scratch[self._start:self._end]
                self._start, self._end = 0, have
            want = need - (self._end - self._start) if exact else _SCRATCH - self._end
            try:
                got = self.sock.recv_into(self._view[self._end:self._end + want], want,
                                          _DONTWAIT)
            except BlockingIOError:
                return False
            if not got:
                raise self._lost("closed", "peer closed the connection")
            self._end += got
        return True

    def _wait(self, events: int, deadline: float) -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise self._lost("timeout", "deadline passed")
        if events != self._events:
            self._events = events
            self._poll.modify(self._fd, events)
        self._poll.poll(math.ceil(remaining * 1000))


def _undone(frames: _Frames, lost: _StreamLost) -> set[int]:
    """Positions of items not completed on a broken stream: an item is done only when
    every one of its frames was acknowledged (refused frames are not done either)."""
    positions = frames.positions
    if frames.lasts is None:
        undone = set(positions[lost.replied:])
        undone.update(positions[n] for n, _ in lost.refusals)
        return undone
    undone = set()
    for frame in [*range(lost.replied, len(positions)), *(n for n, _ in lost.refusals)]:
        undone.update(frames.covered(frame))
    return undone


def _lane_bounds(total: int, lanes: int) -> list[int]:
    """Cut [0, total) into `lanes` nearly equal contiguous ranges: lanes + 1 offsets."""
    bounds = [0]
    for lane in range(1, lanes):
        cut = total * lane // lanes
        cut -= cut % _STRIPE_ALIGN
        bounds.append(max(cut, bounds[-1]))
    bounds.append(total)
    return bounds


def _run_lane(conn: _Connection, frames: _Frames,
              deadline: float) -> list[tuple[int, HixlError]] | _StreamLost:
    """One lane of a striped transfer: its refusals, or how its stream broke."""
    try:
        return conn.exchange(frames, deadline)
    except _StreamLost as lost:
        return lost


class SocketTransport(Transport):
    """Client of one remote agent's data port (TCP, or a unix socket on the same node)."""

    def __init__(self, address: str, *, identity: str = "", connect_timeout: float = 5.0,
                 max_connections: int = 4, frame_limit: int = wire.MAX_PAYLOAD,
                 cluster_token: str | bytes | None = None, stripes: int | None = None,
                 stripe_min_bytes: int = STRIPE_MIN_BYTES) -> None:
        self.name, self._family, self._sockaddr = parse_data_address(address)
        if max_connections < 1:
            raise ParamInvalid(f"max_connections must be >= 1, got {max_connections}")
        if not 0 < frame_limit <= wire.MAX_PAYLOAD:
            raise ParamInvalid(f"frame_limit must be in [1, {wire.MAX_PAYLOAD}], got {frame_limit}")
        if stripes is None:  # striping pays off over TCP; unix streams showed no gain
            stripes = 1 if self._family == socket.AF_UNIX else STRIPES
        if stripes < 1 or stripe_min_bytes < 1:
            raise ParamInvalid(f"stripes and stripe_min_bytes must be >= 1, got {stripes} and "
                               f"{stripe_min_bytes}")
        self._stripes = stripes
        self._stripe_min_bytes = stripe_min_bytes
        self._fast = FASTWIRE  # a lone op's frame in C (hixl._fastwire), or None: Python
        # a lone op up to this size takes the blocking single-frame path (never striped)
        self._single_max = min(SINGLE_MAX, frame_limit,
                               stripe_min_bytes - 1 if stripes > 1 else SINGLE_MAX)
        self._helpers: concurrent.futures.ThreadPoolExecutor | None = None  # striped lanes
        self.address = address
        self._identity = identity.encode("utf-8")
        if len(self._identity) > wire.MAX_HELLO:
            raise ParamInvalid(f"identity is {len(self._identity)} bytes, at most {wire.MAX_HELLO}")
        self._token = auth.as_token(cluster_token)  # proven when the agent asks (hixl.auth)
        self._connect_timeout = connect_timeout
        self._max_connections = max_connections
        self._frame_limit = frame_limit
        # the pool's lock, entered directly (a Condition's own __enter__ and notify are
        # Python code: ~1 us per op); the Condition on it is for the rare waits only
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._waiting = 0  # threads waiting in _acquire for a connection
        self._idle: list[_Connection] = []
        self._live: set[_Connection] = set()
        self._opening = 0
        self._closed = False

    # ------------------------------------------------------------ public API

    def transfer(self, op: TransferOp, items: Sequence[Item], deadline: float) -> None:
        """Run the batch on one pooled connection, or striped over several if it is large.

        A batch of at least `stripe_min_bytes` is cut into up to `stripes` contiguous
        byte ranges, one per connection (an op on a boundary is split into two frames),
        and one poll loop drives them all. Extra connections are taken only when the pool
        has them without waiting, and never the last free one, so a concurrent small
        transfer still gets through.
        """
        if len(items) == 1 and items[0].length <= self._single_max:
            self._single(op, items[0], deadline)
            return
        if not items:
            if self._closed:
                raise NotConnected(f"data connection to {self.address} is closed")
            return
        arrays = items if type(items) is ItemArrays else None
        conn = self._acquire(deadline, arrays.index.tolist() if arrays is not None
                             else [item.index for item in items])
        conns = [conn]
        total = 0
        if self._stripes > 1:
            total = int(arrays.lengths.sum()) if arrays is not None \
                else sum(item.length for item in items)
            if total >= self._stripe_min_bytes:
                # no lane thinner than the cut alignment
                wanted = min(self._stripes, max(1, total // _STRIPE_ALIGN)) - 1
                conns += self._extra_connections(wanted, deadline)
        what = f"{op.name} of {len(items)} op(s) with {self.address}"
        try:
            if len(conns) == 1:
                frames = self._frames(conn.proto, op, items)
            else:
                bounds = _lane_bounds(total, len(conns))
                lanes = [(lane, self._frames(lane.proto, op, items, lo, hi))
                         for lane, lo, hi in zip(conns, bounds[:-1], bounds[1:], strict=True)]
        except BaseException:
            for lane in conns:
                self._release(lane, reusable=False)
            raise
        if len(conns) == 1:
            refusals = self._exchange(conn, frames, deadline, what, items)
            sets = [frames]
        else:
            refusals = self._exchange_striped(lanes, deadline, what, items)
            sets = [lane_frames for _, lane_frames in lanes]
        if refusals and any(frame_set.vectors for frame_set in sets):
            whole = set().union(*(frame_set.vector_positions() for frame_set in sets))
            refusals = self._narrow(op, items, refusals, whole, deadline, what)
        if refusals:
            failed = sorted({items[pos].index for pos, _ in refusals})
            first = min(refusals, key=lambda refusal: refusal[0])[1]
            first.failed = failed
            raise first

    def _narrow(self, op: TransferOp, items: Sequence[Item],
                refusals: list[tuple[int, HixlError]], vectored: set[int], deadline: float,
                what: str) -> list[tuple[int, HixlError]]:
        """The agent refuses a vector request whole, for its first bad range: run the ops
        of refused vectors (`vectored`: the positions vectors carried) once more, one
        frame each (nothing of a refused frame moved, so no byte is moved twice), so
        that `.failed` names exactly the ops refused, as without vectors. Costs a round
        trip on the error path only."""
        positions = sorted({pos for pos, _ in refusals if pos in vectored})
        if not positions:
            return refusals
        kept = [(pos, error) for pos, error in refusals if pos not in vectored]
        retry = [items[pos] for pos in positions]
        conn = self._acquire(deadline, [item.index for item in retry])
        try:
            frames = self._frames(conn.proto, op, retry, vectors=False)
        except BaseException:
            self._release(conn, reusable=False)
            raise
        again = self._exchange(conn, frames, deadline, what, retry)
        return kept + [(positions[pos], error) for pos, error in again]

    def _single(self, op: TransferOp, item: Item, deadline: float) -> None:
        """One op in one frame (`_Connection.single`): the path of small latency-bound
        calls, so it builds no frame lists and names the op in messages only on failure.

        A pooled connection is used without first polling it for staleness (a system
        call, ~2.4 µs of a ~20 µs op): if it turns out dead (EOF, a reset, or bytes that are
        not the reply) before any reply was read, the op runs once more on a fresh
        connection. That is safe because a one-sided WRITE or READ is idempotent: doing it
        twice leaves the same bytes in the same place.
        """
        writing = op == TransferOp.WRITE
        segment = item.segment
        retried = False
        while True:
            conn = self._acquire(deadline, [item.index], check_idle=retried)
            assert conn is not None
            try:
                error = conn.single(_WRITE if writing else _READ, segment.segment_id,
                                    segment.epoch, item.remote_addr, item.local_addr,
                                    item.length, deadline)
            except _StreamLost as lost:
                self._release(conn, reusable=False)
                if conn.pooled and not retried and lost.kind != "timeout" \
                        and not lost.replied and not self._closed:
                    retried = True  # a stale pooled stream: once more, on a checked one
                    continue
                raise self._stream_error(lost, f"{op.name} of 1 op(s) with {self.address}",
                                         [item], {0}) from None
            except BaseException:
                self._release(conn, reusable=False)
                raise
            break
        self._release(conn, reusable=True)
        if error is not None:
            error.failed = [item.index]
            raise error

    def ping(self, deadline: float) -> None:
        """One round trip on a pooled connection: proves the agent's data port answers."""
        conn = self._acquire(deadline, [])
        frames = _Frames([-1], [conn.proto.ping()])
        refusals = self._exchange(conn, frames, deadline, f"ping of {self.address}", ())
        if refusals:
            raise refusals[0][1]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            busy = [conn for conn in self._live if conn not in idle]
            self._live.difference_update(idle)
            helpers, self._helpers = self._helpers, None
            self._cond.notify_all()
        for conn in idle:
            conn.close()
        for conn in busy:  # their transfers fail now instead of running on
            conn.abort()
        if helpers is not None:  # idle threads exit; running lanes end on their aborted streams
            helpers.shutdown(wait=False)

    # ------------------------------------------------------------ internals

    def _frames(self, proto: wire.ClientProtocol, op: TransferOp, items: Sequence[Item],
                lo: int = 0, hi: int | None = None, *, vectors: bool = True) -> _Frames:
        """The request frames for bytes [lo, hi) of the batch (all of it by default).

        The batch's bytes are its items' in order; an item only partly inside the range
        contributes that part. Frames carry at most `frame_limit` bytes. `vectors`: frames
        of one segment go as vector requests where the agent serves them.
        """
        limit = self._frame_limit
        writing = op == TransferOp.WRITE
        if (type(items) is ItemArrays and vectors and proto.vectors and lo == 0 and hi is None
                and int(items.lengths.max()) <= limit):
            return _array_frames(proto, op, items, limit)
        lengths = [item.length for item in items]
        if lo == 0 and hi is None and max(lengths, default=0) <= limit:
            # the common case, one frame per item: no per-item branches
            positions = list(range(len(items)))
            addrs = [item.local_addr for item in items]
            requests = [(item.segment.segment_id, item.segment.epoch, item.remote_addr,
                         item.length) for item in items]
        else:
            positions, requests, addrs, lengths = self._cut(items, lo, hi, limit)
        if not requests:
            return _Frames([], [])
        views: list[Any] = _views(addrs, lengths, writable=not writing)
        positions, lasts, requests, views = _merge(positions, requests, views, limit)
        opcode = wire.Op.WRITE if writing else wire.Op.READ
        vector_frames: list[int] | None = None
        if vectors and proto.vectors and len(requests) > 1:
            positions, lasts, headers, views, vector_frames = _vectors(
                proto, opcode, positions, lasts, requests, views, limit)
        else:
            headers = proto.requests(opcode, requests)
        if writing:
            return _Frames(positions, headers, payloads=views, lasts=lasts,
                           vectors=vector_frames)
        return _Frames(positions, headers, targets=views, lasts=lasts, vectors=vector_frames)

    @staticmethod
    def _cut(items: Sequence[Item], lo: int, hi: int | None, limit: int
             ) -> tuple[list[int], list[tuple[int, int, int, int]], list[int], list[int]]:
        """Frames for bytes [lo, hi) of the batch, none over `limit` bytes: (item positions,
        (segment id, epoch, remote addr, length) requests, local addrs, lengths)."""
        positions: list[int] = []
        requests: list[tuple[int, int, int, int]] = []
        addrs: list[int] = []
        lengths: list[int] = []
        end = 0  # the batch offset where the current item ends
        for pos, item in enumerate(items):
            addr, remote, length = item.local_addr, item.remote_addr, item.length
            start = end
            end += length
            if end <= lo:
                continue
            if hi is not None and start >= hi:
                break
            skip = max(lo - start, 0)
            cut = max(end - hi, 0) if hi is not None else 0
            length -= skip + cut
            addr += skip
            remote += skip
            seg = item.segment
            for offset, part_length in (wire.split(remote, length, limit) if length > limit
                                        else [(0, length)]):
                positions.append(pos)
                requests.append((seg.segment_id, seg.epoch, remote + offset, part_length))
                addrs.append(addr + offset)
                lengths.append(part_length)
        return positions, requests, addrs, lengths

    def _exchange(self, conn: _Connection, frames: _Frames, deadline: float, what: str,
                  items: Sequence[Item]) -> list[tuple[int, HixlError]]:
        """Run frames on `conn`, return it to the pool or drop it, map stream failures.

        Returns (item position, error) per refused frame.
        """
        try:
            refusals = conn.exchange(frames, deadline)
        except _StreamLost as lost:
            self._release(conn, reusable=False)
            raise self._stream_error(lost, what, items, _undone(frames, lost)) from None
        except BaseException:
            self._release(conn, reusable=False)
            raise
        self._release(conn, reusable=True)
        return [(pos, error) for n, error in refusals for pos in frames.covered(n)]

    def _exchange_striped(self, lanes: list[tuple[_Connection, _Frames]], deadline: float,
                          what: str, items: Sequence[Item]) -> list[tuple[int, HixlError]]:
        """`_exchange` over several connections at once, each driven by its own thread.

        A lane that breaks is dropped and the others run on, so `.failed` names exactly
        the items with a frame not acknowledged; the first broken lane decides the error.
        """
        try:
            outcomes = self._run_lanes(lanes, deadline)
        except BaseException:
            for conn, _ in lanes:
                self._release(conn, reusable=False)
            raise
        refusals: list[tuple[int, HixlError]] = []
        undone: set[int] = set()
        first_lost: _StreamLost | None = None
        for (conn, frames), outcome in zip(lanes, outcomes, strict=True):
            if isinstance(outcome, _StreamLost):
                self._release(conn, reusable=False)
                undone |= _undone(frames, outcome)
                first_lost = first_lost or outcome
            else:
                self._release(conn, reusable=True)
                refusals += [(pos, error) for n, error in outcome
                             for pos in frames.covered(n)]
        if first_lost is not None:
            undone.update(pos for pos, _ in refusals)
            raise self._stream_error(first_lost, what, items, undone)
        return refusals

    def _run_lanes(self, lanes: list[tuple[_Connection, _Frames]],
                   deadline: float) -> list[list[tuple[int, HixlError]] | _StreamLost]:
        """Lane 0 in this thread, the others in the transport's helper threads.

        Threads, not one poll loop over all sockets: measured on 2 cores between two
        hosts, a single thread doing every lane's kernel copies gained nothing, while a
        thread per lane lets the copies run on several cores (READ 64 MiB: 0.7x -> 1.0x
        of a raw stream). Each lane's exchange is bounded by the deadline itself.
        """
        with self._lock:
            if self._closed:  # close() aborted these streams: every lane fails at once
                return [_run_lane(conn, frames, deadline) for conn, frames in lanes]
            if self._helpers is None:
                self._helpers = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self._max_connections, thread_name_prefix="hixl-stripe")
            # submitted under the lock: close() cannot shut the pool down in between (a
            # submit after its shutdown raised RuntimeError instead of NotConnected)
            futures = [self._helpers.submit(_run_lane, conn, frames, deadline)
                       for conn, frames in lanes[1:]]
        outcomes = [_run_lane(*lanes[0], deadline)]
        for (conn, _), future in zip(lanes[1:], futures, strict=True):
            try:
                # the lane returns by its deadline; the grace only covers scheduling
                outcomes.append(future.result(deadline - time.monotonic() + _LANE_GRACE_S))
            except concurrent.futures.TimeoutError:
                conn.abort()
                outcomes.append(conn._lost("timeout", "deadline passed"))
        return outcomes

    def _stream_error(self, lost: _StreamLost, what: str, items: Sequence[Item],
                      undone: set[int]) -> HixlError:
        """The typed error for a broken stream; `undone` are the positions not completed."""
        undone.discard(-1)
        failed = sorted(items[pos].index for pos in undone)
        if self._closed:
            return NotConnected(f"{what}: transport closed during the transfer", failed=failed)
        if lost.kind == "timeout":
            return TransferTimeout(f"{what} timed out: {len(failed)} op(s) not acknowledged "
                                   f"by the peer", failed=failed)
        if lost.kind == "protocol":
            return TransferFailed(f"{what} failed: {lost}", failed=failed)
        return PeerUnavailable(f"{what} failed: {lost}; {len(failed)} op(s) not acknowledged",
                               failed=failed)

    def _extra_connections(self, wanted: int, deadline: float) -> list[_Connection]:
        """Up to `wanted` more connections for a striped transfer, without waiting."""
        extra: list[_Connection] = []
        while len(extra) < wanted:
            conn = self._acquire(deadline, [], wait=False)
            if conn is None:
                break
            extra.append(conn)
        return extra

    def _acquire(self, deadline: float, indexes: list[int], *, wait: bool = True,
                 check_idle: bool = True) -> _Connection | None:
        """An idle connection, a new one (up to max_connections), or wait for one.

        With wait=False (a striped transfer's extra lanes): None instead of waiting, when
        taking one would leave the pool no free connection, or when it cannot be opened.
        check_idle=False: an idle connection is returned without polling it for EOF (the
        caller retries on a fresh one if it turns out dead: `_single`).
        """
        with self._lock:
            while True:
                if self._closed:
                    if not wait:
                        return None
                    raise NotConnected(f"data connection to {self.address} is closed",
                                       failed=indexes)
                if not wait and (len(self._live) - len(self._idle) + self._opening + 1
                                 >= self._max_connections):
                    return None
                while self._idle:
                    pooled = self._idle.pop()
                    if not check_idle or not pooled.is_stale():
                        return pooled
                    self._live.discard(pooled)  # the agent closed it (stopped, restarted)
                    pooled.close()
                if len(self._live) + self._opening < self._max_connections:
                    self._opening += 1
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TransferTimeout(
                        f"all {self._max_connections} data connections to {self.address} stayed "
                        "busy until the deadline", failed=indexes)
                self._waiting += 1
                try:
                    self._cond.wait(remaining)
                finally:
                    self._waiting -= 1
        conn: _Connection | None = None
        try:
            conn = self._connect(deadline)
        except HixlError as exc:
            if not wait:
                log.debug("no extra data connection to %s: %s", self.address, exc)
                return None
            exc.failed = indexes
            raise
        finally:
            with self._lock:
                self._opening -= 1
                if conn is not None and not self._closed:
                    self._live.add(conn)
                if self._waiting:
                    self._cond.notify()
        if self._closed:
            self._release(conn, reusable=False)
            if not wait:
                return None
            raise NotConnected(f"data connection to {self.address} is closed", failed=indexes)
        return conn

    def _connect(self, deadline: float) -> _Connection:
        """Open a stream and do the handshake, within the deadline and connect_timeout.

        HELLO; if the agent answers with a challenge, AUTH with the cluster token and check
        the agent's own proof (mutual). An agent without a token does not challenge: a
        client with one still connects.
        """
        limit = min(deadline, time.monotonic() + self._connect_timeout)
        timeout_error: type[HixlError] = (TransferTimeout if limit == deadline
                                          else PeerUnavailable)
        remaining = limit - time.monotonic()
        if remaining <= 0:
            raise TransferTimeout(f"deadline passed before connecting to {self.address}")
        sock = socket.socket(self._family, socket.SOCK_STREAM)
        try:
            tune_socket(sock)
            sock.settimeout(remaining)
            sock.connect(self._sockaddr)
            sock.settimeout(None)  # blocking: each connection bounds its calls (_arm)
        except TimeoutError:
            sock.close()
            raise timeout_error(f"connecting to {self.address} timed out") from None
        except OSError as exc:
            sock.close()
            reason = exc.strerror or str(exc)
            if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
                reason = "connection refused (no agent listening there)"
            raise PeerUnavailable(f"cannot connect to {self.address}: {reason}") from None
        conn = _Connection(sock, self._fast)
        try:
            handshake(DeadlineSocket(sock), conn.proto, self._identity, self._token, limit,
                      runs=True)
        except TimeoutError:
            conn.close()
            raise timeout_error(f"handshake with {self.address} failed: deadline passed") \
                from None
        except (OSError, wire.ProtocolError) as exc:
            conn.close()
            raise PeerUnavailable(f"handshake with {self.address} failed: {exc}") from None
        except AuthenticationFailed as exc:
            conn.close()
            raise AuthenticationFailed(f"data port {self.address}: {exc.args[0]}") from None
        except Refused as refused:
            conn.close()
            if isinstance(refused.error, AuthenticationFailed):
                raise AuthenticationFailed(f"data port {self.address} refused this client: "
                                           f"{refused}") from None
            raise refused.error from None
        except BaseException:
            conn.close()
            raise
        log.debug("data connection to %s open", self.address)
        return conn

    def _release(self, conn: _Connection, *, reusable: bool) -> None:
        with self._lock:
            if reusable and not self._closed and conn in self._live:
                conn.pooled = True
                self._idle.append(conn)
            else:
                self._live.discard(conn)
                conn.close()
            if self._waiting:
                self._cond.notify()
