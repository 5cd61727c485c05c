"""The cache layer's settings, importable without torch: the encoding modes and how module KV is thinned
(:class:`Compression`; engine/cache/compress.py does the thinning)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import EngineError
from engine.limits import check_fields

CONTEXTUAL, ISOLATED = "contextual", "isolated"  # the encoding modes (engine/cache/encode.py)
MODES = (CONTEXTUAL, ISOLATED)
MODE_ALIASES = {"prefixed": CONTEXTUAL}  # the old spelling, still accepted (CLI, RunConfig, stored JSON)


def canonical_mode(mode: str) -> str:
    """``mode`` with an old spelling replaced (``prefixed`` is ``contextual``)."""
    return MODE_ALIASES.get(mode, mode)


METHODS = ("pyramid", "uniform", "recent", "question")


@dataclass(frozen=True)
class Compression:
    """How module KV is thinned per layer (PyramidInfer-style); retention 1 keeps everything.

    ``pyramid``, ``uniform`` and ``recent`` thin the stored entries when a module is encoded,
    before any question is known; ``question`` stores full entries and thins the run's buffer
    after the prompt's new tokens were prefilled, by their attention (see engine/cache/compress.py).
    """

    retention: float = 1.0  # mean fraction of each entry's tokens kept per layer
    method: str = "pyramid"
    recent_frac: float = 0.4  # queries whose attention scores the tokens
    window_frac: float = 0.1  # most recent tokens always kept
    pool_kernel: int = 31  # question: scores max-pooled over this many neighbouring tokens
    question_window: int = 64  # question: at most this many of the newest prompt tokens score the modules

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
        """Stored entries are thinned when encoded (the query-agnostic methods)."""
        return self.active and self.method != "question"

    @property
    def at_run(self) -> bool:
        """The run's buffer is thinned after the new tokens are prefilled (``question``)."""
        return self.active and self.method == "question"

    @property
    def stored_fraction(self) -> float:
        """Mean fraction of a module's tokens its stored entry holds."""
        return self.retention if self.at_encode else 1.0

    def key(self) -> str:
        """What a run with this compression is (encoded schemas made for different ones never mix)."""
        if not self.active:
            return "full"
        if self.method == "question":
            return f"question:{self.retention:.4f}:{self.pool_kernel}:{self.question_window}"
        return f"{self.method}:{self.retention:.4f}:{self.recent_frac}:{self.window_frac}"

    def stored_key(self) -> str:
        """Part of every store key: entries compressed differently never mix (``question`` stores full ones)."""
        return self.key() if self.at_encode else "full"

    def layer_ratios(self, n_layers: int) -> list[float]:
        """Fraction of tokens each layer keeps; their mean is the retention."""
        r = self.retention
        if self.method not in ("pyramid", "question") or n_layers == 1 or r >= 1.0:
            return [r] * n_layers
        r0 = min(1.0, 1.5 * r)
        lo, hi = 0.0, 1.0
        for _ in range(60):  # mean(r0 * g**l) is increasing in g: bisect for mean == r
            g = (lo + hi) / 2
            mean = sum(r0 * g ** i for i in range(n_layers)) / n_layers
            lo, hi = (g, hi) if mean < r else (lo, g)
        return [r0 * lo ** i for i in range(n_layers)]
