"""History tab: the run log as a table and a TTFT plot, CSV export, and a run reopened or re-run."""

from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path

import gradio as gr

from engine.public import Comparison, speed_words
from engine.config import short_dtype
from engine.runlog import RunLogError

from .. import views
from ..errors import refusal

from ..settings import Panel
from ..state import Studio
from ..arm_views import views as arm_views
from ..views import retention_text
from .compare import CompareTab
from .editors import Editors, Step
from .schema import SchemaTab

# what each arm reused from a cache is in its own cell
RUN_HEADERS = ["id", "time (UTC)", "schema", "model", "storage · mode", "prompt tokens"]
# each column's least width, in characters: the longest word its header or cells hold
RUN_CHARS = [5, 10, 10, 14, 11, 8]
ARM_CHARS = 10  # "identical", "diverges", "Baseline"
CHAR_PX, PAD_PX = 8.5, 16  # Gradio's table: 14 px monospace (8.43 px a character), 8 px padding each side
TABLE_PX = 1200  # at least (assets/studio.css #history-table): a narrower window scrolls it sideways


def headers() -> list[str]:
    return RUN_HEADERS + [f"{v.title} TTFT" for v in arm_views()]


def column_widths() -> list[str]:
    """Each column's share of the table, in proportion to the pixels its longest word needs (Gradio breaks a word
    wider than its column)."""
    needs = [chars * CHAR_PX + PAD_PX for chars in RUN_CHARS + [ARM_CHARS] * len(arm_views())]
    return [f"{100 * need / sum(needs):.2f}%" for need in needs]


PLOT_COLUMNS = ["prompt tokens", "TTFT ms", "arm", "run", "schema"]
AXIS_FORMAT = ",d"  # d3: whole numbers with thousands separators, never "193.000000"
MIN_SPAN = 50  # whole units an axis spans at least: a 1,200 px axis then ticks on whole numbers


def build(studio: Studio, tabs: gr.Tabs, tab: gr.Tab, editors: Editors, schema: SchemaTab, panel: Panel,
          compare: CompareTab, downloads: Path) -> Step:
    """The tab; returns its refresh step (the page runs it on first paint)."""
    with gr.Row(elem_classes=["pml-toolbar"]):
        which = gr.Dropdown(["all"], value="all", label="Schema", scale=2)
        refresh_btn = gr.Button("Refresh", size="md", scale=1)
        export = gr.DownloadButton("Export CSV", size="md", scale=1)
    notice = gr.HTML(notice_html(studio), elem_id="history-notice")
    with gr.Column(elem_id="history-table-box"):  # scrolls sideways where the window is narrower than the table
        table = runs_table()
    with gr.Row(elem_classes=["pml-toolbar"]):
        run_id = gr.Textbox(label="Selected run", placeholder="click a row in the table", scale=1,
                            elem_id="selected-run")
        open_btn = gr.Button("Open in editor", size="md", scale=1)
        rerun_btn = gr.Button("Re-run", variant="primary", size="md", scale=1)
    detail = gr.HTML(views.summary_html(None, "Click a row to see its run."), elem_id="history-detail")
    plot = ttft_plot()
    gr.Markdown(f"Run log: `{studio.runlog.path}`", elem_classes=["pml-note"])

    refresh = Step(partial(_refresh_ui, studio, downloads), [which], [table, plot, which, export, notice])
    compare.run.then(*refresh, show_progress="hidden")
    tab.select(*refresh, show_progress="hidden")
    refresh_btn.click(*refresh)
    which.input(*refresh, show_progress="hidden")
    table.select(_pick_row, None, run_id, show_progress="hidden").then(
        partial(_detail_ui, studio), run_id, detail, show_progress="hidden")

    fields = list(panel.widgets)
    opened = [editors.schema, editors.prompt, compare.max_new, compare.temperature] + panel.inputs + [tabs]
    open_btn.click(partial(_open_ui, studio, fields, "schema"), run_id, opened).then(
        *schema.validate).then(*editors.sync)
    rerun_btn.click(partial(_open_ui, studio, fields, "compare"), run_id, opened).then(
        *schema.validate).then(*compare.stream).then(*refresh)
    return refresh


