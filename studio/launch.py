"""Start the studio: build the engine and the run log, build the Blocks, serve on 127.0.0.1.

The tokenizer loads before the page is served, so the first validation answers at once; the weights then load in
the background, so the first Compare finds them loaded.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field

from engine.public import START_MODEL, START_WEIGHTS

from .guard import TOKEN_ENV, TokenError, is_loopback, make_token, page_url
from .hosting import check_address, keep_private, private_temp

# The packaged model on its GGUF weights as the file holds them: fp32's values, faster than int8 (bench/decode.py);
# int4 is faster still but got the travel sample wrong, so it is one flag away.
STUDIO_MODEL, STUDIO_WEIGHTS = START_MODEL, START_WEIGHTS
# Gradio's queue polls every 1 ms and sends progress every 10 ms: ~7 % of a core idle, and during a Compare each
# wake-up takes the GIL from the decoding. 20 ms delays an event by at most 20 ms.
QUEUE_POLL_S, PROGRESS_EVERY_S = 0.02, 0.1


@dataclass(frozen=True)
class StudioOptions:
    """What `pml-studio serve` (and `make run`) serves, as its flags give it."""

    model: str | None = None  # None: the engine's default
    host: str = "127.0.0.1"
    port: int = 7860
    db: str | None = None
    share: bool = False
    results: str | None = None  # the Benchmarks tab's folder
    dtype: str | None = None
    weights: str | None = None
    allow_hosts: tuple[str, ...] = ()
    preload: bool = True  # load the weights in the background once the page is served
    token: str | None = None
    no_token: bool = False
    max_new_tokens_cap: int | None = None
    kv_budget_bytes: int | None = None  # the KV pool's (engine/run/pools.py)
    api: dict = field(default_factory=dict)  # options of the OpenAI-compatible API served on the same port

    @classmethod
    def from_args(cls, args) -> "StudioOptions":
        from engine.config import kv_budget_bytes

        from .api.serve import upstream_options

        return cls(model=args.model, host=args.host, port=args.port, db=args.db, share=args.share,
                   results=args.results, dtype=args.dtype, weights=args.weights, allow_hosts=tuple(args.allow_hosts),
                   token=args.token, no_token=args.no_token, max_new_tokens_cap=args.max_new_tokens_cap,
                   kv_budget_bytes=kv_budget_bytes(args),
                   preload=not args.upstream,  # the page's own runs load the weights when asked
                   api={"default_arm": args.default_arm, "max_queue": args.max_queue,
                        "upstream": upstream_options(args)})


def serve(options: StudioOptions = StudioOptions(), block: bool = True):
    """Launch the studio; return 0 after the server stops (or the running Blocks when ``block`` is False). Only a
    request with the launch token, naming the host, loopback or an allowed host, drives it (studio/guard.py)."""
    from engine.public import check_cache
    from engine.errors import EngineError

    from .connections import Limits

    o = options
    keep_private()
    try:
        token = launch_token(o.host, o.token, o.no_token, o.share)
        connections = Limits.from_env()
        check_cache()  # every folder it loads from the user's own, or one line that says which is not
    except (OSError, ValueError, EngineError) as err:  # TokenError is a ValueError
        print(f"pml-studio: error: {err}", file=sys.stderr)
        return 2
    temp = private_temp()  # before Gradio's import, which reads GRADIO_TEMP_DIR once
    # Only now torch, transformers and gradio (seconds): a refused start says so at once.
    from engine.runlog import RunLog
    from engine.session import Engine

    from .api.serve import check_upstream
    from .api.upstream import UpstreamError
    from .app import build_app, launch_options
    from .streaming import on_engine_thread_soon
    from .shutdown import install as on_stop

    try:
        engine = Engine(model=o.model, dtype=o.dtype, weights=o.weights, kv_budget_bytes=o.kv_budget_bytes)
        engine.store()  # the module store's folder checked now, not at the first encode
        runlog = RunLog(o.db)
        engine.codec  # the tokenizer, before the page can ask for a validation
        if o.api.get("upstream"):
            print(f"PML Studio API: {check_upstream(o.api['upstream'], engine.codec)}", flush=True)
    except (EngineError, UpstreamError) as err:
        print(f"pml-studio: error: {err}", file=sys.stderr)
        return 2
    demo = build_app(engine, runlog, results_dir=o.results, max_new_tokens_cap=o.max_new_tokens_cap, temp=temp)
    _say_loading(engine, runlog, o.preload)
    demo.queue(default_concurrency_limit=1)
    calm_queue(demo)
    if o.preload:
        demo.studio.preload(on_engine_thread_soon)  # the engine thread, where every run's torch work happens
    stop = on_stop(demo) if block else None
    try:
        served = launch_options(demo, token=token, host=o.host, allow_hosts=o.allow_hosts, api=o.api,
                                connections=connections)
        demo.launch(server_name=o.host, server_port=o.port, share=o.share, prevent_thread_lock=True, quiet=True,
                    show_error=False, **served)
    except OSError as err:  # the port is taken (check_address vouched for the address)
        print(f"pml-studio: error: cannot serve on {o.host}:{o.port}: {err}; pick another --port", file=sys.stderr)
        return 2
    _say_open(o.host, o.port, token)
    if not block:
        return demo
    demo.block_thread()
    stop()  # Ctrl-C closed the server
    return 0


def launch_token(host: str, token: str | None, no_token: bool, share: bool = False) -> str | None:
    """``token``, else ``$PML_STUDIO_TOKEN``, else a random one; None for ``no_token``, which a non-loopback ``host``
    or ``share`` refuses (TokenError)."""
    check_address(host)
    if no_token and share:
        raise TokenError("--no-token cannot go with --share: the public link would let anyone on the internet drive "
                         "the studio and run code as you; drop --no-token (the link then needs the token) or --share")
    if no_token and not is_loopback(host):
        raise TokenError(f"--no-token serves only a loopback address, not {host}: anyone who can reach {host} "
                         "could drive the studio and run code as you; drop --no-token")
    return None if no_token else make_token(token or os.environ.get(TOKEN_ENV) or None)


def _say_loading(engine, runlog, preload: bool) -> None:
    print(f"PML Studio: run log {runlog.path}; the model ({engine.config.model}, {engine.config.weights} weights) "
          + ("loads in the background" if preload else "loads on the first encode or compare"), flush=True)
    if runlog.read_only:
        print(f"pml-studio: warning: {runlog.read_only}; History lists its runs, new runs are not logged",
              file=sys.stderr, flush=True)


def _say_open(host: str, port: int, token: str | None) -> None:
    """The URL to open, with the token: printed to this console only (the token's one way out)."""
    print(f"PML Studio: open {page_url(host, port, token)}", flush=True)
    if token is None:
        print("pml-studio: warning: --no-token: every account on this machine can drive the studio and run code "
              "as you", file=sys.stderr, flush=True)


def calm_queue(demo) -> None:
    queue = getattr(demo, "_queue", None)
    if hasattr(queue, "sleep_when_free"):
        queue.sleep_when_free = QUEUE_POLL_S
    if hasattr(queue, "progress_update_sleep_when_free"):
        queue.progress_update_sleep_when_free = PROGRESS_EVERY_S
