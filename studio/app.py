"""The studio's Gradio Blocks: ``build_app(engine, runlog)`` composes one module per tab (studio/tabs/).

Nothing here loads the model. The compare action is also the API endpoint ``/compare`` (docs/cli.md).
"""

from __future__ import annotations

import shutil
import sys
import weakref
from pathlib import Path

import gradio as gr

from engine.runlog import RunLog

from . import benchmarks as bench
from .files import MAX_FILE_BYTES, load_sample, sample_names
from .hosting import private_temp
from .state import Studio
from .tabs import benchmarks, compare, editors, encode, history, model, prompt, schema

ASSETS = Path(__file__).resolve().parent.parent / "assets"
CSS_PATH = ASSETS / "studio.css"
JS_PATH = ASSETS / "studio.js"  # first in the page's <head> (studio/pagescript.py)
DEFAULT_SAMPLE = "travel"
TITLE_HTML = ('<div class="pml-title"><span class="logo">◧</span> PML Studio'
              '<span class="tagline">modular prompt caching — author, encode, compare</span></div>')


def launch_options(demo: gr.Blocks, *, token: str | None, host: str = "127.0.0.1",
                   allow_hosts: tuple[str, ...] = (), api: dict | None = None, connections=None) -> dict:
    """Keyword arguments of ``demo.launch``: the launch-token guard (studio/guard.py), no CORS, the upload cap,
    theme and CSS (Gradio 6 takes them at launch), the OpenAI-compatible API on ``/v1/`` behind the guard, and
    deadlines for slow senders (``connections``: a :class:`~studio.connections.Limits`). The fonts are the
    system's: the page asks no font server for anything."""
    from contextlib import asynccontextmanager

    from starlette.middleware import Middleware

    from .api.routes import ApiRoute
    from .api.serve import studio_api
    from .connections import guard_gradio
    from .errors import bounded_tracebacks
    from .guard import AUTH_JS, LocalGuard, allowed_hosts, no_cors
    from .live import LiveRoute
    from .pagescript import FirstScript
    from .stale_events import StaleEvents

    @asynccontextmanager
    async def lifespan(app):
        no_cors(app)  # Gradio adds its CORS middleware after ours, outside the guard
        yield

    guard_gradio(connections)  # before launch: Gradio's server is made there
    bounded_tracebacks()
    system = ["ui-sans-serif", "system-ui", "sans-serif"]
    mono = ["ui-monospace", "SFMono-Regular", "Menlo", "Consolas", "monospace"]
    theme = gr.themes.Default(primary_hue="indigo", secondary_hue="emerald", neutral_hue="slate",
                              radius_size="md", font=system, font_mono=mono)
    guard = Middleware(LocalGuard, hosts=allowed_hosts(host), proxied=tuple(allow_hosts), token=token)
    middleware = [guard, Middleware(ApiRoute, api=studio_api(demo.studio, **(api or {})))]
    first = "\n".join(p.read_text(encoding="utf-8") for p in (AUTH_JS, JS_PATH) if p.exists())  # the credential first
    middleware += [Middleware(FirstScript, script=first)] if first else []
    middleware += [Middleware(LiveRoute), Middleware(StaleEvents, blocks=demo)]
    return {"theme": theme, "css_paths": [CSS_PATH] if CSS_PATH.exists() else None, "footer_links": ["api"],
            "app_kwargs": {"middleware": middleware, "lifespan": lifespan}, "max_file_size": MAX_FILE_BYTES}


def own_gradio_temp(folder: Path) -> None:
    """Point Gradio's import-time temporary folder at ``folder``: it reads GRADIO_TEMP_DIR once, when imported
    (``route_utils.DEFAULT_TEMP_DIR``, where each launch makes ``vibe_edit_history``), so a studio built after that
    import would otherwise write under ``$TMPDIR/gradio``, a name any account can take first."""
    for name in ("gradio.route_utils", "gradio.routes", "gradio.mcp", "gradio.screen_recording_utils"):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "DEFAULT_TEMP_DIR"):
            module.DEFAULT_TEMP_DIR = str(folder)


def build_app(engine, runlog: RunLog, results_dir: str | Path | None = None,
              assets_dir: str | Path | None = None, max_new_tokens_cap: int | None = None,
              temp: Path | None = None) -> gr.Blocks:
    """The studio around ``engine`` and ``runlog``. The Benchmarks tab reads ``results_dir`` (default:
    ``$PML_STUDIO_RESULTS``, else bench/results, else the installed results) and the plots in ``assets_dir``;
    ``temp``: its private temporary folder (:func:`~studio.hosting.private_temp`; made here when not given)."""
    studio = Studio(engine, runlog, max_new_tokens_cap=max_new_tokens_cap)
    downloads = temp or private_temp()
    own_gradio_temp(downloads / "gradio")
    names = sample_names()
    first = DEFAULT_SAMPLE if DEFAULT_SAMPLE in names else (names[0] if names else None)

    with gr.Blocks(title="PML Studio") as demo:
        demo.studio = studio  # tests and launch reach the run log and engine through this
        demo.downloads = downloads  # studio/shutdown.py removes it at a signal too
        weakref.finalize(demo, shutil.rmtree, downloads, True)
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

        demo.load(*schema_tab.validate).then(*docs.sync).then(*prompt_tab.preview).then(*refresh)
        demo.load(studio.status_html, None, status, show_progress="hidden")  # the model's state now, not at build

        # only /compare is an API; the page's own events stay the page's
        for fn in demo.fns.values():
            if fn.api_name != "compare":
                fn.api_visibility = "private"
    return demo
