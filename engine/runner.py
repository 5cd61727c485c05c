"""Baseline and cached runs, timed the same way, and their comparison (spec section 6).

TTFT is measured one way for both paths: synchronize, ``perf_counter`` around (buffer
allocation + KV assembly for the cached path) + prefill + first sampled token, synchronize.
The cached path's TTFT includes the copy of the modules' KV into the run's buffer
(``copy_ms`` reports that share). Decoding is our own loop over a preallocated buffer with
explicit position ids — ``model.generate()`` derives positions from the cache length, which is
wrong for gapped caches.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .attention import attach, copied_positions, needs_positions
from .encode import EncodedSchema
from .kv import KVBuffer, KVWorkspace
from .models import LoadedModel
from .plan import CACHED, PromptPlan
from .store import ModuleStore

TokenFn = Callable[[str, str], None]  # (path, text so far)


@dataclass(frozen=True)
class Sampling:
    """Decoding settings shared by both runs. temperature 0 = greedy."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class RunResult:
    path: str  # "baseline" | "cached"
    text: str
    token_ids: tuple[int, ...]
    ttft_ms: float
    copy_ms: float  # buffer allocation + module KV assembly (0 for baseline)
    prefill_ms: float  # forward over the prefilled tokens
    sample_ms: float  # choosing the first token from its logits
    prefill_tokens: int
    decode_ms_per_token: float | None  # None when fewer than two tokens were generated
    decode_tokens: int
    peak_rss_bytes: int
    cuda_peak_bytes: int | None
    kv_buffer_bytes: int
    first_logits: torch.Tensor = field(repr=False, compare=False)

    def to_json(self) -> dict:
        return {"text": self.text, "ttft_ms": round(self.ttft_ms, 3), "copy_ms": round(self.copy_ms, 3),
                "prefill_ms": round(self.prefill_ms, 3), "sample_ms": round(self.sample_ms, 3),
                "prefill_tokens": self.prefill_tokens,
                "decode_ms_per_token": None if self.decode_ms_per_token is None else round(self.decode_ms_per_token, 3),
                "new_tokens": self.decode_tokens, "peak_rss_bytes": self.peak_rss_bytes,
                "cuda_peak_bytes": self.cuda_peak_bytes, "kv_buffer_bytes": self.kv_buffer_bytes}


@dataclass(frozen=True)
class Comparison:
    """The arms of one run (each a RunResult, None when not asked for) and how they agree."""

    model: str
    device: str  # where the model ran
    storage: str  # where module KV is stored
    mode: str
    schema: str
    plan: PromptPlan = field(repr=False)
    store_bytes: int
    store_bytes_by_module: dict[str, int]
    storage_dtype: str
    compression: dict  # {"retention", "method"}
    store_stats: dict  # budget, evictions, disk loads/writes/errors of the store after the run
    baseline: RunResult | None
    cached: RunResult | None
    same_text: bool | None  # agreement of cached with baseline (None unless both ran)
    first_divergence: int | None
    first_token_agree: bool | None
    first_token_kl: float | None
    max_first_logit_diff: float | None
    sampling: Sampling
    arms: tuple[str, ...] = ("baseline", "cached")
    encode: dict | None = None  # how the schema's units were obtained before this run (Engine.compare)

    @property
    def speedup(self) -> float | None:
        if self.baseline is None or self.cached is None:
            return None
        return self.baseline.ttft_ms / self.cached.ttft_ms if self.cached.ttft_ms > 0 else float("inf")

    def to_json(self) -> dict:
        """The CLI's JSON contract (`pml-studio run --json`): extend, never rename.

        An arm that was not run (``--arms``) is null, as are the figures that need it.
        """
        cached = None
        if self.cached is not None:
            cached = self.cached.to_json()
            cached["ttft_includes_copy"] = True
        speedup = self.speedup
        return {
            "model": self.model, "storage": self.storage, "mode": self.mode, "schema": self.schema,
            "prompt_tokens": self.plan.prompt_tokens, "cached_tokens": self.plan.cached_tokens,
            "uncached_tokens": self.plan.uncached_tokens, "store_bytes": self.store_bytes,
            "store_bytes_by_module": self.store_bytes_by_module, "device": self.device,
            "storage_dtype": self.storage_dtype, "compression": self.compression, "store_stats": self.store_stats,
            "imported": list(self.plan.imported), "scaffolds": list(self.plan.scaffolds),
            "arms": list(self.arms),
            "baseline": None if self.baseline is None else self.baseline.to_json(), "cached": cached,
            "speedup": None if speedup is None else round(speedup, 3), "same_text": self.same_text,
            "first_divergence": self.first_divergence, "first_token_agree": self.first_token_agree,
            "first_token_kl": _round(self.first_token_kl), "max_first_logit_diff": _round(self.max_first_logit_diff),
            "sampling": {"max_new_tokens": self.sampling.max_new_tokens, "temperature": self.sampling.temperature,
                         "top_p": self.sampling.top_p, "seed": self.sampling.seed},
            "encode": self.encode,
        }


