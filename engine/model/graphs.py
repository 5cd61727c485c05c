"""CUDA graphs for the question's prefill and each decode step: one replay instead of hundreds of launches.

Why: on a GPU a forward of a few tokens over a cache is bound by launching kernels from Python, not by the work
(measured: docs/module-memory.md). A CUDA graph records one forward's kernels once and replays them.

How: a graph reads and writes the same memory on every replay: the KV pool's tensor (``Lease.base``), with static
inputs — token ids, position ids, the lease's first pool slot ``lo``, the first slot written, the last real token.
Each layer writes at ``start + i`` (``index_copy_``) and reads the lease's window of slots from ``lo`` (one graph per
window size, not per lease); the mask lets token i see slots ``lo .. start + i`` only. Token counts
are padded to a bucket (1 for a decode step; 2, 4, … 256 for a question): padding tokens come after the real
ones, so no real token attends to them, and their keys land in slots the next step overwrites. Prompts longer
than the largest bucket (a baseline's full prefill) run eagerly: compute-bound, nothing to save there.

When it applies (:func:`forward` returns None otherwise: the eager forward runs): on CUDA with graphs on
(:func:`set_mode`), the engine's attention with nothing changing it, a level lease, the padded tokens fitting it.
Host copies still waiting launch whole before the replay (engine/kv/layerwise.py). A capture that fails turns graphs
off for that model, with the reason (:func:`status`).
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from engine.kv.pool import LeaseCache
from engine.model.attend import AttentionSpec

MODES = ("auto", "on", "off")  # auto: on where the model computes on CUDA
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # tokens per graph; longer forwards run eagerly
WARMUP = 2  # eager runs on a side stream before a capture (cuBLAS / allocator warm-up, as torch's docs do)
CUDA_ONLY = "off: CUDA only (CUDA graphs replay GPU kernels; on the CPU the eager forward runs)"

_graphs: "weakref.WeakKeyDictionary[torch.nn.Module, _Graphs]" = weakref.WeakKeyDictionary()


def set_mode(model: torch.nn.Module, mode: str) -> None:
    """Graphs for ``model``: "on", "off", or "auto" (on where it computes on CUDA)."""
    if mode not in MODES:
        raise ValueError(f"CUDA graphs mode must be one of {', '.join(MODES)}, not {mode!r}")
    _state(model).mode = mode


def status(model: torch.nn.Module) -> str:
    """"on", or "off: why" (CUDA only, turned off, a failed capture)."""
    s = _graphs.get(model)
    if _device(model).type != "cuda":
        return CUDA_ONLY
    if s is None:
        return "on"
    if s.mode == "off":
        return "off: turned off (--cuda-graphs off)"
    return s.failed or "on"


def forward(lm, cache, ids, positions, spec: AttentionSpec) -> torch.Tensor | None:
    """Logits [1, vocab] of the last of ``ids`` (one row, at ``positions``) over ``cache``, replayed from a CUDA
    graph, the cache advanced past them; None where graphs do not apply (the module docstring says when)."""
    model = lm.model
    if _device(model).type != "cuda":
        return None
    s = _state(model)
    if s.mode == "off" or s.failed or not _plain(lm, spec) or not isinstance(cache, LeaseCache):
        return None
    return s.run(cache, list(ids), list(positions))


def captured(model: torch.nn.Module) -> int:
    """Graphs held for ``model`` (tests, bench)."""
    s = _graphs.get(model)
    return 0 if s is None else len(s.graphs)


# ----------------------------------------------------------------------------------------------
# Internal helpers
# ----------------------------------------------------------------------------------------------

def _device(model) -> torch.device:
    """Where ``model`` computes (its first parameter's or buffer's device; the CPU when it has neither)."""
    first = next(iter(model.parameters()), None)
    first = first if first is not None else next(iter(model.buffers()), None)
    return first.device if first is not None else torch.device("cpu")


def _state(model) -> "_Graphs":
    s = _graphs.get(model)
    if s is None:
        s = _graphs[model] = _Graphs(model)
    return s


def _plain(lm, spec: AttentionSpec) -> bool:
    """The engine's attention runs with nothing changing it (``spec``), and positions are not tracked."""
    from engine.model.positions import needs_positions

    return lm.attention == "pml" and not needs_positions(lm.model) and spec.plain


def _bucket(n: int) -> int | None:
    return next((b for b in BUCKETS if b >= n), None)


class _StaticLayer(CacheLayerMixin):
    """Layer ``index`` of the pool: new keys go to pool slots ``where``; attention reads slots ``window`` (static
    tensors both, set before each replay)."""

    is_sliding = False
    is_compileable = False

    def __init__(self, base: torch.Tensor, index: int, where: torch.Tensor, window: torch.Tensor):
        super().__init__()
        self.pool_keys, self.pool_values = base[index, 0], base[index, 1]  # [1, kv_heads, slots, head_dim]
        self.where, self.window = where, window
        self.dtype, self.device = base.dtype, base.device
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        return None

    def update(self, key_states, value_states, *args, **kwargs):
        self.pool_keys.index_copy_(2, self.where, key_states)
        self.pool_values.index_copy_(2, self.where, value_states)
        return self.pool_keys.index_select(2, self.window), self.pool_values.index_select(2, self.window)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.window.shape[0], 0

    def get_seq_length(self) -> int:
        return 0  # never read: positions and the 4-D mask are given

    def get_max_length(self) -> int:
        return self.window.shape[0]


