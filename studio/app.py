"""The studio's Gradio Blocks: ``build_app(engine, runlog)`` wires studio/handlers.py to components.

Tabs: Schema (editor, validation, layout), Prompt (builder generated from the schema, PML prompt,
token view), Encode, Compare (two streaming columns), History (run log) and Model. Nothing here
loads the model: that happens on the first encode or compare, or from the Model tab.

API (see :func:`build_app`): the compare action is the endpoint ``/compare``::

    from gradio_client import Client
    client = Client("http://127.0.0.1:7860/")
    result = client.predict(schema_text, prompt_text, 32, "cpu", "prefixed", 0.0, api_name="/compare")
    # result is the `pml-studio run --json` document (dict); the run is also recorded in the run log
"""

from __future__ import annotations

import tempfile
from functools import partial
from pathlib import Path

import gradio as gr

from engine.runlog import RunLog

from . import benchmarks as bench
from .handlers import (DTYPE_CHOICES, HISTORY_HEADERS, LAYOUT_HEADERS, METHOD_CHOICES, MODE_NOTE, NONE, RETENTION_NOTE,
                       UNIT_HEADERS, Studio, column_html, compose_prompt, empty_prompt, gpu_explanation,
                       highlight_html, import_program, load_sample, metrics_html, normalise, read_upload,
                       sample_names, selection_from_prompt, summary_html, token_view_html)

ASSETS = Path(__file__).resolve().parent.parent / "assets"
CSS_PATH = ASSETS / "studio.css"
DEFAULT_SAMPLE = "travel"
ENCODE_HEADERS = ["store entry", "tokens", "MB", "KB / token"]


def launch_options() -> dict:
    """Theme and CSS for ``Blocks.launch`` (Gradio 6 takes them at launch, not in the constructor)."""
    theme = gr.themes.Default(primary_hue="indigo", secondary_hue="emerald", neutral_hue="slate",
                              radius_size="md")
    return {"theme": theme, "css_paths": [CSS_PATH] if CSS_PATH.exists() else None, "footer_links": ["api"]}


