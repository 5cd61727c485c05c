"""What every tab shares: the engine (replaced when another model is loaded), the run log, layouts.

Handlers take a :class:`Studio` first and are plain functions of plain values, tested without a server. A run the
run log cannot take waits in memory (at most :data:`PENDING_MAX`) and is written before the next run; at a stop
the rest go to the recovery file (studio/recovery.py), written back at the next start.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import gradio as gr

from engine.public import LOAD_TAKES
from engine.config import RunConfig
from engine.public import START_MODEL, Layout
from engine.errors import EngineError
from engine.config import short_dtype
from engine.runlog import RunLog, RunLogError, utc_now

from . import recovery
from . import settings as run_settings
from .errors import as_gr_error
from .recovery import PendingRun  # noqa: F401 (the studio's name for it)
from .views import chips_html

DEFAULT_MODEL = START_MODEL
PENDING_MAX = 100
# one /compare call holds the studio's single run queue: 30,000 tokens held it for hours
MAX_NEW_TOKENS_CAP = 2048
STOP_WAIT_S = 1.0  # a signal's stop ends within 5 s



@dataclass(frozen=True)
class ModelStatus:
    """The model's state, the one source the header's chip and the Model tab both show."""

    state: str  # "loaded" | "loading" | "failed" | "waiting" (loads when a run needs it)
    name: str
    why: str = ""  # the failure's reason

    @property
    def chip(self) -> str:
        """The header's words: short, and never read as loading once it is loaded."""
        return {"loaded": "loaded", "loading": "loading…", "failed": "failed to load (Model tab)",
                "waiting": "loads on first run"}[self.state]

    @property
    def words(self) -> str:
        """The Model tab's words."""
        return {"loaded": "loaded",
                "loading": f"loading now ({LOAD_TAKES}); an Encode or Compare started meanwhile waits for it",
                "failed": f"failed to load: {self.why}; load it again below, or another model",
                "waiting": "not loaded yet: it loads on the first Encode or Compare (or load it now below)"}[self.state]


@dataclass(frozen=True)
class StopSave:
    written: int = 0
    saved: int = 0  # saved to ``where`` for the next start
    where: Path | None = None
    error: str | None = None  # why the run log refused them
    lost: int = 0
    notes: tuple[str, ...] = ()  # warnings about recovery files


