"""HTML the studio draws: status boxes, the token view, memory readouts, the compare columns, chips.

Every function takes typed values (a Comparison, plans, store stats) and returns HTML, the user's text escaped. A
live run and one reopened from the run log take the same path; arms look as their views say (studio/arm_views/).
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Callable, Iterable

from engine.public import REGISTRY, Arm, Comparison, Reads, is_faster, speed_words
from engine.config import short_dtype

from .arm_views import View, view_of, views

MB = 1_000_000
MIB = 2**20  # the budget is set in MiB, like the CLI's --budget-mb



def ok_html(text_html: str) -> str:
    return f'<div class="pml-status ok">✓ {text_html}</div>'


def problems_html(title: str, problems: Iterable[str]) -> str:
    items = "".join(f"<li><code>{html.escape(p)}</code></li>" for p in problems)
    return f'<div class="pml-status err"><b>{html.escape(title)}</b><ul>{items}</ul></div>'


def error_html(text: str) -> str:
    return f'<div class="pml-status err">{html.escape(text)}</div>'


def note_html(text_html: str) -> str:
    return f'<div class="pml-note">{text_html}</div>'


def kv_html(rows: Iterable[tuple]) -> str:
    cells = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(str(v))}</td></tr>" for k, v in rows)
    return f'<table class="pml-kv">{cells}</table>'


def chips_html(model: str, state: str, runlog_path: str, warning: str = "", why: str = "") -> str:
    short = runlog_path if len(runlog_path) <= 30 else "…" + runlog_path[-29:]
    warn = (f'<span class="chip pml-chip warn" title="{html.escape(why)}"><b>run log</b> {html.escape(warning)}</span>'
            if warning else "")
    return (f'<div class="pml-chips"><span class="chip"><b>model</b> {html.escape(model)} · {state}</span>'
            f'<span class="chip" title="{html.escape(runlog_path)}"><b>run log</b> {html.escape(short)}</span>'
            f"{warn}</div>")


def logged_html(logged: dict | None) -> str:
    if not logged:
        return ""
    if not logged.get("ok"):
        chip = f'<span class="pml-chip warn">{html.escape(logged["error"])}</span>'
        return f'<div class="pml-chips pml-logged">{chip}</div>'
    notes = []
    if logged.get("flushed"):
        n = logged["flushed"]
        notes.append(f"{n} earlier run{'s' if n != 1 else ''} that waited in memory {'were' if n != 1 else 'was'} "
                     "logged with this one")
    if logged.get("flushed") and logged.get("dropped"):
        notes.append(f"{logged['dropped']} unlogged runs were dropped earlier (more waited than the studio keeps)")
    if not notes:
        return ""
    text = f"logged as run {logged['run_id']}; " + "; ".join(notes)
    return f'<div class="pml-chips pml-logged"><span class="pml-chip">{html.escape(text)}</span></div>'


def warn_html(text: str) -> str:
    return f'<div class="pml-status warn">{html.escape(text)}</div>'


def cards_html(cards: Iterable[tuple[str, str]], note: str = "") -> str:
    body = "".join(f'<div class="card"><span class="k">{html.escape(k)}</span><span class="v">{html.escape(v)}</span>'
                   "</div>" for k, v in cards)
    return f'<div class="pml-cards">{body}</div>' + (note_html(html.escape(note)) if note else "")


def retention_text(retention, method) -> str:
    r = 1.0 if retention is None else float(retention)
    return "100 % (full)" if r >= 1.0 else f"{r:.0%} {method or 'pyramid'}".replace("%", " %")



def highlight_html(text: str, lines: Iterable[int] = ()) -> str:
    from pygments import highlight
    from pygments.formatters import HtmlFormatter
    from pygments.lexers import XmlLexer
    from pygments.styles.default import DefaultStyle

    class ErrorLineStyle(DefaultStyle):
        highlight_color = "#fde2e1"
        line_number_color = "#9aa3af"
        line_number_background_color = "transparent"

    fmt = HtmlFormatter(noclasses=True, style=ErrorLineStyle, hl_lines=list(lines), linenos="inline",
                        cssclass="pml-highlight")
    return f'<div class="pml-code">{highlight(text or " ", XmlLexer(), fmt)}</div>'



BASE_TOKEN_CLASSES = {  # token class -> (css class, legend label); a view may add one (View.token_class)
    "cached": ("tok-cached", "cached module"),
    "anonymous": ("tok-anon", "cached system / template text"),
    "argument": ("tok-arg", "argument (prefilled at its param's positions)"),
    "new": ("tok-new", "new text (prefilled)"),
    "template": ("tok-tmpl", "template tokens (prefilled)"),
}


def token_classes() -> dict[str, tuple[str, str]]:
    arms = {v.token_class[0]: (f"tok-{v.token_class[0]}", v.token_class[1]) for v in views() if v.token_class}
    return {**BASE_TOKEN_CLASSES, **arms}
SEGMENT_CLASSES = {  # (segment kind, source) -> token class
    ("cached", "module"): "cached",
    ("cached", "anonymous"): "anonymous",
    ("uncached", "argument"): "argument",
    ("uncached", "text"): "new",
    ("uncached", "template"): "template",
    ("uncached", "anonymous"): "template",
    ("uncached", "module"): "new",
}
def token_marks(comparison: Comparison | None) -> dict[str, set[int]]:
    out: dict[str, set[int]] = {}
    for view in views():
        res = comparison.arm(view.arm) if comparison is not None and view.token_class else None
        if res is not None and res.run.recomputed_positions:
            out[view.token_class[0]] = set(res.run.recomputed_positions)
        if res is not None and res.detail is not None and comparison.plan is not None:
            out.update(view.marks(res.detail, comparison.plan))
    return out


def prefix_stop(comparison: Comparison | None) -> int | None:
    pre = comparison.arm(Arm.PREFIX) if comparison is not None else None
    return None if pre is None else pre.run.reused_tokens


def token_view_html(plan, decode: Callable[[int], str], marks: dict[str, set[int]] | None = None,
                    stop: int | None = None) -> str:
    """The prompt as coloured tokens, hover showing owner, kind and position; ``marks`` ({class: positions})
    overrides classes, ``stop`` marks where prefix-cache reuse stopped."""
    legend: dict[str, str] = {}
    classes = token_classes()
    spans = []
    if stop is not None:
        legend["tok-stop"] = f"prefix cache reused {stop} tokens, up to ▌"
    index = 0
    for seg in plan.segments:
        base = SEGMENT_CLASSES.get((seg.kind, seg.source), "new")
        owner = seg.owner or ("prompt text" if seg.source in ("text", "argument") else "system / template")
        for tid, pos in zip(seg.token_ids, seg.positions or (None,) * len(seg.token_ids)):
            name = next((c for c, where in (marks or {}).items() if pos in where), base)
            cls, label = classes.get(name, classes["new"])
            legend[cls] = label
            shown = html.escape(decode(tid)).replace("\n", "↵\n")
            title = html.escape(f"{owner} · {seg.kind} · position {pos} · id {tid}")
            if index == stop:
                spans.append(f'<span class="tok-stop" title="prefix cache reuse stopped here: {stop} tokens reused, '
                             'the rest prefilled">▌</span>')
            spans.append(f'<span class="tok {cls}" title="{title}">{shown}</span>')
            index += 1
    keys = "".join(f'<span class="tok {c}">{html.escape(lbl)}</span>' for c, lbl in legend.items())
    stats = (f"{plan.prompt_tokens} tokens · {plan.cached_tokens} cached · {plan.uncached_tokens} prefilled "
             f"({100 * plan.uncached_tokens / max(plan.prompt_tokens, 1):.0f} %)")
    return (f'<div class="pml-tokens"><div class="tok-legend">{keys}<span class="tok-stats">{stats}</span></div>'
            f'<div class="tok-body">{"".join(spans)}</div></div>')



MEMORY_ROWS = [("module memory", "bytes"), ("entries", "entries"), ("budget", "budget_bytes"), ("pinned", "pinned"),
               ("evictions", "evictions"), ("disk loads", "disk_loads"), ("disk writes", "disk_writes"),
               ("disk write errors", "disk_write_errors"), ("corrupted files", "disk_corrupt")]


def memory_html(before: dict, after: dict) -> str:
    def fmt(key: str, value) -> str:
        if key in ("bytes", "budget_bytes"):
            return "none" if value is None else f"{value / MIB:,.1f} MiB"
        return f"{value:,}" if isinstance(value, int) else html.escape(str(value))

    rows = []
    for label, key in MEMORY_ROWS:
        b, a = before.get(key), after.get(key)
        cls = ' class="changed"' if a != b else ""
        rows.append(f"<tr{cls}><th>{label}</th><td>{fmt(key, b)}</td><td>{fmt(key, a)}</td></tr>")
    note = error_html(after["disk_error"]) if after.get("disk_error") else ""
    where = "GPU" if str(after.get("device", "")).startswith("cuda") else "CPU"
    return (f'<table class="pml-memory"><thead><tr><th>{where} module store</th><th>before</th><th>after</th></tr>'
            f'</thead><tbody>{"".join(rows)}</tbody></table>{note}')



def head_html(view: View) -> str:
    return f'<div class="col-head">{view.title} <span>{view.subtitle}</span></div>'


DIVERGE_KEYS = {  # what the highlight means in a column: the baseline is the reference, never the wrong one
    True: "highlighted: from here on another arm's answer differs from this one (the baseline is the reference)",
    False: "highlighted: from here on this answer differs from the baseline's (its first differing token on)",
}


def column_html(text: str, active: bool, marker: int | None = None, reference: bool = False,
                stopped: bool = False) -> str:
    """A generated-text column; text from the character offset ``marker`` on is marked as divergent, with its key
    below (``reference``: the baseline's column). ``stopped`` differs from every earlier value of the column, so the
    page redraws it over what its live stream wrote (a caret) since Gradio last sent it."""
    key = ""
    if marker is not None and 0 <= marker <= len(text):
        why = DIVERGE_KEYS[reference]
        body = (html.escape(text[:marker])
                + f'<mark class="diverge" title="{html.escape(why)}">{html.escape(text[marker:]) or "∅"}</mark>')
        key = f'<div class="pml-legend"><mark class="diverge">&nbsp;&nbsp;</mark> {html.escape(why)}</div>'
    else:
        body = html.escape(text)
    cursor = '<span class="caret"></span>' if active else ""
    state = " active" if active else " stopped" if stopped else ""
    return f'<div class="pml-output{state}">{body or "&nbsp;"}{cursor}</div>{key}'


def not_run_html() -> str:
    """The column of an arm that could not run: no answer to read or to set against the baseline's."""
    return '<div class="pml-output not-run">did not run (the reason is below)</div>'


def reuse_counts(comparison: Comparison, arm: str) -> tuple[int, int]:
    run = comparison.arm(arm).run
    return run.reused_tokens, run.prefill_tokens


def metrics_html(comparison: Comparison | None, arm: str) -> str:
    res = comparison.arm(arm) if comparison is not None else None
    if res is None:
        return '<div class="pml-metrics empty">TTFT, decode speed and memory appear here after a run.</div>'
    view = view_of(arm)
    if not res.ran:  # a remote arm whose server failed: the reason, never zeros
        return (f'<div class="pml-arm-chips"><span class="badge warn">could not run: no figures</span></div>'
                + error_html(view.reason(res.detail, res.error)))
    run = res.run
    reused, prefilled = reuse_counts(comparison, arm)
    stored = "" if run.precomputed_tokens == reused else f" · {run.precomputed_tokens:,} stored before this run"
    chips = f'<span class="badge">{reused:,} reused · {prefilled:,} prefilled{stored}</span>'
    speedup = comparison.speedup(arm)
    if res.repeat:
        chips += REPEAT_BADGE
    elif speedup is not None:
        chips += speed_badge(speedup)
    for text in (view.chips(res.detail) if res.detail is not None else ()):
        chips += f'<span class="badge">{html.escape(text)}</span>'
    chips += bars_html(view.bars(res.detail) if res.detail is not None else ())
    rows = first_rows(run, arm)
    rows += [decode_row(run), ("new tokens", str(run.decode_tokens))]
    rows += agreement_rows(res.agreement)
    rows += kv_rows(run, arm)
    rows += [("process peak", f"{run.peak_rss_bytes / MB:,.0f} MB RSS"
              + (f" · {run.cuda_peak_bytes / MB:,.0f} MB GPU" if run.cuda_peak_bytes else ""))]
    cells = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows)
    return f'<div class="pml-arm-chips">{chips}</div><table class="pml-metrics">{cells}</table>'


