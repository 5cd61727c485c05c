"""Seconds from a request to its 400 for a schema with N unknown attributes, through a served studio's API (the tiny
random model: the answer is the refusal, no model runs), and `pml-studio check` on the same file in-process.

    python bench/error_places.py [--attributes 100000] [--repeats 3]

Issue 60's line: 100,000 attributes answered in <= 1 s (it took 32.5 s with an 11 MB body). JSON last.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time
from contextlib import redirect_stderr
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: a script has only bench/ on its path

from bench.common import spread


def schema_with(attributes: int) -> str:
    return ('<schema name="s"><module name="m" ' + " ".join(f'a{i}="v"' for i in range(attributes))
            + ">x</module></schema>")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attributes", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)

    import httpx

    from engine.cli import main as cli
    from engine.model import SMALL_MODEL
    from engine.model.kernels import cpu_info
    from engine.model.load import load_tokenizer
    from engine.runlog import RunLog
    from engine.session import Engine
    from tests.conftest import make_tiny_llama
    from tests.studio_fixtures import AUTH, served_studio

    schema = schema_with(args.attributes)
    body = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "pml": {"schema": schema, "prompt": '<prompt schema="s"><m/></prompt>'}}
    lm = make_tiny_llama(load_tokenizer(SMALL_MODEL)[1])
    api, status, size = [], None, 0
    with tempfile.TemporaryDirectory() as tmp, served_studio(Engine.from_loaded(lm), RunLog(Path(tmp) / "r.db")) \
            as (_, port):
        for _ in range(args.repeats):
            start = time.perf_counter()
            got = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, headers=AUTH, timeout=600)
            api.append(time.perf_counter() - start)
            status, size = got.status_code, len(got.content)
        path = Path(tmp) / "many.xml"
        path.write_text(schema)
        check = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            with redirect_stderr(io.StringIO()) as said:
                code = cli(["check", str(path)])
            check.append(time.perf_counter() - start)
    result = {"bench": "error_places", "attributes": args.attributes, "api_status": status, "api_body_bytes": size,
              "api_seconds": spread(api, 3, every=False), "check_exit": code,
              "check_lines": len(said.getvalue().splitlines()),
              "check_seconds": spread(check, 3, every=False), "load_average": round(os.getloadavg()[0], 2),
              "cpu": cpu_info("model name") or "unknown"}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
