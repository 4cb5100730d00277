"""`hixl bench --plot FILE.png`: does each path reach its target? GB/s against block size.

One panel per path (fabric; socket, named by its transport: unix socket or TCP), each
with the baselines it is judged against (memcpy on the fabric path; the raw stream and
Mooncake on the socket path) as thin grey lines and the report's ratio targets as red
dotted lines (limit x baseline). hixl's lines are thick: one per op, layout and batch
size and API (list or arrays: batched points of unlike shapes are never joined), with the ratio to the baseline
printed at each batch-1 point. GB/s is at the median call, what the targets use. Only
synchronous calls are drawn (named so; `--json` has the async cells); the legend sits
beside the data, never on it.
Needs matplotlib (`pip install 'hixl[plot]'`), imported lazily so the bench never needs it.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from hixl.errors import ConfigError

PATHS = ("fabric", "socket")
# (path, series name, batched?) -> sorted [(block, GB/s, p50 µs)]
Series = dict[tuple[str, str, bool], list[tuple[int, float, float]]]


def series(report: dict[str, Any]) -> Series:
    """The report's synchronous cells grouped into lines (see the module docstring)."""
    points: dict[tuple[str, str, bool], list[tuple[int, float, float]]] = defaultdict(list)
    for cell in report["cells"]:
        if cell.get("mode", "sync") != "sync" or cell.get("path") not in PATHS:
            continue
        if cell["kind"] == "engine":
            layout = cell.get("layout", "whole")
            name = f"hixl {cell['op']}" + (f" ({layout})" if layout != "whole" else "")
        elif cell["kind"] == "baseline":
            name = f"{cell['name']} {cell['op']}" if "op" in cell else cell["name"]
        else:
            continue
        points[(cell["path"], name, cell["batch"] > 1)].append(
            (cell["block"], cell["gbps"], cell["p50_us"]))
    return {key: sorted(values) for key, values in points.items()}


def check_plot_target(path: str) -> None:
    """Refuse --plot before a long run, not after: matplotlib missing, or nowhere to write."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'hixl[plot]'") from None
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ConfigError(f"--plot: cannot write {path!r}: {folder} is not a writable directory")


#: thin lines for what hixl is judged against, by path
BASELINES = {"fabric": ("memcpy",), "socket": ("raw-unix", "raw-tcp", "mooncake")}
_ROUTE_NAMES = {"unix": "unix socket", "tcp": "TCP"}


@dataclass
class Line:
    """One drawn line: its label, points (block, GB/s at the median call), how it looks."""

    label: str
    points: list[tuple[int, float]]
    style: dict[str, Any]
    ratios: list[tuple[int, float, float]] = field(default_factory=list)  # block, GB/s, x


@dataclass
class Panel:
    """One path's panel: its title and lines (what plot_report drew, for tests too)."""

    path: str
    title: str
    lines: list[Line] = field(default_factory=list)
    legend_outside: bool = False


def panels(report: dict[str, Any]) -> list[Panel]:
    """What to draw: per path, hixl's synchronous cells (a line per op, layout, API and
    batch size, so batched points of unlike shapes are never joined), its baselines, and each
    ratio target of the report as the line it sets (limit x baseline)."""
    cells = [c for c in report["cells"] if c.get("mode", "sync") == "sync"]
    found = []
    for path in PATHS:
        engine = [c for c in cells if c["kind"] == "engine" and c["path"] == path]
        if not engine:
            continue
        routes = sorted({str(c.get("route", "")).split(" ", 1)[0] for c in engine} - {""})
        via = ", ".join(_ROUTE_NAMES.get(r, r) for r in routes) if path == "socket" else \
            "mapped memory"
        panel = Panel(path, f"{path} path ({via}): synchronous calls")
        groups: dict[tuple[str, str, str, int], list[dict[str, Any]]] = defaultdict(list)
        for cell in engine:
            groups[(cell["op"], cell.get("layout", "whole"), cell.get("api", "list"),
                    cell["batch"])].append(cell)
        for (op, layout, api, batch), group in sorted(groups.items()):
            group.sort(key=lambda c: c["block"])
            shape = [part for part in (layout if layout != "whole" else "",
                                       api if api != "list" else "") if part]
            name = f"hixl {op}" + (f" ({', '.join(shape)})" if shape else "")
            panel.lines.append(Line(
                f"{name}, {'batch 1' if batch == 1 else f'x{batch} per call'}",
                [(c["block"], c["p50_gbps"]) for c in group],
                {"linewidth": 2.2, "marker": "o" if batch == 1 else "s", "markersize": 4,
                 "linestyle": "-" if batch == 1 else "--"},
                [(c["block"], c["p50_gbps"], c["ratio_p50"]) for c in group
                 if batch == 1 and "ratio_p50" in c]))
        for name in BASELINES[path]:
            base = _baseline_points(cells, path, name)
            if base:
                what = "copies" if name == "memcpy" else "reads"
                panel.lines.append(Line(f"{name} (baseline {what}, batch 1)", base,
                                        {"linewidth": 1.0, "color": "0.45", "marker": ".",
                                         "linestyle": "-"}))
        panel.lines += _target_lines(report, cells, path, engine)
        found.append(panel)
    return found


