"""MoE dispatch/combine on hixl.shmem (hixl.tools.moe): the example run as real PE
processes by the launcher (shmem_run.run_job), compared in every PE with the
single-process reference; the bench beside torch.distributed gloo; a PE killed in the
middle of a dispatch.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hixl.client.shmem import BOOTSTRAP_ENV, JOB_ENV, N_PES_ENV, PE_ENV
from hixl.errors import ParamInvalid
from hixl.tools import moe, moe_bench
from hixl.tools.daemons import MasterProcess
from hixl.tools.shmem_run import run_job

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "moe_dispatch_combine.py"
GIVE_UP_S = 120.0  # only guards against a hang; never a performance bound
_PE_LINE = re.compile(r"^\[pe (\d+)\] (.*)$")


def torch_importable() -> bool:
    return moe_bench.torch_unavailable() is None


def run_example(n_pes: int, *args: str) -> tuple[Any, dict[int, list[str]]]:
    """The example under the launcher: its JobResult and each PE's output lines."""
    out = io.StringIO()
    result = run_job([sys.executable, str(EXAMPLE), *args], n_pes, timeout=GIVE_UP_S,
                     output=out)
    lines: dict[int, list[str]] = {}
    for line in out.getvalue().splitlines():
        match = _PE_LINE.match(line)
        if match:
            lines.setdefault(int(match.group(1)), []).append(match.group(2))
    return result, lines


def example_results(n_pes: int, *args: str) -> list[dict[str, Any]]:
    result, lines = run_example(n_pes, *args, "--json")
    assert result.ok, (result, lines)
    return [json.loads(next(t for t in lines[pe] if t.startswith("{"))) for pe in range(n_pes)]


@pytest.mark.parametrize(("n_pes", "dtype", "local_paths", "route"), [
    (2, "float32", "on", "fabric"),
    (3, "float32", "on", "fabric"),
    (2, "float16", "on", "fabric"),
    (3, "float16", "off", "tcp"),
], ids=["2pes-fp32-mapped", "3pes-fp32-mapped", "2pes-fp16-mapped", "3pes-fp16-tcp"])
def test_the_example_equals_the_single_process_reference(n_pes: int, dtype: str,
                                                         local_paths: str, route: str) -> None:
    # an odd hidden size: fp16 rows are not a multiple of 4 bytes; more experts than topk
    results = example_results(n_pes, "--tokens", "24", "--hidden", "37", "--topk", "3",
                              "--experts-per-pe", "2", "--dtype", dtype, "--iterations", "4",
                              "--local-paths", local_paths)
    for pe, r in enumerate(results):
        assert r["pe"] == pe and r["n_pes"] == n_pes
        assert r["routes"] == ["self" if t == pe else route for t in range(n_pes)]
        assert len(r["checks"]) == 4  # every pass, fresh tokens each
        for check in r["checks"]:
            # bit-equal to the reference (same operations in the same order), and within
            # the stated tolerance of float64: 1e-5 for float32, 1e-2 for float16
            assert check["exact"] is True, check
            assert check["within_tolerance"] is True and check["ok"] is True, check
            assert check["tolerance"] == moe.TOLERANCE[dtype]
            assert check["metadata_problems"] == [], check
        assert r["ok"] is True


def test_the_example_prints_its_check_and_the_default_shape_runs() -> None:
    result, lines = run_example(2, "--tokens", "16", "--hidden", "7168", "--topk", "8",
                                "--experts-per-pe", "8", "--iterations", "2")
    assert result.ok and result.exit_status == 0, (result, lines)
    for pe in range(2):
        assert any("equals the single-process reference exactly" in t for t in lines[pe]), lines


