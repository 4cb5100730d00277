"""The sans-IO data-path codec: frames and both protocol state machines, no sockets."""

from __future__ import annotations

import numpy as np
import pytest

from hixl import errors, wire
from hixl.types import Perm
from hixl.wire import (
    HEADER_SIZE,
    MAX_PAYLOAD,
    Close,
    Discard,
    Header,
    Op,
    ProtocolError,
    ReadHello,
    Reason,
    ReceiveInto,
    Send,
    ServedSegment,
    ServerProtocol,
)

BASE = 0x7F00_0000_0000
SIZE = 64 << 10
EPOCH = 7


def make_segment(segment_id: int = 1, perms: Perm = Perm.RW, epoch: int = EPOCH,
                 base: int = BASE, size: int = SIZE) -> ServedSegment:
    return ServedSegment(segment_id, epoch, base, size, perms, memoryview(bytearray(size)))


def make_server(*segments: ServedSegment, hello: bool = True) -> ServerProtocol:
    table = {seg.segment_id: seg for seg in segments}
    proto = ServerProtocol(table.get, epoch=3)
    if hello:
        action = proto.on_header(wire.hello(1, b"peer")[:HEADER_SIZE])
        assert isinstance(action, ReadHello)
        reply = proto.on_hello(action.request_id, b"peer")
        assert wire.decode_header(reply.reply).epoch == 3
    return proto


def parse_reply(raw: bytes) -> tuple[Header, bytes]:
    header = wire.decode_header(raw[:HEADER_SIZE])
    assert header.opcode == Op.REPLY
    text = raw[HEADER_SIZE:]
    assert len(text) == wire.payload_length(header)
    return header, text


def assert_refused(reply: bytes, reason: Reason, *words: str) -> None:
    header, text = parse_reply(reply)
    assert header.reason == reason
    assert header.flags & wire.FLAG_ERROR_TEXT
    assert header.status != errors.SUCCESS
    message = text.decode()
    for word in words:
        assert word in message, message


# ---------------------------------------------------------------- frames

def test_header_round_trip_keeps_every_field() -> None:
    top = (1 << 64) - 1
    original = Header(Op.WRITE, request_id=top, segment_id=top - 1, epoch=(1 << 32) - 1,
                      addr=top - 2, length=top - 3, status=errors.FAILED, reason=Reason.INTERNAL,
                      flags=0xFFFF)
    raw = original.pack()
    assert len(raw) == HEADER_SIZE == 48
    assert wire.decode_header(raw) == original
    assert wire.decode_header(memoryview(bytearray(raw))) == original


@pytest.mark.parametrize("encoded, expected", [
    (wire.write_header(5, 6, 7, 8, 9), Header(Op.WRITE, 5, 6, 7, 8, 9)),
    (wire.read_request(5, 6, 7, 8, 9), Header(Op.READ, 5, 6, 7, 8, 9)),
    (wire.ok_reply(4, 100), Header(Op.REPLY, 4, length=100)),
    (wire.hello(2)[:HEADER_SIZE], Header(Op.HELLO, 2)),
])
def test_encoders_match_header_pack(encoded: bytes, expected: Header) -> None:
    assert encoded == expected.pack()
    assert wire.decode_header(encoded) == expected


def test_hello_carries_identity_as_payload() -> None:
    raw = wire.hello(9, b"engine-a")
    header = wire.decode_header(raw[:HEADER_SIZE])
    assert wire.payload_length(header) == len(b"engine-a")
    assert raw[HEADER_SIZE:] == b"engine-a"


def test_payload_length_only_for_frames_that_carry_data() -> None:
    assert wire.payload_length(Header(Op.WRITE, length=10)) == 10
    assert wire.payload_length(Header(Op.REPLY, length=10)) == 10
    assert wire.payload_length(Header(Op.READ, length=10)) == 0  # the data comes back
    assert wire.payload_length(Header(Op.PING, length=10)) == 0


@pytest.mark.parametrize("raw, words", [
    (b"\x00" * 47, "47 bytes"),
    (b"\x00" * 49, "49 bytes"),
    (b"\x12\x34" + Header(Op.WRITE).pack()[2:], "bad magic 0x1234"),
    (Header(Op.WRITE).pack()[:2] + b"\x09" + Header(Op.WRITE).pack()[3:], "version 9"),
    (Header(Op.WRITE).pack()[:3] + b"\x63" + Header(Op.WRITE).pack()[4:], "unknown opcode 99"),
])
def test_decode_header_refuses_malformed_frames(raw: bytes, words: str) -> None:
    with pytest.raises(ProtocolError, match=words) as info:
        wire.decode_header(raw)
    assert info.value.reason == Reason.BAD_FRAME


def test_error_reply_text_is_capped() -> None:
    header, text = parse_reply(wire.error_reply(3, Reason.PERMISSION, "x" * 10_000))
    assert len(text) == wire.MAX_ERROR_TEXT
    assert header.request_id == 3 and header.status == errors.PARAM_INVALID


def test_not_leader_reply_carries_the_leader_address() -> None:
    """A standby master's refusal of a CALL (issue 8): reason NOT_LEADER (11, a number no
    other reason uses), the leader's address as the error text, a failed status."""
    assert Reason.NOT_LEADER == 11 and len({int(r) for r in Reason}) == len(Reason)
    header, text = parse_reply(wire.error_reply(9, Reason.NOT_LEADER, "10.0.0.2:50051"))
    assert (header.request_id, header.reason, text) == (9, Reason.NOT_LEADER,
                                                         b"10.0.0.2:50051")
    assert header.flags & wire.FLAG_ERROR_TEXT and header.status == errors.FAILED
    header, text = parse_reply(wire.error_reply(9, Reason.NOT_LEADER, ""))  # leader unknown
    assert header.reason == Reason.NOT_LEADER and text == b""