def _baseline_points(cells: list[dict[str, Any]], path: str, name: str) -> list[tuple[int, float]]:
    """A baseline's batch-1 reads (memcpy: its copies) as (block, GB/s at the median)."""
    return sorted((c["block"], c["p50_gbps"]) for c in cells
                  if c["kind"] == "baseline" and c["path"] == path and c["name"] == name
                  and c["batch"] == 1 and c.get("op", "read") in ("read", "copy"))


def _target_lines(report: dict[str, Any], cells: list[dict[str, Any]], path: str,
                  engine: list[dict[str, Any]]) -> list[Line]:
    """Each batch-1 ratio target of `path` as a line: its limit x the baseline its cells
    are compared with (the cells' `baseline`), over the blocks it applies to."""
    baselines = sorted({c["baseline"] for c in engine if "baseline" in c})
    lines: dict[str, Line] = {}
    for target in report.get("targets", []):
        if (target["path"], target["metric"], target["batch"]) != (path, "ratio_p50", 1):
            continue
        for name in baselines:
            base = dict(_baseline_points(cells, path, name))
            if target["block"] not in base:
                continue
            label = f"target: {target['target']}"
            line = lines.setdefault(label, Line(label, [], {"linewidth": 1.2, "color": "red",
                                                            "linestyle": ":"}))
            point = (target["block"], base[target["block"]] * target["limit"])
            if point not in line.points:
                line.points.append(point)
    for line in lines.values():
        line.points.sort()
    return list(lines.values())


def plot_report(report: dict[str, Any], path: str) -> list[Panel]:
    """Draw the report into a PNG at `path`: a panel per path, GB/s at the median call
    against block size, hixl's lines with their ratio to the baseline printed at each
    point, the baselines and the targets as lines, the legend beside the data."""
    check_plot_target(path)
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    from hixl.tools.bench import human_size

    drawn = panels(report)
    if not drawn:
        raise ConfigError("--plot: the report has no synchronous cells to draw")
    fig, axes = plt.subplots(len(drawn), 1, figsize=(11, 5 * len(drawn)), squeeze=False)
    for panel, ax in zip(drawn, (row[0] for row in axes), strict=True):
        blocks = sorted({b for line in panel.lines for b, _ in line.points})
        for line in panel.lines:
            ax.plot([b for b, _ in line.points], [g for _, g in line.points],
                    label=line.label, **line.style)
            for block, gbps, ratio in line.ratios:
                ax.annotate(f"{ratio:.2f}x", (block, gbps), textcoords="offset points",
                            xytext=(0, 6), ha="center", fontsize=7)
        ax.set_title(panel.title)
        ax.set_ylabel("GB/s (median call)")
        ax.set_xlabel("block size")
        ax.set_xscale("log", base=2)
        ax.set_xticks(blocks, [human_size(b) for b in blocks])
        ax.minorticks_off()
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    where = "across nodes" if report.get("across_nodes") else "one node"
    fig.suptitle(f"hixl bench ({where}, agent {report.get('agent', '?')}, "
                 f"{report.get('host', {}).get('cpus', '?')} CPUs): ratios are hixl / "
                 "baseline at the median call; async cells are in --json")
    fig.tight_layout()
    fig.canvas.draw()
    for panel, ax in zip(drawn, (row[0] for row in axes), strict=True):
        legend = ax.get_legend().get_window_extent()
        panel.legend_outside = legend.x0 >= ax.get_window_extent().x1
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise ConfigError(f"--plot: cannot write {path!r}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return drawn
