"""A server under measurement and its OpenAI-compatible client's side: the server process, a RAG app's requests,
one streamed request timed from the client (:class:`StreamedAnswer`), a configuration's rows (bench/serve.py,
bench/cached_share.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.common import ROOT
from bench.needles import judge
from bench.workloads import SYSTEM
from tools.screenshot import free_port  # noqa: F401  (the servers' ports: one helper for tests, bench, tools)


class Server:
    """A server process on a free port, stopped on exit; its console goes to a temporary file."""

    def __init__(self, argv: list[str], port: int, key: str, env: dict | None = None):
        self.port, self.key = port, key
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     env={**os.environ, **(env or {})})

    def wait(self, timeout: float = 600) -> None:
        client, until = self.client(), time.monotonic() + timeout
        while time.monotonic() < until:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited ({self.proc.returncode}):\n{Path(self.log.name).read_text()[-3000:]}")
            try:
                client.models.list()
                return
            except Exception:  # not listening yet
                time.sleep(1)
        raise SystemExit(f"the server did not answer in {timeout:.0f} s; its log: {self.log.name}")

    def client(self):
        from openai import OpenAI

        return OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key=self.key, max_retries=0, timeout=900)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@contextmanager
def vllm_client(spec: str, dtype: str):
    """(an ``openai`` client, the model it serves) on vLLM's OpenAI server for ``spec`` (tools/vllm_serve.py,
    prefix caching on), stopped on leaving."""
    from openai import OpenAI

    from tools.vllm_serve import VLLM_PYTHON, ServeError, start, stop

    try:
        proc, url = start(spec, free_port(), str(VLLM_PYTHON), dtype=dtype)
    except ServeError as e:
        raise SystemExit(f"{e} (or --no-vllm)")
    try:
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=900)
        yield client, client.models.list().data[0].id
    finally:
        stop(proc)


def messages(docs: list[str], imports: list[int], question: str) -> list[dict]:
    """A RAG app's request: the system message, one content part per retrieved document, the question."""
    parts = [{"type": "text", "text": docs[i]} for i in imports] + [{"type": "text", "text": question}]
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": parts}]


def joined(msgs: list[dict]) -> list[dict]:
    """The same messages with each content a string (llama-cpp-python's chat templates take no content parts)."""
    return [{**m, "content": m["content"] if isinstance(m["content"], str)
             else "\n".join(p["text"] for p in m["content"])} for m in msgs]


@dataclass(frozen=True)
class StreamedAnswer:
    """One streamed request as the client timed it; the server's own figures where it sent them (``usage``, ``pml``)."""

    ttft_ms: float
    last_ms: float
    chunks: int
    text: str
    decode_ms_per_token: float | None = None  # None below two content chunks
    prompt_tokens: int | None = None  # None: no usage sent
    cached_tokens: int = 0
    pml: dict | None = None  # the studio's "pml" extension of the response
    completion_tokens: int | None = None  # the server's count (None: no usage sent)
    gaps_ms: tuple[float, ...] = ()  # between consecutive content chunks

    def to_json(self) -> dict:
        row = {"ttft_ms": self.ttft_ms, "last_ms": self.last_ms, "chunks": self.chunks, "text": self.text}
        if self.decode_ms_per_token is not None:
            row["decode_ms_per_token"] = self.decode_ms_per_token
        if self.prompt_tokens is not None:
            row["prompt_tokens"], row["cached_tokens"] = self.prompt_tokens, self.cached_tokens
        if self.completion_tokens is not None:
            row["completion_tokens"] = self.completion_tokens
        if self.pml:
            p = self.pml
            row.update(server_ttft_ms=p["ttft_ms"], arm_ttft_ms=p["arm_ttft_ms"], routed_kept=p.get("routed_kept"),
                       modules_encoded=p["modules_encoded"], routed_out_tokens=p.get("routed_out_tokens"),
                       recomputed_tokens=p.get("recomputed_tokens"), queue_ms=p.get("queue_ms"),
                       decode_batch=p.get("decode_batch"))
        return row


def stream(client, model: str, msgs: list[dict], new_tokens: int, extra: dict | None) -> StreamedAnswer:
    """One streamed greedy request: client-side times of the first and last content chunks, text, usage."""
    kw = {"extra_body": extra or None, "stream_options": {"include_usage": True}} if extra is not None else {}
    t0 = time.perf_counter()
    times, text, usage, pml = [], [], None, None
    for chunk in client.chat.completions.create(model=model, messages=msgs, max_tokens=new_tokens, temperature=0,
                                                stream=True, **kw):
        if chunk.choices and chunk.choices[0].delta.content:
            times.append(time.perf_counter())
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
        pml = (chunk.model_extra or {}).get("pml") or pml
    if not times:
        raise SystemExit(f"{model}: the answer streamed no text")
    details = usage.prompt_tokens_details if usage is not None else None
    return StreamedAnswer(
        ttft_ms=round((times[0] - t0) * 1000, 1), last_ms=round((times[-1] - t0) * 1000, 1), chunks=len(times),
        text="".join(text),
        decode_ms_per_token=round((times[-1] - times[0]) / (len(times) - 1) * 1000, 2) if len(times) > 1 else None,
        prompt_tokens=None if usage is None else usage.prompt_tokens,
        cached_tokens=details.cached_tokens if details else 0, pml=pml,
        completion_tokens=None if usage is None else usage.completion_tokens,
        gaps_ms=tuple(round((b - a) * 1000, 2) for a, b in zip(times, times[1:])))


def run_config(client, model: str, docs, prompts, new_tokens: int, extra_of, label: str, shape=lambda m: m) -> list[dict]:
    """Warm-up (all documents in order, one token), then every prompt; a row per prompt. ``shape``: how the
    server takes the messages (:func:`joined` for one without content parts)."""
    everything = list(range(len(docs)))
    stream(client, model, shape(messages(docs, everything, prompts[0]["question"])), 1,
           extra_of(everything, prompts[0]))
    rows = []
    for i, p in enumerate(prompts):
        row = stream(client, model, shape(messages(docs, p["imports"], p["question"])), new_tokens,
                     extra_of(p["imports"], p)).to_json()
        row["found"], row["confused"] = judge(row["text"], p)
        rows.append(row)
        print(f"{label} [{i + 1}/{len(prompts)}] {row['ttft_ms']:.0f} ms {'Y' if row['found'] else 'n'} "
              f"{row['text'][:60]!r}", file=sys.stderr, flush=True)
    return rows


def anonymous_tokens(tokenizer) -> int:
    """Tokens of the chat template before the first document: the system message and the user's role tag. They are
    reused too, so ``cached_tokens`` minus these is what the documents contributed."""
    mark = "\u2063DOCUMENTS"
    text = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": mark}],
                                         tokenize=False)
    return len(tokenizer.encode(text[:text.index(mark)], add_special_tokens=False))
