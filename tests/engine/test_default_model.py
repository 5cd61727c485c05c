"""One default everywhere (issue 39, item 7): a run that names no model, through the library, the CLI or the
studio, starts on the same model and weights, the packaged Qwen2.5-Coder-0.5B on its GGUF file's own blocks; a
model named without --weights gets that model's default weights. (The rest of the suite names the small model
through $PML_STUDIO_MODEL, tests/conftest.py; these tests remove it.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.config import RunConfig
from engine.model import MODEL_ENV, SMALL_MODEL, START_MODEL, START_WEIGHTS
from tests.conftest import ROOT

QWEN = "qwen2.5-coder-0.5b"


@pytest.fixture
def no_env(monkeypatch):
    monkeypatch.delenv(MODEL_ENV, raising=False)


def run_args(*extra: str):
    from engine.cli import build_parser, config_from_args
    from studio.cli import EXTRA

    return config_from_args(build_parser(EXTRA).parse_args(["run", "s.xml", "p.xml", *extra]))


def test_the_library_the_cli_and_the_studio_start_on_one_model_and_weights(no_env):
    from engine.session import Engine
    from studio.launch import STUDIO_MODEL, STUDIO_WEIGHTS

    assert (START_MODEL, START_WEIGHTS) == (QWEN, "gguf") == (STUDIO_MODEL, STUDIO_WEIGHTS)
    cfg = Engine().config  # nothing loads until a run
    assert (cfg.model, cfg.weights) == (QWEN, "gguf") == (RunConfig().model, RunConfig().weights)
    assert (run_args().model, run_args().weights) == (QWEN, "gguf")


def test_a_model_named_without_weights_gets_its_own_default(no_env):
    assert run_args("--model", QWEN).weights == "gguf"
    assert run_args("--model", "Qwen2.5-Coder-0.5B-Instruct").weights == "gguf"
    assert run_args("--model", SMALL_MODEL).weights == "fp32"
    assert run_args("--model", QWEN, "--weights", "int8").weights == "int8"
    assert RunConfig().with_(model=SMALL_MODEL).weights == "fp32"  # the weights follow the model
    assert RunConfig(weights="int4").with_(model=SMALL_MODEL).weights == "int4"  # ... unless chosen


def test_the_environment_names_another_default(monkeypatch):
    monkeypatch.setenv(MODEL_ENV, SMALL_MODEL)
    assert (RunConfig().model, RunConfig().weights) == (SMALL_MODEL, "fp32")


@pytest.mark.real_model
def test_pml_studio_info_names_the_default_model_on_its_default_weights():
    env = {k: v for k, v in __import__("os").environ.items() if k != MODEL_ENV}
    out = subprocess.run([sys.executable, "-m", "studio.cli", "info", "--json"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    info = json.loads(out.stdout)
    assert (info["model"], info["weights"]) == ("Qwen2.5-Coder-0.5B-Instruct", "gguf")
