"""One reader of a server-sent event stream's lines, shared by the vllm arm (engine/run/remote.py) and the API's
front (studio/api/upstream.py): each line, written here by hand, read as the SSE format and OpenAI's servers say."""

from __future__ import annotations

import json

import pytest

from engine.run.sse import DONE, EventError, data_of, error_message


@pytest.mark.parametrize("line", ["", "   ", "\r\n", ": ping - 2026-11-29", ":", "event: message", "id: 7",
                                  "retry: 3000", "dat: {}", b"", b": keep-alive\n"])
def test_lines_without_data_are_nothing(line):
    assert data_of(line) is None


@pytest.mark.parametrize("line", ['data: {"choices": [{"text": "a"}]}', 'data:{"choices": [{"text": "a"}]}',
                                  '  data:   {"choices": [{"text": "a"}]}  \r\n', b'data: {"choices": [{"text": "a"}]}\n'])
def test_a_data_line_is_its_object_with_or_without_a_space(line):
    assert data_of(line) == {"choices": [{"text": "a"}]}


def test_the_end_and_text_that_is_not_valid_utf8():
    assert data_of("data: [DONE]") == DONE and data_of(b"data:[DONE]\r\n") == DONE
    assert data_of(b'data: {"text": "caf\xc3"}') == {"text": "caf\ufffd"}  # a broken character, not a crash


@pytest.mark.parametrize("data,why", [("{not json", "not JSON"), ("[1, 2]", "not a JSON object"),
                                      ("5", "not a JSON object"), ('"error"', "not a JSON object"),
                                      ("[" * 100_000, "not JSON")])
def test_data_that_is_not_an_object_names_itself(data, why):
    with pytest.raises(EventError) as err:
        data_of(f"data: {data}")
    assert str(err.value) == f"{why}: {data[:200]}" and err.value.data == data and err.value.event is None


@pytest.mark.parametrize("event,message", [
    ('{"error": {"message": "out of memory", "type": "InternalServerError", "code": 500}}', "out of memory"),
    ('{"error": "the engine died"}', "the engine died"),
    ('{"error": {"code": 3}}', "{'error': {'code': 3}}"),  # no message: the whole document
    ('{"object": "error", "error": null, "message": "bad"}', "{'object': 'error', 'error': None, 'message': 'bad'}"),
])
def test_an_error_event_carries_the_servers_message_and_document(event, message):
    with pytest.raises(EventError) as err:
        data_of(f"data: {event}")
    assert str(err.value) == message and err.value.data == event and err.value.event == json.loads(event)


def test_an_error_documents_message():
    assert error_message({"message": "no such model"}) == "no such model"
    assert error_message({"error": {"message": "x" * 600}}) == "x" * 500
    assert error_message(["odd"]) == "['odd']"


# A stream as the standard writes it: a comment, two events (one with CRLF endings), usage, the end, an event after it
STREAM = (b": ping\n" b'data:{"choices": [{"text": "a"}]}\n' b"\n" b"event: x\n" b'data: {"choices": [{"text": "b"}]}\r\n'
          b"\r\n" b'data: {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}\n\n'
          b"data: [DONE]\n\n" b'data: {"after": "the end"}\n\n')


def served_by(raw: bytes, status: int = 200, headers: dict | None = None):
    """An httpx transport whose server answers every request with ``raw``."""
    import httpx

    return httpx.MockTransport(lambda request: httpx.Response(status, stream=httpx.ByteStream(raw), headers={
        "Content-Type": "text/event-stream", **(headers or {})}))


def events_of(raw: bytes, cut: int = 7) -> list[str]:
    """The data of each event in ``raw`` fed in pieces of ``cut`` bytes (a CR may end one piece, its LF start the
    next), then the end."""
    from engine.run.sse import EventReader

    reader, out = EventReader(), []
    for i in range(0, len(raw), cut):
        out += reader.feed(raw[i:i + cut])
    return out + reader.end()


@pytest.mark.parametrize("cut", [1, 2, 7, 1000])
def test_events_end_at_a_blank_line_whatever_ends_lines_and_wherever_the_bytes_are_cut(cut):
    raw = b'data: {"a": 1}\r\rdata: {"b": 2}\r\n\r\ndata: {"c":\ndata: 3}\n\n: comment\nid: 4\n\ndata:[DONE]\n\n'
    assert events_of(raw, cut) == ['{"a": 1}', '{"b": 2}', '{"c":\n3}', "[DONE]"]


def test_unicode_line_separators_are_text_not_line_ends():
    """U+2028, U+2029 and U+0085 (a real vLLM streams them raw) are text; only CR and LF end a line."""
    text = "x\u2028y\u2029z\u0085w"
    raw = f'data: {{"choices": [{{"text": "{text}"}}]}}\n\n'.encode()
    (data,) = events_of(raw, 3)
    assert json.loads(data)["choices"][0]["text"] == text


def test_a_line_past_the_limit_is_refused_without_being_held():
    from engine.run.sse import EventError, EventReader

    reader = EventReader(max_line=1000)
    reader.feed(b"data: " + b"a" * 900)
    with pytest.raises(EventError, match="a line longer than 1,000 bytes"):
        reader.feed(b"a" * 200)
    assert len(reader._line) <= 1000


def test_an_event_left_open_at_the_end_is_read():
    assert events_of(b'data: {"x": 1}\n') == ['{"x": 1}'] and events_of(b"data: [DONE]") == ["[DONE]"]


def test_json_constants_that_are_not_numbers_are_refused():
    from engine.run.sse import document

    for constant in ("NaN", "Infinity", "-Infinity"):
        with pytest.raises(EventError, match="not JSON"):
            document(f'{{"usage": {{"prompt_tokens": {constant}}}}}')


def test_the_vllm_arm_reads_its_stream_with_it():
    import asyncio

    from engine.run.remote import End, Piece, Remote, RemoteError, Usage

    url = "http://vllm.test:8000"
    body = {"prompt": [1, 2, 3], "max_tokens": 4}

    async def read(raw: bytes) -> list:
        remote = Remote(url, transport=served_by(raw))
        try:
            return [e async for e in remote.complete(body)]
        finally:
            await remote.aclose()

    assert asyncio.run(read(STREAM)) == [Piece("a"), Piece("b"), End(None, Usage(3, 2, 0))]
    head = STREAM.split(b"data: [DONE]")[0]
    for tail, said in [(b'data: {"error": {"message": "the engine died"}}\n\n', f"{url} failed mid-stream: the engine died"),
                       (b"data: {x\n\n", f"{url} sent an event that is not JSON: {{x"),
                       (b"data: [1]\n\n", f"{url} sent an event that is not a JSON object: [1]")]:
        with pytest.raises(RemoteError) as err:
            asyncio.run(read(head + tail))
        assert str(err.value) == said
