"""The data-path wire protocol, sans-IO: frame codec and per-connection state machines.

Nothing here touches a socket. The server side (`ServerProtocol`) turns each 48-byte
header into an *action* for the I/O driver — receive the payload straight into segment
memory, discard it, send a reply, or close — after checking everything before any byte
moves: handshake done, known segment, live epoch, permission, bounds. The client side
encodes requests and checks that replies match what was asked, in order (pipelining).

Frame = header, then `length` payload bytes for HELLO, AUTH, WRITE, CALL and non-empty
REPLY frames.

Handshake: HELLO (payload: the client's name) comes first. Without a cluster token the
reply is a plain OK carrying the agent's epoch. With one, the reply is a CHALLENGE (flag
FLAG_CHALLENGE, payload: a fresh server nonce); the client answers with AUTH (payload:
its own nonce, then HMAC proof of the token, see hixl.auth) and the agent replies OK with
the epoch and its own proof, or refuses (NOT_AUTHENTICATED) and closes. No other frame is
served before that.

Runs: a client that sets FLAG_RUN on its HELLO accepts *run replies*: one REPLY with
FLAG_RUN answers `count` (carried in the `addr` field) consecutive accepted requests of one
kind, starting at `request_id` — WRITE acknowledgements (`length` 0), or READs whose data,
`length` bytes in all, follows back to back in request order. A batch of small ops then
costs one reply header per run instead of one per op, and the client can receive a whole
run's READ data with one scatter read straight into its destinations: no byte lands
anywhere before the run's header said every op in it was accepted.

Vectors: an agent whose HELLO (or AUTH) OK reply sets FLAG_VECTOR accepts *vector*
WRITE/READ requests: FLAG_VECTOR set, `addr` = n (1..MAX_VECTOR_RANGES), `length` = the
bytes of all n ranges, and right after the header a table of n (addr u64, length u64)
entries (VECTOR_ENTRY) naming ranges of the one segment; a WRITE's data follows the table,
the ranges' bytes back to back, and a READ's reply carries them so. Many pages that are
not neighbours in the segment (a layer of a paged KV cache) then cost one frame, one
check pass and one scatter/gather system call instead of one frame each. The agent
checks every range before a byte moves; a refused vector fails all its ranges.

Calls: the same framing and handshake carry the KV store's hot calls to hixl-master's
call endpoint (`CallServerProtocol`; hixl.store_rpc): a CALL frame names the method in
`segment_id`, and its payload is the caller's request id (for the logs; `addr` bytes of
ASCII) followed by the serialized request message; the REPLY carries the serialized reply
message, or error text (FLAG_ERROR_TEXT) when the call itself failed. A data server
closes a connection that sends CALL; the call endpoint closes one that sends WRITE/READ.

    magic u16 | version u8 | opcode u8 | flags u16 | reason u16 | status u32 | epoch u32
    request_id u64 | segment_id u64 | addr u64 | length u64          (network byte order)
"""

from __future__ import annotations

import enum
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from hixl import auth, errors
from hixl.types import Perm

HEADER = struct.Struct("!HBBHHIIQQQQ")
HEADER_SIZE = HEADER.size  # 48
MAGIC = 0x4858  # "HX"
VERSION = 1
MAX_PAYLOAD = 64 << 20  # senders split larger ops into frames of at most this size
MAX_HELLO = 4096
MAX_ERROR_TEXT = 4096
MAX_CALL = 64 << 20  # largest CALL payload or call reply (a batch of many keys)
MAX_CALL_REQUEST_ID = 64  # longest request id a CALL may carry (hixl.logs ids: 16)
FLAG_ERROR_TEXT = 1  # a REPLY whose payload is a UTF-8 error message
FLAG_CHALLENGE = 2  # a HELLO reply whose payload is the server nonce: send AUTH next
FLAG_RUN = 4  # HELLO: the client reads run replies; REPLY: answers a run (count in `addr`)
#: HELLO/AUTH OK reply: the agent serves vector requests; WRITE/READ: this is one
FLAG_VECTOR = 8
#: most ranges one vector request names (its ranges are one scatter/gather call's buffers)
MAX_VECTOR_RANGES = 512
VECTOR_ENTRY = struct.Struct("!QQ")  # one range of a vector request's table: addr, length
#: the largest address a vector entry may name (an address plus a length stays in 63 bits)
_VECTOR_MAX_VALUE = (1 << 62) - 1
AUTH_PAYLOAD = auth.NONCE_SIZE + auth.PROOF_SIZE  # client nonce, then client proof


class Op(enum.IntEnum):
    HELLO = 1
    WRITE = 2
    READ = 3
    REPLY = 4
    PING = 5
    AUTH = 6
    CALL = 7  # a store call (hixl-master's call endpoint), method number in segment_id


class Reason(enum.IntEnum):
    """Why a request was refused; the client maps it to an exception type."""

    OK = 0
    BAD_FRAME = 1
    NOT_AUTHENTICATED = 2
    UNKNOWN_SEGMENT = 3
    STALE_EPOCH = 4
    PERMISSION = 5
    OUT_OF_RANGE = 6
    BAD_LENGTH = 7
    INTERNAL = 8
    UNKNOWN_METHOD = 9  # a CALL naming a method the server does not serve
    NOT_ALLOWED = 10  # the segment's allow-list does not name the engine of the connection
    #: a standby hixl-master refused a CALL, unapplied: its error text is the leader's
    #: gRPC address ("host:port"), empty when unknown (hixl.failover: try there / the next)
    NOT_LEADER = 11


