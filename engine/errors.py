"""The engine's errors: every one a user can cause, with a message naming the place and the fix."""

from __future__ import annotations

from dataclasses import dataclass


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

    def __str__(self) -> str:
        text = f"{self.source}:{self.line}:{self.col}: error: {self.message}"
        return f"{text}; hint: {self.hint}" if self.hint else text

    def to_dict(self) -> dict:
        return {"source": self.source, "line": self.line, "col": self.col,
                "message": self.message, "hint": self.hint}


class PMLError(EngineError):
    """One or more problems in a schema or prompt document."""

    def __init__(self, problems: list[Problem] | Problem):
        self.problems = [problems] if isinstance(problems, Problem) else list(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


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


class RunStopped(EngineError):
    """A run stopped on request; its partial result is not kept."""


class NonFiniteLogits(ModelError):
    """The model computed NaN or infinite logits."""