REPEAT_BADGE = ('<span class="badge repeat" title="an identical earlier request: its KV was read back, so this TTFT '
                'times a lookup, not this arm\'s work">repeat of an earlier identical request: no speedup</span>')


def agreement_rows(agree) -> list[tuple[str, str]]:
    """How an arm's answer compares with the baseline's (every arm but the baseline; `pml-studio run` prints the
    same)."""
    if agree is None:
        return []
    text = "same as the baseline's" if agree.same_text else f"differs from token {agree.first_divergence}"
    first = "agrees" if agree.first_token_agree else "differs"
    return [("answer", text), ("first token", f"{first} · KL {agree.first_token_kl:.4f}")]


def first_rows(run, arm: str) -> list[tuple[str, str]]:
    tokens = "1 token" if run.prefill_tokens == 1 else f"{run.prefill_tokens} tokens"
    rows = [("TTFT", f"{run.ttft_ms:.1f} ms"), ("prefill", f"{tokens} in {run.prefill_ms:.1f} ms")]
    if arm != Arm.BASELINE:
        rows.append((view_of(arm).copy_label, f"{run.copy_ms:.1f} ms"))
    return rows


def decode_row(run) -> tuple[str, str]:
    """Decode speed; arms decoded together share one batch's steps, so the figure is the batch's."""
    dec = run.decode_ms_per_token
    if dec is None:
        return "decode", "–"
    if run.decode_shared > 0:  # a served studio: API requests' runs decoded in the same steps
        return "decode (shared batch)", (f"{dec:.1f} ms/step, a batch of up to {run.decode_batch} runs, "
                                         f"{run.decode_shared:g} of them other requests' on average")
    if run.decode_batch > 1:  # the batch shrinks as arms end
        return "decode (shared batch)", f"{dec:.1f} ms/step, a batch of up to {run.decode_batch} arms"
    return "decode", f"{dec:.1f} ms/token"


