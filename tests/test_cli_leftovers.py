"""Command-line leftovers of issues 17 and 18: `hixl bench --api`, through the real
command line (a private agent, tiny sizes; no timing looked at)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hixl.tools import bench, cli

pytestmark = pytest.mark.timeout(180)


def _bench(*extra: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "hixl.tools.cli", "bench", "--paths", "fabric", "--ops",
         "write", "--modes", "sync", "--layouts", "whole", "--sizes", "4K", "--batch", "1,4",
         "--seconds", "0.02", "--warmup", "1", "--no-hixl-style", "--mooncake", "off",
         "--json", "-", "--no-progress", *extra],
        capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout)


def _engine_cells(report: dict) -> dict:
    return {(c["api"], c["batch"]): c for c in report["cells"] if c["kind"] == "engine"}


def test_bench_api_arrays_measures_array_cells_only() -> None:
    report = _bench("--api", "arrays")
    assert report["config"]["apis"] == ["arrays"] and report["verified"] is True
    cells = _engine_cells(report)
    assert set(cells) == {("arrays", 1), ("arrays", 4)}
    for cell in cells.values():
        assert cell["verified"] is True and cell["calls"] >= 2 and cell["gbps"] > 0


def test_bench_api_both_and_the_default() -> None:
    both = _engine_cells(_bench("--api", "list,arrays"))
    assert set(both) == {(api, batch) for api in bench.APIS for batch in (1, 4)}
    parser = cli.build_parser()
    assert cli.bench_config(parser.parse_args(["bench"])).apis == bench.BenchConfig().apis
    assert cli.bench_config(parser.parse_args(["bench", "--api", "ARRAYS,list"])).apis == (
        "arrays", "list")


@pytest.mark.parametrize("value", ["tuples", "list,tuples", ","])
def test_bench_api_refuses_a_bad_value_naming_the_choices(
        value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--api", value])
    assert exc.value.code == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "--api" in err and "choose from list, arrays" in err, err


def test_bench_local_memory_reaches_the_config_and_refuses_others(
        capsys: pytest.CaptureFixture[str]) -> None:
    """`--local-memory cuda` (issue 21: the HIXL-style run with the local side on the
    device; `--local` is the engines' IP already). The run itself needs a GPU
    (scripts/gpu_check.sh); here the flag's parsing and its refusals."""
    parser = cli.build_parser()
    assert cli.bench_config(parser.parse_args(["bench"])).local_memory == "host"
    assert cli.bench_config(parser.parse_args(
        ["bench", "--local-memory", "cuda"])).local_memory == "cuda"
    with pytest.raises(SystemExit) as exc:
        cli.main(["bench", "--local-memory", "npu"])
    assert exc.value.code == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "--local-memory" in err and "'host', 'cuda'" in err, err
