"""The prefix-cache arm's look: what the cache held before the run."""

from engine.arms.prefix import PrefixReuse

from . import View, register


class PrefixView(View):
    def chips(self, detail: PrefixReuse) -> list[str]:
        held = (detail.warmed_with or {}).get("summary")
        return [f"held before this run: {held}"] if held else []


register(PrefixView("prefix", "Prefix cache", "the longest cached prefix reused, the rest prefilled", "#0d9488",
                    "Prefix cache: reusing the cached prefix, prefilling the rest…"))
