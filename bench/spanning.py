"""Questions that span modules, with held-out discipline (issue 38): two facts from two modules, and every
module's fact, asked in three phrasings each, on two splits drawn with different seeds.

Sets (bench/needles.py; 8 or 4 essay modules of ~250 tokens, each holding a fact of one template about its own
subject):

* **two** — the question names two subjects whose facts sit in two modules; found = both answers, each with its
  own subject. Phrasings (``TWO_PHRASINGS``): ``both`` ("… And … Answer both in a few words"), ``natural``
  ("What are the names of the parrots kept by the harbour masters of A and of B?"), ``value-first`` (each answer
  first, then whom it belongs to).
* **all** — the question names no subject and needs every module ("What are the names of all the parrots …");
  recall = the share of the answers given. Phrasings (``ALL_PHRASINGS``): ``list``, ``natural``, ``value-first``.
* **single** / **confusable** (bench/fidelity.py's sets): one fact asked; the routed arm must lose nothing there.

The ``tune`` split (seed ``--seed``) is where a rule or threshold is chosen; the ``heldout`` split (seed + 1) is
only reported. The ``confirm`` split (seed + 2) runs only the baseline and the routed arm at the engine's defaults: an
unbiased figure for a default that was settled after the held-out split had been read; ``confirm2`` (seed + 3, two
facts) the same arms again, judged together with it. Arms (bench/fidelity.py's names): ``baseline``; ``prefixed``
(the modular arm); ``prefixed+route 0+share R`` (routed recomputing R % of its kept modules' tokens, those the
question attends to most, plus each one's first 4 tokens: issue 47; R = 100 is the routed arm of issue 38, every kept
token recomputed);
``+share 20+sinks 0`` (without the first tokens; tune split only); ``+joint off`` (routed reading every kept module as
stored). ``choose_setting`` picks the cheapest share that keeps the answers on the tune split; the held-out split is
reported, with a frontier plot (assets/spanning-frontier.png). TTFT is each answer's own run; ``× baseline`` is the
ratio of the mean TTFTs (the issue's lines), per-prompt ratios are in the JSON.

    python bench/spanning.py --model qwen2.5-coder-0.5b          # both splits, every set (long on 2 cores)
    python bench/spanning.py --model qwen2.5-coder-0.5b --splits confirm  # the default only, on a third split
    python bench/spanning.py --quick                             # 1 tiny prompt per set and phrasing, no file
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from xml.sax.saxutils import escape

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: a script has only bench/ on its path

from bench.common import bench_model, doc_schema, emit, essay_chunks, has_roles, machine, model_help, result_name, table
from bench import needles
from bench.runner import Runner
from bench.workloads import SYSTEM, wilson
from bench.labels import ROUTED, routed_default
from engine.arms.compare import run_arm
from engine.arms.registry import ArmContext, Sampling
from engine.model import WEIGHTS
from engine.session import Engine

SHARES = (10, 20, 30, 45, 60, 100)  # route_share settings measured, in % (100: issue 38's recompute of all kept)
SETTINGS = tuple(f"{ROUTED}+share {r}" for r in SHARES)
TODAY = f"{ROUTED}+share 100"  # the routed arm before issue 47
# Share 30 with the decode-time focus on its partial recompute, each focus ending with its clause ("clause")
FOCUSED = (f"{ROUTED}+share 30+focus clause",)
# The same shares with the prefix tree warmed in schema order: every module kept reads the full prefill's KV there.
# The tree path needs every module kept, which no two-fact prompt asks for (summaries count it: every_kept).
TREE = tuple(f"{a}+tree" for a in SETTINGS[:-1] + FOCUSED)
# The held-out split runs the arms the tune split chose between, less the variants it ruled out.
TUNE_ONLY = (f"{ROUTED}+share 20+sinks 0",)
ARMS = {
    "two": ("baseline", "prefixed", *SETTINGS, *FOCUSED, f"{ROUTED}+joint off"),
    "all": ("baseline", "prefixed", *SETTINGS, *TREE, *TUNE_ONLY),
    "single": ("prefixed", f"{ROUTED}+share 20", TODAY),
    "confusable": ("prefixed", f"{ROUTED}+share 20", TODAY),
}
# The engine's default routed arm (its share, the tree warmed as Engine.run warms it): all the confirm split runs.
DEFAULT = f"{routed_default()}+tree"
CONFIRM = ("baseline", DEFAULT)
# each split's seed over --seed; confirm2 measures confirm's default again, confirm3 and confirm4 each the one that
# follows the default a confirm split rejected
SEEDS = {"tune": 0, "heldout": 1, "confirm": 2, "confirm2": 3, "confirm3": 4, "confirm4": 5}
FRONTIER = Path(__file__).resolve().parent.parent / "assets" / "spanning-frontier.png"
NEW_TOKENS = {"two": 32, "all": 56, "single": 24, "confusable": 24}


def cases(chunks: list[str], split_seed: int, counts: dict) -> list[dict]:
    """Every case of one split: (set, modules, phrasing) blocks, each drawn with its own seed."""
    out = []
    for i, phrasing in enumerate(needles.TWO_PHRASINGS):
        out += [{**c, "set": "two"} for c in needles.phrased_two_fact_cases(
            chunks, 8, counts["two"], split_seed * 100 + i, phrasing)]
    for n in (4, 8):
        for i, phrasing in enumerate(needles.ALL_PHRASINGS):
            out += [{**c, "set": "all"} for c in needles.aggregate_cases(
                chunks, n, counts[f"all{n}"], split_seed * 100 + 10 * n + i, phrasing)]
    out += [{**c, "set": "single", "phrasing": "one"} for c in needles.varied_cases(
        chunks, 8, counts["single"], split_seed * 100 + 50)]
    out += [{**c, "set": "confusable", "phrasing": "one"} for c in needles.confusable_cases(
        chunks, 8, counts["confusable"], split_seed * 100 + 60)]
    return out


def round_robin(every: list[dict]) -> list[dict]:
    """The first prompt of each (set, modules, phrasing) block, then the second of each, ...: a run stopped early
    has covered every block (the rows are the same in any order)."""
    seen: dict = {}
    ranked = []
    for i, c in enumerate(every):
        block = (c["set"], c["modules"], c["phrasing"])
        seen[block] = seen.get(block, -1) + 1
        ranked.append((seen[block], i, c))
    return [c for *_, c in sorted(ranked, key=lambda t: t[:2])]


def texts(eng: Engine, case: dict, idx: int) -> tuple[str, str]:
    """(schema, prompt) of one case: its modules in order, then the question."""
    prompt = f'<prompt schema="span{idx}">' + "".join(f"<doc{i}/>" for i in range(case["modules"])) + \
        f" {escape(case['question'])}</prompt>"
    return doc_schema(f"span{idx}", case["docs"], system=SYSTEM, roles=has_roles(eng)), prompt


def split_arms(split: str, kind: str) -> tuple[str, ...]:
    """The arms one split runs on one set."""
    if split.startswith("confirm"):
        return CONFIRM if kind in ("two", "all") else CONFIRM[1:]
    return tuple(a for a in ARMS[kind] if not (split == "heldout" and a in TUNE_ONLY))


def arms_run(rows: list[dict] | None) -> list[str]:
    """The arms a split's rows ran, in the order first run."""
    return list(dict.fromkeys(a for r in rows or () for a, v in r.items() if isinstance(v, dict)))