def runs_table() -> gr.Dataframe:
    return gr.Dataframe(headers=headers(), interactive=False, max_height=360, wrap=True, elem_id="history-table",
                        label="Runs (click a row to select it)", column_widths=column_widths())


def ttft_plot() -> gr.ScatterPlot:
    """TTFT over prompt length, a colour per arm (a fixed height would clip the legend)."""
    return gr.ScatterPlot(x="prompt tokens", y="TTFT ms", color="arm", label="TTFT over prompt length",
                          y_title="TTFT (ms)", x_axis_format=AXIS_FORMAT, y_axis_format=AXIS_FORMAT,
                          color_map={v.title: v.color for v in arm_views()}, elem_id="history-plot")



def rows(studio: Studio, schema: str | None = None) -> list[list]:
    out = []
    for r in studio.runlog.runs(schema=_filter(schema), limit=500):
        schema = r["schema_name"] + (f" · {r['source']}" if r.get("source") else "")
        cells = [r["id"], (r["created_at"] or "").replace("T", " ").replace("+00:00", ""), schema,
                 r["model"], storage_cell(r), r["prompt_tokens"]]
        out.append(cells + [arm_cell(r["arms"].get(v.arm)) for v in arm_views()])
    return out


def arm_cell(arm: dict | None) -> str:
    """'812 ms · 6.1× faster · same · 348 reused' from an arm row; '–' for an arm not asked for; 'not run: why' for one
    that could not run; a repeat says so instead of a speedup."""
    if arm and arm.get("error"):  # its first clause; the run's detail below the table has the whole reason
        return f"not run: {arm['error'].split(': ')[0].split('; ')[0]}"
    if not arm or arm.get("ttft_ms") is None:
        return "–"
    parts = [_ms(arm["ttft_ms"])]
    if arm.get("repeat"):
        parts.append("repeat of an earlier identical request")
    elif arm.get("speedup") is not None:
        parts.append(speed_words(arm["speedup"]))
    if arm.get("same_text") is not None:
        parts.append("same" if arm["same_text"] else f"diverges at {arm['first_divergence']}")
    if arm.get("speedup") is not None and arm.get("reused_tokens") is not None:  # not the baseline's
        parts.append(f"{arm['reused_tokens']:,} reused")
    return " · ".join(parts)


def run_detail(studio: Studio, run_id) -> str:
    row = open_run(studio, run_id)
    try:
        comparison = Comparison.from_json(json.loads(row["result_json"] or "{}"))
    except (ValueError, TypeError, KeyError) as err:
        return views.error_html(f"run {row['id']} has no readable result document ({err}); re-run it")
    cells = "".join(f'<div class="pml-col {v.arm}">{views.head_html(v)}'
                    f'{views.column_html(res.run.text, False) if res.ran else views.not_run_html()}'
                    f"{views.metrics_html(comparison, v.arm)}</div>"
                    for v in arm_views() if (res := comparison.arm(v.arm)) is not None)
    return f'{views.summary_html(comparison)}<div class="pml-history-arms">{cells}</div>'


def plot_points(studio: Studio, schema: str | None = None):
    return plot_points_of(studio.runlog.runs(schema=_filter(schema), limit=500))


def plot_points_of(runs: list[dict]):
    import pandas as pd

    titles = {v.arm: v.title for v in arm_views()}
    points = []
    for r in runs:
        for arm, figures in r["arms"].items():  # a repeat's TTFT is a lookup's, not the arm's: left out
            if figures.get("ttft_ms") is not None and not figures.get("error") and not figures.get("repeat"):
                points.append([r["prompt_tokens"], round(figures["ttft_ms"]), titles.get(arm, arm), r["id"],
                               r["schema_name"]])
    return pd.DataFrame(points, columns=PLOT_COLUMNS)


def plot_update(points) -> gr.ScatterPlot:
    """``points`` with axes that read: each spans at least :data:`MIN_SPAN` whole units (else d3's ticks fall between
    whole tokens and ",d" prints "423 423 424"), padded so that no point sits on an edge."""
    if points.empty:
        return gr.ScatterPlot(value=points, x_lim=None, y_lim=None)
    return gr.ScatterPlot(value=points, x_lim=axis_limits(points["prompt tokens"], floor=0),
                          y_lim=axis_limits(points["TTFT ms"], floor=0))


