"""`hixl bench --plot` decides something (issue 20, item 10): per path, hixl's GB/s
against block size with its baseline and the target as lines, the ratio printed, sync
named, batched points of unlike shapes not joined, the legend beside the data, the unix
socket called by its name. The report is shaped like `hixl bench --json`'s; the drawing
is real (matplotlib, a PNG).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hixl.tools.bench_plot import plot_report

KIB, MIB = 1 << 10, 1 << 20


def _engine(path: str, block: int, batch: int, gbps: float, ratio: float | None = None,
            mode: str = "sync", baseline: str = "memcpy") -> dict[str, Any]:
    cell = {"kind": "engine", "path": path, "op": "read", "mode": mode, "layout": "whole",
            "route": "fabric" if path == "fabric" else "unix", "block": block,
            "batch": batch, "gbps": gbps, "p50_gbps": gbps, "p50_us": 1.0,
            "baseline": baseline}
    if ratio is not None:
        cell["ratio_p50"] = ratio
    return cell


def _baseline(name: str, path: str, op: str, block: int, gbps: float) -> dict[str, Any]:
    return {"kind": "baseline", "name": name, "path": path, "op": op, "mode": "sync",
            "block": block, "batch": 1, "gbps": gbps, "p50_gbps": gbps, "p50_us": 1.0}


def _target(name: str, path: str, block: int, limit: float) -> dict[str, Any]:
    return {"target": name, "path": path, "op": "read", "mode": "sync", "layout": "whole",
            "block": block, "batch": 1, "metric": "ratio_p50", "value": 1.0, "limit": limit,
            "met": True}


def test_plot_draws_each_path_against_its_baseline_and_target(tmp_path: Path) -> None:
    fabric_target = "fabric >= 1 MiB: >= 0.85x memcpy"
    socket_target = "socket >= 1 MiB: >= 0.7x raw stream"
    report = {"across_nodes": False, "agent": "127.0.0.1:1", "host": {"cpus": 2}, "cells": [
        _engine("fabric", 64 * KIB, 1, 5.0, 0.5), _engine("fabric", MIB, 1, 9.0, 0.9),
        _engine("fabric", 4 * MIB, 1, 9.5, 0.95),
        _engine("fabric", 4 * KIB, 256, 3.0), _engine("fabric", 64 * KIB, 16, 6.0),
        {**_engine("fabric", 4 * KIB, 256, 4.0), "api": "arrays"},
        _engine("fabric", MIB, 1, 99.0, 9.9, mode="async"),
        _baseline("memcpy", "fabric", "copy", 64 * KIB, 10.0),
        _baseline("memcpy", "fabric", "copy", MIB, 10.0),
        _baseline("memcpy", "fabric", "copy", 4 * MIB, 10.0),
        _engine("socket", MIB, 1, 2.0, 0.8, baseline="raw-unix"),
        _engine("socket", 4 * MIB, 1, 2.4, 0.8, baseline="raw-unix"),
        _baseline("raw-unix", "socket", "read", MIB, 2.5),
        _baseline("raw-unix", "socket", "read", 4 * MIB, 3.0)],
        "targets": [_target(fabric_target, "fabric", MIB, 0.85),
                    _target(fabric_target, "fabric", 4 * MIB, 0.85),
                    _target(socket_target, "socket", MIB, 0.7),
                    _target(socket_target, "socket", 4 * MIB, 0.7)]}
    png = tmp_path / "bench.png"
    fabric, socket_ = plot_report(report, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert fabric.title == "fabric path (mapped memory): synchronous calls"
    assert socket_.title == "socket path (unix socket): synchronous calls"
    lines = {line.label: line for line in fabric.lines}
    assert lines["hixl read, batch 1"].points == [(64 * KIB, 5.0), (MIB, 9.0), (4 * MIB, 9.5)]
    # unlike batched shapes are lines of their own, never one line through both
    assert lines["hixl read, x256 per call"].points == [(4 * KIB, 3.0)]
    assert lines["hixl read, x16 per call"].points == [(64 * KIB, 6.0)]
    assert lines["hixl read (arrays), x256 per call"].points == [(4 * KIB, 4.0)]
    assert lines["hixl read, batch 1"].ratios == [(64 * KIB, 5.0, 0.5), (MIB, 9.0, 0.9),
                                                  (4 * MIB, 9.5, 0.95)]
    assert lines["memcpy (baseline copies, batch 1)"].points == [
        (64 * KIB, 10.0), (MIB, 10.0), (4 * MIB, 10.0)]
    assert lines[f"target: {fabric_target}"].points == [(MIB, 8.5), (4 * MIB, 8.5)]
    assert all(99.0 not in [g for _, g in line.points] for line in fabric.lines)  # no async
    socket_lines = {line.label: line for line in socket_.lines}
    assert socket_lines[f"target: {socket_target}"].points == [(MIB, 2.5 * 0.7),
                                                              (4 * MIB, 3.0 * 0.7)]
    assert "raw-unix (baseline reads, batch 1)" in socket_lines
    assert fabric.legend_outside and socket_.legend_outside
