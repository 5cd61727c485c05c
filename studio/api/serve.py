"""Serving the API: beside the studio (:func:`studio_api`) or alone (``pml-studio api``: :func:`serve`, uvicorn
behind the same guard). The launch token is the API key (``Authorization: Bearer KEY``, studio/guard.py).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .defaults import DEFAULT_ARM, DEFAULT_PORT, MAX_QUEUE, MAX_TOKENS_CAP

if TYPE_CHECKING:
    from .service import EngineOf
    from .upstream import UpstreamOptions


@dataclass(frozen=True)
class ServeOptions:
    """What ``pml-studio api`` serves, as its flags give it."""

    model: str | None = None  # None: the engine's default
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    db: str | None = None
    dtype: str | None = None
    weights: str | None = None
    allow_hosts: tuple[str, ...] = ()
    token: str | None = None
    no_token: bool = False
    default_arm: str | None = None
    max_queue: int = MAX_QUEUE
    max_tokens_cap: int = MAX_TOKENS_CAP
    upstream: "UpstreamOptions | None" = None  # a vLLM server: forward to it (studio/api/front.py)
    kv_budget_bytes: int | None = None  # the KV pool's (engine/run/pools.py)

    @classmethod
    def from_args(cls, args) -> ServeOptions:
        from engine import config

        return cls(model=args.model, host=args.host, port=args.port, db=args.db, dtype=args.dtype,
                   weights=args.weights, allow_hosts=tuple(args.allow_hosts), token=args.token,
                   no_token=args.no_token, default_arm=args.default_arm, max_queue=args.max_queue,
                   max_tokens_cap=args.max_new_tokens_cap or MAX_TOKENS_CAP, upstream=upstream_options(args),
                   kv_budget_bytes=config.kv_budget_bytes(args))

    def api(self) -> dict:
        """The options of :class:`~.service.ApiService`."""
        return {"default_arm": self.default_arm, "max_queue": self.max_queue, "max_tokens_cap": self.max_tokens_cap,
                "upstream": self.upstream}


def studio_api(studio, default_arm: str | None = None, max_queue: int = MAX_QUEUE, upstream: str | None = None):
    """The API app over a studio's engine and run log (a run the log refuses waits with the studio's), or, with
    ``upstream``, the front that forwards to that vLLM server."""
    return api_app(lambda: studio.engine, studio.runlog, default_arm=default_arm, max_queue=max_queue,
                   max_tokens_cap=studio.max_new_tokens_cap, record=studio.record, upstream=upstream)


def upstream_options(args) -> "UpstreamOptions | None":
    """``--upstream``, ``--upstream-key`` and ``--upstream-timeout`` as the front's options (None: no upstream)."""
    from .upstream import UpstreamOptions

    if not args.upstream:
        return None
    return UpstreamOptions.of(args.upstream, args.upstream_key, args.upstream_timeout)


def api_app(engine_of: EngineOf, runlog, upstream: "UpstreamOptions | str | None" = None, **options):
    """The FastAPI app around an :class:`~.service.ApiService` made with ``options``, or around a
    :class:`~.front.FrontService` forwarding to ``upstream`` (its URL or options; the engine then lends only its
    tokenizer)."""
    from .metrics import Metrics
    from .routes import create_api

    if upstream:
        from .front import FrontService
        from .upstream import Upstream

        metrics = Metrics(waiting=lambda: service.waiting)
        service = FrontService(engine_of, Upstream(upstream, lambda text: engine_of().codec.encode(text)),
                               metrics=metrics, **options)
        return create_api(service, metrics)
    from .service import ApiService

    metrics = Metrics(store_bytes=lambda: engine_of().store().nbytes(), waiting=lambda: service.waiting,
                      engine=engine_of)
    service = ApiService(engine_of, runlog, metrics=metrics, **options)
    return create_api(service, metrics)


def api_arguments(sp) -> None:
    """The API's options, for ``pml-studio serve`` and ``pml-studio api``."""
    from engine.config import Limit, add_kv_budget_option
    from engine.public import NumberArg

    sp.add_argument("--default-arm", default=None, type=_arm, metavar="ARM",
                    help=f"the arm that answers an API request that names none in pml.arm: baseline, prefix, cached, "
                         f"blend, routed, ... (default: {DEFAULT_ARM}, chosen by bench/serve.py; docs/api.md says why)")
    sp.add_argument("--max-queue", type=NumberArg(Limit("max queue", 1, 4096, whole=True, example="16")),
                    default=MAX_QUEUE, help=f"API requests that may wait for the engine (with --upstream: in flight "
                    f"to it); more are answered 429 (default {MAX_QUEUE})")
    add_kv_budget_option(sp)
    sp.add_argument("--upstream", default=None, metavar="URL",
                    help="forward the API's requests to the vLLM OpenAI server at URL (http://HOST:PORT), rendered "
                         "here to the baseline's token ids with --model's tokenizer, which must be the one it serves; "
                         "the weights are not loaded (docs/api.md, Upstream)")
    sp.add_argument("--upstream-key", default=None, metavar="KEY",
                    help="the upstream's API key (vLLM's --api-key), sent to it as a Bearer token; default "
                         "$PML_UPSTREAM_API_KEY (better: a command line is visible to every account)")
    sp.add_argument("--upstream-timeout", type=NumberArg(Limit("upstream timeout", 1, 86400, example="900")),
                    default=None, metavar="S",
                    help="seconds an upstream's whole answer may take before the request is answered 504 (default "
                         "900; between two of its events: 300)")


