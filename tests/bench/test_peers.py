"""bench/peers.py (issue 19): the peers' plumbing without the peers, and one quick run where `make peers` was run;
every mode runs one model on both sides (issue 65).

The summaries and ratios are recomputed here from synthetic per-prompt runs; a missing peer must come
back as a reason naming the fix, in the JSON and in the README's table, never as a silent skip. The
end-to-end run needs .peers/ (optional, never made by `make test`), so CI skips it.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys

import pytest

from bench.needles import judge
from bench.workloads import wilson
from conftest import ROOT
from engine.model import MODEL_ENV, SMALL_MODEL, START_MODEL, START_NAME
from engine.model.packaged import PACKAGED, packaged_gguf


def load(name: str):
    """A bench script as a module (they import their siblings as top-level modules, as when run)."""
    sys.path.insert(0, str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def peers():
    return load("peers")


@pytest.fixture
def envs():
    """The peers' environments (bench/peer_envs.py, which bench/peers.py and bench/prefill.py import)."""
    from bench import peer_envs

    return peer_envs


def prompt(answer: str, order: bool) -> dict:
    return {"answer": answer, "others": ["Lisbon"], "schema_order": order}


def test_a_missing_peer_is_a_reason_with_the_fix(envs, monkeypatch, tmp_path):
    monkeypatch.setitem(envs.PEER_PYTHON, "llama.cpp", tmp_path / "nothing" / "bin" / "python")
    py, why = envs.peer_status("llama.cpp")
    assert py is None and "make peers" in why and "does not exist" in why
    out = envs.run_peer("llama.cpp", "peer_llama.py", {"prompts": []})
    assert out == {"error": why}


def test_a_broken_peer_environment_says_what_failed(envs, monkeypatch, tmp_path):
    fake = tmp_path / "bin" / "python"
    fake.parent.mkdir(parents=True)
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} \"$@\"\n")
    fake.chmod(0o755)
    monkeypatch.setitem(envs.PEER_PYTHON, "llama.cpp", fake)
    monkeypatch.setitem(envs.PEER_CHECK, "llama.cpp", "import no_such_module_here")
    py, why = envs.peer_status("llama.cpp")
    assert py is None and "No module named 'no_such_module_here'" in why and "make peers" in why


def test_peer_summary_judges_each_answer_itself(peers):
    prompts = [prompt("Oporto", True), prompt("Madeira", False), prompt("Braga", False)]
    runs = [{"ttft_ms": 100.0, "decode_ms_per_token": 10.0, "text": "It is Oporto.", "prefilled_tokens": 5,
             "reused_tokens": 95},
            {"ttft_ms": 300.0, "decode_ms_per_token": 12.0, "text": "Lisbon, I think", "prefilled_tokens": 50,
             "reused_tokens": 50},
            {"ttft_ms": 500.0, "decode_ms_per_token": 14.0, "text": "madeira? braga!", "prefilled_tokens": 100,
             "reused_tokens": 0}]
    s = peers.summarise_peer(runs, prompts)
    found = [judge(r["text"], p)[0] for r, p in zip(runs, prompts)]
    assert found == [True, False, True]
    assert s["needle_found"] == 2 and s["n"] == 3 and s["ci95"] == wilson(2, 3) and s["confused"] == 1
    assert s["mean_ttft_ms"] == 300.0 and s["ttft_ms"] == {"min": 100.0, "median": 300.0, "max": 500.0}
    assert s["schema_order_mean_ttft_ms"] == 100.0 and s["other_mean_ttft_ms"] == 400.0
    assert s["decode_ms_per_token"]["median"] == 12.0
    assert (s["prefilled_tokens"], s["reused_tokens"]) == (155, 145)


