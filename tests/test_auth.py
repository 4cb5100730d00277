"""Cluster-token authentication, end to end: real agents, a real master, real sockets.

An agent with a token serves only callers that prove it: every gRPC call (Agent and
Registry services, Health and watch streams included) and every data connection. A wrong
or missing token is refused with AuthenticationFailed before any byte moves, and the
agent keeps serving everyone else. Deadlines only prove "does not hang".
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import grpc
import pytest
import waiting
import yaml
from conftest import AgentProcess, agent_command, clean_env, master_process

from hixl import FAILED, SUCCESS, AuthenticationFailed, Engine, Hixl, auth, wire
from hixl.client.agent_client import AgentClient
from hixl.control import error_from_rpc
from hixl.errors import ConfigError
from hixl.registry_client import RegistryClient
from hixl.server.agent.config import AgentConfig
from hixl.transports.tcp import SocketTransport
from hixl.types import SegmentInfo
from hixl.v1 import agent_pb2, agent_pb2_grpc

TOKEN = b"s3cret-cluster-token-for-tests"
DEADLINE_S = 20.0
POOL = [{"name": "pool", "size": "1MiB"}]
StartAgent = Callable[..., AgentProcess]


@pytest.fixture(autouse=True)
def _no_token_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens come only from what each test sets up, never from the developer's shell."""
    monkeypatch.delenv(auth.ENV_TOKEN, raising=False)
    monkeypatch.delenv(auth.ENV_TOKEN_FILE, raising=False)


def write_token(path: Path, token: bytes, mode: int = 0o600) -> str:
    path.write_bytes(token + b"\n")
    path.chmod(mode)
    return str(path)


@pytest.fixture
def token_file(tmp_path: Path) -> str:
    return write_token(tmp_path / "cluster.token", TOKEN)


@pytest.fixture
def wrong_token_file(tmp_path: Path) -> str:
    return write_token(tmp_path / "wrong.token", b"not-the-cluster-token")


def first_segment(agent: AgentProcess) -> SegmentInfo:
    return next(s for s in agent.info.segments if s.name == "pool")


wait_for = partial(waiting.wait_until, timeout=DEADLINE_S)


# ---------------------------------------------------------------- token sources

def test_token_file_is_stripped_and_env_sources_work(tmp_path: Path, token_file: str) -> None:
    assert auth.load_token(token_file, env={}) == TOKEN
    assert auth.load_token(None, env={auth.ENV_TOKEN: " abc \n"}) == b"abc"
    assert auth.load_token(None, env={auth.ENV_TOKEN_FILE: token_file}) == TOKEN
    assert auth.load_token(None, env={}) is None  # authentication off
    # an explicit file wins over the environment
    assert auth.load_token(token_file, env={auth.ENV_TOKEN: "other"}) == TOKEN


@pytest.mark.parametrize("env, words", [
    ({auth.ENV_TOKEN: "  "}, auth.ENV_TOKEN),
    ({auth.ENV_TOKEN_FILE: ""}, auth.ENV_TOKEN_FILE),
    ({auth.ENV_TOKEN: "a", auth.ENV_TOKEN_FILE: "/x"}, "only one"),
])
def test_unusable_env_tokens_are_config_errors(env: dict[str, str], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        auth.load_token(None, env=env)


def test_missing_or_empty_token_file_names_the_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "absent.token")
    with pytest.raises(ConfigError, match=f"{missing}.*cannot read"):
        auth.load_token(missing, env={})
    empty = write_token(tmp_path / "empty.token", b"  ")
    with pytest.raises(ConfigError, match=f"{empty} is empty"):
        auth.load_token(empty, env={})
    with pytest.raises(ConfigError, match="not a regular file"):
        auth.load_token(str(tmp_path), env={})


def test_token_file_readable_by_others_is_used_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    loose = write_token(tmp_path / "loose.token", TOKEN, mode=0o644)
    with caplog.at_level(logging.WARNING, logger="hixl.auth"):
        assert auth.load_token(loose, env={}) == TOKEN
    assert "chmod 600" in caplog.text and loose in caplog.text


