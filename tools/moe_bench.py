"""`hixl bench moe` (`hixl bench-moe`): MoE dispatch + combine on hixl.shmem, timed side by
side with the same all-to-all done by `torch.distributed` (gloo, CPU) in the same run.

For each shape (tokens per PE Bs, hidden H, experts per token K, experts per PE) it runs
`hixl.tools.moe.MoeLayer` in `n_pes` PE processes (`shmem_run.run_job`, a private
hixl-master), once per data path: "mapped" (same-node PEs map each other's heaps) and
"tcp" (`local_paths=False`). When `import torch` works, `n_pes` gloo ranks (processes,
rendezvous `tcp://127.0.0.1:<free port>`) do the same exchange with `all_to_all_single`:
per-(source, expert) counts, then every (token, k) row and its (source, token, k, expert)
metadata with split sizes, the expert compute, every result back, the same reduction —
the same routing, packing and arithmetic code (hixl.tools.moe), only the transport
differs.

A pass starts after a barrier; *dispatch* is routing + packing + exchange until every
row is here, *combine* the exchange back + the weighted reduction (expert compute is
timed apart and left out of both). A pass's time is its slowest PE's; p50/p99 are over
passes. GB/s: token bytes moved per pass (each (token, k) row out and its result back,
`moe.moved_bytes`, rows whose expert is on their own PE included) over the p50 pass.
Two input sets alternate so that a pass reading stale rows shows; every timed pass's
output is compared bit for bit with the single-process reference, the float64 check
once per input set: a mismatch in either system fails the command (exit status 1).

Each PE / rank prints one `MOE-BENCH {json}` line per shape; the parent reads them from
the launcher's output.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import re
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import IO, Any

import numpy as np

from hixl.tools import moe
from hixl.tools.bench import BenchFailure, format_table
from hixl.tools.moe import MoeShape

PATHS = ("mapped", "tcp")
TORCH_MODES = ("auto", "on", "off")
DEFAULT_SHAPES = (MoeShape(128, 7168, 8, 8), MoeShape(16, 7168, 8, 8), MoeShape(512, 2048, 4, 4))
MARK = "MOE-BENCH "
INPUT_SETS = 2  # alternated pass by pass: a stale row cannot match the reference
_LINE = re.compile(r"^\[pe (\d+)\] (.*)$")


class MoeBenchFailure(BenchFailure):
    """A PE or rank failed, or gave no result: the run cannot be reported."""


@dataclass
class MoeBenchConfig:
    shapes: tuple[MoeShape, ...] = DEFAULT_SHAPES
    n_pes: int = 2
    iterations: int = 50
    warmup: int = 5
    dtype: str = "float32"
    paths: tuple[str, ...] = PATHS
    torch: str = "auto"
    seed: int = 0
    timeout: float = 300.0  # a whole job's deadline: only against hangs

    def typed_shapes(self) -> tuple[MoeShape, ...]:
        return tuple(replace(s, dtype=self.dtype) for s in self.shapes)


# ---------------------------------------------------------------- the workers (one per PE)


@dataclass
class ShapeRun:
    """One PE's passes of one shape: per-pass seconds of each phase, and the verdict."""

    dispatch: list[float] = field(default_factory=list)
    compute: list[float] = field(default_factory=list)
    combine: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    max_abs_err: float = 0.0


class _Passes:
    """Inputs, references and the verdict for one shape on one PE."""

    def __init__(self, shape: MoeShape, n_pes: int, pe: int, seed: int) -> None:
        self.shape, self.n_pes, self.pe, self.seed = shape, n_pes, pe, seed
        self.inputs = [moe.make_inputs(shape, n_pes, pe, i, seed) for i in range(INPUT_SETS)]
        self.refs = [moe.reference_output(shape, n_pes, pe, i, seed) for i in range(INPUT_SETS)]
        self.run = ShapeRun()

    def verify(self, step: int, out: np.ndarray) -> None:
        which = step % INPUT_SETS
        if step < INPUT_SETS:  # the float64 check, once per input set
            check = moe.check_output(out, self.shape, self.n_pes, self.pe, which, self.seed,
                                     reference=self.refs[which])
            self.run.max_abs_err = max(self.run.max_abs_err, check.max_abs_err)
            if not check.within_tolerance:
                self.run.problems.append(f"pass {step}: {check.max_abs_err:.3g} from float64 "
                                         f"(tolerance {check.tolerance:g})")
        if not np.array_equal(out, self.refs[which]):
            bad = int(np.count_nonzero(np.any(out != self.refs[which], axis=1)))
            self.run.problems.append(f"pass {step}: {bad} of {self.shape.tokens} tokens "
                                     "differ from the reference")

    def report(self, index: int, rank: int, **extra: Any) -> None:
        print(MARK + json.dumps({"shape": index, "rank": rank, **asdict(self.run), **extra}),
              flush=True)


