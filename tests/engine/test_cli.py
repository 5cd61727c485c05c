"""The CLI contract: exit codes, one-line located errors, no tracebacks, JSON fields."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from conftest import ROOT, SAMPLES, sample_pairs
from engine.cli import build_parser, main
from engine.cli import main as cli_main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def test_every_command_has_help(capsys):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name in sub.choices:
        with pytest.raises(SystemExit) as info:
            main([name, "--help"])
        assert info.value.code == 0
        assert "usage: pml-studio " + name in capsys.readouterr().out


def test_check_accepts_every_sample(capsys):
    files = [str(p) for _, s, q in sample_pairs() for p in (s, q)]
    assert main(["check", *files]) == 0
    assert f"ok: {len(files)} file(s) valid" in capsys.readouterr().out


BAD = {
    "malformed.xml": ("<schema name='m'>\n<module name='code'>if a < b: pass</module>\n</schema>",
                      "malformed.xml:2:", "<![CDATA["),
    "xxe.xml": ('<!DOCTYPE x [<!ENTITY e SYSTEM "file:///etc/passwd">]>\n<schema name="x">&e;</schema>',
                "xxe.xml:1:1:", "DOCTYPE"),
    "dupe.xml": ("<schema name='d'>\n<module name='a'/>\n<module name='a'/>\n</schema>", "dupe.xml:3:15:", "declared twice"),
    "tag.xml": ("<schema name='t'>\n  <modul name='a'/>\n</schema>", "tag.xml:2:4:", "unknown element <modul>"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_check_reports_located_errors(tmp_path, capsys, name):
    text, where, what = BAD[name]
    path = tmp_path / name
    path.write_text(text)
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith(str(tmp_path / where)) and ": error: " in err[0] and what in err[0]


def test_check_lists_the_first_problems_of_a_file_and_counts_the_rest(tmp_path, capsys):
    """12,500 unknown attributes on one line: the output is the first problems and one line for the rest, not
    12,500 lines (each located from the text's start: the time grew as the square of the count)."""
    from engine.errors import MAX_PROBLEMS

    head = '<schema name="s"><module name="m" '
    path = tmp_path / "many.xml"
    path.write_text(head + " ".join(f'a{i}="v"' for i in range(12_500)) + ">x</module></schema>")
    assert main(["check", str(path)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == MAX_PROBLEMS + 1 and err[-1] == f"... and {12_500 - MAX_PROBLEMS} more problems (fix these first)"
    assert err[0].startswith(f"{path}:1:{len(head) + 1}: error: ")
    assert all(f"unknown attribute 'a{i}'" in line for i, line in enumerate(err[:-1]))


@pytest.mark.parametrize("prompt, what", [
    ("<prompt schema='travel'>\n<trip-plan duration='a very long holiday of many many weeks'><overseas><kyoto/></overseas>"
     "</trip-plan></prompt>", "tokens but the param allows 4"),
    ("<prompt schema='travel'>\n<trip-plan duration='3 days'><overseas><kyoto/><lisbon/></overseas></trip-plan></prompt>",
     "members of one union"),
    ("<prompt schema='travel'>\n<trip-plan duration='3 days'><overseas><tokyo/></overseas></trip-plan></prompt>",
     "unknown module <tokyo>"),
    ("<prompt schema='travel'>\n<trip-plan duration='3 days' month='May'/></prompt>", "has no param 'month'"),
])
def test_check_validates_prompts_against_the_schema_beside_them(tmp_path, capsys, prompt, what):
    (tmp_path / "travel.xml").write_text((SAMPLES / "travel.xml").read_text())
    p = tmp_path / "bad.prompt.xml"
    p.write_text(prompt)
    assert main(["check", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"{p}:2:") and what in err


def test_check_prompt_without_its_schema(tmp_path, capsys):
    p = tmp_path / "lonely.prompt.xml"
    p.write_text("<prompt schema='nowhere'><a/></prompt>")
    assert main(["check", str(p)]) == 2
    assert "no schema file found for schema 'nowhere'" in capsys.readouterr().err


def test_document_longer_than_the_context(tmp_path, capsys):
    big = tmp_path / "big.xml"
    big.write_text("<schema name='big'><module name='doc'>" + "lorem ipsum dolor " * 4000 + "</module></schema>")
    assert main(["check", str(big)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{big}:1:1: error: schema 'big' needs") and "context is 8192" in err


def test_missing_file_and_cuda_without_gpu_exit_2_without_traceback(capsys):
    r = run_cli("check", "does-not-exist.xml")  # the module's own entry point, as a user types it
    assert r.returncode == 2 and "no such file" in r.stderr and "Traceback" not in r.stderr
    assert main(["run", str(SAMPLES / "doc_qa.xml"), str(SAMPLES / "doc_qa.prompt.xml"), "--storage", "cuda",
                 "--json"]) == 2
    out, err = capsys.readouterr()
    assert "GPU storage needs a CUDA device" in err and out == "" and "Traceback" not in err


def test_layout_table(capsys):
    assert main(["layout", str(SAMPLES / "travel.xml")]) == 0
    out = capsys.readouterr().out
    assert "trip-plan/overseas/kyoto" in out and "duration[4]" in out
    assert main(["layout", "--json", str(SAMPLES / "travel.xml")]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {r["module"]: r for r in data["modules"]}
    assert rows["trip-plan/overseas/kyoto"]["start"] == rows["trip-plan/overseas/lisbon"]["start"]


@pytest.mark.real_model
def test_run_json_contract_on_the_real_model(capfd):
    # in this process (a child would import torch and transformers again); capfd reads what reaches fd 1, as a
    # caller reading the CLI's stdout would
    assert main(["run", str(SAMPLES / "scaffold.xml"), str(SAMPLES / "scaffold.prompt.xml"), "--max-new-tokens", "4",
                 "--json"]) == 0
    data = json.loads(capfd.readouterr().out)
    assert data["model"] == "SmolLM2-135M-Instruct" and data["storage"] == "cpu"
    # token counts of the plan agree with what each run really prefilled
    assert data["prompt_tokens"] == data["baseline"]["prefill_tokens"]
    assert data["uncached_tokens"] == data["cached"]["prefill_tokens"] < data["cached_tokens"]
    assert data["store_bytes"] > 0 and data["scaffolds"] == ["policy-and-faq"]
    for path in ("baseline", "cached"):
        assert data[path]["ttft_ms"] > 0 and isinstance(data[path]["text"], str)
    assert data["cached"]["copy_ms"] > 0
    assert data["same_text"] is True and data["first_divergence"] is None  # scaffold imported whole: exact
    assert data["first_token_agree"] is True and data["first_token_kl"] < 1e-6


def test_budget_smaller_than_a_module_exits_2_with_the_reason(capsys):
    assert main(["run", str(SAMPLES / "doc_qa.xml"), str(SAMPLES / "doc_qa.prompt.xml"), "--budget-mb", "0.01",
                 "--max-new-tokens", "1", "--json"]) == 2
    err = capsys.readouterr().err
    assert "budget is" in err and "--budget-mb" in err and "Traceback" not in err


def test_bad_retention_exits_2():
    r = run_cli("run", str(SAMPLES / "doc_qa.xml"), str(SAMPLES / "doc_qa.prompt.xml"), "--retention", "0")
    assert r.returncode == 2 and "retention must be in (0, 1]" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.real_model
def test_a_second_cli_run_encodes_nothing(tmp_path, capsys, monkeypatch):
    """The first run here, the second in a new process: what the first saved is found by another process."""
    monkeypatch.setenv("PML_STUDIO_MODULES", str(tmp_path / "modules"))
    args = ["run", str(SAMPLES / "reference_compat.xml"), str(SAMPLES / "reference_compat.prompt.xml"),
            "--max-new-tokens", "1", "--arms", "cached", "--json"]  # only the arm that reads what was saved
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    second = json.loads(run_cli(*args).stdout)
    assert first["encode"]["encoded"] == first["encode"]["units"] > 0
    assert second["encode"]["encoded"] == 0 and second["encode"]["disk"] == second["encode"]["units"]
    assert second["cached"]["text"] == first["cached"]["text"]


@pytest.mark.parametrize("length, message", [
    ("1000000000", "more positions than any model's context"),  # refused while parsing
    ("900000", "needs at least 900002 positions but the model's context is 8192"),  # refused by the layout
])
def test_a_param_len_beyond_the_context_exits_2_before_allocating(tmp_path, capsys, length, message):
    f = tmp_path / "huge.xml"
    f.write_text(f'<schema name="huge"><module name="m">a <param name="p" len="{length}"/></module></schema>')
    assert main(["check", str(f)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"{f}:1:") and message in err and err.count("error:") == 1


def test_an_overlong_argument_is_reported_once(tmp_path, capsys):
    text = (SAMPLES / "travel.prompt.xml").read_text()
    bad = tmp_path / "bad.prompt.xml"
    bad.write_text(text.replace('duration="', 'duration="' + "weeks " * 40, 1))
    assert main(["check", "--schema", str(SAMPLES / "travel.xml"), str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "argument duration=" in err[0] and "needs an argument" not in err[0]


def test_plain_run_output_says_when_disk_entries_were_corrupt_or_unsaved():
    from engine.cli import run_text

    run = {"text": "hi", "ttft_ms": 10.0, "copy_ms": 0.0, "prefill_tokens": 5, "decode_ms_per_token": None,
           "peak_rss_bytes": 2**20}
    data = {"model": "m", "storage": "cpu", "mode": "prefixed", "schema": "s", "prompt_tokens": 5, "cached_tokens": 3,
            "uncached_tokens": 2, "store_bytes": 2**20, "storage_dtype": "float32",
            "compression": {"retention": 1.0}, "arms": ["baseline", "cached"], "baseline": run,
            "cached": dict(run, copy_ms=1.0), "speedup": 1.0, "same_text": True, "first_divergence": None,
            "first_token_agree": True, "first_token_kl": 0.0,
            "store_stats": {"evictions": 0, "disk_corrupt": 2, "disk_write_errors": 1, "disk_error": "disk full"}}
    out = run_text(data)
    assert "2 module file(s) on disk were corrupted and were re-encoded" in out
    assert "1 module file(s) could not be saved (disk full)" in out
    clean = run_text({**data, "store_stats": {"evictions": 0}})
    assert "corrupted" not in clean and "could not be saved" not in clean


def test_the_encoding_mode_s_old_name_is_still_accepted():
    """`prefixed` was renamed `contextual` (one word per concept: "prefix" is the prefix cache); the old spelling
    is accepted by the CLI, RunConfig and documents read back, and module store keys did not change."""
    from engine.arms.compare import Comparison
    from engine.cli import build_parser, config_from_args
    from engine.config import RunConfig
    from studio.cli import EXTRA

    args = build_parser(EXTRA).parse_args(["run", "s.xml", "p.xml", "--mode", "prefixed"])
    assert config_from_args(args).mode == "contextual" == RunConfig(mode="prefixed").mode
    assert Comparison.from_json({"mode": "prefixed"}).mode == "contextual"


def test_encode_warms_a_schema_so_the_next_run_encodes_nothing(tmp_path, capsys, monkeypatch):
    """Issue 48 item 8 (the command, pml-studio's and `python -m engine.cli_encode`'s): `encode SCHEMA` saves a schema's modules on disk ahead of traffic; a later engine (here
    `run`'s, as the studio's or the API's would) loads them from there and encodes nothing."""
    from engine.cli_encode import COMMAND

    def main(argv):
        return cli_main(argv, COMMAND)

    with pytest.raises(SystemExit):
        main(["encode", "--help"])
    assert "ahead of traffic" in capsys.readouterr().out
    monkeypatch.setenv("PML_STUDIO_MODULES", str(tmp_path / "modules"))
    schema, prompt = str(SAMPLES / "reference_compat.xml"), str(SAMPLES / "reference_compat.prompt.xml")
    assert main(["encode", schema, "--no-persist"]) == 2  # refused before the model loads: it would warm nothing
    err = capsys.readouterr().err
    assert "--no-persist" in err and "Traceback" not in err
    assert main(["encode", schema, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["encode"]["encoded"] == data["encode"]["units"] == len(data["units"]) > 0
    saved = list((tmp_path / "modules").glob("*.safetensors"))
    assert data["module_dir"] == str(tmp_path / "modules") and len(saved) == data["encode"]["units"]
    assert main(["run", schema, prompt, "--max-new-tokens", "1", "--json"]) == 0
    after = json.loads(capsys.readouterr().out)
    assert after["encode"]["encoded"] == 0 and after["encode"]["disk"] == after["encode"]["units"]
