"""The real vLLM server the tests marked ``vllm`` talk to (``make test-vllm``; ``make test`` deselects them).

``vllm_server`` is ``$PML_VLLM_URL`` (serving ``$PML_VLLM_MODEL``, else its one model) when set; else one vLLM started
for the session from .peers/vllm (``make vllm``) on the tests' model (SmolLM2-135M, fp32) and stopped at the session's
end, however it ends. Without either, the tests skip with one reason.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest

from tools.screenshot import free_port
from tools.vllm_serve import VLLM_PYTHON, ServeError, served, start, stop

TEST_MODEL = "default"  # the packaged SmolLM2-135M-Instruct, served under this name


@dataclass(frozen=True)
class VllmServer:
    url: str  # base, no /v1
    model: str  # the served model's name


@pytest.fixture(scope="session")
def vllm_server():
    url = os.environ.get("PML_VLLM_URL")
    if url:
        url = url.rstrip("/").removesuffix("/v1")
        names = served(url)
        if not names:
            pytest.fail(f"$PML_VLLM_URL={url} does not answer /v1/models; start it or unset the variable")
        yield VllmServer(url, os.environ.get("PML_VLLM_MODEL") or names[0])
        return
    if not VLLM_PYTHON.exists():
        pytest.skip("no vLLM: run `make vllm` (or set $PML_VLLM_URL to a running server)")
    try:
        proc, url = start(TEST_MODEL, free_port(), str(VLLM_PYTHON))
    except ServeError as e:
        pytest.fail(str(e))
    try:
        yield VllmServer(url, TEST_MODEL)
    finally:
        stop(proc)
