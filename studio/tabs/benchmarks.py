"""Benchmarks tab: the latest bench/results with their plots, and the scaling benchmark run at small sizes.

The readers and the small run are in :mod:`studio.benchmarks`; this module lays them out.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import gradio as gr

from .. import benchmarks as bench
from ..state import Studio


def build(studio: Studio, tab: gr.Tab, results: Path, assets: Path, status: gr.HTML) -> None:
    with gr.Row(elem_classes=["pml-toolbar"]):
        gr.Markdown(f"Latest results of the scripts in `bench/`, read from `{bench._rel(results)}`. Run a script to "
                    "update them.", elem_classes=["pml-note"])
        reload_btn = gr.Button("Reload results", size="md", scale=0, min_width=160)
    views = []
    with gr.Tabs():
        with gr.Tab("Scaling"):
            views += [gr.Markdown(), _plot("scaling", 420), gr.Markdown(),
                      _table("TTFT per prompt length"), _table("Fits")]
        with gr.Tab("TTFT"):
            views += [gr.Markdown(), _table("Speedup per prompt length")]
        with gr.Tab("Memory"):
            views += [gr.Markdown(), _table("KV bytes per token by model family"),
                      _table("Store bytes per sample schema: measured vs predicted")]
        with gr.Tab("Fidelity"):
            views += [gr.Markdown(), _plot("fidelity", 380), gr.Markdown(), _table("Accuracy and agreement per path")]
            with gr.Row():
                views += [_table("Accuracy by needle depth", wrap=False),
                          _table("Accuracy by number of modules", wrap=False)]
        with gr.Tab("Compression"):
            views += [gr.Markdown(), _table("Per storage configuration (needle set)")]
        with gr.Tab("Run scaling here", id="bench-run"):
            _small_run(studio, status)

    show = partial(show_results, results, assets)
    tab.select(show, None, views, show_progress="hidden")
    reload_btn.click(show, None, views)


def _small_run(studio: Studio, status: gr.HTML) -> None:
    gr.Markdown("Runs the scaling benchmark's own measurement (`studio.docqa`, which bench/scaling.py runs too) at "
                "small sizes with the loaded model: a warm-up pair, then 1 baseline and 1 cached run per length. "
                "Results are shown here only; bench/results is left alone.", elem_classes=["pml-note"])
    with gr.Row(elem_classes=["pml-toolbar"]):
        lengths = gr.CheckboxGroup(list(bench.SMALL_LENGTHS), value=[256, 512], label="Prompt lengths (tokens)",
                                   scale=3, elem_id="small-lengths")
        button = gr.Button("Run scaling at small sizes", variant="primary", scale=1, elem_id="small-run")
    note = gr.Markdown()
    table = gr.Dataframe(headers=bench.SMALL_HEADERS, interactive=False, label="Measured now", elem_id="small-table")
    plot = gr.LinePlot(x="prompt tokens", y="TTFT ms", color="path", label="TTFT: baseline vs cached", height=340,
                       color_map={"baseline": "#c0392b", "cached": "#2471a3"})

    def run(lengths_, progress=gr.Progress()):
        def report(done: int, total: int, label: str) -> None:
            progress((done, total), desc=label, unit="lengths")

        rows, text = bench.run_small_scaling(studio.engine, lengths_, report)
        return bench.small_rows(rows), bench.small_plot(rows), text, studio.status_html()

    button.click(run, lengths, [table, plot, note, status])


def show_results(results: Path, assets: Path) -> tuple:
    def table(df):
        return gr.Dataframe(df, visible=not df.empty)

    def image(name):
        path = bench.plot_path(name, assets)
        return gr.Image(path, visible=path is not None)

    s_head, s_rows, s_fits = bench.scaling_view(results)
    t_head, t_rows = bench.ttft_view(results)
    m_head, m_fams, m_samples = bench.memory_view(results)
    f_head, f_sum, f_depth, f_mods = bench.fidelity_view(results)
    c_head, c_rows = bench.compression_view(results)
    return (s_head, image("scaling"), bench.plot_note("scaling", assets), table(s_rows), table(s_fits),
            t_head, table(t_rows), m_head, table(m_fams), table(m_samples), f_head, image("fidelity"),
            bench.plot_note("fidelity", assets), table(f_sum), table(f_depth), table(f_mods), c_head, table(c_rows))


def _table(label: str, wrap: bool = True) -> gr.Dataframe:
    return gr.Dataframe(interactive=False, label=label, wrap=wrap)


def _plot(name: str, height: int) -> gr.Image:
    return gr.Image(label=f"assets/{bench.PLOTS[name]}", type="filepath", interactive=False, show_label=False,
                    height=height, buttons=["fullscreen"])
