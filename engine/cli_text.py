"""Words the CLI prints for people: `info`'s values and `run`'s progress on a terminal (engine/cli.py)."""

from __future__ import annotations

import re
import sys

# C0 controls but tab and newline, DEL, C1 controls (ESC and CSI start a terminal's escape sequences, BEL ends one)
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def terminal_safe(text: str) -> str:
    """``text`` with its control characters written out (``\\x1b``): shown in a terminal, never obeyed."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def human(value) -> str:
    """A value of ``info`` in words: no Python reprs (None, {...}, True, an empty string)."""
    if value is None or value == "":
        return "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {human(v)}" for k, v in value.items()) or "none"
    if isinstance(value, (list, tuple)):
        return ", ".join(human(v) for v in value) or "none"
    return str(value)



LOAD_TAKES = "usually 15-30 s on 2 cores"  # the default model's load


class Progress:
    """`run`'s phases as lines on stderr while a person watches (a terminal): the model's load, each module
    encoded, each arm's prefill and first token (``arms`` in the order they run), then the decoding; nothing with
    ``quiet``, nothing when stderr is a file or a pipe, and never on stdout."""

    def __init__(self, arms, max_new_tokens: int, words, quiet: bool = False, warms: bool = False):
        """``warms``: the prefix cache is warmed before the first arm's prefill (words: engine.words.ArmWords)."""
        self.arms, self.max_new, self.words, self.seen, self.quiet = tuple(arms), max_new_tokens, words, 0, quiet
        self.warms = warms
        self.announced: set[str] = set()

    def say(self, line: str) -> None:
        if not self.quiet and sys.stderr.isatty():
            print(f"pml-studio: {terminal_safe(line)}", file=sys.stderr, flush=True)

    def loading(self, model: str) -> None:
        self.say(f"loading model {model} ({LOAD_TAKES})…")

    def loaded(self, model: str, seconds: float) -> None:
        self.say(f"model {model} ready in {seconds:,.1f} s")

    def follow(self, events):
        """Say each phase of ``events`` as it comes; what it returns."""
        from engine.run.events import FirstToken, UnitEncoded, Warmed, Warming

        while True:
            try:
                event = next(events)
            except StopIteration as done:
                return done.value
            if isinstance(event, UnitEncoded):
                self.encoding(event.done, event.total, event.unit)
            elif isinstance(event, Warming):
                self.say(self.warming(event.tokens))
            elif isinstance(event, Warmed):
                self.say(f"prefix cache warmed in {event.ms / 1000:,.1f} s (in no arm's TTFT)")
                self._next_prefill()
            elif isinstance(event, FirstToken):
                self.first_token(event)

    def warming(self, tokens: int) -> str:
        """Which arm the warm-up is for: the prefix arm, else routed's every-module path."""
        from engine.arms.registry import REGISTRY, Reads

        readers = [a for a in self.arms if a in REGISTRY and REGISTRY[a].reads == Reads.PREFIX_CACHE]
        why = (f"for the {self.words.title(readers[0])} arm" if readers else
               "for the routed arm, which reads it when a question keeps every module (--route-tree off skips that)")
        return (f"warming the prefix cache {why}: prefilling the schema's {tokens:,} tokens in schema order, once "
                "(--no-warmup leaves it out)…")

    def encoding(self, done: int, total: int, label: str) -> None:
        self.say(f"encoding modules {done}/{total}: {label}")
        if done == total and not self.warms:  # else said after the warm-up
            self._next_prefill()

    def _next_prefill(self) -> None:
        if not self.seen and self.arms:
            self._prefilling(self.arms[0])

    def first_token(self, res) -> None:
        self.seen += 1
        run = res.run
        self.say(f"{self.words.title(str(res.arm))}: prefilled {run.prefill_tokens} tokens, first token after "
                 f"{run.ttft_ms:,.0f} ms ({self.seen}/{len(self.arms)} arms)")
        if self.seen < len(self.arms):
            self._prefilling(self.arms[self.seen])
        elif self.max_new > 1:
            self.say(f"decoding up to {self.max_new - 1} more tokens in each arm…")

    def done(self, seconds: float) -> None:
        self.say(f"done: encoding, {len(self.arms)} arms' prefills and their decoding took {seconds:,.1f} s")

    def _prefilling(self, arm: str) -> None:
        if arm not in self.announced:
            self.announced.add(arm)
            self.say(f"{self.words.title(arm)}: prefilling…")
