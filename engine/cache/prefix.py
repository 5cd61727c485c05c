"""Prefix cache: exact reuse of the longest cached token prefix, as vLLM, SGLang and llama.cpp do.

A token-exact radix tree (after SGLang's ``RadixCache``) whose nodes' KV live in the module store;
docs/arms.md, "The prefix cache arm".
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from engine.cache.store import PREFIX, ModuleStore
from engine.errors import StorageError
from engine.kv import ModuleKV
from engine.schema.layout import ANONYMOUS, Layout

MAX_NOTES = 16  # runs remembered by :meth:`PrefixCache.remember`; the least recently used is forgotten with its KV


@dataclass(frozen=True)
class PrefixMatch:
    """The ``reused`` leading tokens a prompt finds, as (entry, first, end) slices."""

    reused: int
    whole: bool  # a repeated prompt
    pieces: tuple[tuple[ModuleKV, int, int], ...] = field(repr=False)
    keys: tuple[str, ...] = field(repr=False)  # root side first


@dataclass(frozen=True)
class WarmPrompt:
    """The schema-order warm-up prompt of one schema."""

    schema: str
    fingerprint: str
    modules: tuple[str, ...]
    token_ids: tuple[int, ...]
    placeholders: tuple[str, ...]  # "module/param"
    ms: float = 0.0  # the warm-up's prefill
    at_run: int = 0  # runs the cache had taken when it was warmed


@dataclass(frozen=True)
class WarmUp:
    """A schema-order warm-up as a run reports it."""

    schema: str
    modules: tuple[str, ...]
    tokens: int
    placeholders: tuple[str, ...] = ()
    ms: float = 0.0  # its prefill, before the arms ran: in no arm's TTFT
    this_run: bool = False  # warmed for this run (no run came between)

    def to_json(self) -> dict:
        return {"schema": self.schema, "modules": list(self.modules), "tokens": self.tokens,
                "placeholders": list(self.placeholders), "ms": round(self.ms, 3), "this_run": self.this_run}

    @classmethod
    def from_json(cls, data: dict) -> "WarmUp":
        return cls(data.get("schema", ""), tuple(data.get("modules") or ()), data.get("tokens", 0),
                   tuple(data.get("placeholders") or ()), data.get("ms") or 0.0, bool(data.get("this_run")))


@dataclass(frozen=True)
class Held:
    """What a prefix cache held before a run."""

    warmup: WarmUp | None  # the run's schema's warm-up, if it was warmed
    earlier_runs: int = 0  # runs inserted before this one
    other_schemas_warmed: int = 0
    stored_tokens: int = 0

    def to_json(self) -> dict:
        return {"warmup": None if self.warmup is None else self.warmup.to_json(), "earlier_runs": self.earlier_runs,
                "other_schemas_warmed": self.other_schemas_warmed, "stored_tokens": self.stored_tokens}

    @classmethod
    def from_json(cls, data: dict) -> "Held":
        warm = data.get("warmup")
        return cls(None if warm is None else WarmUp.from_json(warm), data.get("earlier_runs", 0),
                   data.get("other_schemas_warmed", 0), data.get("stored_tokens", 0))


@dataclass(eq=False)
class _Node:
    tokens: tuple[int, ...]  # the edge's
    depth: int  # its first position
    key: str | None  # None for the root
    parent: "_Node | None"
    children: dict[int, "_Node"] = field(default_factory=dict)  # by first token


class PrefixCache:
    """A radix tree of token ids whose nodes' KV live in ``store``."""

    def __init__(self, store: ModuleStore):
        self.store = store
        self._root = _Node((), 0, None, None)
        self._by_key: dict[str, _Node] = {}
        self._ids = itertools.count()
        self._lock = store.lock  # the store's eviction listener walks the tree
        self.inserted_runs = 0  # warm-ups not counted
        self.warmed: dict[str, WarmPrompt] = {}  # by layout fingerprint
        self.skipped_inserts = 0  # over the budget
        self.evicted_nodes = 0  # with an evicted ancestor
        self._notes: OrderedDict = OrderedDict()
        store.on_evict(self._evicted)

    # -- public API ---------------------------------------------------------------------------

    def match(self, token_ids: list[int] | tuple[int, ...], limit: int | None = None) -> PrefixMatch:
        """The longest cached prefix of ``token_ids``, at most ``limit`` tokens."""
        ids = tuple(token_ids)
        cap = len(ids) if limit is None else max(0, min(limit, len(ids)))
        with self._lock:
            path, matched = self._walk(ids)
            pieces, keys, taken = [], [], 0
            for node, used in path:
                used = min(used, cap - taken)
                if used <= 0:
                    break
                pieces.append((self.store.get(node.key), 0, used))
                keys.append(node.key)
                taken += used
            if path:
                self._touch_up(path[-1][0])
            return PrefixMatch(taken, matched == len(ids) > 0, tuple(pieces), tuple(keys))

    def insert(self, token_ids: list[int] | tuple[int, ...], kv: torch.Tensor, keep: list[str] = (),
               run: bool = False) -> int:
        """Store the KV ([layers, 2, kv_heads, >= len, head_dim]) of ``token_ids`` if it fits beside ``keep``."""
        ids = tuple(token_ids)
        with self._lock:
            self.inserted_runs += int(run)
            path, matched = self._walk(ids)
            if matched == len(ids):
                return 0
            need = (len(ids) - matched) * _bytes_per_token(kv)
            kept = [k for k in dict.fromkeys(keep) if k in self.store and k not in self.store.pinned()]
            held = sum(self.store.entry_bytes(k) for k in [n.key for n, _ in path] + kept)
            budget = self.store.budget_bytes
            if budget is not None and held + need > budget - self._pinned_bytes():
                self.skipped_inserts += 1
                return 0
            self.store.touch(kept + [n.key for n, _ in path][::-1])
            parent = self._root
            if path:
                node, used = path[-1]
                parent = node if used == len(node.tokens) else self._split(node, used)
            try:
                leaf = self._add_leaf(parent, ids[matched:], kv[:, :, :, matched:len(ids)])
            except StorageError:
                self.skipped_inserts += 1
                return 0
            self._touch_up(leaf)
            return len(ids) - matched

    def remember(self, name, note) -> None:
        """Keep ``note`` under ``name``, the first token of the branch a run stored its KV in (engine/run/joint.py);
        a forgotten note's branch goes with it."""
        with self._lock:
            self._notes[name] = note
            self._notes.move_to_end(name)
            while len(self._notes) > MAX_NOTES:
                old, _ = self._notes.popitem(last=False)
                if old in self._root.children:
                    self._drop(self._root.children[old])

    def recall(self, name):
        """The note kept under ``name``, else None."""
        with self._lock:
            note = self._notes.get(name)
            if note is not None:
                self._notes.move_to_end(name)
            return note

    def stored_tokens(self) -> int:
        """Tokens held by the tree's nodes."""
        with self._lock:
            return sum(len(n.tokens) for n in self._by_key.values() if n.key in self.store)

    def held(self, fingerprint: str | None = None) -> "Held":
        """What the cache holds before a run of the schema ``fingerprint``."""
        warm = self.warmed.get(fingerprint) if fingerprint else None
        others = sum(1 for k in self.warmed if k != fingerprint)
        up = None if warm is None else WarmUp(warm.schema, warm.modules, len(warm.token_ids), warm.placeholders,
                                              warm.ms, warm.at_run == self.inserted_runs)
        return Held(up, earlier_runs=self.inserted_runs, other_schemas_warmed=others, stored_tokens=self.stored_tokens())

    def __len__(self) -> int:
        return len(self._by_key)

    def __repr__(self) -> str:
        return f"PrefixCache(nodes={len(self)}, tokens={self.stored_tokens()}, runs={self.inserted_runs})"

    # -- internal helpers ---------------------------------------------------------------------

    def _walk(self, ids: tuple[int, ...]) -> tuple[list[tuple[_Node, int]], int]:
        """(the longest matching path as (node, tokens used), tokens matched)."""
        path: list[tuple[_Node, int]] = []
        node, i = self._root, 0
        while i < len(ids):
            child = node.children.get(ids[i])
            if child is None:
                break
            if child.key not in self.store:  # cleared: the subtree is useless
                self._drop(child)
                break
            used = _common(child.tokens, ids[i:])
            path.append((child, used))
            i += used
            if used < len(child.tokens):
                break
            node = child
        return path, i

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut ``node`` after ``at`` tokens; return the new upper node."""
        entry = self.store.get(node.key)
        upper = _Node(node.tokens[:at], node.depth, self._new_key(), node.parent)
        lower_key = self._new_key()
        upper_kv, lower_kv = entry.slice(slice(0, at)), entry.slice(slice(at, len(node.tokens)))
        node.parent.children[node.tokens[0]] = upper
        upper.children[node.tokens[at]] = node
        self._by_key.pop(node.key)
        self.store.evict(node.key)  # before the halves are stored
        node.tokens, node.depth, node.key, node.parent = node.tokens[at:], node.depth + at, lower_key, upper
        self._by_key[upper.key], self._by_key[lower_key] = upper, node
        self.store.put(upper.key, upper_kv)
        self.store.put(lower_key, lower_kv)
        return upper

    def _add_leaf(self, parent: _Node, tokens: tuple[int, ...], kv: torch.Tensor) -> _Node:
        start = parent.depth + len(parent.tokens)
        leaf = _Node(tokens, start, self._new_key(), parent)
        parent.children[tokens[0]] = leaf
        self._by_key[leaf.key] = leaf
        positions = torch.arange(start, start + len(tokens), dtype=torch.long)
        entry = ModuleKV(kv.clone(), positions, torch.tensor(tokens, dtype=torch.long))
        try:
            self.store.put(leaf.key, entry)
        except StorageError:
            self._drop(leaf)
            raise
        return leaf

    def _touch_up(self, node: _Node) -> None:
        """Mark ``node`` and its ancestors used, leaves evicted first."""
        keys = []
        while node is not None and node.key is not None:
            keys.append(node.key)
            node = node.parent
        self.store.touch(keys)

    def _new_key(self) -> str:
        return f"{PREFIX}{next(self._ids)}"

    def _evicted(self, key: str) -> None:
        """Drop the node the budget evicted, and its descendants."""
        with self._lock:
            node = self._by_key.get(key)
            if node is not None:
                self._drop(node)

    def _drop(self, node: _Node) -> None:
        """Remove ``node``'s subtree from the tree and the store."""
        if node.parent is not None and node.parent.children.get(node.tokens[0]) is node:
            del node.parent.children[node.tokens[0]]
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            self._by_key.pop(n.key, None)
            if self.store.evict(n.key) and n is not node:
                self.evicted_nodes += 1

    def _pinned_bytes(self) -> int:
        return sum(self.store.entry_bytes(k) for k in self.store.pinned())


