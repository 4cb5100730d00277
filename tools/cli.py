"""`hixl`: the user's command line. Subcommands: `bench`, `bench-registry`, `bench-store`
(also spelled `hixl bench store`), `bench-kv-offload` and `bench-moe` (`hixl bench
kv-offload` / `hixl bench moe`: the hixl.shmem scenarios, in hixl.tools.kv_offload_bench
and hixl.tools.moe_bench), the operator queries `status`, `segments`, `keys`
(hixl.tools.admin), `soak` (hixl.tools.soak: random calls under random kills) and
`shmem-run` (hixl.tools.shmem_run: one process per PE of a hixl.shmem job).

Each subcommand is one `add_<name>(subparsers)` function that declares its flags and sets
`handler`; `main()` parses and dispatches, turning expected failures into an error line
and a non-zero exit status instead of a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from hixl.errors import ConfigError, HixlError
from hixl.tools import bench

if TYPE_CHECKING:
    from hixl.tls import TlsSetting

EXIT_FAILED = 1  # the command ran and failed (wrong bytes, missed targets with --check-targets)
EXIT_USAGE = 2  # argparse's own status for bad flags


def _size_list(text: str) -> tuple[int, ...]:
    from hixl.sizes import parse_size_list

    try:
        return parse_size_list(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(exc.args[0]) from None


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,8,256, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"batch sizes must be positive integers, got {text!r}")
    return values


def _choices(allowed: Sequence[str]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        values = tuple(part.strip().lower() for part in text.split(",") if part.strip())
        unknown = [v for v in values if v not in allowed]
        if unknown or not values:
            raise argparse.ArgumentTypeError(
                f"{text!r}: choose from {', '.join(allowed)} (comma-separated)")
        return values
    return parse


def _number(kind: type[int] | type[float], *, zero: bool = False) -> Callable[[str], float]:
    """An argparse type: a positive int or float (`zero`: or 0), refused by name otherwise."""
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
        if not (value >= 0 if zero else value > 0):  # also refuses nan
            raise argparse.ArgumentTypeError(
                f"must {'not be negative' if zero else 'be positive'}, got {text!r}")
        return value
    return parse


def add_json_flag(p: argparse.ArgumentParser) -> None:
    """--json FILE, for every command that prints a report (written by emit_report)."""
    p.add_argument("--json", metavar="FILE",
                   help="also write every number as JSON to FILE ('-' = stdout; the table "
                        "then goes to stderr)")


_positive_float = _number(float)
_positive_int = _number(int)
_non_negative_int = _number(int, zero=True)
_non_negative_float = _number(float, zero=True)


def _one_size(text: str) -> int:
    return _size_list(text)[0]


def _host_port(text: str) -> str:
    try:
        bench.split_host_port(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


# ---------------------------------------------------------------- bench


def add_bench(subparsers: Any) -> None:
    defaults = bench.BenchConfig()
    p = subparsers.add_parser(
        "bench", help="measure PUT/GET throughput and latency against same-run baselines",
        description="Measure the engine on the fabric and socket paths, with memcpy and raw "
                    "socket-stream baselines from the same run, and print GB/s, ops/s, "
                    "p50/p99 latency per call and the ratio to the baseline. Every cell's "
                    "bytes are verified; wrong bytes abort the run.")
    p.add_argument("--agent", metavar="HOST:PORT",
                   help="use this running agent, possibly on another node (default: start a "
                        "private hixl-agent here)")
    p.add_argument("--raw-peer", metavar="HOST:PORT", type=_host_port,
                   help="raw stream baseline server to compare with, on the agent's node "
                        "(`python -m hixl.tools.bench --raw-server --tcp HOST:PORT --buffer "
                        "BYTES --forever`); required when the agent is on another node "
                        "(default: start one here)")
    p.add_argument("--local", metavar="IP",
                   help="this side's IP for the engines (default: the one routing to the agent)")
    p.add_argument("--local-memory", choices=bench.LOCAL_MEMORIES, default=defaults.local_memory,
                   help="where the HIXL-style run's local side lives: host (the default), or "
                        "cuda (a CUDA tensor, D2rH / rH2D; needs torch with CUDA)")
    p.add_argument("--mooncake", choices=("auto", "on", "off"), default=defaults.mooncake,
                   help="measure Mooncake's TransferEngine (tcp) side by side: auto = when "
                        "mooncake.engine imports (default), on = required, off = never")
    p.add_argument("--mooncake-peer", metavar="IP:RPC_PORT", type=_host_port,
                   help="segment of a Mooncake target on the agent's node (`python -m "
                        "hixl.tools.mooncake_baseline --host IP --buffer BYTES`); default: "
                        "start one here (same node only)")
    p.add_argument("--paths", type=_choices(bench.PATHS), default=defaults.paths,
                   help="fabric,socket (default both)")
    p.add_argument("--layouts", type=_choices(bench.LAYOUTS), default=defaults.layouts,
                   help="where the remote bytes live: whole (a segment an agent allocated) "
                        "and/or ranges (HIXL's layout: blocks registered as ranges inside one "
                        "malloc_mem pool of a target engine); default: both")
    p.add_argument("--ops", type=_choices(tuple(bench.OPS)), default=defaults.ops,
                   help="write,read (default both)")
    p.add_argument("--modes", type=_choices(bench.MODES), default=defaults.modes,
                   help="sync,async (default both)")
    p.add_argument("--api", type=_choices(bench.APIS), default=defaults.apis, dest="apis",
                   metavar="{list,arrays}",
                   help="how the engine cells pass their descriptors: list (Engine.transfer "
                        "with TransferOpDesc lists, the default) and/or arrays "
                        "(Engine.transfer_arrays with address arrays), e.g. list,arrays")
    p.add_argument("--sizes", type=_size_list, default=defaults.sizes,
                   help="block sizes, e.g. 4K,64K,1M,8784K,64M (the default)")
    p.add_argument("--batch", type=_int_list, default=None, dest="batches",
                   help="batch sizes for every block size (default 1,256 for blocks up to "
                        "64K, 1,8 for larger)")
    p.add_argument("--max-call-bytes", type=_one_size, default=defaults.max_call_bytes,
                   help="shrink batches so one call moves at most this (default 256M)")
    p.add_argument("--seconds", type=_positive_float, default=defaults.seconds,
                   help=f"measured time per cell (default {defaults.seconds})")
    p.add_argument("--iterations", type=_positive_int, default=defaults.iterations,
                   help=f"at most this many calls per cell (default {defaults.iterations})")
    p.add_argument("--warmup", type=int, default=defaults.warmup,
                   help=f"warm-up calls per cell (default {defaults.warmup})")
    p.add_argument("--depth", type=_positive_int, default=defaults.depth,
                   help=f"async requests in flight (default {defaults.depth})")
    p.add_argument("--timeout", type=_positive_float, default=defaults.timeout,
                   help=f"seconds allowed per transfer call (default {defaults.timeout:g})")
    style = p.add_mutually_exclusive_group()
    style.add_argument("--hixl-style", action="store_true",
                       help="run only HIXL's benchmark shape (one 8784K block, 100 transfers, "
                            "first excluded); the default run includes it")
    style.add_argument("--no-hixl-style", action="store_true",
                       help="skip the HIXL-style run")
    p.add_argument("--hixl-block", type=_one_size, default=defaults.hixl_block,
                   help="block of the HIXL-style run (default 8784K)")
    p.add_argument("--hixl-transfers", type=_positive_int, default=defaults.hixl_transfers,
                   help="transfers of the HIXL-style run (default 100; the first is excluded)")
    add_json_flag(p)
    p.add_argument("--plot", metavar="FILE.png",
                   help="also draw GB/s and p50 latency against block size for each path and "
                        "baseline into FILE.png (needs matplotlib: pip install 'hixl[plot]')")
    p.add_argument("--check-targets", action="store_true",
                   help="exit with status 1 if a performance target is missed")
    progress = p.add_mutually_exclusive_group()
    progress.add_argument("--progress", action="store_true", default=None,
                          help="show progress on stderr (default: when stderr is a terminal)")
    progress.add_argument("--no-progress", action="store_false", dest="progress")
    p.set_defaults(handler=run_bench_command)


def bench_config(args: argparse.Namespace) -> bench.BenchConfig:
    """The BenchConfig that `hixl bench` flags describe."""
    return bench.BenchConfig(
        agent=args.agent, paths=args.paths, layouts=args.layouts, ops=args.ops, modes=args.modes,
        apis=args.apis, local_memory=args.local_memory, sizes=args.sizes,
        batches=args.batches, seconds=args.seconds, iterations=args.iterations,
        warmup=max(0, args.warmup), depth=args.depth, max_call_bytes=args.max_call_bytes,
        timeout=args.timeout, matrix=not args.hixl_style, hixl_style=not args.no_hixl_style,
        hixl_block=args.hixl_block, hixl_transfers=args.hixl_transfers,
        raw_peer=args.raw_peer, local=args.local, mooncake=args.mooncake,
        mooncake_peer=args.mooncake_peer)


def run_bench_command(args: argparse.Namespace) -> int:
    config = bench_config(args)
    if args.plot:
        from hixl.tools.bench_plot import check_plot_target

        check_plot_target(args.plot)
    show_progress = sys.stderr.isatty() if args.progress is None else args.progress
    report = bench.run_bench(config, sys.stderr if show_progress else None)
    emit_report(bench.format_report(report), report, args.json)
    if args.plot:
        from hixl.tools.bench_plot import plot_report

        plot_report(report, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr if args.json == "-" else sys.stdout,
              flush=True)
    if args.check_targets and not all(t["met"] for t in report["targets"]):
        return EXIT_FAILED
    return 0


# ---------------------------------------------------------------- bench-registry


def add_bench_registry(subparsers: Any) -> None:
    from hixl.tools.registry_bench import RegistryBenchConfig

    defaults = RegistryBenchConfig()
    p = subparsers.add_parser(
        "bench-registry", help="measure the control plane: propagation, snapshot, find()",
        description="Start a hixl-master, publish SEGMENTS segments from PUBLISHERS "
                    "simulated agents, follow them with WATCHERS global tables (one process "
                    "each), and measure the time from publish() to a change being visible in "
                    "every watcher, a new watcher's snapshot time, and find() at a small "
                    "and the full table size.")
    p.add_argument("--publishers", type=_positive_int, default=defaults.publishers,
                   help=f"simulated agents (default {defaults.publishers})")
    p.add_argument("--segments", type=_positive_int, default=defaults.segments,
                   help=f"segments in all at full size (default {defaults.segments})")
    p.add_argument("--watchers", type=_positive_int, default=defaults.watchers,
                   help=f"watching GlobalTables, one process each (default {defaults.watchers})")
    p.add_argument("--changes", type=_positive_int, default=defaults.changes,
                   help=f"changes timed one by one (default {defaults.changes})")
    p.add_argument("--small-segments", type=_positive_int, default=defaults.small_segments,
                   help=f"table size find() is compared at (default {defaults.small_segments})")
    p.add_argument("--finds", type=_positive_int, default=defaults.finds,
                   help=f"lookups timed per table size (default {defaults.finds})")
    p.add_argument("--master", metavar="HOST:PORT", default="",
                   help="use this running hixl-master (default: start a private one)")
    p.add_argument("--etcd-endpoints", metavar="HOST:PORT,...", default="",
                   help="start the private hixl-master on this etcd: its registry's leases "
                        "and table live there (default: in the master's memory)")
    p.add_argument("--etcd-prefix", metavar="PREFIX", default="",
                   help="the cluster prefix on etcd (default: a fresh one per run)")
    p.add_argument("--timeout", type=_positive_float, default=defaults.timeout,
                   help=f"deadline of every wait in seconds (default {defaults.timeout:g})")
    add_json_flag(p)
    p.add_argument("--progress", action="store_true", help="show progress on stderr")
    p.set_defaults(handler=run_bench_registry_command)


def run_bench_registry_command(args: argparse.Namespace) -> int:
    from hixl.tools import registry_bench

    config = registry_bench.RegistryBenchConfig(
        publishers=args.publishers, segments=args.segments, watchers=args.watchers,
        changes=args.changes, small_segments=args.small_segments, finds=args.finds,
        master=args.master, etcd_endpoints=args.etcd_endpoints,
        etcd_prefix=args.etcd_prefix, timeout=args.timeout)
    report = registry_bench.run_registry_bench(config, sys.stderr if args.progress else None)
    emit_report(registry_bench.format_registry_report(report), report, args.json)
    return 0


def emit_report(table: str, report: dict[str, Any], json_target: str | None) -> None:
    """Print the table, and the JSON to a file or stdout ('-': the table goes to stderr)."""
    print(table, file=sys.stderr if json_target == "-" else sys.stdout, flush=True)
    if not json_target:
        return
    text = json.dumps(report, indent=2)
    if json_target == "-":
        print(text, flush=True)
    else:
        with open(json_target, "w", encoding="utf-8") as f:
            f.write(text + "\n")


# ---------------------------------------------------------------- bench store


def add_bench_store(subparsers: Any) -> None:
    from hixl.tools.store_bench import WORKLOADS, StoreBenchConfig

    defaults = StoreBenchConfig()
    p = subparsers.add_parser(
        "bench-store", help="measure the KV store (put/get and their forms) against Mooncake "
                            "Store; also `hixl bench store`",
        description="Start a hixl-master and a segment holder process (a store client that "
                    "contributes the pool's memory), then put and get values of each size "
                    "from this process (which contributes none), with put, get, put_from, "
                    "get_into and the batch forms; Mooncake Store runs side by side in the "
                    "same arrangement when it is installed. Prints GB/s, keys/s, p50/p99 "
                    "latency per call (medians over runs) and the ratio to Mooncake. Every "
                    "value is compared byte for byte; a wrong byte fails the command. "
                    "--workload lmcache measures the calls LMCache makes per KV chunk "
                    "request instead.")
    p.add_argument("--workload", choices=tuple(WORKLOADS), default=defaults.workload,
                   help="calls: every call form (put, get, put_from, get_into and the batch "
                        "forms; the default); lmcache: the calls LMCache's Mooncake connector "
                        "makes per request of KV chunks (batch_is_exist, then batch_put_from / "
                        "batch_get_into on a registered buffer)")
    p.add_argument("--sizes", type=_size_list, default=(),
                   help="value sizes (default 64K,1M,8784K; with --workload lmcache "
                        "256K,1M,2M)")
    p.add_argument("--batch", type=_positive_int, default=defaults.batch,
                   help=f"keys per call of the batch forms, chunks per request of the "
                        f"lmcache workload (default {defaults.batch})")
    p.add_argument("--runs", type=_positive_int, default=defaults.runs,
                   help=f"runs per cell; medians are reported (default {defaults.runs})")
    p.add_argument("--run-bytes", type=_one_size, default=defaults.run_bytes,
                   help="bytes one run moves, in 5 to 200 calls (default 64M)")
    p.add_argument("--concurrency", type=_positive_int, default=defaults.concurrency,
                   metavar="THREADS",
                   help="threads calling the one client at once, each its share of a run's "
                        "calls (calls workload; default 1); GB/s and keys/s are then all "
                        "threads' together")
    p.add_argument("--journal", action="store_true",
                   help="also measure hixl on a second master that journals every put "
                        "(fsync'd, in a temporary dir), with its own holder; reports its p50 "
                        "beside the in-memory master's, with the target <= 1.3x for puts")
    p.add_argument("--master", metavar="HOST:PORT", type=_host_port,
                   help="use this running hixl-master (default: start a private one)")
    p.add_argument("--mooncake-master", metavar="HOST:PORT", type=_host_port,
                   help="use this running mooncake_master (default: start a private one)")
    p.add_argument("--no-holder", action="store_false", dest="holders",
                   help="start no segment holders: they are mounted at the masters already "
                        "(e.g. on another node: `python -m hixl.tools.store_bench --holder "
                        "hixl|mooncake --master HOST:PORT --host IP --segment BYTES`)")
    p.add_argument("--local", metavar="IP",
                   help="this side's IP for the clients (default: the one routing to the master)")
    p.add_argument("--no-mooncake", action="store_false", dest="mooncake",
                   help="do not measure Mooncake Store (default: measured when mooncake.store "
                        "imports)")
    add_json_flag(p)
    p.add_argument("--check-targets", action="store_true",
                   help="exit with status 1 if a target ratio to Mooncake is missed")
    progress = p.add_mutually_exclusive_group()
    progress.add_argument("--progress", action="store_true", default=None,
                          help="show progress on stderr (default: when stderr is a terminal)")
    progress.add_argument("--no-progress", action="store_false", dest="progress")
    p.set_defaults(handler=run_bench_store_command)


def store_bench_config(args: argparse.Namespace) -> Any:
    """The StoreBenchConfig that `hixl bench store` flags describe."""
    from hixl.tools.store_bench import StoreBenchConfig

    return StoreBenchConfig(
        sizes=args.sizes, batch=args.batch, runs=args.runs, run_bytes=args.run_bytes,
        master=args.master, mooncake=args.mooncake, mooncake_master=args.mooncake_master,
        holders=args.holders, local=args.local, workload=args.workload,
        concurrency=args.concurrency, journal=args.journal)


def run_bench_store_command(args: argparse.Namespace) -> int:
    from hixl.tools import store_bench

    show_progress = sys.stderr.isatty() if args.progress is None else args.progress
    config = store_bench_config(args)
    try:
        config.check()
    except ValueError as exc:  # flags that do not go together
        print(f"hixl bench store: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    report = store_bench.run_store_bench(config, sys.stderr if show_progress else None)
    emit_report(store_bench.format_store_report(report), report, args.json)
    if args.check_targets and not all(t["met"] for t in report["targets"]):
        return EXIT_FAILED
    return 0


# ---------------------------------------------------------------- status, segments, keys


def _admin_flags(p: argparse.ArgumentParser, *, json_help: str) -> None:
    """Flags every operator query shares: token file, deadline, JSON output."""
    from hixl.tools import admin

    p.add_argument("--token-file", metavar="PATH",
                   help="cluster token file (default: $HIXL_CLUSTER_TOKEN or "
                        "$HIXL_CLUSTER_TOKEN_FILE; none: no authentication)")
    p.add_argument("--tls-ca-file", metavar="PATH",
                   help="dial with TLS, trusting this CA (default: $HIXL_TLS_CA_FILE; "
                        "none: plaintext)")
    p.add_argument("--tls-cert-file", metavar="PATH",
                   help="client certificate for servers that require one (mutual TLS), "
                        "with --tls-key-file (default: $HIXL_TLS_CERT_FILE)")
    p.add_argument("--tls-key-file", metavar="PATH",
                   help="private key of --tls-cert-file (default: $HIXL_TLS_KEY_FILE)")
    p.add_argument("--timeout", type=_positive_float, default=admin.DEFAULT_TIMEOUT_S,
                   help=f"deadline of every call in seconds (default {admin.DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--json", action="store_true", help=json_help)


def _token(args: argparse.Namespace) -> bytes | None:
    from hixl.auth import load_token

    return load_token(args.token_file or None)


def _tls(args: argparse.Namespace) -> TlsSetting:
    """The ClientTLS the flags (else HIXL_TLS_*) describe, or False for plaintext."""
    from hixl.tls import ClientTLS

    tls = ClientTLS.from_settings(args.tls_ca_file or "", args.tls_cert_file or "",
                                  args.tls_key_file or "",
                                  keys=("--tls-ca-file", "--tls-cert-file", "--tls-key-file"))
    if tls is None and (args.tls_cert_file or args.tls_key_file):
        raise ConfigError("--tls-cert-file/--tls-key-file need a CA: --tls-ca-file or "
                          "$HIXL_TLS_CA_FILE")
    return tls or False


def add_status(subparsers: Any) -> None:
    from hixl.tools import admin

    p = subparsers.add_parser(
        "status", help="health of an agent and a master: segments, peers, registry, store",
        description="Ask an agent (Health, Stats) and a hixl-master (registry and store) how "
                    "they are. With no flags: the local agent, and the master it publishes "
                    "to, if any. Exit status 0 when every endpoint asked is healthy, 1 with "
                    "a line naming the endpoint and why when one is not.")
    p.add_argument("--agent", metavar="HOST:PORT", type=_host_port,
                   help=f"agent to ask (default {admin.DEFAULT_AGENT} unless only --master "
                        "is given)")
    p.add_argument("--master", metavar="HOST:PORT[,HOST:PORT...]", type=_master_list,
                   help="hixl-master to ask, or every master of the cluster (the call fails "
                        "over between them; default: the agent's master(s), if any)")
    _admin_flags(p, json_help="print the report as JSON instead of text")
    p.set_defaults(handler=run_status_command)


def run_status_command(args: argparse.Namespace) -> int:
    from hixl.tools import admin

    agent = args.agent or (None if args.master else admin.DEFAULT_AGENT)
    report = admin.status(agent, args.master, token=_token(args), timeout=args.timeout,
                          tls=_tls(args))
    print(json.dumps(report, indent=2) if args.json else admin.format_status(report),
          flush=True)
    for endpoint in (report["agent"], report["master"]):
        for problem in endpoint["problems"] if endpoint else ():
            print(f"hixl status: error: {problem}", file=sys.stderr)
    return 0 if report["ok"] else EXIT_FAILED


def add_segments(subparsers: Any) -> None:
    from hixl.tools import admin

    p = subparsers.add_parser(
        "segments", help="the global segment table",
        description="Print the global table: every published segment with its engine, node, "
                    "id and name, base address, length, permissions, epoch and data "
                    "endpoint; from a hixl-master's registry, or an agent's embedded one (an "
                    "agent that publishes to a master shows its own segments).")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--master", metavar="HOST:PORT[,HOST:PORT...]", type=_master_list,
                        help="read the registry of this hixl-master (several, "
                             "comma-separated: the first that serves)")
    source.add_argument("--agent", metavar="HOST:PORT", type=_host_port,
                        help=f"read this agent (default {admin.DEFAULT_AGENT})")
    p.add_argument("--node", metavar="NODE_ID", help="only segments on this node")
    _admin_flags(p, json_help="print the segments as JSON instead of a table")
    p.set_defaults(handler=run_segments_command)


def run_segments_command(args: argparse.Namespace) -> int:
    from hixl.tools import admin

    listing = admin.segments(master=args.master, agent=args.agent, node=args.node,
                             token=_token(args), timeout=args.timeout, tls=_tls(args))
    print(json.dumps(listing, indent=2) if args.json else admin.format_segments(listing),
          flush=True)
    return 0


def add_keys(subparsers: Any) -> None:
    from hixl.tools import admin

    p = subparsers.add_parser(
        "keys", help="objects in the KV store, by key pattern",
        description="List the store's objects whose key matches PATTERN (a Python regular "
                    "expression, searched anywhere in the key; default: every key), sorted "
                    "by key: size, state, replicas (their segments), lease and pins. Takes "
                    "no lease and counts as no access.")
    p.add_argument("pattern", metavar="PATTERN", nargs="?", default="",
                   help="regular expression (default: all keys)")
    p.add_argument("--master", metavar="HOST:PORT[,HOST:PORT...]", type=_master_list,
                   required=True,
                   help="the hixl-master serving the store (several, comma-separated: the "
                        "first that serves)")
    p.add_argument("--limit", type=_positive_int, default=admin.DEFAULT_KEY_LIMIT,
                   help=f"list at most this many keys (default {admin.DEFAULT_KEY_LIMIT}; the "
                        "master lists at most 10000 per call)")
    _admin_flags(p, json_help="print the keys as JSON instead of a table")
    p.set_defaults(handler=run_keys_command)


def run_keys_command(args: argparse.Namespace) -> int:
    from hixl.tools import admin

    listing = admin.keys(args.master, args.pattern, limit=args.limit, token=_token(args),
                         timeout=args.timeout, tls=_tls(args))
    print(json.dumps(listing, indent=2) if args.json else admin.format_keys(listing),
          flush=True)
    if listing["truncated"]:
        print(f"hixl keys: truncated: {listing['total']} keys match, {len(listing['keys'])} "
              "listed", file=sys.stderr)
    return 0


# ---------------------------------------------------------------- soak


def _master_list(text: str) -> str:
    """--master of the admin commands: one hixl-master, or several (comma-separated: the
    command fails over between them as every master client does)."""
    from hixl.errors import ParamInvalid
    from hixl.failover import parse_addresses

    try:
        return ",".join(parse_addresses(text, "master address"))
    except ParamInvalid as exc:
        raise argparse.ArgumentTypeError(exc.args[0]) from None


def _host_port_list(text: str) -> tuple[str, ...]:
    return tuple(_host_port(part.strip()) for part in text.split(",") if part.strip())


def add_soak(subparsers: Any) -> None:
    from hixl.tools.soak import SoakConfig

    defaults = SoakConfig()
    p = subparsers.add_parser(
        "soak", help="a bounded run of random PUT/GET and store calls under random kills",
        description="Start a hixl-master (journal on, in a temporary dir), AGENTS agents and "
                    "CLIENTS client processes doing random engine PUT/GET and store "
                    "put/get/remove, each checking every byte it reads against what it "
                    "wrote; kill and restart an agent or the master every ~KILL_EVERY s. "
                    "At the end, with the faults stopped, every client verifies what it "
                    "believes is stored. Prints operations, failures by code, faults, corrupt "
                    "reads, hung calls and lost keys; exit status 1 if any of the last three "
                    "is not 0 (or a client died).")
    p.add_argument("--clients", type=_positive_int, default=defaults.clients,
                   help=f"client processes (default {defaults.clients})")
    p.add_argument("--seconds", type=_positive_float, default=defaults.seconds,
                   help=f"length of the run under load (default {defaults.seconds:g}); with "
                        "faults it goes on until an agent and the master were both killed")
    p.add_argument("--agents", type=_positive_int, default=defaults.agents,
                   help=f"hixl-agent processes (default {defaults.agents})")
    p.add_argument("--kill-every", type=_non_negative_float, default=defaults.kill_every,
                   help="mean seconds between kills (an agent or the master, alternately, "
                        f"each restarted on its ports); 0 = no faults (default "
                        f"{defaults.kill_every:g})")
    p.add_argument("--seed", type=int, default=defaults.seed,
                   help=f"seed of the clients' calls and of the faults (default {defaults.seed})")
    p.add_argument("--value-sizes", type=_size_list, default=defaults.value_sizes,
                   help="sizes of values and engine ops, picked at random (default 1K,64K,1M)")
    p.add_argument("--keys", type=_positive_int, default=defaults.keys,
                   help=f"store keys per client (default {defaults.keys})")
    p.add_argument("--call-timeout", type=_positive_float, default=defaults.call_timeout,
                   help="deadline of each transfer, master call and connect in seconds "
                        f"(default {defaults.call_timeout:g}); a call running past its "
                        "deadline plus --grace is a hung call")
    p.add_argument("--grace", type=_positive_float, default=defaults.grace,
                   help=f"seconds past a call's deadline before it counts as hung (default "
                        f"{defaults.grace:g})")
    p.add_argument("--master", metavar="HOST:PORT", type=_host_port,
                   help="soak this running hixl-master (with --agent, and --kill-every 0)")
    p.add_argument("--agent", metavar="HOST:PORT[,...]", type=_host_port_list, default=(),
                   help="soak these running agents (with --master, and --kill-every 0)")
    add_json_flag(p)
    p.add_argument("--keep-logs", action="store_true",
                   help="keep the work dir (every process's log, the master's data) even when "
                        "the run passes (a failed run always keeps it)")
    p.add_argument("--progress", action="store_true", help="say what it does on stderr")
    p.set_defaults(handler=run_soak_command)


def run_soak_command(args: argparse.Namespace) -> int:
    from hixl.tools import soak

    config = soak.SoakConfig(
        clients=args.clients, seconds=args.seconds, agents=args.agents,
        kill_every=args.kill_every, seed=args.seed, value_sizes=args.value_sizes,
        keys=args.keys, call_timeout=args.call_timeout, grace=args.grace,
        master=args.master or "", agent_targets=args.agent, keep_logs=args.keep_logs)
    report = soak.run_soak(config, sys.stderr if args.progress else None)
    emit_report(soak.format_soak_report(report), report, args.json)
    return 0 if report["ok"] else EXIT_FAILED


def add_shmem_run(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "shmem-run", help="run a hixl.shmem job: one process per PE (as mpirun)",
        description="Start the PEs of a hixl.shmem job: the command runs once per PE with "
                    "HIXL_SHMEM_PE, HIXL_SHMEM_N_PES, HIXL_SHMEM_BOOTSTRAP and HIXL_SHMEM_JOB "
                    "set, so hixl.shmem.init() needs no arguments. Without --bootstrap a "
                    "private hixl-master serves the job. When a PE fails, the others are "
                    "stopped; the exit status is the first failure's.")
    p.add_argument("-n", "--np", type=_positive_int, required=True, dest="n_local",
                   help="PEs to start here")
    p.add_argument("--n-pes", type=_positive_int,
                   help="PEs in the whole job, when other nodes start the rest (default -n)")
    p.add_argument("--first-pe", type=int, default=0,
                   help="the first PE number started here (default 0)")
    p.add_argument("--bootstrap", metavar="HOST:PORT", type=_host_port,
                   help="the job's hixl-master (default: start a private one)")
    p.add_argument("--job", help="job name shared by every node's shmem-run (default: a new id)")
    p.add_argument("--timeout", type=float, help="stop every PE after this many seconds")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="the program, after `--` (e.g. -- python prog.py ARGS)")
    p.set_defaults(handler=run_shmem_run)


def run_shmem_run(args: argparse.Namespace) -> int:
    from hixl.tools.shmem_run import run_job

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    result = run_job(command, args.n_local, bootstrap=args.bootstrap, job=args.job,
                     n_pes=args.n_pes, first_pe=args.first_pe, timeout=args.timeout)
    for reason in result.reasons:
        print(f"hixl shmem-run: {reason}", file=sys.stderr)
    return result.exit_status


# ---------------------------------------------------------------- entry point


def build_parser() -> argparse.ArgumentParser:
    from hixl import __version__

    parser = argparse.ArgumentParser(prog="hixl", description="hixl command-line tools")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    from hixl.tools import kv_offload_bench, moe_bench

    for add in (add_bench, add_bench_registry, add_bench_store, kv_offload_bench.add_parser,
                moe_bench.add_parser, add_status, add_segments, add_keys, add_soak,
                add_shmem_run):
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console script `hixl`; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] in (["bench", "store"], ["bench", "kv-offload"], ["bench", "moe"]):
        argv = [f"bench-{argv[1]}", *argv[2:]]  # `hixl bench store ...` is `hixl bench-store ...`
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except bench.BenchFailure as exc:
        print(f"hixl {args.command}: FAILED: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except (HixlError, RuntimeError, OSError) as exc:
        print(f"hixl {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"hixl {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
