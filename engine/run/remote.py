"""A remote OpenAI-compatible server (vLLM) as a run: prompt token ids in, typed events out.

:func:`stream_completion` sends the ids to ``/v1/completions`` (streamed, greedy or sampled as asked) and yields a
:class:`FirstToken` with the time to it measured here, at the client, then one :class:`TokenDelta` per generated
token (its id, text and the server's top log-probabilities), then :class:`Usage` (the tokens the server says it took
from its prefix cache). Every failure is a :class:`RemoteError` naming the server and what to do.
"""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Iterator, Union

from engine.errors import EngineError
from engine.run.sse import DONE, EventError, data_of, error_message
from engine.run.types import Sampling

TOP_LOGPROBS = 20  # vLLM's default --max-logprobs: the first-token agreement is over these
TOKEN_ID = "token_id:"  # vLLM's token strings under return_tokens_as_token_ids


class RemoteError(EngineError):
    """The server could not be reached, refused, or answered something this client cannot read."""


@dataclass(frozen=True)
class Endpoint:
    """A server's base URL (no ``/v1``) and the model it serves under that name."""

    url: str
    model: str
    timeout_s: float = 600.0

    def __post_init__(self):
        object.__setattr__(self, "url", base_url(self.url))


@dataclass(frozen=True)
class FirstToken:
    ttft_ms: float  # request sent until the first token arrived, at the client


@dataclass(frozen=True)
class TokenDelta:
    token_id: int
    text: str
    top: dict[int, float]  # token id -> log-probability, the server's top TOP_LOGPROBS at this step


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens the server took from its prefix cache
    finish_reason: str | None


Event = Union[FirstToken, TokenDelta, Usage]


# -- Public API --

