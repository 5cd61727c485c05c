"""Compare tab: the arms stream side by side (one column per arm that runs), then figures and the token view.

The same comparison is the ``/compare`` API endpoint. A finished run goes to the run log (one the log cannot take
waits in memory, and the page says so); a stopped one shows its partial texts and is not logged.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Iterator

import gradio as gr

from engine.public import FirstToken, Token, UnitEncoded, Warming

from ..arm_views import document, view_of, views as arm_views
from ..errors import as_gr_error, refusal, user_error
from ..live import RUNS
from ..settings import Panel
from ..state import Studio
from ..streaming import in_thread
from ..views import (column_html, first_token_html, head_html, logged_html, metrics_html, not_run_html, note_html,
                     prefix_stop, stopped_html, summary_html, token_marks, token_view_html)
from .editors import Editors, Step


@dataclass(frozen=True)
class CompareTab:
    max_new: gr.Slider
    temperature: gr.Slider
    run: object  # the Compare button's event (history chains a refresh after it)
    stream: Step


def build(studio: Studio, editors: Editors, panel: Panel, status: gr.HTML) -> CompareTab:
    arms = studio.engine.config.arms
    most = min(256, studio.max_new_tokens_cap)
    with gr.Row(equal_height=True, elem_classes=["pml-toolbar"]):
        max_new = gr.Slider(1, most, value=min(32, most), step=1, label="Max new tokens", scale=3,
                            elem_id="max-new-tokens")
        temperature = gr.Slider(0.0, 2.0, value=0.0, step=0.05, label="Temperature", scale=3,
                                info="0 = greedy (default); applies to every arm")
        button = gr.Button("Compare", variant="primary", scale=1, elem_id="compare-btn", interactive=False)
        stop = gr.Button("Stop", variant="stop", scale=0, min_width=80, elem_id="compare-stop")
    stopped_note = gr.HTML("", elem_id="stop-note")  # what a Stop did when no Compare was running
    arm_controls(studio, panel)
    summary = gr.HTML(summary_html(None), elem_id="compare-summary")
    columns = []
    with gr.Row(equal_height=False):
        for view in arm_views():
            with gr.Column(elem_classes=["pml-col", view.arm], visible=view.arm in arms) as col:
                gr.HTML(head_html(view))
                text = gr.HTML(column_html("", False), elem_id=f"{view.arm}-text")
                metrics = gr.HTML(metrics_html(None, view.arm), elem_id=f"{view.arm}-metrics")
            columns += [col, text, metrics]
    with gr.Accordion("Token view: what was cached", open=True):
        tokens = gr.HTML(elem_id="compare-tokens")
    with gr.Accordion("JSON (same as `pml-studio run --json`)", open=False):
        result = gr.JSON()

    inputs = [editors.schema, editors.prompt, max_new, temperature] + panel.inputs
    outputs = [summary] + columns + [tokens, result, status]
    stream = Step(_streamer(studio, panel), inputs, outputs)
    # no progress overlay: its animations took CPU from the decoding
    run = button.click(*stream, api_visibility="private", show_progress="hidden")
    button.click(lambda: "", None, stopped_note, queue=False, show_progress="hidden")
    # outside the queue, which the Compare holds; cancels=[run] also drops a Compare still waiting
    stop.click(stop_ui, None, [summary] + columns + [stopped_note], queue=False, cancels=[run], api_visibility="private",
               show_progress="hidden")
    editors.schema_ok.change(lambda ok: gr.update(interactive=ok), editors.schema_ok, button, show_progress="hidden")
    _api(studio)
    return CompareTab(max_new, temperature, run, stream)


ARM_ACCORDION = "{title}: settings"


def arm_controls(studio: Studio, panel: Panel) -> None:
    from engine.public import settings_specs

    from .encode import REPAIR_NOTE

    by_arm: dict[str, list] = {}
    for spec, _, s in settings_specs():
        by_arm.setdefault(spec.name, []).append(panel.widgets[s.key])
    with gr.Row(equal_height=False, elem_id="arm-toggles"):
        with gr.Column(scale=2):
            panel.widgets["arms"].render()
        with gr.Column(scale=3):
            for arm, widgets in by_arm.items():
                with gr.Accordion(ARM_ACCORDION.format(title=view_of(arm).title), open=False,
                                  elem_id=f"{arm}-settings"):
                    if arm == "cached":
                        gr.Markdown(REPAIR_NOTE, elem_classes=["pml-note"])
                    for widget in widgets:
                        widget.render()


def _api(studio: Studio) -> None:
    async def compare(schema_text: str, prompt_text: str, max_new_tokens: int = 32, storage: str = "cpu",
                      mode: str = "contextual", temperature: float = 0.0, storage_dtype: str = "float32",
                      retention: float = 1.0, compression: str = "pyramid") -> dict:
        """Run the arms on a PML prompt; the `pml-studio run --json` document plus "logged" ({"ok", "run_id",
        "error", "pending", "flushed", "dropped"}: whether the run reached the run log).

        Args:
            schema_text: the PML schema (XML text).
            prompt_text: a PML prompt written against that schema.
            max_new_tokens: tokens to generate in each arm.
            storage: "cpu" or "cuda" (where module KV is stored).
            mode: "contextual" (default) or "isolated".
            temperature: 0 for greedy decoding (default).
            storage_dtype: "float32" (default), "float16" or "bfloat16".
            retention: share of each module's KV kept, in (0, 1].
            compression: "pyramid" (default), "uniform" or "recent", when retention < 1.
        """
        settings = {"storage": storage, "mode": mode, "storage_dtype": storage_dtype, "retention": retention,
                    "method": compression}
        return await cancellable(compare_json, studio, schema_text, prompt_text, max_new_tokens, temperature, settings)

    gr.api(compare, api_name="compare")


@dataclass(frozen=True)
class CompareUpdate:
    phase: str  # "encoding", an arm's name while it generates, "first", "stopped" or "done"
    texts: dict  # arm -> text so far
    arms: tuple[str, ...]
    message: str = ""
    result: dict | None = None  # the `run --json` document, on "done"
    run_id: int | None = None  # None when the run could not be logged
    comparison: object = field(default=None, repr=False)
    logged: dict | None = None  # Studio.record's report, on "done"
    live: object = field(default=None, repr=False)  # studio.live.LiveRun
    firsts: dict = field(default_factory=dict)  # arm -> its RunResult, once it has its first token


STOPPED = "Stopped: the partial run is not in the run log."
NOTHING_TO_STOP = "Nothing to stop: no Compare of this page is running."
DECODING = "Every arm has its first token (TTFTs below); decoding…"

# between two updates through Gradio when no page fetches the texts itself (studio/live.py says why)
UPDATE_EVERY = 0.5


def sampling_of(max_new_tokens, temperature=0.0, top_p: float = 1.0, seed: int = 0, cap: int | None = None):
    from engine.public import Sampling

    with as_gr_error("reading the sampling settings"):
        sampling = Sampling(max_new_tokens=max_new_tokens,
                            temperature=0.0 if temperature in (None, "") else temperature, top_p=top_p, seed=seed)
    if cap is not None and sampling.max_new_tokens > cap:
        raise refusal(f"max new tokens is {sampling.max_new_tokens}, above this studio's cap of {cap}: ask for at most "
                      f"{cap}, or start the studio with --max-new-tokens-cap N (or PML_STUDIO_MAX_NEW_TOKENS_CAP=N)")
    return sampling


def compare_stream(studio: Studio, schema_text: str, prompt_text: str, max_new_tokens, temperature=0.0,
                   settings: dict | None = None, owner: str = "") -> Iterator[CompareUpdate]:
    """Run the arms on the engine thread, yielding each arm's text as it grows; the last update is "done" (logged)
    or "stopped" (not logged). A failure raises gr.Error."""
    sampling = sampling_of(max_new_tokens, temperature, cap=studio.max_new_tokens_cap)
    cfg = studio.run_config(settings or {})
    texts = {arm: "" for arm in cfg.arms}
    live = RUNS.open(cfg.arms, owner)
    yield CompareUpdate("encoding", dict(texts), cfg.arms, "Preparing the run…", live=live)

    events = partial(studio.engine.events, schema_text, prompt_text, sampling, config=cfg)
    # one update per UPDATE_EVERY at most, none while the page fetches the texts itself: each costs it CPU
    shown, held = time.monotonic(), None
    stopped, firsts, res = False, {}, None
    try:
        for kind, *payload in in_thread(events, tick=UPDATE_EVERY, stop=live.stop, pick=partial(_on_engine, live)):
            event = payload[0] if kind == "event" else None
            if kind == "stopped":
                stopped = True
            elif kind == "done":
                res = payload[0]
            elif isinstance(event, (UnitEncoded, Warming)):
                yield CompareUpdate("encoding", dict(texts), cfg.arms, _encoding(event), live=live)
            elif isinstance(event, Token):
                texts[event.arm], held = event.text, event.arm
            elif isinstance(event, FirstToken):  # an arm's TTFT is shown at once
                texts[event.arm], firsts[event.arm] = event.text, event.run
                rest = [v.arm for v in arm_views() if v.arm in cfg.arms and v.arm not in firsts]
                yield CompareUpdate("first", dict(texts), cfg.arms, _progress(rest[0]) if rest else DECODING,
                                    live=live, firsts=dict(firsts))
            if held is not None and live.watched:
                held = None
            if held is not None and time.monotonic() - shown >= UPDATE_EVERY:
                yield CompareUpdate(held, dict(texts), cfg.arms, _progress(held), live=live, firsts=dict(firsts))
                shown, held = time.monotonic(), None
    except Exception as err:
        if held is not None:  # show what came before the failure
            yield CompareUpdate(held, dict(texts), cfg.arms, _progress(held), live=live, firsts=dict(firsts))
        raise user_error(err) from None
    finally:
        live.stop.set()  # a reader gone before the end (Gradio's cancel) stops the engine too
        live.finish()
    if stopped:
        yield CompareUpdate("stopped", dict(live.texts), cfg.arms, STOPPED, live=live, firsts=dict(firsts))
        return
    data = document(res)
    logged = studio.record(data, schema_text, prompt_text)
    final = {str(arm): r.run.text for arm, r in res.arms.items()}
    yield CompareUpdate("done", final, tuple(final), "", data, logged["run_id"], res, logged, live)


def _on_engine(live, event) -> bool:
    """On the engine thread, for every event: the live page's text; whether the reader gets the event (a token
    only when no page fetches the texts: each hand-over wakes a thread)."""
    if isinstance(event, FirstToken):
        live.firsts[event.arm] = event.run
    if isinstance(event, (FirstToken, Token)):
        everyone = all(arm in live.firsts for arm in live.texts)
        live.show(event.arm, event.text, DECODING if everyone else _progress(event.arm))
        return isinstance(event, FirstToken) or not live.watched
    return True


def _encoding(event) -> str:
    if isinstance(event, Warming):
        return warming_words(event.tokens)
    return f"Encoding modules {event.done}/{event.total}: {event.unit}"


def warming_words(tokens: int) -> str:
    """What the run does while the prefix cache is warmed (no module is encoded then)."""
    return (f"Warming the prefix cache: prefilling the schema's {tokens:,} tokens in schema order, once per schema, as "
            "a server that had served this schema would hold them (in no arm's TTFT)…")


async def cancellable(work, *args):
    """``work(*args, stop=flag)`` in a worker thread; a cancelled call or a caller gone sets ``flag``."""
    stop, gone = threading.Event(), _caller_gone()
    task = asyncio.ensure_future(asyncio.to_thread(work, *args, stop=stop))
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a stopped run's error goes to no one
    try:
        while not task.done():
            await asyncio.wait([task], timeout=0.2)
            if gone():
                stop.set()
        return task.result()
    finally:
        stop.set()


def _caller_gone():
    """Whether the current Gradio event's caller has gone (Gradio lets a non-generator run on)."""
    from gradio.context import LocalContext

    blocks, event_id = LocalContext.blocks.get(None), LocalContext.event_id.get(None)

    def gone() -> bool:
        jobs = getattr(getattr(blocks, "_queue", None), "active_jobs", None) or ()
        return any(e._id == event_id and not e.alive for job in jobs if job for e in job)

    return gone


