"""The committed benchmark results hold together the way a fresh --quick run must (tests/bench/test_bench_*.py run
the benchmarks), and the Fidelity plot stays readable.
"""

from __future__ import annotations

import json
import statistics

import pytest

from benchchecks import (RESULTS, check_compression, check_fidelity, check_fits, check_floor, check_ttft_row,
                         check_workload, shape_kv_bytes, wilson_roots)
from conftest import ROOT
from tests.contract.test_docs import load_report


def test_committed_results_pass_the_same_checks():
    """The results the README quotes hold together the way a fresh --quick run must."""
    data = {name: json.loads((RESULTS / f"{name}.json").read_text())
            for name in ("ttft", "scaling", "fidelity", "compression", "workload")}
    for d in (data["ttft"], data["scaling"]):
        for r in d["results"]:
            check_ttft_row(r, d["reps"])
            check_floor(r, d["reps"])
    check_fits(data["scaling"]["results"], data["scaling"]["fits"])
    for path in sorted(RESULTS.glob("gpu-ttft-*.json")):  # the lent GPU's runs, the random-weight shape's too
        d = json.loads(path.read_text())
        assert d["machine"]["cuda"] and d["machine"]["gpu"] and d["device"] == "cuda", path.name
        assert d.get("random_weights", False) == path.stem.endswith("-random"), path.name
        kv = shape_kv_bytes(d) if "shape" in d else 46_080 // (1 if d["dtype"] == "float32" else 2)
        for r in d["results"]:
            check_ttft_row(r, d["reps"], kv)
            check_floor(r, d["reps"])
    check_fidelity(data["fidelity"])
    check_compression(data["compression"])
    check_workload(data["workload"])


def test_committed_spanning_results_hold_together():
    """bench/spanning.py's summaries recomputed from its rows: found with Wilson roots, recall means, TTFT over the
    baseline's; the held-out split ran none of the variants the tune split ruled out, the confirm split only the
    engine's default."""
    paths = [p for p in sorted(RESULTS.glob("spanning-*.json")) if not p.stem.startswith("spanning-rows-")]
    if not paths:
        pytest.skip("no bench/spanning.py results committed")
    for path in paths:
        d = json.loads(path.read_text())
        for split, rows in d["rows"].items():
            if split == "repeats":  # the identical-repeat sends: every one after the first, routed over prefix
                later = [s for r in rows for s in r["sends"][1:]]
                ratio = [s["routed"]["ttft_ms"] / s["prefix"]["ttft_ms"] for s in later]
                summary = d["summary"]["repeats"]
                assert summary["sends"] == len(later) and summary["routed_not_slower"] == sum(x <= 1 for x in ratio)
                assert summary["routed_vs_prefix"]["median"] == pytest.approx(statistics.median(ratio), abs=1e-3)
                continue
            check_split_summary(d["summary"][split], rows, path.name)
            if split == "heldout":
                assert not {a for r in rows for a in r} & set(d["tune_only"])
            if split.startswith("confirm"):  # the baseline and the engine's default routed arm (then) only
                arms = [a for a, v in rows[0].items() if isinstance(v, dict)]
                assert arms[0] == "baseline" and len(arms) == 2 and all(list(r)[-2:] == arms for r in rows)
        last = max((s for s in d["rows"] if s.startswith("confirm")), default=None)
        for pool in (k for k in d["summary"] if "+" in k):  # confirm splits of one arm together, where it is judged
            check_split_summary(d["summary"][pool], [r for s in pool.split("+") for r in d["rows"][s]], path.name)
        if last:  # the newest confirm split measured the engine's default as it is now
            assert d["arms_run"][last][1] == f"{load_report().routed_default()}+tree"


def check_split_summary(summary: dict, rows: list[dict], name: str) -> None:
    """One split's summary against its rows: found and its Wilson roots, recall, mean TTFT over the baseline's."""
    for key, arms in summary.items():
        kind, modules, phrasing = key.split("/")
        rs = [r for r in rows if r["set"] == kind and str(r["modules"]) == modules
              and phrasing in ("every phrasing", r["phrasing"])]
        for arm, s in arms.items():
            ran = [r for r in rs if arm in r]  # a split extended with fewer arms (--arms)
            found = sum(r[arm]["found"] for r in ran)
            assert (s["found"], s["n"]) == (found, len(ran)), (name, key, arm)
            assert s["ci95"] == pytest.approx(wilson_roots(found, len(ran)), abs=1e-4)
            if "recall" in s:
                assert s["recall"] == pytest.approx(statistics.mean(r[arm]["recall"] for r in ran), abs=1e-4)
            if "mean_ttft_vs_baseline" in s:
                ratio = sum(r[arm]["ttft_ms"] for r in ran) / sum(r["baseline"]["ttft_ms"] for r in ran)
                assert s["mean_ttft_vs_baseline"] == pytest.approx(ratio, abs=1e-3)


def test_the_default_routed_label_reads_back_as_the_engine_s_defaults(monkeypatch):
    """The one label of the engine's default routed arm (bench/spanning.py runs it, bench/report.py quotes it)
    parses back, through the labels' own grammar, to the share and focus the engine defaults to."""
    from engine.arms.routed import DEFAULT_FOCUS, DEFAULT_SHARE

    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from fidelity import parse_arm

    spec = parse_arm(f"{load_report().routed_default()}+tree")
    assert (spec["route"], spec["share"], spec["focus"], spec["tree"]) == (0, round(DEFAULT_SHARE * 100),
                                                                          DEFAULT_FOCUS, True)


def test_fidelity_plot_labels_do_not_pile_up(monkeypatch, tmp_path):
    """Issue 48 item 7: the Fidelity plot's labels of points that sit together are spread so that none covers
    another (they piled up at one spot, unreadable); a point alone keeps its label beside it."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from fidelity import frontier_panels, plot_frontier, spread_labels

    cluster = [(0.10, 0.90), (0.11, 0.90), (0.12, 0.90), (0.12, 0.91), (0.13, 0.90), (0.99, 0.90), (0.5, 0.2)]
    sizes = [(0.15, 0.04)] * len(cluster)
    spots = spread_labels(cluster, sizes)
    boxes = [(x, y, x + w, y + h) for (x, y), (w, h) in zip(spots, sizes)]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1], (a, b)  # no two overlap
    assert spots[-1] == pytest.approx((0.51, 0.21))  # alone: just beside its point
    assert spots[5][0] + sizes[5][0] < 0.99  # at the right edge: left of its point, inside the axes
    data = json.loads((ROOT / "bench" / "results" / "fidelity.json").read_text())
    out = tmp_path / "frontier.png"
    plot_frontier(frontier_panels(data["frontier"], data["confusable"], data["confusable_modules"]), out, data["model"])
    assert out.stat().st_size > 10_000
