"""The peers' own environments (``make peers``: llama.cpp, kvpress): whether each works, and a job run in one
(bench/peers.py, bench/prefill.py)."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from bench.common import ROOT
from bench.llama_build import refusal

PEERS = ROOT / ".peers"
PEER_PYTHON = {"llama.cpp": PEERS / "llama" / "bin" / "python", "kvpress": PEERS / "kvpress" / "bin" / "python"}
PEER_CHECK = {"llama.cpp": "import llama_cpp; print(llama_cpp.__version__)",
              "kvpress": "import importlib.metadata as m, kvpress; "
                         "print(m.version('kvpress'), 'with transformers', m.version('transformers'))"}


def peer_status(peer: str) -> tuple[Path | None, str]:
    """(its python, its version line) when ``peer``'s environment works, else (None, why not and the fix)."""
    py = PEER_PYTHON[peer]
    if not py.exists():
        return None, f"{peer} is not set up: {os.path.relpath(py, ROOT)} does not exist; run `make peers`"
    done = subprocess.run([str(py), "-c", PEER_CHECK[peer]], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return None, f"{peer}'s environment {os.path.relpath(py.parent.parent, ROOT)} cannot import it ({last}); " \
                     "run `make peers` again"
    refused = refusal(py) if peer == "llama.cpp" else ""
    return (None, refused) if refused else (py, done.stdout.strip())


def run_peer(peer: str, script: str, job: dict, timeout: int = 7200) -> dict:
    """Run ``bench/SCRIPT`` in ``peer``'s environment on ``job``; its JSON, or {"error": the exact reason}."""
    py, info = peer_status(peer)
    if py is None:
        return {"error": info}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    try:
        done = subprocess.run([str(py), str(ROOT / "bench" / script), f.name], stdout=subprocess.PIPE, stderr=None,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"{peer} ran past {timeout} s"}
    finally:
        Path(f.name).unlink(missing_ok=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        return {"error": f"{peer} exited with {done.returncode} (its error is printed above)"}
    out = json.loads(lines[-1])
    out["version"] = info
    return out
