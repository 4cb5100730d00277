"""Shared fixtures: real hixl-agent processes on free ports with private runtime dirs.

Also sorts every test into one kind, a pytest marker (pyproject.toml lists them):

    unit       no process started: in-process objects and servers only (seconds)
    process    real daemons or other child processes (hixl-agent, hixl-master, workers)
    multihost  simulated hosts in network namespaces (tests/netns.py; root)
    etcd       a real etcd cluster (tests/etcd_cluster.py)
    fuzz       the fuzzers (tests/test_fuzz_*.py)

`bash scripts/test.sh` runs them all; `bash scripts/test.sh -m unit` only the unit tests.
The kind is found, not declared (`_kind_of`): a test that reaches, through its own code,
its fixtures or the helpers in tests/ they call, a way to start a process (subprocess,
multiprocessing, os.fork, a hixl module that starts processes) is "process"; the first of
multihost, etcd, fuzz that applies wins over that. A kind marker put on a test or a
parameter by hand wins over what is found (test_metadata's places). A test still sorted
"unit" that starts a process anyway fails, naming what it started (`_refuse_processes`),
so "unit" stays true.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import inspect
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import Any

import pytest
import yaml
from etcd_cluster import EtcdCluster, start_cluster_or_skip

from hixl.auth import load_token
from hixl.client.agent_client import AgentClient, AgentInfo
from hixl.processes import DaemonProcess, ProcessNotReady
from hixl.tools.daemons import MasterProcess

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


def _remove_file(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def temporary_log(owner: object, prefix: str) -> str:
    """A new temporary file for `owner`'s log (a DaemonProcess's log_path), removed once
    `owner` is gone (or at exit)."""
    fd, path = tempfile.mkstemp(prefix=prefix, suffix=".log")
    os.close(fd)
    weakref.finalize(owner, _remove_file, path)
    return path


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


def start_agent(config_path: str, *args: str, log_path: str, env: Mapping[str, str] | None = None,
                timeout: float = START_TIMEOUT_S, **popen: Any) -> tuple[DaemonProcess, str]:
    """A hixl-agent started from `config_path` (stderr to `log_path`, environment
    clean_env(env)) and its ready line, once it serves; fails the test with its log otherwise."""
    agent = DaemonProcess(agent_command(config_path, *args), name="hixl-agent",
                          ready=READY_PREFIX, env=clean_env(env), log_path=log_path, **popen)
    try:
        return agent, agent.wait_ready(timeout)
    except ProcessNotReady as exc:
        pytest.fail(str(exc))


@contextlib.contextmanager
def master_process(*flags: str, env: Mapping[str, str] | None = None,
                   log_path: str | None = None) -> Iterator[str]:
    """A hixl-master on a free port of 127.0.0.1 with `flags` (a MasterProcess, environment
    clean_env(env), stderr to `log_path`: a temporary file by default); yields its address
    once it serves, and kills it after (its log removed)."""
    with MasterProcess(extra=flags, env=clean_env(env), log_path=log_path) as master:
        yield master.target


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
    daemons: list[DaemonProcess] = []
    workdirs: list[str] = []

    def start(config: Mapping[str, Any] | None = None, args: tuple[str, ...] | list[str] = (),
              env: Mapping[str, str] | None = None,
              timeout: float = START_TIMEOUT_S) -> AgentProcess:
        # short path: unix socket paths are limited to 107 bytes
        workdir = tempfile.mkdtemp(prefix="hxa-")
        workdirs.append(workdir)
        runtime_dir = os.path.join(workdir, "run")
        settings: dict[str, Any] = {"host": "127.0.0.1", "grpc_port": 0, "data_port": 0,
                                    "runtime_dir": runtime_dir, "log_level": "INFO",
                                    "state_dir": TEST_STATE_DIR}
        settings.update(config or {})
        config_path = os.path.join(workdir, "agent.yaml")
        with open(config_path, "w", encoding="utf-8") as f:
            yaml.safe_dump(settings, f)
        log_path = os.path.join(workdir, "agent.log")
        daemon, line = start_agent(config_path, *args, log_path=log_path, env=env,
                                   timeout=timeout)
        daemons.append(daemon)
        engine = parse_ready(line)["engine"]
        # the agent's own token resolution: its cluster_token_file, else the environment
        token = load_token(settings.get("cluster_token_file") or None, clean_env(env))
        with AgentClient(engine, timeout=10.0, cluster_token=token) as client:
            info = client.handshake("pytest")
        return AgentProcess(daemon.proc, engine, info, runtime_dir=settings["runtime_dir"],
                            log_path=log_path, config_path=config_path, ready_line=line)

    yield start

    for daemon in daemons:
        with contextlib.suppress(subprocess.TimeoutExpired):
            daemon.kill()
    for workdir in workdirs:
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


# ---------------------------------------------------------------------------------------
# Tests by kind (the module docstring): markers found from what a test's code reaches.

KINDS = ("unit", "process", "multihost", "etcd", "fuzz")
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
#: names whose presence in a test's code (a global, an attribute, an import) starts a process
_SPAWN_NAMES = frozenset({"subprocess", "Popen", "multiprocessing", "fork", "forkpty",
                          "posix_spawn", "posix_spawnp", "create_subprocess_exec",
                          "create_subprocess_shell", "spawnv_passfds"})
#: the tests/ helper modules that make a kind of their own
_KIND_OF_HELPER = {"netns": "multihost", "etcd_cluster": "etcd"}


def _in_tests(module_name: str) -> bool:
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None) or ""
    return os.path.dirname(os.path.abspath(path)) == TESTS_DIR if path else False


_SPAWN_WORDS = ("subprocess", "multiprocessing", "os.fork", "posix_spawn", "forkpty")
_LIBRARY_SPAWNS: dict[str, bool] = {}
#: library functions that start nothing, in a module that can (the launcher's port picker)
_STARTS_NOTHING = frozenset({("hixl.processes", "free_port"), ("hixl.processes", "free_ports")})


def _library_spawns(module_name: str, _path: tuple[str, ...] = ()) -> bool:
    """Whether a hixl module can start processes: its source names a way to, or it imports
    (at the top or inside a function) a hixl module that can."""
    if module_name in _LIBRARY_SPAWNS:
        return _LIBRARY_SPAWNS[module_name]
    if module_name in _path:  # an import cycle: decided where it started
        return False
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        spec = None
    origin = spec.origin if spec is not None else None
    if not origin or not origin.endswith(".py"):
        return False
    with open(origin, encoding="utf-8") as f:
        source = f.read()
    found = any(word in source for word in _SPAWN_WORDS)
    if not found:
        package = module_name if origin.endswith("__init__.py") else module_name.rpartition(".")[0]
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                names = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            if any(name.startswith("hixl") and name != module_name
                   and _library_spawns(name, (*_path, module_name)) for name in names):
                found = True
                break
    _LIBRARY_SPAWNS[module_name] = found
    return found


class _Reach:
    """The kinds a piece of test code reaches: its names, followed through the functions
    and classes of tests/ it uses; library objects count by their module."""

    def __init__(self) -> None:
        self.kinds: set[str] = set()
        self._seen: set[int] = set()

    def code(self, code: Any, namespace: Mapping[str, Any]) -> None:
        if id(code) in self._seen:
            return
        self._seen.add(id(code))
        for name in code.co_names:
            if name in _SPAWN_NAMES:
                self.kinds.add("process")
            if name in _KIND_OF_HELPER and _in_tests(name):
                self.kinds.add(_KIND_OF_HELPER[name])
            if name in namespace:
                self.value(namespace[name])
            elif name in sys.modules and name.startswith("hixl"):
                self.value(sys.modules[name])
        for const in code.co_consts:
            if hasattr(const, "co_names"):  # nested functions, lambdas, comprehensions
                self.code(const, namespace)

    def value(self, value: Any) -> None:
        if id(value) in self._seen:
            return
        if isinstance(value, ModuleType):
            self._seen.add(id(value))
            module_name = value.__name__
            if module_name in _KIND_OF_HELPER and _in_tests(module_name):
                self.kinds.add(_KIND_OF_HELPER[module_name])
            elif _in_tests(module_name):
                for item in vars(value).values():
                    if getattr(item, "__module__", None) == module_name:
                        self.value(item)
            elif module_name.startswith("hixl") and _library_spawns(module_name):
                self.kinds.add("process")
            return
        if isinstance(value, (dict, list, tuple, set, frozenset)) and len(value) <= 1000:
            self._seen.add(id(value))  # e.g. a table of backends a fixture picks from
            for element in (value.values() if isinstance(value, dict) else value):
                self.value(element)
            return
        value = getattr(value, "__func__", value)  # static/class methods
        value = getattr(value, "fget", value)  # properties
        with contextlib.suppress(ValueError):  # decorated (contextmanager, functools.wraps)
            value = inspect.unwrap(value) if callable(value) else value
        module_name = getattr(value, "__module__", None)
        if not isinstance(module_name, str):
            return
        if module_name in _KIND_OF_HELPER and _in_tests(module_name):
            self.kinds.add(_KIND_OF_HELPER[module_name])
            return
        if module_name.startswith("hixl"):
            if (_library_spawns(module_name)
                    and (module_name, getattr(value, "__name__", "")) not in _STARTS_NOTHING):
                self.kinds.add("process")
            return
        if not _in_tests(module_name):
            return
        self._seen.add(id(value))
        if isinstance(value, type):
            for klass in value.__mro__:
                if _in_tests(getattr(klass, "__module__", "")):
                    for item in vars(klass).values():
                        self.value(item)
                else:  # a library base (a DaemonProcess subclass's) counts by its module
                    self.value(klass)
            return
        code = getattr(value, "__code__", None)
        if code is not None:
            self.code(code, getattr(value, "__globals__", {}))


def _kind_of(item: pytest.Item) -> str:
    module_name = item.module.__name__ if isinstance(item, pytest.Function) else ""
    markers = {mark.name for mark in item.iter_markers()}
    for kind in KINDS:
        if kind in markers:  # declared by hand: wins
            return kind
    reach = _Reach()
    if isinstance(item, pytest.Function):
        reach.value(item.function)
        if item.cls is not None:
            reach.value(item.cls)
        info = getattr(item, "_fixtureinfo", None)
        fixtures = list(info.name2fixturedefs.values()) if info else []
        # fixtures asked for by name (request.getfixturevalue("name")) and their own
        manager = item.session._fixturemanager
        code = getattr(inspect.unwrap(item.function), "__code__", None)
        for name in (_strings_in(code) if code is not None else ()):
            if name.isidentifier() and name not in item.fixturenames:
                fixtures.append(manager.getfixturedefs(name, item) or ())
        for definitions in fixtures:
            for definition in definitions:
                reach.value(inspect.unwrap(definition.func))
    else:  # not a Python function (none today): assume the worst
        reach.kinds.add("process")
    if "netns" in markers or "netns" in item.fixturenames:
        reach.kinds.add("multihost")
    if "cluster" in item.fixturenames and _fixture_is_etcd(item):
        reach.kinds.add("etcd")
    if module_name.startswith("test_fuzz_"):
        reach.kinds.add("fuzz")
    for kind in ("multihost", "etcd", "fuzz", "process"):
        if kind in reach.kinds:
            return kind
    return "unit"


def _strings_in(code: Any) -> Iterator[str]:
    for const in code.co_consts:
        if isinstance(const, str):
            yield const
        elif hasattr(const, "co_consts"):
            yield from _strings_in(const)


def _fixture_is_etcd(item: pytest.Item) -> bool:
    """Whether the test's `cluster` is this file's etcd one (not a module's own)."""
    info = getattr(item, "_fixtureinfo", None)
    definitions = info.name2fixturedefs.get("cluster", ()) if info else ()
    return bool(definitions) and inspect.unwrap(definitions[-1].func).__module__ == __name__


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by these markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(_kind_of(item))


class _Refused(pytest.fail.Exception):
    pass


@contextlib.contextmanager
def _refuse_processes(item: pytest.Item) -> Iterator[list[str]]:
    """While a unit test runs: starting a process from the test's own threads (the main
    one, or any it started) fails it, naming what it started. Threads alive before it
    (a daemon's, left by an earlier test) are not the test's, and are let through."""
    import multiprocessing.util

    before = {t.ident for t in threading.enumerate()} - {threading.main_thread().ident}
    started: list[str] = []
    patches: list[tuple[Any, str, Any]] = []

    def refuse(owner: Any, name: str) -> None:
        original = getattr(owner, name)

        def refused(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() in before:
                return original(*args, **kwargs)
            what = f"{getattr(owner, '__name__', owner)}.{name}"
            started.append(what)
            raise _Refused(f"{item.nodeid} is a unit test (tests/conftest.py) but started a "
                           f"process ({what}): unit tests start none; if it must, make it a "
                           f"process test: @pytest.mark.process", pytrace=True)

        patches.append((owner, name, original))
        setattr(owner, name, refused)

    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
        if hasattr(os, name):
            refuse(os, name)
    refuse(subprocess.Popen, "_execute_child")
    refuse(multiprocessing.util, "spawnv_passfds")
    try:
        yield started
    finally:
        for owner, name, original in reversed(patches):
            setattr(owner, name, original)


def _unit_wrapper(item: pytest.Item) -> Iterator[None]:
    if item.get_closest_marker("unit") is None:
        return (yield)
    with _refuse_processes(item) as started:
        result = yield
    if started:  # refused, but the refusal was swallowed on the way
        pytest.fail(f"{item.nodeid} is a unit test but tried to start processes "
                    f"({', '.join(started)}): make it a process test (@pytest.mark.process)",
                    pytrace=False)
    return result


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    return (yield from _unit_wrapper(item))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    return (yield from _unit_wrapper(item))
