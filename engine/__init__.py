"""PML Studio's cache engine: PML schemas → encoded module KV → cached vs baseline runs.

Never imports gradio. Heavy modules (torch, transformers) load on first use, not here.
"""

import os

# No network: models come from local folders and packages, never a hub, and nothing reports usage. Set
# before transformers or huggingface_hub is imported (they read these once); a user's own setting wins.
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
