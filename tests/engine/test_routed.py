"""The routed arm (issue 27: the question picks the modules it reads) on tiny random-weight models (seconds).

The exactness end: every module kept is the modular run bit for bit. Otherwise what the scout measures and
what a routed run computes are checked against stock transformers (eager attention weights, a DynamicCache
holding only the kept modules), never against the engine's own numbers.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest
import torch
import transformers as T
from test_repair import TURNS
from test_repair import TURNS_PROMPT as PROMPT  # system text, then modules d1, d2, d3 in two user turns
from transformers.cache_utils import DynamicCache

from tests.arm_runs import run_cached
from engine.arms.registry import REGISTRY, Sampling
from engine.arms.routed import PATHS, RoutedInfo, RoutedSettings, Scouted, choose
from tests.arm_runs import run_routed
from engine.config import Compression, RunConfig
from engine.errors import EngineError
from engine.model.load import wrap_model
from engine.schema.layout import ANONYMOUS
from engine.schema.plan import CACHED
from engine.session import Engine
from studio.arm_views import view_of


class Tiny:
    """A 4-layer random Qwen2: the engine around one copy, stock transformers (eager attention) on another."""

    def __init__(self, tokenizer, mode: str = "prefixed"):
        torch.manual_seed(0)
        cfg = T.Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
        self.stock = T.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
        model = copy.deepcopy(self.stock)
        model.set_attn_implementation("sdpa")
        self.lm = wrap_model(model, tokenizer, "tiny-qwen2", fingerprint="routed-qwen2")
        self.eng = Engine.from_loaded(self.lm)
        self.lay = self.eng.layout(TURNS)
        self.plan = self.eng.plan(self.lay, PROMPT, max_new_tokens=4)
        self.enc = self.eng.encode(self.lay, self.eng.config.with_(mode=mode)).encoded
        self.store = self.eng.store()

    def cached_parts(self, keep=None) -> tuple[torch.Tensor, list]:
        """The stored KV of the cached segments in prompt order, those of modules outside ``keep`` left out
        (keep None: all), as [layers, 2, kv_heads, tokens, head_dim], and each token's owner."""
        parts, owners = [], []
        for s in self.plan.segments:
            if s.kind != CACHED:
                continue
            owner = None if s.owner == ANONYMOUS else self.lay.modules[s.owner].top
            if keep is not None and owner is not None and owner not in keep:
                continue
            key, off = self.enc.locate(s.piece, s.scaffold)
            parts.append(self.store.get(key).kv[:, :, :, off + s.offset: off + s.offset + len(s)])
            owners += [owner] * len(s)
        return torch.cat(parts, dim=3), owners

    def stock_prefill(self, keep=None, attentions: bool = False):
        kv, _ = self.cached_parts(keep)
        cache = DynamicCache(ddp_cache_data=[(kv[i, 0][None], kv[i, 1][None]) for i in range(kv.shape[0])])
        ids, pos = self.plan.uncached()
        with torch.inference_mode():
            return self.stock(input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos]), past_key_values=cache,
                              use_cache=True, output_attentions=attentions)


@pytest.fixture(scope="module")
def tiny(tokenizer_bundle):
    return Tiny(tokenizer_bundle[1])


@pytest.fixture(autouse=True)
def route_any_pull(monkeypatch):
    """A random model's attention is flat: no pull reaches MIN_PULL, so these tests of the routing itself route at
    any pull (the threshold has its own test)."""
    from engine.arms import routed

    monkeypatch.setattr(routed, "MIN_PULL", 0.0)
    monkeypatch.setattr(routed, "FOCUS_MARGIN", 0.0)  # the same for the decode-time focus


def test_every_module_kept_is_the_modular_run_bit_for_bit(tiny):
    cached = run_cached(tiny.lm, tiny.plan, tiny.enc, tiny.store, Sampling(4))
    routed, info = run_routed(tiny.lm, tiny.plan, tiny.enc, tiny.store, Sampling(4), k=3, joint="off")
    assert info.kept == ("d1", "d2", "d3") and sum(info.attention.values()) == pytest.approx(1.0)
    assert torch.equal(routed.first_logits, cached.first_logits) and routed.token_ids == cached.token_ids
    assert routed.reused_tokens == cached.reused_tokens == tiny.plan.cached_tokens
    # a threshold above every pull: the question points nowhere, every module stays
    again, info = run_routed(tiny.lm, tiny.plan, tiny.enc, tiny.store, Sampling(4), min_pull=1.0, joint="off")
    assert info.kept == ("d1", "d2", "d3") and torch.equal(again.first_logits, cached.first_logits)


def test_a_question_that_points_at_no_module_keeps_them_all(tiny, monkeypatch):
    """Under MIN_PULL (a greeting on the real model) nothing is routed out: read as stored (joint off), the modular
    run bit for bit; with the threshold at 0 the same prompt is routed."""
    from engine.arms import routed

    cached = run_cached(tiny.lm, tiny.plan, tiny.enc, tiny.store, Sampling(3))
    monkeypatch.setattr(routed, "MIN_PULL", 1.01)  # above any attention weight
    run, info = run_routed(tiny.lm, tiny.plan, tiny.enc, tiny.store, Sampling(3), k=1, joint="off")
    assert info.kept == ("d1", "d2", "d3") and max(info.pull.values()) < 1.01
    assert torch.equal(run.first_logits, cached.first_logits) and run.token_ids == cached.token_ids
    monkeypatch.setattr(routed, "MIN_PULL", 0.0)
    assert len(run_routed(tiny.lm, tiny.plan, tiny.enc, tiny.store, Sampling(3), k=1)[1].kept) == 1


