"""The ``pml-studio`` console script: the engine's commands plus ``serve`` and ``api``, with the arms' words from
their views. The engine's CLI knows nothing of the studio."""

from __future__ import annotations

import os
import sys

from engine.cli_encode import COMMAND as ENCODE


def serve_arguments(sp, page: bool = True) -> None:
    """The options of ``pml-studio serve`` and ``python app.py`` (``page`` False: those of ``pml-studio api``)."""
    from .api.serve import api_arguments

    from engine.config import COMPUTE_DTYPES, MAX_NEW_TOKENS, Limit
    from engine.public import WEIGHTS, NumberArg

    sp.add_argument("--model", default=None, help="packaged model name, model folder or FILE.gguf (converted once) "
                    "(default: the packaged Qwen2.5-Coder-0.5B-Instruct, qwen2.5-coder-0.5b, which `make setup` "
                    "installs, or $PML_STUDIO_MODEL; --model SmolLM2-135M-Instruct is the small one)")
    sp.add_argument("--dtype", default=None, choices=COMPUTE_DTYPES,
                    help="compute precision (default per device: float32 on CPU, bfloat16 on CUDA; bfloat16 is about "
                         "1.8x faster on a CPU with avx512_bf16, see the README's Measured section)")
    sp.add_argument("--weights", default=None, choices=WEIGHTS,
                    help="how the model's linear weights are kept: fp32 (as loaded), bf16, int8 / int4 weight-only, "
                         "or gguf, the GGUF file's own blocks (faster decoding on a CPU; every arm runs on the same "
                         "weights; default: gguf for the default model, fp32 for any other, as pml-studio run)")
    sp.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    sp.add_argument("--allow-host", action="append", default=[], metavar="NAME", dest="allow_hosts",
                    help="also answer requests for this host name, on any port (a reverse proxy's name; repeatable). "
                         "Requests naming any other host are refused, so other web pages cannot drive the studio")
    sp.add_argument("--token", default=None, help="the launch token that lets a browser or program drive the studio "
                    "(default: $PML_STUDIO_TOKEN, else a random one printed in the URL to open; a token given here "
                    "shows in the process list, the environment variable does not)")
    sp.add_argument("--no-token", action="store_true", help="let every local request in without the token (loopback "
                    "--host only): any account on this machine can then drive the studio and run code as you")
    sp.add_argument("--port", type=NumberArg(Limit("port", 1, 65535, whole=True, example="7860")), default=7860,
                    help="port, 1 to 65535 (default 7860; `pml-studio api`: 8000)")
    sp.add_argument("--db", default=None, help="SQLite run log (default: $PML_STUDIO_CACHE/runs.db)")
    sp.add_argument("--max-new-tokens-cap", default=os.environ.get("PML_STUDIO_MAX_NEW_TOKENS_CAP"), metavar="N",
                    type=NumberArg(Limit("max new tokens cap", 1, MAX_NEW_TOKENS, whole=True, example="2048")),
                    help="the most new tokens one Compare (page or /compare API) may ask for, per arm (default: "
                         "$PML_STUDIO_MAX_NEW_TOKENS_CAP, else 2048); the model's context caps it too")
    api_arguments(sp)
    if not page:
        return
    sp.add_argument("--share", action="store_true", help="also create a public Gradio link (off by default)")
    sp.add_argument("--results", default=None, help="folder of benchmark results the Benchmarks tab shows "
                    "(default: $PML_STUDIO_RESULTS, else bench/results, else the copy installed with the package)")


def serve(args) -> int:
    from .launch import StudioOptions, serve as launch

    return launch(StudioOptions.from_args(args))


def api(args) -> int:
    from .api.serve import command

    return command(args)


def info(args) -> int:
    from engine.cli import cmd_info

    from .kernel_words import info_words

    return cmd_info(args, words=info_words)


def api_arguments(sp) -> None:
    from .api.serve import DEFAULT_PORT

    serve_arguments(sp, page=False)
    sp.set_defaults(port=DEFAULT_PORT)


EXTRA = {**ENCODE,  # `encode SCHEMA` (engine/cli_encode.py)
         "serve": ("launch the studio (same as `python app.py`); the OpenAI-compatible API answers on its port too",
                   serve_arguments, serve),
         "info": ("", None, info),  # the engine's command and options, the studio's handler
         "api": ("serve the OpenAI-compatible API alone, without the studio's page (docs/api.md)", api_arguments,
                 api)}


def main(argv: list[str] | None = None) -> int:
    from engine.cli import main as engine_main

    from .arm_views import WORDS

    return engine_main(argv, EXTRA, WORDS)


if __name__ == "__main__":
    sys.exit(main())
