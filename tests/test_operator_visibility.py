"""Silence that is not health (issue 20, item 2): an agent whose master is down, or that
holds the wrong cluster token, says on its ready line and in its log that it is not
published and why, and `hixl status` says so too. Real agents, a real master.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from conftest import AgentProcess, clean_env, master_process, parse_ready

from hixl.processes import free_port

StartAgent = Callable[..., AgentProcess]
DEADLINE_S = 30.0


def _status(agent: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hixl.tools.cli", "status", "--agent", agent,
                           "--timeout", "5"], capture_output=True, text=True, timeout=60,
                          env=clean_env())


def test_agent_with_its_master_down_says_it_is_not_published(agent_process: StartAgent) -> None:
    master = f"127.0.0.1:{free_port()}"  # nothing listens there: connections are refused
    agent = agent_process(config={"master": master, "pool": [{"size": "64KiB"}]})
    assert parse_ready(agent.ready_line)["registry"] == "not-published"
    log = agent.log()
    assert f"WARNING hixl.agent [-] serving, but not published to master {master}: " in log
    status = _status(agent.engine)
    assert status.returncode == 1
    assert f"master {master}: not published: " in status.stdout
    assert f"agent {agent.engine}: not published to master {master}: " in status.stderr


def test_agent_with_the_wrong_token_says_why_it_is_not_published(
        agent_process: StartAgent, tmp_path: Path) -> None:
    good, wrong = tmp_path / "good.token", tmp_path / "wrong.token"
    good.write_text("the-cluster-token-0123456789abcdef\n", encoding="utf-8")
    wrong.write_text("not-the-cluster-token-0123456789\n", encoding="utf-8")
    good.chmod(0o600)
    wrong.chmod(0o600)
    with master_process("--cluster-token-file", str(good)) as master:
        agent = agent_process(config={"master": master, "cluster_token_file": str(wrong)})
        assert parse_ready(agent.ready_line)["registry"] == "not-published"
        assert "wrong cluster token" in agent.log()
        assert "cluster_token=on" in agent.log()


def test_agent_with_its_master_up_says_published(agent_process: StartAgent) -> None:
    with master_process() as master:
        agent = agent_process(config={"master": master})
        assert parse_ready(agent.ready_line)["registry"] == "published"
        assert "cluster_token=off" in agent.log()
    embedded = agent_process()
    assert parse_ready(embedded.ready_line)["registry"] == "embedded"


def test_agent_whose_master_is_an_agents_data_port_is_told_so(agent_process: StartAgent) -> None:
    """A wrong-port mistake in key 'master': the reason names what it reached."""
    other = agent_process()
    data = parse_ready(other.ready_line)["data"]
    agent = agent_process(config={"master": data})
    assert parse_ready(agent.ready_line)["registry"] == "not-published"
    assert ("does not speak gRPC: key 'master' (--master) must be a hixl-master's "
            "host:port, not an agent's data port") in agent.log()
    status = _status(agent.engine)
    assert status.returncode == 1 and "does not speak gRPC" in status.stdout


def test_agent_whose_master_is_another_agent_with_a_master_is_told_so(
        agent_process: StartAgent) -> None:
    with master_process() as master:
        middle = agent_process(config={"master": master})
        agent = agent_process(config={"master": middle.engine})
        assert parse_ready(agent.ready_line)["registry"] == "not-published"
        assert "serves gRPC but no registry: key 'master' (--master) must be a hixl-master's" \
            in agent.log()
