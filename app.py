"""Launch PML Studio: `python app.py [--model DIR] [--host 127.0.0.1] [--port 7860] [--db runs.db] [--share]`."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="app.py", description="PML Studio: author PML schemas, encode them, and "
                                "compare cached with baseline runs in the browser.")
    p.add_argument("--model", default=None, help="local model folder (default: the packaged SmolLM2-135M)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=7860, help="port (default 7860)")
    p.add_argument("--db", default=None, help="SQLite run log (default: $PML_STUDIO_CACHE/runs.db)")
    p.add_argument("--share", action="store_true", help="also create a public Gradio link (off by default)")
    args = p.parse_args(argv)

    from studio.launch import serve

    return serve(model=args.model, host=args.host, port=args.port, db=args.db, share=args.share)


if __name__ == "__main__":
    sys.exit(main())
