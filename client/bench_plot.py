"""`hixl bench --plot FILE.png`: throughput and latency against block size, per path.

One column per path (fabric, socket), each drawn with the baselines it is judged against
(memcpy on the fabric path; the raw stream and Mooncake on the socket path). A series is
the same thing measured at different block sizes: solid lines are batch-1 calls, dashed
lines batched calls; hixl's lines are thick, baselines thin. Only synchronous cells are
drawn (async cells add nothing to the shape and crowd the plot; `--json` has them).
Needs matplotlib (`pip install 'hixl[plot]'`), imported lazily so the bench never needs it.
"""

from __future__ import annotations

import os
from collections import defaultdict
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


def plot_report(report: dict[str, Any], path: str) -> None:
    """Draw the report into a PNG at `path`: a column per path, GB/s above, p50 latency below."""
    check_plot_target(path)
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt

    from hixl.client.bench import human_size

    data = series(report)
    if not data:
        raise ConfigError("--plot: the report has no synchronous cells to draw")
    names = sorted({name for _, name, _ in data})
    colour = {name: plt.get_cmap("tab20")(i % 20) for i, name in enumerate(names)}
    paths = [p for p in PATHS if any(line_path == p for line_path, _, _ in data)]
    fig, axes = plt.subplots(2, len(paths), figsize=(7 * len(paths), 9), squeeze=False)
    for column, drawn in enumerate(paths):
        rate_ax, latency_ax = axes[0][column], axes[1][column]
        blocks = sorted({b for (p, _, _), values in data.items() if p == drawn
                         for b, _, _ in values})
        for (line_path, name, batched), values in sorted(data.items()):
            if line_path != drawn:
                continue
            style = {"color": colour[name], "linestyle": "--" if batched else "-",
                     "linewidth": 2.2 if name.startswith("hixl") else 1.0,
                     "marker": "s" if batched else "o", "markersize": 4,
                     "label": f"{name} ({'batched' if batched else 'batch 1'})"}
            xs = [block for block, _, _ in values]
            rate_ax.plot(xs, [gbps for _, gbps, _ in values], **style)
            latency_ax.plot(xs, [p50 for _, _, p50 in values], **style)
        rate_ax.set_title(f"{drawn} path: throughput")
        rate_ax.set_ylabel("GB/s")
        latency_ax.set_title(f"{drawn} path: p50 latency per call")
        latency_ax.set_ylabel("µs")
        latency_ax.set_yscale("log")
        latency_ax.set_xlabel("block size")
        for ax in (rate_ax, latency_ax):
            ax.set_xscale("log", base=2)
            ax.set_xticks(blocks, [human_size(b) for b in blocks])
            ax.minorticks_off()
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    where = "across nodes" if report.get("across_nodes") else "one node"
    fig.suptitle(f"hixl bench ({where}, agent {report.get('agent', '?')}, "
                 f"{report.get('host', {}).get('cpus', '?')} CPUs)")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise ConfigError(f"--plot: cannot write {path!r}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