def hixl_pe_main(job: dict[str, Any]) -> int:
    """One hixl PE (started by run_job): every shape on one arena, a barrier between."""
    import hixl.shmem as shmem
    from hixl.errors import HixlError

    shapes = [MoeShape(**s) for s in job["shapes"]]
    ctx = shmem.init(heap_size=moe.heap_bytes(shapes, int(os.environ["HIXL_SHMEM_N_PES"])),
                     local_paths=job["path"] == "mapped", timeout=job["timeout"])
    try:
        arena = ctx.malloc(max(moe.BufferPlan(s, ctx.n_pes).total for s in shapes), "moe-arena")
        routes = sorted({ctx.route(pe) for pe in range(ctx.n_pes)} - {"self"})
        for index, shape in enumerate(shapes):
            passes = _Passes(shape, ctx.n_pes, ctx.my_pe, job["seed"])
            layer = moe.MoeLayer(ctx, shape, seed=job["seed"], arena=arena)
            for step in range(job["warmup"] + job["iterations"]):
                ctx.barrier_all()
                out = layer.forward(passes.inputs[step % INPUT_SETS])
                if step >= job["warmup"]:
                    passes.run.dispatch.append(layer.times.dispatch)
                    passes.run.compute.append(layer.times.compute)
                    passes.run.combine.append(layer.times.combine)
                passes.verify(step, out)
            passes.report(index, ctx.my_pe, routes=routes)
            ctx.barrier_all()  # the next layer reuses the arena
        shmem.finalize()
    except HixlError as exc:
        print(MARK + json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        ctx.finalize(barrier=False)
        return 1
    return 0


def torch_rank_main(job: dict[str, Any]) -> int:
    """One gloo rank: the same passes with all_to_all_single (rank = the PE number)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # numpy does the arithmetic; gloo has threads of its own
    rank, world = int(os.environ["HIXL_SHMEM_PE"]), int(os.environ["HIXL_SHMEM_N_PES"])
    dist.init_process_group("gloo", init_method=f"tcp://{os.environ['HIXL_SHMEM_BOOTSTRAP']}",
                            rank=rank, world_size=world,
                            timeout=timedelta(seconds=job["timeout"]))
    try:
        for index, spec in enumerate(job["shapes"]):
            shape = MoeShape(**spec)
            passes = _Passes(shape, world, rank, job["seed"])
            scale, bias = moe.expert_params(shape, world, job["seed"])
            for step in range(job["warmup"] + job["iterations"]):
                dist.barrier()
                out, times = _torch_pass(shape, world, rank, passes.inputs[step % INPUT_SETS],
                                         scale, bias)
                if step >= job["warmup"]:
                    for name, seconds in zip(("dispatch", "compute", "combine"), times,
                                             strict=True):
                        getattr(passes.run, name).append(seconds)
                passes.verify(step, out)
            passes.report(index, rank, torch=torch.__version__)
    finally:
        dist.destroy_process_group()
    return 0


def _torch_pass(shape: MoeShape, world: int, rank: int, inputs: moe.MoeInputs,
                scale: np.ndarray, bias: np.ndarray) -> tuple[np.ndarray, tuple[float, ...]]:
    import torch
    import torch.distributed as dist

    epp, total = shape.experts_per_pe, shape.tokens * shape.topk
    started = time.perf_counter()
    routing = moe.route(inputs.expert_ids, shape, world)
    # per-(source, expert) counts first: they size the receive side
    counts = routing.counts.reshape(world, epp).astype(np.int64)
    got_counts = np.empty_like(counts)
    dist.all_to_all_single(torch.from_numpy(got_counts), torch.from_numpy(counts))
    send_rows, recv_rows = routing.rows_to.tolist(), got_counts.sum(axis=1).tolist()
    tokens = routing.order // shape.topk
    send_x = np.take(inputs.x, tokens, axis=0)
    send_meta = np.stack([np.full(total, rank), tokens, routing.order % shape.topk,
                          routing.experts], axis=1).astype(np.int32)
    recv_x = np.empty((sum(recv_rows), shape.hidden), shape.np_dtype)
    recv_meta = np.empty((sum(recv_rows), len(moe.META_FIELDS)), np.int32)
    dist.all_to_all_single(torch.from_numpy(recv_x), torch.from_numpy(send_x),
                           recv_rows, send_rows)
    dist.all_to_all_single(torch.from_numpy(recv_meta), torch.from_numpy(send_meta),
                           recv_rows, send_rows)
    dispatched = time.perf_counter()
    y = np.empty_like(recv_x)
    start = 0
    for source in range(world):  # rows arrive by source, then by expert
        for local, count in enumerate(got_counts[source].tolist()):
            expert = rank * epp + local
            apply = slice(start, start + count)
            moe.apply_expert(recv_x[apply], scale[expert], bias[expert], y[apply])
            start += count
    computed = time.perf_counter()
    back = np.empty((total, shape.hidden), shape.np_dtype)
    dist.all_to_all_single(torch.from_numpy(back), torch.from_numpy(y), send_rows, recv_rows)
    out = moe.weighted_sum(back, routing.index, inputs.weights)
    done = time.perf_counter()
    return out, (dispatched - started, computed - dispatched, done - computed)


def worker_main(argv: Sequence[str] | None = None) -> int:
    """`python -m hixl.tools.moe_bench --hixl-pe JSON | --torch-rank JSON`."""
    parser = argparse.ArgumentParser(prog="python -m hixl.tools.moe_bench")
    role = parser.add_mutually_exclusive_group(required=True)
    role.add_argument("--hixl-pe", metavar="JSON")
    role.add_argument("--torch-rank", metavar="JSON")
    args = parser.parse_args(argv)
    if args.hixl_pe:
        return hixl_pe_main(json.loads(args.hixl_pe))
    return torch_rank_main(json.loads(args.torch_rank))


# ---------------------------------------------------------------- the parent


class _Lines(io.TextIOBase):
    """run_job's output: keeps every "[pe N] ..." line (results and, on failure, logs)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self.lines.extend(line for line in text.splitlines() if line)
        return len(text)

    def results(self) -> tuple[list[dict[str, Any]], list[str]]:
        """Every MARK line as JSON, and the errors the workers reported."""
        found, errors = [], []
        for line in self.lines:
            match = _LINE.match(line)
            if match and match.group(2).startswith(MARK):
                record = json.loads(match.group(2)[len(MARK):])
                if "error" in record:
                    errors.append(f"PE {match.group(1)}: {record['error']}")
                else:
                    found.append(record)
        return found, errors

    def tail(self, count: int = 20) -> str:
        return "\n".join(self.lines[-count:])


def torch_unavailable() -> str | None:
    """Why torch.distributed with gloo cannot be measured here, or None."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as exc:
        return f"torch does not import ({exc}); install the `torch` extra to compare"
    if not dist.is_available() or not dist.is_gloo_available():
        return f"torch {torch.__version__} has no gloo backend"
    return None


def _run_workers(system: str, role: str, config: MoeBenchConfig, shapes: Sequence[MoeShape],
                 path: str) -> list[dict[str, Any]]:
    """Run one job of n_pes workers; every worker's per-shape records."""
    from hixl.processes import free_port
    from hixl.tools.shmem_run import run_job

    job = {"shapes": [asdict(s) for s in shapes], "path": path, "seed": config.seed,
           "warmup": config.warmup, "iterations": config.iterations,
           "timeout": min(config.timeout, 120.0)}
    command = [sys.executable, "-m", "hixl.tools.moe_bench", role, json.dumps(job)]
    # torch ranks rendezvous at the "bootstrap" address; hixl PEs get a private master
    bootstrap = f"127.0.0.1:{free_port('127.0.0.1')}" if system == "torch" else None
    lines = _Lines()
    result = run_job(command, config.n_pes, bootstrap=bootstrap, timeout=config.timeout,
                     output=lines)
    records, errors = lines.results()
    if not result.ok or errors:
        why = "; ".join(errors + result.reasons) or f"exit status {result.exit_status}"
        raise MoeBenchFailure(f"{system} {path}: {why}\n{lines.tail()}")
    if len(records) != config.n_pes * len(shapes):
        raise MoeBenchFailure(f"{system} {path}: {len(records)} results, expected "
                              f"{config.n_pes * len(shapes)}\n{lines.tail()}")
    return records


def _ms(values: Sequence[float]) -> dict[str, float]:
    arr = np.asarray(values) * 1e3
    return {"p50": float(np.percentile(arr, 50)), "p99": float(np.percentile(arr, 99))}


def summarize(system: str, path: str, shape: MoeShape, n_pes: int,
              records: list[dict[str, Any]]) -> dict[str, Any]:
    """A cell: each pass's time is its slowest PE's; p50/p99 over passes."""
    def slowest(phase: str) -> np.ndarray:
        return np.max([r[phase] for r in records], axis=0)

    dispatch, combine = slowest("dispatch"), slowest("combine")
    total = np.max([np.add(r["dispatch"], r["combine"]) for r in records], axis=0)
    cell = {"system": system, "path": path, "shape": asdict(shape), "passes": len(total),
            "dispatch_ms": _ms(dispatch), "combine_ms": _ms(combine),
            "compute_ms": _ms(slowest("compute")), "total_ms": _ms(total),
            "moved_bytes": moe.moved_bytes(shape, n_pes),
            "problems": [f"rank {r['rank']}: {p}" for r in records for p in r["problems"]],
            "max_abs_err": max(r["max_abs_err"] for r in records)}
    cell["gbps"] = cell["moved_bytes"] / (cell["total_ms"]["p50"] / 1e3) / 1e9
    cell["verified"] = not cell["problems"]
    routes = {route for r in records for route in r.get("routes", ())}
    if routes:
        cell["routes"] = sorted(routes)
    return cell


def run_moe_bench(config: MoeBenchConfig, progress: IO[str] | None = None) -> dict[str, Any]:
    """Every path's hixl job, then the torch job; the report (see format_moe_report)."""
    shapes = config.typed_shapes()
    for shape in shapes:
        shape.check(config.n_pes)
    reason = None if config.torch != "off" else "--torch off"
    if reason is None:
        reason = torch_unavailable()
        if reason and config.torch == "on":
            raise MoeBenchFailure(f"--torch on, but {reason}")
    jobs = [("hixl", "--hixl-pe", path) for path in config.paths]
    if reason is None:
        jobs.append(("torch", "--torch-rank", "gloo"))
    cells: list[dict[str, Any]] = []
    torch_version = None
    started = time.monotonic()
    for system, role, path in jobs:
        if progress is not None:
            print(f"hixl bench moe: {system} {path}, {len(shapes)} shapes x "
                  f"{config.warmup}+{config.iterations} passes on {config.n_pes} PEs",
                  file=progress, flush=True)
        records = _run_workers(system, role, config, shapes, path)
        for index, shape in enumerate(shapes):
            mine = sorted((r for r in records if r["shape"] == index), key=lambda r: r["rank"])
            cells.append(summarize(system, path, shape, config.n_pes, mine))
            torch_version = torch_version or mine[0].get("torch")
    for cell in cells:
        theirs = next((c for c in cells if c["system"] == "torch"
                       and c["shape"] == cell["shape"]), None)
        if cell["system"] == "hixl" and theirs is not None:
            cell["vs_torch"] = theirs["total_ms"]["p50"] / cell["total_ms"]["p50"]
    return {
        "version": 1,
        "kind": "moe",
        "host": {"cpus": os.cpu_count(), "machine": platform.machine(),
                 "python": platform.python_version()},
        "config": {**asdict(config), "shapes": [asdict(s) for s in shapes]},
        "torch": {"measured": reason is None, "version": torch_version, "backend": "gloo",
                  **({"reason": reason} if reason else {})},
        "cells": cells,
        "seconds": round(time.monotonic() - started, 1),
        "verified": all(c["verified"] for c in cells),
    }


def _shape_text(shape: dict[str, Any]) -> str:
    return (f"{shape['tokens']}x{shape['hidden']} K{shape['topk']} "
            f"{shape['experts_per_pe']}e/PE")


def format_moe_report(report: dict[str, Any]) -> str:
    config, torch = report["config"], report["torch"]
    out = [f"hixl bench moe  {config['n_pes']} PEs on one node, {config['dtype']}, "
           f"{config['iterations']} passes (+{config['warmup']} warm-up) per cell, "
           f"{report['host']['cpus']} CPUs"]
    if torch["measured"]:
        out.append(f"side by side: torch.distributed {torch['version']} (gloo, CPU, "
                   "all_to_all_single), same routing, packing and arithmetic")
    else:
        out.append(f"torch.distributed not measured: {torch['reason']}")
    rows = []
    for cell in report["cells"]:
        system = cell["system"] if cell["system"] == "torch" else f"hixl {cell['path']}"
        rows.append([_shape_text(cell["shape"]), system,
                     f"{cell['dispatch_ms']['p50']:.2f}", f"{cell['combine_ms']['p50']:.2f}",
                     f"{cell['total_ms']['p50']:.2f}", f"{cell['total_ms']['p99']:.2f}",
                     f"{cell['gbps']:.2f}",
                     f"{cell['vs_torch']:.2f}x" if "vs_torch" in cell else "-",
                     "ok" if cell["verified"] else "MISMATCH"])
    out += ["", format_table(["shape", "system", "dispatch ms", "combine ms", "total p50",
                              "total p99", "GB/s", "vs torch", "check"], rows, left=(0, 1)),
            "(ms: p50 over passes of the slowest PE; dispatch = route + pack + exchange, "
            "combine = exchange back + weighted sum, expert compute excluded; GB/s: token "
            "bytes out and back per pass, own-PE rows included, / total p50; vs torch: "
            "torch total / hixl total)"]
    problems = [f"{c['system']} {c['path']} {_shape_text(c['shape'])}: {p}"
                for c in report["cells"] for p in c["problems"]]
    out += ["", "correctness: every timed pass equals the single-process reference bit for "
                "bit (float64 check within "
                f"{moe.TOLERANCE[config['dtype']]:g})" if report["verified"]
            else "correctness: FAILED", *problems]
    return "\n".join(out)


# ---------------------------------------------------------------- command line


def _shapes(text: str) -> tuple[MoeShape, ...]:
    shapes = []
    for part in text.split(","):
        fields = part.strip().lower().split("x")
        try:
            values = [int(f) for f in fields]
        except ValueError:
            values = []
        if len(values) != 4 or min(values) <= 0:
            raise argparse.ArgumentTypeError(
                f"{part!r}: a shape is TOKENSxHIDDENxTOPKxEXPERTS_PER_PE, e.g. 128x7168x8x8")
        shapes.append(MoeShape(*values))
    return tuple(shapes)


def _paths(text: str) -> tuple[str, ...]:
    values = tuple(p.strip() for p in text.split(",") if p.strip())
    if not values or any(v not in PATHS for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(PATHS)}")
    return values


def add_parser(subparsers: Any) -> None:
    """Declare `bench-moe` (the CLI maps `hixl bench moe` to it)."""
    from hixl.tools.cli import _non_negative_int, _positive_float, _positive_int, add_json_flag

    defaults = MoeBenchConfig()
    p = subparsers.add_parser(
        "bench-moe", help="time MoE dispatch + combine on hixl.shmem against torch gloo; "
                          "also `hixl bench moe`",
        description="Run MoE dispatch + combine (hixl.tools.moe) in N PE processes on the "
                    "mapped and TCP paths, and the same all-to-all with torch.distributed "
                    "(gloo, CPU) in the same run when torch imports; print dispatch, combine "
                    "and total ms (p50/p99), GB/s and the ratio. Every pass is checked "
                    "against the single-process reference; a mismatch exits with status 1.")
    p.add_argument("--shapes", type=_shapes, default=defaults.shapes,
                   help="TOKENSxHIDDENxTOPKxEXPERTS_PER_PE, comma-separated (default "
                        "128x7168x8x8,16x7168x8x8,512x2048x4x4)")
    p.add_argument("--n-pes", type=_positive_int, default=defaults.n_pes,
                   help=f"PE processes (and torch ranks) (default {defaults.n_pes})")
    p.add_argument("--iterations", type=_positive_int, default=defaults.iterations,
                   help=f"timed passes per shape (default {defaults.iterations})")
    p.add_argument("--warmup", type=_non_negative_int, default=defaults.warmup,
                   help=f"untimed passes first (default {defaults.warmup})")
    p.add_argument("--dtype", choices=tuple(moe.DTYPES), default=defaults.dtype,
                   help="activations' dtype (numpy has no bfloat16) (default float32)")
    p.add_argument("--paths", type=_paths, default=defaults.paths,
                   help="hixl data paths: mapped, tcp (default both)")
    p.add_argument("--torch", choices=TORCH_MODES, default=defaults.torch,
                   help="measure torch.distributed gloo: auto = when it imports (default), "
                        "on = required, off = never")
    p.add_argument("--seed", type=int, default=defaults.seed, help="inputs' seed")
    p.add_argument("--timeout", type=_positive_float, default=defaults.timeout,
                   help=f"deadline of each job in seconds (default {defaults.timeout:g})")
    add_json_flag(p)
    p.add_argument("--progress", action="store_true", help="say which job runs, on stderr")
    p.set_defaults(handler=run_bench_moe_command)


def run_bench_moe_command(args: argparse.Namespace) -> int:
    from hixl.tools.cli import EXIT_FAILED, emit_report

    config = MoeBenchConfig(shapes=args.shapes, n_pes=args.n_pes, iterations=args.iterations,
                            warmup=args.warmup, dtype=args.dtype, paths=args.paths,
                            torch=args.torch, seed=args.seed, timeout=args.timeout)
    report = run_moe_bench(config, sys.stderr if args.progress else None)
    emit_report(format_moe_report(report), report, args.json)
    return 0 if report["verified"] else EXIT_FAILED


if __name__ == "__main__":
    sys.exit(worker_main())
