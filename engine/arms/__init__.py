"""The arms: importing each module outside MACHINERY registers its arm (a new arm is a new file)."""

import importlib
import pkgutil

from engine.arms.registry import REGISTRY, Arm, ArmResult, ArmSpec, RunResult, Sampling  # noqa: F401

MACHINERY = ("registry", "workspace", "memory", "sampling", "decode", "batch", "timing", "attention", "layers", "compare",
             "repair")

for _module in pkgutil.iter_modules(__path__):
    if _module.name not in MACHINERY and not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")
