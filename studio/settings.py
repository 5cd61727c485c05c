"""Run settings: the encode panel's widget values → one :class:`engine.config.RunConfig`.

Widget values reach handlers as a dict keyed by setting name (:class:`Panel`); :func:`run_config` is the one place
they become a config. Each arm's settings are read by key, so a new arm adds its controls without an edit here.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.public import settings_specs
from engine.config import RunConfig, budget_from_mib, choices
from engine.errors import EngineError

from .arm_views import view_of
from .errors import as_gr_error


def radio_choices(setting: str) -> list[tuple[str, str]]:
    if setting == "arms":
        return [(view_of(arm).title, arm) for arm, _ in choices("arms")]
    arm = next((spec.name for spec, _, s in settings_specs() if s.key == setting), None)
    if arm is not None:  # an arm's text setting: its view's plain words (the value stays the CLI's)
        return [(view_of(arm).words_of(setting, value), value) for value, _ in choices(setting)]
    return [(words, value) for value, words in choices(setting)]


def run_config(base: RunConfig, settings: dict) -> RunConfig:
    """``base`` with the panel's ``settings`` applied (empty ones keep base's); raises gr.Error."""
    given = {k: v for k, v in settings.items() if v not in (None, "")}
    with as_gr_error("reading the run settings"):
        changes = {
            "storage": given.get("storage"),
            "mode": given.get("mode"),
            "storage_dtype": given.get("storage_dtype"),
            "retention": given.get("retention"),
            "method": given.get("method"),
            "budget_bytes": budget_from_mib(given.get("budget_mib")),
            "sink": given.get("sink"),
            "arms": _arms(settings.get("arms")),
            # checked by the arm's settings class (4.0 from a slider is 4)
            **{s.key: given.get(s.key) for _, _, s in settings_specs()},
        }
        # the model, its device and dtype belong to the engine
        return base.with_(device=base.device, **{k: v for k, v in changes.items() if v is not None})


@dataclass(frozen=True)
class Panel:
    widgets: dict

    @property
    def inputs(self) -> list:
        return list(self.widgets.values())

    def values(self, args) -> dict:
        return dict(zip(self.widgets, args))

    def __len__(self) -> int:
        return len(self.widgets)


def _arms(chosen) -> tuple[str, ...] | None:
    """The arms checkbox's choice (None: not given, keep the base's); at least one arm."""
    if chosen is None:
        return None
    if isinstance(chosen, str):
        chosen = [a for a in chosen.split(",") if a.strip()]
    if not chosen:
        raise EngineError("choose at least one arm to run (the Arms checkboxes in the Compare tab)")
    return tuple(chosen)