_STATUS_FOR_REASON = {
    Reason.OK: errors.SUCCESS,
    Reason.BAD_FRAME: errors.PARAM_INVALID,
    Reason.NOT_AUTHENTICATED: errors.FAILED,
    Reason.UNKNOWN_SEGMENT: errors.PARAM_INVALID,
    Reason.STALE_EPOCH: errors.FAILED,
    Reason.PERMISSION: errors.PARAM_INVALID,
    Reason.OUT_OF_RANGE: errors.PARAM_INVALID,
    Reason.BAD_LENGTH: errors.PARAM_INVALID,
    Reason.INTERNAL: errors.FAILED,
    Reason.UNKNOWN_METHOD: errors.UNSUPPORTED,
    Reason.NOT_ALLOWED: errors.PARAM_INVALID,  # PermissionDenied's status
    Reason.NOT_LEADER: errors.FAILED,
}


class ProtocolError(Exception):
    """A frame that breaks the protocol; the connection cannot continue."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(slots=True)
class Header:
    opcode: int
    request_id: int = 0
    segment_id: int = 0
    epoch: int = 0
    addr: int = 0
    length: int = 0
    status: int = 0
    reason: int = 0
    flags: int = 0

    def pack(self) -> bytes:
        return HEADER.pack(MAGIC, VERSION, self.opcode, self.flags, self.reason, self.status,
                           self.epoch, self.request_id, self.segment_id, self.addr, self.length)


def decode_header(raw: bytes | bytearray | memoryview) -> Header:
    """Parse and sanity-check one header; ProtocolError names what is wrong."""
    if len(raw) != HEADER_SIZE:
        raise ProtocolError(Reason.BAD_FRAME, f"header is {len(raw)} bytes, expected {HEADER_SIZE}")
    return _checked(HEADER.unpack(raw))


def _checked(fields: tuple[int, ...]) -> Header:
    """The Header of unpacked fields, after the magic/version/opcode checks."""
    (magic, version, opcode, flags, reason, status, epoch, request_id, segment_id, addr,
     length) = fields
    if magic != MAGIC:
        raise ProtocolError(Reason.BAD_FRAME, f"bad magic {magic:#06x}: not a hixl data stream")
    if version != VERSION:
        raise ProtocolError(Reason.BAD_FRAME,
                            f"protocol version {version} not supported (this side speaks {VERSION})")
    if opcode not in _OPCODES:
        raise ProtocolError(Reason.BAD_FRAME, f"unknown opcode {opcode}")
    return Header(opcode, request_id, segment_id, epoch, addr, length, status, reason, flags)


_OPCODES = frozenset(int(op) for op in Op)


def payload_length(header: Header) -> int:
    """How many payload bytes follow this header on the stream (a vector request's table
    included)."""
    table = header.addr * VECTOR_ENTRY.size if header.flags & FLAG_VECTOR and \
        header.opcode in (Op.WRITE, Op.READ) else 0
    if header.opcode in (Op.WRITE, Op.HELLO, Op.REPLY, Op.AUTH, Op.CALL):
        return table + header.length
    return table


def reply_count(header: Header) -> int:
    """How many requests a reply answers: a run's count, else one."""
    return header.addr if header.flags & FLAG_RUN else 1


# Hot-path constants: plain ints, since every enum attribute access costs ~0.1 us and
# the per-op code below runs once per frame.
_pack = HEADER.pack
_unpack_from = HEADER.unpack_from
_HELLO, _WRITE, _READ, _REPLY, _PING, _AUTH, _CALL = (
    int(op) for op in (Op.HELLO, Op.WRITE, Op.READ, Op.REPLY, Op.PING, Op.AUTH, Op.CALL))
_PERM_READ, _PERM_WRITE = int(Perm.READ), int(Perm.WRITE)


def hello(request_id: int, identity: bytes = b"") -> bytes:
    return _pack(MAGIC, VERSION, _HELLO, 0, 0, 0, 0, request_id, 0, 0, len(identity)) + identity


def auth_frame(request_id: int, client_nonce: bytes, proof: bytes) -> bytes:
    """AUTH: the client's nonce and its proof of the cluster token (hixl.auth)."""
    payload = client_nonce + proof
    return _pack(MAGIC, VERSION, _AUTH, 0, 0, 0, 0, request_id, 0, 0, len(payload)) + payload


def write_header(request_id: int, segment_id: int, epoch: int, addr: int, length: int) -> bytes:
    return _pack(MAGIC, VERSION, _WRITE, 0, 0, 0, epoch, request_id, segment_id, addr, length)


def read_request(request_id: int, segment_id: int, epoch: int, addr: int, length: int) -> bytes:
    return _pack(MAGIC, VERSION, _READ, 0, 0, 0, epoch, request_id, segment_id, addr, length)


def ok_reply(request_id: int, length: int = 0) -> bytes:
    return _pack(MAGIC, VERSION, _REPLY, 0, 0, 0, 0, request_id, 0, 0, length)


def run_reply(first_id: int, count: int, length: int = 0) -> bytes:
    """One reply accepting `count` consecutive requests from `first_id` (FLAG_RUN clients).

    `length` is the READ data that follows, all the run's windows back to back; 0 for
    WRITE acknowledgements. A run of one is sent as a plain `ok_reply`.
    """
    if count == 1:
        return _pack(MAGIC, VERSION, _REPLY, 0, 0, 0, 0, first_id, 0, 0, length)
    return _pack(MAGIC, VERSION, _REPLY, FLAG_RUN, 0, 0, 0, first_id, 0, count, length)


def call_frame(request_id: int, method: int, caller_id: bytes, message_length: int) -> bytes:
    """Header of a CALL and its request-id prefix; the serialized message follows them."""
    return _pack(MAGIC, VERSION, _CALL, 0, 0, 0, 0, request_id, method, len(caller_id),
                 len(caller_id) + message_length) + caller_id


