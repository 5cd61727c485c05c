"""The routed arm's look: which modules the question read, and each one's share of its pull."""

from engine.public import PromptPlan, RoutedInfo

from . import Bar, View, register


class RoutedView(View):
    def chips(self, detail: RoutedInfo) -> list[str]:
        d = detail
        kept = ", ".join(f"{m} {d.attention.get(m, 0) * 100:.0f} %" for m in d.kept) or "no module"
        moves = f"; focus {' → '.join(m or 'all (clause ended)' for _, m in d.moves)}" if d.moves else ""
        why = (f"each reached pull {d.min_pull:g}" if all(d.pull.get(m, 0) >= d.min_pull for m in d.joint)
               else f"no module reached pull {d.min_pull:g}, so the question may need them all")
        joint = f"; {', '.join(d.joint)} recomputed together ({why})" if d.joint else ""
        path = {"partial": f"; partial: {d.recomputed} tokens recomputed ({d.share:.0%} + first {d.sinks} of each)",
                "full": f"; full: {d.recomputed} tokens recomputed",
                "repeat": f"; repeat: {d.repeat_tokens} tokens of an identical earlier request read back, none "
                          "recomputed",
                "tree": "; every module read from the prefix tree (the full prefill's own KV), none recomputed"
                }.get(d.path, "")
        return [f"read {kept} of {len(d.attention)} modules; scout {d.scout_ms:.0f} ms{moves}{joint}{path}"]

    def bars(self, detail: RoutedInfo) -> list[Bar]:
        """(module, its share of the question's pull, read) per module."""
        return [(m, share, m in detail.kept) for m, share in detail.attention.items()]

    def marks(self, detail: RoutedInfo, plan: PromptPlan) -> dict[str, set[int]]:
        """{"routed-out": the positions of the modules the run did not read}."""
        if not detail.attention:
            return {}
        out = {p for at in plan.placed() if at.module is not None and at.module not in detail.kept
               for p in at.segment.positions}
        return {"routed-out": out} if out else {}


register(RoutedView("routed", "Routed", "module KV reused, only the modules the question reads", "#65a30d",
                    "Routed: scouting the question's attention, then reading the modules it picked…",
                    token_class=("routed-out", "not read by the routed arm (the question did not pick it)"),
                    copy_label="scout pass + KV copy (in TTFT)"))
