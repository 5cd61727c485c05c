"""Requests served together (engine/run/scheduler.py): runs that join and leave a running batch give the tokens they
give alone, a request that joins gets its first token while the others still decode, a request whose client leaves
is gone from the next step with its KV released, and a request that cannot fit the pool waits for room or says so.
Checked on the tiny random-weight model, and on the real small model (the eager path and, where the engine's kernels
build, the C++ step)."""

from __future__ import annotations

import pytest
import torch

from engine.arms.registry import Sampling
from engine.kv import PoolFull
from engine.run.events import Done, FirstToken, Token
from engine.run.scheduler import Request, Scheduler
from engine.session import Engine
from test_prefix import SCHEMA  # three documents d1, d2, d3

PROMPTS = ['<prompt schema="docs"><d1/><d3/> When does the library open?</prompt>',
           '<prompt schema="docs"><d2/> What is it about?</prompt>',
           '<prompt schema="docs"><d1/><d2/><d3/> Name the three subjects.</prompt>',
           '<prompt schema="docs"><d3/> Say one word.</prompt>']
# (prompt, arms, new tokens): different lengths, arms and ends, so runs join and leave the batch at different steps
CASES = [(0, ("baseline", "cached"), 40), (1, ("cached",), 5), (2, ("prefix", "routed"), 9), (3, ("baseline",), 11)]


class Client:
    """One request's events as they arrive, what it returned or raised."""

    def __init__(self, engine: Engine, case: tuple, on_event=None):
        prompt, arms, new = case
        prepared = engine.prepare(SCHEMA, PROMPTS[prompt], new)
        config = engine.config.with_(arms=arms, warmup=False)
        self.events, self.result, self.error, self.left = [], None, None, False
        self.on_event = on_event
        self.request = Request(engine.request(prepared, Sampling(max_new_tokens=new), config=config), self.sink,
                               self.done, self.failed, lambda: self.left)

    def sink(self, event) -> None:
        self.events.append(event)
        if self.on_event is not None:
            self.on_event(self, event)

    def done(self, value) -> None:
        self.result = value

    def failed(self, err) -> None:
        self.error = err

    def tokens(self) -> dict[str, tuple[int, ...]]:
        return {a.value: r.run.token_ids for a, r in self.result.arms.items()}


def alone(engine: Engine, case: tuple) -> dict[str, tuple[int, ...]]:
    prompt, arms, new = case
    res = engine.compare(SCHEMA, PROMPTS[prompt], Sampling(max_new_tokens=new),
                         config=engine.config.with_(arms=arms, warmup=False))
    return {a.value: r.run.token_ids for a, r in res.arms.items()}


def served_together(engine: Engine, cases: list[tuple], join_after: int = 2, log: list | None = None) -> list[Client]:
    """The first case's request alone, the others joining once it has ``join_after`` tokens; driven to the end
    (``log``: every (client index, event) as it arrives)."""
    rows: list[int] = []
    engine.scheduler.on_step = rows.append
    joined = []

    def logged(index: int):
        return lambda client, event: log.append((index, event)) if log is not None else None

    def join(client, event) -> None:
        logged(0)(client, event)
        if isinstance(event, Token) and not joined and len([e for e in client.events if isinstance(e, Token)]) >= \
                join_after:
            joined.append(True)
            for other in clients[1:]:
                engine.scheduler.submit(other.request)

    clients = [Client(engine, cases[0], join)] + [Client(engine, c, logged(i + 1)) for i, c in enumerate(cases[1:])]
    engine.scheduler.submit(clients[0].request)
    try:
        engine.scheduler.drive()
    finally:
        engine.scheduler.on_step = None
    served_together.rows = rows
    return clients


def test_runs_that_join_and_leave_a_running_batch_give_their_tokens_alone(tiny_lm):
    engine = Engine.from_loaded(tiny_lm)
    want = [alone(engine, c) for c in CASES]
    clients = served_together(Engine.from_loaded(tiny_lm), CASES)
    assert [c.error for c in clients] == [None] * 4
    assert [c.tokens() for c in clients] == want
    rows = served_together.rows
    assert rows[0] == 2 and max(rows) >= 4 and rows[-1] < max(rows)  # its two arms, joined by others, who leave
    shared = [r.run.decode_shared for c in clients for r in c.result.arms.values()]
    assert max(shared) > 0  # a run's figures say it shared its steps with other requests'


