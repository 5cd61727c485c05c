"""Run log: a row per comparison plus a row per arm, filters, CSV export, WAL, concurrent writers, migration."""

from __future__ import annotations

import csv
import io
import hashlib
import json
import pathlib
import shutil
import sqlite3
import threading

import pytest

from engine.runlog import ARM_TABLE, COLUMNS, RunLog, RunLogError, default_path, schema_hash

DATA = pathlib.Path(__file__).resolve().parent.parent / "data"


def fake_comparison(schema: str = "travel", ttft_base: float = 100.0, ttft_cached: float = 10.0, **extra) -> dict:
    """A document shaped like ``Comparison.to_json()``."""
    data = {
        "model": "tiny", "storage": "cpu", "mode": "prefixed", "schema": schema,
        "prompt_tokens": 300, "cached_tokens": 280, "uncached_tokens": 20, "store_bytes": 12_900_000,
        "imported": ["trip-plan"], "scaffolds": [],
        "baseline": {"text": "Nara, 45 minutes.", "ttft_ms": ttft_base, "copy_ms": 0.0, "prefill_ms": ttft_base,
                     "prefill_tokens": 300, "decode_ms_per_token": 60.0, "new_tokens": 4,
                     "peak_rss_bytes": 900_000_000, "cuda_peak_bytes": None, "kv_buffer_bytes": 1},
        "cached": {"text": "Nara, 45 minutes.", "ttft_ms": ttft_cached, "copy_ms": 1.5, "prefill_ms": 8.0,
                   "prefill_tokens": 20, "decode_ms_per_token": 61.0, "new_tokens": 4,
                   "peak_rss_bytes": 910_000_000, "cuda_peak_bytes": None, "kv_buffer_bytes": 1,
                   "ttft_includes_copy": True},
        "speedup": round(ttft_base / ttft_cached, 3), "same_text": True, "first_divergence": None,
        "first_token_agree": True, "first_token_kl": 0.001, "max_first_logit_diff": 0.01,
        "sampling": {"max_new_tokens": 4, "temperature": 0.0, "top_p": 1.0, "seed": 0},
    }
    data.update(extra)
    return data


@pytest.fixture
def log(tmp_path):
    return RunLog(tmp_path / "runs.db")


def test_record_and_get_round_trip(log):
    run_id = log.record(fake_comparison(), "<schema name='travel'/>", "<prompt schema='travel'/>")
    row = log.get(run_id)
    assert row["schema_name"] == "travel"
    assert row["schema_text"] == "<schema name='travel'/>"
    assert row["schema_hash"] == schema_hash("<schema name='travel'/>")
    assert row["prompt_text"] == "<prompt schema='travel'/>"
    base, cached = row["arms"]["baseline"], row["arms"]["cached"]
    assert list(row["arms"]) == ["baseline", "cached"]
    assert base["ttft_ms"] == 100.0 and cached["ttft_ms"] == 10.0
    assert cached["copy_ms"] == 1.5 and cached["speedup"] == 10.0 and base["speedup"] is None
    assert cached["same_text"] == 1 and cached["first_divergence"] is None and base["same_text"] is None
    assert base["text"] == cached["text"] == "Nara, 45 minutes."
    assert base["peak_rss_bytes"] == 900_000_000
    assert row["created_at"].endswith("+00:00")
    assert set(COLUMNS) <= set(row)
    assert log.get(run_id + 1) is None


def test_runs_newest_first_and_filtered_by_schema(log):
    ids = [log.record(fake_comparison(schema=name), f"<schema name='{name}'/>", "p")
           for name in ("travel", "doc_qa", "travel")]
    assert [r["id"] for r in log.runs()] == ids[::-1]
    assert [r["id"] for r in log.runs(schema="travel")] == [ids[2], ids[0]]
    assert [r["id"] for r in log.runs(limit=1)] == [ids[2]]
    assert log.schemas() == ["doc_qa", "travel"]
    assert log.count() == 3


def test_export_csv_has_every_column_and_row(log, tmp_path):
    log.record(fake_comparison(), "s1", "p1")
    log.record(fake_comparison(schema="doc_qa", first_divergence=2, same_text=False), "s2", "p,\"2\"\nline")
    out = log.export_csv(tmp_path / "runs.csv")
    rows = list(csv.DictReader(open(out, encoding="utf-8")))
    assert [r["schema_name"] for r in rows] == ["travel", "doc_qa"]  # oldest first
    assert rows[1]["prompt_text"] == "p,\"2\"\nline"
    assert rows[1]["cached_first_divergence"] == "2" and rows[1]["cached_same_text"] == "0"
    assert list(rows[0])[:len(COLUMNS)] == list(COLUMNS)
    assert {"baseline_ttft_ms", "cached_ttft_ms", "cached_speedup"} <= set(rows[0]) and "prefix_ttft_ms" not in rows[0]
    only = list(csv.DictReader(io.StringIO(log.export_csv(schema="doc_qa"))))
    assert len(only) == 1