def call_reply(request_id: int, message_length: int) -> bytes:
    """Header of a CALL's successful reply; the serialized reply message follows it."""
    return _pack(MAGIC, VERSION, _REPLY, 0, 0, 0, 0, request_id, 0, 0, message_length)


def error_reply(request_id: int, reason: Reason, message: str) -> bytes:
    # cut at MAX_ERROR_TEXT bytes, never inside a character: the text stays valid UTF-8
    text = message.encode("utf-8", "replace")[:MAX_ERROR_TEXT]
    text = text.decode("utf-8", "ignore").encode("utf-8")
    return Header(Op.REPLY, request_id, length=len(text), status=_STATUS_FOR_REASON[reason],
                  reason=reason, flags=FLAG_ERROR_TEXT).pack() + text


def split(addr: int, length: int, limit: int = MAX_PAYLOAD) -> list[tuple[int, int]]:
    """Cut one op into (offset, length) frames of at most `limit` bytes."""
    return [(off, min(limit, length - off)) for off in range(0, length, limit)]


# ---------------------------------------------------------------- server side

@dataclass(slots=True)
class ServedSegment:
    """What the server knows of a segment it serves: identity, rights and its memory.

    Never changed once made (a change of rights or memory is a new object), so the
    per-frame checks read the derived `end`, `readable` and `writable` directly.
    `allowed`: the engines (names given in HELLO) that may reach it; None: every engine,
    so a segment without an allow-list costs the per-frame check one `is None`.
    """

    segment_id: int
    epoch: int
    base: int
    length: int
    perms: Perm
    memory: memoryview  # writable view of the whole segment
    allowed: frozenset[str] | None = None
    end: int = field(init=False)
    readable: bool = field(init=False)
    writable: bool = field(init=False)

    def __post_init__(self) -> None:
        self.end = self.base + self.length
        self.readable = bool(int(self.perms) & _PERM_READ)
        self.writable = bool(int(self.perms) & _PERM_WRITE)


class ReceiveInto:
    """Receive exactly len(target) payload bytes into `target`, then acknowledge the WRITE.

    The acknowledgement is `reply`, or a share of a run reply (`request_id`).
    """

    __slots__ = ("target", "request_id")

    def __init__(self, target: memoryview, request_id: int) -> None:
        self.target = target
        self.request_id = request_id

    @property
    def reply(self) -> bytes:
        return ok_reply(self.request_id)


@dataclass(slots=True)
class Discard:
    """Read and drop `count` payload bytes, then send `reply` (a refused write)."""

    count: int
    reply: bytes


class Send:
    """Send `reply`, then `payload` (a slice of segment memory) if any.

    An accepted READ carries no reply bytes: its OK header is built when needed (`reply`),
    or the read joins a run reply (`request_id`).
    """

    __slots__ = ("_reply", "payload", "request_id")

    def __init__(self, reply: bytes | None, payload: memoryview | None = None,
                 request_id: int = 0) -> None:
        self._reply = reply
        self.payload = payload
        self.request_id = request_id

    @property
    def reply(self) -> bytes:
        if self._reply is not None:
            return self._reply
        return ok_reply(self.request_id, len(self.payload) if self.payload is not None else 0)


@dataclass(slots=True)
class ReadTable:
    """Read a vector request's `count`-byte range table, then pass it to `on_table`."""

    count: int
    opcode: int
    request_id: int
    segment_id: int
    epoch: int
    length: int


class ReceiveVector:
    """Receive the next `size` payload bytes into the ranges of segment `memory` at
    `starts` of `lengths` bytes (int64 arrays, in the table's order), then acknowledge the
    vector WRITE (`request_id`, as ReceiveInto). Arrays, not a view per range: a receive
    loop in C fills them without building hundreds of views."""

    __slots__ = ("memory", "starts", "lengths", "size", "request_id")

    def __init__(self, memory: memoryview, starts: np.ndarray, lengths: np.ndarray,
                 size: int, request_id: int) -> None:
        self.memory, self.starts, self.lengths = memory, starts, lengths
        self.size, self.request_id = size, request_id

    @property
    def targets(self) -> list[memoryview]:
        """One view of `memory` per range, in order."""
        memory = self.memory
        return [memory[start:start + n] for start, n in zip(self.starts.tolist(),
                                                            self.lengths.tolist(), strict=True)]


class SendVector:
    """Accept a vector READ: an OK (or a share of a run reply) carrying `size` bytes, the
    `views` (segment memory, one per range) back to back."""

    __slots__ = ("views", "size", "request_id")

    def __init__(self, views: list[memoryview], size: int, request_id: int) -> None:
        self.views, self.size, self.request_id = views, size, request_id


@dataclass(slots=True)
class ReadHello:
    """Read `count` bytes of handshake payload (HELLO or AUTH), then pass them to `on_hello`."""

    count: int
    request_id: int


@dataclass(slots=True)
class Close:
    """Send `reply` (if any) and close: the stream cannot be trusted any more."""

    reply: bytes | None
    reason: str


Action = (ReceiveInto | Discard | Send | ReadHello | Close | ReadTable | ReceiveVector
          | SendVector)
Resolver = Callable[[int], ServedSegment | None]