def test_a_request_that_joins_gets_its_first_token_while_the_others_decode(tiny_lm):
    engine = Engine.from_loaded(tiny_lm)
    log: list[tuple[int, object]] = []  # (client, event) in the order they arrived
    clients = served_together(engine, [(0, ("baseline",), 30), (3, ("cached",), 4)], join_after=3, log=log)
    assert [c.error for c in clients] == [None, None]
    joiner_first = next(i for i, (c, e) in enumerate(log) if c == 1 and isinstance(e, FirstToken))
    first_last = max(i for i, (c, e) in enumerate(log) if c == 0 and isinstance(e, Token))
    assert joiner_first < first_last
    tokens_then = sum(1 for c, e in log[:joiner_first] if c == 0 and isinstance(e, Token))
    assert tokens_then < 10  # it waited for its own fill, not for the 29 tokens of the other


def test_a_client_that_leaves_is_gone_from_the_next_step_and_its_kv_released(tiny_lm):
    engine = Engine.from_loaded(tiny_lm)
    pool = engine.pool
    stay, leave = Client(engine, (0, ("baseline",), 20)), Client(engine, (2, ("baseline", "cached"), 20))
    steps: list[int] = []
    engine.scheduler.on_step = steps.append

    def go(client, event) -> None:
        if isinstance(event, Token) and len([e for e in client.events if isinstance(e, Token)]) == 3:
            client.left = True  # its client went away: at the next turn it is closed
            go.held = len(pool.held)
            go.at = len(steps)

    leave.on_event = go
    engine.scheduler.submit(stay.request)
    engine.scheduler.submit(leave.request)
    engine.scheduler.drive()
    engine.scheduler.on_step = None
    assert stay.error is None and len(stay.tokens()["baseline"]) == 20
    assert leave.result is None and type(leave.error).__name__ == "Stopped"
    assert steps[go.at - 1] == 3 and steps[go.at] == 1  # three runs before; the next step has the one left
    assert go.held == 3 and pool.held == {}  # every lease back in the pool


def test_a_request_waits_for_room_and_one_that_can_never_fit_says_so(tiny_lm):
    """A pool with room for one run at a time: two requests both answered, the second once the first's lease is
    back; a run larger than the whole pool is refused with the budget to raise."""
    probe = Engine.from_loaded(tiny_lm)
    need = len(probe.prepare(SCHEMA, PROMPTS[0]).plan.token_ids) + 12 + 1
    engine = Engine.from_loaded(tiny_lm, kv_budget_bytes=int(need * 1.5) * probe.pool.token_bytes)
    clients = [Client(engine, (0, ("baseline",), 12)), Client(engine, (0, ("baseline",), 12))]
    for c in clients:
        engine.scheduler.submit(c.request)
    engine.scheduler.drive()
    assert [c.error for c in clients] == [None, None] and clients[0].tokens() == clients[1].tokens()
    first_end = max(i for i, e in enumerate(clients[0].events) if isinstance(e, Token))
    assert engine.pool.peak_tokens <= engine.pool.tokens and first_end > 0
    with pytest.raises(PoolFull, match="raise --kv-budget-mb"):
        engine.compare(SCHEMA, PROMPTS[2], Sampling(12 * need), config=engine.config.with_(arms=("baseline",)))


