"""Runs decoded together: each run of a comparison waits after its first token, then one batch steps them all
(engine/kv/batched.py)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Callable

import torch

from engine.kv import BatchedKV, KVBuffer
from engine.model.load import LoadedModel
from engine.model.positions import needs_positions
from engine.run.decode import decode, decode_step, ended, sync
from engine.run.sampling import sample
from engine.run.types import RunResult, Sampling
from engine.run.workspace import workspace


@dataclass
class Waiting:
    """A run stopped after its first token, waiting to be decoded with a batch."""

    arm: str
    kv: torch.Tensor  # [layers, 2, kv_heads, length, head_dim], copied
    tokens: list[int]
    next_pos: int
    sampling: Sampling
    gen: torch.Generator | None
    emit: Callable[[int], None] | None  # each new token, to the run's text stream
    run: RunResult | None = None  # first token only
    spent: float = 0.0  # seconds of the steps this run generated in
    steps: int = 0


class DecodeBatch:
    """Runs of one model waiting to be decoded together."""

    def __init__(self, lm: LoadedModel):
        self.lm = lm
        self.waiting: list[Waiting] = []
        self.done: list[Waiting] = []
        self.size = 0  # runs in the last batch

    def takes(self, lm: LoadedModel, buf: KVBuffer, tokens: list[int], sampling: Sampling) -> bool:
        """Whether a run with this buffer can wait here."""
        level = all(n == buf.lengths[0] for n in buf.lengths)
        return (lm is self.lm and lm.attention == "pml" and not needs_positions(lm.model) and level
                and not ended(lm, tokens, sampling))

    def decode(self) -> None:
        """Decode every waiting run; :meth:`finish` then gives each run."""
        waiting, self.waiting = self.waiting, []
        if len(waiting) == 1:
            _decode_alone(self.lm, waiting[0])
        elif waiting:
            _decode_batch(self.lm, waiting)
        self.done += waiting
        self.size = len(waiting)

    def finish(self, run: RunResult) -> RunResult:
        """``run`` with its decoded tokens, known by its first logits."""
        for w in self.done:
            if w.run.first_logits is run.first_logits:
                return dataclasses.replace(run, text=self.lm.tokenizer.decode(w.tokens, skip_special_tokens=True),
                                           token_ids=tuple(w.tokens), decode_tokens=len(w.tokens),
                                           decode_ms_per_token=w.spent * 1000 / w.steps if w.steps else None,
                                           decode_batch=self.size)
        return run


def _decode_alone(lm: LoadedModel, w: Waiting) -> None:
    buf = workspace(lm).buffer(w.kv.shape[3] + w.sampling.max_new_tokens + 1)
    buf.write(w.kv)
    with torch.inference_mode():
        w.spent = decode(lm, buf.cache(), w.tokens, w.next_pos, w.sampling, w.gen, w.arm, w.emit)
    w.steps = len(w.tokens) - 1


def _decode_batch(lm: LoadedModel, waiting: list[Waiting]) -> None:
    """Step every run in one forward until each is done (finished rows ride along)."""
    kv = BatchedKV([w.kv for w in waiting], room=max(w.sampling.max_new_tokens for w in waiting) + 1)
    cache = kv.cache()
    live = [True] * len(waiting)
    with torch.inference_mode():
        while any(live):
            s = time.perf_counter()
            logits = decode_step(lm, cache, [w.tokens[-1] for w in waiting], [w.next_pos for w in waiting],
                                 rows_mask=kv.key_mask)
            kv.advance()
            grew = [w for row, w in enumerate(waiting) if live[row]]
            for row, w in enumerate(waiting):
                if live[row]:
                    w.tokens.append(sample(logits[row], w.sampling, w.gen, w.arm, len(w.tokens)))
                    w.next_pos += 1
            sync(lm.device)
            spent = time.perf_counter() - s
            for row, w in enumerate(waiting):
                if live[row]:
                    w.spent += spent
                    w.steps += 1
                    live[row] = not ended(lm, w.tokens, w.sampling)
            for w in grew:
                if w.emit:
                    w.emit(w.tokens[-1])
