"""A captured gRPC proof is good for one call: to the server it was made for, with the
request it was made for (issue 15, item 6), against real agents and a real master.

The attacker here sniffs plaintext gRPC: it holds a valid `hixl-auth` header (captured
from a real client's call by an interceptor, as a sniffer on the wire would) but not the
token. Before the proof bound the server and the request, such a header was accepted by
every other agent and master of the cluster, with any request body, within the window.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import AgentProcess
from test_auth import master_process, write_token

from hixl import AuthenticationFailed, auth
from hixl.client.agent_client import AgentClient
from hixl.control import authenticated_channel, error_from_rpc
from hixl.registry_client import RegistryClient
from hixl.v1 import agent_pb2

TOKEN = b"proof-binding-cluster-token"
DEADLINE_S = 20.0
POOL = [{"name": "pool", "size": "1MiB"}]
ALLOCATE = "/hixl.v1.Agent/AllocateSegment"
QUERY = "/hixl.v1.Registry/QuerySegments"
WATCH = "/hixl.v1.Agent/WatchSegments"


@pytest.fixture(autouse=True)
def _no_token_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(auth.ENV_TOKEN, raising=False)
    monkeypatch.delenv(auth.ENV_TOKEN_FILE, raising=False)
    monkeypatch.delenv(auth.ENV_SERVER_NAMES, raising=False)


@pytest.fixture
def token_file(tmp_path: Path) -> str:
    return write_token(tmp_path / "cluster.token", TOKEN)


@pytest.fixture
def two_agents(agent_process: Callable[..., AgentProcess],
               token_file: str) -> tuple[AgentProcess, AgentProcess]:
    config = {"cluster_token_file": token_file, "pool": POOL}
    return agent_process(config=config), agent_process(config=config)


@pytest.fixture
def master(token_file: str) -> Iterator[str]:
    with master_process("--cluster-token-file", token_file) as address:
        yield address


class _Sniffer(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Sits under hixl's client interceptor and keeps what goes on the wire: the metadata
    and the request bytes. `withhold`: the call never leaves (a man in the middle that
    keeps the honest request for itself)."""

    def __init__(self, withhold: bool = False) -> None:
        self.withhold = withhold
        self.captured: list[tuple[str, str, bytes]] = []  # (method, hixl-auth, body)

    def _keep(self, details: Any, request: Any) -> None:
        proof = dict(details.metadata or ())[auth.METADATA_KEY]
        self.captured.append((details.method, proof, request.SerializeToString()))
        if self.withhold:
            raise _Withheld

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        self._keep(details, request)
        return continuation(details, request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        self._keep(details, request)
        return continuation(details, request)


class _Withheld(Exception):
    pass


def capture(target: str, method: str, request: Any, *, withhold: bool,
            stream: bool = False) -> tuple[str, bytes]:
    """(hixl-auth header, request bytes) of a real client's call of `method` to `target`,
    made through hixl's own client interceptor; the call is delivered unless `withhold`."""
    sniffer = _Sniffer(withhold)
    with grpc.insecure_channel(target) as raw:
        channel = authenticated_channel(grpc.intercept_channel(raw, sniffer), TOKEN, target)
        reply = agent_pb2.SegmentEvent if stream else agent_pb2.SegmentReply
        call = (channel.unary_stream if stream else channel.unary_unary)(
            method, request_serializer=type(request).SerializeToString,
            response_deserializer=reply.FromString)
        try:
            result = call(request, timeout=DEADLINE_S)
            if stream:
                next(iter(result))
                result.cancel()
        except _Withheld:
            assert withhold
    [(sent_method, proof, body)] = sniffer.captured
    assert sent_method == method
    return proof, body


def replay(target: str, method: str, proof: str, body: bytes, *,
           stream: bool = False) -> Exception | None:
    """Send `body` (raw bytes) to `target` under the captured `proof`, as the attacker
    would: None when served, else the error the call raised (typed like hixl's)."""
    with grpc.insecure_channel(target) as channel:
        call = (channel.unary_stream if stream else channel.unary_unary)(method)
        try:
            result = call(body, metadata=((auth.METADATA_KEY, proof),), timeout=DEADLINE_S)
            if stream:
                next(iter(result))
                result.cancel()
        except grpc.RpcError as exc:
            return error_from_rpc(exc, f"{method} at {target}")
    return None


def allocate(name: str, size: int = 4096) -> agent_pb2.AllocateSegmentRequest:
    return agent_pb2.AllocateSegmentRequest(size=size, name=name, owner="victim")


def names(agent: AgentProcess) -> list[str]:
    with AgentClient(agent.engine, timeout=DEADLINE_S, cluster_token=TOKEN) as client:
        return sorted(s.name for s in client.list_segments()[1])


def refused(error: Exception | None, *words: str) -> bool:
    return isinstance(error, AuthenticationFailed) and all(w in str(error) for w in words)


def test_a_sniffed_proof_is_refused_by_other_agents_and_the_master(
        two_agents: tuple[AgentProcess, AgentProcess], master: str) -> None:
    a, b = two_agents
    # a proof sniffed from a delivered call: worthless everywhere, on its own server too
    proof, body = capture(a.engine, ALLOCATE, allocate("honest"), withhold=False)
    assert names(a) == ["honest", "pool"]
    error = replay(b.engine, ALLOCATE, proof, body)
    assert refused(error, f"bound to server {a.engine}", f"this server is {b.engine}")
    assert refused(replay(a.engine, ALLOCATE, proof, body), "replayed")
    query, query_body = capture(a.engine, QUERY, agent_pb2.QuerySegmentsRequest(),
                                withhold=False)
    assert refused(replay(master, QUERY, query, query_body), f"bound to server {a.engine}",
                   f"this server is {master}")
    assert refused(replay(b.engine, QUERY, query, query_body), "bound to server")
    assert names(b) == ["pool"]  # nothing was allocated on the other agent


def test_a_withheld_proof_serves_only_its_own_request_on_its_own_server(
        two_agents: tuple[AgentProcess, AgentProcess]) -> None:
    a, b = two_agents
    # a man in the middle keeps the honest call, with a fresh nonce no server has seen
    proof, body = capture(a.engine, ALLOCATE, allocate("honest"), withhold=True)
    evil = allocate("evil", size=512 << 10).SerializeToString()
    assert refused(replay(a.engine, ALLOCATE, proof, evil), "does not match")
    assert refused(replay(b.engine, ALLOCATE, proof, body), "bound to server")
    assert names(a) == ["pool"] and names(b) == ["pool"]  # nothing ran
    # one delivery of the honest request, as the client made it, to its server: served
    # (the nonce burnt by the forged body makes it a replay; a fresh capture is served)
    proof, body = capture(a.engine, ALLOCATE, allocate("honest"), withhold=True)
    assert replay(b.engine, ALLOCATE, proof, body) is not None
    assert replay(a.engine, ALLOCATE, proof, body) is None
    assert refused(replay(a.engine, ALLOCATE, proof, body), "replayed")
    assert names(a) == ["honest", "pool"] and names(b) == ["pool"]


def test_a_watch_stream_proof_is_bound_to_its_request(
        two_agents: tuple[AgentProcess, AgentProcess]) -> None:
    a, b = two_agents
    proof, body = capture(a.engine, WATCH, agent_pb2.WatchSegmentsRequest(), withhold=True)
    other = body + b"\x08\x01"  # an unknown field: a message that parses, with other bytes
    assert refused(replay(a.engine, WATCH, proof, other, stream=True), "does not match")
    proof, body = capture(a.engine, WATCH, agent_pb2.WatchSegmentsRequest(), withhold=True)
    assert refused(replay(b.engine, WATCH, proof, body, stream=True), "bound to server")
    assert replay(a.engine, WATCH, proof, body, stream=True) is None


def test_honest_clients_by_every_name_of_the_agent(
        two_agents: tuple[AgentProcess, AgentProcess]) -> None:
    a, _ = two_agents
    port = a.engine.rpartition(":")[2]
    for target in (a.engine, f"localhost:{port}", f"ipv4:127.0.0.1:{port}",
                   f"dns:///127.0.0.1:{port}"):
        with AgentClient(target, timeout=DEADLINE_S, cluster_token=TOKEN) as client:
            assert client.health()["status"] == "SERVING"
            info = client.allocate(4096, name=f"via-{len(target)}")
            client.deregister(info.segment_id, info.epoch)
    for target in (a.engine, f"localhost:{port}"):  # the registry client takes host:port
        with RegistryClient(target, timeout=DEADLINE_S, cluster_token=TOKEN) as registry:
            assert "pool" in [s.name for s in registry.query()]
    # a name the agent does not answer to (here: an IP that is not one of this host's)
    # is refused, naming both; no proof for it is ever accepted here
    proof = auth.make_grpc_proof(TOKEN, "/hixl.v1.Agent/Health", f"192.0.2.1:{port}")
    error = replay(a.engine, "/hixl.v1.Agent/Health", proof, b"")
    assert refused(error, f"bound to server 192.0.2.1:{port}", f"this server is {a.engine}")

