"""What the command line tells a newcomer (issue 20, item 9): --version on every
command, `hixl shmem-run` blames the PE that raised (not the one that exited first), and
CLI errors say a reason once. Real processes throughout.
"""

from __future__ import annotations

import io
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import clean_env

from hixl import __version__
from hixl.processes import free_port
from hixl.tools.shmem_run import run_job


@pytest.mark.parametrize(("entry", "prog"), [("hixl.server.main:agent_main", "hixl-agent"),
                                             ("hixl.server.main:master_main", "hixl-master"),
                                             ("hixl.tools.cli:main", "hixl")])
def test_every_command_says_its_version(entry: str, prog: str) -> None:
    """Each console script of pyproject.toml, called as the script calls it."""
    module, function = entry.split(":")
    code = f"import sys; from {module} import {function}; sys.exit({function}(['--version']))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=clean_env())
    assert (done.returncode, done.stdout.strip()) == (0, f"{prog} {__version__}")


#: PE 2 raises; its exit waits (atexit) until PE 1, which fails because of it, has exited
#: and been reaped by shmem-run:
#: the order that made `shmem-run` say "PE 1 failed" when PE 2 raised
_RAISER = textwrap.dedent("""
    import atexit, os, sys, time
    pe, where = int(os.environ["HIXL_SHMEM_PE"]), sys.argv[1]
    deadline = time.monotonic() + 60
    def wait_for(name):
        while not os.path.exists(os.path.join(where, name)):
            assert time.monotonic() < deadline, name
            time.sleep(0.01)
    def pe1_gone():  # reaped by shmem-run: its exit was seen
        wait_for("pe1-pid")
        pid = int(open(os.path.join(where, "pe1-pid")).read())
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            assert time.monotonic() < deadline, "PE 1 still there"
            time.sleep(0.01)
    if pe == 2:
        atexit.register(pe1_gone)
        open(os.path.join(where, "pe2-raised"), "w").close()
        raise RuntimeError("PE 2 broke")
    if pe == 1:
        wait_for("pe2-raised")
        with open(os.path.join(where, "pe1-pid.tmp"), "w") as f:
            f.write(str(os.getpid()))
        os.rename(os.path.join(where, "pe1-pid.tmp"), os.path.join(where, "pe1-pid"))
        sys.exit(5)
    wait_for("never")
""")


def test_shmem_run_blames_the_pe_that_raised(tmp_path: Path) -> None:
    script = tmp_path / "raiser.py"
    script.write_text(_RAISER, encoding="utf-8")
    out = io.StringIO()
    result = run_job([sys.executable, str(script), str(tmp_path)], 3, bootstrap="127.0.0.1:1",
                     timeout=90, output=out)
    assert result.failed_pe == 2 and result.exit_status != 0  # PE 2 raised
    assert result.returncodes[1] == 5  # PE 1 exited on its own, before PE 2
    assert any(reason.startswith("PE 2 failed first (it raised: see its traceback above); "
                                 "PE 1 exited before it (exit status 5)")
               for reason in result.reasons), result.reasons
    assert "[pe 2] RuntimeError: PE 2 broke" in out.getvalue()


def test_cli_error_says_unreachable_once() -> None:
    port = free_port()
    done = subprocess.run([sys.executable, "-m", "hixl.tools.cli", "segments", "--master",
                           f"127.0.0.1:{port}", "--timeout", "5"], capture_output=True,
                          text=True, timeout=60, env=clean_env())
    assert done.returncode != 0
    assert f"master 127.0.0.1:{port}: unreachable (nothing serving there?): " in done.stderr
    assert done.stderr.count("unreachable") == 1, done.stderr


def test_ctrl_c_during_start_up_exits_without_a_traceback(tmp_path: Path) -> None:
    """SIGINT while the pool is being pre-faulted: the agent stops, exit 0, no traceback
    (whether the signal lands during pre-faulting or just after: both are start-up)."""
    import signal

    import waiting
    from conftest import TEST_STATE_DIR

    log_path = tmp_path / "agent.log"
    with open(log_path, "w", encoding="utf-8") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "hixl.server.main", "--grpc-port", "0", "--runtime-dir",
             str(tmp_path / "run"), "--state-dir", TEST_STATE_DIR, "--pool-size", "256MiB"],
            stdout=subprocess.PIPE, stderr=log_file, text=True, env=clean_env())
    try:

        def pre_faulting() -> bool:
            if "pre-faulting pool segment" in log_path.read_text(encoding="utf-8"):
                return True
            assert proc.poll() is None, log_path.read_text()  # exited before it
            return False

        waiting.wait_until(pre_faulting, "the agent pre-faulting its pool", 60, interval=0.01,
                           detail=log_path.read_text)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()
    log = log_path.read_text(encoding="utf-8")
    assert "Traceback" not in log and "KeyboardInterrupt" not in log
