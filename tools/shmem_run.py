"""`hixl shmem-run`: start the PEs of a `hixl.shmem` job as processes (as mpirun, torchrun).

    hixl shmem-run -n 4 -- python examples/moe_dispatch_combine.py --tokens 128

Each PE runs the command with HIXL_SHMEM_PE, HIXL_SHMEM_N_PES, HIXL_SHMEM_BOOTSTRAP and
HIXL_SHMEM_JOB in its environment, so `hixl.shmem.init()` needs no arguments. Without
`--bootstrap` a private `hixl-master` serves the job and is stopped after it. Several
nodes: run one `shmem-run` per node against one master, each starting its share of the
PE numbers (`--first-pe`, `--n-pes` for the job's size, the same `--job`).

A job never hangs on a dead PE: when one exits non-zero (or is killed), the others get
SIGTERM and, after a grace period, SIGKILL; `--timeout` bounds the whole job the same
way. Every line a PE prints is passed on prefixed with "[pe N] ". The exit status is 0
when every PE exited 0, else the failed PE's (128 + signal for a killed one).

The PE blamed is the one that raised first (the first to print a Python traceback), not
merely the first to exit: a PE that raises tears its agent down at exit, which fails its
peers' calls, and they may well exit before it does.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

from hixl.client.shmem import BOOTSTRAP_ENV, JOB_ENV, N_PES_ENV, PE_ENV
from hixl.errors import ParamInvalid

GRACE_S = 5.0  # after SIGTERM, how long the other PEs get before SIGKILL


@dataclass
class JobResult:
    """How a job ended: each PE's exit status (None: never started), the first failure."""

    returncodes: dict[int, int | None]
    failed_pe: int | None = None
    timed_out: bool = False
    reasons: list[str] = field(default_factory=list)
    #: the PEs that printed a Python traceback, in the order their first one arrived
    tracebacks: list[int] = field(default_factory=list)
    first_exit: tuple[int, int] | None = None  # (PE, status) of the first non-zero exit

    @property
    def ok(self) -> bool:
        return self.failed_pe is None and not self.timed_out

    @property
    def exit_status(self) -> int:
        if self.ok:
            return 0
        if self.failed_pe is not None:
            code = self.returncodes.get(self.failed_pe)
            if code is not None and code < 0:
                return 128 - code
            return code or 1
        return 124  # timed out, as timeout(1)


TRACEBACK = "Traceback (most recent call last):"


def _pump(stream: IO[str], pe: int, out: IO[str], lock: threading.Lock,
          result: JobResult) -> None:
    prefix = f"[pe {pe}] "
    for line in stream:
        with lock:
            if line.startswith(TRACEBACK) and pe not in result.tracebacks:
                result.tracebacks.append(pe)
            out.write(prefix + line if line.endswith("\n") else prefix + line + "\n")
            out.flush()


def run_job(command: Sequence[str], n_local: int, *, bootstrap: str | None = None,
            job: str | None = None, n_pes: int | None = None, first_pe: int = 0,
            timeout: float | None = None, env: Mapping[str, str] | None = None,
            output: IO[str] | None = None) -> JobResult:
    """Run PEs first_pe .. first_pe + n_local - 1 of an `n_pes`-PE job (default: all of
    them here) and wait for them; see the module docstring."""
    if not command:
        raise ParamInvalid("shmem-run needs a command to run as each PE")
    total = n_local if n_pes is None else n_pes
    if n_local < 1 or total < 1 or first_pe < 0 or first_pe + n_local > total:
        raise ParamInvalid(f"PEs {first_pe}..{first_pe + n_local - 1} are not inside a job "
                           f"of {total} PEs")
    if timeout is not None and not timeout > 0:
        raise ParamInvalid(f"timeout must be positive, got {timeout}")
    out = output or sys.stdout
    with contextlib.ExitStack() as stack:
        if bootstrap is None:
            from hixl.tools.daemons import MasterProcess

            master = MasterProcess(log_level="WARNING")
            stack.callback(master.close)
            bootstrap = master.target
        job = job or f"job-{uuid.uuid4().hex[:12]}"
        base = {**os.environ, **(env or {}), N_PES_ENV: str(total), BOOTSTRAP_ENV: bootstrap,
                JOB_ENV: job, "PYTHONUNBUFFERED": "1"}
        lock = threading.Lock()
        procs: dict[int, subprocess.Popen[str]] = {}
        pumps: list[threading.Thread] = []
        result = JobResult({pe: None for pe in range(first_pe, first_pe + n_local)})
        try:
            for pe in result.returncodes:
                proc = subprocess.Popen(list(command), env={**base, PE_ENV: str(pe)},
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, start_new_session=True)
                procs[pe] = proc
                assert proc.stdout is not None
                pump = threading.Thread(target=_pump, args=(proc.stdout, pe, out, lock, result),
                                        daemon=True, name=f"shmem-run-pe{pe}")
                pump.start()
                pumps.append(pump)
            _wait(procs, result, None if timeout is None else time.monotonic() + timeout)
        finally:
            _stop_all(procs, result)
            for pump in pumps:
                pump.join(GRACE_S)
            _blame(result)
        return result


def _blame(result: JobResult) -> None:
    """Name the PE that failed first: the first to raise, else the first to exit non-zero
    (decided once every PE's output was read, so a late traceback still counts)."""
    if result.first_exit is None:
        return
    first_pe, code = result.first_exit
    raised = [pe for pe in result.tracebacks if result.returncodes.get(pe) != 0]
    blamed = raised[0] if raised else first_pe
    result.failed_pe = blamed
    how = f"killed by signal {-code}" if code < 0 else f"exit status {code}"
    if blamed == first_pe:
        said = f"PE {blamed} failed ({how}"
        said += ", after raising: see its traceback above)" if raised else ")"
    else:
        said = (f"PE {blamed} failed first (it raised: see its traceback above); PE "
                f"{first_pe} exited before it ({how})")
    result.reasons.append(f"{said}; stopping the others")


def _wait(procs: Mapping[int, subprocess.Popen[str]], result: JobResult,
          deadline: float | None) -> None:
    """Until every PE exited 0, one failed, or the deadline passed.

    One thread per PE blocks in wait() and reports the exit the moment it happens, so the
    PE that failed first is the one named, not the first in a polling order (a PE's
    death quickly fails its peers' calls too)."""
    exits: queue.Queue[tuple[int, int]] = queue.Queue()
    for pe, proc in procs.items():
        threading.Thread(target=lambda pe=pe, proc=proc: exits.put((pe, proc.wait())),
                         daemon=True, name=f"shmem-run-wait{pe}").start()
    for _ in procs:
        left = None if deadline is None else deadline - time.monotonic()
        try:
            if left is not None and left <= 0:
                raise queue.Empty
            pe, code = exits.get(timeout=left)
        except queue.Empty:
            result.timed_out = True
            result.reasons.append("the job passed its timeout; stopping every PE")
            return
        result.returncodes[pe] = code
        if code != 0:
            result.failed_pe = pe  # until _blame has read every PE's output
            result.first_exit = (pe, code)
            return


def _stop_all(procs: Mapping[int, subprocess.Popen[str]], result: JobResult) -> None:
    """SIGTERM every PE still running (its whole process group), SIGKILL after GRACE_S."""
    alive = [(pe, p) for pe, p in procs.items() if p.poll() is None]
    for _, proc in alive:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    for pe, proc in alive:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        result.returncodes[pe] = proc.returncode
    for pe, proc in procs.items():
        if result.returncodes[pe] is None:
            result.returncodes[pe] = proc.poll()


__all__ = ["JobResult", "run_job"]
