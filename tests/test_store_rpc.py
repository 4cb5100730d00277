"""The store call endpoint: its sans-IO codec, then hixl-master serving it for real.

The codec half drives `wire.CallServerProtocol` and `wire.ClientProtocol.call` with
bytes only. The process half runs real hixl-master processes and real store clients:
values moved byte for byte over it, the fallback to gRPC, a master killed mid-call or
hung, a master restarted under a live client, a wrong cluster token. Deadlines only
prove "does not hang"; nothing asserts how long anything took.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from functools import partial

import numpy as np
import pytest
import waiting
from prometheus_client.parser import text_string_to_metric_families

from hixl import errors, store_rpc, wire
from hixl.client.mooncake import MooncakeDistributedStore
from hixl.client.store_client import MasterClient
from hixl.logs import request_context
from hixl.processes import free_port
from hixl.server.master.store import ObjectStore
from hixl.server.master.store_rpc_server import StoreCallServer
from hixl.server.master.store_service import StoreCalls
from hixl.store_codes import ErrorCode
from hixl.store_rpc import (
    MESSAGES,
    METHOD_NUMBERS,
    METHODS,
    CallConnection,
    CallFailed,
    FastPath,
    NotSent,
)
from hixl.store_types import MasterAuthenticationFailed, MasterUnavailable, StoreSegment
from hixl.tools.daemons import HolderProcess, MasterProcess
from hixl.v1 import store_pb2
from hixl.wire import Header, Op, Reason
from hixl.wire_client import DeadlineSocket

H = wire.HEADER_SIZE
TOKEN = b"store-call-secret"
MiB = 1 << 20
DEADLINE_S = 20.0
#: a client deadline no test may wait out (the tests' own timeout is far shorter)
UNREACHABLE_DEADLINE_S = 600.0
GET_REPLICAS = next(n for n, name in METHODS.items() if name == "GetReplicas")
PUT_START = next(n for n, name in METHODS.items() if name == "PutStart")


# ---------------------------------------------------------------- the codec


def shake(server: wire.CallServerProtocol, client: wire.ClientProtocol,
          token: bytes | None = None) -> None:
    """HELLO (and CHALLENGE / AUTH) through both sides; the connection is then served."""
    frame = client.hello(b"client-1")
    action = server.on_header(frame[:H])
    assert isinstance(action, wire.ReadHello)
    reply = server.on_hello(action.request_id, frame[H:])
    assert isinstance(reply, wire.Send)
    header = client.on_reply_header(reply.reply[:H])
    if client.challenged:
        frame = client.auth(token, reply.reply[H:H + header.length])
        action = server.on_header(frame[:H])
        assert isinstance(action, wire.ReadHello)
        reply = server.on_hello(action.request_id, frame[H:])
        assert isinstance(reply, wire.Send), getattr(reply, "reason", "")
        header = client.on_reply_header(reply.reply[:H])
        assert token is not None
        client.check_server_proof(token, reply.reply[H:H + header.length])
    assert server.authenticated


def refusal(action: object, reason: Reason, text: str) -> None:
    """`action` closes the connection with one error reply for `reason` naming `text`."""
    assert isinstance(action, wire.Close), action
    assert action.reply is not None
    header = wire.decode_header(action.reply[:H])
    assert header.reason == reason and header.flags & wire.FLAG_ERROR_TEXT
    assert text in action.reply[H:].decode()


def test_a_call_crosses_both_codecs() -> None:
    server, client = wire.CallServerProtocol(METHODS), wire.ClientProtocol()
    shake(server, client)
    message = store_pb2.KeysRequest(keys=["k1", "k2"]).SerializeToString()
    frame = client.call(GET_REPLICAS, b"rid-7", len(message)) + message
    action = server.on_header(frame[:H])
    assert isinstance(action, wire.ReadCall) and action.count == len(frame) - H
    method, caller_id, body = server.split(action, frame[H:])
    assert (method, caller_id) == ("GetReplicas", "rid-7")
    assert list(store_pb2.KeysRequest.FromString(body).keys) == ["k1", "k2"]
    answer = store_pb2.GetReplicasReply(results=[store_pb2.GetReplicasResult(
        code=ErrorCode.OK, size=5)]).SerializeToString()
    out = wire.call_reply(action.request_id, len(answer)) + answer
    header = client.on_reply_header(out[:H])
    assert header.length == len(answer) and client.outstanding == 0
    assert store_pb2.GetReplicasReply.FromString(out[H:]).results[0].size == 5
    ping = client.ping()
    assert isinstance(server.on_header(ping), wire.Send)


def test_nothing_is_served_before_the_handshake() -> None:
    server, client = wire.CallServerProtocol(METHODS), wire.ClientProtocol()
    frame = client.call(PUT_START, b"", 0)
    refusal(server.on_header(frame[:H]), Reason.NOT_AUTHENTICATED, "send HELLO first")
    assert server.auth_refused and not server.authenticated


def test_a_wrong_token_is_refused_before_any_call() -> None:
    server, client = wire.CallServerProtocol(METHODS, TOKEN), wire.ClientProtocol()
    frame = client.hello(b"intruder")
    action = server.on_header(frame[:H])
    assert isinstance(action, wire.ReadHello)
    challenge = server.on_hello(action.request_id, frame[H:])
    assert isinstance(challenge, wire.Send)
    assert client.on_reply_header(challenge.reply[:H]).flags & wire.FLAG_CHALLENGE
    # a CALL instead of the AUTH the challenge asks for
    early = wire.ClientProtocol().call(PUT_START, b"", 0)
    refusal(server.on_header(early[:H]), Reason.NOT_AUTHENTICATED, "master requires a "
                                                                    "cluster token")
    # an AUTH with another token
    server2, client2 = wire.CallServerProtocol(METHODS, TOKEN), wire.ClientProtocol()
    frame = client2.hello(b"intruder")
    action = server2.on_header(frame[:H])
    challenge = server2.on_hello(action.request_id, frame[H:])  # type: ignore[union-attr]
    assert isinstance(challenge, wire.Send)
    header = client2.on_reply_header(challenge.reply[:H])
    auth = client2.auth(b"not-the-token", challenge.reply[H:H + header.length])
    action = server2.on_header(auth[:H])
    assert isinstance(action, wire.ReadHello)
    refusal(server2.on_hello(action.request_id, auth[H:]), Reason.NOT_AUTHENTICATED,
            "wrong cluster token")
    assert server2.auth_refused and not server2.authenticated
    # and a client without any token stops at the challenge
    with pytest.raises(errors.AuthenticationFailed, match="requires a cluster token"):
        wire.ClientProtocol().auth(None, b"\0" * 16)


def test_the_right_token_is_served_and_the_master_proves_it() -> None:
    server, client = wire.CallServerProtocol(METHODS, TOKEN), wire.ClientProtocol()
    shake(server, client, TOKEN)
    frame = client.call(GET_REPLICAS, b"", 0)
    assert isinstance(server.on_header(frame[:H]), wire.ReadCall)


@pytest.mark.parametrize(("header", "reason", "text"), [
    (b"\0" * H, Reason.BAD_FRAME, "bad magic"),
    (Header(Op.CALL).pack()[:2] + b"\x09" + Header(Op.CALL).pack()[3:], Reason.BAD_FRAME,
     "version"),
    (Header(Op.CALL).pack()[:3] + b"\x63" + Header(Op.CALL).pack()[4:], Reason.BAD_FRAME,
     "unknown opcode"),
    (Header(Op.WRITE, 2, 1, 1, 0x1000, 8).pack(), Reason.BAD_FRAME, "CALL frames only"),
    (Header(Op.READ, 2, 1, 1, 0x1000, 8).pack(), Reason.BAD_FRAME, "CALL frames only"),
    (Header(Op.REPLY, 2).pack(), Reason.BAD_FRAME, "CALL frames only"),
    (Header(Op.CALL, 2, PUT_START, addr=wire.MAX_CALL_REQUEST_ID + 1, length=100).pack(),
     Reason.BAD_FRAME, "request id"),
    (Header(Op.CALL, 2, PUT_START, addr=10, length=4).pack(), Reason.BAD_FRAME, "request id"),
    (Header(Op.CALL, 2, PUT_START, length=wire.MAX_CALL + 1).pack(), Reason.BAD_LENGTH,
     "exceeds"),
])
def test_malformed_frames_close_the_connection(header: bytes, reason: Reason,
                                               text: str) -> None:
    server = wire.CallServerProtocol(METHODS)
    shake(server, wire.ClientProtocol())
    refusal(server.on_header(header), reason, text)


def test_oversized_calls_and_replies_are_refused_on_the_client_too() -> None:
    client = wire.ClientProtocol()
    with pytest.raises(ValueError, match="exceeds"):
        client.call(PUT_START, b"", wire.MAX_CALL + 1)
    with pytest.raises(ValueError, match="request id"):
        client.call(PUT_START, b"x" * (wire.MAX_CALL_REQUEST_ID + 1), 0)
    client.call(PUT_START, b"", 1)
    with pytest.raises(wire.ProtocolError, match="exceeds"):
        client.on_reply_header(wire.call_reply(1, wire.MAX_CALL + 1))


def test_an_unknown_method_is_answered_and_the_connection_goes_on() -> None:
    server, client = wire.CallServerProtocol(METHODS), wire.ClientProtocol()
    shake(server, client)
    frame = client.call(99, b"", 3) + b"abc"
    action = server.on_header(frame[:H])
    assert isinstance(action, wire.Discard) and action.count == 3  # payload skipped
    header = client.on_reply_header(action.reply[:H])
    error = wire.reply_error(header, action.reply[H:])
    assert header.reason == Reason.UNKNOWN_METHOD and isinstance(error, errors.Unsupported)
    assert "unknown method 99" in str(error) and "PutStart" in str(error)
    frame = client.call(GET_REPLICAS, b"", 0)
    assert isinstance(server.on_header(frame[:H]), wire.ReadCall)


def test_a_data_server_closes_a_call() -> None:
    server, client = wire.ServerProtocol(lambda _: None, 1), wire.ClientProtocol()
    frame = client.hello(b"x")
    action = server.on_header(frame[:H])
    assert isinstance(action, wire.ReadHello)
    server.on_hello(action.request_id, frame[H:])
    refusal(server.on_header(client.call(PUT_START, b"", 0)[:H]), Reason.BAD_FRAME,
            "not to a data server")


def test_the_method_table_is_the_master_services() -> None:
    service = store_pb2.DESCRIPTOR.services_by_name["Master"]
    for name, (request, reply) in MESSAGES.items():
        method = service.methods_by_name[name]
        assert method.input_type.full_name == request.DESCRIPTOR.full_name, name
        assert method.output_type.full_name == reply.DESCRIPTOR.full_name, name
    assert set(METHODS.values()) == set(MESSAGES)


class SlowEndpoint:
    """An in-process call endpoint on a real socket, for one connection: it completes the
    handshake, then answers its n-th CALL after `delays[n]` seconds (a missing entry:
    never) with an empty CodesReply; with `reads=False` it reads nothing after the
    handshake."""

    def __init__(self, *delays: float, reads: bool = True) -> None:
        self.delays = list(delays)
        self.reads = reads
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        sock, _ = self.listener.accept()
        server = wire.CallServerProtocol(METHODS)
        with sock:
            while True:
                header = sock.recv(H, socket.MSG_WAITALL)
                if len(header) < H:
                    return
                action = server.on_header(header)
                body = sock.recv(action.count, socket.MSG_WAITALL) if action.count else b""
                if isinstance(action, wire.ReadHello):
                    reply = server.on_hello(action.request_id, body)
                    assert isinstance(reply, wire.Send)
                    sock.sendall(reply.reply)
                    if not self.reads:
                        self.stop.wait()
                        return
                    continue
                assert isinstance(action, wire.ReadCall)
                delay = self.delays.pop(0) if self.delays else None
                if self.stop.wait(delay):
                    return
                sock.sendall(wire.call_reply(action.request_id, 0))

    def close(self) -> None:
        self.stop.set()
        self.listener.close()
        self.thread.join(DEADLINE_S)


def call_exist_key(connection: CallConnection, deadline: float) -> bytes:
    return connection.call(METHOD_NUMBERS["ExistKey"], b"rid",
                           store_pb2.KeysRequest(keys=["k"]).SerializeToString(), deadline)


def test_a_call_nearer_its_deadline_than_the_socket_timeout_ends_at_its_deadline() -> None:
    """The connection's kernel timeout was set for a long deadline; a call with a short
    one sets it again and fails at its own deadline, not the long one."""
    endpoint = SlowEndpoint()  # never answers
    try:
        connection = CallConnection.open("127.0.0.1", endpoint.port, token=None,
                                         identity="t", deadline=time.monotonic() + DEADLINE_S)
        began = time.monotonic()
        with pytest.raises(TimeoutError, match="deadline"):
            call_exist_key(connection, began + 0.3)
        assert time.monotonic() - began < DEADLINE_S / 2  # not the connection's long timeout
        connection.close()
    finally:
        endpoint.close()


def test_a_master_that_stops_reading_fails_the_send_at_the_deadline_unsent() -> None:
    """A request larger than the socket buffers, to an endpoint that takes none of it:
    the send gives up at the call's deadline, as NotSent (never applied: safe to send
    again elsewhere)."""
    endpoint = SlowEndpoint(reads=False)
    try:
        connection = CallConnection.open("127.0.0.1", endpoint.port, token=None,
                                         identity="t", deadline=time.monotonic() + DEADLINE_S)
        began = time.monotonic()
        with pytest.raises(NotSent, match="deadline"):
            connection.call(METHOD_NUMBERS["ExistKey"], b"rid", bytes(32 * MiB), began + 0.5)
        assert time.monotonic() - began < DEADLINE_S / 2
        connection.close()
    finally:
        endpoint.close()


def test_a_socket_timeout_shorter_than_the_deadline_does_not_end_the_call() -> None:
    """A call with a short deadline leaves a short kernel timeout on the connection; the
    next call, with a long deadline, outwaits it and gets its late reply."""
    endpoint = SlowEndpoint(0.0, 1.5)
    try:
        connection = CallConnection.open("127.0.0.1", endpoint.port, token=None,
                                         identity="t", deadline=time.monotonic() + DEADLINE_S)
        assert call_exist_key(connection, time.monotonic() + 1.0) == b""
        assert call_exist_key(connection, time.monotonic() + DEADLINE_S) == b""
        connection.close()
    finally:
        endpoint.close()


def test_a_spinning_call_takes_a_quick_reply_and_still_waits_for_a_late_one() -> None:
    """A lone call polls for its reply a while before blocking (store_rpc.SPIN_S): a
    reply that comes within the spin and one that comes long after it both arrive."""
    endpoint = SlowEndpoint(0.0, 0.5)
    try:
        connection = CallConnection.open("127.0.0.1", endpoint.port, token=None,
                                         identity="t", deadline=time.monotonic() + DEADLINE_S)
        for _ in range(2):
            reply = connection.call(METHOD_NUMBERS["ExistKey"], b"rid",
                                    store_pb2.KeysRequest(keys=["k"]).SerializeToString(),
                                    time.monotonic() + DEADLINE_S, spin_s=0.01)
            assert reply == b""
        connection.close()
    finally:
        endpoint.close()


def test_a_spin_longer_than_the_deadline_ends_at_the_deadline() -> None:
    endpoint = SlowEndpoint()  # never answers
    try:
        connection = CallConnection.open("127.0.0.1", endpoint.port, token=None,
                                         identity="t", deadline=time.monotonic() + DEADLINE_S)
        with pytest.raises(TimeoutError, match="deadline"):
            connection.call(METHOD_NUMBERS["ExistKey"], b"rid", b"",
                            time.monotonic() + 0.3, spin_s=DEADLINE_S)
        connection.close()
    finally:
        endpoint.close()


def test_a_spinning_receive_sees_data_and_the_end_of_the_stream() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        io = DeadlineSocket(ours)
        buffer = memoryview(bytearray(16))
        theirs.sendall(b"abc")
        assert io.recv_spinning(buffer, time.monotonic() + DEADLINE_S, 1.0) == 3
        assert bytes(buffer[:3]) == b"abc"
        theirs.shutdown(socket.SHUT_WR)
        with pytest.raises(ConnectionResetError, match="closed"):
            io.recv_spinning(buffer, time.monotonic() + DEADLINE_S, 1.0)


@pytest.mark.parametrize("value", ["soon", "-1", "20000", "1.5"])
def test_a_bad_spin_setting_is_refused_naming_the_variable(value: str) -> None:
    with pytest.raises(errors.ConfigError, match="HIXL_CALL_SPIN_US.*got"):
        store_rpc.spin_from_env({"HIXL_CALL_SPIN_US": value})
    assert store_rpc.spin_from_env({"HIXL_CALL_SPIN_US": "0"}) == 0.0


def test_only_a_lone_call_with_quick_replies_spins(monkeypatch: pytest.MonkeyPatch) -> None:
    """Concurrent callers block (spinning threads would take the CPU the master needs),
    and so do callers whose replies take longer than the spin (a far master)."""
    monkeypatch.setattr(store_rpc, "SPIN_S", 0.001)
    calls = store_rpc._InFlight()
    assert calls.enter() == 0.001        # alone: spins
    assert calls.enter() == 0.0          # a second one in flight: blocks
    calls.leave(0.0002)
    calls.leave(0.0002)
    for _ in range(4):                   # replies slower than the spin: stop spinning
        calls.enter()
        calls.leave(0.5)
    assert calls.typical_s > 0.001
    assert calls.enter() == 0.0
    calls.leave(0.0001)
    for _ in range(32):                  # quick replies again: spin again
        calls.enter()
        calls.leave(0.0001)
    assert calls.count == 0 and calls.enter() == 0.001
    calls.leave(0.0001)


def _exist_key_calls(server: StoreCallServer, count: int) -> list[bytes]:
    connection = CallConnection.open("127.0.0.1", server.port, token=None, identity="t",
                                     deadline=time.monotonic() + DEADLINE_S)
    try:
        return [call_exist_key(connection, time.monotonic() + DEADLINE_S)
                for _ in range(count)]
    finally:
        connection.close()


def test_the_endpoint_polls_for_back_to_back_calls_and_serves_every_other_call() -> None:
    """In-process (a real server on real sockets): after answering, a connection polls a
    while for its client's next call (--call-spin-us), one connection at a time. Calls
    back to back, a call after a pause longer than the poll, calls on connections that
    run at once and a client that hangs up while it is polled are all served or closed
    as before; with spin_us=0 nothing is polled."""
    exist = store_pb2.CodesReply(codes=[ErrorCode.OBJECT_NOT_FOUND]).SerializeToString()
    server = StoreCallServer(StoreCalls(ObjectStore()), spin_us=10_000)  # the most allowed
    server.start()
    try:
        connection = CallConnection.open("127.0.0.1", server.port, token=None, identity="t",
                                         deadline=time.monotonic() + DEADLINE_S)
        assert [call_exist_key(connection, time.monotonic() + DEADLINE_S)
                for _ in range(50)] == [exist] * 50
        if server._spin_s:  # a host with one CPU never polls
            assert server.counters["calls_polled"] >= 1
        time.sleep(0.05)  # a pause past the poll: the connection blocked meanwhile
        assert call_exist_key(connection, time.monotonic() + DEADLINE_S) == exist
        connection.close()  # hung up while its connection polls
        results: list[list[bytes]] = []
        threads = [threading.Thread(target=lambda: results.append(_exist_key_calls(server, 30)))
                   for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(DEADLINE_S)
        assert results == [[exist] * 30] * 3
        assert server.counters["calls"] == 50 + 1 + 90
    finally:
        server.stop()
    quiet = StoreCallServer(StoreCalls(ObjectStore()), spin_us=0)
    quiet.start()
    try:
        assert _exist_key_calls(quiet, 20) == [exist] * 20
        assert quiet.counters["calls_polled"] == 0
    finally:
        quiet.stop()


def test_the_clients_back_off_asks_once_and_never_hammers_a_dead_port() -> None:
    closed_port = free_port()
    path = FastPath("127.0.0.1", None, "test")
    message = store_pb2.KeysRequest(keys=["k"]).SerializeToString()
    assert path.should_probe() and path.port is None          # never heard of one: ask
    path.advertised(0)                                        # the master has none ...
    assert not path.should_probe()                            # ... ask again only later
    path.advertised(0)
    assert not path.should_probe()
    path.advertised(closed_port)                              # a port: tried at once
    assert path.call("ExistKey", message, time.monotonic() + DEADLINE_S) is None
    assert path.port is None and not path.should_probe()      # refused: gRPC for a while
    path.advertised(closed_port)                              # the same port again (a
    assert path.port == closed_port                           # heartbeat): no new attempt
    assert path.call("ExistKey", message, time.monotonic() + DEADLINE_S) is None
    assert path.port == closed_port  # not tried (a failed attempt would have dropped it)
    assert path.calls == 0
    path.close()


# ---------------------------------------------------------------- a real hixl-master


@pytest.fixture
def master() -> Iterator[MasterProcess]:
    with MasterProcess(extra=["--no-persist"]) as process:
        yield process


eventually = partial(waiting.wait_until, timeout=DEADLINE_S)


def answers(call: Callable[[], object]) -> bool:
    try:
        call()
    except MasterUnavailable:
        return False
    return True


def freeze(pid: int) -> None:
    """SIGSTOP `pid` and wait until every thread of it has stopped (a thread already
    running could otherwise still answer a call sent just after the signal)."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/stat", encoding="ascii") as f:
                states.append(f.read().rpartition(")")[2].split()[0])
        return all(state in "tT" for state in states)

    eventually(stopped, f"every thread of {pid} stopped")


