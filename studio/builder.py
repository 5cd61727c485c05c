"""The prompt builder's model: what a prompt can import from a schema, as typed nodes, and PML both ways.

A :class:`BuilderSpec` (modules, unions, params) is made once per layout by :func:`spec_of`; every consumer goes
through :meth:`BuilderSpec.walk`. Widget values are a flat dict keyed by each node's ``key``. No gradio here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import Callable, TypeVar, Union
from xml.sax.saxutils import escape

from engine.errors import EngineError
from engine.public import ANONYMOUS, Layout

NONE = "(none)"  # radio value for "no member of this union"; not a valid PML identifier
T = TypeVar("T")


@dataclass(frozen=True)
class ParamSpec:
    name: str
    length: int
    default: str | None
    module: str

    @property
    def key(self) -> str:
        return f"{self.module}@{self.name}"


@dataclass(frozen=True)
class ModuleNode:
    """An importable module; a union member when ``union`` is set."""

    path: str
    name: str
    parent: str  # "" at top level
    union: str | None
    params: tuple[ParamSpec, ...]
    children: tuple["Node", ...]  # schema order

    @property
    def key(self) -> str:
        return self.path


@dataclass(frozen=True)
class UnionNode:
    """A union: at most one of ``children`` (its members) is imported."""

    id: str
    parent: str
    children: tuple[ModuleNode, ...]

    @property
    def key(self) -> str:
        return self.id


Node = Union[ModuleNode, UnionNode]


@dataclass(frozen=True)
class BuilderSpec:
    schema: str
    tree: tuple[Node, ...]

    def walk(self, visit: Callable[[Node, int, Callable[[], list]], T], nodes: tuple[Node, ...] | None = None,
             depth: int = 0) -> list[T]:
        """``visit(node, depth, descend)`` for each node of ``nodes`` (default: the top level), in order;
        ``descend()`` visits the children and returns their results (a visitor that does not call it skips them)."""
        return [visit(n, depth, partial(self.walk, visit, n.children, depth + 1))
                for n in (self.tree if nodes is None else nodes)]

    @cached_property
    def modules(self) -> dict[str, ModuleNode]:
        return {n.path: n for n in self.nodes() if isinstance(n, ModuleNode)}

    @cached_property
    def unions(self) -> dict[str, UnionNode]:
        return {n.id: n for n in self.nodes() if isinstance(n, UnionNode)}

    def nodes(self, under: Node | None = None) -> list[Node]:
        def visit(node, depth, descend):
            return [node] + [x for sub in descend() for x in sub]
        return [x for sub in self.walk(visit, None if under is None else under.children) for x in sub]

    def params(self) -> dict[str, ParamSpec]:
        return {p.key: p for m in self.modules.values() for p in m.params}

    def importable(self, parent: str) -> dict[str, ModuleNode]:
        """Modules a prompt may write directly inside ``parent`` ("" = the prompt itself), by name."""
        nodes = self.tree if parent == ANONYMOUS else self.modules[parent].children
        out: dict[str, ModuleNode] = {}
        for n in nodes:
            for m in (n.children if isinstance(n, UnionNode) else (n,)):
                out[m.name] = m
        return out


@dataclass(frozen=True)
class BuilderState:
    """What the builder shows; ``nonce`` forces a redraw; ``picked_over``: the editor's text a pick was applied to."""

    spec: BuilderSpec
    values: dict = field(default_factory=dict)
    text: str = ""
    nonce: int = 0
    picked_over: str | None = None

    def older(self, spec: BuilderSpec, prompt_text: str) -> bool:
        """Whether ``prompt_text`` is the editor's text this state's pick was applied to: a read-back older than it."""
        return self.spec == spec and prompt_text == self.picked_over

    def __hash__(self) -> int:  # Gradio hashes state values to see whether they changed
        return hash((self.spec, tuple(sorted(self.values.items())), self.text, self.nonce))


# From a layout, and the selection rules

def spec_of(lay: Layout) -> BuilderSpec:
    from engine.public import Param

    defaults = {(path, c.name): c.default for path, mod in lay.schema.modules() for c in mod.children
                if isinstance(c, Param)}

    def module(path: str) -> ModuleNode:
        m = lay.modules[path]
        params = tuple(ParamSpec(p.name, p.length, defaults.get((path, p.name)) if p.has_default else None, path)
                       for p in m.params)
        kids = [(lay.modules[c].start, module(c)) for c in m.children]
        kids += [(lay.unions[u].start, union(u)) for u in m.unions]
        return ModuleNode(path, m.name, m.parent, m.union, params, _in_order(kids))

    def union(uid: str) -> UnionNode:
        u = lay.unions[uid]
        return UnionNode(uid, u.parent, tuple(module(p) for p in u.members))

    top = [(m.start, module(p)) for p, m in lay.modules.items() if m.parent == ANONYMOUS and not m.union]
    top += [(u.start, union(uid)) for uid, u in lay.unions.items() if u.parent == ANONYMOUS]
    return BuilderSpec(lay.name, _in_order(top))


def empty_values(spec: BuilderSpec) -> dict:
    out: dict = {}
    for node in spec.nodes():
        if isinstance(node, UnionNode):
            out[node.key] = NONE
        else:
            if node.union is None:
                out[node.key] = False
            out.update({p.key: "" for p in node.params})
    return out


def picked(node: ModuleNode, values: dict) -> bool:
    return values.get(node.union) == node.path if node.union else bool(values.get(node.path))