@pytest.mark.real_model
@pytest.mark.parametrize("weights", ["fp32", "int8"])
def test_on_the_real_model_runs_served_together_give_their_tokens_alone(weights, monkeypatch):
    """SmolLM2-135M, fp32 compute: its own dense weights (the eager batched step) and int8 weights (the C++ step where
    the engine's kernels build, else torch's)."""
    from engine.model import SMALL_MODEL
    from engine.run import scheduler, timing

    # the prompts in chunks of ~16 tokens and a step after each event: they are short, and a long prompt's chunked
    # forwards round otherwise than one whole forward (a real model's greedy answer can turn on that)
    monkeypatch.setattr(timing, "PREFILL_CHUNK", 16)
    monkeypatch.setattr(scheduler, "FILL_BUDGET_S", 0.0)
    engine = Engine(model=SMALL_MODEL, weights=weights, persist=False)
    want = [alone(engine, c) for c in CASES]
    clients = served_together(Engine.from_loaded(engine.lm, weights=weights), CASES, join_after=3)
    assert [c.error for c in clients] == [None] * 4
    assert [c.tokens() for c in clients] == want
    assert max(served_together.rows) >= 4


@pytest.mark.parametrize("budget", [0.0, 60.0])
def test_requests_fill_for_the_budget_before_the_batch_steps(tiny_lm, monkeypatch, budget):
    """Three requests sent together: with no fill budget the first decode step has the first request's run alone
    (one fill event per step); with a budget longer than all three fills, they all fill before it and the first step
    is all three. Their tokens are their own either way."""
    from engine.run import scheduler

    monkeypatch.setattr(scheduler, "FILL_BUDGET_S", budget)
    cases = [(0, ("baseline",), 6), (1, ("baseline",), 6), (3, ("baseline",), 6)]
    want = [alone(Engine.from_loaded(tiny_lm), c) for c in cases]
    engine = Engine.from_loaded(tiny_lm)
    rows: list[int] = []
    engine.scheduler.on_step = rows.append
    clients = [Client(engine, c) for c in cases]
    for c in clients:
        engine.scheduler.submit(c.request)
    engine.scheduler.drive()
    assert [c.error for c in clients] == [None] * 3 and [c.tokens() for c in clients] == want
    assert rows[0] == (3 if budget else 1)


def test_a_long_prefill_lets_the_decoding_runs_step_between_its_chunks(tiny_lm, monkeypatch):
    """A baseline prefill of 3 documents in chunks of about 4 tokens, no fill budget: the running request takes a
    step between chunks (it streams while the other prefills); the prompt goes in the same chunks alone and beside
    others (where they end depends on the prompt alone), giving the tokens of one whole forward."""
    from engine.run import forward, scheduler, timing

    monkeypatch.setattr(scheduler, "FILL_BUDGET_S", 0.0)  # a step after every chunk (the tiny model's take µs)
    engine = Engine.from_loaded(tiny_lm)
    long_case, running = (2, ("baseline",), 6), (0, ("baseline",), 60)
    whole = alone(engine, long_case)
    monkeypatch.setattr(timing, "PREFILL_CHUNK", 4)
    prefills, prefill = [], forward.prefill
    monkeypatch.setattr(forward, "prefill", lambda lm, lease, ids, *a: prefills.append(len(ids)) or
                        prefill(lm, lease, ids, *a))
    assert alone(engine, long_case) == whole
    prompt_tokens = len(engine.prepare(SCHEMA, PROMPTS[2], 6).plan.token_ids)
    chunks = list(prefills)
    assert len(chunks) == round(prompt_tokens / 4) >= 5 and sum(chunks) == prompt_tokens
    assert max(chunks) - min(chunks) <= 1  # near-equal: no short last chunk costing a forward of its own
    log: list[tuple[int, object]] = []
    prefills.clear()
    clients = served_together(engine, [running, long_case], join_after=2, log=log)
    assert [c.error for c in clients] == [None, None]
    assert clients[1].tokens() == whole
    joined = [i for i, (c, e) in enumerate(log) if c == 0 and isinstance(e, Token)][1] + 1  # its second: sent then
    first = next(i for i, (c, e) in enumerate(log) if c == 1 and isinstance(e, FirstToken))
    between = sum(1 for c, e in log[joined:first] if c == 0 and isinstance(e, Token))
    assert between >= len(chunks) - 1  # a step between every two chunks
    assert prefills[-len(chunks):] == chunks  # the chunks it went in alone
