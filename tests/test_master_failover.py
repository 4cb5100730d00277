"""Clients and agents fail over across several master addresses (issue 8, hixl.failover).

Real processes: two independent in-memory hixl-masters (they share no state yet, which
is fine for testing client behaviour), real hixl-agent processes, real engines and store
clients. "Not the leader" is answered by tiny real servers in this file (a grpc.server
that refuses every call with UNAVAILABLE/FAILED_PRECONDITION and `hixl-leader` metadata,
and a store call endpoint speaking the real wire codec), since no master sends it yet.
Deadlines only prove "does not hang"; nothing here measures time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import grpc
import pytest
import waiting
from conftest import AgentProcess

from hixl import Engine, wire
from hixl.client.global_table import GlobalTable
from hixl.client.mooncake import MooncakeDistributedStore
from hixl.client.store_client import MasterClient
from hixl.errors import ConfigError, HixlError, NotConnected, ParamInvalid
from hixl.failover import (
    NOT_LEADER_CODE,
    Endpoints,
    NotLeader,
    TryNext,
    not_leader_metadata,
    parse_addresses,
)
from hixl.processes import free_port
from hixl.registry_client import RegistryClient
from hixl.server.agent.config import AgentConfig
from hixl.store_codes import ErrorCode
from hixl.store_rpc import METHODS, CallConnection, FastPath
from hixl.store_types import MasterNotLeader, MasterRpcError, MasterUnavailable, StoreSegment
from hixl.tools.cli import main
from hixl.tools.daemons import MasterProcess
from hixl.v1 import store_pb2

StartAgent = Callable[..., AgentProcess]

MiB = 1 << 20
#: the longest any wait here may take (far beyond what a healthy run needs)
DEADLINE_S = 20.0
#: a lease short enough that a lost one is noticed within the test
LEASE_MS = 1500


def dead_address() -> str:
    return f"127.0.0.1:{free_port()}"


wait_until = partial(waiting.wait_until, timeout=DEADLINE_S)


def segment(engine: str = "holder:1") -> StoreSegment:
    return StoreSegment(engine, 1, 1, 0x10_0000, 4 * MiB, "node-a")


@pytest.fixture
def masters() -> Iterator[tuple[MasterProcess, MasterProcess]]:
    with MasterProcess() as first, MasterProcess() as second:
        yield first, second


@pytest.fixture(autouse=True)
def no_token_from_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HIXL_CLUSTER_TOKEN", raising=False)
    monkeypatch.delenv("HIXL_CLUSTER_TOKEN_FILE", raising=False)
    monkeypatch.delenv("HIXL_REGISTRY", raising=False)


# ---------------------------------------------------------------- tiny standby masters


class GrpcStandby:
    """A real gRPC server that answers every Master and Registry call "not the leader":
    `code` with trailing metadata hixl-leader: `leader`. With `fast_port`, Heartbeat is
    answered (naming that store call endpoint port) so a client goes on to the endpoint."""

    def __init__(self, leader: str, code: grpc.StatusCode = NOT_LEADER_CODE,
                 fast_port: int | None = None) -> None:
        self.leader = leader
        self.code = code
        self.fast_port = fast_port
        self.calls: list[str] = []
        self._server = grpc.server(ThreadPoolExecutor(max_workers=4))
        self._server.add_generic_rpc_handlers((_Handler(self),))
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.target = f"127.0.0.1:{port}"
        self._server.start()

    def refuse(self, name: str, context: grpc.ServicerContext) -> None:
        self.calls.append(name)
        context.set_trailing_metadata(not_leader_metadata(self.leader))
        context.abort(self.code, "not the leader")

    def close(self) -> None:
        self._server.stop(0).wait(DEADLINE_S)

    def __enter__(self) -> GrpcStandby:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Handler(grpc.GenericRpcHandler):
    def __init__(self, standby: GrpcStandby) -> None:
        self._standby = standby

    def service(self, details: Any) -> grpc.RpcMethodHandler:
        standby = self._standby
        name = details.method.rsplit("/", 1)[-1]
        if name == "Heartbeat" and standby.fast_port is not None:
            reply = store_pb2.HeartbeatReply(fast_port=standby.fast_port).SerializeToString()
            return grpc.unary_unary_rpc_method_handler(lambda request, context: reply)

        def refuse(request: bytes, context: grpc.ServicerContext) -> bytes:
            standby.refuse(name, context)
            return b""

        def refuse_stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
            standby.refuse(name, context)
            yield b""

        if name == "Watch":
            return grpc.unary_stream_rpc_method_handler(refuse_stream)
        return grpc.unary_unary_rpc_method_handler(refuse)


class CallEndpointStandby:
    """A store call endpoint (the real wire codec, HELLO then CALLs) that answers every
    CALL with reason NOT_LEADER naming `leader`; counts the calls it refused."""

    def __init__(self, leader: str) -> None:
        self.leader = leader
        self.refused = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        self._listener.settimeout(0.1)
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        proto = wire.CallServerProtocol(METHODS)
        sock.settimeout(DEADLINE_S)
        with sock, contextlib.suppress(OSError):
            while True:
                action = proto.on_header(_read(sock, wire.HEADER_SIZE))
                if isinstance(action, wire.ReadHello):
                    action = proto.on_hello(action.request_id, _read(sock, action.count))
                    assert isinstance(action, wire.Send)
                    sock.sendall(action.reply)
                elif isinstance(action, wire.ReadCall):
                    _read(sock, action.count)
                    self.refused += 1
                    sock.sendall(wire.error_reply(action.request_id, wire.Reason.NOT_LEADER,
                                                  self.leader))
                else:
                    return

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        self._thread.join(DEADLINE_S)


def _read(sock: socket.socket, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        if not chunk:
            raise ConnectionResetError("peer closed")
        data += chunk
    return bytes(data)


# ---------------------------------------------------------------- addresses


@pytest.mark.parametrize(("value", "bad"), [
    ("127.0.0.1:1,nohost", "'nohost'"),
    ("127.0.0.1:1,,127.0.0.1:2", "entry 2 is empty"),
    ("127.0.0.1:1,h:0", "'h:0'"),
    ("127.0.0.1:1,h:99999", "'h:99999'"),
    ("::1:50051", "brackets"),
    ("etcd://h:2379", "scheme"),
    (["127.0.0.1:1", "h:port"], "'h:port'"),
    ("", "entry 1 is empty"),
    ([], "at least one"),
])
def test_bad_address_lists_are_typed_errors_naming_the_entry(value: Any, bad: str) -> None:
    with pytest.raises(ParamInvalid, match=bad):
        parse_addresses(value)
    with pytest.raises(ParamInvalid, match=bad):
        MasterClient(value)
    with pytest.raises(ParamInvalid, match=bad):
        RegistryClient(value)
    with pytest.raises(ParamInvalid, match=bad):
        GlobalTable(value)


def test_address_lists_parse_in_order_without_duplicates() -> None:
    assert parse_addresses(" a:1 , [::1]:2,a:1,b-2.example:0003") == (
        "a:1", "[::1]:2", "b-2.example:3")
    assert parse_addresses(["a:1", "b:2"]) == ("a:1", "b:2")
    with MasterClient("127.0.0.1:7, 127.0.0.1:8") as client:
        assert client.target == "127.0.0.1:7,127.0.0.1:8" and client.current == "127.0.0.1:7"


def test_the_agent_config_takes_one_master_or_a_list() -> None:
    assert AgentConfig.load(None, {"master": "10.0.0.1:50051"}, {}).master == "10.0.0.1:50051"
    assert AgentConfig.load(None, {}, {"HIXL_AGENT_MASTER": "a:1, b:2"}).master == "a:1,b:2"
    assert AgentConfig.load(None, {"master": ""}, {}).master == ""
    with pytest.raises(ConfigError, match=r"key 'master'.*'b'"):
        AgentConfig.load(None, {"master": "a:1,b"}, {})


def test_the_admin_commands_take_master_lists(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["keys", "--master", "127.0.0.1:1,oops"])
    assert exited.value.code == 2 and "'oops'" in capsys.readouterr().err


# ---------------------------------------------------------------- MasterClient


def test_calls_go_to_the_first_master_then_fail_over_when_it_is_killed(
        masters: tuple[MasterProcess, MasterProcess]) -> None:
    a, b = masters
    with MasterClient([a.target, b.target], timeout=DEADLINE_S) as client, \
            MasterClient(b.target, timeout=DEADLINE_S) as at_b:
        assert client.mount_segment(segment()).code == ErrorCode.OK
        started = client.put_start("only-at-a", 100)
        assert started.code == ErrorCode.OK
        assert client.put_end("only-at-a", started.put_id) == ErrorCode.OK
        assert client.exist_key("only-at-a") == ErrorCode.OK and client.current == a.target
        assert at_b.list_segments() == []  # nothing went to B

        a.kill()
        # idempotent calls move to B within their deadline and succeed there
        assert client.exist_key("only-at-a") == ErrorCode.OBJECT_NOT_FOUND  # B's answer
        assert client.current == b.target
        assert client.heartbeat().status.name == "NEED_REMOUNT"  # B never saw this client
        assert client.mount_segment(segment()).code == ErrorCode.OK
        assert [m.client_id for m in at_b.list_segments()] == [client.client_id]
        started = client.put_start("at-b", 100)
        assert started.code == ErrorCode.OK
        assert client.put_end("at-b", started.put_id) == ErrorCode.OK
        assert at_b.exist_key("at-b") == ErrorCode.OK


def test_a_dead_first_address_costs_the_first_call_nothing(
        masters: tuple[MasterProcess, MasterProcess]) -> None:
    _, b = masters
    with MasterClient(f"{dead_address()},{b.target}", timeout=DEADLINE_S) as client:
        assert client.exist_key("k") == ErrorCode.OBJECT_NOT_FOUND
        assert client.current == b.target
        # non-idempotent too: a refused connection proves the request never left
    with MasterClient([dead_address(), b.target], timeout=DEADLINE_S) as client:
        assert client.remove("k") == ErrorCode.OBJECT_NOT_FOUND
    with RegistryClient(f"{dead_address()},{b.target}", timeout=DEADLINE_S) as registry:
        assert registry.query() == []
        assert registry.current == b.target


def test_every_master_down_fails_at_once_with_rpc_fail() -> None:
    with MasterClient([dead_address(), dead_address()], timeout=DEADLINE_S) as client:
        with pytest.raises(MasterUnavailable) as info:
            client.exist_key("k")
        assert info.value.code == ErrorCode.RPC_FAIL
        with pytest.raises(MasterUnavailable):
            client.put_end("k", 1)


def _all_stopped(pid: int) -> bool:
    """True when every thread of process `pid` is stopped (state T)."""
    states = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError), \
                open(f"/proc/{pid}/task/{task}/stat", encoding="ascii") as f:
            states.append(f.read().rsplit(")", 1)[1].split()[0])
    return bool(states) and all(state == "T" for state in states)


def _rx_queued(port: int) -> bool:
    """True when an established TCP connection to local `port` holds unread bytes (the
    master, stopped, has a request it has not read)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table, encoding="ascii") as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                local_port = int(fields[1].rsplit(":", 1)[1], 16)
                rx_queue = int(fields[4].split(":")[1], 16)
                if local_port == port and fields[3] == "01" and rx_queue > 0:
                    return True
    return False


