"""Property tests of the sans-IO data-path codec (hixl/wire.py) under hostile input.

A small driver does with each action what server/agent/data_server.py does (receive into the
target, discard, read the handshake payload, send, close), on bytes cut into arbitrary
chunks, over segments laid out in one buffer with canary bytes around each. Properties:
the server side never raises; every byte it lets into memory lands exactly in the window
the header names, inside a segment that allows it (checked against the table, not taken
from the action); canaries and every other byte stay as they were; every reply is a
well-formed frame; nothing is served before the handshake. The client side raises nothing
but ProtocolError or a HixlError on any reply stream. Every encoder round-trips, and the
header fields at their limits get the documented answer.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from fuzzing import fuzz_settings
from hypothesis import given
from hypothesis import strategies as st

from hixl import auth, errors, wire
from hixl.types import Perm
from hixl.wire import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_HELLO,
    MAX_PAYLOAD,
    VERSION,
    Close,
    Discard,
    Header,
    Op,
    ProtocolError,
    ReadHello,
    ReadTable,
    Reason,
    ReceiveInto,
    ReceiveVector,
    Send,
    SendVector,
    ServedSegment,
    ServerProtocol,
)

U64 = (1 << 64) - 1
EPOCH = 7
AGENT_EPOCH = 3
CANARY = 64
TOKEN = b"fuzz-cluster-token"


@dataclass(frozen=True)
class Layout:
    """Where a segment lives in the backing buffer, and what the server is told of it."""

    segment_id: int
    base: int      # owner address (what frames name)
    length: int
    perms: Perm
    offset: int    # where its bytes are in the backing buffer


# owner addresses include the very top of the 64-bit space, so addr + length > 2**64 is
# reachable with in-range-looking fields, and address 0
LAYOUTS = [
    Layout(1, 0x7F00_0000_0000, 4096, Perm.RW, 0),
    Layout(2, 0x7F00_0001_0000, 100, Perm.READ, 0),
    Layout(3, 0x7F00_0002_0000, 256, Perm.WRITE, 0),
    Layout(4, (1 << 64) - 256, 256, Perm.RW, 0),
    Layout(5, 0, 64, Perm.RW, 0),
]


def _placed(layouts: list[Layout]) -> list[Layout]:
    """The layouts at offsets with CANARY bytes before, between and after them."""
    placed, offset = [], CANARY
    for lay in layouts:
        placed.append(Layout(lay.segment_id, lay.base, lay.length, lay.perms, offset))
        offset += lay.length + CANARY
    return placed


LAYOUTS = _placed(LAYOUTS)
BACKING_SIZE = LAYOUTS[-1].offset + LAYOUTS[-1].length + CANARY
BY_ID = {lay.segment_id: lay for lay in LAYOUTS}


def address_of(view: memoryview) -> int:
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


class Memory:
    """The backing buffer (segments + canaries), its served table, and the model of what
    it must hold: the initial bytes plus exactly the writes the headers named."""

    def __init__(self) -> None:
        rng = random.Random(1)
        self.backing = bytearray(rng.randbytes(BACKING_SIZE))  # canaries: random too
        self.expected = bytearray(self.backing)
        view = memoryview(self.backing)
        self.table = {lay.segment_id: ServedSegment(
            lay.segment_id, EPOCH, lay.base, lay.length, lay.perms,
            view[lay.offset:lay.offset + lay.length]) for lay in LAYOUTS}

    def resolve(self, segment_id: int) -> ServedSegment | None:
        return self.table.get(segment_id)

    def assert_intact(self) -> None:
        """Every byte is what the model says: canaries untouched, and segment bytes changed
        only where an accepted WRITE's header pointed."""
        if self.backing != self.expected:
            bad = next(i for i, (a, b) in enumerate(zip(self.backing, self.expected,
                                                       strict=True)) if a != b)
            where = next((f"segment {lay.segment_id} offset {bad - lay.offset}"
                          for lay in LAYOUTS if lay.offset <= bad < lay.offset + lay.length),
                         "a canary")
            raise AssertionError(f"byte {bad} ({where}) changed unexpectedly")


def assert_frame(reply: bytes, request_id: int | None = None) -> Header:
    """A reply the server sends is one well-formed REPLY frame, payload included."""
    header = wire.decode_header(reply[:HEADER_SIZE])
    assert header.opcode == Op.REPLY
    assert len(reply) == HEADER_SIZE + wire.payload_length(header)
    if request_id is not None:
        assert header.request_id == request_id
    if header.flags & wire.FLAG_ERROR_TEXT:
        assert header.reason in set(Reason) - {Reason.OK} and header.status != errors.SUCCESS
        assert header.length <= wire.MAX_ERROR_TEXT
        reply[HEADER_SIZE:].decode("utf-8")  # the text is valid UTF-8
    return header


