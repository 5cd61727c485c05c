"""APE at query time (issue 27: ``ape_t`` / ``ape_s`` on the modular and routed arms) on a tiny random Qwen2.

The engine computes APE as one softmax over shifted logits (engine/model/attend.py, ``ApeScale``); the
reference here is the paper's own form, written apart: two softmaxes (the modules at temperature T, everything
else plain) merged by the weights softmax([S·T·LSE_C, LSE_O]), as github.com/Infini-AI-Lab/APE's
``ape_llama.py`` does, run through stock transformers with that attention function registered.
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_routed import Tiny
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from engine.arms.modular import ModularSettings
from tests.arm_runs import run_cached
from engine.arms.registry import Sampling
from tests.arm_runs import run_routed
from engine.config import Compression, RunConfig
from engine.errors import EngineError


def paper_ape(context: torch.Tensor, t: float, s: float):
    """APE's attention (the paper's two-part form) with ``context`` marking the module keys of the cache."""

    def attend(module, query, key, value, attention_mask, scaling=None, **kwargs):
        g = query.shape[1] // key.shape[1]
        k, v = key.repeat_interleave(g, dim=1), value.repeat_interleave(g, dim=1)
        x = torch.matmul(query, k.transpose(-1, -2)) * scaling
        q, kv = x.shape[-2:]
        causal = torch.ones(q, kv, dtype=torch.bool).tril(kv - q)
        ctx = torch.zeros(kv, dtype=torch.bool)
        ctx[: context.shape[0]] = context
        inside, other = causal & ctx, causal & ~ctx
        xc = (x / t).masked_fill(~inside, float("-inf"))
        xo = x.masked_fill(~other, float("-inf"))
        out_c, out_o = torch.matmul(xc.softmax(-1), v), torch.matmul(xo.softmax(-1), v)
        w = torch.stack([s * t * xc.logsumexp(-1), xo.logsumexp(-1)]).softmax(0)  # [2, b, h, q]
        out = w[0, ..., None] * out_c + w[1, ..., None] * out_o
        return out.transpose(1, 2).contiguous(), None

    return attend


class Reference:
    """Stock transformers with APE's attention over the cache of ``keep``'s modules (None: all)."""

    def __init__(self, tiny: Tiny, t: float, s: float, keep=None):
        kv, owners = tiny.cached_parts(keep)
        self.tiny, self.kv = tiny, kv
        name = f"ape_ref_{t}_{s}_{sorted(keep) if keep else 'all'}"
        AttentionInterface.register(name, paper_ape(torch.tensor([o is not None for o in owners]), t, s))
        AttentionMaskInterface.register(name, sdpa_mask)
        self.model = copy.deepcopy(tiny.stock)
        self.model.set_attn_implementation(name)

    def greedy(self, n: int) -> tuple[torch.Tensor, list[int]]:
        """First logits and ``n`` greedy tokens."""
        cache = DynamicCache(ddp_cache_data=[(self.kv[i, 0][None], self.kv[i, 1][None])
                                             for i in range(self.kv.shape[0])])
        ids, pos = self.tiny.plan.uncached()
        with torch.inference_mode():
            out = self.model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos]), past_key_values=cache,
                             use_cache=True)
            first = out.logits[0, -1].float()
            tokens, nxt = [int(first.argmax())], self.tiny.plan.max_position + 1
            while len(tokens) < n:
                step = self.model(input_ids=torch.tensor([[tokens[-1]]]), position_ids=torch.tensor([[nxt]]),
                                  past_key_values=cache, use_cache=True)
                tokens.append(int(step.logits[0, -1].argmax()))
                nxt += 1
        return first, tokens


@pytest.fixture(scope="module")
def tiny(tokenizer_bundle):
    return Tiny(tokenizer_bundle[1])


@pytest.mark.parametrize("t,s", [(0.5, 0.5), (0.9, 0.9), (0.7, 1.0), (1.0, 0.6)])
def test_the_modular_arm_with_ape_is_the_papers_attention(tiny, t, s):
    """First logits and every greedy token (prefill and decode steps both scaled) match the paper's form."""
    run = run_cached(tiny.lm, tiny.plan, tiny.enc, tiny.store, Sampling(5), ape=(t, s))
    first, tokens = Reference(tiny, t, s).greedy(5)
    torch.testing.assert_close(run.first_logits, first, atol=2e-5, rtol=2e-5)
    assert list(run.token_ids) == tokens[: len(run.token_ids)]
    plain = run_cached(tiny.lm, tiny.plan, tiny.enc, tiny.store, Sampling(5))
    assert not torch.allclose(run.first_logits, plain.first_logits, atol=1e-4)  # APE changed something


def test_ape_at_one_one_is_the_modular_run_bit_for_bit(tiny):
    plain = run_cached(tiny.lm, tiny.plan, tiny.enc, tiny.store, Sampling(4))
    same = run_cached(tiny.lm, tiny.plan, tiny.enc, tiny.store, Sampling(4), ape=(1.0, 1.0))
    assert torch.equal(plain.first_logits, same.first_logits) and plain.token_ids == same.token_ids


def test_the_routed_arm_scales_only_the_modules_it_kept(tiny):
    run, info = run_routed(tiny.lm, tiny.plan, tiny.enc, tiny.store, Sampling(4), keep={"d1", "d3"}, ape=(0.6, 0.8))
    first, tokens = Reference(tiny, 0.6, 0.8, keep={"d1", "d3"}).greedy(4)
    torch.testing.assert_close(run.first_logits, first, atol=2e-5, rtol=2e-5)
    assert list(run.token_ids) == tokens[: len(run.token_ids)]


def test_ape_settings_are_checked_where_made():
    assert ModularSettings().ape is None and ModularSettings(ape_t=0.9, ape_s=0.9).ape == (0.9, 0.9)
    with pytest.raises(EngineError, match="ape_t"):
        ModularSettings(ape_t=0.0)
    with pytest.raises(EngineError, match="ape_s"):
        ModularSettings(ape_s=1.5)
    assert RunConfig.make(ape_t=0.9, ape_s=0.8).settings_of("cached").ape_s == 0.8
    with pytest.raises(EngineError, match="APE cannot be combined with repair"):
        RunConfig.make(ape_t=0.9, repair=4)
    with pytest.raises(EngineError, match="question-aware retention"):
        RunConfig.make(ape_t=0.9, compression=Compression(0.5, "question"))


def test_the_cli_takes_ape_as_one_pair(capsys):
    from engine.cli import _arm_settings, build_parser

    parser = build_parser(None, arm_options=True)
    args = parser.parse_args(["run", "s.pml", "p", "--ape", "0.9,0.8"])
    assert _arm_settings(args) == {"ape_t": 0.9, "ape_s": 0.8}
    args = parser.parse_args(["run", "s.pml", "p", "--ape", "0.9,0.8", "--ape-s", "0.5"])
    assert _arm_settings(args) == {"ape_t": 0.9, "ape_s": 0.5}
    for bad in ("0.9", "0.9,2", "a,b"):
        with pytest.raises(SystemExit) as err:
            parser.parse_args(["run", "s.pml", "p", "--ape", bad])
        assert err.value.code == 2
    assert "--ape" in capsys.readouterr().err
