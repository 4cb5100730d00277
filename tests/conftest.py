"""Shared fixtures: real hixl-agent processes on free ports with private runtime dirs."""

from __future__ import annotations

import contextlib
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import Any

import pytest
import yaml
from etcd_cluster import EtcdCluster, start_cluster_or_skip

from hixl.auth import load_token
from hixl.client.agent_client import AgentClient, AgentInfo

READY_PREFIX = "hixl-agent serving "
START_TIMEOUT_S = 30.0


class AgentProcess(tuple):
    """(proc, engine_name, info) — plus .runtime_dir, .log_path, .config_path, .ready_line."""

    proc: subprocess.Popen[str]
    engine: str
    info: AgentInfo
    runtime_dir: str
    log_path: str
    config_path: str
    ready_line: str

    def __new__(cls, proc: subprocess.Popen[str], engine: str, info: AgentInfo,
                **extra: str) -> AgentProcess:
        self = super().__new__(cls, (proc, engine, info))
        self.proc, self.engine, self.info = proc, engine, info
        for key, value in extra.items():
            setattr(self, key, value)
        return self

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()


def agent_command(config_path: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "hixl.server.main", "--config", config_path, *args]


# Agents keep a per-engine owner secret in their state dir (hixl.registry_client): the
# tests' agents, embedded ones included, keep theirs in one private directory per run,
# never in the host's /var/lib/hixl.
TEST_STATE_DIR = tempfile.mkdtemp(prefix="hixl-test-state-")
os.environ["HIXL_AGENT_STATE_DIR"] = TEST_STATE_DIR


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The test's environment without HIXL_AGENT_* (so the host's settings never leak in;
    `agent_process` puts the private state dir into its agents' YAML instead)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HIXL_AGENT_")}
    env.update(extra or {})
    return env


@pytest.fixture(scope="session", autouse=True)
def _private_state_dir() -> Iterator[None]:
    yield
    shutil.rmtree(TEST_STATE_DIR, ignore_errors=True)


def wait_ready(proc: subprocess.Popen[str], log_path: str, timeout: float) -> str:
    """The ready line from the agent's stdout; fails the test (with its log) otherwise."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while time.monotonic() < deadline:
            if sel.select(timeout=max(0.0, deadline - time.monotonic())):
                line = proc.stdout.readline()
                if line.startswith(READY_PREFIX):
                    return line.strip()
                if not line:  # exited before becoming ready
                    break
    proc.kill()
    proc.wait(10)
    with open(log_path, encoding="utf-8", errors="replace") as f:
        log = f.read()
    pytest.fail(f"hixl-agent did not become ready (rc={proc.returncode}); its log:\n{log}")


def parse_ready(line: str) -> dict[str, str]:
    fields = line[len(READY_PREFIX):].split()
    return dict(field.split("=", 1) for field in fields)


@pytest.fixture
def agent_process() -> Iterator[Callable[..., AgentProcess]]:
    """Factory: start a hixl-agent subprocess, wait until it serves, handshake with it.

        proc, engine, info = agent_process(config={"pool": [{"size": "1MiB"}]})

    `config` entries go into its YAML file (grpc_port/data_port 0 and a private, short
    runtime_dir by default); `args` are extra command-line flags; `env` extra environment.
    Every agent started is killed (if still running) and its runtime dir removed at teardown.
    """
    started: list[tuple[subprocess.Popen[str], str, Any]] = []

    def start(config: Mapping[str, Any] | None = None, args: tuple[str, ...] | list[str] = (),
              env: Mapping[str, str] | None = None,
              timeout: float = START_TIMEOUT_S) -> AgentProcess:
        # short path: unix socket paths are limited to 107 bytes
        workdir = tempfile.mkdtemp(prefix="hxa-")
        runtime_dir = os.path.join(workdir, "run")
        settings: dict[str, Any] = {"host": "127.0.0.1", "grpc_port": 0, "data_port": 0,
                                    "runtime_dir": runtime_dir, "log_level": "INFO",
                                    "state_dir": TEST_STATE_DIR}
        settings.update(config or {})
        config_path = os.path.join(workdir, "agent.yaml")
        with open(config_path, "w", encoding="utf-8") as f:
            yaml.safe_dump(settings, f)
        log_path = os.path.join(workdir, "agent.log")
        log_file = open(log_path, "w", encoding="utf-8")  # noqa: SIM115 - outlives this call
        proc = subprocess.Popen(agent_command(config_path, *args), stdout=subprocess.PIPE,
                                stderr=log_file, text=True, env=clean_env(env))
        log_file.close()
        started.append((proc, workdir, None))
        line = wait_ready(proc, log_path, timeout)
        engine = parse_ready(line)["engine"]
        # the agent's own token resolution: its cluster_token_file, else the environment
        token = load_token(settings.get("cluster_token_file") or None, clean_env(env))
        with AgentClient(engine, timeout=10.0, cluster_token=token) as client:
            info = client.handshake("pytest")
        return AgentProcess(proc, engine, info, runtime_dir=settings["runtime_dir"],
                            log_path=log_path, config_path=config_path, ready_line=line)

    yield start

    for proc, workdir, _ in started:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        if proc.stdout is not None:
            proc.stdout.close()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def netns() -> Iterator[Callable[[int], Any]]:
    """Factory for clusters of simulated hosts (tests/netns.py), torn down after the module.

        cluster = netns(3)   # 3 hosts: own netns, hostname, /tmp, /dev/shm, /run, pids

    Skips when namespaces cannot be made here (not root, no `ip`/`unshare`), except with
    CI=true, where the test fails instead: in CI these tests must run.
    """
    import netns as harness  # tests/netns.py

    harness.require()
    clusters: list[harness.Cluster] = []

    def make(n: int) -> harness.Cluster:
        cluster = harness.Cluster(n)
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.close()


#: each module's etcd `cluster` while it is up (so `_whole_again` finds it without
#: asking pytest for a fixture value that may be another module's kind, or torn down)
_ETCD_OF_MODULE: dict[ModuleType, EtcdCluster] = {}


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[EtcdCluster]:
    """A real 3-member etcd cluster (tests/etcd_cluster.py), one per module that asks for
    it; skips without etcd or aetcd (fails instead under CI)."""
    started = start_cluster_or_skip(3)
    _ETCD_OF_MODULE[request.module] = started
    yield started
    del _ETCD_OF_MODULE[request.module]
    started.close()


@pytest.fixture(autouse=True)
def _whole_again(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test that used the etcd `cluster` (and may have killed members), restart
    them, so the next test sees every member healthy. Tests without it pay nothing and
    never start etcd; a module's own fixture named `cluster` is left alone."""
    yield
    started = _ETCD_OF_MODULE.get(request.module)
    if started is not None and "cluster" in request.fixturenames:
        started.ensure_running()


def random_items(rng: Any, info: Any, local: Any, count: int, max_len: int,
                 max_gap: int = 3000) -> list[Any]:
    """Up to `count` transfer items of random lengths (1..max_len) at random gaps
    (0..max_gap) in both the remote segment `info` and the local ShmSegment `local`, in
    order and non-overlapping, so frame splits and lane cuts fall inside items."""
    from hixl.transports.base import Item

    items: list[Item] = []
    remote = near = 0
    for index in range(count):
        length = rng.randint(1, max_len)
        remote += rng.randint(0, max_gap)
        near += rng.randint(0, max_gap)
        if remote + length > info.length or near + length > local.length:
            break
        items.append(Item(index, local.addr + near, info, info.base + remote, length))
        remote += length
        near += length
    return items