def first_token_html(run, arm: str) -> str:
    cells = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in first_rows(run, arm))
    return (f'<div class="pml-arm-chips"><span class="badge">first token in; decoding…</span></div>'
            f'<table class="pml-metrics pml-first">{cells}</table>')


def stopped_html(run, arm: str) -> str:
    """An arm's figures after a Stop: its first-token rows if it had one, and no "decoding…"."""
    if run is None:
        return '<div class="pml-arm-chips"><span class="badge warn">stopped before its first token</span></div>'
    cells = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in first_rows(run, arm))
    return (f'<div class="pml-arm-chips"><span class="badge warn">stopped after its first token</span></div>'
            f'<table class="pml-metrics pml-first">{cells}</table>')


@dataclass(frozen=True)
class Lead:
    """The arm the summary leads with and why."""

    arm: str
    speedup: float  # the baseline's TTFT / its TTFT
    same: bool  # its answer is the baseline's
    faster: bool  # its first token came sooner than the baseline's (engine.words.SAME_SPEED)


def headline(comparison: Comparison) -> Lead | None:
    """The fastest arm that keeps the baseline's answer and is faster; else the fastest faster arm; else the least
    slow (read as slower, never crowned). None when no arm can be set against the baseline."""
    ranked = []
    for res in comparison.arms.values():
        speedup = comparison.speedup(res.arm)
        if speedup is not None and not res.repeat:  # a repeat's TTFT is a lookup's
            same = res.agreement is not None and res.agreement.same_text
            ranked.append(Lead(str(res.arm), speedup, same, is_faster(speedup)))
    if not ranked:
        return None
    pool = [r for r in ranked if r.faster and r.same] or [r for r in ranked if r.faster] or ranked
    return max(pool, key=lambda r: r.speedup)


