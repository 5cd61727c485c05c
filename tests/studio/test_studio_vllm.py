"""The vllm arm in the studio: a column headed as remote, its URL a text box among the arm settings, and a server
that failed shown as its reason in the column, not as zeros."""

from __future__ import annotations

import gradio as gr

from engine.arms.registry import Sampling
from engine.config import RunConfig
from studio import views
from studio.arm_views import view_of
from studio.settings import run_config
from studio.tabs import encode as enc

SCHEMA = '<schema name="s"><system>Be brief.</system><user><module name="a">Alpha text here.</module></user></schema>'
PROMPT = '<prompt schema="s"><a/> What is alpha?</prompt>'


def test_the_column_says_remote_and_prefixes_only():
    head = views.head_html(view_of("vllm"))
    assert "vLLM" in head and "remote · reuses prefixes only" in head


def test_the_url_is_a_text_box_and_reaches_the_run_config():
    from engine.arms.registry import settings_specs

    spec = next(s for _, _, s in settings_specs() if s.key == "vllm_url")
    assert isinstance(enc._control(spec, ""), gr.Textbox)
    config = run_config(RunConfig(), {"arms": ["baseline", "vllm"], "vllm_url": "http://10.0.0.5:8000"})
    assert config.arms == ("baseline", "vllm") and config.settings_of("vllm").url == "http://10.0.0.5:8000"


def test_a_failed_server_is_its_reason_in_the_column(tiny_engine, monkeypatch):
    monkeypatch.delenv("PML_VLLM_URL", raising=False)
    comp = tiny_engine.compare(SCHEMA, PROMPT, Sampling(max_new_tokens=2),
                               config=tiny_engine.config.with_(arms=("baseline", "vllm")))
    cell = views.metrics_html(comp, "vllm")
    assert "vLLM: server URL" in cell and "--vllm-url" not in cell and "TTFT" not in cell  # the page's own field
    assert "TTFT" in views.metrics_html(comp, "baseline")
    lead = views.headline(comp)
    assert lead is None or lead.arm != "vllm"  # a failed arm is never set against the baseline