def test_values_move_byte_for_byte_over_the_call_endpoint(master: MasterProcess) -> None:
    holder = HolderProcess("hixl", master.target, "127.0.0.1", 64 * MiB)
    store = MooncakeDistributedStore(master_timeout=DEADLINE_S)
    try:
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MiB, "tcp", "",
                           master.target) == 0
        rng = np.random.default_rng(7)
        sizes = [1, 4095, 64 << 10, 3 * MiB + 5]
        values = {f"v-{n}": rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes}
        for key, value in values.items():
            assert store.put(key, value) == 0
        source = np.frombuffer(bytearray(rng.integers(0, 256, 2 * MiB, dtype=np.uint8)),
                               dtype=np.uint8)
        sink = np.zeros(2 * MiB, dtype=np.uint8)
        for buffer in (source, sink):
            assert store.register_buffer(buffer.ctypes.data, buffer.nbytes) == 0
        assert store.batch_put_from(["f-0", "f-1"], [source.ctypes.data,
                                                     source.ctypes.data + MiB], [MiB, MiB]) == [0, 0]
        for key, value in values.items():
            assert store.get(key) == value, key
            assert store.get_size(key) == len(value)
        assert store.batch_get_into(["f-0", "f-1"], [sink.ctypes.data + MiB, sink.ctypes.data],
                                    [MiB, MiB]) == [MiB, MiB]
        assert bytes(sink[:MiB]) == bytes(source[MiB:])
        assert bytes(sink[MiB:]) == bytes(source[:MiB])
        assert store.batch_is_exist([*values, "missing"]) == [1] * len(values) + [0]
        assert store.remove("v-1", force=True) == 0  # read-leased by the gets
        assert store.get_into("v-1", sink.ctypes.data, MiB) == ErrorCode.OBJECT_NOT_FOUND
        master_client = store._master
        assert master_client is not None and master_client.fast_port is not None
        space = store._space
        assert space is not None and space.commits == len(values) - 1 + 2
        # every one of those hot calls went over the endpoint, none over gRPC: the puts'
        # Reserve and Commit calls (one round trip per put, docs/store.md), PutStart and
        # PutEnd for the 3 MiB value (over a quarter of a reservation: two-phase),
        # GetReplicas and GetSize per get, 2 batches, exist, remove, get_into
        assert master_client.fast_calls == space.calls + 2 + 2 * len(values) + 4
    finally:
        store.close()
        holder.stop()


