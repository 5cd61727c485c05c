"""The one timed block every arm's run goes through, and the recompute path several arms share.

TTFT is measured one way for every arm, by :func:`timed_run`: synchronize, ``perf_counter``
around (buffer allocation + the arm's ``fill``: copying stored KV, building the prompt-order
mask) + prefill + first sampled token, synchronize. The TTFT of the arms that read stored KV
therefore includes the copy into the run's buffer (``copy_ms`` reports that share; int8 / int4
entries are dequantized by that copy); finding the entries (store lookups, the prefix tree's walk)
happens before. Decoding is our own loop over a preallocated buffer with explicit position ids —
``model.generate()`` derives positions from the cache length, which is wrong for gapped caches.

With ``question`` retention a run thins its buffer after the first token is out (``retention_ms``,
outside TTFT) and decodes over the smaller cache. Each run reports the KV bytes it held: its buffer
after the prefill, the stored entries it read, and the buffer after retention.

A run's buffers come from a :class:`engine.kv.KVWorkspace` per loaded model, kept here (not on the
model) and reused run after run, so allocation costs the same for every arm.

**Decoding together.** Inside :func:`decode_together` (a comparison's arms), a run stops after its first
token (its TTFT measured alone, as above), keeps a copy of its KV and waits; :meth:`DecodeBatch.decode` then
decodes every waiting run as one batch (engine/kv/batched.py), reading the weights once per step for all of
them. Each run's ``decode_ms_per_token`` is then the batch's time per step while that run was generating,
and ``decode_batch`` says how many runs shared it. Runs whose cache the batch cannot hold decode alone,
as before: thinned layers (question retention, compressed entries), models that track key positions
(sliding windows, ALiBi) or use their own attention code.

**Stopping.** ``on_token`` is called after every sampled token; an exception it raises ends the run there
(``Engine.compare`` turns its ``should_stop`` into such a callback). A run whose text
comes to hold one of ``Sampling.stop`` ends there normally (its text keeps the stop string; front ends cut it).
Every sampled token's logit is checked: a NaN or infinite one raises :class:`engine.errors.NonFiniteLogits`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from engine.arms.registry import RunResult, Sampling, TokenFn
from engine.cache.assemble import buffer_ranks, copy_list_ranked, module_slots, prefilled
from engine.cache.compress import QuestionRetention
from engine.cache.encode import EncodedSchema
from engine.cache.store import ModuleStore
from engine.errors import EngineError, NonFiniteLogits
from engine.kv import BatchedKV, KVBuffer, KVWorkspace
from engine.model import graphs, step
from engine.model.attend import (ATTENTION, ApeScale, Focus, RankMask, ape_scaled, focused, key_masked, plain,
                                 rank_masked)
from engine.model.load import LoadedModel
from engine.model.positions import attach, needs_positions
from engine.schema.plan import PromptPlan

__all__ = ["Fill", "timed_run", "run_recomputed", "check_recompute", "workspace", "DecodeBatch", "decode_together",
           "decoder_layers", "run_until", "ape_scale"]

_BATCH: contextvars.ContextVar["DecodeBatch | None"] = contextvars.ContextVar("pml_decode_batch", default=None)
_WORKSPACES: "weakref.WeakKeyDictionary[torch.nn.Module, KVWorkspace]" = weakref.WeakKeyDictionary()  # by model


@dataclass(frozen=True)
class Fill:
    """What an arm's ``fill`` (run inside TTFT, after the buffer is allocated) leaves for the prefill."""

    ids: Sequence[int]  # tokens to prefill
    pos: Sequence[int]  # their position ids
    entries: Sequence = ()  # store entries written into the buffer (their bytes are the run's store reads)
    reused_tokens: int = 0
    recomputed_positions: tuple[int, ...] = ()
    mask: RankMask | None = None  # prompt-order mask for the prefill (recompute), else the causal one
    ape: ApeScale | None = None  # APE's attention over the modules, for the prefill and every decode step
    focus: Focus | None = None  # decode-time focus among the kept modules (the routed arm)