@dataclass
class ServerDriver:
    """Executes ServerProtocol's actions as the data server does, on arbitrary chunks."""

    proto: ServerProtocol
    memory: Memory
    in_place: bool  # on_header_at on the receive buffer (the agent's ring), else on_header
    buf: bytearray = field(default_factory=bytearray)
    pending: list = field(default_factory=list)  # [kind, ...state] of a payload in progress
    closed: bool = False
    replies: list[bytes] = field(default_factory=list)
    served: int = 0  # accepted WRITE/READ

    def feed(self, chunk: bytes) -> None:
        if self.closed:
            return
        self.buf += chunk
        while not self.closed:
            if self.pending:
                if not self._payload():
                    return
                continue
            if len(self.buf) < HEADER_SIZE:
                return
            fields = HEADER.unpack_from(self.buf, 0)
            if self.in_place:
                action = self.proto.on_header_at(self.buf, 0)
            else:
                action = self.proto.on_header(bytes(self.buf[:HEADER_SIZE]))
            del self.buf[:HEADER_SIZE]
            self._act(fields, action)

    def _act(self, fields: tuple[int, ...], action: wire.Action) -> None:
        magic, version, op, _flags, _reason, _status, epoch, rid, segment_id, addr, length = fields
        if type(action) is ReadTable:
            assert self.proto.authenticated and _flags & wire.FLAG_VECTOR
            assert op in (Op.WRITE, Op.READ) and (action.request_id, action.epoch) == (rid, epoch)
            assert action.count == addr * wire.VECTOR_ENTRY.size and 1 <= addr <= MAX_VECTOR
            assert 1 <= length <= MAX_PAYLOAD
            self.pending = ["table", action, bytearray(), fields]
            return
        window = action.target if type(action) is ReceiveInto else (
            action.payload if type(action) is Send else None)
        if window is not None:
            # accepted: check everything against the table, never trusting the action
            assert self.proto.authenticated, "a WRITE/READ was served before the handshake"
            assert (magic, version, action.request_id) == (MAGIC, VERSION, rid)
            assert op == (Op.WRITE if type(action) is ReceiveInto else Op.READ)
            seg = self.memory.table[segment_id]
            lay = BY_ID[segment_id]
            assert seg.epoch == epoch
            assert seg.perms & (Perm.WRITE if op == Op.WRITE else Perm.READ)
            assert 1 <= length <= MAX_PAYLOAD
            assert seg.base <= addr and addr + length <= seg.base + seg.length
            assert len(window) == length
            assert address_of(window) == address_of(seg.memory) + (addr - seg.base)
            self.served += 1
            if type(action) is ReceiveInto:
                self.pending = ["write", action, 0, lay.offset + addr - seg.base]
            else:
                assert bytes(window) == self.memory.backing[
                    lay.offset + addr - seg.base:lay.offset + addr - seg.base + length]
                reply = action.reply + bytes(window)  # the data follows its OK header
                assert assert_frame(reply, rid).status == errors.SUCCESS
                self.replies.append(reply)
            return
        if type(action) is Send:  # PING, or a refusal of a READ / bad length
            header = assert_frame(action.reply, rid)
            assert (op == Op.PING) == (header.status == errors.SUCCESS)
            self.replies.append(action.reply)
        elif type(action) is Discard:  # a refused WRITE: its payload is skipped
            assert op == Op.WRITE and action.count == length <= MAX_PAYLOAD
            assert assert_frame(action.reply, rid).flags & wire.FLAG_ERROR_TEXT
            self.pending = ["discard", action, action.count]
        elif type(action) is ReadHello:
            assert op in (Op.HELLO, Op.AUTH) and action.count == length <= MAX_HELLO
            self.pending = ["hello", action, bytearray()]
        else:
            assert type(action) is Close, action
            if action.reply is not None:
                assert_frame(action.reply)
            self.closed = True

    def _vector(self, fields: tuple[int, ...], table_action: ReadTable, table: bytes) -> None:
        """A vector request's table has come: check the protocol's answer against the
        table itself (every range of an accepted vector inside its segment, with the
        rights), then move the data as for one WRITE/READ."""
        op, segment_id, epoch, length = fields[2], fields[8], fields[6], fields[10]
        rid = fields[7]
        action = self.proto.on_table(table_action, table)
        ranges = [wire.VECTOR_ENTRY.unpack_from(table, at)
                  for at in range(0, len(table), wire.VECTOR_ENTRY.size)]
        if type(action) in (ReceiveVector, SendVector):
            seg = self.memory.table[segment_id]
            assert seg.epoch == epoch and action.request_id == rid
            assert seg.perms & (Perm.WRITE if op == Op.WRITE else Perm.READ)
            assert (op == Op.WRITE) == (type(action) is ReceiveVector)
            views = action.targets if type(action) is ReceiveVector else action.views
            assert len(views) == len(ranges) and sum(n for _, n in ranges) == length
            assert action.size == length
            lay = BY_ID[segment_id]
            spots = []
            for (at, n), view in zip(ranges, views, strict=True):
                assert n >= 1 and seg.base <= at and at + n <= seg.base + seg.length
                assert len(view) == n
                assert address_of(view) == address_of(seg.memory) + (at - seg.base)
                spots.append(lay.offset + at - seg.base)
            self.served += 1
            if type(action) is ReceiveVector:
                self.pending = ["vwrite", action, 0, spots]
            else:
                data = b"".join(bytes(view) for view in views)
                assert data == b"".join(bytes(self.memory.backing[s:s + len(v)])
                                        for s, v in zip(spots, views, strict=True))
                reply = wire.ok_reply(rid, length) + data
                assert assert_frame(reply, rid).status == errors.SUCCESS
                self.replies.append(reply)
        elif type(action) is Discard:
            assert op == Op.WRITE and action.count == length
            assert assert_frame(action.reply, rid).flags & wire.FLAG_ERROR_TEXT
            self.pending = ["discard", action, action.count]
        else:
            assert type(action) is Send and op == Op.READ, action
            assert assert_frame(action.reply, rid).status != errors.SUCCESS
            self.replies.append(action.reply)

    def _payload(self) -> bool:
        """Move payload bytes for the pending action; False when more are needed."""
        kind, action = self.pending[0], self.pending[1]
        if kind == "write":
            filled, at = self.pending[2], self.pending[3]
            take = bytes(self.buf[:len(action.target) - filled])
            del self.buf[:len(take)]
            action.target[filled:filled + len(take)] = take
            self.memory.expected[at + filled:at + filled + len(take)] = take
            self.pending[2] = filled = filled + len(take)
            if filled < len(action.target):
                return False
            self.replies.append(action.reply)
        elif kind == "vwrite":
            filled, spots = self.pending[2], self.pending[3]
            take = bytes(self.buf[:action.size - filled])
            del self.buf[:len(take)]
            done = 0
            at = 0
            for view, spot in zip(action.targets, spots, strict=True):  # in range order
                lo, hi = max(filled, at), min(filled + len(take), at + len(view))
                if lo < hi:
                    piece = take[lo - filled:hi - filled]
                    view[lo - at:hi - at] = piece
                    self.memory.expected[spot + lo - at:spot + hi - at] = piece
                    done += hi - lo
                at += len(view)
            self.pending[2] = filled = filled + done
            if filled < action.size:
                return False
            self.replies.append(wire.ok_reply(action.request_id))
        elif kind == "discard":
            take = min(self.pending[2], len(self.buf))
            del self.buf[:take]
            self.pending[2] -= take
            if self.pending[2]:
                return False
            self.replies.append(action.reply)
        else:  # "table" or "hello": `action.count` bytes gathered, then handed on
            got = self.pending[2]
            take = bytes(self.buf[:action.count - len(got)])
            del self.buf[:len(take)]
            got += take
            if len(got) < action.count:
                return False
            if kind == "table":
                fields = self.pending[3]
                self.pending = []
                self._vector(fields, action, bytes(got))
                return True
            answer = self.proto.on_hello(action.request_id, bytes(got))
            if type(answer) is Close:
                self.closed = True
            else:
                assert_frame(answer.reply, action.request_id)
                self.replies.append(answer.reply)
        self.pending = []
        return True


