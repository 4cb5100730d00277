"""scripts/socket_floor.py (issue 14's measurement) keeps running: it builds its prototype
C extension, drives agents (with hixl._fastwire and with HIXL_FASTWIRE=0) and the C server
through every case, and prints a figure for each. A smoke run with few ops: the figures themselves are the script's output, not
asserted here (no timing thresholds in tests)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from hixl.transports import tcp

ROOT = Path(__file__).resolve().parent.parent
CASES = ("raw python", "Engine->agent", "Engine[py]->agent[py]", "SocketTransport->agent",
         "SocketTransport[py]->agent[py]", "SocketTransport->agent[py]",
         "SocketTransport[py]->agent", "py+C single->agent[py]", "C loop->agent[py]",
         "C loop->agent", "SocketTransport->C srv", "SocketTransport[py]->C srv",
         "py+C single->C srv", "C loop->C srv")


@pytest.mark.skipif(shutil.which("gcc") is None or not os.path.exists(
    os.path.join(sysconfig.get_paths()["include"], "Python.h")) or tcp.FASTWIRE is None,
    reason="the prototype needs gcc and Python.h (a dev tool, not part of hixl), and "
           "compares with hixl._fastwire (built by pip when they are there)")
def test_socket_floor_prototype_measures_every_case() -> None:
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "socket_floor.py"),
                             "--ops", "50", "--rounds", "1"],
                            capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {}
    for line in result.stdout.splitlines():
        for case in CASES:
            for op in ("write", "read"):
                if line.startswith(f"{case} {op} "):
                    rows[(case, op)] = [float(x) for x in line[len(case) + len(op) + 2:].split()]
    assert set(rows) == {(case, op) for case in CASES for op in ("write", "read")}, result.stdout
    for (case, op), (p50, client_cpu, server_cpu) in rows.items():
        assert p50 > 0 and client_cpu > 0 and server_cpu > 0, (case, op, result.stdout)