def test_ratios_against_each_peer(peers):
    rows = [{"schema_order": True, "cached": {"ttft_ms": 50.0}, "llama.cpp-prefix": {"ttft_ms": 40.0}},
            {"schema_order": False, "cached": {"ttft_ms": 100.0}, "llama.cpp-prefix": {"ttft_ms": 400.0}},
            {"schema_order": False, "cached": {"ttft_ms": 150.0}, "llama.cpp-prefix": {"ttft_ms": 600.0}}]
    arms = {"cached": {"mean_ttft_ms": statistics.mean([50, 100, 150])}}
    peer = {"llama.cpp-prefix": {"mean_ttft_ms": statistics.mean([40, 400, 600])},
            "llama.cpp-full": {"error": "not set up"}}
    r = peers.workload_ratios(rows, arms, peer)
    assert r["cached_over_llamacpp_prefix_mean"] == round(100 / (1040 / 3), 3)
    assert r["cached_over_llamacpp_prefix_per_prompt"] == {"min": 0.25, "median": 0.25, "max": 1.25}
    assert r["cached_over_llamacpp_prefix_schema_order_mean"] == 1.25
    assert r["cached_over_llamacpp_prefix_other_mean"] == 0.25
    assert r["cached_over_llamacpp_prefix_peer_faster_prompts"] == 1
    assert not any("full" in k for k in r)  # a peer that could not run has no ratios


def test_llama_driver_common_prefix_without_llama_cpp():
    drv = load("peer_llama")  # imports llama_cpp only when it loads a model
    assert drv.common([1, 2, 3, 4], [1, 2, 9]) == 2
    assert drv.common([], [1]) == 0 and drv.common([5, 6], [5, 6]) == 2


def test_the_readme_table_says_why_a_peer_could_not_run():
    report = load("report")
    arms = {"mean_ttft_ms": 100.0, "ttft_ms": {"min": 90.0, "median": 100.0, "max": 110.0},
            "schema_order_mean_ttft_ms": 95.0, "other_mean_ttft_ms": 105.0,
            "decode_ms_per_token": {"median": 50.0}, "needle_found": 1, "n": 2, "ci95": wilson(1, 2)}
    p = {"command": "python bench/peers.py", "model": "m", "gguf": "m.gguf", "machine": {
        "date": "2026-11-23", "threads": 2, "cpu": "x86_64", "cuda": False, "torch": "2.13.0"},
         "workload": {"prompts": [{"schema_order": True}, {"schema_order": False}], "arms": {"cached": arms},
                      "peers": {"llama.cpp-prefix": {"error": "llama.cpp is not set up: run `make peers`"}}},
         "ratios": {}}
    text = "\n".join(report.peers_section(p, None, "peers-m"))
    assert "could not run: llama.cpp is not set up: run `make peers`" in text
    assert "| studio modular cache | **100 ms** |" in text
    assert "not measured yet" in "\n".join(report.peers_section(None, None, "x"))


def gguf_shape(path) -> dict:
    """What llama.cpp will load, from the GGUF file's own header (only the wanted keys: gguf's GGUFReader parses
    every vocabulary string, minutes for Qwen's 151,936 on a busy machine)."""
    from engine.model.gguf import _header_sizes

    arch, sizes = _header_sizes(path)
    return {"architecture": arch, "layers": sizes["num_hidden_layers"], "hidden": sizes["hidden_size"]}


def studio_shape(name: str) -> dict:
    """What the studio loads under display name ``name``: its converted folder's config.json, read as JSON."""
    from engine.model.packaged import find_packaged

    cfg = json.loads((find_packaged(name).folder() / "config.json").read_text())
    return {"architecture": cfg["model_type"], "layers": cfg["num_hidden_layers"], "hidden": cfg["hidden_size"]}


