"""Each API request is laid out once: its PML is prepared by ``Engine.prepare`` and run by ``Engine.run``; the
documents are measured with the tokenizer, where the layout puts them."""

from __future__ import annotations

import openai
import pytest

from engine.runlog import RunLog
from engine.schema.layout import layout
from engine.schema.plan import plan_prompt
from engine.schema.pml import parse_prompt, parse_schema
from engine.session import Engine
from studio.api import modes
from studio.api.positions import PositionRegistry
from tests.conftest import spy_on_encode
from tests.studio_fixtures import TOKEN, served_studio

MODEL = "tiny-llama"


def essay(name: str) -> str:
    return f"Essay {name}: " + " ".join(f"{name} wrote note {i} about rivers, maps and the weather of {name}."
                                        for i in range(6))


@pytest.fixture(scope="module")
def counted(tiny_lm, tmp_path_factory):
    """(openai client, calls): ``calls`` lists the schema sources the served engine laid out."""
    engine = Engine.from_loaded(tiny_lm)
    calls: list[str] = []
    plain_layout = engine.layout

    def counting(schema_text: str, source: str = "<schema>"):
        calls.append(source)
        return plain_layout(schema_text, source)

    engine.layout = counting
    with served_studio(engine, RunLog(tmp_path_factory.mktemp("once") / "runs.db")) as (_, port):
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=TOKEN, max_retries=0), calls


def ask(client, docs, question, system="Answer from the essays.", **kw):
    content = [{"type": "text", "text": d} for d in docs] + [{"type": "text", "text": question}]
    return client.chat.completions.create(model=MODEL, temperature=0, extra_body={"pml": {"arm": "cached"}},
                                          messages=[{"role": "system", "content": system},
                                                    {"role": "user", "content": content}], **kw)


def layouts(calls: list[str], request) -> int:
    calls.clear()
    got = request()
    if isinstance(got, openai.Stream):
        list(got)
    return len(calls)


@pytest.mark.parametrize("stream", [False, True])
def test_a_chat_request_is_compiled_and_laid_out_once(counted, stream, monkeypatch):
    client, calls = counted
    compiles: list[str] = []
    plain_compile = modes.chat_pml
    monkeypatch.setattr(modes, "chat_pml", lambda turns, how, *a, **kw: compiles.append(how) or
                        plain_compile(turns, how, *a, **kw))
    docs = [essay(f"{n}{stream}") for n in ("Ada", "Brune")]  # first sight: measured, encoded
    assert layouts(calls, lambda: ask(client, docs, "Who wrote about maps?", max_tokens=3, stream=stream)) == 1
    assert layouts(calls, lambda: ask(client, docs[::-1], "Whose rivers?", max_tokens=3, stream=stream)) == 1
    assert layouts(calls, lambda: ask(client, [], "Hello", max_tokens=2, stream=stream)) == 1  # plain
    assert calls == ["request schema"] and compiles == ["auto"] * 3


def test_a_completion_is_laid_out_once(counted):
    client, calls = counted
    prompt = modes.SEPARATOR.join([essay("Cyrus"), "Question: who wrote about maps?"])
    assert layouts(calls, lambda: client.completions.create(model=MODEL, prompt=prompt, max_tokens=2,
                                                            temperature=0)) == 1


def test_documents_placed_compactly_are_laid_out_once(counted, tiny_lm, monkeypatch):
    """Documents placed so far along their context's positions that the answer does not fit are placed from the
    context's start, decided from the tokenizer's counts: the request is compiled once and laid out once."""
    client, calls = counted
    compiled = []
    plain_compile = modes.chat_pml

    def counting(*args, **kw):
        compiled.append(plain_compile(*args, **kw))
        return compiled[-1]

    monkeypatch.setattr(modes, "chat_pml", counting)
    system = "Answer from the long essays."  # a context of its own
    limit = tiny_lm.codec.max_positions
    fill = [essay(f"Fill{i}") for i in range(4)]
    for d in fill:
        assert layouts(calls, lambda: ask(client, [d], "Who?", system=system, max_tokens=1)) == 1
    size = len(tiny_lm.codec.encode(fill[0]))
    asked = limit - (5 * size + 10) + size  # fits after the documents only when they are placed compactly
    calls.clear()
    compiled.clear()
    stream = ask(client, [essay("Last")], "Who?", system=system, max_tokens=asked, stream=True)
    next(iter(stream))  # laid out before its first token; closing the stream stops the run
    stream.close()
    assert calls == ["request schema"] and len(compiled) == 1
    assert compiled[0].spare == 0 and compiled[0].end + asked <= limit  # placed from the start: the answer fits


