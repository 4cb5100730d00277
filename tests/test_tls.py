"""TLS for gRPC, end to end: real agents and a real hixl-master serving TLS, real clients.

Certificates are made per test session with the `openssl` command line in a temporary
directory (no private key is ever committed). Transfers, registry and store calls work
over TLS with the cluster token on top; every mismatch — plaintext against TLS and back, a
certificate from another CA, mutual TLS without a client certificate, a bad file — is a
typed error that says what is wrong, naming the file or the endpoint. Deadlines only
prove "does not hang".
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import waiting
import yaml
from conftest import AgentProcess, agent_command, clean_env, master_process

from hixl import Engine, auth, tls
from hixl.client.agent_client import AgentClient
from hixl.client.store_client import MasterClient
from hixl.errors import ConfigError, PeerUnavailable
from hixl.registry_client import RegistryClient
from hixl.server.agent.config import AgentConfig
from hixl.store_codes import ErrorCode
from hixl.store_types import StoreSegment
from hixl.tls import ClientTLS, ServerTLS
from hixl.tools import cli

TOKEN = b"tls-test-cluster-token"
DEADLINE_S = 20.0
POOL = [{"name": "pool", "size": "1MiB"}]
TLS_ENV = (tls.ENV_CA_FILE, tls.ENV_CERT_FILE, tls.ENV_KEY_FILE, tls.ENV_SERVER_NAME)
StartAgent = Callable[..., AgentProcess]


@pytest.fixture(autouse=True)
def _clean_security_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tokens and TLS files come only from what each test sets up, never from the shell."""
    for var in (auth.ENV_TOKEN, auth.ENV_TOKEN_FILE, *TLS_ENV):
        monkeypatch.delenv(var, raising=False)


# ---------------------------------------------------------------- certificates

@dataclass(frozen=True)
class Pair:
    cert: str
    key: str


@dataclass(frozen=True)
class Pki:
    """Two unrelated CAs; node/client certificates of CA `ca`, one of `other_ca`."""

    dir: Path
    ca: str
    node: Pair          # IP 127.0.0.1/127.0.0.2, localhost; serverAuth + clientAuth
    client: Pair        # clientAuth only
    named: Pair         # DNS hixl.test only: the address dialled is not in it
    other_ca: str
    stranger: Pair      # a certificate of other_ca (serverAuth + clientAuth)


def _openssl(directory: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True,
                   timeout=60)


def _make_ca(directory: Path, name: str) -> tuple[str, str]:
    _openssl(directory, "req", "-x509", "-newkey", "ec", "-pkeyopt",
             "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", f"{name}.key", "-out",
             f"{name}.pem", "-days", "2", "-subj", f"/CN={name}", "-addext",
             "basicConstraints=critical,CA:TRUE", "-addext",
             "keyUsage=critical,keyCertSign,cRLSign")
    return str(directory / f"{name}.pem"), str(directory / f"{name}.key")


