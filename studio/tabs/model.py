"""Model tab: what is loaded (without loading it), load it now, or load another local model folder."""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path

import gradio as gr

from engine.errors import EngineError

from ..errors import as_gr_error
from ..state import DEFAULT_MODEL, Studio
from ..views import kv_html
from .encode import gpu_explanation
from .prompt import PromptTab
from .schema import SchemaTab

log = logging.getLogger("pml-studio")


def build(studio: Studio, tab: gr.Tab, schema: SchemaTab, prompt: PromptTab, status: gr.HTML) -> None:
    with gr.Row(equal_height=False):
        with gr.Column(scale=3):
            table = gr.HTML(model_html(studio), elem_id="model-info")
        with gr.Column(scale=2):
            load_btn = gr.Button("Load model now", variant="primary")
            folder = gr.Textbox(label="Another local model folder",
                                placeholder="/path/to/model (config.json, weights, tokenizer files)")
            load_folder_btn = gr.Button("Load this folder")
            gr.Markdown("Loading happens once; encoded modules are kept per model.", elem_classes=["pml-note"])

    load = partial(_load_ui, studio)
    load_btn.click(partial(load, ""), None, [table, status])
    load_folder_btn.click(load, folder, [table, status]).then(*schema.validate).then(*prompt.preview)
    tab.select(partial(model_html, studio), None, table, show_progress="hidden")


# ----------------------------------------------------------------------------------------------
# Handlers
# ----------------------------------------------------------------------------------------------

def model_info(studio: Studio) -> list[list]:
    """Key/value rows of the model panel (the model is not loaded by this call)."""
    from engine.session import gpu_status

    engine = studio.engine
    ok, why = gpu_status()
    rows = [["model", engine.config.model or f"{DEFAULT_MODEL} (default)"],
            ["status", "loaded" if engine.loaded else "not loaded yet (loads on first encode or compare)"]]
    if engine.loaded:
        info = engine.info()
        rows += [["name", info["model"]], ["device", info["device"]], ["dtype", info["dtype"]],
                 ["parameters", f"{info['parameters']:,}"],
                 ["layers · KV heads · head dim", f"{info['layers']} · {info['kv_heads']} · {info['head_dim']}"],
                 ["KV bytes per token", f"{info['kv_bytes_per_token']:,}"],
                 ["context", f"{info['max_positions']:,} positions"]]
    rows += [["GPU storage", why if ok else "unavailable: " + gpu_explanation(why)],
             ["run log", str(studio.runlog.path)]]
    return rows


def model_html(studio: Studio) -> str:
    return kv_html(model_info(studio))


def load_model(studio: Studio, folder: str | None) -> list[list]:
    """Load the current model (folder empty) or another local model folder; raises gr.Error."""
    from engine.session import Engine

    with studio.lock:
        if not (folder and folder.strip()):
            with as_gr_error("loading the model"):
                studio.engine.lm
            return model_info(studio)
        path = Path(folder.strip()).expanduser()
        if not path.is_dir():
            raise gr.Error(f"{path} is not a folder; give the path of a local transformers model folder "
                           "(config.json, weights and tokenizer files)")
        try:
            engine = Engine(studio.engine.config.with_(model=str(path.resolve())))
            engine.lm
        except EngineError as err:
            raise gr.Error(str(err)) from None
        except Exception as err:
            log.exception("model load failed")
            raise gr.Error(f"cannot load {path}: {type(err).__name__}: {err}") from None
        studio.replace_engine(engine)
    return model_info(studio)


def _load_ui(studio: Studio, folder: str):
    load_model(studio, folder)
    return model_html(studio), studio.status_html()
