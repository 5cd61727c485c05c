"""Decoding after the first token (:func:`step_all`: runs that can share a forward in one batch, the others one by
one), by a comparison's :class:`Decoder`, or parked (:class:`Park`) under the scheduler beside every other
request's runs. :class:`Room`: a lease did not fit the pool yet; :class:`Breathe`: a prefill between chunks."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Generator, Iterator

import torch

from engine.kv.pool import KVPool, Lease, PoolFull
from engine.model.attend import AttentionSpec
from engine.model.load import LoadedModel
from engine.run import forward
from engine.run.events import Directive, Token
from engine.run.sampling import sample
from engine.run.stream import TextStream
from engine.run.types import RunResult, Sampling


@dataclass(eq=False)
class Started:
    """A run after its first token: its lease, what it has generated, what its decode steps attend to."""

    arm: str
    lease: Lease
    tokens: list[int]
    next_pos: int
    sampling: Sampling
    gen: torch.Generator | None
    spec: AttentionSpec
    text: TextStream
    done: bool = False
    spent: float = 0.0  # seconds of the steps it generated in
    steps: int = 0
    rows: int = 0  # the most rows of a step it generated in
    shared: int = 0  # rows of other requests' runs in its steps, summed
    said: str = field(default="", repr=False)  # its text as the last Token gave it
    run: RunResult | None = field(default=None, repr=False)  # its first-token figures, once timed

    @property
    def decode_ms_per_token(self) -> float | None:
        return self.spent * 1000 / self.steps if self.steps else None

    @property
    def batch(self) -> int:
        return max(1, self.rows)

    def result(self, tokenizer, run: RunResult) -> RunResult:
        """``run`` with the tokens generated so far."""
        return dataclasses.replace(run, text=tokenizer.decode(self.tokens, skip_special_tokens=True),
                                   token_ids=tuple(self.tokens), decode_tokens=len(self.tokens),
                                   decode_ms_per_token=self.decode_ms_per_token, decode_batch=self.batch,
                                   decode_shared=round(self.shared / self.steps, 2) if self.steps else 0.0)

    def token(self) -> Token:
        """The Token event of its newest token."""
        text = self.text.push(self.tokens[-1])
        same = len(self.said) if text.startswith(self.said) else len(_common_prefix(self.said, text))
        self.said = text
        return Token(self.arm, self.tokens[-1], text[same:], text)


@dataclass(eq=False)
class Park(Directive):
    """Step ``runs`` with every other request's until each ends; :attr:`tokens`: their events since."""

    runs: list[Started]
    tokens: list[Token] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return all(r.done for r in self.runs)

    def alone(self) -> None:
        raise RuntimeError("a Park comes only from a decoder a scheduler made (Decoder(parks=True)); drive the run "
                           "with that scheduler")


class Breathe(Directive):
    """Before a long prefill's next chunk: the decoding runs step."""

    def alone(self) -> None:
        pass


@dataclass(frozen=True)
class Room(Directive):
    """A lease of ``tokens`` slots did not fit ``pool`` now."""

    pool: KVPool
    tokens: int

    def alone(self) -> None:
        used = self.pool.stats()
        raise PoolFull(f"the KV pool holds {used['tokens']:,} tokens, {used['used_tokens']:,} of them leased by this "
                       f"run's own arms, and has no room for {self.tokens:,} more; raise --kv-budget-mb or run the "
                       "arms apart (--decode apart)")


