"""The one timed run every arm goes through, a generator of its events: TTFT is buffer allocation + the arm's
``fill`` + prefill + first token, synchronized (docs/architecture.md); decoding follows in the decode loop, at
once or with the comparison's other arms (engine/run/decode.py)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable, Generator, Sequence

import torch

from engine.cache.compress import QuestionRetention
from engine.kv import KVBuffer
from engine.model import graphs
from engine.model.attend import PLAIN, AttentionSpec
from engine.model.load import LoadedModel
from engine.model.positions import attach
from engine.run import memory
from engine.run.decode import Decoder, Started, sync
from engine.run.events import FirstToken, Token
from engine.run.sampling import sample
from engine.run.stream import TextStream
from engine.run.types import RunResult, Sampling
from engine.run.workspace import workspace

Timed = Generator["FirstToken | Token", None, tuple[RunResult, KVBuffer]]


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


def timed_run(lm: LoadedModel, arm: str, capacity: int, fill: Callable[[KVBuffer], Fill], sampling: Sampling,
              decoder: Decoder | None = None) -> Timed:
    """Allocate ``capacity`` tokens, ``fill``, prefill, sample (a FirstToken), decode through ``decoder`` (default:
    at once); the run (whole once :meth:`Decoder.finish` gives it) and its buffer. An arm keeps what its ``fill``
    chose."""
    decoder = decoder or Decoder(lm)
    with memory.PEAK_MEMORY(lm.device) as mem:
        decoder.before_start()
        sync(lm.device)
        t0 = time.perf_counter()
        buf = workspace(lm).buffer(capacity)
        work = fill(buf)
        sync(lm.device)
        copy_s = time.perf_counter() - t0
        first, started = _first_token(lm, buf, work, sampling, arm, copy_s)
        yield FirstToken(arm, started.tokens[0], started.said, first)
        yield from decoder.take(started)
    started.run = dataclasses.replace(first, peak_rss_bytes=mem.peak_rss, cuda_peak_bytes=mem.cuda_peak)
    return started.result(lm.tokenizer, started.run), buf


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

def _first_token(lm: LoadedModel, buf: KVBuffer, work: Fill, sampling: Sampling, arm: str,
                 copy_s: float) -> tuple[RunResult, Started]:
    """Prefill, sample the first token, thin the buffer: the first-token figures and the run ready to decode."""
    device = lm.device
    gen = torch.Generator(device="cpu").manual_seed(sampling.seed) if sampling.temperature > 0 else None
    cache = buf.cache()
    attach(cache, work.key_positions)
    with torch.inference_mode():
        t1 = time.perf_counter()
        logits = prefill(lm, cache, work) if work.logits is None else work.logits.to(device)
        sync(device)
        t_fwd = time.perf_counter()
        token = sample(logits, sampling, gen, arm, 0)
        sync(device)
        t2 = time.perf_counter()
    started = Started(arm, buf, cache, [token], work.pos[-1] + 1, sampling, gen, work.decode, TextStream(lm.tokenizer))
    started.token()  # its text so far
    started.cache, used, after, retention_ms = _retain(buf, cache, work.retain, device)
    prefill_s, sample_s = t_fwd - t1, t2 - t_fwd
    read = sum(e.nbytes for e in {id(e): e for e in work.entries}.values())
    run = RunResult(
        arm=arm, text=started.said, token_ids=(token,), ttft_ms=(copy_s + prefill_s + sample_s) * 1000,
        copy_ms=copy_s * 1000 if work.copies else 0.0, prefill_ms=prefill_s * 1000, sample_ms=sample_s * 1000,
        prefill_tokens=0 if work.logits is not None else len(work.ids), decode_ms_per_token=None, decode_tokens=1,
        peak_rss_bytes=0, cuda_peak_bytes=None, kv_buffer_bytes=buf.nbytes, first_logits=logits.detach().float().cpu(),
        reused_tokens=work.reused_tokens,
        precomputed_tokens=work.reused_tokens if work.precomputed_tokens is None else work.precomputed_tokens,
        recomputed_tokens=len(work.recomputed_positions),
        recomputed_positions=work.recomputed_positions, kv_buffer_used_bytes=used,
        kv_buffer_bytes_after_retention=after, kv_store_bytes=read, retention_ms=retention_ms)
    return run, started


def _retain(buf: KVBuffer, cache, retain: QuestionRetention | None, device: str) -> tuple:
    """(cache to decode over, bytes after the prefill, after retention, ms thinning)."""
    used = buf.used_bytes
    if retain is None:
        return cache, used, used, 0.0
    s = time.perf_counter()
    retain.apply(buf)
    sync(device)
    return buf.cache(), used, buf.used_bytes, (time.perf_counter() - s) * 1000
