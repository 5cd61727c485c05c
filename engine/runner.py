"""The arms' runs, timed one way, and the comparison of the arms a run asks for (spec section 6).

Arms (registered in :mod:`engine.arms`; each is one function below):

* **baseline** — one ordinary prefill of the whole prompt (nothing reused, nothing stored);
* **prefix** — what a serving engine does: reuse the longest token prefix the prefix cache holds
  (engine/prefix.py; exact), prefill the rest, then store this prompt's KV for later runs;
* **cached** — modular reuse: the imported modules' KV assembled at their schema positions; with
  ``repair`` K > 0 the link tokens are recomputed (:func:`run_repaired`: prefilled with the
  uncached text, so ``prefill_ms`` holds them).

TTFT is measured one way for every arm, by :func:`timed_run`: synchronize, ``perf_counter``
around (buffer allocation + the arm's ``fill``: copying stored KV, building the prompt-order
mask) + prefill + first sampled token, synchronize. The TTFT of the prefix and cached arms
therefore includes the copy of stored KV into the run's buffer (``copy_ms`` reports that share;
int8 / int4 entries are dequantized by that copy); finding the entries (store lookups, the prefix
tree's walk) happens before, for both. Decoding is our own loop over a preallocated buffer with
explicit position ids — ``model.generate()`` derives positions from the cache length, which is
wrong for gapped caches.

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
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .arms import Agreement, Arm, ArmContext, ArmResult, REGISTRY, first_divergence, register
from .assemble import (buffer_ranks, copy_list, copy_list_ranked, fetch_entries, prefilled, question_retention,
                       token_place, used_keys)
from .attention import attach, copied_positions, needs_positions
from .comparison import Comparison, StoreSummary
from .compress import QuestionRetention
from .config import check_fields
from .encode import EncodedSchema
from .errors import EngineError
from .kv import ATTENTION, KVBuffer, KVWorkspace, RankMask, rank_masked
from .models import LoadedModel
from .plan import PromptPlan
from .prefix import PrefixCache
from .repair import select_repair
from .store import ModuleStore

__all__ = ["Sampling", "RunResult", "PrefixReuse", "Fill", "timed_run", "run_baseline", "run_cached",
           "run_repaired", "run_prefix", "warm_prefix", "compare", "agreement", "first_divergence", "used_keys",
           "fetch_entries", "workspace"]

TokenFn = Callable[[str, str], None]  # (arm, text so far)


@dataclass(frozen=True)
class Sampling:
    """Decoding settings shared by every arm. temperature 0 = greedy."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        check_fields(self, "max_new_tokens", "temperature", "top_p", "seed")  # EngineError naming the setting

    def to_json(self) -> dict:
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "seed": self.seed}


@dataclass(frozen=True)
class PrefixReuse:
    """How a prefix-arm run used the prefix cache (the prefix arm's ``ArmResult.detail``)."""

    reused_tokens: int  # leading prompt tokens taken from the cache (exact)
    repeat: bool  # the whole prompt was cached already; its last token is prefilled anyway (for logits)
    stopped_at: dict  # first prefilled token: {"token": index, "source": segment source, "owner": module or ""}
    warmed_with: dict  # what the cache held before this run (PrefixCache.summary)
    stored_tokens: int = 0  # new tokens this run's prompt added to the cache afterwards
    prefilled_tokens: int = 0  # prompt tokens prefilled (the rest were reused)

    def to_json(self) -> dict:
        return {"prefilled_tokens": self.prefilled_tokens, "reused_tokens": self.reused_tokens,
                "repeat": self.repeat, "stopped_at": self.stopped_at, "warmed_with": self.warmed_with,
                "stored_tokens": self.stored_tokens}

    @classmethod
    def from_json(cls, data: dict) -> "PrefixReuse":
        return cls(reused_tokens=data.get("reused_tokens", 0), repeat=bool(data.get("repeat")),
                   stopped_at=data.get("stopped_at") or {}, warmed_with=data.get("warmed_with") or {},
                   stored_tokens=data.get("stored_tokens", 0), prefilled_tokens=data.get("prefilled_tokens", 0))


