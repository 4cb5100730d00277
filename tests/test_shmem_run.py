"""`hixl shmem-run` (hixl.tools.shmem_run): real PE processes, a real private hixl-master.

A job whose PEs all succeed exits 0 with every PE's output passed on; a PE that fails
stops the others (no PE is left waiting on it) and its status is the job's; a job past
its timeout is stopped; bad arguments are refused before anything starts.
"""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import pytest

from hixl.errors import ParamInvalid
from hixl.tools.shmem_run import GRACE_S, run_job

RING = os.path.join(os.path.dirname(__file__), "helpers", "shmem_ring.py")
pytestmark = pytest.mark.timeout(120)


def _lines(output: str) -> dict[int, str]:
    """PE number -> its `ok=...` line."""
    found = {}
    for line in output.splitlines():
        match = re.match(r"\[pe (\d+)\] (ok=.*)", line)
        if match:
            found[int(match.group(1))] = match.group(2)
    return found


def test_a_job_runs_every_pe_with_its_number_and_one_job_id() -> None:
    out = io.StringIO()
    result = run_job([sys.executable, RING], 3, timeout=90, output=out)
    assert result.ok and result.exit_status == 0, (result, out.getvalue())
    assert result.returncodes == {0: 0, 1: 0, 2: 0}
    lines = _lines(out.getvalue())
    assert sorted(lines) == [0, 1, 2], out.getvalue()
    jobs = set()
    for pe, line in lines.items():
        fields = dict(part.split("=", 1) for part in line.split())
        assert fields["ok"] == "True" and fields["pe"] == str(pe) and fields["n"] == "3"
        assert fields["route"] == "fabric"  # same node: the heaps are mapped
        jobs.add(fields["job"])
    assert len(jobs) == 1 and next(iter(jobs)).startswith("job-")


def test_the_command_line_runs_a_job() -> None:
    done = subprocess.run([sys.executable, "-m", "hixl.tools.cli", "shmem-run", "-n", "2",
                           "--timeout", "90", "--", sys.executable, RING],
                          capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr + done.stdout
    assert sorted(_lines(done.stdout)) == [0, 1]
    assert all(line.startswith("ok=True") for line in _lines(done.stdout).values())


def test_a_failed_pe_stops_the_others_and_sets_the_status() -> None:
    """PE 1 exits 3 right after init; PEs 0 and 2 wait for its signal (they would fail
    once its lease expires, or after 20 s): the launcher stops them first and the job
    reports PE 1."""
    out = io.StringIO()
    result = run_job([sys.executable, RING, "fail-after-init"], 3, timeout=90, output=out)
    assert not result.ok
    assert result.failed_pe == 1 and result.returncodes[1] == 3 and result.exit_status == 3
    for pe in (0, 2):  # stopped by the launcher (SIGTERM, or SIGKILL after the grace)
        assert result.returncodes[pe] is not None and result.returncodes[pe] != 0
    assert any("PE 1 failed (exit status 3)" in reason for reason in result.reasons)
    assert not _lines(out.getvalue())  # nobody got to report success


def test_a_job_past_its_timeout_is_stopped() -> None:
    result = run_job([sys.executable, RING, "hang"], 2, timeout=1.0, output=io.StringIO())
    assert result.timed_out and result.exit_status == 124 and result.failed_pe is None
    assert all(code is not None and code != 0 for code in result.returncodes.values())
    assert GRACE_S > 0


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"command": [], "n_local": 1}, "needs a command"),
    ({"command": ["true"], "n_local": 0}, "not inside a job"),
    ({"command": ["true"], "n_local": 2, "n_pes": 3, "first_pe": 2}, "PEs 2..3"),
    ({"command": ["true"], "n_local": 1, "timeout": 0}, "timeout must be positive"),
])
def test_bad_arguments_are_refused_before_anything_starts(kwargs: dict, message: str) -> None:
    command = kwargs.pop("command")
    n_local = kwargs.pop("n_local")
    with pytest.raises(ParamInvalid, match=re.escape(message)):
        run_job(command, n_local, bootstrap="127.0.0.1:1", **kwargs)


def test_init_without_arguments_names_the_missing_variable(monkeypatch) -> None:
    import hixl.shmem as shmem

    for name in ("HIXL_SHMEM_PE", "HIXL_SHMEM_N_PES", "HIXL_SHMEM_BOOTSTRAP"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ParamInvalid, match=r"\$HIXL_SHMEM_PE .*shmem-run"):
        shmem.init()
    monkeypatch.setenv("HIXL_SHMEM_PE", "zero")
    with pytest.raises(ParamInvalid, match=r"\$HIXL_SHMEM_PE must be int, got 'zero'"):
        shmem.init()
