"""The KV-offload scenario (hixl.tools.kv_offload): the example run by the real launcher
(`run_job`, what `hixl shmem-run` runs) with every page checked in the PEs, mapped and
over TCP; `hixl bench kv-offload` at tiny sizes (its report's structure, never its
timings); a pool PE killed mid-run; and the page checks themselves.
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
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import waiting

from hixl.errors import ParamInvalid
from hixl.tools.daemons import MasterProcess
from hixl.tools.kv_offload import KvLayout, bad_pages, fill_page, page_ok, top_k_blocks
from hixl.tools.kv_offload_bench import KvBenchConfig, add_parser
from hixl.tools.shmem_run import JobResult, run_job

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "kv_offload.py")
GIVE_UP_S = 90.0  # only guards against a hang; never a performance bound


class Output(io.StringIO):
    """What the PEs print (run_job's `output`), safe to read while they run."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def write(self, text: str) -> int:
        with self.lock:
            return super().write(text)

    def lines(self, pe: int) -> list[str]:
        with self.lock:
            text = self.getvalue()
        prefix = f"[pe {pe}] "
        return [line[len(prefix):] for line in text.splitlines() if line.startswith(prefix)]


def example(*args: str) -> list[str]:
    return [sys.executable, EXAMPLE, *args]


@pytest.fixture(scope="module")
def master() -> Iterator[MasterProcess]:
    with MasterProcess(log_level="WARNING") as master:
        yield master


@pytest.mark.parametrize(("n_pes", "flags", "route"),
                         [(2, [], "fabric"), (2, ["--tcp"], "tcp"), (3, [], "fabric")],
                         ids=["mapped", "tcp", "pool-on-2-pes"])
def test_the_example_offloads_and_gathers_every_block_checked(n_pes: int, flags: list[str],
                                                              route: str) -> None:
    out = Output()
    steps, k, blocks, layers = 6, 5, 24, 3
    result = run_job(example("--layers", str(layers), "--blocks", str(blocks), "--block-kib",
                             "12", "--top-k", str(k), "--steps", str(steps), *flags),
                     n_pes, timeout=GIVE_UP_S, output=out)
    assert result.ok, (result, out.getvalue()[-4000:])
    inference = out.lines(0)
    assert f"(route: {route})" in inference[0], inference[0]
    assert f"bad pages per PE {dict.fromkeys(range(1, n_pes), 0)}" in "\n".join(inference)
    step_lines = [line for line in inference if line.startswith("step ")]
    assert len(step_lines) == steps
    for step, line in enumerate(step_lines):
        expected = top_k_blocks(step, blocks, k).tolist()
        assert line.startswith(f"step {step}: gathered blocks {expected} ({layers * k} pages")
        assert line.endswith(": verified"), line
    assert inference[-1] == (f"done: {steps} steps, {steps * k} blocks gathered and checked "
                             "page for page: all correct")
    held = [int(re.search(r"holding (\d+) blocks", out.lines(pe)[0]).group(1))  # type: ignore[union-attr]
            for pe in range(1, n_pes)]
    assert sum(held) == blocks and all("all pages verified" in out.lines(pe)[0]
                                       for pe in range(1, n_pes))


@pytest.mark.netns
def test_the_pool_on_another_host_over_tcp(netns: Any) -> None:
    """Each simulated host runs its share of the job with its own `hixl shmem-run`
    against one hixl-master (the multi-node launch); the pool is reached over TCP."""
    cluster = netns(3)
    hub = cluster.hosts[0]
    bootstrap = cluster.start_master(hub, 50061)
    job = f"kv-hosts-{uuid.uuid4().hex[:8]}"
    steps = 4
    launchers = [cluster.hosts[1 + pe].spawn(
        [sys.executable, "-m", "hixl.tools.cli", "shmem-run", "-n", "1", "--n-pes", "2",
         "--first-pe", str(pe), "--bootstrap", bootstrap, "--job", job, "--timeout",
         str(GIVE_UP_S), "--", *example("--layers", "3", "--blocks", "20", "--block-kib",
                                        "144", "--top-k", "4", "--steps", str(steps))],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for pe in (0, 1)]
    outputs = [proc.communicate(timeout=GIVE_UP_S * 2)[0] for proc in launchers]
    assert [proc.returncode for proc in launchers] == [0, 0], outputs
    assert "(route: tcp)" in outputs[0] and "bad pages per PE {1: 0}" in outputs[0]
    assert outputs[0].count(": verified") == steps and "all correct" in outputs[0]
    assert "[pe 1] pool: holding 20 blocks x 3 layers; all pages verified" in outputs[1]


def _launch(command: list[str], first_pe: int, master: MasterProcess, job: str,
            out: Output, results: dict[int, JobResult]) -> threading.Thread:
    """One launcher per PE (as on two nodes), so the PE that survives is not stopped by
    the other's launcher and can show how it fails."""
    def run() -> None:
        results[first_pe] = run_job(command, 1, n_pes=2, first_pe=first_pe,
                                    bootstrap=master.target, job=job, timeout=GIVE_UP_S,
                                    output=out)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("flags", [[], ["--tcp"]], ids=["mapped", "tcp"])
def test_a_pool_pe_killed_mid_run_fails_the_inference_pe_with_a_typed_error(
        master: MasterProcess, tmp_path: Any, flags: list[str]) -> None:
    # each PE records its pid (exec keeps it) so the test can kill the pool PE
    command = ["sh", "-c", 'echo $$ > "$0/pe$HIXL_SHMEM_PE.pid" && exec "$@"', str(tmp_path),
               *example("--layers", "2", "--blocks", "16", "--block-kib", "8", "--top-k", "4",
                        "--steps", "10000000", *flags)]
    out, results = Output(), {}
    job = f"kv-kill-{uuid.uuid4().hex[:8]}"
    threads = [_launch(command, pe, master, job, out, results) for pe in (0, 1)]

    def at_step_3() -> bool:
        if any(line.startswith("step 3:") for line in out.lines(0)):
            return True
        assert not results, (results, out.getvalue()[-4000:])  # nobody ended before it
        return False

    waiting.wait_until(at_step_3, "PE 0 at step 3", GIVE_UP_S,
                       detail=lambda: out.getvalue()[-4000:])
    os.kill(int((tmp_path / "pe1.pid").read_text()), signal.SIGKILL)
    for thread in threads:
        thread.join(GIVE_UP_S)
        assert not thread.is_alive(), "a launcher hung"
    # the pool PE's launcher reports its death, PE 0's launcher PE 0's failure
    assert results[1].failed_pe == 1 and results[1].exit_status == 128 + signal.SIGKILL
    assert "PE 1 failed (killed by signal 9)" in results[1].reasons[0]
    assert results[0].failed_pe == 0 and results[0].exit_status == 1, results[0]
    assert "PE 0 failed (exit status 1)" in results[0].reasons[0]
    failure = [line for line in out.lines(0) if "failed:" in line]
    assert len(failure) == 1, out.lines(0)[-5:]
    # a typed error naming the pool PE: gone from the registry, or its socket broke
    assert re.match(r"PE 0 failed: (PeerUnavailable|TransferFailed|NotConnected): .*PE 1\b",
                    failure[0]), failure[0]
    assert failure[0].endswith("(failed=[1])"), failure[0]


def test_bench_reports_every_case_and_verified_every_page() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "hixl.tools.cli", "bench", "kv-offload", "--layers", "3",
         "--page-sizes",
         "16K,4K", "--pool", "1M", "--top-k", "4", "--steps", "3", "--runs", "2", "--json", "-"],
        capture_output=True, text=True, timeout=GIVE_UP_S * 2)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    assert "hixl bench kv-offload" in proc.stderr and "verified page for page" in proc.stderr
    assert "vs raw" in proc.stderr and "offload nbi" in proc.stderr
    assert report["bench"] == "kv-offload" and "memmove loop" in report["baseline"]
    cases = report["cases"]
    assert [(c["page_bytes"], c["path"]) for c in cases] == [
        (16 << 10, "mapped"), (16 << 10, "tcp"), (4 << 10, "mapped"), (4 << 10, "tcp")]
    for case in cases:
        assert case["route"] == {"mapped": "fabric", "tcp": "tcp"}[case["path"]]
        blocks = (1 << 20) // (3 * case["page_bytes"])
        assert case["blocks"] == blocks and case["block_bytes"] == 3 * case["page_bytes"]
        # per run two offloads of new contents (per layer, then every layer in flight)
        assert case["verified"] == {"offload_pages": 2 * 2 * blocks * 3,
                                    "gather_pages": 2 * 3 * 4 * 3}
        assert case["bad"] == {"offload": [], "gather": []}
        assert case["offload"]["calls"] == 2 * 3 and case["gather"]["calls"] == 2 * 3
        assert case["offload_nbi"]["calls"] == 2
        for phase in ("offload", "offload_nbi", "gather"):
            figures = case[phase]
            # over TCP, also the raw stream between the same two PEs, in the same run
            raw = {"raw_gbps", "raw_ratio"} if case["path"] == "tcp" else set()
            assert set(figures) == {"calls", "blocks_per_s", "pages_per_s", "gbps", "p50_ms",
                                    "p99_ms", "baseline_gbps", "baseline_p50_ms",
                                    "ratio"} | raw
            if raw:
                assert figures["raw_ratio"] == pytest.approx(
                    figures["gbps"] / figures["raw_gbps"])
            assert figures["pages_per_s"] == pytest.approx(figures["blocks_per_s"] * 3)
            assert all(value > 0 for value in figures.values()), figures