def axis_limits(values, floor: float | None = None) -> list[float]:
    """[low, high] around ``values``: a tenth of their span (at least MIN_SPAN / 2) on each side, never below
    ``floor``; cut there, the span still MIN_SPAN."""
    lo, hi = float(values.min()), float(values.max())
    pad = max((hi - lo) / 10, MIN_SPAN / 2)
    lo, hi = math.floor(lo - pad), math.ceil(hi + pad)
    if floor is not None and lo < floor:
        lo, hi = floor, max(hi, floor + MIN_SPAN)
    return [lo, hi]


def schemas(studio: Studio) -> list[str]:
    return ["all"] + studio.runlog.schemas()


def open_run(studio: Studio, run_id) -> dict:
    text = str(run_id if run_id is not None else "").strip()
    if not text:
        raise refusal("select a run in the table first")
    shown = text if len(text) <= 30 else text[:27] + "..."
    if not (text.isascii() and text.isdigit()):
        raise refusal(f"'{shown}' is not a run id (the whole number in the table's id column); click a row in "
                       "the table")
    row = studio.runlog.get(int(text)) if len(text) <= 19 else None  # beyond any SQLite row id
    if row is None:
        raise refusal(f"there is no run {shown} in {studio.runlog.path}; click a row in the table")
    return row


def stored_settings(row: dict) -> dict:
    """The run's settings as the panel's widgets take them; its arms too, so that a Re-run runs the run's columns."""
    from engine.public import REGISTRY

    out = {"storage": row["storage"], "mode": row["mode"], "storage_dtype": row.get("storage_dtype") or "float32",
           "retention": row.get("retention") or 1.0, "method": row.get("compression_method") or "pyramid"}
    arms = [a for a in row.get("arms") or () if a in REGISTRY]  # an arm since removed cannot run again
    if arms:
        out["arms"] = arms
    return out


def export_csv(studio: Studio, schema: str | None, folder: str | Path) -> str:
    path = Path(folder) / ("pml-runs.csv" if not _filter(schema) else f"pml-runs-{schema}.csv")
    return studio.runlog.export_csv(path, schema=_filter(schema))


def storage_cell(r: dict) -> str:
    out = f"{r['storage']} · {r['mode']}"
    if r.get("storage_dtype") and r["storage_dtype"] != "float32":
        out += f" · {short_dtype(r['storage_dtype'])}"
    if r.get("retention") is not None and r["retention"] < 1.0:
        out += f" · {retention_text(r['retention'], r.get('compression_method'))}"
    return out


def notice_html(studio: Studio, read_error: str | None = None) -> str:
    problems = [p for p in (read_error, studio.log_problem()) if p]
    return "".join(views.warn_html(p) for p in problems)


def _refresh_ui(studio: Studio, downloads: Path, schema_filter: str):
    try:
        choices = schemas(studio)
        value = schema_filter if schema_filter in choices else "all"
        return (rows(studio, value), plot_update(plot_points(studio, value)), gr.update(choices=choices, value=value),
                export_csv(studio, value, downloads), notice_html(studio))
    except RunLogError as err:
        return ([], plot_points_of([]), gr.skip(), gr.skip(), notice_html(studio, str(err)))


def _detail_ui(studio: Studio, run_id):
    try:
        return run_detail(studio, run_id)
    except gr.Error as err:
        return views.error_html(err.message)


def _pick_row(evt: gr.SelectData):
    row = evt.row_value or []
    return str(row[0]) if row else gr.skip()


def _open_ui(studio: Studio, fields: list[str], tab: str, run_id):
    row = open_run(studio, run_id)
    stored = stored_settings(row)
    settings = [stored[f] if f in stored else gr.skip() for f in fields]
    return (row["schema_text"], row["prompt_text"], row["max_new_tokens"] or 32, row["temperature"] or 0.0,
            *settings, gr.Tabs(selected=tab))


def _ms(x) -> str:
    return "–" if x is None else f"{x:.0f} ms"


def _filter(schema: str | None) -> str | None:
    return None if schema in (None, "", "all") else schema