@pytest.mark.parametrize("length, limit", [(1, 10), (10, 10), (11, 10), (95, 10), (MAX_PAYLOAD * 2 + 1,
                                                                                     MAX_PAYLOAD)])
def test_split_covers_the_op_exactly(length: int, limit: int) -> None:
    parts = wire.split(BASE, length, limit)
    assert all(0 < n <= limit for _, n in parts)
    assert [off for off, _ in parts] == list(range(0, length, limit))
    assert sum(n for _, n in parts) == length


# ---------------------------------------------------------------- server: accepted frames

def test_write_receives_into_exactly_the_addressed_bytes() -> None:
    seg = make_segment()
    proto = make_server(seg)
    action = proto.on_header(wire.write_header(11, 1, EPOCH, BASE + 100, 5))
    assert isinstance(action, ReceiveInto)
    action.target[:] = b"hello"
    assert bytes(seg.memory[100:105]) == b"hello"
    assert bytes(seg.memory[:100]) == bytes(100) and bytes(seg.memory[105:]) == bytes(SIZE - 105)
    header, text = parse_reply(action.reply)
    assert (header.request_id, header.status, text) == (11, errors.SUCCESS, b"")


def test_read_sends_the_addressed_bytes_after_an_ok_header() -> None:
    seg = make_segment()
    seg.memory[SIZE - 3:] = b"end"
    proto = make_server(seg)
    action = proto.on_header(wire.read_request(12, 1, EPOCH, BASE + SIZE - 3, 3))
    assert isinstance(action, Send)
    assert action.payload is not None and bytes(action.payload) == b"end"
    header = wire.decode_header(action.reply)
    assert (header.request_id, header.length, header.status) == (12, 3, errors.SUCCESS)


def test_whole_segment_and_max_payload_are_allowed() -> None:
    seg = make_segment()
    proto = make_server(seg)
    assert isinstance(proto.on_header(wire.write_header(1, 1, EPOCH, BASE, SIZE)), ReceiveInto)
    big = ServedSegment(2, EPOCH, BASE, MAX_PAYLOAD, Perm.RW, memoryview(b""))
    proto = make_server(big)
    assert isinstance(proto.on_header(wire.read_request(1, 2, EPOCH, BASE, MAX_PAYLOAD)), Send)


def test_ping_is_answered_after_hello() -> None:
    proto = make_server()
    action = proto.on_header(Header(Op.PING, 8).pack())
    assert isinstance(action, Send)
    assert wire.decode_header(action.reply) == Header(Op.REPLY, 8)


def test_hello_records_identity() -> None:
    proto = make_server(hello=False)
    action = proto.on_header(wire.hello(1, b"x")[:HEADER_SIZE])
    assert isinstance(action, ReadHello) and action.count == 1
    proto.on_hello(1, b"prefill-0")
    assert proto.authenticated and proto.peer_identity == "prefill-0"


# ---------------------------------------------------------------- server: refusals

@pytest.mark.parametrize("frame", [
    wire.write_header(1, 1, EPOCH, BASE, 8),
    wire.read_request(1, 1, EPOCH, BASE, 8),
    Header(Op.PING, 1).pack(),
    Header(Op.REPLY, 1).pack(),
])
def test_everything_but_hello_is_refused_before_the_handshake(frame: bytes) -> None:
    seg = make_segment()
    proto = make_server(seg, hello=False)
    action = proto.on_header(frame)
    assert isinstance(action, Close)
    assert action.reply is not None
    assert_refused(action.reply, Reason.NOT_AUTHENTICATED, "HELLO")
    assert bytes(seg.memory) == bytes(SIZE)


def test_oversized_hello_closes() -> None:
    proto = make_server(hello=False)
    action = proto.on_header(Header(Op.HELLO, 1, length=wire.MAX_HELLO + 1).pack())
    assert isinstance(action, Close)
    assert action.reply is not None
    assert_refused(action.reply, Reason.BAD_LENGTH, str(wire.MAX_HELLO))


@pytest.mark.parametrize("raw, words", [
    (b"\xde\xad" + wire.write_header(1, 1, EPOCH, BASE, 8)[2:], "bad magic"),
    (wire.write_header(1, 1, EPOCH, BASE, 8)[:2] + b"\x02" + wire.write_header(1, 1, EPOCH, BASE, 8)[3:],
     "version 2"),
    (wire.write_header(1, 1, EPOCH, BASE, 8)[:3] + b"\x00" + wire.write_header(1, 1, EPOCH, BASE, 8)[4:],
     "unknown opcode 0"),
    (b"\x00" * 20, "20 bytes"),
])
def test_malformed_header_closes_with_bad_frame(raw: bytes, words: str) -> None:
    proto = make_server(make_segment())
    action = proto.on_header(raw)
    assert isinstance(action, Close)
    assert action.reply is not None
    assert_refused(action.reply, Reason.BAD_FRAME, words)


def test_reply_from_client_closes() -> None:
    proto = make_server(make_segment())
    action = proto.on_header(Header(Op.REPLY, 4).pack())
    assert isinstance(action, Close)
    assert action.reply is not None
    assert_refused(action.reply, Reason.BAD_FRAME, "REPLY")


