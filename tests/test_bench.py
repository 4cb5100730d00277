"""`hixl bench` end to end: a real agent process, both engines, raw stream peer, JSON out.

Tiny sizes and `--seconds 0.05` keep it quick; nothing here looks at how fast anything is
(no timing thresholds): it checks the run covers every cell it should, the numbers are
positive, and the bytes were verified.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from hixl.processes import DaemonProcess
from hixl.tools import bench, cli

pytestmark = pytest.mark.timeout(180)

SIZES = (4096, 65536)
BATCHES = (1, 3)


def _run(*extra: str) -> tuple[dict, str]:
    proc = subprocess.run(
        [sys.executable, "-m", "hixl.tools.cli", "bench", "--sizes", "4K,64K",
         "--batch", "1,3", "--seconds", "0.05", "--warmup", "1", "--hixl-block", "64K",
         "--hixl-transfers", "4", "--json", "-", "--no-progress", *extra],
        capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout), proc.stderr


def _mooncake_missing() -> str | None:
    from hixl.tools import mooncake_baseline

    return mooncake_baseline.unavailable_reason()


def test_bench_json_has_every_cell_with_positive_numbers(tmp_path) -> None:
    plot = tmp_path / "bench.png"
    report, table = _run("--mooncake", "off", "--plot", str(plot))
    _check_plot(report, plot)
    assert report["verified"] is True
    cells = report["cells"]
    engine = {(c["path"], c["layout"], c["op"], c["mode"], c["block"], c["batch"]): c
              for c in cells if c["kind"] == "engine"}
    expected = {(p, lay, o, m, s, b) for p in bench.PATHS for lay in bench.LAYOUTS
                for o in bench.OPS for m in bench.MODES for s in SIZES for b in BATCHES}
    assert set(engine) == expected
    for cell in engine.values():
        # each cell says the path it took: the ranges inside a malloc_mem pool are mapped too
        assert cell["route"] == ("fabric" if cell["path"] == "fabric" else "unix"), cell
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
    style = {(h["path"], h["layout"], h["op"]) for h in report["hixl_style"]}
    assert style == {(p, lay, o) for p in bench.PATHS for lay in bench.LAYOUTS for o in bench.OPS}
    for run in report["hixl_style"]:
        assert run["calls"] == 3 and run["verified"] is True  # 4 transfers, first excluded
        assert run["gbps"] > 0 and run["first_us"] > 0
        assert run["route"] == ("fabric" if run["path"] == "fabric" else "unix")
        # ranges: 4 registered blocks; whole: as many blocks as the 192K segment holds
        assert run["blocks"] == (bench.HIXL_STYLE_BLOCKS if run["layout"] == "ranges" else 3)
    # blocks < 1 MiB and no x256 batch: the single-4K-op latency target applies, and every
    # fabric cell of the ranges layout is compared with its whole-segment twin
    assert {t["target"] for t in report["targets"]} == {
        "fabric one 4 KiB op: p50 <= 15 us",
        "fabric ranges in a malloc_mem pool: >= 0.95x whole segment"}
    assert len([t for t in report["targets"] if "ranges" in t["target"]]) == \
        len(bench.OPS) * len(bench.MODES) * len(SIZES) * len(BATCHES)
    assert "ranges" in table and "route" in table
    assert "ratio" in table and "HIXL-style" in table  # the table went to stderr
    assert report["across_nodes"] is False and report["local"] == "127.0.0.1"
    assert report["mooncake"] == {"measured": False, "reason": "not asked for (--mooncake off)"}
    assert "Mooncake: not measured: not asked for" in table
    assert not any("vs_mooncake" in c for c in cells)


def _check_plot(report: dict, plot) -> None:
    """--plot wrote a PNG, and its lines are the report's sync cells, one per series."""
    from hixl.tools.bench_plot import series

    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = series(report)
    sync_engine = [c for c in report["cells"] if c["kind"] == "engine" and c["mode"] == "sync"]
    for cell in sync_engine:
        name = f"hixl {cell['op']}" + (" (ranges)" if cell["layout"] == "ranges" else "")
        points = lines[(cell["path"], name, cell["batch"] > 1)]
        assert (cell["block"], cell["gbps"], cell["p50_us"]) in points
    assert {name for path, name, _ in lines if path == "fabric"} >= {
        "hixl read", "hixl write", "hixl read (ranges)", "hixl write (ranges)", "memcpy copy"}
    assert {name for path, name, _ in lines if path == "socket"} >= {"hixl read", "hixl write"}
    assert all(points == sorted(points) for points in lines.values())
    assert len([p for points in lines.values() for p in points]) == sum(
        1 for c in report["cells"] if c.get("mode", "sync") == "sync")


