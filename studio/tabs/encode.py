"""Encode tab: storage, mode and precision (compression and sinks folded away), the encode button, per-unit
sources, and the Module memory section (budget, persistence, store entries).

Every run setting (:class:`studio.settings.Panel`) is made in :func:`_settings_panel`; the arms and their settings
are made unrendered there and drawn in the Compare tab, where the arms run.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Callable

import gradio as gr

from engine.public import settings_specs
from engine.config import MAX_SINK, RunConfig, short_dtype

from ..errors import as_gr_error
from ..settings import Panel, radio_choices
from ..state import Studio
from ..streaming import in_thread
from ..views import MB, MIB, cards_html, memory_html, note_html, retention_text
from .editors import Editors

ENTRY_HEADERS = ["store entry", "tokens", "MB", "KB / token"]
UNIT_HEADERS = ["unit", "kind", "tokens encoded", "obtained from", "ms", "stored as (tokens)"]
UNITS_NOTE = ("A unit is one encoding pass. A nested module or a union member is encoded after the modules it sits in "
              "(and a union's scaffold member), so its pass counts their tokens too; only its own tokens are stored, "
              "as the last column and Store entries say.")
GPU_PATHS_NOTE = ("pinned storage, layer-wise copies and CUDA graphs apply only where the model computes on CUDA "
                  "(off: CUDA only on a CPU; the Model tab says which are on)")
SOURCE_LABELS = {"memory": "memory", "disk": "disk", "encoded": "fresh encode"}
MODE_NOTE = ("**contextual** (default): answers closer to the baseline's, at the same time and memory: each module is "
             "encoded after the system text before it. **isolated**: each module encoded alone, answers further "
             "from the baseline's, the same time.\n\n"
             "Prompt Cache's scheme is isolated; contextual was called `prefixed` in earlier versions.")
RETENTION_NOTE = ("**Retention** below 1 keeps that share of each module's keys and values (the system text is never "
                  "compressed): **pyramid** keeps the tokens the module's last tokens attend to most, fewer in deeper "
                  "layers (PyramidInfer); **uniform** the same share, by attention, in every layer; **recent** only "
                  "the last tokens. These three choose when a module is stored, before any question is known, so "
                  "they can drop the answer; **question** keeps stored modules whole and, after the prompt's new "
                  "text is read, drops from the run's cache the module tokens that text attends to least. "
                  "**int8 / int4** storage quantizes keys per channel and values per token (KIVI), about 26 % / "
                  "15 % of fp32 bytes with their scales. Storage precision and retention apply to Compare too.")
REPAIR_NOTE = ("**Repair** brings answers closer to the baseline's where modules were encoded apart, for a later "
               "first token: the recomputed tokens are marked in Compare's token view and their cost is inside the "
               "cached TTFT. K = 0 is the plain cached path, bit for bit.\n\n"
               "EPIC's link-token recompute (LegoLink).")
ENCODING = "Encoding this schema… (its figures appear here when it is done)"
ENCODE_NOTE = ("Encoding stores the KV of every module. It runs again only when the schema, model, mode or storage "
               "settings changed; modules saved on disk are loaded instead of encoded.")


@dataclass(frozen=True)
class EncodeTab:
    panel: Panel  # the run settings, by name (Compare reads them too)


def build(studio: Studio, editors: Editors, status: gr.HTML) -> EncodeTab:
    panel = _settings_panel(studio)
    button = gr.Button("Encode schema", variant="primary", elem_id="encode-btn", interactive=False)
    summary = gr.HTML(note_html(ENCODE_NOTE))
    units = gr.Dataframe(headers=UNIT_HEADERS, interactive=False, elem_id="unit-table", max_height=360,
                         label="Units: where each came from, and how long it took", wrap=True)
    gr.Markdown(UNITS_NOTE, elem_classes=["pml-note"], elem_id="units-note")
    with gr.Accordion("Module memory: budget, persistence, store entries", open=True, elem_id="module-memory"):
        with gr.Row(equal_height=True):
            panel.widgets["budget_mib"] = gr.Number(
                memory_defaults(studio)["budget_mib"], label="Module memory budget (MiB)", minimum=0.01, precision=1,
                scale=1, elem_id="budget-mib", info="least recently used unpinned modules are evicted beyond it")
            gr.HTML(persistence_html(studio), elem_id="persistence")
        with gr.Row(equal_height=False):
            with gr.Column(scale=2):
                memory = gr.HTML(note_html("Module memory before and after encoding appears here."),
                                 elem_id="memory-view")
            with gr.Column(scale=3):
                entries = gr.Dataframe(headers=ENTRY_HEADERS, interactive=False, label="Store entries", max_height=360)

    def on_encode(schema_text: str, *values, progress=gr.Progress()):
        def report(done: int, total: int, label: str) -> None:
            progress((done, total), desc=f"encoding {label}", unit="units")

        progress(0, desc="loading the model" if not studio.engine.loaded else "encoding")
        view = encode(studio, schema_text, panel.values(values), report)
        return view.summary, view.entries, view.units, view.memory, studio.status_html()

    outputs = [summary, entries, units, memory]
    # the last schema's figures leave at the click, before the model or the encoding is waited for
    button.click(lambda: (note_html(ENCODING), [], [], note_html(ENCODING)), None, outputs, queue=False,
                 show_progress="hidden").then(on_encode, [editors.schema] + panel.inputs, outputs + [status])
    editors.schema_ok.change(lambda ok: gr.update(interactive=ok), editors.schema_ok, button, show_progress="hidden")
    storage = panel.widgets["storage"]
    storage.input(lambda s: memory_defaults(studio, s)["budget_mib"], storage, panel.widgets["budget_mib"],
                  show_progress="hidden")
    return EncodeTab(panel)


def _settings_panel(studio: Studio) -> Panel:
    from engine.session import gpu_status

    cfg: RunConfig = studio.engine.config
    gpu_ok, gpu_why = gpu_status()
    w: dict = {}
    with gr.Row():
        w["storage"] = gr.Radio(radio_choices("storage"), value=cfg.storage, label="KV storage", interactive=gpu_ok,
                                info=(gpu_why if gpu_ok else "GPU unavailable: " + gpu_explanation(gpu_why))
                                + " · " + GPU_PATHS_NOTE)
        w["mode"] = gr.Radio(radio_choices("mode"), value=cfg.mode, label="Encoding mode")
    gr.Markdown(MODE_NOTE, elem_classes=["pml-note"])
    with gr.Row():
        w["storage_dtype"] = gr.Radio(radio_choices("storage_dtype"), value=cfg.storage_dtype, label="Storage precision",
                                      info="fp16 / bf16 halve module memory, int8 / int4 cut it to about a quarter "
                                           "/ a sixth; answers may move by the rounding; the same time\n"
                                           "cast back to the model's dtype when assembled (int8 / int4: KIVI)",
                                      elem_id="storage-dtype")
    with gr.Accordion("Compression and sinks (expert)", open=False, elem_id="encode-expert"):
        with gr.Row():
            w["retention"] = gr.Slider(0.1, 1.0, value=cfg.compression.retention, step=0.05, label="Retention",
                                       info="below 1: less module memory; the answer loses what the dropped tokens "
                                            "held; the same time or less\nshare of each module's KV kept (1 = all)",
                                       elem_id="retention")
            w["method"] = gr.Radio(radio_choices("method"), value=cfg.compression.method, label="Compression method",
                                   info="which tokens retention keeps: it changes which facts the answer can use, not the "
                                        "time\nused when retention < 1 (pyramid: PyramidInfer)",
                                   elem_id="compression-method")
        gr.Markdown(RETENTION_NOTE, elem_classes=["pml-note"])
        w["sink"] = gr.Slider(0, MAX_SINK, value=cfg.sink, step=1, precision=0, label="Sink tokens (N, isolated)",
                              elem_id="sink", info="isolated mode: answers closer to the baseline's for N more "
                                                   "tokens per module at encode time, none at the first token\n"
                                                   "each module encoded after the prompt's first N tokens (the chat "
                                                   "template's opening, attention sinks); 0 = off")
    w["arms"] = gr.CheckboxGroup(radio_choices("arms"), value=list(cfg.arms), label="Arms: the columns Compare runs",
                                 elem_id="arms", render=False, info="each arm is one way of reaching the first "
                                                                    "token; fewer arms, a shorter wait")
    for spec, name, s in settings_specs():
        w[s.key] = _control(s, getattr(cfg.settings_of(spec.name), name))
    return Panel(w)


def _control(s, value):
    elem = s.key.replace("_", "-")
    if s.limit is None and not s.choices:  # free text (a URL)
        return gr.Textbox(value=value, label=s.title, info=s.words, elem_id=elem, render=False, max_lines=1)
    if s.limit is None:
        return gr.Radio(radio_choices(s.key), value=value, label=s.title, info=s.words, elem_id=elem, render=False)
    top = s.limit.hi if s.widget_max is None else min(s.limit.hi, s.widget_max)
    whole = {"precision": 0} if s.limit.whole else {}  # Gradio then passes an int
    return gr.Slider(s.limit.lo, top, value=value, step=s.step, label=s.title, info=s.words, elem_id=elem,
                     render=False, **whole)



@dataclass(frozen=True)
class EncodeView:
    summary: str  # HTML
    entries: list[list]  # ENTRY_HEADERS rows
    units: list[list]  # UNIT_HEADERS rows
    memory: str  # store readouts before / after (HTML)
    counts: dict  # units by source: memory, disk, encoded
    nbytes: dict = field(default_factory=dict)  # store entry -> bytes (the table rounds)


def encode(studio: Studio, schema_text: str, settings: dict | None = None,
           progress: Callable[[int, int, str], None] | None = None) -> EncodeView:
    cfg = studio.run_config(settings or {})
    with as_gr_error("encoding"):
        lay = studio.layout(schema_text)
        store = studio.engine.store(cfg.storage)
        before = store.stats()
        res = _encoded(studio.engine.encoding(lay, cfg), progress)
    tokens = lay.entry_tokens()
    entries = []
    for name, nbytes in res.bytes_by_module.items():
        n = tokens.get(name, 0)
        entries.append([name, n, round(nbytes / MB, 3), round(nbytes / n / 1000, 1) if n else None])
    units = res.encoded.units
    counts = {src: sum(u.source == src for u in units) for src in SOURCE_LABELS}
    if res.reused and counts["disk"] == 0:
        state = ("Already encoded for this schema, model, mode and storage settings: nothing was recomputed "
                 f"({len(units)} unit(s) in memory).")
    else:
        state = (f"{counts['encoded']} unit(s) encoded afresh, {counts['disk']} loaded from disk, "
                 f"{counts['memory']} already in memory.")
    total_tokens = sum(r[1] for r in entries)
    per_token = res.store_bytes / total_tokens / MB if total_tokens else 0.0
    cards = [("schema store", f"{res.store_bytes / MIB:,.1f} MiB"), ("tokens stored", f"{total_tokens:,}"),
             ("per token", f"{per_token:.4f} MB"), ("encode time", f"{res.encoded.encode_ms / 1000:.2f} s"),
             ("storage", f"{res.encoded.device} · {short_dtype(res.encoded.dtype)}"),
             ("retention", retention_text(cfg.compression.retention, cfg.compression.method))]
    stored = stored_as(res.encoded, tokens)
    unit_rows = [[u.name, u.kind, u.tokens, SOURCE_LABELS.get(u.source, u.source), round(u.ms, 1),
                  ", ".join(stored.get(k, k) for k in u.keys)] for u in units]
    return EncodeView(cards_html(cards, state), entries, unit_rows, memory_html(before, store.stats()), counts,
                      dict(res.bytes_by_module))


def stored_as(encoded, tokens: dict) -> dict[str, str]:
    """{store key: "entry (its tokens)"}: what each unit's pass left in the store."""
    names = {key: name for name, key in {**encoded.module_keys, **encoded.scaffold_keys}.items()}
    by_name = {str(name): n for name, n in tokens.items()}
    out = {}
    for key, name in names.items():
        shown = str(name) or "(anonymous)"
        n = by_name.get(shown)
        out[key] = shown if n is None else f"{shown} ({n})"
    return out