def imported_modules(spec: BuilderSpec, values: dict) -> list[str]:
    def visit(node, depth, descend):
        if isinstance(node, ModuleNode) and not picked(node, values):
            return []
        own = [node.path] if isinstance(node, ModuleNode) else []
        return own + [p for sub in descend() for p in sub]
    return [p for sub in spec.walk(visit) for p in sub]


def normalise(spec: BuilderSpec, values: dict, trigger: str | None = None) -> dict:
    """Make the selection consistent after widget ``trigger`` changed: unpicking a module clears what was picked
    inside it (arguments kept); picking a nested module picks its parents."""
    values = dict(values)

    def clear_inside(node: Node) -> None:
        for inner in spec.nodes(node):
            if isinstance(inner, UnionNode):
                values[inner.key] = NONE
            elif inner.union is None:
                values[inner.key] = False

    if trigger in spec.modules and not values.get(trigger):
        clear_inside(spec.modules[trigger])
    if trigger in spec.unions:
        for member in spec.unions[trigger].children:
            if values.get(trigger) != member.path:
                clear_inside(member)
    chosen = [spec.modules[values[k] if k in spec.unions else k] for k, v in list(values.items())
              if (k in spec.modules and v and not spec.modules[k].union) or (k in spec.unions and v in spec.modules)]
    for node in chosen:
        _pick_parents(spec, values, node)
    return values


def pick(spec: BuilderSpec, values: dict, path: str) -> dict:
    """Values with module ``path`` and its parents picked: typing an argument imports its module."""
    node = spec.modules[path]
    values = dict(values)
    values[node.union or node.path] = node.path if node.union else True
    return normalise(spec, values, node.union or node.path)


def apply_change(spec: BuilderSpec, values: dict, free_text: str, trigger: str | None) -> tuple[dict, str]:
    values = normalise(spec, values, trigger)
    param = spec.params().get(trigger)
    if param is not None and (values.get(trigger) or "").strip():
        values = pick(spec, values, param.module)
    return values, compose_prompt(spec, values, free_text)


# Values <-> PML prompt text

def compose_prompt(spec: BuilderSpec, values: dict, free_text: str) -> str:
    def visit(node, depth, descend) -> str:
        if isinstance(node, UnionNode):
            return "".join(descend())
        if not picked(node, values):
            return ""
        attrs = ""
        for p in node.params:
            value = (values.get(p.key) or "").strip()
            if value:
                attrs += f' {p.name}="{_attr(value)}"'
        inner = "".join(descend())
        return f"<{node.name}{attrs}>{inner}</{node.name}>" if inner else f"<{node.name}{attrs}/>"

    lines = [f'<prompt schema="{_attr(spec.schema)}">']
    lines += ["  " + element for element in spec.walk(visit) if element]
    text = (free_text or "").strip()
    if text:
        safe = text.replace("&", "&amp;").replace("<", "&lt;")  # '>' is legal in XML text
        # an indent on a later line would become part of the text the model reads
        lines.append("  " + safe)
    lines.append("</prompt>")
    return "\n".join(lines) + "\n"


def selection_from_prompt(spec: BuilderSpec, prompt_text: str) -> tuple[dict, str] | None:
    """(widget values, free text) that reproduce a hand-written prompt, or None when it cannot be read."""
    from engine.public import Import, NewText, parse_prompt

    try:
        prompt = parse_prompt(prompt_text)
    except EngineError:
        return None
    if prompt.schema != spec.schema:
        return None
    values = empty_values(spec)
    texts: list[str] = []

    def take(item: Import, parent: str) -> bool:
        node = spec.importable(parent).get(item.name)
        if node is None:
            return False
        values[node.union or node.path] = node.path if node.union else True
        known = {p.name for p in node.params}
        for k, v in item.args:
            if k not in known:
                return False
            values[f"{node.path}@{k}"] = v
        return all(take(child, node.path) for child in item.children)

    for item in prompt.items:
        if isinstance(item, Import):
            if not take(item, ANONYMOUS):
                return None
        elif isinstance(item, NewText) and item.text.strip():
            texts.append(item.text.strip())
    return values, "\n\n".join(texts)


def next_state(spec: BuilderSpec | None, prompt_text: str, prev: BuilderState | None) -> BuilderState | None:
    """The builder's next state for ``prompt_text``; None to leave it (an unreadable prompt under the same spec:
    the user is typing; or the text a later pick was applied to, whose editor read-back came after the pick)."""
    if spec is None:
        return None
    if prev is not None and prev.older(spec, prompt_text):
        return None
    found = selection_from_prompt(spec, prompt_text)
    if found is None:
        if prev is not None and prev.spec == spec:
            return None
        found = (empty_values(spec), "")
    values, text = found
    return BuilderState(spec, values, text, (prev.nonce if prev else 0) + 1)


def param_info(codec, value: str | None, length: int, default: str | None) -> str:
    value = (value or "").strip()
    if not value:
        return f"empty: uses the default “{default}”" if default is not None else f"required · up to {length} tokens"
    n = len(codec.encode(value))
    return f"{n} / {length} tokens" + (" — too long, shorten it" if n > length else "")


def empty_prompt(schema_name: str) -> str:
    return f'<prompt schema="{_attr(schema_name)}">\n</prompt>\n'



def _in_order(items: list[tuple[int, Node]]) -> tuple[Node, ...]:
    return tuple(n for _, n in sorted(items, key=lambda t: t[0]))


def _pick_parents(spec: BuilderSpec, values: dict, node: ModuleNode) -> None:
    parent = node.parent
    while parent:
        p = spec.modules[parent]
        values[p.union or p.path] = p.path if p.union else True
        parent = p.parent


def _attr(value: str) -> str:
    return escape(value, {'"': "&quot;"})
