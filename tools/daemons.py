"""The hixl daemons as child processes, for the tools, the benches, the tests and
scripts/: `MasterProcess` (hixl-master), `AgentProcess` (hixl-agent), `HolderProcess` (a
store client contributing a segment, `hixl.tools.store_bench --holder`). Each is a
`hixl.processes.DaemonProcess` (spawn, the ready line with a deadline, stop) that knows its
daemon's command line and ready line; tools start daemons this way, never by importing
the server.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence

from hixl.addresses import split_host_port
from hixl.errors import HixlError
from hixl.processes import DaemonProcess, ProcessNotReady

MOONCAKE_QUIET = {"MC_LOG_LEVEL": "ERROR"}  # Mooncake logs every connection at INFO
HOLDER_START_TIMEOUT_S = 60.0

MASTER_READY = "hixl-master serving "
MASTER_START_TIMEOUT_S = 30.0


class MasterProcess(DaemonProcess):
    """A `hixl-master` subprocess on `host` (for the bench and for tests), serving once
    constructed (HixlError with its log otherwise).

    stderr goes to a log file (never a pipe nobody reads, which could fill and block it).
    `port=0` picks a free port; pass the old port to restart a master where it was.
    `host=None` leaves the host to the master's default; `env` is its environment (None:
    ours).
    """

    def __init__(self, port: int = 0, *, host: str | None = "127.0.0.1",
                 log_level: str = "INFO", extra: Sequence[str] = (),
                 log_path: str | None = None, env: Mapping[str, str] | None = None) -> None:
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="hixl-master-", suffix=".log")
            os.close(fd)
        super().__init__(
            [sys.executable, "-m", "hixl.server.master.master",
             *(() if host is None else ("--host", host)),
             "--port", str(port), "--log-level", log_level,
             # metadata kept only when the caller names a place for it (dir or etcd)
             *(() if any(f.startswith(("--data-dir", "--etcd-endpoints")) for f in extra)
               else ("--no-persist",)),
             *extra],
            name="hixl-master", ready=MASTER_READY, env=env, log_path=log_path,
            grace_s=MASTER_START_TIMEOUT_S)
        try:
            line = self.wait_ready(MASTER_START_TIMEOUT_S)
        except ProcessNotReady as exc:
            raise HixlError(str(exc)) from None
        self.target = line[len(MASTER_READY):].strip()
        self.port = split_host_port(self.target)[1]

    def close(self) -> None:
        """Killed (not stopped: a test's master goes at once), its log removed."""
        self.kill()
        super().close()
        if self.log_path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.log_path)


AGENT_START_TIMEOUT_S = 60.0


class AgentProcess:
    """A private `hixl-agent` (free ports, temporary runtime dir), stopped by stop()."""

    READY_PREFIX = "hixl-agent serving "

    def __init__(self, pool_bytes: int) -> None:
        self.runtime_dir = tempfile.mkdtemp(prefix="hixl-bench-")
        self.name = ""
        self.config_path = os.path.join(self.runtime_dir, "agent.yaml")
        with open(self.config_path, "w", encoding="utf-8") as f:
            f.write(f"host: 127.0.0.1\ngrpc_port: 0\ndata_port: 0\ndata_unix: true\n"
                    f"runtime_dir: {self.runtime_dir}\npool_max_bytes: {pool_bytes}\n"
                    "log_level: WARNING\n")
        # HIXL_AGENT_* variables would override the file: the bench's agent ignores them.
        env = {k: v for k, v in os.environ.items() if not k.startswith("HIXL_AGENT_")}
        env["PYTHONUNBUFFERED"] = "1"
        self.process = DaemonProcess(
            [sys.executable, "-c",
             "import sys; from hixl.server.main import agent_main; sys.exit(agent_main())",
             "--config", self.config_path],
            name="hixl-agent", ready=self.READY_PREFIX, env=env, start_new_session=True)
        self.proc = self.process.proc

    def wait_ready(self, timeout: float = AGENT_START_TIMEOUT_S) -> str:
        """The agent's engine name, once it prints its ready line (ProcessNotReady, a
        RuntimeError with its output, if it exits or `timeout` passes first)."""
        self.process.wait_ready(timeout)
        self.name = self.process.ready_fields["engine"]
        return self.name

    def stop(self) -> None:
        self.process.stop()
        shutil.rmtree(self.runtime_dir, ignore_errors=True)


HOLDER_READY = "HIXL-STORE-HOLDER-READY"


def holder_command(system: str, master: str, host: str, segment_bytes: int,
                   forever: bool = False) -> list[str]:
    """argv of a segment holder process (see holder_main)."""
    return [sys.executable, "-m", "hixl.tools.store_bench", "--holder", system,
            "--master", master, "--host", host, "--segment", str(segment_bytes),
            *(["--forever"] if forever else [])]


class HolderProcess(DaemonProcess):
    """A segment holder on this host, serving once constructed (its segment name in
    `segment`; ProcessNotReady, a RuntimeError with its output, otherwise); stop() closes
    its stdin (it unmounts and exits)."""

    def __init__(self, system: str, master: str, host: str, segment_bytes: int) -> None:
        super().__init__(holder_command(system, master, host, segment_bytes),
                         name=f"{system} segment holder", ready=HOLDER_READY,
                         env={**os.environ, **MOONCAKE_QUIET, "PYTHONUNBUFFERED": "1"},
                         stop_by="stdin", grace_s=15.0)
        self.segment = self.wait_ready(HOLDER_START_TIMEOUT_S).split()[2]


__all__ = ["AGENT_START_TIMEOUT_S", "HOLDER_READY", "MASTER_READY", "MOONCAKE_QUIET",
           "AgentProcess",
           "HolderProcess", "MasterProcess", "holder_command"]
