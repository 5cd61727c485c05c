"""Blend (issue 18: selective recompute after CacheBlend) on tiny random-weight models (seconds).

The exactness ends: ratio 0 is the cached run bit for bit; ratio 1 equals the baseline within
1e-4, on several families. In between, what is chosen is checked against quantities computed
independently here from a stock transformers forward (a full prefill's KV, eager attention
weights), never against the engine's own numbers.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import transformers as T
from test_repair import TURNS
from test_repair import TURNS_PROMPT as PROMPT  # three documents in two user turns

from tests.arm_runs import run_baseline
from engine.arms.blend import RULES, cached_ranks, stored_at
from tests.arm_runs import run_blend
from tests.arm_runs import run_cached
from engine.arms.repair import select_repair
from engine.arms.registry import Sampling
from engine.cache.assemble import Span
from engine.errors import EngineError
from engine.model.load import wrap_model
from engine.schema.plan import CACHED
from engine.session import Engine


def _sizes(**extra) -> dict:
    # three layers: check layer 1 leaves one layer whose stored KV only the recompute can fix
    return dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=2048, **extra)


FAMILIES = {
    "llama": lambda v: T.LlamaConfig(vocab_size=v, **_sizes()),
    "qwen2": lambda v: T.Qwen2Config(vocab_size=v, **_sizes()),
    "qwen3": lambda v: T.Qwen3Config(vocab_size=v, **_sizes(head_dim=16)),
    "phi3": lambda v: T.Phi3Config(vocab_size=v, pad_token_id=0, **_sizes()),
    "gemma3": lambda v: T.Gemma3TextConfig(vocab_size=v, **_sizes(head_dim=16, layer_types=["full_attention"] * 3)),
}


class Tiny:
    """A tiny random model: the engine around one copy, stock transformers (SDPA) on another."""

    def __init__(self, family: str, tokenizer, mode: str = "isolated"):
        torch.manual_seed(0)
        self.stock = T.AutoModelForCausalLM.from_config(FAMILIES[family](len(tokenizer)),
                                                        attn_implementation="sdpa").eval()
        self.lm = wrap_model(copy.deepcopy(self.stock), tokenizer, f"tiny-{family}", fingerprint=f"blend-{family}")
        self.eng = Engine.from_loaded(self.lm)
        self.lay = self.eng.layout(TURNS)
        self.plan = self.eng.plan(self.lay, PROMPT, max_new_tokens=4)
        self.enc = self.eng.encode(self.lay, self.eng.config.with_(mode=mode)).encoded

    def blend(self, ratio: float, enc=None, **kw):
        return run_blend(self.lm, self.plan, enc or self.enc, self.eng.store(), Sampling(4), ratio=ratio, **kw)

    def full_prefill_kv(self, layer: int) -> torch.Tensor:
        """[2, kv_heads, prompt, head_dim]: a stock full prefill's K (after RoPE) and V at ``layer``."""
        pos = [p for s in self.plan.segments for p in s.positions]
        with torch.inference_mode():
            out = self.stock(input_ids=torch.tensor([self.plan.token_ids]), position_ids=torch.tensor([pos]),
                             use_cache=True)
        lay = out.past_key_values.layers[layer]
        return torch.stack([lay.keys[0], lay.values[0]])

    def stored_kv(self, layer: int) -> torch.Tensor:
        """[2, kv_heads, cached, head_dim]: the store entries' K and V at ``layer``, cached tokens in prompt order."""
        parts = []
        for s in self.plan.segments:
            if s.kind == CACHED:
                key, off = self.enc.locate(s.piece, s.scaffold)
                parts.append(self.eng.store().get(key).kv[layer, :, :, off + s.offset: off + s.offset + len(s)])
        return torch.cat(parts, 2)


@pytest.fixture(scope="module")
def llama(tokenizer_bundle) -> Tiny:
    return Tiny("llama", tokenizer_bundle[1])


# -- exactness ends ------------------------------------------------------------------------------

