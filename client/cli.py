"""`hixl`: the user's command line. Subcommands: `bench`, `bench-registry` (more, e.g. status/segments/keys, plug in).

Each subcommand is one `add_<name>(subparsers)` function that declares its flags and sets
`handler`; `main()` parses and dispatches, turning expected failures into an error line
and a non-zero exit status instead of a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from hixl.client import bench
from hixl.errors import ConfigError, HixlError

EXIT_FAILED = 1  # the command ran and failed (wrong bytes, missed targets with --check-targets)
EXIT_USAGE = 2  # argparse's own status for bad flags


def _size_list(text: str) -> tuple[int, ...]:
    from hixl.server.config import parse_size

    try:
        sizes = tuple(parse_size(part) for part in text.split(",") if part.strip())
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(exc.args[0]) from None
    if not sizes:
        raise argparse.ArgumentTypeError("give at least one size, e.g. 4K,1M")
    return sizes


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


def _positive(kind: type[int] | type[float]) -> Callable[[str], float]:
    """An argparse type: a positive int or float, refused by name otherwise."""
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
        if not value > 0:  # also refuses nan
            raise argparse.ArgumentTypeError(f"must be positive, got {text!r}")
        return value
    return parse


_positive_float = _positive(float)
_positive_int = _positive(int)


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
                        "(`python -m hixl.client.bench --raw-server --tcp HOST:PORT --buffer "
                        "BYTES --forever`); required when the agent is on another node "
                        "(default: start one here)")
    p.add_argument("--local", metavar="IP",
                   help="this side's IP for the engines (default: the one routing to the agent)")
    p.add_argument("--mooncake", choices=("auto", "on", "off"), default=defaults.mooncake,
                   help="measure Mooncake's TransferEngine (tcp) side by side: auto = when "
                        "mooncake.engine imports (default), on = required, off = never")
    p.add_argument("--mooncake-peer", metavar="IP:RPC_PORT", type=_host_port,
                   help="segment of a Mooncake target on the agent's node (`python -m "
                        "hixl.client.mooncake_baseline --host IP --buffer BYTES`); default: "
                        "start one here (same node only)")
    p.add_argument("--paths", type=_choices(bench.PATHS), default=defaults.paths,
                   help="fabric,socket (default both)")
    p.add_argument("--ops", type=_choices(tuple(bench.OPS)), default=defaults.ops,
                   help="write,read (default both)")
    p.add_argument("--modes", type=_choices(bench.MODES), default=defaults.modes,
                   help="sync,async (default both)")
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
    p.add_argument("--json", metavar="FILE",
                   help="also write every number as JSON to FILE ('-' = stdout; the table "
                        "then goes to stderr)")
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
        agent=args.agent, paths=args.paths, ops=args.ops, modes=args.modes, sizes=args.sizes,
        batches=args.batches, seconds=args.seconds, iterations=args.iterations,
        warmup=max(0, args.warmup), depth=args.depth, max_call_bytes=args.max_call_bytes,
        timeout=args.timeout, matrix=not args.hixl_style, hixl_style=not args.no_hixl_style,
        hixl_block=args.hixl_block, hixl_transfers=args.hixl_transfers,
        raw_peer=args.raw_peer, local=args.local, mooncake=args.mooncake,
        mooncake_peer=args.mooncake_peer)


def run_bench_command(args: argparse.Namespace) -> int:
    config = bench_config(args)
    show_progress = sys.stderr.isatty() if args.progress is None else args.progress
    report = bench.run_bench(config, sys.stderr if show_progress else None)
    table_stream = sys.stderr if args.json == "-" else sys.stdout
    print(bench.format_report(report), file=table_stream, flush=True)
    if args.json:
        text = json.dumps(report, indent=2)
        if args.json == "-":
            print(text, flush=True)
        else:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(text + "\n")
    if args.check_targets and not all(t["met"] for t in report["targets"]):
        return EXIT_FAILED
    return 0


# ---------------------------------------------------------------- bench-registry


def add_bench_registry(subparsers: Any) -> None:
    from hixl.client.registry_bench import RegistryBenchConfig

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
    p.add_argument("--timeout", type=_positive_float, default=defaults.timeout,
                   help=f"deadline of every wait in seconds (default {defaults.timeout:g})")
    p.add_argument("--json", metavar="FILE",
                   help="also write the numbers as JSON to FILE ('-' = stdout; the table "
                        "then goes to stderr)")
    p.add_argument("--progress", action="store_true", help="show progress on stderr")
    p.set_defaults(handler=run_bench_registry_command)


def run_bench_registry_command(args: argparse.Namespace) -> int:
    from hixl.client import registry_bench

    config = registry_bench.RegistryBenchConfig(
        publishers=args.publishers, segments=args.segments, watchers=args.watchers,
        changes=args.changes, small_segments=args.small_segments, finds=args.finds,
        master=args.master, timeout=args.timeout)
    report = registry_bench.run_registry_bench(config, sys.stderr if args.progress else None)
    _emit(registry_bench.format_registry_report(report), report, args.json)
    return 0


def _emit(table: str, report: dict[str, Any], json_target: str | None) -> None:
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


# ---------------------------------------------------------------- entry point


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hixl", description="hixl command-line tools")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in (add_bench, add_bench_registry):
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Console script `hixl`; returns the exit status."""
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