class _ServerHandshake:
    """HELLO, then CHALLENGE / AUTH when a token is set, server side: shared by the data
    path (`ServerProtocol`) and the store's call endpoint (`CallServerProtocol`).

    With a cluster `token`, the connection is `authenticated` only after a valid AUTH;
    without one, right after HELLO (authentication off).
    """

    #: who refuses, in the messages ("this agent requires a cluster token")
    server_name = "agent"
    #: what the OK reply that completes the handshake advertises (FLAG_VECTOR)
    reply_flags = 0

    def __init__(self, epoch: int, token: bytes | None = None) -> None:
        self.epoch = epoch
        self._token = token
        self.authenticated = False
        self.peer_identity = ""
        self._identity = b""
        self._server_nonce: bytes | None = None  # set by HELLO when a token is required
        #: the connection was refused for want of authentication (wrong, missing token)
        self.auth_refused = False
        #: the client accepts run replies (it set FLAG_RUN on its HELLO)
        self.runs = False

    def _handshake_frame(self, header: Header) -> Action | None:
        """The action for HELLO, AUTH and any frame before authentication; None for a
        frame of an authenticated connection, which the protocol itself serves."""
        op = header.opcode
        rid = header.request_id
        if op == _HELLO:
            if header.length > MAX_HELLO:
                msg = f"handshake payload of {header.length} bytes exceeds {MAX_HELLO}"
                return Close(error_reply(rid, Reason.BAD_LENGTH, msg), msg)
            if self._server_nonce is not None or (self._token and self.authenticated):
                msg = "HELLO sent twice"
                return Close(error_reply(rid, Reason.BAD_FRAME, msg), msg)
            self.runs = bool(header.flags & FLAG_RUN)
            return ReadHello(header.length, rid)
        if op == _AUTH:
            return self._on_auth_header(header)
        if not self.authenticated:
            if self._server_nonce is None:
                msg = f"{Op(op).name} before handshake: send HELLO first"
            else:
                msg = (f"{Op(op).name} before authentication: this {self.server_name} "
                       "requires a cluster token (answer its challenge with AUTH)")
            return self._refuse(rid, msg)
        return None

    def _on_auth_header(self, header: Header) -> Action:
        rid = header.request_id
        if self._token is None:
            msg = f"AUTH not expected: this {self.server_name} has no cluster token"
            return Close(error_reply(rid, Reason.BAD_FRAME, msg), msg)
        if self._server_nonce is None:
            if self.authenticated:
                msg = "AUTH sent twice"
                return Close(error_reply(rid, Reason.BAD_FRAME, msg), msg)
            return self._refuse(rid, "AUTH before handshake: send HELLO first")
        if header.length != AUTH_PAYLOAD:
            msg = f"AUTH payload of {header.length} bytes, expected {AUTH_PAYLOAD}"
            return Close(error_reply(rid, Reason.BAD_LENGTH, msg), msg)
        return ReadHello(header.length, rid)

    def _refuse(self, request_id: int, message: str) -> Close:
        self.auth_refused = True
        return Close(error_reply(request_id, Reason.NOT_AUTHENTICATED, message), message)

    def on_hello(self, request_id: int, payload: bytes) -> Send | Close:
        """The payload of the HELLO (the client's name) or of the AUTH that answers it."""
        if self._server_nonce is not None:
            return self._on_auth(request_id, payload)
        self._identity = bytes(payload)
        self.peer_identity = self._identity.decode("utf-8", "replace")
        if self._token is None:
            self.authenticated = True
            return Send(Header(Op.REPLY, request_id, epoch=self.epoch,
                               flags=self.reply_flags).pack())
        self._server_nonce = auth.new_nonce()
        return Send(Header(Op.REPLY, request_id, length=auth.NONCE_SIZE,
                           flags=FLAG_CHALLENGE).pack() + self._server_nonce)

    def _on_auth(self, request_id: int, payload: bytes) -> Send | Close:
        assert self._token is not None and self._server_nonce is not None
        server_nonce, self._server_nonce = self._server_nonce, None  # one try per connection
        client_nonce = bytes(payload[:auth.NONCE_SIZE])
        expected = auth.data_client_proof(self._token, server_nonce, client_nonce,
                                          self._identity)
        if len(payload) != AUTH_PAYLOAD or not auth.proofs_equal(
                expected, payload[auth.NONCE_SIZE:]):
            return self._refuse(request_id, "wrong cluster token: the AUTH proof does not match")
        self.authenticated = True
        proof = auth.data_server_proof(self._token, client_nonce, server_nonce)
        return Send(Header(Op.REPLY, request_id, epoch=self.epoch, length=len(proof),
                           flags=self.reply_flags).pack() + proof)


