"""The accepted range of every numeric setting, checked one way by every front end."""

from __future__ import annotations

import argparse
import math
import numbers
from dataclasses import dataclass

from engine.errors import EngineError

MAX_REPAIR = 64
MAX_SINK = 64
MAX_NEW_TOKENS = 1 << 20  # the plan checks the model's own context
MAX_BUDGET_MIB = 1 << 30  # 1 PiB; in bytes it still fits SQLite's integers
MAX_TEMPERATURE = 100.0  # already far past uniform sampling
MAX_SEED = 2**64 - 1  # torch.Generator's range


@dataclass(frozen=True)
class Limit:
    """The accepted values of one numeric setting: finite, from ``lo`` to ``hi``."""

    name: str  # as messages name it
    lo: float
    hi: float = math.inf
    whole: bool = False
    open_lo: bool = False
    example: str = ""  # the fix a message suggests
    meaning: str = ""  # the range in words, when the computed one reads badly

    def describe(self) -> str:
        """The accepted range in words: 'in (0, 1]'."""
        if self.meaning:
            return self.meaning
        if self.whole:
            return f"a whole number from {self.lo} to {self.hi}"
        if self.hi == math.inf:
            return f"a finite number {'above' if self.open_lo else 'of at least'} {self.lo:g}"
        return f"in {'(' if self.open_lo else '['}{self.lo:g}, {self.hi:g}]"

    def check(self, value, what: str = ""):
        """``value`` (a number or its text) as a number in range, or EngineError."""
        number = _as_number(value, self.whole)
        if number is None or not (self.lo < number if self.open_lo else self.lo <= number) or number > self.hi:
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
            example = f"; e.g. {self.example}" if self.example else ""
            raise EngineError(f"{what or self.name} must be {self.describe()}, got {shown}{example}")
        return number


LIMITS: dict[str, Limit] = {
    "max_new_tokens": Limit("max new tokens", 1, MAX_NEW_TOKENS, whole=True, example="32"),
    "temperature": Limit("temperature", 0.0, MAX_TEMPERATURE, meaning=f"from 0 (greedy) to {MAX_TEMPERATURE}",
                         example="0.7"),
    "top_p": Limit("top-p", 0.0, 1.0, open_lo=True, example="0.9 samples from the likeliest tokens holding 90 % "
                   "of the probability; 1 from all"),
    "seed": Limit("seed", 0, MAX_SEED, whole=True, example="0"),
    "retention": Limit("retention", 0.0, 1.0, open_lo=True, example="0.5 keeps half the KV"),
    "recent_frac": Limit("recent_frac", 0.0, 1.0, open_lo=True, example="0.4"),
    "window_frac": Limit("window_frac", 0.0, 1.0, example="0.1"),
    "budget_mib": Limit("module memory budget (MiB)", 0.0, MAX_BUDGET_MIB, open_lo=True, example="512",
                        meaning=f"a positive number up to {MAX_BUDGET_MIB} (1 PiB)"),
    "kv_budget_bytes": Limit("the KV pool's budget", 4096, MAX_BUDGET_MIB * 2**20, whole=True,
                             example=str(512 << 20)),
    "kv_budget_mib": Limit("KV pool budget (MiB)", 1.0, MAX_BUDGET_MIB, example="512"),
    "budget_bytes": Limit("the module memory budget", 1, MAX_BUDGET_MIB * 2**20, whole=True,
                          meaning=f"a positive number of bytes up to {MAX_BUDGET_MIB * 2**20}",
                          example=str(512 * 2**20)),
    "sink": Limit("sink", 0, MAX_SINK, whole=True, example="4"),
}


def check_fields(obj, *names: str, limits: dict[str, Limit] | None = None) -> None:
    """Check and store each named field of the frozen dataclass ``obj``."""
    limits = LIMITS if limits is None else limits
    for name in names:
        object.__setattr__(obj, name, limits[name].check(getattr(obj, name)))


class NumberArg:
    """argparse ``type=`` of every numeric option: the text checked by a :class:`Limit` (a name in ``LIMITS``, or
    a Limit), so a bad value exits 2 with ``error: argument --x: ...`` naming the range, before anything loads."""

    def __init__(self, limit: "str | Limit"):
        self.limit = LIMITS[limit] if isinstance(limit, str) else limit
        self.__name__ = self.limit.name  # argparse names the type in its own messages

    def __call__(self, text: str):
        try:
            return self.limit.check(text)
        except EngineError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    def __repr__(self) -> str:
        return f"NumberArg({self.limit.name!r})"


def _as_number(value, whole: bool) -> int | float | None:
    """The finite number ``value`` is or spells, else None."""
    if isinstance(value, str):
        value = value.strip()
        if whole:
            try:
                return int(value)  # exact however large
            except ValueError:
                pass
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    elif whole and isinstance(value, numbers.Integral):
        return int(value)
    try:
        number = float(value)
    except (ValueError, OverflowError):
        return None
    if not math.isfinite(number) or (whole and not number.is_integer()):
        return None
    return int(number) if whole else number