def test_the_scout_measures_each_modules_pull_as_eager_attention_does(tiny):
    """A module's pull is the strongest attention any head of any uncached token pays one of its keys, at the
    scout layers; computed here from stock transformers' eager attention weights."""
    layers = (1, 2)
    _, info = run_routed(tiny.lm, tiny.plan, tiny.enc, tiny.store, Sampling(2), k=1, layers=layers)
    out = tiny.stock_prefill(attentions=True)
    _, owners = tiny.cached_parts()
    pull = {m: 0.0 for m in ("d1", "d2", "d3")}
    for layer in layers:
        per_key = out.attentions[layer][0].amax(dim=(0, 1))  # over heads and queries: [keys]
        for i, owner in enumerate(owners):
            if owner is not None:
                pull[owner] = max(pull[owner], float(per_key[i]))
    total = sum(pull.values())
    assert info.layers == layers
    for m, share in info.attention.items():
        assert share == pytest.approx(pull[m] / total, abs=1e-5)
    assert info.kept == (max(pull, key=pull.get),)


@pytest.mark.parametrize("keep", [{"d2"}, {"d1", "d3"}, set()])
def test_a_routed_out_module_is_invisible_to_the_prefill_and_the_decode(tiny, keep):
    """Routing to ``keep`` gives what stock transformers gives over a cache holding only the system text and
    the kept modules: the first token's logits, and every greedy token after it."""
    run, info = run_routed(tiny.lm, tiny.plan, tiny.enc, tiny.store, Sampling(4), keep=keep)
    assert set(info.kept) == keep and info.attention == {}
    out = tiny.stock_prefill(keep)
    torch.testing.assert_close(run.first_logits, out.logits[0, -1].float(), atol=1e-5, rtol=1e-5)
    tokens, cache, nxt = [int(out.logits[0, -1].argmax())], out.past_key_values, tiny.plan.max_position + 1
    with torch.inference_mode():
        while len(tokens) < 4:
            step = tiny.stock(input_ids=torch.tensor([[tokens[-1]]]), position_ids=torch.tensor([[nxt]]),
                              past_key_values=cache, use_cache=True)
            tokens.append(int(step.logits[0, -1].argmax()))
            nxt += 1
    assert list(run.token_ids) == tokens[: len(run.token_ids)]
    kept_tokens = tiny.cached_parts(keep)[0].shape[3]
    assert run.reused_tokens == kept_tokens < tiny.plan.cached_tokens


def _scouted(weights) -> Scouted:
    pull = torch.tensor([weights], dtype=torch.float32)
    return Scouted(tuple(f"m{i}" for i in range(len(weights))), (0,), pull, pull, torch.zeros(1))


def test_choose_keeps_the_modules_the_question_pulls_or_the_top_k_or_all():
    seen = _scouted([0.1, 0.97, 0.5, 0.99])
    assert choose(seen, 0, 0.95) == ("m1", "m3")  # every module reaching the threshold, in prompt order
    assert choose(seen, 0, 0.98) == ("m3",)
    assert choose(seen, 1, 0.95) == ("m3",)
    assert choose(seen, 3, 0.95) == ("m1", "m2", "m3")
    assert choose(seen, 0, 0.995) == ("m0", "m1", "m2", "m3")  # the question points nowhere: all stay
    assert choose(seen, 2, 0.995) == ("m0", "m1", "m2", "m3")
    assert choose(_scouted([0.96, 0.96, 0.4]), 1, 0.95) == ("m0",)  # a tie keeps the earlier module


def test_settings_are_checked_where_made_and_refuse_question_retention(tiny):
    with pytest.raises(EngineError, match="route_k"):
        RoutedSettings(k=-1)
    with pytest.raises(EngineError, match="route_min_pull"):
        RoutedSettings(min_pull=1.5)
    with pytest.raises(EngineError, match="routing and question-aware retention"):
        RunConfig(arms=("cached", "routed"), compression=Compression(0.5, "question"))
    assert RunConfig(arms=("cached", "routed"), compression=Compression(0.5, "pyramid")).arms[-1] == "routed"


def test_the_routed_arm_runs_in_a_comparison_and_its_choice_survives_the_json(tiny):
    assert "routed" in REGISTRY and REGISTRY["routed"].detail is RoutedInfo
    schema, prompt = TURNS, PROMPT
    c = tiny.eng.compare(schema, prompt, Sampling(3),
                         config=tiny.eng.config.with_(arms=("baseline", "cached", "routed"), route_k=2,
                                                      route_min_pull=0.0))
    doc = json.loads(json.dumps(c.to_json()))
    assert doc["arms"] == ["baseline", "cached", "routed"]
    routed = doc["routed"]
    assert routed["route_k"] == 2 and len(routed["route_kept"]) == 2
    assert set(routed["route_attention"]) == {"d1", "d2", "d3"} and routed["scout_ms"] > 0
    assert routed["ttft_ms"] >= routed["scout_ms"]
    from engine.arms.compare import Comparison

    back = Comparison.from_json(doc).arm("routed").detail
    assert back.kept == tuple(routed["route_kept"]) and view_of("routed").chips(back)[0].startswith("read ")