def compare_json(studio: Studio, schema_text: str, prompt_text: str, max_new_tokens=32, temperature=0.0,
                 settings: dict | None = None, stop: threading.Event | None = None) -> dict:
    sampling = sampling_of(max_new_tokens, temperature, cap=studio.max_new_tokens_cap)
    cfg = studio.run_config(settings or {})
    events = partial(studio.engine.events, schema_text, prompt_text, sampling, config=cfg)
    with as_gr_error():
        for kind, *payload in in_thread(events, stop=stop or threading.Event(), pick=lambda event: False):
            if kind == "stopped":
                raise refusal("the run was stopped on request")
            res = payload[0]
    data = document(res)
    logged = studio.record(data, schema_text, prompt_text)
    return {**data, "logged": logged}


def divergence_offsets(studio: Studio, comparison) -> dict[str, int | None]:
    """Character offset, per arm, where its text starts to differ from the baseline's; the baseline is marked at the
    earliest divergence of any arm."""
    from engine.public import first_divergence

    base = comparison.baseline
    out: dict[str, int | None] = {}
    if base is None:
        return out
    first: dict[str, int] = {}
    for arm, res in comparison.arms.items():
        arm, run = arm.value, res.run
        k = None if arm == "baseline" or not res.ran else first_divergence(base.token_ids, run.token_ids)
        if k is not None:
            first[arm] = k
            out[arm] = _chars(studio, run, k)
    if first:
        out["baseline"] = _chars(studio, base, min(first.values()))
    return out