def memory_defaults(studio: Studio, storage: str | None = None) -> dict:
    from engine.errors import EngineError

    cfg = studio.engine.config
    try:
        budget = studio.engine.store(storage or cfg.storage).budget_bytes
    except EngineError:  # e.g. GPU storage without a GPU
        budget = None
    return {"budget_mib": None if budget is None else round(budget / MIB, 1), "persist": cfg.persist,
            "module_dir": str(cfg.modules_path)}


def persistence_html(studio: Studio) -> str:
    d = memory_defaults(studio)
    if d["persist"]:
        state = ('<span class="badge good">persistence on</span> encoded modules are saved under '
                 f'<code>{html.escape(d["module_dir"])}</code> and reloaded after a restart')
    else:
        state = ('<span class="badge">persistence off</span> encoded modules live in memory only '
                 "(start without --no-persist to keep them on disk)")
    return f'<div class="pml-persist">{state}</div>'


def gpu_explanation(why: str) -> str:
    return why.replace("; use --storage cpu", "")


def _encoded(events, progress: Callable[[int, int, str], None] | None):
    """What ``events`` (Engine.encoding) returns, pulled on the engine thread, each unit to ``progress``."""
    for kind, *payload in in_thread(lambda: events):
        if kind == "event" and progress is not None:
            progress(payload[0].done, payload[0].total, payload[0].unit)
        elif kind == "done":
            return payload[0]
