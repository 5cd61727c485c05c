"""What an installed package carries: a non-editable install, with no checkout on sys.path, still shows the
benchmark results, and the studio finds them from the option, the environment or the checkout. (Who may
import whom: tests/contract/test_architecture.py.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import ROOT

def test_results_folder_comes_from_the_option_then_the_environment(monkeypatch, tmp_path):
    from engine.cli import build_parser
    from studio import benchmarks as bm
    from studio.cli import EXTRA

    monkeypatch.delenv(bm.RESULTS_ENV, raising=False)
    assert bm.results_folder() == bm.RESULTS == ROOT / "bench" / "results"  # a checkout: where bench/ writes
    monkeypatch.setenv(bm.RESULTS_ENV, str(tmp_path))
    assert bm.results_folder() == tmp_path and bm.results_folder(tmp_path / "given") == tmp_path / "given"
    (tmp_path / "ttft.json").write_text(json.dumps({"results": [{"prompt_tokens": 7}]}))
    assert list(bm.ttft_view()[1]["prompt tokens"]) == [7]
    args = build_parser(EXTRA).parse_args(["serve", "--results", str(tmp_path / "given")])
    assert args.results == str(tmp_path / "given")


def test_non_editable_install_shows_benchmark_results(tmp_path):
    """`pip install --target` of a copy of the checkout (a wheel build, not editable), then the Benchmarks
    tab's reader in a Python that sees only that install and the venv's dependencies: no checkout, no
    bench package, no editable finder (``-S`` skips site-packages' .pth files)."""
    src, target = tmp_path / "src", tmp_path / "site"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(  # a fresh tree: stale build/ would leak into the wheel
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis", "*.db*"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PML_STUDIO_RESULTS", "PYTHON", "PIP_"))}
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--no-index", "--disable-pip-version-check", "--target", str(target), str(src)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert pip.returncode == 0, pip.stderr[-2000:]
    deps = {sysconfig.get_paths()[k] for k in ("purelib", "platlib")}
    code = ("import importlib.util, json, studio\nfrom studio import benchmarks as bm\n"
            "head, rows, _ = bm.scaling_view()\n"
            "print(json.dumps({'studio': studio.__file__, 'folder': str(bm.results_folder()), 'head': head,"
            " 'rows': len(rows), 'bench': importlib.util.find_spec('bench') is not None,"
            " 'files': sorted(p.name for p in bm.results_folder().glob('*.json'))}))")
    run = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                         env={**env, "PYTHONPATH": os.pathsep.join([str(target), *sorted(deps)])}, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert Path(got["studio"]).is_relative_to(target) and not got["bench"]
    assert got["folder"] == str(target / "studio" / "results")
    assert got["files"] == sorted(p.name for p in (ROOT / "bench" / "results").glob("*.json"))
    scaling = json.loads((ROOT / "bench" / "results" / "scaling.json").read_text())
    assert got["rows"] == len(scaling["results"]) > 0 and scaling["command"] in got["head"]
