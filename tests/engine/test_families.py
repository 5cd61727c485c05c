"""Every tested model family, on a tiny random model built from its config here (no download).

The families are ``engine.model.positions.TESTED_FAMILIES`` (the Model tab shows whether a loaded model's
family is among them); a test below fails if a family there has no builder here. For each:

* baseline = stock transformers: the engine's baseline first logits equal ``model(ids)`` within
  1e-4 and its greedy ids equal ``generate()``'s (stock caches, stock attention);
* a module reused alone at its offset equals a one-pass prefill of the same tokens at the same
  positions;
* a scaffold imported whole is exact (cached equals baseline, same greedy text);
* gapped positions (a union member shorter than its union, so the new text sits after a gap)
  equal a one-pass prefill over the same gapped positions.

References run on a separate copy of the weights with the stock attention. Where transformers
itself reads cache indices as positions — sliding windows, ALiBi — the reference says what
position ids mean explicitly: an attention mask that slides over position ids, an ALiBi bias
read at position ids. The gapped test also checks that the index reading would give a different
answer, so it could fail.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import pytest
import torch
import transformers as T

from engine.errors import EngineError, ModelError
from engine.model.positions import TESTED_FAMILIES
from engine.model.load import wrap_model
from engine.arms.registry import Sampling
from tests.arm_runs import run_baseline
from tests.arm_runs import run_cached
from engine.session import Engine

WINDOW = 12  # shorter than every prompt below, longer than the text after the gap in GAPPED

FLAT = """<schema name="flat">
  <module name="d1">The red fox jumps over the lazy dog near the river bank.</module>
  <module name="d2">Quantum computers use qubits that can hold superpositions of states.</module>
  <module name="d3">The library opens at nine and closes at five on weekdays.</module>
</schema>"""

CHAT = """<schema name="chat">
  <system>You answer questions about the documents.</system>
  <user>
    <module name="d1">The red fox jumps over the lazy dog near the river bank.</module>
    <module name="d2">Quantum computers use qubits that can hold superpositions of states.</module>
  </user>
  <scaffold name="both" modules="d1 d2"/>
</schema>"""

# "short" leaves a gap before the rest of "doc"; the union's scaffold makes doc's unit see "short", so a
# prompt importing it is exact (one-pass prefill over the same gapped positions). The text after the gap
# plus the question is shorter than the window, so the last token's window reaches across the gap.
GAPPED = """<schema name="gap">
  <module name="doc">The red fox jumps over the lazy dog near the river bank.
    <union scaffold="short">
      <module name="long">Quantum computers use qubits that can hold superpositions of many states at once, which
        lets some algorithms finish far sooner than on any classical machine built so far.</module>
      <module name="short">The library opens at nine.</module>
    </union>
    Bye.
  </module>
