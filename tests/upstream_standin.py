"""A vLLM stand-in for the front's tests (tests/studio/test_api_upstream.py): an HTTP server that answers
``/v1/models``, ``/tokenize`` and streamed ``/v1/completions`` in vLLM 0.32's shapes, records the JSON of every
completion request, and reports as cached what vLLM's prefix cache would: the longest prefix sent before, in whole
16-token blocks, less the last token (vLLM always computes one). Not a mock of the client: the client side is the
official openai package, through the front.
"""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BLOCK = 16  # vLLM's KV block


class StandIn:
    """Serve on ``port`` (0: a free one) until :meth:`stop`; ``encode``: the tokenizer ``/tokenize`` answers with."""

    def __init__(self, encode, model: str, max_model_len: int = 4096, reply=("Vell", " has", " three", " ferries"),
                 port: int = 0):
        self.encode, self.model, self.max_model_len, self.reply = encode, model, max_model_len, tuple(reply)
        self.sent: list[dict] = []  # the JSON of every /v1/completions request, in order
        self.headers: list[dict] = []  # the headers of every /v1/completions request, in order
        self.refuse: tuple[int, dict] | None = None  # (status, body) to answer the next completions with
        self.break_after: int | None = None  # send this many text events, then an error event
        # a hostile server (tests/hostile_upstream.py): fn(handler, body) answers the route instead, by path
        self.answer: dict[str, object] = {}
        self._seen: list[list[int]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    def cached(self, ids: list[int]) -> int:
        """vLLM's cached tokens for ``ids`` after the prompts seen so far (then ``ids`` is seen too)."""
        best = max((len(os.path.commonprefix([ids, seen])) for seen in self._seen), default=0)
        self._seen.append(list(ids))
        return min(best, len(ids) - 1) // BLOCK * BLOCK

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def _handler(standin: StandIn):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def do_GET(self):
            if self.path in standin.answer:
                return standin.answer[self.path](self, None)
            if self.path != "/v1/models":
                return self._json(404, {"error": {"message": "Not Found", "type": "NotFound", "param": None,
                                                  "code": 404}})
            self._json(200, {"object": "list", "data": [{"id": standin.model, "object": "model", "owned_by": "vllm",
                                                         "root": "/models/x", "max_model_len": standin.max_model_len}]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            if self.path == "/v1/completions":
                standin.headers.append(dict(self.headers))
            if self.path in standin.answer:
                if self.path == "/v1/completions":
                    standin.sent.append(body)
                return standin.answer[self.path](self, body)
            if self.path == "/tokenize":
                ids = standin.encode(body["prompt"])
                return self._json(200, {"count": len(ids), "max_model_len": standin.max_model_len, "tokens": ids})
            standin.sent.append(body)
            if standin.refuse is not None:
                status, error = standin.refuse
                standin.refuse = None
                return self._json(status, error)
            self._stream(body)

        def _stream(self, body: dict):
            ids, n = body["prompt"], min(body["max_tokens"], len(standin.reply))
            cached = standin.cached(ids)
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            head = {"id": "cmpl-standin", "object": "text_completion", "created": int(time.time()),
                    "model": standin.model}
            for i, text in enumerate(standin.reply[:n]):
                if standin.break_after is not None and i == standin.break_after:
                    self._event({"error": {"message": "the engine died", "type": "InternalServerError",
                                           "param": None, "code": 500}})
                    return self._event("[DONE]")
                last = i == n - 1
                finish = ("length" if n == body["max_tokens"] else "stop") if last else None
                self._event({**head, "choices": [{"index": 0, "text": text, "logprobs": None,
                                                  "finish_reason": finish, "stop_reason": None}], "usage": None})
            usage = {"prompt_tokens": len(ids), "total_tokens": len(ids) + n, "completion_tokens": n,
                     "prompt_tokens_details": {"cached_tokens": cached}}
            self._event({**head, "choices": [], "usage": usage})
            self._event("[DONE]")

        def _event(self, data) -> None:
            text = data if isinstance(data, str) else json.dumps(data)
            self.wfile.write(f"data: {text}\n\n".encode())
            self.wfile.flush()

        def _json(self, status: int, data: dict) -> None:
            raw = json.dumps(data).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

    return Handler
