"""`hixl bench kv-offload`: the KV-offload scenario (hixl.tools.kv_offload), timed.

For each page size (default: the seed's 144 KiB = 128 KiB K + 16 KiB V per layer, i.e.
8784 KiB blocks of 61 layers; and 4 KiB pages, 244 KiB blocks, where the per-page cost
shows) and each path (mapped: same-node PEs map each other's heaps; tcp: `local_paths=
False`, the bytes stream over TCP on one node), one 2-PE job is started with `run_job`
against a private hixl-master: PE 0 the inference side, PE 1 the pool. PE 0 then, `runs`
times: computes the whole cache (a new generation of page contents; untimed), offloads it
one layer per batched PUT (`put_batch`, blocking: a timed *offload batch* is one layer's
pages for every block), waits for the pool PE to check every page it received, and runs
`steps` decode steps, each a top-k choice and a batched GET of those k blocks (every
layer) into a compact buffer — a timed *gather* — checked page for page (untimed).

Batches are `ArrayBatch`es (`offload_batches`, `gather_batches`): offset arrays, one per
pool PE, sent with put_batch / get_batch. Baseline, same run: a plain Python loop of one
`ctypes.memmove` per page over the same pages within PE 0 (into and out of PE 0's own
copy of the symmetric pool; addresses computed untimed), each baseline batch timed right
before its hixl twin so machine noise hits both.
Over TCP a second baseline, same run: the *raw stream* between the same two processes
(`hixl.tools.bench`'s raw stream protocol; PE 1 serves it from a thread, PE 0 dials it
over loopback TCP): each offload batch's and each gather's bytes as one contiguous
stream (a sendall and a 1-byte ack; a request and recv_into), timed right before its
hixl twin -- what the link between those processes carries with no per-page work.
Figures: offload GB/s and blocks/s from the median run (the sum of its batches), gather
GB/s and blocks/s from the median step; p50/p99 per batch and per step; ratio = hixl /
baseline GB/s, raw_ratio = hixl / raw stream GB/s. A wrong byte anywhere fails the command (exit status 1).

`python -m hixl.tools.kv_offload_bench --pe-worker JSON` is one PE of such a job.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from ctypes import memmove
from dataclasses import asdict, dataclass
from typing import IO, Any

import numpy as np

from hixl.tools.bench import (
    KIB,
    MIB,
    BenchFailure,
    RawPeer,
    RawServerThread,
    format_rate,
    format_table,
    human_size,
)

SEED_LAYERS, SEED_PAGE = 61, 144 * KIB  # 128 KiB + 16 KiB per layer: 8784 KiB blocks
PATHS = ("mapped", "tcp")
JOB_GRACE_S = 120.0  # on top of the job's own estimate: only guards against a hang


class KvOffloadBenchFailure(BenchFailure):
    """A page held the wrong bytes (offloaded or gathered): the run is a failure."""


@dataclass
class KvBenchConfig:
    """What to measure; the defaults take about 15-25 s on 2 cores."""

    layers: int = SEED_LAYERS
    page_sizes: tuple[int, ...] = (SEED_PAGE, 4 * KIB)
    pool_bytes: int = 128 * MIB   # blocks per case: pool_bytes // block bytes (>= top_k)
    top_k: int = 8
    steps: int = 10               # decode steps per run
    runs: int = 3                 # offloads (each followed by `steps` gathers)
    paths: tuple[str, ...] = PATHS
    pool_pes: int = 1
    timeout: float = 60.0         # every shmem wait in the PEs

    def blocks(self, page: int) -> int:
        return max(self.top_k, self.pool_bytes // (self.layers * page))


# ---------------------------------------------------------------- one PE


def _percentile_ms(seconds: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(seconds) * 1e3, q))


def _phase(hixl_s: Sequence[float], base_s: Sequence[float], per_unit: Sequence[float],
           base_unit: Sequence[float], blocks: int, block_bytes: int,
           pages_per_block: int, raw_unit: Sequence[float] = ()) -> dict[str, Any]:
    """Figures of one phase: `per_unit` is the time of one unit (an offload run, a gather
    step) moving `blocks` blocks; hixl_s / base_s the individual calls timed; raw_unit,
    when measured, the raw stream's time for each unit's bytes."""
    unit, base = statistics.median(per_unit), statistics.median(base_unit)
    gbps = blocks * block_bytes / unit / 1e9
    base_gbps = blocks * block_bytes / base / 1e9
    figures = {"calls": len(hixl_s), "blocks_per_s": blocks / unit,
               "pages_per_s": blocks * pages_per_block / unit, "gbps": gbps,
               "p50_ms": _percentile_ms(hixl_s, 50), "p99_ms": _percentile_ms(hixl_s, 99),
               "baseline_gbps": base_gbps, "baseline_p50_ms": _percentile_ms(base_s, 50),
               "ratio": gbps / base_gbps}
    if raw_unit:
        raw_gbps = blocks * block_bytes / statistics.median(raw_unit) / 1e9
        figures.update(raw_gbps=raw_gbps, raw_ratio=gbps / raw_gbps)
    return figures


def _timed(call: Any) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def _raw_buffer_bytes(spec: dict[str, Any]) -> int:
    """The largest call of a case: one layer's offload or one step's gather."""
    return spec["page_bytes"] * max(spec["blocks"], spec["top_k"] * spec["layers"])


def _raw_peer(spec: dict[str, Any], deadline: float) -> RawPeer:
    """The raw stream server PE 1 started (its address in spec["raw_address"])."""
    path = spec["raw_address"]
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise BenchFailure(f"PE 1's raw stream server did not say where it listens "
                               f"({path}) within {spec['timeout']:g} s")
        time.sleep(0.01)
    with open(path, encoding="utf-8") as f:
        host, port = f.read().split()
    return RawPeer((host, int(port)))


def run_inference(job: Any, spec: dict[str, Any]) -> dict[str, Any]:
    """PE 0's timed runs: the figures, and every bad page found."""
    from hixl.tools.kv_offload import InferenceSide, bad_pages, top_k_blocks

    side = InferenceSide(job)
    raw = _raw_peer(spec, time.monotonic() + spec["timeout"]).connect("tcp") \
        if spec.get("raw_address") else None
    stream = memoryview(side.cache.reshape(-1))  # raw stream source: any bytes of the cache
    ctx, layout = job.ctx, job.layout
    k, steps, runs = spec["top_k"], spec["steps"], spec["runs"]

    def to_pool(by_pe: dict[int, Any], move: Any) -> None:
        """One array batch per pool PE: all but the last in flight at once, the last
        one blocking (no worker hand-off for the common single pool PE)."""
        batches = list(by_pe.items())
        for pe, batch in batches[:-1]:
            move(batch, pe, nbi=True)
        move(batches[-1][1], batches[-1][0])
        ctx.quiet()

    def address(obj: Any) -> int:
        """Where `obj` is in PE 0 (a symmetric object: PE 0's own copy)."""
        return int(obj.local.ctypes.data) if hasattr(obj, "ctx") else int(obj.ctypes.data)

    def plain_moves(by_pe: dict[int, Any]) -> list[tuple[int, int, int]]:
        """The same pages as (dst, src, length) addresses within PE 0, built untimed."""
        moves: list[tuple[int, int, int]] = []
        for batch in by_pe.values():
            dst, src = address(batch.dst), address(batch.src)
            moves += zip((batch.dst_offsets + dst).tolist(), (batch.src_offsets + src).tolist(),
                         [batch.lengths] * len(batch.dst_offsets), strict=True)
        return moves

    def memmove_loop(moves: list[tuple[int, int, int]]) -> None:
        for dst, src, length in moves:  # the baseline: a plain loop, one memmove per page
            memmove(dst, src, length)

    def raw_write(nbytes: int) -> None:
        assert raw is not None
        raw.write([stream[:nbytes]])

    def raw_read(nbytes: int) -> None:
        assert raw is not None
        raw.read(into_bytes, nbytes, 1)

    def in_flight(layers: list[dict[int, Any]]) -> None:
        """Every layer's batch put with nbi=True, then one quiet: layers in flight at once,
        as a layer-wise offload that does not wait for each layer runs."""
        for by_pe in layers:
            for pe, batch in by_pe.items():
                ctx.put_batch(batch, pe, nbi=True)
        ctx.quiet()

    def new_contents(generation: int) -> None:
        """Every page of the cache recomputed for `generation`: a stale page cannot pass."""
        side.generation = generation
        for layer in range(layout.layers):
            side.compute_layer(layer)

    def check_offloaded(run: int, **how: Any) -> None:
        """Tell the pool PEs this generation is offloaded; note the bad pages they find."""
        side.announce()
        verdicts = side.pool_verdicts()
        if any(verdicts.values()):
            bad["offload"].append({"run": run, **how, "bad_pages_by_pe": verdicts})

    timings: dict[str, list[float]] = {name: [] for name in (
        "offload", "offload_base", "run", "run_base", "gather", "gather_base", "run_raw",
        "gather_raw", "run_nbi")}
    bad: dict[str, list[Any]] = {"offload": [], "gather": []}
    into = side.compact(k)
    into_bytes = memoryview(into.reshape(-1))
    layer_bytes, gather_bytes = layout.blocks * layout.page_bytes, into.nbytes
    for run in range(1, runs + 1):
        # two offloads per run, each of new page contents: one waiting for each layer's
        # batch, then one with every layer in flight
        new_contents(2 * run - 1)
        batches, base_batches, raw_batches = [], [], []
        for layer in range(layout.layers):
            by_pe = side.offload_batches(layer)
            moves = plain_moves(by_pe)
            base_batches.append(_timed(lambda: memmove_loop(moves)))  # noqa: B023
            if raw is not None:
                raw_batches.append(_timed(lambda: raw_write(layer_bytes)))
            batches.append(_timed(lambda: to_pool(by_pe, ctx.put_batch)))  # noqa: B023
        timings["offload"] += batches
        timings["offload_base"] += base_batches
        timings["run"].append(sum(batches))
        timings["run_base"].append(sum(base_batches))
        if raw is not None:
            timings["run_raw"].append(sum(raw_batches))
        check_offloaded(run)
        new_contents(2 * run)
        layers = [side.offload_batches(layer) for layer in range(layout.layers)]
        timings["run_nbi"].append(_timed(lambda: in_flight(layers)))  # noqa: B023
        check_offloaded(run, in_flight=True)
        for step in range(steps):
            blocks = top_k_blocks((run - 1) * steps + step, layout.blocks, k)
            by_pe = side.gather_batches(blocks, into)
            moves = plain_moves(by_pe)
            timings["gather_base"].append(_timed(lambda: memmove_loop(moves)))  # noqa: B023
            if raw is not None:
                timings["gather_raw"].append(_timed(lambda: raw_read(gather_bytes)))
            into.fill(0)  # untimed: a page the gather missed cannot pass
            timings["gather"].append(_timed(lambda: to_pool(by_pe, ctx.get_batch)))  # noqa: B023
            wrong = bad_pages(into, blocks, side.generation)
            if wrong:
                bad["gather"].append({"run": run, "step": step, "pages": wrong[:16]})
    if raw is not None:
        raw.close()
    side.finish()
    return {"offload": _phase(timings["offload"], timings["offload_base"], timings["run"],
                              timings["run_base"], layout.blocks, layout.block_bytes,
                              layout.layers, timings["run_raw"]),
            "offload_nbi": _phase(timings["run_nbi"], timings["run_base"], timings["run_nbi"],
                                  timings["run_base"], layout.blocks, layout.block_bytes,
                                  layout.layers, timings["run_raw"]),
            "gather": _phase(timings["gather"], timings["gather_base"], timings["gather"],
                             timings["gather_base"], k, layout.block_bytes, layout.layers,
                             timings["gather_raw"]),
            "verified": {"offload_pages": 2 * runs * layout.blocks * layout.layers,
                         "gather_pages": runs * steps * k * layout.layers},
            "bad": bad, "route": ctx.route(1)}


