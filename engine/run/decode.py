"""Decoding after the first token, at explicit position ids: one loop, a generator of Token events, for a run
alone (in place, in its own buffer) and for a comparison's batchable runs together (one :class:`BatchedKV`, their
KV copied in: the arms took turns in one workspace buffer)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from engine.kv import BatchedKV, KVBuffer
from engine.model import graphs
from engine.model import step as cpp
from engine.model.attend import PLAIN, AttentionSpec
from engine.model.load import LoadedModel
from engine.model.positions import needs_positions
from engine.run.events import Token
from engine.run.sampling import sample
from engine.run.stream import TextStream
from engine.run.types import RunResult, Sampling
from engine.run.workspace import workspace


@dataclass
class Started:
    """A run after its first token: where its KV is, what it has generated, what its decode steps attend to."""

    arm: str
    buf: KVBuffer | None  # its buffer (None once its KV moved out to ``kv``)
    cache: object  # the Cache over ``buf`` its decode steps read and append to
    tokens: list[int]
    next_pos: int
    sampling: Sampling
    gen: torch.Generator | None
    spec: AttentionSpec
    text: TextStream
    kv: torch.Tensor | None = None  # [layers, 2, kv_heads, length, head_dim]: its KV, moved out of the workspace
    spent: float = 0.0  # seconds of the steps it generated in
    steps: int = 0
    batch: int = 1  # runs in the batch it decoded in
    said: str = field(default="", repr=False)  # its text as the last Token gave it
    run: RunResult | None = field(default=None, repr=False)  # its first-token figures, once timed

    @property
    def decode_ms_per_token(self) -> float | None:
        return self.spent * 1000 / self.steps if self.steps else None

    def result(self, tokenizer, run: RunResult) -> RunResult:
        """``run`` with the tokens generated so far."""
        return dataclasses.replace(run, text=tokenizer.decode(self.tokens, skip_special_tokens=True),
                                   token_ids=tuple(self.tokens), decode_tokens=len(self.tokens),
                                   decode_ms_per_token=self.decode_ms_per_token, decode_batch=self.batch)

    def token(self) -> Token:
        """The Token event of its newest token."""
        text = self.text.push(self.tokens[-1])
        same = len(self.said) if text.startswith(self.said) else len(_common_prefix(self.said, text))
        self.said = text
        return Token(self.arm, self.tokens[-1], text[same:], text)


class Decoder:
    """Where a comparison's runs decode: at once, or (``together``, when it can batch) all in one batch once every
    arm has its first token (:meth:`rest`)."""

    def __init__(self, lm: LoadedModel, together: bool = False):
        self.lm, self.together = lm, together
        self.waiting: list[Started] = []
        self.kept: list[Started] = []  # every run kept for rest()

    def take(self, run: Started) -> Iterator[Token]:
        """Decode ``run`` now, or keep it for :meth:`rest`."""
        if self.together and batchable(self.lm, run):
            self.waiting.append(run)
            self.kept.append(run)
            return
        yield from decode(self.lm, [run])

    def before_start(self) -> None:
        """A run is about to take the workspace: the waiting runs still in it move their KV out."""
        for run in self.waiting:
            if run.buf is not None:
                run.kv, run.buf, run.cache = run.buf.data[:, :, 0, :, : run.buf.length].clone(), None, None

    def rest(self) -> Iterator[Token]:
        """Decode every waiting run, together."""
        waiting, self.waiting = self.waiting, []
        yield from decode(self.lm, waiting)

    def finish(self, run: RunResult) -> RunResult:
        """``run`` (a timed run's result) with every token its decode gave, known by its first logits."""
        for s in self.kept:
            if s.run is not None and s.run.first_logits is run.first_logits:
                return s.result(self.lm.tokenizer, s.run)
        return run


def batchable(lm: LoadedModel, run: Started) -> bool:
    """Plain attention, every layer at one length, no key positions (sliding windows, ALiBi), tokens to go."""
    level = run.buf is None or all(n == run.buf.lengths[0] for n in run.buf.lengths)
    return (run.spec.plain and lm.attention == "pml" and not needs_positions(lm.model) and level
            and not ended(lm, run.tokens, run.sampling))


def decode(lm: LoadedModel, runs: list[Started]) -> Iterator[Token]:
    """Decode ``runs`` to their ends: several in one batch, one in its own buffer; each new token as a Token."""
    if len(runs) > 1:
        kv = BatchedKV([r.buf.data[:, :, 0, :, : r.buf.length] if r.kv is None else r.kv for r in runs],
                       room=max(r.sampling.max_new_tokens for r in runs) + 1)
        for r in runs:
            r.batch = len(runs)
        yield from _loop(lm, runs, kv.cache(), PLAIN, kv)
    elif runs:
        run = runs[0]
        if run.kv is not None:  # moved out while others ran: back into the workspace
            run.buf = workspace(lm).buffer(run.kv.shape[3] + run.sampling.max_new_tokens + 1)
            run.buf.write(run.kv)
            run.cache, run.kv = run.buf.cache(), None
        yield from _loop(lm, runs, run.cache, run.spec, None)


def decode_step(lm: LoadedModel, cache, ids: list[int], positions: list[int], spec: AttentionSpec = PLAIN,
                rows_mask: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
    """Logits [rows, vocab] of one step: the C++ decoder when ``spec`` is plain, else the model (``rows_mask()``:
    batched rows' keys; their BatchedKV is advanced by the loop)."""
    fast = cpp.decoder(lm.model, lm.weights) if spec.plain else None
    view = cache.step_view() if fast is not None and hasattr(cache, "step_view") else None
    if view is not None:
        logits = fast(ids, positions, *view)
        if rows_mask is None:
            cache.advance()
        return logits
    graphed = graphs.forward(lm, cache, ids, positions, spec) if rows_mask is None and len(ids) == 1 else None
    if graphed is not None:  # a CUDA graph's replay (engine/model/graphs.py)
        return graphed
    if rows_mask is not None:
        spec = dataclasses.replace(spec, keys=rows_mask())
    input_ids = torch.tensor([[i] for i in ids], device=lm.device)
    if spec.focus is not None:
        spec.focus.saw(input_ids)  # the focus follows the fed token
    out = lm.model(input_ids=input_ids, position_ids=torch.tensor([[p] for p in positions], device=lm.device),
                   past_key_values=cache, use_cache=True, logits_to_keep=1, attn_spec=spec)
    return out.logits[:, -1]


def ended(lm: LoadedModel, tokens: list[int], sampling: Sampling) -> bool:
    """Whether generation is over: max tokens, end of sequence, or a stop string."""
    if len(tokens) >= sampling.max_new_tokens or tokens[-1] in lm.eos_ids:
        return True
    if not sampling.stop:
        return False
    longest = max(len(s.encode()) for s in sampling.stop)  # a token holds at least one byte
    tail = lm.tokenizer.decode(tokens[-(longest + 2):], skip_special_tokens=True)
    return any(s in tail for s in sampling.stop)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# -- internal helpers --

def _loop(lm: LoadedModel, runs: list[Started], cache, spec: AttentionSpec, kv: BatchedKV | None) -> Iterator[Token]:
    """Step every run in one forward until each is done (finished rows ride along)."""
    live = [not ended(lm, r.tokens, r.sampling) for r in runs]
    with torch.inference_mode():
        while any(live):
            s = time.perf_counter()
            logits = decode_step(lm, cache, [r.tokens[-1] for r in runs], [r.next_pos for r in runs], spec,
                                 rows_mask=None if kv is None else kv.key_mask)
            if kv is not None:
                kv.advance()
            grew = [r for r, on in zip(runs, live) if on]
            for row, r in enumerate(runs):
                if live[row]:
                    r.tokens.append(sample(logits[row], r.sampling, r.gen, r.arm, len(r.tokens)))
                    r.next_pos += 1
            sync(lm.device)
            spent = time.perf_counter() - s
            for row, r in enumerate(runs):
                if live[row]:
                    r.spent += spent
                    r.steps += 1
                    live[row] = not ended(lm, r.tokens, r.sampling)
            for r in grew:
                yield r.token()


def _common_prefix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]