@pytest.mark.parametrize("fast", [True, False], ids=["call-endpoint", "grpc"])
def test_a_put_end_sent_to_a_master_that_died_fails_with_rpc_fail(
        masters: tuple[MasterProcess, MasterProcess], fast: bool) -> None:
    a, b = masters
    with MasterClient([a.target, b.target], timeout=DEADLINE_S, fast=fast) as client:
        assert client.mount_segment(segment()).code == ErrorCode.OK
        started = client.put_start("k", 100)
        assert started.code == ErrorCode.OK
        port = client.fast_port if fast else a.port
        assert port
        if fast:  # else the PutEnd below goes over gRPC too (the endpoint backed off)
            assert client.fast_calls >= 1, "put_start did not go over the call endpoint"
        # A has read all it was sent (so the bytes waiting below can only be the PutEnd)
        wait_until(lambda: not _rx_queued(port), "master A to read what it was sent")
        a.proc.send_signal(signal.SIGSTOP)  # A takes the request but never reads it
        # SIGSTOP is delivered asynchronously: a thread of A still running could read the
        # PutEnd below (and the test would wait for it in vain): wait until all stopped
        wait_until(lambda: _all_stopped(a.proc.pid), "master A to stop")
        outcome: dict[str, Any] = {}

        def put_end() -> None:
            try:
                outcome["codes"] = client.put_end("k", started.put_id)
            except HixlError as exc:
                outcome["error"] = exc

        caller = threading.Thread(target=put_end)
        caller.start()
        try:
            wait_until(lambda: _rx_queued(port), "the PutEnd request to reach master A")
        finally:
            a.kill()  # SIGKILL: A dies with the request unread
        caller.join(DEADLINE_S)
        assert not caller.is_alive(), "put_end hung"
        # never reported done, never repeated at B (B would have answered with a code)
        assert "codes" not in outcome, outcome
        assert isinstance(outcome["error"], MasterRpcError)
        assert outcome["error"].code == ErrorCode.RPC_FAIL
        # it says what happened, not a TLS guess (the connection was up)
        assert "TLS" not in str(outcome["error"]), outcome["error"]
        # the next calls go to B
        assert client.exist_key("k") == ErrorCode.OBJECT_NOT_FOUND
        assert client.current == b.target