@pytest.mark.parametrize("op", [Op.WRITE, Op.READ])
def test_zero_length_is_refused_and_stream_continues(op: Op) -> None:
    proto = make_server(make_segment())
    action = proto.on_header(Header(op, 5, 1, EPOCH, BASE, 0).pack())
    assert isinstance(action, Send) and action.payload is None  # nothing to skip
    assert_refused(action.reply, Reason.BAD_LENGTH, "length 0")


def test_oversized_write_closes_the_stream() -> None:
    """Its payload cannot be skipped safely, so the connection must end."""
    proto = make_server(make_segment())
    action = proto.on_header(wire.write_header(5, 1, EPOCH, BASE, MAX_PAYLOAD + 1))
    assert isinstance(action, Close)
    assert action.reply is not None
    assert_refused(action.reply, Reason.BAD_LENGTH, str(MAX_PAYLOAD + 1))


def test_oversized_read_is_refused_and_stream_continues() -> None:
    proto = make_server(make_segment())
    action = proto.on_header(wire.read_request(5, 1, EPOCH, BASE, MAX_PAYLOAD + 1))
    assert isinstance(action, Send) and action.payload is None
    assert_refused(action.reply, Reason.BAD_LENGTH)


def refusal_cases() -> list[tuple[str, ServedSegment, Op, int, int, int, int, Reason, str]]:
    rw, ro, wo = make_segment(1), make_segment(2, Perm.READ), make_segment(3, Perm.WRITE)
    cases = []
    for op in (Op.WRITE, Op.READ):
        cases += [
            ("unknown segment", rw, op, 99, EPOCH, BASE, 8, Reason.UNKNOWN_SEGMENT, "99"),
            ("stale epoch", rw, op, 1, EPOCH - 1, BASE, 8, Reason.STALE_EPOCH, "stale"),
            ("below base", rw, op, 1, EPOCH, BASE - 1, 8, Reason.OUT_OF_RANGE, "outside"),
            ("end + 1 byte", rw, op, 1, EPOCH, BASE + SIZE - 7, 8, Reason.OUT_OF_RANGE, "outside"),
            ("past the end", rw, op, 1, EPOCH, BASE + SIZE, 1, Reason.OUT_OF_RANGE, "outside"),
            ("far away", rw, op, 1, EPOCH, 0x10, 8, Reason.OUT_OF_RANGE, "outside"),
        ]
    cases += [
        ("write to read-only", ro, Op.WRITE, 2, EPOCH, BASE, 8, Reason.PERMISSION, "writes"),
        ("read from write-only", wo, Op.READ, 3, EPOCH, BASE, 8, Reason.PERMISSION, "reads"),
    ]
    return cases


@pytest.mark.parametrize("case", refusal_cases(), ids=lambda c: f"{c[2].name}-{c[0]}")
def test_refusals_keep_the_stream_and_touch_no_memory(
        case: tuple[str, ServedSegment, Op, int, int, int, int, Reason, str]) -> None:
    _, segment, op, segment_id, epoch, addr, length, reason, words = case
    segment.memory[:] = b"\xab" * SIZE
    proto = make_server(segment)
    action = proto.on_header(Header(op, 21, segment_id, epoch, addr, length).pack())
    if op == Op.WRITE:
        assert isinstance(action, Discard)  # the payload is skipped, the stream stays in step
        assert action.count == length
    else:
        assert isinstance(action, Send) and action.payload is None
    assert_refused(action.reply, reason, words)
    assert wire.decode_header(action.reply[:HEADER_SIZE]).request_id == 21
    assert bytes(segment.memory) == b"\xab" * SIZE
    # the connection goes on: a good request on the same protocol object is served
    good = Op.READ if segment.perms & Perm.READ else Op.WRITE
    ok = proto.on_header(Header(good, 22, segment.segment_id, EPOCH, BASE, 4).pack())
    assert isinstance(ok, Send | ReceiveInto)


def test_segment_deregistered_between_frames_is_refused_not_crashed() -> None:
    """The resolver is asked once per frame, so a segment vanishing mid-check is safe."""
    seg = make_segment()
    answers = iter([seg, None, seg, None, None])
    proto = make_server()
    proto._resolve = lambda _sid: next(answers)  # noqa: SLF001 - a table that changes
    actions = [proto.on_header(wire.read_request(n, 1, EPOCH, BASE, 8)) for n in range(4)]
    assert all(isinstance(action, Send) for action in actions)
    # the second and fourth frames met a deregistered segment: refused, not served
    assert [action.payload is not None for action in actions] == [True, False, True, False]
    assert_refused(actions[1].reply, Reason.UNKNOWN_SEGMENT)
    refused = proto.on_header(wire.write_header(9, 1, EPOCH, BASE, 8))
    assert isinstance(refused, Discard)
    assert_refused(refused.reply, Reason.UNKNOWN_SEGMENT)


def test_reply_error_maps_reasons_to_exceptions() -> None:
    def error_of(reason: Reason) -> errors.HixlError:
        header, text = parse_reply(wire.error_reply(1, reason, f"because {reason.name}"))
        exc = wire.reply_error(header, text)
        assert f"because {reason.name}" in str(exc)
        return exc

    assert isinstance(error_of(Reason.STALE_EPOCH), errors.StaleEpoch)
    assert isinstance(error_of(Reason.PERMISSION), errors.PermissionDenied)
    assert isinstance(error_of(Reason.OUT_OF_RANGE), errors.OutOfRange)
    assert type(error_of(Reason.UNKNOWN_SEGMENT)) is errors.ParamInvalid
    assert type(error_of(Reason.BAD_LENGTH)) is errors.ParamInvalid
    assert type(error_of(Reason.NOT_AUTHENTICATED)) is errors.AuthenticationFailed
    assert type(error_of(Reason.INTERNAL)) is errors.TransferFailed