def test_reference_checks_catch_a_wrong_output_and_shapes_are_checked() -> None:
    shape = moe.MoeShape(8, 16, 2, 2, "float16")
    ref = moe.reference_output(shape, 2, 1, iteration=3, seed=5)
    good = moe.check_output(ref.copy(), shape, 2, 1, 3, 5)
    assert good.ok and good.exact and good.within_tolerance
    off_by_one_ulp = ref.copy()
    off_by_one_ulp.view(np.uint16)[2, 3] += 1
    close = moe.check_output(off_by_one_ulp, shape, 2, 1, 3, 5)
    assert not close.exact and close.within_tolerance and not close.ok
    stale = moe.reference_output(shape, 2, 1, iteration=2, seed=5)  # the previous pass
    assert not moe.check_output(stale, shape, 2, 1, 3, 5).ok
    # every PE's routing is deterministic, distinct per token, weights a softmax
    inputs = moe.make_inputs(shape, 2, 1, 3, 5)
    assert all(len(set(row)) == shape.topk for row in inputs.expert_ids.tolist())
    assert np.allclose(inputs.weights.sum(axis=1), 1.0, atol=1e-6)
    again = moe.make_inputs(shape, 2, 1, 3, 5)
    assert np.array_equal(inputs.x, again.x) and np.array_equal(inputs.expert_ids,
                                                                again.expert_ids)
    with pytest.raises(ParamInvalid, match="topk 5"):
        moe.MoeShape(4, 8, 5, 2).check(2)
    with pytest.raises(ParamInvalid, match="bfloat16"):
        moe.MoeShape(4, 8, 2, 2, "bfloat16").check(2)
    # worst case per (source, destination): a token sends a PE at most min(K, experts/PE)
    assert moe.BufferPlan(moe.MoeShape(16, 8, 8, 2), 4).max_rows == 32


def test_the_metadata_check_catches_wrong_missing_and_misattributed_rows() -> None:
    shape, n_pes, me = moe.MoeShape(12, 4, 3, 2), 3, 1

    def received() -> moe.Dispatched:
        """What PE `me` receives from every source, as a correct dispatch lays it out."""
        blocks = []
        for source in range(n_pes):
            routing = moe.route(moe.make_inputs(shape, n_pes, source).expert_ids, shape, n_pes)
            rows = slice(routing.first[me], routing.first[me] + routing.rows_to[me])
            flat = routing.order[rows]
            meta = np.stack([np.full(flat.size, source), flat // shape.topk,
                             flat % shape.topk, routing.experts[rows]], axis=1).astype(np.int32)
            counts = routing.counts[me * shape.experts_per_pe:(me + 1) * shape.experts_per_pe]
            blocks.append(moe.Received(source, int(routing.first[me]), counts,
                                       np.zeros((flat.size, shape.hidden)), meta))
        return moe.Dispatched(1, routing, blocks)

    assert moe.check_metadata(received(), shape, n_pes, me) == []
    wrong_expert = received()
    meta = wrong_expert.received[0].meta
    meta[0, 3] = me * shape.experts_per_pe + (meta[0, 3] + 1) % shape.experts_per_pe
    assert any("wrong expert" in p for p in moe.check_metadata(wrong_expert, shape, n_pes, me))
    missing = received()
    missing.received[2].meta = missing.received[2].meta[1:]
    assert any("not exactly" in p for p in moe.check_metadata(missing, shape, n_pes, me))
    misattributed = received()
    misattributed.received[1].meta[:, 0] = 0
    assert any("another source" in p
               for p in moe.check_metadata(misattributed, shape, n_pes, me))


# ---------------------------------------------------------------- a PE dies mid-dispatch