def test_the_routed_decision_is_a_typed_routing_on_the_arms_result(tiny):
    """What the API, the Compare tab and the benchmarks read: kept, dropped, recomputed and path, live and read
    back from the JSON; an arm that does not route has none."""
    from engine.arms.compare import Comparison
    from engine.run.types import Routing

    c = tiny.eng.compare(TURNS, PROMPT, Sampling(2), config=tiny.eng.config.with_(arms=("baseline", "cached", "routed"),
                                                                                   route_k=1, route_min_pull=0.0))
    routing = c.arm("routed").routing
    assert isinstance(routing, Routing) and routing is c.arm("routed").detail
    assert len(routing.kept) == 1 and set(routing.kept) | set(routing.dropped) == {"d1", "d2", "d3"}
    assert routing.path in PATHS and routing.recomputed == c.arm("routed").run.recomputed_tokens
    assert c.arm("cached").routing is None and c.arm("baseline").routing is None
    back = Comparison.from_json(json.loads(json.dumps(c.to_json()))).arm("routed").routing
    assert (back.kept, back.dropped, back.recomputed, back.path) == (routing.kept, routing.dropped,
                                                                     routing.recomputed, routing.path)


def test_the_studio_greys_the_modules_routed_out_and_bars_each_modules_share(tiny):
    from studio import views

    c = tiny.eng.compare(TURNS, PROMPT, Sampling(2), config=tiny.eng.config.with_(arms=("baseline", "routed"),
                                                                                   route_k=1, route_min_pull=0.0))
    info = c.arm("routed").detail
    (kept,) = info.kept
    marks = views.token_marks(c)
    hidden = {p for s in c.plan.segments if s.kind == CACHED and s.owner not in (ANONYMOUS, kept) for p in s.positions}
    assert marks == {"routed-out": hidden} and len(hidden) > 0
    page = views.token_view_html(c.plan, tiny.lm.tokenizer.decode, marks)
    assert page.count('class="tok tok-routed-out"') == len(hidden) + 1  # each token, and its legend entry
    bars = views.metrics_html(c, "routed")
    assert bars.count('<div class="pml-bar"') == 2 and bars.count('<div class="pml-bar on"') == 1
    assert f'title="{kept}: {info.attention[kept] * 100:.1f} %"' in bars


def test_focus_masks_the_other_kept_modules_once_the_answer_names_one():
    """A decode step whose token is a trigger of module 1 focuses it: module 0's keys are masked in every layer
    from then on; text of no module and the new keys stay visible; the prefill is never focused."""
    from engine.model.attend import Focus

    focus = Focus(torch.tensor([-1, 0, 0, 1, 1]), {7: 1, 9: 0})
    focus.saw(torch.tensor([[3, 7, 5]]))  # the prefill: not a step
    assert focus.focus is None and focus.restrict(0, 3, 6, None, "cpu") is None
    focus.saw(torch.tensor([[5]]))
    assert focus.focus is None and focus.restrict(0, 1, 6, None, "cpu") is None
    focus.saw(torch.tensor([[7]]))
    assert focus.focus == 1 and focus.changes == [(2, 1)]
    assert focus.restrict(0, 1, 6, None, "cpu")[0, 0, 0].tolist() == [True, False, False, True, True, True]
    causal = torch.ones(1, 1, 1, 6, dtype=torch.bool)
    causal[..., 0] = False
    assert focus.restrict(5, 1, 6, causal, "cpu")[0, 0, 0].tolist() == [False, False, False, True, True, True]
    focus.saw(torch.tensor([[9]]))
    assert focus.changes == [(2, 1), (3, 0)]


def test_a_clause_focus_ends_when_the_answer_ends_the_clause():
    """With clause ends (token 4), the focus a trigger set lasts until the answer writes an end: then every kept
    module is visible again (recorded as -1) until the next trigger; an end with no focus changes nothing."""
    from engine.model.attend import Focus

    focus = Focus(torch.tensor([-1, 0, 0, 1, 1]), {7: 1, 9: 0}, frozenset({4}))
    for token in (4, 7, 5, 4, 5, 9):
        focus.saw(torch.tensor([[token]]))
    assert focus.changes == [(2, 1), (4, -1), (6, 0)] and focus.focus == 0
    focus.saw(torch.tensor([[4]]))
    assert focus.focus is None and focus.restrict(0, 1, 6, None, "cpu") is None
    again = focus.fresh(torch.tensor([1, 1, 0, 0, -1]))  # a repeat's copy: no step seen, owners as given
    assert (again.focus, again.step, again.changes, again.triggers, again.ends) == (None, 0, [], {7: 1, 9: 0}, {4})
    assert again.owners.tolist() == [1, 1, 0, 0, -1] and focus.fresh().owners is focus.owners


def test_triggers_are_the_question_tokens_that_name_one_kept_module(monkeypatch):
    from engine.arms import routed

    monkeypatch.setattr(routed, "FOCUS_MARGIN", 0.2)
    by_token = torch.tensor([[0.99, 0.10, 0.0],   # token 11 names m0
                             [0.97, 0.96, 0.0],   # token 12 pulls m0 and m1 alike: names none
                             [0.20, 0.98, 0.5],   # token 13 names m1
                             [0.50, 0.60, 0.99],  # token 14 names m2, which was not kept
                             [0.10, 0.99, 0.0],   # token 11 again, now naming m1: a clash, dropped
                             [0.80, 0.10, 0.0]])  # under the threshold
    seen = Scouted(("m0", "m1", "m2"), (0,), torch.zeros(1, 3), torch.zeros(1, 3), torch.zeros(1), by_token)
    from engine.arms.routed import triggers

    got = triggers(seen, [11, 12, 13, 14, 11, 16], ("m0", "m1"), 0.95)
    assert got == {13: 1}


