"""Models, schemas and runs as front ends read them (beside ``engine`` and its application modules); each name
loads its module when first read."""

from __future__ import annotations

import importlib

_NAMES = {
    # models
    "engine.model": ("START_MODEL", "START_WEIGHTS", "WEIGHTS"),
    "engine.model.graphs": ("gpu_paths",),
    "engine.model.kernels": ("ROW_TILE", "kernel_status"),
    "engine.model.packaged": ("install_packaged", "packaged_models", "TESTS_MODEL"),
    "engine.describe": ("info_document",),
    "engine.cli_text": ("LOAD_TAKES",),
    # schemas and prompts
    "engine.schema.pml": ("IDENT", "Import", "NewText", "Param", "compact", "document_kind", "parse_prompt"),
    "engine.schema.layout": ("ANONYMOUS", "Layout", "TextCodec"),
    "engine.schema.plan": ("PromptPlan",),
    "engine.schema.where": ("Lines",),
    "engine.programs": ("load_program_file",),
    "engine.cache.encode": ("EncodedSchema",),
    # arms, runs and their results
    "engine.arms": ("REGISTRY",),
    "engine.arms.registry": ("Arm", "ArmContext", "Reads", "Sampling", "first_divergence", "settings_specs"),
    "engine.arms.compare": ("Comparison", "run_arm"),
    "engine.arms.blend": ("BlendInfo",),
    "engine.arms.prefix": ("PrefixReuse",),
    "engine.arms.routed": ("RoutedInfo",),
    "engine.arms.vllm": ("URL_ENV", "VllmRun", "VllmSettings"),
    "engine.cache.prefix": ("Held",),
    "engine.run.events": ("Done", "FirstToken", "Token", "UnitEncoded", "Warming"),
    "engine.run.scheduler": ("Request", "Stopped"),
    # an OpenAI-compatible server (the vllm arm's and the API front's one client)
    "engine.run.remote": ("Card", "End", "Limits", "Piece", "Remote", "RemoteError", "completion_body",
                          "error_fields"),
    "engine.words": ("ArmWords", "is_faster", "speed_words", "titled"),
    # files, folders and numbers given by a user
    "engine.devices": ("cache_root", "check_cache", "process_alive"),
    "engine.files": ("DOCUMENT_BYTES", "read_text"),
    "engine.owned": ("check_trusted",),
    "engine.limits": ("NumberArg",),
}
_RENAMED = {"kernel_status": "status", "TESTS_MODEL": "DEFAULT_MODEL"}
_WHERE = {name: module for module, names in _NAMES.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), _RENAMED.get(name, name))
    globals()[name] = value
    return value