# ---------------------------------------------------------------- client protocol

def test_client_matches_replies_in_order() -> None:
    client = wire.ClientProtocol()
    hello = wire.decode_header(client.hello(b"me")[:HEADER_SIZE])
    write = wire.decode_header(client.write(1, EPOCH, BASE, 100))
    read = wire.decode_header(client.read(1, EPOCH, BASE, 64))
    ping = wire.decode_header(client.ping())
    ids = [hello.request_id, write.request_id, read.request_id, ping.request_id]
    assert len(set(ids)) == 4 and client.outstanding == 4
    assert (write.opcode, write.segment_id, write.epoch, write.addr, write.length) == (
        Op.WRITE, 1, EPOCH, BASE, 100)
    client.on_reply_header(Header(Op.REPLY, ids[0], epoch=3).pack())
    client.on_reply_header(wire.ok_reply(ids[1]))
    got = client.on_reply_header(wire.ok_reply(ids[2], 64))
    assert wire.payload_length(got) == 64
    # an error reply for the oldest request may carry request id 0 (a connection-level error)
    got = client.on_reply_header(wire.error_reply(0, Reason.INTERNAL, "boom")[:HEADER_SIZE])
    assert got.flags & wire.FLAG_ERROR_TEXT and wire.payload_length(got) == 4
    assert client.outstanding == 0


def test_client_accepts_error_text_instead_of_read_data() -> None:
    client = wire.ClientProtocol()
    rid = wire.decode_header(client.read(1, EPOCH, BASE, 64)).request_id
    reply = wire.error_reply(rid, Reason.OUT_OF_RANGE, "nope")
    header = client.on_reply_header(reply[:HEADER_SIZE])
    assert isinstance(wire.reply_error(header, reply[HEADER_SIZE:]), errors.OutOfRange)


@pytest.mark.parametrize("reply, words", [
    (lambda rid: wire.ok_reply(rid + 1), "expected"),  # wrong request id
    (lambda rid: wire.ok_reply(rid, 63), "asked 64"),  # wrong read length
    (lambda rid: wire.read_request(rid, 1, EPOCH, BASE, 64), "expected REPLY"),
    (lambda rid: Header(Op.REPLY, rid, status=errors.FAILED).pack(), "without a message"),
    (lambda rid: Header(Op.REPLY, rid, length=wire.MAX_ERROR_TEXT + 1,
                        flags=wire.FLAG_ERROR_TEXT, status=errors.FAILED).pack(), "too long"),
])
def test_client_refuses_mismatched_read_replies(reply, words: str) -> None:  # noqa: ANN001
    client = wire.ClientProtocol()
    rid = wire.decode_header(client.read(1, EPOCH, BASE, 64)).request_id
    with pytest.raises(ProtocolError, match=words):
        client.on_reply_header(reply(rid))
    assert client.outstanding == 1  # nothing consumed: the caller drops the connection


def test_client_refuses_payload_on_a_write_reply() -> None:
    client = wire.ClientProtocol()
    rid = wire.decode_header(client.write(1, EPOCH, BASE, 64)).request_id
    with pytest.raises(ProtocolError, match="unexpected payload"):
        client.on_reply_header(wire.ok_reply(rid, 64))


def test_client_refuses_unsolicited_replies() -> None:
    client = wire.ClientProtocol()
    with pytest.raises(ProtocolError, match="unsolicited"):
        client.on_reply_header(wire.ok_reply(1))
    rid = wire.decode_header(client.ping()).request_id
    client.on_reply_header(wire.ok_reply(rid))
    with pytest.raises(ProtocolError, match="unsolicited"):
        client.on_reply_header(wire.ok_reply(rid))


# ---------------------------------------------------------------- runs: one reply for many

def test_bulk_requests_match_one_by_one_encoding() -> None:
    ops = [(1, EPOCH, BASE + 10 * n, n + 1) for n in range(5)]
    one_by_one, bulk = wire.ClientProtocol(), wire.ClientProtocol()
    for opcode, encode in ((Op.WRITE, one_by_one.write), (Op.READ, one_by_one.read)):
        assert bulk.requests(opcode, ops) == [encode(*op) for op in ops]
    assert bulk.outstanding == one_by_one.outstanding == 10
    with pytest.raises(ValueError, match="WRITE or READ"):
        bulk.requests(Op.PING, ops)


def test_single_request_pairs_its_frame_with_the_ok_that_accepts_it() -> None:
    """`request` encodes what `write`/`read` do, and its expected OK is exactly the reply
    a server sends; any other reply still goes through the full check, in step."""
    single, one_by_one = wire.ClientProtocol(), wire.ClientProtocol()
    server = wire.ServerProtocol(lambda sid: None, EPOCH)
    for opcode, encode, length in ((Op.WRITE, one_by_one.write, 4096),
                                   (Op.READ, one_by_one.read, 4096)):
        header, ok = single.request(opcode, 1, EPOCH, BASE, length)
        assert header == encode(1, EPOCH, BASE, length)
        rid = wire.decode_header(header).request_id
        assert ok == wire.run_reply(rid, 1, length if opcode == Op.READ else 0)
        assert ok == wire.ok_reply(rid, length if opcode == Op.READ else 0)
        single.answered_ok()
    assert single.outstanding == 0
    # a refusal is not the expected OK: on_reply_header takes it and stays in step
    header, ok = single.request(Op.READ, 9, EPOCH, BASE, 8)
    action = server.on_header(header)
    assert isinstance(action, wire.Close)  # no HELLO: refused before any check
    assert action.reply is not None and not action.reply.startswith(ok)
    refusal = single.on_reply_header(action.reply[:HEADER_SIZE])
    assert refusal.flags & wire.FLAG_ERROR_TEXT and single.outstanding == 0