@dataclass(frozen=True)
class RunResult:
    """One timed run of an arm: its output, timings, what it reused and the KV it held."""

    path: str  # the arm's name
    text: str
    token_ids: tuple[int, ...]
    ttft_ms: float
    copy_ms: float  # buffer allocation + the arm's fill (stored KV copied in; 0 for baseline)
    prefill_ms: float  # forward over the prefilled tokens
    sample_ms: float  # choosing the first token from its logits
    prefill_tokens: int
    decode_ms_per_token: float | None  # None when fewer than two tokens were generated
    decode_tokens: int
    peak_rss_bytes: int
    cuda_peak_bytes: int | None
    kv_buffer_bytes: int  # capacity of the run's buffer
    first_logits: torch.Tensor | None = field(repr=False, compare=False)  # None when read back from JSON
    reused_tokens: int = 0  # prompt tokens whose KV came from a store (modules or the prefix cache)
    recomputed_tokens: int = 0  # cached tokens prefilled again (repair, blend; in prefill_tokens)
    recomputed_positions: tuple[int, ...] = ()  # their position ids
    kv_buffer_used_bytes: int = 0  # KV in the run's buffer after the prefill (baseline: prompt tokens x bytes/token)
    kv_store_bytes: int = 0  # store entries the run read, as stored: modules (cached), prefix nodes (prefix)
    kv_buffer_bytes_after_retention: int = 0  # what decoding ran over (= kv_buffer_used_bytes without retention)
    retention_ms: float = 0.0  # scoring + thinning the buffer (question retention), after the first token

    @property
    def kv_held_bytes(self) -> int:
        """Stored entries read + the run's buffer after the prefill."""
        return self.kv_store_bytes + self.kv_buffer_used_bytes

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

    @classmethod
    def from_json(cls, path: str, d: dict) -> "RunResult":
        """A run read back from its ``run --json`` object (no logits; figures a run log lacks are 0)."""
        return cls(path=path, text=d.get("text", ""), token_ids=(), ttft_ms=d.get("ttft_ms", 0.0),
                   copy_ms=d.get("copy_ms", 0.0), prefill_ms=d.get("prefill_ms", 0.0),
                   sample_ms=d.get("sample_ms", 0.0), prefill_tokens=d.get("prefill_tokens", 0),
                   decode_ms_per_token=d.get("decode_ms_per_token"), decode_tokens=d.get("new_tokens", 0),
                   peak_rss_bytes=d.get("peak_rss_bytes", 0), cuda_peak_bytes=d.get("cuda_peak_bytes"),
                   kv_buffer_bytes=d.get("kv_buffer_bytes", 0), first_logits=None,
                   reused_tokens=d.get("reused_tokens", 0), recomputed_tokens=d.get("recomputed_tokens", 0),
                   recomputed_positions=tuple(d.get("recomputed_positions") or ()),
                   kv_buffer_used_bytes=d.get("kv_buffer_used_bytes", 0), kv_store_bytes=d.get("kv_store_bytes", 0),
                   kv_buffer_bytes_after_retention=d.get("kv_buffer_bytes_after_retention", 0),
                   retention_ms=d.get("retention_ms", 0.0))


@dataclass(frozen=True)
class Fill:
    """What an arm's ``fill`` (run inside TTFT, after the buffer is allocated) leaves for the prefill."""

    ids: Sequence[int]  # tokens to prefill
    pos: Sequence[int]  # their position ids
    entries: Sequence = ()  # store entries written into the buffer (their bytes are the run's store reads)
    reused_tokens: int = 0
    recomputed_positions: tuple[int, ...] = ()
    mask: RankMask | None = None  # prompt-order mask for the prefill (recompute), else the causal one


