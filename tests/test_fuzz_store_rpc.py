"""hixl-master's store call endpoint (`--fast-port`) under hostile input.

Sans-IO: hypothesis byte streams, cut into random chunks, go through
`wire.CallServerProtocol` driven as server/master/store_rpc_server.py drives it (read the
handshake payload, read or skip a CALL's payload, send, close): header fields with any
value, truncated and oversized payloads, wrong opcodes, CALL before the handshake, bad
AUTH, unknown method numbers, payloads that are no protobuf, request ids that are not
UTF-8 or too long, huge lengths. It never raises, never dispatches a call before the
handshake (with and without a cluster token), every reply is a well-formed frame, and a
dispatched payload splits into a known method, a printable request id and a message
whose parse fails with DecodeError at worst.

End to end: a real hixl-master (with and without a cluster token) takes hypothesis
frame streams on fresh sockets, and valid-handshake sessions of CALL frames with random
method numbers and bodies: garbage, mangled messages, and well-formed requests with
hostile field values (huge sizes, "negative" ones, empty / unicode / oversized keys,
huge batches). After each: the connection ended (deadline: no hang), the replies are
well-formed (one per CALL, in order, when the stream stays in step), the master is alive
and logged no traceback, a legitimate MasterClient still gets a put/get round trip over
the endpoint (its fast_calls counter grows), and a key put before the fuzzing is still
there with its size.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from fuzzing import fuzz_settings
from google.protobuf.message import DecodeError
from hypothesis import event, given
from hypothesis import strategies as st
from test_fuzz_data_server import assert_replies_well_formed, exchange
from test_fuzz_wire import assert_frame, chunked, cut_sizes

from hixl import auth, errors, wire
from hixl.client.store_client import MasterClient
from hixl.store_codes import ErrorCode
from hixl.store_rpc import MESSAGES, METHODS, CallConnection
from hixl.store_types import MasterRpcError, StoreSegment
from hixl.tools.daemons import MasterProcess
from hixl.v1 import store_pb2
from hixl.wire import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_CALL,
    MAX_CALL_REQUEST_ID,
    VERSION,
    Op,
    Reason,
)

U64 = (1 << 64) - 1
TOKEN = b"fuzz-store-rpc-token"
DEADLINE_S = 20.0  # a connection must end within this: proves "no hang", never timed
SENTINEL_KEY = f"sentinel-{uuid.uuid4().hex}"
SENTINEL_SIZE = 12345
#: the legitimate client's segment: metadata only (the master never touches it), large
#: enough that what the fuzzer allocates never crowds out a legitimate put
SEGMENT_LENGTH = 1 << 40
REQUEST_TYPES = {name: request for name, (request, _) in MESSAGES.items()}


# ---------------------------------------------------------------- request messages

_OVERSIZED_KEYS = ["k" * 4096, "k" * 4097, "\u00e9" * 2048, "\u00e9" * 2049,
                   "\U0001f600" * 1025, "x" * (256 << 10)]
KEYS = st.one_of(st.just(""), st.text(max_size=12), st.sampled_from(_OVERSIZED_KEYS)).filter(
    lambda key: key != SENTINEL_KEY)
#: u64 fields: edges, "negative" values (what a signed encoder sends), anything
SIZES = st.one_of(st.sampled_from([0, 1, 2, 4095, 4096, 1 << 20, SEGMENT_LENGTH,
                                   SEGMENT_LENGTH + 1, 1 << 63, U64, -1 & U64,
                                   -(1 << 63) & U64]),
                  st.integers(0, U64))
SMALL_SIZES = st.integers(1, 1 << 20)
IDS = st.one_of(st.just(""), st.text(max_size=24), st.just("x" * 5000))
BATCH = st.sampled_from([0, 0, 0, 0, 0, 20, 2000])  # extra keys on top of the drawn ones


def _batch_keys(count: int, seed: int) -> list[str]:
    return [f"batch-{seed}-{i}" for i in range(count)]


@st.composite
def hostile_requests(draw: st.DrawFn, method: str) -> bytes:
    """A well-formed request message of `method` whose fields are hostile."""
    keys = draw(st.lists(KEYS, max_size=5))
    extra = _batch_keys(draw(BATCH), draw(st.integers(0, 1 << 30)))
    if method == "PutStart":
        config = store_pb2.ReplicaConfig(
            replica_num=draw(st.one_of(st.integers(0, 3), st.integers(0, (1 << 32) - 1))),
            with_hard_pin=draw(st.booleans()),
            soft_pin_action=draw(st.integers(-(1 << 31), (1 << 31) - 1)
                                 if draw(st.integers(0, 3)) == 0 else st.integers(0, 2)),
            soft_pin_ttl_ms=draw(SIZES),
            preferred_segments=draw(st.lists(IDS, max_size=3)),
            prefer_alloc_in_same_node=draw(st.booleans()))
        items = [store_pb2.PutStartItem(key=key, value_length=draw(SIZES)) for key in keys]
        items += [store_pb2.PutStartItem(key=key, value_length=draw(SMALL_SIZES))
                  for key in extra]
        message = store_pb2.PutStartRequest(
            client_id=draw(IDS), node_id=draw(IDS), upsert=draw(st.booleans()), items=items,
            **({"config": config} if draw(st.booleans()) else {}))
    elif method in ("PutEnd", "PutRevoke"):
        message = store_pb2.PutEndRequest(
            client_id=draw(IDS), puts=[store_pb2.PutRef(key=key, put_id=draw(SIZES))
                                       for key in keys + extra])
    elif method == "Remove":
        message = store_pb2.RemoveRequest(keys=keys + extra, force=draw(st.booleans()))
    else:
        message = store_pb2.KeysRequest(keys=keys + extra)
    return message.SerializeToString()


METHOD_NAMES = sorted(MESSAGES)
BODY_KIND = st.sampled_from(["hostile", "hostile", "hostile", "empty", "garbage", "mangled",
                             "other", "overlong-varint", "bad-utf8"])


@st.composite
def bodies(draw: st.DrawFn, method: str | None) -> bytes:
    """A CALL's message: a hostile request, garbage, a request cut or flipped, another
    method's request, a varint longer than 10 bytes, a key that is not UTF-8."""
    kind = draw(BODY_KIND)
    name = method if method is not None else draw(st.sampled_from(METHOD_NAMES))
    if kind == "hostile":
        return draw(hostile_requests(name))
    if kind == "empty":
        return b""
    if kind == "garbage":
        return draw(st.binary(max_size=200))
    if kind == "other":
        return draw(hostile_requests(draw(st.sampled_from(METHOD_NAMES))))
    if kind == "overlong-varint":  # field 2 (a size, a put id, force) as an 11-byte varint
        return b"\x10" + b"\xff" * 10 + b"\x01"
    if kind == "bad-utf8":  # field 1 (a key or client id) as a string that is not UTF-8
        raw = draw(st.binary(min_size=1, max_size=20)) + b"\xff\xfe"
        return b"\x0a" + bytes([len(raw)]) + raw
    good = bytearray(draw(hostile_requests(name)))
    if good:
        rng = random.Random(draw(st.integers(0, 1 << 32)))
        for _ in range(1 + rng.randrange(4)):
            good[rng.randrange(len(good))] = rng.randrange(256)
        del good[rng.randrange(len(good) + 1):]
    return bytes(good)