# ---------------------------------------------------------------- "not the leader"


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE,
                                  grpc.StatusCode.FAILED_PRECONDITION])
def test_a_not_leader_answer_over_grpc_sends_the_client_to_the_leader_it_names(
        masters: tuple[MasterProcess, MasterProcess], code: grpc.StatusCode) -> None:
    _, b = masters
    with GrpcStandby(b.target, code) as standby, GrpcStandby("", code) as bystander:
        # the list runs standby, bystander, B: only following the hint skips the bystander
        with MasterClient([standby.target, bystander.target, b.target],
                          timeout=DEADLINE_S) as client:
            assert client.remove("k") == ErrorCode.OBJECT_NOT_FOUND  # not idempotent: fine
            assert client.current == b.target
            assert standby.calls and not bystander.calls
        # a leader missing from the list is added and followed
        with MasterClient(standby.target, timeout=DEADLINE_S) as client:
            assert client.exist_key("k") == ErrorCode.OBJECT_NOT_FOUND
            assert client.endpoints.addresses == (standby.target, b.target)
        # the registry and the watch follow the hint too
        with RegistryClient([standby.target, bystander.target, b.target],
                            timeout=DEADLINE_S) as registry:
            assert registry.query_engines() == [] and registry.current == b.target
        with GlobalTable([standby.target, bystander.target, b.target]) as table:
            assert table.wait_synced(DEADLINE_S) and table.current == b.target
        assert "Watch" in standby.calls and not bystander.calls


