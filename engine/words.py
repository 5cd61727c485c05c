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
