"""The one timed run every arm goes through: TTFT is buffer allocation + the arm's ``fill`` + prefill + first
token, synchronized (docs/architecture.md); decoding follows, alone or in a batch. An exception from
``on_token`` ends the run."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from engine.cache.compress import QuestionRetention
from engine.kv import KVBuffer
from engine.model import graphs
from engine.model.attend import PLAIN, AttentionSpec
from engine.model.load import LoadedModel
from engine.model.positions import attach
from engine.run import memory
from engine.run.batch import DecodeBatch, Waiting
from engine.run.decode import decode, sync
from engine.run.sampling import sample
from engine.run.stream import token_sink
from engine.run.types import RunResult, Sampling, TokenFn
from engine.run.workspace import workspace


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
    detail: Any = None  # what the arm chose inside TTFT (read back by timed_detail)
    retain: QuestionRetention | None = None  # thins the buffer after the first token
    key_positions: list[torch.Tensor] | None = None  # per layer, the buffer's key positions (sliding windows, ALiBi)
    logits: torch.Tensor | None = None  # known logits after ``ids``, whose KV fill wrote: nothing is prefilled


def timed_run(lm: LoadedModel, arm: str, capacity: int, fill: Callable[[KVBuffer], Fill], sampling: Sampling,
              on_token: TokenFn | None = None, batch: DecodeBatch | None = None) -> tuple[RunResult, KVBuffer]:
    """Allocate ``capacity`` tokens, ``fill``, prefill, sample, decode (or wait in ``batch``); the run and its
    buffer (valid until the model's next run)."""
    run, buf, _ = timed_detail(lm, arm, capacity, fill, sampling, on_token, batch)
    return run, buf


def timed_detail(lm: LoadedModel, arm: str, capacity: int, fill: Callable[[KVBuffer], Fill], sampling: Sampling,
                 on_token: TokenFn | None = None, batch: DecodeBatch | None = None) -> tuple[RunResult, KVBuffer, Any]:
    """:func:`timed_run`, and the ``detail`` of the Fill that ``fill`` made."""
    with memory.PEAK_MEMORY(lm.device) as mem:
        sync(lm.device)
        t0 = time.perf_counter()
        buf = workspace(lm).buffer(capacity)
        work = fill(buf)
        sync(lm.device)
        copy_s = time.perf_counter() - t0
        out = _prefill_and_decode(lm, buf, work, sampling, arm, token_sink(arm, lm.tokenizer, on_token), batch)
    read = sum(e.nbytes for e in {id(e): e for e in work.entries}.values())
    steps = len(out.tokens) - 1
    run = RunResult(
        arm=arm, text=lm.tokenizer.decode(out.tokens, skip_special_tokens=True), token_ids=tuple(out.tokens),
        ttft_ms=(copy_s + out.prefill_s + out.sample_s) * 1000, copy_ms=copy_s * 1000 if work.copies else 0.0,
        prefill_ms=out.prefill_s * 1000, sample_ms=out.sample_s * 1000,
        prefill_tokens=0 if work.logits is not None else len(work.ids),
        decode_ms_per_token=out.decode_s * 1000 / steps if steps > 0 else None, decode_tokens=len(out.tokens),
        peak_rss_bytes=mem.peak_rss, cuda_peak_bytes=mem.cuda_peak, kv_buffer_bytes=buf.nbytes,
        first_logits=out.first_logits, reused_tokens=work.reused_tokens,
        precomputed_tokens=work.reused_tokens if work.precomputed_tokens is None else work.precomputed_tokens,
        recomputed_tokens=len(work.recomputed_positions), recomputed_positions=work.recomputed_positions,
        kv_buffer_used_bytes=out.used, kv_buffer_bytes_after_retention=out.after, kv_store_bytes=read,
        retention_ms=out.retention_ms)
    if out.waiting is not None:
        out.waiting.run = run
        batch.waiting.append(out.waiting)
    return run, buf, work.detail


def prefill(lm: LoadedModel, cache, work: Fill) -> torch.Tensor:
    """Logits [vocab] after ``work.ids``: a CUDA graph's replay where one applies, else the model's forward."""
    plain = work.retain is None and work.key_positions is None  # a graph neither scores nor tracks positions
    graphed = graphs.forward(lm, cache, work.ids, work.pos, work.prefill) if plain else None
    if graphed is not None:
        return graphed[0]
    device = lm.device
    return lm.model(input_ids=torch.tensor([list(work.ids)], device=device),
                    position_ids=torch.tensor([list(work.pos)], device=device),
                    past_key_values=cache, use_cache=True, logits_to_keep=1, attn_spec=work.prefill).logits[0, -1]


# -- internal helpers --

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
    waiting: Waiting | None = None


def _prefill_and_decode(lm: LoadedModel, buf: KVBuffer, work: Fill, sampling: Sampling, arm: str,
                        emit: Callable[[int], None] | None, batch: DecodeBatch | None) -> _Decoded:
    """Prefill, sample the first token, decode the rest (each token to ``emit``)."""
    device = lm.device
    gen = torch.Generator(device="cpu").manual_seed(sampling.seed) if sampling.temperature > 0 else None
    cache = buf.cache()
    attach(cache, work.key_positions)
    with torch.inference_mode():
        t1 = time.perf_counter()
        logits = prefill(lm, cache, work) if work.logits is None else work.logits.to(device)
        sync(device)
        t_fwd = time.perf_counter()
        tokens = [sample(logits, sampling, gen, arm, 0)]
        sync(device)
        t2 = time.perf_counter()
        if emit:
            emit(tokens[0])
        cache, used, after, retention_ms = _retain(buf, cache, work.retain, device)
        first = (tokens, logits.detach().float().cpu(), t_fwd - t1, t2 - t_fwd)
        if batch is not None and work.decode.plain and batch.takes(lm, buf, tokens, sampling):
            waiting = Waiting(arm, buf.data[:, :, 0, :, : buf.length].clone(), tokens, work.pos[-1] + 1, sampling,
                              gen, emit)
            return _Decoded(*first, 0.0, used, after, retention_ms, waiting)
        decode_s = decode(lm, cache, tokens, work.pos[-1] + 1, sampling, gen, arm, emit, work.decode)
    return _Decoded(*first, decode_s, used, after, retention_ms)


def _retain(buf: KVBuffer, cache, retain: QuestionRetention | None, device: str) -> tuple:
    """(cache to decode over, bytes after the prefill, after retention, ms thinning)."""
    used = buf.used_bytes
    if retain is None:
        return cache, used, used, 0.0
    s = time.perf_counter()
    retain.apply(buf)
    sync(device)
    return buf.cache(), used, buf.used_bytes, (time.perf_counter() - s) * 1000
