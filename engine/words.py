"""The words a front end gives the engine's command line for its arms; alone, an arm is its name."""

from __future__ import annotations


class ArmWords:
    """How the text output and ``by_arm`` name an arm and its details (studio/cli.py gives the studio's views)."""

    def title(self, arm: str) -> str:
        return arm

    def subtitle(self, arm: str) -> str:
        return ""

    def facts(self, arm: str, detail) -> list[str]:
        """Short facts from the arm's detail (its spec's ``detail`` type, read back from the JSON)."""
        return []


def titled(data: dict, words: ArmWords) -> dict:
    """A ``run --json`` document with each ``by_arm`` entry's ``title`` (the front end's name for the arm)."""
    if not data.get("by_arm"):
        return data
    return {**data, "by_arm": {arm: {"title": words.title(arm), **entry} for arm, entry in data["by_arm"].items()}}


SAME_SPEED = 1.05  # within 5 % either way the two first tokens are one figure (1.0× either way)


def speed_words(ratio: float) -> str:
    """A first-token ratio (the baseline's TTFT / an arm's) in words: '2.3× faster', '1.1× slower', never a ratio
    under 1 called faster."""
    if ratio >= SAME_SPEED:
        return f"{ratio:.1f}× faster"
    if ratio <= 1 / SAME_SPEED:
        return f"{1 / ratio:.1f}× slower"
    return "as fast as the baseline"


def is_faster(ratio: float | None) -> bool:
    return ratio is not None and ratio >= SAME_SPEED

