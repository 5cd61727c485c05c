"""Prometheus metrics of the API (``GET /metrics``); one registry per app, not prometheus_client's global one,
so two apps in one process do not collide."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
DECODE_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1)
SHARE_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)


class Metrics:
    """The API's instruments, in their own registry."""

    def __init__(self, store_bytes: Callable[[], float] = lambda: 0.0, waiting: Callable[[], float] = lambda: 0.0,
                 engine: Callable[[], object] | None = None):
        """``engine()``: the engine whose scheduler and KV pool the gauges read (vLLM's names where it has one)."""
        r = self.registry = CollectorRegistry()
        self.requests = Counter("pml_api_requests", "API requests answered", ["endpoint", "arm", "mode", "status"],
                                registry=r)
        self.prompt_tokens = Counter("pml_api_prompt_tokens", "prompt tokens of answered requests", ["arm"], registry=r)
        self.cached_tokens = Counter("pml_api_cached_tokens", "prompt tokens whose KV was reused, not recomputed",
                                     ["arm"], registry=r)
        self.completion_tokens = Counter("pml_api_completion_tokens", "tokens generated", ["arm"], registry=r)
        self.modules = Counter("pml_api_modules", "modules of answered requests, by where their KV came from",
                               ["source"], registry=r)
        self.hit_ratio = Histogram("pml_api_cached_share", "each request's cached tokens over its prompt tokens",
                                   ["arm"], buckets=SHARE_BUCKETS, registry=r)
        self.ttft = Histogram("pml_api_ttft_seconds", "server time from a request's start on the engine to its first "
                              "token", ["arm"], buckets=TTFT_BUCKETS, registry=r)
        self.decode = Histogram("pml_api_decode_seconds_per_token", "decode time per generated token", ["arm"],
                                buckets=DECODE_BUCKETS, registry=r)
        self.encode = Counter("pml_api_encode_seconds", "seconds requests spent encoding modules at their first sight "
                              "(inside their TTFT)", ["arm"], registry=r)
        self.uncached = Counter("pml_api_uncached_documents", "text parts that ran as new text instead of cached "
                                "documents, by reason (short: under min_module_chars; no_room: past the context)",
                                ["reason"], registry=r)
        self.progress = Counter("pml_api_progress_comments", "SSE comments sent to streamed requests while their "
                                "modules were encoded", registry=r)
        self.queued = Histogram("pml_api_queue_seconds", "time a request waited for the engine", buckets=TTFT_BUCKETS,
                                registry=r)
        Gauge("pml_api_waiting", "requests waiting for the engine", registry=r).set_function(waiting)
        Gauge("pml_module_store_bytes", "bytes the module store holds in memory", registry=r).set_function(store_bytes)
        if engine is not None:
            self._scheduler_gauges(engine)

    def answered(self, endpoint: str, arm: str, mode: str, usage, pml) -> None:
        """Count one answered request (``usage``: types.Usage, ``pml``: types.PmlInfo)."""
        self.requests.labels(endpoint, arm, mode, "200").inc()
        cached = usage.prompt_tokens_details.cached_tokens
        self.prompt_tokens.labels(arm).inc(usage.prompt_tokens)
        self.cached_tokens.labels(arm).inc(cached)
        self.completion_tokens.labels(arm).inc(usage.completion_tokens)
        self.modules.labels("reused").inc(pml.modules_reused)
        self.modules.labels("encoded").inc(pml.modules_encoded)
        self.hit_ratio.labels(arm).observe(cached / usage.prompt_tokens if usage.prompt_tokens else 0.0)
        self.ttft.labels(arm).observe(pml.ttft_ms / 1000)
        if pml.decode_ms_per_token is not None:
            self.decode.labels(arm).observe(pml.decode_ms_per_token / 1000)
        self.queued.observe(pml.queue_ms / 1000)
        self.encode.labels(arm).inc(pml.encode_ms / 1000)
        for reason, parts in pml.uncached_documents.items():
            self.uncached.labels(reason).inc(parts)

    def _scheduler_gauges(self, engine: Callable[[], object]) -> None:
        def load(field: str) -> Callable[[], float]:
            return lambda: getattr(engine().scheduler.load(), field)

        def pool(share: bool) -> Callable[[], float]:
            def read() -> float:
                e = engine()
                if not e.loaded:
                    return 0.0
                stats = e.pool.stats()
                return stats["used_tokens"] / stats["tokens"] if share else stats["budget_bytes"]
            return read

        r = self.registry
        for name, field, doc in (("pml:num_requests_running", "running", "requests filling or decoding"),
                                 ("pml:num_requests_waiting", "waiting", "requests waiting for the engine or for KV room"),
                                 ("pml:num_sequences_running", "sequences", "runs decoding together"),
                                 ("pml:decode_batch_size", "last_batch", "runs in the last decode step")):
            Gauge(name, doc, registry=r).set_function(load(field))
        Gauge("pml:kv_cache_usage_perc", "share of the KV pool leased (0-1)", registry=r).set_function(pool(True))
        Gauge("pml:kv_cache_budget_bytes", "the KV pool's budget", registry=r).set_function(pool(False))

    def refused(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, "", "", str(status)).inc()

    def exposition(self) -> tuple[bytes, str]:
        """(body, content type) of the scrape."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
