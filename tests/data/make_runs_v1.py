# Wrote tests/data/runs-v1.db with the run log of commit 9d7bb5f (before the arms refactor): kept to show how.
import sys, pathlib
exec(open("tests/data/make_run_json_keys_v1.py").read().split("paths = set()")[0])
from engine.runlog import RunLog
out = pathlib.Path("tests/data/runs-v1.db"); out.unlink(missing_ok=True)
log = RunLog(out)
for arms, repair in ((("baseline", "prefix", "cached"), 0), (("baseline", "cached"), 2), (("cached",), 0), (("baseline", "prefix"), 0)):
    c = eng.compare(s, p, Sampling(max_new_tokens=3), config=eng.config.with_(arms=arms, repair=repair))
    log.record(c.to_json(), s, p, created_at="2026-11-20T10:00:00+00:00")
print(log.count())
