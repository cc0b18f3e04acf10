"""Draw what raytp's Grafana dashboard would show, from a live Prometheus, into one PNG.

    python benchmarks/dashboard_preview.py --prometheus http://localhost:9090 --out dashboard.png
    python benchmarks/dashboard_preview.py --prometheus ... --minutes 30 --model-name my-model

Every panel of the generated dashboard (tools/monitoring/dashboard.py, the same queries as the
committed JSON) is queried over the time range with Grafana's variables substituted, and drawn
in the dashboard's order: time series as lines (legend as the dashboard formats it), heatmaps as
le-bucket x time grids. A panel with no data is drawn with a red "NO DATA" so blanks stand out;
their titles are printed too. Needs matplotlib (the `dev` extra).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tools.monitoring.dashboard import ROWS, Panel, substitute  # noqa: E402

COLUMNS = 3


def query_range(prom_url: str, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step})
    with urllib.request.urlopen(f"{prom_url.rstrip('/')}/api/v1/query_range?{params}", timeout=60) as resp:
        answer = json.load(resp)
    if answer["status"] != "success":
        raise ValueError(f"Prometheus refused {expr}: {answer.get('error')}")
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


def legend(fmt: str, labels: dict[str, str]) -> str:
    """Grafana's legend format: {{label}} replaced by the series' label value."""
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)


def _points(series: dict[str, Any], end: float) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for t, v in series["values"]:
        value = float(v)
        if math.isfinite(value):
            xs.append((float(t) - end) / 60.0)
            ys.append(value)
    return xs, ys


def _draw_timeseries(ax: Any, panel: Panel, results: list[list[dict[str, Any]]], end: float) -> bool:
    drawn = False
    for target, result in zip(panel.targets, results, strict=True):
        for series in result:
            xs, ys = _points(series, end)
            if xs:
                ax.plot(xs, ys, label=legend(target.legend, series["metric"]) or target.legend)
                drawn = True
    if drawn:
        ax.legend(fontsize=6, loc="upper left")
    ax.set_ylabel(panel.unit, fontsize=7)
    return drawn


def _draw_heatmap(ax: Any, result: list[dict[str, Any]], end: float) -> bool:
    by_le = sorted(((float(s["metric"].get("le", "inf")), s) for s in result), key=lambda p: p[0])
    times = sorted({float(t) for _, s in by_le for t, _ in s["values"]})
    if not by_le or not times:
        return False
    index = {t: i for i, t in enumerate(times)}
    grid = [[0.0] * len(times) for _ in by_le]
    previous: list[float] = [0.0] * len(times)
    for row, (_, series) in enumerate(by_le):  # cumulative le buckets -> per-bucket counts
        current = [0.0] * len(times)
        for t, v in series["values"]:
            value = float(v)
            current[index[float(t)]] = value if math.isfinite(value) else 0.0
        grid[row] = [max(c - p, 0.0) for c, p in zip(current, previous, strict=True)]
        previous = current
    rows = [i for i, counts in enumerate(grid) if any(counts)]
    if not rows:
        return False
    lo, hi = max(rows[0] - 1, 0), min(rows[-1] + 2, len(grid))  # the buckets with data, one either side
    xs = [(t - end) / 60.0 for t in times]
    ax.pcolormesh(xs, range(hi - lo), grid[lo:hi], shading="nearest", cmap="viridis")
    ax.set_yticks(range(hi - lo), [f"le {le:g}" for le, _ in by_le[lo:hi]], fontsize=6)
    return True


def render(prom_url: str, out: Path, minutes: float = 15.0, model_name: str = ".*", replica: str = ".*") -> list[str]:
    """Draw every panel into `out`; returns the titles of the panels that had no data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = time.time()
    start = end - minutes * 60
    step = max(minutes * 60 / 240, 1.0)
    rate_interval = f"{max(int(4 * step), 15)}s"  # Grafana's $__rate_interval: at least 4 steps
    panels = [(row.title, p) for row in ROWS for p in row.panels]
    nrows = math.ceil(len(panels) / COLUMNS)
    fig, axes = plt.subplots(nrows, COLUMNS, figsize=(6 * COLUMNS, 3.2 * nrows), squeeze=False)
    empty = []
    for ax, (row_title, panel) in zip(axes.flat, panels, strict=False):
        exprs = [substitute(t.expr, rate_interval, model_name, replica) for t in panel.targets]
        results = [query_range(prom_url, e, start, end, step) for e in exprs]
        if panel.kind == "heatmap":
            drawn = _draw_heatmap(ax, results[0], end)
        else:
            drawn = _draw_timeseries(ax, panel, results, end)
        ax.set_title(f"{row_title} / {panel.title}", fontsize=9)
        ax.tick_params(labelsize=6)
        ax.set_xlabel("minutes ago", fontsize=6)
        if not drawn:
            empty.append(panel.title)
            ax.text(0.5, 0.5, "NO DATA", color="red", ha="center", va="center", transform=ax.transAxes)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(f"raytp dashboard preview: {prom_url}, last {minutes:g} min", fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=72)
    plt.close(fig)
    return empty


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prometheus", default="http://localhost:9090", help="Prometheus base URL")
    parser.add_argument("--out", type=Path, default=Path("raytp-dashboard.png"))
    parser.add_argument("--minutes", type=float, default=15.0, help="time range, ending now")
    parser.add_argument("--model-name", default=".*", help="the $model_name variable (regex; .* = All)")
    parser.add_argument("--replica", default=".*", help="the $replica variable (regex; .* = All)")
    args = parser.parse_args()
    empty = render(args.prometheus, args.out, args.minutes, args.model_name, args.replica)
    print(f"wrote {args.out}")
    for title in empty:
        print(f"no data: {title}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