@pytest.mark.parametrize("asked, quick, env, runs", [
    (None, True, None, SMALL_MODEL),  # --quick: the small model, whatever the default
    (None, True, START_MODEL, SMALL_MODEL),
    (None, False, None, START_NAME),  # a full run: the engine's default ...
    (None, False, SMALL_MODEL, SMALL_MODEL),  # ... or $PML_STUDIO_MODEL
    ("default", True, None, SMALL_MODEL),  # --model wins over --quick: the small model's key
    (START_MODEL, True, None, START_NAME),
])
def test_every_mode_gives_the_studio_and_llama_cpp_one_model(peers, monkeypatch, asked, quick, env, runs):
    """Issue 65: `peers.py --quick` ran the studio on Qwen2.5-Coder-0.5B beside llama.cpp on SmolLM2-135M. Each
    mode resolves one model; the GGUF handed to llama.cpp holds the model the studio loads, and kvpress loads the
    studio's own folder."""
    monkeypatch.delenv(MODEL_ENV, raising=False)
    if env:
        monkeypatch.setenv(MODEL_ENV, env)
    model = peers.bench_model(asked, quick)
    assert model.name == runs and model.folder.name == runs
    assert gguf_shape(model.gguf_file()) == studio_shape(model.name)


@pytest.mark.real_model
def test_peers_quick_json_names_the_model_each_side_runs(monkeypatch):
    """The quick run's JSON (no peer needed): "model" and "gguf" are one model, whatever $PML_STUDIO_MODEL was
    (the suite sets it to the small model, which hid issue 65: the default is the 0.5B model)."""
    from benchchecks import run_bench

    monkeypatch.delenv(MODEL_ENV, raising=False)
    _, data, _ = run_bench("peers.py", "--no-workload", "--no-lengths", "--weights", "fp32")  # no packing: seconds
    assert data["model"] == SMALL_MODEL and data["gguf"].startswith(SMALL_MODEL)
    gguf = next(p for p in (packaged_gguf(k) for k in PACKAGED) if p.name == data["gguf"])
    assert gguf_shape(gguf) == studio_shape(data["model"]) == data["model_shape"]


def test_a_model_llama_cpp_cannot_run_is_named_with_the_fix(peers, tmp_path):
    folder = peers.BenchModel(str(tmp_path), tmp_path.name, tmp_path)  # a transformers folder: no GGUF
    with pytest.raises(SystemExit, match=r"llama\.cpp needs a GGUF file; give a packaged model \(default, "):
        folder.gguf_file()
    with pytest.raises(SystemExit, match=r"--model: .*no model 'no-such-model'.*omit --model"):
        peers.bench_model("no-such-model")


def test_packaged_gguf_is_the_file_llama_cpp_loads():
    from engine.model.packaged import packaged_gguf

    path = packaged_gguf("default")
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"


@pytest.mark.real_model
@pytest.mark.skipif(not (ROOT / ".peers" / "llama" / "bin" / "python").exists(),
                    reason="llama.cpp's environment is optional: `make peers` builds it")
def test_peers_quick_runs_llama_cpp_on_the_same_prompts():
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "peers.py"), "--quick", "--no-lengths"], cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-2000:]
    data = json.loads(r.stdout.strip().splitlines()[-1])
    rows = data["workload"]["prompts"]
    assert set(data["peers"]) == {"llama.cpp-full", "llama.cpp-prefix"} and len(rows) == 3
    for row in rows:
        assert row["llama.cpp-full"]["ttft_ms"] > 0
        assert 0 <= row["llama.cpp-prefix"]["reused_tokens"] < row["prompt_tokens"]
    full = data["peers"]["llama.cpp-full"]
    assert full["reused_tokens"] == 0 and full["prefilled_tokens"] == sum(r["prompt_tokens"] for r in rows)
    assert data["model"] == SMALL_MODEL and data["gguf"].startswith(SMALL_MODEL)  # --quick's model, both sides
    assert {k: data["workload"]["llama.cpp"]["model"][k] for k in ("architecture", "layers", "hidden")} == \
        data["model_shape"] == studio_shape(data["model"])
    assert data["ratios"]["cached_over_llamacpp_prefix_mean"] == round(
        data["arms"]["cached"]["mean_ttft_ms"] / data["peers"]["llama.cpp-prefix"]["mean_ttft_ms"], 3)