def run_case(eng: Engine, case: dict, idx: int, arms: tuple[str, ...]) -> dict:
    """The given arms on one prompt of the case's set: its text, found (or recall), TTFT and what routing kept."""
    sampling = Sampling(max_new_tokens=NEW_TOKENS[case["set"]])
    question = escape(case["question"])
    schema, prompt = texts(eng, case, idx)
    lay = eng.layout(schema)
    plan = eng.plan(lay, prompt, sampling.max_new_tokens)
    asked = tuple(case.get("needle_modules") or [case["needle_module"]])
    runner = Runner(eng, lay, plan, sampling, asked)
    row = {k: case[k] for k in ("set", "phrasing", "modules", "kind", "subject", "answer")}
    row.update(prompt_tokens=plan.prompt_tokens, cached_tokens=plan.cached_tokens, asked=list(asked))
    for arm in arms:
        if arm == "only asked":  # the ceiling: a prompt holding only the asked modules, prefilled whole
            only = f'<prompt schema="span{idx}">' + "".join(f"<doc{i}/>" for i in asked) + f" {question}</prompt>"
            ctx = ArmContext(eng.lm, eng.plan(lay, only, sampling.max_new_tokens), None, None, sampling)
            run = run_arm(ctx, "baseline").run
        else:
            run = runner.run(arm)
        found, _ = needles.judge(run.text, case)
        row[arm] = {"text": run.text, "found": found, "ttft_ms": round(run.ttft_ms, 1),
                    "recomputed_tokens": run.recomputed_tokens, **runner.routed.get(arm, {})}
        if run.decode_ms_per_token is not None:  # a focused answer decodes with the Python step: its cost
            row[arm]["decode_ms_per_token"] = round(run.decode_ms_per_token, 2)
        if case["set"] == "all":
            row[arm]["recall"] = round(needles.recall(run.text, case), 4)
    for key in list(runner.store.keys()):  # modules are not shared between prompts
        runner.store.evict(key)
    return row