def _chars(studio: Studio, run, k: int) -> int:
    prefix = studio.tokenizer.decode(list(run.token_ids[:k]), skip_special_tokens=True)
    return len(prefix) if run.text.startswith(prefix) else min(len(prefix), len(run.text))


def stop_ui(request: gr.Request):
    """Stop the session's run and end every column in a stopped state at once (the run's own last update may never
    come: the Stop cancels it): the summary, then (column, text, figures) per arm."""
    asked = RUNS.stop(getattr(request, "session_hash", None) or "")
    if not asked:  # said beside the button, the last run's figures left as they are
        return (gr.skip(),) * (1 + 3 * len(arm_views())) + (note_html(NOTHING_TO_STOP),)
    run = asked[-1]
    cols = []
    for view in arm_views():
        cols += [gr.skip(), column_html(run.texts.get(view.arm, ""), False, stopped=True), stopped_html(run.firsts.get(view.arm),
                                                                                          view.arm)]
    return (summary_html(None, STOPPED), *cols, "")


def _streamer(studio: Studio, panel: Panel):
    """:func:`_stream_ui` with the request, whose session owns the run (Stop stops that session's run only)."""
    def stream(request: gr.Request, schema_text, prompt_text, max_new, temperature, *values):
        owner = getattr(request, "session_hash", None) or ""
        yield from _stream_ui(studio, panel, schema_text, prompt_text, max_new, temperature, *values, owner=owner)
    return stream


