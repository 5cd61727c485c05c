"""The vLLM arm: the prompt sent to a vLLM server as the token ids the baseline prefills (modules in schema order, the
form vLLM's prefix cache can reuse), streamed from ``/v1/completions``; its TTFT is measured at the client and its
cached tokens are vLLM's own count. A server that is absent or fails is a message in the arm's result, never a
failed comparison (docs/scale-out.md)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from engine.arms.registry import (Agreement, Arm, ArmResult, ArmSettings, ArmSpec, DecodingContext, Reads, RunEvents,
                                  first_divergence, register, setting)
from engine.run import remote
from engine.run.events import FirstToken, Token
from engine.run.remote import (TOP_LOGPROBS, Endpoint, RemoteError, TokenDelta, Usage, detokenize, served_models,
                               stream_completion)
from engine.run.types import RunResult, Sampling

URL_ENV = "PML_VLLM_URL"  # the server when --vllm-url is not given


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

    def to_json(self) -> dict:
        return {"remote": True, "reuses": "prefixes only", "url": self.url, "served_model": self.served_model,
                "server_prompt_tokens": self.prompt_tokens, "server_cached_tokens": self.server_cached_tokens,
                "finish_reason": self.finish_reason, "error": self.error,
                "first_top_logprobs": [[t, round(lp, 6)] for t, lp in self.first_top.items()]}

    @classmethod
    def from_json(cls, data: dict) -> "VllmRun":
        return cls(url=data.get("url") or "", served_model=data.get("served_model"),
                   prompt_tokens=data.get("server_prompt_tokens"),
                   server_cached_tokens=data.get("server_cached_tokens"), finish_reason=data.get("finish_reason"),
                   first_top={int(t): lp for t, lp in data.get("first_top_logprobs") or ()}, error=data.get("error"))


def vllm_arm(ctx: DecodingContext) -> RunEvents[ArmResult]:
    settings = ctx.settings_of("vllm")
    url = settings.url or os.environ.get(URL_ENV, "")
    if not url:
        return failed(url, f"no vLLM server given: pass --vllm-url URL (or set ${URL_ENV}); make vllm-serve starts one")
    try:
        endpoint = connect(url, settings.model)
        check_tokenizer(endpoint, list(ctx.plan.token_ids), ctx.lm.tokenizer)
        run, detail = yield from remote_run(endpoint, list(ctx.plan.token_ids), ctx.sampling, ctx.lm.tokenizer)
    except RemoteError as e:
        return failed(url, str(e))
    return ArmResult(Arm("vllm"), run, detail=detail)


def connect(url: str, model: str = "") -> Endpoint:
    """The endpoint of ``model`` at ``url`` (its only model when ``model`` is empty)."""
    names = served_models(url)
    if model and model not in names:
        raise RemoteError(f"{url} serves {', '.join(names) or 'no model'}, not '{model}'; fix --vllm-model")
    if not names:
        raise RemoteError(f"{url} serves no model")
    return Endpoint(url, model or names[0])


def check_tokenizer(endpoint: Endpoint, ids: list[int], tokenizer) -> None:
    """RemoteError unless the server reads ``ids`` as the same text we do (the same tokenizer)."""
    theirs, ours = detokenize(endpoint, ids), tokenizer.decode(ids)
    if theirs != ours:
        at = next((i for i, (a, b) in enumerate(zip(theirs, ours)) if a != b), min(len(theirs), len(ours)))
        raise RemoteError(f"{endpoint.url} serves '{endpoint.model}', whose tokenizer reads the prompt's token ids as "
                          f"other text (from character {at}: {theirs[at:at + 40]!r} against {ours[at:at + 40]!r}); "
                          "serve the comparison's model there (make vllm-serve ARGS=\"--model ...\")")


def remote_run(endpoint: Endpoint, ids: list[int], sampling: Sampling,
               tokenizer) -> RunEvents[tuple[RunResult, VllmRun]]:
    """:func:`stream_completion`'s events as the run's own (a FirstToken, then a Token each), then a RunResult
    (client-side times) and what vLLM reported."""
    ttft, tokens, stamps, text, usage, first_top = None, [], [], "", None, {}
    for event in stream_completion(endpoint, ids, sampling):
        if isinstance(event, remote.FirstToken):
            ttft = event.ttft_ms
        elif isinstance(event, TokenDelta):
            first_top = first_top or event.top
            tokens.append(event.token_id)
            stamps.append(time.perf_counter())
            text += event.text
            if len(tokens) == 1:
                yield FirstToken("vllm", event.token_id, text, _result(tokens, ttft, stamps, tokenizer, None))
            else:
                yield Token("vllm", event.token_id, event.text, text)
        elif isinstance(event, Usage):
            usage = event
    if ttft is None:
        raise RemoteError(f"{endpoint.url} streamed no token (finish reason: {usage.finish_reason})")
    run = _result(tokens, ttft, stamps, tokenizer, usage)
    return run, VllmRun(endpoint.url, endpoint.model, usage.prompt_tokens, usage.cached_tokens, usage.finish_reason,
                        first_top)


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


def failed(url: str, why: str) -> ArmResult:
    """The arm's result when the server could not run it: no tokens, the reason in its detail."""
    run = RunResult(arm="vllm", text="", token_ids=(), ttft_ms=0.0, copy_ms=0.0, prefill_ms=0.0, sample_ms=0.0,
                    prefill_tokens=0, decode_ms_per_token=None, decode_tokens=0, peak_rss_bytes=0,
                    cuda_peak_bytes=None, kv_buffer_bytes=0, first_logits=None)
    return ArmResult(Arm("vllm"), run, detail=VllmRun(url, error=why))


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
