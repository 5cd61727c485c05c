"""Error translation at the studio's edge: engine errors become ``gr.Error`` or inline problem lines.

No traceback reaches the page: an unanticipated exception is logged once and shown as one line, and a user's error
prints nothing (Gradio prints every exception but a ``gr.Error`` with ``print_exception=False``).
"""

from __future__ import annotations

import logging
import sys
import traceback
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Iterator

import gradio as gr

from engine.errors import EngineError, PMLError, shorten
from engine.public import Lines

log = logging.getLogger("pml-studio")
SHOWN = 120  # characters of a long source line shown around a problem's column
MAX_TRACEBACK = 8_000  # characters of a traceback the console shows: its frames, not a request body it quotes


def user_error(err: BaseException, what: str = "the run") -> gr.Error:
    """The ``gr.Error`` a user sees for ``err`` (``what`` names the action in unexpected failures)."""
    if isinstance(err, gr.Error):
        return err
    if isinstance(err, PMLError):
        return refusal("\n".join(_plain(line) for line in err.lines()))
    if isinstance(err, EngineError):
        return refusal(_plain(str(err)))
    log.error("%s failed", what, exc_info=err)  # the one traceback, for a failure nobody anticipated
    return refusal(f"{what} failed: {type(err).__name__}: {err}")


def refusal(message: str) -> gr.Error:
    """The ``gr.Error`` of a user's error: shown in the page, nothing printed to the console."""
    return gr.Error(message, print_exception=False)


@contextmanager
def as_gr_error(what: str = "the run") -> Iterator[None]:
    try:
        yield
    except gr.Error:
        raise
    except Exception as err:
        raise user_error(err, what) from None


def problem_lines(err: EngineError, text: str) -> tuple[list[str], list[int]]:
    """(a line per problem listed, each with its source line, and one that counts the rest; the lines to
    highlight)."""
    src = Lines(text or "")
    out: list[str] = []
    lines: list[int] = []
    problems = err.problems if isinstance(err, PMLError) else []
    for p in problems:
        msg = f"{p.line}:{p.col}: {p.message}" + (f"; hint: {p.hint}" if p.hint else "")
        if 1 <= p.line <= len(src.starts):
            msg += source_line(src.line(p.line), p.line, p.col)
        out.append(msg)
        lines.append(p.line)
    if isinstance(err, PMLError) and err.more:
        out.append(err.more_line())
    if not problems:
        msg = str(err)
        for prefix in ("<schema>:", "<prompt>:"):
            msg = msg[len(prefix):] if msg.startswith(prefix) else msg
        out.append(msg.replace(": error: ", ": ", 1))
    return out, lines


def problem_count(err: EngineError) -> int:
    """How many problems ``err`` found, listed or not."""
    return len(err.problems) + err.more if isinstance(err, PMLError) else 1


def source_line(line: str, number: int, col: int) -> str:
    """The source line under a problem, the caret under its column; a long line shown around the column only."""
    indent = len(line) - len(line.lstrip())
    shown, at = line.strip(), col - 1 - indent  # ``at``: the column in ``shown``
    if len(shown) > SHOWN:
        start = max(0, min(at - SHOWN // 2, len(shown) - SHOWN))
        before, after = ("…" if start > 0 else ""), ("…" if start + SHOWN < len(shown) else "")
        shown, at = before + shown[start:start + SHOWN] + after, at - start + len(before)
    head = f"    {number} | "
    caret = " " * (len(head) + max(at, 0)) + "^" if at <= len(shown) else ""
    return f"\n{head}{shown}" + (f"\n{caret}" if caret else "")


def bounded_tracebacks(most: int = MAX_TRACEBACK) -> None:
    """The tracebacks Gradio prints (its queue's and routes' ``traceback.print_exc()``) and uvicorn logs cut to
    ``most`` characters: the error of a malformed request quotes what it received (Gradio's "Received inputs: [...]"
    a 20 MB body whole)."""
    import gradio.queueing
    import gradio.route_utils
    import gradio.routes

    def print_exc(*args, **kwargs) -> None:
        print(shorten(traceback.format_exc(), most), file=sys.stderr, flush=True)

    for module in (gradio.queueing, gradio.routes, gradio.route_utils):
        module.traceback = SimpleNamespace(**{**vars(traceback), "print_exc": print_exc})
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, _Bounded) for f in logger.filters):
        logger.addFilter(_Bounded(most))


class _Bounded(logging.Filter):
    """A record's message and traceback, each cut to ``most`` characters."""

    def __init__(self, most: int):
        super().__init__()
        self.most = most

    def filter(self, record: logging.LogRecord) -> bool:
        record.msg, record.args = shorten(record.getMessage(), self.most), None
        if record.exc_info:
            record.exc_text = shorten("".join(traceback.format_exception(*record.exc_info)).rstrip(), self.most)
            record.exc_info = None
        return True


def _plain(text: str) -> str:
    return text.replace("<schema>:", "schema ").replace("<prompt>:", "prompt ")