def run_pool(job: Any, spec: dict[str, Any]) -> None:
    """A pool PE: check every generation PE 0 offloads, then wait until it is done."""
    from hixl.tools.kv_offload import PoolSide

    side = PoolSide(job)
    server = None
    if spec.get("raw_address") and job.ctx.my_pe == 1:  # the raw stream's far end: PE 1
        server = RawServerThread(_raw_buffer_bytes(spec))
        partial = spec["raw_address"] + ".part"
        with open(partial, "w", encoding="utf-8") as f:
            f.write("{} {}".format(*server.tcp))
        os.replace(partial, spec["raw_address"])  # PE 0 never reads half an address
    try:
        for generation in range(1, 2 * spec["runs"] + 1):  # two offloads per run
            side.serve(generation)
        side.wait_finished(timeout=spec["job_timeout"])
    finally:
        if server is not None:
            server.close()


def pe_main(spec: dict[str, Any]) -> int:
    """One PE of a bench job (started by `run_job`; identity from its environment)."""
    import hixl.shmem as shmem
    from hixl.errors import HixlError
    from hixl.tools.kv_offload import INFERENCE_PE, KvLayout, KvOffloadJob

    layout = KvLayout(spec["layers"], spec["blocks"], spec["page_bytes"], spec["pool_pes"])
    try:
        with shmem.init(heap_size=layout.heap_bytes, local_paths=spec["local_paths"],
                        timeout=spec["timeout"]) as ctx:
            job = KvOffloadJob(ctx, layout)
            if ctx.my_pe != INFERENCE_PE:
                run_pool(job, spec)
                return 0
            result = run_inference(job, spec)
        with open(spec["out"], "w", encoding="utf-8") as f:
            json.dump(result, f)
    except HixlError as exc:
        print(f"{type(exc).__name__}: {exc} (failed={exc.failed})", file=sys.stderr, flush=True)
        return 1
    return 0


