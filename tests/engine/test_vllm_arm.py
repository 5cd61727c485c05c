"""The vllm arm against a stand-in for vLLM's server: a small HTTP server in the test that records what the arm sends
and answers as vLLM does (/v1/models, /detokenize, streamed /v1/completions with token ids and top log-probabilities),
computing its answer with the stock transformers model. The real server: tests/vllm/."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from conftest import SAMPLES, free_port, stock_figures
from engine.arms.compare import Comparison
from engine.arms.registry import Sampling
from engine.errors import EngineError
from engine.arms.vllm import Endpoint, remote_run
from engine.run.events import finish
from engine.run.remote import Limits, RemoteError, base_url
from test_prefix import SCHEMA  # three documents d1, d2, d3

PROMPT = '<prompt schema="docs"><d1/><d3/> When does the library open?</prompt>'


class StandIn:
    """vLLM's OpenAI server as far as the arm uses it, greedy over ``model`` (None: answers only what it is told)."""

    def __init__(self, model, tokenizer, name: str = "served", fail: tuple[int, str] | None = None,
                 tok=None):
        """``tok``: what its /tokenize does to the ids (another tokenizer)."""
        self.model, self.tokenizer, self.name, self.fail, self.tok = model, tokenizer, name, fail, tok
        self.bodies: list[dict] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def answer(self, body: dict) -> list[dict]:
        """The streamed chunks vLLM would send for ``body``: one token each, then the usage."""
        ids, n = body["prompt"], body["max_tokens"]
        eos = tuple(self.tokenizer.eos_token_id if isinstance(self.tokenizer.eos_token_id, list)
                    else [self.tokenizer.eos_token_id])
        chunks = []
        x = list(ids)
        for _ in range(n):
            with torch.inference_mode():
                logits = self.model(torch.tensor([x])).logits[0, -1].float()
            lp = torch.log_softmax(logits, -1)
            top = torch.topk(lp, body["logprobs"])
            tok = int(top.indices[0])
            chunks.append({"choices": [{"index": 0, "text": self.tokenizer.decode([tok], skip_special_tokens=True),
                                        "logprobs": {"tokens": [f"token_id:{tok}"],
                                                     "top_logprobs": [{f"token_id:{int(i)}": float(v) for i, v in
                                                                       zip(top.indices, top.values)}]},
                                        "finish_reason": None}], "usage": None})
            x.append(tok)
            if tok in eos:
                break
        chunks.append({"choices": [], "usage": {"prompt_tokens": len(ids), "completion_tokens": len(x) - len(ids),
                                                "prompt_tokens_details": {"cached_tokens": 16}}})
        return chunks

    def _handler(self):
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _json(self, code: int, doc) -> None:
                data = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if self.path == "/v1/models":
                    self._json(200, {"object": "list", "data": [{"id": stand_in.name, "object": "model"}]})
                else:
                    self._json(404, {"error": {"message": "Not Found"}})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path == "/tokenize":
                    ids = stand_in.tokenizer.encode(body["prompt"], add_special_tokens=body["add_special_tokens"])
                    self._json(200, {"count": len(ids), "tokens": stand_in.tok(ids) if stand_in.tok else ids})
                    return
                stand_in.bodies.append(body)
                if stand_in.fail:
                    self._json(stand_in.fail[0], {"error": {"message": stand_in.fail[1], "type": "BadRequestError",
                                                            "code": stand_in.fail[0]}})
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for chunk in stand_in.answer(body):
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                self.wfile.write(b"data: [DONE]\n\n")

        return Handler


@pytest.fixture
def stand_in(tiny_lm):
    srv = StandIn(tiny_lm.model, tiny_lm.tokenizer)
    yield srv
    srv.close()


def compare_with(eng, url: str, arms=("baseline", "vllm"), new: int = 6, prompt: str = PROMPT) -> Comparison:
    return eng.compare(SCHEMA, prompt, Sampling(max_new_tokens=new), config=eng.config.with_(arms=arms, vllm_url=url))


def prefilled_by_baseline(monkeypatch) -> list[list[int]]:
    """The token ids the baseline arm hands its prefill, seen as they pass (one list per run)."""
    from engine.arms import baseline

    seen, real = [], baseline.timed_run

    def spy(lm, arm, capacity, fill, *args, **kw):
        def watched(buf):
            work = fill(buf)
            seen.append(list(work.ids))
            return work
        return real(lm, arm, capacity, watched, *args, **kw)

    monkeypatch.setattr(baseline, "timed_run", spy)
    return seen


def test_the_arm_sends_the_baselines_token_ids_and_agrees_with_it(tiny_engine, tiny_lm, stand_in, monkeypatch):
    prefilled = prefilled_by_baseline(monkeypatch)
    comp = compare_with(tiny_engine, stand_in.url)
    base, remote = comp.arm("baseline"), comp.arm("vllm")
    ids = prefilled[0]
    # the prompt went as token ids, the very ones the baseline prefilled: nothing was re-tokenized
    assert stand_in.bodies[0]["prompt"] == ids and len(ids) == comp.prompt.prompt_tokens > 20
    assert stand_in.bodies[0]["stream"] is True and stand_in.bodies[0]["stream_options"] == {"include_usage": True}
    # the stand-in ran stock transformers on those ids: the same greedy tokens as the baseline's own decoding
    _, stock = stock_figures(tiny_lm.model, ids, 6, tiny_lm.eos_ids)
    assert remote.run.token_ids == stock == base.run.token_ids
    assert remote.agreement.same_text and remote.agreement.first_token_agree
    assert remote.agreement.first_token_kl < 1e-4  # over the top 20, both renormalised
    assert remote.run.reused_tokens == 16 and remote.detail.server_cached_tokens == 16
    assert remote.run.ttft_ms > 0 and comp.speedup("vllm") is not None
    doc = comp.to_json()
    assert doc["vllm"]["remote"] and doc["vllm"]["server_prompt_tokens"] == len(ids) and doc["vllm"]["error"] is None
    assert doc["vllm_same_text"] is True and doc["by_arm"]["vllm"]["agreement"]["first_token_agree"] is True
    back = Comparison.from_json(json.loads(json.dumps(doc)))
    assert back.arm("vllm").detail.server_cached_tokens == 16 and back.to_json()["vllm"] == doc["vllm"]