def _round(x: float | None, nd: int = 6) -> float | None:
    return None if x is None else round(x, nd)


def run_baseline(lm: LoadedModel, plan: PromptPlan, sampling: Sampling = Sampling(),
                 on_token: TokenFn | None = None) -> RunResult:
    """One ordinary prefill of the whole materialised prompt at contiguous positions, then decode."""
    ids = plan.token_ids
    with _PeakMemory(lm.device) as mem:
        _sync(lm.device)
        t0 = time.perf_counter()
        buf = workspace(lm).buffer(len(ids) + sampling.max_new_tokens + 1)
        t1 = time.perf_counter()
        result = _prefill_and_decode(lm, buf, ids, list(range(len(ids))), sampling, t0, t1, "baseline", on_token)
    return _with_memory(result, mem)


def run_cached(lm: LoadedModel, plan: PromptPlan, encoded: EncodedSchema, store: ModuleStore,
               sampling: Sampling = Sampling(), on_token: TokenFn | None = None) -> RunResult:
    """Assemble the imported modules' KV into one buffer, prefill only the uncached tokens, decode."""
    copies = _copy_list(plan, encoded, store)
    ids, pos = plan.uncached()
    # sliding windows and ALiBi need the cached keys' position ids (gapped), not their cache indices
    key_pos = copied_positions(copies, lm.n_layers) if needs_positions(lm.model) else None
    with _PeakMemory(lm.device) as mem:
        _sync(lm.device)
        t0 = time.perf_counter()
        buf = workspace(lm).buffer(plan.cached_tokens + len(ids) + sampling.max_new_tokens + 1)
        for entry, a, b in copies:
            entry.write_into(buf, a, b)
        _sync(lm.device)
        t1 = time.perf_counter()
        result = _prefill_and_decode(lm, buf, ids, pos, sampling, t0, t1, "cached", on_token, key_pos)
    return _with_memory(result, mem)


def compare(lm: LoadedModel, plan: PromptPlan, encoded: EncodedSchema, store: ModuleStore,
            sampling: Sampling = Sampling(), on_token: TokenFn | None = None,
            arms: tuple[str, ...] = ("baseline", "cached")) -> Comparison:
    """The asked-for arms of one plan, one after the other on the same buffers, with agreement figures."""
    base = run_baseline(lm, plan, sampling, on_token) if "baseline" in arms else None
    cached = run_cached(lm, plan, encoded, store, sampling, on_token) if "cached" in arms else None
    agree = agreement(base, cached) if base is not None and cached is not None else dict.fromkeys(NO_AGREEMENT)
    return Comparison(
        model=lm.name, device=lm.device, storage=store.device, mode=encoded.mode, schema=plan.layout.name, plan=plan,
        store_bytes=encoded.nbytes(store), store_bytes_by_module=encoded.bytes_by_module(store),
        storage_dtype=encoded.dtype, compression={"retention": encoded.compression.retention,
                                                  "method": encoded.compression.method},
        store_stats=store.stats(), baseline=base, cached=cached, sampling=sampling, arms=tuple(arms), **agree)


NO_AGREEMENT = ("same_text", "first_divergence", "first_token_agree", "first_token_kl", "max_first_logit_diff")


def agreement(base: RunResult, other: RunResult) -> dict:
    """How far ``other`` drifted from ``base``: same_text, first_divergence, first-token agreement and KL."""
    lb = torch.log_softmax(base.first_logits.float(), -1)
    lo = torch.log_softmax(other.first_logits.float(), -1)
    kl = float(torch.sum(lb.exp() * (lb - lo)))
    div = first_divergence(base.token_ids, other.token_ids)
    return {"same_text": div is None, "first_divergence": div,
            "first_token_agree": bool(torch.argmax(lb) == torch.argmax(lo)), "first_token_kl": max(kl, 0.0),
            "max_first_logit_diff": float((base.first_logits - other.first_logits).abs().max())}


def workspace(lm: LoadedModel) -> KVWorkspace:
    """The model's reusable KV workspace (created on first use)."""
    if lm.workspace is None:
        lm.workspace = KVWorkspace(lm.n_layers, lm.kv_heads, lm.head_dim, lm.model.dtype, lm.device)
    return lm.workspace