def test_both_front_ends_feed_the_same_results(tmp_path: object) -> None:
    port = free_port()
    with MasterProcess(extra=["--no-persist", "--metrics-port", str(port)]) as process, \
            MasterClient(process.target, timeout=DEADLINE_S) as fast, \
            MasterClient(process.target, timeout=DEADLINE_S, fast=False) as slow:
        assert fast.mount_segment(StoreSegment("e", 1, 1, 0x10_0000, MiB, "n")).code == 0
        for client, key in ((fast, "by-fast"), (slow, "by-grpc")):
            started = client.put_start(key, 100)
            assert client.put_end(key, started.put_id) == ErrorCode.OK
            assert client.exist_key("nope") == ErrorCode.OBJECT_NOT_FOUND
        assert (fast.fast_calls, slow.fast_calls) == (3, 0)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                    timeout=DEADLINE_S) as reply:
            samples = {(s.name, frozenset(s.labels.items())): s.value
                       for family in text_string_to_metric_families(reply.read().decode())
                       for s in family.samples}

    def count(method: str, code: str) -> float:
        return samples[("hixl_store_results_total",
                        frozenset({"method": method, "code": code}.items()))]

    assert count("PutStart", "OK") == 2 and count("PutEnd", "OK") == 2
    assert count("ExistKey", "OBJECT_NOT_FOUND") == 2


