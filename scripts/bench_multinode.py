#!/usr/bin/env python3
"""`hixl bench` between two simulated hosts: the socket path across a real link.

    sudo .venv/bin/python scripts/bench_multinode.py [--json FILE|-] [hixl bench flags...]

Builds two hosts with the multi-node test harness (tests/netns.py: each host has its own
network namespace with a veth to a bridge, hostname, /tmp, /dev/shm, /run and pids), then
on host B starts a `hixl-agent`, the raw Python socket-stream server (the baseline) and,
when `mooncake.engine` imports, a Mooncake TransferEngine target; on host A it runs
`hixl bench --agent B --raw-peer B [--mooncake-peer B]`, so every figure and every ratio
compares transfers between the same two hosts in the same run. It prints the bench's
report and the veth byte counters of both hosts: proof the bytes crossed the link. Then,
when `iperf3` is installed, it measures what iperf3 reaches over the same link (C,
streaming, 1 and 3 streams, both directions) and prints, at 8784 KiB, hixl and Mooncake
as multiples of it: a reference for what the machine's TCP path gives any sender.

Flags other than --json/--keep-logs/--store/--ceiling-seconds go to `hixl bench` unchanged (e.g. --sizes
4K,1M --ops write --seconds 0.2). Across hosts only the socket path applies (the fabric path
maps memory of the same node). Needs root; exits with status 2 when hosts cannot be made.

    sudo .venv/bin/python scripts/bench_multinode.py --store [hixl bench store flags...]

`--store` measures the KV store instead (`hixl bench store`): host B runs hixl-master and
a segment holder (a store client contributing the pool's memory) and, when `mooncake.store`
imports, a `mooncake_master` and a Mooncake holder; host A runs `hixl bench store --master
B --mooncake-master B --no-holder`, whose clients hold no memory, so every value crosses
the link over TCP, for both systems.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the harness is a dev tool, kept with tests

import netns  # noqa: E402  (tests/netns.py)

from hixl.processes import DaemonProcess, ProcessNotReady  # noqa: E402
from hixl.tools import bench, cli, daemons, store_bench  # noqa: E402

RAW_PORT = 50170
STORE_MASTER_PORT = 50171  # host B's hixl-master
MOONCAKE_MASTER_PORT, MOONCAKE_METRICS_PORT = 50172, 50173  # host B's mooncake_master
MASTER_READY = "hixl-master serving "
IPERF_PORT = 50174  # host B's iperf3 server: a reference for any TCP sender on the link
IPERF_SECONDS = 2  # per direction and stream count (--ceiling-seconds)
IPERF_STREAMS = (1, 3)  # one stream, and as many as hixl stripes a large batch over
RUN_TIMEOUT_S = 3600.0


def _start(host: Any, argv: list[str], ready: str, what: str,
           env: dict[str, str] | None = None) -> str:
    """Start `argv` on `host` and return its first line starting with `ready`, within the
    start timeout (its output stays drained afterwards, so it never blocks on the pipe;
    the cluster kills it at teardown). HarnessError naming `what` with its output if not."""
    process = DaemonProcess(argv, name=what, ready=ready, env=env, stop_by="stdin",
                            spawn=host.spawn)
    try:
        return process.wait_ready(netns.START_TIMEOUT_S)
    except ProcessNotReady as exc:
        raise netns.HarnessError(str(exc)) from None


def _mooncake_wanted(config: bench.BenchConfig) -> str | None:
    """Why Mooncake is left out, or None to start a target on host B."""
    if config.mooncake == "off":
        return "off"
    from hixl.tools import mooncake_baseline

    return mooncake_baseline.unavailable_reason()


def _moved(report: dict[str, Any]) -> dict[str, int]:
    """Bytes hixl's cells moved A->B (write, put) and B->A (read, get); timed calls only,
    so a lower bound of what crossed the link."""
    moved = {"write": 0, "read": 0}
    for cell in report["cells"]:
        if report.get("kind") == "store":
            if cell["system"] == "hixl":
                way = "write" if cell["op"] in store_bench.PUT_OPS else "read"
                moved[way] += cell["calls"] * cell["size"] * cell["batch"]
        elif cell["kind"] == "engine":
            moved[cell["op"]] += cell["calls"] * cell["block"] * cell["batch"]
    return moved


def _counted(hosts: tuple[Any, ...]) -> dict[Any, tuple[int, int]]:
    return {h: (h.tx_bytes(), h.rx_bytes()) for h in hosts}


def _links(a: Any, b: Any, before: dict[Any, tuple[int, int]],
           after: dict[Any, tuple[int, int]]) -> dict[str, dict[str, Any]]:
    return {role: {"host": h.name, "ip": h.ip, "tx_bytes": after[h][0] - before[h][0],
                   "rx_bytes": after[h][1] - before[h][1]}
            for role, h in (("a", a), ("b", b))}


def run(bench_args: list[str], keep_logs: bool, ceiling_seconds: int = IPERF_SECONDS
        ) -> dict[str, Any]:
    """Two hosts, the servers on B, the bench on A; returns the bench report plus counters."""
    args = cli.build_parser().parse_args(["bench", *bench_args])
    if args.agent or args.raw_peer or args.mooncake_peer or args.local:
        raise SystemExit("bench_multinode: --agent/--raw-peer/--mooncake-peer/--local are "
                         "set by this script")
    config = cli.bench_config(args)
    call_bytes = config.largest_call()
    if keep_logs:
        os.environ["HIXL_NETNS_KEEP_LOGS"] = "1"
    with netns.Cluster(2) as cluster:
        a, b = cluster.hosts
        agent = cluster.start_agent(b, {"pool_max_bytes": 2 * call_bytes + (64 << 20),
                                        "log_level": "WARNING"})
        _start(b, [sys.executable, "-m", "hixl.tools.bench", "--raw-server",
                   "--tcp", f"{b.ip}:{RAW_PORT}", "--buffer", str(call_bytes)],
               bench.RAW_READY, f"raw stream server on {b}")
        extra = ["--agent", agent.engine, "--raw-peer", f"{b.ip}:{RAW_PORT}", "--local", a.ip]
        why_not = _mooncake_wanted(config)
        if why_not is None:
            from hixl.tools import mooncake_baseline as mc

            segment = mc.parse_ready(_start(b, mc.target_command(b.ip, call_bytes), mc.READY,
                                            f"Mooncake target on {b}",
                                            env={"MC_LOG_LEVEL": "ERROR"}))[0]
            extra += ["--mooncake-peer", segment]
        before = _counted((a, b))
        result = a.run([sys.executable, "-m", "hixl.tools.cli", "bench", *bench_args, *extra,
                        "--json", "-", "--no-progress"], timeout=RUN_TIMEOUT_S,
                       env={"MC_LOG_LEVEL": "ERROR"})
        after = _counted((a, b))
        missed_targets = result.returncode == cli.EXIT_FAILED and args.check_targets
        if result.returncode != 0 and not (missed_targets and result.stdout.strip()):
            sys.stderr.write(result.stderr[-8000:])
            raise SystemExit(f"bench_multinode: hixl bench on {a} failed "
                             f"(status {result.returncode})")
        report = json.loads(result.stdout)
        if why_not is not None and why_not != "off":
            report["mooncake"]["reason"] = why_not
        links = _links(a, b, before, after)
        ceiling = link_ceiling(a, b, ceiling_seconds)
    return {"bench": report, "links": links, "moved": _moved(report), "ceiling": ceiling}


def run_store(bench_args: list[str], keep_logs: bool) -> dict[str, Any]:
    """`hixl bench store` across the link: masters and segment holders on B, the bench on A."""
    args = cli.build_parser().parse_args(["bench-store", *bench_args])
    if args.master or args.mooncake_master or args.local or not args.holders:
        raise SystemExit("bench_multinode --store: --master/--mooncake-master/--local/"
                         "--no-holder are set by this script")
    config = cli.store_bench_config(args)
    segment = config.segment_bytes()
    if keep_logs:
        os.environ["HIXL_NETNS_KEEP_LOGS"] = "1"
    quiet = {"MC_LOG_LEVEL": "ERROR"}
    with netns.Cluster(2) as cluster:
        a, b = cluster.hosts
        _start(b, [sys.executable, "-m", "hixl.server.master.master", "--host", b.ip,
                   "--port", str(STORE_MASTER_PORT), "--no-persist", "--log-level",
                   "WARNING", f"-default_kv_lease_ttl={store_bench.LEASE_TTL_MS}"],
               MASTER_READY, f"hixl-master on {b}")
        master_at = f"{b.ip}:{STORE_MASTER_PORT}"
        _start(b, daemons.holder_command("hixl", master_at, b.ip, segment),
               daemons.HOLDER_READY, f"hixl segment holder on {b}")
        extra = ["--master", master_at, "--local", a.ip, "--no-holder"]
        why_not = None if config.mooncake else "off"
        why_not = why_not or store_bench.mooncake_store_unavailable()
        binary = store_bench.mooncake_master_binary()
        if why_not is None and binary is None:
            why_not = "no mooncake_master executable"
        if why_not is None:
            assert binary is not None
            b.spawn(store_bench.mooncake_master_command(binary, b.ip, MOONCAKE_MASTER_PORT,
                                                        MOONCAKE_METRICS_PORT),
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL)
            probe = (f"import sys; from hixl.tools.store_bench import wait_port; "
                     f"sys.exit(0 if wait_port({b.ip!r}, {MOONCAKE_MASTER_PORT}, "
                     f"{netns.START_TIMEOUT_S}) else 1)")
            if b.run([sys.executable, "-c", probe], timeout=netns.START_TIMEOUT_S + 30
                     ).returncode != 0:
                raise netns.HarnessError(f"mooncake_master on {b} did not start")
            mooncake_at = f"{b.ip}:{MOONCAKE_MASTER_PORT}"
            _start(b, daemons.holder_command("mooncake", mooncake_at, b.ip, segment),
                   daemons.HOLDER_READY, f"Mooncake segment holder on {b}", env=quiet)
            extra += ["--mooncake-master", mooncake_at]
        elif why_not == "off":
            extra.append("--no-mooncake")
        before = _counted((a, b))
        result = a.run([sys.executable, "-m", "hixl.tools.cli", "bench", "store", *bench_args,
                        *extra, "--json", "-", "--no-progress"], timeout=RUN_TIMEOUT_S,
                       env=quiet)
        after = _counted((a, b))
        missed_targets = result.returncode == cli.EXIT_FAILED and args.check_targets
        if result.returncode != 0 and not (missed_targets and result.stdout.strip()):
            sys.stderr.write(result.stderr[-8000:])
            raise SystemExit(f"bench_multinode: hixl bench store on {a} failed "
                             f"(status {result.returncode})")
        report = json.loads(result.stdout)
        if why_not is not None and why_not != "off":
            report["mooncake"]["reason"] = why_not
        links = _links(a, b, before, after)
    return {"bench": report, "links": links, "moved": _moved(report)}


def link_ceiling(a: Any, b: Any, seconds: int = IPERF_SECONDS) -> dict[str, Any]:
    """iperf3 (C, streaming with no request/reply) A->B and B->A over the same link.

    The best of one TCP stream and of 3 in parallel (as many as hixl stripes a large batch
    over): what a well-known C sender reaches between these two hosts on this machine, a
    reference for hixl's socket path and Mooncake's tcp engine alike (all of them copy
    through the kernel on each side). It is not a hard ceiling: hixl's striped, pipelined
    transfers have beaten it on this 2-core VM. Measured after the bench so it never
    competes with it.
    """
    if seconds <= 0:
        return {"measured": False, "reason": "off (--ceiling-seconds 0)"}
    if shutil.which("iperf3") is None:
        return {"measured": False, "reason": "iperf3 not installed (apt install iperf3)"}
    server = b.spawn(["iperf3", "--server", "--bind", b.ip, "--port", str(IPERF_PORT)],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)
    ceiling: dict[str, Any] = {"measured": True, "tool": "iperf3", "seconds": seconds,
                               "streams": {}}
    try:
        for (way, flags), streams in itertools.product(
                (("write", []), ("read", ["--reverse"])), IPERF_STREAMS):
            for _ in range(50):  # the server needs a moment to listen, and to reset
                result = a.run(["iperf3", "--client", b.ip, "--port", str(IPERF_PORT),
                                "--time", str(seconds), "--parallel", str(streams),
                                "--json", *flags], timeout=seconds + 30)
                try:
                    report = json.loads(result.stdout)
                except ValueError:
                    report = {"error": (result.stdout + result.stderr)[-300:]}
                if "error" not in report:
                    break
                time.sleep(0.1)
            if "error" in report:
                return {"measured": False, "reason": f"iperf3 failed: {report['error']}"}
            gbps = report["end"]["sum_received"]["bits_per_second"] / 8 / 1e9
            ceiling["streams"][f"{way} x{streams}"] = gbps
            ceiling[way] = max(ceiling.get(way, 0.0), gbps)
    finally:
        server.kill()
    return ceiling


def format_ceiling(result: dict[str, Any]) -> str:
    """iperf3's figures and, at each 8784 KiB socket cell, hixl and Mooncake against them."""
    ceiling = result.get("ceiling")
    if not ceiling:
        return ""
    if not ceiling["measured"]:
        return f"\nlink reference (iperf3): not measured: {ceiling['reason']}"
    each = ", ".join(f"{name} streams {gbps:.2f}" for name, gbps in ceiling["streams"].items())
    lines = ["", f"link reference (iperf3, best of {each} GB/s): A->B {ceiling['write']:.2f} "
                 f"GB/s, B->A {ceiling['read']:.2f} GB/s"]
    for cell in result["bench"]["cells"]:
        if (cell["kind"] == "engine" and cell["mode"] == "sync"
                and cell["block"] == bench.HIXL_BLOCK):
            limit = ceiling[cell["op"]]
            text = (f"  {cell['op']} {bench.human_size(cell['block'])} x{cell['batch']}: "
                    f"hixl {cell['gbps']:.2f} GB/s = {cell['gbps'] / limit:.2f}x iperf3")
            if cell.get("mooncake_gbps"):
                text += (f"; Mooncake {cell['mooncake_gbps']:.2f} GB/s = "
                         f"{cell['mooncake_gbps'] / limit:.2f}x iperf3")
            lines.append(text)
    return "\n".join(lines)