class _StaticCache(Cache):
    def __init__(self, base: torch.Tensor, where: torch.Tensor, window: torch.Tensor):
        super().__init__(layers=[_StaticLayer(base, i, where, window) for i in range(base.shape[0])])


class _Graph:
    """One captured forward of ``bucket`` tokens over pool tensor ``base``, reading a window of ``size`` slots."""

    def __init__(self, model, base: torch.Tensor, bucket: int, size: int):
        dev = base.device
        self.model, self.bucket = weakref.ref(model), bucket  # weak: the registry's key is the model
        self.ids = torch.zeros(1, bucket, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, bucket, dtype=torch.long, device=dev)
        self.start = torch.zeros(1, dtype=torch.long, device=dev)  # the first pool slot written
        self.lo = torch.zeros(1, dtype=torch.long, device=dev)  # the lease's first pool slot
        self.last = torch.zeros(1, dtype=torch.long, device=dev)  # index of the last real token
        self.steps = torch.arange(bucket, device=dev)
        self.span = torch.arange(size, device=dev)
        self.window = torch.zeros(size, dtype=torch.long, device=dev)
        self.base = base
        self.graph = None
        self.out: torch.Tensor | None = None

    def feed(self, ids: list[int], positions: list[int], start: int, lo: int) -> None:
        """Set the static inputs: ``ids`` at ``positions`` (padded with the last), written from pool slot ``start``
        of a lease whose first slot is ``lo``."""
        pad = self.bucket - len(ids)
        host = torch.tensor([ids + [ids[-1]] * pad, positions + [positions[-1]] * pad], dtype=torch.long)
        self.ids.copy_(host[0:1])
        self.pos.copy_(host[1:2])
        self.start.fill_(start)
        self.lo.fill_(lo)
        self.last.fill_(len(ids) - 1)
        # the window past the pool's end repeats its last slot (masked out)
        self.window.copy_(torch.clamp(self.span + lo, max=self.base.shape[4] - 1))

    def _forward(self) -> torch.Tensor:
        where = self.start + self.steps  # [bucket] pool slots written
        mask = ((self.span[None, :] + self.lo) <= where[:, None])[None, None]  # [1, 1, bucket, size]: causal by slot
        out = self.model()(input_ids=self.ids, position_ids=self.pos, attention_mask=mask,
                           past_key_values=_StaticCache(self.base, where, self.window), use_cache=True,
                           logits_to_keep=self.last)
        return out.logits[:, -1]  # [1, vocab]

    def capture(self) -> None:
        """Warm up on a side stream, then record (the inputs fed are the live run's: the warm-ups write the
        same keys and values the replay writes)."""
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                self._forward()
        current.wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # its own memory pool (graphs replay in any order); thread-local: the studio's other threads may use CUDA
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.out = self._forward()

    def replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out.clone()


class _Graphs:
    """A model's graphs, by (bucket, window size), over one pool tensor; all dropped when the pool is made anew."""

    def __init__(self, model):
        self.model = weakref.ref(model)
        self.mode = "auto"
        self.failed = ""
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.base_key: tuple | None = None

    def run(self, cache: LeaseCache, ids: list[int], positions: list[int]) -> torch.Tensor | None:
        lease = cache.lease
        base, bucket = lease.base, _bucket(len(ids))
        if bucket is None or not ids or not lease.level or lease.length + bucket > lease.capacity:
            return None
        lease.settle()
        key = (base.data_ptr(), tuple(base.shape), base.dtype)
        if key != self.base_key:
            self.graphs.clear()  # they wrote the old pool's memory
            self.base_key = key
        size = 1 << max(8, (lease.capacity - 1).bit_length())  # windows in powers of two: few graphs
        start = lease.start + lease.length
        g = self.graphs.get((bucket, size))
        if g is None:
            g = _Graph(self.model(), base, bucket, size)
            g.feed(ids, positions, start, lease.start)
            try:
                g.capture()
            except Exception as err:  # any capture failure: eager from now on, and say why
                self.failed = f"off: capture failed ({type(err).__name__}: {str(err).splitlines()[0][:160]})"
                self.graphs.clear()
                torch.cuda.synchronize()
                return None
            self.graphs[(bucket, size)] = g
        else:
            g.feed(ids, positions, start, lease.start)
        return g.replay()  # its caller counts the slots written (engine/run/forward.py)


def gpu_paths(device: str, model: torch.nn.Module | None = None) -> dict[str, str]:
    """What the three GPU paths do for a model on ``device``, one line each: "on …" or "off: why"."""
    from engine.kv import layerwise, pinned

    if not str(device).startswith("cuda"):
        return {"pinned_storage": pinned.CUDA_ONLY, "layerwise_copies": layerwise.CUDA_ONLY,
                "cuda_graphs": CUDA_ONLY}
    return {"pinned_storage": "on when module KV is kept in CPU memory (--storage cpu): page-locked, copied "
                              "asynchronously",
            "layerwise_copies": "on: host KV copied on a side stream, layer by layer beside an eager forward, whole "
                                "(one DMA transfer per range) before a CUDA graph",
            "cuda_graphs": status(model) if model is not None else "on"}
