"""The report of a run record: one self-contained HTML file that opens offline.

Bokeh draws it, with its JavaScript inlined (``INLINE`` resources), so the file
needs no server and no network: it can be mailed, attached to an issue, or opened
on a cluster's login node. It shows, on one clock:

- a summary: makespan, tasks, retries, recoveries, duplicates that won, spilled bytes;
- a zoomable timeline of every task execution, one row per worker process grouped
  by node, coloured by category; recomputed, retried and duplicated tasks are
  outlined, failures, retries and losses marked, node losses and recovery waves
  drawn across;
- each node's object store over time against its capacity (zoom is linked);
- tasks per category (count, mean and max runtime) and the runtime CDF.

``raydag report RUN_DIR -o report.html`` and ``raydag.performance_report(path)``
(like dask's) write it.
"""

from __future__ import annotations

import html
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raydag import config

if TYPE_CHECKING:
    import pandas as pd

    from raydag.observe.record import RunRecord

logger = logging.getLogger(__name__)

RED = "#d62728"
ORANGE = "#ff7f0e"
PURPLE = "#9467bd"
GREEN = "#2ca02c"
GREY = "#7f7f7f"
CDF_POINTS = 2000  # points per runtime CDF line, at most

# Runs in the page before Bokeh: keeps uncaught errors and console.error calls
# where a test (or a person with the inspector) can find them.
_ERRORS_JS = """<script>
window.__raydag_errors = [];
(function () {
  function keep(what) {
    window.__raydag_errors.push(String(what));
    document.documentElement.setAttribute("data-raydag-errors", window.__raydag_errors.join(" | "));
  }
  window.addEventListener("error", function (e) { keep(e.message); });
  window.addEventListener("unhandledrejection", function (e) { keep(e.reason); });
  const error = console.error.bind(console);
  console.error = function () { keep(Array.from(arguments).join(" ")); error.apply(null, arguments); };
})();
</script>"""

# Runs once Bokeh's document is ready: counts the plot canvases that have pixels
# drawn on them, and says so on <body> (``data-raydag-drawn``), for a headless check.
_READY_JS = """
function drawn() {
  const found = [];
  const walk = (root) => {
    for (const el of root.querySelectorAll("*")) {
      if (el.tagName === "CANVAS" && el.width > 0 && el.height > 0) found.push(el);
      if (el.shadowRoot) walk(el.shadowRoot);
    }
  };
  walk(document);
  let n = 0;
  for (const c of found) {
    try {
      const px = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
      for (let i = 3; i < px.length; i += 4 * 97) {
        if (px[i] > 0 && (px[i - 3] < 250 || px[i - 2] < 250 || px[i - 1] < 250)) { n++; break; }
      }
    } catch (e) { console.error("raydag report: cannot read a canvas: " + e); }
  }
  return [found.length, n];
}
function check(tries) {
  const [canvases, painted] = drawn();
  document.body.setAttribute("data-raydag-canvases", String(canvases));
  document.body.setAttribute("data-raydag-drawn", String(painted));
  if (painted < expected && tries > 0) { setTimeout(() => check(tries - 1), 100); return; }
  window.__raydag_ok = painted >= expected;
  document.body.setAttribute("data-raydag-ok", String(window.__raydag_ok));
}
setTimeout(() => check(50), 50);
"""


def _missing(x: Any) -> bool:
    import pandas as pd

    return x is None or bool(pd.isna(x))


def _fmt_bytes(n: float | None) -> str:
    if _missing(n):
        return "-"
    n = float(n)  # type: ignore[arg-type]
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _fmt_s(s: float | None) -> str:
    if _missing(s):
        return "-"
    s = float(s)  # type: ignore[arg-type]
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    if s < 120:
        return f"{s:.2f} s"
    return f"{s / 60:.1f} min"


def _time_unit(largest: float) -> tuple[str, float]:
    """A unit that keeps axis labels short, and the factor from seconds to it."""
    if largest < 2e-3:
        return "microseconds", 1e6
    if largest < 2:
        return "milliseconds", 1e3
    return "seconds", 1.0


def _palette(n: int) -> list[str]:
    from bokeh.palettes import Category10, Category20

    if n <= 10:
        return list(Category10[10])[:n]
    return [Category20[20][i % 20] for i in range(n)]


