"""One run configuration (:class:`RunConfig`), validated once where it is made, then passed whole.

Each setting's choices are listed once (:data:`CHOICES`), for argparse and the studio alike. No torch here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

from engine.cache.settings import METHODS, MODES, Compression, canonical_mode
from engine.errors import EngineError
from engine.model import WEIGHTS, default_model, default_weights
from engine.limits import (LIMITS, MAX_BUDGET_MIB, MAX_NEW_TOKENS, MAX_REPAIR, MAX_SEED, MAX_SINK,  # noqa: F401
                           MAX_TEMPERATURE, Limit, check_fields)

if TYPE_CHECKING:
    from engine.arms.registry import ArmSettings, Setting

# -- one list of choices per setting: (value, words) --

STORAGES = ("cpu", "cuda")
DEVICES = ("cpu", "cuda")
COMPUTE_DTYPES = ("float32", "float16", "bfloat16")
STORAGE_DTYPES = ("float32", "float16", "bfloat16", "int8", "int4")
QUANTIZED = ("int8", "int4")

CHOICES: dict[str, tuple[tuple[str, str], ...]] = {
    "mode": (("contextual", "contextual: modules see the system text before them"),
             ("isolated", "isolated: the paper's scheme, each module alone")),
    "storage": (("cpu", "CPU memory"), ("cuda", "GPU memory")),
    "device": (("cpu", "CPU"), ("cuda", "GPU")),
    "storage_dtype": (("float32", "fp32"), ("float16", "fp16"), ("bfloat16", "bf16"), ("int8", "int8"),
                      ("int4", "int4")),
    "method": tuple((m, m) for m in METHODS),
    "weights": (("fp32", "fp32"), ("bf16", "bf16"), ("int8", "int8 (weight-only)"),
                ("int4", "int4 (weight-only; attention int8)"),
                ("gguf", "gguf (the GGUF file's own 5-bit blocks; int8 elsewhere)")),
    "decode": (("together", "together: the arms decode as one batch"), ("apart", "apart: each arm decodes alone")),
}


def choices(setting: str) -> tuple[tuple[str, str], ...]:
    """(value, words) pairs of ``setting`` (or of ``arms``, or an arm's text setting)."""
    if setting == "arms":
        return tuple((name, name) for name in _arms_registry())
    if setting in CHOICES:
        return CHOICES[setting]
    for _, _, s in _registry_module().settings_specs():
        if s.key == setting and s.choices:
            return tuple((c, c) for c in s.choices)
    raise KeyError(setting)


def values(setting: str) -> tuple[str, ...]:
    return tuple(v for v, _ in choices(setting))


def limit_of(key: str) -> Limit:
    """The accepted range of the numeric setting ``key``: the run's own or an arm's."""
    if key in LIMITS:
        return LIMITS[key]
    limit = arm_setting(key)[2].limit
    if limit is None:
        raise KeyError(f"{key} is not a numeric setting")
    return limit


def arm_setting(key: str) -> tuple[str, str, "Setting"]:
    """(arm, field, Setting) of the arm setting named ``key``; KeyError if none."""
    for spec, name, s in _registry_module().settings_specs():
        if s.key == key:
            return spec.name, name, s
    raise KeyError(key)


def short_dtype(dtype: str | None) -> str:
    """'fp16' for 'float16'."""
    return dict(CHOICES["storage_dtype"]).get(dtype or "float32", dtype or "fp32")


@dataclass(frozen=True)
class RunConfig:
    """Everything a run needs besides the documents and the sampling settings.

    None means the default (``device`` follows storage, ``storage_dtype`` the compute dtype, ``budget_bytes``
    half the free memory). Arm settings are (arm, ArmSettings) pairs, given by key with :meth:`make`
    (``RunConfig.make(repair=4)``) and read with :meth:`settings_of` (``config.settings_of("cached").repair``).
    """

    model: str | None = None
    device: str | None = None
    dtype: str | None = None  # compute dtype of the model
    storage: str = "cpu"
    mode: str = "contextual"  # engine.cache.settings.MODES
    storage_dtype: str | None = None
    compression: Compression = field(default_factory=Compression)
    budget_bytes: int | None = None
    kv_budget_bytes: int | None = None  # the KV pool's (engine/run/pools.py); None: a share of the free memory
    persist: bool = True
    module_dir: str | None = None
    arms: tuple[str, ...] | None = None
    sink: int = 0  # tokens each isolated module is encoded after
    warmup: bool = True  # warm the prefix cache before a schema's first prefix run
    weights: str | None = None  # how the linear weights are kept (engine/model/weights.py)
    decode: str = "together"  # "together": the arms decode as one batch
    arm_settings: tuple[tuple[str, "ArmSettings"], ...] = ()  # (arm, settings) not at their defaults

    @classmethod
    def make(cls, **keys) -> "RunConfig":
        """A config from run fields and arm settings by their keys (``repair=4``, ``route_k=2``)."""
        names = {f.name for f in fields(cls)}
        given = {k: v for k, v in keys.items() if k in names}
        by_key = {k: v for k, v in keys.items() if k not in names}
        return cls(**{**given, "arm_settings": _with_keys(dict(given.get("arm_settings", ())), by_key)})

    def __post_init__(self):
        object.__setattr__(self, "model", self.model or default_model())
        object.__setattr__(self, "weights", self.weights or default_weights(self.model))
        object.__setattr__(self, "mode", canonical_mode(self.mode))
        _one_of("encoding mode", self.mode, MODES)
        _one_of("storage", self.storage, STORAGES)
        if self.device is None:
            object.__setattr__(self, "device", "cuda" if self.storage == "cuda" else "cpu")
        _one_of("device", self.device, DEVICES)
        if self.dtype is None:
            object.__setattr__(self, "dtype", default_dtype(self.device))
        _one_of("compute dtype", self.dtype, COMPUTE_DTYPES)
        _one_of("weight precision", self.weights, WEIGHTS)
        _one_of("decode", self.decode, values("decode"))
        if self.storage_dtype is None:
            object.__setattr__(self, "storage_dtype", self.dtype)
        _one_of("storage dtype", self.storage_dtype, STORAGE_DTYPES)
        if not isinstance(self.compression, Compression):
            raise EngineError("compression must be a Compression(retention, method)")
        if self.storage_dtype in QUANTIZED and self.compression.at_encode:
            raise EngineError(f"{self.storage_dtype} storage keeps whole modules; it cannot be combined with "
                              f"'{self.compression.method}' retention below 1 (tokens dropped at encoding). Use "
                              "retention 1, the 'question' method, or a float storage dtype")
        if self.budget_bytes is not None:
            check_fields(self, "budget_bytes")
        if self.kv_budget_bytes is not None:
            check_fields(self, "kv_budget_bytes")
        object.__setattr__(self, "arms", _arms(self.arms))
        check_fields(self, "sink")
        if not isinstance(self.warmup, bool):
            raise EngineError(f"warmup must be True or False, got {self.warmup!r}")
        if self.module_dir is not None:
            object.__setattr__(self, "module_dir", str(self.module_dir))
        object.__setattr__(self, "arm_settings", tuple(sorted(dict(self.arm_settings).items())))
        for arm in self.arms:
            settings = self.settings_of(arm)
            if settings is not None:
                settings.check_with(self)

    # -- derived --

    def settings_of(self, arm: str) -> "ArmSettings | None":
        """``arm``'s settings in this run, else its defaults (None: it has none)."""
        given = dict(self.arm_settings)
        if arm in given:
            return given[arm]
        spec = _arms_registry().get(arm)
        return None if spec is None or spec.settings is None else spec.settings()

    @property
    def modules_path(self) -> Path:
        from engine.devices import cache_root

        return Path(self.module_dir or os.environ.get("PML_STUDIO_MODULES") or cache_root() / "modules")

    def encoding_key(self) -> tuple:
        """What an encoded schema depends on besides the layout: a change re-encodes."""
        return (self.mode, self.storage, self.storage_dtype, self.compression.key(), self.sink)

    def same_model(self, other: "RunConfig") -> bool:
        """True when ``other`` can run on the model this config loads."""
        return (self.model, self.device, self.dtype, self.weights) == (other.model, other.device, other.dtype,
                                                                        other.weights)

    def with_(self, **changes) -> "RunConfig":
        """A copy with ``changes`` applied and validated (``retention``/``method`` and arm keys too)."""
        if "retention" in changes or "method" in changes:
            retention = changes.pop("retention", self.compression.retention)
            method = changes.pop("method", self.compression.method)
            changes["compression"] = Compression(1.0 if retention in (None, "") else retention, method or "pyramid")
        if "storage" in changes and "device" not in changes:
            changes["device"] = None  # re-derived from the new storage
        if "dtype" not in changes and self.dtype == default_dtype(self.device) \
                and changes.get("device", self.device) != self.device:
            changes["dtype"] = None  # the default of the new device
        if "storage_dtype" not in changes and self.storage_dtype == self.dtype:
            changes["storage_dtype"] = None  # follows the (new) compute dtype
        if "weights" not in changes and self.weights == default_weights(self.model):
            changes["weights"] = None  # the (new) model's default
        current = {f.name: getattr(self, f.name) for f in fields(self)}
        return RunConfig.make(**{**current, **changes})

    def to_json(self) -> dict:
        out = {"model": self.model, "device": self.device, "dtype": self.dtype, "storage": self.storage,
               "mode": self.mode, "storage_dtype": self.storage_dtype,
               "compression": {"retention": self.compression.retention, "method": self.compression.method},
               "budget_bytes": self.budget_bytes, "persist": self.persist, "arms": list(self.arms),
               "sink": self.sink, "warmup": self.warmup, "weights": self.weights,
               "decode": self.decode}
        for spec in _arms_registry().values():
            if spec.settings is not None:
                out.update(self.settings_of(spec.name).by_key())
        return out


def _arms(arms) -> tuple[str, ...]:
    """``arms`` checked and put in column order (the order they run in)."""
    names = _registry_module().arm_names()
    if arms is None:
        return _registry_module().default_arms()
    arms = tuple(arms)
    for arm in arms:
        _one_of("arm", arm, names)
    if not arms or len(set(arms)) != len(arms):
        raise EngineError(f"arms must name each of {', '.join(names)} at most once, and at least one")
    return tuple(a for a in names if a in arms)


def _with_keys(settings: dict, keys: dict) -> tuple:
    """``settings`` (arm -> ArmSettings) with the arm settings named by their keys (``repair=4``) applied."""
    for key, value in keys.items():
        try:
            arm, name, _ = arm_setting(key)
        except KeyError:
            raise EngineError(f"unknown run setting '{key}'; settings: "
                              + ", ".join([f.name for f in fields(RunConfig)] + [s.key for *_, s in _registry_module().settings_specs()]))
        current = settings.get(arm) or _arms_registry()[arm].settings()
        settings[arm] = replace(current, **{name: value})
    return tuple(settings.items())


# -- compute precision per device --

class DtypeWhy(str, Enum):
    """Why a run computes in its dtype (measured: docs/models.md)."""

    ASKED = "asked"
    CPU_DEFAULT = "cpu default"  # fp32: runs exact in fp32 show as exact
    GPU_DEFAULT = "gpu default"  # bf16: half the bytes per decode step


def default_dtype(device: str) -> str:
    """The compute dtype of a run that names none (:class:`DtypeWhy`)."""
    return "bfloat16" if device.startswith("cuda") else "float32"


def dtype_why(device: str, dtype: str) -> DtypeWhy:
    if dtype != default_dtype(device):
        return DtypeWhy.ASKED
    return DtypeWhy.GPU_DEFAULT if device.startswith("cuda") else DtypeWhy.CPU_DEFAULT


def add_kv_budget_option(parser) -> None:
    """``--kv-budget-mb`` on an argparse parser (:func:`kv_budget_bytes` reads it)."""
    from engine.limits import NumberArg

    parser.add_argument("--kv-budget-mb", type=NumberArg("kv_budget_mib"), default=None, metavar="MB",
                        help="the KV pool's budget in MiB: every run decoding at once leases its KV there, the rest "
                             "wait (default: a quarter of the free memory, at most 4 GiB)")


def kv_budget_bytes(args) -> int | None:
    """``--kv-budget-mb`` in bytes (None: the default)."""
    mib = getattr(args, "kv_budget_mb", None)
    return None if mib is None else int(float(mib) * 2**20)


def budget_from_mib(mib) -> int | None:
    """A budget in bytes from MiB (None or empty: the default)."""
    if mib in (None, ""):
        return None
    return max(1, int(LIMITS["budget_mib"].check(mib) * 2**20))


def parse_arms(text: str | list | tuple) -> tuple[str, ...]:
    """'baseline,cached' (or a list) → a tuple of arms."""
    items = [a.strip() for a in (text.split(",") if isinstance(text, str) else text) if a and a.strip()]
    for arm in items:
        _one_of("arm", arm, _registry_module().arm_names())
    return tuple(items)


def _registry_module():
    """engine.arms.registry, arms registered; imported late (torch)."""
    import engine.arms  # noqa: F401  (registers the arms)
    from engine.arms import registry

    return registry


def _arms_registry() -> dict:
    return _registry_module().REGISTRY


def _one_of(what: str, value, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise EngineError(f"unknown {what} '{value}'; use one of {', '.join(allowed)}")

