"""Docs kept honest: the README's numbers are the result files', its commands exist, CI runs its test command."""

from __future__ import annotations

import importlib.util
import re

from conftest import ROOT, SAMPLES, sample_pairs


def load_report():
    spec = importlib.util.spec_from_file_location("report", ROOT / "bench" / "report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_measured_section_is_generated_from_the_result_files():
    report = load_report()
    readme = (ROOT / "README.md").read_text()
    start, end = readme.index(report.START), readme.index(report.END) + len(report.END)
    assert readme[start:end] == report.section(), "run: python bench/report.py --write-readme"


def test_readme_starts_with_the_two_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    first_block = readme.split("```")[1]
    assert "make run" in first_block and "make test" in first_block
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert "torch==2.13.0" in makefile.split("-e '.[test]'")[0]  # CPU torch before anything else


def test_cli_commands_in_the_readme_exist():
    from engine.cli import build_parser
    from studio.cli import EXTRA

    sub = next(a for a in build_parser(EXTRA)._actions if a.dest == "command")
    used = set(re.findall(r"pml-studio (\w+)", (ROOT / "README.md").read_text()))
    assert used and used <= set(sub.choices)


def test_every_sample_is_described():
    text = (SAMPLES / "README.md").read_text()
    for name, _, _ in sample_pairs():
        assert f"{name}.xml" in text


def test_relative_links_in_the_docs_point_into_the_repository():
    for doc in (ROOT / "README.md", ROOT / "docs" / "pml-spec.md"):
        text = doc.read_text()
        assert "../" not in text, f"{doc.name} names a path outside the repository"  # linked or in `code`
        local = [t for t in re.findall(r"\]\(([^)#\s]+)", text) if "://" not in t]
        bad = [t for t in local if not (doc.parent / t).exists() or not (doc.parent / t).resolve().is_relative_to(ROOT)]
        assert bad == [], f"{doc.name} links outside the repository or to missing files"
    assert "docs/pml-spec.md" in re.findall(r"\]\(([^)#\s]+)", (ROOT / "README.md").read_text())


def test_the_language_spec_names_tests_that_exist():
    named = set(re.findall(r"`(test_\w+)`", (ROOT / "docs" / "pml-spec.md").read_text()))
    defined = {name for f in (ROOT / "tests").glob("test_*.py")
               for name in re.findall(r"^def (test_\w+)", f.read_text(), re.M)}
    assert named and named <= defined, named - defined
