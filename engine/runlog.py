"""Run log: every baseline-vs-cached comparison as one row of a SQLite table (sqlite-utils only here).

    log = RunLog()                       # $PML_STUDIO_CACHE/runs.db, WAL mode
    run_id = log.record(comparison.to_json(), schema_text, prompt_text)
    log.runs(schema="travel", limit=50)  # newest first
    log.export_csv("runs.csv")

Each operation opens its own connection (SQLite connections must not cross threads) and
waits up to ``timeout`` seconds for the write lock, so runs finishing at the same moment in
two browser tabs are both written. A row is inserted in one transaction, from a comparison
that has already finished: a failed run never leaves a partial row. The schema text is kept
with every run so that a run can be reopened in the editor.
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

from .errors import EngineError

TABLE = "runs"

# Column → type. New columns may be added (older databases get them on open); none renamed.
COLUMNS: dict[str, type] = {
    "id": int,
    "created_at": str,  # ISO 8601, UTC
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
    "baseline_ttft_ms": float,
    "cached_ttft_ms": float,
    "copy_ms": float,
    "baseline_decode_ms_per_token": float,
    "cached_decode_ms_per_token": float,
    "baseline_new_tokens": int,
    "cached_new_tokens": int,
    "baseline_peak_rss_bytes": int,
    "cached_peak_rss_bytes": int,
    "baseline_text": str,
    "cached_text": str,
    "speedup": float,
    "same_text": int,
    "first_divergence": int,
    "first_token_agree": int,
    "first_token_kl": float,
    "max_first_logit_diff": float,
    "result_json": str,  # the full `run --json` document
    # module memory (issue 5); NULL in rows written before these existed
    "storage_dtype": str,  # float32 | float16 | bfloat16
    "retention": float,  # mean fraction of module KV kept per layer (1.0 = uncompressed)
    "compression_method": str,  # pyramid | uniform | recent
    "units_memory": int,  # schema units found in memory before the run
    "units_disk": int,  # ... loaded from the persisted module folder
    "units_encoded": int,  # ... encoded afresh
    "encode_ms": float,
    "budget_bytes": int,  # module memory budget of the store
    "evictions": int,  # store evictions so far (after the run)
    # prefix-cache arm (issue 9); NULL in rows written before it existed or when the arm was not run
    "prefix_ttft_ms": float,
    "prefix_copy_ms": float,
    "prefix_decode_ms_per_token": float,
    "prefix_new_tokens": int,
    "prefix_peak_rss_bytes": int,
    "prefix_text": str,
    "prefix_reused_tokens": int,  # leading prompt tokens taken from the prefix cache
    "prefix_prefilled_tokens": int,
    "prefix_repeat": int,  # the whole prompt was cached already
    "prefix_warmed_with": str,  # what the prefix cache held before the run (summary)
    "prefix_speedup": float,  # baseline TTFT / prefix TTFT
    "prefix_same_text": int,
    "prefix_first_token_kl": float,
    "prefix_bytes": int,  # bytes the prefix cache held after the run
}

# Columns the studio's history table shows, in order.
SUMMARY = ("id", "created_at", "schema_name", "model", "storage", "mode", "prompt_tokens", "cached_tokens",
           "baseline_ttft_ms", "cached_ttft_ms", "speedup", "same_text", "first_token_kl", "prefix_reused_tokens",
           "prefix_ttft_ms", "prefix_speedup")


class RunLogError(EngineError):
    """The run log cannot be opened or written (path not writable, not a SQLite file...)."""


def default_path() -> Path:
    """``$PML_STUDIO_CACHE/runs.db`` (default ``~/.cache/pml-studio/runs.db``)."""
    from .models import cache_root

    return cache_root() / "runs.db"


def schema_hash(schema_text: str) -> str:
    """Short content hash identifying a schema's exact text."""
    return hashlib.sha256(schema_text.encode("utf-8")).hexdigest()[:16]


class RunLog:
    def __init__(self, path: str | Path | None = None, timeout: float = 30.0):
        self.path = Path(path).expanduser() if path else default_path()
        self.timeout = timeout
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._db() as db:
                db.enable_wal()
                table = db[TABLE]
                if not table.exists():
                    table.create(COLUMNS, pk="id", if_not_exists=True)
                    table.create_index(["schema_name"], if_not_exists=True)
                else:
                    missing = {c: t for c, t in COLUMNS.items() if c not in table.columns_dict}
                    for col, typ in missing.items():
                        table.add_column(col, typ)
        except (OSError, sqlite3.Error) as err:
            raise RunLogError(f"cannot open the run log {self.path}: {err}; pass another file with --db") from None

    # -- public API -------------------------------------------------------------------------------

    def record(self, comparison: dict, schema_text: str, prompt_text: str, schema_hash_: str | None = None,
               created_at: str | None = None) -> int:
        """Insert one finished comparison (``Comparison.to_json()``) in one transaction; return its id."""
        row = row_from_comparison(comparison, schema_text, prompt_text, schema_hash_, created_at)
        try:
            with self._db() as db:
                # IMMEDIATE takes the write lock up front (waiting up to `timeout`); a deferred
                # transaction that reads the table schema first fails at once with "database is locked"
                # when another writer commits in between.
                db.conn.execute("BEGIN IMMEDIATE")
                try:
                    run_id = int(db[TABLE].insert(row).last_pk)
                    db.conn.execute("COMMIT")
                except BaseException:
                    db.conn.rollback()
                    raise
                return run_id
        except sqlite3.Error as err:
            raise RunLogError(f"cannot write to the run log {self.path}: {err}") from None

    def runs(self, schema: str | None = None, limit: int | None = 200) -> list[dict]:
        """Runs, newest first, optionally only those of schema ``schema``."""
        where, args = ("schema_name = ?", [schema]) if schema else (None, [])
        with self._db() as db:
            return list(db[TABLE].rows_where(where, args, order_by="id desc", limit=limit))

    def get(self, run_id: int) -> dict | None:
        """One run by id (None when there is no such run)."""
        with self._db() as db:
            rows = list(db[TABLE].rows_where("id = ?", [int(run_id)]))
        return rows[0] if rows else None

    def schemas(self) -> list[str]:
        """Names of the schemas that have runs, sorted."""
        with self._db() as db:
            return [r["schema_name"] for r in db.query(
                f"select distinct schema_name from {TABLE} order by schema_name")]

    def count(self) -> int:
        with self._db() as db:
            return db[TABLE].count

    def journal_mode(self) -> str:
        with self._db() as db:
            return db.journal_mode

    def export_csv(self, path: str | Path | None = None, schema: str | None = None) -> str:
        """Write the runs (all columns, oldest first) as CSV to ``path``; without a path return the CSV text.

        Text cells a spreadsheet would run as a formula (starting with ``= + - @``, tab or carriage
        return: model output can) are written with a leading ``'``.
        """
        rows = [{k: _csv_cell(v) for k, v in r.items()} for r in reversed(self.runs(schema=schema, limit=None))]
        buf = io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=list(COLUMNS), extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
        if path is None:
            return buf.getvalue()
        Path(path).write_text(buf.getvalue(), encoding="utf-8")
        return str(path)

    def __repr__(self) -> str:
        return f"RunLog({str(self.path)!r})"

    # -- internal helpers -------------------------------------------------------------------------

    @contextmanager
    def _db(self) -> Iterator[Database]:
        conn = sqlite3.connect(str(self.path), timeout=self.timeout)
        try:
            yield Database(conn)
        finally:
            conn.close()


