"""Every event a run yields, pulled by the caller, who stops it by closing the generator (nanochat's
``Engine.generate``). It imports nothing of the engine, so any floor may yield one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generator, TypeVar, Union

__all__ = ["UnitEncoded", "Warming", "Warmed", "FirstToken", "Token", "ArmDone", "Done", "Event", "Directive", "finish"]


@dataclass(frozen=True)
class UnitEncoded:
    """``done`` of ``total`` units are available, the last one ``unit``."""

    done: int
    total: int
    unit: str  # its name ("already encoded" when every unit was)


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


@dataclass(frozen=True)
class ArmDone:
    """An arm's final result, with its agreement with the baseline, once every arm has decoded."""

    result: ArmResult

    @property
    def arm(self) -> "Arm":
        return self.result.arm


@dataclass(frozen=True)
class Done:
    """The run is over: every arm's result."""

    comparison: Comparison


# Engine.events yields encoding and warming, per arm a FirstToken and Tokens, an ArmDone per arm, then a Done
Event = Union[UnitEncoded, Warming, Warmed, FirstToken, Token, ArmDone, Done]

T = TypeVar("T")


class Directive:
    """A run's word to the scheduler driving it (Park, Room, Breathe: engine/run/decode.py), not an event."""

    def alone(self) -> None:
        """Answer it with no scheduler (:func:`finish`)."""
        raise NotImplementedError


def finish(events: Generator[object, None, T]) -> T:
    """Pull every event of ``events`` (no scheduler: each directive answered alone) and return what it returns."""
    while True:
        try:
            event = next(events)
        except StopIteration as done:
            return done.value
        if isinstance(event, Directive):
            event.alone()