def test_run_reply_encodes_count_and_length() -> None:
    header = wire.decode_header(wire.run_reply(7, 3, 300))
    assert (header.request_id, wire.reply_count(header), header.length) == (7, 3, 300)
    assert header.flags == wire.FLAG_RUN and header.status == 0
    assert wire.run_reply(7, 1, 100) == wire.ok_reply(7, 100)  # a run of one is plain
    assert wire.reply_count(wire.decode_header(wire.ok_reply(7))) == 1


def test_server_learns_from_hello_whether_the_client_reads_runs() -> None:
    for runs in (False, True):
        proto = ServerProtocol({}.get, epoch=3)
        hello = wire.ClientProtocol().hello(b"peer", runs=runs)
        assert isinstance(proto.on_header(hello[:HEADER_SIZE]), ReadHello)
        assert proto.runs is runs
    assert not wire.decode_header(wire.ClientProtocol().hello()[:HEADER_SIZE]).flags


def test_server_decodes_headers_in_place_in_a_receive_buffer() -> None:
    """on_header_at reads a header at any offset of a larger buffer, as the agent's ring."""
    seg = make_segment()
    proto = make_server(seg)
    ring = bytearray(b"x" * 5 + wire.write_header(3, 1, EPOCH, BASE + 8, 4) + b"data"
                     + wire.read_request(4, 1, EPOCH, BASE + 8, 4) + b"\0" * 20)
    write = proto.on_header_at(ring, 5)
    assert isinstance(write, ReceiveInto) and write.request_id == 3
    assert write.reply == wire.ok_reply(3)
    write.target[:] = ring[5 + HEADER_SIZE:5 + HEADER_SIZE + 4]
    read = proto.on_header_at(memoryview(ring), 5 + HEADER_SIZE + 4)
    assert isinstance(read, Send) and read.request_id == 4 and bytes(read.payload) == b"data"
    assert read.reply == wire.ok_reply(4, 4)
    refused = proto.on_header_at(wire.read_request(5, 1, EPOCH + 1, BASE, 4), 0)
    assert isinstance(refused, Send) and refused.payload is None
    assert_refused(refused.reply, Reason.STALE_EPOCH, "stale")


def run_client(*requests: tuple[Op, int]) -> tuple[wire.ClientProtocol, int]:
    """A client that asked for runs, with (opcode, length) requests outstanding."""
    client = wire.ClientProtocol()
    client.on_reply_header(Header(Op.REPLY, wire.decode_header(
        client.hello(b"me", runs=True)[:HEADER_SIZE]).request_id, epoch=3).pack())
    first = client.outstanding + 2  # the HELLO was id 1
    for opcode, length in requests:
        client.requests(opcode, [(1, EPOCH, BASE, length)])
    return client, first


def test_client_accepts_runs_covering_exactly_their_requests() -> None:
    client, first = run_client((Op.WRITE, 10), (Op.WRITE, 20), (Op.READ, 5), (Op.READ, 7),
                               (Op.READ, 9), (Op.WRITE, 1))
    got = client.on_reply_header(wire.run_reply(first, 2))
    assert wire.reply_count(got) == 2 and wire.payload_length(got) == 0
    got = client.on_reply_header(wire.run_reply(first + 2, 2, 12))
    assert wire.reply_count(got) == 2 and wire.payload_length(got) == 12
    client.on_reply_header(wire.ok_reply(first + 4, 9))  # a plain reply still works
    client.on_reply_header(wire.ok_reply(first + 5))
    assert client.outstanding == 0


@pytest.mark.parametrize("reply, words", [
    (lambda first: wire.run_reply(first, 4, 12), "4 requests, 3 outstanding"),
    (lambda first: wire.run_reply(first, 2, 11), "carries 11 bytes, its requests asked 12"),
    (lambda first: wire.run_reply(first + 1, 2, 12), "expected"),
    (lambda first: wire.run_reply(0, 2, 12), "expected"),
    (lambda first: Header(Op.REPLY, first, addr=0, flags=wire.FLAG_RUN).pack(), "0 requests"),
    (lambda first: Header(Op.REPLY, first, addr=2, length=12, flags=wire.FLAG_RUN
                          | wire.FLAG_ERROR_TEXT, status=errors.FAILED).pack(), "cannot refuse"),
])
def test_client_refuses_runs_that_do_not_match(reply, words: str) -> None:  # noqa: ANN001
    client, first = run_client((Op.READ, 5), (Op.READ, 7), (Op.WRITE, 3))
    with pytest.raises(ProtocolError, match=words):
        client.on_reply_header(reply(first))
    assert client.outstanding == 3  # nothing consumed: the caller drops the connection