def test_config_key_is_documented() -> None:
    described = AgentConfig.describe()["cluster_token_file"]
    assert described["default"] == "''" and described["env"] == "HIXL_AGENT_CLUSTER_TOKEN_FILE"
    assert "cluster token" in described["doc"]


# ---------------------------------------------------------------- gRPC proofs (no server)

class Clock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


SERVER = "10.1.2.3:50051"


def names_of(*addresses: str) -> auth.ServerNames:
    names = auth.ServerNames(env={})
    for address in addresses:
        host, _, port = address.rpartition(":")
        names.listen(address, int(port))
    return names


def test_grpc_proof_is_bound_to_token_method_time_and_used_once() -> None:
    clock = Clock()
    verifier = auth.GrpcVerifier(TOKEN, clock=clock)
    method = "/hixl.v1.Agent/Health"
    now_ms = int(clock.now * 1000)
    proof = auth.make_grpc_proof(TOKEN, method, SERVER, unix_ms=now_ms)
    assert verifier.verify(method, proof) is None
    assert "replayed" in (verifier.verify(method, proof) or "")
    fresh = auth.make_grpc_proof(TOKEN, method, SERVER, unix_ms=now_ms)
    assert "wrong cluster token" in (verifier.verify("/hixl.v1.Agent/Stats", fresh) or "")
    wrong = auth.make_grpc_proof(b"other", method, SERVER, unix_ms=now_ms)
    assert "wrong cluster token" in (verifier.verify(method, wrong) or "")
    assert "missing" in (verifier.verify(method, None) or "")
    assert "malformed" in (verifier.verify(method, "1.2") or "")
    assert "malformed" in (verifier.verify(method, "x.00.00") or "")
    assert "older hixl" in (verifier.verify(method, f"{now_ms}.{'00' * 16}.{'00' * 32}")
                            or "")  # the v1 proof (method, time, nonce only)
    skewed = auth.make_grpc_proof(TOKEN, method, SERVER, unix_ms=now_ms - 121_000)
    assert "sync the clocks" in (verifier.verify(method, skewed) or "")
    ahead = auth.make_grpc_proof(TOKEN, method, SERVER, unix_ms=now_ms + 119_000)
    assert verifier.verify(method, ahead) is None  # inside the +-120 s window


def test_grpc_proof_is_bound_to_the_server_and_the_request() -> None:
    clock = Clock()
    verifier = auth.GrpcVerifier(TOKEN, clock=clock)
    method = "/hixl.v1.Agent/DeregisterSegment"
    body = agent_pb2.HealthRequest().SerializeToString() + b"\x08\x01"
    proof = auth.make_grpc_proof(TOKEN, method, SERVER, auth.request_digest(body),
                                 unix_ms=int(clock.now * 1000))
    # the server and digest travel in the clear but under the MAC: changing either breaks it
    forged = proof.replace(SERVER, "10.1.2.4:50051")
    assert "wrong cluster token" in (verifier.verify(method, forged) or "")
    other = names_of("10.1.2.4:50051")
    assert "bound to server 10.1.2.3:50051, and this server is 10.1.2.4:50051" in (
        verifier.verify(method, proof, names=other) or "")
    assert "does not match" in (verifier.verify(method, proof, body=b"other") or "")
    assert verifier.verify(method, proof, body=body, names=names_of(SERVER)) is None


@pytest.mark.parametrize("target, server", [
    ("127.0.0.1:5000", "127.0.0.1:5000"), ("Node-1.Example.:5000", "node-1.example:5000"),
    ("dns:///node1:5000", "node1:5000"), ("ipv4:10.0.0.1:5000,10.0.0.2:5000", "10.0.0.1:5000"),
    ("[0:0::1]:5000", "[::1]:5000"), ("ipv6:[::1]:5000", "[::1]:5000"),
    ("[::ffff:127.0.0.1]:5000", "127.0.0.1:5000"), ("node1", "node1:443"),
    ("unix:/run/a.sock", "unix:/run/a.sock")])
