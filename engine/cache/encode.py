"""Encoding: compute and store the KV of every cached unit of a schema.

The units (the anonymous text, one per module variant, one per scaffold) and the encoding modes
are docs/pml-spec.md section 3; an entry already stored, in memory or on disk, is reused.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Generator

from engine.cache.compress import compress
from engine.cache.settings import CONTEXTUAL, Compression, canonical_mode
from engine.cache.store import ModuleStore
from engine.errors import EngineError, MissingEntry
from engine.kv import ModuleKV, storage_tag, to_storage
from engine.model.attend import ATTENTION, AttentionScorer, AttentionSpec, forward_kv
from engine.run.events import UnitEncoded, finish
from engine.schema.layout import ANONYMOUS, EntryName, Layout


_KEY_SPELLING = {CONTEXTUAL: "prefixed"}  # the old spelling keeps persisted entries valid


@dataclass(frozen=True)
class Encoding:
    """The run settings encoding depends on (a ``RunConfig`` can be passed instead)."""

    mode: str = CONTEXTUAL
    storage_dtype: str = "float32"
    compression: Compression = field(default_factory=Compression)
    sink: int = 0  # isolated mode only


@dataclass(frozen=True)
class UnitReport:
    name: str
    kind: str  # "anonymous" | "module" | "scaffold"
    tokens: int
    ms: float
    source: str  # "memory" | "disk" | "encoded"
    unsaved: str = ""  # why the disk refused to keep it (it served from memory)
    keys: tuple[str, ...] = ()  # the store keys it made available

    @property
    def reused(self) -> bool:
        return self.source != "encoded"


@dataclass(frozen=True)
class EncodedSchema:
    layout: Layout = field(repr=False)
    mode: str
    device: str
    dtype: str
    compression: Compression
    pieces: dict[int, tuple[str, int]]  # piece index -> (store key, offset in the entry)
    scaffolds: dict[str, dict[int, tuple[str, int]]]  # scaffold -> pieces
    module_keys: dict[str, str]  # module path or ANONYMOUS -> store key
    scaffold_keys: dict[str, str]
    units: tuple[UnitReport, ...]
    encode_ms: float
    sink: int = 0

    def keys(self) -> list[str]:
        return list(self.module_keys.values()) + list(self.scaffold_keys.values())

    def fresh_keys(self) -> frozenset[str]:
        """Store keys this encode computed (not found in the store)."""
        return frozenset(k for u in self.units if not u.reused for k in u.keys)

    def bytes_by_module(self, store: ModuleStore) -> dict[str, int]:
        out = {str(EntryName.module(path)): store.entry_bytes(k) for path, k in self.module_keys.items()}
        out.update({str(EntryName.scaffold(name)): store.entry_bytes(k) for name, k in self.scaffold_keys.items()})
        return out

    def nbytes(self, store: ModuleStore) -> int:
        """Bytes of this schema's entries, each counted once."""
        return sum(store.entry_bytes(k) for k in set(self.keys()))

    def locate(self, piece: int, scaffold: str | None) -> tuple[str, int]:
        return self.scaffolds[scaffold][piece] if scaffold else self.pieces[piece]


def encode_schema(model, layout: Layout, store: ModuleStore, config: Encoding = Encoding(),
                  model_fingerprint: str = "") -> EncodedSchema:
    """:func:`encoding`, every unit at once."""
    return finish(encoding(model, layout, store, config, model_fingerprint))


