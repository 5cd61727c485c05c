"""Run log: each comparison as a row of ``runs`` and one row per arm in ``arm_runs`` (SQLite).

    log = RunLog()                       # $PML_STUDIO_CACHE/runs.db
    run_id = log.record(comparison.to_json(), schema_text, prompt_text)
    log.runs(schema="travel", limit=50)  # newest first: row["arms"]["cached"]["ttft_ms"]

A new arm adds rows, not columns. Older logs are migrated when opened, newer ones opened
read-only (docs/cli.md, "The run log").
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import sqlite3
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterator

from sqlite_utils import Database

from engine.arms.registry import REGISTRY
from engine.errors import EngineError, StorageError

TABLE = "runs"
ARM_TABLE = "arm_runs"
VERSION = 2  # PRAGMA user_version: 2 = arm rows in ARM_TABLE

# Column → type; columns are only ever added.
COLUMNS: dict[str, type] = {
    "id": int,
    "created_at": str,
    "model": str,
    "storage": str,
    "mode": str,
    "schema_name": str,
    "schema_hash": str,
    "schema_text": str,
    "prompt_text": str,
    "prompt_tokens": int,
    "cached_tokens": int,
    "uncached_tokens": int,
    "store_bytes": int,
    "max_new_tokens": int,
    "temperature": float,
    "result_json": str,  # the full `run --json` document
    "storage_dtype": str,  # this and below: NULL in older rows
    "retention": float,
    "compression_method": str,
    "units_memory": int,
    "units_disk": int,
    "units_encoded": int,
    "encode_ms": float,
    "budget_bytes": int,
    "evictions": int,
    "prefix_bytes": int,
    "source": str,  # "api"; NULL: the studio
}

ARM_COLUMNS: dict[str, type] = {
    "id": int,
    "run_id": int,
    "arm": str,
    "ttft_ms": float,
    "copy_ms": float,
    "prefill_ms": float,
    "prefill_tokens": int,
    "decode_ms_per_token": float,
    "new_tokens": int,
    "peak_rss_bytes": int,
    "text": str,
    "reused_tokens": int,
    "recomputed_tokens": int,
    "kv_store_bytes": int,
    "kv_held_bytes": int,
    "speedup": float,  # NULL for the baseline
    "same_text": int,
    "first_divergence": int,
    "first_token_agree": int,
    "first_token_kl": float,
    "max_first_logit_diff": float,
    "error": str,  # why the arm could not run (its figures NULL)
    "repeat": int,  # 1: an identical earlier request read back
}
ARM_FIGURES = tuple(c for c in ARM_COLUMNS if c not in ("id", "run_id", "arm"))
# added by the first arm row that holds one (sqlite-utils' alter): opening a log never rewrites it
LATE_ARM_COLUMNS = ("error", "repeat")


class RunLogError(EngineError):
    """The run log cannot be opened or written; ``retry``: whether trying again can help."""

    def __init__(self, message: str, retry: bool = True):
        super().__init__(message)
        self.retry = retry


def default_path() -> Path:
    """``$PML_STUDIO_CACHE/runs.db``."""
    from engine.devices import cache_root

    return cache_root() / "runs.db"


def schema_hash(schema_text: str) -> str:
    """A short hash of a schema's text."""
    return hashlib.sha256(schema_text.encode("utf-8")).hexdigest()[:16]