def test_grpc_authority_normalizes_the_target(target: str, server: str) -> None:
    assert auth.grpc_authority(target) == server


def test_server_names_ips_wildcards_and_the_allow_list(monkeypatch: pytest.MonkeyPatch,
                                                       ) -> None:
    names = names_of("127.0.0.1:5000", "[::1]:5001")
    assert names.match_literal("127.0.0.1:5000") and names.match_literal("[::1]:5001")
    assert names.match_literal("127.0.0.1:5001") is False  # another port: another server
    assert names.match_literal("127.0.0.2:5000") is False
    assert names.match_literal("localhost:5000") is None  # resolved by accepts()
    assert names.match_literal("localhost:5002") is False  # no port of ours: no lookup
    anywhere = names_of("0.0.0.0:6000")
    assert anywhere.match_literal("127.0.0.1:6000") and anywhere.match_literal("127.9.9.9:6000")
    assert anywhere.match_literal("192.0.2.1:6000") is False  # TEST-NET: not this host
    assert anywhere.match_literal("127.0.0.1:6001") is False
    assert "any address of this host, port 6000" in anywhere.describe()
    monkeypatch.setenv(auth.ENV_SERVER_NAMES, "lb.example:443, 192.0.2.7:7000")
    allowed = auth.ServerNames()
    assert allowed.match_literal("lb.example:443") and allowed.match_literal("192.0.2.7:7000")
    monkeypatch.setenv(auth.ENV_SERVER_NAMES, "no-port")
    with pytest.raises(ConfigError, match=auth.ENV_SERVER_NAMES):
        auth.ServerNames()


def test_server_names_resolve_host_names() -> None:
    import asyncio
    names = names_of("127.0.0.1:5000")
    assert asyncio.run(names.accepts("localhost:5000"))
    assert not asyncio.run(names.accepts("localhost:5001"))
    assert not asyncio.run(names.accepts("no-such-host.invalid:5000"))
    assert "not know the addresses" in auth.ServerNames(env={}).mismatch("a:1")


def test_grpc_replay_memory_is_bounded_and_never_lapses() -> None:
    clock = Clock()
    verifier = auth.GrpcVerifier(TOKEN, clock=clock, max_tracked=4)
    method = "/m"
    now_ms = int(clock.now * 1000)
    proofs = [auth.make_grpc_proof(TOKEN, method, SERVER, unix_ms=now_ms - 10 + i)
              for i in range(6)]
    for proof in proofs:
        assert verifier.verify(method, proof) is None
    assert verifier.tracked <= 4
    for proof in proofs:  # forgotten ones are refused as too old, remembered ones as replays
        assert verifier.verify(method, proof) is not None
    clock.now += 300  # the window passed: everything is forgotten
    assert verifier.verify(method, auth.make_grpc_proof(
        TOKEN, method, SERVER, unix_ms=int(clock.now * 1000))) is None
    assert verifier.tracked == 1


