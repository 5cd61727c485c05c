"""What a run yields as it goes: typed events the caller pulls and stops by closing the generator (after
nanochat's ``Engine.generate``); ``ArmDone`` and ``Done`` sit with the Comparison (engine/arms/compare.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generator, TypeVar

from engine.cache.encode import UnitEncoded
from engine.run.types import RunResult

__all__ = ["UnitEncoded", "Warming", "Warmed", "FirstToken", "Token", "finish"]


@dataclass(frozen=True)
class Warming:
    """The prefix cache's warm-up (a schema's modules in schema order) starts."""

    tokens: int


@dataclass(frozen=True)
class Warmed:
    """The warm-up is done."""

    ms: float


@dataclass(frozen=True)
class FirstToken:
    """An arm's first token, as soon as it is sampled; ``run``: its first-token figures (TTFT, prefill)."""

    arm: str
    token_id: int
    text: str
    run: RunResult

    @property
    def ttft_ms(self) -> float:
        return self.run.ttft_ms


@dataclass(frozen=True)
class Token:
    """One more token of an arm: ``text`` its text so far, ``delta`` what changed at its end (U+FFFD stands for
    an unfinished character until its last byte)."""

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