def base_url(url: str) -> str:
    """``url`` without a trailing ``/`` or ``/v1``; RemoteError when it is not http(s)."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    if not url.startswith(("http://", "https://")):
        raise RemoteError(f"a vLLM URL starts with http:// or https://, got '{url}'; e.g. http://127.0.0.1:8100")
    return url


def served_models(url: str, timeout_s: float = 10.0) -> list[str]:
    """The model names the server at ``url`` serves (``/v1/models``)."""
    data = _request("GET", f"{base_url(url)}/v1/models", None, timeout_s)
    try:
        return [m["id"] for m in data["data"]]
    except (KeyError, TypeError):
        raise RemoteError(f"{url}/v1/models did not answer as an OpenAI server does ({str(data)[:200]})") from None


def detokenize(endpoint: Endpoint, ids: list[int]) -> str:
    """The server's text of ``ids`` (vLLM's ``/detokenize``): equal to ours when it runs our tokenizer."""
    data = _request("POST", f"{endpoint.url}/detokenize", {"model": endpoint.model, "tokens": ids}, endpoint.timeout_s)
    if not isinstance(data, dict) or "prompt" not in data:
        raise RemoteError(f"{endpoint.url}/detokenize did not answer as vLLM does ({str(data)[:200]}); the vllm arm "
                          "needs vLLM's server, which checks that it runs the same tokenizer")
    return data["prompt"]


def completion_request(endpoint: Endpoint, ids: list[int], sampling: Sampling) -> dict:
    """The body :func:`stream_completion` posts: the prompt as token ids, never re-tokenized text."""
    body = {"model": endpoint.model, "prompt": list(ids), "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature, "top_p": sampling.top_p, "seed": sampling.seed, "stream": True,
            "stream_options": {"include_usage": True}, "logprobs": TOP_LOGPROBS,
            "return_tokens_as_token_ids": True, "skip_special_tokens": True}
    if sampling.stop:
        body.update(stop=list(sampling.stop), include_stop_str_in_output=True)
    return body


def stream_completion(endpoint: Endpoint, ids: list[int], sampling: Sampling) -> Iterator[Event]:
    """Stream a completion of ``ids``: FirstToken, a TokenDelta per token, then Usage."""
    body = json.dumps(completion_request(endpoint, ids, sampling)).encode()
    req = urllib.request.Request(f"{endpoint.url}/v1/completions", body, {"Content-Type": "application/json"})
    start = time.perf_counter()
    first, usage, finish = True, None, None
    with _open(req, endpoint.timeout_s) as resp:
        for chunk in _events(resp, endpoint.url, endpoint.timeout_s):
            for choice in chunk.get("choices") or ():
                finish = choice.get("finish_reason") or finish
                for delta in _deltas(choice, endpoint.url):
                    if first:
                        yield FirstToken((time.perf_counter() - start) * 1000)
                        first = False
                    yield delta
            usage = chunk.get("usage") or usage
    if usage is None:
        raise RemoteError(f"{endpoint.url} sent no usage at the end of the stream; is it vLLM (it sends one when "
                          "asked with stream_options.include_usage)?")
    details = usage.get("prompt_tokens_details") or {}
    yield Usage(usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0),
                int(details.get("cached_tokens") or 0), finish)


# -- Internal helpers --

def _deltas(choice: dict, url: str) -> Iterator[TokenDelta]:
    """One TokenDelta per token of a streamed choice (a chunk may carry several)."""
    lp = choice.get("logprobs") or {}
    tokens, tops = lp.get("tokens") or [], lp.get("top_logprobs") or []
    for i, tok in enumerate(tokens):
        top = tops[i] if i < len(tops) and tops[i] else {}
        # the text is the chunk's, given with its last token: a token may end inside a character
        yield TokenDelta(_token_id(tok, url), choice.get("text", "") if i == len(tokens) - 1 else "",
                         {_token_id(k, url): v for k, v in top.items()})


def _token_id(token: str, url: str) -> int:
    if not token.startswith(TOKEN_ID):
        raise RemoteError(f"{url} named tokens by text ('{token}'), not by id; the vllm arm needs vLLM's "
                          "return_tokens_as_token_ids (vLLM 0.6 or later)")
    return int(token[len(TOKEN_ID):])


def _events(resp, url: str, timeout_s: float) -> Iterator[dict]:
    """The JSON documents of a server-sent event stream, up to ``data: [DONE]``."""
    for raw in _lines(resp, url, timeout_s):
        try:
            doc = data_of(raw)
        except EventError as err:
            raise RemoteError(f"{url} failed mid-stream: {err}" if err.event is not None else
                              f"{url} sent a stream line that is {err}") from None
        if doc == DONE:
            return
        if doc is not None:
            yield doc


def _lines(resp, url: str, timeout_s: float) -> Iterator[bytes]:
    """The response's lines; a stall or a dropped connection as a RemoteError."""
    try:
        yield from resp
    except (socket.timeout, TimeoutError):
        raise RemoteError(f"{url} did not answer within {timeout_s:g} s; is the server overloaded?") from None
    except OSError as e:
        raise RemoteError(f"{url} dropped the stream ({e}); is the server still running?") from None


def _request(method: str, url: str, body: dict | None, timeout_s: float):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"}, method=method)
    with _open(req, timeout_s) as resp:
        try:
            return json.load(resp)
        except ValueError:
            raise RemoteError(f"{url} answered something that is not JSON; is it a vLLM server?") from None


def _open(req: urllib.request.Request, timeout_s: float):
    """urlopen, its failures as RemoteErrors that say what to do."""
    where = req.full_url
    try:
        return urllib.request.urlopen(req, timeout=timeout_s)
    except urllib.error.HTTPError as e:
        try:
            said = error_message(json.loads(e.read().decode("utf-8", "replace")))
        except ValueError:
            said = e.reason
        raise RemoteError(f"{where} refused the request (HTTP {e.code}): {said}") from None
    except (socket.timeout, TimeoutError):
        raise RemoteError(f"{where} did not answer within {timeout_s:g} s; is the server overloaded?") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise RemoteError(f"cannot reach {where} ({reason}); start vLLM (make vllm-serve) or fix --vllm-url") \
            from None