def test_ratio_zero_is_the_cached_run_bit_for_bit(llama):
    plain = run_cached(llama.lm, llama.plan, llama.enc, llama.eng.store(), Sampling(4))
    blend, info = llama.blend(0.0)
    assert blend.token_ids == plain.token_ids and torch.equal(blend.first_logits, plain.first_logits)
    assert blend.arm == "blend" and blend.recomputed_tokens == 0 and info.ranks == () and info.selection_ms == 0
    tiny, _ = llama.blend(0.4 / llama.plan.cached_tokens)  # rounds to 0 tokens
    assert torch.equal(tiny.first_logits, plain.first_logits)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_ratio_one_equals_the_baseline(tokenizer_bundle, family):
    t = Tiny(family, tokenizer_bundle[1])
    base = run_baseline(t.lm, t.plan, Sampling(4))
    plain = run_cached(t.lm, t.plan, t.enc, t.eng.store(), Sampling(4))
    full, info = t.blend(1.0)
    assert float((plain.first_logits - base.first_logits).abs().max()) > 1e-3  # approximate without blending
    assert float((full.first_logits - base.first_logits).abs().max()) < 1e-4
    assert full.token_ids == base.token_ids
    assert full.recomputed_tokens == t.plan.cached_tokens == len(info.ranks) and full.reused_tokens == 0
    part, info = t.blend(0.3)  # the selection pass runs on every family
    assert part.recomputed_tokens == len(info.ranks) == round(0.3 * t.plan.cached_tokens)


def test_fresh_early_layers_through_the_last_layer_are_the_full_prefill(llama):
    """Check layer = last layer: the selection pass is a full prefill, so writing its KV for every cached
    token leaves nothing stale, whatever the share recomputed — a check that it lands in the right slots."""
    base = run_baseline(llama.lm, llama.plan, Sampling(4))
    last = llama.lm.n_layers - 1
    fresh, _ = llama.blend(0.2, check_layer=last, fresh_early=True)
    stale, _ = llama.blend(0.2, check_layer=last, fresh_early=False)
    assert float((fresh.first_logits - base.first_logits).abs().max()) < 1e-4
    assert float((stale.first_logits - base.first_logits).abs().max()) > 1e-3


# -- which tokens --------------------------------------------------------------------------------

@pytest.mark.parametrize("rule,row", [("deviation-k", 0), ("deviation-v", 1)])
@pytest.mark.parametrize("check_layer", [1, 2])
def test_deviation_picks_the_top_n_of_an_independent_full_prefill(llama, rule, row, check_layer):
    cached = cached_ranks(llama.plan)
    fresh = llama.full_prefill_kv(check_layer)[:, :, cached]
    dev = (fresh - llama.stored_kv(check_layer)).pow(2).sum(dim=(1, 3))[row]  # [cached]
    for ratio in (0.1, 0.3):
        n = round(ratio * len(cached))
        want = {cached[i] for i in torch.topk(dev, n).indices.tolist()}
        _, info = llama.blend(ratio, rule=rule, check_layer=check_layer)
        assert set(info.ranks) == want


def test_question_picks_what_the_new_text_attends_to_most(llama):
    """Eager attention weights of a stock full prefill at the check layer, summed over heads and the
    uncached tokens' rows."""
    eager = copy.deepcopy(llama.stock)
    eager.set_attn_implementation("eager")
    pos = [p for s in llama.plan.segments for p in s.positions]
    with torch.inference_mode():
        out = eager(input_ids=torch.tensor([llama.plan.token_ids]), position_ids=torch.tensor([pos]),
                    use_cache=True, output_attentions=True)
    uncached = [r for r in range(len(pos)) if r not in set(cached_ranks(llama.plan))]
    score = out.attentions[1][0][:, uncached].sum(dim=(0, 1))  # [prompt]
    cached = cached_ranks(llama.plan)
    n = round(0.2 * len(cached))
    want = {cached[i] for i in torch.topk(score[cached], n).indices.tolist()}
    _, info = llama.blend(0.2, rule="question")
    assert set(info.ranks) == want