CALLER_IDS = st.one_of(st.just(b""), st.from_regex(rb"\A[0-9a-f]{16}\Z"),
                       st.binary(max_size=MAX_CALL_REQUEST_ID),
                       st.text(max_size=20).map(lambda text: text.encode()),
                       st.binary(min_size=MAX_CALL_REQUEST_ID + 1, max_size=100))
KNOWN_METHOD = st.sampled_from(sorted(METHODS))
METHOD_NUMBER = st.one_of(KNOWN_METHOD, KNOWN_METHOD, KNOWN_METHOD,
                          st.sampled_from([0, 8, 15, U64]), st.integers(0, U64))
ONE_IN_FIVE = st.integers(0, 4)
u16 = st.integers(0, 0xFFFF)
u32 = st.integers(0, 0xFFFF_FFFF)
u64 = st.integers(0, U64)
FIELD_LENGTHS = st.sampled_from([0, 1, 47, 48, MAX_CALL, MAX_CALL + 1, 1 << 32, 1 << 63, U64])


@dataclass(frozen=True)
class Call:
    """One CALL frame as drawn: `in_step` when its header tells the payload's true size."""

    frame: bytes
    method: int
    in_step: bool


@st.composite
def calls(draw: st.DrawFn, request_id: int = 0, hostile_header: bool = True) -> Call:
    """A CALL with a random method number and body; with `hostile_header`, its flags,
    status, reason, epoch, request-id length and payload length may be anything too."""
    method = draw(METHOD_NUMBER)
    body = draw(bodies(METHODS.get(method)))
    caller = draw(CALLER_IDS)
    rid = request_id or draw(u64)
    addr, length = len(caller), len(caller) + len(body)
    flags = status = reason = epoch = 0
    in_step = True
    if hostile_header and draw(ONE_IN_FIVE) == 0:
        flags, status, reason, epoch = draw(u16), draw(u32), draw(u16), draw(u32)
        if draw(st.booleans()):
            addr, in_step = draw(st.one_of(st.integers(0, 2 * MAX_CALL_REQUEST_ID), u64)), False
        if draw(st.booleans()):
            length, in_step = draw(st.one_of(FIELD_LENGTHS, st.integers(0, 4096))), False
    header = HEADER.pack(MAGIC, VERSION, Op.CALL, flags, reason, status, epoch, rid, method,
                         addr, length)
    return Call(header + caller + body, method, in_step and len(caller) <= MAX_CALL_REQUEST_ID)


