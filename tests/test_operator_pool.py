"""Pools that fit the machine (issue 20, item 5): a pool larger than the memory there is
is refused before any of it is mapped, naming the numbers, where they were read and the
setting to change; a pool being pre-faulted says so in the log.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import yaml
from conftest import TEST_STATE_DIR, AgentProcess, clean_env

from hixl.server.agent.runtime import memory_room

StartAgent = Callable[..., AgentProcess]


def _mem_total() -> int:
    with open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal in /proc/meminfo")


def _start_refused(tmp_path: Path, **settings: object) -> subprocess.CompletedProcess[str]:
    config = {"host": "127.0.0.1", "grpc_port": 0, "data_port": 0,
              "runtime_dir": str(tmp_path / "run"), "state_dir": TEST_STATE_DIR, **settings}
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    return subprocess.run([sys.executable, "-m", "hixl.server.main", "--config", str(path)],
                          capture_output=True, text=True, timeout=120, env=clean_env())


def test_a_pool_larger_than_the_machine_is_refused_before_mapping(tmp_path: Path) -> None:
    too_big = 2 * _mem_total()
    result = _start_refused(tmp_path, pool_size=too_big)
    assert result.returncode == 1 and result.stdout == ""
    said = result.stderr
    assert "does not fit this machine" in said and "available (MemAvailable in /proc/meminfo)" in said
    assert f"{too_big / (1 << 30):.1f} GiB in 1 segment(s)" in said
    assert "lower key 'pool_size' (--pool-size, HIXL_AGENT_POOL_SIZE)" in said
    assert "cannot map" not in said  # refused before any mapping, not by mmap


def test_a_pool_list_too_large_names_the_pool_key(tmp_path: Path) -> None:
    half = _mem_total() // 2 + (1 << 30)
    result = _start_refused(tmp_path, pool=[{"name": "a", "size": half},
                                            {"name": "b", "size": half}])
    assert result.returncode == 1
    assert "in 2 segment(s)" in result.stderr and "lower key 'pool'" in result.stderr


def test_pre_faulting_is_logged(agent_process: StartAgent) -> None:
    agent = agent_process(config={"pool_size": "8MiB"})
    log = agent.log()
    assert "pre-faulting pool segment 'pool' (8.0 MiB)" in log
    assert "pool segment 'pool': 8.0 MiB pre-faulted in " in log


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="ascii")


def test_cgroup_v2_limit_is_a_bound(tmp_path: Path) -> None:
    """The reading itself, on a copy of the files a cgroup v2 host has."""
    _tree(tmp_path, {"proc/meminfo": "MemTotal: 1000 kB\nMemAvailable: 900000 kB\n",
                     "proc/self/cgroup": "0::/job\n",
                     "sys/fs/cgroup/job/memory.max": f"{8 << 30}\n",
                     "sys/fs/cgroup/job/memory.current": f"{3 << 30}\n",
                     "sys/fs/cgroup/job/memory.stat": f"anon 1\ninactive_file {1 << 30}\n"})
    bounds = memory_room(str(tmp_path))
    assert bounds[0] == (900000 * 1024, "MemAvailable in /proc/meminfo")
    room, where = bounds[1]
    assert room == (8 << 30) - (2 << 30)
    assert where.endswith(os.path.join("sys/fs/cgroup/job", "memory.max") + ")")


def test_cgroup_v1_limit_is_a_bound_and_no_limit_is_none(tmp_path: Path) -> None:
    _tree(tmp_path, {"proc/meminfo": "MemAvailable: 100 kB\n",
                     "proc/self/cgroup": "4:memory:/pod\n0::/\n",
                     "sys/fs/cgroup/memory/memory.limit_in_bytes": f"{4 << 30}\n",
                     "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{1 << 30}\n",
                     "sys/fs/cgroup/memory/memory.stat": "total_inactive_file 0\n"})
    assert [room for room, _ in memory_room(str(tmp_path))] == [100 * 1024, 3 << 30]
    _tree(tmp_path, {"sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n"})
    assert [room for room, _ in memory_room(str(tmp_path))] == [100 * 1024]
