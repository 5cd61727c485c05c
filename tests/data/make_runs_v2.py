# Writes tests/data/runs-v2.db with the run log as the code of the engine-in-layers change writes it (run log
# schema version 2, every arm in its own row, blend's detail in the stored document), from the tiny random
# Llama of the tests' tiny_lm fixture. Run from the repository root: python tests/data/make_runs_v2.py
import pathlib
import sys

sys.path.insert(0, "tests")
from conftest import SAMPLES, make_tiny_llama  # noqa: E402

from engine.arms.registry import Sampling  # noqa: E402
from engine.model.load import load_tokenizer  # noqa: E402
from engine.runlog import RunLog  # noqa: E402
from engine.session import Engine  # noqa: E402

_, tok, _ = load_tokenizer("SmolLM2-135M-Instruct")  # the small model the tests run
eng = Engine.from_loaded(make_tiny_llama(tok))
s, p = (SAMPLES / "travel.xml").read_text(), (SAMPLES / "travel.prompt.xml").read_text()
out = pathlib.Path("tests/data/runs-v2.db")
out.unlink(missing_ok=True)
log = RunLog(out)
for arms, changes in ((("baseline", "prefix", "cached", "blend"), {"blend": 0.25, "blend_rule": "question"}),
                      (("baseline", "cached"), {"repair": 2}), (("cached", "blend"), {"blend": 0.5})):
    c = eng.compare(s, p, Sampling(max_new_tokens=3), config=eng.config.with_(arms=arms, **changes))
    log.record(c.to_json(), s, p, created_at="2026-11-23T10:00:00+00:00")
log.close() if hasattr(log, "close") else None
print(log.count())
