"""PML Studio's Gradio UI. ``build_app(engine, runlog)`` is in studio.app, ``serve(...)`` in studio.launch."""