# A PE of the job: one good pass, then pass 2, where the victim dies (SIGKILL, sent to
# itself) right after putting its rows, before the signal announcing them.
_DYING_PE = textwrap.dedent("""
    import json, os, signal, sys
    import hixl.shmem as shmem
    from hixl.tools import moe
    from hixl.errors import HixlError

    victim, n = int(sys.argv[1]), int(os.environ["HIXL_SHMEM_N_PES"])
    shape = moe.MoeShape(16, 256, 2, 2)
    ctx = shmem.init(heap_size=moe.heap_bytes(shape, n), lease_ttl_ms=1000, timeout=30)
    layer = moe.MoeLayer(ctx, shape)
    layer.forward(moe.make_inputs(shape, n, ctx.my_pe, 0))
    ctx.barrier_all()
    if ctx.my_pe == victim:
        ctx.signal = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
    try:
        layer.forward(moe.make_inputs(shape, n, ctx.my_pe, 1))
        print(json.dumps({"pe": ctx.my_pe, "error": None}), flush=True)
    except HixlError as exc:
        print(json.dumps({"pe": ctx.my_pe, "error": type(exc).__name__,
                          "failed": list(exc.failed), "message": str(exc)}), flush=True)
        ctx.finalize(barrier=False)
        sys.exit(3)
""")


def test_a_pe_killed_mid_dispatch_makes_the_others_fail_with_a_typed_error() -> None:
    n_pes, victim = 3, 2
    job = f"moe-kill-{uuid.uuid4().hex[:8]}"
    with MasterProcess(log_level="WARNING") as master:
        procs = [subprocess.Popen(
            [sys.executable, "-c", _DYING_PE, str(victim)], stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
            env={**os.environ, PE_ENV: str(pe), N_PES_ENV: str(n_pes),
                 BOOTSTRAP_ENV: master.target, JOB_ENV: job})
            for pe in range(n_pes)]
        try:
            outputs = [proc.communicate(timeout=GIVE_UP_S) for proc in procs]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    assert procs[victim].returncode == -signal.SIGKILL
    for pe in range(n_pes):
        if pe == victim:
            continue
        stdout, stderr = outputs[pe]
        assert procs[pe].returncode == 3, (pe, stdout, stderr[-3000:])
        reply = json.loads(stdout.strip().splitlines()[-1])
        assert reply["error"] == "PeerUnavailable", reply
        assert reply["failed"] == [victim] and f"PE {victim}" in reply["message"], reply


def test_the_launcher_reports_a_pe_killed_mid_dispatch_and_stops_the_others() -> None:
    out = io.StringIO()
    result = run_job([sys.executable, "-c", _DYING_PE, "1"], 3, timeout=GIVE_UP_S, output=out)
    assert not result.ok and not result.timed_out
    assert result.failed_pe == 1 and result.exit_status == 128 + signal.SIGKILL
    assert any("PE 1 failed (killed by signal 9)" in r for r in result.reasons), result
    assert all(code is not None for code in result.returncodes.values())  # none left running


# ---------------------------------------------------------------- the bench


TINY = (moe.MoeShape(8, 40, 2, 2), moe.MoeShape(5, 24, 3, 2))


