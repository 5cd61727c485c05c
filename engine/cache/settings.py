"""The cache layer's settings, importable without torch."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import EngineError
from engine.limits import check_fields

CONTEXTUAL, ISOLATED = "contextual", "isolated"
MODES = (CONTEXTUAL, ISOLATED)
MODE_ALIASES = {"prefixed": CONTEXTUAL}  # the old spelling


def canonical_mode(mode: str) -> str:
    return MODE_ALIASES.get(mode, mode)


METHODS = ("pyramid", "uniform", "recent", "question")


@dataclass(frozen=True)
class Compression:
    """How module KV is thinned per layer (docs/module-memory.md)."""

    retention: float = 1.0  # mean fraction kept per layer
    method: str = "pyramid"
    recent_frac: float = 0.4  # of queries that score
    window_frac: float = 0.1  # of recent tokens always kept
    pool_kernel: int = 31  # question: keeps a multi-token answer whole
    question_window: int = 64  # question: new tokens that score

    def __post_init__(self):
        check_fields(self, "retention", "recent_frac", "window_frac")
        if self.method not in METHODS:
            raise EngineError(f"unknown compression method '{self.method}'; use one of {', '.join(METHODS)}")
        if not isinstance(self.pool_kernel, int) or self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
            raise EngineError(f"pool_kernel must be an odd whole number of tokens, got {self.pool_kernel!r}; e.g. 31")
        if not isinstance(self.question_window, int) or self.question_window < 1:
            raise EngineError(f"question_window must be a positive number of tokens, got {self.question_window!r}")

    @property
    def active(self) -> bool:
        return self.retention < 1.0

    @property
    def at_encode(self) -> bool:
        return self.active and self.method != "question"

    @property
    def at_run(self) -> bool:
        return self.active and self.method == "question"

    @property
    def stored_fraction(self) -> float:
        return self.retention if self.at_encode else 1.0

    def key(self) -> str:
        """Identifies this compression."""
        if not self.active:
            return "full"
        if self.method == "question":
            return f"question:{self.retention:.4f}:{self.pool_kernel}:{self.question_window}"
        return f"{self.method}:{self.retention:.4f}:{self.recent_frac}:{self.window_frac}"

    def stored_key(self) -> str:
        """Its part of every store key."""
        return self.key() if self.at_encode else "full"

    def layer_ratios(self, n_layers: int) -> list[float]:
        """Fraction each layer keeps; their mean is the retention."""
        r = self.retention
        if self.method not in ("pyramid", "question") or n_layers == 1 or r >= 1.0:
            return [r] * n_layers
        r0 = min(1.0, 1.5 * r)
        lo, hi = 0.0, 1.0
        for _ in range(60):  # mean(r0 * g**l) grows with g: bisect
            g = (lo + hi) / 2
            mean = sum(r0 * g ** i for i in range(n_layers)) / n_layers
            lo, hi = (g, hi) if mean < r else (lo, g)
        return [r0 * lo ** i for i in range(n_layers)]
