"""Issue 15, item 5: a client's key pattern cannot grow a real hixl-master's memory.

The match timeout never covered compiling: `regex` unrolls counted repeats, so the 18
bytes `(?:a{1000}){3000}` grew the master's peak memory by ~800 MiB, and every distinct
pattern was kept in the module's cache (up to 500, megabytes each). The attack runs here
against a `hixl-master` process; its peak and resident memory are read from
/proc/PID/status (VmHWM, VmRSS) before and after.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hixl.client.store_client import MasterClient
from hixl.server.master.store import MAX_REGEX_WEIGHT
from hixl.store_codes import ErrorCode
from hixl.store_types import ReplicaConfig, StoreSegment
from hixl.tools.daemons import MasterProcess

MiB = 1 << 20
#: what the attack grew the master by before the bound (measured: ~800 MiB); the
#: bounded master may move by allocator noise, far below this
GROWTH_LIMIT = 64 * MiB
KEYS = [f"model/{layer}/{part}" for layer in range(4) for part in ("k", "v")]


def memory(pid: int, field: str) -> int:
    """VmHWM (peak resident) or VmRSS of a process, in bytes."""
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/{pid}/status")


@pytest.fixture
def master(tmp_path: Path) -> Iterator[MasterProcess]:
    with MasterProcess(extra=["--data-dir", str(tmp_path / "data")]) as process:
        yield process


def test_regex_compile_bomb_and_distinct_patterns_do_not_grow_the_master(
        master: MasterProcess) -> None:
    with MasterClient(master.target, timeout=60.0, client_id="tenant") as client:
        segment = StoreSegment("node-a:50161", 1, 1, 0x10_0000, MiB, "node-a")
        assert client.mount_segment(segment).code == ErrorCode.OK
        started = client.batch_put_start([(key, 64) for key in KEYS], ReplicaConfig())
        assert client.batch_put_end([(k, s.put_id) for k, s in zip(KEYS, started, strict=True)]
                                    ) == [ErrorCode.OK] * len(KEYS)
        assert client.list_keys("").total == len(KEYS)         # warm every code path once
        peak_before = memory(master.proc.pid, "VmHWM")

        # the attack: the compile bomb, on both calls, several times
        bomb = "(?:a{1000}){3000}"
        for _ in range(3):
            listed = client.list_keys(bomb)
            assert listed.code == ErrorCode.INVALID_PARAMS
            assert repr(bomb) in listed.message and str(MAX_REGEX_WEIGHT) in listed.message
            removed = client.remove_by_regex(bomb, force=True)
            assert (removed.code, removed.count) == (ErrorCode.INVALID_PARAMS, 0)
        peak_after_bomb = memory(master.proc.pid, "VmHWM")

        # ... and distinct patterns just under the bound: compiled, used, not kept
        rss_before = memory(master.proc.pid, "VmRSS")
        for i in range(40):
            assert client.list_keys(f"(?:a{{90}}){{100}}|^model/{i}/").code == ErrorCode.OK
        rss_after = memory(master.proc.pid, "VmRSS")

        print(f"master VmHWM {peak_before / MiB:.1f} -> {peak_after_bomb / MiB:.1f} MiB "
              f"(bomb); VmRSS {rss_before / MiB:.1f} -> {rss_after / MiB:.1f} MiB "
              "(40 distinct patterns)")
        assert peak_after_bomb - peak_before < GROWTH_LIMIT
        assert rss_after - rss_before < GROWTH_LIMIT

        # honest use: listing and removal by pattern still work, nothing was lost
        listed = client.list_keys(r"^model/\d/k$")
        assert (listed.code, [k.key for k in listed.keys]) == (
            ErrorCode.OK, sorted(k for k in KEYS if k.endswith("/k")))
        assert client.batch_exist_key(KEYS) == [ErrorCode.OK] * len(KEYS)
        removed = client.remove_by_regex(r"^model/3/", force=True)
        assert (removed.code, removed.count) == (ErrorCode.OK, 2)
        assert client.list_keys("").total == len(KEYS) - 2