def _make_cert(directory: Path, name: str, ca: tuple[str, str], san: str,
               usage: str = "serverAuth,clientAuth") -> Pair:
    _openssl(directory, "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
    (directory / f"{name}.ext").write_text(f"subjectAltName={san}\nextendedKeyUsage={usage}\n")
    _openssl(directory, "x509", "-req", "-in", f"{name}.csr", "-CA", ca[0], "-CAkey", ca[1],
             "-set_serial", f"0x{os.urandom(8).hex()}", "-days", "2", "-out", f"{name}.pem",
             "-extfile", f"{name}.ext")
    os.chmod(directory / f"{name}.key", 0o600)
    return Pair(str(directory / f"{name}.pem"), str(directory / f"{name}.key"))


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make test certificates")
    directory = tmp_path_factory.mktemp("pki")
    ca = _make_ca(directory, "ca")
    other = _make_ca(directory, "other-ca")
    local = "IP:127.0.0.1,IP:127.0.0.2,DNS:localhost"
    return Pki(directory, ca[0],
               node=_make_cert(directory, "node", ca, local),
               client=_make_cert(directory, "client", ca, "DNS:client", "clientAuth"),
               named=_make_cert(directory, "named", ca, "DNS:hixl.test"),
               other_ca=other[0],
               stranger=_make_cert(directory, "stranger", other, local))


def serving(pair: Pair, **extra: object) -> dict[str, object]:
    """Agent config keys serving TLS with `pair` (plus a pool and the token file)."""
    return {"tls_cert_file": pair.cert, "tls_key_file": pair.key, "pool": POOL, **extra}


@pytest.fixture
def token_file(tmp_path: Path) -> str:
    path = tmp_path / "cluster.token"
    path.write_bytes(TOKEN)
    path.chmod(0o600)
    return str(path)


def pool_segment(agent: AgentProcess):  # type: ignore[no-untyped-def]
    return next(s for s in agent.info.segments if s.name == "pool")


def socket_engine(tls_setting: tls.TlsSetting = None) -> Engine:
    return Engine("127.0.0.1", {"EnableUseFabricMem": "0"}, cluster_token=TOKEN,
                  tls=tls_setting)


def round_trip(engine: Engine, agent: str, base: int, size: int = 64 << 10) -> None:
    """Write random bytes to `agent` at `base`, read them back, compare every byte."""
    payload = os.urandom(size)
    back = bytearray(size)
    engine.register(payload)
    engine.register(back)
    engine.write(agent, payload, base)
    engine.read(agent, back, base)
    assert back == payload


# ---------------------------------------------------------------- files: ConfigError

def test_unusable_files_are_config_errors_naming_them(pki: Pki, tmp_path: Path) -> None:
    missing = str(tmp_path / "absent.pem")
    with pytest.raises(ConfigError, match=f"tls_cert_file {missing}: cannot read"):
        ServerTLS(missing, pki.node.key)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match=f"tls_cert_file {garbage}: not a PEM file"):
        ServerTLS(str(garbage), pki.node.key)
    with pytest.raises(ConfigError, match=f"tls_cert_file {pki.node.key}: holds no cert"):
        ServerTLS(pki.node.key, pki.node.key)  # a key where the certificate belongs
    with pytest.raises(ConfigError, match=f"tls_key_file {pki.stranger.key}: the private "
                                          f"key does not match the certificate"):
        ServerTLS(pki.node.cert, pki.stranger.key)
    encrypted = tmp_path / "encrypted.key"
    _openssl(tmp_path, "pkey", "-in", pki.node.key, "-aes256", "-passout", "pass:x", "-out",
             str(encrypted))
    with pytest.raises(ConfigError, match=f"{encrypted}: the private key is encrypted"):
        ServerTLS(pki.node.cert, str(encrypted))
    with pytest.raises(ConfigError, match="client authentication needs tls_ca_file"):
        ServerTLS(pki.node.cert, pki.node.key, client_auth=True)
    with pytest.raises(ConfigError, match=f"ca_file {pki.node.key}: holds no usable CA"):
        ClientTLS(pki.node.key)
    with pytest.raises(ConfigError, match="go together"):
        ClientTLS(pki.ca, cert_file=pki.client.cert)


