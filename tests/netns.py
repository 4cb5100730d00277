"""Simulated hosts on one machine, for multi-node tests (DESIGN §9).

A network namespace alone is not a separate host: two namespaces still share /dev/shm,
/tmp, /run, the hostname and process ids, so an engine would rightly decide they are one
node and map memory instead of using the network. Every `Host` here therefore gets

- its own network namespace, with `lo` up and a veth `eth0` plugged into a bridge that
  lives in a dedicated *switch* namespace (the root namespace is never touched), holding
  an address of a private test subnet `10.77.<cluster>.<n>/24` and no default route;
- its own UTS (hostname), mount (private tmpfs on /tmp, /dev/shm and /run) and PID
  namespace, made once by the host's "init" process
  `ip netns exec NS unshare -mu -p -f --mount-proc sh -c 'hostname H; mount ...; exec sleep'`;
  every process run on the host joins all four namespaces of that init (`nsenter -t PID
  -n -m -u -p`), so processes on one host share its /run, /dev/shm and hostname -- as on a
  real node, where a client and the node's agent see each other's unix sockets -- while
  processes on different hosts share nothing but the switch.

Paths the processes need (the repository, the virtual environment, the per-run directory
with config files) are bind-mounted back if they live under a directory the tmpfs hides,
so the harness works from a checkout under /tmp too. Config files and logs go to a per-run
directory under /var/tmp (the hosts' /tmp is private). Names carry the test process's pid;
everything is torn down by `Cluster.close()` (a context manager, also run at exit), and
namespaces left by a crashed earlier run are removed when the next cluster starts.

    with Cluster(3) as cluster:
        agent = cluster.start_agent(cluster.hosts[1], {"pool": [{"name": "kv", "size": "8MiB"}]})
        worker = cluster.worker(cluster.hosts[0], fabric="1")
        worker.ok("connect", agent=agent.engine)
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from hixl.processes import DaemonProcess, ProcessNotReady

PREFIX = "hxn"
SUBNET = "10.77"
GRPC_PORT = 50161
DATA_PORT = 50162
MASTER_PORT = 50051
HOST_IF = "eth0"
HIDDEN_ROOTS = ("/tmp", "/dev/shm", "/run")  # each host mounts a private tmpfs here
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS_DIR)
WORKER = os.path.join(TESTS_DIR, "helpers", "engine_worker.py")
READY_PREFIX = "hixl-agent serving "
BOOTED = "hixl-netns-host-booted"
START_TIMEOUT_S = 30.0
COMMAND_TIMEOUT_S = 30.0


class HarnessError(RuntimeError):
    """The harness itself could not do something (namespace setup, a process that died)."""


# ---------------------------------------------------------------- availability

@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """Why simulated hosts cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root (network, mount and PID namespaces)"
    for tool in ("ip", "unshare", "nsenter", "mount", "umount", "hostname", "sleep"):
        if shutil.which(tool) is None:
            return f"needs the `{tool}` command (iproute2 / util-linux)"
    probe = subprocess.run(
        ["unshare", "-n", "-m", "-u", "-p", "-f", "--mount-proc", "sh", "-c",
         "mount -t tmpfs none /tmp && ip link set lo up"],
        capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
    if probe.returncode != 0:
        return f"cannot create namespaces here: {probe.stderr.strip() or probe.returncode}"
    return None


def require() -> None:
    """Skip the calling test when hosts cannot be simulated -- unless CI=true: then fail."""
    import pytest

    reason = unavailable_reason()
    if reason is None:
        return
    if os.environ.get("CI") == "true":
        pytest.fail(f"netns tests must run in CI (CI=true) but cannot: {reason}")
    pytest.skip(f"simulated hosts unavailable: {reason}; they always run in CI")


# ---------------------------------------------------------------- plumbing

def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """An `ip` command; a failure raises HarnessError with its stderr."""
    result = subprocess.run(["ip", *args], capture_output=True, text=True,
                            timeout=COMMAND_TIMEOUT_S)
    if check and result.returncode != 0:
        raise HarnessError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_namespace(ns: str) -> None:
    """SIGKILL every process in network namespace `ns`, then delete it."""
    for _ in range(50):
        pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    _ip("netns", "delete", ns, check=False)


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines()
            if line.strip()]