def test_documents_are_measured_where_the_layout_puts_them(tokenizer_bundle):
    """The tokenizer's counts give each document the positions the layout gives it, and the prompt the length and
    last position the plan gives it: line ends, markup, surrounding spaces and characters XML cannot hold
    included."""
    codec = tokenizer_bundle[2]
    reg = PositionRegistry()
    odd = ["  Lines\r\nend \r here & <there> " + essay("Dora") + "\x01 \n", essay("Emil") + "\t ", essay("Fay")]
    turns = [modes.Turn("system", (modes.Part(" Be brief.\r\n"),)),
             modes.Turn("user", (modes.Part("Earlier question"),)),
             modes.Turn("assistant", (modes.Part(""),)),
             modes.Turn("user", tuple(modes.Part(t) for t in ["Read these:\r\n ", *odd, "Which?", " & why"])),
             modes.Turn("assistant", (modes.Part("Fay."),)), modes.Turn("user", (modes.Part("Sure?"),))]
    end = codec.max_positions - codec.max_positions // modes.ROOM_SHARE
    for order in (turns, [*turns[:3], modes.Turn("user", turns[3].parts[::-1]), *turns[4:]]):
        c = modes.chat_pml(order, "auto", codec, reg)
        lay = layout(parse_schema(c.schema), codec)
        plan = plan_prompt(lay, parse_prompt(c.prompt))
        assert len(c.documents) == 3 and (c.end, c.prompt_tokens) == (plan.max_position + 1, plan.prompt_tokens)
        for name in c.documents:
            key, m = name.removeprefix("d_"), lay.modules[name]
            placed = reg.place(c.context, [(key, reg.size(key))], reg.first(c.context), end)[key]
            assert (m.start, m.end - m.start) == (placed, reg.size(key))


def test_a_completion_is_counted_as_the_plan_counts_it(tokenizer_bundle):
    codec = tokenizer_bundle[2]
    prompt = modes.SEPARATOR.join(["Context:\r\n", essay("Gil"), essay("Hana") + " \r", "Question: whose maps?  "])
    c = modes.completion_pml(prompt, "auto", codec, PositionRegistry())
    plan = plan_prompt(layout(parse_schema(c.schema), codec), parse_prompt(c.prompt))
    assert len(c.documents) == 2 and (c.end, c.prompt_tokens) == (plan.max_position + 1, plan.prompt_tokens)


def test_a_document_sent_again_is_not_tokenized_again(counted, tiny_lm, monkeypatch):
    """A document is tokenized once, where the request is compiled, and neither by its layout nor by the next
    request that sends it (the codec remembers it by its text); the answers' token counts stay the plan's."""
    client, _ = counted
    plain = tiny_lm.tokenizer.encode
    seen = spy_on_encode(monkeypatch, tiny_lm.tokenizer)
    docs = [essay("Ines"), essay("Jonas")]
    first = ask(client, docs, "Who wrote about maps?", max_tokens=2)
    again = ask(client, docs[::-1], "Whose rivers?", max_tokens=2, system="Another context.")
    for doc in docs:
        assert sum(doc in text for text in seen) == 1, doc[:20]
    assert first.pml["modules_encoded"] == 2 and again.usage.prompt_tokens > sum(len(plain(d)) for d in docs)


def test_a_front_tokenizes_a_document_once_though_it_keeps_no_positions(tiny_lm, monkeypatch):
    """A front places each request's documents with a fresh registry (it keeps nothing between requests), so it
    measured every document at every request; the codec remembers the ids: once each, and the same render."""
    from studio.api.front import render
    from studio.api.schemas import SchemaBook
    from studio.api.service import Work

    engine = Engine.from_loaded(tiny_lm)
    seen = spy_on_encode(monkeypatch, tiny_lm.tokenizer)
    docs = [essay("Karl"), essay("Lena")]
    turn = modes.Turn("user", tuple(modes.Part(t) for t in [*docs, "Who wrote about maps?"]))
    work = Work(endpoint="chat", arm="vllm", how="auto", max_tokens=2, temperature=0.0, top_p=1.0, seed=0,
                turns=(turn,))
    first, again = (render(engine, work, SchemaBook(None, remember=False), None, 100) for _ in range(2))
    assert [sum(doc in text for text in seen) for doc in docs] == [1, 1]
    assert first.token_ids == again.token_ids and len(first.compiled.documents) == 2
