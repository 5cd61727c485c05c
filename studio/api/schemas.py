"""The schema an explicit-PML request gives (``pml.schema``): PML text, or the name of one sent inline before,
of the run log's newest run of that schema, or of a sample schema."""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

from engine.errors import EngineError
from engine.public import IDENT

from .errors import ApiError

KEPT = 64  # inline schemas remembered by name
MAX_SAMPLE_NAME = 200  # NAME.xml within a file name's 255 bytes
SAMPLES = Path(__file__).resolve().parent.parent.parent / "sample_schemas"


class SchemaBook:
    def __init__(self, runlog=None, samples: Path = SAMPLES, remember: bool = True):
        """``remember``: keep inline schemas by name (False for a front, which another front may stand in for)."""
        self.runlog, self.samples, self.remember = runlog, samples, remember
        self._inline: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def text(self, given: str) -> str:
        """The schema's PML text: ``given`` itself when it is PML, else the saved schema named ``given``."""
        if given.lstrip().startswith("<"):
            return given
        name = given.strip()
        if not IDENT.match(name):
            raise ApiError(400, f"pml.schema is neither PML text (starting with '<') nor a schema name: '{name[:40]}'",
                           param="pml.schema", code="schema_not_found")
        found = self._inline_named(name) or self._logged(name) or self._sample(name)
        if found is None:
            shown = name if len(name) <= 80 else f"{name[:80]}... ({len(name)} characters)"
            sent = "not sent to this server before, " if self.remember else ""
            raise ApiError(400, f"no schema named '{shown}': {sent}not in the run log "
                           f"{getattr(self.runlog, 'path', '(none)')}, not a sample in {self.samples}; send its PML "
                           "text as pml.schema", param="pml.schema", code="schema_not_found")
        return found

    def keep(self, name: str, text: str) -> None:
        """Remember inline schema ``text`` by its ``name`` once a request has laid it out (so it is parsed once, by
        the run: a schema that does not parse is not remembered)."""
        if not self.remember:
            return
        with self._lock:
            self._inline[name] = text
            self._inline.move_to_end(name)
            while len(self._inline) > KEPT:
                self._inline.popitem(last=False)

    def _inline_named(self, name: str) -> str | None:
        with self._lock:
            return self._inline.get(name)

    def _logged(self, name: str) -> str | None:
        if self.runlog is None:
            return None
        try:
            rows = self.runlog.runs(schema=name, limit=1)
        except EngineError:
            return None
        return rows[0]["schema_text"] if rows else None

    def _sample(self, name: str) -> str | None:
        if len(name.encode()) > MAX_SAMPLE_NAME:
            return None
        path = self.samples / f"{name}.xml"
        try:
            return path.read_text(encoding="utf-8") if path.is_file() else None
        except (OSError, UnicodeDecodeError):  # a sample that cannot be read is not one
            return None
