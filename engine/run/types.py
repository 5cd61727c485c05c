"""What a run takes and gives back: its sampling settings, the timed result, a routing arm's decision."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.errors import EngineError
from engine.limits import check_fields


@dataclass(frozen=True)
class Sampling:
    """Decoding settings shared by every arm."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()  # the generation ends once its text holds one

    def __post_init__(self):
        check_fields(self, "max_new_tokens", "temperature", "top_p", "seed")
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (tuple, list)) or not all(isinstance(s, str) and s for s in stop):
            raise EngineError(f"stop must be a list of non-empty strings, got {self.stop!r}; e.g. [\"\\n\\n\"]")
        object.__setattr__(self, "stop", tuple(stop))

    @classmethod
    def from_json(cls, data: dict | None) -> "Sampling":
        keys = ("max_new_tokens", "temperature", "top_p", "seed", "stop")
        return cls(**{k: v for k, v in (data or {}).items() if k in keys})

    def to_json(self) -> dict:
        out = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
               "seed": self.seed}
        return {**out, "stop": list(self.stop)} if self.stop else out


@dataclass(frozen=True)
class Routing:
    """Which modules a routing arm's answer read, and how."""

    kept: tuple[str, ...] = ()  # in prompt order
    dropped: tuple[str, ...] = ()
    recomputed: int = 0  # cached tokens prefilled again
    path: str = "stored"  # engine/arms/routed.py PATHS


@dataclass(frozen=True)
class RunResult:
    """One timed run of an arm."""

    arm: str
    text: str
    token_ids: tuple[int, ...]
    ttft_ms: float
    copy_ms: float  # buffer allocation + the arm's fill
    prefill_ms: float  # forward over the prefilled tokens
    sample_ms: float  # choosing the first token from its logits
    prefill_tokens: int
    decode_ms_per_token: float | None  # None below two generated tokens
    decode_tokens: int
    peak_rss_bytes: int
    cuda_peak_bytes: int | None
    kv_buffer_bytes: int  # capacity of the run's buffer
    first_logits: torch.Tensor | None = field(repr=False, compare=False)  # None when read back from JSON
    reused_tokens: int = 0  # prompt tokens whose KV came from a store
    precomputed_tokens: int = 0  # prompt tokens it did not compute: read as a store or the prefix tree held them
    # before this request (the routed arm's left-out modules too: its scout read them); the API's cached_tokens
    recomputed_tokens: int = 0  # cached tokens prefilled again (in prefill_tokens)
    recomputed_positions: tuple[int, ...] = ()
    kv_buffer_used_bytes: int = 0  # KV in the run's buffer after the prefill
    kv_store_bytes: int = 0  # store entries the run read, as stored
    kv_buffer_bytes_after_retention: int = 0  # what decoding ran over
    retention_ms: float = 0.0  # thinning the buffer after the first token
    decode_batch: int = 1  # the most runs one of its decode steps computed together
    decode_shared: float = 0.0  # other requests' runs in its steps, on average (a served studio's API)

    @property
    def kv_held_bytes(self) -> int:
        return self.kv_store_bytes + self.kv_buffer_used_bytes

    def to_json(self) -> dict:
        return {"text": self.text, "ttft_ms": round(self.ttft_ms, 3), "copy_ms": round(self.copy_ms, 3),
                "prefill_ms": round(self.prefill_ms, 3), "sample_ms": round(self.sample_ms, 3),
                "prefill_tokens": self.prefill_tokens,
                "decode_ms_per_token": None if self.decode_ms_per_token is None else round(self.decode_ms_per_token, 3),
                "new_tokens": self.decode_tokens, "peak_rss_bytes": self.peak_rss_bytes,
                "cuda_peak_bytes": self.cuda_peak_bytes, "kv_buffer_bytes": self.kv_buffer_bytes,
                "reused_tokens": self.reused_tokens, "precomputed_tokens": self.precomputed_tokens,
                "recomputed_tokens": self.recomputed_tokens,
                "recomputed_positions": list(self.recomputed_positions),
                "kv_buffer_used_bytes": self.kv_buffer_used_bytes, "kv_store_bytes": self.kv_store_bytes,
                "kv_held_bytes": self.kv_held_bytes,
                "kv_buffer_bytes_after_retention": self.kv_buffer_bytes_after_retention,
                "retention_ms": round(self.retention_ms, 3), "decode_batch": self.decode_batch,
                "decode_shared": self.decode_shared}

    @classmethod
    def from_json(cls, arm: str, d: dict) -> "RunResult":
        """Read back from ``run --json`` (no logits)."""
        return cls(arm=arm, text=d.get("text", ""), token_ids=(), ttft_ms=d.get("ttft_ms", 0.0),
                   copy_ms=d.get("copy_ms", 0.0), prefill_ms=d.get("prefill_ms", 0.0),
                   sample_ms=d.get("sample_ms", 0.0), prefill_tokens=d.get("prefill_tokens", 0),
                   decode_ms_per_token=d.get("decode_ms_per_token"), decode_tokens=d.get("new_tokens", 0),
                   peak_rss_bytes=d.get("peak_rss_bytes", 0), cuda_peak_bytes=d.get("cuda_peak_bytes"),
                   kv_buffer_bytes=d.get("kv_buffer_bytes", 0), first_logits=None,
                   reused_tokens=d.get("reused_tokens", 0),
                   precomputed_tokens=d.get("precomputed_tokens", d.get("reused_tokens", 0)),  # older documents
                   recomputed_tokens=d.get("recomputed_tokens", 0),
                   recomputed_positions=tuple(d.get("recomputed_positions") or ()),
                   kv_buffer_used_bytes=d.get("kv_buffer_used_bytes", 0), kv_store_bytes=d.get("kv_store_bytes", 0),
                   kv_buffer_bytes_after_retention=d.get("kv_buffer_bytes_after_retention", 0),
                   retention_ms=d.get("retention_ms", 0.0), decode_batch=d.get("decode_batch") or 1,
                   decode_shared=d.get("decode_shared") or 0.0)