def test_standbys_that_know_no_leader_end_the_call_at_its_deadline() -> None:
    with GrpcStandby("") as first, GrpcStandby("") as second, \
            MasterClient([first.target, second.target], timeout=2.0) as client:
        with pytest.raises(MasterNotLeader) as info:
            client.exist_key("k")  # round after round until the deadline, no hang
        assert info.value.code == ErrorCode.RPC_FAIL and info.value.leader == ""
        assert "ExistKey" in first.calls and "ExistKey" in second.calls


def test_not_leader_on_the_store_call_endpoint_through_the_real_codec(
        masters: tuple[MasterProcess, MasterProcess]) -> None:
    _, b = masters
    endpoint = CallEndpointStandby(b.target)
    try:
        # the codec: the reason and the leader's address reach the client intact
        connection = CallConnection.open("127.0.0.1", endpoint.port, token=None,
                                         identity="pytest",
                                         deadline=time.monotonic() + DEADLINE_S)
        try:
            with pytest.raises(NotLeader) as info:
                connection.call(5, b"rid", store_pb2.KeysRequest(keys=["k"]).SerializeToString(),
                                time.monotonic() + DEADLINE_S)
            assert info.value.leader == b.target
            assert not connection.stale()  # the connection stays usable
        finally:
            connection.close()
        fast = FastPath("127.0.0.1", None, "pytest")
        fast.advertised(endpoint.port)
        with pytest.raises(NotLeader):
            fast.call("PutEnd", b"", time.monotonic() + DEADLINE_S)
        fast.close()
        # a client whose standby advertises that endpoint follows the hint to B, even
        # with a non-idempotent call (a NOT_LEADER call was not applied)
        with GrpcStandby(b.target, fast_port=endpoint.port) as standby, \
                MasterClient([standby.target, b.target], timeout=DEADLINE_S) as client:
            assert client.remove("k") == ErrorCode.OBJECT_NOT_FOUND
            assert client.current == b.target and endpoint.refused == 3
            assert "Remove" not in standby.calls  # refused by the endpoint, not by gRPC
    finally:
        endpoint.close()


def test_the_retry_policy_repeats_only_what_is_safe() -> None:
    """The policy itself, with attempts standing in for masters."""
    endpoints = Endpoints("127.0.0.1:1,127.0.0.1:2")
    seen: list[str] = []

    def maybe_delivered(address: str, deadline: float) -> str:
        seen.append(address)
        if address.endswith(":1"):
            raise TryNext(MasterUnavailable("reset after sending"), sent=True)
        return address

    with pytest.raises(MasterUnavailable, match="reset after sending"):
        endpoints.call(maybe_delivered, timeout=DEADLINE_S, idempotent=False)
    assert seen == ["127.0.0.1:1"] and endpoints.current() == "127.0.0.1:2"
    endpoints.failed("127.0.0.1:2")
    assert endpoints.call(maybe_delivered, timeout=DEADLINE_S, idempotent=True) == "127.0.0.1:2"
    endpoints.failed("127.0.0.1:2", leader="127.0.0.1:1")  # a hint moves straight there
    assert endpoints.current() == "127.0.0.1:1"
    endpoints.failed("127.0.0.1:2")  # a stale report (another caller moved on) moves nothing
    assert endpoints.current() == "127.0.0.1:1"