def test_client_refuses_runs_mixing_kinds_or_not_asked_for() -> None:
    client, first = run_client((Op.WRITE, 5), (Op.READ, 7))
    with pytest.raises(ProtocolError, match="not all WRITEs or all READs"):
        client.on_reply_header(wire.run_reply(first, 2, 7))
    plain = wire.ClientProtocol()
    plain.hello()
    plain.on_reply_header(Header(Op.REPLY, 1, epoch=3).pack())
    plain.requests(Op.WRITE, [(1, EPOCH, BASE, 1)] * 2)
    with pytest.raises(ProtocolError, match="did not ask"):
        plain.on_reply_header(wire.run_reply(2, 2))


# ---------------------------------------------------------------- cluster-token handshake

TOKEN = b"cluster-secret-0123456789"


def secured_server(*segments: ServedSegment, token: bytes = TOKEN) -> ServerProtocol:
    table = {seg.segment_id: seg for seg in segments}
    return ServerProtocol(table.get, epoch=3, token=token)


def feed(server: ServerProtocol, frame: bytes) -> wire.Action:
    """Give the server one whole frame: its header, then its handshake payload if asked."""
    action = server.on_header(frame[:HEADER_SIZE])
    if isinstance(action, ReadHello):
        assert action.count == len(frame) - HEADER_SIZE
        return server.on_hello(action.request_id, frame[HEADER_SIZE:])
    return action


def challenge_of(server: ServerProtocol, client: wire.ClientProtocol,
                 identity: bytes = b"peer") -> bytes:
    """HELLO -> CHALLENGE; the client has checked the reply, returns the server nonce."""
    answer = feed(server, client.hello(identity))
    assert isinstance(answer, Send) and answer.payload is None
    header = client.on_reply_header(answer.reply[:HEADER_SIZE])
    assert header.flags & wire.FLAG_CHALLENGE and client.challenged
    assert header.epoch == 0  # the epoch is told only to authenticated clients
    nonce = answer.reply[HEADER_SIZE:]
    assert len(nonce) == wire.payload_length(header) == 16
    return nonce


def authenticate(server: ServerProtocol, token: bytes = TOKEN) -> wire.ClientProtocol:
    client = wire.ClientProtocol()
    nonce = challenge_of(server, client)
    answer = feed(server, client.auth(token, nonce))
    assert isinstance(answer, Send)
    header = client.on_reply_header(answer.reply[:HEADER_SIZE])
    assert header.status == errors.SUCCESS and header.epoch == 3
    client.check_server_proof(token, answer.reply[HEADER_SIZE:])
    return client


def test_token_handshake_authenticates_both_sides_then_serves() -> None:
    seg = make_segment()
    server = secured_server(seg)
    client = authenticate(server)
    assert server.authenticated and not server.auth_refused
    assert server.peer_identity == "peer"
    action = server.on_header(client.write(1, EPOCH, BASE, 8))
    assert isinstance(action, ReceiveInto) and len(action.target) == 8


def test_wrong_token_is_refused_and_closes() -> None:
    seg = make_segment()
    server = secured_server(seg)
    client = wire.ClientProtocol()
    nonce = challenge_of(server, client)
    refusal = feed(server, client.auth(b"not-the-token", nonce))
    assert isinstance(refusal, Close) and refusal.reply is not None
    assert_refused(refusal.reply, Reason.NOT_AUTHENTICATED, "wrong cluster token")
    assert not server.authenticated and server.auth_refused
    header, text = parse_reply(refusal.reply)
    assert isinstance(wire.reply_error(header, text), errors.AuthenticationFailed)
    assert bytes(seg.memory) == bytes(SIZE)


def test_a_refused_connection_gets_no_second_try() -> None:
    server = secured_server()
    client = wire.ClientProtocol()
    nonce = challenge_of(server, client)
    assert isinstance(feed(server, client.auth(b"guess-1", nonce)), Close)
    # even the right proof for that nonce is refused now: one AUTH per connection
    again = feed(server, client.auth(TOKEN, nonce))
    assert isinstance(again, Close) and not server.authenticated


def test_a_replayed_proof_is_refused_on_a_new_connection() -> None:
    first = secured_server()
    client = wire.ClientProtocol()
    nonce = challenge_of(first, client)
    recorded = client.auth(TOKEN, nonce)  # a valid AUTH frame, as seen on the wire
    assert isinstance(feed(first, recorded), Send) and first.authenticated
    second = secured_server()
    other_nonce = challenge_of(second, wire.ClientProtocol())
    assert other_nonce != nonce  # a fresh challenge per connection
    replay = feed(second, recorded)
    assert isinstance(replay, Close) and replay.reply is not None
    assert_refused(replay.reply, Reason.NOT_AUTHENTICATED, "wrong cluster token")
    assert not second.authenticated


def test_a_proof_for_another_identity_is_refused() -> None:
    server = secured_server()
    client = wire.ClientProtocol()
    nonce = challenge_of(server, client, identity=b"decode-0")
    liar = wire.ClientProtocol()
    liar.hello(b"prefill-7")  # the proof binds the name sent in HELLO
    assert isinstance(feed(server, liar.auth(TOKEN, nonce)), Close)


@pytest.mark.parametrize("frame", [
    wire.write_header(2, 1, EPOCH, BASE, 8) + bytes(8),
    wire.read_request(2, 1, EPOCH, BASE, 8),
    Header(Op.PING, 2).pack(),
])
def test_frames_before_auth_are_refused(frame: bytes) -> None:
    seg = make_segment()
    server = secured_server(seg)
    challenge_of(server, wire.ClientProtocol())
    action = server.on_header(frame[:HEADER_SIZE])
    assert isinstance(action, Close) and action.reply is not None
    assert_refused(action.reply, Reason.NOT_AUTHENTICATED, "requires a cluster token")
    assert server.auth_refused and not server.authenticated
    assert bytes(seg.memory) == bytes(SIZE)


