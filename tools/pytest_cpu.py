"""Where the suite's time goes: CPU seconds per test, its child processes included, one JSON line per test.

    make test ARGS="-p tools.pytest_cpu"               # writes $PYTEST_CPU_LOG-gw0.jsonl ... (default /tmp/pytest-cpu)
    python -m tools.pytest_cpu /tmp/pytest-cpu-*.jsonl # CPU and wall time per file, and when each worker ended

The suite runs on two cores with four workers, so CPU time, not wall time, says what a test costs: a test's wall
time grows with whatever the other workers run beside it.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time

import pytest

LOG = os.environ.get("PYTEST_CPU_LOG", "/tmp/pytest-cpu")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before, start = os.times(), time.perf_counter()
    yield
    after = os.times()
    row = {"test": item.nodeid, "wall": time.perf_counter() - start,
           "cpu": after.user - before.user + after.system - before.system,
           "children": (after.children_user - before.children_user
                        + after.children_system - before.children_system),  # reaped child processes
           "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "end": time.time()}
    with open(f"{LOG}-{row['worker']}.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")


def summary(paths: list[str], top: int = 25) -> str:
    rows = [json.loads(line) for p in paths for line in open(p) if line.strip()]
    first = min(r["end"] - r["wall"] for r in rows)
    cpu, wall = collections.Counter(), collections.Counter()
    for r in rows:
        name = r["test"].split("::")[0]
        cpu[name] += r["cpu"] + r["children"]
        wall[name] += r["wall"]
    ends = {}
    for r in rows:
        ends[r["worker"]] = max(ends.get(r["worker"], 0), r["end"] - first)
    lines = [f"{len(rows)} tests, {sum(cpu.values()):.0f} CPU s; workers ended at "
             + ", ".join(f"{w} {t:.0f} s" for w, t in sorted(ends.items()))]
    lines += [f"{c:7.1f} CPU s {wall[name]:7.1f} wall s  {name}" for name, c in cpu.most_common(top)]
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary(sys.argv[1:]))
