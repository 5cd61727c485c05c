"""PML parsing and validation: schema and prompt documents → frozen dataclasses (docs/pml-spec.md).

The text is read as XML by xmldoc.py. Every problem found in one pass is raised together as one :class:`PMLError`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterator
from typing import Union as TypingUnion

from engine.errors import MAX_PROBLEMS, Problem, Problems, named

from .where import Lines
from .xmldoc import parse_xml, strip_comments, tag_map

IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*\Z")
ROLES = ("system", "user", "assistant")
REFERENCE_PARAMETER_LEN = 16  # `<parameter>` without `length`, as the spec documents
MAX_PARAM_LEN = 1 << 20  # the layout checks the model's own context


# ----------------------------------------------------------------------------------------------
# Public data model
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Text:
    """A run of literal text (whitespace at both ends collapsed to at most one space)."""

    text: str
    line: int


@dataclass(frozen=True)
class Param:
    """A placeholder of ``length`` positions inside a module."""

    name: str
    length: int
    default: str | None
    line: int


@dataclass(frozen=True)
class Module:
    """A reusable segment; ``children`` are Text, Param, Module and Union nodes in order."""

    name: str
    children: tuple
    cache: bool
    line: int


@dataclass(frozen=True)
class Union:
    """Mutually exclusive modules that share a start position."""

    members: tuple[Module, ...]
    scaffold: str | None
    line: int


@dataclass(frozen=True)
class Role:
    """A chat-role region (``system``/``user``/``assistant``) at the top of a schema."""

    role: str
    children: tuple
    line: int


@dataclass(frozen=True)
class Scaffold:
    """Top-level modules that are also encoded jointly."""

    name: str
    modules: tuple[str, ...]
    line: int


Node = TypingUnion[Text, Param, Module, Union, Role]


@dataclass(frozen=True)
class Schema:
    name: str
    children: tuple
    scaffolds: tuple[Scaffold, ...]
    source: str = "<schema>"
    text: str = field(default="", repr=False, compare=False)

    def modules(self) -> Iterator[tuple[str, Module]]:
        """Every module with its path (``parent/child``), in document order."""
        yield from _walk_modules(self.children, "")


@dataclass(frozen=True)
class Import:
    """``<name arg="value">children</name>`` in a prompt."""

    name: str
    args: tuple[tuple[str, str], ...]
    children: tuple["Import", ...]
    line: int
    col: int  # of its name
    at: tuple[tuple[str, int, int, int, int], ...] = ()  # (argument, line, col of its name, line, col of its value)

    def arg_at(self, key: str, value: bool = False) -> tuple[int, int]:
        """(line, column) of argument ``key``'s name (``value``: of its value); the tag's when unknown."""
        where = self._places.get(key, (self.line, self.col) * 2)
        return where[2:] if value else where[:2]

    @cached_property
    def _places(self) -> dict[str, tuple[int, ...]]:  # made once: an import may have thousands of arguments
        return {k: tuple(where) for k, *where in self.at}


@dataclass(frozen=True)
class NewText:
    """Uncached text of a prompt; ``role`` is set when it was written inside a role tag."""

    text: str
    role: str | None
    line: int


@dataclass(frozen=True)
class Prompt:
    schema: str
    items: tuple  # Import | NewText, in document order
    source: str = "<prompt>"
    text: str = field(default="", repr=False, compare=False)
    line: int = 1


def parse_schema(text: str, source: str = "<schema>") -> Schema:
    """Parse and structurally validate a schema document; raise PMLError listing its problems."""
    root, v, name = _open_root(text, source, "schema", "name", "<schema name=\"my-schema\"> ... </schema>")
    children = v.container(root, where="schema")
    scaffolds = _scaffolds(v, root, children)
    if v.problems:
        raise v.problems.error()
    return Schema(name=name, children=tuple(children), scaffolds=tuple(scaffolds), source=source, text=text)


def parse_prompt(text: str, source: str = "<prompt>") -> Prompt:
    """Parse a prompt document (imports are resolved against a schema later, in plan.py)."""
    root, v, schema = _open_root(text, source, "prompt", "schema", "<prompt schema=\"SCHEMA-NAME\"> ... </prompt>")
    items = v.prompt_items(root)
    if v.problems:
        raise v.problems.error()
    return Prompt(schema=schema, items=tuple(items), source=source, text=text, line=root.sourceline or 1)


def document_kind(text: str) -> str | None:
    """'schema', 'prompt' or None: the root tag of a document, without validating it."""
    m = re.search(r"<\s*(schema|prompt)\b", strip_comments(text))
    return m.group(1) if m else None


def compact(text: str | None) -> str:
    """Collapse leading/trailing whitespace to one space; whitespace-only text becomes ''."""
    if not text or not text.strip():
        return ""
    lead = " " if text[0].isspace() else ""
    trail = " " if text[-1].isspace() else ""
    return lead + text.strip() + trail


# ----------------------------------------------------------------------------------------------
# Internal helpers
# ----------------------------------------------------------------------------------------------

def _walk_modules(children, prefix: str) -> Iterator[tuple[str, Module]]:
    for node in children:
        if isinstance(node, Module):
            path = f"{prefix}{node.name}"
            yield path, node
            yield from _walk_modules(node.children, path + "/")
        elif isinstance(node, Union):
            yield from _walk_modules(node.members, prefix)
        elif isinstance(node, Role):
            yield from _walk_modules(node.children, prefix)


def _open_root(text: str, source: str, tag: str, attr: str, example: str):
    """(root element, validator, root identifier) of a document rooted at ``<tag attr=...>``."""
    root = parse_xml(text, source)
    v = _Validator(source, text, root)
    if root.tag != tag:
        v.add(root, f"the root element is <{root.tag}>, a {tag} starts with <{tag} {attr}=\"...\">",
              f"wrap the document in {example}")
        raise v.problems.error()
    v.check_attrs(root, {attr}, tag)
    return root, v, v.identifier(root, attr, tag)


class _Validator:
    """Collects problems while turning lxml elements into the frozen data model."""

    def __init__(self, source: str, text: str, root=None):
        self.source, self.lines = source, Lines(text)
        self.problems = Problems()
        self.tags = tag_map(root, text)  # element -> its start tag in the text (where.Tag)

    # -- reporting ----------------------------------------------------------------------------

    def add(self, el, message: str, hint: str = "", attr: str | None = None, value: bool = True) -> None:
        """A problem at ``el``'s name, or at its attribute ``attr``'s value (``value`` false: its name)."""
        self.problems.add(lambda: Problem(self.source, *self.where(el, attr, value), message, hint))

    def where(self, el, attr: str | None = None, value: bool = True) -> tuple[int, int]:
        tag = self.tags.get(el)
        if tag is None:  # no map (the scan and lxml disagreed): the line lxml gives, the tag's first '<' on it
            line = getattr(el, "sourceline", None) or 1
            text = self.lines.line(line)
            return line, text.find("<" + str(getattr(el, "tag", ""))) + 2 if "<" + str(el.tag) in text else 1
        at = tag.attrs.get(attr) if attr else None
        return self.lines.at(tag.start + 1 if at is None else at[1 if value else 0])

    # -- attributes ---------------------------------------------------------------------------

    def check_attrs(self, el, allowed: set[str], what: str) -> None:
        unknown = [attr for attr in el.attrib if attr not in allowed]
        for attr in unknown[:MAX_PROBLEMS]:  # past those, counted only: an element may have 100,000
            self.add(el, f"<{el.tag}> has an unknown attribute '{attr}'",
                     f"attributes of {what}: {', '.join(sorted(allowed)) or 'none'}", attr, value=False)
        self.problems.more += max(len(unknown) - MAX_PROBLEMS, 0)

    def identifier(self, el, attr: str, what: str) -> str:
        value = el.get(attr)
        if value is None:
            self.add(el, f"<{el.tag}> needs a '{attr}' attribute", f"write <{el.tag} {attr}=\"...\">")
            return ""
        value = value.strip()
        if not IDENT.match(value):
            self.add(el, f"{what} {attr} '{value}' is not a valid identifier",
                     "use letters, digits, '_', '.', '-' and start with a letter or '_'", attr)
        return value

    # -- schema -------------------------------------------------------------------------------

    def container(self, el, where: str) -> list:
        """Children of <schema>, a role tag or a <module>; text runs kept in order."""
        out: list = []
        names: dict[str, int] = {}
        params: set[str] = set()
        self._text(out, el.text, el.sourceline)
        for child in el:
            if not isinstance(child.tag, str):  # entity references left unresolved
                self.add(el, "entity references are not expanded in PML", "write the text out literally")
            elif child.tag == "module":
                m = self.module(child)
                self._unique(names, [(child, m.name)], where)
                out.append(m)
            elif child.tag == "union":
                u = self.union(child)
                self._unique(names, _members(child, u), where)
                out.append(u)
            elif child.tag in ("param", "parameter"):
                if where.startswith("module"):
                    p = self.param(child)
                    if p.name in params:
                        self.add(child, f"param '{p.name}' is declared twice in {where}",
                                 "give each param of a module its own name", "name")
                    params.add(p.name)
                    out.append(p)
                else:
                    self.add(child, f"<{child.tag}> is only allowed inside a <module>, not in {where}",
                             "move it into the module whose text it fills")
            elif child.tag in ROLES:
                if where == "schema":
                    role = Role(child.tag, tuple(self._role_children(child, names)), child.sourceline or 1)
                    out.append(role)
                else:
                    self.add(child, f"<{child.tag}> is only allowed at the top of the schema, not in {where}",
                             f"close the {where} before opening <{child.tag}>, or remove the role tag")
            elif child.tag == "scaffold":
                if where != "schema":
                    self.add(child, f"<scaffold> must sit directly in <schema>, not in {where}",
                             "move it after the role regions, directly inside <schema>")
            else:
                self.add(child, f"unknown element <{child.tag}> in {where}",
                         "PML elements are schema, module, union, param, scaffold, system, user, assistant; "
                         "if this is text (HTML, code), wrap it in <![CDATA[ ... ]]>")
            self._text(out, child.tail, child.sourceline)
        return out

    def _role_children(self, el, names: dict[str, int]) -> list:
        self.check_attrs(el, set(), f"<{el.tag}>")
        out: list = []
        self._text(out, el.text, el.sourceline)
        for child in el:
            if child.tag == "module":
                m = self.module(child)
                self._unique(names, [(child, m.name)], "schema")
                out.append(m)
            elif child.tag == "union":
                u = self.union(child)
                self._unique(names, _members(child, u), "schema")
                out.append(u)
            elif child.tag in ("param", "parameter"):
                self.add(child, f"<{child.tag}> is only allowed inside a <module>, not in <{el.tag}>",
                         "move it into the module whose text it fills")
            elif child.tag in ROLES or child.tag == "scaffold":
                self.add(child, f"<{child.tag}> cannot be nested in <{el.tag}>",
                         f"close </{el.tag}> first")
            elif isinstance(child.tag, str):
                self.add(child, f"unknown element <{child.tag}> in <{el.tag}>",
                         "PML elements are module, union and text here; wrap literal markup in <![CDATA[ ... ]]>")
            self._text(out, child.tail, child.sourceline)
        return out

    def _text(self, out: list, text: str | None, line: int | None) -> None:
        t = compact(text)
        if t:
            out.append(Text(t, line or 1))

    def _unique(self, names: dict[str, int], new: list[tuple], where: str) -> None:
        """Check the (element, module name) pairs ``new`` against the sibling ``names`` (name -> line) seen."""
        for el, name in new:
            if not name:
                continue
            if name in ROLES:
                self.add(el, f"module name '{name}' is reserved for the chat role tag",
                         "rename the module (e.g. 'user-profile')", "name")
            if name in names:
                self.add(el, f"module '{name}' is declared twice in {where} (first on line {names[name]})",
                         "module names must be unique among siblings: rename one of them", "name")
            else:
                names[name] = self.where(el, "name")[0]

    def module(self, el) -> Module:
        self.check_attrs(el, {"name", "cache"}, "<module>")
        name = self.identifier(el, "name", "module")
        cache_attr = (el.get("cache") or "true").strip().lower()
        if cache_attr not in ("true", "false"):
            self.add(el, f"module '{name}' has cache=\"{el.get('cache')}\"", "write cache=\"true\" or cache=\"false\"",
                     "cache")
        children = self.container(el, where=f"module '{name}'")
        return Module(name=name, children=tuple(children), cache=cache_attr != "false", line=el.sourceline or 1)

    def union(self, el) -> Union:
        self.check_attrs(el, {"scaffold"}, "<union>")
        members: list[Module] = []
        if compact(el.text):
            self.add(el, "text directly inside <union> is not allowed", "put the text inside one of its <module>s")
        for child in el:
            if child.tag == "module":
                members.append(self.module(child))
            elif isinstance(child.tag, str):
                self.add(child, f"<union> may only contain <module> elements, found <{child.tag}>",
                         "wrap it in a <module name=\"...\"> or move it out of the union")
            if compact(child.tail):
                self.add(child, "text directly inside <union> is not allowed",
                         "put the text inside one of its <module>s")
        if not members:
            self.add(el, "<union> has no <module> members", "add at least two <module> elements, or remove the union")
        scaffold = el.get("scaffold")
        if scaffold is not None:
            scaffold = scaffold.strip()
            if scaffold not in [m.name for m in members]:
                valid = named([m.name for m in members])
                self.add(el, f"union scaffold '{scaffold}' is not one of its members", f"members: {valid}", "scaffold")
        return Union(members=tuple(members), scaffold=scaffold, line=el.sourceline or 1)

    def param(self, el) -> Param:
        reference = el.tag == "parameter"
        len_attr, default_attr = ("length", "scaffold") if reference else ("len", "default")
        allowed = {"name", len_attr, default_attr} | ({"len", "default"} if reference else set())
        self.check_attrs(el, allowed, f"<{el.tag}>")
        name = self.identifier(el, "name", el.tag)
        raw = el.get(len_attr, el.get("len"))
        length = 0
        if raw is None:
            if reference:
                length = REFERENCE_PARAMETER_LEN
            else:
                self.add(el, f"param '{name}' needs a len attribute (its most tokens)",
                         f"write <param name=\"{name}\" len=\"8\"/>")
        else:
            try:
                length = int(raw.strip())
            except ValueError:
                length = 0
            if length <= 0:
                self.add(el, f"param '{name}' has {len_attr}=\"{raw}\", it must be a positive whole number",
                         f"write {len_attr}=\"8\" (tokens)", len_attr if el.get(len_attr) is not None else "len")
            elif length > MAX_PARAM_LEN:
                self.add(el, f"param '{name}' has {len_attr}=\"{raw}\", more positions than any model's context",
                         f"write a {len_attr} of at most the model's context (e.g. {len_attr}=\"64\")",
                         len_attr if el.get(len_attr) is not None else "len")
                length = 0
        if compact(el.text) or len(el):
            self.add(el, f"param '{name}' must be empty", f"write <{el.tag} name=\"{name}\" .../> and give "
                     "default text with the default attribute")
        default = el.get(default_attr, el.get("default"))
        return Param(name=name, length=length, default=default, line=el.sourceline or 1)

    # -- prompt -------------------------------------------------------------------------------

    def prompt_items(self, root) -> list:
        items: list = []
        self._new_text(items, root.text, root.sourceline)
        for child in root:
            if not isinstance(child.tag, str):
                self.add(root, "entity references are not expanded in PML", "write the text out literally")
            elif child.tag in ROLES:
                self.check_attrs(child, set(), f"<{child.tag}>")
                if len(child):
                    self.add(child[0], f"<{child[0].tag}> inside <{child.tag}>: a role tag in a prompt holds "
                             "new text only", "put module imports directly inside <prompt>")
                text = (child.text or "").strip()
                if text:
                    items.append(NewText(text, child.tag, child.sourceline or 1))
            elif child.tag in ("module", "union", "param", "parameter", "scaffold", "schema", "prompt"):
                self.add(child, f"<{child.tag}> is a schema element; a prompt imports modules by name",
                         "write <MODULE-NAME/> to import a module, e.g. <doc1/>")
            else:
                items.append(self.import_(child))
            self._new_text(items, child.tail, child.sourceline)
        return items

    def _new_text(self, items: list, text: str | None, line: int | None) -> None:
        t = compact(text)
        if t:
            items.append(NewText(t, None, line or 1))

    def import_(self, el) -> Import:
        line, col = self.where(el)
        if compact(el.text) or any(compact(c.tail) for c in el):
            self.add(el, f"the import <{el.tag}> contains text; an import contains no text",
                     f"put new text after </{el.tag}>, or give arguments as attributes")
        children = tuple(self.import_(c) for c in el if isinstance(c.tag, str))
        at = tuple((k, *self.where(el, k, value=False), *self.where(el, k)) for k in el.attrib)
        return Import(name=el.tag, args=tuple((k, v) for k, v in el.attrib.items()), children=children,
                      line=line, col=col, at=at)


def _members(el, union: Union) -> list[tuple]:
    """(element, name) of each member of the ``union`` parsed from ``el``."""
    return list(zip([c for c in el if c.tag == "module"], [m.name for m in union.members]))


def _scaffolds(v: _Validator, root, children) -> list[Scaffold]:
    """The <scaffold> elements of ``root``, checked against the schema's top-level ``children``."""
    top = _top_level_unions(children)  # top-level module name -> union index (None outside unions)
    out: list[Scaffold] = []
    seen: set[str] = set()
    for el in root:
        if el.tag != "scaffold":
            continue
        v.check_attrs(el, {"name", "modules"}, "<scaffold>")
        name = v.identifier(el, "name", "scaffold")
        if name in seen:
            v.add(el, f"scaffold '{name}' is declared twice", "rename one of them")
        seen.add(name)
        mods = tuple((el.get("modules") or "").split())
        if len(mods) < 2:
            v.add(el, f"scaffold '{name}' lists {len(mods)} module(s); it needs at least two",
                  "write modules=\"first-module second-module\"")
        unions_used: dict[int, str] = {}
        for m in mods:
            if m not in top:
                v.add(el, f"scaffold '{name}' names '{m}', which is not a top-level module",
                      f"top-level modules: {named(top)}")
            elif top[m] is not None:
                if top[m] in unions_used:
                    v.add(el, f"scaffold '{name}' names '{unions_used[top[m]]}' and '{m}', two members of "
                          "one union (a prompt can never import both)", "keep one of them")
                unions_used[top[m]] = m
        if len(set(mods)) != len(mods):
            v.add(el, f"scaffold '{name}' names a module twice", "list each module once")
        out.append(Scaffold(name=name, modules=mods, line=el.sourceline or 1))
    return out


def _top_level_unions(children) -> dict[str, int | None]:
    """Top-level module name -> index of its union (None outside unions)."""
    top: dict[str, int | None] = {}
    union_idx = 0

    def collect(nodes):
        nonlocal union_idx
        for n in nodes:
            if isinstance(n, Module):
                top[n.name] = None
            elif isinstance(n, Union):
                union_idx += 1
                for m in n.members:
                    top[m.name] = union_idx
            elif isinstance(n, Role):
                collect(n.children)

    collect(children)
    return top