POISON = st.sampled_from(["magic", "version", "opcode", "hello", "auth", "write", "read",
                          "reply", "ping", "garbage", "truncated", "every"])


@st.composite
def other_frames(draw: st.DrawFn) -> bytes:
    """A frame that is no CALL, or one that breaks the stream: odd magic/version/opcode,
    HELLO/AUTH again, WRITE/READ/REPLY (not served here), garbage, a cut CALL."""
    kind = draw(POISON)
    rng = random.Random(draw(u32))
    magic, version = MAGIC, VERSION
    opcode = {"hello": Op.HELLO, "auth": Op.AUTH, "write": Op.WRITE, "read": Op.READ,
              "reply": Op.REPLY, "ping": Op.PING}.get(kind, Op.CALL)
    length = draw(st.one_of(st.integers(0, 200), FIELD_LENGTHS))
    if kind == "auth" and draw(st.booleans()):
        length = wire.AUTH_PAYLOAD
    if kind == "magic":
        magic = draw(st.sampled_from([0, 0x5848, rng.getrandbits(16)]))
    elif kind == "version":
        version = draw(st.sampled_from([0, 2, 255]))
    elif kind == "opcode":
        opcode = draw(st.sampled_from([0, 8, 255, rng.randrange(8, 256)]))
    elif kind == "garbage":
        return draw(st.binary(min_size=1, max_size=120))
    elif kind == "truncated":
        whole = draw(calls()).frame
        return whole[:draw(st.integers(0, max(0, len(whole) - 1)))]
    elif kind == "every":
        magic, version, opcode = draw(u16), draw(st.integers(0, 255)), draw(
            st.integers(0, 255))
    header = HEADER.pack(magic, version, opcode, draw(u16), draw(u16), draw(u32), draw(u32),
                         draw(u64), draw(u64), draw(u64), length)
    carried = length if opcode in (Op.HELLO, Op.AUTH, Op.WRITE, Op.REPLY, Op.CALL) else 0
    return header + rng.randbytes(min(carried, 4096))