def test_plot_is_refused_before_the_run(tmp_path, monkeypatch, capsys) -> None:
    """A --plot that cannot be written fails at once, naming the fix, not after the bench."""
    missing_dir = tmp_path / "no" / "such" / "dir" / "bench.png"
    code = cli.main(["bench", "--plot", str(missing_dir), "--no-progress"])
    assert code == cli.EXIT_FAILED
    assert "not a writable directory" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if hixl[plot] were not installed
    code = cli.main(["bench", "--plot", str(tmp_path / "bench.png"), "--no-progress"])
    assert code == cli.EXIT_FAILED
    assert "pip install 'hixl[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "bench.png").exists()


def test_bench_against_a_raw_peer_started_separately() -> None:
    """--raw-peer: the raw stream server runs on its own (as on another node), TCP only."""
    with DaemonProcess(
            [sys.executable, "-m", "hixl.tools.bench", "--raw-server", "--tcp",
             "127.0.0.1:0", "--buffer", str(1 << 20), "--forever"],
            name="raw stream server", ready=bench.RAW_READY) as server:
        ready = server.wait_ready().split()
        assert ready[0] == bench.RAW_READY
        peer = f"127.0.0.1:{ready[1]}"
        report, _ = _run("--raw-peer", peer, "--local", "127.0.0.1", "--paths", "socket",
                         "--modes", "sync", "--no-hixl-style", "--mooncake", "off")
    assert report["raw_peer"] == peer and report["socket_baseline"] == "raw-tcp"
    assert report["paths"] == {"socket": {"route": "unix"}}
    baselines = {(c["name"], c["op"], c["block"], c["batch"]) for c in report["cells"]
                 if c["kind"] == "baseline"}
    assert baselines == {("raw-tcp", op, size, batch) for op in bench.OPS for size in SIZES
                         for batch in BATCHES}
    for cell in report["cells"]:
        if cell["kind"] == "engine":
            assert cell["baseline"] == "raw-tcp" and cell["ratio"] > 0 and cell["verified"]


@pytest.mark.skipif(_mooncake_missing() is not None,
                    reason="optional extra hixl[mooncake] (mooncake.engine) not installed")
def test_bench_measures_mooncake_side_by_side() -> None:
    report, table = _run("--mooncake", "on", "--paths", "socket", "--modes", "sync",
                         "--no-hixl-style")
    info = report["mooncake"]
    assert info["measured"] is True and info["protocol"] == "tcp"
    assert info["metadata"] == "P2PHANDSHAKE" and info["segment"].startswith("127.0.0.1:")
    mooncake = {(c["op"], c["block"], c["batch"]): c for c in report["cells"]
                if c["kind"] == "baseline" and c["name"] == "mooncake"}
    assert set(mooncake) == {(op, size, batch) for op in bench.OPS for size in SIZES
                             for batch in BATCHES}
    for cell in mooncake.values():
        assert cell["gbps"] > 0 and cell["calls"] >= 2 and cell["p99_us"] >= cell["p50_us"]
    engine = [c for c in report["cells"] if c["kind"] == "engine"]
    assert len(engine) == len(mooncake) * len(bench.LAYOUTS)  # each layout vs Mooncake
    for cell in engine:
        base = mooncake[(cell["op"], cell["block"], cell["batch"])]
        assert cell["mooncake_gbps"] == base["gbps"]
        assert cell["vs_mooncake"] > 0 and cell["vs_mooncake_p50"] > 0
    assert "vs Mooncake TransferEngine" in table