@pytest.mark.parametrize("text", ["=HYPERLINK(\"http://x\")", "+1+2", "-2+3", "@SUM(A1)", "\tx", "\rx"])
def test_export_csv_makes_formula_cells_inert(log, text):
    data = fake_comparison(first_token_kl=-0.5)  # a negative number stays a number
    data["cached"] = dict(data["cached"], text=text)
    log.record(data, "s", "Plain prompt")
    row = next(csv.DictReader(io.StringIO(log.export_csv())))
    assert row["cached_text"] == "'" + text
    assert row["baseline_text"] == "Nara, 45 minutes." and row["prompt_text"] == "Plain prompt"
    assert row["cached_first_token_kl"] == "-0.5" and row["cached_speedup"] == "10.0"
    assert log.runs()[0]["arms"]["cached"]["text"] == text  # only the export is escaped, the log keeps the text


def test_wal_mode_is_on(log):
    assert log.journal_mode() == "wal"
    conn = sqlite3.connect(log.path)
    assert conn.execute("pragma journal_mode").fetchone()[0] == "wal"
    conn.close()


def test_concurrent_writers_lose_no_rows(tmp_path):
    path = tmp_path / "runs.db"
    RunLog(path)
    per_thread, threads = 25, 4
    barrier = threading.Barrier(threads)
    errors: list[BaseException] = []

    def writer(k: int) -> None:
        try:
            log = RunLog(path)  # each tab of the studio shares one file, not one connection
            barrier.wait(timeout=60)
            for i in range(per_thread):
                log.record(fake_comparison(schema=f"s{k}", ttft_base=100 + i), f"schema {k}", f"prompt {i}")
        except BaseException as err:  # surfaced by the assertion below; the others stop waiting for this one
            barrier.abort()
            errors.append(err)

    workers = [threading.Thread(target=writer, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    assert not errors
    log = RunLog(path)
    assert log.count() == per_thread * threads
    for k in range(threads):
        assert len(log.runs(schema=f"s{k}", limit=None)) == per_thread
    conn = sqlite3.connect(path)
    assert conn.execute("pragma integrity_check").fetchone()[0] == "ok"
    conn.close()



def test_a_journal_file_removed_while_the_log_opens_is_no_error(tmp_path, monkeypatch):
    """The last connection to close removes the -wal and -shm files: one that goes between the check that it is
    there and the check of its owner (another thread or process closing the log) is not an error."""
    from engine import owned

    path = tmp_path / "runs.db"
    RunLog(path)
    wal = path.with_name(path.name + "-wal")
    wal.write_bytes(b"")  # as a live connection leaves it
    check = owned.check_own_file

    def closed_meanwhile(file, *args, **kwargs):
        if str(file) == str(wal) and wal.exists():
            wal.unlink()
        return check(file, *args, **kwargs)

    monkeypatch.setattr(owned, "check_own_file", closed_meanwhile)
    log = RunLog(path)
    assert log.record(fake_comparison(), "<schema/>", "prompt") == 1 and log.count() == 1


def test_failed_record_leaves_no_row(log):
    with pytest.raises(KeyError):
        log.record({"model": "tiny"}, "s", "p")  # not a comparison document
    assert log.count() == 0


def test_default_path_follows_cache_env(monkeypatch, tmp_path):
    monkeypatch.setenv("PML_STUDIO_CACHE", str(tmp_path / "cache"))
    assert default_path() == tmp_path / "cache" / "runs.db"
    log = RunLog()
    assert log.path == tmp_path / "cache" / "runs.db" and log.path.exists()


def test_unwritable_path_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(RunLogError, match="--db"):
        RunLog(blocker / "runs.db")


def test_older_database_gains_new_columns(tmp_path):
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.execute("create table runs (id integer primary key, created_at text, schema_name text)")
    conn.commit()
    conn.close()
    log = RunLog(path)
    run_id = log.record(fake_comparison(), "s", "p")
    assert log.get(run_id)["arms"]["cached"]["speedup"] == 10.0


def test_module_memory_settings_are_recorded(log):
    data = fake_comparison(storage_dtype="bfloat16", compression={"retention": 0.3, "method": "recent"},
                           store_stats={"budget_bytes": 2**30, "evictions": 2},
                           encode={"ms": 12.5, "units": 4, "memory": 1, "disk": 2, "encoded": 1, "detail": []})
    row = log.get(log.record(data, "s", "p"))
    assert row["storage_dtype"] == "bfloat16" and row["retention"] == 0.3 and row["compression_method"] == "recent"
    assert (row["units_memory"], row["units_disk"], row["units_encoded"]) == (1, 2, 1)
    assert row["encode_ms"] == 12.5 and row["budget_bytes"] == 2**30 and row["evictions"] == 2
    old = log.get(log.record(fake_comparison(), "s", "p"))  # a document from before these fields: NULLs
    assert old["storage_dtype"] is None and old["units_encoded"] is None


def test_database_from_before_module_memory_gains_its_columns(tmp_path):
    path = tmp_path / "v1.db"
    before = {c: t for c, t in COLUMNS.items() if c not in ("storage_dtype", "retention", "compression_method",
                                                            "units_memory", "units_disk", "units_encoded",
                                                            "encode_ms", "budget_bytes", "evictions")}
    from sqlite_utils import Database

    db = Database(path)
    db["runs"].create(before, pk="id")
    db["runs"].insert({"created_at": "2026-01-01T00:00:00+00:00", "schema_name": "travel", "storage": "cpu",
                       "mode": "prefixed"})
    db.close()
    log = RunLog(path)
    assert log.runs()[0]["storage_dtype"] is None  # the old row reads back
    run_id = log.record(fake_comparison(storage_dtype="float16"), "s", "p")
    assert log.get(run_id)["storage_dtype"] == "float16" and log.count() == 2


def with_prefix_arm(**extra) -> dict:
    data = fake_comparison(**extra)
    data["arms"] = ["baseline", "prefix", "cached"]
    data["prefix"] = {"text": "Nara, 45 minutes.", "ttft_ms": 40.0, "copy_ms": 0.5, "prefill_ms": 39.0,
                      "prefill_tokens": 120, "prefilled_tokens": 120, "decode_ms_per_token": 60.5, "new_tokens": 4,
                      "peak_rss_bytes": 905_000_000, "cuda_peak_bytes": None, "kv_buffer_bytes": 1,
                      "reused_tokens": 180, "repeat": False, "ttft_includes_copy": True,
                      "stopped_at": {"token": 180, "source": "module", "owner": "kyoto"},
                      "warmed_with": {"summary": "schema-order warm-up (3 modules, 250 tokens) + 2 earlier runs"}}
    data.update(prefix_speedup=2.5, prefix_same_text=True, prefix_first_token_kl=0.0,
                store_stats={"budget_bytes": 2**30, "evictions": 0, "prefix_bytes": 4096})
    return data


def test_prefix_arm_is_recorded(log):
    row = log.get(log.record(with_prefix_arm(), "s", "p"))
    pre = row["arms"]["prefix"]
    assert pre["ttft_ms"] == 40.0 and pre["reused_tokens"] == 180 and pre["prefill_tokens"] == 120
    assert pre["speedup"] == 2.5 and pre["same_text"] == 1 and row["prefix_bytes"] == 4096
    assert pre["text"] == row["arms"]["baseline"]["text"]
    assert json.loads(row["result_json"])["prefix"]["warmed_with"]["summary"].startswith("schema-order warm-up")
    old = log.get(log.record(fake_comparison(), "s", "p"))  # no prefix arm: no row, no bytes
    assert "prefix" not in old["arms"] and old["prefix_bytes"] is None


def test_an_arm_left_out_has_no_row_and_its_figures_are_nulls(log):
    data = with_prefix_arm(speedup=None, same_text=None, first_token_agree=None, first_token_kl=None)
    data["cached"] = None
    row = log.get(log.record(data, "s", "p"))
    assert list(row["arms"]) == ["baseline", "prefix"] and row["arms"]["prefix"]["ttft_ms"] == 40.0


def test_a_database_written_before_the_arm_table_is_migrated_with_nothing_lost(tmp_path):
    """tests/data/runs-v1.db was written by the run log of commit 9d7bb5f (one wide row per run)."""
    path = tmp_path / "runs.db"
    shutil.copy(DATA / "runs-v1.db", path)
    old = sqlite3.connect(path)
    old.row_factory = sqlite3.Row
    before = [dict(r) for r in old.execute("select * from runs order by id")]
    old.close()
    log = RunLog(path)
    after = {r["id"]: r for r in log.runs(limit=None)}
    assert len(after) == len(before) == 4
    for wide in before:
        row = after[wide["id"]]
        assert {k: row[k] for k in wide} == wide  # every old column and value is still there
        for arm in ("baseline", "prefix", "cached"):
            if wide[f"{arm}_ttft_ms"] is None:
                assert arm not in row["arms"]
                continue
            got = row["arms"][arm]
            assert got["ttft_ms"] == wide[f"{arm}_ttft_ms"] and got["text"] == wide[f"{arm}_text"]
            assert got["new_tokens"] == wide[f"{arm}_new_tokens"]
        if "cached" in row["arms"] and wide["speedup"] is not None:
            c = row["arms"]["cached"]
            assert (c["speedup"], c["same_text"], c["first_token_kl"]) == (
                wide["speedup"], wide["same_text"], wide["first_token_kl"])
        if "prefix" in row["arms"]:
            assert row["arms"]["prefix"]["reused_tokens"] == wide["prefix_reused_tokens"]
            assert row["arms"]["prefix"]["speedup"] == wide["prefix_speedup"]
    RunLog(path)  # opening again adds nothing
    conn = sqlite3.connect(path)
    assert conn.execute(f"select count(*) from {ARM_TABLE}").fetchone()[0] == sum(len(r["arms"]) for r in after.values())
    assert conn.execute("pragma user_version").fetchone()[0] == 2
    conn.close()
    new_id = log.record(with_prefix_arm(), "s", "p")  # and the migrated log takes new runs
    assert list(log.get(new_id)["arms"]) == ["baseline", "prefix", "cached"]


def test_the_studio_history_opens_a_database_written_before_the_arm_table(tmp_path, tiny_engine):
    from studio.state import Studio
    from studio.tabs import history

    path = tmp_path / "runs.db"
    shutil.copy(DATA / "runs-v1.db", path)
    studio = Studio(tiny_engine, RunLog(path))
    rows = history.rows(studio)
    assert [r[0] for r in rows] == [4, 3, 2, 1]
    cells = dict(zip(history.headers(), rows[-1]))  # run 1 had all three arms
    assert cells["Baseline TTFT"].endswith(" ms") and "×" in cells["Prefix cache TTFT"]
    assert dict(zip(history.headers(), rows[1]))["Baseline TTFT"] == "–"  # run 3 ran the cached arm alone
    detail = history.run_detail(studio, 1)
    assert detail.count('class="col-head"') == 3 and "first token" in detail and "pml-summary" in detail
    repeats = sum(bool(a.get("repeat")) for r in RunLog(path).runs() for a in r["arms"].values())
    assert repeats == 1  # a prefix arm's rerun of an identical prompt: a lookup's TTFT, not in the plot
    assert len(history.plot_points(studio)) == 3 + 2 + 1 + 2 - repeats


def test_the_studio_history_opens_a_database_written_by_todays_code(tmp_path, tiny_engine):
    """tests/data/runs-v2.db was written by tests/data/make_runs_v2.py with the layered engine: four arms,
    blend's detail in the stored document. Opened as it is (no migration), every arm and detail is read back."""
    from engine.arms.compare import Comparison
    from studio.state import Studio
    from studio.tabs import history

    path = tmp_path / "runs.db"
    shutil.copy(DATA / "runs-v2.db", path)
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    studio = Studio(tiny_engine, RunLog(path))
    rows = history.rows(studio)
    assert [r[0] for r in rows] == [3, 2, 1]
    first = dict(zip(history.headers(), rows[-1]))
    assert all(first[f"{t} TTFT"] != "–" for t in ("Baseline", "Prefix cache", "Modular cache", "Blend"))
    assert dict(zip(history.headers(), rows[0]))["Baseline TTFT"] == "–"  # run 3: cached and blend only
    detail = history.run_detail(studio, 1)
    assert detail.count('class="col-head"') == 4 and "blend 0.25 by question" in detail
    blend = Comparison.from_json(json.loads(RunLog(path).get(1)["result_json"])).arm("blend").detail
    assert (blend.ratio, blend.rule) == (0.25, "question")
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before  # today's version: nothing to migrate


# -- a database written by a newer version is read, never changed -----------------------------------

def newer_database(path: pathlib.Path, wal: bool = False, version: int = 99) -> None:
    """A run log as a newer PML Studio could leave it: this version's tables plus a column it does not know,
    one run with its arm rows, ``user_version`` = ``version`` (written with plain sqlite3, not RunLog)."""
    data = fake_comparison()
    conn = sqlite3.connect(path)
    if wal:
        conn.execute("pragma journal_mode=wal")
    cols = ", ".join(f"{c} {'integer primary key' if c == 'id' else ''}" for c in COLUMNS)
    conn.execute(f"create table runs ({cols}, future_column text)")
    conn.execute("create table arm_runs (id integer primary key, run_id integer, arm text, ttft_ms float, text text)")
    conn.execute("insert into runs (id, created_at, model, storage, mode, schema_name, prompt_tokens, cached_tokens,"
                 " result_json, future_column) values (7, '2030-01-01T00:00:00+00:00', 'tiny', 'cpu', 'prefixed',"
                 " 'travel', 300, 280, ?, 'x')", [json.dumps(data)])
    conn.executemany("insert into arm_runs (run_id, arm, ttft_ms, text) values (7, ?, ?, ?)",
                     [("baseline", 100.0, "Nara"), ("cached", 10.0, "Nara")])
    conn.execute(f"pragma user_version = {version}")
    conn.commit()
    conn.close()


def files_of(path: pathlib.Path) -> dict[str, str]:
    """Every file beside the database (its -wal, -shm, -journal included) by name, with its sha256."""
    import hashlib

    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.parent.iterdir())}


