"""The studio's Gradio Blocks: ``build_app(engine, runlog)`` composes one module per tab (studio/tabs/).

Tabs: Schema (editor, validation, layout), Prompt (builder generated from the schema, PML prompt,
token view), Encode (storage, mode, precision, per-unit sources, Module memory), Compare (the arms to run, each
arm's settings folded beside it, one streaming column per arm), History (run log), Model and Benchmarks. Nothing here loads the model: that happens on the
first encode or compare, or from the Model tab (``studio.launch`` loads the tokenizer first).

API: the compare action is the endpoint ``/compare``::

    from gradio_client import Client
    client = Client("http://127.0.0.1:7860/", headers={"Authorization": f"Bearer {token}"})  # the launch token
    result = client.predict(schema_text, prompt_text, 32, "cpu", "contextual", 0.0, api_name="/compare")
    # result is the `pml-studio run --json` document (dict); the run is also recorded in the run log
"""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from pathlib import Path

import gradio as gr

from engine.runlog import RunLog

from . import benchmarks as bench
from .files import MAX_FILE_BYTES, load_sample, sample_names
from .state import Studio
from .tabs import benchmarks, compare, editors, encode, history, model, prompt, schema

ASSETS = Path(__file__).resolve().parent.parent / "assets"
CSS_PATH = ASSETS / "studio.css"
JS_PATH = ASSETS / "studio.js"  # first in the page's <head> (studio/pagescript.py): Gradio's status tracker 4 frames a
# second, not 60; a running Compare's texts read from studio/live.py (one streamed response per run)
DEFAULT_SAMPLE = "travel"
TITLE_HTML = ('<div class="pml-title"><span class="logo">◧</span> PML Studio'
              '<span class="tagline">modular prompt caching — author, encode, compare</span></div>')


def launch_options(demo: gr.Blocks, *, token: str | None, host: str = "127.0.0.1",
                   allow_hosts: tuple[str, ...] = (), api: dict | None = None, connections=None) -> dict:
    """Keyword arguments of ``demo.launch``: the guard that lets only the user holding the launch ``token`` drive
    the studio (studio/guard.py; None: any local request, ``--no-token``), no CORS, the upload cap, and theme
    and CSS (Gradio 6 takes them at launch). Behind the guard, the OpenAI-compatible API (studio/api/) answers
    ``/v1/`` and ``/metrics`` on the same port; ``api``: its options (:func:`studio.api.serve.studio_api`).
    The server Gradio starts closes slow senders' connections (studio/connections.py) under ``connections``, a
    :class:`~studio.connections.Limits` (None: its defaults).

    The theme's fonts are the system's: the page asks no font server for anything.
    """
    from contextlib import asynccontextmanager

    from starlette.middleware import Middleware

    from .api.routes import ApiRoute
    from .api.serve import studio_api
    from .connections import guard_gradio
    from .guard import AUTH_JS, LocalGuard, allowed_hosts, no_cors
    from .live import LiveRoute
    from .pagescript import FirstScript

    @asynccontextmanager
    async def lifespan(app):
        no_cors(app)  # before the first request: Gradio adds its CORS middleware after ours, outside the guard
        yield

    guard_gradio(connections)  # before launch: Gradio's server is made there
    system = ["ui-sans-serif", "system-ui", "sans-serif"]
    mono = ["ui-monospace", "SFMono-Regular", "Menlo", "Consolas", "monospace"]
    theme = gr.themes.Default(primary_hue="indigo", secondary_hue="emerald", neutral_hue="slate",
                              radius_size="md", font=system, font_mono=mono)
    guard = Middleware(LocalGuard, hosts=allowed_hosts(host), proxied=tuple(allow_hosts), token=token)
    middleware = [guard, Middleware(ApiRoute, api=studio_api(demo.studio, **(api or {})))]
    first = "\n".join(p.read_text(encoding="utf-8") for p in (AUTH_JS, JS_PATH) if p.exists())  # the credential first
    middleware += [Middleware(FirstScript, script=first)] if first else []
    middleware.append(Middleware(LiveRoute))  # a running Compare's texts, streamed to the page (studio/live.py)
    return {"theme": theme, "css_paths": [CSS_PATH] if CSS_PATH.exists() else None, "footer_links": ["api"],
            "app_kwargs": {"middleware": middleware, "lifespan": lifespan}, "max_file_size": MAX_FILE_BYTES}


