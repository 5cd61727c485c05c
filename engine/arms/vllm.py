"""The vLLM arm: the prompt sent to a vLLM server as the token ids the baseline prefills (modules in schema order, the
form vLLM's prefix cache can reuse), streamed from ``/v1/completions``; its TTFT is measured at the client and its
cached tokens are vLLM's own count. A server that is absent or fails is a message in the arm's result, never a
failed comparison (docs/scale-out.md)."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

import torch

from engine.arms.registry import (Agreement, Arm, ArmResult, ArmSettings, ArmSpec, DecodingContext, Reads, RunEvents,
                                  first_divergence, register, setting)
from engine.limits import Limit
from engine.run.events import FirstToken, Token
from engine.run.remote import TOP_LOGPROBS, Blocking, End, Limits, RemoteError, Usage, base_url, completion_body
from engine.run.types import RunResult, Sampling

URL_ENV = "PML_VLLM_URL"  # the server when --vllm-url is not given
KEY_ENV = "PML_VLLM_API_KEY"  # its API key (vLLM's --api-key), read here only: a setting would be logged with the run
_ANSWERED: set[tuple[str, str]] = set()  # (url, model) that answered this process
_ANSWERED_LOCK = threading.Lock()


@dataclass(frozen=True)
class VllmSettings(ArmSettings):
    """Where the vLLM server is; empty: ``$PML_VLLM_URL``."""

    url: str = setting("", "vllm_url", "vLLM: server URL",
                       "adds a column whose answer comes from a vLLM server on the same token ids: it reuses "
                       "prefixes only, and its first token comes when that server answers (the network included)",
                       how=f"a vLLM OpenAI server's base URL, e.g. http://127.0.0.1:8100 (default ${URL_ENV}; "
                       "make vllm-serve starts one)", metavar="URL")
    model: str = setting("", "vllm_model", "vLLM: served model name",
                         "which of the server's models answers: it must be this studio's model (same tokenizer), "
                         "else the column says why and no time is compared",
                         how="the name vLLM serves the model under (default: the one it serves)", metavar="NAME")
    timeout: float = setting(900.0, "vllm_timeout", "vLLM: answer deadline (s)",
                             "how long the server may take to answer in all before the column says it timed out (it "
                             "may also send nothing new for at most 300 s)",
                             limit=Limit("vllm timeout", 1.0, 86400.0, meaning="seconds, from 1", example="900"),
                             step=10.0, widget_max=3600.0, metavar="S")


@dataclass(frozen=True)
class VllmRun:
    """What the server said about one run, or why it could not run."""

    url: str
    served_model: str | None = None
    prompt_tokens: int | None = None  # as vLLM counted them
    server_cached_tokens: int | None = None  # vLLM's usage.prompt_tokens_details.cached_tokens
    finish_reason: str | None = None
    first_top: dict[int, float] = field(default_factory=dict)  # first token's top TOP_LOGPROBS log-probabilities
    error: str | None = None
    error_kind: str | None = None  # unconfigured, or RemoteError's kind: unavailable, timeout, refused, broken, mismatch
    first_request: bool = False  # the first this process had that server answer: may hold its warm-up

    def to_json(self) -> dict:
        return {"remote": True, "reuses": "prefixes only", "url": self.url, "served_model": self.served_model,
                "server_prompt_tokens": self.prompt_tokens, "server_cached_tokens": self.server_cached_tokens,
                "first_request": self.first_request,
                "finish_reason": self.finish_reason, "error": self.error, "error_kind": self.error_kind,
                "first_top_logprobs": [[t, round(lp, 6)] for t, lp in self.first_top.items()]}

    @classmethod
    def from_json(cls, data: dict) -> "VllmRun":
        return cls(url=data.get("url") or "", served_model=data.get("served_model"),
                   prompt_tokens=data.get("server_prompt_tokens"),
                   server_cached_tokens=data.get("server_cached_tokens"), finish_reason=data.get("finish_reason"),
                   first_request=bool(data.get("first_request")),
                   first_top={int(t): lp for t, lp in data.get("first_top_logprobs") or ()}, error=data.get("error"),
                   error_kind=data.get("error_kind"))


@dataclass(frozen=True)
class Endpoint:
    """A server's base URL (no ``/v1``), the model it serves under that name, its key and limits."""

    url: str
    model: str
    api_key: str | None = field(default=None, repr=False)
    limits: Limits = Limits()

    def __post_init__(self):
        object.__setattr__(self, "url", base_url(self.url))


def vllm_arm(ctx: DecodingContext) -> RunEvents[ArmResult]:
    settings = ctx.settings_of("vllm")
    url = settings.url or os.environ.get(URL_ENV, "")
    if not url:
        return failed(url, "no vLLM server given: fill in \"vLLM: server URL\" (the studio), pass --vllm-url URL (the "
                      f"CLI) or set ${URL_ENV}; make vllm-serve starts one", kind="unconfigured")
    try:
        limits = Limits(answer_s=settings.timeout, idle_s=min(Limits.idle_s, settings.timeout))
        endpoint = connect(url, settings.model, tokenizer=ctx.lm.tokenizer, limits=limits)
        run, detail = yield from remote_run(endpoint, list(ctx.plan.token_ids), ctx.sampling, ctx.lm.tokenizer)
    except RemoteError as e:
        fix = "; start vLLM (make vllm-serve) or fix the vLLM URL" if e.kind == "unavailable" else ""
        return failed(url, f"{e}{fix}", kind=e.kind)
    return ArmResult(Arm("vllm"), run, detail=detail)