def test_link_rule_at_a_repair_count_is_the_repair_selection(llama):
    for k in (1, 3):
        sel = select_repair(llama.plan, k, llama.enc.mode)
        _, info = llama.blend(len(sel) / llama.plan.cached_tokens, rule="link")
        assert info.ranks == sel.ranks


@pytest.mark.parametrize("rule", list(RULES))
def test_every_rule_recomputes_n_distinct_cached_tokens(llama, rule):
    cached = set(cached_ranks(llama.plan))
    positions = [p for s in llama.plan.segments for p in s.positions]
    for ratio in (0.05, 0.5):
        n = round(ratio * len(cached))
        run, info = llama.blend(ratio, rule=rule)
        assert len(set(info.ranks)) == len(info.ranks) == n == run.recomputed_tokens
        assert set(info.ranks) <= cached and list(info.ranks) == sorted(info.ranks)
        assert run.recomputed_positions == tuple(positions[r] for r in info.ranks)
        assert run.prefill_tokens == llama.plan.uncached_tokens + n and run.reused_tokens == len(cached) - n
        assert info.rule == rule and 0 < info.selection_ms <= run.copy_ms < run.ttft_ms  # copy_ms: selection + copy


def test_mixed_takes_the_link_openings_and_random_follows_its_seed(llama):
    _, mixed = llama.blend(0.3, rule="mixed")
    assert set(select_repair(llama.plan, 2, llama.enc.mode).ranks) <= set(mixed.ranks)
    a, b, c = (llama.blend(0.3, rule="random", seed=s)[1].ranks for s in (0, 0, 1))
    assert a == b != c


# -- stored entries as they are read -------------------------------------------------------------

def test_quantized_entries_are_compared_dequantized(llama):
    enc = llama.eng.encode(llama.lay, llama.eng.config.with_(mode="isolated", storage_dtype="int8")).encoded
    ranges, want = [], []
    for s in llama.plan.segments:
        if s.kind == CACHED:
            key, off = enc.locate(s.piece, s.scaffold)
            entry = llama.eng.store().get(key)
            ranges.append(Span(entry, off + s.offset, off + s.offset + len(s)))
            kv = entry.dequantize() if hasattr(entry, "dequantize") else entry.kv.float()
            want.append(kv[1, :, :, off + s.offset: off + s.offset + len(s)])
    assert any(hasattr(r.entry, "dequantize") for r in ranges)
    assert torch.equal(stored_at(ranges, 1), torch.cat(want, 2))
    base = run_baseline(llama.lm, llama.plan, Sampling(4))
    assert float((llama.blend(1.0, enc)[0].first_logits - base.first_logits).abs().max()) < 1e-4
    assert llama.blend(0.2, enc)[0].recomputed_tokens == round(0.2 * llama.plan.cached_tokens)


def test_compressed_entries_blend_per_layer(llama):
    enc = llama.eng.encode(llama.lay, llama.eng.config.with_(mode="isolated", retention=0.5)).encoded
    base = run_baseline(llama.lm, llama.plan, Sampling(4))
    part, info = llama.blend(0.2, enc)
    assert part.recomputed_tokens == len(info.ranks) == round(0.2 * llama.plan.cached_tokens)
    full, _ = llama.blend(1.0, enc)
    assert float((full.first_logits - base.first_logits).abs().max()) < 1e-4  # nothing compressed is left


# -- refusals ------------------------------------------------------------------------------------

def test_sliding_window_models_are_refused_with_the_reason(tokenizer_bundle):
    tok = tokenizer_bundle[1]
    cfg = T.MistralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, sliding_window=8, attn_implementation="sdpa")
    lm = wrap_model(T.MistralForCausalLM(cfg).eval(), tok, "tiny-mistral", fingerprint="blend-mistral-window")
    eng = Engine.from_loaded(lm)
    lay = eng.layout(TURNS)
    plan = eng.plan(lay, PROMPT, max_new_tokens=2)
    enc = eng.encode(lay, eng.config.with_(mode="isolated")).encoded
    with pytest.raises(EngineError, match="not available for models with sliding-window or ALiBi attention.*"
                                          "set blend to 0"):
        run_blend(lm, plan, enc, eng.store(), Sampling(2), ratio=0.15)
    plain = run_cached(lm, plan, enc, eng.store(), Sampling(2))
    assert torch.equal(run_blend(lm, plan, enc, eng.store(), Sampling(2), ratio=0)[0].first_logits,
                       plain.first_logits)


