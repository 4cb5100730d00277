"""`hixl bench store` end to end: a real hixl-master, real segment holder processes, real
store clients; Mooncake Store side by side when it is installed.

Tiny sizes and few calls keep it quick; nothing here looks at how fast anything is (no
timing thresholds). It checks that every cell is reported and verified, that Mooncake runs
in the same arrangement when installed, that bad flags are refused by name, and that a
wrong byte is caught: by `verify` on real buffers, and through a real store whose value
was replaced behind the bench's back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from hixl.tools import cli, store_bench
from hixl.tools.daemons import MasterProcess
from hixl.tools.store_bench import StoreBench, StoreBenchConfig, StoreBenchFailure, verify

pytestmark = pytest.mark.timeout(240)

SIZES = (64 << 10, 1 << 20)
BATCH = 2
TINY = ["--sizes", "64K,1M", "--runs", "1", "--batch", str(BATCH), "--run-bytes", "256K"]


def _mooncake_missing() -> str | None:
    """Why Mooncake Store is not measured here; in CI it must be (the extra is installed)."""
    reason = store_bench.mooncake_store_unavailable()
    if reason is not None and os.environ.get("CI"):
        pytest.fail(f"CI installs the mooncake extra, yet: {reason}")
    return reason


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hixl.tools.cli", *args],
                          capture_output=True, text=True, timeout=220,
                          env={**os.environ, "MC_LOG_LEVEL": "ERROR"})


def test_every_cell_is_measured_verified_and_compared_with_mooncake() -> None:
    missing = _mooncake_missing()
    proc = _bench("bench", "store", *TINY, "--json", "-", "--no-progress")
    assert proc.returncode == 0, proc.stderr[-6000:]
    report = json.loads(proc.stdout)
    assert report["kind"] == "store" and report["verified"] is True
    assert report["across_nodes"] is False and report["holder_segments"]
    assert report["config"]["runs"] == 1 and report["config"]["batch"] == BATCH
    cells = {(c["system"], c["op"], c["size"]): c for c in report["cells"]}
    ours = {(op, size) for (system, op, size) in cells if system == "hixl"}
    assert ours == {(op, size) for op in store_bench.OPS for size in SIZES}
    for (system, op, size), cell in cells.items():
        if "skipped" in cell:
            continue
        assert cell["verified"] is True and cell["runs"] == 1
        assert cell["batch"] == (BATCH if op in store_bench.BATCH_OPS else 1)
        assert cell["calls"] >= store_bench.MIN_CALLS
        for key in ("gbps", "ops_per_s", "p50_us", "p99_us", "mean_us"):
            assert cell[key] > 0, (system, op, size, key)
        assert cell["p99_us"] >= cell["p50_us"]
    assert not any("skipped" in c for c in report["cells"] if c["system"] == "hixl")
    table = proc.stderr
    assert "correctness: every value read back and compared byte for byte" in table
    if missing is None:
        mooncake = report["mooncake"]
        assert mooncake["measured"] is True and mooncake["metadata"] == "P2PHANDSHAKE"
        assert {(op, size) for (system, op, size) in cells if system == "mooncake"} == ours
        # at these sizes Mooncake's calls all succeed: every cell has its ratio and target
        for op, size in ours:
            assert "skipped" not in cells[("mooncake", op, size)]
            assert cells[("hixl", op, size)]["vs_mooncake"] > 0
        versus = [t for t in report["targets"] if t["metric"] == "vs_mooncake"]
        assert {(t["op"], t["size"]) for t in versus} == ours
        assert all(t["limit"] == store_bench.TARGET_ONE_NODE for t in versus)
        assert "side by side: Mooncake Store" in table and "MC GB/s" in table
    else:
        assert report["mooncake"] == {"measured": False, "reason": missing}
        assert not any(t["metric"] == "vs_mooncake" for t in report["targets"])
        assert "Mooncake Store not measured" in table
    # the get_into forms read cached keys: each set against a memmove of its bytes
    cached = {(t["op"], t["size"]): t for t in report["targets"]
              if t["metric"] == "vs_copy_p50"}
    assert set(cached) == {(op, size) for op in store_bench.INTO_OPS for size in SIZES}
    for (op, size), target in cached.items():
        cell = cells[("hixl", op, size)]
        assert target["value"] == pytest.approx(cell["p50_us"] / cell["copy_p50_us"])
        assert target["met"] == (target["value"] <= store_bench.TARGET_CACHED_GET)


@pytest.mark.parametrize("command", [["bench", "store"], ["bench-store"]])
@pytest.mark.parametrize(("flags", "named"), [
    (["--batch", "0"], "--batch"),
    (["--runs", "two"], "--runs"),
    (["--sizes", "12Q"], "--sizes"),
    (["--master", "nohost"], "--master"),
    (["--mooncake-master", "1.2.3.4:x"], "--mooncake-master"),
    (["--run-bytes", "-1"], "--run-bytes"),
    (["--bogus"], "--bogus"),
    (["--workload", "vllm"], "--workload"),
    (["--concurrency", "0"], "--concurrency"),
])
def test_bad_flags_exit_2_naming_the_flag(command: list[str], flags: list[str], named: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main([*command, *flags])
    assert exc.value.code == cli.EXIT_USAGE
    assert named in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "named"), [
    (["--journal", "--master", "10.0.0.1:50051"], "--journal"),
    (["--journal", "--no-holder"], "--no-holder"),
    (["--concurrency", "2", "--workload", "lmcache"], "--concurrency"),
])
def test_flags_that_do_not_go_together_exit_2_naming_them(
        flags: list[str], named: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "store", *flags]) == cli.EXIT_USAGE
    assert named in capsys.readouterr().err


def test_concurrent_threads_and_a_journaled_master_are_measured_and_verified() -> None:
    """--concurrency 3 --journal: every cell of both hixl masters verified, each put
    form with its journaled p50 beside the in-memory one, and that target reported."""
    config = StoreBenchConfig(sizes=(64 << 10,), batch=2, runs=1, run_bytes=256 << 10,
                              mooncake=False, concurrency=3, journal=True)
    report = store_bench.run_store_bench(config)
    assert report["verified"] is True
    cells = {(c["system"], c["op"]): c for c in report["cells"]}
    for system in ("hixl", store_bench.JOURNAL_SYSTEM):
        for op in store_bench.OPS:
            cell = cells[(system, op)]
            assert cell["verified"] is True and cell["calls"] >= store_bench.MIN_CALLS
    for op in store_bench.OPS:
        ours = cells[("hixl", op)]
        assert ours["journal_vs_memory_p50"] == pytest.approx(
            cells[(store_bench.JOURNAL_SYSTEM, op)]["p50_us"] / ours["p50_us"])
    journal = [t for t in report["targets"] if t["metric"] == "journal_vs_memory_p50"]
    assert {t["op"] for t in journal} == store_bench.PUT_OPS
    assert all(t["met"] == (t["value"] <= store_bench.TARGET_JOURNAL) for t in journal)
    table = store_bench.format_store_report(report)
    assert "3 threads call the client at once" in table and "jrnl/mem" in table


def test_both_spellings_parse_to_the_same_config() -> None:
    flags = ["--sizes", "4K,8784K", "--batch", "3", "--runs", "2", "--no-mooncake",
             "--master", "10.0.0.1:50051", "--no-holder", "--local", "10.0.0.2"]
    parser = cli.build_parser()
    rewritten = parser.parse_args(["bench-store", *flags])
    config = cli.store_bench_config(rewritten)
    assert config == StoreBenchConfig(sizes=(4096, 8784 << 10), batch=3, runs=2,
                                      master="10.0.0.1:50051", mooncake=False, holders=False,
                                      local="10.0.0.2")
    assert config.segment_bytes() > 3 * (8784 << 10)  # the largest batch fits below 0.7


def test_verify_names_the_first_wrong_byte_on_real_buffers() -> None:
    expected = np.random.default_rng(7).integers(0, 256, 65536, dtype=np.uint8)
    verify("same", expected, expected.tobytes())             # bytes
    verify("same", expected, memoryview(expected.copy()))    # a buffer
    verify("same", expected, expected.copy())                # an array
    damaged = bytearray(expected.tobytes())
    damaged[40000] ^= 0xFF
    with pytest.raises(StoreBenchFailure, match=(
            f"label: WRONG BYTES at offset 40000 of 65536: expected {expected[40000]}, "
            f"found {expected[40000] ^ 0xFF}")):
        verify("label", expected, damaged)
    with pytest.raises(StoreBenchFailure, match="WRONG LENGTH: expected 65536 bytes, got 0"):
        verify("label", expected, b"")  # what Mooncake's get returns for a missing key


@pytest.mark.parametrize("concurrency", [1, 3])
def test_a_value_replaced_behind_the_benchs_back_fails_the_get_cell(concurrency: int) -> None:
    """The real path: a store whose value is not what the bench put (here replaced with an
    upsert through the same client) makes the get run fail, naming the key -- also when
    the check runs on one of several calling threads."""
    size = 64 << 10
    config = StoreBenchConfig(sizes=(size,), batch=2, runs=1, run_bytes=256 << 10,
                              mooncake=False, concurrency=concurrency)
    with StoreBench(config) as bench:
        assert bench.mooncake_info == {"measured": False,
                                       "reason": "not asked for (--no-mooncake)"}
        [side] = bench.sides
        stored = bench._store_values(side, size, 2)
        bench._get_run(side, "get_into", size, stored)  # intact: passes
        key, _ = stored[1]
        assert side.store.upsert(key, bytes(size)) == 0
        for op in ("get", "get_into", "get_batch", "batch_get_into"):
            with pytest.raises(StoreBenchFailure, match=f"hixl {op} 64K key {key}: WRONG BYTES"):
                bench._get_run(side, op, size, stored)


def test_no_holder_without_a_mounted_segment_is_refused_by_name() -> None:
    with MasterProcess(log_level="WARNING") as master:
        proc = _bench("bench-store", *TINY, "--master", master.target, "--no-holder",
                      "--no-mooncake", "--no-progress")
    assert proc.returncode == cli.EXIT_FAILED
    assert f"no segment is mounted at hixl-master {master.target}" in proc.stderr
    assert "--holder hixl" in proc.stderr


@pytest.mark.netns
@pytest.mark.timeout(300)
def test_store_bench_between_two_hosts_crosses_the_link() -> None:
    import netns

    netns.require()
    missing = _mooncake_missing()
    proc = subprocess.run(
        [sys.executable, os.path.join(netns.REPO, "scripts", "bench_multinode.py"), "--store",
         "--json", "-", *TINY],
        capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads(proc.stdout)
    report, links, moved = result["bench"], result["links"], result["moved"]
    b_ip = links["b"]["ip"]
    assert report["across_nodes"] is True and report["local"] == links["a"]["ip"]
    assert report["master"] == f"{b_ip}:50171" and report["verified"] is True
    assert all(name.startswith(b_ip + ":") for name in report["holder_segments"])
    hixl = {(c["op"], c["size"]) for c in report["cells"] if c["system"] == "hixl"}
    assert hixl == {(op, size) for op in store_bench.OPS for size in SIZES}
    assert report["mooncake"]["measured"] is (missing is None)
    if missing is None:
        assert report["mooncake"]["master"].startswith(b_ip + ":")
        versus = [t for t in report["targets"] if t["metric"] == "vs_mooncake"]
        assert versus and all(t["limit"] == store_bench.TARGET_ACROSS_NODES for t in versus)
    assert moved["write"] > 0 and moved["read"] > 0
    assert links["a"]["tx_bytes"] >= moved["write"] <= links["b"]["rx_bytes"]
    assert links["b"]["tx_bytes"] >= moved["read"] <= links["a"]["rx_bytes"]
    assert "the bytes crossed the link" in proc.stderr


def test_the_lmcache_workload_runs_both_systems_and_checks_every_chunk() -> None:
    """The caller-shaped mode (LMCache's batch_is_exist + batch_put_from / batch_get_into
    per request), tiny: every cell reported and verified; Mooncake side by side with a
    ratio when installed. No timing is looked at."""
    missing = _mooncake_missing()
    proc = subprocess.run(
        [sys.executable, "-m", "hixl.tools.store_bench", "--workload", "lmcache",
         "--sizes", "256K", "--runs", "1", "--batch", "2", "--run-bytes", "512K",
         "--json", "-"], capture_output=True, text=True, timeout=220,
        env={**os.environ, "MC_LOG_LEVEL": "ERROR"})
    assert proc.returncode == 0, proc.stderr[-6000:]
    report = json.loads(proc.stdout)
    assert report["config"]["workload"] == "lmcache" and report["verified"] is True
    assert report["targets"] == []
    cells = {(c["system"], c["op"]): c for c in report["cells"]}
    assert {op for system, op in cells if system == "hixl"} == set(store_bench.LMCACHE_OPS)
    for cell in cells.values():
        assert "skipped" not in cell, cell
        assert cell["verified"] is True and cell["batch"] == 2 and cell["size"] == 256 << 10
        assert cell["calls"] >= store_bench.MIN_CALLS and cell["p50_us"] > 0
    if missing is None:
        assert {op for system, op in cells if system == "mooncake"} == set(store_bench.LMCACHE_OPS)
        assert all(cells[("hixl", op)]["vs_mooncake"] > 0 for op in store_bench.LMCACHE_OPS)
    assert "a request's time is its batch_is_exist" in proc.stderr


@pytest.mark.parametrize(("flags", "named"), [
    (["--workload", "vllm"], "--workload"), (["--sizes", "12Q"], "--sizes"),
    (["--batch", "0"], "--batch")])
def test_the_modules_bench_flags_are_refused_by_name(flags: list[str], named: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        store_bench.main(flags)
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


def test_workload_defaults() -> None:
    assert StoreBenchConfig().sizes == store_bench.DEFAULT_SIZES
    lmcache = StoreBenchConfig(workload="lmcache")
    assert lmcache.sizes == store_bench.LMCACHE_SIZES and lmcache.ops == store_bench.LMCACHE_OPS
    with pytest.raises(ValueError, match="workload must be one of"):
        StoreBenchConfig(workload="vllm").check()


def test_the_command_lines_workload_flag_and_its_default_sizes() -> None:
    """`hixl bench store` alone is the call-forms bench at 64K,1M,8784K; --workload lmcache
    alone is LMCache's calls at 256K,1M,2M (not the call forms' sizes); --sizes overrides
    either."""
    parser = cli.build_parser()
    plain = cli.store_bench_config(parser.parse_args(["bench-store"]))
    assert plain == StoreBenchConfig()
    assert plain.workload == "calls" and plain.sizes == store_bench.DEFAULT_SIZES
    lmcache = cli.store_bench_config(parser.parse_args(["bench-store", "--workload", "lmcache"]))
    assert lmcache.workload == "lmcache" and lmcache.sizes == store_bench.LMCACHE_SIZES
    assert lmcache.ops == store_bench.LMCACHE_OPS
    sized = cli.store_bench_config(parser.parse_args(
        ["bench-store", "--workload", "lmcache", "--sizes", "64K"]))
    assert sized.sizes == (64 << 10,) and sized.workload == "lmcache"


def test_hixl_bench_store_workload_lmcache_runs_just_that_workload() -> None:
    """Through the real command line, default sizes: only LMCache's two request kinds, at
    each of its chunk sizes, every chunk verified (hixl only, to stay small)."""
    proc = _bench("bench", "store", "--workload", "lmcache", "--runs", "1", "--batch", "2",
                  "--run-bytes", "256K", "--no-mooncake", "--json", "-", "--no-progress")
    assert proc.returncode == 0, proc.stderr[-6000:]
    report = json.loads(proc.stdout)
    assert report["config"]["workload"] == "lmcache" and report["verified"] is True
    assert report["config"]["sizes"] == list(store_bench.LMCACHE_SIZES)
    cells = {(c["system"], c["op"], c["size"]): c for c in report["cells"]}
    assert set(cells) == {("hixl", op, size) for op in store_bench.LMCACHE_OPS
                          for size in store_bench.LMCACHE_SIZES}
    for cell in cells.values():
        assert "skipped" not in cell, cell
        assert cell["verified"] is True and cell["batch"] == 2 and cell["p50_us"] > 0
    assert "a request's time is its batch_is_exist" in proc.stderr
