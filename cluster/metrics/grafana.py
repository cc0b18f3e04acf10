"""Render dashboard.py's rows and panels into Grafana dashboard JSON with grafana-foundation-sdk.

Decision: Grafana's own foundation SDK (generated from Grafana's schemas) rather than grafanalib or
hand-written JSON, so field names and defaults follow Grafana's schema. It is a generation-time
dependency (the `test` extra: the staleness test regenerates the JSON); nothing at run time
imports this module.
"""

from __future__ import annotations

import json
from typing import Any

from grafana_foundation_sdk.builders import dashboard as gd
from grafana_foundation_sdk.builders import heatmap, prometheus, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import prometheus as prom_models
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    DataSourceRef,
    VariableRefresh,
    VariableSort,
)

from cluster.metrics.dashboard import ROWS, VARIABLES, Panel

UID = "raytp-overview"
TITLE = "raytp"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${datasource}")
PANEL_WIDTH, PANEL_HEIGHT = 12, 8  # two panels per row of the grid


def _panel(p: Panel, panel_id: int) -> Any:
    builder: Any = heatmap.Panel() if p.kind == "heatmap" else timeseries.Panel()
    builder = (
        builder.id(panel_id)
        .title(p.title)
        .description(p.description)
        .datasource(DATASOURCE)
        .span(PANEL_WIDTH)
        .height(PANEL_HEIGHT)
    )
    if p.kind == "heatmap":
        # Prometheus already bucketed the data: draw its buckets (le) rather than re-bucketing.
        builder = (
            builder.calculate(False)
            .rows_frame(heatmap.RowsHeatmapOptions().layout(common.HeatmapCellLayout.LE))
            .show_tooltip()
            .show_y_histogram()
        )
    else:
        builder = builder.unit(p.unit).fill_opacity(10).show_points(common.VisibilityMode.NEVER)
    for i, t in enumerate(p.targets):
        query = prometheus.Dataquery().expr(t.expr).legend_format(t.legend).ref_id(chr(ord("A") + i)).range()
        if p.kind == "heatmap":
            query = query.format(prom_models.PromQueryFormat.HEATMAP)
        builder = builder.with_target(query)
    return builder


def _query_variable(name: str, query: str) -> gd.QueryVariable:
    return (
        gd.QueryVariable(name)
        .label(name)
        .query(query)
        .datasource(DATASOURCE)
        .multi(True)
        .include_all(True)
        .all_value(".*")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
    )


def build_dashboard() -> dict[str, Any]:
    board = (
        gd.Dashboard(TITLE)
        .uid(UID)
        .description("raytp engine, Ray Serve HTTP and batch metrics. Generated from cluster/metrics; do not edit.")
        .tags(["raytp", "llm", "ray"])
        .editable()
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .refresh("30s")
        .time("now-1h", "now")
        .timezone("browser")
        .with_variable(gd.DatasourceVariable("datasource").label("Data source").type("prometheus"))
    )
    for name, query in VARIABLES.items():
        board = board.with_variable(_query_variable(name, query))
    panel_id = 1
    for row in ROWS:
        board = board.with_row(gd.Row(row.title).id(panel_id))
        panel_id += 1
        for p in row.panels:
            board = board.with_panel(_panel(p, panel_id))
            panel_id += 1
    encoded: dict[str, Any] = json.loads(JSONEncoder(sort_keys=True).encode(board.build()))
    return encoded


def dashboard_json() -> str:
    """The committed file's exact text (stable: sorted keys, two-space indent, final newline)."""
    return json.dumps(build_dashboard(), indent=2, sort_keys=True) + "\n"