def timed_run(lm: LoadedModel, arm: str, capacity: int, fill: Callable[[KVBuffer], Fill], sampling: Sampling,
              on_token: TokenFn | None = None, retain: QuestionRetention | None = None,
              key_positions: list[torch.Tensor] | None = None) -> tuple[RunResult, KVBuffer]:
    """Allocate a buffer of ``capacity`` tokens, ``fill`` it, prefill, sample, decode: the one timed block
    every arm shares. Returns the run and its buffer (valid until the model's next run)."""
    with _PeakMemory(lm.device) as mem:
        _sync(lm.device)
        t0 = time.perf_counter()
        buf = workspace(lm).buffer(capacity)
        work = fill(buf)
        _sync(lm.device)
        copy_s = time.perf_counter() - t0
        out = _prefill_and_decode(lm, buf, work, sampling, arm, on_token, retain, key_positions)
    read = sum(e.nbytes for e in {id(e): e for e in work.entries}.values())
    steps = len(out.tokens) - 1
    run = RunResult(
        path=arm, text=lm.tokenizer.decode(out.tokens, skip_special_tokens=True), token_ids=tuple(out.tokens),
        ttft_ms=(copy_s + out.prefill_s + out.sample_s) * 1000, copy_ms=copy_s * 1000 if arm != "baseline" else 0.0,
        prefill_ms=out.prefill_s * 1000, sample_ms=out.sample_s * 1000, prefill_tokens=len(work.ids),
        decode_ms_per_token=out.decode_s * 1000 / steps if steps > 0 else None, decode_tokens=len(out.tokens),
        peak_rss_bytes=mem.peak_rss, cuda_peak_bytes=mem.cuda_peak, kv_buffer_bytes=buf.nbytes,
        first_logits=out.first_logits, reused_tokens=work.reused_tokens,
        recomputed_tokens=len(work.recomputed_positions), recomputed_positions=work.recomputed_positions,
        kv_buffer_used_bytes=out.used, kv_store_bytes=read, kv_buffer_bytes_after_retention=out.after,
        retention_ms=out.retention_ms)
    return run, buf


# ----------------------------------------------------------------------------------------------
# The arms
# ----------------------------------------------------------------------------------------------

@register(Arm.BASELINE, title="Baseline", subtitle="full prefill of every prompt token", color="#f97316",
          reads_store=False)
def baseline_arm(ctx: ArmContext) -> ArmResult:
    return ArmResult(Arm.BASELINE, run_baseline(ctx.lm, ctx.plan, ctx.sampling, ctx.on_token))


@register(Arm.PREFIX, title="Prefix cache", subtitle="the longest cached prefix reused, the rest prefilled",
          color="#0d9488", reads_store=True, legacy_prefix="prefix_")
def prefix_arm(ctx: ArmContext) -> ArmResult:
    if ctx.prefix is None:
        raise EngineError("the prefix arm needs a prefix cache (Engine.compare makes one per storage device)")
    run, reuse = _prefix_run(ctx.lm, ctx.plan, ctx.prefix, ctx.sampling, ctx.on_token, keep=ctx.keep)
    return ArmResult(Arm.PREFIX, run, detail=reuse)


@register(Arm.CACHED, title="Modular cache", subtitle="module KV reused, the rest prefilled", color="#4f46e5",
          reads_store=True, legacy_prefix="")
def cached_arm(ctx: ArmContext) -> ArmResult:
    return ArmResult(Arm.CACHED, run_cached(ctx.lm, ctx.plan, ctx.encoded, ctx.store, ctx.sampling, ctx.on_token,
                                            ctx.repair))


def run_baseline(lm: LoadedModel, plan: PromptPlan, sampling: Sampling = Sampling(),
                 on_token: TokenFn | None = None) -> RunResult:
    """One ordinary prefill of the whole materialised prompt at contiguous positions, then decode."""
    ids = list(plan.token_ids)
    run, _ = timed_run(lm, "baseline", len(ids) + sampling.max_new_tokens + 1,
                       lambda buf: Fill(ids, list(range(len(ids)))), sampling, on_token)
    return run