# ---------------------------------------------------------------- strategies

MAX_VECTOR = wire.MAX_VECTOR_RANGES
u8 = st.integers(0, 0xFF)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFF_FFFF)
u64 = st.integers(0, U64)
LENGTH_EDGES = [0, 1, 2, 47, 48, 100, 4096, MAX_PAYLOAD, MAX_PAYLOAD + 1, 1 << 32, 1 << 63,
                U64]


def _edges(lay: Layout) -> list[int]:
    values = [lay.base - 1, lay.base, lay.base + 1, lay.base + lay.length - 1,
              lay.base + lay.length, lay.base + lay.length + 1, 0, U64]
    return [v for v in values if 0 <= v <= U64]


# strategies built once: building them inside a draw costs more than the test itself
POISON = st.sampled_from(["magic", "version", "opcode", "closer", "payload", "every"])
ONE_IN_FIVE = st.integers(0, 4)
CLOSERS = st.sampled_from([Op.HELLO, Op.AUTH, Op.REPLY, Op.CALL])
REQUESTS = st.sampled_from([Op.WRITE, Op.READ, Op.WRITE, Op.READ, Op.PING])
FLAGS = st.one_of(st.just(0), st.sampled_from([1, 2, 4, 7, 0xFFFF]), u16)
HOSTILE_EPOCH = st.one_of(st.just(AGENT_EPOCH), u32)
HOSTILE_SEGMENT = st.one_of(st.sampled_from([0, 6, 99, U64]), u64)
SMALL = st.integers(0, 1 << 16)
LAYOUT = st.sampled_from(LAYOUTS)
EDGE_ADDR = {lay.segment_id: st.one_of(
    st.integers(max(0, lay.base - 16), min(U64, lay.base + lay.length + 16)),
    st.sampled_from(_edges(lay)), u64) for lay in LAYOUTS}
EDGE_LENGTH = {lay.segment_id: st.one_of(
    st.integers(0, lay.length + 16),
    st.sampled_from([*LENGTH_EDGES, lay.length, lay.length + 1]), u64) for lay in LAYOUTS}