@pytest.mark.parametrize("wal", [False, True], ids=["rollback-journal", "wal"])
def test_a_database_from_a_newer_version_is_read_only_and_left_byte_for_byte(tmp_path, wal):
    path = tmp_path / "runs.db"
    newer_database(path, wal=wal)
    before = files_of(path)
    assert list(before) == ["runs.db"]  # sqlite removed its -wal and -shm when the writer closed
    log = RunLog(path)
    assert log.read_only and str(path) in log.read_only and "schema version 99, this one knows 2" in log.read_only
    assert "--db" in log.read_only
    runs = log.runs()  # what it can read is listed
    assert [r["id"] for r in runs] == [7] and runs[0]["future_column"] == "x"
    assert runs[0]["arms"]["cached"]["ttft_ms"] == 10.0 and log.count() == 1 and log.schemas() == ["travel"]
    assert log.get(7)["schema_name"] == "travel"
    assert "travel" in log.export_csv()
    with pytest.raises(RunLogError, match="newer PML Studio") as err:
        log.record(fake_comparison(), "s", "p")
    assert err.value.retry is False
    RunLog(path)  # opening it again changes nothing either
    assert files_of(path) == before  # no migration, no new column, no WAL switch, no -wal/-shm left behind
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    assert conn.execute("pragma user_version").fetchone()[0] == 99
    assert conn.execute("select count(*) from runs").fetchone()[0] == 1
    assert conn.execute("select count(*) from sqlite_master where name like 'idx_%'").fetchone()[0] == 0
    conn.close()