def run_cached(lm: LoadedModel, plan: PromptPlan, encoded: EncodedSchema, store: ModuleStore,
               sampling: Sampling = Sampling(), on_token: TokenFn | None = None, repair: int = 0) -> RunResult:
    """Assemble the imported modules' KV into one buffer, prefill only the uncached tokens, decode.

    ``repair`` K > 0 recomputes K link tokens per link (:func:`run_repaired`); 0 is this path, unchanged.
    """
    if repair:
        return run_repaired(lm, plan, encoded, store, sampling, on_token, repair)
    copies = copy_list(plan, encoded, store)
    ids, pos = plan.uncached()
    # sliding windows and ALiBi need the cached keys' position ids (gapped), not their cache indices
    key_pos = copied_positions(copies, lm.n_layers) if needs_positions(lm.model) else None

    def fill(buf: KVBuffer) -> Fill:
        for entry, a, b in copies:
            entry.write_into(buf, a, b)
        return Fill(ids, pos, [e for e, *_ in copies], reused_tokens=plan.cached_tokens)

    run, _ = timed_run(lm, "cached", plan.cached_tokens + len(ids) + sampling.max_new_tokens + 1, fill, sampling,
                       on_token, retain=question_retention(plan, encoded), key_positions=key_pos)
    return run


def run_repaired(lm: LoadedModel, plan: PromptPlan, encoded: EncodedSchema, store: ModuleStore,
                 sampling: Sampling = Sampling(), on_token: TokenFn | None = None, k: int = 4,
                 first: bool | None = None) -> RunResult:
    """The cached run with link-token recompute (issue 12, after EPIC).

    The tokens :func:`engine.repair.select_repair` picks are left out of the buffer and prefilled
    together with the uncached tokens, at their own position ids; every prefilled token attends
    to the cached entries and prefilled tokens before it in the prompt (:class:`RankMask`), so
    their fresh KV replaces the stored one for the rest of the run. TTFT includes the recompute.
    """
    check_recompute(lm, "link-token repair", "set repair to 0")
    sel = select_repair(plan, k, encoded.mode, first)
    return run_recomputed(lm, plan, encoded, store, set(sel.ranks), sel.positions, sampling, on_token)


def run_recomputed(lm: LoadedModel, plan: PromptPlan, encoded: EncodedSchema, store: ModuleStore, redo: set[int],
                   positions: tuple[int, ...], sampling: Sampling = Sampling(), on_token: TokenFn | None = None,
                   arm: str = "cached", before: Callable[[], None] | None = None) -> RunResult:
    """A cached run whose cached tokens of prompt ranks ``redo`` (at ``positions``) are recomputed: left out
    of the buffer and prefilled with the uncached tokens under the prompt-order mask. ``before`` runs
    first inside TTFT (a selection pass, for instance)."""
    copies = copy_list_ranked(plan, encoded, store, redo)
    ids, pos, ranks = prefilled(plan, redo)

    def fill(buf: KVBuffer) -> Fill:
        if before is not None:
            before()
        for entry, a, b, _ in copies:
            entry.write_into(buf, a, b)
        mask = RankMask(buffer_ranks(copies, lm.n_layers), torch.tensor(ranks, dtype=torch.long))
        return Fill(ids, pos, [e for e, *_ in copies], reused_tokens=plan.cached_tokens - len(redo),
                    recomputed_positions=tuple(positions), mask=mask)

    run, _ = timed_run(lm, arm, plan.cached_tokens + plan.uncached_tokens + sampling.max_new_tokens + 1, fill,
                       sampling, on_token)
    return run


def check_recompute(lm: LoadedModel, what: str, fix: str) -> None:
    """Refuse a recomputing run on a model whose attention the prompt-order mask cannot drive."""
    if getattr(lm.model.config, "_attn_implementation", "") != ATTENTION:
        raise EngineError(f"{what} needs the model to run with SDPA attention (the loaded model uses "
                          f"'{lm.model.config._attn_implementation}'); {fix}")
    if needs_positions(lm.model):
        raise EngineError(f"{what} is not available for models with sliding-window or ALiBi attention yet "
                          f"(its prompt-order mask would replace their position-aware one); {fix}")