def speed_badge(speedup: float) -> str:
    """An arm's first token against the baseline's: green only when it is faster."""
    cls = "good" if is_faster(speedup) else "warn" if speedup < 1 else ""
    return f'<span class="badge speed {cls}">{speed_words(speedup)} first token</span>'


def bars_html(bars) -> str:
    rows = "".join(
        f'<div class="pml-bar{" on" if on else ""}" title="{html.escape(label)}: {share * 100:.1f} %">'
        f'<span class="pml-bar-label">{html.escape(label)}</span>'
        f'<span class="pml-bar-track"><span class="pml-bar-fill" style="width:{max(0.0, min(1.0, share)) * 100:.1f}%">'
        f'</span></span><span class="pml-bar-value">{share * 100:.0f} %</span></div>' for label, share, on in bars)
    return f'<div class="pml-bars">{rows}</div>' if rows else ""


def kv_rows(run, arm: str) -> list[tuple[str, str]]:
    """The KV bytes an arm held: what it read from a store plus the run's buffer, and what decoding ran over."""
    held = run.kv_held_bytes
    if not held:
        return []  # a run logged before these figures existed
    store, buf = run.kv_store_bytes, run.kv_buffer_used_bytes
    spec = REGISTRY.get(str(arm))
    source = None if spec is None or spec.reads == Reads.NOTHING else spec.reads
    detail = "prompt buffer" if source is None else f"{source} {store / MB:,.1f} + buffer {buf / MB:,.1f}"
    rows = [("KV held", f"{held / MB:,.1f} MB ({detail})")]
    after = run.kv_buffer_bytes_after_retention or buf
    if after < buf:
        rows.append(("decoded over", f"{after / MB:,.1f} MB after retention ({after / buf:.0%} of the buffer)"))
    return rows


