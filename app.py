"""Launch PML Studio: `python app.py [--model DIR] [--dtype D] [--host 127.0.0.1] [--port 7860] [--db runs.db] [--share]
[--results DIR]` (the options of `pml-studio serve`)."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    """The options of `pml-studio serve`, with the CLI's parser (negative numbers are values)."""
    from engine.cli import Parser
    from studio.cli import serve_arguments

    p = Parser(prog="app.py", description="PML Studio: author PML schemas, encode them, and compare cached with "
               "baseline runs in the browser.")
    serve_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    from studio.cli import serve

    return serve(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