def test_the_first_request_a_server_answers_this_process_is_marked_cold(tiny_engine, stand_in):
    """A cold server's warm-up must not read as its prefill: the first run on a server says so, in its JSON and
    its column's words; the next does not."""
    from studio.arm_views import view_of

    first, second = (compare_with(tiny_engine, stand_in.url, arms=("vllm",), new=2).arm("vllm") for _ in range(2))
    assert first.detail.first_request and not second.detail.first_request
    doc = first.detail.to_json()
    assert doc["first_request"] is True and type(first.detail).from_json(doc).first_request
    assert any(c.startswith("cold:") for c in view_of("vllm").chips(first.detail))
    assert not any(c.startswith("cold:") for c in view_of("vllm").chips(second.detail))


def test_the_streamed_text_comes_as_the_runs_events(tiny_engine, stand_in):
    from engine.run.events import FirstToken, Token

    got = list(tiny_engine.events(SCHEMA, PROMPT, Sampling(max_new_tokens=4),
                                  config=tiny_engine.config.with_(arms=("vllm",), vllm_url=stand_in.url)))
    mine = [e for e in got if isinstance(e, (FirstToken, Token)) and e.arm == "vllm"]
    texts = [e.text for e in mine]
    assert isinstance(mine[0], FirstToken) and mine[0].ttft_ms > 0
    assert texts and all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # text so far, growing
    assert texts[-1] == got[-1].comparison.arm("vllm").run.text


@pytest.mark.parametrize("case", ["no url", "refused", "http 400", "other model", "other tokenizer"])
def test_a_server_that_cannot_run_the_arm_is_a_message_in_its_column(tiny_engine, tiny_lm, case, monkeypatch):
    monkeypatch.delenv("PML_VLLM_URL", raising=False)
    srv = None
    if case == "refused":
        url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    elif case == "no url":
        url = ""
    else:
        srv = StandIn(tiny_lm.model, tiny_lm.tokenizer, fail=(400, "This model's maximum context length is 8")
                      if case == "http 400" else None, tok=(lambda ids: [i + 1 for i in ids]) if case == "other tokenizer"
                      else None)
        url = srv.url
    try:
        config = tiny_engine.config.with_(arms=("baseline", "vllm"), vllm_url=url,
                                          vllm_model="elsewhere" if case == "other model" else "")
        comp = tiny_engine.compare(SCHEMA, PROMPT, Sampling(max_new_tokens=3), config=config)
    finally:
        if srv:
            srv.close()
    words = {"no url": "--vllm-url", "refused": "cannot reach", "http 400": "HTTP 400): This model's maximum",
             "other model": "not 'elsewhere'", "other tokenizer": "tokenizer"}[case]
    remote = comp.arm("vllm")
    assert words in remote.error and remote.agreement is None and comp.speedup("vllm") is None
    assert len(comp.arm("baseline").run.token_ids) == 3  # the comparison itself went on
    doc = comp.to_json()
    assert doc["vllm"]["error"] == remote.error and doc["vllm_speedup"] is None and doc["vllm_same_text"] is None


def test_a_url_is_checked_and_a_slow_server_times_out(tiny_lm):
    assert base_url("http://h:1/v1/") == "http://h:1"
    with pytest.raises(EngineError, match="http:// or https://"):
        base_url("127.0.0.1:8100")
    srv = StandIn(tiny_lm.model, tiny_lm.tokenizer)
    srv.answer = lambda body: threading.Event().wait(3) or []  # says nothing for 3 s
    try:
        with pytest.raises(RemoteError, match="did not answer within 1 s"):
            finish(remote_run(Endpoint(srv.url, "served", limits=Limits(idle_s=1)), [1, 2, 3],
                              Sampling(max_new_tokens=2), tiny_lm.tokenizer))
    finally:
        srv.close()


def test_the_arm_is_offered_on_the_command_line():
    from engine.cli import build_parser

    args = build_parser(arm_options=True).parse_args(["run", "s.xml", "p.xml", "--arms", "baseline,vllm",
                                                      "--vllm-url", "http://127.0.0.1:8100"])
    from engine.cli import config_from_args

    config = config_from_args(args)
    assert config.arms == ("baseline", "vllm") and config.settings_of("vllm").url == "http://127.0.0.1:8100"


@pytest.mark.real_model
def test_on_the_real_model_the_arm_sends_the_baselines_ids_and_answers_alike(real_engine, real_stock, monkeypatch):
    prefilled = prefilled_by_baseline(monkeypatch)
    schema, prompt = (SAMPLES / "travel.xml").read_text(), (SAMPLES / "travel.prompt.xml").read_text()
    srv = StandIn(real_stock, real_engine.tokenizer)
    try:
        comp = real_engine.compare(schema, prompt, Sampling(max_new_tokens=8),
                                   config=real_engine.config.with_(arms=("baseline", "vllm"), vllm_url=srv.url))
    finally:
        srv.close()
    assert srv.bodies[0]["prompt"] == prefilled[0] and len(prefilled[0]) == comp.prompt.prompt_tokens
    assert comp.arm("vllm").run.token_ids == comp.arm("baseline").run.token_ids
    assert comp.arm("vllm").agreement.first_token_agree