# ---------------------------------------------------------------- agents and engines


def test_an_agent_republishes_at_the_next_master_and_engines_resync_from_it(
        masters: tuple[MasterProcess, MasterProcess], agent_process: StartAgent) -> None:
    a, b = masters
    agent = agent_process(config={"master": f"{a.target},{b.target}",
                                  "lease_ttl_ms": LEASE_MS,
                                  "pool": [{"size": "1MiB", "name": "kv-pool"}]})
    with RegistryClient(a.target, timeout=DEADLINE_S) as at_a, \
            RegistryClient(b.target, timeout=DEADLINE_S) as at_b, \
            Engine("127.0.0.1", registry=f"{a.target},{b.target}") as engine:
        wait_until(lambda: len(at_a.query(agent.engine)) == 1, "the agent's segment at A")
        assert at_b.query(agent.engine) == []  # published at A only
        table = engine.global_table
        assert table is not None
        assert table.wait_for(lambda t: len(t.segments(agent.engine)) == 1, DEADLINE_S)
        before = table.segments(agent.engine)
        resyncs = table.resyncs

        a.kill()
        wait_until(lambda: at_b.query(agent.engine) == before,
                   "the agent's segment at B (within the lease ttl and a retry)")
        assert table.wait_for(lambda t: t.resyncs > resyncs and t.synced
                              and t.segments(agent.engine) == before, DEADLINE_S)
        assert table.current == b.target
        assert agent.engine in engine.engines()


def test_a_lease_is_renewed_only_where_it_was_granted(
        masters: tuple[MasterProcess, MasterProcess]) -> None:
    a, b = masters
    with RegistryClient([a.target, b.target], timeout=DEADLINE_S) as registry, \
            RegistryClient(b.target, timeout=DEADLINE_S) as at_b:
        at_b.publish("other:1", "node-b", 1, [], 60_000)
        lease = registry.publish("mine:1", "node-a", 1, [], 60_000)
        a.kill()
        # B could hold a lease of that number (each master numbers its own): the client
        # never sends the renewal there
        with pytest.raises(NotConnected, match=f"granted by registry {a.target}.*publish again"):
            registry.keepalive(lease)
        assert registry.current == b.target
        assert registry.publish("mine:1", "node-a", 1, [], 60_000) != lease
        assert {e.engine for e in at_b.query_engines()} == {"other:1", "mine:1"}


# ---------------------------------------------------------------- the Mooncake store


def test_the_store_sets_up_past_a_dead_master_and_fails_when_all_are(
        masters: tuple[MasterProcess, MasterProcess]) -> None:
    _, b = masters
    store = MooncakeDistributedStore(setup_timeout=DEADLINE_S)
    listed = MooncakeDistributedStore(setup_timeout=DEADLINE_S)
    try:
        assert store.setup("127.0.0.1", "P2PHANDSHAKE", 4 * MiB, MiB, "tcp", "",
                           f"{dead_address()},{b.target}") == 0, store.last_error
        assert store.put("k", b"value") == 0 and store.get("k") == b"value"
        with MasterClient(b.target, timeout=DEADLINE_S) as at_b:
            assert at_b.exist_key("k") == ErrorCode.OK
        # the dict form takes a list; a pure client reads the value from the first one
        assert listed.setup({"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                             "global_segment_size": 0,
                             "master_server_addr": [dead_address(), b.target]}) == 0, \
            listed.last_error
        assert listed.get("k") == b"value"
    finally:
        listed.close()
        store.close()

    nowhere = MooncakeDistributedStore(setup_timeout=1.0)
    try:
        assert nowhere.setup("127.0.0.1", "P2PHANDSHAKE", 0, MiB, "tcp", "",
                             f"{dead_address()},{dead_address()}") == ErrorCode.RPC_FAIL
        assert "no hixl-master answered" in nowhere.last_error
    finally:
        nowhere.close()
    refused = MooncakeDistributedStore(setup_timeout=1.0)
    try:
        assert refused.setup("127.0.0.1", "P2PHANDSHAKE", 0, MiB, "tcp", "",
                             f"{b.target},nope") == ErrorCode.INVALID_PARAMS
        assert "'nope'" in refused.last_error
    finally:
        refused.close()
