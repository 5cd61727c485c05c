"""PML Studio's cache engine: PML schemas → encoded module KV → cached vs baseline runs.

Never imports gradio. Heavy modules (torch, transformers) load on first use, not here.
"""

from .errors import ContextLengthError, EngineError, ModelError, PMLError, Problem, StorageError

__all__ = ["Engine", "RunConfig", "EngineError", "PMLError", "Problem", "ModelError", "StorageError", "ContextLengthError",
           "Sampling"]


def __getattr__(name):
    if name == "Engine":
        from .session import Engine
        return Engine
    if name == "RunConfig":
        from .config import RunConfig
        return RunConfig
    if name == "Sampling":
        from .runner import Sampling
        return Sampling
    raise AttributeError(name)
