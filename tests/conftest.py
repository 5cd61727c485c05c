"""Shared fixtures: a tiny random-weight Llama (seconds) and the real default model (session-wide)."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import tempfile

import pytest

from engine.model import MODEL_ENV, SMALL_MODEL
from tools.screenshot import free_port  # noqa: F401  (tests import it from here: one helper for tests, bench, tools)

# The real vLLM server of the tests marked vllm: a plugin, since a second conftest.py (tests/vllm/) would be imported
# under the same module name as this one.
pytest_plugins = ["tests.vllm_fixtures"]

# The suite runs the small SmolLM2-135M wherever a test names no model (Engine(), the CLI in a subprocess): the
# default, Qwen2.5-Coder-0.5B, costs seconds a run. Tests of that default remove this (tests/engine/test_default_model.py).
os.environ[MODEL_ENV] = SMALL_MODEL

# Persisted module files go to a throw-away folder (subprocesses inherit it), never the user's cache;
# it is removed when the session ends (unless the caller chose the folder).
_OWN_MODULES = None if "PML_STUDIO_MODULES" in os.environ else tempfile.mkdtemp(prefix="pml-test-modules-")
if _OWN_MODULES:
    os.environ["PML_STUDIO_MODULES"] = _OWN_MODULES


# The longest files first (by wall time in a 4-worker run): `make test` hands whole files to its workers in
# collection order (--no-loadscope-reorder: xdist would order them by their count of tests), so the suite ends
# when its last long file does; started first, they end beside the short ones.
SLOW_FIRST = ("tests/engine/test_real_model.py", "tests/bench/test_bench_speed.py", "tests/engine/test_qwen.py",
              "tests/studio/test_private_files.py", "tests/engine/test_cli.py",
              "tests/studio/test_studio_offline.py", "tests/bench/test_bench_fidelity.py",
              "tests/studio/test_browser.py", "tests/engine/test_bounded_reads.py",
              "tests/bench/test_bench_workload.py", "tests/studio/test_studio_guard.py",
              "tests/bench/test_bench_compression.py", "tests/engine/test_programs.py",
              "tests/engine/test_prefix.py", "tests/engine/test_prefill.py", "tests/engine/test_gguf_model.py",
              "tests/studio/test_browser_newcomer.py", "tests/studio/test_browser_honest.py",
              "tests/studio/test_browser_trust.py",
              "tests/contract/test_architecture.py",
              "tests/engine/test_default_model.py", "tests/studio/test_shutdown.py", "tests/engine/test_weights.py",
              "tests/studio/test_api_upstream.py")


def pytest_collection_modifyitems(session, config, items):
    rank = {path: i for i, path in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order


# The browser files run as one unit on one worker: two chromiums and their studios at once on two cores slowed a
# page's events past CodeMirror's undo grouping and a walk's waits, and bought no time (2 min 17 s one after another,
# 2 min 0 s on four workers).
BROWSER_FILE = re.compile(r"tests/studio/test_browser\w*\.py$")


@pytest.hookimpl(optionalhook=True)  # a run without xdist (-p no:xdist) knows no such hook
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadFileScheduling

    if config.getvalue("dist") != "loadfile" or not hasattr(LoadFileScheduling, "_split_scope"):
        return None  # xdist's own scheduler (a later xdist may name its scope otherwise)

    class BrowserTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return "tests/studio/test_browser*.py" if BROWSER_FILE.search(scope) else scope

    return BrowserTogether(config, log)


def pytest_sessionfinish(session, exitstatus):
    if _OWN_MODULES:
        shutil.rmtree(_OWN_MODULES, ignore_errors=True)

ROOT = pathlib.Path(__file__).resolve().parent.parent
SAMPLES = ROOT / "sample_schemas"


@pytest.fixture(scope="session")
def tokenizer_bundle():
    """(name, tokenizer, codec) of the small model (SmolLM2-135M), without its weights."""
    from engine.model.load import load_tokenizer

    return load_tokenizer(SMALL_MODEL)


@pytest.fixture(scope="session")
def tiny_lm(tokenizer_bundle):
    """A 2-layer random-weight Llama with the default model's tokenizer and chat template."""
    return make_tiny_llama(tokenizer_bundle[1])


