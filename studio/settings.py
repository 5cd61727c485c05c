"""Run settings: the encode panel's widget values → one :class:`engine.config.RunConfig`.

The widgets (tabs/encode.py) read their choices from ``engine.config`` (``labelled()`` /
``values()``) and start at the engine's config; their values reach handlers as a dict keyed by
setting name (:class:`Panel`). :func:`run_config` is the one place those values become a
config, validated by the engine. A new run setting is one widget in the panel and one line in
:func:`run_config` — e.g. ``w["repair"] = gr.Slider(0, MAX_REPAIR, value=cfg.repair, step=1,
precision=0, label=...)`` (precision 0: Gradio then passes an int) and ``"repair": given.get("repair"),``.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import LIMITS, RunConfig, budget_from_mib

from .errors import as_gr_error


def run_config(base: RunConfig, settings: dict) -> RunConfig:
    """``base`` with the panel's ``settings`` applied (missing or empty ones keep base's); raises gr.Error."""
    given = {k: v for k, v in settings.items() if v not in (None, "")}
    with as_gr_error("reading the run settings"):
        changes = {
            "storage": given.get("storage"),
            "mode": given.get("mode"),
            "storage_dtype": given.get("storage_dtype"),
            "retention": given.get("retention"),
            "method": given.get("method"),
            "budget_bytes": budget_from_mib(given.get("budget_mib")),
            "repair": given.get("repair"),  # checked by RunConfig: a whole number (4.0 from a slider is 4)
            "sink": given.get("sink"),
            "blend_rule": given.get("blend_rule"),
        }
        changes.update(_blend(base, given.get("blend")))
        # the model, its device and dtype belong to the engine: a run changes only how modules are kept
        return base.with_(device=base.device, **{k: v for k, v in changes.items() if v is not None})


@dataclass(frozen=True)
class Panel:
    """The setting widgets, by setting name, in the order handlers receive their values."""

    widgets: dict

    @property
    def inputs(self) -> list:
        return list(self.widgets.values())

    def values(self, args) -> dict:
        """{setting: value} from the values Gradio passes for :attr:`inputs`."""
        return dict(zip(self.widgets, args))

    def __len__(self) -> int:
        return len(self.widgets)


def _blend(base: RunConfig, share) -> dict:
    """The blend slider: R > 0 runs the blend arm at R; 0 leaves it out; no value keeps the base's arms."""
    if share is None:
        return {}
    share = LIMITS["blend"].check(share)
    arms = tuple(a for a in base.arms if a != "blend")
    return {"arms": arms + ("blend",), "blend": share} if share > 0 else {"arms": arms}