def build_app(engine, runlog: RunLog, results_dir: str | Path | None = None,
              assets_dir: str | Path | None = None) -> gr.Blocks:
    """The studio around ``engine`` (an ``engine.session.Engine``) and ``runlog``.

    The compare action is also an API endpoint, ``api_name="compare"``::

        Client(url).predict(schema_text, prompt_text, max_new_tokens, storage, mode, temperature,
                            storage_dtype, retention, compression, api_name="/compare")

    (the last three are optional) returns the same JSON document as ``pml-studio run --json`` and
    records the run. The Benchmarks tab reads ``results_dir`` (default bench/results) and the plots
    in ``assets_dir`` (default assets/).
    """
    from engine.session import gpu_status

    studio = Studio(engine, runlog)
    results = Path(results_dir) if results_dir else bench.RESULTS
    assets = Path(assets_dir) if assets_dir else bench.ASSETS
    memory0 = studio.memory_defaults()
    downloads = Path(tempfile.mkdtemp(prefix="pml-studio-"))
    names = sample_names()
    first = DEFAULT_SAMPLE if DEFAULT_SAMPLE in names else (names[0] if names else None)
    schema0, prompt0 = load_sample(first) if first else ("", "")
    gpu_ok, gpu_why = gpu_status()

    with gr.Blocks(title="PML Studio") as demo:
        demo.studio = studio  # tests and launch reach the run log and engine through this
        spec_state = gr.State(None)  # builder spec of the last valid schema
        builder_state = gr.State(None)  # {"spec", "values", "text", "nonce"}: what the builder shows

        with gr.Row(elem_classes=["pml-header"]):
            gr.HTML('<div class="pml-title"><span class="logo">◧</span> PML Studio'
                    '<span class="tagline">modular prompt caching — author, encode, compare</span></div>')
            status = gr.HTML(studio.status_html())

        with gr.Tabs(selected="schema") as tabs:
            # -- Schema ------------------------------------------------------------------------------
            with gr.Tab("1 · Schema", id="schema"):
                with gr.Row(equal_height=False):
                    with gr.Column(scale=1):
                        with gr.Row(elem_classes=["pml-toolbar"]):
                            sample = gr.Dropdown(names, value=first, label="Sample schema", scale=3)
                            upload = gr.UploadButton("Upload .xml", file_types=[".xml"], size="md", scale=1)
                            download = gr.DownloadButton("Download .xml", size="md", scale=1)
                        with gr.Row(elem_classes=["pml-toolbar"]):
                            py_upload = gr.UploadButton("Import from Python (.py)", file_types=[".py"], size="md",
                                                        scale=1, elem_id="py-upload")
                            py_program = gr.Dropdown([], value=None, label="Prompt program", scale=2,
                                                     interactive=False, elem_id="py-program")
                        py_status = gr.HTML('<div class="pml-note">Import from Python compiles a prompt program '
                                            "(@prompt_program) into the editor and its example call into the "
                                            "prompt; the file is imported, so its top-level code runs on this "
                                            "machine.</div>", elem_id="py-status")
                        py_path = gr.State(None)
                        schema_code = gr.Code(schema0, language="html", label="Schema (PML)", lines=26, wrap_lines=True,
                                              max_lines=40, interactive=True, elem_id="schema-editor")
                    with gr.Column(scale=1):
                        validation = gr.HTML(elem_id="schema-validation")
                        layout_table = gr.Dataframe(headers=LAYOUT_HEADERS, interactive=False, label="Layout",
                                                    max_height=420, wrap=True,
                                                    column_widths=["40%", "17%", "11%", "20%", "12%"])
                        with gr.Accordion("Highlighted source (problem lines in red)", open=False) as source_acc:
                            highlighted = gr.HTML()

            # -- Prompt ------------------------------------------------------------------------------
            with gr.Tab("2 · Prompt", id="prompt"):
                with gr.Row(equal_height=False):
                    with gr.Column(scale=2, elem_classes=["pml-builder"]):
                        gr.Markdown("#### Prompt builder\nPick modules and fill params; the PML prompt on the "
                                    "right follows. Edits made there come back here when you leave the editor.")

                        @gr.render(inputs=[builder_state])
                        def builder(state):
                            _render_builder(studio, state, prompt_code)

                    with gr.Column(scale=3):
                        prompt_code = gr.Code(prompt0, language="html", label="Prompt (PML)", lines=10, wrap_lines=True,
                                              max_lines=24, interactive=True, elem_id="prompt-editor")
                        prompt_status = gr.HTML()
                        token_view = gr.HTML()

            # -- Encode ------------------------------------------------------------------------------
            with gr.Tab("3 · Encode", id="encode"):
                with gr.Row():
                    storage = gr.Radio([("CPU memory", "cpu"), ("GPU memory", "cuda")], value="cpu",
                                       label="KV storage", interactive=gpu_ok,
                                       info=gpu_why if gpu_ok else "GPU unavailable: " + gpu_explanation(gpu_why))
                    mode = gr.Radio(["prefixed", "isolated"], value=engine.config.mode, label="Encoding mode",
                                    info="prefixed: modules see the system text before them (closer to the "
                                         "baseline, same memory) · isolated: the paper's scheme")
                gr.Markdown(MODE_NOTE, elem_classes=["pml-note"])
                with gr.Row():
                    storage_dtype = gr.Radio(DTYPE_CHOICES, value=engine.config.storage_dtype, label="Storage precision",
                                             info="fp16 / bf16 halve module bytes; cast back to the model's dtype "
                                                  "when assembled",
                                             elem_id="storage-dtype")
                    retention = gr.Slider(0.1, 1.0, value=engine.config.compression.retention, step=0.05,
                                          label="Retention", info="share of each module's KV kept (1 = all)",
                                          elem_id="retention")
                    method = gr.Radio(METHOD_CHOICES, value=engine.config.compression.method, label="Compression method",
                                      info="used when retention < 1", elem_id="compression-method")
                gr.Markdown(RETENTION_NOTE, elem_classes=["pml-note"])
                with gr.Row(equal_height=True):
                    budget = gr.Number(memory0["budget_mib"], label="Module memory budget (MiB)", minimum=0.01,
                                       precision=1, scale=1, elem_id="budget-mib",
                                       info="least recently used unpinned modules are evicted beyond it")
                    persist_view = gr.HTML(studio.persistence_html(), elem_id="persistence")
                encode_btn = gr.Button("Encode schema", variant="primary", elem_id="encode-btn")
                encode_summary = gr.HTML('<div class="pml-note">Encoding stores the KV of every module. It runs '
                                         "again only when the schema, model, mode or storage settings changed; "
                                         "modules saved on disk are loaded instead of encoded.</div>")
                with gr.Row(equal_height=False):
                    with gr.Column(scale=3):
                        unit_table = gr.Dataframe(headers=UNIT_HEADERS, interactive=False, elem_id="unit-table",
                                                  label="Units: where each came from, and how long it took",
                                                  max_height=360, wrap=True)
                    with gr.Column(scale=2):
                        memory_view = gr.HTML('<div class="pml-note">Module memory before and after encoding '
                                              "appears here.</div>", elem_id="memory-view")
                encode_table = gr.Dataframe(headers=ENCODE_HEADERS, interactive=False, label="Store entries",
                                            max_height=360)

            # -- Compare -----------------------------------------------------------------------------
            with gr.Tab("4 · Compare", id="compare"):
                with gr.Row(equal_height=True, elem_classes=["pml-toolbar"]):
                    max_new = gr.Slider(1, 256, value=32, step=1, label="Max new tokens", scale=3,
                                        elem_id="max-new-tokens")
                    temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="Temperature",
                                            info="0 = greedy (default); applies to both runs", scale=3)
                    compare_btn = gr.Button("Compare", variant="primary", scale=1, elem_id="compare-btn")
                summary = gr.HTML(summary_html(None), elem_id="compare-summary")
                with gr.Row(equal_height=False):
                    with gr.Column(elem_classes=["pml-col"]):
                        gr.HTML('<div class="col-head">Baseline <span>full prefill of every prompt token</span></div>')
                        base_out = gr.HTML(column_html("", False), elem_id="baseline-text")
                        base_metrics = gr.HTML(metrics_html(None, False))
                    with gr.Column(elem_classes=["pml-col", "cached"]):
                        gr.HTML('<div class="col-head">Cached <span>module KV reused, the rest prefilled</span></div>')
                        cached_out = gr.HTML(column_html("", False), elem_id="cached-text")
                        cached_metrics = gr.HTML(metrics_html(None, True))
                with gr.Accordion("Token view: what was cached", open=True):
                    compare_tokens = gr.HTML()
                with gr.Accordion("JSON (same as `pml-studio run --json`)", open=False):
                    result_json = gr.JSON()

            # -- History -----------------------------------------------------------------------------
            with gr.Tab("5 · History", id="history") as history_tab:
                with gr.Row(elem_classes=["pml-toolbar"]):
                    hist_filter = gr.Dropdown(["all"], value="all", label="Schema", scale=2)
                    refresh_btn = gr.Button("Refresh", size="md", scale=1)
                    export_btn = gr.DownloadButton("Export CSV", size="md", scale=1)
                hist_table = gr.Dataframe(headers=HISTORY_HEADERS, interactive=False, max_height=360, wrap=True,
                                          label="Runs (click a row to select it)", elem_id="history-table",
                                          column_widths=["5%", "15%", "11%", "15%", "11%", "9%", "8%", "8%", "6%",
                                                         "6%", "6%"])
                with gr.Row(elem_classes=["pml-toolbar"]):
                    run_id = gr.Textbox(label="Selected run", placeholder="click a row in the table", scale=1,
                                        elem_id="selected-run")
                    open_btn = gr.Button("Open in editor", size="md", scale=1)
                    rerun_btn = gr.Button("Re-run", variant="primary", size="md", scale=1)
                hist_plot = gr.ScatterPlot(x="prompt tokens", y="TTFT ms", color="path", label="TTFT over prompt length",
                                           color_map={"baseline": "#f97316", "cached": "#4f46e5"}, height=320)
                gr.Markdown(f"Run log: `{runlog.path}`", elem_classes=["pml-note"])

            # -- Model -------------------------------------------------------------------------------
            with gr.Tab("6 · Model", id="model") as model_tab:
                with gr.Row(equal_height=False):
                    with gr.Column(scale=3):
                        model_table = gr.HTML(studio.model_html(), elem_id="model-info")
                    with gr.Column(scale=2):
                        load_btn = gr.Button("Load model now", variant="primary")
                        folder = gr.Textbox(label="Another local model folder",
                                            placeholder="/path/to/model (config.json, weights, tokenizer files)")
                        load_folder_btn = gr.Button("Load this folder")
                        gr.Markdown("Loading happens once; encoded modules are kept per model.",
                                    elem_classes=["pml-note"])

            # -- Benchmarks --------------------------------------------------------------------------
            with gr.Tab("7 · Benchmarks", id="benchmarks") as bench_tab:
                with gr.Row(elem_classes=["pml-toolbar"]):
                    gr.Markdown(f"Latest results of the scripts in `bench/`, read from `{bench._rel(results)}`. "
                                "Run a script to update them.", elem_classes=["pml-note"])
                    bench_refresh = gr.Button("Reload results", size="md", scale=0, min_width=160)
                with gr.Tabs():
                    with gr.Tab("Scaling"):
                        scaling_head = gr.Markdown()
                        scaling_plot = gr.Image(label="assets/scaling.png", type="filepath", interactive=False,
                                                show_label=False, height=420, buttons=["fullscreen"])
                        scaling_plot_note = gr.Markdown()
                        scaling_table = gr.Dataframe(interactive=False, label="TTFT per prompt length", wrap=True)
                        scaling_fits = gr.Dataframe(interactive=False, label="Fits", wrap=True)
                    with gr.Tab("TTFT"):
                        ttft_head = gr.Markdown()
                        ttft_table = gr.Dataframe(interactive=False, label="Speedup per prompt length", wrap=True)
                    with gr.Tab("Memory"):
                        memory_head = gr.Markdown()
                        family_table = gr.Dataframe(interactive=False, label="KV bytes per token by model family",
                                                    wrap=True)
                        sample_table = gr.Dataframe(interactive=False, label="Store bytes per sample schema: "
                                                    "measured vs predicted", wrap=True)
                    with gr.Tab("Fidelity"):
                        fidelity_head = gr.Markdown()
                        fidelity_plot = gr.Image(label="assets/fidelity.png", type="filepath", interactive=False,
                                                 show_label=False, height=380, buttons=["fullscreen"])
                        fidelity_plot_note = gr.Markdown()
                        fidelity_table = gr.Dataframe(interactive=False, label="Accuracy and agreement per path",
                                                      wrap=True)
                        with gr.Row():
                            depth_table = gr.Dataframe(interactive=False, label="Accuracy by needle depth")
                            modules_table = gr.Dataframe(interactive=False, label="Accuracy by number of modules")
                    with gr.Tab("Compression"):
                        compression_head = gr.Markdown()
                        compression_table = gr.Dataframe(interactive=False, wrap=True,
                                                         label="Per storage configuration (needle set)")
                    with gr.Tab("Run scaling here", id="bench-run"):
                        gr.Markdown("Runs the scaling benchmark's own measurement (`bench.workloads.ttft_point`) "
                                    "at small sizes with the loaded model: a warm-up pair, then 1 baseline and "
                                    "1 cached run per length. Results are shown here only; bench/results is "
                                    "left alone.", elem_classes=["pml-note"])
                        with gr.Row(elem_classes=["pml-toolbar"]):
                            small_lengths = gr.CheckboxGroup(list(bench.SMALL_LENGTHS), value=[256, 512],
                                                             label="Prompt lengths (tokens)", scale=3,
                                                             elem_id="small-lengths")
                            small_btn = gr.Button("Run scaling at small sizes", variant="primary", scale=1,
                                                  elem_id="small-run")
                        small_note = gr.Markdown()
                        small_table = gr.Dataframe(headers=bench.SMALL_HEADERS, interactive=False,
                                                   label="Measured now", elem_id="small-table")
                        small_plot = gr.LinePlot(x="prompt tokens", y="TTFT ms", color="path",
                                                 color_map={"baseline": "#c0392b", "cached": "#2471a3"},
                                                 label="TTFT: baseline vs cached", height=340)

        # -- handlers (thin adapters over studio) ---------------------------------------------------

        def validate(schema_text: str, prev_spec):
            v = studio.validate(schema_text)
            spec = v.spec if v.ok and v.spec != prev_spec else gr.skip()
            file = gr.skip()
            if v.ok:
                file = downloads / f"{v.name}.xml"
                file.write_text(schema_text, encoding="utf-8")
            rows = [list(r) for r in v.rows] if v.ok else gr.skip()
            return (v.status_html(), rows, highlight_html(schema_text, v.lines), spec,
                    gr.update(interactive=v.ok), gr.update(interactive=v.ok), file,
                    gr.skip() if v.ok else gr.Accordion(open=True))

        validate_out = [validation, layout_table, highlighted, spec_state, encode_btn, compare_btn, download,
                        source_acc]

        def sync_builder(spec, prompt_text: str, prev):
            if not spec:
                return gr.skip()
            found = selection_from_prompt(spec, prompt_text)
            if found is None:
                if prev and prev.get("spec") == spec:
                    return gr.skip()  # keep what the builder shows until the prompt reads again
                found = ({}, "")
            values, text = found
            nonce = (prev or {}).get("nonce", 0) + 1
            return {"spec": spec, "values": values, "text": text, "nonce": nonce}

        def preview(schema_text: str, prompt_text: str):
            return studio.preview(schema_text, prompt_text)

        schema_code.change(validate, [schema_code, spec_state], validate_out, trigger_mode="always_last",
                           show_progress="hidden")
        spec_state.change(sync_builder, [spec_state, prompt_code, builder_state], builder_state,
                          show_progress="hidden")
        schema_code.change(preview, [schema_code, prompt_code], [prompt_status, token_view],
                           trigger_mode="always_last", show_progress="hidden")
        prompt_code.change(preview, [schema_code, prompt_code], [prompt_status, token_view],
                           trigger_mode="always_last", show_progress="hidden")
        prompt_code.blur(sync_builder, [spec_state, prompt_code, builder_state], builder_state,
                         show_progress="hidden")

        sample.input(load_sample, sample, [schema_code, prompt_code], show_progress="hidden").then(
            sync_builder, [spec_state, prompt_code, builder_state], builder_state, show_progress="hidden")

        def on_upload(file):
            kind, text = read_upload(file)
            return (text, gr.skip()) if kind == "schema" else (gr.skip(), text)

        upload.upload(on_upload, upload, [schema_code, prompt_code]).then(
            sync_builder, [spec_state, prompt_code, builder_state], builder_state, show_progress="hidden")

        # Import from Python: compile a program of the uploaded file into the editor (problems inline)
        def on_py(path, program=None):
            imp = import_program(path, program)
            if not imp.ok:
                return gr.skip(), gr.skip(), gr.skip(), imp.status, gr.skip()
            prompt = imp.prompt if imp.prompt is not None else empty_prompt(imp.program)
            return (imp.schema, prompt, gr.Dropdown(choices=list(imp.roots), value=imp.program, interactive=True),
                    imp.status, path)

        py_out = [schema_code, prompt_code, py_program, py_status, py_path]
        py_upload.upload(on_py, py_upload, py_out).then(
            sync_builder, [spec_state, prompt_code, builder_state], builder_state, show_progress="hidden")
        py_program.input(on_py, [py_path, py_program], py_out).then(
            sync_builder, [spec_state, prompt_code, builder_state], builder_state, show_progress="hidden")

        # Encode
        memory_in = [storage_dtype, retention, method, budget]

        def encode(schema_text: str, storage_: str, mode_: str, dtype_: str, retention_: float, method_: str,
                   budget_, progress=gr.Progress()):
            def report(done: int, total: int, label: str) -> None:
                progress((done, total), desc=f"encoding {label}", unit="units")

            progress(0, desc="loading the model" if not studio.engine.loaded else "encoding")
            view = studio.encode(schema_text, storage_, mode_, report, dtype_, retention_, method_, budget_)
            return view.summary, view.entries, view.units, view.memory, studio.status_html()

        encode_btn.click(encode, [schema_code, storage, mode] + memory_in,
                         [encode_summary, encode_table, unit_table, memory_view, status], api_visibility="private")

        def budget_of(storage_: str):
            return studio.memory_defaults(storage_)["budget_mib"]

        storage.input(budget_of, storage, budget, show_progress="hidden")

        # Compare (streaming, for the page); the API endpoint below returns the JSON document
        def compare_ui(schema_text, prompt_text, storage_, mode_, max_new_, temperature_, dtype_, retention_, method_,
                       budget_):
            last = summary_html(None, "Preparing the run…")
            try:
                for upd in studio.compare_stream(schema_text, prompt_text, storage_, mode_, max_new_, temperature_,
                                                 storage_dtype=dtype_, retention=retention_, method=method_,
                                                 budget_mib=budget_):
                    if upd.phase != "done":
                        last = summary_html(None, upd.message)
                        yield (last, column_html(upd.baseline_text, upd.phase == "baseline"),
                               column_html(upd.cached_text, upd.phase == "cached"), gr.skip(), gr.skip(),
                               gr.skip(), gr.skip(), gr.skip())
                        continue
                    res, data = upd.comparison, upd.result
                    b_mark, c_mark = studio.divergence_offsets(res)
                    yield (summary_html(data), column_html(res.baseline.text, False, b_mark),
                           column_html(res.cached.text, False, c_mark), metrics_html(data["baseline"], False),
                           metrics_html(data["cached"], True), token_view_html(res.plan, studio.decode_token),
                           data, studio.status_html())
            except gr.Error as err:
                yield (summary_html(None, f"The run failed: {err.message}"),) + (gr.skip(),) * 7
                raise

        compare_out = [summary, base_out, cached_out, base_metrics, cached_metrics, compare_tokens, result_json,
                       status]
        compare_in = [schema_code, prompt_code, storage, mode, max_new, temperature] + memory_in

        def compare(schema_text: str, prompt_text: str, max_new_tokens: int = 32, storage: str = "cpu",
                    mode: str = "prefixed", temperature: float = 0.0, storage_dtype: str = "float32",
                    retention: float = 1.0, compression: str = "pyramid") -> dict:
            """Run baseline and cached on a PML prompt and return the `pml-studio run --json` document.

            Args:
                schema_text: the PML schema document (XML text).
                prompt_text: a PML prompt written against that schema.
                max_new_tokens: tokens to generate in each run (at least 1).
                storage: "cpu" or "cuda" (where module KV is stored).
                mode: encoding mode, "prefixed" (default) or "isolated".
                temperature: 0 for greedy decoding (default).
                storage_dtype: precision of stored modules, "float32" (default), "float16" or "bfloat16".
                retention: share of each module's KV kept, in (0, 1]; 1.0 (default) keeps all.
                compression: how tokens are chosen when retention < 1: "pyramid" (default), "uniform", "recent".
            """
            return studio.compare_json(schema_text, prompt_text, max_new_tokens, storage, mode, temperature,
                                       storage_dtype, retention, compression)

        gr.api(compare, api_name="compare")

        # History
        def refresh(schema_filter):
            choices = studio.history_schemas()
            value = schema_filter if schema_filter in choices else "all"
            return (studio.history(value), studio.history_plot(value), gr.update(choices=choices, value=value),
                    studio.export_csv(value, downloads))

        hist_out = [hist_table, hist_plot, hist_filter, export_btn]
        compare_btn.click(compare_ui, compare_in, compare_out, api_visibility="private").then(
            refresh, hist_filter, hist_out, show_progress="hidden")
        history_tab.select(refresh, hist_filter, hist_out, show_progress="hidden")
        refresh_btn.click(refresh, hist_filter, hist_out)
        hist_filter.input(refresh, hist_filter, hist_out, show_progress="hidden")

        def pick_run(evt: gr.SelectData):
            row = evt.row_value or []
            return str(row[0]) if row else gr.skip()

        hist_table.select(pick_run, None, run_id, show_progress="hidden")

        def open_run(rid, tab: str):
            row = studio.open_run(rid)
            return (row["schema_text"], row["prompt_text"], row["storage"], row["mode"],
                    row["max_new_tokens"] or 32, row["temperature"] or 0.0, row.get("storage_dtype") or "float32",
                    row.get("retention") or 1.0, row.get("compression_method") or "pyramid", gr.Tabs(selected=tab))

        open_out = [schema_code, prompt_code, storage, mode, max_new, temperature, storage_dtype, retention, method,
                    tabs]
        open_btn.click(partial(open_run, tab="schema"), run_id, open_out).then(
            validate, [schema_code, spec_state], validate_out).then(
            sync_builder, [spec_state, prompt_code, builder_state], builder_state)
        rerun_btn.click(partial(open_run, tab="compare"), run_id, open_out).then(
            validate, [schema_code, spec_state], validate_out).then(
            compare_ui, compare_in, compare_out).then(refresh, hist_filter, hist_out)

        # Model
        def load(folder_text: str):
            studio.load_model(folder_text)
            return studio.model_html(), studio.status_html()

        load_btn.click(partial(load, ""), None, [model_table, status])
        load_folder_btn.click(load, folder, [model_table, status]).then(
            validate, [schema_code, spec_state], validate_out).then(
            preview, [schema_code, prompt_code], [prompt_status, token_view])
        model_tab.select(studio.model_html, None, model_table, show_progress="hidden")

        # Benchmarks
        def show_benchmarks():
            def table(df):  # an empty table is hidden, not shown as a bare header
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
                    bench.plot_note("fidelity", assets), table(f_sum), table(f_depth), table(f_mods), c_head,
                    table(c_rows))

        bench_out = [scaling_head, scaling_plot, scaling_plot_note, scaling_table, scaling_fits, ttft_head, ttft_table,
                     memory_head, family_table, sample_table, fidelity_head, fidelity_plot, fidelity_plot_note,
                     fidelity_table, depth_table, modules_table, compression_head, compression_table]
        bench_tab.select(show_benchmarks, None, bench_out, show_progress="hidden")
        bench_refresh.click(show_benchmarks, None, bench_out)

        def run_small(lengths, progress=gr.Progress()):
            def report(done: int, total: int, label: str) -> None:
                progress((done, total), desc=label, unit="lengths")

            rows, note = bench.run_small_scaling(studio.engine, lengths, report)
            return bench.small_rows(rows), bench.small_plot(rows), note, studio.status_html()

        small_btn.click(run_small, small_lengths, [small_table, small_plot, small_note, status])

        # First paint: validate the preloaded sample, fill the builder, preview the prompt, list runs.
        demo.load(validate, [schema_code, spec_state], validate_out).then(
            sync_builder, [spec_state, prompt_code, builder_state], builder_state).then(
            preview, [schema_code, prompt_code], [prompt_status, token_view]).then(
            refresh, hist_filter, hist_out)

        # Only /compare is an API; the page's own events stay callable by the page alone.
        for fn in demo.fns.values():
            if fn.api_name != "compare":
                fn.api_visibility = "private"
    return demo


