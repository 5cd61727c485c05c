"""A finished run as the client sees it: its text cut at a stop string, why it ended, honest usage."""

from __future__ import annotations


def cached_tokens(comparison, arm: str) -> int:
    """The prompt tokens this request did not compute, as the run counted them (``RunResult.precomputed_tokens``):
    read from the store or the prefix tree and not recomputed, the modules the routed arm left out of the answer
    included (its scout read their stored KV; nothing prefilled them), less the tokens of units this request
    encoded. So ``prompt_tokens - cached_tokens`` is what this request computed, as OpenAI's and vLLM's usage read."""
    return comparison.arm(arm).run.precomputed_tokens


def routed_out_tokens(comparison, arm: str) -> int | None:
    """Tokens of the modules the routed arm read from the store and left out of the answer; None for other arms."""
    routing = comparison.arm(arm).routing
    if routing is None or comparison.plan is None:
        return None
    return sum(len(at.segment) for at in comparison.plan.placed()
               if at.module is not None and at.module not in routing.kept)


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


class StopCut:
    """:func:`visible` for a text that only grows, one delta at a time (an upstream's stream), ended by the delta
    that completes a stop string, as a generation ends; each call reads the delta and the few characters before it,
    so a long answer costs linear time."""

    def __init__(self, stop: tuple[str, ...]):
        self.stop = tuple(s for s in stop if s)
        self.reach = max((len(s) for s in self.stop), default=1) - 1  # characters a stop string may reach back
        self.context = ""  # the last ``reach`` characters shown
        self.held = ""  # characters not shown yet: they may begin a stop string
        self.stopped = False

    def add(self, delta: str) -> str:
        """What ``delta`` makes visible: up to the first stop string (then nothing more), less a held tail."""
        if self.stopped or not delta:
            return ""
        window = self.context + self.held + delta
        start = len(self.context)
        found = min((i for i in (window.find(s, max(0, start - len(s) + 1)) for s in self.stop) if i >= 0),
                    default=-1)
        if found >= 0:
            self.stopped = True
            return window[start:max(found, start)]
        hold = max((k for s in self.stop for k in range(1, len(s)) if window.endswith(s[:k])), default=0)
        shown = window[start:len(window) - hold]
        self.held = window[len(window) - hold:]
        self.context = (self.context + shown)[-self.reach:] if self.reach else ""
        return shown

    def flush(self) -> str:
        """The held tail, once the text is whole: it did not become a stop string."""
        held, self.held = ("", "") if self.stopped else (self.held, "")
        return held


def finish_reason(token_ids: tuple[int, ...], stopped: bool, eos: tuple[int, ...], max_new: int) -> str:
    if stopped or (token_ids and token_ids[-1] in eos) or len(token_ids) < max_new:
        return "stop"
    return "length"