def connect(url: str, model: str = "", tokenizer=None, api_key: str | None = None,
            limits: Limits = Limits()) -> Endpoint:
    """The endpoint of ``model`` at ``url`` (its first model when ``model`` is empty), its tokenizer checked against
    ``tokenizer``'s when given (engine/run/remote.py says how); ``api_key``: default ``$PML_VLLM_API_KEY``."""
    key = api_key or os.environ.get(KEY_ENV) or None
    encode = None if tokenizer is None else (lambda text: tokenizer.encode(text, add_special_tokens=False))
    with Blocking(url, api_key=key, limits=limits) as client:
        try:
            card = client.run(client.remote.connect(model, encode, local="this studio"))
        except RemoteError as e:
            if e.kind == "mismatch":
                raise RemoteError(f"{e}; serve the comparison's model there (make vllm-serve ARGS=\"--model ...\")",
                                  kind=e.kind) from None
            if e.kind == "refused" and model:
                raise RemoteError(f"{e}; fix --vllm-model", kind=e.kind) from None
            raise
    return Endpoint(url, card.model, key, limits)


def remote_run(endpoint: Endpoint, ids: list[int], sampling: Sampling,
               tokenizer) -> RunEvents[tuple[RunResult, VllmRun]]:
    """The server's streamed answer as the run's own events (a FirstToken, then a Token each), then a RunResult
    (times at this client: from sending the request) and what vLLM reported."""
    tokens, stamps, text, first_top = [], [], "", {}
    server = (endpoint.url, endpoint.model)
    with _ANSWERED_LOCK:
        first_request = server not in _ANSWERED
    ttft, end = None, None
    body = completion_body(endpoint.model, ids, sampling, logprobs=TOP_LOGPROBS)
    with Blocking(endpoint.url, api_key=endpoint.api_key, limits=endpoint.limits) as client:
        start = time.perf_counter()
        for event in client.stream(client.remote.complete(body)):
            if isinstance(event, End):
                end = event
                continue
            for i, token in enumerate(event.token_ids):
                now = time.perf_counter()
                ttft = (now - start) * 1000 if ttft is None else ttft
                first_top = first_top or event.top[i]
                tokens.append(token)
                stamps.append(now)
                # the text is the piece's, given with its last token: a token may end inside a character
                delta = event.text if i == len(event.token_ids) - 1 else ""
                text += delta
                if len(tokens) == 1:
                    yield FirstToken("vllm", token, text, _result(tokens, ttft, stamps, tokenizer, None))
                else:
                    yield Token("vllm", token, delta, text)
    if ttft is None:
        raise RemoteError(f"{endpoint.url} streamed no token (finish reason: {end.finish_reason})")
    with _ANSWERED_LOCK:
        _ANSWERED.add(server)
    run = _result(tokens, ttft, stamps, tokenizer, end.usage)
    return run, VllmRun(endpoint.url, endpoint.model, end.usage.prompt_tokens, end.usage.cached_tokens,
                        end.finish_reason, first_top, first_request=first_request)


def _result(tokens: list[int], ttft: float, stamps: list[float], tokenizer, usage: Usage | None) -> RunResult:
    """The run so far; its token counts once ``usage`` came."""
    steps = len(stamps) - 1
    cached = 0 if usage is None else usage.cached_tokens
    return RunResult(arm="vllm", text=tokenizer.decode(tokens, skip_special_tokens=True), token_ids=tuple(tokens),
                     ttft_ms=ttft, copy_ms=0.0, prefill_ms=ttft, sample_ms=0.0,
                     prefill_tokens=0 if usage is None else usage.prompt_tokens - cached,
                     decode_ms_per_token=(stamps[-1] - stamps[0]) * 1000 / steps if steps else None,
                     decode_tokens=len(tokens), peak_rss_bytes=0, cuda_peak_bytes=None, kv_buffer_bytes=0,
                     first_logits=None, reused_tokens=cached, precomputed_tokens=cached)


def failed(url: str, why: str, kind: str = "broken") -> ArmResult:
    """The arm's result when the server could not run it: no tokens, the reason (and its kind) in its detail."""
    run = RunResult(arm="vllm", text="", token_ids=(), ttft_ms=0.0, copy_ms=0.0, prefill_ms=0.0, sample_ms=0.0,
                    prefill_tokens=0, decode_ms_per_token=None, decode_tokens=0, peak_rss_bytes=0,
                    cuda_peak_bytes=None, kv_buffer_bytes=0, first_logits=None)
    return ArmResult(Arm("vllm"), run, detail=VllmRun(url, error=why, error_kind=kind))


def top_agreement(base: ArmResult, res: ArmResult) -> Agreement | None:
    """Agreement with the baseline from vLLM's top log-probabilities of the first token: its KL and log-probability
    difference are over vLLM's top TOP_LOGPROBS tokens only, each side renormalised over them."""
    top = res.detail.first_top
    if res.detail.error or not top or base.run.first_logits is None:
        return None
    ids = torch.tensor(list(top))
    lb = torch.log_softmax(base.run.first_logits.float(), -1)
    sub_b = torch.log_softmax(lb[ids], -1)
    sub_v = torch.log_softmax(torch.tensor(list(top.values()), dtype=torch.float32), -1)
    kl = max(float(torch.sum(sub_b.exp() * (sub_b - sub_v))), 0.0)
    div = first_divergence(base.run.token_ids, res.run.token_ids)
    return Agreement(same_text=div is None, first_divergence=div,
                     first_token_agree=int(torch.argmax(lb)) == max(top, key=top.get), first_token_kl=kl,
                     max_first_logit_diff=float((lb[ids] - torch.tensor(list(top.values()))).abs().max()))


register(ArmSpec("vllm", vllm_arm, order=90, reads=Reads.NOTHING, settings=VllmSettings, detail=VllmRun,
                 agreement=top_agreement))
