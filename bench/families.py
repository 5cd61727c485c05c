"""Model families: the table of what tests/engine/test_families.py checks, per family, from a run of it.

Runs ``pytest tests/engine/test_families.py`` in this process with a small plugin that records every
test's outcome per family (the tests build a tiny random model from each architecture's config,
no download; see the test module's docstring for what each check compares). Prints a markdown
table, then one JSON document last (also written to bench/results/families.json, which
bench/report.py turns into the README's table).

    python bench/families.py      # ~1 min on 2 CPU cores
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: a script has only bench/ on its path

from bench.common import ROOT, emit, machine, table

CHECKS = {  # test function -> column
    "test_baseline_equals_stock_transformers": "baseline = stock",
    "test_module_reused_at_its_offset_equals_one_pass_prefill": "module reuse exact at offset",
    "test_scaffold_imported_whole_is_exact": "scaffold exact",
    "test_gapped_positions_equal_one_pass_prefill_over_them": "gapped positions exact",
    "test_model_facts_name_the_attention_path": "attention path reported",
}


class Outcomes:
    """A pytest plugin: outcome of every parametrized check, per family: "passed", "failed" (an assertion
    did not hold: a wrong result) or "error" (anything else raised, in the test or its setup)."""

    def __init__(self):
        self.by_family: dict[str, dict[str, str]] = {}
        self.other: dict[str, str] = {}

    def pytest_runtest_makereport(self, item, call):
        if call.excinfo is not None and call.excinfo.errisinstance(pytest.skip.Exception):
            self._record(item.nodeid, "skipped")
        elif call.excinfo is not None:
            wrong = call.when == "call" and call.excinfo.errisinstance(AssertionError)
            self._record(item.nodeid, "failed" if wrong else "error")
        elif call.when == "call":
            self._record(item.nodeid, "passed")

    def _record(self, nodeid: str, outcome: str) -> None:
        m = re.match(r".*::(\w+)\[(.+)\]$", nodeid)
        if m and m.group(1) in CHECKS:
            slot = self.by_family.setdefault(m.group(2), {})
            if slot.get(CHECKS[m.group(1)]) in (None, "passed"):  # a setup error stays an error
                slot[CHECKS[m.group(1)]] = outcome
        else:
            self.other[nodeid.split("::")[-1]] = outcome


def main() -> None:
    plugin = Outcomes()
    t0 = time.perf_counter()
    code = pytest.main([str(ROOT / "tests" / "test_families.py"), "-q", "-p", "no:cacheprovider"], plugins=[plugin])
    rows = []
    for family, checks in plugin.by_family.items():
        runs = all(v != "error" for v in checks.values()) and len(checks) == len(CHECKS)
        rows.append({"family": family, "runs": runs, **{col: checks.get(col, "not run") for col in CHECKS.values()}})
    print(table(["family", "runs", *CHECKS.values()],
                [[r["family"], "yes" if r["runs"] else "no", *(r[c] for c in CHECKS.values())] for r in rows]))
    emit("families", {"benchmark": "families", "machine": machine(), "seconds": round(time.perf_counter() - t0, 1),
                      "pytest_exit_code": int(code), "checks": list(CHECKS.values()), "families": rows,
                      "other_tests": plugin.other})
    sys.exit(int(code))


if __name__ == "__main__":
    main()
