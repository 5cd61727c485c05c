"""The engine's errors: every one a user can cause, with a message naming the place and the fix."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from typing import Callable

MAX_PROBLEMS = 20  # listed per document, as clang's -ferror-limit; the rest are counted
MAX_WORDS = 400  # characters of a problem's message or hint: a name 50,000 characters long is cut in its middle
MAX_NAMED = 12  # names a hint lists ("valid here: a, b, ...")


class EngineError(Exception):
    """An input problem the user can fix; ``str(err)`` says how."""


@dataclass(frozen=True)
class Problem:
    """One located problem in a PML document."""

    source: str
    line: int
    col: int
    message: str
    hint: str = ""

    def __post_init__(self):
        object.__setattr__(self, "message", shorten(self.message, MAX_WORDS))
        object.__setattr__(self, "hint", shorten(self.hint, MAX_WORDS))

    def __str__(self) -> str:
        text = f"{self.source}:{self.line}:{self.col}: error: {self.message}"
        return f"{text}; hint: {self.hint}" if self.hint else text

    def to_dict(self) -> dict:
        return {"source": self.source, "line": self.line, "col": self.col,
                "message": self.message, "hint": self.hint}


class PMLError(EngineError):
    """One or more problems in a schema or prompt document: the first :data:`MAX_PROBLEMS`, and how many more."""

    def __init__(self, problems: list[Problem] | Problem, more: int = 0):
        problems = [problems] if isinstance(problems, Problem) else list(problems)
        self.problems = problems[:MAX_PROBLEMS]
        self.more = more + len(problems) - len(self.problems)
        super().__init__("\n".join(self.lines()))

    def lines(self) -> list[str]:
        """One line per problem listed, then one that counts the rest."""
        return [str(p) for p in self.problems] + ([self.more_line()] if self.more else [])

    def more_line(self) -> str:
        return f"... and {self.more} more problem{'s' if self.more != 1 else ''} (fix these first)"


class Problems:
    """The problems of one document as they are found: the first :data:`MAX_PROBLEMS` kept, the rest only counted
    (a document may hold 100,000, and locating each costs time)."""

    def __init__(self):
        self.kept: list[Problem] = []
        self.more = 0

    def __bool__(self) -> bool:
        return bool(self.kept)

    def add(self, problem: Problem | Callable[[], Problem]) -> None:
        """Keep ``problem`` (or the one it makes, called only while the list has room), else count it."""
        if len(self.kept) >= MAX_PROBLEMS:
            self.more += 1
        else:
            self.kept.append(problem() if callable(problem) else problem)

    def error(self) -> PMLError:
        return PMLError(self.kept, self.more)


class ModelError(EngineError):
    """The model cannot be found, loaded or used."""


class StorageError(EngineError):
    """The requested KV storage is not available."""


class MissingEntry(StorageError):
    """A store entry is in neither memory nor disk; the engine encodes again before timing."""

    def __init__(self, key: str, reason: str = ""):
        self.key = key
        self.reason = reason
        super().__init__(f"module KV entry {key[:12]}… is no longer stored{': ' + reason if reason else ''}; "
                         "encode the schema again")


class ContextLengthError(EngineError):
    """A schema or prompt needs more positions than the model has."""


class InputFileError(EngineError):
    """A file given by path cannot be read."""


class NonFiniteLogits(ModelError):
    """The model computed NaN or infinite logits."""


def shorten(text: str, most: int) -> str:
    """``text`` cut in its middle to at most about ``most`` characters, saying how many it left out."""
    if len(text) <= most:
        return text
    keep = most // 2
    return f"{text[:keep]} …({len(text) - 2 * keep} characters left out)… {text[-keep:]}"


def named(names, most: int = MAX_NAMED) -> str:
    """``names`` as a hint lists them: the first ``most``, and how many there are in all; 'none' for none."""
    if not names:
        return "none"
    shown = ", ".join(islice(names, most))  # not the whole list: a hint per problem must not cost the list
    return shown if len(names) <= most else f"{shown}, … ({len(names)} in all)"