def test_bare_unauthenticated_status_maps_to_authentication_failed() -> None:
    class Refused(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.UNAUTHENTICATED

        def details(self) -> str:
            return "go away"

    error = error_from_rpc(Refused(), "handshake at agent x")
    assert isinstance(error, AuthenticationFailed) and "go away" in str(error)


# ---------------------------------------------------------------- agent: the good client

@pytest.fixture(params=["unix", "tcp"])
def secured_agent(request: pytest.FixtureRequest, agent_process: StartAgent,
                  token_file: str) -> AgentProcess:
    """An agent requiring TOKEN; data over its unix socket, or TCP only (data_unix: false)."""
    return agent_process(config={"cluster_token_file": token_file, "pool": POOL,
                                 "data_unix": request.param == "unix"})


def socket_engine(token: bytes | None) -> Engine:
    return Engine("127.0.0.1", {"EnableUseFabricMem": "0"}, cluster_token=token)


def test_right_token_moves_bytes_on_the_socket_path(secured_agent: AgentProcess) -> None:
    seg = first_segment(secured_agent)
    payload = os.urandom(64 << 10)
    back = bytearray(len(payload))
    with socket_engine(TOKEN) as engine:
        engine.connect(secured_agent.engine)
        assert engine.route(secured_agent.engine, seg.base) == (
            "unix" if secured_agent.info.data_unix else "tcp")
        engine.register(payload)
        engine.register(back)
        engine.write(secured_agent.engine, payload, seg.base + 4096)
        engine.read(secured_agent.engine, back, seg.base + 4096)
    assert back == payload


@pytest.mark.parametrize("token, words", [(b"wrong-token", "wrong cluster token"),
                                          (None, "no cluster token presented")])
def test_wrong_or_missing_token_is_refused_at_connect(secured_agent: AgentProcess,
                                                      token: bytes | None, words: str) -> None:
    with socket_engine(token) as engine, pytest.raises(AuthenticationFailed, match=words):
        engine.connect(secured_agent.engine)


def test_every_grpc_call_needs_the_token(secured_agent: AgentProcess) -> None:
    with AgentClient(secured_agent.engine, timeout=DEADLINE_S) as anonymous:
        with pytest.raises(AuthenticationFailed, match="no cluster token"):
            anonymous.health()
        with pytest.raises(AuthenticationFailed):
            anonymous.allocate(4096)
        watch = anonymous.watch(timeout=DEADLINE_S)  # a stream is refused like a call
        with watch, pytest.raises(AuthenticationFailed):
            next(watch)
    with RegistryClient(secured_agent.engine, timeout=DEADLINE_S) as registry, \
            pytest.raises(AuthenticationFailed):
        registry.query()  # the embedded registry too
    with AgentClient(secured_agent.engine, timeout=DEADLINE_S, cluster_token=TOKEN) as client:
        assert client.health()["status"] == "SERVING"
        assert [s.name for s in client.list_segments()[1]] == ["pool"]  # nothing allocated
        with client.watch(timeout=DEADLINE_S) as watch:
            assert next(watch)[0] == "SNAPSHOT"
    with RegistryClient(secured_agent.engine, timeout=DEADLINE_S,
                        cluster_token=TOKEN) as registry:
        assert [s.name for s in registry.query()] == ["pool"]


def test_a_replayed_grpc_proof_is_refused(secured_agent: AgentProcess) -> None:
    proof = auth.make_grpc_proof(TOKEN, "/hixl.v1.Agent/Health",
                                 auth.grpc_authority(secured_agent.engine))
    with grpc.insecure_channel(secured_agent.engine) as channel:
        stub = agent_pb2_grpc.AgentStub(channel)
        metadata = ((auth.METADATA_KEY, proof),)
        assert stub.Health(agent_pb2.HealthRequest(), metadata=metadata,
                           timeout=DEADLINE_S).status == "SERVING"
        with pytest.raises(grpc.RpcError) as caught:
            stub.Health(agent_pb2.HealthRequest(), metadata=metadata, timeout=DEADLINE_S)
    error = error_from_rpc(caught.value, "health")
    assert isinstance(error, AuthenticationFailed) and "replayed" in str(error)


# ---------------------------------------------------------------- agent: the data port

def open_data(agent: AgentProcess) -> socket.socket:
    if agent.info.data_unix:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        address: str | tuple[str, int] = agent.info.data_unix
    else:
        host, _, port = agent.info.data_tcp.rpartition(":")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        address = (host, int(port))
    sock.settimeout(DEADLINE_S)
    sock.connect(address)
    return sock


def recv_exact(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        assert chunk, "the agent closed the connection early"
        data += chunk
    return data


def forged_write(agent: AgentProcess, token: bytes | None, seg: SegmentInfo,
                 payload: bytes) -> tuple[wire.Header, str]:
    """HELLO, then AUTH with `token` (none: skip AUTH), then a pipelined WRITE.

    Returns the agent's refusal (header, text) after checking it closed the connection.
    """
    with open_data(agent) as sock:
        proto = wire.ClientProtocol()
        sock.sendall(proto.hello(b"intruder"))
        header = proto.on_reply_header(recv_exact(sock, wire.HEADER_SIZE))
        nonce = recv_exact(sock, header.length)
        assert proto.challenged, "the agent must challenge"
        frames = proto.auth(token, nonce) if token is not None else b""
        frames += proto.write(seg.segment_id, seg.epoch, seg.base, len(payload)) + payload
        sock.sendall(frames)
        refusal = proto.on_reply_header(recv_exact(sock, wire.HEADER_SIZE))
        assert refusal.flags & wire.FLAG_ERROR_TEXT
        text = recv_exact(sock, refusal.length).decode()
        assert sock.recv(1) == b""  # closed: the WRITE was never served
    return refusal, text


def test_wrong_or_missing_token_moves_no_byte_at_the_data_port(
        secured_agent: AgentProcess) -> None:
    seg = first_segment(secured_agent)
    payload = b"\xee" * 8192
    refusal, text = forged_write(secured_agent, b"wrong-token", seg, payload)
    assert refusal.reason == wire.Reason.NOT_AUTHENTICATED and "wrong cluster token" in text
    refusal, text = forged_write(secured_agent, None, seg, payload)
    assert refusal.reason == wire.Reason.NOT_AUTHENTICATED and "requires a cluster token" in text
    address = (f"unix://{secured_agent.info.data_unix}" if secured_agent.info.data_unix
               else f"tcp://{secured_agent.info.data_tcp}")
    for token, words in ((b"wrong-token", "refused this client"),
                         (None, "none is configured here")):
        transport = SocketTransport(address, cluster_token=token)
        try:
            with pytest.raises(AuthenticationFailed, match=words):
                transport.ping(time.monotonic() + DEADLINE_S)
        finally:
            transport.close()

    with AgentClient(secured_agent.engine, timeout=DEADLINE_S, cluster_token=TOKEN) as client:
        stats = client.stats()
    assert stats["data_bytes_written"] == 0 and stats["data_ops_write"] == 0
    assert stats["data_auth_failures"] == 3  # the transport without token never sent AUTH
    # the segment is untouched, and the agent still serves the good client
    seen = bytearray(seg.length)
    fresh = os.urandom(len(payload))
    back = bytearray(len(fresh))
    with socket_engine(TOKEN) as engine:
        engine.connect(secured_agent.engine)
        engine.register(seen)
        engine.register(fresh)
        engine.register(back)
        engine.read(secured_agent.engine, seen, seg.base)
        engine.write(secured_agent.engine, fresh, seg.base)
        engine.read(secured_agent.engine, back, seg.base)
    assert seen == bytes(seg.length)
    assert back == fresh


def test_a_client_with_a_token_works_with_an_agent_without_one(
        agent_process: StartAgent) -> None:
    open_agent = agent_process(config={"pool": POOL, "data_unix": False})
    seg = first_segment(open_agent)
    data = os.urandom(4096)
    back = bytearray(len(data))
    with socket_engine(TOKEN) as engine:
        engine.connect(open_agent.engine)
        engine.register(data)
        engine.register(back)
        engine.write(open_agent.engine, data, seg.base)
        engine.read(open_agent.engine, back, seg.base)
    assert back == data


def test_hixl_facade_takes_the_token_from_the_environment(
        secured_agent: AgentProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    without = Hixl()
    assert without.initialize("127.0.0.1") == SUCCESS
    try:
        assert without.connect(secured_agent.engine) == FAILED
        assert isinstance(without.last_error, AuthenticationFailed)
    finally:
        without.finalize()
    monkeypatch.setenv(auth.ENV_TOKEN, TOKEN.decode())
    member = Hixl()
    assert member.initialize("127.0.0.1", {"EnableUseFabricMem": "0"}) == SUCCESS
    try:
        assert member.connect(secured_agent.engine) == SUCCESS
    finally:
        member.finalize()


def test_an_embedded_agent_requires_the_engine_token(tmp_path: Path) -> None:
    config = AgentConfig(host="127.0.0.1", grpc_port=0, runtime_dir=str(tmp_path / "run"))
    served = bytearray(4096)
    data = os.urandom(4096)
    with Engine("127.0.0.1", agent_config=config, cluster_token=TOKEN.decode()) as owner:
        owner.register(served)
        with socket_engine(None) as stranger, pytest.raises(AuthenticationFailed):
            stranger.connect(owner.name)
        with socket_engine(TOKEN) as peer:
            peer.connect(owner.name)
            peer.register(data)
            peer.write(owner.name, data, peer.segments(owner.name)[0].base)
    assert served == data


# ---------------------------------------------------------------- hixl-master

def test_master_refuses_an_agent_with_the_wrong_token(
        agent_process: StartAgent, token_file: str, wrong_token_file: str) -> None:
    with master_process("--cluster-token-file", token_file) as master, \
            RegistryClient(master, timeout=DEADLINE_S, cluster_token=TOKEN) as registry:
        with RegistryClient(master, timeout=DEADLINE_S) as anonymous, \
                pytest.raises(AuthenticationFailed, match="no cluster token"):
            anonymous.query()
        outsider = agent_process(config={"master": master, "pool": POOL,
                                         "cluster_token_file": wrong_token_file})
        wait_for(lambda: "wrong cluster token" in outsider.log(), "the refusal in the log")
        assert outsider.proc.poll() is None  # still running, still retrying
        assert registry.query(outsider.engine) == []
        member = agent_process(config={"master": master, "pool": POOL,
                                       "cluster_token_file": token_file})
        wait_for(lambda: [s.name for s in registry.query(member.engine)] == ["pool"],
                 "the member's segments at the master")
        assert registry.query(outsider.engine) == []


def test_master_takes_its_token_from_the_environment(agent_process: StartAgent) -> None:
    env = {auth.ENV_TOKEN: TOKEN.decode()}
    with master_process(env=env) as master:
        with RegistryClient(master, timeout=DEADLINE_S) as anonymous, \
                pytest.raises(AuthenticationFailed):
            anonymous.query()
        member = agent_process(config={"master": master, "pool": POOL}, env=env)
        with RegistryClient(master, timeout=DEADLINE_S, cluster_token=TOKEN) as registry:
            wait_for(lambda: [s.name for s in registry.query(member.engine)] == ["pool"],
                     "the member's segments at the master")


# ---------------------------------------------------------------- unusable token files

def run_agent_expecting_exit(tmp_path: Path, settings: dict[str, object],
                             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    config_path = tmp_path / "agent.yaml"
    config_path.write_text(yaml.safe_dump({"host": "127.0.0.1", "grpc_port": 0,
                                           "runtime_dir": str(tmp_path / "run"), **settings}))
    return subprocess.run(agent_command(str(config_path)), capture_output=True, text=True,
                          env=clean_env(env), timeout=DEADLINE_S)


def test_agent_exits_2_naming_a_missing_or_empty_token_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "absent.token")
    done = run_agent_expecting_exit(tmp_path, {"cluster_token_file": missing})
    assert done.returncode == 2 and missing in done.stderr and "cannot read" in done.stderr
    empty = write_token(tmp_path / "empty.token", b"")
    done = run_agent_expecting_exit(tmp_path, {}, env={auth.ENV_TOKEN_FILE: empty})
    assert done.returncode == 2 and f"{empty} is empty" in done.stderr


def test_master_exits_2_naming_a_missing_token_file(tmp_path: Path) -> None:
    missing = str(tmp_path / "absent.token")
    done = subprocess.run([sys.executable, "-m", "hixl.server.master.master", "--port", "0",
                           "--cluster-token-file", missing], capture_output=True, text=True,
                          env=clean_env(), timeout=DEADLINE_S)
    assert done.returncode == 2 and missing in done.stderr
