"""How the studio shows each arm: its column title, subtitle, colour, progress text, chips and bars.

A :class:`View` turns an arm's typed detail into words, found by arm name; an arm without a view file gets a title
from its name and a colour from :data:`PALETTE`. :data:`WORDS` gives the same words to ``pml-studio run``.
"""

from __future__ import annotations

import importlib
import pkgutil
import zlib
from dataclasses import dataclass, replace
from typing import Any

from engine.public import ArmWords, titled

PALETTE = ("#7c3aed", "#db2777", "#0891b2", "#65a30d", "#ca8a04", "#dc2626", "#2563eb", "#9333ea")

Bar = tuple[str, float, bool]  # (what, share 0..1, highlighted)


@dataclass(frozen=True)
class View:
    """One arm's look. Empty fields are derived from the arm's name (:meth:`filled`)."""

    arm: str
    title: str = ""
    subtitle: str = ""
    color: str = ""
    progress: str = ""  # what the page says while the arm runs
    token_class: tuple[str, str] | None = None  # (name, legend) of its recomputed tokens in the token view
    copy_label: str = "KV copy (in TTFT)"
    choice_words: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()  # (setting key, ((value, words), ...))

    def words_of(self, key: str, value: str) -> str:
        """A text setting's choice in plain words (the value itself when the view has none)."""
        return dict(dict(self.choice_words).get(key, ())).get(value, value)

    def chips(self, detail: Any) -> list[str]:
        """Short facts under the arm's column (and in `pml-studio run`'s text)."""
        return []

    def summary_facts(self, detail: Any) -> list[str]:
        """Facts the summary above the columns must say about this arm (what its figure depends on)."""
        return []

    def bars(self, detail: Any) -> list[Bar]:
        return []

    def reason(self, detail: Any, error: str) -> str:
        """Why the arm could not run, in the studio's words: a CLI option is named as the control that sets it."""
        return in_studio_words(error)

    def marks(self, detail: Any, plan) -> dict[str, set[int]]:
        """Token view classes of its own: {token class: positions}."""
        return {}

    def filled(self) -> "View":
        title = self.title or self.arm.replace("_", " ").capitalize()
        return replace(self, title=title, color=self.color or _palette(self.arm),
                       progress=self.progress or f"{title}: running…")


def in_studio_words(text: str) -> str:
    """``text`` with each arm setting's CLI option (``--vllm-url``) named as its studio control (“vLLM: server
    URL”, in its arm's settings beside the Arms)."""
    from engine.public import settings_specs

    for _, _, s in settings_specs():
        text = text.replace(f"--{s.key.replace('_', '-')}", f"“{s.title}”")
    return text


VIEWS: dict[str, View] = {}


def register(view: View) -> View:
    _discover()
    VIEWS[view.arm] = view.filled()
    return view


def unregister(arm: str) -> None:
    VIEWS.pop(arm, None)


def view_of(arm: str) -> View:
    _discover()
    return VIEWS.get(str(arm)) or View(str(arm)).filled()


def views() -> tuple[View, ...]:
    """One view per registered arm, in column order (read when a page is built, so later arms appear too)."""
    from engine.public import REGISTRY

    return tuple(view_of(arm) for arm in REGISTRY)


class Words(ArmWords):
    def title(self, arm: str) -> str:
        return view_of(arm).title

    def subtitle(self, arm: str) -> str:
        return view_of(arm).subtitle

    def facts(self, arm: str, detail) -> list[str]:
        return view_of(arm).chips(detail)


WORDS = Words()


def document(comparison) -> dict:
    return titled(comparison.to_json(), WORDS)


def _palette(arm: str) -> str:
    return PALETTE[zlib.crc32(arm.encode()) % len(PALETTE)]  # an arm keeps its colour as others come


_found = False


def _discover() -> None:
    """Import every view module of this folder once (they import the arms, and with them torch)."""
    global _found
    if not _found:
        _found = True
        for module in pkgutil.iter_modules(__path__):
            importlib.import_module(f"{__name__}.{module.name}")
