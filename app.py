"""Launch PML Studio: `python app.py [--model DIR] [--dtype D] [--host 127.0.0.1] [--port 7860] [--db runs.db] [--share]
[--results DIR]` (the options of `pml-studio serve`)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    from studio.cli import serve, serve_arguments

    p = argparse.ArgumentParser(prog="app.py", description="PML Studio: author PML schemas, encode them, and "
                                "compare cached with baseline runs in the browser.")
    serve_arguments(p)
    return serve(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