@st.composite
def frames(draw: st.DrawFn, poison: bool = False) -> bytes:
    """One frame with hostile fields. A clean frame is a well-formed WRITE, READ or PING
    (payload exact) whose flags, epoch, segment, address and length may be anything, at
    and around the segments' edges: the stream stays in step. A `poison` frame breaks the
    stream: odd magic, version or opcode, a HELLO/AUTH/REPLY/CALL, a payload short or
    long, or every field random."""
    kind = draw(POISON) if poison else "clean"
    every = kind == "every"
    lay = draw(LAYOUT)
    magic = draw(u16) if kind == "magic" or every else MAGIC
    version = draw(u8) if kind == "version" or every else VERSION
    if kind == "opcode" or every:
        opcode = draw(u8)
    else:
        opcode = draw(CLOSERS if kind == "closer" else REQUESTS)
    flags = draw(FLAGS)
    epoch = EPOCH if draw(ONE_IN_FIVE) else draw(HOSTILE_EPOCH)
    segment_id = lay.segment_id if draw(ONE_IN_FIVE) else draw(HOSTILE_SEGMENT)
    end = lay.base + lay.length
    if draw(ONE_IN_FIVE):  # inside the segment: what the other fields decide
        addr = lay.base + draw(SMALL) % lay.length
        length = 1 + draw(SMALL) % (end - addr)
    else:  # at and around its edges, or anywhere
        addr = draw(EDGE_ADDR[lay.segment_id])
        length = draw(EDGE_LENGTH[lay.segment_id])
        if draw(ONE_IN_FIVE) == 0:
            length = min(U64, (1 << 64) - addr)  # addr + length == 2**64 exactly
    header = HEADER.pack(magic, version, opcode, flags, draw(u16) if every else 0,
                         draw(u32) if every else 0, epoch, draw(u64), segment_id, addr, length)
    carried = length if opcode in (Op.WRITE, Op.HELLO, Op.AUTH, Op.REPLY, Op.CALL) else 0
    if kind == "payload":
        carried = [carried // 2, carried + 17, 0][draw(SMALL) % 3]
    # a huge length arrives truncated: the rest of the stream is taken as its payload
    return header + random.Random(draw(u32)).randbytes(min(carried, 8192))


VECTOR_COUNT = st.one_of(st.integers(1, 6), st.sampled_from([0, MAX_VECTOR, MAX_VECTOR + 1]),
                        u64)
VECTOR_TOTAL = st.sampled_from(["sum", "sum", "sum", "off", "any"])


@st.composite
def vector_frames(draw: st.DrawFn) -> bytes:
    """A vector WRITE/READ whose table holds ranges in and around a segment (or anywhere),
    and whose header's count and length may disagree with the table: each refusal must
    keep the stream in step (or close it), no range outside its segment served."""
    lay = draw(LAYOUT)
    opcode = draw(st.sampled_from([Op.WRITE, Op.READ]))
    count = draw(VECTOR_COUNT)
    ranges = []
    for _ in range(min(count, 6)):
        if draw(ONE_IN_FIVE):
            at = lay.base + draw(SMALL) % lay.length
            ranges.append((at, 1 + draw(SMALL) % (lay.base + lay.length - at)))
        else:
            ranges.append((draw(EDGE_ADDR[lay.segment_id]), draw(EDGE_LENGTH[lay.segment_id])))
    total = sum(n for _, n in ranges)
    how = draw(VECTOR_TOTAL)
    length = total if how == "sum" else (total + 1 if how == "off" else draw(u64))
    length &= U64
    epoch = EPOCH if draw(ONE_IN_FIVE) else draw(HOSTILE_EPOCH)
    segment_id = lay.segment_id if draw(ONE_IN_FIVE) else draw(HOSTILE_SEGMENT)
    header = HEADER.pack(MAGIC, VERSION, opcode, wire.FLAG_VECTOR | draw(FLAGS), 0, 0, epoch,
                         draw(u64), segment_id, count, length)
    table = b"".join(wire.VECTOR_ENTRY.pack(at & U64, n & U64) for at, n in ranges)
    data = random.Random(draw(u32)).randbytes(min(length, 8192)) if opcode == Op.WRITE else b""
    return header + table + data


def hello_frame(runs: bool, identity: bytes) -> bytes:
    frame = bytearray(wire.hello(1, identity))
    if runs:
        frame[4:6] = wire.FLAG_RUN.to_bytes(2, "big")
    return bytes(frame)


STARTS = st.sampled_from(["hello", "hello", "hello-runs", "hello-runs", "none", "garbage"])
POISONS = st.sampled_from(["none", "frame", "garbage"])
CLEAN_FRAMES = st.lists(st.one_of(frames(), frames(), vector_frames()), max_size=10)
POISON_FRAME = frames(poison=True)
GARBAGE = st.binary(min_size=1, max_size=80)


@st.composite
def streams(draw: st.DrawFn) -> bytes:
    """A connection's bytes: an optional HELLO, then frames mixed with garbage."""
    start = draw(STARTS)
    parts = []
    if start.startswith("hello"):
        parts.append(hello_frame(start == "hello-runs", draw(st.binary(max_size=24))))
    elif start == "garbage":
        parts.append(draw(st.binary(min_size=1, max_size=96)))
    body = draw(CLEAN_FRAMES)
    poison = draw(POISONS)
    if poison != "none":  # one frame that breaks the stream, somewhere
        body.insert(draw(SMALL) % (len(body) + 1),
                    draw(POISON_FRAME if poison == "frame" else GARBAGE))
    return b"".join(parts + body)


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    """`data` cut at the sizes in `cuts` (the rest in one last piece)."""
    pieces, at = [], 0
    for size in cuts:
        if at >= len(data):
            break
        pieces.append(data[at:at + size])
        at += size
    if at < len(data):
        pieces.append(data[at:])
    return pieces


cut_sizes = st.lists(st.integers(1, 200), max_size=30)


# ---------------------------------------------------------------- server side

@fuzz_settings(400)
@given(data=streams(), cuts=cut_sizes, in_place=st.booleans())
def test_server_never_raises_and_writes_only_named_windows(data: bytes, cuts: list[int],
                                                           in_place: bool) -> None:
    memory = Memory()
    driver = ServerDriver(ServerProtocol(memory.resolve, AGENT_EPOCH), memory, in_place)
    for piece in chunked(data, cuts):
        driver.feed(piece)
    memory.assert_intact()


@fuzz_settings(200)
@given(data=streams(), cuts=cut_sizes)
def test_with_a_token_nothing_is_served_without_a_valid_auth(data: bytes,
                                                              cuts: list[int]) -> None:
    """Random AUTH frames (no valid proof) never open the connection."""
    memory = Memory()
    driver = ServerDriver(ServerProtocol(memory.resolve, AGENT_EPOCH, TOKEN), memory, True)
    for piece in chunked(data, cuts):
        driver.feed(piece)
    assert driver.served == 0 and not driver.proto.authenticated
    memory.assert_intact()


@fuzz_settings(100)
@given(data=st.binary(min_size=HEADER_SIZE, max_size=HEADER_SIZE * 4),
       offset=st.integers(0, HEADER_SIZE * 3))
def test_on_header_at_any_offset_equals_on_header(data: bytes, offset: int) -> None:
    """The ring decoder gives the same answer as decoding the 48 bytes alone."""
    offset = min(offset, len(data) - HEADER_SIZE)
    raw = data[offset:offset + HEADER_SIZE]
    answers = []
    for in_place in (True, False):
        memory = Memory()
        proto = ServerProtocol(memory.resolve, AGENT_EPOCH)
        proto.on_hello(1, b"peer")  # authenticated (no token)
        action = proto.on_header_at(data, offset) if in_place else proto.on_header(raw)
        answers.append((type(action), getattr(action, "reply", None)))
    assert answers[0] == answers[1]


def test_short_headers_close_instead_of_raising() -> None:
    proto = ServerProtocol(Memory().resolve, AGENT_EPOCH)
    for size in (0, 1, 47, 49, 96):
        action = proto.on_header(b"\0" * size)
        assert isinstance(action, Close) and "expected 48" in action.reason


# ---------------------------------------------------------------- header fields at their limits

def served_protocol(*, runs: bool = False) -> tuple[ServerProtocol, Memory]:
    memory = Memory()
    proto = ServerProtocol(memory.resolve, AGENT_EPOCH)
    assert isinstance(proto.on_header(hello_frame(runs, b"")[:HEADER_SIZE]), ReadHello)
    proto.on_hello(1, b"")
    return proto, memory


def refusal(action: wire.Action) -> Reason:
    reply = action.reply
    assert reply is not None
    return Reason(assert_frame(reply).reason)


TOP = BY_ID[4]  # ends exactly at 2**64


@pytest.mark.parametrize("op, addr, length, answer, reason", [
    # the last byte of the address space is addressable; one more wraps past 2**64
    (Op.WRITE, U64, 1, ReceiveInto, None),
    (Op.READ, U64, 1, Send, None),
    (Op.WRITE, U64, 2, Discard, Reason.OUT_OF_RANGE),
    (Op.READ, U64, 2, Send, Reason.OUT_OF_RANGE),
    (Op.WRITE, TOP.base, TOP.length, ReceiveInto, None),
    (Op.WRITE, TOP.base, TOP.length + 1, Discard, Reason.OUT_OF_RANGE),
    (Op.READ, TOP.base + 1, U64, Send, Reason.BAD_LENGTH),
    (Op.WRITE, TOP.base + 1, U64, Close, Reason.BAD_LENGTH),  # unskippable payload
    (Op.WRITE, TOP.base, 0, Send, Reason.BAD_LENGTH),
    (Op.READ, TOP.base, 0, Send, Reason.BAD_LENGTH),
    (Op.WRITE, TOP.base, MAX_PAYLOAD, Discard, Reason.OUT_OF_RANGE),
    (Op.WRITE, TOP.base, MAX_PAYLOAD + 1, Close, Reason.BAD_LENGTH),
    (Op.READ, TOP.base, MAX_PAYLOAD + 1, Send, Reason.BAD_LENGTH),
    (Op.WRITE, TOP.base - 1, 2, Discard, Reason.OUT_OF_RANGE),  # starts before the segment
])
def test_address_and_length_limits(op: Op, addr: int, length: int, answer: type,
                                   reason: Reason | None) -> None:
    proto, memory = served_protocol()
    action = proto.on_header(HEADER.pack(MAGIC, VERSION, op, 0, 0, 0, EPOCH, 9, TOP.segment_id,
                                         addr, length))
    assert type(action) is answer
    if reason is None:
        window = action.target if answer is ReceiveInto else action.payload
        assert address_of(window) == address_of(memory.table[4].memory) + addr - TOP.base
        assert len(window) == length
    else:
        assert refusal(action) == reason


@pytest.mark.parametrize("patch, words", [
    ({"magic": 0}, "bad magic"), ({"magic": 0x5848}, "bad magic"),
    ({"version": 0}, "version 0"), ({"version": 2}, "version 2"),
    ({"version": 255}, "version 255"),
    ({"opcode": 0}, "unknown opcode 0"), ({"opcode": 8}, "unknown opcode 8"),
    ({"opcode": 255}, "unknown opcode 255"),
])
def test_bad_magic_version_opcode_close_with_bad_frame(patch: dict[str, int],
                                                       words: str) -> None:
    fields = {"magic": MAGIC, "version": VERSION, "opcode": int(Op.WRITE)} | patch
    raw = HEADER.pack(fields["magic"], fields["version"], fields["opcode"], 0, 0, 0, EPOCH, 1,
                      1, BY_ID[1].base, 8)
    for authenticated in (False, True):
        proto = served_protocol()[0] if authenticated else ServerProtocol({}.get, 1)
        action = proto.on_header(raw)
        assert isinstance(action, Close) and words in action.reason
        assert refusal(action) == Reason.BAD_FRAME


@pytest.mark.parametrize("flags", [wire.FLAG_ERROR_TEXT, wire.FLAG_CHALLENGE, wire.FLAG_RUN,
                                   0xFFFF & ~wire.FLAG_VECTOR])
def test_request_flags_do_not_change_what_is_served(flags: int) -> None:
    """Flags mean something only on HELLO and replies, and FLAG_VECTOR on WRITE/READ (its
    own tests); any other flag on a WRITE/READ is ignored."""
    proto, memory = served_protocol()
    lay = BY_ID[1]
    write = proto.on_header(HEADER.pack(MAGIC, VERSION, Op.WRITE, flags, 0, 0, EPOCH, 2, 1,
                                        lay.base + 8, 8))
    assert isinstance(write, ReceiveInto) and len(write.target) == 8
    ping = proto.on_header(HEADER.pack(MAGIC, VERSION, Op.PING, flags, 0, 0, 0, 3, 0, 0, 0))
    assert isinstance(ping, Send) and ping.reply == wire.ok_reply(3)


def test_hello_length_limit_and_unknown_flags() -> None:
    proto = ServerProtocol({}.get, AGENT_EPOCH)
    ok = proto.on_header(HEADER.pack(MAGIC, VERSION, Op.HELLO, 0xFFFF, 0, 0, 0, 1, 0, 0,
                                     MAX_HELLO))
    assert isinstance(ok, ReadHello) and ok.count == MAX_HELLO and proto.runs
    too_long = ServerProtocol({}.get, AGENT_EPOCH).on_header(
        HEADER.pack(MAGIC, VERSION, Op.HELLO, 0, 0, 0, 0, 1, 0, 0, MAX_HELLO + 1))
    assert isinstance(too_long, Close) and refusal(too_long) == Reason.BAD_LENGTH


# ---------------------------------------------------------------- client side

REPLY_FLAGS = st.one_of(st.sampled_from([0, wire.FLAG_RUN, wire.FLAG_ERROR_TEXT,
                                         wire.FLAG_CHALLENGE, 5, 7]), u16)
REPLY_STATUS = st.one_of(st.just(0), st.sampled_from([errors.PARAM_INVALID, errors.FAILED]),
                         u32)
REPLY_OPCODE = st.one_of(st.just(int(Op.REPLY)), st.sampled_from([int(op) for op in Op]), u8)
REPLY_CHOICE = st.sampled_from(["near", "near", "near", "zero", "any"])


@st.composite
def reply_frames(draw: st.DrawFn, first_id: int, sizes: list[int]) -> bytes:
    """A reply with hostile fields, near what the client expects: request ids around the
    outstanding ones, run counts and lengths around their sums, any flags and status."""
    near = {"near": first_id - 1 + draw(SMALL) % (len(sizes) + 3), "zero": 0}
    rid = near.get(draw(REPLY_CHOICE)) or draw(u64)
    count = draw(SMALL) % (len(sizes) + 3) if draw(ONE_IN_FIVE) else draw(u64)
    sums = [sum(sizes[:n]) for n in range(len(sizes) + 1)]
    lengths = [*sums, *sizes, 16, 32, wire.MAX_ERROR_TEXT + 1]
    length = lengths[draw(SMALL) % len(lengths)] if draw(ONE_IN_FIVE) else draw(
        st.one_of(SMALL, u64))
    magic = MAGIC if draw(ONE_IN_FIVE) else draw(u16)
    version = VERSION if draw(ONE_IN_FIVE) else draw(u8)
    header = HEADER.pack(magic, version, draw(REPLY_OPCODE), draw(REPLY_FLAGS),
                         0 if draw(ONE_IN_FIVE) else draw(u16), draw(REPLY_STATUS), draw(u32),
                         rid, draw(u64), count, length)
    return header + random.Random(draw(u32)).randbytes(min(length, 300))


@st.composite
def client_sessions(draw: st.DrawFn) -> tuple[wire.ClientProtocol, list[bytes]]:
    """A client with requests outstanding (HELLO, WRITEs, READs, PINGs, maybe AUTH), and
    the reply stream a hostile agent sends it."""
    client = wire.ClientProtocol()
    client.hello(draw(st.binary(max_size=16)), runs=draw(st.booleans()))
    sizes = [0]
    for kind, length in draw(st.lists(st.tuples(st.sampled_from("wrpa"),
                                                st.integers(1, 200)), max_size=8)):
        if kind == "w":
            client.write(1, EPOCH, 0, length)
            sizes.append(0)
        elif kind == "r":
            client.requests(Op.READ, [(1, EPOCH, 0, length)])
            sizes.append(length)
        elif kind == "p":
            client.ping()
            sizes.append(0)
        else:
            client.auth(TOKEN, bytes(auth.NONCE_SIZE))
            sizes.append(auth.PROOF_SIZE)
    # the first `good` requests are answered properly, then the agent turns hostile
    good = draw(SMALL) % (len(sizes) + 1)
    replies = [wire.ok_reply(rid, size) + bytes(size)
               for rid, size in enumerate(sizes[:good], 1)]
    first, rest = good + 1, sizes[good:]
    replies += draw(st.lists(st.one_of(reply_frames(first, rest), reply_frames(first, rest),
                                       st.binary(max_size=60)), max_size=6))
    return client, replies


@fuzz_settings(300)
@given(session=client_sessions(), cuts=cut_sizes)
def test_client_raises_only_protocol_errors(session: tuple[wire.ClientProtocol, list[bytes]],
                                            cuts: list[int]) -> None:
    client, replies = session
    buf = bytearray()
    skip = 0  # payload bytes of the last accepted reply still to come
    for piece in chunked(b"".join(replies), cuts):
        buf += piece
        while True:
            if skip:
                take = min(skip, len(buf))
                del buf[:take]
                skip -= take
                if skip:
                    break
            if len(buf) < HEADER_SIZE:
                break
            before = client.outstanding
            try:
                header = client.on_reply_header(bytes(buf[:HEADER_SIZE]))
            except (ProtocolError, errors.HixlError):
                assert client.outstanding == before  # nothing consumed: the caller hangs up
                return
            del buf[:HEADER_SIZE]
            count = wire.reply_count(header)
            assert 1 <= count <= before and client.outstanding == before - count
            skip = wire.payload_length(header)


@fuzz_settings(100)
@given(nonce=st.binary(max_size=40), proof=st.binary(max_size=40))
def test_client_auth_inputs_raise_only_typed_errors(nonce: bytes, proof: bytes) -> None:
    client = wire.ClientProtocol()
    client.hello(b"me")
    with pytest.raises(ProtocolError):
        client.check_server_proof(TOKEN, proof)  # no AUTH in flight
    if len(nonce) != auth.NONCE_SIZE:
        with pytest.raises(ProtocolError, match="challenge of the wrong size"):
            client.auth(TOKEN, nonce)
        return
    client.auth(TOKEN, nonce)
    with pytest.raises(errors.AuthenticationFailed):
        client.check_server_proof(TOKEN, proof)


@fuzz_settings(100)
@given(data=st.binary(max_size=200))
def test_decode_header_raises_only_protocol_error(data: bytes) -> None:
    try:
        header = wire.decode_header(data)
    except ProtocolError as exc:
        assert exc.reason == Reason.BAD_FRAME
    else:
        assert len(data) == HEADER_SIZE and header.opcode in set(Op)


# ---------------------------------------------------------------- round trips

@fuzz_settings(200)
@given(opcode=st.sampled_from(list(Op)), rid=u64, seg=u64, epoch=u32, addr=u64, length=u64,
       status=u32, reason=u16, flags=u16)
def test_header_round_trips_every_opcode(opcode: Op, rid: int, seg: int, epoch: int, addr: int,
                                         length: int, status: int, reason: int,
                                         flags: int) -> None:
    header = Header(opcode, rid, seg, epoch, addr, length, status, reason, flags)
    assert wire.decode_header(header.pack()) == header


@fuzz_settings(200)
@given(rid=u64, seg=u64, epoch=u32, addr=u64, length=u64, count=st.integers(1, U64),
       identity=st.binary(max_size=MAX_HELLO), text=st.text(max_size=5000),
       reason=st.sampled_from(list(Reason)[1:]), nonce=st.binary(min_size=16, max_size=16),
       proof=st.binary(min_size=32, max_size=32), caller=st.binary(max_size=64),
       message=st.integers(0, wire.MAX_CALL - 64))
def test_encoders_round_trip(rid: int, seg: int, epoch: int, addr: int, length: int,
                             count: int, identity: bytes, text: str, reason: Reason,
                             nonce: bytes, proof: bytes, caller: bytes, message: int) -> None:
    def decoded(frame: bytes, opcode: Op) -> Header:
        header = wire.decode_header(frame[:HEADER_SIZE])
        assert header.opcode == opcode
        return header

    hello = wire.hello(rid, identity)
    assert decoded(hello, Op.HELLO).length == len(identity) and hello[HEADER_SIZE:] == identity
    auth_frame = wire.auth_frame(rid, nonce, proof)
    assert decoded(auth_frame, Op.AUTH).length == wire.AUTH_PAYLOAD
    assert auth_frame[HEADER_SIZE:] == nonce + proof
    for encode, opcode in ((wire.write_header, Op.WRITE), (wire.read_request, Op.READ)):
        header = decoded(encode(rid, seg, epoch, addr, length), opcode)
        assert (header.request_id, header.segment_id, header.epoch, header.addr,
                header.length) == (rid, seg, epoch, addr, length)
    assert decoded(wire.ok_reply(rid, length), Op.REPLY).length == length
    run = decoded(wire.run_reply(rid, count, length), Op.REPLY)
    assert (run.request_id, wire.reply_count(run), run.length) == (rid, count, length)
    error = wire.error_reply(rid, reason, text)
    header = assert_frame(error, rid)
    assert header.reason == reason and header.flags == wire.FLAG_ERROR_TEXT
    assert error[HEADER_SIZE:] == text.encode()[:wire.MAX_ERROR_TEXT].decode("utf-8", "ignore").encode()  # cut at a character
    call = wire.call_frame(rid, seg, caller, message)
    header = decoded(call, Op.CALL)
    assert (header.segment_id, header.addr, header.length) == (seg, len(caller),
                                                               len(caller) + message)
    assert call[HEADER_SIZE:] == caller
    assert decoded(wire.call_reply(rid, message), Op.REPLY).length == message
    ping = wire.ClientProtocol()
    assert decoded(ping.ping(), Op.PING).request_id == 1


@fuzz_settings(100)
@given(ops=st.lists(st.tuples(u64, u32, u64, u64), max_size=20),
       opcode=st.sampled_from([Op.WRITE, Op.READ]))
def test_bulk_requests_equal_one_by_one(ops: list[tuple[int, int, int, int]],
                                        opcode: Op) -> None:
    bulk, single = wire.ClientProtocol(), wire.ClientProtocol()
    encode = single.write if opcode == Op.WRITE else single.read
    assert bulk.requests(opcode, ops) == [encode(*op) for op in ops]
    assert bulk.outstanding == single.outstanding == len(ops)


# ---------------------------------------------------------------- both sides together

@st.composite
def requests(draw: st.DrawFn) -> tuple[Op, int, int, int, int, bytes]:
    """A WRITE or READ the client's own checks allow but the agent may refuse: unknown
    segment, stale epoch, wrong permission, out of range."""
    op = draw(st.sampled_from([Op.WRITE, Op.READ]))
    lay = draw(st.sampled_from(LAYOUTS))
    segment_id = draw(st.one_of(st.just(lay.segment_id), st.just(77)))
    epoch = draw(st.one_of(st.just(EPOCH), st.just(EPOCH + 1)))
    length = draw(st.integers(1, 64))
    addr = draw(st.integers(max(0, lay.base - 8), min(U64, lay.base + lay.length + 8)))
    return op, segment_id, epoch, addr, length, random.Random(draw(u32)).randbytes(length)


def expected_error(segment_id: int, epoch: int, op: Op, addr: int,
                   length: int) -> type[errors.HixlError] | None:
    lay = BY_ID.get(segment_id)
    if lay is None:
        return errors.ParamInvalid
    if epoch != EPOCH:
        return errors.StaleEpoch
    if not lay.perms & (Perm.WRITE if op == Op.WRITE else Perm.READ):
        return errors.PermissionDenied
    if addr < lay.base or addr + length > lay.base + lay.length:
        return errors.OutOfRange
    return None


@fuzz_settings(200)
@given(ops=st.lists(requests(), min_size=1, max_size=12), runs=st.booleans())
def test_client_and_server_agree_on_every_answer(
        ops: list[tuple[Op, int, int, int, int, bytes]], runs: bool) -> None:
    """Pipelined requests, answered as the data server answers (run replies when asked):
    the client accepts every reply, refusals raise the type their reason names, accepted
    WRITEs land where they should and READs return the segment's bytes."""
    memory = Memory()
    client = wire.ClientProtocol()
    proto = ServerProtocol(memory.resolve, AGENT_EPOCH)
    action = proto.on_header(client.hello(b"me", runs=runs)[:HEADER_SIZE])
    assert isinstance(action, ReadHello)
    client.on_reply_header(proto.on_hello(action.request_id, b"me").reply)
    stream: list[bytes] = []
    run: list[tuple[int, int, bytes]] = []  # (request id, opcode, READ data) of the open run

    def close_run() -> None:
        if not run:
            return
        if runs:
            data = b"".join(chunk for _, _, chunk in run)
            stream.append(wire.run_reply(run[0][0], len(run), len(data)) + data)
        else:  # one plain reply per request
            stream.extend(wire.ok_reply(rid, len(chunk)) + chunk for rid, _, chunk in run)
        run.clear()

    for op, segment_id, epoch, addr, length, payload in ops:
        frame = (client.write if op == Op.WRITE else client.read)(segment_id, epoch, addr,
                                                                 length)
        rid = wire.decode_header(frame).request_id
        action = proto.on_header(frame)
        if type(action) is ReceiveInto:
            action.target[:] = payload
            lay = BY_ID[segment_id]
            memory.expected[lay.offset + addr - lay.base:
                            lay.offset + addr - lay.base + length] = payload
            accepted = (rid, Op.WRITE, b"")
        elif type(action) is Send and action.payload is not None:
            lay = BY_ID[segment_id]
            at = lay.offset + addr - lay.base
            assert bytes(action.payload) == memory.expected[at:at + length]
            accepted = (rid, Op.READ, bytes(action.payload))
        else:
            accepted = None
        if accepted and run and (run[-1][1] != accepted[1] or run[-1][0] + 1 != rid):
            close_run()
        if accepted:
            run.append(accepted)
            continue
        close_run()
        assert type(action) in (Send, Discard)
        stream.append(action.reply)
    close_run()
    replies = b"".join(stream)
    answered = []
    while replies:
        header = client.on_reply_header(replies[:HEADER_SIZE])  # never a ProtocolError
        size = wire.payload_length(header)
        body, replies = replies[HEADER_SIZE:HEADER_SIZE + size], replies[HEADER_SIZE + size:]
        if header.flags & wire.FLAG_ERROR_TEXT:
            answered.append(type(wire.reply_error(header, body)))
        else:
            answered.extend([None] * wire.reply_count(header))
    assert client.outstanding == 0
    assert answered == [expected_error(s, e, op, a, n) for op, s, e, a, n, _ in ops]
    memory.assert_intact()


def test_the_atheris_harness_runs_where_atheris_installs() -> None:
    """scripts/fuzz_wire.py (coverage-guided, on demand) works: a short run finds nothing.
    atheris is in the `test` extra, so CI always runs this; elsewhere it may be missing."""
    if os.environ.get("CI") != "true":
        pytest.importorskip("atheris")
    script = Path(__file__).parent.parent / "scripts" / "fuzz_wire.py"
    done = subprocess.run([sys.executable, str(script), "-runs=3000", "-seed=1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Done 3000 runs" in done.stderr