def test_a_client_without_token_cannot_answer_the_challenge() -> None:
    server = secured_server()
    client = wire.ClientProtocol()
    nonce = challenge_of(server, client)
    with pytest.raises(errors.AuthenticationFailed, match="requires a cluster token"):
        client.auth(None, nonce)
    # and a tokenless client that just carries on is refused by the server
    refused = server.on_header(client.write(1, EPOCH, BASE, 8))
    assert isinstance(refused, Close) and not server.authenticated


def test_auth_out_of_place_closes() -> None:
    proof = wire.auth_frame(1, bytes(16), bytes(32))
    before_hello = secured_server()
    action = feed(before_hello, proof)
    assert isinstance(action, Close) and action.reply is not None
    assert_refused(action.reply, Reason.NOT_AUTHENTICATED, "HELLO")
    twice = secured_server()
    authenticate(twice)
    action = feed(twice, proof)
    assert isinstance(action, Close) and action.reply is not None
    assert_refused(action.reply, Reason.BAD_FRAME, "twice")
    no_token = make_server()  # authentication off: AUTH is not part of the protocol
    action = feed(no_token, proof)
    assert isinstance(action, Close) and action.reply is not None
    assert_refused(action.reply, Reason.BAD_FRAME, "no cluster token")


def test_auth_of_the_wrong_size_and_hello_twice_close() -> None:
    server = secured_server()
    challenge_of(server, wire.ClientProtocol())
    action = server.on_header(Header(Op.AUTH, 2, length=wire.AUTH_PAYLOAD + 1).pack())
    assert isinstance(action, Close) and action.reply is not None
    assert_refused(action.reply, Reason.BAD_LENGTH, str(wire.AUTH_PAYLOAD))
    server = secured_server()
    challenge_of(server, wire.ClientProtocol())
    action = server.on_header(wire.hello(2, b"again")[:HEADER_SIZE])
    assert isinstance(action, Close) and not server.authenticated


def test_client_checks_the_agent_proof() -> None:
    """An impostor agent (any other token) can accept our AUTH but cannot prove the token."""
    impostor = secured_server(token=b"some-other-token")
    client = wire.ClientProtocol()
    nonce = challenge_of(impostor, client)
    rid = wire.decode_header(client.auth(TOKEN, nonce)[:HEADER_SIZE]).request_id
    fake = Header(Op.REPLY, rid, epoch=3, length=32).pack() + bytes(range(32))
    client.on_reply_header(fake[:HEADER_SIZE])
    with pytest.raises(errors.AuthenticationFailed, match="did not prove"):
        client.check_server_proof(TOKEN, fake[HEADER_SIZE:])


def test_a_client_with_token_works_with_an_agent_without_one() -> None:
    server = make_server(hello=False)
    client = wire.ClientProtocol()
    answer = feed(server, client.hello(b"me"))
    assert isinstance(answer, Send)
    header = client.on_reply_header(answer.reply)
    assert not client.challenged and header.epoch == 3 and server.authenticated


@pytest.mark.parametrize("reply, words", [
    (Header(Op.REPLY, 1, length=16).pack(), "HELLO reply carries 16"),  # no challenge flag
    (Header(Op.REPLY, 1, length=8, flags=wire.FLAG_CHALLENGE).pack(), "HELLO reply carries 8"),
])
def test_client_refuses_malformed_challenges(reply: bytes, words: str) -> None:
    client = wire.ClientProtocol()
    client.hello(b"me")
    with pytest.raises(ProtocolError, match=words):
        client.on_reply_header(reply)


# ---------------------------------------------------------------- vector requests

def vector(client: wire.ClientProtocol, op: Op, segment_id: int, epoch: int,
           ranges: list[tuple[int, int]]) -> bytes:
    """client.vector_table of (addr, length) pairs."""
    table = np.array(ranges, np.uint64).reshape(-1, 2)
    return client.vector_table(op, segment_id, epoch, table)


def vector_frame(op: Op, ranges: list[tuple[int, int]], *, segment_id: int = 1,
                 epoch: int = EPOCH) -> tuple[wire.ClientProtocol, bytes, bytes]:
    """A client's vector request: (its protocol, the header, the range table)."""
    client = wire.ClientProtocol()
    frame = vector(client, op, segment_id, epoch, ranges)
    return client, frame[:HEADER_SIZE], frame[HEADER_SIZE:]


def test_the_handshake_offers_vectors_and_the_client_learns_it() -> None:
    proto = ServerProtocol({}.get, epoch=3)
    proto.on_header(wire.hello(1, b"peer")[:HEADER_SIZE])
    reply = proto.on_hello(1, b"peer").reply
    assert wire.decode_header(reply).flags & wire.FLAG_VECTOR
    client = wire.ClientProtocol()
    client.hello(b"peer")
    client.on_reply_header(reply)
    assert client.vectors
    old_agent = wire.ClientProtocol()  # an agent that does not offer them: never used
    old_agent.hello(b"peer")
    old_agent.on_reply_header(wire.Header(Op.REPLY, 1, epoch=3).pack())
    assert not old_agent.vectors
    calls = wire.CallServerProtocol({1: "Commit"})  # the store call endpoint: no vectors
    calls.on_header(wire.hello(1, b"peer")[:HEADER_SIZE])
    assert not wire.decode_header(calls.on_hello(1, b"peer").reply).flags & wire.FLAG_VECTOR