def test_a_master_without_the_endpoint_is_served_over_grpc() -> None:
    with MasterProcess(extra=["--no-persist", "--fast-port", "-1"]) as process, \
            MasterClient(process.target, timeout=DEADLINE_S) as client:
        assert client.mount_segment(StoreSegment("e", 1, 1, 0x10_0000, MiB, "n")).code == 0
        started = client.put_start("k", 10)
        assert client.put_end("k", started.put_id) == ErrorCode.OK
        assert client.get_replicas("k").size == 10
        assert (client.fast_calls, client.fast_port) == (0, None)


def test_an_unreachable_endpoint_falls_back_to_grpc_then_comes_back(
        master: MasterProcess) -> None:
    closed_port = free_port()
    with MasterClient(master.target, timeout=UNREACHABLE_DEADLINE_S) as client:
        assert client.exist_key("k") == ErrorCode.OBJECT_NOT_FOUND  # probes, then the endpoint
        assert client.fast_calls == 1
        # as if the master had advertised a port nobody can reach (filtered, or gone)
        client._advertised(closed_port)
        assert client.exist_key("k") == ErrorCode.OBJECT_NOT_FOUND  # over gRPC
        assert client.fast_calls == 1
        # after its back-off the client asks the master again and is back on the endpoint
        eventually(lambda: client.exist_key("k") == ErrorCode.OBJECT_NOT_FOUND
                   and client.fast_calls > 1, "the call endpoint is used again")


