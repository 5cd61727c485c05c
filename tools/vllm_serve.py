"""Serve a model the studio knows with vLLM's OpenAI server, prefix caching and prompt-token details on.

The model is the studio's converted folder of a packaged model (``engine.model.packaged``), served under its key;
vLLM runs from its own environment (``make vllm``: .peers/vllm). :func:`start` waits until ``/v1/models`` answers
and returns the process and its base URL (no ``/v1``); the ``__main__`` prints the URL and serves until Ctrl-C.

    python tools/vllm_serve.py                                  # the default model (qwen2.5-coder-0.5b), port 8100
    python tools/vllm_serve.py --model default --port 8101      # the tests' model (SmolLM2-135M)
    make vllm-serve ARGS="--model default"

On a machine with a CUDA GPU the same command serves with upstream vLLM (``make vllm`` installs it there); without
AVX2 or with too little memory it says so in one line instead of starting.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = ROOT / ".peers" / "vllm" / "bin" / "python"
DEFAULT_PORT = 8100
START_DEADLINE_S = 600.0  # 45-51 s measured here on 2 cores at rest, over 5 min under a load of 25 (docs/scale-out.md)
KV_SPACE_GIB = 2  # vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE)
MIN_FREE_GIB = KV_SPACE_GIB + 2  # the KV space, the weights and vLLM itself
BLOCK_TOKENS = 16  # vLLM caches whole blocks of this many tokens


class ServeError(RuntimeError):
    """vLLM could not be started or did not answer; the message says why and what to do."""


def start(model: str, port: int, python: str, dtype: str = "float32", deadline_s: float = START_DEADLINE_S,
          log: Path | None = None, api_key: str | None = None,
          cores: tuple[int, ...] = ()) -> tuple[subprocess.Popen, str]:
    """Start vLLM on ``model`` (a packaged model's key or a model folder) at 127.0.0.1:``port`` with ``python``
    (vLLM's environment); wait for ``/v1/models``; (process, base URL). ServeError, the process stopped, when it
    exits or does not answer by ``deadline_s``. ``api_key``: the key vLLM requires (``VLLM_API_KEY``: not in ``ps``);
    ``cores``: the CPU ids its model's threads are bound to (default: every core)."""
    proc, url = launch(model, port, python, dtype, log, api_key, cores)
    try:
        wait_ready(proc, url, deadline_s, proc.log, api_key)
    except BaseException:
        stop(proc)
        raise
    return proc, url


def launch(model: str, port: int, python: str, dtype: str = "float32", log: Path | None = None,
           api_key: str | None = None, cores: tuple[int, ...] = ()) -> tuple[subprocess.Popen, str]:
    """:func:`start` without the wait (several servers start at once; :func:`wait_ready` each); the process's
    ``log`` attribute is its log file."""
    refusal = cannot_run(python)
    if refusal:
        raise ServeError(refusal)
    folder, name = model_folder(model)
    log = log or Path(tempfile.mkstemp(prefix="vllm-", suffix=".log")[1])
    with open(log, "w") as out:
        proc = subprocess.Popen(command(python, folder, name, port, dtype), stdout=out, stderr=subprocess.STDOUT,
                                env=environment(api_key, cores), start_new_session=True)
    proc.log = log
    return proc, f"http://127.0.0.1:{port}"


def command(python: str, folder: Path, name: str, port: int, dtype: str) -> list[str]:
    # the `vllm` console script fails on the CPU build (its distribution is named vllm-cpu): the module runs
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--served-model-name", name,
            "--port", str(port), "--host", "127.0.0.1", "--dtype", dtype, "--enforce-eager", "--max-model-len", "4096",
            "--enable-prefix-caching", "--enable-prompt-tokens-details"]


def environment(api_key: str | None = None, cores: tuple[int, ...] = ()) -> dict:
    # vLLM's CPU build keeps one core for itself unless told: on 2 cores its model would run on 1 thread where the
    # studio's runs on 2, so the model gets every core, as torch's threads do (set the variables to choose)
    env = {"VLLM_CPU_KVCACHE_SPACE": str(KV_SPACE_GIB), "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", **os.environ}
    if cores:  # replicas side by side: each model's threads on cores of its own (its HTTP threads float)
        env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
    if api_key:
        env["VLLM_API_KEY"] = api_key
    return env


def model_folder(model: str) -> tuple[Path, str]:
    """(folder, served name) of a packaged model's key or a model folder."""
    if Path(model).is_dir():
        return Path(model), Path(model).name
    sys.path.insert(0, str(ROOT))
    from engine.model.packaged import PACKAGED, ensure_packaged

    if model not in PACKAGED:
        raise ServeError(f"no packaged model '{model}'; use one of {', '.join(PACKAGED)} or a model folder")
    return ensure_packaged(model), model


def cannot_run(python: str) -> str | None:
    """One line saying why vLLM cannot run here, or None."""
    if not Path(python).exists():
        return f"vLLM is not set up ({python} is missing): run `make vllm`"
    if not gpu() and not avx2():
        return "vLLM's CPU build needs a CPU with AVX2 and this one has none; point --vllm-url at a vLLM elsewhere"
    free = available_gib()
    if free is not None and free < MIN_FREE_GIB:
        return (f"vLLM needs about {MIN_FREE_GIB} GiB of free memory ({KV_SPACE_GIB} GiB of KV space) and "
                f"{free:.1f} GiB is available; stop something or serve it elsewhere")
    return None


def wait_ready(proc: subprocess.Popen, url: str, deadline_s: float, log: Path, api_key: str | None = None) -> None:
    until = time.monotonic() + deadline_s
    while time.monotonic() < until:
        if proc.poll() is not None:
            raise ServeError(f"vLLM exited ({proc.returncode}) before answering; its last words:\n{tail(log)}")
        if served(url, api_key):
            return
        time.sleep(1)
    raise ServeError(f"vLLM did not answer {url}/v1/models within {deadline_s:.0f} s; its log: {log}\n{tail(log)}")


def served(url: str, api_key: str | None = None) -> list[str]:
    """The model names ``url`` serves ([] when it does not answer, or refuses ``api_key``)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{url}/v1/models", headers=headers), timeout=2) as r:
            return [m["id"] for m in json.load(r)["data"]]
    except (OSError, ValueError, KeyError):
        return []


def stop(proc: subprocess.Popen, grace_s: float = 20) -> None:
    """Stop vLLM and the engine process it started (one process group)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


def tail(log: Path, lines: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def avx2() -> bool:
    try:
        return "avx2" in Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return True  # not Linux: let vLLM say


def gpu() -> bool:
    return Path("/dev/nvidia0").exists()


def available_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="a packaged model's key (engine/model/packaged.py) "
                                                                  "or a transformers folder")
    ap.add_argument("--port", type=int, default=DEFAULT_PORT)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                    help="vLLM's compute dtype (named wherever its agreement is reported)")
    ap.add_argument("--python", default=str(VLLM_PYTHON), help="vLLM's environment's python (make vllm)")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    try:
        proc, url = start(args.model, args.port, args.python, args.dtype)
    except ServeError as e:
        print(f"vllm-serve: {e}", file=sys.stderr)
        return 1
    print(f"vLLM serves {served(url)[0]} at {url} (OpenAI API: {url}/v1), ready in {time.monotonic() - t0:.0f} s; "
          f"Ctrl-C stops it", flush=True)
    try:
        proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        stop(proc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
