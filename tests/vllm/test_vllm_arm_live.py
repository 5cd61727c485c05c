"""The vllm arm against a real vLLM server (marker ``vllm``: ``make test-vllm``): the ids it prefills are the
baseline's, a schema-order prompt sent again is read from vLLM's prefix cache, and the CLI runs the arm."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.arms.registry import Sampling
from engine.model import SMALL_MODEL
from tests.conftest import ROOT, SAMPLES

pytestmark = pytest.mark.vllm

SAMPLE = "almanac"  # the longest sample: 530 prompt tokens on SmolLM2, 33 of vLLM's 16-token blocks


@pytest.fixture(scope="module")
def engine():
    from engine.session import Engine

    return Engine(model=SMALL_MODEL)


def sample(name: str = SAMPLE) -> tuple[str, str]:
    return (SAMPLES / f"{name}.xml").read_text(), (SAMPLES / f"{name}.prompt.xml").read_text()


def test_vllm_prefills_the_baselines_ids_and_answers_as_it_does(engine, vllm_server):
    schema, prompt = sample()
    comp = engine.compare(schema, prompt, Sampling(max_new_tokens=12), config=engine.config.with_(
        arms=("baseline", "vllm"), vllm_url=vllm_server.url, vllm_model=vllm_server.model))
    remote = comp.arm("vllm")
    assert remote.error is None
    ids = engine.plan(engine.layout(schema), prompt).token_ids
    assert remote.detail.prompt_tokens == len(ids) == comp.prompt.prompt_tokens  # vLLM counted the ids we sent
    assert remote.agreement.first_token_agree  # fp32 on both sides
    assert remote.run.ttft_ms > 0 and len(remote.run.token_ids) >= 1


def test_the_same_schema_order_prompt_sent_twice_is_read_from_vllms_cache(engine, vllm_server):
    schema, prompt = sample()
    config = engine.config.with_(arms=("vllm",), vllm_url=vllm_server.url, vllm_model=vllm_server.model)
    runs = [engine.compare(schema, prompt, Sampling(max_new_tokens=2), config=config).arm("vllm") for _ in range(2)]
    second = runs[1].detail
    assert runs[1].error is None and second.prompt_tokens > 400
    assert second.server_cached_tokens / second.prompt_tokens >= 0.9
    assert second.server_cached_tokens % 16 == 0  # whole blocks


def test_the_cli_runs_the_arm_beside_the_baseline(vllm_server, tmp_path):
    schema, prompt = SAMPLES / "travel.xml", SAMPLES / "travel.prompt.xml"
    out = subprocess.run([sys.executable, "-m", "engine.cli", "run", str(schema), str(prompt), "--json",
                          "--arms", "baseline,vllm", "--vllm-url", vllm_server.url, "--vllm-model", vllm_server.model,
                          "--max-new-tokens", "6", "--model", SMALL_MODEL, "--weights", "fp32"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    assert doc["vllm"]["error"] is None and doc["vllm"]["server_prompt_tokens"] == doc["prompt_tokens"]
    assert doc["vllm"]["served_model"] == vllm_server.model and doc["vllm_first_token_agree"] is True