def test_a_master_killed_mid_call_fails_it_with_rpc_fail(master: MasterProcess) -> None:
    store = MooncakeDistributedStore(master_timeout=UNREACHABLE_DEADLINE_S)
    try:
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", 0, MiB, "tcp", "", master.target) == 0
        assert store.get_size("k") == ErrorCode.OBJECT_NOT_FOUND
        assert store._master is not None and store._master.fast_calls == 1
        freeze(master.proc.pid)  # the next call waits for an answer ...
        outcome: list[int] = []
        caller = threading.Thread(target=lambda: outcome.append(store.get_size("k")))
        caller.start()
        time.sleep(0.2)  # (most likely) sent, and waiting
        master.kill()     # ... that never comes
        caller.join(DEADLINE_S)
        assert not caller.is_alive() and outcome == [ErrorCode.RPC_FAIL]
        assert store.get_size("k") == ErrorCode.RPC_FAIL   # and at once while it is gone
        assert store.is_exist("k") == -1
    finally:
        store.close()


def test_a_hung_master_fails_the_call_within_its_deadline(master: MasterProcess) -> None:
    with MasterClient(master.target, timeout=DEADLINE_S) as client:
        assert client.exist_key("k") == ErrorCode.OBJECT_NOT_FOUND
        freeze(master.proc.pid)
        try:
            with pytest.raises(MasterUnavailable, match="deadline") as caught:
                client.exist_key("k", timeout=0.3)
            assert caught.value.code == ErrorCode.RPC_FAIL
        finally:
            os.kill(master.proc.pid, signal.SIGCONT)
        # the connection that timed out is gone; the next call takes a new one
        assert client.exist_key("k") == ErrorCode.OBJECT_NOT_FOUND