STARTS = st.sampled_from(["hello", "hello", "hello", "none", "garbage", "half-hello",
                          "hello-auth"])


@st.composite
def streams(draw: st.DrawFn) -> bytes:
    """A connection's bytes from its first: maybe a HELLO (and an AUTH with a random
    proof), then CALLs mixed with other frames and garbage."""
    start = draw(STARTS)
    parts = []
    if start.startswith("hello"):
        flags = draw(st.sampled_from([0, wire.FLAG_RUN, 0xFFFF]))
        identity = draw(st.binary(max_size=24))
        parts.append(HEADER.pack(MAGIC, VERSION, Op.HELLO, flags, 0, 0, 0, 1, 0, 0,
                                 len(identity)) + identity)
        if start == "hello-auth":  # no proof of the token: random bytes
            parts.append(wire.auth_frame(2, draw(st.binary(min_size=auth.NONCE_SIZE,
                                                           max_size=auth.NONCE_SIZE)),
                                         draw(st.binary(min_size=auth.PROOF_SIZE,
                                                        max_size=auth.PROOF_SIZE))))
    elif start == "half-hello":  # announces a name longer than what follows
        parts.append(HEADER.pack(MAGIC, VERSION, Op.HELLO, 0, 0, 0, 0, 1, 0, 0, 200) + b"half")
    elif start == "garbage":
        parts.append(draw(st.binary(min_size=1, max_size=96)))
    body = [call.frame for call in draw(st.lists(calls(), max_size=6))]
    for _ in range(draw(st.integers(0, 2))):
        body.insert(draw(st.integers(0, len(body))), draw(other_frames()))
    return b"".join(parts + body)


# ---------------------------------------------------------------- sans-IO