def run_prefix(lm: LoadedModel, plan: PromptPlan, prefix: PrefixCache, sampling: Sampling = Sampling(),
               on_token: TokenFn | None = None, insert: bool = True, keep: Sequence[str] = ()) -> RunResult:
    """The prefix arm's run alone (its reuse details: :func:`prefix_arm`)."""
    return _prefix_run(lm, plan, prefix, sampling, on_token, insert, keep)[0]


def _prefix_run(lm: LoadedModel, plan: PromptPlan, prefix: PrefixCache, sampling: Sampling,
                on_token: TokenFn | None, insert: bool = True, keep: Sequence[str] = ()) -> tuple:
    """Reuse the longest cached token prefix (at most all but the last token), prefill the rest, decode;
    then (``insert``) store the prompt's KV in the prefix cache, as a server would, evicting by LRU but
    never the store entries ``keep`` (the modules the cached arm reads next)."""
    ids = list(plan.token_ids)
    warmed_with = prefix.summary(plan.layout.fingerprint)
    match = prefix.match(ids, limit=len(ids) - 1)
    k = match.reused

    def fill(buf: KVBuffer) -> Fill:
        for entry, a, b in match.pieces:
            entry.write_into(buf, a, b)
        return Fill(ids[k:], list(range(k, len(ids))), [e for e, *_ in match.pieces], reused_tokens=k)

    run, buf = timed_run(lm, "prefix", len(ids) + sampling.max_new_tokens + 1, fill, sampling, on_token)
    stored = prefix.insert(ids, buf.data[:, :, 0], list(keep)) if insert else 0  # before another run reuses it
    if insert:
        prefix.inserted_runs += 1
    reuse = PrefixReuse(reused_tokens=k, repeat=match.whole, stopped_at=token_place(plan, k),
                        warmed_with=warmed_with, stored_tokens=stored, prefilled_tokens=run.prefill_tokens)
    return run, reuse


def warm_prefix(lm: LoadedModel, prefix: PrefixCache, token_ids: tuple[int, ...] | list[int],
                keep: Sequence[str] = ()) -> int:
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
    return prefix.insert(ids, buf.data[:, :, 0], list(keep))


def compare(lm: LoadedModel, plan: PromptPlan, encoded: EncodedSchema, store: ModuleStore,
            sampling: Sampling = Sampling(), on_token: TokenFn | None = None,
            arms: Sequence[str] = ("baseline", "cached"), prefix: PrefixCache | None = None,
            repair: int = 0, blend: float = 0.15, options: dict | None = None) -> Comparison:
    """The asked-for arms of one plan, one after the other on the same buffers, in registry order, each
    with its agreement with the baseline. Store entries are fetched before any arm is timed."""
    wanted = [a for a in REGISTRY if a.value in {str(x) for x in arms}]
    if any(a not in (Arm.BASELINE, Arm.PREFIX) for a in wanted):  # the arms that read module entries
        fetch_entries(plan, encoded, store)
    keep = tuple(used_keys(plan, encoded)) if Arm.CACHED in wanted else ()
    ctx = ArmContext(lm, plan, encoded, store, sampling, on_token, prefix, keep, repair, blend, options or {})
    results = {a: REGISTRY[a].run(ctx) for a in wanted}
    base = results.get(Arm.BASELINE)
    return Comparison(
        model=lm.name, device=lm.device, plan=plan, store=StoreSummary.of(encoded, store), sampling=sampling,
        arms={a: r.with_agreement(base) for a, r in results.items()}, mode=encoded.mode, repair=repair,
        sink=encoded.sink)


def agreement(base: RunResult, other: RunResult) -> dict:
    """:meth:`Agreement.between` as the ``run --json`` keys (for benchmark scripts)."""
    a = Agreement.between(base, other)
    return {k: getattr(a, k) for k in Agreement.FIELDS}