def _source(df: pd.DataFrame) -> Any:
    """A ColumnDataSource of plain columns (Bokeh's DataFrame path warns on pandas 3)."""
    from bokeh.models import ColumnDataSource

    return ColumnDataSource(
        {c: list(df[c]) if df[c].dtype == object else df[c].to_numpy() for c in df.columns}
    )


def _node_label(node: Any) -> str:
    return f"node {str(node)[:8]}" if node else "node ?"


# ---- the parts ----------------------------------------------------------------------


def _summary_div(rec: RunRecord, summary: dict[str, Any], title: str) -> Any:
    from bokeh.models import Div

    runs = rec.meta.get("runs", [rec.meta])
    status = summary["status"]
    colour = {"ok": GREEN, "failed": RED, "aborted": ORANGE}.get(status, GREY)
    cells = [
        ("status", f'<b style="color:{colour}">{html.escape(status)}</b>'),
        ("makespan", _fmt_s(summary["makespan_s"])),
        ("computes", str(summary["computes"])),
        ("tasks in the graphs", f"{summary['tasks']:,}"),
        ("task executions", f"{summary['executions']:,}"),
        ("retries", f"{summary['retries']:,}"),
        ("failures", f"{summary['failures']:,}"),
        ("nodes lost", f"{summary['nodes_lost']:,}"),
        (
            "recoveries",
            f"{summary['recovery_waves']} waves, {summary['recomputed']:,} tasks recomputed",
        ),
        ("duplicates that won", f"{summary['duplicates_won']} of {summary['duplicates']}"),
        ("cancelled", f"{summary['cancelled']:,}"),
        ("bytes made", _fmt_bytes(summary["bytes_made"])),
        ("peak in the stores", _fmt_bytes(summary["peak_store_bytes"])),
        ("bytes spilled", _fmt_bytes(summary["bytes_spilled"])),
    ]
    items = "".join(
        f'<div class="card"><div class="k">{html.escape(k)}</div><div class="v">{v}</div></div>'
        for k, v in cells
    )
    errors = [r.get("error") for r in runs if r.get("error")]
    err = "".join(f'<pre class="err">{html.escape(str(e))[:2000]}</pre>' for e in errors)
    first = runs[0] if runs else {}
    versions = first.get("versions", {})
    sub = ", ".join(f"{k} {v}" for k, v in versions.items())
    started = html.escape(str(rec.meta.get("started_at", "")))
    return Div(
        text=f"""
<style>
.rd h1 {{ font: 600 22px sans-serif; margin: 4px 0; }}
.rd .sub {{ font: 12px sans-serif; color: #555; margin-bottom: 8px; }}
.rd .cards {{ display: flex; flex-wrap: wrap; gap: 8px; }}
.rd .card {{ border: 1px solid #ddd; border-radius: 6px; padding: 6px 10px; min-width: 120px; }}
.rd .k {{ font: 11px sans-serif; color: #666; }}
.rd .v {{ font: 600 16px sans-serif; }}
.rd .err {{ color: {RED}; white-space: pre-wrap; font-size: 12px; }}
</style>
<div class="rd"><h1>{html.escape(title)}</h1>
<div class="sub">started {started}; {html.escape(sub)}</div>
<div class="cards">{items}</div>{err}</div>""",
        sizing_mode="stretch_width",
    )


def _label(x: float, y: float, text: str, colour: str, x_range: Any) -> Any:
    """A note beside a vertical line: to its right, or its left near the plot's end."""
    from bokeh.models import Label

    left = x > x_range.start + 0.6 * (x_range.end - x_range.start)
    return Label(
        x=x,
        y=y,
        y_units="screen",
        text=f"{text} " if left else f" {text}",
        text_align="right" if left else "left",
        text_color=colour,
        text_font_size="11px",
        background_fill_color="white",
        background_fill_alpha=0.7,
    )


def _rows(tasks: pd.DataFrame, has_driver_row: bool) -> list[tuple[str, str]]:
    """Timeline rows: (node, worker) in order of first start, and the driver's row."""
    rows: list[tuple[str, str]] = []
    if len(tasks):
        first = tasks.groupby(["node_label", "worker_label"], sort=False).start.min()
        node_first = first.groupby(level=0).min().sort_values()
        for node in node_first.index:
            workers = first.loc[node].sort_values()
            rows.extend((node, w) for w in workers.index)
    if has_driver_row:
        rows.append(("driver", "events"))
    return rows