def _render_builder(studio: Studio, state: dict | None, prompt_code: gr.Code) -> None:
    """The builder's widgets for one spec (runs inside ``gr.render``): nested modules sit in their parent's box."""
    if not state:
        gr.Markdown("_The builder appears once the schema is valid._", elem_classes=["pml-note"])
        return
    spec, values = state["spec"], state["values"]
    keys: list[str] = []
    comps: list = []
    params: dict[str, dict] = {}
    unions: set[str] = set()

    def add(key: str, comp) -> None:
        keys.append(key)
        comps.append(comp)

    def module_body(path: str, node: dict) -> None:
        for p in spec["modules"][path]["params"]:
            key = f"{path}@{p['name']}"
            value = values.get(key) or ""
            params[key] = p
            add(key, gr.Textbox(value=value, label=f"{p['name']} · up to {p['len']} tokens", lines=1, max_lines=3,
                                placeholder=f"default: {p['default']}" if p["default"] is not None else "required",
                                info=studio.param_info(value, p["len"], p["default"]), elem_classes=["pml-param"],
                                interactive=True))
        for child in node["children"]:
            visit(child)

    def visit(node: dict) -> None:
        key = node["key"]
        if node["kind"] == "module":
            with gr.Group(elem_classes=["pml-node"]):
                add(key, gr.Checkbox(value=bool(values.get(key)), label=spec["modules"][key]["name"],
                                     elem_classes=["pml-module"], interactive=True))
                if spec["modules"][key]["params"] or node["children"]:
                    with gr.Column(elem_classes=["pml-nested"]):
                        module_body(key, node)
            return
        members = node["children"]
        names = [spec["modules"][m["key"]]["name"] for m in members]
        unions.add(key)
        with gr.Group(elem_classes=["pml-node", "pml-union"]):
            add(key, gr.Radio([("none", NONE)] + [(n, m["key"]) for n, m in zip(names, members)],
                              value=values.get(key) or NONE, label="union: pick at most one", interactive=True))
            for name, m in zip(names, members):
                if spec["modules"][m["key"]]["params"] or m["children"]:
                    with gr.Column(elem_classes=["pml-nested"]):
                        gr.HTML(f'<div class="pml-heading">when <b>{name}</b> is picked</div>')
                        module_body(m["key"], m)

    with gr.Column(elem_classes=["pml-tree"]):
        for node in spec["tree"]:
            visit(node)
    free = gr.Textbox(value=state.get("text", ""), label="New text (not cached)", lines=4,
                      placeholder="Your question or instruction; it is prefilled at request time.",
                      elem_id="builder-free-text", interactive=True)

    def on_change(trigger, *vals):
        values_ = normalise(spec, dict(zip(keys, vals[:-1])), trigger)
        if trigger in params and (values_.get(trigger) or "").strip():
            values_ = _pick_module_of_param(spec, values_, trigger)
        text = compose_prompt(spec, values_, vals[-1])
        updates = []
        for key in keys:
            if key in params:
                p = params[key]
                updates.append(gr.update(info=studio.param_info(values_.get(key), p["len"], p["default"])))
            else:
                updates.append(values_.get(key, NONE if key in unions else False))
        return [text] + updates

    inputs = comps + [free]
    for key, comp in zip(keys, comps):
        comp.input(partial(on_change, key), inputs, [prompt_code] + comps, show_progress="hidden",
                   trigger_mode="always_last", api_visibility="private")
    free.input(partial(on_change, None), inputs, [prompt_code] + comps, show_progress="hidden",
               trigger_mode="always_last", api_visibility="private")


def _pick_module_of_param(spec: dict, values: dict, param_key: str) -> dict:
    """Typing an argument imports its module (and that module's parents)."""
    path = param_key.split("@", 1)[0]
    info = spec["modules"][path]
    values = dict(values)
    if info["union"]:
        values[info["union"]] = path
        return normalise(spec, values, info["union"])
    values[path] = True
    return normalise(spec, values, path)