def test_focus_changes_nothing_when_one_module_or_every_module_is_kept(tiny):
    for keep in ({"d2"}, {"d1", "d2", "d3"}):
        on, info = run_routed(tiny.lm, tiny.plan, tiny.enc, tiny.store, Sampling(5), keep=keep, focus="on", joint="off")
        off, _ = run_routed(tiny.lm, tiny.plan, tiny.enc, tiny.store, Sampling(5), keep=keep, focus="off", joint="off")
        assert on.token_ids == off.token_ids and torch.equal(on.first_logits, off.first_logits) and not info.moves


def test_focus_with_two_modules_kept_reads_one_at_a_time(tiny):
    """Two modules kept by scouting (top 2; every question token a trigger of the module it pulls hardest, at a
    threshold of 0): the first token is the unfocused run's; each move is to a kept module; the moves survive
    the JSON."""
    on, info = run_routed(tiny.lm, tiny.plan, tiny.enc, tiny.store, Sampling(8), k=2, focus="on", joint="off")
    off, _ = run_routed(tiny.lm, tiny.plan, tiny.enc, tiny.store, Sampling(8), k=2, focus="off", joint="off")
    assert len(info.kept) == 2 and torch.equal(on.first_logits, off.first_logits)
    assert {m for _, m in info.moves} <= set(info.kept)
    back = RoutedInfo.from_json(json.loads(json.dumps(info.to_json())))
    assert back.moves == info.moves and back.focus == "on"


# One user turn of three modules with no text between them: every module's tokens follow the system text and
# each other, so a joint prefill of some of them is stock transformers' causal prefill over the system text's KV.
FLAT = """<schema name="flat">
  <system>You answer questions about the documents.</system>
  <user><module name="d1">{0}</module><module name="d2">{1}</module><module name="d3">{2}</module></user>
</schema>""".format(*__import__("test_repair").DOCS)
FLAT_PROMPT = "<prompt schema='flat'><d1/><d2/><d3/> Which animal jumps?</prompt>"


@pytest.fixture(scope="module")
def flat(tokenizer_bundle):
    t = Tiny(tokenizer_bundle[1])
    t.lay = t.eng.layout(FLAT)
    t.plan = t.eng.plan(t.lay, FLAT_PROMPT, max_new_tokens=4)
    t.enc = t.eng.encode(t.lay, t.eng.config.with_(mode="prefixed")).encoded
    owners = [s.owner for s in t.plan.segments if s.kind == CACHED]
    first = next(i for i, o in enumerate(owners) if o != ANONYMOUS)
    assert first > 0 and ANONYMOUS not in owners[first:]  # system text, then modules only
    return t


def stock_joint(t: Tiny, together: set[str]):
    """Stock transformers: the system text's stored KV as the cache, then the tokens of the modules ``together``
    and the uncached tokens prefilled in prompt order at their own positions (the others left out)."""
    kv, _ = t.cached_parts(keep=set())  # the anonymous text only
    cache = DynamicCache(ddp_cache_data=[(kv[i, 0][None], kv[i, 1][None]) for i in range(kv.shape[0])])
    ids, pos = [], []
    for s in t.plan.segments:
        module = t.lay.modules[s.owner].top if s.owner != ANONYMOUS else None
        if s.kind != CACHED or module in together:
            ids += list(s.token_ids)
            pos += list(s.positions)
    with torch.inference_mode():
        return t.stock(input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos]), past_key_values=cache,
                       use_cache=True)


@pytest.mark.parametrize("k", [2, 0])  # the 2 strongest; every module (all reach a threshold of 0)
def test_modules_that_reach_the_threshold_are_prefilled_together(flat, k):
    run, info = run_routed(flat.lm, flat.plan, flat.enc, flat.store, Sampling(4), k=k, share=1.0)
    assert len(info.kept) == (k or 3) and info.joint == info.kept and not info.moves and info.path == "full"
    out = stock_joint(flat, set(info.kept))
    torch.testing.assert_close(run.first_logits, out.logits[0, -1].float(), atol=1e-4, rtol=1e-4)
    module_tokens = sum(len(s) for s in flat.plan.segments if s.kind == CACHED and s.owner != ANONYMOUS
                        and flat.lay.modules[s.owner].top in info.kept)
    assert run.recomputed_tokens == module_tokens and run.prefill_tokens == module_tokens + flat.plan.uncached_tokens
    assert run.reused_tokens == flat.cached_parts(keep=set())[0].shape[3]  # the system text alone
    if k == 0:  # every module prefilled together after the exact system prefix: the full prefill
        from tests.arm_runs import run_baseline

        base = run_baseline(flat.lm, flat.plan, Sampling(4))
        torch.testing.assert_close(run.first_logits, base.first_logits, atol=1e-4, rtol=1e-4)
        assert run.token_ids == base.token_ids


