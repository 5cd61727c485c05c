"""The engine reads like its field's best: what a forward attends to is passed to it, notes live in docs/ and
bench/results, functions fit on a screen, and the front page starts with what the studio is."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE = sorted((ROOT / "engine").rglob("*.py"))
STUDIO = sorted((ROOT / "studio").rglob("*.py"))
NOTE_SHARE = 0.18  # comments and docstrings, of all the engine's (and the studio's) characters
LONGEST_FUNCTION = 50
ISSUE_REF = re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE)


def _docstrings(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                yield node, doc


def _notes(path: Path) -> tuple[int, int]:
    """(characters of comments and docstrings, characters of the file)."""
    text = path.read_text()
    comments = sum(len(t.string) for t in tokenize.generate_tokens(io.StringIO(text).readline)
                   if t.type == tokenize.COMMENT)
    return comments + sum(len(d) for _, d in _docstrings(ast.parse(text))), len(text)


def _functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_no_context_variable_drives_the_engine():
    found = [f"{p.relative_to(ROOT)}:{n}" for p in ENGINE for n, line in enumerate(p.read_text().splitlines(), 1)
             if "ContextVar" in line or re.match(r"\s*(import contextvars|from contextvars)", line)]
    assert not found, found


def test_comments_and_docstrings_are_a_small_share_of_the_engine():
    notes, chars = map(sum, zip(*(_notes(p) for p in ENGINE)))
    assert notes / chars <= NOTE_SHARE, f"{notes / chars:.1%} of engine/ is comments and docstrings"


def test_comments_and_docstrings_are_a_small_share_of_the_studio():
    notes, chars = map(sum, zip(*(_notes(p) for p in STUDIO)))
    assert notes / chars <= NOTE_SHARE, f"{notes / chars:.1%} of studio/ is comments and docstrings"


def test_no_short_function_has_a_docstring_longer_than_its_body():
    long = []
    for p in ENGINE:
        for fn in _functions(p):
            doc = ast.get_docstring(fn, clean=False)
            if doc is None:
                continue
            body = fn.body[1:]
            if not body:  # a protocol's or an abstract method's declaration: the docstring is all there is
                continue
            body_lines = (body[-1].end_lineno - body[0].lineno + 1) if body else 0
            doc_lines = fn.body[0].end_lineno - fn.body[0].lineno + 1
            if body_lines < 5 and doc_lines > body_lines:
                long.append(f"{p.relative_to(ROOT)}:{fn.lineno} {fn.name} ({doc_lines} docstring lines, {body_lines} code)")
    assert not long, "\n".join(long)


def test_no_issue_numbers_in_code():
    found = [f"{p.relative_to(ROOT)}:{n}: {line.strip()[:80]}" for p in ENGINE + STUDIO
             for n, line in enumerate(p.read_text().splitlines(), 1) if ISSUE_REF.search(line)]
    assert not found, "\n".join(found)


def test_no_engine_function_is_longer_than_a_screen():
    long = [f"{p.relative_to(ROOT)}:{fn.lineno} {fn.name} ({fn.end_lineno - fn.lineno + 1} lines)"
            for p in ENGINE for fn in _functions(p) if fn.end_lineno - fn.lineno + 1 > LONGEST_FUNCTION]
    assert not long, "\n".join(long)


def test_the_readme_starts_with_what_the_studio_is():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines"
    head = "\n".join(lines[:10])
    assert "PML Studio" in head and re.search(r"prompt cach", head, re.IGNORECASE), head
    assert "make run" in "\n".join(lines[:40]) and "make test" in "\n".join(lines[:40])