def first_divergence(a: tuple[int, ...], b: tuple[int, ...]) -> int | None:
    """Index of the first differing token (or of the shorter sequence's end); None if identical."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


# ----------------------------------------------------------------------------------------------
# Internal helpers
# ----------------------------------------------------------------------------------------------

def used_keys(plan: PromptPlan, encoded: EncodedSchema) -> list[str]:
    """Store keys a cached run of ``plan`` reads."""
    return sorted({encoded.locate(s.piece, s.scaffold)[0] for s in plan.segments if s.kind == CACHED})


def _copy_list(plan: PromptPlan, encoded: EncodedSchema, store: ModuleStore) -> list:
    """(entry, first token, end token) ranges to copy, in cache order, adjacent ranges merged."""
    out: list = []
    for seg in plan.segments:
        if seg.kind != CACHED:
            continue
        key, off = encoded.locate(seg.piece, seg.scaffold)
        entry = store.get(key)
        a = off + seg.offset
        b = a + len(seg)
        if out and out[-1][0] is entry and out[-1][2] == a:
            out[-1] = (entry, out[-1][1], b)
        else:
            out.append((entry, a, b))
    return out


def _sample(logits: torch.Tensor, sampling: Sampling, gen: torch.Generator | None) -> int:
    if sampling.temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / sampling.temperature, -1)
    if sampling.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, -1) - sorted_p < sampling.top_p
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        return int(order[torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=gen)])
    return int(torch.multinomial(probs, 1, generator=gen))


def _prefill_and_decode(lm: LoadedModel, buf: KVBuffer, ids: list[int], pos: list[int], sampling: Sampling,
                        t0: float, t1: float, path: str, on_token: TokenFn | None,
                        key_positions: list[torch.Tensor] | None = None) -> RunResult:
    model, device = lm.model, lm.device
    gen = torch.Generator(device="cpu").manual_seed(sampling.seed) if sampling.temperature > 0 else None
    cache = buf.cache()
    attach(cache, key_positions)
    with torch.inference_mode():
        out = model(input_ids=torch.tensor([ids], device=device), position_ids=torch.tensor([pos], device=device),
                    past_key_values=cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[0, -1]
        _sync(device)
        t_fwd = time.perf_counter()
        tok = _sample(logits, sampling, gen)
        _sync(device)
        t2 = time.perf_counter()
        first_logits = logits.detach().float().cpu()
        tokens = [tok]
        next_pos = pos[-1] + 1
        decode_s = 0.0
        eos = set(lm.eos_ids)
        if on_token:
            on_token(path, lm.tokenizer.decode(tokens, skip_special_tokens=True))
        while len(tokens) < sampling.max_new_tokens and tokens[-1] not in eos:
            s = time.perf_counter()
            out = model(input_ids=torch.tensor([[tokens[-1]]], device=device),
                        position_ids=torch.tensor([[next_pos]], device=device), past_key_values=cache,
                        use_cache=True, logits_to_keep=1)
            tok = _sample(out.logits[0, -1], sampling, gen)
            _sync(device)
            decode_s += time.perf_counter() - s
            tokens.append(tok)
            next_pos += 1
            if on_token:
                on_token(path, lm.tokenizer.decode(tokens, skip_special_tokens=True))
    cache.sync_length()
    steps = len(tokens) - 1
    return RunResult(
        path=path, text=lm.tokenizer.decode(tokens, skip_special_tokens=True), token_ids=tuple(tokens),
        ttft_ms=(t2 - t0) * 1000, copy_ms=(t1 - t0) * 1000 if path == "cached" else 0.0,
        prefill_ms=(t_fwd - t1) * 1000, sample_ms=(t2 - t_fwd) * 1000, prefill_tokens=len(ids),
        decode_ms_per_token=decode_s * 1000 / steps if steps > 0 else None, decode_tokens=len(tokens),
        peak_rss_bytes=0, cuda_peak_bytes=None, kv_buffer_bytes=buf.nbytes, first_logits=first_logits)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _with_memory(result: RunResult, mem: "_PeakMemory") -> RunResult:
    from dataclasses import replace
    return replace(result, peak_rss_bytes=mem.peak_rss, cuda_peak_bytes=mem.cuda_peak)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class _PeakMemory:
    """Peak resident memory of the process during a run (sampled every 5 ms), and CUDA peak."""

    def __init__(self, device: str, interval: float = 0.005):
        self.device = device
        self.interval = interval
        self.peak_rss = 0
        self.cuda_peak: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._stop.is_set():
            self.peak_rss = max(self.peak_rss, _rss_bytes())
            self._stop.wait(self.interval)

    def __enter__(self) -> "_PeakMemory":
        if self.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        self.peak_rss = _rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak_rss = max(self.peak_rss, _rss_bytes())
        if self.device.startswith("cuda"):
            self.cuda_peak = int(torch.cuda.max_memory_allocated())

