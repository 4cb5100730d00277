"""An agent serving from a background thread is stopped when its process exits.

Client processes embed agents (Engine("ip:port"), the Mooncake adapters) and often exit
without closing them. The agent's uvloop runs in a daemon thread; a timer firing there
after the interpreter is finalized crashed the process with SIGSEGV (seen about once in
30 runs of tests/test_mooncake_te.py). An atexit hook now stops every background agent
first: its loop is closed and its socket files are gone before finalization.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

from hixl.server.agent import runtime
from hixl.server.agent.config import AgentConfig


def _config(runtime_dir: Path) -> AgentConfig:
    return AgentConfig(host="127.0.0.1", grpc_port=0, runtime_dir=str(runtime_dir),
                       pool=[], log_level="WARNING")


def test_the_exit_hook_stops_background_agents(tmp_path: Path) -> None:
    server = runtime.AgentServer(_config(tmp_path / "run")).start()
    try:
        assert server in runtime._BACKGROUND
        assert os.listdir(tmp_path / "run"), "the agent's sockets"
        runtime._stop_background_agents()
        assert server not in runtime._BACKGROUND
        assert server._thread is not None and not server._thread.is_alive()
        assert os.listdir(tmp_path / "run") == []
    finally:
        server.stop()


def test_a_process_exiting_with_an_open_agent_stops_it_cleanly(tmp_path: Path) -> None:
    script = f"""
from hixl.server.agent.runtime import AgentServer
from hixl.server.agent.config import AgentConfig
AgentServer(AgentConfig(host="127.0.0.1", grpc_port=0, runtime_dir={str(tmp_path / 'run')!r},
                        pool=[], log_level="WARNING")).start()
print("serving", flush=True)
"""  # and exits without stop()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "serving"
    assert os.listdir(tmp_path / "run") == []  # stop() ran: it removes its socket files


def test_an_agent_taking_a_stopping_agents_port_keeps_its_sockets(tmp_path: Path) -> None:
    # With grpc_port 0 the OS may hand a stopping agent's port to a new one at once (seen
    # in CI among 300 short-lived engines), and the socket paths are named after the port.
    # The new agent starts the moment the old one's gRPC port is released: it must find
    # its paths free, and the old agent, finishing its stop, must leave them alone.
    run_dir = tmp_path / "run"
    first = runtime.AgentServer(_config(run_dir)).start()
    port = int(first.engine_name.rsplit(":", 1)[1])
    taker: list[runtime.AgentServer] = []
    refusals: list[Exception] = []  # the stop swallows what its steps raise: keep it here
    grpc_server = first._grpc
    assert grpc_server is not None
    release_port = grpc_server.stop

    async def release_then_hand_over(grace: float | None) -> None:
        await release_port(grace)
        config = dataclasses.replace(_config(run_dir), grpc_port=port)
        try:
            taker.append(await asyncio.to_thread(runtime.AgentServer(config).start))
        except Exception as exc:  # noqa: BLE001 - asserted below
            refusals.append(exc)

    grpc_server.stop = release_then_hand_over  # type: ignore[method-assign]
    try:
        first.stop()
        assert refusals == [] and len(taker) == 1, refusals
        second = taker[0]
        assert second.engine_name == f"127.0.0.1:{port}"
        assert sorted(os.listdir(run_dir)) == sorted(
            os.path.basename(path) for path in (second.endpoints.data_unix,
                                                second.endpoints.fd_socket) if path)
    finally:
        first.stop()
        for server in taker:
            server.stop()
    assert os.listdir(run_dir) == []