def _csv_cell(value):
    """A text cell made inert for spreadsheets (OWASP CSV injection); numbers and other values unchanged."""
    if isinstance(value, str) and value[:1] in ("=", "+", "-", "@", "\t", "\r"):
        return "'" + value
    return value


def row_from_comparison(data: dict, schema_text: str, prompt_text: str, schema_hash_: str | None = None,
                        created_at: str | None = None) -> dict:
    """Flatten a ``run --json`` document into a run-log row (an arm that was not run gives NULLs)."""
    b, c, p = data["baseline"] or {}, data["cached"] or {}, data.get("prefix") or {}
    sampling = data.get("sampling", {})
    compression = data.get("compression") or {}
    enc = data.get("encode") or {}
    stats = data.get("store_stats") or {}
    return {
        "created_at": created_at or datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "model": data["model"], "storage": data["storage"], "mode": data["mode"],
        "schema_name": data["schema"], "schema_hash": schema_hash_ or schema_hash(schema_text),
        "schema_text": schema_text, "prompt_text": prompt_text,
        "prompt_tokens": data["prompt_tokens"], "cached_tokens": data["cached_tokens"],
        "uncached_tokens": data["uncached_tokens"], "store_bytes": data["store_bytes"],
        "max_new_tokens": sampling.get("max_new_tokens"), "temperature": sampling.get("temperature"),
        "baseline_ttft_ms": b.get("ttft_ms"), "cached_ttft_ms": c.get("ttft_ms"), "copy_ms": c.get("copy_ms"),
        "baseline_decode_ms_per_token": b.get("decode_ms_per_token"),
        "cached_decode_ms_per_token": c.get("decode_ms_per_token"),
        "baseline_new_tokens": b.get("new_tokens"), "cached_new_tokens": c.get("new_tokens"),
        "baseline_peak_rss_bytes": b.get("peak_rss_bytes"), "cached_peak_rss_bytes": c.get("peak_rss_bytes"),
        "baseline_text": b.get("text"), "cached_text": c.get("text"),
        "speedup": data["speedup"], "same_text": _flag(data["same_text"]),
        "first_divergence": data.get("first_divergence"), "first_token_agree": _flag(data["first_token_agree"]),
        "first_token_kl": data.get("first_token_kl"), "max_first_logit_diff": data.get("max_first_logit_diff"),
        "result_json": json.dumps(data, sort_keys=True),
        "storage_dtype": data.get("storage_dtype"), "retention": compression.get("retention"),
        "compression_method": compression.get("method"), "units_memory": enc.get("memory"),
        "units_disk": enc.get("disk"), "units_encoded": enc.get("encoded"), "encode_ms": enc.get("ms"),
        "budget_bytes": stats.get("budget_bytes"), "evictions": stats.get("evictions"),
        **_prefix_columns(data, p, stats),
    }


def _prefix_columns(data: dict, p: dict, stats: dict) -> dict:
    return {"prefix_ttft_ms": p.get("ttft_ms"), "prefix_copy_ms": p.get("copy_ms"),
            "prefix_decode_ms_per_token": p.get("decode_ms_per_token"), "prefix_new_tokens": p.get("new_tokens"),
            "prefix_peak_rss_bytes": p.get("peak_rss_bytes"), "prefix_text": p.get("text"),
            "prefix_reused_tokens": p.get("reused_tokens"), "prefix_prefilled_tokens": p.get("prefilled_tokens"),
            "prefix_repeat": _flag(p.get("repeat")), "prefix_warmed_with": (p.get("warmed_with") or {}).get("summary"),
            "prefix_speedup": data.get("prefix_speedup"), "prefix_same_text": _flag(data.get("prefix_same_text")),
            "prefix_first_token_kl": data.get("prefix_first_token_kl"),
            "prefix_bytes": stats.get("prefix_bytes") if p else None}


def _flag(value) -> int | None:
    """0/1 for a boolean, NULL for a figure that was not measured (an arm not run)."""
    return None if value is None else int(bool(value))