@dataclass
class CallDriver:
    """Executes CallServerProtocol's actions as the call endpoint does, on any chunks,
    checking each against the header it answers (never trusting the action)."""

    proto: wire.CallServerProtocol
    buf: bytearray = field(default_factory=bytearray)
    pending: list = field(default_factory=list)  # [kind, action, state] mid-payload
    closed: bool = False
    replies: list[bytes] = field(default_factory=list)
    dispatched: list[tuple[str, str, bytes]] = field(default_factory=list)

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
            action = self.proto.on_header(bytes(self.buf[:HEADER_SIZE]))
            del self.buf[:HEADER_SIZE]
            self._act(fields, action)

    def _act(self, fields: tuple[int, ...], action: wire.CallAction) -> None:
        op, rid, method, addr, length = fields[2], fields[7], fields[8], fields[9], fields[10]
        served = self.proto.authenticated
        if type(action) is wire.ReadCall:
            assert served, "a CALL was dispatched before the handshake"
            assert (op, action.request_id, action.method) == (Op.CALL, rid, method)
            assert method in METHODS and action.count == length <= MAX_CALL
            assert action.caller_id_length == addr <= min(MAX_CALL_REQUEST_ID, length)
            self.pending = ["call", action, bytearray()]
        elif type(action) is wire.Discard:
            assert served and op == Op.CALL and method not in METHODS
            assert action.count == length <= MAX_CALL
            assert assert_frame(action.reply, rid).reason == Reason.UNKNOWN_METHOD
            self.pending = ["discard", action, action.count]
        elif type(action) is wire.Send:
            assert served and op == Op.PING and action.payload is None
            assert action.reply == wire.ok_reply(rid)
            self.replies.append(action.reply)
        elif type(action) is wire.ReadHello:
            assert op in (Op.HELLO, Op.AUTH) and action.count == length <= wire.MAX_HELLO
            self.pending = ["hello", action, bytearray()]
        else:
            assert type(action) is wire.Close, action
            if action.reply is not None:
                assert assert_frame(action.reply).flags & wire.FLAG_ERROR_TEXT
                self.replies.append(action.reply)
            self.closed = True

    def _payload(self) -> bool:
        """Move payload bytes for the pending action; False when more are needed."""
        kind, action, state = self.pending
        if kind == "discard":
            take = min(state, len(self.buf))
            del self.buf[:take]
            self.pending[2] = state = state - take
            if state:
                return False
            self.replies.append(action.reply)
        else:
            take = bytes(self.buf[:action.count - len(state)])
            del self.buf[:len(take)]
            state += take
            if len(state) < action.count:
                return False
            if kind == "hello":
                self._on_hello(action, bytes(state))
            else:
                self._on_call(action, bytes(state))
        self.pending = []
        return True

    def _on_hello(self, action: wire.ReadHello, payload: bytes) -> None:
        answer = self.proto.on_hello(action.request_id, payload)
        if type(answer) is wire.Close:
            assert answer.reply is not None and not self.proto.authenticated
            assert assert_frame(answer.reply, action.request_id).reason in (
                Reason.NOT_AUTHENTICATED, Reason.BAD_FRAME)
            self.closed = True
            return
        assert type(answer) is wire.Send
        header = assert_frame(answer.reply, action.request_id)
        assert header.status == errors.SUCCESS and header.length == len(
            answer.reply) - HEADER_SIZE
        self.replies.append(answer.reply)

    def _on_call(self, action: wire.ReadCall, payload: bytes) -> None:
        method, caller_id, message = self.proto.split(action, payload)
        assert method == METHODS[action.method]
        assert caller_id == "" or (caller_id.isascii() and caller_id.isprintable()
                                   and len(caller_id) == action.caller_id_length)
        assert bytes(message) == payload[action.caller_id_length:]
        # what the endpoint does next: a parse that fails with DecodeError at worst
        with contextlib.suppress(DecodeError):
            REQUEST_TYPES[method].FromString(message)
        self.dispatched.append((method, caller_id, bytes(message)))
        self.replies.append(wire.call_reply(action.request_id, 0))


def handshaken(token: bytes | None) -> wire.CallServerProtocol:
    """A server protocol past a valid handshake (AUTH with the right proof if `token`)."""
    server, client = wire.CallServerProtocol(METHODS, token), wire.ClientProtocol()
    hello = client.hello(b"fuzzer")
    action = server.on_header(hello[:HEADER_SIZE])
    assert isinstance(action, wire.ReadHello)
    reply = server.on_hello(action.request_id, hello[HEADER_SIZE:])
    assert isinstance(reply, wire.Send)
    header = client.on_reply_header(reply.reply[:HEADER_SIZE])
    if client.challenged:
        frame = client.auth(token, reply.reply[HEADER_SIZE:HEADER_SIZE + header.length])
        action = server.on_header(frame[:HEADER_SIZE])
        assert isinstance(action, wire.ReadHello)
        assert isinstance(server.on_hello(action.request_id, frame[HEADER_SIZE:]), wire.Send)
    assert server.authenticated
    return server


@fuzz_settings(300)
@given(data=streams(), cuts=cut_sizes)
def test_the_codec_never_raises_and_answers_in_frames(data: bytes, cuts: list[int]) -> None:
    driver = CallDriver(wire.CallServerProtocol(METHODS))
    for piece in chunked(data, cuts):
        driver.feed(piece)
    if not driver.proto.authenticated:
        assert not driver.dispatched


@fuzz_settings(150)
@given(data=streams(), cuts=cut_sizes)
def test_with_a_token_nothing_is_dispatched_without_a_valid_auth(data: bytes,
                                                                  cuts: list[int]) -> None:
    """Random AUTH frames (no valid proof) never open the connection."""
    driver = CallDriver(wire.CallServerProtocol(METHODS, TOKEN))
    for piece in chunked(data, cuts):
        driver.feed(piece)
    assert not driver.dispatched and not driver.proto.authenticated