def test_settings_fall_back_to_the_environment_per_file(pki: Pki) -> None:
    env = {tls.ENV_CA_FILE: pki.ca, tls.ENV_CERT_FILE: pki.node.cert,
           tls.ENV_KEY_FILE: pki.node.key}
    server = ServerTLS.from_settings(env=env)
    assert server is not None and server.cert_file == pki.node.cert
    assert not server.client_auth
    client = ClientTLS.from_settings(env=env)
    assert client is not None and (client.ca_file, client.cert_file) == (pki.ca, pki.node.cert)
    assert ServerTLS.from_settings(env={}) is None and ClientTLS.from_settings(env={}) is None
    # a certificate alone serves TLS; the same process dials in plaintext (no CA)
    assert ClientTLS.from_settings(env={tls.ENV_CERT_FILE: pki.node.cert}) is None
    with pytest.raises(ConfigError, match=f"{tls.ENV_KEY_FILE} is not"):
        ServerTLS.from_settings(env={tls.ENV_CERT_FILE: pki.node.cert})
    with pytest.raises(ConfigError, match=f"{tls.ENV_CA_FILE} /nope.pem: cannot read"):
        ClientTLS.from_settings(env={tls.ENV_CA_FILE: "/nope.pem"})
    # an explicit key beats the variable, and messages name the key
    config = AgentConfig(tls_cert_file="/no/such.pem", tls_key_file=pki.node.key)
    with pytest.raises(ConfigError, match="tls_cert_file /no/such.pem"):
        config.server_tls(env)
    described = AgentConfig.describe()
    for key in ("tls_cert_file", "tls_key_file", "tls_ca_file", "tls_client_auth"):
        assert described[key]["env"] == "HIXL_AGENT_" + key.upper()


def write_agent_config(tmp_path: Path, settings: dict[str, object]) -> str:
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump({"host": "127.0.0.1", "grpc_port": 0,
                                    "runtime_dir": str(tmp_path / "run"), **settings}))
    return str(path)


def test_daemons_exit_2_naming_an_unusable_tls_file(pki: Pki, tmp_path: Path) -> None:
    missing = str(tmp_path / "absent.key")
    config = write_agent_config(tmp_path, {"tls_cert_file": pki.node.cert,
                                           "tls_key_file": missing})
    done = subprocess.run(agent_command(config), capture_output=True, text=True,
                          env=clean_env(), timeout=DEADLINE_S)
    assert done.returncode == 2 and f"tls_key_file {missing}" in done.stderr
    done = subprocess.run([sys.executable, "-m", "hixl.server.master.master", "--port", "0",
                           "--tls-cert-file", pki.node.cert, "--tls-key-file",
                           pki.stranger.key], capture_output=True, text=True,
                          env=clean_env(), timeout=DEADLINE_S)
    assert done.returncode == 2 and "does not match the certificate" in done.stderr
    assert pki.stranger.key in done.stderr


# ---------------------------------------------------------------- an agent serving TLS