def private_temp() -> Path:
    """The studio's temporary folder (0700, :func:`tempfile.mkdtemp`): schema downloads, the CSV export, and Gradio's
    own cache (``GRADIO_TEMP_DIR``: uploads and the copies of every file it serves), which would otherwise go to
    /tmp/gradio, readable by every account and left after the studio stops. Set before the Blocks are built: each
    component reads it when made, Gradio's routes at launch."""
    folder = Path(tempfile.mkdtemp(prefix="pml-studio-"))
    (folder / "gradio").mkdir(mode=0o700)
    os.environ["GRADIO_TEMP_DIR"] = str(folder / "gradio")
    return folder


def build_app(engine, runlog: RunLog, results_dir: str | Path | None = None,
              assets_dir: str | Path | None = None, max_new_tokens_cap: int | None = None) -> gr.Blocks:
    """The studio around ``engine`` (an ``engine.session.Engine``) and ``runlog``.

    The compare action is also an API endpoint, ``api_name="compare"``::

        Client(url).predict(schema_text, prompt_text, max_new_tokens, storage, mode, temperature,
                            storage_dtype, retention, compression, api_name="/compare")

    (the last three are optional) returns the same JSON document as ``pml-studio run --json`` and
    records the run. The Benchmarks tab reads ``results_dir`` (default: ``$PML_STUDIO_RESULTS``, else
    bench/results, else the results installed with the package) and the plots in ``assets_dir``
    (default assets/).
    """
    studio = Studio(engine, runlog, max_new_tokens_cap=max_new_tokens_cap)  # None: state.MAX_NEW_TOKENS_CAP
    downloads = private_temp()
    names = sample_names()
    first = DEFAULT_SAMPLE if DEFAULT_SAMPLE in names else (names[0] if names else None)

    with gr.Blocks(title="PML Studio") as demo:
        demo.studio = studio  # tests and launch reach the run log and engine through this
        demo.downloads = downloads  # studio/shutdown.py removes it at SIGTERM and SIGHUP too (Gradio's cache with it)
        weakref.finalize(demo, shutil.rmtree, downloads, True)  # schema downloads and CSV exports go with the app
        with gr.Row(elem_classes=["pml-header"]):
            gr.HTML(TITLE_HTML)
            status = gr.HTML(studio.status_html())
        docs = editors.create(*(load_sample(first) if first else ("", "")))
        with gr.Tabs(selected="schema") as tabs:
            with gr.Tab("1 · Schema", id="schema"):
                schema_tab = schema.build(studio, docs, downloads, first)
            with gr.Tab("2 · Prompt", id="prompt"):
                prompt_tab = prompt.build(studio, docs)
            with gr.Tab("3 · Encode", id="encode"):
                panel = encode.build(studio, docs, status).panel
            with gr.Tab("4 · Compare", id="compare"):
                compare_tab = compare.build(studio, docs, panel, status)
            with gr.Tab("5 · History", id="history") as history_tab:
                refresh = history.build(studio, tabs, history_tab, docs, schema_tab, panel, compare_tab, downloads)
            with gr.Tab("6 · Model", id="model") as model_tab:
                model.build(studio, model_tab, schema_tab, prompt_tab, status)
            with gr.Tab("7 · Benchmarks", id="benchmarks") as bench_tab:
                benchmarks.build(studio, bench_tab, bench.results_folder(results_dir),
                                 Path(assets_dir or bench.ASSETS), status)

        # First paint: validate the preloaded sample, fill the builder, preview the prompt, list runs.
        demo.load(*schema_tab.validate).then(*docs.sync).then(*prompt_tab.preview).then(*refresh)
        demo.load(studio.status_html, None, status, show_progress="hidden")  # the model's state now, not at build

        # Only /compare is an API; the page's own events stay callable by the page alone.
        for fn in demo.fns.values():
            if fn.api_name != "compare":
                fn.api_visibility = "private"
    return demo
