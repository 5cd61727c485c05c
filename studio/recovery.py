"""The recovery file: finished runs the run log could not take when the studio stopped, read back at the next start.

One :meth:`PendingRun.to_json` per line, 0600 (it holds prompts and answers), beside the run log or else in
``$PML_STUDIO_CACHE`` under a hash of the run log's path, so two run logs never share one.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engine.errors import EngineError

FIELDS = ("created_at", "schema_text", "prompt_text", "data")  # and "source", absent from older files
SUFFIX = ".pending.jsonl"
# 100 waiting runs of a few MB each at most: a larger file is not one the studio wrote
MAX_BYTES = 1 << 30


class RecoveryFileError(EngineError):
    """A recovery file that cannot be read back as runs."""


@dataclass(frozen=True, eq=False)  # each run is itself (hashed by identity)
class PendingRun:
    data: dict  # the `run --json` document
    schema_text: str
    prompt_text: str
    created_at: str
    source: str | None = None  # "api", None for the studio's Compare

    def to_json(self) -> dict:
        """The run as plain JSON values (``data`` holds str subclasses that ``copy.deepcopy`` cannot rebuild)."""
        return json.loads(json.dumps({"created_at": self.created_at, "schema_text": self.schema_text,
                                      "prompt_text": self.prompt_text, "data": self.data, "source": self.source}))

    @classmethod
    def from_json(cls, doc: dict) -> "PendingRun":
        return cls(doc["data"], doc["schema_text"], doc["prompt_text"], doc["created_at"], doc.get("source"))


def places(log_path: Path) -> list[Path]:
    from engine.public import cache_root

    log_path = Path(log_path).expanduser().absolute()
    tag = hashlib.sha256(str(log_path).encode("utf-8")).hexdigest()[:12]
    return [log_path.with_name(log_path.name + SUFFIX), cache_root() / f"{log_path.name}.{tag}{SUFFIX}"]


def existing(log_path: Path) -> list[Path]:
    return [p for p in places(log_path) if p.is_file()]


def save(runs: list[PendingRun], log_path: Path) -> Path:
    """Write ``runs`` to the first of :func:`places` that takes them; its path (or the last OSError)."""
    text = "".join(json.dumps(run.to_json()) + "\n" for run in runs)
    error: OSError | None = None
    for path in places(log_path):
        try:
            write_atomically(path, text)
            return path
        except OSError as err:
            error = err
    raise error


def read(path: Path) -> list[PendingRun]:
    try:
        if path.stat().st_size > MAX_BYTES:
            raise RecoveryFileError(f"{path}: {path.stat().st_size} bytes, more than the {MAX_BYTES} a stop writes")
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise RecoveryFileError(f"{path}: cannot be read ({err})") from None
    runs = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            runs.append(_run(line, f"{path}:{n}"))
    return runs


def set_aside(path: Path) -> Path | None:
    """Rename a damaged recovery file to ``NAME.corrupt`` (``.corrupt.2``... when taken); None when it cannot be."""
    for n in range(1, 100):
        aside = path.with_name(path.name + ".corrupt" + (f".{n}" if n > 1 else ""))
        if aside.exists():
            continue
        try:
            os.replace(path, aside)
            return aside
        except OSError:
            return None
    return None


def write_atomically(path: Path, text: str) -> None:
    """``text`` in ``path``, whole or not at all, readable by this user only (mkstemp, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise




def _run(line: str, where: str) -> PendingRun:
    """One line's run, checked as the run log will read it, so a bad line fails before any run is written."""
    from engine.runlog import arm_rows, row_from_comparison

    try:
        run = json.loads(line)
    except json.JSONDecodeError as err:
        raise RecoveryFileError(f"{where}: not JSON ({err.msg})") from None
    if not isinstance(run, dict) or not all(k in run for k in FIELDS):
        raise RecoveryFileError(f"{where}: not a saved run (it needs {', '.join(FIELDS)})")
    if not all(isinstance(run[k], str) for k in FIELDS[:3]) or not isinstance(run["data"], dict) \
            or not isinstance(run.get("source"), (str, type(None))):
        raise RecoveryFileError(f"{where}: a saved run's texts must be strings and its data an object")
    try:
        row_from_comparison(run["data"], run["schema_text"], run["prompt_text"], created_at=run["created_at"])
        arm_rows(run["data"], 0)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise RecoveryFileError(f"{where}: not a run --json document ({type(err).__name__}: {err})") from None
    return PendingRun.from_json(run)
