"""The engine never imports gradio (the UI adapts the engine, never the reverse)."""

from __future__ import annotations

import subprocess
import sys

from tests.conftest import ROOT


def test_engine_imports_do_not_pull_in_gradio():
    code = ("import sys, engine, engine.session, engine.runlog, engine.arms, engine.cli\n"
            "bad = sorted(m for m in sys.modules if m == 'gradio' or m.startswith('gradio.'))\n"
            "print(','.join(bad))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"engine imported gradio modules: {out.stdout.strip()}"
