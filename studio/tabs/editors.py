"""The documents every tab reads or writes: the schema and prompt editors and the builder's state, made before
the tabs (``render=False``) so any tab can target them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import gradio as gr

from ..builder import BuilderSpec, BuilderState, next_state


class Step(NamedTuple):
    fn: Callable
    inputs: list
    outputs: list


@dataclass(frozen=True)
class Editors:
    schema: gr.Code
    prompt: gr.Code
    spec: gr.State  # builder spec of the last valid schema
    builder: gr.State  # BuilderState
    schema_ok: gr.State  # enables Encode and Compare

    @property
    def sync(self) -> Step:
        return Step(sync_builder, [self.spec, self.prompt, self.builder], [self.builder])


def create(schema_text: str, prompt_text: str) -> Editors:
    schema = gr.Code(schema_text, language="html", label="Schema (PML)", lines=26, wrap_lines=True, max_lines=40,
                     interactive=True, elem_id="schema-editor", render=False)
    prompt = gr.Code(prompt_text, language="html", label="Prompt (PML)", lines=10, wrap_lines=True, max_lines=24,
                     interactive=True, elem_id="prompt-editor", render=False)
    return Editors(schema, prompt, gr.State(None), gr.State(None), gr.State(False))


def sync_builder(spec: BuilderSpec | None, prompt_text: str, prev: BuilderState | None):
    state = next_state(spec, prompt_text or "", prev)
    return gr.skip() if state is None else state
