"""The arms: the interface (:mod:`.registry`), the one timed run (:mod:`.timing`) and its parts, the comparison
(:mod:`.compare`), and one file per arm.

This package's ``__init__`` is the one place arms are registered: it imports every module of this folder
that is not part of the machinery, and each arm module registers its :class:`~.registry.ArmSpec`. A new
arm is a new file here (plus its test); nothing else names it. Column order is each spec's ``order``.
"""

import importlib
import pkgutil

from engine.arms.registry import REGISTRY, Arm, ArmResult, ArmSpec, RunResult, Sampling  # noqa: F401

MACHINERY = ("registry", "workspace", "memory", "sampling", "decode", "batch", "timing", "attention", "layers", "compare",
             "repair")  # modules that register no arm

for _module in pkgutil.iter_modules(__path__):
    if _module.name not in MACHINERY and not _module.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_module.name}")
