"""What every dashboard shares: the datasource and template variables, the node join,
panel builders that always set a unit and a datasource, and a row-packing layout.

Pure: builds grafanalib objects, reads and writes nothing.

Node names: agent series carry no `node` label (the scrape target adds `instance`); the
agent's `rankguard_agent_info{node}` names the node, and the recording rule
`rankguard:agent_node:info` (one series per instance) is what panels join on, the
node_exporter `node_uname_info` pattern.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from grafanalib.core import (
    Annotations,
    Dashboard,
    DashboardLink,
    GridPos,
    Heatmap,
    Stat,
    Table,
    Target,
    Template,
    Templating,
    Time,
    TimeSeries,
)

from ..contract.metrics import JOB_LABEL, NODE_LABEL, RANK_INFO, RANK_LABELS, RANK_UP

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRID_WIDTH = 24
TAG = "rankguard"

# Scrape job names of the example prometheus.yml; rules and panels select on them.
AGENT_JOB = "rankguard-agent"
SUPERVISOR_JOB = "rankguard-supervisor"

# Label matchers for the template variables (the label names are the contract's; the
# variables are named after them).
JOB = f'{JOB_LABEL}=~"${JOB_LABEL}"'
NODE_INFO = f'rankguard:agent_node:info{{{NODE_LABEL}=~"${NODE_LABEL}"}}'


TOKENS_PER_SECOND = "suffix: tok/s"  # Grafana's custom-unit syntax: no built-in unit fits


def with_node(expr: str) -> str:
    """Attach `node` to per-instance agent series and filter by the $node variable."""
    return f"({expr}) * on (instance) group_left (node) {NODE_INFO}"


def live(expr: str) -> str:
    """Keep series of ranks whose process is alive (a dead rank keeps its last values
    until the agent forgets it)."""
    return f"(({expr}) and on (instance, {', '.join(RANK_LABELS)}) ({RANK_UP} == 1))"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""
    instant: bool = False
    table: bool = False  # Grafana's "table" format (one row per series)


def _targets(queries: Sequence[Query]) -> list[Target]:
    return [
        Target(
            expr=q.expr,
            legendFormat=q.legend,
            refId=chr(ord("A") + i),
            instant=q.instant,
            format="table" if q.table else "time_series",
            datasource=DATASOURCE,
            intervalFactor=1,
        )
        for i, q in enumerate(queries)
    ]


def _basics(title: str, description: str, queries: Sequence[Query]) -> dict:
    """What every panel builder passes alike: the text and the queries on $datasource."""
    return {
        "title": title,
        "description": description,
        "dataSource": DATASOURCE,
        "targets": _targets(queries),
    }


@dataclass(frozen=True)
class Cell:
    """A panel and its size; `layout` gives positions and ids."""

    panel: object
    width: int
    height: int = 8


def timeseries(
    title: str,
    queries: Sequence[Query],
    unit: str,
    *,
    width: int = 12,
    height: int = 8,
    description: str = "",
    stacked: bool = False,
    bars: bool = False,
    max_value: float | None = None,
    thresholds: Sequence[tuple[str, float | None]] = (),
) -> Cell:
    extra: dict = {"fieldConfig": {"defaults": {}}}
    if max_value is not None:
        extra["fieldConfig"]["defaults"]["max"] = max_value
        extra["fieldConfig"]["defaults"]["min"] = 0
    if thresholds:
        # Draw the operating target as a dashed line.
        extra["fieldConfig"]["defaults"]["custom"] = {"thresholdsStyle": {"mode": "dashed"}}
    panel = TimeSeries(
        **_basics(title, description, queries),
        unit=unit,
        stacking={"mode": "normal", "group": "A"} if stacked else {"mode": "none"},
        fillOpacity=60 if stacked or bars else 10,
        drawStyle="bars" if bars else "line",
        legendDisplayMode="table" if len(queries) > 1 or stacked else "list",
        legendCalcs=["lastNotNull", "max"],
        tooltipMode="multi",
        thresholds=_steps(thresholds),
        extraJson=extra,
    )
    return Cell(panel, width, height)


def stat(
    title: str,
    queries: Sequence[Query],
    unit: str,
    *,
    width: int = 4,
    height: int = 4,
    description: str = "",
    thresholds: Sequence[tuple[str, float | None]] = (("green", None),),
    text_mode: str = "auto",
    decimals: int | None = None,
) -> Cell:
    panel = Stat(
        **_basics(title, description, queries),
        format=unit,
        decimals=decimals,
        reduceCalc="lastNotNull",
        graphMode="none",
        colorMode="value",
        textMode=text_mode,
        thresholds=_steps(thresholds),
    )
    return Cell(panel, width, height)


def table(
    title: str,
    queries: Sequence[Query],
    unit: str,
    *,
    width: int = 12,
    height: int = 8,
    description: str = "",
    hide_columns: Iterable[str] = ("Time",),
    rename: dict[str, str] | None = None,
) -> Cell:
    panel = Table(
        **_basics(title, description, queries),
        unit=unit,
        transformations=[
            {"id": "merge", "options": {}},
            {
                "id": "organize",
                "options": {
                    "excludeByName": dict.fromkeys(hide_columns, True),
                    "renameByName": rename or {},
                },
            },
        ],
    )
    return Cell(panel, width, height)


def heatmap(
    title: str,
    query: Query,
    unit: str,
    *,
    width: int = 12,
    height: int = 10,
    description: str = "",
    max_value: float | None = 1.0,
) -> Cell:
    """One row per series (a GPU), colour for the value: readable for hundreds of GPUs,
    where one line per GPU is not. Grafana's heatmap with `calculate: false` over
    series-as-buckets data."""
    panel = Heatmap(
        **_basics(title, description, [query]),
        dataFormat="tsbuckets",
        hideZeroBuckets=False,
        extraJson={
            "fieldConfig": {"defaults": {"unit": unit}},
            "options": {
                "calculate": False,
                "cellGap": 1,
                "color": {"mode": "scheme", "scheme": "RdYlGn", "reverse": False,
                          "min": 0, **({"max": max_value} if max_value is not None else {})},
                "yAxis": {"axisPlacement": "left"},
                "rowsFrame": {"layout": "auto"},
                "tooltip": {"show": True, "yHistogram": False},
                "legend": {"show": True},
                "cellValues": {"unit": unit},
            },
        },
    )  # fmt: skip
    return Cell(panel, width, height)


def _steps(thresholds: Sequence[tuple[str, float | None]]) -> list[dict]:
    """[("green", None), ("red", 0.9)] -> Grafana threshold steps (the first is the base)."""
    if not thresholds:
        return [{"color": "green", "value": None}]
    return [{"color": c, "value": v} for c, v in thresholds]


def layout(rows: Sequence[Sequence[Cell]]) -> list:
    """Place cells left to right, a new line when a row is full or ends; ids in order."""
    panels, pid, y = [], 1, 0
    for row in rows:
        x, line_height = 0, 0
        for cell in row:
            if x + cell.width > GRID_WIDTH:
                x, y = 0, y + line_height
                line_height = 0
            cell.panel.gridPos = GridPos(h=cell.height, w=cell.width, x=x, y=y)
            cell.panel.id = pid
            pid += 1
            panels.append(cell.panel)
            x += cell.width
            line_height = max(line_height, cell.height)
        y += line_height
    return panels


def templating() -> Templating:
    """$datasource, $training_job and $node, the same on every dashboard so links between
    them keep the selection."""
    query_ds = {"type": "prometheus", "uid": "${datasource}"}
    return Templating(
        [
            Template(name="datasource", label="Data source", query="prometheus",
                     type="datasource", default="Prometheus"),
            Template(name=JOB_LABEL, label="Training job",
                     query=f"label_values({RANK_INFO}, {JOB_LABEL})",
                     dataSource=query_ds, includeAll=True, multi=True, allValue=".*",
                     refresh=2, sort=1, default="$__all"),
            Template(name="node", label="Node",
                     query="label_values(rankguard:agent_node:info, node)",
                     dataSource=query_ds, includeAll=True, multi=True, allValue=".*",
                     refresh=2, sort=1, default="$__all"),
        ]
    )  # fmt: skip


def _annotation(name: str, colour: str, counter: str, *, title: str, text: str) -> dict:
    """A mark wherever the supervisor's `counter` (labelled by `kind`) went up."""
    return {
        "name": name,
        "datasource": DATASOURCE,
        "enable": True,
        "iconColor": colour,
        "expr": f"sum by (kind) (increase({counter}[$__interval])) > 0",
        "step": "30s",
        "titleFormat": title,
        "textFormat": text,
        "useValueForTime": False,
    }


def annotations(extra: Sequence[dict] = ()) -> Annotations:
    """Incidents and restarts the supervisor recorded, as marks on every time axis."""
    base = [
        _annotation(
            "Incidents",
            "red",
            "rankguard_supervisor_incidents_total",
            title="incident: {{kind}}",
            text="supervisor recorded a {{kind}} incident",
        ),
        _annotation(
            "Restarts",
            "orange",
            "rankguard_supervisor_restarts_total",
            title="restart after {{kind}}",
            text="the job restarted after a {{kind}} incident",
        ),
    ]
    return Annotations(list=base + list(extra))


def dashboard(uid: str, title: str, description: str, rows: Sequence[Sequence[Cell]]) -> Dashboard:
    return Dashboard(
        uid=uid,
        title=title,
        description=description,
        tags=[TAG],
        timezone="browser",
        refresh="30s",
        time=Time("now-1h", "now"),
        templating=templating(),
        annotations=annotations(),
        links=[
            DashboardLink(
                title="rankguard",
                type="dashboards",
                tags=[TAG],
                asDropdown=True,
                keepTime=True,
                includeVars=True,
            )
        ],  # fmt: skip
        panels=layout(rows),
    ).auto_panel_ids()
