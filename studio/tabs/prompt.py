"""Prompt tab: the builder generated from the schema (studio/builder.py), the PML prompt, its token view."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import gradio as gr

from engine.errors import EngineError

from ..builder import NONE, BuilderState, ModuleNode, UnionNode, apply_change, param_info, selection_from_prompt
from ..errors import problem_lines
from ..state import Studio
from ..views import error_html, ok_html, problems_html, token_view_html
from .editors import Editors, Step

BUILDER_HELP = ("#### Prompt builder\nPick modules and fill params; the PML prompt on the right follows. Edits "
                "made there come back here when you leave the editor.")


@dataclass(frozen=True)
class PromptTab:
    preview: Step  # re-check the prompt against the schema (after the model changed)


def build(studio: Studio, editors: Editors) -> PromptTab:
    with gr.Row(equal_height=False):
        with gr.Column(scale=2, elem_classes=["pml-builder"]):
            gr.Markdown(BUILDER_HELP)

            @gr.render(inputs=[editors.builder])
            def builder(state):
                render_builder(studio, state, editors)

        with gr.Column(scale=3):
            editors.prompt.render()
            status = gr.HTML()
            tokens = gr.HTML()

    preview_step = Step(partial(preview, studio), [editors.schema, editors.prompt], [status, tokens])
    editors.schema.change(*preview_step, trigger_mode="always_last", show_progress="hidden")
    editors.prompt.change(*preview_step, trigger_mode="always_last", show_progress="hidden")
    editors.prompt.blur(*editors.sync, show_progress="hidden")
    editors.spec.change(*editors.sync, show_progress="hidden")
    return PromptTab(preview_step)



def preview(studio: Studio, schema_text: str, prompt_text: str) -> tuple[str, str]:
    try:
        lay = studio.layout(schema_text)
    except EngineError:
        return error_html("Fix the schema first (see the Schema tab)."), ""
    try:
        plan = studio.engine.plan(lay, prompt_text or "")
    except EngineError as err:
        return problems_html("prompt problem(s)", problem_lines(err, prompt_text or "")[0]), ""
    status = ok_html(f"prompt is valid: {plan.prompt_tokens} tokens, {plan.cached_tokens} cached, "
                     f"{plan.uncached_tokens} prefilled")
    return status, token_view_html(plan, studio.decode_token)


def argument_info(studio: Studio, value: str | None, length: int, default: str | None) -> str:
    return param_info(studio.engine.codec, value, length, default)


def render_builder(studio: Studio, state: BuilderState | None, editors: Editors) -> None:
    """The builder for ``state``. Its components and events carry keys made of the schema's spec and the node, so a
    redraw for the same schema keeps their ids: an event a widget sent while the builder was redrawn (a click right
    after typing in the prompt editor, whose blur redraws it) reaches its handler instead of a removed one."""
    if not state:
        gr.Markdown("_The builder appears once the schema is valid._", elem_classes=["pml-note"])
        return
    spec, values = state.spec, state.values
    tag = f"builder-{spec_tag(spec)}"
    widgets: dict[str, gr.components.Component] = {}

    def params(node: ModuleNode) -> None:
        for p in node.params:
            value = values.get(p.key) or ""
            widgets[p.key] = gr.Textbox(
                value=value, label=f"{p.name} · up to {p.length} tokens", lines=1, max_lines=3, interactive=True,
                placeholder=f"default: {p.default}" if p.default is not None else "required",
                info=argument_info(studio, value, p.length, p.default), elem_classes=["pml-param"],
                key=f"{tag}-{p.key}", preserved_by_key=None)

    def visit(node, depth, descend) -> None:
        if isinstance(node, UnionNode):
            choices = [("none", NONE)] + [(m.name, m.path) for m in node.children]
            with gr.Group(elem_classes=["pml-node", "pml-union"]):
                widgets[node.key] = gr.Radio(choices, value=values.get(node.key) or NONE, interactive=True,
                                             label="union: pick at most one", key=f"{tag}-{node.key}",
                                             preserved_by_key=None)
                descend()
        elif node.union:  # a union member: its params and children, under a heading
            if node.params or node.children:
                with gr.Column(elem_classes=["pml-nested"]):
                    gr.HTML(f'<div class="pml-heading">when <b>{node.name}</b> is picked</div>')
                    params(node)
                    descend()
        else:
            with gr.Group(elem_classes=["pml-node"]):
                widgets[node.key] = gr.Checkbox(value=bool(values.get(node.key)), label=node.name, interactive=True,
                                                elem_classes=["pml-module"], key=f"{tag}-{node.key}",
                                                preserved_by_key=None)
                if node.params or node.children:
                    with gr.Column(elem_classes=["pml-nested"]):
                        params(node)
                        descend()

    with gr.Column(elem_classes=["pml-tree"]):
        spec.walk(visit)
    free = gr.Textbox(value=state.text, label="New text (not cached)", lines=4, interactive=True,
                      placeholder="Your question or instruction; it is prefilled at request time.",
                      elem_id="builder-free-text", key=f"{tag}-free", preserved_by_key=None)
    _wire_builder(studio, state, widgets, free, editors, tag)


def spec_tag(spec) -> str:
    """A short name for ``spec``, the same for the same schema structure in this process."""
    return f"{hash(spec) & 0xFFFFFFFF:08x}"


def builder_updates(studio: Studio, spec, keys: list[str], trigger: str | None, prompt_text: str,
                    state: BuilderState | None, *vals) -> list:
    """The prompt, the builder's state and each widget after widget ``trigger`` changed (None: the new-text box).
    The change is applied to the selection the prompt editor holds now, so that text typed there and not yet read
    back into the builder (its blur comes with the click) is kept. A pick (a checkbox or radio) also sets the state,
    so that a redraw for that blur shows the pick; typing in a box leaves the state (a redraw would fight the typing)."""
    shown, free = dict(zip(keys, vals[:-1])), vals[-1]
    params = spec.params()
    # the editor's text from before the last pick (an event sent before the pick's update reached the editor): the
    # pick's selection, or this event would write the old pick back into the editor
    stale = state is not None and state.older(spec, prompt_text)
    found = (state.values, state.text) if stale else selection_from_prompt(spec, prompt_text or "")
    if found is None:  # the editor's text cannot be read: the widgets are the selection
        base, text = shown, free
    else:
        read, text = found
        base = {k: read.get(k) if k not in params or read.get(k) else shown.get(k) for k in keys}  # kept arguments
        if trigger is None:
            text = free
        else:
            base[trigger] = shown.get(trigger)
    values, prompt = apply_change(spec, base, text, trigger)
    picked = trigger is not None and trigger not in params
    updates = []
    for key in keys:
        if key in params:
            p = params[key]
            info = argument_info(studio, values.get(key), p.length, p.default)
            updates.append(gr.update(info=info) if key == trigger or not picked else
                           gr.update(value=values.get(key) or "", info=info))
        else:
            updates.append(values.get(key, NONE if key in spec.unions else False))
    new_state = BuilderState(spec, values, text, (state.nonce if state is not None else 0) + 1,
                             picked_over=prompt_text or "") if picked else gr.skip()
    return [prompt, new_state] + updates


def _wire_builder(studio: Studio, state: BuilderState, widgets: dict, free: gr.Textbox, editors: Editors,
                  tag: str) -> None:
    keys, comps = list(widgets), list(widgets.values())
    inputs, outputs = [editors.prompt, editors.builder] + comps + [free], [editors.prompt, editors.builder] + comps
    for key, comp in [*widgets.items(), (None, free)]:
        # a pick is the user's (.input): a redraw that sets a checkbox must not count as a click; a box keeps
        # .change, since .input misses a paste, a drop and a value set by a script or an autocomplete
        listen = comp.change if isinstance(comp, gr.Textbox) else comp.input
        listen(partial(builder_updates, studio, state.spec, keys, key), inputs, outputs, show_progress="hidden",
               trigger_mode="always_last", api_visibility="private", key=f"{tag}-on-{key}")