def utc_now() -> str:
    """ISO 8601, UTC, to the second."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


class RunLog:
    def __init__(self, path: str | Path | None = None, timeout: float = 30.0):
        """Open or create the log at ``path``."""
        self.path = Path(path).expanduser() if path else default_path()
        self.timeout = timeout
        self.read_only: str | None = None  # why this log cannot be written
        try:
            _claim(self.path)
        except StorageError as err:  # refused, or no folder can be made there
            raise RunLogError(str(err), retry=False) from None
        except OSError as err:
            raise RunLogError(f"cannot open the run log {self.path}: {err}; pass another file with --db") from None
        try:
            found = _stored_version(self.path)
            if found is not None and found > VERSION:
                self.read_only = (f"the run log {self.path} was written by a newer PML Studio (schema version "
                                  f"{found}, this one knows {VERSION}): open it with that version, "
                                  "or pass --db another.db")
                return
            with self._db() as db:
                db.enable_wal()
                _create_or_extend(db, TABLE, COLUMNS)
                db[TABLE].create_index(["schema_name"], if_not_exists=True)
                _create_or_extend(db, ARM_TABLE, ARM_COLUMNS, foreign_keys=[("run_id", TABLE, "id")],
                                  late=LATE_ARM_COLUMNS)
                db[ARM_TABLE].create_index(["run_id"], if_not_exists=True)
                if db.execute("PRAGMA user_version").fetchone()[0] < VERSION:
                    _migrate(db)
            _owner_only(self.path)
        except (OSError, sqlite3.Error) as err:
            raise RunLogError(f"cannot open the run log {self.path}: {err}; pass another file with --db") from None

    # -- public API -------------------------------------------------------------------------------

    def record(self, comparison: dict, schema_text: str, prompt_text: str, schema_hash_: str | None = None,
               created_at: str | None = None, source: str | None = None) -> int:
        """Insert a finished ``Comparison.to_json()`` and its arms at once; return the run's id."""
        if self.read_only:
            raise RunLogError(self.read_only, retry=False)
        row = row_from_comparison(comparison, schema_text, prompt_text, schema_hash_, created_at)
        row["source"] = source
        try:
            with self._db() as db:
                # IMMEDIATE waits for the lock; a deferred transaction fails at once
                db.conn.execute("BEGIN IMMEDIATE")
                try:
                    run_id = int(db[TABLE].insert(row).last_pk)
                    db[ARM_TABLE].insert_all(arm_rows(comparison, run_id), alter=True)
                    db.conn.execute("COMMIT")
                except BaseException:
                    db.conn.rollback()
                    raise
                return run_id
        except sqlite3.Error as err:
            raise RunLogError(self._problem(err)) from None

    def runs(self, schema: str | None = None, limit: int | None = 200) -> list[dict]:
        """Runs, newest first, each with ``arms``: {arm: arm row}."""
        where, args = ("schema_name = ?", [schema]) if schema else (None, [])
        with self._reading() as db:
            rows = list(db[TABLE].rows_where(where, args, order_by="id desc", limit=limit))
            return _with_arms(db, rows)

    def get(self, run_id: int) -> dict | None:
        """One run by id, with its ``arms``, or None."""
        if not 0 < int(run_id) < 2**63:  # not a SQLite row id
            return None
        with self._reading() as db:
            rows = _with_arms(db, list(db[TABLE].rows_where("id = ?", [int(run_id)])))
        return rows[0] if rows else None

    def schemas(self) -> list[str]:
        """Names of the schemas that have runs, sorted."""
        with self._reading() as db:
            return [r["schema_name"] for r in db.query(
                f"select distinct schema_name from {TABLE} order by schema_name")]

    def count(self) -> int:
        with self._reading() as db:
            return db[TABLE].count

    def journal_mode(self) -> str:
        with self._reading() as db:
            return db.journal_mode

    def export_csv(self, path: str | Path | None = None, schema: str | None = None) -> str:
        """Write the runs, oldest first, as CSV with ``ARM_FIGURE`` columns (or return the text)."""
        runs = list(reversed(self.runs(schema=schema, limit=None)))
        arms = [a.value for a in REGISTRY if any(a.value in r["arms"] for r in runs)]
        arms += sorted({a for r in runs for a in r["arms"]} - set(arms))  # arms since removed
        names = [c for c in COLUMNS] + [f"{a}_{f}" for a in arms for f in ARM_FIGURES]
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=names, extrasaction="ignore")
        writer.writeheader()
        for r in runs:
            flat = {k: v for k, v in r.items() if k != "arms"}
            flat.update({f"{a}_{f}": v for a, arm in r["arms"].items() for f, v in arm.items() if f in ARM_FIGURES})
            writer.writerow({k: _csv_cell(v) for k, v in flat.items()})
        if path is None:
            return buf.getvalue()
        Path(path).write_text(buf.getvalue(), encoding="utf-8")
        return str(path)

    def __repr__(self) -> str:
        return f"RunLog({str(self.path)!r})"

    # -- internal helpers -------------------------------------------------------------------------

    @contextmanager
    def _db(self) -> Iterator[Database]:
        if self.read_only:
            conn = sqlite3.connect(_read_only_uri(self.path), uri=True, timeout=self.timeout)
        else:
            conn = sqlite3.connect(str(self.path), timeout=self.timeout)
        try:
            yield Database(conn)
        finally:
            conn.close()

    @contextmanager
    def _reading(self) -> Iterator[Database]:
        """:meth:`_db` for a read, raising RunLogError."""
        try:
            with self._db() as db:
                yield db
        except sqlite3.Error as err:
            raise RunLogError(f"cannot read runs: {self._problem(err)}") from None

    def _problem(self, err: sqlite3.Error) -> str:
        """The file, what stopped it, and the fix."""
        name = getattr(err, "sqlite_errorname", "")
        text = str(err)
        if name.startswith(("SQLITE_BUSY", "SQLITE_LOCKED")) or "locked" in text:
            why = (f"is locked by another writer (waited {self.timeout:g} s): let the other program finish "
                   "or close it, or pass --db another.db")
        elif name.startswith(("SQLITE_READONLY", "SQLITE_CANTOPEN", "SQLITE_PERM")) or "readonly" in text:
            why = (f"is read-only ({text}): make the file and its folder writable for this user "
                   "(a WAL database is written beside the file, even to read it), or pass --db another.db")
        else:
            why = f"cannot be used ({text}): check the file and the disk, or pass --db another.db"
        return f"the run log {self.path} {why}"


