"""The vllm arm against a server that misbehaves (tests/hostile_upstream.py): whatever it sends — a redirect, a body
without end, fields of the wrong type — the arm's column says why and the comparison goes on with the baseline
kept; nothing it sends grows this process by more than a bounded amount, and no redirect is ever followed."""

from __future__ import annotations

import time

import pytest

from engine.arms.registry import Sampling
from test_prefix import SCHEMA
from tests import hostile_upstream as hostile
from tests.upstream_standin import StandIn

PROMPT = '<prompt schema="docs"><d1/><d3/> When does the library open?</prompt>'
MAX_GROWTH = 256 << 20


@pytest.fixture(scope="module")
def standin(tiny_lm):
    with StandIn(lambda text: tiny_lm.tokenizer.encode(text, add_special_tokens=False), "served") as upstream:
        yield upstream


@pytest.fixture
def answer(standin):
    yield lambda path, fn: standin.answer.__setitem__(path, fn)
    standin.answer.clear()


def compare(engine, url: str, new: int = 3, timeout: float = 4.0):
    config = engine.config.with_(arms=("baseline", "vllm"), vllm_url=url, vllm_timeout=timeout)
    return engine.compare(SCHEMA, PROMPT, Sampling(max_new_tokens=new), config=config)


def ran_with_error(comp, words: str) -> None:
    remote = comp.arm("vllm")
    assert remote.error and words in remote.error, remote.error
    assert remote.detail.error_kind in ("unavailable", "timeout", "refused", "broken", "mismatch")
    assert len(comp.arm("baseline").run.token_ids) == 3 and comp.speedup("vllm") is None


def tokens(*ids, tops=True):
    """A completion chunk naming ``ids`` as vLLM does under return_tokens_as_token_ids."""
    lp = {"tokens": [f"token_id:{i}" for i in ids],
          "top_logprobs": [{f"token_id:{i}": -0.1} for i in ids] if tops else None}
    return {"choices": [{"index": 0, "text": "x", "logprobs": lp, "finish_reason": None}], "usage": None}


HOSTILE = {
    "a gzip bomb of one line": (hostile.gzip_bomb(), "longer than"),
    "a plain 512 MB line": (hostile.long_line(), "longer than"),
    "an endless stream": (lambda h, body: hostile.endless_events(h, tokens(5)), "more than the 3 tokens asked for"),
    "1 byte every 3 s": (hostile.trickle(3.0), "within 2 s"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_whatever_the_server_streams_costs_bounded_memory_and_ends_in_time(tiny_engine, standin, answer, case):
    fn, words = HOSTILE[case]
    answer("/v1/completions", fn)
    started = time.monotonic()
    with hostile.peak_growth() as growth:
        comp = compare(tiny_engine, standin.url, timeout=2.0)
    ran_with_error(comp, words)
    assert growth[0] < MAX_GROWTH, f"{case}: the arm grew this process by {growth[0] / 2**20:.0f} MB"
    assert time.monotonic() - started < 30


def test_a_huge_model_list_is_refused_at_its_limit(tiny_engine, standin, answer):
    answer("/v1/models", hostile.gzip_bomb(line=False, kind="application/json"))
    with hostile.peak_growth() as growth:
        comp = compare(tiny_engine, standin.url)
    ran_with_error(comp, "more than 1,048,576 bytes")
    assert growth[0] < MAX_GROWTH


def test_redirects_are_never_followed(tiny_engine, tiny_lm, answer, standin):
    """/v1/models answering 302 to another server (or to ftp://): the arm says so and asks nothing of it."""
    with StandIn(lambda text: tiny_lm.tokenizer.encode(text, add_special_tokens=False), "other") as other:
        other.answer["/v1/models?ssrf=1"] = lambda h, body: pytest.fail("the redirect was followed")
        for to in (f"{other.url}/v1/models?ssrf=1", "ftp://127.0.0.1/models"):
            answer("/v1/models", hostile.status(302, {"Location": to}))
            comp = compare(tiny_engine, standin.url)
            ran_with_error(comp, "a redirect to " + to)
            assert "which is not followed" in comp.arm("vllm").error
        answer("/v1/completions", hostile.status(307, {"Location": f"{other.url}/v1/completions"}))
        ran_with_error(compare(tiny_engine, standin.url), "which is not followed")
        assert other.sent == []


MALFORMED = {
    "a token id that is not a number": [{"choices": [{"text": "x", "logprobs": {
        "tokens": ["token_id:abc"], "top_logprobs": [None]}}]}],
    "tokens named by text": [{"choices": [{"text": "x", "logprobs": {"tokens": ["x"], "top_logprobs": [None]}}]}],
    "no log-probabilities": [{"choices": [{"text": "x", "logprobs": None}]}],
    "tokens not a list": [{"choices": [{"text": "x", "logprobs": {"tokens": "abc", "top_logprobs": []}}]}],
    "a log-probability that is text": [{"choices": [{"text": "x", "logprobs": {
        "tokens": ["token_id:1"], "top_logprobs": [{"token_id:1": "high"}]}}]}],
    "choices not a list": [{"choices": {"text": "x"}}],
    "text not text": [{"choices": [{"text": 7, "logprobs": tokens(1)["choices"][0]["logprobs"]}]}],
    "negative usage": [tokens(1), {"choices": [], "usage": {"prompt_tokens": -1000, "completion_tokens": 1,
                                                           "prompt_tokens_details": {"cached_tokens": 99999}}}],
    "no usage": [tokens(1)],
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_field_of_the_wrong_type_is_a_message_in_the_column_not_a_crash(tiny_engine, standin, answer, case):
    answer("/v1/completions", hostile.events(*MALFORMED[case]))
    comp = compare(tiny_engine, standin.url)
    ran_with_error(comp, standin.url)
    assert comp.to_json()["vllm"]["error"] == comp.arm("vllm").error


def test_a_model_name_past_its_limit_is_refused_not_printed(tiny_engine, standin, answer):
    answer("/v1/models", hostile.json_answer({"data": [{"id": "m" * 100_000}]}))
    comp = compare(tiny_engine, standin.url)
    ran_with_error(comp, "not a name of at most 256 printable characters")
    assert len(comp.arm("vllm").error) < 1000


def test_a_servers_escape_sequences_are_shown_not_obeyed_by_pml_studio_run(standin, answer, capsys):
    """A refusal whose message would retitle the terminal and clear its screen: `pml-studio run` prints it with the
    control characters written out."""
    from conftest import SAMPLES as samples
    from studio.cli import main  # pml-studio's own words for each arm (studio/arm_views)

    answer("/v1/completions", hostile.json_answer({"error": {"message": "\x1b]0;pwned\x07\x1b[2J\x9b31m gone",
                                                             "type": "BadRequestError"}}, 400))
    code = main(["run", str(samples / "travel.xml"), str(samples / "travel.prompt.xml"), "--arms", "baseline,vllm",
                 "--vllm-url", standin.url, "--max-new-tokens", "2"])
    out, err = capsys.readouterr()
    assert code == 0 and "pwned" in out
    assert not any(c in out + err for c in "\x1b\x07\x9b")
    assert "\\x1b]0;pwned\\x07\\x1b[2J\\x9b31m gone" in out