def timed_run(lm: LoadedModel, arm: str, capacity: int, fill: Callable[[KVBuffer], Fill], sampling: Sampling,
              on_token: TokenFn | None = None, retain: QuestionRetention | None = None,
              key_positions: list[torch.Tensor] | None = None) -> tuple[RunResult, KVBuffer]:
    """Allocate a buffer of ``capacity`` tokens, ``fill`` it, prefill, sample, decode: the one timed block
    every arm shares. Returns the run and its buffer (valid until the model's next run)."""
    with PEAK_MEMORY(lm.device) as mem:
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
        arm=arm, text=lm.tokenizer.decode(out.tokens, skip_special_tokens=True), token_ids=tuple(out.tokens),
        ttft_ms=(copy_s + out.prefill_s + out.sample_s) * 1000, copy_ms=copy_s * 1000 if arm != "baseline" else 0.0,
        prefill_ms=out.prefill_s * 1000, sample_ms=out.sample_s * 1000, prefill_tokens=len(work.ids),
        decode_ms_per_token=out.decode_s * 1000 / steps if steps > 0 else None, decode_tokens=len(out.tokens),
        peak_rss_bytes=mem.peak_rss, cuda_peak_bytes=mem.cuda_peak, kv_buffer_bytes=buf.nbytes,
        first_logits=out.first_logits, reused_tokens=work.reused_tokens,
        recomputed_tokens=len(work.recomputed_positions), recomputed_positions=work.recomputed_positions,
        kv_buffer_used_bytes=out.used, kv_store_bytes=read, kv_buffer_bytes_after_retention=out.after,
        retention_ms=out.retention_ms)
    if out.waiting is not None:  # decoded later, with the other runs of the batch
        out.waiting.run = run
        _BATCH.get().waiting.append(out.waiting)
    return run, buf



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


def ape_scale(lm: LoadedModel, ranges: list, ape: tuple[float, float] | None) -> ApeScale | None:
    """APE's attention (T, S) over the modules of ``ranges`` ((entry, first, end, module or None), in buffer order:
    :func:`engine.cache.assemble.module_ranges`); None when ``ape`` is None or (1, 1), plain attention."""
    if ape is None or tuple(ape) == (1.0, 1.0):
        return None
    check_ape(lm)
    return ApeScale(module_slots(ranges, lm.n_layers), *ape)


def check_ape(lm: LoadedModel) -> None:
    """Refuse APE on a model whose attention the engine's APE path cannot compute."""
    fix = "set ape-t and ape-s to 1"
    if getattr(lm.model.config, "_attn_implementation", "") != ATTENTION:
        raise EngineError(f"APE needs the model to run with SDPA attention (the loaded model uses "
                          f"'{lm.model.config._attn_implementation}'); {fix}")
    if needs_positions(lm.model) or getattr(lm.model.config, "attn_logit_softcapping", None):
        raise EngineError(f"APE is not available for models with sliding-window, ALiBi or soft-capped attention "
                          f"yet ('{lm.model.config.model_type}'); {fix}")


def decoder_layers(model, what: str, fix: str) -> torch.nn.ModuleList:
    """The model's decoder layers, in the order its forward calls them; EngineError naming ``what`` needs them."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise EngineError(f"{what} needs the decoder layers at `model.model.layers`, which "
                          f"'{model.config.model_type}' models do not have; {fix}")
    return layers


def run_until(lm: LoadedModel, last: int, what: str, fix: str, **inputs) -> None:
    """``lm.model(**inputs)`` through decoder layers ``0..last`` only (a hook ends the forward there): a partial
    prefill whose observers (scorers, the cache) saw those layers. Run it inside ``torch.inference_mode()``."""
    handle = decoder_layers(lm.model, what, fix)[last].register_forward_hook(_stop)
    try:
        lm.model(**inputs)
    except _Enough:
        return
    finally:
        handle.remove()
    raise EngineError(f"{what} ran past layer {last}: the model's decoder layers are not called in order; {fix}")


def workspace(lm: LoadedModel) -> KVWorkspace:
    """The reusable KV workspace of runs on ``lm`` (created on first use, dropped with the model)."""
    space = _WORKSPACES.get(lm.model)
    if space is None or (space.dtype, str(space.device)) != (lm.model.dtype, str(lm.device)):
        space = _WORKSPACES[lm.model] = KVWorkspace(lm.n_layers, lm.kv_heads, lm.head_dim, lm.model.dtype, lm.device)
    return space


# ----------------------------------------------------------------------------------------------
# Internal helpers
# ----------------------------------------------------------------------------------------------

class _Enough(Exception):
    """Raised after :func:`run_until`'s last layer to end its forward."""


def _stop(module, args, output):
    raise _Enough


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
    waiting: "_Waiting | None" = None  # set when the run waits to be decoded with a batch


