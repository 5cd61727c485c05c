"""Two ``pml-studio api`` workers on one module store folder, as behind a router (tools/replicas.py,
docs/scale-out.md): a document set one encoded is answered by the other from the store (``modules_encoded`` 0), and
both encoding one new set at once leave one valid entry a module."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from engine.cache.store import DiskStore
from engine.model import SMALL_MODEL
from tests.studio_fixtures import AUTH, TOKEN
from tools.replicas import studio_workers

START_S = 240  # two workers' imports and model loads on a busy machine (a readiness wait, not a timing)


def essay(name: str) -> str:
    return f"Essay {name}: " + " ".join(f"{name} kept log {i} of tides, ferries and fog at the harbour." for i in
                                        range(6))


def ask(worker, docs, question: str) -> dict:
    content = [{"type": "text", "text": d} for d in docs] + [{"type": "text", "text": question}]
    body = {"model": SMALL_MODEL, "max_tokens": 3, "temperature": 0,
            "messages": [{"role": "system", "content": "Answer from the logs."}, {"role": "user", "content": content}]}
    response = httpx.post(f"{worker.url}/v1/chat/completions", json=body, headers=AUTH, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()["pml"]


def test_two_workers_on_one_store_reuse_each_others_encodings(tmp_path):
    store = tmp_path / "modules"
    docs = [essay(n) for n in ("Ines", "Jory", "Kalle")]
    with studio_workers(2, store, TOKEN, SMALL_MODEL, deadline_s=START_S) as (one, two):
        assert httpx.get(f"{one.url}/health", timeout=10).status_code == 200  # no token: a router's check
        assert ask(one, docs, "Who logged fog?")["modules_encoded"] == 3
        second = ask(two, docs[::-1], "Who logged ferries?")  # another order, another worker: read from the store
        assert second["modules_encoded"] == 0 and second["modules_reused"] == 3
        before = set(store.iterdir())

        new = [essay(n) for n in ("Lotte", "Mads")]  # both workers encode one new set at once
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda w: ask(w, new, "Who kept log 2?"), (one, two)))
        assert all(a["modules_encoded"] + a["modules_reused"] == 2 for a in answers)
    added = set(store.iterdir()) - before
    assert len(added) == 2 and all(p.suffix == ".safetensors" for p in added)  # one entry a module, no temporary
    disk = DiskStore(store)
    assert all(disk.load(p.stem) is not None for p in store.iterdir()) and disk.corrupt == 0
