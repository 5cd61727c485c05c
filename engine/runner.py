"""Baseline, prefix-cache and cached runs, timed the same way, and their comparison (spec section 6).

* **baseline** — one ordinary prefill of the whole prompt (nothing reused, nothing stored);
* **prefix** — what a serving engine does: reuse the longest token prefix the prefix cache holds
  (engine/prefix.py; exact), prefill the rest, then store this prompt's KV for later runs;
* **cached** — modular reuse: the imported modules' KV assembled at their schema positions; with
  ``repair`` K > 0 the link tokens are recomputed (:func:`run_repaired`: prefilled with the
  uncached text, so ``prefill_ms`` holds them).

TTFT is measured one way for every path: synchronize, ``perf_counter`` around (buffer
allocation + KV assembly for the prefix and cached paths) + prefill + first sampled token,
synchronize. Their TTFT includes the copy of stored KV into the run's buffer (``copy_ms``
reports that share; int8 / int4 entries are dequantized by that copy); finding the entries
(store lookups, the prefix tree's walk) happens before, for both. Decoding is our own loop over
a preallocated buffer with explicit position ids — ``model.generate()`` derives positions from
the cache length, which is wrong for gapped caches.

With ``question`` retention the cached run thins its buffer after the first token is out
(``retention_ms``, outside TTFT) and decodes over the smaller cache. Each run reports the KV
bytes it held: its buffer after the prefill, the stored entries it read, and the buffer after
retention.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from .compress import QuestionRetention
from .attention import attach, copied_positions, needs_positions
from .encode import EncodedSchema
from .errors import EngineError
from .kv import ATTENTION, KVBuffer, KVWorkspace, LayeredKV, RankMask, rank_masked
from .models import LoadedModel
from .layout import ANONYMOUS
from .plan import CACHED, PromptPlan
from .prefix import PrefixCache
from .repair import select_repair
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
class PrefixReuse:
    """How a prefix-arm run used the prefix cache."""

    reused_tokens: int  # leading prompt tokens taken from the cache (exact)
    repeat: bool  # the whole prompt was cached already; its last token is prefilled anyway (for logits)
    stopped_at: dict  # first prefilled token: {"token": index, "source": segment source, "owner": module or ""}
    warmed_with: dict  # what the cache held before this run (PrefixCache.summary)
    stored_tokens: int = 0  # new tokens this run's prompt added to the cache afterwards

    def to_json(self) -> dict:
        return {"reused_tokens": self.reused_tokens, "repeat": self.repeat, "stopped_at": self.stopped_at,
                "warmed_with": self.warmed_with, "stored_tokens": self.stored_tokens}


@dataclass(frozen=True)
class RunResult:
    path: str  # "baseline" | "prefix" | "cached"
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
    kv_buffer_bytes: int  # capacity of the run's buffer
    first_logits: torch.Tensor = field(repr=False, compare=False)
    reused_tokens: int = 0  # prompt tokens whose KV came from a store (modules or the prefix cache)
    reuse: PrefixReuse | None = None  # prefix arm only
    recomputed_tokens: int = 0  # cached tokens prefilled again by link-token repair (in prefill_tokens)
    recomputed_positions: tuple[int, ...] = ()  # their position ids
    kv_buffer_used_bytes: int = 0  # KV in the run's buffer after the prefill (baseline: prompt tokens x bytes/token)
    kv_store_bytes: int = 0  # store entries the run read, as stored: modules (cached), prefix nodes (prefix); 0 for baseline
    kv_held_bytes: int = 0  # kv_store_bytes + kv_buffer_used_bytes
    kv_buffer_bytes_after_retention: int = 0  # what decoding ran over (= kv_buffer_used_bytes without retention)
    retention_ms: float = 0.0  # scoring + thinning the buffer (question retention), after the first token

    def to_json(self) -> dict:
        return {"text": self.text, "ttft_ms": round(self.ttft_ms, 3), "copy_ms": round(self.copy_ms, 3),
                "prefill_ms": round(self.prefill_ms, 3), "sample_ms": round(self.sample_ms, 3),
                "prefill_tokens": self.prefill_tokens,
                "decode_ms_per_token": None if self.decode_ms_per_token is None else round(self.decode_ms_per_token, 3),
                "new_tokens": self.decode_tokens, "peak_rss_bytes": self.peak_rss_bytes,
                "cuda_peak_bytes": self.cuda_peak_bytes, "kv_buffer_bytes": self.kv_buffer_bytes,
                "reused_tokens": self.reused_tokens, "recomputed_tokens": self.recomputed_tokens,
                "recomputed_positions": list(self.recomputed_positions),
                "kv_buffer_used_bytes": self.kv_buffer_used_bytes, "kv_store_bytes": self.kv_store_bytes,
                "kv_held_bytes": self.kv_held_bytes,
                "kv_buffer_bytes_after_retention": self.kv_buffer_bytes_after_retention,
                "retention_ms": round(self.retention_ms, 3)}


@dataclass(frozen=True)
class Comparison:
    """The arms of one run (each a RunResult, None when not asked for) and how they agree with the baseline."""

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
    prefix: RunResult | None = None  # the prefix-cache arm (its ``reuse`` says what it reused)
    prefix_agreement: dict | None = None  # agreement(baseline, prefix), keys as NO_AGREEMENT
    repair: int = 0  # link tokens recomputed per link (issue 12)
    sink: int = 0  # sink tokens the isolated module entries were encoded after

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
        return {**self._core_json(cached, speedup), **self._prefix_json()}

    def _core_json(self, cached: dict | None, speedup: float | None) -> dict:
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
            "encode": self.encode, "repair": self.repair, "sink": self.sink,
        }

    def _prefix_json(self) -> dict:
        """``prefix`` (the arm, with its reuse) and its agreement with the baseline as ``prefix_*`` keys."""
        arm = None
        if self.prefix is not None:
            arm = {**self.prefix.to_json(), "prefilled_tokens": self.prefix.prefill_tokens, "ttft_includes_copy": True}
            if self.prefix.reuse is not None:
                arm.update(self.prefix.reuse.to_json())
        agree = self.prefix_agreement or dict.fromkeys(NO_AGREEMENT)
        speedup = None
        if self.prefix is not None and self.baseline is not None and self.prefix.ttft_ms > 0:
            speedup = round(self.baseline.ttft_ms / self.prefix.ttft_ms, 3)
        return {"prefix": arm, "prefix_speedup": speedup, "prefix_same_text": agree["same_text"],
                "prefix_first_divergence": agree["first_divergence"],
                "prefix_first_token_agree": agree["first_token_agree"],
                "prefix_first_token_kl": _round(agree["first_token_kl"]),
                "prefix_max_first_logit_diff": _round(agree["max_first_logit_diff"])}


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
               sampling: Sampling = Sampling(), on_token: TokenFn | None = None, repair: int = 0) -> RunResult:
    """Assemble the imported modules' KV into one buffer, prefill only the uncached tokens, decode.

    ``repair`` K > 0 recomputes K link tokens per link (:func:`run_repaired`); 0 is this path, unchanged.
    """
    if repair:
        return run_repaired(lm, plan, encoded, store, sampling, on_token, repair)
    copies = _copy_list(plan, encoded, store)
    ids, pos = plan.uncached()
    retain = _question_retention(plan, encoded)
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
        result = _prefill_and_decode(lm, buf, ids, pos, sampling, t0, t1, "cached", on_token, retain=retain,
                                     key_positions=key_pos)
    return _holding(replace(_with_memory(result, mem), reused_tokens=plan.cached_tokens), (e for e, *_ in copies))


def run_prefix(lm: LoadedModel, plan: PromptPlan, prefix: PrefixCache, sampling: Sampling = Sampling(),
               on_token: TokenFn | None = None, insert: bool = True, keep: list[str] = ()) -> RunResult:
    """Reuse the longest cached token prefix (at most all but the last token), prefill the rest, decode;
    then (``insert``) store the prompt's KV in the prefix cache, as a server would, evicting by LRU but
    never the store entries ``keep`` (the modules the cached arm reads next)."""
    ids = plan.token_ids
    warmed_with = prefix.summary(plan.layout.fingerprint)
    match = prefix.match(ids, limit=len(ids) - 1)
    k = match.reused
    with _PeakMemory(lm.device) as mem:
        _sync(lm.device)
        t0 = time.perf_counter()
        buf = workspace(lm).buffer(len(ids) + sampling.max_new_tokens + 1)
        for entry, a, b in match.pieces:
            entry.write_into(buf, a, b)
        _sync(lm.device)
        t1 = time.perf_counter()
        result = _prefill_and_decode(lm, buf, ids[k:], list(range(k, len(ids))), sampling, t0, t1, "prefix", on_token)
    stored = prefix.insert(ids, buf.data[:, :, 0], keep) if insert else 0  # before another run reuses the buffer
    if insert:
        prefix.inserted_runs += 1
    reuse = PrefixReuse(reused_tokens=k, repeat=match.whole, stopped_at=_token_place(plan, k),
                        warmed_with=warmed_with, stored_tokens=stored)
    return _holding(replace(_with_memory(result, mem), reused_tokens=k, reuse=reuse), (e for e, *_ in match.pieces))


def warm_prefix(lm: LoadedModel, prefix: PrefixCache, token_ids: tuple[int, ...] | list[int],
                keep: list[str] = ()) -> int:
    """Prefill ``token_ids`` (reusing what the cache holds) and store their KV; return the tokens stored."""
    ids = list(token_ids)
    match = prefix.match(ids, limit=len(ids) - 1)
    buf = workspace(lm).buffer(len(ids) + 1)
    for entry, a, b in match.pieces:
        entry.write_into(buf, a, b)
    k = match.reused
    with torch.inference_mode():
        lm.model(input_ids=torch.tensor([ids[k:]], device=lm.device),
                 position_ids=torch.tensor([list(range(k, len(ids)))], device=lm.device),
                 past_key_values=buf.cache(), use_cache=True, logits_to_keep=1)
    return prefix.insert(ids, buf.data[:, :, 0], keep)


def compare(lm: LoadedModel, plan: PromptPlan, encoded: EncodedSchema, store: ModuleStore,
            sampling: Sampling = Sampling(), on_token: TokenFn | None = None,
            arms: tuple[str, ...] = ("baseline", "cached"), prefix: PrefixCache | None = None,
            repair: int = 0) -> Comparison:
    """The asked-for arms of one plan, one after the other on the same buffers (baseline, prefix, cached),
    with each arm's agreement with the baseline. The prefix arm needs the engine's ``prefix`` cache."""
    if "prefix" in arms and prefix is None:
        raise EngineError("the prefix arm needs a prefix cache (Engine.compare makes one per storage device)")
    base = run_baseline(lm, plan, sampling, on_token) if "baseline" in arms else None
    keep = used_keys(plan, encoded) if "cached" in arms else []
    pre = run_prefix(lm, plan, prefix, sampling, on_token, keep=keep) if "prefix" in arms else None
    cached = run_cached(lm, plan, encoded, store, sampling, on_token, repair) if "cached" in arms else None
    agree = agreement(base, cached) if base is not None and cached is not None else dict.fromkeys(NO_AGREEMENT)
    pre_agree = agreement(base, pre) if base is not None and pre is not None else None
    return Comparison(
        model=lm.name, device=lm.device, storage=store.device, mode=encoded.mode, schema=plan.layout.name, plan=plan,
        store_bytes=encoded.nbytes(store), store_bytes_by_module=encoded.bytes_by_module(store),
        storage_dtype=encoded.dtype, compression={"retention": encoded.compression.retention,
                                                  "method": encoded.compression.method},
        store_stats=store.stats(), baseline=base, cached=cached, sampling=sampling, arms=tuple(arms),
        prefix=pre, prefix_agreement=pre_agree, repair=repair, sink=encoded.sink, **agree)


NO_AGREEMENT = ("same_text", "first_divergence", "first_token_agree", "first_token_kl", "max_first_logit_diff")


def run_repaired(lm: LoadedModel, plan: PromptPlan, encoded: EncodedSchema, store: ModuleStore,
                 sampling: Sampling = Sampling(), on_token: TokenFn | None = None, k: int = 4,
                 first: bool | None = None) -> RunResult:
    """The cached run with link-token recompute (issue 12, after EPIC).

    The tokens :func:`engine.repair.select_repair` picks are left out of the buffer and prefilled
    together with the uncached tokens, at their own position ids; every prefilled token attends
    to the cached entries and prefilled tokens before it in the prompt (:class:`RankMask`), so
    their fresh KV replaces the stored one for the rest of the run. TTFT includes the recompute.
    """
    if getattr(lm.model.config, "_attn_implementation", "") != ATTENTION:
        raise EngineError("link-token repair needs the model to run with SDPA attention (the loaded model uses "
                          f"'{lm.model.config._attn_implementation}'); set repair to 0")
    if needs_positions(lm.model):
        raise EngineError("link-token repair is not available for models with sliding-window or ALiBi attention yet "
                          "(its prompt-order mask would replace their position-aware one); set repair to 0")
    sel = select_repair(plan, k, encoded.mode, first)
    redo = set(sel.ranks)
    copies = _copy_list_ranked(plan, encoded, store, redo)
    ids, pos, ranks = _prefilled(plan, redo)
    with _PeakMemory(lm.device) as mem:
        _sync(lm.device)
        t0 = time.perf_counter()
        buf = workspace(lm).buffer(plan.cached_tokens + plan.uncached_tokens + sampling.max_new_tokens + 1)
        for entry, a, b, _ in copies:
            entry.write_into(buf, a, b)
        mask = RankMask(_buffer_ranks(copies, lm.n_layers), torch.tensor(ranks, dtype=torch.long))
        _sync(lm.device)
        t1 = time.perf_counter()
        result = _prefill_and_decode(lm, buf, ids, pos, sampling, t0, t1, "cached", on_token, mask=mask)
    return _holding(replace(_with_memory(result, mem), reused_tokens=plan.cached_tokens - len(sel),
                            recomputed_tokens=len(sel), recomputed_positions=sel.positions), (e for e, *_ in copies))


def _holding(result: RunResult, entries) -> RunResult:
    """``result`` with the store entries it read (each counted once, as stored) and the KV it held."""
    read = sum(e.nbytes for e in {id(e): e for e in entries}.values())
    return replace(result, kv_store_bytes=read, kv_held_bytes=read + result.kv_buffer_used_bytes)


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


def _token_place(plan: PromptPlan, k: int) -> dict:
    """Where token ``k`` of the materialised prompt comes from: {"token", "source", "owner"}."""
    start = 0
    for seg in plan.segments:
        if k < start + len(seg):
            return {"token": k, "source": seg.source, "owner": seg.owner}
        start += len(seg)
    return {"token": k, "source": "end", "owner": ""}


def _question_retention(plan: PromptPlan, encoded: EncodedSchema) -> QuestionRetention | None:
    """The run-time retention of a ``question`` compression (None for the others): module tokens may go,
    the anonymous text may not."""
    if not encoded.compression.at_run:
        return None
    anon = encoded.module_keys.get(ANONYMOUS)
    marks = [encoded.locate(s.piece, s.scaffold)[0] != anon for s in plan.segments if s.kind == CACHED
             for _ in range(len(s))]
    return QuestionRetention(encoded.compression, torch.tensor(marks, dtype=torch.bool))


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


def _copy_list_ranked(plan: PromptPlan, encoded: EncodedSchema, store: ModuleStore, skip: set[int]) -> list:
    """(entry, first token, end token, rank of the first token) ranges to copy, leaving out ranks ``skip``."""
    out: list = []
    rank = 0
    for seg in plan.segments:
        if seg.kind == CACHED:
            key, off = encoded.locate(seg.piece, seg.scaffold)
            entry = store.get(key)
            for i in range(len(seg)):
                if rank + i in skip:
                    continue
                a = off + seg.offset + i
                if out and out[-1][0] is entry and out[-1][2] == a and out[-1][3] + a - out[-1][1] == rank + i:
                    out[-1] = (entry, out[-1][1], a + 1, out[-1][3])
                else:
                    out.append((entry, a, a + 1, rank + i))
        rank += len(seg)
    return out


def _prefilled(plan: PromptPlan, redo: set[int]) -> tuple[list[int], list[int], list[int]]:
    """(token ids, position ids, ranks) a repaired run prefills: uncached tokens and ranks ``redo``, in order."""
    ids: list[int] = []
    pos: list[int] = []
    ranks: list[int] = []
    rank = 0
    for s in plan.segments:
        for i, (t, p) in enumerate(zip(s.token_ids, s.positions)):
            if s.kind != CACHED or rank + i in redo:
                ids.append(t)
                pos.append(p)
                ranks.append(rank + i)
        rank += len(s)
    return ids, pos, ranks


def _buffer_ranks(copies: list, n_layers: int) -> list[torch.Tensor]:
    """Per layer, the ranks of the buffer's entries in buffer order (one shared tensor unless compressed)."""
    every = [torch.arange(r, r + b - a) for _, a, b, r in copies]
    if not any(isinstance(entry, LayeredKV) for entry, *_ in copies):
        shared = torch.cat(every) if every else torch.zeros(0, dtype=torch.long)
        return [shared] * n_layers
    out = []
    for layer in range(n_layers):
        parts = []
        for (entry, a, b, r), full in zip(copies, every):
            if isinstance(entry, LayeredKV):
                kept = entry.kept[layer]
                kept = kept[(kept >= a) & (kept < b)]
                parts.append(kept - a + r)
            else:
                parts.append(full)
        out.append(torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long))
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
                        mask: RankMask | None = None, retain: QuestionRetention | None = None,
                        key_positions: list[torch.Tensor] | None = None) -> RunResult:
    model, device = lm.model, lm.device
    gen = torch.Generator(device="cpu").manual_seed(sampling.seed) if sampling.temperature > 0 else None
    cache = buf.cache()
    attach(cache, key_positions)
    with torch.inference_mode():
        with rank_masked(mask), (retain.watching() if retain is not None else contextlib.nullcontext()):
            # the rank mask acts on the prefill only: decode steps see the whole buffer
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
        cache, used, after, retention_ms = _retain(buf, cache, retain, device)
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
        ttft_ms=(t2 - t0) * 1000, copy_ms=(t1 - t0) * 1000 if path != "baseline" else 0.0,
        prefill_ms=(t_fwd - t1) * 1000, sample_ms=(t2 - t_fwd) * 1000, prefill_tokens=len(ids),
        decode_ms_per_token=decode_s * 1000 / steps if steps > 0 else None, decode_tokens=len(tokens),
        peak_rss_bytes=0, cuda_peak_bytes=None, kv_buffer_bytes=buf.nbytes, first_logits=first_logits,
        kv_buffer_used_bytes=used, kv_held_bytes=used, kv_buffer_bytes_after_retention=after,
        retention_ms=retention_ms)


def _retain(buf: KVBuffer, cache, retain: QuestionRetention | None, device: str) -> tuple:
    """(cache to decode over, buffer bytes after the prefill, after retention, ms spent thinning): the
    buffer thinned by ``retain`` when given, else the prefill's cache unchanged."""
    cache.sync_length()
    used = buf.used_bytes
    if retain is None:
        return cache, used, used, 0.0
    s = time.perf_counter()
    retain.apply(buf)
    _sync(device)
    return buf.cache(), used, buf.used_bytes, (time.perf_counter() - s) * 1000


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _with_memory(result: RunResult, mem: "_PeakMemory") -> RunResult:
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