class ServerProtocol(_ServerHandshake):
    """One data connection, server side. Feed headers; execute the actions returned.

    With a cluster `token`, the connection is `authenticated` only after a valid AUTH;
    without one, right after HELLO (authentication off).
    """

    reply_flags = FLAG_VECTOR

    def __init__(self, resolve: Resolver, epoch: int, token: bytes | None = None) -> None:
        super().__init__(epoch, token)
        self._resolve = resolve

    def on_header(self, raw: bytes | bytearray | memoryview) -> Action:
        if len(raw) != HEADER_SIZE:
            msg = f"header is {len(raw)} bytes, expected {HEADER_SIZE}"
            return Close(error_reply(0, Reason.BAD_FRAME, msg), msg)
        return self.on_header_at(raw, 0)

    def on_header_at(self, buffer: bytes | bytearray | memoryview, offset: int) -> Action:
        """`on_header` for the 48 bytes at `buffer[offset:]` (a driver's receive buffer).

        An accepted WRITE or READ takes the short path: one unpack, one resolve, the
        checks inline, no Header object; everything else goes through `_on_frame`.
        """
        fields = _unpack_from(buffer, offset)
        magic, version, op, flags, _, _, epoch, rid, segment_id, addr, length = fields
        if (op in (_WRITE, _READ) and magic == MAGIC and version == VERSION
                and not flags & FLAG_VECTOR and self.authenticated and 0 < length <= MAX_PAYLOAD):
            # resolve once: a second lookup could miss a segment deregistered in between
            segment = self._resolve(segment_id)
            if (segment is not None and segment.epoch == epoch and addr >= segment.base
                    and addr + length <= segment.end
                    and (segment.writable if op == _WRITE else segment.readable)
                    and (segment.allowed is None or self.peer_identity in segment.allowed)):
                start = addr - segment.base
                window = segment.memory[start:start + length]
                if op == _WRITE:
                    return ReceiveInto(window, rid)
                return Send(None, window, rid)
            header = _checked(fields)
            refusal = self._check(header, segment)
            assert refusal is not None  # the same checks as above, now naming the failure
            reply = error_reply(rid, *refusal)
            return Discard(length, reply) if op == _WRITE else Send(reply)
        try:
            header = _checked(fields)
        except ProtocolError as exc:
            return Close(error_reply(0, exc.reason, str(exc)), str(exc))
        return self._on_frame(header)

    def _on_frame(self, header: Header) -> Action:
        """Every frame but an accepted WRITE or READ: handshake, refusals, PING."""
        handshake = self._handshake_frame(header)
        if handshake is not None:
            return handshake
        op = header.opcode
        rid = header.request_id
        if op == _PING:
            return Send(ok_reply(rid))
        if header.flags & FLAG_VECTOR and op in (_WRITE, _READ):
            return self._on_vector_header(header)
        if op == _REPLY:
            msg = "a client may not send REPLY frames"
            return Close(error_reply(rid, Reason.BAD_FRAME, msg), msg)
        if op == _CALL:
            msg = "CALL frames go to hixl-master's store call endpoint, not to a data server"
            return Close(error_reply(rid, Reason.BAD_FRAME, msg), msg)
        # a WRITE or READ of a bad length: on_header_at checks and serves all the others
        msg = f"length {header.length} must be in [1, {MAX_PAYLOAD}]"
        if op == _WRITE and header.length > MAX_PAYLOAD:
            # the payload cannot be skipped safely: the stream is lost
            return Close(error_reply(rid, Reason.BAD_LENGTH, msg), msg)
        return Send(error_reply(rid, Reason.BAD_LENGTH, msg))

    def _on_vector_header(self, header: Header) -> ReadTable | Close:
        """A vector WRITE/READ: read its range table next (`on_table`). A count or length
        out of bounds breaks the frame itself (what follows cannot be found): close."""
        count, length, rid = header.addr, header.length, header.request_id
        if not 1 <= count <= MAX_VECTOR_RANGES or not 0 < length <= MAX_PAYLOAD:
            msg = (f"vector of {count} ranges and {length} bytes: at most "
                   f"{MAX_VECTOR_RANGES} ranges, 1 to {MAX_PAYLOAD} bytes")
            return Close(error_reply(rid, Reason.BAD_LENGTH, msg), msg)
        return ReadTable(count * VECTOR_ENTRY.size, header.opcode, rid, header.segment_id,
                         header.epoch, length)

    def on_table(self, action: ReadTable, table: bytes | bytearray | memoryview
                 ) -> ReceiveVector | SendVector | Discard | Send | Close:
        """The range table of `action`'s vector request: every range checked (the
        segment's identity, rights and bounds, the ranges adding up to the header's
        length) before a byte moves. A refused WRITE's data is skipped (Discard)."""
        writing = action.opcode == _WRITE
        rid = action.request_id
        count = len(table) // VECTOR_ENTRY.size
        entries = np.frombuffer(table, ">u8", count * 2).reshape(count, 2)
        addrs, lengths = entries[:, 0], entries[:, 1]
        if int(addrs.max()) > _VECTOR_MAX_VALUE or int(lengths.min()) == 0 \
                or int(lengths.max()) > MAX_PAYLOAD or int(lengths.sum()) != action.length:
            msg = (f"vector table of {count} ranges: each length must be in [1, "
                   f"{MAX_PAYLOAD}], each address below 2**62, and the lengths must add up "
                   f"to the header's {action.length} bytes")
            if writing:  # the data's extent is what the header said: skip it
                return Discard(action.length, error_reply(rid, Reason.BAD_FRAME, msg))
            return Send(error_reply(rid, Reason.BAD_FRAME, msg))
        segment = self._resolve(action.segment_id)
        header = Header(action.opcode, rid, action.segment_id, action.epoch,
                        int(addrs.min()), 0)
        header.length = int((addrs + lengths).max()) - header.addr  # the ranges' span
        refusal = self._check(header, segment)
        if refusal is None:
            assert segment is not None
            starts = (addrs - segment.base).astype(np.int64)
            received = ReceiveVector(segment.memory, starts, lengths.astype(np.int64),
                                     action.length, rid)
            if writing:
                return received
            return SendVector(received.targets, action.length, rid)
        reply = error_reply(rid, *refusal)
        return Discard(action.length, reply) if writing else Send(reply)

    def _check(self, header: Header, segment: ServedSegment | None) -> tuple[Reason, str] | None:
        if segment is None:
            if header.epoch < self.epoch:
                # a handle from an earlier life of this agent (epochs grow from one start
                # to the next, and segment ids start again): stale, so the client
                # reconnects; not a bad request
                return (Reason.STALE_EPOCH,
                        f"segment {header.segment_id} epoch {header.epoch} is stale (the "
                        f"agent's epoch is now {self.epoch}): the agent restarted; "
                        "reconnect to refresh the table")
            return Reason.UNKNOWN_SEGMENT, f"segment {header.segment_id} is not served here"
        if header.epoch != segment.epoch:
            return (Reason.STALE_EPOCH,
                    f"segment {header.segment_id} epoch {header.epoch} is stale (now "
                    f"{segment.epoch}): the agent restarted; reconnect to refresh the table")
        if segment.allowed is not None and self.peer_identity not in segment.allowed:
            return (Reason.NOT_ALLOWED,
                    f"engine {self.peer_identity!r} may not reach segment "
                    f"{header.segment_id}: it is not in the segment's allowed_engines")
        writing = header.opcode == _WRITE
        if not (segment.writable if writing else segment.readable):
            return (Reason.PERMISSION,
                    f"segment {header.segment_id} does not allow "
                    f"{'writes' if writing else 'reads'} (perms {segment.perms})")
        end = header.addr + header.length
        if header.addr < segment.base or end > segment.base + segment.length:
            return (Reason.OUT_OF_RANGE,
                    f"[{header.addr:#x}, {end:#x}) is outside segment {header.segment_id} "
                    f"[{segment.base:#x}, {segment.base + segment.length:#x})")
        return None


