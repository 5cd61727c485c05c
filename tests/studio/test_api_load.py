"""The API under load (the engine's scheduler, engine/run/scheduler.py): concurrent requests decode in one batch and
each answer says so (``pml.decode_batch``, ``pml.queue_ms``); ``/metrics`` shows the running and waiting requests
and the KV pool's use; 64 clients at once leave memory within the pool's budget plus the weights, the KV pool never
past its budget, every client answered or told 429. Client: the official openai package."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai

from engine.runlog import RunLog
from engine.session import Engine
from tests.hostile_upstream import peak_growth, rss
from tests.studio_fixtures import AUTH, TOKEN, served_studio

MODEL = "tiny-llama"
DOC = "The harbour of Vell keeps three ferries, each named after a wind: " + "north, south and east. " * 12


def client_for(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=TOKEN, max_retries=0, timeout=300)


def ask(client: openai.OpenAI, i: int, new: int):
    return client.chat.completions.create(
        model=MODEL, max_tokens=new, temperature=0, extra_body={"pml": {"arm": ("cached", "baseline")[i % 2]}},
        messages=[{"role": "user", "content": [{"type": "text", "text": DOC}, {"type": "text", "text": f"Q{i}?"}]}])


def test_concurrent_requests_decode_together_and_their_answers_say_so(tiny_lm, tmp_path):
    engine = Engine.from_loaded(tiny_lm)
    with served_studio(engine, RunLog(tmp_path / "runs.db")) as (_, port):
        client = client_for(port)
        lengths = [24, 6, 16, 10]  # they join and leave at different steps
        alone = [ask(client, i, n) for i, n in enumerate(lengths)]
        assert all(a.model_extra["pml"]["decode_batch"] == 1 for a in alone)
        gate = threading.Barrier(len(lengths))

        def together(i: int):
            gate.wait()
            return ask(client, i, lengths[i])

        with ThreadPoolExecutor(len(lengths)) as pool:
            answers = list(pool.map(together, range(len(lengths))))
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", headers=AUTH).text
    assert [a.choices[0].message.content for a in answers] == [a.choices[0].message.content for a in alone]
    pml = [a.model_extra["pml"] for a in answers]
    assert max(p["decode_batch"] for p in pml) >= 2 and max(p["decode_shared"] for p in pml) > 0
    assert all(p["queue_ms"] >= 0 for p in pml)
    for name in ("pml:num_requests_running", "pml:num_requests_waiting", "pml:num_sequences_running",
                 "pml:kv_cache_usage_perc", "pml:kv_cache_budget_bytes", "pml:decode_batch_size"):
        assert f"\n{name} " in metrics, name


def test_sixty_four_clients_at_once_stay_within_the_pools_budget(tiny_lm, tmp_path):
    """A KV pool with room for about four runs, 32 requests in flight at most: 64 clients at once are answered or
    told 429, none fails otherwise; the pool's leases never pass its budget and the process's memory grows by less
    than the budget plus the weights (and the 64 connections' own buffers, an allowance measured on this machine)."""
    token_bytes = 2 * tiny_lm.n_layers * tiny_lm.kv_heads * tiny_lm.head_dim * 4
    engine = Engine.from_loaded(tiny_lm, kv_budget_bytes=4 * 160 * token_bytes)
    weights = sum(p.numel() * p.element_size() for p in tiny_lm.model.parameters())
    with served_studio(engine, RunLog(tmp_path / "runs.db"), api={"max_queue": 32}) as (_, port):
        client = client_for(port)
        ask(client, 0, 2)  # the documents encoded once, the server warm
        before = rss()
        gate = threading.Barrier(64)

        def one(i: int) -> str:
            gate.wait()
            try:
                return ask(client, i, 12).choices[0].finish_reason
            except openai.RateLimitError:
                return "429"

        with peak_growth() as growth, ThreadPoolExecutor(64) as pool:
            outcomes = list(pool.map(one, range(64)))
        after = rss()
    answered = sum(o in ("stop", "length") for o in outcomes)
    assert answered + outcomes.count("429") == 64 and answered >= 32
    assert engine.pool.peak_tokens <= engine.pool.tokens and engine.pool.held == {}
    allowance = 32 << 20  # the server's and the 64 clients' threads and sockets, not KV
    print(f"64 clients: {answered} answered, {outcomes.count('429')} told 429, peak growth {growth[0] / 2**20:.1f} MB, "
          f"after {(after - before) / 2**20:.1f} MB; pool {engine.pool.budget_bytes / 2**20:.2f} MB, weights {weights / 2**20:.1f} MB")
    assert growth[0] < engine.pool.budget_bytes + weights + allowance, growth[0] / 2**20
    assert after - before < engine.pool.budget_bytes + weights + allowance