def format_links(result: dict[str, Any]) -> str:
    links, moved = result["links"], result["moved"]
    lines = ["", "link counters during the bench (veth eth0 of each host)"]
    for role in ("a", "b"):
        link = links[role]
        lines.append(f"  host {role.upper()} {link['host']} ({link['ip']}): "
                     f"tx {link['tx_bytes'] / 1e9:.3f} GB, rx {link['rx_bytes'] / 1e9:.3f} GB")
    lines.append(f"  hixl cells moved (timed calls): write/put {moved['write'] / 1e9:.3f} GB "
                 f"A->B, read/get {moved['read'] / 1e9:.3f} GB B->A")
    crossed = (links["a"]["tx_bytes"] >= moved["write"] and links["b"]["rx_bytes"] >= moved["write"]
               and links["b"]["tx_bytes"] >= moved["read"] and links["a"]["rx_bytes"] >= moved["read"])
    lines.append("  the bytes crossed the link" if crossed
                 else "  WARNING: the link carried fewer bytes than the hixl cells moved")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="hixl bench between two simulated hosts (network namespaces)",
        epilog="Any other flag goes to `hixl bench` (see `hixl bench --help`).")
    parser.add_argument("--json", metavar="FILE",
                        help="also write the numbers as JSON to FILE ('-' = stdout; the tables "
                             "then go to stderr)")
    parser.add_argument("--keep-logs", action="store_true",
                        help="keep the agents' logs under the harness's run directory")
    parser.add_argument("--ceiling-seconds", type=int, default=IPERF_SECONDS, metavar="S",
                        help="after the bench, measure what iperf3 reaches over the link for "
                             f"S seconds per direction and stream count (default {IPERF_SECONDS};"
                             " 0 = skip; ignored with --store)")
    parser.add_argument("--store", action="store_true",
                        help="run `hixl bench store` (the KV store against Mooncake Store) "
                             "instead of `hixl bench`; other flags go to it")
    ours, bench_args = parser.parse_known_args(argv)
    reason = netns.unavailable_reason()
    if reason is not None:
        print(f"bench_multinode: simulated hosts unavailable: {reason}", file=sys.stderr)
        return 2
    result = (run_store(bench_args, ours.keep_logs) if ours.store
              else run(bench_args, ours.keep_logs, ours.ceiling_seconds))
    report = result["bench"]
    table = store_bench.format_store_report(report) if ours.store else bench.format_report(report)
    text = table + "\n" + format_links(result) + format_ceiling(result)
    cli.emit_report(text, result, ours.json)
    if "--check-targets" in bench_args and not all(t["met"] for t in report["targets"]):
        return cli.EXIT_FAILED
    return 0


if __name__ == "__main__":
    sys.exit(main())