@fuzz_settings(150)
@given(frames=st.lists(st.one_of(calls(), calls(), other_frames().map(
    lambda frame: Call(frame, 0, False))), max_size=8), cuts=cut_sizes,
       token=st.sampled_from([None, TOKEN]))
def test_after_a_valid_handshake_every_in_step_call_is_answered(
        frames: list[Call], cuts: list[int], token: bytes | None) -> None:
    """Once authenticated (with or without a token), hostile CALLs are each answered in
    order, a known method dispatched with its exact message, until a frame that breaks
    the stream closes the connection."""
    driver = CallDriver(handshaken(token))
    for piece in chunked(b"".join(call.frame for call in frames), cuts):
        driver.feed(piece)
    in_step = 0
    for call in frames:
        if not call.in_step:
            break
        in_step += 1
    answered = driver.replies[:in_step]
    assert len(answered) == in_step or driver.closed
    for call, reply in zip(frames, answered, strict=False):
        sent = wire.decode_header(call.frame[:HEADER_SIZE])
        header = assert_frame(reply, sent.request_id)
        assert (header.reason == Reason.UNKNOWN_METHOD) == (call.method not in METHODS)


def test_short_and_long_headers_close_instead_of_raising() -> None:
    for authenticated in (False, True):
        proto = handshaken(None) if authenticated else wire.CallServerProtocol(METHODS)
        for size in (0, 1, 47, 49, 96):
            action = proto.on_header(b"\0" * size)
            assert isinstance(action, wire.Close) and "expected 48" in action.reason


@pytest.mark.parametrize("caller", [b"\xff\xfe", b"a\x00b", b"caf\xc3\xa9", b"tab\there",
                                    b"x" * MAX_CALL_REQUEST_ID])
def test_request_ids_that_are_not_printable_ascii_are_dropped(caller: bytes) -> None:
    proto = handshaken(None)
    body = store_pb2.KeysRequest(keys=["k"]).SerializeToString()
    frame = wire.call_frame(5, 5, caller, len(body)) + body
    action = proto.on_header(frame[:HEADER_SIZE])
    assert isinstance(action, wire.ReadCall)
    method, caller_id, message = proto.split(action, frame[HEADER_SIZE:])
    expected = caller.decode() if caller.isascii() and caller.decode().isprintable() else ""
    assert (method, caller_id, bytes(message)) == ("ExistKey", expected, body)


@fuzz_settings(50)
@given(text=st.text(alphabet=st.characters(codec="utf-8"), min_size=1000, max_size=5000))
def test_error_text_is_cut_at_a_character(text: str) -> None:
    """Regression: error_reply cut its text at MAX_ERROR_TEXT bytes even inside a
    multi-byte character, so a long refusal was not valid UTF-8. Now it is the longest
    whole-character prefix that fits."""
    reply = wire.error_reply(3, Reason.BAD_FRAME, text)
    cut = reply[HEADER_SIZE:].decode("utf-8")  # strict
    assert assert_frame(reply, 3).length == len(reply) - HEADER_SIZE <= wire.MAX_ERROR_TEXT
    assert text.startswith(cut)
    assert len(cut.encode()) > wire.MAX_ERROR_TEXT - 4 or cut == text


def test_a_refusal_cut_inside_a_character_stays_utf8() -> None:
    for char in ("\u00e9", "\u20ac", "\U0001f600"):  # 2, 3 and 4 bytes
        for pad in range(4):
            text = "x" * pad + char * wire.MAX_ERROR_TEXT
            payload = wire.error_reply(1, Reason.NOT_ALLOWED, text)[HEADER_SIZE:]
            assert text.startswith(payload.decode("utf-8"))


# ---------------------------------------------------------------- a real hixl-master

