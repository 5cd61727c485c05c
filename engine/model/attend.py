"""The engine's attention function, the masks it applies, the scoring it feeds, and :func:`forward_kv`.

* :func:`use_pml_attention` routes a model's attention through :func:`_pml_attention` (per-layer
  cache lengths, position-aware windows, soft-capping).
* :class:`RankMask` — for a repaired run, attention by each token's rank in the
  prompt instead of its index in the buffer, for the one prefill forward (:func:`rank_masked`).
* :class:`AttentionScorer` / :class:`QueryCapture` — attention scoring for compression, fed
  within :func:`scoring`.
* :class:`ApeScale` — APE's attention over parallel-encoded contexts (arXiv 2502.05431), for the
  forwards inside :func:`ape_scaled`.
* :class:`Focus` — while decoding, the one module of several whose subject the answer last named, read alone
  (the routed arm's focus), for the forwards inside :func:`focused`.
* :func:`forward_kv` — run the model over tokens at explicit positions with an optional
  past and return the new tokens' KV as a ModuleKV.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import torch
from transformers.cache_utils import DynamicCache

from engine.kv.entries import ModuleKV
from engine.model import positions as positional

ATTENTION = "pml_attention"  # no "sdpa" in the name: transformers would then refuse it to models without SDPA
_SCORER: contextvars.ContextVar["AttentionScorer | QueryCapture | None"] = contextvars.ContextVar("pml_scorer",
                                                                                                 default=None)
_RANKS: contextvars.ContextVar["RankMask | None"] = contextvars.ContextVar("pml_ranks", default=None)
_KEYS: contextvars.ContextVar["torch.Tensor | None"] = contextvars.ContextVar("pml_keys", default=None)
_APE: contextvars.ContextVar["ApeScale | None"] = contextvars.ContextVar("pml_ape", default=None)
_FOCUS: contextvars.ContextVar["Focus | None"] = contextvars.ContextVar("pml_focus", default=None)


class RankMask:
    """Causal attention by rank for one forward whose cache is not in prompt order.

    A repaired run leaves the recomputed tokens out of the buffer and prefills them with the
    uncached tokens, appended after the buffer's entries; so a key's index in the buffer no
    longer says where it sits in the prompt. Each key and query carries its **rank** (its index
    in the materialised prompt, the baseline's order) and a query attends to every key of rank
    ≤ its own — exactly the baseline's causal mask whenever the KV is the baseline's.
    Compressed entries keep different tokens per layer, so buffer ranks may differ per layer.
    """

    def __init__(self, cached: list[torch.Tensor], new: torch.Tensor):
        self.cached = cached  # [layers] x [buffer entries of that layer] int64 ranks (shared when equal)
        self.new = new  # [new tokens] int64 ranks, in the order they are prefilled
        self._made: dict[int, torch.Tensor] = {}  # id(cached[layer]) -> mask

    def mask(self, layer: int, q: int, kv: int, device) -> torch.Tensor:
        """[1, 1, q, kv] bool mask (True = attend) for ``layer``."""
        cached = self.cached[layer]
        if q != self.new.shape[0] or kv != cached.shape[0] + q:
            raise ValueError(f"rank mask for {self.new.shape[0]} queries over {cached.shape[0]} cached keys "
                             f"used on {q} queries over {kv} keys in layer {layer}")
        made = self._made.get(id(cached))
        if made is None or made.device != torch.device(device):
            keys = torch.cat([cached, self.new])
            made = (keys[None, :] <= self.new[:, None])[None, None].to(device)
            self._made[id(cached)] = made
        return made


@contextlib.contextmanager
def rank_masked(mask: RankMask | None):
    """Within this block, forwards through the PML attention use ``mask`` (None: unchanged)."""
    if mask is None:
        yield None
        return
    token = _RANKS.set(mask)
    try:
        yield mask
    finally:
        _RANKS.reset(token)


def plain() -> bool:
    """True when no engine context changes attention now (no scorer, rank or key mask, APE, focus, tracked
    positions): what the C++ decode step (engine/model/step.py) computes is then exactly this module's attention."""
    return all(v.get() is None for v in (_SCORER, _RANKS, _KEYS, _APE, _FOCUS)) and positional.current() is None


@contextlib.contextmanager
def key_masked(mask: torch.Tensor):
    """Within this block, forwards through the PML attention let batch row ``b`` attend to the keys where
    ``mask[b, 0, 0]`` is True ([rows, 1, 1, keys] bool; a batched decode step over right-padded rows,
    engine/kv/batched.py)."""
    token = _KEYS.set(mask)
    try:
        yield mask
    finally:
        _KEYS.reset(token)


class ApeScale:
    """APE at query time (Adaptive Parallel Encoding, arXiv 2502.05431; github.com/Infini-AI-Lab/APE).

    Modules encoded apart sit side by side in the buffer; APE rescales the attention queries pay them. Per
    layer, head and query, with x = q·k·scaling, C the visible keys of the parallel modules and O every other
    visible key (system text, scaffolds, arguments, the new tokens)::

        out = w_C · Σ_C softmax(x / T) v  +  w_O · Σ_O softmax(x) v,   [w_C, w_O] = softmax([S·T·LSE_C(x / T), LSE_O(x)])

    a temperature T sharpening the attention inside the modules and a scale S on their total mass (APE's
    ``ape_llama.py``, whose README sets T = S = 0.9). It is one softmax over the logits x / T + (S·T − 1)·LSE_C(x / T)
    on C and x on O, which is how :meth:`attend` computes it. T = S = 1 is plain attention.

    ``context[layer]`` marks the buffer slots of the parallel modules in that layer (compressed entries keep
    different tokens per layer); keys past it (the prefilled and decoded tokens) are never context.
    """

    def __init__(self, context: list[torch.Tensor], temperature: float, scale: float):
        self.context = context  # [layers] x bool [cached slots of that layer]
        self.t, self.s = float(temperature), float(scale)

    def attend(self, layer: int, query, key, value, attention_mask, scaling: float | None) -> torch.Tensor:
        """Attention output [batch, queries, heads, dim] (as transformers' attention functions return it)."""
        b, h, q, d = query.shape
        kv, g = key.shape[-2], h // key.shape[1]
        k = key.repeat_interleave(g, dim=1) if g > 1 else key
        v = value.repeat_interleave(g, dim=1) if g > 1 else value
        x = torch.matmul(query.float(), k.float().transpose(-1, -2)) * (scaling or d ** -0.5)  # [b, h, q, kv]
        if attention_mask is None:
            visible = torch.ones(q, kv, dtype=torch.bool, device=query.device).tril_(kv - q)
        elif attention_mask.dtype == torch.bool:
            visible = attention_mask[..., -q:, :kv]
        else:
            visible = attention_mask[..., -q:, :kv] > float("-inf")
        ctx = torch.zeros(kv, dtype=torch.bool, device=query.device)
        mark = self.context[layer]
        ctx[: min(kv, mark.shape[0])] = mark[:kv].to(query.device)
        inside = x / self.t
        lse = inside.masked_fill(~(ctx & visible), float("-inf")).logsumexp(-1, keepdim=True)
        shift = torch.where(torch.isfinite(lse), (self.s * self.t - 1.0) * lse, torch.zeros_like(lse))
        logits = torch.where(ctx, inside + shift, x).masked_fill(~visible, float("-inf"))
        out = torch.matmul(logits.softmax(-1).to(v.dtype), v)
        return out.transpose(1, 2).contiguous()


@contextlib.contextmanager
def ape_scaled(ape: "ApeScale | None"):
    """Within this block, forwards through the PML attention use APE's scaled attention (None: unchanged)."""
    if ape is None:
        yield None
        return
    token = _APE.set(ape)
    try:
        yield ape
    finally:
        _APE.reset(token)


class Focus:
    """Decode-time focus among the modules a routed run kept (engine/arms/routed.py).

    With two or more modules kept (a question about two subjects), the answer still mixes them up: each is
    visible while the model writes about the other. The routed arm's scout knows which of the question's tokens
    point at which kept module (``triggers``: token id -> module index; a subject's name). While decoding, each
    time the model writes one of those tokens (:meth:`saw`, fed the step's input ids) that module becomes the
    focus, and the other kept modules are masked out in every layer, in this step and the next ones, until a
    token of another module's subject takes the focus. The prefill (the question) and the first token are not
    focused; text of no module is never masked.

    ``owners`` [cached slots]: each buffer slot's kept-module index (-1: text of no module).
    """

    def __init__(self, owners: torch.Tensor, triggers: dict[int, int]):
        self.owners, self.triggers = owners, dict(triggers)
        self.focus: int | None = None
        self.step = 0  # decode steps seen
        self.changes: list[tuple[int, int]] = []  # (decode step, module index) each time the focus moved
        self._mask: torch.Tensor | None = None

    def saw(self, input_ids: torch.Tensor) -> None:
        """A forward's input ids: a decode step (one token) whose token is a trigger moves the focus."""
        if input_ids.shape[-1] != 1:
            return
        self.step += 1
        module = self.triggers.get(int(input_ids.reshape(-1)[-1]))
        if module is not None and module != self.focus:
            self.focus, self._mask = module, None
            self.changes.append((self.step, module))

    def restrict(self, layer: int, q: int, kv: int, attention_mask, device):
        """``attention_mask`` with the unfocused kept modules masked out, in a focused decode step."""
        if self.focus is None or q != 1:
            return attention_mask
        if self._mask is None or self._mask.device != torch.device(device):
            self._mask = ((self.owners < 0) | (self.owners == self.focus)).to(device)
        visible = torch.ones(kv, dtype=torch.bool, device=device)
        n = min(kv, self._mask.shape[0])
        visible[:n] = self._mask[:n]
        visible = visible[None, None, None, :]
        if attention_mask is None:
            return visible
        if attention_mask.dtype == torch.bool:
            return attention_mask & visible
        return attention_mask.masked_fill(~visible, float("-inf"))


@contextlib.contextmanager
def focused(focus: "Focus | None", model=None):
    """Within this block, decode steps through the PML attention are focused by ``focus`` (None: unchanged), which
    sees each forward's input ids through a hook on ``model``'s input embeddings."""
    if focus is None:
        yield None
        return
    token = _FOCUS.set(focus)
    handle = model.get_input_embeddings().register_forward_pre_hook(lambda mod, args: focus.saw(args[0]))
    try:
        yield focus
    finally:
        handle.remove()
        _FOCUS.reset(token)


class AttentionScorer:
    """Per layer, the recency-weighted attention the unit's most recent queries pay to its tokens.

    Used while encoding a unit for PyramidInfer-style compression: the last ``recent_frac`` of
    the unit's queries (weights growing linearly towards the newest) score each of the unit's
    keys; past (prefix) keys take part in the softmax but are not scored.
    """

    def __init__(self, n_new: int, recent_frac: float = 0.4):
        self.n_new = n_new
        self.recent = max(1, math.ceil(recent_frac * n_new))
        self.scores: dict[int, torch.Tensor] = {}  # layer -> [n_new]

    def observe(self, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> None:
        # query: [1, heads, n_new, dim]; key: [1, kv_heads, n_past + n_new, dim]
        r = min(self.recent, query.shape[2])
        att = attention_weights(query[:, :, -r:], key, scaling)  # [kv_heads, group, r, kv]
        w = torch.arange(1, r + 1, dtype=att.dtype, device=att.device)
        w = w / w.sum()
        per_key = torch.einsum("kgrn,r->n", att, w) / (att.shape[0] * att.shape[1])  # [kv]
        self.scores[layer] = per_key[key.shape[2] - self.n_new:].cpu()


class QueryCapture:
    """Per layer, the newest ``window`` queries of the first forward it sees (a run's prefill).

    Only kept, not used, during the forward: scoring them against the cache happens after the
    first token is out, so time to first token is not touched (engine/cache/compress.py).
    """

    def __init__(self, window: int):
        self.window = window
        self.queries: dict[int, torch.Tensor] = {}  # layer -> [1, heads, <= window, dim], RoPE applied
        self.scaling: dict[int, float | None] = {}

    def observe(self, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> None:
        if layer not in self.queries:
            self.queries[layer] = query[:, :, -self.window:].clone()
            self.scaling[layer] = scaling


def attention_weights(query: torch.Tensor, key: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """Softmax attention of the newest queries over ``key``, per KV head and query group: [kv_heads, group, r, kv].

    ``query`` [1, heads, r, dim] are the last r tokens of the cache ``key`` [1, kv_heads, kv, dim]
    (query i sits at cache index kv - r + i and sees the keys up to it).
    """
    _, h, r, d = query.shape
    kvh, kv = key.shape[1], key.shape[2]
    g = h // kvh
    qr = query[0].reshape(kvh, g * r, d)
    att = torch.matmul(qr.float(), key[0].float().transpose(-1, -2)) * (scaling or d ** -0.5)
    att = att.view(kvh, g, r, kv)
    causal = torch.ones(r, kv, dtype=torch.bool, device=query.device).tril_(kv - r)
    return att.masked_fill(~causal, float("-inf")).softmax(-1)


@contextlib.contextmanager
def scoring(scorer: "AttentionScorer | QueryCapture"):
    """Within this block, forwards through the PML attention feed ``scorer``."""
    token = _SCORER.set(scorer)
    try:
        yield scorer
    finally:
        _SCORER.reset(token)


def _pml_attention(module, query, key, value, attention_mask, **kwargs):
    """transformers' attention, made exact for the engine's caches.

    * Caches whose layers hold different lengths (compressed entries): a layer shorter than the
      mask gets the bottom-right causal mask at its own length (batch 1, no padding: exact).
    * Sliding-window layers: the window is applied to position ids, not cache indices, when the
      model's positions are tracked (:mod:`engine.model.positions`), so gapped caches keep it.
    * Logit soft-capping (Gemma 2), which SDPA cannot compute: eager attention.
    * Inside :func:`rank_masked` (repair) the :class:`RankMask`'s mask replaces the causal one; inside
      :func:`key_masked` (arms decoded together) each row's key mask does. Inside :func:`ape_scaled` the
      attention over the resolved mask is APE's (:class:`ApeScale`).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    scorer = _SCORER.get()
    if scorer is not None:
        scorer.observe(module.layer_idx, query, key, kwargs.get("scaling"))
    q, kv = query.shape[-2], key.shape[-2]
    ranks, keys = _RANKS.get(), _KEYS.get()
    window, positions = kwargs.get("sliding_window"), positional.current()
    if ranks is not None:
        attention_mask = ranks.mask(module.layer_idx, q, kv, query.device)
    elif keys is not None:
        attention_mask = keys[..., :kv]
    elif window and positions is not None:
        attention_mask = positions.window_mask(module.layer_idx, q, kv, window, query.device)
    elif attention_mask is not None and attention_mask.shape[-1] != kv:
        attention_mask = torch.ones(q, kv, dtype=torch.bool, device=query.device).tril_(kv - q)[None, None]
    focus = _FOCUS.get()
    if focus is not None:
        attention_mask = focus.restrict(module.layer_idx, q, kv, attention_mask, query.device)
    ape = _APE.get()
    if ape is not None:
        return ape.attend(module.layer_idx, query, key, value, attention_mask, kwargs.get("scaling")), None
    softcap = kwargs.get("softcap")
    if softcap:
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        return positional.eager(query, key, value, attention_mask, scaling, softcap)
    if _GQA_WITH_MASK and query.shape[-2] == 1 and query.device.type == "cpu" \
            and not any(kwargs.get(k) for k in _SPECIAL_KWARGS):
        return _decode_attention(query, key, value, attention_mask, kwargs.get("scaling")), None
    if _GQA_WITH_MASK and _grouped_masked_cpu(module, query, attention_mask, kwargs):
        # Several new tokens over a cache (the cached prefill): transformers repeats K/V for every query
        # head here (it keeps enable_gqa for unmasked calls, as CUDA's masked GQA falls back to slow
        # kernels); on CPU, SDPA handles grouped heads with a mask directly and skips that copy.
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=kwargs.get("scaling"), enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _decode_attention(query, key, value, attention_mask, scaling: float | None) -> torch.Tensor:
    """One query token per row over its keys, as three small ops: a decode step on CPU, where SDPA's flash kernel
    costs ~80 µs a layer in set-up for a few µs of work (query heads grouped over their KV head, no K/V copies).
    ``attention_mask`` None (every key), bool (True = attend) or additive, its last query row taken. Returns
    [batch, 1, heads, dim], as transformers' attention functions do."""
    b, h, _, d = query.shape
    kvh, n = key.shape[1], key.shape[2]
    q = query.reshape(b, kvh, h // kvh, d)
    scores = torch.matmul(q, key.transpose(-1, -2)).mul_(scaling or d ** -0.5)  # [b, kv heads, group, keys]
    if attention_mask is not None:
        mask = attention_mask[..., -1, :n].reshape(attention_mask.shape[0], 1, 1, n)
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = scores.softmax(-1, dtype=torch.float32).to(value.dtype)
    return torch.matmul(probs, value).reshape(b, 1, h, d)


_GQA_WITH_MASK = True  # False: always transformers' own SDPA path, no shortcut (for before/after measurements)
_SPECIAL_KWARGS = ("softcap", "position_bias", "cache", "output_attentions", "s_aux", "sinks", "dropout")


def _grouped_masked_cpu(module, query, attention_mask, kwargs) -> bool:
    """True for a grouped-query, masked, multi-token CPU call that uses none of SDPA's special options (one token,
    a decode step, takes :func:`_decode_attention` before this is asked)."""
    return (query.device.type == "cpu" and query.shape[-2] > 1
            and attention_mask is not None
            and getattr(module, "num_key_value_groups", 1) > 1 and not any(kwargs.get(k) for k in _SPECIAL_KWARGS))


def use_pml_attention(model) -> str:
    """Route ``model``'s attention through the engine's; return the path in use.

    ``"pml"``: the attention function above runs in every layer (models that take transformers'
    attention interface, loaded with SDPA or eager attention). ``"own"``: the model's own attention
    code (MPT, Falcon), with ALiBi taken from position ids. Models that need positions for their
    attention (sliding windows, ALiBi) get their forward hooked to track them.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if positional.needs_positions(model):
        positional.track_positions(model)
    if model.config.model_type in positional.OWN_ATTENTION:
        positional.adopt_alibi(model)
        return "own"
    if getattr(model.config, "_attn_implementation", None) not in ("sdpa", "eager", ATTENTION):
        return "own"
    AttentionInterface.register(ATTENTION, _pml_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    model.set_attn_implementation(ATTENTION)
    return "pml"


def forward_kv(model, token_ids: list[int], positions: list[int], past: ModuleKV | None = None) -> ModuleKV:
    """KV of ``token_ids`` at ``positions``, attending causally to ``past`` (if any) and to each other."""
    device = model.device
    cache = DynamicCache()
    if past is not None and len(past):
        # [layers] x (k, v): [1, kv_heads, seq, head_dim]
        cache = DynamicCache(ddp_cache_data=[(past.kv[i, 0].unsqueeze(0).to(device),
                                              past.kv[i, 1].unsqueeze(0).to(device))
                                             for i in range(past.kv.shape[0])])
        positional.attach(cache, past.positions)  # sliding windows and ALiBi read key positions, not indices
    n_past = cache.get_seq_length()
    ids = torch.tensor([token_ids], dtype=torch.long, device=device)
    pos = torch.tensor([positions], dtype=torch.long, device=device)
    with torch.inference_mode():
        # use_cache=True: with gapped positions and no cache, transformers would assume packed sequences.
        model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1)
    kv = torch.stack([torch.stack([layer.keys[0, :, n_past:], layer.values[0, :, n_past:]])
                      for layer in cache.layers])
    return ModuleKV(kv.contiguous(), torch.tensor(positions, dtype=torch.long),
                    torch.tensor(token_ids, dtype=torch.long))

