"""Decoding after the first token, at explicit position ids (``generate()`` would read the cache length)."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

import torch

from engine.model import graphs
from engine.model import step as cpp
from engine.model.attend import PLAIN, AttentionSpec
from engine.model.load import LoadedModel
from engine.run.sampling import sample
from engine.run.types import Sampling


def decode(lm: LoadedModel, cache, tokens: list[int], next_pos: int, sampling: Sampling, gen, arm: str,
           emit: Callable[[int], None] | None, spec: AttentionSpec = PLAIN) -> float:
    """Decode after ``tokens`` (appended to, each new one given to ``emit``), each step attending as ``spec``;
    seconds spent."""
    spent = 0.0
    while not ended(lm, tokens, sampling):
        s = time.perf_counter()
        tok = sample(decode_step(lm, cache, [tokens[-1]], [next_pos], spec)[0], sampling, gen, arm, len(tokens))
        sync(lm.device)
        spent += time.perf_counter() - s
        tokens.append(tok)
        next_pos += 1
        if emit:
            emit(tok)
    return spent


def decode_step(lm: LoadedModel, cache, ids: list[int], positions: list[int], spec: AttentionSpec = PLAIN,
                rows_mask: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
    """Logits [rows, vocab] of one step: the C++ decoder when ``spec`` is plain, else the model (``rows_mask()``:
    batched rows' keys)."""
    fast = cpp.decoder(lm.model, lm.weights) if spec.plain else None
    view = cache.step_view() if fast is not None and hasattr(cache, "step_view") else None
    if view is not None:
        logits = fast(ids, positions, *view)
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
