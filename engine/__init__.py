"""PML Studio's cache engine: PML schemas → encoded module KV → cached vs baseline runs; no gradio."""

import os

# No network and no telemetry, set before transformers is imported; a user's own setting wins.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
               "DO_NOT_TRACK": "1"}
for _name, _value in OFFLINE_ENV.items():
    os.environ.setdefault(_name, _value)

from engine.errors import ContextLengthError, EngineError, ModelError, PMLError, Problem, StorageError

__all__ = ["Engine", "RunConfig", "EngineError", "PMLError", "Problem", "ModelError", "StorageError", "ContextLengthError",
           "Sampling"]


def __getattr__(name):
    if name == "Engine":
        from engine.session import Engine
        return Engine
    if name == "RunConfig":
        from engine.config import RunConfig
        return RunConfig
    if name == "Sampling":
        from engine.arms.registry import Sampling
        return Sampling
    raise AttributeError(name)