def test_transfers_and_registry_over_tls_from_the_environment(
        pki: Pki, agent_process: StartAgent, token_file: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One set of variables: the agent serves TLS with HIXL_TLS_CERT/KEY_FILE, clients dial
    with HIXL_TLS_CA_FILE; the token authenticates on top."""
    monkeypatch.setenv(tls.ENV_CA_FILE, pki.ca)
    monkeypatch.setenv(tls.ENV_CERT_FILE, pki.node.cert)
    monkeypatch.setenv(tls.ENV_KEY_FILE, pki.node.key)
    agent = agent_process(config={"pool": POOL, "cluster_token_file": token_file,
                                  "data_unix": False})
    assert "grpc=TLS (certificate " + pki.node.cert in agent.log()
    seg = pool_segment(agent)
    with socket_engine() as engine:
        engine.connect(agent.engine)  # the handshake over TLS
        round_trip(engine, agent.engine, seg.base)
    with RegistryClient(agent.engine, timeout=DEADLINE_S, cluster_token=TOKEN) as registry:
        assert [s.name for s in registry.query()] == ["pool"]  # the embedded registry
    # TLS does not replace the token
    with AgentClient(agent.engine, timeout=DEADLINE_S) as anonymous, \
            pytest.raises(Exception, match="no cluster token"):
        anonymous.health()


def test_plaintext_client_is_refused_by_a_tls_agent_with_a_clear_error(
        pki: Pki, agent_process: StartAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(tls.ENV_CA_FILE, pki.ca)  # for the fixture's handshake
    agent = agent_process(config=serving(pki.node))
    with AgentClient(agent.engine, timeout=DEADLINE_S, tls=False) as plain, \
            pytest.raises(PeerUnavailable, match="may require TLS") as caught:
        plain.health()
    assert agent.engine in str(caught.value) and tls.ENV_CA_FILE in str(caught.value)
    with socket_engine(False) as engine, pytest.raises(PeerUnavailable, match="TLS"):
        engine.connect(agent.engine)
    with RegistryClient(agent.engine, timeout=DEADLINE_S, tls=False) as registry, \
            pytest.raises(PeerUnavailable, match="may require TLS"):
        registry.query()
    # the agent still serves TLS clients
    with AgentClient(agent.engine, timeout=DEADLINE_S) as client:
        assert client.health()["status"] == "SERVING"


def test_tls_client_is_refused_by_a_plaintext_agent_with_a_clear_error(
        pki: Pki, agent_process: StartAgent) -> None:
    agent = agent_process(config={"pool": POOL})
    with AgentClient(agent.engine, timeout=DEADLINE_S, tls=ClientTLS(pki.ca)) as client, \
            pytest.raises(PeerUnavailable, match="does not speak TLS") as caught:
        client.health()
    assert agent.engine in str(caught.value)


def test_a_certificate_from_another_ca_is_refused(pki: Pki, agent_process: StartAgent,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(tls.ENV_CA_FILE, pki.other_ca)
    agent = agent_process(config=serving(pki.stranger))
    with AgentClient(agent.engine, timeout=DEADLINE_S, tls=ClientTLS(pki.ca)) as client, \
            pytest.raises(PeerUnavailable, match="not signed by the CA") as caught:
        client.health()
    assert pki.ca in str(caught.value)


def test_mutual_tls_refuses_clients_without_a_certificate_of_its_ca(
        pki: Pki, agent_process: StartAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(tls.ENV_CA_FILE, pki.ca)
    monkeypatch.setenv(tls.ENV_CERT_FILE, pki.client.cert)
    monkeypatch.setenv(tls.ENV_KEY_FILE, pki.client.key)
    agent = agent_process(config=serving(pki.node, tls_ca_file=pki.ca, tls_client_auth=True))
    seg = pool_segment(agent)
    with AgentClient(agent.engine, timeout=DEADLINE_S, tls=ClientTLS(pki.ca)) as anonymous, \
            pytest.raises(PeerUnavailable, match="requires a client certificate"):
        anonymous.health()
    foreign = ClientTLS(pki.ca, pki.stranger.cert, pki.stranger.key)
    with AgentClient(agent.engine, timeout=DEADLINE_S, tls=foreign) as stranger, \
            pytest.raises(PeerUnavailable, match=f"refused the client certificate "
                                                 f"{pki.stranger.cert}"):
        stranger.health()
    with socket_engine() as engine:  # the environment's client certificate
        engine.connect(agent.engine)
        round_trip(engine, agent.engine, seg.base)


def test_an_embedded_agent_serves_tls_and_the_name_in_the_certificate_matters(
        pki: Pki, tmp_path: Path) -> None:
    config = AgentConfig(host="127.0.0.1", grpc_port=0, runtime_dir=str(tmp_path / "run"),
                         tls_cert_file=pki.named.cert, tls_key_file=pki.named.key,
                         tls_ca_file=pki.ca)
    served = bytearray(8192)
    with Engine("127.0.0.1", agent_config=config, cluster_token=TOKEN) as owner:
        owner.register(served)
        # the certificate names hixl.test, not 127.0.0.1: refused, saying so
        with socket_engine(ClientTLS(pki.ca)) as peer, \
                pytest.raises(PeerUnavailable, match="does not name the address"):
            peer.connect(owner.name)
        with socket_engine(ClientTLS(pki.ca, server_name="hixl.test")) as peer:
            peer.connect(owner.name)
            data = os.urandom(len(served))
            peer.register(data)
            peer.write(owner.name, data, peer.segments(owner.name)[0].base)
    assert served == data


# ---------------------------------------------------------------- hixl-master over TLS

def test_master_registry_and_store_over_mutual_tls(pki: Pki, agent_process: StartAgent,
                                                   token_file: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent publishes to a master requiring client certificates (it presents its own),
    store calls and transfers run over TLS, and plaintext is refused with a clear error."""
    with master_process("--cluster-token-file", token_file, "--tls-cert-file",
                        pki.node.cert, "--tls-key-file", pki.node.key, "--tls-ca-file",
                        pki.ca, "--tls-client-auth",
                        log_path=str(tmp_path / "master.log")) as master:
        monkeypatch.setenv(tls.ENV_CA_FILE, pki.ca)  # the fixture's handshake
        agent = agent_process(config=serving(pki.node, master=master, tls_ca_file=pki.ca,
                                             cluster_token_file=token_file,
                                             data_unix=False))
        client_tls = ClientTLS(pki.ca, pki.client.cert, pki.client.key)
        with RegistryClient(master, timeout=DEADLINE_S, cluster_token=TOKEN,
                            tls=client_tls) as registry:
            segments = waiting.wait_until(lambda: registry.query(agent.engine),  # soon
                                          f"{agent.engine} published", DEADLINE_S,
                                          detail=agent.log)
            assert [s.name for s in segments] == ["pool"]
        with RegistryClient(master, timeout=DEADLINE_S, cluster_token=TOKEN,
                            tls=False) as plain, \
                pytest.raises(PeerUnavailable, match="may require TLS"):
            plain.query()

        seg = segments[0]
        value = os.urandom(48 << 10)
        with MasterClient(master, timeout=DEADLINE_S, cluster_token=TOKEN,
                          tls=client_tls) as store, \
                socket_engine(client_tls) as engine:
            mounted = store.mount_segment(StoreSegment(agent.engine, seg.segment_id,
                                                       seg.epoch, seg.base, seg.length))
            assert mounted.code == ErrorCode.OK
            put = store.put_start("tls/key", len(value))
            assert put.code == ErrorCode.OK and len(put.replicas) == 1
            engine.connect(agent.engine)
            engine.register(value)
            engine.write(agent.engine, value, put.replicas[0].addr)
            assert store.put_end("tls/key", put.put_id) == ErrorCode.OK
            got = store.get_replicas("tls/key")
            assert got.code == ErrorCode.OK and got.size == len(value)
            back = bytearray(len(value))
            engine.register(back)
            engine.read(agent.engine, back, got.replicas[0].addr)
            assert back == value
            assert [k.key for k in store.list_keys("^tls/").keys] == ["tls/key"]
            # a client dialling with TLS keeps every store call inside TLS
            assert getattr(store, "fast_calls", 0) == 0
        # a master serving TLS keeps its plaintext store call endpoint closed by default
        assert "store call endpoint off: gRPC is served over TLS" in (
            tmp_path / "master.log").read_text()


def test_cli_status_over_tls(pki: Pki, agent_process: StartAgent, token_file: str,
                             monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv(tls.ENV_CA_FILE, pki.ca)
    agent = agent_process(config=serving(pki.node, cluster_token_file=token_file))
    monkeypatch.delenv(tls.ENV_CA_FILE)
    common = ["status", "--agent", agent.engine, "--token-file", token_file, "--timeout",
              "5"]
    assert cli.main([*common, "--tls-ca-file", pki.ca]) == 0
    assert "SERVING" in capsys.readouterr().out
    assert cli.main(common) == 1  # plaintext against TLS: says so, names the agent
    err = capsys.readouterr().err
    assert f"agent {agent.engine}: connection failed (TLS)" in err
    assert cli.main([*common, "--tls-cert-file", pki.client.cert]) == 1
    assert "need a CA" in capsys.readouterr().err