def _prefill_and_decode(lm: LoadedModel, buf: KVBuffer, work: Fill, sampling: Sampling, arm: str,
                        on_token: TokenFn | None, retain: QuestionRetention | None,
                        key_positions: list[torch.Tensor] | None) -> _Decoded:
    """Prefill ``work.ids`` over the filled buffer, sample the first token, decode the rest (timings inside)."""
    model, device = lm.model, lm.device
    gen = torch.Generator(device="cpu").manual_seed(sampling.seed) if sampling.temperature > 0 else None
    cache = buf.cache()
    attach(cache, key_positions)
    with torch.inference_mode(), ape_scaled(work.ape), focused(work.focus, model):
        t1 = time.perf_counter()
        with rank_masked(work.mask), (retain.watching() if retain is not None else contextlib.nullcontext()):
            # the rank mask acts on the prefill only: decode steps see the whole buffer
            graphed = graphs.forward(lm, cache, work.ids, work.pos) if work.mask is None and work.ape is None \
                and work.focus is None and retain is None and key_positions is None else None
            out = graphed if graphed is not None else model(
                input_ids=torch.tensor([list(work.ids)], device=device),
                position_ids=torch.tensor([list(work.pos)], device=device),
                past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        logits = out[0]
        _sync(device)
        t_fwd = time.perf_counter()
        tokens = [_sample(logits, sampling, gen, arm, 0)]
        _sync(device)
        t2 = time.perf_counter()
        if on_token:
            on_token(arm, lm.tokenizer.decode(tokens, skip_special_tokens=True))
        cache, used, after, retention_ms = _retain(buf, cache, retain, device)
        batch = _BATCH.get()
        alone = work.ape is not None or work.focus is not None  # their attention is the run's own: decoded alone
        if batch is not None and not alone and batch.takes(lm, buf, tokens, sampling):
            waiting = _Waiting(arm, buf.data[:, :, 0, :, : buf.length].clone(), tokens, work.pos[-1] + 1, sampling,
                               gen, on_token)
            return _Decoded(tokens, logits.detach().float().cpu(), t_fwd - t1, t2 - t_fwd, 0.0, used, after,
                            retention_ms, waiting)
        decode_s = _decode(lm, cache, tokens, work.pos[-1] + 1, sampling, gen, arm, on_token)
    cache.sync_length()
    return _Decoded(tokens, logits.detach().float().cpu(), t_fwd - t1, t2 - t_fwd, decode_s, used, after,
                    retention_ms)


def _decode(lm: LoadedModel, cache, tokens: list[int], next_pos: int, sampling: Sampling, gen,
            arm: str, on_token: TokenFn | None) -> float:
    """Greedy / sampled decoding after the first token, appending to ``tokens``; returns seconds spent."""
    spent = 0.0
    while not _ended(lm, tokens, sampling):
        s = time.perf_counter()
        tok = _sample(_step(lm, cache, [tokens[-1]], [next_pos])[0], sampling, gen, arm, len(tokens))
        _sync(lm.device)
        spent += time.perf_counter() - s
        tokens.append(tok)
        next_pos += 1
        if on_token:
            on_token(arm, lm.tokenizer.decode(tokens, skip_special_tokens=True))
    return spent


@dataclass
class _Waiting:
    """A run stopped after its first token, waiting to be decoded with a batch."""

    arm: str
    kv: torch.Tensor  # its buffer's KV, copied: [layers, 2, kv_heads, length, head_dim]
    tokens: list[int]
    next_pos: int
    sampling: Sampling
    gen: torch.Generator | None
    on_token: TokenFn | None
    run: RunResult | None = None  # as timed_run made it (first token only)
    spent: float = 0.0  # seconds of the batch's steps this run generated in
    steps: int = 0


class DecodeBatch:
    """Runs of one model waiting to be decoded together (see the module docstring)."""

    def __init__(self, lm: LoadedModel):
        self.lm = lm
        self.waiting: list[_Waiting] = []
        self.done: list[_Waiting] = []
        self.size = 0  # runs in the last batch

    def takes(self, lm: LoadedModel, buf: KVBuffer, tokens: list[int], sampling: Sampling) -> bool:
        """Whether a run with this buffer, after its first token, can wait for the batch (a model that tracks
        key positions, the only one given ``key_positions``, never can)."""
        level = all(n == buf.lengths[0] for n in buf.lengths)
        return (lm is self.lm and lm.attention == "pml" and not needs_positions(lm.model) and level and not _ended(lm, tokens, sampling))

    def decode(self) -> None:
        """Decode every waiting run (one batch when there are several); :meth:`finish` then gives each run."""
        waiting, self.waiting = self.waiting, []
        if len(waiting) == 1:
            _decode_alone(self.lm, waiting[0])
        elif waiting:
            _decode_batch(self.lm, waiting)
        self.done += waiting
        self.size = len(waiting)

    def finish(self, run: RunResult) -> RunResult:
        """``run`` (as an arm returned it: timed_run's first-token run, perhaps renamed) with its decoded tokens
        and decode timing; unchanged if it never waited here. A run is known by its first logits, which every
        copy of it shares."""
        for w in self.done:
            if w.run.first_logits is run.first_logits:
                return dataclasses.replace(run, text=self.lm.tokenizer.decode(w.tokens, skip_special_tokens=True),
                                           token_ids=tuple(w.tokens), decode_tokens=len(w.tokens),
                                           decode_ms_per_token=w.spent * 1000 / w.steps if w.steps else None,
                                           decode_batch=self.size)
        return run


@contextlib.contextmanager
def decode_together(lm: LoadedModel, enabled: bool = True):
    """Within this block, runs on ``lm`` wait after their first token in the yielded :class:`DecodeBatch`
    (None when not ``enabled``: runs decode as they go); call its ``decode()``, then ``finish(run)`` for each
    run an arm returned."""
    batch = DecodeBatch(lm) if enabled else None
    token = _BATCH.set(batch)
    try:
        yield batch
    finally:
        _BATCH.reset(token)


def _decode_alone(lm: LoadedModel, w: _Waiting) -> None:
    buf = workspace(lm).buffer(w.kv.shape[3] + w.sampling.max_new_tokens + 1)
    buf.write(w.kv)
    with torch.inference_mode():
        w.spent = _decode(lm, buf.cache(), w.tokens, w.next_pos, w.sampling, w.gen, w.arm, w.on_token)
    w.steps = len(w.tokens) - 1


def _decode_batch(lm: LoadedModel, waiting: list[_Waiting]) -> None:
    """Step every run in one forward until each has its tokens (a finished row rides along, ignored)."""
    kv = BatchedKV([w.kv for w in waiting], room=max(w.sampling.max_new_tokens for w in waiting) + 1)
    cache = kv.cache()
    live = [True] * len(waiting)
    with torch.inference_mode():
        while any(live):
            s = time.perf_counter()
            logits = _step(lm, cache, [w.tokens[-1] for w in waiting], [w.next_pos for w in waiting], kv.key_mask)
            kv.advance()
            grew = []
            for row, w in enumerate(waiting):
                if live[row]:
                    w.tokens.append(_sample(logits[row], w.sampling, w.gen, w.arm, len(w.tokens)))
                    w.next_pos += 1
                    grew.append(w)
            _sync(lm.device)
            step = time.perf_counter() - s
            for row, w in enumerate(waiting):
                if live[row]:
                    w.spent += step
                    w.steps += 1
                    live[row] = not _ended(lm, w.tokens, w.sampling)
            for w in grew:
                if w.on_token:
                    w.on_token(w.arm, lm.tokenizer.decode(w.tokens, skip_special_tokens=True))


def _ended(lm: LoadedModel, tokens: list[int], sampling: Sampling) -> bool:
    """Whether a run's generation is over: ``max_new_tokens`` reached, an end-of-sequence token, or one of
    ``sampling.stop`` in its text (asked after every token, so only the last few tokens can hold a new one)."""
    if len(tokens) >= sampling.max_new_tokens or tokens[-1] in lm.eos_ids:
        return True
    if not sampling.stop:
        return False
    longest = max(len(s.encode()) for s in sampling.stop)  # a token holds at least one byte of the text
    tail = lm.tokenizer.decode(tokens[-(longest + 2):], skip_special_tokens=True)
    return any(s in tail for s in sampling.stop)


def _step(lm: LoadedModel, cache, ids: list[int], positions: list[int], key_mask=None) -> torch.Tensor:
    """Logits [rows, vocab] of one decode step (token ``ids[row]`` at ``positions[row]`` per row) over ``cache``:
    the C++ decoder where it applies (engine/model/step.py) and no engine context changes attention, else the
    model's forward (``key_mask()``: the batched rows' key mask it then needs)."""
    fast = step.decoder(lm.model, lm.weights) if plain() else None
    view = cache.step_view() if fast is not None and hasattr(cache, "step_view") else None
    if view is not None:
        logits = fast(ids, positions, *view)
        cache.advance()
        return logits
    graphed = graphs.forward(lm, cache, ids, positions) if key_mask is None and len(ids) == 1 else None
    if graphed is not None:  # a CUDA graph's replay (engine/model/graphs.py)
        return graphed
    with key_masked(key_mask()) if key_mask is not None else contextlib.nullcontext():
        out = lm.model(input_ids=torch.tensor([[i] for i in ids], device=lm.device),
                       position_ids=torch.tensor([[p] for p in positions], device=lm.device), past_key_values=cache,
                       use_cache=True, logits_to_keep=1)
    return out.logits[:, -1]


def _sample(logits: torch.Tensor, sampling: Sampling, gen: torch.Generator | None, arm: str = "", at: int = 0) -> int:
    """The next token from ``logits`` [vocab]; NonFiniteLogits when the logits hold NaN or +inf (``arm``, ``at``:
    the run and the token's index, for the message)."""
    if sampling.temperature <= 0:
        return _finite(logits, int(torch.argmax(logits)), arm, at)
    probs = torch.softmax(logits.float() / sampling.temperature, -1)
    if not bool(torch.isfinite(probs).all()):  # so small a temperature that the logits overflowed: its limit
        return _finite(logits, int(torch.argmax(logits)), arm, at)
    if sampling.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, -1) - sorted_p < sampling.top_p
        keep[0] = True  # the likeliest token always (a top-p below float32's smallest number would keep none)
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        return int(order[torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=gen)])
    return int(torch.multinomial(probs, 1, generator=gen))


