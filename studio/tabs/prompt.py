"""Prompt tab: the builder generated from the schema (studio/builder.py), the PML prompt, its token view."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import gradio as gr

from engine.errors import EngineError

from ..builder import NONE, BuilderState, ModuleNode, UnionNode, apply_change, param_info
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
                render_builder(studio, state, editors.prompt)

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


def render_builder(studio: Studio, state: BuilderState | None, prompt_code: gr.Code) -> None:
    if not state:
        gr.Markdown("_The builder appears once the schema is valid._", elem_classes=["pml-note"])
        return
    spec, values = state.spec, state.values
    widgets: dict[str, gr.components.Component] = {}

    def params(node: ModuleNode) -> None:
        for p in node.params:
            value = values.get(p.key) or ""
            widgets[p.key] = gr.Textbox(
                value=value, label=f"{p.name} · up to {p.length} tokens", lines=1, max_lines=3, interactive=True,
                placeholder=f"default: {p.default}" if p.default is not None else "required",
                info=argument_info(studio, value, p.length, p.default), elem_classes=["pml-param"])

    def visit(node, depth, descend) -> None:
        if isinstance(node, UnionNode):
            choices = [("none", NONE)] + [(m.name, m.path) for m in node.children]
            with gr.Group(elem_classes=["pml-node", "pml-union"]):
                widgets[node.key] = gr.Radio(choices, value=values.get(node.key) or NONE, interactive=True,
                                             label="union: pick at most one")
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
                                                elem_classes=["pml-module"])
                if node.params or node.children:
                    with gr.Column(elem_classes=["pml-nested"]):
                        params(node)
                        descend()

    with gr.Column(elem_classes=["pml-tree"]):
        spec.walk(visit)
    free = gr.Textbox(value=state.text, label="New text (not cached)", lines=4, interactive=True,
                      placeholder="Your question or instruction; it is prefilled at request time.",
                      elem_id="builder-free-text")
    _wire_builder(studio, state, widgets, free, prompt_code)


def builder_updates(studio: Studio, state: BuilderState, keys: list[str], trigger: str | None, *vals) -> list:
    spec = state.spec
    values, text = apply_change(spec, dict(zip(keys, vals[:-1])), vals[-1], trigger)
    params = spec.params()
    updates = []
    for key in keys:
        if key in params:
            p = params[key]
            updates.append(gr.update(info=argument_info(studio, values.get(key), p.length, p.default)))
        else:
            updates.append(values.get(key, NONE if key in spec.unions else False))
    return [text] + updates


def _wire_builder(studio: Studio, state: BuilderState, widgets: dict, free: gr.Textbox, prompt_code: gr.Code) -> None:
    keys, comps = list(widgets), list(widgets.values())
    inputs, outputs = comps + [free], [prompt_code] + comps
    # .change, not .input: .input misses a paste, a drop and a value set by a script or an autocomplete
    for key, comp in [*widgets.items(), (None, free)]:
        comp.change(partial(builder_updates, studio, state, keys, key), inputs, outputs, show_progress="hidden",
                    trigger_mode="always_last", api_visibility="private")