# ---------------------------------------------------------------- store calls, server side

@dataclass(slots=True)
class ReadCall:
    """Read the CALL's `count` payload bytes, split them with `CallServerProtocol.split`,
    run the method and send its reply (`call_reply`, or `error_reply` if the call fails)."""

    count: int
    request_id: int
    method: int
    caller_id_length: int


CallAction = ReadCall | Discard | Send | ReadHello | Close


class CallServerProtocol(_ServerHandshake):
    """One connection to hixl-master's store call endpoint, server side.

    The handshake is the data path's (HELLO, and CHALLENGE / AUTH with a token); then
    each CALL naming one of `methods` (number -> name) becomes a ReadCall. A CALL naming
    another method is answered UNKNOWN_METHOD and its payload skipped, so the connection
    stays usable; a frame that is no CALL, or a payload over MAX_CALL, closes it.
    """

    server_name = "master"

    def __init__(self, methods: dict[int, str], token: bytes | None = None) -> None:
        super().__init__(0, token)
        self._methods = methods

    def on_header(self, raw: bytes | bytearray | memoryview) -> CallAction:
        try:
            header = decode_header(raw)
        except ProtocolError as exc:
            return Close(error_reply(0, exc.reason, str(exc)), str(exc))
        handshake = self._handshake_frame(header)
        if handshake is not None:
            return handshake  # type: ignore[return-value]  # never ReceiveInto: no segments
        op, rid = header.opcode, header.request_id
        if op == _PING:
            return Send(ok_reply(rid))
        if op != _CALL:
            msg = (f"{Op(op).name} is not served here: this is hixl-master's store call "
                   "endpoint (CALL frames only)")
            return Close(error_reply(rid, Reason.BAD_FRAME, msg), msg)
        if header.length > MAX_CALL:
            msg = f"call payload of {header.length} bytes exceeds {MAX_CALL}"
            return Close(error_reply(rid, Reason.BAD_LENGTH, msg), msg)
        if header.addr > MAX_CALL_REQUEST_ID or header.addr > header.length:
            msg = (f"call request id of {header.addr} bytes (at most {MAX_CALL_REQUEST_ID}, "
                   f"within the {header.length}-byte payload)")
            return Close(error_reply(rid, Reason.BAD_FRAME, msg), msg)
        if header.segment_id not in self._methods:
            known = ", ".join(self._methods.values())
            return Discard(header.length, error_reply(
                rid, Reason.UNKNOWN_METHOD,
                f"unknown method {header.segment_id} (this master serves {known})"))
        return ReadCall(header.length, rid, header.segment_id, header.addr)

    def split(self, action: ReadCall, payload: bytes | bytearray | memoryview,
              ) -> tuple[str, str, memoryview]:
        """(method name, caller's request id, request message) of a CALL's payload; the
        request id is "" when it is not printable ASCII (the caller's logs say which)."""
        view = memoryview(payload)
        cut = action.caller_id_length
        try:
            caller_id = bytes(view[:cut]).decode("ascii")
        except UnicodeDecodeError:
            caller_id = ""
        if not caller_id.isprintable():
            caller_id = ""
        return self._methods[action.method], caller_id, view[cut:]


# ---------------------------------------------------------------- client side

