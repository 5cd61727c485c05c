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


LINES = [b": ping\n", b'data:{"choices": [{"text": "a"}]}\n', b"\n", b"event: x\n",
         b'data: {"choices": [{"text": "b"}]}\r\n', b"data: [DONE]\n", b'data: {"after": "the end"}\n']


def test_the_vllm_arm_reads_its_stream_with_it():
    from engine.run.remote import RemoteError, _events

    url = "http://vllm.test:8000"
    assert list(_events(iter(LINES), url, 1.0)) == [{"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]}]
    for line, said in [(b'data: {"error": {"message": "the engine died"}}', f"{url} failed mid-stream: the engine died"),
                       (b"data: {x", f"{url} sent a stream line that is not JSON: {{x"),
                       (b"data: [1]", f"{url} sent a stream line that is not a JSON object: [1]")]:
        with pytest.raises(RemoteError) as err:
            list(_events(iter([LINES[1], line, LINES[5]]), url, 1.0))
        assert str(err.value) == said
