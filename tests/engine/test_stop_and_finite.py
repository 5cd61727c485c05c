"""A run closed by its caller ends within a token and leaves the engine clean; a model that computes NaN is a named
error (never empty answers marked same_text); ``run --json`` is strict JSON; a hub id is refused at once, offline;
packed weights are counted as parameters (issue 37, items 8 and 9)."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from engine.arms.registry import Sampling
from engine.run.events import ArmDone, Done, FirstToken, Token, UnitEncoded
from engine import errors
from engine.errors import ModelError
from engine.model.load import load_model, load_tokenizer, resolve_model_path, wrap_model
from engine.session import Engine
from studio import files

SAMPLING = Sampling(max_new_tokens=12)


@pytest.fixture(scope="module")
def travel_docs():
    return files.load_sample("travel")


def tiny_llama(tok, tie: bool = True, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=tie, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("decode", ["together", "apart"])
def test_a_run_closed_mid_decode_leaves_the_engine_free_and_the_next_run_whole(tiny_engine, travel_docs, decode):
    """The caller pulls the comparison's events and closes the generator at the 4th token: nothing more comes, the
    run lock is free for another thread at once, and the next run is token for token the uninterrupted one."""
    schema, prompt = travel_docs
    cfg = tiny_engine.config.with_(decode=decode, arms=("baseline", "prefix", "cached"))
    whole = tiny_engine.compare(schema, prompt, SAMPLING, config=cfg)
    events = tiny_engine.events(schema, prompt, SAMPLING, config=cfg)
    tokens = []
    for event in events:
        if isinstance(event, (FirstToken, Token)):
            tokens.append(event)
            if len(tokens) == 4:
                break
    events.close()
    assert next(events, None) is None  # closed: no event after the 4th token
    if decode == "together":  # three first tokens, then the batch's first step gave the baseline its second
        assert [type(t).__name__ for t in tokens] == ["FirstToken"] * 3 + ["Token"]
    else:  # apart: the baseline decodes before the next arm starts
        assert {t.arm for t in tokens} == {"baseline"}
    free = []

    def try_lock() -> None:  # another thread (the next request) finds the engine free at once
        free.append(tiny_engine.run_lock.acquire(blocking=False))
        if free[-1]:
            tiny_engine.run_lock.release()

    other = threading.Thread(target=try_lock)
    other.start()
    other.join()
    assert free == [True]
    again = tiny_engine.compare(schema, prompt, SAMPLING, config=cfg)
    assert {a.value: r.run.token_ids for a, r in again.arms.items()} == \
        {a.value: r.run.token_ids for a, r in whole.arms.items()}


def test_a_runs_events_come_in_order_and_end_with_its_comparison(tiny_engine, travel_docs):
    schema, prompt = travel_docs
    cfg = tiny_engine.config.with_(decode="together", arms=("baseline", "prefix", "cached"))
    got = list(tiny_engine.events(schema, prompt, SAMPLING, config=cfg))
    assert isinstance(got[-1], Done) and isinstance(got[0], UnitEncoded)
    res = got[-1].comparison
    firsts = [i for i, e in enumerate(got) if isinstance(e, FirstToken)]
    done = [e for e in got if isinstance(e, ArmDone)]
    assert [got[i].arm for i in firsts] == ["baseline", "prefix", "cached"]
    assert [str(e.arm) for e in done] == ["baseline", "prefix", "cached"] and done[1].result == res.arm("prefix")
    for arm, r in res.arms.items():  # a FirstToken, then a Token per further token, the last one its text
        mine = [e for e in got if isinstance(e, (FirstToken, Token)) and e.arm == arm]
        assert [e.token_id for e in mine] == list(r.run.token_ids) and mine[-1].text == r.run.text
        assert "".join(e.text if isinstance(e, FirstToken) else e.delta for e in mine) == r.run.text
        assert mine[0].ttft_ms == r.run.ttft_ms
    assert max(firsts) < min(i for i, e in enumerate(got) if isinstance(e, Token))  # decoded together


def test_a_run_closed_before_it_starts_computes_nothing(tiny_engine, travel_docs, monkeypatch):
    from engine import session

    schema, prompt = travel_docs
    started = []
    monkeypatch.setattr(session, "encoding", lambda *a, **k: started.append(a))
    events = tiny_engine.events(schema, prompt, SAMPLING)
    events.close()
    assert next(events, None) is None and started == []
    assert tiny_engine.run_lock.acquire(blocking=False)
    tiny_engine.run_lock.release()


def test_a_model_that_computes_nan_is_refused_at_load(tokenizer_bundle):
    model = tiny_llama(tokenizer_bundle[1])
    with torch.no_grad():
        model.model.norm.weight[0] = float("nan")  # a checkpoint with one NaN
    with pytest.raises(errors.NonFiniteLogits, match="non-finite logits"):
        wrap_model(model, tokenizer_bundle[1], "nan-llama")


def test_logits_that_turn_nan_are_a_named_error_not_an_empty_answer(tokenizer_bundle, travel_docs):
    """A rope that overflows past the load's 4-token check (here: its frequencies made NaN after load) reaches the
    runs: the first token's NaN logits are an error naming the arm, never a text marked same_text."""
    lm = wrap_model(tiny_llama(tokenizer_bundle[1]), tokenizer_bundle[1], "rope-nan-llama")
    rope = lm.model.model.rotary_emb
    rope.inv_freq.fill_(float("nan"))
    engine = Engine.from_loaded(lm)
    with pytest.raises(errors.NonFiniteLogits, match=r"at the first token of the \w+ arm.*rope"):
        engine.compare(*travel_docs, SAMPLING)


