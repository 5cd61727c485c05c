"""The mixed workload's prompts (bench/needles.py :func:`make_workload`) through the arms, one row each, and their
summary per arm: what bench/workload.py and bench/peers.py measure alike."""

from __future__ import annotations

import statistics

from bench.needles import judge, prompt_xml
from bench.workloads import wilson
from engine.arms.registry import Sampling
from engine.session import Engine


def run_prompt(eng: Engine, schema: str, p: dict, sampling: Sampling, sweep: tuple[float, ...] = ()) -> dict:
    """One prompt through the configured arms (``Engine.compare``), then through the blend arm alone at each
    ratio of ``sweep`` (rows ``blend R%``), the module encodings reused."""
    c = eng.compare(schema, prompt_xml(p), sampling)
    data = c.to_json()
    row = {"imports": [f"doc{i}" for i in p["imports"]], "asked": f"doc{p['asked']}", "schema_order": p["schema_order"],
           "kind": p["kind"], "answer": p["answer"],
           "prompt_tokens": data["prompt_tokens"], "cached_tokens": data["cached_tokens"],
           "prefix_bytes_after": data["store_stats"]["prefix_bytes"]}
    for arm in data["arms"]:
        r = data[arm]
        found, confused = judge(r["text"], p)
        row[arm] = {"ttft_ms": r["ttft_ms"], "prefilled_tokens": r["prefill_tokens"], "reused_tokens": r["reused_tokens"],
                    "decode_ms_per_token": r["decode_ms_per_token"], "text": r["text"], "found": found,
                    "confused": confused}
    if data["prefix"]:
        row["prefix"].update(stopped_at=data["prefix"]["stopped_at"], repeat=data["prefix"]["repeat"],
                             same_text=data["prefix_same_text"], first_token_kl=data["prefix_first_token_kl"])
        row["prefix"]["broke"] = data["prefix"]["reused_tokens"] < data["cached_tokens"]
    if data["cached"] and data["baseline"]:
        row["cached"].update(same_text=data["same_text"], first_token_kl=data["first_token_kl"])
    if data.get("blend"):
        row["blend"].update(recomputed_tokens=data["blend"]["recomputed_tokens"],
                            blend_ratio=data["blend"].get("blend_ratio"),
                            selection_ms=data["blend"].get("selection_ms"))
    row["store_bytes"] = data["store_bytes"]
    for ratio in sweep:
        cfg = eng.config.with_(arms=("blend",), blend=ratio)
        b = eng.compare(schema, prompt_xml(p), sampling, config=cfg).arm("blend").run
        found, confused = judge(b.text, p)
        row[sweep_arm(ratio)] = {"ttft_ms": round(b.ttft_ms, 2), "prefilled_tokens": b.prefill_tokens,
                                 "reused_tokens": b.reused_tokens, "recomputed_tokens": b.recomputed_tokens,
                                 "text": b.text, "found": found, "confused": confused}
    return row


def sweep_arm(ratio: float) -> str:
    return f"blend {round(ratio * 100)}%"


def pct(xs: list[float], q: float) -> float:
    """Percentile ``q`` (0-100) by linear interpolation between closest ranks."""
    s = sorted(xs)
    if len(s) == 1:
        return s[0]
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarise(rows: list[dict], arms: list[str]) -> dict:
    out = {}
    for arm in arms:
        ttft = [r[arm]["ttft_ms"] for r in rows]
        ordered = [r[arm]["ttft_ms"] for r in rows if r["schema_order"]]
        other = [r[arm]["ttft_ms"] for r in rows if not r["schema_order"]]
        found = sum(r[arm]["found"] for r in rows)
        s = {"mean_ttft_ms": round(statistics.mean(ttft), 2), "p50_ttft_ms": round(pct(ttft, 50), 2),
             "p90_ttft_ms": round(pct(ttft, 90), 2),
             "schema_order_mean_ttft_ms": round(statistics.mean(ordered), 2) if ordered else None,
             "other_mean_ttft_ms": round(statistics.mean(other), 2) if other else None,
             "prefilled_tokens": sum(r[arm]["prefilled_tokens"] for r in rows),
             "reused_tokens": sum(r[arm]["reused_tokens"] for r in rows),
             "needle_found": found, "n": len(rows), "needle_accuracy": round(found / len(rows), 4),
             "ci95": wilson(found, len(rows)), "confused": sum(r[arm].get("confused", False) for r in rows)}
        if "recomputed_tokens" in rows[0][arm]:
            s["recomputed_tokens"] = sum(r[arm]["recomputed_tokens"] for r in rows)
        if arm == "baseline":
            s["cache_bytes"] = 0
        elif arm == "prefix":
            s["cache_bytes"] = rows[-1]["prefix_bytes_after"]
            s["cache_bytes_max"] = max(r["prefix_bytes_after"] for r in rows)
            s["reuse_broke"] = sum(r["prefix"]["broke"] for r in rows)
            s["same_answers_as_baseline"] = (sum(r["prefix"]["text"] == r["baseline"]["text"] for r in rows)
                                             if "baseline" in arms else None)
        else:
            s["cache_bytes"] = rows[-1]["store_bytes"]
        out[arm] = s
    return out
