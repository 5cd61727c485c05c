"""A full disk under the module store: the request answers from memory and says why nothing was stored; never a 500.

The store's folder is a 2 MB tmpfs nearly filled by another file (where this process may mount one: root, as CI), or
else a writer that fails as safetensors does on a full disk (its own SafetensorError, not an OSError).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import openai
import pytest

from engine.arms.registry import Sampling
from engine.runlog import RunLog
from engine.session import Engine
from studio.views import summary_html
from tests.studio.test_api import ESSAYS, MODEL, parts
from tests.studio_fixtures import TOKEN, served_studio


@pytest.fixture
def full_store(tmp_path, monkeypatch) -> Path:
    """A module store folder with no room left."""
    folder = tmp_path / "modules"
    folder.mkdir(mode=0o700)
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(folder)], capture_output=True).returncode == 0
    if mounted:
        with open(folder / "ballast", "wb", buffering=0) as f:  # the other files of a full disk
            for size in (65536, 4096, 1):
                try:
                    while True:
                        f.write(b"\0" * size)
                except OSError:
                    pass
    else:
        import safetensors
        import safetensors.torch

        def no_room(*args, **kwargs):
            raise safetensors.SafetensorError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, "
                                              'message: "No space left on device" })')
        monkeypatch.setattr(safetensors.torch, "save_file", no_room)
    yield folder
    if mounted:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_compare_on_a_full_disk_runs_from_memory_and_says_so(tiny_lm, full_store):
    eng = Engine.from_loaded(tiny_lm, module_dir=str(full_store), persist=True)
    schema = ('<schema name="full"><module name="doc">' + ESSAYS[0] + "</module></schema>")
    prompt = '<prompt schema="full"><doc/>What did Ada write about?</prompt>'
    res = eng.compare(schema, prompt, Sampling(max_new_tokens=3),
                      config=eng.config.with_(arms=("baseline", "cached"), warmup=False))
    assert res.arm("cached").run.text == res.arm("baseline").run.text or res.arm("cached").run.token_ids
    assert res.encode["unsaved"] >= 1 and "cannot write" in res.encode["store_note"]
    assert not list(full_store.glob("*.safetensors"))  # nothing half-written left behind
    assert "not saved" in summary_html(res)
    # the entry served from memory: a second run reads it there, encoding nothing
    again = eng.compare(schema, prompt, Sampling(max_new_tokens=3),
                        config=eng.config.with_(arms=("cached",), warmup=False))
    assert again.encode["encoded"] == 0


def test_the_api_answers_on_a_full_disk_and_says_nothing_was_stored(tiny_lm, full_store, tmp_path):
    eng = Engine.from_loaded(tiny_lm, module_dir=str(full_store), persist=True)
    with served_studio(eng, RunLog(tmp_path / "runs.db")) as (_, port):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=TOKEN, max_retries=0)
        messages = [{"role": "user", "content": parts(*ESSAYS[:2], "Who wrote about rivers?")}]
        answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0,
                                                extra_body={"pml": {"arm": "cached"}})
    pml = answer.model_extra["pml"]
    assert answer.choices[0].finish_reason in ("length", "stop")
    assert pml["modules_encoded"] >= 2 and "cannot write" in pml["store_note"], pml
