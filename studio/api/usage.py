"""A finished run as the client sees it: its text cut at a stop string, why it ended, honest usage."""

from __future__ import annotations

from engine.arms.registry import REGISTRY, Reads
from engine.schema.layout import ANONYMOUS, EntryName
from engine.schema.plan import CACHED


def cached_tokens(comparison, arm: str) -> int:
    """The prompt tokens this request did not compute: the arm's reused tokens (recomputed ones already out) and
    the modules the routed arm left out of the answer (the scout read their stored KV; nothing prefilled them),
    less the tokens of units this request encoded. So ``prompt_tokens - cached_tokens`` is what this request
    computed, as OpenAI's and vLLM's usage read."""
    run = comparison.arm(arm).run
    if REGISTRY[arm].reads != Reads.MODULES or comparison.plan is None:
        return run.reused_tokens
    fresh, out = _fresh_and_routed_out(comparison, arm)
    return max(0, run.reused_tokens + out - fresh)


def routed_out_tokens(comparison, arm: str) -> int | None:
    """Tokens of the modules the routed arm read from the store and left out of the answer; None for other arms."""
    if getattr(comparison.arm(arm).detail, "kept", None) is None or comparison.plan is None:
        return None
    return _fresh_and_routed_out(comparison, arm)[1]


def _fresh_and_routed_out(comparison, arm: str) -> tuple[int, int]:
    """(cached tokens of units this request encoded, not recomputed; tokens of modules routed out)."""
    fresh_units = {u["unit"].split(" [")[0] for u in (comparison.encode or {}).get("detail", ())
                   if u["source"] == "encoded"}
    kept = getattr(comparison.arm(arm).detail, "kept", None)  # the routed arm's modules
    redo = set(comparison.arm(arm).run.recomputed_positions)
    layout, fresh, out = comparison.plan.layout, 0, 0
    for s in comparison.plan.segments:
        if s.kind != CACHED:
            continue
        top = ANONYMOUS if s.owner == ANONYMOUS else layout.modules[s.owner].top
        unit = f"scaffold:{s.scaffold}" if s.scaffold else str(EntryName.module(top))
        if kept is not None and top != ANONYMOUS and not s.scaffold and top not in kept:
            out += len(s.positions)
        if unit in fresh_units:
            fresh += sum(p not in redo for p in s.positions)
    return fresh, out


def module_sources(comparison) -> tuple[int, int]:
    """(modules read from the store, modules encoded now)."""
    units = [u for u in (comparison.encode or {}).get("detail", ()) if u["kind"] == "module"]
    encoded = sum(u["source"] == "encoded" for u in units)
    return len(units) - encoded, encoded


def cut(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    at = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return (text, False) if at < 0 else (text[:at], True)


def visible(text: str, stop: tuple[str, ...]) -> str:
    """A growing ``text`` up to a stop string, less a tail that may become one or a partial character (U+FFFD)."""
    text, found = cut(text, stop)
    if found:
        return text
    hold = max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
    text = text[: len(text) - hold]
    return text.rstrip("\ufffd")


class Visible:
    """:func:`visible`, incrementally: a KMP automaton per stop string reads only the new characters."""

    def __init__(self, stop: tuple[str, ...]):
        self.scans = [_Scan(s) for s in stop]
        self.text = ""

    def __call__(self, text: str) -> str:
        same = len(self.text) if text.startswith(self.text) else _common(self.text, text)
        self.text = text
        found = [at for at in (scan.read(text, same) for scan in self.scans) if at is not None]
        if found:
            return text[: min(found)]
        hold = max((scan.state() for scan in self.scans), default=0)
        return text[: len(text) - hold].rstrip("\ufffd")


class _Scan:
    """After each character, the longest prefix of the stop string ending there (Knuth-Morris-Pratt)."""

    def __init__(self, stop: str):
        self.stop, self.fail, self.states = stop, [0], []
        self.found: int | None = None  # where the first match starts

    def state(self) -> int:
        return self.states[-1] if self.states else 0

    def read(self, text: str, same: int) -> int | None:
        """Read ``text`` from its ``same``-th character; the start of the first match, or None."""
        if self.found is not None and self.found + len(self.stop) <= same:
            return self.found
        del self.states[same:]
        self.found, s, q = None, self.stop, self.state()
        for i in range(len(self.states), len(text)):
            c = text[i]
            while q and s[q] != c:
                q = self._fail(q - 1)
            q += s[q] == c
            self.states.append(q)
            if q == len(s):
                self.found = i + 1 - q
                return self.found
        return None

    def _fail(self, i: int) -> int:
        s, fail = self.stop, self.fail
        for j in range(len(fail), i + 1):
            k = fail[j - 1]
            while k and s[j] != s[k]:
                k = fail[k - 1]
            fail.append(k + (s[j] == s[k]))
        return fail[i]


def _common(a: str, b: str) -> int:
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if a[:mid] == b[:mid] else (lo, mid - 1)
    return lo


def finish_reason(token_ids: tuple[int, ...], stopped: bool, eos: tuple[int, ...], max_new: int) -> str:
    if stopped or (token_ids and token_ids[-1] in eos) or len(token_ids) < max_new:
        return "stop"
    return "length"
