"""Every benchmark says which model it runs (issue 65): its --help names the model of each mode, built from the
constants bench/common.py resolves the model with, and no --quick line of a docstring names a model --quick does not
run. (That the studio and each peer run that one model: tests/bench/test_peers.py.)"""

from __future__ import annotations

import ast
import contextlib
import io
import runpy
import sys

import pytest

from bench.common import QUICK_MODEL
from conftest import ROOT
from engine.model import START_MODEL
from engine.model.packaged import PACKAGED

BENCH = ROOT / "bench"
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if 'add_argument("--model"' in p.read_text())
# every packaged model's key and name, and the family words a docstring would use for one
MODEL_WORDS = {w for p in PACKAGED.values() for w in (p.key, p.name, p.name.split("-")[0])} - {"default"} | {
    "Qwen", "0.5B", "135M"}


def help_text(script: str) -> str:
    """``python bench/SCRIPT --help`` as printed, run in this process (its folder first on the path, as when run)."""
    argv, out = sys.argv, io.StringIO()
    sys.argv = [str(BENCH / script), "--help"]
    sys.path.insert(0, str(BENCH))
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
            runpy.run_path(str(BENCH / script), run_name="__main__")
    finally:
        sys.argv = argv
        sys.path.remove(str(BENCH))
    assert done.value.code in (None, 0), script
    return " ".join(out.getvalue().split())


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_names_the_model_each_mode_runs(script):
    text = help_text(script)
    assert START_MODEL in text, f"{script} --help does not name the default model"
    if "--quick" in text:
        assert f"with --quick: {QUICK_MODEL}" in text, f"{script} --help does not name the --quick model"


def test_no_quick_line_of_a_docstring_names_another_model():
    """A docstring's `--quick` example may name the model --quick runs, never another (nor "the default model":
    --quick does not run the default)."""
    stale = []
    for path in sorted(BENCH.glob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        for line in (x for x in doc.splitlines() if "--quick" in x):
            named = {w for w in MODEL_WORDS if w in line and w not in QUICK_MODEL}
            if named or "default model" in line:
                stale.append(f"{path.name}: {line.strip()}")
    assert not stale
