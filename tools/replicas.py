"""Several servers behind vLLM's router (``vllm-router``, ``make router``): N vLLM replicas of a model the studio
knows, or N ``pml-studio api`` workers sharing one module store, and the router over them; started, waited for,
their URLs printed, and all stopped however this ends (Ctrl-C included). docs/scale-out.md says what was tested.

    python tools/replicas.py --replicas 2 --policy consistent_hash     # 2 vLLM replicas of the tests' model
    python tools/replicas.py --studio --replicas 2                     # 2 studio workers on one module store
    make replicas ARGS="--replicas 2 --policy round_robin"

Each vLLM replica's model threads are bound to a core of its own while there are enough (``VLLM_CPU_OMP_THREADS_BIND``;
its HTTP threads float), else they share them all. Put the PML front before the router (``pml-studio api --upstream
ROUTER``) and ``consistent_hash`` keeps each document set on one replica by the front's ``X-Session-ID``.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run as a script, tools/ alone is on the path

from tools.screenshot import free_port  # noqa: E402
from tools.vllm_serve import START_DEADLINE_S, VLLM_PYTHON, ServeError, launch, stop, tail, wait_ready  # noqa: E402

ROUTER = ROOT / ".peers" / "router" / "bin" / "vllm-router"
ROUTER_VERSION = "0.1.17"  # make router pins it: another project publishes a package of the same name
POLICIES = ("consistent_hash", "round_robin", "cache_aware", "power_of_two", "random")
STUDIO_MODEL = "SmolLM2-135M-Instruct"  # the tests' model, as `pml-studio api --model` names it
# The router retries a request only while no byte of its answer has been sent (a refused connection, a 5xx or 429
# before the stream), never a stream that broke: so no answer is sent twice. Its circuit breaker opens after
# BREAKER failures in a row; RETRIES attempts in all let a request to a dead replica open it and then be answered
# by another (consistent_hash picks the same dead replica until then).
BREAKER = 3
RETRIES = BREAKER + 1
HEALTH_EVERY_S = 5  # the router's health checks of its workers (a worker found dead leaves the ring)


class ReplicaError(RuntimeError):
    """The fleet could not be started; the message says why and what to do."""


@dataclass(frozen=True)
class Worker:
    """One server behind the router."""

    url: str
    proc: subprocess.Popen
    log: Path
    cores: tuple[int, ...] = ()  # where its model's threads run; () all


@dataclass(frozen=True)
class Fleet:
    """The router's base URL (no ``/v1``) and the workers behind it."""

    url: str
    workers: tuple[Worker, ...]
    policy: str
    router: subprocess.Popen
    router_log: Path


@contextmanager
def vllm_fleet(n: int, policy: str, model: str = "default", python: str = str(VLLM_PYTHON), dtype: str = "float32",
               api_key: str | None = None, deadline_s: float = START_DEADLINE_S) -> Iterator[Fleet]:
    """``n`` vLLM replicas (:func:`vllm_replicas`) and the router over them; every process stopped on leaving,
    however it is left. ``api_key``: the key each replica requires (the router passes the client's
    ``Authorization`` on)."""
    with vllm_replicas(n, model, python, dtype, api_key, deadline_s) as workers:
        with router(workers, policy, deadline_s) as fleet:
            yield fleet


@contextmanager
def vllm_replicas(n: int, model: str = "default", python: str = str(VLLM_PYTHON), dtype: str = "float32",
                  api_key: str | None = None, deadline_s: float = START_DEADLINE_S) -> Iterator[tuple[Worker, ...]]:
    """``n`` vLLM replicas of ``model`` started at once (one core each where there are ``n``), yielded once each
    answers; every one stopped on leaving."""
    with ExitStack() as stack:
        workers = []
        for cores in core_sets(n):
            proc, url = launch(model, free_port(), python, dtype, api_key=api_key, cores=cores)
            stack.callback(stop, proc)
            workers.append(Worker(url, proc, proc.log, cores))
        until = time.monotonic() + deadline_s
        for w in workers:
            wait_ready(w.proc, w.url, max(1.0, until - time.monotonic()), w.log, api_key)
        yield tuple(workers)


