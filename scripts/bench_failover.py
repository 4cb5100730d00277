#!/usr/bin/env python3
"""Fail-over time of several hixl-masters on one etcd (issue 8): kill the leader, K times.

    .venv/bin/python scripts/bench_failover.py [--masters 3] [--kills 10] [--lease-ttl 5]
                                               [--remount-delay S] [--json FILE|-]

Starts a 3-member etcd cluster on loopback (the test harness, tests/etcd_cluster.py),
N hixl-masters on one prefix (the first leads), a segment holder process (a store client
contributing a 256 MiB segment; with --remount-delay, one that remounts that late) and,
in this process, a Mooncake store client given every master address whose thread puts
values back to back, recording each put's outcome. Then, K times: SIGKILL the leader
mid-load, and measure

- `elected`: from the kill to etcd naming a new leader (an election observer here), and
- `first put`: from the kill to the end of the first put that started after the kill and
  succeeded (the new leader loaded the store, the client found it, the holder remounted);

restart the killed master on its port (as its supervisor would: it rejoins as a standby)
and go on. Each switch's failed puts (with their codes) are those that ended after its
kill and before the next one, split into puts *in flight* at the kill (started
before the killed process was gone: their request may have reached the dying leader, so
the client does not repeat it: RPC_FAIL) and puts *started after* it (the new leader holds those until the holder remounts its
segment, docs/store.md §6: none should fail). At the
end every put that returned 0 is read back byte for byte: `lost` must be 0. Prints a
table of every kill and p50/p99/max (format_table / emit_report of `hixl bench`), and the
JSON report with `--json`. Root is not needed.

What bounds the figures: a SIGKILLed leader's candidacy ends when etcd expires its
election lease, `--lease-ttl` seconds after its last keepalive (so `elected` is at most
about the TTL, plus etcd's lease-expiry check, ~0.5 s); the winner then takes over the
writer claim at once and loads the store from etcd (a few ms for a small store), and
clients are back within their retry pauses (at most 0.5 s) once it serves.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))  # the harness is a dev tool, kept with tests

from etcd_cluster import EtcdCluster, etcd_missing  # noqa: E402  (tests/etcd_cluster.py)

from hixl.client.mooncake import MooncakeDistributedStore  # noqa: E402
from hixl.client.store_client import MasterClient  # noqa: E402
from hixl.etcd import EtcdClient, Leader  # noqa: E402
from hixl.processes import DaemonProcess, ProcessNotReady  # noqa: E402
from hixl.server.master.leadership import ELECTION_NAME  # noqa: E402
from hixl.store_codes import ErrorCode  # noqa: E402
from hixl.tools.bench import format_table  # noqa: E402
from hixl.tools.cli import emit_report  # noqa: E402
from hixl.tools.daemons import HolderProcess, MasterProcess  # noqa: E402

MiB = 1 << 20
WAIT_S = 60.0        # the most one switch may take before the bench gives up
#: the holder's segment: room for every value the load writes, so nothing is evicted
#: (an eviction drops keys by design and would read as a loss)
HOLDER_BYTES = 256 * MiB
EVICTION_WATERMARK = 0.95   # hixl-master's default --eviction_high_watermark_ratio


#: a segment holder (a hixl store client contributing a segment) whose every remount
#: after its first mount starts `delay` s late: a slow holder (a loaded host)
DELAYED_HOLDER = r"""
import sys, time
from hixl.client.mooncake import MooncakeDistributedStore

targets, size, delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
store = MooncakeDistributedStore(setup_timeout=60)
if store.setup("127.0.0.1", "P2PHANDSHAKE", size, 16 << 20, "tcp", "", targets):
    print("setup failed:", store.last_error, flush=True)
    sys.exit(1)
mount = store._master.mount_segment

def late(*args, **kwargs):
    time.sleep(delay)
    return mount(*args, **kwargs)