def test_one_module_is_read_as_stored_and_a_question_that_points_nowhere_is_the_full_prefill(flat, monkeypatch):
    from engine.arms import routed
    from tests.arm_runs import run_baseline

    one, info = run_routed(flat.lm, flat.plan, flat.enc, flat.store, Sampling(3), k=1)
    assert info.joint == () and one.recomputed_tokens == 0 and info.path == "stored"
    monkeypatch.setattr(routed, "MIN_PULL", 1.01)  # nothing reaches it: every module kept, all recomputed together
    nowhere, info = run_routed(flat.lm, flat.plan, flat.enc, flat.store, Sampling(3), share=1.0)
    assert info.kept == info.joint == ("d1", "d2", "d3") and "no module reached" in view_of("routed").chips(info)[0]
    base = run_baseline(flat.lm, flat.plan, Sampling(3))
    torch.testing.assert_close(nowhere.first_logits, base.first_logits, atol=1e-4, rtol=1e-4)
    cached = run_cached(flat.lm, flat.plan, flat.enc, flat.store, Sampling(3))
    stored, info = run_routed(flat.lm, flat.plan, flat.enc, flat.store, Sampling(3), joint="off")
    assert info.joint == () and torch.equal(stored.first_logits, cached.first_logits)  # joint off: the modular run


def test_the_joint_recompute_is_said_and_survives_the_json(flat):
    c = flat.eng.compare(FLAT, FLAT_PROMPT, Sampling(3), config=flat.eng.config.with_(
        arms=("baseline", "routed"), route_k=2, route_min_pull=0.0, route_joint="on"))
    doc = json.loads(json.dumps(c.to_json()))
    assert len(doc["routed"]["route_joint"]) == 2 and doc["routed"]["recomputed_tokens"] > 0
    back = RoutedInfo.from_json(doc["routed"])
    assert back.joint == tuple(doc["routed"]["route_joint"]) and "recomputed together" in view_of("routed").chips(back)[0]
    off = flat.eng.compare(FLAT, FLAT_PROMPT, Sampling(3), config=flat.eng.config.with_(
        arms=("baseline", "routed"), route_k=2, route_min_pull=0.0, route_joint="off"))
    assert off.to_json()["routed"]["route_joint"] == [] and off.to_json()["routed"]["recomputed_tokens"] == 0


# Selective recompute (issue 47): the share of the kept modules' tokens the question attends to most, plus each
# module's first tokens; checked against stock transformers walking the prompt in order, where each stored token's
# KV is appended to the cache as stored and each recomputed or new token is prefilled over everything before it.

def stock_partial(t: Tiny, redo: set[int]):
    """Stock transformers over the prompt in rank order: ranks ``redo`` and the uncached tokens prefilled over
    the cache so far, every other cached token's stored KV appended as it is."""
    cache, rank, out, ids, pos = DynamicCache(), 0, None, [], []

    def run():
        nonlocal out, ids, pos
        if ids:
            with torch.inference_mode():
                out = t.stock(input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos]), past_key_values=cache,
                              use_cache=True)
        ids, pos = [], []

    for s in t.plan.segments:
        key, off = t.enc.locate(s.piece, s.scaffold) if s.kind == CACHED else (None, 0)
        for i, (tok, p) in enumerate(zip(s.token_ids, s.positions)):
            if s.kind != CACHED or rank + i in redo:
                ids.append(tok)
                pos.append(p)
                continue
            run()
            kv = t.store.get(key).kv[:, :, :, off + s.offset + i: off + s.offset + i + 1]
            for layer in range(kv.shape[0]):
                cache.update(kv[layer, 0][None], kv[layer, 1][None], layer)
        rank += len(s)
    run()
    return out


def module_tokens(t: Tiny, kept) -> int:
    return sum(len(s) for s in t.plan.segments if s.kind == CACHED and s.owner != ANONYMOUS
               and t.lay.modules[s.owner].top in kept)


@pytest.mark.parametrize("share,sinks", [(0.3, 2), (0.1, 0), (0.0, 3)])
def test_a_partial_recompute_is_stock_transformers_reading_the_rest_as_stored(flat, monkeypatch, share, sinks):
    from engine.arms import routed
    from engine.run.joint import module_ranks, select_tokens

    picked: list = []
    monkeypatch.setattr(routed, "select_tokens", lambda *a: picked.append(select_tokens(*a)) or picked[-1])
    run, info = run_routed(flat.lm, flat.plan, flat.enc, flat.store, Sampling(3), share=share, sinks=sinks)
    assert info.kept == ("d1", "d2", "d3") and info.path == "partial"
    redo = set(picked[0])
    per = module_ranks(flat.plan, {"d1", "d2", "d3"})
    assert all(set(rs[:sinks]) <= redo and redo & set(rs) for rs in per.values())  # sinks, and every module
    n = module_tokens(flat, info.kept)
    assert len(redo) == run.recomputed_tokens == info.recomputed and len(redo) - 3 * sinks <= round(share * n)
    assert run.reused_tokens == flat.plan.cached_tokens - len(redo)
    out = stock_partial(flat, redo)
    torch.testing.assert_close(run.first_logits, out.logits[0, -1].float(), atol=1e-4, rtol=1e-4)


def test_a_recompute_of_everything_is_the_full_prefill_and_of_nothing_the_modular_run(flat):
    from tests.arm_runs import run_baseline

    full, info = run_routed(flat.lm, flat.plan, flat.enc, flat.store, Sampling(4), share=1.0, sinks=0)
    base = run_baseline(flat.lm, flat.plan, Sampling(4))
    assert info.path == "full" and info.recomputed == module_tokens(flat, info.kept)
    torch.testing.assert_close(full.first_logits, base.first_logits, atol=1e-4, rtol=1e-4)
    assert full.token_ids == base.token_ids
    none, info = run_routed(flat.lm, flat.plan, flat.enc, flat.store, Sampling(4), share=0.0, sinks=0)
    cached = run_cached(flat.lm, flat.plan, flat.enc, flat.store, Sampling(4))
    assert info.path == "stored" and info.recomputed == 0 and info.joint == ()
    assert torch.equal(none.first_logits, cached.first_logits) and none.token_ids == cached.token_ids


