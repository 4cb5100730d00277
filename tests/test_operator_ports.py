"""Wrong-port mistakes (issue 20, item 1): three ports (master, agent gRPC, agent data)
make dialling the wrong one the likeliest mistake. Each client path says what it reached
and what it expected; a remote name without a port is refused instead of dialling :443.
Real agents and a real master.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from conftest import AgentProcess, parse_ready
from test_operator_visibility import master_process

from hixl.client.engine import Engine
from hixl.errors import ParamInvalid, WrongServer, hint_for

StartAgent = Callable[..., AgentProcess]
TIMEOUT_S = 10.0


def test_connect_to_an_agents_data_port_says_it_is_not_grpc(agent_process: StartAgent) -> None:
    agent = agent_process()
    data = parse_ready(agent.ready_line)["data"]
    with Engine("127.0.0.1") as engine, pytest.raises(WrongServer) as caught:
        engine.connect(data, timeout=TIMEOUT_S)
    said = str(caught.value)
    assert f"handshake at agent {data}: {data} does not speak gRPC: an agent's data port" in said
    assert "Failed parsing HTTP/2" not in said
    assert "host:grpc_port" in hint_for(caught.value)


def test_connect_to_the_masters_port_says_it_is_not_an_agent() -> None:
    with master_process() as master, Engine("127.0.0.1") as engine, \
            pytest.raises(WrongServer) as caught:
        engine.connect(master, timeout=TIMEOUT_S)
    said = str(caught.value)
    assert said.startswith(f"[UNSUPPORTED 103905] handshake at agent {master}: {master} "
                           "serves gRPC but not the hixl Agent service: a hixl-master's port")
    assert "Method not found" not in said and "MEM_HOST" not in hint_for(caught.value)


def test_a_remote_engine_name_without_a_port_is_refused() -> None:
    with Engine("127.0.0.1") as engine, pytest.raises(ParamInvalid) as caught:
        engine.connect("127.0.0.1", timeout=TIMEOUT_S)
    assert "engine name '127.0.0.1' has no port" in str(caught.value)
    assert "e.g. '127.0.0.1:50161'" in str(caught.value)