# ---------------------------------------------------------------- the bench


def _case_name(layers: int, page: int) -> str:
    seed = " (seed)" if (layers, page) == (SEED_LAYERS, SEED_PAGE) else ""
    return f"{layers}x{human_size(page)}{seed}"


def run_case(config: KvBenchConfig, page: int, path: str, bootstrap: str,
             workdir: str) -> dict[str, Any]:
    """One job (PE 0 and the pool PEs) for one page size and path; its figures."""
    from hixl.tools.shmem_run import run_job

    blocks = config.blocks(page)
    out = os.path.join(workdir, f"pe0-{uuid.uuid4().hex[:8]}.json")
    # generous: the runs' bytes at 50 MB/s, plus start-up; only a guard against a hang
    moved = config.runs * (blocks + config.steps * config.top_k) * config.layers * page * 2
    job_timeout = JOB_GRACE_S + moved / 50e6
    spec = {"layers": config.layers, "blocks": blocks, "page_bytes": page,
            "pool_pes": config.pool_pes, "top_k": config.top_k, "steps": config.steps,
            "runs": config.runs, "local_paths": path == "mapped", "timeout": config.timeout,
            "job_timeout": job_timeout, "out": out,
            # over TCP, the raw stream between the same two PEs (PE 1 says where it listens)
            "raw_address": os.path.join(workdir, f"raw-{uuid.uuid4().hex[:8]}")
            if path == "tcp" else ""}
    capture = io.StringIO()  # every PE line (run_job serializes them), for a failure
    result = run_job([sys.executable, "-m", "hixl.tools.kv_offload_bench", "--pe-worker",
                      json.dumps(spec)], 1 + config.pool_pes, bootstrap=bootstrap,
                     timeout=job_timeout, output=capture)
    if not result.ok or not os.path.exists(out):
        tail = capture.getvalue()[-4000:]
        raise RuntimeError(f"kv-offload job ({_case_name(config.layers, page)}, {path}) "
                           f"failed: {'; '.join(result.reasons) or 'no result'}\n{tail}")
    with open(out, encoding="utf-8") as f:
        figures = json.load(f)
    return {"case": _case_name(config.layers, page), "path": path, "layers": config.layers,
            "page_bytes": page, "block_bytes": config.layers * page, "blocks": blocks,
            "top_k": config.top_k, "steps": config.steps, "runs": config.runs,
            "pool_pes": config.pool_pes, **figures}