@contextmanager
def studio_fleet(n: int, policy: str, store: Path, token: str, model: str = STUDIO_MODEL,
                 deadline_s: float = 300.0, extra: tuple[str, ...] = ()) -> Iterator[Fleet]:
    """``n`` ``pml-studio api`` workers (:func:`studio_workers`) and the router over them; all stopped on leaving."""
    with studio_workers(n, store, token, model, deadline_s, extra) as workers:
        with router(workers, policy, deadline_s) as fleet:
            yield fleet


@contextmanager
def studio_workers(n: int, store: Path, token: str, model: str = STUDIO_MODEL, deadline_s: float = 300.0,
                   extra: tuple[str, ...] = ()) -> Iterator[tuple[Worker, ...]]:
    """``n`` ``pml-studio api`` workers of ``model`` on one module store folder (``store``; a run log each),
    serving ``token``, each on a core of its own where there are ``n``; yielded once each has its model loaded
    (``/health``), every one stopped on leaving, however it is left."""
    with ExitStack() as stack:
        workers = []
        for i, cores in enumerate(core_sets(n)):
            port, log = free_port(), _log(f"studio-{i}-")
            env = {**os.environ, "PML_STUDIO_MODULES": str(store), "PML_STUDIO_TOKEN": token}
            if cores:  # torch's threads, one per core it has: more would spin against the other worker's
                env["OMP_NUM_THREADS"] = str(len(cores))
            cmd = [sys.executable, "-m", "studio.cli", "api", "--model", model, "--port", str(port),
                   "--db", str(store.parent / f"runs-{port}.db"), *extra]
            with open(log, "w") as out:
                proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                        start_new_session=True, preexec_fn=_bind(cores))
            stack.callback(stop, proc)
            workers.append(Worker(f"http://127.0.0.1:{port}", proc, log, cores))
        until = time.monotonic() + deadline_s
        for w in workers:
            _wait_healthy(w.proc, w.url, until, w.log, "the studio worker")
        yield tuple(workers)