def _stored_version(path: Path) -> int | None:
    """``PRAGMA user_version`` at ``path`` (None: no database yet)."""
    if not path.is_file() or path.stat().st_size == 0:
        return None
    conn = sqlite3.connect(_read_only_uri(path), uri=True)
    try:
        return int(conn.execute("PRAGMA user_version").fetchone()[0])
    finally:
        conn.close()


def _claim(path: Path) -> None:
    """Make the log's file, private and exclusively ours (``O_EXCL``), or check that the one there, and its WAL
    files, are the user's own in a folder no other account can write to: the log holds every prompt and document,
    and a file another account made stays open to it whatever its mode."""
    from engine.devices import CACHE_FIX
    from engine.owned import check_own_file, create_private, private_folder

    fix = f"pass --db a file in a folder of yours (the default is ~/.cache/pml-studio/runs.db; {CACHE_FIX})"
    private_folder(path.parent, "run log's folder", fix)
    if create_private(path):
        return
    check_own_file(path, "run log", fix)
    for file in (path.with_name(path.name + end) for end in _SIDE_FILES):
        try:
            check_own_file(file, "run log's journal", fix)
        except FileNotFoundError:  # none, or removed meanwhile by the last connection to close
            pass


_SIDE_FILES = ("-wal", "-shm", "-journal")  # SQLite's files beside the log, opened with the same rights


def _owner_only(path: Path) -> None:
    """The log and its WAL files readable by their owner alone (they hold every schema, prompt and answer): a log
    made before, or by a process with a lax umask, is made private at the next open."""
    for file in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        try:
            if file.stat().st_mode & 0o077:
                file.chmod(0o600)
        except OSError:  # absent, or another account's file: opening it already said what matters
            pass


def _read_only_uri(path: Path) -> str:
    """A URI that opens ``path`` without creating or changing any file."""
    with open(path, "rb") as f:
        header = f.read(20)
    wal_format = len(header) == 20 and header[18] == 2
    immutable = wal_format and not path.with_name(path.name + "-wal").exists()
    return path.resolve().as_uri() + ("?immutable=1" if immutable else "?mode=ro")


def _create_or_extend(db: Database, name: str, columns: dict, late: tuple[str, ...] = (), **create) -> None:
    """Create table ``name`` or add the columns it lacks but the ``late`` ones."""
    table = db[name]
    if not table.exists():
        table.create(columns, pk="id", if_not_exists=True, **create)
        return
    for col, typ in columns.items():
        if col not in table.columns_dict and col not in late:
            table.add_column(col, typ)


def _migrate(db: Database) -> None:
    """Arm rows, from its stored document, for every run that has none."""
    db.conn.execute("BEGIN IMMEDIATE")
    try:
        done = {r[0] for r in db.execute(f"select distinct run_id from {ARM_TABLE}")}
        for run_id, doc in db.execute(f"select id, result_json from {TABLE}").fetchall():
            if run_id not in done and doc:
                db[ARM_TABLE].insert_all(arm_rows(json.loads(doc), run_id), alter=True)
        db.conn.execute(f"PRAGMA user_version = {VERSION}")
        db.conn.execute("COMMIT")
    except BaseException:
        db.conn.rollback()
        raise


