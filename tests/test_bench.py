"""`hixl bench` end to end: a real agent process, both engines, raw stream peer, JSON out.

Tiny sizes and `--seconds 0.05` keep it quick; nothing here looks at how fast anything is
(no timing thresholds): it checks the run covers every cell it should, the numbers are
positive, and the bytes were verified.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hixl.client import bench, cli

pytestmark = pytest.mark.timeout(180)

SIZES = (4096, 65536)
BATCHES = (1, 3)


def _run(*extra: str) -> tuple[dict, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "hixl.client.cli", "bench", "--sizes", "4K,64K",
         "--batch", "1,3", "--seconds", "0.05", "--warmup", "1", "--hixl-block", "64K",
         "--hixl-transfers", "4", "--json", "-", "--no-progress", *extra],
        capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr


def test_bench_json_has_every_cell_with_positive_numbers() -> None:
    report, table = _run()
    assert report["verified"] is True
    cells = report["cells"]
    engine = {(c["path"], c["op"], c["mode"], c["block"], c["batch"]): c
              for c in cells if c["kind"] == "engine"}
    expected = {(p, o, m, s, b) for p in bench.PATHS for o in bench.OPS for m in bench.MODES
                for s in SIZES for b in BATCHES}
    assert set(engine) == expected
    for cell in engine.values():
        assert cell["verified"] is True
        assert cell["calls"] >= 2
        for key in ("gbps", "ops_per_s", "p50_us", "p99_us", "mean_us", "baseline_gbps",
                    "ratio", "ratio_p50", "p50_gbps"):
            assert cell[key] > 0, (key, cell)
        assert cell["p99_us"] >= cell["p50_us"]
        assert cell["baseline"] == ("memcpy" if cell["path"] == "fabric"
                                    else report["socket_baseline"])
        assert (cell.get("shm_ratio", 0) > 0) == (cell["path"] == "fabric")
    baselines = {(c["name"], c["op"], c["block"], c["batch"]) for c in cells
                 if c["kind"] == "baseline"}
    for size in SIZES:
        for batch in BATCHES:
            assert ("memcpy", "copy", size, batch) in baselines
            for op in bench.OPS:
                assert ("memcpy-shm", op, size, batch) in baselines
            for kind in ("raw-unix", "raw-tcp"):
                for op in bench.OPS:
                    assert (kind, op, size, batch) in baselines
    # on one node the fabric engine maps the segment and the socket engine uses unix
    assert report["paths"]["fabric"]["route"] == "fabric"
    assert report["paths"]["socket"]["route"] == "unix"
    assert report["socket_baseline"] == "raw-unix"
    style = {(h["path"], h["op"]) for h in report["hixl_style"]}
    assert style == {(p, o) for p in bench.PATHS for o in bench.OPS}
    for run in report["hixl_style"]:
        assert run["calls"] == 3 and run["verified"] is True  # 4 transfers, first excluded
        assert run["gbps"] > 0 and run["first_us"] > 0
    # blocks < 1 MiB and no x256 batch: only the single-4K-op latency target applies
    assert {t["target"] for t in report["targets"]} == {"fabric one 4 KiB op: p50 <= 15 us"}
    assert "ratio" in table and "HIXL-style" in table  # the table went to stderr


def test_bench_hixl_style_only_and_json_file(tmp_path) -> None:
    out = tmp_path / "bench.json"
    code = cli.main(["bench", "--hixl-style", "--paths", "fabric", "--ops", "write",
                     "--hixl-block", "16K", "--hixl-transfers", "3", "--json", str(out),
                     "--no-progress"])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["cells"] == []
    assert [(h["path"], h["op"], h["calls"]) for h in report["hixl_style"]] == [
        ("fabric", "write", 2)]
    assert report["verified"] is True


def test_bench_refuses_bad_flags(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--paths", "carrier-pigeon"])
    assert exc.value.code == 2
    assert "choose from fabric, socket" in capsys.readouterr().err


def test_batches_are_capped_by_call_size() -> None:
    config = bench.BenchConfig(sizes=(64 << 20,), batches=(1, 8), max_call_bytes=256 << 20)
    assert config.batches_for(64 << 20) == [1, 4]
    assert bench.BenchConfig().batches_for(4096) == [1, 256]
    assert bench.sample_windows(4096, 1) == [(0, 4096)]
    assert bench.sample_windows(1 << 20, 3) == [(0, 262144), (786432, 262144),
                                                (2097152, 262144), (2883584, 262144)]