class FuzzMaster:
    """A hixl-master process, a legitimate client with a segment mounted, a key put
    before any fuzzing, and the offset of the master's log checked so far."""

    def __init__(self, token: bytes | None) -> None:
        self.token = token
        self.workdir = tempfile.mkdtemp(prefix="hxs-")
        extra = ["--no-persist", "--client_ttl", "86400"]
        if token is not None:
            token_file = os.path.join(self.workdir, "token")
            with open(token_file, "wb") as f:
                f.write(token)
            os.chmod(token_file, 0o600)
            extra += ["--cluster-token-file", token_file]
        self.process = MasterProcess(extra=extra)
        self.client = MasterClient(self.process.target, timeout=DEADLINE_S,
                                   cluster_token=token)
        self.log_seen = 0
        self.puts = 0
        try:
            mounted = self.client.mount_segment(StoreSegment(
                "fuzz-engine", 1, 1, 1 << 20, SEGMENT_LENGTH, "fuzz-node"))
            assert mounted.code == ErrorCode.OK, mounted
            self.put(SENTINEL_KEY, SENTINEL_SIZE)
            assert self.client.fast_port is not None
            self.port = self.client.fast_port
        except BaseException:
            self.close()
            raise

    def put(self, key: str, size: int) -> None:
        started = self.client.put_start(key, size)
        assert started.code == ErrorCode.OK, started
        assert self.client.put_end(key, started.put_id) == ErrorCode.OK

    def connect(self) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=DEADLINE_S)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def session(self) -> socket.socket:
        """A connection past a valid handshake (and AUTH with the token)."""
        connection = CallConnection.open("127.0.0.1", self.port, token=self.token,
                                         identity="fuzzer",
                                         deadline=time.monotonic() + DEADLINE_S)
        return connection.sock

    def assert_healthy(self) -> None:
        """Alive, no traceback logged since the last check, and a legitimate client is
        still served over the endpoint: a fresh put and get, and the sentinel intact."""
        assert self.process.proc.poll() is None, f"the master died:\n{self.process.log()}"
        with open(self.process.log_path, encoding="utf-8", errors="replace") as f:
            f.seek(self.log_seen)
            new = f.read()
            self.log_seen = f.tell()
        assert "Traceback" not in new and "internal error" not in new, new
        before = self.client.fast_calls
        self.puts += 1
        key = f"legit-{SENTINEL_KEY}-{self.puts}"
        self.put(key, self.puts)
        assert self.client.get_replicas(key).size == self.puts
        assert self.client.get_size(SENTINEL_KEY) == SENTINEL_SIZE
        assert self.client.get_replicas(SENTINEL_KEY).size == SENTINEL_SIZE
        assert self.client.fast_calls == before + 5  # every one of them over the endpoint

    def close(self) -> None:
        self.client.close()
        self.process.close()
        for name in os.listdir(self.workdir):
            os.unlink(os.path.join(self.workdir, name))
        os.rmdir(self.workdir)


@pytest.fixture(scope="module")
def open_master() -> Iterator[FuzzMaster]:
    master = FuzzMaster(None)
    yield master
    master.close()


@pytest.fixture(scope="module")
def token_master() -> Iterator[FuzzMaster]:
    master = FuzzMaster(TOKEN)
    yield master
    master.close()


def replies_of(data: bytes) -> list[tuple[wire.Header, bytes]]:
    """The REPLY frames in `data` (whole ones), with their payloads."""
    out, at = [], 0
    while len(data) - at >= HEADER_SIZE:
        header = wire.decode_header(data[at:at + HEADER_SIZE])
        end = at + HEADER_SIZE + header.length
        out.append((header, data[at + HEADER_SIZE:end]))
        at = end
    return out