def _with_arms(db: Database, rows: list[dict]) -> list[dict]:
    """``rows`` with ``arms``: {arm: its row}, in registry order."""
    if not rows:
        return rows
    ids = [r["id"] for r in rows]
    by_run: dict[int, dict] = {i: {} for i in ids}
    marks = ",".join("?" * len(ids))
    for a in db[ARM_TABLE].rows_where(f"run_id in ({marks})", ids, order_by="id"):
        by_run[a["run_id"]][a["arm"]] = {k: v for k, v in a.items() if k not in ("id", "run_id", "arm")}
    order = [a.value for a in REGISTRY]
    for r in rows:
        arms = by_run[r["id"]]
        r["arms"] = {a: arms[a] for a in sorted(arms, key=lambda a: order.index(a) if a in order else len(order))}
    return rows


def _csv_cell(value):
    """A text cell a spreadsheet will not run as a formula."""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


def row_from_comparison(data: dict, schema_text: str, prompt_text: str, schema_hash_: str | None = None,
                        created_at: str | None = None) -> dict:
    """The run's row from a ``run --json`` document."""
    sampling = data.get("sampling", {})
    compression = data.get("compression") or {}
    enc = data.get("encode") or {}
    stats = data.get("store_stats") or {}
    return {
        "created_at": created_at or utc_now(),
        "model": data["model"], "storage": data["storage"], "mode": data["mode"],
        "schema_name": data["schema"], "schema_hash": schema_hash_ or schema_hash(schema_text),
        "schema_text": schema_text, "prompt_text": prompt_text,
        "prompt_tokens": data["prompt_tokens"], "cached_tokens": data["cached_tokens"],
        "uncached_tokens": data["uncached_tokens"], "store_bytes": data["store_bytes"],
        "max_new_tokens": sampling.get("max_new_tokens"), "temperature": sampling.get("temperature"),
        "result_json": json.dumps(data, sort_keys=True),
        "storage_dtype": data.get("storage_dtype"), "retention": compression.get("retention"),
        "compression_method": compression.get("method"), "units_memory": enc.get("memory"),
        "units_disk": enc.get("disk"), "units_encoded": enc.get("encoded"), "encode_ms": enc.get("ms"),
        "budget_bytes": stats.get("budget_bytes"), "evictions": stats.get("evictions"),
        "prefix_bytes": stats.get("prefix_bytes") if data.get("prefix") else None,
    }


def arm_rows(data: dict, run_id: int) -> list[dict]:
    """One row per arm, read as the views read it."""
    from engine.arms.compare import Comparison

    comp = Comparison.from_json(data)
    out = []
    for arm, res in comp.arms.items():
        run, agree = res.run, res.agreement
        if not res.ran:  # no figures
            out.append({"run_id": run_id, "arm": arm.value, "text": run.text, "error": res.error, "repeat": 0})
            continue
        row = {"run_id": run_id, "arm": arm.value, "ttft_ms": run.ttft_ms, "copy_ms": run.copy_ms,
               "prefill_ms": run.prefill_ms, "prefill_tokens": run.prefill_tokens,
               "decode_ms_per_token": run.decode_ms_per_token, "new_tokens": run.decode_tokens,
               "peak_rss_bytes": run.peak_rss_bytes, "text": run.text, "reused_tokens": run.reused_tokens,
               "recomputed_tokens": run.recomputed_tokens, "kv_store_bytes": run.kv_store_bytes,
               "kv_held_bytes": run.kv_held_bytes, "speedup": _speedup(data, comp, arm)}
        row.update({k: (None if agree is None else _flag_or(getattr(agree, k))) for k in
                    ("same_text", "first_divergence", "first_token_agree", "first_token_kl", "max_first_logit_diff")})
        row["repeat"] = int(res.repeat)
        out.append(row)
    return out


def _flag_or(value):
    """0/1 for a boolean."""
    return int(value) if isinstance(value, bool) else value


def _speedup(data: dict, comp, arm) -> float | None:
    """The arm's speedup as its document wrote it."""
    spec = REGISTRY[arm]
    if arm.value != "baseline" and f"{spec.json_stem}speedup" in data:
        return data[f"{spec.json_stem}speedup"]
    x = comp.speedup(arm)
    return None if x is None else round(x, 3)