def encoding(model, layout: Layout, store: ModuleStore, config: Encoding = Encoding(),
             model_fingerprint: str = "") -> Generator[UnitEncoded, None, EncodedSchema]:
    """Encode every cached unit of ``layout`` into ``store``, a UnitEncoded after each; the anonymous entry keeps
    the compute dtype."""
    mode, dtype, comp = canonical_mode(config.mode), config.storage_dtype, config.compression
    if comp.active and getattr(model.config, "_attn_implementation", "") != ATTENTION:
        raise EngineError("compression needs the model to run with SDPA attention (the loaded model uses "
                          f"'{model.config._attn_implementation}'); set retention to 1.0")
    jobs = _plan_units(layout)
    ctx = _Context(model, layout, store, dtype, comp, len(jobs))
    storage = f"{storage_tag(dtype)}|{comp.stored_key()}"
    t_start = time.perf_counter()
    pieces_map: dict[int, tuple[str, int]] = {}
    module_keys: dict[str, str] = {}

    # 1. Anonymous unit (pinned: every prompt uses it).
    anon = [p.index for p in layout.anonymous()]
    anon_key = _key(model_fingerprint, layout.codec.fingerprint, "anonymous", _ids_pos(layout, anon))
    anon_entry = ctx.unit(anon, None, {EntryName.anonymous(): (anon_key, anon)}, EntryName.anonymous(), "anonymous")
    if anon:
        module_keys[ANONYMOUS] = anon_key
        _map_pieces(layout, anon, pieces_map, anon_key)
    yield ctx.advance(EntryName.anonymous())
    pasts = _Pasts(layout, anon_entry, mode, config.sink if mode == "isolated" else 0)

    # 2. Module units, one per (top-level module, variant).
    for top, choice, targets in jobs[1:-len(layout.schema.scaffolds) or None]:
        unit = layout.unit_pieces(top, choice)
        context, past = pasts.context_of(layout.modules[top].start)
        unit_key = _key(model_fingerprint, layout.codec.fingerprint, _KEY_SPELLING.get(mode, mode), storage, context, _ids_pos(layout, unit))
        wanted = {}
        for path in targets:
            own = list(layout.modules[path].pieces)
            if own:
                key = _key(unit_key, path.split("/")[-1], str([unit.index(i) for i in own]))
                wanted[path] = (key, own)
                module_keys[path] = key
                _map_pieces(layout, own, pieces_map, key)
        label = top + "".join(f" [{m.rsplit('/', 1)[-1]}]" for m in choice.values())
        ctx.unit(unit, past, wanted, label, "module")
        yield ctx.advance(label)

    # 3. Scaffold units.
    scaffolds, scaffold_keys = yield from _encode_scaffolds(ctx, pasts, model_fingerprint, storage)
    return EncodedSchema(layout=layout, mode=mode, device=store.device, dtype=dtype, compression=comp,
                         pieces=pieces_map, scaffolds=scaffolds, module_keys=module_keys, scaffold_keys=scaffold_keys,
                         units=tuple(ctx.reports), encode_ms=(time.perf_counter() - t_start) * 1000, sink=pasts.sink)


def _encode_scaffolds(ctx: _Context, pasts: _Pasts, model_fingerprint: str,
                      storage: str) -> Generator[UnitEncoded, None, tuple[dict, dict[str, str]]]:
    """Encode one joint unit per scaffold."""
    layout = ctx.layout
    scaffolds: dict[str, dict[int, tuple[str, int]]] = {}
    scaffold_keys: dict[str, str] = {}
    for sc in layout.schema.scaffolds:
        pre, covered = layout.scaffold_unit(sc.name)
        _, past = pasts.prefix_of(min(layout.modules[m].start for m in sc.modules))
        key = _key(model_fingerprint, layout.codec.fingerprint, "scaffold", storage, _ids_pos(layout, pre),
                   _ids_pos(layout, covered))
        name = EntryName.scaffold(sc.name)
        ctx.unit(covered, past, {name: (key, covered)}, name, "scaffold")
        scaffold_keys[sc.name] = key
        scaffolds[sc.name] = {}
        _map_pieces(layout, covered, scaffolds[sc.name], key)
        yield ctx.advance(name)
    return scaffolds, scaffold_keys


def count_units(layout: Layout) -> int:
    return len(_plan_units(layout))


# ----------------------------------------------------------------------------------------------
# Internal helpers
# ----------------------------------------------------------------------------------------------

def _plan_units(layout: Layout) -> list[tuple[str, dict, list[str]]]:
    """[anonymous] + [(top, union choice, target modules)] + [scaffold placeholders]."""
    jobs: list[tuple[str, dict, list[str]]] = [("", {}, [])]
    for top in layout.top_level():
        if not layout.modules[top].cache:
            continue
        groups: dict[tuple, tuple[dict, list[str]]] = {}
        for path, m in layout.modules.items():
            if m.top != top or not m.cache:
                continue
            choice = layout.variant_of(path)
            sig = tuple(sorted(choice.items()))
            groups.setdefault(sig, (choice, []))[1].append(path)
        for choice, targets in groups.values():
            jobs.append((top, choice, targets))
    jobs += [("", {}, [])] * len(layout.schema.scaffolds)
    return jobs


def _ids_pos(layout: Layout, pieces: list[int]) -> str:
    ids: list[int] = []
    pos: list[int] = []
    for i in pieces:
        p = layout.pieces[i]
        ids += p.token_ids
        pos += range(p.start, p.end)
    return f"{ids}|{pos}"