def test_select_tokens_takes_sinks_then_each_modules_share_then_the_strongest(monkeypatch):
    """Hand-made scores over a plan of two modules of 10 tokens: the rule, computed by hand, with and without the cap
    on the share of all module tokens."""
    from types import SimpleNamespace

    from engine.run import joint
    from engine.run.joint import select_tokens

    from engine.schema.plan import PromptPlan

    class Seg(SimpleNamespace):
        def __len__(self):
            return self.n

    segments = (Seg(kind=CACHED, owner=ANONYMOUS, scaffold=None, n=2), Seg(kind=CACHED, owner="a", scaffold=None,
                n=10), Seg(kind=CACHED, owner="b", scaffold=None, n=10), Seg(kind="new", owner=ANONYMOUS,
                                                                             scaffold=None, n=3))
    plan = PromptPlan(layout=SimpleNamespace(modules={"a": SimpleNamespace(top="a"), "b": SimpleNamespace(top="b")}),
                      prompt=None, imported=(), arguments=(), scaffolds=(), segments=segments)
    score = torch.zeros(22)
    score[2:12] = torch.arange(10, dtype=torch.float32)  # module a: later tokens score higher
    score[12:22] = torch.arange(10, dtype=torch.float32) / 100  # module b: far weaker
    sinks = {2, 12}
    # both modules kept, so the cap (0.2 of the 20 module tokens = 4) binds: a quota of 1 each, then the 2 strongest
    assert set(select_tokens(plan, score, ("a", "b"), 0.4, 1)) == sinks | {11, 21} | {10, 9}
    # uncapped, share 0.4 of 20 tokens = 8: each module's half-share quota (2 each, by score), then the 4 strongest
    monkeypatch.setattr(joint, "PROMPT_CAP", 1.0)
    assert set(select_tokens(plan, score, ("a", "b"), 0.4, 1)) == sinks | {10, 11, 20, 21} | {9, 8, 7, 6}
    assert select_tokens(plan, None, ("a", "b"), 0.4, 1) is None  # no score per token: the caller recomputes all
    assert set(select_tokens(plan, score, ("a", "b"), 1.0, 0)) == set(range(2, 22))


def test_an_identical_request_reads_its_stored_run_back_and_is_never_slower_than_the_prefix_arm(flat, monkeypatch):
    """The second identical request reads the first's KV from the prefix tree, every token of it, and samples the
    first run's own first logits: it prefills nothing (the prefix arm prefills the last token), answers the same and
    reports the whole prompt as cached. A run kept without its logits prefills the last token again."""
    from engine.arms import routed

    monkeypatch.setattr(routed, "MIN_PULL", 1.01)  # every module kept: a partial recompute
    eng = Engine.from_loaded(flat.lm)
    cfg = eng.config.with_(arms=("routed",), warmup=False)
    first = eng.compare(FLAT, FLAT_PROMPT, Sampling(4), config=cfg)
    again = eng.compare(FLAT, FLAT_PROMPT, Sampling(4), config=cfg)
    a, b = first.arm("routed"), again.arm("routed")
    assert a.detail.path == "partial" and b.detail.path == "repeat" and b.detail.kept == a.detail.kept
    n = flat.plan.prompt_tokens
    assert b.run.prefill_tokens == 0 and b.run.reused_tokens == b.detail.repeat_tokens == n
    assert b.run.recomputed_tokens == 0 and b.detail.scout_ms == 0 and b.run.prefill_ms < a.run.prefill_ms
    assert torch.equal(b.run.first_logits, a.run.first_logits) and b.run.token_ids == a.run.token_ids
    doc = json.loads(json.dumps(again.to_json()))["routed"]
    assert doc["route_path"] == "repeat" and RoutedInfo.from_json(doc).repeat_tokens == n
    from studio.api.usage import cached_tokens

    assert cached_tokens(again, "routed") == n
    pcfg = eng.config.with_(arms=("prefix",), warmup=False)
    eng.compare(FLAT, FLAT_PROMPT, Sampling(4), config=pcfg)
    prefix = eng.compare(FLAT, FLAT_PROMPT, Sampling(4), config=pcfg).arm("prefix").run
    assert prefix.prefill_tokens == 1 and prefix.reused_tokens == n - 1  # the prefix arm's repeat: one token more
    cache = eng.prefix_cache()
    for key, kept in list(cache._notes.items()):  # as kept before first logits were stored
        cache._notes[key] = replace(kept, logits=None)
    old = eng.compare(FLAT, FLAT_PROMPT, Sampling(4), config=cfg).arm("routed")  # its logits computed again
    assert old.detail.path == "repeat" and old.run.prefill_tokens == 1 and old.run.reused_tokens == n - 1
    torch.testing.assert_close(old.run.first_logits, a.run.first_logits, atol=1e-4, rtol=1e-4)
    assert old.run.token_ids == a.run.token_ids