def test_a_vector_write_lands_each_range_where_its_entry_says() -> None:
    segment = make_segment()
    proto = make_server(segment)
    ranges = [(BASE + 4096, 3), (BASE, 2), (BASE + SIZE - 4, 4)]   # any order, not adjacent
    client, header, table = vector_frame(Op.WRITE, ranges)
    wanted = wire.decode_header(header)
    assert (wanted.addr, wanted.length) == (3, 9)
    assert wire.payload_length(wanted) == len(table) + 9
    action = proto.on_header(header)
    assert isinstance(action, wire.ReadTable) and action.count == len(table) == 48
    accepted = proto.on_table(action, table)
    assert isinstance(accepted, wire.ReceiveVector) and accepted.size == 9
    data = b"abcdefghi"
    at = 0
    for view in accepted.targets:
        view[:] = data[at:at + len(view)]
        at += len(view)
    memory = bytes(segment.memory)
    assert memory[4096:4099] == b"abc" and memory[:2] == b"de" and memory[-4:] == b"fghi"
    assert memory.count(0) == SIZE - 9
    client.on_reply_header(wire.ok_reply(accepted.request_id))
    assert client.outstanding == 0


def test_a_vector_read_sends_its_ranges_back_to_back() -> None:
    segment = make_segment()
    segment.memory[:] = bytes(range(256)) * (SIZE // 256)
    proto = make_server(segment)
    ranges = [(BASE + 10, 2), (BASE + 300, 3)]
    client, header, table = vector_frame(Op.READ, ranges)
    assert wire.payload_length(wire.decode_header(header)) == len(table)
    accepted = proto.on_table(proto.on_header(header), table)
    assert isinstance(accepted, wire.SendVector) and accepted.size == 5
    assert b"".join(bytes(v) for v in accepted.views) == bytes([10, 11, 44, 45, 46])
    reply = client.on_reply_header(wire.ok_reply(accepted.request_id, 5))
    assert reply.length == 5 and client.outstanding == 0


@pytest.mark.parametrize(("perms", "op", "ranges", "reason", "words"), [
    (Perm.RW, Op.WRITE, [(BASE, 4), (BASE + SIZE - 2, 3)], Reason.OUT_OF_RANGE, "outside"),
    (Perm.RW, Op.READ, [(BASE - 1, 2)], Reason.OUT_OF_RANGE, "outside"),
    (Perm.READ, Op.WRITE, [(BASE, 4)], Reason.PERMISSION, "does not allow writes"),
    (Perm.WRITE, Op.READ, [(BASE, 4)], Reason.PERMISSION, "does not allow reads"),
])
def test_a_vector_with_one_bad_range_is_refused_whole(perms: Perm, op: Op, ranges: list,
                                                      reason: Reason, words: str) -> None:
    segment = make_segment(perms=perms)
    proto = make_server(segment)
    _, header, table = vector_frame(op, ranges)
    refused = proto.on_table(proto.on_header(header), table)
    if op == Op.WRITE:  # the data is skipped: the stream stays in step
        assert isinstance(refused, Discard) and refused.count == sum(n for _, n in ranges)
    else:
        assert isinstance(refused, Send) and refused.payload is None
    assert_refused(refused.reply, reason, words)
    assert not any(segment.memory)


def test_a_table_that_disagrees_with_its_header_is_refused() -> None:
    proto = make_server(make_segment())
    _, header, _ = vector_frame(Op.WRITE, [(BASE, 4), (BASE + 8, 4)])
    for table in (wire.VECTOR_ENTRY.pack(BASE, 4) + wire.VECTOR_ENTRY.pack(BASE + 8, 5),
                  wire.VECTOR_ENTRY.pack(BASE, 8) + wire.VECTOR_ENTRY.pack(BASE + 8, 0),
                  wire.VECTOR_ENTRY.pack(1 << 63, 4) + wire.VECTOR_ENTRY.pack(BASE, 4)):
        refused = proto.on_table(proto.on_header(header), table)
        assert isinstance(refused, Discard) and refused.count == 8
        assert_refused(refused.reply, Reason.BAD_FRAME, "add up")


@pytest.mark.parametrize(("count", "length"), [(0, 8), (wire.MAX_VECTOR_RANGES + 1, 8),
                                               (1, 0), (1, MAX_PAYLOAD + 1)])
def test_a_vector_header_out_of_bounds_closes(count: int, length: int) -> None:
    proto = make_server(make_segment())
    raw = wire.HEADER.pack(wire.MAGIC, wire.VERSION, Op.WRITE, wire.FLAG_VECTOR, 0, 0, EPOCH,
                           5, 1, count, length)
    closed = proto.on_header(raw)
    assert isinstance(closed, Close)
    assert_refused(closed.reply, Reason.BAD_LENGTH, "ranges")


def test_the_client_encodes_only_what_a_vector_can_carry() -> None:
    client = wire.ClientProtocol()
    with pytest.raises(ValueError, match="WRITE or READ"):
        vector(client, Op.PING, 1, EPOCH, [(BASE, 1)])
    with pytest.raises(ValueError, match="1 to"):
        vector(client, Op.WRITE, 1, EPOCH, [])
    with pytest.raises(ValueError, match="1 to"):
        vector(client, Op.WRITE, 1, EPOCH, [(BASE, 1)] * (wire.MAX_VECTOR_RANGES + 1))
    assert client.outstanding == 0