def _key(*parts: str) -> str:
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:24]


def _map_pieces(layout: Layout, pieces: list[int], out: dict[int, tuple[str, int]], key: str) -> None:
    offset = 0
    for i in pieces:
        out[i] = (key, offset)
        offset += len(layout.pieces[i])


class _Context:
    """What one encode_schema call shares between its units."""

    def __init__(self, model, layout: Layout, store: ModuleStore, precision: str, comp: Compression, total: int):
        self.model, self.layout, self.store, self.precision, self.comp = model, layout, store, precision, comp
        self.reports: list[UnitReport] = []
        self.total, self.done = total, 0

    def advance(self, label: str) -> UnitEncoded:
        """One more unit done."""
        self.done += 1
        return UnitEncoded(self.done, self.total, label)

    def unit(self, unit: list[int], past: ModuleKV | None, wanted: dict[str, tuple[str, list[int]]], label: str,
             kind: str) -> ModuleKV | None:
        """Make every wanted entry available; return the anonymous unit's KV, else None."""
        if not unit:
            return None
        layout, store = self.layout, self.store
        n_tokens = sum(len(layout.pieces[i]) for i in unit)
        t0 = time.perf_counter()
        places = [store.where(key) for key, _ in wanted.values()]
        if all(places):
            try:
                entries = [store.get(key) for key, _ in wanted.values()]
                source = "memory" if all(p == "memory" for p in places) else "disk"
                self.reports.append(UnitReport(label, kind, n_tokens, (time.perf_counter() - t0) * 1000, source,
                                               keys=tuple(k for k, _ in wanted.values())))
                return entries[0] if kind == "anonymous" else None
            except MissingEntry:
                pass  # vanished or corrupted: encode afresh
        ids: list[int] = []
        pos: list[int] = []
        offsets: dict[int, int] = {}
        for i in unit:
            p = layout.pieces[i]
            offsets[i] = len(ids)
            ids += p.token_ids
            pos += range(p.start, p.end)
        compress_it = self.comp.at_encode and kind != "anonymous"
        if compress_it:
            scorer = AttentionScorer(len(ids), self.comp.recent_frac)
            out = forward_kv(self.model, ids, pos, past, AttentionSpec(scorer=scorer))
            scores = [scorer.scores[i] for i in range(out.kv.shape[0])]
        else:
            out, scores = forward_kv(self.model, ids, pos, past), None
        for name, (key, own) in wanted.items():
            idx = [offsets[i] + k for i in own for k in range(len(layout.pieces[i]))]
            entry = out if idx == list(range(len(out))) else out.slice(idx)
            if compress_it:
                entry = compress(entry, [s[idx] for s in scores], self.comp)
            if kind != "anonymous":
                entry = to_storage(entry, self.precision)
            store.put(key, entry, pinned=kind == "anonymous", meta={"module": name, "schema": layout.name})
        unsaved = next((why for key, _ in wanted.values() if (why := store.unsaved(key))), "")
        self.reports.append(UnitReport(label, kind, n_tokens, (time.perf_counter() - t0) * 1000, "encoded", unsaved,
                                       tuple(k for k, _ in wanted.values())))
        return out if kind == "anonymous" else None


class _Pasts:
    """The past KV a unit is encoded after, by mode."""

    def __init__(self, layout: Layout, anon_entry: ModuleKV | None, mode: str, sink: int):
        self.layout, self.anon_entry, self.mode, self.sink = layout, anon_entry, mode, sink

    def prefix_of(self, start: int) -> tuple[list[int], ModuleKV | None]:
        pre = self.layout.prefix_pieces(start)
        if not pre or self.anon_entry is None:
            return [], None
        n = sum(len(self.layout.pieces[i]) for i in pre)
        return pre, self.anon_entry.slice(slice(0, n))

    def context_of(self, start: int) -> tuple[str, ModuleKV | None]:
        """(key part, past KV) of a module unit starting at ``start``."""
        if self.mode == CONTEXTUAL:
            pre, past = self.prefix_of(start)
            return _ids_pos(self.layout, pre), past
        _, past = self.prefix_of(start) if self.sink else ([], None)
        if past is None:
            return _ids_pos(self.layout, []), None
        past = past.slice(slice(0, min(self.sink, len(past))))
        return f"sink|{past.token_ids.tolist()}|{past.positions.tolist()}", past