def _timeline(
    rec: RunRecord, tasks: pd.DataFrame, colours: dict[str, str], x_range: Any
) -> tuple[Any, int]:
    from bokeh.models import ColumnDataSource, FactorRange, HoverTool, Span
    from bokeh.plotting import figure

    ev = rec.events
    marks = ev[ev.event.isin(["failed", "retried", "cancelled", "lost"])]
    rows = _rows(tasks, has_driver_row=len(marks) > 0)
    height = int(min(1100, max(380, 22 * len(rows) + 200)))
    shown = _drawn(tasks, int(config.get("record.report-timeline-tasks")))
    what = "Tasks over time, per worker process and node (drag to pan, wheel to zoom)"
    if len(shown) < len(tasks):
        what += (
            f": {len(shown):,} of {len(tasks):,} task executions drawn (retried, "
            "recomputed and duplicated ones first, evenly sampled)"
        )
    tasks = shown
    p = figure(
        title=what,
        y_range=FactorRange(*reversed(rows)) if rows else FactorRange(("none", "none")),
        x_range=x_range,
        height=height,
        sizing_mode="stretch_width",
        tools="xpan,xwheel_zoom,box_zoom,reset,save",
        active_scroll="xwheel_zoom",
        active_drag="xpan",
        x_axis_label="seconds since the start",
        output_backend="canvas",
    )
    p.yaxis.group_label_orientation = "horizontal"
    p.ygrid.grid_line_color = None
    if len(tasks):
        data = tasks.assign(
            row=list(zip(tasks.node_label, tasks.worker_label, strict=True)),
            colour=[colours.get(c, GREY) for c in tasks.category],
            size=[_fmt_bytes(b) for b in tasks.nbytes],
            took=[_fmt_s(d) for d in tasks.duration],
        )
        cols = ["row", "start", "end", "colour", "key", "category", "size", "took", "attempt"]
        cols += ["wave", "node_label", "worker_label", "duplicate", "won", "group"]
        src = _source(data[cols])
        bars = p.hbar(
            y="row",
            left="start",
            right="end",
            height=0.8,
            fill_color="colour",
            line_color=None,
            source=src,
            legend_field="category",
        )
        p.add_tools(
            HoverTool(
                renderers=[bars],
                tooltips=[
                    ("key", "@key"),
                    ("category", "@category"),
                    ("where", "@node_label, pid @worker_label"),
                    ("start", "@start{0.000} s"),
                    ("ran", "@took"),
                    ("value", "@size"),
                    ("attempt / wave", "@attempt / @wave"),
                    ("group", "@group"),
                ],
            )
        )
        for mask, colour, label, dash in (
            (data.wave > 0, RED, "recomputed after a loss", "solid"),
            (data.attempt > 0, ORANGE, "retry", "dashed"),
            (data.duplicate & data.won, PURPLE, "duplicate that won", "solid"),
            (data.duplicate & ~data.won, PURPLE, "duplicate that lost", "dotted"),
        ):
            if mask.any():
                p.hbar(
                    y="row",
                    left="start",
                    right="end",
                    height=0.95,
                    fill_alpha=0.0,
                    line_color=colour,
                    line_width=2,
                    line_dash=dash,
                    source=_source(data.loc[mask, ["row", "start", "end"]]),
                    legend_label=label,
                )
    if len(marks):
        kinds = {  # drawn in this order: failures on top
            "cancelled": ("square_x", GREY, 10),
            "lost": ("circle_x", RED, 10),
            "retried": ("triangle", ORANGE, 12),
            "failed": ("x", RED, 18),
        }
        for kind, (marker, colour, size) in kinds.items():
            m = marks[marks.event == kind]
            if not len(m):
                continue
            src = ColumnDataSource(
                {
                    "time": m.time,
                    "row": [("driver", "events")] * len(m),
                    "key": m.key.fillna(""),
                    "reason": m.reason.fillna("").str.slice(0, 300),
                }
            )
            r = p.scatter(
                "time",
                "row",
                marker=marker,
                size=size,
                line_color=colour,
                fill_color=colour,
                line_width=2,
                source=src,
                legend_label=f"{kind} ({len(m)})",
            )
            p.add_tools(
                HoverTool(
                    renderers=[r],
                    tooltips=[(kind, "@key"), ("when", "@time{0.000} s"), ("why", "@reason")],
                )
            )
    for _, e in ev[ev.event.isin(["node-lost", "node-joined"])].iterrows():
        lost = e.event == "node-lost"
        colour = RED if lost else GREEN
        p.add_layout(
            Span(
                location=e.time,
                dimension="height",
                line_color=colour,
                line_width=2,
                line_dash="dashed",
            )
        )
        p.add_layout(
            _label(
                e.time, 5, f"{_node_label(e.node)} {'lost' if lost else 'joined'}", colour, x_range
            )
        )
    waves = (
        ev[ev.event == "recovery"]
        .groupby(["run", "wave"])
        .agg(time=("time", "min"), n=("key", "size"))
    )
    for (_, wave), w in waves.iterrows():
        p.add_layout(Span(location=w.time, dimension="height", line_color=RED, line_dash="dotted"))
        p.add_layout(_label(w.time, 20, f"recovery wave {wave}: {int(w.n)} tasks", RED, x_range))
    if p.legend:
        legend = p.legend[0]
        legend.orientation = "horizontal"
        legend.ncols = 6
        legend.label_text_font_size = "11px"
        legend.click_policy = "hide"
        p.add_layout(legend, "below")
    return p, len(rows)


