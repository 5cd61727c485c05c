"""What every tab shares: the engine (replaced when another model is loaded), the run log, layouts.

Handlers take a :class:`Studio` as their first argument and are plain functions of plain values
(tests call them without a server). Nothing here loads the model; the tokenizer is the engine's
own (``Engine.tokenizer``), loaded once.
"""

from __future__ import annotations

import threading

import gradio as gr

from engine.config import RunConfig
from engine.errors import EngineError
from engine.layout import Layout
from engine.runlog import RunLog, RunLogError

from . import settings as run_settings
from .errors import as_gr_error
from .views import chips_html

DEFAULT_MODEL = "SmolLM2-135M-Instruct"


class Studio:
    """The engine, the run log, and the layouts of recently seen schema texts."""

    def __init__(self, engine, runlog: RunLog):
        self.engine = engine
        self.runlog = runlog
        self.lock = threading.Lock()  # model loads
        self._layouts: dict[tuple[int, str], Layout] = {}

    # -- documents --------------------------------------------------------------------------------

    def layout(self, schema_text: str) -> Layout:
        """The schema's layout (cached by text); raises EngineError."""
        key = (id(self.engine), schema_text)
        lay = self._layouts.get(key)
        if lay is None:
            if not (schema_text or "").strip():
                raise EngineError("1:1: the schema is empty; pick a sample or write <schema name=\"...\">")
            lay = self.engine.layout(schema_text)
            if len(self._layouts) > 32:
                self._layouts.clear()
            self._layouts[key] = lay
        return lay

    @property
    def tokenizer(self):
        """The engine's tokenizer (loaded without the weights when they are not loaded yet)."""
        return self.engine.tokenizer

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    # -- runs -------------------------------------------------------------------------------------

    def run_config(self, settings: dict) -> RunConfig:
        """The RunConfig of the panel's ``settings``, its store ready (device checked, budget applied)."""
        cfg = run_settings.run_config(self.engine.config, settings)
        with as_gr_error():
            self.engine.store(cfg.storage)  # a GPU store without a GPU fails here, with the reason
            if cfg.budget_bytes is not None:
                self.engine.set_budget(cfg.budget_bytes, cfg.storage)
        return cfg

    def record(self, data: dict, schema_text: str, prompt_text: str) -> int | None:
        """Write a finished run to the run log; a failed write is a warning, not a lost result."""
        try:
            return self.runlog.record(data, schema_text, prompt_text)
        except RunLogError as err:
            gr.Warning(str(err))
            return None

    # -- model ------------------------------------------------------------------------------------

    def replace_engine(self, engine) -> None:
        self.engine = engine
        self._layouts.clear()

    def status_html(self) -> str:
        name = self.engine.lm.name if self.engine.loaded else (self.engine.config.model or DEFAULT_MODEL)
        state = "loaded" if self.engine.loaded else "loads on first run"
        return chips_html(str(name), state, str(self.runlog.path))