</schema>"""


def _sizes(**extra) -> dict:
    return dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=2048, **extra)


# variant -> (config builder taking the vocab size, attention implementation of the stock model)
BUILDERS = {
    "llama": (lambda v: T.LlamaConfig(vocab_size=v, **_sizes()), "sdpa"),
    "qwen2": (lambda v: T.Qwen2Config(vocab_size=v, **_sizes(use_sliding_window=True, sliding_window=WINDOW,
                                                               max_window_layers=1)), "sdpa"),
    "qwen3": (lambda v: T.Qwen3Config(vocab_size=v, **_sizes(head_dim=16)), "sdpa"),
    "mistral": (lambda v: T.MistralConfig(vocab_size=v, **_sizes(sliding_window=WINDOW)), "sdpa"),
    "gemma3": (lambda v: T.Gemma3TextConfig(vocab_size=v, **_sizes(head_dim=16, sliding_window=WINDOW,
                                                                     layer_types=["sliding_attention",
                                                                                  "full_attention"])), "sdpa"),
    "gemma2": (lambda v: T.Gemma2Config(vocab_size=v, **_sizes(head_dim=16, sliding_window=WINDOW)), "eager"),
    "phi3": (lambda v: T.Phi3Config(vocab_size=v, pad_token_id=0, **_sizes(sliding_window=WINDOW)), "sdpa"),
    "gpt_neox": (lambda v: T.GPTNeoXConfig(vocab_size=v, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, max_position_embeddings=2048), "sdpa"),
    "falcon": (lambda v: T.FalconConfig(vocab_size=v, hidden_size=64, num_hidden_layers=2,
                                        num_attention_heads=4), "sdpa"),
    "falcon-alibi": (lambda v: T.FalconConfig(vocab_size=v, hidden_size=64, num_hidden_layers=2,
                                              num_attention_heads=4, alibi=True, multi_query=False), "sdpa"),
    "falcon-grouped": (lambda v: T.FalconConfig(vocab_size=v, hidden_size=64, num_hidden_layers=2,
                                                num_attention_heads=4, num_kv_heads=2,
                                                new_decoder_architecture=True), "sdpa"),
    "mpt": (lambda v: T.MptConfig(vocab_size=v, d_model=64, n_layers=2, n_heads=4, max_seq_len=2048), "eager"),
}


class Family:
    """A tiny random model of one family: the engine around one copy, stock transformers on another."""

    def __init__(self, variant: str, tokenizer):
        build, attn = BUILDERS[variant]
        cfg = build(len(tokenizer))
        torch.manual_seed(0)
        self.stock = T.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).eval()
        self.variant, self.config = variant, self.stock.config
        mine = copy.deepcopy(self.stock)
        self.lm = wrap_model(mine, tokenizer, f"tiny-{variant}", fingerprint=f"tiny-{variant}-seed0")
        self.engine = Engine.from_loaded(self.lm)

    def one_pass(self, ids: list[int], pos: list[int], windows_by_index: bool = False) -> torch.Tensor:
        """Last-token logits of one stock forward of ``ids`` at ``pos`` (what position ids mean: see module doc)."""
        kwargs = {"input_ids": torch.tensor([ids]), "position_ids": torch.tensor([pos]), "use_cache": True}
        mask = self._masks(pos, windows_by_index)
        if mask is not None:
            kwargs["attention_mask"] = mask
        with torch.inference_mode(), self._alibi_at(None if windows_by_index else pos):
            return self.stock(**kwargs).logits[0, -1]

    def _masks(self, pos: list[int], by_index: bool):
        window = getattr(self.config, "sliding_window", None)
        types = getattr(self.config, "layer_types", None)
        if not window or (types and "sliding_attention" not in types):
            return None
        n = len(pos)
        p = torch.arange(n) if by_index else torch.tensor(pos)
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        sliding = causal & ((p[:, None] - p[None, :]) < window)
        as_mask = (lambda m: m[None, None]) if self.config._attn_implementation != "eager" else \
            (lambda m: torch.zeros(n, n).masked_fill(~m, torch.finfo(torch.float32).min)[None, None])
        if types:
            return {"full_attention": as_mask(causal), "sliding_attention": as_mask(sliding)}
        return as_mask(sliding)

    @contextmanager
    def _alibi_at(self, pos: list[int] | None):
        """The stock ALiBi bias, read at position ids instead of key indices (MPT, ALiBi Falcon)."""
        if pos is None or not (self.config.model_type == "mpt" or getattr(self.config, "alibi", False)):
            yield
            return
        idx = torch.tensor(pos)
        if self.config.model_type == "mpt":
            base = self.stock.transformer
            stock = base.build_mpt_alibi_tensor
            base.build_mpt_alibi_tensor = lambda h, n, m=8, device=None: stock(h, max(pos) + 1, m, device)[:, :, idx]
            try:
                yield
            finally:
                del base.build_mpt_alibi_tensor
            return
        from transformers.models.falcon import modeling_falcon as mf

        stock = mf.build_alibi_tensor
        mf.build_alibi_tensor = lambda mask, h, dtype: stock(torch.ones(1, max(pos) + 1, dtype=torch.long), h,
                                                            dtype)[:, :, idx]
        try:
            yield
        finally:
            mf.build_alibi_tensor = stock


@pytest.fixture(scope="module", params=list(BUILDERS))
def family(request, tokenizer_bundle) -> Family:
    return Family(request.param, tokenizer_bundle[1])


def test_every_listed_family_is_built_here():
    built = {b(64).model_type for b, _ in BUILDERS.values()}
    assert built == set(TESTED_FAMILIES)


def test_baseline_equals_stock_transformers(family):
    eng = family.engine
    plan = eng.plan(eng.layout(FLAT), "<prompt schema='flat'><d1/><d2/> What jumps over the dog?</prompt>",
                    max_new_tokens=10)
    assert len(plan.token_ids) > 2 * WINDOW
    base = run_baseline(family.lm, plan, Sampling(10))
    ids = torch.tensor([list(plan.token_ids)])
    with torch.inference_mode():
        stock = family.stock(input_ids=ids).logits[0, -1]
        gen = family.stock.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=list(family.lm.eos_ids),
                                    pad_token_id=family.lm.eos_ids[0])
    assert torch.allclose(base.first_logits, stock, atol=1e-4), (base.first_logits - stock).abs().max()
    assert list(base.token_ids) == gen[0, ids.shape[1]:].tolist()


def test_module_reused_at_its_offset_equals_one_pass_prefill(family):
    eng = family.engine
    lay = eng.layout(FLAT)
    plan = eng.plan(lay, "<prompt schema='flat'><d3/> And then what happens?</prompt>", max_new_tokens=1)
    assert lay.modules["d3"].start > 2 * WINDOW  # d3 sits far from position 0
    enc = eng.encode(lay, eng.config.with_(mode="isolated")).encoded
    cached = run_cached(family.lm, plan, enc, eng.store(), Sampling(1))
    ids = [t for s in plan.segments for t in s.token_ids]
    pos = [p for s in plan.segments for p in s.positions]
    assert pos == list(range(pos[0], pos[0] + len(pos)))  # contiguous from the module's offset
    ref = family.one_pass(ids, pos)
    assert torch.allclose(cached.first_logits, ref, atol=1e-4), (cached.first_logits - ref).abs().max()
    if family.config.model_type in ("mpt",) or getattr(family.config, "alibi", False):
        # ALiBi is shift-invariant: the same tokens from position 0, through the untouched stock model
        with torch.inference_mode():
            plain = family.stock(input_ids=torch.tensor([ids])).logits[0, -1]
        assert torch.allclose(cached.first_logits, plain, atol=1e-4)


def test_scaffold_imported_whole_is_exact(family):
    eng = family.engine
    c = eng.compare(CHAT, "<prompt schema='chat'><d1/><d2/> Summarise both.</prompt>", Sampling(6),
                    config=eng.config.with_(mode="isolated"))
    assert c.plan.scaffolds == ("both",)
    assert c.agreement().max_first_logit_diff < 1e-4 and c.agreement().same_text


def test_gapped_positions_equal_one_pass_prefill_over_them(family):
    eng = family.engine
    lay = eng.layout(GAPPED)
    plan = eng.plan(lay, "<prompt schema='gap'><doc><short/></doc> Why?</prompt>", max_new_tokens=1)
    ids = [t for s in plan.segments for t in s.token_ids]
    pos = [p for s in plan.segments for p in s.positions]
    gaps = [(i, b - a) for i, (a, b) in enumerate(zip(pos, pos[1:])) if b - a > 1]
    assert len(gaps) == 1 and gaps[0][1] > WINDOW  # the skipped part of the union is wider than the window
    assert len(pos) - gaps[0][0] <= WINDOW  # ... and the window of the last token reaches across it
    enc = eng.encode(lay, eng.config.with_(mode="isolated")).encoded
    cached = run_cached(family.lm, plan, enc, eng.store(), Sampling(1))
    ref = family.one_pass(ids, pos)
    assert torch.allclose(cached.first_logits, ref, atol=1e-4), (cached.first_logits - ref).abs().max()
    position_semantics = family.lm.sliding_window or family.config.model_type == "mpt" or \
        getattr(family.config, "alibi", False)
    if position_semantics:  # reading cache indices as positions would have given another answer
        by_index = family.one_pass(ids, pos, windows_by_index=True)
        assert (cached.first_logits - by_index).abs().max() > 1e-3


def test_model_facts_name_the_attention_path(family):
    info = family.lm.info()
    assert info["family_tested"] is True and info["model_type"] in TESTED_FAMILIES
    own = family.config.model_type in ("mpt", "falcon")
    assert info["attention"] == ("own" if own else "pml")
    assert info["sliding_window"] == (WINDOW if family.variant in ("qwen2", "mistral", "gemma3", "gemma2", "phi3")
                                      else None)
    with torch.inference_mode():
        out = family.stock(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True)
    layer = out.past_key_values.layers[0]
    per_token = 2 * family.lm.n_layers * layer.keys.shape[1] * layer.keys.shape[3] * 4  # fp32: what stock caches
    assert info["kv_bytes_per_token"] == per_token


def test_compression_is_refused_for_models_with_their_own_attention(tokenizer_bundle):
    fam = Family("mpt", tokenizer_bundle[1])
    eng = fam.engine
    cfg = eng.config.with_(compression=eng.config.compression.__class__(retention=0.5))
    with pytest.raises(EngineError, match="compression needs .* set retention to 1.0"):
        eng.encode(eng.layout(FLAT), cfg)


def test_unsupported_families_are_refused_with_the_reason():
    from engine.model.positions import check_supported

    bloom = T.BloomConfig(vocab_size=64, hidden_size=32, n_layer=1, n_head=4)
    with pytest.raises(ModelError, match="own code.*tested family"):
        check_supported(bloom, T.BloomForCausalLM)
    hybrid = T.Qwen3NextConfig(vocab_size=64, hidden_size=32, num_hidden_layers=4)
    with pytest.raises(ModelError, match="linear_attention.*keep state"):
        check_supported(hybrid, T.Qwen3NextForCausalLM)