def run_repeat(eng: Engine, case: dict, idx: int, times: int) -> dict:
    """One request sent ``times`` times through ``Engine.compare`` with the prefix and the default routed arm (the
    API's arms): each send's TTFT, reused tokens and routed path. The prefix cache is warmed in schema order, which
    is this prompt's order: the prefix arm's best case."""
    schema, prompt = texts(eng, case, 1000 + idx)
    config = eng.config.with_(arms=("prefix", "routed"), decode="apart")
    sends = []
    for _ in range(times):
        comp = eng.compare(schema, prompt, Sampling(max_new_tokens=1), config=config)
        sends.append({str(arm): {"ttft_ms": round(r.run.ttft_ms, 2), "reused_tokens": r.run.reused_tokens,
                                 "prefill_tokens": r.run.prefill_tokens,
                                 **({"path": r.routing.path} if r.routing is not None else {})}
                      for arm, r in comp.arms.items()})
    return {"set": case["set"], "modules": case["modules"], "prompt_tokens": comp.plan.prompt_tokens,
            "sends": sends}


def summarise_repeats(rows: list[dict]) -> dict:
    """Over every send after the first: routed's TTFT over prefix's (min/median/max), how often routed was not
    slower, its paths, and the share of the prompt it reused."""
    later = [s for r in rows for s in r["sends"][1:]]
    ratio = [s["routed"]["ttft_ms"] / s["prefix"]["ttft_ms"] for s in later]
    return {"sends": len(later), "routed_ms": spread3([s["routed"]["ttft_ms"] for s in later], 2),
            "prefix_ms": spread3([s["prefix"]["ttft_ms"] for s in later], 2), "routed_vs_prefix": spread3(ratio, 3),
            "routed_not_slower": sum(x <= 1 for x in ratio),
            "paths": {p: sum(s["routed"]["path"] == p for s in later) for p in {s["routed"]["path"] for s in later}},
            "routed_reused_share": spread3([s["routed"]["reused_tokens"] / r["prompt_tokens"]
                                            for r in rows for s in r["sends"][1:]], 3)}


