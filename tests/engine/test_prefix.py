"""The prefix-cache arm: a radix tree over token ids, exact reuse, warm-up, eviction, JSON, run log."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import first_token_kl
from engine.errors import EngineError
from engine.cache.prefix import PrefixCache, schema_order_prompt
from engine.arms.registry import Sampling
from engine.arms.compare import comparing
from engine.arms.registry import ArmContext
from engine.run.events import finish
from engine.session import Engine
from engine.cache.store import PREFIX, DiskStore, ModuleStore

SCHEMA = """<schema name="docs">
  <system>You answer questions about the documents.</system>
  <user>
    <module name="d1">The red fox jumps over the lazy dog near the river bank every morning.</module>
    <module name="d2">Quantum computers use qubits that can hold superpositions of states.</module>
    <module name="d3">The library opens at nine and closes at five on weekdays.</module>
  </user>
</schema>"""

# -- the tree alone, on synthetic KV: every token's "KV" is a function of the whole prefix up to it ---------

LAYERS, HEADS, DIM = 2, 1, 2


def fake_kv(ids: list[int]) -> torch.Tensor:
    """[layers, 2, heads, len, dim]: the value at position p identifies ids[:p + 1] (as real KV would)."""
    vals = [float(hash(tuple(ids[: p + 1])) % 100_003) for p in range(len(ids))]
    t = torch.tensor(vals).view(1, 1, 1, len(ids), 1)
    return t.expand(LAYERS, 2, HEADS, len(ids), DIM).clone()


def gathered(match) -> torch.Tensor:
    parts = [entry.kv[:, :, :, a:b] for entry, a, b in match.pieces]
    return torch.cat(parts, dim=3) if parts else torch.empty(LAYERS, 2, HEADS, 0, DIM)


def longest_common_prefix(seq: list[int], seen: list[list[int]]) -> int:
    best = 0
    for s in seen:
        n = 0
        while n < min(len(s), len(seq)) and s[n] == seq[n]:
            n += 1
        best = max(best, n)
    return best


def test_tree_reuses_the_longest_stored_prefix_exactly():
    rng = random.Random(0)
    cache = PrefixCache(ModuleStore("cpu"))
    seen: list[list[int]] = []
    for _ in range(60):
        base = rng.choice(seen) if seen and rng.random() < 0.7 else []
        cut = rng.randrange(0, len(base) + 1) if base else 0
        seq = base[:cut] + [rng.randrange(6) for _ in range(rng.randrange(1, 12))]
        m = cache.match(seq)
        expect = longest_common_prefix(seq, seen)
        assert m.reused == expect and m.whole == (expect == len(seq))
        assert torch.equal(gathered(m), fake_kv(seq)[:, :, :, :expect])  # splits kept every token's KV
        cache.insert(seq, fake_kv(seq))
        seen.append(seq)
    assert cache.stored_tokens() == sum(len(cache.store.get(k)) for k in cache.store.keys())
    capped = cache.match(seen[0], limit=len(seen[0]) - 1)
    assert capped.whole and capped.reused == len(seen[0]) - 1  # a repeat reuses all but its last token


def test_budget_evicts_prefix_nodes_leaves_first_and_descendants_with_their_parent():
    per_token = LAYERS * 2 * HEADS * DIM * 4
    store = ModuleStore("cpu", budget_bytes=40 * per_token)
    cache = PrefixCache(store)
    trunk = [1, 2, 3, 4, 5, 6, 7, 8]
    a, b, other = trunk + [10, 11, 12], trunk + [20, 21, 22], [30 + i for i in range(28)]
    cache.insert(a, fake_kv(a))
    cache.insert(b, fake_kv(b))  # splits a: the trunk and two branches
    assert len(cache) == 3 and store.stats()["prefix_entries"] == 3
    cache.insert(other, fake_kv(other))  # 14 + 28 tokens > 40: the least recently used leaf (a's) goes
    assert cache.match(a).reused == len(trunk) and cache.match(b).reused == len(b)
    assert cache.match(other).reused == len(other) and store.evictions == 1
    trunk_key, b_key = cache.match(b).keys
    (other_key,) = cache.match(other).keys
    store.touch([other_key, b_key])  # make the trunk the least recently used entry, its child the most recent
    store.set_budget(35 * per_token)
    assert cache.match(b).reused == 0 and b_key not in store  # the child went with its parent
    assert cache.match(other).reused == len(other) and store.nbytes() <= store.budget_bytes
    assert cache.stored_tokens() == sum(len(store.get(k)) for k in store.keys()) == len(other)
    stats = store.stats()
    assert stats["prefix_entries"] == len(store) == 1 and stats["prefix_bytes"] == store.nbytes()
    big = list(range(100, 150))
    assert cache.insert(big, fake_kv(big)) == 0 and cache.skipped_inserts == 1  # larger than the budget
    assert cache.match(other).reused == len(other)


def test_prefix_entries_never_reach_the_disk(tmp_path):
    store = ModuleStore("cpu", disk=DiskStore(tmp_path))
    cache = PrefixCache(store)
    cache.insert([1, 2, 3], fake_kv([1, 2, 3]))
    assert all(k.startswith(PREFIX) for k in store.keys()) and not list(tmp_path.glob("*"))
    store.clear()
    assert cache.match([1, 2, 3]).reused == 0 and len(cache) == 0  # pruned when its entry vanished


# -- the warm-up prompt ----------------------------------------------------------------------------

def test_schema_order_prompt_is_what_the_written_prompt_materialises(tiny_engine):
    schema = """<schema name="t">
      <system>Plan trips.</system>
      <user>
        <module name="plan">A trip for <param name="who" len="5" default="two adults"/>.
          <union scaffold="far">
            <module name="near">Stay close to home.</module>
            <module name="far">Fly abroad to <union><module name="rome">Rome.</module>
              <module name="oslo">Oslo.</module></union></module>
          </union>
        </module>
        <module name="today" cache="false">Today is Monday.</module>
        <union><module name="cheap">On a budget.</module><module name="lux">In luxury.</module></union>
      </user>
    </schema>"""
    lay = tiny_engine.layout(schema)
    warm = schema_order_prompt(lay)
    assert warm.modules == ("plan", "plan/far", "plan/far/rome", "today", "cheap") and warm.placeholders == ()
    written = "<prompt schema='t'><plan><far><rome/></far></plan><today/><cheap/></prompt>"
    assert list(warm.token_ids) == tiny_engine.plan(lay, written).token_ids
    no_default = schema.replace(' default="two adults"', "")
    w2 = schema_order_prompt(tiny_engine.layout(no_default))
    assert w2.placeholders == ("plan/who",)
    assert w2.token_ids.count(tiny_engine.codec.placeholder) >= 5


# -- the arm on the tiny model -----------------------------------------------------------------------

def run(eng, prompt, n=6, **cfg):
    return eng.compare(SCHEMA, prompt, Sampling(n), config=eng.config.with_(**cfg) if cfg else None)


def warm_overlap(c) -> int:
    """Tokens the prompt of ``c`` shares, from its start, with the warm-up prompt (schema order)."""
    return longest_common_prefix(c.plan.token_ids, [list(schema_order_prompt(c.plan.layout).token_ids)])


def test_prefix_arm_equals_the_baseline(tiny_engine):
    c = run(tiny_engine, "<prompt schema='docs'><d2/><d1/> Which animal jumps?</prompt>", n=10)
    assert tuple(c.arms) == ("baseline", "prefix", "cached")
    assert c.prefix.reused_tokens == warm_overlap(c) > 0  # the system text, up to where d2 departs from d1
    assert float((c.prefix.first_logits - c.baseline.first_logits).abs().max()) < 1e-4
    assert c.prefix.token_ids == c.baseline.token_ids
    assert c.agreement("prefix").same_text and c.agreement("prefix").first_token_kl < 1e-6
    assert c.agreement("prefix").first_token_kl == pytest.approx(first_token_kl(c.baseline, c.prefix), abs=1e-7)
    assert c.prefix.prefill_tokens == c.plan.prompt_tokens - c.prefix.reused_tokens


def test_schema_order_prompt_reuses_everything_the_modular_arm_reuses(tiny_engine):
    c = run(tiny_engine, "<prompt schema='docs'><d1/><d2/> Which animal jumps?</prompt>")
    reused = c.prefix.reused_tokens
    cached_positions = [i for i, t in enumerate(_token_kinds(c.plan)) if t == "cached"]
    assert cached_positions and max(cached_positions) < reused  # every cached token lies in the reused prefix
    assert reused >= c.plan.cached_tokens
    assert c.arm("prefix").detail.warmed_with["warmup"]["modules"] == ["d1", "d2", "d3"]
    assert c.arm("prefix").detail.stopped_at["source"] in ("anonymous", "text")


def test_a_prompt_that_skips_the_first_module_reuses_only_the_system_text(tiny_engine):
    c = run(tiny_engine, "<prompt schema='docs'><d2/><d3/> Which library?</prompt>")
    lay = c.plan.layout
    assert c.prefix.reused_tokens == lay.modules["d1"].start  # the text before the first module, no more
    assert c.arm("prefix").detail.stopped_at == {"token": lay.modules["d1"].start, "source": "module", "owner": "d2"}
    assert c.cached.reused_tokens == c.plan.cached_tokens > c.prefix.reused_tokens


def test_a_repeated_prompt_reuses_itself_and_says_so(tiny_engine):
    prompt = "<prompt schema='docs'><d3/> When does it open?</prompt>"
    first = run(tiny_engine, prompt)
    again = run(tiny_engine, prompt)
    n = again.plan.prompt_tokens
    assert not first.arm("prefix").detail.repeat and first.prefix.reused_tokens == warm_overlap(first)
    assert first.arm("prefix").detail.stored_tokens == n - warm_overlap(first) and again.arm("prefix").detail.stored_tokens == 0
    assert again.arm("prefix").detail.repeat and again.prefix.reused_tokens == n - 1 and again.prefix.prefill_tokens == 1
    assert again.arm("prefix").detail.warmed_with["earlier_runs"] == first.arm("prefix").detail.warmed_with["earlier_runs"] + 1
    assert again.prefix.token_ids == again.baseline.token_ids


def test_without_warmup_the_cache_holds_only_earlier_runs(tiny_lm):
    eng = Engine.from_loaded(tiny_lm, warmup=False)
    first = run(eng, "<prompt schema='docs'><d1/> Which animal?</prompt>")
    assert first.prefix.reused_tokens == 0 and first.arm("prefix").detail.warmed_with["warmup"] is None
    second = run(eng, "<prompt schema='docs'><d1/><d3/> Which animal?</prompt>")
    assert second.prefix.reused_tokens == second.plan.layout.modules["d1"].end  # system text + d1, from run one
    assert "1 earlier run" in second.arm("prefix").detail.warmed_with["summary"]


def test_arms_select_and_json_has_the_prefix_keys(tiny_engine):
    j = run(tiny_engine, "<prompt schema='docs'><d2/> Qubits?</prompt>").to_json()
    assert j["arms"] == ["baseline", "prefix", "cached"]
    p = j["prefix"]
    for key in ("text", "ttft_ms", "copy_ms", "decode_ms_per_token", "reused_tokens", "prefilled_tokens",
                "warmed_with", "stopped_at", "repeat", "stored_tokens"):
        assert key in p
    assert p["prefilled_tokens"] + p["reused_tokens"] == j["prompt_tokens"] and p["ttft_includes_copy"]
    assert j["prefix_same_text"] is True and j["prefix_first_token_kl"] < 1e-6
    assert j["baseline"]["reused_tokens"] == 0 and j["cached"]["reused_tokens"] == j["cached_tokens"]
    assert j["store_stats"]["prefix_entries"] > 0 and j["store_stats"]["prefix_bytes"] > 0
    two = run(tiny_engine, "<prompt schema='docs'><d2/> Qubits?</prompt>", arms=("baseline", "cached")).to_json()
    assert two["prefix"] is None and two["prefix_same_text"] is None and two["same_text"] is not None


def test_the_runner_refuses_a_prefix_arm_without_a_cache(tiny_engine):
    lay = tiny_engine.layout(SCHEMA)
    plan = tiny_engine.plan(lay, "<prompt schema='docs'><d2/> Qubits?</prompt>", 2)
    enc = tiny_engine.encode(lay).encoded
    with pytest.raises(EngineError, match="prefix cache"):
        finish(comparing(ArmContext(tiny_engine.lm, plan, enc, tiny_engine.store(), Sampling(2)),
                         arms=("baseline", "prefix")))


def test_prefix_inserts_do_not_evict_the_modules_the_cached_arm_reads(tiny_lm):
    full = Engine.from_loaded(tiny_lm)
    lay = full.layout(SCHEMA)
    sizes = full.encode(lay).bytes_by_module
    room = len(schema_order_prompt(lay).token_ids) + 15  # the warm-up and about one question's tokens
    budget = sum(sizes.values()) + room * tiny_lm.kv_bytes_per_token
    eng = Engine.from_loaded(tiny_lm, budget_bytes=budget)
    for q in ("Which animal jumps over the dog?", "Which computer uses qubits?", "When does the library open?"):
        c = run(eng, f"<prompt schema='docs'><d1/><d2/><d3/> {q}</prompt>")
        alone = run(full, f"<prompt schema='docs'><d1/><d2/><d3/> {q}</prompt>", arms=("cached",))  # no budget
        assert c.prefix.token_ids == c.baseline.token_ids and c.cached.token_ids == alone.cached.token_ids
        assert torch.allclose(c.cached.first_logits, alone.cached.first_logits, atol=1e-6)
    store = eng.store()
    assert store.evictions >= 1 and store.nbytes() <= budget  # prefix entries made room for each other
    enc = eng.encode(lay)
    assert {u.source for u in enc.encoded.units} == {"memory"}  # the modules were never evicted


def _token_kinds(plan) -> list[str]:
    return [s.kind for s in plan.segments for _ in s.token_ids]



@pytest.mark.real_model
def test_prefix_arm_is_exact_on_the_real_model(real_engine):
    from conftest import SAMPLES

    schema = (SAMPLES / "doc_qa.xml").read_text()
    prompt = (SAMPLES / "doc_qa.prompt.xml").read_text()  # skips a module: reuse breaks inside the schema
    eng = Engine.from_loaded(real_engine.lm)  # its own prefix cache: other tests' runs are not in it
    c = eng.compare(schema, prompt, Sampling(12))
    lay = c.plan.layout
    # through remote-work, then into travel-expenses only as far as it shares its first tokens with the
    # skipped annual-leave ("Halden Robotics Handbook, Section ")
    skip = lay.modules["annual-leave"].start
    shared = next(i for i, (a, b) in enumerate(zip(lay.pieces[lay.modules["annual-leave"].pieces[0]].token_ids,
                                                     lay.pieces[lay.modules["travel-expenses"].pieces[0]].token_ids))
                  if a != b)
    assert c.prefix.reused_tokens == skip + shared and 0 < shared < 20
    assert c.arm("prefix").detail.stopped_at == {"token": skip + shared, "source": "module", "owner": "travel-expenses"}
    assert float((c.prefix.first_logits - c.baseline.first_logits).abs().max()) < 1e-4
    assert c.prefix.token_ids == c.baseline.token_ids and c.agreement("prefix").same_text
