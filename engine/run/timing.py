"""The one timed run every arm goes through, a generator of its events: TTFT is the arm's ``fill`` of its lease +
prefill + first token, synchronized (not the wait for the lease); then the decoder (engine/run/decode.py)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Generator, Sequence

import torch

from engine.cache.compress import QuestionRetention
from engine.kv.pool import Lease, lease_tokens
from engine.model.attend import PLAIN, AttentionSpec
from engine.model.load import LoadedModel
from engine.model.positions import attach
from engine.run import forward, memory
from engine.run.decode import Breathe, Decoder, Started, sync, take_lease
from engine.run.events import FirstToken, Token
from engine.run.sampling import sample
from engine.run.stream import TextStream
from engine.run.types import RunResult, Sampling

Timed = Generator["FirstToken | Token | Breathe", None, RunResult]

# decoding runs step between a long prefill's chunks (docs/architecture.md); where they end depends on the prompt
# alone: chunked and whole forwards round differently
PREFILL_CHUNK = 256


@dataclass(frozen=True)
class Fill:
    """What an arm's ``fill`` (inside TTFT) leaves for the prefill."""

    ids: Sequence[int]  # tokens to prefill
    pos: Sequence[int]  # their position ids
    entries: Sequence = ()  # store entries written into the buffer
    reused_tokens: int = 0
    precomputed_tokens: int | None = None  # as RunResult's; None: reused_tokens
    recomputed_positions: tuple[int, ...] = ()
    prefill: AttentionSpec = PLAIN  # what the prefill attends to
    decode: AttentionSpec = PLAIN  # what every decode step attends to
    copies: bool = True  # False: fill writes nothing; copy_ms 0
    retain: QuestionRetention | None = None  # thins the buffer after the first token
    key_positions: list[torch.Tensor] | None = None  # per layer, the buffer's key positions (sliding windows, ALiBi)
    logits: torch.Tensor | None = None  # known logits after ``ids``, whose KV fill wrote: nothing is prefilled


def timed_run(lm: LoadedModel, arm: str, tokens: int, fill: Callable[[Lease], Fill], sampling: Sampling,
              decoder: Decoder | None = None, after: Callable[[Lease, RunResult], None] | None = None) -> Timed:
    """Lease room for ``tokens`` (what ``fill`` and the prefill write) and the decoding; ``fill``, prefill, sample
    (a FirstToken); ``after(lease, run)`` reads the prompt's KV (a cache keeps it); then decode through ``decoder``
    (default: at once), which releases the lease. The run (whole once :meth:`Decoder.finish` gives it)."""
    decoder = decoder or Decoder(lm)
    lease = yield from take_lease(decoder.pool, lease_tokens(tokens, sampling.max_new_tokens))
    started = None
    try:
        with memory.PEAK_MEMORY(lm.device) as mem:
            sync(lm.device)
            t0 = time.perf_counter()
            work = fill(lease)
            sync(lm.device)
            first, started = yield from _first_token(lm, lease, work, sampling, arm, time.perf_counter() - t0)
            if after is not None:
                after(lease, first)
            yield FirstToken(arm, started.tokens[0], started.said, first)
            yield from decoder.take(started)  # the decoder owns the lease now
        started.run = dataclasses.replace(first, peak_rss_bytes=mem.peak_rss, cuda_peak_bytes=mem.cuda_peak)
        return started.result(lm.tokenizer, started.run)
    finally:
        if started is None or not decoder.owns(started):
            lease.release()  # a run that failed before its decode, or decoded at once


# -- internal helpers --

def _first_token(lm: LoadedModel, lease: Lease, work: Fill, sampling: Sampling, arm: str,
                 copy_s: float) -> Generator[Breathe, None, tuple[RunResult, Started]]:
    """Prefill (a :class:`Breathe` between chunks), sample, thin the lease: the first-token figures (of its own
    forwards) and the run."""
    device = lm.device
    gen = torch.Generator(device="cpu").manual_seed(sampling.seed) if sampling.temperature > 0 else None
    attach(lease.cache(), work.key_positions)
    prefill_s = 0.0
    if work.logits is None:
        for a, b in prefill_chunks(work):
            if a:
                yield Breathe()
            with torch.inference_mode():
                t1 = time.perf_counter()
                # a graph neither scores nor tracks positions
                graphable = b - a == len(work.ids) and work.retain is None and work.key_positions is None
                logits = forward.prefill(lm, lease, work.ids[a:b], work.pos[a:b], work.prefill, graphable)
                sync(device)
                prefill_s += time.perf_counter() - t1
    else:
        logits = work.logits.to(device)
    with torch.inference_mode():
        t_fwd = time.perf_counter()
        token = sample(logits, sampling, gen, arm, 0)
        sync(device)
        t2 = time.perf_counter()
    started = Started(arm, lease, [token], work.pos[-1] + 1, sampling, gen, work.decode, TextStream(lm.tokenizer))
    started.token()  # its text so far
    used, kept, retention_ms = _retain(lease, work.retain, device)
    sample_s = t2 - t_fwd
    read = sum(e.nbytes for e in {id(e): e for e in work.entries}.values())
    run = RunResult(
        arm=arm, text=started.said, token_ids=(token,), ttft_ms=(copy_s + prefill_s + sample_s) * 1000,
        copy_ms=copy_s * 1000 if work.copies else 0.0, prefill_ms=prefill_s * 1000, sample_ms=sample_s * 1000,
        prefill_tokens=0 if work.logits is not None else len(work.ids), decode_ms_per_token=None, decode_tokens=1,
        peak_rss_bytes=0, cuda_peak_bytes=None, kv_buffer_bytes=lease.nbytes,
        first_logits=logits.detach().float().cpu(), reused_tokens=work.reused_tokens,
        precomputed_tokens=work.reused_tokens if work.precomputed_tokens is None else work.precomputed_tokens,
        recomputed_tokens=len(work.recomputed_positions),
        recomputed_positions=work.recomputed_positions, kv_buffer_used_bytes=used,
        kv_buffer_bytes_after_retention=kept, kv_store_bytes=read, retention_ms=retention_ms)
    return run, started


def prefill_chunks(work: Fill) -> list[tuple[int, int]]:
    """``[a, b)`` slices of ``work.ids``: ``n / PREFILL_CHUNK`` (rounded) near-equal ones where the prefill attends
    plainly, else one."""
    n = len(work.ids)
    plain = work.prefill.plain and work.retain is None and work.key_positions is None
    k = max(1, round(n / PREFILL_CHUNK)) if plain else 1
    return [(n * i // k, n * (i + 1) // k) for i in range(k)]


def _retain(lease: Lease, retain: QuestionRetention | None, device: str) -> tuple[int, int, float]:
    """(bytes after the prefill, after retention, ms thinning)."""
    used = lease.used_bytes
    if retain is None:
        return used, used, 0.0
    s = time.perf_counter()
    retain.apply(lease)
    sync(device)
    return used, lease.used_bytes, (time.perf_counter() - s) * 1000
