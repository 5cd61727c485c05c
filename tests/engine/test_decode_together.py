"""Arms decoded together (engine/run/decode.py, engine/run/forward.py): each row of a batched step over leases of
one pool computes what its run computes alone, and a comparison decoded together gives every arm the tokens it gets
decoding apart."""

from __future__ import annotations

import torch

from engine.arms.registry import Sampling
from engine.kv import KVPool
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
    """Three leases of one pool of different lengths (and gapped positions), garbage between them: one batched eager
    step's logits per row, against the same step over that row's cache alone (a DynamicCache: transformers' own
    path, no engine mask)."""
    from transformers.cache_utils import DynamicCache

    from engine.run.forward import Row, step

    model = tiny_lm.model
    torch.manual_seed(3)
    pool = KVPool(tiny_lm.n_layers, tiny_lm.kv_heads, tiny_lm.head_dim, torch.float32, "cpu", 8 << 20)
    lengths, firsts = [5, 11, 8], [0, 7, 30]
    leases, alone = [], []
    for n, first in zip(lengths, firsts):
        ids = torch.randint(5, 500, (1, n))
        pos = torch.arange(first, first + n)[None]
        cache = DynamicCache()
        _forward(model, ids, pos, cache)
        pool.lease(2).raw.normal_()  # a neighbour's slots, never read
        lease = pool.lease(n + 4)
        lease.write(torch.stack([torch.stack([l.keys[0], l.values[0]]) for l in cache.layers]))
        leases.append(lease)
        alone.append((cache, first + n))
    for s in range(3):
        nxt = torch.randint(5, 500, (3,))
        rows = [Row(lease, int(nxt[i]), p + s) for i, (lease, (_, p)) in enumerate(zip(leases, alone))]
        with torch.inference_mode():
            got = step(tiny_lm, rows).float()
        for row, (c, p) in enumerate(alone):
            want = _forward(model, nxt[row:row + 1][None], torch.tensor([[p + s]]), c)
            assert torch.allclose(got[row], want[0], atol=1e-5, rtol=1e-4), (s, row)
    assert [x.length for x in leases] == [n + 3 for n in lengths]


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




def test_a_lone_arm_decodes_in_place_in_its_own_lease(tiny_engine, monkeypatch):
    """A one-arm run (the API's) decodes in its one lease of the pool, never copied, the same tokens as decoding
    apart; the lease goes back to the pool when the run ends."""
    from engine.kv import KVPool

    apart = tiny_engine.compare(SCHEMA, PROMPT, Sampling(max_new_tokens=8),
                                config=tiny_engine.config.with_(arms=("cached",), decode="apart"))
    made, real = [], KVPool.lease
    monkeypatch.setattr(KVPool, "lease", lambda self, n: made.append(n) or real(self, n))
    alone = tiny_engine.compare(SCHEMA, PROMPT, Sampling(max_new_tokens=8),
                                config=tiny_engine.config.with_(arms=("cached",), decode="together"))
    assert len(made) == 1 and alone.arm("cached").run.decode_batch == 1 and alone.decode == "apart"
    assert alone.arm("cached").run.token_ids == apart.arm("cached").run.token_ids
    assert len(alone.arm("cached").run.token_ids) == 8
    assert tiny_engine.pool.held == {}