class Decoder:
    """Where a comparison's runs lease their KV and decode: at once, or ``together`` once every arm has its first
    token; with ``parks``, by the scheduler driving it. It releases a kept run's lease when the run ends."""

    def __init__(self, lm: LoadedModel, together: bool = False, parks: bool = False, pool: KVPool | None = None):
        from engine.run.pools import pool_of

        self.lm, self.together, self.parks = lm, together, parks
        self.pool = pool or pool_of(lm)  # where its runs lease their KV
        self.waiting: list[Started] = []
        self.kept: list[Started] = []  # every run kept for rest()

    def take(self, run: Started) -> Iterator[Token]:
        """Decode ``run`` now, or keep it for :meth:`rest` (plain attention only: a focus is read after decoding)."""
        if self.together and run.spec.plain and batchable(self.lm, run):
            self.waiting.append(run)
            self.kept.append(run)
            return
        yield from self._decode([run])

    def rest(self) -> Iterator[Token]:
        """Decode every waiting run, together; release their leases."""
        waiting, self.waiting = self.waiting, []
        try:
            yield from self._decode(waiting)
        finally:
            for run in waiting:
                run.lease.release()

    def owns(self, run: Started) -> bool:
        """Whether ``run``'s lease waits here for :meth:`rest`."""
        return any(r is run for r in self.kept)

    def close(self) -> None:
        """Release the leases of runs still waiting (the comparison stopped early)."""
        for run in self.waiting:
            run.lease.release()
        self.waiting = []

    def finish(self, run: RunResult) -> RunResult:
        """``run`` (a timed run's result) with every token its decode gave, known by its first logits."""
        for s in self.kept:
            if s.run is not None and s.run.first_logits is run.first_logits:
                return s.result(self.lm.tokenizer, s.run)
        return run

    def _decode(self, runs: list[Started]) -> Iterator[Token]:
        live = [r for r in runs if not _mark_ended(self.lm, r)]
        if not live:
            return
        if not self.parks:
            while not all(r.done for r in live):
                yield from step_all(self.lm, live)
            return
        park = Park(live)
        while True:
            yield park  # the scheduler steps it with everything else, then resumes the request
            tokens, park.tokens = park.tokens, []
            yield from tokens
            if park.done:
                return


def take_lease(pool: KVPool, tokens: int) -> Generator[Room, None, Lease]:
    """A lease of ``tokens`` slots, waiting (:class:`Room`) while the pool has no room."""
    while (lease := pool.lease(tokens)) is None:
        yield Room(pool, tokens)
    return lease


def step_all(lm: LoadedModel, runs: list[Started], owner: dict[int, int] | None = None) -> list[Token]:
    """One decode step of every run not done (batchable ones in one forward); their Tokens. ``owner``: each run's
    request by ``id(run)`` (whose rows it shared)."""
    owner = owner or {}
    live = [r for r in runs if not r.done]
    rows = [forward.Row(r.lease, r.tokens[-1], r.next_pos, r.spec) for r in live]
    together = [i for i, row in enumerate(rows) if forward.batchable(lm, row)]
    groups = ([together] if together else []) + [[i] for i in range(len(rows)) if i not in set(together)]
    with torch.inference_mode():
        for group in groups:
            s = time.perf_counter()
            logits = forward.step(lm, [rows[i] for i in group])
            for row, i in enumerate(group):
                r = live[i]
                r.tokens.append(sample(logits[row], r.sampling, r.gen, r.arm, len(r.tokens)))
                r.next_pos += 1
            sync(lm.device)
            spent = time.perf_counter() - s
            for i in group:
                r = live[i]
                r.spent, r.steps, r.rows = r.spent + spent, r.steps + 1, max(r.rows, len(group))
                r.shared += sum(owner.get(id(live[j])) != owner.get(id(r)) for j in group)
                _mark_ended(lm, r)
    return [r.token() for r in live]


def batchable(lm: LoadedModel, run: Started) -> bool:
    """Whether ``run`` can share decode steps with others (engine/run/forward.py) and has tokens to go."""
    return forward.batchable(lm, forward.Row(run.lease, 0, 0, run.spec)) and not ended(lm, run.tokens, run.sampling)


def ended(lm: LoadedModel, tokens: list[int], sampling: Sampling) -> bool:
    """Whether generation is over: max tokens, end of sequence, or a stop string."""
    if len(tokens) >= sampling.max_new_tokens or tokens[-1] in lm.eos_ids:
        return True
    if not sampling.stop:
        return False
    longest = max(len(s.encode()) for s in sampling.stop)  # a token holds at least one byte
    tail = lm.tokenizer.decode(tokens[-(longest + 2):], skip_special_tokens=True)
    return any(s in tail for s in sampling.stop)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# -- internal helpers --

def _mark_ended(lm: LoadedModel, run: Started) -> bool:
    run.done = run.done or ended(lm, run.tokens, run.sampling)
    return run.done


def _common_prefix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]
