"""Arms named by label, as the fidelity, spanning and compression benchmarks and the report write them:
``MODE[+sink N][+repair K][+first kept][+blend R[ RULE]][+route K]...`` (:func:`parse_arm`), and the label of the
engine's default routed arm (:func:`routed_default`)."""

from __future__ import annotations

import re

ROUTED = "prefixed+route 0"  # the routed arm keeping every module whose pull reaches the threshold


def parse_arm(name: str) -> dict:
    """'isolated+sink 3+repair 16+first kept' -> {mode, sink, repair, first, blend, rule, check, ...}; 'prefixed+blend 15
    link' = 15 % of the cached tokens recomputed, chosen by the blend rule 'link' (default: deviation);
    '+check 6' = the blend selection pass checks deviation at layer 6 (default 1, CacheBlend's);
    '+route K' = the routed arm keeping the top K modules (0: every module whose pull reaches the threshold, the
    default), '+pull P' with the threshold at P % (engine/arms/routed.py), '+layers A-B' its scout layers; '+oracle' = only the asked module(s)
    visible (the routing ceiling), '+oracle recompute' = the asked module(s) recomputed in context;
    '+focus off' = the routed arm without its decode-time focus, '+focus clause' with it on a partial recompute too,
    each focus ending with its clause; '+joint off' = without its joint recompute;
    '+ape T S' = APE at query time with temperature T % and scale S % (modular and routed arms); '+share R' = the
    routed arm recomputing R % of its kept modules' tokens (100: all of them), '+sinks K' and each one's first K;
    '+tree' = the routed arm with the prefix tree warmed in schema order (reads it when every module is kept);
    baseline/scaffold as they are."""
    if name in ("baseline", "scaffold"):
        return {"special": name}
    mode, *parts = name.split("+")
    spec = {"mode": mode, "sink": 0, "repair": 0, "first": None, "blend": 0, "rule": "deviation", "check": 1,
            "route": None, "pull": None, "layers": None, "oracle": None, "ape": None, "focus": "on",
            "joint": "on", "share": None, "sinks": None, "tree": False}
    for p in parts:
        m = re.fullmatch(r"(sink|repair|check|route|pull|share|sinks) (\d+)", p)
        b = re.fullmatch(r"blend (\d+)(?: (\S+))?", p)
        lay = re.fullmatch(r"layers (\d+)-(\d+)", p)
        ape = re.fullmatch(r"ape (\d+) (\d+)", p)
        if m:
            spec[m.group(1)] = int(m.group(2))
        elif b:
            spec["blend"], spec["rule"] = int(b.group(1)), b.group(2) or "deviation"
        elif ape:
            spec["ape"] = (int(ape.group(1)) / 100, int(ape.group(2)) / 100)
        elif lay:
            spec["layers"] = tuple(range(int(lay.group(1)), int(lay.group(2)) + 1))
        elif p in ("oracle", "oracle recompute"):
            spec["oracle"] = p
        elif p in ("focus off", "focus clause"):
            spec["focus"] = p.split()[1]
        elif p == "joint off":
            spec["joint"] = "off"
        elif p == "tree":
            spec["tree"] = True
        elif p == "first kept":
            spec["first"] = False
        else:
            raise SystemExit(f"unknown arm part '{p}' in '{name}'")
    if mode not in ("prefixed", "isolated"):
        raise SystemExit(f"unknown mode in arm '{name}'")
    return spec


def routed_default() -> str:
    """The engine's default routed arm as the arm labels write it (:func:`parse_arm`), less '+tree': the
    focus is named where it is not 'on', the labels' own default."""
    from engine.arms.routed import DEFAULT_FOCUS, DEFAULT_SHARE

    focus = "" if DEFAULT_FOCUS == "on" else f"+focus {DEFAULT_FOCUS}"
    return f"{ROUTED}+share {round(DEFAULT_SHARE * 100)}{focus}"
