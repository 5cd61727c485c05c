"""Docs kept honest: the numbers in README and docs/benchmarks.md are the result files', their commands exist,
their links resolve, CI runs the README's test command, and the README stays a front page."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from conftest import ROOT, SAMPLES, sample_pairs


def load_report():
    spec = importlib.util.spec_from_file_location("report", ROOT / "bench" / "report.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def docs() -> list[Path]:
    """README.md and every page in docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(doc) -> set[str]:
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def between(text: str, start: str, end: str) -> str:
    return text[text.index(start):text.index(end) + len(end)]


def test_benchmarks_page_is_generated_from_the_result_files():
    report = load_report()
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    assert between(page, report.START, report.END) == report.section(), "run: python bench/report.py --write-readme"


def test_readme_headline_is_generated_from_the_result_files():
    report = load_report()
    readme = (ROOT / "README.md").read_text()
    assert between(readme, report.HEAD_START, report.HEAD_END) == report.headline(), \
        "run: python bench/report.py --write-readme"
    assert report.START not in readme, "the Measured tables live in docs/benchmarks.md"


def test_readme_is_a_front_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150, "move long material to a page in docs/"
    assert "docs/benchmarks.md" in readme


def test_readme_s_first_screen_says_what_it_is_then_shows_it_sets_it_up_and_names_the_api():
    """As vLLM's and SGLang's READMEs open: what it is, a picture, the quick start; figures come later."""
    lines = (ROOT / "README.md").read_text().splitlines()
    what = next(i for i, line in enumerate(lines) if "modular prompt caching" in line)
    picture = lines.index("![The studio comparing baseline, prefix-cache and modular-cache runs](assets/screenshot.png)")
    commands = next(i for i, line in enumerate(lines) if line.startswith("make run"))
    api = next(i for i, line in enumerate(lines) if "OpenAI-compatible API" in line and "(docs/api.md)" in line)
    assert what < 10 and what < picture < commands < api < 25
    assert not any(re.search(r"ms/token|\d ms\b|\d×", line) for line in lines[:api + 1]), "figures go below"


def test_readme_starts_with_the_two_commands_and_ci_runs_the_test_one():
    readme = (ROOT / "README.md").read_text()
    first_block = readme.split("```")[1]
    assert "make run" in first_block and "make test" in first_block
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert "torch==2.13.0" in makefile.split("-e '.[test]'")[0]  # CPU torch before anything else


def test_cli_commands_in_the_readme_exist():
    """Every `pml-studio CMD` in the README and the pages of docs/ is a command of the CLI."""
    from engine.cli import build_parser
    from studio.cli import EXTRA

    sub = next(a for a in build_parser(EXTRA)._actions if a.dest == "command")
    for doc in docs():
        used = set(re.findall(r"pml-studio (\w+)", doc.read_text()))
        assert used <= set(sub.choices), (doc.name, used - set(sub.choices))
    assert re.findall(r"pml-studio (\w+)", (ROOT / "README.md").read_text())


def test_every_sample_is_described():
    text = (SAMPLES / "README.md").read_text()
    for name, _, _ in sample_pairs():
        assert f"{name}.xml" in text


def test_relative_links_in_the_docs_point_into_the_repository():
    for doc in docs():
        text = doc.read_text()
        if doc.parent == ROOT:
            assert "../" not in text, f"{doc.name} names a path outside the repository"  # linked or in `code`
        links = [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t and not t.startswith("mailto:")]
        for link in links:
            path, _, anchor = link.partition("#")
            target = (doc.parent / path).resolve() if path else doc
            assert target.is_relative_to(ROOT) and target.exists(), \
                f"{doc.name}: {link} is outside the repository or missing"
            if anchor and target.suffix == ".md":
                assert anchor in anchors(target), f"{doc.name}: {link} names no heading of {target.name}"
    readme_links = re.findall(r"\]\(([^)#\s]+)", (ROOT / "README.md").read_text())
    assert "docs/pml-spec.md" in readme_links


def test_every_docs_page_is_indexed_and_links_back():
    readme_links = re.findall(r"\]\(([^)#\s]+)", (ROOT / "README.md").read_text())
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert pages <= {Path(t).name for t in readme_links if t.startswith("docs/")}, "every page is in the README's index"
    for page in pages - {"pml-spec.md"}:  # the language spec keeps its own opening
        title, lead = (ROOT / "docs" / page).read_text().split("\n\n")[:2]
        assert title.startswith("# ") and "](../README.md)" in lead, \
            f"{page}: a title, one line on what it covers, then a link back"


def test_the_language_spec_names_tests_that_exist():
    named = set(re.findall(r"`(test_\w+)`", (ROOT / "docs" / "pml-spec.md").read_text()))
    defined = {name for f in (ROOT / "tests").rglob("test_*.py")
               for name in re.findall(r"^def (test_\w+)", f.read_text(), re.M)}
    assert named and named <= defined, named - defined


def test_the_makefile_s_python_snippets_import_what_exists():
    """`make setup` / `make qwen` run `python -c "from engine... import ..."`: a moved name breaks a fresh clone."""
    import importlib

    snippets = re.findall(r'from ([\w.]+) import ([\w, ]+)', (ROOT / "Makefile").read_text())
    assert snippets
    for module, names in snippets:
        mod = importlib.import_module(module)
        for name in (n.strip() for n in names.split(",")):
            assert hasattr(mod, name), f"Makefile: {module} has no {name}"