@contextmanager
def router(workers: tuple[Worker, ...], policy: str, deadline_s: float = 120.0,
           program: Path = ROUTER) -> Iterator[Fleet]:
    """vllm-router over ``workers`` (each healthy already) with ``policy``, on a free port; stopped on leaving."""
    if not program.exists():
        raise ReplicaError(f"vllm-router is not set up ({program} is missing): run `make router`")
    if policy not in POLICIES:
        raise ReplicaError(f"no router policy '{policy}'; use one of {', '.join(POLICIES)}")
    port, log = free_port(), _log("router-")
    with open(log, "w") as out:
        proc = subprocess.Popen(router_command(program, [w.url for w in workers], policy, port), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(proc, url, time.monotonic() + deadline_s, log, "vllm-router")
        yield Fleet(url, workers, policy, proc, log)
    finally:
        stop(proc)


def router_command(program: Path, urls: list[str], policy: str, port: int) -> list[str]:
    """The router's command line: its workers, policy and port; retries and breaker as :data:`RETRIES` says."""
    return [str(program), "--worker-urls", *urls, "--policy", policy, "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-port", str(free_port()), "--worker-startup-check-interval", "1",
            "--retry-max-retries", str(RETRIES), "--cb-failure-threshold", str(BREAKER),
            "--health-check-interval-secs", str(HEALTH_EVERY_S), "--log-level", "warning"]


def core_sets(n: int) -> list[tuple[int, ...]]:
    """The cores each of ``n`` replicas' model threads are bound to: one each while this process may use ``n``
    or more, else none (every replica shares every core)."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return [(cores[i],) for i in range(n)] if len(cores) >= n else [() for _ in range(n)]


def prompt_tokens(workers: tuple[Worker, ...]) -> list[float]:
    """Each vLLM replica's prompt tokens so far (``vllm:prompt_tokens_total`` of its /metrics, which needs no key;
    -1 for one that does not answer): where a router sent the work."""
    counts = []
    for w in workers:
        try:
            with urllib.request.urlopen(f"{w.url}/metrics", timeout=30) as r:
                text = r.read().decode()
        except OSError:
            counts.append(-1.0)
            continue
        counts.append(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                          if line.startswith("vllm:prompt_tokens_total")))
    return counts


def kill(worker: Worker) -> None:
    """End ``worker`` at once, as a crash would (its whole process group): for checks of what a router does then."""
    try:
        os.killpg(worker.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    worker.proc.wait()


def _wait_healthy(proc: subprocess.Popen, url: str, until: float, log: Path, what: str) -> None:
    while time.monotonic() < until:
        if proc.poll() is not None:
            raise ReplicaError(f"{what} at {url} exited ({proc.returncode}) before answering; its last words:\n"
                               f"{tail(log)}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (OSError, urllib.error.HTTPError):
            pass
        time.sleep(0.5)
    raise ReplicaError(f"{what} at {url} was not healthy in time; its log: {log}\n{tail(log)}")


def _bind(cores: tuple[int, ...]):
    """What a child runs before its program: kept on ``cores`` (None: anywhere)."""
    return (lambda: os.sched_setaffinity(0, cores)) if cores else None


def _log(prefix: str) -> Path:
    return Path(tempfile.mkstemp(prefix=prefix, suffix=".log")[1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", type=int, default=2, help="how many servers behind the router (default 2)")
    ap.add_argument("--policy", default="consistent_hash", choices=POLICIES, help="the router's policy")
    ap.add_argument("--model", default=None, help="vLLM: a packaged model's key (default: the tests' model); "
                                                  f"--studio: the studio's model name (default {STUDIO_MODEL})")
    ap.add_argument("--studio", action="store_true", help="pml-studio api workers on one module store, not vLLM")
    ap.add_argument("--store", default=None, help="--studio: the shared module store folder (default: a new one)")
    args = ap.parse_args(argv)
    if args.replicas < 1:
        print("replicas: --replicas takes 1 or more", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops them all as Ctrl-C does
    try:
        with ExitStack() as stack:
            fleet = stack.enter_context(_fleet(args))
            print(f"router ({fleet.policy}) at {fleet.url} (OpenAI API: {fleet.url}/v1) over "
                  + ", ".join(w.url + (f" (core {','.join(map(str, w.cores))})" if w.cores else "")
                              for w in fleet.workers) + "; Ctrl-C stops them all", flush=True)
            _serve(fleet)
    except (ServeError, ReplicaError) as e:
        print(f"replicas: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    return 0


@contextmanager
def _fleet(args) -> Iterator[Fleet]:
    if not args.studio:
        with vllm_fleet(args.replicas, args.policy, args.model or "default", api_key=os.environ.get("VLLM_API_KEY")) \
                as fleet:
            yield fleet
        return
    from studio.guard import TOKEN_ENV, make_token

    store = Path(args.store) if args.store else Path(tempfile.mkdtemp(prefix="pml-store-")) / "modules"
    token = make_token(os.environ.get(TOKEN_ENV) or None)
    print(f"studio workers: module store {store}; API key (the launch token): {token}", flush=True)
    with studio_fleet(args.replicas, args.policy, store, token, args.model or STUDIO_MODEL) as fleet:
        yield fleet


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _serve(fleet: Fleet) -> None:
    """Until Ctrl-C, or a process behind it ends (then say which)."""
    while True:
        for proc, what in [(fleet.router, "the router"), *((w.proc, w.url) for w in fleet.workers)]:
            if proc.poll() is not None:
                raise ReplicaError(f"{what} exited ({proc.returncode}); stopping the others")
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())
