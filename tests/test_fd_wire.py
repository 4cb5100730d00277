"""hixl.fd_wire: the fd socket's messages and their sans-IO codec.

Unit tests: no sockets, no fds, no processes. The bytes are the ones the agent and its
clients have always exchanged (tests/test_agent_process.py sends some by hand)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hixl import fd_wire
from hixl.errors import ParamInvalid, PermissionDenied, StaleEpoch
from hixl.fd_wire import (
    Deposit,
    Deposited,
    FdGranted,
    GetFd,
    GetStates,
    MalformedReply,
    Ping,
    Pong,
    Refused,
    StatesGranted,
    decode_reply,
    decode_request,
    encode_reply,
    encode_request,
)

_u64 = st.integers(min_value=0, max_value=(1 << 64) - 1)
_requests = st.one_of(
    st.builds(GetFd, _u64, _u64, st.booleans(), st.text(max_size=40)),
    st.just(GetStates()), st.just(Ping()),
    st.builds(Deposit, st.integers(min_value=1, max_value=1 << 50)))
_replies = st.one_of(
    st.builds(FdGranted, _u64, _u64, _u64), st.builds(StatesGranted, st.integers(1, 1 << 32)),
    st.builds(Deposited, st.text(max_size=40)), st.builds(Pong, _u64, st.text(max_size=40)),
    st.builds(Refused, st.one_of(st.none(), st.integers(0, 999999)), st.text(max_size=80),
              st.sampled_from(["", "ParamInvalid", "PermissionDenied", "StaleEpoch"])))
_REQUEST_OF = {FdGranted: GetFd(1, 1), StatesGranted: GetStates(), Deposited: Deposit(1),
               Pong: Ping(), Refused: Ping()}


# ------------------------------------------------------------------ the bytes


def test_wire_bytes_are_the_protocol() -> None:
    assert encode_request(GetFd(3, 7, True, "10.0.0.1:50161")) == (
        b'{"op": "get_fd", "segment_id": 3, "epoch": 7, "write": true, '
        b'"engine": "10.0.0.1:50161"}')
    assert encode_request(GetStates()) == b'{"op": "get_states"}'
    assert encode_request(Deposit(4096)) == b'{"op": "deposit", "length": 4096}'
    assert encode_request(Ping()) == b'{"op": "ping"}'
    assert encode_reply(FdGranted(4096, 8192, 2)) == (
        b'{"ok": true, "length": 4096, "offset": 8192, "slot": 2}')
    assert encode_reply(StatesGranted(64)) == b'{"ok": true, "capacity": 64}'
    assert encode_reply(Deposited("ab12")) == b'{"ok": true, "ticket": "ab12"}'
    assert encode_reply(Pong(5, "h:1")) == b'{"ok": true, "epoch": 5, "engine": "h:1"}'
    assert encode_reply(Refused(103900, "no", "ParamInvalid")) == (
        b'{"ok": false, "status": 103900, "error": "no", "kind": "ParamInvalid"}')


def test_messages_name_their_op_and_fds() -> None:
    assert [r.op for r in (GetFd(0, 0), GetStates(), Deposit(1), Ping())] == list(fd_wire.OPS)
    assert (Deposit(1).fds, GetFd(0, 0).fds, FdGranted(1).fds, StatesGranted(1).fds,
            Deposited("t").fds, Pong(0, "").fds) == (1, 0, 1, 1, 0, 0)


def test_refused_of_an_error() -> None:
    refused = Refused.of(StaleEpoch("segment 3 is at epoch 9"))
    assert refused == Refused(StaleEpoch("x").status, "segment 3 is at epoch 9", "StaleEpoch")


# ------------------------------------------------------------------ round trips


@given(_requests)
def test_requests_round_trip(asked: fd_wire.Request) -> None:
    assert decode_request(encode_request(asked), asked.fds) == asked


@given(_replies)
def test_replies_round_trip(reply: fd_wire.Reply) -> None:
    asked = _REQUEST_OF[type(reply)]
    assert decode_reply(encode_reply(reply), asked, reply.fds) == reply
    assert decode_reply(encode_reply(reply), asked.op, reply.fds) == reply


# ------------------------------------------------------------------ malformed requests


@pytest.mark.parametrize(("data", "fds", "problem"), [
    (b"not json", 0, "request is not JSON"),
    (b"\xff\xfe", 0, "request is not JSON"),
    (b"[1, 2]", 0, "must be a JSON object"),
    (b"{}", 0, "unknown op None"),
    (b'{"op": "explode"}', 0, "unknown op 'explode'"),
    (b'{"op": "get_fd"}', 0, "'segment_id' must be a non-negative integer"),
    (b'{"op": "get_fd", "segment_id": "1", "epoch": 1}', 0, "'segment_id'"),
    (b'{"op": "get_fd", "segment_id": true, "epoch": 1}', 0, "'segment_id'"),
    (b'{"op": "get_fd", "segment_id": 1, "epoch": -1}', 0, "'epoch'"),
    (b'{"op": "get_fd", "segment_id": 1, "epoch": 1, "write": "yes"}', 0, "'write' must be"),
    (b'{"op": "get_fd", "segment_id": 1, "epoch": 1, "engine": 5}', 0, "'engine' must be"),
    (b'{"op": "ping"}', 1, "ping takes no fds, got 1"),
    (b'{"op": "get_fd", "segment_id": 1, "epoch": 1}', 2, "get_fd takes no fds"),
    (b'{"op": "deposit", "length": 10}', 0, "deposit needs exactly one fd attached, got 0"),
    (b'{"op": "deposit", "length": 10}', 2, "exactly one fd"),
    (b'{"op": "deposit", "length": 0}', 1, "length must be positive"),
    (b'{"op": "deposit"}', 1, "'length' must be a non-negative integer"),
    (b"x" * 10000, 0, "request is not JSON"),
])
def test_malformed_requests_are_param_invalid(data: bytes, fds: int, problem: str) -> None:
    with pytest.raises(ParamInvalid, match=problem) as caught:
        decode_request(data, fds)
    assert type(caught.value) is ParamInvalid  # the reply's "kind" clients re-raise


def test_requests_keep_defaults() -> None:
    assert decode_request(b'{"op": "get_fd", "segment_id": 1, "epoch": 2}') == GetFd(1, 2)
    assert decode_request(b'{"op": "ping", "extra": 1}') == Ping()


@given(st.binary(max_size=200), st.integers(min_value=0, max_value=4))
def test_any_bytes_decode_or_are_refused_typed(data: bytes, fds: int) -> None:
    try:
        asked = decode_request(data, fds)
    except ParamInvalid:
        return
    assert asked.fds == fds


@given(st.dictionaries(st.sampled_from(["op", "segment_id", "epoch", "write", "engine",
                                        "length"]),
                       st.one_of(st.sampled_from(list(fd_wire.OPS)), st.integers(-2, 2),
                                 st.booleans(), st.none(), st.text(max_size=5))),
       st.integers(min_value=0, max_value=2))
def test_any_object_decodes_or_is_refused_typed(fields: dict, fds: int) -> None:
    try:
        asked = decode_request(json.dumps(fields).encode(), fds)
    except ParamInvalid:
        return
    assert asked.op == fields["op"] and asked.fds == fds


# ------------------------------------------------------------------ malformed replies


@pytest.mark.parametrize(("data", "asked", "fds", "problem"), [
    (b"garbage", Ping(), 0, fd_wire.NOT_JSON),
    (b"[]", Ping(), 0, fd_wire.NOT_JSON),
    (b'{"ok": true}', GetFd(1, 1), 1, "malformed get_fd reply"),
    (b'{"ok": true, "length": 5}', GetFd(1, 1), 0, "with 0 fds"),
    (b'{"ok": true, "length": -5}', GetFd(1, 1), 1, "malformed get_fd reply"),
    (b'{"ok": true, "length": 5, "slot": "x"}', GetFd(1, 1), 1, "malformed get_fd"),
    (b'{"ok": true, "length": true}', GetFd(1, 1), 1, "malformed get_fd"),
    (b'{"ok": true, "capacity": 0}', GetStates(), 1, "malformed get_states reply"),
    (b'{"ok": true, "capacity": 8}', GetStates(), 2, "with 2 fds"),
    (b'{"ok": true}', Deposit(1), 0, "no ticket in"),
    (b'{"ok": true, "epoch": "1", "engine": "h:1"}', Ping(), 0, "malformed ping reply"),
])
def test_malformed_replies(data: bytes, asked: fd_wire.Request, fds: int,
                           problem: str) -> None:
    with pytest.raises(MalformedReply, match=problem):
        decode_reply(data, asked, fds)


def test_refusals_tolerate_missing_fields() -> None:
    assert decode_reply(b'{"ok": false}', Ping()) == Refused(None, "refused", "")
    assert decode_reply(b'{"ok": false, "status": "x", "kind": 3}', GetFd(1, 1)) == Refused(
        None, "refused", "3")
    refused = decode_reply(encode_reply(Refused.of(PermissionDenied("read-only"))),
                           GetFd(1, 1, True))
    assert refused.kind == "PermissionDenied" and refused.error == "read-only"


def test_a_granted_reply_may_carry_no_extra_fields() -> None:
    assert decode_reply(b'{"ok": true, "length": 9}', GetFd(1, 1), 1) == FdGranted(9, 0, 0)


def test_unknown_op_has_no_reply() -> None:
    with pytest.raises(ValueError, match="no reply is defined"):
        decode_reply(b'{"ok": true}', "explode")


@given(st.binary(max_size=200), st.sampled_from([GetFd(1, 1), GetStates(), Deposit(1), Ping()]),
       st.integers(min_value=0, max_value=4))
def test_any_reply_bytes_decode_or_are_malformed(data: bytes, asked: fd_wire.Request,
                                                 fds: int) -> None:
    try:
        reply = decode_reply(data, asked, fds)
    except MalformedReply:
        return
    assert decode_reply(encode_reply(reply), asked, reply.fds) == reply