def command(args) -> int:
    """``pml-studio api``: the API alone, served by uvicorn until Ctrl-C."""
    return serve(ServeOptions.from_args(args))


def serve(options: ServeOptions) -> int:
    """Serve the API alone behind the launch-token guard; 0 after Ctrl-C, 2 on a start error."""
    import uvicorn

    from engine.public import check_cache
    from engine.errors import EngineError
    from engine.runlog import RunLog
    from engine.session import Engine

    from ..connections import Limits
    from ..guard import TOKEN_ENV, TokenError, is_loopback, make_token
    from ..hosting import check_address, keep_private
    from ..streaming import on_engine_thread_soon
    from .upstream import UpstreamError

    host, port = options.host, options.port
    keep_private()
    try:
        check_address(host)
        limits = Limits.from_env()
        token = None if options.no_token else make_token(options.token or os.environ.get(TOKEN_ENV) or None)
        if options.no_token and not is_loopback(host):
            raise TokenError(f"--no-token serves only a loopback address, not {host}; drop --no-token")
        check_cache()  # every folder it loads from the user's own, or one line that says which is not
        engine = Engine(model=options.model, dtype=options.dtype, weights=options.weights,
                        kv_budget_bytes=options.kv_budget_bytes)
        engine.store()  # the module store's folder checked now, not at the first encode
        runlog = RunLog(options.db)
        engine.codec  # the tokenizer, before the first request
        if options.upstream:
            print(f"PML Studio API: {check_upstream(options.upstream, engine.codec)}", flush=True)
    except (OSError, ValueError, EngineError, UpstreamError) as err:  # TokenError is a ValueError
        print(f"pml-studio: error: {err}", file=sys.stderr)
        return 2
    app = headless_app(engine, runlog, token, host, options.allow_hosts, **options.api())
    if options.upstream:
        print(f"PML Studio API: base URL http://{host}:{port}/v1, a front for {options.upstream.url} (tokenizer of "
              f"{engine.config.model}; its weights are not loaded)", flush=True)
    else:
        on_engine_thread_soon(_preload, engine)
        print(f"PML Studio API: base URL http://{host}:{port}/v1, model {engine.config.model} "
              f"({engine.config.weights} weights), run log {runlog.path}", flush=True)
    print("PML Studio API: " + (f"API key (the launch token): {token}" if token else
                                "--no-token: every account on this machine can use the API"), flush=True)
    server = uvicorn.Server(server_config(app, host, port, limits))
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    return 0


def check_upstream(upstream: "UpstreamOptions | str", codec) -> str:
    """The start's line about the upstream: what it serves, its tokenizer checked against ``codec``'s (within the
    check's deadline: a server that stalls does not keep the front from listening). UpstreamError when it tokenizes
    otherwise; one that does not answer yet is checked again at each request."""
    import asyncio

    from .errors import ApiError
    from .upstream import Upstream, UpstreamError

    front = Upstream(upstream, codec.encode)

    async def check():
        try:
            return await front.ready()
        finally:
            await front.aclose()

    try:
        served = asyncio.run(check())
    except ApiError as err:
        if err.code == "upstream_mismatch":
            raise UpstreamError(err.message) from None
        return f"{err.message}; requests are answered 503 until it does"
    return (f"upstream {front.url} serves '{served.model}' (max_model_len {served.max_model_len}), tokenizer "
            "checked")


def server_config(app, host: str, port: int, limits=None):
    """uvicorn's configuration: slow clients cut off under ``limits`` (studio/connections.py)."""
    import uvicorn

    from ..connections import guarded, quiet_resource_errors, raise_open_files

    raise_open_files()
    quiet_resource_errors()
    return uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off",
                          http=guarded("auto", limits))


def _arm(name: str) -> str:
    """``--default-arm``'s value, checked against the registered arms."""
    import argparse

    from engine.config import values

    if name not in values("arms"):
        raise argparse.ArgumentTypeError(f"unknown arm '{name}'; arms: {', '.join(values('arms'))}")
    return name


def headless_app(engine, runlog, token: str | None, host: str = "127.0.0.1", allow_hosts=(), **options):
    """The launch-token guard, then the API, then OpenAI's 404."""
    from ..guard import LocalGuard, allowed_hosts
    from .errors import ApiError
    from .routes import ApiRoute

    api = api_app(lambda: engine, runlog, **options)
    return LocalGuard(ApiRoute(_not_found(ApiError), api), hosts=allowed_hosts(host), proxied=tuple(allow_hosts),
                      token=token)


def _not_found(error):
    async def app(scope, receive, send):
        from fastapi.responses import JSONResponse

        err = error(404, f"{scope.get('path')}: not found; this server answers /v1/models, /v1/chat/completions, "
                    "/v1/completions and /metrics", code="not_found")
        await JSONResponse(err.body(), 404)(scope, receive, send)
    return app


def _preload(engine) -> None:
    try:
        engine.lm
    except Exception as err:  # noqa: BLE001 (each request then says why, as a 503)
        print(f"pml-studio: the model did not load: {err}", file=sys.stderr, flush=True)