class Studio:
    def __init__(self, engine, runlog: RunLog, recover: bool = True, max_new_tokens_cap: int | None = None):
        self.engine = engine
        self.runlog = runlog
        self.max_new_tokens_cap = max_new_tokens_cap or MAX_NEW_TOKENS_CAP
        self.lock = threading.Lock()  # model loads
        self._layouts: dict[tuple[int, str], Layout] = {}
        self._log_lock = threading.Lock()  # the pending runs and their writing
        self.pending: deque[PendingRun] = deque()  # oldest first
        self.dropped = 0
        self.log_error: str | None = None  # why the last write failed
        self._saved: list = []  # recovery files holding runs that wait in self.pending
        self.preloading = False  # a background load is asked for or under way
        self.load_error: str | None = None  # why the last load failed
        for line in self.recover_pending() if recover else ():
            print(line, file=sys.stderr, flush=True)

    def layout(self, schema_text: str) -> Layout:
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
        return self.engine.tokenizer

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def run_config(self, settings: dict) -> RunConfig:
        cfg = run_settings.run_config(self.engine.config, settings)
        with as_gr_error():
            self.engine.store(cfg.storage)  # a GPU store without a GPU fails here, with the reason
            if cfg.budget_bytes is not None:
                self.engine.set_budget(cfg.budget_bytes, cfg.storage)
        return cfg

    def record(self, data: dict, schema_text: str, prompt_text: str, source: str | None = None,
               toast: bool = True) -> dict:
        """Write a finished run to the run log, after the runs waiting before it; return the ``logged`` report
        (``{"ok", "run_id", "error", "pending", "flushed", "dropped"}``). A run that cannot be written waits."""
        run = PendingRun(data, schema_text, prompt_text, utc_now(), source)
        with self._log_lock:
            if self.runlog.read_only:  # nothing can make it writable: nothing to keep
                return self._report(None, 0, f"not logged: {self.runlog.read_only}", toast)
            self.pending.append(run)
            written, err = self._flush()
            self.log_error = None if err is None else str(err)
            for line in self._resave_or_warn(written):
                print(line, file=sys.stderr, flush=True)
            if err is None:
                return self._report(written[run], len(written) - 1, None, toast)
            lost = self._trim()
            kept = f"kept in memory ({len(self.pending)} waiting, at most {PENDING_MAX}), retried with the next run"
            return self._report(None, len(written), f"not logged: {err}; {kept}{lost}", toast)

    def save_pending(self, wait_s: float = STOP_WAIT_S) -> StopSave:
        """At stop: write the waiting runs, and save those the run log refuses (or a lock held past ``wait_s``) to
        the recovery file."""
        self.runlog.timeout = min(self.runlog.timeout, wait_s)
        held = self._log_lock.acquire(timeout=wait_s)
        try:
            if not self.pending:
                return StopSave()
            written, err = self._flush() if held else ({}, RunLogError("another thread was writing to it"))
            notes = tuple(self._resave_or_warn(written))
            if err is None:
                return StopSave(written=len(written), notes=notes)
            n = len(self.pending)
            try:
                self._resave()
            except OSError as saving:
                return StopSave(len(written), lost=n, error=f"{err}; and no recovery file could be written ({saving})")
            where, self._saved = self._saved[0], []  # the next start's to read
            self.pending.clear()
            return StopSave(len(written), n, where, str(err), notes=notes)
        finally:
            if held:
                self._log_lock.release()

    def recover_pending(self) -> list[str]:
        """At start: write the runs a stop saved for this run log, oldest first with their own times; the console
        lines saying so. A damaged file is renamed aside; runs the log refuses wait in memory and in their file."""
        notes, runs, files = [], [], []
        for path in recovery.existing(self.runlog.path):
            try:
                runs += recovery.read(path)
                files.append(path)
            except recovery.RecoveryFileError as err:
                aside = recovery.set_aside(path)
                kept = f"moved to {aside}" if aside else "left in place"
                notes.append(f"pml-studio: warning: saved runs not recovered: {err}; the file is {kept}, "
                             "the run log is unchanged")
        if not runs:
            return notes
        if self.runlog.read_only:
            return notes + [f"pml-studio: warning: {_runs(len(runs))} saved in {', '.join(map(str, files))} wait "
                            f"for a writable run log: {self.runlog.read_only}"]
        with self._log_lock:
            self.pending.extendleft(reversed(sorted(runs, key=lambda r: r.created_at)))
            self._saved = files
            written, err = self._flush()
            self.log_error = None if err is None else str(err)
            notes += self._resave_or_warn(written)
        if err is None:
            return notes + [f"PML Studio: {_runs(len(written))} saved at the last stop written to the run log "
                            f"{self.runlog.path}"]
        return notes + [f"pml-studio: warning: {len(written)} of {_runs(len(runs))} saved at the last stop written; "
                        f"{len(self.pending)} wait in memory and in {self._saved[0]} ({err})"]

    def _resave(self) -> None:
        """Make the recovery files hold exactly the waiting runs (none: every file removed); raises OSError."""
        keep = recovery.save(self._snapshot(), self.runlog.path) if self.pending else None
        for path in self._saved:
            if path != keep:
                path.unlink(missing_ok=True)
        self._saved = [keep] if keep else []

    def _snapshot(self) -> list[PendingRun]:
        """The waiting runs, read again if another thread wrote one meanwhile (a stop that could not wait)."""
        for _ in range(100):
            try:
                return list(self.pending)
            except RuntimeError:  # deque mutated during iteration
                continue
        return list(self.pending)

    def _resave_or_warn(self, written: dict) -> list[str]:
        if not (written and self._saved):
            return []
        try:
            self._resave()
        except OSError as err:
            return [f"pml-studio: warning: cannot update the recovery file ({err}); remove "
                    f"{', '.join(map(str, self._saved))} once the run log holds its runs"]
        return []

    def _trim(self) -> str:
        n = 0
        while len(self.pending) > PENDING_MAX:
            self.pending.popleft()
            n += 1
        self.dropped += n
        if not n:
            return ""
        return (f"; {self.dropped} unlogged runs dropped so far: the studio keeps the last {PENDING_MAX} "
                f"(fix the run log, or restart with --db another.db)")

    def _flush(self) -> tuple[dict[PendingRun, int], RunLogError | None]:
        """Write the pending runs, oldest first, until one fails. A run leaves :attr:`pending` once written, so a
        stop that cannot wait saves it."""
        written: dict[PendingRun, int] = {}
        while self.pending:
            run = self.pending[0]
            try:
                written[run] = self.runlog.record(run.data, run.schema_text, run.prompt_text,
                                                  created_at=run.created_at, source=run.source)
            except RunLogError as err:
                return written, err
            self.pending.popleft()
        return written, None

    def _report(self, run_id: int | None, flushed: int, error: str | None, toast: bool = True) -> dict:
        if error and toast:
            gr.Warning(error)
        return {"ok": error is None, "run_id": run_id, "error": error, "pending": len(self.pending),
                "flushed": flushed, "dropped": self.dropped}

    def log_problem(self) -> str | None:
        if self.runlog.read_only:
            return f"{self.runlog.read_only}. Its runs are listed; new runs are not logged."
        n = len(self.pending)
        if not n and not self.dropped:
            return None
        text = (f"{n} finished run{'s are' if n != 1 else ' is'} not in the run log yet ({self.log_error}); "
                f"kept in memory (at most {PENDING_MAX}) and written with the next run") if n else ""
        if self.dropped:
            text += f"{'; ' if text else ''}{self.dropped} unlogged runs were dropped (more than {PENDING_MAX} waited)"
        return text

    def replace_engine(self, engine) -> None:
        self.engine = engine
        self.load_error = None
        self._layouts.clear()

    def preload(self, schedule) -> None:
        """Load the weights in the background: ``schedule(fn)`` runs ``fn`` on the engine thread. Until it ends the
        status says loading; a failure is kept for the header and the Model tab (the next run reports it again)."""
        self.preloading = True
        engine = self.engine

        def load() -> None:
            try:
                engine.lm
                self.load_error = None
            except Exception as err:  # noqa: BLE001 (said on the page and the console; the next run raises it)
                self.load_error = str(err) or type(err).__name__
                print(f"pml-studio: the model did not load in the background: {err}", file=sys.stderr, flush=True)
            finally:
                self.preloading = False

        schedule(load)

    def model_status(self) -> ModelStatus:
        engine = self.engine
        if engine.loaded:
            return ModelStatus("loaded", engine.lm.name)
        name = str(engine.config.model or DEFAULT_MODEL)
        if self.preloading or getattr(engine, "loading", False):
            return ModelStatus("loading", name)
        if self.load_error:
            return ModelStatus("failed", name, self.load_error)
        return ModelStatus("waiting", name)

    def status_html(self) -> str:
        model = self.model_status()
        name, state = model.name, model.chip
        cfg = self.engine.config
        if getattr(cfg, "dtype", None):
            state += f" · {short_dtype(cfg.dtype)} · {getattr(cfg, 'weights', 'fp32')} weights"
        if self.runlog.read_only:
            warning = "read-only"
        else:
            warning = f"{len(self.pending)} not logged" if self.pending else ""
        return chips_html(str(name), state, str(self.runlog.path), warning, self.log_problem() or "")


def _runs(n: int) -> str:
    return f"{n} finished run{'s' if n != 1 else ''}"
