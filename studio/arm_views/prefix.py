"""The prefix-cache arm's look: what the cache held before the run."""

from engine.public import Held, PrefixReuse

from . import View, register


class PrefixView(View):
    def chips(self, detail: PrefixReuse) -> list[str]:
        return [f"held before this run: {held_words(detail.held)}"]

    def summary_facts(self, detail: PrefixReuse) -> list[str]:
        """A first run and a rerun told apart: the prefix arm's figure grows with what earlier runs left."""
        held, out = detail.held, []
        n = held.earlier_runs
        first = "only the schema-order warm-up" if held.warmup is not None else "no run"
        out.append(f"prefix cache: a first run, it held {first}" if n == 0 else
                   f"prefix cache: a rerun, it held {_plural(n, 'earlier run')} (its figure grows with them)")
        if held.warmup is not None and held.warmup.this_run:
            out.append(f"prefix warm-up {held.warmup.ms / 1000:,.1f} s before the arms ran "
                       f"({held.warmup.tokens} tokens, in no TTFT)")
        return out


def _plural(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n != 1 else ''}"


def held_words(held: Held) -> str:
    """'schema-order warm-up (3 modules, 516 tokens) + 2 earlier runs'."""
    parts = []
    if held.warmup is not None:
        when = f", warmed for this run in {held.warmup.ms / 1000:,.1f} s" if held.warmup.this_run else ""
        parts.append(f"schema-order warm-up ({_plural(len(held.warmup.modules), 'module')}, "
                     f"{held.warmup.tokens} tokens{when})")
    if held.other_schemas_warmed:
        parts.append(_plural(held.other_schemas_warmed, "other schema warm-up"))
    parts.append(_plural(held.earlier_runs, "earlier run"))
    return " + ".join(parts)


register(PrefixView("prefix", "Prefix cache", "the longest cached prefix reused, the rest prefilled", "#0d9488",
                    "Prefix cache: reusing the cached prefix, prefilling the rest…"))