def _drawn(tasks: pd.DataFrame, most: int) -> pd.DataFrame:
    """At most about ``most`` of ``tasks`` for the timeline: every unusual one (retried,
    recomputed, duplicated; if they are more than half of ``most``, every n-th of them),
    and of the rest every n-th by start time. A browser draws
    a few tens of thousands of bars at ease; a 330k-task run's would be a page of
    hundreds of megabytes. The summary, the per-category table and the CDF read every
    task."""
    import pandas as pd

    if len(tasks) <= most:
        return tasks
    unusual = (tasks.wave > 0) | (tasks.attempt > 0) | tasks.duplicate
    odd, rest = tasks[unusual], tasks[~unusual].sort_values("start")
    if len(odd) > most // 2:  # a run of many recoveries: half the room for them, sampled
        odd = odd.sort_values("start").iloc[:: -(-len(odd) // (most // 2))]
    room = max(most - len(odd), 1)
    step = -(-len(rest) // room)  # ceil
    return pd.concat([odd, rest.iloc[::step]]).sort_index()


def _stores(rec: RunRecord, x_range: Any) -> Any:
    from bokeh.models import ColumnDataSource, Div, HoverTool
    from bokeh.plotting import figure

    st = rec.stores_table.to_pandas()  # no missing values: plain numpy columns
    if not len(st):
        return Div(
            text="<p><i>The object stores were not sampled for this record: they are while "
            "a record is written (raydag.record.directory) or inside "
            "raydag.performance_report.</i></p>",
            sizing_mode="stretch_width",
        )
    p = figure(
        title="Object store per node (solid: used, dashed: capacity, dotted: spilled since the start)",
        x_range=x_range,
        height=300,
        sizing_mode="stretch_width",
        tools="xpan,xwheel_zoom,box_zoom,reset,save",
        active_scroll="xwheel_zoom",
        x_axis_label="seconds since the start",
        y_axis_label="MiB",
        output_backend="canvas",
    )
    nodes = list(dict.fromkeys(st.node))
    colours = _palette(len(nodes))
    lines = []
    for node, colour in zip(nodes, colours, strict=True):
        for _, s in st[st.node == node].groupby("run"):
            s = s.sort_values("time")
            src = ColumnDataSource(
                {
                    "time": s.time,
                    "used": s.used_bytes / 2**20,
                    "cap": s.capacity_bytes / 2**20,
                    "spilled": (s.spilled_bytes - s.spilled_bytes.iloc[0]) / 2**20,
                    "objects": s.num_objects,
                }
            )
            label = _node_label(node)
            lines.append(
                p.line(
                    "time", "used", line_color=colour, line_width=2, source=src, legend_label=label
                )
            )
            p.line("time", "cap", line_color=colour, line_dash="dashed", source=src)
            if (s.spilled_bytes != s.spilled_bytes.iloc[0]).any():
                p.line(
                    "time",
                    "spilled",
                    line_color=colour,
                    line_dash="dotted",
                    line_width=2,
                    source=src,
                )
    p.add_tools(
        HoverTool(
            renderers=lines,
            tooltips=[
                ("t", "@time{0.00} s"),
                ("used", "@used{0.0} MiB"),
                ("capacity", "@cap{0} MiB"),
                ("spilled", "@spilled{0.0} MiB"),
                ("objects", "@objects"),
            ],  # fmt: skip
        )
    )
    p.y_range.start = 0
    p.legend.location = "top_left"
    p.legend.label_text_font_size = "10px"
    p.add_layout(p.legend[0], "right")
    return p


def _categories(tasks: pd.DataFrame, colours: dict[str, str]) -> tuple[Any, Any]:
    from bokeh.models import ColumnDataSource, Div, HoverTool
    from bokeh.plotting import figure

    if not len(tasks):
        return Div(text="<p><i>No task finished.</i></p>"), None
    g = tasks.groupby("category").agg(
        count=("duration", "size"),
        mean=("duration", "mean"),
        max=("duration", "max"),
        total=("duration", "sum"),
        nbytes=("nbytes", "sum"),
        retried=("attempt", lambda a: int((a > 0).sum())),
        recomputed=("wave", lambda w: int((w > 0).sum())),
    )
    g = g.sort_values("total", ascending=False)
    head = "".join(
        f"<th>{h}</th>"
        for h in (
            "",
            "category",
            "count",
            "mean",
            "max",
            "total",
            "bytes out",
            "retries",
            "recomputed",
        )
    )
    body = "".join(
        f'<tr><td><span style="display:inline-block;width:12px;height:12px;'
        f'background:{colours.get(c, GREY)}"></span></td><td>{html.escape(str(c))}</td>'
        f"<td>{int(r['count']):,}</td><td>{_fmt_s(r['mean'])}</td><td>{_fmt_s(r['max'])}</td>"
        f"<td>{_fmt_s(r['total'])}</td><td>{_fmt_bytes(r['nbytes'])}</td>"
        f"<td>{int(r['retried'])}</td><td>{int(r['recomputed'])}</td></tr>"
        for c, r in g.head(60).iterrows()
    )
    more = f"<p><i>and {len(g) - 60} more categories</i></p>" if len(g) > 60 else ""
    table = Div(
        text=f"""<style>.rdt td, .rdt th {{ font: 12px sans-serif; padding: 2px 8px; text-align: right; }}
.rdt td:nth-child(2), .rdt th:nth-child(2) {{ text-align: left; }}
.rdt tr:nth-child(even) {{ background: #f4f4f4; }}</style>
<h3 style="font: 600 15px sans-serif">Tasks per category</h3>
<table class="rdt"><tr>{head}</tr>{body}</table>{more}""",
        sizing_mode="stretch_width",
    )
    top = g.head(30).iloc[::-1]
    cats = [str(c) for c in top.index]
    unit, scale = _time_unit(float(top["max"].max()))
    src = ColumnDataSource(
        {
            "category": cats,
            "mean": top["mean"] * scale,
            "max": top["max"] * scale,
            "count": top["count"],
            "colour": [colours.get(c, GREY) for c in top.index],
        }
    )
    p = figure(
        title="Runtime per category (light: max, dark: mean)",
        y_range=cats,
        height=max(200, 24 * len(cats) + 80),
        sizing_mode="stretch_width",
        tools="xwheel_zoom,reset,save",
        x_axis_label=unit,
        output_backend="canvas",
    )
    p.hbar(
        y="category",
        right="max",
        height=0.8,
        fill_color="colour",
        fill_alpha=0.35,
        line_color=None,
        source=src,
    )
    mean = p.hbar(
        y="category", right="mean", height=0.5, fill_color="colour", line_color=None, source=src
    )
    p.add_tools(
        HoverTool(
            renderers=[mean],
            tooltips=[
                ("category", "@category"),
                ("count", "@count"),
                ("mean", f"@mean{{0.000}} {unit}"),
                ("max", f"@max{{0.000}} {unit}"),
            ],  # fmt: skip
        )
    )
    p.x_range.start = 0
    return table, p


def _cdf(tasks: pd.DataFrame, colours: dict[str, str]) -> Any:
    import numpy as np
    from bokeh.models import Div
    from bokeh.plotting import figure

    d = tasks.duration.dropna().to_numpy()
    if not len(d):
        return Div(text="")
    floor = max(float(d[d > 0].min()) if (d > 0).any() else 1e-6, 1e-7)
    p = figure(
        title="Runtime CDF (black: all tasks; colours: the largest categories)",
        x_axis_type="log",
        height=320,
        sizing_mode="stretch_width",
        tools="xpan,xwheel_zoom,box_zoom,reset,save",
        x_axis_label="task runtime, seconds",
        y_axis_label="fraction of tasks",
        output_backend="canvas",
    )

    def line(values: np.ndarray, **kw: Any) -> None:
        x = np.sort(np.maximum(values, floor))
        y = np.arange(1, len(x) + 1) / len(x)
        if len(x) > CDF_POINTS:  # the same curve to the eye, in a bounded page
            at = np.unique(np.linspace(0, len(x) - 1, CDF_POINTS).astype(np.int64))
            x, y = x[at], y[at]
        p.step(x, y, mode="after", **kw)

    top = tasks.category.value_counts().head(8).index
    for c in top:
        durations = tasks.loc[tasks.category == c, "duration"].dropna().to_numpy()
        line(durations, line_color=colours.get(c, GREY), legend_label=str(c)[:40], line_width=1.5)
    line(d, line_color="black", line_width=2.5, legend_label="all tasks")
    p.y_range.start = 0
    p.y_range.end = 1.02
    p.legend.label_text_font_size = "10px"
    p.legend.click_policy = "hide"
    p.add_layout(p.legend[0], "right")
    return p


# ---- the file ---------------------------------------------------------------------


def render(rec: RunRecord, title: str | None = None) -> str:
    """The report of ``rec`` as one HTML document (Bokeh's JavaScript inlined)."""
    from bokeh.document import Document
    from bokeh.embed import file_html
    from bokeh.events import DocumentReady
    from bokeh.layouts import column
    from bokeh.models import CustomJS, Range1d
    from bokeh.resources import INLINE

    summary = rec.summary()
    runs = rec.meta.get("runs", [rec.meta])
    title = title or (
        f"raydag run {rec.meta.get('id', '')}"
        if len(runs) == 1
        else f"raydag: {len(runs)} computes"
    )
    tasks = rec.tasks
    tasks["node_label"] = [_node_label(n) for n in tasks.node]
    tasks["worker_label"] = ["pid ?" if _missing(w) else f"pid {int(w)}" for w in tasks.worker]
    for c in ("nbytes", "input_bytes", "duration"):
        tasks[c] = tasks[c].astype("float64")
    counts = tasks.category.value_counts()
    colours = dict(zip(counts.index, _palette(len(counts)), strict=True))
    end = max(
        float(rec.meta.get("wall_seconds") or 0.0),
        float(tasks.end.max()) if len(tasks) else 0.0,
        float(rec.events.time.max()) if len(rec.events) else 0.0,
    )
    x_range = Range1d(0, max(end * 1.02, 1e-3), bounds=(min(0.0, -0.01 * end), end * 1.1 + 1e-3))
    timeline, _ = _timeline(rec, tasks, colours, x_range)
    stores = _stores(rec, x_range)
    table, per_category = _categories(tasks, colours)
    cdf = _cdf(tasks, colours)
    parts = [_summary_div(rec, summary, title), timeline, stores, table, per_category, cdf]
    parts = [x for x in parts if x is not None]
    layout = column(*parts, sizing_mode="stretch_width")
    plots = sum(1 for x in parts if type(x).__name__ == "figure")
    doc = Document()
    doc.add_root(layout)
    doc.js_on_event(DocumentReady, CustomJS(args={"expected": plots}, code=_READY_JS))
    page = file_html(doc, resources=INLINE, title=title)
    return page.replace("<head>", "<head>\n" + _ERRORS_JS, 1)


def write_report(
    records: RunRecord | Sequence[RunRecord],
    filename: str | os.PathLike[str],
    title: str | None = None,
) -> Path:
    """Write the report of one record, or of several (at least one) merged on one clock."""
    if isinstance(records, Sequence):
        records = type(records[0]).merge(list(records))
    path = Path(filename)
    if path.parent != Path(""):
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(records, title), encoding="utf-8")
    logger.info("raydag: wrote the report to %s", path)
    return path