def run_kv_offload_bench(config: KvBenchConfig, progress: IO[str] | None = None
                         ) -> dict[str, Any]:
    """Every (page size, path) case; raises KvOffloadBenchFailure on a wrong byte (after
    building the whole report, so the failure names every bad page)."""
    from hixl.tools.daemons import MasterProcess

    cases: list[dict[str, Any]] = []
    with MasterProcess(log_level="WARNING") as master, \
            tempfile.TemporaryDirectory(prefix="hixl-kv-bench-") as workdir:
        for page in config.page_sizes:
            for path in config.paths:
                if progress is not None:
                    print(f"kv-offload: {_case_name(config.layers, page)} over {path} ...",
                          file=progress, flush=True)
                cases.append(run_case(config, page, path, master.target, workdir))
    report = {"bench": "kv-offload", "config": asdict(config),
              "host": {"cpus": os.cpu_count(), "machine": platform.machine(),
                       "python": platform.python_version()},
              "baseline": "memmove loop: one ctypes.memmove per page of the same batches "
                          "within PE 0 (its own copy of the pool)",
              "cases": cases}
    failures = [f"{c['case']} {c['path']}: {c['bad']}" for c in cases
                if c["bad"]["offload"] or c["bad"]["gather"]]
    if failures:
        raise KvOffloadBenchFailure("wrong bytes: " + "; ".join(failures))
    return report