def _parse_bench(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hixl")
    moe_bench.add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench-moe", *argv])


def test_bench_moe_reports_hixl_beside_torch_gloo_every_pass_verified(
        capsys: pytest.CaptureFixture[str]) -> None:
    torch_ok = torch_importable()
    if not torch_ok and os.environ.get("CI") == "true":
        pytest.fail(f"CI installs the torch extra, yet: {moe_bench.torch_unavailable()}")
    args = _parse_bench("--shapes", "8x40x2x2,5x24x3x2", "--iterations", "3", "--warmup",
                        "1", "--json", "-")
    assert args.shapes == TINY and args.paths == ("mapped", "tcp")
    assert args.handler(args) == 0
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    table = captured.err
    assert report["kind"] == "moe" and report["verified"] is True
    assert report["config"]["n_pes"] == 2
    systems = [(c["system"], c["path"]) for c in report["cells"]]
    expected = [("hixl", "mapped")] * 2 + [("hixl", "tcp")] * 2
    if torch_ok:
        expected += [("torch", "gloo")] * 2
        assert report["torch"]["measured"] is True and report["torch"]["version"]
    else:  # pragma: no cover - only where the torch extra is not installed
        assert report["torch"]["measured"] is False and "torch" in report["torch"]["reason"]
        assert "torch.distributed not measured" in table
    assert systems == expected
    for cell in report["cells"]:
        assert cell["verified"] is True and cell["problems"] == [], cell
        assert cell["passes"] == 3
        assert cell["shape"]["dtype"] == "float32"
        for phase in ("dispatch_ms", "combine_ms", "compute_ms", "total_ms"):
            assert set(cell[phase]) == {"p50", "p99"} and cell[phase]["p50"] > 0
        assert cell["gbps"] > 0 and cell["moved_bytes"] == moe.moved_bytes(
            moe.MoeShape(**cell["shape"]), 2)
        assert ("vs_torch" in cell) == (torch_ok and cell["system"] == "hixl")
        if cell["system"] == "hixl":
            assert cell["routes"] == (["fabric"] if cell["path"] == "mapped" else ["tcp"])
    assert "correctness: every timed pass equals" in table and "hixl mapped" in table


def test_bench_moe_float16_with_three_pes_one_path_and_no_torch() -> None:
    config = moe_bench.MoeBenchConfig(shapes=(moe.MoeShape(6, 20, 3, 1),), n_pes=3,
                                      iterations=2, warmup=0, dtype="float16",
                                      paths=("mapped",), torch="off")
    report = moe_bench.run_moe_bench(config)
    assert report["torch"] == {"measured": False, "version": None, "backend": "gloo",
                               "reason": "--torch off"}
    (cell,) = report["cells"]
    assert cell["verified"] and cell["shape"]["dtype"] == "float16"
    assert cell["max_abs_err"] <= moe.TOLERANCE["float16"] * 10
    assert "torch.distributed not measured: --torch off" in moe_bench.format_moe_report(report)


def test_a_mismatch_shows_in_the_report_and_fails_the_command() -> None:
    shape = moe.MoeShape(4, 8, 2, 2)
    records = [{"rank": r, "dispatch": [0.001, 0.002], "compute": [0.0, 0.0],
                "combine": [0.001, 0.001], "max_abs_err": 0.0,
                "problems": ["pass 1: 3 of 4 tokens differ from the reference"] if r else []}
               for r in range(2)]
    cell = moe_bench.summarize("hixl", "mapped", shape, 2, records)
    assert cell["verified"] is False
    assert cell["problems"] == ["rank 1: pass 1: 3 of 4 tokens differ from the reference"]
    assert cell["total_ms"]["p50"] == pytest.approx(2.5)  # the slowest PE's pass
    report = {"config": {"n_pes": 2, "dtype": "float32", "iterations": 2, "warmup": 0},
              "torch": {"measured": False, "reason": "--torch off"}, "host": {"cpus": 2},
              "cells": [cell], "verified": False}
    text = moe_bench.format_moe_report(report)
    assert "MISMATCH" in text and "correctness: FAILED" in text and "3 of 4 tokens" in text


def test_bench_moe_flags_are_checked() -> None:
    for argv in (["--shapes", "8x40x2"], ["--shapes", "8x40x0x2"], ["--paths", "fabric"],
                 ["--n-pes", "0"], ["--dtype", "bfloat16"]):
        with pytest.raises(SystemExit):
            _parse_bench(*argv)
    with pytest.raises(ParamInvalid, match="topk"):
        moe_bench.run_moe_bench(moe_bench.MoeBenchConfig(shapes=(moe.MoeShape(4, 8, 5, 2),),
                                                         torch="off"))


def test_the_command_line_runs_the_bench() -> None:
    """`hixl bench moe` (the spelling users type) reaches the same command."""
    done = subprocess.run([sys.executable, "-m", "hixl.tools.cli", "bench", "moe", "--shapes",
                           "5x24x3x2", "--iterations", "2", "--warmup", "1", "--paths",
                           "mapped", "--torch", "off", "--json", "-"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert report["kind"] == "moe" and report["verified"] is True
    assert [(c["system"], c["path"]) for c in report["cells"]] == [("hixl", "mapped")]
