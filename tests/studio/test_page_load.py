"""What the studio does to keep the page and the server quiet while it decodes: assets/studio.js put first in the
page's <head> (studio/pagescript.py) and Gradio's queue polling slowed (studio/launch.py calm_queue)."""

from __future__ import annotations

import asyncio

import gradio as gr

from studio.launch import PROGRESS_EVERY_S, QUEUE_POLL_S, calm_queue
from studio.pagescript import FirstScript


def _serve(app, path="/", method="GET"):
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app({"type": "http", "method": method, "path": path, "headers": []}, receive, send))
    start = next(m for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return dict(start["headers"]), body


def _app(content_type: bytes, chunks: list[bytes]):
    async def app(scope, receive, send):
        size = str(sum(map(len, chunks))).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", content_type), (b"content-length", size)]})
        for i, chunk in enumerate(chunks):
            await send({"type": "http.response.body", "body": chunk, "more_body": i < len(chunks) - 1})
    return app


def test_the_script_comes_first_in_the_head_of_an_html_page():
    page = [b"<!doctype html><html><head lang='en'><script type=module src=x.js></script>", b"</head><body/></html>"]
    headers, body = _serve(FirstScript(_app(b"text/html; charset=utf-8", page), "window.a = 1;"))
    assert body.startswith(b"<!doctype html><html><head lang='en'><script>window.a = 1;</script><script type=module")
    assert body.endswith(b"</head><body/></html>") and int(headers[b"content-length"]) == len(body)


def test_other_answers_pass_untouched():
    for kind, chunks in [(b"application/json", [b'{"head": "<head>"}']), (b"text/event-stream", [b"data: 1\n\n", b"x"])]:
        headers, body = _serve(FirstScript(_app(kind, chunks), "window.a = 1;"))
        assert body == b"".join(chunks) and headers[b"content-type"] == kind
    _, body = _serve(FirstScript(_app(b"text/html", [b"<head></head>"]), "s"), method="POST")
    assert body == b"<head></head>"


def test_the_queue_polls_less_often():
    with gr.Blocks() as demo:
        gr.Textbox()
    demo.queue()
    assert demo._queue.sleep_when_free < QUEUE_POLL_S  # Gradio's own: 1 ms off Windows
    calm_queue(demo)
    assert (demo._queue.sleep_when_free, demo._queue.progress_update_sleep_when_free) == (QUEUE_POLL_S, PROGRESS_EVERY_S)