def make_tiny_llama(tok):
    """The tiny Llama of :func:`tiny_lm` (seed 0), for scripts that write test data too."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.model.load import wrap_model

    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    return wrap_model(model, tok, "tiny-llama", fingerprint="tiny-llama-seed0")


@pytest.fixture
def tiny_engine(tiny_lm):
    from engine.session import Engine

    return Engine.from_loaded(tiny_lm)


@pytest.fixture(scope="session")
def real_engine():
    """The small model on the CPU; ``PML_STUDIO_TEST_DEVICE=cuda`` runs the same tests with the model and the
    module store on a GPU, in fp32 so that the tolerances stay those of the CPU."""
    from engine.session import Engine

    device = os.environ.get("PML_STUDIO_TEST_DEVICE", "cpu")
    eng = Engine(model=SMALL_MODEL) if device == "cpu" else Engine(model=SMALL_MODEL, device=device, storage=device,
                                                                   dtype="float32")
    eng.lm  # load once per session
    return eng


def sample_pairs() -> list[tuple[str, pathlib.Path, pathlib.Path]]:
    out = []
    for schema in sorted(SAMPLES.glob("*.xml")):
        if schema.name.endswith(".prompt.xml"):
            continue
        out.append((schema.stem, schema, schema.with_name(schema.stem + ".prompt.xml")))
    return out



def spy_on_encode(monkeypatch, tokenizer) -> list[str]:
    """The texts ``tokenizer.encode`` is given from now on (it still encodes them)."""
    seen: list[str] = []
    plain = tokenizer.encode

    def spy(text, **kw):
        seen.append(text)
        return plain(text, **kw)

    monkeypatch.setattr(tokenizer, "encode", spy)
    return seen

# -- independent checks of a run: what a test computes itself, never a field of the result ---------

def first_token_kl(base, other) -> float:
    """KL(base || other) of two runs' first-token distributions, computed here with torch's kl_div."""
    import torch.nn.functional as F

    p, q = (F.log_softmax(r.first_logits.double(), -1) for r in (base, other))
    return float(F.kl_div(q, p, reduction="sum", log_target=True))


def decoded_fully(run, max_new_tokens: int, eos) -> bool:
    """The run decoded exactly ``max_new_tokens`` tokens, or fewer ending in its first end-of-sequence token."""
    ids, eos = run.token_ids, set(eos)
    return 0 < len(ids) <= max_new_tokens and not eos & set(ids[:-1]) and (len(ids) == max_new_tokens or ids[-1] in eos)


def timed(fn, *args, **kwargs):
    """(fn's result, wall-clock milliseconds the call took)."""
    import time

    t = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, (time.perf_counter() - t) * 1000


def arm_ms(comparison) -> float:
    """Milliseconds every arm of ``comparison`` reports for itself: TTFT, retention, then its decode steps (arms
    decoded together share their steps: the batch took as long as its longest-generating arm)."""
    runs = [res.run for res in comparison.arms.values()]
    assert all(r.ttft_ms > 0 for r in runs)
    decode = {id(r): (r.decode_ms_per_token or 0) * (len(r.token_ids) - 1) for r in runs}
    together = [decode[id(r)] for r in runs if r.decode_batch > 1]
    return (sum(r.ttft_ms + r.retention_ms for r in runs) + sum(decode[id(r)] for r in runs if r.decode_batch == 1)
            + max(together, default=0.0))


def stock_figures(model, ids: list[int], n_new: int, eos: tuple[int, ...]):
    """(last-position logits, greedy continuation) of a stock model, computed by transformers alone."""
    import torch

    x = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n_new, do_sample=False,
                             eos_token_id=list(eos), pad_token_id=eos[0], output_logits=True,
                             return_dict_in_generate=True)
    return out.logits[0][0].float(), tuple(out.sequences[0, len(ids):].tolist())


@pytest.fixture(scope="session")
def real_stock():
    """The default model as stock transformers loads it, with its own SDPA attention (the oracle's side)."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.model.packaged import default_model_dir

    return AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32,
                                                attn_implementation="sdpa").eval()