def test_bench_without_mooncake_says_why_when_it_is_required(monkeypatch) -> None:
    """--mooncake on fails by name when the engine is missing; auto runs without it."""
    from hixl.tools import mooncake_baseline

    monkeypatch.setattr(mooncake_baseline, "unavailable_reason",
                        lambda: "mooncake.engine does not import (test)")
    args = ["--paths", "socket", "--ops", "write", "--modes", "sync", "--sizes", "4K",
            "--batch", "1", "--seconds", "0.02", "--warmup", "0", "--no-hixl-style"]
    config = cli.bench_config(cli.build_parser().parse_args(["bench", *args, "--mooncake", "on"]))
    with pytest.raises(bench.BenchFailure, match="Mooncake was required.*does not import"):
        bench.run_bench(config)
    config = cli.bench_config(cli.build_parser().parse_args(["bench", *args]))
    report = bench.run_bench(config)
    assert report["mooncake"] == {"measured": False,
                                  "reason": "mooncake.engine does not import (test)"}
    assert "Mooncake: not measured: mooncake.engine does not import" in bench.format_report(
        report)


def test_bench_hixl_style_only_and_json_file(tmp_path) -> None:
    out = tmp_path / "bench.json"
    code = cli.main(["bench", "--hixl-style", "--paths", "fabric", "--ops", "write",
                     "--hixl-block", "16K", "--hixl-transfers", "3", "--json", str(out),
                     "--no-progress"])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["cells"] == []
    assert [(h["path"], h["layout"], h["op"], h["calls"]) for h in report["hixl_style"]] == [
        ("fabric", "whole", "write", 2), ("fabric", "ranges", "write", 2)]
    assert report["verified"] is True