def _finite(logits: torch.Tensor, tok: int, arm: str, at: int) -> int:
    """``tok``, the argmax of ``logits``, after checking its logit: argmax picks a NaN or +inf when there is one,
    so one number read tells whether the logits are broken."""
    if not math.isfinite(float(logits[tok])):
        where = "the first token" if at == 0 else f"token {at + 1}"
        raise NonFiniteLogits(f"the model produced non-finite logits (NaN or inf) at {where} of the {arm or 'run'} "
                              "arm: its weights or rope settings are broken (a NaN in the checkpoint, a rope_theta "
                              "or rope_scaling that overflows); check the model's config.json and weights")
    return tok


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
    """Peak resident memory of the process during a run, and the CUDA peak.

    On Linux the kernel keeps the high-water mark itself (``VmHWM``); it is reset through
    ``/proc/self/clear_refs`` before the run and read after it, so nothing runs beside the timed block.
    Where that cannot be written, :class:`_SampledPeak` polls the resident size from a thread instead
    (bench/peak_memory.py measures what that thread costs a TTFT).
    """

    def __init__(self, device: str):
        self.device = device
        self.peak_rss = 0
        self.cuda_peak: int | None = None

    def __enter__(self) -> "_PeakMemory":
        if self.device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        self._start()
        return self

    def __exit__(self, *exc) -> None:
        self.peak_rss = max(self._stop(), _rss_bytes())
        if self.device.startswith("cuda"):
            self.cuda_peak = int(torch.cuda.max_memory_allocated())

    def _start(self) -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current resident size

    def _stop(self) -> int:
        return _status_bytes("VmHWM")


class _SampledPeak(_PeakMemory):
    """The fallback: the resident size sampled every ``interval`` seconds by a thread during the run."""

    def __init__(self, device: str, interval: float = 0.005):
        super().__init__(device)
        self.interval = interval
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._done.is_set():
            self.peak_rss = max(self.peak_rss, _rss_bytes())
            self._done.wait(self.interval)

    def _start(self) -> None:
        self.peak_rss = _rss_bytes()
        self._thread.start()

    def _stop(self) -> int:
        self._done.set()
        self._thread.join()
        return self.peak_rss


def _status_bytes(field: str) -> int:
    """A ``kB`` field of /proc/self/status in bytes (0 when absent)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _hwm_resettable() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_bytes("VmHWM") > 0
    except OSError:
        return False


PEAK_MEMORY = _PeakMemory if _hwm_resettable() else _SampledPeak  # how timed_run reads a run's peak memory