def test_a_repeat_decodes_over_its_kv_in_the_first_runs_order_so_every_step_has_the_same_logits(flat, monkeypatch):
    """A partial recompute's buffer holds the copies first and the recomputed tokens after them; the repeat reads the
    run back in that order, not the prompt's, so each decode step sums attention as the first run did: bit-equal
    logits, where prompt order flipped a near-tie of the default model (bench/load.py, 8 clients)."""
    from engine.arms import routed
    from engine.run import decode, joint
    from engine.run.sampling import sample

    monkeypatch.setattr(routed, "MIN_PULL", 1.01)  # every module kept: a partial recompute
    steps: list[torch.Tensor] = []

    def recorded(logits, *args, **kwargs):
        steps.append(logits.clone())
        return sample(logits, *args, **kwargs)

    monkeypatch.setattr(decode, "sample", recorded)
    eng = Engine.from_loaded(flat.lm)
    cfg = eng.config.with_(arms=("routed",), warmup=False, route_share=0.4)
    first = eng.compare(FLAT, FLAT_PROMPT, Sampling(8), config=cfg).arm("routed")
    ran, steps[:] = list(steps), []
    again = eng.compare(FLAT, FLAT_PROMPT, Sampling(8), config=cfg).arm("routed")
    assert first.detail.path == "partial" and first.run.recomputed_tokens < flat.plan.cached_tokens
    assert again.detail.path == "repeat" and len(steps) == len(ran) == 7
    assert all(torch.equal(a, b) for a, b in zip(ran, steps))
    stored = next(iter(eng.prefix_cache()._notes.values()))
    where = [(code >> joint._POSITION_SHIFT) - 1 for code in stored.sequence[1:]]
    assert where != sorted(where)  # the copies before the recomputed tokens: not the prompt's order


def test_a_clause_focus_on_a_partial_recompute_masks_by_module_and_a_repeat_decodes_as_the_first_run(flat,
                                                                                                     monkeypatch):
    """Two of three modules kept and partly recomputed, with the clause focus (every token a trigger: a random
    model's answer names nothing): the prefill is the unfocused run's, the answer not; each buffer slot's owner is
    the module its rank belongs to (walked from the plan's segments); every move names a kept module or a clause
    end; an identical request reads the run back and writes the same answer, its focus moving as the first run's."""
    from engine.arms import routed

    every = {t: t % 2 for t in range(len(flat.lm.tokenizer))}
    monkeypatch.setattr(routed, "triggers", lambda *_: every)
    cfg = flat.eng.config.with_(arms=("routed",), route_k=2, route_min_pull=0.0, route_share=0.4, warmup=False)
    eng = Engine.from_loaded(flat.lm)
    first = eng.compare(FLAT, FLAT_PROMPT, Sampling(12), config=cfg.with_(route_focus="clause")).arm("routed")
    off = eng.compare(FLAT, FLAT_PROMPT, Sampling(12), config=cfg.with_(route_focus="off")).arm("routed")
    assert first.detail.path == "partial" and len(first.detail.kept) == 2 and first.detail.focus == "clause"
    assert torch.equal(first.run.first_logits, off.run.first_logits) and first.run.token_ids != off.run.token_ids
    assert first.detail.moves and {m for _, m in first.detail.moves} <= set(first.detail.kept) | {""}
    rank, owner = 0, {}
    for s in flat.plan.segments:
        top = flat.lay.modules[s.owner].top if s.kind == CACHED and s.owner != ANONYMOUS else None
        owner.update({r: top for r in range(rank, rank + len(s))})
        rank += len(s)
    slots = list(range(flat.plan.prompt_tokens))
    got = routed._joint_owners(flat.plan, first.detail.kept, slots).tolist()
    assert got == [first.detail.kept.index(owner[r]) if owner[r] in first.detail.kept else -1 for r in slots]
    again = eng.compare(FLAT, FLAT_PROMPT, Sampling(12), config=cfg.with_(route_focus="clause")).arm("routed")
    assert again.detail.path == "repeat" and again.run.token_ids == first.run.token_ids
    assert again.detail.moves == first.detail.moves
    back = RoutedInfo.from_json(json.loads(json.dumps(first.detail.to_json())))
    assert back.moves == first.detail.moves and back.focus == "clause"
    said = view_of("routed").chips(replace(first.detail, moves=((3, "d2"), (6, ""), (8, "d3"))))[0]
    assert "focus d2 → all (clause ended) → d3" in said


def test_clause_ends_are_the_tokens_holding_punctuation_or_a_newline(tiny):
    from engine.arms.routed import clause_ends

    tok = tiny.lm.tokenizer
    ends = clause_ends(tok)
    for text in (".", ",", ";", "!", "?", "\n"):
        assert set(tok.encode(text, add_special_tokens=False)) <= ends, text
    assert not set(tok.encode(" harbour master", add_special_tokens=False)) & ends
    assert clause_ends(tok) is ends  # computed once per tokenizer


def test_another_question_over_the_same_modules_is_not_a_repeat(flat, monkeypatch):
    from engine.arms import routed

    monkeypatch.setattr(routed, "MIN_PULL", 1.01)
    eng = Engine.from_loaded(flat.lm)
    cfg = eng.config.with_(arms=("routed",), warmup=False)
    eng.compare(FLAT, FLAT_PROMPT, Sampling(2), config=cfg)
    other = eng.compare(FLAT, FLAT_PROMPT.replace("jumps", "sleeps"), Sampling(2), config=cfg).arm("routed")
    assert other.detail.path == "partial" and other.run.recomputed_tokens > 0
    shared = eng.compare(FLAT, FLAT_PROMPT, Sampling(2), config=cfg.with_(route_share=0.5)).arm("routed")
    assert shared.detail.path == "partial"  # other settings: another key


