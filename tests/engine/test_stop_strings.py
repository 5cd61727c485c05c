"""``Sampling.stop``: a run ends at the token whose text completes a stop string (the OpenAI API's ``stop``), in
every arm and whether the arms decode together or apart; the tokens before it are the unstopped run's."""

from __future__ import annotations

import pytest

from engine.arms.registry import Sampling
from engine.errors import EngineError
from studio import files

ARMS = ("baseline", "prefix", "cached")


@pytest.mark.parametrize("decode", ["together", "apart"])
def test_a_run_ends_at_the_token_that_completes_a_stop_string(tiny_engine, decode):
    schema, prompt = files.load_sample("travel")
    cfg = tiny_engine.config.with_(decode=decode, arms=ARMS)
    whole = tiny_engine.compare(schema, prompt, Sampling(max_new_tokens=12), config=cfg)
    decode_text = tiny_engine.tokenizer.decode
    for arm in ARMS:
        ids = whole.arm(arm).run.token_ids
        texts = [decode_text(list(ids[:k]), skip_special_tokens=True) for k in range(1, len(ids) + 1)]
        k = next(k for k in range(2, len(ids)) if texts[k] != texts[k - 1])  # a token, after the first, adding text
        stop = texts[k][len(texts[k - 1]):][:2]
        cut = tiny_engine.compare(schema, prompt, Sampling(max_new_tokens=12, stop=(stop,)),
                                  config=cfg.with_(arms=(arm,))).arm(arm).run
        first = next(j for j, t in enumerate(texts) if stop in t)  # the first token whose text holds the stop
        assert cut.token_ids == ids[:first + 1] and stop in cut.text, arm


def test_stop_strings_are_checked_where_sampling_is_made():
    assert Sampling(stop="\n").stop == ("\n",) and Sampling(stop=["a", "b"]).stop == ("a", "b")
    assert "stop" not in Sampling().to_json() and Sampling.from_json(Sampling(stop=("x",)).to_json()).stop == ("x",)
    for bad in ([""], [3], "", None):
        with pytest.raises(EngineError, match="stop"):
            Sampling(stop=bad)