@pytest.mark.parametrize("kw,match", [({"ratio": 1.5}, "ratio must be a share"), ({"ratio": -0.1}, "ratio must"),
                                      ({"rule": "best"}, "unknown blend rule 'best'"),
                                      ({"check_layer": 3}, "check layer must be a layer index from 1 to 2"),
                                      ({"check_layer": 0}, "from 1 to 2")])
def test_bad_settings_are_refused(llama, kw, match):
    with pytest.raises(EngineError, match=match):
        llama.blend(**{"ratio": 0.15, **kw})


# -- the blend arm everywhere the arms are ------------------------------------------------------

def test_blend_is_an_arm_of_compare_the_json_the_run_log_and_the_studio(tiny_lm, tmp_path):
    from conftest import SAMPLES

    from engine.runlog import RunLog
    from engine.session import Engine
    from studio import arm_views, views
    from studio.arm_views import view_of
    from studio.settings import run_config

    eng = Engine.from_loaded(tiny_lm)
    schema, prompt = (SAMPLES / "travel.xml").read_text(), (SAMPLES / "travel.prompt.xml").read_text()
    # the studio: the arms checkbox picks the columns, the blend controls set its settings
    cfg = run_config(eng.config, {"arms": ["baseline", "prefix", "cached", "blend"], "blend": 0.25, "mode": "isolated"})
    assert cfg.arms == ("baseline", "prefix", "cached", "blend") and cfg.settings_of("blend").ratio == 0.25
    assert run_config(cfg, {"arms": ["baseline", "cached"]}).arms == ("baseline", "cached")
    c = eng.compare(schema, prompt, Sampling(3), config=cfg.with_(arms=("baseline", "cached", "blend")))
    doc = c.to_json()
    n = round(0.25 * c.plan.cached_tokens)
    assert doc["arms"] == ["baseline", "cached", "blend"]
    assert doc["blend"]["blend_ratio"] == 0.25 and doc["blend"]["recomputed_tokens"] == n
    assert len(doc["blend"]["recomputed_positions"]) == n and doc["blend"]["rule"] == "deviation"
    assert doc["blend_speedup"] == doc["by_arm"]["blend"]["speedup"] is not None
    assert doc["blend_same_text"] == c.agreement("blend").same_text
    log = RunLog(tmp_path / "runs.db")
    row = log.get(log.record(doc, schema, prompt))
    assert row["arms"]["blend"]["recomputed_tokens"] == n
    # its detail survives the run log: the History tab reopens the stored document as a Comparison
    from engine.arms.compare import Comparison

    back = Comparison.from_json(json.loads(row["result_json"]))
    live, read = c.arm("blend").detail, back.arm("blend").detail
    assert (read.ratio, read.rule, read.check_layer, read.fresh_early) == \
        (live.ratio, live.rule, live.check_layer, live.fresh_early) == (0.25, "deviation", 1, live.fresh_early)
    assert read.selection_ms == round(live.selection_ms, 3) and view_of("blend").chips(read) == [
        f"blend 0.25 by deviation, selection {live.selection_ms:.0f} ms"]
    marks = views.token_marks(c)
    assert marks["blended"] == set(doc["blend"]["recomputed_positions"])
    from engine.words import speed_words

    assert "Blend" in [v.title for v in arm_views.views()]
    assert f"{speed_words(c.speedup('blend'))} first token" in views.metrics_html(c, "blend")  # slower reads slower


def test_blend_settings_are_checked_where_they_are_made():
    from engine.config import RunConfig
    from engine.errors import EngineError

    for bad in (-0.1, 1.5, True, "x"):
        with pytest.raises(EngineError, match="blend must be a share"):
            RunConfig.make(blend=bad)
    with pytest.raises(EngineError, match="blend rule"):
        RunConfig.make(blend_rule="loudest")
