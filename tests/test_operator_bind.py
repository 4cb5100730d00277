"""Bind errors in one voice (issue 20, items 6 and 7): what could not be served, on which
address, why, and the setting to change, for every listener of a real hixl-agent and
hixl-master; two agents sharing a runtime_dir and port are told which setting parts them.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml
from conftest import TEST_STATE_DIR, AgentProcess, clean_env

StartAgent = Callable[..., AgentProcess]
#: in TEST-NET-1 (RFC 5737): never an address of the machine running the tests
FOREIGN_HOST = "192.0.2.1"


@contextlib.contextmanager
def listening() -> Iterator[int]:
    """A port some other program listens on while the block runs."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield int(sock.getsockname()[1])


def _agent(tmp_path: Path, **settings: object) -> subprocess.CompletedProcess[str]:
    config = {"host": "127.0.0.1", "grpc_port": 0, "data_port": 0,
              "runtime_dir": str(tmp_path / "run"), "state_dir": TEST_STATE_DIR, **settings}
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return subprocess.run([sys.executable, "-m", "hixl.server.main", "--config", str(path)],
                          capture_output=True, text=True, timeout=120, env=clean_env())


def _master(*flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hixl.server.master.master", "--no-persist", *flags],
                          capture_output=True, text=True, timeout=120, env=clean_env())


def test_agent_grpc_port_in_use(tmp_path: Path) -> None:
    with listening() as port:
        result = _agent(tmp_path, grpc_port=port)
    assert result.returncode == 1
    assert (f"cannot serve gRPC on 127.0.0.1:{port}: port {port} is in use by another "
            f"process") in result.stderr
    assert "choose another port with key 'grpc_port' (--grpc-port, HIXL_AGENT_GRPC_PORT)" \
        in result.stderr


def test_agent_data_port_in_use(tmp_path: Path) -> None:
    with listening() as port:
        result = _agent(tmp_path, data_port=port)
    assert result.returncode == 1
    assert (f"cannot serve the data path on 127.0.0.1:{port}: port {port} is in use by "
            "another process") in result.stderr
    assert "key 'data_port' (--data-port, HIXL_AGENT_DATA_PORT)" in result.stderr
    assert "[Errno 98]" not in result.stderr


def test_agent_metrics_port_in_use(tmp_path: Path) -> None:
    with listening() as port:
        result = _agent(tmp_path, metrics_port=port)
    assert result.returncode == 1
    assert (f"cannot serve metrics on 127.0.0.1:{port}: port {port} is in use by another "
            "process") in result.stderr
    assert ("choose another port with key 'metrics_port' (--metrics-port, "
            "HIXL_AGENT_METRICS_PORT), 0 for no metrics endpoint") in result.stderr


def test_agent_host_not_on_this_machine(tmp_path: Path) -> None:
    result = _agent(tmp_path, host=FOREIGN_HOST)
    assert result.returncode == 1
    assert (f"cannot serve gRPC on {FOREIGN_HOST}:0: '{FOREIGN_HOST}' is not an address of "
            "this machine; set key 'host' (--host) to an address of this machine") \
        in result.stderr
    assert "port in use?" not in result.stderr


def test_master_port_in_use_and_host_not_here() -> None:
    with listening() as port:
        result = _master("--port", str(port))
    assert result.returncode == 1
    assert result.stderr.startswith(
        f"hixl-master: cannot serve gRPC on 127.0.0.1:{port}: port {port} is in use")
    assert "--port (--rpc_port, key 'port', HIXL_MASTER_PORT)" in result.stderr
    assert "Failed to add port" not in result.stderr  # no gRPC C-core line
    result = _master("--host", FOREIGN_HOST, "--port", "0")
    assert result.returncode == 1
    assert f"'{FOREIGN_HOST}' is not an address of this machine; set --host" in result.stderr


def test_two_agents_sharing_runtime_dir_and_port_are_told_the_setting(
        agent_process: StartAgent, tmp_path: Path) -> None:
    first = agent_process()
    port = int(first.engine.rsplit(":", 1)[1])
    result = _agent(tmp_path, host="127.0.0.2", grpc_port=port, runtime_dir=first.runtime_dir)
    assert result.returncode == 1
    assert "another process is already serving on" in result.stderr
    assert (f"another agent with grpc_port {port} uses this runtime_dir; give each agent "
            "on this host its own key 'runtime_dir' (--runtime-dir, HIXL_AGENT_RUNTIME_DIR)") \
        in result.stderr


@pytest.mark.parametrize(("flag", "what", "setting"), [
    ("--fast-port", "the store call endpoint", "--fast-port (key 'fast_port'"),
    ("--metrics-port", "the HTTP side (metrics)", "--metrics-port (--metrics_port, key"),
])
def test_master_other_ports_in_use(flag: str, what: str, setting: str) -> None:
    with listening() as port:
        result = _master("--port", "0", flag, str(port))
    assert result.returncode == 1
    assert (f"hixl-master: cannot serve {what} on 127.0.0.1:{port}: port {port} is in use by "
            "another process") in result.stderr
    assert f"choose another port with {setting}" in result.stderr