def test_the_oldest_kept_run_is_forgotten_with_its_kv(flat, monkeypatch):
    from engine.arms import routed
    from engine.cache import prefix as tree

    monkeypatch.setattr(routed, "MIN_PULL", 1.01)
    monkeypatch.setattr(tree, "MAX_NOTES", 1)
    eng = Engine.from_loaded(flat.lm)
    cfg = eng.config.with_(arms=("routed",), warmup=False)
    eng.compare(FLAT, FLAT_PROMPT, Sampling(2), config=cfg)
    one = eng.prefix_cache().stored_tokens()
    assert one == flat.plan.prompt_tokens + 1  # every token, and the run's key
    eng.compare(FLAT, FLAT_PROMPT.replace("jumps", "sleeps"), Sampling(2), config=cfg)
    assert eng.prefix_cache().stored_tokens() < 1.5 * one  # the first run's KV went with its note
    assert eng.compare(FLAT, FLAT_PROMPT, Sampling(2), config=cfg).arm("routed").detail.path == "partial"


def test_a_question_that_keeps_every_module_reads_the_trees_kv_and_answers_as_the_full_prefill(flat, monkeypatch):
    """With every module kept and the schema-order warm-up in the prefix tree, the routed run reads the tree's KV
    (the full prefill's own) and prefills only the question: the baseline's logits and tokens, nothing recomputed;
    an identical request is then a repeat; with route_tree off the same question recomputes its share."""
    from engine.arms import routed

    monkeypatch.setattr(routed, "MIN_PULL", 1.01)  # every module kept
    eng = Engine.from_loaded(flat.lm)
    cfg = eng.config.with_(arms=("baseline", "routed"), decode="apart")  # warm-up on, as Engine's default
    comp = eng.compare(FLAT, FLAT_PROMPT, Sampling(4), config=cfg)
    run, info, base = comp.arm("routed").run, comp.arm("routed").detail, comp.arm("baseline").run
    assert info.path == "tree" and info.kept == ("d1", "d2", "d3") and info.recomputed == 0
    assert run.recomputed_tokens == 0 and run.reused_tokens >= flat.plan.cached_tokens
    assert run.prefill_tokens == flat.plan.prompt_tokens - run.reused_tokens
    torch.testing.assert_close(run.first_logits, base.first_logits, atol=1e-4, rtol=1e-4)
    assert run.token_ids == base.token_ids
    again = eng.compare(FLAT, FLAT_PROMPT, Sampling(4), config=cfg).arm("routed")
    assert again.detail.path == "repeat" and again.run.prefill_tokens == 0 and again.run.token_ids == base.token_ids
    off = eng.compare(FLAT, FLAT_PROMPT, Sampling(4), config=cfg.with_(route_tree="off")).arm("routed")
    assert off.detail.path == "partial" and off.run.recomputed_tokens > 0


def test_the_tree_path_needs_every_module_kept_and_the_tree_past_the_last_module(flat, monkeypatch):
    """Two of three modules kept: a partial recompute although the tree holds them (routing drops the third). The
    modules d1 and d3 without d2 (PML keeps schema order and d3's positions): the tree's schema-order prefix ends
    after d1, so a partial recompute."""
    eng = Engine.from_loaded(flat.lm)
    cfg = eng.config.with_(arms=("routed",))  # a random model's pull never reaches the default: every module kept
    two = eng.compare(FLAT, FLAT_PROMPT, Sampling(2), config=cfg.with_(route_k=2, route_min_pull=0.0)).arm("routed")
    assert len(two.detail.kept) == 2 and two.detail.path == "partial"
    gapped = eng.compare(FLAT, FLAT_PROMPT.replace("<d2/>", ""), Sampling(2), config=cfg).arm("routed")
    assert gapped.detail.kept == ("d1", "d3") and gapped.detail.path == "partial"


def test_the_api_counts_routed_out_modules_as_cached_and_says_how_many(flat):
    """The API's cached_tokens is what the request did not compute: a module the scout read from the store and
    routed out is neither prefilled nor recomputed, so it counts (``routed_out_tokens`` says how much of it);
    prompt_tokens - cached_tokens is what the routed arm prefilled."""
    from studio.api.usage import cached_tokens, routed_out_tokens

    eng = Engine.from_loaded(flat.lm)
    routed = RoutedSettings(k=1, min_pull=0.0)
    cfg = eng.config.with_(arms=("cached", "routed"), warmup=False, arm_settings={"routed": routed})
    first = eng.compare(FLAT, FLAT_PROMPT.replace("animal", "bird"), Sampling(2), config=cfg)  # encodes the modules
    assert cached_tokens(first, "routed") == cached_tokens(first, "cached") == 0  # every unit computed now
    c = eng.compare(FLAT, FLAT_PROMPT, Sampling(2), config=cfg)
    kept, run = c.arm("routed").detail.kept, c.arm("routed").run
    assert len(kept) == 1 and c.arm("routed").detail.path == "stored"
    out = module_tokens(flat, {"d1", "d2", "d3"} - set(kept))
    assert routed_out_tokens(c, "routed") == out > 0 and routed_out_tokens(c, "cached") is None
    assert run.reused_tokens == flat.plan.cached_tokens - out  # the buffer held the kept module and the system text
    assert cached_tokens(c, "routed") == c.prompt.prompt_tokens - run.prefill_tokens == cached_tokens(c, "cached")
