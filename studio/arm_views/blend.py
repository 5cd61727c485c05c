"""The blend arm's look: the share it recomputed, by which rule, and what choosing cost."""

from engine.public import BlendInfo

from . import View, register


class BlendView(View):
    def chips(self, detail: BlendInfo) -> list[str]:
        return [f"blend {detail.ratio:g} by {detail.rule}, selection {detail.selection_ms:.0f} ms"]


register(BlendView("blend", "Blend", "module KV reused, the most deviating share recomputed", "#be185d",
                   "Blend: choosing the deviating tokens, recomputing them with the rest…",
                   token_class=("blended", "recomputed by blend (chosen by deviation / rule)"),
                   choice_words=(("blend_rule", (("deviation", "most changed"), ("deviation-k", "most changed keys"),
                                                 ("deviation-v", "most changed values"), ("link", "link tokens"),
                                                 ("question", "what the question reads"), ("mixed", "a mix"),
                                                 ("random", "random (a control)"))),)))