def schema_order_prompt(layout: Layout) -> WarmPrompt:
    """The prompt importing every module in schema order (each union's default member), no question."""
    chosen: set[str] = set()

    def take(path: str) -> None:
        chosen.add(path)
        mod = layout.modules[path]
        for child in mod.children:
            take(child)
        for uid in mod.unions:
            take(_default_member(layout, uid))

    for path, mod in layout.modules.items():
        if mod.parent == ANONYMOUS and not mod.union:
            take(path)
    for uid, union in layout.unions.items():
        if union.parent == ANONYMOUS:
            take(_default_member(layout, uid))
    ids: list[int] = []
    placeholders: list[str] = []
    for piece in layout.pieces:
        if piece.owner != ANONYMOUS and piece.owner not in chosen:
            continue
        tokens = piece.token_ids
        if piece.kind == "param":
            param = next(p for p in layout.modules[piece.owner].params if p.name == piece.param)
            if param.has_default:
                tokens = tokens[: param.default_tokens]
            else:
                placeholders.append(f"{piece.owner}/{piece.param}")
        ids += tokens
    ids += layout.codec.generation_prompt
    return WarmPrompt(layout.name, layout.fingerprint, tuple(p for p in layout.modules if p in chosen), tuple(ids),
                      tuple(placeholders))


def _default_member(layout: Layout, uid: str) -> str:
    union = layout.unions[uid]
    return union.default or union.members[0]


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _bytes_per_token(kv: torch.Tensor) -> int:  # kv: [layers, 2, kv_heads, seq, head_dim]
    return kv.shape[0] * 2 * kv.shape[2] * kv.shape[4] * kv.element_size()
