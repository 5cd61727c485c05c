"""tools/vllm_serve.py without vLLM (in `make test`): where vLLM cannot run it says why in one line, a server that
exits or never answers is a ServeError with its last words, and whatever happens the process it started is gone."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tools import vllm_serve
from tools.vllm_serve import ServeError, cannot_run, start, stop


def test_where_vllm_cannot_run_one_line_says_why(monkeypatch, tmp_path):
    assert "make vllm" in cannot_run(str(tmp_path / "missing" / "python"))
    monkeypatch.setattr(vllm_serve, "gpu", lambda: False)
    monkeypatch.setattr(vllm_serve, "avx2", lambda: False)
    assert "AVX2" in cannot_run(sys.executable)
    monkeypatch.setattr(vllm_serve, "avx2", lambda: True)
    monkeypatch.setattr(vllm_serve, "available_gib", lambda: 1.5)
    assert "1.5 GiB is available" in cannot_run(sys.executable)
    monkeypatch.setattr(vllm_serve, "available_gib", lambda: 64.0)
    assert cannot_run(sys.executable) is None


def fake_python(tmp_path, body: str) -> str:
    """An executable standing in for vLLM's python: it runs ``body`` whatever it is asked."""
    exe = tmp_path / "python"
    exe.write_text(f"#!{sys.executable}\n{body}\n")
    exe.chmod(0o755)
    return str(exe)


def test_a_server_that_exits_is_an_error_with_its_last_words(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_serve, "cannot_run", lambda python: None)
    python = fake_python(tmp_path, "import sys; print('RuntimeError: no kernel for this CPU'); sys.exit(3)")
    with pytest.raises(ServeError, match=r"exited \(3\)[^$]*no kernel for this CPU"):
        start(str(tmp_path), 1, python, deadline_s=30)


def test_a_server_that_never_answers_is_stopped_at_the_deadline(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_serve, "cannot_run", lambda python: None)
    pidfile = tmp_path / "pid"
    python = fake_python(tmp_path, f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); "
                                   "time.sleep(600)")
    with pytest.raises(ServeError, match="did not answer"):
        start(str(tmp_path), 1, python, deadline_s=4)  # the stand-in writes its pid within a second
    pid = int(pidfile.read_text())
    with pytest.raises(ProcessLookupError):  # stopped, not left behind
        os.kill(pid, 0)


def test_stop_ends_the_whole_process_group(tmp_path):
    import subprocess
    import time

    child_pid = tmp_path / "child"
    script = (f"import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; "
              f"time.sleep(600)']); open({str(child_pid)!r}, 'w').write(str(c.pid)); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    for _ in range(100):
        if child_pid.exists() and child_pid.read_text():
            break
        time.sleep(0.1)
    stop(proc, grace_s=5)
    child = int(child_pid.read_text())
    for _ in range(50):  # the child is reaped by init once killed
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the engine process vLLM started outlived stop()")
    assert proc.poll() is not None


def test_the_replicas_tool_says_what_is_missing_and_never_retries_past_its_breaker(tmp_path):
    """tools/replicas.py without vLLM: a router not set up or a policy it lacks is one line naming the fix; a request
    to a dead replica is tried more times than the breaker needs to open, so the last try reaches a live one."""
    from tools.replicas import BREAKER, RETRIES, ReplicaError, core_sets, router, router_command

    with pytest.raises(ReplicaError, match="make router"):
        with router((), "round_robin", program=tmp_path / "vllm-router"):
            pass
    with pytest.raises(ReplicaError, match="no router policy 'fastest'"):
        with router((), "fastest", program=Path(sys.executable)):
            pass
    cmd = router_command(Path("vllm-router"), ["http://a", "http://b"], "consistent_hash", 9)
    assert cmd[cmd.index("--retry-max-retries") + 1] == str(RETRIES) and RETRIES > BREAKER
    assert cmd[cmd.index("--cb-failure-threshold") + 1] == str(BREAKER)
    cores = core_sets(2)
    assert len(cores) == 2 and (cores == [(), ()] or len({c for cs in cores for c in cs}) == 2)