def workspace(lm: LoadedModel) -> KVWorkspace:
    """The model's reusable KV workspace (created on first use)."""
    if lm.workspace is None:
        lm.workspace = KVWorkspace(lm.n_layers, lm.kv_heads, lm.head_dim, lm.model.dtype, lm.device)
    return lm.workspace


# ----------------------------------------------------------------------------------------------
# Internal helpers
# ----------------------------------------------------------------------------------------------

@dataclass
class _Decoded:
    tokens: list[int]
    first_logits: torch.Tensor
    prefill_s: float
    sample_s: float
    decode_s: float
    used: int  # buffer bytes after the prefill
    after: int  # ... after retention
    retention_ms: float


def _prefill_and_decode(lm: LoadedModel, buf: KVBuffer, work: Fill, sampling: Sampling, arm: str,
                        on_token: TokenFn | None, retain: QuestionRetention | None,
                        key_positions: list[torch.Tensor] | None) -> _Decoded:
    """Prefill ``work.ids`` over the filled buffer, sample the first token, decode the rest (timings inside)."""
    model, device = lm.model, lm.device
    gen = torch.Generator(device="cpu").manual_seed(sampling.seed) if sampling.temperature > 0 else None
    cache = buf.cache()
    attach(cache, key_positions)
    with torch.inference_mode():
        t1 = time.perf_counter()
        with rank_masked(work.mask), (retain.watching() if retain is not None else contextlib.nullcontext()):
            # the rank mask acts on the prefill only: decode steps see the whole buffer
            out = model(input_ids=torch.tensor([list(work.ids)], device=device),
                        position_ids=torch.tensor([list(work.pos)], device=device),
                        past_key_values=cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[0, -1]
        _sync(device)
        t_fwd = time.perf_counter()
        tokens = [_sample(logits, sampling, gen)]
        _sync(device)
        t2 = time.perf_counter()
        if on_token:
            on_token(arm, lm.tokenizer.decode(tokens, skip_special_tokens=True))
        cache, used, after, retention_ms = _retain(buf, cache, retain, device)
        decode_s = _decode(lm, cache, tokens, work.pos[-1] + 1, sampling, gen, arm, on_token)
    cache.sync_length()
    return _Decoded(tokens, logits.detach().float().cpu(), t_fwd - t1, t2 - t_fwd, decode_s, used, after,
                    retention_ms)


def _decode(lm: LoadedModel, cache, tokens: list[int], next_pos: int, sampling: Sampling, gen,
            arm: str, on_token: TokenFn | None) -> float:
    """Greedy / sampled decoding after the first token, appending to ``tokens``; returns seconds spent."""
    eos = set(lm.eos_ids)
    spent = 0.0
    while len(tokens) < sampling.max_new_tokens and tokens[-1] not in eos:
        s = time.perf_counter()
        out = lm.model(input_ids=torch.tensor([[tokens[-1]]], device=lm.device),
                       position_ids=torch.tensor([[next_pos]], device=lm.device), past_key_values=cache,
                       use_cache=True, logits_to_keep=1)
        tok = _sample(out.logits[0, -1], sampling, gen)
        _sync(lm.device)
        spent += time.perf_counter() - s
        tokens.append(tok)
        next_pos += 1
        if on_token:
            on_token(arm, lm.tokenizer.decode(tokens, skip_special_tokens=True))
    return spent


def _sample(logits: torch.Tensor, sampling: Sampling, gen: torch.Generator | None) -> int:
    if sampling.temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / sampling.temperature, -1)
    if not bool(torch.isfinite(probs).all()):  # so small a temperature that the logits overflowed: its limit
        return int(torch.argmax(logits))
    if sampling.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, -1) - sorted_p < sampling.top_p
        keep[0] = True  # the likeliest token always (a top-p below float32's smallest number would keep none)
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        return int(order[torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=gen)])
    return int(torch.multinomial(probs, 1, generator=gen))


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



from . import blend as _blend  # noqa: E402,F401  (registers the blend arm; it builds on the functions above)