def summary_html(comparison: Comparison | None, message: str = "", live: str = "") -> str:
    """The line above the columns: the headline arm's speedup and agreement (while a run goes, its ``message`` and
    the ``live`` marker the page reads its texts by)."""
    if comparison is None:
        text = html.escape(message) if message else "Press <b>Compare</b> to run the arms on the prompt."
        return f'<div class="pml-summary idle"><span class="pml-live-message">{text}</span>{live}</div>'
    lead = headline(comparison)
    big, sub = _lead_words(lead, [str(a) for a, res in comparison.arms.items() if res.repeat])
    facts = []
    agree = comparison.agreement(lead.arm) if lead is not None else None
    if agree is not None:
        facts.append('<span class="badge good">same text</span>' if agree.same_text
                     else f'<span class="badge warn">diverges at token {agree.first_divergence}</span>')
        facts.append('<span class="badge good">first token agrees</span>' if agree.first_token_agree
                     else '<span class="badge warn">first token differs</span>')
        facts.append(f'<span class="badge">first-token KL {agree.first_token_kl:.4f}</span>')
    p = comparison.prompt
    facts.append(f'<span class="badge">{p.cached_tokens} of {p.prompt_tokens} prompt tokens in modules</span>')
    facts.append(f'<span class="badge">{html.escape(comparison.store.device)} · {html.escape(comparison.mode)}</span>')
    facts += _repair_badges(comparison)
    facts += [f'<span class="badge repeat">{html.escape(view_of(str(a)).title)}: a repeat of an earlier identical '
              'request (read back), not in the headline</span>' for a, res in comparison.arms.items() if res.repeat]
    facts += [f'<span class="badge history">{html.escape(fact)}</span>' for res in comparison.arms.values()
              if res.detail is not None for fact in view_of(str(res.arm)).summary_facts(res.detail)]
    slower = " slower" if lead is not None and not lead.faster else ""
    return (f'<div class="pml-summary"><div class="speedup{slower}"><span class="big">{big}</span>'
            f'<span class="sub">{sub}</span></div>'
            f'<div class="facts">{"".join(facts)}{_memory_badges(comparison)}</div></div>')


def _lead_words(lead: Lead | None, repeats: list[str] = ()) -> tuple[str, str]:
    """(the big figure, the line under it); ``repeats``: the arms that read back an identical earlier request."""
    if lead is None and repeats:
        names = ", ".join(html.escape(view_of(a).title) for a in repeats)
        return "repeat", (f"{names}: an identical earlier request read back, so no speedup to show; change the "
                          "prompt to time the arms")
    if lead is None:
        return "–", "faster first token (no arm to set against the baseline)"
    title = f"<b>{html.escape(view_of(lead.arm).title)}</b>"
    if not lead.faster:  # read as slower: a ratio under 1 is never "faster"
        return speed_words(lead.speedup), f"first token at best: {title}; no arm's came before the baseline's"
    why = ("the fastest arm whose answer is the baseline's" if lead.same
           else "the fastest arm; no faster arm's answer is the baseline's")
    return f"{lead.speedup:.1f}×", f"faster first token: {title}, {why}"


def _repair_badges(comparison: Comparison) -> list[str]:
    cached = comparison.cached
    n = cached.recomputed_tokens if cached is not None else 0
    if not comparison.repair and not n:
        return []
    if not n:
        return [f'<span class="badge">repair K={comparison.repair}: nothing to recompute</span>']
    prefilled = cached.prefill_tokens or n
    cost = cached.prefill_ms * n / prefilled
    return [f'<span class="badge tok-recomputed">repair K={comparison.repair}: {n} cached tokens recomputed '
            f'({n / prefilled:.0%} of the cached prefill, ≈{cost:.0f} ms of its TTFT)</span>']


def _memory_badges(comparison: Comparison) -> str:
    comp = comparison.store.compression or {}
    kept = comp.get("retention")
    extra = "" if kept is None or kept >= 1.0 else f' · {retention_text(kept, comp.get("method"))} kept'
    out = f'<span class="badge">{short_dtype(comparison.store.dtype)} storage{extra}</span>'
    enc = comparison.encode
    if enc:
        out += (f'<span class="badge">units: {enc.get("memory", 0)} memory · {enc.get("disk", 0)} disk · '
                f'{enc.get("encoded", 0)} encoded</span>')
    if enc and enc.get("unsaved"):
        out += (f'<span class="badge warn" title="{html.escape(enc.get("store_note", ""))}">{enc["unsaved"]} unit(s) '
                "not saved: the module store's disk refused them (full or read-only); this run used them from "
                "memory</span>")
    return out