def summarise(rows: list[dict]) -> dict:
    """Per set, modules and phrasing (and over the phrasings): each arm's found with its Wilson interval, recall,
    TTFT and TTFT over the baseline's (min/median/max)."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        for key in (f"{r['set']}/{r['modules']}/{r['phrasing']}", f"{r['set']}/{r['modules']}/every phrasing"):
            groups.setdefault(key, []).append(r)
    out = {}
    for key, every in groups.items():
        arms = dict.fromkeys(a for r in every for a, v in r.items() if isinstance(v, dict))
        out[key] = {}
        for arm in arms:  # a split extended with fewer arms (--arms): each arm over the rows that ran it
            rs = [r for r in every if arm in r]
            found = sum(r[arm]["found"] for r in rs)
            ttft = [r[arm]["ttft_ms"] for r in rs]
            s = {"found": found, "n": len(rs), "accuracy": round(found / len(rs), 4), "ci95": wilson(found, len(rs)),
                 "ttft_ms": spread3(ttft)}
            for ref in ("baseline", "prefixed"):
                if all(ref in r for r in rs):  # per prompt, and of the means (the TTFT lines)
                    s[f"ttft_vs_{ref}"] = spread3([r[arm]["ttft_ms"] / r[ref]["ttft_ms"] for r in rs], 3)
                    s[f"mean_ttft_vs_{ref}"] = round(statistics.mean(ttft) / statistics.mean(
                        r[ref]["ttft_ms"] for r in rs), 3)
            decode = [r[arm]["decode_ms_per_token"] for r in rs if "decode_ms_per_token" in r[arm]]
            if decode:  # rows measured before this field have none
                s["decode_ms_per_token"] = spread3(decode, 2)
            if "recall" in rs[0][arm]:
                s["recall"] = round(statistics.mean(r[arm]["recall"] for r in rs), 4)
            if "joint" in rs[0][arm]:
                s["joint_recomputed"] = sum(bool(r[arm]["joint"]) for r in rs)
                s["asked_kept"] = sum(r[arm]["asked_kept"] for r in rs)
                s["recomputed_mean"] = round(statistics.mean(r[arm]["recomputed_tokens"] for r in rs), 1)
                s["every_kept"] = sum(len(r[arm]["kept"]) == r["modules"] for r in rs)
                paths = [r[arm].get("path", "") for r in rs]
                s["paths"] = {p: paths.count(p) for p in sorted(set(paths))}
            out[key][arm] = s
    return out


def choose_setting(tune: dict, rejected: set[str] = frozenset()) -> str | None:
    """The cheapest setting (mean TTFT over the baseline's, summed over the spanning sets) that keeps two-fact
    accuracy within 5 points of the baseline's in each phrasing and every-module recall within 10, on the tune
    split (settings that ran on every tune prompt), less the shares a confirm split ``rejected``; None if none. A
    tree setting on a set where its share never kept every module is that share's run (the same computation)."""
    costs = [k for k in tune if "every phrasing" in k and k.startswith(("two", "all")) and "baseline" in tune[k]]
    keys = costs + [k for k in tune if k.startswith("two") and "every phrasing" not in k and "baseline" in tune[k]]
    if not costs:  # a run of settings alone (--arms): nothing to weigh them against
        return None
    ok = []
    for arm in SETTINGS + FOCUSED + TREE:
        stats = {k: tune[k].get(arm) or _untouched(tune[k].get(arm.removesuffix("+tree"))) for k in keys}
        if arm.removesuffix("+tree") in rejected or not all(
                v and v["n"] == tune[k]["baseline"]["n"] for k, v in stats.items()):
            continue  # a candidate ran on every tune prompt: its accuracy and the baseline's are on the same ones
        if keeps(stats, {k: tune[k]["baseline"] for k in keys}):
            ok.append((sum(stats[k]["mean_ttft_vs_baseline"] for k in costs), arm))
    return min(ok)[1] if ok else None


def keeps(stats: dict, baseline: dict) -> bool:
    """The issue's lines, per summary key: two facts within 5 points of the baseline, every-module recall within 10."""
    return all(s["accuracy"] >= baseline[k]["accuracy"] - 0.05 if k.startswith("two")
               else s["recall"] >= baseline[k]["recall"] - 0.10 for k, s in stats.items())


def confirm_judged(rows: dict) -> dict[str, str]:
    """{routed arm: where its lines are judged}: the one confirm split that ran it, or all of them together
    ("confirm+confirm2", as said before the second one ran)."""
    by_arm: dict[str, list[str]] = {}
    for split in sorted(s for s in rows if s.startswith("confirm")):
        by_arm.setdefault(arms_run(rows[split])[-1], []).append(split)
    return {arm: "+".join(ss) for arm, ss in by_arm.items()}


def rejected_shares(summary: dict, judged: dict[str, str]) -> set[str]:
    """The routed settings (less ``+tree``) that the confirm rows which ran them (``judged``) measured outside the
    lines."""
    out = set()
    for arm, name in judged.items():
        lines = [k for k in summary[name] if k.startswith("two") or k.endswith("every phrasing")]
        if not all("baseline" in summary[name][k] for k in lines):  # rows run without it (--arms) judge nothing
            continue
        if not keeps({k: summary[name][k][arm] for k in lines}, {k: summary[name][k]["baseline"] for k in lines}):
            out.add(arm.removesuffix("+tree"))
    return out


def _untouched(s: dict | None) -> dict | None:
    """A share's summary where the tree path could not have run (no prompt kept every module), else None."""
    return s if s is not None and s.get("every_kept") == 0 else None


def plot_frontier(summary: dict, out: Path) -> None:
    """Accuracy (two facts) or recall (every module) against mean TTFT over the baseline's, one point per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = [k for k in ("two/8/every phrasing", "all/4/every phrasing", "all/8/every phrasing") if k in summary]
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
    for ax, key in zip(axes[0], keys):
        what = "accuracy" if key.startswith("two") else "recall"
        for i, (arm, s) in enumerate(summary[key].items()):
            x, y = s.get("mean_ttft_vs_baseline"), s.get(what)
            if x is None or y is None:
                continue
            ax.scatter([x], [y * 100], color="black" if arm == "baseline" else "#0f766e" if ROUTED in arm else "grey")
            ax.annotate(arm.replace(ROUTED, "routed").replace("prefixed", "modular"), (x, y * 100), fontsize=7,
                        xytext=(4, 4 - 9 * (i % 4)), textcoords="offset points")  # staggered: points sit close
        ax.set_xlabel("mean TTFT × baseline")
        ax.set_ylabel(f"{what} %")
        ax.set_title(f"{key.split('/every')[0]} (held-out, n={next(iter(summary[key].values()))['n']})")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def spread3(xs: list[float], digits: int = 1) -> dict:
    return {"min": round(min(xs), digits), "median": round(statistics.median(xs), digits),
            "mean": round(statistics.mean(xs), digits), "max": round(max(xs), digits)}


def print_split(name: str, summary: dict) -> None:
    for key, arms in summary.items():
        if "every phrasing" not in key and not key.startswith(("single", "confusable")):
            continue
        print(f"\n{name}: {key}")
        print(table(["arm", "found", "recall", "TTFT mean ms", "× baseline (means)", "recomputed", "paths"],
                    [[a, f"{s['found']}/{s['n']}", s.get("recall", "-"), s["ttft_ms"]["mean"],
                      s.get("mean_ttft_vs_baseline", "-"), s.get("recomputed_mean", "-"),
                      " ".join(f"{p} {n}" for p, n in s.get("paths", {}).items()) or "-"] for a, s in arms.items()]))


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help=model_help())
    ap.add_argument("--weights", default="gguf", choices=WEIGHTS, help="the studio's default: gguf")
    ap.add_argument("--seed", type=int, default=38, help="the tune split's seed; the held-out split's is seed + 1")
    ap.add_argument("--splits", nargs="+", default=["tune", "heldout"], choices=tuple(SEEDS))
    ap.add_argument("--tune", type=int, nargs=5, default=[6, 4, 3, 8, 8], metavar=("TWO", "ALL4", "ALL8", "SINGLE",
                    "CONFUSABLE"), help="tune-split prompts per phrasing (two, all of 4, all of 8) and per set")
    ap.add_argument("--heldout", type=int, nargs=5, default=[12, 8, 6, 24, 24], metavar=("TWO", "ALL4", "ALL8",
                    "SINGLE", "CONFUSABLE"), help="held-out prompts per phrasing and per set")
    ap.add_argument("--confirm", type=int, nargs=5, default=[12, 8, 6, 0, 0], metavar=("TWO", "ALL4", "ALL8",
                    "SINGLE", "CONFUSABLE"), help="confirm-split prompts per phrasing and per set")
    for split in ("confirm2", "confirm3", "confirm4"):  # two facts only: confirm's every-module rows do not read the share
        ap.add_argument(f"--{split}", type=int, nargs=5, default=[12, 0, 0, 0, 0], metavar=("TWO", "ALL4", "ALL8",
                        "SINGLE", "CONFUSABLE"), help=f"{split} split: prompts per phrasing and per set")
    ap.add_argument("--chunk-tokens", type=int, default=250, help="tokens of essay text per module")
    ap.add_argument("--rows-out", type=Path, help="keep every finished prompt's row in this file as the run goes")
    ap.add_argument("--from-rows", type=Path, help="summarise a --rows-out file instead of running (its optional "
                    "'commands' list names the runs that made it)")
    ap.add_argument("--repeats", type=int, default=0, metavar="N", help="also send N held-out prompts (two facts "
                    "and every module of 8, by turns) 3 times each with the prefix and default routed arms: "
                    "the identical-repeat line")
    ap.add_argument("--arms", nargs="+", help="run only these arms on every set (a split extended for the settings "
                    "still in question); summaries take each arm over the rows that ran it")
    ap.add_argument("--skip-rounds", type=int, default=0, metavar="K", help="leave out each block's first K prompts "
                    "(they were run before): with --tune 12 ... --skip-rounds 3, prompts 4 to 12 of each block")
    ap.add_argument("--phrasings", nargs="+", help="run only the prompts of these phrasings (a split extended where "
                    "a setting is still in question)")
    ap.add_argument("--quick", action="store_true", help="1 prompt per set and phrasing, tune split only, no file")
    args = ap.parse_args()
    if args.quick:
        args.splits, args.tune, args.chunk_tokens = ["tune"], [1, 1, 1, 1, 1], 40
    return args


def main() -> None:
    args = parse_args()
    t0 = time.perf_counter()
    eng = Engine(model=bench_model(args.model, args.quick).spec, weights=args.weights, persist=False)
    rows: dict[str, list[dict]] = json.loads(args.from_rows.read_text()) if args.from_rows else {}
    collected_by = rows.pop("commands", None)  # a merged rows file names the runs that made its rows
    if not args.from_rows:
        chunks = essay_chunks(eng.codec.encode, args.chunk_tokens)
        for split in args.splits:
            counts = dict(zip(("two", "all4", "all8", "single", "confusable"), getattr(args, split)))
            rows[split] = []
            every = round_robin(cases(chunks, args.seed + SEEDS[split], counts))
            skip = args.skip_rounds * len({(c["set"], c["modules"], c["phrasing"]) for c in every})
            for i, case in enumerate(every[skip:], skip):
                if args.phrasings and case["phrasing"] not in args.phrasings:
                    continue
                rows[split].append(run_case(eng, case, i, tuple(args.arms or split_arms(split, case["set"]))))
                r = rows[split][-1]
                print(f"{split} {i} {r['set']}/{r['modules']}/{r['phrasing']}: " + ", ".join(
                    f"{a} {'+' if v['found'] else '-'}{v.get('recall', '')}" for a, v in r.items()
                    if isinstance(v, dict)), flush=True)
                if args.rows_out:
                    args.rows_out.write_text(json.dumps(rows))
        if args.repeats:
            spanning = [c for c in round_robin(cases(chunks, args.seed + 1, dict(
                two=args.repeats, all4=0, all8=args.repeats, single=0, confusable=0))) if c["set"] in ("two", "all")]
            rows["repeats"] = [run_repeat(eng, c, i, 3) for i, c in enumerate(spanning[: args.repeats])]
            if args.rows_out:
                args.rows_out.write_text(json.dumps(rows))
    repeats = rows.pop("repeats", None)
    summary = {split: summarise(rs) for split, rs in rows.items()}
    judged = confirm_judged(rows)
    summary.update({n: summarise([r for s in n.split("+") for r in rows[s]]) for n in judged.values() if "+" in n})
    for split, s in summary.items():
        print_split(split, s)
    if repeats:
        summary["repeats"] = summarise_repeats(repeats)
        print("\nrepeats (every send after the first):", json.dumps(summary["repeats"]))
        rows["repeats"] = repeats
    rejected = rejected_shares(summary, judged)
    chosen = choose_setting(summary["tune"], rejected) if "tune" in summary else None
    print(f"\nchosen on the tune split: {chosen}")
    if summary.get("heldout") and not args.quick:
        plot_frontier(summary["heldout"], FRONTIER)
    emit(result_name("spanning-shares", eng.config.model), {  # issue 38's file (spanning-…) stays as it was
        "benchmark": "spanning-shares", "model": eng.config.model, "weights": eng.config.weights, "greedy": True,
        "new_tokens": NEW_TOKENS, "arms": ARMS, "tune_only": TUNE_ONLY, "confirm_arms": arms_run(rows.get("confirm"))
        or CONFIRM, "arms_run": {k: arms_run(v) for k, v in rows.items() if k != "repeats"},
        "chunk_tokens": args.chunk_tokens, "seeds": {k: args.seed + v for k, v in SEEDS.items()},
        "phrasings": {"two": {k: v(needles.FACTS[0], "A", "B") for k, v in needles.TWO_PHRASINGS.items()},
                      "all": {k: v(needles.FACTS[0]) for k, v in needles.ALL_PHRASINGS.items()}},
        "machine": machine(), "seconds": round(time.perf_counter() - t0, 1), "collected_by": collected_by,
        "chosen_on_tune": chosen, "rejected_by_confirm": sorted(rejected), "summary": summary, "rows": rows},
        write=not args.quick)


if __name__ == "__main__":
    main()