def test_bench_flags_default_to_the_seed_block_and_small_blocks() -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench-kv-offload"])
    config = KvBenchConfig()
    assert (args.layers, args.page_sizes) == (61, (144 << 10, 4 << 10))
    assert args.layers * args.page_sizes[0] == 8784 << 10  # the seed's block
    assert (args.top_k, args.steps, args.runs, args.paths) == (
        config.top_k, config.steps, config.runs, ("mapped", "tcp"))
    with pytest.raises(SystemExit):
        parser.parse_args(["bench-kv-offload", "--page-sizes", "1001"])  # not a multiple of 8
    with pytest.raises(SystemExit):
        parser.parse_args(["bench-kv-offload", "--paths", "rdma"])


def test_page_checks_catch_wrong_bytes_wrong_places_and_stale_pages() -> None:
    layers, blocks, page = 3, 5, 4096
    pages = np.zeros((layers, blocks, page), np.uint8)
    for layer in range(layers):
        for block in range(blocks):
            fill_page(pages[layer, block], layer, block, generation=2)
    assert bad_pages(pages, range(blocks), 2) == []
    assert bad_pages(pages, range(blocks), 1) == [[la, b] for la in range(3) for b in range(5)]
    pages[1, 3, 4000] ^= 1  # one flipped bit
    assert bad_pages(pages, range(blocks), 2) == [[1, 3]]
    assert not page_ok(pages[0, 0], 0, 1, 2)  # block 0's page where block 1's should be
    assert not page_ok(pages[0, 0], 1, 0, 2)  # another layer's
    assert not page_ok(np.zeros(page, np.uint8), 0, 0, 0)


def test_top_k_and_layout() -> None:
    chosen = top_k_blocks(7, 100, 10)
    assert np.array_equal(chosen, top_k_blocks(7, 100, 10))  # deterministic
    assert len(set(chosen.tolist())) == 10 and not np.array_equal(chosen, top_k_blocks(8, 100, 10))
    scores = np.random.default_rng([2024, 7]).random(100)
    assert chosen.tolist() == np.argsort(-scores)[:10].tolist()  # the best first
    with pytest.raises(ParamInvalid, match="top-k"):
        top_k_blocks(0, 4, 5)
    layout = KvLayout(61, 10, 144 << 10, pool_pes=3)
    assert layout.block_bytes == 8784 << 10 and layout.slots == 4 and layout.n_pes == 4
    assert [layout.home(b) for b in (0, 1, 2, 3, 9)] == [(1, 0), (2, 0), (3, 0), (1, 1), (1, 3)]
    assert layout.heap_bytes >= layout.slots * layout.block_bytes
    with pytest.raises(ParamInvalid, match="page_bytes"):
        KvLayout(2, 2, 1001)
    with pytest.raises(ParamInvalid, match="layers"):
        KvLayout(0, 2, 1024)