def _stream_ui(studio: Studio, panel: Panel, schema_text, prompt_text, max_new, temperature, *values, owner: str = ""):
    """compare_stream as component updates: summary, (column, text, metrics) per arm, tokens, JSON, status."""
    try:
        sent: dict = {}  # an update carries only what changed: each part costs a re-render
        for upd in compare_stream(studio, schema_text, prompt_text, max_new, temperature, panel.values(values),
                                  owner):
            if upd.phase != "done":
                cols = []
                for view in arm_views():
                    shown = view.arm in upd.arms
                    html = column_html(upd.texts.get(view.arm, ""), upd.phase == view.arm, stopped=upd.phase == "stopped")
                    first = upd.firsts.get(view.arm)
                    figures = (stopped_html(first, view.arm) if upd.phase == "stopped"
                               else metrics_html(None, view.arm) if first is None else first_token_html(first, view.arm))
                    cols += [_changed(sent, f"{view.arm}:col", shown, gr.Column(visible=shown)),
                             _changed(sent, f"{view.arm}:text", html, html),
                             _changed(sent, f"{view.arm}:metrics", figures, figures)]
                live = upd.live.marker() if upd.live is not None and upd.phase != "stopped" else ""
                summary = summary_html(None, upd.message, live)
                yield (_changed(sent, "summary", summary, summary), *cols, _changed(sent, "tokens", "", ""),
                       _changed(sent, "json", None, None), gr.skip())
                continue
            comparison = upd.comparison
            marks = divergence_offsets(studio, comparison)
            cols = []
            for view in arm_views():
                res = comparison.arm(view.arm)
                text = column_html(upd.texts.get(view.arm, ""), False, marks.get(view.arm), view.arm == "baseline") \
                    if res is None or res.ran else not_run_html()
                cols += [gr.Column(visible=res is not None), text, metrics_html(comparison, view.arm)]
            tokens = token_view_html(comparison.plan, studio.decode_token, token_marks(comparison),
                                     prefix_stop(comparison))
            yield (summary_html(comparison) + logged_html(upd.logged), *cols, tokens, upd.result, studio.status_html())
    except gr.Error as err:
        yield (summary_html(None, f"The run failed: {err.message}"),) + (gr.skip(),) * (3 * len(arm_views()) + 3)
        raise


def _changed(sent: dict, key: str, value, update):
    if sent.get(key, _changed) == value:
        return gr.skip()
    sent[key] = value
    return update


def _progress(arm: str) -> str:
    return view_of(arm).progress
