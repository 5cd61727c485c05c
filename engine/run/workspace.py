"""One reusable KV workspace per model, so every arm's buffer costs the same."""

from __future__ import annotations

import weakref

import torch

from engine.kv import KVWorkspace
from engine.model.load import LoadedModel

_WORKSPACES: "weakref.WeakKeyDictionary[torch.nn.Module, KVWorkspace]" = weakref.WeakKeyDictionary()


def workspace(lm: LoadedModel) -> KVWorkspace:
    """The KV workspace of ``lm``."""
    space = _WORKSPACES.get(lm.model)
    if space is None or (space.dtype, str(space.device)) != (lm.model.dtype, str(lm.device)):
        space = _WORKSPACES[lm.model] = KVWorkspace(lm.n_layers, lm.kv_heads, lm.head_dim, lm.model.dtype, lm.device)
    return space