def clean_stale() -> list[str]:
    """Remove namespaces and run dirs with our prefix left by runs whose process is gone."""
    removed = []
    for ns in _namespaces():
        parts = ns.split("-")
        if parts[0] == PREFIX and len(parts) > 1 and parts[1].isdigit() and not _pid_alive(
                int(parts[1])):
            _kill_namespace(ns)
            removed.append(ns)
    base = _run_base()
    with contextlib.suppress(OSError):
        for entry in os.listdir(base):
            parts = entry.split("-")
            if parts[0] == PREFIX and len(parts) == 2 and parts[1].isdigit() and not _pid_alive(
                    int(parts[1])):
                shutil.rmtree(os.path.join(base, entry), ignore_errors=True)
    return removed


def _run_base() -> str:
    return os.environ.get("HIXL_NETNS_DIR", "/var/tmp")


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def _hidden_root(path: str) -> str | None:
    return next((root for root in HIDDEN_ROOTS if _under(path, root)), None)


def kept_paths(extra: Sequence[str] = ()) -> list[str]:
    """Directories the hosts' processes need that a private tmpfs would hide, outermost only."""
    candidates = [REPO, sys.prefix, sys.exec_prefix, sys.base_prefix,
                  os.path.dirname(os.path.realpath(sys.executable)), *extra,
                  *(p for p in sys.path if p and os.path.isdir(p))]
    paths = sorted({os.path.realpath(p) for p in candidates if _hidden_root(os.path.realpath(p))})
    outermost: list[str] = []
    for path in paths:  # sorted: a parent comes before its children
        if not any(_under(path, kept) for kept in outermost):
            outermost.append(path)
    return outermost


# ---------------------------------------------------------------- processes

class HostProcess(subprocess.Popen):
    """A process started on a Host. `pid` is the `nsenter` wrapper; signals go to the program.

    The program is the wrapper's child, inside the host's PID namespace (its pid here is
    `program_pid()`), so `send_signal` -- and with it `kill()` and `terminate()` -- reaches
    the program itself; the wrapper exits with the program's status.
    """

    @staticmethod
    def child_of(proc: subprocess.Popen, timeout: float = 10.0) -> int | None:
        """The pid of `proc`'s (only) child; None once `proc` exited."""
        deadline = time.monotonic() + timeout
        while proc.poll() is None:
            try:
                with open(f"/proc/{proc.pid}/task/{proc.pid}/children", encoding="ascii") as f:
                    children = f.read().split()
            except OSError:
                children = []
            if children:
                return int(children[0])
            if time.monotonic() > deadline:
                raise HarnessError(f"process {proc.pid} started no program within {timeout}s")
            time.sleep(0.005)
        return None

    def program_pid(self, timeout: float = 10.0) -> int | None:
        """The program's pid in our namespace (the wrapper's child); None once it exited."""
        return self.child_of(self, timeout)

    def send_signal(self, sig: int) -> None:
        target = self.program_pid()
        if target is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(target, sig)
        if sig in (signal.SIGKILL, signal.SIGCONT):
            # nsenter stops itself when its child stops; it must run again to reap the child
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)