def test_a_newer_database_in_use_by_its_writer_is_read_with_its_uncheckpointed_runs(tmp_path):
    path = tmp_path / "runs.db"
    newer_database(path, wal=True)
    writer = sqlite3.connect(path)  # the newer studio, still running: its last run is only in runs.db-wal
    writer.execute("pragma wal_autocheckpoint = 0")
    writer.execute("insert into runs (id, created_at, schema_name, result_json) values (8, '2030-01-02', 'doc_qa', '{}')")
    writer.commit()
    before = files_of(path)
    assert {"runs.db-wal", "runs.db-shm"} <= set(before)
    log = RunLog(path)
    assert log.read_only and [r["id"] for r in log.runs()] == [8, 7]
    assert files_of(path)["runs.db"] == before["runs.db"] and set(files_of(path)) == set(before)
    writer.close()


def test_a_database_of_this_version_is_still_opened_for_writing(tmp_path):
    path = tmp_path / "runs.db"
    newer_database(path, version=2)  # the same tables, as this version wrote them
    log = RunLog(path)
    assert log.read_only is None and log.journal_mode() == "wal"
    log.record(fake_comparison(), "s", "p")
    conn = sqlite3.connect(path)
    assert conn.execute("select count(*) from runs").fetchone()[0] == 2
    conn.close()


def test_a_file_that_is_not_a_database_is_a_clear_error_and_is_left_alone(tmp_path):
    path = tmp_path / "runs.db"
    path.write_bytes(b"not a database, but more than twenty bytes long")
    with pytest.raises(RunLogError, match=r"cannot open the run log .*runs\.db.*--db"):
        RunLog(path)
    assert path.read_bytes() == b"not a database, but more than twenty bytes long"
