"""scripts/bench_multinode.py end to end: `hixl bench` between two simulated hosts.

Tiny sizes and short cells; nothing here looks at how fast anything is. It checks that
the run crossed the link (veth counters), measured only the socket path over TCP against
a raw stream served on the agent's host, verified every cell, and -- when the optional
Mooncake extra is installed -- measured Mooncake between the same hosts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import netns
import pytest

from hixl.tools import bench

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300)]

SCRIPT = os.path.join(netns.REPO, "scripts", "bench_multinode.py")
SIZES = (4096, 65536)
BATCHES = (1, 2)


def test_bench_between_two_hosts_reports_every_cell_and_crosses_the_link() -> None:
    netns.require()
    from hixl.tools import mooncake_baseline

    with_mooncake = mooncake_baseline.unavailable_reason() is None
    proc = subprocess.run(
        [sys.executable, SCRIPT, "--json", "-", "--sizes", "4K,64K", "--batch", "1,2",
         "--modes", "sync", "--seconds", "0.05", "--warmup", "1", "--hixl-block", "64K",
         "--hixl-transfers", "3", "--ceiling-seconds", "1"],
        capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads(proc.stdout)
    report, links, moved = result["bench"], result["links"], result["moved"]
    b_ip = links["b"]["ip"]
    assert report["across_nodes"] is True and report["local"] == links["a"]["ip"]
    assert report["agent"].startswith(b_ip + ":") and report["raw_peer"].startswith(b_ip + ":")
    assert report["paths"] == {"socket": {"route": "tcp"}}  # no fabric across hosts
    assert report["socket_baseline"] == "raw-tcp" and report["verified"] is True
    engine = {(c["op"], c["block"], c["batch"]): c for c in report["cells"]
              if c["kind"] == "engine"}
    assert set(engine) == {(op, s, b) for op in bench.OPS for s in SIZES for b in BATCHES}
    for cell in engine.values():
        assert cell["path"] == "socket" and cell["verified"] is True
        assert cell["baseline"] == "raw-tcp" and cell["ratio"] > 0 and cell["p50_us"] > 0
        assert ("vs_mooncake" in cell) == with_mooncake
    names = {c["name"] for c in report["cells"] if c["kind"] == "baseline"}
    assert names == ({"raw-tcp", "mooncake"} if with_mooncake else {"raw-tcp"})
    assert report["mooncake"]["measured"] is with_mooncake
    if with_mooncake:
        assert report["mooncake"]["segment"].startswith(b_ip + ":")
    else:
        assert report["mooncake"]["reason"]
    assert {(h["path"], h["op"]) for h in report["hixl_style"]} == {
        ("socket", op) for op in bench.OPS}
    # the bytes crossed the veth: A sent at least what it wrote, B at least what A read
    assert moved["write"] > 0 and moved["read"] > 0
    assert links["a"]["tx_bytes"] >= moved["write"] <= links["b"]["rx_bytes"]
    assert links["b"]["tx_bytes"] >= moved["read"] <= links["a"]["rx_bytes"]
    assert "the bytes crossed the link" in proc.stderr
    # what iperf3 (installed by .ci/run) reaches over the same link, after the bench
    ceiling = result["ceiling"]
    if shutil.which("iperf3") is None and os.environ.get("CI") != "true":
        assert ceiling == {"measured": False, "reason": "iperf3 not installed (apt install iperf3)"}
    else:
        assert ceiling["measured"] is True, ceiling
        assert set(ceiling["streams"]) == {"write x1", "write x3", "read x1", "read x3"}
        assert all(gbps > 0 for gbps in ceiling["streams"].values())
        for way in ("write", "read"):
            assert ceiling[way] == max(ceiling["streams"][f"{way} x1"],
                                       ceiling["streams"][f"{way} x3"])
        assert "link reference (iperf3" in proc.stderr