def test_bench_refuses_bad_flags(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--paths", "carrier-pigeon"])
    assert exc.value.code == 2
    assert "choose from fabric, socket" in capsys.readouterr().err
    for flag in ("--raw-peer", "--mooncake-peer"):
        with pytest.raises(SystemExit) as exc:
            cli.main(["bench", flag, "no-port-here"])
        assert exc.value.code == 2
        assert "expected HOST:PORT" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--mooncake", "maybe"])
    assert exc.value.code == 2


def test_cross_node_and_mooncake_targets() -> None:
    """Across nodes the raw-stream target is 0.8x; Mooncake targets apply once measured."""
    def cell(block: int, batch: int, **numbers: float) -> dict:
        return {"kind": "engine", "path": "socket", "op": "write", "mode": "sync",
                "block": block, "batch": batch, **numbers}

    cells = [cell(bench.HIXL_BLOCK, 1, ratio_p50=0.75, vs_mooncake=3.0, vs_mooncake_p50=2.4),
             cell(4096, 256, ratio_p50=0.9, vs_mooncake=5.5, vs_mooncake_p50=6.0)]
    targets = {t["target"]: t for t in bench.evaluate_targets(cells, across_nodes=True)}
    raw = targets["socket >= 1 MiB: >= 0.8x raw stream (across nodes)"]
    assert raw["limit"] == 0.8 and raw["met"] is False
    assert targets["socket 8784 KiB: >= 2.5x Mooncake tcp"]["met"] is False  # p50 ratio 2.4
    assert targets["socket 4 KiB x256: >= 5x Mooncake tcp"]["met"] is True
    same_node = {t["target"]: t for t in bench.evaluate_targets(cells)}
    assert same_node["socket >= 1 MiB: >= 0.7x raw stream"]["met"] is True


def test_local_address_towards_an_agent() -> None:
    assert bench.local_address_towards("127.0.0.1:50051") == "127.0.0.1"
    assert bench.split_host_port("[::1]:7") == ("::1", 7)
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        bench.split_host_port("10.0.0.1")


def test_batches_are_capped_by_call_size() -> None:
    config = bench.BenchConfig(sizes=(64 << 20,), batches=(1, 8), max_call_bytes=256 << 20)
    assert config.batches_for(64 << 20) == [1, 4]
    assert bench.BenchConfig().batches_for(4096) == [1, 256]
    assert bench.sample_windows(4096, 1) == [(0, 4096)]
    assert bench.sample_windows(1 << 20, 3) == [(0, 262144), (786432, 262144),
                                                (2097152, 262144), (2883584, 262144)]


def test_progress_bar_counts_every_cell_to_the_end() -> None:
    """--progress draws a bar that reaches total/total, naming the cell under way."""
    import io

    stream = io.StringIO()
    args = ["--paths", "fabric", "--ops", "write", "--modes", "sync", "--sizes", "4K",
            "--batch", "1,2", "--seconds", "0.02", "--warmup", "0", "--no-hixl-style",
            "--mooncake", "off"]
    report = bench.run_bench(cli.bench_config(cli.build_parser().parse_args(["bench", *args])),
                             stream)
    frames = stream.getvalue().replace("\r", "\n")
    counts = [(int(n), int(total)) for n, total in re.findall(r" (\d+)/(\d+) \[", frames)]
    totals = {total for _, total in counts}
    assert len(totals) == 1, counts  # known once the run starts, then fixed
    [total] = totals
    done = [n for n, _ in counts]
    assert done == sorted(done) and done[-1] == total >= len(report["cells"]), counts
    assert "0/?" in frames and "starting hixl-agent" in frames
    assert "fabric write sync ranges 4K x2" in frames, frames[-800:]


def test_bench_array_api_cells_beside_the_list_cells() -> None:
    """apis=("list", "arrays"): each engine cell is measured twice, through Engine.transfer
    (a TransferOpDesc list) and Engine.transfer_arrays (address arrays), on the same ops;
    both verified, both compared with the same baseline, and the arrays' own target
    appears for the 4 KiB x256 fabric cells."""
    config = bench.BenchConfig(paths=bench.PATHS, layouts=("whole",), ops=tuple(bench.OPS),
                               modes=bench.MODES, apis=bench.APIS, sizes=(4096,),
                               batches=(1, 256), seconds=0.02, warmup=1, hixl_style=False,
                               mooncake="off")
    report = bench.run_bench(config)
    assert report["verified"] is True
    engine = {(c["path"], c["op"], c["mode"], c["api"], c["batch"]): c
              for c in report["cells"] if c["kind"] == "engine"}
    assert set(engine) == {(p, o, m, a, b) for p in bench.PATHS for o in bench.OPS
                           for m in bench.MODES for a in bench.APIS for b in (1, 256)}
    for (path, op, mode, _api, batch), cell in engine.items():
        assert cell["verified"] is True and cell["calls"] >= 2
        assert cell["gbps"] > 0 and cell["ops_per_s"] > 0 and cell["ratio"] > 0
        twin = engine[(path, op, mode, "list", batch)]
        assert cell["baseline"] == twin["baseline"] and cell["route"] == twin["route"]
    arrays_targets = [t for t in report["targets"] if "as arrays" in t["target"]]
    assert {(t["op"], t["mode"]) for t in arrays_targets} == {
        (o, m) for o in bench.OPS for m in bench.MODES}
    table = bench.format_report(report)
    assert " arrays " in table and "Engine.transfer_arrays" in table
    with pytest.raises(ValueError, match="unknown api"):
        bench.run_bench(bench.BenchConfig(apis=("tuples",)))
