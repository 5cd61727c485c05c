"""The arms: this package imports each of its modules, so every arm's file registers its arm (a new arm is a new
file; the folder holds nothing else but the registry, compare and repair)."""

import importlib
import pkgutil

from engine.arms.registry import REGISTRY, Arm, ArmResult, ArmSpec  # noqa: F401
from engine.run.types import RunResult, Sampling  # noqa: F401

for _module in pkgutil.iter_modules(__path__):
    if not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")
