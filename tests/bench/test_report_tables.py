"""The benchmark tables as data (bench/tables.py): a spec renders to the Markdown written out here by hand, a cell
without its value takes its fallback, a result file's own spec wins over the module's, every bench script writes
the specs of its tables into its JSON, and the report's template holds every block the report asks for."""

from __future__ import annotations

import json
import sys

import pytest

from bench import common, page, tables
from conftest import ROOT
from tests.contract.test_docs import load_report

SPEC = {"columns": [["arm", "l", "`{arm}`"], ["TTFT", "r", "{ttft_ms[median]:.0f} ms", "—"],
                    ["baseline", "r", "{baseline_ms!k:.2f} s"], ["store", "c", "{bytes!M:.1f} MiB", "none"]]}


def test_a_spec_renders_the_markdown_a_person_would_write():
    rows = [{"arm": "isolated", "ttft_ms": {"median": 401.6}, "baseline_ms": 5190.0, "bytes": 3 * 2**20},
            {"arm": "baseline", "ttft_ms": None, "baseline_ms": 250.0, "bytes": None},
            "| kvpress | could not run: no GPU | | |"]
    assert tables.render(SPEC, rows) == [
        "| arm | TTFT | baseline | store |",
        "|---|---:|---:|:-:|",
        "| `isolated` | 402 ms | 5.19 s | 3.0 MiB |",
        "| `baseline` | — | 0.25 s | none |",
        "| kvpress | could not run: no GPU | | |"]


def test_a_missing_value_without_a_fallback_is_an_error():
    with pytest.raises(KeyError, match="baseline_ms"):
        tables.render(SPEC, [{"arm": "x", "ttft_ms": {"median": 1.0}, "bytes": 1}])


def test_a_column_repeats_for_each_item_and_its_header_takes_the_table_s_values():
    spec = {"columns": [["n", "r", "{n}"], ["`{each}` after {tokens}", "r", "{kl[{each}]:.3f}", "—"]]}
    rows = [{"n": 1, "kl": {"a+b 4": 0.12345, "c": 0.5}}, {"n": 2, "kl": {"c": 1.0}}]
    assert tables.render(spec, rows, ["a+b 4", "c"], tokens=8) == [
        "| n | `a+b 4` after 8 | `c` after 8 |", "|---:|---:|---:|", "| 1 | 0.123 | 0.500 |", "| 2 | — | 1.000 |"]


def test_a_labelled_table_leaves_out_the_lines_a_result_cannot_fill():
    spec = {"columns": [["what", "l"], ["measured", "r"]],
            "rows": [["start at {n} tokens", "{start_s:.1f} s"], ["pairs", "{pairs[median]:.2f}"]]}
    assert tables.render(spec, {"n": 32, "start_s": 12.34}) == [
        "| what | measured |", "|---|---:|", "| start at 32 tokens | 12.3 s |"]


def test_every_spec_is_json_and_a_result_file_s_own_spec_wins():
    assert json.loads(json.dumps(tables.TABLES)) == tables.TABLES
    assert tables.spec({}, "ttft") is tables.TABLES["ttft"]
    own = {"columns": [["tokens", "r", "{prompt_tokens:,}"]]}
    report = load_report()
    doc = json.loads((ROOT / "bench" / "results" / "ttft.json").read_text())
    rows = report.table("ttft", {**doc, "tables": {"ttft": own}}, doc["results"]).splitlines()
    assert rows[:2] == ["| tokens |", "|---:|"]
    assert rows[2:] == [f"| {r['prompt_tokens']:,} |" for r in doc["results"]]


def test_emit_writes_the_specs_of_the_script_s_tables(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(sys, "argv", [str(ROOT / "bench" / "compression.py"), "--quick"])
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    common.emit("compression-x", {"benchmark": "compression"})
    doc = json.loads((tmp_path / "compression-x.json").read_text())
    assert doc["command"] == "python bench/compression.py --quick" and doc["benchmark"] == "compression"
    assert doc["tables"] == {"compression": tables.TABLES["compression"],
                             "compression_at_4k": tables.TABLES["compression_at_4k"]}
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == doc
    monkeypatch.setattr(sys, "argv", [str(ROOT / "bench" / "memory.py")])  # no table of its own: no field
    common.emit("memory-x", {"benchmark": "memory"})
    assert "tables" not in json.loads((tmp_path / "memory-x.json").read_text())


def test_every_table_a_script_names_exists_and_every_script_named_exists():
    for script, names in tables.BY_SCRIPT.items():
        assert (ROOT / "bench" / f"{script}.py").exists(), script
        assert set(names) <= set(tables.TABLES), script


def test_the_template_splits_into_blocks_written_as_they_stand():
    report = page  # the pages' shared parts (bench/page.py)
    text = "ignored\n<!-- a -->\nline one\n\n<!-- b -->\n trailing space \n<!-- c -->\nlast\n"
    assert report.blocks(text) == {"a": "line one\n", "b": " trailing space ", "c": "last"}
    assert report.say("lead", slug="m", model="M") == "## M (`--model m`, `make qwen` or one click in the Model tab)\n"