def format_kv_report(report: dict[str, Any]) -> str:
    """The table: per case and path, the offload batches and the decode gathers."""
    config = report["config"]
    out = [f"hixl bench kv-offload  one node, PE 0 (inference) -> {config['pool_pes']} pool "
           f"PE(s); {config['runs']} runs x (offload + {config['steps']} decode steps of "
           f"top-{config['top_k']})  {report['host']['cpus']} CPUs"]
    rows = []
    for case in report["cases"]:
        for phase, name, unit in (("offload", "offload", "layer"),
                                  ("offload_nbi", "offload nbi", "run"),
                                  ("gather", "gather", f"top-{case['top_k']}")):
            f = case[phase]
            rows.append([case["case"], f"{case['path']} ({case['route']})", name,
                         human_size(case["block_bytes"], approximate=True),
                         str(case["top_k"] if phase == "gather" else case["blocks"]),
                         f"{unit}", str(f["calls"]), format_rate(f["blocks_per_s"]),
                         format_rate(f["pages_per_s"]),
                         f"{f['gbps']:.3f}", f"{f['p50_ms']:.2f}", f"{f['p99_ms']:.2f}",
                         f"{f['baseline_gbps']:.3f}", f"{f['ratio']:.2f}x",
                         f"{f['raw_gbps']:.3f}" if "raw_gbps" in f else "-",
                         f"{f['raw_ratio']:.2f}x" if "raw_ratio" in f else "-"])
    out += ["", format_table(["case", "path", "phase", "block", "blocks", "batch", "calls",
                              "blocks/s", "pages/s", "GB/s", "p50 ms", "p99 ms", "memmove GB/s",
                              "ratio", "raw GB/s", "vs raw"],
                             rows, left=(0, 1, 2, 5)),
            "(offload: one batched PUT per layer for every block, GB/s of the median run; "
            "offload nbi: the same batches put with nbi=True, every layer in flight, one "
            "quiet per run, GB/s and p50/p99 of the runs; "
            "gather: one batched GET of the top-k blocks, every layer, GB/s of the median "
            "step; p50/p99 per batch or step; " + report["baseline"] + "; ratio: "
            "hixl / memmove-loop GB/s; raw: over TCP, the same bytes as one stream between the "
            "same two PEs, vs raw = hixl / raw GB/s)"]
    verified = [f"{c['case']} {c['path']}: {c['verified']['offload_pages']} offloaded + "
                f"{c['verified']['gather_pages']} gathered pages" for c in report["cases"]]
    out.append("verified page for page: " + "; ".join(verified))
    return "\n".join(out)


# ---------------------------------------------------------------- command line


