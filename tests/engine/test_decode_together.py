"""Arms decoded together (engine/run/decode.py, engine/kv/batched.py): each row of a batched
step computes what its run computes alone, and a comparison decoded together gives every arm the tokens it
gets decoding apart."""

from __future__ import annotations

import torch

from engine.arms.registry import Sampling
from engine.kv import BatchedKV
from engine.model.attend import AttentionSpec
from tests.arm_runs import streamed

SCHEMA = """<schema name="s">
  <system>You answer briefly.</system>
  <module name="a">Alpha owns a red kite and lives in Oslo.</module>
  <module name="b">Beta owns a blue boat and lives in Lima, a city of many bridges and old markets.</module>
</schema>"""
PROMPT = """<prompt schema="s"><a/><b/><user>Who lives in Lima?</user></prompt>"""


def _forward(model, ids, pos, cache, spec=None):
    with torch.inference_mode():
        return model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True,
                     logits_to_keep=1, **({} if spec is None else {"attn_spec": spec})).logits[:, -1].float()


def test_a_batched_step_computes_each_row_as_alone(tiny_lm):
    """Three caches of different lengths (and gapped positions): one batched step's logits per row, against the
    same step over that row's cache alone (a DynamicCache: transformers' own path, no engine mask)."""
    from transformers.cache_utils import DynamicCache

    model = tiny_lm.model
    torch.manual_seed(3)
    lengths, firsts = [5, 11, 8], [0, 7, 30]
    kvs, alone = [], []
    for n, first in zip(lengths, firsts):
        ids = torch.randint(5, 500, (1, n))
        pos = torch.arange(first, first + n)[None]
        cache = DynamicCache()
        _forward(model, ids, pos, cache)
        kvs.append(torch.stack([torch.stack([l.keys[0], l.values[0]]) for l in cache.layers]))
        alone.append((cache, first + n))
    batch = BatchedKV(kvs, room=4)
    cache = batch.cache()
    for step in range(3):
        nxt = torch.randint(5, 500, (3, 1))
        pos = torch.tensor([[p + step] for _, p in alone])
        got = _forward(model, nxt, pos, cache, AttentionSpec(keys=batch.key_mask()))
        batch.advance()
        for row, (c, p) in enumerate(alone):
            want = _forward(model, nxt[row:row + 1], torch.tensor([[p + step]]), c)
            assert torch.allclose(got[row], want[0], atol=1e-5, rtol=1e-4), (step, row)


def test_a_comparison_decoded_together_gives_each_arm_its_own_tokens(tiny_engine):
    sampling = Sampling(max_new_tokens=12)
    apart = tiny_engine.compare(SCHEMA, PROMPT, sampling, config=tiny_engine.config.with_(decode="apart"))
    together = tiny_engine.compare(SCHEMA, PROMPT, sampling)
    assert together.decode == "together" and apart.decode == "apart"
    assert set(together.arms) == set(apart.arms) and len(together.arms) >= 3
    for arm, res in together.arms.items():
        other = apart.arms[arm].run
        assert res.run.token_ids == other.token_ids and res.run.text == other.text, arm
        assert res.run.decode_batch == len(together.arms) and other.decode_batch == 1
        assert len(res.run.token_ids) == 12 and res.run.decode_ms_per_token > 0
        assert res.run.ttft_ms > 0 and torch.allclose(res.run.first_logits, other.first_logits, atol=1e-4)
    data = together.to_json()
    assert data["decode"] == "together" and data["cached"]["decode_batch"] == len(together.arms)
    assert data["same_text"] == apart.to_json()["same_text"]


def test_streamed_tokens_arrive_for_every_arm_and_end_with_its_text(tiny_engine):
    seen: dict[str, list[str]] = {}
    res = streamed(tiny_engine.events(SCHEMA, PROMPT, Sampling(max_new_tokens=6)), seen)
    assert set(seen) == {a.value for a in res.arms}
    for arm, texts in seen.items():
        assert len(texts) == 6 and texts[-1] == res.arm(arm).run.text




def test_a_lone_arm_decodes_in_place_in_its_own_buffer(tiny_engine, monkeypatch):
    """A one-arm run (the API's) waits for no batch: one buffer for its whole run, its KV never copied out, and
    the same tokens as decoding apart."""
    from engine.kv.buffer import KVWorkspace
    from engine.run import decode

    apart = tiny_engine.compare(SCHEMA, PROMPT, Sampling(max_new_tokens=8),
                                config=tiny_engine.config.with_(arms=("cached",), decode="apart"))
    made, real = [], KVWorkspace.buffer
    monkeypatch.setattr(KVWorkspace, "buffer", lambda self, n: made.append(n) or real(self, n))
    monkeypatch.setattr(decode, "BatchedKV", None)  # a batch would fail
    waited, batchable = [], decode.batchable
    monkeypatch.setattr(decode, "batchable", lambda lm, run: waited.append(batchable(lm, run)) or waited[-1])
    alone = tiny_engine.compare(SCHEMA, PROMPT, Sampling(max_new_tokens=8),
                                config=tiny_engine.config.with_(arms=("cached",), decode="together"))
    assert waited == [True]  # it waited for the others, and there were none
    assert len(made) == 1 and alone.arm("cached").run.decode_batch == 1 and alone.decode == "apart"
    assert alone.arm("cached").run.token_ids == apart.arm("cached").run.token_ids
    assert len(alone.arm("cached").run.token_ids) == 8