class ClientProtocol:
    """One data connection, client side: numbers requests and matches replies in order.

    Request ids are consecutive, so the outstanding requests are [first, next id): kept as
    an opcode per request (a bytearray) and the payload length its reply must carry, from
    `_head` on, which lets a run reply be checked with a few C-level slice operations.
    """

    def __init__(self) -> None:
        self._next_id = 1
        self._opcodes = bytearray()  # outstanding requests' opcodes, oldest at _head
        self._lengths: list[int] = []  # the payload length each one's reply must carry
        self._head = 0
        self._runs = False  # HELLO asked for run replies
        self._identity = b""
        self._nonces: tuple[bytes, bytes] | None = None  # (server, client) while in AUTH
        #: the agent answered HELLO with a CHALLENGE: AUTH must follow
        self.challenged = False
        #: the agent's handshake reply offered vector requests (FLAG_VECTOR)
        self.vectors = False

    @property
    def outstanding(self) -> int:
        return len(self._opcodes) - self._head

    def _take_id(self, opcode: int, length: int) -> int:
        rid = self._next_id
        self._next_id += 1
        self._opcodes.append(opcode)
        self._lengths.append(length)
        return rid

    def _answered(self, count: int) -> None:
        self._head += count
        if self._head == len(self._opcodes):
            self._opcodes.clear()
            self._lengths.clear()
            self._head = 0

    def hello(self, identity: bytes = b"", *, runs: bool = False) -> bytes:
        """HELLO naming this client; `runs`: ask for run replies (FLAG_RUN), which the
        caller must then read as `reply_count` requests' answers."""
        self._identity = identity
        self._runs = runs
        frame = bytearray(hello(self._take_id(Op.HELLO, 0), identity))
        if runs:
            frame[4:6] = FLAG_RUN.to_bytes(2, "big")
        return bytes(frame)

    def auth(self, token: bytes | None, server_nonce: bytes) -> bytes:
        """AUTH answering the agent's challenge; AuthenticationFailed without a token."""
        if token is None:
            raise errors.AuthenticationFailed(
                f"the agent requires a cluster token and none is configured here (set "
                f"{auth.ENV_TOKEN} or {auth.ENV_TOKEN_FILE})")
        if len(server_nonce) != auth.NONCE_SIZE:
            raise ProtocolError(Reason.BAD_FRAME, "challenge of the wrong size")
        client_nonce = auth.new_nonce()
        self._nonces = (bytes(server_nonce), client_nonce)
        proof = auth.data_client_proof(token, self._nonces[0], client_nonce, self._identity)
        return auth_frame(self._take_id(Op.AUTH, auth.PROOF_SIZE), client_nonce, proof)

    def check_server_proof(self, token: bytes, proof: bytes | bytearray | memoryview) -> None:
        """Mutual authentication: AuthenticationFailed unless the agent proved the token."""
        if self._nonces is None:
            raise ProtocolError(Reason.BAD_FRAME, "no AUTH in flight")
        server_nonce, client_nonce = self._nonces
        self._nonces = None
        if not auth.proofs_equal(auth.data_server_proof(token, client_nonce, server_nonce),
                                 proof):
            raise errors.AuthenticationFailed(
                "the agent did not prove the cluster token: it holds a different one (not "
                "a member of this cluster)")

    def write(self, segment_id: int, epoch: int, addr: int, length: int) -> bytes:
        """Header of a WRITE; the caller sends `length` payload bytes right after it."""
        return write_header(self._take_id(Op.WRITE, 0), segment_id, epoch, addr, length)

    def read(self, segment_id: int, epoch: int, addr: int, length: int) -> bytes:
        return read_request(self._take_id(Op.READ, length), segment_id, epoch, addr, length)

    def requests(self, opcode: int, ops: list[tuple[int, int, int, int]]) -> list[bytes]:
        """Headers of many WRITEs or READs at once: `ops` are (segment_id, epoch, addr, length).

        Same frames as `write`/`read` one by one, at a fraction of the per-op cost.
        """
        if opcode not in (_WRITE, _READ):
            raise ValueError(f"requests() encodes WRITE or READ, not opcode {opcode}")
        first = self._next_id
        headers = [_pack(MAGIC, VERSION, opcode, 0, 0, 0, epoch, rid, segment_id, addr, length)
                   for rid, (segment_id, epoch, addr, length) in enumerate(ops, first)]
        self._next_id = first + len(ops)
        self._opcodes += bytes((opcode,)) * len(ops)
        if opcode == _READ:
            self._lengths += [op[3] for op in ops]
        else:
            self._lengths += [0] * len(ops)
        return headers

    def vector_table(self, opcode: int, segment_id: int, epoch: int, table: np.ndarray
                     ) -> bytes:
        """A vector WRITE or READ of the ranges in `table`, an (n, 2) array of (addr,
        length) of one segment: its header and range table (a WRITE's data, the ranges'
        bytes in order, follows them). Only for an agent that offered vectors
        (`vectors`)."""
        count = len(table)
        total = int(table[:, 1].sum()) if count else 0
        if opcode not in (_WRITE, _READ) or not 1 <= count <= MAX_VECTOR_RANGES \
                or not 0 < total <= MAX_PAYLOAD:
            raise ValueError(f"a vector is a WRITE or READ of 1 to {MAX_VECTOR_RANGES} "
                             f"ranges and 1 to {MAX_PAYLOAD} bytes, not opcode {opcode} with "
                             f"{count} ranges of {total} bytes")
        rid = self._take_id(opcode, total if opcode == _READ else 0)
        return _pack(MAGIC, VERSION, opcode, FLAG_VECTOR, 0, 0, epoch, rid, segment_id,
                     count, total) + table.astype(">u8", copy=False).tobytes()

    def request(self, opcode: int, segment_id: int, epoch: int, addr: int, length: int
                ) -> tuple[bytes, bytes]:
        """One WRITE or READ header, and the plain OK reply that would accept it.

        Why the pair: a single op's reply is checked by comparing its 48 bytes with the
        expected OK (`answered_ok`), skipping the decode; any other reply still goes
        through `on_reply_header`, which checks it fully.
        """
        rid = self._next_id
        self._next_id = rid + 1
        self._opcodes.append(opcode)
        data = length if opcode == _READ else 0
        self._lengths.append(data)
        return (_pack(MAGIC, VERSION, opcode, 0, 0, 0, epoch, rid, segment_id, addr, length),
                _pack(MAGIC, VERSION, _REPLY, 0, 0, 0, 0, rid, 0, 0, data))

    def take(self, opcode: int, length: int) -> int:
        """Number one WRITE or READ of `length` bytes that the caller encodes itself (the
        compiled lone op, hixl._fastwire: the same frame as `request`); its request id."""
        rid = self._next_id
        self._next_id = rid + 1
        self._opcodes.append(opcode)
        self._lengths.append(length if opcode == _READ else 0)
        return rid

    def answered_ok(self) -> None:
        """The oldest outstanding request got exactly the OK reply `request` returned."""
        self._answered(1)

    def ping(self) -> bytes:
        return Header(Op.PING, self._take_id(Op.PING, 0)).pack()

    def call(self, method: int, caller_id: bytes, message_length: int) -> bytes:
        """Header and request-id prefix of a CALL (store call endpoint); the caller sends
        the `message_length` bytes of the serialized request right after them."""
        if len(caller_id) > MAX_CALL_REQUEST_ID:
            raise ValueError(f"request id of {len(caller_id)} bytes (at most "
                             f"{MAX_CALL_REQUEST_ID})")
        if len(caller_id) + message_length > MAX_CALL:
            raise ValueError(f"call of {len(caller_id) + message_length} bytes exceeds "
                             f"{MAX_CALL}")
        return call_frame(self._take_id(Op.CALL, 0), method, caller_id, message_length)

    def on_reply_header(self, raw: bytes | bytearray | memoryview) -> Header:
        """Check the next reply header against the oldest outstanding request(s).

        Returns the header; the caller then reads `payload_length(header)` bytes (read data,
        or error text when `header.flags & FLAG_ERROR_TEXT`). A run reply answers
        `reply_count(header)` requests; its READ data is theirs, back to back. Raises
        ProtocolError when the reply is not the one expected.
        """
        header = decode_header(raw)
        if header.opcode != _REPLY:
            raise ProtocolError(Reason.BAD_FRAME, f"expected REPLY, got opcode {header.opcode}")
        outstanding = len(self._opcodes) - self._head
        if not outstanding:
            raise ProtocolError(Reason.BAD_FRAME, f"unsolicited reply {header.request_id}")
        rid = self._next_id - outstanding
        opcode, length = self._opcodes[self._head], self._lengths[self._head]
        if header.request_id not in (rid, 0):
            raise ProtocolError(Reason.BAD_FRAME,
                                f"reply for request {header.request_id}, expected {rid}")
        if header.flags & FLAG_RUN:
            self._check_run(header, rid, opcode, outstanding)
            self._answered(header.addr)
            return header
        if header.flags & FLAG_ERROR_TEXT:
            if header.length > MAX_ERROR_TEXT:
                raise ProtocolError(Reason.BAD_FRAME, "error text too long")
        elif header.status != errors.SUCCESS:
            raise ProtocolError(Reason.BAD_FRAME, "error reply without a message")
        elif opcode == _READ and header.length != length:
            raise ProtocolError(Reason.BAD_FRAME,
                                f"read reply carries {header.length} bytes, asked {length}")
        elif opcode == _HELLO:
            challenge = bool(header.flags & FLAG_CHALLENGE)
            if header.length != (auth.NONCE_SIZE if challenge else 0):
                raise ProtocolError(Reason.BAD_FRAME,
                                    f"HELLO reply carries {header.length} bytes")
            self.challenged = challenge
            self.vectors = not challenge and bool(header.flags & FLAG_VECTOR)
        elif opcode == _AUTH and header.length != length:
            raise ProtocolError(Reason.BAD_FRAME,
                                f"AUTH reply carries {header.length} bytes, expected {length}")
        elif opcode == _AUTH:
            self.vectors = bool(header.flags & FLAG_VECTOR)
        elif opcode == _CALL and header.length > MAX_CALL:
            raise ProtocolError(Reason.BAD_FRAME,
                                f"call reply of {header.length} bytes exceeds {MAX_CALL}")
        elif opcode not in (_READ, _AUTH, _CALL) and header.length != 0:
            raise ProtocolError(Reason.BAD_FRAME, "unexpected payload on a reply")
        self._answered(1)
        return header

    def _check_run(self, header: Header, rid: int, opcode: int, outstanding: int) -> None:
        """A run reply must accept `count` outstanding requests of one kind, exactly."""
        count = header.addr
        if not self._runs:
            raise ProtocolError(Reason.BAD_FRAME, "run reply, but this client did not ask "
                                                  "for runs")
        if header.request_id != rid:
            raise ProtocolError(Reason.BAD_FRAME,
                                f"run reply from request {header.request_id}, expected {rid}")
        if header.flags & FLAG_ERROR_TEXT or header.status != errors.SUCCESS or header.reason:
            raise ProtocolError(Reason.BAD_FRAME, "a run reply cannot refuse")
        if not 1 <= count <= outstanding:
            raise ProtocolError(Reason.BAD_FRAME, f"run reply for {count} requests, "
                                                  f"{outstanding} outstanding")
        head = self._head
        if opcode not in (_WRITE, _READ) or self._opcodes.count(opcode, head,
                                                                 head + count) != count:
            raise ProtocolError(Reason.BAD_FRAME, f"run reply for {count} requests that are "
                                                  "not all WRITEs or all READs")
        expected = sum(self._lengths[head:head + count])
        if header.length != expected:
            raise ProtocolError(Reason.BAD_FRAME, f"run reply carries {header.length} bytes, "
                                                  f"its requests asked {expected}")


def reply_error(header: Header, text: bytes) -> errors.HixlError:
    """The exception a refused request's reply stands for."""
    message = text.decode("utf-8", "replace")
    reason = header.reason
    if reason == Reason.STALE_EPOCH:
        return errors.StaleEpoch(message)
    if reason == Reason.PERMISSION or reason == Reason.NOT_ALLOWED:
        return errors.PermissionDenied(message)
    if reason == Reason.OUT_OF_RANGE:
        return errors.OutOfRange(message)
    if reason == Reason.NOT_AUTHENTICATED:
        return errors.AuthenticationFailed(message)
    return errors.error_for_status(header.status or errors.FAILED, message)