def _page_list(text: str) -> tuple[int, ...]:
    from hixl.tools.cli import _size_list

    sizes = _size_list(text)
    if any(size % 8 for size in sizes):
        raise argparse.ArgumentTypeError(f"page sizes must be multiples of 8 bytes: {text!r}")
    return sizes


def add_parser(subparsers: Any) -> None:
    """Declare `bench-kv-offload` (`hixl bench kv-offload`) on a CLI's subparsers."""
    from hixl.tools.cli import (
        _choices,
        _one_size,
        _positive_float,
        _positive_int,
        add_json_flag,
    )

    defaults = KvBenchConfig()
    p = subparsers.add_parser(
        "bench-kv-offload", help="KV-cache offload to a pool PE and top-k gathers (hixl.shmem); "
                                 "also `hixl bench kv-offload`",
        description="Start a hixl.shmem job per page size and path (PE 0: a paged KV cache, "
                    "PE 1: the host pool), offload the cache one batched PUT per layer and "
                    "gather the top-k blocks back per decode step with one batched GET; "
                    "print blocks/s, GB/s and p50/p99 per offload batch and per gather next "
                    "to a memmove loop of the same pages within PE 0. Every page is checked; a "
                    "wrong byte fails the command.")
    p.add_argument("--layers", type=_positive_int, default=defaults.layers,
                   help=f"layers per block (default {defaults.layers}, the seed's model)")
    p.add_argument("--page-sizes", type=_page_list, default=defaults.page_sizes,
                   help="bytes of one block in one layer, one case each (default 144K,4K: "
                        "the seed's 8784K blocks, and small ones)")
    p.add_argument("--pool", type=_one_size, default=defaults.pool_bytes, dest="pool_bytes",
                   help="KV cache bytes per case: blocks = pool / block size (default 128M)")
    p.add_argument("--top-k", type=_positive_int, default=defaults.top_k,
                   help=f"blocks gathered per decode step (default {defaults.top_k})")
    p.add_argument("--steps", type=_positive_int, default=defaults.steps,
                   help=f"decode steps per run (default {defaults.steps})")
    p.add_argument("--runs", type=_positive_int, default=defaults.runs,
                   help=f"offloads per case, each followed by the steps (default "
                        f"{defaults.runs}; medians are reported)")
    p.add_argument("--paths", type=_choices(PATHS), default=defaults.paths,
                   help="mapped,tcp (default both)")
    p.add_argument("--pool-pes", type=_positive_int, default=defaults.pool_pes,
                   help="PEs the pool is sharded over (default 1)")
    p.add_argument("--timeout", type=_positive_float, default=defaults.timeout,
                   help=f"deadline of every wait in the PEs, seconds (default "
                        f"{defaults.timeout:g})")
    add_json_flag(p)
    p.add_argument("--progress", action="store_true", help="name each case on stderr")
    p.set_defaults(handler=run_command)


def run_command(args: argparse.Namespace) -> int:
    from hixl.tools.cli import emit_report

    config = KvBenchConfig(layers=args.layers, page_sizes=args.page_sizes,
                           pool_bytes=args.pool_bytes, top_k=args.top_k, steps=args.steps,
                           runs=args.runs, paths=args.paths, pool_pes=args.pool_pes,
                           timeout=args.timeout)
    report = run_kv_offload_bench(config, sys.stderr if args.progress else None)
    emit_report(format_kv_report(report), report, args.json)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m hixl.tools.kv_offload_bench`: a PE (--pe-worker), else the bench."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--pe-worker"]:
        return pe_main(json.loads(argv[1]))
    parser = argparse.ArgumentParser(prog="hixl bench kv-offload")
    add_parser(parser.add_subparsers(dest="command", required=False))
    args = parser.parse_args(["bench-kv-offload", *argv])
    from hixl.errors import HixlError

    try:
        return args.handler(args)
    except BenchFailure as exc:
        print(f"hixl bench kv-offload: FAILED: {exc}", file=sys.stderr)
    except (HixlError, RuntimeError, OSError) as exc:
        print(f"hixl bench kv-offload: error: {exc}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
