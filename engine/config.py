"""One run configuration, validated once where it is made, then passed whole.

Every front end — the CLI's argparse, the studio's widgets, the benchmarks, library users —
builds a :class:`RunConfig`; the :class:`engine.session.Engine` holds one and a run may
override it with another. The choices of every setting are listed once here (:data:`CHOICES`)
and read by argparse and by the studio's radios, so the lists can never drift apart.

    from engine import Engine, RunConfig
    eng = Engine(RunConfig(mode="isolated", storage_dtype="float16"))
    eng.compare(schema_xml, prompt_xml, config=eng.config.with_(repair=4))

No torch here: validation that needs the machine (is CUDA present?) is done by ``check_device``.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from .errors import EngineError
from .arms import Arm

# -- one list of choices per setting (value, label) ---------------------------------------------

MODES = ("prefixed", "isolated")
METHODS = ("pyramid", "uniform", "recent", "question")
STORAGES = ("cpu", "cuda")
DEVICES = ("cpu", "cuda")
COMPUTE_DTYPES = ("float32", "float16", "bfloat16")
STORAGE_DTYPES = ("float32", "float16", "bfloat16", "int8", "int4")
QUANTIZED = ("int8", "int4")
ARMS = tuple(a.value for a in Arm)  # every arm name, in column order
DEFAULT_ARMS = ("baseline", "prefix", "cached")  # blend runs when asked for (--arms ...,blend or --blend R)
BLEND_RULES = ("deviation", "deviation-k", "deviation-v", "link", "question", "mixed", "random")
MAX_REPAIR = 64
MAX_SINK = 64
MAX_NEW_TOKENS = 1 << 20  # no model has a longer context; the plan checks the loaded model's own
MAX_BUDGET_MIB = 1 << 30  # 1 PiB, more than any machine has; in bytes it still fits the run log's 64-bit integers
MAX_TEMPERATURE = 100.0  # far past uniform sampling already (logits differ by tens at most)
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes 0 ... 2**64 - 1

CHOICES: dict[str, tuple[tuple[str, str], ...]] = {
    "mode": (("prefixed", "prefixed: modules see the system text before them"),
             ("isolated", "isolated: the paper's scheme, each module alone")),
    "storage": (("cpu", "CPU memory"), ("cuda", "GPU memory")),
    "device": (("cpu", "CPU"), ("cuda", "GPU")),
    "storage_dtype": (("float32", "fp32"), ("float16", "fp16"), ("bfloat16", "bf16"), ("int8", "int8"),
                      ("int4", "int4")),
    "method": tuple((m, m) for m in METHODS),
    "arms": (("baseline", "Baseline"), ("prefix", "Prefix cache"), ("cached", "Modular cache"), ("blend", "Blend")),
    "blend_rule": tuple((r, r) for r in BLEND_RULES),
}


# -- the accepted range of every numeric setting -------------------------------------------------

@dataclass(frozen=True)
class Limit:
    """The accepted values of one numeric setting: finite, from ``lo`` to ``hi`` (``lo`` itself excluded when
    ``open_lo``), whole numbers only when ``whole``.

    :meth:`check` is the one validation of a number for every front end: argparse's ``type=``
    (``engine.cli.NumberArg``), the studio's widgets and API, and the dataclasses library users
    build (:class:`RunConfig`, :class:`Compression`, ``engine.runner.Sampling``, via :func:`check_fields`).
    """

    name: str  # the setting in messages, e.g. "top-p"
    lo: float
    hi: float = math.inf
    whole: bool = False
    open_lo: bool = False
    example: str = ""  # a valid value (and what it does): the fix a message suggests
    meaning: str = ""  # the range in words when the computed one reads badly

    def describe(self) -> str:
        """The accepted range in words: 'a whole number from 0 to 64', 'in (0, 1]'."""
        if self.meaning:
            return self.meaning
        if self.whole:
            return f"a whole number from {self.lo} to {self.hi}"
        if self.hi == math.inf:
            return f"a finite number {'above' if self.open_lo else 'of at least'} {self.lo:g}"
        return f"in {'(' if self.open_lo else '['}{self.lo:g}, {self.hi:g}]"

    def check(self, value, what: str = ""):
        """``value`` (a number or its text) as an int (``whole``) or a float in range; otherwise EngineError
        naming ``what`` (default: the setting's name), the range, what was given and an example."""
        number = _as_number(value, self.whole)
        if number is None or not (self.lo < number if self.open_lo else self.lo <= number) or number > self.hi:
            shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
            example = f"; e.g. {self.example}" if self.example else ""
            raise EngineError(f"{what or self.name} must be {self.describe()}, got {shown}{example}")
        return number


LIMITS: dict[str, Limit] = {
    "max_new_tokens": Limit("max new tokens", 1, MAX_NEW_TOKENS, whole=True, example="32"),
    "temperature": Limit("temperature", 0.0, MAX_TEMPERATURE, meaning=f"from 0 (greedy) to {MAX_TEMPERATURE}",
                         example="0.7"),
    "top_p": Limit("top-p", 0.0, 1.0, open_lo=True, example="0.9 samples from the likeliest tokens holding 90 % "
                   "of the probability; 1 from all"),
    "seed": Limit("seed", 0, MAX_SEED, whole=True, example="0"),
    "retention": Limit("retention", 0.0, 1.0, open_lo=True, example="0.5 keeps half the KV"),
    "recent_frac": Limit("recent_frac", 0.0, 1.0, open_lo=True, example="0.4"),
    "window_frac": Limit("window_frac", 0.0, 1.0, example="0.1"),
    "blend": Limit("blend", 0.0, 1.0, meaning="a share of the cached tokens from 0 to 1", example="0.15"),
    "budget_mib": Limit("module memory budget (MiB)", 0.0, MAX_BUDGET_MIB, open_lo=True, example="512",
                        meaning=f"a positive number up to {MAX_BUDGET_MIB} (1 PiB)"),
    "budget_bytes": Limit("the module memory budget", 1, MAX_BUDGET_MIB * 2**20, whole=True,
                          meaning=f"a positive number of bytes up to {MAX_BUDGET_MIB * 2**20}",
                          example=str(512 * 2**20)),
    "repair": Limit("repair", 0, MAX_REPAIR, whole=True, example="4"),
    "sink": Limit("sink", 0, MAX_SINK, whole=True, example="4"),
}


def check_fields(obj, *names: str) -> None:
    """Check each named field of the (frozen) dataclass ``obj`` against ``LIMITS[name]``; store the number."""
    for name in names:
        object.__setattr__(obj, name, LIMITS[name].check(getattr(obj, name)))


def _as_number(value, whole: bool) -> int | float | None:
    """The finite number ``value`` is or spells (an int when ``whole``), else None; never raises."""
    if isinstance(value, str):
        value = value.strip()
        if whole:
            try:
                return int(value)  # exact however large ('4.0' and '1e3' are read as floats below)
            except ValueError:
                pass
    elif isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    elif whole and isinstance(value, numbers.Integral):
        return int(value)
    try:
        number = float(value)
    except (ValueError, OverflowError):
        return None
    if not math.isfinite(number) or (whole and not number.is_integer()):
        return None
    return int(number) if whole else number


def values(setting: str) -> tuple[str, ...]:
    """The accepted values of ``setting`` (argparse ``choices``)."""
    return tuple(v for v, _ in CHOICES[setting])


def labelled(setting: str) -> list[tuple[str, str]]:
    """(label, value) pairs of ``setting`` (Gradio radio choices)."""
    return [(label, v) for v, label in CHOICES[setting]]


def short_dtype(dtype: str | None) -> str:
    """'fp16' for 'float16' (labels in tables and chips)."""
    return dict(CHOICES["storage_dtype"]).get(dtype or "float32", dtype or "fp32")


@dataclass(frozen=True)
class Compression:
    """How module KV is thinned per layer (PyramidInfer-style); retention 1 keeps everything.

    ``pyramid``, ``uniform`` and ``recent`` thin the stored entries when a module is encoded,
    before any question is known; ``question`` stores full entries and thins the run's buffer
    after the prompt's new tokens were prefilled, by their attention (see engine/compress.py).
    """

    retention: float = 1.0  # mean fraction of each entry's tokens kept per layer
    method: str = "pyramid"
    recent_frac: float = 0.4  # queries whose attention scores the tokens
    window_frac: float = 0.1  # most recent tokens always kept
    pool_kernel: int = 31  # question: scores max-pooled over this many neighbouring tokens
    question_window: int = 64  # question: at most this many of the newest prompt tokens score the modules

    def __post_init__(self):
        check_fields(self, "retention", "recent_frac", "window_frac")
        if self.method not in METHODS:
            raise EngineError(f"unknown compression method '{self.method}'; use one of {', '.join(METHODS)}")
        if not isinstance(self.pool_kernel, int) or self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
            raise EngineError(f"pool_kernel must be an odd whole number of tokens, got {self.pool_kernel!r}; e.g. 31")
        if not isinstance(self.question_window, int) or self.question_window < 1:
            raise EngineError(f"question_window must be a positive number of tokens, got {self.question_window!r}")

    @property
    def active(self) -> bool:
        return self.retention < 1.0

    @property
    def at_encode(self) -> bool:
        """Stored entries are thinned when encoded (the query-agnostic methods)."""
        return self.active and self.method != "question"

    @property
    def at_run(self) -> bool:
        """The run's buffer is thinned after the new tokens are prefilled (``question``)."""
        return self.active and self.method == "question"

    @property
    def stored_fraction(self) -> float:
        """Mean fraction of a module's tokens its stored entry holds."""
        return self.retention if self.at_encode else 1.0

    def key(self) -> str:
        """What a run with this compression is (encoded schemas made for different ones never mix)."""
        if not self.active:
            return "full"
        if self.method == "question":
            return f"question:{self.retention:.4f}:{self.pool_kernel}:{self.question_window}"
        return f"{self.method}:{self.retention:.4f}:{self.recent_frac}:{self.window_frac}"

    def stored_key(self) -> str:
        """Part of every store key: entries compressed differently never mix (``question`` stores full ones)."""
        return self.key() if self.at_encode else "full"

    def layer_ratios(self, n_layers: int) -> list[float]:
        """Fraction of tokens each layer keeps; their mean is the retention."""
        r = self.retention
        if self.method not in ("pyramid", "question") or n_layers == 1 or r >= 1.0:
            return [r] * n_layers
        r0 = min(1.0, 1.5 * r)
        lo, hi = 0.0, 1.0
        for _ in range(60):  # mean(r0 * g**l) is increasing in g: bisect for mean == r
            g = (lo + hi) / 2
            mean = sum(r0 * g ** i for i in range(n_layers)) / n_layers
            lo, hi = (g, hi) if mean < r else (lo, g)
        return [r0 * lo ** i for i in range(n_layers)]


@dataclass(frozen=True)
class RunConfig:
    """Everything a run needs besides the documents and the sampling settings.

    ``device`` None means: ``cuda`` when storage is ``cuda``, else ``cpu``. ``dtype`` None means
    :func:`default_dtype` of the device; ``storage_dtype`` None means the compute dtype (module KV
    is stored in the precision the run computes in). ``budget_bytes`` None means half the memory
    available on the storage device. ``module_dir`` None means ``$PML_STUDIO_MODULES``, else
    ``$PML_STUDIO_CACHE/modules``.
    """

    model: str | None = None
    device: str | None = None
    dtype: str | None = None  # compute dtype of the model
    storage: str = "cpu"
    mode: str = "prefixed"
    storage_dtype: str | None = None
    compression: Compression = field(default_factory=Compression)
    budget_bytes: int | None = None
    persist: bool = True
    module_dir: str | None = None
    arms: tuple[str, ...] = DEFAULT_ARMS
    blend: float = 0.15  # share of cached tokens the blend arm recomputes (issue 18)
    blend_rule: str = "deviation"  # how the blend arm picks them
    repair: int = 0  # link tokens recomputed per module (issue 12); 0 = off
    sink: int = 0  # neutral tokens each isolated module is encoded after (issue 12); 0 = off
    warmup: bool = True  # warm the prefix cache with the schema-order prompt before a schema's first prefix run

    def __post_init__(self):
        _one_of("encoding mode", self.mode, MODES)
        _one_of("storage", self.storage, STORAGES)
        if self.device is None:
            object.__setattr__(self, "device", "cuda" if self.storage == "cuda" else "cpu")
        _one_of("device", self.device, DEVICES)
        if self.dtype is None:
            object.__setattr__(self, "dtype", default_dtype(self.device))
        _one_of("compute dtype", self.dtype, COMPUTE_DTYPES)
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
        arms = tuple(self.arms)
        for arm in arms:
            _one_of("arm", arm, ARMS)
        if not arms or len(set(arms)) != len(arms):
            raise EngineError(f"arms must name each of {', '.join(ARMS)} at most once, and at least one")
        # keep them in the canonical order: the runs always happen in that order
        object.__setattr__(self, "arms", tuple(a for a in ARMS if a in arms))
        check_fields(self, "repair", "sink", "blend")
        _one_of("blend rule", self.blend_rule, BLEND_RULES)
        if "blend" in self.arms and self.compression.at_run:
            raise EngineError("blend and question-aware retention cannot be combined yet (blend reorders the run's "
                              "buffer that question retention thins); leave blend out of the arms or pick another "
                              "compression")
        if not isinstance(self.warmup, bool):
            raise EngineError(f"warmup must be True or False, got {self.warmup!r}")
        if self.module_dir is not None:
            object.__setattr__(self, "module_dir", str(self.module_dir))
        if self.repair and self.compression.at_run:
            raise EngineError("repair and question-aware retention cannot be combined yet (repair reorders the run's "
                              "buffer that question retention thins); set repair to 0 or pick another compression")

    # -- derived ---------------------------------------------------------------------------------

    @property
    def modules_path(self) -> Path:
        """Where persisted module entries live."""
        from .models import cache_root

        return Path(self.module_dir or os.environ.get("PML_STUDIO_MODULES") or cache_root() / "modules")

    def encoding_key(self) -> tuple:
        """What an encoded schema depends on besides the layout: a change re-encodes."""
        return (self.mode, self.storage, self.storage_dtype, self.compression.key(), self.sink)

    def same_model(self, other: "RunConfig") -> bool:
        """True when ``other`` can run on the model this config loads (model, device, dtype)."""
        return (self.model, self.device, self.dtype) == (other.model, other.device, other.dtype)

    def with_(self, **changes) -> "RunConfig":
        """A copy with ``changes`` applied and validated (``retention``/``method`` build a Compression)."""
        if "retention" in changes or "method" in changes:
            retention = changes.pop("retention", self.compression.retention)
            method = changes.pop("method", self.compression.method)
            changes["compression"] = Compression(1.0 if retention in (None, "") else retention, method or "pyramid")
        unknown = set(changes) - {f.name for f in fields(self)}
        if unknown:
            raise EngineError(f"unknown run setting(s): {', '.join(sorted(unknown))}")
        if "storage" in changes and "device" not in changes:
            changes["device"] = None  # re-derived from the new storage
        if "dtype" not in changes and self.dtype == default_dtype(self.device) \
                and changes.get("device", self.device) != self.device:
            changes["dtype"] = None  # the default of the new device
        if "storage_dtype" not in changes and self.storage_dtype == self.dtype:
            changes["storage_dtype"] = None  # follows the (new) compute dtype
        return replace(self, **changes)

    def to_json(self) -> dict:
        return {"model": self.model, "device": self.device, "dtype": self.dtype, "storage": self.storage,
                "mode": self.mode, "storage_dtype": self.storage_dtype,
                "compression": {"retention": self.compression.retention, "method": self.compression.method},
                "budget_bytes": self.budget_bytes, "persist": self.persist, "arms": list(self.arms),
                "repair": self.repair, "sink": self.sink, "warmup": self.warmup, "blend": self.blend,
                "blend_rule": self.blend_rule}


# -- compute precision per device, by measurement (bench/precision.py) ------------------------------

PRECISION_RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results" / "precision-qwen2.5-coder-0.5b.json"


def default_dtype(device: str) -> str:
    """The compute dtype of a run that names none: float32 on CPU, bfloat16 on CUDA.

    CPU, measured (bench/precision.py, Qwen2.5-Coder-0.5B on this project's 2-core AMD EPYC with
    avx512_bf16): bf16 prefills 1.8x and decodes 1.45x faster than fp32 with the same needle
    accuracy, and moves the first token by a KL of ~1e-3. fp32 stays the default all the same: this
    product measures how far a cached run is from a full prefill, and in bf16 the kernels round
    differently per shape, so runs that are exact in fp32 (one module at the start, a scaffold,
    blend at 100 %, repair of every token) differ from the baseline by up to ~1e-3 KL
    (tests/test_precision.py) instead of ~1e-7.
    bf16 is one setting away (``dtype``) for speed. CUDA, not measured here (no GPU): bf16 halves
    the bytes each decode step reads and runs on tensor cores.
    """
    return "bfloat16" if device.startswith("cuda") else "float32"


def dtype_reason(device: str, dtype: str) -> str:
    """One sentence saying why a run computes in ``dtype`` on ``device``, with the measured numbers when present."""
    if dtype != default_dtype(device):
        return f"{short_dtype(dtype)} as asked (the default on {device} is {short_dtype(default_dtype(device))})"
    if device.startswith("cuda"):
        return "the default on a GPU: bf16 halves the bytes each decode step reads (not measured on this project's " \
               "machines, which have no GPU)"
    try:
        data = json.loads(PRECISION_RESULTS.read_text())
        row = max(data["ttft"], key=lambda r: r["prompt_tokens"])
        fp32, bf16 = row["fp32"], row["bf16"]
        kl = data["needles"]["single"]["bf16 baseline"]["kl_vs_fp32"]["mean"]
    except (OSError, ValueError, KeyError, TypeError):
        return "the default on CPU until bf16 is measured against it here: bf16 adds its own first-token KL to " \
               "every comparison (run bench/precision.py for this machine's numbers)"
    return (f"the default on CPU, so that runs exact in fp32 (a scaffold, one module at the start, blend at 100 %) "
            f"show as exact; measured on {data['model']} (bench/precision.py), bf16 prefills "
            f"{row['prompt_tokens']:,} tokens in {bf16['baseline_ttft_ms']['median'] / 1000:.1f} s against fp32's "
            f"{fp32['baseline_ttft_ms']['median'] / 1000:.1f} s and decodes at "
            f"{bf16['decode_ms_per_token']['median']:.0f} ms/token against "
            f"{fp32['decode_ms_per_token']['median']:.0f}, but adds a first-token KL of {kl:.1e} to every "
            f"comparison: choose bf16 for speed")


def budget_from_mib(mib) -> int | None:
    """A budget in bytes from a number of MiB (None or empty: the default); EngineError unless in range."""
    if mib in (None, ""):
        return None
    return max(1, int(LIMITS["budget_mib"].check(mib) * 2**20))


def parse_arms(text: str | list | tuple) -> tuple[str, ...]:
    """'baseline,cached' (or a list) → a tuple of arms; EngineError naming the valid ones."""
    items = [a.strip() for a in (text.split(",") if isinstance(text, str) else text) if a and a.strip()]
    for arm in items:
        _one_of("arm", arm, ARMS)
    return tuple(items)


def _one_of(what: str, value, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise EngineError(f"unknown {what} '{value}'; use one of {', '.join(allowed)}")

