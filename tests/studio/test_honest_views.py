"""The Compare views read honestly (issue 64): no slower arm crowned or badged "faster", a key under every
highlight, the prefix arm's history above the columns, Stop's columns stopped. Fast: comparisons read back
from run --json documents, as History reads them."""

from __future__ import annotations

import html

from studio import views
from tests.studio.test_studio_newcomer import _doc
from tests.studio_fixtures import doc


def test_a_slower_arm_is_never_crowned_nor_badged_faster():
    comparison = doc(_doc({"prefix": 1000 / 1134, "cached": 1000 / 1716}, {"prefix": True, "cached": True}))
    summary = html.unescape(views.summary_html(comparison))
    assert "faster first token: " not in summary and "1.1× slower" in summary and "Prefix cache" in summary
    badge = views.metrics_html(comparison, "cached")
    assert "1.7× slower first token" in badge and "badge speed warn" in badge and "good" not in badge
    faster = doc(_doc({"prefix": 0.8, "cached": 3.0}, {"prefix": True, "cached": False}))
    summary = html.unescape(views.summary_html(faster))  # the agreeing arm is slower: the faster one leads, said so
    assert "3.0×" in summary and "Modular cache" in summary and "no faster arm's answer is the baseline's" in summary


def test_every_highlight_has_its_key():
    arm = views.column_html("Nara is known for deer.", False, 5)
    base = views.column_html("Nara is known for temples.", False, 5, reference=True)
    assert 'class="pml-legend"' in arm and "differs from the baseline's" in html.unescape(arm)
    assert "the baseline is the reference" in html.unescape(base)
    assert "pml-legend" not in views.column_html("same text", False)


def test_stopped_columns_say_stopped_not_decoding():
    comparison = doc(_doc({"cached": 3.0}, {"cached": True}))
    run = comparison.arm("cached").run
    assert "stopped after its first token" in views.stopped_html(run, "cached") and "decoding" not in \
        views.stopped_html(run, "cached")
    assert "stopped before its first token" in views.stopped_html(None, "cached")


def test_one_prefilled_token_is_said_in_the_singular():
    from dataclasses import replace

    run = doc(_doc({"prefix": 3.0}, {"prefix": True})).arm("prefix").run
    rows = dict(views.first_rows(replace(run, prefill_tokens=1), "prefix"))
    assert rows["prefill"].startswith("1 token in ")
    assert dict(views.first_rows(replace(run, prefill_tokens=2), "prefix"))["prefill"].startswith("2 tokens in ")