def test_calls_work_again_after_a_master_restart_without_a_new_client() -> None:
    first = MasterProcess(extra=["--no-persist"])
    second = None
    try:
        client = MasterClient(first.target, timeout=UNREACHABLE_DEADLINE_S)
        assert client.mount_segment(StoreSegment("e", 1, 1, 0x10_0000, MiB, "n")).code == 0
        started = client.put_start("k", 10)
        assert client.put_end("k", started.put_id) == ErrorCode.OK
        before, old_port = client.fast_calls, client.fast_port
        assert before == 2 and old_port is not None
        first.kill()
        with pytest.raises(MasterUnavailable):
            client.exist_key("k")
        second = MasterProcess(first.port, extra=["--no-persist"])  # a new endpoint port
        eventually(lambda: answers(lambda: client.exist_key("k")), "the master answers")
        assert client.exist_key("k") == ErrorCode.OBJECT_NOT_FOUND  # a new, empty master
        eventually(lambda: client.exist_key("k") == ErrorCode.OBJECT_NOT_FOUND
                   and client.fast_calls > before, "the new call endpoint is used")
        assert client.fast_port is not None  # the restarted master's, learned by a probe
        client.close()
    finally:
        if second is not None:
            second.close()
        first.close()


def test_a_wrong_token_is_refused_before_any_request(tmp_path: object) -> None:
    token_file = os.path.join(str(tmp_path), "token")
    with open(token_file, "wb") as f:
        f.write(TOKEN)
    os.chmod(token_file, 0o600)
    with MasterProcess(extra=["--no-persist", "--cluster-token-file", token_file]) as process, \
            MasterClient(process.target, timeout=DEADLINE_S, cluster_token=TOKEN) as member:
        assert member.exist_key("k") == ErrorCode.OBJECT_NOT_FOUND
        assert member.fast_calls == 1
        port = member.fast_port
        assert port is not None
        deadline = time.monotonic() + DEADLINE_S
        with pytest.raises(errors.AuthenticationFailed, match="wrong cluster token"):
            CallConnection.open("127.0.0.1", port, token=b"not-the-token", identity="x",
                                deadline=deadline)
        with pytest.raises(errors.AuthenticationFailed, match="requires a cluster token"):
            CallConnection.open("127.0.0.1", port, token=None, identity="x", deadline=deadline)
        # a CALL with no handshake at all: refused and closed, nothing started
        request = store_pb2.PutStartRequest(client_id="intruder", items=[
            store_pb2.PutStartItem(key="planted", value_length=10)]).SerializeToString()
        with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE_S) as raw:
            raw.sendall(wire.ClientProtocol().call(PUT_START, b"", len(request)) + request)
            data = b""
            while chunk := raw.recv(65536):
                data += chunk
        header = wire.decode_header(data[:H])
        assert header.reason == Reason.NOT_AUTHENTICATED
        assert member.stats()["puts_in_progress"] == 0
        assert member.exist_key("planted") == ErrorCode.OBJECT_NOT_FOUND
        with MasterClient(process.target, timeout=DEADLINE_S,
                          cluster_token=b"not-the-token") as outsider, \
                pytest.raises(MasterAuthenticationFailed):
            outsider.exist_key("k")


def test_a_failed_call_names_its_request_id_on_both_sides(master: MasterProcess) -> None:
    with MasterClient(master.target, timeout=DEADLINE_S) as client:
        client.heartbeat()
        port = client.fast_port
    assert port is not None
    path = FastPath("127.0.0.1", None, "test")
    path.advertised(port)
    try:
        with request_context("rid-store-42"), pytest.raises(CallFailed) as caught:
            path.call("PutStart", b"\xff\xff\xff", time.monotonic() + DEADLINE_S)
        assert "PutStart" in str(caught.value) and "(request rid-store-42)" in str(caught.value)
        # the connection survives a failed call
        reply = path.call("ExistKey", store_pb2.KeysRequest(keys=["k"]).SerializeToString(),
                          time.monotonic() + DEADLINE_S)
        assert reply is not None and list(store_pb2.CodesReply.FromString(reply).codes) == [
            ErrorCode.OBJECT_NOT_FOUND]
    finally:
        path.close()
    eventually(lambda: "[rid-store-42]" in master.log(), "the master logs the request id")