store._master.mount_segment = late
print("DELAYED-HOLDER-READY", flush=True)
sys.stdin.read()
store.close()
"""


class DelayedHolder:
    """The holder of `--remount-delay`; stop() closes its stdin (it unmounts and exits)."""

    def __init__(self, targets: str, size: int, delay: float) -> None:
        self.process = DaemonProcess(
            [sys.executable, "-c", DELAYED_HOLDER, targets, str(size), str(delay)],
            name="the holder", ready=re.compile("DELAYED-HOLDER-READY"),
            env={**os.environ, "PYTHONUNBUFFERED": "1"}, stop_by="stdin", grace_s=WAIT_S)
        try:
            self.process.wait_ready(2 * WAIT_S)  # its setup alone may take WAIT_S
        except ProcessNotReady as exc:
            raise SystemExit(f"bench_failover: {exc}") from None

    def stop(self) -> None:
        self.process.stop()


@dataclass
class Put:
    key: str
    size: int
    started: float
    ended: float
    code: int


def value(index: int, size: int) -> bytes:
    """A value that says which put wrote it (checked byte for byte at the end)."""
    stamp = f"{index:>12}".encode()
    return (stamp * (size // len(stamp) + 1))[:size]


class Load:
    """Puts back to back on a thread; every outcome recorded."""

    def __init__(self, store: MooncakeDistributedStore, size: int) -> None:
        self.store = store
        self.size = size
        self.puts: list[Put] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="put-load")

    def _run(self) -> None:
        index = 0
        while not self._stop.is_set():
            key = f"failover-{index}"
            started = time.monotonic()
            code = self.store.put(key, value(index, self.size))
            self.puts.append(Put(key, self.size, started, time.monotonic(), code))
            index += 1

    def first_success_after(self, moment: float) -> Put | None:
        return next((p for p in list(self.puts) if p.started >= moment and p.code == 0), None)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(WAIT_S)


class Elections:
    """When etcd named each leader, as an observer here sees it (monotonic time)."""

    def __init__(self, client: EtcdClient) -> None:
        self.changes: list[tuple[float, str]] = []
        self._watch = client.election(ELECTION_NAME).observe(self._changed)

    def _changed(self, leader: Leader | None) -> None:
        self.changes.append((time.monotonic(), leader.value.decode() if leader else ""))

    def first_after(self, moment: float, other_than: str) -> float | None:
        return next((t for t, name in list(self.changes)
                     if t >= moment and name and name != other_than), None)

    def current(self) -> str:
        return self.changes[-1][1] if self.changes else ""

    def close(self) -> None:
        self._watch.cancel()


def wait_for(predicate: Any, what: str) -> Any:
    deadline = time.monotonic() + WAIT_S
    while (result := predicate()) is None:
        if time.monotonic() > deadline:
            raise SystemExit(f"bench_failover: timed out waiting for {what}")
        time.sleep(0.01)
    return result


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (nearest rank): p99 of 10 kills is their max."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), int(-(-q * len(ordered) // 100))))
    return ordered[rank - 1]


def run(args: argparse.Namespace) -> dict[str, Any]:
    prefix = f"/hixl/bench-failover-{uuid.uuid4().hex[:8]}/"
    with EtcdCluster(3) as cluster:
        flags = ["--etcd-endpoints", ",".join(cluster.endpoints), "--etcd-prefix", prefix,
                 "--etcd-lease-ttl", str(args.lease_ttl)]
        etcd = EtcdClient({"endpoints": cluster.endpoints, "prefix": prefix})
        masters = [MasterProcess(extra=flags) for _ in range(args.masters)]
        targets = ",".join(m.target for m in masters)
        elections = Elections(etcd)
        holder = (DelayedHolder(targets, HOLDER_BYTES, args.remount_delay)
                  if args.remount_delay > 0
                  else HolderProcess("hixl", targets, "127.0.0.1", HOLDER_BYTES))
        store = MooncakeDistributedStore(setup_timeout=WAIT_S)
        load: Load | None = None
        kills: list[dict[str, Any]] = []
        try:
            if store.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 * MiB, "tcp", "", targets):
                raise SystemExit(f"bench_failover: store setup failed: {store.last_error}")
            load = Load(store, args.value_size)
            load.start()
            wait_for(lambda: load.first_success_after(0.0), "the first put")
            for number in range(1, args.kills + 1):
                time.sleep(args.settle)
                old = wait_for(lambda: elections.current() or None, "a leader")
                victim = next(m for m in masters if m.target == old)
                killed_at = time.monotonic()
                victim.kill()  # returns once the process is gone
                dead_at = time.monotonic()  # no request reaches it from now on
                elected = wait_for(lambda o=old, t=killed_at: elections.first_after(t, o),
                                   "a new leader")
                first = wait_for(lambda t=killed_at: load.first_success_after(t),
                                 "a put at the new leader")
                kills.append({"kill": number, "old_leader": old,
                              "new_leader": elections.current(), "killed_at": killed_at,
                              "dead_at": dead_at,
                              "elected_s": round(elected - killed_at, 4),
                              "first_put_s": round(first.ended - killed_at, 4)})
                print(f"kill {number}: elected after {elected - killed_at:.3f} s, first put "
                      f"after {first.ended - killed_at:.3f} s", file=sys.stderr, flush=True)
                masters[masters.index(victim)] = MasterProcess(victim.port, extra=flags)
                victim.close()
            time.sleep(args.settle)  # the last switch's window: puts after it count too
        finally:
            if load is not None:
                load.stop()
        try:
            assert load is not None
            count_failures(kills, load.puts)
            ok = [p for p in load.puts if p.code == 0]
            # usage only grows (nothing is removed): under the eviction watermark at the
            # end means no eviction ever ran (stats counters die with each killed leader)
            with MasterClient(targets, timeout=WAIT_S) as master:
                usage = float(master.stats()["usage"])
            lost = [p.key for p, index in ((p, int(p.key.rsplit("-", 1)[1])) for p in ok)
                    if store.get(p.key) != value(index, p.size)]
            report = summarize(args, kills, len(load.puts), len(ok), lost)
            report["pool_usage"] = round(usage, 4)
            report["may_have_evicted"] = usage >= EVICTION_WATERMARK
        finally:
            store.close()
            holder.stop()
            elections.close()
            etcd.close()
            for master in masters:
                master.close()
    return report


def count_failures(kills: list[dict[str, Any]], puts: list[Put]) -> None:
    """Each kill's failed puts: those that ended after it and before the next kill (or
    the end), split into those in flight when it came (started before it: a
    request that may have reached the dying leader is not repeated, RPC_FAIL) and those
    started after it (what a switch should never fail)."""
    for kill, following in zip(kills, [*kills[1:], None], strict=True):
        start, dead = kill.pop("killed_at"), kill.pop("dead_at")
        end = following["killed_at"] if following is not None else float("inf")
        failed = [p for p in puts if p.code != 0 and start <= p.ended < end]
        codes: dict[str, int] = {}
        for put in failed:
            name = ErrorCode(put.code).name if put.code in ErrorCode._value2member_map_ \
                else str(put.code)
            codes[name] = codes.get(name, 0) + 1
        in_flight = sum(1 for p in failed if p.started < dead)
        kill.update({"failed_puts": len(failed), "failed_in_flight": in_flight,
                     "failed_after_kill": len(failed) - in_flight, "failed_codes": codes})


def summarize(args: argparse.Namespace, kills: list[dict[str, Any]], puts: int,
              succeeded: int, lost: list[str]) -> dict[str, Any]:
    summary = {}
    for name in ("elected_s", "first_put_s", "failed_puts", "failed_in_flight",
                 "failed_after_kill"):
        values = [float(k[name]) for k in kills]
        summary[name] = {"p50": statistics.median(values), "p99": percentile(values, 99),
                         "max": max(values)}
    return {"masters": args.masters, "kills": args.kills, "lease_ttl_s": args.lease_ttl,
            "remount_delay_s": args.remount_delay,
            "value_bytes": args.value_size, "puts": puts, "puts_succeeded": succeeded,
            "lost_keys": len(lost), "lost": lost[:20], "per_kill": kills, "summary": summary,
            "settings": {k: v for k, v in vars(args).items() if k != "json"}}


def format_report(report: dict[str, Any]) -> str:
    rows = [[str(k["kill"]), k["old_leader"], k["new_leader"], f"{k['elected_s']:.3f}",
             f"{k['first_put_s']:.3f}", str(k["failed_puts"]), str(k["failed_in_flight"]),
             str(k["failed_after_kill"]),
             " ".join(f"{c}:{n}" for c, n in k["failed_codes"].items()) or "-"]
            for k in report["per_kill"]]
    table = format_table(["kill", "old leader", "new leader", "elected s", "first put s",
                          "failed puts", "in flight", "after kill", "codes"], rows,
                         left=(0, 1, 2, 8))
    summary = report["summary"]
    lines = [f"hixl-master fail-over: {report['masters']} masters, election lease "
             f"{report['lease_ttl_s']} s, {report['kills']} kills of the leader (SIGKILL) "
             f"under a put load of {report['value_bytes']} B values"
             + (f", each remount {report['remount_delay_s']:g} s late"
                if report["remount_delay_s"] else ""), "", table, ""]
    stats = [[name, *(f"{summary[key][q]:.3f}" for q in ("p50", "p99", "max"))]
             for name, key in (("kill -> new leader elected (s)", "elected_s"),
                               ("kill -> first successful put (s)", "first_put_s"),
                               ("failed puts per switch", "failed_puts"),
                               ("... in flight at the kill", "failed_in_flight"),
                               ("... started after the kill", "failed_after_kill"))]
    lines += [format_table(["", "p50", "p99", "max"], stats, left=(0,)), "",
              f"puts: {report['puts']} ({report['puts_succeeded']} succeeded); keys lost "
              f"(reported stored, then missing or different): {report['lost_keys']}; "
              f"pool usage at the end: {100 * report['pool_usage']:.1f} % (no eviction "
              f"below {100 * EVICTION_WATERMARK:.0f} %)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench_failover.py", description=__doc__.split(
        "\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--masters", type=int, default=3, help="hixl-masters (default 3)")
    parser.add_argument("--kills", type=int, default=10, help="leader kills (default 10)")
    parser.add_argument("--lease-ttl", type=int, default=5,
                        help="the masters' --etcd-lease-ttl in s (default 5, the master's)")
    parser.add_argument("--value-size", type=int, default=4096,
                        help="bytes per put (default 4096; the pool is 256 MiB and must "
                             "hold every value put: nothing may be evicted)")
    parser.add_argument("--settle", type=float, default=1.0,
                        help="seconds of load between a switch and the next kill (default 1)")
    parser.add_argument("--remount-delay", type=float, default=0.0, metavar="S",
                        help="the segment holder starts each remount after a switch S s "
                             "late (a slow holder: the new leader has no room until then; "
                             "default 0)")
    parser.add_argument("--json", metavar="FILE|-", help="also write the JSON report")
    args = parser.parse_args(argv)
    if args.masters < 2 or args.kills < 1:
        parser.error("need --masters >= 2 and --kills >= 1")
    missing = etcd_missing()
    if missing:
        print(f"bench_failover: {missing}", file=sys.stderr)
        return 2
    with contextlib.suppress(KeyError):
        os.environ.pop("HIXL_CLUSTER_TOKEN")
    report = run(args)
    emit_report(format_report(report), report, args.json)
    if report["may_have_evicted"]:
        print("bench_failover: the pool filled up to the eviction watermark, so lost keys "
              "cannot be told from evicted ones: lower --value-size or --kills",
              file=sys.stderr)
        return 2
    return 1 if report["lost_keys"] else 0


if __name__ == "__main__":
    sys.exit(main())
