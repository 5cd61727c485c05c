"""The ``pml-studio`` console script: the engine's commands plus ``serve`` (launch the studio).

The engine's CLI knows nothing of the studio; this entry point sits above both and adds the
one command that needs the UI.
"""

from __future__ import annotations

import sys


def _serve_arguments(sp) -> None:
    sp.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    sp.add_argument("--port", type=int, default=7860)
    sp.add_argument("--db", default=None, help="SQLite run log (default: under the user's data folder)")
    sp.add_argument("--share", action="store_true", help="create a public Gradio link (off unless asked)")
    sp.add_argument("--model", default=None, help="model folder (default: the packaged SmolLM2-135M)")


def _serve(args) -> int:
    from .launch import serve

    return serve(model=args.model, host=args.host, port=args.port, db=args.db, share=args.share)


EXTRA = {"serve": ("launch the studio (same as `python app.py`)", _serve_arguments, _serve)}


def main(argv: list[str] | None = None) -> int:
    from engine.cli import main as engine_main

    return engine_main(argv, EXTRA)


if __name__ == "__main__":
    sys.exit(main())