class Host:
    """One simulated host: its own network namespace, hostname, /tmp, /dev/shm, /run, pids."""

    def __init__(self, cluster: Cluster, index: int) -> None:
        self.cluster = cluster
        self.index = index
        self.ns = f"{cluster.prefix}-h{index}"
        self.name = f"{PREFIX}{cluster.number}h{index}"  # its hostname
        self.ip = f"{SUBNET}.{cluster.number}.{index}"
        self.switch_port = f"p{index}"
        self.init: DaemonProcess | None = None
        self.init_pid = 0

    def __repr__(self) -> str:
        return f"Host({self.name}, {self.ip})"

    def _boot_script(self) -> str:
        """The host's "init": hostname, private tmpfs mounts (keeping what we need), then sleep."""
        q = shlex.quote
        script = ["set -e", f"hostname {self.name}", "mount --make-rprivate /"]
        for k, root in enumerate(HIDDEN_ROOTS):
            # what we keep is reached through a bind of the old root, dropped afterwards
            mine = [p for p in self.cluster.kept if _under(p, root)]
            stash = os.path.join(self.cluster.run_dir, "stash", str(k))
            if mine:
                script.append(f"mount --bind {root} {q(stash)}")
            mode = "755" if root == "/run" else "1777"
            script.append(f"mount -t tmpfs -o mode={mode} none {root}")
            for path in mine:
                inner = stash + path[len(root):]
                script.append(f"mkdir -p {q(path)} && mount --bind {q(inner)} {q(path)}")
            if mine:
                script.append(f"umount -l {q(stash)}")
        script += [f"echo {BOOTED}", "exec sleep infinity"]
        return "\n".join(script)

    def boot(self) -> None:
        """Start the host's first process: it owns the host's UTS, mount and PID namespaces."""
        self.init = DaemonProcess(
            ["ip", "netns", "exec", self.ns, "unshare", "-mu", "-p", "-f", "--mount-proc",
             "--kill-child", "sh", "-c", self._boot_script()],
            name=f"{self}'s init", ready=BOOTED)
        try:
            self.init.wait_ready(COMMAND_TIMEOUT_S)
        except ProcessNotReady as exc:
            raise HarnessError(f"{self} did not boot: {exc}") from None
        pid = HostProcess.child_of(self.init.proc, COMMAND_TIMEOUT_S)
        if pid is None:
            raise HarnessError(f"{self}: its init exited at once")
        self.init_pid = pid

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` wrapped so that it runs on this host, in the namespaces of its init."""
        return ["nsenter", "-t", str(self.init_pid), "-n", "-m", "-u", "-p", f"--wd={REPO}",
                "--", *argv]

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """Our environment without HIXL_AGENT_* (a host's settings never leak in), plus `extra`."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("HIXL_AGENT_")}
        env.update(extra or {})
        return env

    def run(self, argv: Sequence[str], timeout: float = 60.0,
            env: Mapping[str, str] | None = None,
            input: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run `argv` on this host to completion (text output captured)."""
        return subprocess.run(self.command(argv), capture_output=True, text=True,
                              timeout=timeout, env=self.env(env), input=input)

    def spawn(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **popen: Any) -> HostProcess:
        """Start `argv` on this host; the cluster kills it at teardown if still running."""
        proc = HostProcess(self.command(argv), env=self.env(env), **popen)
        self.cluster.processes.append(proc)
        return proc

    def _set_link(self, state: str) -> None:
        _ip("-n", self.ns, "link", "set", HOST_IF, state)

    def link_down(self) -> None:
        """Unplug this host's cable (its side of the veth goes down)."""
        self._set_link("down")

    def link_up(self) -> None:
        self._set_link("up")

    def _counter(self, name: str) -> int:
        result = subprocess.run(
            ["ip", "netns", "exec", self.ns, "cat",
             f"/sys/class/net/{HOST_IF}/statistics/{name}"],
            capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S)
        if result.returncode != 0:
            raise HarnessError(f"{self}: cannot read {name}: {result.stderr.strip()}")
        return int(result.stdout)

    def tx_bytes(self) -> int:
        """Bytes this host has sent on its link (the veth's counter)."""
        return self._counter("tx_bytes")

    def rx_bytes(self) -> int:
        return self._counter("rx_bytes")


# ---------------------------------------------------------------- agents and workers

class AgentHandle:
    """A `hixl-agent` (python -m hixl.server.main) running on a host, ready to serve."""

    def __init__(self, host: Host, config: Mapping[str, Any], tag: str) -> None:
        self.host = host
        self.config: dict[str, Any] = {
            "host": host.ip, "grpc_port": GRPC_PORT, "data_port": DATA_PORT,
            "data_unix": True, "runtime_dir": "/run/hixl", "log_level": "INFO", **config}
        base = os.path.join(host.cluster.run_dir, f"agent-{host.name}-{tag}")
        self.config_path = base + ".yaml"
        self.log_path = base + ".log"
        with open(self.config_path, "w", encoding="utf-8") as f:
            yaml.safe_dump(self.config, f)
        self.process: DaemonProcess | None = None
        self.ready: dict[str, str] = {}
        self.start()

    @property
    def proc(self) -> subprocess.Popen[str] | None:
        """Its HostProcess (signals reach the agent), None before the first start."""
        return None if self.process is None else self.process.proc

    @property
    def engine(self) -> str:
        """The engine name peers dial: "ip:grpc_port"."""
        return self.ready["engine"]

    @property
    def epoch(self) -> int:
        return int(self.ready["epoch"])

    @property
    def data_tcp(self) -> tuple[str, int]:
        host, port = self.ready["data"].rsplit(":", 1)
        return host, int(port)

    def log(self) -> str:
        assert self.process is not None
        return self.process.log()

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        """Start the agent and wait for its ready line (HarnessError with its log otherwise)."""
        self.process = DaemonProcess(
            [sys.executable, "-m", "hixl.server.main", "--config", self.config_path],
            name=f"hixl-agent on {self.host}", ready=READY_PREFIX, log_path=self.log_path,
            spawn=self.host.spawn)
        try:
            self.process.wait_ready(timeout)
        except ProcessNotReady as exc:
            raise HarnessError(str(exc)) from None
        self.ready = self.process.ready_fields

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM (a clean shutdown), then SIGKILL if it has not exited by `timeout`."""
        assert self.process is not None
        return self.process.stop(timeout)

    def kill(self) -> int:
        """SIGKILL, and wait for it to be gone."""
        assert self.process is not None
        return self.process.kill()

    def restart(self, timeout: float = START_TIMEOUT_S) -> AgentHandle:
        """Kill it if it still runs, start it again on the same ports; a new epoch."""
        if self.proc is not None and self.proc.poll() is None:
            self.kill()
        self.start(timeout)
        return self


class WorkerError(AssertionError):
    """A worker step that was expected to succeed answered with an error."""


class Worker:
    """tests/helpers/engine_worker.py on a host, one Engine, driven step by step.

    Each `call` sends one JSON step on stdin and returns the JSON line it answers with;
    a step that fails with a HixlError answers {"error": ClassName, "status", "failed",
    "message"} and the engine stays usable for the next step.
    """

    def __init__(self, host: Host, fabric: str, tag: str, registry: str | None = None) -> None:
        self.host = host
        self.log_path = os.path.join(host.cluster.run_dir, f"worker-{host.name}-{tag}.log")
        job = {"fabric": fabric, "local": host.ip, "steps": "stdin", "registry": registry}
        self.process = DaemonProcess([sys.executable, WORKER, json.dumps(job)],
                                     name=f"worker on {host}", log_path=self.log_path,
                                     stop_by="stdin", lines=True, spawn=host.spawn)
        self.proc = self.process.proc

    def call(self, do: str, give_up: float = 60.0, **fields: Any) -> dict[str, Any]:
        """Run one step (its fields, e.g. the transfer's `timeout`, go to the worker).

        `give_up` only guards against a hang: no answer by then raises HarnessError.
        """
        self.process.send(json.dumps({"do": do, **fields}) + "\n")  # if it died: see below
        line = self.process.next_line(give_up)
        if not line:
            state = "exited" if line == "" else f"gave no answer within {give_up}s"
            raise HarnessError(f"worker on {self.host} {state} at step {do!r}; "
                               f"{self.process.tail()}")
        return json.loads(line)

    def ok(self, do: str, give_up: float = 60.0, **fields: Any) -> dict[str, Any]:
        """Run one step that must succeed."""
        reply = self.call(do, give_up, **fields)
        if "error" in reply:
            raise WorkerError(f"worker on {self.host}: step {do} failed: {reply}")
        return reply

    def close(self, timeout: float = 10.0) -> None:
        """End it (EOF on stdin closes the engine); killed if it does not exit in time."""
        self.process.stop(timeout)
        self.process.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------- the cluster

_live: list[Cluster] = []
_counter = 0


@atexit.register
def _close_all() -> None:
    for cluster in list(_live):
        cluster.close()


class Cluster:
    """`n` simulated hosts on one switch; a context manager that tears everything down."""

    def __init__(self, n: int) -> None:
        global _counter
        if not 1 <= n <= 250:
            raise ValueError(f"a cluster has 1..250 hosts, got {n}")
        _counter += 1
        self.number = _counter
        self.prefix = f"{PREFIX}-{os.getpid()}-{self.number}"
        self.switch_ns = f"{self.prefix}-sw"
        self.run_dir = os.path.join(_run_base(), f"{PREFIX}-{os.getpid()}", f"c{self.number}")
        self.hosts: list[Host] = []
        self.processes: list[HostProcess] = []
        self.agents: list[AgentHandle] = []
        self.workers: list[Worker] = []
        self._made: list[str] = []
        self._closed = False
        self._tags = 0
        _live.append(self)
        try:
            self._create(n)
        except BaseException:
            self.close()
            raise

    def _create(self, n: int) -> None:
        clean_stale()
        if _hidden_root(os.path.realpath(self.run_dir)):
            raise HarnessError(f"run dir {self.run_dir} is under {HIDDEN_ROOTS}, which every "
                               "host hides; set HIXL_NETNS_DIR to another directory")
        for k in range(len(HIDDEN_ROOTS)):
            os.makedirs(os.path.join(self.run_dir, "stash", str(k)), exist_ok=True)
        self.kept = kept_paths()
        _ip("netns", "add", self.switch_ns)
        self._made.append(self.switch_ns)
        _ip("-n", self.switch_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch_ns, "link", "set", "br0", "up")
        for index in range(1, n + 1):
            host = Host(self, index)
            _ip("netns", "add", host.ns)
            self._made.append(host.ns)
            _ip("-n", self.switch_ns, "link", "add", host.switch_port, "type", "veth",
                "peer", "name", HOST_IF, "netns", host.ns)
            _ip("-n", self.switch_ns, "link", "set", host.switch_port, "master", "br0", "up")
            _ip("-n", host.ns, "link", "set", "lo", "up")
            _ip("-n", host.ns, "addr", "add", f"{host.ip}/24", "dev", HOST_IF)
            _ip("-n", host.ns, "link", "set", HOST_IF, "up")
            self.hosts.append(host)
            host.boot()

    def _tag(self) -> str:
        self._tags += 1
        return str(self._tags)

    def start_agent(self, host: Host, config: Mapping[str, Any] | None = None) -> AgentHandle:
        """A hixl-agent on `host` at host.ip:GRPC_PORT (data on DATA_PORT), ready to serve."""
        agent = AgentHandle(host, config or {}, self._tag())
        self.agents.append(agent)
        return agent

    def start_master(self, host: Host, port: int = MASTER_PORT) -> str:
        """A hixl-master on `host` (in memory only), serving; returns its "ip:port"."""
        master = DaemonProcess([sys.executable, "-m", "hixl.server.master.master", "--host", host.ip,
                                "--port", str(port), "--no-persist"],
                               name=f"hixl-master on {host}", ready="hixl-master serving",
                               spawn=host.spawn)
        try:
            master.wait_ready(START_TIMEOUT_S)
        except ProcessNotReady as exc:
            raise HarnessError(str(exc)) from None
        return f"{host.ip}:{port}"

    def worker(self, host: Host, fabric: str = "1", registry: str | None = None) -> Worker:
        """An engine worker on `host` (EnableUseFabricMem=`fabric`), driven step by step;
        with `registry` ("ip:port") its engine follows that registry's global table."""
        worker = Worker(host, fabric, self._tag(), registry)
        self.workers.append(worker)
        return worker

    def close(self) -> None:
        """Kill every process, delete every namespace (and with them the links), remove files."""
        if self._closed:
            return
        self._closed = True
        for worker in self.workers:
            with contextlib.suppress(Exception):
                worker.close(timeout=2.0)
        for proc in self.processes:
            if proc.poll() is None:
                with contextlib.suppress(Exception):
                    proc.kill()
        for host in self.hosts:
            if host.init is not None and host.init.alive():
                host.init.proc.kill()  # --kill-child takes its init, and with it its PID namespace
        for ns in reversed(self._made):
            _kill_namespace(ns)
        for proc in [*self.processes, *(h.init.proc for h in self.hosts if h.init is not None)]:
            with contextlib.suppress(Exception):
                proc.wait(COMMAND_TIMEOUT_S)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        if os.environ.get("HIXL_NETNS_KEEP_LOGS") != "1":
            shutil.rmtree(self.run_dir, ignore_errors=True)
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(self.run_dir))
        if self in _live:
            _live.remove(self)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