def test_run_json_writes_non_finite_numbers_as_null(monkeypatch, tmp_path, capsys):
    """`run --json` is read by strict parsers: a NaN or infinite figure is null, never bare NaN."""
    from engine import cli, session

    doc = {"model": "m", "store_stats": {}, "first_token_kl": float("nan"),
           "cached": {"ttft_ms": float("inf"), "x": [1.0, float("-inf")]}}

    class Fake:
        lm = None  # the CLI loads the model before the run, to say how long that took
        loaded = True

        def __init__(self, config):
            pass

        def events(self, *args, **kwargs):  # the run's events: none, then its result
            yield from ()
            return type("Result", (), {"to_json": lambda self: doc})()

    monkeypatch.setattr(session, "Engine", Fake)
    schema, prompt = tmp_path / "s.xml", tmp_path / "p.xml"
    schema.write_text("<schema name='s'>x</schema>")
    prompt.write_text("<prompt schema='s'>y</prompt>")
    assert cli.main(["run", str(schema), str(prompt), "--json", "--no-persist"]) == 0
    out = capsys.readouterr().out

    def refuse(name):
        raise AssertionError(f"bare {name} in the JSON")

    data = json.loads(out, parse_constant=refuse)
    assert data == {"model": "m", "store_stats": {}, "first_token_kl": None,
                    "cached": {"ttft_ms": None, "x": [1.0, None]}}


def test_a_hub_id_is_refused_at_once_and_nothing_asks_a_hub(monkeypatch):
    import transformers

    def asked(*args, **kwargs):
        pytest.fail(f"transformers was asked for {args[:1]}")

    monkeypatch.setattr(transformers.PreTrainedConfig, "get_config_dict", asked)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", asked)
    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", asked)
    for call in (resolve_model_path, load_tokenizer, load_model):
        with pytest.raises(ModelError, match=r"no model 'org/name': not a packaged model.*offline"):
            call("org/name")


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("tie", [True, False])
def test_packed_weights_are_counted_as_parameters(tokenizer_bundle, tmp_path, kind, tie, monkeypatch):
    """A model loaded with --weights int8 / int4 has the parameter count of the same model in fp32 (its packed
    layers keep their weights as buffers, which torch's parameters() leaves out), and every load reads local
    files only."""
    import transformers

    tok = tokenizer_bundle[1]
    model = tiny_llama(tok, tie=tie)
    expected = sum(p.numel() for p in model.parameters())  # transformers' own count of the fp32 model
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    seen = []
    real = transformers.AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        seen.append(kwargs.get("local_files_only"))
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    fp32 = load_model(str(folder))
    packed = load_model(str(folder), weights=kind)
    assert packed.weights == kind and packed.weight_bytes < fp32.weight_bytes
    assert packed.n_params == fp32.n_params == expected
    assert packed.info()["parameters"] == expected
    assert seen == [True, True]


def test_compile_of_a_directory_says_it_is_one(tmp_path, capsys):
    from engine import cli

    assert cli.main(["compile", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path) in err and ("folder" in err or "directory" in err) and "no such file" not in err
