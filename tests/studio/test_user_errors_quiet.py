"""A user's error prints nothing to the console: Gradio prints a traceback for every exception a handler raises
unless it is a ``gr.Error`` made with ``print_exception=False`` (studio.errors.refusal). So the studio makes its
``gr.Error``s in one place only."""

from __future__ import annotations

import ast

from tests.conftest import ROOT


def test_every_gr_error_of_the_studio_is_made_by_refusal():
    made_elsewhere = []
    for path in sorted((ROOT / "studio").rglob("*.py")):
        if path.name == "errors.py" and path.parent.name == "studio":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            func = node.func if isinstance(node, ast.Call) else None
            if isinstance(func, ast.Attribute) and func.attr == "Error" and getattr(func.value, "id", "") == "gr":
                made_elsewhere.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert made_elsewhere == [], "raise studio.errors.refusal(...) instead (it prints no traceback)"


def test_an_upload_handlers_error_is_made_quiet():
    """What Gradio's queue catches from a handler: a gr.Error that asks it to print nothing."""
    import pytest

    from studio.files import read_upload

    with pytest.raises(Exception) as caught:
        read_upload(None)
    assert caught.value.print_exception is False and "no file was uploaded" in str(caught.value)
