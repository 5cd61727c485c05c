"""The accepted range of every numeric setting, checked one way wherever a number enters.

:class:`Limit` is the one validation of a number for every front end: argparse's ``type=``
(``engine.cli.NumberArg``), the studio's widgets and API, and the dataclasses library users build
(``RunConfig``, ``Compression``, ``Sampling``, an arm's settings) via :func:`check_fields`. The base
layer: it imports nothing of the engine but its errors.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from engine.errors import EngineError

MAX_REPAIR = 64
MAX_SINK = 64
MAX_NEW_TOKENS = 1 << 20  # no model has a longer context; the plan checks the loaded model's own
MAX_BUDGET_MIB = 1 << 30  # 1 PiB, more than any machine has; in bytes it still fits the run log's 64-bit integers
MAX_TEMPERATURE = 100.0  # far past uniform sampling already (logits differ by tens at most)
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 0 ... 2**64 - 1


@dataclass(frozen=True)
class Limit:
    """The accepted values of one numeric setting: finite, from ``lo`` to ``hi`` (``lo`` itself excluded when
    ``open_lo``), whole numbers only when ``whole``.

    :meth:`check` is the one validation of a number for every front end: argparse's ``type=``
    (``engine.cli.NumberArg``), the studio's widgets and API, and the dataclasses library users
    build (:class:`RunConfig`, :class:`Compression`, ``engine.arms.registry.Sampling``, via :func:`check_fields`).
    """

    name: str  # the setting in messages, e.g. "top-p"
    lo: float
    hi: float = math.inf
    whole: bool = False
    open_lo: bool = False
    example: str = ""  # a valid value (and what it does): the fix a message suggests
    meaning: str = ""  # the range in words when the computed one reads badly

    def describe(self) -> str:
        """The accepted range in words: 'a whole number from 0 to 64', 'in (0, 1]'."""
        if self.meaning:
            return self.meaning
        if self.whole:
            return f"a whole number from {self.lo} to {self.hi}"
        if self.hi == math.inf:
            return f"a finite number {'above' if self.open_lo else 'of at least'} {self.lo:g}"
        return f"in {'(' if self.open_lo else '['}{self.lo:g}, {self.hi:g}]"

    def check(self, value, what: str = ""):
        """``value`` (a number or its text) as an int (``whole``) or a float in range; otherwise EngineError
        naming ``what`` (default: the setting's name), the range, what was given and an example."""
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
    "budget_bytes": Limit("the module memory budget", 1, MAX_BUDGET_MIB * 2**20, whole=True,
                          meaning=f"a positive number of bytes up to {MAX_BUDGET_MIB * 2**20}",
                          example=str(512 * 2**20)),
    "sink": Limit("sink", 0, MAX_SINK, whole=True, example="4"),
}


def check_fields(obj, *names: str, limits: dict[str, Limit] | None = None) -> None:
    """Check each named field of the (frozen) dataclass ``obj`` against ``limits[name]`` (default
    :data:`LIMITS`); store the number."""
    limits = LIMITS if limits is None else limits
    for name in names:
        object.__setattr__(obj, name, limits[name].check(getattr(obj, name)))


def _as_number(value, whole: bool) -> int | float | None:
    """The finite number ``value`` is or spells (an int when ``whole``), else None; never raises."""
    if isinstance(value, str):
        value = value.strip()
        if whole:
            try:
                return int(value)  # exact however large ('4.0' and '1e3' are read as floats below)
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