def check_replies(data: bytes, reset: bool) -> list[tuple[wire.Header, bytes]]:
    """Every reply is a whole, well-formed REPLY frame: error text is UTF-8 and names no
    internal error, and a call's reply parses as some reply message."""
    assert_replies_well_formed(data, reset)
    replies = replies_of(data)
    for header, payload in replies:
        if header.flags & wire.FLAG_ERROR_TEXT:
            assert header.length <= wire.MAX_ERROR_TEXT and header.status != errors.SUCCESS
            assert "internal error" not in payload.decode("utf-8")
        else:
            assert header.status == errors.SUCCESS and header.length <= MAX_CALL
    return replies


@fuzz_settings(100)
@given(data=streams(), cuts=cut_sizes, token=st.booleans())
def test_hostile_streams_never_hurt_the_master(open_master: FuzzMaster,
                                               token_master: FuzzMaster, data: bytes,
                                               cuts: list[int], token: bool) -> None:
    master = token_master if token else open_master
    with master.connect() as sock:
        replies, reset = exchange(sock, chunked(data, cuts))
    check_replies(replies, reset)
    if token:  # no valid AUTH in a stream: not one call answered
        assert all(header.flags & (wire.FLAG_ERROR_TEXT | wire.FLAG_CHALLENGE)
                   for header, _ in replies_of(replies)), replies
    master.assert_healthy()


@fuzz_settings(100)
@given(frames=st.lists(calls(), min_size=1, max_size=6),
       poison=st.one_of(st.none(), other_frames()), cuts=cut_sizes, token=st.booleans())
def test_hostile_calls_after_a_valid_handshake(open_master: FuzzMaster,
                                               token_master: FuzzMaster, frames: list[Call],
                                               poison: bytes | None, cuts: list[int],
                                               token: bool) -> None:
    master = token_master if token else open_master
    stream = [call.frame for call in frames] + ([poison] if poison is not None else [])
    with master.session() as sock:
        replies, reset = exchange(sock, chunked(b"".join(stream), cuts))
    answered = check_replies(replies, reset)
    in_step = 0
    for call in frames:
        if not call.in_step:
            break
        in_step += 1
    assert len(answered) >= in_step, "a call in step was not answered"
    for call, (header, payload) in zip(frames[:in_step], answered, strict=False):
        assert header.request_id == wire.decode_header(call.frame[:HEADER_SIZE]).request_id
        if call.method not in METHODS:
            assert header.reason == Reason.UNKNOWN_METHOD
            event("unknown method")
        elif not header.flags & wire.FLAG_ERROR_TEXT:
            MESSAGES[METHODS[call.method]][1].FromString(payload)
            event(f"served {METHODS[call.method]}")
        else:
            assert header.reason == Reason.BAD_FRAME
            assert "does not parse" in payload.decode(), payload
            event("request does not parse")
    master.assert_healthy()


def test_a_reply_over_the_frame_limit_is_refused_not_sent() -> None:
    """Regression: a small request can ask for a reply over wire.MAX_CALL (the same key
    many times, on a segment with a long engine name). The master sent it anyway, and
    the client's codec refused the frame ("bad reply") and dropped the connection; now
    the call is answered with error text, and the connection serves the next call."""
    with MasterProcess(extra=["--no-persist"]) as process, \
            MasterClient(process.target, timeout=DEADLINE_S) as client:
        engine = "e" * 60_000  # each replica in the reply names it
        assert client.mount_segment(StoreSegment(engine, 1, 1, 1 << 20, 1 << 30)).code == 0
        started = client.put_start("k", 10)
        assert client.put_end("k", started.put_id) == ErrorCode.OK
        repeats = MAX_CALL // len(engine) + 1
        before = client.fast_calls
        with pytest.raises(MasterRpcError, match="exceeds the call endpoint's limit") as caught:
            client.batch_get_replicas(["k"] * repeats)
        assert caught.value.status == errors.PARAM_INVALID
        assert client.get_replicas("k").size == 10
        assert client.fast_calls == before + 1  # the same connection, still on the endpoint
        assert "Traceback" not in process.log()
