"""What a run yields as it goes: typed events the caller pulls, one at a time, and stops by closing the generator
(after nanochat's ``Engine.generate``). The arms' own (``ArmDone``, ``Done``) sit with the Comparison in
engine/arms/compare.py; ``Engine.events`` yields them all."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generator, TypeVar

from engine.cache.encode import UnitEncoded
from engine.run.types import RunResult

__all__ = ["UnitEncoded", "Warming", "Warmed", "FirstToken", "Token", "finish"]


@dataclass(frozen=True)
class Warming:
    """The prefix cache is being warmed with a schema's modules in schema order."""

    tokens: int


@dataclass(frozen=True)
class Warmed:
    """The warm-up is done."""

    ms: float


@dataclass(frozen=True)
class FirstToken:
    """An arm's first token, as soon as it is sampled: its TTFT and the rest of its first-token figures in ``run``
    (its text so far is the first token's)."""

    arm: str
    token_id: int
    text: str
    run: RunResult

    @property
    def ttft_ms(self) -> float:
        return self.run.ttft_ms


@dataclass(frozen=True)
class Token:
    """One more token of an arm: ``text`` is its whole text so far, ``delta`` what this token added to it (an
    unfinished character shows as U+FFFD until its last byte arrives, so ``delta`` may rewrite: use ``text``)."""

    arm: str
    token_id: int
    delta: str
    text: str


T = TypeVar("T")


def finish(events: Generator[object, None, T]) -> T:
    """Pull every event of ``events`` and return what it returns."""
    while True:
        try:
            next(events)
        except StopIteration as done:
            return done.value
