"""A real etcd cluster on loopback, for tests of hixl's etcd seam (hixl.etcd) and of the
services built on it.

Each member is an `etcd` process (Debian's etcd-server; CI installs it) with its own free
client and peer ports on 127.0.0.1 and its own data directory under one temporary
directory, bootstrapped statically (`--initial-cluster`). Elections are tuned fast
(heartbeat 50 ms, election timeout 500 ms) so fail-over tests stay short. `start()` waits,
with a deadline, until every member answers /health with a leader (a real call).

    with EtcdCluster(3) as cluster:
        client = EtcdClient({"endpoints": cluster.endpoints, "prefix": "/hixl/t/"})
        cluster.kill(0)          # SIGKILL
        cluster.restart(0)       # same data dir, same ports; waits until healthy

Members are SIGKILLed by `close()` (also run at exit), so no etcd outlives the tests.
`start_cluster_or_skip()` is what fixtures call: it skips when `etcd` or `aetcd` is
missing -- unless CI=true, where that is a failure (CI installs both).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from typing import Any

import pytest

from hixl.processes import free_ports

HOST = "127.0.0.1"
START_TIMEOUT_S = 30.0
_live: set[EtcdCluster] = set()


class EtcdCluster:
    """N etcd members on loopback (see the module docstring)."""

    def __init__(self, size: int = 3, *, binary: str = "etcd", name: str = "hixl-test",
                 extra_args: Iterable[str] = (),
                 tls: tuple[str, str, str] | None = None) -> None:
        """`tls`: (certificate, key, CA) PEM files: clients must then use https and
        present a certificate of that CA (peers stay plaintext)."""
        self.size = size
        self.tls = tls
        self.binary = shutil.which(binary) or binary
        self.name = name
        self.extra_args = list(extra_args)
        self.directory = tempfile.mkdtemp(prefix="hixl-etcd-")
        ports = free_ports(2 * size, HOST)
        self.client_ports = ports[:size]
        self.peer_ports = ports[size:]
        self.member_names = [f"m{i}" for i in range(size)]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * size
        self._token = f"{name}-{os.getpid()}-{id(self):x}"

    @property
    def endpoints(self) -> list[str]:
        return [f"{HOST}:{port}" for port in self.client_ports]

    def endpoint(self, index: int) -> str:
        return self.endpoints[index]

    def index_of(self, endpoint: str) -> int:
        return self.endpoints.index(endpoint)

    def log_path(self, index: int) -> str:
        return os.path.join(self.directory, f"{self.member_names[index]}.log")

    def log(self, index: int, tail: int = 4000) -> str:
        try:
            with open(self.log_path(index), encoding="utf-8", errors="replace") as f:
                return f.read()[-tail:]
        except OSError:
            return "(no log)"

    def _command(self, index: int) -> list[str]:
        name = self.member_names[index]
        client = f"{self._scheme}://{HOST}:{self.client_ports[index]}"
        tls_args = [] if self.tls is None else [
            "--cert-file", self.tls[0], "--key-file", self.tls[1],
            "--trusted-ca-file", self.tls[2], "--client-cert-auth"]
        peer = f"http://{HOST}:{self.peer_ports[index]}"
        initial = ",".join(f"{n}=http://{HOST}:{p}"
                           for n, p in zip(self.member_names, self.peer_ports, strict=True))
        return [self.binary, "--name", name,
                "--data-dir", os.path.join(self.directory, name),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", initial, "--initial-cluster-state", "new",
                "--initial-cluster-token", self._token,
                "--heartbeat-interval", "50", "--election-timeout", "500",
                "--logger", "zap", "--log-outputs", "stderr", *tls_args, *self.extra_args]

    @property
    def _scheme(self) -> str:
        return "http" if self.tls is None else "https"

    def _spawn(self, index: int) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD")}
        with open(self.log_path(index), "ab") as log:
            self.procs[index] = subprocess.Popen(
                self._command(index), stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                env=env, start_new_session=True)

    def start(self, timeout: float = START_TIMEOUT_S) -> EtcdCluster:
        _live.add(self)
        for index in range(self.size):
            self._spawn(index)
        self.wait_healthy(range(self.size), timeout)
        return self

    def running(self, index: int) -> bool:
        proc = self.procs[index]
        return proc is not None and proc.poll() is None

    def healthy(self, index: int, timeout: float = 1.0) -> bool:
        """Whether the member answers /health with a leader (a real round trip)."""
        url = f"{self._scheme}://{HOST}:{self.client_ports[index]}/health"
        context = None
        if self.tls is not None:
            context = ssl.create_default_context(cafile=self.tls[2])
            context.load_cert_chain(self.tls[0], self.tls[1])
        try:
            with urllib.request.urlopen(url, timeout=timeout, context=context) as reply:
                return json.loads(reply.read()).get("health") == "true"
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def wait_healthy(self, indexes: Iterable[int] | None = None,
                     timeout: float = START_TIMEOUT_S) -> None:
        """Wait until each member (default: every running one) is healthy; RuntimeError
        with the members' logs when the deadline passes first."""
        waiting = list(range(self.size) if indexes is None else indexes)
        deadline = time.monotonic() + timeout
        while waiting:
            waiting = [i for i in waiting if not self.healthy(i)]
            for index in waiting:
                if not self.running(index):
                    raise RuntimeError(f"etcd member {index} exited; its log:\n"
                                       f"{self.log(index)}")
            if waiting and time.monotonic() > deadline:
                logs = "\n".join(f"--- member {i}:\n{self.log(i)}" for i in waiting)
                raise RuntimeError(f"etcd members {waiting} not healthy within {timeout} s"
                                   f"\n{logs}")
            if waiting:
                time.sleep(0.1)

    def kill(self, index: int) -> None:
        """SIGKILL member `index` (a crash: no goodbye to its peers)."""
        self._end(index, signal.SIGKILL)

    def stop(self, index: int) -> None:
        """SIGTERM member `index` and wait for it to exit."""
        self._end(index, signal.SIGTERM)

    def _end(self, index: int, sig: signal.Signals) -> None:
        proc = self.procs[index]
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def restart(self, index: int, *, wait: bool = True,
                timeout: float = START_TIMEOUT_S) -> None:
        """Start member `index` again (same data dir and ports); with `wait`, until it is
        healthy (which needs a quorum of members running)."""
        self._end(index, signal.SIGKILL)
        self._spawn(index)
        if wait:
            self.wait_healthy([index], timeout)

    def ensure_running(self, timeout: float = START_TIMEOUT_S) -> None:
        """Restart every member that is down, then wait until all are healthy."""
        for index in range(self.size):
            if not self.running(index):
                self._spawn(index)
        self.wait_healthy(range(self.size), timeout)

    def close(self) -> None:
        for index in range(self.size):
            self._end(index, signal.SIGKILL)
        _live.discard(self)
        shutil.rmtree(self.directory, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start() if not any(self.procs) else self

    def __exit__(self, *exc: object) -> None:
        self.close()


@atexit.register
def _close_all() -> None:
    for cluster in list(_live):
        with contextlib.suppress(Exception):
            cluster.close()


def etcd_missing() -> str:
    """Why etcd tests cannot run here ("" when they can)."""
    if shutil.which("etcd") is None:
        return "the etcd binary is not installed (Debian: apt-get install etcd-server)"
    if importlib.util.find_spec("aetcd") is None:
        return "the aetcd package is not installed (pip install 'hixl[etcd]')"
    return ""


def start_cluster_or_skip(size: int = 3, **options: Any) -> EtcdCluster:
    """A started cluster (`options` as EtcdCluster's); skips when etcd or aetcd is
    missing, fails instead under CI."""
    missing = etcd_missing()
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but {missing}")
        pytest.skip(missing)
    cluster = EtcdCluster(size, **options)
    try:
        return cluster.start()
    except RuntimeError as exc:
        cluster.close()
        pytest.fail(str(exc))
