"""PML Studio's Gradio UI: ``build_app`` is in studio.app, ``serve`` in studio.launch."""

import os

import engine  # noqa: F401  (its offline settings, before gradio imports huggingface_hub)

# Gradio's usage analytics and version check stay off unless the user turns them on
os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
