"""Wrong-port mistakes of the store and registry clients (issue 20, item 1, last bullet).

A store client or an `Engine(registry=...)` pointed at an agent's gRPC port or at its data
port gets an immediate answer there (UNIMPLEMENTED, or bytes that are not HTTP/2); it must
say at once what it reached, what it expected and what to give instead, never wait out its
deadline and then suggest `hixl-master --port <the agent's port>`. Each call below is given
a deadline of minutes; the module's pytest timeout is far shorter, so a client that waits
its deadline out fails the test (no wall-clock assertion). Real agents and a real master.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from conftest import AgentProcess, parse_ready
from test_operator_visibility import master_process

from hixl.client.engine import Engine
from hixl.client.mooncake import MooncakeDistributedStore
from hixl.client.store_client import MasterClient
from hixl.errors import WrongServer
from hixl.registry_client import RegistryClient
from hixl.store_codes import ErrorCode
from hixl.store_types import MasterRpcError, MasterWrongServer
from hixl.wrong_server import REGISTRY

StartAgent = Callable[..., AgentProcess]
#: every client's deadline here: far beyond the test's timeout, so waiting it out fails
LONG_S = 600.0

pytestmark = pytest.mark.timeout(120)

REACHED_AGENT = "serves gRPC but not the hixl Master service (the KV store): an hixl agent's " \
                "gRPC port"
REACHED_DATA = "does not speak gRPC: an hixl agent's data port"
MASTER_FIX = "Give the store hixl-master's address, host:port"


def _ports(agent: AgentProcess) -> dict[str, str]:
    return {"grpc": agent.engine, "data": parse_ready(agent.ready_line)["data"]}


@pytest.mark.parametrize("port", ["grpc", "data"])
def test_master_client_at_an_agent_says_what_it_reached(agent_process: StartAgent,
                                                        port: str) -> None:
    target = _ports(agent_process())[port]
    with MasterClient(target, timeout=LONG_S) as master, \
            pytest.raises(MasterWrongServer) as caught:
        master.heartbeat()
    said = str(caught.value)
    assert said.startswith(f"[UNSUPPORTED 103905] heartbeat at master {target}: {target} "
                           f"{REACHED_AGENT if port == 'grpc' else REACHED_DATA}")
    assert MASTER_FIX in said
    assert "Method not found" not in said and "Failed parsing HTTP/2" not in said
    # still a failed master call for the store (RPC_FAIL), and a WrongServer for hixl
    assert isinstance(caught.value, MasterRpcError) and isinstance(caught.value, WrongServer)
    assert caught.value.code == ErrorCode.RPC_FAIL


@pytest.mark.parametrize("port", ["grpc", "data"])
def test_store_setup_at_an_agent_fails_at_once_naming_it(agent_process: StartAgent,
                                                         port: str) -> None:
    target = _ports(agent_process())[port]
    store = MooncakeDistributedStore(master_timeout=LONG_S, setup_timeout=LONG_S)
    try:
        rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 1 << 20, "tcp", "", target)
        assert rc == ErrorCode.RPC_FAIL
        said = store.last_error
        assert said.startswith(f"setup: master_server_addr {target} is not a hixl-master: "
                               f"heartbeat at master {target}: {target} ")
        assert (REACHED_AGENT if port == "grpc" else REACHED_DATA) in said
        assert MASTER_FIX in said
        assert "hixl-master --port" not in said and "within" not in said
    finally:
        store.close()


def test_store_with_a_segment_at_an_agents_grpc_port_fails_at_once(
        agent_process: StartAgent) -> None:
    """The mount path (a client contributing memory) stops at once too."""
    agent = agent_process(config={"pool": [{"size": "4MiB"}]})
    store = MooncakeDistributedStore(agent=agent.engine, master_timeout=LONG_S,
                                     setup_timeout=LONG_S)
    try:
        rc = store.setup("127.0.0.1", "P2PHANDSHAKE", 1 << 20, 1 << 20, "tcp", "",
                         agent.engine)
        assert rc == ErrorCode.RPC_FAIL
        said = store.last_error
        assert said.startswith(f"setup: master_server_addr {agent.engine} is not a "
                               f"hixl-master: mount of segment ")
        assert f"at master {agent.engine}: {agent.engine} {REACHED_AGENT}" in said
    finally:
        store.close()


def test_engine_registry_at_an_agent_with_a_master_says_it_serves_no_registry(
        agent_process: StartAgent) -> None:
    """An agent that publishes to a master serves no registry of its own."""
    with master_process() as master:
        middle = agent_process(config={"master": master})
        with Engine("127.0.0.1", registry=middle.engine) as engine:
            table = engine.global_table
            assert table is not None
            with pytest.raises(WrongServer) as caught:
                table.require(LONG_S)
            said = str(caught.value)
            assert f"registry {middle.engine} has not answered" in said
            assert (f"{middle.engine} serves gRPC but not the hixl Registry service: an hixl "
                    "agent that publishes to a master of its own") in said
            assert "Give Engine(registry=...) (HIXL_REGISTRY) the address the agents' " \
                   "--master names" in said
            assert "Method not found" not in said
            with pytest.raises(WrongServer):
                engine.engines()


def test_engine_registry_at_an_agents_data_port_says_it_is_not_grpc(
        agent_process: StartAgent) -> None:
    agent = agent_process()
    data = _ports(agent)["data"]
    with Engine("127.0.0.1", registry=data) as engine:
        table = engine.global_table
        assert table is not None
        # connect waits for the registry's first snapshot only while waiting can help:
        # then it reaches the agent by handshake
        engine.connect(agent.engine, timeout=LONG_S)
        assert engine.segments(agent.engine) == agent.info.segments
        with pytest.raises(WrongServer) as caught:
            table.require(LONG_S)
        said = str(caught.value)
        assert f"{data} does not speak gRPC: an hixl agent's data port" in said
        assert "Failed parsing HTTP/2" not in said
    with RegistryClient(data, timeout=LONG_S, expect=REGISTRY) as client, \
            pytest.raises(WrongServer) as direct:
        client.query()
    assert str(direct.value).startswith(f"[UNSUPPORTED 103905] query of registry {data}: "
                                        f"{data} does not speak gRPC")


def test_a_wrong_address_among_several_is_passed_over(agent_process: StartAgent) -> None:
    """Given every master address, one that is an agent's port is skipped like a master
    that is down: the store's calls and the engine's registry go to the real master."""
    agent = agent_process()
    ports = _ports(agent)
    with master_process() as master:
        with MasterClient(f"{ports['grpc']},{master}", timeout=LONG_S) as client:
            client.heartbeat()
            assert client.current == master
        with RegistryClient(f"{ports['data']},{master}", timeout=LONG_S,
                            expect=REGISTRY) as registry:
            registry.query()
            assert registry.current == master
        with Engine("127.0.0.1", registry=f"{ports['data']},{master}") as engine:
            table = engine.global_table
            assert table is not None
            table.require(LONG_S)
            assert table.current == master
